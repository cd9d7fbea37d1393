//! Training samples from indexed datasets, as Megatron's GPT dataset makes
//! them (`megatron/core/datasets/gpt_dataset.py`), and weighted blends of
//! several datasets (`blended_dataset.py`).
//!
//! - [`Split`]: `969,30,1` cuts a dataset's documents into
//!   train, validation and test parts by Megatron's rounding rule.
//! - [`GptPart`]: one part's documents, in an order shuffled per epoch with
//!   the seed, concatenated across document boundaries and cut into
//!   samples of `seq + 1` tokens that start every `seq`
//!   tokens (consecutive samples share one token: the last target of one
//!   is the first input of the next). The samples of an epoch are shuffled
//!   too. A partial sample at an epoch's end is dropped.
//! - [`Blend`]: samples of several parts in the proportions of their
//!   weights, by Megatron's greedy rule (each sample goes to the dataset
//!   furthest behind its share).
//!
//! Sample `g` of a part is a pure function of (seed, part, `g`): epoch
//! `g / samples_per_epoch`, and within it position `g % samples_per_epoch`
//! of that epoch's shuffled samples. Nothing depends on which samples were
//! read before, so a resumed run reads exactly the samples an uninterrupted
//! one would. Epoch indices are built when first needed and the newest few
//! are kept.

use super::indexed::IndexedDataset;
use super::{Xoshiro256, mix64};
use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The names of the three parts of a split, in order.
pub const PART_NAMES: [&str; 3] = ["train", "validation", "test"];

/// The relative sizes of the train, validation and test parts of indexed
/// data ([`Setting::Split`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    weights: [f64; 3],
    text: String,
}

impl Default for Split {
    /// Megatron's default, `969,30,1`.
    fn default() -> Self {
        Split {
            weights: [969.0, 30.0, 1.0],
            text: "969,30,1".into(),
        }
    }
}

impl Split {
    /// Parses `969,30,1` (Megatron also takes `/` between the numbers;
    /// missing trailing parts are 0); a refusal names the setting as
    /// `spelling` spells it.
    pub fn parse(text: &str, spelling: SettingSpelling) -> std::result::Result<Self, String> {
        let bad = |why: String| {
            Err(format!(
                "{}: {why}; give up to three sizes of the train, validation and \
                 test parts, e.g. 969,30,1 or 90,10,0",
                spelling.given(Setting::Split, text)
            ))
        };
        let pieces: Vec<&str> = text.split([',', '/']).map(str::trim).collect();
        if pieces.len() > 3 {
            return bad(format!("{} numbers", pieces.len()));
        }
        let mut weights = [0.0; 3];
        for (w, piece) in weights.iter_mut().zip(&pieces) {
            match piece.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => *w = v,
                _ => return bad(format!("`{piece}` is not a size of 0 or more")),
            }
        }
        if weights.iter().sum::<f64>() <= 0.0 {
            return bad("the sizes add up to 0".into());
        }
        Ok(Split {
            weights,
            text: text.trim().to_string(),
        })
    }

    pub fn weights(&self) -> [f64; 3] {
        self.weights
    }

    /// The split as given.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The document ranges of the three parts of `documents` documents,
    /// by Megatron's `get_split_indices`: each part's share of the count
    /// rounded (half to even, as Python's `round`), the rounding error
    /// taken off every boundary after the first.
    pub fn ranges(&self, documents: usize) -> [Range<usize>; 3] {
        let total: f64 = self.weights.iter().sum();
        let mut bounds = [0i64; 4];
        for (i, w) in self.weights.iter().enumerate() {
            bounds[i + 1] = bounds[i] + (w / total * documents as f64).round_ties_even() as i64;
        }
        let diff = bounds[3] - documents as i64;
        for b in &mut bounds[1..] {
            *b -= diff;
        }
        let at = |i: usize| bounds[i].clamp(0, documents as i64) as usize;
        [at(0)..at(1), at(1)..at(2), at(2)..at(3)]
    }
}

/// A shuffled `0..n` (Fisher-Yates from the top, xoshiro256** seeded with
/// `seed`).
pub fn permutation(n: usize, seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n as u32).collect();
    let mut rng = Xoshiro256::seed_from_u64(seed);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// One epoch of a part: its documents' order, where each starts in the
/// concatenation, and the order of its samples.
#[derive(Debug)]
struct EpochIndex {
    epoch: u64,
    /// Sequence ids of the dataset, shuffled.
    order: Vec<u32>,
    /// `starts[k]`: the first token of `order[k]` in the concatenation;
    /// one more entry holds the total.
    starts: Vec<u64>,
    /// Sample ids of the epoch, shuffled.
    samples: Vec<u32>,
}

/// Epoch indices kept per part: ranks read the same epoch, and at most the
/// next one, at a time.
const EPOCHS_KEPT: usize = 2;

/// One part (train, validation or test) of one dataset, cut into samples.
#[derive(Debug)]
pub struct GptPart {
    dataset: Arc<IndexedDataset>,
    part: usize,
    documents: Range<usize>,
    seed: u64,
    /// Tokens between the starts of consecutive samples (the sequence
    /// length); a sample is one more (its last target).
    stride: usize,
    tokens: u64,
    samples_per_epoch: u64,
    epochs: Mutex<Vec<Arc<EpochIndex>>>,
}

impl GptPart {
    /// Part `part` (an index into [`PART_NAMES`]) of `dataset`: the
    /// documents `documents`, samples of `stride + 1` tokens every
    /// `stride`. Refusals name the settings as `spelling` spells them.
    pub fn new(
        dataset: Arc<IndexedDataset>,
        part: usize,
        documents: Range<usize>,
        seed: u64,
        stride: usize,
        spelling: SettingSpelling,
    ) -> Result<Self> {
        let name = || format!("{} ({} part)", dataset.idx_name(), PART_NAMES[part]);
        let seq_len = spelling.name(Setting::SeqLength);
        if stride == 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: samples need a sequence length above 0; give {seq_len} 1 or more",
                name()
            )));
        }
        let window = stride + 1;
        // The epoch index stores document numbers in u32.
        if documents.end > u32::MAX as usize {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: documents up to number {} are more than this reader indexes ({}); split \
                 the corpus into several datasets and blend them",
                name(),
                documents.end,
                u32::MAX
            )));
        }
        let tokens: u64 = documents
            .clone()
            .map(|i| dataset.sequence_length(i) as u64)
            .sum();
        if tokens < window as u64 {
            return Err(RuntimeError::io(
                name(),
                format!(
                    "its {} documents hold {tokens} tokens, but one sample needs {window} \
                     (sequence length {stride} + 1 target); use more data, a larger share of \
                     it for this part ({}), or a shorter sequence ({seq_len})",
                    documents.len(),
                    spelling.name(Setting::Split),
                ),
            ));
        }
        let samples_per_epoch = (tokens - 1) / stride as u64;
        if samples_per_epoch > u64::from(u32::MAX) {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: {samples_per_epoch} samples per epoch are more than this reader indexes; \
                 split the corpus into several datasets and blend them",
                name()
            )));
        }
        Ok(GptPart {
            dataset,
            part,
            documents,
            seed,
            stride,
            tokens,
            samples_per_epoch,
            epochs: Mutex::new(Vec::new()),
        })
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn documents(&self) -> Range<usize> {
        self.documents.clone()
    }

    pub fn samples_per_epoch(&self) -> u64 {
        self.samples_per_epoch
    }

    /// Tokens per sample.
    pub fn window(&self) -> usize {
        self.stride + 1
    }

    /// The seed of one of an epoch's shuffles (`what`: documents or
    /// samples).
    fn shuffle_seed(&self, epoch: u64, what: u64) -> u64 {
        let mut h = mix64(self.seed ^ 0x0067_7074_6461_7461); // "gptdata"
        for part in [self.part as u64, epoch, what] {
            h = mix64(h.wrapping_add(0x9E37_79B9_7F4A_7C15) ^ part);
        }
        h
    }

    /// The order of documents in `epoch`, as sequence ids of the dataset.
    pub fn document_order(&self, epoch: u64) -> Vec<u32> {
        let start = self.documents.start as u32;
        permutation(self.documents.len(), self.shuffle_seed(epoch, 0))
            .into_iter()
            .map(|k| start + k)
            .collect()
    }

    fn build_epoch(&self, epoch: u64) -> EpochIndex {
        let order = self.document_order(epoch);
        let mut starts = Vec::with_capacity(order.len() + 1);
        let mut at = 0u64;
        for &doc in &order {
            starts.push(at);
            at += self.dataset.sequence_length(doc as usize) as u64;
        }
        starts.push(at);
        let samples = permutation(self.samples_per_epoch as usize, self.shuffle_seed(epoch, 1));
        EpochIndex {
            epoch,
            order,
            starts,
            samples,
        }
    }

    fn epoch(&self, epoch: u64) -> Arc<EpochIndex> {
        // A poisoned lock only means another rank panicked: the cache
        // itself is always whole. Built under the lock: the thread ranks of
        // a process ask for the same epoch at the same time, and one build
        // serves them all (they never want an epoch the others do not).
        let mut epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = epochs.iter().find(|e| e.epoch == epoch) {
            return found.clone();
        }
        let built = Arc::new(self.build_epoch(epoch));
        if epochs.len() >= EPOCHS_KEPT {
            epochs.remove(0);
        }
        epochs.push(built.clone());
        built
    }

    /// Fills `out` (`window` tokens) with sample `g` of the part.
    pub fn sample(&self, g: u64, out: &mut [u32]) -> Result<()> {
        if out.len() != self.window() {
            return Err(RuntimeError::InvalidArgument(format!(
                "a sample of {} is {} tokens, not {}",
                self.dataset.idx_name(),
                self.window(),
                out.len()
            )));
        }
        let index = self.epoch(g / self.samples_per_epoch);
        let sample = u64::from(index.samples[(g % self.samples_per_epoch) as usize]);
        let start = sample * self.stride as u64;
        // The document holding the sample's first token.
        let mut k = index.starts.partition_point(|&s| s <= start) - 1;
        let mut offset = (start - index.starts[k]) as usize;
        let mut filled = 0;
        while filled < out.len() {
            let doc = index.order[k] as usize;
            let take = (self.dataset.sequence_length(doc) - offset).min(out.len() - filled);
            self.dataset
                .read(doc, offset, &mut out[filled..filled + take])?;
            filled += take;
            k += 1;
            offset = 0;
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        format!(
            "{}: {} documents, {} tokens",
            PART_NAMES[self.part],
            self.documents.len(),
            self.tokens
        )
    }
}

/// Samples of several parts in the proportions of their weights.
#[derive(Debug)]
pub struct Blend {
    parts: Vec<GptPart>,
    /// Normalised weights.
    weights: Vec<f64>,
    index: Mutex<BlendIndex>,
}

/// Megatron's blending index, extended as samples are asked for (its
/// prefix never changes, so extending is the same as building it whole).
#[derive(Debug, Default)]
struct BlendIndex {
    /// Per blended sample: the part it comes from, and its sample there.
    part: Vec<u16>,
    sample: Vec<u64>,
    /// Samples given to each part so far.
    counts: Vec<u64>,
}

/// Blend indices are extended this many samples at a time.
const BLEND_CHUNK: u64 = 4096;

impl Blend {
    /// `parts` with `weights` (finite, above 0; normalised here).
    pub fn new(parts: Vec<GptPart>, weights: Vec<f64>) -> Result<Self> {
        let total: f64 = weights.iter().sum();
        if parts.is_empty()
            || parts.len() != weights.len()
            || parts.len() > usize::from(u16::MAX)
            || !weights.iter().all(|w| w.is_finite() && *w > 0.0)
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "a blend needs 1 to {} datasets with finite weights above 0 (got {} datasets, \
                 weights {weights:?})",
                u16::MAX,
                parts.len()
            )));
        }
        let weights: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let index = BlendIndex {
            counts: vec![0; parts.len()],
            ..BlendIndex::default()
        };
        Ok(Blend {
            parts,
            weights,
            index: Mutex::new(index),
        })
    }

    pub fn parts(&self) -> &[GptPart] {
        &self.parts
    }

    /// Which part blended sample `g` comes from, and its sample there.
    pub fn locate(&self, g: u64) -> (usize, u64) {
        if self.parts.len() == 1 {
            return (0, g);
        }
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        while index.part.len() as u64 <= g {
            let until = (g / BLEND_CHUNK + 1) * BLEND_CHUNK;
            for i in index.part.len() as u64..until {
                // Megatron's build_blending_indices: the part furthest
                // behind its share of the samples so far (the first on
                // ties) takes the next one.
                let at = (i as f64).max(1.0);
                let mut best = 0;
                let mut best_error = self.weights[0] * at - index.counts[0] as f64;
                for (d, w) in self.weights.iter().enumerate().skip(1) {
                    let error = w * at - index.counts[d] as f64;
                    if error > best_error {
                        best = d;
                        best_error = error;
                    }
                }
                let taken = index.counts[best];
                index.part.push(best as u16);
                index.sample.push(taken);
                index.counts[best] += 1;
            }
        }
        (
            usize::from(index.part[g as usize]),
            index.sample[g as usize],
        )
    }

    /// Fills `out` with blended sample `g`.
    pub fn sample(&self, g: u64, out: &mut [u32]) -> Result<()> {
        let (part, sample) = self.locate(g);
        self.parts[part].sample(sample, out)
    }
}

/// Megatron indexed datasets ([`Setting::DataPath`]): one dataset, or
/// several with weights.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexedSpec {
    /// (weight, prefix) per dataset; weights are relative.
    pub blend: Vec<(f64, PathBuf)>,
    pub split: Split,
}

impl IndexedSpec {
    /// Parses the datasets as Megatron's `data_path` takes them: `PREFIX`,
    /// or `WEIGHT PREFIX` pairs (`0.3 A 0.7 B`); a refusal names the
    /// setting as `spelling` spells it.
    pub fn parse(
        words: &[String],
        split: Split,
        spelling: SettingSpelling,
    ) -> std::result::Result<Self, String> {
        let data_path = spelling.name(Setting::DataPath);
        let usage = format!(
            "give one PREFIX (of PREFIX.idx and PREFIX.bin), or WEIGHT PREFIX pairs \
             such as `{}`",
            spelling.given(Setting::DataPath, "0.3 A 0.7 B")
        );
        let blend = match words {
            [] => return Err(format!("{data_path} is empty: {usage}")),
            [prefix] => vec![(1.0, PathBuf::from(prefix))],
            _ if words.len() % 2 == 1 => {
                return Err(format!(
                    "{data_path} has {} values, an odd number, so they are not WEIGHT PREFIX \
                     pairs: {usage}",
                    words.len()
                ));
            }
            _ => words
                .chunks_exact(2)
                .map(|pair| match pair[0].trim().parse::<f64>() {
                    Ok(w) if w.is_finite() && w > 0.0 => Ok((w, PathBuf::from(&pair[1]))),
                    _ => Err(format!(
                        "{data_path}: `{}` (before {}) is not a weight above 0: {usage}",
                        pair[0], pair[1]
                    )),
                })
                .collect::<std::result::Result<_, _>>()?,
        };
        if let Some((_, empty)) = blend.iter().find(|(_, p)| p.as_os_str().is_empty()) {
            return Err(format!(
                "{data_path} has an empty prefix ({}): {usage}",
                empty.display()
            ));
        }
        Ok(IndexedSpec { blend, split })
    }

    /// The datasets as a user would write them (`0.3 A 0.7 B`).
    pub fn describe(&self) -> String {
        match self.blend.as_slice() {
            [(_, prefix)] => prefix.display().to_string(),
            many => many
                .iter()
                .map(|(w, p)| format!("{w} {}", p.display()))
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::indexed::by_hand::{Scratch, write_u16};
    use super::*;

    #[test]
    fn split_ranges_follow_megatron_rounding() {
        let split = Split::parse("969,30,1", SettingSpelling::FIELDS).unwrap();
        // 1000 documents: 969 / 30 / 1.
        assert_eq!(split.ranges(1000), [0..969, 969..999, 999..1000]);
        // 10 documents: round(9.69) = 10, round(0.3) = 0, round(0.01) = 0.
        assert_eq!(split.ranges(10), [0..10, 10..10, 10..10]);
        // 90/10 of 25: round(22.5) = 22 (half to even), round(2.5) = 2, the
        // missing document shifts the boundaries: [0, 23, 25, 25].
        let split = Split::parse("90/10", SettingSpelling::FIELDS).unwrap();
        assert_eq!(split.ranges(25), [0..23, 23..25, 25..25]);
        for bad in ["", "1,2,3,4", "a,b", "-1,2", "0,0,0", "inf"] {
            assert!(Split::parse(bad, SettingSpelling::FIELDS).is_err(), "{bad}");
        }
        assert!(
            Split::parse("1,2,3,4", SettingSpelling::FIELDS)
                .unwrap_err()
                .contains("up to three sizes")
        );
    }

    #[test]
    fn permutations_are_fixed_by_the_seed() {
        let a = permutation(10, 5);
        assert_eq!(a, permutation(10, 5));
        assert_ne!(a, permutation(10, 6));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<u32>>());
        assert!(permutation(0, 1).is_empty());
    }

    fn tiny_part(dir: &Scratch, seed: u64) -> GptPart {
        let prefix = dir.prefix("tiny");
        write_u16(&prefix, &[vec![1, 2, 3], vec![4, 5], vec![6, 7, 8, 9]]);
        let dataset = Arc::new(IndexedDataset::open(&prefix).unwrap());
        GptPart::new(dataset, 0, 0..3, seed, 2, SettingSpelling::FIELDS).unwrap()
    }

    #[test]
    fn samples_follow_the_hand_computed_order() {
        let dir = Scratch::new("order");
        let part = tiny_part(&dir, 11);
        // 9 tokens, samples of 3 every 2: (9 - 1) / 2 = 4 per epoch.
        assert_eq!(part.samples_per_epoch(), 4);
        // The shuffles of the seed (pinned: a change of the generator or
        // the seed mixing changes every run's data).
        let e0 = part.build_epoch(0);
        assert_eq!(
            (e0.order.as_slice(), e0.samples.as_slice()),
            (&[2u32, 1, 0][..], &[2u32, 0, 1, 3][..])
        );
        let e1 = part.build_epoch(1);
        assert_eq!(
            (e1.order.as_slice(), e1.samples.as_slice()),
            (&[2u32, 1, 0][..], &[3u32, 2, 1, 0][..])
        );
        // Documents 2, 1, 0 concatenated: 6 7 8 9 | 4 5 | 1 2 3. Sample s
        // is tokens 2s..2s+3: s0 = 6 7 8, s1 = 8 9 4, s2 = 4 5 1, s3 = 1 2 3.
        let (s0, s1, s2, s3) = ([6, 7, 8], [8, 9, 4], [4, 5, 1], [1, 2, 3]);
        // Epoch 0 reads s2 s0 s1 s3, epoch 1 reads s3 s2 s1 s0.
        let expected = [s2, s0, s1, s3, s3, s2, s1, s0];
        for (g, want) in expected.iter().enumerate() {
            let mut out = [0u32; 3];
            part.sample(g as u64, &mut out).unwrap();
            assert_eq!(&out, want, "sample {g}");
        }
        // Reading out of order, or again, gives the same samples: each is
        // a function of (seed, g) alone.
        for g in [7u64, 0, 5, 5, 2] {
            let mut out = [0u32; 3];
            part.sample(g, &mut out).unwrap();
            assert_eq!(out, expected[g as usize], "sample {g} again");
        }
        // The document order is shuffled anew per epoch.
        let orders: std::collections::HashSet<Vec<u32>> =
            (0..12).map(|e| part.document_order(e)).collect();
        assert!(orders.len() > 1);
        // Another seed, another order.
        let other = tiny_part(&dir, 12);
        let firsts: Vec<[u32; 3]> = (0..8)
            .map(|g| {
                let mut out = [0u32; 3];
                other.sample(g, &mut out).unwrap();
                out
            })
            .collect();
        assert_ne!(firsts, expected.to_vec());
    }

    #[test]
    fn a_part_too_small_for_one_sample_is_refused() {
        let dir = Scratch::new("small");
        let prefix = dir.prefix("tiny");
        write_u16(&prefix, &[vec![1, 2], vec![3]]);
        let dataset = Arc::new(IndexedDataset::open(&prefix).unwrap());
        let m = GptPart::new(dataset, 1, 0..2, 0, 4, SettingSpelling::FIELDS)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains(
                "tiny.idx (validation part): its 2 documents hold 3 tokens, but one sample needs 5"
            ),
            "{m}"
        );
    }

    #[test]
    fn blends_follow_megatrons_greedy_index() {
        let dir = Scratch::new("blend");
        let part = |name: &str, first: u16| {
            let prefix = dir.prefix(name);
            let docs: Vec<Vec<u16>> = (0..20).map(|d| vec![first + d, first + d]).collect();
            write_u16(&prefix, &docs);
            let dataset = Arc::new(IndexedDataset::open(&prefix).unwrap());
            GptPart::new(dataset, 0, 0..20, 3, 1, SettingSpelling::FIELDS).unwrap()
        };
        let blend = Blend::new(vec![part("a", 100), part("b", 200)], vec![3.0, 7.0]).unwrap();
        // Weights 0.3 / 0.7, by hand: sample i goes to the dataset with the
        // largest w * max(i, 1) - taken so far (the first on ties).
        let parts: Vec<usize> = (0..10).map(|g| blend.locate(g).0).collect();
        let samples: Vec<u64> = (0..10).map(|g| blend.locate(g).1).collect();
        assert_eq!(parts, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]);
        assert_eq!(samples, [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]);
        // Far samples extend the index; the prefix stays the same.
        let far = blend.locate(100_000);
        assert_eq!(blend.locate(3), (1, 2));
        let share = (0..10_000).filter(|g| blend.locate(*g).0 == 0).count();
        assert_eq!(share, 3000);
        assert!(far.1 < 100_000);
        let mut out = [0u32; 2];
        blend.sample(1, &mut out).unwrap();
        assert!(out.iter().all(|t| (100..120).contains(t)), "{out:?}");
        assert!(Blend::new(vec![], vec![]).is_err());
    }

    #[test]
    fn data_path_takes_a_prefix_or_weighted_pairs() {
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = IndexedSpec::parse(
            &words(&["corpus"]),
            Split::default(),
            SettingSpelling::FIELDS,
        )
        .unwrap();
        assert_eq!(one.blend, vec![(1.0, PathBuf::from("corpus"))]);
        let two = IndexedSpec::parse(
            &words(&["0.3", "a", "0.7", "b"]),
            Split::default(),
            SettingSpelling::FIELDS,
        )
        .unwrap();
        assert_eq!(
            two.blend,
            vec![(0.3, PathBuf::from("a")), (0.7, PathBuf::from("b"))]
        );
        assert_eq!(two.describe(), "0.3 a 0.7 b");
        let err = IndexedSpec::parse(
            &words(&["a", "b"]),
            Split::default(),
            SettingSpelling::FIELDS,
        )
        .unwrap_err();
        assert!(err.contains("`a` (before b) is not a weight"), "{err}");
        let err = IndexedSpec::parse(
            &words(&["0.3", "a", "b"]),
            Split::default(),
            SettingSpelling::FIELDS,
        )
        .unwrap_err();
        assert!(err.contains("an odd number"), "{err}");
        let err = IndexedSpec::parse(
            &words(&["0", "a", "1", "b"]),
            Split::default(),
            SettingSpelling::FIELDS,
        )
        .unwrap_err();
        assert!(err.contains("not a weight above 0"), "{err}");
    }
}

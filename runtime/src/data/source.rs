//! The sources as a run reads them: batches of any source, and Megatron
//! indexed datasets split and blended.

use super::gpt::{self, Blend, GptPart, IndexedSpec, Split};
use super::{
    BYTE_VOCAB, Batch, BatchKey, BatchShape, ByteFile, IndexedDataset, MarkovChain, Xoshiro256,
    mix64,
};
use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use std::sync::Arc;

/// Where training tokens come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    Markov(MarkovChain),
    Bytes(ByteFile),
    Indexed(Arc<IndexedSource>),
}

impl DataSource {
    /// Tokens produced lie in `0..vocab()`.
    pub fn vocab(&self) -> usize {
        match self {
            DataSource::Markov(chain) => chain.vocab(),
            DataSource::Bytes(_) => BYTE_VOCAB,
            DataSource::Indexed(source) => source.vocab,
        }
    }

    /// The lowest achievable loss in nats per token, when known.
    pub fn entropy_floor(&self) -> Option<f64> {
        match self {
            DataSource::Markov(chain) => Some(chain.entropy_floor()),
            DataSource::Bytes(_) | DataSource::Indexed(_) => None,
        }
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        match self {
            DataSource::Markov(chain) => format!(
                "synthetic Markov stream over {} tokens (entropy floor {:.4} nats/token)",
                chain.vocab(),
                chain.entropy_floor()
            ),
            DataSource::Bytes(file) => format!("{} ({} bytes)", file.name, file.len()),
            DataSource::Indexed(source) => source.description.clone(),
        }
    }

    /// Checks that batches of `shape` can be made (call it while validating
    /// the configuration, before any device memory is touched); returns the
    /// tokens per batch.
    pub fn check_shape(&self, shape: BatchShape) -> Result<usize> {
        let total = shape.validate()?;
        let window = shape.window();
        if let DataSource::Bytes(file) = self
            && file.len() < window
        {
            return Err(RuntimeError::io(
                &file.name,
                format!(
                    "the file has {} bytes but one training window needs {window} (seq {} + 1 \
                     target); use a longer file or a shorter sequence",
                    file.len(),
                    shape.seq,
                ),
            ));
        }
        if let DataSource::Indexed(source) = self
            && shape.seq != source.seq
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "the indexed data was cut into samples of {} + 1 tokens, not {} + 1",
                source.seq, shape.seq
            )));
        }
        Ok(total)
    }

    /// The batch for `key`: the same key always gives the same tokens.
    pub fn batch(&self, key: BatchKey, shape: BatchShape) -> Result<Batch> {
        let total = self.check_shape(shape)?;
        let window = shape.window();
        let mut tokens = vec![0u32; total];
        for (row, out) in tokens.chunks_exact_mut(window).enumerate() {
            let mut rng = Xoshiro256::seed_from_u64(key.row_seed(row));
            match self {
                DataSource::Markov(chain) => chain.sample_window(&mut rng, out),
                DataSource::Bytes(file) => file.sample_window(&mut rng, out)?,
                DataSource::Indexed(source) => {
                    let g = source.layout.sample(key, shape.batch, row);
                    source.train.sample(g, out)?;
                }
            }
        }
        Ok(Batch { shape, tokens })
    }

    /// Evaluation batch `k` (of the run's fixed set) of `dp_rank`'s
    /// `micro_batch`: the validation part of indexed data; for the other
    /// sources, batches of their stream under a seed no training batch
    /// uses. Fails for indexed data without a validation part.
    pub fn eval_batch(&self, key: BatchKey, shape: BatchShape) -> Result<Batch> {
        match self {
            DataSource::Indexed(source) => {
                let total = self.check_shape(shape)?;
                let validation = source.validation.as_ref().ok_or_else(|| {
                    RuntimeError::InvalidArgument(format!(
                        "{}: evaluation needs a validation part, and {} leaves none; \
                         give the second number of {} above 0 (e.g. 90,10,0)",
                        source.description,
                        source.spelling.given(Setting::Split, source.split.text()),
                        source.spelling.name(Setting::Split)
                    ))
                })?;
                let mut tokens = vec![0u32; total];
                for (row, out) in tokens.chunks_exact_mut(shape.window()).enumerate() {
                    validation.sample(source.layout.sample(key, shape.batch, row), out)?;
                }
                Ok(Batch { shape, tokens })
            }
            _ => self.batch(
                BatchKey {
                    seed: key.seed ^ EVAL_SEED,
                    ..key
                },
                shape,
            ),
        }
    }
}

/// Mixed into the seed of evaluation batches of the synthetic and byte
/// streams: "evaluate".
const EVAL_SEED: u64 = 0x6576_616c_7561_7465;

/// The most tokens a blend has for its ids to be scanned before the first
/// step (about 3 s at the 1.2 G tokens/s `cargo bench --bench indexed_data`
/// measures from the page cache). A larger corpus would spend minutes of
/// every start reading itself, so its samples check their ids as they are
/// read instead, with the same error.
pub const UPFRONT_TOKEN_SCAN: u64 = 4_000_000_000;

/// How a step's samples are spread over ranks and micro-batches, as
/// Megatron's pretraining sampler does: each micro-batch round takes the
/// next `ranks x micro_batch_size` samples, rank `r` its `r`-th slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleLayout {
    pub ranks: usize,
    pub micro_batches: usize,
}

impl SampleLayout {
    /// The global sample number of `row` of `key`'s micro-batch of `batch`
    /// rows.
    pub fn sample(&self, key: BatchKey, batch: usize, row: usize) -> u64 {
        let per_round = (self.ranks * batch) as u64;
        let per_step = per_round * self.micro_batches as u64;
        key.step * per_step
            + key.micro_batch as u64 * per_round
            + (key.dp_rank * batch + row) as u64
    }
}

/// Megatron indexed datasets as training data: the train parts of the
/// blend, and the validation parts when the split has one.
#[derive(Debug)]
pub struct IndexedSource {
    train: Blend,
    validation: Option<Blend>,
    split: Split,
    layout: SampleLayout,
    seq: usize,
    /// One more than the largest token id of the datasets (the model's
    /// vocabulary when they were too large to scan).
    vocab: usize,
    description: String,
    /// How refusals name the settings.
    spelling: SettingSpelling,
}

impl IndexedSource {
    /// Opens every dataset of `spec`, checks them (format, token ids within
    /// `vocab`, the split's parts), and cuts the train and validation parts
    /// into samples of `seq + 1` tokens shuffled with `seed`.
    /// `need_validation`: the run evaluates, so the validation part must
    /// not be empty. Token ids are checked by one scan before the run when
    /// the blend has at most `scan_limit` tokens (runs pass
    /// [`UPFRONT_TOKEN_SCAN`]), else as they are read. Refusals name the
    /// settings as `spelling` spells them.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        spec: &IndexedSpec,
        vocab: usize,
        seed: u64,
        shape: BatchShape,
        layout: SampleLayout,
        need_validation: bool,
        scan_limit: u64,
        spelling: SettingSpelling,
    ) -> Result<Self> {
        let seq = shape.seq;
        let mut trains = Vec::new();
        let mut validations = Vec::new();
        let mut largest = 0u64;
        let mut lines = Vec::new();
        let opened = spec
            .blend
            .iter()
            .map(|(_, prefix)| IndexedDataset::open(prefix))
            .collect::<Result<Vec<_>>>()?;
        let total: u64 = opened.iter().map(|d| d.tokens()).sum();
        let scan = total <= scan_limit;
        for (d, dataset) in opened.into_iter().enumerate() {
            if dataset.documents() == 0 || dataset.tokens() == 0 {
                return Err(RuntimeError::io(
                    dataset.idx_name(),
                    format!(
                        "the corpus is empty ({} documents, {} tokens); prepare it from a text \
                         with content (`hybridgen data prepare`)",
                        dataset.documents(),
                        dataset.tokens()
                    ),
                ));
            }
            let dataset = Arc::new(if scan {
                largest = largest.max(dataset.check_tokens(vocab)?);
                dataset
            } else {
                // Too many tokens to read before the first step: every
                // sample checks its own as it is read.
                largest = largest.max(vocab.saturating_sub(1) as u64);
                dataset.check_reads_against(vocab)
            });
            let ranges = spec.split.ranges(dataset.sequences());
            let weights = spec.split.weights();
            for (part, range) in ranges.iter().enumerate() {
                let needed = weights[part] > 0.0 || (part == 1 && need_validation);
                if range.is_empty() && needed {
                    let split = spelling.given(Setting::Split, spec.split.text());
                    let why = if weights[part] > 0.0 {
                        format!(
                            "{split} gives its {} part no documents of the {}",
                            gpt::PART_NAMES[part],
                            dataset.sequences()
                        )
                    } else {
                        format!(
                            "{} evaluates on the validation part, but {split} gives it none",
                            spelling.name(Setting::EvalEvery)
                        )
                    };
                    return Err(RuntimeError::io(
                        dataset.idx_name(),
                        format!(
                            "{why}; use more documents, or a split whose parts each get one \
                             (e.g. {} for a small corpus)",
                            spelling.given(Setting::Split, "90,10,0")
                        ),
                    ));
                }
            }
            // Each dataset's parts shuffle with their own seed.
            let part_seed = mix64(seed ^ (d as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let train = GptPart::new(
                dataset.clone(),
                0,
                ranges[0].clone(),
                part_seed,
                seq,
                spelling,
            )?;
            let mut line = format!("{} ({}", dataset.prefix().display(), train.describe());
            trains.push(train);
            if !ranges[1].is_empty() {
                let validation = GptPart::new(
                    dataset.clone(),
                    1,
                    ranges[1].clone(),
                    part_seed,
                    seq,
                    spelling,
                )?;
                line += &format!("; {}", validation.describe());
                validations.push(validation);
            }
            lines.push(line + ")");
        }
        let weights: Vec<f64> = spec.blend.iter().map(|(w, _)| *w).collect();
        let validation = if validations.len() == trains.len() {
            Some(Blend::new(validations, weights.clone())?)
        } else {
            None
        };
        let train = Blend::new(trains, weights)?;
        let description = match spec.blend.as_slice() {
            [_] => format!("indexed dataset {}", lines.join("")),
            many => format!(
                "blend of {} indexed datasets: {}",
                many.len(),
                many.iter()
                    .zip(&lines)
                    .map(|((w, _), line)| format!("{w} x {line}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        Ok(IndexedSource {
            train,
            validation,
            split: spec.split.clone(),
            layout,
            seq,
            vocab: largest as usize + 1,
            description,
            spelling,
        })
    }

    pub fn train(&self) -> &Blend {
        &self.train
    }

    pub fn validation(&self) -> Option<&Blend> {
        self.validation.as_ref()
    }
}

//! The data sources' properties.

use super::*;
use crate::setting::SettingSpelling;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

fn key(step: u64, dp_rank: usize, micro_batch: usize) -> BatchKey {
    BatchKey {
        seed: 7,
        step,
        dp_rank,
        micro_batch,
    }
}

fn binary_entropy(p: f64) -> f64 {
    -(p * p.ln() + (1.0 - p) * (1.0 - p).ln())
}

/// A blend within the up-front scan's bound is refused before the run
/// for an id past the vocabulary; past the bound it opens at once, and
/// the sample that holds the id fails with the same message.
#[test]
fn a_corpus_too_large_to_scan_checks_its_ids_as_samples_are_read() {
    use super::indexed::by_hand::{Scratch, write_u16};
    let dir = Scratch::new("scan-bound");
    let prefix = dir.prefix("c");
    write_u16(&prefix, &[vec![1; 60], vec![2, 3, 300, 4], vec![5; 60]]);
    let spec = IndexedSpec {
        blend: vec![(1.0, prefix)],
        split: Split::parse("100,0,0", SettingSpelling::FIELDS).unwrap(),
    };
    let shape = BatchShape::new(1, 8);
    let layout = SampleLayout {
        ranks: 1,
        micro_batches: 1,
    };
    let message = "c.bin: token 2 of sequence 1 is id 300, past the model's vocabulary of 256";
    let open = |limit| {
        IndexedSource::open(
            &spec,
            256,
            1,
            shape,
            layout,
            false,
            limit,
            SettingSpelling::FIELDS,
        )
    };
    let scanned = open(UPFRONT_TOKEN_SCAN).unwrap_err();
    assert!(scanned.to_string().contains(message), "{scanned}");
    let source = open(0).unwrap();
    let data = DataSource::Indexed(Arc::new(source));
    assert_eq!(data.vocab(), 256);
    // 14 samples of 9 tokens an epoch: every one is read within 14 steps.
    let results: Vec<_> = (0..14)
        .map(|step| data.batch(key(step, 0, 0), shape))
        .collect();
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].contains(message), "{}", failed[0]);
    assert!(results.iter().filter(|r| r.is_ok()).count() == 13);
}

#[test]
fn splitmix_and_xoshiro_match_reference_values() {
    // Reference outputs of the published C implementations.
    let mut sm = SplitMix64::new(0);
    assert_eq!(sm.next_u64(), 0xE220_A839_7B1D_CDAF);
    assert_eq!(sm.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    let mut x = Xoshiro256 { s: [1, 2, 3, 4] };
    assert_eq!(x.next_u64(), 11520);
    assert_eq!(x.next_u64(), 0);
    assert_eq!(x.next_u64(), 1509978240);
    assert_eq!(x.next_u64(), 1215971899390074240);
}

#[test]
fn below_and_f64_stay_in_range() {
    let mut rng = Xoshiro256::seed_from_u64(1);
    let mut seen = [false; 7];
    for _ in 0..1000 {
        let v = rng.below(7);
        assert!(v < 7);
        seen[v as usize] = true;
        let f = rng.next_f64();
        assert!((0.0..1.0).contains(&f));
    }
    assert!(seen.iter().all(|s| *s));
    assert_eq!(rng.below(0), 0);
}

#[test]
fn two_state_chain_entropy_matches_the_hand_computation() {
    // P = [[1/2, 1/2], [1/4, 3/4]]: pi = (1/3, 2/3),
    // H = 1/3 ln 2 + 2/3 h(1/4).
    let chain =
        MarkovChain::from_transitions(vec![vec![(0, 0.5), (1, 0.5)], vec![(0, 0.25), (1, 0.75)]])
            .unwrap();
    let pi = chain.stationary();
    assert!((pi[0] - 1.0 / 3.0).abs() < 1e-12, "{pi:?}");
    assert!((pi[1] - 2.0 / 3.0).abs() < 1e-12, "{pi:?}");
    let expected = std::f64::consts::LN_2 / 3.0 + 2.0 / 3.0 * binary_entropy(0.25);
    assert!((chain.entropy_floor() - expected).abs() < 1e-12);
}

#[test]
fn periodic_and_deterministic_chains() {
    // A 3-cycle is periodic: the lazy iteration still finds pi = 1/3.
    let cycle = MarkovChain::from_transitions(vec![vec![(1, 1.0)], vec![(2, 1.0)], vec![(0, 1.0)]])
        .unwrap();
    assert_eq!(cycle.entropy_floor(), 0.0);
    assert!(
        cycle
            .stationary()
            .iter()
            .all(|p| (p - 1.0 / 3.0).abs() < 1e-12)
    );
    // Bipartite 0 <-> {1, 2}: pi = (1/2, 1/4, 1/4), H = 1/2 ln 2.
    let star = MarkovChain::from_transitions(vec![
        vec![(1, 0.5), (2, 0.5)],
        vec![(0, 1.0)],
        vec![(0, 1.0)],
    ])
    .unwrap();
    assert!((star.stationary()[0] - 0.5).abs() < 1e-12);
    assert!((star.entropy_floor() - 0.5 * std::f64::consts::LN_2).abs() < 1e-12);
}

#[test]
fn bad_chains_are_refused() {
    let err =
        |rows: Vec<Vec<(u32, f64)>>| MarkovChain::from_transitions(rows).unwrap_err().to_string();
    assert!(err(vec![]).contains("at least one token"));
    assert!(err(vec![vec![(0, 0.5)]]).contains("add up to 0.5"));
    assert!(err(vec![vec![(3, 1.0)]]).contains("outside the vocabulary"));
    assert!(err(vec![vec![(0, 1.5), (0, -0.5)]]).contains("probability -0.5"));
    assert!(err(vec![vec![(0, 0.5), (0, 0.5)]]).contains("twice"));
    assert!(err(vec![vec![], vec![(0, 1.0)]]).contains("token 0's successors"));
    // 1 -> 1 forever: token 0 is never reached again.
    assert!(err(vec![vec![(1, 1.0)], vec![(1, 1.0)]]).contains("not irreducible: token 1"));
    assert!(MarkovChain::random(1, 1, 0).is_err());
    assert!(MarkovChain::random(8, 9, 0).is_err());
    assert!(MarkovChain::random(8, 0, 0).is_err());
}

#[test]
fn random_chain_floor_matches_sampled_loss() {
    let chain = MarkovChain::random(64, 4, 3).unwrap();
    let floor = chain.entropy_floor();
    assert!(floor > 0.3 && floor < 4f64.ln(), "{floor}");
    let source = DataSource::Markov(chain.clone());
    // The average log-loss of the true model over sampled transitions
    // estimates the entropy rate (deterministic seed: no flakiness).
    let mut total = 0.0;
    let mut count = 0usize;
    let mut first_counts = vec![0usize; 64];
    for step in 0..40 {
        let batch = source
            .batch(key(step, 0, 0), BatchShape::new(16, 128))
            .unwrap();
        for row in batch.tokens().chunks_exact(129) {
            first_counts[row[0] as usize] += 1;
            for pair in row.windows(2) {
                let p = chain
                    .successors(pair[0])
                    .iter()
                    .find(|(s, _)| *s == pair[1])
                    .map(|(_, p)| *p)
                    .expect("sampled a transition the chain does not have");
                total -= p.ln();
                count += 1;
            }
        }
    }
    let estimate = total / count as f64;
    assert!((estimate - floor).abs() < 0.02, "{estimate} vs {floor}");
    assert_eq!(first_counts.iter().sum::<usize>(), 640);
}

#[test]
fn batches_depend_on_the_key_alone() {
    let source = DataSource::Markov(MarkovChain::random(32, 3, 11).unwrap());
    let shape = BatchShape::new(4, 18);
    let a = source.batch(key(5, 1, 2), shape).unwrap();
    // Resuming: an unrelated earlier batch does not change this one.
    let _ = source.batch(key(4, 1, 2), shape).unwrap();
    let b = source.batch(key(5, 1, 2), shape).unwrap();
    assert_eq!(a, b);
    let distinct: HashSet<Vec<u32>> = [
        key(5, 1, 2),
        key(6, 1, 2),
        key(5, 0, 2),
        key(5, 1, 3),
        BatchKey {
            seed: 8,
            ..key(5, 1, 2)
        },
    ]
    .iter()
    .map(|k| source.batch(*k, shape).unwrap().tokens().to_vec())
    .collect();
    assert_eq!(distinct.len(), 5);
    // A row does not depend on how many rows come before or after it.
    let bigger = source.batch(key(5, 1, 2), BatchShape::new(6, 18)).unwrap();
    assert_eq!(&bigger.tokens()[..a.tokens().len()], a.tokens());
}

/// layers.md, Model: MTP depth k reads nothing past the sample's S + 1
/// tokens; inputs are rolled left by k (0 past the end), targets too,
/// masked for the last k positions.
#[test]
fn mtp_inputs_and_targets_roll_inside_the_sample() {
    let source = DataSource::Markov(MarkovChain::random(16, 2, 1).unwrap());
    let batch = source.batch(key(0, 0, 0), BatchShape::new(2, 5)).unwrap();
    assert_eq!(batch.tokens().len(), 2 * 6);
    for k in 1..=3 {
        let (inputs, targets) = (batch.mtp_inputs(k), batch.mtp_targets(k));
        assert_eq!((inputs.len(), targets.len()), (10, 10));
        for row in 0..2 {
            let w = &batch.tokens()[row * 6..(row + 1) * 6];
            for t in 0..5 {
                let (input, target) = (inputs[row * 5 + t], targets[row * 5 + t]);
                if t + k < 5 {
                    assert_eq!((input, target), (w[t + k], w[t + k + 1]), "k={k} t={t}");
                } else {
                    assert_eq!((input, target), (0, IGNORE_TARGET), "k={k} t={t}");
                }
            }
        }
        let counted = targets.iter().filter(|&&t| t != IGNORE_TARGET).count();
        assert_eq!(counted, 2 * (5 - k), "the S - k labelled positions per row");
    }
}

#[test]
fn inputs_and_targets_are_shifted_views() {
    let source = DataSource::Markov(MarkovChain::random(16, 2, 1).unwrap());
    let batch = source.batch(key(0, 0, 0), BatchShape::new(2, 5)).unwrap();
    assert_eq!(batch.tokens().len(), 2 * 6);
    for row in 0..2 {
        let w = &batch.tokens()[row * 6..(row + 1) * 6];
        assert_eq!(batch.inputs(row).unwrap(), &w[..5]);
        assert_eq!(batch.targets(row).unwrap(), &w[1..6]);
    }
    assert!(batch.inputs(2).is_err());
    assert!(batch.targets(2).is_err());
    assert_eq!(batch.mtp_inputs(0).len(), 10);
    assert_eq!(batch.dims().rows().unwrap(), 10);
    assert_eq!(&batch.mtp_targets(0)[5..], batch.targets(1).unwrap());
    assert!(batch.tokens().iter().all(|t| *t < 16));
    assert!(source.batch(key(0, 0, 0), BatchShape::new(0, 5)).is_err());
    assert!(source.batch(key(0, 0, 0), BatchShape::new(2, 0)).is_err());
    assert!(
        source
            .batch(key(0, 0, 0), BatchShape::new(usize::MAX, 2))
            .is_err()
    );
}

#[test]
fn byte_file_windows_and_errors() {
    let text: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
    let source = DataSource::Bytes(ByteFile::from_bytes("t.txt", text.clone(), 256).unwrap());
    assert_eq!(source.vocab(), 256);
    assert_eq!(source.entropy_floor(), None);
    let batch = source.batch(key(3, 0, 0), BatchShape::new(3, 21)).unwrap();
    for row in batch.tokens().chunks_exact(22) {
        // Windows are contiguous runs of the file.
        let start = text.iter().position(|b| u32::from(*b) == row[0]).unwrap();
        for (i, t) in row.iter().enumerate() {
            assert_eq!(*t, u32::from(text[(start + i) % 256]));
        }
    }
    assert_eq!(
        batch,
        source.batch(key(3, 0, 0), BatchShape::new(3, 21)).unwrap()
    );
    // Exactly one window fits.
    let exact = DataSource::Bytes(ByteFile::from_bytes("e", vec![1, 2, 3, 4], 300).unwrap());
    let b = exact.batch(key(0, 0, 0), BatchShape::new(2, 3)).unwrap();
    assert_eq!(b.tokens(), &[1, 2, 3, 4, 1, 2, 3, 4]);
    assert_eq!(exact.check_shape(BatchShape::new(2, 3)).unwrap(), 8);
    let short = exact
        .batch(key(0, 0, 0), BatchShape::new(1, 4))
        .unwrap_err()
        .to_string();
    assert!(
        short.contains("e: the file has 4 bytes but one training window needs 5"),
        "{short}"
    );

    let empty = ByteFile::from_bytes("empty.txt", vec![], 256)
        .unwrap_err()
        .to_string();
    assert!(empty.contains("empty.txt: the file is empty"), "{empty}");
    let small = ByteFile::from_bytes("t", vec![1], 128)
        .unwrap_err()
        .to_string();
    assert!(small.contains("only 128 tokens"), "{small}");
    let missing = ByteFile::open(
        Path::new("/nonexistent/corpus.txt"),
        256,
        SettingSpelling::FIELDS,
    )
    .unwrap_err();
    assert!(missing.to_string().starts_with("/nonexistent/corpus.txt:"));
}

/// A file of `bytes` under the temp dir, removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(tag: &str, bytes: &[u8]) -> Self {
        let path =
            std::env::temp_dir().join(format!("hybridgen-data-{tag}-{}.bin", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn file_windows_are_bit_identical_to_the_whole_file_reader() {
    // Golden values from the implementation that read the whole file into
    // memory (before windows were read in place): FNV-1a of each batch's
    // tokens and its first eight tokens.
    let bytes: Vec<u8> = (0..5000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let file = TempFile::new("golden", &bytes);
    let on_disk = DataSource::Bytes(ByteFile::open(&file.0, 256, SettingSpelling::FIELDS).unwrap());
    let in_memory = DataSource::Bytes(ByteFile::from_bytes("m", bytes, 256).unwrap());
    let at = |seed, step, dp_rank, micro_batch| BatchKey {
        seed,
        step,
        dp_rank,
        micro_batch,
    };
    let golden: [(BatchKey, BatchShape, u64, [u32; 8]); 4] = [
        (
            at(7, 0, 0, 0),
            BatchShape::new(3, 21),
            0x7475_8657_c1f2_44a9,
            [138, 70, 2, 190, 122, 53, 241, 173],
        ),
        (
            at(7, 5, 1, 2),
            BatchShape::new(4, 64),
            0x0d1a_ec73_d127_98d9,
            [245, 176, 108, 40, 228, 160, 91, 23],
        ),
        (
            at(123, 99, 3, 7),
            BatchShape::new(2, 302),
            0x126c_41cb_5101_8061,
            [102, 34, 222, 154, 86, 17, 205, 137],
        ),
        // One window of the whole file: offset 0 is the only start.
        (
            at(0, 0, 0, 0),
            BatchShape::new(1, 4999),
            0xd826_f322_a2a2_051c,
            [0, 187, 119, 51, 239, 171, 102, 34],
        ),
    ];
    for (key, shape, hash, first) in golden {
        for source in [&on_disk, &in_memory] {
            let batch = source.batch(key, shape).unwrap();
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for t in batch.tokens() {
                h ^= u64::from(*t);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            assert_eq!(h, hash, "{key:?} {shape:?}");
            assert_eq!(&batch.tokens()[..8], &first, "{key:?} {shape:?}");
        }
    }
}

#[test]
fn only_regular_non_empty_files_are_data() {
    let err = |path: &Path| {
        ByteFile::open(path, 256, SettingSpelling::FIELDS)
            .unwrap_err()
            .to_string()
    };
    let dir = std::env::temp_dir();
    let message = err(&dir);
    assert!(
        message.contains("this is a directory, not a data file"),
        "{message}"
    );
    let empty = err(Path::new(""));
    assert!(empty.contains("config.data: the path is empty"), "{empty}");
    let file = TempFile::new("empty", b"");
    let message = err(&file.0);
    assert!(message.contains("the file is empty"), "{message}");
    #[cfg(unix)]
    {
        let message = err(Path::new("/dev/zero"));
        assert_eq!(
            message,
            "/dev/zero: this is a character device, not a data file; give a regular \
             file of text"
        );
        let fifo = std::env::temp_dir().join(format!("hybridgen-fifo-{}", std::process::id()));
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let message = err(&fifo);
            let _ = std::fs::remove_file(&fifo);
            assert!(message.contains("this is a FIFO (named pipe)"), "{message}");
        }
    }
    // A file that shrinks under a run fails its next read by name.
    let file = TempFile::new("shrinks", &[7u8; 64]);
    let source = DataSource::Bytes(ByteFile::open(&file.0, 256, SettingSpelling::FIELDS).unwrap());
    std::fs::write(&file.0, [7u8; 4]).unwrap();
    let message = source
        .batch(key(0, 0, 0), BatchShape::new(2, 30))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("the file shrank while training"),
        "{message}"
    );
}

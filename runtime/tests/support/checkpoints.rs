//! Trained checkpoints for the Hugging Face round-trip tests, and their
//! parameters read back.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::checkpoint::CheckpointReader;
use hybridgen_runtime::train::{TrainConfig, train};
use std::path::{Path, PathBuf};

/// A checkpoint of `model` after three steps on two ranks (experts split
/// over them, ZeRO-3): the values are trained, not the initialisation. An
/// odd count: the sign-based expert-bias steps can undo each other in two.
pub fn trained(dir: &Path, model: ModelConfig) -> PathBuf {
    let mut config = TrainConfig::new(model);
    config.steps = 3;
    config.micro_batches = 2;
    config.micro_batch_size = 2;
    config.ranks = 2;
    config.ep = 2;
    config.save = Some(dir.join("ckpt"));
    train(&config, &mut |_| {}).unwrap();
    dir.join("ckpt")
}

/// Every parameter of checkpoint `dir`, by key.
pub fn params(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let reader = CheckpointReader::open(dir, "checkpoint").unwrap();
    let keys: Vec<String> = reader.index.tensors.keys().cloned().collect();
    keys.into_iter()
        .map(|k| {
            let v = reader.param(&k).unwrap();
            (k, v)
        })
        .collect()
}

/// [`params`] as bits, for comparisons that must be exact (NaN and -0
/// included).
#[allow(dead_code)] // not every test file that includes this compares bits
pub fn param_bits(dir: &Path) -> Vec<(String, Vec<u32>)> {
    params(dir)
        .into_iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

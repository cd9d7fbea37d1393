//! Hugging Face interop: hybridgen checkpoints <-> folders transformers'
//! `NemotronHForCausalLM` (and vLLM) or `Qwen3NextForCausalLM` load as they
//! are.
//!
//! [`mapping`] is the one table between the two sets of tensor names and
//! layouts for nemotron_h ([`qwen3_next`] holds qwen3_next's); [`config`] translates `config.json`; [`files`] reads and writes
//! the safetensors folder; [`convert`] puts them together: export, import,
//! and the weights a run starts from (`init_from`).

pub mod config;
pub mod convert;
pub mod files;
pub mod mapping;
pub mod qwen3_next;

pub use config::{HfDtype, family_of, from_hf_config, to_hf_config};
pub use convert::{
    DryRun, ExportReport, HfWeights, LossCheck, dry_run, export, import_checkpoint, loss_check,
};
pub use mapping::{Family, HfTensor, Piece, Source, TABLE, ValueMap, hf_tensors};

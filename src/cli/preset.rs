//! `hybridgen preset [NAME]`: the built-in presets, as model files.

use super::Failure;
use hybridgen_dsl::config::{ModelConfig, PRESET_NAMES};

#[derive(clap::Args, Debug)]
pub(crate) struct PresetArgs {
    /// Print this preset's model file (TOML); without it, list the presets.
    name: Option<String>,
}

pub(crate) fn run(args: &PresetArgs) -> Result<(), Failure> {
    match &args.name {
        None => {
            let mut out = String::new();
            for name in PRESET_NAMES {
                let pattern = ModelConfig::preset(name)
                    .map(|m| m.pattern)
                    .unwrap_or_default();
                out += &format!("{name:<26} {pattern}\n");
            }
            super::emit(&out)
        }
        Some(name) => match ModelConfig::preset_source(name) {
            Some(source) => super::emit(source),
            None => Err(Failure::Message(format!(
                "unknown preset `{name}`; the presets are: {}",
                PRESET_NAMES.join(", ")
            ))),
        },
    }
}

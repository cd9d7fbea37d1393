//! `hybridgen import HF_DIR --output CHECKPOINT`: a Hugging Face Nemotron-H
//! or Qwen3-Next folder as a hybridgen checkpoint to train from; `--model-only` prints
//! its `config.json` as a model file.

use super::Failure;
use hybridgen_runtime::hf;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub(crate) struct ImportArgs {
    /// The folder: config.json plus model.safetensors, or shards and
    /// model.safetensors.index.json.
    hf_dir: PathBuf,
    /// The checkpoint root to write (new, or an empty directory): step 0
    /// holds the weights, with fresh optimizer state.
    #[arg(
        long,
        value_name = "CHECKPOINT",
        required_unless_present = "model_only"
    )]
    output: Option<PathBuf>,
    /// Print the model (a model file, TOML) that config.json describes and
    /// write nothing.
    #[arg(long, conflicts_with = "output")]
    model_only: bool,
    /// Regroup the layers: the same layers in the same order, with groups
    /// (say `M[*E]M[*E]` for `M*EM*E`).
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    pattern: Option<String>,
}

fn runtime(e: hybridgen_runtime::RuntimeError) -> Failure {
    Failure::Message(format!("cannot import: {e}"))
}

pub(crate) fn run(args: &ImportArgs) -> Result<(), Failure> {
    if args.model_only {
        // The tensors are checked too: a model file is only useful with
        // weights that fit it.
        let weights =
            hf::HfWeights::open(&args.hf_dir, args.pattern.as_deref()).map_err(runtime)?;
        let toml = toml_text(weights.bound_model())?;
        return super::emit(&format!(
            "# Imported from {}/config.json. seq_length is the length hybridgen trains\n\
             # at, not a limit of the model.\n{toml}",
            args.hf_dir.display()
        ));
    }
    let Some(output) = &args.output else {
        return Err(Failure::Message(
            "give --output CHECKPOINT (or --model-only)".into(),
        ));
    };
    let (dir, model) =
        hf::import_checkpoint(&args.hf_dir, output, args.pattern.as_deref()).map_err(runtime)?;
    super::emit(&format!(
        "imported {} as {} (pattern {}); train from it with: hybridgen train --resume {}\n",
        args.hf_dir.display(),
        dir.display(),
        model.pattern,
        output.display()
    ))
}

/// The model as a model file. Written by hand from its serde form (one
/// level of tables of scalars is all a model has), which `from_toml` reads
/// back to the same model.
fn toml_text(model: &hybridgen_dsl::ModelConfig) -> Result<String, Failure> {
    let value = serde_json::to_value(model)
        .map_err(|e| Failure::Message(format!("cannot print the model: {e}")))?;
    let Some(fields) = value.as_object() else {
        return Err(Failure::Message(
            "cannot print the model: not a table".into(),
        ));
    };
    let mut top = String::new();
    let mut tables = String::new();
    for (name, v) in fields {
        match v {
            serde_json::Value::Object(table) => {
                tables += &format!("\n[{name}]\n");
                for (field, v) in table {
                    if !v.is_null() {
                        tables += &format!("{field} = {}\n", scalar(v)?);
                    }
                }
            }
            serde_json::Value::Null => {}
            v => top += &format!("{name} = {}\n", scalar(v)?),
        }
    }
    Ok(top + &tables)
}

fn scalar(v: &serde_json::Value) -> Result<String, Failure> {
    Ok(match v {
        serde_json::Value::String(s) => serde_json::Value::String(s.clone()).to_string(),
        serde_json::Value::Bool(b) => b.to_string(),
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(u), _) => u.to_string(),
            // Model fields are f32: print the shortest text that reads back
            // to the same f32 (0.02, not 0.019999999552965164).
            (None, Some(f)) => {
                let short = format!("{:?}", f as f32);
                if short.contains(['.', 'e']) {
                    short
                } else {
                    format!("{short}.0")
                }
            }
            _ => n.to_string(),
        },
        other => {
            return Err(Failure::Message(format!(
                "cannot print the model: {other} is not a TOML scalar"
            )));
        }
    })
}

//! `hybridgen export CHECKPOINT --to hf OUT_DIR`: a checkpoint as a folder
//! transformers' `NemotronHForCausalLM` (and vLLM) or `Qwen3NextForCausalLM`
//! load as they are.

use super::Failure;
use hybridgen_runtime::hf::{self, HfDtype};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// A Hugging Face folder for transformers' nemotron_h or qwen3_next.
    Hf,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DtypeArg {
    Bf16,
    F32,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FormatArg {
    Text,
    Json,
}

#[derive(clap::Args, Debug)]
pub(crate) struct ExportArgs {
    /// The checkpoint: a root (its newest complete step) or one step's
    /// directory. With --dry-run, --preset or --model may stand in for it.
    checkpoint: Option<PathBuf>,
    /// What to export to.
    #[arg(long, value_enum)]
    to: Target,
    /// The folder to write (new, or an empty directory). Written under
    /// OUT_DIR.partial and renamed when complete.
    out_dir: Option<PathBuf>,
    /// The tensors' dtype (the router's expert bias stays f32, as
    /// transformers keeps it).
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// List the config and every tensor's name, shape, dtype and file,
    /// writing nothing.
    #[arg(long)]
    dry_run: bool,
    /// With --dry-run and no checkpoint: a built-in preset's model.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["model", "checkpoint"])]
    preset: Option<String>,
    /// With --dry-run and no checkpoint: a model file.
    #[arg(long, value_name = "FILE", conflicts_with = "checkpoint")]
    model: Option<PathBuf>,
    /// After exporting, run hybridgen's model from the exported weights on
    /// one fixed sequence and write the tokens and its loss to FILE (JSON),
    /// for scripts/hf_check.py to compare with transformers.
    #[arg(long, value_name = "FILE", conflicts_with = "dry_run")]
    loss_check: Option<PathBuf>,
    /// Tokens in the --loss-check sequence.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    loss_tokens: u32,
    /// `text`: readable; `json`: one object on stdout (what --dry-run
    /// lists, or what the export wrote).
    #[arg(long, value_enum, default_value = "text")]
    format: FormatArg,
}

fn runtime(e: hybridgen_runtime::RuntimeError) -> Failure {
    Failure::Message(format!("cannot export: {e}"))
}

pub(crate) fn run(args: &ExportArgs) -> Result<(), Failure> {
    let dtype = match args.dtype {
        DtypeArg::Bf16 => HfDtype::Bf16,
        DtypeArg::F32 => HfDtype::F32,
    };
    if args.dry_run {
        return dry_run(args, dtype);
    }
    if args.preset.is_some() || args.model.is_some() {
        return Err(Failure::Message(
            "--preset and --model describe a model without weights: they go with --dry-run; \
             to export weights, give a checkpoint"
                .into(),
        ));
    }
    let (Some(checkpoint), Some(out)) = (&args.checkpoint, &args.out_dir) else {
        return Err(Failure::Message(
            "give the checkpoint and the folder to write: hybridgen export CHECKPOINT --to hf OUT_DIR"
                .into(),
        ));
    };
    let report = hf::export(checkpoint, out, dtype).map_err(runtime)?;
    let check = match &args.loss_check {
        None => None,
        Some(path) => {
            let check = hf::loss_check(out, args.loss_tokens as usize, 0).map_err(runtime)?;
            let text = json!({
                "tokens": check.tokens,
                "loss": check.loss,
                "aux_loss": check.aux_loss,
                "seq_length": args.loss_tokens,
                "dtype": dtype.torch_name(),
            });
            super::write_file(path, format!("{text}\n").as_bytes(), "--loss-check")?;
            Some(check)
        }
    };
    match args.format {
        FormatArg::Json => super::emit(&format!(
            "{}\n",
            json!({
                "out": report.out.display().to_string(),
                "step": report.step,
                "files": report.files,
                "tensors": report.tensors,
                "bytes": report.bytes,
                "notes": report.notes,
                "loss": check.as_ref().map(|c| c.loss),
            })
        )),
        FormatArg::Text => {
            let mut text = String::new();
            for note in &report.notes {
                text += &format!("note: {note}\n");
            }
            text += &format!(
                "exported step {} to {}: {} tensors, {} bytes in {}\n",
                report.step,
                report.out.display(),
                report.tensors,
                report.bytes,
                report.files.join(", ")
            );
            if let (Some(check), Some(path)) = (&check, &args.loss_check) {
                text += &format!(
                    "hybridgen's loss on {} fixed tokens: {} (written to {})\n",
                    args.loss_tokens,
                    check.loss,
                    path.display()
                );
            }
            super::emit(&text)
        }
    }
}

fn dry_run(args: &ExportArgs, dtype: HfDtype) -> Result<(), Failure> {
    let model = match (&args.checkpoint, &args.model, &args.preset) {
        (Some(dir), _, _) => {
            // Only the model: the index, not a checksum of every rank file.
            hybridgen_runtime::checkpoint::open_index(dir, "CHECKPOINT")
                .map_err(runtime)?
                .1
                .model
        }
        (None, file, preset) => super::plan::resolve_model(None, file.as_ref(), preset.as_deref())?,
    };
    let listing = hf::dry_run(&model, dtype).map_err(runtime)?;
    let file_of = |i: usize| {
        listing
            .files
            .iter()
            .find(|(_, members)| members.contains(&i))
            .map_or("", |(f, _)| f.as_str())
    };
    match args.format {
        FormatArg::Json => {
            let tensors: Vec<_> = listing
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    json!({
                        "name": t.name,
                        "shape": t.shape,
                        "dtype": match t.dtype { HfDtype::Bf16 => "BF16", HfDtype::F32 => "F32" },
                        "file": file_of(i),
                    })
                })
                .collect();
            let files: Vec<&str> = listing.files.iter().map(|(f, _)| f.as_str()).collect();
            super::emit(&format!(
                "{}\n",
                json!({
                    "config": listing.config,
                    "tensors": tensors,
                    "files": files,
                    "notes": listing.notes,
                })
            ))
        }
        FormatArg::Text => {
            let mut text = String::new();
            for note in &listing.notes {
                text += &format!("note: {note}\n");
            }
            text += "config.json:\n";
            text += &serde_json::to_string_pretty(&listing.config).unwrap_or_default();
            text += "\ntensors:\n";
            for (i, t) in listing.tensors.iter().enumerate() {
                text += &format!(
                    "  {:<60} {:<18} {:<4} {}\n",
                    t.name,
                    format!("{:?}", t.shape),
                    match t.dtype {
                        HfDtype::Bf16 => "BF16",
                        HfDtype::F32 => "F32",
                    },
                    file_of(i)
                );
            }
            let bytes: u64 = listing.tensors.iter().map(|t| t.bytes()).sum();
            text += &format!(
                "{} tensors, {bytes} bytes in {} file(s); nothing written (--dry-run)\n",
                listing.tensors.len(),
                listing.files.len()
            );
            super::emit(&text)
        }
    }
}

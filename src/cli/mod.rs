//! The `hybridgen` command line: `check`, `plan`, `explain`, `preset`,
//! `train`, `data prepare`, `plot`, `export` and `import`. Every command
//! calls the same library functions the `model!` macro and build scripts
//! use, so they cannot disagree.
//!
//! Exit codes: 0 success, 1 invalid input (a bad pattern, model or layout,
//! reported with codes), 2 usage errors (bad flags).

mod board;
mod check;
mod data;
mod explain;
mod export;
mod human;
mod import;
pub mod plan;
mod plot;
mod preset;
mod train;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::ffi::OsString;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "hybridgen",
    version,
    about = "Plan and train hybrid Mamba / attention / MoE models from a layer pattern",
    long_about = "Plan and train hybrid Mamba / attention / MoE models from a layer pattern.\n\n\
                  A pattern names one layer per character (M Mamba, * attention, + MLA, D DSA,\n\
                  G gated delta net, - MLP, E MoE); [ ] groups layers into one nested stack,\n\
                  | separates pipeline stages and / starts a multi-token-prediction depth.\n\
                  Example: hybridgen plan 'M[*E]M[*E]' --dp 4 --ep 2"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate a pattern: exit 0 with a summary, or 1 with every error.
    Check(check::CheckArgs),
    /// Plan a model: layers, FSDP units, buckets, shards, memory per rank.
    Plan(plan::PlanArgs),
    /// Explain an error code (e.g. H005) and how to fix it.
    Explain(explain::ExplainArgs),
    /// List the built-in presets, or print one as a model file to start from.
    Preset(preset::PresetArgs),
    /// Train a model (default: the `tiny` preset, synthetic data, 2 CPU
    /// thread ranks, expert parallelism 2, the overlap schedule, ZeRO-3).
    Train(Box<train::TrainArgs>),
    /// Prepare training data: `data prepare` tokenizes text into a Megatron
    /// indexed dataset.
    Data(data::DataArgs),
    /// Draw the loss and eval-loss curves of `train --log-file` logs into
    /// an SVG.
    Plot(plot::PlotArgs),
    /// Export a checkpoint as a Hugging Face folder (transformers' and
    /// vLLM's nemotron_h, or qwen3_next), or list what it would write
    /// (--dry-run).
    Export(Box<export::ExportArgs>),
    /// Import a Hugging Face Nemotron-H or Qwen3-Next folder as a checkpoint, or print
    /// its model file (--model-only).
    Import(import::ImportArgs),
}

/// Why a command failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Invalid input, already explained on stderr: exit 1.
    Invalid,
    /// Invalid input with a message still to print: exit 1.
    Message(String),
    /// A failure with a stable code (`hybridgen train`): the message goes to
    /// stderr and, when `json`, stdout ends with `{"error": {"code",
    /// "message"}}`. Exit 1.
    Coded {
        code: &'static str,
        message: String,
        json: bool,
    },
}

impl Failure {
    /// This failure with `code`, unless it has one already.
    pub(crate) fn coded(self, code: &'static str, json: bool) -> Failure {
        let message = match self {
            Failure::Coded { .. } => return self,
            Failure::Invalid => "invalid input (see the errors above)".to_string(),
            Failure::Message(message) => message,
        };
        Failure::Coded {
            code,
            message,
            json,
        }
    }
}

/// The last line of stdout when a `--format json` run fails.
fn error_object(code: &str, message: &str) -> String {
    format!(
        "{}\n",
        serde_json::json!({ "error": { "code": code, "message": message } })
    )
}

/// Whether `args` ask `train` for JSON output, judged from the raw words
/// (for usage errors, found before the flags parse).
fn wants_json(args: &[OsString]) -> bool {
    let words: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    words.contains(&"train")
        && (words.contains(&"--format=json")
            || words
                .windows(2)
                .any(|w| w[0] == "--format" && w[1] == "json"))
}

/// Writes command output to stdout. A reader that went away (`| head`) ends
/// the output quietly rather than with a panic.
pub(crate) fn emit(text: &str) -> Result<(), Failure> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::Message(format!("cannot write to stdout: {e}"))),
    }
}

/// Writes a command's output file `path` whole under a temporary name, then
/// renames it, so a reader never sees half a file; `what` names the file in
/// the error (the flag that gave it).
pub(crate) fn write_file(path: &std::path::Path, bytes: &[u8], what: &str) -> Result<(), Failure> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(format!(".tmp-{}", std::process::id()));
    let temporary = std::path::PathBuf::from(temporary);
    std::fs::write(&temporary, bytes)
        .and_then(|()| std::fs::rename(&temporary, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&temporary);
            Failure::Message(format!("{what} {}: cannot write it: {e}", path.display()))
        })
}

/// Parses `args` and runs the command.
pub fn run(args: impl IntoIterator<Item = impl Into<OsString> + Clone>) -> ExitCode {
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    // The matches are kept: `train` asks which flags were given.
    let parsed = Cli::command()
        .try_get_matches_from(&args)
        .and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => {
            // clap prints help and version to stdout (exit 0) and usage
            // errors to stderr (exit 2).
            let _ = err.print();
            if err.use_stderr() && wants_json(&args) {
                // The first paragraph: what is wrong, without the usage hint.
                let rendered = err.render().to_string();
                let message = rendered
                    .trim()
                    .trim_start_matches("error: ")
                    .split("\n\n")
                    .next()
                    .unwrap_or_default();
                let _ = emit(&error_object("usage", message));
            }
            return ExitCode::from(if err.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli.command {
        Command::Check(args) => check::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Explain(args) => explain::run(&args),
        Command::Preset(args) => preset::run(&args),
        Command::Train(args) => train::run(&args, matches.subcommand_matches("train")),
        Command::Data(args) => data::run(&args),
        Command::Plot(args) => plot::run(&args),
        Command::Export(args) => export::run(&args),
        Command::Import(args) => import::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Invalid) => ExitCode::from(1),
        Err(Failure::Message(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
        Err(Failure::Coded {
            code,
            message,
            json,
        }) => {
            eprintln!("error: {message}");
            if json {
                let _ = emit(&error_object(code, &message));
            }
            ExitCode::from(1)
        }
    }
}

//! The `hybridgen` command line: `check`, `plan`, `explain`, `preset` and
//! `train`. Every command calls the same library functions the `model!` macro
//! and build scripts use, so they cannot disagree.
//!
//! Exit codes: 0 success, 1 invalid input (a bad pattern, model or layout,
//! reported with codes), 2 usage errors (bad flags).

mod check;
mod explain;
mod human;
pub mod plan;
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
}

/// Why a command failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Invalid input, already explained on stderr: exit 1.
    Invalid,
    /// Invalid input with a message still to print: exit 1.
    Message(String),
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

/// Parses `args` and runs the command.
pub fn run(args: impl IntoIterator<Item = impl Into<OsString> + Clone>) -> ExitCode {
    // The matches are kept: `train` asks which flags were given.
    let parsed = Cli::command()
        .try_get_matches_from(args)
        .and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => {
            // clap prints help and version to stdout (exit 0) and usage
            // errors to stderr (exit 2).
            let _ = err.print();
            return ExitCode::from(if err.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli.command {
        Command::Check(args) => check::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Explain(args) => explain::run(&args),
        Command::Preset(args) => preset::run(&args),
        Command::Train(args) => train::run(&args, matches.subcommand_matches("train")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Invalid) => ExitCode::from(1),
        Err(Failure::Message(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(1)
        }
    }
}

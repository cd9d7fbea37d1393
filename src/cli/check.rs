//! `hybridgen check PATTERN`.

use super::Failure;
use hybridgen_dsl::Pattern;

#[derive(clap::Args, Debug)]
pub(crate) struct CheckArgs {
    /// The layer pattern, e.g. 'M[*E]M[*E]' (quote it: * and | mean something to the shell).
    /// Patterns may start with `-` (a dense MLP layer); the pattern `--` (two MLP
    /// layers) reads as the end of the options, so write it after one: `check -- --`.
    #[arg(allow_hyphen_values = true)]
    pattern: String,
}

pub(crate) fn run(args: &CheckArgs) -> Result<(), Failure> {
    match Pattern::parse(&args.pattern) {
        Ok(pattern) => super::emit(&format!("{}\n", summary(&pattern))),
        Err(diagnostics) => {
            eprintln!("{diagnostics}");
            Err(Failure::Invalid)
        }
    }
}

/// One line: counts and the canonical form.
fn summary(pattern: &Pattern) -> String {
    let groups = pattern.items().filter(|i| i.is_group()).count();
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    let mut parts = vec![
        plural(pattern.physical_count(), "physical layer"),
        format!("{} logical", pattern.logical_count()),
        plural(groups, "group"),
    ];
    if pattern.has_pipeline_segments() {
        parts.push(plural(pattern.segments.len(), "pipeline segment"));
    }
    parts.push(plural(pattern.mtp_depth_count(), "MTP depth"));
    format!(
        "ok: {}; canonical: {}",
        parts.join(", "),
        pattern.canonical()
    )
}

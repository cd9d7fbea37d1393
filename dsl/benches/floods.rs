//! Patterns made of mistakes: how long parsing and rendering take, and how
//! big the report is, for floods of errors and very long lines. The figures
//! should grow linearly with the input (never quadratically) and the report
//! should stay a few kilobytes. A plain `main` that prints the figures (no
//! assertions: machines differ).
//!
//! `cargo bench -p hybridgen-dsl --bench floods`

use hybridgen_dsl::Pattern;
use hybridgen_dsl::pattern::MAX_PATTERN_BYTES;
use std::time::{Duration, Instant};

fn main() {
    let cases: Vec<(&str, String)> = vec![
        ("120,000 `]`", "]".repeat(120_000)),
        (
            "1,048,576 `]` (the length limit)",
            "]".repeat(MAX_PATTERN_BYTES),
        ),
        ("10 MB of `M` (over the limit)", "M".repeat(10_000_000)),
        (
            "1 MiB of spaces, then `x`",
            format!("{}x", " ".repeat(MAX_PATTERN_BYTES - 1)),
        ),
        (
            "349,525 unclosed `[M|`",
            "[M|".repeat(MAX_PATTERN_BYTES / 3),
        ),
        ("`[E{100000}M]`", "[E{100000}M]".to_string()),
        (
            "`/M{1000}` then 100,000 `/`",
            format!("/M{{1000}}{}", "/".repeat(100_000)),
        ),
    ];
    println!(
        "{:<36} {:>10} {:>10} {:>10} {:>12}",
        "input", "parse", "render", "errors", "report bytes"
    );
    for (name, source) in &cases {
        let start = Instant::now();
        let parsed = Pattern::parse(source);
        let parse = start.elapsed();
        let (render, errors, bytes) = match parsed {
            Ok(_) => (Duration::ZERO, 0, 0),
            Err(diagnostics) => {
                let start = Instant::now();
                let report = diagnostics.to_string();
                (start.elapsed(), diagnostics.total(), report.len())
            }
        };
        println!(
            "{name:<36} {:>7.0} ms {:>7.1} ms {errors:>10} {bytes:>12}",
            parse.as_secs_f64() * 1e3,
            render.as_secs_f64() * 1e3
        );
    }
}

//! Parse + plan throughput: a 100,000-layer pattern with the `tiny` preset's
//! dimensions, and the two Nemotron presets. Target: 100,000 layers planned in
//! under 50 ms on one core.
//!
//! Run with `cargo bench -p hybridgen-dsl --bench plan`. A plain `main` (no
//! criterion): each case runs a few times and the median is printed.

use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions};
use std::hint::black_box;
use std::time::{Duration, Instant};

const RUNS: usize = 9;
/// The figure the 100,000-layer cases must beat.
const TARGET: Duration = Duration::from_millis(50);

struct Case {
    name: &'static str,
    preset: &'static str,
    /// Replaces the preset's pattern when set.
    pattern: Option<String>,
    layout: ParallelLayout,
    /// Held to the 50 ms target.
    large: bool,
}

fn main() {
    let long_literal = "M*-E".repeat(25_000);
    let cases = [
        Case {
            name: "(M[*E]M-){20000}, tiny, dp 8 ep 4",
            preset: "tiny",
            pattern: Some("(M[*E]M-){20000}".to_string()),
            layout: ParallelLayout::new(8, 4),
            large: true,
        },
        Case {
            name: "[*E]{50000}, tiny, dp 1",
            preset: "tiny",
            pattern: Some("[*E]{50000}".to_string()),
            layout: ParallelLayout::new(1, 1),
            large: true,
        },
        Case {
            name: "100,000-symbol literal M*-E..., tiny, dp 4 ep 2",
            preset: "tiny",
            pattern: Some(long_literal),
            layout: ParallelLayout::new(4, 2),
            large: true,
        },
        Case {
            name: "nemotron-nano-9b-v2, dp 8",
            preset: "nemotron-nano-9b-v2",
            pattern: None,
            layout: ParallelLayout::new(8, 1),
            large: false,
        },
        Case {
            name: "nemotron-3-nano-30b-a3b, dp 8 ep 8",
            preset: "nemotron-3-nano-30b-a3b",
            pattern: None,
            layout: ParallelLayout::new(8, 8),
            large: false,
        },
    ];

    println!("parse + plan, median of {RUNS} runs");
    let mut missed = Vec::new();
    for case in &cases {
        let mut model = ModelConfig::preset(case.preset).expect("built-in preset");
        if let Some(pattern) = &case.pattern {
            model.pattern = pattern.clone();
        }
        let options = PlanOptions {
            layout: case.layout.clone(),
            ..PlanOptions::default()
        };
        let mut times = Vec::with_capacity(RUNS);
        let mut layers = 0;
        for _ in 0..RUNS {
            let start = Instant::now();
            let plan = Plan::new(black_box(&model), black_box(&options)).expect("plans");
            times.push(start.elapsed());
            layers = plan.physical_layers();
            drop(black_box(plan));
        }
        times.sort_unstable();
        let median = times[RUNS / 2];
        println!(
            "{:<52} {:>7} layers {:>9.3} ms {:>8.0} ns/layer   (min {:.3} ms, max {:.3} ms)",
            case.name,
            layers,
            median.as_secs_f64() * 1e3,
            median.as_secs_f64() * 1e9 / layers.max(1) as f64,
            times[0].as_secs_f64() * 1e3,
            times[RUNS - 1].as_secs_f64() * 1e3,
        );
        if case.large && median >= TARGET {
            missed.push(case.name);
        }
    }
    if missed.is_empty() {
        println!(
            "every 100,000-layer case is under {} ms",
            TARGET.as_millis()
        );
    } else {
        println!(
            "over the {} ms target: {}",
            TARGET.as_millis(),
            missed.join("; ")
        );
    }
}

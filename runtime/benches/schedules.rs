//! Tokens per second and the hidden share of comm-lane time for the two
//! schedules on the CPU backend. Run with `cargo bench -p hybridgen-runtime
//! --bench schedules`. Prints figures; asserts nothing about time.
//!
//! On the CPU the comm lane's busy time includes waiting for peers inside
//! collectives, so "hidden" is the share of that time the compute lane
//! spent working: what the overlap schedule is for.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, train};

fn main() {
    let runs = 5;
    println!(
        "{:<14} {:<8} {:>12} {:>10} {:>8}",
        "pattern", "schedule", "tokens/s", "step ms", "hidden"
    );
    for pattern in ["[*E][*E][*E]", "M[*E]M-[*E]", "[M*E][M*E]"] {
        let mut best = Vec::new();
        for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            let mut model = ModelConfig::preset("tiny").expect("preset");
            model.pattern = pattern.to_string();
            let mut config = TrainConfig::new(model);
            config.steps = 24;
            config.schedule = kind;
            // Median of a few runs.
            let mut results: Vec<(f64, f64, f64)> = (0..runs)
                .map(|_| {
                    let summary = train(&config, &mut |_| {}).expect("training run");
                    (
                        summary.tokens_per_second,
                        summary.mean_step_time.as_secs_f64() * 1e3,
                        summary.hidden_fraction().unwrap_or(0.0),
                    )
                })
                .collect();
            results.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (tps, ms, hidden) = results[runs / 2];
            println!(
                "{pattern:<14} {:<8} {tps:>12.0} {ms:>10.1} {:>7.0}%",
                format!("{kind:?}").to_lowercase(),
                hidden * 100.0
            );
            best.push(tps);
        }
        println!("{pattern:<14} overlap / plain = {:.2}x", best[1] / best[0]);
    }
}

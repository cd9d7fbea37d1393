//! Step time, tokens per second and the hidden share of comm-lane time for
//! the two schedules on the CPU backend. Run with `cargo bench -p
//! hybridgen-runtime --bench schedules`. Prints figures; asserts nothing
//! about time.
//!
//! Every figure is measured between steps, never over the whole run: the
//! first step of each run (which sizes the arenas) is left out, and so are
//! thread start-up, initialisation and the final parameter hash. Step time
//! is the median of rank 0's step times (`StepReport::elapsed`: forward,
//! backward and optimizer) over the later steps of every run; tokens per
//! second is one step's tokens over that median.
//!
//! On the CPU the comm lane's busy time includes waiting for peers inside
//! collectives, so "hidden" is the share of that time the compute lane
//! spent working: what the overlap schedule is for. It is read from each
//! run's trace, over the spans after the first step's optimizer update.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::trace::{Span, rank_stats};
use hybridgen_runtime::train::{TrainConfig, train};
use serde_json::Value;
use std::time::Duration;

/// Runs per pattern and schedule, and steps per run.
const RUNS: usize = 3;
const STEPS: u64 = 24;

fn main() {
    println!(
        "{:<14} {:<8} {:>9} {:>9} {:>9} {:>12} {:>7}",
        "pattern", "schedule", "step ms", "p10 ms", "p90 ms", "tokens/s", "hidden"
    );
    for pattern in ["[*E][*E][*E]", "M[*E]M-[*E]", "[M*E][M*E]"] {
        let mut medians = Vec::new();
        for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            let mut model = ModelConfig::preset("tiny").expect("preset");
            model.pattern = pattern.to_string();
            let mut config = TrainConfig::new(model);
            config.steps = STEPS;
            config.schedule = kind;
            let trace = std::env::temp_dir().join(format!(
                "hybridgen-bench-schedules-{}.json",
                std::process::id()
            ));
            config.trace = Some(trace.clone());
            let mut step_times = Vec::new();
            let (mut busy, mut hidden) = (Duration::ZERO, Duration::ZERO);
            for _ in 0..RUNS {
                let mut times = Vec::new();
                train(&config, &mut |r| times.push(r.elapsed)).expect("training run");
                step_times.extend(times.into_iter().skip(1));
                let spans = spans_after_the_first_step(&trace);
                for rank in rank_stats(&spans) {
                    busy += rank.comm_busy;
                    hidden += rank.hidden;
                }
            }
            let _ = std::fs::remove_file(&trace);
            step_times.sort();
            let at = |q: f64| {
                step_times[((step_times.len() - 1) as f64 * q).round() as usize].as_secs_f64()
            };
            let median = at(0.5);
            let tokens_per_second = config.tokens_per_step() as f64 / median;
            let hidden_share = if busy.is_zero() {
                0.0
            } else {
                hidden.as_secs_f64() / busy.as_secs_f64()
            };
            println!(
                "{pattern:<14} {:<8} {:>9.2} {:>9.2} {:>9.2} {tokens_per_second:>12.0} {:>6.0}%",
                format!("{kind:?}").to_lowercase(),
                median * 1e3,
                at(0.1) * 1e3,
                at(0.9) * 1e3,
                hidden_share * 100.0
            );
            medians.push(median);
        }
        println!(
            "{pattern:<14} overlap / plain tokens/s = {:.2}x",
            medians[0] / medians[1]
        );
    }
}

/// The spans of a run's Chrome trace that started after its first step's
/// optimizer update ended, rank by rank (lanes by their trace thread ids:
/// compute 0, comm 1).
fn spans_after_the_first_step(path: &std::path::Path) -> Vec<Span> {
    let text = std::fs::read_to_string(path).expect("the run's trace");
    let trace: Value = serde_json::from_str(&text).expect("a Chrome trace");
    let micros = |v: &Value| Duration::from_secs_f64(v.as_f64().unwrap_or(0.0) / 1e6);
    let events: Vec<&Value> = trace["traceEvents"]
        .as_array()
        .expect("trace events")
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    let rank_of = |e: &Value| e["pid"].as_u64().unwrap_or(0) as usize;
    let first_update_end = |rank: usize| {
        events
            .iter()
            .filter(|e| rank_of(e) == rank)
            .filter(|e| {
                e["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("optimizer step"))
            })
            .map(|e| micros(&e["ts"]) + micros(&e["dur"]))
            .min()
            .unwrap_or(Duration::MAX)
    };
    let ranks = events.iter().map(|e| rank_of(e)).max().map_or(0, |r| r + 1);
    let after: Vec<Duration> = (0..ranks).map(first_update_end).collect();
    events
        .iter()
        .filter(|e| micros(&e["ts"]) >= after[rank_of(e)])
        .map(|e| {
            let lane = match e["tid"].as_u64() {
                Some(0) => "compute",
                Some(1) => "comm",
                _ => "other",
            };
            let start = micros(&e["ts"]);
            Span {
                rank: rank_of(e),
                lane: lane.into(),
                name: e["name"].as_str().unwrap_or_default().to_string().into(),
                category: "",
                micro_batch: None,
                start,
                end: start + micros(&e["dur"]),
            }
        })
        .collect()
}

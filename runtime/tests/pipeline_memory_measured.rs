//! The memory check under pipeline parallelism against what a pipelined
//! run really allocates. A counting allocator measures the heap (the CPU
//! backend's buffers are heap `Vec`s, every thread rank's in this one
//! process); this file holds a single test so nothing else runs in the
//! process meanwhile.

use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions};
use hybridgen_runtime::Precision;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, memory_need};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::peak_of;

/// `pattern` on `pp` pipeline ranks of one data-parallel rank each, one
/// step of long sequences: activations dominate what the run allocates.
fn config(pattern: &str, pp: usize, schedule: ScheduleKind, precision: Precision) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    if let Some(dsa) = model.dsa.as_mut() {
        dsa.indexer_loss_coeff = 0.01;
    }
    let mut config = TrainConfig::new(model);
    config.ranks = pp;
    config.pp = pp;
    config.ep = 1;
    config.steps = 1;
    config.micro_batches = 8;
    config.micro_batch_size = 4;
    config.seq_length = 128;
    config.schedule = schedule;
    config.precision = precision;
    config.recompute = Recompute::None;
    config
}

#[test]
fn the_estimate_covers_what_a_pipelined_run_allocates() {
    let mut report = String::new();
    let mut results = Vec::new();
    let runs = [
        ("M*E-M*E-", 2),
        ("M*E-M*E-", 4),
        ("M*E-M*E-/*E", 2),
        ("M*|E-|ME|*-", 2),
        // The newest kinds across stages: G's chunk states, D's indexer
        // (its loss on, so its scores' gradient is kept too).
        ("G-E-|D-ED", 2),
    ];
    for (pattern, pp) in runs {
        for precision in [Precision::F32, Precision::Bf16] {
            for schedule in [ScheduleKind::Plain, ScheduleKind::Overlap] {
                let c = config(pattern, pp, schedule, precision);
                let options = PlanOptions {
                    layout: ParallelLayout {
                        pp,
                        ..ParallelLayout::new(1, 1)
                    },
                    ..PlanOptions::default()
                };
                let plan = Plan::new(&c.model, &options).unwrap();
                let need = memory_need(&c, &plan).unwrap();
                let measured = peak_of(&c) as u64;
                let per_stage: Vec<String> = need
                    .stages
                    .iter()
                    .map(|s| format!("{} x {}", s.live_micro_batches, s.per_rank))
                    .collect();
                report += &format!(
                    "{pattern:<12} pp {pp} {precision} {schedule:?}: estimate {} ({}), measured {measured}\n",
                    need.total,
                    per_stage.join(", ")
                );
                results.push((pattern, pp, precision, schedule, need.total, measured));
            }
        }
    }
    println!("{report}");
    for (pattern, pp, precision, schedule, estimate, measured) in results {
        assert!(
            estimate >= measured,
            "{pattern} pp {pp} {precision} {schedule:?} under-estimated:\n{report}"
        );
        // An upper bound, but not a loose one. Each micro-batch in flight
        // is counted whole but for its working set, which the shared arena
        // holds once, with the arena's headroom (a quarter plus 1 MiB);
        // 1F1B keeps up to 5 here on a rank whose share of these small
        // models is a few MiB, and the backward of one frees what the
        // forward of the next reuses: 1.97 for `M*E-M*E-/*E` pp 2 in f32
        // under the overlap schedule, the most.
        assert!(
            estimate as f64 <= measured as f64 * 2.2,
            "{pattern} pp {pp} {precision} {schedule:?} over-estimated more than 2.2x:\n{report}"
        );
    }
}

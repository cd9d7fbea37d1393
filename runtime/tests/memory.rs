//! The memory preflight against what a run really allocates, and memory that
//! must not grow with the number of micro-batches. A counting allocator
//! measures the heap (the CPU backend's buffers are heap `Vec`s); this file
//! holds a single test so nothing else runs in the process meanwhile.

use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions};
use hybridgen_runtime::Precision;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, memory_need};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{measure, peak_of};

/// One rank, one step of long sequences through a small model: activations
/// dominate what the run allocates.
fn config(pattern: &str, schedule: ScheduleKind, precision: Precision) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    // `D` with its indexer loss on, which keeps the most: the indexer's
    // outputs and its score gradient, `seq` floats a token.
    model.dsa.as_mut().unwrap().indexer_loss_coeff = 0.01;
    let mut config = TrainConfig::new(model);
    config.ranks = 1;
    config.ep = 1;
    config.steps = 1;
    config.micro_batches = 3;
    config.micro_batch_size = 4;
    config.seq_length = 256;
    config.schedule = schedule;
    config.precision = precision;
    config
}

#[test]
fn the_estimate_covers_what_a_run_allocates_and_micro_batches_do_not_add_up() {
    let mut report = String::new();
    let mut results = Vec::new();
    // bf16 halves parameters and activations, not gradients, master
    // weights or optimizer state, and the CPU's kernels hold f32 copies of
    // their bf16 operands while they run.
    let patterns = [
        "M", "MMMMMM", "*", "+", "D", "-", "E", "G", "M*-E", "[*E]-/*",
    ];
    let runs = [Precision::F32, Precision::Bf16]
        .into_iter()
        .flat_map(|precision| patterns.map(|pattern| (pattern, precision)));
    for (pattern, precision) in runs {
        for schedule in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            let mut c = config(pattern, schedule, precision);
            if pattern == "D" {
                // Long enough that the indexer's scores and their
                // gradient, `seq` floats a token each, are most of the
                // layer: an estimate without them falls short.
                c.seq_length = 2048;
                c.micro_batch_size = 1;
            }
            let options = PlanOptions {
                layout: ParallelLayout::new(1, 1),
                ..PlanOptions::default()
            };
            let plan = Plan::new(&c.model, &options).unwrap();
            let need = memory_need(&c, &plan).unwrap();
            let measured = peak_of(&c) as u64;
            report += &format!(
                "{pattern:<8} {precision} {schedule:?}: estimate {} (state {}, activations {} x {}), measured {}\n",
                need.per_rank,
                need.state.total,
                need.live_micro_batches,
                need.activations.total,
                measured
            );
            results.push((pattern, precision, schedule, need.per_rank, measured));
        }
    }
    println!("{report}");
    for (pattern, precision, schedule, estimate, measured) in results {
        // An upper bound, but not a loose one: a refusal must not turn away
        // runs that fit by a wide margin. The overlap schedule is counted as
        // two whole micro-batches in flight; its interleave frees one's
        // layers while the other's fill up, in one arena, so it needs
        // about one and a layer.
        assert!(
            estimate >= measured,
            "{pattern} {precision} {schedule:?} under-estimated:\n{report}"
        );
        // (One rank holds its units in its shards, with no pool or
        // gradient buffers: little state beside the activations, whose
        // estimate's margin then shows the most: 1.77 for `E` in f32, 1.57
        // for `E` in bf16. The estimate bounds a layer's backward by its
        // working set while its input gradient runs. Since the feed-forward
        // blocks recompute their activation in the backward instead of
        // keeping it, the measured peak of `E` in f32 fell by 1.64 MB, about
        // twice the activations it kept, and its estimate by those once,
        // 0.79 MB: the working set still counts the activation's gradient,
        // which the recomputed activation replaces.)
        let slack = match schedule {
            ScheduleKind::Plain => 1.8,
            ScheduleKind::Overlap => 2.5,
        };
        assert!(
            estimate as f64 <= measured as f64 * slack,
            "{pattern} {precision} {schedule:?} over-estimated more than {slack}x:\n{report}"
        );
    }

    // Micro-batch states are dropped as their work completes: a step of 40
    // micro-batches holds what a step of 2 does. Held means the arena's
    // peak in use, plus the heap beside the arena's segments (the host's
    // micro-batch tokens, the step's program). The heap itself is not the
    // measure: the arena grows in segments, and whether the lanes' threads
    // interleave so that one more segment is needed varies from run to run.
    let mut few = config("M*-E", ScheduleKind::Overlap, Precision::F32);
    few.seq_length = 64;
    few.micro_batches = 2;
    let mut many = few.clone();
    many.micro_batches = 40;
    let held = |config: &TrainConfig| {
        let (heap, summary) = measure(config);
        let beside = heap as u64 - summary.reserved_bytes.min(heap as u64);
        (summary.peak_allocated_bytes, beside)
    };
    let ((few_arena, few_beside), (many_arena, many_beside)) = (held(&few), held(&many));
    assert!(
        many_arena <= few_arena + few_arena / 10,
        "40 micro-batches peaked at {many_arena} arena bytes, 2 at {few_arena}"
    );
    // The program of 40 micro-batches is longer than that of 2: a few bytes
    // a micro-batch, not their activations.
    assert!(
        many_beside <= few_beside + few_arena / 10,
        "40 micro-batches held {many_beside} heap bytes beside the arena, 2 held {few_beside}"
    );
}

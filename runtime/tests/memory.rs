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
use counting_alloc::peak_of;

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
        // estimate's margin then shows the most: 1.52 for `E` in f32, 1.51
        // for `M` in bf16. The estimate bounds a layer's backward by its
        // working set while its input gradient runs; since the norms'
        // weight gradients keep partial sums instead of their inputs and
        // output gradients, a lone `M` layer's peak is that working set,
        // under the bound. In bf16 the head's logits are bf16 now, which
        // the CPU widens to an f32 copy while its loss kernel runs: that
        // raised the measured peaks, and `M` in bf16 went from 1.62 to
        // 1.51.)
        let slack = match schedule {
            ScheduleKind::Plain => 1.6,
            ScheduleKind::Overlap => 2.5,
        };
        assert!(
            estimate as f64 <= measured as f64 * slack,
            "{pattern} {precision} {schedule:?} over-estimated more than {slack}x:\n{report}"
        );
    }

    // Micro-batch states are dropped as their work completes: a step of 40
    // micro-batches peaks where a step of 2 does.
    let mut few = config("M*-E", ScheduleKind::Overlap, Precision::F32);
    few.seq_length = 64;
    few.micro_batches = 2;
    let mut many = few.clone();
    many.micro_batches = 40;
    let (few_peak, many_peak) = (peak_of(&few), peak_of(&many));
    assert!(
        many_peak <= few_peak + few_peak / 10,
        "40 micro-batches peaked at {many_peak} bytes, 2 at {few_peak}"
    );
}

/// On GPUs each rank has a device of its own: the need checked is one
/// rank's plus what the device itself takes, against the GPU's free memory,
/// and the refusal says so (and does not suggest fewer thread ranks).
#[test]
fn a_gpu_run_is_checked_per_gpu_with_the_devices_overhead() {
    use hybridgen_runtime::fsdp::Sharding;
    use hybridgen_runtime::memory::{AvailableMemory, FitHints};
    use hybridgen_runtime::optimizer::OptimizerKind;
    use hybridgen_runtime::train::GPU_OVERHEAD;
    let config = TrainConfig::new(ModelConfig::preset("tiny").unwrap());
    let plan = Plan::new(
        &config.model,
        &PlanOptions {
            layout: ParallelLayout::new(config.ranks, config.ep),
            ..PlanOptions::default()
        },
    )
    .unwrap();
    let need = memory_need(&config, &plan).unwrap();
    assert_eq!(
        need.total,
        need.per_rank * 2,
        "two thread ranks share the host"
    );
    // A GPU kernel scratch below the CPU's changes nothing.
    let per_gpu = need.clone().on_one_gpu(GPU_OVERHEAD, 0);
    assert_eq!(per_gpu.total, need.per_rank + GPU_OVERHEAD);
    let hints = FitHints {
        micro_batch_size: config.micro_batch_size,
        seq_length: config.seq_length,
        sharding: Sharding::Zero3,
        optimizer: OptimizerKind::Adam,
        recompute: config.recompute,
    };
    let free = |bytes| AvailableMemory {
        bytes,
        source: "free on cuda:0 (NVIDIA H200) of 139.8 GiB".into(),
    };
    assert_eq!(per_gpu.check(&free(per_gpu.total), &hints), None);
    let refusal = per_gpu.check(&free(GPU_OVERHEAD), &hints).unwrap();
    assert!(refusal.contains("each GPU rank, plus 1.2 GiB"), "{refusal}");
    assert!(refusal.contains("free on cuda:0"), "{refusal}");
    assert!(refusal.contains("more GPUs"), "{refusal}");
    assert!(!refusal.contains("fewer ranks"), "{refusal}");
}

//! Training in bf16 on the CPU (`--precision bf16`): parameters and
//! activations are stored in bf16 with the GPU's rounding points, while
//! master weights, gradient accumulation, gradient shards and optimizer state
//! stay f32 (`fsdp.rs`). The run must really be bf16, keep the schedules'
//! bit parity, and converge where the f32 run does.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::Precision;
use hybridgen_runtime::backend::DeviceStats;
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, TrainSummary, train};
use serde_json::Value;
use std::path::PathBuf;

/// `hybridgen train`'s defaults (the tiny preset, two ranks, EP 2, the
/// overlap schedule, ZeRO-3, 120 steps) in `precision`.
fn default_run(precision: Precision) -> TrainConfig {
    let mut config = TrainConfig::new(ModelConfig::preset("tiny").unwrap());
    config.precision = precision;
    config
}

/// Every step's main, MTP and aux losses and gradient norm, as bits.
type Steps = Vec<[u64; 4]>;

struct Run {
    steps: Steps,
    /// Rank 0's device memory in use after each step.
    in_use: Vec<u64>,
    summary: TrainSummary,
}

fn run(config: &TrainConfig) -> Run {
    let (mut steps, mut in_use) = (Vec::new(), Vec::new());
    let summary = train(config, &mut |r| {
        steps.push([
            r.loss.to_bits(),
            r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
            r.aux_loss.to_bits(),
            r.grad_norm.to_bits(),
        ]);
        let DeviceStats { in_use_bytes, .. } = r.device;
        in_use.push(in_use_bytes);
    })
    .unwrap_or_else(|e| panic!("{:?}: {e}", config.precision));
    assert_eq!(steps.len() as u64, summary.steps);
    Run {
        steps,
        in_use,
        summary,
    }
}

#[test]
fn bf16_training_of_the_default_model_ends_within_0_05_nats_of_f32() {
    let f32_run = run(&default_run(Precision::F32));
    let bf16_run = run(&default_run(Precision::Bf16));
    let loss = |r: &Run| r.summary.final_loss.expect("a final loss");
    let (f32_loss, bf16_loss) = (loss(&f32_run), loss(&bf16_run));
    println!(
        "120 steps of the default model: final loss f32 {f32_loss:.4}, bf16 {bf16_loss:.4} \
         ({:+.4} nats); first loss {:.4}; {:.1} s f32, {:.1} s bf16",
        bf16_loss - f32_loss,
        f32_run.summary.first_loss.unwrap_or(f64::NAN),
        f32_run.summary.wall.as_secs_f64(),
        bf16_run.summary.wall.as_secs_f64(),
    );
    assert!(
        (bf16_loss - f32_loss).abs() <= 0.05,
        "bf16 ended at {bf16_loss}, f32 at {f32_loss}"
    );
    // Both learned: the comparison means something only if the loss fell
    // far more than the tolerance.
    let first = f32_run.summary.first_loss.expect("a first loss");
    assert!(
        first - f32_loss > 1.0,
        "f32 fell from {first} to {f32_loss} only"
    );
    // And they are different runs, not one run twice.
    assert_ne!(bf16_run.summary.param_hash, f32_run.summary.param_hash);
}

#[test]
fn bf16_stores_parameters_and_activations_in_two_bytes() {
    // A few steps of the default model: a bf16 run that secretly computed
    // in f32 would give the f32 run's bits and use its memory.
    let few = |precision| {
        let mut config = default_run(precision);
        config.steps = 2;
        run(&config)
    };
    let (f32_run, bf16_run) = (few(Precision::F32), few(Precision::Bf16));
    // The first forward already rounds the parameters and activations.
    assert_ne!(bf16_run.steps[0][0], f32_run.steps[0][0], "the first loss");
    assert_ne!(bf16_run.summary.param_hash, f32_run.summary.param_hash);
    // Device memory after a step: parameter shards, the gathered units and
    // the arenas' activations halve, while master weights, gradients and
    // Adam's moments (f32 in both) stay. Between those bounds, or one of
    // the two halves is not what it should be.
    let (f32_bytes, bf16_bytes) = (f32_run.in_use[1] as f64, bf16_run.in_use[1] as f64);
    println!("rank 0 in use after step 2: f32 {f32_bytes} B, bf16 {bf16_bytes} B");
    assert!(
        bf16_bytes < 0.9 * f32_bytes && bf16_bytes > 0.5 * f32_bytes,
        "bf16 holds {bf16_bytes} bytes, f32 {f32_bytes}"
    );
}

/// A fresh path for a trace file of this test process.
fn trace_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "hybridgen-precision-{}-{name}.json",
        std::process::id()
    ))
}

/// The start times (microseconds) of rank 0's compute-lane spans of the
/// first step, of micro-batch `mb` and category `cat`, in order.
fn first_step_starts(trace: &Value, mb: u64, cat: &str) -> Vec<f64> {
    let events = trace["traceEvents"].as_array().expect("trace events");
    let rank0 = |e: &&Value| e["ph"] == "X" && e["pid"] == 0 && e["tid"] == 0;
    let start = |e: &Value| e["ts"].as_f64().expect("ts");
    // Every step starts by zeroing its loss sums.
    let mut step_starts: Vec<f64> = events
        .iter()
        .filter(rank0)
        .filter(|e| e["name"] == "zero loss sums")
        .map(start)
        .collect();
    step_starts.sort_by(f64::total_cmp);
    let end = step_starts.get(1).copied().unwrap_or(f64::INFINITY);
    let mut out: Vec<f64> = events
        .iter()
        .filter(rank0)
        .filter(|e| e["cat"] == cat && e["args"]["micro_batch"] == mb)
        .map(start)
        .filter(|&t| t < end)
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

#[test]
fn bf16_overlap_schedule_equals_plain_bit_for_bit() {
    // The tiny preset as it is, and with an MTP depth (its loss compared
    // too).
    for mtp in [false, true] {
        overlap_equals_plain_in_bf16(mtp);
    }
}

fn overlap_equals_plain_in_bf16(mtp: bool) {
    let curve = |schedule: ScheduleKind| {
        let mut config = default_run(Precision::Bf16);
        if mtp {
            config.model.pattern += "/*E";
        }
        config.steps = 3;
        config.ranks = 2;
        config.ep = 2;
        config.sharding = Sharding::Zero3;
        config.schedule = schedule;
        let path = trace_path(&format!("{schedule:?}-{mtp}"));
        config.trace = Some(path.clone());
        let run = run(&config);
        let text = std::fs::read_to_string(&path).expect("the trace");
        let _ = std::fs::remove_file(&path);
        let trace: Value = serde_json::from_str(&text).expect("trace JSON");
        (run, trace)
    };
    let (overlap, overlap_trace) = curve(ScheduleKind::Overlap);
    let (plain, plain_trace) = curve(ScheduleKind::Plain);
    assert_eq!(overlap.steps, plain.steps, "losses, aux, MTP, grad norms");
    assert_eq!(overlap.summary.param_hash, plain.summary.param_hash);
    let has_mtp = overlap.steps.iter().all(|s| !f64::from_bits(s[1]).is_nan());
    assert_eq!(
        has_mtp, mtp,
        "an MTP loss on every step exactly when MTP is on"
    );
    // Each run ran the schedule it was asked for: in the combined 1F1B
    // program micro-batch 1's forward runs between pieces of micro-batch
    // 0's backward; the plain one finishes a micro-batch's backward first.
    let interleaved = |trace: &Value| {
        let backward = first_step_starts(trace, 0, "backward");
        let (Some(&first), Some(&last)) = (backward.first(), backward.last()) else {
            panic!("micro-batch 0 has no backward in the first step's trace");
        };
        first_step_starts(trace, 1, "forward")
            .iter()
            .any(|&f| f > first && f < last)
    };
    assert!(interleaved(&overlap_trace), "overlap did not interleave");
    assert!(!interleaved(&plain_trace), "plain interleaved");
    // ZeRO-3: parameters are all-gathered on the comm lane.
    let gathers = |trace: &Value| {
        trace["traceEvents"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == 1 && e["cat"] == "gather")
            .count()
    };
    assert!(gathers(&overlap_trace) > 0 && gathers(&plain_trace) > 0);
}

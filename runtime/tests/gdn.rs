//! `G` (the gated delta net) trains on the CPU end to end: in grouped,
//! ungrouped and MTP patterns, in f32 and bf16, the overlap schedule gives
//! the plain schedule's bits, ZeRO-3 gives no_shard's, recomputation
//! changes nothing, and the loss falls. Every parity run reads its trace to
//! check that the schedule and sharding compared are the ones that ran. On
//! a GPU, `prepare` refuses `G` before any work, naming the missing kernel.

use hybridgen_dsl::{LayerKind, ModelConfig, ParallelLayout, Plan, PlanOptions, UnitFilter};
use hybridgen_runtime::Precision;
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, prepare, prepare_on, train};
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A small run of the tiny preset (whose `[gdn]` has 2 key heads of 16 and
/// 4 value heads of 16) with `pattern`.
fn config(pattern: &str) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let mut config = TrainConfig::new(model);
    config.steps = 3;
    config.micro_batches = 3;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config.recompute = Recompute::None;
    config
}

/// Per step, the bits of the main, MTP and aux losses and the gradient
/// norm; then the final parameter hash.
type Curve = (Vec<[u64; 4]>, u64);

#[path = "support/trace_ran.rs"]
mod trace_ran;
use trace_ran::{Ran, ran};

/// Trains `config` with a trace; its curve, main losses and what ran.
fn run(config: &TrainConfig) -> (Curve, Vec<f64>, Ran) {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "hybridgen-gdn-{}-{}.json",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let mut config = config.clone();
    config.trace = Some(path.clone());
    let mut steps = Vec::new();
    let mut losses = Vec::new();
    let result = train(&config, &mut |r| {
        losses.push(r.loss);
        steps.push([
            r.loss.to_bits(),
            r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
            r.aux_loss.to_bits(),
            r.grad_norm.to_bits(),
        ])
    });
    let text = std::fs::read_to_string(&path);
    let _ = std::fs::remove_file(&path);
    let summary = result.unwrap_or_else(|e| panic!("{}: {e}", config.model.pattern));
    assert_eq!(steps.len() as u64, config.steps);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let trace: Value = serde_json::from_str(&text.unwrap()).unwrap();
    ((steps, summary.param_hash), losses, ran(&trace))
}

/// Overlap against plain, ZeRO-3 against no_shard, recomputation against
/// none: the same bits, each run having run what it asked for.
fn parity(pattern: &str, edit: impl Fn(&mut TrainConfig)) {
    let with = |f: &dyn Fn(&mut TrainConfig)| {
        let mut c = config(pattern);
        edit(&mut c);
        f(&mut c);
        run(&c)
    };
    let (overlap, _, ran) = with(&|_| {});
    assert_eq!(
        ran,
        Ran {
            schedule: ScheduleKind::Overlap,
            sharding: Sharding::Zero3
        },
        "{pattern}"
    );
    let (plain, _, ran) = with(&|c| c.schedule = ScheduleKind::Plain);
    assert_eq!(ran.schedule, ScheduleKind::Plain, "{pattern}");
    assert_eq!(overlap, plain, "{pattern}: overlap vs plain");
    let (no_shard, _, ran) = with(&|c| c.sharding = Sharding::NoShard);
    assert_eq!(ran.sharding, Sharding::NoShard, "{pattern}");
    assert_eq!(overlap, no_shard, "{pattern}: ZeRO-3 vs no_shard");
    let (recomputed, _, _) = with(&|c| c.recompute = Recompute::Full);
    assert_eq!(overlap, recomputed, "{pattern}: full recompute vs none");
}

#[test]
fn grouped_gdn_with_experts_keeps_parity() {
    parity("M[GE]", |_| {});
}

#[test]
fn ungrouped_gdn_beside_attention_keeps_parity() {
    parity("G*G-E", |_| {});
}

#[test]
fn gdn_in_an_mtp_depth_keeps_parity() {
    parity("[GE]-/GE", |_| {});
}

/// `G` layers as the only FSDP units, the others in none between them.
#[test]
fn gdn_units_chosen_by_kind_keep_parity() {
    let units = |c: &mut TrainConfig| c.unit_filter = UnitFilter::parse_kinds("G").unwrap();
    let mut c = config("G*G-E");
    units(&mut c);
    let options = PlanOptions {
        layout: ParallelLayout::new(c.ranks, c.ep),
        unit_filter: c.unit_filter.clone(),
        ..PlanOptions::default()
    };
    let plan = Plan::new(&c.model, &options).unwrap();
    let gdn_layers = plan
        .layers
        .iter()
        .filter(|l| l.kind == LayerKind::GatedDeltaNet)
        .count();
    assert_eq!(
        (plan.units.len(), gdn_layers),
        (2, 2),
        "one unit per G layer"
    );
    parity("G*G-E", units);
}

#[test]
fn gdn_in_bf16_keeps_parity() {
    parity("M[GE]", |c| c.precision = Precision::Bf16);
}

/// The loss falls: thirty steps of `G*G-E` on the synthetic stream, in
/// f32 and bf16.
#[test]
fn the_loss_falls() {
    for precision in [Precision::F32, Precision::Bf16] {
        let mut c = config("G*G-E");
        c.steps = 30;
        c.precision = precision;
        c.optimizer.lr = 3e-3;
        let (_, losses, _) = run(&c);
        let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
        let (first, last) = (mean(&losses[..3]), mean(&losses[27..]));
        assert!(
            last < first - 0.3,
            "{precision}: the loss went from {first:.3} to {last:.3}: {losses:?}"
        );
    }
}

#[path = "support/fake_gpu.rs"]
mod fake_gpu;
use fake_gpu::a_gpu;

#[test]
fn a_gpu_takes_gdn_as_the_cpu_does() {
    for pattern in ["M[GE]", "G*G-E", "M[*E]/GE"] {
        let c = config(pattern);
        prepare_on(&c, a_gpu()).unwrap_or_else(|e| panic!("{pattern} on a GPU: {e}"));
        prepare(&c).unwrap_or_else(|e| panic!("{pattern} on the CPU: {e}"));
    }
}

/// Key heads wider than the GPU kernels take are refused before any work on
/// a GPU, naming the setting and the limit; the CPU trains them.
#[test]
fn a_gpu_refuses_key_heads_its_kernels_cannot_take() {
    let mut c = config("M[GE]");
    c.model.gdn.as_mut().unwrap().key_head_dim = 256;
    let err = prepare_on(&c, a_gpu()).err().expect("refused on a GPU");
    let text = err.to_string();
    assert!(
        text.contains("gdn.key_head_dim = 256") && text.contains("at most 128"),
        "{text}"
    );
    prepare(&c).unwrap_or_else(|e| panic!("on the CPU: {e}"));
    // A model file with wide heads but no `G` layer is not refused.
    c.model.pattern = "M[*E]".into();
    prepare_on(&c, a_gpu()).unwrap_or_else(|e| panic!("without G on a GPU: {e}"));
}

//! `D` (DeepSeek sparse attention) trains on the CPU end to end, its
//! indexer loss on, at expert parallelism 2: grouped with experts, after
//! Mamba, beside MLA (`*` cannot share a model with `D`: H009), in an MTP
//! depth and in bf16, the overlap schedule gives the plain schedule's bits,
//! ZeRO-3 gives no_shard's and recomputation changes nothing; a resume
//! continues the same curve, two pipeline stages train like one,
//! evaluation changes no training bit, and the loss falls. The step
//! reports the indexer loss (Megatron's "indexer loss", a mean over
//! micro-batches, ranks and `D` layers) when the model trains an indexer,
//! and with a zero coefficient the indexer does not train. Every parity run
//! reads its trace to check that the schedule and sharding compared are the
//! ones that ran.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::Precision;
use hybridgen_runtime::checkpoint::ResumeFrom;
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{StepReport, TrainConfig, TrainSummary, train};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The indexer loss coefficient the runs train with (Megatron's DSA test
/// uses 0.01).
const COEFF: f32 = 0.01;

/// A small run of the tiny preset (whose `[dsa]` has 2 indexer heads of 16)
/// with `pattern`: 16-token sequences of which each query keeps 4 keys, so
/// the selection drops keys from the fifth position on; two ranks, expert
/// parallelism 2 (the defaults).
fn config(pattern: &str) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let dsa = model.dsa.as_mut().unwrap();
    dsa.index_topk = 4;
    dsa.indexer_loss_coeff = COEFF;
    let mut config = TrainConfig::new(model);
    config.steps = 3;
    config.micro_batches = 3;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config.recompute = Recompute::None;
    assert_eq!((config.ranks, config.ep), (2, 2));
    config
}

/// Per step, the bits of the main, MTP, aux and indexer losses and the
/// gradient norm; then the final parameter hash.
type Curve = (Vec<[u64; 5]>, u64);

#[path = "support/trace_ran.rs"]
mod trace_ran;
use trace_ran::{Ran, ran};

/// A finished run.
struct Run {
    curve: Curve,
    reports: Vec<StepReport>,
    summary: TrainSummary,
    ran: Option<Ran>,
}

/// Trains `config` (with a trace when `traced`).
fn run(config: &TrainConfig, traced: bool) -> Run {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "hybridgen-dsa-{}-{}.json",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let mut config = config.clone();
    if traced {
        config.trace = Some(path.clone());
    }
    let mut reports = Vec::new();
    let result = train(&config, &mut |r| reports.push(r.clone()));
    let text = traced.then(|| std::fs::read_to_string(&path));
    let _ = std::fs::remove_file(&path);
    let summary = result.unwrap_or_else(|e| panic!("{}: {e}", config.model.pattern));
    assert_eq!(reports.len() as u64, summary.steps);
    let steps = reports
        .iter()
        .map(|r| {
            [
                r.loss.to_bits(),
                r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
                r.aux_loss.to_bits(),
                r.indexer_loss.unwrap_or(f64::NAN).to_bits(),
                r.grad_norm.to_bits(),
            ]
        })
        .collect();
    let ran = text.map(|t| ran(&serde_json::from_str(&t.unwrap()).unwrap()));
    Run {
        curve: (steps, summary.param_hash),
        reports,
        summary,
        ran,
    }
}

/// Every step reports an indexer loss above 0 and finite.
fn assert_indexer_loss_reported(case: &str, reports: &[StepReport]) {
    for r in reports {
        let loss = r.indexer_loss;
        assert!(
            loss.is_some_and(|l| l.is_finite() && l > 0.0),
            "{case} step {}: indexer loss {loss:?}",
            r.step
        );
    }
}

/// Overlap against plain, ZeRO-3 against no_shard, recomputation against
/// none: the same bits (the indexer loss's among them), each run having run
/// what it asked for.
fn parity(pattern: &str) {
    parity_with(pattern, |_| {});
}

/// [`parity`] with `edit` applied to every run.
fn parity_with(pattern: &str, edit: impl Fn(&mut TrainConfig)) {
    let with = |f: &dyn Fn(&mut TrainConfig)| {
        let mut c = config(pattern);
        edit(&mut c);
        f(&mut c);
        run(&c, true)
    };
    let overlap = with(&|_| {});
    assert_eq!(
        overlap.ran,
        Some(Ran {
            schedule: ScheduleKind::Overlap,
            sharding: Sharding::Zero3
        }),
        "{pattern}"
    );
    assert_indexer_loss_reported(pattern, &overlap.reports);
    let plain = with(&|c| c.schedule = ScheduleKind::Plain);
    assert_eq!(
        plain.ran.map(|r| r.schedule),
        Some(ScheduleKind::Plain),
        "{pattern}"
    );
    assert_eq!(overlap.curve, plain.curve, "{pattern}: overlap vs plain");
    let no_shard = with(&|c| c.sharding = Sharding::NoShard);
    assert_eq!(
        no_shard.ran.map(|r| r.sharding),
        Some(Sharding::NoShard),
        "{pattern}"
    );
    assert_eq!(
        overlap.curve, no_shard.curve,
        "{pattern}: ZeRO-3 vs no_shard"
    );
    // Every layer recomputed, then only the first: a recomputed `D` layer
    // runs its indexer again in the backward and must add no second loss.
    for recompute in [Recompute::Full, Recompute::Layers(1)] {
        let again = with(&|c| c.recompute = recompute);
        assert_eq!(
            overlap.curve, again.curve,
            "{pattern}: recompute {recompute} vs none"
        );
    }
}

#[test]
fn grouped_dsa_with_experts_keeps_parity() {
    parity("[DE]-");
}

#[test]
fn dsa_after_mamba_keeps_parity() {
    parity("M[DE]");
}

#[test]
fn ungrouped_dsa_beside_mla_keeps_parity() {
    parity("D+D-E");
}

#[test]
fn dsa_in_an_mtp_depth_keeps_parity() {
    parity("[DE]-/DE");
}

/// bf16 activations: the indexer's and the attention's inputs widened to
/// f32 by the CPU's kernels, the scores and the loss in f32 either way.
#[test]
fn dsa_in_bf16_keeps_parity() {
    parity_with("M[DE]", |c| c.precision = Precision::Bf16);
}

/// Evaluation runs the `D` layers forward only (their indexer loss is
/// computed and not reported) and changes nothing of the training: the
/// curve and parameters are those of a run that does not evaluate.
#[test]
fn evaluating_a_dsa_model_changes_no_training_bit() {
    let mut c = config("M[DE]");
    let plain = run(&c, false);
    (c.eval_every, c.eval_steps) = (Some(1), 2);
    let evaluated = run(&c, false);
    assert_eq!(plain.curve, evaluated.curve);
    for r in &evaluated.reports {
        let eval = r.eval_loss;
        assert!(
            eval.is_some_and(f64::is_finite),
            "step {}: {eval:?}",
            r.step
        );
    }
}

/// The loss falls: thirty steps of `[DE]-`, the indexer loss reported on
/// every one.
#[test]
fn the_loss_falls_and_the_indexer_loss_is_reported() {
    let mut c = config("[DE]-");
    c.steps = 30;
    let r = run(&c, false);
    assert_indexer_loss_reported("[DE]-", &r.reports);
    let losses: Vec<f64> = r.reports.iter().map(|r| r.loss).collect();
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    let (first, last) = (mean(&losses[..3]), mean(&losses[27..]));
    assert!(
        last < first - 0.3,
        "the loss went from {first:.3} to {last:.3}: {losses:?}"
    );
}

/// The reported indexer loss carries its coefficient: the first step's
/// forward does not depend on it (the indexer reads detached inputs and its
/// loss reaches only the indexer), so twice the coefficient reports twice
/// the loss, up to the f32 rounding of the per-row losses.
#[test]
fn the_indexer_loss_scales_with_its_coefficient() {
    let first = |coeff: f32| {
        let mut c = config("M[DE]");
        c.steps = 1;
        c.model.dsa.as_mut().unwrap().indexer_loss_coeff = coeff;
        let r = run(&c, false);
        (r.reports[0].loss, r.reports[0].indexer_loss.unwrap())
    };
    let (loss, once) = first(COEFF);
    let (loss_twice, twice) = first(2.0 * COEFF);
    assert_eq!(loss.to_bits(), loss_twice.to_bits());
    assert!(
        (twice / once - 2.0).abs() < 1e-5,
        "{once} at {COEFF}, {twice} at twice that"
    );
}

/// The pattern's parameters (and optimizer moments) in a checkpoint step
/// written by one rank, whose file holds every tensor whole.
fn saved_tensors(step_dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(step_dir.join("rank-00000.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect()
}

/// Trains `M[DE]` on one rank for three steps with `coeff`, saving every
/// step; each tensor whose name contains `indexer`: whether step 3's equals
/// step 1's.
fn indexer_tensors_unchanged(coeff: f32) -> BTreeMap<String, bool> {
    let root = std::env::temp_dir().join(format!(
        "hybridgen-dsa-frozen-{}-{coeff}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&root);
    let mut c = config("M[DE]");
    c.model.dsa.as_mut().unwrap().indexer_loss_coeff = coeff;
    (c.ranks, c.ep) = (1, 1);
    c.save = Some(root.clone());
    c.save_every = Some(1);
    // Decoupled weight decay would shrink the indexer's matrices without
    // any gradient; the default is none, as here.
    assert_eq!(c.optimizer.weight_decay, 0.0);
    let r = run(&c, false);
    assert_eq!(
        r.reports[0].indexer_loss.is_some(),
        coeff > 0.0,
        "an indexer loss is reported exactly when it is on"
    );
    let (first, last) = (
        saved_tensors(&root.join("step-000001")),
        saved_tensors(&root.join("step-000003")),
    );
    let _ = std::fs::remove_dir_all(&root);
    let indexer: BTreeMap<String, bool> = first
        .iter()
        .filter(|(name, _)| name.contains("indexer"))
        .map(|(name, bytes)| (name.clone(), last.get(name) == Some(bytes)))
        .collect();
    // The weights of the indexer's five parameters at least.
    assert!(indexer.len() >= 5, "{:?}", first.keys().collect::<Vec<_>>());
    // The rest of the layer trains either way.
    let attention = first
        .iter()
        .filter(|(name, _)| name.contains("linear_proj") && !name.contains("indexer"))
        .count();
    assert!(attention > 0);
    assert!(
        first
            .iter()
            .filter(|(name, _)| name.contains("linear_proj"))
            .all(|(name, bytes)| last.get(name) != Some(bytes)),
        "the attention's output projection trained"
    );
    indexer
}

/// Megatron's DSA without `dsa_indexer_loss_coeff`: no loss, and the
/// indexer does not train (its scores only choose keys, which has no
/// gradient). With a coefficient, every indexer tensor moves.
#[test]
fn without_a_coefficient_the_indexer_does_not_train() {
    let frozen = indexer_tensors_unchanged(0.0);
    assert!(frozen.values().all(|&same| same), "{frozen:?}");
    let trained = indexer_tensors_unchanged(COEFF);
    assert!(trained.values().all(|&same| !same), "{trained:?}");
}

#[test]
fn resume_continues_the_same_curve() {
    for (schedule, sharding) in [
        (ScheduleKind::Overlap, Sharding::Zero3),
        (ScheduleKind::Plain, Sharding::NoShard),
    ] {
        let dir: PathBuf = std::env::temp_dir().join(format!(
            "hybridgen-dsa-resume-{}-{schedule:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let with = |steps: u64, save: bool, resume: bool| {
            let mut c = config("M[DE]");
            c.schedule = schedule;
            c.sharding = sharding;
            c.steps = steps;
            c.save = save.then(|| dir.clone());
            c.resume = resume.then(|| ResumeFrom::Dir(dir.clone()));
            run(&c, false)
        };
        let straight = with(4, false, false);
        let first = with(2, true, false);
        // `steps` is where the run ends: the resumed run trains steps 3 and 4.
        let second = with(4, false, true);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(second.summary.resumed_from, Some(2));
        let numbers: Vec<u64> = second.reports.iter().map(|r| r.step).collect();
        assert_eq!(numbers, [3, 4]);
        let mut resumed = first.curve.0;
        resumed.extend(second.curve.0);
        assert_eq!(straight.curve.0, resumed, "{schedule:?}, {sharding:?}");
        assert_eq!(
            straight.curve.1, second.curve.1,
            "{schedule:?}, {sharding:?}"
        );
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
}

/// Two pipeline stages (2 data-parallel ranks each, EP 2) train like one:
/// the same losses and final parameters bit for bit. The indexer and aux
/// losses are summed a stage at a time before the stages are added, so
/// their reports are held to a tolerance, and the gradient norm's partials
/// are grouped by stage (`tests/pipeline.rs` says why).
#[test]
fn two_stages_train_like_one() {
    for pattern in ["D+|D-E", "[DE]|-[DE]"] {
        for schedule in [ScheduleKind::Overlap, ScheduleKind::Plain] {
            let mut one = config(pattern);
            one.schedule = schedule;
            let want = run(&one, false);
            let mut two = one.clone();
            (two.pp, two.ranks) = (2, 4);
            let got = run(&two, false);
            let case = format!("{pattern} {schedule:?}");
            assert_eq!(got.summary.stage_waits.len(), 2, "{case}: ran as stages");
            assert_indexer_loss_reported(&case, &got.reports);
            for (w, g) in want.reports.iter().zip(&got.reports) {
                assert_eq!(w.loss.to_bits(), g.loss.to_bits(), "{case} {}", w.step);
                let (wi, gi) = (w.indexer_loss.unwrap(), g.indexer_loss.unwrap());
                assert!(close(wi, gi, 1e-9), "{case} {}: {wi} {gi}", w.step);
                assert!(close(w.aux_loss, g.aux_loss, 1e-9), "{case} {}", w.step);
                assert!(close(w.grad_norm, g.grad_norm, 1e-12), "{case} {}", w.step);
            }
            assert_eq!(want.curve.1, got.curve.1, "{case}: final parameters");
        }
    }
}

/// The reported indexer loss is a mean, as Megatron's is: over the
/// micro-batches (scaled by 1/num_microbatches), the data-parallel ranks
/// and the `D` layers. Each is a mean of values of one order at the first
/// step (the same initial weights, other tokens or another layer), so four
/// micro-batches, two ranks or a second `D` layer report about what one
/// does; a sum would report about twice or four times as much.
#[test]
fn the_indexer_loss_is_a_mean_over_micro_batches_ranks_and_layers() {
    let first = |pattern: &str, ranks: usize, micro_batches: usize| {
        let mut c = config(pattern);
        (c.ranks, c.ep, c.micro_batches, c.steps) = (ranks, 1, micro_batches, 1);
        run(&c, false).reports[0].indexer_loss.unwrap()
    };
    let one = first("[DE]-", 1, 1);
    for (what, other) in [
        ("four micro-batches", first("[DE]-", 1, 4)),
        ("two ranks", first("[DE]-", 2, 1)),
        ("a D layer in an MTP depth too", first("[DE]-/DE", 1, 1)),
    ] {
        let ratio = other / one;
        assert!(
            (0.6..1.6).contains(&ratio),
            "{what}: {other} against {one} with one"
        );
    }
}

//! Pipeline parallelism on the CPU: a pattern's stages on `pp` ranks train
//! the same model as one rank does. The 1F1B order runs every micro-batch's
//! backward in micro-batch order on every stage, so each parameter's
//! gradient is made of the same additions in the same order, and the
//! losses are summed as without a pipeline: losses, and parameters, agree
//! bit for bit.
//!
//! Two sums are grouped differently, and the tests hold them to a
//! tolerance instead: the gradient norm (a stage's buckets are cut where
//! the pipeline rank changes, so its f64 partial sums are grouped by
//! stage; the clipping factor is rounded to f32, so the update does not
//! see the difference), and the MoE aux loss's report (each stage adds its
//! own layers'). Where the last stage needs the embedding table too (MTP
//! depths, tied output weights), its gradient is the sum of the two stages'
//! sums, added in another order than one rank adds the same terms: those
//! runs agree on the first step's losses and stay within a tolerance after.

use hybridgen_dsl::{ModelConfig, UnitFilter};
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{StepReport, TrainConfig, TrainSummary, train};

/// The tiny preset with `pattern`, short sequences.
fn config(pattern: &str) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let mut config = TrainConfig::new(model);
    config.steps = 3;
    config.micro_batches = 4;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config
}

fn run(config: &TrainConfig) -> (Vec<StepReport>, TrainSummary) {
    let mut reports = Vec::new();
    let summary = train(config, &mut |r| reports.push(r.clone()))
        .unwrap_or_else(|e| panic!("pp {} ranks {}: {e}", config.pp, config.ranks));
    (reports, summary)
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
}

/// `pattern` at pp 1 on `dp` ranks against each `(pp, schedule)`, with
/// `dp` data-parallel ranks a stage and expert parallelism `ep`.
fn same_as_one_stage(pattern: &str, dp: usize, ep: usize, pps: &[usize], units: Option<&str>) {
    let mut base = config(pattern);
    base.ranks = dp;
    base.ep = ep;
    if let Some(units) = units {
        base.unit_filter = UnitFilter::parse_kinds(units).unwrap();
    }
    for schedule in [ScheduleKind::Overlap, ScheduleKind::Plain] {
        base.schedule = schedule;
        let (want, want_summary) = run(&base);
        for &pp in pps {
            let mut c = base.clone();
            c.pp = pp;
            c.ranks = dp * pp;
            let (got, summary) = run(&c);
            let case = format!("{pattern} pp {pp} dp {dp} ep {ep} {schedule:?} units {units:?}");
            let shared = pattern.contains('/') || c.model.tie_embeddings;
            for (step, (w, g)) in want.iter().zip(&got).enumerate() {
                let exact = !shared || step == 0;
                if exact {
                    assert_eq!(
                        w.loss.to_bits(),
                        g.loss.to_bits(),
                        "{case} step {step} loss"
                    );
                    assert_eq!(
                        w.mtp_loss.map(f64::to_bits),
                        g.mtp_loss.map(f64::to_bits),
                        "{case} step {step} MTP loss"
                    );
                } else {
                    assert!(
                        close(w.loss, g.loss, 1e-5),
                        "{case} step {step}: {w:?} {g:?}"
                    );
                }
                // A shared embedding's gradient differs in its last bits
                // from the first step on, and the norm with it (and the
                // later steps' losses).
                let tol = if shared { 1e-4 } else { 1e-12 };
                let aux_tol = if shared { 1e-4 } else { 1e-9 };
                assert!(
                    close(w.aux_loss, g.aux_loss, aux_tol),
                    "{case} step {step} aux"
                );
                assert!(
                    close(w.grad_norm, g.grad_norm, tol),
                    "{case} step {step} norm"
                );
            }
            // It ran as stages: each pipeline rank reports its wait.
            assert_eq!(summary.stage_waits.len(), pp, "{case}");
            assert!(summary.ideal_bubble.is_some_and(|b| b > 0.0), "{case}");
            if !shared {
                assert_eq!(
                    want_summary.param_hash, summary.param_hash,
                    "{case}: final parameters"
                );
            }
        }
    }
}

#[test]
fn two_stages_train_like_one() {
    same_as_one_stage("M[*E]|M-[*E]", 1, 1, &[2], None);
}

#[test]
fn four_stages_with_data_and_expert_parallelism_train_like_one() {
    same_as_one_stage("[ME]*|E[*E]|M-|[*E]E", 2, 2, &[2, 4], None);
}

#[test]
fn interleaved_virtual_stages_train_like_one() {
    // Four segments on two ranks: two virtual stages a rank.
    same_as_one_stage("M*|E-|ME|*-", 1, 1, &[2], Some("M,*"));
}

#[test]
fn an_even_split_without_bars_trains_like_one() {
    same_as_one_stage("M*E-ME*-", 2, 1, &[2, 4], Some("group"));
}

#[test]
fn mtp_on_the_last_stage_shares_the_embedding() {
    same_as_one_stage("M[*E]|M-[*E]/*E", 1, 1, &[2], None);
}

/// What the pipeline cannot run is refused before any work, saying why.
#[test]
fn pipelines_that_cannot_be_are_refused_before_any_work() {
    let refused = |pattern: &str, edit: &dyn Fn(&mut TrainConfig)| {
        let mut c = config(pattern);
        edit(&mut c);
        let e = train(&c, &mut |_| panic!("a refused run trained")).unwrap_err();
        assert_eq!(e.code(), "invalid_config", "{pattern}: {e}");
        e.to_string()
    };
    let e = refused("M[*E]|M-[*E]", &|c| {
        c.ranks = 3;
        c.pp = 2;
        c.ep = 1;
    });
    assert!(
        e.contains("config.ranks = 3") && e.contains("config.pp = 2"),
        "{e}"
    );
    let e = refused("M[*E]|M-[*E]", &|c| {
        c.ranks = 4;
        c.pp = 2;
        c.ep = 4;
    });
    assert!(e.contains("expert-parallel"), "{e}");
    // Three segments do not divide over two ranks (H020).
    let e = refused("M*|E-|ME", &|c| {
        c.ranks = 2;
        c.pp = 2;
        c.ep = 1;
    });
    assert!(e.contains("H020"), "{e}");
    // An even split that cuts a group (H021).
    let e = refused("M[*E]-", &|c| {
        c.ranks = 2;
        c.pp = 2;
        c.ep = 1;
    });
    assert!(e.contains("H021"), "{e}");
    // Interleaving runs micro-batches in groups of pp.
    let e = refused("M*|E-|ME|*-", &|c| {
        c.ranks = 2;
        c.pp = 2;
        c.ep = 1;
        c.micro_batches = 3;
    });
    assert!(
        e.contains("config.micro_batches = 3") && e.contains("multiple of 2"),
        "{e}"
    );
    // Virtual stages with empty segments that leave the ranks uneven:
    // rank 0 runs two of them, rank 1 one.
    let e = refused("M*|E-|ME|||", &|c| {
        c.ranks = 2;
        c.pp = 2;
        c.ep = 1;
    });
    assert!(e.contains("virtual"), "{e}");
}

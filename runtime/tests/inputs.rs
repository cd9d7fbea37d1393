//! Inputs that cannot hang or exhaust a run: refused before any work with
//! the figures and the fix, or stopped with the root cause first.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::RuntimeError;
use hybridgen_runtime::checkpoint::ResumeFrom;
use hybridgen_runtime::data::DataChoice;
use hybridgen_runtime::train::{TrainConfig, train};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn config(preset: &str, pattern: Option<&str>) -> TrainConfig {
    let mut model = ModelConfig::preset(preset).unwrap();
    if let Some(pattern) = pattern {
        model.pattern = pattern.to_string();
    }
    let mut config = TrainConfig::new(model);
    config.steps = 2;
    config.micro_batches = 2;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    // The same figure on every machine.
    config.memory_available = Some(16 << 30);
    config
}

/// The plan a run of `config` makes.
fn plan_of(config: &TrainConfig) -> hybridgen_dsl::Plan {
    hybridgen_dsl::Plan::new(
        &config.model,
        &hybridgen_dsl::PlanOptions {
            layout: hybridgen_dsl::ParallelLayout::new(config.ranks, config.ep),
            ..Default::default()
        },
    )
    .unwrap()
}

/// The error of a run that must fail before its first step.
fn refused(config: &TrainConfig) -> RuntimeError {
    train(config, &mut |r| panic!("step {} ran", r.step)).unwrap_err()
}

#[test]
fn runs_that_cannot_fit_are_refused_with_the_figures_before_any_allocation() {
    let mut nemotron = config("nemotron-nano-9b-v2", None);
    nemotron.seq_length = 8192;
    let mut deep = config("tiny", Some("M{100000}"));
    deep.seq_length = 64;
    let mut wide = config("tiny", None);
    wide.micro_batch_size = 128;
    wide.seq_length = 16384;
    for (what, c) in [("nemotron", nemotron), ("M{100000}", deep), ("wide", wide)] {
        let started = Instant::now();
        let error = refused(&c);
        let took = started.elapsed();
        let message = error.to_string();
        assert_eq!(error.code(), "out_of_memory", "{what}: {message}");
        assert!(message.starts_with("this run needs "), "{what}: {message}");
        for figure in [
            "16.0 GiB is available (the configured limit)",
            "per rank: ",
            "2 thread ranks in this process: ",
            "to fit, try:",
        ] {
            assert!(
                message.contains(figure),
                "{what} lacks {figure:?}: {message}"
            );
        }
        // Refused before planning 100,000 layers (seconds) or allocating:
        // a guard against hanging, not a speed target.
        assert!(took < Duration::from_secs(30), "{what} took {took:?}");
        println!("{what}: refused in {took:?}");
    }
    // 100,000 layers are refused from the pattern, before planning them.
    let mut deep = config("tiny", Some("M{100000}"));
    deep.seq_length = 64;
    let message = refused(&deep).to_string();
    assert!(message.starts_with("this run needs at least "), "{message}");
    // The tips fit the cause: activations of a huge micro-batch.
    let mut wide = config("tiny", None);
    wide.micro_batch_size = 128;
    wide.seq_length = 16384;
    let message = refused(&wide).to_string();
    assert!(
        message.contains("a smaller micro-batch size (now 128) or sequence length (now 16384)"),
        "{message}"
    );
    // Between the bound made before planning and the full estimate: the
    // planned check refuses it, "about" rather than "at least" (keeping
    // every layer: `auto` would recompute some to fit).
    let mut c = config("tiny", None);
    c.recompute = hybridgen_runtime::recompute::Recompute::None;
    c.micro_batch_size = 8;
    c.seq_length = 512;
    let tokens = hybridgen_runtime::backend::Tokens::new(c.micro_batch_size, c.seq_length);
    let layout = hybridgen_runtime::memory::StateLayout {
        sharding: c.sharding,
        ranks: c.ranks,
        ep: c.ep,
        optimizer: c.optimizer.kind,
        resident_units: 0,
        grad_buffers: 0,
    };
    let sizes = hybridgen_runtime::memory::ElementSizes::CPU;
    let bound = hybridgen_runtime::memory::MemoryNeed::lower_bound(
        &c.model,
        layout,
        tokens,
        2,
        sizes,
        hybridgen_runtime::recompute::Recompute::None,
    )
    .unwrap()
    .total;
    let plan = plan_of(&c);
    let full = hybridgen_runtime::train::memory_need(&c, &plan)
        .unwrap()
        .total;
    assert!(bound < full, "{bound} {full}");
    c.memory_available = Some((bound + full) / 2);
    let message = refused(&c).to_string();
    assert!(message.starts_with("this run needs about "), "{message}");
    // And a run that fits is not refused.
    let mut fits = config("tiny", None);
    fits.steps = 1;
    train(&fits, &mut |_| {}).unwrap();
}

/// `--recompute auto` recomputes the fewest layers with which the run's
/// estimate fits, and all of them, refused with that need's figures, when
/// nothing fits.
#[test]
fn auto_recomputation_takes_the_fewest_layers_that_fit() {
    use hybridgen_runtime::recompute::Recompute;
    use hybridgen_runtime::train::{memory_need, prepare};
    // Six layers that can recompute, two MoE ones that cannot.
    let mut c = config("tiny", Some("MM*E-M*E"));
    c.micro_batch_size = 8;
    c.seq_length = 256;
    let plan = plan_of(&c);
    let base = c.clone();
    let need = |recompute| {
        let mut c = base.clone();
        c.recompute = recompute;
        memory_need(&c, &plan).unwrap().total
    };
    let needs: Vec<u64> = (0..=6).map(|n| need(Recompute::Largest(n))).collect();
    assert!(
        needs.windows(2).all(|w| w[1] < w[0]),
        "each layer recomputed needs less: {needs:?}"
    );
    assert_eq!(need(Recompute::Full), needs[6]);
    // The Mamba layers keep the most, so three of them fit in less than
    // the first three layers (two Mamba, one attention).
    assert!(needs[3] < need(Recompute::Layers(3)), "{needs:?}");
    assert_eq!(need(Recompute::None), needs[0]);
    c.recompute = Recompute::Auto;
    for (available, settled) in [
        (needs[0], Recompute::None),
        (needs[2], Recompute::Largest(2)),
        (needs[2] - 1, Recompute::Largest(3)),
        (needs[5], Recompute::Largest(5)),
        (needs[6], Recompute::Full),
    ] {
        c.memory_available = Some(available);
        let prepared = prepare(&c).unwrap();
        assert_eq!(prepared.config.recompute, settled, "{available} bytes");
        assert_eq!(prepared.memory.total, need(settled));
        let n = match settled {
            Recompute::None => 0,
            Recompute::Largest(n) => n,
            _ => 6,
        };
        assert_eq!(prepared.recomputed_layers(), (n, 6));
    }
    c.memory_available = Some(needs[6] - 1);
    let message = refused(&c).to_string();
    let about = format!("needs about {}", hybridgen_runtime::memory::bytes(needs[6]));
    assert!(message.contains(&about), "{about}: {message}");
    // A number of layers is taken as given.
    c.recompute = Recompute::Layers(4);
    c.memory_available = Some(u64::MAX);
    assert_eq!(prepare(&c).unwrap().config.recompute, Recompute::Layers(4));
}

#[test]
fn timeouts_outside_a_week_are_refused_and_long_ones_run() {
    for timeout in [Duration::ZERO, Duration::MAX, Duration::from_secs(u64::MAX)] {
        let mut c = config("tiny", None);
        c.timeout = timeout;
        let message = refused(&c).to_string();
        assert!(
            message.contains("must lie between 1 ms and 604800 s"),
            "{timeout:?}: {message}"
        );
    }
    // A week: every `Instant + timeout` and doubled lane timeout still fits
    // the clock.
    let mut c = config("tiny", None);
    c.steps = 1;
    c.timeout = Duration::from_secs(7 * 24 * 3600);
    train(&c, &mut |_| {}).unwrap();
}

#[test]
fn data_that_is_not_a_regular_file_is_refused_by_name() {
    let mut c = config("tiny", None);
    for (path, kind) in [("/dev/zero", "a character device"), ("/tmp", "a directory")] {
        c.data = DataChoice::File(PathBuf::from(path));
        let message = refused(&c).to_string();
        assert_eq!(
            message,
            format!("{path}: this is {kind}, not a data file; give a regular file of text")
        );
    }
    c.data = DataChoice::File(PathBuf::new());
    let message = refused(&c).to_string();
    assert!(message.contains("the path is empty"), "{message}");
}

#[test]
fn a_trace_path_that_cannot_be_written_is_refused_before_the_first_step() {
    let mut c = config("tiny", None);
    c.trace = Some(std::env::temp_dir());
    let message = refused(&c).to_string();
    assert!(message.contains("this is a directory"), "{message}");
    c.trace = Some(PathBuf::from("/nonexistent-hybridgen/trace.json"));
    let message = refused(&c).to_string();
    assert!(
        message.contains("cannot write the trace here: /nonexistent-hybridgen does not exist"),
        "{message}"
    );
}

#[test]
fn divergence_says_what_went_non_finite_and_why_for_these_settings() {
    // A huge learning rate without clipping: the update of step 1 blows the
    // weights up and step 2's loss is NaN, on every rank.
    let mut c = config("tiny", None);
    c.steps = 4;
    c.optimizer.lr = 1e30;
    c.optimizer.clip_grad = None;
    let mut steps = 0;
    let error = train(&c, &mut |_| steps += 1).unwrap_err();
    let message = error.to_string();
    assert_eq!(error.code(), "diverged", "{message}");
    assert_eq!(steps, 1, "{message}");
    assert!(
        message.starts_with("ranks 0, 1: training diverged at step 2: the loss is NaN"),
        "{message}"
    );
    assert!(message.contains("no gradient clipping"), "{message}");
    assert!(message.contains("learning rate 1e30"), "{message}");
    assert!(
        message.contains("turn gradient clipping on (config.optimizer.clip_grad = 1)"),
        "{message}"
    );
    // Weights that overflow before any update: not the learning rate.
    let mut c = config("tiny", None);
    c.model.init_std = 1e30;
    let message = refused(&c).to_string();
    assert!(message.contains("training diverged at step 1"), "{message}");
    assert!(
        message.contains("the learning rate is not the cause"),
        "{message}"
    );
    assert!(message.contains("gradient clipping at norm 1"), "{message}");
}

#[test]
fn a_failing_rank_is_reported_first_with_its_rank() {
    let dir = std::env::temp_dir().join(format!("hybridgen-rootcause-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = config("tiny", Some("[*E][*E]"));
    c.steps = 1;
    c.save = Some(dir.clone());
    train(&c, &mut |_| {}).unwrap();
    // Rank 1's pieces are gone: rank 1 fails while loading, rank 0 waits in
    // a collective until rank 1's abort reaches it.
    std::fs::remove_file(dir.join("step-000001").join("rank-00001.safetensors")).unwrap();
    let mut c = config("tiny", Some("[*E][*E]"));
    c.resume = Some(ResumeFrom::Dir(dir.clone()));
    let error = refused(&c);
    let _ = std::fs::remove_dir_all(&dir);
    let message = error.to_string();
    assert!(message.starts_with("rank 1: "), "{message}");
    let first = message.lines().next().unwrap();
    assert!(first.contains("rank-00001.safetensors"), "{message}");
    assert!(
        message.ends_with("rank 0 stopped because of it"),
        "{message}"
    );
    assert_eq!(error.code(), "io");
}

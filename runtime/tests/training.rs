//! End-to-end training on the CPU backend: the schedules, the sharding
//! strategies and expert parallelism change when work runs, never what is
//! computed, so losses and parameters must agree bit for bit
//! (shared/spec/ep-overlap.md, "Correctness bar").

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::RuntimeError;
use hybridgen_runtime::checkpoint::ResumeFrom;
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, train};

/// A small run: the tiny preset with `pattern`, short sequences.
fn config(pattern: &str) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let mut config = TrainConfig::new(model);
    config.steps = 3;
    config.micro_batches = 3;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config
}

/// What a parity test compares, per step, as bits: the main loss, the MTP
/// loss, the MoE aux loss and the gradient norm (all summed on the device in
/// an order the schedules must share), then the parameter hash.
type Curve = (Vec<[u64; 4]>, u64);

fn run(config: &TrainConfig) -> Curve {
    let mut steps = Vec::new();
    let summary = train(config, &mut |r| {
        steps.push([
            r.loss.to_bits(),
            r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
            r.aux_loss.to_bits(),
            r.grad_norm.to_bits(),
        ])
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(steps.len() as u64, summary.steps);
    (steps, summary.param_hash)
}

fn with(pattern: &str, edit: impl FnOnce(&mut TrainConfig)) -> Curve {
    let mut c = config(pattern);
    edit(&mut c);
    run(&c)
}

/// The main losses of a curve.
fn losses(curve: &Curve) -> Vec<u64> {
    curve.0.iter().map(|s| s[0]).collect()
}

#[test]
fn overlap_schedule_equals_plain_bit_for_bit() {
    // The spec's three patterns, shared experts on and off, ZeRO-3, EP 2.
    for pattern in ["[*E][*E]", "[M*E][M*E]", "M[+E]M-[+E]"] {
        for shared in [true, false] {
            let edit = |c: &mut TrainConfig| {
                if !shared {
                    c.model.moe.as_mut().unwrap().shared_expert_ffn_hidden_size = None;
                }
            };
            let overlap = with(pattern, |c| {
                edit(c);
                c.schedule = ScheduleKind::Overlap;
            });
            let plain = with(pattern, |c| {
                edit(c);
                c.schedule = ScheduleKind::Plain;
            });
            assert_eq!(overlap, plain, "{pattern}, shared expert {shared}");
        }
    }
}

#[test]
fn zero3_equals_no_shard_on_two_and_four_ranks() {
    // Clipping on every step and weight decay: the update depends on the
    // norm's bits and on which elements decay, so both must agree.
    let clipped = |c: &mut TrainConfig| {
        c.optimizer.clip_grad = Some(0.05);
        c.optimizer.weight_decay = 0.1;
    };
    for ranks in [2, 4] {
        let zero3 = with("[M*E][M*E]", |c| {
            clipped(c);
            c.ranks = ranks;
        });
        let no_shard = with("[M*E][M*E]", |c| {
            clipped(c);
            c.ranks = ranks;
            c.sharding = Sharding::NoShard;
        });
        assert_eq!(zero3, no_shard, "{ranks} ranks");
        assert!(
            zero3.0.iter().all(|s| f64::from_bits(s[3]) > 0.05),
            "every step must clip for this test to hold what it says"
        );
    }
}

#[test]
fn the_host_reads_the_moe_counts_and_the_step_end_only() {
    // Per step: one read per MoE layer and micro-batch (the all-to-all's
    // counts), then the loss sums and the gradient-norm partials.
    for (pattern, moe_layers) in [("[M*E][M*E]", 2), ("M*-", 0), ("[*E]M/*E", 2)] {
        let mut c = config(pattern);
        c.ep = if moe_layers == 0 { 1 } else { 2 };
        let mut reads = Vec::new();
        train(&c, &mut |r| reads.push(r.device.host_reads)).unwrap_or_else(|e| panic!("{e}"));
        let budget = (moe_layers * c.micro_batches + 2) as u64;
        assert_eq!(reads, vec![budget; c.steps as usize], "{pattern}");
    }
}

#[test]
fn four_ranks_overlap_equals_plain() {
    let overlap = with("[*E]M[*E]", |c| c.ranks = 4);
    let plain = with("[*E]M[*E]", |c| {
        c.ranks = 4;
        c.schedule = ScheduleKind::Plain;
    });
    assert_eq!(overlap, plain);
}

#[test]
fn multi_token_prediction_trains_and_keeps_parity() {
    let overlap = with("[M*E][M*E]/*E", |_| {});
    let plain = with("[M*E][M*E]/*E", |c| c.schedule = ScheduleKind::Plain);
    assert_eq!(overlap, plain);
    // Before the first update MTP only adds a head: the main loss is the
    // MTP-free model's, bit for bit (same data, same initial values). After
    // it, MTP's gradient has flowed into the shared layers.
    let without = with("[M*E][M*E]", |_| {});
    let (with_mtp, without_mtp) = (losses(&overlap), losses(&without));
    assert_eq!(with_mtp[0], without_mtp[0]);
    assert_ne!(with_mtp[1..], without_mtp[1..]);
    assert_ne!(overlap.1, without.1);
    assert!(overlap.0.iter().all(|s| f64::from_bits(s[1]) > 0.0));
}

#[test]
fn a_group_changes_no_maths() {
    // `[*-]` and `*-` are the same layers: one unit or two, the same bits.
    // Only the gradient norm's partial sums follow the buckets, which a group
    // changes, so the norm agrees to rounding (and clips by the same f32
    // factor here: the parameters are the same bits).
    for (grouped, ungrouped, ep) in [("[*-]", "*-", 1), ("M[*E]", "M*E", 2)] {
        let a = with(grouped, |c| c.ep = ep);
        let b = with(ungrouped, |c| c.ep = ep);
        assert_eq!(a.1, b.1, "{grouped}");
        for (x, y) in a.0.iter().zip(&b.0) {
            assert_eq!(x[..3], y[..3], "{grouped}");
            let (nx, ny) = (f64::from_bits(x[3]), f64::from_bits(y[3]));
            assert!(
                (nx - ny).abs() <= 1e-12 * nx,
                "{grouped}: norm {nx} vs {ny}"
            );
        }
    }
}

#[test]
fn another_seed_gives_other_bits() {
    // Guards the parity tests against passing because nothing they compare
    // depends on anything: another seed gives other losses and parameters.
    let a = with("[*E][*E]/*E", |_| {});
    let b = with("[*E][*E]/*E", |c| c.seed = 1);
    assert_ne!(a.1, b.1);
    // Each quantity compared per step: loss, MTP loss, aux loss, norm.
    for i in 0..4 {
        let each = |curve: &Curve| curve.0.iter().map(|s| s[i]).collect::<Vec<_>>();
        assert_ne!(each(&a), each(&b), "quantity {i}");
    }
}

#[test]
fn resume_continues_the_same_curve() {
    let dir = std::env::temp_dir().join(format!("hybridgen-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let straight = with("[M*E]-[*E]", |c| c.steps = 4);
    let first = with("[M*E]-[*E]", |c| {
        c.steps = 2;
        c.save = Some(dir.clone());
    });
    // `steps` is where the run ends: the resumed run trains steps 3 and 4.
    let second = with("[M*E]-[*E]", |c| {
        c.steps = 4;
        c.resume = Some(ResumeFrom::Dir(dir.clone()));
    });
    let _ = std::fs::remove_dir_all(&dir);
    let mut resumed = first.0;
    resumed.extend(second.0);
    assert_eq!(straight.0, resumed);
    assert_eq!(straight.1, second.1);
}

#[test]
fn a_checkpoint_loads_onto_another_layout() {
    let dir = std::env::temp_dir().join(format!("hybridgen-reshard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let saved = with("[*E][*E]", |c| {
        c.steps = 2;
        c.ranks = 4;
        c.save = Some(dir.clone());
    });
    // Written by ZeRO-3 on 4 ranks; loaded (zero further steps) by ZeRO-3 on
    // 4 ranks, ZeRO-3 on 2, and no_shard on 2: the same parameters. The
    // layout is the one setting a resume may change.
    for (ranks, sharding) in [
        (4, Sharding::Zero3),
        (2, Sharding::Zero3),
        (2, Sharding::NoShard),
    ] {
        let loaded = with("[*E][*E]", |c| {
            c.steps = 2;
            c.ranks = ranks;
            c.sharding = sharding;
            c.resume = Some(ResumeFrom::Dir(dir.clone()));
        });
        assert_eq!(loaded.1, saved.1, "{ranks} ranks, {sharding:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kinds_the_runtime_lacks_are_refused_before_work_starts() {
    for (pattern, symbol) in [("M[GE]", "`G`"), ("M[DE]", "`D`")] {
        let mut c = config(pattern);
        c.ep = 1;
        let err = train(&c, &mut |_| panic!("no step may run")).unwrap_err();
        match err {
            RuntimeError::Unsupported(m) => {
                assert!(m.contains(symbol) && m.contains("not supported"), "{m}")
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn impossible_layouts_are_refused_before_work_starts() {
    let mut c = config("[*E][*E]");
    c.ranks = 3;
    c.ep = 2;
    let err = train(&c, &mut |_| panic!("no step may run"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not divisible by --ep 2"), "{err}");
    let mut c = config("[*E][*E]");
    c.ranks = 3;
    c.ep = 3;
    let err = train(&c, &mut |_| panic!("no step may run"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("H023"), "{err}");
    let mut c = config("[*E]x");
    c.ep = 1;
    let err = train(&c, &mut |_| panic!("no step may run"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("H001"), "{err}");
}

#[test]
fn converges_to_near_the_entropy_floor() {
    // A bigram stream: embedding and output layer alone can learn it, so a
    // small model gets close to the floor within a couple of hundred steps.
    let mut c = config("*-");
    c.ranks = 1;
    c.ep = 1;
    c.steps = 150;
    c.micro_batches = 2;
    c.micro_batch_size = 8;
    c.seq_length = 32;
    c.optimizer.lr = 1e-2;
    let mut last = f64::NAN;
    let summary = train(&c, &mut |r| last = r.loss).unwrap();
    let floor = summary.entropy_floor.unwrap();
    assert!(
        last < floor + 0.25,
        "loss {last} is not near the floor {floor}"
    );
    assert!(
        last > floor - 0.1,
        "loss {last} is below the floor {floor}: the data leaks"
    );
}

/// The units the FSDP engine gathered in a run, from its trace.
fn gathered_units(pattern: &str) -> std::collections::BTreeSet<String> {
    let path = std::env::temp_dir().join(format!(
        "hybridgen-units-{}-{}.json",
        std::process::id(),
        pattern.replace(['[', ']', '*', '|', '/'], "_")
    ));
    with(pattern, |c| {
        c.steps = 1;
        c.trace = Some(path.clone());
    });
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .filter_map(|name| name.strip_prefix("gather decoder.layers."))
        .map(|unit| format!("decoder.layers.{unit}"))
        .collect()
}

#[test]
fn units_are_grouped_mixed_and_ungrouped_as_fsdp_md_says() {
    let set = |names: &[&str]| names.iter().map(|s| s.to_string()).collect();
    // Grouped: 2 units. Mixed: 4. Ungrouped: 3. Never a group's member alone.
    assert_eq!(
        gathered_units("[*E][*E]"),
        set(&["decoder.layers.0", "decoder.layers.1"])
    );
    assert_eq!(
        gathered_units("M[*E]M[*E]"),
        set(&[
            "decoder.layers.0",
            "decoder.layers.1",
            "decoder.layers.2",
            "decoder.layers.3"
        ])
    );
    assert_eq!(
        gathered_units("M*E"),
        set(&["decoder.layers.0", "decoder.layers.1", "decoder.layers.2"])
    );
}

#[test]
fn a_failing_rank_stops_the_others_with_the_root_cause() {
    let dir = std::env::temp_dir().join(format!("hybridgen-fault-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    with("[*E][*E]", |c| {
        c.steps = 1;
        c.save = Some(dir.clone());
    });
    // Rank 1's pieces are gone: rank 1 fails while loading, rank 0 loads
    // and waits in its first collective until rank 1's abort reaches it.
    std::fs::remove_file(dir.join("step-000001/rank-00001.safetensors")).unwrap();
    let mut c = config("[*E][*E]");
    c.steps = 2;
    c.resume = Some(ResumeFrom::Dir(dir.clone()));
    c.timeout = std::time::Duration::from_secs(600);
    let started = std::time::Instant::now();
    let err = train(&c, &mut |_| panic!("no step may complete")).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    let message = err.to_string();
    assert!(message.contains("rank-00001.safetensors"), "{message}");
    assert!(
        !matches!(err, RuntimeError::Peer { .. }),
        "the root cause, not a peer's report: {message}"
    );
    // Far below the 600 s collective timeout: the abort, not a timeout,
    // stopped rank 0.
    assert!(started.elapsed() < std::time::Duration::from_secs(300));
}

/// After the first step the device's pool holds every buffer a step needs:
/// later steps allocate nothing, on either schedule, with MTP and MoE.
#[test]
fn steps_after_the_first_allocate_nothing() {
    for (pattern, kind) in [
        ("M*-M*-/*-", ScheduleKind::Overlap),
        ("[M*E][M*E]/*E", ScheduleKind::Overlap),
        ("M[*E]M-", ScheduleKind::Plain),
    ] {
        let mut c = config(pattern);
        c.steps = 6;
        c.schedule = kind;
        let mut stats = Vec::new();
        train(&c, &mut |r| stats.push(r.device)).unwrap_or_else(|e| panic!("{e}"));
        assert!(stats[0].allocations > 0, "{pattern}: step 1 allocates");
        for (i, s) in stats.iter().enumerate().skip(1) {
            assert_eq!(
                s.allocations,
                0,
                "{pattern} {kind:?}: step {} allocated",
                i + 1
            );
        }
    }
}

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

/// Losses as bits, and the parameter hash.
fn run(config: &TrainConfig) -> (Vec<u64>, u64) {
    let mut losses = Vec::new();
    let summary =
        train(config, &mut |r| losses.push(r.loss.to_bits())).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(losses.len() as u64, summary.steps);
    (losses, summary.param_hash)
}

fn with(pattern: &str, edit: impl FnOnce(&mut TrainConfig)) -> (Vec<u64>, u64) {
    let mut c = config(pattern);
    edit(&mut c);
    run(&c)
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
    for ranks in [2, 4] {
        let zero3 = with("[M*E][M*E]", |c| c.ranks = ranks);
        let no_shard = with("[M*E][M*E]", |c| {
            c.ranks = ranks;
            c.sharding = Sharding::NoShard;
        });
        assert_eq!(zero3, no_shard, "{ranks} ranks");
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
    assert_eq!(overlap.0[0], without.0[0]);
    assert_ne!(overlap.0[1..], without.0[1..]);
    assert_ne!(overlap.1, without.1);
}

#[test]
fn a_group_changes_no_maths() {
    // `[*-]` and `*-` are the same layers: one unit or two, the same bits.
    let grouped = with("[*-]", |c| c.ep = 1);
    let ungrouped = with("*-", |c| c.ep = 1);
    assert_eq!(grouped, ungrouped);
    let grouped = with("M[*E]", |_| {});
    let ungrouped = with("M*E", |_| {});
    assert_eq!(grouped, ungrouped);
}

#[test]
fn another_seed_gives_other_bits() {
    // Guards the parity tests against passing because nothing they compare
    // depends on anything: another seed gives other losses and parameters.
    let a = with("[*E][*E]", |_| {});
    let b = with("[*E][*E]", |c| c.seed = 1);
    assert_ne!(a.1, b.1);
    assert_ne!(a.0, b.0);
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

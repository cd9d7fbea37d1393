//! End-to-end training on the CPU backend: the schedules, the sharding
//! strategies and expert parallelism change when work runs, never what is
//! computed, so losses and parameters must agree bit for bit
//! (docs/overlap-schedule.md, "Correctness"). Every run also checks,
//! from its trace, that the schedule and sharding it asked for are the ones
//! that ran: equal bits from two runs of the same path would prove nothing.
//!
//! Bit equality between ZeRO-3 and no_shard holds on the CPU, whose
//! collectives sum in rank order whatever the sequence of calls; on GPUs,
//! where NCCL promises determinism only for equal calls, those comparisons
//! become tolerances.

use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions, UnitFilter};
use hybridgen_runtime::RuntimeError;
use hybridgen_runtime::checkpoint::ResumeFrom;
use hybridgen_runtime::fsdp::{ShardLayout, Sharding};
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{StepReport, TrainConfig, TrainSummary, prepare, prepare_on, train};
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// A finished run: what it computed and what its trace shows it ran.
struct Run {
    curve: Curve,
    reports: Vec<StepReport>,
    summary: TrainSummary,
    trace: Value,
}

/// Trains `config` with a trace, and checks from the trace that every rank
/// ran the schedule and the sharding `config` asks for ([`ran`]).
fn run(config: &TrainConfig) -> Run {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "hybridgen-training-{}-{}.json",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    let mut config = config.clone();
    config.trace = Some(path.clone());
    let mut reports = Vec::new();
    let result = train(&config, &mut |r| reports.push(r.clone()));
    let text = std::fs::read_to_string(&path);
    let _ = std::fs::remove_file(&path);
    let summary = result.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reports.len() as u64, summary.steps);
    let trace: Value = serde_json::from_str(&text.unwrap()).unwrap();
    // A run of no steps (a checkpoint loaded and hashed) shows no path.
    if summary.steps > 0 {
        let asked = Ran {
            ranks: config.ranks,
            steps: summary.steps as usize,
            // One micro-batch: both programs are the same.
            schedule: (config.micro_batches > 1).then_some(config.schedule),
            sharding: (config.ranks > 1).then_some(config.sharding),
        };
        assert_eq!(
            ran(&trace, &plan(&config)),
            asked,
            "what ran is not what was asked for"
        );
    }
    let steps = reports
        .iter()
        .map(|r| {
            [
                r.loss.to_bits(),
                r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
                r.aux_loss.to_bits(),
                r.grad_norm.to_bits(),
            ]
        })
        .collect();
    Run {
        curve: (steps, summary.param_hash),
        reports,
        summary,
        trace,
    }
}

fn with(pattern: &str, edit: impl FnOnce(&mut TrainConfig)) -> Curve {
    run_with(pattern, edit).curve
}

fn run_with(pattern: &str, edit: impl FnOnce(&mut TrainConfig)) -> Run {
    let mut c = config(pattern);
    edit(&mut c);
    run(&c)
}

/// The plan `config` trains.
fn plan(config: &TrainConfig) -> Plan {
    let options = PlanOptions {
        layout: ParallelLayout::new(config.ranks, config.ep),
        unit_filter: config.unit_filter.clone(),
        ..PlanOptions::default()
    };
    Plan::new(&config.model, &options).unwrap()
}

/// The main losses of a curve.
fn losses(curve: &Curve) -> Vec<u64> {
    curve.0.iter().map(|s| s[0]).collect()
}

/// What a trace shows a run did, the same on every rank.
#[derive(Debug, PartialEq)]
struct Ran {
    ranks: usize,
    /// Steps run (each starts by zeroing the loss sums).
    steps: usize,
    /// Overlap: in every step, some forward piece of micro-batch m + 1 runs
    /// between two backward pieces of micro-batch m on the compute lane.
    /// Plain: every backward piece of m runs before any forward piece of
    /// m + 1. `None` for a single micro-batch.
    schedule: Option<ScheduleKind>,
    /// ZeRO-3: per step, every unit is all-gathered ("gather <unit>") and
    /// the non-unit parameters once ("gather non-unit"), nothing refreshed.
    /// no_shard: per step, every unit and the non-unit parameters are
    /// refreshed once from the masters, nothing gathered. Units whose every
    /// bucket a rank holds whole and alone (`ShardLayout::gathers_unit` is
    /// false) are neither: their shards are their buffers. `None`: a world
    /// of one, where that is every unit and the non-unit buckets, so
    /// nothing is gathered, refreshed or reduced under either sharding.
    sharding: Option<Sharding>,
}

/// One span of a Chrome trace.
struct Span<'a> {
    name: &'a str,
    category: &'a str,
    rank: u64,
    lane: u64,
    start: f64,
    micro_batch: Option<u64>,
}

/// Reads what ran from a run's trace; panics naming a rank and step whose
/// work follows neither schedule, or whose gathers follow neither sharding.
fn ran(trace: &Value, plan: &Plan) -> Ran {
    let mut spans: Vec<Span> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| Span {
            name: e["name"].as_str().unwrap(),
            category: e["cat"].as_str().unwrap(),
            rank: e["pid"].as_u64().unwrap(),
            lane: e["tid"].as_u64().unwrap(),
            start: e["ts"].as_f64().unwrap(),
            micro_batch: e["args"]["micro_batch"].as_u64(),
        })
        .collect();
    spans.sort_by(|a, b| {
        (a.rank, a.lane)
            .cmp(&(b.rank, b.lane))
            .then(a.start.total_cmp(&b.start))
    });
    let ranks: std::collections::BTreeSet<u64> = spans.iter().map(|s| s.rank).collect();
    let mut each = Vec::new();
    for &rank in &ranks {
        let mine: Vec<&Span> = spans.iter().filter(|s| s.rank == rank).collect();
        let count = |name: &str| mine.iter().filter(|s| s.name == name).count();
        let steps = count("zero loss sums");
        // The compute lane (tid 0) runs its work in issue order: split it
        // into steps, each a list of (micro-batch, forward?) pieces.
        let mut per_step: Vec<Vec<(u64, bool)>> = Vec::new();
        for s in mine.iter().filter(|s| s.lane == 0) {
            if s.name == "zero loss sums" {
                per_step.push(Vec::new());
            }
            let piece = match (s.micro_batch, s.category) {
                (Some(_), _) if s.name.starts_with("retire") => None,
                (Some(mb), "forward") => Some((mb, true)),
                (Some(mb), "backward" | "wgrad") => Some((mb, false)),
                _ => None,
            };
            if let (Some(piece), Some(step)) = (piece, per_step.last_mut()) {
                step.push(piece);
            }
        }
        let shapes: Vec<Option<ScheduleKind>> = per_step.iter().map(|s| schedule_of(s)).collect();
        let schedule = shapes[0];
        assert!(
            shapes.iter().all(|s| *s == schedule),
            "rank {rank}: the steps ran different schedules: {shapes:?}"
        );
        let layout = ShardLayout {
            sharding: Sharding::Zero3,
            world: ranks.len(),
            ep: plan.layout.ep,
        };
        let unit_gathers = (0..plan.units.len())
            .filter(|&u| layout.gathers_unit(plan, u))
            .map(|u| count(&format!("gather {}", plan.units[u].name)))
            .collect::<Vec<_>>();
        let pooled = unit_gathers.len();
        let gathers = mine
            .iter()
            .filter(|s| s.name.starts_with("gather "))
            .count();
        let refreshes = mine
            .iter()
            .filter(|s| s.name.starts_with("refresh "))
            .count();
        let non_unit = usize::from(!layout.sole_non_unit(plan));
        let reduces = mine
            .iter()
            .filter(|s| s.name.starts_with("reduce "))
            .count();
        let zero3 = count("gather non-unit") == non_unit * steps
            && unit_gathers.iter().all(|&n| n >= steps)
            && gathers == count("gather non-unit") + unit_gathers.iter().sum::<usize>()
            && refreshes == 0;
        let no_shard = count("refresh unit") == pooled * steps
            && count("refresh non-unit") == non_unit * steps
            && refreshes == count("refresh unit") + count("refresh non-unit")
            && gathers == 0;
        let sharding = match (zero3, no_shard) {
            // Nothing to tell them apart by: a world of one, whose
            // gradients are never reduced either.
            (true, true) if pooled == 0 && non_unit == 0 && reduces == 0 => None,
            (true, false) => Some(Sharding::Zero3),
            (false, true) => Some(Sharding::NoShard),
            _ => panic!(
                "rank {rank}: {steps} steps with unit gathers {unit_gathers:?}, \
                 {} non-unit gathers, {refreshes} refreshes: neither ZeRO-3 nor no_shard",
                count("gather non-unit")
            ),
        };
        each.push(Ran {
            ranks: ranks.len(),
            steps,
            schedule,
            sharding,
        });
    }
    let first = each.remove(0);
    for (rank, other) in each.iter().enumerate() {
        assert_eq!(*other, first, "rank {} ran otherwise than rank 0", rank + 1);
    }
    first
}

/// The schedule one step's compute-lane pieces follow (see [`Ran`]).
fn schedule_of(pieces: &[(u64, bool)]) -> Option<ScheduleKind> {
    let last = pieces.iter().map(|p| p.0).max().unwrap_or(0);
    if last == 0 {
        return None;
    }
    let at = |mb: u64, forward: bool| -> Vec<usize> {
        (0..pieces.len())
            .filter(|&i| pieces[i] == (mb, forward))
            .collect()
    };
    let (mut interleaved, mut in_order) = (true, true);
    for m in 0..last {
        let backward = at(m, false);
        let next_forward = at(m + 1, true);
        let (Some(&first_b), Some(&last_b)) = (backward.first(), backward.last()) else {
            panic!("micro-batch {m} ran no backward piece on the compute lane");
        };
        interleaved &= next_forward.iter().any(|&f| first_b < f && f < last_b);
        in_order &= next_forward.iter().all(|&f| f > last_b);
    }
    match (interleaved, in_order) {
        (true, false) => Some(ScheduleKind::Overlap),
        (false, true) => Some(ScheduleKind::Plain),
        _ => panic!("compute-lane pieces in neither schedule's order: {pieces:?}"),
    }
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
            assert!(
                overlap.0.iter().all(|s| f64::from_bits(s[2]) > 0.0),
                "{pattern}: the aux loss compared must be live"
            );
        }
    }
}

/// Unit choices that leave layers in no unit between units (the case the
/// unit filter exists for): three steps of the overlap schedule give the
/// plain schedule's bits, with the shared expert and without, and ZeRO-3
/// gives no-shard's. The trace shows the engine gathered exactly the units
/// the filter picked, never a layer outside them.
fn filtered_units_keep_parity(cases: &[(&str, &str)]) {
    for &(pattern, units) in cases {
        for shared in [true, false] {
            let edit = |c: &mut TrainConfig| {
                c.unit_filter = UnitFilter::parse_kinds(units).unwrap();
                if !shared {
                    c.model.moe.as_mut().unwrap().shared_expert_ffn_hidden_size = None;
                }
            };
            let label = format!("{pattern} --units {units}, shared expert {shared}");
            let overlap = run_with(pattern, |c| {
                edit(c);
                c.schedule = ScheduleKind::Overlap;
            });
            let plain = with(pattern, |c| {
                edit(c);
                c.schedule = ScheduleKind::Plain;
            });
            assert_eq!(overlap.curve, plain, "{label}: overlap vs plain");
            assert!(
                overlap.curve.0.iter().all(|s| f64::from_bits(s[2]) > 0.0),
                "{label}: the aux loss compared must be live"
            );
            let no_shard = with(pattern, |c| {
                edit(c);
                c.sharding = Sharding::NoShard;
            });
            assert_eq!(overlap.curve, no_shard, "{label}: ZeRO-3 vs no-shard");
            let mut c = config(pattern);
            edit(&mut c);
            let picked: std::collections::BTreeSet<String> =
                plan(&c).units.iter().map(|u| u.name.to_string()).collect();
            assert!(
                picked.len() < plan(&c).logical_layers.len(),
                "{label}: the filter must leave a layer out"
            );
            assert_eq!(gathered(&overlap.trace), picked, "{label}: units gathered");
        }
    }
}

#[test]
fn filtered_attention_units_overlap_equals_plain() {
    filtered_units_keep_parity(&[
        // Grouped: `M` between the groups is in no unit.
        ("[*E]M[*E]", "group"),
        // Mixed: the `E` kind picks the groups, not the `M` between them.
        ("M[*E]M[*E]", "E"),
        // Ungrouped: `M` and `*` between the `E` units.
        ("M*EM*E", "E"),
        // A regrouped Nemotron-3 pattern with an MTP depth.
        ("[ME][ME]M[*E][ME]M[*E]/*E", "group,mtp"),
    ]);
}

#[test]
fn filtered_mamba_units_overlap_equals_plain() {
    filtered_units_keep_parity(&[("[ME]*[ME]", "group"), ("*[ME]-[ME]", "E"), ("M*EM*E", "M")]);
}

#[test]
fn filtered_mla_units_overlap_equals_plain() {
    filtered_units_keep_parity(&[
        ("[+E]M[+E]", "group"),
        ("M[+E]-[+E]", "E"),
        ("+M-E+ME", "+,-"),
    ]);
}

#[test]
fn zero3_equals_no_shard_on_two_and_four_ranks() {
    // Clipping on every step and weight decay: the update depends on the
    // norm's bits and on which elements decay, so both must agree.
    let clipped = |c: &mut TrainConfig| {
        c.optimizer.clip_grad = Some(0.05);
        c.optimizer.weight_decay = 0.1;
    };
    // Both schedules: a unit's gathers and refreshes land elsewhere in each.
    for (ranks, schedule) in [
        (2, ScheduleKind::Overlap),
        (4, ScheduleKind::Overlap),
        (2, ScheduleKind::Plain),
    ] {
        let zero3 = with("[M*E][M*E]", |c| {
            clipped(c);
            c.ranks = ranks;
            c.schedule = schedule;
        });
        let no_shard = with("[M*E][M*E]", |c| {
            clipped(c);
            c.ranks = ranks;
            c.schedule = schedule;
            c.sharding = Sharding::NoShard;
        });
        assert_eq!(zero3, no_shard, "{ranks} ranks, {schedule:?}");
        assert!(
            zero3.0.iter().all(|s| f64::from_bits(s[3]) > 0.05),
            "every step must clip for this test to hold what it says"
        );
    }
}

/// Reads the host makes at the end of every step: one, of the loss sums
/// (main, MTP and aux, accumulated on the device over the micro-batches)
/// and the gradient-norm partials (one per bucket), which share a buffer.
const STEP_END_READS: u64 = 1;

#[test]
fn the_host_reads_the_moe_counts_and_the_step_end_only() {
    // Per step: under expert parallelism one read per MoE layer (MTP's
    // included) and micro-batch, the all-to-all's counts, then the step's
    // end; without it the step's end alone (the experts' GEMMs take their
    // rows on the device). On either schedule, either sharding, with
    // clipping; aux-loss-free balancing reads nothing more (its loads come
    // with the step's end).
    for (pattern, ep) in [
        ("[M*E][M*E]", 2),
        ("M*-", 1),
        ("[*E]M/*E", 2),
        ("M[*E]M-/*E", 1),
    ] {
        for schedule in [ScheduleKind::Overlap, ScheduleKind::Plain] {
            for sharding in [Sharding::Zero3, Sharding::NoShard] {
                let mut c = config(pattern);
                c.ep = ep;
                c.schedule = schedule;
                c.sharding = sharding;
                c.optimizer.clip_grad = Some(0.05);
                let moe_layers = plan(&c)
                    .schedule
                    .nodes
                    .iter()
                    .filter(|n| n.has_expert_exchange())
                    .count();
                let per_moe_layer = u64::from(ep > 1);
                let budget = per_moe_layer * (moe_layers * c.micro_batches) as u64 + STEP_END_READS;
                let reads = |c: &TrainConfig| -> Vec<u64> {
                    run(c).reports.iter().map(|r| r.device.host_reads).collect()
                };
                let case =
                    format!("{pattern} ({moe_layers} MoE layers), {schedule:?}, {sharding:?}");
                let unbalanced = reads(&c);
                assert_eq!(unbalanced, vec![budget; c.steps as usize], "{case}");
                if moe_layers > 0 {
                    balanced(&mut c, 0.05);
                    assert_eq!(reads(&c), unbalanced, "{case}, with an expert bias");
                }
            }
        }
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

/// layers.md, Model: MTP depth k rolls inputs and labels inside the sample
/// of S + 1 tokens (as Megatron does) instead of reading k tokens past it,
/// so a file of exactly one sample trains a model with two MTP depths.
#[test]
fn multi_token_prediction_reads_nothing_past_the_sample() {
    let path = std::env::temp_dir().join(format!("hybridgen-mtp-{}.txt", std::process::id()));
    // seq_length 16: one sample is 17 bytes.
    std::fs::write(&path, b"abcdefghijklmnopq").unwrap();
    let result = std::panic::catch_unwind(|| {
        with("[M*E]/*E/*E", |c| {
            c.data = hybridgen_runtime::data::DataChoice::File(path.clone());
            c.steps = 2;
        })
    });
    let _ = std::fs::remove_file(&path);
    let curve = result.expect("one sample of S + 1 tokens is enough for MTP");
    assert!(curve.0.iter().all(|s| f64::from_bits(s[1]).is_finite()));
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
fn recomputation_changes_no_bits_and_keeps_less() {
    // Dense layers (recomputed), MoE ones (which keep their activations),
    // a group, an MTP depth, both schedules.
    for (pattern, ep, schedule) in [
        ("M*-M*-", 1, ScheduleKind::Plain),
        ("[M*]-[*E]/*E", 2, ScheduleKind::Overlap),
    ] {
        let setup = |c: &mut TrainConfig| {
            c.ep = ep;
            c.schedule = schedule;
        };
        let keep = with(pattern, setup);
        // All of them, only the first two (a group's layer recomputed,
        // its other one kept), and the two that keep the most.
        for recompute in [Recompute::Full, Recompute::Layers(2), Recompute::Largest(2)] {
            let again = with(pattern, |c| {
                setup(c);
                c.recompute = recompute;
            });
            assert_eq!(keep, again, "{pattern} {recompute}");
        }
    }
    // What it is for: a dense model's layers keep only their inputs.
    // The summary reports the same peak, within what the arenas hold.
    let peak = |run: &Run| {
        let peak = run
            .reports
            .iter()
            .map(|r| r.device.peak_in_use_bytes)
            .max()
            .unwrap();
        assert_eq!(run.summary.peak_allocated_bytes, peak);
        assert!(0 < peak && peak <= run.summary.reserved_bytes);
        peak
    };
    let dense = |c: &mut TrainConfig| {
        c.ep = 1;
        c.seq_length = 64;
    };
    let keep = run_with("MMMM**--", dense);
    let again = run_with("MMMM**--", |c| {
        dense(c);
        c.recompute = Recompute::Full;
    });
    assert!(
        4 * peak(&again) < 3 * peak(&keep),
        "peak {} with recomputation, {} without",
        peak(&again),
        peak(&keep)
    );
    // Half the layers recomputed: a peak between the two.
    let half = run_with("MMMM**--", |c| {
        dense(c);
        c.recompute = Recompute::Layers(4);
    });
    assert!(
        peak(&again) < peak(&half) && peak(&half) < peak(&keep),
        "peak {} with all recomputed, {} with half, {} with none",
        peak(&again),
        peak(&half),
        peak(&keep)
    );
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
    for (schedule, sharding) in [
        (ScheduleKind::Overlap, Sharding::Zero3),
        (ScheduleKind::Plain, Sharding::NoShard),
    ] {
        let dir = std::env::temp_dir().join(format!(
            "hybridgen-resume-{}-{schedule:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let path = |c: &mut TrainConfig| {
            c.schedule = schedule;
            c.sharding = sharding;
        };
        let straight = with("[M*E]-[*E]", |c| {
            path(c);
            c.steps = 4;
        });
        let first = with("[M*E]-[*E]", |c| {
            path(c);
            c.steps = 2;
            c.save = Some(dir.clone());
        });
        // `steps` is where the run ends: the resumed run trains steps 3 and 4.
        let second = run_with("[M*E]-[*E]", |c| {
            path(c);
            c.steps = 4;
            c.resume = Some(ResumeFrom::Dir(dir.clone()));
        });
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(second.summary.resumed_from, Some(2));
        let numbers: Vec<u64> = second.reports.iter().map(|r| r.step).collect();
        assert_eq!(numbers, [3, 4]);
        let mut resumed = first.0;
        resumed.extend(second.curve.0);
        assert_eq!(straight.0, resumed, "{schedule:?}, {sharding:?}");
        assert_eq!(straight.1, second.curve.1, "{schedule:?}, {sharding:?}");
    }
}

#[path = "support/balancing.rs"]
mod balancing;
use balancing::balanced;

/// The expert biases a checkpoint step holds (rank 0's file keeps them).
fn saved_biases(step_dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(step_dir.join("rank-00000.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .filter(|(name, _)| name.ends_with(".mlp.router.expert_bias"))
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Aux-loss-free balancing (layers.md `E` step 3): the bias starts at zero,
/// moves by exactly the rate per step towards the mean load, changes what
/// is trained, is saved with the checkpoint and restored by a resume (the
/// resumed curve is the straight one bit for bit), and keeps the schedule
/// and sharding parity.
#[test]
fn expert_bias_is_trained_saved_and_resumed() {
    let pattern = "[M*E]-[*E]";
    let dir = std::env::temp_dir().join(format!("hybridgen-bias-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let straight = with(pattern, |c| {
        balanced(c, 0.05);
        c.steps = 5;
    });
    let frozen = with(pattern, |c| {
        balanced(c, 0.0);
        c.steps = 5;
    });
    assert_eq!(
        straight.0[0], frozen.0[0],
        "the first step routes with a zero bias"
    );
    assert_ne!(
        straight.0[1..],
        frozen.0[1..],
        "the updated bias changes the routing"
    );
    // Three steps: an odd number of +-rate moves cannot cancel (the bias of
    // this tiny model overshoots and swings back in two).
    let first = with(pattern, |c| {
        balanced(c, 0.05);
        c.steps = 3;
        c.save = Some(dir.clone());
    });
    let biases = saved_biases(&dir.join("step-000003"));
    let keys: Vec<&str> = biases.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "param/decoder.layers.0.mlp.router.expert_bias",
            "param/decoder.layers.2.mlp.router.expert_bias"
        ]
    );
    for (key, bias) in &biases {
        assert_eq!(bias.len(), 4, "{key}");
        // Three steps of +-0.05 (or 0 at the mean) from zero.
        for &b in bias {
            let steps = b / 0.05;
            assert!(
                (steps - steps.round()).abs() < 1e-5 && steps.abs() <= 3.0 + 1e-5,
                "{key}: {b} is not a sum of three steps of +-0.05"
            );
        }
        assert!(bias.iter().any(|&b| b != 0.0), "{key}: never moved");
        // Sign updates move some experts up and some down.
        assert!(
            bias.iter().any(|&b| b > 0.0) && bias.iter().any(|&b| b < 0.0),
            "{key}: {bias:?}"
        );
    }
    let second = with(pattern, |c| {
        balanced(c, 0.05);
        c.steps = 5;
        c.resume = Some(ResumeFrom::Dir(dir.clone()));
    });
    let _ = std::fs::remove_dir_all(&dir);
    let mut resumed = first.0;
    resumed.extend(second.0);
    assert_eq!(straight.0, resumed);
    assert_eq!(straight.1, second.1);
    let plain = with(pattern, |c| {
        balanced(c, 0.05);
        c.steps = 5;
        c.schedule = ScheduleKind::Plain;
        c.sharding = Sharding::NoShard;
    });
    assert_eq!(straight, plain, "overlap + ZeRO-3 against plain + no_shard");
}

/// Evaluation routes forward only: its tokens count in no expert's load,
/// so a run that evaluates after every step moves the expert biases, and
/// trains, bit for bit as one that does not (with and without expert
/// parallelism, whose loads come through different steps). Trained
/// without a trace: [`ran`] reads training steps only.
#[test]
fn evaluation_moves_no_expert_bias() {
    let curve = |ep: usize, eval_every: Option<u64>| {
        let mut c = config("[M*E]-[*E]");
        balanced(&mut c, 0.05);
        (c.ep, c.steps) = (ep, 5);
        (c.eval_every, c.eval_steps) = (eval_every, 1);
        let mut reports = Vec::new();
        let summary = train(&c, &mut |r| reports.push(r.clone())).unwrap();
        let steps: Vec<[u64; 3]> = reports
            .iter()
            .map(|r| {
                [
                    r.loss.to_bits(),
                    r.aux_loss.to_bits(),
                    r.grad_norm.to_bits(),
                ]
            })
            .collect();
        let evaluated = reports.iter().all(|r| r.eval_loss.is_some());
        (steps, summary.param_hash, evaluated)
    };
    for ep in [1, 2] {
        let (straight, hash, _) = curve(ep, None);
        let (evaluating, evaluating_hash, evaluated) = curve(ep, Some(1));
        assert!(evaluated, "ep {ep}: a step did not evaluate");
        assert_eq!(straight, evaluating, "ep {ep}");
        assert_eq!(hash, evaluating_hash, "ep {ep}");
    }
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
    // And trains on from there: one more step on 2 ranks, sharded or not,
    // to the same bits (each run checks its gathers or refreshes ran).
    let [zero3, no_shard] = [Sharding::Zero3, Sharding::NoShard].map(|sharding| {
        with("[*E][*E]", |c| {
            c.steps = 3;
            c.ranks = 2;
            c.sharding = sharding;
            c.resume = Some(ResumeFrom::Dir(dir.clone()));
        })
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(zero3.0.len(), 1);
    assert_eq!(zero3, no_shard);
    assert_ne!(zero3.1, saved.1);
}

#[path = "support/fake_gpu.rs"]
mod fake_gpu;
use fake_gpu::a_gpu;

/// `D` trains on the CPU (`tests/dsa.rs`) and on a GPU
/// (`tests/cuda_sparse_attention.rs`): a GPU's run is prepared like the
/// CPU's, in the decoder and in an MTP depth alike.
#[test]
fn dsa_is_prepared_for_a_gpu_as_for_the_cpu() {
    for pattern in ["M[DE]", "[+E]/DE"] {
        let mut c = config(pattern);
        c.ep = 1;
        prepare(&c).unwrap_or_else(|e| panic!("{pattern} on the CPU: {e}"));
        prepare_on(&c, a_gpu()).unwrap_or_else(|e| panic!("{pattern} on a GPU: {e}"));
    }
    // Indexer heads or latent rows (kv_lora_rank + rope, what `D` attends
    // over) wider than the GPU kernels take: refused before any work on a
    // GPU, naming the setting and the limit; the CPU trains them.
    for (setting, named) in [
        ("dsa.index_head_dim = 256", "dsa.index_head_dim = 256"),
        (
            "mla.kv_lora_rank = 1024",
            "mla.kv_lora_rank + mla.qk_rope_head_dim",
        ),
    ] {
        let mut c = config("M[DE]");
        c.ep = 1;
        if setting.starts_with("dsa") {
            c.model.dsa.as_mut().unwrap().index_head_dim = 256;
        } else {
            c.model.mla.as_mut().unwrap().kv_lora_rank = 1024;
        }
        let err = prepare_on(&c, a_gpu()).err().expect("refused on a GPU");
        assert!(err.to_string().contains(named), "{err}");
        prepare(&c).unwrap_or_else(|e| panic!("{setting} on the CPU: {e}"));
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
    assert!(err.contains("not divisible by config.ep = 2"), "{err}");
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
    gathered(&run_with(pattern, |c| c.steps = 1).trace)
}

/// The units a trace shows gathered (decoder layers and MTP depths).
fn gathered(trace: &Value) -> std::collections::BTreeSet<String> {
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .filter_map(|name| name.strip_prefix("gather "))
        .filter(|unit| unit.starts_with("decoder.layers.") || unit.starts_with("mtp.layers."))
        .map(str::to_string)
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

/// The overlap schedule keeps two micro-batches in flight, but the backward
/// of one frees its layers as the forward of the next fills its own, from
/// one arena: together they hold about one micro-batch's activations and a
/// layer's or two, not two micro-batches' (per-micro-batch arenas held two:
/// the second added all of one; with one arena it adds 0.24 of one for
/// `M*-M*-M*-` and 0.25 for `[ME][*E][ME][*E]`, whose nodes are a quarter
/// of it each).
#[test]
fn the_overlap_schedule_holds_about_one_micro_batch() {
    for pattern in ["M*-M*-M*-", "[ME][*E][ME][*E]"] {
        let one = |schedule| {
            run_with(pattern, |c| {
                c.ranks = 1;
                c.ep = 1;
                c.seq_length = 64;
                c.steps = 2;
                c.schedule = schedule;
            })
            .reports
        };
        let (plain, overlap) = (one(ScheduleKind::Plain), one(ScheduleKind::Overlap));
        let peak = |r: &[StepReport]| r.iter().map(|r| r.device.peak_in_use_bytes).max().unwrap();
        // What a step leaves in use is the state; the plain schedule's
        // peak above it, one micro-batch's activations and working set.
        let state = plain.last().unwrap().device.in_use_bytes;
        let micro_batch = peak(&plain) - state;
        let second = peak(&overlap).saturating_sub(peak(&plain));
        assert!(
            3 * second < micro_batch,
            "{pattern}: the overlap schedule's second micro-batch adds {second} bytes to the \
             plain schedule's peak, whose micro-batch takes {micro_batch} above the state \
             ({state})"
        );
    }
}

/// After the first step the device's pool holds every buffer a step needs:
/// later steps allocate nothing, on either schedule and either sharding,
/// with MTP, and with MoE under expert parallelism (whose routing, and so
/// the rows each expert gets, changes from step to step).
#[test]
fn steps_after_the_first_allocate_nothing() {
    for (pattern, schedule, sharding) in [
        ("M*-M*-/*-", ScheduleKind::Overlap, Sharding::Zero3),
        ("[M*E][M*E]/*E", ScheduleKind::Overlap, Sharding::Zero3),
        ("[M*E][M*E]/*E", ScheduleKind::Plain, Sharding::NoShard),
        ("M[*E]M-", ScheduleKind::Plain, Sharding::Zero3),
        ("M[*E]M-", ScheduleKind::Overlap, Sharding::NoShard),
    ] {
        let stats: Vec<_> = run_with(pattern, |c| {
            c.steps = 6;
            c.schedule = schedule;
            c.sharding = sharding;
        })
        .reports
        .iter()
        .map(|r| r.device)
        .collect();
        let what = format!("{pattern}, {schedule:?}, {sharding:?}");

        assert!(stats[0].allocations > 0, "{what}: step 1 allocates");
        for (i, s) in stats.iter().enumerate().skip(1) {
            assert_eq!(
                (s.allocations, s.allocated_bytes),
                (0, 0),
                "{what}: step {} allocated",
                i + 1
            );
            // The arenas grow with headroom, so a small leak would take
            // steps to show as an allocation: what a step leaves in use
            // shows it at once.
            assert_eq!(
                s.in_use_bytes,
                stats[0].in_use_bytes,
                "{what}: step {} ends holding more or less than step 1",
                i + 1
            );
        }
    }
}

/// A world of one holds every unit whole and alone: the units' buffers
/// are its shards, so nothing is gathered, refreshed or reduced (the trace
/// check of `run` sees none), and the layers accumulate every
/// micro-batch's gradients straight into the shards. Both schedules and
/// both shardings give the same bits there. (`tests/data.rs` checks the
/// sums against two ranks' reduce on the same samples.)
#[test]
fn a_world_of_one_keeps_its_units_in_its_shards() {
    let one = |edit: &dyn Fn(&mut TrainConfig)| {
        with("[M*E]-[*E]", |c| {
            c.ranks = 1;
            c.ep = 1;
            edit(c);
        })
    };
    let overlap = one(&|c| c.schedule = ScheduleKind::Overlap);
    let plain = one(&|c| c.schedule = ScheduleKind::Plain);
    let no_shard = one(&|c| c.sharding = Sharding::NoShard);
    assert_eq!(overlap, plain);
    assert_eq!(overlap, no_shard);
}

//! What a run's Chrome trace shows it did, read from rank 0's spans: which
//! schedule ran its micro-batches and which sharding moved its parameters.
//! For the layer kinds' parity tests, which check that each run of a
//! comparison ran what it asked for before comparing their bits.

use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::schedule::ScheduleKind;
use serde_json::Value;

/// What a trace shows a run did.
#[derive(Debug, PartialEq)]
pub struct Ran {
    pub schedule: ScheduleKind,
    pub sharding: Sharding,
}

/// Reads rank 0's trace: the schedule from the order of its compute-lane
/// pieces (overlap: a forward piece of micro-batch m + 1 runs between two
/// backward pieces of m; plain: after all of them), the sharding from its
/// parameter moves (ZeRO-3 gathers, no_shard refreshes from the masters).
pub fn ran(trace: &Value) -> Ran {
    let events = trace["traceEvents"].as_array().unwrap();
    let mut spans: Vec<(f64, &str, &str, Option<u64>)> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == 0)
        .filter(|e| e["tid"] == 0 || e["name"].as_str().unwrap().starts_with("gather "))
        .map(|e| {
            (
                e["ts"].as_f64().unwrap(),
                e["name"].as_str().unwrap(),
                e["cat"].as_str().unwrap(),
                e["args"]["micro_batch"].as_u64(),
            )
        })
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let names = |prefix: &str| spans.iter().filter(|s| s.1.starts_with(prefix)).count();
    let sharding = match (names("gather "), names("refresh ")) {
        (g, 0) if g > 0 => Sharding::Zero3,
        (0, r) if r > 0 => Sharding::NoShard,
        other => panic!("neither ZeRO-3 nor no_shard: (gathers, refreshes) {other:?}"),
    };
    // The first step's compute-lane pieces: (micro-batch, forward?).
    let pieces: Vec<(u64, bool)> = spans
        .iter()
        .skip_while(|s| s.1 != "zero loss sums")
        .skip(1)
        .take_while(|s| s.1 != "zero loss sums")
        .filter(|s| !s.1.starts_with("retire") && !s.1.starts_with("gather "))
        .filter_map(|s| match s.2 {
            "forward" => s.3.map(|mb| (mb, true)),
            "backward" | "wgrad" => s.3.map(|mb| (mb, false)),
            _ => None,
        })
        .collect();
    let at = |piece: (u64, bool)| -> Vec<usize> {
        (0..pieces.len()).filter(|&i| pieces[i] == piece).collect()
    };
    let backward = at((0, false));
    let next_forward = at((1, true));
    let (first, last) = (backward[0], *backward.last().unwrap());
    let schedule = if next_forward.iter().any(|&f| first < f && f < last) {
        ScheduleKind::Overlap
    } else {
        assert!(next_forward.iter().all(|&f| f > last), "{pieces:?}");
        ScheduleKind::Plain
    };
    Ran { schedule, sharding }
}

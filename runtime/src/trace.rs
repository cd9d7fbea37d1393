//! A Chrome-trace (Perfetto) recorder: one track per rank and lane.
//!
//! Lanes record one [`Span`] per work item they run; the recorder exports
//! them as Chrome trace JSON (`{"traceEvents": [...]}`: "X" complete events
//! with `pid` = rank and `tid` = lane, plus metadata naming each process
//! "rank N" and each thread after its lane), and computes what the closing
//! summary reports: how long each lane was busy, and how much of the comm
//! lane's busy time was hidden under compute-lane busy time.
//!
//! Recording takes one uncontended-in-practice mutex push per work item:
//! work items are whole slots and collectives (milliseconds), so the cost is
//! negligible next to them, and the trace stays in one ordered list.

use crate::error::{Result, RuntimeError};
use crate::lane::Label;
use serde_json::{Map, Value, json};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The lane that runs kernels; the overlap statistics measure against it.
pub const COMPUTE_LANE: &str = "compute";
/// The lane that runs collectives; its busy time is what overlap hides.
pub const COMM_LANE: &str = "comm";

/// One piece of work that ran on a lane, with times relative to the
/// recorder's epoch.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub rank: usize,
    pub lane: Cow<'static, str>,
    pub name: Cow<'static, str>,
    pub category: &'static str,
    pub micro_batch: Option<usize>,
    pub start: Duration,
    pub end: Duration,
}

impl Span {
    /// A span for `label` that ran on `lane` of `rank` from `start` to `end`
    /// (offsets from the recorder's epoch).
    pub fn new(
        rank: usize,
        lane: impl Into<Cow<'static, str>>,
        label: &Label,
        start: Duration,
        end: Duration,
    ) -> Self {
        Span {
            rank,
            lane: lane.into(),
            name: label.name.clone(),
            category: label.category,
            micro_batch: label.micro_batch,
            start,
            end: end.max(start),
        }
    }

    pub fn duration(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }
}

/// Thread-safe collector of spans. Share it as `Arc<TraceRecorder>` between
/// every lane of every rank of the process so all spans share one clock.
#[derive(Debug)]
pub struct TraceRecorder {
    epoch: Instant,
    spans: Mutex<Vec<Span>>,
    /// Set by [`TraceRecorder::statistics_only`]: spans are folded into
    /// these as they arrive and not kept.
    running: Option<Mutex<RunningStats>>,
    /// Ranks a pipeline stage, when the run has stages: each rank's track
    /// is then named with its stage too.
    stage_ranks: std::sync::OnceLock<usize>,
}

impl Default for TraceRecorder {
    fn default() -> Self {
        Self::new()
    }
}

impl TraceRecorder {
    /// An empty recorder whose epoch (time zero of the trace) is now.
    pub fn new() -> Self {
        TraceRecorder {
            epoch: Instant::now(),
            spans: Mutex::new(Vec::new()),
            running: None,
            stage_ranks: std::sync::OnceLock::new(),
        }
    }

    /// Names each rank's track with its pipeline stage: world rank `w` runs
    /// pipeline rank `w / ranks_a_stage`.
    pub fn name_stages(&self, ranks_a_stage: usize) {
        let _ = self.stage_ranks.set(ranks_a_stage.max(1));
    }

    /// A recorder that keeps no spans, only what [`Self::stats`] reports,
    /// computed as spans arrive: for runs that write no trace, so memory does
    /// not grow with the work done. Exact for lanes that run one item at a
    /// time and record in order (every [`crate::CpuLane`]).
    pub fn statistics_only() -> Self {
        TraceRecorder {
            running: Some(Mutex::new(RunningStats::default())),
            ..Self::new()
        }
    }

    /// Time zero of the trace.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Offset of `instant` from the epoch (zero for instants before it).
    pub fn offset(&self, instant: Instant) -> Duration {
        instant.saturating_duration_since(self.epoch)
    }

    /// Adds a span.
    pub fn record(&self, span: Span) {
        if let Some(running) = &self.running {
            running
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .add(&span);
            return;
        }
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(span);
    }

    /// Adds a span for `label`, run on `lane` of `rank` between two instants.
    pub fn record_work(
        &self,
        rank: usize,
        lane: &str,
        label: &Label,
        start: Instant,
        end: Instant,
    ) {
        self.record(Span::new(
            rank,
            lane.to_string(),
            label,
            self.offset(start),
            self.offset(end),
        ));
    }

    /// A copy of every span recorded so far, in recording order.
    pub fn spans(&self) -> Vec<Span> {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Removes and returns every span recorded so far (e.g. to export one
    /// step at a time).
    pub fn take(&self) -> Vec<Span> {
        std::mem::take(&mut *self.spans.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The recorded spans as Chrome trace JSON.
    pub fn chrome_trace(&self) -> Value {
        let mut trace = chrome_trace(&self.spans());
        if let (Some(&per_stage), Some(events)) = (
            self.stage_ranks.get(),
            trace.get_mut("traceEvents").and_then(Value::as_array_mut),
        ) {
            for event in events.iter_mut() {
                if event["name"] == "process_name"
                    && let Some(rank) = event["pid"].as_u64()
                {
                    event["args"]["name"] =
                        json!(format!("rank {rank} (stage {})", rank as usize / per_stage));
                }
            }
        }
        trace
    }

    /// Writes the Chrome trace JSON to `path` (open it in ui.perfetto.dev or
    /// chrome://tracing).
    pub fn write_chrome_trace(&self, path: &std::path::Path) -> Result<()> {
        let text = serde_json::to_string(&self.chrome_trace())
            .map_err(|e| RuntimeError::io(path.display(), e))?;
        std::fs::write(path, text).map_err(|e| RuntimeError::io(path.display(), e))
    }

    /// Busy and hidden time per rank over the recorded spans.
    pub fn stats(&self) -> Vec<RankStats> {
        match &self.running {
            Some(running) => running
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .stats(),
            None => rank_stats(&self.spans()),
        }
    }
}

/// The thread id a lane gets in the trace: compute first, comm second, any
/// other lanes after them in name order, so every rank's tracks line up.
fn lane_tids(spans: &[Span]) -> BTreeMap<&str, u64> {
    let others: BTreeSet<&str> = spans
        .iter()
        .map(|s| s.lane.as_ref())
        .filter(|l| *l != COMPUTE_LANE && *l != COMM_LANE)
        .collect();
    let mut tids = BTreeMap::new();
    tids.insert(COMPUTE_LANE, 0);
    tids.insert(COMM_LANE, 1);
    for (i, lane) in others.into_iter().enumerate() {
        tids.insert(lane, 2 + i as u64);
    }
    tids
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Chrome trace JSON for `spans`: metadata events naming each rank's process
/// and lane threads, then one "X" event per span.
pub fn chrome_trace(spans: &[Span]) -> Value {
    let tids = lane_tids(spans);
    let mut lanes_of_rank: BTreeMap<usize, BTreeSet<&str>> = BTreeMap::new();
    for span in spans {
        lanes_of_rank
            .entry(span.rank)
            .or_default()
            .insert(span.lane.as_ref());
    }
    let mut events = Vec::with_capacity(spans.len() + 3 * lanes_of_rank.len());
    for (rank, lanes) in &lanes_of_rank {
        events.push(json!({
            "ph": "M", "name": "process_name", "pid": rank, "tid": 0,
            "args": {"name": format!("rank {rank}")},
        }));
        events.push(json!({
            "ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
            "args": {"sort_index": rank},
        }));
        for lane in lanes {
            let tid = tids.get(lane).copied().unwrap_or(0);
            events.push(json!({
                "ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                "args": {"name": lane},
            }));
            events.push(json!({
                "ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                "args": {"sort_index": tid},
            }));
        }
    }
    for span in spans {
        let mut args = Map::new();
        if let Some(mb) = span.micro_batch {
            args.insert("micro_batch".into(), json!(mb));
        }
        events.push(json!({
            "ph": "X",
            "name": span.name.as_ref(),
            "cat": span.category,
            "pid": span.rank,
            "tid": tids.get(span.lane.as_ref()).copied().unwrap_or(0),
            "ts": micros(span.start),
            "dur": micros(span.duration()),
            "args": Value::Object(args),
        }));
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// Busy time of one rank's lanes, and how much of the comm lane's busy time
/// overlapped compute-lane busy time.
#[derive(Clone, Debug, PartialEq)]
pub struct RankStats {
    pub rank: usize,
    /// Busy time of every lane of the rank (the union of its spans, so
    /// nested or overlapping spans on one lane count once).
    pub busy: BTreeMap<String, Duration>,
    /// Busy time of the compute lane (zero when it recorded nothing).
    pub compute_busy: Duration,
    /// Busy time of the comm lane (zero when it recorded nothing).
    pub comm_busy: Duration,
    /// Comm busy time during which the compute lane was busy too.
    pub hidden: Duration,
    /// Time in stage-to-stage exchanges (category [`P2P`]) during which the
    /// compute lane had nothing to run: what a pipeline stage waited for
    /// its neighbours, the measured bubble.
    pub waited: Duration,
    /// From the first span's start to the last span's end.
    pub wall: Duration,
}

impl RankStats {
    /// `hidden / comm_busy`; `None` when the comm lane was never busy.
    pub fn hidden_fraction(&self) -> Option<f64> {
        (!self.comm_busy.is_zero())
            .then(|| self.hidden.as_secs_f64() / self.comm_busy.as_secs_f64())
    }

    /// Comm busy time not hidden under compute.
    pub fn exposed(&self) -> Duration {
        self.comm_busy.saturating_sub(self.hidden)
    }

    /// [`RankStats::waited`] over the rank's wall time.
    pub fn waited_fraction(&self) -> f64 {
        self.waited.as_secs_f64() / self.wall.as_secs_f64().max(1e-12)
    }
}

/// The category of a stage-to-stage exchange's span.
pub const P2P: &str = "p2p";

/// A time interval `[start, end)` since the epoch.
type Interval = (Duration, Duration);

/// Sorted, disjoint intervals covering the given ones.
fn union(mut intervals: Vec<Interval>) -> Vec<Interval> {
    intervals.retain(|(s, e)| e > s);
    intervals.sort();
    let mut merged: Vec<Interval> = Vec::with_capacity(intervals.len());
    for (s, e) in intervals {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

fn total(intervals: &[Interval]) -> Duration {
    intervals.iter().map(|(s, e)| *e - *s).sum()
}

/// Total length of the intersection of two sorted disjoint interval lists.
fn intersection(a: &[Interval], b: &[Interval]) -> Duration {
    let (mut i, mut j) = (0, 0);
    let mut sum = Duration::ZERO;
    while i < a.len() && j < b.len() {
        let start = a[i].0.max(b[j].0);
        let end = a[i].1.min(b[j].1);
        if end > start {
            sum += end - start;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    sum
}

/// Busy and hidden time for every rank that has spans, in rank order.
pub fn rank_stats(spans: &[Span]) -> Vec<RankStats> {
    let mut by_rank: BTreeMap<usize, BTreeMap<&str, Vec<Interval>>> = BTreeMap::new();
    let mut exchanges: BTreeMap<usize, Vec<Interval>> = BTreeMap::new();
    for span in spans {
        by_rank
            .entry(span.rank)
            .or_default()
            .entry(span.lane.as_ref())
            .or_default()
            .push((span.start, span.end));
        if span.category == P2P {
            exchanges
                .entry(span.rank)
                .or_default()
                .push((span.start, span.end));
        }
    }
    by_rank
        .into_iter()
        .map(|(rank, lanes)| {
            let first = lanes.values().flatten().map(|i| i.0).min();
            let last = lanes.values().flatten().map(|i| i.1).max();
            let merged: BTreeMap<&str, Vec<Interval>> = lanes
                .into_iter()
                .map(|(lane, intervals)| (lane, union(intervals)))
                .collect();
            let empty = Vec::new();
            let compute = merged.get(COMPUTE_LANE).unwrap_or(&empty);
            let comm = merged.get(COMM_LANE).unwrap_or(&empty);
            let p2p = union(exchanges.remove(&rank).unwrap_or_default());
            RankStats {
                rank,
                busy: merged
                    .iter()
                    .map(|(lane, iv)| (lane.to_string(), total(iv)))
                    .collect(),
                compute_busy: total(compute),
                comm_busy: total(comm),
                hidden: intersection(comm, compute),
                waited: total(&p2p).saturating_sub(intersection(&p2p, compute)),
                wall: match (first, last) {
                    (Some(f), Some(l)) => l.saturating_sub(f),
                    _ => Duration::ZERO,
                },
            }
        })
        .collect()
}

/// [`rank_stats`] kept up to date span by span. Each lane's spans arrive in
/// time order and do not overlap one another, so busy time is a sum, and a
/// pair of compute and comm spans is intersected when the later of the two
/// arrives; spans that no later span of the other lane can overlap are
/// dropped, so memory stays that of the few in flight.
#[derive(Debug, Default)]
struct RunningStats {
    ranks: BTreeMap<usize, RunningRank>,
}

#[derive(Debug, Default)]
struct RunningRank {
    busy: BTreeMap<String, Duration>,
    first: Option<Duration>,
    last: Option<Duration>,
    hidden: Duration,
    /// Exchange time, and the part of it under compute.
    p2p: Duration,
    p2p_hidden: Duration,
    /// Compute and comm spans a later span of the other lane may overlap,
    /// and the exchanges among the comm spans.
    compute: std::collections::VecDeque<Interval>,
    comm: std::collections::VecDeque<Interval>,
    exchanges: std::collections::VecDeque<Interval>,
}

impl RunningStats {
    fn add(&mut self, span: &Span) {
        let rank = self.ranks.entry(span.rank).or_default();
        *rank.busy.entry(span.lane.to_string()).or_default() += span.duration();
        rank.first = Some(rank.first.map_or(span.start, |f| f.min(span.start)));
        rank.last = Some(rank.last.map_or(span.end, |l| l.max(span.end)));
        let overlap = |span: &Span, others: &std::collections::VecDeque<Interval>| {
            let mut sum = Duration::ZERO;
            for other in others {
                let start = span.start.max(other.0);
                let end = span.end.min(other.1);
                if end > start {
                    sum += end - start;
                }
            }
            sum
        };
        match span.lane.as_ref() {
            COMPUTE_LANE => {
                rank.hidden += overlap(span, &rank.comm);
                rank.p2p_hidden += overlap(span, &rank.exchanges);
                // Later spans of this lane start after this one ends.
                rank.comm.retain(|other| other.1 > span.end);
                rank.exchanges.retain(|other| other.1 > span.end);
                if span.end > span.start {
                    rank.compute.push_back((span.start, span.end));
                }
            }
            COMM_LANE => {
                rank.hidden += overlap(span, &rank.compute);
                if span.category == P2P {
                    rank.p2p += span.duration();
                    rank.p2p_hidden += overlap(span, &rank.compute);
                    if span.end > span.start {
                        rank.exchanges.push_back((span.start, span.end));
                    }
                }
                rank.compute.retain(|other| other.1 > span.end);
                if span.end > span.start {
                    rank.comm.push_back((span.start, span.end));
                }
            }
            _ => {}
        }
    }

    fn stats(&self) -> Vec<RankStats> {
        self.ranks
            .iter()
            .map(|(&rank, r)| {
                let lane = |name: &str| r.busy.get(name).copied().unwrap_or_default();
                RankStats {
                    rank,
                    busy: r.busy.clone(),
                    compute_busy: lane(COMPUTE_LANE),
                    comm_busy: lane(COMM_LANE),
                    hidden: r.hidden,
                    waited: r.p2p.saturating_sub(r.p2p_hidden),
                    wall: match (r.first, r.last) {
                        (Some(f), Some(l)) => l.saturating_sub(f),
                        _ => Duration::ZERO,
                    },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn span(rank: usize, lane: &'static str, start: u64, end: u64) -> Span {
        Span::new(rank, lane, &Label::new("w", "forward"), ms(start), ms(end))
    }

    #[test]
    fn hidden_time_is_comm_busy_time_under_compute() {
        // compute busy [0,10) and [20,30); comm busy [5,25): hidden = 5 + 5.
        let spans = vec![
            span(0, COMPUTE_LANE, 0, 10),
            span(0, COMPUTE_LANE, 20, 30),
            span(0, COMM_LANE, 5, 25),
        ];
        let stats = rank_stats(&spans);
        assert_eq!(stats.len(), 1);
        let s = &stats[0];
        assert_eq!(s.compute_busy, ms(20));
        assert_eq!(s.comm_busy, ms(20));
        assert_eq!(s.hidden, ms(10));
        assert_eq!(s.exposed(), ms(10));
        assert_eq!(s.wall, ms(30));
        assert_eq!(s.hidden_fraction(), Some(0.5));
        assert_eq!(s.busy["compute"], ms(20));
        assert_eq!(s.busy["comm"], ms(20));
    }

    #[test]
    fn overlapping_spans_on_one_lane_count_once_and_ranks_are_separate() {
        let spans = vec![
            span(1, COMM_LANE, 0, 10),
            span(1, COMM_LANE, 5, 15),
            span(1, COMM_LANE, 15, 20),
            span(0, COMPUTE_LANE, 0, 100),
            // Rank 1's comm is not hidden by rank 0's compute.
            span(1, COMPUTE_LANE, 18, 40),
        ];
        let stats = rank_stats(&spans);
        assert_eq!(stats.len(), 2);
        assert_eq!(stats[0].rank, 0);
        assert_eq!(stats[0].comm_busy, Duration::ZERO);
        assert_eq!(stats[0].hidden_fraction(), None);
        assert_eq!(stats[1].comm_busy, ms(20));
        assert_eq!(stats[1].hidden, ms(2));
        assert!((stats[1].hidden_fraction().unwrap() - 0.1).abs() < 1e-12);
    }

    #[test]
    fn running_statistics_equal_those_of_the_stored_spans() {
        // Two ranks, each with a compute and a comm lane running one item at
        // a time, recorded in the interleaved order the lanes finish in.
        let mut rng = crate::data::Xoshiro256::seed_from_u64(5);
        let mut spans = Vec::new();
        for rank in 0..2 {
            for lane in [COMPUTE_LANE, COMM_LANE] {
                let mut at = 0;
                for _ in 0..200 {
                    let start = at + rng.below(7);
                    let end = start + rng.below(9);
                    spans.push(span(rank, lane, start, end));
                    at = end;
                }
            }
        }
        spans.sort_by_key(|s| s.end);
        let running = TraceRecorder::statistics_only();
        for s in &spans {
            running.record(s.clone());
        }
        assert!(running.spans().is_empty());
        assert_eq!(running.stats(), rank_stats(&spans));
        assert!(running.stats()[0].hidden > Duration::ZERO);
    }

    #[test]
    fn fully_hidden_and_fully_exposed() {
        let hidden = rank_stats(&[span(0, COMPUTE_LANE, 0, 50), span(0, COMM_LANE, 10, 20)]);
        assert_eq!(hidden[0].hidden_fraction(), Some(1.0));
        let exposed = rank_stats(&[span(0, COMPUTE_LANE, 0, 10), span(0, COMM_LANE, 10, 20)]);
        assert_eq!(exposed[0].hidden, Duration::ZERO);
        assert_eq!(exposed[0].hidden_fraction(), Some(0.0));
    }

    #[test]
    fn chrome_trace_parses_back_with_metadata_and_complete_events() {
        let recorder = TraceRecorder::new();
        recorder.record(Span::new(
            0,
            COMPUTE_LANE,
            &Label::new("fwd \"pre-dispatch\" decoder.layers.0", "forward").micro_batch(2),
            ms(1),
            ms(3),
        ));
        recorder.record(span(1, COMM_LANE, 2, 4));
        recorder.record(span(1, "host", 0, 1));
        let text = serde_json::to_string(&recorder.chrome_trace()).unwrap();
        let parsed: Value = serde_json::from_str(&text).unwrap();
        let events = parsed["traceEvents"].as_array().unwrap();

        let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(complete.len(), 3);
        let fwd = complete[0];
        assert_eq!(fwd["name"], "fwd \"pre-dispatch\" decoder.layers.0");
        assert_eq!(fwd["cat"], "forward");
        assert_eq!(fwd["pid"], 0);
        assert_eq!(fwd["tid"], 0);
        assert_eq!(fwd["ts"].as_f64(), Some(1000.0));
        assert_eq!(fwd["dur"].as_f64(), Some(2000.0));
        assert_eq!(fwd["args"]["micro_batch"], 2);
        assert_eq!(complete[1]["tid"], 1);
        assert_eq!(complete[2]["tid"], 2);

        let names: Vec<(u64, u64, String, String)> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"].as_str().unwrap().ends_with("_name"))
            .map(|e| {
                (
                    e["pid"].as_u64().unwrap(),
                    e["tid"].as_u64().unwrap(),
                    e["name"].as_str().unwrap().to_string(),
                    e["args"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert!(names.contains(&(0, 0, "process_name".into(), "rank 0".into())));
        assert!(names.contains(&(1, 0, "process_name".into(), "rank 1".into())));
        assert!(names.contains(&(0, 0, "thread_name".into(), "compute".into())));
        assert!(names.contains(&(1, 1, "thread_name".into(), "comm".into())));
        assert!(names.contains(&(1, 2, "thread_name".into(), "host".into())));
    }

    #[test]
    fn write_and_take() {
        let recorder = TraceRecorder::new();
        let start = recorder.epoch() + ms(5);
        recorder.record_work(
            3,
            COMM_LANE,
            &Label::new("a2a", "a2a"),
            start,
            start + ms(1),
        );
        let dir = std::env::temp_dir().join(format!("hybridgen-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        recorder.write_chrome_trace(&path).unwrap();
        let parsed: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(parsed["traceEvents"].as_array().unwrap().len() >= 2);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(recorder.take().len(), 1);
        assert!(recorder.spans().is_empty());
        let missing = recorder.write_chrome_trace(std::path::Path::new("/nonexistent/dir/t.json"));
        assert!(matches!(missing, Err(RuntimeError::Io { .. })));
    }
}

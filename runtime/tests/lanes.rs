//! CPU lanes: real overlap, FIFO order, dependencies across lanes, failure
//! propagation, timeouts, panics, clean shutdown, and trace spans. No test
//! asserts on elapsed time; the short timeouts only bound the timeout tests.

use hybridgen_runtime::cpu::CpuBackend;
use hybridgen_runtime::trace::{COMM_LANE, COMPUTE_LANE};
use hybridgen_runtime::{
    CpuEvent, CpuLane, Event, Label, Lane, LaneConfig, RuntimeError, TraceRecorder,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A barrier that gives up: `wait` returns false if the other parties do
/// not arrive within the timeout, so a broken lane fails the test instead
/// of hanging it.
struct Rendezvous {
    parties: usize,
    arrived: Mutex<usize>,
    all_here: Condvar,
}

impl Rendezvous {
    fn new(parties: usize) -> Arc<Self> {
        Arc::new(Rendezvous {
            parties,
            arrived: Mutex::new(0),
            all_here: Condvar::new(),
        })
    }

    fn wait(&self, timeout: Duration) -> bool {
        let mut arrived = self.arrived.lock().unwrap();
        *arrived += 1;
        self.all_here.notify_all();
        let (arrived, result) = self
            .all_here
            .wait_timeout_while(arrived, timeout, |a| *a < self.parties)
            .unwrap();
        drop(arrived);
        !result.timed_out()
    }
}

const PATIENT: Duration = Duration::from_secs(20);

fn label(name: &'static str) -> Label {
    Label::new(name, "test")
}

#[test]
fn two_lanes_run_at_the_same_time() {
    let trace = Arc::new(TraceRecorder::new());
    let config = LaneConfig::default().rank(3).trace(trace.clone());
    let compute = CpuLane::with_config(COMPUTE_LANE, config.clone()).unwrap();
    let comm = CpuLane::with_config(COMM_LANE, config).unwrap();
    // Each work only finishes if the other is running at the same time.
    let meet = Rendezvous::new(2);
    let (a, b) = (meet.clone(), meet.clone());
    let e1 = compute.submit(
        label("gemm"),
        &[],
        Box::new(move |_: &CpuBackend| {
            if a.wait(PATIENT) {
                Ok(())
            } else {
                Err(RuntimeError::Numeric(
                    "comm work never ran alongside".into(),
                ))
            }
        }),
    );
    let e2 = comm.submit(
        label("all_gather"),
        &[],
        Box::new(move |_: &CpuBackend| {
            if b.wait(PATIENT) {
                Ok(())
            } else {
                Err(RuntimeError::Numeric(
                    "compute work never ran alongside".into(),
                ))
            }
        }),
    );
    e1.wait().unwrap();
    e2.wait().unwrap();
    compute.synchronize().unwrap();
    comm.synchronize().unwrap();

    let spans = trace.spans();
    assert_eq!(spans.len(), 2);
    assert!(spans.iter().all(|s| s.rank == 3));
    let gemm = spans.iter().find(|s| s.name == "gemm").unwrap();
    assert_eq!(gemm.lane, COMPUTE_LANE);
    // Both spans contain the moment they met, so the comm span is hidden.
    let stats = trace.stats();
    assert_eq!(stats.len(), 1);
    assert!(stats[0].hidden > Duration::ZERO, "{stats:?}");
}

#[test]
fn work_runs_in_submission_order() {
    let lane = CpuLane::new(COMPUTE_LANE).unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let events: Vec<CpuEvent> = (0..200)
        .map(|i| {
            let order = order.clone();
            lane.submit(
                Label::new(format!("item {i}"), "test"),
                &[],
                Box::new(move |_: &CpuBackend| {
                    order.lock().unwrap().push(i);
                    Ok(())
                }),
            )
        })
        .collect();
    lane.synchronize().unwrap();
    assert!(events.iter().all(|e| e.is_complete()));
    assert_eq!(*order.lock().unwrap(), (0..200).collect::<Vec<_>>());
}

#[test]
fn work_waits_for_events_of_other_lanes() {
    let compute = CpuLane::new(COMPUTE_LANE).unwrap();
    let comm = CpuLane::new(COMM_LANE).unwrap();
    let (release, gate) = mpsc::channel::<()>();
    let gathered = Arc::new(AtomicBool::new(false));
    let flag = gathered.clone();
    let gather = comm.submit(
        label("gather"),
        &[],
        Box::new(move |_: &CpuBackend| {
            gate.recv_timeout(PATIENT)
                .map_err(|_| RuntimeError::Numeric("never released".into()))?;
            flag.store(true, Ordering::SeqCst);
            Ok(())
        }),
    );
    let saw = gathered.clone();
    let forward = compute.submit(
        label("forward"),
        std::slice::from_ref(&gather),
        Box::new(move |_: &CpuBackend| {
            if saw.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err(RuntimeError::Numeric("ran before its dependency".into()))
            }
        }),
    );
    assert!(!forward.is_complete());
    release.send(()).unwrap();
    forward.wait().unwrap();
    assert!(gather.is_complete());
}

#[test]
fn failures_propagate_naming_the_failed_work() {
    let compute = CpuLane::new(COMPUTE_LANE).unwrap();
    let comm = CpuLane::new(COMM_LANE).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let dispatch = comm.submit(
        label("dispatch fwd layer 3"),
        &[],
        Box::new(|_: &CpuBackend| Err(RuntimeError::Numeric("bad routing".into()))),
    );
    let r = ran.clone();
    let mlp = compute.submit(
        label("mlp fwd layer 3"),
        std::slice::from_ref(&dispatch),
        Box::new(move |_: &CpuBackend| {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }),
    );
    let r = ran.clone();
    let combine = comm.submit(
        label("combine fwd layer 3"),
        std::slice::from_ref(&mlp),
        Box::new(move |_: &CpuBackend| {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }),
    );
    // The failed work's own event returns its own error.
    assert!(matches!(dispatch.wait(), Err(RuntimeError::Numeric(m)) if m == "bad routing"));
    let mlp_err = mlp.wait().unwrap_err().to_string();
    assert_eq!(
        mlp_err,
        "compute lane: skipped `mlp fwd layer 3`: it waits on `dispatch fwd layer 3` on the \
         comm lane, which failed: bad routing"
    );
    let combine_err = combine.wait().unwrap_err().to_string();
    assert!(
        combine_err.contains("skipped `combine fwd layer 3`"),
        "{combine_err}"
    );
    assert!(
        combine_err.contains("`dispatch fwd layer 3` on the comm lane failed: bad routing"),
        "{combine_err}"
    );
    // Indirect: a third lane waits on the skipped work and learns the root.
    let host = CpuLane::new("host").unwrap();
    let r = ran.clone();
    let loss = host.submit(
        label("loss"),
        std::slice::from_ref(&mlp),
        Box::new(move |_: &CpuBackend| {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }),
    );
    assert_eq!(
        loss.wait().unwrap_err().to_string(),
        "host lane: skipped `loss`: it waits on `mlp fwd layer 3` on the compute lane, which \
         did not run because `dispatch fwd layer 3` on the comm lane failed: bad routing"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);

    // Later work on a lane whose earlier work failed is skipped too...
    let later = compute.submit(label("pre-dispatch layer 4"), &[], Box::new(|_: &CpuBackend| Ok(())));
    let later_err = later.wait().unwrap_err().to_string();
    assert!(
        later_err.contains("skipped `pre-dispatch layer 4`"),
        "{later_err}"
    );
    // ...until synchronize reports the first error, once.
    assert!(matches!(comm.synchronize(), Err(RuntimeError::Numeric(_))));
    let first = compute.synchronize().unwrap_err().to_string();
    assert!(first.contains("skipped `mlp fwd layer 3`"), "{first}");
    comm.synchronize().unwrap();
    compute.synchronize().unwrap();
    let again = compute.submit(label("next step"), &[], Box::new(|_: &CpuBackend| Ok(())));
    again.wait().unwrap();
}

#[test]
fn a_stalled_dependency_times_out_naming_it() {
    let comm = CpuLane::new(COMM_LANE).unwrap();
    let compute = CpuLane::with_config(
        COMPUTE_LANE,
        LaneConfig::default().wait_timeout(Duration::from_millis(200)),
    )
    .unwrap();
    let (release, gate) = mpsc::channel::<()>();
    let stalled = comm.submit(
        label("reduce_scatter bucket 7"),
        &[],
        Box::new(move |_: &CpuBackend| {
            let _ = gate.recv_timeout(PATIENT);
            Ok(())
        }),
    );
    let waiting = compute.submit(
        label("optimizer step"),
        std::slice::from_ref(&stalled),
        Box::new(|_: &CpuBackend| Ok(())),
    );
    let err = waiting.wait_timeout(PATIENT).unwrap_err().to_string();
    assert!(
        err.contains("`optimizer step` gave up after waiting 200ms for `reduce_scatter bucket 7` on the comm lane"),
        "{err}"
    );
    assert!(compute.synchronize().is_err());
    release.send(()).unwrap();
    comm.synchronize().unwrap();
}

#[test]
fn a_panic_in_work_becomes_an_error() {
    let lane = CpuLane::new(COMPUTE_LANE).unwrap();
    let event = lane.submit(
        label("broken kernel"),
        &[],
        Box::new(|_: &CpuBackend| panic!("index out of bounds")),
    );
    let err = event.wait().unwrap_err().to_string();
    assert_eq!(
        err,
        "compute lane: `broken kernel` panicked: index out of bounds"
    );
    assert!(lane.synchronize().is_err());
    // The worker survived.
    lane.submit(label("after"), &[], Box::new(|_: &CpuBackend| Ok(())))
        .wait()
        .unwrap();
}

#[test]
fn dropping_a_lane_runs_what_is_queued_then_stops() {
    let lane = CpuLane::new(COMM_LANE).unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let (release, gate) = mpsc::channel::<()>();
    lane.submit(
        label("first"),
        &[],
        Box::new(move |_: &CpuBackend| {
            let _ = gate.recv_timeout(PATIENT);
            Ok(())
        }),
    );
    let events: Vec<CpuEvent> = (0..10)
        .map(|_| {
            let count = count.clone();
            lane.submit(
                label("queued"),
                &[],
                Box::new(move |_: &CpuBackend| {
                    count.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }),
            )
        })
        .collect();
    release.send(()).unwrap();
    drop(lane); // joins the worker after draining the queue
    assert_eq!(count.load(Ordering::SeqCst), 10);
    assert!(events.iter().all(|e| e.is_complete() && e.wait().is_ok()));
}

#[test]
fn many_lanes_come_and_go() {
    // Lanes created and dropped repeatedly leave no thread behind blocking
    // the drop (each drop joins its worker).
    for i in 0..50 {
        let lane = CpuLane::with_config(COMPUTE_LANE, LaneConfig::default().rank(i)).unwrap();
        assert_eq!(lane.rank(), i);
        lane.submit(label("w"), &[], Box::new(|_: &CpuBackend| Ok(())));
    }
}

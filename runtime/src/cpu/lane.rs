//! CPU lanes: a worker thread per lane with a FIFO queue; events as a flag
//! with a condition variable.
//!
//! Semantics (the CUDA stream model, made safe):
//! - Work runs in submission order on the lane's thread, each item once its
//!   `after` events have completed.
//! - A failed item fails its event with its own error. An item whose
//!   dependency failed is skipped, and its event fails with an error naming
//!   the upstream work that failed. Lane order is a dependency too: once an
//!   item failed, later items on the same lane are skipped until
//!   [`Lane::synchronize`] has reported the failure (a CUDA stream's errors
//!   are sticky in the same way; running later slots on half-computed state
//!   would only produce confusing follow-on errors).
//! - Waiting for a dependency is bounded by the lane's wait timeout, so a
//!   stalled dependency becomes an error naming the work waited on.
//! - A panic inside work is caught and becomes that work's error.
//! - Dropping a lane runs what is still queued, then joins the thread.

use super::CpuBackend;
use crate::error::{Result, RuntimeError};
use crate::lane::{Event, Label, Lane, Work};
use crate::trace::TraceRecorder;
use std::collections::VecDeque;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long work waits for a dependency by default. Longer than the
/// collectives' default timeout, so a stalled peer is reported by the
/// collective (which names the rank) before a lane gives up on the event.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(300);

/// `timeout` from now, for waits bounded by a user's timeout: a timeout too
/// long for the clock (`Duration::MAX`, `u64::MAX` seconds) waits a year
/// rather than overflowing `Instant` (which panics, and in a lane's worker
/// would leave its work unfinished forever).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(timeout.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(3600)))
        .unwrap_or(now)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The lane never panics while holding its locks (work runs unlocked and
    // inside catch_unwind), so a poisoned lock still holds consistent state.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where an event comes from, for error messages.
#[derive(Debug)]
struct Origin {
    lane: Arc<str>,
    label: Label,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` on the {} lane", self.label.name, self.lane)
    }
}

#[derive(Debug)]
enum Status {
    Pending,
    Done,
    /// The work failed itself: `error` is its own error.
    Failed {
        error: RuntimeError,
    },
    /// The work did not run because `root` (another work item) failed.
    Skipped {
        error: RuntimeError,
        root: Arc<Origin>,
        root_error: RuntimeError,
    },
}

#[derive(Debug)]
struct EventState {
    origin: Arc<Origin>,
    wait_timeout: Duration,
    status: Mutex<Status>,
    done: Condvar,
}

/// Marks completion of one work item (or an already-completed marker).
/// Cloning shares the marker.
#[derive(Clone, Debug)]
pub struct CpuEvent {
    state: Arc<EventState>,
}

/// Why a dependency did not complete successfully.
enum DependencyFailure {
    /// It ran and failed, or was skipped because of `root`.
    Failed {
        root: Arc<Origin>,
        root_error: RuntimeError,
    },
    TimedOut,
}

impl CpuEvent {
    fn pending(origin: Arc<Origin>, wait_timeout: Duration) -> Self {
        CpuEvent {
            state: Arc::new(EventState {
                origin,
                wait_timeout,
                status: Mutex::new(Status::Pending),
                done: Condvar::new(),
            }),
        }
    }

    /// An event that is already complete: a starting point for schedules.
    pub fn completed(label: Label) -> Self {
        let event = Self::pending(
            Arc::new(Origin {
                lane: Arc::from("host"),
                label,
            }),
            DEFAULT_WAIT_TIMEOUT,
        );
        event.finish(Status::Done);
        event
    }

    /// An event that already failed with `error` (e.g. work that could not
    /// even be submitted); work that depends on it is skipped.
    pub fn failed(label: Label, error: RuntimeError) -> Self {
        let event = Self::pending(
            Arc::new(Origin {
                lane: Arc::from("host"),
                label,
            }),
            DEFAULT_WAIT_TIMEOUT,
        );
        event.finish(Status::Failed { error });
        event
    }

    /// The label of the work behind this event.
    pub fn label(&self) -> &Label {
        &self.state.origin.label
    }

    /// The lane the work was submitted to (`host` for [`Self::completed`]).
    pub fn lane(&self) -> &str {
        &self.state.origin.lane
    }

    fn finish(&self, status: Status) {
        *lock(&self.state.status) = status;
        self.state.done.notify_all();
    }

    /// Blocks until the work completes or `deadline` passes; `Ok(Ok(()))`
    /// when it succeeded.
    fn wait_until(&self, deadline: Instant) -> std::result::Result<(), DependencyFailure> {
        let mut status = lock(&self.state.status);
        loop {
            match &*status {
                Status::Pending => {}
                Status::Done => return Ok(()),
                Status::Failed { error } => {
                    return Err(DependencyFailure::Failed {
                        root: self.state.origin.clone(),
                        root_error: error.clone(),
                    });
                }
                Status::Skipped {
                    root, root_error, ..
                } => {
                    return Err(DependencyFailure::Failed {
                        root: root.clone(),
                        root_error: root_error.clone(),
                    });
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(DependencyFailure::TimedOut);
            }
            status = self
                .state
                .done
                .wait_timeout(status, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Blocks until the work completes or `timeout` passes. Returns the
    /// work's error if it failed or was skipped.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        match self.wait_until(deadline_after(timeout)) {
            Ok(()) => Ok(()),
            Err(DependencyFailure::TimedOut) => Err(RuntimeError::Lane {
                lane: self.state.origin.lane.to_string(),
                message: format!(
                    "`{}` did not complete within {:?}: it (or work it waits on) may be \
                     stalled or deadlocked",
                    self.state.origin.label.name, timeout
                ),
            }),
            Err(DependencyFailure::Failed { .. }) => {
                Err(self.error().unwrap_or_else(|| RuntimeError::Lane {
                    lane: self.state.origin.lane.to_string(),
                    message: format!("`{}` failed", self.state.origin.label.name),
                }))
            }
        }
    }

    /// The error this event completed with, if it has failed.
    pub fn error(&self) -> Option<RuntimeError> {
        match &*lock(&self.state.status) {
            Status::Failed { error } | Status::Skipped { error, .. } => Some(error.clone()),
            Status::Pending | Status::Done => None,
        }
    }
}

impl Event for CpuEvent {
    /// Waits at most twice the submitting lane's wait timeout: long enough
    /// for the work's own wait on a stalled dependency to give up first and
    /// report which dependency stalled.
    fn wait(&self) -> Result<()> {
        self.wait_timeout(self.state.wait_timeout.saturating_mul(2))
    }

    fn is_complete(&self) -> bool {
        !matches!(*lock(&self.state.status), Status::Pending)
    }
}

/// Settings of one lane.
#[derive(Clone, Debug)]
pub struct LaneConfig {
    /// The rank the lane belongs to (for traces and thread names).
    pub rank: usize,
    /// How long work waits for its dependencies before failing ([`Event::wait`]
    /// on its event waits twice as long).
    pub wait_timeout: Duration,
    /// Where to record one span per work item that runs.
    pub trace: Option<Arc<TraceRecorder>>,
    /// The device the lane's work runs kernels on; the lane binds it to
    /// itself (its name appears in the device's hazard errors).
    pub device: CpuBackend,
}

impl Default for LaneConfig {
    fn default() -> Self {
        LaneConfig {
            rank: 0,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            trace: None,
            device: CpuBackend::default(),
        }
    }
}

impl LaneConfig {
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = rank;
        self
    }

    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    pub fn trace(mut self, recorder: Arc<TraceRecorder>) -> Self {
        self.trace = Some(recorder);
        self
    }

    pub fn device(mut self, device: CpuBackend) -> Self {
        self.device = device;
        self
    }
}

struct Job {
    label: Label,
    after: Vec<CpuEvent>,
    work: Work<CpuBackend>,
    event: CpuEvent,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// Items submitted / finished (run, failed or skipped) since creation.
    submitted: u64,
    finished: u64,
    /// The first failure not yet reported by `synchronize`; while set, later
    /// items on this lane are skipped.
    failure: Option<LaneFailure>,
    closing: bool,
}

/// The first item on a lane that failed or was skipped.
#[derive(Clone)]
struct LaneFailure {
    /// What `synchronize` reports: that item's own error.
    error: RuntimeError,
    /// The work that actually failed (that item, or what it depended on).
    root: Arc<Origin>,
    root_error: RuntimeError,
    /// Whether the root failure happened on this lane.
    own: bool,
}

struct Shared {
    name: Arc<str>,
    config: LaneConfig,
    /// `config.device` bound to this lane.
    backend: CpuBackend,
    queue: Mutex<Queue>,
    /// Signals the worker: a job arrived or the lane is closing.
    work_ready: Condvar,
    /// Signals `synchronize`: a job finished.
    job_done: Condvar,
}

/// A lane on the CPU: one worker thread running submitted work in order.
pub struct CpuLane {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl fmt::Debug for CpuLane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuLane")
            .field("name", &self.shared.name)
            .field("rank", &self.shared.config.rank)
            .finish()
    }
}

impl CpuLane {
    /// A lane named `name` (`compute`, `comm`) with default settings.
    pub fn new(name: &str) -> Result<Self> {
        Self::with_config(name, LaneConfig::default())
    }

    /// A lane named `name` with `config`; starts its worker thread.
    pub fn with_config(name: &str, config: LaneConfig) -> Result<Self> {
        let shared = Arc::new(Shared {
            name: Arc::from(name),
            backend: config.device.on_lane(name),
            config,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                submitted: 0,
                finished: 0,
                failure: None,
                closing: false,
            }),
            work_ready: Condvar::new(),
            job_done: Condvar::new(),
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name(format!("{name} lane, rank {}", shared.config.rank))
            .spawn(move || run_worker(&worker_shared))
            .map_err(|e| RuntimeError::Lane {
                lane: name.to_string(),
                message: format!("cannot start the worker thread: {e}"),
            })?;
        Ok(CpuLane {
            shared,
            worker: Some(worker),
        })
    }

    pub fn rank(&self) -> usize {
        self.shared.config.rank
    }

    pub fn wait_timeout(&self) -> Duration {
        self.shared.config.wait_timeout
    }
}

impl Lane for CpuLane {
    type Event = CpuEvent;
    type Backend = CpuBackend;

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn backend(&self) -> &CpuBackend {
        &self.shared.backend
    }

    fn submit(&self, label: Label, after: &[CpuEvent], work: Work<CpuBackend>) -> CpuEvent {
        let event = CpuEvent::pending(
            Arc::new(Origin {
                lane: self.shared.name.clone(),
                label: label.clone(),
            }),
            self.shared.config.wait_timeout,
        );
        let mut queue = lock(&self.shared.queue);
        queue.submitted += 1;
        queue.jobs.push_back(Job {
            label,
            after: after.to_vec(),
            work,
            event: event.clone(),
        });
        drop(queue);
        self.shared.work_ready.notify_one();
        event
    }

    fn synchronize(&self) -> Result<()> {
        let mut queue = lock(&self.shared.queue);
        let target = queue.submitted;
        while queue.finished < target {
            queue = self
                .shared
                .job_done
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
        // Reported once: the lane accepts work again after this.
        match queue.failure.take() {
            Some(failure) => Err(failure.error),
            None => Ok(()),
        }
    }
}

impl Drop for CpuLane {
    fn drop(&mut self) {
        lock(&self.shared.queue).closing = true;
        self.shared.work_ready.notify_all();
        if let Some(worker) = self.worker.take() {
            // The worker catches panics from work, so joining cannot fail in
            // practice; if it somehow did, there is nothing left to clean up.
            let _ = worker.join();
        }
    }
}

fn run_worker(shared: &Shared) {
    loop {
        let (job, lane_failure) = {
            let mut queue = lock(&shared.queue);
            loop {
                if let Some(job) = queue.jobs.pop_front() {
                    break (job, queue.failure.clone());
                }
                if queue.closing {
                    return;
                }
                queue = shared
                    .work_ready
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let status = run_job(shared, job.label, job.after, job.work, lane_failure);
        let new_failure = match &status {
            Status::Done => None,
            Status::Failed { error } => Some(LaneFailure {
                error: error.clone(),
                root: job.event.state.origin.clone(),
                root_error: error.clone(),
                own: true,
            }),
            Status::Skipped {
                error,
                root,
                root_error,
            } => Some(LaneFailure {
                error: error.clone(),
                root: root.clone(),
                root_error: root_error.clone(),
                own: false,
            }),
            Status::Pending => None,
        };
        job.event.finish(status);
        let mut queue = lock(&shared.queue);
        if queue.failure.is_none() {
            queue.failure = new_failure;
        }
        queue.finished += 1;
        drop(queue);
        shared.job_done.notify_all();
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_string()
    }
}

/// Waits for the dependencies, runs the work, and says how it ended.
fn run_job(
    shared: &Shared,
    label: Label,
    after: Vec<CpuEvent>,
    work: Work<CpuBackend>,
    lane_failure: Option<LaneFailure>,
) -> Status {
    let lane = shared.name.to_string();
    let skipped = |how: String, root: Arc<Origin>, root_error: RuntimeError| Status::Skipped {
        error: RuntimeError::Skipped {
            lane: lane.clone(),
            work: label.name.to_string(),
            how,
            origin: root.to_string(),
            root: Box::new(root_error.clone()),
        },
        root,
        root_error,
    };
    if let Some(failure) = lane_failure {
        let how = if failure.own {
            format!("earlier work {} failed", failure.root)
        } else {
            format!(
                "earlier work on this lane was skipped because {} failed",
                failure.root
            )
        };
        return skipped(how, failure.root, failure.root_error);
    }
    let deadline = deadline_after(shared.config.wait_timeout);
    for dependency in &after {
        match dependency.wait_until(deadline) {
            Ok(()) => {}
            Err(DependencyFailure::Failed { root, root_error }) => {
                let via = &dependency.state.origin;
                let how = if Arc::ptr_eq(via, &root) {
                    format!("it waits on {root}, which failed")
                } else {
                    format!("it waits on {via}, which did not run because {root} failed")
                };
                return skipped(how, root, root_error);
            }
            Err(DependencyFailure::TimedOut) => {
                return Status::Failed {
                    error: RuntimeError::Lane {
                        lane,
                        message: format!(
                            "`{}` gave up after waiting {:?} for {} to complete: it may be \
                             stalled or deadlocked (raise the lane wait timeout if that work \
                             is legitimately slow)",
                            label.name, shared.config.wait_timeout, dependency.state.origin
                        ),
                    },
                };
            }
        }
    }
    drop(after);
    let start = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| work(&shared.backend)));
    let end = Instant::now();
    if let Some(trace) = &shared.config.trace {
        trace.record_work(shared.config.rank, &shared.name, &label, start, end);
    }
    match outcome {
        Ok(Ok(())) => Status::Done,
        Ok(Err(error)) => Status::Failed { error },
        Err(payload) => Status::Failed {
            error: RuntimeError::Lane {
                lane,
                message: format!(
                    "`{}` panicked: {}",
                    label.name,
                    panic_message(payload.as_ref())
                ),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completed_and_failed_events() {
        let done = CpuEvent::completed(Label::new("start", "host"));
        assert!(done.is_complete());
        assert!(done.wait().is_ok());
        assert_eq!(done.lane(), "host");
        let failed = CpuEvent::failed(
            Label::new("load", "host"),
            RuntimeError::Numeric("nan".into()),
        );
        assert!(failed.is_complete());
        assert!(matches!(failed.wait(), Err(RuntimeError::Numeric(_))));
    }

    #[test]
    fn work_depending_on_a_failed_host_event_is_skipped() {
        let lane = CpuLane::new("compute").unwrap();
        let failed = CpuEvent::failed(
            Label::new("load batch", "host"),
            RuntimeError::Numeric("bad".into()),
        );
        let event = lane.submit(
            Label::new("fwd", "forward"),
            &[failed],
            Box::new(|_: &CpuBackend| Ok(())),
        );
        let err = event.wait().unwrap_err().to_string();
        assert!(err.contains("skipped `fwd`"), "{err}");
        assert!(
            err.contains("`load batch` on the host lane, which failed"),
            "{err}"
        );
        // Skipping is reported by synchronize once; then the lane runs again.
        let sync = lane.synchronize().unwrap_err().to_string();
        assert!(sync.contains("skipped `fwd`"), "{sync}");
        let again = lane.submit(
            Label::new("fwd 2", "forward"),
            &[],
            Box::new(|_: &CpuBackend| Ok(())),
        );
        assert!(again.wait().is_ok());
        assert!(lane.synchronize().is_ok());
    }

    #[test]
    fn skipped_work_carries_the_root_cause_and_where_it_happened() {
        let comm = CpuLane::new("comm").unwrap();
        let compute = CpuLane::new("compute").unwrap();
        let dispatch = comm.submit(
            Label::new("dispatch mb0", "a2a"),
            &[],
            Box::new(|_: &CpuBackend| Err(RuntimeError::Numeric("bad routing".into()))),
        );
        let mlp = compute.submit(
            Label::new("mlp mb0", "forward"),
            &[dispatch],
            Box::new(|_: &CpuBackend| Ok(())),
        );
        let later = compute.submit(Label::new("mlp mb1", "forward"), &[], Box::new(|_: &CpuBackend| Ok(())));
        for error in [mlp.wait().unwrap_err(), later.wait().unwrap_err()] {
            assert!(matches!(error.root_cause(), RuntimeError::Numeric(m) if m == "bad routing"));
            assert_eq!(error.code(), "diverged");
            match error {
                RuntimeError::Skipped { origin, .. } => {
                    assert_eq!(origin, "`dispatch mb0` on the comm lane")
                }
                other => panic!("{other}"),
            }
        }
        let reported = compute.synchronize().unwrap_err();
        assert!(matches!(reported.root_cause(), RuntimeError::Numeric(_)));
        assert!(comm.synchronize().is_err());
    }

    #[test]
    fn timeouts_too_long_for_the_clock_neither_panic_nor_hang() {
        // A worker that panicked computing its deadline would leave its work
        // unfinished and `synchronize` waiting forever.
        let lane =
            CpuLane::with_config("compute", LaneConfig::default().wait_timeout(Duration::MAX))
                .unwrap();
        let first = lane.submit(Label::new("first", "forward"), &[], Box::new(|_: &CpuBackend| Ok(())));
        let second = lane.submit(
            Label::new("second", "forward"),
            std::slice::from_ref(&first),
            Box::new(|_: &CpuBackend| Ok(())),
        );
        second.wait().unwrap();
        first.wait_timeout(Duration::MAX).unwrap();
        lane.synchronize().unwrap();
    }

    #[test]
    fn event_wait_times_out_naming_the_work() {
        let lane = CpuLane::with_config(
            "comm",
            LaneConfig::default().wait_timeout(Duration::from_millis(50)),
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let event = lane.submit(
            Label::new("slow all_gather", "gather"),
            &[],
            Box::new(move |_: &CpuBackend| {
                let _ = rx.recv_timeout(Duration::from_secs(10));
                Ok(())
            }),
        );
        let err = event.wait().unwrap_err().to_string();
        assert!(
            err.contains("`slow all_gather` did not complete within 100ms"),
            "{err}"
        );
        tx.send(()).unwrap();
        lane.synchronize().unwrap();
    }
}

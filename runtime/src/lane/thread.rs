//! Lanes driven by a host thread each: a FIFO queue of work, and events
//! as a status with a condition variable. Every device's lanes are this
//! machinery over a [`LaneQueue`], which says what running work means on
//! the device: on the CPU the work computes on the lane's thread and is
//! done when it returns; on a GPU it enqueues kernels on the lane's stream
//! and is done when an event recorded after it completes ([`DeviceMark`]).
//!
//! Semantics (the CUDA stream model, made safe):
//! - Work runs in submission order on the lane's thread, each item once its
//!   `after` events have completed on the host side (on a GPU: once their
//!   work was enqueued; the device then orders the streams with
//!   [`LaneQueue::wait_for`], so the host never waits for the GPU here).
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

use crate::backend::Backend;
use crate::cpu::CpuBackend;
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

/// How long a lane waiting for work on another lane yields its core before
/// it blocks on a condition variable. The hand-offs between lanes sit on a
/// step's critical path where nothing else is queued (an `E` layer's
/// dispatch on the comm lane, then its experts on the compute lane, in the
/// first micro-batch), and on an H200 host a lane thread woken from a
/// condition variable took up to 270 µs to run again, the GPU idle
/// meanwhile. Yielding lets any runnable thread have the core (a CPU
/// lane's work on a small machine), so the cost is a few polls.
const YIELD_BEFORE_BLOCKING: Duration = Duration::from_micros(300);

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

/// What running work means on one device: the part of a lane that is not
/// host-side bookkeeping.
pub trait LaneQueue: Send + Sync + 'static {
    type Backend: Backend;
    type Mark: DeviceMark;

    /// The device bound to this queue: what work receives.
    fn backend(&self) -> &Self::Backend;

    /// Makes work run on this queue from now on wait for `mark` (on a GPU:
    /// `cuStreamWaitEvent`; nothing on the CPU, whose marks are complete).
    fn wait_for(&self, mark: &Self::Mark) -> Result<()>;

    /// Runs `work` on this queue (which computes, or enqueues), recording it
    /// in the trace as `label`; returns the mark that completes when it has
    /// run on the device.
    fn run(&self, label: &Label, work: Work<Self::Backend>) -> Result<Self::Mark>;

    /// Waits (bounded) until everything run on this queue has completed on
    /// the device, reporting what failed there.
    fn drain(&self) -> Result<()>;
}

/// When work that was run on a queue completes on its device.
pub trait DeviceMark: Clone + Send + Sync + 'static {
    /// Blocks, bounded, until the work completed; `what` names it for the
    /// error.
    fn wait(&self, what: &dyn Fn() -> String) -> Result<()>;
    fn is_complete(&self) -> bool;
}

/// On the CPU, work has completed when its call returns.
impl DeviceMark for () {
    fn wait(&self, _: &dyn Fn() -> String) -> Result<()> {
        Ok(())
    }

    fn is_complete(&self) -> bool {
        true
    }
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
enum Status<M> {
    Pending,
    /// Run on the host side; `M` says when the device is done.
    Done(M),
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
struct EventState<M> {
    origin: Arc<Origin>,
    wait_timeout: Duration,
    status: Mutex<Status<M>>,
    done: Condvar,
}

/// Marks completion of one work item (or an already-completed marker).
/// Cloning shares the marker.
#[derive(Debug)]
pub struct ThreadEvent<M> {
    state: Arc<EventState<M>>,
}

impl<M> Clone for ThreadEvent<M> {
    fn clone(&self) -> Self {
        ThreadEvent {
            state: self.state.clone(),
        }
    }
}

/// An event of a CPU lane.
pub type CpuEvent = ThreadEvent<()>;

/// Why a dependency did not complete successfully.
enum DependencyFailure {
    /// It ran and failed, or was skipped because of `root`.
    Failed {
        root: Arc<Origin>,
        root_error: RuntimeError,
    },
    TimedOut,
}

impl<M: DeviceMark + Default> ThreadEvent<M> {
    /// An event that is already complete: a starting point for schedules.
    pub fn completed(label: Label) -> Self {
        let event = Self::pending(host_origin(label), DEFAULT_WAIT_TIMEOUT);
        event.finish(Status::Done(M::default()));
        event
    }
}

fn host_origin(label: Label) -> Arc<Origin> {
    Arc::new(Origin {
        lane: Arc::from("host"),
        label,
    })
}

impl<M: DeviceMark> ThreadEvent<M> {
    fn pending(origin: Arc<Origin>, wait_timeout: Duration) -> Self {
        ThreadEvent {
            state: Arc::new(EventState {
                origin,
                wait_timeout,
                status: Mutex::new(Status::Pending),
                done: Condvar::new(),
            }),
        }
    }

    pub fn failed(label: Label, error: RuntimeError) -> Self {
        let event = Self::pending(host_origin(label), DEFAULT_WAIT_TIMEOUT);
        event.finish(Status::Failed { error });
        event
    }

    pub fn label(&self) -> &Label {
        &self.state.origin.label
    }

    pub fn lane(&self) -> &str {
        &self.state.origin.lane
    }

    fn finish(&self, status: Status<M>) {
        *lock(&self.state.status) = status;
        self.state.done.notify_all();
    }

    /// Waits until the work ran on the host side; returns its device mark.
    /// Yields its core for a moment before it blocks: see
    /// [`YIELD_BEFORE_BLOCKING`].
    fn wait_until(&self, deadline: Instant) -> std::result::Result<M, DependencyFailure> {
        let yield_until = deadline.min(Instant::now() + YIELD_BEFORE_BLOCKING);
        while matches!(*lock(&self.state.status), Status::Pending) && Instant::now() < yield_until {
            std::thread::yield_now();
        }
        let mut status = lock(&self.state.status);
        loop {
            match &*status {
                Status::Pending => {}
                Status::Done(mark) => return Ok(mark.clone()),
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

    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        match self.wait_until(deadline_after(timeout)) {
            Ok(mark) => {
                let origin = &self.state.origin;
                mark.wait(&|| origin.to_string())
            }
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

    pub fn error(&self) -> Option<RuntimeError> {
        match &*lock(&self.state.status) {
            Status::Failed { error } | Status::Skipped { error, .. } => Some(error.clone()),
            Status::Pending | Status::Done(_) => None,
        }
    }
}

impl<M: DeviceMark> Event for ThreadEvent<M> {
    fn wait(&self) -> Result<()> {
        self.wait_timeout(self.state.wait_timeout.saturating_mul(2))
    }

    fn is_complete(&self) -> bool {
        match &*lock(&self.state.status) {
            Status::Pending => false,
            Status::Done(mark) => mark.is_complete(),
            Status::Failed { .. } | Status::Skipped { .. } => true,
        }
    }
}

/// How a CPU lane is set up.
#[derive(Clone, Debug)]
pub struct LaneConfig {
    /// The rank the lane belongs to (for traces and thread names).
    pub rank: usize,
    /// How long work waits for a dependency before failing.
    pub wait_timeout: Duration,
    /// Where the lane records what it ran.
    pub trace: Option<Arc<TraceRecorder>>,
    /// The device work receives (bound to the lane by name).
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

/// The CPU's queue: work computes on the lane's thread.
pub struct CpuQueue {
    backend: CpuBackend,
    lane: Arc<str>,
    rank: usize,
    trace: Option<Arc<TraceRecorder>>,
}

impl LaneQueue for CpuQueue {
    type Backend = CpuBackend;
    type Mark = ();

    fn backend(&self) -> &CpuBackend {
        &self.backend
    }

    fn wait_for(&self, _: &()) -> Result<()> {
        Ok(())
    }

    fn run(&self, label: &Label, work: Work<CpuBackend>) -> Result<()> {
        let start = Instant::now();
        let outcome = work(&self.backend);
        if let Some(trace) = &self.trace {
            trace.record_work(self.rank, &self.lane, label, start, Instant::now());
        }
        outcome
    }

    fn drain(&self) -> Result<()> {
        Ok(())
    }
}

/// A CPU lane: a worker thread that runs its work.
pub type CpuLane = ThreadLane<CpuQueue>;

impl ThreadLane<CpuQueue> {
    pub fn new(name: &str) -> Result<Self> {
        Self::with_config(name, LaneConfig::default())
    }

    pub fn with_config(name: &str, config: LaneConfig) -> Result<Self> {
        let queue = CpuQueue {
            backend: config.device.on_lane(name),
            lane: Arc::from(name),
            rank: config.rank,
            trace: config.trace.clone(),
        };
        ThreadLane::start(name, config.rank, config.wait_timeout, queue)
    }
}

struct Job<Q: LaneQueue> {
    label: Label,
    after: Vec<ThreadEvent<Q::Mark>>,
    work: Work<Q::Backend>,
    event: ThreadEvent<Q::Mark>,
}

struct Jobs<Q: LaneQueue> {
    jobs: VecDeque<Job<Q>>,
    submitted: u64,
    finished: u64,
    failure: Option<LaneFailure>,
    closing: bool,
}

/// The first failure on a lane, kept until `synchronize` reports it.
#[derive(Clone)]
struct LaneFailure {
    /// What the failing item's event carries.
    error: RuntimeError,
    root: Arc<Origin>,
    root_error: RuntimeError,
    /// Whether the item failed itself (rather than being skipped).
    own: bool,
}

struct Shared<Q: LaneQueue> {
    name: Arc<str>,
    rank: usize,
    wait_timeout: Duration,
    queue: Q,
    jobs: Mutex<Jobs<Q>>,
    work_ready: Condvar,
    job_done: Condvar,
}

/// A lane: a host thread running its work in order on a [`LaneQueue`].
pub struct ThreadLane<Q: LaneQueue> {
    shared: Arc<Shared<Q>>,
    worker: Option<JoinHandle<()>>,
}

impl<Q: LaneQueue> fmt::Debug for ThreadLane<Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadLane")
            .field("name", &self.shared.name)
            .field("rank", &self.shared.rank)
            .finish()
    }
}

impl<Q: LaneQueue> ThreadLane<Q> {
    /// Starts lane `name` of `rank` on `queue`; work waits at most
    /// `wait_timeout` for a dependency.
    pub fn start(name: &str, rank: usize, wait_timeout: Duration, queue: Q) -> Result<Self> {
        let shared = Arc::new(Shared {
            name: Arc::from(name),
            rank,
            wait_timeout,
            queue,
            jobs: Mutex::new(Jobs {
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
            .name(format!("{name} lane, rank {rank}"))
            .spawn(move || run_worker(&worker_shared))
            .map_err(|e| RuntimeError::Lane {
                lane: name.to_string(),
                message: format!("cannot start the worker thread: {e}"),
            })?;
        Ok(ThreadLane {
            shared,
            worker: Some(worker),
        })
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    pub fn wait_timeout(&self) -> Duration {
        self.shared.wait_timeout
    }

    /// The device side of the lane.
    pub fn queue(&self) -> &Q {
        &self.shared.queue
    }
}

impl<Q: LaneQueue> Lane for ThreadLane<Q> {
    type Event = ThreadEvent<Q::Mark>;
    type Backend = Q::Backend;

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn backend(&self) -> &Q::Backend {
        self.shared.queue.backend()
    }

    fn submit(
        &self,
        label: Label,
        after: &[ThreadEvent<Q::Mark>],
        work: Work<Q::Backend>,
    ) -> ThreadEvent<Q::Mark> {
        let event = ThreadEvent::pending(
            Arc::new(Origin {
                lane: self.shared.name.clone(),
                label: label.clone(),
            }),
            self.shared.wait_timeout,
        );
        let mut jobs = lock(&self.shared.jobs);
        jobs.submitted += 1;
        jobs.jobs.push_back(Job {
            label,
            after: after.to_vec(),
            work,
            event: event.clone(),
        });
        drop(jobs);
        self.shared.work_ready.notify_one();
        event
    }

    fn synchronize(&self) -> Result<()> {
        let mut jobs = lock(&self.shared.jobs);
        let target = jobs.submitted;
        while jobs.finished < target {
            jobs = self
                .shared
                .job_done
                .wait(jobs)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let failure = jobs.failure.take();
        drop(jobs);
        // The device's own failures (a faulting kernel) surface here too;
        // the host side's first failure is reported first.
        let drained = self.shared.queue.drain();
        match failure {
            Some(failure) => Err(failure.error),
            None => drained,
        }
    }
}

impl<Q: LaneQueue> Drop for ThreadLane<Q> {
    fn drop(&mut self) {
        lock(&self.shared.jobs).closing = true;
        self.shared.work_ready.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn run_worker<Q: LaneQueue>(shared: &Shared<Q>) {
    loop {
        let (job, lane_failure) = {
            let mut jobs = lock(&shared.jobs);
            loop {
                if let Some(job) = jobs.jobs.pop_front() {
                    break (job, jobs.failure.clone());
                }
                if jobs.closing {
                    return;
                }
                jobs = shared
                    .work_ready
                    .wait(jobs)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let status = run_job(shared, job.label, job.after, job.work, lane_failure);
        let new_failure = match &status {
            Status::Done(_) | Status::Pending => None,
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
        };
        job.event.finish(status);
        let mut jobs = lock(&shared.jobs);
        if jobs.failure.is_none() {
            jobs.failure = new_failure;
        }
        jobs.finished += 1;
        drop(jobs);
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

fn run_job<Q: LaneQueue>(
    shared: &Shared<Q>,
    label: Label,
    after: Vec<ThreadEvent<Q::Mark>>,
    work: Work<Q::Backend>,
    lane_failure: Option<LaneFailure>,
) -> Status<Q::Mark> {
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
    let deadline = deadline_after(shared.wait_timeout);
    for dependency in &after {
        let mark = match dependency.wait_until(deadline) {
            Ok(mark) => mark,
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
                            label.name, shared.wait_timeout, dependency.state.origin
                        ),
                    },
                };
            }
        };
        if let Err(error) = shared.queue.wait_for(&mark) {
            return Status::Failed { error };
        }
    }
    drop(after);
    let outcome = catch_unwind(AssertUnwindSafe(|| shared.queue.run(&label, work)));
    match outcome {
        Ok(Ok(mark)) => Status::Done(mark),
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
        let later = compute.submit(
            Label::new("mlp mb1", "forward"),
            &[],
            Box::new(|_: &CpuBackend| Ok(())),
        );
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
        let first = lane.submit(
            Label::new("first", "forward"),
            &[],
            Box::new(|_: &CpuBackend| Ok(())),
        );
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

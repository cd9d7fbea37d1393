//! The streams of one GPU and the events that order them.
//!
//! Every stream a GPU's work runs on (a lane's, the rank's host queue) is
//! registered in the GPU's [`QueueSet`] under a small index, so a buffer can
//! remember which streams used it in a bitmask ([`super::buffer`]): when the
//! buffer is dropped, its arena region becomes reusable only after an event
//! recorded on each of those streams, the way CUDA's stream-ordered
//! allocators work. Events come from a pool, since the step loop records
//! them constantly and creating one is a driver allocation.

use crate::error::{Result, RuntimeError};
use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags};
use cudarc::driver::{CudaContext, CudaStream, result};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

/// How long a wait yields its core before it starts sleeping: longer than
/// any one step's queued GPU work behind a host read, so those waits end
/// within a yield of the event rather than within a sleep.
const YIELD_BEFORE_SLEEP: Duration = Duration::from_millis(50);

/// The most streams one GPU registers (the width of a buffer's user mask).
pub const MAX_QUEUES: usize = 16;

/// A raw CUDA event handle that may cross threads (the driver API is
/// thread-safe; the handle is just a name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawEvent(pub(crate) CUevent);

// SAFETY: CUDA events are driver objects usable from any thread of the
// process once their context is current there.
unsafe impl Send for RawEvent {}
unsafe impl Sync for RawEvent {}

/// Says what failed, on which GPU.
pub(crate) fn device_error(device: &str, what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Device {
        device: device.to_string(),
        message: format!("{what}: {e}"),
    }
}

/// What a bounded wait on the GPU checks besides the clock: a closure the
/// platform installs that fails when a peer failed or a communicator
/// reported an error, so a rank blocked on a stream stuck in a collective
/// stops instead of waiting out its deadline.
pub type Watch = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// The registered streams of one GPU and its event pool.
pub struct QueueSet {
    pub(crate) name: String,
    pub(crate) context: Arc<CudaContext>,
    streams: RwLock<Vec<Arc<CudaStream>>>,
    sync_events: Mutex<Vec<RawEvent>>,
    timed_events: Mutex<Vec<RawEvent>>,
    /// How long a host wait on this GPU may take, and what else it checks.
    timeout: Duration,
    watch: RwLock<Option<Watch>>,
}

impl std::fmt::Debug for QueueSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QueueSet({})", self.name)
    }
}

impl QueueSet {
    pub(crate) fn new(name: String, context: Arc<CudaContext>, timeout: Duration) -> Self {
        QueueSet {
            name,
            context,
            streams: RwLock::new(Vec::new()),
            sync_events: Mutex::new(Vec::new()),
            timed_events: Mutex::new(Vec::new()),
            timeout,
            watch: RwLock::new(None),
        }
    }

    pub(crate) fn error(&self, what: &str, e: impl std::fmt::Display) -> RuntimeError {
        device_error(&self.name, what, e)
    }

    /// Makes this GPU's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(|e| self.error("making the context current", e))
    }

    /// A new non-blocking stream, registered: returns it and its index.
    pub(crate) fn new_stream(&self) -> Result<(usize, Arc<CudaStream>)> {
        self.bind()?;
        let stream = self
            .context
            .new_stream()
            .map_err(|e| self.error("creating a stream", e))?;
        let mut streams = self.streams.write().unwrap_or_else(PoisonError::into_inner);
        if streams.len() == MAX_QUEUES {
            return Err(self.error(
                "creating a stream",
                format!("a GPU drives at most {MAX_QUEUES} queues"),
            ));
        }
        streams.push(stream.clone());
        Ok((streams.len() - 1, stream))
    }

    /// The stream registered under `index`.
    pub(crate) fn stream(&self, index: usize) -> Option<Arc<CudaStream>> {
        self.streams
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(index)
            .cloned()
    }

    /// A pooled event without timing (for ordering).
    pub(crate) fn take_event(&self) -> Result<RawEvent> {
        self.take_from(&self.sync_events, CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    /// A pooled event that records time (for traces).
    pub(crate) fn take_timed_event(&self) -> Result<RawEvent> {
        self.take_from(&self.timed_events, CUevent_flags::CU_EVENT_DEFAULT)
    }

    fn take_from(&self, pool: &Mutex<Vec<RawEvent>>, flags: CUevent_flags) -> Result<RawEvent> {
        if let Some(event) = pool.lock().unwrap_or_else(PoisonError::into_inner).pop() {
            return Ok(event);
        }
        self.bind()?;
        result::event::create(flags)
            .map(RawEvent)
            .map_err(|e| self.error("creating an event", e))
    }

    /// Returns an event to the pool. Safe once every `cuStreamWaitEvent` on
    /// it has been issued: a wait captures the record it waits for.
    pub(crate) fn give_event(&self, event: RawEvent) {
        self.sync_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(event);
    }

    pub(crate) fn give_timed_event(&self, event: RawEvent) {
        self.timed_events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(event);
    }

    /// Records `event` on `stream`: it completes when everything enqueued
    /// there so far has run.
    pub(crate) fn record(&self, event: RawEvent, stream: &CudaStream) -> Result<()> {
        self.bind()?;
        // SAFETY: both handles are live objects of this context.
        unsafe { result::event::record(event.0, stream.cu_stream()) }
            .map_err(|e| self.error("recording an event", e))
    }

    /// Makes `stream` wait (on the GPU) for `event`'s last record.
    pub(crate) fn wait_on(&self, stream: &CudaStream, event: RawEvent) -> Result<()> {
        // SAFETY: both handles are live objects of this context.
        unsafe {
            result::stream::wait_event(
                stream.cu_stream(),
                event.0,
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| self.error("waiting for an event", e))
    }

    /// Whether `event`'s work has run; an error when it failed (a kernel
    /// fault surfaces here).
    pub(crate) fn query(&self, event: RawEvent) -> Result<bool> {
        // SAFETY: a live event of this context.
        match unsafe { result::event::query(event.0) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(self.error("the GPU's work failed", e)),
        }
    }

    /// Installs what bounded waits check besides the clock.
    pub fn set_watch(&self, watch: Watch) {
        *self.watch.write().unwrap_or_else(PoisonError::into_inner) = Some(watch);
    }

    /// Blocks until `event` completed, polling so that the wait stays
    /// bounded: past the timeout, or when the watch reports a failure, it
    /// gives up with an error saying what it waited for. Spins briefly
    /// first (most waits are short), then yields the core for as long as a
    /// step's GPU work can take, and only then sleeps in growing steps. A
    /// sleep overshoots the event by up to its own length, and the waits
    /// on a step's path (a count read behind milliseconds of GEMMs) were
    /// leaving the GPU idle for up to the 1 ms cap each.
    pub(crate) fn wait_event(&self, event: RawEvent, what: &dyn Fn() -> String) -> Result<()> {
        self.bind()?;
        let start = Instant::now();
        let timeout = self.timeout;
        let mut pause = Duration::from_micros(2);
        let mut polls = 0u32;
        loop {
            if self.query(event)? {
                return Ok(());
            }
            polls += 1;
            if polls.is_multiple_of(64) {
                if let Some(watch) = self
                    .watch
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone()
                {
                    watch()?;
                }
                if start.elapsed() > timeout {
                    return Err(RuntimeError::Lane {
                        lane: self.name.clone(),
                        message: format!(
                            "{} did not finish within {:.0?}: a peer may have stalled or the \
                             work is slower than the timeout allows (raise it)",
                            what(),
                            timeout
                        ),
                    });
                }
            }
            if polls <= 200 {
                std::hint::spin_loop();
            } else if start.elapsed() < YIELD_BEFORE_SLEEP {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }
}

impl Drop for QueueSet {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_err() {
            return;
        }
        let pools = [&self.sync_events, &self.timed_events];
        for pool in pools {
            for event in pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .drain(..)
            {
                // SAFETY: pooled events are owned by the pool alone.
                let _ = unsafe { result::event::destroy(event.0) };
            }
        }
    }
}

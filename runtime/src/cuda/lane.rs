//! CUDA lanes: a stream each, driven by a host thread that only enqueues
//! (the lane machinery of [`crate::lane::thread`] over a [`CudaQueue`]).
//! Work's completion is a CUDA event recorded after it ([`CudaMark`]);
//! cross-lane waits are `cuStreamWaitEvent`, so the host never waits for
//! the GPU to order two lanes.
//!
//! Work the rank's driver thread enqueues on its host queue between
//! submissions (uploads, zeroing, the optimizer) is ordered before lane work
//! submitted after it: before running work, a lane fences on the host queue
//! when that queue has had work since the lane's last fence.
//!
//! Traces show what ran on the GPU: each piece of work is bracketed by two
//! timed events, and their times (read once they completed, never by
//! waiting for them) are placed on the host clock through an anchor event
//! recorded when the stream was idle.

use super::backend::CudaBackend;
use super::queue::{QueueSet, RawEvent};
use crate::error::Result;
use crate::lane::thread::{DeviceMark, LaneQueue, ThreadEvent, ThreadLane};
use crate::lane::{Label, Work};
use crate::trace::{Span, TraceRecorder};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A lane on a GPU stream.
pub type CudaLane = ThreadLane<CudaQueue>;
/// An event of a [`CudaLane`].
pub type CudaEvent = ThreadEvent<CudaMark>;

/// When a piece of work has run on the GPU: a pooled event recorded after
/// it on its stream.
#[derive(Clone, Debug)]
pub struct CudaMark(Arc<MarkEvent>);

#[derive(Debug)]
struct MarkEvent {
    event: RawEvent,
    /// The stream it was recorded on (waiting on it there is a no-op).
    stream: usize,
    queues: Arc<QueueSet>,
}

impl Drop for MarkEvent {
    fn drop(&mut self) {
        self.queues.give_event(self.event);
    }
}

impl DeviceMark for CudaMark {
    fn wait(&self, what: &dyn Fn() -> String) -> Result<()> {
        self.0.queues.wait_event(self.0.event, what)
    }

    fn is_complete(&self) -> bool {
        // A failed query means the work failed: complete, not successfully.
        self.0.queues.query(self.0.event).unwrap_or(true)
    }
}

/// A span whose events have been recorded but maybe not yet run.
struct PendingSpan {
    label: Label,
    start: RawEvent,
    end: RawEvent,
}

/// Where a lane's spans go and how their GPU times become host times.
struct Tracing {
    recorder: Arc<TraceRecorder>,
    rank: usize,
    pending: Mutex<VecDeque<PendingSpan>>,
    /// A timed event that completed at `at` (host clock).
    anchor: Mutex<(RawEvent, Instant)>,
}

/// The device side of a CUDA lane.
pub struct CudaQueue {
    backend: CudaBackend,
    /// The rank's host queue, fenced on before work when it has had work.
    host: Option<CudaBackend>,
    fenced: AtomicU64,
    tracing: Option<Tracing>,
}

impl CudaQueue {
    /// A new stream on `host`'s GPU named `lane`, fencing on `host`'s queue,
    /// recording spans for `rank` into `trace`.
    pub fn new(
        host: &CudaBackend,
        lane: &str,
        rank: usize,
        trace: Option<Arc<TraceRecorder>>,
    ) -> Result<CudaQueue> {
        let backend = host.on_new_queue(lane)?;
        let tracing = match trace {
            None => None,
            Some(recorder) => Some(Tracing {
                recorder,
                rank,
                pending: Mutex::new(VecDeque::new()),
                anchor: Mutex::new(anchor(&backend)?),
            }),
        };
        Ok(CudaQueue {
            backend,
            host: Some(host.clone()),
            fenced: AtomicU64::new(0),
            tracing,
        })
    }

    fn queues(&self) -> &Arc<QueueSet> {
        &self.backend.gpu().queues
    }

    /// Makes this stream wait for the host queue's work, if it had any
    /// since the last fence.
    fn fence_host_queue(&self) -> Result<()> {
        let Some(host) = &self.host else {
            return Ok(());
        };
        let ops = host.queue.ops.load(Ordering::Acquire);
        if ops == self.fenced.load(Ordering::Relaxed) {
            return Ok(());
        }
        let queues = self.queues();
        let event = queues.take_event()?;
        let fenced = queues
            .record(event, host.stream())
            .and_then(|()| queues.wait_on(self.backend.stream(), event));
        queues.give_event(event);
        fenced?;
        self.fenced.store(ops, Ordering::Relaxed);
        Ok(())
    }

    /// Turns the spans whose events have run into trace spans, in order;
    /// with `all`, waits for the stream first so every one has.
    fn resolve_spans(&self, tracing: &Tracing) -> Result<()> {
        let queues = self.queues();
        let (anchor, at) = *tracing
            .anchor
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut pending = tracing
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while let Some(span) = pending.front() {
            if !queues.query(span.end)? {
                break;
            }
            let since = |event: RawEvent| -> Result<Duration> {
                // SAFETY: both are completed timed events of this context.
                let ms = unsafe { cudarc::driver::result::event::elapsed(anchor.0, event.0) }
                    .map_err(|e| queues.error("timing a span", e))?;
                Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            };
            let (start, end) = (since(span.start)?, since(span.end)?);
            let recorder = &tracing.recorder;
            let base = recorder.offset(at);
            recorder.record(Span::new(
                tracing.rank,
                self.backend.queue.name.to_string(),
                &span.label,
                base + start,
                base + end,
            ));
            let span = pending.pop_front().expect("just looked at it");
            queues.give_timed_event(span.start);
            queues.give_timed_event(span.end);
        }
        Ok(())
    }
}

/// A timed event recorded on `backend`'s idle stream, and when it ran.
fn anchor(backend: &CudaBackend) -> Result<(RawEvent, Instant)> {
    let queues = &backend.gpu().queues;
    backend.synchronize()?;
    let event = queues.take_timed_event()?;
    queues.record(event, backend.stream())?;
    queues.wait_event(event, &|| "the trace's anchor event".to_string())?;
    Ok((event, Instant::now()))
}

impl LaneQueue for CudaQueue {
    type Backend = CudaBackend;
    type Mark = CudaMark;

    fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    fn wait_for(&self, mark: &CudaMark) -> Result<()> {
        if mark.0.stream == self.backend.queue_index() {
            return Ok(());
        }
        self.queues().wait_on(self.backend.stream(), mark.0.event)
    }

    fn run(&self, label: &Label, work: Work<CudaBackend>) -> Result<CudaMark> {
        let queues = self.queues();
        queues.bind()?;
        self.fence_host_queue()?;
        let stream = self.backend.stream();
        let start = match &self.tracing {
            Some(_) => {
                let start = queues.take_timed_event()?;
                queues.record(start, stream)?;
                Some(start)
            }
            None => None,
        };
        let outcome = work(&self.backend);
        if let (Some(tracing), Some(start)) = (&self.tracing, start) {
            let end = queues.take_timed_event()?;
            queues.record(end, stream)?;
            tracing
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push_back(PendingSpan {
                    label: label.clone(),
                    start,
                    end,
                });
            self.resolve_spans(tracing)?;
        }
        outcome?;
        let event = queues.take_event()?;
        queues.record(event, stream)?;
        Ok(CudaMark(Arc::new(MarkEvent {
            event,
            stream: self.backend.queue_index(),
            queues: queues.clone(),
        })))
    }

    fn drain(&self) -> Result<()> {
        self.backend.synchronize()?;
        if let Some(tracing) = &self.tracing {
            self.resolve_spans(tracing)?;
            // A fresh anchor keeps the f32 milliseconds of event timing
            // precise in long runs.
            let (new, at) = anchor(&self.backend)?;
            let (old, _) = std::mem::replace(
                &mut *tracing
                    .anchor
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner),
                (new, at),
            );
            self.queues().give_timed_event(old);
        }
        Ok(())
    }
}

impl ThreadLane<CudaQueue> {
    /// A lane named `name` on a new stream of `host`'s GPU. Work waits at
    /// most `wait_timeout` for a dependency to be enqueued.
    pub fn on_gpu(
        name: &str,
        host: &CudaBackend,
        rank: usize,
        wait_timeout: Duration,
        trace: Option<Arc<TraceRecorder>>,
    ) -> Result<CudaLane> {
        let queue = CudaQueue::new(host, name, rank, trace)?;
        ThreadLane::start(name, rank, wait_timeout, queue)
    }
}

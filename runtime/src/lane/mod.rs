//! Lanes and events: ordered queues of work, and markers another lane can
//! wait on (docs/architecture.md). CUDA: a stream and an event, driven by a
//! host thread per lane. CPU: a worker thread per lane with a queue, and a
//! flag with a condition variable. The schedules are written once against
//! these traits, so the CPU run really overlaps too.

pub mod thread;

use crate::backend::Backend;
use crate::error::Result;
use std::borrow::Cow;

/// A unit of lane work. It receives the lane's backend (on a GPU, bound to
/// the lane's stream) and launches its kernels there; where it runs on the
/// host is the lane's business.
pub type Work<B> = Box<dyn FnOnce(&B) -> Result<()> + Send + 'static>;

/// What a piece of lane work is, for traces and error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    /// Short name shown on the timeline (`fwd pre-dispatch decoder.layers.3`).
    pub name: Cow<'static, str>,
    /// Category for the trace viewer: `forward`, `backward`, `wgrad`,
    /// `gather`, `reduce`, `a2a`, `optimizer`, ...
    pub category: &'static str,
    /// The micro-batch, when the work belongs to one.
    pub micro_batch: Option<usize>,
}

impl Label {
    pub fn new(name: impl Into<Cow<'static, str>>, category: &'static str) -> Self {
        Label {
            name: name.into(),
            category,
            micro_batch: None,
        }
    }

    pub fn micro_batch(mut self, micro_batch: usize) -> Self {
        self.micro_batch = Some(micro_batch);
        self
    }
}

/// A marker that completes when the work behind it has run.
pub trait Event: Clone + Send + Sync + 'static {
    /// Blocks the calling thread until the work completed. Returns the
    /// work's error if it failed (or was skipped because a dependency failed).
    fn wait(&self) -> Result<()>;
    /// Whether the work has completed (successfully or not).
    fn is_complete(&self) -> bool;
}

/// An ordered queue of work.
pub trait Lane: Send + Sync {
    type Event: Event;
    /// The device the lane's work runs on.
    type Backend: Backend;

    /// The lane's name (`compute`, `comm`), for traces and errors.
    fn name(&self) -> &str;

    /// The device, bound to this lane: what [`Work`] receives.
    fn backend(&self) -> &Self::Backend;

    /// Queues `work` behind everything already queued on this lane; it starts
    /// once every event in `after` has completed. Returns an event that
    /// completes when the work has run. If a dependency failed, the work is
    /// skipped and the returned event carries that failure.
    fn submit(&self, label: Label, after: &[Self::Event], work: Work<Self::Backend>)
    -> Self::Event;

    /// Waits until everything queued so far has run; the first error wins.
    fn synchronize(&self) -> Result<()>;
}

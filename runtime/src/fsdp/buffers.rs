//! A rank's shards, the buffers of the unit pool, and how the layers reach
//! the parameters and gradients they read and write.

#[cfg(doc)]
use super::{FsdpEngine, ShardLayout};
use crate::backend::{Backend, Slice, SliceMut};
use crate::device::{Buf, Device, EventOf};
use crate::error::{Result, RuntimeError};
use std::ops::Range;
use std::sync::Arc;

/// What a rank keeps of one bucket between steps. Lane work and the
/// driver share it; lanes and events order their accesses.
pub struct ShardState<B: Backend> {
    /// f32 master weights of the owned elements.
    pub master: B::Buf,
    /// The same in the compute dtype: what all-gathers send.
    pub param: ShardPart<B>,
    /// f32 gradients of the owned elements, summed over micro-batches.
    pub grad: ShardPart<B>,
}

/// Where a shard's compute-dtype parameters or its gradients live: a
/// buffer of their own, or, for a bucket this rank holds whole and alone
/// (see [`FsdpEngine`]'s held buckets), the bucket's region of its unit's
/// held buffers, which layers then read and accumulate into directly.
pub struct ShardPart<B: Backend> {
    buf: Arc<B::Buf>,
    range: Range<usize>,
}

impl<B: Backend> ShardPart<B> {
    pub(super) fn whole(buf: B::Buf, len: usize) -> Self {
        ShardPart {
            buf: Arc::new(buf),
            range: 0..len,
        }
    }

    pub(super) fn region(buf: &Arc<B::Buf>, range: Range<usize>) -> Self {
        ShardPart {
            buf: buf.clone(),
            range,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    pub fn view<'a>(&'a self, b: &B) -> Result<Slice<'a, B>> {
        b.slice(&self.buf, self.range.clone())
    }

    pub fn view_mut<'a>(&'a self, b: &B) -> Result<SliceMut<'a, B>> {
        b.slice_mut(&self.buf, self.range.clone())
    }

    /// `piece`, in the shard's coordinates.
    pub fn piece<'a>(&'a self, b: &B, piece: Range<usize>) -> Result<Slice<'a, B>> {
        b.slice(&self.buf, self.within(piece)?)
    }

    pub fn piece_mut<'a>(&'a self, b: &B, piece: Range<usize>) -> Result<SliceMut<'a, B>> {
        b.slice_mut(&self.buf, self.within(piece)?)
    }

    /// `piece` of the shard as a range of its buffer.
    fn within(&self, piece: Range<usize>) -> Result<Range<usize>> {
        let end = self.range.start.checked_add(piece.end);
        match end {
            Some(end) if piece.start <= piece.end && end <= self.range.end => {
                Ok(self.range.start + piece.start..end)
            }
            _ => Err(RuntimeError::InvalidArgument(format!(
                "elements {piece:?} of a shard of {} elements",
                self.range.len()
            ))),
        }
    }
}

/// One buffer of the unit pool.
pub(super) struct ParamSlot<D: Device> {
    pub(super) buf: Arc<Buf<D>>,
    /// The unit whose parameters it holds (valid or being gathered).
    pub(super) holder: Option<usize>,
    /// The last work on each lane (compute, comm) that read it: a new
    /// gather waits for them. Lanes are FIFO, so the newest use per lane
    /// covers the older ones.
    pub(super) last_uses: [Option<EventOf<D>>; 2],
    /// When it was last released, for least-recently-released reuse.
    pub(super) released_at: u64,
}

/// The held buffers of a unit: the storage of the shards of its buckets
/// that this rank holds whole and alone ([`ShardLayout::sole`]), back to
/// back. They are never gathered, and their gradients never copied or
/// reduced: the layers accumulate every micro-batch's straight into the
/// shards.
pub(super) struct HeldBuckets<D: Device> {
    pub(super) params: Arc<Buf<D>>,
    pub(super) grads: Arc<Buf<D>>,
    /// The last work that wrote `grads` (the step's zeroing, then each
    /// micro-batch's backward): the next backward waits for it.
    pub(super) written: Option<EventOf<D>>,
}

pub(super) struct GradSlot<D: Device> {
    pub(super) buf: Arc<Buf<D>>,
    pub(super) busy: bool,
    /// The reduce that last read it; the next user waits for it.
    pub(super) free_after: Option<EventOf<D>>,
}

/// Where a unit's parameters are.
pub(super) struct Residency<D: Device> {
    pub(super) slot: Option<usize>,
    pub(super) refs: usize,
    /// Completes when the unit's parameters are in its slot.
    pub(super) ready: Option<EventOf<D>>,
    pub(super) grad_slot: Option<usize>,
    /// Completes when the unit's gradient buffer is zeroed.
    pub(super) grad_ready: Option<EventOf<D>>,
}

/// One bucket's part of a gather or a reduce: the rank's shard, the
/// bucket's region in the full buffer, and the group it is sharded over.
pub(super) struct BucketJob<D: Device> {
    pub(super) shard: Arc<ShardState<D::Backend>>,
    pub(super) region: Range<usize>,
    pub(super) comm: Arc<D::Comm>,
}

/// A unit's (or the non-unit) parameter or gradient buffer, with the event
/// that must complete before work reads or writes it.
pub struct BufferAccess<D: Device, T> {
    pub buf: T,
    pub ready: Option<EventOf<D>>,
}

/// The non-unit parameters (read by many lane works at once).
pub type ParamAccess<D> = BufferAccess<D, Arc<Buf<D>>>;
/// The non-unit gradients.
pub type GradAccess<D> = BufferAccess<D, Arc<Buf<D>>>;

/// A unit's parameter (or gradient) buffers: the pool buffer its gathered
/// buckets are in, and its held buffer; `None` where it has no such
/// buckets.
pub struct UnitBuffers<D: Device> {
    pub gathered: Option<Arc<Buf<D>>>,
    pub held: Option<Arc<Buf<D>>>,
}

/// Which buffer a parameter (and its gradient) lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Its unit's pool buffer (gathered) and gradient buffer.
    Gathered,
    /// Its unit's held buffers: its shard itself.
    Held,
    /// The non-unit buffers.
    NonUnit,
}

/// Where a parameter lies: its holder and its elements there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamPlace {
    pub holder: Holder,
    pub range: Range<usize>,
}

/// What fills the master weights: elements `range` of parameter `p` (by
/// index into `plan.params`) into a slice of `range.len()` values.
pub type InitParams<'a> = dyn Fn(usize, Range<usize>, &mut [f32]) -> Result<()> + Sync + 'a;

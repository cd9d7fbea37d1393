//! A GPU's arenas: where its buffers get their memory.
//!
//! The same scheme as the CPU's (`crate::cpu::arena`): a few large device
//! allocations carved into regions, best fit, neighbours merged when a
//! buffer is dropped, growth as [`ArenaGrowth`] says (the micro-batches'
//! arena by a quarter during the first step), nothing allocated once a step
//! has run. What a GPU adds is *when* a region may be
//! reused: a buffer is dropped on the host as soon as the host code that
//! enqueued its last kernel returns, while that kernel may not have run yet.
//! So a freed region carries, per stream that used the buffer, an event
//! recorded there at the drop; whoever takes the region next makes its
//! stream wait for those events (on the GPU: the host never blocks here).
//! A stream's later event implies its earlier ones, so a region keeps at
//! most one per stream, and merging keeps the later of two.

use super::queue::{MAX_QUEUES, QueueSet, RawEvent};
use crate::backend::ArenaGrowth;
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaStream, result};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

/// Regions start on multiples of this many bytes (cuBLAS and vector loads
/// want 256-byte alignment).
const GRANULE: usize = 256;
/// The smallest segment an arena adds (2 MiB, the driver's page size).
const MIN_SEGMENT: usize = 2 << 20;

/// One recorded event a free region waits for; shared by the pieces a
/// split leaves, and back in the pool when the last of them is gone.
#[derive(Debug)]
struct Fence {
    /// The order it was recorded in (keeps the later of one stream's two).
    order: u64,
    event: RawEvent,
    queues: Arc<QueueSet>,
}

impl Drop for Fence {
    fn drop(&mut self) {
        self.queues.give_event(self.event);
    }
}

/// Events a region must wait for before reuse, per stream index.
#[derive(Clone, Debug, Default)]
struct Fences {
    by_stream: [Option<Arc<Fence>>; MAX_QUEUES],
}

impl Fences {
    /// Keeps, per stream, the later of the two fences.
    fn merge(&mut self, other: Fences) {
        for (mine, theirs) in self.by_stream.iter_mut().zip(other.by_stream) {
            match (mine.as_ref(), theirs) {
                (_, None) => {}
                (Some(m), Some(t)) if m.order >= t.order => {}
                (_, Some(t)) => *mine = Some(t),
            }
        }
    }
}

/// A region of an arena, owned by one buffer.
#[derive(Debug)]
pub(crate) struct Region {
    segment: usize,
    offset: usize,
    pub(crate) bytes: usize,
    /// The device address of the region's first byte.
    pub(crate) ptr: u64,
}

/// One device allocation of an arena, freed when the arena is dropped.
struct Segment {
    ptr: u64,
}

#[derive(Default)]
struct State {
    segments: Vec<Segment>,
    in_use: usize,
    peak: usize,
    total: usize,
    /// Free regions by (segment, offset) -> (bytes, fences).
    by_place: BTreeMap<(usize, usize), (usize, Fences)>,
    /// The same regions by size, for best fit.
    by_size: BTreeSet<(usize, usize, usize)>,
    /// Records made so far (orders fences of one stream).
    records: u64,
}

impl State {
    fn insert(&mut self, segment: usize, offset: usize, bytes: usize, fences: Fences) {
        self.by_place.insert((segment, offset), (bytes, fences));
        self.by_size.insert((bytes, segment, offset));
    }

    fn remove(&mut self, segment: usize, offset: usize) -> Option<(usize, Fences)> {
        let (bytes, fences) = self.by_place.remove(&(segment, offset))?;
        self.by_size.remove(&(bytes, segment, offset));
        Some((bytes, fences))
    }
}

/// One arena of one GPU.
pub struct GpuArena {
    queues: Arc<QueueSet>,
    state: Mutex<State>,
    growth: ArenaGrowth,
}

impl std::fmt::Debug for GpuArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuArena({} bytes)", self.total_bytes())
    }
}

impl GpuArena {
    pub(crate) fn new(queues: Arc<QueueSet>, growth: ArenaGrowth) -> Self {
        GpuArena {
            queues,
            state: Mutex::new(State::default()),
            growth,
        }
    }

    /// A region of at least `bytes` bytes, zeroed on `stream` (stream
    /// `index`) after that stream waits for the region's fences from other
    /// streams; and whether the arena had to grow (a device allocation).
    pub(crate) fn take(
        &self,
        bytes: usize,
        fill: Option<u8>,
        index: usize,
        stream: &CudaStream,
        what: impl FnOnce() -> String,
    ) -> Result<(Region, bool)> {
        let want = bytes.max(1).div_ceil(GRANULE) * GRANULE;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut grew = false;
        let fit = match state.by_size.range((want, 0, 0)..).next().copied() {
            Some(fit) => fit,
            None => {
                let size = self.growth.segment(want, state.total, MIN_SEGMENT);
                self.queues.bind()?;
                // SAFETY: a plain device allocation, freed in `drop`.
                let ptr = unsafe { result::malloc_sync(size) }.map_err(|e| {
                    RuntimeError::OutOfMemory(format!(
                        "{}: out of GPU memory allocating {size} bytes for {} ({e}); the \
                         memory estimate was too low: lower the micro-batch size or the \
                         sequence length, or use more GPUs",
                        self.queues.name,
                        what()
                    ))
                })?;
                let segment = state.segments.len();
                state.segments.push(Segment { ptr });
                state.total += size;
                state.insert(segment, 0, size, Fences::default());
                grew = true;
                (size, segment, 0)
            }
        };
        let (size, segment, offset) = fit;
        let (_, fences) = state
            .remove(segment, offset)
            .expect("a region found by size is in the place map");
        state.in_use += want;
        state.peak = state.peak.max(state.in_use);
        if size > want {
            // The rest stays fenced: it was part of the same freed buffers.
            state.insert(segment, offset + want, size - want, fences.clone());
        }
        let ptr = state.segments[segment].ptr + offset as u64;
        drop(state);
        for (s, fence) in fences.by_stream.iter().enumerate() {
            if let Some(fence) = fence
                && s != index
            {
                self.queues.wait_on(stream, fence.event)?;
            }
        }
        if let Some(byte) = fill {
            // SAFETY: the region is `want` bytes of a live segment, owned by
            // no buffer; the memset runs on the stream that will use it.
            unsafe { result::memset_d8_async(ptr, byte, want, stream.cu_stream()) }
                .map_err(|e| self.queues.error("filling a new buffer", e))?;
        }
        Ok((
            Region {
                segment,
                offset,
                bytes: want,
                ptr,
            },
            grew,
        ))
    }

    /// Takes a region back once the streams in `users` (a bitmask of stream
    /// indices) have run what they were given so far.
    pub(crate) fn give(&self, region: &Region, users: u32) {
        let mut fences = Fences::default();
        for s in 0..MAX_QUEUES {
            if users & (1 << s) == 0 {
                continue;
            }
            let Some(stream) = self.queues.stream(s) else {
                continue;
            };
            // Without a fence the region is not safe to reuse: leak it.
            let Ok(event) = self.queues.take_event() else {
                return;
            };
            if self.queues.record(event, &stream).is_err() {
                self.queues.give_event(event);
                return;
            }
            let order = {
                let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                state.records += 1;
                state.records
            };
            fences.by_stream[s] = Some(Arc::new(Fence {
                order,
                event,
                queues: self.queues.clone(),
            }));
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (segment, mut offset, mut bytes) = (region.segment, region.offset, region.bytes);
        state.in_use -= bytes;
        if let Some((&(s, o), &(b, _))) = state.by_place.range(..(segment, offset)).next_back()
            && s == segment
            && o + b == offset
        {
            let (_, before) = state.remove(s, o).expect("just found");
            fences.merge(before);
            offset = o;
            bytes += b;
        }
        if let Some((after_bytes, after)) = state.remove(segment, offset + bytes) {
            fences.merge(after);
            bytes += after_bytes;
        }
        state.insert(segment, offset, bytes, fences);
    }

    /// Bytes in use now, and the most in use at once so far.
    pub fn use_bytes(&self) -> (usize, usize) {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        (state.in_use, state.peak)
    }

    /// Bytes the arena holds, used or not.
    pub fn total_bytes(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }
}

impl Drop for GpuArena {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if self.queues.bind().is_err() {
            return;
        }
        // Every buffer is gone (each holds the arena); wait for the GPU to
        // be done with them before handing the memory back.
        let _ = self.queues.context.synchronize();
        state.by_place.clear();
        for segment in state.segments.drain(..) {
            // SAFETY: allocated by `take`, used by no buffer any more.
            let _ = unsafe { result::free_sync(segment.ptr) };
        }
    }
}

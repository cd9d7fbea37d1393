//! Reads from a GPU to the host in one round trip.
//!
//! A host read has to see every write queued before it and report any bad
//! index a kernel flagged in the GPU's fault word ([`KernelSet`]). Done as
//! three waits (the stream, then a blocking copy of the fault word, then a
//! blocking copy of the data), each costs a trip to the GPU and back, about
//! 20-30 µs, and the MoE layers' count reads sit on the step's critical
//! path: the GPU has nothing else queued while the host waits for the
//! counts that size the experts' GEMMs. Here a read enqueues the copies of
//! the fault word and the data into pinned host memory behind the work
//! queued so far, records one event, and waits for that event alone: one
//! trip. Started early (`StagedRead::start`) and finished later, the trip
//! overlaps whatever the GPU runs in between.
//!
//! Pinned buffers come from a pool on the GPU, so after the first step no
//! read allocates. Reads larger than [`STAGED_READ_MAX_BYTES`] (tests,
//! checkpoints, hashes: none latency-bound) go through it a chunk at a
//! time, the next chunk's copy in flight while one is copied out
//! (`CudaBackend::read_into`).

use super::fault::DeviceFault;
use super::launch::KernelSet;
use super::queue::{QueueSet, RawEvent};
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaStream, result};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

/// The largest read that goes through pinned staging.
pub const STAGED_READ_MAX_BYTES: usize = 1 << 20;

/// The smallest pinned buffer the pool allocates (room for the fault word
/// and a few thousand counts).
const MIN_STAGING_BYTES: usize = 4096;

/// Bytes in front of the data in a staging buffer: the fault word.
const FAULT_BYTES: usize = std::mem::size_of::<u64>();

/// One pinned host buffer.
struct Staging {
    ptr: *mut u8,
    capacity: usize,
}

// SAFETY: pinned host memory is plain memory any thread may read and write;
// the pool hands a buffer to one read at a time.
unsafe impl Send for Staging {}

impl Staging {
    fn alloc(queues: &QueueSet, bytes: usize) -> Result<Staging> {
        let capacity = bytes.max(MIN_STAGING_BYTES).next_power_of_two();
        queues.bind()?;
        // SAFETY: the context is current; flags 0 is page-locked memory
        // for this context.
        let ptr = unsafe { result::malloc_host(capacity, 0) }
            .map_err(|e| queues.error("allocating pinned host memory for a read", e))?;
        Ok(Staging {
            ptr: ptr.cast(),
            capacity,
        })
    }

    fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: `len <= capacity` (callers check) bytes of a live
        // allocation that no copy is writing (the read's event completed).
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The GPU's pinned staging buffers not in use.
pub(crate) struct StagingPool {
    queues: Arc<QueueSet>,
    free: Mutex<Vec<Staging>>,
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        // Pinned memory is freed in its context.
        if self.queues.bind().is_ok() {
            self.free
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
    }
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        write!(f, "StagingPool({} free)", free.len())
    }
}

impl StagingPool {
    pub(crate) fn new(queues: Arc<QueueSet>) -> StagingPool {
        StagingPool {
            queues,
            free: Mutex::new(Vec::new()),
        }
    }

    /// A free buffer of at least `bytes`, the smallest that fits; a new one
    /// when none does.
    fn take(&self, bytes: usize) -> Result<Staging> {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, s)| s.capacity >= bytes)
            .min_by_key(|(_, s)| s.capacity)
            .map(|(i, _)| i);
        match best {
            Some(i) => Ok(free.swap_remove(i)),
            None => {
                drop(free);
                Staging::alloc(&self.queues, bytes)
            }
        }
    }

    fn give(&self, staging: Staging) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(staging);
    }
}

/// What a read needs of its GPU: the staging pool (and through it the
/// streams' events) and the fault word's address. Cloned into every
/// pending read, so that one dropped unfinished can still wait for its
/// copy before its buffer is reused.
#[derive(Clone)]
pub(crate) struct ReadContext {
    pub(crate) pool: Arc<StagingPool>,
    pub(crate) fault_word: u64,
}

/// A read of `len` elements of `T` (the fault word with it) in flight to
/// pinned memory: `StagedRead::finish` waits for it.
pub struct StagedRead<T> {
    cx: ReadContext,
    staging: Option<Staging>,
    event: RawEvent,
    len: usize,
    what: &'static str,
    _t: PhantomData<T>,
}

impl<T: Copy> StagedRead<T> {
    /// Enqueues on `stream` the copies of the fault word and of `len`
    /// elements of `T` at device address `src`, and an event after them.
    /// `what` names the read in a timeout.
    pub(crate) fn start(
        cx: &ReadContext,
        stream: &CudaStream,
        src: u64,
        len: usize,
        what: &'static str,
    ) -> Result<StagedRead<T>> {
        let data_bytes = len * std::mem::size_of::<T>();
        let staging = cx.pool.take(FAULT_BYTES + data_bytes)?;
        let event = match cx.pool.queues.take_event() {
            Ok(event) => event,
            Err(e) => {
                cx.pool.give(staging);
                return Err(e);
            }
        };
        let mut read = StagedRead {
            cx: cx.clone(),
            staging: Some(staging),
            event,
            len,
            what,
            _t: PhantomData,
        };
        if let Err(e) = read.enqueue(stream, src, data_bytes) {
            // A copy may be queued without the event behind it: leak the
            // buffer rather than hand it to another read under that copy.
            std::mem::forget(read.staging.take());
            return Err(e);
        }
        Ok(read)
    }

    fn enqueue(&self, stream: &CudaStream, src: u64, data_bytes: usize) -> Result<()> {
        let staging = self
            .staging
            .as_ref()
            .expect("a started read holds its buffer");
        let queues = &self.cx.pool.queues;
        queues.bind()?;
        // SAFETY: the staging buffer holds FAULT_BYTES + data_bytes bytes
        // and stays untouched until the event completes (the read owns
        // it); the fault word is a live u64 of this context and `src`
        // holds `data_bytes` bytes (checked by the caller).
        unsafe {
            let word = std::slice::from_raw_parts_mut(staging.ptr, FAULT_BYTES);
            result::memcpy_dtoh_async(word, self.cx.fault_word, stream.cu_stream())
                .map_err(|e| queues.error("reading the fault word", e))?;
            if data_bytes > 0 {
                let data = std::slice::from_raw_parts_mut(staging.ptr.add(FAULT_BYTES), data_bytes);
                result::memcpy_dtoh_async(data, src, stream.cu_stream())
                    .map_err(|e| queues.error("copying to the host", e))?;
            }
        }
        queues.record(self.event, stream)
    }

    /// Elements the read copies.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the read copies no elements (a wait and a fault check).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waits (bounded) for the copies, then writes the data into `dst`
    /// ([`StagedRead::len`] elements), or returns the first bad index a
    /// kernel reported before the read (clearing it, on `stream`, for the
    /// next read).
    pub(crate) fn finish(
        mut self,
        kernels: &KernelSet,
        stream: &Arc<CudaStream>,
        dst: &mut [T],
    ) -> Result<()> {
        crate::view::same_len(self.what, self.len, dst.len())?;
        let what = self.what;
        let queues = &self.cx.pool.queues;
        if let Err(e) = queues.wait_event(self.event, &|| format!("the GPU's work before {what}")) {
            // The copy may never land: leak its buffer rather than wait
            // again in `drop`, or free or reuse it under the copy.
            std::mem::forget(self.staging.take());
            return Err(e);
        }
        let staging = self
            .staging
            .take()
            .expect("a started read holds its buffer");
        let bytes = staging.bytes(FAULT_BYTES + self.len * std::mem::size_of::<T>());
        let word = u64::from_ne_bytes(bytes[..FAULT_BYTES].try_into().expect("8 bytes"));
        let data = bytes[FAULT_BYTES..].as_ptr().cast::<T>();
        for (i, out) in dst.iter_mut().enumerate() {
            // SAFETY: the buffer holds `len` elements of `T` (plain data)
            // past the fault word, as copied from the device; read
            // unaligned, the data starting 8 bytes into the allocation.
            *out = unsafe { data.add(i).read_unaligned() };
        }
        self.cx.pool.give(staging);
        match DeviceFault::decode(word) {
            None => Ok(()),
            Some(fault) => {
                kernels.clear_fault(stream)?;
                Err(RuntimeError::InvalidArgument(format!(
                    "{}: kernel `{}` found bad input on the device: {fault}",
                    queues.name,
                    fault.kernels()
                )))
            }
        }
    }
}

/// A host read in flight ([`crate::Backend::start_download`]): staged, or,
/// past [`STAGED_READ_MAX_BYTES`], already done.
pub enum HostRead<T> {
    Staged(StagedRead<T>),
    Done(Vec<T>),
}

impl<T: Copy> HostRead<T> {
    /// Elements the read copies.
    pub fn len(&self) -> usize {
        match self {
            HostRead::Staged(read) => read.len(),
            HostRead::Done(data) => data.len(),
        }
    }

    /// Whether the read copies no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Drop for StagedRead<T> {
    fn drop(&mut self) {
        // Unfinished (an error on the way): the copy may still be in
        // flight, so its buffer goes back only once it has landed; one
        // whose copy cannot be waited for is leaked rather than freed or
        // reused under a copy.
        let queues = &self.cx.pool.queues;
        if let Some(staging) = self.staging.take() {
            if queues
                .wait_event(self.event, &|| "a dropped read's copy".to_string())
                .is_ok()
            {
                self.cx.pool.give(staging);
            } else {
                std::mem::forget(staging);
            }
        }
        queues.give_event(self.event);
    }
}

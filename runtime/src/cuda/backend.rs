//! `impl Backend for CudaBackend`: buffers in GPU arenas ([`CudaBuf`]),
//! kernels as NVRTC-compiled CUDA C ([`KernelSet`]) and cuBLAS GEMMs
//! (`Blas`), each enqueued on the stream of the queue the value is bound
//! to. Nothing here waits for the GPU except a download (a host read, the
//! one synchronisation the `Backend` contract has), and that wait is
//! bounded (`QueueSet::wait_event`).
//!
//! A [`Gpu`] is one device: its context, compiled kernels, arenas and
//! counters, shared by every queue on it. A [`CudaBackend`] is that GPU
//! bound to one queue (a stream with its cuBLAS handle): the rank's host
//! queue (what the driver thread uses between steps) or a lane's.

use super::arena::GpuArena;
use super::blas::Blas;
use super::buffer::{CudaBuf, view_mut_on, view_on};
use super::host_read::{HostRead, ReadContext, STAGED_READ_MAX_BYTES, StagedRead, StagingPool};
use super::launch::{ATTENTION_GEMM_SCRATCH_BYTES, GpuView, KernelSet, SCAN_CHUNKED_SCRATCH_BYTES};
use super::ops::attention::attention_scratch_bytes;
use super::ops::attention_flash::flash_attention_takes;
use super::ops::scan::scan_scratch_bytes;
use super::queue::QueueSet;
use crate::backend::{
    ArenaGrowth, AttentionDims, Backend, DeviceStats, Precision, ScratchCall, ScratchSettings,
    Slice, SliceMut, memory,
};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, Scalar, same_len};
use cudarc::driver::{CudaContext, CudaStream, result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Bytes a large read moves at a time through pinned staging (two such
/// buffers, 16 MiB each with the fault word, stay in the pool after).
const READ_CHUNK_BYTES: usize = 8 << 20;

/// What a GPU has done ([`DeviceStats`]).
#[derive(Debug, Default)]
struct GpuCounters {
    allocations: AtomicU64,
    allocated_bytes: AtomicU64,
    host_reads: AtomicU64,
}

/// One GPU: context, kernels, arenas, counters.
pub struct Gpu {
    pub(crate) queues: Arc<QueueSet>,
    pub(crate) kernels: KernelSet,
    compute: DType,
    arenas: Mutex<Vec<Arc<GpuArena>>>,
    /// Pinned staging and the fault word, for host reads.
    reads: ReadContext,
    counters: GpuCounters,
    /// What [`Backend::alloc_uninit`] leaves in a buffer: nothing is
    /// written, or with `$HYBRIDGEN_POISON_UNINIT` set (the GPU tests set
    /// it) every byte 0xFF, as the CPU backend does, so a kernel that reads
    /// what no kernel wrote fails a test instead of reading a stale zero.
    uninit_fill: Option<u8>,
}

/// Set (to anything but empty or `0`): `Gpu::uninit_fill` poisons.
pub const POISON_UNINIT_ENV: &str = "HYBRIDGEN_POISON_UNINIT";

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.queues.name)
    }
}

impl Gpu {
    /// Opens GPU `ordinal` (counted after `CUDA_VISIBLE_DEVICES`), compiles
    /// and loads the kernels for it. Host waits on it give up after
    /// `timeout`.
    pub fn open(ordinal: usize, precision: Precision, timeout: Duration) -> Result<Arc<Gpu>> {
        let name = format!("cuda:{ordinal}");
        let context = super::catch_cudarc_panic(|| CudaContext::new(ordinal))
            .map_err(|e| super::queue::device_error(&name, "loading the CUDA driver", e))?
            .map_err(|e| super::queue::device_error(&name, "opening the device", e))?;
        // The runtime orders its streams with its own events; cudarc's
        // per-allocation tracking would add waits of its own.
        // SAFETY: no cudarc allocation of this context is in use yet.
        unsafe { context.disable_event_tracking() };
        let kernels = KernelSet::new(&context)?;
        let queues = Arc::new(QueueSet::new(name, context, timeout));
        let reads = ReadContext {
            pool: Arc::new(StagingPool::new(queues.clone())),
            fault_word: kernels.fault_word(),
        };
        Ok(Arc::new(Gpu {
            arenas: Mutex::new(vec![Arc::new(GpuArena::new(
                queues.clone(),
                ArenaGrowth::of_arena(0),
            ))]),
            reads,
            queues,
            kernels,
            compute: precision.compute_dtype(),
            counters: GpuCounters::default(),
            uninit_fill: std::env::var(POISON_UNINIT_ENV)
                .is_ok_and(|v| !v.is_empty() && v != "0")
                .then_some(0xFF),
        }))
    }

    pub fn name(&self) -> &str {
        &self.queues.name
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.queues.context
    }

    /// The GPU's streams and events.
    pub fn queues(&self) -> &Arc<QueueSet> {
        &self.queues
    }

    /// This GPU bound to a new queue (a stream of its own), allocating from
    /// arena 0.
    pub fn backend(self: &Arc<Self>, queue: &str) -> Result<CudaBackend> {
        let (index, stream) = self.queues.new_stream()?;
        let blas = Blas::new(&self.queues, &stream)?;
        let arena = self.arenas.lock().unwrap_or_else(PoisonError::into_inner)[0].clone();
        Ok(CudaBackend {
            gpu: self.clone(),
            queue: Arc::new(Queue {
                index,
                name: Arc::from(queue),
                stream,
                blas,
                side: std::sync::OnceLock::new(),
                ops: AtomicU64::new(0),
            }),
            arena,
            attention_scratch: ATTENTION_GEMM_SCRATCH_BYTES,
            flash_attention: true,
            grouped_gemm: true,
            scan_scratch: SCAN_CHUNKED_SCRATCH_BYTES,
        })
    }
}

/// The streams besides its own that a queue's grouped GEMMs spread their
/// problems over. The MoE experts' GEMMs are many and mostly small (an
/// expert's rows under a balanced routing), and one after another on one
/// stream each leaves most SMs idle and pays a kernel boundary; on three
/// streams they run side by side.
const SIDE_STREAMS: usize = 2;

/// A stream a queue's grouped GEMMs fork onto and join back from within
/// one call, with a cuBLAS handle (and workspace) of its own. It is not
/// registered in the GPU's queue set: no buffer outlives a call's use of
/// it, since the queue's own stream waits for it before the call returns.
#[derive(Debug)]
pub(crate) struct SideStream {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: Blas,
}

/// One stream of a GPU with its cuBLAS handle.
#[derive(Debug)]
pub(crate) struct Queue {
    /// Its index in the GPU's queue set (a bit of a buffer's user mask).
    pub(crate) index: usize,
    pub(crate) name: Arc<str>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: Blas,
    /// Made at the first grouped GEMM with problems to spare.
    side: std::sync::OnceLock<Vec<SideStream>>,
    /// Views handed to work on this queue so far: lanes compare it with
    /// what they last fenced to know whether the host queue has work they
    /// must wait for.
    pub(crate) ops: AtomicU64,
}

/// A GPU bound to one queue. Clones share the queue.
#[derive(Clone, Debug)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    pub(crate) queue: Arc<Queue>,
    arena: Arc<GpuArena>,
    /// The most scratch one attention call of the GEMM path takes (see
    /// [`AttentionGemmPlan`](super::ops::attention::AttentionGemmPlan)).
    pub(crate) attention_scratch: usize,
    /// Whether attention takes the flash kernels where they apply (see
    /// [`flash_attention_takes`]).
    flash_attention: bool,
    /// Whether `grouped_matmul` takes the grouped kernel where it applies
    /// (see [`grouped_gemm_takes`](super::ops::grouped_gemm::grouped_gemm_takes)); on by default, as in training.
    pub(crate) grouped_gemm: bool,
    /// The most scratch one call of the chunked Mamba scan takes (see
    /// [`ScanChunkPlan`](super::ops::scan_chunked::ScanChunkPlan)).
    pub(crate) scan_scratch: usize,
}

impl CudaBackend {
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The stream this value enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.queue.stream
    }

    /// Its index among the GPU's queues.
    pub fn queue_index(&self) -> usize {
        self.queue.index
    }

    /// The same GPU bound to a new queue of its own (what a lane gets).
    pub fn on_new_queue(&self, name: &str) -> Result<CudaBackend> {
        let mut backend = self.gpu.backend(name)?;
        backend.arena = self.arena.clone();
        backend.attention_scratch = self.attention_scratch;
        backend.flash_attention = self.flash_attention;
        backend.grouped_gemm = self.grouped_gemm;
        backend.scan_scratch = self.scan_scratch;
        Ok(backend)
    }

    /// This backend with attention's GEMM path capped at `bytes` of
    /// scratch a call: fewer KV heads batch into one call, and a sequence
    /// whose one KV head needs more takes the tiled kernels (0: always).
    /// Less memory for slower attention; the tests use it to reach every
    /// path with small problems.
    pub fn with_attention_scratch(mut self, bytes: usize) -> CudaBackend {
        self.attention_scratch = bytes;
        self
    }

    /// This backend with attention's flash kernels on (the default) or
    /// off: off, bf16 problems take the GEMM path as other ones do. The
    /// tests use it to reach both paths.
    pub fn with_flash_attention(mut self, on: bool) -> CudaBackend {
        self.flash_attention = on;
        self
    }

    /// This backend with `grouped_matmul`'s bf16 problems on the grouped
    /// kernel (on Hopper; [`crate::backend::ExpertGemm::Grouped`], the
    /// default) or on cuBLAS ([`crate::backend::ExpertGemm::Cublas`]).
    pub fn with_grouped_gemm(mut self, on: bool) -> CudaBackend {
        self.grouped_gemm = on;
        self
    }

    /// Whether attention on these views takes the flash kernels.
    pub(crate) fn flash_attention(&self, dims: AttentionDims, tensors: &[GpuView]) -> bool {
        self.flash_attention
            && self.k().has_flash_attention()
            && flash_attention_takes(dims, tensors)
    }

    /// This backend with the Mamba scan's chunked path capped at
    /// `bytes` of scratch a call: fewer chunks a slice, and a problem whose
    /// one chunk needs more takes the sequential kernels (0: always). The
    /// tests use it to reach both paths.
    pub fn with_scan_scratch(mut self, bytes: usize) -> CudaBackend {
        self.scan_scratch = bytes;
        self
    }

    /// Waits (bounded by the GPU's timeout and watch) until everything
    /// enqueued on this queue has run, then reports any bad index a kernel
    /// found.
    pub fn synchronize(&self) -> Result<()> {
        // A read of nothing: the wait, and the fault word with it.
        StagedRead::<u32>::start(&self.gpu.reads, self.s(), 0, 0, "a wait for the queue")?.finish(
            &self.gpu.kernels,
            &self.queue.stream,
            &mut [],
        )
    }

    /// `out = ((shares[0] + shares[1]) + ...)` in f32 on this queue, the
    /// shares read where they lie (`KernelSet::sum_shares`).
    ///
    /// # Safety
    /// Every address in `shares` is the start of `out`'s length of f32 in
    /// device memory this queue's context may read, left alone by every
    /// other queue until the sum has run.
    pub(crate) unsafe fn sum_shares(&self, shares: &[u64], out: SliceMut<'_, Self>) -> Result<()> {
        // SAFETY: as this function's.
        unsafe { self.k().sum_shares(self.s(), shares, self.m(&out)) }
    }

    /// A view as kernels take it, noted as used by this queue.
    pub(crate) fn v(&self, view: Slice<'_, Self>) -> GpuView {
        self.queue.ops.fetch_add(1, Ordering::Relaxed);
        view_on(view, self.queue.index)
    }

    pub(crate) fn m(&self, view: &SliceMut<'_, Self>) -> GpuView {
        self.queue.ops.fetch_add(1, Ordering::Relaxed);
        view_mut_on(view, self.queue.index)
    }

    pub(crate) fn k(&self) -> &KernelSet {
        &self.gpu.kernels
    }

    pub(crate) fn s(&self) -> &CudaStream {
        &self.queue.stream
    }

    /// A buffer from this backend's arena, its bytes set to `fill` on its
    /// queue (`None`: left as they are).
    fn alloc_filled(&self, len: usize, dtype: DType, fill: Option<u8>) -> Result<CudaBuf> {
        let bytes = len.checked_mul(dtype.bytes()).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("{len} elements of {dtype} overflow usize"))
        })?;
        let (region, grew) = self
            .arena
            .take(bytes, fill, self.queue.index, self.s(), || {
                format!("{len} x {dtype}")
            })?;
        if grew {
            let c = &self.gpu.counters;
            c.allocations.fetch_add(1, Ordering::Relaxed);
            c.allocated_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        Ok(CudaBuf::new(
            self.arena.clone(),
            region,
            len,
            dtype,
            self.queue.index,
        ))
    }

    /// The queue's side streams, made on first use.
    pub(crate) fn side_streams(&self) -> Result<&[SideStream]> {
        if let Some(side) = self.queue.side.get() {
            return Ok(side);
        }
        let queues = &self.gpu.queues;
        queues.bind()?;
        let mut side = Vec::with_capacity(SIDE_STREAMS);
        for _ in 0..SIDE_STREAMS {
            let stream = queues
                .context
                .new_stream()
                .map_err(|e| queues.error("creating a stream for grouped GEMMs", e))?;
            let blas = Blas::new(queues, &stream)?;
            side.push(SideStream { stream, blas });
        }
        // One thread drives a queue at a time, so nothing raced to set it.
        Ok(self.queue.side.get_or_init(|| side))
    }

    /// `len` elements of `dtype` from the arena for one call's scratch: the
    /// view, and the buffer that must live until the call's work is
    /// enqueued (dropping it fences the region on this queue's stream).
    pub(crate) fn scratch(&self, len: usize, dtype: DType) -> Result<(GpuView, CudaBuf)> {
        let buf = self.alloc(len, dtype)?;
        Ok((GpuView::new(buf.device_ptr(), len, dtype), buf))
    }

    /// [`CudaBackend::scratch`] not zeroed, for scratch the call writes
    /// whole before reading it.
    pub(crate) fn scratch_uninit(&self, len: usize, dtype: DType) -> Result<(GpuView, CudaBuf)> {
        let buf = self.alloc_uninit(len, dtype)?;
        Ok((GpuView::new(buf.device_ptr(), len, dtype), buf))
    }

    /// Starts reading `len` elements of `T` at `src` to the host, behind the
    /// queue's work so far: staged through pinned memory (one round trip,
    /// [`super::host_read`]), or, past [`STAGED_READ_MAX_BYTES`], read at
    /// once ([`CudaBackend::read_into`]).
    fn start_read<T: Scalar>(&self, src: GpuView, len: usize) -> Result<HostRead<T>> {
        if len * std::mem::size_of::<T>() <= STAGED_READ_MAX_BYTES {
            let read = StagedRead::start(&self.gpu.reads, self.s(), src.ptr, len, "a host read")?;
            return Ok(HostRead::Staged(read));
        }
        let mut data = vec![T::default(); len];
        self.read_into(src, &mut data)?;
        Ok(HostRead::Done(data))
    }

    /// Reads `dst.len()` elements of `T` at `src` into `dst`, behind the
    /// queue's work so far, through pinned staging [`READ_CHUNK_BYTES`] at
    /// a time, the next chunk's copy in flight while one is copied out. A
    /// pageable copy straight into `dst`, as large reads were made before,
    /// ran the benchmark model's parameter hash (3.6 GB of f32) in 8 s on
    /// an H200 host.
    fn read_into<T: Scalar>(&self, src: GpuView, dst: &mut [T]) -> Result<()> {
        let per = (READ_CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
        let bytes = std::mem::size_of::<T>() as u64;
        let mut in_flight: Option<(StagedRead<T>, &mut [T])> = None;
        for (i, chunk) in dst.chunks_mut(per).enumerate() {
            let at = src.ptr + (i * per) as u64 * bytes;
            let read =
                StagedRead::start(&self.gpu.reads, self.s(), at, chunk.len(), "a host read")?;
            if let Some((done, out)) = in_flight.replace((read, chunk)) {
                done.finish(&self.gpu.kernels, &self.queue.stream, out)?;
            }
        }
        if let Some((done, out)) = in_flight {
            done.finish(&self.gpu.kernels, &self.queue.stream, out)?;
        }
        Ok(())
    }

    fn finish_read<T: Scalar>(&self, read: HostRead<T>, dst: &mut [T]) -> Result<()> {
        match read {
            HostRead::Staged(read) => read.finish(&self.gpu.kernels, &self.queue.stream, dst)?,
            HostRead::Done(data) => {
                same_len("finish_download", data.len(), dst.len())?;
                dst.copy_from_slice(&data);
            }
        }
        self.gpu.counters.host_reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type HostRead<T: Scalar> = HostRead<T>;

    fn name(&self) -> String {
        self.gpu.queues.name.clone()
    }

    fn compute_dtype(&self) -> DType {
        self.gpu.compute
    }

    fn stats(&self) -> DeviceStats {
        let (in_use, peak, reserved) = self
            .gpu
            .arenas
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|a| (a.use_bytes(), a.total_bytes()))
            .fold((0, 0, 0), |(u, p, r), ((a, b), t)| (u + a, p + b, r + t));
        let c = &self.gpu.counters;
        DeviceStats {
            allocations: c.allocations.load(Ordering::Relaxed),
            allocated_bytes: c.allocated_bytes.load(Ordering::Relaxed),
            host_reads: c.host_reads.load(Ordering::Relaxed),
            in_use_bytes: in_use as u64,
            peak_in_use_bytes: peak as u64,
            reserved_bytes: reserved as u64,
        }
    }

    fn kernel_scratch(call: ScratchCall, settings: ScratchSettings) -> u64 {
        match call {
            ScratchCall::Attention(dims) => attention_scratch_bytes(dims, settings),
            ScratchCall::Scan(dims) => scan_scratch_bytes(dims, settings),
        }
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<CudaBuf> {
        self.alloc_filled(len, dtype, Some(0))
    }

    fn alloc_uninit(&self, len: usize, dtype: DType) -> Result<CudaBuf> {
        self.alloc_filled(len, dtype, self.gpu.uninit_fill)
    }

    fn in_arena(&self, arena: usize) -> Self {
        let mut arenas = self
            .gpu
            .arenas
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while arenas.len() <= arena {
            let growth = ArenaGrowth::of_arena(arenas.len());
            arenas.push(Arc::new(GpuArena::new(self.gpu.queues.clone(), growth)));
        }
        CudaBackend {
            arena: arenas[arena].clone(),
            ..self.clone()
        }
    }

    fn upload<T: Scalar>(&self, src: &[T], dst: SliceMut<'_, Self>) -> Result<()> {
        memory::check_upload(T::DTYPE, src.len(), dst.operand())?;
        let dst = self.m(&dst);
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` holds `src.len()` elements of `T`. From pageable
        // memory the driver stages the bytes before returning, so `src` may
        // go away afterwards; the copy is ordered on this queue.
        unsafe { result::memcpy_htod_async(dst.ptr, src, self.s().cu_stream()) }
            .map_err(|e| self.gpu.queues.error("copying to the GPU", e))
    }

    fn download<T: Scalar>(&self, src: Slice<'_, Self>, dst: &mut [T]) -> Result<()> {
        memory::check_download("download", src.operand(), T::DTYPE, Some(dst.len()))?;
        if std::mem::size_of_val(dst) > STAGED_READ_MAX_BYTES {
            // Straight into `dst`, without a copy of the whole read.
            self.read_into(self.v(src), dst)?;
            self.gpu.counters.host_reads.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let read = self.start_read(self.v(src), dst.len())?;
        self.finish_read(read, dst)
    }

    fn start_download<T: Scalar>(&self, src: Slice<'_, Self>) -> Result<HostRead<T>> {
        memory::check_download("start_download", src.operand(), T::DTYPE, None)?;
        self.start_read(self.v(src), src.len())
    }

    fn finish_download<T: Scalar>(&self, read: HostRead<T>, dst: &mut [T]) -> Result<()> {
        same_len("finish_download", read.len(), dst.len())?;
        self.finish_read(read, dst)
    }

    fn copy(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()> {
        memory::check_copy(src.operand(), dst.operand())?;
        let (src, dst) = (self.v(src), self.m(&dst));
        let bytes = src.len * src.dtype.bytes();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both views hold `bytes` bytes of live buffers.
        unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, bytes, self.s().cu_stream()) }
            .map_err(|e| self.gpu.queues.error("copying on the GPU", e))
    }

    fn cast(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()> {
        memory::check_cast(src.operand(), dst.operand())?;
        self.k().cast(self.s(), self.v(src), self.m(&dst))
    }

    fn fill(&self, dst: SliceMut<'_, Self>, value: f32) -> Result<()> {
        memory::check_fill(dst.operand())?;
        self.k().fill(self.s(), self.m(&dst), value)
    }

    fn zero(&self, dst: SliceMut<'_, Self>) -> Result<()> {
        self.k().zero(self.s(), self.m(&dst))
    }
}

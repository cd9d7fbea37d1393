//! The `Backend` trait: device memory and the kernels layers need
//! (docs/architecture.md). Layers, the FSDP engine and the optimizer are
//! written once against it; the CPU backend (deterministic kernels, bf16
//! stored for real) is the reference the CUDA backend (cuBLAS, NVRTC) is
//! checked against.
//!
//! A backend value is bound to one lane: its kernels run on that lane's
//! queue (CUDA: its stream), in the order they are called. Lane work
//! receives its lane's backend ([`crate::lane::Work`]); nothing depends on
//! which thread happens to run it. Every kernel is deterministic: the same
//! inputs give the same bits, whatever else runs.
//!
//! Every kernel states the dtypes it takes (see each method; the rules are
//! [`DTypeRule`]s) and refuses others with an error naming the kernel, the
//! argument and the dtypes. Floating-point kernels compute in f32 whatever
//! their storage (bf16 inputs are widened, bf16 outputs rounded once, at the
//! store), so a bf16 run rounds at the same points on every backend.
//! Converting between dtypes is [`Backend::cast`], never a side effect.
//!
//! The kernels are at the granularity llm.c uses (a matmul with transpose and
//! accumulate flags, a norm forward and its two backwards, ...): small enough
//! that the CUDA backend maps each to one cuBLAS call or one NVRTC kernel,
//! coarse enough that a layer is a dozen calls.
//!
//! The kernels come in families, a module each ([`dense`], [`layout`],
//! [`norm`], [`conv`], [`scan`], [`delta`], [`attention`],
//! [`sparse_attention`], [`lookup`],
//! [`moe`], [`optim`]): its dimension types, the trait of kernels a backend
//! implements ([`NormKernels`], ...), and one check a kernel over
//! device-neutral facts (each view's length and dtype, an
//! [`Operand`](crate::view::Operand)). The [`Backend`] method of a kernel
//! (written in its family's module, which the trait takes in) runs the
//! check, then the backend's method of the same name with `_unchecked`:
//! a check is written once, and both backends run it. Adding a kernel is
//! its method and check in its family's module, its CPU body
//! (`cpu::ops::<family>`) and its CUDA body (`cuda::ops::<family>`), and
//! its conformance case.

use crate::error::{Result, RuntimeError};
pub use crate::view::{DType, DTypeRule, DeviceBuffer, Scalar, View, ViewMut};
use std::ops::Range;

pub mod arena;
pub mod attention;
pub mod conv;
pub mod delta;
pub mod dense;
pub mod layout;
pub mod lookup;
pub mod memory;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod scan;
pub mod sparse_attention;

pub use arena::ArenaGrowth;
pub use attention::{
    AttentionBackend, AttentionDims, AttentionInputs, AttentionKernels, RotaryDims, RotaryPairing,
};
pub use conv::{ConvDims, ConvKernels};
pub use delta::{DeltaDims, DeltaGrads, DeltaInputs, DeltaKernels};
pub use dense::{
    BatchLayout, BatchedMatmulDims, DenseKernels, ExpertGemm, GroupedMatmul, MatmulDims,
    MatmulProblem, SegmentedGroup, SegmentedMatmul,
};
pub use layout::{CopyCols, LayoutKernels, MlaKvDims, QkvDims};
pub use lookup::{IGNORE_TARGET, LookupDims, LookupKernels, LossDims};
pub use moe::{
    AuxLossDims, ExpertBias, ExpertOrder, MoeKernels, ReceivedDims, RouteDims, RouteOutputs,
    RoutedSlots, RouterScores, UnpermuteDims, UnpermuteGrads,
};
pub use norm::{NormDims, NormKernels, Unary};
pub use optim::{AdamMoments, AdamStep, OptimKernels, SgdStep};
pub use scan::{ScanDims, ScanGrads, ScanInputs, ScanKernels};
pub use sparse_attention::{
    IndexerDims, IndexerInputs, IndexerLossDims, LayerNormDims, SparseAttentionKernels,
    SparseMqaDims,
};

/// A read-only view of one of `B`'s buffers.
pub type Slice<'a, B> = View<'a, <B as Backend>::Buf>;
/// A writable view of one of `B`'s buffers.
pub type SliceMut<'a, B> = ViewMut<'a, <B as Backend>::Buf>;

/// The precision a run trains in (Megatron's mixed precision): which dtype
/// parameters and activations are stored in. Master weights, gradient
/// accumulation, gradient shards and optimizer state are f32 either way.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Everything in f32: the checking mode, and the CPU default.
    #[default]
    F32,
    /// Parameters and activations in bf16, computing in f32.
    Bf16,
}

impl Precision {
    /// The storage type of parameters and activations.
    pub const fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
        }
    }
}

/// The precision's name, as the setting takes it: `f32` or `bf16`.
impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// What a device has done so far, over all its lanes: what tests use to
/// prove that the step loop allocates nothing and reads back only what the
/// schedule needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceStats {
    /// Allocations the device had to make (a pool hit is not one).
    pub allocations: u64,
    pub allocated_bytes: u64,
    /// Device-to-host reads.
    pub host_reads: u64,
    /// Bytes of buffers alive now, and the most alive at once so far (both
    /// summed over the device's arenas).
    pub in_use_bytes: u64,
    pub peak_in_use_bytes: u64,
    /// Bytes the device's arenas hold, in use or free: what the device
    /// gave the run (an arena grows during the first step, then holds).
    pub reserved_bytes: u64,
}

impl std::ops::Sub for DeviceStats {
    type Output = DeviceStats;
    /// The counts between two snapshots; the memory figures are the later
    /// snapshot's (a peak or a holding has no difference).
    fn sub(self, earlier: DeviceStats) -> DeviceStats {
        DeviceStats {
            allocations: self.allocations - earlier.allocations,
            allocated_bytes: self.allocated_bytes - earlier.allocated_bytes,
            host_reads: self.host_reads - earlier.host_reads,
            ..self
        }
    }
}

/// A kernel call whose scratch memory is asked about before anything is
/// allocated ([`Backend::kernel_scratch`]): the calls of a model's layers
/// that may take scratch from the arena while they run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScratchCall {
    /// An attention forward or backward (the backward takes the more).
    Attention(AttentionDims),
    /// A Mamba scan forward or backward.
    Scan(ScanDims),
}

/// What a backend's kernel scratch depends on besides the call: the
/// activations' dtype and the backend's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchSettings {
    /// The dtype activations are stored in.
    pub dtype: DType,
    /// Which attention kernels a GPU takes.
    pub attention: AttentionBackend,
    /// The most scratch one attention call of a GPU's GEMM path may take
    /// (bytes; `crate::cuda::launch::ATTENTION_GEMM_SCRATCH_BYTES` by
    /// default).
    pub attention_cap: usize,
    /// The most scratch one call of a GPU's chunked Mamba scan may take
    /// (bytes; `crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES` by
    /// default).
    pub scan_cap: usize,
}

/// Device memory and kernels, bound to one lane.
///
/// The kernels' methods are written in their families' modules and
/// expanded into this trait (`dense::dense_methods!()`, ...), not left on
/// the family traits: callers name only `Backend`, and a supertrait's
/// method is not found on a concrete backend, or on an associated type such
/// as a device's `D::Backend`, unless that supertrait is imported as well.
/// The family traits are what a backend implements: each kernel after its
/// check.
pub trait Backend:
    Clone
    + Send
    + Sync
    + 'static
    + DenseKernels<<Self as Backend>::Buf>
    + LayoutKernels<<Self as Backend>::Buf>
    + NormKernels<<Self as Backend>::Buf>
    + ConvKernels<<Self as Backend>::Buf>
    + ScanKernels<<Self as Backend>::Buf>
    + DeltaKernels<<Self as Backend>::Buf>
    + AttentionKernels<<Self as Backend>::Buf>
    + SparseAttentionKernels<<Self as Backend>::Buf>
    + LookupKernels<<Self as Backend>::Buf>
    + MoeKernels<<Self as Backend>::Buf>
    + OptimKernels<<Self as Backend>::Buf>
{
    /// One device allocation.
    type Buf: DeviceBuffer;
    /// A read to the host in flight ([`Backend::start_download`]).
    type HostRead<T: Scalar>: Send;

    /// A short name (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// What parameters and activations are stored in (bf16 or f32).
    fn compute_dtype(&self) -> DType;

    /// Allocations and host reads so far, over every lane of the device.
    fn stats(&self) -> DeviceStats;

    /// The most scratch (bytes) one `call` of this backend's kernels takes
    /// from the arena while it runs, under `settings`: what the memory plan
    /// counts before anything is allocated. Asked of the backend's type,
    /// since the plan is made before a device is opened; a backend whose
    /// kernels take no scratch (the CPU's) says 0.
    fn kernel_scratch(call: ScratchCall, settings: ScratchSettings) -> u64
    where
        Self: Sized;

    // ---- memory -----------------------------------------------------------

    /// A zero-filled buffer of `len` elements of `dtype`.
    fn alloc(&self, len: usize, dtype: DType) -> Result<Self::Buf>;
    /// A buffer of `len` elements of `dtype` whose contents are
    /// unspecified: for an output the next kernel writes whole (not one it
    /// accumulates into), so the GPU spends no memset on it. The CPU
    /// backend fills it with all bits set (NaN in every float dtype, an
    /// out-of-range u32 index), so reading an element before writing it
    /// shows in its results instead of passing as a zero.
    fn alloc_uninit(&self, len: usize, dtype: DType) -> Result<Self::Buf>;
    /// This backend, allocating from arena `arena` instead. The executor
    /// gives the micro-batches' buffers an arena of their own (arena 1),
    /// shared by every micro-batch in flight, so that one micro-batch's
    /// forward reuses what another's backward freed; each step issues the
    /// same work, so once a step has run, the next ones allocate nothing.
    /// Arena 0 is where everything else allocates (parameters, optimizer
    /// state).
    fn in_arena(&self, arena: usize) -> Self;
    /// Host to device; `T` must be the view's dtype.
    fn upload<T: Scalar>(&self, src: &[T], dst: SliceMut<'_, Self>) -> Result<()>;
    /// Device to host; `T` must be the view's dtype. Waits for the lane's
    /// work so far: a host read is a synchronisation point, which is why the
    /// runtime makes as few as the schedule allows.
    fn download<T: Scalar>(&self, src: Slice<'_, Self>, dst: &mut [T]) -> Result<()>;
    /// Starts a download of `src` behind the lane's work so far and returns
    /// without waiting; [`Backend::finish_download`] (on any lane of the
    /// device) waits for that work alone, not for what was queued after the
    /// start. A host read started early overlaps the work issued in between
    /// (an `E` layer reads its expert counts behind its shared expert's
    /// GEMMs). `T` must be the view's dtype.
    fn start_download<T: Scalar>(&self, src: Slice<'_, Self>) -> Result<Self::HostRead<T>>;
    /// Waits for a started download and writes it into `dst` (the view's
    /// length); reports a bad index a kernel found before the start, as
    /// [`Backend::download`] does.
    fn finish_download<T: Scalar>(&self, read: Self::HostRead<T>, dst: &mut [T]) -> Result<()>;
    /// `dst = src`, both of one dtype.
    fn copy(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()>;
    /// `dst = src` converted (bf16, f32 or f64 either side), rounding to
    /// nearest even when narrowing.
    fn cast(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()>;
    /// Every element of a float view set to `value` (rounded to its dtype).
    fn fill(&self, dst: SliceMut<'_, Self>, value: f32) -> Result<()>;
    /// Every element of a view of any dtype set to zero.
    fn zero(&self, dst: SliceMut<'_, Self>) -> Result<()>;

    // ---- views --------------------------------------------------------------
    // Views are backend-independent handles (`crate::view`); these provided
    // methods spell the common moves the way layers read best.

    fn buf_len(&self, buf: &Self::Buf) -> usize {
        buf.len()
    }
    /// `buf[range]`; an error (not a panic) when the range is out of bounds.
    fn slice<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Result<Slice<'a, Self>> {
        View::of(buf, range)
    }
    fn slice_mut<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Result<SliceMut<'a, Self>> {
        ViewMut::of(buf, range)
    }
    /// Splits a writable view in two at `mid`, as `split_at_mut` does.
    fn split_mut<'a>(
        &self,
        slice: SliceMut<'a, Self>,
        mid: usize,
    ) -> Result<(SliceMut<'a, Self>, SliceMut<'a, Self>)> {
        slice.split_at(mid)
    }
    /// Reborrows a writable view as a read-only one.
    fn as_slice<'b>(&self, slice: &'b SliceMut<'_, Self>) -> Slice<'b, Self> {
        slice.as_view()
    }
    fn slice_len(&self, slice: Slice<'_, Self>) -> usize {
        slice.len()
    }
    /// `slice[range]` of a read-only view; an error when out of bounds.
    fn subslice<'a>(&self, slice: Slice<'a, Self>, range: Range<usize>) -> Result<Slice<'a, Self>> {
        slice.slice(range)
    }
    /// `slice[range]` of a writable view, borrowed from it.
    fn subslice_mut<'b>(
        &self,
        slice: &'b mut SliceMut<'_, Self>,
        range: Range<usize>,
    ) -> Result<SliceMut<'b, Self>> {
        slice.slice_mut(range)
    }
    /// Reborrows a writable view for a shorter lifetime.
    fn reborrow_mut<'b>(&self, slice: &'b mut SliceMut<'_, Self>) -> SliceMut<'b, Self> {
        slice.reborrow()
    }
    /// The whole buffer as a read-only view.
    fn view<'a>(&self, buf: &'a Self::Buf) -> Result<Slice<'a, Self>> {
        Ok(View::whole(buf))
    }
    /// The whole buffer as a writable view.
    fn view_mut<'a>(&self, buf: &'a Self::Buf) -> Result<SliceMut<'a, Self>> {
        Ok(ViewMut::whole(buf))
    }

    // ---- kernels ----------------------------------------------------------------
    // Every kernel validates the lengths of its views against its dimensions
    // and returns `RuntimeError::InvalidArgument` on a mismatch. Views a
    // kernel writes must not be views a kernel reads (the CPU backend checks
    // it). Token ids and targets are `u32` device views, uploaded once per
    // micro-batch; the MoE routing and permutation indices are `u32` device
    // views computed by kernels: the host reads only the per-expert counts
    // the all-to-all needs.

    // ---- kernels: dense algebra and layout moves --------------------------------
    dense::dense_methods!();
    layout::layout_methods!();

    // ---- kernels: normalisation and activations -----------------------------
    norm::norm_methods!();

    // ---- kernels: Mamba ------------------------------------------------------
    conv::conv_methods!();
    scan::scan_methods!();

    // ---- kernels: gated delta net ------------------------------------------
    delta::delta_methods!();

    // ---- kernels: attention ----------------------------------------------------
    attention::attention_methods!();

    // ---- kernels: DeepSeek sparse attention ----------------------------------
    sparse_attention::sparse_attention_methods!();

    // ---- kernels: embedding and loss -------------------------------------------
    lookup::lookup_methods!();

    // ---- kernels: mixture of experts -------------------------------------------
    // Routing state is f32 (logits, scores, weights, the softmax sums) and
    // `u32` (selected experts, counts, permutations) in every precision; only
    // the rows moved between tokens and experts are in the compute dtype.
    moe::moe_methods!();

    // ---- kernels: optimizer -----------------------------------------------------
    optim::optim_methods!();
}

/// The shape of one micro-batch's activations: `[rows, width]` with
/// `rows = batch * seq`, token `t` of sequence `b` at row `b * seq + t`.
/// Causal kernels restart at every sequence boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tokens {
    pub batch: usize,
    pub seq: usize,
}

impl Tokens {
    pub const fn new(batch: usize, seq: usize) -> Self {
        Tokens { batch, seq }
    }

    /// `batch * seq`, or an error when it overflows.
    pub fn rows(self) -> Result<usize> {
        self.batch.checked_mul(self.seq).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "{} sequences of {} tokens overflow usize",
                self.batch, self.seq
            ))
        })
    }
}

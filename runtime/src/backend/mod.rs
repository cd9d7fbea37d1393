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

use crate::error::{Result, RuntimeError};
pub use crate::view::{DType, DTypeRule, DeviceBuffer, Scalar, View, ViewMut};
use std::ops::Range;

pub mod attention;
pub mod conv;
pub mod dense;
pub mod layout;
pub mod lookup;
mod moe;
pub mod norm;
pub mod optim;
pub mod scan;

pub use attention::{
    AttentionBackend, AttentionDims, AttentionInputs, AttentionKernels, RotaryDims, RotaryPairing,
};
pub use conv::{ConvDims, ConvKernels};
pub use dense::{DenseKernels, ExpertGemm, GroupedMatmul, MatmulDims, MatmulProblem};
pub use layout::{CopyCols, LayoutKernels, MlaKvDims, QkvDims};
pub use lookup::{IGNORE_TARGET, LookupDims, LookupKernels, LossDims};
pub use moe::{
    AuxLossDims, ExpertBias, ExpertOrder, ReceivedDims, RouteDims, RouteOutputs, RoutedSlots,
    RouterScores, UnpermuteDims, UnpermuteGrads,
};
pub use norm::{NormDims, NormKernels, Unary};
pub use optim::{AdamMoments, AdamStep, OptimKernels, SgdStep};
pub use scan::{ScanDims, ScanGrads, ScanInputs, ScanKernels};

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

/// The name `--precision` takes: `f32` or `bf16`.
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
}

impl std::ops::Sub for DeviceStats {
    type Output = DeviceStats;
    /// The counts between two snapshots; the memory in use is the later
    /// snapshot's (a peak has no difference).
    fn sub(self, earlier: DeviceStats) -> DeviceStats {
        DeviceStats {
            allocations: self.allocations - earlier.allocations,
            allocated_bytes: self.allocated_bytes - earlier.allocated_bytes,
            host_reads: self.host_reads - earlier.host_reads,
            ..self
        }
    }
}

/// Device memory and kernels, bound to one lane.
pub trait Backend:
    Clone
    + Send
    + Sync
    + 'static
    + NormKernels<<Self as Backend>::Buf>
    + LayoutKernels<<Self as Backend>::Buf>
    + DenseKernels<<Self as Backend>::Buf>
    + ConvKernels<<Self as Backend>::Buf>
    + ScanKernels<<Self as Backend>::Buf>
    + AttentionKernels<<Self as Backend>::Buf>
    + LookupKernels<<Self as Backend>::Buf>
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
    /// gives every micro-batch in flight an arena of its own: a micro-batch's
    /// pieces of work run one after another, so the buffers an arena hands
    /// out and takes back follow the same order in every step, and once a
    /// step has run, the next ones allocate nothing. Arena 0 is where
    /// everything else allocates (parameters, optimizer state).
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

    // ---- kernels: dense algebra ---------------------------------------------
    // Every kernel validates the lengths of its views against its dimensions
    // and returns `RuntimeError::InvalidArgument` on a mismatch. Views a
    // kernel writes must not be views a kernel reads (the CPU backend checks
    // it). Token ids and targets are `u32` device views, uploaded once per
    // micro-batch; the MoE routing and permutation indices are `u32` device
    // views computed by kernels: the host reads only the per-expert counts
    // the all-to-all needs.
    dense::dense_methods!();
    layout::layout_methods!();

    // ---- kernels: normalisation and activations -----------------------------
    norm::norm_methods!();

    // ---- kernels: Mamba ------------------------------------------------------

    conv::conv_methods!();

    scan::scan_methods!();

    // ---- kernels: attention ----------------------------------------------------

    attention::attention_methods!();

    // ---- kernels: embedding and loss -------------------------------------------

    lookup::lookup_methods!();

    // ---- kernels: mixture of experts -------------------------------------------
    // Routing state is f32 (logits, scores, weights, the softmax sums) and
    // `u32` (selected experts, counts, permutations) in every precision; only
    // the rows moved between tokens and experts are in the compute dtype.

    /// Router scoring and top-k selection (layers.md `E` step 2) on f32
    /// `logits` `[rows, E]`: `scores` = softmax or sigmoid of the logits;
    /// `selected[r*k..][..k]` = the k experts with the largest
    /// `scores + expert_bias.bias` (bias for selection only), best first,
    /// ties to the lower index; `weights[r, j]` = `topk_scale` times
    /// `scores[r, sel_j] / sum_j scores[r, sel_j]` (with softmax this equals a
    /// softmax over the k selected logits), or times the raw
    /// `scores[r, sel_0]` with sigmoid and k = 1 (Megatron normalises only
    /// when k > 1); `prob_sum[e] += sum_r p_r[e]`, rows in order, the
    /// load-balancing loss's `T * P_e`, with `p_r` the row's scores normalised
    /// over all experts (the softmax itself; sigmoid scores over their sum),
    /// when `prob_sum` is given (a router without that loss passes none).
    /// With a bias, `expert_bias.unbiased` gets the top-k of the scores
    /// without it (what the load-balancing loss counts).
    /// Dtypes: `logits`, `expert_bias.bias` (`[E]`), `scores`, `weights`,
    /// `prob_sum` f32; `selected`, `expert_bias.unbiased` u32.
    fn moe_route_forward(
        &self,
        logits: Slice<'_, Self>,
        expert_bias: Option<ExpertBias<Slice<'_, Self>, SliceMut<'_, Self>>>,
        out: RouteOutputs<SliceMut<'_, Self>>,
        selected: SliceMut<'_, Self>,
        dims: RouteDims,
    ) -> Result<()>;

    /// Backward of the routing: from `d_weights` `[rows, k]` and the
    /// load-balancing term `aux_grad[e]` (= dLoss/d p_r[e], the same for
    /// every row; see [`Backend::moe_aux_loss_backward`]) writes `d_logits`
    /// `[rows, E]` (overwritten): the gradient through the scaling, the
    /// weight normalisation and the score function, plus `aux_grad` through
    /// the normalised scores `p_r` of [`Backend::moe_route_forward`].
    /// Dtypes: `selected` u32; everything else f32.
    fn moe_route_backward(
        &self,
        saved: RouterScores<Slice<'_, Self>>,
        selected: Slice<'_, Self>,
        d_weights: Slice<'_, Self>,
        aux_grad: Slice<'_, Self>,
        d_logits: SliceMut<'_, Self>,
        dims: RouteDims,
    ) -> Result<()>;

    /// The per-expert histogram of a routing: `counts[e]` = the number of
    /// (token, k-slot) pairs of `selected` `[tokens, k]` that chose expert
    /// `e` (overwritten, `[E]`). An expert index at or past `E` is an error.
    /// Dtypes: u32 both.
    fn moe_expert_counts(
        &self,
        selected: Slice<'_, Self>,
        counts: SliceMut<'_, Self>,
        slots: RoutedSlots,
    ) -> Result<()>;

    /// The dispatch permutation: a stable counting sort of the (token,
    /// k-slot) pairs by expert, then token, then k-slot. With `start[e]` the
    /// exclusive prefix sum of `counts` (from [`Backend::moe_expert_counts`]),
    /// the pair `(t, j)` choosing expert `e` as its `i`-th pair in that order
    /// goes to send row `start[e] + i`: `positions[t*k + j]` = that row and
    /// `sources[row] = t` (the token whose normed input the row carries).
    /// `counts` not matching `selected` is an error. Dtypes: u32 all.
    fn moe_sort_by_expert(
        &self,
        selected: Slice<'_, Self>,
        counts: Slice<'_, Self>,
        out: ExpertOrder<SliceMut<'_, Self>>,
        slots: RoutedSlots,
    ) -> Result<()>;

    /// The regroup after the dispatch all-to-all. Received rows arrive
    /// ordered by (source rank, local expert): `recv_counts[i*L + j]` rows
    /// from rank `i` for local expert `j`. Writes `order[g]` = the received
    /// row at grouped position `g` of the expert-major order (local expert,
    /// then source rank, then arrival), so each expert's rows are one
    /// contiguous range. `order` has `sum(recv_counts)` elements. Dtypes: u32
    /// both.
    fn moe_expert_major_order(
        &self,
        recv_counts: Slice<'_, Self>,
        order: SliceMut<'_, Self>,
        dims: ReceivedDims,
    ) -> Result<()>;

    /// The switch load-balancing loss `coeff * E * sum_e f_e P_e`, with
    /// `f_e = counts[e] / (T k)` and `P_e = prob_sum[e] / T`, summed in
    /// f64 in expert order, added to `loss[0]` (0 when `T = 0` or
    /// `coeff = 0`). Dtypes: `counts` u32, `prob_sum` f32, `loss` f64
    /// (`[1]`, accumulated, so a step can sum every layer and micro-batch on
    /// the device and read it once).
    fn moe_aux_loss_forward(
        &self,
        counts: Slice<'_, Self>,
        prob_sum: Slice<'_, Self>,
        loss: SliceMut<'_, Self>,
        dims: AuxLossDims,
    ) -> Result<()>;

    /// The gradient of `scale` times [`Backend::moe_aux_loss_forward`]'s loss
    /// with respect to each row's normalised scores (the counts held fixed):
    /// `aux_grad[e] = coeff * E * (counts[e] / (T k)) / T * scale`, computed
    /// in f64 and rounded once to f32 (overwritten; zeros when `T = 0`).
    /// Dtypes: `counts` u32, `aux_grad` f32.
    fn moe_aux_loss_backward(
        &self,
        counts: Slice<'_, Self>,
        aux_grad: SliceMut<'_, Self>,
        dims: AuxLossDims,
        scale: f32,
    ) -> Result<()>;

    /// `dst[i] = src[index[i]]` for rows of `width` elements. Dtypes: `src`
    /// and `dst` alike (bf16 or f32), `index` u32.
    fn gather_rows(
        &self,
        src: Slice<'_, Self>,
        index: Slice<'_, Self>,
        dst: SliceMut<'_, Self>,
        width: usize,
    ) -> Result<()>;

    /// `dst[index[i]] = src[i]` for rows of `width` elements; `index` must be
    /// distinct (a permutation), which the CPU backend checks. Dtypes: `src`
    /// and `dst` alike (bf16 or f32), `index` u32.
    fn scatter_rows(
        &self,
        src: Slice<'_, Self>,
        index: Slice<'_, Self>,
        dst: SliceMut<'_, Self>,
        width: usize,
    ) -> Result<()>;

    /// The MoE combine: `out[t] = sum_{j<k} w[t, j] * rows[positions[t*k + j]]`
    /// (overwritten), `j` in order; `weights` `[tokens, k]`, or all ones when
    /// `None` (the backward of the dispatch gather sums a token's k row
    /// gradients this way). Dtypes: `rows` and `out` bf16 or f32, `weights`
    /// f32, `positions` u32.
    fn moe_unpermute(
        &self,
        rows: Slice<'_, Self>,
        weights: Option<Slice<'_, Self>>,
        positions: Slice<'_, Self>,
        out: SliceMut<'_, Self>,
        dims: UnpermuteDims,
    ) -> Result<()>;

    /// The MoE layer's combine into the residual stream:
    /// `x[t] += sum_{j<k} w[t, j] * rows[positions[t*k + j]] + shared[t]`,
    /// `j` in order, then `shared` (the shared expert's output, where there
    /// is one), then `x`, summed in f32 and rounded once (one kernel
    /// instead of a combine into scratch and two adds). Dtypes as
    /// [`Backend::moe_unpermute`]'s, `shared` and `x` bf16 or f32.
    fn moe_combine(
        &self,
        rows: Slice<'_, Self>,
        weights: Slice<'_, Self>,
        positions: Slice<'_, Self>,
        shared: Option<Slice<'_, Self>>,
        x: SliceMut<'_, Self>,
        dims: UnpermuteDims,
    ) -> Result<()>;

    /// Backward of [`Backend::moe_unpermute`] with weights, overwriting
    /// `grads.rows` (`d rows[positions[t*k+j]] = w[t, j] * dout[t]`) and
    /// `grads.weights` (`d w[t, j] = dout[t] . rows[positions[t*k+j]]`).
    /// Dtypes: `dout`, `rows`, `grads.rows` bf16 or f32; `weights` and
    /// `grads.weights` f32; `positions` u32.
    fn moe_unpermute_backward(
        &self,
        dout: Slice<'_, Self>,
        rows: Slice<'_, Self>,
        weights: Slice<'_, Self>,
        positions: Slice<'_, Self>,
        grads: UnpermuteGrads<SliceMut<'_, Self>>,
        dims: UnpermuteDims,
    ) -> Result<()>;

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

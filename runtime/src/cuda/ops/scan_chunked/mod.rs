//! The Mamba-2 scan in chunked form, forward and backward
//! (`kernels/scan_chunked.cu` has the maths): each chunk's recurrence as
//! matrix products through cuBLAS, with kernels for the masks, sums and
//! layouts between them. The products take f32 operands (strict f32) where
//! an output of the call is f32, and bf16 ones (f32 accumulation) where
//! every output is bf16, as mamba_ssm's kernels do: x, dY, B and C are
//! bf16 inputs and stay exact; the other operands round once.
//! The sequential kernels (`scan.rs`) walk a chunk's steps one after
//! another; these spend their time in GEMMs.
//!
//! They need scratch proportional to the chunks they work on at once
//! (about 68 MB a chunk at Nemotron-H's widths), so the backend caps it
//! ([`SCAN_CHUNKED_SCRATCH_BYTES`] by default) and a problem is cut into
//! slices of (sequence, chunk) items. Two passes go over the slices, with
//! what crosses chunks in between: the forward computes each chunk's own
//! state, passes the states along the chunks, then y; the backward
//! computes each chunk's own state gradient, combines the carries over
//! the chunks, then the gradients. A problem whose one chunk does not fit
//! the cap, or whose chunk is longer than [`CHUNKED_MAX_CHUNK`], takes the
//! sequential kernels.

use super::scan::{Tagged, backward_tags, forward_tags};
use crate::backend::{ScanDims, ScanGrads, ScanInputs};
use crate::cuda::blas::{Blas, StridedGemm, StridedMatrix};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, block_per_row, ensure, exactly, grid_for, per_item, product,
};
use crate::cuda::queue::QueueSet;
use crate::error::Result;
use crate::view::DType;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr};
use std::collections::HashMap;

/// The longest chunk the chunked path takes (`CHUNKED_MAX_CHUNK` in
/// `scan_chunked.cu`: the final kernel keeps a chunk's steps in shared
/// memory).
pub const CHUNKED_MAX_CHUNK: usize = 1024;

/// Threads of the per-(item, head) kernels.
const THREADS: u32 = 256;
/// Per-step arrays of a slice (`StepValues` in `scan_chunked.cu`).
const STEP_ARRAYS: usize = 7;
/// Columns of a block of `ssd_chunk_scores_sums` (`SUMS_COLUMNS`), and the
/// most heads a group it takes (`SUMS_MAX_HEADS`).
const SUMS_COLUMNS: usize = 32;
const SUMS_MAX_HEADS: usize = 16;
/// The head widths the tensor-core scores kernels are compiled for
/// (`ssd_chunk_scores_sums_mma_p{P}`, `ssd_chunk_scores_times_mma_p{P}`):
/// Mamba-2's 64 and Nemotron-H 9B's 80.
const MMA_HEAD_WIDTHS: [usize; 2] = [64, 80];
/// The most heads a group `ssd_chunk_scores_sums_mma` is given, its warps,
/// which its launch bound holds it to (`MMA_SUMS_WARPS`), and the dynamic
/// shared memory reserved for it: what 16 heads of 80 take
/// ([`mma_sums_shared_bytes`], the kernel's `mma_sums_shared`).
const MMA_SUMS_HEADS: usize = 16;
const MMA_SUMS_WARPS: usize = 4;
const MMA_SUMS_THREADS: u32 = (MMA_SUMS_WARPS * 32) as u32;
const MMA_SUMS_MAX_SHARED: usize = mma_sums_shared_bytes(MMA_SUMS_HEADS, MMA_HEAD_WIDTHS[1]);
/// A warp's staging rows' pitch in the kernel (`MMA_STAGE_PITCH`).
const MMA_STAGE_PITCH: usize = SUMS_COLUMNS + 8;
// The reservation is the widest group's: 80 is the widest width.
const _: () = assert!(MMA_HEAD_WIDTHS[1] >= MMA_HEAD_WIDTHS[0]);
/// The rows of a block of `ssd_chunk_scores_times_mma` and the longest
/// chunk it stages (`MMA_TIMES_ROWS`, `MMA_TIMES_MAX_CHUNK`).
const MMA_TIMES_ROWS: usize = 64;
const MMA_TIMES_MAX_CHUNK: usize = 256;
/// Its threads: a warp per 16 rows.
const MMA_TIMES_THREADS: u32 = (MMA_TIMES_ROWS / 16 * 32) as u32;

/// How the chunked path cuts a problem: (sequence, chunk) items a
/// slice. Built by [`ScanChunkPlan::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanChunkPlan {
    pub items_per_slice: usize,
}

/// Elements of one item's scratch, by part.
struct ItemLens {
    /// dt, Lam, e^Lam, w, row and column sums, y dots: `[H, Q]` each.
    steps: usize,
    /// x, dY, e^Lam dY, w x, M^T dY and (C S_in^T, then B K^T): `[G, Q, J
    /// P]` each.
    wide: usize,
    /// B, C, dB, dC: `[G, Q, N]` each.
    narrow: usize,
    /// CB and dCB: `[G, Q, Q]` each.
    group_scores: usize,
    /// M and dM: `[H, Q, Q]` each. Where the tensor-core kernels take a
    /// call ([`takes_mma_sums`], [`takes_mma_times`]) dM's slot goes unused
    /// and only the backward writes M (for the M^T dY GEMMs); the plan
    /// still reserves both, since it is made before the operands' dtype
    /// and alignment are known (268 MB of dM at the benchmark's widths).
    head_scores: usize,
    /// The row sums' partials of `ssd_chunk_scores_sums`: `[H, Q, Q /
    /// SUMS_COLUMNS]` (rounded up).
    row_parts: usize,
}

impl ItemLens {
    fn new(dims: ScanDims) -> Option<ItemLens> {
        let q = dims.chunk;
        let m = |a: usize, b: usize| a.checked_mul(b);
        Some(ItemLens {
            steps: m(dims.heads, q)?,
            wide: m(m(dims.heads, dims.head_dim)?, q)?,
            narrow: m(m(dims.groups, dims.state)?, q)?,
            group_scores: m(m(dims.groups, q)?, q)?,
            head_scores: m(m(dims.heads, q)?, q)?,
            row_parts: m(m(dims.heads, q)?, q.div_ceil(SUMS_COLUMNS))?,
        })
    }

    fn total(&self) -> Option<usize> {
        [
            (STEP_ARRAYS, self.steps),
            (6, self.wide),
            (4, self.narrow),
            (2, self.group_scores),
            (2, self.head_scores),
            (1, self.row_parts),
        ]
        .into_iter()
        .try_fold(0usize, |acc, (count, len)| {
            acc.checked_add(count.checked_mul(len)?)
        })
    }
}

impl ScanChunkPlan {
    /// The plan for `dims` under a cap of `scratch_bytes` (the backend's,
    /// by default [`SCAN_CHUNKED_SCRATCH_BYTES`]); `None` sends the problem
    /// to the sequential kernels: an empty problem, a chunk longer than
    /// [`CHUNKED_MAX_CHUNK`], or one whose single chunk does not fit.
    pub fn new(dims: ScanDims, scratch_bytes: usize) -> Option<ScanChunkPlan> {
        let rows = dims.tokens.rows().ok()?;
        if rows == 0
            || dims.head_dim == 0
            || dims.state == 0
            || dims.chunk == 0
            || dims.chunk > CHUNKED_MAX_CHUNK
            || dims.groups == 0
            || !dims.heads.is_multiple_of(dims.groups)
        {
            return None;
        }
        let items = dims.tokens.batch * dims.tokens.seq.div_ceil(dims.chunk);
        let global = ScanChunkPlan::global_len(dims)?.checked_mul(DType::F32.bytes())?;
        let per_item = ItemLens::new(dims)?
            .total()?
            .checked_mul(DType::F32.bytes())?;
        let fit = scratch_bytes.checked_sub(global)? / per_item.max(1);
        (fit > 0).then(|| ScanChunkPlan {
            items_per_slice: fit.min(items),
        })
    }

    /// Elements (f32) of what lives across slices: every chunk's carry
    /// (`[batch, chunks, H, P, N]`), the bf16 operand copies of the states
    /// and the carries (that layout each, in the room of one f32 array),
    /// total decay (`[batch, chunks, H]`) and A_log and D partials
    /// (`[batch, H, chunks, 2]`).
    fn global_len(dims: ScanDims) -> Option<usize> {
        let items = dims
            .tokens
            .batch
            .checked_mul(dims.tokens.seq.div_ceil(dims.chunk.max(1)))?;
        let per_item = dims.heads.checked_mul(
            dims.head_dim
                .checked_mul(dims.state)?
                .checked_mul(2)?
                .checked_add(3)?,
        )?;
        items.checked_mul(per_item)
    }

    /// Elements (f32) of the scratch [`KernelSet::ssd_scan_backward_chunked`]
    /// takes for `dims` with this plan.
    pub fn scratch_len(&self, dims: ScanDims) -> usize {
        let per_item = ItemLens::new(dims).and_then(|l| l.total()).unwrap_or(0);
        ScanChunkPlan::global_len(dims).unwrap_or(0) + self.items_per_slice * per_item
    }

    /// The smallest cap under which [`ScanChunkPlan::new`] gives slices of
    /// `items` (sequence, chunk) items (fewer where the problem has
    /// fewer); `None` past `usize`.
    pub fn cap_for(dims: ScanDims, items: usize) -> Option<usize> {
        let per_item = ItemLens::new(dims)?.total()?.checked_mul(items)?;
        ScanChunkPlan::global_len(dims)?
            .checked_add(per_item)?
            .checked_mul(DType::F32.bytes())
    }

    /// The slices of `items` (sequence, chunk) items, as `[first, end)`.
    fn slices(&self, items: usize) -> impl DoubleEndedIterator<Item = (usize, usize)> + Clone {
        let per_slice = self.items_per_slice.max(1);
        (0..items)
            .step_by(per_slice)
            .map(move |i0| (i0, (i0 + per_slice).min(items)))
    }

    /// The second pass's order over the slices: last first, each with
    /// whether its operands are still prepared in the scratch. The first
    /// pass leaves its last slice's there (nothing between the passes
    /// writes the slice's scratch), so that slice is not prepared again;
    /// each slice's work in the second pass stands alone (its outputs and
    /// per-chunk partials go to its own items), so the order changes no
    /// bits. With two slices (the 9B's widths) that is 3 preparations a
    /// call instead of 4.
    fn second_pass(&self, items: usize) -> impl Iterator<Item = (usize, usize, bool)> {
        self.slices(items)
            .rev()
            .enumerate()
            .map(|(n, (i0, i1))| (i0, i1, n == 0))
    }

    /// Bytes of [`ScanChunkPlan::scratch_len`].
    pub fn scratch_bytes(&self, dims: ScanDims) -> usize {
        self.scratch_len(dims) * DType::F32.bytes()
    }
}

/// `view` from element `offset` on, `len` elements.
fn part(view: GpuView, offset: usize, len: usize) -> GpuView {
    GpuView::new(
        view.ptr + (offset * view.dtype.bytes()) as u64,
        len,
        view.dtype,
    )
}

/// The scratch cut into its parts (see [`ItemLens`] and
/// [`ScanChunkPlan::global_len`]). The GEMMs' operands (`dy_e`, `x_w`,
/// `b`, `c`, `m`, `d_cb` and the `_op` views) are in the call's operand
/// dtype; the rest is f32. A bf16 operand takes the first half of its f32
/// slot, and x's and dY's bf16 copies the second halves of `x_w`'s and
/// `dy_e`'s; in f32 they are x and dY themselves.
struct Parts {
    carry: GpuView,
    /// The states' operand copy (bf16), `None` when the operands are f32
    /// (the states themselves are).
    states_op: Option<GpuView>,
    /// The carries as operands: their bf16 copy, or `carry` itself.
    carry_op: GpuView,
    chunk_decay: GpuView,
    partials: GpuView,
    steps: GpuView,
    /// x and dY in f32, written only where the operands are f32 (they
    /// are then `x_op` and `dy_op`); in bf16 these slots go unused.
    x: GpuView,
    dy: GpuView,
    x_op: GpuView,
    dy_op: GpuView,
    dy_e: GpuView,
    x_w: GpuView,
    t_acc: GpuView,
    u: GpuView,
    b: GpuView,
    c: GpuView,
    d_b: GpuView,
    d_c: GpuView,
    cb: GpuView,
    d_cb: GpuView,
    m: GpuView,
    d_m: GpuView,
    row_parts: GpuView,
    /// Whether the `_quads` kernels take the slices (see [`takes_quads`]).
    quads: bool,
    /// Whether `ssd_chunk_scores_sums` takes the backward's scores and
    /// sums: the `_quads` kernels do, Q is whole blocks of `SUMS_COLUMNS`
    /// and a group has at most `SUMS_MAX_HEADS` heads.
    fused_sums: bool,
    /// Whether `ssd_chunk_scores_sums_mma` takes the backward's dM
    /// products, scores and sums (see [`takes_mma_sums`]).
    mma_sums: bool,
    /// Whether `ssd_chunk_scores_times_mma` takes the forward's M X (see
    /// [`takes_mma_times`]).
    mma_times: bool,
}

impl Parts {
    /// Whether the GEMMs' operands are bf16.
    fn bf16(&self) -> bool {
        self.b.dtype == DType::Bf16
    }

    /// The kernels' tag of the operands' dtype: how the per-step kernels
    /// read x and dY from `x_op` and `dy_op` (in bf16 the `x` and `dy`
    /// slots go unwritten).
    fn operand_tag(&self) -> i32 {
        crate::cuda::launch::dtype_tag(self.x_op.dtype)
    }

    /// Every part, for checks that hold for all of them.
    fn all(&self) -> [GpuView; 23] {
        [
            self.carry,
            self.states_op.unwrap_or(self.carry),
            self.carry_op,
            self.chunk_decay,
            self.partials,
            self.steps,
            self.x,
            self.dy,
            self.x_op,
            self.dy_op,
            self.dy_e,
            self.x_w,
            self.t_acc,
            self.u,
            self.b,
            self.c,
            self.d_b,
            self.d_c,
            self.cb,
            self.d_cb,
            self.m,
            self.d_m,
            self.row_parts,
        ]
    }

    fn new(
        scratch: GpuView,
        dims: ScanDims,
        plan: ScanChunkPlan,
        items: usize,
        operand: DType,
        mma_reserved: bool,
    ) -> Parts {
        let lens = ItemLens::new(dims).expect("the plan checked the sizes");
        let n = plan.items_per_slice;
        let mut offset = 0;
        let mut next = |len: usize| {
            let view = part(scratch, offset, len);
            offset += len;
            view
        };
        // An f32 slot as an operand array: itself, or its first half in bf16.
        let op = |slot: GpuView| GpuView::new(slot.ptr, slot.len, operand);
        // Its second half in bf16 (only taken when the operands are bf16).
        let second = |slot: GpuView| part(op(slot), slot.len, slot.len);
        let heads = items * dims.heads;
        let state_len = heads * dims.head_dim * dims.state;
        let carry = next(state_len);
        let copies = next(state_len);
        let chunk_decay = next(heads);
        let partials = next(2 * heads);
        let steps = next(STEP_ARRAYS * n * lens.steps);
        let x = next(n * lens.wide);
        let dy = next(n * lens.wide);
        let dy_e = next(n * lens.wide);
        let x_w = next(n * lens.wide);
        let bf16 = operand == DType::Bf16;
        let mut parts = Parts {
            carry,
            states_op: bf16.then(|| op(copies)),
            carry_op: if bf16 { second(copies) } else { carry },
            chunk_decay,
            partials,
            steps,
            x,
            dy,
            x_op: if bf16 { second(x_w) } else { x },
            dy_op: if bf16 { second(dy_e) } else { dy },
            dy_e: op(dy_e),
            x_w: op(x_w),
            t_acc: next(n * lens.wide),
            u: next(n * lens.wide),
            b: op(next(n * lens.narrow)),
            c: op(next(n * lens.narrow)),
            d_b: next(n * lens.narrow),
            d_c: next(n * lens.narrow),
            cb: next(n * lens.group_scores),
            d_cb: op(next(n * lens.group_scores)),
            m: op(next(n * lens.head_scores)),
            d_m: next(n * lens.head_scores),
            row_parts: next(n * lens.row_parts),
            quads: false,
            fused_sums: false,
            mma_sums: false,
            mma_times: false,
        };
        parts.quads = takes_quads(dims, plan, items, &parts);
        parts.fused_sums = parts.quads
            && dims.chunk.is_multiple_of(SUMS_COLUMNS)
            && dims.heads / dims.groups <= SUMS_MAX_HEADS;
        parts.mma_sums = takes_mma_sums(dims, &parts, mma_reserved);
        parts.mma_times = takes_mma_times(dims, &parts);
        parts
    }
}

/// A strided batch over a slice's (item, group) pairs of `view`'s dtype:
/// pair `k` at `ptr + k * stride`, rows `ld` apart.
fn pairs(view: GpuView, ld: usize, stride: usize) -> StridedMatrix {
    StridedMatrix {
        ptr: view.ptr,
        dtype: view.dtype,
        ld,
        stride,
    }
}

/// `view` from `offset` elements on.
fn from(view: GpuView, offset: usize) -> GpuView {
    part(view, offset, view.len.saturating_sub(offset))
}

/// The shapes and the math mode the slice's GEMMs share.
#[derive(Clone, Copy)]
struct Shape {
    /// The operands' dtype: bf16 when every output of the call is bf16
    /// (those outputs keep 8 bits, and the products run on the tensor
    /// cores), else f32 (strict f32 products, as the CPU computes them).
    operand: DType,
    q: usize,
    p: usize,
    n: usize,
    /// Heads a group (J).
    j: usize,
    /// A group's x columns (J P).
    jp: usize,
    /// One head's state (P N).
    pn: usize,
}

impl Shape {
    /// Head j's columns of a `[item, G, Q, J P]` array, a matrix per
    /// (item, group) pair.
    fn head_columns(&self, view: GpuView, j: usize) -> StridedMatrix {
        pairs(from(view, j * self.p), self.jp, self.q * self.jp)
    }

    /// The states (or carries) of the group of each of a slice's (item,
    /// group) pairs from item `first`, out of `[batch * chunks, H, P, N]`:
    /// its J heads' `[P, N]` blocks are contiguous, one `[J P, N]` matrix.
    fn group_states(&self, view: GpuView, first: usize, heads: usize) -> StridedMatrix {
        pairs(
            from(view, first * heads * self.pn),
            self.n,
            self.j * self.pn,
        )
    }

    /// `out_j = lhs S_j^T` for every head j of a slice's (item, group)
    /// pairs, as one product a pair: `out = lhs [S_0; ...; S_{J-1}]^T`,
    /// since the heads' columns of `out` and their states lie side by
    /// side. `lhs` `[Q, N]` a pair (C or B), `states` `[batch * chunks,
    /// H, P, N]` from item `first` (the chunk states or the carries),
    /// `out` `[item, G, Q, J P]`.
    fn times_head_states(
        &self,
        gemm: &dyn Fn(StridedGemm) -> Result<()>,
        (first, count, heads): (usize, usize, usize),
        lhs: StridedMatrix,
        states: GpuView,
        out: GpuView,
    ) -> Result<()> {
        gemm(batched(
            count * (heads / self.j),
            (self.q, self.jp, self.n),
            (lhs, false),
            (self.group_states(states, first, heads), true),
            self.head_columns(out, 0),
            0.0,
        ))
    }

    /// `out_j = op(M_j) rhs_j` for every head j of `pair_count` (item,
    /// group) pairs: M the heads' `[Q, Q]` scores (`[item, H, Q, Q]`),
    /// transposed when `transpose`; `rhs` and `out` `[item, G, Q, J P]`.
    fn head_scores_times(
        &self,
        gemm: &dyn Fn(StridedGemm) -> Result<()>,
        pair_count: usize,
        (scores, transpose): (GpuView, bool),
        rhs: GpuView,
        out: GpuView,
    ) -> Result<()> {
        let qq = self.q * self.q;
        for j in 0..self.j {
            gemm(batched(
                pair_count,
                (self.q, self.p, self.q),
                (pairs(from(scores, j * qq), self.q, self.j * qq), transpose),
                (self.head_columns(rhs, j), false),
                self.head_columns(out, j),
                0.0,
            ))?;
        }
        Ok(())
    }

    fn new(dims: ScanDims, outputs: &[GpuView]) -> Shape {
        let j = dims.heads / dims.groups;
        Shape {
            operand: if outputs.iter().all(|v| v.dtype == DType::Bf16) {
                DType::Bf16
            } else {
                DType::F32
            },
            q: dims.chunk,
            p: dims.head_dim,
            n: dims.state,
            j,
            jp: j * dims.head_dim,
            pn: dims.head_dim * dims.state,
        }
    }
}

/// `C = op(A) op(B) (+ C when beta is 1)` over `batch` (item, group) pairs,
/// `op(A)` `[m, k]`.
fn batched(
    batch: usize,
    (m, n, k): (usize, usize, usize),
    (a, a_trans): (StridedMatrix, bool),
    (b, b_trans): (StridedMatrix, bool),
    c: StridedMatrix,
    beta: f32,
) -> StridedGemm {
    StridedGemm {
        m,
        n,
        k,
        a,
        a_trans,
        b,
        b_trans,
        c,
        alpha: 1.0,
        beta,
        batch,
    }
}

/// `scratch` is f32 and holds what `plan` needs.
fn check_scratch(
    kernel: &str,
    plan: ScanChunkPlan,
    scratch: GpuView,
    dims: ScanDims,
) -> Result<()> {
    exactly(kernel, "scratch", &scratch, DType::F32)?;
    ensure(plan.items_per_slice > 0, || {
        format!("{kernel}: a chunked plan of no items")
    })?;
    let need = plan.scratch_len(dims);
    ensure(scratch.len >= need, || {
        format!(
            "{kernel}: `scratch` has {} elements, but this plan needs at least {need} \
             (ScanChunkPlan::scratch_len)",
            scratch.len
        )
    })
}

impl KernelSet {
    /// `Backend::ssd_scan_backward` in chunked form, with `scratch` an f32
    /// view of at least [`ScanChunkPlan::scratch_len`] elements that
    /// nothing else uses until it returns. Same contract as
    /// [`KernelSet::ssd_scan_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ssd_scan_backward_chunked(
        &self,
        stream: &CudaStream,
        blas: &Blas,
        queues: &QueueSet,
        inputs: ScanInputs<GpuView>,
        states: GpuView,
        dy: GpuView,
        grads: ScanGrads<GpuView>,
        scratch: GpuView,
        dims: ScanDims,
        plan: ScanChunkPlan,
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let checked = backward_tags(dims, &inputs, &dy, &grads);
        let [dyt, dxt, ddtt] = checked.others;
        let ScanGrads {
            xbc: d_xbc,
            dt: d_dt,
            a_log: d_a_log,
            d: d_d,
        } = grads;
        let call = Call::new(
            k,
            (blas, queues, self.scan_mma_sums),
            (inputs, Some(dy), states),
            Tags::new(checked.inputs, [dyt, dxt, ddtt]),
            (scratch, dims, plan, checked.chunks),
            &[d_xbc, d_dt],
        )?;
        let (parts, shape, slices, operands, tags) = (
            &call.parts,
            call.shape,
            call.plan.slices(call.items),
            &call.operands,
            &call.tags,
        );
        let gemm = |g: StridedGemm| call.gemm(g);
        let chunks = checked.chunks;

        // First pass: each chunk's own state gradient L_c = dY^T diag(e^Lam)
        // C (into the carries), then the carries K over all chunks.
        for (i0, i1) in slices.clone() {
            self.chunk_prepare(stream, operands, tags, parts, dims, i0, i1 - i0)?;
            // The group's heads at once: their columns of e^Lam dY and
            // their carries lie side by side (M = J P).
            gemm(batched(
                (i1 - i0) * dims.groups,
                (shape.jp, shape.n, shape.q),
                (shape.head_columns(parts.dy_e, 0), true),
                (pairs(parts.c, shape.n, shape.q * shape.n), false),
                shape.group_states(parts.carry, i0, dims.heads),
                0.0,
            ))?;
        }
        // The carries' bf16 copy, written as they are combined (none when
        // the operands are f32).
        let carry_copy = if parts.bf16() { parts.carry_op.ptr } else { 0 };
        self.ssd_scan_carry_combine(
            stream,
            (parts.carry.ptr, carry_copy),
            parts.chunk_decay.ptr,
            dims,
            chunks,
        )?;
        // The forward's states as operands: their bf16 copy, or themselves.
        let states_op = match parts.states_op {
            Some(copy) => {
                let copy = part(copy, 0, operands.states.len);
                self.cast(stream, operands.states, copy)?;
                copy
            }
            None => operands.states,
        };

        // Second pass: the gradients, slice by slice.
        for (i0, i1, prepared) in call.plan.second_pass(call.items) {
            if !prepared {
                self.chunk_prepare(stream, operands, tags, parts, dims, i0, i1 - i0)?;
            }
            self.chunk_gradients(
                stream,
                &gemm,
                (operands, states_op),
                tags,
                parts,
                (d_xbc, d_dt),
                dims,
                shape,
                (i0, i1 - i0),
            )?;
        }
        self.ssd_scan_backward_params(stream, parts.partials.ptr, dims, chunks, d_a_log, d_d)
    }

    /// `Backend::ssd_scan_forward` in chunked form (overwrites `y` and
    /// `states`), with `scratch` as for
    /// [`KernelSet::ssd_scan_backward_chunked`] (the forward uses part of
    /// it). Same contract as [`KernelSet::ssd_scan_forward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ssd_scan_forward_chunked(
        &self,
        stream: &CudaStream,
        blas: &Blas,
        queues: &QueueSet,
        inputs: ScanInputs<GpuView>,
        y: GpuView,
        states: GpuView,
        scratch: GpuView,
        dims: ScanDims,
        plan: ScanChunkPlan,
    ) -> Result<()> {
        let k = "ssd_scan_forward";
        let checked: Tagged<1> = forward_tags(dims, &inputs, &y);
        let [yt] = checked.others;
        let chunks = checked.chunks;
        let call = Call::new(
            k,
            (blas, queues, self.scan_mma_sums),
            (inputs, None, states),
            Tags::new(checked.inputs, [0, yt, 0]),
            (scratch, dims, plan, chunks),
            &[y],
        )?;
        let (parts, s, slices, o, tags) = (
            &call.parts,
            call.shape,
            call.plan.slices(call.items),
            &call.operands,
            &call.tags,
        );
        let gemm = |g: StridedGemm| call.gemm(g);
        let (qq, qn) = (s.q * s.q, s.q * s.n);
        let wide = |view: GpuView, j: usize| s.head_columns(view, j);

        // First pass: each chunk's own X^T diag(w) B into its state slot,
        // then the states passed along the chunks.
        for (i0, i1) in slices.clone() {
            self.chunk_prepare(stream, o, tags, parts, dims, i0, i1 - i0)?;
            // The group's heads at once (M = J P), as in the backward.
            gemm(batched(
                (i1 - i0) * dims.groups,
                (s.jp, s.n, s.q),
                (wide(parts.x_w, 0), true),
                (pairs(parts.b, s.n, qn), false),
                s.group_states(states, i0, dims.heads),
                0.0,
            ))?;
        }
        let ks = "ssd_scan_state_combine";
        let [batch_u, heads_u, pn_u, chunks_u] =
            [dims.tokens.batch, dims.heads, s.pn, chunks].map(|v| v as u64);
        // The states as operands: their bf16 copy (written as they are
        // passed along), or themselves.
        let states_op = parts.states_op.map(|copy| part(copy, 0, states.len));
        let copy = states_op.map_or(0, |v| v.ptr);
        let states_op = states_op.unwrap_or(states);
        let quads = super::scan::combine_quads(pn_u, states.ptr, copy);
        let mut b = KernelArgs::new(stream, self.function(ks)?);
        b.arg(&states.ptr)
            .arg(&copy)
            .arg(&parts.chunk_decay.ptr)
            .arg(&batch_u);
        b.arg(&heads_u).arg(&pn_u).arg(&chunks_u).arg(&quads);
        let elements = product(k, &[dims.tokens.batch, dims.heads, s.pn])?;
        self.go(
            ks,
            &mut b,
            grid_for(elements / if quads == 1 { 4 } else { 1 }),
        )?;

        // Second pass: y, slice by slice.
        for (i0, i1, prepared) in call.plan.second_pass(call.items) {
            let count = i1 - i0;
            if !prepared {
                self.chunk_prepare(stream, o, tags, parts, dims, i0, count)?;
            }
            let pair_count = count * dims.groups;
            let c_mat = pairs(parts.c, s.n, qn);
            gemm(batched(
                pair_count,
                (s.q, s.q, s.n),
                (c_mat, false),
                (pairs(parts.b, s.n, qn), true),
                pairs(parts.cb, s.q, qq),
                0.0,
            ))?;
            if parts.mma_times {
                // M made and multiplied where it is needed, never stored: a
                // block per (item, head, block of rows).
                let blocks = product(k, &[count, dims.heads, dims.chunk / MMA_TIMES_ROWS])?;
                let pointers = [parts.x_op, parts.cb, parts.t_acc, parts.steps].map(|v| v.ptr);
                self.scores_mma(
                    stream,
                    MmaScores::Times,
                    &pointers,
                    (dims, count),
                    (blocks, MMA_TIMES_THREADS),
                )?;
            } else {
                self.chunk_scores(stream, parts, None, dims, count)?;
                s.head_scores_times(&gemm, pair_count, (parts.m, false), parts.x_op, parts.t_acc)?;
            }
            s.times_head_states(&gemm, (i0, count, dims.heads), c_mat, states_op, parts.u)?;
            let ko = if parts.quads {
                "ssd_chunk_output_quads"
            } else {
                "ssd_chunk_output"
            };
            let slice = SliceArgs::new(dims, i0, count);
            let narrow = slice.narrow();
            let mut b = KernelArgs::new(stream, self.function(ko)?);
            let op_tag = parts.operand_tag();
            b.arg(&parts.x_op.ptr)
                .arg(&op_tag)
                .arg(&parts.t_acc.ptr)
                .arg(&parts.u.ptr)
                .arg(&parts.steps.ptr)
                .arg(&o.d.ptr)
                .arg(&tags.skip)
                .arg(&y.ptr)
                .arg(&yt);
            let elements = product(k, &[pair_count, s.q, s.jp])?;
            if parts.quads {
                narrow.push(&mut b);
                self.go(ko, &mut b, grid_for(elements / 4))?;
            } else {
                slice.push(&mut b);
                self.go(ko, &mut b, grid_for(elements))?;
            }
        }
        Ok(())
    }

    /// A slice's per-step values (`ssd_chunk_factors`) and packed operands
    /// (`ssd_chunk_pack`).
    #[allow(clippy::too_many_arguments)]
    fn chunk_prepare(
        &self,
        stream: &CudaStream,
        o: &Operands,
        tags: &Tags,
        parts: &Parts,
        dims: ScanDims,
        first: usize,
        count: usize,
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let slice = SliceArgs::new(dims, first, count);
        let [first_u, count_u, seq, heads, _, _, _, chunk] = slice.0;
        let kf = "ssd_chunk_factors";
        let mut b = KernelArgs::new(stream, self.function(kf)?);
        push_step_inputs(&mut b, o, tags);
        b.arg(&parts.steps.ptr)
            .arg(&parts.chunk_decay.ptr)
            .arg(&first_u)
            .arg(&count_u)
            .arg(&seq)
            .arg(&heads)
            .arg(&chunk);
        self.go(kf, &mut b, per_item(count * dims.heads, THREADS)?)?;

        let dy_ptr = o.dy.map_or(0, |dy| dy.ptr);
        let kp = match (parts.quads, parts.bf16()) {
            (true, true) => "ssd_chunk_pack_quads_bf16",
            (true, false) => "ssd_chunk_pack_quads",
            (false, true) => "ssd_chunk_pack_bf16",
            (false, false) => "ssd_chunk_pack",
        };
        // x and dY in f32 where the operands are f32, else their bf16
        // operand copies (the per-step kernels read `x_op` and `dy_op`
        // either way).
        let ((x_f32, dy_f32), (x_copy, dy_copy)) = if parts.bf16() {
            ((0, 0), (parts.x_op.ptr, parts.dy_op.ptr))
        } else {
            ((parts.x.ptr, parts.dy.ptr), (0, 0))
        };
        let mut b = KernelArgs::new(stream, self.function(kp)?);
        b.arg(&o.xbc.ptr)
            .arg(&tags.xbc)
            .arg(&dy_ptr)
            .arg(&tags.dy)
            .arg(&parts.steps.ptr);
        b.arg(&x_f32)
            .arg(&dy_f32)
            .arg(&parts.dy_e.ptr)
            .arg(&parts.x_w.ptr)
            .arg(&parts.b.ptr)
            .arg(&parts.c.ptr)
            .arg(&x_copy)
            .arg(&dy_copy);
        let rows = product(k, &[count, dims.groups, dims.chunk])?;
        if parts.quads {
            let narrow = slice.narrow();
            narrow.push(&mut b);
            let quads = rows * (dims.heads / dims.groups * dims.head_dim + dims.state) / 4;
            return self.go(kp, &mut b, grid_for(quads));
        }
        slice.push(&mut b);
        self.go(kp, &mut b, block_per_row(rows))
    }

    /// `ssd_chunk_scores` over a slice of `count` items: M from CB, and in
    /// the backward (`gradients`: dM, dCB) the products and dCB.
    fn chunk_scores(
        &self,
        stream: &CudaStream,
        parts: &Parts,
        gradients: Option<(GpuView, GpuView)>,
        dims: ScanDims,
        count: usize,
    ) -> Result<()> {
        let k = "ssd_chunk_scores";
        let (d_m, d_cb) = gradients.map_or((0, 0), |(d_m, d_cb)| (d_m.ptr, d_cb.ptr));
        let rows = product(k, &[count, dims.groups, dims.chunk])?;
        let sizes = [count, dims.heads, dims.groups, dims.chunk];
        let (wide, narrow) = (sizes.map(|v| v as u64), sizes.map(|v| v as u32));
        if gradients.is_some() && parts.fused_sums {
            // With the sums (`ssd_chunk_scores_sums`): a block per (item,
            // group, block of columns).
            let kernel = if parts.bf16() {
                "ssd_chunk_scores_sums_bf16"
            } else {
                "ssd_chunk_scores_sums"
            };
            let mut b = KernelArgs::new(stream, self.function(kernel)?);
            b.arg(&parts.cb.ptr)
                .arg(&d_m)
                .arg(&parts.m.ptr)
                .arg(&d_cb)
                .arg(&parts.row_parts.ptr)
                .arg(&parts.steps.ptr);
            for v in &narrow {
                b.arg(v);
            }
            let blocks = product(k, &[count, dims.groups, dims.chunk / SUMS_COLUMNS])?;
            return self.go(kernel, &mut b, per_item(blocks, THREADS)?);
        }
        let kernel = match (parts.quads, parts.bf16()) {
            (true, true) => "ssd_chunk_scores_quads_bf16",
            (true, false) => "ssd_chunk_scores_quads",
            (false, true) => "ssd_chunk_scores_bf16",
            (false, false) => k,
        };
        let mut b = KernelArgs::new(stream, self.function(kernel)?);
        b.arg(&parts.cb.ptr)
            .arg(&d_m)
            .arg(&parts.m.ptr)
            .arg(&d_cb)
            .arg(&parts.steps.ptr);
        if parts.quads {
            for v in &narrow {
                b.arg(v);
            }
            return self.go(k, &mut b, grid_for(rows * dims.chunk / 4));
        }
        for v in &wide {
            b.arg(v);
        }
        self.go(k, &mut b, block_per_row(rows))
    }

    /// One of the tensor-core scores kernels (`which`, for the call's head
    /// width) over a slice of `count` items: its `pointers`, then the
    /// slice's items, heads, groups and chunk in 32 bits (the `_quads`
    /// kernels' indices), on `blocks` of `threads` (and, for the sums, the
    /// group's dynamic shared memory).
    fn scores_mma(
        &self,
        stream: &CudaStream,
        which: MmaScores,
        pointers: &[u64],
        (dims, count): (ScanDims, usize),
        (blocks, threads): (usize, u32),
    ) -> Result<()> {
        let k = which.kernel(dims.head_dim).ok_or_else(|| {
            crate::error::RuntimeError::Unsupported(format!(
                "ssd_chunk_scores {which:?} on tensor cores: no kernel for heads of {} channels \
                 (kernels exist for {MMA_HEAD_WIDTHS:?}; `takes_mma_sums` and `takes_mma_times` \
                 should have sent this call to the GEMMs: a launcher bug to report)",
                dims.head_dim
            ))
        })?;
        let sizes = [count, dims.heads, dims.groups, dims.chunk].map(|v| v as u32);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        for p in pointers {
            b.arg(p);
        }
        for v in &sizes {
            b.arg(v);
        }
        let mut config = per_item(blocks, threads)?;
        if which == MmaScores::Sums {
            config.shared_mem_bytes =
                mma_sums_shared_bytes(dims.heads / dims.groups, dims.head_dim) as u32;
        }
        self.go(k, &mut b, config)
    }

    /// The second pass over one slice of `count` items from `first`.
    #[allow(clippy::too_many_arguments)]
    fn chunk_gradients(
        &self,
        stream: &CudaStream,
        gemm: &dyn Fn(StridedGemm) -> Result<()>,
        (o, states_op): (&Operands, GpuView),
        tags: &Tags,
        parts: &Parts,
        (d_xbc, d_dt): (GpuView, GpuView),
        dims: ScanDims,
        s: Shape,
        (first, count): (usize, usize),
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let pair_count = count * dims.groups;
        let (qq, qn) = (s.q * s.q, s.q * s.n);
        let wide = |view: GpuView, j: usize| s.head_columns(view, j);
        let run = |m, n, kk, a, a_trans, b, b_trans, c, beta| {
            gemm(batched(
                pair_count,
                (m, n, kk),
                (a, a_trans),
                (b, b_trans),
                c,
                beta,
            ))
        };
        // CB = C B^T per (item, group).
        let b_mat = pairs(parts.b, s.n, qn);
        let c_mat = pairs(parts.c, s.n, qn);
        let cb = pairs(parts.cb, s.q, qq);
        run(s.q, s.q, s.n, c_mat, false, b_mat, true, cb, 0.0)?;
        if parts.mma_sums {
            // dM made and used where it is needed, never stored: a block
            // per (item, group, block of columns).
            let blocks = product(k, &[count, dims.groups, dims.chunk / SUMS_COLUMNS])?;
            let pointers = [
                parts.dy_op,
                parts.x_op,
                parts.cb,
                parts.m,
                parts.d_cb,
                parts.row_parts,
                parts.steps,
            ]
            .map(|v| v.ptr);
            self.scores_mma(
                stream,
                MmaScores::Sums,
                &pointers,
                (dims, count),
                (blocks, MMA_SUMS_THREADS),
            )?;
        } else {
            // dM = dY X^T per head.
            for j in 0..s.j {
                let d_m = pairs(from(parts.d_m, j * qq), s.q, s.j * qq);
                run(
                    s.q,
                    s.q,
                    s.p,
                    wide(parts.dy_op, j),
                    false,
                    wide(parts.x_op, j),
                    true,
                    d_m,
                    0.0,
                )?;
            }
            self.chunk_scores(stream, parts, Some((parts.d_m, parts.d_cb)), dims, count)?;
        }
        let [count_u, heads, head_dim, groups, chunk] =
            [count, dims.heads, dims.head_dim, dims.groups, dims.chunk].map(|v| v as u64);
        // M^T dY, and C S_in^T (for the readout term of dLam) in u.
        s.head_scores_times(gemm, pair_count, (parts.m, true), parts.dy_op, parts.t_acc)?;
        let heads_of = (first, count, dims.heads);
        s.times_head_states(gemm, heads_of, c_mat, states_op, parts.u)?;
        let kr = "ssd_chunk_sums";
        // The row sums' partials when `chunk_scores` took the sums.
        let (row_parts, column_blocks) = if parts.fused_sums {
            (parts.row_parts.ptr, (dims.chunk / SUMS_COLUMNS) as u64)
        } else {
            (0, 0)
        };
        let op_tag = parts.operand_tag();
        let mut b = KernelArgs::new(stream, self.function(kr)?);
        b.arg(&parts.d_m.ptr)
            .arg(&row_parts)
            .arg(&column_blocks)
            .arg(&parts.u.ptr)
            .arg(&parts.dy_op.ptr)
            .arg(&op_tag)
            .arg(&parts.steps.ptr);
        b.arg(&count_u)
            .arg(&heads)
            .arg(&head_dim)
            .arg(&groups)
            .arg(&chunk);
        self.go(
            kr,
            &mut b,
            per_item(product(k, &[count, dims.heads])?, THREADS)?,
        )?;
        // U = B K^T per head (over C S_in^T, now summed).
        s.times_head_states(gemm, heads_of, b_mat, parts.carry_op, parts.u)?;
        // dB = (w X) K + dCB^T C and dC = (e^Lam dY) S_in + dCB B, the
        // group's heads side by side (K = J P).
        let group_rows = |view: GpuView| s.group_states(view, first, dims.heads);
        let d_cb = pairs(parts.d_cb, s.q, qq);
        let d_b = pairs(parts.d_b, s.n, qn);
        let d_c = pairs(parts.d_c, s.n, qn);
        run(
            s.q,
            s.n,
            s.jp,
            wide(parts.x_w, 0),
            false,
            group_rows(parts.carry_op),
            false,
            d_b,
            0.0,
        )?;
        run(s.q, s.n, s.q, d_cb, true, c_mat, false, d_b, 1.0)?;
        run(
            s.q,
            s.n,
            s.jp,
            wide(parts.dy_e, 0),
            false,
            group_rows(states_op),
            false,
            d_c,
            0.0,
        )?;
        run(s.q, s.n, s.q, d_cb, false, b_mat, false, d_c, 1.0)?;

        let slice = SliceArgs::new(dims, first, count);
        let kf = "ssd_chunk_final";
        let mut b = KernelArgs::new(stream, self.function(kf)?);
        push_step_inputs(&mut b, o, tags);
        b.arg(&o.d.ptr).arg(&tags.skip);
        b.arg(&o.states.ptr)
            .arg(&parts.carry.ptr)
            .arg(&parts.x_op.ptr)
            .arg(&parts.dy_op.ptr)
            .arg(&op_tag)
            .arg(&parts.t_acc.ptr)
            .arg(&parts.u.ptr)
            .arg(&parts.steps.ptr);
        b.arg(&d_xbc.ptr)
            .arg(&tags.dxbc)
            .arg(&d_dt.ptr)
            .arg(&tags.ddt)
            .arg(&parts.partials.ptr);
        slice.push(&mut b);
        self.go(
            kf,
            &mut b,
            per_item(product(k, &[count, dims.heads])?, THREADS)?,
        )?;

        let elements = product(k, &[pair_count, s.q, s.n])?;
        let quads = parts.quads && d_xbc.ptr.is_multiple_of(16);
        let ku = if quads {
            "ssd_chunk_unpack_quads"
        } else {
            "ssd_chunk_unpack"
        };
        let mut b = KernelArgs::new(stream, self.function(ku)?);
        b.arg(&parts.d_b.ptr)
            .arg(&parts.d_c.ptr)
            .arg(&d_xbc.ptr)
            .arg(&tags.dxbc);
        if quads {
            let narrow = slice.narrow();
            narrow.push(&mut b);
            return self.go(ku, &mut b, grid_for(elements / 4));
        }
        slice.push(&mut b);
        self.go(ku, &mut b, grid_for(elements))
    }
}

/// `first_item, items, seq, heads, head_dim, groups, state, chunk`: the
/// tail of the slice kernels' arguments, in 64 bits (or, for the `_quads`
/// kernels, 32).
struct SliceArgs<T = u64>([T; 8]);

impl SliceArgs {
    fn new(dims: ScanDims, first: usize, count: usize) -> SliceArgs {
        SliceArgs(
            [
                first,
                count,
                dims.tokens.seq,
                dims.heads,
                dims.head_dim,
                dims.groups,
                dims.state,
                dims.chunk,
            ]
            .map(|v| v as u64),
        )
    }

    /// The same as the `_quads` kernels take them (32-bit: `takes_quads`
    /// checked that they fit).
    fn narrow(&self) -> SliceArgs<u32> {
        SliceArgs(self.0.map(|v| v as u32))
    }
}

impl<T: DeviceRepr> SliceArgs<T> {
    fn push<'a>(&'a self, b: &mut KernelArgs<'a>) {
        for v in &self.0 {
            b.arg(v);
        }
    }
}

/// The inputs' views.
struct Operands {
    xbc: GpuView,
    dt: GpuView,
    dt_bias: GpuView,
    a_log: GpuView,
    d: GpuView,
    /// None in the forward.
    dy: Option<GpuView>,
    states: GpuView,
}

/// Pushes what the per-step kernels read first: dt, dt_bias and A_log,
/// each with its dtype tag.
fn push_step_inputs<'a>(b: &mut KernelArgs<'a>, o: &'a Operands, tags: &'a Tags) {
    b.arg(&o.dt.ptr)
        .arg(&tags.dt)
        .arg(&o.dt_bias.ptr)
        .arg(&tags.bias)
        .arg(&o.a_log.ptr)
        .arg(&tags.a_log);
}

/// The dtype tags of the inputs and outputs.
#[derive(Clone, Copy)]
struct Tags {
    xbc: i32,
    dt: i32,
    bias: i32,
    a_log: i32,
    skip: i32,
    dy: i32,
    /// `dxbc` in the backward, `y` in the forward.
    dxbc: i32,
    ddt: i32,
}

impl Tags {
    /// From the inputs' tags (xbc, dt, dt_bias, a_log, d) and dy, dxbc (or
    /// y) and ddt's (0 where a call has none).
    fn new([xbc, dt, bias, a_log, skip]: [i32; 5], [dy, dxbc, ddt]: [i32; 3]) -> Tags {
        Tags {
            xbc,
            dt,
            bias,
            a_log,
            skip,
            dy,
            dxbc,
            ddt,
        }
    }
}

/// What a checked chunked call works with: cuBLAS, the scratch cut into
/// its parts, the plan and items to slice, the operands and the GEMMs'
/// shape.
struct Call<'a> {
    blas: &'a Blas,
    queues: &'a QueueSet,
    parts: Parts,
    plan: ScanChunkPlan,
    /// (sequence, chunk) items of the problem.
    items: usize,
    operands: Operands,
    tags: Tags,
    shape: Shape,
}

/// Whether the `_quads` kernels (`scan_chunked.cu`: 4 elements a thread,
/// 32-bit indices) take a call: P, N and Q multiples of 4 (a quad never
/// straddles two heads or rows), every scratch part 16-byte aligned, and
/// every index they compute within 31 bits: a slice's largest arrays (the
/// heads' scores, and the quads of x, B and C that packing walks), the
/// problem's (item, step) pairs and the steps of a sequence and its padding.
fn takes_quads(dims: ScanDims, plan: ScanChunkPlan, items: usize, parts: &Parts) -> bool {
    let within = |factors: &[usize]| {
        factors
            .iter()
            .try_fold(1usize, |acc, &f| acc.checked_mul(f))
            .is_some_and(|n| n <= i32::MAX as usize)
    };
    let (per_slice, q) = (plan.items_per_slice, dims.chunk);
    // x's columns and one of B or C's, per step.
    let packed = (dims.heads.saturating_mul(dims.head_dim))
        .saturating_add(dims.groups.saturating_mul(dims.state));
    [dims.head_dim, dims.state, q]
        .iter()
        .all(|d| d.is_multiple_of(4))
        && parts.all().iter().all(|p| p.ptr.is_multiple_of(16))
        && within(&[per_slice, dims.heads, q, q])
        && within(&[per_slice, q, packed])
        && within(&[items, dims.heads, q])
        && within(&[dims.tokens.seq.saturating_add(q)])
}

/// The dynamic shared memory of an `ssd_chunk_scores_sums_mma` block for
/// `heads` heads a group of `p` channels (`mma_sums_shared` in the
/// kernel): the group's X rows for a block of columns, J P rounded up to 64
/// plus 32 apart (bf16), the warps' 16 staging rows, Lam and dt of each
/// head's columns, and each warp's column sums per head (f32).
const fn mma_sums_shared_bytes(heads: usize, p: usize) -> usize {
    let pitch = (heads * p).div_ceil(64) * 64 + 32;
    2 * SUMS_COLUMNS * pitch
        + 2 * MMA_SUMS_WARPS * 16 * MMA_STAGE_PITCH
        + 4 * 2 * heads * SUMS_COLUMNS
        + 4 * MMA_SUMS_WARPS * heads * SUMS_COLUMNS
}

/// The tensor-core scores kernels, each compiled for [`MMA_HEAD_WIDTHS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MmaScores {
    /// The backward's dM products, scores and sums.
    Sums,
    /// The forward's M X.
    Times,
}

impl MmaScores {
    /// The kernel for heads of `p` channels, if one is compiled.
    fn kernel(self, p: usize) -> Option<&'static str> {
        Some(match (self, p) {
            (MmaScores::Sums, 64) => "ssd_chunk_scores_sums_mma_p64",
            (MmaScores::Sums, 80) => "ssd_chunk_scores_sums_mma_p80",
            (MmaScores::Times, 64) => "ssd_chunk_scores_times_mma_p64",
            (MmaScores::Times, 80) => "ssd_chunk_scores_times_mma_p80",
            _ => return None,
        })
    }
}

/// Lets every `ssd_chunk_scores_sums_mma` kernel take its dynamic shared
/// memory (past the 48 KiB a launch gets without asking). False where the
/// device cannot give it: the backward's scores then take the GEMMs and
/// `ssd_chunk_scores_sums`.
pub(super) fn reserve_shared_memory(functions: &HashMap<&'static str, CudaFunction>) -> bool {
    MMA_HEAD_WIDTHS.iter().all(|&p| {
        MmaScores::Sums
            .kernel(p)
            .and_then(|name| functions.get(name))
            .is_some_and(|f| {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    MMA_SUMS_MAX_SHARED as i32,
                )
                .is_ok()
            })
    })
}

/// Whether `ssd_chunk_scores_sums_mma` takes a call's backward scores: where
/// `ssd_chunk_scores_sums` would, the operands are bf16 (tensor-core
/// products, as the GEMMs it replaces), P has a kernel, a group has at most
/// `MMA_SUMS_HEADS` heads (so its rows fit the reserved shared memory), and
/// the kernel set reserved that memory (`reserved`).
fn takes_mma_sums(dims: ScanDims, parts: &Parts, reserved: bool) -> bool {
    reserved
        && parts.fused_sums
        && parts.bf16()
        && MmaScores::Sums.kernel(dims.head_dim).is_some()
        && dims.heads / dims.groups <= MMA_SUMS_HEADS
}

/// Whether `ssd_chunk_scores_times_mma` takes a call's forward M X: where
/// the `_quads` kernels do, the operands are bf16, P has a kernel, and Q is
/// whole blocks of its rows, short enough that one head's rows of a chunk
/// fit its shared memory.
fn takes_mma_times(dims: ScanDims, parts: &Parts) -> bool {
    parts.quads
        && parts.bf16()
        && MmaScores::Times.kernel(dims.head_dim).is_some()
        && dims.chunk.is_multiple_of(MMA_TIMES_ROWS)
        && dims.chunk <= MMA_TIMES_MAX_CHUNK
}

impl<'a> Call<'a> {
    /// After the views' checks: checks the scratch against `plan` and
    /// cuts it; `outputs` decide the GEMMs' operands ([`Shape::operand`]).
    fn new(
        k: &str,
        (blas, queues, mma_reserved): (&'a Blas, &'a QueueSet, bool),
        (inputs, dy, states): (ScanInputs<GpuView>, Option<GpuView>, GpuView),
        tags: Tags,
        (scratch, dims, plan, chunks): (GpuView, ScanDims, ScanChunkPlan, usize),
        outputs: &[GpuView],
    ) -> Result<Call<'a>> {
        check_scratch(k, plan, scratch, dims)?;
        let items = dims.tokens.batch * chunks;
        let shape = Shape::new(dims, outputs);
        let ScanInputs {
            xbc,
            dt,
            dt_bias,
            a_log,
            d,
        } = inputs;
        Ok(Call {
            blas,
            queues,
            parts: Parts::new(scratch, dims, plan, items, shape.operand, mma_reserved),
            plan,
            items,
            operands: Operands {
                xbc,
                dt,
                dt_bias,
                a_log,
                d,
                dy,
                states,
            },
            tags,
            shape,
        })
    }

    fn gemm(&self, g: StridedGemm) -> Result<()> {
        // SAFETY: every item of every operand lies inside the scratch,
        // `states` or the carries, whose lengths the checks made before
        // `Call::new` and in it held against the plan and the dimensions.
        unsafe { self.blas.gemm_strided(self.queues, g) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;
    use crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES;

    fn dims(batch: usize, seq: usize, chunk: usize) -> ScanDims {
        ScanDims {
            tokens: Tokens::new(batch, seq),
            heads: 64,
            head_dim: 64,
            groups: 8,
            state: 128,
            chunk,
        }
    }

    /// The launcher's sizes are the kernels': a block launched with more
    /// threads than a kernel's launch bound is refused on the GPU
    /// (`ssd_chunk_scores_sums_mma` was, once), and a shape the launcher
    /// admits past a kernel's arrays would run over them.
    #[test]
    fn the_launchers_sizes_are_the_kernels_defines() {
        let source = crate::cuda::launch::source_with_defines(
            "scan_chunked.cu",
            &[
                ("CHUNKED_MAX_CHUNK", CHUNKED_MAX_CHUNK),
                ("SUMS_COLUMNS", SUMS_COLUMNS),
                ("SUMS_MAX_HEADS", SUMS_MAX_HEADS),
                ("SUMS_WARPS", THREADS as usize / 32),
                ("MMA_SUMS_WARPS", MMA_SUMS_WARPS),
                ("MMA_TIMES_ROWS", MMA_TIMES_ROWS),
                ("MMA_TIMES_MAX_CHUNK", MMA_TIMES_MAX_CHUNK),
            ],
        );
        // The forward kernel's launch bound is a warp per 16 rows, which
        // is how MMA_TIMES_THREADS is defined here; the sums' staging
        // pitch is this one's.
        for needle in [
            "__launch_bounds__(MMA_TIMES_ROWS / 16 * 32)",
            "__launch_bounds__(MMA_SUMS_WARPS * 32, 3)",
            "#define MMA_STAGE_PITCH (SUMS_COLUMNS + 8)",
            "return (jp + 63) / 64 * 64 + 32;",
        ] {
            assert!(source.text.contains(needle), "{needle}");
        }
        // Every width's kernels are compiled (named in the source and its
        // entry points).
        for p in MMA_HEAD_WIDTHS {
            for which in [MmaScores::Sums, MmaScores::Times] {
                let name = which.kernel(p).unwrap();
                let macro_call = format!("({name}, {p})");
                assert!(source.text.contains(&macro_call), "{macro_call}");
                assert!(source.entry_points.contains(&name), "{name}");
            }
        }
    }

    #[test]
    fn the_default_cap_takes_a_benchmark_sequence_in_one_slice() {
        // bench-hybrid-moe: one sequence of 4096 tokens, chunks of 256.
        let d = dims(1, 4096, 256);
        let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        assert_eq!(plan.items_per_slice, 16);
        assert!(plan.scratch_bytes(d) <= SCAN_CHUNKED_SCRATCH_BYTES);
        // Four sequences: slices of what fits, never past the cap.
        let d4 = dims(4, 4096, 256);
        let plan = ScanChunkPlan::new(d4, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        assert!(
            plan.items_per_slice >= 8 && plan.items_per_slice < 64,
            "{plan:?}"
        );
        assert!(plan.scratch_bytes(d4) <= SCAN_CHUNKED_SCRATCH_BYTES);
    }

    #[test]
    fn problems_the_chunked_path_does_not_take_go_to_the_sequential_kernels() {
        let d = dims(1, 4096, 256);
        // A cap below one chunk, a chunk past the limit, nothing to do.
        assert_eq!(ScanChunkPlan::new(d, 1 << 20), None);
        assert_eq!(ScanChunkPlan::new(d, 0), None);
        assert_eq!(ScanChunkPlan::new(dims(1, 4096, 2048), usize::MAX), None);
        assert_eq!(ScanChunkPlan::new(dims(0, 4096, 256), usize::MAX), None);
        let no_state = ScanDims { state: 0, ..d };
        assert_eq!(ScanChunkPlan::new(no_state, usize::MAX), None);
        let bad_groups = ScanDims { groups: 7, ..d };
        assert_eq!(ScanChunkPlan::new(bad_groups, usize::MAX), None);
    }

    /// `times_head_states` is one GEMM a (item, group) pair over the
    /// group's J heads side by side: head j's `[Q, P]` block of the output
    /// and `[P, N]` block of the states are where a GEMM of that head alone
    /// reads and writes them (columns j P of the pair's `[Q, J P]` rows;
    /// state slot `(item, g J + j)` from item `first`).
    #[test]
    fn a_groups_heads_are_one_gemm_over_their_side_by_side_blocks() {
        let d = dims(2, 1024, 256);
        let f32s = |len| GpuView::new(1 << 30, len, DType::F32);
        let shape = Shape::new(d, &[f32s(1)]);
        let (first, count) = (3usize, 4usize);
        let (out, states) = (f32s(1 << 26), GpuView::new(1 << 34, 1 << 26, DType::F32));
        let lhs = pairs(f32s(1 << 20), shape.n, shape.q * shape.n);
        let calls = std::cell::RefCell::new(Vec::new());
        let record = |g: StridedGemm| {
            calls.borrow_mut().push(g);
            Ok(())
        };
        shape
            .times_head_states(&record, (first, count, d.heads), lhs, states, out)
            .unwrap();
        let calls = calls.into_inner();
        assert_eq!(calls.len(), 1, "one GEMM for every head");
        let g = calls[0];
        assert_eq!(
            (g.batch, g.m, g.n, g.k),
            (count * d.groups, shape.q, shape.jp, shape.n)
        );
        assert!(!g.a_trans && g.b_trans);
        let at = |m: StridedMatrix, pair: usize, row: usize, col: usize| {
            m.ptr + 4 * (pair * m.stride + row * m.ld + col) as u64
        };
        for pair in 0..g.batch {
            let (item, group) = (pair / d.groups, pair % d.groups);
            for j in 0..shape.j {
                // A head's own GEMM: its columns of the output, its state.
                let head = (first + item) * d.heads + group * shape.j + j;
                let own_out = out.ptr + 4 * (pair * shape.q * shape.jp + j * shape.p) as u64;
                let own_state = states.ptr + 4 * (head * shape.pn) as u64;
                assert_eq!(
                    at(g.c, pair, 0, j * shape.p),
                    own_out,
                    "pair {pair}, head {j}"
                );
                assert_eq!(g.c.ld, shape.jp);
                // B is stored [J P, N]: head j's rows start at row j P.
                assert_eq!(
                    at(g.b, pair, j * shape.p, 0),
                    own_state,
                    "pair {pair}, head {j}"
                );
                assert_eq!(g.b.ld, shape.n);
            }
        }
    }

    /// With bf16 operands the GEMMs read bf16 matrices and write f32 ones,
    /// and every offset into a bf16 view counts 2-byte elements: head j's
    /// scores, its columns of x and the states of item `first` lie where
    /// the kernels wrote them.
    #[test]
    fn bf16_operands_are_addressed_in_their_own_elements() {
        let d = dims(1, 4096, 256);
        let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        let items = 16;
        let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
        let parts = Parts::new(scratch, d, plan, items, DType::Bf16, true);
        let shape = Shape::new(d, &[GpuView::new(0, 1, DType::Bf16)]);
        assert_eq!(shape.operand, DType::Bf16);
        let calls = std::cell::RefCell::new(Vec::new());
        let record = |g: StridedGemm| {
            calls.borrow_mut().push(g);
            Ok(())
        };
        let j = 3;
        shape
            .head_scores_times(&record, 2, (parts.m, false), parts.x_op, parts.t_acc)
            .unwrap();
        let first = 5;
        let states = parts.states_op.unwrap();
        let lhs = pairs(parts.c, shape.n, shape.q * shape.n);
        shape
            .times_head_states(&record, (first, 2, d.heads), lhs, states, parts.u)
            .unwrap();
        let calls = calls.into_inner();
        let (scores, product) = (calls[j], calls[shape.j]);
        let (q, p) = (shape.q, shape.p);
        assert_eq!(
            (scores.a.dtype, scores.b.dtype, scores.c.dtype),
            (DType::Bf16, DType::Bf16, DType::F32)
        );
        assert_eq!(scores.a.ptr, parts.m.ptr + (2 * j * q * q) as u64);
        assert_eq!(scores.b.ptr, parts.x_op.ptr + (2 * j * p) as u64);
        assert_eq!(scores.c.ptr, parts.t_acc.ptr + (4 * j * p) as u64);
        assert_eq!(
            (product.b.dtype, product.c.dtype),
            (DType::Bf16, DType::F32)
        );
        assert_eq!(
            product.b.ptr,
            states.ptr + (2 * first * d.heads * shape.pn) as u64
        );
    }

    #[test]
    fn the_quad_kernels_take_aligned_scratch_and_shapes_of_whole_quads() {
        let takes = |d: ScanDims, base: u64| {
            let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
            let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
            let scratch = GpuView::new(base, plan.scratch_len(d), DType::F32);
            let [f32, bf16] =
                [DType::F32, DType::Bf16].map(|t| Parts::new(scratch, d, plan, items, t, true));
            assert_eq!(
                f32.quads, bf16.quads,
                "the operands' dtype does not decide it"
            );
            assert!(!f32.fused_sums || f32.quads);
            f32.quads
        };
        // The benchmark's scan, on an aligned scratch.
        assert!(takes(dims(1, 4096, 256), 1 << 20));
        // A scratch 4 bytes off, a chunk or a state that is not whole
        // quads: the element kernels.
        assert!(!takes(dims(1, 4096, 256), (1 << 20) + 4));
        assert!(!takes(dims(1, 4096, 250), 1 << 20));
        let odd_state = ScanDims {
            state: 130,
            ..dims(1, 4096, 256)
        };
        assert!(!takes(odd_state, 1 << 20));
        // Parts one item long (3 heads of 4 x 4 states) lie 12 bytes apart:
        // not every part is aligned.
        let narrow = ScanDims {
            tokens: Tokens::new(1, 4),
            heads: 3,
            head_dim: 4,
            groups: 1,
            state: 4,
            chunk: 4,
        };
        assert!(!takes(narrow, 1 << 20));
    }

    /// Every part lies inside the scratch and no two overlap, with f32 and
    /// with bf16 operands (the bf16 ones share their f32 slots in halves).
    #[test]
    fn the_parts_tile_the_scratch_without_overlap() {
        for d in [dims(1, 4096, 256), dims(2, 1000, 96)] {
            let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
            let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
            let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
            let end = scratch.ptr + (scratch.len * 4) as u64;
            for operand in [DType::F32, DType::Bf16] {
                let parts = Parts::new(scratch, d, plan, items, operand, true);
                assert_eq!(parts.bf16(), operand == DType::Bf16);
                let mut spans: Vec<(u64, u64)> = parts
                    .all()
                    .iter()
                    .map(|v| (v.ptr, v.ptr + (v.len * v.dtype.bytes()) as u64))
                    .collect();
                // With f32 operands, x's, dY's and the carries' operand
                // views are those arrays themselves.
                spans.sort_unstable();
                spans.dedup();
                for (start, stop) in &spans {
                    assert!(
                        *start >= scratch.ptr && stop <= &end,
                        "{operand}: a part past the scratch"
                    );
                }
                for pair in spans.windows(2) {
                    assert!(pair[0].1 <= pair[1].0, "{operand}: parts overlap: {pair:?}");
                }
            }
        }
    }

    #[test]
    fn the_scores_take_their_sums_where_blocks_of_columns_and_the_heads_fit() {
        let fused = |d: ScanDims| {
            let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
            let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
            let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
            Parts::new(scratch, d, plan, items, DType::Bf16, true).fused_sums
        };
        // The benchmark's 8 heads a group in chunks of 256; 16 heads a group.
        assert!(fused(dims(1, 4096, 256)));
        assert!(fused(ScanDims {
            heads: 128,
            ..dims(1, 4096, 256)
        }));
        // 17 heads a group, chunks that are not whole blocks of 32 columns,
        // shapes the `_quads` kernels do not take.
        assert!(!fused(ScanDims {
            heads: 136,
            ..dims(1, 4096, 256)
        }));
        assert!(!fused(dims(1, 4096, 48)));
        assert!(!fused(ScanDims {
            state: 130,
            ..dims(1, 4096, 256)
        }));
    }

    #[test]
    fn the_tensor_core_scores_take_heads_of_64_and_80_channels() {
        let takes = |d: ScanDims, reserved: bool| {
            let plan = ScanChunkPlan::new(d, usize::MAX).unwrap();
            let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
            let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
            let parts = Parts::new(scratch, d, plan, items, DType::Bf16, reserved);
            (parts.mma_sums, parts.mma_times)
        };
        // The benchmark model (8 heads of 64 a group), Nemotron-H 9B (16
        // heads of 80 a group), 16 heads of 64.
        let nine_b = ScanDims {
            heads: 128,
            head_dim: 80,
            ..dims(1, 4096, 256)
        };
        assert_eq!(takes(dims(1, 4096, 256), true), (true, true));
        assert_eq!(takes(nine_b, true), (true, true));
        assert_eq!(
            takes(
                ScanDims {
                    heads: 128,
                    ..dims(1, 4096, 256)
                },
                true
            ),
            (true, true)
        );
        // Without the shared memory reserved, the sums take the GEMMs.
        assert_eq!(takes(nine_b, false), (false, true));
        // A width without kernels; chunks of 512 (past the forward's
        // staging) and of 32 (not whole blocks of its rows).
        assert_eq!(
            takes(
                ScanDims {
                    head_dim: 72,
                    ..nine_b
                },
                true
            ),
            (false, false)
        );
        assert_eq!(
            takes(
                ScanDims {
                    chunk: 512,
                    ..nine_b
                },
                true
            ),
            (true, false)
        );
        assert_eq!(
            takes(
                ScanDims {
                    chunk: 32,
                    ..nine_b
                },
                true
            ),
            (true, false)
        );
        // f32 operands take the GEMMs.
        let plan = ScanChunkPlan::new(nine_b, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        let scratch = GpuView::new(1 << 20, plan.scratch_len(nine_b), DType::F32);
        let f32_parts = Parts::new(scratch, nine_b, plan, 16, DType::F32, true);
        assert!(!f32_parts.mma_sums && !f32_parts.mma_times);
        // The shared memory of a block grows with the group, up to the
        // reservation at its widest.
        assert!(mma_sums_shared_bytes(8, 64) < 48 * 1024);
        assert!(mma_sums_shared_bytes(16, 64) < MMA_SUMS_MAX_SHARED);
        // 99 KiB: 32 rows of 1,312 bf16, 4 warps' 16 staging rows of 40,
        // and 16 heads' Lam, dt and 4 warps' column sums of 32.
        assert_eq!(MMA_SUMS_MAX_SHARED, 101_376);
    }

    #[test]
    fn the_second_pass_starts_with_the_slice_the_first_left_prepared() {
        let plan = ScanChunkPlan { items_per_slice: 2 };
        assert_eq!(plan.slices(5).collect::<Vec<_>>(), [(0, 2), (2, 4), (4, 5)]);
        assert_eq!(
            plan.second_pass(5).collect::<Vec<_>>(),
            [(4, 5, true), (2, 4, false), (0, 2, false)]
        );
        // One slice: prepared once, by the first pass.
        let whole = ScanChunkPlan {
            items_per_slice: 16,
        };
        assert_eq!(whole.second_pass(16).collect::<Vec<_>>(), [(0, 16, true)]);
    }

    #[test]
    fn the_scratch_is_the_carries_and_a_slice_of_items() {
        // 2 sequences of 100 steps in chunks of 64: 4 items.
        let d = ScanDims {
            tokens: Tokens::new(2, 100),
            heads: 6,
            head_dim: 10,
            groups: 3,
            state: 20,
            chunk: 64,
        };
        // Steps, wide, narrow, group and head scores, the row sums' partials
        // (2 blocks of 32 columns).
        let per_item = 7 * 6 * 64
            + 6 * 60 * 64
            + 4 * 3 * 20 * 64
            + 2 * 3 * 64 * 64
            + 2 * 6 * 64 * 64
            + 6 * 64 * 2;
        // Per chunk: carries, the states' and carries' bf16 copies, decay
        // and two partials a head.
        let global = 4 * 6 * (2 * 10 * 20 + 3);
        let plan = ScanChunkPlan::new(d, (global + 3 * per_item) * 4).unwrap();
        assert_eq!(plan.items_per_slice, 3);
        assert_eq!(plan.scratch_len(d), global + 3 * per_item);
        let all = ScanChunkPlan::new(d, usize::MAX).unwrap();
        assert_eq!(all.items_per_slice, 4);
        let cap = ScanChunkPlan::cap_for(d, 2).unwrap();
        assert_eq!(ScanChunkPlan::new(d, cap).unwrap().items_per_slice, 2);
        assert_eq!(ScanChunkPlan::new(d, cap - 1).unwrap().items_per_slice, 1);
    }
}

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
//! ([`SCAN_CHUNKED_SCRATCH_BYTES`](crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES) by default) and a problem is cut into
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
    GpuView, KernelSet, block_per_row, ensure, grid_for, per_item, product, reserve_dynamic_shared,
};
use crate::cuda::queue::QueueSet;
use crate::error::Result;
use crate::view::DType;
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
    /// by default [`SCAN_CHUNKED_SCRATCH_BYTES`](crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES)); `None` sends the problem
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

    /// Elements (f32) of the scratch `KernelSet::ssd_scan_backward_chunked`
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
    scratch.operand().exactly(DType::F32, kernel, "scratch")?;
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
            .is_some_and(|f| reserve_dynamic_shared(f, MMA_SUMS_MAX_SHARED))
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

mod passes;
#[cfg(test)]
mod tests;

//! Attention on a GPU: [`AttentionKernels`] for [`CudaBackend`] (the flash
//! kernels of [`super::attention_flash`] where they take the problem, else
//! the GEMM path through cuBLAS where its plan fits the scratch cap, else the
//! tiled kernels), the launchers of `kernels/attention.cu` (causal attention
//! with grouped KV heads, forward `attention_forward` and backward
//! `attention_backward_dq` then `attention_backward_dkdv`) and of the rotary
//! kernel, on [`KernelSet`]. The launchers take views `backend::attention`'s
//! checks accepted.
//!
//! The kernels are tiled the flash-attention way (a block per 64-query or
//! 32-key tile per head, scores only in registers and shared memory) and
//! take no scratch memory: the backward recomputes the probabilities from
//! `lse` and `D_t = dout_t . out_t` where it needs them. Their grids depend on
//! the dimensions alone, so every sum has one order and the same inputs give
//! the same bits.

use super::attention_flash::{flash_attention_dims, flash_attention_scratch_len};
use crate::backend::{
    AttentionBackend, AttentionDims, AttentionInputs, AttentionKernels, RotaryDims, RotaryPairing,
    ScratchSettings,
};
use crate::cuda::blas::{Blas, StridedGemm, StridedMatrix};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, MAX_GRID_X, MAX_GRID_Y, as_u32, dtype_tag, ensure, grid_for, product,
};
use crate::cuda::queue::QueueSet;
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use crate::view::{View, ViewMut};
use cudarc::driver::{CudaStream, LaunchConfig};

impl AttentionKernels<CudaBuf> for CudaBackend {
    fn attention_forward_unchecked(
        &self,
        inputs: AttentionInputs<View<'_, CudaBuf>>,
        out: ViewMut<'_, CudaBuf>,
        lse: ViewMut<'_, CudaBuf>,
        dims: AttentionDims,
    ) -> Result<()> {
        let inputs = AttentionInputs {
            q: self.v(inputs.q),
            k: self.v(inputs.k),
            v: self.v(inputs.v),
        };
        let (out, lse) = (self.m(&out), self.m(&lse));
        if self.flash_attention(dims, &[inputs.q, inputs.k, inputs.v, out]) {
            return self
                .k()
                .attention_forward_flash(self.s(), inputs, out, lse, dims);
        }
        let Some(plan) = AttentionGemmPlan::new(
            dims,
            &[inputs.q, inputs.k, inputs.v, out],
            self.attention_scratch,
        ) else {
            return self.k().attention_forward(self.s(), inputs, out, lse, dims);
        };
        // The GEMM path: tensor-core products through cuBLAS, scratch from
        // the arena (a repeated step allocates nothing).
        let (scores, _scores_buf) = self.scratch_uninit(plan.scores_len(dims), DType::F32)?;
        let (probs, _probs_buf) = self.scratch_uninit(plan.probs_len(dims), plan.dtype)?;
        let lens = AttentionGemmPlan::accumulator_lens(dims);
        let (acc_out, _acc_buf) = self.scratch(lens.out, DType::F32)?;
        self.k().attention_forward_gemm(
            self.s(),
            &self.queue.blas,
            &self.gpu().queues,
            inputs,
            out,
            lse,
            dims,
            plan,
            (scores, probs),
            acc_out,
        )
    }

    fn attention_backward_unchecked(
        &self,
        inputs: AttentionInputs<View<'_, CudaBuf>>,
        out: View<'_, CudaBuf>,
        lse: View<'_, CudaBuf>,
        dout: View<'_, CudaBuf>,
        grads: AttentionInputs<ViewMut<'_, CudaBuf>>,
        dims: AttentionDims,
    ) -> Result<()> {
        let inputs = AttentionInputs {
            q: self.v(inputs.q),
            k: self.v(inputs.k),
            v: self.v(inputs.v),
        };
        let grads = AttentionInputs {
            q: self.m(&grads.q),
            k: self.m(&grads.k),
            v: self.m(&grads.v),
        };
        let (out, lse, dout) = (self.v(out), self.v(lse), self.v(dout));
        let views = [
            inputs.q, inputs.k, inputs.v, out, dout, grads.q, grads.k, grads.v,
        ];
        if self.flash_attention(dims, &views) {
            let (scratch, _scratch_buf) =
                self.scratch_uninit(flash_attention_scratch_len(dims), DType::F32)?;
            return self.k().attention_backward_flash(
                self.s(),
                inputs,
                (out, lse, dout),
                grads,
                scratch,
                dims,
            );
        }
        let Some(plan) = AttentionGemmPlan::new(dims, &views, self.attention_scratch) else {
            return self
                .k()
                .attention_backward(self.s(), inputs, out, lse, dout, grads, dims);
        };
        let (scores, _scores_buf) = self.scratch_uninit(plan.scores_len(dims), DType::F32)?;
        let (probs, _probs_buf) = self.scratch_uninit(plan.probs_len(dims), plan.dtype)?;
        let lens = AttentionGemmPlan::accumulator_lens(dims);
        let (acc_q, _acc_q_buf) = self.scratch(lens.q, DType::F32)?;
        let (acc_k, _acc_k_buf) = self.scratch(lens.k, DType::F32)?;
        let (acc_v, _acc_v_buf) = self.scratch(lens.v, DType::F32)?;
        self.k().attention_backward_gemm(
            self.s(),
            &self.queue.blas,
            &self.gpu().queues,
            inputs,
            (out, lse, dout),
            grads,
            dims,
            plan,
            (scores, probs),
            AttentionInputs {
                q: acc_q,
                k: acc_k,
                v: acc_v,
            },
        )
    }

    fn rotary_forward_unchecked(&self, x: ViewMut<'_, CudaBuf>, dims: RotaryDims) -> Result<()> {
        self.k().rotary_forward(self.s(), self.m(&x), dims)
    }

    fn rotary_backward_unchecked(&self, dx: ViewMut<'_, CudaBuf>, dims: RotaryDims) -> Result<()> {
        self.k().rotary_backward(self.s(), self.m(&dx), dims)
    }
}

/// Threads of every attention block (`ATT_THREADS`).
const THREADS: u32 = 256;
/// Query rows of a forward or dq block (`TILE`).
const QUERY_TILE: usize = 64;
/// Key rows of a dk/dv block (`KEYS_DKDV`).
const KEY_TILE: usize = 32;
/// Head channels of one block (`COLS`); a larger head dim takes more blocks.
const CHANNEL_GROUP: usize = 256;

/// The dimensions as the kernels take them, checked to fit their u32
/// arithmetic (the flash kernels' too).
pub(super) struct KernelDims {
    pub(super) batch: u32,
    pub(super) seq: u32,
    pub(super) heads: u32,
    pub(super) kv_heads: u32,
    pub(super) qk_dim: u32,
    v_dim: u32,
    pub(super) scale: f32,
}

impl KernelDims {
    pub(super) fn new(kernel: &str, d: AttentionDims) -> Result<KernelDims> {
        // Tile starts run to `seq` plus a tile in u32.
        ensure(d.tokens.seq <= i32::MAX as usize, || {
            format!(
                "{kernel}: sequences of {} tokens exceed the CUDA kernels' {} tokens",
                d.tokens.seq,
                i32::MAX
            )
        })?;
        Ok(KernelDims {
            batch: as_u32(kernel, "batch", d.tokens.batch)?,
            seq: as_u32(kernel, "sequence length", d.tokens.seq)?,
            heads: as_u32(kernel, "heads", d.heads)?,
            kv_heads: as_u32(kernel, "KV heads", d.kv_heads)?,
            qk_dim: as_u32(kernel, "qk dim", d.qk_dim)?,
            v_dim: as_u32(kernel, "v dim", d.v_dim)?,
            scale: d.scale,
        })
    }

    /// Pushes `batch, seq, heads, kv_heads, qk_dim, v_dim, scale` (the tail
    /// of every attention kernel's arguments).
    fn push<'a>(&'a self, b: &mut KernelArgs<'a>) {
        b.arg(&self.batch)
            .arg(&self.seq)
            .arg(&self.heads)
            .arg(&self.kv_heads)
            .arg(&self.qk_dim)
            .arg(&self.v_dim)
            .arg(&self.scale);
    }
}

/// A grid of `tiles` tiles for each of `pairs` (sequence, head) pairs along
/// x, and `channel_groups` groups of head channels along y (at least one).
fn tile_grid(kernel: &str, tiles: usize, pairs: usize, channels: usize) -> Result<LaunchConfig> {
    let blocks = tiles.checked_mul(pairs).filter(|&b| b <= MAX_GRID_X);
    let groups = channels.div_ceil(CHANNEL_GROUP).max(1);
    match blocks {
        Some(blocks) if groups <= MAX_GRID_Y => Ok(LaunchConfig {
            grid_dim: (blocks as u32, groups as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }),
        _ => Err(RuntimeError::Unsupported(format!(
            "{kernel}: {tiles} tiles x {pairs} (sequence, head) pairs x {groups} channel groups \
             exceed a CUDA grid"
        ))),
    }
}

impl KernelSet {
    /// `Backend::attention_forward`: `out` (the dtype of the activations)
    /// and the f32 log-sum-exp of each (row, head) in `lse`.
    pub fn attention_forward(
        &self,
        stream: &CudaStream,
        inputs: AttentionInputs<GpuView>,
        out: GpuView,
        lse: GpuView,
        dims: AttentionDims,
    ) -> Result<()> {
        let kn = "attention_forward";
        let AttentionInputs { q, k, v } = inputs;
        let [qt, kt, vt, ot] = [q, k, v, out].map(|view| dtype_tag(view.dtype));
        let rows = dims.tokens.batch * dims.tokens.seq;
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = KernelDims::new(kn, dims)?;
        let config = tile_grid(
            kn,
            dims.tokens.seq.div_ceil(QUERY_TILE),
            dims.tokens.batch * dims.heads,
            dims.v_dim,
        )?;
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&q.ptr)
            .arg(&qt)
            .arg(&k.ptr)
            .arg(&kt)
            .arg(&v.ptr)
            .arg(&vt);
        b.arg(&out.ptr).arg(&ot).arg(&lse.ptr);
        shape.push(&mut b);
        self.go(kn, &mut b, config)
    }

    /// `Backend::attention_backward`: overwrites `grads.q`, `grads.k` and
    /// `grads.v`. Two kernels: dq by query tiles, then dk and dv by key
    /// tiles, each key tile summing over the query tiles and the group's
    /// query heads in a fixed order.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        stream: &CudaStream,
        inputs: AttentionInputs<GpuView>,
        out: GpuView,
        lse: GpuView,
        dout: GpuView,
        grads: AttentionInputs<GpuView>,
        dims: AttentionDims,
    ) -> Result<()> {
        let kn = "attention_backward";
        let AttentionInputs { q, k, v } = inputs;
        let [qt, kt, vt, ot, gt] = [q, k, v, out, dout].map(|view| dtype_tag(view.dtype));
        let AttentionInputs {
            q: dq,
            k: dk,
            v: dv,
        } = grads;
        let [dqt, dkt, dvt] = [dq, dk, dv].map(|view| dtype_tag(view.dtype));
        let rows = dims.tokens.batch * dims.tokens.seq;
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = KernelDims::new(kn, dims)?;
        let pairs = dims.tokens.batch * dims.heads;
        if dq.len > 0 {
            let k_dq = "attention_backward_dq";
            let config = tile_grid(kn, dims.tokens.seq.div_ceil(QUERY_TILE), pairs, dims.qk_dim)?;
            let mut b = KernelArgs::new(stream, self.function(k_dq)?);
            b.arg(&q.ptr)
                .arg(&qt)
                .arg(&k.ptr)
                .arg(&kt)
                .arg(&v.ptr)
                .arg(&vt);
            b.arg(&out.ptr)
                .arg(&ot)
                .arg(&lse.ptr)
                .arg(&dout.ptr)
                .arg(&gt);
            b.arg(&dq.ptr).arg(&dqt);
            shape.push(&mut b);
            self.go(k_dq, &mut b, config)?;
        }
        if dk.len > 0 || dv.len > 0 {
            let k_dkdv = "attention_backward_dkdv";
            let config = tile_grid(
                kn,
                dims.tokens.seq.div_ceil(KEY_TILE),
                dims.tokens.batch * dims.kv_heads,
                dims.qk_dim.max(dims.v_dim),
            )?;
            let mut b = KernelArgs::new(stream, self.function(k_dkdv)?);
            b.arg(&q.ptr)
                .arg(&qt)
                .arg(&k.ptr)
                .arg(&kt)
                .arg(&v.ptr)
                .arg(&vt);
            b.arg(&out.ptr)
                .arg(&ot)
                .arg(&lse.ptr)
                .arg(&dout.ptr)
                .arg(&gt);
            b.arg(&dk.ptr).arg(&dkt).arg(&dv.ptr).arg(&dvt);
            shape.push(&mut b);
            self.go(k_dkdv, &mut b, config)?;
        }
        Ok(())
    }
}

// ---- the GEMM path ----------------------------------------------------------------

/// How `KernelSet::attention_forward_gemm` and
/// `KernelSet::attention_backward_gemm` cut a problem: the dtype every
/// operand shares and the KV heads each batched call takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionGemmPlan {
    pub dtype: DType,
    pub kv_heads_per_call: usize,
}

impl AttentionGemmPlan {
    /// The plan for `dims` when every view shares one float dtype and one
    /// KV head's scratch fits `scratch_bytes` (the backend's cap, by default
    /// [`ATTENTION_GEMM_SCRATCH_BYTES`](crate::cuda::launch::ATTENTION_GEMM_SCRATCH_BYTES)); `None` sends the problem to the
    /// tiled kernels.
    pub fn new(
        dims: AttentionDims,
        views: &[GpuView],
        scratch_bytes: usize,
    ) -> Option<AttentionGemmPlan> {
        let dtype = views.first()?.dtype;
        if views.iter().any(|v| v.dtype != dtype) {
            return None;
        }
        AttentionGemmPlan::for_dtype(dims, dtype, scratch_bytes)
    }

    /// The plan for `dims` with every operand in `dtype` (f32 or bf16, else
    /// `None`), under a cap of `scratch_bytes`.
    pub fn for_dtype(
        dims: AttentionDims,
        dtype: DType,
        scratch_bytes: usize,
    ) -> Option<AttentionGemmPlan> {
        if !matches!(dtype, DType::F32 | DType::Bf16) {
            return None;
        }
        let split = if dtype == DType::Bf16 { 2 } else { 1 };
        let per_head = dims
            .tokens
            .seq
            .checked_mul(dims.tokens.seq)?
            .checked_mul(DType::F32.bytes() + split * dtype.bytes())?;
        let fit = scratch_bytes / per_head.max(1);
        (fit > 0 && dims.kv_heads > 0).then(|| AttentionGemmPlan {
            dtype,
            kv_heads_per_call: fit.min(dims.kv_heads),
        })
    }

    /// Whether probabilities and score gradients are stored as a bf16
    /// value and its bf16 remainder (see `attention_rows.cu`): in bf16.
    pub fn split(&self) -> bool {
        self.dtype == DType::Bf16
    }

    /// Elements of the f32 scores scratch, `[kv_heads_per_call, seq, seq]`.
    pub fn scores_len(&self, dims: AttentionDims) -> usize {
        self.kv_heads_per_call * dims.tokens.seq * dims.tokens.seq
    }

    /// Elements (of `dtype`) of the probabilities scratch: one matrix like
    /// the scores', two when [`AttentionGemmPlan::split`].
    pub fn probs_len(&self, dims: AttentionDims) -> usize {
        self.scores_len(dims) * if self.split() { 2 } else { 1 }
    }

    /// Bytes of scratch one call takes: the scores, the probabilities and
    /// the accumulators of the backward (which has more than the forward).
    pub fn scratch_bytes(&self, dims: AttentionDims) -> usize {
        let lens = AttentionGemmPlan::accumulator_lens(dims);
        let accumulators = (lens.q + lens.k + lens.v).max(lens.out);
        (self.scores_len(dims) + accumulators) * DType::F32.bytes()
            + self.probs_len(dims) * self.dtype.bytes()
    }

    /// Elements of the f32 accumulators of one sequence's query-side
    /// results (the forward's `out` and the backward's query gradient),
    /// `[seq, heads, v_dim]` and `[seq, heads, qk_dim]`, and of its key and
    /// value gradients, `[seq, kv_heads, qk_dim]` and `[seq, kv_heads,
    /// v_dim]` (summed over a group's query heads); each rounds once into
    /// its output when the sequence is done.
    pub fn accumulator_lens(dims: AttentionDims) -> AttentionAccumulatorLens {
        let (q_rows, kv_rows) = (
            dims.tokens.seq * dims.heads,
            dims.tokens.seq * dims.kv_heads,
        );
        AttentionAccumulatorLens {
            out: q_rows * dims.v_dim,
            q: q_rows * dims.qk_dim,
            k: kv_rows * dims.qk_dim,
            v: kv_rows * dims.v_dim,
        }
    }
}

/// Elements of one sequence's f32 accumulators of the GEMM path: the
/// forward's `out`, the backward's query, key and value gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionAccumulatorLens {
    pub out: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
}

/// `view` from element `offset` on.
fn at(view: GpuView, offset: usize) -> GpuView {
    GpuView::new(
        view.ptr + (offset * view.dtype.bytes()) as u64,
        view.len.saturating_sub(offset),
        view.dtype,
    )
}

/// A strided batch over heads: item `i` at `offset + i * stride` of `view`,
/// rows `ld` apart.
fn heads(view: GpuView, offset: usize, ld: usize, stride: usize) -> StridedMatrix {
    StridedMatrix {
        ptr: at(view, offset).ptr,
        dtype: view.dtype,
        ld,
        stride,
    }
}

/// Where one batched call works: sequence `b`, query head `j` of every
/// group, KV heads `[g0, g0 + count)`.
#[derive(Clone, Copy)]
struct Slab {
    b: usize,
    j: usize,
    g0: usize,
    count: usize,
}

/// The shapes every call of the GEMM path shares.
struct GemmShape {
    seq: usize,
    heads: usize,
    kv_heads: usize,
    group: usize,
    qk: usize,
    v: usize,
    scale: f32,
}

impl GemmShape {
    fn new(d: AttentionDims) -> GemmShape {
        GemmShape {
            seq: d.tokens.seq,
            heads: d.heads,
            kv_heads: d.kv_heads,
            group: d.heads / d.kv_heads,
            qk: d.qk_dim,
            v: d.v_dim,
            scale: d.scale,
        }
    }

    /// The slab's query heads in a `[rows, heads, width]` tensor.
    fn query(&self, view: GpuView, s: Slab, width: usize) -> StridedMatrix {
        let first = (s.b * self.seq * self.heads + s.g0 * self.group + s.j) * width;
        heads(view, first, self.heads * width, self.group * width)
    }

    /// The slab's KV heads in a `[rows, kv_heads, width]` tensor.
    fn key(&self, view: GpuView, s: Slab, width: usize) -> StridedMatrix {
        let first = (s.b * self.seq * self.kv_heads + s.g0) * width;
        heads(view, first, self.kv_heads * width, width)
    }

    /// The slab's KV heads in a one-sequence `[seq, kv_heads, width]`
    /// accumulator.
    fn accumulator(&self, view: GpuView, s: Slab, width: usize) -> StridedMatrix {
        heads(view, s.g0 * width, self.kv_heads * width, width)
    }

    /// The slab's query heads in a one-sequence `[seq, heads, width]`
    /// accumulator.
    fn query_accumulator(&self, view: GpuView, s: Slab, width: usize) -> StridedMatrix {
        let first = (s.g0 * self.group + s.j) * width;
        heads(view, first, self.heads * width, self.group * width)
    }

    /// `[count, seq, seq]` scratch.
    fn square(&self, view: GpuView) -> StridedMatrix {
        heads(view, 0, self.seq, self.seq * self.seq)
    }

    fn gemm(
        &self,
        s: Slab,
        (m, n, k): (usize, usize, usize),
        (a, a_trans): (StridedMatrix, bool),
        (b, b_trans): (StridedMatrix, bool),
        c: StridedMatrix,
        (alpha, beta): (f32, f32),
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
            alpha,
            beta,
            batch: s.count,
        }
    }

    /// `scores = scale q k^T` for the slab.
    fn scores(&self, s: Slab, q: GpuView, k: GpuView, scores: GpuView) -> StridedGemm {
        self.gemm(
            s,
            (self.seq, self.seq, self.qk),
            (self.query(q, s, self.qk), false),
            (self.key(k, s, self.qk), true),
            self.square(scores),
            (self.scale, 0.0),
        )
    }

    /// Every slab of sequence `b`, in the fixed order the backward's sums
    /// over a group's query heads follow.
    fn slabs(&self, b: usize, per_call: usize) -> impl Iterator<Item = Slab> + '_ {
        (0..self.kv_heads).step_by(per_call).flat_map(move |g0| {
            let count = per_call.min(self.kv_heads - g0);
            (0..self.group).map(move |j| Slab { b, j, g0, count })
        })
    }

    /// `op(A) B` over the split matrix `a` (its high part, then its low
    /// part added when there is one) into `c` with `beta` for the first.
    #[allow(clippy::too_many_arguments)]
    fn split_gemms(
        &self,
        s: Slab,
        mnk: (usize, usize, usize),
        (a, low, a_trans): (GpuView, Option<GpuView>, bool),
        b: (StridedMatrix, bool),
        c: StridedMatrix,
        (alpha, beta): (f32, f32),
    ) -> [Option<StridedGemm>; 2] {
        let high = self.gemm(s, mnk, (self.square(a), a_trans), b, c, (alpha, beta));
        let low = low.map(|low| self.gemm(s, mnk, (self.square(low), a_trans), b, c, (alpha, 1.0)));
        [Some(high), low]
    }
}

/// The GEMM path's scratch: scores (f32) and probabilities (the plan's
/// dtype, split in bf16: `high` then `low`).
struct Squares {
    scores: GpuView,
    high: GpuView,
    low: Option<GpuView>,
}

impl Squares {
    fn new(plan: AttentionGemmPlan, dims: AttentionDims, scores: GpuView, probs: GpuView) -> Self {
        let n = plan.scores_len(dims);
        let high = GpuView::new(probs.ptr, n, probs.dtype);
        let low = plan
            .split()
            .then(|| GpuView::new(at(probs, n).ptr, n, probs.dtype));
        Squares { scores, high, low }
    }

    /// The low half's address, 0 (null in the kernels) without one.
    fn low_ptr(&self) -> u64 {
        self.low.map_or(0, |v| v.ptr)
    }
}

impl KernelSet {
    /// Launches one row kernel of `attention_rows.cu` over the slab's
    /// `count * seq` rows.
    fn row_blocks(&self, kernel: &str, shape: &GemmShape, s: Slab) -> Result<LaunchConfig> {
        let rows = product(kernel, &[s.count, shape.seq])?;
        ensure(rows <= MAX_GRID_X, || {
            format!("{kernel}: {rows} rows exceed a CUDA grid")
        })?;
        Ok(LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (
                crate::cuda::launch::reduce_threads(shape.seq, THREADS),
                1,
                1,
            ),
            shared_mem_bytes: 0,
        })
    }

    fn probs(
        &self,
        stream: &CudaStream,
        shape: &GemmShape,
        s: Slab,
        squares: &Squares,
        lse: GpuView,
        find: bool,
    ) -> Result<()> {
        let kn = "attention_probs";
        let config = self.row_blocks(kn, shape, s)?;
        let first = s.b * shape.seq * shape.heads + s.g0 * shape.group + s.j;
        let lse = at(lse, first);
        let (pt, seq) = (
            crate::cuda::launch::dtype_tag(squares.high.dtype),
            as_u32(kn, "seq", shape.seq)?,
        );
        let (row, item) = (
            as_u32(kn, "heads", shape.heads)?,
            as_u32(kn, "group", shape.group)?,
        );
        let (find, low) = (i32::from(find), squares.low_ptr());
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&squares.scores.ptr).arg(&squares.high.ptr).arg(&low);
        b.arg(&pt).arg(&lse.ptr);
        b.arg(&seq).arg(&row).arg(&item).arg(&find);
        self.go(kn, &mut b, config)
    }

    /// Enqueues the GEMMs of `gemms` (the low half's only when there is one).
    fn run_gemms(blas: &Blas, queues: &QueueSet, gemms: &[Option<StridedGemm>]) -> Result<()> {
        for g in gemms.iter().flatten() {
            // SAFETY: the callers build every GEMM from views and scratch
            // whose lengths they checked against the slab's extent.
            unsafe { blas.gemm_strided(queues, *g)? };
        }
        Ok(())
    }

    /// `Backend::attention_forward` through cuBLAS (see
    /// [`AttentionGemmPlan`]): per sequence, per query head of a group, a
    /// strided batch over KV heads of `scale q k^T`, the causal softmax
    /// (`attention_probs`, which stores `lse`) and `p v` into the
    /// sequence's f32 accumulator, rounded once into `out`. `scores` and
    /// `probs` hold [`AttentionGemmPlan::scores_len`] and
    /// [`AttentionGemmPlan::probs_len`] elements (f32 and the plan's dtype),
    /// `acc_out` [`AttentionGemmPlan::accumulator_lens`]`.out` (f32).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_forward_gemm(
        &self,
        stream: &CudaStream,
        blas: &Blas,
        queues: &QueueSet,
        inputs: AttentionInputs<GpuView>,
        out: GpuView,
        lse: GpuView,
        dims: AttentionDims,
        plan: AttentionGemmPlan,
        (scores, probs): (GpuView, GpuView),
        acc_out: GpuView,
    ) -> Result<()> {
        let kn = "attention_forward";
        check_scratch(kn, dims, plan, scores, probs)?;
        let rows = dims.tokens.batch * dims.tokens.seq;
        let AttentionInputs { q, k, v } = inputs;
        let lens = AttentionGemmPlan::accumulator_lens(dims);
        accumulator(kn, "the output accumulator", &acc_out, lens.out)?;
        for (name, view) in [("q", &q), ("k", &k), ("v", &v), ("out", &out)] {
            view.operand().exactly(plan.dtype, kn, name)?;
        }
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = GemmShape::new(dims);
        let squares = Squares::new(plan, dims, scores, probs);
        for b in 0..dims.tokens.batch {
            for s in shape.slabs(b, plan.kv_heads_per_call) {
                Self::run_gemms(blas, queues, &[Some(shape.scores(s, q, k, scores))])?;
                self.probs(stream, &shape, s, &squares, lse, true)?;
                let pv = shape.split_gemms(
                    s,
                    (shape.seq, shape.v, shape.seq),
                    (squares.high, squares.low, false),
                    (shape.key(v, s, shape.v), false),
                    shape.query_accumulator(acc_out, s, shape.v),
                    (1.0, 0.0),
                );
                Self::run_gemms(blas, queues, &pv)?;
            }
            self.store_sequence(stream, b, &[(acc_out, out)])?;
        }
        Ok(())
    }

    /// `Backend::attention_backward` through cuBLAS: per slab, the scores
    /// again and the probabilities from `lse` (the forward's bits), `dv +=
    /// p^T dout`, `dp = dout v^T`, `ds = p (dp - dout . out)`
    /// (`attention_scores_grad`, over the probabilities), `dq = scale ds k`
    /// and `dk += scale ds^T q`. A sequence's gradients collect in f32
    /// accumulators ([`AttentionGemmPlan::accumulator_lens`]; the key and
    /// value ones sum over the group's query heads in head order), then
    /// round once into `grads`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward_gemm(
        &self,
        stream: &CudaStream,
        blas: &Blas,
        queues: &QueueSet,
        inputs: AttentionInputs<GpuView>,
        (out, lse, dout): (GpuView, GpuView, GpuView),
        grads: AttentionInputs<GpuView>,
        dims: AttentionDims,
        plan: AttentionGemmPlan,
        (scores, probs): (GpuView, GpuView),
        acc: AttentionInputs<GpuView>,
    ) -> Result<()> {
        let kn = "attention_backward";
        check_scratch(kn, dims, plan, scores, probs)?;
        let rows = dims.tokens.batch * dims.tokens.seq;
        let AttentionInputs { q, k, v } = inputs;
        let lens = AttentionGemmPlan::accumulator_lens(dims);
        accumulator(kn, "the query accumulator", &acc.q, lens.q)?;
        accumulator(kn, "the key accumulator", &acc.k, lens.k)?;
        accumulator(kn, "the value accumulator", &acc.v, lens.v)?;
        let operands = [
            ("q", &q),
            ("k", &k),
            ("v", &v),
            ("out", &out),
            ("dout", &dout),
        ];
        let gradients = [
            ("grads.q", &grads.q),
            ("grads.k", &grads.k),
            ("grads.v", &grads.v),
        ];
        for (name, view) in operands.into_iter().chain(gradients) {
            view.operand().exactly(plan.dtype, kn, name)?;
        }
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = GemmShape::new(dims);
        let squares = Squares::new(plan, dims, scores, probs);
        let (pt, ot) = (
            crate::cuda::launch::dtype_tag(plan.dtype),
            crate::cuda::launch::dtype_tag(plan.dtype),
        );
        let seq = as_u32(kn, "seq", shape.seq)?;
        let o_row = as_u32(kn, "heads x v dim", shape.heads * shape.v)?;
        let o_item = as_u32(kn, "group x v dim", shape.group * shape.v)?;
        let v_dim = as_u32(kn, "v dim", shape.v)?;
        let low = squares.low_ptr();
        let split = (squares.high, squares.low);
        for b in 0..dims.tokens.batch {
            for s in shape.slabs(b, plan.kv_heads_per_call) {
                let beta = if s.j == 0 { 0.0 } else { 1.0 };
                Self::run_gemms(blas, queues, &[Some(shape.scores(s, q, k, scores))])?;
                self.probs(stream, &shape, s, &squares, lse, false)?;
                let dv = shape.split_gemms(
                    s,
                    (shape.seq, shape.v, shape.seq),
                    (split.0, split.1, true),
                    (shape.query(dout, s, shape.v), false),
                    shape.accumulator(acc.v, s, shape.v),
                    (1.0, beta),
                );
                let dp = shape.gemm(
                    s,
                    (shape.seq, shape.seq, shape.v),
                    (shape.query(dout, s, shape.v), false),
                    (shape.key(v, s, shape.v), true),
                    shape.square(scores),
                    (1.0, 0.0),
                );
                Self::run_gemms(blas, queues, &[dv[0], dv[1], Some(dp)])?;
                let kg = "attention_scores_grad";
                let config = self.row_blocks(kg, &shape, s)?;
                let first = (s.b * shape.seq * shape.heads + s.g0 * shape.group + s.j) * shape.v;
                let (dout_s, out_s) = (at(dout, first), at(out, first));
                let mut launch = KernelArgs::new(stream, self.function(kg)?);
                launch
                    .arg(&scores.ptr)
                    .arg(&squares.high.ptr)
                    .arg(&low)
                    .arg(&pt);
                launch.arg(&dout_s.ptr).arg(&ot).arg(&out_s.ptr).arg(&ot);
                launch.arg(&seq).arg(&o_row).arg(&o_item).arg(&v_dim);
                self.go(kg, &mut launch, config)?;
                let dq = shape.split_gemms(
                    s,
                    (shape.seq, shape.qk, shape.seq),
                    (split.0, split.1, false),
                    (shape.key(k, s, shape.qk), false),
                    shape.query_accumulator(acc.q, s, shape.qk),
                    (shape.scale, 0.0),
                );
                let dk = shape.split_gemms(
                    s,
                    (shape.seq, shape.qk, shape.seq),
                    (split.0, split.1, true),
                    (shape.query(q, s, shape.qk), false),
                    shape.accumulator(acc.k, s, shape.qk),
                    (shape.scale, beta),
                );
                Self::run_gemms(blas, queues, &[dq[0], dq[1], dk[0], dk[1]])?;
            }
            let pairs = [(acc.q, grads.q), (acc.k, grads.k), (acc.v, grads.v)];
            self.store_sequence(stream, b, &pairs)?;
        }
        Ok(())
    }

    /// Rounds sequence `b`'s accumulators into their outputs, where the
    /// sequence's rows are contiguous (an accumulator holds one sequence).
    fn store_sequence(
        &self,
        stream: &CudaStream,
        b: usize,
        pairs: &[(GpuView, GpuView)],
    ) -> Result<()> {
        for &(acc, dst) in pairs {
            let n = acc.len;
            let dst = GpuView::new(at(dst, b * n).ptr, n, dst.dtype);
            self.cast(stream, acc, dst)?;
        }
        Ok(())
    }
}

/// An f32 accumulator of exactly `n` elements (a view of that length, so
/// that [`KernelSet::store_sequence`] can take its length for a sequence's).
fn accumulator(kernel: &str, name: &str, view: &GpuView, n: usize) -> Result<()> {
    view.operand().exactly(DType::F32, kernel, name)?;
    ensure(view.len == n, || {
        format!(
            "{kernel}: {name} has {} elements, one sequence needs exactly {n}",
            view.len
        )
    })
}

/// The scratch of a GEMM-path call: scores in f32 and probabilities in the
/// plan's dtype, [`AttentionGemmPlan::scores_len`] and
/// [`AttentionGemmPlan::probs_len`] elements.
fn check_scratch(
    kernel: &str,
    dims: AttentionDims,
    plan: AttentionGemmPlan,
    scores: GpuView,
    probs: GpuView,
) -> Result<()> {
    scores
        .operand()
        .exactly(DType::F32, kernel, "the scores scratch")?;
    probs
        .operand()
        .exactly(plan.dtype, kernel, "the probabilities scratch")?;
    ensure(
        plan.kv_heads_per_call > 0 && plan.kv_heads_per_call <= dims.kv_heads,
        || {
            format!(
                "{kernel}: a plan of {} KV heads a call for {} KV heads",
                plan.kv_heads_per_call, dims.kv_heads
            )
        },
    )?;
    scores
        .operand()
        .has_len(kernel, "the scores scratch", plan.scores_len(dims))?;
    probs
        .operand()
        .has_len(kernel, "the probabilities scratch", plan.probs_len(dims))
}

impl KernelSet {
    fn rotary(
        &self,
        stream: &CudaStream,
        k: &'static str,
        x: GpuView,
        d: RotaryDims,
        sign: f32,
    ) -> Result<()> {
        let t = dtype_tag(x.dtype);
        let rows = d.tokens.batch * d.tokens.seq;
        if rows * d.heads * (d.dim / 2) == 0 {
            return Ok(());
        }
        // A thread per (row, pair index); it rotates that pair of every head.
        let angles = rows * (d.dim / 2);
        let dims = [rows, d.tokens.seq, d.heads, d.head_stride, d.offset, d.dim].map(|v| v as u64);
        let mut b = KernelArgs::new(stream, self.function("rotary")?);
        b.arg(&x.ptr).arg(&t);
        for v in &dims {
            b.arg(v);
        }
        let interleaved = i32::from(d.pairing == RotaryPairing::Interleaved);
        b.arg(&d.base).arg(&sign).arg(&interleaved);
        self.go(k, &mut b, grid_for(angles))
    }

    /// `Backend::rotary_forward`, in place.
    pub fn rotary_forward(&self, stream: &CudaStream, x: GpuView, d: RotaryDims) -> Result<()> {
        self.rotary(stream, "rotary_forward", x, d, 1.0)
    }

    /// `Backend::rotary_backward`, in place.
    pub fn rotary_backward(&self, stream: &CudaStream, dx: GpuView, d: RotaryDims) -> Result<()> {
        self.rotary(stream, "rotary_backward", dx, d, -1.0)
    }
}

/// The most scratch (bytes) one attention call takes under `settings`
/// (`Backend::kernel_scratch`): the flash kernels' dk and dv shares and
/// row values for the bf16 problems they take, else the GEMM path's
/// scores, probabilities and accumulators where its plan fits the cap,
/// else none (the tiled kernels).
pub fn attention_scratch_bytes(dims: AttentionDims, settings: ScratchSettings) -> u64 {
    let flash = settings.attention == AttentionBackend::Flash
        && settings.dtype == DType::Bf16
        && flash_attention_dims(dims);
    let bytes = if flash {
        flash_attention_scratch_len(dims) * DType::F32.bytes()
    } else {
        AttentionGemmPlan::for_dtype(dims, settings.dtype, settings.attention_cap)
            .map_or(0, |plan| plan.scratch_bytes(dims))
    };
    bytes as u64
}

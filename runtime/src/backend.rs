//! The `Backend` trait: device memory and the kernels layers need
//! (shared/spec/runtime.md). Layers, the FSDP engine and the optimizer are
//! written once against it; the CPU backend (f32, deterministic loops) is the
//! reference the CUDA backend (bf16 storage, f32 accumulation, cuBLAS, NVRTC)
//! is checked against.
//!
//! Kernels run on the lane whose worker thread calls them (CUDA: the stream
//! bound to that lane's host thread). Every kernel is deterministic: the same
//! inputs give the same bits, whatever else runs.
//!
//! The kernels are at the granularity llm.c uses (a matmul with transpose and
//! accumulate flags, a norm forward and its two backwards, ...): small enough
//! that the CUDA backend maps each to one cuBLAS call or one NVRTC kernel,
//! coarse enough that a layer is a dozen calls.

use crate::error::{Result, RuntimeError};
use hybridgen_dsl::config::ScoreFunction;
use std::ops::Range;

/// How a buffer stores its elements. The CPU keeps everything in f32; the
/// CUDA backend keeps `Compute` buffers (parameters, activations) in bf16 and
/// `F32` buffers (master weights, gradient shards, optimizer moments) in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    Compute,
    F32,
}

/// Device memory and kernels.
pub trait Backend: Send + Sync + 'static {
    /// One device allocation: a flat array of elements.
    type Buf: Send + Sync + 'static;
    /// A read-only view of part of a buffer (`&[f32]` on the CPU).
    type Slice<'a>: Copy + Send
    where
        Self: 'a;
    /// A writable view of part of a buffer (`&mut [f32]` on the CPU).
    type SliceMut<'a>: Send
    where
        Self: 'a;

    /// A short name (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    // ---- memory -----------------------------------------------------------

    /// A zero-filled buffer of `len` elements.
    fn alloc(&self, len: usize, precision: Precision) -> Result<Self::Buf>;
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// `buf[range]`; an error (not a panic) when the range is out of bounds.
    fn slice<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Result<Self::Slice<'a>>;
    fn slice_mut<'a>(
        &self,
        buf: &'a mut Self::Buf,
        range: Range<usize>,
    ) -> Result<Self::SliceMut<'a>>;
    /// Splits a writable view in two at `mid`, as `split_at_mut` does.
    fn split_mut<'a>(
        &self,
        slice: Self::SliceMut<'a>,
        mid: usize,
    ) -> Result<(Self::SliceMut<'a>, Self::SliceMut<'a>)>
    where
        Self: 'a;
    /// Reborrows a writable view as a read-only one.
    fn as_slice<'a, 'b>(&self, slice: &'b Self::SliceMut<'a>) -> Self::Slice<'b>
    where
        'a: 'b;
    fn slice_len(&self, slice: Self::Slice<'_>) -> usize;
    fn upload(&self, src: &[f32], dst: Self::SliceMut<'_>) -> Result<()>;
    fn download(&self, src: Self::Slice<'_>, dst: &mut [f32]) -> Result<()>;
    fn copy(&self, src: Self::Slice<'_>, dst: Self::SliceMut<'_>) -> Result<()>;
    fn fill(&self, dst: Self::SliceMut<'_>, value: f32) -> Result<()>;

    // ---- views --------------------------------------------------------------
    // Layers are written once against this trait, so they take sub-views of
    // views (a weight's row block, one expert's rows) and reborrow writable
    // views to pass them on.

    /// `slice[range]` of a read-only view; an error when out of bounds.
    fn subslice<'a>(&self, slice: Self::Slice<'a>, range: Range<usize>) -> Result<Self::Slice<'a>>
    where
        Self: 'a;
    /// `slice[range]` of a writable view, borrowed for `'b`.
    fn subslice_mut<'a, 'b>(
        &self,
        slice: &'b mut Self::SliceMut<'a>,
        range: Range<usize>,
    ) -> Result<Self::SliceMut<'b>>
    where
        'a: 'b;
    /// A read-only view with a shorter lifetime. Generic code needs it where
    /// views of different lifetimes meet in one struct (e.g. weights and
    /// activations in [`ScanInputs`]): lifetimes of associated types do not
    /// shorten implicitly.
    fn shorten<'a, 'b>(&self, slice: Self::Slice<'a>) -> Self::Slice<'b>
    where
        'a: 'b,
        Self: 'a;
    /// Reborrows a writable view for a shorter lifetime (`&mut *slice`).
    fn reborrow_mut<'a, 'b>(&self, slice: &'b mut Self::SliceMut<'a>) -> Self::SliceMut<'b>
    where
        'a: 'b;
    /// The whole buffer as a read-only view.
    fn view<'a>(&self, buf: &'a Self::Buf) -> Result<Self::Slice<'a>> {
        self.slice(buf, 0..self.buf_len(buf))
    }
    /// The whole buffer as a writable view.
    fn view_mut<'a>(&self, buf: &'a mut Self::Buf) -> Result<Self::SliceMut<'a>> {
        let len = self.buf_len(buf);
        self.slice_mut(buf, 0..len)
    }

    // ---- kernels: dense algebra ---------------------------------------------
    // Every kernel validates the lengths of its views against its dimensions
    // and returns `RuntimeError::InvalidArgument` on a mismatch. Views a
    // kernel writes must not be views a kernel reads (Rust's borrows enforce
    // it on the CPU). Index inputs (token ids, permutations, routing) are host
    // slices: the CUDA backend uploads them (they are small next to the rows
    // they index); the host needs them anyway for all-to-all counts.

    /// `C = op(A) op(B)`, or `C += op(A) op(B)` with `dims.accumulate`, with
    /// `op(A)` `[m, k]` and `op(B)` `[k, n]`, all row-major. `A` is stored
    /// `[m, k]`, or `[k, m]` when `a_trans`; `B` is stored `[k, n]`, or
    /// `[n, k]` when `b_trans`. A linear layer is `y = x W^T` (`b_trans`),
    /// its input gradient `dx = dy W`, its weight gradient `dW += dy^T x`
    /// (`a_trans`, accumulate); see [`MatmulDims::linear`] and friends.
    fn matmul(
        &self,
        a: Self::Slice<'_>,
        b: Self::Slice<'_>,
        c: Self::SliceMut<'_>,
        dims: MatmulDims,
    ) -> Result<()>;

    /// `y += alpha x`.
    fn axpy(&self, alpha: f32, x: Self::Slice<'_>, y: Self::SliceMut<'_>) -> Result<()>;

    /// `x *= alpha`.
    fn scale(&self, x: Self::SliceMut<'_>, alpha: f32) -> Result<()>;

    /// A strided 2-D copy of a block of columns (cudaMemcpy2D): for every row
    /// `r < rows` and column `j < cols`,
    /// `dst[r*dst_stride + dst_offset + j] (+)= src[r*src_stride + src_offset + j]`
    /// (`+=` with `accumulate`). Splits and joins column blocks, e.g. the GQA
    /// `[q | k | v]` rows per KV group.
    fn copy_cols(
        &self,
        src: Self::Slice<'_>,
        dst: Self::SliceMut<'_>,
        dims: CopyCols,
    ) -> Result<()>;

    /// `out[j] += sum_r x[r, j]` over `rows` rows of `cols` columns, rows in
    /// order (a bias gradient).
    fn column_sum(
        &self,
        x: Self::Slice<'_>,
        out: Self::SliceMut<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<()>;

    // ---- kernels: normalisation and activations -----------------------------

    /// RMSNorm over groups: each row of `dim` channels is cut into `groups`
    /// groups of `dim / groups` consecutive channels (1 group is the plain
    /// norm; `G` groups is Mamba's gated norm). Per group
    /// `rstd = 1 / sqrt(mean(x^2) + eps)`, `y = x * rstd * w` (w over all
    /// `dim` channels). Writes `y` `[rows, dim]` and `rstd` `[rows, groups]`
    /// (kept for backward). Computed in f32.
    fn rmsnorm_forward(
        &self,
        x: Self::Slice<'_>,
        weight: Self::Slice<'_>,
        y: Self::SliceMut<'_>,
        rstd: Self::SliceMut<'_>,
        dims: NormDims,
    ) -> Result<()>;

    /// Input gradient of [`Backend::rmsnorm_forward`], accumulated:
    /// per group, with `g = w * dy`,
    /// `dx += rstd * g - x * rstd^3 * mean(g * x)`.
    fn rmsnorm_backward_input(
        &self,
        dy: Self::Slice<'_>,
        x: Self::Slice<'_>,
        weight: Self::Slice<'_>,
        rstd: Self::Slice<'_>,
        dx: Self::SliceMut<'_>,
        dims: NormDims,
    ) -> Result<()>;

    /// Weight gradient of [`Backend::rmsnorm_forward`], accumulated in row
    /// order: `dw[j] += sum_r dy[r, j] * x[r, j] * rstd[r, group(j)]`.
    fn rmsnorm_backward_weight(
        &self,
        dy: Self::Slice<'_>,
        x: Self::Slice<'_>,
        rstd: Self::Slice<'_>,
        dw: Self::SliceMut<'_>,
        dims: NormDims,
    ) -> Result<()>;

    /// `y = f(x)` element-wise for `op` (see [`Unary`]).
    fn unary_forward(&self, op: Unary, x: Self::Slice<'_>, y: Self::SliceMut<'_>) -> Result<()>;

    /// `dx = dy * f'(x)` element-wise (overwrites `dx`).
    fn unary_backward(
        &self,
        op: Unary,
        x: Self::Slice<'_>,
        dy: Self::Slice<'_>,
        dx: Self::SliceMut<'_>,
    ) -> Result<()>;

    /// `y = silu(gate) * up` element-wise: SwiGLU, and Mamba's `y * silu(z)`.
    fn silu_mul_forward(
        &self,
        gate: Self::Slice<'_>,
        up: Self::Slice<'_>,
        y: Self::SliceMut<'_>,
    ) -> Result<()>;

    /// Gradients of [`Backend::silu_mul_forward`] (overwritten):
    /// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)`.
    fn silu_mul_backward(
        &self,
        gate: Self::Slice<'_>,
        up: Self::Slice<'_>,
        dy: Self::Slice<'_>,
        dgate: Self::SliceMut<'_>,
        dup: Self::SliceMut<'_>,
    ) -> Result<()>;

    // ---- kernels: Mamba ------------------------------------------------------

    /// Causal depthwise conv1d along time, restarting at every sequence:
    /// `y[t, c] = bias[c] + sum_{j<K} w[c, j] * x[t - (K-1) + j, c]`, terms
    /// before the sequence start being zero (PyTorch `conv1d` with padding
    /// `K-1`, truncated). `x`, `y` `[rows, channels]`, `w` `[channels, K]`.
    fn conv1d_forward(
        &self,
        x: Self::Slice<'_>,
        weight: Self::Slice<'_>,
        bias: Self::Slice<'_>,
        y: Self::SliceMut<'_>,
        dims: ConvDims,
    ) -> Result<()>;

    /// `dx` of [`Backend::conv1d_forward`] (overwritten):
    /// `dx[s, c] = sum_j w[c, j] * dy[s + (K-1) - j, c]` within the sequence.
    fn conv1d_backward_input(
        &self,
        dy: Self::Slice<'_>,
        weight: Self::Slice<'_>,
        dx: Self::SliceMut<'_>,
        dims: ConvDims,
    ) -> Result<()>;

    /// Weight and bias gradients of [`Backend::conv1d_forward`], accumulated:
    /// `dw[c, j] += sum_t dy[t, c] * x[t - (K-1) + j, c]`,
    /// `dbias[c] += sum_t dy[t, c]`.
    fn conv1d_backward_weight(
        &self,
        dy: Self::Slice<'_>,
        x: Self::Slice<'_>,
        dw: Self::SliceMut<'_>,
        dbias: Self::SliceMut<'_>,
        dims: ConvDims,
    ) -> Result<()>;

    /// The Mamba-2 selective scan (layers.md `M` steps 3-4), per sequence
    /// and head `h` (group `g = h / (H/G)`), state `S` `[P, N]` from zero:
    /// `dt_t = softplus(dt_raw[t, h] + dt_bias[h])`, `A = -exp(A_log[h])`,
    /// `S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`, `y_t = S_t C_t + D[h] x_t`.
    /// `xbc` is `[rows, H*P + 2*G*N]` holding `x | B | C` per row (the
    /// conv output after SiLU), `dt` `[rows, H]` raw, `y` `[rows, H*P]`.
    /// `states` receives the state at the start of every chunk of
    /// `dims.chunk` steps, `[batch, ceil(seq/chunk), H, P, N]`, so backward
    /// can recompute inside a chunk instead of keeping every step's state.
    fn ssd_scan_forward(
        &self,
        inputs: ScanInputs<Self::Slice<'_>>,
        y: Self::SliceMut<'_>,
        states: Self::SliceMut<'_>,
        dims: ScanDims,
    ) -> Result<()>;

    /// Backward of [`Backend::ssd_scan_forward`] given `dy`: overwrites
    /// `grads.xbc` (all of `x | B | C`) and `grads.dt` (w.r.t. the raw `dt`),
    /// and accumulates `grads.a_log` and `grads.d` (`[H]` each). The
    /// `dt_bias` gradient is the column sum of `grads.dt`.
    fn ssd_scan_backward(
        &self,
        inputs: ScanInputs<Self::Slice<'_>>,
        states: Self::Slice<'_>,
        dy: Self::Slice<'_>,
        grads: ScanGrads<Self::SliceMut<'_>>,
        dims: ScanDims,
    ) -> Result<()>;

    // ---- kernels: attention ----------------------------------------------------

    /// Causal softmax attention per sequence with grouped KV heads: query
    /// head `j` uses KV head `j / (heads / kv_heads)`;
    /// `o_t = sum_{u<=t} softmax_u(scale * q_t . k_u) v_u` (f32 softmax).
    /// `q` `[rows, heads, qk_dim]`, `k` `[rows, kv_heads, qk_dim]`,
    /// `v` `[rows, kv_heads, v_dim]`, `out` `[rows, heads, v_dim]`; `lse`
    /// `[rows, heads]` receives each row's log-sum-exp of the scaled scores,
    /// so backward recomputes the probabilities instead of keeping them.
    fn attention_forward(
        &self,
        inputs: AttentionInputs<Self::Slice<'_>>,
        out: Self::SliceMut<'_>,
        lse: Self::SliceMut<'_>,
        dims: AttentionDims,
    ) -> Result<()>;

    /// Backward of [`Backend::attention_forward`] given `dout`; overwrites
    /// `grads.q`, `grads.k`, `grads.v`. With `p` the recomputed probabilities
    /// and `D_t = dout_t . o_t`: `ds_tu = p_tu (dout_t . v_u - D_t)`,
    /// `dq_t = scale sum_u ds_tu k_u`, `dk_u = scale sum_t ds_tu q_t`,
    /// `dv_u = sum_t p_tu dout_t` (sums over the query heads of a group).
    fn attention_backward(
        &self,
        inputs: AttentionInputs<Self::Slice<'_>>,
        out: Self::Slice<'_>,
        lse: Self::Slice<'_>,
        dout: Self::Slice<'_>,
        grads: AttentionInputs<Self::SliceMut<'_>>,
        dims: AttentionDims,
    ) -> Result<()>;

    /// Rotary position embedding (rotate-half), in place on channels
    /// `[offset, offset + dim)` of every head of `x` `[rows, heads, head_stride]`,
    /// position `t` = the row's index inside its sequence. For `i < dim/2`,
    /// `theta = t * base^(-2i/dim)`, `(a, b) = (x[i], x[i + dim/2])` becomes
    /// `(a cos - b sin, b cos + a sin)`.
    fn rotary_forward(&self, x: Self::SliceMut<'_>, dims: RotaryDims) -> Result<()>;

    /// Backward of [`Backend::rotary_forward`], in place: the inverse rotation
    /// `(da, db) <- (da cos + db sin, db cos - da sin)`.
    fn rotary_backward(&self, dx: Self::SliceMut<'_>, dims: RotaryDims) -> Result<()>;

    // ---- kernels: embedding and loss -------------------------------------------

    /// `out[r] = table[ids[r]]`: `table` `[vocab, hidden]`, `out`
    /// `[ids.len(), hidden]`. An id at or past `vocab` is an error.
    fn embedding_forward(
        &self,
        table: Self::Slice<'_>,
        ids: &[u32],
        out: Self::SliceMut<'_>,
        dims: LookupDims,
    ) -> Result<()>;

    /// `dtable[ids[r]] += dout[r]`, rows in order (deterministic; the CUDA
    /// backend sorts rows by id and sums each id's rows in row order).
    fn embedding_backward(
        &self,
        dout: Self::Slice<'_>,
        ids: &[u32],
        dtable: Self::SliceMut<'_>,
        dims: LookupDims,
    ) -> Result<()>;

    /// Softmax cross-entropy in f32, in place: `logits` `[rows, vocab]` becomes
    /// the probabilities `softmax(logits)`; `losses[r] = logsumexp(logits_r)
    /// - logits_r[targets[r]]`, or 0 where `targets[r] == IGNORE_TARGET`.
    fn cross_entropy_forward(
        &self,
        logits: Self::SliceMut<'_>,
        targets: &[u32],
        losses: Self::SliceMut<'_>,
        dims: LossDims,
    ) -> Result<()>;

    /// Backward of [`Backend::cross_entropy_forward`] for loss `scale *
    /// sum_r losses[r]`, in place: the probabilities become
    /// `scale * (p - onehot(target))`, and rows with an ignored target 0.
    fn cross_entropy_backward(
        &self,
        probs: Self::SliceMut<'_>,
        targets: &[u32],
        scale: f32,
        dims: LossDims,
    ) -> Result<()>;

    // ---- kernels: mixture of experts -------------------------------------------

    /// Router scoring and top-k selection (layers.md `E` step 2) on f32
    /// `logits` `[rows, E]`: `scores` = softmax or sigmoid of the logits;
    /// `selected[r*k..][..k]` = the k experts with the largest
    /// `scores + expert_bias` (bias for selection only), best first, ties to
    /// the lower index; `weights[r, j] = scores[r, sel_j] / sum_j scores[r, sel_j]`
    /// (with softmax this equals a softmax over the k selected logits);
    /// `softmax_sum[e] += sum_r softmax(logits_r)[e]`, rows in order, the
    /// load-balancing loss's `T * P_e`. `selected` is a host slice (the CUDA
    /// backend downloads it: the host needs the counts for the all-to-all).
    fn moe_route_forward(
        &self,
        logits: Self::Slice<'_>,
        expert_bias: Option<&[f32]>,
        out: RouteOutputs<Self::SliceMut<'_>>,
        selected: &mut [u32],
        dims: RouteDims,
    ) -> Result<()>;

    /// Backward of the routing: from `d_weights` `[rows, k]` and the
    /// load-balancing term `aux_grad[e]` (= dLoss/d softmax(logits)[r, e],
    /// the same for every row) writes `d_logits` `[rows, E]` (overwritten):
    /// the gradient through the weight normalisation and the score function,
    /// plus `aux_grad` through the softmax.
    fn moe_route_backward(
        &self,
        saved: RouterScores<Self::Slice<'_>>,
        selected: &[u32],
        d_weights: Self::Slice<'_>,
        aux_grad: &[f32],
        d_logits: Self::SliceMut<'_>,
        dims: RouteDims,
    ) -> Result<()>;

    /// `dst[i] = src[index[i]]` for rows of `width` elements.
    fn gather_rows(
        &self,
        src: Self::Slice<'_>,
        index: &[u32],
        dst: Self::SliceMut<'_>,
        width: usize,
    ) -> Result<()>;

    /// `dst[index[i]] = src[i]` for rows of `width` elements; `index` must be
    /// distinct (a permutation), which the CPU backend checks.
    fn scatter_rows(
        &self,
        src: Self::Slice<'_>,
        index: &[u32],
        dst: Self::SliceMut<'_>,
        width: usize,
    ) -> Result<()>;

    /// The MoE combine: `out[t] = sum_{j<k} w[t, j] * rows[positions[t*k + j]]`
    /// (overwritten), `j` in order; `weights` `[tokens, k]`, or all ones when
    /// `None` (the backward of the dispatch gather sums a token's k row
    /// gradients this way).
    fn moe_unpermute(
        &self,
        rows: Self::Slice<'_>,
        weights: Option<Self::Slice<'_>>,
        positions: &[u32],
        out: Self::SliceMut<'_>,
        dims: UnpermuteDims,
    ) -> Result<()>;

    /// Backward of [`Backend::moe_unpermute`] with weights, overwriting
    /// `grads.rows` (`d rows[positions[t*k+j]] = w[t, j] * dout[t]`) and
    /// `grads.weights` (`d w[t, j] = dout[t] . rows[positions[t*k+j]]`).
    fn moe_unpermute_backward(
        &self,
        dout: Self::Slice<'_>,
        rows: Self::Slice<'_>,
        weights: Self::Slice<'_>,
        positions: &[u32],
        grads: UnpermuteGrads<Self::SliceMut<'_>>,
        dims: UnpermuteDims,
    ) -> Result<()>;

    // ---- kernels: optimizer -----------------------------------------------------

    /// One AdamW step on a flat f32 shard (decoupled weight decay, as torch
    /// `AdamW` and Megatron): `p -= lr * wd * p`; `m = b1 m + (1-b1) g`;
    /// `v = b2 v + (1-b2) g^2`; `p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
    fn adam_update(
        &self,
        param: Self::SliceMut<'_>,
        grad: Self::Slice<'_>,
        m: Self::SliceMut<'_>,
        v: Self::SliceMut<'_>,
        step: AdamStep,
    ) -> Result<()>;

    /// One SGD step (torch semantics): `g' = g + wd * p`; with momentum `mu`,
    /// `buf = mu * buf + g'` and `p -= lr * buf`, else `p -= lr * g'`.
    /// `momentum` must be `Some` exactly when `step.momentum != 0`.
    fn sgd_update(
        &self,
        param: Self::SliceMut<'_>,
        grad: Self::Slice<'_>,
        momentum: Option<Self::SliceMut<'_>>,
        step: SgdStep,
    ) -> Result<()>;

    /// `out[b] = sum of x[i]^2` over block `b` of [`NORM_BLOCK`] elements
    /// (the last block may be shorter), each block summed in f64 in order:
    /// the gradient norm's partials, independent of how a buffer is sharded
    /// as long as shards start on a block boundary. `out` is a host slice of
    /// `ceil(len / NORM_BLOCK)` values (the CUDA backend downloads them).
    fn sum_squares_blocks(&self, x: Self::Slice<'_>, out: &mut [f64]) -> Result<()>;
}

// ---- kernel dimensions ------------------------------------------------------

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

/// Dimensions of [`Backend::matmul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_trans: bool,
    pub b_trans: bool,
    pub accumulate: bool,
}

impl MatmulDims {
    /// `y[rows, out] = x[rows, in] W^T` with `W` `[out, in]`.
    pub const fn linear(rows: usize, in_features: usize, out_features: usize) -> Self {
        MatmulDims {
            m: rows,
            n: out_features,
            k: in_features,
            a_trans: false,
            b_trans: true,
            accumulate: false,
        }
    }

    /// `dx[rows, in] (+)= dy[rows, out] W`.
    pub const fn linear_input_grad(
        rows: usize,
        in_features: usize,
        out_features: usize,
        accumulate: bool,
    ) -> Self {
        MatmulDims {
            m: rows,
            n: in_features,
            k: out_features,
            a_trans: false,
            b_trans: false,
            accumulate,
        }
    }

    /// `dW[out, in] += dy[rows, out]^T x[rows, in]`.
    pub const fn linear_weight_grad(rows: usize, in_features: usize, out_features: usize) -> Self {
        MatmulDims {
            m: out_features,
            n: in_features,
            k: rows,
            a_trans: true,
            b_trans: false,
            accumulate: true,
        }
    }
}

/// Dimensions of [`Backend::copy_cols`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyCols {
    pub rows: usize,
    pub cols: usize,
    pub src_stride: usize,
    pub src_offset: usize,
    pub dst_stride: usize,
    pub dst_offset: usize,
    pub accumulate: bool,
}

/// Dimensions of the RMSNorm kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormDims {
    pub rows: usize,
    pub dim: usize,
    /// Groups normalised separately; must divide `dim`.
    pub groups: usize,
    pub eps: f32,
}

/// Element-wise functions of [`Backend::unary_forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    /// `x * sigmoid(x)`.
    Silu,
    /// `x * Phi(x)`, the exact (erf) GELU, as PyTorch's default.
    Gelu,
    /// `relu(x)^2` (Nemotron-H).
    SquaredRelu,
}

/// Dimensions of the conv1d kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub tokens: Tokens,
    pub channels: usize,
    pub kernel: usize,
}

/// Dimensions of the SSD scan kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScanDims {
    pub tokens: Tokens,
    /// H.
    pub heads: usize,
    /// P.
    pub head_dim: usize,
    /// G; divides `heads`.
    pub groups: usize,
    /// N.
    pub state: usize,
    /// Steps between saved states.
    pub chunk: usize,
}

impl ScanDims {
    /// Row width of `xbc`: `H*P + 2*G*N`.
    pub const fn xbc_width(&self) -> usize {
        self.heads * self.head_dim + 2 * self.groups * self.state
    }

    /// Elements of the saved chunk-start states.
    pub const fn states_len(&self) -> usize {
        self.tokens.batch
            * self.tokens.seq.div_ceil(self.chunk)
            * self.heads
            * self.head_dim
            * self.state
    }
}

/// The read-only inputs of the SSD scan.
#[derive(Clone, Copy, Debug)]
pub struct ScanInputs<S> {
    /// `[rows, H*P + 2*G*N]`: `x | B | C`.
    pub xbc: S,
    /// `[rows, H]`, before softplus and bias.
    pub dt: S,
    pub dt_bias: S,
    pub a_log: S,
    /// The skip `D`, `[H]`.
    pub d: S,
}

/// The gradients the SSD scan backward writes.
#[derive(Debug)]
pub struct ScanGrads<M> {
    pub xbc: M,
    pub dt: M,
    pub a_log: M,
    pub d: M,
}

/// Dimensions of the attention kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    pub tokens: Tokens,
    pub heads: usize,
    /// Divides `heads`.
    pub kv_heads: usize,
    pub qk_dim: usize,
    pub v_dim: usize,
    pub scale: f32,
}

/// Query, key and value tensors (inputs, or their gradients).
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<S> {
    pub q: S,
    pub k: S,
    pub v: S,
}

/// Dimensions of the rotary kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RotaryDims {
    pub tokens: Tokens,
    pub heads: usize,
    /// Elements per head in the buffer.
    pub head_stride: usize,
    /// First rotated channel of a head.
    pub offset: usize,
    /// Rotated channels (even).
    pub dim: usize,
    pub base: f32,
}

/// Dimensions of the embedding kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LookupDims {
    pub vocab: usize,
    pub hidden: usize,
}

/// A target that contributes no loss (positions past the end for MTP).
pub const IGNORE_TARGET: u32 = u32::MAX;

/// Dimensions of the cross-entropy kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LossDims {
    pub rows: usize,
    pub vocab: usize,
}

/// Dimensions of the routing kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteDims {
    pub rows: usize,
    pub experts: usize,
    pub top_k: usize,
    pub score: ScoreFunction,
}

/// What [`Backend::moe_route_forward`] writes besides the selection.
#[derive(Debug)]
pub struct RouteOutputs<M> {
    /// `[rows, E]`.
    pub scores: M,
    /// `[rows, k]`.
    pub weights: M,
    /// `[E]`, accumulated.
    pub softmax_sum: M,
}

/// What the routing backward reads from the forward.
#[derive(Clone, Copy, Debug)]
pub struct RouterScores<S> {
    pub logits: S,
    pub scores: S,
}

/// Dimensions of the unpermute kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UnpermuteDims {
    pub tokens: usize,
    pub top_k: usize,
    /// Rows in the permuted buffer (`tokens * top_k`).
    pub rows: usize,
    pub width: usize,
}

/// What [`Backend::moe_unpermute_backward`] writes.
#[derive(Debug)]
pub struct UnpermuteGrads<M> {
    pub rows: M,
    pub weights: M,
}

/// Hyper-parameters of one AdamW step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count, for the bias corrections.
    pub step: u64,
}

/// Hyper-parameters of one SGD step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

/// Block size of [`Backend::sum_squares_blocks`].
pub const NORM_BLOCK: usize = 128;

//! DeepSeek sparse attention (`D` layers, layers.md `D`): the lightning
//! indexer's scores, its causal top-k, the indexer's KL loss against the
//! main attention and its backward, softmax attention over the selected keys
//! (every head reading one shared key/value row a token, the form MLA's
//! absorbed attention takes) and its backward, and the LayerNorm (with
//! bias) of the indexer's keys.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `sparse_attention_methods`,
//! which the trait expands; the check a `check_` function of the kernel's
//! name), and its [`SparseAttentionKernels`] method on each backend
//! (`cpu::ops::sparse_attention`, `cuda::ops::sparse_attention`).

#[cfg(doc)]
use super::Backend;
use super::Tokens;
use crate::error::Result;
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, ensure, product};

/// The padding of a row of selected keys shorter than `topk` (a query with
/// fewer causal keys than `topk` selects all of them).
pub const NO_KEY: u32 = u32::MAX;

/// The floor of the indexer loss's target before its logarithm and of the
/// target's normaliser (Megatron's `INDEXER_LOSS_EPS`).
pub const INDEXER_LOSS_EPS: f32 = 1e-10;

/// Dimensions of the indexer kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IndexerDims {
    pub tokens: Tokens,
    /// ni: indexer heads.
    pub heads: usize,
    /// di: channels of an indexer head (and of the indexer key).
    pub head_dim: usize,
    /// Keys each query selects.
    pub topk: usize,
    /// The factor on the per-head weights (`ni^-1/2 * di^-1/2`).
    pub weight_scale: f32,
}

/// Dimensions of the indexer loss: the indexer's and the main attention's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IndexerLossDims {
    pub tokens: Tokens,
    /// Keys each query selects (the row width of the indices).
    pub topk: usize,
    /// The main attention's query heads (all reading one shared key row a
    /// token).
    pub heads: usize,
    /// The main attention's query/key width per head (and of the key
    /// row).
    pub qk_dim: usize,
    /// The main attention's softmax scale.
    pub scale: f32,
    /// The loss coefficient (`dsa.indexer_loss_coeff`).
    pub coeff: f32,
    /// Both distributions over the selected keys only (else over every
    /// causal key).
    pub sparse: bool,
}

/// Dimensions of the sparse attention kernels over one shared key/value
/// row a token (multi-query attention, the form MLA attends in once its key
/// up-projection is absorbed into the queries).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparseMqaDims {
    pub tokens: Tokens,
    /// Query heads, all reading the same key/value row of a token.
    pub heads: usize,
    /// Channels of a query head and of the shared key row.
    pub qk_dim: usize,
    /// Channels of the value: the key row's first `v_dim` (at most
    /// `qk_dim`).
    pub v_dim: usize,
    /// Keys each query selects (the row width of the indices).
    pub topk: usize,
    pub scale: f32,
}

/// Dimensions of the LayerNorm kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormDims {
    pub rows: usize,
    pub width: usize,
    pub eps: f32,
}

/// The indexer's inputs: its queries, its keys and its per-head weights.
#[derive(Clone, Copy, Debug)]
pub struct IndexerInputs<S> {
    /// `[rows, ni, di]`.
    pub q: S,
    /// `[rows, di]`: one key a token, shared by the heads.
    pub k: S,
    /// `[rows, ni]`: the weights before `weight_scale`.
    pub weights: S,
}

/// The sparse attention kernels as a backend implements them: each runs
/// once [`Backend`]'s method of the same name (without `_unchecked`) has
/// checked its arguments here, so their dtypes and lengths are right.
pub trait SparseAttentionKernels<Buf: DeviceBuffer> {
    fn indexer_scores_unchecked(
        &self,
        inputs: IndexerInputs<View<'_, Buf>>,
        scores: ViewMut<'_, Buf>,
        dims: IndexerDims,
    ) -> Result<()>;

    fn indexer_topk_unchecked(
        &self,
        scores: View<'_, Buf>,
        indices: ViewMut<'_, Buf>,
        dims: IndexerDims,
    ) -> Result<()>;

    #[allow(clippy::too_many_arguments)]
    fn indexer_loss_unchecked(
        &self,
        scores: View<'_, Buf>,
        q: View<'_, Buf>,
        k: View<'_, Buf>,
        indices: View<'_, Buf>,
        loss: ViewMut<'_, Buf>,
        d_scores: ViewMut<'_, Buf>,
        dims: IndexerLossDims,
    ) -> Result<()>;

    fn indexer_backward_unchecked(
        &self,
        inputs: IndexerInputs<View<'_, Buf>>,
        d_scores: View<'_, Buf>,
        grads: IndexerInputs<ViewMut<'_, Buf>>,
        dims: IndexerDims,
        scale: f32,
    ) -> Result<()>;

    fn sparse_mqa_forward_unchecked(
        &self,
        q: View<'_, Buf>,
        kv: View<'_, Buf>,
        indices: View<'_, Buf>,
        out: ViewMut<'_, Buf>,
        lse: ViewMut<'_, Buf>,
        dims: SparseMqaDims,
    ) -> Result<()>;

    #[allow(clippy::too_many_arguments)]
    fn sparse_mqa_backward_unchecked(
        &self,
        q: View<'_, Buf>,
        kv: View<'_, Buf>,
        indices: View<'_, Buf>,
        out: View<'_, Buf>,
        lse: View<'_, Buf>,
        dout: View<'_, Buf>,
        dq: ViewMut<'_, Buf>,
        dkv: ViewMut<'_, Buf>,
        dims: SparseMqaDims,
    ) -> Result<()>;

    fn layer_norm_forward_unchecked(
        &self,
        x: View<'_, Buf>,
        weight: View<'_, Buf>,
        bias: View<'_, Buf>,
        y: ViewMut<'_, Buf>,
        stats: ViewMut<'_, Buf>,
        dims: LayerNormDims,
    ) -> Result<()>;

    fn layer_norm_backward_unchecked(
        &self,
        x: View<'_, Buf>,
        weight: View<'_, Buf>,
        stats: View<'_, Buf>,
        dy: View<'_, Buf>,
        dx: ViewMut<'_, Buf>,
        dims: LayerNormDims,
    ) -> Result<()>;

    fn layer_norm_weight_grad_unchecked(
        &self,
        x: View<'_, Buf>,
        stats: View<'_, Buf>,
        dy: View<'_, Buf>,
        d_weight: ViewMut<'_, Buf>,
        d_bias: ViewMut<'_, Buf>,
        dims: LayerNormDims,
    ) -> Result<()>;
}

impl<T: DeviceBuffer> IndexerInputs<View<'_, T>> {
    /// The inputs' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> IndexerInputs<Operand> {
        IndexerInputs {
            q: self.q.operand(),
            k: self.k.operand(),
            weights: self.weights.operand(),
        }
    }
}

impl<T: DeviceBuffer> IndexerInputs<ViewMut<'_, T>> {
    /// The gradients' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> IndexerInputs<Operand> {
        IndexerInputs {
            q: self.q.operand(),
            k: self.k.operand(),
            weights: self.weights.operand(),
        }
    }
}

/// `[rows, seq]`: the scores and their gradient, a row a query and a column
/// a key position of its sequence.
fn score_len(kernel: &str, tokens: Tokens) -> Result<usize> {
    product(kernel, &[tokens.rows()?, tokens.seq])
}

/// A positive `topk`.
fn check_topk(kernel: &str, topk: usize) -> Result<()> {
    ensure(topk > 0, || {
        format!("{kernel}: top-k is 0; select at least one key")
    })
}

/// The indexer's inputs (float, the lengths `d` gives); gives the rows.
fn check_indexer_inputs(
    kernel: &str,
    inputs: &IndexerInputs<Operand>,
    d: IndexerDims,
) -> Result<usize> {
    for (name, view) in [
        ("q", inputs.q),
        ("k", inputs.k),
        ("weights", inputs.weights),
    ] {
        view.float(kernel, name)?;
    }
    ensure(d.heads > 0 && d.head_dim > 0, || {
        format!(
            "{kernel}: {} indexer heads of {} channels; both must be at least 1",
            d.heads, d.head_dim
        )
    })?;
    check_topk(kernel, d.topk)?;
    let rows = d.tokens.rows()?;
    inputs
        .q
        .has_len(kernel, "q", product(kernel, &[rows, d.heads, d.head_dim])?)?;
    inputs
        .k
        .has_len(kernel, "k", product(kernel, &[rows, d.head_dim])?)?;
    inputs
        .weights
        .has_len(kernel, "weights", product(kernel, &[rows, d.heads])?)?;
    Ok(rows)
}

/// [`Backend::indexer_scores`]'s arguments.
pub fn check_indexer_scores(
    inputs: IndexerInputs<Operand>,
    scores: Operand,
    dims: IndexerDims,
) -> Result<()> {
    let k = "indexer_scores";
    check_indexer_inputs(k, &inputs, dims)?;
    scores.exactly(DType::F32, k, "scores")?;
    scores.has_len(k, "scores", score_len(k, dims.tokens)?)
}

/// [`Backend::indexer_topk`]'s arguments.
pub fn check_indexer_topk(scores: Operand, indices: Operand, dims: IndexerDims) -> Result<()> {
    let k = "indexer_topk";
    scores.exactly(DType::F32, k, "scores")?;
    indices.exactly(DType::U32, k, "indices")?;
    check_topk(k, dims.topk)?;
    scores.has_len(k, "scores", score_len(k, dims.tokens)?)?;
    indices.has_len(k, "indices", product(k, &[dims.tokens.rows()?, dims.topk])?)
}

/// [`Backend::indexer_loss`]'s arguments.
pub fn check_indexer_loss(
    scores: Operand,
    q: Operand,
    key: Operand,
    indices: Operand,
    loss: Operand,
    d_scores: Operand,
    dims: IndexerLossDims,
) -> Result<()> {
    let k = "indexer_loss";
    scores.exactly(DType::F32, k, "scores")?;
    q.float(k, "q")?;
    key.float(k, "k")?;
    indices.exactly(DType::U32, k, "indices")?;
    loss.exactly(DType::F32, k, "loss")?;
    d_scores.exactly(DType::F32, k, "d_scores")?;
    check_topk(k, dims.topk)?;
    ensure(dims.heads > 0 && dims.qk_dim > 0, || {
        format!(
            "{k}: {} attention heads of {} channels; both must be at least 1",
            dims.heads, dims.qk_dim
        )
    })?;
    let rows = dims.tokens.rows()?;
    let scores_len = score_len(k, dims.tokens)?;
    scores.has_len(k, "scores", scores_len)?;
    q.has_len(k, "q", product(k, &[rows, dims.heads, dims.qk_dim])?)?;
    key.has_len(k, "k", product(k, &[rows, dims.qk_dim])?)?;
    indices.has_len(k, "indices", product(k, &[rows, dims.topk])?)?;
    loss.has_len(k, "loss", rows)?;
    d_scores.has_len(k, "d_scores", scores_len)
}

/// [`Backend::indexer_backward`]'s arguments.
pub fn check_indexer_backward(
    inputs: IndexerInputs<Operand>,
    d_scores: Operand,
    grads: IndexerInputs<Operand>,
    dims: IndexerDims,
) -> Result<()> {
    let k = "indexer_backward";
    check_indexer_inputs(k, &inputs, dims)?;
    d_scores.exactly(DType::F32, k, "d_scores")?;
    for (name, view) in [
        ("dq", grads.q),
        ("dk", grads.k),
        ("d_weights", grads.weights),
    ] {
        view.float(k, name)?;
    }
    d_scores.has_len(k, "d_scores", score_len(k, dims.tokens)?)?;
    grads.q.has_len(k, "dq", inputs.q.len)?;
    grads.k.has_len(k, "dk", inputs.k.len)?;
    grads.weights.has_len(k, "d_weights", inputs.weights.len)
}

/// `q`, `kv`, the indices, `out` and `lse` against `d`.
fn check_sparse_mqa(
    kernel: &str,
    d: SparseMqaDims,
    q: Operand,
    kv: Operand,
    indices: Operand,
    out: Operand,
    lse: Operand,
) -> Result<()> {
    for (name, view) in [("q", q), ("kv", kv), ("out", out)] {
        view.float(kernel, name)?;
    }
    indices.exactly(DType::U32, kernel, "indices")?;
    lse.exactly(DType::F32, kernel, "lse")?;
    check_topk(kernel, d.topk)?;
    ensure(d.heads > 0 && d.qk_dim > 0 && d.v_dim > 0, || {
        format!(
            "{kernel}: {} heads of {} (q/k) and {} (v) channels; each must be at least 1",
            d.heads, d.qk_dim, d.v_dim
        )
    })?;
    ensure(d.v_dim <= d.qk_dim, || {
        format!(
            "{kernel}: the value is the key row's first {} channels, but the row has {}",
            d.v_dim, d.qk_dim
        )
    })?;
    let rows = d.tokens.rows()?;
    q.has_len(kernel, "q", product(kernel, &[rows, d.heads, d.qk_dim])?)?;
    kv.has_len(kernel, "kv", product(kernel, &[rows, d.qk_dim])?)?;
    indices.has_len(kernel, "indices", product(kernel, &[rows, d.topk])?)?;
    out.has_len(kernel, "out", product(kernel, &[rows, d.heads, d.v_dim])?)?;
    lse.has_len(kernel, "lse", product(kernel, &[rows, d.heads])?)
}

/// [`Backend::sparse_mqa_forward`]'s arguments.
pub fn check_sparse_mqa_forward(
    q: Operand,
    kv: Operand,
    indices: Operand,
    out: Operand,
    lse: Operand,
    dims: SparseMqaDims,
) -> Result<()> {
    check_sparse_mqa("sparse_mqa_forward", dims, q, kv, indices, out, lse)
}

/// [`Backend::sparse_mqa_backward`]'s arguments.
#[allow(clippy::too_many_arguments)]
pub fn check_sparse_mqa_backward(
    q: Operand,
    kv: Operand,
    indices: Operand,
    out: Operand,
    lse: Operand,
    dout: Operand,
    dq: Operand,
    dkv: Operand,
    dims: SparseMqaDims,
) -> Result<()> {
    let k = "sparse_mqa_backward";
    for (name, view) in [("dout", dout), ("dq", dq), ("dkv", dkv)] {
        view.float(k, name)?;
    }
    check_sparse_mqa(k, dims, q, kv, indices, out, lse)?;
    dout.has_len(k, "dout", out.len)?;
    dq.has_len(k, "dq", q.len)?;
    dkv.has_len(k, "dkv", kv.len)
}

/// A LayerNorm's `[rows, width]` view, its `[width]` parameters and its
/// `[rows, 2]` f32 statistics.
fn check_layer_norm(
    kernel: &str,
    d: LayerNormDims,
    named: &[(&str, Operand, usize)],
) -> Result<()> {
    ensure(d.width > 0, || format!("{kernel}: the width is 0"))?;
    ensure(d.eps.is_finite() && d.eps >= 0.0, || {
        format!(
            "{kernel}: epsilon {} is not a finite number of at least 0",
            d.eps
        )
    })?;
    let (rows, width) = (d.rows, d.width);
    for &(name, view, factor) in named {
        let want = match factor {
            0 => width,
            2 => product(kernel, &[rows, 2])?,
            _ => product(kernel, &[rows, width])?,
        };
        view.has_len(kernel, name, want)?;
    }
    Ok(())
}

/// [`Backend::layer_norm_forward`]'s arguments.
pub fn check_layer_norm_forward(
    x: Operand,
    weight: Operand,
    bias: Operand,
    y: Operand,
    stats: Operand,
    dims: LayerNormDims,
) -> Result<()> {
    let k = "layer_norm_forward";
    for (name, view) in [("x", x), ("weight", weight), ("bias", bias), ("y", y)] {
        view.float(k, name)?;
    }
    stats.exactly(DType::F32, k, "stats")?;
    check_layer_norm(
        k,
        dims,
        &[
            ("x", x, 1),
            ("weight", weight, 0),
            ("bias", bias, 0),
            ("y", y, 1),
            ("stats", stats, 2),
        ],
    )
}

/// [`Backend::layer_norm_backward`]'s arguments.
pub fn check_layer_norm_backward(
    x: Operand,
    weight: Operand,
    stats: Operand,
    dy: Operand,
    dx: Operand,
    dims: LayerNormDims,
) -> Result<()> {
    let k = "layer_norm_backward";
    for (name, view) in [("x", x), ("weight", weight), ("dy", dy), ("dx", dx)] {
        view.float(k, name)?;
    }
    stats.exactly(DType::F32, k, "stats")?;
    check_layer_norm(
        k,
        dims,
        &[
            ("x", x, 1),
            ("weight", weight, 0),
            ("stats", stats, 2),
            ("dy", dy, 1),
            ("dx", dx, 1),
        ],
    )
}

/// [`Backend::layer_norm_weight_grad`]'s arguments.
pub fn check_layer_norm_weight_grad(
    x: Operand,
    stats: Operand,
    dy: Operand,
    d_weight: Operand,
    d_bias: Operand,
    dims: LayerNormDims,
) -> Result<()> {
    let k = "layer_norm_weight_grad";
    for (name, view) in [
        ("x", x),
        ("dy", dy),
        ("d_weight", d_weight),
        ("d_bias", d_bias),
    ] {
        view.float(k, name)?;
    }
    stats.exactly(DType::F32, k, "stats")?;
    check_layer_norm(
        k,
        dims,
        &[
            ("x", x, 1),
            ("stats", stats, 2),
            ("dy", dy, 1),
            ("d_weight", d_weight, 0),
            ("d_bias", d_bias, 0),
        ],
    )
}

/// [`Backend`]'s sparse attention methods: each checks its arguments, then
/// runs its [`SparseAttentionKernels`] method.
macro_rules! sparse_attention_methods {
    () => {
        /// The lightning indexer's scores, in f32: for query row `r` (token
        /// `t` of its sequence) and key position `u <= t` of the same
        /// sequence, `scores[r, u] = sum_h weight_scale * weights[r, h] *
        /// relu(q[r, h] . k[u])`; `scores[r, u] = -inf` for `u > t` (the
        /// causal mask). `q` `[rows, ni, di]`, `k` `[rows, di]`, `weights`
        /// `[rows, ni]`, `scores` `[rows, seq]` f32.
        fn indexer_scores(
            &self,
            inputs: IndexerInputs<Slice<'_, Self>>,
            scores: SliceMut<'_, Self>,
            dims: IndexerDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_indexer_scores(
                inputs.operands(),
                scores.operand(),
                dims,
            )?;
            self.indexer_scores_unchecked(inputs, scores, dims)
        }

        /// Each query's top `dims.topk` causal keys by score: the `topk`
        /// highest of `scores[r, 0..=t]`, ties to the lower key position,
        /// written in ascending key order; a query with `t + 1 <= topk`
        /// causal keys selects all of them and pads with `NO_KEY`.
        /// `scores` f32 `[rows, seq]`, `indices` u32 `[rows, topk]`.
        fn indexer_topk(
            &self,
            scores: Slice<'_, Self>,
            indices: SliceMut<'_, Self>,
            dims: IndexerDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_indexer_topk(
                scores.operand(),
                indices.operand(),
                dims,
            )?;
            self.indexer_topk_unchecked(scores, indices, dims)
        }

        /// The indexer's KL loss for each query row, in f32, over the row's
        /// valid keys `V` (every causal key, or with `dims.sparse` the
        /// selected ones): the target `p_t[u] = sum_h softmax_V(scale *
        /// q[r, h] . k[u])` normalised to sum 1 (its sum floored at
        /// `INDEXER_LOSS_EPS`), the indexer's `log p_i = log_softmax_V(
        /// scores[r])`, `loss[r] = coeff / rows * sum_V p_t (log max(p_t,
        /// INDEXER_LOSS_EPS) - log p_i)`, and `d_scores[r, u] = coeff /
        /// rows * (p_i[u] - p_t[u])` on `V`, 0 elsewhere: the gradient of
        /// the loss with respect to the scores, the target held fixed.
        /// `q` `[rows, heads, qk_dim]` and the key rows `k` `[rows,
        /// qk_dim]` shared by the heads (the main attention's, `D`'s
        /// absorbed queries and latent rows), `indices` u32 `[rows, topk]`, `loss` f32 `[rows]`,
        /// `scores` and `d_scores` f32 `[rows, seq]`.
        #[allow(clippy::too_many_arguments)]
        fn indexer_loss(
            &self,
            scores: Slice<'_, Self>,
            q: Slice<'_, Self>,
            k: Slice<'_, Self>,
            indices: Slice<'_, Self>,
            loss: SliceMut<'_, Self>,
            d_scores: SliceMut<'_, Self>,
            dims: IndexerLossDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_indexer_loss(
                scores.operand(),
                q.operand(),
                k.operand(),
                indices.operand(),
                loss.operand(),
                d_scores.operand(),
                dims,
            )?;
            self.indexer_loss_unchecked(scores, q, k, indices, loss, d_scores, dims)
        }

        /// Backward of [`Backend::indexer_scores`] given `scale *
        /// d_scores` (only causal entries are read): overwrites `grads.q`,
        /// `grads.k` and `grads.weights` (w.r.t. the weights before
        /// `weight_scale`). The ReLU passes no gradient where `q . k <= 0`.
        fn indexer_backward(
            &self,
            inputs: IndexerInputs<Slice<'_, Self>>,
            d_scores: Slice<'_, Self>,
            grads: IndexerInputs<SliceMut<'_, Self>>,
            dims: IndexerDims,
            scale: f32,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_indexer_backward(
                inputs.operands(),
                d_scores.operand(),
                grads.operands(),
                dims,
            )?;
            self.indexer_backward_unchecked(inputs, d_scores, grads, dims, scale)
        }

        /// Softmax attention of each query over its selected keys, every
        /// head reading one key/value row a token (multi-query): `o[r, h] =
        /// sum_{u in S_r} softmax_u(scale * q[r, h] . kv[u]) kv[u, ..v_dim]`
        /// (f32 softmax), `S_r` the row's indices that are not `NO_KEY` and
        /// not after the query (the causal mask), in ascending key order.
        /// `q` `[rows, heads, qk_dim]`, `kv` `[rows, qk_dim]` (the value is
        /// its first `v_dim` channels), `indices` u32 `[rows, topk]` (key
        /// positions within the sequence), `out` `[rows, heads, v_dim]`,
        /// `lse` f32 `[rows, heads]` (the log-sum-exp of the selected scaled
        /// scores; `-inf` and a zero output for a row that selects nothing).
        fn sparse_mqa_forward(
            &self,
            q: Slice<'_, Self>,
            kv: Slice<'_, Self>,
            indices: Slice<'_, Self>,
            out: SliceMut<'_, Self>,
            lse: SliceMut<'_, Self>,
            dims: SparseMqaDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_sparse_mqa_forward(
                q.operand(),
                kv.operand(),
                indices.operand(),
                out.operand(),
                lse.operand(),
                dims,
            )?;
            self.sparse_mqa_forward_unchecked(q, kv, indices, out, lse, dims)
        }

        /// Backward of [`Backend::sparse_mqa_forward`] given `dout`,
        /// recomputing the probabilities from `lse` (`p = exp(scale q .
        /// kv - lse)`, `ds = p (dout . v - dout . out) scale`): overwrites
        /// `dq` `[rows, heads, qk_dim]` and `dkv` `[rows, qk_dim]`, the
        /// key's and the value's gradients of the shared row summed
        /// (`dkv[u] = sum ds q + [sum p dout | 0]`).
        #[allow(clippy::too_many_arguments)]
        fn sparse_mqa_backward(
            &self,
            q: Slice<'_, Self>,
            kv: Slice<'_, Self>,
            indices: Slice<'_, Self>,
            out: Slice<'_, Self>,
            lse: Slice<'_, Self>,
            dout: Slice<'_, Self>,
            dq: SliceMut<'_, Self>,
            dkv: SliceMut<'_, Self>,
            dims: SparseMqaDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_sparse_mqa_backward(
                q.operand(),
                kv.operand(),
                indices.operand(),
                out.operand(),
                lse.operand(),
                dout.operand(),
                dq.operand(),
                dkv.operand(),
                dims,
            )?;
            self.sparse_mqa_backward_unchecked(q, kv, indices, out, lse, dout, dq, dkv, dims)
        }

        /// LayerNorm with bias, in f32: per row `mean = sum x / width`,
        /// `rstd = 1 / sqrt(sum (x - mean)^2 / width + eps)`,
        /// `y = (x - mean) * rstd * weight + bias`; `stats` f32 `[rows, 2]`
        /// receives `(mean, rstd)`.
        fn layer_norm_forward(
            &self,
            x: Slice<'_, Self>,
            weight: Slice<'_, Self>,
            bias: Slice<'_, Self>,
            y: SliceMut<'_, Self>,
            stats: SliceMut<'_, Self>,
            dims: LayerNormDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_layer_norm_forward(
                x.operand(),
                weight.operand(),
                bias.operand(),
                y.operand(),
                stats.operand(),
                dims,
            )?;
            self.layer_norm_forward_unchecked(x, weight, bias, y, stats, dims)
        }

        /// The input gradient of [`Backend::layer_norm_forward`] given `dy`
        /// (overwrites `dx`): with `xh = (x - mean) * rstd` and
        /// `g = dy * weight`, `dx = rstd * (g - mean(g) - xh * mean(g xh))`.
        fn layer_norm_backward(
            &self,
            x: Slice<'_, Self>,
            weight: Slice<'_, Self>,
            stats: Slice<'_, Self>,
            dy: Slice<'_, Self>,
            dx: SliceMut<'_, Self>,
            dims: LayerNormDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_layer_norm_backward(
                x.operand(),
                weight.operand(),
                stats.operand(),
                dy.operand(),
                dx.operand(),
                dims,
            )?;
            self.layer_norm_backward_unchecked(x, weight, stats, dy, dx, dims)
        }

        /// The parameter gradients of [`Backend::layer_norm_forward`],
        /// accumulated: `d_weight += sum_rows dy * xh`, `d_bias += sum_rows
        /// dy`, rows in order.
        fn layer_norm_weight_grad(
            &self,
            x: Slice<'_, Self>,
            stats: Slice<'_, Self>,
            dy: Slice<'_, Self>,
            d_weight: SliceMut<'_, Self>,
            d_bias: SliceMut<'_, Self>,
            dims: LayerNormDims,
        ) -> Result<()> {
            $crate::backend::sparse_attention::check_layer_norm_weight_grad(
                x.operand(),
                stats.operand(),
                dy.operand(),
                d_weight.operand(),
                d_bias.operand(),
                dims,
            )?;
            self.layer_norm_weight_grad_unchecked(x, stats, dy, d_weight, d_bias, dims)
        }
    };
}
pub(super) use sparse_attention_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_shapes_are_errors() {
        let dims = IndexerDims {
            tokens: Tokens::new(2, 5),
            heads: 3,
            head_dim: 4,
            topk: 2,
            weight_scale: 0.5,
        };
        let f32s = |len| Operand::new(len, DType::F32);
        let inputs = IndexerInputs {
            q: f32s(10 * 12),
            k: f32s(10 * 4),
            weights: f32s(10 * 3),
        };
        check_indexer_scores(inputs, f32s(50), dims).unwrap();
        assert!(check_indexer_scores(inputs, f32s(49), dims).is_err());
        assert!(check_indexer_scores(inputs, Operand::new(50, DType::Bf16), dims).is_err());
        let no_topk = IndexerDims { topk: 0, ..dims };
        assert!(check_indexer_scores(inputs, f32s(50), no_topk).is_err());
        let u32s = Operand::new(20, DType::U32);
        check_indexer_topk(f32s(50), u32s, dims).unwrap();
        assert!(check_indexer_topk(f32s(50), f32s(20), dims).is_err());
        let ln = LayerNormDims {
            rows: 3,
            width: 4,
            eps: 1e-5,
        };
        check_layer_norm_forward(f32s(12), f32s(4), f32s(4), f32s(12), f32s(6), ln).unwrap();
        assert!(
            check_layer_norm_forward(f32s(12), f32s(4), f32s(3), f32s(12), f32s(6), ln).is_err()
        );
    }
}

//! Mixture of experts: routing, the dispatch permutation, the
//! load-balancing loss, the per-expert load of aux-loss-free balancing, and
//! the row moves between tokens and experts.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `moe_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`MoeKernels`] method on each backend (`cpu::ops::moe`,
//! `cuda::ops::moe`). Selected experts, counts and positions are device
//! data: a backend checks their range where they lie (see each method).

#[cfg(doc)]
use super::Backend;
use crate::error::Result;
use crate::view::{
    DType, DeviceBuffer, Operand, View, ViewMut, as_u32, ensure, product, same_dtype,
};
use hybridgen_dsl::config::ScoreFunction;

/// Dimensions of the routing kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteDims {
    pub rows: usize,
    pub experts: usize,
    pub top_k: usize,
    pub score: ScoreFunction,
    /// The factor on the routing weights (Megatron's
    /// `moe_router_topk_scaling_factor`; 1 when the model sets none).
    pub topk_scale: f32,
}

/// The expert bias of a routing (aux-loss-free balancing).
#[derive(Clone, Copy, Debug)]
pub struct ExpertBias<S, M> {
    /// `[E]` f32: added to the scores for the selection only.
    pub bias: S,
    /// `[rows, k]` u32: each row's top-k of the scores without the bias,
    /// best first (the load-balancing loss counts these).
    pub unbiased: M,
}

/// What [`Backend::moe_route_forward`] writes besides the selection.
#[derive(Clone, Copy, Debug)]
pub struct RouteOutputs<M> {
    /// `[rows, E]`, f32.
    pub scores: M,
    /// `[rows, k]`, f32.
    pub weights: M,
    /// `[E]`, f32, accumulated: the normalised scores summed over rows;
    /// `None` where no load-balancing loss reads them (its coefficient 0),
    /// so nothing computes them.
    pub prob_sum: Option<M>,
}

/// What the routing backward reads from the forward.
#[derive(Clone, Copy, Debug)]
pub struct RouterScores<S> {
    pub logits: S,
    pub scores: S,
}

/// The (token, k-slot) pairs of one routing: `tokens * top_k` slots over
/// `experts` experts (the histogram and the dispatch sort).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RoutedSlots {
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
}

/// What [`Backend::moe_sort_by_expert`] writes, `[tokens * k]` each.
#[derive(Clone, Copy, Debug)]
pub struct ExpertOrder<M> {
    /// `positions[t*k + j]`: the send row of token `t`'s k-slot `j`.
    pub positions: M,
    /// `sources[row]`: the token a send row carries.
    pub sources: M,
}

/// The shape of the received-counts table of [`Backend::moe_expert_major_order`]:
/// `ranks` source ranks by `local_experts` experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReceivedDims {
    pub ranks: usize,
    pub local_experts: usize,
}

/// Dimensions of the load-balancing loss kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AuxLossDims {
    pub slots: RoutedSlots,
    /// The loss coefficient (`moe.aux_loss_coeff`).
    pub coeff: f32,
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
#[derive(Clone, Copy, Debug)]
pub struct UnpermuteGrads<M> {
    pub rows: M,
    pub weights: M,
}

/// The MoE kernels as a backend implements them: each runs once
/// [`Backend`]'s method of the same name (without `_unchecked`) has checked
/// its arguments here, so their dtypes and lengths are right.
pub trait MoeKernels<Buf: DeviceBuffer> {
    fn moe_route_forward_unchecked(
        &self,
        logits: View<'_, Buf>,
        expert_bias: Option<ExpertBias<View<'_, Buf>, ViewMut<'_, Buf>>>,
        out: RouteOutputs<ViewMut<'_, Buf>>,
        selected: ViewMut<'_, Buf>,
        dims: RouteDims,
    ) -> Result<()>;

    fn moe_route_backward_unchecked(
        &self,
        saved: RouterScores<View<'_, Buf>>,
        selected: View<'_, Buf>,
        d_weights: View<'_, Buf>,
        aux_grad: View<'_, Buf>,
        d_logits: ViewMut<'_, Buf>,
        dims: RouteDims,
    ) -> Result<()>;

    fn moe_expert_counts_unchecked(
        &self,
        selected: View<'_, Buf>,
        counts: ViewMut<'_, Buf>,
        slots: RoutedSlots,
    ) -> Result<()>;

    fn moe_sort_by_expert_unchecked(
        &self,
        selected: View<'_, Buf>,
        counts: View<'_, Buf>,
        out: ExpertOrder<ViewMut<'_, Buf>>,
        slots: RoutedSlots,
    ) -> Result<()>;

    fn moe_expert_major_order_unchecked(
        &self,
        recv_counts: View<'_, Buf>,
        order: ViewMut<'_, Buf>,
        dims: ReceivedDims,
    ) -> Result<()>;

    fn moe_aux_loss_forward_unchecked(
        &self,
        counts: View<'_, Buf>,
        prob_sum: View<'_, Buf>,
        loss: ViewMut<'_, Buf>,
        dims: AuxLossDims,
    ) -> Result<()>;

    fn moe_aux_loss_backward_unchecked(
        &self,
        counts: View<'_, Buf>,
        aux_grad: ViewMut<'_, Buf>,
        dims: AuxLossDims,
        scale: f32,
    ) -> Result<()>;

    fn moe_load_accumulate_unchecked(
        &self,
        counts: View<'_, Buf>,
        load: ViewMut<'_, Buf>,
    ) -> Result<()>;

    fn gather_rows_unchecked(
        &self,
        src: View<'_, Buf>,
        index: View<'_, Buf>,
        dst: ViewMut<'_, Buf>,
        width: usize,
    ) -> Result<()>;

    fn scatter_rows_unchecked(
        &self,
        src: View<'_, Buf>,
        index: View<'_, Buf>,
        dst: ViewMut<'_, Buf>,
        width: usize,
    ) -> Result<()>;

    fn moe_unpermute_unchecked(
        &self,
        rows: View<'_, Buf>,
        weights: Option<View<'_, Buf>>,
        positions: View<'_, Buf>,
        out: ViewMut<'_, Buf>,
        dims: UnpermuteDims,
    ) -> Result<()>;

    fn moe_combine_unchecked(
        &self,
        rows: View<'_, Buf>,
        weights: View<'_, Buf>,
        positions: View<'_, Buf>,
        shared: Option<View<'_, Buf>>,
        x: ViewMut<'_, Buf>,
        dims: UnpermuteDims,
    ) -> Result<()>;

    fn moe_unpermute_backward_unchecked(
        &self,
        dout: View<'_, Buf>,
        rows: View<'_, Buf>,
        weights: View<'_, Buf>,
        positions: View<'_, Buf>,
        grads: UnpermuteGrads<ViewMut<'_, Buf>>,
        dims: UnpermuteDims,
    ) -> Result<()>;
}

/// The router's f32 logits `[rows, E]` and a top-k in `1..=E`.
fn check_route(kernel: &str, logits: Operand, d: RouteDims) -> Result<()> {
    logits.exactly(DType::F32, kernel, "logits")?;
    ensure(d.top_k >= 1 && d.top_k <= d.experts, || {
        format!(
            "{kernel}: top-k {} must be in 1..={} experts",
            d.top_k, d.experts
        )
    })?;
    logits.has_len(kernel, "logits", product(kernel, &[d.rows, d.experts])?)?;
    as_u32(kernel, "experts", d.experts).map(|_| ())
}

/// [`Backend::moe_route_forward`]'s arguments.
pub fn check_moe_route_forward(
    logits: Operand,
    expert_bias: Option<ExpertBias<Operand, Operand>>,
    out: RouteOutputs<Operand>,
    selected: Operand,
    d: RouteDims,
) -> Result<()> {
    let k = "moe_route_forward";
    check_route(k, logits, d)?;
    for (name, view) in [("scores", out.scores), ("weights", out.weights)] {
        view.exactly(DType::F32, k, name)?;
    }
    if let Some(prob_sum) = out.prob_sum {
        prob_sum.exactly(DType::F32, k, "prob_sum")?;
        prob_sum.has_len(k, "prob_sum", d.experts)?;
    }
    selected.exactly(DType::U32, k, "selected")?;
    let picks = product(k, &[d.rows, d.top_k])?;
    out.scores.has_len(k, "scores", logits.len)?;
    out.weights.has_len(k, "weights", picks)?;
    selected.has_len(k, "selected", picks)?;
    if let Some(b) = expert_bias {
        b.bias.exactly(DType::F32, k, "expert_bias")?;
        b.bias.has_len(k, "expert_bias", d.experts)?;
        b.unbiased.exactly(DType::U32, k, "unbiased")?;
        b.unbiased.has_len(k, "unbiased", picks)?;
    }
    Ok(())
}

/// [`Backend::moe_route_backward`]'s arguments.
pub fn check_moe_route_backward(
    saved: RouterScores<Operand>,
    selected: Operand,
    d_weights: Operand,
    aux_grad: Operand,
    d_logits: Operand,
    d: RouteDims,
) -> Result<()> {
    let k = "moe_route_backward";
    check_route(k, saved.logits, d)?;
    let floats = [
        ("scores", saved.scores),
        ("d_weights", d_weights),
        ("aux_grad", aux_grad),
        ("d_logits", d_logits),
    ];
    for (name, view) in floats {
        view.exactly(DType::F32, k, name)?;
    }
    selected.exactly(DType::U32, k, "selected")?;
    let picks = product(k, &[d.rows, d.top_k])?;
    saved.scores.has_len(k, "scores", saved.logits.len)?;
    selected.has_len(k, "selected", picks)?;
    d_weights.has_len(k, "d_weights", picks)?;
    aux_grad.has_len(k, "aux_grad", d.experts)?;
    d_logits.has_len(k, "d_logits", saved.logits.len)
}

/// The routed slots `tokens * top_k` (with `top_k >= 1`), which must fit
/// the u32 row indices the permutation holds.
fn slot_count(kernel: &str, s: RoutedSlots) -> Result<usize> {
    ensure(s.top_k >= 1, || format!("{kernel}: top-k is 0"))?;
    let n = product(kernel, &[s.tokens, s.top_k])?;
    as_u32(kernel, "routed slots", n).map(|_| ())?;
    as_u32(kernel, "experts", s.experts).map(|_| ())?;
    Ok(n)
}

/// [`Backend::moe_expert_counts`]'s arguments; gives the routed slots.
pub fn check_moe_expert_counts(
    selected: Operand,
    counts: Operand,
    s: RoutedSlots,
) -> Result<usize> {
    let k = "moe_expert_counts";
    selected.exactly(DType::U32, k, "selected")?;
    counts.exactly(DType::U32, k, "counts")?;
    let n = slot_count(k, s)?;
    selected.has_len(k, "selected", n)?;
    counts.has_len(k, "counts", s.experts)?;
    Ok(n)
}

/// [`Backend::moe_sort_by_expert`]'s arguments; gives the routed slots.
pub fn check_moe_sort_by_expert(
    selected: Operand,
    counts: Operand,
    out: ExpertOrder<Operand>,
    s: RoutedSlots,
) -> Result<usize> {
    let k = "moe_sort_by_expert";
    let named = [
        ("selected", selected),
        ("counts", counts),
        ("positions", out.positions),
        ("sources", out.sources),
    ];
    for (name, view) in named {
        view.exactly(DType::U32, k, name)?;
    }
    let n = slot_count(k, s)?;
    selected.has_len(k, "selected", n)?;
    counts.has_len(k, "counts", s.experts)?;
    out.positions.has_len(k, "positions", n)?;
    out.sources.has_len(k, "sources", n)?;
    Ok(n)
}

/// [`Backend::moe_expert_major_order`]'s arguments. (That `order` holds
/// the sum of the counts is data, which each backend checks.)
pub fn check_moe_expert_major_order(
    recv_counts: Operand,
    order: Operand,
    d: ReceivedDims,
) -> Result<()> {
    let k = "moe_expert_major_order";
    recv_counts.exactly(DType::U32, k, "recv_counts")?;
    order.exactly(DType::U32, k, "order")?;
    let pairs = product(k, &[d.ranks, d.local_experts])?;
    recv_counts.has_len(k, "recv_counts", pairs)?;
    as_u32(k, "received rows", order.len).map(|_| ())
}

/// The expert counts (u32, one an expert) and the loss coefficient.
fn check_aux(kernel: &str, counts: Operand, d: AuxLossDims) -> Result<()> {
    counts.exactly(DType::U32, kernel, "counts")?;
    counts.has_len(kernel, "counts", d.slots.experts)?;
    ensure(d.coeff.is_finite() && d.coeff >= 0.0, || {
        format!(
            "{kernel}: the coefficient {} is not a finite value >= 0",
            d.coeff
        )
    })
}

/// [`Backend::moe_aux_loss_forward`]'s arguments.
pub fn check_moe_aux_loss_forward(
    counts: Operand,
    prob_sum: Operand,
    loss: Operand,
    d: AuxLossDims,
) -> Result<()> {
    let k = "moe_aux_loss_forward";
    check_aux(k, counts, d)?;
    prob_sum.exactly(DType::F32, k, "prob_sum")?;
    loss.exactly(DType::F64, k, "loss")?;
    prob_sum.has_len(k, "prob_sum", d.slots.experts)?;
    loss.has_len(k, "loss", 1)
}

/// [`Backend::moe_aux_loss_backward`]'s arguments.
pub fn check_moe_aux_loss_backward(
    counts: Operand,
    aux_grad: Operand,
    d: AuxLossDims,
) -> Result<()> {
    let k = "moe_aux_loss_backward";
    check_aux(k, counts, d)?;
    aux_grad.exactly(DType::F32, k, "aux_grad")?;
    aux_grad.has_len(k, "aux_grad", d.slots.experts)
}

/// [`Backend::moe_load_accumulate`]'s arguments.
pub fn check_moe_load_accumulate(counts: Operand, load: Operand) -> Result<()> {
    let k = "moe_load_accumulate";
    counts.exactly(DType::U32, k, "counts")?;
    load.exactly(DType::F64, k, "load")?;
    as_u32(k, "experts", counts.len)?;
    load.has_len(k, "load", counts.len)
}

/// A gather's or scatter's rows: `moved` (`index.len` rows of `width`,
/// named `moved_name`) and `other` (whole rows of `width`, the `side` the
/// indices point into).
fn check_row_move(
    kernel: &str,
    [src, index, dst]: [Operand; 3],
    (moved_name, moved): (&str, Operand),
    (side, other): (&str, Operand),
    width: usize,
) -> Result<()> {
    src.float(kernel, "src")?;
    same_dtype(kernel, ("src", src.dtype), ("dst", dst.dtype))?;
    index.exactly(DType::U32, kernel, "index")?;
    moved.has_len(kernel, moved_name, product(kernel, &[index.len, width])?)?;
    ensure(width > 0 || other.len == 0, || {
        format!("{kernel}: width 0 with a non-empty {side}")
    })?;
    ensure(width == 0 || other.len.is_multiple_of(width), || {
        format!("{kernel}: {side} of {} is not rows of {width}", other.len)
    })
}

/// [`Backend::gather_rows`]'s arguments.
pub fn check_gather_rows(src: Operand, index: Operand, dst: Operand, width: usize) -> Result<()> {
    let views = [src, index, dst];
    check_row_move("gather_rows", views, ("dst", dst), ("source", src), width)
}

/// [`Backend::scatter_rows`]'s arguments.
pub fn check_scatter_rows(src: Operand, index: Operand, dst: Operand, width: usize) -> Result<()> {
    let views = [src, index, dst];
    check_row_move(
        "scatter_rows",
        views,
        ("src", src),
        ("destination", dst),
        width,
    )
}

/// The permuted rows (bf16 or f32, `[rows, width]`), the positions (u32,
/// one a routed slot) and the per-token view `out_name` (bf16 or f32,
/// `[tokens, width]`) of an unpermute, a combine or their backward.
fn check_unpermute(
    kernel: &str,
    rows: Operand,
    positions: Operand,
    (out_name, out): (&str, Operand),
    d: UnpermuteDims,
) -> Result<()> {
    rows.float(kernel, "rows")?;
    out.float(kernel, out_name)?;
    positions.exactly(DType::U32, kernel, "positions")?;
    rows.has_len(kernel, "rows", product(kernel, &[d.rows, d.width])?)?;
    positions.has_len(kernel, "positions", product(kernel, &[d.tokens, d.top_k])?)?;
    out.has_len(kernel, out_name, product(kernel, &[d.tokens, d.width])?)?;
    as_u32(kernel, "rows", d.rows).map(|_| ())
}

/// f32 weights, one a routed slot.
fn check_weights(kernel: &str, name: &str, weights: Operand, positions: Operand) -> Result<()> {
    weights.exactly(DType::F32, kernel, name)?;
    weights.has_len(kernel, name, positions.len)
}

/// [`Backend::moe_unpermute`]'s arguments.
pub fn check_moe_unpermute(
    rows: Operand,
    weights: Option<Operand>,
    positions: Operand,
    out: Operand,
    d: UnpermuteDims,
) -> Result<()> {
    let k = "moe_unpermute";
    check_unpermute(k, rows, positions, ("out", out), d)?;
    match weights {
        Some(weights) => check_weights(k, "weights", weights, positions),
        None => Ok(()),
    }
}

/// [`Backend::moe_combine`]'s arguments.
pub fn check_moe_combine(
    rows: Operand,
    weights: Operand,
    positions: Operand,
    shared: Option<Operand>,
    x: Operand,
    d: UnpermuteDims,
) -> Result<()> {
    let k = "moe_combine";
    check_unpermute(k, rows, positions, ("x", x), d)?;
    check_weights(k, "weights", weights, positions)?;
    if let Some(shared) = shared {
        shared.float(k, "shared")?;
        shared.has_len(k, "shared", x.len)?;
    }
    Ok(())
}

/// [`Backend::moe_unpermute_backward`]'s arguments.
pub fn check_moe_unpermute_backward(
    dout: Operand,
    rows: Operand,
    weights: Operand,
    positions: Operand,
    grads: UnpermuteGrads<Operand>,
    d: UnpermuteDims,
) -> Result<()> {
    let k = "moe_unpermute_backward";
    grads.rows.float(k, "d_rows")?;
    check_unpermute(k, rows, positions, ("dout", dout), d)?;
    check_weights(k, "weights", weights, positions)?;
    grads.weights.exactly(DType::F32, k, "d_weights")?;
    grads.rows.has_len(k, "grads.rows", rows.len)?;
    grads.weights.has_len(k, "grads.weights", positions.len)
}

/// [`Backend`]'s MoE methods: each checks its arguments, then runs its
/// [`MoeKernels`] method.
macro_rules! moe_methods {
    () => {
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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_route_forward(
                logits.operand(),
                expert_bias.as_ref().map(|b| ExpertBias {
                    bias: b.bias.operand(),
                    unbiased: b.unbiased.operand(),
                }),
                RouteOutputs {
                    scores: out.scores.operand(),
                    weights: out.weights.operand(),
                    prob_sum: out.prob_sum.as_ref().map(ViewMut::operand),
                },
                selected.operand(),
                dims,
            )?;
            self.moe_route_forward_unchecked(logits, expert_bias, out, selected, dims)
        }

        /// Backward of the routing: from `d_weights` `[rows, k]` and the
        /// load-balancing term `aux_grad[e]` (= `dLoss/d p_r[e]`, the same for
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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_route_backward(
                RouterScores {
                    logits: saved.logits.operand(),
                    scores: saved.scores.operand(),
                },
                selected.operand(),
                d_weights.operand(),
                aux_grad.operand(),
                d_logits.operand(),
                dims,
            )?;
            self.moe_route_backward_unchecked(saved, selected, d_weights, aux_grad, d_logits, dims)
        }

        /// The per-expert histogram of a routing: `counts[e]` = the number of
        /// (token, k-slot) pairs of `selected` `[tokens, k]` that chose expert
        /// `e` (overwritten, `[E]`). An expert index at or past `E` is an error.
        /// Dtypes: u32 both.
        fn moe_expert_counts(
            &self,
            selected: Slice<'_, Self>,
            counts: SliceMut<'_, Self>,
            slots: RoutedSlots,
        ) -> Result<()> {
            $crate::backend::moe::check_moe_expert_counts(
                selected.operand(),
                counts.operand(),
                slots,
            )?;
            self.moe_expert_counts_unchecked(selected, counts, slots)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_sort_by_expert(
                selected.operand(),
                counts.operand(),
                ExpertOrder {
                    positions: out.positions.operand(),
                    sources: out.sources.operand(),
                },
                slots,
            )?;
            self.moe_sort_by_expert_unchecked(selected, counts, out, slots)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_expert_major_order(
                recv_counts.operand(),
                order.operand(),
                dims,
            )?;
            self.moe_expert_major_order_unchecked(recv_counts, order, dims)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_aux_loss_forward(
                counts.operand(),
                prob_sum.operand(),
                loss.operand(),
                dims,
            )?;
            self.moe_aux_loss_forward_unchecked(counts, prob_sum, loss, dims)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_aux_loss_backward(
                counts.operand(),
                aux_grad.operand(),
                dims,
            )?;
            self.moe_aux_loss_backward_unchecked(counts, aux_grad, dims, scale)
        }

        /// `load[e] += counts[e]` for every expert `e`: a routing's per-expert
        /// counts (from [`Backend::moe_expert_counts`]) added to a running
        /// f64 total on the device, exactly (integers below 2^53), so a step
        /// can sum its micro-batches' loads and read them with its other
        /// totals. Dtypes: `counts` u32, `load` f64 (accumulated), one an
        /// expert.
        fn moe_load_accumulate(
            &self,
            counts: Slice<'_, Self>,
            load: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::moe::check_moe_load_accumulate(counts.operand(), load.operand())?;
            self.moe_load_accumulate_unchecked(counts, load)
        }

        /// `dst[i] = src[index[i]]` for rows of `width` elements. Dtypes: `src`
        /// and `dst` alike (bf16 or f32), `index` u32.
        fn gather_rows(
            &self,
            src: Slice<'_, Self>,
            index: Slice<'_, Self>,
            dst: SliceMut<'_, Self>,
            width: usize,
        ) -> Result<()> {
            $crate::backend::moe::check_gather_rows(
                src.operand(),
                index.operand(),
                dst.operand(),
                width,
            )?;
            self.gather_rows_unchecked(src, index, dst, width)
        }

        /// `dst[index[i]] = src[i]` for rows of `width` elements; `index` must be
        /// distinct (a permutation), which the CPU backend checks. Dtypes: `src`
        /// and `dst` alike (bf16 or f32), `index` u32.
        fn scatter_rows(
            &self,
            src: Slice<'_, Self>,
            index: Slice<'_, Self>,
            dst: SliceMut<'_, Self>,
            width: usize,
        ) -> Result<()> {
            $crate::backend::moe::check_scatter_rows(
                src.operand(),
                index.operand(),
                dst.operand(),
                width,
            )?;
            self.scatter_rows_unchecked(src, index, dst, width)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_unpermute(
                rows.operand(),
                weights.as_ref().map(View::operand),
                positions.operand(),
                out.operand(),
                dims,
            )?;
            self.moe_unpermute_unchecked(rows, weights, positions, out, dims)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_combine(
                rows.operand(),
                weights.operand(),
                positions.operand(),
                shared.as_ref().map(View::operand),
                x.operand(),
                dims,
            )?;
            self.moe_combine_unchecked(rows, weights, positions, shared, x, dims)
        }

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
        ) -> Result<()> {
            $crate::backend::moe::check_moe_unpermute_backward(
                dout.operand(),
                rows.operand(),
                weights.operand(),
                positions.operand(),
                UnpermuteGrads {
                    rows: grads.rows.operand(),
                    weights: grads.weights.operand(),
                },
                dims,
            )?;
            self.moe_unpermute_backward_unchecked(dout, rows, weights, positions, grads, dims)
        }
    };
}
pub(super) use moe_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_permutation_and_combine_shapes_are_checked() {
        let f32s = |len| Operand::new(len, DType::F32);
        let u32s = |len| Operand::new(len, DType::U32);
        let route = RouteDims {
            rows: 3,
            experts: 4,
            top_k: 2,
            score: ScoreFunction::Softmax,
            topk_scale: 1.0,
        };
        let out = RouteOutputs {
            scores: f32s(12),
            weights: f32s(6),
            prob_sum: None,
        };
        assert!(check_moe_route_forward(f32s(12), None, out, u32s(6), route).is_ok());
        let too_many = RouteDims { top_k: 5, ..route };
        assert!(check_moe_route_forward(f32s(12), None, out, u32s(6), too_many).is_err());
        let slots = RoutedSlots {
            tokens: 3,
            top_k: 2,
            experts: 4,
        };
        assert_eq!(check_moe_expert_counts(u32s(6), u32s(4), slots).unwrap(), 6);
        let none = RoutedSlots { top_k: 0, ..slots };
        assert!(check_moe_expert_counts(u32s(0), u32s(4), none).is_err());
        assert!(check_gather_rows(f32s(7), u32s(2), f32s(4), 2).is_err());
        assert!(check_gather_rows(f32s(8), u32s(2), f32s(4), 2).is_ok());
        assert!(check_scatter_rows(f32s(4), u32s(2), f32s(3), 0).is_err());
        let d = UnpermuteDims {
            tokens: 3,
            top_k: 2,
            rows: 6,
            width: 2,
        };
        let grads = UnpermuteGrads {
            rows: f32s(12),
            weights: f32s(5),
        };
        let backward = check_moe_unpermute_backward(f32s(6), f32s(12), f32s(6), u32s(6), grads, d);
        let aux = AuxLossDims {
            slots,
            coeff: f32::NAN,
        };
        assert!(
            check_moe_aux_loss_forward(u32s(4), f32s(4), Operand::new(1, DType::F64), aux).is_err()
        );
        assert!(backward.unwrap_err().to_string().contains("grads.weights"));
        let f64s = |len| Operand::new(len, DType::F64);
        assert!(check_moe_load_accumulate(u32s(4), f64s(4)).is_ok());
        let short = check_moe_load_accumulate(u32s(4), f64s(3)).unwrap_err();
        assert!(short.to_string().contains("load"), "{short}");
        assert!(check_moe_load_accumulate(u32s(4), f32s(4)).is_err());
        assert!(check_moe_load_accumulate(f64s(4), f64s(4)).is_err());
    }
}

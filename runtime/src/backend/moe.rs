//! Mixture of experts: routing, the dispatch permutation, the
//! load-balancing loss, and the row moves between tokens and experts.

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
#[derive(Debug)]
pub struct ExpertBias<S, M> {
    /// `[E]` f32: added to the scores for the selection only.
    pub bias: S,
    /// `[rows, k]` u32: each row's top-k of the scores without the bias,
    /// best first (the load-balancing loss counts these).
    pub unbiased: M,
}

/// What [`Backend::moe_route_forward`] writes besides the selection.
#[derive(Debug)]
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
#[derive(Debug)]
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
#[derive(Debug)]
pub struct UnpermuteGrads<M> {
    pub rows: M,
    pub weights: M,
}

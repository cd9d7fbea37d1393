//! `E`: the mixture-of-experts layer (layers.md `E`), in stages so the
//! overlap schedule can run the all-to-alls between them on its comm lane:
//!
//! ```text
//! prepare ──send rows──▶ [dispatch a2a] ──▶ experts ──▶ [combine a2a] ──▶ combine
//! prepare_backward_input ◀── [a2a] ◀── experts_backward_input ◀── [a2a] ◀── combine_backward
//! ```
//!
//! - `prepare` (pre-dispatch slot): pre-MLP norm, the router
//!   (`routing.rs`: f32 logits, top-k, per-expert counts, the load-balancing
//!   loss added to the caller's device accumulator), the shared expert, and
//!   the dispatch permutation (`permutation.rs`): a send buffer of `T * k`
//!   rows sorted by (global expert, token, k-slot). Global expert `e` lives
//!   on EP rank `e / L` as local expert `e % L` (`L = E / ep`), so the buffer
//!   is already cut into per-rank segments ([`MoeLayer::counts_per_rank`]).
//! - `dispatch` (comm lane): under expert parallelism the host reads the `E`
//!   per-expert counts (the layer's one host read per micro-batch: the
//!   all-to-all needs its sizes), exchanges them
//!   ([`crate::Collective::all_to_all_counts`]) and the rows
//!   ([`crate::Collective::all_to_all`]); received rows are ordered by
//!   (source rank, local expert, ...). Under expert parallelism 1 the rows
//!   stay where they are and nothing is read: the experts' GEMMs take each
//!   expert's rows from the router's device counts
//!   ([`Backend::segmented_matmul`]). Aux-loss-free balancing reads nothing
//!   either: `prepare` adds the counts to the step's load on the device
//!   ([`Backend::moe_load_accumulate`]).
//! - `experts` (mlp slot): regroups the received rows expert-major (then by
//!   source rank) on the device, runs every local expert as grouped matmuls
//!   (`experts.rs`), and writes the outputs back in received order, ready to
//!   be sent back.
//! - `combine` (comm lane): the rows come back; the combine unpermutes them,
//!   weights them by the router weights, sums each token's k copies in k-slot
//!   order, adds the shared expert and adds the result into the residual.
//!
//! Backward mirrors it; the aux-loss gradient (scaled by the caller's loss
//! scale) enters in `prepare_backward_input`. Every routing index (the
//! selection, the counts, the permutation, the regroup) is a u32 device
//! buffer made by a kernel; the host only ever holds counts. Routing runs in
//! f32 in every precision; the rows moved between tokens and experts are in
//! the compute dtype. [`MoeLayer::forward_with`] and friends run every stage
//! back to back with an [`ExpertExchange`] (`exchange.rs`): a
//! [`LocalExchange`] (expert parallelism 1, a copy) or a
//! [`CollectiveExchange`] over a communicator.

mod balance;
mod exchange;
mod experts;
mod permutation;
mod routing;

pub use balance::{ExpertBalance, expert_bias_key, expert_bias_keys, update_expert_bias};
pub use exchange::{CollectiveExchange, ExpertExchange, LocalExchange};
use experts::ExpertInput;
pub use experts::{MoeExpertsSaved, MoeExpertsWgrad};

use super::mlp::Ffn;
use super::norm::{NormPartials, RmsNorm};
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, grad, grad_pair, positive, section,
    uninit, uninit_f32, weight,
};
use crate::backend::{Backend, DType, Slice, SliceMut, UnpermuteGrads};
use crate::error::{Result, RuntimeError};
use exchange::ExchangeRows;
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::config::ScoreFunction;
use hybridgen_dsl::params::{ParamDef, layer_params};
use routing::RouterSaved;

const PRE_NORM: usize = 0;
const ROUTER: usize = 1;

/// `E`: `x += sum_k w_k Expert_k(u) + Shared(u)`, `u = RMSNorm(x)`.
#[derive(Clone, Debug)]
pub struct MoeLayer {
    hidden: usize,
    experts: usize,
    local_experts: usize,
    top_k: usize,
    expert: Ffn,
    shared: Option<Ffn>,
    score: ScoreFunction,
    topk_scale: f32,
    aux_coeff: f32,
    /// The bias a standalone call routes with (training passes its own
    /// device buffer instead, see [`RouterContext`]); `None` without
    /// aux-loss-free balancing.
    expert_bias: Option<Vec<f32>>,
    expert_bias_rate: f32,
    params: Vec<ParamDef>,
}

/// What the forward steps of an `E` layer read and add to besides its
/// weights and the residual stream.
pub struct RouterContext<'a, B: Backend> {
    /// One f64 on the device: `Prepare` adds the load-balancing loss to it.
    pub aux_loss: SliceMut<'a, B>,
    /// With aux-loss-free balancing: the training's expert bias and load.
    pub balance: Option<Balance<'a, B>>,
}

/// The training's aux-loss-free balancing state of one `E` layer.
pub struct Balance<'a, B: Backend> {
    /// `[E]` f32 on the device: `Prepare` selects with it.
    pub bias: Slice<'a, B>,
    /// `[E]` f64 on the device: `Prepare` adds the micro-batch's per-expert
    /// counts to it.
    pub load: SliceMut<'a, B>,
}

/// The shared expert's activations: its fc1 output, for the backward (its
/// `act` is recomputed from it: `Ffn::activate`), and its output until the
/// combine adds it into the residual stream, which then drops it.
struct SharedSaved<B: Backend> {
    pre: B::Buf,
    out: Option<B::Buf>,
}

/// Routing state of one micro-batch, from `prepare` to `prepare_backward_input`.
pub struct MoeRouting<B: Backend> {
    rows: usize,
    x_in: B::Buf,
    rstd: B::Buf,
    u: B::Buf,
    router: RouterSaved<B>,
    /// u32 `[T, k]`: the send-buffer row of each (token, k-slot).
    positions: B::Buf,
    shared: Option<SharedSaved<B>>,
}

impl<B: Backend> MoeRouting<B> {
    /// Rows routed to each global expert, read back from the device (for
    /// tests and logs; the dispatch finishes the read `prepare` started).
    pub fn expert_counts(&self, b: &B) -> Result<Vec<usize>> {
        let read = b.start_download(b.view(&self.router.counts)?)?;
        self.finish_counts(b, read)
    }

    /// The rows routed to each global expert, from a read of the counts
    /// started earlier.
    fn finish_counts(&self, b: &B, read: B::HostRead<u32>) -> Result<Vec<usize>> {
        let mut counts = vec![0u32; b.buf_len(&self.router.counts)];
        b.finish_download(read, &mut counts)?;
        Ok(counts.into_iter().map(|c| c as usize).collect())
    }

    /// `[T, k]`: each token's experts (global indices), best first, read
    /// back from the device (for tests).
    pub fn selected(&self, b: &B) -> Result<Vec<u32>> {
        let mut selected = vec![0u32; b.buf_len(&self.router.selected)];
        b.download(b.view(&self.router.selected)?, &mut selected)?;
        Ok(selected)
    }
}

/// What [`MoeLayer::prepare`] produces.
pub struct MoePrepared<B: Backend> {
    /// `[T * k, h]` rows of the normed input sorted by (global expert, token,
    /// k-slot): the dispatch all-to-all's send buffer. Drop it once sent.
    /// The rows per global expert are [`MoeRouting::expert_counts`].
    pub send: B::Buf,
    /// State for `combine` and the backward.
    pub routing: MoeRouting<B>,
    /// The per-expert counts on their way to the host, which needs them
    /// under expert parallelism (the all-to-all's sizes): the dispatch's one
    /// host read, started before the permutation and the shared expert so
    /// that their GPU work hides the round trip. `None` under expert
    /// parallelism 1: the experts' GEMMs read the counts on the device.
    pub counts: Option<B::HostRead<u32>>,
}

/// What [`MoeLayer::combine`] keeps.
pub struct MoeCombined<B: Backend> {
    routing: MoeRouting<B>,
    /// The expert outputs as they came back, in send order.
    returned: B::Buf,
}

impl<B: Backend> MoeCombined<B> {
    pub fn routing(&self) -> &MoeRouting<B> {
        &self.routing
    }
}

/// What [`MoeLayer::combine_backward`] produces.
pub struct MoeCombineBackward<B: Backend> {
    /// `[T * k, h]`: the gradient of the returned rows, in send order; send
    /// it to the experts with the dispatch counts.
    pub d_returned: B::Buf,
    pub state: MoeCombineGrad<B>,
}

/// State from `combine_backward` to `prepare_backward_input`.
pub struct MoeCombineGrad<B: Backend> {
    routing: MoeRouting<B>,
    /// f32 `[T, k]`.
    d_weights: B::Buf,
}

/// The shared expert's part of [`MoePrepareWgrad`].
struct SharedWgrad<B: Backend> {
    act: B::Buf,
    d_pre: B::Buf,
    d_out: B::Buf,
}

/// What [`MoeLayer::prepare_backward_input`] keeps.
pub struct MoePrepareWgrad<B: Backend> {
    rows: usize,
    norm: NormPartials<B>,
    u: B::Buf,
    /// In the compute dtype.
    d_logits: B::Buf,
    shared: Option<SharedWgrad<B>>,
}

/// A whole forward run through an [`ExpertExchange`].
pub struct MoeSaved<B: Backend> {
    stage: MoeStage<B>,
    /// f64 `[1]`: the load-balancing loss of the run.
    aux_loss: B::Buf,
}

impl<B: Backend> MoeSaved<B> {
    /// The load-balancing loss (with its coefficient), read back from the
    /// device (for tests; the schedule accumulates it on the device).
    pub fn aux_loss(&self, b: &B) -> Result<f64> {
        let mut value = [0.0f64];
        b.download(b.view(&self.aux_loss)?, &mut value)?;
        Ok(value[0])
    }

    /// The routing of the forward (for tests).
    pub fn routing(&self) -> Option<&MoeRouting<B>> {
        match &self.stage.flow {
            MoeFlow::Combined { combined, .. } => Some(&combined.routing),
            _ => None,
        }
    }
}

/// A whole input-gradient backward run through an [`ExpertExchange`]: the
/// weight gradients still to take.
pub struct MoeWgrad<B: Backend> {
    stage: MoeStage<B>,
}

/// The forward steps of an `E` layer, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeForward {
    /// Pre-dispatch slot: norm, router, shared expert, permutation.
    Prepare,
    /// The dispatch all-to-all (comm lane).
    Dispatch,
    /// Mlp slot: the local experts.
    Experts,
    /// The combine all-to-all and the weighted sum into the residual (comm
    /// lane).
    Combine,
}

impl MoeForward {
    pub const ALL: [MoeForward; 4] = [
        MoeForward::Prepare,
        MoeForward::Dispatch,
        MoeForward::Experts,
        MoeForward::Combine,
    ];

    fn name(self) -> &'static str {
        match self {
            MoeForward::Prepare => "prepare",
            MoeForward::Dispatch => "dispatch",
            MoeForward::Experts => "experts",
            MoeForward::Combine => "combine",
        }
    }
}

/// The backward steps of an `E` layer, in the order the schedules run them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeBackward {
    Combine,
    Experts,
    ExpertsWeights,
    Dispatch,
    Prepare,
    PrepareWeights,
}

impl MoeBackward {
    fn name(self) -> &'static str {
        match self {
            MoeBackward::Combine => "combine backward",
            MoeBackward::Experts => "experts backward",
            MoeBackward::ExpertsWeights => "experts weight gradient",
            MoeBackward::Dispatch => "dispatch backward",
            MoeBackward::Prepare => "prepare backward",
            MoeBackward::PrepareWeights => "prepare weight gradient",
        }
    }
}

/// Where one micro-batch of an `E` layer stands between the schedule's
/// steps: each variant holds exactly what the next step needs, so a step
/// run out of order is an error naming both steps, never a missing field.
enum MoeFlow<B: Backend> {
    Idle,
    Prepared {
        routing: MoeRouting<B>,
        send: B::Buf,
        counts: Option<B::HostRead<u32>>,
    },
    Dispatched {
        routing: MoeRouting<B>,
        recv: B::Buf,
        /// `None` under expert parallelism 1: the rows stayed here and the
        /// router's device counts size the experts.
        recv_counts: Option<Vec<Vec<usize>>>,
        rows: ExchangeRows,
    },
    Computed {
        routing: MoeRouting<B>,
        out: B::Buf,
        experts: MoeExpertsSaved<B>,
        rows: ExchangeRows,
    },
    Combined {
        combined: MoeCombined<B>,
        experts: MoeExpertsSaved<B>,
        rows: ExchangeRows,
    },
    CombineGrad {
        state: MoeCombineGrad<B>,
        d_out: B::Buf,
        experts: MoeExpertsSaved<B>,
        rows: ExchangeRows,
    },
    ExpertsGrad {
        state: MoeCombineGrad<B>,
        d_in: B::Buf,
        rows: ExchangeRows,
    },
    DispatchGrad {
        state: MoeCombineGrad<B>,
        d_send: B::Buf,
    },
    PrepareGrad {
        wgrad: MoePrepareWgrad<B>,
    },
}

impl<B: Backend> MoeFlow<B> {
    fn name(&self) -> &'static str {
        match self {
            MoeFlow::Idle => "no forward",
            MoeFlow::Prepared { .. } => "prepare",
            MoeFlow::Dispatched { .. } => "dispatch",
            MoeFlow::Computed { .. } => "experts",
            MoeFlow::Combined { .. } => "combine",
            MoeFlow::CombineGrad { .. } => "combine backward",
            MoeFlow::ExpertsGrad { .. } => "experts backward",
            MoeFlow::DispatchGrad { .. } => "dispatch backward",
            MoeFlow::PrepareGrad { .. } => "prepare backward",
        }
    }
}

/// One micro-batch's state in an `E` layer between steps: the data flow,
/// and the experts' weight gradient, which may wait.
pub struct MoeStage<B: Backend> {
    flow: MoeFlow<B>,
    experts_wgrad: Option<MoeExpertsWgrad<B>>,
}

impl<B: Backend> MoeStage<B> {
    /// Before the forward (and after the last weight step).
    pub fn idle() -> Self {
        MoeStage {
            flow: MoeFlow::Idle,
            experts_wgrad: None,
        }
    }

    /// Whether nothing of a micro-batch is left in the layer.
    pub fn is_idle(&self) -> bool {
        matches!(self.flow, MoeFlow::Idle) && self.experts_wgrad.is_none()
    }
}

fn out_of_order(step: &str, after: &str) -> RuntimeError {
    RuntimeError::InvalidArgument(format!(
        "`E` layer: the {step} step cannot run after {after}; the schedule ran a step out of order"
    ))
}

impl MoeLayer {
    /// The layer for a rank holding `local_experts` of the `E` experts
    /// (`E / ep`; `E` for expert parallelism 1).
    pub fn new(config: &ModelConfig, local_experts: usize) -> Result<Self> {
        let m = section(&config.moe, LayerKind::Moe, "moe")?;
        let experts = positive("moe.num_experts", m.num_experts)?;
        let top_k = positive("moe.top_k", m.top_k)?;
        if top_k > experts {
            return Err(RuntimeError::InvalidArgument(format!(
                "moe.top_k = {top_k} is above moe.num_experts = {experts}"
            )));
        }
        if local_experts == 0 || experts % local_experts != 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "{local_experts} local experts do not split {experts} experts evenly over EP ranks"
            )));
        }
        if !(m.aux_loss_coeff.is_finite() && m.aux_loss_coeff >= 0.0) {
            return Err(RuntimeError::InvalidArgument(format!(
                "moe.aux_loss_coeff is {}",
                m.aux_loss_coeff
            )));
        }
        if !(m.topk_scaling_factor.is_finite() && m.topk_scaling_factor > 0.0) {
            return Err(RuntimeError::InvalidArgument(format!(
                "moe.topk_scaling_factor is {}; it must be a finite number above 0 (1 for none)",
                m.topk_scaling_factor
            )));
        }
        if !(m.expert_bias_update_rate.is_finite() && m.expert_bias_update_rate >= 0.0) {
            return Err(RuntimeError::InvalidArgument(format!(
                "moe.expert_bias_update_rate is {}; it must be a finite number of at least 0",
                m.expert_bias_update_rate
            )));
        }
        if m.expert_bias && m.score_function == ScoreFunction::Softmax {
            return Err(RuntimeError::InvalidArgument(
                "moe.expert_bias needs moe.score_function = \"sigmoid\": aux-loss-free balancing \
                 biases sigmoid scores only, as in Megatron"
                    .into(),
            ));
        }
        let hidden = positive("hidden_size", config.hidden_size)?;
        let ffn = |width| Ffn {
            hidden,
            width,
            activation: m.activation,
        };
        let shared = match m.shared_expert_ffn_hidden_size {
            Some(fs) => Some(ffn(positive("moe.shared_expert_ffn_hidden_size", fs)?)),
            None => None,
        };
        Ok(MoeLayer {
            hidden,
            experts,
            local_experts,
            top_k,
            expert: ffn(positive("moe.ffn_hidden_size", m.ffn_hidden_size)?),
            shared,
            score: m.score_function,
            topk_scale: m.topk_scaling_factor,
            aux_coeff: m.aux_loss_coeff,
            expert_bias: m.expert_bias.then(|| vec![0.0; experts]),
            expert_bias_rate: m.expert_bias_update_rate,
            params: layer_params(LayerKind::Moe, config, local_experts),
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    /// E.
    pub fn num_experts(&self) -> usize {
        self.experts
    }

    /// Experts on this rank (`E / ep`).
    pub fn local_experts(&self) -> usize {
        self.local_experts
    }

    /// The expert-parallel size this layer was built for.
    pub fn ep(&self) -> usize {
        self.experts / self.local_experts
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The f32 selection bias a standalone call routes with
    /// (`moe.expert_bias`), when enabled.
    pub fn expert_bias(&self) -> Option<&[f32]> {
        self.expert_bias.as_deref()
    }

    /// The bias's step per optimizer step, with aux-loss-free balancing.
    pub fn expert_bias_rate(&self) -> Option<f32> {
        self.expert_bias.as_ref().map(|_| self.expert_bias_rate)
    }

    /// Replaces the bias standalone calls route with; an error when the
    /// config has no expert bias.
    pub fn set_expert_bias(&mut self, bias: &[f32]) -> Result<()> {
        match &mut self.expert_bias {
            Some(own) if own.len() == bias.len() => {
                own.copy_from_slice(bias);
                Ok(())
            }
            Some(own) => Err(RuntimeError::InvalidArgument(format!(
                "expert bias of {} values for {} experts",
                bias.len(),
                own.len()
            ))),
            None => Err(RuntimeError::InvalidArgument(
                "this MoE layer has no expert bias (set `moe.expert_bias = true`)".into(),
            )),
        }
    }

    fn fc1(&self, j: usize) -> usize {
        2 + j
    }

    fn fc2(&self, j: usize) -> usize {
        2 + self.local_experts + j
    }

    fn shared_fc1(&self) -> usize {
        2 + 2 * self.local_experts
    }

    fn norm(&self) -> RmsNorm {
        RmsNorm::plain(self.hidden)
    }

    /// Cuts per-global-expert counts into per-EP-rank lists of per-local-
    /// expert counts (the shape `all_to_all_counts` sends).
    pub fn counts_per_rank(&self, per_expert: &[usize]) -> Result<Vec<Vec<usize>>> {
        check_len("MoE counts", "per_expert", per_expert.len(), self.experts)?;
        Ok(per_expert
            .chunks(self.local_experts)
            .map(<[usize]>::to_vec)
            .collect())
    }

    // ---- forward stages ---------------------------------------------------------

    /// Pre-dispatch: norm, routing, shared expert, permutation. Reads the
    /// residual `x` (the residual add happens in `combine`) and adds the
    /// load-balancing loss to `aux_acc` (one f64, on the device). With
    /// `balance` (the training's), routes with its bias (see
    /// `MoeLayer::route`) and adds the per-expert counts to its load, on
    /// the device.
    pub fn prepare<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        x: Slice<'_, B>,
        tokens: Tokens,
        aux_acc: SliceMut<'_, B>,
        balance: Option<Balance<'_, B>>,
    ) -> Result<MoePrepared<B>> {
        let name = "`E` layer prepare";
        check_weights(b, name, &self.params, weights)?;
        let rows = check_rows(name, "x", b.slice_len(x), tokens, self.hidden)?;
        let h = self.hidden;
        let w = |i| weight::<B>(weights, i);
        let (u, rstd, x_in) = self
            .norm()
            .forward_keeping_input(b, w(PRE_NORM)?, x, rows)?;
        let (bias, load) = balance.map(|b| (b.bias, b.load)).unzip();
        let router = self.route(b, w(ROUTER)?, b.view(&u)?, rows, aux_acc, bias)?;
        // The host needs the counts only to size an all-to-all.
        let counts = (self.ep() > 1)
            .then(|| b.start_download(b.view(&router.counts)?))
            .transpose()?;
        if let Some(load) = load {
            b.moe_load_accumulate(b.view(&router.counts)?, load)?;
        }
        let (send, positions) = self.permute(
            b,
            b.view(&router.selected)?,
            b.view(&router.counts)?,
            b.view(&u)?,
            rows,
        )?;
        let shared = match &self.shared {
            Some(ffn) => {
                let pre = uninit(b, ffn.pre_len(rows))?;
                let act = uninit(b, ffn.act_len(rows))?;
                let out = uninit(b, rows * h)?;
                let i = self.shared_fc1();
                ffn.forward(
                    b,
                    (w(i)?, w(i + 1)?),
                    b.view(&u)?,
                    b.view_mut(&pre)?,
                    b.view_mut(&act)?,
                    b.view_mut(&out)?,
                    rows,
                    false,
                )?;
                Some(SharedSaved {
                    pre,
                    out: Some(out),
                })
            }
            None => None,
        };
        Ok(MoePrepared {
            send,
            counts,
            routing: MoeRouting {
                rows,
                x_in,
                rstd,
                u,
                router,
                positions,
                shared,
            },
        })
    }

    /// The combine slot: `x += sum_j w_j rows[pos(t, j)] + shared(u)`.
    /// `returned` holds the expert outputs in send order.
    pub fn combine<B: Backend>(
        &self,
        b: &B,
        mut routing: MoeRouting<B>,
        returned: B::Buf,
        mut x: SliceMut<'_, B>,
    ) -> Result<MoeCombined<B>> {
        let name = "`E` layer combine";
        let (rows, h) = (routing.rows, self.hidden);
        check_len(
            name,
            "returned",
            b.buf_len(&returned),
            rows * self.top_k * h,
        )?;
        check_len(name, "x", b.slice_len(b.as_slice(&x)), rows * h)?;
        // The shared expert's output is added here and needed no more.
        let shared_out = match routing.shared.as_mut() {
            Some(shared) => Some(shared.out.take().ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "{name}: the shared expert's output was already combined"
                ))
            })?),
            None => None,
        };
        self.combine_into(
            b,
            b.view(&returned)?,
            b.view(&routing.router.weights)?,
            b.view(&routing.positions)?,
            shared_out.as_ref().map(|out| b.view(out)).transpose()?,
            b.reborrow_mut(&mut x),
            rows,
        )?;
        Ok(MoeCombined { routing, returned })
    }

    // ---- backward stages --------------------------------------------------------

    /// Combine backward: `dx` (dL/d(x after the layer)) is only read; the
    /// residual part of the gradient passes through to
    /// `prepare_backward_input`, which adds the rest into `dx`.
    pub fn combine_backward<B: Backend>(
        &self,
        b: &B,
        combined: MoeCombined<B>,
        dx: Slice<'_, B>,
    ) -> Result<MoeCombineBackward<B>> {
        let routing = combined.routing;
        let (rows, h, k) = (routing.rows, self.hidden, self.top_k);
        check_len(
            "`E` layer combine backward",
            "dx",
            b.slice_len(dx),
            rows * h,
        )?;
        let d_returned = uninit(b, rows * k * h)?;
        let d_weights = uninit_f32(b, rows * k)?;
        self.unpermute_backward(
            b,
            dx,
            b.view(&combined.returned)?,
            b.view(&routing.router.weights)?,
            b.view(&routing.positions)?,
            UnpermuteGrads {
                rows: b.view_mut(&d_returned)?,
                weights: b.view_mut(&d_weights)?,
            },
            rows,
        )?;
        Ok(MoeCombineBackward {
            d_returned,
            state: MoeCombineGrad { routing, d_weights },
        })
    }

    /// Pre-dispatch backward: `d_send` is the gradient of the send rows (as
    /// they come back from the experts, send order). Adds into `dx` the
    /// gradient through the permutation, the router (with the load-balancing
    /// loss's gradient times `loss_scale`), the shared expert and the norm.
    pub fn prepare_backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        state: MoeCombineGrad<B>,
        d_send: Slice<'_, B>,
        dx: SliceMut<'_, B>,
        loss_scale: f32,
    ) -> Result<MoePrepareWgrad<B>> {
        let name = "`E` layer prepare backward";
        check_weights(b, name, &self.params, weights)?;
        let r = state.routing;
        let (rows, h, k) = (r.rows, self.hidden, self.top_k);
        check_len(name, "d_send", b.slice_len(d_send), rows * k * h)?;
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * h)?;
        let w = |i| weight::<B>(weights, i);
        // The permutation's, the router's and the shared expert's input
        // gradients sum in f32 (a GEMM's sum into bf16 would round twice, or
        // go through scratch), and the norm reads the sum as it is.
        let d_u = uninit_f32(b, rows * h)?;
        self.permute_backward(b, d_send, b.view(&r.positions)?, b.view_mut(&d_u)?, rows)?;
        let d_logits =
            self.route_backward(b, &r.router, b.view(&state.d_weights)?, rows, loss_scale)?;
        self.router_backward_input(b, w(ROUTER)?, b.view(&d_logits)?, b.view_mut(&d_u)?, rows)?;
        // The shared expert reads the layer output's gradient in `dx`, which
        // keeps it until the norm below adds into it; the norm's pass copies
        // it for the shared expert's weight gradients.
        let shared = match (&self.shared, r.shared) {
            (Some(ffn), Some(saved)) => {
                let d_pre = uninit(b, ffn.pre_len(rows))?;
                let i = self.shared_fc1();
                let act = ffn.backward_input(
                    b,
                    (w(i)?, w(i + 1)?),
                    b.view(&saved.pre)?,
                    b.as_slice(&dx),
                    b.view_mut(&d_pre)?,
                    b.view_mut(&d_u)?,
                    rows,
                    true,
                )?;
                Some((act, d_pre))
            }
            (None, None) => None,
            _ => {
                return Err(RuntimeError::InvalidArgument(format!(
                    "{name}: the saved state does not match the layer's shared expert"
                )));
            }
        };
        let (norm, weight) = (self.norm(), w(PRE_NORM)?);
        let (x_in, rstd, d_u) = (&r.x_in, &r.rstd, b.view(&d_u)?);
        let (shared, norm) = match shared {
            Some((act, d_pre)) => {
                let (d_out, partials) =
                    norm.backward_input_keeping_dx(b, weight, x_in, rstd, d_u, dx, rows)?;
                (Some(SharedWgrad { act, d_pre, d_out }), partials)
            }
            None => (
                None,
                norm.backward_input(b, weight, x_in, rstd, d_u, dx, rows)?,
            ),
        };
        Ok(MoePrepareWgrad {
            rows,
            norm,
            u: r.u,
            d_logits,
            shared,
        })
    }

    /// Accumulates the norm, router and shared-expert weight gradients.
    pub fn prepare_backward_weight<B: Backend>(
        &self,
        b: &B,
        g: MoePrepareWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`E` layer", &self.params, grads)?;
        let rows = g.rows;
        self.norm()
            .backward_weight(b, &g.norm, grad(b, grads, PRE_NORM)?)?;
        self.router_backward_weight(
            b,
            b.view(&g.d_logits)?,
            b.view(&g.u)?,
            grad(b, grads, ROUTER)?,
            rows,
        )?;
        if let (Some(ffn), Some(s)) = (&self.shared, &g.shared) {
            let i = self.shared_fc1();
            ffn.backward_weight(
                b,
                b.view(&g.u)?,
                b.view(&s.act)?,
                b.view(&s.d_pre)?,
                b.view(&s.d_out)?,
                grad_pair(b, grads, i, i + 1)?,
                rows,
            )?;
        }
        Ok(())
    }

    // ---- the schedule's steps ----------------------------------------------------

    /// Runs one forward step of one micro-batch: the schedule's slots call
    /// these in order (prepare in pre-dispatch, dispatch and combine on the
    /// comm lane, experts in the mlp slot). `x` is the residual stream: read
    /// by `Prepare`, added into by `Combine`. `router.aux_loss` (one f64 on
    /// the device) receives the load-balancing loss: `Prepare` adds this
    /// layer's and micro-batch's, the other steps leave it alone, so a caller
    /// can sum every layer (and micro-batch) in one buffer and read it once.
    /// `Prepare` also adds the per-expert counts to `router.balance`'s load
    /// on the device. Under expert parallelism `Dispatch` reads them back to
    /// the host for the all-to-all's sizes: the layer's only host read.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_step<B: Backend, X: ExpertExchange<B>>(
        &self,
        step: MoeForward,
        b: &B,
        weights: &[Slice<'_, B>],
        stage: MoeStage<B>,
        mut x: SliceMut<'_, B>,
        router: RouterContext<'_, B>,
        tokens: Tokens,
        exchange: &X,
    ) -> Result<MoeStage<B>> {
        let h = self.hidden;
        let MoeStage {
            flow,
            experts_wgrad,
        } = stage;
        let with = |flow| MoeStage {
            flow,
            experts_wgrad: None,
        };
        if experts_wgrad.is_some() {
            return Err(out_of_order(
                step.name(),
                "a pending experts' weight gradient",
            ));
        }
        Ok(match (step, flow) {
            (MoeForward::Prepare, MoeFlow::Idle) => {
                let prepared = self.prepare(
                    b,
                    weights,
                    b.as_slice(&x),
                    tokens,
                    router.aux_loss,
                    router.balance,
                )?;
                with(MoeFlow::Prepared {
                    routing: prepared.routing,
                    send: prepared.send,
                    counts: prepared.counts,
                })
            }
            (
                MoeForward::Dispatch,
                MoeFlow::Prepared {
                    routing,
                    send,
                    counts,
                },
            ) => {
                let counts = counts
                    .map(|read| routing.finish_counts(b, read))
                    .transpose()?;
                let (recv_counts, rows) = match counts {
                    // Expert parallelism 1: every routed row stays here,
                    // `T * k` of them, whatever the split among experts.
                    _ if self.ep() == 1 => {
                        let total = routing.rows * self.top_k;
                        let rows = ExchangeRows {
                            send: vec![total],
                            recv: vec![total],
                        };
                        (None, rows)
                    }
                    Some(counts) => {
                        let send_counts = self.counts_per_rank(&counts)?;
                        let recv_counts = exchange.exchange_counts(&send_counts)?;
                        let rows = ExchangeRows {
                            send: send_counts.iter().map(|c| c.iter().sum()).collect(),
                            recv: recv_counts.iter().map(|c| c.iter().sum()).collect(),
                        };
                        (Some(recv_counts), rows)
                    }
                    None => {
                        return Err(out_of_order(
                            step.name(),
                            "a prepare that read no counts under expert parallelism",
                        ));
                    }
                };
                let recv = exchange.exchange_rows(b, send, &rows.send, &rows.recv, h)?;
                with(MoeFlow::Dispatched {
                    routing,
                    recv,
                    recv_counts,
                    rows,
                })
            }
            (
                MoeForward::Experts,
                MoeFlow::Dispatched {
                    routing,
                    recv,
                    recv_counts,
                    rows,
                },
            ) => {
                let input = match &recv_counts {
                    Some(counts) => ExpertInput::Received(counts),
                    None => ExpertInput::Local {
                        total: routing.rows * self.top_k,
                    },
                };
                let counts = b.view(&routing.router.counts)?;
                let (out, experts) = self.experts(b, weights, recv, input, counts)?;
                with(MoeFlow::Computed {
                    routing,
                    out,
                    experts,
                    rows,
                })
            }
            (
                MoeForward::Combine,
                MoeFlow::Computed {
                    routing,
                    out,
                    experts,
                    rows,
                },
            ) => {
                let returned = exchange.exchange_rows(b, out, &rows.recv, &rows.send, h)?;
                let combined = self.combine(b, routing, returned, b.reborrow_mut(&mut x))?;
                with(MoeFlow::Combined {
                    combined,
                    experts,
                    rows,
                })
            }
            (step, flow) => return Err(out_of_order(step.name(), flow.name())),
        })
    }

    /// Runs one backward step of one micro-batch. `dx` is the residual
    /// stream's gradient (read by `Combine`, added into by `Prepare`);
    /// `grads` are the layer's weight gradients, which only the two weight
    /// steps write (they accumulate). The experts' weight step may run at any
    /// point after `Experts`: the schedule runs it right away, the whole-layer
    /// calls after everything else.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_step<B: Backend, X: ExpertExchange<B>>(
        &self,
        step: MoeBackward,
        b: &B,
        weights: &[Slice<'_, B>],
        stage: MoeStage<B>,
        mut dx: SliceMut<'_, B>,
        mut grads: Option<&mut [SliceMut<'_, B>]>,
        loss_scale: f32,
        exchange: &X,
    ) -> Result<MoeStage<B>> {
        let h = self.hidden;
        let MoeStage {
            flow,
            mut experts_wgrad,
        } = stage;
        let mut need_grads = || {
            grads
                .take()
                .ok_or_else(|| out_of_order(step.name(), "a step without gradient buffers"))
        };
        let flow = match (step, flow) {
            (
                MoeBackward::Combine,
                MoeFlow::Combined {
                    combined,
                    experts,
                    rows,
                },
            ) => {
                let back = self.combine_backward(b, combined, b.as_slice(&dx))?;
                let d_out =
                    exchange.exchange_rows(b, back.d_returned, &rows.send, &rows.recv, h)?;
                MoeFlow::CombineGrad {
                    state: back.state,
                    d_out,
                    experts,
                    rows,
                }
            }
            (
                MoeBackward::Experts,
                MoeFlow::CombineGrad {
                    state,
                    d_out,
                    experts,
                    rows,
                },
            ) => {
                let (d_in, wgrad) = self.experts_backward_input(b, weights, experts, d_out)?;
                experts_wgrad = Some(wgrad);
                MoeFlow::ExpertsGrad { state, d_in, rows }
            }
            (MoeBackward::ExpertsWeights, flow) => {
                let wgrad = experts_wgrad
                    .take()
                    .ok_or_else(|| out_of_order(step.name(), flow.name()))?;
                self.experts_backward_weight(b, wgrad, need_grads()?)?;
                flow
            }
            (MoeBackward::Dispatch, MoeFlow::ExpertsGrad { state, d_in, rows }) => {
                let d_send = exchange.exchange_rows(b, d_in, &rows.recv, &rows.send, h)?;
                MoeFlow::DispatchGrad { state, d_send }
            }
            (MoeBackward::Prepare, MoeFlow::DispatchGrad { state, d_send }) => {
                let wgrad = self.prepare_backward_input(
                    b,
                    weights,
                    state,
                    b.view(&d_send)?,
                    b.reborrow_mut(&mut dx),
                    loss_scale,
                )?;
                MoeFlow::PrepareGrad { wgrad }
            }
            (MoeBackward::PrepareWeights, MoeFlow::PrepareGrad { wgrad }) => {
                if experts_wgrad.is_some() {
                    return Err(out_of_order(
                        step.name(),
                        "a pending experts' weight gradient",
                    ));
                }
                self.prepare_backward_weight(b, wgrad, need_grads()?)?;
                MoeFlow::Idle
            }
            (step, flow) => return Err(out_of_order(step.name(), flow.name())),
        };
        Ok(MoeStage {
            flow,
            experts_wgrad,
        })
    }

    // ---- every step back to back ------------------------------------------------

    /// The whole forward, exchanging rows through `exchange`; the
    /// load-balancing loss stays on the device in the returned state
    /// ([`MoeSaved::aux_loss`] reads it).
    pub fn forward_with<B: Backend, X: ExpertExchange<B>>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
        exchange: &X,
    ) -> Result<MoeSaved<B>> {
        let aux_loss = b.alloc(1, DType::F64)?;
        let mut stage = MoeStage::idle();
        for step in MoeForward::ALL {
            stage = self.forward_step(
                step,
                b,
                weights,
                stage,
                b.reborrow_mut(&mut x),
                RouterContext {
                    aux_loss: b.view_mut(&aux_loss)?,
                    balance: None,
                },
                tokens,
                exchange,
            )?;
        }
        Ok(MoeSaved { stage, aux_loss })
    }

    /// The whole input-gradient backward, exchanging rows through `exchange`;
    /// both weight gradients are left for [`MoeLayer::backward_weight_with`].
    pub fn backward_input_with<B: Backend, X: ExpertExchange<B>>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: MoeSaved<B>,
        mut dx: SliceMut<'_, B>,
        loss_scale: f32,
        exchange: &X,
    ) -> Result<MoeWgrad<B>> {
        let mut stage = saved.stage;
        for step in [
            MoeBackward::Combine,
            MoeBackward::Experts,
            MoeBackward::Dispatch,
            MoeBackward::Prepare,
        ] {
            stage = self.backward_step(
                step,
                b,
                weights,
                stage,
                b.reborrow_mut(&mut dx),
                None,
                loss_scale,
                exchange,
            )?;
        }
        Ok(MoeWgrad { stage })
    }

    /// Both weight-gradient parts.
    pub fn backward_weight_with<B: Backend>(
        &self,
        b: &B,
        wgrad: MoeWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        // The weight steps read no activations and exchange nothing; the
        // residual gradient is not touched, so an empty view stands in.
        let none = b.alloc_uninit(0, b.compute_dtype())?;
        let mut stage = wgrad.stage;
        for step in [MoeBackward::ExpertsWeights, MoeBackward::PrepareWeights] {
            stage = self.backward_step(
                step,
                b,
                &[],
                stage,
                b.view_mut(&none)?,
                Some(&mut *grads),
                0.0,
                &LocalExchange,
            )?;
        }
        Ok(())
    }
}

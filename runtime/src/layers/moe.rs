//! `E`: the mixture-of-experts layer (layers.md `E`), in stages so the
//! overlap schedule can run the all-to-alls between them on its comm lane:
//!
//! ```text
//! prepare ──send rows──▶ [dispatch a2a] ──▶ experts ──▶ [combine a2a] ──▶ combine
//! prepare_backward_input ◀── [a2a] ◀── experts_backward_input ◀── [a2a] ◀── combine_backward
//! ```
//!
//! - `prepare` (pre-dispatch slot): pre-MLP norm, router in f32, top-k, the
//!   load-balancing loss value, the shared expert, and the permutation: a
//!   send buffer of `T * k` rows sorted by (global expert, token, k-slot),
//!   with per-global-expert row counts. Global expert `e` lives on EP rank
//!   `e / L` as local expert `e % L` (`L = E / ep`), so the buffer is already
//!   cut into per-rank segments ([`MoeLayer::counts_per_rank`]).
//! - The caller exchanges counts ([`crate::Collective::all_to_all_counts`])
//!   and rows ([`crate::Collective::all_to_all`]); received rows are ordered
//!   by (source rank, local expert, ...).
//! - `experts` (mlp slot): regroups the received rows expert-major (then by
//!   source rank), runs each local expert's MLP, and writes the outputs back
//!   in received order, ready to be sent back.
//! - `combine` (combine slot): unpermutes the returned rows, weights them by
//!   the router weights, sums each token's k copies in k-slot order, adds the
//!   shared expert and adds the result into the residual.
//!
//! Backward mirrors it; the aux-loss gradient (scaled by the caller's loss
//! scale) enters in `prepare_backward_input`. [`MoeLayer::forward_with`] and
//! friends run every stage back to back with an [`ExpertExchange`]: a
//! [`LocalExchange`] (expert parallelism 1, a copy) or a
//! [`CollectiveExchange`] over a communicator.

use super::mlp::Ffn;
use super::norm::RmsNorm;
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, copy_of, grad, grad_pair, positive,
    section, weight, zeros, zeros_f32,
};
use crate::backend::{Backend, MatmulDims, RouteDims, RouteOutputs, RouterScores, UnpermuteDims, UnpermuteGrads, Slice, SliceMut};
use crate::collective::Collective;
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::config::ScoreFunction;
use hybridgen_dsl::params::{ParamDef, layer_params};

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
    aux_coeff: f32,
    expert_bias: Option<Vec<f32>>,
    params: Vec<ParamDef>,
}

/// The shared expert's activations.
struct SharedSaved<B: Backend> {
    pre: B::Buf,
    act: B::Buf,
    out: B::Buf,
}

/// Routing state of one micro-batch, from `prepare` to `prepare_backward_input`.
pub struct MoeRouting<B: Backend> {
    rows: usize,
    x_in: B::Buf,
    rstd: B::Buf,
    u: B::Buf,
    logits: B::Buf,
    scores: B::Buf,
    weights: B::Buf,
    /// `[T, k]`: each token's experts, best first.
    selected: Vec<u32>,
    /// `[T, k]`: the send-buffer row of each (token, k-slot).
    positions: Vec<u32>,
    /// Rows per global expert.
    counts: Vec<usize>,
    aux_loss: f64,
    shared: Option<SharedSaved<B>>,
}

impl<B: Backend> MoeRouting<B> {
    /// The load-balancing loss (with its coefficient) of this micro-batch.
    pub fn aux_loss(&self) -> f64 {
        self.aux_loss
    }

    /// Rows routed to each global expert (for expert-bias updates and logs).
    pub fn expert_counts(&self) -> &[usize] {
        &self.counts
    }

    /// `[T, k]`: each token's experts (global indices), best first.
    pub fn selected(&self) -> &[u32] {
        &self.selected
    }
}

/// What [`MoeLayer::prepare`] produces.
pub struct MoePrepared<B: Backend> {
    /// `[T * k, h]` rows of the normed input sorted by (global expert, token,
    /// k-slot): the dispatch all-to-all's send buffer. Drop it once sent.
    pub send: B::Buf,
    /// Rows for each global expert, in expert order.
    pub send_counts: Vec<usize>,
    /// The load-balancing loss `coeff * E * sum_i f_i P_i` on these tokens.
    pub aux_loss: f64,
    /// State for `combine` and the backward.
    pub routing: MoeRouting<B>,
}

/// What [`MoeLayer::experts`] keeps.
pub struct MoeExpertsSaved<B: Backend> {
    /// Rows per local expert.
    expert_rows: Vec<usize>,
    /// Grouped row -> received row.
    regroup: Vec<u32>,
    input: B::Buf,
    pre: B::Buf,
    act: B::Buf,
}

/// What [`MoeLayer::experts_backward_input`] keeps.
pub struct MoeExpertsWgrad<B: Backend> {
    expert_rows: Vec<usize>,
    input: B::Buf,
    act: B::Buf,
    d_pre: B::Buf,
    d_out: B::Buf,
}

/// What [`MoeLayer::combine`] keeps.
pub struct MoeCombined<B: Backend> {
    routing: MoeRouting<B>,
    /// The expert outputs as they came back, in send order.
    returned: B::Buf,
}

impl<B: Backend> MoeCombined<B> {
    pub fn aux_loss(&self) -> f64 {
        self.routing.aux_loss
    }

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
    d_weights: B::Buf,
    /// dL/d(layer output), for the shared expert.
    d_out: Option<B::Buf>,
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
    x_in: B::Buf,
    rstd: B::Buf,
    u: B::Buf,
    d_u: B::Buf,
    d_logits: B::Buf,
    shared: Option<SharedWgrad<B>>,
}

/// A whole forward run through an [`ExpertExchange`].
pub struct MoeSaved<B: Backend> {
    combined: MoeCombined<B>,
    experts: MoeExpertsSaved<B>,
    send_rows: Vec<usize>,
    recv_rows: Vec<usize>,
}

impl<B: Backend> MoeSaved<B> {
    pub fn aux_loss(&self) -> f64 {
        self.combined.aux_loss()
    }

    pub fn routing(&self) -> &MoeRouting<B> {
        &self.combined.routing
    }
}

/// A whole input-gradient backward run through an [`ExpertExchange`].
pub struct MoeWgrad<B: Backend> {
    experts: MoeExpertsWgrad<B>,
    prepare: MoePrepareWgrad<B>,
}

/// The all-to-alls around the experts, as the staged calls need them.
pub trait ExpertExchange<B: Backend> {
    /// `send[j]`: rows this rank sends to rank j, per local expert of rank j.
    /// Returns, per source rank i, the rows it sends here per local expert.
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>>;

    /// Sends `send_rows[j]` rows (of `width`) to rank j, in rank order, and
    /// returns the `recv_rows[i]` rows received from each rank i, in rank order.
    fn exchange_rows(
        &self,
        b: &B,
        send: Slice<'_, B>,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<B::Buf>;
}

/// The exchange of expert parallelism 1: every expert is local, so the rows
/// stay and are copied.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExchange;

impl<B: Backend> ExpertExchange<B> for LocalExchange {
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        if send.len() != 1 {
            return Err(RuntimeError::InvalidArgument(format!(
                "the local expert exchange serves expert parallelism 1, not {}; use a \
                 CollectiveExchange (or the staged calls) under expert parallelism",
                send.len()
            )));
        }
        Ok(send.to_vec())
    }

    fn exchange_rows(
        &self,
        b: &B,
        send: Slice<'_, B>,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<B::Buf> {
        if send_rows != recv_rows || send_rows.len() != 1 {
            return Err(RuntimeError::InvalidArgument(format!(
                "local expert exchange: sending {send_rows:?} rows but receiving {recv_rows:?}"
            )));
        }
        check_len(
            "local expert exchange",
            "send",
            b.slice_len(send),
            send_rows[0] * width,
        )?;
        copy_of(b, send)
    }
}

/// The exchange over an expert-parallel communicator: counts with
/// [`Collective::all_to_all_counts`], rows with [`Collective::all_to_all`].
pub struct CollectiveExchange<'c, C> {
    pub collective: &'c C,
}

impl<B: Backend, C: Collective<B>> ExpertExchange<B> for CollectiveExchange<'_, C> {
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        self.collective.all_to_all_counts(send)
    }

    fn exchange_rows(
        &self,
        b: &B,
        send: Slice<'_, B>,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<B::Buf> {
        let send_counts: Vec<usize> = send_rows.iter().map(|r| r * width).collect();
        let recv_counts: Vec<usize> = recv_rows.iter().map(|r| r * width).collect();
        let mut recv = zeros(b, recv_counts.iter().sum())?;
        self.collective
            .all_to_all(send, &send_counts, b.view_mut(&mut recv)?, &recv_counts)?;
        Ok(recv)
    }
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
            aux_coeff: m.aux_loss_coeff,
            expert_bias: m.expert_bias.then(|| vec![0.0; experts]),
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

    /// The f32 selection bias (`moe.expert_bias`), when enabled.
    pub fn expert_bias(&self) -> Option<&[f32]> {
        self.expert_bias.as_deref()
    }

    /// Replaces the selection bias (aux-loss-free balancing updates it
    /// between steps); an error when the config has no expert bias.
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

    fn route_dims(&self, rows: usize) -> RouteDims {
        RouteDims {
            rows,
            experts: self.experts,
            top_k: self.top_k,
            score: self.score,
        }
    }

    fn unpermute_dims(&self, tokens: usize) -> UnpermuteDims {
        UnpermuteDims {
            tokens,
            top_k: self.top_k,
            rows: tokens * self.top_k,
            width: self.hidden,
        }
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

    /// Pre-dispatch: norm, routing, aux loss, shared expert, permutation.
    /// Reads the residual `x` (the residual add happens in `combine`).
    pub fn prepare<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        x: Slice<'_, B>,
        tokens: Tokens,
    ) -> Result<MoePrepared<B>> {
        let name = "`E` layer prepare";
        check_weights(b, name, &self.params, weights)?;
        let rows = check_rows(name, "x", b.slice_len(x), tokens, self.hidden)?;
        let (h, e_n, k) = (self.hidden, self.experts, self.top_k);
        let w = |i| weight::<B>(weights, i);
        let x_in = copy_of(b, x)?;
        let (u, rstd) = self.norm().forward(b, w(PRE_NORM)?, b.view(&x_in)?, rows)?;
        let mut logits = zeros_f32(b, rows * e_n)?;
        b.matmul(
            b.view(&u)?,
            w(ROUTER)?,
            b.view_mut(&mut logits)?,
            MatmulDims::linear(rows, h, e_n),
        )?;
        let mut scores = zeros_f32(b, rows * e_n)?;
        let mut route_weights = zeros_f32(b, rows * k)?;
        let mut softmax_sum = zeros_f32(b, e_n)?;
        let mut selected = vec![0u32; rows * k];
        let out = RouteOutputs {
            scores: b.view_mut(&mut scores)?,
            weights: b.view_mut(&mut route_weights)?,
            softmax_sum: b.view_mut(&mut softmax_sum)?,
        };
        b.moe_route_forward(
            b.view(&logits)?,
            self.expert_bias.as_deref(),
            out,
            &mut selected,
            self.route_dims(rows),
        )?;
        let mut probability_sums = vec![0.0f32; e_n];
        b.download(b.view(&softmax_sum)?, &mut probability_sums)?;
        let mut counts = vec![0usize; e_n];
        for &e in &selected {
            if let Some(c) = counts.get_mut(e as usize) {
                *c += 1;
            }
        }
        let aux_loss = self.aux_loss(&counts, &probability_sums, rows);
        // Counting sort by expert; tokens and k-slots in order within one.
        let mut next: Vec<usize> = counts
            .iter()
            .scan(0usize, |acc, &c| {
                let start = *acc;
                *acc += c;
                Some(start)
            })
            .collect();
        let mut positions = vec![0u32; rows * k];
        let mut send_tokens = vec![0u32; rows * k];
        let row_index = |r: usize| {
            u32::try_from(r).map_err(|_| {
                RuntimeError::InvalidArgument(format!("{name}: {r} rows overflow u32"))
            })
        };
        for (slot, &e) in selected.iter().enumerate() {
            let at = next.get_mut(e as usize).ok_or_else(|| {
                RuntimeError::InvalidArgument(format!("{name}: routing picked expert {e} of {e_n}"))
            })?;
            positions[slot] = row_index(*at)?;
            send_tokens[*at] = row_index(slot / k)?;
            *at += 1;
        }
        let mut send = zeros(b, rows * k * h)?;
        b.gather_rows(b.view(&u)?, &send_tokens, b.view_mut(&mut send)?, h)?;
        let shared = match &self.shared {
            Some(ffn) => {
                let mut pre = zeros(b, ffn.pre_len(rows))?;
                let mut act = zeros(b, ffn.act_len(rows))?;
                let mut out = zeros(b, rows * h)?;
                let i = self.shared_fc1();
                ffn.forward(
                    b,
                    (w(i)?, w(i + 1)?),
                    b.view(&u)?,
                    b.view_mut(&mut pre)?,
                    b.view_mut(&mut act)?,
                    b.view_mut(&mut out)?,
                    rows,
                    false,
                )?;
                Some(SharedSaved { pre, act, out })
            }
            None => None,
        };
        Ok(MoePrepared {
            send,
            send_counts: counts.clone(),
            aux_loss,
            routing: MoeRouting {
                rows,
                x_in,
                rstd,
                u,
                logits,
                scores,
                weights: route_weights,
                selected,
                positions,
                counts,
                aux_loss,
                shared,
            },
        })
    }

    /// `coeff * E * sum_i f_i P_i`, `f_i = counts_i / (T k)`,
    /// `P_i = softmax_sum_i / T`, summed in f64 in expert order.
    fn aux_loss(&self, counts: &[usize], probability_sums: &[f32], rows: usize) -> f64 {
        if rows == 0 || self.aux_coeff == 0.0 {
            return 0.0;
        }
        let slots = (rows * self.top_k) as f64;
        let sum: f64 = counts
            .iter()
            .zip(probability_sums)
            .map(|(&c, &p)| (c as f64 / slots) * (p as f64 / rows as f64))
            .sum();
        self.aux_coeff as f64 * self.experts as f64 * sum
    }

    /// Rows received from each source rank for each local expert -> the
    /// grouped order (expert-major, then source rank): grouped row -> received row.
    fn regroup(&self, recv_counts: &[Vec<usize>]) -> Result<(Vec<usize>, Vec<u32>)> {
        let l = self.local_experts;
        let mut starts = Vec::with_capacity(recv_counts.len());
        let mut total = 0usize;
        for (src, counts) in recv_counts.iter().enumerate() {
            check_len(
                "`E` layer experts",
                &format!("recv_counts[{src}]"),
                counts.len(),
                l,
            )?;
            starts.push(total);
            total += counts.iter().sum::<usize>();
        }
        let mut expert_rows = vec![0usize; l];
        let mut regroup = Vec::with_capacity(total);
        for (j, rows_j) in expert_rows.iter_mut().enumerate() {
            for (counts, &start) in recv_counts.iter().zip(&starts) {
                let offset = start + counts[..j].iter().sum::<usize>();
                for r in offset..offset + counts[j] {
                    regroup.push(u32::try_from(r).map_err(|_| {
                        RuntimeError::InvalidArgument(format!("{r} received rows overflow u32"))
                    })?);
                }
                *rows_j += counts[j];
            }
        }
        Ok((expert_rows, regroup))
    }

    /// The mlp slot: runs the local experts on the received rows
    /// (`recv_counts[i][j]` rows from source rank i for local expert j, in
    /// that order) and writes their outputs to `out` in received order.
    pub fn experts<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        recv: Slice<'_, B>,
        recv_counts: &[Vec<usize>],
        mut out: SliceMut<'_, B>,
    ) -> Result<MoeExpertsSaved<B>> {
        let name = "`E` layer experts";
        check_weights(b, name, &self.params, weights)?;
        let (expert_rows, regroup) = self.regroup(recv_counts)?;
        let (h, ffn) = (self.hidden, self.expert);
        let total = regroup.len();
        check_len(name, "recv", b.slice_len(recv), total * h)?;
        check_len(name, "out", b.slice_len(b.as_slice(&out)), total * h)?;
        let mut input = zeros(b, total * h)?;
        b.gather_rows(recv, &regroup, b.view_mut(&mut input)?, h)?;
        let mut pre = zeros(b, ffn.pre_len(total))?;
        let mut act = zeros(b, ffn.act_len(total))?;
        let mut grouped = zeros(b, total * h)?;
        let mut start = 0;
        for (j, &n) in expert_rows.iter().enumerate() {
            if n > 0 {
                let rows = start..start + n;
                ffn.forward(
                    b,
                    (
                        weight::<B>(weights, self.fc1(j))?,
                        weight::<B>(weights, self.fc2(j))?,
                    ),
                    b.slice(&input, rows.start * h..rows.end * h)?,
                    b.slice_mut(&mut pre, ffn.pre_len(rows.start)..ffn.pre_len(rows.end))?,
                    b.slice_mut(&mut act, ffn.act_len(rows.start)..ffn.act_len(rows.end))?,
                    b.slice_mut(&mut grouped, rows.start * h..rows.end * h)?,
                    n,
                    false,
                )?;
            }
            start += n;
        }
        b.scatter_rows(b.view(&grouped)?, &regroup, b.reborrow_mut(&mut out), h)?;
        Ok(MoeExpertsSaved {
            expert_rows,
            regroup,
            input,
            pre,
            act,
        })
    }

    /// The combine slot: `x += sum_j w_j rows[pos(t, j)] + shared(u)`.
    /// `returned` holds the expert outputs in send order.
    pub fn combine<B: Backend>(
        &self,
        b: &B,
        routing: MoeRouting<B>,
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
        let mut moe_out = zeros(b, rows * h)?;
        b.moe_unpermute(
            b.view(&returned)?,
            Some(b.view(&routing.weights)?),
            &routing.positions,
            b.view_mut(&mut moe_out)?,
            self.unpermute_dims(rows),
        )?;
        if let Some(shared) = &routing.shared {
            b.axpy(1.0, b.view(&shared.out)?, b.view_mut(&mut moe_out)?)?;
        }
        b.axpy(1.0, b.view(&moe_out)?, b.reborrow_mut(&mut x))?;
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
        let mut d_returned = zeros(b, rows * k * h)?;
        let mut d_weights = zeros_f32(b, rows * k)?;
        let grads = UnpermuteGrads {
            rows: b.view_mut(&mut d_returned)?,
            weights: b.view_mut(&mut d_weights)?,
        };
        b.moe_unpermute_backward(
            dx,
            b.view(&combined.returned)?,
            b.view(&routing.weights)?,
            &routing.positions,
            grads,
            self.unpermute_dims(rows),
        )?;
        let d_out = match routing.shared {
            Some(_) => Some(copy_of(b, dx)?),
            None => None,
        };
        Ok(MoeCombineBackward {
            d_returned,
            state: MoeCombineGrad {
                routing,
                d_weights,
                d_out,
            },
        })
    }

    /// Experts backward: `d_out` is the gradient of the experts' outputs in
    /// received order; writes the gradient of their inputs to `d_in` (received
    /// order), ready to be sent back.
    pub fn experts_backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: MoeExpertsSaved<B>,
        d_out: Slice<'_, B>,
        mut d_in: SliceMut<'_, B>,
    ) -> Result<MoeExpertsWgrad<B>> {
        let name = "`E` layer experts backward";
        check_weights(b, name, &self.params, weights)?;
        let (h, ffn) = (self.hidden, self.expert);
        let total = saved.regroup.len();
        check_len(name, "d_out", b.slice_len(d_out), total * h)?;
        check_len(name, "d_in", b.slice_len(b.as_slice(&d_in)), total * h)?;
        let mut d_grouped = zeros(b, total * h)?;
        b.gather_rows(d_out, &saved.regroup, b.view_mut(&mut d_grouped)?, h)?;
        let mut d_pre = zeros(b, ffn.pre_len(total))?;
        let mut d_in_grouped = zeros(b, total * h)?;
        let mut start = 0;
        for (j, &n) in saved.expert_rows.iter().enumerate() {
            if n > 0 {
                let rows = start..start + n;
                ffn.backward_input(
                    b,
                    (
                        weight::<B>(weights, self.fc1(j))?,
                        weight::<B>(weights, self.fc2(j))?,
                    ),
                    b.slice(&saved.pre, ffn.pre_len(rows.start)..ffn.pre_len(rows.end))?,
                    b.slice(&d_grouped, rows.start * h..rows.end * h)?,
                    b.slice_mut(&mut d_pre, ffn.pre_len(rows.start)..ffn.pre_len(rows.end))?,
                    b.slice_mut(&mut d_in_grouped, rows.start * h..rows.end * h)?,
                    n,
                    false,
                )?;
            }
            start += n;
        }
        b.scatter_rows(
            b.view(&d_in_grouped)?,
            &saved.regroup,
            b.reborrow_mut(&mut d_in),
            h,
        )?;
        Ok(MoeExpertsWgrad {
            expert_rows: saved.expert_rows,
            input: saved.input,
            act: saved.act,
            d_pre,
            d_out: d_grouped,
        })
    }

    /// Accumulates the local experts' weight gradients.
    pub fn experts_backward_weight<B: Backend>(
        &self,
        b: &B,
        g: MoeExpertsWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`E` layer experts", &self.params, grads)?;
        let (h, ffn) = (self.hidden, self.expert);
        let mut start = 0;
        for (j, &n) in g.expert_rows.iter().enumerate() {
            if n > 0 {
                let rows = start..start + n;
                ffn.backward_weight(
                    b,
                    b.slice(&g.input, rows.start * h..rows.end * h)?,
                    b.slice(&g.act, ffn.act_len(rows.start)..ffn.act_len(rows.end))?,
                    b.slice(&g.d_pre, ffn.pre_len(rows.start)..ffn.pre_len(rows.end))?,
                    b.slice(&g.d_out, rows.start * h..rows.end * h)?,
                    grad_pair(b, grads, self.fc1(j), self.fc2(j))?,
                    n,
                )?;
            }
            start += n;
        }
        Ok(())
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
        mut dx: SliceMut<'_, B>,
        loss_scale: f32,
    ) -> Result<MoePrepareWgrad<B>> {
        let name = "`E` layer prepare backward";
        check_weights(b, name, &self.params, weights)?;
        let r = state.routing;
        let (rows, h, e_n, k) = (r.rows, self.hidden, self.experts, self.top_k);
        check_len(name, "d_send", b.slice_len(d_send), rows * k * h)?;
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * h)?;
        let w = |i| weight::<B>(weights, i);
        let mut d_u = zeros(b, rows * h)?;
        b.moe_unpermute(
            d_send,
            None,
            &r.positions,
            b.view_mut(&mut d_u)?,
            self.unpermute_dims(rows),
        )?;
        // dL_aux/dp[t, e] = coeff * E * f_e / T, times the caller's scale.
        let aux_grad: Vec<f32> = if rows == 0 {
            vec![0.0; e_n]
        } else {
            let slots = (rows * k) as f64;
            r.counts
                .iter()
                .map(|&c| {
                    (self.aux_coeff as f64 * e_n as f64 * (c as f64 / slots) / rows as f64
                        * loss_scale as f64) as f32
                })
                .collect()
        };
        let mut d_logits = zeros_f32(b, rows * e_n)?;
        b.moe_route_backward(
            RouterScores {
                logits: b.view(&r.logits)?,
                scores: b.view(&r.scores)?,
            },
            &r.selected,
            b.view(&state.d_weights)?,
            &aux_grad,
            b.view_mut(&mut d_logits)?,
            self.route_dims(rows),
        )?;
        b.matmul(
            b.view(&d_logits)?,
            w(ROUTER)?,
            b.view_mut(&mut d_u)?,
            MatmulDims::linear_input_grad(rows, h, e_n, true),
        )?;
        let shared = match (&self.shared, r.shared, state.d_out) {
            (Some(ffn), Some(saved), Some(d_out)) => {
                let mut d_pre = zeros(b, ffn.pre_len(rows))?;
                let i = self.shared_fc1();
                ffn.backward_input(
                    b,
                    (w(i)?, w(i + 1)?),
                    b.view(&saved.pre)?,
                    b.view(&d_out)?,
                    b.view_mut(&mut d_pre)?,
                    b.view_mut(&mut d_u)?,
                    rows,
                    true,
                )?;
                Some(SharedWgrad {
                    act: saved.act,
                    d_pre,
                    d_out,
                })
            }
            (None, None, None) => None,
            _ => {
                return Err(RuntimeError::InvalidArgument(format!(
                    "{name}: the saved state does not match the layer's shared expert"
                )));
            }
        };
        self.norm().backward_input(
            b,
            w(PRE_NORM)?,
            &r.x_in,
            &r.rstd,
            b.view(&d_u)?,
            b.reborrow_mut(&mut dx),
            rows,
        )?;
        Ok(MoePrepareWgrad {
            rows,
            x_in: r.x_in,
            rstd: r.rstd,
            u: r.u,
            d_u,
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
        let (rows, h) = (g.rows, self.hidden);
        self.norm().backward_weight(
            b,
            &g.x_in,
            &g.rstd,
            &g.d_u,
            grad(b, grads, PRE_NORM)?,
            rows,
        )?;
        b.matmul(
            b.view(&g.d_logits)?,
            b.view(&g.u)?,
            grad(b, grads, ROUTER)?,
            MatmulDims::linear_weight_grad(rows, h, self.experts),
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

    // ---- every stage back to back -------------------------------------------------

    /// The whole forward, exchanging rows through `exchange`.
    pub fn forward_with<B: Backend, X: ExpertExchange<B>>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
        exchange: &X,
    ) -> Result<MoeSaved<B>> {
        let prepared = self.prepare(b, weights, b.as_slice(&x), tokens)?;
        let send_counts = self.counts_per_rank(&prepared.send_counts)?;
        let recv_counts = exchange.exchange_counts(&send_counts)?;
        let send_rows: Vec<usize> = send_counts.iter().map(|c| c.iter().sum()).collect();
        let recv_rows: Vec<usize> = recv_counts.iter().map(|c| c.iter().sum()).collect();
        let h = self.hidden;
        let recv = exchange.exchange_rows(b, b.view(&prepared.send)?, &send_rows, &recv_rows, h)?;
        drop(prepared.send);
        let mut out = zeros(b, b.buf_len(&recv))?;
        let experts = self.experts(
            b,
            weights,
            b.view(&recv)?,
            &recv_counts,
            b.view_mut(&mut out)?,
        )?;
        drop(recv);
        let returned = exchange.exchange_rows(b, b.view(&out)?, &recv_rows, &send_rows, h)?;
        let combined = self.combine(b, prepared.routing, returned, b.reborrow_mut(&mut x))?;
        Ok(MoeSaved {
            combined,
            experts,
            send_rows,
            recv_rows,
        })
    }

    /// The whole input-gradient backward, exchanging rows through `exchange`.
    pub fn backward_input_with<B: Backend, X: ExpertExchange<B>>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: MoeSaved<B>,
        mut dx: SliceMut<'_, B>,
        loss_scale: f32,
        exchange: &X,
    ) -> Result<MoeWgrad<B>> {
        let h = self.hidden;
        let combined = self.combine_backward(b, saved.combined, b.as_slice(&dx))?;
        let d_out = exchange.exchange_rows(
            b,
            b.view(&combined.d_returned)?,
            &saved.send_rows,
            &saved.recv_rows,
            h,
        )?;
        drop(combined.d_returned);
        let mut d_in = zeros(b, b.buf_len(&d_out))?;
        let experts = self.experts_backward_input(
            b,
            weights,
            saved.experts,
            b.view(&d_out)?,
            b.view_mut(&mut d_in)?,
        )?;
        drop(d_out);
        let d_send =
            exchange.exchange_rows(b, b.view(&d_in)?, &saved.recv_rows, &saved.send_rows, h)?;
        let prepare = self.prepare_backward_input(
            b,
            weights,
            combined.state,
            b.view(&d_send)?,
            b.reborrow_mut(&mut dx),
            loss_scale,
        )?;
        Ok(MoeWgrad { experts, prepare })
    }

    /// Both weight-gradient parts.
    pub fn backward_weight_with<B: Backend>(
        &self,
        b: &B,
        wgrad: MoeWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        self.experts_backward_weight(b, wgrad.experts, grads)?;
        self.prepare_backward_weight(b, wgrad.prepare, grads)
    }
}

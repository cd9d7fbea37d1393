//! The router (layers.md `E` steps 1-3): f32 logits `u W_router^T`, scores
//! and the top-k selection, the per-expert counts, and the load-balancing
//! loss, all in device buffers; and their backward. Routing runs in f32 in
//! every precision (logits, scores, weights); the selection and the counts
//! are u32.

use super::MoeLayer;
use crate::backend::{
    AuxLossDims, Backend, DType, ExpertBias, MatmulDims, RouteDims, RouteOutputs, RoutedSlots,
    RouterScores, Slice, SliceMut,
};
use crate::error::{Result, RuntimeError};
use crate::layers::{uninit_f32, zeros_f32};

/// What the router keeps from the forward for the backward (and, for its
/// counts, for the dispatch).
pub(super) struct RouterSaved<B: Backend> {
    /// `[T, E]` f32.
    pub logits: B::Buf,
    /// `[T, E]` f32.
    pub scores: B::Buf,
    /// `[T, k]` f32: each token's weights of its selected experts.
    pub weights: B::Buf,
    /// `[T, k]` u32: each token's experts (global indices), best first.
    pub selected: B::Buf,
    /// `[E]` u32: the slots routed to each global expert.
    pub counts: B::Buf,
    /// `[E]` u32, with an expert bias: the slots each expert would get
    /// without it, which the load-balancing loss counts (without a bias
    /// that is `counts`).
    pub unbiased_counts: Option<B::Buf>,
}

impl<B: Backend> RouterSaved<B> {
    /// The counts of the load-balancing loss: the top-k without the bias.
    fn aux_counts(&self) -> &B::Buf {
        self.unbiased_counts.as_ref().unwrap_or(&self.counts)
    }
}

impl MoeLayer {
    pub(super) fn route_dims(&self, rows: usize) -> RouteDims {
        RouteDims {
            rows,
            experts: self.experts,
            top_k: self.top_k,
            score: self.score,
            topk_scale: self.topk_scale,
        }
    }

    pub(super) fn routed_slots(&self, rows: usize) -> RoutedSlots {
        RoutedSlots {
            tokens: rows,
            top_k: self.top_k,
            experts: self.experts,
        }
    }

    fn aux_dims(&self, rows: usize) -> AuxLossDims {
        AuxLossDims {
            slots: self.routed_slots(rows),
            coeff: self.aux_coeff,
        }
    }

    /// Routes `rows` rows of the normed input `u`: logits, scores, the top-k
    /// selection and weights, the per-expert counts; adds the load-balancing
    /// loss (with its coefficient) to `aux_acc` (one f64) on the device.
    /// `expert_bias` (`[E]` f32 on the device) is the training's bias; a
    /// layer with a bias routed without one uses its own (standalone calls).
    pub(super) fn route<B: Backend>(
        &self,
        b: &B,
        w_router: Slice<'_, B>,
        u: Slice<'_, B>,
        rows: usize,
        aux_acc: SliceMut<'_, B>,
        expert_bias: Option<Slice<'_, B>>,
    ) -> Result<RouterSaved<B>> {
        let (h, e_n, k) = (self.hidden, self.experts, self.top_k);
        // f32 logits from compute-dtype operands: f32 accumulation, no
        // rounding to bf16 before the softmax.
        let logits = uninit_f32(b, rows * e_n)?;
        b.matmul(
            u,
            w_router,
            b.view_mut(&logits)?,
            MatmulDims::linear(rows, h, e_n),
        )?;
        let scores = uninit_f32(b, rows * e_n)?;
        let weights = uninit_f32(b, rows * k)?;
        // The load-balancing loss's sums, only where it counts.
        let prob_sum = (self.aux_coeff != 0.0)
            .then(|| zeros_f32(b, e_n))
            .transpose()?;
        let selected = b.alloc_uninit(rows * k, DType::U32)?;
        // A standalone call routes with the layer's own bias, uploaded here
        // (E values); training passes its device buffer.
        let own_bias = match (&self.expert_bias, expert_bias) {
            (None, Some(_)) => {
                return Err(RuntimeError::InvalidArgument(
                    "`E` layer: an expert bias was given, but the model routes without one \
                     (`moe.expert_bias` is off)"
                        .into(),
                ));
            }
            (Some(values), None) => {
                let buf = uninit_f32(b, values.len())?;
                b.upload(values, b.view_mut(&buf)?)?;
                Some(buf)
            }
            _ => None,
        };
        let bias = match (&own_bias, expert_bias) {
            (Some(buf), _) => Some(b.view(buf)?),
            (None, given) => given,
        };
        let unbiased = match bias {
            Some(_) => Some(b.alloc_uninit(rows * k, DType::U32)?),
            None => None,
        };
        let expert_bias = match (bias, &unbiased) {
            (Some(bias), Some(unbiased)) => Some(ExpertBias {
                bias,
                unbiased: b.view_mut(unbiased)?,
            }),
            _ => None,
        };
        b.moe_route_forward(
            b.view(&logits)?,
            expert_bias,
            RouteOutputs {
                scores: b.view_mut(&scores)?,
                weights: b.view_mut(&weights)?,
                prob_sum: prob_sum.as_ref().map(|p| b.view_mut(p)).transpose()?,
            },
            b.view_mut(&selected)?,
            self.route_dims(rows),
        )?;
        let histogram = |of: &B::Buf| -> Result<B::Buf> {
            let counts = b.alloc_uninit(e_n, DType::U32)?;
            b.moe_expert_counts(b.view(of)?, b.view_mut(&counts)?, self.routed_slots(rows))?;
            Ok(counts)
        };
        let saved = RouterSaved {
            counts: histogram(&selected)?,
            unbiased_counts: unbiased.as_ref().map(histogram).transpose()?,
            logits,
            scores,
            weights,
            selected,
        };
        if let Some(prob_sum) = &prob_sum {
            b.moe_aux_loss_forward(
                b.view(saved.aux_counts())?,
                b.view(prob_sum)?,
                aux_acc,
                self.aux_dims(rows),
            )?;
        }
        Ok(saved)
    }

    /// The logits' gradient from the routing weights' gradient `d_weights`
    /// (f32 `[T, k]`) and the load-balancing loss's (times `loss_scale`),
    /// returned in the compute dtype, ready for the router's two matmuls.
    pub(super) fn route_backward<B: Backend>(
        &self,
        b: &B,
        saved: &RouterSaved<B>,
        d_weights: Slice<'_, B>,
        rows: usize,
        loss_scale: f32,
    ) -> Result<B::Buf> {
        let e_n = self.experts;
        let aux_grad = uninit_f32(b, e_n)?;
        b.moe_aux_loss_backward(
            b.view(saved.aux_counts())?,
            b.view_mut(&aux_grad)?,
            self.aux_dims(rows),
            loss_scale,
        )?;
        let d_logits = uninit_f32(b, rows * e_n)?;
        b.moe_route_backward(
            RouterScores {
                logits: b.view(&saved.logits)?,
                scores: b.view(&saved.scores)?,
            },
            b.view(&saved.selected)?,
            d_weights,
            b.view(&aux_grad)?,
            b.view_mut(&d_logits)?,
            self.route_dims(rows),
        )?;
        // The routing gradient is f32, but `d_u += d_logits W_router` and
        // `dW_router += d_logits^T u` multiply it with compute-dtype operands
        // (the router weight, the normed input), and a matmul takes A and B
        // of one dtype. In bf16 the gradient is therefore rounded to bf16
        // once, here, explicitly; both GEMMs then run on bf16 operands with
        // f32 accumulation like every other GEMM of a bf16 run. In f32 it is
        // already the compute dtype and stays as it is (no copy).
        if b.compute_dtype() == DType::F32 {
            return Ok(d_logits);
        }
        let cast = b.alloc_uninit(rows * e_n, b.compute_dtype())?;
        b.cast(b.view(&d_logits)?, b.view_mut(&cast)?)?;
        Ok(cast)
    }

    /// `d_u += d_logits W_router`.
    pub(super) fn router_backward_input<B: Backend>(
        &self,
        b: &B,
        w_router: Slice<'_, B>,
        d_logits: Slice<'_, B>,
        d_u: SliceMut<'_, B>,
        rows: usize,
    ) -> Result<()> {
        b.matmul(
            d_logits,
            w_router,
            d_u,
            MatmulDims::linear_input_grad(rows, self.hidden, self.experts, true),
        )
    }

    /// `dW_router += d_logits^T u`.
    pub(super) fn router_backward_weight<B: Backend>(
        &self,
        b: &B,
        d_logits: Slice<'_, B>,
        u: Slice<'_, B>,
        dw: SliceMut<'_, B>,
        rows: usize,
    ) -> Result<()> {
        b.matmul(
            d_logits,
            u,
            dw,
            MatmulDims::linear_weight_grad(rows, self.hidden, self.experts),
        )
    }
}

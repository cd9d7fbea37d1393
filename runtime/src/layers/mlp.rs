//! `-`: the dense MLP, and the feed-forward block it shares with the MoE
//! experts and the shared expert (`act(u W1^T) W2^T`, no biases).

use super::norm::{NormPartials, RmsNorm};
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, grad, grad_pair, positive, section,
    uninit, weight, weight_rows,
};
use crate::backend::{Backend, MatmulDims, Slice, SliceMut, Unary};
use crate::error::Result;
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::config::Activation;
use hybridgen_dsl::params::{ParamDef, layer_params};

/// The feed-forward block `out (+)= act(u W1^T) W2^T` on `n` rows.
///
/// Its buffers are caller-owned views so an MoE layer can run every expert
/// on a row range of one buffer. `pre` holds the fc1 output: `[n, F]`, or for
/// SwiGLU the two planes `[gate: n x F | up: n x F]` (W1's rows `[0, F)` are
/// the gate, `[F, 2F)` the up projection, as Megatron's `[gate | up]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ffn {
    pub hidden: usize,
    pub width: usize,
    pub activation: Activation,
}

impl Ffn {
    /// Elements of `pre` (and `d_pre`) for `n` rows.
    pub fn pre_len(&self, n: usize) -> usize {
        n * self.width * self.activation.fc1_factor()
    }

    /// Elements of `act` for `n` rows.
    pub fn act_len(&self, n: usize) -> usize {
        n * self.width
    }

    /// The element-wise activation; `None` for SwiGLU (gated, two inputs).
    pub fn unary(&self) -> Option<Unary> {
        match self.activation {
            Activation::SquaredRelu => Some(Unary::SquaredRelu),
            Activation::Gelu => Some(Unary::Gelu),
            Activation::Swiglu => None,
        }
    }

    /// `act = act(pre)` on `n` rows, in the forward. The backward needs
    /// `act` again for the fc2 weight gradient and recomputes it rather than
    /// the forward keeping it: [`Ffn::backward_input`]'s activation backward
    /// writes it over the spent activation gradient in the same pass (the
    /// same expression on the same values, so the same bits), which spares
    /// keeping `act` from a layer's forward to its backward (what Megatron's
    /// selective `--recompute-modules moe_act` does for its experts; here
    /// always, for every feed-forward block).
    pub fn activate<B: Backend>(
        &self,
        b: &B,
        pre: Slice<'_, B>,
        act: SliceMut<'_, B>,
        n: usize,
    ) -> Result<()> {
        match self.unary() {
            Some(op) => b.unary_forward(op, pre, act),
            None => {
                let f = self.width;
                b.silu_mul_forward(
                    b.subslice(pre, 0..n * f)?,
                    b.subslice(pre, n * f..2 * n * f)?,
                    act,
                )
            }
        }
    }

    /// `out (+)= act(u W1^T) W2^T`, keeping `pre`; `act` is scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        (w1, w2): (Slice<'_, B>, Slice<'_, B>),
        u: Slice<'_, B>,
        mut pre: SliceMut<'_, B>,
        mut act: SliceMut<'_, B>,
        out: SliceMut<'_, B>,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (h, f) = (self.hidden, self.width);
        match self.unary() {
            Some(_) => b.matmul(u, w1, b.reborrow_mut(&mut pre), MatmulDims::linear(n, h, f))?,
            None => {
                let (mut gate, mut up) = b.split_mut(b.reborrow_mut(&mut pre), n * f)?;
                let w_gate = weight_rows(b, w1, h, 0..f)?;
                let w_up = weight_rows(b, w1, h, f..2 * f)?;
                b.matmul(
                    u,
                    w_gate,
                    b.reborrow_mut(&mut gate),
                    MatmulDims::linear(n, h, f),
                )?;
                b.matmul(
                    u,
                    w_up,
                    b.reborrow_mut(&mut up),
                    MatmulDims::linear(n, h, f),
                )?;
            }
        }
        self.activate(b, b.as_slice(&pre), b.reborrow_mut(&mut act), n)?;
        let mut dims = MatmulDims::linear(n, f, h);
        dims.accumulate = accumulate;
        b.matmul(b.as_slice(&act), w2, out, dims)
    }

    /// `d_u (+)= J^T d_out`, writing `d_pre` (kept for the weight
    /// gradient). Returns `act(pre)` (`act_len(n)` values), recomputed for
    /// the fc2 weight gradient in the buffer the activation's gradient
    /// held.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        (w1, w2): (Slice<'_, B>, Slice<'_, B>),
        pre: Slice<'_, B>,
        d_out: Slice<'_, B>,
        d_pre: SliceMut<'_, B>,
        mut d_u: SliceMut<'_, B>,
        n: usize,
        accumulate: bool,
    ) -> Result<B::Buf> {
        let (h, f) = (self.hidden, self.width);
        let d_act = uninit(b, self.act_len(n))?;
        b.matmul(
            d_out,
            w2,
            b.view_mut(&d_act)?,
            MatmulDims::linear_input_grad(n, f, h, false),
        )?;
        match self.unary() {
            Some(op) => {
                let mut d_pre = d_pre;
                b.unary_backward_recompute(
                    op,
                    pre,
                    b.view_mut(&d_act)?,
                    b.reborrow_mut(&mut d_pre),
                )?;
                b.matmul(
                    b.as_slice(&d_pre),
                    w1,
                    d_u,
                    MatmulDims::linear_input_grad(n, h, f, accumulate),
                )?;
            }
            None => {
                let gate = b.subslice(pre, 0..n * f)?;
                let up = b.subslice(pre, n * f..2 * n * f)?;
                let (mut d_gate, mut d_up) = b.split_mut(d_pre, n * f)?;
                b.silu_mul_backward_recompute(
                    gate,
                    up,
                    b.view_mut(&d_act)?,
                    b.reborrow_mut(&mut d_gate),
                    b.reborrow_mut(&mut d_up),
                )?;
                let w_gate = weight_rows(b, w1, h, 0..f)?;
                let w_up = weight_rows(b, w1, h, f..2 * f)?;
                b.matmul(
                    b.as_slice(&d_gate),
                    w_gate,
                    b.reborrow_mut(&mut d_u),
                    MatmulDims::linear_input_grad(n, h, f, accumulate),
                )?;
                b.matmul(
                    b.as_slice(&d_up),
                    w_up,
                    d_u,
                    MatmulDims::linear_input_grad(n, h, f, true),
                )?;
            }
        }
        Ok(d_act)
    }

    /// `dW1 += d_pre^T u`, `dW2 += d_out^T act`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        u: Slice<'_, B>,
        act: Slice<'_, B>,
        d_pre: Slice<'_, B>,
        d_out: Slice<'_, B>,
        (mut dw1, dw2): (SliceMut<'_, B>, SliceMut<'_, B>),
        n: usize,
    ) -> Result<()> {
        let (h, f) = (self.hidden, self.width);
        b.matmul(d_out, act, dw2, MatmulDims::linear_weight_grad(n, f, h))?;
        match self.unary() {
            Some(_) => b.matmul(d_pre, u, dw1, MatmulDims::linear_weight_grad(n, h, f)),
            None => {
                let d_gate = b.subslice(d_pre, 0..n * f)?;
                let d_up = b.subslice(d_pre, n * f..2 * n * f)?;
                b.matmul(
                    d_gate,
                    u,
                    b.subslice_mut(&mut dw1, 0..f * h)?,
                    MatmulDims::linear_weight_grad(n, h, f),
                )?;
                b.matmul(
                    d_up,
                    u,
                    b.subslice_mut(&mut dw1, f * h..2 * f * h)?,
                    MatmulDims::linear_weight_grad(n, h, f),
                )
            }
        }
    }
}

/// `-`: `x += act(RMSNorm(x) W_fc1^T) W_fc2^T`.
#[derive(Clone, Debug)]
pub struct MlpLayer {
    ffn: Ffn,
    params: Vec<ParamDef>,
}

/// Parameter indices (params.md order).
const NORM: usize = 0;
const FC1: usize = 1;
const FC2: usize = 2;

/// What [`MlpLayer::forward`] keeps.
pub struct MlpSaved<B: Backend> {
    rows: usize,
    x_in: B::Buf,
    rstd: B::Buf,
    u: B::Buf,
    pre: B::Buf,
}

/// What [`MlpLayer::backward_input`] keeps.
pub struct MlpWgrad<B: Backend> {
    rows: usize,
    norm: NormPartials<B>,
    u: B::Buf,
    act: B::Buf,
    d_out: B::Buf,
    d_pre: B::Buf,
}

impl MlpLayer {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let m = section(&config.mlp, LayerKind::Mlp, "mlp")?;
        Ok(MlpLayer {
            ffn: Ffn {
                hidden: positive("hidden_size", config.hidden_size)?,
                width: positive("mlp.ffn_hidden_size", m.ffn_hidden_size)?,
                activation: m.activation,
            },
            params: layer_params(LayerKind::Mlp, config, 0),
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    fn norm(&self) -> RmsNorm {
        RmsNorm::plain(self.ffn.hidden)
    }

    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<MlpSaved<B>> {
        check_weights(b, "`-` layer", &self.params, weights)?;
        let rows = check_rows(
            "`-` layer",
            "x",
            b.slice_len(b.as_slice(&x)),
            tokens,
            self.ffn.hidden,
        )?;
        let (u, rstd, x_in) = self.norm().forward_keeping_input(
            b,
            weight::<B>(weights, NORM)?,
            b.as_slice(&x),
            rows,
        )?;
        let pre = uninit(b, self.ffn.pre_len(rows))?;
        let act = uninit(b, self.ffn.act_len(rows))?;
        let w = (weight::<B>(weights, FC1)?, weight::<B>(weights, FC2)?);
        self.ffn.forward(
            b,
            w,
            b.view(&u)?,
            b.view_mut(&pre)?,
            b.view_mut(&act)?,
            x,
            rows,
            true,
        )?;
        Ok(MlpSaved {
            rows,
            x_in,
            rstd,
            u,
            pre,
        })
    }

    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: MlpSaved<B>,
        mut dx: SliceMut<'_, B>,
    ) -> Result<MlpWgrad<B>> {
        check_weights(b, "`-` layer", &self.params, weights)?;
        let rows = saved.rows;
        check_len(
            "`-` layer backward",
            "dx",
            b.slice_len(b.as_slice(&dx)),
            rows * self.ffn.hidden,
        )?;
        let d_pre = uninit(b, self.ffn.pre_len(rows))?;
        let d_u = uninit(b, rows * self.ffn.hidden)?;
        let w = (weight::<B>(weights, FC1)?, weight::<B>(weights, FC2)?);
        // `act`: the fc2 weight gradient's operand, recomputed from `pre`
        // before it goes.
        let act = self.ffn.backward_input(
            b,
            w,
            b.view(&saved.pre)?,
            b.as_slice(&dx),
            b.view_mut(&d_pre)?,
            b.view_mut(&d_u)?,
            rows,
            false,
        )?;
        drop(saved.pre);
        // dx keeps the output's gradient until here; the weight gradients
        // keep it, copied in the norm's pass.
        let (d_out, norm) = self.norm().backward_input_keeping_dx(
            b,
            weight::<B>(weights, NORM)?,
            &saved.x_in,
            &saved.rstd,
            b.view(&d_u)?,
            b.reborrow_mut(&mut dx),
            rows,
        )?;
        Ok(MlpWgrad {
            rows,
            norm,
            u: saved.u,
            act,
            d_out,
            d_pre,
        })
    }

    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        wgrad: MlpWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`-` layer", &self.params, grads)?;
        let rows = wgrad.rows;
        self.norm()
            .backward_weight(b, &wgrad.norm, grad(b, grads, NORM)?)?;
        let dw = grad_pair(b, grads, FC1, FC2)?;
        self.ffn.backward_weight(
            b,
            b.view(&wgrad.u)?,
            b.view(&wgrad.act)?,
            b.view(&wgrad.d_pre)?,
            b.view(&wgrad.d_out)?,
            dw,
            rows,
        )
    }
}

//! `G`: the gated delta net (layers.md `G`), Megatron-LM's `GatedDeltaNet`,
//! with the recurrence evaluated sequentially per value head and the state
//! kept only at chunk starts.

use super::norm::{NormPartials, RmsNorm};
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, grad, positive, section, uninit,
    uninit_f32, weight, zeros, zeros_f32,
};
use super::{conv_silu, split_projection};
use crate::backend::{
    Backend, ConvDims, DeltaDims, DeltaGrads, DeltaInputs, MatmulDims, Slice, SliceMut,
};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::{ParamDef, layer_params};
use std::ops::Range;

/// Parameter indices (params.md order).
const DT_BIAS: usize = 0;
const A_LOG: usize = 1;
const IN_NORM: usize = 2;
const IN_PROJ: usize = 3;
const CONV_W: usize = 4;
const OUT_NORM: usize = 5;
const OUT_PROJ: usize = 6;

/// Steps between the states the forward keeps for the backward (the chunk
/// of Megatron's chunked kernel). On the CPU any value gives the same
/// bits; the GPU's kernels evaluate the recurrence in chunks of exactly
/// this many steps (their `DELTA_CHUNK`: 64 keeps a chunk's triangular
/// solve and scores in a block's shared memory) and save the state at
/// each chunk's start, so they take no other value.
pub const STATE_CHUNK: usize = 64;

/// `G`: `x += W_out (RMSNorm_head(Delta(SiLU(Conv(qkv)), beta, alpha)) *
/// silu(z))` on `[qkv | z | beta | alpha] = RMSNorm(x) W_in^T`.
#[derive(Clone, Debug)]
pub struct GdnLayer {
    hidden: usize,
    key_heads: usize,
    value_heads: usize,
    key_dim: usize,
    value_dim: usize,
    conv_kernel: usize,
    params: Vec<ParamDef>,
}

/// What [`GdnLayer::forward`] keeps.
///
/// The backward recomputes the rest from these, the same kernels on the same
/// values (so the bits of keeping them): the convolution's output before
/// and after the SiLU from `qkv_in`, the output norm from `out`, the gated
/// output from `z` and the norm. Beside the input, its norm and the gates,
/// that keeps `c + 2 vd` values a token instead of `3 c + 4 vd` (and no
/// f32 `rstd` a value head), for a convolution, a norm and two element-wise
/// passes more in the backward.
pub struct GdnSaved<B: Backend> {
    tokens: Tokens,
    x_in: B::Buf,
    rstd_in: B::Buf,
    u: B::Buf,
    z: B::Buf,
    beta: B::Buf,
    alpha: B::Buf,
    qkv_in: B::Buf,
    states: B::Buf,
    out: B::Buf,
}

/// The gated output `silu(z) * RMSNorm(o)`, with the norm's output and
/// `rstd` (`GdnLayer::gated_output`).
struct GatedOutput<B: Backend> {
    gated: B::Buf,
    normed: B::Buf,
    rstd: B::Buf,
}

/// What [`GdnLayer::backward_input`] keeps.
pub struct GdnWgrad<B: Backend> {
    tokens: Tokens,
    in_norm: NormPartials<B>,
    u: B::Buf,
    d_z: B::Buf,
    d_beta: B::Buf,
    d_alpha: B::Buf,
    qkv_in: B::Buf,
    d_qkv_in: B::Buf,
    d_qkv_conv: B::Buf,
    d_a_log: B::Buf,
    out_norm: NormPartials<B>,
    gated: B::Buf,
    d_out: B::Buf,
}

impl GdnLayer {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let g = section(&config.gdn, LayerKind::GatedDeltaNet, "gdn")?;
        let key_heads = positive("gdn.key_heads", g.key_heads)?;
        let value_heads = positive("gdn.value_heads", g.value_heads)?;
        if value_heads % key_heads != 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "gdn.key_heads = {key_heads} does not divide gdn.value_heads = {value_heads}"
            )));
        }
        Ok(GdnLayer {
            hidden: positive("hidden_size", config.hidden_size)?,
            key_heads,
            value_heads,
            key_dim: positive("gdn.key_head_dim", g.key_head_dim)?,
            value_dim: positive("gdn.value_head_dim", g.value_head_dim)?,
            conv_kernel: positive("gdn.conv_kernel", g.conv_kernel)?,
            params: layer_params(LayerKind::GatedDeltaNet, config, 0),
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    /// `Kd = Hk*dk`.
    fn key_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    /// `Vd = Hv*dv'`.
    fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// Conv channels: `q | k | v`.
    fn conv_dim(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    fn in_norm(&self) -> RmsNorm {
        RmsNorm::plain(self.hidden)
    }

    /// The output norm: one `dv'` weight shared by every value head, each
    /// head's row normalised on its own (rows `[rows * Hv, dv']`).
    fn out_norm(&self) -> RmsNorm {
        RmsNorm::plain(self.value_dim)
    }

    fn conv_dims(&self, tokens: Tokens) -> ConvDims {
        ConvDims {
            tokens,
            channels: self.conv_dim(),
            kernel: self.conv_kernel,
        }
    }

    fn delta_dims(&self, tokens: Tokens) -> DeltaDims {
        DeltaDims {
            tokens,
            key_heads: self.key_heads,
            value_heads: self.value_heads,
            key_dim: self.key_dim,
            value_dim: self.value_dim,
            chunk: STATE_CHUNK,
        }
    }

    /// Row blocks of `in_proj`, in Megatron's order: `q | k | v` (the conv's
    /// input), `z`, `beta`, `alpha`.
    fn proj_blocks(&self) -> [Range<usize>; 4] {
        let (c, v, hv) = (self.conv_dim(), self.value_width(), self.value_heads);
        [
            0..c,
            c..c + v,
            c + v..c + v + hv,
            c + v + hv..c + v + 2 * hv,
        ]
    }

    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<GdnSaved<B>> {
        let name = "`G` layer";
        check_weights(b, name, &self.params, weights)?;
        let rows = check_rows(name, "x", b.slice_len(b.as_slice(&x)), tokens, self.hidden)?;
        let (h, c, vd, hv) = (
            self.hidden,
            self.conv_dim(),
            self.value_width(),
            self.value_heads,
        );
        let w = |i| weight::<B>(weights, i);
        let (u, rstd_in, x_in) =
            self.in_norm()
                .forward_keeping_input(b, w(IN_NORM)?, b.as_slice(&x), rows)?;
        // One fused projection, computed per row block so each output is contiguous.
        let [bqkv, bz, bbeta, balpha] = self.proj_blocks();
        let mut qkv_in = uninit(b, rows * c)?;
        let mut z = uninit(b, rows * vd)?;
        let mut beta = uninit(b, rows * hv)?;
        let mut alpha = uninit(b, rows * hv)?;
        split_projection::forward(
            b,
            w(IN_PROJ)?,
            h,
            rows,
            &u,
            [
                (bqkv, &mut qkv_in),
                (bz, &mut z),
                (bbeta, &mut beta),
                (balpha, &mut alpha),
            ],
        )?;
        let (qkv_conv, qkv) = self.conv_outputs(b, weights, &qkv_in, tokens)?;
        let dims = self.delta_dims(tokens);
        let out = uninit(b, rows * vd)?;
        let states = uninit_f32(b, dims.states_len())?;
        let inputs = DeltaInputs {
            qkv: b.view(&qkv)?,
            beta: b.view(&beta)?,
            alpha: b.view(&alpha)?,
            dt_bias: w(DT_BIAS)?,
            a_log: w(A_LOG)?,
        };
        b.gated_delta_forward(inputs, b.view_mut(&out)?, b.view_mut(&states)?, dims)?;
        drop((qkv_conv, qkv));
        let GatedOutput { gated, .. } = self.gated_output(b, weights, &out, &z, rows)?;
        let mut proj = MatmulDims::linear(rows, vd, h);
        proj.accumulate = true;
        b.matmul(b.view(&gated)?, w(OUT_PROJ)?, b.reborrow_mut(&mut x), proj)?;
        Ok(GdnSaved {
            tokens,
            x_in,
            rstd_in,
            u,
            z,
            beta,
            alpha,
            qkv_in,
            states,
            out,
        })
    }

    /// `silu(z) * RMSNorm(out)` per value head, with the norm's output and
    /// `rstd`: in the forward, and again in the backward from what the
    /// forward kept.
    fn gated_output<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        out: &B::Buf,
        z: &B::Buf,
        rows: usize,
    ) -> Result<GatedOutput<B>> {
        let (normed, rstd) = self.out_norm().forward(
            b,
            weight::<B>(weights, OUT_NORM)?,
            b.view(out)?,
            rows * self.value_heads,
        )?;
        let gated = uninit(b, rows * self.value_width())?;
        b.silu_mul_forward(b.view(z)?, b.view(&normed)?, b.view_mut(&gated)?)?;
        Ok(GatedOutput {
            gated,
            normed,
            rstd,
        })
    }

    /// The convolution's output before and after the SiLU, from its input.
    fn conv_outputs<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        qkv_in: &B::Buf,
        tokens: Tokens,
    ) -> Result<(B::Buf, B::Buf)> {
        // Megatron's conv has no bias; the kernel takes one, so a zero one.
        let no_bias = zeros(b, self.conv_dim())?;
        conv_silu::forward(
            b,
            b.view(qkv_in)?,
            weight::<B>(weights, CONV_W)?,
            b.view(&no_bias)?,
            self.conv_dims(tokens),
        )
    }

    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        s: GdnSaved<B>,
        mut dx: SliceMut<'_, B>,
    ) -> Result<GdnWgrad<B>> {
        let name = "`G` layer backward";
        check_weights(b, name, &self.params, weights)?;
        let tokens = s.tokens;
        let rows = tokens.rows()?;
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * self.hidden)?;
        let (h, c, vd, hv) = (
            self.hidden,
            self.conv_dim(),
            self.value_width(),
            self.value_heads,
        );
        let w = |i| weight::<B>(weights, i);
        // The gated output (the output projection's weight-gradient
        // operand) and the output norm, as the forward computed them.
        let GatedOutput {
            gated,
            normed,
            rstd: rstd_out,
        } = self.gated_output(b, weights, &s.out, &s.z, rows)?;
        let d_gated = uninit(b, rows * vd)?;
        b.matmul(
            b.as_slice(&dx),
            w(OUT_PROJ)?,
            b.view_mut(&d_gated)?,
            MatmulDims::linear_input_grad(rows, vd, h, false),
        )?;
        let d_z = uninit(b, rows * vd)?;
        let d_normed = uninit(b, rows * vd)?;
        b.silu_mul_backward(
            b.view(&s.z)?,
            b.view(&normed)?,
            b.view(&d_gated)?,
            b.view_mut(&d_z)?,
            b.view_mut(&d_normed)?,
        )?;
        drop((normed, d_gated));
        let d_out_heads = zeros(b, rows * vd)?;
        let out_norm = self.out_norm().backward_input(
            b,
            w(OUT_NORM)?,
            &s.out,
            &rstd_out,
            b.view(&d_normed)?,
            b.view_mut(&d_out_heads)?,
            rows * hv,
        )?;
        drop((rstd_out, d_normed));
        // The recurrence's and the SiLU's inputs, as the forward computed
        // them.
        let (qkv_conv, qkv) = self.conv_outputs(b, weights, &s.qkv_in, tokens)?;
        let d_qkv = uninit(b, rows * c)?;
        let d_beta = uninit(b, rows * hv)?;
        let d_alpha = uninit(b, rows * hv)?;
        let d_a_log = zeros_f32(b, hv)?;
        let inputs = DeltaInputs {
            qkv: b.view(&qkv)?,
            beta: b.view(&s.beta)?,
            alpha: b.view(&s.alpha)?,
            dt_bias: w(DT_BIAS)?,
            a_log: w(A_LOG)?,
        };
        let grads = DeltaGrads {
            qkv: b.view_mut(&d_qkv)?,
            beta: b.view_mut(&d_beta)?,
            alpha: b.view_mut(&d_alpha)?,
            a_log: b.view_mut(&d_a_log)?,
        };
        b.gated_delta_backward(
            inputs,
            b.view(&s.states)?,
            b.view(&d_out_heads)?,
            grads,
            self.delta_dims(tokens),
        )?;
        drop(qkv);
        let (d_qkv_conv, d_qkv_in) = conv_silu::backward_input(
            b,
            b.view(&qkv_conv)?,
            b.view(&d_qkv)?,
            w(CONV_W)?,
            self.conv_dims(tokens),
        )?;
        drop((qkv_conv, d_qkv));
        let [bqkv, bz, bbeta, balpha] = self.proj_blocks();
        let d_u = split_projection::input_grad(
            b,
            w(IN_PROJ)?,
            h,
            rows,
            [
                (bqkv, &d_qkv_in),
                (bz, &d_z),
                (bbeta, &d_beta),
                (balpha, &d_alpha),
            ],
        )?;
        // dx keeps the output's gradient until here; the weight gradients
        // keep it, copied in the norm's pass.
        let (d_out, in_norm) = self.in_norm().backward_input_keeping_dx(
            b,
            w(IN_NORM)?,
            &s.x_in,
            &s.rstd_in,
            b.view(&d_u)?,
            b.reborrow_mut(&mut dx),
            rows,
        )?;
        Ok(GdnWgrad {
            tokens,
            in_norm,
            u: s.u,
            d_z,
            d_beta,
            d_alpha,
            qkv_in: s.qkv_in,
            d_qkv_in,
            d_qkv_conv,
            d_a_log,
            out_norm,
            gated,
            d_out,
        })
    }

    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        g: GdnWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`G` layer", &self.params, grads)?;
        let rows = g.tokens.rows()?;
        let (h, c, vd, hv) = (
            self.hidden,
            self.conv_dim(),
            self.value_width(),
            self.value_heads,
        );
        // The conv has no bias: its bias gradient goes to scratch.
        let d_no_bias = zeros(b, c)?;
        b.conv1d_backward_weight(
            b.view(&g.d_qkv_conv)?,
            b.view(&g.qkv_in)?,
            grad(b, grads, CONV_W)?,
            b.view_mut(&d_no_bias)?,
            self.conv_dims(g.tokens),
        )?;
        // dt_bias enters every row's alpha.
        b.column_sum(b.view(&g.d_alpha)?, grad(b, grads, DT_BIAS)?, rows, hv)?;
        b.axpy(1.0, b.view(&g.d_a_log)?, grad(b, grads, A_LOG)?)?;
        self.in_norm()
            .backward_weight(b, &g.in_norm, grad(b, grads, IN_NORM)?)?;
        let [bqkv, bz, bbeta, balpha] = self.proj_blocks();
        split_projection::weight_grad(
            b,
            grads,
            IN_PROJ,
            h,
            rows,
            &g.u,
            [
                (bqkv, &g.d_qkv_in),
                (bz, &g.d_z),
                (bbeta, &g.d_beta),
                (balpha, &g.d_alpha),
            ],
        )?;
        self.out_norm()
            .backward_weight(b, &g.out_norm, grad(b, grads, OUT_NORM)?)?;
        b.matmul(
            b.view(&g.d_out)?,
            b.view(&g.gated)?,
            grad(b, grads, OUT_PROJ)?,
            MatmulDims::linear_weight_grad(rows, vd, h),
        )
    }
}

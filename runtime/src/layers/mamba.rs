//! `M`: the Mamba-2 mixer (layers.md `M`), with the scan evaluated
//! sequentially per head and the state kept only at chunk starts.

use super::norm::{NormPartials, RmsNorm};
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, grad, grad_pair, positive, section,
    uninit, uninit_f32, weight, zeros, zeros_f32,
};
use super::{conv_silu, split_projection};
use crate::backend::{
    Backend, ConvDims, MatmulDims, ScanDims, ScanGrads, ScanInputs, Slice, SliceMut,
};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::{ParamDef, layer_params};

/// Parameter indices (params.md order).
const CONV_W: usize = 0;
const CONV_B: usize = 1;
const DT_BIAS: usize = 2;
const A_LOG: usize = 3;
const D_SKIP: usize = 4;
const IN_NORM: usize = 5;
const IN_PROJ: usize = 6;
const OUT_NORM: usize = 7;
const OUT_PROJ: usize = 8;

/// `M`: `x += W_out GatedNorm(Scan(SiLU(Conv(xBC))) * silu(z))` on
/// `[z | xBC | dt] = RMSNorm(x) W_in^T`.
#[derive(Clone, Debug)]
pub struct MambaLayer {
    hidden: usize,
    heads: usize,
    head_dim: usize,
    groups: usize,
    state: usize,
    conv_kernel: usize,
    chunk: usize,
    params: Vec<ParamDef>,
}

/// What [`MambaLayer::forward`] keeps.
pub struct MambaSaved<B: Backend> {
    tokens: Tokens,
    x_in: B::Buf,
    rstd_in: B::Buf,
    u: B::Buf,
    z: B::Buf,
    /// The convolution's input. Its output before and after the SiLU, the
    /// gated `y` and its norm are recomputed in the backward from this,
    /// `z` and `y` (a convolution and two elementwise passes, the same
    /// kernels on the same inputs, so the same bits): keeping them would
    /// cost `2 conv_dim + 2 d_inner` values a token.
    xbc_in: B::Buf,
    dt: B::Buf,
    states: B::Buf,
    y: B::Buf,
}

/// What [`MambaLayer::backward_input`] keeps.
pub struct MambaWgrad<B: Backend> {
    tokens: Tokens,
    in_norm: NormPartials<B>,
    u: B::Buf,
    d_z: B::Buf,
    xbc_in: B::Buf,
    d_xbc_in: B::Buf,
    d_xbc_conv: B::Buf,
    d_dt: B::Buf,
    d_a_log: B::Buf,
    d_skip: B::Buf,
    gated_norm: NormPartials<B>,
    normed: B::Buf,
    d_out: B::Buf,
}

impl MambaLayer {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let m = section(&config.mamba, LayerKind::Mamba, "mamba")?;
        let heads = positive("mamba.num_heads", m.num_heads)?;
        let groups = positive("mamba.num_groups", m.num_groups)?;
        if heads % groups != 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "mamba.num_groups = {groups} does not divide mamba.num_heads = {heads}"
            )));
        }
        Ok(MambaLayer {
            hidden: positive("hidden_size", config.hidden_size)?,
            heads,
            head_dim: positive("mamba.head_dim", m.head_dim)?,
            groups,
            state: positive("mamba.state_size", m.state_size)?,
            conv_kernel: positive("mamba.conv_kernel", m.conv_kernel)?,
            chunk: positive("mamba.chunk_size", m.chunk_size)?,
            params: layer_params(LayerKind::Mamba, config, 0),
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    fn d_inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Conv channels: `x | B | C`.
    fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.groups * self.state
    }

    fn in_norm(&self) -> RmsNorm {
        RmsNorm::plain(self.hidden)
    }

    fn gated_norm(&self) -> RmsNorm {
        RmsNorm::grouped(self.d_inner(), self.groups)
    }

    fn conv_dims(&self, tokens: Tokens) -> ConvDims {
        ConvDims {
            tokens,
            channels: self.conv_dim(),
            kernel: self.conv_kernel,
        }
    }

    fn scan_dims(&self, tokens: Tokens) -> ScanDims {
        ScanDims {
            tokens,
            heads: self.heads,
            head_dim: self.head_dim,
            groups: self.groups,
            state: self.state,
            chunk: self.chunk,
        }
    }

    /// Row blocks of `in_proj`: z, xBC, dt.
    fn proj_blocks(&self) -> [std::ops::Range<usize>; 3] {
        let (d, c) = (self.d_inner(), self.conv_dim());
        [0..d, d..d + c, d + c..d + c + self.heads]
    }

    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<MambaSaved<B>> {
        let name = "`M` layer";
        check_weights(b, name, &self.params, weights)?;
        let rows = check_rows(name, "x", b.slice_len(b.as_slice(&x)), tokens, self.hidden)?;
        let (h, d, c, heads) = (self.hidden, self.d_inner(), self.conv_dim(), self.heads);
        let w = |i| weight::<B>(weights, i);
        let (u, rstd_in, x_in) =
            self.in_norm()
                .forward_keeping_input(b, w(IN_NORM)?, b.as_slice(&x), rows)?;
        // One fused projection, computed per row block so each output is contiguous.
        let [bz, bxbc, bdt] = self.proj_blocks();
        let mut z = uninit(b, rows * d)?;
        let mut xbc_in = uninit(b, rows * c)?;
        let mut dt = uninit(b, rows * heads)?;
        split_projection::forward(
            b,
            w(IN_PROJ)?,
            h,
            rows,
            &u,
            [(bz, &mut z), (bxbc, &mut xbc_in), (bdt, &mut dt)],
        )?;
        // Only the SiLU's output goes on; the backward recomputes both.
        let (_, xbc) = conv_silu::forward(
            b,
            b.view(&xbc_in)?,
            w(CONV_W)?,
            w(CONV_B)?,
            self.conv_dims(tokens),
        )?;
        let scan = self.scan_dims(tokens);
        let y = uninit(b, rows * d)?;
        let states = uninit_f32(b, scan.states_len())?;
        let inputs = ScanInputs {
            xbc: b.view(&xbc)?,
            dt: b.view(&dt)?,
            dt_bias: w(DT_BIAS)?,
            a_log: w(A_LOG)?,
            d: w(D_SKIP)?,
        };
        b.ssd_scan_forward(inputs, b.view_mut(&y)?, b.view_mut(&states)?, scan)?;
        let gated = uninit(b, rows * d)?;
        b.silu_mul_forward(b.view(&z)?, b.view(&y)?, b.view_mut(&gated)?)?;
        let (normed, _) = self
            .gated_norm()
            .forward(b, w(OUT_NORM)?, b.view(&gated)?, rows)?;
        let mut out = MatmulDims::linear(rows, d, h);
        out.accumulate = true;
        b.matmul(b.view(&normed)?, w(OUT_PROJ)?, b.reborrow_mut(&mut x), out)?;
        Ok(MambaSaved {
            tokens,
            x_in,
            rstd_in,
            u,
            z,
            xbc_in,
            dt,
            states,
            y,
        })
    }

    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        s: MambaSaved<B>,
        mut dx: SliceMut<'_, B>,
    ) -> Result<MambaWgrad<B>> {
        let name = "`M` layer backward";
        check_weights(b, name, &self.params, weights)?;
        let tokens = s.tokens;
        let rows = tokens.rows()?;
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * self.hidden)?;
        let (h, d, c, heads) = (self.hidden, self.d_inner(), self.conv_dim(), self.heads);
        let w = |i| weight::<B>(weights, i);
        // The gated output and its norm, as the forward computed them.
        let gated = uninit(b, rows * d)?;
        b.silu_mul_forward(b.view(&s.z)?, b.view(&s.y)?, b.view_mut(&gated)?)?;
        let (normed, rstd_gated) =
            self.gated_norm()
                .forward(b, w(OUT_NORM)?, b.view(&gated)?, rows)?;
        let d_normed = uninit(b, rows * d)?;
        b.matmul(
            b.as_slice(&dx),
            w(OUT_PROJ)?,
            b.view_mut(&d_normed)?,
            MatmulDims::linear_input_grad(rows, d, h, false),
        )?;
        let d_gated = zeros(b, rows * d)?;
        let gated_norm = self.gated_norm().backward_input(
            b,
            w(OUT_NORM)?,
            &gated,
            &rstd_gated,
            b.view(&d_normed)?,
            b.view_mut(&d_gated)?,
            rows,
        )?;
        drop((gated, rstd_gated, d_normed));
        let d_z = uninit(b, rows * d)?;
        let d_y = uninit(b, rows * d)?;
        b.silu_mul_backward(
            b.view(&s.z)?,
            b.view(&s.y)?,
            b.view(&d_gated)?,
            b.view_mut(&d_z)?,
            b.view_mut(&d_y)?,
        )?;
        drop(d_gated);
        // The convolution's output before and after the SiLU, as the
        // forward computed them.
        let (xbc_conv, xbc) = conv_silu::forward(
            b,
            b.view(&s.xbc_in)?,
            w(CONV_W)?,
            w(CONV_B)?,
            self.conv_dims(tokens),
        )?;
        let d_xbc = uninit(b, rows * c)?;
        let d_dt = uninit(b, rows * heads)?;
        let d_a_log = zeros_f32(b, heads)?;
        let d_skip = zeros_f32(b, heads)?;
        let inputs = ScanInputs {
            xbc: b.view(&xbc)?,
            dt: b.view(&s.dt)?,
            dt_bias: w(DT_BIAS)?,
            a_log: w(A_LOG)?,
            d: w(D_SKIP)?,
        };
        let grads = ScanGrads {
            xbc: b.view_mut(&d_xbc)?,
            dt: b.view_mut(&d_dt)?,
            a_log: b.view_mut(&d_a_log)?,
            d: b.view_mut(&d_skip)?,
        };
        b.ssd_scan_backward(
            inputs,
            b.view(&s.states)?,
            b.view(&d_y)?,
            grads,
            self.scan_dims(tokens),
        )?;
        drop((xbc, d_y));
        let (d_xbc_conv, d_xbc_in) = conv_silu::backward_input(
            b,
            b.view(&xbc_conv)?,
            b.view(&d_xbc)?,
            w(CONV_W)?,
            self.conv_dims(tokens),
        )?;
        let [bz, bxbc, bdt] = self.proj_blocks();
        let d_u = split_projection::input_grad(
            b,
            w(IN_PROJ)?,
            h,
            rows,
            [(bz, &d_z), (bxbc, &d_xbc_in), (bdt, &d_dt)],
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
        Ok(MambaWgrad {
            tokens,
            in_norm,
            u: s.u,
            d_z,
            xbc_in: s.xbc_in,
            d_xbc_in,
            d_xbc_conv,
            d_dt,
            d_a_log,
            d_skip,
            gated_norm,
            normed,
            d_out,
        })
    }

    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        g: MambaWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`M` layer", &self.params, grads)?;
        let rows = g.tokens.rows()?;
        let (h, d, heads) = (self.hidden, self.d_inner(), self.heads);
        {
            let (dw, dbias) = grad_pair(b, grads, CONV_W, CONV_B)?;
            b.conv1d_backward_weight(
                b.view(&g.d_xbc_conv)?,
                b.view(&g.xbc_in)?,
                dw,
                dbias,
                self.conv_dims(g.tokens),
            )?;
        }
        b.column_sum(b.view(&g.d_dt)?, grad(b, grads, DT_BIAS)?, rows, heads)?;
        b.axpy(1.0, b.view(&g.d_a_log)?, grad(b, grads, A_LOG)?)?;
        b.axpy(1.0, b.view(&g.d_skip)?, grad(b, grads, D_SKIP)?)?;
        self.in_norm()
            .backward_weight(b, &g.in_norm, grad(b, grads, IN_NORM)?)?;
        let [bz, bxbc, bdt] = self.proj_blocks();
        split_projection::weight_grad(
            b,
            grads,
            IN_PROJ,
            h,
            rows,
            &g.u,
            [(bz, &g.d_z), (bxbc, &g.d_xbc_in), (bdt, &g.d_dt)],
        )?;
        self.gated_norm()
            .backward_weight(b, &g.gated_norm, grad(b, grads, OUT_NORM)?)?;
        b.matmul(
            b.view(&g.d_out)?,
            b.view(&g.normed)?,
            grad(b, grads, OUT_PROJ)?,
            MatmulDims::linear_weight_grad(rows, d, h),
        )
    }
}

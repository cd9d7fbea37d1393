//! `*`: grouped-query self-attention (layers.md `*`), with optional qk-norm
//! and optional rotary embeddings.

use super::norm::{NormPartials, RmsNorm};
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, core_attention, grad, positive,
    section, uninit, weight, zeros,
};
use crate::backend::{
    AttentionDims, AttentionInputs, Backend, MatmulDims, QkvDims, RotaryDims, RotaryPairing, Slice,
    SliceMut,
};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::config::Position;
use hybridgen_dsl::params::{ParamDef, layer_params};

/// Parameter indices (params.md order).
const PROJ: usize = 0;
const QKV_NORM: usize = 1;
const QKV: usize = 2;
const Q_NORM: usize = 3;
const K_NORM: usize = 4;

/// `*`: `x += Attn(split(RMSNorm(x) W_qkv^T)) W_proj^T`.
#[derive(Clone, Debug)]
pub struct AttentionLayer {
    hidden: usize,
    heads: usize,
    groups: usize,
    head_dim: usize,
    qk_norm: bool,
    rope_base: Option<f32>,
    params: Vec<ParamDef>,
}

/// Pre-norm queries and keys with their norms' `rstd` (qk-norm only).
struct QkNormSaved<B: Backend> {
    q_pre: B::Buf,
    rstd_q: B::Buf,
    k_pre: B::Buf,
    rstd_k: B::Buf,
}

/// What [`AttentionLayer::forward`] keeps.
pub struct AttentionSaved<B: Backend> {
    tokens: Tokens,
    x_in: B::Buf,
    rstd_in: B::Buf,
    u: B::Buf,
    qk_norm: Option<QkNormSaved<B>>,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    o: B::Buf,
    lse: B::Buf,
}

/// The qk-norm part of [`AttentionWgrad`]: the norms' weight-gradient
/// partial sums.
struct QkNormWgrad<B: Backend> {
    q: NormPartials<B>,
    k: NormPartials<B>,
}

/// What [`AttentionLayer::backward_input`] keeps.
pub struct AttentionWgrad<B: Backend> {
    tokens: Tokens,
    norm: NormPartials<B>,
    u: B::Buf,
    d_qkv: B::Buf,
    d_out: B::Buf,
    o: B::Buf,
    qk_norm: Option<QkNormWgrad<B>>,
}

impl AttentionLayer {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let a = section(&config.attention, LayerKind::Attention, "attention")?;
        let heads = positive("attention.num_heads", a.num_heads)?;
        let groups = positive("attention.num_kv_groups", a.num_kv_groups)?;
        if heads % groups != 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "attention.num_kv_groups = {groups} does not divide attention.num_heads = {heads}"
            )));
        }
        let head_dim = positive(
            "the attention head dim",
            config.attention_head_dim().unwrap_or(0),
        )?;
        let rope_base = match a.position {
            Position::None => None,
            Position::Rope if head_dim % 2 == 0 => Some(a.rope_base),
            Position::Rope => {
                return Err(RuntimeError::InvalidArgument(format!(
                    "rotary embeddings need an even head dim; attention head dim is {head_dim}"
                )));
            }
        };
        Ok(AttentionLayer {
            hidden: positive("hidden_size", config.hidden_size)?,
            heads,
            groups,
            head_dim,
            qk_norm: a.qk_norm,
            rope_base,
            params: layer_params(LayerKind::Attention, config, 0),
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    fn qkv_width(&self) -> usize {
        self.head_dim * (self.heads + 2 * self.groups)
    }

    /// The fused projection's layout: per KV group, its query heads, its
    /// key and its value.
    fn qkv_dims(&self, rows: usize) -> QkvDims {
        QkvDims {
            rows,
            groups: self.groups,
            heads_per_group: self.heads / self.groups,
            head_dim: self.head_dim,
        }
    }

    fn rotary(&self, tokens: Tokens, heads: usize) -> Option<RotaryDims> {
        self.rope_base.map(|base| RotaryDims {
            tokens,
            heads,
            head_stride: self.head_dim,
            offset: 0,
            dim: self.head_dim,
            base,
            pairing: RotaryPairing::RotateHalf,
        })
    }

    fn attention_dims(&self, tokens: Tokens) -> AttentionDims {
        AttentionDims {
            tokens,
            heads: self.heads,
            kv_heads: self.groups,
            qk_dim: self.head_dim,
            v_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<AttentionSaved<B>> {
        let name = "`*` layer";
        check_weights(b, name, &self.params, weights)?;
        let rows = check_rows(name, "x", b.slice_len(b.as_slice(&x)), tokens, self.hidden)?;
        let (h, c, heads, groups) = (self.hidden, self.head_dim, self.heads, self.groups);
        let w = |i| weight::<B>(weights, i);
        let (u, rstd_in, x_in) =
            RmsNorm::plain(h).forward_keeping_input(b, w(QKV_NORM)?, b.as_slice(&x), rows)?;
        let width = self.qkv_width();
        let qkv = uninit(b, rows * width)?;
        b.matmul(
            b.view(&u)?,
            w(QKV)?,
            b.view_mut(&qkv)?,
            MatmulDims::linear(rows, h, width),
        )?;
        let mut q = uninit(b, rows * heads * c)?;
        let mut k = uninit(b, rows * groups * c)?;
        let v = uninit(b, rows * groups * c)?;
        b.qkv_split(
            b.view(&qkv)?,
            AttentionInputs {
                q: b.view_mut(&q)?,
                k: b.view_mut(&k)?,
                v: b.view_mut(&v)?,
            },
            self.qkv_dims(rows),
        )?;
        drop(qkv);
        let qk_norm = if self.qk_norm {
            let norm = RmsNorm::plain(c);
            let (qn, rstd_q) = norm.forward(b, w(Q_NORM)?, b.view(&q)?, rows * heads)?;
            let (kn, rstd_k) = norm.forward(b, w(K_NORM)?, b.view(&k)?, rows * groups)?;
            let q_pre = std::mem::replace(&mut q, qn);
            let k_pre = std::mem::replace(&mut k, kn);
            Some(QkNormSaved {
                q_pre,
                rstd_q,
                k_pre,
                rstd_k,
            })
        } else {
            None
        };
        if let (Some(rq), Some(rk)) = (self.rotary(tokens, heads), self.rotary(tokens, groups)) {
            b.rotary_forward(b.view_mut(&q)?, rq)?;
            b.rotary_forward(b.view_mut(&k)?, rk)?;
        }
        let (o, lse) = core_attention::forward(
            b,
            AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
            },
            w(PROJ)?,
            b.reborrow_mut(&mut x),
            self.attention_dims(tokens),
            h,
        )?;
        Ok(AttentionSaved {
            tokens,
            x_in,
            rstd_in,
            u,
            qk_norm,
            q,
            k,
            v,
            o,
            lse,
        })
    }

    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        s: AttentionSaved<B>,
        mut dx: SliceMut<'_, B>,
    ) -> Result<AttentionWgrad<B>> {
        let name = "`*` layer backward";
        check_weights(b, name, &self.params, weights)?;
        let tokens = s.tokens;
        let rows = tokens.rows()?;
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * self.hidden)?;
        let (h, c, heads, groups) = (self.hidden, self.head_dim, self.heads, self.groups);
        let w = |i| weight::<B>(weights, i);
        let saved = core_attention::Saved {
            q: &s.q,
            k: &s.k,
            v: &s.v,
            o: &s.o,
            lse: &s.lse,
        };
        let (mut dq, mut dk, dv) = core_attention::backward_input(
            b,
            saved,
            w(PROJ)?,
            b.as_slice(&dx),
            self.attention_dims(tokens),
            h,
        )?;
        if let (Some(rq), Some(rk)) = (self.rotary(tokens, heads), self.rotary(tokens, groups)) {
            b.rotary_backward(b.view_mut(&dq)?, rq)?;
            b.rotary_backward(b.view_mut(&dk)?, rk)?;
        }
        // Through qk-norm: dq/dk become gradients of the pre-norm q/k.
        let qk_norm = match s.qk_norm {
            Some(qs) => {
                let norm = RmsNorm::plain(c);
                let dq_pre = zeros(b, rows * heads * c)?;
                let dk_pre = zeros(b, rows * groups * c)?;
                let q = norm.backward_input(
                    b,
                    w(Q_NORM)?,
                    &qs.q_pre,
                    &qs.rstd_q,
                    b.view(&dq)?,
                    b.view_mut(&dq_pre)?,
                    rows * heads,
                )?;
                let k = norm.backward_input(
                    b,
                    w(K_NORM)?,
                    &qs.k_pre,
                    &qs.rstd_k,
                    b.view(&dk)?,
                    b.view_mut(&dk_pre)?,
                    rows * groups,
                )?;
                dq = dq_pre;
                dk = dk_pre;
                Some(QkNormWgrad { q, k })
            }
            None => None,
        };
        let width = self.qkv_width();
        let d_qkv = uninit(b, rows * width)?;
        b.qkv_join(
            AttentionInputs {
                q: b.view(&dq)?,
                k: b.view(&dk)?,
                v: b.view(&dv)?,
            },
            b.view_mut(&d_qkv)?,
            self.qkv_dims(rows),
        )?;
        let d_u = uninit(b, rows * h)?;
        b.matmul(
            b.view(&d_qkv)?,
            w(QKV)?,
            b.view_mut(&d_u)?,
            MatmulDims::linear_input_grad(rows, h, width, false),
        )?;
        // dx keeps the output's gradient until here; the weight gradients
        // keep it, copied in the norm's pass.
        let (d_out, norm) = RmsNorm::plain(h).backward_input_keeping_dx(
            b,
            w(QKV_NORM)?,
            &s.x_in,
            &s.rstd_in,
            b.view(&d_u)?,
            b.reborrow_mut(&mut dx),
            rows,
        )?;
        Ok(AttentionWgrad {
            tokens,
            norm,
            u: s.u,
            d_qkv,
            d_out,
            o: s.o,
            qk_norm,
        })
    }

    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        g: AttentionWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`*` layer", &self.params, grads)?;
        let rows = g.tokens.rows()?;
        let (h, c) = (self.hidden, self.head_dim);
        core_attention::proj_weight_grad(
            b,
            &g.d_out,
            &g.o,
            grad(b, grads, PROJ)?,
            self.attention_dims(g.tokens),
            h,
        )?;
        RmsNorm::plain(h).backward_weight(b, &g.norm, grad(b, grads, QKV_NORM)?)?;
        b.matmul(
            b.view(&g.d_qkv)?,
            b.view(&g.u)?,
            grad(b, grads, QKV)?,
            MatmulDims::linear_weight_grad(rows, h, self.qkv_width()),
        )?;
        if let Some(qk) = g.qk_norm {
            let norm = RmsNorm::plain(c);
            norm.backward_weight(b, &qk.q, grad(b, grads, Q_NORM)?)?;
            norm.backward_weight(b, &qk.k, grad(b, grads, K_NORM)?)?;
        }
        Ok(())
    }
}

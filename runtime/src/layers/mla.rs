//! `+`: multi-latent attention (layers.md `+`, DeepSeek-V2/V3 style): LoRA
//! queries (or a direct projection), a compressed key/value latent with a
//! shared rotary key, optional RMSNorm on both latents.

use super::norm::{NormPartials, RmsNorm};
use super::{
    Tokens, check_grads, check_len, check_rows, check_weights, core_attention, grad, grad_rows,
    positive, section, uninit, weight, weight_rows, zeros,
};
use crate::backend::{
    AttentionDims, AttentionInputs, Backend, MatmulDims, MlaKvDims, RotaryDims, RotaryPairing,
    Slice, SliceMut,
};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::{ParamDef, layer_params};

/// Where each parameter sits in the list (it depends on `q_lora_rank` and
/// qk-norm, params.md).
#[derive(Clone, Copy, Debug)]
struct Indices {
    in_norm: usize,
    proj: usize,
    /// `linear_q_down_proj` (with q LoRA).
    q_down: Option<usize>,
    q_norm: Option<usize>,
    /// `linear_q_up_proj`, or `linear_q_proj` without q LoRA.
    q_up: usize,
    kv_down: usize,
    kv_norm: Option<usize>,
    kv_up: usize,
}

impl Indices {
    fn new(q_lora: bool, qk_norm: bool) -> Self {
        let mut next = 2;
        let mut take = |present: bool| {
            present.then(|| {
                next += 1;
                next - 1
            })
        };
        let q_down = take(q_lora);
        let q_norm = take(q_lora && qk_norm);
        let q_up = take(true).unwrap_or_default();
        let kv_down = take(true).unwrap_or_default();
        let kv_norm = take(qk_norm);
        let kv_up = take(true).unwrap_or_default();
        Indices {
            in_norm: 0,
            proj: 1,
            q_down,
            q_norm,
            q_up,
            kv_down,
            kv_norm,
            kv_up,
        }
    }

    /// `D`'s order (params.md): the input norm, the five indexer
    /// parameters, the MLA projections (q LoRA required), then the two
    /// latent norms standalone.
    fn dsa(qk_norm: bool) -> Self {
        Indices {
            in_norm: 0,
            proj: 6,
            q_down: Some(7),
            q_norm: qk_norm.then_some(11),
            q_up: 8,
            kv_down: 9,
            kv_norm: qk_norm.then_some(12),
            kv_up: 10,
        }
    }
}

/// `+`: `x += Attn(q, [k_nope | rope(k_rope)], v) W_proj^T`.
#[derive(Clone, Debug)]
pub struct MlaLayer {
    hidden: usize,
    heads: usize,
    q_rank: Option<usize>,
    kv_rank: usize,
    nope_dim: usize,
    rope_dim: usize,
    v_dim: usize,
    rope_base: f32,
    at: Indices,
    params: Vec<ParamDef>,
}

/// A LoRA latent (`cq` or `c`) as the up projection reads it.
struct Latent<B: Backend> {
    /// The down projection's output and its norm's `rstd`, with qk-norm.
    norm: Option<(B::Buf, B::Buf)>,
    /// The normed latent (the raw one without qk-norm).
    out: B::Buf,
}

/// The gradients of a [`Latent`].
struct LatentGrad<B: Backend> {
    /// W.r.t. `out`.
    d_out: B::Buf,
    /// W.r.t. the raw latent, when a norm sits between (else `d_out`).
    d_raw: Option<B::Buf>,
    /// The norm's weight-gradient partial sums, when a norm sits between.
    norm: Option<NormPartials<B>>,
}

impl<B: Backend> LatentGrad<B> {
    fn d_raw(&self) -> &B::Buf {
        self.d_raw.as_ref().unwrap_or(&self.d_out)
    }
}

impl<B: Backend> Latent<B> {
    fn new(
        b: &B,
        raw: B::Buf,
        norm_weight: Option<Slice<'_, B>>,
        dim: usize,
        rows: usize,
    ) -> Result<Self> {
        Ok(match norm_weight {
            Some(w) => {
                let (out, rstd) = RmsNorm::plain(dim).forward(b, w, b.view(&raw)?, rows)?;
                Latent {
                    norm: Some((raw, rstd)),
                    out,
                }
            }
            None => Latent {
                norm: None,
                out: raw,
            },
        })
    }

    fn backward_input(
        &self,
        b: &B,
        norm_weight: Option<Slice<'_, B>>,
        d_out: B::Buf,
        dim: usize,
        rows: usize,
    ) -> Result<LatentGrad<B>> {
        let (d_raw, norm) = match (&self.norm, norm_weight) {
            (Some((raw, rstd)), Some(w)) => {
                let d_raw = zeros(b, rows * dim)?;
                let partials = RmsNorm::plain(dim).backward_input(
                    b,
                    w,
                    raw,
                    rstd,
                    b.view(&d_out)?,
                    b.view_mut(&d_raw)?,
                    rows,
                )?;
                (Some(d_raw), Some(partials))
            }
            _ => (None, None),
        };
        Ok(LatentGrad { d_out, d_raw, norm })
    }

    fn backward_weight(
        &self,
        b: &B,
        g: &LatentGrad<B>,
        dw: SliceMut<'_, B>,
        dim: usize,
    ) -> Result<()> {
        match &g.norm {
            Some(partials) => RmsNorm::plain(dim).backward_weight(b, partials, dw),
            None => Ok(()),
        }
    }
}

/// What an MLA projection keeps for its backward (shared by `+` and `D`):
/// the input norm, the latents; [`MlaLayer::project`] hands the queries and
/// the rotated shared key beside it.
pub(crate) struct Projected<B: Backend> {
    tokens: Tokens,
    x_in: B::Buf,
    rstd_in: B::Buf,
    u: B::Buf,
    cq: Option<Latent<B>>,
    ckv: Latent<B>,
}

/// The attention's inputs an MLA projection makes: `q` `[rows, a, dn +
/// dr]` after rotary, and the shared rotary key `k_rope` `[rows, dr]`
/// after rotary (the latent `c` is [`Projected::kv_latent`]).
pub(crate) struct Queries<B: Backend> {
    pub(crate) q: B::Buf,
    pub(crate) k_rope: B::Buf,
}

impl<B: Backend> Projected<B> {
    pub(crate) fn tokens(&self) -> Tokens {
        self.tokens
    }

    /// The normalised input `u = RMSNorm(x)`.
    pub(crate) fn normed_input(&self) -> &B::Buf {
        &self.u
    }

    /// The compressed query after its norm (`cq`), with q LoRA.
    pub(crate) fn query_latent(&self) -> Option<&B::Buf> {
        self.cq.as_ref().map(|l| &l.out)
    }

    /// The key/value latent after its norm (`c`), `[rows, kv_rank]`.
    pub(crate) fn kv_latent(&self) -> &B::Buf {
        &self.ckv.out
    }
}

/// The gradients [`MlaLayer::backward_projection`] starts from: of the
/// queries `dq` `[rows, a, dn + dr]` and of the rotated shared key
/// `d_k_rope` `[rows, dr]` (both before rotary's backward), of the latent
/// `d_c` `[rows, kv_rank]` (after its norm), and of the up-projected keys
/// and values when the attention formed them (for the up projection's
/// weight gradient).
pub(crate) struct LatentGrads<B: Backend> {
    pub(crate) dq: B::Buf,
    pub(crate) d_c: B::Buf,
    pub(crate) d_k_rope: B::Buf,
    pub(crate) d_kv: Option<B::Buf>,
}

/// What [`MlaLayer::forward`] keeps.
pub struct MlaSaved<B: Backend> {
    p: Projected<B>,
    /// `[rows, a, dn + dr]`, after rotary.
    q: B::Buf,
    /// `[rows, a, dn + dr]`: `[k_nope | rope(k_rope)]` per head.
    k: B::Buf,
    /// `[rows, a, dv]`.
    v: B::Buf,
    o: B::Buf,
    lse: B::Buf,
}

/// What [`MlaLayer::backward_input`] keeps.
pub struct MlaWgrad<B: Backend> {
    tokens: Tokens,
    norm: NormPartials<B>,
    u: B::Buf,
    d_out: B::Buf,
    o: B::Buf,
    dq: B::Buf,
    cq: Option<(Latent<B>, LatentGrad<B>)>,
    ckv: Latent<B>,
    d_ckv: LatentGrad<B>,
    d_k_rope: B::Buf,
    /// The gradient of the up-projected keys and values, when they were
    /// formed (`+`; `D` attends over the latent and adds the up
    /// projection's weight gradient itself).
    d_kv: Option<B::Buf>,
}

impl<B: Backend> MlaWgrad<B> {
    /// The normalised input `u`.
    pub(crate) fn normed_input(&self) -> &B::Buf {
        &self.u
    }

    /// The compressed query after its norm, with q LoRA.
    pub(crate) fn query_latent(&self) -> Option<&B::Buf> {
        self.cq.as_ref().map(|(l, _)| &l.out)
    }
}

impl MlaLayer {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let m = section(&config.mla, LayerKind::Mla, "mla")?;
        let rope_dim = positive("mla.qk_rope_head_dim", m.qk_rope_head_dim)?;
        if rope_dim % 2 != 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "mla.qk_rope_head_dim = {rope_dim} is odd; rotary embeddings rotate pairs"
            )));
        }
        if let Some(qr) = m.q_lora_rank {
            positive("mla.q_lora_rank", qr)?;
        }
        Ok(MlaLayer {
            hidden: positive("hidden_size", config.hidden_size)?,
            heads: positive("mla.num_heads", m.num_heads)?,
            q_rank: m.q_lora_rank,
            kv_rank: positive("mla.kv_lora_rank", m.kv_lora_rank)?,
            nope_dim: positive("mla.qk_head_dim", m.qk_head_dim)?,
            rope_dim,
            v_dim: positive("mla.v_head_dim", m.v_head_dim)?,
            rope_base: m.rope_base,
            at: Indices::new(m.q_lora_rank.is_some(), m.qk_norm),
            params: layer_params(LayerKind::Mla, config, 0),
        })
    }

    /// The MLA inside a `D` layer: `[mla]`'s dimensions, `D`'s parameter
    /// list and order.
    pub(crate) fn for_dsa(config: &ModelConfig) -> Result<Self> {
        let m = section(&config.mla, LayerKind::Dsa, "mla")?;
        if m.q_lora_rank.is_none() {
            return Err(RuntimeError::InvalidArgument(
                "a `D` layer needs `mla.q_lora_rank`: its indexer reads the compressed query; \
                 set `q_lora_rank` in [mla]"
                    .into(),
            ));
        }
        Ok(MlaLayer {
            at: Indices::dsa(m.qk_norm),
            params: layer_params(LayerKind::Dsa, config, 0),
            ..MlaLayer::new(config)?
        })
    }

    pub(crate) fn hidden(&self) -> usize {
        self.hidden
    }

    pub(crate) fn q_rank(&self) -> Option<usize> {
        self.q_rank
    }

    pub(crate) fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    pub(crate) fn rope_base(&self) -> f32 {
        self.rope_base
    }

    /// Where `linear_proj` sits in the weight list.
    pub(crate) fn proj_index(&self) -> usize {
        self.at.proj
    }

    /// Where `linear_kv_up_proj` (`[a (dn + dv), kv_rank]`: per head its
    /// key block then its value block) sits in the weight list.
    pub(crate) fn kv_up_index(&self) -> usize {
        self.at.kv_up
    }

    pub(crate) fn heads(&self) -> usize {
        self.heads
    }

    pub(crate) fn kv_rank(&self) -> usize {
        self.kv_rank
    }

    pub(crate) fn nope_dim(&self) -> usize {
        self.nope_dim
    }

    pub(crate) fn v_dim(&self) -> usize {
        self.v_dim
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    /// Per-head query/key width `dn + dr`.
    pub(crate) fn qk_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }

    fn rotary(
        &self,
        tokens: Tokens,
        heads: usize,
        head_stride: usize,
        offset: usize,
    ) -> RotaryDims {
        RotaryDims {
            tokens,
            heads,
            head_stride,
            offset,
            dim: self.rope_dim,
            base: self.rope_base,
            // Megatron's MLA rotates interleaved pairs (layers.md `+` 4).
            pairing: RotaryPairing::Interleaved,
        }
    }

    pub(crate) fn attention_dims(&self, tokens: Tokens) -> AttentionDims {
        AttentionDims {
            tokens,
            heads: self.heads,
            kv_heads: self.heads,
            qk_dim: self.qk_dim(),
            v_dim: self.v_dim,
            scale: 1.0 / (self.qk_dim() as f32).sqrt(),
        }
    }

    /// The layout of the up-projected `kv` rows (per head `[k_nope | v]`)
    /// and of the shared rotary key.
    fn kv_dims(&self, rows: usize) -> MlaKvDims {
        MlaKvDims {
            rows,
            heads: self.heads,
            nope_dim: self.nope_dim,
            rope_dim: self.rope_dim,
            v_dim: self.v_dim,
        }
    }

    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<MlaSaved<B>> {
        let (p, Queries { q, k_rope }) =
            self.project(b, weights, b.as_slice(&x), tokens, "`+` layer")?;
        let (k, v) = self.decompress(b, weights, &p, k_rope)?;
        let (o, lse) = core_attention::forward(
            b,
            AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
            },
            weight::<B>(weights, self.at.proj)?,
            b.reborrow_mut(&mut x),
            self.attention_dims(tokens),
            self.hidden,
        )?;
        Ok(MlaSaved { p, q, k, v, o, lse })
    }

    /// The per-head keys and values from the latent (`+`): `kv = c
    /// W_kv_up^T`, split into `k` `[rows, a, dn + dr]` (`[k_nope |
    /// k_rope]`) and `v` `[rows, a, dv]`.
    fn decompress<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        p: &Projected<B>,
        k_rope: B::Buf,
    ) -> Result<(B::Buf, B::Buf)> {
        let rows = p.tokens.rows()?;
        let (a, kr, dv) = (self.heads, self.kv_rank, self.v_dim);
        let kv_width = a * (self.nope_dim + dv);
        let kv = uninit(b, rows * kv_width)?;
        b.matmul(
            b.view(&p.ckv.out)?,
            weight::<B>(weights, self.at.kv_up)?,
            b.view_mut(&kv)?,
            MatmulDims::linear(rows, kr, kv_width),
        )?;
        let k = uninit(b, rows * a * self.qk_dim())?;
        let v = uninit(b, rows * a * dv)?;
        b.mla_kv_split(
            b.view(&kv)?,
            b.view(&k_rope)?,
            b.view_mut(&k)?,
            b.view_mut(&v)?,
            self.kv_dims(rows),
        )?;
        Ok((k, v))
    }

    /// The input norm, the query and key/value down projections with their
    /// latent norms and rotary: the queries and the rotated shared key for
    /// the attention, and what the backward of all that needs (the latent
    /// `c` among it).
    pub(crate) fn project<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        x: Slice<'_, B>,
        tokens: Tokens,
        name: &str,
    ) -> Result<(Projected<B>, Queries<B>)> {
        check_weights(b, name, &self.params, weights)?;
        let rows = check_rows(name, "x", b.slice_len(x), tokens, self.hidden)?;
        let (h, a, kr, dr) = (self.hidden, self.heads, self.kv_rank, self.rope_dim);
        let dqk = self.qk_dim();
        let w = |i| weight::<B>(weights, i);
        let opt = |i: Option<usize>| i.map(w).transpose();
        let (u, rstd_in, x_in) =
            RmsNorm::plain(h).forward_keeping_input(b, w(self.at.in_norm)?, x, rows)?;
        // Queries.
        let q = uninit(b, rows * a * dqk)?;
        let cq = match (self.q_rank, self.at.q_down) {
            (Some(qr), Some(q_down)) => {
                let raw = uninit(b, rows * qr)?;
                b.matmul(
                    b.view(&u)?,
                    w(q_down)?,
                    b.view_mut(&raw)?,
                    MatmulDims::linear(rows, h, qr),
                )?;
                let latent = Latent::new(b, raw, opt(self.at.q_norm)?, qr, rows)?;
                b.matmul(
                    b.view(&latent.out)?,
                    w(self.at.q_up)?,
                    b.view_mut(&q)?,
                    MatmulDims::linear(rows, qr, a * dqk),
                )?;
                Some(latent)
            }
            _ => {
                b.matmul(
                    b.view(&u)?,
                    w(self.at.q_up)?,
                    b.view_mut(&q)?,
                    MatmulDims::linear(rows, h, a * dqk),
                )?;
                None
            }
        };
        // Keys and values: the latent c and the shared rotary key.
        let c_raw = uninit(b, rows * kr)?;
        let k_rope = uninit(b, rows * dr)?;
        b.matmul(
            b.view(&u)?,
            weight_rows(b, w(self.at.kv_down)?, h, 0..kr)?,
            b.view_mut(&c_raw)?,
            MatmulDims::linear(rows, h, kr),
        )?;
        b.matmul(
            b.view(&u)?,
            weight_rows(b, w(self.at.kv_down)?, h, kr..kr + dr)?,
            b.view_mut(&k_rope)?,
            MatmulDims::linear(rows, h, dr),
        )?;
        let ckv = Latent::new(b, c_raw, opt(self.at.kv_norm)?, kr, rows)?;
        b.rotary_forward(b.view_mut(&q)?, self.rotary(tokens, a, dqk, self.nope_dim))?;
        b.rotary_forward(b.view_mut(&k_rope)?, self.rotary(tokens, 1, dr, 0))?;
        Ok((
            Projected {
                tokens,
                x_in,
                rstd_in,
                u,
                cq,
                ckv,
            },
            Queries { q, k_rope },
        ))
    }

    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        s: MlaSaved<B>,
        dx: SliceMut<'_, B>,
    ) -> Result<MlaWgrad<B>> {
        let name = "`+` layer backward";
        check_weights(b, name, &self.params, weights)?;
        let rows = s.p.tokens.rows()?;
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * self.hidden)?;
        let saved = core_attention::Saved {
            q: &s.q,
            k: &s.k,
            v: &s.v,
            o: &s.o,
            lse: &s.lse,
        };
        let (dq, dk, d_v) = core_attention::backward_input(
            b,
            saved,
            weight::<B>(weights, self.at.proj)?,
            b.as_slice(&dx),
            self.attention_dims(s.p.tokens),
            self.hidden,
        )?;
        drop((s.q, s.k, s.v));
        let rows = s.p.tokens.rows()?;
        // Back through the split: k_rope is shared, so its gradient sums
        // the heads in order; then through the up projection.
        let kv_width = self.heads * (self.nope_dim + self.v_dim);
        let d_kv = uninit(b, rows * kv_width)?;
        let d_k_rope = uninit(b, rows * self.rope_dim)?;
        b.mla_kv_join(
            b.view(&dk)?,
            b.view(&d_v)?,
            b.view_mut(&d_kv)?,
            b.view_mut(&d_k_rope)?,
            self.kv_dims(rows),
        )?;
        drop((dk, d_v));
        let d_c = uninit(b, rows * self.kv_rank)?;
        b.matmul(
            b.view(&d_kv)?,
            weight::<B>(weights, self.at.kv_up)?,
            b.view_mut(&d_c)?,
            MatmulDims::linear_input_grad(rows, self.kv_rank, kv_width, false),
        )?;
        let grads = LatentGrads {
            dq,
            d_c,
            d_k_rope,
            d_kv: Some(d_kv),
        };
        self.backward_projection(b, weights, s.p, s.o, grads, dx)
    }

    /// Back through [`MlaLayer::project`] from the gradients of the
    /// queries, the latent `c` and the rotated shared key (`dx` still holds
    /// the layer output's gradient, which becomes the input's); `o` is the
    /// attention output, for the projection's weight gradient.
    pub(crate) fn backward_projection<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        s: Projected<B>,
        o: B::Buf,
        grads: LatentGrads<B>,
        dx: SliceMut<'_, B>,
    ) -> Result<MlaWgrad<B>> {
        let LatentGrads {
            dq,
            d_c,
            d_k_rope,
            d_kv,
        } = grads;
        let tokens = s.tokens;
        let rows = tokens.rows()?;
        let (h, a, kr, dr) = (self.hidden, self.heads, self.kv_rank, self.rope_dim);
        let dqk = self.qk_dim();
        let w = |i| weight::<B>(weights, i);
        let opt = |i: Option<usize>| i.map(w).transpose();
        b.rotary_backward(b.view_mut(&dq)?, self.rotary(tokens, a, dqk, self.nope_dim))?;
        b.rotary_backward(b.view_mut(&d_k_rope)?, self.rotary(tokens, 1, dr, 0))?;
        // Key/value path into d_u.
        let d_ckv = s
            .ckv
            .backward_input(b, opt(self.at.kv_norm)?, d_c, kr, rows)?;
        let d_u = uninit(b, rows * h)?;
        b.matmul(
            b.view(d_ckv.d_raw())?,
            weight_rows(b, w(self.at.kv_down)?, h, 0..kr)?,
            b.view_mut(&d_u)?,
            MatmulDims::linear_input_grad(rows, h, kr, false),
        )?;
        b.matmul(
            b.view(&d_k_rope)?,
            weight_rows(b, w(self.at.kv_down)?, h, kr..kr + dr)?,
            b.view_mut(&d_u)?,
            MatmulDims::linear_input_grad(rows, h, dr, true),
        )?;
        // Query path into d_u.
        let cq = match (s.cq, self.q_rank, self.at.q_down) {
            (Some(latent), Some(qr), Some(q_down)) => {
                let d_cq = uninit(b, rows * qr)?;
                b.matmul(
                    b.view(&dq)?,
                    w(self.at.q_up)?,
                    b.view_mut(&d_cq)?,
                    MatmulDims::linear_input_grad(rows, qr, a * dqk, false),
                )?;
                let g = latent.backward_input(b, opt(self.at.q_norm)?, d_cq, qr, rows)?;
                b.matmul(
                    b.view(g.d_raw())?,
                    w(q_down)?,
                    b.view_mut(&d_u)?,
                    MatmulDims::linear_input_grad(rows, h, qr, true),
                )?;
                Some((latent, g))
            }
            (None, None, _) => {
                b.matmul(
                    b.view(&dq)?,
                    w(self.at.q_up)?,
                    b.view_mut(&d_u)?,
                    MatmulDims::linear_input_grad(rows, h, a * dqk, true),
                )?;
                None
            }
            _ => {
                return Err(RuntimeError::InvalidArgument(
                    "`+` layer backward: the saved state does not match the layer's q LoRA setting"
                        .into(),
                ));
            }
        };
        // dx keeps the output's gradient until here; the weight gradients
        // keep it, copied in the norm's pass.
        let (d_out, norm) = RmsNorm::plain(h).backward_input_keeping_dx(
            b,
            w(self.at.in_norm)?,
            &s.x_in,
            &s.rstd_in,
            b.view(&d_u)?,
            dx,
            rows,
        )?;
        Ok(MlaWgrad {
            tokens,
            norm,
            u: s.u,
            d_out,
            o,
            dq,
            cq,
            ckv: s.ckv,
            d_ckv,
            d_k_rope,
            d_kv,
        })
    }

    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        g: MlaWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`+` layer", &self.params, grads)?;
        let rows = g.tokens.rows()?;
        let (h, a, kr, dr, dv) = (
            self.hidden,
            self.heads,
            self.kv_rank,
            self.rope_dim,
            self.v_dim,
        );
        let dqk = self.qk_dim();
        RmsNorm::plain(h).backward_weight(b, &g.norm, grad(b, grads, self.at.in_norm)?)?;
        core_attention::proj_weight_grad(
            b,
            &g.d_out,
            &g.o,
            grad(b, grads, self.at.proj)?,
            self.attention_dims(g.tokens),
            h,
        )?;
        match (&g.cq, self.q_rank, self.at.q_down) {
            (Some((latent, lg)), Some(qr), Some(q_down)) => {
                b.matmul(
                    b.view(lg.d_raw())?,
                    b.view(&g.u)?,
                    grad(b, grads, q_down)?,
                    MatmulDims::linear_weight_grad(rows, h, qr),
                )?;
                if let Some(i) = self.at.q_norm {
                    latent.backward_weight(b, lg, grad(b, grads, i)?, qr)?;
                }
                b.matmul(
                    b.view(&g.dq)?,
                    b.view(&latent.out)?,
                    grad(b, grads, self.at.q_up)?,
                    MatmulDims::linear_weight_grad(rows, qr, a * dqk),
                )?;
            }
            _ => {
                b.matmul(
                    b.view(&g.dq)?,
                    b.view(&g.u)?,
                    grad(b, grads, self.at.q_up)?,
                    MatmulDims::linear_weight_grad(rows, h, a * dqk),
                )?;
            }
        }
        b.matmul(
            b.view(g.d_ckv.d_raw())?,
            b.view(&g.u)?,
            grad_rows(b, grads, self.at.kv_down, h, 0..kr)?,
            MatmulDims::linear_weight_grad(rows, h, kr),
        )?;
        b.matmul(
            b.view(&g.d_k_rope)?,
            b.view(&g.u)?,
            grad_rows(b, grads, self.at.kv_down, h, kr..kr + dr)?,
            MatmulDims::linear_weight_grad(rows, h, dr),
        )?;
        if let Some(i) = self.at.kv_norm {
            g.ckv.backward_weight(b, &g.d_ckv, grad(b, grads, i)?, kr)?;
        }
        match &g.d_kv {
            Some(d_kv) => {
                let kv_width = a * (self.nope_dim + dv);
                b.matmul(
                    b.view(d_kv)?,
                    b.view(&g.ckv.out)?,
                    grad(b, grads, self.at.kv_up)?,
                    MatmulDims::linear_weight_grad(rows, kr, kv_width),
                )
            }
            None => Ok(()),
        }
    }
}

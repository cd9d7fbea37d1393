//! `D`: DeepSeek sparse attention (layers.md `D`), Megatron-LM's DSA: the
//! MLA of `+` (its projections shared through `MlaLayer::project` and
//! `MlaLayer::backward_projection`) attending only to the keys a
//! lightning indexer selects per query, and the indexer trained by a KL loss
//! towards the main attention's distribution. The indexer reads the layer's
//! normalised input and compressed query detached: its loss trains only the
//! indexer, and the attention's gradient never reaches it.
//!
//! The attention runs in MLA's absorbed form (DeepSeek-V3.2's): each
//! head's key up-projection is folded into its query (`q_lat[h] =
//! [q_nope[h] W_UK[h] | q_rope[h]]`), every head attends over one row a
//! token (`kv[t] = [c[t] | k_rope[t]]`, the values its first `kv_rank`
//! channels) with `Backend::sparse_mqa_forward`, and each head's value
//! up-projection is applied to its output (`o[h] = o_lat[h] W_UV[h]^T`).
//! The same function as up-projecting keys and values, in another rounding.

use super::mla::{LatentGrads, MlaLayer, MlaWgrad, Projected, Queries};
use super::{
    Tokens, check_grads, check_len, check_weights, grad, grad_rows, positive, section, uninit,
    uninit_f32, weight, weight_rows,
};
use crate::backend::{
    Backend, BatchLayout, BatchedMatmulDims, CopyCols, DType, IndexerDims, IndexerInputs,
    IndexerLossDims, LayerNormDims, MatmulDims, RotaryDims, RotaryPairing, Slice, SliceMut,
    SparseMqaDims,
};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::ParamDef;
use std::ops::Range;

/// Parameter indices of the indexer (params.md order: after the input norm
/// at 0; the MLA's follow).
const WQ_B: usize = 1;
const WK: usize = 2;
const K_NORM_W: usize = 3;
const K_NORM_B: usize = 4;
const WEIGHTS_PROJ: usize = 5;

/// The epsilon of the indexer key's LayerNorm (Megatron's
/// `layernorm_epsilon` default, which the indexer takes unless overridden).
pub const INDEXER_K_NORM_EPS: f32 = 1e-5;

/// `D`: `x += SparseAttn(q, k, v; topk(Indexer(u, cq))) W_proj^T` with MLA's
/// q, k, v.
#[derive(Clone, Debug)]
pub struct DsaLayer {
    mla: MlaLayer,
    index_heads: usize,
    index_dim: usize,
    topk: usize,
    loss_coeff: f32,
    sparse_loss: bool,
}

/// The indexer's forward, kept for its backward when the loss is on.
struct IndexerSaved<B: Backend> {
    /// `[rows, ni, di]`, after rotary.
    q: B::Buf,
    /// The key before its LayerNorm, `[rows, di]`, and the norm's stats.
    k_raw: B::Buf,
    k_stats: B::Buf,
    /// `[rows, di]`, after the norm and rotary.
    k: B::Buf,
    /// `[rows, ni]`, before the weight scale.
    weights: B::Buf,
    /// `coeff / rows * (p_indexer - p_target)`, f32 `[rows, seq]`.
    d_scores: B::Buf,
    /// Each row's share of the loss, f32 `[rows]`.
    loss: B::Buf,
}

/// What [`DsaLayer::forward`] keeps.
pub struct DsaSaved<B: Backend> {
    p: Projected<B>,
    /// MLA's queries `[rows, a, dn + dr]` after rotary (their nope part
    /// for `W_UK`'s gradient).
    q: B::Buf,
    /// The absorbed queries `[rows, a, kv_rank + dr]`.
    q_lat: B::Buf,
    /// The shared rows `[rows, kv_rank + dr]`: `[c | rope(k_rope)]`.
    kv: B::Buf,
    /// u32 `[rows, topk]`.
    indices: B::Buf,
    /// The attention's output over the latent, `[rows, a, kv_rank]`.
    o_lat: B::Buf,
    /// The heads' outputs `[rows, a, dv]` (the output projection's input).
    o: B::Buf,
    lse: B::Buf,
    indexer: Option<IndexerSaved<B>>,
}

/// The indexer's gradients, for its weight gradient.
struct IndexerGrads<B: Backend> {
    d_q: B::Buf,
    k_raw: B::Buf,
    k_stats: B::Buf,
    d_k: B::Buf,
    d_k_raw: B::Buf,
    d_weights: B::Buf,
}

/// What [`DsaLayer::backward_input`] keeps.
pub struct DsaWgrad<B: Backend> {
    tokens: Tokens,
    mla: MlaWgrad<B>,
    /// For `W_UK`'s gradient: the queries and the absorbed queries'
    /// gradient. For `W_UV`'s: the heads' output gradient and the latent
    /// output.
    q: B::Buf,
    dq_lat: B::Buf,
    d_o: B::Buf,
    o_lat: B::Buf,
    indexer: Option<IndexerGrads<B>>,
}

/// The per-head shapes of MLA's absorbed attention.
#[derive(Clone, Copy, Debug)]
struct Absorbed {
    heads: usize,
    /// dn: a query head's part without rotary.
    nope: usize,
    rope: usize,
    /// dv: a head's value width.
    v: usize,
    /// The latent's width (`kv_lora_rank`).
    rank: usize,
}

impl Absorbed {
    /// A query head's width `dn + dr`.
    fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// The shared row's width (and an absorbed query head's): `kv_rank + dr`.
    fn width(&self) -> usize {
        self.rank + self.rope
    }

    /// `linear_kv_up_proj`'s rows from head 0's key block `W_UK[0]` `[dn,
    /// kv_rank]` on (each head's `dn` key rows then its `dv` value rows):
    /// with [`Absorbed::blocks`], every head's key block.
    fn key_rows(&self) -> Range<usize> {
        0..self.heads * (self.nope + self.v)
    }

    /// The rows from head 0's value block `W_UV[0]` `[dv, kv_rank]` on.
    fn value_rows(&self) -> Range<usize> {
        self.nope..self.heads * (self.nope + self.v)
    }

    /// One block a head of `linear_kv_up_proj` (rows of `kv_rank`, a head's
    /// `dn + dv` rows apart), from the first row of [`Absorbed::key_rows`]
    /// or [`Absorbed::value_rows`].
    fn blocks(&self) -> BatchLayout {
        BatchLayout {
            pitch: self.rank,
            stride: (self.nope + self.v) * self.rank,
        }
    }

    /// The per-head products `C[h] (+)= op(A[h]) op(B[h])` over all heads:
    /// `a` and `b` each an interleaved `[rows, heads, width]` tensor (the
    /// width given) or the weight's blocks (`None`), `c` likewise.
    fn per_head(&self, dims: MatmulDims, [a, b, c]: [Option<usize>; 3]) -> BatchedMatmulDims {
        let layout = |width: Option<usize>| match width {
            Some(w) => BatchLayout::heads(self.heads, w),
            None => self.blocks(),
        };
        BatchedMatmulDims {
            batch: self.heads,
            dims,
            a: layout(a),
            b: layout(b),
            c: layout(c),
        }
    }
}

/// Columns `[src_offset, src_offset + cols)` of each `src_stride`-wide row
/// into columns `[dst_offset, ..)` of each `dst_stride`-wide row.
fn copy_block<B: Backend>(
    b: &B,
    src: &B::Buf,
    dst: &B::Buf,
    rows: usize,
    (src_stride, src_offset): (usize, usize),
    (dst_stride, dst_offset): (usize, usize),
    cols: usize,
) -> Result<()> {
    b.copy_cols(
        b.view(src)?,
        b.view_mut(dst)?,
        CopyCols {
            rows,
            cols,
            src_stride,
            src_offset,
            dst_stride,
            dst_offset,
            accumulate: false,
        },
    )
}

impl<B: Backend> DsaSaved<B> {
    /// The indexer loss of this forward (its coefficient applied, a mean
    /// over the micro-batch's rows), read back (for tests); 0 without it.
    pub fn indexer_loss(&self, b: &B) -> Result<f64> {
        let Some(ix) = &self.indexer else {
            return Ok(0.0);
        };
        let sum = b.alloc(1, DType::F64)?;
        b.accumulate_sum(b.view(&ix.loss)?, b.view_mut(&sum)?)?;
        let mut value = [0.0f64];
        b.download(b.view(&sum)?, &mut value)?;
        Ok(value[0])
    }

    /// Adds the indexer loss into `slot` (f64 `[1]`), on the lane.
    pub fn add_indexer_loss(&self, b: &B, slot: SliceMut<'_, B>) -> Result<()> {
        match &self.indexer {
            Some(ix) => b.accumulate_sum(b.view(&ix.loss)?, slot),
            None => Ok(()),
        }
    }

    /// The selected keys, u32 `[rows, topk]` (for tests).
    pub fn indices(&self) -> &B::Buf {
        &self.indices
    }
}

impl DsaLayer {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let d = section(&config.dsa, LayerKind::Dsa, "dsa")?;
        let mla = MlaLayer::for_dsa(config)?;
        let index_dim = positive("dsa.index_head_dim", d.index_head_dim)?;
        if index_dim < mla.rope_dim() {
            return Err(RuntimeError::InvalidArgument(format!(
                "dsa.index_head_dim = {index_dim} is below mla.qk_rope_head_dim = {}: the \
                 indexer rotates its first qk_rope_head_dim channels; make index_head_dim at \
                 least that",
                mla.rope_dim()
            )));
        }
        if !(d.indexer_loss_coeff.is_finite() && d.indexer_loss_coeff >= 0.0) {
            return Err(RuntimeError::InvalidArgument(format!(
                "dsa.indexer_loss_coeff = {} is not a finite number of at least 0",
                d.indexer_loss_coeff
            )));
        }
        Ok(DsaLayer {
            index_heads: positive("dsa.index_heads", d.index_heads)?,
            index_dim,
            topk: positive("dsa.index_topk", d.index_topk)?,
            loss_coeff: d.indexer_loss_coeff,
            sparse_loss: d.indexer_sparse_loss,
            mla,
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        self.mla.params()
    }

    fn qr(&self) -> Result<usize> {
        self.mla.q_rank().ok_or_else(|| {
            RuntimeError::InvalidArgument("a `D` layer needs `mla.q_lora_rank`".into())
        })
    }

    fn indexer_dims(&self, tokens: Tokens) -> IndexerDims {
        IndexerDims {
            tokens,
            heads: self.index_heads,
            head_dim: self.index_dim,
            topk: self.topk,
            // Megatron scales the per-head weights by ni^-1/2 and by the
            // indexer's softmax scale di^-1/2.
            weight_scale: ((self.index_heads as f64).sqrt() * (self.index_dim as f64).sqrt())
                .recip() as f32,
        }
    }

    /// Rotary on the first `dr` channels of each indexer head, rotate-half
    /// pairs (Megatron's `dsa_indexer_rope_interleaved` is off by default).
    fn indexer_rotary(&self, tokens: Tokens, heads: usize) -> RotaryDims {
        RotaryDims {
            tokens,
            heads,
            head_stride: self.index_dim,
            offset: 0,
            dim: self.mla.rope_dim(),
            base: self.mla.rope_base(),
            pairing: RotaryPairing::RotateHalf,
        }
    }

    fn key_norm_dims(&self, rows: usize) -> LayerNormDims {
        LayerNormDims {
            rows,
            width: self.index_dim,
            eps: INDEXER_K_NORM_EPS,
        }
    }

    fn absorbed(&self) -> Absorbed {
        Absorbed {
            heads: self.mla.heads(),
            nope: self.mla.nope_dim(),
            rope: self.mla.rope_dim(),
            v: self.mla.v_dim(),
            rank: self.mla.kv_rank(),
        }
    }

    /// The attention over the shared latent rows: MLA's heads and softmax
    /// scale (`(dn + dr)^-1/2`), rows of `kv_rank + dr`, values their first
    /// `kv_rank` channels.
    fn attention_dims(&self, tokens: Tokens) -> SparseMqaDims {
        let ab = self.absorbed();
        SparseMqaDims {
            tokens,
            heads: ab.heads,
            qk_dim: ab.width(),
            v_dim: ab.rank,
            topk: self.topk,
            scale: self.mla.attention_dims(tokens).scale,
        }
    }

    /// The absorbed queries `[rows, a, kv_rank + dr]`: per head `[q_nope[h]
    /// W_UK[h] | q_rope[h]]` (every head's product in one batched matmul,
    /// read and written in place).
    fn absorb_queries<B: Backend>(
        &self,
        b: &B,
        kv_up: Slice<'_, B>,
        q: &B::Buf,
        rows: usize,
    ) -> Result<B::Buf> {
        let ab = self.absorbed();
        let (a, dn, kr, dl) = (ab.heads, ab.nope, ab.rank, ab.width());
        let q_lat = uninit(b, rows * a * dl)?;
        copy_block(b, q, &q_lat, rows * a, (ab.qk(), dn), (dl, kr), ab.rope)?;
        b.batched_matmul(
            b.view(q)?,
            weight_rows(b, kv_up, kr, ab.key_rows())?,
            b.view_mut(&q_lat)?,
            ab.per_head(
                MatmulDims::linear_input_grad(rows, kr, dn, false),
                [Some(ab.qk()), None, Some(dl)],
            ),
        )?;
        Ok(q_lat)
    }

    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        mut x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<DsaSaved<B>> {
        let (p, Queries { q, k_rope }) =
            self.mla
                .project(b, weights, b.as_slice(&x), tokens, "`D` layer")?;
        let rows = tokens.rows()?;
        let (h, ni, di, qr) = (
            self.mla.hidden(),
            self.index_heads,
            self.index_dim,
            self.qr()?,
        );
        let w = |i| weight::<B>(weights, i);
        let u = p.normed_input();
        let cq = p.query_latent().ok_or_else(|| {
            RuntimeError::InvalidArgument(
                "`D` layer: the projection kept no compressed query".into(),
            )
        })?;
        // The indexer, on the detached u and cq.
        let iq = uninit(b, rows * ni * di)?;
        b.matmul(
            b.view(cq)?,
            w(WQ_B)?,
            b.view_mut(&iq)?,
            MatmulDims::linear(rows, qr, ni * di),
        )?;
        let k_raw = uninit(b, rows * di)?;
        b.matmul(
            b.view(u)?,
            w(WK)?,
            b.view_mut(&k_raw)?,
            MatmulDims::linear(rows, h, di),
        )?;
        let ik = uninit(b, rows * di)?;
        let k_stats = uninit_f32(b, rows * 2)?;
        b.layer_norm_forward(
            b.view(&k_raw)?,
            w(K_NORM_W)?,
            w(K_NORM_B)?,
            b.view_mut(&ik)?,
            b.view_mut(&k_stats)?,
            self.key_norm_dims(rows),
        )?;
        let iw = uninit(b, rows * ni)?;
        b.matmul(
            b.view(u)?,
            w(WEIGHTS_PROJ)?,
            b.view_mut(&iw)?,
            MatmulDims::linear(rows, h, ni),
        )?;
        b.rotary_forward(b.view_mut(&iq)?, self.indexer_rotary(tokens, ni))?;
        b.rotary_forward(b.view_mut(&ik)?, self.indexer_rotary(tokens, 1))?;
        let dims = self.indexer_dims(tokens);
        let scores = uninit_f32(b, rows * tokens.seq)?;
        let inputs = IndexerInputs {
            q: b.view(&iq)?,
            k: b.view(&ik)?,
            weights: b.view(&iw)?,
        };
        b.indexer_scores(inputs, b.view_mut(&scores)?, dims)?;
        let indices = b.alloc_uninit(rows * self.topk, DType::U32)?;
        b.indexer_topk(b.view(&scores)?, b.view_mut(&indices)?, dims)?;
        // The absorbed queries and the shared rows `[c | k_rope]`.
        let ab = self.absorbed();
        let (a, kr, dl) = (ab.heads, ab.rank, ab.width());
        let kv_up = w(self.mla.kv_up_index())?;
        let q_lat = self.absorb_queries(b, kv_up, &q, rows)?;
        let kv = uninit(b, rows * dl)?;
        copy_block(b, p.kv_latent(), &kv, rows, (kr, 0), (dl, 0), kr)?;
        copy_block(b, &k_rope, &kv, rows, (ab.rope, 0), (dl, kr), ab.rope)?;
        drop(k_rope);
        let attention = self.attention_dims(tokens);
        let indexer = if self.loss_coeff > 0.0 {
            let loss = uninit_f32(b, rows)?;
            let d_scores = uninit_f32(b, rows * tokens.seq)?;
            b.indexer_loss(
                b.view(&scores)?,
                b.view(&q_lat)?,
                b.view(&kv)?,
                b.view(&indices)?,
                b.view_mut(&loss)?,
                b.view_mut(&d_scores)?,
                IndexerLossDims {
                    tokens,
                    topk: self.topk,
                    heads: attention.heads,
                    qk_dim: attention.qk_dim,
                    scale: attention.scale,
                    coeff: self.loss_coeff,
                    sparse: self.sparse_loss,
                },
            )?;
            Some(IndexerSaved {
                q: iq,
                k_raw,
                k_stats,
                k: ik,
                weights: iw,
                d_scores,
                loss,
            })
        } else {
            None
        };
        drop(scores);
        // The attention over the selected rows, each head's value
        // up-projection, then the output projection.
        let o_lat = uninit(b, rows * a * kr)?;
        let lse = uninit_f32(b, rows * a)?;
        b.sparse_mqa_forward(
            b.view(&q_lat)?,
            b.view(&kv)?,
            b.view(&indices)?,
            b.view_mut(&o_lat)?,
            b.view_mut(&lse)?,
            attention,
        )?;
        let dv = ab.v;
        let o = uninit(b, rows * a * dv)?;
        b.batched_matmul(
            b.view(&o_lat)?,
            weight_rows(b, kv_up, kr, ab.value_rows())?,
            b.view_mut(&o)?,
            ab.per_head(MatmulDims::linear(rows, kr, dv), [Some(kr), None, Some(dv)]),
        )?;
        let mut out = MatmulDims::linear(rows, a * dv, h);
        out.accumulate = true;
        b.matmul(
            b.view(&o)?,
            w(self.mla.proj_index())?,
            b.reborrow_mut(&mut x),
            out,
        )?;
        Ok(DsaSaved {
            p,
            q,
            q_lat,
            kv,
            indices,
            o_lat,
            o,
            lse,
            indexer,
        })
    }

    /// `dx += J^T dx`; `loss_scale` multiplies the indexer loss's gradient
    /// (the scale of the cross-entropy's gradients, as for the MoE
    /// load-balancing loss).
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        s: DsaSaved<B>,
        dx: SliceMut<'_, B>,
        loss_scale: f32,
    ) -> Result<DsaWgrad<B>> {
        let name = "`D` layer backward";
        check_weights(b, name, self.params(), weights)?;
        let tokens = s.p_tokens();
        let rows = tokens.rows()?;
        let h = self.mla.hidden();
        check_len(name, "dx", b.slice_len(b.as_slice(&dx)), rows * h)?;
        let w = |i| weight::<B>(weights, i);
        let ab = self.absorbed();
        let (a, dn, dv, kr, dl) = (ab.heads, ab.nope, ab.v, ab.rank, ab.width());
        let kv_up = w(self.mla.kv_up_index())?;
        let d_o = uninit(b, rows * a * dv)?;
        b.matmul(
            b.as_slice(&dx),
            w(self.mla.proj_index())?,
            b.view_mut(&d_o)?,
            MatmulDims::linear_input_grad(rows, a * dv, h, false),
        )?;
        // Back through each head's value up-projection: d_o_lat[h] =
        // d_o[h] W_UV[h].
        let d_o_lat = uninit(b, rows * a * kr)?;
        b.batched_matmul(
            b.view(&d_o)?,
            weight_rows(b, kv_up, kr, ab.value_rows())?,
            b.view_mut(&d_o_lat)?,
            ab.per_head(
                MatmulDims::linear_input_grad(rows, kr, dv, false),
                [Some(dv), None, Some(kr)],
            ),
        )?;
        let dq_lat = uninit(b, rows * a * dl)?;
        let dkv = uninit(b, rows * dl)?;
        b.sparse_mqa_backward(
            b.view(&s.q_lat)?,
            b.view(&s.kv)?,
            b.view(&s.indices)?,
            b.view(&s.o_lat)?,
            b.view(&s.lse)?,
            b.view(&d_o_lat)?,
            b.view_mut(&dq_lat)?,
            b.view_mut(&dkv)?,
            self.attention_dims(tokens),
        )?;
        drop((d_o_lat, s.q_lat, s.kv));
        // Back through the absorption: dq_nope[h] = dq_lat[h][..kv_rank]
        // W_UK[h]^T, the rotary part as it is.
        let dq = uninit(b, rows * a * ab.qk())?;
        copy_block(b, &dq_lat, &dq, rows * a, (dl, kr), (ab.qk(), dn), ab.rope)?;
        b.batched_matmul(
            b.view(&dq_lat)?,
            weight_rows(b, kv_up, kr, ab.key_rows())?,
            b.view_mut(&dq)?,
            ab.per_head(
                MatmulDims::linear(rows, kr, dn),
                [Some(dl), None, Some(ab.qk())],
            ),
        )?;
        // The shared row's gradient: the latent's and the rotary key's.
        let d_c = uninit(b, rows * kr)?;
        let d_k_rope = uninit(b, rows * ab.rope)?;
        copy_block(b, &dkv, &d_c, rows, (dl, 0), (kr, 0), kr)?;
        copy_block(b, &dkv, &d_k_rope, rows, (dl, kr), (ab.rope, 0), ab.rope)?;
        drop(dkv);
        let indexer = match s.indexer {
            Some(ix) => Some(self.indexer_backward(b, weights, ix, tokens, loss_scale)?),
            None => None,
        };
        let grads = LatentGrads {
            dq,
            d_c,
            d_k_rope,
            d_kv: None,
        };
        let mla = self
            .mla
            .backward_projection(b, weights, s.p, s.o, grads, dx)?;
        Ok(DsaWgrad {
            tokens,
            mla,
            q: s.q,
            dq_lat,
            d_o,
            o_lat: s.o_lat,
            indexer,
        })
    }

    /// The indexer's gradients from its loss: through the scores, rotary
    /// and the key's LayerNorm, down to the projections' outputs (the
    /// indexer's inputs are detached, so nothing flows further).
    fn indexer_backward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        ix: IndexerSaved<B>,
        tokens: Tokens,
        loss_scale: f32,
    ) -> Result<IndexerGrads<B>> {
        let rows = tokens.rows()?;
        let (ni, di) = (self.index_heads, self.index_dim);
        let d_q = uninit(b, rows * ni * di)?;
        let d_k = uninit(b, rows * di)?;
        let d_weights = uninit(b, rows * ni)?;
        b.indexer_backward(
            IndexerInputs {
                q: b.view(&ix.q)?,
                k: b.view(&ix.k)?,
                weights: b.view(&ix.weights)?,
            },
            b.view(&ix.d_scores)?,
            IndexerInputs {
                q: b.view_mut(&d_q)?,
                k: b.view_mut(&d_k)?,
                weights: b.view_mut(&d_weights)?,
            },
            self.indexer_dims(tokens),
            loss_scale,
        )?;
        b.rotary_backward(b.view_mut(&d_q)?, self.indexer_rotary(tokens, ni))?;
        b.rotary_backward(b.view_mut(&d_k)?, self.indexer_rotary(tokens, 1))?;
        let d_k_raw = uninit(b, rows * di)?;
        b.layer_norm_backward(
            b.view(&ix.k_raw)?,
            weight::<B>(weights, K_NORM_W)?,
            b.view(&ix.k_stats)?,
            b.view(&d_k)?,
            b.view_mut(&d_k_raw)?,
            self.key_norm_dims(rows),
        )?;
        Ok(IndexerGrads {
            d_q,
            k_raw: ix.k_raw,
            k_stats: ix.k_stats,
            d_k,
            d_k_raw,
            d_weights,
        })
    }

    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        g: DsaWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`D` layer", self.params(), grads)?;
        let rows = g.tokens.rows()?;
        let (h, ni, di, qr) = (
            self.mla.hidden(),
            self.index_heads,
            self.index_dim,
            self.qr()?,
        );
        if let Some(ix) = &g.indexer {
            let cq = g.mla.query_latent().ok_or_else(|| {
                RuntimeError::InvalidArgument(
                    "`D` layer: the projection's gradient kept no compressed query".into(),
                )
            })?;
            let u = g.mla.normed_input();
            b.matmul(
                b.view(&ix.d_q)?,
                b.view(cq)?,
                grad(b, grads, WQ_B)?,
                MatmulDims::linear_weight_grad(rows, qr, ni * di),
            )?;
            b.matmul(
                b.view(&ix.d_k_raw)?,
                b.view(u)?,
                grad(b, grads, WK)?,
                MatmulDims::linear_weight_grad(rows, h, di),
            )?;
            let (d_norm_w, d_norm_b) = super::grad_pair(b, grads, K_NORM_W, K_NORM_B)?;
            b.layer_norm_weight_grad(
                b.view(&ix.k_raw)?,
                b.view(&ix.k_stats)?,
                b.view(&ix.d_k)?,
                d_norm_w,
                d_norm_b,
                self.key_norm_dims(rows),
            )?;
            b.matmul(
                b.view(&ix.d_weights)?,
                b.view(u)?,
                grad(b, grads, WEIGHTS_PROJ)?,
                MatmulDims::linear_weight_grad(rows, h, ni),
            )?;
        }
        // linear_kv_up_proj, every head's blocks in place: dW_UK[h] +=
        // q_nope[h]^T dq_lat[h][..kv_rank], dW_UV[h] += d_o[h]^T o_lat[h].
        let ab = self.absorbed();
        let (dn, dv, kr, dl) = (ab.nope, ab.v, ab.rank, ab.width());
        let kv_up = self.mla.kv_up_index();
        b.batched_matmul(
            b.view(&g.q)?,
            b.view(&g.dq_lat)?,
            grad_rows(b, grads, kv_up, kr, ab.key_rows())?,
            ab.per_head(
                MatmulDims::linear_weight_grad(rows, kr, dn),
                [Some(ab.qk()), Some(dl), None],
            ),
        )?;
        b.batched_matmul(
            b.view(&g.d_o)?,
            b.view(&g.o_lat)?,
            grad_rows(b, grads, kv_up, kr, ab.value_rows())?,
            ab.per_head(
                MatmulDims::linear_weight_grad(rows, kr, dv),
                [Some(dv), Some(kr), None],
            ),
        )?;
        self.mla.backward_weight(b, g.mla, grads)
    }
}

impl<B: Backend> DsaSaved<B> {
    fn p_tokens(&self) -> Tokens {
        self.p.tokens()
    }
}

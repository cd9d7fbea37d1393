//! The entry of an MTP depth (layers.md "Model"): `h_k = W_eh [RMSNorm_e(e) ;
//! RMSNorm_h(h_{k-1})]`, embedding first as Megatron concatenates. The
//! caller embeds the shifted tokens (position t gets token t + k) and runs
//! the depth's layers, final norm and the shared head after it.

use super::norm::{NormPartials, RmsNorm};
use super::{check_grads, check_len, check_weights, grad, positive, uninit, weight};
use crate::backend::{Backend, CopyCols, MatmulDims, Slice, SliceMut};
use crate::error::Result;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::ParamDef;

const ENORM: usize = 0;
const HNORM: usize = 1;
const EH_PROJ: usize = 2;

/// `mtp.layers.{d}.{enorm, hnorm, eh_proj}` (the first three parameters of
/// the depth's `MtpBlock`, in that order).
#[derive(Clone, Debug)]
pub struct MtpEntry {
    hidden: usize,
    params: Vec<ParamDef>,
}

/// What [`MtpEntry::forward`] keeps.
pub struct MtpSaved<B: Backend> {
    rows: usize,
    emb: B::Buf,
    rstd_e: B::Buf,
    h_prev: B::Buf,
    rstd_h: B::Buf,
    cat: B::Buf,
}

/// What [`MtpEntry::backward_input`] keeps.
pub struct MtpWgrad<B: Backend> {
    rows: usize,
    enorm: NormPartials<B>,
    hnorm: NormPartials<B>,
    cat: B::Buf,
    d_out: B::Buf,
}

impl MtpEntry {
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let h = positive("hidden_size", config.hidden_size)?;
        Ok(MtpEntry {
            hidden: h,
            params: vec![
                ParamDef::new("enorm.weight", &[h]),
                ParamDef::new("hnorm.weight", &[h]),
                ParamDef::new("eh_proj.weight", &[h, 2 * h]),
            ],
        })
    }

    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    /// Column block `half` (0: embedding, 1: hidden) of a `[rows, 2h]` row.
    fn half(&self, rows: usize, half: usize, into_cat: bool) -> CopyCols {
        let h = self.hidden;
        let (src_stride, src_offset, dst_stride, dst_offset) = if into_cat {
            (h, 0, 2 * h, half * h)
        } else {
            (2 * h, half * h, h, 0)
        };
        CopyCols {
            rows,
            cols: h,
            src_stride,
            src_offset,
            dst_stride,
            dst_offset,
            accumulate: false,
        }
    }

    /// `h_k` (a new `[rows, h]` buffer) from the embedded shifted tokens
    /// `emb` and the previous depth's hidden states `h_prev` (`h_0`: the
    /// decoder output after its final norm).
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        emb: Slice<'_, B>,
        h_prev: Slice<'_, B>,
    ) -> Result<(B::Buf, MtpSaved<B>)> {
        check_weights(b, "MTP entry", &self.params, weights)?;
        let h = self.hidden;
        let rows = b.slice_len(emb) / h;
        check_len("MTP entry", "emb", b.slice_len(emb), rows * h)?;
        check_len("MTP entry", "h_prev", b.slice_len(h_prev), rows * h)?;
        let norm = RmsNorm::plain(h);
        let (en, rstd_e) = norm.forward(b, weight::<B>(weights, ENORM)?, emb, rows)?;
        let (hn, rstd_h) = norm.forward(b, weight::<B>(weights, HNORM)?, h_prev, rows)?;
        let cat = uninit(b, rows * 2 * h)?;
        b.copy_cols(b.view(&en)?, b.view_mut(&cat)?, self.half(rows, 0, true))?;
        b.copy_cols(b.view(&hn)?, b.view_mut(&cat)?, self.half(rows, 1, true))?;
        let out = uninit(b, rows * h)?;
        b.matmul(
            b.view(&cat)?,
            weight::<B>(weights, EH_PROJ)?,
            b.view_mut(&out)?,
            MatmulDims::linear(rows, 2 * h, h),
        )?;
        let saved = MtpSaved {
            rows,
            emb: super::copy_of(b, emb)?,
            rstd_e,
            h_prev: super::copy_of(b, h_prev)?,
            rstd_h,
            cat,
        };
        Ok((out, saved))
    }

    /// `d_emb += ...`, `d_h_prev += ...` from `d_out` = dL/dh_k.
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: MtpSaved<B>,
        d_out: Slice<'_, B>,
        d_emb: SliceMut<'_, B>,
        d_h_prev: SliceMut<'_, B>,
    ) -> Result<MtpWgrad<B>> {
        check_weights(b, "MTP entry backward", &self.params, weights)?;
        let (h, rows) = (self.hidden, saved.rows);
        for (what, len) in [
            ("d_out", b.slice_len(d_out)),
            ("d_emb", b.slice_len(b.as_slice(&d_emb))),
            ("d_h_prev", b.slice_len(b.as_slice(&d_h_prev))),
        ] {
            check_len("MTP entry backward", what, len, rows * h)?;
        }
        let d_cat = uninit(b, rows * 2 * h)?;
        b.matmul(
            d_out,
            weight::<B>(weights, EH_PROJ)?,
            b.view_mut(&d_cat)?,
            MatmulDims::linear_input_grad(rows, 2 * h, h, false),
        )?;
        let d_en = uninit(b, rows * h)?;
        let d_hn = uninit(b, rows * h)?;
        b.copy_cols(
            b.view(&d_cat)?,
            b.view_mut(&d_en)?,
            self.half(rows, 0, false),
        )?;
        b.copy_cols(
            b.view(&d_cat)?,
            b.view_mut(&d_hn)?,
            self.half(rows, 1, false),
        )?;
        let norm = RmsNorm::plain(h);
        let enorm = norm.backward_input(
            b,
            weight::<B>(weights, ENORM)?,
            &saved.emb,
            &saved.rstd_e,
            b.view(&d_en)?,
            d_emb,
            rows,
        )?;
        let hnorm = norm.backward_input(
            b,
            weight::<B>(weights, HNORM)?,
            &saved.h_prev,
            &saved.rstd_h,
            b.view(&d_hn)?,
            d_h_prev,
            rows,
        )?;
        Ok(MtpWgrad {
            rows,
            enorm,
            hnorm,
            cat: saved.cat,
            d_out: super::copy_of(b, d_out)?,
        })
    }

    /// Accumulates the `enorm`, `hnorm` and `eh_proj` gradients.
    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        g: MtpWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "MTP entry", &self.params, grads)?;
        let (h, rows) = (self.hidden, g.rows);
        let norm = RmsNorm::plain(h);
        norm.backward_weight(b, &g.enorm, grad(b, grads, ENORM)?)?;
        norm.backward_weight(b, &g.hnorm, grad(b, grads, HNORM)?)?;
        b.matmul(
            b.view(&g.d_out)?,
            b.view(&g.cat)?,
            grad(b, grads, EH_PROJ)?,
            MatmulDims::linear_weight_grad(rows, 2 * h, h),
        )
    }
}

//! RMSNorm as layers use it (fused in front of a projection, Mamba's grouped
//! gated norm, qk-norm), and the standalone final norm of the decoder and of
//! each MTP depth.

use super::{Tokens, check_rows, copy_of, uninit, uninit_f32};
use crate::backend::{Backend, NormDims, Slice, SliceMut};
use crate::error::{Result, RuntimeError};

/// The epsilon of every RMSNorm (layers.md).
pub const RMS_NORM_EPS: f32 = 1e-5;

/// RMSNorm over `dim` channels cut into `groups` groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RmsNorm {
    pub dim: usize,
    pub groups: usize,
}

impl RmsNorm {
    pub fn plain(dim: usize) -> Self {
        RmsNorm { dim, groups: 1 }
    }

    pub fn grouped(dim: usize, groups: usize) -> Self {
        RmsNorm { dim, groups }
    }

    fn dims(&self, rows: usize) -> NormDims {
        NormDims {
            rows,
            dim: self.dim,
            groups: self.groups,
            eps: RMS_NORM_EPS,
        }
    }

    /// `(y, rstd)` for `x` `[rows, dim]`.
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: Slice<'_, B>,
        rows: usize,
    ) -> Result<(B::Buf, B::Buf)> {
        self.forward_into(b, weight, x, None, rows)
    }

    /// `(y, rstd, x_copy)`: [`RmsNorm::forward`], and a copy of `x` made in
    /// the same pass (what a layer keeps of its input).
    pub fn forward_keeping_input<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: Slice<'_, B>,
        rows: usize,
    ) -> Result<(B::Buf, B::Buf, B::Buf)> {
        let x_copy = uninit(b, b.slice_len(x))?;
        let (y, rstd) = self.forward_into(b, weight, x, Some(b.view_mut(&x_copy)?), rows)?;
        Ok((y, rstd, x_copy))
    }

    /// `(y, rstd)`, copying `x` into `x_copy` where given.
    fn forward_into<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: Slice<'_, B>,
        x_copy: Option<SliceMut<'_, B>>,
        rows: usize,
    ) -> Result<(B::Buf, B::Buf)> {
        let y = uninit(b, b.slice_len(x))?;
        let rstd = uninit_f32(b, rows.saturating_mul(self.groups))?;
        let dims = self.dims(rows);
        b.rmsnorm_forward(x, weight, b.view_mut(&y)?, b.view_mut(&rstd)?, x_copy, dims)?;
        Ok((y, rstd))
    }

    /// `dx += J^T dy`, returning `dx` as it was before (copied in the same
    /// pass: what a layer keeps of its output's gradient) and the weight
    /// gradient's partial sums.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_input_keeping_dx<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: &B::Buf,
        rstd: &B::Buf,
        dy: Slice<'_, B>,
        dx: SliceMut<'_, B>,
        rows: usize,
    ) -> Result<(B::Buf, NormPartials<B>)> {
        let before = uninit(b, b.slice_len(b.as_slice(&dx)))?;
        let partials = self.backward_into(b, weight, x, rstd, dy, dx, Some(&before), rows)?;
        Ok((before, partials))
    }

    /// `dx += J^T dy`, returning the weight gradient's partial sums (taken
    /// in the same pass over `dy` and `x`).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: &B::Buf,
        rstd: &B::Buf,
        dy: Slice<'_, B>,
        dx: SliceMut<'_, B>,
        rows: usize,
    ) -> Result<NormPartials<B>> {
        self.backward_into(b, weight, x, rstd, dy, dx, None, rows)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_into<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: &B::Buf,
        rstd: &B::Buf,
        dy: Slice<'_, B>,
        dx: SliceMut<'_, B>,
        before: Option<&B::Buf>,
        rows: usize,
    ) -> Result<NormPartials<B>> {
        let dims = self.dims(rows);
        let partials = uninit_f32(b, dims.weight_partials_len())?;
        let before = before.map(|buf| b.view_mut(buf)).transpose()?;
        let (x, rstd, out) = (b.view(x)?, b.view(rstd)?, b.view_mut(&partials)?);
        b.rmsnorm_backward_input(dy, x, weight, rstd, dx, before, out, dims)?;
        Ok(NormPartials { rows, partials })
    }

    /// `dw += sum_rows dy * x * rstd`, from the partial sums the input
    /// gradient took.
    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        partials: &NormPartials<B>,
        dw: SliceMut<'_, B>,
    ) -> Result<()> {
        let dims = self.dims(partials.rows);
        b.rmsnorm_backward_weight(b.view(&partials.partials)?, dw, dims)
    }
}

/// The weight gradient's partial sums of one [`RmsNorm`] backward (slices
/// of rows, `NormDims::weight_partials_len` f32s): what the delayed weight
/// gradient keeps of the norm, in place of its `dy` and `x`.
pub(crate) struct NormPartials<B: Backend> {
    rows: usize,
    partials: B::Buf,
}

/// The decoder's final norm (`decoder.final_norm.weight`), or an MTP depth's
/// `final_layernorm`: `y = RMSNorm(x)` into a new buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FinalNorm {
    norm: RmsNorm,
}

/// What [`FinalNorm::forward`] keeps.
pub struct NormSaved<B: Backend> {
    rows: usize,
    x: B::Buf,
    rstd: B::Buf,
}

/// What [`FinalNorm::backward_input`] keeps.
pub struct NormWgrad<B: Backend> {
    partials: NormPartials<B>,
}

impl FinalNorm {
    pub fn new(hidden: usize) -> Result<Self> {
        super::positive("the hidden size", hidden)?;
        Ok(FinalNorm {
            norm: RmsNorm::plain(hidden),
        })
    }

    fn check_weight(&self, len: usize) -> Result<()> {
        if len == self.norm.dim {
            Ok(())
        } else {
            Err(RuntimeError::InvalidArgument(format!(
                "final norm: the weight has {len} elements, expected {}",
                self.norm.dim
            )))
        }
    }

    /// `y = RMSNorm(x)` for `x` `[rows, h]`; returns `y` and the saved state.
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        x: Slice<'_, B>,
        tokens: Tokens,
    ) -> Result<(B::Buf, NormSaved<B>)> {
        self.check_weight(b.slice_len(weight))?;
        let rows = check_rows("final norm", "x", b.slice_len(x), tokens, self.norm.dim)?;
        let (y, rstd) = self.norm.forward(b, weight, x, rows)?;
        let x = copy_of(b, x)?;
        Ok((y, NormSaved { rows, x, rstd }))
    }

    /// `dx += J^T dy` (`dy` = dL/dy summed over every consumer of `y`).
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        saved: NormSaved<B>,
        dy: Slice<'_, B>,
        dx: SliceMut<'_, B>,
    ) -> Result<NormWgrad<B>> {
        self.check_weight(b.slice_len(weight))?;
        let len = saved.rows * self.norm.dim;
        for (what, got) in [
            ("dy", b.slice_len(dy)),
            ("dx", b.slice_len(b.as_slice(&dx))),
        ] {
            if got != len {
                return Err(RuntimeError::InvalidArgument(format!(
                    "final norm backward: `{what}` has {got} elements, expected {len}"
                )));
            }
        }
        let partials =
            self.norm
                .backward_input(b, weight, &saved.x, &saved.rstd, dy, dx, saved.rows)?;
        Ok(NormWgrad { partials })
    }

    /// `dw += ...` for the norm weight.
    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        wgrad: NormWgrad<B>,
        dw: SliceMut<'_, B>,
    ) -> Result<()> {
        self.check_weight(b.slice_len(b.as_slice(&dw)))?;
        self.norm.backward_weight(b, &wgrad.partials, dw)
    }
}

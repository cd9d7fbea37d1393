//! Layers with hand-written forward, input-gradient and weight-gradient
//! backward (docs/layers.md), written once against [`Backend`].
//!
//! Conventions every layer follows (the schedules rely on them):
//! - Activations of a micro-batch are `[rows, h]` row-major, `rows = batch *
//!   seq` ([`Tokens`]); causal ops restart at every sequence.
//! - Weights arrive as a list of read-only views in exactly
//!   `layer_params(kind, config, local_experts)` order; weight gradients as a
//!   list of writable views in the same order, and backward **accumulates**
//!   into them (they sum over micro-batches).
//! - `forward` reads the residual stream `x` and adds the layer's output in
//!   place (`x += f(x)`), returning what backward needs (a `...Saved` value).
//!   `backward_input` consumes it, turns `dx` = dL/d(x after) in place into
//!   dL/d(x before) (`dx += J^T dx`), and returns what the weight gradient
//!   needs (a `...Wgrad` value). `backward_weight` consumes that and may run
//!   any time later ("delayed wgrad"): it only reads its own saved buffers, so
//!   the bits are the same whenever it runs.
//! - Everything is deterministic: fixed loop orders, no reductions whose
//!   order varies.

pub mod attention;
mod conv_silu;
mod core_attention;
pub mod dsa;
pub mod embedding;
pub mod gdn;
pub mod head;
pub mod init;
pub mod mamba;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod mtp;
pub mod norm;
mod split_projection;

pub use crate::backend::Tokens;
pub use attention::{AttentionLayer, AttentionSaved, AttentionWgrad};
pub use dsa::{DsaLayer, DsaSaved, DsaWgrad};
pub use embedding::Embedding;
pub use gdn::{GdnLayer, GdnSaved, GdnWgrad};
pub use head::{HEAD_CHUNK_ELEMENTS, Head, HeadSaved, counted_targets};
pub use init::{InitScale, ParamInit, global_expert_name, init_param, init_param_range};

pub use mamba::{MambaLayer, MambaSaved, MambaWgrad};
pub use mla::{MlaLayer, MlaSaved, MlaWgrad};
pub use mlp::{MlpLayer, MlpSaved, MlpWgrad};
pub use moe::{
    Balance, CollectiveExchange, ExpertBalance, ExpertExchange, LocalExchange, MoeBackward,
    MoeCombineBackward, MoeCombineGrad, MoeCombined, MoeExpertsSaved, MoeExpertsWgrad, MoeForward,
    MoeLayer, MoePrepareWgrad, MoePrepared, MoeRouting, MoeSaved, MoeStage, MoeWgrad,
    RouterContext, expert_bias_key, expert_bias_keys, update_expert_bias,
};

pub use mtp::{MtpEntry, MtpSaved, MtpWgrad};
pub use norm::{FinalNorm, NormSaved, NormWgrad, RMS_NORM_EPS};

use crate::backend::{Backend, DType, Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::ParamDef;
use std::ops::Range;

/// One decoder (or MTP) layer of any kind the runtime trains. The schedule
/// holds one per physical layer and calls it per micro-batch, keeping the
/// returned [`LayerSaved`] / [`LayerWgrad`] per (micro-batch, layer).
///
/// `E` layers also expose their stages ([`LayerImpl::as_moe`]) for the
/// overlap schedule, which runs the all-to-alls between them; the whole-layer
/// calls here run those stages with a [`LocalExchange`] (expert parallelism
/// 1).
#[derive(Clone, Debug)]
pub enum LayerImpl {
    Mamba(MambaLayer),
    Gdn(GdnLayer),
    Attention(AttentionLayer),
    Mla(MlaLayer),
    Dsa(DsaLayer),
    Mlp(MlpLayer),
    Moe(MoeLayer),
}

/// What a layer's forward kept for its backward, per micro-batch.
pub enum LayerSaved<B: Backend> {
    Mamba(MambaSaved<B>),
    Gdn(GdnSaved<B>),
    Attention(AttentionSaved<B>),
    Mla(MlaSaved<B>),
    Dsa(DsaSaved<B>),
    Mlp(MlpSaved<B>),
    Moe(MoeSaved<B>),
}

/// What a layer's input-gradient backward kept for its weight gradient.
pub enum LayerWgrad<B: Backend> {
    Mamba(MambaWgrad<B>),
    Gdn(GdnWgrad<B>),
    Attention(AttentionWgrad<B>),
    Mla(MlaWgrad<B>),
    Dsa(DsaWgrad<B>),
    Mlp(MlpWgrad<B>),
    Moe(MoeWgrad<B>),
}

impl<B: Backend> LayerSaved<B> {
    /// The MoE load-balancing loss of this forward (already multiplied by its
    /// coefficient), read back from the device (for tests); 0 for other
    /// kinds.
    pub fn aux_loss(&self, b: &B) -> Result<f64> {
        match self {
            LayerSaved::Moe(saved) => saved.aux_loss(b),
            _ => Ok(0.0),
        }
    }

    /// The DSA indexer loss of this forward (already multiplied by its
    /// coefficient), read back from the device (for tests); 0 for other
    /// kinds.
    pub fn indexer_loss(&self, b: &B) -> Result<f64> {
        match self {
            LayerSaved::Dsa(saved) => saved.indexer_loss(b),
            _ => Ok(0.0),
        }
    }

    /// Adds a `D` layer's indexer loss into the step's f64 slot, on the
    /// lane; nothing for other kinds.
    pub fn add_indexer_loss(&self, b: &B, slot: SliceMut<'_, B>) -> Result<()> {
        match self {
            LayerSaved::Dsa(saved) => saved.add_indexer_loss(b, slot),
            _ => Ok(()),
        }
    }
}

impl LayerImpl {
    /// The layer for `kind` under `config`. `local_experts` is the number of
    /// experts this rank holds (`E / ep`) for `E`, ignored otherwise. A
    /// missing config section or inconsistent dimensions are refused with
    /// `InvalidArgument`.
    pub fn new(kind: LayerKind, config: &ModelConfig, local_experts: usize) -> Result<Self> {
        Ok(match kind {
            LayerKind::Mamba => LayerImpl::Mamba(MambaLayer::new(config)?),
            LayerKind::Attention => LayerImpl::Attention(AttentionLayer::new(config)?),
            LayerKind::Mla => LayerImpl::Mla(MlaLayer::new(config)?),
            LayerKind::Mlp => LayerImpl::Mlp(MlpLayer::new(config)?),
            LayerKind::Moe => LayerImpl::Moe(MoeLayer::new(config, local_experts)?),
            LayerKind::GatedDeltaNet => LayerImpl::Gdn(GdnLayer::new(config)?),
            LayerKind::Dsa => LayerImpl::Dsa(DsaLayer::new(config)?),
        })
    }

    pub fn kind(&self) -> LayerKind {
        match self {
            LayerImpl::Mamba(_) => LayerKind::Mamba,
            LayerImpl::Gdn(_) => LayerKind::GatedDeltaNet,
            LayerImpl::Attention(_) => LayerKind::Attention,
            LayerImpl::Mla(_) => LayerKind::Mla,
            LayerImpl::Dsa(_) => LayerKind::Dsa,
            LayerImpl::Mlp(_) => LayerKind::Mlp,
            LayerImpl::Moe(_) => LayerKind::Moe,
        }
    }

    /// The parameters, in the order weights and gradients are passed.
    pub fn params(&self) -> &[ParamDef] {
        match self {
            LayerImpl::Mamba(l) => l.params(),
            LayerImpl::Gdn(l) => l.params(),
            LayerImpl::Attention(l) => l.params(),
            LayerImpl::Mla(l) => l.params(),
            LayerImpl::Dsa(l) => l.params(),
            LayerImpl::Mlp(l) => l.params(),
            LayerImpl::Moe(l) => l.params(),
        }
    }

    /// The MoE layer, for the staged calls of the overlap schedule.
    pub fn as_moe(&self) -> Option<&MoeLayer> {
        match self {
            LayerImpl::Moe(l) => Some(l),
            _ => None,
        }
    }

    pub fn as_moe_mut(&mut self) -> Option<&mut MoeLayer> {
        match self {
            LayerImpl::Moe(l) => Some(l),
            _ => None,
        }
    }

    /// `x += layer(x)` for one micro-batch.
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        x: SliceMut<'_, B>,
        tokens: Tokens,
    ) -> Result<LayerSaved<B>> {
        Ok(match self {
            LayerImpl::Mamba(l) => LayerSaved::Mamba(l.forward(b, weights, x, tokens)?),
            LayerImpl::Gdn(l) => LayerSaved::Gdn(l.forward(b, weights, x, tokens)?),
            LayerImpl::Attention(l) => LayerSaved::Attention(l.forward(b, weights, x, tokens)?),
            LayerImpl::Mla(l) => LayerSaved::Mla(l.forward(b, weights, x, tokens)?),
            LayerImpl::Dsa(l) => LayerSaved::Dsa(l.forward(b, weights, x, tokens)?),
            LayerImpl::Mlp(l) => LayerSaved::Mlp(l.forward(b, weights, x, tokens)?),
            LayerImpl::Moe(l) => {
                LayerSaved::Moe(l.forward_with(b, weights, x, tokens, &LocalExchange)?)
            }
        })
    }

    /// `dx += J^T dx`. `aux_loss_scale` multiplies the gradient of an `E`
    /// layer's load-balancing loss and of a `D` layer's indexer loss (pass
    /// the scale used for the cross-entropy gradients); other kinds ignore
    /// it.
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: LayerSaved<B>,
        dx: SliceMut<'_, B>,
        aux_loss_scale: f32,
    ) -> Result<LayerWgrad<B>> {
        Ok(match (self, saved) {
            (LayerImpl::Mamba(l), LayerSaved::Mamba(s)) => {
                LayerWgrad::Mamba(l.backward_input(b, weights, s, dx)?)
            }
            (LayerImpl::Gdn(l), LayerSaved::Gdn(s)) => {
                LayerWgrad::Gdn(l.backward_input(b, weights, s, dx)?)
            }
            (LayerImpl::Attention(l), LayerSaved::Attention(s)) => {
                LayerWgrad::Attention(l.backward_input(b, weights, s, dx)?)
            }
            (LayerImpl::Mla(l), LayerSaved::Mla(s)) => {
                LayerWgrad::Mla(l.backward_input(b, weights, s, dx)?)
            }
            (LayerImpl::Dsa(l), LayerSaved::Dsa(s)) => {
                LayerWgrad::Dsa(l.backward_input(b, weights, s, dx, aux_loss_scale)?)
            }
            (LayerImpl::Mlp(l), LayerSaved::Mlp(s)) => {
                LayerWgrad::Mlp(l.backward_input(b, weights, s, dx)?)
            }
            (LayerImpl::Moe(l), LayerSaved::Moe(s)) => LayerWgrad::Moe(l.backward_input_with(
                b,
                weights,
                s,
                dx,
                aux_loss_scale,
                &LocalExchange,
            )?),
            (layer, _) => return Err(mismatch(layer.kind(), "saved state")),
        })
    }

    /// Accumulates the weight gradients into `grads`.
    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        wgrad: LayerWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        match (self, wgrad) {
            (LayerImpl::Mamba(l), LayerWgrad::Mamba(w)) => l.backward_weight(b, w, grads),
            (LayerImpl::Gdn(l), LayerWgrad::Gdn(w)) => l.backward_weight(b, w, grads),
            (LayerImpl::Attention(l), LayerWgrad::Attention(w)) => l.backward_weight(b, w, grads),
            (LayerImpl::Mla(l), LayerWgrad::Mla(w)) => l.backward_weight(b, w, grads),
            (LayerImpl::Dsa(l), LayerWgrad::Dsa(w)) => l.backward_weight(b, w, grads),
            (LayerImpl::Mlp(l), LayerWgrad::Mlp(w)) => l.backward_weight(b, w, grads),
            (LayerImpl::Moe(l), LayerWgrad::Moe(w)) => l.backward_weight_with(b, w, grads),
            (layer, _) => Err(mismatch(layer.kind(), "weight-gradient state")),
        }
    }
}

fn mismatch(kind: LayerKind, what: &str) -> RuntimeError {
    RuntimeError::InvalidArgument(format!(
        "the {what} passed to a `{}` layer belongs to another layer kind",
        kind.symbol()
    ))
}

// ---- helpers shared by the layers -------------------------------------------

/// A config section a layer needs, or an error naming it.
pub(crate) fn section<'c, T>(section: &'c Option<T>, kind: LayerKind, name: &str) -> Result<&'c T> {
    section.as_ref().ok_or_else(|| {
        RuntimeError::InvalidArgument(format!(
            "a `{}` ({}) layer needs the model's [{name}] section",
            kind.symbol(),
            kind.name()
        ))
    })
}

/// A dimension that must be at least 1.
pub(crate) fn positive(what: &str, value: usize) -> Result<usize> {
    if value == 0 {
        Err(RuntimeError::InvalidArgument(format!("{what} is 0")))
    } else {
        Ok(value)
    }
}

/// Checks a weight list against a layer's parameter definitions.
pub(crate) fn check_weights<B: Backend>(
    b: &B,
    layer: &str,
    defs: &[ParamDef],
    weights: &[Slice<'_, B>],
) -> Result<()> {
    check_views(
        layer,
        "weights",
        defs,
        weights.iter().map(|w| b.slice_len(*w)),
    )
}

/// Checks a gradient list against a layer's parameter definitions.
pub(crate) fn check_grads<B: Backend>(
    b: &B,
    layer: &str,
    defs: &[ParamDef],
    grads: &[SliceMut<'_, B>],
) -> Result<()> {
    check_views(
        layer,
        "gradients",
        defs,
        grads.iter().map(|g| b.slice_len(b.as_slice(g))),
    )
}

fn check_views(
    layer: &str,
    what: &str,
    defs: &[ParamDef],
    lens: impl ExactSizeIterator<Item = usize>,
) -> Result<()> {
    if lens.len() != defs.len() {
        return Err(RuntimeError::InvalidArgument(format!(
            "{layer}: {} {what} given, the layer has {} parameters",
            lens.len(),
            defs.len()
        )));
    }
    for (len, def) in lens.zip(defs) {
        if len != def.numel() {
            return Err(RuntimeError::InvalidArgument(format!(
                "{layer}: {what} for `{}` have {len} elements, its shape {:?} has {}",
                def.name,
                def.shape,
                def.numel()
            )));
        }
    }
    Ok(())
}

/// Weight `i` of a checked list.
pub(crate) fn weight<'w, B: Backend>(weights: &[Slice<'w, B>], i: usize) -> Result<Slice<'w, B>> {
    weights.get(i).copied().ok_or_else(|| {
        RuntimeError::InvalidArgument(format!("weight {i} is missing from the list"))
    })
}

/// Rows `rows` of a row-major `[_, width]` weight (a block of a fused
/// projection).
pub(crate) fn weight_rows<'w, B: Backend>(
    b: &B,
    w: Slice<'w, B>,
    width: usize,
    rows: Range<usize>,
) -> Result<Slice<'w, B>> {
    b.subslice(w, rows.start * width..rows.end * width)
}

/// Gradient `i` of a checked list, reborrowed.
pub(crate) fn grad<'g, 'a: 'g, B: Backend>(
    b: &B,
    grads: &'g mut [SliceMut<'a, B>],
    i: usize,
) -> Result<SliceMut<'g, B>> {
    let g = grads.get_mut(i).ok_or_else(|| {
        RuntimeError::InvalidArgument(format!("gradient {i} is missing from the list"))
    })?;
    Ok(b.reborrow_mut(g))
}

/// Rows `rows` of gradient `i` (`[_, width]`).
pub(crate) fn grad_rows<'g, 'a: 'g, B: Backend>(
    b: &B,
    grads: &'g mut [SliceMut<'a, B>],
    i: usize,
    width: usize,
    rows: Range<usize>,
) -> Result<SliceMut<'g, B>> {
    let g = grads.get_mut(i).ok_or_else(|| {
        RuntimeError::InvalidArgument(format!("gradient {i} is missing from the list"))
    })?;
    b.subslice_mut(g, rows.start * width..rows.end * width)
}

/// Gradients `i < j` of a checked list, both reborrowed.
pub(crate) fn grad_pair<'g, 'a: 'g, B: Backend>(
    b: &B,
    grads: &'g mut [SliceMut<'a, B>],
    i: usize,
    j: usize,
) -> Result<(SliceMut<'g, B>, SliceMut<'g, B>)> {
    let (lo, hi) = grads
        .split_at_mut_checked(j)
        .filter(|_| i < j)
        .ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("gradients {i} and {j} are not in the list"))
        })?;
    Ok((grad(b, lo, i)?, grad(b, hi, 0)?))
}

/// `got == want` for a view named `what`.
pub(crate) fn check_len(layer: &str, what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(format!(
            "{layer}: `{what}` has {got} elements, expected {want}"
        )))
    }
}

/// A zeroed activation buffer.
pub(crate) fn zeros<B: Backend>(b: &B, len: usize) -> Result<B::Buf> {
    b.alloc(len, b.compute_dtype())
}

/// A zeroed f32 buffer (router, loss, scan parameters' gradients).
pub(crate) fn zeros_f32<B: Backend>(b: &B, len: usize) -> Result<B::Buf> {
    b.alloc(len, DType::F32)
}

/// An activation buffer of unspecified contents, for an output the next
/// kernel writes whole (not one accumulated into or written in part).
pub(crate) fn uninit<B: Backend>(b: &B, len: usize) -> Result<B::Buf> {
    b.alloc_uninit(len, b.compute_dtype())
}

/// An f32 buffer of unspecified contents, for an output the next kernel
/// writes whole (not one accumulated into or written in part).
pub(crate) fn uninit_f32<B: Backend>(b: &B, len: usize) -> Result<B::Buf> {
    b.alloc_uninit(len, DType::F32)
}

/// A new buffer holding a copy of `src`.
pub(crate) fn copy_of<B: Backend>(b: &B, src: Slice<'_, B>) -> Result<B::Buf> {
    let buf = uninit(b, b.slice_len(src))?;
    b.copy(src, b.view_mut(&buf)?)?;
    Ok(buf)
}

/// Checks that `x` is `[rows, width]` for `tokens`; returns `rows`.
pub(crate) fn check_rows(
    layer: &str,
    what: &str,
    len: usize,
    tokens: Tokens,
    width: usize,
) -> Result<usize> {
    let rows = tokens.rows()?;
    let want = rows.checked_mul(width).ok_or_else(|| {
        RuntimeError::InvalidArgument(format!("{layer}: {rows} rows of {width} overflow"))
    })?;
    if len != want {
        return Err(RuntimeError::InvalidArgument(format!(
            "{layer}: `{what}` has {len} elements, expected {} x {} = {want} for {} sequences of {}",
            rows, width, tokens.batch, tokens.seq
        )));
    }
    Ok(rows)
}

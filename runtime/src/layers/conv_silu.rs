//! The causal depthwise conv and SiLU that `M` (Mamba-2) and `G` (the gated
//! delta net) both put between their input projection and their
//! recurrence: one home for its forward and input gradient, so the two
//! layers run the same kernels in the same order.

use super::uninit;
use crate::backend::{Backend, ConvDims, Slice, Unary};
use crate::error::Result;

/// `act = SiLU(conv(input) + bias)`, `[rows, channels]`; returns the conv's
/// output (the backward's SiLU input, kept) and `act`.
pub(crate) fn forward<B: Backend>(
    b: &B,
    input: Slice<'_, B>,
    weight: Slice<'_, B>,
    bias: Slice<'_, B>,
    dims: ConvDims,
) -> Result<(B::Buf, B::Buf)> {
    let len = dims.tokens.rows()? * dims.channels;
    let conv = uninit(b, len)?;
    b.conv1d_forward(input, weight, bias, b.view_mut(&conv)?, dims)?;
    let act = uninit(b, len)?;
    b.unary_forward(Unary::Silu, b.view(&conv)?, b.view_mut(&act)?)?;
    Ok((conv, act))
}

/// The input gradient of [`forward`] from `d_act`: returns the conv
/// output's gradient (the weight gradient's input, kept) and the input's.
pub(crate) fn backward_input<B: Backend>(
    b: &B,
    conv: Slice<'_, B>,
    d_act: Slice<'_, B>,
    weight: Slice<'_, B>,
    dims: ConvDims,
) -> Result<(B::Buf, B::Buf)> {
    let len = dims.tokens.rows()? * dims.channels;
    let d_conv = uninit(b, len)?;
    b.unary_backward(Unary::Silu, conv, d_act, b.view_mut(&d_conv)?)?;
    let d_input = uninit(b, len)?;
    b.conv1d_backward_input(b.view(&d_conv)?, weight, b.view_mut(&d_input)?, dims)?;
    Ok((d_conv, d_input))
}

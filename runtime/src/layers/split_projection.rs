//! A fused input projection whose row blocks feed different paths (`M`'s
//! `z | xBC | dt`, `G`'s `qkv | z | beta | alpha`): the forward computes it a
//! block at a time so each path's input is contiguous, the input gradient
//! sums the blocks' products in f32, and the weight gradient writes each
//! block's rows. One home for the three loops both layers need.

use super::{grad_rows, uninit_f32, weight_rows};
use crate::backend::{Backend, MatmulDims, Slice, SliceMut};
use crate::error::Result;
use std::ops::Range;

/// `out_i = u W[block_i]^T` for each block, `u` `[rows, hidden]`.
pub(crate) fn forward<'a, B: Backend + 'a>(
    b: &B,
    weight: Slice<'_, B>,
    hidden: usize,
    rows: usize,
    u: &B::Buf,
    blocks: impl IntoIterator<Item = (Range<usize>, &'a mut B::Buf)>,
) -> Result<()> {
    for (block, out) in blocks {
        let width = block.len();
        b.matmul(
            b.view(u)?,
            weight_rows(b, weight, hidden, block)?,
            b.view_mut(out)?,
            MatmulDims::linear(rows, hidden, width),
        )?;
    }
    Ok(())
}

/// `du = sum_i d_out_i W[block_i]`, `[rows, hidden]` in f32: a GEMM's sum
/// into bf16 would round twice (or go through scratch), and the norm's
/// backward reads the sum as it is.
pub(crate) fn input_grad<'a, B: Backend + 'a>(
    b: &B,
    weight: Slice<'_, B>,
    hidden: usize,
    rows: usize,
    blocks: impl IntoIterator<Item = (Range<usize>, &'a B::Buf)>,
) -> Result<B::Buf> {
    let d_u = uninit_f32(b, rows * hidden)?;
    for (i, (block, d_out)) in blocks.into_iter().enumerate() {
        let width = block.len();
        b.matmul(
            b.view(d_out)?,
            weight_rows(b, weight, hidden, block)?,
            b.view_mut(&d_u)?,
            MatmulDims::linear_input_grad(rows, hidden, width, i > 0),
        )?;
    }
    Ok(d_u)
}

/// `dW[block_i] = d_out_i^T u`, into gradient `index` of `grads`.
pub(crate) fn weight_grad<'a, B: Backend + 'a>(
    b: &B,
    grads: &mut [SliceMut<'_, B>],
    index: usize,
    hidden: usize,
    rows: usize,
    u: &B::Buf,
    blocks: impl IntoIterator<Item = (Range<usize>, &'a B::Buf)>,
) -> Result<()> {
    for (block, d_out) in blocks {
        let width = block.len();
        b.matmul(
            b.view(d_out)?,
            b.view(u)?,
            grad_rows(b, grads, index, hidden, block)?,
            MatmulDims::linear_weight_grad(rows, hidden, width),
        )?;
    }
    Ok(())
}

//! What `*` (GQA) and `+` (MLA) share: causal softmax attention over
//! prepared queries, keys and values, then the output projection added into
//! the residual; and the gradients of both. The layers differ only in how
//! they make q, k, v (and undo that in backward).

use super::{check_len, uninit, uninit_f32};
use crate::backend::{AttentionDims, AttentionInputs, Backend, MatmulDims, Slice, SliceMut};
use crate::error::Result;

/// Elements of o (and of the projection's input): `rows x heads x v_dim`.
fn width(dims: &AttentionDims) -> usize {
    dims.heads * dims.v_dim
}

/// `x += Attn(q, k, v) W_proj^T`; returns the attention output `o` and the
/// per-row log-sum-exp the backward needs.
pub(crate) fn forward<B: Backend>(
    b: &B,
    qkv: AttentionInputs<&B::Buf>,
    proj: Slice<'_, B>,
    x: SliceMut<'_, B>,
    dims: AttentionDims,
    hidden: usize,
) -> Result<(B::Buf, B::Buf)> {
    let rows = dims.tokens.rows()?;
    let o = uninit(b, rows * width(&dims))?;
    let lse = uninit_f32(b, rows * dims.heads)?;
    let inputs = AttentionInputs {
        q: b.view(qkv.q)?,
        k: b.view(qkv.k)?,
        v: b.view(qkv.v)?,
    };
    b.attention_forward(inputs, b.view_mut(&o)?, b.view_mut(&lse)?, dims)?;
    let mut out = MatmulDims::linear(rows, width(&dims), hidden);
    out.accumulate = true;
    b.matmul(b.view(&o)?, proj, x, out)?;
    Ok((o, lse))
}

/// The saved forward of the core, by reference.
pub(crate) struct Saved<'s, B: Backend> {
    pub q: &'s B::Buf,
    pub k: &'s B::Buf,
    pub v: &'s B::Buf,
    pub o: &'s B::Buf,
    pub lse: &'s B::Buf,
}

/// From `d_out` = dL/d(layer output): the gradients of q, k and v (before
/// the layer undoes its rotary embedding, norms or head split).
pub(crate) fn backward_input<B: Backend>(
    b: &B,
    saved: Saved<'_, B>,
    proj: Slice<'_, B>,
    d_out: Slice<'_, B>,
    dims: AttentionDims,
    hidden: usize,
) -> Result<(B::Buf, B::Buf, B::Buf)> {
    let rows = dims.tokens.rows()?;
    check_len(
        "attention backward",
        "d_out",
        b.slice_len(d_out),
        rows * hidden,
    )?;
    let d_o = uninit(b, rows * width(&dims))?;
    b.matmul(
        d_out,
        proj,
        b.view_mut(&d_o)?,
        MatmulDims::linear_input_grad(rows, width(&dims), hidden, false),
    )?;
    let dq = uninit(b, rows * dims.heads * dims.qk_dim)?;
    let dk = uninit(b, rows * dims.kv_heads * dims.qk_dim)?;
    let dv = uninit(b, rows * dims.kv_heads * dims.v_dim)?;
    let inputs = AttentionInputs {
        q: b.view(saved.q)?,
        k: b.view(saved.k)?,
        v: b.view(saved.v)?,
    };
    let grads = AttentionInputs {
        q: b.view_mut(&dq)?,
        k: b.view_mut(&dk)?,
        v: b.view_mut(&dv)?,
    };
    b.attention_backward(
        inputs,
        b.view(saved.o)?,
        b.view(saved.lse)?,
        b.view(&d_o)?,
        grads,
        dims,
    )?;
    Ok((dq, dk, dv))
}

/// `dW_proj += d_out^T o`.
pub(crate) fn proj_weight_grad<B: Backend>(
    b: &B,
    d_out: &B::Buf,
    o: &B::Buf,
    dw: SliceMut<'_, B>,
    dims: AttentionDims,
    hidden: usize,
) -> Result<()> {
    let rows = dims.tokens.rows()?;
    b.matmul(
        b.view(d_out)?,
        b.view(o)?,
        dw,
        MatmulDims::linear_weight_grad(rows, width(&dims), hidden),
    )
}

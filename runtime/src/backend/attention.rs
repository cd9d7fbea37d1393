//! Causal softmax attention with grouped KV heads, and rotary position
//! embeddings.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `attention_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`AttentionKernels`] method on each backend (`cpu::ops::attention`,
//! `cuda::ops::attention`).

#[cfg(doc)]
use super::Backend;
use super::Tokens;
use crate::error::Result;
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, ensure, product};

/// Which attention kernels a GPU backend takes (Megatron's
/// `--attention-backend`). The CPU backend has one path, the unfused one.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum AttentionBackend {
    /// Fused kernels (FlashAttention-2's tiling, `attention_flash.cu`) for
    /// bf16 heads of 64 or 128 channels, whose probabilities and score
    /// gradients round to bf16 between their two products, as
    /// FlashAttention's do; other problems take the unfused path.
    #[default]
    Flash,
    /// Materialised scores through cuBLAS (or the tiled kernels)
    /// everywhere: one rounding, at the store.
    Unfused,
}

/// Dimensions of the attention kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    pub tokens: Tokens,
    pub heads: usize,
    /// Divides `heads`.
    pub kv_heads: usize,
    pub qk_dim: usize,
    pub v_dim: usize,
    pub scale: f32,
}

/// Query, key and value tensors (inputs, or their gradients).
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<S> {
    pub q: S,
    pub k: S,
    pub v: S,
}

/// Dimensions of the rotary kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RotaryDims {
    pub tokens: Tokens,
    pub heads: usize,
    /// Elements per head in the buffer.
    pub head_stride: usize,
    /// First rotated channel of a head.
    pub offset: usize,
    /// Rotated channels (even).
    pub dim: usize,
    pub base: f32,
    /// Which channels rotate together.
    pub pairing: RotaryPairing,
}

/// The channel pairs a rotary embedding rotates, both at frequency
/// `theta_i = t * base^(-2i/dim)` for pair `i < dim/2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotaryPairing {
    /// `(i, i + dim/2)`: Megatron's default (`*` attention).
    RotateHalf,
    /// `(2i, 2i + 1)`: Megatron's MLA (`mla_rotary_interleaved`).
    Interleaved,
}

impl RotaryPairing {
    /// The channels (relative to the rotated block) of pair `i` of a block
    /// of `dim` channels.
    pub fn pair(self, i: usize, dim: usize) -> (usize, usize) {
        match self {
            RotaryPairing::RotateHalf => (i, i + dim / 2),
            RotaryPairing::Interleaved => (2 * i, 2 * i + 1),
        }
    }
}

/// The attention and rotary kernels as a backend implements them: each
/// runs once [`Backend`]'s method of the same name (without `_unchecked`)
/// has checked its arguments here, so their dtypes and lengths are right.
pub trait AttentionKernels<Buf: DeviceBuffer> {
    fn attention_forward_unchecked(
        &self,
        inputs: AttentionInputs<View<'_, Buf>>,
        out: ViewMut<'_, Buf>,
        lse: ViewMut<'_, Buf>,
        dims: AttentionDims,
    ) -> Result<()>;

    fn attention_backward_unchecked(
        &self,
        inputs: AttentionInputs<View<'_, Buf>>,
        out: View<'_, Buf>,
        lse: View<'_, Buf>,
        dout: View<'_, Buf>,
        grads: AttentionInputs<ViewMut<'_, Buf>>,
        dims: AttentionDims,
    ) -> Result<()>;

    fn rotary_forward_unchecked(&self, x: ViewMut<'_, Buf>, dims: RotaryDims) -> Result<()>;

    fn rotary_backward_unchecked(&self, dx: ViewMut<'_, Buf>, dims: RotaryDims) -> Result<()>;
}

impl<T: DeviceBuffer> AttentionInputs<View<'_, T>> {
    /// The tensors' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> AttentionInputs<Operand> {
        AttentionInputs {
            q: self.q.operand(),
            k: self.k.operand(),
            v: self.v.operand(),
        }
    }
}

impl<T: DeviceBuffer> AttentionInputs<ViewMut<'_, T>> {
    /// The tensors' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> AttentionInputs<Operand> {
        AttentionInputs {
            q: self.q.operand(),
            k: self.k.operand(),
            v: self.v.operand(),
        }
    }
}

/// `q`, `k` and `v` against `d` (float dtypes checked by the caller, in
/// its arguments' order), `out` (`[rows, heads, v_dim]`) and `lse`
/// (`[rows, heads]`, f32); gives the rows.
fn check_attention(
    kernel: &str,
    d: AttentionDims,
    inputs: AttentionInputs<Operand>,
    out: Operand,
    lse: Operand,
) -> Result<usize> {
    let rows = d.tokens.rows()?;
    ensure(d.kv_heads > 0 && d.heads.is_multiple_of(d.kv_heads), || {
        format!(
            "{kernel}: {} KV heads do not divide {} heads",
            d.kv_heads, d.heads
        )
    })?;
    let AttentionInputs { q, k, v } = inputs;
    q.has_len(kernel, "q", product(kernel, &[rows, d.heads, d.qk_dim])?)?;
    k.has_len(kernel, "k", product(kernel, &[rows, d.kv_heads, d.qk_dim])?)?;
    v.has_len(kernel, "v", product(kernel, &[rows, d.kv_heads, d.v_dim])?)?;
    out.has_len(kernel, "out", product(kernel, &[rows, d.heads, d.v_dim])?)?;
    lse.has_len(kernel, "lse", product(kernel, &[rows, d.heads])?)?;
    Ok(rows)
}

/// [`Backend::attention_forward`]'s arguments; gives the rows.
pub fn check_attention_forward(
    inputs: AttentionInputs<Operand>,
    out: Operand,
    lse: Operand,
    dims: AttentionDims,
) -> Result<usize> {
    let k = "attention_forward";
    for (name, view) in [("q", inputs.q), ("k", inputs.k), ("v", inputs.v)] {
        view.float(k, name)?;
    }
    lse.exactly(DType::F32, k, "lse")?;
    out.float(k, "out")?;
    check_attention(k, dims, inputs, out, lse)
}

/// [`Backend::attention_backward`]'s arguments; gives the rows.
pub fn check_attention_backward(
    inputs: AttentionInputs<Operand>,
    out: Operand,
    lse: Operand,
    dout: Operand,
    grads: AttentionInputs<Operand>,
    dims: AttentionDims,
) -> Result<usize> {
    let k = "attention_backward";
    let floats = [
        ("q", inputs.q),
        ("k", inputs.k),
        ("v", inputs.v),
        ("out", out),
        ("dout", dout),
    ];
    for (name, view) in floats {
        view.float(k, name)?;
    }
    lse.exactly(DType::F32, k, "lse")?;
    for (name, view) in [("dq", grads.q), ("dk", grads.k), ("dv", grads.v)] {
        view.float(k, name)?;
    }
    let rows = check_attention(k, dims, inputs, out, lse)?;
    dout.has_len(k, "dout", out.len)?;
    grads.q.has_len(k, "grads.q", inputs.q.len)?;
    grads.k.has_len(k, "grads.k", inputs.k.len)?;
    grads.v.has_len(k, "grads.v", inputs.v.len)?;
    Ok(rows)
}

/// The view a rotary kernel turns in place (`name` in errors) against `d`.
fn check_rotary(kernel: &str, name: &str, x: Operand, d: RotaryDims) -> Result<()> {
    x.float(kernel, name)?;
    ensure(d.dim.is_multiple_of(2), || {
        format!("{kernel}: rotary dim {} is odd", d.dim)
    })?;
    ensure(d.offset + d.dim <= d.head_stride, || {
        format!(
            "{kernel}: channels {}..{} do not fit a head of {}",
            d.offset,
            d.offset + d.dim,
            d.head_stride
        )
    })?;
    let rows = d.tokens.rows()?;
    x.has_len(
        kernel,
        name,
        product(kernel, &[rows, d.heads, d.head_stride])?,
    )?;
    product(kernel, &[rows, d.heads, d.dim / 2]).map(|_| ())
}

/// [`Backend::rotary_forward`]'s arguments.
pub fn check_rotary_forward(x: Operand, dims: RotaryDims) -> Result<()> {
    check_rotary("rotary_forward", "x", x, dims)
}

/// [`Backend::rotary_backward`]'s arguments.
pub fn check_rotary_backward(dx: Operand, dims: RotaryDims) -> Result<()> {
    check_rotary("rotary_backward", "dx", dx, dims)
}

/// [`Backend`]'s attention and rotary methods: each checks its arguments,
/// then runs its [`AttentionKernels`] method.
macro_rules! attention_methods {
    () => {
        /// Causal softmax attention per sequence with grouped KV heads: query
        /// head `j` uses KV head `j / (heads / kv_heads)`;
        /// `o_t = sum_{u<=t} softmax_u(scale * q_t . k_u) v_u` (f32 softmax).
        /// `q` `[rows, heads, qk_dim]`, `k` `[rows, kv_heads, qk_dim]`,
        /// `v` `[rows, kv_heads, v_dim]`, `out` `[rows, heads, v_dim]`; `lse`
        /// `[rows, heads]` receives each row's log-sum-exp of the scaled scores,
        /// so backward recomputes the probabilities instead of keeping them.
        fn attention_forward(
            &self,
            inputs: AttentionInputs<Slice<'_, Self>>,
            out: SliceMut<'_, Self>,
            lse: SliceMut<'_, Self>,
            dims: AttentionDims,
        ) -> Result<()> {
            $crate::backend::attention::check_attention_forward(
                inputs.operands(),
                out.operand(),
                lse.operand(),
                dims,
            )?;
            self.attention_forward_unchecked(inputs, out, lse, dims)
        }

        /// Backward of [`Backend::attention_forward`] given `dout`; overwrites
        /// `grads.q`, `grads.k`, `grads.v`. With `p` the recomputed probabilities
        /// and `D_t = dout_t . o_t`: `ds_tu = p_tu (dout_t . v_u - D_t)`,
        /// `dq_t = scale sum_u ds_tu k_u`, `dk_u = scale sum_t ds_tu q_t`,
        /// `dv_u = sum_t p_tu dout_t` (sums over the query heads of a group).
        fn attention_backward(
            &self,
            inputs: AttentionInputs<Slice<'_, Self>>,
            out: Slice<'_, Self>,
            lse: Slice<'_, Self>,
            dout: Slice<'_, Self>,
            grads: AttentionInputs<SliceMut<'_, Self>>,
            dims: AttentionDims,
        ) -> Result<()> {
            $crate::backend::attention::check_attention_backward(
                inputs.operands(),
                out.operand(),
                lse.operand(),
                dout.operand(),
                grads.operands(),
                dims,
            )?;
            self.attention_backward_unchecked(inputs, out, lse, dout, grads, dims)
        }

        /// Rotary position embedding (rotate-half), in place on channels
        /// `[offset, offset + dim)` of every head of `x` `[rows, heads, head_stride]`,
        /// position `t` = the row's index inside its sequence. For `i < dim/2`,
        /// `theta = t * base^(-2i/dim)`, `(a, b) = (x[i], x[i + dim/2])` becomes
        /// `(a cos - b sin, b cos + a sin)`.
        fn rotary_forward(&self, x: SliceMut<'_, Self>, dims: RotaryDims) -> Result<()> {
            $crate::backend::attention::check_rotary_forward(x.operand(), dims)?;
            self.rotary_forward_unchecked(x, dims)
        }

        /// Backward of [`Backend::rotary_forward`], in place: the inverse rotation
        /// `(da, db) <- (da cos + db sin, db cos - da sin)`.
        fn rotary_backward(&self, dx: SliceMut<'_, Self>, dims: RotaryDims) -> Result<()> {
            $crate::backend::attention::check_rotary_backward(dx.operand(), dims)?;
            self.rotary_backward_unchecked(dx, dims)
        }
    };
}
pub(super) use attention_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_head_counts_and_blocks_are_errors() {
        let f32s = |len| Operand::new(len, DType::F32);
        let dims = AttentionDims {
            tokens: Tokens::new(1, 2),
            heads: 4,
            kv_heads: 3,
            qk_dim: 2,
            v_dim: 2,
            scale: 1.0,
        };
        let inputs = AttentionInputs {
            q: f32s(16),
            k: f32s(12),
            v: f32s(12),
        };
        assert!(check_attention_forward(inputs, f32s(16), f32s(8), dims).is_err());
        let dims = AttentionDims {
            kv_heads: 2,
            ..dims
        };
        let inputs = AttentionInputs {
            k: f32s(8),
            v: f32s(8),
            ..inputs
        };
        assert_eq!(
            check_attention_forward(inputs, f32s(16), f32s(8), dims).unwrap(),
            2
        );
        let rotary = RotaryDims {
            tokens: Tokens::new(1, 2),
            heads: 2,
            head_stride: 4,
            offset: 1,
            dim: 4,
            base: 10_000.0,
            pairing: RotaryPairing::RotateHalf,
        };
        assert!(check_rotary_forward(f32s(16), rotary).is_err());
        assert!(
            check_rotary_backward(
                f32s(16),
                RotaryDims {
                    offset: 0,
                    ..rotary
                }
            )
            .is_ok()
        );
    }
}

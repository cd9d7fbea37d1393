//! Causal softmax attention with grouped KV heads, and rotary position
//! embeddings.

use super::Tokens;

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

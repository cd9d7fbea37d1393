//! The scratch the GPU kernels take while they run (attention's, the
//! Mamba scan's, the gated delta rule's and sparse attention's), for the
//! memory check,
//! computed by the backend's own rule
//! ([`crate::backend::Backend::kernel_scratch`]).

use crate::backend::{
    AttentionBackend, AttentionDims, Backend, DeltaDims, ScanDims, ScratchCall, ScratchSettings,
    Tokens,
};
use crate::cuda::CudaBackend;
use crate::view::DType;
use hybridgen_dsl::{LayerKind, ModelConfig};

/// The kernel calls of `model`'s layers of `kinds` at `tokens` a
/// micro-batch that may take scratch while they run: attention (`*` and
/// MLA layers) and the Mamba scan.
pub fn scratch_calls(model: &ModelConfig, kinds: &[LayerKind], tokens: Tokens) -> Vec<ScratchCall> {
    let attention = |heads: usize, kv_heads: usize, qk_dim: usize, v_dim: usize| {
        ScratchCall::Attention(AttentionDims {
            tokens,
            heads,
            kv_heads,
            qk_dim,
            v_dim,
            scale: 1.0,
        })
    };
    let mut calls = Vec::new();
    if kinds.contains(&LayerKind::Attention)
        && let (Some(a), Some(c)) = (&model.attention, model.attention_head_dim())
    {
        calls.push(attention(a.num_heads, a.num_kv_groups, c, c));
    }
    if kinds.contains(&LayerKind::Mla)
        && let Some(m) = &model.mla
    {
        let qk = m.qk_head_dim + m.qk_rope_head_dim;
        calls.push(attention(m.num_heads, m.num_heads, qk, m.v_head_dim));
    }
    if kinds.contains(&LayerKind::Mamba)
        && let Some(m) = &model.mamba
    {
        calls.push(ScratchCall::Scan(ScanDims {
            tokens,
            heads: m.num_heads,
            head_dim: m.head_dim,
            groups: m.num_groups,
            state: m.state_size,
            chunk: m.chunk_size,
        }));
    }
    calls
}

/// The most scratch one call of `B`'s kernels takes for `model`'s layers
/// of `kinds` at `tokens` a micro-batch ([`Backend::kernel_scratch`] of
/// each of [`scratch_calls`]), in bytes. Calls run one at a time on a
/// lane, so the largest counts; the arena reuses it.
pub fn kernel_scratch<B: Backend>(
    model: &ModelConfig,
    kinds: &[LayerKind],
    tokens: Tokens,
    settings: ScratchSettings,
) -> u64 {
    scratch_calls(model, kinds, tokens)
        .into_iter()
        .map(|call| B::kernel_scratch(call, settings))
        .max()
        .unwrap_or(0)
}

/// [`kernel_scratch`] of the CUDA backend, activations in `dtype`, its
/// attention kernels `backend`, its GEMM attention and chunked scan capped
/// at `attention_cap` and `scan_cap` bytes a call.
pub fn gpu_kernel_scratch(
    model: &ModelConfig,
    kinds: &[LayerKind],
    tokens: Tokens,
    dtype: DType,
    backend: AttentionBackend,
    (attention_cap, scan_cap): (usize, usize),
) -> u64 {
    let settings = ScratchSettings {
        dtype,
        attention: backend,
        attention_cap,
        scan_cap,
    };
    kernel_scratch::<CudaBackend>(model, kinds, tokens, settings)
        .max(gdn_scratch(model, kinds, tokens, settings))
        .max(dsa_scratch(model, kinds, tokens, dtype))
}

/// The GPU's sparse attention scratch for `model`'s `D` layers (its
/// backward's: in bf16 on tensor cores a partial copy of the key rows for
/// each of a sequence's blocks, otherwise `dout . out` a row and head; and
/// a bit a (key, query) pair), 0 without them. Counted here rather than as a [`ScratchCall`]: only the
/// CUDA backend takes scratch for it.
fn dsa_scratch(model: &ModelConfig, kinds: &[LayerKind], tokens: Tokens, dtype: DType) -> u64 {
    match &model.mla {
        Some(m) if kinds.contains(&LayerKind::Dsa) => {
            // `D` attends over the shared latent row (kv_rank + rope).
            let dims = crate::backend::SparseMqaDims {
                tokens,
                heads: m.num_heads,
                qk_dim: m.kv_lora_rank + m.qk_rope_head_dim,
                v_dim: m.kv_lora_rank,
                // The scratch does not depend on the selection's width.
                topk: 1,
                scale: 1.0,
            };
            crate::cuda::ops::sparse_attention::sparse_mqa_scratch_bytes(dims, dtype)
        }
        _ => 0,
    }
}

/// The GPU's gated delta rule scratch for `model`'s `G` layers (its
/// backward's, the larger), 0 without them. Counted here rather than as a
/// [`ScratchCall`]: only the CUDA backend takes scratch for it.
fn gdn_scratch(
    model: &ModelConfig,
    kinds: &[LayerKind],
    tokens: Tokens,
    settings: ScratchSettings,
) -> u64 {
    match &model.gdn {
        Some(g) if kinds.contains(&LayerKind::GatedDeltaNet) => {
            let dims = DeltaDims {
                tokens,
                key_heads: g.key_heads,
                value_heads: g.value_heads,
                key_dim: g.key_head_dim,
                value_dim: g.value_head_dim,
                chunk: crate::layers::gdn::STATE_CHUNK,
            };
            crate::cuda::ops::delta::delta_scratch_bytes(dims, settings)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `D` layer's GPU scratch: `dout . out` a row and head and a bit a
    /// (key, query) pair, in 4-byte words, for the tiny preset's MLA.
    #[test]
    fn dsa_layers_count_the_sparse_attention_backwards_scratch() {
        let model = ModelConfig::preset("tiny").unwrap();
        let m = model.mla.as_ref().expect("tiny has MLA");
        let tokens = Tokens::new(2, 100);
        let words = 200 * m.num_heads + 200 * 100usize.div_ceil(32);
        let scratch = |kinds: &[LayerKind]| {
            gpu_kernel_scratch(
                &model,
                kinds,
                tokens,
                DType::F32,
                AttentionBackend::Flash,
                (0, 0),
            )
        };
        assert_eq!(scratch(&[LayerKind::Dsa]), 4 * words as u64);
        assert_eq!(scratch(&[LayerKind::Mlp]), 0);
    }
}

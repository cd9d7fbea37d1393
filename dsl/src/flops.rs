//! Model FLOPs per token, forward and backward: what MFU divides by. The
//! formula is the PyTorch baseline's (docs/benchmarks.md,
//! "FLOPs"), taken from the model instead of written out for one:
//!
//! - 6 × the matrix parameters a token passes through: every layer's
//!   projections, a MoE layer's router, `top_k` of its experts and its
//!   shared expert, the output layer; not the embedding lookup, norms,
//!   biases or the Mamba conv1d;
//! - attention's score and value products over the full `S × S` (the
//!   causal kernels do about half): 12 × query heads × head dim × `S` a
//!   layer;
//! - the Mamba chunked scan's products, 3 × its forward's: per token,
//!   `2GQN` (C·Bᵀ) + `2HQP` (the masked scores times x) + `4HPN` (the
//!   chunk states and C times the entering state) + `2H c² P N / S` (the
//!   state passing over the `c` chunks), with chunk `Q`.
//!
//! Each MTP depth adds its layers, its `2h → h` projection and a pass
//! through the output layer. Layers whose FLOPs the formula does not cover
//! (MLA, DSA, gated delta net) give `None`: no MFU rather than a wrong one.

use crate::config::ModelConfig;
use crate::params::layer_params;
use crate::pattern::{LayerKind, Pattern};

/// FLOPs per token of one forward and backward pass of `config` at
/// sequence length `seq`; `None` when the pattern does not parse or has a
/// layer kind the formula does not cover.
pub fn flops_per_token(config: &ModelConfig, seq: usize) -> Option<u64> {
    let pattern = Pattern::parse(&config.pattern).ok()?;
    let h = config.hidden_size as u64;
    let output = h * config.padded_vocab_size() as u64;
    let depths = pattern.mtp_depths.len() as u64;
    let mut matrices = output * (1 + depths) + depths * 2 * h * h;
    let mut quadratic = 0u64;
    for layer in pattern
        .layers()
        .chain(pattern.mtp_depths.iter().flat_map(|d| &d.layers))
    {
        let kind = layer.kind;
        matrices += matrix_params(config, kind)?;
        quadratic += match kind {
            LayerKind::Attention => {
                let heads = config.attention.as_ref()?.num_heads;
                12 * (heads * config.attention_head_dim()?) as u64 * seq as u64
            }
            LayerKind::Mamba => 3 * scan_forward(config, seq)?,
            _ => 0,
        };
    }
    Some(6 * matrices + quadratic)
}

/// The matrix parameters one token of a layer of `kind` multiplies by.
fn matrix_params(config: &ModelConfig, kind: LayerKind) -> Option<u64> {
    if matches!(
        kind,
        LayerKind::Mla | LayerKind::Dsa | LayerKind::GatedDeltaNet
    ) {
        return None;
    }
    let (experts, top_k) = config
        .moe
        .as_ref()
        .map_or((0, 0), |m| (m.num_experts, m.top_k));
    let (mut dense, mut expert) = (0u64, 0u64);
    for p in layer_params(kind, config, experts) {
        if p.shape.len() < 2 || p.name.contains("conv1d") {
            continue;
        }
        if p.expert {
            expert += p.numel() as u64;
        } else {
            dense += p.numel() as u64;
        }
    }
    // Every token goes through top_k of the experts.
    Some(dense + expert.checked_mul(top_k as u64)? / experts.max(1) as u64)
}

/// The chunked scan's forward FLOPs per token of one Mamba layer.
fn scan_forward(config: &ModelConfig, seq: usize) -> Option<u64> {
    let m = config.mamba.as_ref()?;
    let [g, n, hd, p, q] = [
        m.num_groups,
        m.state_size,
        m.num_heads,
        m.head_dim,
        m.chunk_size.min(seq.max(1)),
    ]
    .map(|v| v as u64);
    let s = seq.max(1) as u64;
    let chunks = s.div_ceil(q);
    Some(2 * g * q * n + 2 * hd * q * p + 4 * hd * p * n + 2 * hd * chunks * chunks * p * n / s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The baseline's own figure for its model.
    #[test]
    fn the_benchmark_model_has_the_baselines_count() {
        let model = ModelConfig::preset("bench-hybrid-moe").unwrap();
        assert_eq!(flops_per_token(&model, 4096), Some(3_031_695_360));
    }

    #[test]
    fn each_part_counts() {
        let model = ModelConfig::preset("bench-hybrid-moe").unwrap();
        let full = flops_per_token(&model, 4096).unwrap();
        // Longer sequences cost more attention; more experts a token, more.
        assert!(flops_per_token(&model, 8192).unwrap() > full);
        let mut wider = model.clone();
        wider.moe.as_mut().unwrap().top_k = 8;
        assert!(flops_per_token(&wider, 4096).unwrap() > full);
        // An MTP depth adds its layers, projection and output pass.
        let mut mtp = model.clone();
        mtp.pattern = format!("{}/*E", model.pattern);
        assert!(flops_per_token(&mtp, 4096).unwrap() > full);
        // A layer kind the formula does not cover gives no figure.
        let mut mla = ModelConfig::preset("tiny").unwrap();
        mla.pattern = "+".into();
        assert_eq!(flops_per_token(&mla, 64), None);
    }
}

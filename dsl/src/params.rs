//! Each layer kind's parameters: names, shapes and order (docs/layers.md).
//! Names are relative to the layer's prefix (`decoder.layers.{i}.`).

use crate::config::ModelConfig;
use crate::pattern::LayerKind;
use serde::Serialize;
use std::borrow::Cow;

/// One parameter of a layer, before it is placed in the model. `Cow` fields
/// let the `model!` macro emit definitions as `const` data of this same type.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ParamDef {
    /// Name relative to its owner (`mixer.in_proj.weight`).
    pub name: Cow<'static, str>,
    pub shape: Cow<'static, [usize]>,
    /// Sharded over the expert-data-parallel group (the name contains `.experts.`).
    pub expert: bool,
    /// For an expert weight: its local expert index j.
    pub local_expert: Option<usize>,
}

impl ParamDef {
    /// A dense parameter.
    pub fn new(name: impl Into<Cow<'static, str>>, shape: &[usize]) -> Self {
        ParamDef {
            name: name.into(),
            shape: Cow::Owned(shape.to_vec()),
            expert: false,
            local_expert: None,
        }
    }

    fn expert(name: String, shape: &[usize], j: usize) -> Self {
        ParamDef {
            name: name.into(),
            shape: Cow::Owned(shape.to_vec()),
            expert: true,
            local_expert: Some(j),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements per leading-dimension row (`shape[1:].numel()`), the unit
    /// Megatron's FSDP pads buckets by.
    pub fn row_numel(&self) -> usize {
        self.shape.iter().skip(1).product::<usize>().max(1)
    }
}

/// The parameters of one layer of `kind`, in `named_parameters()` order, with
/// `experts` expert weights listed for an `E` layer (the rank-local count
/// under expert parallelism; the full count for totals).
///
/// The config must have the kind's section (the planner checks H026 first);
/// a missing section yields no parameters rather than a panic.
pub fn layer_params(kind: LayerKind, config: &ModelConfig, experts: usize) -> Vec<ParamDef> {
    let h = config.hidden_size;
    let mut p = Vec::new();
    match kind {
        LayerKind::Mamba => {
            let Some(m) = &config.mamba else { return p };
            let d_in = m.num_heads * m.head_dim;
            let gn = m.num_groups * m.state_size;
            let conv = d_in + 2 * gn;
            p.push(ParamDef::new(
                "mixer.conv1d_weight",
                &[conv, 1, m.conv_kernel],
            ));
            p.push(ParamDef::new("mixer.conv1d_bias", &[conv]));
            p.push(ParamDef::new("mixer.dt_bias", &[m.num_heads]));
            p.push(ParamDef::new("mixer.A_log", &[m.num_heads]));
            p.push(ParamDef::new("mixer.D", &[m.num_heads]));
            p.push(ParamDef::new("mixer.in_proj.layer_norm_weight", &[h]));
            p.push(ParamDef::new(
                "mixer.in_proj.weight",
                &[2 * d_in + 2 * gn + m.num_heads, h],
            ));
            p.push(ParamDef::new("mixer.norm.weight", &[d_in]));
            p.push(ParamDef::new("mixer.out_proj.weight", &[h, d_in]));
        }
        LayerKind::Attention => {
            let Some(a) = &config.attention else { return p };
            let c = config.attention_head_dim().unwrap_or(0);
            p.push(ParamDef::new(
                "self_attention.linear_proj.weight",
                &[h, a.num_heads * c],
            ));
            p.push(ParamDef::new(
                "self_attention.linear_qkv.layer_norm_weight",
                &[h],
            ));
            p.push(ParamDef::new(
                "self_attention.linear_qkv.weight",
                &[c * (a.num_heads + 2 * a.num_kv_groups), h],
            ));
            if a.qk_norm {
                p.push(ParamDef::new("self_attention.q_layernorm.weight", &[c]));
                p.push(ParamDef::new("self_attention.k_layernorm.weight", &[c]));
            }
        }
        LayerKind::Mla => {
            if config.mla.is_none() {
                return p;
            }
            p.push(ParamDef::new("input_layernorm.weight", &[h]));
            mla_params(config, &mut p, true);
        }
        LayerKind::Dsa => {
            let (Some(m), Some(d)) = (&config.mla, &config.dsa) else {
                return p;
            };
            let qr = m.q_lora_rank.unwrap_or(0);
            let ix = "self_attention.core_attention.indexer";
            p.push(ParamDef::new("input_layernorm.weight", &[h]));
            p.push(ParamDef::new(
                format!("{ix}.linear_wq_b.weight"),
                &[d.index_heads * d.index_head_dim, qr],
            ));
            p.push(ParamDef::new(
                format!("{ix}.linear_wk.weight"),
                &[d.index_head_dim, h],
            ));
            p.push(ParamDef::new(
                format!("{ix}.k_norm.weight"),
                &[d.index_head_dim],
            ));
            p.push(ParamDef::new(
                format!("{ix}.k_norm.bias"),
                &[d.index_head_dim],
            ));
            p.push(ParamDef::new(
                format!("{ix}.linear_weights_proj.weight"),
                &[d.index_heads, h],
            ));
            mla_params(config, &mut p, false);
            if m.qk_norm {
                p.push(ParamDef::new("self_attention.q_layernorm.weight", &[qr]));
                p.push(ParamDef::new(
                    "self_attention.kv_layernorm.weight",
                    &[m.kv_lora_rank],
                ));
            }
        }
        LayerKind::GatedDeltaNet => {
            let Some(g) = &config.gdn else { return p };
            let kd = g.key_heads * g.key_head_dim;
            let vd = g.value_heads * g.value_head_dim;
            p.push(ParamDef::new("self_attention.dt_bias", &[g.value_heads]));
            p.push(ParamDef::new("self_attention.A_log", &[g.value_heads]));
            p.push(ParamDef::new(
                "self_attention.in_proj.layer_norm_weight",
                &[h],
            ));
            p.push(ParamDef::new(
                "self_attention.in_proj.weight",
                &[2 * kd + 2 * vd + 2 * g.value_heads, h],
            ));
            p.push(ParamDef::new(
                "self_attention.conv1d.weight",
                &[2 * kd + vd, 1, g.conv_kernel],
            ));
            p.push(ParamDef::new(
                "self_attention.out_norm.weight",
                &[g.value_head_dim],
            ));
            p.push(ParamDef::new("self_attention.out_proj.weight", &[h, vd]));
        }
        LayerKind::Mlp => {
            let Some(m) = &config.mlp else { return p };
            let u = m.activation.fc1_factor();
            p.push(ParamDef::new("mlp.linear_fc1.layer_norm_weight", &[h]));
            p.push(ParamDef::new(
                "mlp.linear_fc1.weight",
                &[u * m.ffn_hidden_size, h],
            ));
            p.push(ParamDef::new(
                "mlp.linear_fc2.weight",
                &[h, m.ffn_hidden_size],
            ));
        }
        LayerKind::Moe => {
            let Some(m) = &config.moe else { return p };
            let u = m.activation.fc1_factor();
            let fe = m.ffn_hidden_size;
            p.push(ParamDef::new("pre_mlp_layernorm.weight", &[h]));
            p.push(ParamDef::new("mlp.router.weight", &[m.num_experts, h]));
            for j in 0..experts {
                p.push(ParamDef::expert(
                    format!("mlp.experts.linear_fc1.weight{j}"),
                    &[u * fe, h],
                    j,
                ));
            }
            for j in 0..experts {
                p.push(ParamDef::expert(
                    format!("mlp.experts.linear_fc2.weight{j}"),
                    &[h, fe],
                    j,
                ));
            }
            if let Some(fs) = m.shared_expert_ffn_hidden_size {
                p.push(ParamDef::new(
                    "mlp.shared_experts.linear_fc1.weight",
                    &[u * fs, h],
                ));
                p.push(ParamDef::new(
                    "mlp.shared_experts.linear_fc2.weight",
                    &[h, fs],
                ));
            }
        }
    }
    p
}

/// The MLA projections shared by `+` and `D`. `+` fuses its LoRA norms into
/// the up projections (with qk-norm); `D` lists them standalone at the end,
/// which the caller adds.
fn mla_params(config: &ModelConfig, p: &mut Vec<ParamDef>, fused_norms: bool) {
    let Some(m) = &config.mla else { return };
    let h = config.hidden_size;
    let a = m.num_heads;
    let (dn, dr, dv, kr) = (
        m.qk_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let fused = fused_norms && m.qk_norm;
    p.push(ParamDef::new(
        "self_attention.linear_proj.weight",
        &[h, a * dv],
    ));
    match m.q_lora_rank {
        Some(qr) => {
            p.push(ParamDef::new(
                "self_attention.linear_q_down_proj.weight",
                &[qr, h],
            ));
            if fused {
                p.push(ParamDef::new(
                    "self_attention.linear_q_up_proj.layer_norm_weight",
                    &[qr],
                ));
            }
            p.push(ParamDef::new(
                "self_attention.linear_q_up_proj.weight",
                &[a * (dn + dr), qr],
            ));
        }
        None => p.push(ParamDef::new(
            "self_attention.linear_q_proj.weight",
            &[a * (dn + dr), h],
        )),
    }
    p.push(ParamDef::new(
        "self_attention.linear_kv_down_proj.weight",
        &[kr + dr, h],
    ));
    if fused {
        p.push(ParamDef::new(
            "self_attention.linear_kv_up_proj.layer_norm_weight",
            &[kr],
        ));
    }
    p.push(ParamDef::new(
        "self_attention.linear_kv_up_proj.weight",
        &[a * (dn + dv), kr],
    ));
}

/// Parameters of one layer of `kind` with every expert counted.
pub fn layer_param_count(kind: LayerKind, config: &ModelConfig) -> u64 {
    let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    layer_params(kind, config, experts)
        .iter()
        .map(|p| p.numel() as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-layer figures params.md gives for the Nemotron presets.
    #[test]
    fn per_layer_counts_match_the_spec() {
        let nano = ModelConfig::preset("nemotron-nano-9b-v2").unwrap();
        assert_eq!(layer_param_count(LayerKind::Mamba, &nano), 147_450_624);
        assert_eq!(layer_param_count(LayerKind::Mlp, &nano), 140_497_280);
        assert_eq!(layer_param_count(LayerKind::Attention, &nano), 55_054_720);
        let moe = ModelConfig::preset("nemotron-3-nano-30b-a3b").unwrap();
        assert_eq!(layer_param_count(LayerKind::Mamba, &moe), 38_744_896);
        assert_eq!(layer_param_count(LayerKind::Moe, &moe), 1_297_468_032);
        assert_eq!(layer_param_count(LayerKind::Attention, &moe), 23_399_040);
    }

    #[test]
    fn expert_weights_are_exactly_the_dot_experts_dot_names() {
        let tiny = ModelConfig::preset("tiny").unwrap();
        for p in layer_params(LayerKind::Moe, &tiny, 2) {
            assert_eq!(p.expert, p.name.contains(".experts."), "{}", p.name);
        }
    }
}

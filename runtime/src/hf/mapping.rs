//! The one table between hybridgen's tensors (Megatron's names, params.md)
//! and transformers' `NemotronHForCausalLM` (the names of the published
//! Nemotron-H checkpoints), and what it gives for a plan: every Hugging Face
//! tensor with its name, shape and the hybridgen elements it holds.
//!
//! Hugging Face numbers layers flat (`backbone.layers.{i}`, i the physical
//! index), so groups flatten and pipeline stages vanish; each block is one
//! pre-norm plus one mixer, so a layer's fused norm (`in_proj`'s,
//! `linear_qkv`'s, `linear_fc1`'s) or its `pre_mlp_layernorm` becomes the
//! block's `norm.weight`. MTP depths flatten the way Megatron-Bridge's
//! Nemotron-H bridge writes them: layer j of depth d is `mtp.layers.{d*L+j}`
//! (L layers a depth), the depth's `enorm`, `hnorm` and `eh_proj` sit on its
//! first layer and its `final_layernorm` on its last.

use crate::error::{Result, RuntimeError};
use hybridgen_dsl::LayerKind;
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::{LayerRef, Owner};
use std::collections::HashMap;
use std::ops::Range;

/// How a hybridgen tensor's elements become a Hugging Face tensor's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The same elements in the same order. Mamba's `in_proj` rows are
    /// `[z | x | B | C | dt]` and its conv channels `[x | B | C]` on both
    /// sides, so neither is reordered.
    Same,
    /// One part of Megatron's fused `linear_qkv`, whose rows come per KV
    /// group as `[q: a/g heads | k: one head | v: one head]` (layers.md):
    /// transformers keeps `q_proj`, `k_proj` and `v_proj` apart.
    Qkv(QkvPart),
    /// No hybridgen tensor: transformers' router always has an f32
    /// `e_score_correction_bias` (one value per router row), which
    /// hybridgen, whose checkpoints hold no expert bias yet, exports as
    /// zeros and imports only when all zero.
    ZeroBias,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkvPart {
    Q,
    K,
    V,
}

/// Where a row applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The model's own tensors (prefix-free names).
    Model,
    /// A decoder or MTP layer of this kind: names after `decoder.layers.{i}.`
    /// and `backbone.layers.{i}.` (or `mtp.layers.{k}.`).
    Layer(LayerKind),
    /// An MTP depth's own tensors: names after `mtp.layers.{d}.` and
    /// `mtp.layers.{k}.`.
    MtpDepth,
}

/// One line of the mapping. `{j}` stands for an expert's global index.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub scope: Scope,
    pub hybridgen: &'static str,
    pub hf: &'static str,
    pub layout: Layout,
}

const fn row(scope: Scope, hybridgen: &'static str, hf: &'static str, layout: Layout) -> Row {
    Row {
        scope,
        hybridgen,
        hf,
        layout,
    }
}

use LayerKind::{Attention, Mamba, Mlp, Moe};
use Layout::{Qkv, Same, ZeroBias};
use Scope::{Layer, Model, MtpDepth};

/// The mapping: every exportable hybridgen tensor, in params.md's order.
/// A kind or tensor that is not here cannot be exported.
pub const TABLE: &[Row] = &[
    row(
        Model,
        "embedding.word_embeddings.weight",
        "backbone.embeddings.weight",
        Same,
    ),
    row(
        Model,
        "decoder.final_norm.weight",
        "backbone.norm_f.weight",
        Same,
    ),
    row(
        Model,
        "decoder.final_layernorm.weight",
        "backbone.norm_f.weight",
        Same,
    ),
    row(Model, "output_layer.weight", "lm_head.weight", Same),
    row(
        Layer(Mamba),
        "mixer.conv1d_weight",
        "mixer.conv1d.weight",
        Same,
    ),
    row(Layer(Mamba), "mixer.conv1d_bias", "mixer.conv1d.bias", Same),
    row(Layer(Mamba), "mixer.dt_bias", "mixer.dt_bias", Same),
    row(Layer(Mamba), "mixer.A_log", "mixer.A_log", Same),
    row(Layer(Mamba), "mixer.D", "mixer.D", Same),
    row(
        Layer(Mamba),
        "mixer.in_proj.layer_norm_weight",
        "norm.weight",
        Same,
    ),
    row(
        Layer(Mamba),
        "mixer.in_proj.weight",
        "mixer.in_proj.weight",
        Same,
    ),
    row(Layer(Mamba), "mixer.norm.weight", "mixer.norm.weight", Same),
    row(
        Layer(Mamba),
        "mixer.out_proj.weight",
        "mixer.out_proj.weight",
        Same,
    ),
    row(
        Layer(Attention),
        "self_attention.linear_proj.weight",
        "mixer.o_proj.weight",
        Same,
    ),
    row(
        Layer(Attention),
        "self_attention.linear_qkv.layer_norm_weight",
        "norm.weight",
        Same,
    ),
    row(
        Layer(Attention),
        "self_attention.linear_qkv.weight",
        "mixer.q_proj.weight",
        Qkv(QkvPart::Q),
    ),
    row(
        Layer(Attention),
        "self_attention.linear_qkv.weight",
        "mixer.k_proj.weight",
        Qkv(QkvPart::K),
    ),
    row(
        Layer(Attention),
        "self_attention.linear_qkv.weight",
        "mixer.v_proj.weight",
        Qkv(QkvPart::V),
    ),
    row(
        Layer(Mlp),
        "mlp.linear_fc1.layer_norm_weight",
        "norm.weight",
        Same,
    ),
    row(
        Layer(Mlp),
        "mlp.linear_fc1.weight",
        "mixer.up_proj.weight",
        Same,
    ),
    row(
        Layer(Mlp),
        "mlp.linear_fc2.weight",
        "mixer.down_proj.weight",
        Same,
    ),
    row(Layer(Moe), "pre_mlp_layernorm.weight", "norm.weight", Same),
    row(Layer(Moe), "mlp.router.weight", "mixer.gate.weight", Same),
    // The router's bias rides on the router (it follows it, as in the
    // published files).
    row(
        Layer(Moe),
        "mlp.router.weight",
        "mixer.gate.e_score_correction_bias",
        ZeroBias,
    ),
    row(
        Layer(Moe),
        "mlp.experts.linear_fc1.weight{j}",
        "mixer.experts.{j}.up_proj.weight",
        Same,
    ),
    row(
        Layer(Moe),
        "mlp.experts.linear_fc2.weight{j}",
        "mixer.experts.{j}.down_proj.weight",
        Same,
    ),
    row(
        Layer(Moe),
        "mlp.shared_experts.linear_fc1.weight",
        "mixer.shared_experts.up_proj.weight",
        Same,
    ),
    row(
        Layer(Moe),
        "mlp.shared_experts.linear_fc2.weight",
        "mixer.shared_experts.down_proj.weight",
        Same,
    ),
    row(MtpDepth, "enorm.weight", "enorm.weight", Same),
    row(MtpDepth, "hnorm.weight", "hnorm.weight", Same),
    row(MtpDepth, "eh_proj.weight", "eh_proj.weight", Same),
    row(
        MtpDepth,
        "final_layernorm.weight",
        "final_layernorm.weight",
        Same,
    ),
];

/// The layer kinds transformers' `nemotron_h` has, with the names it
/// gives them in `layers_block_type`.
pub const HF_KINDS: [(LayerKind, &str); 4] = [
    (Mamba, "mamba"),
    (Attention, "attention"),
    (Mlp, "mlp"),
    (Moe, "moe"),
];

/// A run of a Hugging Face tensor's rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// These rows of the hybridgen parameter (its leading dimension).
    Rows(Range<usize>),
    /// This many rows of zeros, which hybridgen has no parameter for (the
    /// output gates of qwen3_next's `q_proj`): an export writes zeros, an
    /// import takes them only when they are all zero.
    Zeros(usize),
}

impl Piece {
    /// Rows this piece takes in the Hugging Face tensor.
    pub fn len(&self) -> usize {
        match self {
            Piece::Rows(r) => r.len(),
            Piece::Zeros(n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How the stored values relate to hybridgen's (after the rows are
/// gathered). Each is exact both ways in f32 where the export allows it
/// (see `qwen3_next`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueMap {
    /// The same values.
    Same,
    /// A zero-centred norm weight (transformers' `x_normed * (1 + w)`):
    /// `w - 1` stored, `w + 1` read back.
    ZeroCentred,
    /// A projection that follows a zero-weight sigmoid gate (0.5 for every
    /// token): `2 w` stored, `w / 2` read back.
    Doubled,
}

/// What a Hugging Face tensor holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Rows of a hybridgen parameter (index into `plan.params`), taken in
    /// the order of `pieces` (ranges of the parameter's leading dimension,
    /// or zero rows); one range covering every row for [`Layout::Same`].
    Rows {
        param: usize,
        key: String,
        pieces: Vec<Piece>,
        map: ValueMap,
    },
    /// No hybridgen tensor: a gate whose weight hybridgen exports as zeros
    /// (qwen3_next's `shared_expert_gate`) and imports only when all zero.
    Zeros,
    /// The router's expert bias, stored in f32 whatever the export's
    /// dtype: the checkpoint's trained `...mlp.router.expert_bias` under
    /// `key`, or all zeros for a model without one.
    ExpertBias { key: Option<String> },
}

/// One tensor of the Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub source: Source,
}

impl HfTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Kept in f32 whatever the export's dtype, as transformers keeps
    /// `e_score_correction_bias` (`_keep_in_fp32_modules_strict`).
    pub fn always_f32(&self) -> bool {
        matches!(self.source, Source::ExpertBias { .. })
    }
}

/// The transformers model type an export writes, or an import reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `nemotron_h` (`NemotronHForCausalLM`): `M`, `*`, `-`, `E`, each
    /// layer its own block.
    NemotronH,
    /// `qwen3_next` (`Qwen3NextForCausalLM`): decoder layers of a token
    /// mixer (`G` or `*`) and an MLP (`-` or `E`).
    Qwen3Next,
}

impl Family {
    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::NemotronH => "nemotron_h",
            Family::Qwen3Next => "qwen3_next",
        }
    }
}

/// The name a symbol has in messages.
pub fn kind_name(kind: LayerKind) -> &'static str {
    match kind {
        LayerKind::Mamba => "`M` (Mamba-2)",
        LayerKind::Attention => "`*` (attention)",
        LayerKind::Mla => "`+` (multi-latent attention)",
        LayerKind::Dsa => "`D` (DeepSeek sparse attention)",
        LayerKind::GatedDeltaNet => "`G` (gated delta net)",
        LayerKind::Mlp => "`-` (MLP)",
        LayerKind::Moe => "`E` (mixture of experts)",
    }
}

/// Refuses a layer kind transformers' `nemotron_h` does not have.
pub fn check_kind(kind: LayerKind, at: &str) -> Result<()> {
    if HF_KINDS.iter().any(|(k, _)| *k == kind) {
        return Ok(());
    }
    // transformers computes DeepSeek sparse attention only in its own
    // model type, which a hybrid with Mamba layers is not, and which this
    // export does not write.
    let elsewhere = match kind {
        LayerKind::Dsa => {
            " (transformers computes `D` only in its deepseek_v32 models, which this export \
             does not write)"
        }
        _ => "",
    };
    Err(RuntimeError::Unsupported(format!(
        "{at} is {}: transformers' nemotron_h has no such layer (it has `M`, `*`, `-` and \
         `E`){elsewhere}; export a pattern without it",
        kind_name(kind)
    )))
}

/// Where a parameter (`name` relative to its owner) sits in the Hugging
/// Face numbering: the name prefix and the table scope.
fn place(plan: &Plan, owner: Owner, name: &str) -> Result<(String, Scope)> {
    let per_depth = plan.mtp_layers.first().map_or(0, Vec::len);
    Ok(match owner {
        Owner::Embedding | Owner::FinalNorm | Owner::OutputLayer => (String::new(), Model),
        Owner::Layer(LayerRef::Decoder(i)) => {
            let kind = plan.layers[i].kind;
            check_kind(kind, &format!("decoder layer {i}"))?;
            (format!("backbone.layers.{i}."), Layer(kind))
        }
        Owner::Layer(LayerRef::Mtp { depth, index }) => {
            let kind = plan.mtp_layers[depth][index].kind;
            check_kind(kind, &format!("layer {index} of MTP depth {depth}"))?;
            (
                format!("mtp.layers.{}.", depth * per_depth + index),
                Layer(kind),
            )
        }
        // The depth's last norm sits on its last layer, the rest on its first.
        Owner::MtpBlock(d) if name == "final_layernorm.weight" => (
            format!(
                "mtp.layers.{}.",
                d * per_depth + per_depth.saturating_sub(1)
            ),
            MtpDepth,
        ),
        Owner::MtpBlock(d) => (format!("mtp.layers.{}.", d * per_depth), MtpDepth),
    })
}

/// The rows of a fused `linear_qkv` ([c(a+2g), h]) that one part takes.
fn qkv_rows(plan: &Plan, part: QkvPart) -> Vec<Range<usize>> {
    let (Some(a), Some(c)) = (&plan.model.attention, plan.model.attention_head_dim()) else {
        return Vec::new();
    };
    let per_group = a.num_heads / a.num_kv_groups.max(1);
    let stride = (per_group + 2) * c;
    (0..a.num_kv_groups)
        .map(|g| {
            let base = g * stride;
            match part {
                QkvPart::Q => base..base + per_group * c,
                QkvPart::K => base + per_group * c..base + (per_group + 1) * c,
                QkvPart::V => base + (per_group + 1) * c..base + stride,
            }
        })
        .collect()
}

/// The table's rows by scope and hybridgen name (expert digits as `{j}`).
fn rows_by_name() -> HashMap<(ScopeKey, &'static str), Vec<&'static Row>> {
    let mut map: HashMap<(ScopeKey, &'static str), Vec<&'static Row>> = HashMap::new();
    for r in TABLE {
        map.entry((ScopeKey::of(r.scope), r.hybridgen))
            .or_default()
            .push(r);
    }
    map
}

/// [`Scope`] as a hash key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum ScopeKey {
    Model,
    Layer(LayerKind),
    MtpDepth,
}

impl ScopeKey {
    fn of(scope: Scope) -> Self {
        match scope {
            Model => ScopeKey::Model,
            Layer(k) => ScopeKey::Layer(k),
            MtpDepth => ScopeKey::MtpDepth,
        }
    }
}

/// Every Hugging Face tensor of `plan`'s model, in the plan's parameter
/// order (the router's zero bias right after the router), each expert by
/// its global index. The plan must be for one rank (`ep` 1) so that every
/// expert is in it. A parameter the table lacks is an error naming it.
pub fn hf_tensors(plan: &Plan, family: Family) -> Result<Vec<HfTensor>> {
    if family == Family::Qwen3Next {
        return super::qwen3_next::hf_tensors(plan);
    }
    if plan.layout.ep != 1 {
        return Err(RuntimeError::InvalidArgument(format!(
            "the Hugging Face mapping needs a plan holding every expert (ep 1), not ep {}",
            plan.layout.ep
        )));
    }
    let rows = rows_by_name();
    let mut out = Vec::with_capacity(plan.params.len() + plan.layers.len());
    for (p, param) in plan.params.iter().enumerate() {
        let def = plan.def(param);
        let (prefix, scope) = place(plan, param.owner, &def.name)?;
        let key = plan.checkpoint_key(param, 0);
        // `owner_prefix` of the model-level parameters is part of their name.
        let relative = match scope {
            Model => key.clone(),
            _ => def.name.to_string(),
        };
        let (lookup, expert) = match def.local_expert {
            Some(j) => (
                format!(
                    "{}{{j}}",
                    relative.trim_end_matches(|c: char| c.is_ascii_digit())
                ),
                Some(j),
            ),
            None => (relative.clone(), None),
        };
        let Some(matches) = rows.get(&(ScopeKey::of(scope), lookup.as_str())) else {
            return Err(RuntimeError::Unsupported(format!(
                "`{key}` has no counterpart in transformers' nemotron_h{}",
                match scope {
                    Layer(LayerKind::Attention) =>
                        " (its attention has no query/key norms: export a model without `qk_norm`)",
                    _ => "",
                }
            )));
        };
        for r in matches {
            let name = match expert {
                Some(j) => r.hf.replace("{j}", &j.to_string()),
                None => r.hf.to_string(),
            };
            let rows: Vec<Range<usize>> = match r.layout {
                Same => std::iter::once(0..def.shape[0]).collect(),
                Qkv(part) => qkv_rows(plan, part),
                ZeroBias => {
                    // One value per expert: as many as the router has rows.
                    // A model routing with an expert bias keeps it next to
                    // the router's weight (`layers::expert_bias_keys`).
                    let trained = plan.model.moe.as_ref().is_some_and(|m| m.expert_bias);
                    let bias_key = trained.then(|| crate::layers::expert_bias_key(&key));
                    out.push(HfTensor {
                        name: format!("{prefix}{name}"),
                        shape: vec![def.shape[0]],
                        source: Source::ExpertBias { key: bias_key },
                    });
                    continue;
                }
            };
            let mut shape = def.shape.to_vec();
            shape[0] = rows.iter().map(Range::len).sum();
            out.push(HfTensor {
                name: format!("{prefix}{name}"),
                shape,
                source: Source::Rows {
                    param: p,
                    key: key.clone(),
                    pieces: rows.into_iter().map(Piece::Rows).collect(),
                    map: ValueMap::Same,
                },
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridgen_dsl::{ModelConfig, PlanOptions};

    fn plan(pattern: &str) -> Plan {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = pattern.to_string();
        model.attention.as_mut().unwrap().position = hybridgen_dsl::config::Position::None;
        Plan::new(&model, &PlanOptions::default()).unwrap()
    }

    #[test]
    fn every_row_of_every_parameter_lands_in_exactly_one_tensor() {
        let plan = plan("M[*E]-E/*E/*E");
        let tensors = hf_tensors(&plan, Family::NemotronH).unwrap();
        let mut covered: Vec<Vec<u32>> = plan
            .params
            .iter()
            .map(|p| vec![0; plan.def(p).shape[0]])
            .collect();
        for t in &tensors {
            if let Source::Rows { param, pieces, .. } = &t.source {
                let cols: usize = plan.def(&plan.params[*param]).shape[1..].iter().product();
                assert_eq!(
                    t.numel(),
                    pieces.iter().map(Piece::len).sum::<usize>() * cols,
                    "{}",
                    t.name
                );
                for piece in pieces {
                    let Piece::Rows(r) = piece else { continue };
                    for row in r.clone() {
                        covered[*param][row] += 1;
                    }
                }
            }
        }
        for (p, rows) in covered.iter().enumerate() {
            assert!(
                rows.iter().all(|&n| n == 1),
                "{} covered {:?}",
                plan.param_name(&plan.params[p]),
                rows
            );
        }
        let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "two tensors share a name");
    }

    #[test]
    fn qkv_rows_follow_megatrons_per_group_interleaving() {
        // a = 4, g = 2, c = 16: per group [q q | k | v], 64 rows a group.
        let plan = plan("*");
        assert_eq!(qkv_rows(&plan, QkvPart::Q), vec![0..32, 64..96]);
        assert_eq!(qkv_rows(&plan, QkvPart::K), vec![32..48, 96..112]);
        assert_eq!(qkv_rows(&plan, QkvPart::V), vec![48..64, 112..128]);
    }

    #[test]
    fn groups_flatten_and_mtp_layers_number_flat() {
        let plan = plan("M[*E]/*E/*E");
        let names: Vec<String> = hf_tensors(&plan, Family::NemotronH)
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        for want in [
            "backbone.layers.1.mixer.q_proj.weight",
            "backbone.layers.2.mixer.experts.3.down_proj.weight",
            "backbone.layers.2.mixer.gate.e_score_correction_bias",
            "mtp.layers.0.eh_proj.weight",
            "mtp.layers.1.final_layernorm.weight",
            "mtp.layers.2.enorm.weight",
            "mtp.layers.3.mixer.shared_experts.up_proj.weight",
            "backbone.norm_f.weight",
            "lm_head.weight",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing");
        }
    }

    #[test]
    fn kinds_transformers_lacks_are_refused_by_position() {
        let err = hf_tensors(&plan("M+"), Family::NemotronH)
            .unwrap_err()
            .to_string();
        assert!(err.contains("decoder layer 1 is `+`"), "{err}");
        let err = hf_tensors(&plan("M/G"), Family::NemotronH)
            .unwrap_err()
            .to_string();
        assert!(err.contains("layer 0 of MTP depth 0 is `G`"), "{err}");
    }
}

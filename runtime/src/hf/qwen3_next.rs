//! transformers' `qwen3_next` (`Qwen3NextForCausalLM`) <-> a hybridgen
//! model: its `config.json` and its tensors.
//!
//! A qwen3_next decoder layer is a token mixer (`linear_attention`, the gated
//! delta net, or `full_attention`) followed by an MLP (a sparse MoE block, or
//! a dense MLP for the layers in `mlp_only_layers`), each behind its own
//! norm. So a hybridgen pattern maps when its layers pair up as `G` or `*`
//! followed by `E` or `-`; HF layer `p` holds hybridgen layers `2p` and
//! `2p + 1`.
//!
//! Where the two compute the same function with different parameters, the
//! export rewrites them so that transformers computes exactly what hybridgen
//! does (docs/hugging-face.md):
//!
//! - qwen3_next's norms (all but the delta net's gated output norm) are
//!   zero-centred, `x_normed * (1 + w)`: hybridgen's weight `w` is stored as
//!   `w - 1`, which f32 holds exactly for `w` in [0.5, 2] (an f32 export
//!   refuses a weight for which `1 + (w - 1)` is not `w`);
//! - its attention multiplies each head's output by `sigmoid(gate)` (a second
//!   half of `q_proj`) and its shared expert by `sigmoid(shared_expert_gate)`:
//!   hybridgen has neither gate, so they are exported as zeros (`sigmoid(0)`
//!   is 0.5 for every token) and the projection after them doubled (a power
//!   of two, exact); an import takes them only when the gates are all zero,
//!   and halves the projection back.

use super::config::{
    BOOKKEEPING, HfDtype, NORM_EPS, check_fixed_field, decimal, init_std, refuse, tie_embeddings,
};
use super::mapping::{HfTensor, Piece, Source, ValueMap, kind_name};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::config::{
    Activation, AttentionConfig, GdnConfig, MlpConfig, MoeConfig, MtpConfig, Position,
    ScoreFunction,
};
use hybridgen_dsl::plan::{LayerRef, Owner};
use hybridgen_dsl::{LayerKind, ModelConfig, Pattern, Plan};
use serde_json::{Map, Value, json};
use std::ops::Range;

/// What transformers' qwen3_next calls a token mixer.
fn mixer_type(kind: LayerKind) -> Option<&'static str> {
    match kind {
        LayerKind::GatedDeltaNet => Some("linear_attention"),
        LayerKind::Attention => Some("full_attention"),
        _ => None,
    }
}

fn is_mlp(kind: LayerKind) -> bool {
    matches!(kind, LayerKind::Mlp | LayerKind::Moe)
}

/// The pattern's decoder layers, checked to pair as qwen3_next's decoder
/// layers: `(mixer, mlp)` for each.
fn pairs(model: &ModelConfig) -> Result<Vec<(LayerKind, LayerKind)>> {
    let pattern = Pattern::parse(&model.pattern).map_err(|d| {
        refuse(format!(
            "the model's pattern `{}` is not valid: {d}",
            model.pattern
        ))
    })?;
    if pattern.mtp_depth_count() > 0 {
        return Err(refuse(format!(
            "the pattern `{}` has MTP depths, which transformers' qwen3_next does not compute \
             (it drops `mtp.*` tensors on load); export a pattern without `/...` depths",
            pattern.canonical()
        )));
    }
    let kinds: Vec<LayerKind> = pattern.layers().map(|l| l.kind).collect();
    let fix = "transformers' qwen3_next decoder layers are a token mixer (`G` or `*`) followed by \
               an MLP (`E` or `-`); export a pattern of such pairs";
    for (i, kind) in kinds.iter().enumerate() {
        let fits = if i % 2 == 0 {
            mixer_type(*kind).is_some()
        } else {
            is_mlp(*kind)
        };
        if !fits {
            let place = if i % 2 == 0 {
                "where a token mixer must come"
            } else {
                "where the MLP after the token mixer of layer {prev} must come"
            };
            return Err(refuse(format!(
                "decoder layer {i} is {}, {}: {fix}",
                kind_name(*kind),
                place.replace("{prev}", &(i.saturating_sub(1)).to_string())
            )));
        }
    }
    if kinds.len() % 2 == 1 {
        return Err(refuse(format!(
            "decoder layer {} is {} with no MLP after it: {fix}",
            kinds.len() - 1,
            kind_name(kinds[kinds.len() - 1])
        )));
    }
    Ok(kinds.chunks(2).map(|p| (p[0], p[1])).collect())
}

fn activation_name(activation: Activation) -> &'static str {
    match activation {
        Activation::Gelu => "gelu",
        Activation::Swiglu => "swiglu",
        Activation::SquaredRelu => "squared_relu",
    }
}

/// Refuses what transformers' qwen3_next cannot compute as hybridgen does,
/// naming the setting and what to change; the pairs otherwise.
pub fn check(model: &ModelConfig) -> Result<Vec<(LayerKind, LayerKind)>> {
    let pairs = pairs(model)?;
    let uses = |k: LayerKind| pairs.iter().any(|(a, b)| *a == k || *b == k);
    let missing = |section: &str| {
        refuse(format!(
            "the model has no [{section}] section for the layers that need it"
        ))
    };
    if uses(LayerKind::Attention) {
        let a = model
            .attention
            .as_ref()
            .ok_or_else(|| missing("attention"))?;
        if !a.qk_norm {
            return Err(refuse(
                "the model's attention has no query/key norms, but transformers' qwen3_next attention \
                 always normalises each query and key head (`q_norm`, `k_norm`); export a model with \
                 `qk_norm = true` in [attention]"
                    .into(),
            ));
        }
    }
    if uses(LayerKind::Mlp) {
        let m = model.mlp.as_ref().ok_or_else(|| missing("mlp"))?;
        if m.activation != Activation::Swiglu {
            return Err(refuse(format!(
                "[mlp] uses activation `{}`, but transformers' qwen3_next MLPs are SwiGLU; export a \
                 model with `activation = \"swiglu\"`",
                activation_name(m.activation)
            )));
        }
    }
    if uses(LayerKind::Moe) {
        let m = model.moe.as_ref().ok_or_else(|| missing("moe"))?;
        if m.activation != Activation::Swiglu {
            return Err(refuse(format!(
                "[moe] uses activation `{}`, but transformers' qwen3_next experts are SwiGLU; export a \
                 model with `activation = \"swiglu\"`",
                activation_name(m.activation)
            )));
        }
        if m.score_function != ScoreFunction::Softmax {
            return Err(refuse(
                "the model's MoE router scores with a sigmoid (`score_function = \"sigmoid\"`), but \
                 transformers' qwen3_next router is a softmax; export a model with \
                 `score_function = \"softmax\"`"
                    .into(),
            ));
        }
        if m.expert_bias {
            return Err(refuse(
                "the model's MoE router selects with an expert bias (`expert_bias = true`), which \
                 transformers' qwen3_next router has no counterpart for; export a model without it"
                    .into(),
            ));
        }
        if m.topk_scaling_factor != 1.0 {
            return Err(refuse(format!(
                "the model's MoE scales the routing weights by {} (`topk_scaling_factor`), but \
                 transformers' qwen3_next does not scale them; export a model with \
                 `topk_scaling_factor = 1`",
                m.topk_scaling_factor
            )));
        }
        if m.shared_expert_ffn_hidden_size.is_none() {
            return Err(refuse(
                "the model's MoE layers have no shared expert, but transformers' qwen3_next MoE block \
                 always has one; export a model with `shared_expert_ffn_hidden_size` set"
                    .into(),
            ));
        }
    }
    if uses(LayerKind::GatedDeltaNet) {
        model.gdn.as_ref().ok_or_else(|| missing("gdn"))?;
    }
    Ok(pairs)
}

/// The `config.json` of `model` as qwen3_next, and the notes an export
/// prints.
pub fn to_config(model: &ModelConfig, dtype: HfDtype) -> Result<(Value, Vec<String>)> {
    let pairs = check(model)?;
    let mut notes = Vec::new();
    let pattern = Pattern::parse(&model.pattern).map_err(|d| refuse(d.to_string()))?;
    if pattern.has_groups() || pattern.has_pipeline_segments() {
        notes.push(format!(
            "groups and pipeline stages have no counterpart in transformers and do not change the \
             maths: the pattern `{}` is exported flat as {} qwen3_next decoder layers",
            pattern.canonical(),
            pairs.len()
        ));
    }
    let uses = |k: LayerKind| pairs.iter().any(|(a, b)| *a == k || *b == k);
    let mut c = Map::new();
    c.insert("architectures".into(), json!(["Qwen3NextForCausalLM"]));
    c.insert("model_type".into(), json!("qwen3_next"));
    c.insert("vocab_size".into(), json!(model.padded_vocab_size()));
    c.insert("hidden_size".into(), json!(model.hidden_size));
    c.insert("num_hidden_layers".into(), json!(pairs.len()));
    c.insert(
        "layer_types".into(),
        json!(
            pairs
                .iter()
                .map(|(m, _)| mixer_type(*m).unwrap_or_default())
                .collect::<Vec<_>>()
        ),
    );
    c.insert("tie_word_embeddings".into(), json!(model.tie_embeddings));
    c.insert("rms_norm_eps".into(), json!(NORM_EPS));
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("initializer_range".into(), json!(decimal(model.init_std)));
    c.insert("max_position_embeddings".into(), json!(model.seq_length));
    c.insert("attention_bias".into(), json!(false));
    c.insert("attention_dropout".into(), json!(0.0));
    c.insert("torch_dtype".into(), json!(dtype.torch_name()));
    if uses(LayerKind::Attention) {
        let a = model.attention.as_ref().expect("checked");
        c.insert("num_attention_heads".into(), json!(a.num_heads));
        c.insert("num_key_value_heads".into(), json!(a.num_kv_groups));
        c.insert(
            "head_dim".into(),
            json!(model.attention_head_dim().unwrap_or(0)),
        );
        // hybridgen rotates the whole head (rotate-half pairs) or nothing:
        // a rotary fraction of 0 rotates no channel, which is exactly no
        // position embedding.
        let fraction = match a.position {
            Position::Rope => 1.0,
            Position::None => 0.0,
        };
        c.insert(
            "rope_parameters".into(),
            json!({
                "rope_type": "default",
                "rope_theta": decimal(a.rope_base),
                "partial_rotary_factor": fraction,
            }),
        );
    }
    if uses(LayerKind::GatedDeltaNet) {
        let g = model.gdn.as_ref().expect("checked");
        c.insert("linear_num_key_heads".into(), json!(g.key_heads));
        c.insert("linear_num_value_heads".into(), json!(g.value_heads));
        c.insert("linear_key_head_dim".into(), json!(g.key_head_dim));
        c.insert("linear_value_head_dim".into(), json!(g.value_head_dim));
        c.insert("linear_conv_kernel_dim".into(), json!(g.conv_kernel));
    }
    if uses(LayerKind::Mlp) {
        let m = model.mlp.as_ref().expect("checked");
        c.insert("intermediate_size".into(), json!(m.ffn_hidden_size));
    }
    let dense: Vec<usize> = pairs
        .iter()
        .enumerate()
        .filter(|(_, (_, m))| *m == LayerKind::Mlp)
        .map(|(p, _)| p)
        .collect();
    c.insert("mlp_only_layers".into(), json!(dense));
    c.insert("decoder_sparse_step".into(), json!(1));
    match &model.moe {
        Some(m) if uses(LayerKind::Moe) => {
            c.insert("num_experts".into(), json!(m.num_experts));
            c.insert("num_experts_per_tok".into(), json!(m.top_k));
            c.insert("moe_intermediate_size".into(), json!(m.ffn_hidden_size));
            c.insert(
                "shared_expert_intermediate_size".into(),
                json!(m.shared_expert_ffn_hidden_size),
            );
            // A softmax over the selected logits is the full softmax's
            // selected scores over their sum.
            c.insert("norm_topk_prob".into(), json!(true));
            c.insert(
                "router_aux_loss_coef".into(),
                json!(decimal(m.aux_loss_coeff)),
            );
        }
        _ => {
            c.insert("num_experts".into(), json!(0));
        }
    }
    Ok((Value::Object(c), notes))
}

/// Fields hybridgen reads into the model.
const READ: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "layer_types",
    "full_attention_interval",
    "tie_word_embeddings",
    "initializer_range",
    "max_position_embeddings",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "rope_theta",
    "partial_rotary_factor",
    "rope_scaling",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "intermediate_size",
    "mlp_only_layers",
    "decoder_sparse_step",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "router_aux_loss_coef",
];

/// Qwen3-Next's own fields that do not change what the model computes
/// (besides transformers' `BOOKKEEPING`): the router's logits returned,
/// and the sliding-window settings, which transformers' Qwen3-Next does
/// not read.
const IGNORED: &[&str] = &[
    "output_router_logits",
    "max_window_layers",
    "use_sliding_window",
];

/// Fields that must have the one value hybridgen computes with.
fn required(name: &str) -> Option<(Value, &'static str)> {
    const ONLY: &str = "hybridgen computes only this value";
    Some(match name {
        "attention_bias" => (json!(false), ONLY),
        "hidden_act" => (json!("silu"), ONLY),
        "rms_norm_eps" => (json!(NORM_EPS), "hybridgen's RMSNorm uses eps 1e-5"),
        "attention_dropout" => (json!(0.0), ONLY),
        "sliding_window" => (
            Value::Null,
            "hybridgen's attention is full causal attention",
        ),
        _ => return None,
    })
}

/// A model from a qwen3_next `config.json` (`origin` names it in errors).
pub fn from_config(c: &Map<String, Value>, origin: &str) -> Result<ModelConfig> {
    let field_error = |name: &str, why: String| refuse(format!("{origin}: `{name}` {why}"));
    for (name, value) in c {
        if [READ, BOOKKEEPING, IGNORED]
            .iter()
            .any(|names| names.contains(&name.as_str()))
        {
            continue;
        }
        check_fixed_field(name, value, required(name), origin)?;
    }
    let usize_field = |name: &str| -> Result<Option<usize>> {
        match c.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n <= hybridgen_dsl::config::MAX_DIMENSION as u64)
                .map(|n| Some(n as usize))
                .ok_or_else(|| field_error(name, format!("is {v}, not a whole number"))),
        }
    };
    let need = |name: &str, why: &str| -> Result<usize> {
        usize_field(name)?
            .filter(|&n| n > 0)
            .ok_or_else(|| field_error(name, format!("is missing or 0; {why}")))
    };
    let layers = need("num_hidden_layers", "the layers are unknown")?;
    // The mixers: `layer_types`, or transformers' default of every
    // `full_attention_interval`-th layer full attention.
    let mixers: Vec<LayerKind> = match c.get("layer_types").filter(|v| !v.is_null()) {
        Some(v) => {
            let items = v
                .as_array()
                .ok_or_else(|| field_error("layer_types", format!("is {v}, not a list")))?;
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item.as_str() {
                    Some("linear_attention") => Ok(LayerKind::GatedDeltaNet),
                    Some("full_attention") => Ok(LayerKind::Attention),
                    _ => Err(field_error(
                        "layer_types",
                        format!(
                            "item {i} is {item}, not \"linear_attention\" or \"full_attention\""
                        ),
                    )),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let every = usize_field("full_attention_interval")?.unwrap_or(4).max(1);
            (0..layers)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        LayerKind::Attention
                    } else {
                        LayerKind::GatedDeltaNet
                    }
                })
                .collect()
        }
    };
    if mixers.len() != layers {
        return Err(field_error(
            "num_hidden_layers",
            format!("is {layers}, but `layer_types` lists {}", mixers.len()),
        ));
    }
    let experts = usize_field("num_experts")?.unwrap_or(0);
    let step = usize_field("decoder_sparse_step")?.unwrap_or(1).max(1);
    let dense_only: Vec<usize> = match c.get("mlp_only_layers").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|items| {
                items
                    .iter()
                    .map(|i| i.as_u64().map(|i| i as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                field_error("mlp_only_layers", format!("is {v}, not a list of layers"))
            })?,
    };
    let mut pattern = String::new();
    for (p, mixer) in mixers.iter().enumerate() {
        let sparse = !dense_only.contains(&p) && experts > 0 && (p + 1) % step == 0;
        pattern.push(mixer.symbol());
        pattern.push(if sparse { 'E' } else { '-' });
    }
    let symbols = pattern.clone();
    let uses = |k: LayerKind| symbols.contains(k.symbol());
    let vocab = need("vocab_size", "the embedding size is unknown")?;
    if vocab % 128 != 0 {
        return Err(field_error(
            "vocab_size",
            format!(
                "is {vocab}: hybridgen pads the vocabulary to a multiple of 128, so the embedding of \
                 {vocab} rows would not fit; pad the checkpoint's embedding and lm_head to {} rows",
                vocab.div_ceil(128) * 128
            ),
        ));
    }
    let mut model = ModelConfig {
        pattern,
        hidden_size: need("hidden_size", "the model's width is unknown")?,
        vocab_size: vocab,
        tie_embeddings: tie_embeddings(c, origin)?,
        init_std: init_std(c),
        seq_length: usize_field("max_position_embeddings")?
            .filter(|&n| n > 0)
            .map_or(4096, |m| m.min(4096)),
        attention: None,
        mla: None,
        dsa: None,
        gdn: None,
        mamba: None,
        mlp: None,
        moe: None,
        mtp: MtpConfig::default(),
    };
    let why =
        |kind: LayerKind| format!("the model has {} layers and they need it", kind_name(kind));
    if uses(LayerKind::Attention) {
        let why = why(LayerKind::Attention);
        let heads = need("num_attention_heads", &why)?;
        let rope = c
            .get("rope_parameters")
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or_else(|| json!({}));
        if let Some(scaling) = c.get("rope_scaling").filter(|v| !v.is_null()) {
            return Err(field_error(
                "rope_scaling",
                format!(
                    "is {scaling}: hybridgen's rotary embedding is unscaled; only null imports"
                ),
            ));
        }
        let get = |key: &str| {
            rope.get(key)
                .or_else(|| c.get(key))
                .filter(|v| !v.is_null())
        };
        if let Some(kind) = rope.get("rope_type").filter(|v| !v.is_null())
            && kind.as_str() != Some("default")
        {
            return Err(field_error(
                "rope_parameters",
                format!("has rope_type {kind}: hybridgen's rotary embedding is the default one"),
            ));
        }
        let fraction = get("partial_rotary_factor")
            .map_or(Some(0.25), Value::as_f64)
            .unwrap_or(f64::NAN);
        let position = if fraction == 1.0 {
            Position::Rope
        } else if fraction == 0.0 {
            Position::None
        } else {
            return Err(field_error(
                "partial_rotary_factor",
                format!(
                    "is {fraction} (transformers' default is 0.25): hybridgen rotates the whole head \
                     (1) or none of it (0); only those import"
                ),
            ));
        };
        let theta = get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 0.0) || (theta as f32) as f64 != theta {
            return Err(field_error(
                "rope_theta",
                format!("is {theta}: hybridgen keeps the rotary base as an f32 above 0"),
            ));
        }
        model.attention = Some(AttentionConfig {
            num_heads: heads,
            num_kv_groups: usize_field("num_key_value_heads")?.unwrap_or(heads),
            head_dim: usize_field("head_dim")?,
            qk_norm: true,
            position,
            rope_base: theta as f32,
        });
    }
    if uses(LayerKind::GatedDeltaNet) {
        let why = why(LayerKind::GatedDeltaNet);
        model.gdn = Some(GdnConfig {
            key_heads: need("linear_num_key_heads", &why)?,
            value_heads: need("linear_num_value_heads", &why)?,
            key_head_dim: need("linear_key_head_dim", &why)?,
            value_head_dim: need("linear_value_head_dim", &why)?,
            conv_kernel: usize_field("linear_conv_kernel_dim")?.unwrap_or(4),
        });
    }
    if uses(LayerKind::Mlp) {
        model.mlp = Some(MlpConfig {
            ffn_hidden_size: need("intermediate_size", &why(LayerKind::Mlp))?,
            activation: Activation::Swiglu,
        });
    }
    if uses(LayerKind::Moe) {
        let why = why(LayerKind::Moe);
        if c.get("norm_topk_prob").and_then(Value::as_bool) == Some(false) {
            return Err(field_error(
                "norm_topk_prob",
                "is false: hybridgen's softmax router normalises over the selected experts (a \
                 softmax over their logits); only true imports"
                    .into(),
            ));
        }
        let aux = c
            .get("router_aux_loss_coef")
            .and_then(Value::as_f64)
            .filter(|v| v.is_finite() && *v >= 0.0)
            .map_or(1e-3, |v| v as f32);
        model.moe = Some(MoeConfig {
            num_experts: experts,
            top_k: need("num_experts_per_tok", &why)?,
            ffn_hidden_size: need("moe_intermediate_size", &why)?,
            shared_expert_ffn_hidden_size: Some(need("shared_expert_intermediate_size", &why)?),
            activation: Activation::Swiglu,
            score_function: ScoreFunction::Softmax,
            aux_loss_coeff: aux,
            topk_scaling_factor: 1.0,
            expert_bias: false,
            expert_bias_update_rate: 1e-3,
        });
    }
    let parsed = Pattern::parse(&model.pattern).map_err(|_| {
        refuse(format!(
            "{origin}: the layer pattern `{}` does not parse",
            model.pattern
        ))
    })?;
    if let Some(first) = model.check(&parsed).first() {
        return Err(refuse(format!(
            "{origin}: the dimensions do not make a model: {}",
            first.message
        )));
    }
    Ok(model)
}

/// One tensor from whole rows of a parameter.
fn rows_tensor(
    name: String,
    def_shape: &[usize],
    param: usize,
    key: &str,
    pieces: Vec<Piece>,
    map: ValueMap,
) -> HfTensor {
    let mut shape = def_shape.to_vec();
    shape[0] = pieces.iter().map(Piece::len).sum();
    HfTensor {
        name,
        shape,
        source: Source::Rows {
            param,
            key: key.to_string(),
            pieces,
            map,
        },
    }
}

fn rows(r: Range<usize>) -> Piece {
    Piece::Rows(r)
}

/// Every qwen3_next tensor of `plan`'s model, in the plan's parameter
/// order. The plan must hold every expert (`ep` 1).
pub fn hf_tensors(plan: &Plan) -> Result<Vec<HfTensor>> {
    if plan.layout.ep != 1 {
        return Err(RuntimeError::InvalidArgument(format!(
            "the Hugging Face mapping needs a plan holding every expert (ep 1), not ep {}",
            plan.layout.ep
        )));
    }
    check(&plan.model)?;
    let model = &plan.model;
    let h = model.hidden_size;
    let mut out = Vec::with_capacity(plan.params.len() + plan.layers.len());
    for (p, param) in plan.params.iter().enumerate() {
        let def = plan.def(param);
        let key = plan.checkpoint_key(param, 0);
        let shape = &def.shape[..];
        let all = || vec![rows(0..shape[0])];
        let mut push = |name: String, pieces: Vec<Piece>, map: ValueMap| {
            out.push(rows_tensor(name, shape, p, &key, pieces, map));
        };
        let i = match param.owner {
            Owner::Embedding => {
                push("model.embed_tokens.weight".into(), all(), ValueMap::Same);
                continue;
            }
            Owner::FinalNorm => {
                push("model.norm.weight".into(), all(), ValueMap::ZeroCentred);
                continue;
            }
            Owner::OutputLayer => {
                push("lm_head.weight".into(), all(), ValueMap::Same);
                continue;
            }
            Owner::Layer(LayerRef::Decoder(i)) => i,
            Owner::Layer(LayerRef::Mtp { .. }) | Owner::MtpBlock(_) => {
                return Err(refuse(format!(
                    "`{key}` belongs to an MTP depth, which transformers' qwen3_next does not compute; \
                     export a pattern without MTP depths"
                )));
            }
        };
        let kind = plan.layers[i].kind;
        let prefix = format!("model.layers.{}.", i / 2);
        let name = def.name.as_ref();
        let unmapped = || {
            refuse(format!(
                "`{key}` has no counterpart in transformers' qwen3_next"
            ))
        };
        match kind {
            LayerKind::GatedDeltaNet => {
                let g = model.gdn.as_ref().expect("checked");
                let (kd, vd, hv) = (
                    g.key_heads * g.key_head_dim,
                    g.value_heads * g.value_head_dim,
                    g.value_heads,
                );
                let r = g.value_heads / g.key_heads;
                let (dk, dvr) = (g.key_head_dim, r * g.value_head_dim);
                let la = format!("{prefix}linear_attn.");
                match name {
                    "self_attention.dt_bias" | "self_attention.A_log" => push(
                        format!("{la}{}", name.trim_start_matches("self_attention.")),
                        all(),
                        ValueMap::Same,
                    ),
                    "self_attention.in_proj.layer_norm_weight" => push(
                        format!("{prefix}input_layernorm.weight"),
                        all(),
                        ValueMap::ZeroCentred,
                    ),
                    "self_attention.in_proj.weight" => {
                        // hybridgen: [q | k | v | z | beta | alpha], heads in
                        // order; qwen3_next: per key head i, [q_i | k_i | its
                        // r value heads' v | their z], and [b | a] likewise.
                        let qkvz = (0..g.key_heads)
                            .flat_map(|i| {
                                [
                                    rows(i * dk..(i + 1) * dk),
                                    rows(kd + i * dk..kd + (i + 1) * dk),
                                    rows(2 * kd + i * dvr..2 * kd + (i + 1) * dvr),
                                    rows(2 * kd + vd + i * dvr..2 * kd + vd + (i + 1) * dvr),
                                ]
                            })
                            .collect();
                        push(format!("{la}in_proj_qkvz.weight"), qkvz, ValueMap::Same);
                        let base = 2 * kd + 2 * vd;
                        let ba = (0..g.key_heads)
                            .flat_map(|i| {
                                [
                                    rows(base + i * r..base + (i + 1) * r),
                                    rows(base + hv + i * r..base + hv + (i + 1) * r),
                                ]
                            })
                            .collect();
                        push(format!("{la}in_proj_ba.weight"), ba, ValueMap::Same);
                    }
                    "self_attention.conv1d.weight" => {
                        push(format!("{la}conv1d.weight"), all(), ValueMap::Same)
                    }
                    "self_attention.out_norm.weight" => {
                        push(format!("{la}norm.weight"), all(), ValueMap::Same)
                    }
                    "self_attention.out_proj.weight" => {
                        push(format!("{la}out_proj.weight"), all(), ValueMap::Same)
                    }
                    _ => return Err(unmapped()),
                }
            }
            LayerKind::Attention => {
                let a = model.attention.as_ref().expect("checked");
                let c = model.attention_head_dim().unwrap_or(0);
                let per = a.num_heads / a.num_kv_groups.max(1);
                let stride = (per + 2) * c;
                let sa = format!("{prefix}self_attn.");
                match name {
                    "self_attention.linear_proj.weight" => {
                        push(format!("{sa}o_proj.weight"), all(), ValueMap::Doubled)
                    }
                    "self_attention.linear_qkv.layer_norm_weight" => push(
                        format!("{prefix}input_layernorm.weight"),
                        all(),
                        ValueMap::ZeroCentred,
                    ),
                    "self_attention.linear_qkv.weight" => {
                        // q_proj: per head, its query rows then its output
                        // gate's (zeros).
                        let q = (0..a.num_heads)
                            .flat_map(|j| {
                                let start = (j / per) * stride + (j % per) * c;
                                [rows(start..start + c), Piece::Zeros(c)]
                            })
                            .collect();
                        push(format!("{sa}q_proj.weight"), q, ValueMap::Same);
                        let part = |offset: usize| {
                            (0..a.num_kv_groups)
                                .map(|g| rows(g * stride + offset..g * stride + offset + c))
                                .collect()
                        };
                        push(format!("{sa}k_proj.weight"), part(per * c), ValueMap::Same);
                        push(
                            format!("{sa}v_proj.weight"),
                            part((per + 1) * c),
                            ValueMap::Same,
                        );
                    }
                    "self_attention.q_layernorm.weight" => {
                        push(format!("{sa}q_norm.weight"), all(), ValueMap::ZeroCentred)
                    }
                    "self_attention.k_layernorm.weight" => {
                        push(format!("{sa}k_norm.weight"), all(), ValueMap::ZeroCentred)
                    }
                    _ => return Err(unmapped()),
                }
            }
            LayerKind::Mlp => {
                let f = model.mlp.as_ref().expect("checked").ffn_hidden_size;
                let mlp = format!("{prefix}mlp.");
                match name {
                    "mlp.linear_fc1.layer_norm_weight" => push(
                        format!("{prefix}post_attention_layernorm.weight"),
                        all(),
                        ValueMap::ZeroCentred,
                    ),
                    "mlp.linear_fc1.weight" => {
                        push(
                            format!("{mlp}gate_proj.weight"),
                            vec![rows(0..f)],
                            ValueMap::Same,
                        );
                        push(
                            format!("{mlp}up_proj.weight"),
                            vec![rows(f..2 * f)],
                            ValueMap::Same,
                        );
                    }
                    "mlp.linear_fc2.weight" => {
                        push(format!("{mlp}down_proj.weight"), all(), ValueMap::Same)
                    }
                    _ => return Err(unmapped()),
                }
            }
            LayerKind::Moe => {
                let m = model.moe.as_ref().expect("checked");
                let mlp = format!("{prefix}mlp.");
                let fe = m.ffn_hidden_size;
                let fs = m.shared_expert_ffn_hidden_size.unwrap_or(0);
                if let Some(j) = def.local_expert {
                    let ex = format!("{mlp}experts.{j}.");
                    if name.starts_with("mlp.experts.linear_fc1.weight") {
                        push(
                            format!("{ex}gate_proj.weight"),
                            vec![rows(0..fe)],
                            ValueMap::Same,
                        );
                        push(
                            format!("{ex}up_proj.weight"),
                            vec![rows(fe..2 * fe)],
                            ValueMap::Same,
                        );
                    } else if name.starts_with("mlp.experts.linear_fc2.weight") {
                        push(format!("{ex}down_proj.weight"), all(), ValueMap::Same);
                    } else {
                        return Err(unmapped());
                    }
                    continue;
                }
                match name {
                    "pre_mlp_layernorm.weight" => push(
                        format!("{prefix}post_attention_layernorm.weight"),
                        all(),
                        ValueMap::ZeroCentred,
                    ),
                    "mlp.router.weight" => push(format!("{mlp}gate.weight"), all(), ValueMap::Same),
                    "mlp.shared_experts.linear_fc1.weight" => {
                        push(
                            format!("{mlp}shared_expert.gate_proj.weight"),
                            vec![rows(0..fs)],
                            ValueMap::Same,
                        );
                        push(
                            format!("{mlp}shared_expert.up_proj.weight"),
                            vec![rows(fs..2 * fs)],
                            ValueMap::Same,
                        );
                    }
                    "mlp.shared_experts.linear_fc2.weight" => {
                        push(
                            format!("{mlp}shared_expert.down_proj.weight"),
                            all(),
                            ValueMap::Doubled,
                        );
                        out.push(HfTensor {
                            name: format!("{mlp}shared_expert_gate.weight"),
                            shape: vec![1, h],
                            source: Source::Zeros,
                        });
                    }
                    _ => return Err(unmapped()),
                }
            }
            other => {
                return Err(refuse(format!(
                    "decoder layer {i} is {}: transformers' qwen3_next has no such layer",
                    kind_name(other)
                )));
            }
        }
    }
    Ok(out)
}

/// The value an f32 export stores for hybridgen's `w` under `map`, or why it
/// cannot be exact.
pub fn export_value(map: ValueMap, w: f32) -> std::result::Result<f32, String> {
    match map {
        ValueMap::Same => Ok(w),
        ValueMap::ZeroCentred => {
            let e = w - 1.0;
            if 1.0 + e == w {
                Ok(e)
            } else {
                Err(format!(
                    "the norm weight {w:e} is stored as w - 1 (transformers computes 1 + w), which \
                     f32 cannot hold exactly for it"
                ))
            }
        }
        ValueMap::Doubled => {
            let d = 2.0 * w;
            if d.is_finite() {
                Ok(d)
            } else {
                Err(format!(
                    "the weight {w:e} is stored doubled (after a 0.5 gate), which overflows f32"
                ))
            }
        }
    }
}

/// hybridgen's value for a stored `v` under `map`, or why it is not exact.
pub fn import_value(map: ValueMap, v: f32) -> std::result::Result<f32, String> {
    match map {
        ValueMap::Same => Ok(v),
        // transformers computes `1 + w` in f32 too: the same value.
        ValueMap::ZeroCentred => Ok(1.0 + v),
        ValueMap::Doubled => {
            let half = v * 0.5;
            if half * 2.0 == v {
                Ok(half)
            } else {
                Err(format!(
                    "the weight {v:e} follows a 0.5 gate, so hybridgen holds half of it, which f32 \
                     cannot hold exactly"
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_gdn() -> ModelConfig {
        ModelConfig::preset("tiny-gdn").unwrap()
    }

    #[test]
    fn the_preset_exports_and_reads_back_flat() {
        let model = tiny_gdn();
        let (config, notes) = to_config(&model, HfDtype::F32).unwrap();
        assert!(
            notes[0].contains("4 qwen3_next decoder layers"),
            "{notes:?}"
        );
        let back = from_config(config.as_object().unwrap(), "c").unwrap();
        assert_eq!(back.pattern, "GEGEGE*E");
        let mut want = model;
        want.pattern = back.pattern.clone();
        want.mla = None;
        want.dsa = None;
        want.mamba = None;
        want.mlp = None;
        assert_eq!(back, want);
    }

    #[test]
    fn a_published_style_config_reads_its_layers_and_refuses_what_differs() {
        // The fields of the published Qwen3-Next config (its dimensions
        // shrunk): every fourth layer full attention, every layer MoE.
        let mut c = json!({
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "hidden_size": 64,
            "vocab_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "intermediate_size": 96,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [2],
            "norm_topk_prob": true,
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
        });
        let read = |c: &Value| from_config(c.as_object().unwrap(), "c").map_err(|e| e.to_string());
        let err = read(&c).unwrap_err();
        assert!(err.contains("`rms_norm_eps` is 1e-6"), "{err}");
        c["rms_norm_eps"] = json!(1e-5);
        let err = read(&c).unwrap_err();
        assert!(err.contains("`partial_rotary_factor` is 0.25"), "{err}");
        c["partial_rotary_factor"] = json!(1.0);
        let model = read(&c).unwrap();
        assert_eq!(model.pattern, "GEGEG-*E");
        assert_eq!(model.attention.as_ref().unwrap().rope_base, 1e7);
        c["norm_topk_prob"] = json!(false);
        assert!(read(&c).unwrap_err().contains("`norm_topk_prob` is false"));
    }

    #[test]
    fn value_maps_are_exact_or_refused() {
        // w - 1 is exact on [0.5, 2]; 0.1 - 1 loses 0.1's low bits.
        assert_eq!(export_value(ValueMap::ZeroCentred, 1.25), Ok(0.25));
        assert_eq!(export_value(ValueMap::ZeroCentred, 0.5), Ok(-0.5));
        assert!(export_value(ValueMap::ZeroCentred, 0.1).is_err());
        assert_eq!(import_value(ValueMap::ZeroCentred, 0.25), Ok(1.25));
        assert_eq!(export_value(ValueMap::Doubled, 0.3), Ok(0.6));
        assert_eq!(import_value(ValueMap::Doubled, 0.6), Ok(0.3));
        assert!(export_value(ValueMap::Doubled, f32::MAX).is_err());
        // The smallest subnormal has no half.
        assert!(import_value(ValueMap::Doubled, f32::from_bits(1)).is_err());
    }
}

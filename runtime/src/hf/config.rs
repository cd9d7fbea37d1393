//! `config.json` of transformers' `nemotron_h` <-> a hybridgen model.
//!
//! Export writes every dimension the model's layers use, the layer pattern
//! as `hybrid_override_pattern` (groups and pipeline stages flattened), the
//! MTP pattern, the MoE fields and the dtype. Import reads a field only if
//! hybridgen models it; a field that would change the maths to something
//! hybridgen does not compute must have the one value hybridgen computes,
//! and a field it does not know at all is refused, so nothing is dropped
//! without a word.

use super::mapping::{Family, HF_KINDS, check_kind, kind_name};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::config::{
    Activation, AttentionConfig, MambaConfig, MlpConfig, MoeConfig, MtpConfig, Position,
    ScoreFunction,
};
use hybridgen_dsl::{LayerKind, ModelConfig, Pattern};
use serde_json::{Map, Value, json};

/// The dtype of an export's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfDtype {
    Bf16,
    F32,
}

impl HfDtype {
    /// transformers' name for it (`torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            HfDtype::Bf16 => "bfloat16",
            HfDtype::F32 => "float32",
        }
    }
}

/// The most MTP depths an imported config may ask for (published models
/// have one or two): the pattern is built from them before it is checked.
const MAX_MTP_DEPTHS: u64 = 1024;

/// RMSNorm's epsilon: fixed in hybridgen (layers.md).
pub(super) const NORM_EPS: f64 = 1e-5;

/// A pattern's layers flattened to transformers' symbols: the main
/// decoder and one MTP depth's (all depths are alike, H010).
struct FlatPattern {
    decoder: Vec<LayerKind>,
    mtp: Vec<LayerKind>,
    mtp_depths: usize,
}

fn flatten(pattern: &Pattern) -> FlatPattern {
    FlatPattern {
        decoder: pattern.layers().map(|l| l.kind).collect(),
        mtp: pattern
            .mtp_depths
            .first()
            .map(|d| d.layers.iter().map(|l| l.kind).collect())
            .unwrap_or_default(),
        mtp_depths: pattern.mtp_depth_count(),
    }
}

fn symbols(kinds: &[LayerKind]) -> String {
    kinds.iter().map(|k| k.symbol()).collect()
}

pub(super) fn refuse(message: String) -> RuntimeError {
    RuntimeError::Unsupported(message)
}

/// The transformers model type `model` exports as: `qwen3_next` for a
/// pattern with `G` (which nemotron_h lacks); otherwise `nemotron_h` when it
/// computes the model, else `qwen3_next` when that does; a model neither
/// computes is refused with both reasons.
pub fn family_of(model: &ModelConfig) -> Result<Family> {
    let has_g = Pattern::parse(&model.pattern).is_ok_and(|p| {
        p.layers()
            .chain(p.mtp_depths.iter().flat_map(|d| d.layers.iter()))
            .any(|l| l.kind == LayerKind::GatedDeltaNet)
    });
    let qwen = super::qwen3_next::check(model).map(|_| Family::Qwen3Next);
    if has_g && qwen.is_ok() {
        return qwen;
    }
    let nemotron = match nemotron_h_config(model, HfDtype::F32) {
        Ok(_) => return Ok(Family::NemotronH),
        Err(e) => e,
    };
    qwen.map_err(|q| {
        refuse(format!(
            "neither transformers' nemotron_h nor its qwen3_next computes this model: for \
             qwen3_next, {}; for nemotron_h, {}",
            strip(&q),
            strip(&nemotron)
        ))
    })
}

/// A refusal's message without its prefix.
fn strip(e: &RuntimeError) -> String {
    match e {
        RuntimeError::Unsupported(m) => m.clone(),
        other => other.to_string(),
    }
}

/// The `config.json` of `model` exported in `dtype`, and the notes an
/// export prints (what it flattened). Refuses what transformers cannot
/// compute as hybridgen does.
pub fn to_hf_config(model: &ModelConfig, dtype: HfDtype) -> Result<(Value, Vec<String>)> {
    match family_of(model)? {
        Family::NemotronH => nemotron_h_config(model, dtype),
        Family::Qwen3Next => super::qwen3_next::to_config(model, dtype),
    }
}

/// [`to_hf_config`] as transformers' nemotron_h.
fn nemotron_h_config(model: &ModelConfig, dtype: HfDtype) -> Result<(Value, Vec<String>)> {
    let pattern = Pattern::parse(&model.pattern).map_err(|d| {
        refuse(format!(
            "the model's pattern `{}` is not valid: {d}",
            model.pattern
        ))
    })?;
    let flat = flatten(&pattern);
    let mut used: Vec<LayerKind> = flat.decoder.iter().chain(&flat.mtp).copied().collect();
    used.sort();
    used.dedup();
    for (i, kind) in flat.decoder.iter().enumerate() {
        check_kind(*kind, &format!("decoder layer {i}"))?;
    }
    for (i, kind) in flat.mtp.iter().enumerate() {
        check_kind(*kind, &format!("MTP layer {i}"))?;
    }
    let mut notes = Vec::new();
    if pattern.has_groups() || pattern.has_pipeline_segments() {
        notes.push(format!(
            "groups and pipeline stages have no counterpart in transformers and do not change the maths: \
             the pattern `{}` is exported flat as `{}`",
            pattern.canonical(),
            symbols(&flat.decoder)
        ));
    }
    let mut c = Map::new();
    c.insert("architectures".into(), json!(["NemotronHForCausalLM"]));
    c.insert("model_type".into(), json!("nemotron_h"));
    c.insert("vocab_size".into(), json!(model.padded_vocab_size()));
    c.insert("hidden_size".into(), json!(model.hidden_size));
    c.insert("num_hidden_layers".into(), json!(flat.decoder.len()));
    c.insert(
        "hybrid_override_pattern".into(),
        json!(symbols(&flat.decoder)),
    );
    c.insert("tie_word_embeddings".into(), json!(model.tie_embeddings));
    c.insert("layer_norm_epsilon".into(), json!(NORM_EPS));
    c.insert("initializer_range".into(), json!(decimal(model.init_std)));
    c.insert("max_position_embeddings".into(), json!(model.seq_length));
    c.insert("use_bias".into(), json!(false));
    c.insert("torch_dtype".into(), json!(dtype.torch_name()));
    if used.contains(&LayerKind::Attention) {
        let a = model
            .attention
            .as_ref()
            .ok_or_else(|| missing("attention"))?;
        if a.position != Position::None {
            return Err(refuse(
                "the model's attention uses rotary positions (`position = \"rope\"`), but transformers' \
                 nemotron_h attention has no position embedding; export a model with `position = \"none\"` \
                 (Nemotron-H's own choice: the Mamba layers carry order)"
                    .into(),
            ));
        }
        if a.qk_norm {
            return Err(refuse(
                "the model's attention has query/key norms (`qk_norm = true`), which transformers' \
                 nemotron_h attention lacks; export a model without them"
                    .into(),
            ));
        }
        c.insert("num_attention_heads".into(), json!(a.num_heads));
        c.insert("num_key_value_heads".into(), json!(a.num_kv_groups));
        c.insert(
            "head_dim".into(),
            json!(model.attention_head_dim().unwrap_or(0)),
        );
        c.insert("attention_bias".into(), json!(false));
    }
    if used.contains(&LayerKind::Mamba) {
        let m = model.mamba.as_ref().ok_or_else(|| missing("mamba"))?;
        c.insert("mamba_num_heads".into(), json!(m.num_heads));
        c.insert("mamba_head_dim".into(), json!(m.head_dim));
        c.insert("n_groups".into(), json!(m.num_groups));
        c.insert("ssm_state_size".into(), json!(m.state_size));
        c.insert("conv_kernel".into(), json!(m.conv_kernel));
        c.insert("chunk_size".into(), json!(m.chunk_size));
        c.insert("use_conv_bias".into(), json!(true));
        c.insert("mamba_proj_bias".into(), json!(false));
        c.insert("mamba_hidden_act".into(), json!("silu"));
    }
    if used.contains(&LayerKind::Mlp) {
        let m = model.mlp.as_ref().ok_or_else(|| missing("mlp"))?;
        check_activation(m.activation, "[mlp]")?;
        c.insert("intermediate_size".into(), json!(m.ffn_hidden_size));
    }
    if used.contains(&LayerKind::Mlp) || used.contains(&LayerKind::Moe) {
        c.insert("mlp_hidden_act".into(), json!("relu2"));
        c.insert("mlp_bias".into(), json!(false));
    }
    if used.contains(&LayerKind::Moe) {
        let m = model.moe.as_ref().ok_or_else(|| missing("moe"))?;
        check_activation(m.activation, "[moe]")?;
        if m.score_function != ScoreFunction::Sigmoid {
            return Err(refuse(
                "the model's MoE router scores with a softmax (`score_function = \"softmax\"`), but \
                 transformers' nemotron_h router scores with a sigmoid; export a model with \
                 `score_function = \"sigmoid\"`"
                    .into(),
            ));
        }
        let Some(fs) = m.shared_expert_ffn_hidden_size else {
            return Err(refuse(
                "the model's MoE layers have no shared expert, but transformers' NemotronHMoE always has \
                 one; export a model with `shared_expert_ffn_hidden_size` set"
                    .into(),
            ));
        };
        if !used.contains(&LayerKind::Mlp) {
            // Published MoE-only configs carry the expert width here too.
            c.insert("intermediate_size".into(), json!(m.ffn_hidden_size));
        }
        c.insert("n_routed_experts".into(), json!(m.num_experts));
        c.insert("num_experts_per_tok".into(), json!(m.top_k));
        c.insert("moe_intermediate_size".into(), json!(m.ffn_hidden_size));
        c.insert("moe_shared_expert_intermediate_size".into(), json!(fs));
        c.insert("n_shared_experts".into(), json!(1));
        // Megatron normalises the selected sigmoid scores only when top-k > 1.
        c.insert("norm_topk_prob".into(), json!(m.top_k > 1));
        c.insert(
            "routed_scaling_factor".into(),
            json!(decimal(m.topk_scaling_factor)),
        );
        c.insert("n_group".into(), json!(1));
        c.insert("topk_group".into(), json!(1));
    }
    c.insert("num_nextn_predict_layers".into(), json!(flat.mtp_depths));
    if flat.mtp_depths > 0 {
        c.insert(
            "mtp_hybrid_override_pattern".into(),
            json!(symbols(&flat.mtp)),
        );
        notes.push(format!(
            "{} MTP depth(s) of `{}` are exported as `mtp.layers.*` (Megatron-Bridge's numbering); \
             transformers ignores them on load, vLLM's MTP reads them",
            flat.mtp_depths,
            symbols(&flat.mtp)
        ));
    }
    Ok((Value::Object(c), notes))
}

/// An f32 as the f64 its shortest decimal text reads as (0.02, not the
/// 0.019999999552965164 a widening gives): what a config.json writer means.
pub(super) fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

fn missing(section: &str) -> RuntimeError {
    refuse(format!(
        "the model has no [{section}] section for the layers that need it"
    ))
}

fn check_activation(activation: Activation, section: &str) -> Result<()> {
    if activation == Activation::SquaredRelu {
        return Ok(());
    }
    Err(refuse(format!(
        "{section} uses activation `{}`, but transformers' nemotron_h MLPs and experts are squared ReLU \
         (`relu2`, not gated); export a model with `activation = \"squared_relu\"`",
        match activation {
            Activation::Gelu => "gelu",
            Activation::Swiglu => "swiglu",
            Activation::SquaredRelu => "squared_relu",
        }
    )))
}

/// Fields hybridgen reads into the model.
const READ: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "hybrid_override_pattern",
    "layers_block_type",
    "tie_word_embeddings",
    "initializer_range",
    "max_position_embeddings",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_head_dim",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "mamba_n_groups",
    "ssm_state_size",
    "conv_kernel",
    "mamba_d_conv",
    "chunk_size",
    "mamba_chunk_size",
    "intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "n_shared_experts",
    "norm_topk_prob",
    "routed_scaling_factor",
    "num_nextn_predict_layers",
    "mtp_hybrid_override_pattern",
    "mtp_layers_block_type",
];

/// Fields every transformers config carries that do not change what the
/// model computes: its class and origin, tokens, the cache, dtypes. Every
/// importer skips them.
pub(super) const BOOKKEEPING: &[&str] = &[
    "architectures",
    "auto_map",
    "_name_or_path",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
];

/// Nemotron-H's own fields that do not change what the model computes:
/// logits kept, kernels, initialisation, positions of an attention without
/// rotary embeddings, and Mamba's `expand` (transformers sizes the mixer
/// from its heads).
const IGNORED: &[&str] = &[
    "num_logits_to_keep",
    "use_mamba_kernels",
    "mamba_ssm_cache_dtype",
    "residual_in_fp32",
    "rescale_prenorm_residual",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
    "mamba_dt_min",
    "mamba_dt_max",
    "mamba_dt_init_floor",
    "expand",
    "mamba_expand",
    "rope_theta",
    "partial_rotary_factor",
    "moe_shared_expert_overlap",
];

/// Fields that must have the value hybridgen computes with, and why the
/// value is fixed, in words.
fn required(name: &str) -> Option<(Value, &'static str)> {
    const ONLY: &str = "hybridgen computes only this value";
    Some(match name {
        "attention_bias" | "mlp_bias" | "use_bias" | "mamba_proj_bias" => (json!(false), ONLY),
        "use_conv_bias" | "mamba_conv_bias" => (json!(true), ONLY),
        "mamba_hidden_act" => (json!("silu"), ONLY),
        "mlp_hidden_act" => (json!("relu2"), ONLY),
        "layer_norm_epsilon" | "norm_eps" | "rms_norm_eps" => {
            (json!(NORM_EPS), "hybridgen's RMSNorm uses eps 1e-5")
        }
        "n_group" | "topk_group" => (
            json!(1),
            "hybridgen's router does not restrict experts by group",
        ),
        "moe_latent_size" => (Value::Null, "hybridgen's MoE has no latent projection"),
        "sliding_window" => (
            Value::Null,
            "hybridgen's attention is full causal attention",
        ),
        "attention_dropout" | "hidden_dropout" => (json!(0.0), ONLY),
        _ => return None,
    })
}

fn same_value(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// `tie_word_embeddings` of a `config.json` (transformers' default, false,
/// where it is missing). Shared by every model type's import.
pub(super) fn tie_embeddings(c: &Map<String, Value>, origin: &str) -> Result<bool> {
    match c.get("tie_word_embeddings") {
        None => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| {
            refuse(format!(
                "{origin}: `tie_word_embeddings` is {v}, not true or false"
            ))
        }),
    }
}

/// `initializer_range` of a `config.json`, the standard deviation new
/// weights are drawn with; 0.02 where it is missing or not a positive
/// number (it does not change the model's maths).
pub(super) fn init_std(c: &Map<String, Value>) -> f32 {
    c.get("initializer_range")
        .and_then(Value::as_f64)
        .filter(|v| v.is_finite() && *v > 0.0)
        .map_or(0.02, |v| v as f32)
}

/// Checks a `config.json` field the import does not read: `required` is the
/// one value it may hold and why (the maths hybridgen computes), or `None`
/// where hybridgen has no such setting. Shared by every model type's import.
pub(super) fn check_fixed_field(
    name: &str,
    value: &Value,
    required: Option<(Value, &'static str)>,
    origin: &str,
) -> Result<()> {
    let why = match required {
        Some((want, _)) if same_value(value, &want) => return Ok(()),
        Some((want, why)) => format!("is {value}, but {why}: only {want} imports"),
        None => "is not a field hybridgen models; remove it if it does not change the maths, \
                 or the model cannot be imported"
            .into(),
    };
    Err(refuse(format!("{origin}: `{name}` {why}")))
}

/// A model from a `config.json` (`origin` names it in errors).
pub fn from_hf_config(config: &Value, origin: &str) -> Result<ModelConfig> {
    let field_error = |name: &str, why: String| refuse(format!("{origin}: `{name}` {why}"));
    let Some(c) = config.as_object() else {
        return Err(refuse(format!("{origin}: not a JSON object")));
    };
    match c.get("model_type").and_then(Value::as_str) {
        Some("nemotron_h") => {}
        Some("qwen3_next") => return super::qwen3_next::from_config(c, origin),
        other => {
            return Err(field_error(
                "model_type",
                format!(
                    "is {}, not \"nemotron_h\" or \"qwen3_next\": hybridgen imports transformers' \
                     Nemotron-H and Qwen3-Next models only",
                    other.map_or("missing".to_string(), |s| format!("\"{s}\""))
                ),
            ));
        }
    }
    for (name, value) in c {
        if [READ, BOOKKEEPING, IGNORED]
            .iter()
            .any(|names| names.contains(&name.as_str()))
        {
            continue;
        }
        if name == "time_step_limit" || name == "mamba_dt_limit" {
            // transformers' default (0, inf) clamps nothing.
            let ok = value.as_array().is_some_and(|v| {
                v.len() == 2
                    && v[0].as_f64() == Some(0.0)
                    && (v[1].is_null()
                        || v[1].as_str() == Some("Infinity")
                        || v[1].as_f64().is_some_and(f64::is_infinite))
            });
            if !ok {
                return Err(field_error(
                    name,
                    format!(
                        "is {value}: hybridgen does not clamp Mamba's time step; only (0, inf) imports"
                    ),
                ));
            }
            continue;
        }
        check_fixed_field(name, value, required(name), origin)?;
    }
    let usize_field = |names: &[&str]| -> Result<Option<usize>> {
        for name in names {
            if let Some(v) = c.get(*name) {
                if v.is_null() {
                    continue;
                }
                return v
                    .as_u64()
                    .filter(|&n| n > 0 && n <= hybridgen_dsl::config::MAX_DIMENSION as u64)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| {
                        field_error(name, format!("is {v}, not a positive whole number"))
                    });
            }
        }
        Ok(None)
    };
    let need = |names: &[&str], why: &str| -> Result<usize> {
        usize_field(names)?.ok_or_else(|| field_error(names[0], format!("is missing; {why}")))
    };
    let decoder =
        kinds_of(c, "hybrid_override_pattern", "layers_block_type", origin)?.ok_or_else(|| {
            field_error(
                "hybrid_override_pattern",
                "is missing (nor is there `layers_block_type`): the layers are unknown".into(),
            )
        })?;
    if let Some(n) = usize_field(&["num_hidden_layers"])?
        && n != decoder.len()
    {
        return Err(field_error(
            "num_hidden_layers",
            format!("is {n}, but the layer pattern has {} layers", decoder.len()),
        ));
    }
    let depths = c
        .get("num_nextn_predict_layers")
        .map(|v| {
            v.as_u64().ok_or_else(|| {
                field_error(
                    "num_nextn_predict_layers",
                    format!("is {v}, not a whole number"),
                )
            })
        })
        .transpose()?
        .unwrap_or(0);
    if depths > MAX_MTP_DEPTHS {
        return Err(field_error(
            "num_nextn_predict_layers",
            format!("is {depths}: more than {MAX_MTP_DEPTHS} MTP depths is no model"),
        ));
    }
    let depths = depths as usize;
    let mtp = if depths > 0 {
        kinds_of(
            c,
            "mtp_hybrid_override_pattern",
            "mtp_layers_block_type",
            origin,
        )?
        .unwrap_or_else(|| vec![LayerKind::Attention, LayerKind::Moe])
    } else {
        Vec::new()
    };
    let mut pattern = symbols(&decoder);
    for _ in 0..depths {
        pattern.push('/');
        pattern.push_str(&symbols(&mtp));
    }
    let used: Vec<LayerKind> = decoder.iter().chain(&mtp).copied().collect();
    let uses = |k: LayerKind| used.contains(&k);
    let vocab = need(&["vocab_size"], "the embedding size is unknown")?;
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
    let max_positions = usize_field(&["max_position_embeddings"])?;
    let mut model = ModelConfig {
        pattern,
        hidden_size: need(&["hidden_size"], "the model's width is unknown")?,
        vocab_size: vocab,
        tie_embeddings: tie_embeddings(c, origin)?,
        init_std: init_std(c),
        // hybridgen's training length, not a limit of the model: the
        // default, or the model's own limit when shorter.
        seq_length: max_positions.map_or(4096, |m| m.min(4096)),
        attention: None,
        mla: None,
        dsa: None,
        gdn: None,
        mamba: None,
        mlp: None,
        moe: None,
        mtp: MtpConfig::default(),
    };
    let with =
        |why: &str, kind: LayerKind| format!("the pattern has {} layers {why}", kind_name(kind));
    if uses(LayerKind::Attention) {
        let why = with("and they need it", LayerKind::Attention);
        let heads = need(&["num_attention_heads"], &why)?;
        model.attention = Some(AttentionConfig {
            num_heads: heads,
            num_kv_groups: usize_field(&["num_key_value_heads"])?.unwrap_or(heads),
            head_dim: usize_field(&["head_dim", "attention_head_dim"])?,
            qk_norm: false,
            position: Position::None,
            rope_base: 10_000.0,
        });
    }
    if uses(LayerKind::Mamba) {
        let why = with("and they need it", LayerKind::Mamba);
        model.mamba = Some(MambaConfig {
            num_heads: need(&["mamba_num_heads"], &why)?,
            head_dim: need(&["mamba_head_dim"], &why)?,
            num_groups: need(&["n_groups", "mamba_n_groups"], &why)?,
            state_size: need(&["ssm_state_size"], &why)?,
            conv_kernel: usize_field(&["conv_kernel", "mamba_d_conv"])?.unwrap_or(4),
            inner_size: None,
            chunk_size: usize_field(&["chunk_size", "mamba_chunk_size"])?.unwrap_or(128),
        });
    }
    if uses(LayerKind::Mlp) {
        let why = with("and they need it", LayerKind::Mlp);
        model.mlp = Some(MlpConfig {
            ffn_hidden_size: need(&["intermediate_size"], &why)?,
            activation: Activation::SquaredRelu,
        });
    }
    if uses(LayerKind::Moe) {
        let why = with("and they need it", LayerKind::Moe);
        let top_k = need(&["num_experts_per_tok"], &why)?;
        let shared = usize_field(&["n_shared_experts"])?.unwrap_or(1);
        if shared != 1 {
            return Err(field_error(
                "n_shared_experts",
                format!("is {shared}: transformers' NemotronHMoE has exactly one shared expert"),
            ));
        }
        let normalised = c
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        if normalised != (top_k > 1) {
            return Err(field_error(
                "norm_topk_prob",
                format!(
                    "is {normalised} with top-k {top_k}: hybridgen (as Megatron) normalises the selected \
                     sigmoid scores exactly when top-k > 1"
                ),
            ));
        }
        let scaling = match c.get("routed_scaling_factor") {
            None | Some(Value::Null) => 1.0,
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite() && *f > 0.0 && *f <= f64::from(f32::MAX))
                .map(|f| f as f32)
                .ok_or_else(|| {
                    field_error(
                        "routed_scaling_factor",
                        format!("is {v}: the routed weights' scale must be a number above 0"),
                    )
                })?,
        };
        model.moe = Some(MoeConfig {
            num_experts: need(&["n_routed_experts"], &why)?,
            top_k,
            ffn_hidden_size: need(&["moe_intermediate_size"], &why)?,
            shared_expert_ffn_hidden_size: Some(need(
                &["moe_shared_expert_intermediate_size"],
                &why,
            )?),
            activation: Activation::SquaredRelu,
            score_function: ScoreFunction::Sigmoid,
            aux_loss_coeff: 1e-2,
            topk_scaling_factor: scaling,
            // Nemotron-H balances with the router's correction bias.
            expert_bias: true,
            expert_bias_update_rate: 1e-3,
        });
    }
    let parsed = Pattern::parse(&model.pattern).map_err(|_| {
        refuse(format!(
            "{origin}: the layer pattern `{}` does not parse",
            model.pattern
        ))
    })?;
    let problems = model.check(&parsed);
    if let Some(first) = problems.first() {
        return Err(refuse(format!(
            "{origin}: the dimensions do not make a model: {}",
            first.message
        )));
    }
    Ok(model)
}

/// A layer list from `pattern_field` (a string of `M*-E`) or `list_field`
/// (transformers' names), whichever is present.
fn kinds_of(
    c: &Map<String, Value>,
    pattern_field: &str,
    list_field: &str,
    origin: &str,
) -> Result<Option<Vec<LayerKind>>> {
    if let Some(v) = c.get(pattern_field).filter(|v| !v.is_null()) {
        let text = v
            .as_str()
            .ok_or_else(|| refuse(format!("{origin}: `{pattern_field}` is {v}, not a string")))?;
        return text
            .chars()
            .enumerate()
            .map(|(i, ch)| {
                LayerKind::ALL
                    .into_iter()
                    .find(|k| k.symbol() == ch)
                    .ok_or_else(|| {
                        refuse(format!(
                            "{origin}: `{pattern_field}` has `{ch}` at {i}, not one of M * - E"
                        ))
                    })
                    .and_then(|k| {
                        check_kind(k, &format!("{origin}: `{pattern_field}` layer {i}")).map(|()| k)
                    })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some);
    }
    let Some(v) = c.get(list_field).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let items = v
        .as_array()
        .ok_or_else(|| refuse(format!("{origin}: `{list_field}` is {v}, not a list")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let name = item.as_str().unwrap_or_default();
            // transformers renamed `mamba`/`attention` to these; both load.
            let name = match name {
                "linear_attention" => "mamba",
                "full_attention" => "attention",
                other => other,
            };
            HF_KINDS
                .iter()
                .find(|(_, n)| *n == name)
                .map(|(k, _)| *k)
                .ok_or_else(|| refuse(format!("{origin}: `{list_field}` item {i} is {item}, not one of mamba, attention, mlp, moe")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nemotron_h() -> Value {
        json!({
            "model_type": "nemotron_h",
            "hybrid_override_pattern": "M*-",
            "hidden_size": 64,
            "vocab_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_head_dim": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 16,
            "intermediate_size": 128,
            "rms_norm_eps": 1e-5,
            "time_step_limit": [0.0, "Infinity"],
        })
    }

    #[test]
    fn older_spellings_and_pythons_infinity_import() {
        let model = from_hf_config(&nemotron_h(), "c").unwrap();
        assert_eq!(model.attention_head_dim(), Some(16));
        assert_eq!(model.pattern, "M*-");
    }

    #[test]
    fn a_clamped_time_step_is_refused_by_name() {
        let mut c = nemotron_h();
        c["time_step_limit"] = json!([0.0, 0.1]);
        let err = from_hf_config(&c, "c").unwrap_err().to_string();
        assert!(err.contains("`time_step_limit` is [0.0,0.1]"), "{err}");
    }

    #[test]
    fn an_export_reads_back_as_the_same_model() {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = "M*-E/*E".into();
        model.attention.as_mut().unwrap().position = Position::None;
        let moe = model.moe.as_mut().unwrap();
        moe.score_function = ScoreFunction::Sigmoid;
        moe.expert_bias = true;
        let (config, _) = to_hf_config(&model, HfDtype::F32).unwrap();
        let back = from_hf_config(&config, "c").unwrap();
        // Sections the pattern does not use are not exported.
        model.mla = None;
        model.dsa = None;
        model.gdn = None;
        assert_eq!(back, model);
    }
}

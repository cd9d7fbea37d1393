//! Model dimensions: one section per layer kind (docs/layers.md),
//! read from TOML model files or taken from a built-in preset.

use crate::diagnostic::{Code, Diagnostic};
use crate::pattern::LayerKind;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A model: its pattern and the dimensions of every layer kind it uses.
///
/// A model file is this struct in TOML:
///
/// ```toml
/// pattern = "M[*E]M[*E]"
/// hidden_size = 64
/// vocab_size = 256
///
/// [attention]
/// num_heads = 4
/// num_kv_groups = 2
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The layer pattern (pattern.md), sugar allowed.
    pub pattern: String,
    /// h.
    pub hidden_size: usize,
    /// V before padding; the embedding has `padded_vocab_size()` rows.
    pub vocab_size: usize,
    /// Share the input embedding with the output layer (no `output_layer.weight`).
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Standard deviation of the normal initialisation (layers.md).
    #[serde(default = "default_init_std")]
    pub init_std: f32,
    /// Tokens per sequence used for activation sizes and by `train`.
    #[serde(default = "default_seq_length")]
    pub seq_length: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsa: Option<DsaConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gdn: Option<GdnConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mamba: Option<MambaConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp: Option<MlpConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    #[serde(default)]
    pub mtp: MtpConfig,
}

/// `*`: grouped-query attention.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionConfig {
    /// a.
    pub num_heads: usize,
    /// g: key/value groups (g = a is multi-head attention, g = 1 multi-query).
    pub num_kv_groups: usize,
    /// c; defaults to h / a.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// RMSNorm on each query and key head.
    #[serde(default)]
    pub qk_norm: bool,
    #[serde(default)]
    pub position: Position,
    #[serde(default = "default_rope_base")]
    pub rope_base: f32,
}

/// Position information in attention. Nemotron-H and Megatron's hybrid
/// default use none: the Mamba layers carry order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Position {
    #[default]
    None,
    Rope,
}

/// `+` (and the MLA part of `D`): multi-latent attention.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaConfig {
    /// a.
    pub num_heads: usize,
    /// qr; without it queries are projected directly from the hidden state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_lora_rank: Option<usize>,
    /// kr.
    pub kv_lora_rank: usize,
    /// dn.
    pub qk_head_dim: usize,
    /// dr.
    pub qk_rope_head_dim: usize,
    /// dv.
    pub v_head_dim: usize,
    /// RMSNorm on the compressed query and key/value (the LoRA norms).
    #[serde(default = "yes")]
    pub qk_norm: bool,
    #[serde(default = "default_rope_base")]
    pub rope_base: f32,
}

/// `D`: the DSA indexer; the rest of the layer takes `[mla]`'s dimensions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DsaConfig {
    /// ni.
    pub index_heads: usize,
    /// di.
    pub index_head_dim: usize,
    /// Keys each query attends to.
    pub index_topk: usize,
    /// The indexer's KL loss coefficient (Megatron's
    /// `dsa_indexer_loss_coeff`; unset there, which is 0: no indexer loss,
    /// and the indexer does not train).
    #[serde(default)]
    pub indexer_loss_coeff: f32,
    /// The indexer loss over the selected keys only, instead of every causal
    /// key (Megatron's `dsa_indexer_use_sparse_loss`, off by default).
    #[serde(default)]
    pub indexer_sparse_loss: bool,
}

/// `G`: gated delta net.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GdnConfig {
    /// Hk.
    pub key_heads: usize,
    /// Hv.
    pub value_heads: usize,
    /// dk.
    pub key_head_dim: usize,
    /// dv'.
    pub value_head_dim: usize,
    /// kg.
    #[serde(default = "default_conv_kernel")]
    pub conv_kernel: usize,
}

/// `M`: Mamba-2.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MambaConfig {
    /// H.
    pub num_heads: usize,
    /// P.
    pub head_dim: usize,
    /// G.
    pub num_groups: usize,
    /// N.
    pub state_size: usize,
    #[serde(default = "default_conv_kernel")]
    pub conv_kernel: usize,
    /// d_in, when a config states it: must equal H x P.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inner_size: Option<usize>,
    /// Chunk length of the chunked (SSD) scan; any value gives the same maths.
    #[serde(default = "default_chunk_size")]
    pub chunk_size: usize,
}

/// `-`: dense MLP.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlpConfig {
    /// F.
    pub ffn_hidden_size: usize,
    #[serde(default)]
    pub activation: Activation,
}

/// `E`: mixture of experts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    /// E.
    pub num_experts: usize,
    pub top_k: usize,
    /// Fe.
    pub ffn_hidden_size: usize,
    /// Fs: one shared expert of this width, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_ffn_hidden_size: Option<usize>,
    #[serde(default)]
    pub activation: Activation,
    #[serde(default)]
    pub score_function: ScoreFunction,
    /// Switch-style load-balancing loss coefficient; 0 disables it.
    #[serde(default = "default_aux_loss_coeff")]
    pub aux_loss_coeff: f32,
    /// The factor on the routing weights after their normalisation
    /// (Megatron's `moe_router_topk_scaling_factor`, Hugging Face's
    /// `routed_scaling_factor`); 1 leaves them as they are.
    #[serde(default = "one")]
    pub topk_scaling_factor: f32,
    /// Aux-loss-free balancing: an f32 per-expert bias added to the scores
    /// for selection only (a buffer, never a parameter), moved after every
    /// step by `expert_bias_update_rate` towards the mean load. Sigmoid
    /// scoring only, as in Megatron.
    #[serde(default)]
    pub expert_bias: bool,
    /// The bias's step (Megatron's `moe_router_bias_update_rate`).
    #[serde(default = "default_expert_bias_update_rate")]
    pub expert_bias_update_rate: f32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// relu(x)^2, as Nemotron-H (u = 1).
    #[default]
    SquaredRelu,
    Gelu,
    /// silu(gate) * up (u = 2).
    Swiglu,
}

impl Activation {
    /// u: rows of fc1 per hidden unit.
    pub const fn fc1_factor(self) -> usize {
        match self {
            Activation::Swiglu => 2,
            _ => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoreFunction {
    #[default]
    Softmax,
    Sigmoid,
}

/// Multi-token prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MtpConfig {
    /// Factor on the depth-averaged MTP loss.
    #[serde(default = "default_mtp_loss_scale")]
    pub loss_scale: f32,
}

impl Default for MtpConfig {
    fn default() -> Self {
        MtpConfig {
            loss_scale: default_mtp_loss_scale(),
        }
    }
}

fn default_init_std() -> f32 {
    0.02
}
fn default_seq_length() -> usize {
    4096
}
fn default_rope_base() -> f32 {
    10_000.0
}
fn default_conv_kernel() -> usize {
    4
}
fn default_chunk_size() -> usize {
    128
}
fn default_aux_loss_coeff() -> f32 {
    1e-2
}
fn default_mtp_loss_scale() -> f32 {
    0.1
}
fn default_expert_bias_update_rate() -> f32 {
    1e-3
}
fn one() -> f32 {
    1.0
}
fn yes() -> bool {
    true
}

/// Reading a model file failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read model file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A directory, FIFO, device or socket: reading one could block forever
    /// (a FIFO) or never end (`/dev/zero`).
    #[error("cannot read model file {path}: it is {kind}, not a regular file")]
    NotAFile { path: String, kind: &'static str },
    #[error(
        "cannot read model file {path}: it is larger than the limit of {limit} bytes; a model file is a short TOML text"
    )]
    TooLarge { path: String, limit: u64 },
    #[error("model file {path} is not a valid model:\n{message}")]
    Toml { path: String, message: String },
    #[error("unknown preset `{0}`; the presets are: {presets}", presets = PRESET_NAMES.join(", "))]
    UnknownPreset(String),
}

/// The largest dimension (hidden size, heads, widths, vocabulary...) a
/// model may have; with it, no shape arithmetic can overflow.
pub const MAX_DIMENSION: usize = 1 << 24;
/// The most experts a MoE layer may have.
pub const MAX_EXPERTS: usize = 1 << 16;
/// The most elements a whole model may have.
pub const MAX_MODEL_ELEMENTS: u128 = 1 << 53;

/// The largest model file read, in bytes (16 MiB): far more than a model
/// needs (a pattern has at most
/// [`MAX_PATTERN_BYTES`](crate::pattern::MAX_PATTERN_BYTES)), and little
/// enough to read at once.
pub const MAX_MODEL_FILE_BYTES: u64 = 16 << 20;

/// The text of the regular file at `path`, if it has at most `limit` bytes.
/// The file's type is checked before it is opened: opening a FIFO for
/// reading blocks until a writer appears.
fn read_text(path: &Path, limit: u64) -> Result<String, ConfigError> {
    use std::io::Read;
    let shown = || path.display().to_string();
    let io = |source| ConfigError::Io {
        path: shown(),
        source,
    };
    let not_a_file = |kind| ConfigError::NotAFile {
        path: shown(),
        kind,
    };
    if let Some(kind) = file_kind(&std::fs::metadata(path).map_err(io)?) {
        return Err(not_a_file(kind));
    }
    let file = std::fs::File::open(path).map_err(io)?;
    // Checked again on what was opened, in case the path changed since.
    if let Some(kind) = file_kind(&file.metadata().map_err(io)?) {
        return Err(not_a_file(kind));
    }
    // Read to one byte past the limit, not to the end: the size the
    // metadata gave may have changed since.
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(ConfigError::TooLarge {
            path: shown(),
            limit,
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "it is not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        ))
    })
}

/// What a path that is not a regular file is, in words; `None` for a
/// regular file.
fn file_kind(metadata: &std::fs::Metadata) -> Option<&'static str> {
    let kind = metadata.file_type();
    if kind.is_file() {
        return None;
    }
    if kind.is_dir() {
        return Some("a directory");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if kind.is_char_device() {
            return Some("a character device");
        }
        if kind.is_block_device() {
            return Some("a block device");
        }
        if kind.is_socket() {
            return Some("a socket");
        }
    }
    Some("a special file")
}

/// The TOML parser's message with every line cut to a few hundred
/// characters: it quotes the offending line, which may be megabytes long.
fn shorten_lines(message: &str) -> String {
    message
        .split('\n')
        .map(|line| crate::diagnostic::shorten(line, 200))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Built-in presets, by name.
pub const PRESET_NAMES: [&str; 6] = [
    "tiny",
    "tiny-gdn",
    "tiny-dsa",
    "nemotron-nano-9b-v2",
    "nemotron-3-nano-30b-a3b",
    "bench-hybrid-moe",
];

const TINY: &str = include_str!("../presets/tiny.toml");
const TINY_GDN: &str = include_str!("../presets/tiny-gdn.toml");
const TINY_DSA: &str = include_str!("../presets/tiny-dsa.toml");
const NEMOTRON_NANO_9B_V2: &str = include_str!("../presets/nemotron-nano-9b-v2.toml");
const NEMOTRON_3_NANO_30B_A3B: &str = include_str!("../presets/nemotron-3-nano-30b-a3b.toml");
const BENCH_HYBRID_MOE: &str = include_str!("../presets/bench-hybrid-moe.toml");

impl ModelConfig {
    /// A built-in preset. The presets are TOML files shipped with the crate, so
    /// a user can copy one as the start of a model file.
    pub fn preset(name: &str) -> Result<ModelConfig, ConfigError> {
        let text = ModelConfig::preset_source(name)
            .ok_or_else(|| ConfigError::UnknownPreset(name.to_string()))?;
        ModelConfig::from_toml(text, &format!("<preset {name}>"))
    }

    /// The TOML text of a built-in preset.
    pub fn preset_source(name: &str) -> Option<&'static str> {
        match name {
            "tiny" => Some(TINY),
            "tiny-gdn" => Some(TINY_GDN),
            "tiny-dsa" => Some(TINY_DSA),
            "nemotron-nano-9b-v2" => Some(NEMOTRON_NANO_9B_V2),
            "nemotron-3-nano-30b-a3b" => Some(NEMOTRON_3_NANO_30B_A3B),
            "bench-hybrid-moe" => Some(BENCH_HYBRID_MOE),
            _ => None,
        }
    }

    /// Parses a model from TOML; `origin` names the text in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<ModelConfig, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Toml {
            path: origin.to_string(),
            message: shorten_lines(&e.to_string()),
        })
    }

    /// Reads a model file: a regular file of at most [`MAX_MODEL_FILE_BYTES`].
    /// Anything else is refused before it is read, so a FIFO cannot block
    /// and `/dev/zero` cannot fill the memory.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ConfigError> {
        let text = read_text(path, MAX_MODEL_FILE_BYTES)?;
        ModelConfig::from_toml(&text, &path.display().to_string())
    }

    /// V rounded up to a multiple of 128.
    pub fn padded_vocab_size(&self) -> usize {
        self.vocab_size.div_ceil(128).saturating_mul(128)
    }

    /// c for `*` layers.
    pub fn attention_head_dim(&self) -> Option<usize> {
        let a = self.attention.as_ref()?;
        a.head_dim
            .or_else(|| self.hidden_size.checked_div(a.num_heads))
    }

    /// Whether the config has the section a layer kind needs.
    pub fn has_dimensions_for(&self, kind: LayerKind) -> bool {
        match kind {
            LayerKind::Mamba => self.mamba.is_some(),
            LayerKind::Attention => self.attention.is_some(),
            LayerKind::Mla => self.mla.is_some(),
            LayerKind::Dsa => self.mla.is_some() && self.dsa.is_some(),
            LayerKind::GatedDeltaNet => self.gdn.is_some(),
            LayerKind::Mlp => self.mlp.is_some(),
            LayerKind::Moe => self.moe.is_some(),
        }
    }

    /// Every size field present, by its TOML name.
    fn sizes(&self) -> Vec<(&'static str, usize)> {
        let mut sizes = vec![
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("seq_length", self.seq_length),
        ];
        if let Some(a) = &self.attention {
            sizes.extend([
                ("attention.num_heads", a.num_heads),
                ("attention.num_kv_groups", a.num_kv_groups),
            ]);
            sizes.extend(a.head_dim.map(|d| ("attention.head_dim", d)));
        }
        if let Some(m) = &self.mla {
            sizes.extend([
                ("mla.num_heads", m.num_heads),
                ("mla.kv_lora_rank", m.kv_lora_rank),
                ("mla.qk_head_dim", m.qk_head_dim),
                ("mla.qk_rope_head_dim", m.qk_rope_head_dim),
                ("mla.v_head_dim", m.v_head_dim),
            ]);
            sizes.extend(m.q_lora_rank.map(|r| ("mla.q_lora_rank", r)));
        }
        if let Some(d) = &self.dsa {
            sizes.extend([
                ("dsa.index_heads", d.index_heads),
                ("dsa.index_head_dim", d.index_head_dim),
                ("dsa.index_topk", d.index_topk),
            ]);
        }
        if let Some(g) = &self.gdn {
            sizes.extend([
                ("gdn.key_heads", g.key_heads),
                ("gdn.value_heads", g.value_heads),
                ("gdn.key_head_dim", g.key_head_dim),
                ("gdn.value_head_dim", g.value_head_dim),
                ("gdn.conv_kernel", g.conv_kernel),
            ]);
        }
        if let Some(m) = &self.mamba {
            sizes.extend([
                ("mamba.num_heads", m.num_heads),
                ("mamba.head_dim", m.head_dim),
                ("mamba.num_groups", m.num_groups),
                ("mamba.state_size", m.state_size),
                ("mamba.conv_kernel", m.conv_kernel),
                ("mamba.chunk_size", m.chunk_size),
            ]);
            sizes.extend(m.inner_size.map(|d| ("mamba.inner_size", d)));
        }
        if let Some(m) = &self.mlp {
            sizes.push(("mlp.ffn_hidden_size", m.ffn_hidden_size));
        }
        if let Some(m) = &self.moe {
            sizes.extend([
                ("moe.top_k", m.top_k),
                ("moe.ffn_hidden_size", m.ffn_hidden_size),
            ]);
            sizes.extend(
                m.shared_expert_ffn_hidden_size
                    .map(|f| ("moe.shared_expert_ffn_hidden_size", f)),
            );
        }
        sizes
    }

    /// Sizes beyond any real model, which would overflow the planner's
    /// arithmetic (a typo like `hidden_size = 40960000000`).
    pub(crate) fn check_limits(&self, out: &mut Vec<Diagnostic>) {
        for (name, value) in self.sizes() {
            if value > MAX_DIMENSION {
                out.push(
                    Diagnostic::new(
                        Code::H025,
                        format!("`{name} = {value}` is over the limit of {MAX_DIMENSION}"),
                    )
                    .help("every dimension is at most 2^24; is there a typo?"),
                );
            }
        }
        if let Some(m) = &self.moe
            && m.num_experts > MAX_EXPERTS
        {
            out.push(
                Diagnostic::new(
                    Code::H025,
                    format!(
                        "`moe.num_experts = {}` is over the limit of {MAX_EXPERTS}",
                        m.num_experts
                    ),
                )
                .help("a MoE layer has at most 65536 experts; is there a typo?"),
            );
        }
    }

    pub(crate) fn check_dimensions(&self, out: &mut Vec<Diagnostic>) {
        let mut bad = |message: String, help: &str| {
            out.push(Diagnostic::new(Code::H025, message).help(help));
        };
        let positive = |name: &str, value: usize, bad: &mut dyn FnMut(String, &str)| {
            if value == 0 {
                bad(format!("`{name}` is 0"), "every size must be at least 1");
            }
        };
        positive("hidden_size", self.hidden_size, &mut bad);
        positive("vocab_size", self.vocab_size, &mut bad);
        positive("seq_length", self.seq_length, &mut bad);
        if let Some(a) = &self.attention {
            positive("attention.num_heads", a.num_heads, &mut bad);
            positive("attention.num_kv_groups", a.num_kv_groups, &mut bad);
            if a.num_kv_groups > 0 && a.num_heads % a.num_kv_groups != 0 {
                bad(
                    format!(
                        "`attention.num_kv_groups = {}` does not divide `attention.num_heads = {}`",
                        a.num_kv_groups, a.num_heads
                    ),
                    "each KV group serves a whole number of query heads: pick a divisor of num_heads",
                );
            }
            match a.head_dim {
                Some(0) => bad(
                    "`attention.head_dim` is 0".into(),
                    "every size must be at least 1",
                ),
                Some(_) => {}
                None if a.num_heads > 0 && !self.hidden_size.is_multiple_of(a.num_heads) => bad(
                    format!(
                        "`attention.num_heads = {}` does not divide `hidden_size = {}`",
                        a.num_heads, self.hidden_size
                    ),
                    "set `attention.head_dim` explicitly, or pick a head count that divides hidden_size",
                ),
                None => {}
            }
            if a.position == Position::Rope && self.attention_head_dim().is_some_and(|c| c % 2 != 0)
            {
                bad(
                    format!(
                        "rotary embeddings need an even head dim; attention head dim is {}",
                        self.attention_head_dim().unwrap_or(0)
                    ),
                    "use an even head_dim, or `position = \"none\"`",
                );
            }
        }
        if let Some(m) = &self.mla {
            positive("mla.num_heads", m.num_heads, &mut bad);
            positive("mla.kv_lora_rank", m.kv_lora_rank, &mut bad);
            positive("mla.qk_head_dim", m.qk_head_dim, &mut bad);
            positive("mla.qk_rope_head_dim", m.qk_rope_head_dim, &mut bad);
            positive("mla.v_head_dim", m.v_head_dim, &mut bad);
            if m.q_lora_rank == Some(0) {
                bad(
                    "`mla.q_lora_rank` is 0".into(),
                    "leave it out to project queries directly, or make it at least 1",
                );
            }
            if m.qk_rope_head_dim % 2 != 0 {
                bad(
                    format!("`mla.qk_rope_head_dim = {}` is odd", m.qk_rope_head_dim),
                    "rotary embeddings rotate pairs of channels: use an even size",
                );
            }
        }
        if let Some(d) = &self.dsa {
            positive("dsa.index_heads", d.index_heads, &mut bad);
            positive("dsa.index_head_dim", d.index_head_dim, &mut bad);
            positive("dsa.index_topk", d.index_topk, &mut bad);
            if !(d.indexer_loss_coeff.is_finite() && d.indexer_loss_coeff >= 0.0) {
                bad(
                    format!(
                        "`dsa.indexer_loss_coeff = {}` is not a finite number of at least 0",
                        d.indexer_loss_coeff
                    ),
                    "give 0 (no indexer loss) or a small positive coefficient such as 0.01",
                );
            }
            if let Some(m) = &self.mla
                && d.index_head_dim < m.qk_rope_head_dim
            {
                bad(
                    format!(
                        "`dsa.index_head_dim = {}` is below `mla.qk_rope_head_dim = {}`",
                        d.index_head_dim, m.qk_rope_head_dim
                    ),
                    "the indexer rotates its first qk_rope_head_dim channels: make \
                     index_head_dim at least that",
                );
            }
            if self.mla.as_ref().is_some_and(|m| m.q_lora_rank.is_none()) {
                bad(
                    "DSA needs `mla.q_lora_rank`: its indexer reads the compressed query".into(),
                    "set `q_lora_rank` in [mla]",
                );
            }
        }
        if let Some(g) = &self.gdn {
            positive("gdn.key_heads", g.key_heads, &mut bad);
            positive("gdn.value_heads", g.value_heads, &mut bad);
            positive("gdn.key_head_dim", g.key_head_dim, &mut bad);
            positive("gdn.value_head_dim", g.value_head_dim, &mut bad);
            positive("gdn.conv_kernel", g.conv_kernel, &mut bad);
            if g.key_heads > 0 && g.value_heads % g.key_heads != 0 {
                bad(
                    format!(
                        "`gdn.key_heads = {}` does not divide `gdn.value_heads = {}`",
                        g.key_heads, g.value_heads
                    ),
                    "each key head serves a whole number of value heads",
                );
            }
        }
        if let Some(m) = &self.mamba {
            positive("mamba.num_heads", m.num_heads, &mut bad);
            positive("mamba.head_dim", m.head_dim, &mut bad);
            positive("mamba.num_groups", m.num_groups, &mut bad);
            positive("mamba.state_size", m.state_size, &mut bad);
            positive("mamba.conv_kernel", m.conv_kernel, &mut bad);
            positive("mamba.chunk_size", m.chunk_size, &mut bad);
            if m.num_groups > 0 && m.num_heads % m.num_groups != 0 {
                bad(
                    format!(
                        "`mamba.num_groups = {}` does not divide `mamba.num_heads = {}`",
                        m.num_groups, m.num_heads
                    ),
                    "head i reads group i / (H/G): pick a divisor of num_heads",
                );
            }
            // H x P only when both are in range: an oversized factor is
            // reported once, by the limits check, not again as a product.
            let heads_times_dim = (m.num_heads <= MAX_DIMENSION && m.head_dim <= MAX_DIMENSION)
                .then(|| m.num_heads * m.head_dim);
            if let (Some(inner), Some(product)) = (m.inner_size, heads_times_dim)
                && inner != product
            {
                bad(
                    format!(
                        "`mamba.inner_size = {inner}` but num_heads x head_dim = {} x {} = {product}",
                        m.num_heads, m.head_dim,
                    ),
                    "d_in is H x P: drop inner_size, or make the three agree",
                );
            }
            if let Some(product) = heads_times_dim
                && m.num_groups > 0
                && product % m.num_groups != 0
            {
                bad(
                    format!(
                        "Mamba inner size {product} does not split into {} norm groups",
                        m.num_groups
                    ),
                    "the gated norm normalises d_in / G channels per group",
                );
            }
        }
        if let Some(m) = &self.mlp {
            positive("mlp.ffn_hidden_size", m.ffn_hidden_size, &mut bad);
        }
        if let Some(m) = &self.moe {
            positive("moe.num_experts", m.num_experts, &mut bad);
            positive("moe.top_k", m.top_k, &mut bad);
            positive("moe.ffn_hidden_size", m.ffn_hidden_size, &mut bad);
            if m.shared_expert_ffn_hidden_size == Some(0) {
                bad(
                    "`moe.shared_expert_ffn_hidden_size` is 0".into(),
                    "leave it out for no shared expert",
                );
            }
            if m.top_k > m.num_experts {
                bad(
                    format!(
                        "`moe.top_k = {}` is above `moe.num_experts = {}`",
                        m.top_k, m.num_experts
                    ),
                    "each token picks top_k distinct experts: use top_k <= num_experts",
                );
            }
            if m.expert_bias && m.score_function == ScoreFunction::Softmax {
                bad(
                    "`moe.expert_bias = true` with `moe.score_function = \"softmax\"`: the expert bias \
                     (aux-loss-free balancing) works on sigmoid scores only, as in Megatron"
                        .into(),
                    "set `score_function = \"sigmoid\"` in [moe], or drop `expert_bias`",
                );
            }
        }
        for real in self.reals() {
            if !real.range.contains(real.value) {
                bad(
                    format!(
                        "`{} = {}` is not {}",
                        real.name,
                        real.value,
                        real.range.describe()
                    ),
                    real.help,
                );
            }
        }
    }

    /// Every real-valued field present, with the range it must lie in.
    fn reals(&self) -> Vec<RealField> {
        let field = |name, value, range, help| RealField {
            name,
            value,
            range,
            help,
        };
        let mut reals = vec![field(
            "init_std",
            self.init_std,
            RealRange::Positive,
            "the standard deviation of the initial weights: use a small positive number such as 0.02",
        )];
        let rope = "rotary frequencies are base^(-2i/d), falling with i only for a base above 1: use e.g. 10000";
        if let Some(a) = &self.attention {
            reals.push(field(
                "attention.rope_base",
                a.rope_base,
                RealRange::AboveOne,
                rope,
            ));
        }
        if let Some(m) = &self.mla {
            reals.push(field(
                "mla.rope_base",
                m.rope_base,
                RealRange::AboveOne,
                rope,
            ));
        }
        if let Some(m) = &self.moe {
            reals.push(field(
                "moe.aux_loss_coeff",
                m.aux_loss_coeff,
                RealRange::NonNegative,
                "the load-balancing loss's weight: use 0 (off) or a small positive number such as 0.01",
            ));
            reals.push(field(
                "moe.topk_scaling_factor",
                m.topk_scaling_factor,
                RealRange::Positive,
                "the factor on the routing weights: 1 for none, 2.5 for Nemotron 3 Nano",
            ));
            reals.push(field(
                "moe.expert_bias_update_rate",
                m.expert_bias_update_rate,
                RealRange::NonNegative,
                "the expert bias's step per optimizer step: use a small number such as 0.001 (0 freezes the bias)",
            ));
        }
        reals.push(field(
            "mtp.loss_scale",
            self.mtp.loss_scale,
            RealRange::NonNegative,
            "the weight of the multi-token-prediction loss: use 0 (off) or a number such as 0.1",
        ));
        reals
    }
}

/// One real-valued field of a model, for range checks.
struct RealField {
    /// The TOML name (`attention.rope_base`).
    name: &'static str,
    value: f32,
    range: RealRange,
    help: &'static str,
}

/// Where a real-valued field may lie. Every range is of finite numbers:
/// TOML can write `nan` and `inf`, and either would poison training.
#[derive(Clone, Copy)]
enum RealRange {
    /// Above 0.
    Positive,
    /// 0 or above.
    NonNegative,
    /// Above 1.
    AboveOne,
}

impl RealRange {
    fn contains(self, value: f32) -> bool {
        value.is_finite()
            && match self {
                RealRange::Positive => value > 0.0,
                RealRange::NonNegative => value >= 0.0,
                RealRange::AboveOne => value > 1.0,
            }
    }

    fn describe(self) -> &'static str {
        match self {
            RealRange::Positive => "a finite number above 0",
            RealRange::NonNegative => "a finite number of at least 0",
            RealRange::AboveOne => "a finite number above 1",
        }
    }
}

/// The TOML section holding a kind's dimensions.
pub fn kind_section(kind: LayerKind) -> &'static str {
    match kind {
        LayerKind::Mamba => "[mamba]",
        LayerKind::Attention => "[attention]",
        LayerKind::Mla => "[mla]",
        LayerKind::Dsa => "[dsa]",
        LayerKind::GatedDeltaNet => "[gdn]",
        LayerKind::Mlp => "[mlp]",
        LayerKind::Moe => "[moe]",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_read_up_to_the_limit_and_not_past_it() {
        let dir = std::env::temp_dir().join(format!("hybridgen-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.toml");
        std::fs::write(&path, "0123456789").unwrap();
        assert_eq!(read_text(&path, 10).unwrap(), "0123456789");
        let e = read_text(&path, 9).unwrap_err();
        assert!(matches!(e, ConfigError::TooLarge { limit: 9, .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

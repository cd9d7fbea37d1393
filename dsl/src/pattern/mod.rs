//! The pattern language: symbols, the syntax tree (with byte spans), the
//! canonical printer, and the entry point [`Pattern::parse`].
//!
//! A [`Pattern`] is always valid: parsing either yields one or reports every
//! independent mistake of the input as [`Diagnostics`].

mod lower;
mod rules;

use crate::diagnostic::Diagnostics;
use crate::span::Span;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The seven layer kinds a pattern can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LayerKind {
    /// `M`: Mamba-2 mixer.
    Mamba,
    /// `*`: self-attention (GQA).
    Attention,
    /// `+`: multi-latent attention.
    Mla,
    /// `D`: DeepSeek sparse attention (MLA + indexer).
    Dsa,
    /// `G`: gated delta net.
    GatedDeltaNet,
    /// `-`: dense MLP.
    Mlp,
    /// `E`: mixture of experts.
    Moe,
}

/// The prefix under which a layer kind publishes its checkpoint keys. Members
/// of one group share `decoder.layers.L.`, so two members of one namespace
/// would collide (H008).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Namespace {
    Mixer,
    SelfAttention,
    Mlp,
}

impl LayerKind {
    pub const ALL: [LayerKind; 7] = [
        LayerKind::Mamba,
        LayerKind::Attention,
        LayerKind::Mla,
        LayerKind::Dsa,
        LayerKind::GatedDeltaNet,
        LayerKind::Mlp,
        LayerKind::Moe,
    ];

    pub const fn symbol(self) -> char {
        match self {
            LayerKind::Mamba => 'M',
            LayerKind::Attention => '*',
            LayerKind::Mla => '+',
            LayerKind::Dsa => 'D',
            LayerKind::GatedDeltaNet => 'G',
            LayerKind::Mlp => '-',
            LayerKind::Moe => 'E',
        }
    }

    pub const fn from_symbol(symbol: char) -> Option<LayerKind> {
        Some(match symbol {
            'M' => LayerKind::Mamba,
            '*' => LayerKind::Attention,
            '+' => LayerKind::Mla,
            'D' => LayerKind::Dsa,
            'G' => LayerKind::GatedDeltaNet,
            '-' => LayerKind::Mlp,
            'E' => LayerKind::Moe,
            _ => return None,
        })
    }

    /// What the layer is, in words.
    pub const fn name(self) -> &'static str {
        match self {
            LayerKind::Mamba => "Mamba-2 mixer",
            LayerKind::Attention => "self-attention (GQA)",
            LayerKind::Mla => "multi-latent attention",
            LayerKind::Dsa => "DeepSeek sparse attention",
            LayerKind::GatedDeltaNet => "gated delta net",
            LayerKind::Mlp => "dense MLP",
            LayerKind::Moe => "mixture of experts",
        }
    }

    /// A Rust-identifier-friendly name (`mamba`, `attention`, ...), used for
    /// generated field names and config sections.
    pub const fn ident(self) -> &'static str {
        match self {
            LayerKind::Mamba => "mamba",
            LayerKind::Attention => "attention",
            LayerKind::Mla => "mla",
            LayerKind::Dsa => "dsa",
            LayerKind::GatedDeltaNet => "gdn",
            LayerKind::Mlp => "mlp",
            LayerKind::Moe => "moe",
        }
    }

    /// `-` and `E` end a logical layer in the overlap schedule (the mlp slot);
    /// everything else is pre-dispatch work.
    pub const fn is_terminal(self) -> bool {
        matches!(self, LayerKind::Mlp | LayerKind::Moe)
    }

    /// `* + D G`: the layers that publish under `self_attention.`.
    pub const fn is_attention_family(self) -> bool {
        matches!(
            self,
            LayerKind::Attention | LayerKind::Mla | LayerKind::Dsa | LayerKind::GatedDeltaNet
        )
    }

    pub const fn namespace(self) -> Namespace {
        match self {
            LayerKind::Mamba => Namespace::Mixer,
            LayerKind::Attention | LayerKind::Mla | LayerKind::Dsa | LayerKind::GatedDeltaNet => {
                Namespace::SelfAttention
            }
            LayerKind::Mlp | LayerKind::Moe => Namespace::Mlp,
        }
    }
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.symbol())
    }
}

/// One physical layer of the pattern, with the span of the symbol that wrote
/// it (for a repeated layer, the symbol inside the repeat).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layer {
    pub kind: LayerKind,
    pub span: Span,
}

/// `[...]`: consecutive layers built as one nested stack; one logical layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub members: Vec<Layer>,
    pub span: Span,
}

/// One logical layer of the main pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    Layer(Layer),
    Group(Group),
}

impl Item {
    pub fn layers(&self) -> &[Layer] {
        match self {
            Item::Layer(layer) => std::slice::from_ref(layer),
            Item::Group(group) => &group.members,
        }
    }

    pub fn span(&self) -> Span {
        match self {
            Item::Layer(layer) => layer.span,
            Item::Group(group) => group.span,
        }
    }

    pub fn is_group(&self) -> bool {
        matches!(self, Item::Group(_))
    }
}

/// The items between two `|` (or the whole main pattern without `|`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub items: Vec<Item>,
    pub span: Span,
}

/// One multi-token-prediction depth: a plain run of layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MtpDepth {
    pub layers: Vec<Layer>,
    pub span: Span,
}

/// A parsed, expanded, validated layer pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    /// The main pattern's segments; one segment when there is no `|`.
    pub segments: Vec<Segment>,
    /// MTP depths (all identical); empty when the pattern has no MTP.
    pub mtp_depths: Vec<MtpDepth>,
}

/// Repeats may write at most this many copies at once...
pub const MAX_REPEAT: usize = 100_000;
/// ...and a whole pattern may expand to at most this many layers, so sugar
/// like `(M{100000}){100000}` is an error rather than an out-of-memory.
pub const MAX_EXPANDED_LAYERS: usize = 1_000_000;
/// The longest pattern text, in bytes (1 MiB): far beyond any real
/// pattern (repeats write long ones; a million layers written out as `M*M*...`
/// fit). Reading costs time and memory per byte of text, a megabyte of
/// mistakes being a million errors, so longer text is refused before it is
/// read.
pub const MAX_PATTERN_BYTES: usize = 1 << 20;

impl Pattern {
    /// Parses and validates a pattern, reporting every independent mistake.
    pub fn parse(source: &str) -> Result<Pattern, Diagnostics> {
        let lower::Lowered {
            pattern,
            diagnostics: syntax,
            lossy_depths,
        } = lower::lower(source);
        let rules = rules::check(&pattern, &lossy_depths);
        if syntax.is_empty() && rules.is_empty() {
            return Ok(pattern);
        }
        let (mut diagnostics, syntax_omitted) = syntax.into_parts();
        let (semantic, rules_omitted) = rules.into_parts();
        diagnostics.extend(semantic);
        // A repeat copies a mistake; report each culprit once.
        diagnostics.sort_by_key(|d| (d.span.map(|s| (s.start, s.end)), d.code));
        diagnostics.dedup_by(|a, b| a.code == b.code && a.span == b.span);
        let mut report = Diagnostics::new(source, "pattern", diagnostics);
        report.omitted += syntax_omitted + rules_omitted;
        Err(report)
    }

    /// Whether the main pattern has `|`.
    pub fn has_pipeline_segments(&self) -> bool {
        self.segments.len() > 1
    }

    /// The main pattern's items (logical layers) in order, across segments.
    pub fn items(&self) -> impl Iterator<Item = &Item> + '_ {
        self.segments.iter().flat_map(|s| s.items.iter())
    }

    /// The main pattern's physical layers in order.
    pub fn layers(&self) -> impl Iterator<Item = &Layer> + '_ {
        self.items().flat_map(Item::layers)
    }

    /// `num_layers`: symbols of the main pattern, groups counted member by member.
    pub fn physical_count(&self) -> usize {
        self.items().map(|item| item.layers().len()).sum()
    }

    /// Items of the main pattern: groups and ungrouped symbols.
    pub fn logical_count(&self) -> usize {
        self.segments.iter().map(|s| s.items.len()).sum()
    }

    pub fn mtp_depth_count(&self) -> usize {
        self.mtp_depths.len()
    }

    /// Every layer kind the pattern uses, MTP included, in symbol-table order.
    pub fn kinds(&self) -> Vec<LayerKind> {
        // One pass over the layers (not one per kind): planners call this on
        // patterns of 100,000 layers.
        let mut used = [false; LayerKind::ALL.len()];
        for layer in self
            .layers()
            .chain(self.mtp_depths.iter().flat_map(|d| &d.layers))
        {
            used[layer.kind as usize] = true;
        }
        LayerKind::ALL
            .into_iter()
            .filter(|&k| used[k as usize])
            .collect()
    }

    /// Whether any group appears in the main pattern (decides `final_layernorm`
    /// versus `final_norm` in checkpoint names).
    pub fn has_groups(&self) -> bool {
        self.items().any(Item::is_group)
    }

    /// The canonical form: plain Megatron syntax, no sugar, no white space.
    pub fn canonical(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, segment) in self.segments.iter().enumerate() {
            if i > 0 {
                f.write_str("|")?;
            }
            for item in &segment.items {
                match item {
                    Item::Layer(layer) => write!(f, "{}", layer.kind)?,
                    Item::Group(group) => {
                        f.write_str("[")?;
                        for member in &group.members {
                            write!(f, "{}", member.kind)?;
                        }
                        f.write_str("]")?;
                    }
                }
            }
        }
        for depth in &self.mtp_depths {
            f.write_str("/")?;
            for layer in &depth.layers {
                write!(f, "{}", layer.kind)?;
            }
        }
        Ok(())
    }
}

impl std::str::FromStr for Pattern {
    type Err = Diagnostics;

    fn from_str(source: &str) -> Result<Self, Self::Err> {
        Pattern::parse(source)
    }
}

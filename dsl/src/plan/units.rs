//! FSDP units: one filter decides (docs/fsdp.md).
//!
//! The filter is a single predicate over the module tree. It alone picks the
//! units, and the bucket layout is built from the units it picked, so hook
//! units and bucket units cannot disagree (Megatron issue #3793). A kind list
//! is shorthand, lowered to the same predicate.

use crate::diagnostic::{Code, Diagnostic};
use crate::pattern::LayerKind;
use serde::Serialize;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// What a module of the model tree is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModuleKind {
    Embedding,
    /// An ungrouped layer of the decoder, or a layer of an MTP depth.
    Layer,
    /// A `[...]` nested stack.
    Group,
    FinalNorm,
    MtpDepth,
    OutputLayer,
}

/// A module the filter is asked about.
#[derive(Clone, Copy, Debug)]
pub struct Module<'a> {
    /// State-dict path (`decoder.layers.3`, `mtp.layers.0`, `embedding`).
    pub path: &'a str,
    pub kind: ModuleKind,
    /// The layer kinds inside: one for a layer, the members for a group, the
    /// depth's layers for an MTP depth, none otherwise.
    pub layer_kinds: &'a [LayerKind],
}

/// One entry of the kind-list shorthand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum UnitKind {
    Layer(LayerKind),
    Group,
    Mtp,
}

impl UnitKind {
    /// `M`, `*`, ... `E`, `group` or `mtp`.
    pub fn parse(text: &str) -> Option<UnitKind> {
        match text.trim() {
            "group" => Some(UnitKind::Group),
            "mtp" => Some(UnitKind::Mtp),
            s => {
                let mut chars = s.chars();
                match (chars.next(), chars.next()) {
                    (Some(c), None) => LayerKind::from_symbol(c).map(UnitKind::Layer),
                    _ => None,
                }
            }
        }
    }
}

impl fmt::Display for UnitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnitKind::Layer(kind) => write!(f, "{kind}"),
            UnitKind::Group => f.write_str("group"),
            UnitKind::Mtp => f.write_str("mtp"),
        }
    }
}

type Predicate = dyn Fn(&Module<'_>) -> bool + Send + Sync;

/// Decides which modules are FSDP units. The planner walks the module tree
/// top-down and asks the filter about each candidate: a match becomes a unit
/// and its subtree is not asked (outermost match wins). The outer decoder
/// stack is never asked, and neither are a group's members: a group is one
/// nested stack, a unit as a whole or not at all.
#[derive(Clone)]
pub struct UnitFilter {
    predicate: Arc<Predicate>,
    description: String,
}

impl fmt::Debug for UnitFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnitFilter")
            .field("rule", &self.description)
            .finish()
    }
}

impl Default for UnitFilter {
    /// Every group, every ungrouped decoder layer and every MTP depth is one
    /// unit; embedding, final norm and output layer belong to none.
    fn default() -> Self {
        UnitFilter {
            predicate: Arc::new(|m: &Module<'_>| {
                matches!(
                    m.kind,
                    ModuleKind::Group | ModuleKind::Layer | ModuleKind::MtpDepth
                )
            }),
            description: "default: every group, ungrouped layer and MTP depth".to_string(),
        }
    }
}

impl UnitFilter {
    /// The shorthand: a layer is a unit when its kind is listed; a group when
    /// `group` or any member's kind is listed; an MTP depth when `mtp` is.
    pub fn kinds(kinds: &[UnitKind]) -> Self {
        let list = kinds.to_vec();
        let description = format!(
            "kinds: {}",
            kinds
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        );
        UnitFilter {
            predicate: Arc::new(move |m: &Module<'_>| {
                let listed = |k: &LayerKind| list.contains(&UnitKind::Layer(*k));
                match m.kind {
                    ModuleKind::Layer => m.layer_kinds.iter().any(listed),
                    ModuleKind::Group => {
                        list.contains(&UnitKind::Group) || m.layer_kinds.iter().any(listed)
                    }
                    ModuleKind::MtpDepth => list.contains(&UnitKind::Mtp),
                    _ => false,
                }
            }),
            description,
        }
    }

    /// Parses the shorthand as the command line writes it: `group,M,E`.
    /// An empty list selects nothing (everything is then non-unit).
    pub fn parse_kinds(text: &str) -> Result<Self, Diagnostic> {
        let mut kinds = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match UnitKind::parse(part) {
                Some(kind) => kinds.push(kind),
                None => {
                    return Err(Diagnostic::new(Code::H027, format!("`{part}` is not a unit kind"))
                        .help("unit kinds are the layer symbols M * + D G - E, `group` and `mtp`, separated by commas"));
                }
            }
        }
        Ok(UnitFilter::kinds(&kinds))
    }

    /// A custom predicate; `description` says what it selects, for reports.
    pub fn predicate(
        description: impl Into<String>,
        f: impl Fn(&Module<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        UnitFilter {
            predicate: Arc::new(f),
            description: description.into(),
        }
    }

    /// The one way to build a filter from optional user input: the default
    /// when neither is given, and an error when both are (H027).
    pub fn from_options(
        kinds: Option<&[UnitKind]>,
        predicate: Option<UnitFilter>,
    ) -> Result<Self, Diagnostic> {
        match (kinds, predicate) {
            (Some(_), Some(_)) => Err(Diagnostic::new(
                Code::H027,
                "both a unit kind list and a custom unit filter were given",
            )
            .help("a kind list is shorthand for a filter: give one or the other")),
            (Some(kinds), None) => Ok(UnitFilter::kinds(kinds)),
            (None, Some(filter)) => Ok(filter),
            (None, None) => Ok(UnitFilter::default()),
        }
    }

    pub fn is_unit(&self, module: &Module<'_>) -> bool {
        (self.predicate)(module)
    }

    pub fn description(&self) -> &str {
        &self.description
    }
}

/// What a unit is, as plans report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitShape {
    /// A `[...]` group.
    Group,
    /// One layer (of the decoder or of an MTP depth).
    Layer,
    /// A whole MTP depth.
    Mtp,
}

/// One FSDP unit: gathered before use, released after, reduced as one set of
/// buckets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FsdpUnit {
    pub index: usize,
    /// Module path (`decoder.layers.1`, `mtp.layers.0`).
    pub name: Cow<'static, str>,
    pub shape: UnitShape,
    /// Physical decoder layers in the unit (empty for MTP units).
    pub layers: Cow<'static, [usize]>,
    /// The MTP depth, for a unit inside one.
    pub mtp_depth: Option<usize>,
    /// Bucket ids, in issue order.
    pub buckets: Cow<'static, [usize]>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(kind: ModuleKind, kinds: &[LayerKind]) -> Module<'_> {
        Module {
            path: "x",
            kind,
            layer_kinds: kinds,
        }
    }

    #[test]
    fn kind_list_lowers_to_the_same_kind_of_filter() {
        let f = UnitFilter::parse_kinds("E, mtp").unwrap();
        assert!(f.is_unit(&module(ModuleKind::Layer, &[LayerKind::Moe])));
        assert!(!f.is_unit(&module(ModuleKind::Layer, &[LayerKind::Mamba])));
        assert!(f.is_unit(&module(
            ModuleKind::Group,
            &[LayerKind::Attention, LayerKind::Moe]
        )));
        assert!(!f.is_unit(&module(
            ModuleKind::Group,
            &[LayerKind::Attention, LayerKind::Mlp]
        )));
        assert!(f.is_unit(&module(ModuleKind::MtpDepth, &[])));
        assert!(!f.is_unit(&module(ModuleKind::Embedding, &[])));
    }

    #[test]
    fn kinds_and_predicate_together_are_an_error() {
        let custom = UnitFilter::predicate("groups", |m| m.kind == ModuleKind::Group);
        let err = UnitFilter::from_options(Some(&[UnitKind::Group]), Some(custom)).unwrap_err();
        assert_eq!(err.code, Code::H027);
        assert_eq!(
            UnitFilter::parse_kinds("group,Q").unwrap_err().code,
            Code::H027
        );
    }
}

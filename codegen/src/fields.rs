//! What the fields of a `model!` declaration mean: a typed schema of the
//! model file's keys (the same keys a TOML model file has, plus the layout
//! choices the static plan depends on), resolved over an optional preset.
//!
//! The declared values are merged into the preset's TOML table and the
//! result deserialized as a [`ModelConfig`], so the macro, model files and
//! the command line read dimensions through one code path. Every field
//! records its span, so later checks can point at the field they concern.

use crate::ast::{Field, ModelDecl, Value};
use crate::errors::Errors;
use hybridgen_dsl::config::ModelConfig;
use hybridgen_dsl::diagnostic::Code;
use hybridgen_dsl::plan::{DEFAULT_NON_UNIT_BUCKET_CAP, UnitKind};
use proc_macro2::Span;
use std::collections::HashMap;
use syn::{Lit, LitStr};

/// The type of a field's value.
#[derive(Clone, Copy)]
enum Kind {
    /// A whole number (`usize`).
    Int,
    /// A number (`f32`).
    Float,
    Bool,
    Str,
    /// One of a few words, written bare or as a string.
    Choice(&'static [&'static str]),
    /// A `{ ... }` section of its own fields.
    Section(&'static [Spec]),
}

/// One key of the schema.
struct Spec {
    name: &'static str,
    kind: Kind,
    /// Must be given when the preset does not give it.
    required: bool,
    /// Can be removed with `none` (an `Option` in [`ModelConfig`]).
    optional: bool,
    /// An example value, for error messages.
    example: &'static str,
}

const fn req(name: &'static str, kind: Kind, example: &'static str) -> Spec {
    Spec {
        name,
        kind,
        required: true,
        optional: false,
        example,
    }
}

const fn opt(name: &'static str, kind: Kind, example: &'static str) -> Spec {
    Spec {
        name,
        kind,
        required: false,
        optional: false,
        example,
    }
}

/// An `Option` field: absent by default, removable with `none`.
const fn maybe(name: &'static str, kind: Kind, example: &'static str) -> Spec {
    Spec {
        name,
        kind,
        required: false,
        optional: true,
        example,
    }
}

const ACTIVATIONS: &[&str] = &["squared_relu", "gelu", "swiglu"];

const ATTENTION: &[Spec] = &[
    req("num_heads", Kind::Int, "32"),
    req("num_kv_groups", Kind::Int, "8"),
    maybe("head_dim", Kind::Int, "128"),
    opt("qk_norm", Kind::Bool, "true"),
    opt("position", Kind::Choice(&["none", "rope"]), "rope"),
    opt("rope_base", Kind::Float, "10000.0"),
];
const MLA: &[Spec] = &[
    req("num_heads", Kind::Int, "16"),
    maybe("q_lora_rank", Kind::Int, "1536"),
    req("kv_lora_rank", Kind::Int, "512"),
    req("qk_head_dim", Kind::Int, "128"),
    req("qk_rope_head_dim", Kind::Int, "64"),
    req("v_head_dim", Kind::Int, "128"),
    opt("qk_norm", Kind::Bool, "true"),
    opt("rope_base", Kind::Float, "10000.0"),
];
const DSA: &[Spec] = &[
    req("index_heads", Kind::Int, "64"),
    req("index_head_dim", Kind::Int, "128"),
    req("index_topk", Kind::Int, "2048"),
    opt("indexer_loss_coeff", Kind::Float, "0.0"),
    opt("indexer_sparse_loss", Kind::Bool, "false"),
];
const GDN: &[Spec] = &[
    req("key_heads", Kind::Int, "16"),
    req("value_heads", Kind::Int, "32"),
    req("key_head_dim", Kind::Int, "128"),
    req("value_head_dim", Kind::Int, "128"),
    opt("conv_kernel", Kind::Int, "4"),
];
const MAMBA: &[Spec] = &[
    req("num_heads", Kind::Int, "128"),
    req("head_dim", Kind::Int, "64"),
    req("num_groups", Kind::Int, "8"),
    req("state_size", Kind::Int, "128"),
    opt("conv_kernel", Kind::Int, "4"),
    maybe("inner_size", Kind::Int, "8192"),
    opt("chunk_size", Kind::Int, "128"),
];
const MLP: &[Spec] = &[
    req("ffn_hidden_size", Kind::Int, "15680"),
    opt("activation", Kind::Choice(ACTIVATIONS), "squared_relu"),
];
const MOE: &[Spec] = &[
    req("num_experts", Kind::Int, "128"),
    req("top_k", Kind::Int, "6"),
    req("ffn_hidden_size", Kind::Int, "1856"),
    maybe("shared_expert_ffn_hidden_size", Kind::Int, "3712"),
    opt("activation", Kind::Choice(ACTIVATIONS), "squared_relu"),
    opt(
        "score_function",
        Kind::Choice(&["softmax", "sigmoid"]),
        "sigmoid",
    ),
    opt("aux_loss_coeff", Kind::Float, "0.01"),
    opt("topk_scaling_factor", Kind::Float, "2.5"),
    opt("expert_bias", Kind::Bool, "true"),
    opt("expert_bias_update_rate", Kind::Float, "0.001"),
];
const MTP: &[Spec] = &[opt("loss_scale", Kind::Float, "0.1")];

/// The keys of a model file, in the order of [`ModelConfig`].
const MODEL: &[Spec] = &[
    req("pattern", Kind::Str, "\"M[*E]M[*E]\""),
    req("hidden_size", Kind::Int, "4096"),
    req("vocab_size", Kind::Int, "131072"),
    opt("tie_embeddings", Kind::Bool, "false"),
    opt("init_std", Kind::Float, "0.02"),
    opt("seq_length", Kind::Int, "4096"),
    maybe(
        "attention",
        Kind::Section(ATTENTION),
        "{ num_heads: 32, num_kv_groups: 8 }",
    ),
    maybe(
        "mla",
        Kind::Section(MLA),
        "{ num_heads: 16, kv_lora_rank: 512, ... }",
    ),
    maybe("dsa", Kind::Section(DSA), "{ index_heads: 64, ... }"),
    maybe("gdn", Kind::Section(GDN), "{ key_heads: 16, ... }"),
    maybe(
        "mamba",
        Kind::Section(MAMBA),
        "{ num_heads: 128, head_dim: 64, ... }",
    ),
    maybe("mlp", Kind::Section(MLP), "{ ffn_hidden_size: 15680 }"),
    maybe(
        "moe",
        Kind::Section(MOE),
        "{ num_experts: 128, top_k: 6, ... }",
    ),
    opt("mtp", Kind::Section(MTP), "{ loss_scale: 0.1 }"),
];

/// Fields that are not model-file keys: where to start from, and the layout
/// choices the static plan depends on.
const PLAN_FIELDS: &[&str] = &[
    "preset",
    "ep",
    "pp",
    "first_stage_layers",
    "last_stage_layers",
    "unit_kinds",
    "non_unit_bucket_cap",
];

/// The declaration, resolved: dimensions and the layout choices that shape
/// the static tables.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub config: ModelConfig,
    pub ep: usize,
    pub pp: usize,
    pub first_stage_layers: Option<usize>,
    pub last_stage_layers: Option<usize>,
    /// The FSDP unit-kind shorthand; `None` is the planner's default rule.
    pub unit_kinds: Option<Vec<UnitKind>>,
    pub non_unit_bucket_cap: usize,
}

/// Where each field was written, so a check on the resolved model can point
/// at its culprit.
pub struct FieldSpans {
    /// Value spans by dotted path (`hidden_size`, `attention.num_heads`).
    values: HashMap<String, Span>,
    /// Section names by their key (`attention`).
    sections: HashMap<String, Span>,
    /// The pattern's literal, when written in the declaration.
    pub pattern: Option<LitStr>,
    /// The preset's literal, when one is named.
    pub preset: Option<LitStr>,
    /// The model's name, the place of last resort.
    pub name: Span,
}

impl FieldSpans {
    pub fn value(&self, path: &str) -> Option<Span> {
        self.values.get(path).copied()
    }

    pub fn section(&self, name: &str) -> Option<Span> {
        self.sections.get(name).copied()
    }

    /// Where a value that was not written in the declaration came from.
    pub fn origin(&self) -> Span {
        self.preset.as_ref().map_or(self.name, LitStr::span)
    }
}

/// Reads every field, reporting each mistake at its field. Returns the
/// resolved model when nothing is wrong with the fields themselves.
pub fn resolve(decl: &ModelDecl, errors: &mut Errors) -> (Option<Resolved>, FieldSpans) {
    let mut spans = FieldSpans {
        values: HashMap::new(),
        sections: HashMap::new(),
        pattern: None,
        preset: None,
        name: decl.name.span(),
    };
    let before = errors.len();
    let mut seen: HashMap<String, Span> = HashMap::new();
    let mut table = toml::Table::new();
    let mut layout = Layout::default();
    let mut unit_filter_field = None;
    for field in &decl.fields {
        let key = field.name.to_string();
        if seen.insert(key.clone(), field.name.span()).is_some() {
            errors.push(
                field.name.span(),
                format!("`{key}` is given twice; remove one of them"),
            );
            continue;
        }
        match key.as_str() {
            "preset" => read_preset(field, &mut spans, errors),
            "unit_kinds" => layout.unit_kinds = read_unit_kinds(&field.value, errors),
            "unit_filter" => unit_filter_field = Some(field.name.span()),
            "ep" | "pp" | "first_stage_layers" | "last_stage_layers" | "non_unit_bucket_cap" => {
                let value = int(&key, &field.value, "2", errors);
                spans.values.insert(key.clone(), field.value.span());
                match key.as_str() {
                    "ep" => layout.ep = value,
                    "pp" => layout.pp = value,
                    "first_stage_layers" => layout.first_stage_layers = value,
                    "last_stage_layers" => layout.last_stage_layers = value,
                    _ => layout.non_unit_bucket_cap = value,
                }
            }
            _ => match MODEL.iter().find(|s| s.name == key) {
                Some(spec) => {
                    if key == "pattern" {
                        spans.pattern = field.value.as_str().cloned();
                    }
                    read_field(spec, field, "", &mut table, &mut spans, errors);
                }
                None => {
                    let known: Vec<&str> = MODEL
                        .iter()
                        .map(|s| s.name)
                        .chain(PLAN_FIELDS.iter().copied())
                        .collect();
                    errors.push(field.name.span(), unknown_field(&key, "a model", &known));
                }
            },
        }
    }
    if let Some(span) = unit_filter_field {
        let message = if layout.unit_kinds.is_some() {
            format!(
                "[{}] both `unit_kinds` and `unit_filter` are given\n  help: a kind list is shorthand for a unit filter: give one or the other",
                Code::H027
            )
        } else {
            "`unit_filter`: a custom unit filter runs at run time, so `model!` cannot plan units with it\n  help: use `unit_kinds: [\"group\", \"E\", ...]` (the layer symbols M * + D G - E, `group` and `mtp`), or call `Plan::new` with `UnitFilter::predicate` at run time"
                .to_string()
        };
        errors.push(span, message);
    }

    let base = match spans.preset.as_ref() {
        Some(lit) => ModelConfig::preset_source(&lit.value())
            .and_then(|text| toml::from_str::<toml::Table>(text).ok())
            .unwrap_or_default(),
        None => toml::Table::new(),
    };
    let merged = merge(base, table);
    // With an unknown preset, every key it would have given is "missing":
    // one error about the preset says it all.
    let preset_failed = decl
        .fields
        .iter()
        .any(|f| f.name == "preset" && spans.preset.is_none());
    if !preset_failed {
        check_required(&merged, decl, &spans, errors);
    }
    if errors.len() > before {
        return (None, spans);
    }
    match toml::Value::Table(merged).try_into::<ModelConfig>() {
        Ok(config) => {
            let resolved = Resolved {
                config,
                ep: layout.ep.unwrap_or(1),
                pp: layout.pp.unwrap_or(1),
                first_stage_layers: layout.first_stage_layers,
                last_stage_layers: layout.last_stage_layers,
                unit_kinds: layout.unit_kinds.flatten(),
                non_unit_bucket_cap: layout
                    .non_unit_bucket_cap
                    .unwrap_or(DEFAULT_NON_UNIT_BUCKET_CAP),
            };
            (Some(resolved), spans)
        }
        Err(e) => {
            // The schema mirrors ModelConfig, so this means they drifted apart.
            errors.push(
                decl.name.span(),
                format!("the model's dimensions do not form a model: {e}"),
            );
            (None, spans)
        }
    }
}

#[derive(Default)]
struct Layout {
    ep: Option<usize>,
    pp: Option<usize>,
    first_stage_layers: Option<usize>,
    last_stage_layers: Option<usize>,
    /// `Some(None)`: given but unreadable.
    unit_kinds: Option<Option<Vec<UnitKind>>>,
    non_unit_bucket_cap: Option<usize>,
}

fn read_preset(field: &Field, spans: &mut FieldSpans, errors: &mut Errors) {
    let Some(lit) = field.value.as_str() else {
        errors.push(
            field.value.span(),
            format!(
                "`preset` takes a preset's name as a string, like `preset: \"tiny\"`; found {}\n  help: the presets are: {}",
                field.value.describe(),
                hybridgen_dsl::config::PRESET_NAMES.join(", ")
            ),
        );
        return;
    };
    let name = lit.value();
    if ModelConfig::preset_source(&name).is_none() {
        let mut message = format!("unknown preset `{name}`");
        if let Some(close) = closest(&name, &hybridgen_dsl::config::PRESET_NAMES) {
            message += &format!("; did you mean `{close}`?");
        }
        message += &format!(
            "\n  help: the presets are: {}",
            hybridgen_dsl::config::PRESET_NAMES.join(", ")
        );
        errors.push(lit.span(), message);
        return;
    }
    spans.preset = Some(lit.clone());
}

fn read_unit_kinds(value: &Value, errors: &mut Errors) -> Option<Option<Vec<UnitKind>>> {
    let help = "unit kinds are the layer symbols M * + D G - E, `group` and `mtp`, written as strings: `unit_kinds: [\"group\", \"E\"]`";
    let items: Vec<&Value> = match value {
        Value::List { items, .. } => items.iter().collect(),
        _ => {
            errors.push(
                value.span(),
                format!(
                    "`unit_kinds` takes a list; found {}\n  help: {help}",
                    value.describe()
                ),
            );
            return Some(None);
        }
    };
    let mut kinds = Vec::new();
    let mut ok = true;
    for item in items {
        match item.as_str() {
            Some(lit) => match UnitKind::parse(&lit.value()) {
                Some(kind) => kinds.push(kind),
                None => {
                    ok = false;
                    errors.push(
                        lit.span(),
                        format!(
                            "[{}] `{}` is not a unit kind\n  help: {help}",
                            Code::H027,
                            lit.value()
                        ),
                    );
                }
            },
            None => {
                ok = false;
                errors.push(
                    item.span(),
                    format!(
                        "[{}] a unit kind is written as a string; found {}\n  help: {help}",
                        Code::H027,
                        item.describe()
                    ),
                );
            }
        }
    }
    Some(ok.then_some(kinds))
}

/// Reads one schema field into `table`, recursing into sections.
fn read_field(
    spec: &Spec,
    field: &Field,
    prefix: &str,
    table: &mut toml::Table,
    spans: &mut FieldSpans,
    errors: &mut Errors,
) {
    let path = format!("{prefix}{}", spec.name);
    spans.values.insert(path.clone(), field.value.span());
    if spec.optional && matches!(&field.value, Value::Word(w) if w == "none") {
        table.insert(spec.name.to_string(), Removed::marker());
        return;
    }
    let converted = match spec.kind {
        Kind::Section(fields) => {
            spans.sections.insert(path.clone(), field.name.span());
            let Value::Section {
                fields: written, ..
            } = &field.value
            else {
                let none = if spec.optional { ", or `none`" } else { "" };
                errors.push(
                    field.value.span(),
                    format!(
                        "`{path}` takes a section, like `{path}: {}`{none}; found {}",
                        spec.example,
                        field.value.describe()
                    ),
                );
                return;
            };
            let mut section = toml::Table::new();
            let mut seen = HashMap::new();
            for inner in written {
                let key = inner.name.to_string();
                if seen.insert(key.clone(), ()).is_some() {
                    errors.push(
                        inner.name.span(),
                        format!("`{path}.{key}` is given twice; remove one of them"),
                    );
                    continue;
                }
                match fields.iter().find(|s| s.name == key) {
                    Some(inner_spec) => {
                        let prefix = format!("{path}.");
                        read_field(inner_spec, inner, &prefix, &mut section, spans, errors);
                    }
                    None => {
                        let known: Vec<&str> = fields.iter().map(|s| s.name).collect();
                        errors.push(
                            inner.name.span(),
                            unknown_field(&key, &format!("`{path}`"), &known),
                        );
                    }
                }
            }
            Some(toml::Value::Table(section))
        }
        Kind::Int => int_value(&path, spec, &field.value, errors).map(toml::Value::Integer),
        Kind::Float => float(&path, spec, &field.value, errors).map(toml::Value::Float),
        Kind::Bool => match &field.value {
            Value::Lit(Lit::Bool(b)) => Some(toml::Value::Boolean(b.value())),
            other => {
                errors.push(
                    other.span(),
                    mistyped(&path, "`true` or `false`", spec, other),
                );
                None
            }
        },
        Kind::Str => match field.value.as_str() {
            Some(lit) => Some(toml::Value::String(lit.value())),
            None => {
                errors.push(
                    field.value.span(),
                    mistyped(&path, "a string", spec, &field.value),
                );
                None
            }
        },
        Kind::Choice(choices) => {
            let word = match &field.value {
                Value::Word(w) => Some((w.to_string(), w.span())),
                Value::Lit(Lit::Str(s)) => Some((s.value(), s.span())),
                _ => None,
            };
            match word {
                Some((word, _)) if choices.contains(&word.as_str()) => {
                    Some(toml::Value::String(word))
                }
                Some((word, span)) => {
                    let mut message = format!(
                        "`{path}` cannot be `{word}`; it is one of {}",
                        quoted(choices)
                    );
                    if let Some(close) = closest(&word, choices) {
                        message += &format!("\n  help: did you mean `{close}`?");
                    }
                    errors.push(span, message);
                    None
                }
                None => {
                    let what = format!("one of {}", quoted(choices));
                    errors.push(
                        field.value.span(),
                        mistyped(&path, &what, spec, &field.value),
                    );
                    None
                }
            }
        }
    };
    if let Some(value) = converted {
        table.insert(spec.name.to_string(), value);
    }
}

/// A written `none`: removes the key from the preset when merged.
struct Removed;

impl Removed {
    const KEY: &'static str = "\u{0}hybridgen-none";

    fn marker() -> toml::Value {
        toml::Value::String(Removed::KEY.to_string())
    }

    fn is(value: &toml::Value) -> bool {
        value.as_str() == Some(Removed::KEY)
    }
}

/// Declared values over the preset's: scalars replace, sections merge key by
/// key, `none` removes.
fn merge(mut base: toml::Table, declared: toml::Table) -> toml::Table {
    for (key, value) in declared {
        if Removed::is(&value) {
            base.remove(&key);
            continue;
        }
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(into)), toml::Value::Table(from)) => {
                let merged = merge(std::mem::take(into), from);
                *into = merged;
            }
            (_, value) => {
                let value = match value {
                    toml::Value::Table(from) => toml::Value::Table(merge(toml::Table::new(), from)),
                    other => other,
                };
                base.insert(key, value);
            }
        }
    }
    base
}

/// Keys the resolved model must have: reported at the section that lacks
/// them, or at the model's name for top-level keys.
fn check_required(table: &toml::Table, decl: &ModelDecl, spans: &FieldSpans, errors: &mut Errors) {
    for spec in MODEL {
        match (table.get(spec.name), spec.kind) {
            (None, _) if spec.required => {
                let help = if spans.preset.is_some() {
                    format!("add `{}: {}`", spec.name, spec.example)
                } else {
                    format!(
                        "add `{}: {}`, or start from a preset: `preset: \"tiny\"` (the presets are: {})",
                        spec.name,
                        spec.example,
                        hybridgen_dsl::config::PRESET_NAMES.join(", ")
                    )
                };
                errors.push(
                    decl.name.span(),
                    format!(
                        "model `{}` has no `{}`\n  help: {help}",
                        decl.name, spec.name
                    ),
                );
            }
            (Some(toml::Value::Table(section)), Kind::Section(fields)) => {
                let missing: Vec<&Spec> = fields
                    .iter()
                    .filter(|f| f.required && !section.contains_key(f.name))
                    .collect();
                if missing.is_empty() {
                    continue;
                }
                let names: Vec<String> = missing.iter().map(|f| format!("`{}`", f.name)).collect();
                let example: Vec<String> = missing
                    .iter()
                    .map(|f| format!("{}: {}", f.name, f.example))
                    .collect();
                errors.push(
                    spans.section(spec.name).unwrap_or(decl.name.span()),
                    format!(
                        "section `{}` is missing {}\n  help: add {}",
                        spec.name,
                        names.join(", "),
                        example.join(", ")
                    ),
                );
            }
            _ => {}
        }
    }
}

fn int(name: &str, value: &Value, example: &'static str, errors: &mut Errors) -> Option<usize> {
    let spec = Spec {
        name: "",
        kind: Kind::Int,
        required: false,
        optional: false,
        example,
    };
    int_value(name, &spec, value, errors).map(|n| n as usize)
}

fn int_value(path: &str, spec: &Spec, value: &Value, errors: &mut Errors) -> Option<i64> {
    match value {
        Value::Lit(Lit::Int(lit)) => match lit.base10_parse::<u64>() {
            Ok(n) if i64::try_from(n).is_ok() && usize::try_from(n).is_ok() => Some(n as i64),
            _ => {
                errors.push(
                    lit.span(),
                    format!("`{path}` is too large for a size: {}", lit.base10_digits()),
                );
                None
            }
        },
        Value::Negative(span, Lit::Int(_)) => {
            errors.push(*span, format!("`{path}` is a size and cannot be negative"));
            None
        }
        other => {
            errors.push(other.span(), mistyped(path, "a whole number", spec, other));
            None
        }
    }
}

fn float(path: &str, spec: &Spec, value: &Value, errors: &mut Errors) -> Option<f64> {
    let (negative, lit) = match value {
        Value::Lit(lit) => (false, lit),
        Value::Negative(_, lit) => (true, lit),
        other => {
            errors.push(other.span(), mistyped(path, "a number", spec, other));
            return None;
        }
    };
    let parsed = match lit {
        Lit::Float(f) => f.base10_parse::<f64>().ok(),
        Lit::Int(i) => i.base10_parse::<u64>().ok().map(|n| n as f64),
        _ => {
            errors.push(value.span(), mistyped(path, "a number", spec, value));
            return None;
        }
    };
    match parsed {
        Some(x) => Some(if negative { -x } else { x }),
        None => {
            errors.push(value.span(), format!("`{path}` is not a number"));
            None
        }
    }
}

fn mistyped(path: &str, expected: &str, spec: &Spec, found: &Value) -> String {
    format!(
        "`{path}` takes {expected}, like `{}: {}`; found {}",
        path.rsplit('.').next().unwrap_or(path),
        spec.example,
        found.describe()
    )
}

fn unknown_field(key: &str, owner: &str, known: &[&str]) -> String {
    let mut message = format!("{owner} has no field `{key}`");
    if let Some(close) = closest(key, known) {
        message += &format!("; did you mean `{close}`?");
    }
    message += &format!("\n  help: the fields are: {}", known.join(", "));
    message
}

fn quoted(words: &[&str]) -> String {
    words
        .iter()
        .map(|w| format!("`{w}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The known word nearest to `word`, if it is near enough to be a typo.
fn closest<'a>(word: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(word, k), *k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn resolve_tokens(tokens: proc_macro2::TokenStream) -> (Option<Resolved>, Vec<String>) {
        let decl: ModelDecl = syn::parse2(tokens).unwrap();
        let mut errors = Errors::default();
        let (resolved, _) = resolve(&decl, &mut errors);
        (resolved, errors.messages())
    }

    #[test]
    fn overrides_merge_into_the_preset() {
        let (resolved, errors) = resolve_tokens(quote! {
            struct M {
                preset: "tiny",
                pattern: "M*",
                attention: { num_heads: 8 },
                moe: none,
                ep: 2,
            }
        });
        assert!(errors.is_empty(), "{errors:?}");
        let r = resolved.unwrap();
        let tiny = ModelConfig::preset("tiny").unwrap();
        let attention = r.config.attention.as_ref().unwrap();
        assert_eq!(attention.num_heads, 8);
        assert_eq!(
            attention.num_kv_groups,
            tiny.attention.as_ref().unwrap().num_kv_groups
        );
        assert!(r.config.moe.is_none());
        assert_eq!(r.config.pattern, "M*");
        assert_eq!(r.config.mamba, tiny.mamba);
        assert_eq!(r.ep, 2);
    }

    #[test]
    fn every_mistake_is_reported_at_once() {
        let (resolved, errors) = resolve_tokens(quote! {
            struct M {
                pattern: 3,
                hidden_sise: 64,
                vocab_size: -1,
                attention: { num_heads: "8", position: ropes },
                mlp: { activation: gelu },
                unit_kinds: ["group", "Q"],
                preset: "tiny",
                preset: "tiny",
            }
        });
        assert!(resolved.is_none());
        let joined = errors.join("\n---\n");
        for needle in [
            "`pattern` takes a string",
            "did you mean `hidden_size`?",
            "cannot be negative",
            "`attention.num_heads` takes a whole number",
            "did you mean `rope`?",
            "[H027] `Q` is not a unit kind",
            "`preset` is given twice",
        ] {
            assert!(joined.contains(needle), "missing {needle:?} in\n{joined}");
        }
    }

    #[test]
    fn missing_keys_are_named_with_an_example() {
        let (_, errors) = resolve_tokens(quote! {
            struct M { pattern: "M", mamba: { num_heads: 4 } }
        });
        let joined = errors.join("\n");
        assert!(joined.contains("has no `hidden_size`"), "{joined}");
        assert!(
            joined.contains("section `mamba` is missing `head_dim`, `num_groups`, `state_size`"),
            "{joined}"
        );
    }

    #[test]
    fn kinds_and_a_custom_filter_together_are_h027() {
        let (_, errors) = resolve_tokens(quote! {
            struct M { preset: "tiny", unit_kinds: ["E"], unit_filter: my_filter }
        });
        assert!(
            errors.iter().any(|e| e.starts_with("[H027] both")),
            "{errors:?}"
        );
    }

    /// The schema must name exactly the keys of a model file, or declared
    /// fields would be rejected (or silently dropped) by deserialisation.
    #[test]
    fn the_schema_matches_model_config() {
        let mut full = ModelConfig::preset("tiny").unwrap();
        full.attention.as_mut().unwrap().head_dim = Some(16);
        full.mamba.as_mut().unwrap().inner_size = Some(64);
        let value = toml::Value::try_from(&full).unwrap();
        let table = value.as_table().unwrap();
        let mut keys: Vec<&str> = table.keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut schema: Vec<&str> = MODEL.iter().map(|s| s.name).collect();
        schema.sort_unstable();
        assert_eq!(keys, schema);
        for spec in MODEL {
            if let (Kind::Section(fields), Some(toml::Value::Table(section))) =
                (spec.kind, table.get(spec.name))
            {
                let mut keys: Vec<&str> = section.keys().map(String::as_str).collect();
                keys.sort_unstable();
                let mut schema: Vec<&str> = fields.iter().map(|s| s.name).collect();
                schema.sort_unstable();
                assert_eq!(keys, schema, "section {}", spec.name);
            }
        }
    }

    #[test]
    fn typos_get_suggestions() {
        assert_eq!(
            closest("hiden_size", &["hidden_size", "vocab_size"]),
            Some("hidden_size")
        );
        assert_eq!(closest("banana", &["hidden_size", "vocab_size"]), None);
    }
}

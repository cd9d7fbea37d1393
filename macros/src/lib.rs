//! The `model!` macro. All of its logic (reading the declaration, planning,
//! generating) lives in `hybridgen-codegen`, shared with build scripts and
//! tested there as plain functions; use it through the `hybridgen` facade.

use proc_macro::TokenStream;

/// Declares a hybrid Mamba / attention / MoE model and plans it at build
/// time.
///
/// ```ignore
/// hybridgen::model! {
///     /// Doc comments and `#[cfg]`-like attributes are passed through.
///     pub struct HybridMoe {
///         pattern: "(M[*E]){2}/*E",        // the layer pattern, sugar allowed
///         preset: "tiny",                  // optional: start from a preset...
///         hidden_size: 64,                 // ...and override what differs
///         attention: { num_heads: 4, num_kv_groups: 2, position: rope },
///         moe: { num_experts: 4, top_k: 2, shared_expert_ffn_hidden_size: none },
///         ep: 2,                           // expert-parallel size (default 1)
///         unit_kinds: ["group", "mtp"],    // optional FSDP unit-kind shorthand
///     }
/// }
/// ```
///
/// # Fields
/// The keys of a TOML model file, typed: `pattern`, `hidden_size`,
/// `vocab_size`, `tie_embeddings`, `init_std`, `seq_length`, and the sections
/// `attention`, `mla`, `dsa`, `gdn`, `mamba`, `mlp`, `moe`, `mtp` written as
/// `{ key: value, ... }`. Without a `preset`, required keys must be given;
/// with one, given keys override the preset's, section by section, and
/// `none` removes an optional key or section. Choices (`position`,
/// `activation`, `score_function`) are written bare or as strings.
///
/// The layout the static tables depend on: `ep` (expert-parallel size,
/// default 1), `pp`, `first_stage_layers`, `last_stage_layers` (pipeline),
/// `unit_kinds` (the FSDP unit-kind shorthand; default: every group,
/// ungrouped layer and MTP depth is a unit) and `non_unit_bucket_cap`.
///
/// # What it generates
/// A module named after the struct in snake case (`hybrid_moe`), and a `use`
/// of the model struct beside it:
/// - constants: `PATTERN`, `CANONICAL_PATTERN`, layer counts, `EP`, `PP`,
///   `TOTAL_PARAMS`, ...;
/// - the static plan as `const` data of the planner's own types:
///   `PARAM_DEFS`, `PARAMS` (owner, definition, bucket, offset),
///   `PARAM_NAMES`, `BUCKETS`, `UNITS`, `STAGES`, `SCHEDULE`, `SLOT_TABLES`
///   (the overlap schedule's five slots per node), `LAYER_HANDLES`,
///   `MODULES`; the padded length and shard range of a bucket are `const fn`s
///   of the world size (`BUCKETS[b].padded_numel(w)`, `padded_numel(b, w)`);
/// - the FSDP unit filter as code: `is_unit(&Module)`, `unit_of_path`,
///   `is_unit_path`, `unit_filter()`;
/// - one struct per logical-layer shape (`MambaLayer`, `AttentionMoeGroup`,
///   `MtpDepth`, ...) whose fields name the members by kind, and the model
///   struct holding one per logical layer (`layer_0`, ...) and per MTP depth
///   (`mtp_0`, ...), with `new()`, `config()`, `layout(dp)`,
///   `plan_options(&layout)`, `plan(&layout)` and `hybridgen::StaticModel`.
///
/// # Errors
/// Every mistake of one declaration is reported in one compile: pattern
/// errors (`[H001]`...`[H012]`) at the pattern literal with the pattern and a
/// caret under the culprit in the message, dimension and layout errors
/// (`[H020]`...`[H027]`) at the field they concern, unknown or mistyped
/// fields at the field. Next to the errors a stub module with the same
/// names is emitted, so code using the model reports nothing further.
#[proc_macro]
pub fn model(input: TokenStream) -> TokenStream {
    hybridgen_codegen::expand(input.into())
        .unwrap_or_else(|error| error.into_compile_error())
        .into()
}

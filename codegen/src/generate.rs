//! Plan -> the generated module: `const` tables of the planner's own types
//! (`Cow::Borrowed` where the run-time plan holds `Cow::Owned`), a struct per
//! logical layer and per MTP depth, the model struct, the FSDP unit filter as
//! code, and the glue back to the run-time planner.
//!
//! Generated code reaches the library only through
//! `<crate>::__private`, imported once at the top of the module under
//! `__`-prefixed names so it cannot collide with the model's own names.
//! `__private::dsl` is the facade's name for `hybridgen_dsl`, whose
//! `static_model` module (and its `rows`) generated tables are made of.

use crate::fields::Resolved;
use crate::layer_structs::{ModelShape, kind_tokens};
use crate::tables::tables;
use hybridgen_dsl::config::{
    Activation, AttentionConfig, DsaConfig, GdnConfig, MambaConfig, MlaConfig, MlpConfig,
    ModelConfig, MoeConfig, MtpConfig, Position, ScoreFunction,
};
use hybridgen_dsl::pattern::LayerKind;
use hybridgen_dsl::plan::{Plan, UnitKind};
use proc_macro2::{Ident, Literal, TokenStream};
use quote::quote;
use syn::{Attribute, Visibility};

/// Who the generated module is for: the names and attributes the user
/// declared, and the path of the facade crate.
#[derive(Clone)]
pub struct ModelSpec {
    pub name: Ident,
    pub module: Ident,
    pub vis: Visibility,
    /// Doc comments, put on the module and on the model struct.
    pub docs: Vec<Attribute>,
    /// Other attributes (`#[cfg]`...), put on the module and the re-export.
    pub forwarded: Vec<Attribute>,
    /// `::hybridgen` unless the facade is reached under another name.
    pub krate: syn::Path,
}

impl ModelSpec {
    /// The `use` items every generated module starts with.
    pub(super) fn imports(&self) -> TokenStream {
        let krate = &self.krate;
        quote! {
            #[allow(unused_imports)]
            use #krate::__private::dsl as __dsl;
            #[allow(unused_imports)]
            use #krate::__private::dsl::LayerKind as __Kind;
            #[allow(unused_imports)]
            use #krate::__private::dsl::plan as __plan;
            #[allow(unused_imports)]
            use #krate::__private::dsl::static_model as __model;
            #[allow(unused_imports)]
            use #krate::__private::dsl::static_model::rows as __rows;
            #[allow(unused_imports)]
            use #krate::__private::dsl::static_model::param_def as __param_def;
            #[allow(unused_imports)]
            use #krate::__private::Cow as __Cow;
        }
    }

    /// `#[docs] #[attrs] vis mod module { body } vis use module::Name;`
    pub(super) fn wrap(&self, body: TokenStream) -> TokenStream {
        let ModelSpec {
            name,
            module,
            vis,
            docs,
            forwarded,
            ..
        } = self;
        let imports = self.imports();
        quote! {
            #(#docs)*
            #(#forwarded)*
            #vis mod #module {
                #imports
                #body
            }
            #(#forwarded)*
            #[allow(unused_imports)]
            #vis use #module::#name;
        }
    }
}

/// The module name for a model struct: `NemotronNano9bV2` -> `nemotron_nano9b_v2`.
pub fn module_name(name: &str) -> String {
    let name = name.strip_prefix("r#").unwrap_or(name);
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::with_capacity(name.len() + 4);
    for (i, &c) in chars.iter().enumerate() {
        if c.is_uppercase() && i > 0 {
            let prev = chars[i - 1];
            let next_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
            if prev.is_lowercase() || prev.is_ascii_digit() || (prev.is_uppercase() && next_lower) {
                out.push('_');
            }
        }
        out.extend(c.to_lowercase());
    }
    // A keyword (`Mod`, `Type`, `Self`) cannot name a module.
    if syn::parse_str::<Ident>(&out).is_err() {
        out.push_str("_model");
    }
    out
}

/// The whole generated output for a planned model.
pub fn generate(spec: &ModelSpec, resolved: &Resolved, plan: &Plan) -> TokenStream {
    let shape = ModelShape::of(&plan.pattern);
    let mut body = TokenStream::new();
    body.extend(constants(spec, resolved, plan));
    body.extend(tables(plan));
    body.extend(unit_filter(plan, resolved));
    body.extend(shape.structs());
    body.extend(model_struct(spec, plan, &shape));
    spec.wrap(body)
}

fn lit(n: usize) -> Literal {
    Literal::usize_unsuffixed(n)
}

/// `Some(n)` / `None`: the prelude's names, which a generated module (a
/// fresh scope holding only generated items) always sees.
fn opt(n: Option<usize>) -> TokenStream {
    match n {
        Some(n) => {
            let n = lit(n);
            quote!(Some(#n))
        }
        None => quote!(None),
    }
}

fn doc(text: &str) -> TokenStream {
    quote!(#[doc = #text])
}

/// Model-wide facts.
fn constants(spec: &ModelSpec, resolved: &Resolved, plan: &Plan) -> TokenStream {
    let pattern = plan.model.pattern.as_str();
    let canonical = plan.pattern.canonical();
    let physical = lit(plan.physical_layers());
    let logical = lit(plan.logical_layers.len());
    let mtp = lit(plan.mtp_depths());
    let ep = lit(resolved.ep);
    let pp = lit(resolved.pp);
    let first = opt(resolved.first_stage_layers);
    let last = opt(resolved.last_stage_layers);
    let local = lit(plan.local_experts());
    let total = Literal::u64_unsuffixed(plan.total_params);
    let active = Literal::u64_unsuffixed(plan.active_params);
    let cap = lit(resolved.non_unit_bucket_cap);
    let name = spec.name.to_string();
    let unit_kinds = match &resolved.unit_kinds {
        None => quote!(::core::option::Option::None),
        Some(kinds) => {
            let kinds = kinds.iter().map(|k| match k {
                UnitKind::Layer(kind) => {
                    let kind = kind_tokens(*kind);
                    quote!(__plan::UnitKind::Layer(#kind))
                }
                UnitKind::Group => quote!(__plan::UnitKind::Group),
                UnitKind::Mtp => quote!(__plan::UnitKind::Mtp),
            });
            quote!(::core::option::Option::Some(&[#(#kinds),*]))
        }
    };
    quote! {
        /// The model struct's name.
        pub const NAME: &str = #name;
        /// The layer pattern as written.
        pub const PATTERN: &str = #pattern;
        /// The pattern in plain Megatron syntax (no sugar, no white space).
        pub const CANONICAL_PATTERN: &str = #canonical;
        /// Decoder layers, groups counted member by member (`num_layers`).
        pub const PHYSICAL_LAYERS: usize = #physical;
        /// Decoder items: groups and ungrouped layers.
        pub const LOGICAL_LAYERS: usize = #logical;
        pub const MTP_DEPTHS: usize = #mtp;
        /// The expert-parallel size the tables are planned for.
        pub const EP: usize = #ep;
        /// The pipeline-parallel size the stages are planned for.
        pub const PP: usize = #pp;
        pub const FIRST_STAGE_LAYERS: ::core::option::Option<usize> = #first;
        pub const LAST_STAGE_LAYERS: ::core::option::Option<usize> = #last;
        /// Experts each expert-parallel rank holds.
        pub const LOCAL_EXPERTS: usize = #local;
        /// Parameters of the whole model, every expert counted.
        pub const TOTAL_PARAMS: u64 = #total;
        /// Parameters one token passes through.
        pub const ACTIVE_PARAMS: u64 = #active;
        /// Size cap of non-unit buckets, in elements.
        pub const NON_UNIT_BUCKET_CAP: usize = #cap;
        /// The declared FSDP unit kinds; `None` is the default rule.
        pub const UNIT_KINDS: ::core::option::Option<&[__plan::UnitKind]> = #unit_kinds;
    }
}

/// The FSDP unit filter as code: the typed predicate the planner asks, the
/// path predicate, and a [`UnitFilter`](hybridgen_dsl::plan::UnitFilter) built from
/// them.
fn unit_filter(plan: &Plan, resolved: &Resolved) -> TokenStream {
    let rule = plan.unit_filter.description();
    let is_unit = match &resolved.unit_kinds {
        None => quote! {
            ::core::matches!(
                module.kind,
                __plan::ModuleKind::Group | __plan::ModuleKind::Layer | __plan::ModuleKind::MtpDepth
            )
        },
        Some(kinds) => {
            let listed: Vec<TokenStream> = LayerKind::ALL
                .into_iter()
                .filter(|k| kinds.contains(&UnitKind::Layer(*k)))
                .map(kind_tokens)
                .collect();
            let any_listed = if listed.is_empty() {
                quote!(false)
            } else {
                quote!(
                    module
                        .layer_kinds
                        .iter()
                        .any(|kind| ::core::matches!(kind, #(#listed)|*))
                )
            };
            let group = if kinds.contains(&UnitKind::Group) {
                quote!(true)
            } else {
                any_listed.clone()
            };
            let mtp = kinds.contains(&UnitKind::Mtp);
            quote! {
                match module.kind {
                    __plan::ModuleKind::Layer => #any_listed,
                    __plan::ModuleKind::Group => #group,
                    __plan::ModuleKind::MtpDepth => #mtp,
                    _ => false,
                }
            }
        }
    };
    let arms = plan.units.iter().map(|u| {
        let name = u.name.as_ref();
        let index = lit(u.index);
        quote!(#name => Some(#index))
    });
    quote! {
        /// The unit filter's rule, in words.
        pub const UNIT_FILTER_RULE: &str = #rule;

        /// The FSDP unit filter over typed modules: the predicate the
        /// planner asks about each candidate module, outermost match winning.
        pub fn is_unit(module: &__plan::Module<'_>) -> bool {
            #is_unit
        }

        /// The FSDP unit a module path is, if any (`decoder.layers.3`,
        /// `mtp.layers.0`).
        pub fn unit_of_path(path: &str) -> ::core::option::Option<usize> {
            match path {
                #(#arms,)*
                _ => ::core::option::Option::None,
            }
        }

        /// Whether the module at `path` is an FSDP unit.
        pub fn is_unit_path(path: &str) -> bool {
            unit_of_path(path).is_some()
        }

        /// The unit filter as the run-time planner takes it.
        pub fn unit_filter() -> __plan::UnitFilter {
            __plan::UnitFilter::predicate(UNIT_FILTER_RULE, is_unit)
        }
    }
}

fn model_struct(spec: &ModelSpec, plan: &Plan, shape: &ModelShape) -> TokenStream {
    let name = &spec.name;
    let docs = &spec.docs;
    let (fields, values) = shape.model_fields();
    let summary = doc(&format!(
        "Pattern `{}`: {} physical / {} logical layers, {} MTP depths, {} FSDP units, {} buckets; {} parameters ({} active).",
        plan.pattern.canonical(),
        plan.physical_layers(),
        plan.logical_layers.len(),
        plan.mtp_depths(),
        plan.units.len(),
        plan.buckets.len(),
        plan.total_params,
        plan.active_params
    ));
    let config = config_tokens(&plan.model);
    let model_traits = model_traits(name);
    quote! {
        #(#docs)*
        ///
        #summary
        ///
        /// Field `layer_i` is logical layer `i` (`decoder.layers.i`), typed
        /// by its shape: `MambaLayer`, `AttentionMoeGroup`, ... whose fields
        /// name the members by kind; `mtp_d` is MTP depth `d`. Each holds its
        /// members' [`LayerHandle`](__model::LayerHandle)s (kind, path,
        /// parameters in `PARAMS`) and its module entry (path, FSDP unit,
        /// schedule node); `slots()` is its overlap-schedule slot table.
        // No `PartialEq`/`Hash`: derived for thousands of fields they nest
        // that many `&&`s, which overflows the compiler's stack.
        #[derive(Clone, Copy, Debug)]
        pub struct #name {
            #fields
        }

        impl #name {
            /// The model's layers, read from the tables.
            pub const fn new() -> Self {
                #name { #values }
            }

            /// The model dimensions the tables were planned from.
            pub fn config() -> __dsl::ModelConfig {
                #config
            }

            /// The declared layout (`ep`, pipeline) with data-parallel size `dp`.
            pub fn layout(dp: usize) -> __plan::ParallelLayout {
                __plan::ParallelLayout {
                    dp,
                    ep: EP,
                    pp: PP,
                    first_stage_layers: FIRST_STAGE_LAYERS,
                    last_stage_layers: LAST_STAGE_LAYERS,
                }
            }

            /// The planner's options for `layout`: the generated unit filter
            /// and the declared bucket cap.
            pub fn plan_options(layout: &__plan::ParallelLayout) -> __plan::PlanOptions {
                __plan::PlanOptions {
                    layout: ::core::clone::Clone::clone(layout),
                    unit_filter: unit_filter(),
                    non_unit_bucket_cap: NON_UNIT_BUCKET_CAP,
                }
            }

            /// The plan for `layout`, assembled from the `const` tables
            /// without planning again (the training runtime takes it as
            /// is); an H023 error when `layout` differs from the declared
            /// `ep` or pipeline split.
            pub fn plan(layout: &__plan::ParallelLayout) -> ::core::result::Result<__plan::Plan, __dsl::Diagnostics> {
                let tables = __plan::PlanTables {
                    params: PARAMS,
                    param_defs: PARAM_DEFS,
                    units: UNITS,
                    buckets: BUCKETS,
                    schedule: SCHEDULE,
                };
                __model::plan_declared(&Self::config(), &Self::plan_options(layout), &Self::layout(layout.dp), &tables)
            }
        }

        #model_traits
    }
}

fn float(x: f32) -> TokenStream {
    if x.is_finite() {
        let x = Literal::f32_suffixed(x);
        quote!(#x)
    } else if x.is_nan() {
        quote!(f32::NAN)
    } else if x > 0.0 {
        quote!(f32::INFINITY)
    } else {
        quote!(f32::NEG_INFINITY)
    }
}

fn some<T>(value: &Option<T>, f: impl FnOnce(&T) -> TokenStream) -> TokenStream {
    match value {
        Some(v) => {
            let v = f(v);
            quote!(::core::option::Option::Some(#v))
        }
        None => quote!(::core::option::Option::None),
    }
}

fn activation(a: Activation) -> TokenStream {
    match a {
        Activation::SquaredRelu => quote!(__dsl::config::Activation::SquaredRelu),
        Activation::Gelu => quote!(__dsl::config::Activation::Gelu),
        Activation::Swiglu => quote!(__dsl::config::Activation::Swiglu),
    }
}

/// A [`ModelConfig`] literal. Every struct is destructured without `..`, so a
/// field added to the config is a compile error here rather than a value
/// silently left out of generated code.
fn config_tokens(c: &ModelConfig) -> TokenStream {
    let ModelConfig {
        pattern,
        hidden_size,
        vocab_size,
        tie_embeddings,
        init_std,
        seq_length,
        attention,
        mla,
        dsa,
        gdn,
        mamba,
        mlp,
        moe,
        mtp,
    } = c;
    let (hidden_size, vocab_size, seq_length) =
        (lit(*hidden_size), lit(*vocab_size), lit(*seq_length));
    let init_std = float(*init_std);
    let attention = some(attention, |a| {
        let AttentionConfig {
            num_heads,
            num_kv_groups,
            head_dim,
            qk_norm,
            position,
            rope_base,
        } = a;
        let (num_heads, num_kv_groups, head_dim) =
            (lit(*num_heads), lit(*num_kv_groups), opt(*head_dim));
        let position = match position {
            Position::None => quote!(__dsl::config::Position::None),
            Position::Rope => quote!(__dsl::config::Position::Rope),
        };
        let rope_base = float(*rope_base);
        quote!(__dsl::config::AttentionConfig { num_heads: #num_heads, num_kv_groups: #num_kv_groups, head_dim: #head_dim, qk_norm: #qk_norm, position: #position, rope_base: #rope_base })
    });
    let mla = some(mla, |m| {
        let MlaConfig {
            num_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            qk_norm,
            rope_base,
        } = m;
        let (num_heads, q_lora_rank, kv_lora_rank) =
            (lit(*num_heads), opt(*q_lora_rank), lit(*kv_lora_rank));
        let (qk_head_dim, qk_rope_head_dim, v_head_dim) =
            (lit(*qk_head_dim), lit(*qk_rope_head_dim), lit(*v_head_dim));
        let rope_base = float(*rope_base);
        quote!(__dsl::config::MlaConfig { num_heads: #num_heads, q_lora_rank: #q_lora_rank, kv_lora_rank: #kv_lora_rank, qk_head_dim: #qk_head_dim, qk_rope_head_dim: #qk_rope_head_dim, v_head_dim: #v_head_dim, qk_norm: #qk_norm, rope_base: #rope_base })
    });
    let dsa = some(dsa, |d| {
        let DsaConfig {
            index_heads,
            index_head_dim,
            index_topk,
            indexer_loss_coeff,
            indexer_sparse_loss,
        } = d;
        let (a, b, c) = (lit(*index_heads), lit(*index_head_dim), lit(*index_topk));
        let coeff = float(*indexer_loss_coeff);
        quote!(__dsl::config::DsaConfig { index_heads: #a, index_head_dim: #b, index_topk: #c, indexer_loss_coeff: #coeff, indexer_sparse_loss: #indexer_sparse_loss })
    });
    let gdn = some(gdn, |g| {
        let GdnConfig {
            key_heads,
            value_heads,
            key_head_dim,
            value_head_dim,
            conv_kernel,
        } = g;
        let (a, b, c, d, e) = (
            lit(*key_heads),
            lit(*value_heads),
            lit(*key_head_dim),
            lit(*value_head_dim),
            lit(*conv_kernel),
        );
        quote!(__dsl::config::GdnConfig { key_heads: #a, value_heads: #b, key_head_dim: #c, value_head_dim: #d, conv_kernel: #e })
    });
    let mamba = some(mamba, |m| {
        let MambaConfig {
            num_heads,
            head_dim,
            num_groups,
            state_size,
            conv_kernel,
            inner_size,
            chunk_size,
        } = m;
        let (a, b, c, d) = (
            lit(*num_heads),
            lit(*head_dim),
            lit(*num_groups),
            lit(*state_size),
        );
        let (e, f, g) = (lit(*conv_kernel), opt(*inner_size), lit(*chunk_size));
        quote!(__dsl::config::MambaConfig { num_heads: #a, head_dim: #b, num_groups: #c, state_size: #d, conv_kernel: #e, inner_size: #f, chunk_size: #g })
    });
    let mlp = some(mlp, |m| {
        let MlpConfig {
            ffn_hidden_size,
            activation: act,
        } = m;
        let (f, act) = (lit(*ffn_hidden_size), activation(*act));
        quote!(__dsl::config::MlpConfig { ffn_hidden_size: #f, activation: #act })
    });
    let moe = some(moe, |m| {
        let MoeConfig {
            num_experts,
            top_k,
            ffn_hidden_size,
            shared_expert_ffn_hidden_size,
            activation: act,
            score_function,
            aux_loss_coeff,
            topk_scaling_factor,
            expert_bias,
            expert_bias_update_rate,
        } = m;
        let (e, k, f, s) = (
            lit(*num_experts),
            lit(*top_k),
            lit(*ffn_hidden_size),
            opt(*shared_expert_ffn_hidden_size),
        );
        let act = activation(*act);
        let score = match score_function {
            ScoreFunction::Softmax => quote!(__dsl::config::ScoreFunction::Softmax),
            ScoreFunction::Sigmoid => quote!(__dsl::config::ScoreFunction::Sigmoid),
        };
        let aux = float(*aux_loss_coeff);
        let (scaling, rate) = (float(*topk_scaling_factor), float(*expert_bias_update_rate));
        quote!(__dsl::config::MoeConfig { num_experts: #e, top_k: #k, ffn_hidden_size: #f, shared_expert_ffn_hidden_size: #s, activation: #act, score_function: #score, aux_loss_coeff: #aux, topk_scaling_factor: #scaling, expert_bias: #expert_bias, expert_bias_update_rate: #rate })
    });
    let MtpConfig { loss_scale } = mtp;
    let loss_scale = float(*loss_scale);
    quote! {
        __dsl::ModelConfig {
            pattern: ::std::string::String::from(#pattern),
            hidden_size: #hidden_size,
            vocab_size: #vocab_size,
            tie_embeddings: #tie_embeddings,
            init_std: #init_std,
            seq_length: #seq_length,
            attention: #attention,
            mla: #mla,
            dsa: #dsa,
            gdn: #gdn,
            mamba: #mamba,
            mlp: #mlp,
            moe: #moe,
            mtp: __dsl::config::MtpConfig { loss_scale: #loss_scale },
        }
    }
}

/// The trait impls of a model struct, the same for a real module and for the
/// stub emitted on errors (whose inherent items they forward to).
pub(super) fn model_traits(name: &syn::Ident) -> TokenStream {
    quote! {
        impl ::core::default::Default for #name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl __model::StaticModel for #name {
            const NAME: &'static str = NAME;
            const PATTERN: &'static str = PATTERN;
            const CANONICAL_PATTERN: &'static str = CANONICAL_PATTERN;
            const EP: usize = EP;
            const PP: usize = PP;
            const UNIT_KINDS: ::core::option::Option<&'static [__plan::UnitKind]> = UNIT_KINDS;
            const NON_UNIT_BUCKET_CAP: usize = NON_UNIT_BUCKET_CAP;
            const PARAM_DEFS: &'static [__dsl::params::ParamDef] = PARAM_DEFS;
            const PARAMS: &'static [__plan::Param] = PARAMS;
            const PARAM_NAMES: &'static [&'static str] = PARAM_NAMES;
            const UNITS: &'static [__plan::FsdpUnit] = UNITS;
            const BUCKETS: &'static [__plan::Bucket] = BUCKETS;
            const STAGES: &'static [__plan::Stage] = STAGES;
            const SCHEDULE: __plan::SchedulePlan = SCHEDULE;
            const SLOT_TABLES: &'static [__model::SlotTable] = SLOT_TABLES;

            fn config() -> __dsl::ModelConfig {
                Self::config()
            }
            fn unit_filter() -> __plan::UnitFilter {
                unit_filter()
            }
            fn plan_options(layout: &__plan::ParallelLayout) -> __plan::PlanOptions {
                Self::plan_options(layout)
            }
            fn plan(layout: &__plan::ParallelLayout) -> ::core::result::Result<__plan::Plan, __dsl::Diagnostics> {
                Self::plan(layout)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_are_snake_case() {
        assert_eq!(module_name("Tiny"), "tiny");
        assert_eq!(module_name("NemotronNano9bV2"), "nemotron_nano9b_v2");
        assert_eq!(module_name("MoEModel"), "mo_e_model");
        assert_eq!(module_name("HTTPServer"), "http_server");
        assert_eq!(module_name("Mod"), "mod_model");
        assert_eq!(module_name("Self_"), "self_");
    }
}

//! Plan -> the generated module: `const` tables of the planner's own types
//! (`Cow::Borrowed` where the run-time plan holds `Cow::Owned`), a struct per
//! logical layer and per MTP depth, the model struct, the FSDP unit filter as
//! code, and the glue back to the run-time planner.
//!
//! Generated code reaches the library only through
//! `<crate>::__private`, imported once at the top of the module under
//! `__`-prefixed names so it cannot collide with the model's own names.

use super::fields::Resolved;
use crate::config::{
    Activation, AttentionConfig, DsaConfig, GdnConfig, MambaConfig, MlaConfig, MlpConfig,
    ModelConfig, MoeConfig, MtpConfig, Position, ScoreFunction,
};
use crate::params::ParamDef;
use crate::pattern::LayerKind;
use crate::plan::{
    Bucket, FsdpUnit, LayerRef, Op, Owner, Param, Plan, ScheduleNode, Slot, Stage, UnitKind,
    UnitShape,
};
use proc_macro2::{Ident, Literal, Span, TokenStream};
use quote::{format_ident, quote};
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
            use #krate::__private::dsl::plan::{LayerRef as __Ref, Op as __Op, Owner as __Owner};
            #[allow(unused_imports)]
            use #krate::__private::dsl::codegen::static_model as __model;
            #[allow(unused_imports)]
            use #krate::__private::dsl::codegen::static_model::build_const::{
                bucket as __bucket, decoder_layer as __decoder_layer,
                decoder_param as __decoder_param, mtp_layer as __mtp_layer,
                mtp_param as __mtp_param, node as __node, param as __param,
                param_def as __param_def, slots as __slots, unit as __unit,
            };
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
    let tables = Tables::new(plan);
    let mut body = TokenStream::new();
    body.extend(constants(spec, resolved, plan));
    body.extend(tables.param_defs());
    body.extend(tables.params());
    body.extend(tables.units());
    body.extend(tables.buckets());
    body.extend(tables.stages());
    body.extend(tables.schedule());
    body.extend(unit_filter(plan, resolved));
    body.extend(tables.layer_structs());
    body.extend(model_struct(spec, plan));
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

pub(super) fn kind_tokens(kind: LayerKind) -> TokenStream {
    let variant = Ident::new(
        match kind {
            LayerKind::Mamba => "Mamba",
            LayerKind::Attention => "Attention",
            LayerKind::Mla => "Mla",
            LayerKind::Dsa => "Dsa",
            LayerKind::GatedDeltaNet => "GatedDeltaNet",
            LayerKind::Mlp => "Mlp",
            LayerKind::Moe => "Moe",
        },
        Span::call_site(),
    );
    quote!(__Kind::#variant)
}

fn layer_ref(layer: LayerRef) -> TokenStream {
    match layer {
        LayerRef::Decoder(i) => {
            let i = lit(i);
            quote!(__Ref::Decoder(#i))
        }
        LayerRef::Mtp { depth, index } => {
            let (depth, index) = (lit(depth), lit(index));
            quote!(__Ref::Mtp { depth: #depth, index: #index })
        }
    }
}

fn owner(owner: Owner) -> TokenStream {
    match owner {
        Owner::Embedding => quote!(__Owner::Embedding),
        Owner::Layer(layer) => {
            let layer = layer_ref(layer);
            quote!(__Owner::Layer(#layer))
        }
        Owner::FinalNorm => quote!(__Owner::FinalNorm),
        Owner::MtpBlock(d) => {
            let d = lit(d);
            quote!(__Owner::MtpBlock(#d))
        }
        Owner::OutputLayer => quote!(__Owner::OutputLayer),
    }
}

fn op(op: Op) -> TokenStream {
    match op {
        Op::Embed => quote!(__Op::Embed),
        Op::MtpEnter(d) => {
            let d = lit(d);
            quote!(__Op::MtpEnter(#d))
        }
        Op::Layer(l) => {
            let l = layer_ref(l);
            quote!(__Op::Layer(#l))
        }
        Op::MoePrepare(l) => {
            let l = layer_ref(l);
            quote!(__Op::MoePrepare(#l))
        }
        Op::MoeDispatch(l) => {
            let l = layer_ref(l);
            quote!(__Op::MoeDispatch(#l))
        }
        Op::MoeExperts(l) => {
            let l = layer_ref(l);
            quote!(__Op::MoeExperts(#l))
        }
        Op::MoeCombine(l) => {
            let l = layer_ref(l);
            quote!(__Op::MoeCombine(#l))
        }
        Op::Mlp(l) => {
            let l = layer_ref(l);
            quote!(__Op::Mlp(#l))
        }
        Op::FinalNorm => quote!(__Op::FinalNorm),
        Op::Head(d) => {
            let d = opt(d);
            quote!(__Op::Head(#d))
        }
    }
}

fn slice(items: impl IntoIterator<Item = TokenStream>) -> TokenStream {
    let items = items.into_iter();
    quote!(&[#(#items),*])
}

fn usizes(items: &[usize]) -> TokenStream {
    slice(items.iter().map(|&n| {
        let n = lit(n);
        quote!(#n)
    }))
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

/// The plan's tables and the per-layer indexes derived from them in one pass.
struct Tables<'p> {
    plan: &'p Plan,
    /// `[first, end)` into `params` per decoder layer, and per MTP layer.
    decoder_params: Vec<(usize, usize)>,
    mtp_params: Vec<Vec<(usize, usize)>>,
}

impl<'p> Tables<'p> {
    fn new(plan: &'p Plan) -> Self {
        let mut decoder_params = vec![(0, 0); plan.layers.len()];
        let mut mtp_params: Vec<Vec<(usize, usize)>> = plan
            .mtp_layers
            .iter()
            .map(|d| vec![(0, 0); d.len()])
            .collect();
        let record = |range: &mut (usize, usize), i: usize| {
            if range.1 == 0 {
                range.0 = i;
            }
            range.1 = i + 1;
        };
        for (i, param) in plan.params.iter().enumerate() {
            match param.owner {
                Owner::Layer(LayerRef::Decoder(l)) => {
                    if let Some(range) = decoder_params.get_mut(l) {
                        record(range, i);
                    }
                }
                Owner::Layer(LayerRef::Mtp { depth, index }) => {
                    if let Some(range) = mtp_params.get_mut(depth).and_then(|d| d.get_mut(index)) {
                        record(range, i);
                    }
                }
                _ => {}
            }
        }
        Tables {
            plan,
            decoder_params,
            mtp_params,
        }
    }

    fn param_defs(&self) -> TokenStream {
        let defs = self.plan.param_defs.iter().map(|def: &ParamDef| {
            let name = def.name.as_ref();
            let shape = usizes(&def.shape);
            let expert = def.expert;
            let local = opt(def.local_expert);
            quote!(__param_def(#name, #shape, #expert, #local))
        });
        quote! {
            /// Parameter definitions: name relative to the owner, full shape,
            /// expert-ness, local expert index. Every layer of a kind shares
            /// its definitions.
            pub const PARAM_DEFS: &[__dsl::params::ParamDef] = &[#(#defs),*];
        }
    }

    fn params(&self) -> TokenStream {
        let params = self.plan.params.iter().map(|p: &Param| {
            let (def, bucket, offset) = (lit(p.def), lit(p.bucket), lit(p.offset));
            match p.owner {
                Owner::Layer(LayerRef::Decoder(layer)) => {
                    let layer = lit(layer);
                    quote!(__decoder_param(#layer, #def, #bucket, #offset))
                }
                Owner::Layer(LayerRef::Mtp { depth, index }) => {
                    let (depth, index) = (lit(depth), lit(index));
                    quote!(__mtp_param(#depth, #index, #def, #bucket, #offset))
                }
                other => {
                    let owner = owner(other);
                    quote!(__param(#owner, #def, #bucket, #offset))
                }
            }
        });
        let names = self.plan.params.iter().map(|p| self.plan.param_name(p));
        quote! {
            /// One rank's parameters in model (`named_parameters()`) order:
            /// owner, definition (index into `PARAM_DEFS`), bucket, and offset
            /// in the bucket (a multiple of 64).
            pub const PARAMS: &[__plan::Param] = &[#(#params),*];
            /// The full state-dict name of each entry of `PARAMS`.
            pub const PARAM_NAMES: &[&str] = &[#(#names),*];
        }
    }

    fn units(&self) -> TokenStream {
        let units = self.plan.units.iter().map(|u: &FsdpUnit| {
            let index = lit(u.index);
            let name = u.name.as_ref();
            let shape = match u.shape {
                UnitShape::Group => quote!(__plan::UnitShape::Group),
                UnitShape::Layer => quote!(__plan::UnitShape::Layer),
                UnitShape::Mtp => quote!(__plan::UnitShape::Mtp),
            };
            let layers = usizes(&u.layers);
            let depth = opt(u.mtp_depth);
            let buckets = usizes(&u.buckets);
            quote!(__unit(#index, #name, #shape, #layers, #depth, #buckets))
        });
        quote! {
            /// FSDP units in forward order, as the unit filter picked them.
            pub const UNITS: &[__plan::FsdpUnit] = &[#(#units),*];
        }
    }

    fn buckets(&self) -> TokenStream {
        let buckets = self.plan.buckets.iter().map(|b: &Bucket| {
            let (id, numel, end) = (lit(b.id), lit(b.numel), lit(b.end));
            let unit = opt(b.unit);
            let expert = b.expert;
            let params = usizes(&b.params);
            let lcm = match b.megatron_row_lcm {
                Some(l) => {
                    let l = Literal::u64_unsuffixed(l);
                    quote!(Some(#l))
                }
                None => quote!(None),
            };
            quote!(__bucket(#id, #unit, #expert, #params, #numel, #end, #lcm))
        });
        quote! {
            /// Every bucket by id (forward order): id, unit, expert-ness,
            /// parameters (indices into `PARAMS`), elements, end of the last
            /// parameter, Megatron's padding unit. Offsets are fixed; the
            /// padded length and shard ranges are `const fn`s of the shard
            /// group size `W`: `BUCKETS[b].padded_numel(W)`,
            /// `BUCKETS[b].shard_range(W, rank)`.
            pub const BUCKETS: &[__plan::Bucket] = &[#(#buckets),*];

            /// Bucket `bucket`'s padded length when sharded over `world` ranks.
            pub const fn padded_numel(bucket: usize, world: usize) -> usize {
                BUCKETS[bucket].padded_numel(world)
            }

            /// The elements of bucket `bucket` that rank `rank` of `world` owns.
            pub const fn shard_range(bucket: usize, world: usize, rank: usize) -> ::core::ops::Range<usize> {
                BUCKETS[bucket].shard_range(world, rank)
            }
        }
    }

    fn stages(&self) -> TokenStream {
        let stages = self.plan.stages.iter().map(|s: &Stage| {
            let (rank, vp) = (lit(s.pp_rank), lit(s.vp_stage));
            let (l0, l1) = (lit(s.layers.start), lit(s.layers.end));
            let (g0, g1) = (lit(s.logical.start), lit(s.logical.end));
            let mtp = s.has_mtp;
            quote! {
                __plan::Stage { pp_rank: #rank, vp_stage: #vp, layers: #l0..#l1, logical: #g0..#g1, has_mtp: #mtp }
            }
        });
        quote! {
            /// Pipeline stages for `PP` ranks.
            pub const STAGES: &[__plan::Stage] = &[#(#stages),*];
        }
    }

    fn schedule(&self) -> TokenStream {
        let nodes = self.plan.schedule.nodes.iter().map(node);
        let tables = self.plan.schedule.nodes.iter().map(|n| {
            let [pre, dispatch, mlp, combine, post] =
                Slot::ALL.map(|slot| slice(n.ops(slot).into_iter().map(op)));
            quote!(__slots(#pre, #dispatch, #mlp, #combine, #post))
        });
        quote! {
            /// The overlap schedule's forward chain: one node per logical
            /// layer, then one per MTP layer (index, module path, logical
            /// index, MTP depth, unit, pre-layers, terminal, embedding, MTP
            /// entry, final norm, heads).
            pub const SCHEDULE: __plan::SchedulePlan = __plan::SchedulePlan { nodes: __Cow::Borrowed(&[#(#nodes),*]) };
            /// Each schedule node's five slots (pre-dispatch, dispatch, mlp,
            /// combine, MTP post-process), as `const` data.
            pub const SLOT_TABLES: &[__model::SlotTable] = &[#(#tables),*];
        }
    }

    /// A struct per logical layer and per MTP depth; a group's fields name
    /// its members by kind.
    fn layer_structs(&self) -> TokenStream {
        let plan = self.plan;
        let mut out = TokenStream::new();
        let unit_of = |path: &str| plan.units.iter().position(|u| u.name == path);
        let mut node_of_logical = vec![0; plan.logical_layers.len()];
        let mut node_of_mtp = vec![None; plan.mtp_depths()];
        for node in plan.schedule.nodes.iter() {
            if let Some(l) = node.logical
                && let Some(slot) = node_of_logical.get_mut(l)
            {
                *slot = node.index;
            }
            if let Some(d) = node.mtp_depth
                && let Some(slot) = node_of_mtp.get_mut(d)
                && slot.is_none()
            {
                *slot = Some(node.index);
            }
        }
        let units_by_path: std::collections::HashMap<&str, usize> = plan
            .units
            .iter()
            .map(|u| (u.name.as_ref(), u.index))
            .collect();
        for logical in &plan.logical_layers {
            let path = logical.path();
            let members: Vec<Member> = logical
                .layers
                .clone()
                .map(|i| {
                    let info = &plan.layers[i];
                    let (first, end) = self.decoder_params[i];
                    Member {
                        layer: LayerRef::Decoder(i),
                        kind: info.kind,
                        path: info.path(),
                        first,
                        end,
                    }
                })
                .collect();
            let symbols: String = members.iter().map(|m| m.kind.symbol()).collect();
            let what = if logical.is_group {
                format!("group `[{symbols}]`")
            } else {
                format!(
                    "`{symbols}` ({})",
                    members.first().map_or("", |m| m.kind.name())
                )
            };
            let unit = units_by_path.get(path.as_str()).copied();
            let description = format!(
                "`{path}`: {what}, physical layers {}..{}{}.",
                logical.layers.start,
                logical.layers.end,
                unit.map_or(String::from(", in no FSDP unit"), |u| format!(
                    ", FSDP unit {u}"
                ))
            );
            out.extend(layer_struct(
                &format_ident!("Layer{}", logical.index),
                &description,
                &path,
                logical.index,
                unit,
                node_of_logical.get(logical.index).copied().unwrap_or(0),
                &members,
            ));
        }
        for (d, depth) in plan.mtp_layers.iter().enumerate() {
            let path = format!("mtp.layers.{d}");
            let members: Vec<Member> = depth
                .iter()
                .map(|l| {
                    let (first, end) = self.mtp_params[d][l.index];
                    Member {
                        layer: LayerRef::Mtp {
                            depth: d,
                            index: l.index,
                        },
                        kind: l.kind,
                        path: l.path(),
                        first,
                        end,
                    }
                })
                .collect();
            let symbols: String = members.iter().map(|m| m.kind.symbol()).collect();
            let unit = unit_of(&path);
            let description = format!(
                "`{path}`: multi-token-prediction depth {d}, `{symbols}`{}.",
                unit.map_or(String::new(), |u| format!(", FSDP unit {u}"))
            );
            out.extend(layer_struct(
                &format_ident!("MtpDepth{d}"),
                &description,
                &path,
                d,
                unit,
                node_of_mtp[d].unwrap_or(0),
                &members,
            ));
        }
        out
    }
}

fn node(n: &ScheduleNode) -> TokenStream {
    let index = lit(n.index);
    let name = n.name.as_ref();
    let logical = opt(n.logical);
    let depth = opt(n.mtp_depth);
    let unit = opt(n.unit);
    let pre = slice(n.pre_layers.iter().map(|&l| layer_ref(l)));
    let terminal = match n.terminal {
        Some((layer, kind)) => {
            let (layer, kind) = (layer_ref(layer), kind_tokens(kind));
            quote!(Some((#layer, #kind)))
        }
        None => quote!(None),
    };
    let embed = n.embed;
    let enter = opt(n.mtp_enter);
    let final_norm = n.final_norm;
    let heads = slice(n.heads.iter().map(|&h| opt(h)));
    quote!(__node(#index, #name, #logical, #depth, #unit, #pre, #terminal, #embed, #enter, #final_norm, #heads))
}

/// One physical layer inside a layer struct.
pub(super) struct Member {
    pub layer: LayerRef,
    pub kind: LayerKind,
    pub path: String,
    pub first: usize,
    pub end: usize,
}

/// Field names by kind (`mamba`, `attention`, `moe`); a kind that appears
/// more than once (possible in MTP depths: `/MM`) is numbered by position.
pub(super) fn member_fields(kinds: &[LayerKind]) -> Vec<Ident> {
    kinds
        .iter()
        .enumerate()
        .map(|(j, kind)| {
            if kinds.iter().filter(|k| *k == kind).count() > 1 {
                format_ident!("{}_{}", kind.ident(), j)
            } else {
                format_ident!("{}", kind.ident())
            }
        })
        .collect()
}

fn layer_struct(
    name: &Ident,
    description: &str,
    path: &str,
    index: usize,
    unit: Option<usize>,
    node: usize,
    members: &[Member],
) -> TokenStream {
    let description = doc(description);
    let kinds: Vec<LayerKind> = members.iter().map(|m| m.kind).collect();
    let fields = member_fields(&kinds);
    let field_docs = members.iter().map(|m| {
        doc(&format!(
            "`{}`: {} ({})",
            m.path,
            m.kind.symbol(),
            m.kind.name()
        ))
    });
    let handles = members.iter().map(|m| {
        let kind = kind_tokens(m.kind);
        let path = m.path.as_str();
        let (first, end) = (lit(m.first), lit(m.end));
        match m.layer {
            LayerRef::Decoder(layer) => {
                let layer = lit(layer);
                quote!(__decoder_layer(#layer, #kind, #path, #first, #end))
            }
            LayerRef::Mtp { depth, index } => {
                let (depth, index) = (lit(depth), lit(index));
                quote!(__mtp_layer(#depth, #index, #kind, #path, #first, #end))
            }
        }
    });
    let (index, node, unit) = (lit(index), lit(node), opt(unit));
    let field_defs = fields
        .iter()
        .zip(field_docs)
        .map(|(field, doc)| quote!(#doc pub #field: __model::LayerHandle));
    quote! {
        #description
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct #name {
            #(#field_defs,)*
        }

        // The constants are documented once, on the model struct, rather
        // than on each of what may be thousands of layer structs.
        #[allow(missing_docs)]
        impl #name {
            pub const PATH: &str = #path;
            pub const INDEX: usize = #index;
            pub const UNIT: ::core::option::Option<usize> = #unit;
            pub const NODE: usize = #node;
            pub const SLOTS: __model::SlotTable = SLOT_TABLES[#node];
            pub const NEW: Self = #name { #(#fields: #handles,)* };
        }
    }
}

/// The FSDP unit filter as code: the typed predicate the planner asks, the
/// path predicate, and a [`UnitFilter`](crate::plan::UnitFilter) built from
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

fn model_struct(spec: &ModelSpec, plan: &Plan) -> TokenStream {
    let name = &spec.name;
    let docs = &spec.docs;
    let mut fields = Vec::new();
    let mut types = Vec::new();
    let mut field_docs = Vec::new();
    for logical in &plan.logical_layers {
        fields.push(format_ident!("layer_{}", logical.index));
        types.push(format_ident!("Layer{}", logical.index));
        field_docs.push(doc(&format!("`{}`", logical.path())));
    }
    for d in 0..plan.mtp_depths() {
        fields.push(format_ident!("mtp_{d}"));
        types.push(format_ident!("MtpDepth{d}"));
        field_docs.push(doc(&format!("`mtp.layers.{d}`")));
    }
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
    quote! {
        #(#docs)*
        ///
        #summary
        ///
        /// Each field is a layer struct (`LayerN` per logical layer,
        /// `MtpDepthN` per MTP depth) whose fields name its members by kind
        /// and hold their [`LayerHandle`](__model::LayerHandle)s. Each layer
        /// struct has the constants `PATH` (module path), `INDEX` (logical
        /// index or MTP depth), `UNIT` (its FSDP unit, if any), `NODE` (its
        /// node in `SCHEDULE`), `SLOTS` (its overlap-schedule slot table) and
        /// `NEW` (its value).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct #name {
            #(#field_docs pub #fields: #types,)*
        }

        impl #name {
            /// The model's layers, each with its parameters' place in `PARAMS`.
            pub const fn new() -> Self {
                #name { #(#fields: #types::NEW,)* }
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

            /// A run-time plan for `layout`, equal to the `const` tables; an
            /// H023 error when `layout` differs from the declared `ep` or
            /// pipeline split.
            pub fn plan(layout: &__plan::ParallelLayout) -> ::core::result::Result<__plan::Plan, __dsl::Diagnostics> {
                __model::plan_declared(&Self::config(), &Self::plan_options(layout), &Self::layout(layout.dp))
            }
        }

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
        } = d;
        let (a, b, c) = (lit(*index_heads), lit(*index_head_dim), lit(*index_topk));
        quote!(__dsl::config::DsaConfig { index_heads: #a, index_head_dim: #b, index_topk: #c })
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
            expert_bias,
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
        quote!(__dsl::config::MoeConfig { num_experts: #e, top_k: #k, ffn_hidden_size: #f, shared_expert_ffn_hidden_size: #s, activation: #act, score_function: #score, aux_loss_coeff: #aux, expert_bias: #expert_bias })
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

    #[test]
    fn repeated_kinds_are_numbered() {
        let names = member_fields(&[LayerKind::Mamba, LayerKind::Mamba, LayerKind::Moe]);
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["mamba_0", "mamba_1", "moe"]);
    }
}

//! The module emitted next to the `compile_error!`s of an invalid
//! declaration: the same names with the same types, so code that uses the
//! model reports nothing further and the user sees the real mistakes only.
//!
//! When the pattern itself is valid the layer structs are known and are
//! emitted too; otherwise (or when the model is named like one of them, which
//! would make the stub clash as the real module does) the model struct has no
//! layer fields.

use crate::generate::ModelSpec;
use crate::layer_structs::ModelShape;
use hybridgen_dsl::pattern::Pattern;
use proc_macro2::TokenStream;
use quote::quote;

pub fn stub(spec: &ModelSpec, pattern: Option<&Pattern>) -> TokenStream {
    let name = &spec.name;
    let docs = &spec.docs;
    let (layer_structs, fields) = match pattern {
        Some(pattern) => {
            let shape = ModelShape::of(pattern);
            (shape.structs(), shape.model_fields().0)
        }
        None => Default::default(),
    };
    // A literal `panic!` is allowed in the `const fn new()`; stubs never run.
    let unreachable = quote!(::core::panic!("the model declaration has errors"));
    let model_traits = crate::generate::model_traits(name);
    let body = quote! {
        pub const NAME: &str = "";
        pub const PATTERN: &str = "";
        pub const CANONICAL_PATTERN: &str = "";
        pub const PHYSICAL_LAYERS: usize = 0;
        pub const LOGICAL_LAYERS: usize = 0;
        pub const MTP_DEPTHS: usize = 0;
        pub const EP: usize = 1;
        pub const PP: usize = 1;
        pub const FIRST_STAGE_LAYERS: ::core::option::Option<usize> = ::core::option::Option::None;
        pub const LAST_STAGE_LAYERS: ::core::option::Option<usize> = ::core::option::Option::None;
        pub const LOCAL_EXPERTS: usize = 0;
        pub const TOTAL_PARAMS: u64 = 0;
        pub const ACTIVE_PARAMS: u64 = 0;
        pub const NON_UNIT_BUCKET_CAP: usize = 0;
        pub const UNIT_KINDS: ::core::option::Option<&[__plan::UnitKind]> = ::core::option::Option::None;
        pub const PARAM_DEFS: &[__dsl::params::ParamDef] = &[];
        pub const PARAMS: &[__plan::Param] = &[];
        pub const PARAM_NAMES: &[&str] = &[];
        pub const BUCKETS: &[__plan::Bucket] = &[];
        pub const fn padded_numel(bucket: usize, world: usize) -> usize {
            let _ = (bucket, world);
            0
        }
        pub const fn shard_range(bucket: usize, world: usize, rank: usize) -> ::core::ops::Range<usize> {
            let _ = (bucket, world, rank);
            0..0
        }
        pub const UNITS: &[__plan::FsdpUnit] = &[];
        pub const STAGES: &[__plan::Stage] = &[];
        pub const SCHEDULE: __plan::SchedulePlan = __plan::SchedulePlan { nodes: __Cow::Borrowed(&[]) };
        pub const SLOT_TABLES: &[__model::SlotTable] = &[];
        pub const LAYER_HANDLES: &[__model::LayerHandle] = &[];
        pub const MODULES: &[__rows::ModuleEntry] = &[];
        pub const UNIT_FILTER_RULE: &str = "";
        pub fn is_unit(module: &__plan::Module<'_>) -> bool {
            let _ = module;
            #unreachable
        }
        pub fn unit_of_path(path: &str) -> ::core::option::Option<usize> {
            let _ = path;
            #unreachable
        }
        pub fn is_unit_path(path: &str) -> bool {
            let _ = path;
            #unreachable
        }
        pub fn unit_filter() -> __plan::UnitFilter {
            #unreachable
        }

        #layer_structs

        #(#docs)*
        // No `PartialEq`/`Hash`: derived for thousands of fields they nest
        // that many `&&`s, which overflows the compiler's stack.
        #[derive(Clone, Copy, Debug)]
        pub struct #name {
            #fields
        }

        impl #name {
            pub const fn new() -> Self {
                // Not a `const` value: a stub model is never evaluated.
                #unreachable
            }
            pub fn config() -> __dsl::ModelConfig {
                #unreachable
            }
            pub fn layout(dp: usize) -> __plan::ParallelLayout {
                let _ = dp;
                #unreachable
            }
            pub fn plan_options(layout: &__plan::ParallelLayout) -> __plan::PlanOptions {
                let _ = layout;
                #unreachable
            }
            pub fn plan(layout: &__plan::ParallelLayout) -> ::core::result::Result<__plan::Plan, __dsl::Diagnostics> {
                let _ = layout;
                #unreachable
            }
        }

        #model_traits
    };
    spec.wrap(body)
}

//! # hybridgen-codegen
//!
//! The code generator of the `model!` macro: a model declaration in, a Rust
//! module of `const` plan tables and typed layer structs out. It is shared
//! by the macro (`hybridgen-macros` is one line over [`expand`]) and the
//! build-script API (`hybridgen::build`, over [`build_script`]), and it is
//! plain Rust over `proc_macro2::TokenStream`s, so it is tested as ordinary
//! functions (token streams in and out, snapshots of the formatted module)
//! without a compiler in the loop.
//!
//! Planning is not done here: [`validate`] calls the one planner of
//! `hybridgen-dsl`, and the types generated modules are made of (the
//! `StaticModel` trait, `LayerHandle`, `SlotTable`, the compact `rows` table
//! form) live in `hybridgen_dsl::static_model`, so neither the runtime nor
//! generated code compiles `syn`.
//!
//! Stages, one module each, in the order serde_derive taught us:
//! - [`ast`]: read the declaration's tokens (`pub struct Name { field: value, ... }`);
//! - [`fields`]: give the fields meaning (typed schema, preset + overrides);
//! - [`validate`]: plan with the one planner, every diagnostic at its span;
//! - [`generate`]: emit the module, with [`tables`] (the plan as `const`
//!   tables, large ones in the compact `rows` form) and [`layer_structs`]
//!   (the typed layers); [`stub`]: its stand-in on errors;
//! - [`build_script`]: the same module from model files, for `build.rs`.
//!
//! Errors are collected ([`errors::Errors`]) and reported together; an
//! invalid declaration expands to its `compile_error!`s plus a stub module
//! with the same names, so one mistake does not cascade.

pub mod ast;
pub mod build_script;
pub mod errors;
pub mod fields;
pub mod generate;
pub mod layer_structs;
pub mod stub;
pub mod tables;
pub mod validate;

use ast::ModelDecl;
use errors::Errors;
use generate::ModelSpec;
use hybridgen_dsl::pattern::Pattern;
use proc_macro2::TokenStream;

/// Expands a `model!` invocation. `Err` only when the input is not a model
/// declaration at all (nothing to name a stub after); every other mistake
/// comes back as `compile_error!`s plus a stub module in `Ok`.
pub fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let decl: ModelDecl = syn::parse2(input)?;
    Ok(expand_decl(&decl, &facade_path()))
}

/// The path generated code reaches the library through.
pub fn facade_path() -> syn::Path {
    syn::parse_quote!(::hybridgen)
}

/// Expands a parsed declaration; `krate` is the facade crate's path.
pub fn expand_decl(decl: &ModelDecl, krate: &syn::Path) -> TokenStream {
    let mut errors = Errors::default();
    let spec = spec_of(decl, krate);
    let (resolved, spans) = fields::resolve(decl, &mut errors);
    let plan = match &resolved {
        Some(resolved) => validate::plan(resolved, &spans, &mut errors),
        None => {
            validate::check_pattern_only(&spans, &mut errors);
            None
        }
    };
    let name_clash = plan
        .as_ref()
        .is_some_and(|plan| check_generated_names(decl, &plan.pattern, &mut errors));
    match (plan, &resolved) {
        (Some(plan), Some(resolved)) if errors.is_empty() => {
            generate::generate(&spec, resolved, &plan)
        }
        (plan, _) => {
            let pattern = match plan {
                // The stub's layer structs would clash with the model struct
                // just as the real ones do: without them the clash is the
                // one error.
                Some(_) if name_clash => None,
                Some(plan) => Some(plan.pattern),
                None => resolved
                    .as_ref()
                    .map(|r| r.config.pattern.clone())
                    .or_else(|| spans.pattern.as_ref().map(syn::LitStr::value))
                    .and_then(|source| Pattern::parse(&source).ok()),
            };
            let mut out = errors.to_compile_errors();
            out.extend(stub::stub(&spec, pattern.as_ref()));
            out
        }
    }
}

/// The model struct shares its module with the generated layer structs:
/// whether its name is one of theirs (reported).
fn check_generated_names(decl: &ModelDecl, pattern: &Pattern, errors: &mut Errors) -> bool {
    let name = decl.name.to_string();
    let shape = layer_structs::ModelShape::of(pattern);
    let clash = shape.type_names().any(|generated| generated == name);
    if clash {
        errors.push(
            decl.name.span(),
            format!(
                "`{name}` is also the name of a layer struct generated for this pattern\n  help: name the model after what it is, e.g. `NemotronNano`"
            ),
        );
    }
    clash
}

/// Names and attributes of the generated items.
fn spec_of(decl: &ModelDecl, krate: &syn::Path) -> ModelSpec {
    let name = decl.name.to_string();
    let (docs, forwarded) = decl
        .attrs
        .iter()
        .cloned()
        .partition(|attr| attr.path().is_ident("doc"));
    ModelSpec {
        name: decl.name.clone(),
        module: syn::parse_str::<proc_macro2::Ident>(&generate::module_name(&name))
            .map(|mut module| {
                module.set_span(decl.name.span());
                module
            })
            .unwrap_or_else(|_| proc_macro2::Ident::new("model", decl.name.span())),
        vis: decl.vis.clone(),
        docs,
        forwarded,
        krate: krate.clone(),
    }
}

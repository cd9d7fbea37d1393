//! `expand` as the macro sees it: `TokenStream` in, `TokenStream` out, no
//! compiler. Every pattern code comes back as a `compile_error!` carrying
//! the code plus a stub module with the same names as a valid expansion,
//! and no input makes it panic. Nothing guards the planner against panics,
//! so a panicking planner fails these tests; and since a stub defines the
//! same names as a real module, the tests tell them apart by the errors
//! emitted and by the module's constants.

use hybridgen_codegen::expand;
use hybridgen_dsl::config::ModelConfig;
use hybridgen_dsl::plan::{Plan, PlanOptions};
use proc_macro2::TokenStream;
use proptest::prelude::*;
use quote::quote;
use std::collections::BTreeSet;

fn expand_str(fields: &str) -> TokenStream {
    let input: TokenStream = format!("pub struct Model {{ {fields} }}")
        .parse()
        .expect("test input tokenizes");
    expand(input).expect("a model declaration")
}

/// The `compile_error!` messages of an expansion.
fn errors(output: &TokenStream) -> Vec<String> {
    let file: syn::File = syn::parse2(output.clone()).expect("output parses");
    file.items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Macro(m)
                if m.mac
                    .path
                    .segments
                    .last()
                    .is_some_and(|s| s.ident == "compile_error") =>
            {
                let lit: syn::LitStr = syn::parse2(m.mac.tokens.clone()).ok()?;
                Some(lit.value())
            }
            _ => None,
        })
        .collect()
}

/// The value of `pub const NAME: usize = ...;` in the generated module.
fn usize_const(output: &TokenStream, name: &str) -> Option<usize> {
    let file: syn::File = syn::parse2(output.clone()).expect("output parses");
    file.items.iter().find_map(|item| match item {
        syn::Item::Mod(module) => {
            module
                .content
                .iter()
                .flat_map(|(_, items)| items)
                .find_map(|item| match item {
                    syn::Item::Const(c) if c.ident == name => match &*c.expr {
                        syn::Expr::Lit(syn::ExprLit {
                            lit: syn::Lit::Int(int),
                            ..
                        }) => int.base10_parse().ok(),
                        _ => None,
                    },
                    _ => None,
                })
        }
        _ => None,
    })
}

/// Whether the output is a real expansion: no error, and the model's
/// constants filled in (a stub's `NAME` is empty and it has no layers).
fn is_real_module(output: &TokenStream) -> bool {
    errors(output).is_empty()
        && output
            .to_string()
            .contains("pub const NAME : & str = \"Model\"")
}

/// What the planner itself says of `pattern` over the `tiny` preset with the
/// macro's default layout: the physical layer count, or the codes of the
/// diagnostics the macro shows.
fn planner_verdict(pattern: &str) -> Result<usize, Vec<String>> {
    let mut config = ModelConfig::preset("tiny").expect("the tiny preset");
    config.pattern = pattern.to_string();
    match Plan::new(&config, &PlanOptions::default()) {
        Ok(plan) => Ok(plan.layers.len()),
        Err(diagnostics) => Err(diagnostics
            .codes()
            .iter()
            .take(hybridgen_dsl::Diagnostics::MAX_RENDERED)
            .map(|code| format!("[{code}]"))
            .collect()),
    }
}

/// The macro's verdict on `pattern` must be the planner's: the same module
/// when it plans (no error at all), the same codes in the same order when it
/// does not.
fn assert_expands_as_planned(pattern: &str) -> Result<(), TestCaseError> {
    let output = expand_str(&format!("preset: \"tiny\", pattern: \"{pattern}\""));
    let errors = errors(&output);
    match planner_verdict(pattern) {
        Ok(physical) => {
            prop_assert!(errors.is_empty(), "{pattern:?} plans, yet: {errors:?}");
            prop_assert!(is_real_module(&output), "{pattern:?}: a stub");
            prop_assert_eq!(usize_const(&output, "PHYSICAL_LAYERS"), Some(physical));
        }
        Err(codes) => {
            let shown: Vec<&str> = errors
                .iter()
                .filter(|e| !e.starts_with("... and"))
                .map(|e| e.split(' ').next().unwrap_or(""))
                .collect();
            prop_assert_eq!(shown, codes, "{:?}: {:?}", pattern, errors);
            prop_assert!(
                names(&output).contains("struct Model"),
                "{pattern:?}: no stub"
            );
        }
    }
    Ok(())
}

/// The names a module defines (items and associated items of the model
/// struct), to compare a stub with a real expansion.
fn names(output: &TokenStream) -> BTreeSet<String> {
    let file: syn::File = syn::parse2(output.clone()).expect("output parses");
    let mut names = BTreeSet::new();
    for item in &file.items {
        if let syn::Item::Mod(module) = item {
            for item in module.content.iter().flat_map(|(_, items)| items) {
                match item {
                    syn::Item::Const(c) if !c.ident.to_string().starts_with("__") => {
                        names.insert(c.ident.to_string());
                    }
                    syn::Item::Fn(f) => {
                        names.insert(format!("fn {}", f.sig.ident));
                    }
                    syn::Item::Struct(s) => {
                        names.insert(format!("struct {}", s.ident));
                        for field in &s.fields {
                            if let Some(ident) = &field.ident {
                                names.insert(format!("{}.{ident}", s.ident));
                            }
                        }
                    }
                    syn::Item::Impl(i) if i.trait_.is_none() => {
                        for item in &i.items {
                            match item {
                                syn::ImplItem::Fn(f) => {
                                    names.insert(format!("impl fn {}", f.sig.ident));
                                }
                                syn::ImplItem::Const(c) => {
                                    names.insert(format!("impl const {}", c.ident));
                                }
                                _ => {}
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    names
}

#[test]
fn every_pattern_code_is_a_compile_error_with_its_code() {
    for (code, pattern) in [
        ("H001", "M*x"),
        ("H002", "M[*E"),
        ("H003", "M*]"),
        ("H004", "M[]"),
        ("H005", "M[[M]]"),
        ("H006", "[E*]"),
        ("H007", "[-*]"),
        ("H008", "[MM]"),
        ("H009", "M*M+"),
        ("H010", "M*/ME/M"),
        ("H011", "M*/[ME]"),
        ("H012", "M{0}"),
    ] {
        let output = expand_str(&format!("preset: \"tiny\", pattern: \"{pattern}\""));
        let errors = errors(&output);
        assert_eq!(errors.len(), 1, "{pattern}: {errors:?}");
        assert!(
            errors[0].starts_with(&format!("[{code}]")),
            "{pattern}: {}",
            errors[0]
        );
        assert!(
            errors[0].contains(&format!("\n    {pattern}\n")),
            "{}",
            errors[0]
        );
        assert!(
            names(&output).contains("struct Model"),
            "{pattern}: no stub"
        );
    }
}

/// A stub has every name of a real expansion of the same pattern, so code
/// written against the model compiles on (and fails only at the real
/// mistake).
#[test]
fn the_stub_has_the_names_of_the_real_module() {
    let valid = expand_str("preset: \"tiny\", pattern: \"M[*E]-/*E\"");
    assert!(errors(&valid).is_empty());
    let broken = expand_str("preset: \"tiny\", pattern: \"M[*E]-/*E\", hidden_size: 0");
    assert_eq!(errors(&broken).len(), 1, "{:?}", errors(&broken));
    let (valid, broken) = (names(&valid), names(&broken));
    let missing: Vec<&String> = valid.difference(&broken).collect();
    assert!(missing.is_empty(), "the stub lacks {missing:?}");
}

#[test]
fn a_model_named_like_a_layer_struct_is_refused() {
    let output = expand(quote! { struct MambaLayer { preset: "tiny", pattern: "M*" } }).unwrap();
    let errors = errors(&output);
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].contains("also the name of a layer struct"),
        "{}",
        errors[0]
    );
    // The stub must not bring the clash back: every struct it defines has a
    // name of its own, so the compiler adds no error of its own (E0428).
    let file: syn::File = syn::parse2(output).expect("output parses");
    let structs: Vec<String> = file
        .items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Mod(module) => module.content.as_ref(),
            _ => None,
        })
        .flat_map(|(_, items)| items)
        .filter_map(|item| match item {
            syn::Item::Struct(s) => Some(s.ident.to_string()),
            _ => None,
        })
        .collect();
    let unique: BTreeSet<&String> = structs.iter().collect();
    assert_eq!(unique.len(), structs.len(), "{structs:?}");
    assert!(structs.contains(&"MambaLayer".to_string()), "{structs:?}");
}

#[test]
fn not_a_declaration_is_an_error_not_a_panic() {
    for input in [
        quote!(),
        quote!(
            fn x() {}
        ),
        quote!(struct),
        quote!(struct M { a: }),
        quote!(struct M ( )),
        quote!(struct M { a: 1 } trailing),
    ] {
        assert!(expand(input).is_err());
    }
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        "[0-9]{1,25}".prop_map(|s| s),
        "-[0-9]{1,3}".prop_map(|s| s),
        "[0-9]{1,3}\\.[0-9]{1,3}".prop_map(|s| s),
        Just("true".to_string()),
        Just("none".to_string()),
        "[a-z_]{1,8}".prop_map(|s| s),
        "\"[ -~]{0,12}\"".prop_map(|s| s.replace('\\', "")),
        Just("{ num_heads: 0 }".to_string()),
        Just("[\"E\", \"group\"]".to_string()),
        Just("[1, x]".to_string()),
    ]
}

fn key() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "pattern",
        "preset",
        "hidden_size",
        "vocab_size",
        "init_std",
        "seq_length",
        "tie_embeddings",
        "attention",
        "mamba",
        "moe",
        "mlp",
        "mtp",
        "ep",
        "pp",
        "first_stage_layers",
        "last_stage_layers",
        "unit_kinds",
        "unit_filter",
        "non_unit_bucket_cap",
        "bogus",
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Arbitrary patterns (bytes of the pattern alphabet and beyond) over a
    /// preset: never a panic, and exactly the planner's verdict: a real
    /// module without errors when it plans, its diagnostics when not.
    #[test]
    fn arbitrary_patterns_never_panic(pattern in "[-M*+DGE\\[\\]|/(){}0-9 xq]{0,24}") {
        assert_expands_as_planned(&pattern)?;
    }

    /// Well-formed patterns (groups ending in their one terminal, ungrouped
    /// layers, MTP depths): every one expands without a single error.
    #[test]
    fn valid_patterns_expand_without_errors(
        items in prop::collection::vec(prop_oneof![
            Just("M"), Just("*"), Just("-"), Just("E"), Just("[M*E]"), Just("[*-]"),
            Just("[ME]"), Just("[M]"), Just("(M[*E]){2}"), Just("M{3}"),
        ], 1..8),
        mtp in prop_oneof![Just(""), Just("/*E"), Just("/M-/M-")],
    ) {
        let pattern = format!("{}{mtp}", items.concat());
        prop_assert!(planner_verdict(&pattern).is_ok(), "{pattern:?} should plan");
        assert_expands_as_planned(&pattern)?;
    }

    /// Arbitrary fields and values: never a panic, and never a stub without
    /// an error or an error beside a real module.
    #[test]
    fn arbitrary_fields_never_panic(
        preset in any::<bool>(),
        fields in prop::collection::vec((key(), value()), 0..6),
    ) {
        // Over a preset most declarations reach the planner.
        let text: Vec<String> = preset
            .then(|| "preset: \"tiny\"".to_string())
            .into_iter()
            .chain(fields.iter().map(|(k, v)| format!("{k}: {v}")))
            .collect();
        let input = format!("pub struct Model {{ {} }}", text.join(", "));
        if let Ok(tokens) = input.parse::<TokenStream>()
            && let Ok(output) = expand(tokens)
        {
            prop_assert!(names(&output).contains("struct Model"));
            let errors = errors(&output);
            prop_assert_eq!(errors.is_empty(), is_real_module(&output), "{}: {:?}", input, errors);
        }
    }
}

/// Absurd sizes are a dimension problem reported once per wrong field, not
/// a crash of the compiler; a size that is merely unusual expands without
/// any error.
#[test]
fn huge_dimensions_do_not_panic() {
    let over = |field: &str| format!("[H025] `{field} = ");
    for (fields, expected) in [
        (
            "preset: \"tiny\", hidden_size: 4000000000000000000",
            vec![over("hidden_size")],
        ),
        (
            "preset: \"tiny\", vocab_size: 9223372036854775807",
            vec![over("vocab_size")],
        ),
        (
            "preset: \"tiny\", pattern: \"E\", moe: { num_experts: 4000000000000, top_k: 1 }",
            vec![over("moe.num_experts")],
        ),
        (
            "preset: \"tiny\", mamba: { num_heads: 4294967296, head_dim: 4294967296 }",
            vec![over("mamba.num_heads"), over("mamba.head_dim")],
        ),
        (
            "preset: \"tiny\", ep: 9223372036854775807",
            vec![
                "[H023] 4 experts do not split over expert-parallel size 9223372036854775807"
                    .to_string(),
            ],
        ),
        (
            "preset: \"tiny\", pp: 0",
            vec!["[H023] `pp` is 0".to_string()],
        ),
        ("preset: \"tiny\", non_unit_bucket_cap: 0", vec![]),
    ] {
        let output = expand_str(fields);
        let errors = errors(&output);
        assert_eq!(errors.len(), expected.len(), "{fields}: {errors:?}");
        for (error, start) in errors.iter().zip(&expected) {
            assert!(error.starts_with(start.as_str()), "{fields}: {error}");
        }
        assert_eq!(is_real_module(&output), expected.is_empty(), "{fields}");
        assert!(names(&output).contains("struct Model"), "{fields}");
    }
}

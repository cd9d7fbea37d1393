//! Plans the resolved declaration with the planner every other front end
//! uses, and turns each of its diagnostics into an error at the right place:
//! pattern mistakes at the pattern literal (the culprit's bytes when the
//! compiler allows), dimension mistakes at the field they name, layout
//! mistakes at the layout field.

use crate::errors::{Errors, field_message, pattern_message, pattern_span};
use crate::fields::{FieldSpans, Resolved};
use hybridgen_dsl::diagnostic::{Code, Diagnostic, Diagnostics};
use hybridgen_dsl::pattern::Pattern;
use hybridgen_dsl::plan::{ParallelLayout, Plan, PlanOptions, UnitFilter};
use proc_macro2::Span;

/// The layout the static tables are planned for. Buckets do not depend on
/// the data-parallel size (it enters only through `const fn`s of `W`), so
/// the smallest one the expert-parallel size allows is used.
pub fn declared_layout(resolved: &Resolved) -> ParallelLayout {
    ParallelLayout {
        dp: resolved.ep.max(1),
        ep: resolved.ep,
        pp: resolved.pp,
        first_stage_layers: resolved.first_stage_layers,
        last_stage_layers: resolved.last_stage_layers,
    }
}

pub fn plan_options(resolved: &Resolved) -> PlanOptions {
    PlanOptions {
        layout: declared_layout(resolved),
        unit_filter: match &resolved.unit_kinds {
            Some(kinds) => UnitFilter::kinds(kinds),
            None => UnitFilter::default(),
        },
        non_unit_bucket_cap: resolved.non_unit_bucket_cap,
    }
}

/// Plans the model, or reports every diagnostic at its place.
pub fn plan(resolved: &Resolved, spans: &FieldSpans, errors: &mut Errors) -> Option<Plan> {
    // No guard against panics here: the planner answers every input with a
    // plan or diagnostics (its size limits keep its arithmetic in range), and
    // a panic is a planner bug, which must not be reported as the user's
    // mistake.
    match Plan::new(&resolved.config, &plan_options(resolved)) {
        Ok(plan) => Some(plan),
        Err(diagnostics) => {
            report_all(&diagnostics, &resolved.config.pattern, spans, errors);
            None
        }
    }
}

/// When the fields themselves are wrong there is no model to plan, but the
/// pattern's own mistakes are independent of them and still reported.
pub fn check_pattern_only(spans: &FieldSpans, errors: &mut Errors) {
    let Some(literal) = &spans.pattern else {
        return;
    };
    let source = literal.value();
    if let Err(diagnostics) = Pattern::parse(&source) {
        report_all(&diagnostics, &source, spans, errors);
    }
}

/// The first [`Diagnostics::MAX_RENDERED`] diagnostics, each at its place,
/// then one error at the pattern saying how many more there are: a pattern
/// of a hundred thousand `]` is as many mistakes.
fn report_all(diagnostics: &Diagnostics, pattern: &str, spans: &FieldSpans, errors: &mut Errors) {
    let shown = diagnostics.items.len().min(Diagnostics::MAX_RENDERED);
    for d in &diagnostics.items[..shown] {
        report(d, pattern, spans, errors);
    }
    let hidden = diagnostics.total() - shown;
    if hidden > 0 {
        let span = spans
            .pattern
            .as_ref()
            .map_or_else(|| spans.origin(), syn::LitStr::span);
        errors.push(
            span,
            format!(
                "... and {hidden} more error{} ({} in total)",
                if hidden == 1 { "" } else { "s" },
                diagnostics.total()
            ),
        );
    }
}

fn report(d: &Diagnostic, pattern: &str, spans: &FieldSpans, errors: &mut Errors) {
    if d.span.is_some() {
        let (span, message) = match &spans.pattern {
            Some(literal) => (pattern_span(literal, d.span), pattern_message(d, pattern)),
            // The pattern came from the preset: show it, point at the preset.
            None => (spans.origin(), pattern_message(d, pattern)),
        };
        errors.push(span, macro_words(&message));
        return;
    }
    let span = match d.code {
        Code::H023 => layout_field(&d.message, spans),
        Code::H020 | Code::H021 | Code::H022 => spans
            .value("pp")
            .or_else(|| spans.value("first_stage_layers"))
            .or_else(|| spans.value("last_stage_layers"))
            .or_else(|| spans.pattern.as_ref().map(syn::LitStr::span)),
        _ => dimension_field(d, spans),
    };
    errors.push(
        span.unwrap_or_else(|| spans.origin()),
        macro_words(&field_message(d)),
    );
}

/// H023 concerns the pipeline size when it names `--pp`, else the
/// expert-parallel size (the data-parallel size is not declared).
fn layout_field(message: &str, spans: &FieldSpans) -> Option<Span> {
    if message.contains("--pp") {
        spans.value("pp")
    } else {
        spans.value("ep")
    }
}

/// A dimension diagnostic names its fields in backticks
/// (`` `attention.num_kv_groups = 3` ``): point at the first one written in
/// the declaration, else at its section, else at a section the message
/// mentions.
fn dimension_field(d: &Diagnostic, spans: &FieldSpans) -> Option<Span> {
    let text = format!("{} {}", d.message, d.help);
    let quoted: Vec<&str> = text
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|q| q.split([' ', '=']).next().unwrap_or(q))
        .collect();
    quoted
        .iter()
        .find_map(|path| spans.value(path))
        .or_else(|| {
            quoted
                .iter()
                .find_map(|path| spans.section(path.split('.').next().unwrap_or(path)))
        })
        .or_else(|| {
            [
                "attention",
                "mla",
                "dsa",
                "gdn",
                "mamba",
                "mlp",
                "moe",
                "mtp",
            ]
            .into_iter()
            .filter(|section| {
                text.split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                    .any(|word| word.eq_ignore_ascii_case(section))
            })
            .find_map(|section| spans.section(section))
        })
}

/// The planner speaks in command-line flags; the macro's user wrote fields.
fn macro_words(message: &str) -> String {
    message
        .replace("--first-stage-layers", "`first_stage_layers`")
        .replace("--last-stage-layers", "`last_stage_layers`")
        .replace("--ep", "`ep`")
        .replace("--pp", "`pp`")
        .replace("--dp", "the data-parallel size")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ast::ModelDecl;
    use crate::fields::resolve;
    use quote::quote;

    fn errors_of(tokens: proc_macro2::TokenStream) -> Vec<String> {
        let decl: ModelDecl = syn::parse2(tokens).unwrap();
        let mut errors = Errors::default();
        let (resolved, spans) = resolve(&decl, &mut errors);
        match resolved {
            Some(r) => {
                plan(&r, &spans, &mut errors);
            }
            None => check_pattern_only(&spans, &mut errors),
        }
        errors.messages()
    }

    #[test]
    fn pattern_errors_carry_code_and_caret() {
        let errors = errors_of(quote! { struct M { preset: "tiny", pattern: "M[[M]]" } });
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("[H005]"), "{}", errors[0]);
        assert!(errors[0].contains("    M[[M]]\n      ^"), "{}", errors[0]);
    }

    #[test]
    fn pattern_errors_survive_field_errors() {
        let errors = errors_of(quote! { struct M { preset: "tiny", pattern: "Mx", hidden: 3 } });
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors.iter().any(|e| e.starts_with("[H001]")));
    }

    #[test]
    fn dimension_and_layout_errors_are_coded() {
        let errors = errors_of(quote! {
            struct M { preset: "tiny", pattern: "M*E", attention: { num_kv_groups: 3 }, ep: 3 }
        });
        assert!(errors.iter().any(|e| e.starts_with("[H025]")), "{errors:?}");
        assert!(errors.iter().any(|e| e.starts_with("[H023]")), "{errors:?}");
        let errors = errors_of(quote! { struct M { preset: "tiny", pattern: "M*", mamba: none } });
        assert!(errors.iter().any(|e| e.starts_with("[H026]")), "{errors:?}");
        let errors = errors_of(quote! { struct M { preset: "tiny", pattern: "M*|M*|M*", pp: 2 } });
        assert!(errors.iter().any(|e| e.starts_with("[H020]")), "{errors:?}");
    }

    #[test]
    fn a_flood_of_errors_is_capped_with_a_count() {
        let pattern = "]".repeat(120_000);
        for tokens in [
            quote! { struct M { preset: "tiny", pattern: #pattern } },
            // With a field error too: the pattern alone is checked.
            quote! { struct M { preset: "tiny", pattern: #pattern, hidden: 3 } },
        ] {
            let errors = errors_of(tokens);
            let flood: Vec<_> = errors.iter().filter(|e| e.starts_with("[H003]")).collect();
            assert_eq!(flood.len(), Diagnostics::MAX_RENDERED, "{}", errors.len());
            assert_eq!(
                errors.last().map(String::as_str),
                Some("... and 119950 more errors (120000 in total)")
            );
            // Each shows a window of the line, not the 120,000 characters.
            assert!(errors.iter().all(|e| e.len() < 1000), "{}", errors[0]);
        }
    }
}

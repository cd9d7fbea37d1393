//! The error collector: every mistake of one `model!` invocation is gathered
//! here and reported in one compile, each at its culprit's span.

use hybridgen_dsl::diagnostic::Diagnostic;
use hybridgen_dsl::span::Span as ByteSpan;
use proc_macro2::{Span, TokenStream};
use syn::LitStr;

/// Mistakes found so far, in the order found.
#[derive(Default)]
pub struct Errors {
    errors: Vec<syn::Error>,
}

impl Errors {
    pub fn push(&mut self, span: Span, message: impl std::fmt::Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    pub fn push_error(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    pub fn len(&self) -> usize {
        self.errors.len()
    }

    /// One `compile_error!` per mistake.
    pub fn to_compile_errors(&self) -> TokenStream {
        self.errors
            .iter()
            .map(syn::Error::to_compile_error)
            .collect()
    }

    /// The messages, for tests and for the build-script API.
    pub fn messages(&self) -> Vec<String> {
        self.errors.iter().map(ToString::to_string).collect()
    }
}

/// Where a pattern diagnostic points: the culprit's bytes inside the string
/// literal when the compiler can say so (`Literal::subspan` is nightly-only
/// inside the compiler), else the whole literal.
pub fn pattern_span(literal: &LitStr, culprit: Option<ByteSpan>) -> Span {
    let Some(culprit) = culprit else {
        return literal.span();
    };
    let token = literal.token();
    let text = token.to_string();
    // Byte offsets in the literal's value equal offsets in its source text
    // shifted by the opening quote, unless escapes change lengths.
    let (opening, closing) = if let Some(raw) = text.strip_prefix('r') {
        let hashes = raw.len() - raw.trim_start_matches('#').len();
        (2 + hashes, 1 + hashes)
    } else if text.starts_with('"') && !text.contains('\\') {
        (1, 1)
    } else {
        return literal.span();
    };
    let start = culprit.start.saturating_add(opening);
    let end = culprit
        .end
        .max(culprit.start.saturating_add(1))
        .saturating_add(opening);
    if end > text.len().saturating_sub(closing) {
        return literal.span();
    }
    token.subspan(start..end).unwrap_or_else(|| literal.span())
}

/// The `compile_error!` text of a diagnostic whose span points into the
/// pattern: code, message, the pattern with a caret, help.
pub fn pattern_message(diagnostic: &Diagnostic, pattern: &str) -> String {
    diagnostic.render_inline(pattern)
}

/// The `compile_error!` text of a diagnostic with no place in the pattern.
pub fn field_message(diagnostic: &Diagnostic) -> String {
    let mut plain = diagnostic.clone();
    plain.span = None;
    plain.render_inline("")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literal(source: &str) -> LitStr {
        syn::parse_str(source).unwrap()
    }

    #[test]
    fn culprit_spans_fall_back_to_the_literal_with_escapes() {
        let lit = literal(r#""M\u{2a}x""#);
        let whole = lit.span();
        let at = pattern_span(&lit, Some(ByteSpan::new(2, 3)));
        assert_eq!(format!("{at:?}"), format!("{whole:?}"));
    }

    #[test]
    fn out_of_range_culprits_do_not_panic() {
        for source in [r#""M""#, r##"r#"M"#"##, r#""""#] {
            let lit = literal(source);
            for (start, end) in [
                (0, 0),
                (0, 1),
                (1, 1),
                (5, 9),
                (usize::MAX / 2, 0),
                (usize::MAX, usize::MAX),
            ] {
                let _ = pattern_span(&lit, Some(ByteSpan::new(start, end)));
            }
        }
    }
}

//! The `model!` input as written: a struct-like declaration whose fields are
//! `name: value` pairs. This stage only reads tokens; what the fields mean is
//! decided by [`crate::fields`].
//!
//! ```text
//! /// docs
//! pub struct Tiny {
//!     pattern: "M[*E]M[*E]",
//!     preset: "tiny",
//!     hidden_size: 64,
//!     attention: { num_heads: 4, num_kv_groups: 2 },
//!     unit_kinds: ["group", "E"],
//! }
//! ```
//!
//! Values are read leniently (a value is whatever stands before the next
//! comma), so one malformed value is reported at its place and the other
//! fields are still checked.

use proc_macro2::{Delimiter, Span, TokenTree};
use syn::parse::{Parse, ParseStream};
use syn::{Attribute, Ident, Lit, LitStr, Token, Visibility};

/// The whole declaration.
pub struct ModelDecl {
    /// Outer attributes: doc comments and anything to forward (`#[cfg]`).
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub name: Ident,
    /// The span of the `{ ... }` holding the fields.
    pub brace_span: Span,
    pub fields: Vec<Field>,
}

/// `name: value`.
pub struct Field {
    pub name: Ident,
    pub value: Value,
}

/// A field's value, classified by its shape only.
pub enum Value {
    Lit(Lit),
    /// `-` followed by a literal.
    Negative(Span, Lit),
    /// A bare word: `none`, `true`, `rope`, ...
    Word(Ident),
    /// `{ name: value, ... }`.
    Section {
        span: Span,
        fields: Vec<Field>,
    },
    /// `[value, ...]`.
    List {
        span: Span,
        items: Vec<Value>,
    },
    /// Anything else; reported where it starts.
    Other(Span),
}

impl Value {
    pub fn span(&self) -> Span {
        match self {
            Value::Lit(lit) => lit.span(),
            Value::Negative(span, _) => *span,
            Value::Word(ident) => ident.span(),
            Value::Section { span, .. } | Value::List { span, .. } | Value::Other(span) => *span,
        }
    }

    /// What the value looks like, for "expected X, found Y" messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Value::Lit(Lit::Str(_)) => "a string",
            Value::Lit(Lit::Int(_)) | Value::Negative(_, Lit::Int(_)) => "a whole number",
            Value::Lit(Lit::Float(_)) | Value::Negative(_, Lit::Float(_)) => "a number",
            Value::Lit(Lit::Bool(_)) => "a boolean",
            Value::Lit(_) | Value::Negative(..) => "a literal",
            Value::Word(_) => "a word",
            Value::Section { .. } => "a `{ ... }` section",
            Value::List { .. } => "a `[ ... ]` list",
            Value::Other(_) => "an expression",
        }
    }

    pub fn as_str(&self) -> Option<&LitStr> {
        match self {
            Value::Lit(Lit::Str(s)) => Some(s),
            _ => None,
        }
    }
}

impl Parse for ModelDecl {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        if !input.peek(Token![struct]) {
            return Err(input.error(
                "expected `struct Name { ... }`: a model is declared like a struct, e.g. `pub struct Tiny { pattern: \"M*E\", preset: \"tiny\" }`",
            ));
        }
        input.parse::<Token![struct]>()?;
        let name: Ident = input.parse()?;
        if input.peek(Token![<]) {
            return Err(input.error("a model declaration takes no generic parameters"));
        }
        let content;
        let brace = syn::braced!(content in input);
        let fields = parse_fields(&content)?;
        if !input.is_empty() {
            return Err(input.error(
                "unexpected tokens after the model declaration: one `model!` declares one model",
            ));
        }
        Ok(ModelDecl {
            attrs,
            vis,
            name,
            brace_span: brace.span.join(),
            fields,
        })
    }
}

/// `name: value, name: value, ...` with an optional trailing comma. Doc
/// comments on fields are allowed and ignored.
fn parse_fields(input: ParseStream) -> syn::Result<Vec<Field>> {
    let mut fields = Vec::new();
    while !input.is_empty() {
        for attr in input.call(Attribute::parse_outer)? {
            if !attr.path().is_ident("doc") {
                return Err(syn::Error::new_spanned(
                    attr,
                    "only doc comments are allowed on model fields",
                ));
            }
        }
        let name: Ident = input.parse()?;
        if !input.peek(Token![:]) {
            return Err(input.error(format!(
                "expected `:` after `{name}`: fields are written `name: value`"
            )));
        }
        input.parse::<Token![:]>()?;
        let value = parse_value(input)?;
        fields.push(Field { name, value });
        if input.is_empty() {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    Ok(fields)
}

fn parse_value(input: ParseStream) -> syn::Result<Value> {
    // Everything up to the next top-level comma is this value.
    let tokens = input.step(|cursor| {
        let mut rest = *cursor;
        let mut tokens = Vec::new();
        while let Some((tt, next)) = rest.token_tree() {
            if matches!(&tt, TokenTree::Punct(p) if p.as_char() == ',') {
                break;
            }
            tokens.push(tt);
            rest = next;
        }
        Ok((tokens, rest))
    })?;
    classify(tokens, input.span())
}

fn classify(tokens: Vec<TokenTree>, end: Span) -> syn::Result<Value> {
    match tokens.as_slice() {
        [] => Err(syn::Error::new(end, "expected a value after `:`")),
        [TokenTree::Literal(lit)] => Ok(Value::Lit(Lit::new(lit.clone()))),
        [TokenTree::Punct(minus), TokenTree::Literal(lit)] if minus.as_char() == '-' => {
            Ok(Value::Negative(minus.span(), Lit::new(lit.clone())))
        }
        [TokenTree::Ident(ident)] => Ok(match ident.to_string().as_str() {
            "true" | "false" => {
                Value::Lit(Lit::Bool(syn::LitBool::new(ident == "true", ident.span())))
            }
            _ => Value::Word(ident.clone()),
        }),
        [TokenTree::Group(group)] if group.delimiter() == Delimiter::Brace => {
            let fields = syn::parse::Parser::parse2(parse_fields, group.stream())?;
            Ok(Value::Section {
                span: group.span(),
                fields,
            })
        }
        [TokenTree::Group(group)] if group.delimiter() == Delimiter::Bracket => {
            let items = syn::parse::Parser::parse2(parse_list, group.stream())?;
            Ok(Value::List {
                span: group.span(),
                items,
            })
        }
        [TokenTree::Group(group)] if group.delimiter() == Delimiter::None => {
            // A value passed through a `macro_rules!` fragment arrives wrapped
            // in an invisible group.
            classify(group.stream().into_iter().collect(), group.span())
        }
        [first, ..] => Ok(Value::Other(first.span())),
    }
}

fn parse_list(input: ParseStream) -> syn::Result<Vec<Value>> {
    let mut items = Vec::new();
    while !input.is_empty() {
        items.push(parse_value(input)?);
        if input.is_empty() {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    #[test]
    fn reads_a_declaration_with_sections_lists_and_docs() {
        let decl: ModelDecl = syn::parse2(quote! {
            /// A model.
            pub(crate) struct Tiny {
                /// the layers
                pattern: "M[*E]",
                hidden_size: 64,
                init_std: 0.02,
                tie_embeddings: true,
                attention: { num_heads: 4, position: rope },
                unit_kinds: ["group", "E"],
                odd: 1 + 2,
                neg: -3,
            }
        })
        .unwrap();
        assert_eq!(decl.name, "Tiny");
        assert_eq!(decl.attrs.len(), 1);
        let names: Vec<String> = decl.fields.iter().map(|f| f.name.to_string()).collect();
        assert_eq!(
            names,
            [
                "pattern",
                "hidden_size",
                "init_std",
                "tie_embeddings",
                "attention",
                "unit_kinds",
                "odd",
                "neg"
            ]
        );
        assert!(matches!(decl.fields[3].value, Value::Lit(Lit::Bool(_))));
        match &decl.fields[4].value {
            Value::Section { fields, .. } => {
                assert!(matches!(fields[1].value, Value::Word(_)));
            }
            _ => panic!("expected a section"),
        }
        match &decl.fields[5].value {
            Value::List { items, .. } => assert_eq!(items.len(), 2),
            _ => panic!("expected a list"),
        }
        assert!(matches!(decl.fields[6].value, Value::Other(_)));
        assert!(matches!(decl.fields[7].value, Value::Negative(..)));
    }

    #[test]
    fn rejects_what_is_not_a_struct_declaration() {
        for input in [
            quote! { enum Tiny {} },
            quote! { struct Tiny<T> {} },
            quote! { struct Tiny { pattern "M" } },
            quote! { struct Tiny { pattern: } },
            quote! { struct Tiny {} struct Other {} },
            quote! { struct Tiny { #[serde] pattern: "M" } },
        ] {
            assert!(syn::parse2::<ModelDecl>(input).is_err());
        }
    }
}

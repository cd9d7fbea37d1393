//! The typed layer structs: one struct per distinct logical-layer shape
//! (`MambaLayer`, `AttentionMoeGroup`, ...) whose fields name the members by
//! kind, one `MtpDepth` struct for the multi-token-prediction depths, and
//! the model struct holding one of them per logical layer and per depth.
//!
//! A struct's values are read from the `MODULES` and `LAYER_HANDLES` tables
//! by a `const fn`, so a model of any depth costs one struct per shape and a
//! few tokens per layer.

use hybridgen_dsl::pattern::{Item, LayerKind, Pattern};
use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote};

/// The struct for one logical-layer shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    pub name: String,
    pub kinds: Vec<LayerKind>,
    pub is_group: bool,
}

fn camel(kind: LayerKind) -> &'static str {
    match kind {
        LayerKind::Mamba => "Mamba",
        LayerKind::Attention => "Attention",
        LayerKind::Mla => "Mla",
        LayerKind::Dsa => "Dsa",
        LayerKind::GatedDeltaNet => "GatedDeltaNet",
        LayerKind::Mlp => "Mlp",
        LayerKind::Moe => "Moe",
    }
}

impl Shape {
    /// `M` -> `MambaLayer`, `[*E]` -> `AttentionMoeGroup`.
    pub fn of(kinds: Vec<LayerKind>, is_group: bool) -> Shape {
        let mut name: String = kinds.iter().map(|&k| camel(k)).collect();
        name.push_str(if is_group { "Group" } else { "Layer" });
        Shape {
            name,
            kinds,
            is_group,
        }
    }

    pub fn ident(&self) -> Ident {
        Ident::new(&self.name, Span::call_site())
    }
}

/// The layout of the model struct: each logical layer's shape, the MTP
/// depth's kinds, and the distinct shapes in order of first appearance.
pub struct ModelShape {
    /// Per logical layer, an index into `shapes`.
    pub layers: Vec<usize>,
    pub shapes: Vec<Shape>,
    pub mtp_depths: usize,
    /// The kinds of one MTP depth (all depths are the same, H010).
    pub mtp_kinds: Vec<LayerKind>,
}

/// The name of the MTP depth struct.
pub const MTP_DEPTH: &str = "MtpDepth";

impl ModelShape {
    pub fn of(pattern: &Pattern) -> ModelShape {
        let mut shapes: Vec<Shape> = Vec::new();
        let mut layers = Vec::with_capacity(pattern.logical_count());
        for item in pattern.items() {
            let kinds: Vec<LayerKind> = item.layers().iter().map(|l| l.kind).collect();
            let shape = Shape::of(kinds, matches!(item, Item::Group(_)));
            let index = match shapes.iter().position(|s| *s == shape) {
                Some(i) => i,
                None => {
                    shapes.push(shape);
                    shapes.len() - 1
                }
            };
            layers.push(index);
        }
        ModelShape {
            layers,
            shapes,
            mtp_depths: pattern.mtp_depths.len(),
            mtp_kinds: pattern
                .mtp_depths
                .first()
                .map(|d| d.layers.iter().map(|l| l.kind).collect())
                .unwrap_or_default(),
        }
    }

    /// Every name this generates beside the model struct.
    pub fn type_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.shapes
            .iter()
            .map(|s| s.name.as_str())
            .chain((self.mtp_depths > 0).then_some(MTP_DEPTH))
    }

    /// The layer struct definitions.
    pub fn structs(&self) -> TokenStream {
        let mut out = TokenStream::new();
        for shape in &self.shapes {
            let symbols: String = shape.kinds.iter().map(|k| k.symbol()).collect();
            let names: Vec<&str> = shape.kinds.iter().map(|k| k.name()).collect();
            let description = if shape.is_group {
                format!(
                    "A group `[{symbols}]`: {}, built as one nested stack (one FSDP unit under the default filter).",
                    names.join(", then ")
                )
            } else {
                format!("An ungrouped layer `{symbols}`: {}.", names.join(""))
            };
            out.extend(layer_struct(
                &shape.ident(),
                &description,
                &shape.kinds,
                quote!(index),
            ));
        }
        if self.mtp_depths > 0 {
            let symbols: String = self.mtp_kinds.iter().map(|k| k.symbol()).collect();
            out.extend(layer_struct(
                &format_ident!("{MTP_DEPTH}"),
                &format!("A multi-token-prediction depth `{symbols}`: its own small stack, on the last pipeline stage."),
                &self.mtp_kinds,
                quote!(LOGICAL_LAYERS + index),
            ));
        }
        out
    }

    /// The model struct's fields and its `new()` body.
    pub fn model_fields(&self) -> (TokenStream, TokenStream) {
        let mut fields = TokenStream::new();
        let mut values = TokenStream::new();
        for (i, &shape) in self.layers.iter().enumerate() {
            let field = format_ident!("layer_{i}");
            let ty = self.shapes[shape].ident();
            let index = proc_macro2::Literal::usize_unsuffixed(i);
            fields.extend(quote!(pub #field: #ty,));
            values.extend(quote!(#field: #ty::at(#index),));
        }
        let mtp = format_ident!("{MTP_DEPTH}");
        for d in 0..self.mtp_depths {
            let field = format_ident!("mtp_{d}");
            let index = proc_macro2::Literal::usize_unsuffixed(d);
            fields.extend(quote!(pub #field: #mtp,));
            values.extend(quote!(#field: #mtp::at(#index),));
        }
        (fields, values)
    }
}

/// Field names by kind (`mamba`, `attention`, `moe`); a kind that appears
/// more than once (possible in MTP depths: `/MM`) is numbered by position.
pub fn member_fields(kinds: &[LayerKind]) -> Vec<Ident> {
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

pub fn kind_tokens(kind: LayerKind) -> TokenStream {
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

/// `module`: the entry in `MODULES` for `index` (a logical index, or an
/// MTP depth offset past the logical layers).
fn layer_struct(
    name: &Ident,
    description: &str,
    kinds: &[LayerKind],
    module: TokenStream,
) -> TokenStream {
    let fields = member_fields(kinds);
    let field_docs = kinds
        .iter()
        .map(|k| format!("The `{}` member ({}).", k.symbol(), k.name()));
    let handles = (0..kinds.len()).map(|j| {
        if j == 0 {
            quote!(LAYER_HANDLES[module.first_handle])
        } else {
            let j = proc_macro2::Literal::usize_unsuffixed(j);
            quote!(LAYER_HANDLES[module.first_handle + #j])
        }
    });
    let kind_list = kinds.iter().map(|&k| kind_tokens(k));
    quote! {
        #[doc = #description]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct #name {
            /// Logical index (for an MTP depth: the depth).
            pub index: usize,
            /// Module path, FSDP unit, schedule node, first layer handle.
            pub module: __rows::ModuleEntry,
            #(
                #[doc = #field_docs]
                pub #fields: __model::LayerHandle,
            )*
        }

        impl #name {
            /// The members' kinds, in order.
            pub const KINDS: &[__Kind] = &[#(#kind_list),*];

            /// The module at `index`, read from `MODULES` and
            /// `LAYER_HANDLES`. `index` must be one of this shape: the model
            /// struct's `new()` builds every layer with the right one.
            pub const fn at(index: usize) -> Self {
                let module = MODULES[#module];
                #name {
                    index,
                    module,
                    #(#fields: #handles,)*
                }
            }

            /// The overlap schedule's five slots for this module (its first
            /// schedule node).
            pub const fn slots(&self) -> __model::SlotTable {
                SLOT_TABLES[self.module.node]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_named_by_kinds_and_shared() {
        let pattern = Pattern::parse("M[*E]M[*E]-[M*-]/*E").unwrap();
        let shape = ModelShape::of(&pattern);
        let names: Vec<&str> = shape.type_names().collect();
        assert_eq!(
            names,
            [
                "MambaLayer",
                "AttentionMoeGroup",
                "MlpLayer",
                "MambaAttentionMlpGroup",
                "MtpDepth"
            ]
        );
        assert_eq!(shape.layers, [0, 1, 0, 1, 2, 3]);
    }

    #[test]
    fn repeated_kinds_are_numbered() {
        let names = member_fields(&[LayerKind::Mamba, LayerKind::Mamba, LayerKind::Moe]);
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["mamba_0", "mamba_1", "moe"]);
    }
}

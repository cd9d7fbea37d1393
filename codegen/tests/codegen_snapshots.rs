//! Snapshots of what `model!` expands to, formatted with prettyplease so a
//! reviewer reads the generated module as a user's editor would show it.
//! Update with `INSTA_UPDATE=always cargo test -p hybridgen-codegen --test codegen_snapshots`
//! and review the diff.

use hybridgen_codegen::expand;
use proc_macro2::TokenStream;
use quote::quote;

fn pretty(input: TokenStream) -> String {
    let output = expand(input).expect("a model declaration");
    let file: syn::File = syn::parse2(output).expect("generated code parses");
    prettyplease::unparse(&file)
}

#[test]
fn grouped_attention_moe() {
    insta::assert_snapshot!(pretty(quote! {
        /// Two GPT-like layers, each one group and one FSDP unit.
        pub struct Grouped {
            preset: "tiny",
            pattern: "[*E][*E]",
            moe: { num_experts: 2, top_k: 1, shared_expert_ffn_hidden_size: none },
        }
    }));
}

#[test]
fn mixed_with_mtp_and_unit_kinds() {
    insta::assert_snapshot!(pretty(quote! {
        pub(crate) struct Mixed {
            preset: "tiny",
            pattern: "M[*E]-/*E",
            hidden_size: 32,
            vocab_size: 128,
            attention: { num_heads: 2, num_kv_groups: 1, head_dim: 16 },
            mamba: { num_heads: 2 },
            moe: { num_experts: 2, top_k: 1, shared_expert_ffn_hidden_size: none },
            ep: 2,
            unit_kinds: ["group", "mtp"],
        }
    }));
}

#[test]
fn ungrouped_dense() {
    insta::assert_snapshot!(pretty(quote! {
        struct Dense {
            pattern: "M*-",
            hidden_size: 16,
            vocab_size: 100,
            tie_embeddings: true,
            attention: { num_heads: 2, num_kv_groups: 2, position: rope },
            mamba: { num_heads: 2, head_dim: 8, num_groups: 1, state_size: 4 },
            mlp: { ffn_hidden_size: 32, activation: swiglu },
        }
    }));
}

/// An invalid declaration: the errors, then a stub with the same names.
#[test]
fn errors_and_stub() {
    insta::assert_snapshot!(pretty(quote! {
        pub struct Broken {
            preset: "tiny",
            pattern: "M[*E]M[[-]]",
            attention: { num_kv_groups: 3 },
        }
    }));
}

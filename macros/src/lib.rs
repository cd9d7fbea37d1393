//! The `model!` macro. All of its logic (reading the declaration, planning,
//! generating) lives in [`hybridgen_dsl::codegen`], shared with the command
//! line and with build scripts; use it through the `hybridgen` facade,
//! whose documentation describes the syntax.

use proc_macro::TokenStream;

/// Declares a hybrid model and plans it at build time. See `hybridgen::model!`.
#[proc_macro]
pub fn model(input: TokenStream) -> TokenStream {
    hybridgen_dsl::codegen::expand(input.into())
        .unwrap_or_else(|error| error.into_compile_error())
        .into()
}

//! trybuild cases for `model!`: every pattern error code and every
//! dimension, layout and field error the macro can see fails to compile with
//! the code and a pointer at the culprit (`tests/ui/fail/*.stderr`); the pass
//! cases compile and run.
//!
//! Regenerate the expected output with the pinned toolchain:
//! `TRYBUILD=overwrite cargo test --test macro_ui`, then review each file.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}

//! The backend conformance suite (`hybridgen_runtime::conformance`) on the
//! CPU backend, in f32 and in bf16: every kernel against the suite's f64
//! reference, dtype and size refusals, bit-repeatability. Another backend's
//! tests call `conformance::run_all` the same way.

use hybridgen_runtime::Precision;
use hybridgen_runtime::conformance::{self, CheckKind, Options};
use hybridgen_runtime::cpu::CpuBackend;

fn run(precision: Precision) -> conformance::Report {
    let report = conformance::run_all(&CpuBackend::new(precision), &Options::default());
    // The figures, for `--nocapture`: largest errors per kernel.
    println!("{report}");
    report
}

/// The methods of `Backend` that are not kernels: identity, statistics,
/// the kernels' scratch estimate, arena selection and the provided view
/// helpers (plain view arithmetic, the same for every backend).
const NOT_KERNELS: [&str; 16] = [
    "name",
    "compute_dtype",
    "stats",
    "kernel_scratch",
    "in_arena",
    "buf_len",
    "slice",
    "slice_mut",
    "split_mut",
    "as_slice",
    "slice_len",
    "subslice",
    "subslice_mut",
    "reborrow_mut",
    "view",
    "view_mut",
];

/// Every kernel of the `Backend` trait, read from its source (the trait in
/// backend/mod.rs, and each kernel family's methods in the `*_methods` macro
/// of its file, which the trait expands): a kernel added to the trait
/// without conformance checks fails this test.
fn backend_kernels() -> Vec<String> {
    let source = include_str!("../src/backend/mod.rs");
    let start = source
        .find("pub trait Backend")
        .expect("backend/mod.rs declares `pub trait Backend`");
    let body = &source[start..];
    let mut bodies = vec![&body[..body.find("\n}\n").expect("the trait's closing brace")]];
    for family in [
        include_str!("../src/backend/attention.rs"),
        include_str!("../src/backend/conv.rs"),
        include_str!("../src/backend/delta.rs"),
        include_str!("../src/backend/dense.rs"),
        include_str!("../src/backend/layout.rs"),
        include_str!("../src/backend/lookup.rs"),
        include_str!("../src/backend/moe.rs"),
        include_str!("../src/backend/norm.rs"),
        include_str!("../src/backend/optim.rs"),
        include_str!("../src/backend/scan.rs"),
        include_str!("../src/backend/sparse_attention.rs"),
    ] {
        if let Some(start) = family.find("macro_rules!") {
            let methods = &family[start..];
            bodies.push(&methods[..methods.find("\npub(super) use").expect("the macro's use")]);
        }
    }
    let body = bodies.concat();
    let kernels: Vec<String> = body
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix("fn "))
        .map(|rest| {
            rest.split(['(', '<'])
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .filter(|name| !NOT_KERNELS.contains(&name.as_str()))
        .collect();
    assert!(
        kernels.len() > 50,
        "read only {} kernels from backend/",
        kernels.len()
    );
    kernels
}

/// Every kernel has value checks and refusal checks: a suite that silently
/// checked nothing would also be "clean".
fn assert_covers_every_kernel(report: &conformance::Report) {
    for kernel in backend_kernels() {
        let of = |kind| {
            report
                .checks
                .iter()
                .filter(|c| c.kernel == kernel && c.kind == kind)
                .count()
        };
        // `download`'s values are checked by the upload round-trips (a
        // value cannot be seen without it), `finish_download`'s by
        // `start_download`'s (the two halves of one read).
        let values_needed = !matches!(kernel.as_str(), "download" | "finish_download");
        assert!(
            !values_needed || of(CheckKind::Values) > 0,
            "no value checks for `{kernel}`"
        );
        // Any length and dtype are valid for these.
        let refusals_needed = !matches!(kernel.as_str(), "alloc" | "alloc_uninit" | "zero");
        assert!(
            !refusals_needed || of(CheckKind::Refusal) > 0,
            "no refusal checks for `{kernel}`"
        );
    }
}

#[test]
fn cpu_backend_conforms_in_f32() {
    let report = run(Precision::F32);
    assert_covers_every_kernel(&report);
    assert!(report.is_clean(), "{report}");
}

#[test]
fn cpu_backend_conforms_in_bf16() {
    let report = run(Precision::Bf16);
    assert_covers_every_kernel(&report);
    // bf16 runs also check bf16 inputs into f32 outputs and back.
    assert!(
        report
            .checks
            .iter()
            .any(|c| c.case.contains("bf16 in, f32 out")),
        "no mixed-dtype checks in bf16"
    );
    assert!(report.is_clean(), "{report}");
}

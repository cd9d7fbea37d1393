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

/// Every kernel family has value checks and refusal checks: a suite that
/// silently checked nothing would also be "clean".
fn assert_covers_every_kernel(report: &conformance::Report) {
    let kernels = [
        "alloc",
        "upload",
        "download",
        "copy",
        "cast",
        "fill",
        "zero",
        "matmul",
        "axpy",
        "scale",
        "copy_cols",
        "column_sum",
        "rmsnorm_forward",
        "rmsnorm_backward_input",
        "rmsnorm_backward_weight",
        "unary_forward",
        "unary_backward",
        "silu_mul_forward",
        "silu_mul_backward",
        "conv1d_forward",
        "conv1d_backward_input",
        "conv1d_backward_weight",
        "ssd_scan_forward",
        "ssd_scan_backward",
        "attention_forward",
        "attention_backward",
        "rotary_forward",
        "rotary_backward",
        "embedding_forward",
        "embedding_backward",
        "cross_entropy_forward",
        "cross_entropy_backward",
        "moe_route_forward",
        "moe_route_backward",
        "gather_rows",
        "scatter_rows",
        "moe_unpermute",
        "moe_unpermute_backward",
        "adam_update",
        "sgd_update",
        "sum_squares_blocks",
    ];
    for kernel in kernels {
        let of = |kind| {
            report
                .checks
                .iter()
                .filter(|c| c.kernel == kernel && c.kind == kind)
                .count()
        };
        let values_needed = !matches!(kernel, "download");
        assert!(
            !values_needed || of(CheckKind::Values) > 0,
            "no value checks for `{kernel}`"
        );
        let refusals_needed = !matches!(kernel, "alloc" | "zero");
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

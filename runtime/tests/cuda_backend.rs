//! The CUDA backend on a GPU: the backend conformance suite (every kernel
//! against the suite's f64 reference, refusals, bit-repeatability) in f32
//! and bf16, and the parts of the device that are not kernels: lanes on
//! streams ordered by events, the host queue's fence, arenas that reuse
//! memory only after its last users ran, and traces in GPU time.
//!
//! Each test is `#[ignore = "needs a GPU"]`: the binary is built on a
//! machine without CUDA (`scripts/cuda_bundle.sh`) and run on one with it
//! with `--include-ignored`; run without a GPU, a test fails saying why.

use hybridgen_runtime::backend::{
    Backend, BatchLayout, BatchedMatmulDims, GroupedMatmul, MatmulDims, ScanDims, ScanGrads,
    ScanInputs, SegmentedMatmul, Slice, Tokens,
};
use hybridgen_runtime::conformance::{self, Options};
use hybridgen_runtime::cpu::CpuBackend;
use hybridgen_runtime::cuda::ops::scan_chunked::ScanChunkPlan;
use hybridgen_runtime::cuda::{CudaBackend, CudaBuf, CudaLane, Gpu, probe};
use hybridgen_runtime::lane::{Event, Label, Lane};
use hybridgen_runtime::trace::TraceRecorder;
use hybridgen_runtime::view::DType;
use hybridgen_runtime::{Precision, RuntimeError};
use std::sync::Arc;
use std::time::Duration;

/// The first GPU bound to a host queue. The tests that call this are
/// `#[ignore]`d: a machine without a GPU fails them rather than passing
/// them unrun.
fn gpu(precision: Precision) -> CudaBackend {
    if let Err(why) = probe() {
        panic!("needs a GPU: {why}");
    }
    let gpu = Gpu::open(0, precision, Duration::from_secs(60)).expect("the probed GPU opens");
    gpu.backend("host").expect("a host queue")
}

// CUDA's expf/logf/tanhf are within 2 ulp of libm's (CUDA C Programming
// Guide, "Mathematical Functions"): twice the CPU's tolerances covers them;
// anything looser is a bug.
fn options() -> Options {
    Options {
        slack: 2.0,
        ..Options::default()
    }
}

/// Every family but two, each checked on a GPU elsewhere: the gated delta
/// rule's (its cases save states every 1 to 8 steps, and the GPU kernels
/// take chunks of 64 only: `cuda_kernels_run`'s delta family compares them
/// with the CPU at 64) and DeepSeek sparse attention's (run with the rest of
/// that family's GPU tests in `cuda_sparse_attention.rs`).
fn conformance_of(backend: &CudaBackend) {
    let mut suite = conformance::Suite::new(backend, &options());
    for family in conformance::Family::ALL {
        if !matches!(
            family,
            conformance::Family::Delta | conformance::Family::SparseAttention
        ) {
            suite.run(family);
        }
    }
    let report = suite.finish();
    println!("{report}");
    assert!(report.is_clean(), "{report}");
}

/// One family of the suite, with the same slack as the whole.
fn family_conforms(backend: &CudaBackend, family: conformance::Family) {
    let mut suite = conformance::Suite::new(backend, &options());
    suite.run(family);
    let report = suite.finish();
    println!("{report}");
    assert!(report.is_clean(), "{report}");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_backend_conforms_in_f32() {
    let backend = gpu(Precision::F32);
    conformance_of(&backend);
}

/// In bf16 the Mamba scan runs its sequential kernels here: the chunked
/// path's products take bf16 operands (see [`every_scan_path_conforms`]),
/// which `both_scan_paths_match_the_cpu_at_real_widths` holds instead.
#[test]
#[ignore = "needs a GPU"]
fn cuda_backend_conforms_in_bf16() {
    let backend = gpu(Precision::Bf16);
    conformance_of(&backend.with_scan_scratch(0));
}

/// Attention takes cuBLAS with every KV head in one batched call by
/// default (the suite's sequences are short). A cap of 700 bytes of scratch
/// cuts the suite's 9-token, 3-KV-head case into one call per KV head (a
/// head's 9 x 9 scores and probabilities take 648 bytes, 8 an entry in f32
/// and in split bf16) and sends its 17-token cases to the tiled kernels; a
/// cap of 0 sends every case there. Each path must conform on its own.
#[test]
#[ignore = "needs a GPU"]
fn every_attention_path_conforms() {
    for precision in [Precision::F32, Precision::Bf16] {
        let backend = gpu(precision);
        for cap in [700, 0] {
            println!("{precision:?}, attention scratch capped at {cap} bytes");
            family_conforms(
                &backend.clone().with_attention_scratch(cap),
                conformance::Family::Attention,
            );
        }
    }
}

/// The Mamba scan takes its chunked path (cuBLAS) by default, in slices
/// of chunks under a smaller cap, and the sequential kernels under a cap
/// of 0: each must conform on its own, forward and backward (the suite's
/// sequences have 2 to 6 chunk items; 3 a slice cuts some into two
/// slices). With bf16 outputs the chunked path's products take bf16
/// operands, as mamba_ssm's do: their rounding is more than the suite's
/// element-wise bounds allow (one rounding at the store, which the CPU
/// reaches 0.99 of), so there `both_scan_paths_match_the_cpu_at_real_widths`
/// holds it, at odd shapes too.
#[test]
#[ignore = "needs a GPU"]
fn every_scan_path_conforms() {
    for precision in [Precision::F32, Precision::Bf16] {
        let backend = gpu(precision);
        for cap in [6 << 10, 0] {
            if precision == Precision::Bf16 && cap != 0 {
                continue;
            }
            println!("{precision:?}, scan scratch capped at {cap} bytes");
            family_conforms(
                &backend.clone().with_scan_scratch(cap),
                conformance::Family::Mamba,
            );
        }
    }
}

/// The backend's default runs the suite's 16-byte aligned grouped cases
/// on the grouped GEMM kernel (Hopper; views three elements off take
/// cuBLAS); with it off (`--expert-gemm cublas`) every grouped case takes
/// cuBLAS, which must conform on its own too.
#[test]
#[ignore = "needs a GPU"]
fn the_cublas_expert_path_conforms() {
    for precision in [Precision::F32, Precision::Bf16] {
        let backend = gpu(precision);
        family_conforms(
            &backend.with_grouped_gemm(false),
            conformance::Family::Dense,
        );
    }
}

/// At the benchmark model's expert sizes (hidden 2,048, width 1,024; 700
/// to 1,300 rows an expert) the grouped kernel and cuBLAS sum each output
/// in the same order (K-steps of 16 in order, f32), so the experts' three
/// GEMMs (forward, input gradient, and the weight gradient added to f32
/// gradients) give the same bits either way, and `--expert-gemm` changes
/// speed only. Off Hopper both take cuBLAS.
#[test]
#[ignore = "needs a GPU"]
fn the_grouped_gemm_kernel_gives_cublas_bits_at_expert_sizes() {
    let host = gpu(Precision::Bf16);
    let (hidden, width) = (2048, 1024);
    let rows = [700usize, 1024, 1301];
    let mut seed = 7u64;
    let mut inputs = Vec::new();
    for &r in &rows {
        let x = put(
            &host,
            &uniform(&mut seed, r * hidden, -2.0, 2.0),
            DType::Bf16,
        );
        let w = put(
            &host,
            &uniform(&mut seed, width * hidden, -2.0, 2.0),
            DType::Bf16,
        );
        let dy = put(
            &host,
            &uniform(&mut seed, r * width, -2.0, 2.0),
            DType::Bf16,
        );
        let grad = uniform(&mut seed, width * hidden, -2.0, 2.0);
        inputs.push((r, x, w, dy, grad));
    }
    let run = |grouped: bool| -> Vec<Vec<f32>> {
        let dev = host.clone().with_grouped_gemm(grouped);
        let mut outs = Vec::new();
        let mut bufs = Vec::new();
        for (r, _, _, _, grad) in &inputs {
            bufs.push((
                dev.alloc(r * width, DType::Bf16).unwrap(),
                dev.alloc(r * hidden, DType::Bf16).unwrap(),
                put(&dev, grad, DType::F32),
            ));
        }
        // Two groups, as the experts' layer makes them: one type per C.
        let (mut problems, mut weight_grads) = (Vec::new(), Vec::new());
        for ((r, x, w, dy, _), (y, dx, dw)) in inputs.iter().zip(&mut bufs) {
            let r = *r;
            problems.push(GroupedMatmul::<CudaBackend> {
                a: dev.view(x).unwrap(),
                b: dev.view(w).unwrap(),
                c: dev.view_mut(y).unwrap(),
                dims: MatmulDims::linear(r, hidden, width),
            });
            problems.push(GroupedMatmul::<CudaBackend> {
                a: dev.view(dy).unwrap(),
                b: dev.view(w).unwrap(),
                c: dev.view_mut(dx).unwrap(),
                dims: MatmulDims::linear_input_grad(r, hidden, width, false),
            });
            weight_grads.push(GroupedMatmul::<CudaBackend> {
                a: dev.view(dy).unwrap(),
                b: dev.view(x).unwrap(),
                c: dev.view_mut(dw).unwrap(),
                dims: MatmulDims::linear_weight_grad(r, hidden, width),
            });
        }
        dev.grouped_matmul(problems).unwrap();
        dev.grouped_matmul(weight_grads).unwrap();
        for ((r, ..), (y, dx, dw)) in inputs.iter().zip(&bufs) {
            outs.push(get(&dev, y, r * width));
            outs.push(get(&dev, dx, r * hidden));
            let mut wide = vec![0.0f32; width * hidden];
            dev.download(dev.view(dw).unwrap(), &mut wide).unwrap();
            outs.push(wide);
        }
        outs
    };
    let (cublas, grouped) = (run(false), run(true));
    for (i, (a, b)) in cublas.iter().zip(&grouped).enumerate() {
        let what = ["forward", "input gradient", "weight gradient"][i % 3];
        let differ = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "expert {} ({} rows), {what}: {differ} of {} values differ from cuBLAS's",
            i / 3,
            rows[i / 3],
            a.len()
        );
    }
}

/// The experts' GEMMs with each expert's rows read on the device
/// (`segmented_matmul`, the MoE layer's path at expert parallelism 1) give
/// the bits of the same GEMMs with the rows known on the host
/// (`grouped_matmul` over each expert's slices): the forward, the input
/// gradient and the weight gradient added to f32 gradients, with experts
/// of no rows, of one row, and of rows that are not a multiple of the
/// kernels' 128-row tile. Each output row is one dot product over K in the
/// same order either way, and rows past an expert's end are neither
/// stored nor summed, so a difference in any bit is a segment read wrong.
/// Off Hopper both take cuBLAS and the test compares cuBLAS with itself.
#[test]
#[ignore = "needs a GPU"]
fn segmented_expert_gemms_give_the_bits_of_host_sized_ones() {
    let dev = gpu(Precision::Bf16).with_grouped_gemm(true);
    let (hidden, width) = (512, 256);
    let counts: [u32; 8] = [0, 1, 130, 131, 200, 0, 700, 64];
    let total: usize = counts.iter().map(|&c| c as usize).sum();
    let starts: Vec<usize> = counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c as usize;
            Some(start)
        })
        .collect();
    let mut seed = 11u64;
    let x = put(
        &dev,
        &uniform(&mut seed, total * hidden, -2.0, 2.0),
        DType::Bf16,
    );
    let dy = put(
        &dev,
        &uniform(&mut seed, total * width, -2.0, 2.0),
        DType::Bf16,
    );
    let w: Vec<CudaBuf> = counts
        .iter()
        .map(|_| {
            put(
                &dev,
                &uniform(&mut seed, width * hidden, -2.0, 2.0),
                DType::Bf16,
            )
        })
        .collect();
    let grads: Vec<Vec<f32>> = counts
        .iter()
        .map(|_| uniform(&mut seed, width * hidden, -2.0, 2.0))
        .collect();
    let rows = dev.alloc(counts.len(), DType::U32).unwrap();
    dev.upload(&counts, dev.view_mut(&rows).unwrap()).unwrap();
    // The forward, the input gradient and every expert's weight gradient.
    let run = |segmented: bool| -> Vec<Vec<f32>> {
        let y = dev.alloc(total * width, DType::Bf16).unwrap();
        let dx = dev.alloc(total * hidden, DType::Bf16).unwrap();
        let dw: Vec<CudaBuf> = grads.iter().map(|g| put(&dev, g, DType::F32)).collect();
        let weights = || w.iter().map(|b| dev.view(b).unwrap()).collect::<Vec<_>>();
        let forward = MatmulDims::linear(total, hidden, width);
        let input_grad = MatmulDims::linear_input_grad(total, hidden, width, false);
        let weight_grad = MatmulDims::linear_weight_grad(total, hidden, width);
        if segmented {
            dev.segmented_matmul(
                dev.view(&rows).unwrap(),
                vec![
                    SegmentedMatmul::Rows {
                        a: dev.view(&x).unwrap(),
                        b: weights(),
                        c: dev.view_mut(&y).unwrap(),
                        dims: forward,
                    },
                    SegmentedMatmul::Rows {
                        a: dev.view(&dy).unwrap(),
                        b: weights(),
                        c: dev.view_mut(&dx).unwrap(),
                        dims: input_grad,
                    },
                ],
            )
            .unwrap();
            dev.segmented_matmul(
                dev.view(&rows).unwrap(),
                vec![SegmentedMatmul::Depth {
                    a: dev.view(&dy).unwrap(),
                    b: dev.view(&x).unwrap(),
                    c: dw.iter().map(|g| dev.view_mut(g).unwrap()).collect(),
                    dims: weight_grad,
                }],
            )
            .unwrap();
        } else {
            let (mut products, mut weight_grads) = (Vec::new(), Vec::new());
            for (e, (&count, &start)) in counts.iter().zip(&starts).enumerate() {
                let (n, end) = (count as usize, start + count as usize);
                if n == 0 {
                    continue;
                }
                let x_rows = dev.slice(&x, start * hidden..end * hidden).unwrap();
                let dy_rows = dev.slice(&dy, start * width..end * width).unwrap();
                products.push(GroupedMatmul::<CudaBackend> {
                    a: x_rows,
                    b: dev.view(&w[e]).unwrap(),
                    c: dev.slice_mut(&y, start * width..end * width).unwrap(),
                    dims: MatmulDims::linear(n, hidden, width),
                });
                products.push(GroupedMatmul::<CudaBackend> {
                    a: dy_rows,
                    b: dev.view(&w[e]).unwrap(),
                    c: dev.slice_mut(&dx, start * hidden..end * hidden).unwrap(),
                    dims: MatmulDims::linear_input_grad(n, hidden, width, false),
                });
                weight_grads.push(GroupedMatmul::<CudaBackend> {
                    a: dy_rows,
                    b: x_rows,
                    c: dev.view_mut(&dw[e]).unwrap(),
                    dims: MatmulDims::linear_weight_grad(n, hidden, width),
                });
            }
            dev.grouped_matmul(products).unwrap();
            dev.grouped_matmul(weight_grads).unwrap();
        }
        let mut outs = vec![get(&dev, &y, total * width), get(&dev, &dx, total * hidden)];
        for g in &dw {
            let mut wide = vec![0.0f32; width * hidden];
            dev.download(dev.view(g).unwrap(), &mut wide).unwrap();
            outs.push(wide);
        }
        outs
    };
    let (host_sized, segmented) = (run(false), run(true));
    for (i, (a, b)) in host_sized.iter().zip(&segmented).enumerate() {
        let what = match i {
            0 => "the forward".to_string(),
            1 => "the input gradient".to_string(),
            e => format!(
                "expert {} ({} rows)'s weight gradient",
                e - 2,
                counts[e - 2]
            ),
        };
        let differ = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differ, 0, "{what}: {differ} of {} values differ", a.len());
    }
}

/// RMSNorm's backward in one pass (`rmsnorm_backward`: dx and the weight
/// gradient's partial sums, the views 16-byte aligned) gives the two-pass
/// way's dx bits (each row's sums taken in the same shape) and partial sums
/// within rounding of its (the rows of a slice added in another order);
/// and the two-pass way 8 channels a thread gives the scalar kernels'
/// partial-sum bits. The two-pass way is reached with the partials one
/// element into their buffer (8 channels a thread), the scalar one with
/// every view one element in. Rows span 69 slices, the last one short; dy
/// is bf16 or f32 (the layers sum it in f32), x bf16 or f32; groups of
/// 2,048 and 512 channels (the benchmark's pre-norm and Mamba's gated
/// norm), and of 264 (no one-pass kernel: the two-pass way either way).
#[test]
#[ignore = "needs a GPU"]
fn the_norm_backward_in_one_pass_matches_the_two_pass_way() {
    let dev = gpu(Precision::Bf16);
    let rows = 1100usize;
    let mut seed = 11u64;
    for (dim, groups, one_pass) in [(2048usize, 1usize, true), (4096, 8, true), (2112, 8, false)] {
        let n = rows * dim;
        let dy = uniform(&mut seed, n, -2.0, 2.0);
        let x = uniform(&mut seed, n, -2.0, 2.0);
        let w = uniform(&mut seed, dim, -2.0, 2.0);
        let dx0 = uniform(&mut seed, n, -2.0, 2.0);
        let rstd = uniform(&mut seed, rows * groups, 0.5, 2.0);
        let dims = hybridgen_runtime::backend::NormDims {
            rows,
            dim,
            groups,
            eps: 1e-5,
        };
        let len = dims.weight_partials_len();
        for (dy_t, x_t) in [
            (DType::Bf16, DType::Bf16),
            (DType::F32, DType::Bf16),
            (DType::F32, DType::F32),
        ] {
            // `values` in a buffer of `dtype`, starting `at` elements in.
            let placed = |values: &[f32], dtype: DType, at: usize| {
                let mut padded = vec![0.0f32; at];
                padded.extend_from_slice(values);
                put(&dev, &padded, dtype)
            };
            let read = |buf: &CudaBuf, at: usize, len: usize| -> Vec<f32> {
                let wide = dev.alloc(len, DType::F32).unwrap();
                let from = dev.slice(buf, at..at + len).unwrap();
                dev.cast(from, dev.view_mut(&wide).unwrap()).unwrap();
                let mut out = vec![0.0f32; len];
                dev.download(dev.view(&wide).unwrap(), &mut out).unwrap();
                out
            };
            // (dx, partials) with the views `at` and the partials `p_at`
            // elements into their buffers.
            let run = |at: usize, p_at: usize| -> (Vec<f32>, Vec<f32>) {
                let (dyb, xb) = (placed(&dy, dy_t, at), placed(&x, x_t, at));
                let (wb, dxb) = (placed(&w, x_t, at), placed(&dx0, x_t, at));
                let rstdb = put(&dev, &rstd, DType::F32);
                let pb = placed(&vec![f32::NAN; len], DType::F32, p_at);
                dev.rmsnorm_backward_input(
                    dev.slice(&dyb, at..at + n).unwrap(),
                    dev.slice(&xb, at..at + n).unwrap(),
                    dev.slice(&wb, at..at + dim).unwrap(),
                    dev.view(&rstdb).unwrap(),
                    dev.slice_mut(&dxb, at..at + n).unwrap(),
                    None,
                    dev.slice_mut(&pb, p_at..p_at + len).unwrap(),
                    dims,
                )
                .unwrap();
                (read(&dxb, at, n), read(&pb, p_at, len))
            };
            let what = format!("{groups} groups of {dim}, dy {dy_t}, x {x_t}");
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let (one, two, scalar) = (run(0, 0), run(0, 1), run(1, 1));
            let differ = |a: &[f32], b: &[f32]| {
                bits(a)
                    .iter()
                    .zip(bits(b))
                    .filter(|(a, b)| **a != *b)
                    .count()
            };
            assert_eq!(
                differ(&one.0, &two.0),
                0,
                "{what}: dx differs between one pass and two"
            );
            assert_eq!(
                differ(&two.1, &scalar.1),
                0,
                "{what}: the 8-channel partial sums differ from the scalar ones"
            );
            if !one_pass {
                assert_eq!(differ(&one.1, &two.1), 0, "{what}: the same kernels ran");
                continue;
            }
            // Each partial adds 16 terms of magnitude up to 4 * 2: the two
            // orders agree within a few roundings of that sum.
            let worst = one
                .1
                .iter()
                .zip(&two.1)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= 4e-4,
                "{what}: one-pass partial sums off by {worst}"
            );
            assert!(
                differ(&one.1, &two.1) > 0,
                "{what}: the one-pass kernel did not run"
            );
        }
    }
}

/// `Backend::batched_matmul` against a loop of `Backend::matmul` on
/// packed copies of each matrix, at the `D` layer's shapes (16 heads of
/// DeepSeek's widths: dn = dv = 128, kv_rank 512, 300 rows): the absorbed
/// queries (A of interleaved heads, B weight blocks), the value
/// up-projection (B^T) and dW_UK (A^T, C += into f32 weight blocks), in f32
/// and bf16 storage. The two call different cuBLAS routines (a strided
/// batch; `cublasGemmEx` or cuBLASLt), which may sum in other orders, so
/// the bound is two summations' worth: `2 k u sum |a b|` in f32 (u =
/// 2^-24), plus one bf16 ulp of the result (at most 2^-7 |c|: the two
/// round nearby f32 values) for a bf16 `C`.
/// How many elements agree bit for bit is printed.
#[test]
#[ignore = "needs a GPU"]
fn batched_matmul_matches_a_loop_of_matmuls() {
    let (heads, rows, dn, kr) = (16, 300, 128, 512);
    let blocks = BatchLayout {
        pitch: kr,
        stride: 2 * dn * kr,
    };
    let cases = [
        (
            "absorbed queries",
            MatmulDims::linear_input_grad(rows, kr, dn, false),
            [
                BatchLayout::heads(heads, dn + 64),
                blocks,
                BatchLayout::heads(heads, kr + 64),
            ],
        ),
        (
            "value up-projection",
            MatmulDims::linear(rows, kr, dn),
            [
                BatchLayout::heads(heads, kr),
                blocks,
                BatchLayout::heads(heads, dn),
            ],
        ),
        (
            "dW_UK",
            MatmulDims::linear_weight_grad(rows, kr, dn),
            [
                BatchLayout::heads(heads, dn + 64),
                BatchLayout::heads(heads, kr + 64),
                blocks,
            ],
        ),
    ];
    let cpu = CpuBackend::new(Precision::F32);
    for precision in [Precision::F32, Precision::Bf16] {
        let dev = gpu(precision);
        let ab = precision.compute_dtype();
        let mut seed = 11u64;
        for (name, d, [la, lb, lc]) in cases {
            let dims = BatchedMatmulDims {
                batch: heads,
                dims: d,
                a: la,
                b: lb,
                c: lc,
            };
            // Weight gradients accumulate in f32; the rest is stored as
            // the activations are.
            let c_dtype = if d.accumulate { DType::F32 } else { ab };
            let span = |which: usize| {
                let (r, w) = dims.stored()[which];
                dims.layouts()[which].span(heads, r, w).unwrap()
            };
            let host: [Vec<f32>; 3] = [0, 1, 2].map(|w| uniform(&mut seed, span(w), -2.0, 2.0));
            let [a, b, c] = [(0, ab), (1, ab), (2, c_dtype)].map(|(w, t)| put(&dev, &host[w], t));
            // The values as stored (bf16-rounded where stored in bf16).
            let stored = [(0, &a), (1, &b), (2, &c)].map(|(w, buf)| get(&dev, buf, host[w].len()));
            dev.batched_matmul(
                dev.view(&a).unwrap(),
                dev.view(&b).unwrap(),
                dev.view_mut(&c).unwrap(),
                dims,
            )
            .unwrap();
            let batched = get(&dev, &c, host[2].len());
            let pack = |v: &[f32], which: usize, i: usize| -> Vec<f32> {
                let (r, w) = dims.stored()[which];
                (0..r)
                    .flat_map(|row| (0..w).map(move |col| (row, col)))
                    .map(|(row, col)| v[dims.at(which, i, row, col)])
                    .collect()
            };
            let (mut same, mut total) = (0usize, 0usize);
            for i in 0..heads {
                let [pa, pb, pc] = [0, 1, 2].map(|w| pack(&stored[w], w, i));
                let (ba, bb, bc) = (
                    put(&dev, &pa, ab),
                    put(&dev, &pb, ab),
                    put(&dev, &pc, c_dtype),
                );
                dev.matmul(
                    dev.view(&ba).unwrap(),
                    dev.view(&bb).unwrap(),
                    dev.view_mut(&bc).unwrap(),
                    d,
                )
                .unwrap();
                let looped = get(&dev, &bc, pc.len());
                // `sum_p |a b|` (+ `|c|` when accumulating): the same matmul
                // of the absolute values, on the CPU.
                let magnitude = {
                    let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
                    let [ma, mb, mc] = [&pa, &pb, &pc].map(|v| put(&cpu, &abs(v), DType::F32));
                    cpu.matmul(
                        cpu.view(&ma).unwrap(),
                        cpu.view(&mb).unwrap(),
                        cpu.view_mut(&mc).unwrap(),
                        d,
                    )
                    .unwrap();
                    get(&cpu, &mc, pc.len())
                };
                for r in 0..d.m {
                    for j in 0..d.n {
                        let mag = magnitude[r * d.n + j] as f64;
                        let want = looped[r * d.n + j];
                        let got = batched[dims.at(2, i, r, j)];
                        let mut bound = 2.0 * d.k as f64 * mag / (1u64 << 24) as f64;
                        if c_dtype == DType::Bf16 {
                            bound += want.abs() as f64 / 128.0;
                        }
                        let err = (got as f64 - want as f64).abs();
                        assert!(
                            err <= bound,
                            "{name} ({precision}): head {i} ({r}, {j}): batched {got} vs \
                             looped {want} (error {err:e}, bound {bound:e})"
                        );
                        same += usize::from(got.to_bits() == want.to_bits());
                        total += 1;
                    }
                }
            }
            println!("{name} ({precision}): {same} of {total} elements the same bits");
        }
    }
}

/// Values uniform in `[lo, hi)` from a fixed-seed generator.
fn uniform(seed: &mut u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((*seed >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// `values` in a new buffer of `dtype` on `dev` (uploaded as f32, cast
/// there, so every backend rounds them the same way).
fn put<B: Backend>(dev: &B, values: &[f32], dtype: DType) -> B::Buf {
    let wide = dev.alloc(values.len(), DType::F32).unwrap();
    dev.upload(values, dev.view_mut(&wide).unwrap()).unwrap();
    let buf = dev.alloc(values.len(), dtype).unwrap();
    dev.cast(dev.view(&wide).unwrap(), dev.view_mut(&buf).unwrap())
        .unwrap();
    buf
}

/// `buf`'s values widened to f32.
fn get<B: Backend>(dev: &B, buf: &B::Buf, len: usize) -> Vec<f32> {
    let wide = dev.alloc(len, DType::F32).unwrap();
    dev.cast(dev.view(buf).unwrap(), dev.view_mut(&wide).unwrap())
        .unwrap();
    let mut out = vec![0.0f32; len];
    dev.download(dev.view(&wide).unwrap(), &mut out).unwrap();
    out
}

/// A scan problem's inputs (xbc, dt, dt_bias, a_log, d, dy) and the states
/// the CPU forward saves for them.
struct ScanProblem {
    dims: ScanDims,
    inputs: [Vec<f32>; 6],
    grads_in: [Vec<f32>; 2],
}

/// Views of a problem's inputs on `dev` (`bufs` as [`ScanProblem::inputs`]).
fn scan_inputs<'a, B: Backend>(dev: &B, bufs: &'a [B::Buf; 6]) -> ScanInputs<Slice<'a, B>> {
    ScanInputs {
        xbc: dev.view(&bufs[0]).unwrap(),
        dt: dev.view(&bufs[1]).unwrap(),
        dt_bias: dev.view(&bufs[2]).unwrap(),
        a_log: dev.view(&bufs[3]).unwrap(),
        d: dev.view(&bufs[4]).unwrap(),
    }
}

/// The scan forward on `dev`: y and the chunk states.
fn scan_forward<B: Backend>(dev: &B, p: &ScanProblem, dtype: DType) -> [Vec<f32>; 2] {
    let bufs = p.inputs.each_ref().map(|v| put(dev, v, dtype));
    let y_len = p.inputs[5].len();
    let y = dev.alloc(y_len, dtype).unwrap();
    let states = dev.alloc(p.dims.states_len(), DType::F32).unwrap();
    dev.ssd_scan_forward(
        scan_inputs(dev, &bufs),
        dev.view_mut(&y).unwrap(),
        dev.view_mut(&states).unwrap(),
        p.dims,
    )
    .unwrap();
    [get(dev, &y, y_len), get(dev, &states, p.dims.states_len())]
}

/// The largest error of `got` against `expected`, relative to the largest
/// expected value (printed, and bounded by `bound`).
fn check_close(what: &str, got: &[f32], expected: &[f32], bound: f32) {
    let scale = expected
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(1e-30);
    let worst = got
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let rel = worst / scale;
    println!("{what}: error {rel:.2e} of its largest value {scale:.3e}");
    assert!(
        rel <= bound && got.iter().all(|v| v.is_finite()),
        "{what}: {rel:e} > {bound:e}"
    );
}

/// The scan backward on `dev`: d_xbc, d_dt, d_a_log, d_d, with the chunk
/// states of the CPU's forward.
fn scan_backward<B: Backend>(
    dev: &B,
    p: &ScanProblem,
    states: &[f32],
    dtype: DType,
) -> [Vec<f32>; 4] {
    let bufs = p.inputs.each_ref().map(|v| put(dev, v, dtype));
    let states = put(dev, states, DType::F32);
    let d_xbc = dev.alloc(p.inputs[0].len(), dtype).unwrap();
    let d_dt = dev.alloc(p.inputs[1].len(), dtype).unwrap();
    let [d_a_log, d_d] = p.grads_in.each_ref().map(|v| put(dev, v, DType::F32));
    let grads = ScanGrads {
        xbc: dev.view_mut(&d_xbc).unwrap(),
        dt: dev.view_mut(&d_dt).unwrap(),
        a_log: dev.view_mut(&d_a_log).unwrap(),
        d: dev.view_mut(&d_d).unwrap(),
    };
    dev.ssd_scan_backward(
        scan_inputs(dev, &bufs),
        dev.view(&states).unwrap(),
        dev.view(&bufs[5]).unwrap(),
        grads,
        p.dims,
    )
    .unwrap();
    [
        get(dev, &d_xbc, p.inputs[0].len()),
        get(dev, &d_dt, p.inputs[1].len()),
        get(dev, &d_a_log, p.grads_in[0].len()),
        get(dev, &d_d, p.grads_in[1].len()),
    ]
}

/// The scan's chunked path (whole, and in slices of 3 chunks) and its
/// sequential kernels, forward and backward, against the CPU backend at
/// real widths (P = 64, N = 128, groups of 8 and 4 heads), with inputs of
/// order one: whole chunks of 256, many chunks of 64 with decays near 1
/// (the states and carries cross every chunk) and a last chunk cut short
/// (in bf16 these take the tensor-core `_mma` kernels); at odd widths,
/// which take the element-wise kernels (not the `_quads` ones); and with
/// large groups in chunks of 48 and 64 (in bf16 the GEMM paths the `_mma`
/// kernels replace). Each output's largest
/// error, relative to its largest value, is printed and bounded.
#[test]
#[ignore = "needs a GPU"]
fn both_scan_paths_match_the_cpu_at_real_widths() {
    for precision in [Precision::F32, Precision::Bf16] {
        let gpu = gpu(precision);
        let cpu = CpuBackend::new(precision);
        let dtype = precision.compute_dtype();
        // Output rounding: bf16 keeps 8 bits.
        let bound = if dtype == DType::F32 { 2e-4 } else { 2e-2 };
        let mut seed = 0x5ca9u64;
        // batch, seq, heads, head dim, groups, state, chunk, slow decays
        for (batch, seq, heads, head_dim, groups, state, chunk, slow) in [
            (
                1usize, 512usize, 16usize, 64usize, 2usize, 128usize, 256usize, false,
            ),
            (2, 700, 8, 64, 2, 128, 64, true),
            (1, 300, 8, 64, 2, 128, 256, false),
            (2, 75, 6, 10, 3, 21, 16, false),
            // 20 heads a group in chunks of 48: the `_quads` scores without
            // their sums, and in bf16 the forward's M X as GEMMs (chunks of
            // 48 are not whole blocks of `ssd_chunk_scores_times_mma`).
            (1, 200, 20, 64, 1, 16, 48, false),
            // 12 heads of 48 a group: in bf16 the backward's dM as GEMMs
            // and `ssd_chunk_scores_sums_bf16` (the `_mma` kernels take
            // the first three cases and the three below: heads of 64 or
            // 80, at most 16 a group).
            (1, 256, 12, 48, 1, 32, 64, false),
            // Nemotron-H 9B's group: 16 heads of 80; the same with partial
            // last chunks; 16 heads of 64.
            (1, 512, 32, 80, 2, 128, 256, false),
            (2, 300, 32, 80, 2, 64, 128, false),
            (1, 200, 16, 64, 1, 32, 64, false),
        ] {
            let dims = ScanDims {
                tokens: Tokens::new(batch, seq),
                heads,
                head_dim,
                groups,
                state,
                chunk,
            };
            let rows = batch * seq;
            let (dt_lo, dt_hi, a_lo, a_hi) = if slow {
                (-5.0, -3.0, -1.0, 0.0)
            } else {
                (-2.0, 1.0, -1.0, 1.0)
            };
            let p = ScanProblem {
                dims,
                inputs: [
                    uniform(&mut seed, rows * dims.xbc_width(), -1.5, 1.5),
                    uniform(&mut seed, rows * heads, dt_lo, dt_hi),
                    uniform(&mut seed, heads, -1.0, 0.5),
                    uniform(&mut seed, heads, a_lo, a_hi),
                    uniform(&mut seed, heads, -1.0, 1.0),
                    uniform(&mut seed, rows * heads * head_dim, -1.0, 1.0),
                ],
                grads_in: [
                    uniform(&mut seed, heads, -1.0, 1.0),
                    uniform(&mut seed, heads, -1.0, 1.0),
                ],
            };
            // The CPU forward's chunk states, as the backward receives them.
            let forward = scan_forward(&cpu, &p, dtype);
            let states = &forward[1];
            let expected = scan_backward(&cpu, &p, states, dtype);
            let slices = ScanChunkPlan::cap_for(dims, 3).unwrap();
            for (path, dev) in [
                ("chunked", gpu.clone()),
                (
                    "chunked, 3 chunks a slice",
                    gpu.clone().with_scan_scratch(slices),
                ),
                ("sequential", gpu.clone().with_scan_scratch(0)),
            ] {
                let case = format!(
                    "{precision:?} {batch}x{seq} H{heads} P{head_dim} G{groups} N{state} c{chunk}{} {path}",
                    if slow { " slow" } else { "" }
                );
                let got = scan_forward(&dev, &p, dtype);
                for (name, (g, e)) in ["y", "states"].iter().zip(got.iter().zip(&forward)) {
                    check_close(&format!("{case}: {name}"), g, e, bound);
                }
                let got = scan_backward(&dev, &p, states, dtype);
                for (name, (g, e)) in ["d_xbc", "d_dt", "d_a_log", "d_d"]
                    .iter()
                    .zip(got.iter().zip(&expected))
                {
                    check_close(&format!("{case}: {name}"), g, e, bound);
                }
            }
        }
    }
}

fn lane(host: &CudaBackend, name: &str, trace: Option<Arc<TraceRecorder>>) -> CudaLane {
    CudaLane::on_gpu(name, host, 0, Duration::from_secs(60), trace).expect("a lane")
}

/// Work the host queue enqueued before a submission is ordered before the
/// lane's work: the lane fences on the host queue on the GPU, the host never
/// waits, so a missing fence shows as the lane reading `a` too early.
#[test]
#[ignore = "needs a GPU"]
fn lane_work_is_ordered_after_the_host_queues_work() {
    let host = gpu(Precision::F32);
    use hybridgen_runtime::view::DType;
    let n = 1 << 22;
    let a = Arc::new(host.alloc(n, DType::F32).unwrap());
    let b = Arc::new(host.alloc(n, DType::F32).unwrap());
    let compute = lane(&host, "compute", None);
    // The host queue's work is long; `a` becomes 1 only at its end.
    for _ in 0..300 {
        host.scale(host.view_mut(&a).unwrap(), 1.0).unwrap();
    }
    host.fill(host.view_mut(&a).unwrap(), 1.0).unwrap();
    let (a1, b1) = (a.clone(), b.clone());
    compute.submit(
        Label::new("copy", "forward"),
        &[],
        Box::new(move |dev: &CudaBackend| dev.axpy(1.0, dev.view(&a1)?, dev.view_mut(&b1)?)),
    );
    compute.synchronize().unwrap();
    let mut out = vec![0.0f32; n];
    host.download(host.view(&b).unwrap(), &mut out).unwrap();
    let wrong = out.iter().filter(|&&v| v != 1.0).count();
    assert_eq!(wrong, 0, "{wrong} of {n} wrong, e.g. {:?}", &out[..4]);
}

/// Work on one lane that another waits for through an event sees its
/// results, however long the first takes on the GPU: the wait is on the
/// GPU (`cuStreamWaitEvent`), so one left out shows as wrong values.
#[test]
#[ignore = "needs a GPU"]
fn lanes_are_ordered_by_events() {
    let host = gpu(Precision::F32);
    use hybridgen_runtime::view::DType;
    let n = 1 << 22;
    let a = Arc::new(host.alloc(n, DType::F32).unwrap());
    let b = Arc::new(host.alloc(n, DType::F32).unwrap());
    host.fill(host.view_mut(&a).unwrap(), 1.0).unwrap();
    let compute = lane(&host, "compute", None);
    let comm = lane(&host, "comm", None);
    let (a1, b1) = (a.clone(), b.clone());
    // Long work on the compute stream, ending with b = a.
    let slow = compute.submit(
        Label::new("slow", "forward"),
        &[],
        Box::new(move |dev: &CudaBackend| {
            for _ in 0..200 {
                dev.scale(dev.view_mut(&a1)?, 1.0)?;
            }
            dev.axpy(1.0, dev.view(&a1)?, dev.view_mut(&b1)?)
        }),
    );
    // Doubles b once the compute lane's work ran.
    let b2 = b.clone();
    let after = comm.submit(
        Label::new("after", "reduce"),
        &[slow],
        Box::new(move |dev: &CudaBackend| dev.scale(dev.view_mut(&b2)?, 2.0)),
    );
    after.wait().unwrap();
    let mut out = vec![0.0f32; n];
    host.download(host.view(&b).unwrap(), &mut out).unwrap();
    let wrong = out.iter().filter(|&&v| v != 2.0).count();
    assert_eq!(wrong, 0, "{wrong} of {n} wrong, e.g. {:?}", &out[..4]);
    compute.synchronize().unwrap();
    comm.synchronize().unwrap();
}

/// A buffer dropped right after its (long) work was enqueued on one lane
/// is not handed to another lane until that work ran: the two lanes are
/// ordered on the host only (a channel), never on the GPU, so only the
/// arena's fence keeps the first lane's late writes out of the second
/// lane's new buffer. Once a step's allocations have been made, repeating
/// the step allocates nothing.
#[test]
#[ignore = "needs a GPU"]
fn arenas_reuse_memory_only_after_its_last_users_ran() {
    let host = gpu(Precision::F32);
    use hybridgen_runtime::view::DType;
    let compute = lane(&host, "compute", None);
    let comm = lane(&host, "comm", None);
    let n = 1 << 22;
    for step in 0..3 {
        let before = host.stats();
        let (dropped, released) = std::sync::mpsc::channel::<()>();
        compute.submit(
            Label::new("writer", "forward"),
            &[],
            Box::new(move |dev: &CudaBackend| {
                let scratch = dev.alloc(n, DType::F32)?;
                for _ in 0..300 {
                    dev.fill(dev.view_mut(&scratch)?, 7.0)?;
                }
                // Dropped here, long before the fills ran on the GPU.
                drop(scratch);
                let _ = dropped.send(());
                Ok(())
            }),
        );
        let reader = comm.submit(
            Label::new("reader", "reduce"),
            &[],
            Box::new(move |dev: &CudaBackend| {
                released
                    .recv_timeout(Duration::from_secs(60))
                    .map_err(|e| RuntimeError::Numeric(format!("the writer never ran: {e}")))?;
                let mine = dev.alloc(n, DType::F32)?;
                let mut out = vec![1.0f32; n];
                dev.download(dev.view(&mine)?, &mut out)?;
                let late = out.iter().filter(|&&v| v != 0.0).count();
                if late > 0 {
                    return Err(RuntimeError::Numeric(format!(
                        "a new buffer held {late} of another lane's late writes"
                    )));
                }
                Ok(())
            }),
        );
        reader.wait().unwrap();
        compute.synchronize().unwrap();
        comm.synchronize().unwrap();
        let during = host.stats() - before;
        if step > 0 {
            assert_eq!(during.allocations, 0, "step {step}: {during:?}");
        }
    }
}

/// Traces show each lane's work at its GPU times: a span per submission, in
/// order on each lane, and work that waited on another lane's event starts
/// after that work ended.
#[test]
#[ignore = "needs a GPU"]
fn traces_show_work_at_gpu_times() {
    let host = gpu(Precision::F32);
    let trace = Arc::new(TraceRecorder::new());
    let compute = lane(&host, "compute", Some(trace.clone()));
    let comm = lane(&host, "comm", Some(trace.clone()));
    let n = 1 << 22;
    let x = Arc::new(host.alloc(n, hybridgen_runtime::view::DType::F32).unwrap());
    let x1 = x.clone();
    let first = compute.submit(
        Label::new("long", "forward"),
        &[],
        Box::new(move |dev: &CudaBackend| {
            for _ in 0..200 {
                dev.scale(dev.view_mut(&x1)?, 1.0)?;
            }
            Ok(())
        }),
    );
    let x2 = x.clone();
    comm.submit(
        Label::new("next", "reduce"),
        &[first],
        Box::new(move |dev: &CudaBackend| dev.scale(dev.view_mut(&x2)?, 1.0)),
    );
    compute.synchronize().unwrap();
    comm.synchronize().unwrap();
    let spans = trace.spans();
    let long = spans.iter().find(|s| s.name == "long").expect("long");
    let next = spans.iter().find(|s| s.name == "next").expect("next");
    println!(
        "long {:?}..{:?}, next {:?}..{:?}",
        long.start, long.end, next.start, next.end
    );
    assert!(long.duration() > Duration::from_micros(100), "{long:?}");
    assert!(
        next.start + Duration::from_micros(50) >= long.end,
        "{next:?} {long:?}"
    );
}

/// A bad index found on the device is reported at the next host read, as
/// the CPU reports it at the call.
#[test]
#[ignore = "needs a GPU"]
fn device_found_bad_indices_surface_at_the_next_read() {
    let host = gpu(Precision::F32);
    use hybridgen_runtime::view::DType;
    let src = host.alloc(4 * 3, DType::F32).unwrap();
    let index = host.alloc(2, DType::U32).unwrap();
    let dst = host.alloc(2 * 3, DType::F32).unwrap();
    host.upload(&[1u32, 9], host.view_mut(&index).unwrap())
        .unwrap();
    host.gather_rows(
        host.view(&src).unwrap(),
        host.view(&index).unwrap(),
        host.view_mut(&dst).unwrap(),
        3,
    )
    .unwrap();
    let mut out = vec![0.0f32; 6];
    let err = host
        .download(host.view(&dst).unwrap(), &mut out)
        .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, RuntimeError::InvalidArgument(_)), "{message}");
    assert!(message.contains("gather_rows"), "{message}");
    // Reported once: the next read is clean.
    host.download(host.view(&dst).unwrap(), &mut out).unwrap();
}

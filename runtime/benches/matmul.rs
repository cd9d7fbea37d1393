//! GFLOP/s of the CPU backend's matmul against the hand-written loops it
//! replaced, for the three products of a linear layer: `y = x W^T`,
//! `dx = dy W`, `dW += dy^T x`. Run with `cargo bench -p hybridgen-runtime
//! --bench matmul`. Prints figures; asserts nothing about time.
//!
//! Widths: hidden 1024 with 2048 tokens (out 1024, and 4096 as an MLP's up
//! projection), and the `tiny` preset's default run (256 tokens of hidden 64,
//! MLP width 128), where packing overhead matters most. Each figure is the
//! best of several calls (the machine is shared; the best is the least
//! disturbed).

use hybridgen_runtime::backend::MatmulDims;
use hybridgen_runtime::cpu::ops::dense::matmul;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// The kernel before it used `matrixmultiply` (kept verbatim, checks aside):
/// i-k-j loops whose innermost loop is a contiguous row update; `A B^T`
/// transposes B into a scratch buffer first; `A^T B` is rank-1 row updates.
fn loops_matmul(a: &[f32], b: &[f32], c: &mut [f32], dims: MatmulDims) {
    let MatmulDims { m, n, k, .. } = dims;
    if !dims.accumulate {
        c.fill(0.0);
    }
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let axpy_row = |alpha: f32, x: &[f32], y: &mut [f32]| {
        for (y, x) in y.iter_mut().zip(x) {
            *y += alpha * x;
        }
    };
    match (dims.a_trans, dims.b_trans) {
        (false, false) => {
            for (a_row, c_row) in a.chunks_exact(k).zip(c.chunks_exact_mut(n)) {
                for (&a_ip, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
                    axpy_row(a_ip, b_row, c_row);
                }
            }
        }
        (false, true) => {
            let mut bt = vec![0.0f32; k * n];
            for (j, b_row) in b.chunks_exact(k).enumerate() {
                for (p, &v) in b_row.iter().enumerate() {
                    bt[p * n + j] = v;
                }
            }
            for (a_row, c_row) in a.chunks_exact(k).zip(c.chunks_exact_mut(n)) {
                for (&a_ip, bt_row) in a_row.iter().zip(bt.chunks_exact(n)) {
                    axpy_row(a_ip, bt_row, c_row);
                }
            }
        }
        (true, false) => {
            for (a_col, b_row) in a.chunks_exact(m).zip(b.chunks_exact(n)) {
                for (&a_pi, c_row) in a_col.iter().zip(c.chunks_exact_mut(n)) {
                    axpy_row(a_pi, b_row, c_row);
                }
            }
        }
        (true, true) => {
            for (i, c_row) in c.chunks_exact_mut(n).enumerate() {
                for (c_ij, b_row) in c_row.iter_mut().zip(b.chunks_exact(k)) {
                    let mut sum = 0.0f32;
                    for (p, &b_jp) in b_row.iter().enumerate() {
                        sum += a[p * m + i] * b_jp;
                    }
                    *c_ij += sum;
                }
            }
        }
    }
}

/// Uniform in `[-1, 1)` from a seeded xorshift64* stream.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            bits as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The best time of `f` over at least `min_calls` calls and `min_total`.
fn best_time(min_calls: usize, min_total: Duration, mut f: impl FnMut()) -> Duration {
    let started = Instant::now();
    let mut best = Duration::MAX;
    let mut calls = 0;
    while calls < min_calls || started.elapsed() < min_total {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        calls += 1;
    }
    best
}

fn main() {
    println!(
        "{:<26} {:>18} {:>12} {:>12} {:>8} {:>10}",
        "product", "m x n x k", "loops GF/s", "sgemm GF/s", "speedup", "rel diff"
    );
    // (tokens, in features, out features)
    for (rows, fin, fout) in [(2048, 1024, 1024), (2048, 1024, 4096), (256, 64, 128)] {
        let products = [
            ("y = x W^T", MatmulDims::linear(rows, fin, fout)),
            (
                "dx = dy W",
                MatmulDims::linear_input_grad(rows, fin, fout, false),
            ),
            (
                "dW += dy^T x",
                MatmulDims::linear_weight_grad(rows, fin, fout),
            ),
        ];
        for (name, d) in products {
            let a = values(d.m * d.k, 1);
            let b = values(d.k * d.n, 2);
            let c0 = values(d.m * d.n, 3);
            let flops = 2.0 * (d.m * d.n * d.k) as f64;
            let min_total = Duration::from_millis(if flops > 1e9 { 2000 } else { 500 });

            let mut c = c0.clone();
            let t_loops = best_time(3, min_total, || {
                loops_matmul(black_box(&a), black_box(&b), &mut c, d);
                black_box(&c);
            });
            let t_sgemm = best_time(3, min_total, || {
                matmul(black_box(&a), black_box(&b), &mut c, d).expect("matmul");
                black_box(&c);
            });
            // The two sum in different orders: the difference is rounding,
            // shown relative to the largest element of C.
            let (mut c_loops, mut c_sgemm) = (c0.clone(), c0);
            loops_matmul(&a, &b, &mut c_loops, d);
            matmul(&a, &b, &mut c_sgemm, d).expect("matmul");
            let largest = c_loops.iter().fold(0.0f32, |x, y| x.max(y.abs()));
            let max_diff = c_loops
                .iter()
                .zip(&c_sgemm)
                .fold(0.0f32, |x, (p, q)| x.max((p - q).abs()))
                / largest;
            let gflops = |t: Duration| flops / t.as_secs_f64() / 1e9;
            println!(
                "{:<26} {:>18} {:>12.1} {:>12.1} {:>7.2}x {:>10.1e}",
                format!("{name} ({fin}->{fout})"),
                format!("{} x {} x {}", d.m, d.n, d.k),
                gflops(t_loops),
                gflops(t_sgemm),
                t_loops.as_secs_f64() / t_sgemm.as_secs_f64(),
                max_diff,
            );
        }
    }
}

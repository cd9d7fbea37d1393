//! Dense algebra: matmul with transpose and accumulate flags, axpy, scale,
//! strided column copies, column sums, and the f64 sum of a view that loss
//! accumulators are built from.

use super::check;
use crate::backend::MatmulDims;
use crate::error::Result;

/// `sum_i a[i] b[i]` in a fixed order: eight interleaved partial sums (so
/// the loop vectorises) combined as a fixed tree, then the tail.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail
}

/// `y += alpha x` on equal-length rows (vectorises).
pub(crate) fn axpy_row(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// `C (+)= op(A) op(B)` through `matrixmultiply`'s sgemm: it packs panels of
/// `op(A)` and `op(B)` into cache-sized blocks and runs a SIMD microkernel
/// chosen from the CPU's features (AVX-512, FMA + AVX2, AVX, ...), reading
/// the stored matrices through row and column strides, so a transposed
/// operand is never copied. Its block sizes are compile-time constants and it
/// runs on the calling thread (the crate's `threading` feature is off), so on
/// one machine each element of `C` sums its `k` terms in an order fixed by
/// `(m, n, k)` and the transposes alone: equal inputs give equal bits whatever
/// other threads do. That order is not `p = 0, 1, ...` (blocks of `k` are
/// added onto `C` in turn), so results differ from a naive loop by rounding,
/// and a CPU with other SIMD features may round differently.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], dims: MatmulDims) -> Result<()> {
    let MatmulDims { m, n, k, .. } = dims;
    let k_name = "matmul";
    check::len(k_name, "A", a.len(), check::product(k_name, &[m, k])?)?;
    check::len(k_name, "B", b.len(), check::product(k_name, &[k, n])?)?;
    check::len(k_name, "C", c.len(), check::product(k_name, &[m, n])?)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !dims.accumulate {
            c.fill(0.0);
        }
        return Ok(());
    }
    // Element strides (row, column) of op(A) `[m, k]` and op(B) `[k, n]` as
    // stored. Every stride is at most a slice's length, and a slice never
    // holds more than `isize::MAX` elements, so the conversions are exact.
    let (rsa, csa) = if dims.a_trans { (1, m) } else { (k, 1) };
    let (rsb, csb) = if dims.b_trans { (1, k) } else { (n, 1) };
    let beta = if dims.accumulate { 1.0 } else { 0.0 };
    // SAFETY: with the lengths checked above, every element sgemm reads,
    // `a[i*rsa + p*csa]` and `b[p*rsb + j*csb]` for `i < m`, `p < k`,
    // `j < n`, lies inside `a` and `b` (the largest offsets are `m*k - 1` and
    // `k*n - 1`), and every element it writes, `c[i*n + j]`, inside `c`; the
    // strides are nonzero for `C`, so its elements do not alias. `c` is a
    // unique borrow, so it overlaps neither input. With `beta = 0` sgemm
    // overwrites `C` without reading it (the contract's `C = op(A) op(B)`).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    Ok(())
}

pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) -> Result<()> {
    check::len("axpy", "y", y.len(), x.len())?;
    axpy_row(alpha, x, y);
    Ok(())
}

pub fn scale(x: &mut [f32], alpha: f32) -> Result<()> {
    for v in x.iter_mut() {
        *v *= alpha;
    }
    Ok(())
}

pub fn column_sum(x: &[f32], out: &mut [f32], rows: usize, cols: usize) -> Result<()> {
    check::len(
        "column_sum",
        "x",
        x.len(),
        check::product("column_sum", &[rows, cols])?,
    )?;
    check::len("column_sum", "out", out.len(), cols)?;
    if cols == 0 {
        return Ok(());
    }
    for row in x.chunks_exact(cols) {
        axpy_row(1.0, row, out);
    }
    Ok(())
}

pub fn accumulate_sum<T: Copy + Into<f64>>(x: &[T], out: &mut [f64]) -> Result<()> {
    check::len("accumulate_sum", "out", out.len(), 1)?;
    let mut sum = 0.0f64;
    for &v in x {
        sum += v.into();
    }
    out[0] += sum;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed.wrapping_mul(40_503));
                (v % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    /// The definition, in f64.
    fn reference(a: &[f32], b: &[f32], c0: &[f32], d: MatmulDims) -> Vec<f64> {
        let mut c: Vec<f64> = if d.accumulate {
            c0.iter().map(|&v| v as f64).collect()
        } else {
            vec![0.0; d.m * d.n]
        };
        for i in 0..d.m {
            for j in 0..d.n {
                for p in 0..d.k {
                    let av = if d.a_trans {
                        a[p * d.m + i]
                    } else {
                        a[i * d.k + p]
                    };
                    let bv = if d.b_trans {
                        b[j * d.k + p]
                    } else {
                        b[p * d.n + j]
                    };
                    c[i * d.n + j] += av as f64 * bv as f64;
                }
            }
        }
        c
    }

    /// Uniform in `[-1, 1)` from a seeded xorshift64* stream.
    fn random(n: usize, seed: u64) -> Vec<f32> {
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

    fn all_dims(m: usize, n: usize, k: usize) -> impl Iterator<Item = MatmulDims> {
        [false, true].into_iter().flat_map(move |a_trans| {
            [false, true].into_iter().flat_map(move |b_trans| {
                [false, true].into_iter().map(move |accumulate| MatmulDims {
                    m,
                    n,
                    k,
                    a_trans,
                    b_trans,
                    accumulate,
                })
            })
        })
    }

    /// `sum_p |op(A)[i,p]| |op(B)[p,j]|` (+ `|C0[i,j]|` when accumulating):
    /// the scale of every rounding error a summation order can make.
    fn magnitude(a: &[f32], b: &[f32], c0: &[f32], d: MatmulDims) -> Vec<f64> {
        let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
        reference(&abs(a), &abs(b), &abs(c0), d)
    }

    /// Sizes around the crate's blocking (a 8x8 microkernel, 64 rows, 256 of
    /// `k`, 1024 columns per block) and the odd sizes that leave partial tiles.
    /// Tolerance: 1e-5 of the element's magnitude (at most `k` ulps of
    /// `k * 2^-24` relative for any summation order, far less in practice);
    /// summation order differs from the definition's, so bits may not.
    #[test]
    fn matmul_matches_the_definition_for_every_transpose_and_accumulate() {
        let sizes = [
            (3, 5, 4),
            (1, 9, 17),
            (7, 2, 1),
            (1, 1, 1),
            (3, 17, 64),
            (17, 64, 3),
            (64, 3, 17),
            (129, 17, 64),
            (17, 129, 129),
            (65, 9, 300),
            (2, 1030, 5),
        ];
        for (case, (m, n, k)) in sizes.into_iter().enumerate() {
            for d in all_dims(m, n, k) {
                let seed = 10 * case as u64;
                let a = random(m * k, seed + 1);
                let b = random(k * n, seed + 2);
                let c0 = random(m * n, seed + 3);
                let mut c = c0.clone();
                matmul(&a, &b, &mut c, d).unwrap();
                let want = reference(&a, &b, &c0, d);
                let scale = magnitude(&a, &b, &c0, d);
                for (idx, ((got, want), scale)) in c.iter().zip(&want).zip(&scale).enumerate() {
                    let err = (*got as f64 - want).abs();
                    assert!(
                        err <= 1e-5 * scale,
                        "{d:?} at {idx}: {got} vs {want} (error {err:e}, scale {scale})"
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_overwrites_without_reading_c_unless_accumulating() {
        let (m, n, k) = (5, 11, 7);
        for d in all_dims(m, n, k) {
            let (a, b) = (random(m * k, 1), random(k * n, 2));
            let mut c = vec![f32::NAN; m * n];
            matmul(&a, &b, &mut c, d).unwrap();
            assert_eq!(
                c.iter().all(|v| v.is_finite()),
                !d.accumulate,
                "{d:?}: C = op(A) op(B) ignores C's old values, C += keeps them"
            );
        }
    }

    #[test]
    fn matmul_with_an_empty_dimension() {
        // k = 0: the product is zero, so C is zeroed or left as it was.
        for d in all_dims(3, 4, 0) {
            let mut c = vec![2.5; 12];
            matmul(&[], &[], &mut c, d).unwrap();
            let want = if d.accumulate { 2.5 } else { 0.0 };
            assert!(c.iter().all(|&v| v == want), "{d:?}: {c:?}");
        }
        // m = 0 or n = 0: C is empty, and the other operand is still checked.
        for d in all_dims(0, 4, 3) {
            let b = random(12, 2);
            matmul(&[], &b, &mut [], d).unwrap();
            assert!(matmul(&[], &b[..11], &mut [], d).is_err());
        }
        for d in all_dims(4, 0, 3) {
            let a = random(12, 1);
            matmul(&a, &[], &mut [], d).unwrap();
            assert!(matmul(&a[..11], &[], &mut [], d).is_err());
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Equal inputs give equal bits: on a second call, on another thread, and
    /// while other threads run matmuls of other shapes at the same time.
    #[test]
    fn matmul_is_bit_repeatable_across_calls_and_threads() {
        let run = |m: usize, n: usize, k: usize, seed: u64| -> Vec<Vec<u32>> {
            all_dims(m, n, k)
                .map(|d| {
                    let (a, b) = (random(m * k, seed), random(k * n, seed + 1));
                    let mut c = random(m * n, seed + 2);
                    matmul(&a, &b, &mut c, d).unwrap();
                    bits(&c)
                })
                .collect()
        };
        let (m, n, k) = (67, 131, 300);
        let first = run(m, n, k, 7);
        assert_eq!(run(m, n, k, 7), first, "a second call");
        std::thread::scope(|scope| {
            let noise: Vec<_> = (0..2u64)
                .map(|t| {
                    scope.spawn(move || {
                        for round in 0..4 {
                            run(33 + round, 9 + 40 * t as usize, 257, 100 + t);
                        }
                    })
                })
                .collect();
            let beside = scope.spawn(|| (0..3).map(|_| run(m, n, k, 7)).collect::<Vec<_>>());
            for got in beside.join().unwrap() {
                assert_eq!(got, first, "on another thread, beside other matmuls");
            }
            for t in noise {
                t.join().unwrap();
            }
        });
    }

    #[test]
    fn matmul_rejects_bad_sizes() {
        let d = MatmulDims::linear(2, 3, 4);
        let mut c = vec![0.0; 8];
        assert!(matmul(&[0.0; 6], &[0.0; 11], &mut c, d).is_err());
        assert!(matmul(&[0.0; 5], &[0.0; 12], &mut c, d).is_err());
        assert!(matmul(&[0.0; 6], &[0.0; 12], &mut c[..7], d).is_err());
        assert!(matmul(&[0.0; 6], &[0.0; 12], &mut c, d).is_ok());
    }

    #[test]
    fn linear_helpers_compute_the_three_products_of_a_linear_layer() {
        let (rows, fin, fout) = (3, 4, 2);
        let x = pseudo(rows * fin, 4);
        let w = pseudo(fout * fin, 5);
        let mut y = vec![0.0; rows * fout];
        matmul(&x, &w, &mut y, MatmulDims::linear(rows, fin, fout)).unwrap();
        for r in 0..rows {
            for o in 0..fout {
                let want: f32 = (0..fin).map(|i| x[r * fin + i] * w[o * fin + i]).sum();
                assert!((y[r * fout + o] - want).abs() < 1e-5);
            }
        }
        let dy = pseudo(rows * fout, 6);
        let mut dx = vec![0.0; rows * fin];
        matmul(
            &dy,
            &w,
            &mut dx,
            MatmulDims::linear_input_grad(rows, fin, fout, false),
        )
        .unwrap();
        let mut dw = vec![1.0; fout * fin];
        matmul(
            &dy,
            &x,
            &mut dw,
            MatmulDims::linear_weight_grad(rows, fin, fout),
        )
        .unwrap();
        for i in 0..fin {
            for r in 0..rows {
                let want: f32 = (0..fout).map(|o| dy[r * fout + o] * w[o * fin + i]).sum();
                assert!((dx[r * fin + i] - want).abs() < 1e-5);
            }
            for o in 0..fout {
                let want: f32 = 1.0
                    + (0..rows)
                        .map(|r| dy[r * fout + o] * x[r * fin + i])
                        .sum::<f32>();
                assert!((dw[o * fin + i] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn dot_is_exact_on_integers_and_handles_tails() {
        for n in [0, 1, 7, 8, 9, 23] {
            let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 3) as f32).collect();
            let want: f32 = (0..n).map(|i| (i * (i % 3)) as f32).sum();
            assert_eq!(dot(&a, &b), want);
        }
    }

    #[test]
    fn accumulate_sum_adds_an_in_order_f64_sum() {
        let x = pseudo(37, 8);
        let mut out = [0.25f64];
        accumulate_sum(&x, &mut out).unwrap();
        let mut want = 0.0f64;
        for &v in &x {
            want += v as f64;
        }
        assert_eq!(out[0].to_bits(), (0.25 + want).to_bits());
        // Summed from zero first, then added: not a running sum onto `out`.
        // (At 1e16 the f64 spacing is 2: each 1 added alone would be lost.)
        let mut out = [1e16f64];
        accumulate_sum(&[1.0f32, 1.0, 1.0, 1.0], &mut out).unwrap();
        assert_eq!(out[0], 1e16 + 4.0);
        assert_ne!(out[0], 1e16);
        accumulate_sum(&[0.5f64, 0.25], &mut out[..]).unwrap();
        assert!(accumulate_sum(&x, &mut [0.0, 0.0]).is_err());
    }

    #[test]
    fn column_sum_adds_rows_into_the_output() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [1.0, 1.0];
        column_sum(&x, &mut out, 3, 2).unwrap();
        assert_eq!(out, [10.0, 13.0]);
        assert!(column_sum(&x, &mut out, 2, 2).is_err());
    }
}

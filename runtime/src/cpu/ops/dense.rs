//! Dense algebra: matmul with transpose and accumulate flags (one, or many
//! as one grouped call), axpy, scale, column sums, and the f64 sum of a
//! view that loss accumulators are built from.

use crate::backend::dense::{check_batched_matmul, check_matmul, segments_as_problems};
use crate::backend::{BatchedMatmulDims, DenseKernels, MatmulDims, MatmulProblem, SegmentedMatmul};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{DType, Operand, View, ViewMut};

impl DenseKernels<CpuBuf> for CpuBackend {
    fn matmul_unchecked(
        &self,
        a: View<'_, CpuBuf>,
        b: View<'_, CpuBuf>,
        c: ViewMut<'_, CpuBuf>,
        dims: MatmulDims,
    ) -> Result<()> {
        let k = self.access("matmul");
        let (a, b) = (k.f32_in("A", a)?, k.f32_in("B", b)?);
        matmul(&a, &b, &mut k.f32_out("C", c)?, dims)
    }

    fn grouped_matmul_unchecked(
        &self,
        problems: Vec<MatmulProblem<View<'_, CpuBuf>, ViewMut<'_, CpuBuf>>>,
    ) -> Result<()> {
        let k = self.access("grouped_matmul");
        // Registering every view before any loop runs is what refuses
        // overlapping `C`s (an aliasing error of this one call).
        let mut operands = Vec::with_capacity(problems.len());
        for (i, p) in problems.into_iter().enumerate() {
            let name = |operand: &str| format!("problems[{i}].{operand}");
            let a = k.f32_in(&name("A"), p.a)?;
            let b = k.f32_in(&name("B"), p.b)?;
            let out = k.f32_out(&name("C"), p.c)?;
            operands.push((a, b, out, p.dims));
        }
        let mut problems: Vec<MatmulProblem<&[f32], &mut [f32]>> = operands
            .iter_mut()
            .map(|(a, b, c, dims)| MatmulProblem {
                a: &**a,
                b: &**b,
                c: &mut **c,
                dims: *dims,
            })
            .collect();
        grouped_matmul(&mut problems)
    }

    fn batched_matmul_unchecked(
        &self,
        a: View<'_, CpuBuf>,
        b: View<'_, CpuBuf>,
        c: ViewMut<'_, CpuBuf>,
        dims: BatchedMatmulDims,
    ) -> Result<()> {
        let k = self.access("batched_matmul");
        let (a, b) = (k.f32_in("A", a)?, k.f32_in("B", b)?);
        batched_matmul(&a, &b, &mut k.f32_out("C", c)?, dims)
    }

    fn segmented_matmul_unchecked(
        &self,
        rows: View<'_, CpuBuf>,
        problems: Vec<SegmentedMatmul<View<'_, CpuBuf>, ViewMut<'_, CpuBuf>>>,
    ) -> Result<()> {
        // The reference reads the rows where they are and runs the grouped
        // call of the segments with rows, as a GPU without the segmented
        // kernels does after reading them.
        let counts = self
            .access("segmented_matmul")
            .typed_in::<u32>("rows", rows)?
            .to_vec();
        self.grouped_matmul_unchecked(segments_as_problems(&counts, problems)?)
    }

    fn axpy_unchecked(
        &self,
        alpha: f32,
        x: View<'_, CpuBuf>,
        y: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("axpy");
        let x = k.f32_in("x", x)?;
        axpy(alpha, &x, &mut k.f32_out("y", y)?);
        Ok(())
    }

    fn scale_unchecked(&self, x: ViewMut<'_, CpuBuf>, alpha: f32) -> Result<()> {
        let k = self.access("scale");
        scale(&mut k.f32_out("x", x)?, alpha);
        Ok(())
    }

    fn column_sum_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        out: ViewMut<'_, CpuBuf>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let k = self.access("column_sum");
        let x = k.f32_in("x", x)?;
        column_sum(&x, &mut k.f32_out("out", out)?, rows, cols);
        Ok(())
    }

    fn accumulate_sum_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        out: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("accumulate_sum");
        let out_values = k.typed_out::<f64>("out", out)?;
        match x.dtype() {
            DType::F64 => accumulate_sum(k.typed_in::<f64>("x", x)?, out_values),
            _ => accumulate_sum(&k.f32_in("x", x)?, out_values),
        }
        Ok(())
    }
}

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
    // The lengths, checked here too: the unsafe block below relies on them,
    // and this loop is public.
    let f32s = |len| Operand::new(len, DType::F32);
    check_matmul(f32s(a.len()), f32s(b.len()), f32s(c.len()), dims)?;
    let MatmulDims { m, n, k, .. } = dims;
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

/// `dims.batch` products of [`matmul`], each on matrices read and written
/// in place at their [`crate::backend::BatchLayout`]: the same sgemm call
/// with the same `(m, n, k)` and transposes, only other addresses and row
/// strides, so each product has exactly the bits [`matmul`] gives on a
/// packed copy of its matrices (sgemm packs its panels before it sums, and
/// its order depends on the shape alone). `C`'s elements outside its
/// matrices are neither read nor written.
pub fn batched_matmul(a: &[f32], b: &[f32], c: &mut [f32], dims: BatchedMatmulDims) -> Result<()> {
    // The layouts, checked here too: the unsafe block below relies on them,
    // and this function is public.
    let f32s = |len| Operand::new(len, DType::F32);
    check_batched_matmul(f32s(a.len()), f32s(b.len()), f32s(c.len()), dims)?;
    let BatchedMatmulDims { batch, dims: d, .. } = dims;
    let MatmulDims { m, n, k, .. } = d;
    if batch == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !d.accumulate {
            for i in 0..batch {
                for r in 0..m {
                    let at = dims.at(2, i, r, 0);
                    c[at..at + n].fill(0.0);
                }
            }
        }
        return Ok(());
    }
    // As in `matmul`: element strides (row, column) of op(A) and op(B) as
    // stored, now with each operand's pitch as its row stride.
    // A pitch past its slice's length only happens for a matrix of one
    // stored row, whose pitch no element offset uses: clamping it leaves
    // every address as it is and makes the conversions below exact.
    let (pa, pb, pc) = (
        dims.a.pitch.min(a.len()),
        dims.b.pitch.min(b.len()),
        dims.c.pitch.min(c.len()),
    );
    let (rsa, csa) = if d.a_trans { (1, pa) } else { (pa, 1) };
    let (rsb, csb) = if d.b_trans { (1, pb) } else { (pb, 1) };
    let beta = if d.accumulate { 1.0 } else { 0.0 };
    for i in 0..batch {
        let (a0, b0, c0) = (
            dims.at(0, i, 0, 0),
            dims.at(1, i, 0, 0),
            dims.at(2, i, 0, 0),
        );
        // SAFETY: the check bounds every matrix's last element by its
        // slice's length (each matrix's elements are `at(i, r, col)` for
        // stored `r` and `col` within its shape, the largest `span - 1`),
        // so every element sgemm reads from `a` and `b` and writes in `c`
        // lies inside them; `pc >= n` keeps one matrix's elements of `C`
        // apart, and the check refused layouts whose matrices overlap. `c`
        // is a unique borrow, so it overlaps neither input. With `beta = 0`
        // sgemm overwrites `C` without reading it. Strides at most a
        // slice's length (clamped above) convert to `isize` exactly.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr().add(a0),
                rsa as isize,
                csa as isize,
                b.as_ptr().add(b0),
                rsb as isize,
                csb as isize,
                beta,
                c.as_mut_ptr().add(c0),
                pc as isize,
                1,
            );
        }
    }
    Ok(())
}

pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    axpy_row(alpha, x, y);
}

pub fn scale(x: &mut [f32], alpha: f32) {
    for v in x.iter_mut() {
        *v *= alpha;
    }
}

pub fn column_sum(x: &[f32], out: &mut [f32], _rows: usize, cols: usize) {
    if cols == 0 {
        return;
    }
    for row in x.chunks_exact(cols) {
        axpy_row(1.0, row, out);
    }
}

pub fn accumulate_sum<T: Copy + Into<f64>>(x: &[T], out: &mut [f64]) {
    let mut sum = 0.0f64;
    for &v in x {
        sum += v.into();
    }
    out[0] += sum;
}

/// The grouped matmul: every problem in order, each exactly [`matmul`]
/// with its dims, so grouping never changes the bits.
pub fn grouped_matmul(problems: &mut [MatmulProblem<&[f32], &mut [f32]>]) -> Result<()> {
    for p in problems.iter_mut() {
        matmul(p.a, p.b, p.c, p.dims)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::dense::{check_accumulate_sum, check_column_sum};

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
        accumulate_sum(&x, &mut out);
        let mut want = 0.0f64;
        for &v in &x {
            want += v as f64;
        }
        assert_eq!(out[0].to_bits(), (0.25 + want).to_bits());
        // Summed from zero first, then added: not a running sum onto `out`.
        // (At 1e16 the f64 spacing is 2: each 1 added alone would be lost.)
        let mut out = [1e16f64];
        accumulate_sum(&[1.0f32, 1.0, 1.0, 1.0], &mut out);
        assert_eq!(out[0], 1e16 + 4.0);
        assert_ne!(out[0], 1e16);
        accumulate_sum(&[0.5f64, 0.25], &mut out[..]);
        let out = Operand::new(2, DType::F64);
        assert!(check_accumulate_sum(Operand::new(37, DType::F32), out).is_err());
    }

    #[test]
    fn column_sum_adds_rows_into_the_output() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [1.0, 1.0];
        column_sum(&x, &mut out, 3, 2);
        assert_eq!(out, [10.0, 13.0]);
        let (x, out) = (Operand::new(6, DType::F32), Operand::new(2, DType::F32));
        assert!(check_column_sum(x, out, 2, 2).is_err());
    }

    /// `C (+)= op(A) op(B)` by the definition, in f64.
    fn naive(a: &[f32], b: &[f32], c: &[f32], d: MatmulDims) -> Vec<f64> {
        let at = |i: usize, p: usize| {
            if d.a_trans {
                a[p * d.m + i]
            } else {
                a[i * d.k + p]
            }
        };
        let bt = |p: usize, j: usize| {
            if d.b_trans {
                b[j * d.k + p]
            } else {
                b[p * d.n + j]
            }
        };
        let mut out = Vec::with_capacity(d.m * d.n);
        for i in 0..d.m {
            for j in 0..d.n {
                let base = if d.accumulate {
                    c[i * d.n + j] as f64
                } else {
                    0.0
                };
                out.push(
                    base + (0..d.k)
                        .map(|p| at(i, p) as f64 * bt(p, j) as f64)
                        .sum::<f64>(),
                );
            }
        }
        out
    }

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + seed) * 0.731).sin()).collect()
    }

    #[test]
    fn each_problem_is_its_own_matmul_bit_for_bit() {
        let dims = [
            MatmulDims::linear(3, 4, 5),
            MatmulDims::linear_input_grad(2, 4, 5, true),
            MatmulDims::linear_weight_grad(6, 3, 2),
            MatmulDims::linear(0, 4, 5),
        ];
        let a: Vec<Vec<f32>> = dims
            .iter()
            .enumerate()
            .map(|(i, d)| values(d.m * d.k, i as f32))
            .collect();
        let b: Vec<Vec<f32>> = dims
            .iter()
            .enumerate()
            .map(|(i, d)| values(d.k * d.n, 10.0 + i as f32))
            .collect();
        let c0: Vec<Vec<f32>> = dims
            .iter()
            .enumerate()
            .map(|(i, d)| values(d.m * d.n, 20.0 + i as f32))
            .collect();
        let mut grouped = c0.clone();
        let mut problems: Vec<_> = grouped
            .iter_mut()
            .enumerate()
            .map(|(i, c)| MatmulProblem {
                a: &a[i][..],
                b: &b[i][..],
                c: &mut c[..],
                dims: dims[i],
            })
            .collect();
        grouped_matmul(&mut problems).unwrap();
        for (i, d) in dims.iter().enumerate() {
            let mut alone = c0[i].clone();
            matmul(&a[i], &b[i], &mut alone, *d).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&grouped[i]), bits(&alone), "problem {i}");
            for (got, want) in grouped[i].iter().zip(naive(&a[i], &b[i], &c0[i], *d)) {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "problem {i}: {got} vs {want}"
                );
            }
        }
    }

    /// Matrix `i` of `which` (0: A, 1: B, 2: C), packed out of its layout.
    fn packed(v: &[f32], d: &BatchedMatmulDims, which: usize, i: usize) -> Vec<f32> {
        let (rows, width) = d.stored()[which];
        (0..rows)
            .flat_map(|r| (0..width).map(move |c| (r, c)))
            .map(|(r, c)| v[d.at(which, i, r, c)])
            .collect()
    }

    /// Every head of interleaved `[rows, heads, width]` operands (and a
    /// stacked weight with gaps between its blocks) against `matmul` on
    /// packed copies: the same bits, every transpose and accumulate; `C`'s
    /// elements between its matrices untouched.
    #[test]
    fn batched_matmul_is_matmul_on_each_matrix_bit_for_bit() {
        use crate::backend::BatchLayout;
        let (batch, m, n, k) = (5, 7, 9, 13);
        for (case, d) in all_dims(m, n, k).enumerate() {
            let [(ar, aw), (br, bw), _] = BatchedMatmulDims {
                batch,
                dims: d,
                a: BatchLayout::packed(0, 0),
                b: BatchLayout::packed(0, 0),
                c: BatchLayout::packed(0, 0),
            }
            .stored();
            let dims = BatchedMatmulDims {
                batch,
                dims: d,
                // Heads of `[ar, batch, aw + 3]` from column 2 of a head.
                a: BatchLayout::heads(batch, aw + 3),
                // Blocks of `br + 2` rows of a `bw + 1`-wide weight.
                b: BatchLayout {
                    pitch: bw + 1,
                    stride: (br + 2) * (bw + 1),
                },
                c: BatchLayout::heads(batch, n + 1),
            };
            let a = random(ar * batch * (aw + 3), 3 * case as u64);
            let b = random(batch * (br + 2) * (bw + 1), 3 * case as u64 + 1);
            let c0 = random(m * batch * (n + 1), 3 * case as u64 + 2);
            let mut c = c0.clone();
            batched_matmul(&a[2..], &b, &mut c, dims).unwrap();
            for i in 0..batch {
                let mut want = packed(&c0, &dims, 2, i);
                let (pa, pb) = (packed(&a[2..], &dims, 0, i), packed(&b, &dims, 1, i));
                matmul(&pa, &pb, &mut want, d).unwrap();
                assert_eq!(
                    bits(&packed(&c, &dims, 2, i)),
                    bits(&want),
                    "{d:?}, matrix {i}"
                );
            }
            // The column past each head's n is no matrix's.
            for r in 0..m {
                for i in 0..batch {
                    let at = r * batch * (n + 1) + i * (n + 1) + n;
                    assert_eq!(c[at].to_bits(), c0[at].to_bits(), "{d:?}: {r}, {i}");
                }
            }
        }
    }

    mod backend {
        use crate::backend::{Backend, MatmulDims, MatmulProblem};
        use crate::cpu::{CpuBackend, CpuBuf, round_bf16};
        use crate::view::{DType, DeviceBuffer, View, ViewMut};

        fn filled(b: &CpuBackend, values: &[f32], dtype: DType) -> CpuBuf {
            let f = b.alloc(values.len(), DType::F32).unwrap();
            b.upload(values, ViewMut::whole(&f)).unwrap();
            let buf = b.alloc(values.len(), dtype).unwrap();
            b.cast(View::whole(&f), ViewMut::whole(&buf)).unwrap();
            buf
        }

        fn read(b: &CpuBackend, buf: &CpuBuf) -> Vec<f32> {
            let f = b.alloc(buf.len(), DType::F32).unwrap();
            b.cast(View::whole(buf), ViewMut::whole(&f)).unwrap();
            let mut out = vec![0.0; buf.len()];
            b.download(View::whole(&f), &mut out).unwrap();
            out
        }

        const DIMS: MatmulDims = MatmulDims::linear(2, 3, 2);

        #[test]
        fn operands_of_mixed_dtypes_and_overlapping_outputs_are_refused() {
            let b = CpuBackend::default();
            let x = [0.5f32, -1.0, 0.25, 1.5, 0.75, -0.5];
            let (a32, b32, a16) = (
                filled(&b, &x, DType::F32),
                filled(&b, &x, DType::F32),
                filled(&b, &x, DType::Bf16),
            );
            let c = b.alloc(8, DType::F32).unwrap();
            let c16 = b.alloc(4, DType::Bf16).unwrap();
            let err = b
                .grouped_matmul(vec![
                    MatmulProblem {
                        a: View::whole(&a32),
                        b: View::whole(&b32),
                        c: ViewMut::of(&c, 0..4).unwrap(),
                        dims: DIMS,
                    },
                    MatmulProblem {
                        a: View::whole(&a16),
                        b: View::whole(&b32),
                        c: ViewMut::of(&c, 4..8).unwrap(),
                        dims: DIMS,
                    },
                ])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(
                    "kernel `grouped_matmul`: `problems[0].A` is f32 but `problems[1].A` is bf16"
                ),
                "{err}"
            );
            let err = b
                .grouped_matmul(vec![
                    MatmulProblem {
                        a: View::whole(&a32),
                        b: View::whole(&b32),
                        c: ViewMut::of(&c, 0..4).unwrap(),
                        dims: DIMS,
                    },
                    MatmulProblem {
                        a: View::whole(&a32),
                        b: View::whole(&b32),
                        c: ViewMut::whole(&c16),
                        dims: DIMS,
                    },
                ])
                .unwrap_err()
                .to_string();
            assert!(err.contains("`problems[1].C` is bf16"), "{err}");
            let u = b.alloc(6, DType::U32).unwrap();
            let err = b
                .grouped_matmul(vec![MatmulProblem {
                    a: View::whole(&u),
                    b: View::whole(&u),
                    c: ViewMut::of(&c, 0..4).unwrap(),
                    dims: DIMS,
                }])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("`problems[0].A` is u32, but it takes bf16 or f32"),
                "{err}"
            );
            let err = b
                .grouped_matmul(vec![
                    MatmulProblem {
                        a: View::whole(&a32),
                        b: View::whole(&b32),
                        c: ViewMut::of(&c, 0..4).unwrap(),
                        dims: DIMS,
                    },
                    MatmulProblem {
                        a: View::whole(&a32),
                        b: View::whole(&b32),
                        c: ViewMut::of(&c, 2..6).unwrap(),
                        dims: DIMS,
                    },
                ])
                .unwrap_err()
                .to_string();
            assert!(err.contains("aliases"), "{err}");
        }

        #[test]
        fn bf16_outputs_are_the_f32_products_rounded_once() {
            let b = CpuBackend::default();
            // Representable in bf16; their products and sums are not.
            let x = [1.0078125f32, -1.5, 0.25, 1.5, 0.75, -0.515625];
            let y = [1.0078125f32, 0.5, -0.75, 0.125, 1.0, -1.5];
            let (a16, b16) = (filled(&b, &x, DType::Bf16), filled(&b, &y, DType::Bf16));
            let c16 = b.alloc(4, DType::Bf16).unwrap();
            b.grouped_matmul(vec![MatmulProblem {
                a: View::whole(&a16),
                b: View::whole(&b16),
                c: ViewMut::whole(&c16),
                dims: DIMS,
            }])
            .unwrap();
            let mut want = vec![0.0f32; 4];
            super::matmul(&x, &y, &mut want, DIMS).unwrap();
            round_bf16(&mut want);
            assert_eq!(read(&b, &c16), want);
            assert!(
                b.grouped_matmul(Vec::new()).is_ok(),
                "an empty group is a no-op"
            );
        }
    }

    #[test]
    fn a_bad_problem_is_named_and_nothing_is_written() {
        use crate::Backend;
        let b = CpuBackend::default();
        let ones = |len| {
            let buf = b.alloc(len, DType::F32).unwrap();
            b.fill(ViewMut::whole(&buf), 1.0).unwrap();
            buf
        };
        let (x, c0, c1) = (ones(6), ones(4), ones(3));
        let err = b
            .grouped_matmul(vec![
                MatmulProblem {
                    a: View::of(&x, 0..4).unwrap(),
                    b: View::of(&x, 0..4).unwrap(),
                    c: ViewMut::whole(&c0),
                    dims: MatmulDims::linear(2, 2, 2),
                },
                MatmulProblem {
                    a: View::whole(&x),
                    b: View::whole(&x),
                    c: ViewMut::whole(&c1),
                    dims: MatmulDims::linear(2, 3, 2),
                },
            ])
            .unwrap_err()
            .to_string();
        assert!(err.contains("problems[1].C"), "{err}");
        let mut c = [0.0f32; 4];
        b.download(View::whole(&c0), &mut c).unwrap();
        assert_eq!(c, [1.0; 4], "the good problem ran before the check");
    }
}

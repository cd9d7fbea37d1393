//! Dense algebra: matmul with transpose and accumulate flags, axpy, scale,
//! strided column copies, column sums, and the f64 sum of a view that loss
//! accumulators are built from.

use super::check;
use crate::backend::{CopyCols, MatmulDims};
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

/// `C (+)= op(A) op(B)`. Loop orders keep the innermost loop a contiguous
/// row update (it vectorises): i-k-j for `A B` and, after transposing B into
/// a scratch buffer, for `A B^T`; rank-1 row updates for `A^T B`. Every
/// element sums its k terms in order `p = 0, 1, ...` onto C.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], dims: MatmulDims) -> Result<()> {
    let MatmulDims { m, n, k, .. } = dims;
    let k_name = "matmul";
    check::len(k_name, "A", a.len(), check::product(k_name, &[m, k])?)?;
    check::len(k_name, "B", b.len(), check::product(k_name, &[k, n])?)?;
    check::len(k_name, "C", c.len(), check::product(k_name, &[m, n])?)?;
    if !dims.accumulate {
        c.fill(0.0);
    }
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    match (dims.a_trans, dims.b_trans) {
        (false, false) => {
            for (a_row, c_row) in a.chunks_exact(k).zip(c.chunks_exact_mut(n)) {
                for (&a_ip, b_row) in a_row.iter().zip(b.chunks_exact(n)) {
                    axpy_row(a_ip, b_row, c_row);
                }
            }
        }
        (false, true) => {
            // Row dot products do not vectorise as well as row updates:
            // transpose B once (n*k, small next to m*n*k) and run i-k-j.
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
            // Rare (no layer uses it): A^T B^T, summing over p in order.
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

pub fn copy_cols(src: &[f32], dst: &mut [f32], dims: CopyCols) -> Result<()> {
    let kn = "copy_cols";
    check::ensure(
        dims.src_offset + dims.cols <= dims.src_stride
            && dims.dst_offset + dims.cols <= dims.dst_stride,
        || format!("{kn}: the column block does not fit its row stride ({dims:?})"),
    )?;
    check::len(
        kn,
        "src",
        src.len(),
        check::product(kn, &[dims.rows, dims.src_stride])?,
    )?;
    check::len(
        kn,
        "dst",
        dst.len(),
        check::product(kn, &[dims.rows, dims.dst_stride])?,
    )?;
    if dims.rows == 0 || dims.cols == 0 {
        return Ok(());
    }
    let src_rows = src.chunks_exact(dims.src_stride);
    let dst_rows = dst.chunks_exact_mut(dims.dst_stride);
    for (s, d) in src_rows.zip(dst_rows) {
        let s = &s[dims.src_offset..dims.src_offset + dims.cols];
        let d = &mut d[dims.dst_offset..dims.dst_offset + dims.cols];
        if dims.accumulate {
            axpy_row(1.0, s, d);
        } else {
            d.copy_from_slice(s);
        }
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

    #[test]
    fn matmul_matches_the_definition_for_every_transpose_and_accumulate() {
        for (m, n, k) in [(3, 5, 4), (1, 9, 17), (7, 2, 1), (4, 4, 0)] {
            for a_trans in [false, true] {
                for b_trans in [false, true] {
                    for accumulate in [false, true] {
                        let d = MatmulDims {
                            m,
                            n,
                            k,
                            a_trans,
                            b_trans,
                            accumulate,
                        };
                        let a = pseudo(m * k, 1);
                        let b = pseudo(k * n, 2);
                        let c0 = pseudo(m * n, 3);
                        let mut c = c0.clone();
                        matmul(&a, &b, &mut c, d).unwrap();
                        let want = reference(&a, &b, &c0, d);
                        for (got, want) in c.iter().zip(&want) {
                            assert!((*got as f64 - want).abs() < 1e-5, "{d:?}: {got} vs {want}");
                        }
                    }
                }
            }
        }
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
    fn copy_cols_moves_and_accumulates_a_column_block() {
        let src: Vec<f32> = (0..12).map(|v| v as f32).collect(); // [3, 4]
        let mut dst = vec![0.0; 6]; // [3, 2]
        let dims = CopyCols {
            rows: 3,
            cols: 2,
            src_stride: 4,
            src_offset: 1,
            dst_stride: 2,
            dst_offset: 0,
            accumulate: false,
        };
        copy_cols(&src, &mut dst, dims).unwrap();
        assert_eq!(dst, vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
        copy_cols(
            &src,
            &mut dst,
            CopyCols {
                accumulate: true,
                ..dims
            },
        )
        .unwrap();
        assert_eq!(dst, vec![2.0, 4.0, 10.0, 12.0, 18.0, 20.0]);
        assert!(
            copy_cols(
                &src,
                &mut dst,
                CopyCols {
                    src_offset: 3,
                    ..dims
                }
            )
            .is_err()
        );
        assert!(copy_cols(&src[..11], &mut dst, dims).is_err());
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

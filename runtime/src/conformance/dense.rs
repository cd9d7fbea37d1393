//! Dense algebra: matmul (every transpose and accumulate combination, odd
//! sizes), axpy, scale, copy_cols, column_sum.

use super::Suite;
use super::case::{Expected, KernelCase};
use super::reference as r;
use crate::backend::{Backend, CopyCols, MatmulDims};

/// f32 unit roundoff: tolerances are stated in multiples of it.
pub(super) const U: f64 = 1.0 / (1u64 << 24) as f64;

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    matmul(s);
    axpy(s);
    scale(s);
    copy_cols(s);
    column_sum(s);
}

fn matmul<B: Backend>(s: &mut Suite<'_, B>) {
    let shapes = [
        (1, 1, 1),
        (3, 17, 33),
        (17, 3, 65),
        (33, 65, 3),
        (65, 33, 17),
        (130, 17, 33),
        (17, 130, 65),
        (1, 130, 130),
        (130, 1, 17),
        (5, 4, 0),
    ];
    let mut first = true;
    for (m, n, k) in shapes {
        for flags in 0..8u8 {
            let dims = MatmulDims {
                m,
                n,
                k,
                a_trans: flags & 1 != 0,
                b_trans: flags & 2 != 0,
                accumulate: flags & 4 != 0,
            };
            let name = format!(
                "m={m} n={n} k={k}{}{}{}",
                if dims.a_trans { " A^T" } else { "" },
                if dims.b_trans { " B^T" } else { "" },
                if dims.accumulate { " C+=" } else { "" }
            );
            let a = s.rng.values(m * k, -2.0, 2.0);
            let b = s.rng.values(k * n, -2.0, 2.0);
            let case = KernelCase::new("matmul", name)
                .input("A", a)
                .input("B", b)
                .same_dtype("A", "B")
                // k order-one products: the error of any summation order
                // stays well inside k * 16u * (|terms|).
                .tolerance(64.0 * U * (k as f64 + 1.0), 16.0 * U);
            let case = if dims.accumulate {
                case.inout("C", s.rng.values(m * n, -2.0, 2.0))
            } else {
                case.output("C", m * n)
            };
            let case = if std::mem::take(&mut first) {
                case.with_refusals()
            } else {
                case
            };
            s.check_kernel(
                case,
                |x| {
                    vec![Expected::new(
                        "C",
                        r::matmul(&x["A"], &x["B"], &x["C"], dims),
                    )]
                },
                |dev, b| {
                    dev.matmul(b.view("A")?, b.view("B")?, b.view_mut("C")?, dims)?;
                    Ok(vec![])
                },
            );
        }
    }
}

fn axpy<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, len) in [0usize, 1, 37, 1000].into_iter().enumerate() {
        let alpha = s.rng.uniform(-2.0, 2.0) as f32;
        let case = KernelCase::new("axpy", format!("{len} elements, alpha {alpha}"))
            .input("x", s.rng.values(len, -2.0, 2.0))
            .inout("y", s.rng.values(len, -2.0, 2.0))
            .tolerance(8.0 * U, 8.0 * U);
        let case = if i == 1 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                let y = x["y"].iter().zip(&x["x"]);
                vec![Expected::new(
                    "y",
                    y.map(|(y, x)| y + f64::from(alpha) * x).collect(),
                )]
            },
            |dev, b| {
                dev.axpy(alpha, b.view("x")?, b.view_mut("y")?)?;
                Ok(vec![])
            },
        );
    }
}

fn scale<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, len) in [0usize, 1, 37, 1000].into_iter().enumerate() {
        let alpha = s.rng.uniform(-2.0, 2.0) as f32;
        let case = KernelCase::new("scale", format!("{len} elements, alpha {alpha}"))
            .inout("x", s.rng.values(len, -2.0, 2.0))
            .free_len("x")
            .tolerance(0.0, 2.0 * U);
        let case = if i == 1 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                let v = x["x"].iter().map(|v| v * f64::from(alpha)).collect();
                vec![Expected::new("x", v)]
            },
            |dev, b| {
                dev.scale(b.view_mut("x")?, alpha)?;
                Ok(vec![])
            },
        );
    }
}

fn copy_cols<B: Backend>(s: &mut Suite<'_, B>) {
    let blocks = [
        // rows, cols, src stride/offset, dst stride/offset
        (5, 3, 7, 2, 4, 1),
        (1, 1, 1, 0, 1, 0),
        (9, 8, 8, 0, 17, 9),
        (4, 5, 12, 7, 5, 0),
        (0, 3, 4, 1, 3, 0),
    ];
    let mut first = true;
    for (rows, cols, src_stride, src_offset, dst_stride, dst_offset) in blocks {
        for accumulate in [false, true] {
            let dims = CopyCols {
                rows,
                cols,
                src_stride,
                src_offset,
                dst_stride,
                dst_offset,
                accumulate,
            };
            let case = KernelCase::new(
                "copy_cols",
                format!(
                    "{rows} rows of {cols} from [{src_offset}..] of {src_stride} to \
                     [{dst_offset}..] of {dst_stride}{}",
                    if accumulate { ", accumulate" } else { "" }
                ),
            )
            .input("src", s.rng.values(rows * src_stride, -2.0, 2.0))
            .inout("dst", s.rng.values(rows * dst_stride, -2.0, 2.0))
            .same_dtype("src", "dst")
            .tolerance(0.0, 2.0 * U);
            let case = if std::mem::take(&mut first) {
                case.with_refusals()
            } else {
                case
            };
            if accumulate && rows == 5 {
                let bad = CopyCols {
                    src_offset: src_stride - cols + 1,
                    ..dims
                };
                s.check_refusal(&case, "a block past its row stride", &[], |dev, b| {
                    dev.copy_cols(b.view("src")?, b.view_mut("dst")?, bad)?;
                    Ok(vec![])
                });
            }
            s.check_kernel(
                case,
                |x| {
                    vec![Expected::new(
                        "dst",
                        r::copy_cols(&x["src"], &x["dst"], dims),
                    )]
                },
                |dev, b| {
                    dev.copy_cols(b.view("src")?, b.view_mut("dst")?, dims)?;
                    Ok(vec![])
                },
            );
        }
    }
}

fn column_sum<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (rows, cols)) in [(1, 1), (7, 33), (130, 5), (0, 4)].into_iter().enumerate() {
        let case = KernelCase::new("column_sum", format!("{rows} rows of {cols}"))
            .input("x", s.rng.values(rows * cols, -2.0, 2.0))
            .inout("out", s.rng.values(cols, -2.0, 2.0))
            .tolerance(16.0 * U * (rows as f64 + 1.0), 16.0 * U);
        let case = if i == 1 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                vec![Expected::new(
                    "out",
                    r::column_sum(&x["x"], &x["out"], rows, cols),
                )]
            },
            |dev, b| {
                dev.column_sum(b.view("x")?, b.view_mut("out")?, rows, cols)?;
                Ok(vec![])
            },
        );
    }
}

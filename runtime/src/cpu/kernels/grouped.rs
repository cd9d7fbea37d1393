//! The grouped matmul: many independent matmuls as one kernel (a GPU runs
//! them as one cuBLAS grouped GEMM). Each problem is exactly [`matmul`]
//! with its dims, so grouping never changes the bits.

use super::check;
use super::dense::matmul;
use crate::backend::MatmulProblem;
use crate::error::{Result, RuntimeError};

/// Runs every problem in order, after checking all of their sizes, so a bad
/// problem leaves every `C` untouched.
pub fn grouped_matmul(problems: &mut [MatmulProblem<&[f32], &mut [f32]>]) -> Result<()> {
    let kn = "grouped_matmul";
    for (i, p) in problems.iter().enumerate() {
        let d = p.dims;
        let name = |operand: &str| format!("problems[{i}].{operand}");
        check::len(kn, &name("A"), p.a.len(), check::product(kn, &[d.m, d.k])?)?;
        check::len(kn, &name("B"), p.b.len(), check::product(kn, &[d.k, d.n])?)?;
        check::len(kn, &name("C"), p.c.len(), check::product(kn, &[d.m, d.n])?)?;
    }
    for (i, p) in problems.iter_mut().enumerate() {
        matmul(p.a, p.b, p.c, p.dims).map_err(|e| {
            RuntimeError::InvalidArgument(format!("grouped_matmul, problem {i}: {e}"))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MatmulDims;

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

    #[test]
    fn a_bad_problem_is_named_and_nothing_is_written() {
        let (a, b) = (vec![1.0f32; 6], vec![1.0f32; 6]);
        let (mut c0, mut c1) = (vec![7.0f32; 4], vec![7.0f32; 3]);
        let mut problems = vec![
            MatmulProblem {
                a: &a[..4],
                b: &b[..4],
                c: &mut c0[..],
                dims: MatmulDims::linear(2, 2, 2),
            },
            MatmulProblem {
                a: &a[..],
                b: &b[..],
                c: &mut c1[..],
                dims: MatmulDims::linear(2, 3, 2),
            },
        ];
        let err = grouped_matmul(&mut problems).unwrap_err().to_string();
        assert!(err.contains("problems[1].C"), "{err}");
        assert_eq!(c0, [7.0; 4], "the good problem ran before the check");
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
            super::super::matmul(&x, &y, &mut want, DIMS).unwrap();
            round_bf16(&mut want);
            assert_eq!(read(&b, &c16), want);
            assert!(
                b.grouped_matmul(Vec::new()).is_ok(),
                "an empty group is a no-op"
            );
        }
    }
}

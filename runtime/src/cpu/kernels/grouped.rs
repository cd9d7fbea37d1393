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
}

//! Causal depthwise conv1d along time (Mamba's short convolution), restarting
//! at every sequence boundary.

use super::check;
use crate::backend::ConvDims;
use crate::error::Result;

/// Checks the views; returns `rows`.
fn validate(kernel: &str, dims: ConvDims, x: usize, w: usize) -> Result<usize> {
    let rows = dims.tokens.rows()?;
    check::ensure(dims.kernel > 0, || {
        format!("{kernel}: the kernel width is 0")
    })?;
    check::len(
        kernel,
        "x",
        x,
        check::product(kernel, &[rows, dims.channels])?,
    )?;
    check::len(
        kernel,
        "weight",
        w,
        check::product(kernel, &[dims.channels, dims.kernel])?,
    )?;
    Ok(rows)
}

pub fn conv1d_forward(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    y: &mut [f32],
    dims: ConvDims,
) -> Result<()> {
    let kn = "conv1d_forward";
    validate(kn, dims, x.len(), weight.len())?;
    check::len(kn, "bias", bias.len(), dims.channels)?;
    check::len(kn, "y", y.len(), x.len())?;
    let (c_n, k_n, seq) = (dims.channels, dims.kernel, dims.tokens.seq);
    for b in 0..dims.tokens.batch {
        for t in 0..seq {
            let out = &mut y[(b * seq + t) * c_n..][..c_n];
            out.copy_from_slice(bias);
            // Tap j reads step t - (K-1) + j; taps before the sequence start are zero.
            for j in (k_n - 1).saturating_sub(t)..k_n {
                let s = t + j + 1 - k_n;
                let xin = &x[(b * seq + s) * c_n..][..c_n];
                for c in 0..c_n {
                    out[c] += weight[c * k_n + j] * xin[c];
                }
            }
        }
    }
    Ok(())
}

pub fn conv1d_backward_input(
    dy: &[f32],
    weight: &[f32],
    dx: &mut [f32],
    dims: ConvDims,
) -> Result<()> {
    let kn = "conv1d_backward_input";
    validate(kn, dims, dy.len(), weight.len())?;
    check::len(kn, "dx", dx.len(), dy.len())?;
    let (c_n, k_n, seq) = (dims.channels, dims.kernel, dims.tokens.seq);
    for b in 0..dims.tokens.batch {
        for s in 0..seq {
            let out = &mut dx[(b * seq + s) * c_n..][..c_n];
            out.fill(0.0);
            // Step s feeds output t = s + (K-1) - j through tap j.
            for j in 0..k_n {
                let t = s + k_n - 1 - j;
                if t >= seq {
                    continue;
                }
                let g = &dy[(b * seq + t) * c_n..][..c_n];
                for c in 0..c_n {
                    out[c] += weight[c * k_n + j] * g[c];
                }
            }
        }
    }
    Ok(())
}

pub fn conv1d_backward_weight(
    dy: &[f32],
    x: &[f32],
    dw: &mut [f32],
    dbias: &mut [f32],
    dims: ConvDims,
) -> Result<()> {
    let kn = "conv1d_backward_weight";
    validate(kn, dims, x.len(), dw.len())?;
    check::len(kn, "dy", dy.len(), x.len())?;
    check::len(kn, "dbias", dbias.len(), dims.channels)?;
    let (c_n, k_n, seq) = (dims.channels, dims.kernel, dims.tokens.seq);
    for b in 0..dims.tokens.batch {
        for t in 0..seq {
            let g = &dy[(b * seq + t) * c_n..][..c_n];
            for c in 0..c_n {
                dbias[c] += g[c];
            }
            for j in (k_n - 1).saturating_sub(t)..k_n {
                let s = t + j + 1 - k_n;
                let xin = &x[(b * seq + s) * c_n..][..c_n];
                for c in 0..c_n {
                    dw[c * k_n + j] += g[c] * xin[c];
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.61 + seed).sin()).collect()
    }

    /// `y` from the definition, sequence by sequence.
    fn reference(x: &[f32], w: &[f32], bias: &[f32], dims: ConvDims) -> Vec<f64> {
        let (c_n, k_n, seq) = (dims.channels, dims.kernel, dims.tokens.seq);
        let mut y = vec![0.0; x.len()];
        for b in 0..dims.tokens.batch {
            for t in 0..seq {
                for c in 0..c_n {
                    let mut acc = bias[c] as f64;
                    for j in 0..k_n {
                        let s = t as i64 - (k_n as i64 - 1) + j as i64;
                        if s >= 0 {
                            acc +=
                                w[c * k_n + j] as f64 * x[(b * seq + s as usize) * c_n + c] as f64;
                        }
                    }
                    y[(b * seq + t) * c_n + c] = acc;
                }
            }
        }
        y
    }

    #[test]
    fn forward_and_backward_match_the_definition() {
        let dims = ConvDims {
            tokens: Tokens::new(2, 5),
            channels: 3,
            kernel: 4,
        };
        let x = data(30, 0.2);
        let w = data(12, 1.0);
        let bias = data(3, 2.0);
        let mut y = vec![0.0; 30];
        conv1d_forward(&x, &w, &bias, &mut y, dims).unwrap();
        for (a, b) in y.iter().zip(reference(&x, &w, &bias, dims)) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
        // The output is linear in x, w and bias: check gradients of
        // L = sum dy * y exactly by unit perturbations of the reference.
        let dy = data(30, 3.0);
        let loss = |x: &[f32], w: &[f32], bias: &[f32]| -> f64 {
            reference(x, w, bias, dims)
                .iter()
                .zip(&dy)
                .map(|(a, b)| a * *b as f64)
                .sum()
        };
        let base = loss(&x, &w, &bias);
        let mut dx = vec![9.0; 30];
        conv1d_backward_input(&dy, &w, &mut dx, dims).unwrap();
        for i in 0..30 {
            let mut xp = x.clone();
            xp[i] += 1.0;
            assert!((dx[i] as f64 - (loss(&xp, &w, &bias) - base)).abs() < 1e-4);
        }
        let (mut dw, mut db) = (vec![0.0; 12], vec![0.0; 3]);
        conv1d_backward_weight(&dy, &x, &mut dw, &mut db, dims).unwrap();
        for i in 0..12 {
            let mut wp = w.clone();
            wp[i] += 1.0;
            assert!((dw[i] as f64 - (loss(&x, &wp, &bias) - base)).abs() < 1e-4);
        }
        for i in 0..3 {
            let mut bp = bias.clone();
            bp[i] += 1.0;
            assert!((db[i] as f64 - (loss(&x, &w, &bp) - base)).abs() < 1e-4);
        }
    }

    #[test]
    fn sequences_do_not_leak_into_each_other() {
        let dims = ConvDims {
            tokens: Tokens::new(2, 3),
            channels: 1,
            kernel: 4,
        };
        let x = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0];
        let mut y = [0.0; 6];
        conv1d_forward(&x, &[1.0; 4], &[0.0], &mut y, dims).unwrap();
        assert_eq!(y, [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]);
        assert!(conv1d_forward(&x, &[1.0; 3], &[0.0], &mut y, dims).is_err());
    }
}

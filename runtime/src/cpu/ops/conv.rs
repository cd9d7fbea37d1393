//! Causal depthwise conv1d along time (Mamba's short convolution),
//! restarting at every sequence boundary.

use crate::backend::{ConvDims, ConvKernels};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl ConvKernels<CpuBuf> for CpuBackend {
    fn conv1d_forward_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        weight: View<'_, CpuBuf>,
        bias: View<'_, CpuBuf>,
        y: ViewMut<'_, CpuBuf>,
        dims: ConvDims,
    ) -> Result<()> {
        let k = self.access("conv1d_forward");
        let (x, w, bias) = (
            k.f32_in("x", x)?,
            k.f32_in("weight", weight)?,
            k.f32_in("bias", bias)?,
        );
        conv1d_forward(&x, &w, &bias, &mut k.f32_out("y", y)?, dims);
        Ok(())
    }

    fn conv1d_backward_input_unchecked(
        &self,
        dy: View<'_, CpuBuf>,
        weight: View<'_, CpuBuf>,
        dx: ViewMut<'_, CpuBuf>,
        dims: ConvDims,
    ) -> Result<()> {
        let k = self.access("conv1d_backward_input");
        let (dy, w) = (k.f32_in("dy", dy)?, k.f32_in("weight", weight)?);
        conv1d_backward_input(&dy, &w, &mut k.f32_out("dx", dx)?, dims);
        Ok(())
    }

    fn conv1d_backward_weight_unchecked(
        &self,
        dy: View<'_, CpuBuf>,
        x: View<'_, CpuBuf>,
        dw: ViewMut<'_, CpuBuf>,
        dbias: ViewMut<'_, CpuBuf>,
        dims: ConvDims,
    ) -> Result<()> {
        let k = self.access("conv1d_backward_weight");
        let (dy, x) = (k.f32_in("dy", dy)?, k.f32_in("x", x)?);
        conv1d_backward_weight(
            &dy,
            &x,
            &mut k.f32_out("dw", dw)?,
            &mut k.f32_out("dbias", dbias)?,
            dims,
        );
        Ok(())
    }
}

pub fn conv1d_forward(x: &[f32], weight: &[f32], bias: &[f32], y: &mut [f32], dims: ConvDims) {
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
}

pub fn conv1d_backward_input(dy: &[f32], weight: &[f32], dx: &mut [f32], dims: ConvDims) {
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
}

pub fn conv1d_backward_weight(
    dy: &[f32],
    x: &[f32],
    dw: &mut [f32],
    dbias: &mut [f32],
    dims: ConvDims,
) {
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
        conv1d_forward(&x, &w, &bias, &mut y, dims);
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
        conv1d_backward_input(&dy, &w, &mut dx, dims);
        for i in 0..30 {
            let mut xp = x.clone();
            xp[i] += 1.0;
            assert!((dx[i] as f64 - (loss(&xp, &w, &bias) - base)).abs() < 1e-4);
        }
        let (mut dw, mut db) = (vec![0.0; 12], vec![0.0; 3]);
        conv1d_backward_weight(&dy, &x, &mut dw, &mut db, dims);
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
        conv1d_forward(&x, &[1.0; 4], &[0.0], &mut y, dims);
        assert_eq!(y, [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]);
    }
}

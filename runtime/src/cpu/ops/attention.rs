//! Causal softmax attention with grouped KV heads and separate q/k and v
//! head dims: forward keeps the log-sum-exp per (row, head); backward
//! recomputes the probabilities from it (the flash-attention split), so no
//! `[seq, seq]` matrix outlives a call. And the rotary position embedding,
//! in place on a channel block of every head, with positions counted from
//! each sequence's start; rotate-half or interleaved pairs
//! ([`RotaryPairing`](crate::backend::RotaryPairing)).

use super::dense::{axpy_row, dot};
use crate::backend::{AttentionDims, AttentionInputs, AttentionKernels, RotaryDims};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl AttentionKernels<CpuBuf> for CpuBackend {
    fn attention_forward_unchecked(
        &self,
        inputs: AttentionInputs<View<'_, CpuBuf>>,
        out: ViewMut<'_, CpuBuf>,
        lse: ViewMut<'_, CpuBuf>,
        dims: AttentionDims,
    ) -> Result<()> {
        let k = self.access("attention_forward");
        let (q, kk, v) = (
            k.f32_in("q", inputs.q)?,
            k.f32_in("k", inputs.k)?,
            k.f32_in("v", inputs.v)?,
        );
        let lse = k.typed_out::<f32>("lse", lse)?;
        attention_forward(
            AttentionInputs {
                q: &q,
                k: &kk,
                v: &v,
            },
            &mut k.f32_out("out", out)?,
            lse,
            dims,
        );
        Ok(())
    }

    fn attention_backward_unchecked(
        &self,
        inputs: AttentionInputs<View<'_, CpuBuf>>,
        out: View<'_, CpuBuf>,
        lse: View<'_, CpuBuf>,
        dout: View<'_, CpuBuf>,
        grads: AttentionInputs<ViewMut<'_, CpuBuf>>,
        dims: AttentionDims,
    ) -> Result<()> {
        let k = self.access("attention_backward");
        let (q, kk, v) = (
            k.f32_in("q", inputs.q)?,
            k.f32_in("k", inputs.k)?,
            k.f32_in("v", inputs.v)?,
        );
        let (out, dout) = (k.f32_in("out", out)?, k.f32_in("dout", dout)?);
        let lse = k.typed_in::<f32>("lse", lse)?;
        attention_backward(
            AttentionInputs {
                q: &q,
                k: &kk,
                v: &v,
            },
            &out,
            lse,
            &dout,
            AttentionInputs {
                q: &mut k.f32_out("dq", grads.q)?,
                k: &mut k.f32_out("dk", grads.k)?,
                v: &mut k.f32_out("dv", grads.v)?,
            },
            dims,
        );
        Ok(())
    }

    fn rotary_forward_unchecked(&self, x: ViewMut<'_, CpuBuf>, dims: RotaryDims) -> Result<()> {
        let k = self.access("rotary_forward");
        rotary_forward(&mut k.f32_out("x", x)?, dims);
        Ok(())
    }

    fn rotary_backward_unchecked(&self, dx: ViewMut<'_, CpuBuf>, dims: RotaryDims) -> Result<()> {
        let k = self.access("rotary_backward");
        rotary_backward(&mut k.f32_out("dx", dx)?, dims);
        Ok(())
    }
}

/// Row offsets of query head `j` at row `r`, and of its KV head.
struct Strides {
    heads: usize,
    kv_heads: usize,
    group: usize,
    dq: usize,
    dv: usize,
}

impl Strides {
    fn new(dims: AttentionDims) -> Self {
        Strides {
            heads: dims.heads,
            kv_heads: dims.kv_heads,
            group: dims.heads / dims.kv_heads,
            dq: dims.qk_dim,
            dv: dims.v_dim,
        }
    }
    fn q(&self, r: usize, j: usize) -> usize {
        (r * self.heads + j) * self.dq
    }
    fn k(&self, r: usize, j: usize) -> usize {
        (r * self.kv_heads + j / self.group) * self.dq
    }
    fn v(&self, r: usize, j: usize) -> usize {
        (r * self.kv_heads + j / self.group) * self.dv
    }
    fn o(&self, r: usize, j: usize) -> usize {
        (r * self.heads + j) * self.dv
    }
}

pub fn attention_forward(
    inputs: AttentionInputs<&[f32]>,
    out: &mut [f32],
    lse: &mut [f32],
    dims: AttentionDims,
) {
    let s = Strides::new(dims);
    let seq = dims.tokens.seq;
    let mut scores = vec![0.0f32; seq];
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            for j in 0..dims.heads {
                let q = &inputs.q[s.q(base + t, j)..][..s.dq];
                let mut max = f32::NEG_INFINITY;
                for (u, sc) in scores[..=t].iter_mut().enumerate() {
                    *sc = dims.scale * dot(q, &inputs.k[s.k(base + u, j)..][..s.dq]);
                    max = max.max(*sc);
                }
                let o = &mut out[s.o(base + t, j)..][..s.dv];
                o.fill(0.0);
                let mut sum = 0.0f32;
                for (u, sc) in scores[..=t].iter().enumerate() {
                    let p = (sc - max).exp();
                    sum += p;
                    axpy_row(p, &inputs.v[s.v(base + u, j)..][..s.dv], o);
                }
                let inv = 1.0 / sum;
                for v in o.iter_mut() {
                    *v *= inv;
                }
                lse[(base + t) * dims.heads + j] = max + sum.ln();
            }
        }
    }
}

pub fn attention_backward(
    inputs: AttentionInputs<&[f32]>,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    grads: AttentionInputs<&mut [f32]>,
    dims: AttentionDims,
) {
    let AttentionInputs {
        q: dq,
        k: dk,
        v: dv,
    } = grads;
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    let s = Strides::new(dims);
    let seq = dims.tokens.seq;
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            for j in 0..dims.heads {
                let q = &inputs.q[s.q(base + t, j)..][..s.dq];
                let g = &dout[s.o(base + t, j)..][..s.dv];
                let delta = dot(g, &out[s.o(base + t, j)..][..s.dv]);
                let l = lse[(base + t) * dims.heads + j];
                let dq_t = &mut dq[s.q(base + t, j)..][..s.dq];
                for u in 0..=t {
                    let k = &inputs.k[s.k(base + u, j)..][..s.dq];
                    let v = &inputs.v[s.v(base + u, j)..][..s.dv];
                    let p = (dims.scale * dot(q, k) - l).exp();
                    let ds = p * (dot(g, v) - delta) * dims.scale;
                    axpy_row(ds, k, dq_t);
                    axpy_row(ds, q, &mut dk[s.k(base + u, j)..][..s.dq]);
                    axpy_row(p, g, &mut dv[s.v(base + u, j)..][..s.dv]);
                }
            }
        }
    }
}

// ---- rotary position embeddings ------------------------------------------------

/// Rotates every pair by `sign * theta` (sign -1 is the inverse rotation).
fn rotate(x: &mut [f32], dims: RotaryDims, sign: f32) {
    let half = dims.dim / 2;
    if half == 0 || dims.heads == 0 {
        return;
    }
    // inv_freq_i = 1 / base^(2i/dim), as Megatron computes it in f32.
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / dims.base.powf((2 * i) as f32 / dims.dim as f32))
        .collect();
    let row_len = dims.heads * dims.head_stride;
    for (r, row) in x.chunks_exact_mut(row_len).enumerate() {
        let pos = (r % dims.tokens.seq) as f32;
        for head in row.chunks_exact_mut(dims.head_stride) {
            let block = &mut head[dims.offset..dims.offset + dims.dim];
            for (i, &f) in inv_freq.iter().enumerate() {
                let (sin, cos) = (pos * f).sin_cos();
                let sin = sign * sin;
                let (a, b) = dims.pairing.pair(i, dims.dim);
                let (x1, x2) = (block[a], block[b]);
                block[a] = x1 * cos - x2 * sin;
                block[b] = x2 * cos + x1 * sin;
            }
        }
    }
}

pub fn rotary_forward(x: &mut [f32], dims: RotaryDims) {
    rotate(x, dims, 1.0);
}

pub fn rotary_backward(dx: &mut [f32], dims: RotaryDims) {
    rotate(dx, dims, -1.0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.53 + seed).sin()).collect()
    }

    fn dims() -> AttentionDims {
        AttentionDims {
            tokens: Tokens::new(2, 4),
            heads: 4,
            kv_heads: 2,
            qk_dim: 3,
            v_dim: 2,
            scale: 0.6,
        }
    }

    /// Softmax attention from the definition, in f64.
    fn reference(q: &[f32], k: &[f32], v: &[f32], d: AttentionDims) -> Vec<f64> {
        let s = Strides::new(d);
        let seq = d.tokens.seq;
        let mut o = vec![0.0; d.tokens.batch * seq * d.heads * d.v_dim];
        for b in 0..d.tokens.batch {
            for t in 0..seq {
                for j in 0..d.heads {
                    let r = b * seq + t;
                    let sc: Vec<f64> = (0..=t)
                        .map(|u| {
                            (0..d.qk_dim)
                                .map(|i| {
                                    q[s.q(r, j) + i] as f64 * k[s.k(b * seq + u, j) + i] as f64
                                })
                                .sum::<f64>()
                                * d.scale as f64
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    for (u, x) in sc.iter().enumerate() {
                        let p = (x - m).exp() / z;
                        for i in 0..d.v_dim {
                            o[s.o(r, j) + i] += p * v[s.v(b * seq + u, j) + i] as f64;
                        }
                    }
                }
            }
        }
        o
    }

    #[test]
    fn forward_and_backward_match_the_definition() {
        let d = dims();
        let (q, k, v) = (data(8 * 12, 0.1), data(8 * 6, 1.3), data(8 * 4, 2.9));
        let mut out = vec![0.0; 8 * 8];
        let mut lse = vec![0.0; 8 * 4];
        attention_forward(
            AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
            },
            &mut out,
            &mut lse,
            d,
        );
        for (a, b) in out.iter().zip(reference(&q, &k, &v, d)) {
            assert!((*a as f64 - b).abs() < 1e-5);
        }
        let dout = data(64, 0.7);
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let grads = AttentionInputs {
            q: &mut dq[..],
            k: &mut dk[..],
            v: &mut dv[..],
        };
        attention_backward(
            AttentionInputs {
                q: &q,
                k: &k,
                v: &v,
            },
            &out,
            &lse,
            &dout,
            grads,
            d,
        );
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            reference(q, k, v, d)
                .iter()
                .zip(&dout)
                .map(|(a, b)| a * *b as f64)
                .sum()
        };
        let h = 1e-3f32;
        let fd = |which: usize, i: usize| -> f64 {
            let mut t = [q.clone(), k.clone(), v.clone()];
            t[which][i] += h;
            let plus = loss(&t[0], &t[1], &t[2]);
            t[which][i] -= 2.0 * h;
            let minus = loss(&t[0], &t[1], &t[2]);
            (plus - minus) / (2.0 * h as f64)
        };
        for (which, got) in [&dq, &dk, &dv].into_iter().enumerate() {
            for (i, &g) in got.iter().enumerate() {
                let want = fd(which, i);
                assert!(
                    (g as f64 - want).abs() < 1e-3,
                    "tensor {which}[{i}]: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn the_first_token_attends_only_to_itself() {
        let d = AttentionDims {
            tokens: Tokens::new(1, 3),
            heads: 1,
            kv_heads: 1,
            qk_dim: 1,
            v_dim: 1,
            scale: 1.0,
        };
        let mut out = vec![0.0; 3];
        let mut lse = vec![0.0; 3];
        let v = [5.0, 7.0, 9.0];
        attention_forward(
            AttentionInputs {
                q: &[1.0; 3],
                k: &[0.0; 3],
                v: &v,
            },
            &mut out,
            &mut lse,
            d,
        );
        assert_eq!(out, vec![5.0, 6.0, 7.0]);
    }

    mod rotary {
        use super::super::*;
        use crate::backend::attention::check_rotary_forward;
        use crate::backend::{RotaryPairing, Tokens};
        use crate::view::{DType, Operand};

        fn dims() -> RotaryDims {
            RotaryDims {
                tokens: Tokens::new(2, 3),
                heads: 2,
                head_stride: 6,
                offset: 2,
                dim: 4,
                base: 10_000.0,
                pairing: RotaryPairing::RotateHalf,
            }
        }

        /// Each pairing turns its pair (a, b) of the rotated channels by
        /// `t * base^(-2i/dim)` and leaves the other channels: rotate-half
        /// pairs channel i with i + dim/2; MLA's interleaved pairing
        /// (Megatron's `mla_rotary_interleaved`) pairs 2i with 2i + 1.
        #[test]
        fn each_pairing_turns_its_pairs_and_leaves_other_channels() {
            let x: Vec<f32> = (0..72).map(|i| (i as f32 * 0.3).cos()).collect();
            for (pairing, pair) in [
                (
                    RotaryPairing::RotateHalf,
                    (|i| (i, i + 2)) as fn(usize) -> (usize, usize),
                ),
                (RotaryPairing::Interleaved, |i| (2 * i, 2 * i + 1)),
            ] {
                let d = RotaryDims { pairing, ..dims() };
                let mut y = x.clone();
                rotary_forward(&mut y, d);
                for r in 0..6 {
                    let pos = (r % 3) as f64;
                    for h in 0..2 {
                        let base = (r * 2 + h) * 6;
                        assert_eq!(&y[base..base + 2], &x[base..base + 2]);
                        for i in 0..2 {
                            let theta = pos * 10_000f64.powf(-(2.0 * i as f64) / 4.0);
                            let (ia, ib) = pair(i);
                            let (at, bt) = (base + 2 + ia, base + 2 + ib);
                            let (a, b) = (x[at] as f64, x[bt] as f64);
                            let want_a = a * theta.cos() - b * theta.sin();
                            let want_b = b * theta.cos() + a * theta.sin();
                            let why = format!("{pairing:?}: row {r} head {h} pair {i}");
                            assert!((y[at] as f64 - want_a).abs() < 1e-5, "{why}");
                            assert!((y[bt] as f64 - want_b).abs() < 1e-5, "{why}");
                        }
                    }
                }
            }
        }

        #[test]
        fn backward_is_the_transpose_of_forward() {
            for pairing in [RotaryPairing::RotateHalf, RotaryPairing::Interleaved] {
                transpose_holds(RotaryDims { pairing, ..dims() });
            }
        }

        // <R x, g> == <x, R^T g> for random x and g.
        fn transpose_holds(d: RotaryDims) {
            let x: Vec<f32> = (0..72).map(|i| (i as f32 * 0.7).sin()).collect();
            let g: Vec<f32> = (0..72).map(|i| (i as f32 * 1.1).cos()).collect();
            let mut rx = x.clone();
            rotary_forward(&mut rx, d);
            let mut rtg = g.clone();
            rotary_backward(&mut rtg, d);
            let lhs: f64 = rx.iter().zip(&g).map(|(a, b)| *a as f64 * *b as f64).sum();
            let rhs: f64 = x.iter().zip(&rtg).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!((lhs - rhs).abs() < 1e-4);
            let (x, short) = (Operand::new(72, DType::F32), Operand::new(71, DType::F32));
            assert!(check_rotary_forward(short, d).is_err());
            assert!(check_rotary_forward(x, RotaryDims { offset: 3, ..d }).is_err());
        }
    }
}

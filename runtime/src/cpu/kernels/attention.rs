//! Causal softmax attention with grouped KV heads and separate q/k and v
//! head dims. Forward keeps the log-sum-exp per (row, head); backward
//! recomputes the probabilities from it (the flash-attention split), so no
//! `[seq, seq]` matrix outlives a call.

use super::check;
use crate::cpu::ops::dense::{axpy_row, dot};
use crate::backend::{AttentionDims, AttentionInputs};
use crate::error::Result;

/// Checks every view; returns `rows`.
fn validate(kernel: &str, dims: AttentionDims, inputs: &AttentionInputs<&[f32]>) -> Result<usize> {
    let rows = dims.tokens.rows()?;
    check::ensure(
        dims.kv_heads > 0 && dims.heads.is_multiple_of(dims.kv_heads),
        || {
            format!(
                "{kernel}: {} KV heads do not divide {} heads",
                dims.kv_heads, dims.heads
            )
        },
    )?;
    check::len(
        kernel,
        "q",
        inputs.q.len(),
        check::product(kernel, &[rows, dims.heads, dims.qk_dim])?,
    )?;
    check::len(
        kernel,
        "k",
        inputs.k.len(),
        check::product(kernel, &[rows, dims.kv_heads, dims.qk_dim])?,
    )?;
    check::len(
        kernel,
        "v",
        inputs.v.len(),
        check::product(kernel, &[rows, dims.kv_heads, dims.v_dim])?,
    )?;
    check::product(kernel, &[rows, dims.heads, dims.v_dim])?;
    Ok(rows)
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
) -> Result<()> {
    let kn = "attention_forward";
    let rows = validate(kn, dims, &inputs)?;
    check::len(kn, "out", out.len(), rows * dims.heads * dims.v_dim)?;
    check::len(kn, "lse", lse.len(), rows * dims.heads)?;
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
    Ok(())
}

pub fn attention_backward(
    inputs: AttentionInputs<&[f32]>,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    grads: AttentionInputs<&mut [f32]>,
    dims: AttentionDims,
) -> Result<()> {
    let kn = "attention_backward";
    let rows = validate(kn, dims, &inputs)?;
    check::len(kn, "out", out.len(), rows * dims.heads * dims.v_dim)?;
    check::len(kn, "dout", dout.len(), out.len())?;
    check::len(kn, "lse", lse.len(), rows * dims.heads)?;
    check::len(kn, "grads.q", grads.q.len(), inputs.q.len())?;
    check::len(kn, "grads.k", grads.k.len(), inputs.k.len())?;
    check::len(kn, "grads.v", grads.v.len(), inputs.v.len())?;
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
    Ok(())
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
        )
        .unwrap();
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
        )
        .unwrap();
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
        )
        .unwrap();
        assert_eq!(out, vec![5.0, 6.0, 7.0]);
        let bad = AttentionDims { kv_heads: 2, ..d };
        assert!(
            attention_forward(
                AttentionInputs {
                    q: &[1.0; 3],
                    k: &[0.0; 3],
                    v: &v
                },
                &mut out,
                &mut lse,
                bad
            )
            .is_err()
        );
    }
}

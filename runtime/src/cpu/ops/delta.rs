//! The gated delta rule, evaluated sequentially per (sequence, value head).
//!
//! Every row `p` of a head's state `S` `[dv', dk]` evolves on its own given
//! the step's normalised key: `S_p = exp(g) S_p`, `u_p = beta (v_p - S_p .
//! k)`, `S_p += u_p k`, `out_p = S_p . q`. Forward keeps only the state at
//! the start of every chunk; backward walks the chunks in reverse,
//! recomputes the chunk's states from its saved start (the same operations
//! in the same order, so the same bits) and runs the reverse recurrence of
//! the state gradient. The value heads of one key head are walked in
//! order, and their query and key gradients summed in that order, so the
//! sums never depend on anything but the dimensions.

use crate::backend::delta::DELTA_L2_EPS;
use crate::backend::{DeltaDims, DeltaGrads, DeltaInputs, DeltaKernels};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl DeltaKernels<CpuBuf> for CpuBackend {
    fn gated_delta_forward_unchecked(
        &self,
        inputs: DeltaInputs<View<'_, CpuBuf>>,
        out: ViewMut<'_, CpuBuf>,
        states: ViewMut<'_, CpuBuf>,
        dims: DeltaDims,
    ) -> Result<()> {
        let k = self.access("gated_delta_forward");
        let (qkv, beta, alpha, dt_bias, a_log) = (
            k.f32_in("qkv", inputs.qkv)?,
            k.f32_in("beta", inputs.beta)?,
            k.f32_in("alpha", inputs.alpha)?,
            k.f32_in("dt_bias", inputs.dt_bias)?,
            k.f32_in("a_log", inputs.a_log)?,
        );
        let states = k.typed_out::<f32>("states", states)?;
        gated_delta_forward(
            DeltaInputs {
                qkv: &qkv,
                beta: &beta,
                alpha: &alpha,
                dt_bias: &dt_bias,
                a_log: &a_log,
            },
            &mut k.f32_out("out", out)?,
            states,
            dims,
        );
        Ok(())
    }

    fn gated_delta_backward_unchecked(
        &self,
        inputs: DeltaInputs<View<'_, CpuBuf>>,
        states: View<'_, CpuBuf>,
        d_out: View<'_, CpuBuf>,
        grads: DeltaGrads<ViewMut<'_, CpuBuf>>,
        dims: DeltaDims,
    ) -> Result<()> {
        let k = self.access("gated_delta_backward");
        let (qkv, beta, alpha, dt_bias, a_log) = (
            k.f32_in("qkv", inputs.qkv)?,
            k.f32_in("beta", inputs.beta)?,
            k.f32_in("alpha", inputs.alpha)?,
            k.f32_in("dt_bias", inputs.dt_bias)?,
            k.f32_in("a_log", inputs.a_log)?,
        );
        let states = k.typed_in::<f32>("states", states)?;
        let d_out = k.f32_in("d_out", d_out)?;
        gated_delta_backward(
            DeltaInputs {
                qkv: &qkv,
                beta: &beta,
                alpha: &alpha,
                dt_bias: &dt_bias,
                a_log: &a_log,
            },
            states,
            &d_out,
            DeltaGrads {
                qkv: &mut k.f32_out("d_qkv", grads.qkv)?,
                beta: &mut k.f32_out("d_beta", grads.beta)?,
                alpha: &mut k.f32_out("d_alpha", grads.alpha)?,
                a_log: &mut k.f32_out("d_a_log", grads.a_log)?,
            },
            dims,
        );
        Ok(())
    }
}

/// `log(1 + exp(x))`, linear above 20 as PyTorch's default threshold (and
/// flash-linear-attention's in-kernel gate).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// The derivative of [`softplus`].
fn softplus_derivative(x: f32) -> f32 {
    if x > 20.0 { 1.0 } else { sigmoid(x) }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

/// Where a head's pieces live in a row of `qkv` and of the output.
struct Layout {
    width: usize,
    out_width: usize,
    key_heads: usize,
    value_heads: usize,
    dk: usize,
    dv: usize,
    /// Value heads a key head serves: `Hv / Hk`.
    per_key: usize,
}

impl Layout {
    fn new(dims: DeltaDims) -> Self {
        Layout {
            width: dims.qkv_width(),
            out_width: dims.out_width(),
            key_heads: dims.key_heads,
            value_heads: dims.value_heads,
            dk: dims.key_dim,
            dv: dims.value_dim,
            per_key: dims.value_heads / dims.key_heads,
        }
    }
    fn q(&self, i: usize) -> usize {
        i * self.dk
    }
    fn k(&self, i: usize) -> usize {
        (self.key_heads + i) * self.dk
    }
    fn v(&self, j: usize) -> usize {
        2 * self.key_heads * self.dk + j * self.dv
    }
}

/// The gates of value head `j` at row `r`.
struct Gates {
    beta: f32,
    /// `alpha + dt_bias`, softplus's argument.
    raw: f32,
    /// `g = -exp(A_log) softplus(raw)`.
    g: f32,
    decay: f32,
}

impl Gates {
    /// `a` is `exp(A_log[j])`.
    fn at(inputs: &DeltaInputs<&[f32]>, l: &Layout, r: usize, j: usize, a: f32) -> Gates {
        let raw = inputs.alpha[r * l.value_heads + j] + inputs.dt_bias[j];
        let g = -a * softplus(raw);
        Gates {
            beta: sigmoid(inputs.beta[r * l.value_heads + j]),
            raw,
            g,
            decay: g.exp(),
        }
    }
}

/// One sequence's queries and keys of key head `i`, L2-normalised (the
/// queries also scaled), with the reciprocal norms backward needs.
struct Normalised {
    q: Vec<f32>,
    k: Vec<f32>,
    rq: Vec<f32>,
    rk: Vec<f32>,
}

impl Normalised {
    fn new(seq: usize, dk: usize) -> Self {
        Normalised {
            q: vec![0.0; seq * dk],
            k: vec![0.0; seq * dk],
            rq: vec![0.0; seq],
            rk: vec![0.0; seq],
        }
    }

    fn fill(&mut self, qkv: &[f32], l: &Layout, b: usize, i: usize, seq: usize, scale: f32) {
        let dk = l.dk;
        for t in 0..seq {
            let row = &qkv[(b * seq + t) * l.width..][..l.width];
            for (src, dst, r, s) in [
                (&row[l.q(i)..][..dk], &mut self.q, &mut self.rq, scale),
                (&row[l.k(i)..][..dk], &mut self.k, &mut self.rk, 1.0),
            ] {
                let rstd = 1.0 / (dot(src, src) + DELTA_L2_EPS).sqrt();
                r[t] = rstd;
                for (d, &x) in dst[t * dk..][..dk].iter_mut().zip(src) {
                    *d = x * rstd * s;
                }
            }
        }
    }
}

/// One step of one head's state: `S = decay S`, `u = beta (v - S k)`,
/// `S += u k^T`, and `out = S q` where given.
fn step(
    state: &mut [f32],
    gates: &Gates,
    k: &[f32],
    v: &[f32],
    q: &[f32],
    mut out: Option<&mut [f32]>,
) {
    let dk = k.len();
    for (p, s_row) in state.chunks_exact_mut(dk).enumerate() {
        for s in s_row.iter_mut() {
            *s *= gates.decay;
        }
        let u = gates.beta * (v[p] - dot(s_row, k));
        for (s, &kx) in s_row.iter_mut().zip(k) {
            *s += u * kx;
        }
        if let Some(out) = out.as_deref_mut() {
            out[p] = dot(s_row, q);
        }
    }
}

pub fn gated_delta_forward(
    inputs: DeltaInputs<&[f32]>,
    out: &mut [f32],
    states: &mut [f32],
    dims: DeltaDims,
) {
    let l = Layout::new(dims);
    let seq = dims.tokens.seq;
    let chunks = seq.div_ceil(dims.chunk);
    let size = l.dv * l.dk;
    let mut norm = Normalised::new(seq, l.dk);
    let mut state = vec![0.0f32; size];
    for b in 0..dims.tokens.batch {
        for i in 0..l.key_heads {
            norm.fill(inputs.qkv, &l, b, i, seq, dims.scale());
            for j in i * l.per_key..(i + 1) * l.per_key {
                let a = inputs.a_log[j].exp();
                state.fill(0.0);
                for t in 0..seq {
                    if t % dims.chunk == 0 {
                        let at = ((b * chunks + t / dims.chunk) * l.value_heads + j) * size;
                        states[at..at + size].copy_from_slice(&state);
                    }
                    let r = b * seq + t;
                    let gates = Gates::at(&inputs, &l, r, j, a);
                    let v = &inputs.qkv[r * l.width + l.v(j)..][..l.dv];
                    let o = &mut out[r * l.out_width + j * l.dv..][..l.dv];
                    let (q, k) = (&norm.q[t * l.dk..][..l.dk], &norm.k[t * l.dk..][..l.dk]);
                    step(&mut state, &gates, k, v, q, Some(o));
                }
            }
        }
    }
}

pub fn gated_delta_backward(
    inputs: DeltaInputs<&[f32]>,
    states: &[f32],
    d_out: &[f32],
    grads: DeltaGrads<&mut [f32]>,
    dims: DeltaDims,
) {
    let l = Layout::new(dims);
    let DeltaGrads {
        qkv: d_qkv,
        beta: d_beta,
        alpha: d_alpha,
        a_log: d_a_log,
    } = grads;
    let seq = dims.tokens.seq;
    if seq == 0 {
        return;
    }
    let chunks = seq.div_ceil(dims.chunk);
    let chunk = dims.chunk.min(seq);
    let (size, dk, dv) = (l.dv * l.dk, l.dk, l.dv);
    let scale = dims.scale();
    let mut norm = Normalised::new(seq, dk);
    // The gradients of the normalised (and scaled) queries and keys, summed
    // over the key head's value heads; the states after each step of the
    // current chunk; the state gradient.
    let mut dq = vec![0.0f32; seq * dk];
    let mut dk_norm = vec![0.0f32; seq * dk];
    let mut history = vec![0.0f32; chunk * size];
    let mut ds = vec![0.0f32; size];
    let mut decayed = vec![0.0f32; dk];
    for b in 0..dims.tokens.batch {
        for i in 0..l.key_heads {
            norm.fill(inputs.qkv, &l, b, i, seq, scale);
            dq.fill(0.0);
            dk_norm.fill(0.0);
            for j in i * l.per_key..(i + 1) * l.per_key {
                let a = inputs.a_log[j].exp();
                let mut d_a_log_head = 0.0f32;
                ds.fill(0.0);
                for c in (0..chunks).rev() {
                    let start = &states[((b * chunks + c) * l.value_heads + j) * size..][..size];
                    let (t0, t1) = (c * dims.chunk, ((c + 1) * dims.chunk).min(seq));
                    for t in t0..t1 {
                        let r = b * seq + t;
                        let (prev, cur) = history.split_at_mut((t - t0) * size);
                        let cur = &mut cur[..size];
                        cur.copy_from_slice(if t == t0 {
                            start
                        } else {
                            &prev[(t - t0 - 1) * size..]
                        });
                        let gates = Gates::at(&inputs, &l, r, j, a);
                        let v = &inputs.qkv[r * l.width + l.v(j)..][..dv];
                        let (q, k) = (&norm.q[t * dk..][..dk], &norm.k[t * dk..][..dk]);
                        step(cur, &gates, k, v, q, None);
                    }
                    for t in (t0..t1).rev() {
                        let r = b * seq + t;
                        let gates = Gates::at(&inputs, &l, r, j, a);
                        let s_t = &history[(t - t0) * size..][..size];
                        let s_prev = if t == t0 {
                            start
                        } else {
                            &history[(t - t0 - 1) * size..][..size]
                        };
                        let v = &inputs.qkv[r * l.width + l.v(j)..][..dv];
                        let d_o = &d_out[r * l.out_width + j * dv..][..dv];
                        let (q, k) = (&norm.q[t * dk..][..dk], &norm.k[t * dk..][..dk]);
                        let dq_t = &mut dq[t * dk..][..dk];
                        let dk_t = &mut dk_norm[t * dk..][..dk];
                        let dv_t = &mut d_qkv[r * l.width + l.v(j)..][..dv];
                        let (mut d_beta_t, mut d_g) = (0.0f32, 0.0f32);
                        for p in 0..dv {
                            let ds_row = &mut ds[p * dk..][..dk];
                            let st_row = &s_t[p * dk..][..dk];
                            // out_p = S_t,p . q: dS_t,p += d_out_p q; dq += d_out_p S_t,p.
                            for ((d, &qx), (dqx, &sx)) in
                                ds_row.iter_mut().zip(q).zip(dq_t.iter_mut().zip(st_row))
                            {
                                *d += d_o[p] * qx;
                                *dqx += d_o[p] * sx;
                            }
                            // The decayed row as the forward had it (the same
                            // products, so the same bits), its prediction
                            // and the update u = beta (v - pred).
                            for (a_x, &sx) in decayed.iter_mut().zip(&s_prev[p * dk..][..dk]) {
                                *a_x = sx * gates.decay;
                            }
                            let resid = v[p] - dot(&decayed, k);
                            let u = gates.beta * resid;
                            // S_t,p = A_p + u k: du = dS . k.
                            let du = dot(ds_row, k);
                            d_beta_t += du * resid;
                            dv_t[p] = gates.beta * du;
                            let d_pred = -gates.beta * du;
                            // dk += dS u + d_pred A_p; dA_p = dS + d_pred k;
                            // dg += A_p . dA_p; dS_{t-1} = decay dA_p.
                            for (((d, &kx), &a_x), dkx) in
                                ds_row.iter_mut().zip(k).zip(&decayed).zip(dk_t.iter_mut())
                            {
                                *dkx += *d * u + d_pred * a_x;
                                let da = *d + d_pred * kx;
                                d_g += a_x * da;
                                *d = gates.decay * da;
                            }
                        }
                        let at = r * l.value_heads + j;
                        d_beta[at] = d_beta_t * gates.beta * (1.0 - gates.beta);
                        // g = -exp(A_log) softplus(raw): dg/draw = -exp(A_log)
                        // softplus'(raw), dg/dA_log = g.
                        d_alpha[at] = d_g * -a * softplus_derivative(gates.raw);
                        d_a_log_head += d_g * gates.g;
                    }
                }
                d_a_log[j] += d_a_log_head;
            }
            // Through the L2 norms: y = x r, dx = r (dy - y (y . dy)); the
            // queries' gradient also through the scale.
            for t in 0..seq {
                let r = b * seq + t;
                let row = &inputs.qkv[r * l.width..][..l.width];
                let drow = &mut d_qkv[r * l.width..][..l.width];
                for (x, rstd, dy, s, at) in [
                    (
                        &row[l.q(i)..][..dk],
                        norm.rq[t],
                        &dq[t * dk..][..dk],
                        scale,
                        l.q(i),
                    ),
                    (
                        &row[l.k(i)..][..dk],
                        norm.rk[t],
                        &dk_norm[t * dk..][..dk],
                        1.0,
                        l.k(i),
                    ),
                ] {
                    let mut y_dy = 0.0f32;
                    for (&xv, &g) in x.iter().zip(dy) {
                        y_dy += xv * rstd * (g * s);
                    }
                    for ((d, &xv), &g) in drow[at..][..dk].iter_mut().zip(x).zip(dy) {
                        *d = rstd * (g * s - xv * rstd * y_dy);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    fn data(n: usize, seed: f32, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|i| amp * (i as f32 * 0.71 + seed).sin())
            .collect()
    }

    struct Case {
        dims: DeltaDims,
        qkv: Vec<f32>,
        beta: Vec<f32>,
        alpha: Vec<f32>,
        dt_bias: Vec<f32>,
        a_log: Vec<f32>,
    }

    fn case(chunk: usize) -> Case {
        let dims = DeltaDims {
            tokens: Tokens::new(2, 5),
            key_heads: 2,
            value_heads: 4,
            key_dim: 3,
            value_dim: 2,
            chunk,
        };
        let rows = 10;
        Case {
            dims,
            qkv: data(rows * dims.qkv_width(), 0.3, 1.5),
            beta: data(rows * 4, 1.7, 2.0),
            alpha: data(rows * 4, 0.4, 1.5),
            dt_bias: data(4, 0.5, 0.5),
            a_log: data(4, 2.2, 0.8),
        }
    }

    fn inputs(c: &Case) -> DeltaInputs<&[f32]> {
        DeltaInputs {
            qkv: &c.qkv,
            beta: &c.beta,
            alpha: &c.alpha,
            dt_bias: &c.dt_bias,
            a_log: &c.a_log,
        }
    }

    /// The recurrence of layers.md in f64, written as matrices:
    /// `S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`,
    /// `out_t = S_t q_t`, one (sequence, value head) at a time.
    fn reference(c: &Case) -> Vec<f64> {
        let d = c.dims;
        let l = Layout::new(d);
        let seq = d.tokens.seq;
        let (dk, dv) = (l.dk, l.dv);
        let mut out = vec![0.0; d.tokens.batch * seq * l.out_width];
        let normed = |x: &[f32], scale: f64| -> Vec<f64> {
            let n = (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() + 1e-6).sqrt();
            x.iter().map(|&v| v as f64 / n * scale).collect()
        };
        for b in 0..d.tokens.batch {
            for j in 0..l.value_heads {
                let i = j / l.per_key;
                let mut s = vec![0.0f64; dv * dk];
                for t in 0..seq {
                    let r = b * seq + t;
                    let row = &c.qkv[r * l.width..][..l.width];
                    let q = normed(&row[l.q(i)..][..dk], 1.0 / (dk as f64).sqrt());
                    let k = normed(&row[l.k(i)..][..dk], 1.0);
                    let v = &row[l.v(j)..][..dv];
                    let beta = 1.0 / (1.0 + (-(c.beta[r * l.value_heads + j] as f64)).exp());
                    let raw = (c.alpha[r * l.value_heads + j] + c.dt_bias[j]) as f64;
                    let g = -(c.a_log[j] as f64).exp() * raw.exp().ln_1p();
                    // S (I - beta k k^T): row p minus beta (S_p . k) k.
                    let mut next = vec![0.0f64; dv * dk];
                    for p in 0..dv {
                        let sk: f64 = (0..dk).map(|x| s[p * dk + x] * k[x]).sum();
                        for x in 0..dk {
                            next[p * dk + x] = g.exp() * (s[p * dk + x] - beta * sk * k[x])
                                + beta * v[p] as f64 * k[x];
                        }
                    }
                    s = next;
                    for p in 0..dv {
                        out[r * l.out_width + j * dv + p] =
                            (0..dk).map(|x| s[p * dk + x] * q[x]).sum();
                    }
                }
            }
        }
        out
    }

    fn run(c: &Case) -> (Vec<f32>, Vec<f32>) {
        let rows = c.dims.tokens.batch * c.dims.tokens.seq;
        let mut out = vec![f32::NAN; rows * c.dims.out_width()];
        let mut states = vec![f32::NAN; c.dims.states_len()];
        gated_delta_forward(inputs(c), &mut out, &mut states, c.dims);
        (out, states)
    }

    /// The backward's gradients (qkv, beta, alpha, A_log) of `c` given
    /// `d_out`, with the forward's chunk states.
    fn gradients(c: &Case, states: &[f32], d_out: &[f32]) -> [Vec<f32>; 4] {
        let mut out = [
            vec![f32::NAN; c.qkv.len()],
            vec![f32::NAN; c.beta.len()],
            vec![f32::NAN; c.alpha.len()],
            vec![0.0; c.dims.value_heads],
        ];
        let [gq, gb, ga, gl] = &mut out;
        let grads = DeltaGrads {
            qkv: &mut gq[..],
            beta: &mut gb[..],
            alpha: &mut ga[..],
            a_log: &mut gl[..],
        };
        gated_delta_backward(inputs(c), states, d_out, grads, c.dims);
        out
    }

    #[test]
    fn forward_matches_the_matrix_recurrence() {
        let c = case(2);
        let (out, _) = run(&c);
        let want = reference(&c);
        assert!(want.iter().any(|w| w.abs() > 0.1), "a live output");
        for (a, b) in out.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    /// Queries and keys whose squared norms are near the epsilon: the
    /// normalisation divides by `sqrt(|x|^2 + 1e-6)`, flash-linear-attention's
    /// `l2norm` (another epsilon moves these outputs by a third).
    #[test]
    fn the_l2_norm_takes_its_epsilon_as_fla_does() {
        let mut c = case(2);
        for v in c.qkv.iter_mut() {
            *v *= 1e-3;
        }
        let (out, _) = run(&c);
        let want = reference(&c);
        let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
        assert!(scale > 0.0);
        for (a, b) in out.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-4 * scale, "{a} vs {b}");
        }
    }

    #[test]
    fn backward_matches_finite_differences_and_is_chunk_independent() {
        let d_out = data(10 * 8, 4.4, 1.0);
        let mut results = Vec::new();
        for chunk in [1, 2, 3, 5, 8] {
            let c = case(chunk);
            let (out, states) = run(&c);
            results.push((out, gradients(&c, &states, &d_out)));
        }
        for r in &results[1..] {
            assert!(r == &results[0], "the chunk length changed the bits");
        }
        let [gq, gb, ga, gl] = &results[0].1;
        let loss = |c: &Case| -> f64 {
            reference(c)
                .iter()
                .zip(&d_out)
                .map(|(y, d)| y * *d as f64)
                .sum()
        };
        let h = 1e-3f32;
        let fd = |field: fn(&mut Case) -> &mut Vec<f32>, i: usize| -> f64 {
            let mut plus = case(3);
            field(&mut plus)[i] += h;
            let mut minus = case(3);
            field(&mut minus)[i] -= h;
            (loss(&plus) - loss(&minus)) / (2.0 * h as f64)
        };
        let close = |got: f32, want: f64, what: &str| {
            assert!(
                (got as f64 - want).abs() < 2e-3 * (1.0 + want.abs()),
                "{what}: {got} vs {want}"
            );
        };
        for (i, &g) in gq.iter().enumerate() {
            close(g, fd(|c| &mut c.qkv, i), &format!("qkv[{i}]"));
        }
        for (i, (&g_b, &g_a)) in gb.iter().zip(ga).enumerate() {
            close(g_b, fd(|c| &mut c.beta, i), &format!("beta[{i}]"));
            close(g_a, fd(|c| &mut c.alpha, i), &format!("alpha[{i}]"));
        }
        for (i, &g) in gl.iter().enumerate() {
            close(g, fd(|c| &mut c.a_log, i), &format!("a_log[{i}]"));
        }
        // dt_bias enters as alpha does: its gradient is alpha's column sum.
        for j in 0..4 {
            let sum: f64 = ga.iter().skip(j).step_by(4).map(|&g| g as f64).sum();
            close(
                sum as f32,
                fd(|c| &mut c.dt_bias, j),
                &format!("dt_bias[{j}]"),
            );
        }
    }

    #[test]
    fn d_a_log_accumulates() {
        let c = case(2);
        let (_, states) = run(&c);
        let d_out = data(80, 1.1, 1.0);
        let once = gradients(&c, &states, &d_out)[3].clone();
        let mut grads = [
            vec![0.0; c.qkv.len()],
            vec![0.0; c.beta.len()],
            vec![0.0; c.alpha.len()],
            vec![1.0; 4],
        ];
        let [gq, gb, ga, gl] = &mut grads;
        let g = DeltaGrads {
            qkv: &mut gq[..],
            beta: &mut gb[..],
            alpha: &mut ga[..],
            a_log: &mut gl[..],
        };
        gated_delta_backward(inputs(&c), &states, &d_out, g, c.dims);
        for (a, b) in gl.iter().zip(&once) {
            assert!((a - (1.0 + b)).abs() < 1e-6, "{a} vs 1 + {b}");
        }
    }
}

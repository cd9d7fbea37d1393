//! The gated delta rule of `G` layers, forward and backward, over several
//! sequences, key heads shared by one to three value heads, and chunk
//! lengths that do and do not divide the sequence; against an f64
//! recurrence written here from the method's documentation.

use super::Suite;
use super::case::{Bufs, Expected, KernelCase, Values};
use super::dense::U;
use super::reference as r;
use crate::backend::{Backend, DeltaDims, DeltaGrads, DeltaInputs, Slice, Tokens};

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    gated_delta(s);
}

/// The f64 inputs of the reference.
struct DeltaValues<'a> {
    qkv: &'a [f64],
    beta: &'a [f64],
    alpha: &'a [f64],
    dt_bias: &'a [f64],
    a_log: &'a [f64],
}

fn values<'a>(x: &'a Values) -> DeltaValues<'a> {
    DeltaValues {
        qkv: &x["qkv"],
        beta: &x["beta"],
        alpha: &x["alpha"],
        dt_bias: &x["dt_bias"],
        a_log: &x["a_log"],
    }
}

/// `x / sqrt(sum x^2 + 1e-6)`, times `scale`.
fn l2_normalised(x: &[f64], scale: f64) -> Vec<f64> {
    let norm = (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
    x.iter().map(|v| v / norm * scale).collect()
}

/// `(out, chunk-start states)` of the gated delta rule, step by step from
/// the recurrence `S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t
/// v_t k_t^T`, `out_t = S_t q_t`.
fn forward(v: &DeltaValues<'_>, d: DeltaDims) -> (Vec<f64>, Vec<f64>) {
    let (hk, hv, dk, dv, seq) = (
        d.key_heads,
        d.value_heads,
        d.key_dim,
        d.value_dim,
        d.tokens.seq,
    );
    let (width, out_width) = (d.qkv_width(), d.out_width());
    let chunks = seq.div_ceil(d.chunk);
    let size = dv * dk;
    let scale = 1.0 / (dk as f64).sqrt();
    let mut out = vec![0.0; d.tokens.batch * seq * out_width];
    let mut states = vec![0.0; d.states_len()];
    for b in 0..d.tokens.batch {
        for j in 0..hv {
            let i = j / (hv / hk);
            let mut s = vec![0.0f64; size];
            for t in 0..seq {
                if t % d.chunk == 0 {
                    let at = ((b * chunks + t / d.chunk) * hv + j) * size;
                    states[at..at + size].copy_from_slice(&s);
                }
                let r = b * seq + t;
                let row = &v.qkv[r * width..(r + 1) * width];
                let q = l2_normalised(&row[i * dk..(i + 1) * dk], scale);
                let k = l2_normalised(&row[(hk + i) * dk..(hk + i + 1) * dk], 1.0);
                let val = &row[2 * hk * dk + j * dv..][..dv];
                let beta = 1.0 / (1.0 + (-v.beta[r * hv + j]).exp());
                let raw = v.alpha[r * hv + j] + v.dt_bias[j];
                let g = -v.a_log[j].exp() * raw.exp().ln_1p();
                let mut next = vec![0.0f64; size];
                for p in 0..dv {
                    let sk: f64 = (0..dk).map(|x| s[p * dk + x] * k[x]).sum();
                    for x in 0..dk {
                        next[p * dk + x] =
                            g.exp() * (s[p * dk + x] - beta * sk * k[x]) + beta * val[p] * k[x];
                    }
                }
                s = next;
                for p in 0..dv {
                    out[r * out_width + j * dv + p] = (0..dk).map(|x| s[p * dk + x] * q[x]).sum();
                }
            }
        }
    }
    (out, states)
}

/// The gradient of `sum d_out . out` with respect to `qkv | beta | alpha |
/// a_log`, by finite differences of the f64 forward (the trait defines the
/// backward only as the gradient of its forward).
fn gradient(x: &Values, dims: DeltaDims) -> Vec<f64> {
    let (nq, nb) = (x["qkv"].len(), x["beta"].len());
    let mut at = Vec::new();
    for name in ["qkv", "beta", "alpha", "a_log"] {
        at.extend_from_slice(&x[name]);
    }
    let d_out = &x["d_out"];
    r::gradient(&at, |v| {
        let values = DeltaValues {
            qkv: &v[..nq],
            beta: &v[nq..nq + nb],
            alpha: &v[nq + nb..nq + 2 * nb],
            dt_bias: &x["dt_bias"],
            a_log: &v[nq + 2 * nb..],
        };
        let (out, _) = forward(&values, dims);
        out.iter().zip(d_out).map(|(a, b)| a * b).sum()
    })
}

fn inputs<'b, B: Backend>(b: &'b Bufs<B>) -> crate::Result<DeltaInputs<Slice<'b, B>>> {
    Ok(DeltaInputs {
        qkv: b.view("qkv")?,
        beta: b.view("beta")?,
        alpha: b.view("alpha")?,
        dt_bias: b.view("dt_bias")?,
        a_log: b.view("a_log")?,
    })
}

fn gated_delta<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, key heads, value heads, key dim, value dim, chunk
    let shapes = [
        (2, 7, 2, 4, 3, 2, 3),
        (1, 5, 1, 1, 2, 3, 8),
        (2, 6, 1, 3, 4, 2, 2),
        (1, 4, 2, 2, 2, 1, 1),
    ];
    for (i, (batch, seq, hk, hv, dk, dv, chunk)) in shapes.into_iter().enumerate() {
        let dims = DeltaDims {
            tokens: Tokens::new(batch, seq),
            key_heads: hk,
            value_heads: hv,
            key_dim: dk,
            value_dim: dv,
            chunk,
        };
        let rows = batch * seq;
        let name =
            format!("{batch} x {seq} tokens, Hk={hk} Hv={hv} dk={dk} dv={dv}, chunk {chunk}");
        let qkv = s.rng.values(rows * dims.qkv_width(), -1.5, 1.5);
        // sigmoid(beta) spans ~0.05..0.95; softplus(alpha + dt_bias) ~0.05..1.7
        // and exp(A_log) ~0.4..2.7: per-step decays from ~0.01 to ~0.98.
        let beta = s.rng.values(rows * hv, -3.0, 3.0);
        let alpha = s.rng.values(rows * hv, -2.0, 1.0);
        let dt_bias = s.rng.values(hv, -1.0, 0.5);
        let a_log = s.rng.values(hv, -1.0, 1.0);
        let refusals = i == 0;
        let out_len = rows * dims.out_width();
        // Errors grow along the recurrence (seq steps) and with the dot
        // products of a step (dk and dv long).
        let steps = (seq as f64).max(1.0) * (dk + dv) as f64;

        let fwd = KernelCase::new("gated_delta_forward", name.clone())
            .input("qkv", qkv.clone())
            .input("beta", beta.clone())
            .input("alpha", alpha.clone())
            .input("dt_bias", dt_bias.clone())
            .input("a_log", a_log.clone())
            .output("out", out_len)
            .output_f32("states", dims.states_len())
            .tolerance(64.0 * U * steps, 64.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        if refusals {
            for (what, bad) in [
                (
                    "value heads not a multiple of the key heads",
                    DeltaDims {
                        value_heads: 3,
                        ..dims
                    },
                ),
                ("chunk length 0", DeltaDims { chunk: 0, ..dims }),
                ("key dim 0", DeltaDims { key_dim: 0, ..dims }),
            ] {
                s.check_refusal(&fwd, what, &[], |dev, b| {
                    dev.gated_delta_forward(
                        inputs(b)?,
                        b.view_mut("out")?,
                        b.view_mut("states")?,
                        bad,
                    )?;
                    Ok(vec![])
                });
            }
        }
        s.check_kernel(
            fwd,
            |x| {
                let (out, states) = forward(&values(x), dims);
                vec![Expected::new("out", out), Expected::new("states", states)]
            },
            |dev, b| {
                dev.gated_delta_forward(
                    inputs(b)?,
                    b.view_mut("out")?,
                    b.view_mut("states")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let bwd = KernelCase::new("gated_delta_backward", name)
            .input("qkv", qkv)
            .input("beta", beta)
            .input("alpha", alpha)
            .input("dt_bias", dt_bias)
            .input("a_log", a_log)
            .input("d_out", s.rng.values(out_len, -2.0, 2.0))
            .input_f32_from("states", move |x| forward(&values(x), dims).1)
            .output("d_qkv", rows * dims.qkv_width())
            .output("d_beta", rows * hv)
            .output("d_alpha", rows * hv)
            .inout("d_a_log", s.rng.values(hv, -2.0, 2.0))
            .tolerance(256.0 * U * steps, 64.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let g = gradient(x, dims);
                let (nq, nb) = (x["qkv"].len(), x["beta"].len());
                let d_a_log = x["d_a_log"]
                    .iter()
                    .zip(&g[nq + 2 * nb..])
                    .map(|(a, b)| a + b)
                    .collect();
                vec![
                    Expected::new("d_qkv", g[..nq].to_vec()),
                    Expected::new("d_beta", g[nq..nq + nb].to_vec()),
                    Expected::new("d_alpha", g[nq + nb..nq + 2 * nb].to_vec()),
                    Expected::new("d_a_log", d_a_log),
                ]
            },
            |dev, b| {
                dev.gated_delta_backward(
                    inputs(b)?,
                    b.view("states")?,
                    b.view("d_out")?,
                    DeltaGrads {
                        qkv: b.view_mut("d_qkv")?,
                        beta: b.view_mut("d_beta")?,
                        alpha: b.view_mut("d_alpha")?,
                        a_log: b.view_mut("d_a_log")?,
                    },
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

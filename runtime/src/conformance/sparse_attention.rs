//! DeepSeek sparse attention: the indexer's scores, top-k, loss and
//! backward, sparse attention forward and backward, and the LayerNorm
//! with bias; against f64 references written here from the methods'
//! documentation (the backwards by finite differences of the forwards,
//! except the indexer's, written out: its ReLU has a kink).

use super::Suite;
use super::case::{Bufs, Expected, KernelCase, Values};
use super::dense::U;
use super::reference as r;
use crate::backend::sparse_attention::NO_KEY;
use crate::backend::{
    Backend, IndexerDims, IndexerInputs, IndexerLossDims, LayerNormDims, Slice, SparseMqaDims,
    Tokens,
};

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    indexer(s);
    sparse_mqa(s);
    layer_norm(s);
}

fn indexer_inputs<'b, B: Backend>(b: &'b Bufs<B>) -> crate::Result<IndexerInputs<Slice<'b, B>>> {
    Ok(IndexerInputs {
        q: b.view("q")?,
        k: b.view("k")?,
        weights: b.view("weights")?,
    })
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `[rows, seq]` scores, `-inf` after the query.
fn scores(q: &[f64], k: &[f64], w: &[f64], d: IndexerDims) -> Vec<f64> {
    let (seq, ni, di) = (d.tokens.seq, d.heads, d.head_dim);
    let mut out = vec![f64::NEG_INFINITY; d.tokens.batch * seq * seq];
    for b in 0..d.tokens.batch {
        for t in 0..seq {
            let r = b * seq + t;
            for u in 0..=t {
                let key = &k[(b * seq + u) * di..][..di];
                out[r * seq + u] = (0..ni)
                    .map(|h| {
                        let logit = dot(&q[(r * ni + h) * di..][..di], key);
                        d.weight_scale as f64 * w[r * ni + h] * logit.max(0.0)
                    })
                    .sum();
            }
        }
    }
    out
}

/// The indexer's backward, `(dq, dk, d_weights)`, analytically in f64:
/// with `g = scale * d_scores[r, u]` and the ReLU open where `q . k > 0`,
/// `dq[r, h] += g ws w[r, h] k[u]`, `dk[u] += g ws w[r, h] q[r, h]` and
/// `dw[r, h] += g ws relu(q . k)`. Not by finite differences: a step across
/// the ReLU's kink (a logit within the step of zero) would make the
/// reference, not the kernel, wrong.
fn indexer_gradient(
    q: &[f64],
    k: &[f64],
    w: &[f64],
    d_scores: &[f64],
    d: IndexerDims,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (seq, ni, di) = (d.tokens.seq, d.heads, d.head_dim);
    let ws = d.weight_scale as f64;
    let (mut dq, mut dk, mut dw) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; w.len()]);
    for b in 0..d.tokens.batch {
        for t in 0..seq {
            let r = b * seq + t;
            for u in 0..=t {
                let g = scale * d_scores[r * seq + u];
                let key = (b * seq + u) * di;
                for h in 0..ni {
                    let qh = (r * ni + h) * di;
                    let logit = dot(&q[qh..qh + di], &k[key..key + di]);
                    if logit <= 0.0 {
                        continue;
                    }
                    let c = g * ws * w[r * ni + h];
                    for x in 0..di {
                        dq[qh + x] += c * k[key + x];
                        dk[key + x] += c * q[qh + x];
                    }
                    dw[r * ni + h] += g * ws * logit;
                }
            }
        }
    }
    (dq, dk, dw)
}

/// The selected keys of every row: ascending, padded with `NO_KEY`.
fn topk(scores: &[f64], batch: usize, seq: usize, topk: usize) -> Vec<u32> {
    let mut out = vec![NO_KEY; batch * seq * topk];
    for r in 0..batch * seq {
        let t = r % seq;
        let row = &scores[r * seq..(r + 1) * seq];
        let mut order: Vec<usize> = (0..=t).collect();
        order.sort_by(|&x, &y| row[y].total_cmp(&row[x]).then(x.cmp(&y)));
        order.truncate(topk);
        order.sort_unstable();
        for (i, u) in order.into_iter().enumerate() {
            out[r * topk + i] = u as u32;
        }
    }
    out
}

/// `(loss, d_scores)` of the indexer loss.
fn indexer_loss(x: &Values, d: IndexerLossDims) -> (Vec<f64>, Vec<f64>) {
    let (seq, heads, dq, tk) = (d.tokens.seq, d.heads, d.qk_dim, d.topk);
    let rows = d.tokens.batch * seq;
    let (sc, q, k, ix) = (&x["scores"], &x["q"], &x["k"], &x["indices"]);
    let factor = d.coeff as f64 / rows as f64;
    let mut loss = vec![0.0; rows];
    let mut grad = vec![0.0; rows * seq];
    for r in 0..rows {
        let (b, t) = (r / seq, r % seq);
        let keys: Vec<usize> = if d.sparse {
            ix[r * tk..(r + 1) * tk]
                .iter()
                .map(|&u| u as u32)
                .filter(|&u| u != NO_KEY && (u as usize) <= t)
                .map(|u| u as usize)
                .collect()
        } else {
            (0..=t).collect()
        };
        let mut target = vec![0.0; keys.len()];
        for h in 0..heads {
            let qh = &q[(r * heads + h) * dq..][..dq];
            let logits: Vec<f64> = keys
                .iter()
                .map(|&u| d.scale as f64 * dot(qh, &k[(b * seq + u) * dq..][..dq]))
                .collect();
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            for (tg, l) in target.iter_mut().zip(&logits) {
                *tg += (l - max).exp() / sum;
            }
        }
        let total = target.iter().sum::<f64>().max(1e-10);
        let row: Vec<f64> = keys.iter().map(|&u| sc[r * seq + u]).collect();
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let log_sum = row.iter().map(|s| (s - max).exp()).sum::<f64>().ln();
        let mut kl = 0.0;
        for (i, &u) in keys.iter().enumerate() {
            let p_t = target[i] / total;
            let log_p = row[i] - max - log_sum;
            kl += p_t * (p_t.max(1e-10).ln() - log_p);
            grad[r * seq + u] = factor * (log_p.exp() - p_t);
        }
        loss[r] = factor * kl;
    }
    (loss, grad)
}

fn indexer<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, ni, di, topk
    let shapes = [(2, 5, 2, 3, 2), (1, 4, 1, 4, 8), (1, 6, 3, 2, 3)];
    for (i, (batch, seq, ni, di, tk)) in shapes.into_iter().enumerate() {
        let dims = IndexerDims {
            tokens: Tokens::new(batch, seq),
            heads: ni,
            head_dim: di,
            topk: tk,
            weight_scale: 0.7,
        };
        let rows = batch * seq;
        let name = format!("{batch} x {seq} tokens, {ni} heads of {di}, top {tk}");
        let q = s.rng.values(rows * ni * di, -1.0, 1.0);
        let k = s.rng.values(rows * di, -1.0, 1.0);
        let w = s.rng.values(rows * ni, -1.0, 1.0);
        let refusals = i == 0;
        let fwd = KernelCase::new("indexer_scores", name.clone())
            .input("q", q.clone())
            .input("k", k.clone())
            .input("weights", w.clone())
            .output_f32("scores", rows * seq)
            .tolerance(16.0 * U * (ni * di) as f64, 16.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        s.check_kernel(
            fwd,
            |x| {
                vec![Expected::new(
                    "scores",
                    scores(&x["q"], &x["k"], &x["weights"], dims),
                )]
            },
            |dev, b| {
                dev.indexer_scores(indexer_inputs(b)?, b.view_mut("scores")?, dims)?;
                Ok(vec![])
            },
        );

        // Distinct scores, and a row of ties (ties go to the lower key).
        let mut sc = s.rng.values(rows * seq, -2.0, 2.0);
        for u in 0..seq {
            sc[(seq - 1) * seq + u] = 0.5;
        }
        let sel = KernelCase::new("indexer_topk", name.clone())
            .input_f32("scores", sc.clone())
            .output_u32("indices", rows * tk);
        let sel = if refusals { sel.with_refusals() } else { sel };
        let want = topk(&sc, batch, seq, tk);
        s.check_kernel(
            sel,
            move |_| {
                vec![Expected::new("indices", want.iter().map(|&v| v as f64).collect()).exact()]
            },
            |dev, b| {
                dev.indexer_topk(b.view("scores")?, b.view_mut("indices")?, dims)?;
                Ok(vec![])
            },
        );

        // The loss, dense and sparse, against a main attention of 2 heads of 3
        // sharing one key row a token.
        let (heads, dq) = (2, 3);
        let main_q = s.rng.values(rows * heads * dq, -1.5, 1.5);
        let main_k = s.rng.values(rows * dq, -1.5, 1.5);
        let picked = topk(&sc, batch, seq, tk);
        for sparse in [false, true] {
            let ld = IndexerLossDims {
                tokens: dims.tokens,
                topk: tk,
                heads,
                qk_dim: dq,
                scale: 0.6,
                coeff: 0.3,
                sparse,
            };
            let lc = KernelCase::new("indexer_loss", format!("{name}, sparse {sparse}"))
                .input_f32("scores", sc.clone())
                .input("q", main_q.clone())
                .input("k", main_k.clone())
                .input_u32("indices", &picked)
                .output_f32("loss", rows)
                .output_f32("d_scores", rows * seq)
                .tolerance(64.0 * U * (seq * heads * dq) as f64, 64.0 * U);
            let lc = if refusals && !sparse {
                lc.with_refusals()
            } else {
                lc
            };
            s.check_kernel(
                lc,
                |x| {
                    let (loss, grad) = indexer_loss(x, ld);
                    vec![Expected::new("loss", loss), Expected::new("d_scores", grad)]
                },
                |dev, b| {
                    dev.indexer_loss(
                        b.view("scores")?,
                        b.view("q")?,
                        b.view("k")?,
                        b.view("indices")?,
                        b.view_mut("loss")?,
                        b.view_mut("d_scores")?,
                        ld,
                    )?;
                    Ok(vec![])
                },
            );
        }

        let d_scores: Vec<f64> = scores(&q, &k, &w, dims)
            .iter()
            .map(|v| {
                if v.is_finite() {
                    s.rng.uniform(-1.0, 1.0)
                } else {
                    0.0
                }
            })
            .collect();
        let bwd = KernelCase::new("indexer_backward", name)
            .input("q", q)
            .input("k", k)
            .input("weights", w)
            .input_f32("d_scores", d_scores)
            .output("dq", rows * ni * di)
            .output("dk", rows * di)
            .output("d_weights", rows * ni)
            .tolerance(256.0 * U * (seq * ni * di) as f64, 64.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        let scale = 1.5;
        s.check_kernel(
            bwd,
            |x| {
                let (dq, dk, dw) =
                    indexer_gradient(&x["q"], &x["k"], &x["weights"], &x["d_scores"], dims, scale);
                vec![
                    Expected::new("dq", dq),
                    Expected::new("dk", dk),
                    Expected::new("d_weights", dw),
                ]
            },
            |dev, b| {
                dev.indexer_backward(
                    indexer_inputs(b)?,
                    b.view("d_scores")?,
                    IndexerInputs {
                        q: b.view_mut("dq")?,
                        k: b.view_mut("dk")?,
                        weights: b.view_mut("d_weights")?,
                    },
                    dims,
                    scale as f32,
                )?;
                Ok(vec![])
            },
        );
    }
}

/// A query row's keys: its selected positions that are not `NO_KEY` and
/// not after the query.
fn row_keys(ix: &[f64], r: usize, seq: usize, topk: usize) -> Vec<usize> {
    ix[r * topk..(r + 1) * topk]
        .iter()
        .map(|&u| u as u32)
        .filter(|&u| u != NO_KEY && (u as usize) < seq && (u as usize) <= r % seq)
        .map(|u| u as usize)
        .collect()
}

/// Sparse MQA's `(out, lse)` in f64: every head against the shared rows.
fn mqa_forward(q: &[f64], kv: &[f64], ix: &[f64], d: SparseMqaDims) -> (Vec<f64>, Vec<f64>) {
    let (seq, heads, dk, dv, tk) = (d.tokens.seq, d.heads, d.qk_dim, d.v_dim, d.topk);
    let rows = d.tokens.batch * seq;
    let mut out = vec![0.0; rows * heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; rows * heads];
    for r in 0..rows {
        let base = r - r % seq;
        let keys = row_keys(ix, r, seq, tk);
        for j in 0..heads {
            let qh = &q[(r * heads + j) * dk..][..dk];
            let logits: Vec<f64> = keys
                .iter()
                .map(|&u| d.scale as f64 * dot(qh, &kv[(base + u) * dk..][..dk]))
                .collect();
            if keys.is_empty() {
                continue;
            }
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            lse[r * heads + j] = max + sum.ln();
            for (l, &u) in logits.iter().zip(&keys) {
                let p = (l - max).exp() / sum;
                for c in 0..dv {
                    out[(r * heads + j) * dv + c] += p * kv[(base + u) * dk + c];
                }
            }
        }
    }
    (out, lse)
}

/// Sparse MQA's `(dq, dkv)` in f64 from the saved `out` and `lse` as
/// stored (the method's definition).
fn mqa_backward(x: &Values, d: SparseMqaDims) -> (Vec<f64>, Vec<f64>) {
    let (seq, heads, dk, dv, tk) = (d.tokens.seq, d.heads, d.qk_dim, d.v_dim, d.topk);
    let (q, kv, ix) = (&x["q"], &x["kv"], &x["indices"]);
    let (out, lse, dout) = (&x["out"], &x["lse"], &x["dout"]);
    let (mut dq, mut dkv) = (vec![0.0; q.len()], vec![0.0; kv.len()]);
    let scale = d.scale as f64;
    for r in 0..d.tokens.batch * seq {
        let base = r - r % seq;
        for j in 0..heads {
            let at_q = (r * heads + j) * dk;
            let at_o = (r * heads + j) * dv;
            let g = &dout[at_o..at_o + dv];
            let delta = dot(g, &out[at_o..at_o + dv]);
            for u in row_keys(ix, r, seq, tk) {
                let at = (base + u) * dk;
                let p =
                    (scale * dot(&q[at_q..at_q + dk], &kv[at..at + dk]) - lse[r * heads + j]).exp();
                let ds = p * (dot(g, &kv[at..at + dv]) - delta) * scale;
                for c in 0..dk {
                    dq[at_q + c] += ds * kv[at + c];
                    dkv[at + c] += ds * q[at_q + c];
                }
                for c in 0..dv {
                    dkv[at + c] += p * g[c];
                }
            }
        }
    }
    (dq, dkv)
}

fn sparse_mqa<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, heads, qk dim, v dim, topk: a v as wide as the row, one
    // narrower, rows padded with NO_KEY (top-k past the causal keys), and
    // enough channels for the kernels' groups of eight plus a tail.
    let shapes = [
        (2, 5, 2, 3, 2, 2),
        (1, 6, 3, 4, 4, 4),
        (1, 3, 3, 2, 1, 5),
        (2, 9, 4, 19, 16, 3),
    ];
    for (i, (batch, seq, heads, dk, dv, tk)) in shapes.into_iter().enumerate() {
        let dims = SparseMqaDims {
            tokens: Tokens::new(batch, seq),
            heads,
            qk_dim: dk,
            v_dim: dv,
            topk: tk,
            scale: 0.5,
        };
        let rows = batch * seq;
        let name = format!("{batch} x {seq} tokens, {heads} heads, dk={dk} dv={dv}, top {tk}");
        let q = s.rng.values(rows * heads * dk, -1.5, 1.5);
        let kv = s.rng.values(rows * dk, -1.5, 1.5);
        let picks = s.rng.values(rows * seq, -1.0, 1.0);
        let indices = topk(&picks, batch, seq, tk);
        let refusals = i == 0;
        let fwd = KernelCase::new("sparse_mqa_forward", name.clone())
            .input("q", q.clone())
            .input("kv", kv.clone())
            .input_u32("indices", &indices)
            .output("out", rows * heads * dv)
            .output_f32("lse", rows * heads)
            .tolerance(64.0 * U * (tk * dk) as f64, 64.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        s.check_kernel(
            fwd,
            |x| {
                let (out, lse) = mqa_forward(&x["q"], &x["kv"], &x["indices"], dims);
                vec![Expected::new("out", out), Expected::new("lse", lse)]
            },
            |dev, b| {
                dev.sparse_mqa_forward(
                    b.view("q")?,
                    b.view("kv")?,
                    b.view("indices")?,
                    b.view_mut("out")?,
                    b.view_mut("lse")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let bwd = KernelCase::new("sparse_mqa_backward", name)
            .input("q", q)
            .input("kv", kv)
            .input_u32("indices", &indices)
            .input_from("out", move |x| {
                mqa_forward(&x["q"], &x["kv"], &x["indices"], dims).0
            })
            .input_f32_from("lse", move |x| {
                mqa_forward(&x["q"], &x["kv"], &x["indices"], dims).1
            })
            .input("dout", s.rng.values(rows * heads * dv, -1.0, 1.0))
            .output("dq", rows * heads * dk)
            .output("dkv", rows * dk)
            .tolerance(256.0 * U * (heads * tk * (dk + dv)) as f64, 64.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let (dq, dkv) = mqa_backward(x, dims);
                vec![Expected::new("dq", dq), Expected::new("dkv", dkv)]
            },
            |dev, b| {
                dev.sparse_mqa_backward(
                    b.view("q")?,
                    b.view("kv")?,
                    b.view("indices")?,
                    b.view("out")?,
                    b.view("lse")?,
                    b.view("dout")?,
                    b.view_mut("dq")?,
                    b.view_mut("dkv")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

/// `(y, stats)` of the LayerNorm.
fn layer_norm_forward(
    x: &[f64],
    w: &[f64],
    bias: &[f64],
    d: LayerNormDims,
) -> (Vec<f64>, Vec<f64>) {
    let n = d.width;
    let mut y = vec![0.0; d.rows * n];
    let mut stats = vec![0.0; d.rows * 2];
    for r in 0..d.rows {
        let xr = &x[r * n..(r + 1) * n];
        let mean = xr.iter().sum::<f64>() / n as f64;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let rstd = 1.0 / (var + d.eps as f64).sqrt();
        for i in 0..n {
            y[r * n + i] = (xr[i] - mean) * rstd * w[i] + bias[i];
        }
        stats[2 * r] = mean;
        stats[2 * r + 1] = rstd;
    }
    (y, stats)
}

fn layer_norm<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (rows, width)) in [(5, 6), (1, 3), (4, 9)].into_iter().enumerate() {
        let dims = LayerNormDims {
            rows,
            width,
            eps: 1e-5,
        };
        let name = format!("{rows} rows of {width}");
        let x = s.rng.values(rows * width, -2.0, 2.0);
        let w = s.rng.values(width, 0.5, 1.5);
        let bias = s.rng.values(width, -0.5, 0.5);
        let refusals = i == 0;
        let tol = 64.0 * U * width as f64;
        let fwd = KernelCase::new("layer_norm_forward", name.clone())
            .input("x", x.clone())
            .input("weight", w.clone())
            .input("bias", bias.clone())
            .output("y", rows * width)
            .output_f32("stats", rows * 2)
            .tolerance(tol, 64.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        s.check_kernel(
            fwd,
            |x| {
                let (y, stats) = layer_norm_forward(&x["x"], &x["weight"], &x["bias"], dims);
                vec![Expected::new("y", y), Expected::new("stats", stats)]
            },
            |dev, b| {
                dev.layer_norm_forward(
                    b.view("x")?,
                    b.view("weight")?,
                    b.view("bias")?,
                    b.view_mut("y")?,
                    b.view_mut("stats")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
        let stats_of = move |x: &Values| {
            let ones = vec![1.0; width];
            let zeros = vec![0.0; width];
            layer_norm_forward(&x["x"], &ones, &zeros, dims).1
        };
        let dy = s.rng.values(rows * width, -1.0, 1.0);
        let bwd = KernelCase::new("layer_norm_backward", name.clone())
            .input("x", x.clone())
            .input("weight", w)
            .input_f32_from("stats", stats_of)
            .input("dy", dy.clone())
            .output("dx", rows * width)
            .tolerance(4.0 * tol, 64.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let zeros = vec![0.0; width];
                let g = r::gradient(&x["x"], |p| {
                    layer_norm_forward(p, &x["weight"], &zeros, dims)
                        .0
                        .iter()
                        .zip(&x["dy"])
                        .map(|(a, b)| a * b)
                        .sum()
                });
                vec![Expected::new("dx", g)]
            },
            |dev, b| {
                dev.layer_norm_backward(
                    b.view("x")?,
                    b.view("weight")?,
                    b.view("stats")?,
                    b.view("dy")?,
                    b.view_mut("dx")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
        let wg = KernelCase::new("layer_norm_weight_grad", name)
            .input("x", x)
            .input_f32_from("stats", stats_of)
            .input("dy", dy)
            .inout("d_weight", s.rng.values(width, -1.0, 1.0))
            .inout("d_bias", s.rng.values(width, -1.0, 1.0))
            .tolerance(4.0 * tol * rows as f64, 64.0 * U);
        let wg = if refusals { wg.with_refusals() } else { wg };
        s.check_kernel(
            wg,
            |x| {
                let stats = stats_of(x);
                let mut dw = x["d_weight"].to_vec();
                let mut db = x["d_bias"].to_vec();
                for r in 0..rows {
                    for c in 0..width {
                        let g = x["dy"][r * width + c];
                        dw[c] += g * (x["x"][r * width + c] - stats[2 * r]) * stats[2 * r + 1];
                        db[c] += g;
                    }
                }
                vec![Expected::new("d_weight", dw), Expected::new("d_bias", db)]
            },
            |dev, b| {
                dev.layer_norm_weight_grad(
                    b.view("x")?,
                    b.view("stats")?,
                    b.view("dy")?,
                    b.view_mut("d_weight")?,
                    b.view_mut("d_bias")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

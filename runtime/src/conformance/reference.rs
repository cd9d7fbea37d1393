//! The plain references: naive f64 loops written from the maths documented
//! on each [`Backend`](crate::Backend) method, sharing nothing with any
//! backend's kernels. Where a method documents its backward only as "the
//! gradient of the forward" (the SSD scan, the routing), the reference is a
//! high-order finite difference of the f64 forward.

use crate::backend::{
    AdamStep, AttentionDims, ConvDims, CopyCols, IGNORE_TARGET, MatmulDims, MlaKvDims, NormDims,
    QkvDims, RotaryDims, RotaryPairing, ScanDims, SgdStep, Unary,
};
use crate::view::DType;
use hybridgen_dsl::config::ScoreFunction;

// ---- storage ---------------------------------------------------------------------

/// `v` as a buffer of `dtype` holds it: rounded once to nearest, ties to
/// even, overflowing to infinity.
pub(crate) fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F64 => v,
        DType::F32 => f64::from(v as f32),
        DType::Bf16 => round_bf16(v),
        DType::U32 => v,
    }
}

/// Round to nearest even at bf16's precision (8 significant bits, f32's
/// exponent range, subnormals below `2^-126`), from f64 directly: one
/// rounding, however many bits `v` has.
pub(crate) fn round_bf16(v: f64) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    let exponent = ((v.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    // Below bf16's smallest normal the spacing stays that of 2^-126.
    let exponent = exponent.max(-126);
    let ulp = f64::from_bits(((exponent - 7 + 1023) as u64) << 52);
    let r = (v / ulp).round_ties_even() * ulp;
    let max = (2.0 - 1.0 / 128.0) * 2f64.powi(127);
    if r.abs() > max {
        f64::INFINITY.copysign(v)
    } else {
        r
    }
}

// ---- dense ---------------------------------------------------------------------

pub(crate) fn matmul(a: &[f64], b: &[f64], c0: &[f64], d: MatmulDims) -> Vec<f64> {
    let mut c = vec![0.0; d.m * d.n];
    for i in 0..d.m {
        for j in 0..d.n {
            let mut sum = if d.accumulate { c0[i * d.n + j] } else { 0.0 };
            for p in 0..d.k {
                let av = if d.a_trans {
                    a[p * d.m + i]
                } else {
                    a[i * d.k + p]
                };
                let bv = if d.b_trans {
                    b[j * d.k + p]
                } else {
                    b[p * d.n + j]
                };
                sum += av * bv;
            }
            c[i * d.n + j] = sum;
        }
    }
    c
}

pub(crate) fn copy_cols(src: &[f64], dst0: &[f64], d: CopyCols) -> Vec<f64> {
    let mut dst = dst0.to_vec();
    for r in 0..d.rows {
        for j in 0..d.cols {
            let s = src[r * d.src_stride + d.src_offset + j];
            let t = &mut dst[r * d.dst_stride + d.dst_offset + j];
            *t = if d.accumulate { *t + s } else { s };
        }
    }
    dst
}

pub(crate) fn column_sum(x: &[f64], out0: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = out0.to_vec();
    for r in 0..rows {
        for j in 0..cols {
            out[j] += x[r * cols + j];
        }
    }
    out
}

// ---- normalisation ---------------------------------------------------------------

/// `(y, rstd)`.
pub(crate) fn rmsnorm_forward(x: &[f64], w: &[f64], d: NormDims) -> (Vec<f64>, Vec<f64>) {
    let gs = d.dim / d.groups;
    let mut y = vec![0.0; d.rows * d.dim];
    let mut rstd = vec![0.0; d.rows * d.groups];
    for r in 0..d.rows {
        for g in 0..d.groups {
            let at = r * d.dim + g * gs;
            let ms = (0..gs).map(|i| x[at + i] * x[at + i]).sum::<f64>() / gs as f64;
            let rs = 1.0 / (ms + f64::from(d.eps)).sqrt();
            rstd[r * d.groups + g] = rs;
            for i in 0..gs {
                y[at + i] = x[at + i] * rs * w[g * gs + i];
            }
        }
    }
    (y, rstd)
}

pub(crate) fn rmsnorm_backward_input(
    dy: &[f64],
    x: &[f64],
    w: &[f64],
    rstd: &[f64],
    dx0: &[f64],
    d: NormDims,
) -> Vec<f64> {
    let gs = d.dim / d.groups;
    let mut dx = dx0.to_vec();
    for r in 0..d.rows {
        for g in 0..d.groups {
            let at = r * d.dim + g * gs;
            let rs = rstd[r * d.groups + g];
            let gx = |i: usize| w[g * gs + i] * dy[at + i];
            let mean = (0..gs).map(|i| gx(i) * x[at + i]).sum::<f64>() / gs as f64;
            for i in 0..gs {
                dx[at + i] += rs * gx(i) - x[at + i] * rs * rs * rs * mean;
            }
        }
    }
    dx
}

/// `partials[s, j]`: the sum over slice `s` of the rows of
/// `dy * x * rstd` (`NormDims::weight_slice_rows` rows a slice).
pub(crate) fn rmsnorm_weight_partials(
    dy: &[f64],
    x: &[f64],
    rstd: &[f64],
    d: NormDims,
) -> Vec<f64> {
    let gs = d.dim / d.groups;
    let mut partials = vec![0.0; d.weight_partials_len()];
    for r in 0..d.rows {
        let slice = r / d.weight_slice_rows();
        for j in 0..d.dim {
            let i = r * d.dim + j;
            partials[slice * d.dim + j] += dy[i] * x[i] * rstd[r * d.groups + j / gs];
        }
    }
    partials
}

/// `dw + sum_s partials[s, ..]`.
pub(crate) fn rmsnorm_backward_weight(partials: &[f64], dw0: &[f64], d: NormDims) -> Vec<f64> {
    let mut dw = dw0.to_vec();
    for slice in partials.chunks_exact(d.dim.max(1)) {
        for (dw, p) in dw.iter_mut().zip(slice) {
            *dw += p;
        }
    }
    dw
}

// ---- activations -------------------------------------------------------------------

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// erf to ~1e-13: its Maclaurin series below 3, the continued fraction of
/// erfc above.
pub(crate) fn erf(x: f64) -> f64 {
    let a = x.abs();
    let value = if a < 3.0 {
        // At most 60 terms: the series' terms fall below 1e-17 of the sum
        // by n = 50 for every |x| < 3.
        let (mut term, mut sum) = (a, a);
        for n in 1..=60 {
            let n = f64::from(n);
            term *= -a * a / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(a) = exp(-a^2) / sqrt(pi) / (a + 1/2 / (a + 1 / (a + 3/2 / (a + ...))))
        let mut f = a;
        for n in (1..=200).rev() {
            f = a + (f64::from(n) / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
    };
    value.copysign(x)
}

fn normal_cdf(x: f64) -> f64 {
    0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

pub(crate) fn unary(op: Unary, x: f64) -> f64 {
    match op {
        Unary::Silu => x * sigmoid(x),
        Unary::Gelu => x * normal_cdf(x),
        Unary::SquaredRelu => x.max(0.0) * x.max(0.0),
    }
}

pub(crate) fn unary_derivative(op: Unary, x: f64) -> f64 {
    match op {
        Unary::Silu => sigmoid(x) * (1.0 + x * (1.0 - sigmoid(x))),
        Unary::Gelu => normal_cdf(x) + x * normal_pdf(x),
        Unary::SquaredRelu => 2.0 * x.max(0.0),
    }
}

// ---- conv1d ----------------------------------------------------------------------

/// `x[t - (K-1) + j, c]` within the sequence of row `b * seq + t`, or 0.
fn conv_tap(x: &[f64], d: ConvDims, b: usize, t: usize, j: usize, c: usize) -> f64 {
    let s = t as i64 - (d.kernel as i64 - 1) + j as i64;
    if s < 0 {
        0.0
    } else {
        x[(b * d.tokens.seq + s as usize) * d.channels + c]
    }
}

pub(crate) fn conv1d_forward(x: &[f64], w: &[f64], bias: &[f64], d: ConvDims) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for b in 0..d.tokens.batch {
        for t in 0..d.tokens.seq {
            for c in 0..d.channels {
                let mut acc = bias[c];
                for j in 0..d.kernel {
                    acc += w[c * d.kernel + j] * conv_tap(x, d, b, t, j, c);
                }
                y[(b * d.tokens.seq + t) * d.channels + c] = acc;
            }
        }
    }
    y
}

pub(crate) fn conv1d_backward_input(dy: &[f64], w: &[f64], d: ConvDims) -> Vec<f64> {
    let seq = d.tokens.seq;
    let mut dx = vec![0.0; dy.len()];
    for b in 0..d.tokens.batch {
        for s in 0..seq {
            for c in 0..d.channels {
                let mut acc = 0.0;
                for j in 0..d.kernel {
                    let t = s + d.kernel - 1 - j;
                    if t < seq {
                        acc += w[c * d.kernel + j] * dy[(b * seq + t) * d.channels + c];
                    }
                }
                dx[(b * seq + s) * d.channels + c] = acc;
            }
        }
    }
    dx
}

/// `(dw, dbias)`, accumulated onto `dw0`, `dbias0`.
pub(crate) fn conv1d_backward_weight(
    dy: &[f64],
    x: &[f64],
    dw0: &[f64],
    dbias0: &[f64],
    d: ConvDims,
) -> (Vec<f64>, Vec<f64>) {
    let (mut dw, mut dbias) = (dw0.to_vec(), dbias0.to_vec());
    for b in 0..d.tokens.batch {
        for t in 0..d.tokens.seq {
            for c in 0..d.channels {
                let g = dy[(b * d.tokens.seq + t) * d.channels + c];
                dbias[c] += g;
                for j in 0..d.kernel {
                    dw[c * d.kernel + j] += g * conv_tap(x, d, b, t, j, c);
                }
            }
        }
    }
    (dw, dbias)
}

// ---- SSD scan --------------------------------------------------------------------

fn softplus(x: f64) -> f64 {
    x.exp().ln_1p()
}

/// The scan's inputs, in f64.
pub(crate) struct ScanValues<'a> {
    pub xbc: &'a [f64],
    pub dt: &'a [f64],
    pub dt_bias: &'a [f64],
    pub a_log: &'a [f64],
    pub d: &'a [f64],
}

/// `(y, chunk-start states)` of the selective scan, step by step from the
/// recurrence.
pub(crate) fn ssd_scan_forward(v: &ScanValues<'_>, d: ScanDims) -> (Vec<f64>, Vec<f64>) {
    let (h_n, p_n, n_n, seq) = (d.heads, d.head_dim, d.state, d.tokens.seq);
    let width = d.xbc_width();
    let per_group = h_n / d.groups;
    let chunks = seq.div_ceil(d.chunk);
    let mut y = vec![0.0; d.tokens.batch * seq * h_n * p_n];
    let mut states = vec![0.0; d.states_len()];
    for b in 0..d.tokens.batch {
        for h in 0..h_n {
            let g = h / per_group;
            let a = -v.a_log[h].exp();
            let mut s = vec![0.0; p_n * n_n];
            for t in 0..seq {
                if t % d.chunk == 0 {
                    let at = ((b * chunks + t / d.chunk) * h_n + h) * p_n * n_n;
                    states[at..at + p_n * n_n].copy_from_slice(&s);
                }
                let r = b * seq + t;
                let row = &v.xbc[r * width..(r + 1) * width];
                let x = |p: usize| row[h * p_n + p];
                let bb = |n: usize| row[h_n * p_n + g * n_n + n];
                let cc = |n: usize| row[h_n * p_n + (d.groups + g) * n_n + n];
                let dt = softplus(v.dt[r * h_n + h] + v.dt_bias[h]);
                let decay = (dt * a).exp();
                for p in 0..p_n {
                    for n in 0..n_n {
                        s[p * n_n + n] = decay * s[p * n_n + n] + dt * x(p) * bb(n);
                    }
                }
                for p in 0..p_n {
                    let sc: f64 = (0..n_n).map(|n| s[p * n_n + n] * cc(n)).sum();
                    y[r * h_n * p_n + h * p_n + p] = sc + v.d[h] * x(p);
                }
            }
        }
    }
    (y, states)
}

// ---- attention and rotary ------------------------------------------------------------

/// Scaled scores of query row `t`, head `j` against keys `0..=t`, and their
/// log-sum-exp.
fn attention_scores(
    q: &[f64],
    k: &[f64],
    d: AttentionDims,
    b: usize,
    t: usize,
    j: usize,
) -> (Vec<f64>, f64) {
    let seq = d.tokens.seq;
    let kv = j / (d.heads / d.kv_heads);
    let qr = &q[((b * seq + t) * d.heads + j) * d.qk_dim..][..d.qk_dim];
    let scores: Vec<f64> = (0..=t)
        .map(|u| {
            let kr = &k[((b * seq + u) * d.kv_heads + kv) * d.qk_dim..][..d.qk_dim];
            f64::from(d.scale) * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>()
        })
        .collect();
    let max = scores.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
    let lse = max + scores.iter().map(|s| (s - max).exp()).sum::<f64>().ln();
    (scores, lse)
}

/// `(out, lse)`.
pub(crate) fn attention_forward(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d: AttentionDims,
) -> (Vec<f64>, Vec<f64>) {
    let seq = d.tokens.seq;
    let rows = d.tokens.batch * seq;
    let mut out = vec![0.0; rows * d.heads * d.v_dim];
    let mut lse = vec![0.0; rows * d.heads];
    for b in 0..d.tokens.batch {
        for t in 0..seq {
            for j in 0..d.heads {
                let kv = j / (d.heads / d.kv_heads);
                let (scores, l) = attention_scores(q, k, d, b, t, j);
                lse[(b * seq + t) * d.heads + j] = l;
                let o = &mut out[((b * seq + t) * d.heads + j) * d.v_dim..][..d.v_dim];
                for (u, s) in scores.iter().enumerate() {
                    let p = (s - l).exp();
                    let vr = &v[((b * seq + u) * d.kv_heads + kv) * d.v_dim..][..d.v_dim];
                    for (o, vv) in o.iter_mut().zip(vr) {
                        *o += p * vv;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// `(dq, dk, dv)` from the documented formulas, with `D_t = dout_t . out_t`
/// on the `out` given (as the kernel receives it).
pub(crate) fn attention_backward(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    out: &[f64],
    dout: &[f64],
    d: AttentionDims,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let seq = d.tokens.seq;
    let scale = f64::from(d.scale);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for b in 0..d.tokens.batch {
        for t in 0..seq {
            for j in 0..d.heads {
                let kv = j / (d.heads / d.kv_heads);
                let (scores, l) = attention_scores(q, k, d, b, t, j);
                let o_at = ((b * seq + t) * d.heads + j) * d.v_dim;
                let g = &dout[o_at..][..d.v_dim];
                let delta = dot(g, &out[o_at..][..d.v_dim]);
                let q_at = ((b * seq + t) * d.heads + j) * d.qk_dim;
                for (u, s) in scores.iter().enumerate() {
                    let p = (s - l).exp();
                    let k_at = ((b * seq + u) * d.kv_heads + kv) * d.qk_dim;
                    let v_at = ((b * seq + u) * d.kv_heads + kv) * d.v_dim;
                    let ds = p * (dot(g, &v[v_at..][..d.v_dim]) - delta);
                    for i in 0..d.qk_dim {
                        dq[q_at + i] += scale * ds * k[k_at + i];
                        dk[k_at + i] += scale * ds * q[q_at + i];
                    }
                    for i in 0..d.v_dim {
                        dv[v_at + i] += p * g[i];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Rotates channels `[offset, offset + dim)` of every head; `inverse` for
/// the backward.
pub(crate) fn rotary(x: &[f64], d: RotaryDims, inverse: bool) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = d.dim / 2;
    let rows = d.tokens.batch * d.tokens.seq;
    for r in 0..rows {
        let pos = (r % d.tokens.seq) as f64;
        for h in 0..d.heads {
            let at = (r * d.heads + h) * d.head_stride + d.offset;
            for i in 0..half {
                let theta = pos * f64::from(d.base).powf(-(2.0 * i as f64) / d.dim as f64);
                let (sin, cos) = theta.sin_cos();
                let (ia, ib) = match d.pairing {
                    RotaryPairing::RotateHalf => (i, i + half),
                    RotaryPairing::Interleaved => (2 * i, 2 * i + 1),
                };
                let (a, b) = (x[at + ia], x[at + ib]);
                let (na, nb) = if inverse {
                    (a * cos + b * sin, b * cos - a * sin)
                } else {
                    (a * cos - b * sin, b * cos + a * sin)
                };
                y[at + ia] = na;
                y[at + ib] = nb;
            }
        }
    }
    y
}

// ---- embedding and loss ------------------------------------------------------------

fn softmax(z: &[f64]) -> Vec<f64> {
    let max = z.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
    let e: Vec<f64> = z.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// `(probs, losses)`.
pub(crate) fn cross_entropy_forward(
    logits: &[f64],
    targets: &[u32],
    vocab: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut probs = Vec::with_capacity(logits.len());
    let mut losses = Vec::with_capacity(targets.len());
    for (row, &t) in logits.chunks(vocab).zip(targets) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        losses.push(if t == IGNORE_TARGET {
            0.0
        } else {
            lse - row[t as usize]
        });
        probs.extend(softmax(row));
    }
    (probs, losses)
}

pub(crate) fn cross_entropy_backward(
    probs: &[f64],
    targets: &[u32],
    scale: f64,
    vocab: usize,
) -> Vec<f64> {
    let mut grad = probs.to_vec();
    for (row, &t) in grad.chunks_mut(vocab).zip(targets) {
        if t == IGNORE_TARGET {
            row.fill(0.0);
            continue;
        }
        row[t as usize] -= 1.0;
        for v in row.iter_mut() {
            *v *= scale;
        }
    }
    grad
}

// ---- routing ---------------------------------------------------------------------

pub(crate) fn route_scores(z: &[f64], score: ScoreFunction) -> Vec<f64> {
    match score {
        ScoreFunction::Softmax => softmax(z),
        ScoreFunction::Sigmoid => z.iter().map(|&v| sigmoid(v)).collect(),
    }
}

/// The `k` experts with the largest `scores + bias`, best first, ties to
/// the lower index.
pub(crate) fn top_k(scores: &[f64], bias: Option<&[f64]>, k: usize) -> Vec<usize> {
    let key = |e: usize| scores[e] + bias.map_or(0.0, |b| b[e]);
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // A stable sort keeps the lower index first among equal keys.
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    order.truncate(k);
    order
}

/// The forward of one row with its selection fixed: the weights of the
/// selected experts (normalised, or the raw score with sigmoid and k = 1,
/// then times `topk_scale`), and the row's scores normalised over all
/// experts (the load-balancing loss's `p`).
pub(crate) fn route_row(
    z: &[f64],
    selected: &[usize],
    score: ScoreFunction,
    topk_scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let s = route_scores(z, score);
    let sum: f64 = selected.iter().map(|&e| s[e]).sum();
    let raw = score == ScoreFunction::Sigmoid && selected.len() == 1;
    let weights = selected
        .iter()
        .map(|&e| topk_scale * if raw { s[e] } else { s[e] / sum })
        .collect();
    let total: f64 = s.iter().sum();
    let p = match score {
        ScoreFunction::Softmax => s,
        ScoreFunction::Sigmoid => s.iter().map(|v| v / total).collect(),
    };
    (weights, p)
}

// ---- MoE dispatch ---------------------------------------------------------------------

/// How many (token, k-slot) pairs chose each expert.
pub(crate) fn expert_counts(selected: &[u32], experts: usize) -> Vec<u32> {
    let mut counts = vec![0u32; experts];
    for &e in selected {
        counts[e as usize] += 1;
    }
    counts
}

/// `(positions, sources)` of the dispatch: the pairs `(t, j)` sorted by
/// (expert, token, k-slot), pair number `i` of that order going to send
/// row `i`.
pub(crate) fn sort_by_expert(selected: &[u32], top_k: usize) -> (Vec<u32>, Vec<u32>) {
    let mut pairs: Vec<(u32, usize, usize)> = selected
        .iter()
        .enumerate()
        .map(|(slot, &e)| (e, slot / top_k, slot % top_k))
        .collect();
    pairs.sort();
    let mut positions = vec![0u32; selected.len()];
    let mut sources = vec![0u32; selected.len()];
    for (row, &(_, t, j)) in pairs.iter().enumerate() {
        positions[t * top_k + j] = row as u32;
        sources[row] = t as u32;
    }
    (positions, sources)
}

/// The received rows (numbered in arrival order: source rank, then local
/// expert, then arrival) sorted by (local expert, source rank, arrival).
pub(crate) fn expert_major_order(recv_counts: &[u32], local_experts: usize) -> Vec<u32> {
    let mut rows: Vec<(usize, usize, u32)> = Vec::new();
    let mut next = 0u32;
    for (block, &count) in recv_counts.iter().enumerate() {
        let (rank, expert) = (block / local_experts, block % local_experts);
        for _ in 0..count {
            rows.push((expert, rank, next));
            next += 1;
        }
    }
    rows.sort();
    rows.iter().map(|&(_, _, row)| row).collect()
}

/// The switch load-balancing loss `coeff * E * sum_e f_e P_e` with
/// `f_e = counts[e] / (T k)` and `P_e = prob_sum[e] / T` (0 for `T = 0`).
pub(crate) fn aux_loss(
    counts: &[f64],
    prob_sum: &[f64],
    tokens: usize,
    top_k: usize,
    coeff: f64,
) -> f64 {
    if tokens == 0 {
        return 0.0;
    }
    let (t, experts) = (tokens as f64, counts.len() as f64);
    let sum: f64 = counts
        .iter()
        .zip(prob_sum)
        .map(|(c, p)| (c / (t * top_k as f64)) * (p / t))
        .sum();
    coeff * experts * sum
}

/// `d(scale * aux_loss) / d softmax(logits)[r, e]`, the same for every row.
pub(crate) fn aux_loss_grad(
    counts: &[f64],
    tokens: usize,
    top_k: usize,
    coeff: f64,
    scale: f64,
) -> Vec<f64> {
    if tokens == 0 {
        return vec![0.0; counts.len()];
    }
    // aux = coeff E sum_e f_e (sum_r p_re) / T, so d aux / d p_re = coeff E f_e / T.
    let (t, experts) = (tokens as f64, counts.len() as f64);
    counts
        .iter()
        .map(|c| coeff * experts * (c / (t * top_k as f64)) / t * scale)
        .collect()
}

// ---- head splits ---------------------------------------------------------------------

/// `(q, k, v)` of the fused GQA projection, element by element: group `g`'s
/// block of a row is `[q heads of g | k_g | v_g]`.
pub(crate) fn qkv_split(qkv: &[f64], d: QkvDims) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (c, hpg) = (d.head_dim, d.heads_per_group);
    let block = (hpg + 2) * c;
    let width = d.groups * block;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..d.rows {
        for g in 0..d.groups {
            for h in 0..hpg {
                for i in 0..c {
                    q.push(qkv[r * width + g * block + h * c + i]);
                }
            }
        }
        for g in 0..d.groups {
            for i in 0..c {
                k.push(qkv[r * width + g * block + hpg * c + i]);
            }
        }
        for g in 0..d.groups {
            for i in 0..c {
                v.push(qkv[r * width + g * block + (hpg + 1) * c + i]);
            }
        }
    }
    (q, k, v)
}

/// The fused layout back from `q`, `k`, `v` (the inverse of [`qkv_split`]).
pub(crate) fn qkv_join(q: &[f64], k: &[f64], v: &[f64], d: QkvDims) -> Vec<f64> {
    let (c, hpg) = (d.head_dim, d.heads_per_group);
    let mut fused = Vec::with_capacity(d.rows * d.width());
    for r in 0..d.rows {
        for g in 0..d.groups {
            for h in 0..hpg {
                let head = g * hpg + h;
                fused.extend_from_slice(&q[(r * d.groups * hpg + head) * c..][..c]);
            }
            fused.extend_from_slice(&k[(r * d.groups + g) * c..][..c]);
            fused.extend_from_slice(&v[(r * d.groups + g) * c..][..c]);
        }
    }
    fused
}

/// `(k, v)` of the MLA split: `k_i = [k_nope_i | k_rope]`, `v_i` from the
/// `[k_nope_i | v_i]` blocks of `kv`.
pub(crate) fn mla_kv_split(kv: &[f64], k_rope: &[f64], d: MlaKvDims) -> (Vec<f64>, Vec<f64>) {
    let (dn, dr, dv) = (d.nope_dim, d.rope_dim, d.v_dim);
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for r in 0..d.rows {
        for i in 0..d.heads {
            let head = &kv[(r * d.heads + i) * (dn + dv)..][..dn + dv];
            k.extend_from_slice(&head[..dn]);
            k.extend_from_slice(&k_rope[r * dr..][..dr]);
            v.extend_from_slice(&head[dn..]);
        }
    }
    (k, v)
}

/// `(d_kv, d_k_rope)`: the nope parts of `dk` and `dv` in the fused layout,
/// and the rope parts of `dk` summed over the heads.
pub(crate) fn mla_kv_join(dk: &[f64], dv: &[f64], d: MlaKvDims) -> (Vec<f64>, Vec<f64>) {
    let (dn, dr, dvd) = (d.nope_dim, d.rope_dim, d.v_dim);
    let mut d_kv = Vec::new();
    let mut d_rope = vec![0.0; d.rows * dr];
    for r in 0..d.rows {
        for i in 0..d.heads {
            let k_head = &dk[(r * d.heads + i) * (dn + dr)..][..dn + dr];
            d_kv.extend_from_slice(&k_head[..dn]);
            d_kv.extend_from_slice(&dv[(r * d.heads + i) * dvd..][..dvd]);
            for c in 0..dr {
                d_rope[r * dr + c] += k_head[dn + c];
            }
        }
    }
    (d_kv, d_rope)
}

// ---- optimizer ---------------------------------------------------------------------

/// Whether element `i` lies in one of the decayed `[start, end)` ranges.
fn decayed(ranges: &[(usize, usize)], i: usize) -> bool {
    ranges.iter().any(|&(start, end)| start <= i && i < end)
}

/// `(param, m, v)` after one AdamW step.
pub(crate) fn adam(
    p: &[f64],
    g: &[f64],
    m: &[f64],
    v: &[f64],
    ranges: &[(usize, usize)],
    s: AdamStep,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (lr, b1, b2) = (f64::from(s.lr), f64::from(s.beta1), f64::from(s.beta2));
    let (eps, scale) = (f64::from(s.eps), f64::from(s.grad_scale));
    let t = s.step as i32;
    let (bc1, bc2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..p.len() {
        let wd = if decayed(ranges, i) {
            f64::from(s.weight_decay)
        } else {
            0.0
        };
        let gi = g[i] * scale;
        let mut param = p[i] * (1.0 - lr * wd);
        let mi = b1 * m[i] + (1.0 - b1) * gi;
        let vi = b2 * v[i] + (1.0 - b2) * gi * gi;
        param -= lr * (mi / bc1) / ((vi / bc2).sqrt() + eps);
        out.0.push(param);
        out.1.push(mi);
        out.2.push(vi);
    }
    out
}

/// `(param, momentum buffer)` after one SGD step.
pub(crate) fn sgd(
    p: &[f64],
    g: &[f64],
    buf: Option<&[f64]>,
    ranges: &[(usize, usize)],
    s: SgdStep,
) -> (Vec<f64>, Option<Vec<f64>>) {
    let (lr, mu, scale) = (
        f64::from(s.lr),
        f64::from(s.momentum),
        f64::from(s.grad_scale),
    );
    let mut param = p.to_vec();
    let mut new_buf = buf.map(<[f64]>::to_vec);
    for i in 0..p.len() {
        let wd = if decayed(ranges, i) {
            f64::from(s.weight_decay)
        } else {
            0.0
        };
        let gi = g[i] * scale + wd * p[i];
        match new_buf.as_mut() {
            Some(b) => {
                b[i] = mu * b[i] + gi;
                param[i] -= lr * b[i];
            }
            None => param[i] -= lr * gi,
        }
    }
    (param, new_buf)
}

/// Sums of squares of consecutive pieces of `piece` elements, each in
/// index order from zero (squares of f32 values are exact in f64, so the
/// order fixes every bit).
pub(crate) fn sum_squares(x: &[f64], piece: usize) -> Vec<f64> {
    x.chunks(piece)
        .map(|b| b.iter().fold(0.0, |sum, v| sum + v * v))
        .collect()
}

// ---- finite differences ----------------------------------------------------------------

/// The gradient of `f` at `x` by the fourth-order central difference
/// `(8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h`: truncation error
/// `O(h^4)`, so with `h = 1e-3` and f64 evaluation it is good to ~1e-10,
/// far below any f32 tolerance.
pub(crate) fn gradient(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut at = x.to_vec();
    let mut g = vec![0.0; x.len()];
    for i in 0..x.len() {
        let v = x[i];
        let h = 1e-3 * v.abs().max(1.0);
        let mut eval = |delta: f64| {
            at[i] = v + delta;
            f(&at)
        };
        let (p1, m1, p2, m2) = (eval(h), eval(-h), eval(2.0 * h), eval(-2.0 * h));
        at[i] = v;
        g[i] = (8.0 * (p1 - m1) - (p2 - m2)) / (12.0 * h);
    }
    g
}

/// The most an f64 sum of `terms` in any order can be off from the exact
/// sum: `(n - 1) 2^-53 sum |t|` (Higham, *Accuracy and Stability of
/// Numerical Algorithms*, 4.2), doubled for the reference's own rounding.
pub(crate) fn f64_sum_error(terms: impl Iterator<Item = f64>) -> f64 {
    let (n, magnitude) = terms.fold((0usize, 0.0f64), |(n, m), t| (n + 1, m + t.abs()));
    2.0 * n.saturating_sub(1) as f64 * f64::EPSILON / 2.0 * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (2.9, 0.999_958_902_121_900_1),
            (3.0, 0.999_977_909_503_001_4),
            (4.0, 0.999_999_984_582_742_1),
            (-1.0, -0.842_700_792_949_714_9),
        ] {
            assert!(
                (erf(x) - want).abs() < 1e-12,
                "erf({x}) = {} vs {want}",
                erf(x)
            );
        }
    }

    #[test]
    fn bf16_rounding_is_once_to_nearest_even() {
        // Exactly representable values stay.
        for v in [1.0, -2.5, 0.15625, 96.0, 3.0e38f32 as f64] {
            assert_eq!(round_bf16(round_bf16(v)), round_bf16(v));
        }
        // A tie rounds to even: 1 + 2^-8 lies between 1 and 1 + 2^-7.
        assert_eq!(round_bf16(1.0 + 2f64.powi(-8)), 1.0);
        assert_eq!(
            round_bf16(1.0 + 3.0 * 2f64.powi(-8)),
            1.0 + 2.0 * 2f64.powi(-7)
        );
        // Just above the tie rounds up, however far below f32's precision
        // the excess is (rounding through f32 would land on the tie).
        assert_eq!(
            round_bf16(1.0 + 2f64.powi(-8) + 2f64.powi(-40)),
            1.0 + 2f64.powi(-7)
        );
        // bf16's largest finite value, and overflow.
        let max = (2.0 - 1.0 / 128.0) * 2f64.powi(127);
        assert_eq!(round_bf16(max), max);
        assert_eq!(round_bf16(f64::from(f32::MAX)), f64::INFINITY);
        assert_eq!(round_bf16(-1e39), f64::NEG_INFINITY);
        // Subnormals: spacing 2^-133; half of the smallest rounds to even (0).
        assert_eq!(round_bf16(2f64.powi(-133)), 2f64.powi(-133));
        assert_eq!(round_bf16(2f64.powi(-134)), 0.0);
        assert_eq!(round_bf16(3.0 * 2f64.powi(-134)), 2.0 * 2f64.powi(-133));
        // Agrees with `half` on f32 inputs (where `half` is exact).
        for i in 0..10_000u32 {
            let v = f32::from_bits(0x3f80_0000u32.wrapping_add(i.wrapping_mul(2_654_435_761) >> 6));
            let v = if i % 2 == 0 { v } else { -v * 1e-30 };
            assert_eq!(
                round_bf16(f64::from(v)),
                half::bf16::from_f32(v).to_f64(),
                "{v:e}"
            );
        }
    }

    #[test]
    fn finite_differences_are_accurate() {
        let x = [0.3, -1.2, 2.0];
        let f = |v: &[f64]| (v[0] * v[1]).sin() + v[2].exp() * v[0];
        let g = gradient(&x, f);
        let want = [
            x[1] * (x[0] * x[1]).cos() + x[2].exp(),
            x[0] * (x[0] * x[1]).cos(),
            x[2].exp() * x[0],
        ];
        for (g, w) in g.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{g} vs {w}");
        }
    }

    #[test]
    fn top_k_breaks_ties_to_the_lower_index() {
        assert_eq!(top_k(&[0.5, 0.5, 0.7, 0.5], None, 3), vec![2, 0, 1]);
        assert_eq!(
            top_k(&[0.1, 0.2, 0.3], Some(&[0.3, 0.0, -0.3]), 2),
            vec![0, 1]
        );
    }
}

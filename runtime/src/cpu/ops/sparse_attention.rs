//! DeepSeek sparse attention on the CPU: the indexer's scores, top-k, loss
//! and backward, softmax attention over the selected keys, and the
//! indexer key's LayerNorm. Every loop runs in a fixed order (rows, then
//! keys in ascending position, then heads), in f32, so equal inputs give
//! equal bits. Sparse attention (every head reading one shared key/value
//! row a token) walks a query's selected keys in ascending position.

use super::checked_index;
use super::dense::{axpy_row, dot};
use crate::backend::sparse_attention::{INDEXER_LOSS_EPS, NO_KEY};
use crate::backend::{
    IndexerDims, IndexerInputs, IndexerLossDims, LayerNormDims, SparseAttentionKernels,
    SparseMqaDims,
};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl SparseAttentionKernels<CpuBuf> for CpuBackend {
    fn indexer_scores_unchecked(
        &self,
        inputs: IndexerInputs<View<'_, CpuBuf>>,
        scores: ViewMut<'_, CpuBuf>,
        dims: IndexerDims,
    ) -> Result<()> {
        let k = self.access("indexer_scores");
        let (q, kk, w) = (
            k.f32_in("q", inputs.q)?,
            k.f32_in("k", inputs.k)?,
            k.f32_in("weights", inputs.weights)?,
        );
        let scores = k.typed_out::<f32>("scores", scores)?;
        indexer_scores(
            IndexerInputs {
                q: &q,
                k: &kk,
                weights: &w,
            },
            scores,
            dims,
        );
        Ok(())
    }

    fn indexer_topk_unchecked(
        &self,
        scores: View<'_, CpuBuf>,
        indices: ViewMut<'_, CpuBuf>,
        dims: IndexerDims,
    ) -> Result<()> {
        let k = self.access("indexer_topk");
        let scores = k.typed_in::<f32>("scores", scores)?;
        let indices = k.typed_out::<u32>("indices", indices)?;
        indexer_topk(
            scores,
            indices,
            dims.tokens.batch,
            dims.tokens.seq,
            dims.topk,
        );
        Ok(())
    }

    fn indexer_loss_unchecked(
        &self,
        scores: View<'_, CpuBuf>,
        q: View<'_, CpuBuf>,
        kv: View<'_, CpuBuf>,
        indices: View<'_, CpuBuf>,
        loss: ViewMut<'_, CpuBuf>,
        d_scores: ViewMut<'_, CpuBuf>,
        dims: IndexerLossDims,
    ) -> Result<()> {
        let k = self.access("indexer_loss");
        let scores = k.typed_in::<f32>("scores", scores)?;
        let (q, key) = (k.f32_in("q", q)?, k.f32_in("k", kv)?);
        let indices = k.typed_in::<u32>("indices", indices)?;
        check_indices("indexer_loss", indices, dims.tokens.seq)?;
        let loss = k.typed_out::<f32>("loss", loss)?;
        let d_scores = k.typed_out::<f32>("d_scores", d_scores)?;
        indexer_loss(scores, &q, &key, indices, loss, d_scores, dims);
        Ok(())
    }

    fn indexer_backward_unchecked(
        &self,
        inputs: IndexerInputs<View<'_, CpuBuf>>,
        d_scores: View<'_, CpuBuf>,
        grads: IndexerInputs<ViewMut<'_, CpuBuf>>,
        dims: IndexerDims,
        scale: f32,
    ) -> Result<()> {
        let k = self.access("indexer_backward");
        let (q, kk, w) = (
            k.f32_in("q", inputs.q)?,
            k.f32_in("k", inputs.k)?,
            k.f32_in("weights", inputs.weights)?,
        );
        let d_scores = k.typed_in::<f32>("d_scores", d_scores)?;
        indexer_backward(
            IndexerInputs {
                q: &q,
                k: &kk,
                weights: &w,
            },
            d_scores,
            IndexerInputs {
                q: &mut k.f32_out("dq", grads.q)?,
                k: &mut k.f32_out("dk", grads.k)?,
                weights: &mut k.f32_out("d_weights", grads.weights)?,
            },
            dims,
            scale,
        );
        Ok(())
    }

    fn sparse_mqa_forward_unchecked(
        &self,
        q: View<'_, CpuBuf>,
        kv: View<'_, CpuBuf>,
        indices: View<'_, CpuBuf>,
        out: ViewMut<'_, CpuBuf>,
        lse: ViewMut<'_, CpuBuf>,
        dims: SparseMqaDims,
    ) -> Result<()> {
        let k = self.access("sparse_mqa_forward");
        let (q, kv) = (k.f32_in("q", q)?, k.f32_in("kv", kv)?);
        let indices = k.typed_in::<u32>("indices", indices)?;
        check_indices("sparse_mqa_forward", indices, dims.tokens.seq)?;
        let lse = k.typed_out::<f32>("lse", lse)?;
        sparse_mqa_forward(&q, &kv, indices, &mut k.f32_out("out", out)?, lse, dims);
        Ok(())
    }

    fn sparse_mqa_backward_unchecked(
        &self,
        q: View<'_, CpuBuf>,
        kv: View<'_, CpuBuf>,
        indices: View<'_, CpuBuf>,
        out: View<'_, CpuBuf>,
        lse: View<'_, CpuBuf>,
        dout: View<'_, CpuBuf>,
        dq: ViewMut<'_, CpuBuf>,
        dkv: ViewMut<'_, CpuBuf>,
        dims: SparseMqaDims,
    ) -> Result<()> {
        let k = self.access("sparse_mqa_backward");
        let (q, kv) = (k.f32_in("q", q)?, k.f32_in("kv", kv)?);
        let indices = k.typed_in::<u32>("indices", indices)?;
        check_indices("sparse_mqa_backward", indices, dims.tokens.seq)?;
        let (out, dout) = (k.f32_in("out", out)?, k.f32_in("dout", dout)?);
        let lse = k.typed_in::<f32>("lse", lse)?;
        sparse_mqa_backward(
            &q,
            &kv,
            indices,
            (&out, lse, &dout),
            &mut k.f32_out("dq", dq)?,
            &mut k.f32_out("dkv", dkv)?,
            dims,
        );
        Ok(())
    }

    fn layer_norm_forward_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        weight: View<'_, CpuBuf>,
        bias: View<'_, CpuBuf>,
        y: ViewMut<'_, CpuBuf>,
        stats: ViewMut<'_, CpuBuf>,
        dims: LayerNormDims,
    ) -> Result<()> {
        let k = self.access("layer_norm_forward");
        let (x, w, bias) = (
            k.f32_in("x", x)?,
            k.f32_in("weight", weight)?,
            k.f32_in("bias", bias)?,
        );
        let stats = k.typed_out::<f32>("stats", stats)?;
        layer_norm_forward(&x, &w, &bias, &mut k.f32_out("y", y)?, stats, dims);
        Ok(())
    }

    fn layer_norm_backward_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        weight: View<'_, CpuBuf>,
        stats: View<'_, CpuBuf>,
        dy: View<'_, CpuBuf>,
        dx: ViewMut<'_, CpuBuf>,
        dims: LayerNormDims,
    ) -> Result<()> {
        let k = self.access("layer_norm_backward");
        let (x, w, dy) = (
            k.f32_in("x", x)?,
            k.f32_in("weight", weight)?,
            k.f32_in("dy", dy)?,
        );
        let stats = k.typed_in::<f32>("stats", stats)?;
        layer_norm_backward(&x, &w, stats, &dy, &mut k.f32_out("dx", dx)?, dims);
        Ok(())
    }

    fn layer_norm_weight_grad_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        stats: View<'_, CpuBuf>,
        dy: View<'_, CpuBuf>,
        d_weight: ViewMut<'_, CpuBuf>,
        d_bias: ViewMut<'_, CpuBuf>,
        dims: LayerNormDims,
    ) -> Result<()> {
        let k = self.access("layer_norm_weight_grad");
        let (x, dy) = (k.f32_in("x", x)?, k.f32_in("dy", dy)?);
        let stats = k.typed_in::<f32>("stats", stats)?;
        layer_norm_weight_grad(
            &x,
            stats,
            &dy,
            &mut k.f32_out("d_weight", d_weight)?,
            &mut k.f32_out("d_bias", d_bias)?,
            dims,
        );
        Ok(())
    }
}

/// Every index is a key position of the sequence or `NO_KEY`: checked
/// before a loop writes anything.
fn check_indices(kernel: &str, indices: &[u32], seq: usize) -> Result<()> {
    for &i in indices.iter().filter(|&&i| i != NO_KEY) {
        checked_index(kernel, "selected key", i, seq)?;
    }
    Ok(())
}

/// The keys query `t` attends to among its row of `indices`: not
/// `NO_KEY` and not after `t`, in the row's (ascending) order.
fn selected(row: &[u32], t: usize) -> impl Iterator<Item = usize> + '_ {
    row.iter()
        .filter(|&&u| u != NO_KEY)
        .map(|&u| u as usize)
        .filter(move |&u| u <= t)
}

pub fn indexer_scores(inputs: IndexerInputs<&[f32]>, scores: &mut [f32], dims: IndexerDims) {
    let (seq, ni, di) = (dims.tokens.seq, dims.heads, dims.head_dim);
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            let r = base + t;
            let row = &mut scores[r * seq..(r + 1) * seq];
            for (u, s) in row.iter_mut().enumerate() {
                if u > t {
                    *s = f32::NEG_INFINITY;
                    continue;
                }
                let key = &inputs.k[(base + u) * di..][..di];
                let mut sum = 0.0f32;
                for h in 0..ni {
                    let logit = dot(&inputs.q[(r * ni + h) * di..][..di], key);
                    sum += dims.weight_scale * inputs.weights[r * ni + h] * logit.max(0.0);
                }
                *s = sum;
            }
        }
    }
}

/// Per row, the `topk` best causal keys (score descending, then position
/// ascending), written in ascending position and padded with `NO_KEY`.
pub fn indexer_topk(scores: &[f32], indices: &mut [u32], batch: usize, seq: usize, topk: usize) {
    let mut order: Vec<usize> = Vec::with_capacity(seq);
    for b in 0..batch {
        for t in 0..seq {
            let r = b * seq + t;
            let row = &scores[r * seq..(r + 1) * seq];
            order.clear();
            order.extend(0..=t);
            if order.len() > topk {
                // `total_cmp` orders every value, NaN included, so the
                // selection is a function of the bits alone.
                order.sort_by(|&x, &y| row[y].total_cmp(&row[x]).then(x.cmp(&y)));
                order.truncate(topk);
                order.sort_unstable();
            }
            let out = &mut indices[r * topk..(r + 1) * topk];
            out.fill(NO_KEY);
            for (slot, &u) in out.iter_mut().zip(&order) {
                *slot = u as u32;
            }
        }
    }
}

/// The valid keys of query `t`: every causal key, or the selected ones.
fn valid_keys(row: &[u32], t: usize, sparse: bool, keys: &mut Vec<usize>) {
    keys.clear();
    if sparse {
        keys.extend(selected(row, t));
    } else {
        keys.extend(0..=t);
    }
}

pub fn indexer_loss(
    scores: &[f32],
    q: &[f32],
    k: &[f32],
    indices: &[u32],
    loss: &mut [f32],
    d_scores: &mut [f32],
    dims: IndexerLossDims,
) {
    let (seq, heads, dq, topk) = (dims.tokens.seq, dims.heads, dims.qk_dim, dims.topk);
    let rows = dims.tokens.batch * seq;
    let factor = dims.coeff / rows.max(1) as f32;
    let mut keys = Vec::with_capacity(seq);
    let mut target = vec![0.0f32; seq];
    let mut logits = vec![0.0f32; seq];
    d_scores.fill(0.0);
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            let r = base + t;
            valid_keys(
                &indices[r * topk..(r + 1) * topk],
                t,
                dims.sparse,
                &mut keys,
            );
            // The target: the main attention's probabilities over the valid
            // keys, summed over heads, then normalised to sum 1.
            target[..keys.len()].fill(0.0);
            for h in 0..heads {
                let qh = &q[(r * heads + h) * dq..][..dq];
                let mut max = f32::NEG_INFINITY;
                for (i, &u) in keys.iter().enumerate() {
                    logits[i] = dims.scale * dot(qh, &k[(base + u) * dq..][..dq]);
                    max = max.max(logits[i]);
                }
                let mut sum = 0.0f32;
                for l in &mut logits[..keys.len()] {
                    *l = (*l - max).exp();
                    sum += *l;
                }
                for (tg, l) in target.iter_mut().zip(&logits[..keys.len()]) {
                    *tg += l / sum;
                }
            }
            let total: f32 = target[..keys.len()].iter().sum();
            let total = total.max(INDEXER_LOSS_EPS);
            // The indexer's log-probabilities over the same keys.
            let row = &scores[r * seq..(r + 1) * seq];
            let max = keys
                .iter()
                .map(|&u| row[u])
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = keys.iter().map(|&u| (row[u] - max).exp()).sum();
            let log_sum = sum.ln();
            let mut kl = 0.0f32;
            let d_row = &mut d_scores[r * seq..(r + 1) * seq];
            for (i, &u) in keys.iter().enumerate() {
                let p_t = target[i] / total;
                let log_p = row[u] - max - log_sum;
                kl += p_t * (p_t.max(INDEXER_LOSS_EPS).ln() - log_p);
                d_row[u] = factor * (log_p.exp() - p_t);
            }
            loss[r] = factor * kl;
        }
    }
}

pub fn indexer_backward(
    inputs: IndexerInputs<&[f32]>,
    d_scores: &[f32],
    grads: IndexerInputs<&mut [f32]>,
    dims: IndexerDims,
    scale: f32,
) {
    let IndexerInputs {
        q: dq,
        k: dk,
        weights: dw,
    } = grads;
    dq.fill(0.0);
    dk.fill(0.0);
    dw.fill(0.0);
    let (seq, ni, di) = (dims.tokens.seq, dims.heads, dims.head_dim);
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            let r = base + t;
            for u in 0..=t {
                let g = scale * d_scores[r * seq + u];
                if g == 0.0 {
                    continue;
                }
                let key = &inputs.k[(base + u) * di..][..di];
                for h in 0..ni {
                    let qh = &inputs.q[(r * ni + h) * di..][..di];
                    let logit = dot(qh, key);
                    if logit <= 0.0 {
                        continue;
                    }
                    let w = dims.weight_scale * inputs.weights[r * ni + h];
                    dw[r * ni + h] += g * dims.weight_scale * logit;
                    axpy_row(g * w, key, &mut dq[(r * ni + h) * di..][..di]);
                    axpy_row(g * w, qh, &mut dk[(base + u) * di..][..di]);
                }
            }
        }
    }
}

/// [`SparseMqaDims`]' forward: per query row its selected keys, then
/// per head the scores, their max and the weighted sum of the values (the
/// key row's first `v_dim` channels).
pub fn sparse_mqa_forward(
    q: &[f32],
    kv: &[f32],
    indices: &[u32],
    out: &mut [f32],
    lse: &mut [f32],
    dims: SparseMqaDims,
) {
    let (seq, heads, dk, dv, topk) = (
        dims.tokens.seq,
        dims.heads,
        dims.qk_dim,
        dims.v_dim,
        dims.topk,
    );
    let mut scores = vec![0.0f32; topk];
    let mut keys = Vec::with_capacity(topk);
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            let r = base + t;
            keys.clear();
            keys.extend(selected(&indices[r * topk..(r + 1) * topk], t));
            for j in 0..heads {
                let qh = &q[(r * heads + j) * dk..][..dk];
                let mut max = f32::NEG_INFINITY;
                for (sc, &u) in scores.iter_mut().zip(&keys) {
                    *sc = dims.scale * dot(qh, &kv[(base + u) * dk..][..dk]);
                    max = max.max(*sc);
                }
                let o = &mut out[(r * heads + j) * dv..][..dv];
                o.fill(0.0);
                if keys.is_empty() {
                    lse[r * heads + j] = f32::NEG_INFINITY;
                    continue;
                }
                let mut sum = 0.0f32;
                for (sc, &u) in scores.iter().zip(&keys) {
                    let p = (sc - max).exp();
                    sum += p;
                    axpy_row(p, &kv[(base + u) * dk..][..dv], o);
                }
                let inv = 1.0 / sum;
                for v in o.iter_mut() {
                    *v *= inv;
                }
                lse[r * heads + j] = max + sum.ln();
            }
        }
    }
}

/// [`SparseMqaDims`]' backward: `dq` a (row, head) over its keys in
/// ascending order; each key's `dkv` row sums, in query-row order and each
/// row's heads in order, `ds q` then `p dout` (the order the GPU's key pass
/// keeps).
pub fn sparse_mqa_backward(
    q: &[f32],
    kv: &[f32],
    indices: &[u32],
    (out, lse, dout): (&[f32], &[f32], &[f32]),
    dq: &mut [f32],
    dkv: &mut [f32],
    dims: SparseMqaDims,
) {
    dq.fill(0.0);
    dkv.fill(0.0);
    let (seq, heads, dk, dv, topk) = (
        dims.tokens.seq,
        dims.heads,
        dims.qk_dim,
        dims.v_dim,
        dims.topk,
    );
    let mut keys = Vec::with_capacity(topk);
    for b in 0..dims.tokens.batch {
        let base = b * seq;
        for t in 0..seq {
            let r = base + t;
            keys.clear();
            keys.extend(selected(&indices[r * topk..(r + 1) * topk], t));
            for j in 0..heads {
                let qh = &q[(r * heads + j) * dk..][..dk];
                let g = &dout[(r * heads + j) * dv..][..dv];
                let delta = dot(g, &out[(r * heads + j) * dv..][..dv]);
                let l = lse[r * heads + j];
                let dq_t = &mut dq[(r * heads + j) * dk..][..dk];
                for &u in &keys {
                    let row = &kv[(base + u) * dk..][..dk];
                    let p = (dims.scale * dot(qh, row) - l).exp();
                    let ds = p * (dot(g, &row[..dv]) - delta) * dims.scale;
                    axpy_row(ds, row, dq_t);
                    let d_row = &mut dkv[(base + u) * dk..][..dk];
                    axpy_row(ds, qh, d_row);
                    axpy_row(p, g, &mut d_row[..dv]);
                }
            }
        }
    }
}

pub fn layer_norm_forward(
    x: &[f32],
    w: &[f32],
    bias: &[f32],
    y: &mut [f32],
    stats: &mut [f32],
    dims: LayerNormDims,
) {
    let n = dims.width;
    for r in 0..dims.rows {
        let xr = &x[r * n..(r + 1) * n];
        let mean = xr.iter().sum::<f32>() / n as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
        let rstd = 1.0 / (var + dims.eps).sqrt();
        for (i, yv) in y[r * n..(r + 1) * n].iter_mut().enumerate() {
            *yv = (xr[i] - mean) * rstd * w[i] + bias[i];
        }
        stats[2 * r] = mean;
        stats[2 * r + 1] = rstd;
    }
}

pub fn layer_norm_backward(
    x: &[f32],
    w: &[f32],
    stats: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dims: LayerNormDims,
) {
    let n = dims.width;
    for r in 0..dims.rows {
        let (mean, rstd) = (stats[2 * r], stats[2 * r + 1]);
        let xr = &x[r * n..(r + 1) * n];
        let dyr = &dy[r * n..(r + 1) * n];
        let (mut mean_g, mut mean_gx) = (0.0f32, 0.0f32);
        for i in 0..n {
            let g = dyr[i] * w[i];
            mean_g += g;
            mean_gx += g * (xr[i] - mean) * rstd;
        }
        mean_g /= n as f32;
        mean_gx /= n as f32;
        for (i, d) in dx[r * n..(r + 1) * n].iter_mut().enumerate() {
            let xh = (xr[i] - mean) * rstd;
            *d = rstd * (dyr[i] * w[i] - mean_g - xh * mean_gx);
        }
    }
}

pub fn layer_norm_weight_grad(
    x: &[f32],
    stats: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    db: &mut [f32],
    dims: LayerNormDims,
) {
    let n = dims.width;
    for r in 0..dims.rows {
        let (mean, rstd) = (stats[2 * r], stats[2 * r + 1]);
        for i in 0..n {
            let g = dy[r * n + i];
            dw[i] += g * (x[r * n + i] - mean) * rstd;
            db[i] += g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_breaks_ties_to_the_lower_position_and_pads_short_rows() {
        // One sequence of 4; every score equal but key 2's.
        let mut scores = vec![1.0f32; 16];
        scores[3 * 4 + 2] = 2.0;
        let mut indices = vec![0u32; 8];
        indexer_topk(&scores, &mut indices, 1, 4, 2);
        assert_eq!(
            indices,
            vec![0, NO_KEY, 0, 1, 0, 1, 0, 2],
            "row 0 has one causal key; rows 1 and 2 take their first two; row 3 its best and the lowest tie"
        );
    }
}

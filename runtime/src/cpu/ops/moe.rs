//! Mixture-of-experts kernels: router scoring with top-k selection and its
//! backward, the per-expert histogram, the dispatch sort and the regroup
//! after the all-to-all, the load-balancing loss and its gradient, the
//! balancing load's running sum, row gathers/scatters, and the weighted
//! unpermute (combine) with its backward.
//! Index arguments are `u32` (device views of `DType::U32` in the backend).

use super::checked_index;
use super::dense::{axpy_row, dot};
use crate::backend::{
    AuxLossDims, ExpertBias, ExpertOrder, MoeKernels, ReceivedDims, RouteDims, RouteOutputs,
    RoutedSlots, RouterScores, UnpermuteDims, UnpermuteGrads,
};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{DType, Operand, View, ViewMut, ensure};
use hybridgen_dsl::config::ScoreFunction;

impl MoeKernels<CpuBuf> for CpuBackend {
    fn moe_route_forward_unchecked(
        &self,
        logits: View<'_, CpuBuf>,
        expert_bias: Option<ExpertBias<View<'_, CpuBuf>, ViewMut<'_, CpuBuf>>>,
        out: RouteOutputs<ViewMut<'_, CpuBuf>>,
        selected: ViewMut<'_, CpuBuf>,
        dims: RouteDims,
    ) -> Result<()> {
        let k = self.access("moe_route_forward");
        let expert_bias = match expert_bias {
            Some(b) => Some(ExpertBias {
                bias: k.typed_in::<f32>("expert_bias", b.bias)?,
                unbiased: k.typed_out::<u32>("unbiased", b.unbiased)?,
            }),
            None => None,
        };
        moe_route_forward(
            k.typed_in::<f32>("logits", logits)?,
            expert_bias,
            RouteOutputs {
                scores: k.typed_out::<f32>("scores", out.scores)?,
                weights: k.typed_out::<f32>("weights", out.weights)?,
                prob_sum: out
                    .prob_sum
                    .map(|p| k.typed_out::<f32>("prob_sum", p))
                    .transpose()?,
            },
            k.typed_out::<u32>("selected", selected)?,
            dims,
        )
    }

    fn moe_route_backward_unchecked(
        &self,
        saved: RouterScores<View<'_, CpuBuf>>,
        selected: View<'_, CpuBuf>,
        d_weights: View<'_, CpuBuf>,
        aux_grad: View<'_, CpuBuf>,
        d_logits: ViewMut<'_, CpuBuf>,
        dims: RouteDims,
    ) -> Result<()> {
        let k = self.access("moe_route_backward");
        moe_route_backward(
            RouterScores {
                logits: k.typed_in::<f32>("logits", saved.logits)?,
                scores: k.typed_in::<f32>("scores", saved.scores)?,
            },
            k.typed_in::<u32>("selected", selected)?,
            k.typed_in::<f32>("d_weights", d_weights)?,
            k.typed_in::<f32>("aux_grad", aux_grad)?,
            k.typed_out::<f32>("d_logits", d_logits)?,
            dims,
        )
    }

    fn moe_expert_counts_unchecked(
        &self,
        selected: View<'_, CpuBuf>,
        counts: ViewMut<'_, CpuBuf>,
        slots: RoutedSlots,
    ) -> Result<()> {
        let k = self.access("moe_expert_counts");
        moe_expert_counts(
            k.typed_in::<u32>("selected", selected)?,
            k.typed_out::<u32>("counts", counts)?,
            slots,
        )
    }

    fn moe_sort_by_expert_unchecked(
        &self,
        selected: View<'_, CpuBuf>,
        counts: View<'_, CpuBuf>,
        out: ExpertOrder<ViewMut<'_, CpuBuf>>,
        slots: RoutedSlots,
    ) -> Result<()> {
        let k = self.access("moe_sort_by_expert");
        moe_sort_by_expert(
            k.typed_in::<u32>("selected", selected)?,
            k.typed_in::<u32>("counts", counts)?,
            ExpertOrder {
                positions: k.typed_out::<u32>("positions", out.positions)?,
                sources: k.typed_out::<u32>("sources", out.sources)?,
            },
            slots,
        )
    }

    fn moe_expert_major_order_unchecked(
        &self,
        recv_counts: View<'_, CpuBuf>,
        order: ViewMut<'_, CpuBuf>,
        dims: ReceivedDims,
    ) -> Result<()> {
        let k = self.access("moe_expert_major_order");
        moe_expert_major_order(
            k.typed_in::<u32>("recv_counts", recv_counts)?,
            k.typed_out::<u32>("order", order)?,
            dims,
        )
    }

    fn moe_aux_loss_forward_unchecked(
        &self,
        counts: View<'_, CpuBuf>,
        prob_sum: View<'_, CpuBuf>,
        loss: ViewMut<'_, CpuBuf>,
        dims: AuxLossDims,
    ) -> Result<()> {
        let k = self.access("moe_aux_loss_forward");
        moe_aux_loss_forward(
            k.typed_in::<u32>("counts", counts)?,
            k.typed_in::<f32>("prob_sum", prob_sum)?,
            k.typed_out::<f64>("loss", loss)?,
            dims,
        );
        Ok(())
    }

    fn moe_load_accumulate_unchecked(
        &self,
        counts: View<'_, CpuBuf>,
        load: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("moe_load_accumulate");
        moe_load_accumulate(
            k.typed_in::<u32>("counts", counts)?,
            k.typed_out::<f64>("load", load)?,
        );
        Ok(())
    }

    fn moe_aux_loss_backward_unchecked(
        &self,
        counts: View<'_, CpuBuf>,
        aux_grad: ViewMut<'_, CpuBuf>,
        dims: AuxLossDims,
        scale: f32,
    ) -> Result<()> {
        let k = self.access("moe_aux_loss_backward");
        moe_aux_loss_backward(
            k.typed_in::<u32>("counts", counts)?,
            k.typed_out::<f32>("aux_grad", aux_grad)?,
            dims,
            scale,
        );
        Ok(())
    }

    fn gather_rows_unchecked(
        &self,
        src: View<'_, CpuBuf>,
        index: View<'_, CpuBuf>,
        dst: ViewMut<'_, CpuBuf>,
        width: usize,
    ) -> Result<()> {
        let k = self.access("gather_rows");
        let index = k.typed_in::<u32>("index", index)?;
        let src = k.f32_in("src", src)?;
        gather_rows(&src, index, &mut k.f32_out("dst", dst)?, width)
    }

    fn scatter_rows_unchecked(
        &self,
        src: View<'_, CpuBuf>,
        index: View<'_, CpuBuf>,
        dst: ViewMut<'_, CpuBuf>,
        width: usize,
    ) -> Result<()> {
        let k = self.access("scatter_rows");
        let index = k.typed_in::<u32>("index", index)?;
        let src = k.f32_in("src", src)?;
        scatter_rows(&src, index, &mut k.f32_out("dst", dst)?, width)
    }

    fn moe_unpermute_unchecked(
        &self,
        rows: View<'_, CpuBuf>,
        weights: Option<View<'_, CpuBuf>>,
        positions: View<'_, CpuBuf>,
        out: ViewMut<'_, CpuBuf>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        let k = self.access("moe_unpermute");
        let rows = k.f32_in("rows", rows)?;
        let weights = weights
            .map(|w| k.typed_in::<f32>("weights", w))
            .transpose()?;
        let positions = k.typed_in::<u32>("positions", positions)?;
        moe_unpermute(&rows, weights, positions, &mut k.f32_out("out", out)?, dims)
    }

    fn moe_combine_unchecked(
        &self,
        rows: View<'_, CpuBuf>,
        weights: View<'_, CpuBuf>,
        positions: View<'_, CpuBuf>,
        shared: Option<View<'_, CpuBuf>>,
        x: ViewMut<'_, CpuBuf>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        let k = self.access("moe_combine");
        let rows = k.f32_in("rows", rows)?;
        let weights = k.typed_in::<f32>("weights", weights)?;
        let positions = k.typed_in::<u32>("positions", positions)?;
        let shared = shared.map(|s| k.f32_in("shared", s)).transpose()?;
        moe_combine(
            &rows,
            weights,
            positions,
            shared.as_deref(),
            &mut k.f32_out("x", x)?,
            dims,
        )
    }

    fn moe_unpermute_backward_unchecked(
        &self,
        dout: View<'_, CpuBuf>,
        rows: View<'_, CpuBuf>,
        weights: View<'_, CpuBuf>,
        positions: View<'_, CpuBuf>,
        grads: UnpermuteGrads<ViewMut<'_, CpuBuf>>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        let k = self.access("moe_unpermute_backward");
        let (dout, rows) = (k.f32_in("dout", dout)?, k.f32_in("rows", rows)?);
        let weights = k.typed_in::<f32>("weights", weights)?;
        let positions = k.typed_in::<u32>("positions", positions)?;
        moe_unpermute_backward(
            &dout,
            &rows,
            weights,
            positions,
            UnpermuteGrads {
                rows: &mut k.f32_out("d_rows", grads.rows)?,
                weights: k.typed_out::<f32>("d_weights", grads.weights)?,
            },
            dims,
        )
    }
}

/// `softmax(z)` into `p`, in f32 with the max subtracted.
fn softmax(z: &[f32], p: &mut [f32]) {
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f32;
    for (p, &v) in p.iter_mut().zip(z) {
        *p = (v - max).exp();
        sum += *p;
    }
    let inv = 1.0 / sum;
    for p in p.iter_mut() {
        *p *= inv;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Top-k of `key` by repeated arg-max into `sel`; `>` keeps the lower index
/// on ties. `taken` is scratch of `key.len()`.
fn top_k(key: impl Fn(usize) -> f32, taken: &mut [bool], sel: &mut [u32]) {
    taken.fill(false);
    for slot in sel.iter_mut() {
        let mut best = taken.iter().position(|t| !t).unwrap_or(0);
        for (e, &t) in taken.iter().enumerate().skip(best + 1) {
            if !t && key(e) > key(best) {
                best = e;
            }
        }
        taken[best] = true;
        *slot = best as u32;
    }
}

pub fn moe_route_forward(
    logits: &[f32],
    mut expert_bias: Option<ExpertBias<&[f32], &mut [u32]>>,
    mut out: RouteOutputs<&mut [f32]>,
    selected: &mut [u32],
    dims: RouteDims,
) -> Result<()> {
    let (e_n, k) = (dims.experts, dims.top_k);
    let mut probs = vec![0.0f32; e_n];
    let mut taken = vec![false; e_n];
    let rows = logits
        .chunks_exact(e_n)
        .zip(out.scores.chunks_exact_mut(e_n));
    let picks = selected
        .chunks_exact_mut(k)
        .zip(out.weights.chunks_exact_mut(k));
    for (r, ((z, scores), (sel, weights))) in rows.zip(picks).enumerate() {
        match dims.score {
            ScoreFunction::Softmax => {
                softmax(z, &mut probs);
                scores.copy_from_slice(&probs);
            }
            ScoreFunction::Sigmoid => {
                let mut sum = 0.0f32;
                for (s, &v) in scores.iter_mut().zip(z) {
                    *s = sigmoid(v);
                    sum += *s;
                }
                for (p, &s) in probs.iter_mut().zip(scores.iter()) {
                    *p = s / sum;
                }
            }
        }
        if let Some(prob_sum) = out.prob_sum.as_deref_mut() {
            axpy_row(1.0, &probs, prob_sum);
        }
        match &mut expert_bias {
            Some(b) => {
                top_k(|e| scores[e] + b.bias[e], &mut taken, sel);
                top_k(|e| scores[e], &mut taken, &mut b.unbiased[r * k..][..k]);
            }
            None => top_k(|e| scores[e], &mut taken, sel),
        }
        if dims.score == ScoreFunction::Sigmoid && k == 1 {
            weights[0] = dims.topk_scale * scores[sel[0] as usize];
            continue;
        }
        let mut sum = 0.0f32;
        for &e in sel.iter() {
            sum += scores[e as usize];
        }
        for (w, &e) in weights.iter_mut().zip(sel.iter()) {
            *w = dims.topk_scale * (scores[e as usize] / sum);
        }
    }
    Ok(())
}

pub fn moe_route_backward(
    saved: RouterScores<&[f32]>,
    selected: &[u32],
    d_weights: &[f32],
    aux_grad: &[f32],
    d_logits: &mut [f32],
    dims: RouteDims,
) -> Result<()> {
    let kn = "moe_route_backward";
    let (e_n, k) = (dims.experts, dims.top_k);
    for &e in selected {
        checked_index(kn, "selected expert", e, e_n)?;
    }
    let mut d_scores = vec![0.0f32; e_n];
    let picks = selected.chunks_exact(k).zip(d_weights.chunks_exact(k));
    for ((scores, (sel, dw)), dz) in saved
        .scores
        .chunks_exact(e_n)
        .zip(picks)
        .zip(d_logits.chunks_exact_mut(e_n))
    {
        d_scores.fill(0.0);
        if dims.score == ScoreFunction::Sigmoid && k == 1 {
            // w = scale * s: no normalisation.
            d_scores[sel[0] as usize] = dims.topk_scale * dw[0];
        } else {
            // w_j = scale * s_j / S over the selected:
            // ds_l = scale * (dw_l - sum_j dw_j s_j / S) / S.
            let mut sum = 0.0f32;
            for &e in sel {
                sum += scores[e as usize];
            }
            let mut weighted = 0.0f32;
            for (&e, &d) in sel.iter().zip(dw) {
                weighted += d * scores[e as usize] / sum;
            }
            for (&e, &d) in sel.iter().zip(dw) {
                d_scores[e as usize] += dims.topk_scale * ((d - weighted) / sum);
            }
        }
        match dims.score {
            ScoreFunction::Softmax => {
                // The scores are the softmax and `p`: one Jacobian for both terms.
                for (ds, &a) in d_scores.iter_mut().zip(aux_grad) {
                    *ds += a;
                }
                softmax_backward(scores, &d_scores, dz, false);
            }
            ScoreFunction::Sigmoid => {
                // p_e = s_e / S over all experts: ds_j += (a_j - p . a) / S.
                let total: f32 = scores.iter().sum();
                let mut pa = 0.0f32;
                for (&s, &a) in scores.iter().zip(aux_grad) {
                    pa += s / total * a;
                }
                for (((dz, &ds), &s), &a) in dz.iter_mut().zip(&d_scores).zip(scores).zip(aux_grad)
                {
                    *dz = (ds + (a - pa) / total) * s * (1.0 - s);
                }
            }
        }
    }
    Ok(())
}

/// `dz (+)= p * (g - p . g)`: the softmax Jacobian-vector product.
fn softmax_backward(p: &[f32], g: &[f32], dz: &mut [f32], accumulate: bool) {
    let mut pg = 0.0f32;
    for (&p, &g) in p.iter().zip(g) {
        pg += p * g;
    }
    for ((dz, &p), &g) in dz.iter_mut().zip(p).zip(g) {
        let v = p * (g - pg);
        if accumulate { *dz += v } else { *dz = v }
    }
}

pub fn moe_expert_counts(selected: &[u32], counts: &mut [u32], slots: RoutedSlots) -> Result<()> {
    let kn = "moe_expert_counts";
    counts.fill(0);
    for &e in selected {
        let e = checked_index(kn, "selected expert", e, slots.experts)?;
        // At most `tokens * top_k` slots, which fits u32 (checked before).
        counts[e] += 1;
    }
    Ok(())
}

pub fn moe_sort_by_expert(
    selected: &[u32],
    counts: &[u32],
    out: ExpertOrder<&mut [u32]>,
    slots: RoutedSlots,
) -> Result<()> {
    let kn = "moe_sort_by_expert";
    let n = selected.len();
    let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    ensure(total == n as u64, || {
        format!("{kn}: the counts sum to {total}, but the routing has {n} slots")
    })?;
    // `next[e]`: the next free send row of expert e; `end[e]`: its end.
    let mut next = Vec::with_capacity(counts.len());
    let mut end = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &c in counts {
        next.push(at);
        at += c as usize;
        end.push(at);
    }
    for (slot, &e) in selected.iter().enumerate() {
        let e = checked_index(kn, "selected expert", e, slots.experts)?;
        let row = next[e];
        ensure(row < end[e], || {
            format!(
                "{kn}: expert {e} is selected more often than counts[{e}] = {} says",
                counts[e]
            )
        })?;
        // Both fit u32: `row < n` and `slot / k < tokens <= n`.
        out.positions[slot] = row as u32;
        out.sources[row] = (slot / slots.top_k) as u32;
        next[e] += 1;
    }
    Ok(())
}

pub fn moe_expert_major_order(
    recv_counts: &[u32],
    order: &mut [u32],
    dims: ReceivedDims,
) -> Result<()> {
    let kn = "moe_expert_major_order";
    let l = dims.local_experts;
    let total: u64 = recv_counts.iter().map(|&c| u64::from(c)).sum();
    ensure(u32::try_from(total).is_ok(), || {
        format!("{kn}: {total} received rows overflow the u32 row indices")
    })?;
    let total = usize::try_from(total).unwrap_or(usize::MAX);
    Operand::new(order.len(), DType::U32).has_len(kn, "order", total)?;
    if l == 0 {
        return Ok(());
    }
    // `offsets[i*L + j]`: the first received row of (source rank i, expert j).
    let mut offsets = Vec::with_capacity(recv_counts.len());
    let mut at = 0u32;
    for &c in recv_counts {
        offsets.push(at);
        at += c;
    }
    let mut g = 0usize;
    for j in 0..l {
        for i in 0..dims.ranks {
            let (start, count) = (offsets[i * l + j], recv_counts[i * l + j]);
            for row in start..start + count {
                order[g] = row;
                g += 1;
            }
        }
    }
    Ok(())
}

pub fn moe_aux_loss_forward(counts: &[u32], prob_sum: &[f32], loss: &mut [f64], dims: AuxLossDims) {
    let RoutedSlots {
        tokens,
        top_k,
        experts,
    } = dims.slots;
    if tokens == 0 || dims.coeff == 0.0 {
        return;
    }
    let slots = (tokens * top_k) as f64;
    let sum: f64 = counts
        .iter()
        .zip(prob_sum)
        .map(|(&c, &p)| (c as f64 / slots) * (p as f64 / tokens as f64))
        .sum();
    loss[0] += dims.coeff as f64 * experts as f64 * sum;
}

/// `load[e] += counts[e]`: exact while a total stays below 2^53.
pub fn moe_load_accumulate(counts: &[u32], load: &mut [f64]) {
    for (total, &c) in load.iter_mut().zip(counts) {
        *total += f64::from(c);
    }
}

pub fn moe_aux_loss_backward(counts: &[u32], aux_grad: &mut [f32], dims: AuxLossDims, scale: f32) {
    let RoutedSlots {
        tokens,
        top_k,
        experts,
    } = dims.slots;
    if tokens == 0 {
        aux_grad.fill(0.0);
        return;
    }
    let slots = (tokens * top_k) as f64;
    for (g, &c) in aux_grad.iter_mut().zip(counts) {
        *g = (dims.coeff as f64 * experts as f64 * (c as f64 / slots) / tokens as f64
            * scale as f64) as f32;
    }
}

pub fn gather_rows(src: &[f32], index: &[u32], dst: &mut [f32], width: usize) -> Result<()> {
    let kn = "gather_rows";
    if width == 0 {
        return Ok(());
    }
    let n = src.len() / width;
    for &i in index {
        checked_index(kn, "row index", i, n)?;
    }
    for (row, &i) in dst.chunks_exact_mut(width).zip(index) {
        row.copy_from_slice(&src[i as usize * width..][..width]);
    }
    Ok(())
}

pub fn scatter_rows(src: &[f32], index: &[u32], dst: &mut [f32], width: usize) -> Result<()> {
    let kn = "scatter_rows";
    if width == 0 {
        return Ok(());
    }
    let n = dst.len() / width;
    let mut seen = vec![false; n];
    for &i in index {
        let i = checked_index(kn, "row index", i, n)?;
        ensure(!seen[i], || format!("{kn}: row {i} is written twice"))?;
        seen[i] = true;
    }
    for (row, &i) in src.chunks_exact(width).zip(index) {
        dst[i as usize * width..][..width].copy_from_slice(row);
    }
    Ok(())
}

/// Every position inside the permuted rows (data, checked before a loop
/// writes anything).
fn check_positions(kernel: &str, positions: &[u32], dims: UnpermuteDims) -> Result<()> {
    for &p in positions {
        checked_index(kernel, "position", p, dims.rows)?;
    }
    Ok(())
}

pub fn moe_unpermute(
    rows: &[f32],
    weights: Option<&[f32]>,
    positions: &[u32],
    out: &mut [f32],
    dims: UnpermuteDims,
) -> Result<()> {
    let kn = "moe_unpermute";
    check_positions(kn, positions, dims)?;
    out.fill(0.0);
    if dims.width == 0 || dims.top_k == 0 {
        return Ok(());
    }
    for (t, (o, pos)) in out
        .chunks_exact_mut(dims.width)
        .zip(positions.chunks_exact(dims.top_k))
        .enumerate()
    {
        for (j, &p) in pos.iter().enumerate() {
            let w = weights.map_or(1.0, |w| w[t * dims.top_k + j]);
            axpy_row(w, &rows[p as usize * dims.width..][..dims.width], o);
        }
    }
    Ok(())
}

/// `x[t] += sum_j w[t, j] rows[positions[t*k + j]] + shared[t]`: the sum
/// in f32 in that order (`j` in order, then `shared`, then `x`), as the
/// CUDA kernel takes it.
pub fn moe_combine(
    rows: &[f32],
    weights: &[f32],
    positions: &[u32],
    shared: Option<&[f32]>,
    x: &mut [f32],
    dims: UnpermuteDims,
) -> Result<()> {
    let kn = "moe_combine";
    check_positions(kn, positions, dims)?;
    if dims.width == 0 {
        return Ok(());
    }
    let (w, k) = (dims.width, dims.top_k);
    for (t, row) in x.chunks_exact_mut(w).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            let mut sum = 0.0f32;
            for slot in t * k..(t + 1) * k {
                sum += weights[slot] * rows[positions[slot] as usize * w + c];
            }
            if let Some(shared) = shared {
                sum += shared[t * w + c];
            }
            *x += sum;
        }
    }
    Ok(())
}

pub fn moe_unpermute_backward(
    dout: &[f32],
    rows: &[f32],
    weights: &[f32],
    positions: &[u32],
    grads: UnpermuteGrads<&mut [f32]>,
    dims: UnpermuteDims,
) -> Result<()> {
    let kn = "moe_unpermute_backward";
    check_positions(kn, positions, dims)?;
    grads.rows.fill(0.0);
    if dims.width == 0 || dims.top_k == 0 {
        grads.weights.fill(0.0);
        return Ok(());
    }
    let (w_n, k) = (dims.width, dims.top_k);
    for (t, g) in dout.chunks_exact(w_n).enumerate() {
        for j in 0..k {
            let p = positions[t * k + j] as usize;
            let row = &rows[p * w_n..][..w_n];
            grads.weights[t * k + j] = dot(g, row);
            axpy_row(weights[t * k + j], g, &mut grads.rows[p * w_n..][..w_n]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

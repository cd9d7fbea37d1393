//! Mixture-of-experts kernels: router scoring with top-k selection and its
//! backward, row gathers/scatters for the permutation, and the weighted
//! unpermute (combine) with its backward.

use super::check;
use super::dense::{axpy_row, dot};
use crate::backend::{RouteDims, RouteOutputs, RouterScores, UnpermuteDims, UnpermuteGrads};
use crate::error::Result;
use hybridgen_dsl::config::ScoreFunction;

fn validate_route(kernel: &str, logits: usize, dims: RouteDims) -> Result<()> {
    check::ensure(dims.top_k >= 1 && dims.top_k <= dims.experts, || {
        format!(
            "{kernel}: top-k {} must be in 1..={} experts",
            dims.top_k, dims.experts
        )
    })?;
    check::len(
        kernel,
        "logits",
        logits,
        check::product(kernel, &[dims.rows, dims.experts])?,
    )
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

pub fn moe_route_forward(
    logits: &[f32],
    expert_bias: Option<&[f32]>,
    out: RouteOutputs<&mut [f32]>,
    selected: &mut [u32],
    dims: RouteDims,
) -> Result<()> {
    let kn = "moe_route_forward";
    validate_route(kn, logits.len(), dims)?;
    let (e_n, k) = (dims.experts, dims.top_k);
    check::len(kn, "scores", out.scores.len(), logits.len())?;
    check::len(
        kn,
        "weights",
        out.weights.len(),
        check::product(kn, &[dims.rows, k])?,
    )?;
    check::len(kn, "softmax_sum", out.softmax_sum.len(), e_n)?;
    check::len(kn, "selected", selected.len(), dims.rows * k)?;
    if let Some(bias) = expert_bias {
        check::len(kn, "expert_bias", bias.len(), e_n)?;
    }
    check::ensure(u32::try_from(e_n).is_ok(), || {
        format!("{kn}: {e_n} experts overflow u32")
    })?;
    let mut probs = vec![0.0f32; e_n];
    let mut taken = vec![false; e_n];
    let rows = logits
        .chunks_exact(e_n)
        .zip(out.scores.chunks_exact_mut(e_n));
    let picks = selected
        .chunks_exact_mut(k)
        .zip(out.weights.chunks_exact_mut(k));
    for ((z, scores), (sel, weights)) in rows.zip(picks) {
        softmax(z, &mut probs);
        axpy_row(1.0, &probs, out.softmax_sum);
        match dims.score {
            ScoreFunction::Softmax => scores.copy_from_slice(&probs),
            ScoreFunction::Sigmoid => {
                for (s, &v) in scores.iter_mut().zip(z) {
                    *s = sigmoid(v);
                }
            }
        }
        // Top-k by repeated arg-max; `>` keeps the lower index on ties.
        taken.fill(false);
        for slot in sel.iter_mut() {
            let key = |e: usize| scores[e] + expert_bias.map_or(0.0, |b| b[e]);
            let mut best = taken.iter().position(|t| !t).unwrap_or(0);
            for (e, &t) in taken.iter().enumerate().skip(best + 1) {
                if !t && key(e) > key(best) {
                    best = e;
                }
            }
            taken[best] = true;
            *slot = best as u32;
        }
        let mut sum = 0.0f32;
        for &e in sel.iter() {
            sum += scores[e as usize];
        }
        for (w, &e) in weights.iter_mut().zip(sel.iter()) {
            *w = scores[e as usize] / sum;
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
    validate_route(kn, saved.logits.len(), dims)?;
    let (e_n, k) = (dims.experts, dims.top_k);
    check::len(kn, "scores", saved.scores.len(), saved.logits.len())?;
    check::len(kn, "selected", selected.len(), dims.rows * k)?;
    check::len(kn, "d_weights", d_weights.len(), dims.rows * k)?;
    check::len(kn, "aux_grad", aux_grad.len(), e_n)?;
    check::len(kn, "d_logits", d_logits.len(), saved.logits.len())?;
    for &e in selected {
        check::index(kn, "selected expert", e, e_n)?;
    }
    let mut d_scores = vec![0.0f32; e_n];
    let mut probs = vec![0.0f32; e_n];
    let rows = saved
        .logits
        .chunks_exact(e_n)
        .zip(saved.scores.chunks_exact(e_n));
    let picks = selected.chunks_exact(k).zip(d_weights.chunks_exact(k));
    for (((z, scores), (sel, dw)), dz) in rows.zip(picks).zip(d_logits.chunks_exact_mut(e_n)) {
        // w_j = s_j / S over the selected: ds_l = (dw_l - sum_j dw_j w_j) / S.
        let mut sum = 0.0f32;
        for &e in sel {
            sum += scores[e as usize];
        }
        let mut weighted = 0.0f32;
        for (&e, &d) in sel.iter().zip(dw) {
            weighted += d * scores[e as usize] / sum;
        }
        d_scores.fill(0.0);
        for (&e, &d) in sel.iter().zip(dw) {
            d_scores[e as usize] += (d - weighted) / sum;
        }
        match dims.score {
            ScoreFunction::Softmax => {
                // The scores are the softmax: one Jacobian for both terms.
                for (ds, &a) in d_scores.iter_mut().zip(aux_grad) {
                    *ds += a;
                }
                softmax_backward(scores, &d_scores, dz, false);
            }
            ScoreFunction::Sigmoid => {
                for ((dz, &ds), &s) in dz.iter_mut().zip(&d_scores).zip(scores) {
                    *dz = ds * s * (1.0 - s);
                }
                softmax(z, &mut probs);
                softmax_backward(&probs, aux_grad, dz, true);
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

pub fn gather_rows(src: &[f32], index: &[u32], dst: &mut [f32], width: usize) -> Result<()> {
    let kn = "gather_rows";
    check::len(
        kn,
        "dst",
        dst.len(),
        check::product(kn, &[index.len(), width])?,
    )?;
    check::ensure(width > 0 || src.is_empty(), || {
        format!("{kn}: width 0 with a non-empty source")
    })?;
    if width == 0 {
        return Ok(());
    }
    check::ensure(src.len().is_multiple_of(width), || {
        format!("{kn}: source of {} is not rows of {width}", src.len())
    })?;
    let n = src.len() / width;
    for &i in index {
        check::index(kn, "row index", i, n)?;
    }
    for (row, &i) in dst.chunks_exact_mut(width).zip(index) {
        row.copy_from_slice(&src[i as usize * width..][..width]);
    }
    Ok(())
}

pub fn scatter_rows(src: &[f32], index: &[u32], dst: &mut [f32], width: usize) -> Result<()> {
    let kn = "scatter_rows";
    check::len(
        kn,
        "src",
        src.len(),
        check::product(kn, &[index.len(), width])?,
    )?;
    check::ensure(width > 0 || dst.is_empty(), || {
        format!("{kn}: width 0 with a non-empty destination")
    })?;
    if width == 0 {
        return Ok(());
    }
    check::ensure(dst.len().is_multiple_of(width), || {
        format!("{kn}: destination of {} is not rows of {width}", dst.len())
    })?;
    let n = dst.len() / width;
    let mut seen = vec![false; n];
    for &i in index {
        let i = check::index(kn, "row index", i, n)?;
        check::ensure(!seen[i], || format!("{kn}: row {i} is written twice"))?;
        seen[i] = true;
    }
    for (row, &i) in src.chunks_exact(width).zip(index) {
        dst[i as usize * width..][..width].copy_from_slice(row);
    }
    Ok(())
}

fn validate_unpermute(
    kernel: &str,
    rows: usize,
    positions: &[u32],
    out: usize,
    dims: UnpermuteDims,
) -> Result<()> {
    check::len(
        kernel,
        "rows",
        rows,
        check::product(kernel, &[dims.rows, dims.width])?,
    )?;
    check::len(
        kernel,
        "positions",
        positions.len(),
        check::product(kernel, &[dims.tokens, dims.top_k])?,
    )?;
    check::len(
        kernel,
        "out",
        out,
        check::product(kernel, &[dims.tokens, dims.width])?,
    )?;
    for &p in positions {
        check::index(kernel, "position", p, dims.rows)?;
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
    validate_unpermute(kn, rows.len(), positions, out.len(), dims)?;
    if let Some(w) = weights {
        check::len(kn, "weights", w.len(), positions.len())?;
    }
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

pub fn moe_unpermute_backward(
    dout: &[f32],
    rows: &[f32],
    weights: &[f32],
    positions: &[u32],
    grads: UnpermuteGrads<&mut [f32]>,
    dims: UnpermuteDims,
) -> Result<()> {
    let kn = "moe_unpermute_backward";
    validate_unpermute(kn, rows.len(), positions, dout.len(), dims)?;
    check::len(kn, "weights", weights.len(), positions.len())?;
    check::len(kn, "grads.rows", grads.rows.len(), rows.len())?;
    check::len(kn, "grads.weights", grads.weights.len(), positions.len())?;
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
mod tests {
    use super::*;

    fn route(
        logits: &[f32],
        bias: Option<&[f32]>,
        dims: RouteDims,
    ) -> (Vec<f32>, Vec<f32>, Vec<u32>, Vec<f32>) {
        let mut scores = vec![0.0; logits.len()];
        let mut weights = vec![0.0; dims.rows * dims.top_k];
        let mut sum = vec![0.0; dims.experts];
        let mut sel = vec![0; dims.rows * dims.top_k];
        let out = RouteOutputs {
            scores: &mut scores[..],
            weights: &mut weights[..],
            softmax_sum: &mut sum[..],
        };
        moe_route_forward(logits, bias, out, &mut sel, dims).unwrap();
        (scores, weights, sel, sum)
    }

    #[test]
    fn top_k_is_best_first_with_ties_to_the_lower_index_and_bias_only_selects() {
        let dims = RouteDims {
            rows: 2,
            experts: 4,
            top_k: 2,
            score: ScoreFunction::Softmax,
        };
        let logits = [0.5, 2.0, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0];
        let (scores, weights, sel, sum) = route(&logits, None, dims);
        assert_eq!(sel, [1, 2, 0, 1]);
        assert!((weights[0] - 0.5).abs() < 1e-6 && (weights[2] - 0.5).abs() < 1e-6);
        let z: f32 = logits[..4].iter().map(|v| v.exp()).sum();
        assert!((scores[1] - 2f32.exp() / z).abs() < 1e-6);
        assert!((sum[0] - (scores[0] + 0.25)).abs() < 1e-6);
        // A bias moves the choice but not the weights' definition.
        let bias = [0.0, 0.0, 0.0, 1.0];
        let (_, weights_b, sel_b, _) = route(&logits, Some(&bias), dims);
        assert_eq!(sel_b, [3, 1, 3, 0]);
        let w0 = scores[3] / (scores[1] + scores[3]);
        assert!((weights_b[0] - w0).abs() < 1e-6);
        let sig = RouteDims {
            score: ScoreFunction::Sigmoid,
            ..dims
        };
        let (s, w, sel_s, _) = route(&logits, None, sig);
        assert_eq!(sel_s, [1, 2, 0, 1]);
        assert!((s[0] - 1.0 / (1.0 + (-0.5f32).exp())).abs() < 1e-6);
        assert!((w[0] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn route_backward_matches_finite_differences() {
        for score in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
            for top_k in [1, 2, 3] {
                let dims = RouteDims {
                    rows: 3,
                    experts: 5,
                    top_k,
                    score,
                };
                let logits: Vec<f32> = (0..15).map(|i| (i as f32 * 1.37).sin() * 2.0).collect();
                let dw: Vec<f32> = (0..3 * top_k).map(|i| (i as f32 * 0.77).cos()).collect();
                let aux: Vec<f32> = (0..5).map(|i| 0.1 * i as f32 - 0.2).collect();
                let (scores, _, sel, _) = route(&logits, None, dims);
                let mut dz = vec![0.0; 15];
                let saved = RouterScores {
                    logits: &logits[..],
                    scores: &scores[..],
                };
                moe_route_backward(saved, &sel, &dw, &aux, &mut dz, dims).unwrap();
                // L = sum dw * weights + sum_r aux . softmax(z_r), selection held fixed.
                let loss = |z: &[f32]| -> f64 {
                    let (_, w, s, sum) = route(z, None, dims);
                    assert_eq!(s, sel, "the perturbation changed the selection");
                    let a: f64 = w.iter().zip(&dw).map(|(a, b)| *a as f64 * *b as f64).sum();
                    a + sum
                        .iter()
                        .zip(&aux)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                };
                for i in 0..15 {
                    let (mut p, mut m) = (logits.clone(), logits.clone());
                    p[i] += 1e-3;
                    m[i] -= 1e-3;
                    let fd = (loss(&p) - loss(&m)) / 2e-3;
                    assert!(
                        (dz[i] as f64 - fd).abs() < 2e-3,
                        "{score:?} k={top_k} [{i}]: {} vs {fd}",
                        dz[i]
                    );
                }
            }
        }
    }

    #[test]
    fn gather_scatter_and_unpermute_round_trip() {
        let src: Vec<f32> = (0..8).map(|v| v as f32).collect(); // 4 rows of 2
        let index = [2u32, 0, 3, 1];
        let mut g = vec![0.0; 8];
        gather_rows(&src, &index, &mut g, 2).unwrap();
        assert_eq!(g, [4.0, 5.0, 0.0, 1.0, 6.0, 7.0, 2.0, 3.0]);
        let mut back = vec![0.0; 8];
        scatter_rows(&g, &index, &mut back, 2).unwrap();
        assert_eq!(back, src);
        assert!(scatter_rows(&g, &[0, 0, 1, 2], &mut back, 2).is_err());
        assert!(gather_rows(&src, &[4], &mut g[..2], 2).is_err());
        // Two tokens, k = 2, rows permuted.
        let dims = UnpermuteDims {
            tokens: 2,
            top_k: 2,
            rows: 4,
            width: 2,
        };
        let positions = [1u32, 3, 0, 2];
        let weights = [0.25, 0.75, 0.5, 0.5];
        let mut out = vec![0.0; 4];
        moe_unpermute(&src, Some(&weights), &positions, &mut out, dims).unwrap();
        assert_eq!(
            out,
            [0.25 * 2.0 + 0.75 * 6.0, 0.25 * 3.0 + 0.75 * 7.0, 2.0, 3.0]
        );
        let dout = [1.0, 2.0, 3.0, 4.0];
        let (mut drows, mut dw) = (vec![0.0; 8], vec![0.0; 4]);
        let grads = UnpermuteGrads {
            rows: &mut drows[..],
            weights: &mut dw[..],
        };
        moe_unpermute_backward(&dout, &src, &weights, &positions, grads, dims).unwrap();
        assert_eq!(
            dw,
            [
                1.0 * 2.0 + 2.0 * 3.0,
                6.0 + 14.0,
                3.0 * 0.0 + 4.0,
                3.0 * 4.0 + 4.0 * 5.0
            ]
        );
        assert_eq!(drows, [1.5, 2.0, 0.25, 0.5, 1.5, 2.0, 0.75, 1.5]);
        let mut sums = vec![0.0; 4];
        moe_unpermute(&src, None, &positions, &mut sums, dims).unwrap();
        assert_eq!(sums, [2.0 + 6.0, 3.0 + 7.0, 0.0 + 4.0, 1.0 + 5.0]);
    }
}

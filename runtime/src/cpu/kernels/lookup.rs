//! Token embedding lookup and its deterministic scatter-add, and the softmax
//! cross-entropy of the output head.

use super::check;
use crate::cpu::ops::dense::axpy_row;
use crate::backend::{IGNORE_TARGET, LookupDims, LossDims};
use crate::error::Result;

pub fn embedding_forward(
    table: &[f32],
    ids: &[u32],
    out: &mut [f32],
    dims: LookupDims,
) -> Result<()> {
    let kn = "embedding_forward";
    check::len(
        kn,
        "table",
        table.len(),
        check::product(kn, &[dims.vocab, dims.hidden])?,
    )?;
    check::len(
        kn,
        "out",
        out.len(),
        check::product(kn, &[ids.len(), dims.hidden])?,
    )?;
    // Every id checked before any row is written: a refused call writes
    // nothing (the trait's promise).
    for &id in ids {
        check::index(kn, "token id", id, dims.vocab)?;
    }
    if dims.hidden == 0 {
        return Ok(());
    }
    for (row, &id) in out.chunks_exact_mut(dims.hidden).zip(ids) {
        row.copy_from_slice(&table[id as usize * dims.hidden..][..dims.hidden]);
    }
    Ok(())
}

pub fn embedding_backward(
    dout: &[f32],
    ids: &[u32],
    dtable: &mut [f32],
    dims: LookupDims,
) -> Result<()> {
    let kn = "embedding_backward";
    check::len(
        kn,
        "dtable",
        dtable.len(),
        check::product(kn, &[dims.vocab, dims.hidden])?,
    )?;
    check::len(
        kn,
        "dout",
        dout.len(),
        check::product(kn, &[ids.len(), dims.hidden])?,
    )?;
    for &id in ids {
        check::index(kn, "token id", id, dims.vocab)?;
    }
    if dims.hidden == 0 {
        return Ok(());
    }
    for (row, &id) in dout.chunks_exact(dims.hidden).zip(ids) {
        axpy_row(
            1.0,
            row,
            &mut dtable[id as usize * dims.hidden..][..dims.hidden],
        );
    }
    Ok(())
}

fn validate_targets(kernel: &str, targets: &[u32], dims: LossDims) -> Result<()> {
    check::len(kernel, "targets", targets.len(), dims.rows)?;
    for &t in targets {
        if t != IGNORE_TARGET {
            check::index(kernel, "target", t, dims.vocab)?;
        }
    }
    Ok(())
}

pub fn cross_entropy_forward(
    logits: &mut [f32],
    targets: &[u32],
    losses: &mut [f32],
    dims: LossDims,
) -> Result<()> {
    softmax_rows("cross_entropy_forward", logits, targets, Some(losses), dims)
}

/// The losses of [`cross_entropy_forward`]; the logits become the
/// probabilities (the backend contract leaves them unspecified).
pub fn cross_entropy_loss(
    logits: &mut [f32],
    targets: &[u32],
    losses: &mut [f32],
    dims: LossDims,
) -> Result<()> {
    softmax_rows("cross_entropy_loss", logits, targets, Some(losses), dims)
}

pub fn cross_entropy_backward(
    probs: &mut [f32],
    targets: &[u32],
    scale: f32,
    dims: LossDims,
) -> Result<()> {
    gradient_rows("cross_entropy_backward", probs, targets, scale, dims)
}

/// [`cross_entropy_forward`] then [`cross_entropy_backward`] in place,
/// with the losses where `losses` is given.
pub fn cross_entropy_gradient(
    logits: &mut [f32],
    targets: &[u32],
    scale: f32,
    losses: Option<&mut [f32]>,
    dims: LossDims,
) -> Result<()> {
    let kn = "cross_entropy_gradient";
    softmax_rows(kn, logits, targets, losses, dims)?;
    gradient_rows(kn, logits, targets, scale, dims)
}

/// Each row of `logits` becomes its softmax, and with `losses` its loss
/// (`logsumexp - logit of the target`, 0 for an ignored target).
fn softmax_rows(
    kn: &'static str,
    logits: &mut [f32],
    targets: &[u32],
    mut losses: Option<&mut [f32]>,
    dims: LossDims,
) -> Result<()> {
    check::len(
        kn,
        "logits",
        logits.len(),
        check::product(kn, &[dims.rows, dims.vocab])?,
    )?;
    if let Some(losses) = losses.as_deref() {
        check::len(kn, "losses", losses.len(), dims.rows)?;
    }
    validate_targets(kn, targets, dims)?;
    if dims.vocab == 0 {
        return Ok(());
    }
    for (r, (row, &target)) in logits.chunks_exact_mut(dims.vocab).zip(targets).enumerate() {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum = 0.0f32;
        for v in row.iter() {
            sum += (v - max).exp();
        }
        if let Some(losses) = losses.as_deref_mut() {
            losses[r] = if target == IGNORE_TARGET {
                0.0
            } else {
                max + sum.ln() - row[target as usize]
            };
        }
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v = (*v - max).exp() * inv;
        }
    }
    Ok(())
}

/// Each row of probabilities becomes `scale * (p - onehot(target))`, or
/// zeros for an ignored target.
fn gradient_rows(
    kn: &'static str,
    probs: &mut [f32],
    targets: &[u32],
    scale: f32,
    dims: LossDims,
) -> Result<()> {
    check::len(
        kn,
        "probs",
        probs.len(),
        check::product(kn, &[dims.rows, dims.vocab])?,
    )?;
    validate_targets(kn, targets, dims)?;
    if dims.vocab == 0 {
        return Ok(());
    }
    for (row, &target) in probs.chunks_exact_mut(dims.vocab).zip(targets) {
        if target == IGNORE_TARGET {
            row.fill(0.0);
            continue;
        }
        row[target as usize] -= 1.0;
        for v in row.iter_mut() {
            *v *= scale;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_gathers_and_scatters_in_row_order() {
        let dims = LookupDims {
            vocab: 3,
            hidden: 2,
        };
        let table = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let mut out = [0.0; 6];
        embedding_forward(&table, &[2, 0, 2], &mut out, dims).unwrap();
        assert_eq!(out, [20.0, 21.0, 0.0, 1.0, 20.0, 21.0]);
        let mut dtable = [1.0; 6];
        embedding_backward(
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            &[2, 0, 2],
            &mut dtable,
            dims,
        )
        .unwrap();
        assert_eq!(dtable, [4.0, 5.0, 1.0, 1.0, 7.0, 9.0]);
        assert!(embedding_forward(&table, &[3, 0, 0], &mut out, dims).is_err());
        assert!(embedding_backward(&out, &[0, 0, 3], &mut dtable, dims).is_err());
        assert_eq!(
            dtable,
            [4.0, 5.0, 1.0, 1.0, 7.0, 9.0],
            "a bad id must not half-apply"
        );
    }

    #[test]
    fn cross_entropy_matches_the_definition_and_masks() {
        let dims = LossDims { rows: 3, vocab: 4 };
        let logits: Vec<f32> = (0..12).map(|i| (i as f32 * 0.9).sin() * 2.0).collect();
        let targets = [1, IGNORE_TARGET, 3];
        let mut probs = logits.clone();
        let mut losses = [0.0; 3];
        cross_entropy_forward(&mut probs, &targets, &mut losses, dims).unwrap();
        let lse = |r: usize| -> f64 {
            logits[r * 4..r * 4 + 4]
                .iter()
                .map(|&v| (v as f64).exp())
                .sum::<f64>()
                .ln()
        };
        assert!((losses[0] as f64 - (lse(0) - logits[1] as f64)).abs() < 1e-5);
        assert_eq!(losses[1], 0.0);
        assert!((losses[2] as f64 - (lse(2) - logits[11] as f64)).abs() < 1e-5);
        // dL/dlogits of 0.5 * sum(losses), against finite differences.
        let mut grad = probs.clone();
        cross_entropy_backward(&mut grad, &targets, 0.5, dims).unwrap();
        let total = |l: &[f32]| -> f64 {
            [0usize, 2]
                .iter()
                .map(|&r| {
                    let row = &l[r * 4..r * 4 + 4];
                    let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
                    0.5 * (z - row[targets[r] as usize] as f64)
                })
                .sum()
        };
        for i in 0..12 {
            let (mut p, mut m) = (logits.clone(), logits.clone());
            p[i] += 1e-3;
            m[i] -= 1e-3;
            let fd = (total(&p) - total(&m)) / 2e-3;
            assert!(
                (grad[i] as f64 - fd).abs() < 1e-3,
                "{i}: {} vs {fd}",
                grad[i]
            );
        }
        assert!(cross_entropy_forward(&mut probs, &[4, 0, 0], &mut losses, dims).is_err());
    }
}

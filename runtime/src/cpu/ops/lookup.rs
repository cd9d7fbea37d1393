//! Token embedding lookup and its deterministic scatter-add, and the softmax
//! cross-entropy of the output head. Ids and targets are data: the loops
//! check each one's range before writing anything.

use super::checked_index;
use super::dense::axpy_row;
use crate::backend::{IGNORE_TARGET, LookupDims, LookupKernels, LossDims};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl LookupKernels<CpuBuf> for CpuBackend {
    fn embedding_forward_unchecked(
        &self,
        table: View<'_, CpuBuf>,
        ids: View<'_, CpuBuf>,
        out: ViewMut<'_, CpuBuf>,
        dims: LookupDims,
    ) -> Result<()> {
        let k = self.access("embedding_forward");
        let (table, ids) = (k.f32_in("table", table)?, k.typed_in::<u32>("ids", ids)?);
        embedding_forward(&table, ids, &mut k.f32_out("out", out)?, dims)
    }

    fn embedding_backward_unchecked(
        &self,
        dout: View<'_, CpuBuf>,
        ids: View<'_, CpuBuf>,
        dtable: ViewMut<'_, CpuBuf>,
        dims: LookupDims,
    ) -> Result<()> {
        let k = self.access("embedding_backward");
        let (dout, ids) = (k.f32_in("dout", dout)?, k.typed_in::<u32>("ids", ids)?);
        embedding_backward(&dout, ids, &mut k.f32_out("dtable", dtable)?, dims)
    }

    fn cross_entropy_forward_unchecked(
        &self,
        logits: ViewMut<'_, CpuBuf>,
        targets: View<'_, CpuBuf>,
        losses: ViewMut<'_, CpuBuf>,
        dims: LossDims,
    ) -> Result<()> {
        let k = self.access("cross_entropy_forward");
        let targets = k.typed_in::<u32>("targets", targets)?;
        cross_entropy_forward(
            k.typed_out::<f32>("logits", logits)?,
            targets,
            k.typed_out::<f32>("losses", losses)?,
            dims,
        )
    }

    fn cross_entropy_backward_unchecked(
        &self,
        probs: ViewMut<'_, CpuBuf>,
        targets: View<'_, CpuBuf>,
        scale: f32,
        dims: LossDims,
    ) -> Result<()> {
        let k = self.access("cross_entropy_backward");
        let targets = k.typed_in::<u32>("targets", targets)?;
        cross_entropy_backward(k.typed_out::<f32>("probs", probs)?, targets, scale, dims)
    }

    fn cross_entropy_loss_unchecked(
        &self,
        logits: ViewMut<'_, CpuBuf>,
        targets: View<'_, CpuBuf>,
        losses: ViewMut<'_, CpuBuf>,
        dims: LossDims,
    ) -> Result<()> {
        let k = self.access("cross_entropy_loss");
        let targets = k.typed_in::<u32>("targets", targets)?;
        // bf16 logits are widened; the probabilities rounded back into them
        // are unspecified.
        cross_entropy_loss(
            &mut k.f32_out("logits", logits)?,
            targets,
            k.typed_out::<f32>("losses", losses)?,
            dims,
        )
    }

    fn cross_entropy_gradient_unchecked(
        &self,
        logits: ViewMut<'_, CpuBuf>,
        targets: View<'_, CpuBuf>,
        scale: f32,
        out: Option<ViewMut<'_, CpuBuf>>,
        losses: Option<ViewMut<'_, CpuBuf>>,
        dims: LossDims,
    ) -> Result<()> {
        let k = self.access("cross_entropy_gradient");
        let targets = k.typed_in::<u32>("targets", targets)?;
        // bf16 logits are widened (and the gradients computed in place are
        // rounded back into them once).
        let mut logits = k.f32_out("logits", logits)?;
        let losses = match losses {
            Some(l) => Some(k.typed_out::<f32>("losses", l)?),
            None => None,
        };
        let Some(out) = out else {
            return cross_entropy_gradient(&mut logits, targets, scale, losses, dims);
        };
        let mut out = k.f32_out("out", out)?;
        cross_entropy_gradient(&mut logits, targets, scale, losses, dims)?;
        // A bf16 `out` is rounded once, as a cast of the f32 gradients.
        out.copy_from_slice(&logits);
        Ok(())
    }
}

pub fn embedding_forward(
    table: &[f32],
    ids: &[u32],
    out: &mut [f32],
    dims: LookupDims,
) -> Result<()> {
    let kn = "embedding_forward";
    // Every id checked before any row is written: a refused call writes
    // nothing (the trait's promise).
    for &id in ids {
        checked_index(kn, "token id", id, dims.vocab)?;
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
    for &id in ids {
        checked_index(kn, "token id", id, dims.vocab)?;
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
    for &t in targets {
        if t != IGNORE_TARGET {
            checked_index(kernel, "target", t, dims.vocab)?;
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
    use crate::Backend;
    use crate::cpu::ops::refusals::{buf, refused};
    use crate::view::DType;

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

    #[test]
    fn token_ids_and_targets_are_u32_device_views() {
        let b = CpuBackend::default();
        let dims = LookupDims {
            vocab: 3,
            hidden: 2,
        };
        let table = buf(&b, 6, DType::F32);
        b.upload(
            &[0.0f32, 1.0, 10.0, 11.0, 20.0, 21.0],
            ViewMut::whole(&table),
        )
        .unwrap();
        let ids = buf(&b, 2, DType::U32);
        b.upload(&[2u32, 0], ViewMut::whole(&ids)).unwrap();
        let out = buf(&b, 4, DType::F32);
        b.embedding_forward(
            View::whole(&table),
            View::whole(&ids),
            ViewMut::whole(&out),
            dims,
        )
        .unwrap();
        let mut host = [0.0f32; 4];
        b.download(View::whole(&out), &mut host).unwrap();
        assert_eq!(host, [20.0, 21.0, 0.0, 1.0]);
        let float_ids = buf(&b, 2, DType::F32);
        refused(
            b.embedding_forward(
                View::whole(&table),
                View::whole(&float_ids),
                ViewMut::whole(&out),
                dims,
            ),
            "embedding_forward",
            "ids",
        );
        refused(
            b.embedding_backward(
                View::whole(&out),
                View::whole(&float_ids),
                ViewMut::whole(&table),
                dims,
            ),
            "embedding_backward",
            "ids",
        );
        let bf16_out = buf(&b, 4, DType::Bf16);
        refused(
            b.embedding_forward(
                View::whole(&table),
                View::whole(&ids),
                ViewMut::whole(&bf16_out),
                dims,
            ),
            "embedding_forward",
            "out",
        );
        let loss_dims = LossDims { rows: 2, vocab: 2 };
        let (losses, float_targets) = (buf(&b, 2, DType::F32), buf(&b, 2, DType::F32));
        refused(
            b.cross_entropy_forward(
                ViewMut::whole(&out),
                View::whole(&float_targets),
                ViewMut::whole(&losses),
                loss_dims,
            ),
            "cross_entropy_forward",
            "targets",
        );
        refused(
            b.cross_entropy_backward(
                ViewMut::whole(&out),
                View::whole(&float_targets),
                1.0,
                loss_dims,
            ),
            "cross_entropy_backward",
            "targets",
        );
    }
}

//! Optimizer steps on flat f32 shards, and the block sums of squares the
//! gradient norm is built from.

use super::check;
use crate::backend::{AdamStep, NORM_BLOCK, SgdStep};
use crate::error::Result;

pub fn adam_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: AdamStep,
) -> Result<()> {
    let kn = "adam_update";
    check::len(kn, "grad", grad.len(), param.len())?;
    check::len(kn, "m", m.len(), param.len())?;
    check::len(kn, "v", v.len(), param.len())?;
    check::ensure(step.step >= 1, || format!("{kn}: steps count from 1"))?;
    let t = i32::try_from(step.step).unwrap_or(i32::MAX);
    // Bias corrections in f64 on the host, then f32 like the loop.
    let bc1 = (1.0 - (step.beta1 as f64).powi(t)) as f32;
    let bc2 = (1.0 - (step.beta2 as f64).powi(t)) as f32;
    let decay = 1.0 - step.lr * step.weight_decay;
    for (((p, &g), m), v) in param
        .iter_mut()
        .zip(grad)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
    {
        *p *= decay;
        *m = step.beta1 * *m + (1.0 - step.beta1) * g;
        *v = step.beta2 * *v + (1.0 - step.beta2) * g * g;
        let m_hat = *m / bc1;
        let v_hat = *v / bc2;
        *p -= step.lr * m_hat / (v_hat.sqrt() + step.eps);
    }
    Ok(())
}

pub fn sgd_update(
    param: &mut [f32],
    grad: &[f32],
    momentum: Option<&mut [f32]>,
    step: SgdStep,
) -> Result<()> {
    let kn = "sgd_update";
    check::len(kn, "grad", grad.len(), param.len())?;
    match momentum {
        Some(buf) => {
            check::ensure(step.momentum != 0.0, || {
                format!("{kn}: a momentum buffer without momentum")
            })?;
            check::len(kn, "momentum", buf.len(), param.len())?;
            for ((p, &g), b) in param.iter_mut().zip(grad).zip(buf.iter_mut()) {
                let g = g + step.weight_decay * *p;
                *b = step.momentum * *b + g;
                *p -= step.lr * *b;
            }
        }
        None => {
            check::ensure(step.momentum == 0.0, || {
                format!("{kn}: momentum {} needs a buffer", step.momentum)
            })?;
            for (p, &g) in param.iter_mut().zip(grad) {
                let g = g + step.weight_decay * *p;
                *p -= step.lr * g;
            }
        }
    }
    Ok(())
}

pub fn sum_squares_blocks(x: &[f32], out: &mut [f64]) -> Result<()> {
    check::len(
        "sum_squares_blocks",
        "out",
        out.len(),
        x.len().div_ceil(NORM_BLOCK),
    )?;
    for (o, block) in out.iter_mut().zip(x.chunks(NORM_BLOCK)) {
        let mut sum = 0.0f64;
        for &v in block {
            sum += v as f64 * v as f64;
        }
        *o = sum;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adam_first_step_moves_by_lr_times_the_sign() {
        // With zero moments the first bias-corrected step is g / (|g| + eps).
        let mut p = vec![1.0, -2.0, 0.5];
        let g = [0.3, -0.1, 0.0];
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        let step = AdamStep {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 1,
        };
        adam_update(&mut p, &g, &mut m, &mut v, step).unwrap();
        let want = [
            1.0 * (1.0 - 0.001) - 0.01,
            -2.0 * (1.0 - 0.001) + 0.01,
            0.5 * (1.0 - 0.001),
        ];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert!((m[0] - 0.03).abs() < 1e-7 && (v[0] - 0.05 * 0.09).abs() < 1e-7);
        assert!(adam_update(&mut p, &g[..2], &mut m, &mut v, step).is_err());
        assert!(adam_update(&mut p, &g, &mut m, &mut v, AdamStep { step: 0, ..step }).is_err());
    }

    #[test]
    fn sgd_with_and_without_momentum() {
        let step = SgdStep {
            lr: 0.5,
            momentum: 0.0,
            weight_decay: 0.1,
        };
        let mut p = vec![1.0, 2.0];
        sgd_update(&mut p, &[1.0, -1.0], None, step).unwrap();
        assert_eq!(p, vec![1.0 - 0.5 * 1.1, 2.0 - 0.5 * (-1.0 + 0.2)]);
        let step = SgdStep {
            momentum: 0.9,
            weight_decay: 0.0,
            ..step
        };
        let mut p = vec![1.0];
        let mut buf = vec![0.0];
        sgd_update(&mut p, &[1.0], Some(&mut buf), step).unwrap();
        sgd_update(&mut p, &[1.0], Some(&mut buf), step).unwrap();
        assert_eq!(buf, vec![1.9]);
        assert!((p[0] - (1.0 - 0.5 - 0.95)).abs() < 1e-6);
        assert!(sgd_update(&mut p, &[1.0], None, step).is_err());
    }

    #[test]
    fn block_sums_of_squares_cover_a_short_last_block() {
        let x: Vec<f32> = (0..300).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut out = vec![0.0; 3];
        sum_squares_blocks(&x, &mut out).unwrap();
        for (b, &o) in out.iter().enumerate() {
            let want: f64 = x[b * 128..(b * 128 + 128).min(300)]
                .iter()
                .map(|&v| (v as f64).powi(2))
                .sum();
            assert_eq!(o, want);
        }
        assert!(sum_squares_blocks(&x, &mut out[..2]).is_err());
    }
}

//! Optimizer steps over a bucket's f32 shard (AdamW, SGD; decayed ranges
//! as `[start, end)` pairs, checked as data before anything is written),
//! and the gradient norm's per-piece sums of squares.

use crate::backend::{AdamMoments, AdamStep, OptimKernels, SgdStep};
use crate::cpu::buffer::KernelAccess;
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut, ensure};
use std::ops::Range;

impl OptimKernels<CpuBuf> for CpuBackend {
    fn adam_update_unchecked(
        &self,
        param: ViewMut<'_, CpuBuf>,
        copy: Option<ViewMut<'_, CpuBuf>>,
        grad: View<'_, CpuBuf>,
        moments: AdamMoments<ViewMut<'_, CpuBuf>>,
        decayed: View<'_, CpuBuf>,
        step: AdamStep,
    ) -> Result<()> {
        let k = self.access("adam_update");
        updated_with_copy(&k, param, copy, |param| {
            adam_update(
                param,
                k.typed_in::<f32>("grad", grad)?,
                k.typed_out::<f32>("m", moments.m)?,
                k.typed_out::<f32>("v", moments.v)?,
                k.typed_in::<u32>("decayed", decayed)?,
                step,
            )
        })
    }

    fn sgd_update_unchecked(
        &self,
        param: ViewMut<'_, CpuBuf>,
        copy: Option<ViewMut<'_, CpuBuf>>,
        grad: View<'_, CpuBuf>,
        momentum: Option<ViewMut<'_, CpuBuf>>,
        decayed: View<'_, CpuBuf>,
        step: SgdStep,
    ) -> Result<()> {
        let k = self.access("sgd_update");
        updated_with_copy(&k, param, copy, |param| {
            let momentum = momentum
                .map(|m| k.typed_out::<f32>("momentum", m))
                .transpose()?;
            sgd_update(
                param,
                k.typed_in::<f32>("grad", grad)?,
                momentum,
                k.typed_in::<u32>("decayed", decayed)?,
                step,
            )
        })
    }

    fn sum_squares_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        piece: usize,
        out: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("sum_squares");
        sum_squares(
            k.typed_in::<f32>("x", x)?,
            piece,
            k.typed_out::<f64>("out", out)?,
        );
        Ok(())
    }
}

/// An optimizer step on the f32 shard `param` (`update`), then, with
/// `copy` (the shard's length), the updated parameters written there,
/// rounded once as a cast of the shard would (`Backend::adam_update`).
fn updated_with_copy<'k>(
    k: &KernelAccess<'k>,
    param: ViewMut<'k, CpuBuf>,
    copy: Option<ViewMut<'k, CpuBuf>>,
    update: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    let param = k.typed_out::<f32>("param", param)?;
    let mut copy = copy.map(|copy| k.f32_out("copy", copy)).transpose()?;
    update(&mut *param)?;
    if let Some(copy) = copy.as_mut() {
        copy.copy_from_slice(param);
    }
    Ok(())
}

pub fn decayed_ranges(kernel: &str, decayed: &[u32], len: usize) -> Result<Vec<Range<usize>>> {
    let mut ranges = Vec::with_capacity(decayed.len() / 2);
    let mut at = 0usize;
    for pair in decayed.chunks_exact(2) {
        let (start, end) = (pair[0] as usize, pair[1] as usize);
        ensure(at <= start && start <= end && end <= len, || {
            format!(
                "{kernel}: decayed range {start}..{end} is out of order or outside the shard of {len} elements"
            )
        })?;
        ranges.push(start..end);
        at = end;
    }
    Ok(ranges)
}

/// Calls `run(range, decayed)` for consecutive runs covering `0..len`.
fn for_each_run(len: usize, decayed: &[Range<usize>], mut run: impl FnMut(Range<usize>, bool)) {
    let mut at = 0;
    for r in decayed {
        if at < r.start {
            run(at..r.start, false);
        }
        if r.start < r.end {
            run(r.clone(), true);
        }
        at = r.end;
    }
    if at < len {
        run(at..len, false);
    }
}

pub fn adam_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    decayed: &[u32],
    step: AdamStep,
) -> Result<()> {
    let kn = "adam_update";
    let decayed = decayed_ranges(kn, decayed, param.len())?;
    let t = i32::try_from(step.step).unwrap_or(i32::MAX);
    // Bias corrections in f64 on the host, then f32 like the loop.
    let bc1 = (1.0 - (step.beta1 as f64).powi(t)) as f32;
    let bc2 = (1.0 - (step.beta2 as f64).powi(t)) as f32;
    // `1 - lr * 0` is exactly 1: undecayed elements keep their value.
    let factor = |on: bool| 1.0 - step.lr * if on { step.weight_decay } else { 0.0 };
    for_each_run(param.len(), &decayed, |range, on| {
        let decay = factor(on);
        let r = range.clone();
        for (((p, &g), m), v) in param[r.clone()]
            .iter_mut()
            .zip(&grad[r.clone()])
            .zip(m[r.clone()].iter_mut())
            .zip(v[r].iter_mut())
        {
            let g = g * step.grad_scale;
            *p *= decay;
            *m = step.beta1 * *m + (1.0 - step.beta1) * g;
            *v = step.beta2 * *v + (1.0 - step.beta2) * g * g;
            let m_hat = *m / bc1;
            let v_hat = *v / bc2;
            *p -= step.lr * m_hat / (v_hat.sqrt() + step.eps);
        }
    });
    Ok(())
}

pub fn sgd_update(
    param: &mut [f32],
    grad: &[f32],
    momentum: Option<&mut [f32]>,
    decayed: &[u32],
    step: SgdStep,
) -> Result<()> {
    let kn = "sgd_update";
    let decayed = decayed_ranges(kn, decayed, param.len())?;
    let wd = |on: bool| if on { step.weight_decay } else { 0.0 };
    match momentum {
        Some(buf) => {
            for_each_run(param.len(), &decayed, |r, on| {
                let wd = wd(on);
                for ((p, &g), b) in param[r.clone()]
                    .iter_mut()
                    .zip(&grad[r.clone()])
                    .zip(buf[r].iter_mut())
                {
                    let g = g * step.grad_scale + wd * *p;
                    *b = step.momentum * *b + g;
                    *p -= step.lr * *b;
                }
            });
        }
        None => {
            for_each_run(param.len(), &decayed, |r, on| {
                let wd = wd(on);
                for (p, &g) in param[r.clone()].iter_mut().zip(&grad[r]) {
                    let g = g * step.grad_scale + wd * *p;
                    *p -= step.lr * g;
                }
            });
        }
    }
    Ok(())
}

pub fn sum_squares(x: &[f32], piece: usize, out: &mut [f64]) {
    for (o, chunk) in out.iter_mut().zip(x.chunks(piece)) {
        let mut sum = 0.0f64;
        for &v in chunk {
            sum += f64::from(v) * f64::from(v);
        }
        *o = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;
    use crate::cpu::ops::refusals::{buf, refused};
    use crate::view::DType;

    fn adam(lr: f32, weight_decay: f32, grad_scale: f32, step: u64) -> AdamStep {
        AdamStep {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
            grad_scale,
            step,
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2000)
            .map(|v| v as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn adam_first_step_moves_by_lr_times_the_sign() {
        // With zero moments the first bias-corrected step is g / (|g| + eps).
        let mut p = vec![1.0, -2.0, 0.5];
        let g = [0.3, -0.1, 0.0];
        let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
        let step = adam(0.01, 0.1, 1.0, 1);
        adam_update(&mut p, &g, &mut m, &mut v, &[0, 3], step).unwrap();
        let want = [
            1.0 * (1.0 - 0.001) - 0.01,
            -2.0 * (1.0 - 0.001) + 0.01,
            0.5 * (1.0 - 0.001),
        ];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert!((m[0] - 0.03).abs() < 1e-7 && (v[0] - 0.05 * 0.09).abs() < 1e-7);
    }

    /// The element-wise definition, one element at a time, with the decay
    /// chosen per element and the gradient pre-scaled, as the optimizer did
    /// before one launch covered a bucket.
    fn adam_reference(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        decay: &[bool],
        s: AdamStep,
    ) {
        let t = s.step as i32;
        let bc1 = (1.0 - (s.beta1 as f64).powi(t)) as f32;
        let bc2 = (1.0 - (s.beta2 as f64).powi(t)) as f32;
        for i in 0..p.len() {
            let wd = if decay[i] { s.weight_decay } else { 0.0 };
            let g = g[i] * s.grad_scale;
            p[i] *= 1.0 - s.lr * wd;
            m[i] = s.beta1 * m[i] + (1.0 - s.beta1) * g;
            v[i] = s.beta2 * v[i] + (1.0 - s.beta2) * g * g;
            p[i] -= s.lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + s.eps);
        }
    }

    #[test]
    fn one_launch_over_a_bucket_equals_the_element_wise_definition() {
        let n = 40;
        let decayed = [3u32, 10, 10, 17, 25, 33];
        let decay: Vec<bool> = (0..n)
            .map(|i| {
                decayed
                    .chunks(2)
                    .any(|r| (r[0] as usize..r[1] as usize).contains(&i))
            })
            .collect();
        for (step, scale) in [(1, 1.0), (2, 0.37), (7, 1.0)] {
            let s = adam(0.01, 0.1, scale, step);
            let (mut p, g) = (values(n, 1), values(n, 2));
            let (mut m, mut v) = (
                values(n, 3),
                values(n, 4).iter().map(|x| x * x).collect::<Vec<f32>>(),
            );
            let (mut p2, mut m2, mut v2): (Vec<f32>, Vec<f32>, Vec<f32>) =
                (p.clone(), m.clone(), v.clone());
            adam_update(&mut p, &g, &mut m, &mut v, &decayed, s).unwrap();
            adam_reference(&mut p2, &g, &mut m2, &mut v2, &decay, s);
            assert_eq!(bits(&p), bits(&p2));
            assert_eq!(bits(&m), bits(&m2));
            assert_eq!(bits(&v), bits(&v2));
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn the_gradient_scale_is_a_multiplication_before_the_update() {
        // Clipping used to scale the gradient buffer, then update: same bits.
        let (g, s) = (values(16, 5), 0.123f32);
        let scaled: Vec<f32> = g.iter().map(|x| x * s).collect();
        let (mut p1, mut m1, mut v1) = (values(16, 6), vec![0.1; 16], vec![0.2; 16]);
        let (mut p2, mut m2, mut v2) = (p1.clone(), m1.clone(), v1.clone());
        adam_update(
            &mut p1,
            &g,
            &mut m1,
            &mut v1,
            &[0, 16],
            adam(0.01, 0.1, s, 3),
        )
        .unwrap();
        adam_update(
            &mut p2,
            &scaled,
            &mut m2,
            &mut v2,
            &[0, 16],
            adam(0.01, 0.1, 1.0, 3),
        )
        .unwrap();
        assert_eq!(
            (bits(&p1), bits(&m1), bits(&v1)),
            (bits(&p2), bits(&m2), bits(&v2))
        );
        let sgd = |grad_scale| SgdStep {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
            grad_scale,
        };
        let (mut p1, mut b1) = (values(16, 7), vec![0.5; 16]);
        let (mut p2, mut b2) = (p1.clone(), b1.clone());
        sgd_update(&mut p1, &g, Some(&mut b1), &[2, 9], sgd(s)).unwrap();
        sgd_update(&mut p2, &scaled, Some(&mut b2), &[2, 9], sgd(1.0)).unwrap();
        assert_eq!((bits(&p1), bits(&b1)), (bits(&p2), bits(&b2)));
    }

    #[test]
    fn zero_parameters_with_zero_gradients_stay_zero() {
        // Alignment gaps and padding ride along in the bucket's one launch.
        let n = 8;
        let g = vec![0.0f32; n];
        for decayed in [&[][..], &[0, 8][..]] {
            let (mut p, mut m, mut v) = (vec![0.0f32; n], vec![0.0; n], vec![0.0; n]);
            for step in 1..4 {
                adam_update(
                    &mut p,
                    &g,
                    &mut m,
                    &mut v,
                    decayed,
                    adam(0.1, 0.5, 0.3, step),
                )
                .unwrap();
            }
            assert!(
                p.iter().chain(&m).chain(&v).all(|x| x.to_bits() == 0),
                "{p:?}"
            );
            let mut buf = vec![0.0f32; n];
            let step = SgdStep {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.5,
                grad_scale: 0.3,
            };
            sgd_update(&mut p, &g, Some(&mut buf), decayed, step).unwrap();
            let plain = SgdStep {
                momentum: 0.0,
                ..step
            };
            sgd_update(&mut p, &g, None, decayed, plain).unwrap();
            assert!(p.iter().chain(&buf).all(|x| x.to_bits() == 0), "{p:?}");
        }
    }

    #[test]
    fn decayed_ranges_are_checked() {
        let (mut p, g) = (vec![0.0f32; 4], vec![0.0f32; 4]);
        let (mut m, mut v) = (vec![0.0; 4], vec![0.0; 4]);
        let s = adam(0.1, 0.1, 1.0, 1);
        for bad in [&[0, 5][..], &[2, 1][..], &[0, 3, 2, 4][..]] {
            let err = adam_update(&mut p, &g, &mut m, &mut v, bad, s)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("adam_update") && err.contains("decayed"),
                "{err}"
            );
        }
        adam_update(&mut p, &g, &mut m, &mut v, &[0, 2, 2, 4], s).unwrap();
    }

    #[test]
    fn sgd_with_and_without_momentum() {
        let step = SgdStep {
            lr: 0.5,
            momentum: 0.0,
            weight_decay: 0.1,
            grad_scale: 1.0,
        };
        let mut p = vec![1.0, 2.0];
        sgd_update(&mut p, &[1.0, -1.0], None, &[0, 2], step).unwrap();
        assert_eq!(p, vec![1.0 - 0.5 * 1.1, 2.0 - 0.5 * (-1.0 + 0.2)]);
        // Undecayed: no weight decay term.
        let mut p = vec![1.0, 2.0];
        sgd_update(&mut p, &[1.0, -1.0], None, &[1, 2], step).unwrap();
        assert_eq!(p, vec![1.0 - 0.5 * 1.0, 2.0 - 0.5 * (-1.0 + 0.2)]);
        let step = SgdStep {
            momentum: 0.9,
            weight_decay: 0.0,
            ..step
        };
        let mut p = vec![1.0];
        let mut buf = vec![0.0];
        sgd_update(&mut p, &[1.0], Some(&mut buf), &[], step).unwrap();
        sgd_update(&mut p, &[1.0], Some(&mut buf), &[], step).unwrap();
        assert_eq!(buf, vec![1.9]);
        assert!((p[0] - (1.0 - 0.5 - 0.95)).abs() < 1e-6);
    }

    #[test]
    fn sums_of_squares_per_piece_cover_a_short_last_piece() {
        let x = values(300, 9);
        for piece in [1, 7, 128, 300, 301] {
            let mut out = vec![-1.0; 300usize.div_ceil(piece)];
            sum_squares(&x, piece, &mut out);
            for (i, &o) in out.iter().enumerate() {
                let mut want = 0.0f64;
                for &v in &x[i * piece..((i + 1) * piece).min(300)] {
                    want += (v as f64) * (v as f64);
                }
                assert_eq!(o.to_bits(), want.to_bits(), "piece {piece}, {i}");
            }
        }
        let mut none: [f64; 0] = [];
        sum_squares(&[], 5, &mut none);
    }

    #[test]
    fn optimizer_kernels_take_f32_state_u32_ranges_and_an_f64_norm() {
        let b = CpuBackend::default();
        let [p, g, m, v] = [0; 4].map(|_| buf(&b, 4, DType::F32));
        let step = AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_scale: 1.0,
            step: 1,
        };
        let moments = || AdamMoments {
            m: ViewMut::whole(&m),
            v: ViewMut::whole(&v),
        };
        let ranges = buf(&b, 2, DType::U32);
        b.upload(&[0u32, 4], ViewMut::whole(&ranges)).unwrap();
        b.adam_update(
            ViewMut::whole(&p),
            None,
            View::whole(&g),
            moments(),
            View::whole(&ranges),
            step,
        )
        .unwrap();
        let float_ranges = buf(&b, 2, DType::F32);
        refused(
            b.adam_update(
                ViewMut::whole(&p),
                None,
                View::whole(&g),
                moments(),
                View::whole(&float_ranges),
                step,
            ),
            "adam_update",
            "decayed",
        );
        let sgd = SgdStep {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
            grad_scale: 1.0,
        };
        refused(
            b.sgd_update(
                ViewMut::whole(&p),
                None,
                View::whole(&g),
                None,
                View::whole(&float_ranges),
                sgd,
            ),
            "sgd_update",
            "decayed",
        );
        let bf16_grad = buf(&b, 4, DType::Bf16);
        let partials = buf(&b, 2, DType::F64);
        refused(
            b.sum_squares(View::whole(&bf16_grad), 2, ViewMut::whole(&partials)),
            "sum_squares",
            "x",
        );
        refused(
            b.sum_squares(View::whole(&g), 2, ViewMut::whole(&float_ranges)),
            "sum_squares",
            "out",
        );
        b.upload(&[1.0f32, 2.0, 3.0, 4.0], ViewMut::whole(&g))
            .unwrap();
        b.sum_squares(View::whole(&g), 2, ViewMut::whole(&partials))
            .unwrap();
        let mut host = [0.0f64; 2];
        b.download(View::whole(&partials), &mut host).unwrap();
        assert_eq!(host, [5.0, 25.0]);
    }
}

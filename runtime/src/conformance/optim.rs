//! Optimizer kernels on f32 shards: AdamW (first and a later step), SGD with
//! and without momentum, and the gradient norm's block sums of squares.

use super::Suite;
use super::case::{Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{AdamStep, Backend, NORM_BLOCK, SgdStep};

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    adam(s);
    sgd(s);
    sum_squares(s);
}

fn adam<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (len, step)) in [(300, 1u64), (37, 7), (1, 1000)].into_iter().enumerate() {
        let hyper = AdamStep {
            lr: 0.05,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
        };
        let case = KernelCase::new("adam_update", format!("{len} elements, step {step}"))
            .inout_f32("param", s.rng.values(len, -2.0, 2.0))
            .input_f32("grad", s.rng.values(len, -2.0, 2.0))
            .inout_f32("m", s.rng.values(len, -1.0, 1.0))
            .inout_f32("v", s.rng.values(len, 0.0, 2.0))
            .tolerance(16.0 * U, 16.0 * U);
        let case = if i == 0 { case.with_refusals() } else { case };
        if i == 0 {
            let bad = AdamStep { step: 0, ..hyper };
            s.check_refusal(&case, "step 0 (steps count from 1)", &[], |dev, b| {
                dev.adam_update(
                    b.view_mut("param")?,
                    b.view("grad")?,
                    b.view_mut("m")?,
                    b.view_mut("v")?,
                    bad,
                )?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            case,
            |x| {
                let (p, m, v) = r::adam(&x["param"], &x["grad"], &x["m"], &x["v"], hyper);
                vec![
                    Expected::new("param", p),
                    Expected::new("m", m),
                    Expected::new("v", v),
                ]
            },
            |dev, b| {
                dev.adam_update(
                    b.view_mut("param")?,
                    b.view("grad")?,
                    b.view_mut("m")?,
                    b.view_mut("v")?,
                    hyper,
                )?;
                Ok(vec![])
            },
        );
    }
}

fn sgd<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, momentum) in [0.9f32, 0.0].into_iter().enumerate() {
        let hyper = SgdStep {
            lr: 0.1,
            momentum,
            weight_decay: 0.01,
        };
        let len = 300;
        let case = KernelCase::new("sgd_update", format!("{len} elements, momentum {momentum}"))
            .inout_f32("param", s.rng.values(len, -2.0, 2.0))
            .input_f32("grad", s.rng.values(len, -2.0, 2.0));
        let case = if momentum != 0.0 {
            case.inout_f32("momentum", s.rng.values(len, -2.0, 2.0))
        } else {
            case
        };
        let case = case.tolerance(8.0 * U, 8.0 * U).with_refusals();
        if i == 0 {
            let without = SgdStep {
                momentum: 0.0,
                ..hyper
            };
            s.check_refusal(&case, "a momentum buffer with momentum 0", &[], |dev, b| {
                dev.sgd_update(
                    b.view_mut("param")?,
                    b.view("grad")?,
                    Some(b.view_mut("momentum")?),
                    without,
                )?;
                Ok(vec![])
            });
            s.check_refusal(&case, "momentum 0.9 without a buffer", &[], |dev, b| {
                dev.sgd_update(b.view_mut("param")?, b.view("grad")?, None, hyper)?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            case,
            |x| {
                let buf = (momentum != 0.0).then(|| &x["momentum"]);
                let (p, buf) = r::sgd(&x["param"], &x["grad"], buf, hyper);
                let mut e = vec![Expected::new("param", p)];
                e.extend(buf.map(|b| Expected::new("momentum", b)));
                e
            },
            |dev, b| {
                let buf = if momentum != 0.0 {
                    Some(b.view_mut("momentum")?)
                } else {
                    None
                };
                dev.sgd_update(b.view_mut("param")?, b.view("grad")?, buf, hyper)?;
                Ok(vec![])
            },
        );
    }
}

fn sum_squares<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, len) in [0usize, 1, 127, 128, 129, 300, 1000]
        .into_iter()
        .enumerate()
    {
        let blocks = len.div_ceil(NORM_BLOCK);
        let case = KernelCase::new("sum_squares_blocks", format!("{len} elements"))
            .input_f32("x", s.rng.values(len, -2.0, 2.0))
            .free_len("x");
        let case = if i == 2 { case.with_refusals() } else { case };
        if i == 2 {
            s.check_refusal(&case, "one block sum too few", &[], |dev, b| {
                let mut out = vec![0.0f64; blocks - 1];
                dev.sum_squares_blocks(b.view("x")?, &mut out)?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            case,
            // Summed in f64: any order is within a few f64 ulps.
            |x| vec![Expected::new("out", r::sum_squares_blocks(&x["x"])).tolerance(0.0, 1e-13)],
            |dev, b| {
                let mut out = vec![0.0f64; blocks];
                dev.sum_squares_blocks(b.view("x")?, &mut out)?;
                Ok(vec![("out", out)])
            },
        );
    }
}

//! Optimizer kernels on whole f32 bucket shards: AdamW (first and later
//! steps, a clipping factor, weight decay on some ranges only, zero padding
//! that must stay zero), SGD with and without momentum, and the gradient
//! norm's per-piece sums of squares.

use super::Suite;
use super::case::{BadInput, Bufs, Expected, HostOutputs, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{AdamMoments, AdamStep, Backend, SgdStep};
use crate::error::Result;

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    adam(s);
    sgd(s);
    sum_squares(s);
}

/// A shard's layout: its length, the decayed `[start, end)` ranges, and
/// the padding (zero parameters and gradients) between and after them.
struct Shard {
    len: usize,
    ranges: Vec<(usize, usize)>,
    padding: Vec<(usize, usize)>,
}

impl Shard {
    /// The `decayed` argument: the ranges as u32 pairs.
    fn decayed(&self) -> Vec<u32> {
        self.ranges
            .iter()
            .flat_map(|&(a, b)| [a as u32, b as u32])
            .collect()
    }

    /// Random values, zero on the padding.
    fn values<B: Backend>(&self, s: &mut Suite<'_, B>, lo: f64, hi: f64) -> Vec<f64> {
        let mut v = s.rng.values(self.len, lo, hi);
        for &(a, b) in &self.padding {
            v[a..b].fill(0.0);
        }
        v
    }
}

fn shards() -> Vec<Shard> {
    vec![
        // Matrices decayed, a norm between them not, alignment padding
        // after each, an adjacent pair of ranges.
        Shard {
            len: 300,
            ranges: vec![(0, 120), (120, 130), (150, 270)],
            padding: vec![(140, 150), (290, 300)],
        },
        // Nothing decayed (norms and biases only).
        Shard {
            len: 37,
            ranges: vec![],
            padding: vec![],
        },
        // Everything decayed, and an empty range.
        Shard {
            len: 64,
            ranges: vec![(0, 0), (0, 64)],
            padding: vec![],
        },
        Shard {
            len: 1,
            ranges: vec![(0, 1)],
            padding: vec![],
        },
        Shard {
            len: 0,
            ranges: vec![],
            padding: vec![],
        },
    ]
}

/// Decayed ranges every optimizer kernel must refuse, for a shard of `len`.
fn bad_ranges(len: u32) -> [(&'static str, Vec<u32>); 3] {
    [
        ("a decayed range past the shard", vec![0, 10, 20, len + 1]),
        ("overlapping decayed ranges", vec![0, 20, 10, 30]),
        ("a decayed range that ends before it starts", vec![30, 20]),
    ]
}

fn adam<B: Backend>(s: &mut Suite<'_, B>) {
    let mut first = true;
    for shard in shards() {
        for (step, grad_scale) in [(1u64, 1.0f32), (7, 0.37), (1000, 1.0)] {
            let hyper = AdamStep {
                lr: 0.05,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_scale,
                step,
            };
            let len = shard.len;
            let case = KernelCase::new(
                "adam_update",
                format!(
                    "{len} elements, {} decayed ranges, step {step}, grad scale {grad_scale}",
                    shard.ranges.len()
                ),
            )
            .inout_f32("param", shard.values(s, -2.0, 2.0))
            // The compute-precision copy of the updated parameters.
            .output("copy", len)
            .input_f32("grad", shard.values(s, -2.0, 2.0))
            .inout_f32("m", shard.values(s, -1.0, 1.0))
            .inout_f32("v", shard.values(s, 0.0, 2.0))
            .input_u32("decayed", &shard.decayed())
            .tolerance(16.0 * U, 16.0 * U);
            let refusals = std::mem::take(&mut first);
            let case = if refusals { case.with_refusals() } else { case };
            let launch = |hyper: AdamStep| {
                move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                    dev.adam_update(
                        b.view_mut("param")?,
                        Some(b.view_mut("copy")?),
                        b.view("grad")?,
                        AdamMoments {
                            m: b.view_mut("m")?,
                            v: b.view_mut("v")?,
                        },
                        b.view("decayed")?,
                        hyper,
                    )?;
                    Ok(vec![])
                }
            };
            if refusals {
                let zeroth = AdamStep { step: 0, ..hyper };
                s.check_refusal(&case, "step 0 (steps count from 1)", &[], launch(zeroth));
                for (what, ranges) in bad_ranges(len as u32) {
                    s.check_bad_input(
                        &case,
                        BadInput::new(what).with_u32("decayed", &ranges),
                        launch(hyper),
                    );
                }
            }
            let ranges = shard.ranges.clone();
            s.check_kernel(
                case,
                move |x| {
                    let (p, m, v) =
                        r::adam(&x["param"], &x["grad"], &x["m"], &x["v"], &ranges, hyper);
                    vec![
                        Expected::new("copy", p.clone()).zeros_exact(),
                        Expected::new("param", p).zeros_exact(),
                        Expected::new("m", m).zeros_exact(),
                        Expected::new("v", v).zeros_exact(),
                    ]
                },
                launch(hyper),
            );
        }
    }
}

fn sgd<B: Backend>(s: &mut Suite<'_, B>) {
    let mut first = true;
    for shard in shards() {
        for (momentum, grad_scale) in [(0.9f32, 1.0f32), (0.0, 0.37)] {
            let hyper = SgdStep {
                lr: 0.1,
                momentum,
                weight_decay: 0.01,
                grad_scale,
            };
            let len = shard.len;
            let case = KernelCase::new(
                "sgd_update",
                format!(
                    "{len} elements, {} decayed ranges, momentum {momentum}, grad scale {grad_scale}",
                    shard.ranges.len()
                ),
            )
            .inout_f32("param", shard.values(s, -2.0, 2.0))
            .output("copy", len)
            .input_f32("grad", shard.values(s, -2.0, 2.0));
            let case = if momentum != 0.0 {
                case.inout_f32("momentum", shard.values(s, -2.0, 2.0))
            } else {
                case
            };
            let case = case
                .input_u32("decayed", &shard.decayed())
                .tolerance(8.0 * U, 8.0 * U);
            let refusals = first && momentum != 0.0;
            first &= !refusals;
            let case = if refusals { case.with_refusals() } else { case };
            let launch = |hyper: SgdStep, with_buffer: bool| {
                move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                    let buf = if with_buffer {
                        Some(b.view_mut("momentum")?)
                    } else {
                        None
                    };
                    dev.sgd_update(
                        b.view_mut("param")?,
                        Some(b.view_mut("copy")?),
                        b.view("grad")?,
                        buf,
                        b.view("decayed")?,
                        hyper,
                    )?;
                    Ok(vec![])
                }
            };
            if refusals {
                let without = SgdStep {
                    momentum: 0.0,
                    ..hyper
                };
                s.check_refusal(
                    &case,
                    "a momentum buffer with momentum 0",
                    &[],
                    launch(without, true),
                );
                s.check_refusal(
                    &case,
                    "momentum 0.9 without a buffer",
                    &[],
                    launch(hyper, false),
                );
                for (what, ranges) in bad_ranges(len as u32) {
                    s.check_bad_input(
                        &case,
                        BadInput::new(what).with_u32("decayed", &ranges),
                        launch(hyper, true),
                    );
                }
            }
            let ranges = shard.ranges.clone();
            s.check_kernel(
                case,
                move |x| {
                    let buf = (momentum != 0.0).then(|| &x["momentum"]);
                    let (p, buf) = r::sgd(&x["param"], &x["grad"], buf, &ranges, hyper);
                    let mut e = vec![
                        Expected::new("copy", p.clone()).zeros_exact(),
                        Expected::new("param", p).zeros_exact(),
                    ];
                    e.extend(buf.map(|b| Expected::new("momentum", b).zeros_exact()));
                    e
                },
                launch(hyper, momentum != 0.0),
            );
        }
    }
}

fn sum_squares<B: Backend>(s: &mut Suite<'_, B>) {
    // length, piece: pieces that divide it, do not, exceed it, one element.
    let shapes: [(usize, usize); 9] = [
        (300, 128),
        (0, 4),
        (1, 1),
        (127, 128),
        (129, 128),
        (256, 128),
        (1000, 7),
        (37, 1),
        (5, 1000),
    ];
    for (i, (len, piece)) in shapes.into_iter().enumerate() {
        let pieces = len.div_ceil(piece);
        let case = KernelCase::new(
            "sum_squares",
            format!("{len} elements in pieces of {piece}"),
        )
        .input_f32("x", s.rng.values(len, -2.0, 2.0))
        .output_f64("out", pieces)
        // Any length of `x` is taken; `out` must have its piece count.
        .free_len("x");
        let refusals = i == 0;
        let case = if refusals { case.with_refusals() } else { case };
        let launch = |piece: usize| {
            move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                dev.sum_squares(b.view("x")?, piece, b.view_mut("out")?)?;
                Ok(vec![])
            }
        };
        if refusals {
            s.check_bad_input(
                &case,
                BadInput::new("pieces of 0 elements").with("out", vec![]),
                launch(0),
            );
            s.check_bad_input(
                &case,
                BadInput::new("one piece sum too few").with("out", vec![0.0; pieces - 1]),
                launch(piece),
            );
        }
        s.check_kernel(
            case,
            // Squares of f32 values are exact in f64; the order of each
            // piece's sum is the backend's own, so it may differ from index
            // order by what any order of an f64 sum allows.
            move |x| {
                let err = x["x"]
                    .chunks(piece.max(1))
                    .map(|p| r::f64_sum_error(p.iter().map(|v| v * v)))
                    .fold(0.0, f64::max);
                vec![Expected::new("out", r::sum_squares(&x["x"], piece)).tolerance(err, 0.0)]
            },
            launch(piece),
        );
    }
}

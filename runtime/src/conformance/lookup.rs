//! Token embedding forward and its scatter-add backward (repeated ids), and
//! the softmax cross-entropy forward and backward (with ignored targets).
//! Ids and targets are u32 device views.

use super::Suite;
use super::case::{BadInput, Bufs, Expected, HostOutputs, KernelCase, Values};
use super::dense::U;
use super::reference as r;
use crate::backend::{Backend, IGNORE_TARGET, LookupDims, LossDims, Slice, SliceMut};
use crate::error::Result;

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    embedding(s);
    cross_entropy(s);
}

fn embedding<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (vocab, hidden, tokens)) in [(11, 7, 13), (5, 33, 4), (1, 1, 3), (40, 3, 0)]
        .into_iter()
        .enumerate()
    {
        let dims = LookupDims { vocab, hidden };
        let ids = s.rng.indices(tokens, vocab);
        let name = format!("{tokens} ids into {vocab} x {hidden}");
        let refusals = i == 0;
        // The bad id last: a kernel that writes rows before it checks them
        // has written the others by then.
        let mut bad_ids = ids.clone();
        if let Some(last) = bad_ids.last_mut() {
            *last = vocab as u32;
        }

        let fwd = KernelCase::new("embedding_forward", name.clone())
            .input("table", s.rng.values(vocab * hidden, -2.0, 2.0))
            .input_u32("ids", &ids)
            .output("out", tokens * hidden)
            .same_dtype("table", "out");
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.embedding_forward(b.view("table")?, b.view("ids")?, b.view_mut("out")?, dims)?;
            Ok(vec![])
        };
        if refusals {
            s.check_bad_input(
                &fwd,
                BadInput::new("a token id past the vocabulary")
                    .with_u32("ids", &bad_ids)
                    .nothing_written(),
                launch,
            );
        }
        s.check_kernel(
            fwd,
            |x| {
                let table = &x["table"];
                let out = ids
                    .iter()
                    .flat_map(|&id| table[id as usize * hidden..][..hidden].to_vec())
                    .collect();
                vec![Expected::new("out", out)]
            },
            launch,
        );

        let bwd = KernelCase::new("embedding_backward", name)
            .input("dout", s.rng.values(tokens * hidden, -2.0, 2.0))
            .input_u32("ids", &ids)
            .inout("dtable", s.rng.values(vocab * hidden, -2.0, 2.0))
            .tolerance(16.0 * U * (tokens as f64 + 1.0), 16.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.embedding_backward(b.view("dout")?, b.view("ids")?, b.view_mut("dtable")?, dims)?;
            Ok(vec![])
        };
        if refusals {
            s.check_bad_input(
                &bwd,
                BadInput::new("a token id past the vocabulary")
                    .with_u32("ids", &bad_ids)
                    .nothing_written(),
                launch,
            );
        }
        s.check_kernel(
            bwd,
            |x| {
                let mut dtable = x["dtable"].to_vec();
                for (t, &id) in ids.iter().enumerate() {
                    for j in 0..hidden {
                        dtable[id as usize * hidden + j] += x["dout"][t * hidden + j];
                    }
                }
                vec![Expected::new("dtable", dtable)]
            },
            launch,
        );
    }
}

/// The targets of one shape of the loss kernels' cases: the good ones,
/// one past the vocabulary (`bad`), and whether this shape also checks the
/// kernels' refusals (of `bad`, and of one target too few).
struct Targets<'a> {
    good: &'a [u32],
    bad: &'a [u32],
    refusals: bool,
}

/// Checks a loss kernel's `case` (its f32 matrix and any outputs already
/// given): the targets and the tolerance are added here, then its refusals
/// of bad targets where `targets` asks for them, then its values.
fn check_loss_case<B: Backend>(
    s: &mut Suite<'_, B>,
    case: KernelCase,
    targets: &Targets<'_>,
    tolerance: (f64, f64),
    reference: impl Fn(&Values) -> Vec<Expected>,
    launch: impl Fn(&B, &Bufs<B>) -> Result<HostOutputs> + Copy,
) {
    let case = case
        .input_u32("targets", targets.good)
        .tolerance(tolerance.0, tolerance.1);
    let case = if targets.refusals {
        let case = case.with_refusals();
        s.check_bad_input(
            &case,
            BadInput::new("a target past the vocabulary").with_u32("targets", targets.bad),
            launch,
        );
        s.check_bad_input(
            &case,
            BadInput::new("one target too few").with_u32("targets", &targets.good[1..]),
            launch,
        );
        case
    } else {
        case
    };
    s.check_kernel(case, reference, launch);
}

/// A loss kernel that writes each row's loss from `logits` (the
/// logits left as the kernel leaves them): `cross_entropy_forward` or
/// `cross_entropy_loss`.
type LossKernel<B> = fn(&B, SliceMut<'_, B>, Slice<'_, B>, SliceMut<'_, B>, LossDims) -> Result<()>;

/// The launch of a [`LossKernel`] on a case's `logits`, `targets` and
/// `losses`.
fn losses_launch<B: Backend>(
    kernel: LossKernel<B>,
    dims: LossDims,
) -> impl Fn(&B, &Bufs<B>) -> Result<HostOutputs> + Copy {
    move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
        kernel(
            dev,
            b.view_mut("logits")?,
            b.view("targets")?,
            b.view_mut("losses")?,
            dims,
        )?;
        Ok(vec![])
    }
}

fn cross_entropy<B: Backend>(s: &mut Suite<'_, B>) {
    // The last two shapes also run aligned rows of whole 16-byte words (a
    // GPU's 8-a-thread path for bf16 logits; 4,136 logits are more than two
    // words for each of its 256 threads, and a tail).
    let shapes = [
        (6, 37, false),
        (5, 130, false),
        (1, 1, false),
        (3, 2, false),
        (3, 64, true),
        (2, 4136, true),
    ];
    for (i, (rows, vocab, aligned)) in shapes.into_iter().enumerate() {
        let dims = LossDims { rows, vocab };
        let mut good = s.rng.indices(rows, vocab);
        if rows > 1 {
            good[1] = IGNORE_TARGET;
        }
        let logits = s.rng.values(rows * vocab, -4.0, 4.0);
        let name = format!(
            "{rows} rows of {vocab}{}",
            if aligned { ", aligned" } else { "" }
        );
        let tol = (16.0 * U * vocab as f64, 16.0 * U);
        let mut bad = good.clone();
        bad[rows - 1] = vocab as u32;
        let targets = Targets {
            good: &good,
            bad: &bad,
            refusals: i == 0,
        };
        let aligned_case = |case: KernelCase| if aligned { case.aligned() } else { case };
        // The forward's logits are f32; the losses' and the gradients' f32
        // or the compute dtype (the head's).
        let f32_logits_case = |kernel: &'static str, what: String| {
            aligned_case(KernelCase::new(kernel, what).inout_f32("logits", logits.clone()))
        };
        let logits_case = |kernel: &'static str, what: String| {
            aligned_case(KernelCase::new(kernel, what).inout("logits", logits.clone()))
        };

        check_loss_case(
            s,
            f32_logits_case("cross_entropy_forward", name.clone()).output_f32("losses", rows),
            &targets,
            tol,
            |x| {
                let (probs, losses) = r::cross_entropy_forward(&x["logits"], &good, vocab);
                vec![
                    Expected::new("logits", probs),
                    // Exactly 0 where the target is ignored, so the plain
                    // sum is the masked one.
                    Expected::new("losses", losses).zeros_exact(),
                ]
            },
            losses_launch(B::cross_entropy_forward, dims),
        );

        let scale = 0.37f32;
        let probs = r::cross_entropy_forward(&logits, &good, vocab).0;
        check_loss_case(
            s,
            KernelCase::new("cross_entropy_backward", name.clone()).inout_f32("probs", probs),
            &targets,
            tol,
            |x| {
                let grad = r::cross_entropy_backward(&x["probs"], &good, f64::from(scale), vocab);
                vec![Expected::new("probs", grad).zeros_exact()]
            },
            move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                dev.cross_entropy_backward(b.view_mut("probs")?, b.view("targets")?, scale, dims)?;
                Ok(vec![])
            },
        );

        // The losses alone: the logits are left unspecified.
        check_loss_case(
            s,
            logits_case("cross_entropy_loss", name.clone()).output_f32("losses", rows),
            &targets,
            tol,
            |x| {
                let losses = r::cross_entropy_forward(&x["logits"], &good, vocab).1;
                vec![Expected::new("losses", losses).zeros_exact()]
            },
            losses_launch(B::cross_entropy_loss, dims),
        );

        // Forward and backward at once, into an output of the compute
        // dtype (the logits then unspecified) or in place.
        let gradient = |x: &Values| {
            let probs = r::cross_entropy_forward(&x["logits"], &good, vocab).0;
            r::cross_entropy_backward(&probs, &good, f64::from(scale), vocab)
        };
        let launch = move |into: bool, with_losses: bool| {
            move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                let out = if into { Some(b.view_mut("out")?) } else { None };
                let losses = if with_losses {
                    Some(b.view_mut("losses")?)
                } else {
                    None
                };
                dev.cross_entropy_gradient(
                    b.view_mut("logits")?,
                    b.view("targets")?,
                    scale,
                    out,
                    losses,
                    dims,
                )?;
                Ok(vec![])
            }
        };
        check_loss_case(
            s,
            logits_case("cross_entropy_gradient", format!("{name}, into `out`"))
                .output("out", rows * vocab),
            &targets,
            tol,
            |x| vec![Expected::new("out", gradient(x)).zeros_exact()],
            launch(true, false),
        );
        // With the losses too (the head's forward), into `out` or in place.
        let with_losses = |x: &Values, gradients: &'static str| {
            let losses = r::cross_entropy_forward(&x["logits"], &good, vocab).1;
            vec![
                Expected::new(gradients, gradient(x)).zeros_exact(),
                Expected::new("losses", losses).zeros_exact(),
            ]
        };
        check_loss_case(
            s,
            logits_case(
                "cross_entropy_gradient",
                format!("{name}, into `out`, with the losses"),
            )
            .output("out", rows * vocab)
            .output_f32("losses", rows),
            &targets,
            tol,
            |x| with_losses(x, "out"),
            launch(true, true),
        );
        check_loss_case(
            s,
            logits_case(
                "cross_entropy_gradient",
                format!("{name}, in place, with the losses"),
            )
            .output_f32("losses", rows),
            &Targets {
                refusals: false,
                ..targets
            },
            tol,
            |x| with_losses(x, "logits"),
            launch(false, true),
        );
        check_loss_case(
            s,
            logits_case("cross_entropy_gradient", format!("{name}, in place")),
            &Targets {
                refusals: false,
                ..targets
            },
            tol,
            |x| vec![Expected::new("logits", gradient(x)).zeros_exact()],
            launch(false, false),
        );
    }
}

//! Token embedding forward and its scatter-add backward (repeated ids), and
//! the softmax cross-entropy forward and backward (with ignored targets).

use super::Suite;
use super::case::{Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{Backend, IGNORE_TARGET, LookupDims, LossDims};

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
        let mut bad_ids = ids.clone();
        if let Some(last) = bad_ids.last_mut() {
            *last = vocab as u32;
        }

        let fwd = KernelCase::new("embedding_forward", name.clone())
            .input("table", s.rng.values(vocab * hidden, -2.0, 2.0))
            .output("out", tokens * hidden);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        if refusals {
            s.check_refusal(&fwd, "a token id past the vocabulary", &[], |dev, b| {
                dev.embedding_forward(b.view("table")?, &bad_ids, b.view_mut("out")?, dims)?;
                Ok(vec![])
            });
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
            |dev, b| {
                dev.embedding_forward(b.view("table")?, &ids, b.view_mut("out")?, dims)?;
                Ok(vec![])
            },
        );

        let bwd = KernelCase::new("embedding_backward", name)
            .input("dout", s.rng.values(tokens * hidden, -2.0, 2.0))
            .inout("dtable", s.rng.values(vocab * hidden, -2.0, 2.0))
            .tolerance(16.0 * U * (tokens as f64 + 1.0), 16.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        if refusals {
            s.check_refusal(&bwd, "a token id past the vocabulary", &[], |dev, b| {
                dev.embedding_backward(b.view("dout")?, &bad_ids, b.view_mut("dtable")?, dims)?;
                Ok(vec![])
            });
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
            |dev, b| {
                dev.embedding_backward(b.view("dout")?, &ids, b.view_mut("dtable")?, dims)?;
                Ok(vec![])
            },
        );
    }
}

fn cross_entropy<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (rows, vocab)) in [(6, 37), (5, 130), (1, 1), (3, 2)].into_iter().enumerate() {
        let dims = LossDims { rows, vocab };
        let mut targets = s.rng.indices(rows, vocab);
        if rows > 1 {
            targets[1] = IGNORE_TARGET;
        }
        let logits = s.rng.values(rows * vocab, -4.0, 4.0);
        let name = format!("{rows} rows of {vocab}");
        let refusals = i == 0;
        let tol = (16.0 * U * vocab as f64, 16.0 * U);

        let fwd = KernelCase::new("cross_entropy_forward", name.clone())
            .inout_f32("logits", logits.clone())
            .output_f32("losses", rows)
            .tolerance(tol.0, tol.1);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        if refusals {
            let mut bad = targets.clone();
            bad[0] = vocab as u32;
            s.check_refusal(&fwd, "a target past the vocabulary", &[], |dev, b| {
                dev.cross_entropy_forward(
                    b.view_mut("logits")?,
                    &bad,
                    b.view_mut("losses")?,
                    dims,
                )?;
                Ok(vec![])
            });
            let short = &targets[1..];
            s.check_refusal(&fwd, "one target too few", &[], |dev, b| {
                dev.cross_entropy_forward(
                    b.view_mut("logits")?,
                    short,
                    b.view_mut("losses")?,
                    dims,
                )?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            fwd,
            |x| {
                let (probs, losses) = r::cross_entropy_forward(&x["logits"], &targets, vocab);
                vec![
                    Expected::new("logits", probs),
                    Expected::new("losses", losses),
                ]
            },
            |dev, b| {
                dev.cross_entropy_forward(
                    b.view_mut("logits")?,
                    &targets,
                    b.view_mut("losses")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let scale = 0.37f32;
        let probs = r::cross_entropy_forward(&logits, &targets, vocab).0;
        let bwd = KernelCase::new("cross_entropy_backward", name)
            .inout_f32("probs", probs)
            .tolerance(tol.0, tol.1);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        if refusals {
            let mut bad = targets.clone();
            bad[0] = vocab as u32;
            s.check_refusal(&bwd, "a target past the vocabulary", &[], |dev, b| {
                dev.cross_entropy_backward(b.view_mut("probs")?, &bad, scale, dims)?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            bwd,
            |x| {
                let grad =
                    r::cross_entropy_backward(&x["probs"], &targets, f64::from(scale), vocab);
                vec![Expected::new("probs", grad)]
            },
            |dev, b| {
                dev.cross_entropy_backward(b.view_mut("probs")?, &targets, scale, dims)?;
                Ok(vec![])
            },
        );
    }
}

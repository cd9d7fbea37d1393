//! Causal attention with grouped KV heads (MHA, GQA, MQA; separate q/k and
//! v head dims) forward and backward, and rotary embeddings forward and
//! backward on a part of each head.

use super::Suite;
use super::case::{Bufs, Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{AttentionDims, AttentionInputs, Backend, RotaryDims, Slice, Tokens};

fn inputs<B: Backend>(b: &Bufs<B>) -> crate::Result<AttentionInputs<Slice<'_, B>>> {
    Ok(AttentionInputs {
        q: b.view("q")?,
        k: b.view("k")?,
        v: b.view("v")?,
    })
}

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    attention(s);
    rotary(s);
}

fn attention<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, heads, kv heads, qk dim, v dim
    let shapes = [
        (2, 6, 4, 2, 8, 5),
        (1, 9, 3, 3, 4, 4),
        (2, 5, 4, 1, 6, 3),
        (1, 1, 2, 1, 2, 2),
        (1, 17, 2, 2, 16, 8),
    ];
    for (i, (batch, seq, heads, kv_heads, qk_dim, v_dim)) in shapes.into_iter().enumerate() {
        let dims = AttentionDims {
            tokens: Tokens::new(batch, seq),
            heads,
            kv_heads,
            qk_dim,
            v_dim,
            scale: 1.0 / (qk_dim as f32).sqrt(),
        };
        let rows = batch * seq;
        let name = format!(
            "{batch} x {seq} tokens, {heads} heads / {kv_heads} KV, qk {qk_dim}, v {v_dim}"
        );
        let q = s.rng.values(rows * heads * qk_dim, -1.5, 1.5);
        let k = s.rng.values(rows * kv_heads * qk_dim, -1.5, 1.5);
        let v = s.rng.values(rows * kv_heads * v_dim, -2.0, 2.0);
        let refusals = i == 0;
        // Sums over up to `seq` keys of `qk_dim`-term scores.
        let terms = (seq * qk_dim.max(v_dim)) as f64;

        let fwd = KernelCase::new("attention_forward", name.clone())
            .input("q", q.clone())
            .input("k", k.clone())
            .input("v", v.clone())
            .output("out", rows * heads * v_dim)
            .output_f32("lse", rows * heads)
            .tolerance(16.0 * U * terms, 32.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        if refusals {
            let bad = AttentionDims {
                kv_heads: 3,
                ..dims
            };
            s.check_refusal(&fwd, "KV heads that do not divide heads", &[], |dev, b| {
                dev.attention_forward(inputs(b)?, b.view_mut("out")?, b.view_mut("lse")?, bad)?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            fwd,
            |x| {
                let (out, lse) = r::attention_forward(&x["q"], &x["k"], &x["v"], dims);
                vec![Expected::new("out", out), Expected::new("lse", lse)]
            },
            |dev, b| {
                dev.attention_forward(inputs(b)?, b.view_mut("out")?, b.view_mut("lse")?, dims)?;
                Ok(vec![])
            },
        );

        let bwd = KernelCase::new("attention_backward", name)
            .input("q", q)
            .input("k", k)
            .input("v", v)
            .input_from("out", move |x| {
                r::attention_forward(&x["q"], &x["k"], &x["v"], dims).0
            })
            .input_f32_from("lse", move |x| {
                r::attention_forward(&x["q"], &x["k"], &x["v"], dims).1
            })
            .input("dout", s.rng.values(rows * heads * v_dim, -2.0, 2.0))
            .output("dq", rows * heads * qk_dim)
            .output("dk", rows * kv_heads * qk_dim)
            .output("dv", rows * kv_heads * v_dim)
            .tolerance(32.0 * U * terms, 32.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let (dq, dk, dv) =
                    r::attention_backward(&x["q"], &x["k"], &x["v"], &x["out"], &x["dout"], dims);
                vec![
                    Expected::new("dq", dq),
                    Expected::new("dk", dk),
                    Expected::new("dv", dv),
                ]
            },
            |dev, b| {
                dev.attention_backward(
                    inputs(b)?,
                    b.view("out")?,
                    b.view("lse")?,
                    b.view("dout")?,
                    AttentionInputs {
                        q: b.view_mut("dq")?,
                        k: b.view_mut("dk")?,
                        v: b.view_mut("dv")?,
                    },
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

fn rotary<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, heads, head stride, offset, rotated dim, base
    let shapes = [
        (2, 5, 3, 10, 2, 6, 10_000.0),
        (1, 33, 2, 8, 0, 8, 500.0),
        (3, 4, 1, 4, 0, 2, 10_000.0),
        (1, 6, 2, 12, 5, 4, 10_000.0),
    ];
    for (i, (batch, seq, heads, head_stride, offset, dim, base)) in shapes.into_iter().enumerate() {
        let dims = RotaryDims {
            tokens: Tokens::new(batch, seq),
            heads,
            head_stride,
            offset,
            dim,
            base,
        };
        let len = batch * seq * heads * head_stride;
        let name = format!(
            "{batch} x {seq} tokens, {heads} heads of {head_stride}, channels {offset}..{}, base {base}",
            offset + dim
        );
        for (kernel, arg, inverse) in [
            ("rotary_forward", "x", false),
            ("rotary_backward", "dx", true),
        ] {
            // f32 angles `t * base^(-2i/dim)` are off by ~t ulps.
            let case = KernelCase::new(kernel, name.clone())
                .inout(arg, s.rng.values(len, -2.0, 2.0))
                .tolerance(32.0 * U * seq as f64, 16.0 * U);
            let case = if i == 0 { case.with_refusals() } else { case };
            if i == 0 {
                for (what, bad) in [
                    (
                        "an odd rotated dim",
                        RotaryDims {
                            dim: dim - 1,
                            ..dims
                        },
                    ),
                    (
                        "channels past the head",
                        RotaryDims {
                            offset: head_stride - dim + 1,
                            ..dims
                        },
                    ),
                ] {
                    s.check_refusal(&case, what, &[], |dev, b| {
                        if inverse {
                            dev.rotary_backward(b.view_mut(arg)?, bad)?;
                        } else {
                            dev.rotary_forward(b.view_mut(arg)?, bad)?;
                        }
                        Ok(vec![])
                    });
                }
            }
            s.check_kernel(
                case,
                |x| vec![Expected::new(arg, r::rotary(&x[arg], dims, inverse))],
                |dev, b| {
                    if inverse {
                        dev.rotary_backward(b.view_mut(arg)?, dims)?;
                    } else {
                        dev.rotary_forward(b.view_mut(arg)?, dims)?;
                    }
                    Ok(vec![])
                },
            );
        }
    }
}

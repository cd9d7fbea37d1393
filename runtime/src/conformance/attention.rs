//! Causal attention with grouped KV heads (MHA, GQA, MQA; separate q/k and
//! v head dims) forward and backward, rotary embeddings forward and
//! backward on a part of each head, and the head splits that feed them:
//! the fused GQA projection's split and join, MLA's key/value split and
//! join.

use super::Suite;
use super::case::{Bufs, Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{
    AttentionDims, AttentionInputs, Backend, MlaKvDims, QkvDims, RotaryDims, RotaryPairing, Slice,
    Tokens,
};

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
    qkv_split_join(s);
    mla_kv_split_join(s);
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
    // batch, seq, heads, head stride, offset, rotated dim, base, pairing
    let (half, interleaved) = (RotaryPairing::RotateHalf, RotaryPairing::Interleaved);
    let shapes = [
        (2, 5, 3, 10, 2, 6, 10_000.0, half),
        (1, 33, 2, 8, 0, 8, 500.0, half),
        (3, 4, 1, 4, 0, 2, 10_000.0, half),
        (1, 6, 2, 12, 5, 4, 10_000.0, half),
        (2, 5, 3, 10, 2, 6, 10_000.0, interleaved),
        (1, 9, 4, 24, 16, 8, 10_000.0, interleaved),
    ];
    for (i, (batch, seq, heads, head_stride, offset, dim, base, pairing)) in
        shapes.into_iter().enumerate()
    {
        let dims = RotaryDims {
            tokens: Tokens::new(batch, seq),
            heads,
            head_stride,
            offset,
            dim,
            base,
            pairing,
        };
        let len = batch * seq * heads * head_stride;
        let name = format!(
            "{batch} x {seq} tokens, {heads} heads of {head_stride}, channels {offset}..{}, base {base}, {pairing:?}",
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

fn qkv_split_join<B: Backend>(s: &mut Suite<'_, B>) {
    // rows, KV groups, query heads per group, head dim: GQA, MQA-like
    // (one group), MHA (one query head per group), no rows; then heads of
    // whole 16-byte words (a GPU moves a word a thread: 8 bf16 or 4 f32).
    let shapes = [
        (5, 2, 3, 4),
        (1, 1, 1, 1),
        (7, 3, 1, 5),
        (3, 1, 4, 7),
        (0, 2, 2, 3),
        (6, 2, 3, 8),
        (3, 4, 2, 16),
    ];
    for (i, (rows, groups, heads_per_group, head_dim)) in shapes.into_iter().enumerate() {
        let dims = QkvDims {
            rows,
            groups,
            heads_per_group,
            head_dim,
        };
        let name = format!(
            "{rows} rows, {groups} KV groups of {heads_per_group} query heads, head dim {head_dim}"
        );
        let (q_len, kv_len) = (
            rows * groups * heads_per_group * head_dim,
            rows * groups * head_dim,
        );
        let refusals = i == 0;

        let split = KernelCase::new("qkv_split", name.clone())
            .input("qkv", s.rng.values(rows * dims.width(), -2.0, 2.0))
            .output("q", q_len)
            .output("k", kv_len)
            .output("v", kv_len)
            .same_dtype("q", "qkv")
            .same_dtype("k", "qkv")
            .same_dtype("v", "qkv");
        let split = if refusals {
            split.with_refusals()
        } else {
            split
        };
        let launch = move |dims: QkvDims| {
            move |dev: &B, b: &Bufs<B>| -> crate::Result<_> {
                dev.qkv_split(
                    b.view("qkv")?,
                    AttentionInputs {
                        q: b.view_mut("q")?,
                        k: b.view_mut("k")?,
                        v: b.view_mut("v")?,
                    },
                    dims,
                )?;
                Ok(vec![])
            }
        };
        if refusals {
            // The same number of elements cut differently must still be
            // refused: the views no longer match the dims.
            let swapped = QkvDims {
                groups: heads_per_group,
                heads_per_group: groups,
                ..dims
            };
            s.check_refusal(
                &split,
                "KV groups and heads per group swapped",
                &[],
                launch(swapped),
            );
        }
        // Copies: exact (the case's default tolerance).
        s.check_kernel(
            split,
            move |x| {
                let (q, k, v) = r::qkv_split(&x["qkv"], dims);
                vec![
                    Expected::new("q", q),
                    Expected::new("k", k),
                    Expected::new("v", v),
                ]
            },
            launch(dims),
        );

        let join = KernelCase::new("qkv_join", name)
            .input("dq", s.rng.values(q_len, -2.0, 2.0))
            .input("dk", s.rng.values(kv_len, -2.0, 2.0))
            .input("dv", s.rng.values(kv_len, -2.0, 2.0))
            .output("dqkv", rows * dims.width())
            .same_dtype("dq", "dqkv")
            .same_dtype("dk", "dqkv")
            .same_dtype("dv", "dqkv");
        let join = if refusals { join.with_refusals() } else { join };
        s.check_kernel(
            join,
            move |x| {
                vec![Expected::new(
                    "dqkv",
                    r::qkv_join(&x["dq"], &x["dk"], &x["dv"], dims),
                )]
            },
            move |dev, b| {
                dev.qkv_join(
                    AttentionInputs {
                        q: b.view("dq")?,
                        k: b.view("dk")?,
                        v: b.view("dv")?,
                    },
                    b.view_mut("dqkv")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

fn mla_kv_split_join<B: Backend>(s: &mut Suite<'_, B>) {
    // rows, heads, nope dim, rope dim, v dim
    let shapes = [
        (5, 3, 4, 2, 6),
        (1, 1, 1, 1, 1),
        (7, 4, 8, 4, 8),
        (2, 5, 3, 6, 2),
        (0, 2, 3, 2, 3),
    ];
    for (i, (rows, heads, nope_dim, rope_dim, v_dim)) in shapes.into_iter().enumerate() {
        let dims = MlaKvDims {
            rows,
            heads,
            nope_dim,
            rope_dim,
            v_dim,
        };
        let name =
            format!("{rows} rows, {heads} heads, nope {nope_dim}, rope {rope_dim}, v {v_dim}");
        let kv_len = rows * heads * (nope_dim + v_dim);
        let k_len = rows * heads * (nope_dim + rope_dim);
        let v_len = rows * heads * v_dim;
        let refusals = i == 0;

        let split = KernelCase::new("mla_kv_split", name.clone())
            .input("kv", s.rng.values(kv_len, -2.0, 2.0))
            .input("k_rope", s.rng.values(rows * rope_dim, -2.0, 2.0))
            .output("k", k_len)
            .output("v", v_len)
            .same_dtype("k_rope", "kv")
            .same_dtype("k", "kv")
            .same_dtype("v", "kv");
        let split = if refusals {
            split.with_refusals()
        } else {
            split
        };
        let launch = move |dims: MlaKvDims| {
            move |dev: &B, b: &Bufs<B>| -> crate::Result<_> {
                dev.mla_kv_split(
                    b.view("kv")?,
                    b.view("k_rope")?,
                    b.view_mut("k")?,
                    b.view_mut("v")?,
                    dims,
                )?;
                Ok(vec![])
            }
        };
        if refusals {
            let swapped = MlaKvDims {
                nope_dim: v_dim,
                v_dim: nope_dim,
                ..dims
            };
            s.check_refusal(&split, "nope and v dims swapped", &[], launch(swapped));
        }
        s.check_kernel(
            split,
            move |x| {
                let (k, v) = r::mla_kv_split(&x["kv"], &x["k_rope"], dims);
                vec![Expected::new("k", k), Expected::new("v", v)]
            },
            launch(dims),
        );

        let join = KernelCase::new("mla_kv_join", name)
            .input("dk", s.rng.values(k_len, -2.0, 2.0))
            .input("dv", s.rng.values(v_len, -2.0, 2.0))
            .output("d_kv", kv_len)
            .output("d_k_rope", rows * rope_dim)
            .same_dtype("dv", "dk")
            .same_dtype("d_kv", "dk")
            .same_dtype("d_k_rope", "dk");
        let join = if refusals { join.with_refusals() } else { join };
        s.check_kernel(
            join,
            move |x| {
                let (d_kv, d_k_rope) = r::mla_kv_join(&x["dk"], &x["dv"], dims);
                vec![
                    // A copy: exact.
                    Expected::new("d_kv", d_kv),
                    // `heads` order-one terms summed in f32.
                    Expected::new("d_k_rope", d_k_rope)
                        .tolerance(16.0 * U * (heads as f64 + 1.0), 16.0 * U),
                ]
            },
            move |dev, b| {
                dev.mla_kv_join(
                    b.view("dk")?,
                    b.view("dv")?,
                    b.view_mut("d_kv")?,
                    b.view_mut("d_k_rope")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

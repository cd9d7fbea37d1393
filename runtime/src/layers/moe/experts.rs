//! The local experts as one grouped operation. The received rows, grouped
//! expert-major ([`ExpertGroups`]), are one buffer in which each expert owns
//! a contiguous row range; every GEMM of the expert MLPs is then one
//! [`SegmentedMatmul`] over those ranges (fc1, fc2, and both backward
//! passes), run as a [`Backend::grouped_matmul`] of the ranges where the
//! host knows them (expert parallelism above 1) or as a
//! [`Backend::segmented_matmul`] that reads them on the device (expert
//! parallelism 1), and the activation and its backward one launch over all
//! rows. Each expert's product is the matmul the per-expert loop ran, so the
//! bits are the same either way.
//!
//! For SwiGLU the fc1 output of all rows is two planes,
//! `[gate: total x F | up: total x F]`, so one `silu_mul` covers every
//! expert; expert `j`'s fc1 weight rows `[0, F)` make its gate, `[F, 2F)`
//! its up projection (Megatron's `[gate | up]`).

use super::MoeLayer;
use super::permutation::{ExpertGroups, ExpertRows};
use crate::backend::{Backend, MatmulDims, SegmentedGroup, SegmentedMatmul, Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use crate::layers::{check_grads, check_len, check_weights, weight, weight_rows};

/// What the experts' forward (`MoeLayer::experts`) keeps for their backward
/// (the activation is recomputed from `pre`: `Ffn::activate`).
pub struct MoeExpertsSaved<B: Backend> {
    groups: ExpertGroups<B>,
    /// The grouped input rows `[total, h]`.
    input: B::Buf,
    pre: B::Buf,
}

/// What [`MoeLayer::experts_backward_input`] keeps.
pub struct MoeExpertsWgrad<B: Backend> {
    /// Rows per local expert.
    rows: ExpertRows<B>,
    total: usize,
    input: B::Buf,
    act: B::Buf,
    d_pre: B::Buf,
    /// The grouped output gradient `[total, h]`.
    d_out: B::Buf,
}

/// Where the rows the experts take come from.
pub(super) enum ExpertInput<'a> {
    /// Expert parallelism above 1: `recv_counts[i][j]` rows from source
    /// rank i for local expert j, in that order.
    Received(&'a [Vec<usize>]),
    /// Expert parallelism 1: the layer's `total` routed rows in send order
    /// (grouped by expert), sized per expert by the router's counts on the
    /// device.
    Local { total: usize },
}

/// `rows` rows of `width` elements of a row-major buffer.
fn rows_of<'a, B: Backend>(
    b: &B,
    buf: &'a B::Buf,
    rows: std::ops::Range<usize>,
    width: usize,
) -> Result<Slice<'a, B>> {
    b.slice(buf, rows.start * width..rows.end * width)
}

fn rows_of_mut<'a, B: Backend>(
    b: &B,
    buf: &'a B::Buf,
    rows: std::ops::Range<usize>,
    width: usize,
) -> Result<SliceMut<'a, B>> {
    b.slice_mut(buf, rows.start * width..rows.end * width)
}

/// One view an expert, of `l` experts.
fn per_expert<'w, B: Backend>(
    l: usize,
    pick: impl Fn(usize) -> Result<Slice<'w, B>>,
) -> Result<Vec<Slice<'w, B>>> {
    (0..l).map(pick).collect()
}

impl MoeLayer {
    /// The mlp slot: runs the local experts on the received rows and
    /// returns their outputs in received order. Takes the received rows:
    /// with one source rank they already are in grouped order and become
    /// the saved input as they are. `counts` is the router's (u32 `[E]`),
    /// which sizes the experts under [`ExpertInput::Local`].
    pub(super) fn experts<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        recv: B::Buf,
        input: ExpertInput<'_>,
        counts: Slice<'_, B>,
    ) -> Result<(B::Buf, MoeExpertsSaved<B>)> {
        let name = "`E` layer experts";
        check_weights(b, name, &self.params, weights)?;
        let groups = match input {
            ExpertInput::Received(recv_counts) => {
                ExpertGroups::new(b, recv_counts, self.local_experts)?
            }
            ExpertInput::Local { total } => {
                check_len(name, "counts", b.slice_len(counts), self.local_experts)?;
                ExpertGroups::local(b, counts, total)?
            }
        };
        let (h, ffn, total) = (self.hidden, self.expert, groups.total());
        check_len(name, "recv", b.buf_len(&recv), total * h)?;
        let input = groups.group(b, recv, h)?;
        // Every buffer below is written whole: each GEMM overwrites its
        // experts' rows (the experts' segments cover every row), and the
        // activation covers all rows.
        let dtype = b.compute_dtype();
        let pre = b.alloc_uninit(ffn.pre_len(total), dtype)?;
        let act = b.alloc_uninit(ffn.act_len(total), dtype)?;
        let grouped = b.alloc_uninit(total * h, dtype)?;
        let (f, l, w) = (ffn.width, self.local_experts, |i| weight::<B>(weights, i));

        // fc1: one grouped GEMM over every expert (two problems per expert
        // for SwiGLU: its gate and up planes).
        let dims = MatmulDims::linear(total, h, f);
        let fc1: Vec<SegmentedGroup<'_, B>> = match ffn.unary() {
            Some(_) => vec![SegmentedMatmul::Rows {
                a: b.view(&input)?,
                b: per_expert::<B>(l, |j| w(self.fc1(j)))?,
                c: b.view_mut(&pre)?,
                dims,
            }],
            None => vec![
                SegmentedMatmul::Rows {
                    a: b.view(&input)?,
                    b: per_expert::<B>(l, |j| weight_rows(b, w(self.fc1(j))?, h, 0..f))?,
                    c: rows_of_mut(b, &pre, 0..total, f)?,
                    dims,
                },
                SegmentedMatmul::Rows {
                    a: b.view(&input)?,
                    b: per_expert::<B>(l, |j| weight_rows(b, w(self.fc1(j))?, h, f..2 * f))?,
                    c: rows_of_mut(b, &pre, total..2 * total, f)?,
                    dims,
                },
            ],
        };
        groups.rows().matmul(b, fc1)?;
        // The activation: one launch over all rows.
        ffn.activate(b, b.view(&pre)?, b.view_mut(&act)?, total)?;
        // fc2: one grouped GEMM.
        let fc2 = SegmentedMatmul::Rows {
            a: b.view(&act)?,
            b: per_expert::<B>(l, |j| w(self.fc2(j)))?,
            c: b.view_mut(&grouped)?,
            dims: MatmulDims::linear(total, f, h),
        };
        groups.rows().matmul(b, vec![fc2])?;
        let out = groups.ungroup(b, grouped, h)?;
        Ok((out, MoeExpertsSaved { groups, input, pre }))
    }

    /// Experts backward: `d_out` is the gradient of the experts' outputs in
    /// received order; returns the gradient of their inputs (received
    /// order), ready to be sent back, and what the weight step needs.
    pub fn experts_backward_input<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        saved: MoeExpertsSaved<B>,
        d_out: B::Buf,
    ) -> Result<(B::Buf, MoeExpertsWgrad<B>)> {
        let name = "`E` layer experts backward";
        check_weights(b, name, &self.params, weights)?;
        let MoeExpertsSaved { groups, input, pre } = saved;
        let (h, ffn, total) = (self.hidden, self.expert, groups.total());
        check_len(name, "d_out", b.buf_len(&d_out), total * h)?;
        let d_grouped = groups.group(b, d_out, h)?;
        let (f, l, w) = (ffn.width, self.local_experts, |i| weight::<B>(weights, i));
        let dtype = b.compute_dtype();

        // d_act = d_out W2, per expert, one grouped GEMM (written whole, as
        // is every buffer below: see `experts`).
        let d_act = b.alloc_uninit(ffn.act_len(total), dtype)?;
        let fc2 = SegmentedMatmul::Rows {
            a: b.view(&d_grouped)?,
            b: per_expert::<B>(l, |j| w(self.fc2(j)))?,
            c: b.view_mut(&d_act)?,
            dims: MatmulDims::linear_input_grad(total, f, h, false),
        };
        groups.rows().matmul(b, vec![fc2])?;
        // The activation's backward over all rows, then d_in = d_pre W1.
        // The same pass writes the fc2 weight gradient's operand, act(pre),
        // over the spent d_act (`Ffn::activate`).
        let d_pre = b.alloc_uninit(ffn.pre_len(total), dtype)?;
        // The SwiGLU path's first grouped call overwrites it, the second
        // adds to it.
        let d_in_grouped = b.alloc_uninit(total * h, dtype)?;
        match ffn.unary() {
            Some(op) => {
                b.unary_backward_recompute(
                    op,
                    b.view(&pre)?,
                    b.view_mut(&d_act)?,
                    b.view_mut(&d_pre)?,
                )?;
                let fc1 = SegmentedMatmul::Rows {
                    a: b.view(&d_pre)?,
                    b: per_expert::<B>(l, |j| w(self.fc1(j)))?,
                    c: b.view_mut(&d_in_grouped)?,
                    dims: MatmulDims::linear_input_grad(total, h, f, false),
                };
                groups.rows().matmul(b, vec![fc1])?;
            }
            None => {
                b.silu_mul_backward_recompute(
                    b.slice(&pre, 0..total * f)?,
                    b.slice(&pre, total * f..2 * total * f)?,
                    b.view_mut(&d_act)?,
                    b.slice_mut(&d_pre, 0..total * f)?,
                    b.slice_mut(&d_pre, total * f..2 * total * f)?,
                )?;
                // `d_in = d_gate W_gate`, then `d_in += d_up W_up`: two
                // grouped calls, since both write every expert's rows and
                // the up term must add onto the gate term.
                for (half, accumulate) in [(0, false), (1, true)] {
                    let planes = half * f..(half + 1) * f;
                    let fc1 = SegmentedMatmul::Rows {
                        a: rows_of(b, &d_pre, half * total..(half + 1) * total, f)?,
                        b: per_expert::<B>(l, |j| {
                            weight_rows(b, w(self.fc1(j))?, h, planes.clone())
                        })?,
                        c: b.view_mut(&d_in_grouped)?,
                        dims: MatmulDims::linear_input_grad(total, h, f, accumulate),
                    };
                    groups.rows().matmul(b, vec![fc1])?;
                }
            }
        }
        let act = d_act;
        drop(pre);
        let d_in = groups.ungroup(b, d_in_grouped, h)?;
        Ok((
            d_in,
            MoeExpertsWgrad {
                rows: groups.into_rows(),
                total,
                input,
                act,
                d_pre,
                d_out: d_grouped,
            },
        ))
    }

    /// Accumulates the local experts' weight gradients: every expert's
    /// `dW2 += d_out^T act` and `dW1 += d_pre^T input` as one grouped GEMM.
    pub fn experts_backward_weight<B: Backend>(
        &self,
        b: &B,
        g: MoeExpertsWgrad<B>,
        grads: &mut [SliceMut<'_, B>],
    ) -> Result<()> {
        check_grads(b, "`E` layer experts", &self.params, grads)?;
        let (h, f, l, total) = (self.hidden, self.expert.width, self.local_experts, g.total);
        let missing =
            || RuntimeError::InvalidArgument("`E` layer experts: gradients are missing".into());
        // The list is `[norm, router, fc1 x L, fc2 x L, ...]`.
        let (_, experts) = grads.split_at_mut_checked(2).ok_or_else(missing)?;
        let (fc1s, rest) = experts.split_at_mut_checked(l).ok_or_else(missing)?;
        let fc2s = rest.get_mut(..l).ok_or_else(missing)?;
        let mut problems: Vec<SegmentedGroup<'_, B>> = Vec::with_capacity(3);
        problems.push(SegmentedMatmul::Depth {
            a: b.view(&g.d_out)?,
            b: b.view(&g.act)?,
            c: fc2s.iter_mut().map(|dw2| b.reborrow_mut(dw2)).collect(),
            dims: MatmulDims::linear_weight_grad(total, f, h),
        });
        let x = b.view(&g.input)?;
        let dims = MatmulDims::linear_weight_grad(total, h, f);
        match self.expert.unary() {
            Some(_) => problems.push(SegmentedMatmul::Depth {
                a: b.view(&g.d_pre)?,
                b: x,
                c: fc1s.iter_mut().map(|dw1| b.reborrow_mut(dw1)).collect(),
                dims,
            }),
            None => {
                let (mut gates, mut ups) = (Vec::with_capacity(l), Vec::with_capacity(l));
                for dw1 in fc1s.iter_mut() {
                    let (gate, up) = b.split_mut(b.reborrow_mut(dw1), f * h)?;
                    gates.push(gate);
                    ups.push(up);
                }
                problems.push(SegmentedMatmul::Depth {
                    a: rows_of(b, &g.d_pre, 0..total, f)?,
                    b: x,
                    c: gates,
                    dims,
                });
                problems.push(SegmentedMatmul::Depth {
                    a: rows_of(b, &g.d_pre, total..2 * total, f)?,
                    b: x,
                    c: ups,
                    dims,
                });
            }
        }
        g.rows.matmul(b, problems)
    }
}

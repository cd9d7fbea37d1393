//! The local experts as one grouped operation. The received rows, grouped
//! expert-major ([`ExpertGroups`]), are one buffer in which each expert owns
//! a contiguous row range; every GEMM of the expert MLPs is then one
//! [`Backend::grouped_matmul`] over those ranges (fc1, fc2, and both
//! backward passes), and the activation and its backward one launch over all
//! rows. Each problem of a grouped call is the matmul the per-expert loop
//! ran, so the bits are the same.
//!
//! For SwiGLU the fc1 output of all rows is two planes,
//! `[gate: total x F | up: total x F]`, so one `silu_mul` covers every
//! expert; expert `j`'s fc1 weight rows `[0, F)` make its gate, `[F, 2F)`
//! its up projection (Megatron's `[gate | up]`).

use super::MoeLayer;
use super::permutation::ExpertGroups;
use crate::backend::{Backend, GroupedMatmul, MatmulDims, MatmulProblem, Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use crate::layers::{check_grads, check_len, check_weights, weight, weight_rows};
use std::ops::Range;

/// What [`MoeLayer::experts`] keeps.
pub struct MoeExpertsSaved<B: Backend> {
    groups: ExpertGroups<B>,
    /// The grouped input rows `[total, h]`.
    input: B::Buf,
    pre: B::Buf,
    act: B::Buf,
}

/// What [`MoeLayer::experts_backward_input`] keeps.
pub struct MoeExpertsWgrad<B: Backend> {
    /// Rows per local expert.
    rows: Vec<usize>,
    input: B::Buf,
    act: B::Buf,
    d_pre: B::Buf,
    /// The grouped output gradient `[total, h]`.
    d_out: B::Buf,
}

/// The row ranges of the experts with rows, in grouped order: `(local
/// expert, rows)`. Empty experts have no problem in a grouped call.
fn expert_ranges(rows: &[usize]) -> Vec<(usize, Range<usize>)> {
    let mut start = 0;
    let mut ranges = Vec::with_capacity(rows.len());
    for (j, &n) in rows.iter().enumerate() {
        if n > 0 {
            ranges.push((j, start..start + n));
        }
        start += n;
    }
    ranges
}

/// `rows` rows of `width` elements of a row-major buffer.
fn rows_of<'a, B: Backend>(
    b: &B,
    buf: &'a B::Buf,
    rows: &Range<usize>,
    width: usize,
) -> Result<Slice<'a, B>> {
    b.slice(buf, rows.start * width..rows.end * width)
}

fn rows_of_mut<'a, B: Backend>(
    b: &B,
    buf: &'a B::Buf,
    rows: &Range<usize>,
    width: usize,
) -> Result<SliceMut<'a, B>> {
    b.slice_mut(buf, rows.start * width..rows.end * width)
}

impl MoeLayer {
    /// The mlp slot: runs the local experts on the received rows
    /// (`recv_counts[i][j]` rows from source rank i for local expert j, in
    /// that order) and returns their outputs in received order. Takes the
    /// received rows: with one source rank they already are in grouped
    /// order and become the saved input as they are.
    pub fn experts<B: Backend>(
        &self,
        b: &B,
        weights: &[Slice<'_, B>],
        recv: B::Buf,
        recv_counts: &[Vec<usize>],
    ) -> Result<(B::Buf, MoeExpertsSaved<B>)> {
        let name = "`E` layer experts";
        check_weights(b, name, &self.params, weights)?;
        let groups = ExpertGroups::new(b, recv_counts, self.local_experts)?;
        let (h, ffn, total) = (self.hidden, self.expert, groups.total());
        check_len(name, "recv", b.buf_len(&recv), total * h)?;
        let input = groups.group(b, recv, h)?;
        // Every buffer below is written whole: each GEMM overwrites its
        // experts' rows (the experts' ranges cover every row), and the
        // activation covers all rows.
        let dtype = b.compute_dtype();
        let pre = b.alloc_uninit(ffn.pre_len(total), dtype)?;
        let act = b.alloc_uninit(ffn.act_len(total), dtype)?;
        let grouped = b.alloc_uninit(total * h, dtype)?;
        let ranges = expert_ranges(groups.rows());
        let (f, w) = (ffn.width, |i| weight::<B>(weights, i));

        // fc1: one grouped GEMM over every expert (two problems per expert
        // for SwiGLU: its gate and up planes).
        let mut fc1: Vec<GroupedMatmul<'_, B>> = Vec::with_capacity(2 * ranges.len());
        for (j, r) in &ranges {
            let x = rows_of(b, &input, r, h)?;
            let dims = MatmulDims::linear(r.len(), h, f);
            match ffn.unary() {
                Some(_) => fc1.push(MatmulProblem {
                    a: x,
                    b: w(self.fc1(*j))?,
                    c: rows_of_mut(b, &pre, r, f)?,
                    dims,
                }),
                None => {
                    let w1 = w(self.fc1(*j))?;
                    fc1.push(MatmulProblem {
                        a: x,
                        b: weight_rows(b, w1, h, 0..f)?,
                        c: rows_of_mut(b, &pre, r, f)?,
                        dims,
                    });
                    fc1.push(MatmulProblem {
                        a: x,
                        b: weight_rows(b, w1, h, f..2 * f)?,
                        c: rows_of_mut(b, &pre, &(total + r.start..total + r.end), f)?,
                        dims,
                    });
                }
            }
        }
        b.grouped_matmul(fc1)?;
        // The activation: one launch over all rows.
        match ffn.unary() {
            Some(op) => b.unary_forward(op, b.view(&pre)?, b.view_mut(&act)?)?,
            None => b.silu_mul_forward(
                b.slice(&pre, 0..total * f)?,
                b.slice(&pre, total * f..2 * total * f)?,
                b.view_mut(&act)?,
            )?,
        }
        // fc2: one grouped GEMM.
        let mut fc2: Vec<GroupedMatmul<'_, B>> = Vec::with_capacity(ranges.len());
        for (j, r) in &ranges {
            fc2.push(MatmulProblem {
                a: rows_of(b, &act, r, f)?,
                b: w(self.fc2(*j))?,
                c: rows_of_mut(b, &grouped, r, h)?,
                dims: MatmulDims::linear(r.len(), f, h),
            });
        }
        b.grouped_matmul(fc2)?;
        let out = groups.ungroup(b, grouped, h)?;
        Ok((
            out,
            MoeExpertsSaved {
                groups,
                input,
                pre,
                act,
            },
        ))
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
        let MoeExpertsSaved {
            groups,
            input,
            pre,
            act,
        } = saved;
        let (h, ffn, total) = (self.hidden, self.expert, groups.total());
        check_len(name, "d_out", b.buf_len(&d_out), total * h)?;
        let d_grouped = groups.group(b, d_out, h)?;
        let ranges = expert_ranges(groups.rows());
        let (f, w) = (ffn.width, |i| weight::<B>(weights, i));
        let dtype = b.compute_dtype();

        // d_act = d_out W2, per expert, one grouped GEMM (written whole, as
        // is every buffer below: see `experts`).
        let d_act = b.alloc_uninit(ffn.act_len(total), dtype)?;
        let mut problems: Vec<GroupedMatmul<'_, B>> = Vec::with_capacity(ranges.len());
        for (j, r) in &ranges {
            problems.push(MatmulProblem {
                a: rows_of(b, &d_grouped, r, h)?,
                b: w(self.fc2(*j))?,
                c: rows_of_mut(b, &d_act, r, f)?,
                dims: MatmulDims::linear_input_grad(r.len(), f, h, false),
            });
        }
        b.grouped_matmul(problems)?;
        // The activation's backward over all rows, then d_in = d_pre W1.
        let d_pre = b.alloc_uninit(ffn.pre_len(total), dtype)?;
        // The SwiGLU path's first grouped call overwrites it, the second
        // adds to it.
        let d_in_grouped = b.alloc_uninit(total * h, dtype)?;
        match ffn.unary() {
            Some(op) => {
                b.unary_backward(op, b.view(&pre)?, b.view(&d_act)?, b.view_mut(&d_pre)?)?;
                let mut problems: Vec<GroupedMatmul<'_, B>> = Vec::with_capacity(ranges.len());
                for (j, r) in &ranges {
                    problems.push(MatmulProblem {
                        a: rows_of(b, &d_pre, r, f)?,
                        b: w(self.fc1(*j))?,
                        c: rows_of_mut(b, &d_in_grouped, r, h)?,
                        dims: MatmulDims::linear_input_grad(r.len(), h, f, false),
                    });
                }
                b.grouped_matmul(problems)?;
            }
            None => {
                b.silu_mul_backward(
                    b.slice(&pre, 0..total * f)?,
                    b.slice(&pre, total * f..2 * total * f)?,
                    b.view(&d_act)?,
                    b.slice_mut(&d_pre, 0..total * f)?,
                    b.slice_mut(&d_pre, total * f..2 * total * f)?,
                )?;
                // `d_in = d_gate W_gate`, then `d_in += d_up W_up`: two
                // grouped calls, since both write every expert's rows and
                // the up term must add onto the gate term.
                for (half, accumulate) in [(0, false), (1, true)] {
                    let mut problems: Vec<GroupedMatmul<'_, B>> = Vec::with_capacity(ranges.len());
                    for (j, r) in &ranges {
                        let plane = half * total + r.start..half * total + r.end;
                        problems.push(MatmulProblem {
                            a: rows_of(b, &d_pre, &plane, f)?,
                            b: weight_rows(b, w(self.fc1(*j))?, h, half * f..(half + 1) * f)?,
                            c: rows_of_mut(b, &d_in_grouped, r, h)?,
                            dims: MatmulDims::linear_input_grad(r.len(), h, f, accumulate),
                        });
                    }
                    b.grouped_matmul(problems)?;
                }
            }
        }
        let d_in = groups.ungroup(b, d_in_grouped, h)?;
        Ok((
            d_in,
            MoeExpertsWgrad {
                rows: groups.rows().to_vec(),
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
        let (h, f, l) = (self.hidden, self.expert.width, self.local_experts);
        let total: usize = g.rows.iter().sum();
        let missing =
            || RuntimeError::InvalidArgument("`E` layer experts: gradients are missing".into());
        // The list is `[norm, router, fc1 x L, fc2 x L, ...]`.
        let (_, experts) = grads.split_at_mut_checked(2).ok_or_else(missing)?;
        let (fc1s, rest) = experts.split_at_mut_checked(l).ok_or_else(missing)?;
        let fc2s = rest.get_mut(..l).ok_or_else(missing)?;
        let mut problems: Vec<GroupedMatmul<'_, B>> = Vec::with_capacity(3 * l);
        let mut start = 0;
        for ((dw1, dw2), &n) in fc1s.iter_mut().zip(fc2s.iter_mut()).zip(&g.rows) {
            let r = start..start + n;
            start += n;
            if n == 0 {
                continue;
            }
            problems.push(MatmulProblem {
                a: rows_of(b, &g.d_out, &r, h)?,
                b: rows_of(b, &g.act, &r, f)?,
                c: b.reborrow_mut(dw2),
                dims: MatmulDims::linear_weight_grad(n, f, h),
            });
            let x = rows_of(b, &g.input, &r, h)?;
            match self.expert.unary() {
                Some(_) => problems.push(MatmulProblem {
                    a: rows_of(b, &g.d_pre, &r, f)?,
                    b: x,
                    c: b.reborrow_mut(dw1),
                    dims: MatmulDims::linear_weight_grad(n, h, f),
                }),
                None => {
                    let (dw_gate, dw_up) = b.split_mut(b.reborrow_mut(dw1), f * h)?;
                    problems.push(MatmulProblem {
                        a: rows_of(b, &g.d_pre, &r, f)?,
                        b: x,
                        c: dw_gate,
                        dims: MatmulDims::linear_weight_grad(n, h, f),
                    });
                    problems.push(MatmulProblem {
                        a: rows_of(b, &g.d_pre, &(total + r.start..total + r.end), f)?,
                        b: x,
                        c: dw_up,
                        dims: MatmulDims::linear_weight_grad(n, h, f),
                    });
                }
            }
        }
        b.grouped_matmul(problems)
    }
}

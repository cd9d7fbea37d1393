//! Where each routed row goes. The dispatch permutation sorts a
//! micro-batch's (token, k-slot) pairs by (global expert, token, k-slot) (a
//! stable counting sort on the device) and gathers the normed input into
//! that send order; the combine unpermutes the returned rows and sums each
//! token's k copies with their weights. After the dispatch all-to-all, the
//! received rows (ordered by source rank, then local expert) are regrouped
//! expert-major so each local expert's rows are one contiguous range.
//! Every index here is a u32 device buffer made by a kernel.

use super::MoeLayer;
use crate::backend::dense::segments_as_problems;
use crate::backend::{
    Backend, DType, ExpertOrder, ReceivedDims, SegmentedGroup, Slice, SliceMut, UnpermuteDims,
    UnpermuteGrads,
};
use crate::error::{Result, RuntimeError};
use crate::layers::{check_len, uninit};

impl MoeLayer {
    fn unpermute_dims(&self, tokens: usize) -> UnpermuteDims {
        UnpermuteDims {
            tokens,
            top_k: self.top_k,
            rows: tokens * self.top_k,
            width: self.hidden,
        }
    }

    /// The dispatch: sorts the slots of `selected` by expert (`counts` from
    /// the router) and gathers the rows of `u` into a `[T * k, h]` send
    /// buffer in that order. Returns the send buffer and `positions`
    /// (u32 `[T * k]`: the send row of each (token, k-slot)).
    pub(super) fn permute<B: Backend>(
        &self,
        b: &B,
        selected: Slice<'_, B>,
        counts: Slice<'_, B>,
        u: Slice<'_, B>,
        rows: usize,
    ) -> Result<(B::Buf, B::Buf)> {
        let (h, k) = (self.hidden, self.top_k);
        // The sort writes every entry of both (a permutation of the slots;
        // counts that do not match fail the run), so neither is zeroed.
        let positions = b.alloc_uninit(rows * k, DType::U32)?;
        let sources = b.alloc_uninit(rows * k, DType::U32)?;
        b.moe_sort_by_expert(
            selected,
            counts,
            ExpertOrder {
                positions: b.view_mut(&positions)?,
                sources: b.view_mut(&sources)?,
            },
            self.routed_slots(rows),
        )?;
        // The gather writes every send row (`sources` has one entry a row;
        // a bad one fails the run), so nothing needs zeroing first.
        let send = uninit(b, rows * k * h)?;
        b.gather_rows(u, b.view(&sources)?, b.view_mut(&send)?, h)?;
        Ok((send, positions))
    }

    /// Backward of the dispatch gather: `d_u = sum_j d_send[positions[t*k + j]]`
    /// (overwritten), each token's k rows in k-slot order.
    pub(super) fn permute_backward<B: Backend>(
        &self,
        b: &B,
        d_send: Slice<'_, B>,
        positions: Slice<'_, B>,
        d_u: SliceMut<'_, B>,
        rows: usize,
    ) -> Result<()> {
        b.moe_unpermute(d_send, None, positions, d_u, self.unpermute_dims(rows))
    }

    /// The combine into the residual stream: `x[t] += sum_j w[t, j]
    /// returned[positions[t*k + j]] + shared[t]`, `j` in order, rounded once.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn combine_into<B: Backend>(
        &self,
        b: &B,
        returned: Slice<'_, B>,
        weights: Slice<'_, B>,
        positions: Slice<'_, B>,
        shared: Option<Slice<'_, B>>,
        x: SliceMut<'_, B>,
        rows: usize,
    ) -> Result<()> {
        b.moe_combine(
            returned,
            weights,
            positions,
            shared,
            x,
            self.unpermute_dims(rows),
        )
    }

    /// Backward of [`MoeLayer::unpermute`]: the returned rows' gradient (send
    /// order) and the routing weights' gradient (f32), both overwritten.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn unpermute_backward<B: Backend>(
        &self,
        b: &B,
        d_out: Slice<'_, B>,
        returned: Slice<'_, B>,
        weights: Slice<'_, B>,
        positions: Slice<'_, B>,
        grads: UnpermuteGrads<SliceMut<'_, B>>,
        rows: usize,
    ) -> Result<()> {
        b.moe_unpermute_backward(
            d_out,
            returned,
            weights,
            positions,
            grads,
            self.unpermute_dims(rows),
        )
    }
}

/// How many rows each local expert has: what the experts' GEMMs cut their
/// rows by.
pub(super) enum ExpertRows<B: Backend> {
    /// Known on the host, from the counts exchange (expert parallelism
    /// above 1): the GEMMs take them as host dimensions.
    Host(Vec<u32>),
    /// u32 `[L]` on the device, a copy of the router's counts (expert
    /// parallelism 1: every routed row stays here, so only the total is
    /// needed on the host): the GEMMs read them on the device
    /// ([`Backend::segmented_matmul`]), and nothing waits for the host.
    Device(B::Buf),
}

impl<B: Backend> ExpertRows<B> {
    /// Runs `problems`, each cut into one segment a local expert: as one
    /// grouped call of the host's segments, or with the counts read on the
    /// device.
    pub fn matmul(&self, b: &B, problems: Vec<SegmentedGroup<'_, B>>) -> Result<()> {
        match self {
            ExpertRows::Host(rows) => b.grouped_matmul(segments_as_problems(rows, problems)?),
            ExpertRows::Device(rows) => b.segmented_matmul(b.view(rows)?, problems),
        }
    }
}

/// The rows a rank received for its local experts, grouped expert-major.
pub(super) struct ExpertGroups<B: Backend> {
    /// Rows per local expert: the row ranges of the grouped order, in order.
    rows: ExpertRows<B>,
    /// All received rows.
    total: usize,
    /// u32 `[total]`: grouped row -> received row; `None` when the received
    /// order already is the grouped one (rows from one source rank arrive
    /// expert by expert), so grouping moves nothing.
    order: Option<B::Buf>,
}

impl<B: Backend> ExpertGroups<B> {
    /// Expert parallelism 1: the `total` routed rows stay on this rank, in
    /// send order, which is grouped order; `counts` (u32 `[E]`, the
    /// router's) is copied on the device, so no host reads it.
    pub fn local(b: &B, counts: Slice<'_, B>, total: usize) -> Result<Self> {
        let rows = b.alloc_uninit(b.slice_len(counts), DType::U32)?;
        b.copy(counts, b.view_mut(&rows)?)?;
        Ok(ExpertGroups {
            rows: ExpertRows::Device(rows),
            total,
            order: None,
        })
    }

    /// From the received counts (`recv_counts[i][j]`: rows from source rank
    /// `i` for local expert `j`), which the host has from the counts
    /// exchange: it uploads the small `[ranks, L]` table (no host read) and
    /// the regroup itself runs on the device.
    pub fn new(b: &B, recv_counts: &[Vec<usize>], local_experts: usize) -> Result<Self> {
        let mut table = Vec::with_capacity(recv_counts.len() * local_experts);
        let mut rows = vec![0u32; local_experts];
        for (src, counts) in recv_counts.iter().enumerate() {
            check_len(
                "`E` layer experts",
                &format!("recv_counts[{src}]"),
                counts.len(),
                local_experts,
            )?;
            for (j, &c) in counts.iter().enumerate() {
                let overflow = || {
                    RuntimeError::InvalidArgument(format!(
                        "`E` layer experts: {c} rows from rank {src} for local expert {j} \
                         overflow the u32 row indices"
                    ))
                };
                let c = u32::try_from(c).map_err(|_| overflow())?;
                table.push(c);
                rows[j] = rows[j].checked_add(c).ok_or_else(overflow)?;
            }
        }
        let total = rows.iter().map(|&n| n as usize).sum();
        if recv_counts.len() == 1 {
            return Ok(ExpertGroups {
                rows: ExpertRows::Host(rows),
                total,
                order: None,
            });
        }
        let counts = b.alloc_uninit(table.len(), DType::U32)?;
        b.upload(&table, b.view_mut(&counts)?)?;
        let order = b.alloc_uninit(total, DType::U32)?;
        b.moe_expert_major_order(
            b.view(&counts)?,
            b.view_mut(&order)?,
            ReceivedDims {
                ranks: recv_counts.len(),
                local_experts,
            },
        )?;
        Ok(ExpertGroups {
            rows: ExpertRows::Host(rows),
            total,
            order: Some(order),
        })
    }

    /// Rows per local expert.
    pub fn rows(&self) -> &ExpertRows<B> {
        &self.rows
    }

    /// Rows per local expert, kept past the grouping.
    pub fn into_rows(self) -> ExpertRows<B> {
        self.rows
    }

    /// All received rows.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The received rows (of `width`) in grouped order: `grouped[g] =
    /// received[order[g]]`, or `received` itself when the orders agree.
    pub fn group(&self, b: &B, received: B::Buf, width: usize) -> Result<B::Buf> {
        let Some(order) = &self.order else {
            return Ok(received);
        };
        // The order is a permutation: the gather writes every row.
        let grouped = b.alloc_uninit(b.buf_len(&received), b.view(&received)?.dtype())?;
        b.gather_rows(
            b.view(&received)?,
            b.view(order)?,
            b.view_mut(&grouped)?,
            width,
        )?;
        Ok(grouped)
    }

    /// Back to received order: `received[order[g]] = grouped[g]`, or
    /// `grouped` itself when the orders agree.
    pub fn ungroup(&self, b: &B, grouped: B::Buf, width: usize) -> Result<B::Buf> {
        let Some(order) = &self.order else {
            return Ok(grouped);
        };
        // The order is a permutation: the scatter writes every row.
        let received = b.alloc_uninit(b.buf_len(&grouped), b.view(&grouped)?.dtype())?;
        b.scatter_rows(
            b.view(&grouped)?,
            b.view(order)?,
            b.view_mut(&received)?,
            width,
        )?;
        Ok(received)
    }
}

//! Gradient buffers for units' backwards, and the reduction of their
//! gradients (and the non-unit ones) into the owned shards.

use super::buffers::BucketJob;
use super::{FsdpEngine, Sharding};
use crate::backend::Backend;
use crate::collective::Collective;
use crate::device::{Buf, Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use crate::lane::{Label, Lane};
use std::sync::Arc;

impl<D: Device> FsdpEngine<D> {
    /// A zeroed gradient buffer for `unit`'s gathered buckets, and its held
    /// buffer (the step's sum so far) once its last writer is done: ready
    /// when both are.
    pub fn grad_buffer(&mut self, unit: usize, rank: &RankContext<D>) -> Result<()> {
        let held_written = self.held[unit].as_ref().and_then(|h| h.written.clone());
        if self.gathered[unit].is_empty() {
            self.units[unit].grad_ready = held_written;
            return Ok(());
        }
        let slot = self
            .grad_slots
            .iter()
            .position(|s| !s.busy)
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "all {} gradient buffers are in use taking one for unit {unit}; the schedule's dry run should have sized them",
                    self.grad_slots.len()
                ))
            })?;
        let grad_slot = &mut self.grad_slots[slot];
        grad_slot.busy = true;
        // The zeroing waits for the held buffer's last writer too, so its
        // event covers both.
        let after: Vec<_> = grad_slot
            .free_after
            .take()
            .into_iter()
            .chain(held_written)
            .collect();
        let buf = grad_slot.buf.clone();
        let zeroed = rank.compute.submit(
            Label::new(
                format!("zero grads {}", self.plan.units[unit].name),
                "reduce",
            ),
            &after,
            Box::new(move |b: &D::Backend| b.zero(b.view_mut(&buf)?)),
        );
        self.units[unit].grad_slot = Some(slot);
        self.units[unit].grad_ready = Some(zeroed);
        Ok(())
    }

    /// Reduces `unit`'s gradients of one micro-batch into the owned shards
    /// of its gathered buckets (reduce-scatter, or all-reduce under
    /// `no_shard`, then `+=`), bucket by bucket in id order, after `after`;
    /// frees the gradient buffer. Its held buckets' gradients are in their
    /// shards already: `after` (the micro-batch's last work) becomes what
    /// the next backward waits for.
    pub fn reduce(
        &mut self,
        unit: usize,
        rank: &RankContext<D>,
        after: &[EventOf<D>],
    ) -> Result<()> {
        if let Some(held) = &mut self.held[unit] {
            match after {
                [] => {}
                [last] => held.written = Some(last.clone()),
                // One event that covers them all.
                many => {
                    let joined = rank.compute.submit(
                        Label::new("gradients written", "reduce"),
                        many,
                        Box::new(|_: &D::Backend| Ok(())),
                    );
                    held.written = Some(joined);
                }
            }
        }
        if self.gathered[unit].is_empty() {
            self.units[unit].grad_ready = None;
            return Ok(());
        }
        let slot = self.units[unit].grad_slot.take().ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "unit {unit} is reduced without a gradient buffer"
            ))
        })?;
        self.units[unit].grad_ready = None;
        let buckets = self.gathered[unit].clone();
        let event = self.reduce_into_shards(
            rank,
            &buckets,
            self.grad_slots[slot].buf.clone(),
            after,
            &format!("reduce {}", self.plan.units[unit].name),
        )?;
        let grad_slot = &mut self.grad_slots[slot];
        grad_slot.busy = false;
        grad_slot.free_after = Some(event);
        Ok(())
    }

    /// Ends a step's backward: reduces the non-unit gradients, accumulated
    /// over every micro-batch, into their shards (where they already are
    /// when the non-unit buckets are sole).
    pub fn reduce_non_unit(&mut self, rank: &RankContext<D>, after: &[EventOf<D>]) -> Result<()> {
        if self.non_unit_sole {
            return Ok(());
        }
        let buckets = self.held_non_unit();
        self.reduce_into_shards(
            rank,
            &buckets,
            self.non_unit_grads.clone(),
            after,
            "reduce non-unit",
        )?;
        Ok(())
    }

    /// Adds the other holder's gradients into this rank's shards of the
    /// shared embedding's bucket (held by the first and the last stage's
    /// ranks, see `hybridgen_dsl::plan`'s pipeline rules), after `after`
    /// (every reduce of the step): each side sends its shard's sum and adds
    /// the other's, so both hold the same bits (an addition of two terms
    /// does not depend on their order) and update alike. `pipe` is the
    /// rank's pipeline group. Nothing to do without a shared bucket.
    pub fn sum_shared(
        &self,
        rank: &RankContext<D>,
        pipe: &Arc<D::Comm>,
        after: &[EventOf<D>],
    ) -> Option<EventOf<D>> {
        let plan = &self.plan;
        let jobs: Vec<_> = plan
            .buckets
            .iter()
            .filter(|b| self.holds[b.id] && plan.is_shared_bucket(b))
            .filter_map(|b| {
                let peer = plan
                    .bucket_stages(b)
                    .map(|s| plan.stages[s].pp_rank)
                    .find(|&r| r != rank.pp_rank)?;
                Some((self.shards[b.id].clone(), peer))
            })
            .collect();
        if jobs.is_empty() {
            return None;
        }
        let scratch = self.scratch.clone();
        let pipe = pipe.clone();
        Some(rank.comm.submit(
            Label::new("sum shared embedding gradients", "reduce"),
            after,
            Box::new(move |b: &D::Backend| {
                for (shard, peer) in &jobs {
                    let len = shard.grad.len();
                    pipe.send_recv(
                        Some((shard.grad.view(b)?, *peer)),
                        Some((b.slice_mut(&scratch, 0..len)?, *peer)),
                    )?;
                    b.axpy(1.0, b.slice(&scratch, 0..len)?, shard.grad.view_mut(b)?)?;
                }
                Ok(())
            }),
        ))
    }

    fn reduce_into_shards(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
        source: Arc<Buf<D>>,
        after: &[EventOf<D>],
        what: &str,
    ) -> Result<EventOf<D>> {
        let jobs = self.bucket_jobs(rank, buckets);
        let scratch = self.scratch.clone();
        let sharding = self.layout.sharding;
        Ok(rank.comm.submit(
            Label::new(what.to_string(), "reduce"),
            after,
            Box::new(move |b: &D::Backend| {
                for BucketJob {
                    shard,
                    region,
                    comm,
                } in &jobs
                {
                    let len = shard.grad.len();
                    match sharding {
                        // One rank's reduce-scatter is a copy of its whole
                        // gradient: add it straight into the shard instead
                        // (the same values, one pass less over them).
                        Sharding::Zero3 if comm.size() == 1 && region.len() == len => {
                            b.axpy(
                                1.0,
                                b.slice(&source, region.clone())?,
                                shard.grad.view_mut(b)?,
                            )?;
                        }
                        Sharding::Zero3 => {
                            let src = b.slice(&source, region.clone())?;
                            comm.reduce_scatter(src, b.slice_mut(&scratch, 0..len)?)?;
                            b.axpy(1.0, b.slice(&scratch, 0..len)?, shard.grad.view_mut(b)?)?;
                        }
                        Sharding::NoShard => {
                            comm.all_reduce(b.slice_mut(&source, region.clone())?)?;
                            let summed = b.slice(&source, region.clone())?;
                            b.axpy(1.0, summed, shard.grad.view_mut(b)?)?;
                        }
                    }
                }
                Ok(())
            }),
        ))
    }
}

//! A step's start, and units' parameters gathered into the pool (or
//! refreshed from their shards under `no_shard`) and released.

use super::buffers::{BucketJob, ParamSlot, Residency};
use super::{FsdpEngine, Sharding};
use crate::backend::Backend;
use crate::collective::Collective;
use crate::device::{Buf, Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use crate::lane::{Label, Lane};
use hybridgen_dsl::plan::LaneKind;
use std::sync::Arc;

impl<D: Device> FsdpEngine<D> {
    /// Starts a step: the optimizer changed every parameter, so pool
    /// buffers are stale (ZeRO-3) or refreshed from the master weights
    /// (`no_shard`); non-unit parameters are gathered and every gradient
    /// accumulator zeroed.
    pub fn begin_step(&mut self, rank: &RankContext<D>) -> Result<()> {
        for u in &mut self.units {
            u.ready = None;
            u.grad_ready = None;
            if self.layout.sharding == Sharding::Zero3 {
                u.slot = None;
            }
        }
        for slot in &mut self.param_slots {
            if self.layout.sharding == Sharding::Zero3 {
                slot.holder = None;
            }
        }
        // Zero the gradient accumulators: the shards with buffers of their
        // own, the units' held buffers and the non-unit buffer (which hold
        // the other shards').
        let own: Vec<_> = (0..self.shards.len())
            .filter(|&b| !self.housed[b])
            .map(|b| self.shards[b].clone())
            .collect();
        let mut whole: Vec<_> = self
            .held
            .iter()
            .flatten()
            .map(|h| h.grads.clone())
            .collect();
        whole.push(self.non_unit_grads.clone());
        let zeroed = rank.compute.submit(
            Label::new("zero gradients", "optimizer"),
            &[],
            Box::new(move |b: &D::Backend| {
                for shard in &own {
                    b.zero(shard.grad.view_mut(b)?)?;
                }
                for buf in &whole {
                    b.zero(b.view_mut(buf)?)?;
                }
                Ok(())
            }),
        );
        for held in self.held.iter_mut().flatten() {
            held.written = Some(zeroed.clone());
        }
        if self.layout.sharding == Sharding::NoShard {
            // Refresh every pooled unit's whole-bucket copy of its gathered
            // buckets from their shards (held buckets are read in place).
            for u in 0..self.units.len() {
                let Some(slot) = self.units[u].slot else {
                    continue;
                };
                let buckets = self.gathered[u].clone();
                let buf = self.param_slots[slot].buf.clone();
                let event = self.copy_params(rank, &buckets, buf, &zeroed, "refresh unit")?;
                self.units[u].ready = Some(event);
            }
        }
        let buckets = self.held_non_unit();
        let params = self.non_unit_params.clone();
        self.non_unit_ready = Some(match self.layout.sharding {
            // Sole non-unit parameters are their shards, which the last
            // step's optimizer (done: steps end synchronised) refreshed.
            _ if self.non_unit_sole => zeroed,
            Sharding::Zero3 => self.gather(rank, &buckets, params, &[zeroed], "gather non-unit")?,
            Sharding::NoShard => {
                self.copy_params(rank, &buckets, params, &zeroed, "refresh non-unit")?
            }
        });
        Ok(())
    }

    /// The comm-lane work that all-gathers `buckets` into `dest` (at their
    /// regions), after `after`.
    fn gather(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
        dest: Arc<Buf<D>>,
        after: &[EventOf<D>],
        what: &str,
    ) -> Result<EventOf<D>> {
        let jobs = self.bucket_jobs(rank, buckets);
        Ok(rank.comm.submit(
            Label::new(what.to_string(), "gather"),
            after,
            Box::new(move |b: &D::Backend| {
                for BucketJob {
                    shard,
                    region,
                    comm,
                } in &jobs
                {
                    comm.all_gather(shard.param.view(b)?, b.slice_mut(&dest, region.clone())?)?;
                }
                Ok(())
            }),
        ))
    }

    pub(super) fn bucket_jobs(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
    ) -> Vec<BucketJob<D>> {
        buckets
            .iter()
            .map(|&b| BucketJob {
                shard: self.shards[b].clone(),
                region: self.regions[b].clone(),
                comm: if self.plan.buckets[b].expert {
                    rank.edp.clone()
                } else {
                    rank.dp.clone()
                },
            })
            .collect()
    }

    /// `no_shard`: copies whole buckets from their masters into `dest`.
    fn copy_params(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
        dest: Arc<Buf<D>>,
        after: &EventOf<D>,
        what: &str,
    ) -> Result<EventOf<D>> {
        let jobs: Vec<_> = buckets
            .iter()
            .map(|&b| (self.shards[b].clone(), self.regions[b].clone()))
            .collect();
        Ok(rank.compute.submit(
            Label::new(what.to_string(), "gather"),
            std::slice::from_ref(after),
            Box::new(move |b: &D::Backend| {
                for (shard, region) in &jobs {
                    b.copy(shard.param.view(b)?, b.slice_mut(&dest, region.clone())?)?;
                }
                Ok(())
            }),
        ))
    }

    /// One more user of `unit`: gathers its gathered buckets into a free
    /// pool buffer unless they are still resident (a unit with none needs
    /// nothing).
    pub fn acquire(&mut self, unit: usize, rank: &RankContext<D>) -> Result<()> {
        self.units[unit].refs += 1;
        if self.units[unit].slot.is_some() || self.gathered[unit].is_empty() {
            return Ok(());
        }
        // Reuse the least recently released free buffer.
        let free =
            |s: &ParamSlot<D>, units: &[Residency<D>]| s.holder.is_none_or(|h| units[h].refs == 0);
        let slot = (0..self.param_slots.len())
            .filter(|&i| free(&self.param_slots[i], &self.units))
            .min_by_key(|&i| (self.param_slots[i].holder.is_some(), self.param_slots[i].released_at))
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "the unit pool ({} buffers) is exhausted gathering unit {unit}; the schedule's dry run should have sized it",
                    self.param_slots.len()
                ))
            })?;
        if let Some(previous) = self.param_slots[slot].holder.take() {
            self.units[previous].slot = None;
            self.units[previous].ready = None;
        }
        let after: Vec<_> = std::mem::take(&mut self.param_slots[slot].last_uses)
            .into_iter()
            .flatten()
            .collect();
        let buckets = self.gathered[unit].clone();
        let dest = self.param_slots[slot].buf.clone();
        let ready = self.gather(
            rank,
            &buckets,
            dest,
            &after,
            &format!("gather {}", self.plan.units[unit].name),
        )?;
        self.param_slots[slot].holder = Some(unit);
        self.units[unit].slot = Some(slot);
        self.units[unit].ready = Some(ready);
        Ok(())
    }

    /// One user of `unit` is done issuing work. The data stays until its
    /// buffer is needed for another unit.
    pub fn release(&mut self, unit: usize) {
        let u = &mut self.units[unit];
        u.refs = u.refs.saturating_sub(1);
        if u.refs == 0
            && let Some(slot) = u.slot
        {
            self.clock += 1;
            self.param_slots[slot].released_at = self.clock;
        }
    }

    /// Records work that read `unit`'s parameters, so the buffer is not
    /// overwritten before it ran.
    pub fn note_use(&mut self, unit: Option<usize>, lane: LaneKind, event: &EventOf<D>) {
        let Some(slot) = unit.and_then(|u| self.units[u].slot) else {
            return;
        };
        let index = match lane {
            LaneKind::Compute => 0,
            LaneKind::Comm => 1,
        };
        self.param_slots[slot].last_uses[index] = Some(event.clone());
    }
}

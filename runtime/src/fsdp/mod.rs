//! The FSDP engine (docs/fsdp.md): ZeRO-3 and `no_shard`, driven by
//! the plan's static bucket layout.
//!
//! Each rank keeps, per bucket, its shard of the f32 master weights, of the
//! compute-precision parameters that get all-gathered, and of the f32
//! gradients accumulated over micro-batches.
//!
//! Buffer dtypes follow Megatron's mixed precision (bf16 with its
//! default fp32 `main_grad`): what all-gathers move and layers read is in
//! the compute dtype (bf16, or f32 under `Precision::F32`); every gradient
//! buffer is f32, because gradients are accumulated over micro-batches and
//! reduce-scattered in f32 and never rounded to bf16 on the way:
//!
//! | buffer | dtype |
//! | --- | --- |
//! | shard master weights, shard gradients, reduce scratch | f32 |
//! | shard parameters (gather source), unit pool, non-unit parameters | compute |
//! | unit gradient buffers, non-unit gradients (wgrad GEMMs accumulate here) | f32 |
//!
//! A unit's full parameters exist only in a fixed pool of buffers sized by a dry run of the schedule; a
//! release is lazy (the data stays until its buffer is reused, least
//! recently released first), so a unit needed again soon is not gathered
//! twice. Non-unit buckets are gathered once per step and never released;
//! their gradients accumulate over the step and are reduced at its end.
//!
//! A bucket one rank holds whole and alone (every bucket in a world of
//! one; an expert bucket whose expert-data-parallel group is one rank, as
//! under EP 2 on 2 ranks) needs none of that: its unit's *held* buffers
//! are the shards' storage of all such buckets of the unit, so they are
//! never gathered, take no room in the pool, and the layers accumulate
//! every micro-batch's gradients straight into the shards, with nothing
//! copied, zeroed per micro-batch or reduced. A unit mixing both (an
//! `[ME]` group under EP 2: its Mamba and the MoE layer's norm, router and
//! shared expert are sharded, its routed experts held) gathers and reduces
//! only its sharded buckets. The non-unit buckets are held when all of them
//! are. On one H200 holding whole units took the benchmark's step from 245
//! to 229 ms (a gradient `axpy` and a memset per unit and micro-batch, and
//! a copy per gather).
//!
//! `no_shard` keeps every bucket whole on every rank and all-reduces
//! gradients where ZeRO-3 reduce-scatters them. Both sum over ranks in rank
//! order and accumulate over micro-batches in the same order, and the
//! optimizer is element-wise, so the two give the same bits.
//!
//! Modules: `layout` ([`ShardLayout`]: where every bucket's pieces live),
//! `buffers` (a rank's shards, the unit pool's buffers and what the layers
//! read), `init` (the engine's construction: shards, pool and initial
//! weights), `gather` (a step's start, and units' parameters gathered and
//! released), `reduce` (gradient buffers and their reduction into the
//! shards).

mod buffers;
mod gather;
mod init;
mod layout;
mod reduce;
#[cfg(test)]
mod tests;

pub use buffers::{
    BufferAccess, GradAccess, Holder, InitParams, ParamAccess, ParamPlace, ShardPart, ShardState,
    UnitBuffers,
};
pub use layout::ShardLayout;

use crate::device::{Buf, Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use buffers::{GradSlot, HeldBuckets, ParamSlot, Residency};
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::Bucket;
use std::ops::Range;
use std::sync::Arc;

/// How parameters, gradients and optimizer state are spread over ranks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Plain data parallelism: everything whole on every rank, gradients
    /// all-reduced.
    NoShard,
    /// ZeRO-3 (`optim_grads_params`): parameters, gradients and optimizer
    /// state sharded; units gathered before use and released after.
    #[default]
    Zero3,
}

/// The engine of one rank.
pub struct FsdpEngine<D: Device> {
    plan: Arc<Plan>,
    layout: ShardLayout,
    /// Per bucket id.
    shards: Vec<Arc<ShardState<D::Backend>>>,
    /// Per bucket: where its region starts inside its unit's pool buffer
    /// (or inside the non-unit buffer), and its length.
    regions: Vec<Range<usize>>,
    param_slots: Vec<ParamSlot<D>>,
    grad_slots: Vec<GradSlot<D>>,
    units: Vec<Residency<D>>,
    /// Per unit: its held buffers, when it has held buckets.
    held: Vec<Option<HeldBuckets<D>>>,
    /// Per unit: its buckets sharded over ranks (gathered and reduced).
    gathered: Vec<Vec<usize>>,
    /// Per bucket: whether its shard lives in its unit's held buffers or in
    /// the held non-unit buffers.
    housed: Vec<bool>,
    /// Per bucket: whether this rank's pipeline stages hold it (every
    /// bucket without a pipeline).
    holds: Vec<bool>,
    non_unit_params: Arc<Buf<D>>,
    non_unit_grads: Arc<Buf<D>>,
    /// Whether the non-unit buffers are the non-unit shards' storage (every
    /// non-unit bucket is sole): nothing to gather or reduce there either.
    non_unit_sole: bool,
    /// Completes when the non-unit parameters are gathered for this step.
    non_unit_ready: Option<EventOf<D>>,
    /// Reduce-scatter output before it is added to a shard (comm lane only).
    scratch: Arc<Buf<D>>,
    clock: u64,
}

impl<D: Device> FsdpEngine<D> {
    pub fn sharding(&self) -> Sharding {
        self.layout.sharding
    }

    /// Where every bucket's pieces live.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// Per bucket id, the rank's shard state (for the optimizer and
    /// checkpoints).
    pub fn shards(&self) -> &[Arc<ShardState<D::Backend>>] {
        &self.shards
    }

    /// Whether this rank holds bucket `b` (its pipeline stages' buckets;
    /// every bucket without a pipeline). The shards of the others are empty.
    pub fn holds(&self, b: usize) -> bool {
        self.holds[b]
    }

    /// The non-unit buckets this rank holds, in id order.
    fn held_non_unit(&self) -> Vec<usize> {
        self.plan
            .non_unit_buckets()
            .filter(|b| self.holds[b.id])
            .map(|b| b.id)
            .collect()
    }

    /// Ranks a bucket is sharded over under this engine's sharding.
    pub fn world_of(&self, bucket: &Bucket) -> usize {
        self.layout.group_size(&self.plan, bucket)
    }

    /// Where parameter `p` lives: which of its holder buffers, and where
    /// inside it.
    pub fn param_place(&self, p: usize) -> ParamPlace {
        let param = &self.plan.params[p];
        let start = self.regions[param.bucket].start + param.offset;
        let holder = match self.plan.buckets[param.bucket].unit {
            None => Holder::NonUnit,
            Some(_) if self.housed[param.bucket] => Holder::Held,
            Some(_) => Holder::Gathered,
        };
        ParamPlace {
            holder,
            range: start..start + self.plan.def(param).numel(),
        }
    }

    /// The non-unit parameters, gathered for this step.
    pub fn non_unit_params(&self) -> ParamAccess<D> {
        BufferAccess {
            buf: self.non_unit_params.clone(),
            ready: self.non_unit_ready.clone(),
        }
    }

    /// The non-unit gradient buffer, accumulated over the whole step.
    pub fn non_unit_grads(&self) -> GradAccess<D> {
        BufferAccess {
            buf: self.non_unit_grads.clone(),
            ready: None,
        }
    }

    /// The parameters `unit`'s work reads.
    pub fn unit_params(&self, unit: usize) -> Result<BufferAccess<D, UnitBuffers<D>>> {
        let gathered = self.unit_slot(
            unit,
            self.units[unit].slot,
            "is used without being acquired",
        )?;
        Ok(BufferAccess {
            buf: UnitBuffers {
                gathered: gathered.map(|slot| self.param_slots[slot].buf.clone()),
                held: self.held[unit].as_ref().map(|h| h.params.clone()),
            },
            // A unit with nothing to gather never has a gather to wait for.
            ready: self.units[unit].ready.clone(),
        })
    }

    /// The gradient buffers `unit`'s backward accumulates into.
    pub fn unit_grads(&self, unit: usize) -> Result<BufferAccess<D, UnitBuffers<D>>> {
        let gathered = self.unit_slot(
            unit,
            self.units[unit].grad_slot,
            "runs backward without a gradient buffer",
        )?;
        Ok(BufferAccess {
            buf: UnitBuffers {
                gathered: gathered.map(|slot| self.grad_slots[slot].buf.clone()),
                held: self.held[unit].as_ref().map(|h| h.grads.clone()),
            },
            ready: self.units[unit].grad_ready.clone(),
        })
    }

    /// `unit`'s pool slot (`slot`, of parameters or gradients) when it has
    /// gathered buckets: an error saying it `missing` when it has none.
    fn unit_slot(&self, unit: usize, slot: Option<usize>, missing: &str) -> Result<Option<usize>> {
        if self.gathered[unit].is_empty() {
            return Ok(None);
        }
        slot.map(Some).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "unit {unit} ({}) {missing}",
                self.plan.units[unit].name
            ))
        })
    }

    /// The elements of bucket `b` this rank owns, in bucket coordinates.
    pub fn owned_range(&self, b: usize, rank: &RankContext<D>) -> Range<usize> {
        self.layout
            .owned_range(&self.plan, &self.plan.buckets[b], rank.rank)
    }
}

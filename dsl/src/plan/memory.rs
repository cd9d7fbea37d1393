//! Per-rank memory of ZeRO-3 training, from the static layout: a rank
//! holding every bucket ([`Plan::memory`]), or, under pipeline
//! parallelism, the buckets of one pipeline rank's stages
//! ([`Plan::stage_memory`]).

use super::{Bucket, FsdpUnit, ParallelLayout, Plan, SHARD_ALIGN};
use serde::Serialize;
use std::ops::Range;

/// Bytes one rank holds for parameters, gradients and optimizer state under
/// ZeRO-3 (activations not included: they depend on batch and sequence).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryEstimate {
    /// Units the schedule keeps gathered at once: in the overlap schedule a
    /// forward unit and a backward unit, each with its prefetch (4); in the
    /// plain one a unit and its prefetch (2).
    pub live_units: usize,
    /// bf16 shards of every bucket.
    pub param_shards: u64,
    /// f32 master copies of the shards.
    pub master_weights: u64,
    /// f32 gradient shards (accumulated over micro-batches).
    pub grad_shards: u64,
    /// Adam's two f32 moments per shard element.
    pub optimizer_states: u64,
    /// The fixed pool of unsharded buffers: bf16 parameters of the
    /// `live_units` largest units, plus bf16 gradients of the two largest
    /// (the unit in backward and the one whose reduce-scatter is in flight).
    /// A unit's size here counts only its buckets sharded over ranks: a
    /// bucket one rank holds whole and alone (a world of one, or an expert
    /// bucket whose expert-data-parallel group is one rank) is read and
    /// accumulated in its shard, never gathered (the runtime's FSDP engine).
    pub unit_pool: u64,
    /// Non-unit buckets, gathered once per step and never released: bf16
    /// parameters and gradients; none when every one of them is held whole
    /// by one rank (their shards are then the buffers).
    pub non_unit: u64,
    pub total: u64,
}

impl MemoryEstimate {
    /// The estimate for each of `live_units` (one pass over the buckets
    /// serves them all).
    pub(crate) fn of<const N: usize>(
        units: &[FsdpUnit],
        buckets: &[Bucket],
        layout: &ParallelLayout,
        live_units: [usize; N],
    ) -> [MemoryEstimate; N] {
        Self::of_held(units, buckets, layout, live_units, |_| true)
    }

    /// [`MemoryEstimate::of`] for a rank that holds only the buckets `held`
    /// says it does: the others take no shard, no room in the pool and no
    /// non-unit buffer (the runtime's FSDP engine under pipeline
    /// parallelism).
    fn of_held<const N: usize>(
        units: &[FsdpUnit],
        buckets: &[Bucket],
        layout: &ParallelLayout,
        live_units: [usize; N],
        held: impl Fn(&Bucket) -> bool,
    ) -> [MemoryEstimate; N] {
        let world = |b: &Bucket| {
            if b.expert {
                layout.expert_dp()
            } else {
                layout.dp.max(1)
            }
        };
        let mut shard_elems = 0u64;
        let mut non_unit_elems = 0u64;
        let mut non_unit_held = true;
        // Per bucket: its padded length where it is gathered, 0 where held.
        let mut gathered = Vec::with_capacity(buckets.len());
        for bucket in buckets {
            if !held(bucket) {
                gathered.push(0);
                continue;
            }
            // One division: the padded length is `blocks * world * 128` and
            // each rank's shard `blocks * 128`.
            let world = world(bucket) as u64;
            let blocks = (bucket.end as u64).div_ceil(world * SHARD_ALIGN as u64);
            let elems = blocks * world * SHARD_ALIGN as u64;
            gathered.push(if world > 1 { elems } else { 0 });
            shard_elems += blocks * SHARD_ALIGN as u64;
            if bucket.unit.is_none() {
                non_unit_elems += elems;
                non_unit_held &= world == 1;
            }
        }
        if non_unit_held {
            non_unit_elems = 0;
        }
        // The sizes of the largest units, largest first: one pass that keeps
        // a short sorted list, not a sort of every unit.
        let keep = live_units.into_iter().max().unwrap_or(0).max(2);
        let mut top: Vec<u64> = Vec::with_capacity(keep + 1);
        for unit in units {
            let elems: u64 = unit.buckets.iter().map(|&b| gathered[b]).sum();
            if top.len() == keep && top.last().is_some_and(|&smallest| smallest >= elems) {
                continue;
            }
            let at = top.partition_point(|&e| e >= elems);
            top.insert(at, elems);
            top.truncate(keep);
        }
        let largest = |n: usize| top.iter().take(n).sum::<u64>();
        live_units.map(|live_units| {
            let param_shards = 2 * shard_elems;
            let master_weights = 4 * shard_elems;
            let grad_shards = 4 * shard_elems;
            let optimizer_states = 8 * shard_elems;
            let unit_pool = 2 * largest(live_units) + 2 * largest(2);
            let non_unit = 2 * 2 * non_unit_elems;
            MemoryEstimate {
                live_units,
                param_shards,
                master_weights,
                grad_shards,
                optimizer_states,
                unit_pool,
                non_unit,
                total: param_shards
                    + master_weights
                    + grad_shards
                    + optimizer_states
                    + unit_pool
                    + non_unit,
            }
        })
    }
}

/// What one pipeline rank holds and what that takes under ZeRO-3
/// ([`Plan::stage_memory`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StageMemory {
    pub pp_rank: usize,
    /// Its stages (indices into [`Plan::stages`]), in model order.
    pub stages: Vec<usize>,
    /// The physical decoder layers of those stages, one range a stage.
    pub layers: Vec<Range<usize>>,
    /// Whether it runs the embedding (the first stage's rank).
    pub embedding: bool,
    /// Whether it runs the final norm, the output layer and the MTP
    /// depths (the last stage's rank).
    pub heads: bool,
    /// Parameters in the buckets it holds (the shared embedding counted on
    /// both its ranks).
    pub params: u64,
    /// Under the overlap schedule.
    pub memory: MemoryEstimate,
    /// Under the plain schedule.
    pub memory_plain: MemoryEstimate,
}

impl Plan {
    /// Per pipeline rank, in rank order: the buckets of its stages
    /// ([`Plan::holds`], the shared embedding on both the first and the last
    /// stage's rank) as [`Plan::memory`] counts a rank's. Without a
    /// pipeline, one entry, the same figures as [`Plan::memory`] and
    /// [`Plan::memory_plain`].
    pub fn stage_memory(&self) -> Vec<StageMemory> {
        let (first, last) = (self.first_stage(), self.last_stage());
        let rank_of = |s: usize| self.stages.get(s).map_or(0, |st| st.pp_rank);
        (0..self.layout.pp.max(1))
            .map(|pp_rank| {
                let held = |b: &Bucket| self.holds(pp_rank, b);
                let [memory, memory_plain] =
                    MemoryEstimate::of_held(&self.units, &self.buckets, &self.layout, [4, 2], held);
                let stages: Vec<usize> = (0..self.stages.len())
                    .filter(|&s| self.stages[s].pp_rank == pp_rank)
                    .collect();
                StageMemory {
                    pp_rank,
                    layers: stages
                        .iter()
                        .map(|&s| self.stages[s].layers.clone())
                        .collect(),
                    stages,
                    embedding: rank_of(first) == pp_rank,
                    heads: rank_of(last) == pp_rank,
                    params: self
                        .buckets
                        .iter()
                        .filter(|b| held(b))
                        .map(|b| b.numel as u64)
                        .sum(),
                    memory,
                    memory_plain,
                }
            })
            .collect()
    }
}

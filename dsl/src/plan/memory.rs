//! Per-rank memory of ZeRO-3 training, from the static layout.

use super::{Bucket, FsdpUnit, ParallelLayout, SHARD_ALIGN};
use serde::Serialize;

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

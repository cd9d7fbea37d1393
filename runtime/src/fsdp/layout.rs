//! Where every bucket's pieces live, on every rank.

use super::Sharding;
#[cfg(doc)]
use crate::device::RankContext;
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::Bucket;
use std::ops::Range;

/// Where the pieces of every bucket live: the one rule the engine, the
/// optimizer's norm, checkpoints and the parameter hash all follow. Ranks are
/// laid out as [`RankContext`] says: EP rank `r % ep`, EDP rank `r / ep`.
/// `world` and `ep` are a checked layout's (a plan's: [`ShardLayout::of`]):
/// `ep` is at least 1 and divides `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub sharding: Sharding,
    /// Data-parallel ranks.
    pub world: usize,
    pub ep: usize,
}

impl ShardLayout {
    /// The layout of `plan`'s ranks (its checked [`hybridgen_dsl::ParallelLayout`])
    /// under `sharding`.
    pub fn of(plan: &Plan, sharding: Sharding) -> Self {
        ShardLayout {
            sharding,
            world: plan.layout.dp,
            ep: plan.layout.ep,
        }
    }

    /// Ranks one copy of `bucket` is cut into (1: kept whole).
    pub fn group_size(&self, plan: &Plan, bucket: &Bucket) -> usize {
        match self.sharding {
            Sharding::NoShard => 1,
            Sharding::Zero3 => plan.bucket_world(bucket),
        }
    }

    /// Which piece of its bucket world rank `r` holds.
    pub fn group_rank(&self, expert: bool, r: usize) -> usize {
        match self.sharding {
            Sharding::NoShard => 0,
            Sharding::Zero3 if expert => r / self.ep,
            Sharding::Zero3 => r,
        }
    }

    /// The world ranks whose pieces, in order, make up the copy of a bucket
    /// that EP rank `e` holds (expert buckets differ per EP rank; dense ones
    /// do not, pass `e = 0`). Under `no_shard` that is one rank, the first
    /// holding it whole.
    pub fn holders(&self, expert: bool, e: usize) -> Vec<usize> {
        let ep = self.ep;
        match (self.sharding, expert) {
            (Sharding::NoShard, false) => vec![0],
            (Sharding::NoShard, true) => vec![e],
            (Sharding::Zero3, false) => (0..self.world).collect(),
            (Sharding::Zero3, true) => (0..self.world / ep).map(|q| q * ep + e).collect(),
        }
    }

    /// Whether one rank alone holds `bucket` (whole) and sums its
    /// gradients: no other rank has a piece or a copy of it (a world of
    /// one, or an expert bucket whose expert-data-parallel group is one
    /// rank). Nothing of it is ever gathered or reduced.
    pub fn sole(&self, plan: &Plan, bucket: &Bucket) -> bool {
        plan.bucket_world(bucket) == 1
    }

    /// Whether `unit` has a bucket that is not [`ShardLayout::sole`]: one
    /// it gathers before use (into the pool) and reduces after.
    pub fn gathers_unit(&self, plan: &Plan, unit: usize) -> bool {
        plan.units[unit]
            .buckets
            .iter()
            .any(|&b| !self.sole(plan, &plan.buckets[b]))
    }

    /// Whether every non-unit bucket is [`ShardLayout::sole`].
    pub fn sole_non_unit(&self, plan: &Plan) -> bool {
        plan.non_unit_buckets().all(|b| self.sole(plan, b))
    }

    /// The elements of `bucket` world rank `r` holds, in bucket coordinates.
    pub fn owned_range(&self, plan: &Plan, bucket: &Bucket, r: usize) -> Range<usize> {
        bucket.shard_range(
            self.group_size(plan, bucket),
            self.group_rank(bucket.expert, r),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

    /// For every sharding and layout: each copy of a bucket is made of its
    /// holders' pieces, which tile `[0, padded)` in order, and every rank
    /// holds exactly one piece of every copy it belongs to.
    #[test]
    fn holders_pieces_tile_every_bucket() {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = "M[*E]-".into();
        for (world, ep) in [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4)] {
            let options = PlanOptions {
                layout: ParallelLayout::new(world, ep),
                ..PlanOptions::default()
            };
            let plan = Plan::new(&model, &options).unwrap();
            for sharding in [Sharding::NoShard, Sharding::Zero3] {
                let layout = ShardLayout {
                    sharding,
                    world,
                    ep,
                };
                for bucket in plan.buckets.iter() {
                    let padded = bucket.padded_numel(layout.group_size(&plan, bucket));
                    let copies = if bucket.expert { ep } else { 1 };
                    for e in 0..copies {
                        let mut at = 0;
                        for r in layout.holders(bucket.expert, e) {
                            if bucket.expert {
                                assert_eq!(r % ep, e, "rank {r} holds EP rank {e}'s experts");
                            }
                            let piece = layout.owned_range(&plan, bucket, r);
                            assert_eq!(
                                piece.start, at,
                                "{sharding:?} world {world} ep {ep} bucket {}",
                                bucket.id
                            );
                            at = piece.end;
                        }
                        assert_eq!(at, padded);
                    }
                }
            }
        }
    }
}

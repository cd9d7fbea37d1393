//! Where a plan's work and parameters live under pipeline parallelism.
//!
//! The planner cuts the decoder into stages ([`Stage`], H020-H022); this
//! module answers the questions the runtime asks of that cut: which stage
//! runs a schedule node, which stages hold a bucket, and the chain of
//! stages an activation passes through. The rules:
//!
//! - A decoder node runs on the stage holding its logical layer. The
//!   embedding runs with the first decoder node; the final norm, the output
//!   layer and every MTP depth with the last decoder node (Megatron puts
//!   them on the first and last pipeline stage; a stage with no layers,
//!   from an empty `|` segment, runs nothing).
//! - Buckets do not cross pipeline ranks: the planner closes a non-unit
//!   bucket where the pipeline rank changes, so a bucket's parameters all
//!   live on one rank, except one: the embedding table, when the last
//!   stage's rank needs it too (tied output weights, or MTP depths looking
//!   up their tokens). It is then a bucket of its own, held by the first
//!   and the last stage's ranks, and its gradients are summed across the
//!   two before the update, as Megatron's embedding group does.
//! - The chain is the stages that run anything, in model order; an
//!   activation goes from each to the next, its gradient back.

use super::Plan;
use super::schedule::ScheduleNode;
use crate::plan::{Bucket, Owner};
use std::ops::Range;

impl Plan {
    /// The stage (index into [`Plan::stages`]) that runs schedule node
    /// `node`.
    pub fn node_stage(&self, node: &ScheduleNode) -> usize {
        if node.mtp_depth.is_some() {
            return self.last_stage();
        }
        match node.logical {
            Some(l) => self.logical_stage(l),
            None => 0,
        }
    }

    fn logical_stage(&self, logical: usize) -> usize {
        self.logical_layers
            .get(logical)
            .and_then(|item| self.layers.get(item.layers.start))
            .map_or(0, |layer| layer.stage)
    }

    /// The stage running the first decoder node: the embedding's.
    pub fn first_stage(&self) -> usize {
        self.schedule
            .nodes
            .first()
            .map_or(0, |node| self.node_stage(node))
    }

    /// The stage running the last decoder node: the final norm's, the
    /// output layer's and the MTP depths'.
    pub fn last_stage(&self) -> usize {
        self.logical_layers
            .len()
            .checked_sub(1)
            .map_or(0, |l| self.logical_stage(l))
    }

    /// Whether the last stage needs the embedding table as well as the
    /// first (see the module doc).
    pub fn shares_embedding(&self) -> bool {
        let rank = |s: usize| self.stages.get(s).map_or(0, |st| st.pp_rank);
        rank(self.first_stage()) != rank(self.last_stage())
            && (self.model.tie_embeddings || self.mtp_depths() > 0)
    }

    /// The stage an owner's parameters live on (the first, for a shared
    /// embedding; [`Plan::bucket_stages`] gives both).
    pub fn owner_stage(&self, owner: Owner) -> usize {
        match owner {
            Owner::Embedding => self.first_stage(),
            Owner::Layer(crate::plan::LayerRef::Decoder(i)) => {
                self.layers.get(i).map_or(0, |layer| layer.stage)
            }
            Owner::Layer(crate::plan::LayerRef::Mtp { .. })
            | Owner::FinalNorm
            | Owner::MtpBlock(_)
            | Owner::OutputLayer => self.last_stage(),
        }
    }

    /// The stages holding `bucket`: its parameters' stage, and the last
    /// stage too for the shared embedding's bucket (when the two are on
    /// different pipeline ranks).
    pub fn bucket_stages(&self, bucket: &Bucket) -> impl Iterator<Item = usize> + '_ {
        let owner = bucket.params.first().map(|&p| self.params[p].owner);
        let first = owner.map_or(0, |o| self.owner_stage(o));
        let shared = owner == Some(Owner::Embedding) && self.shares_embedding();
        std::iter::once(first).chain(shared.then(|| self.last_stage()))
    }

    /// The pipeline rank of `bucket`'s first holder: the one rank that
    /// counts, hashes and writes it (the shared embedding's bucket is held
    /// by two).
    pub fn bucket_owner(&self, bucket: &Bucket) -> usize {
        let stage = self.bucket_stages(bucket).next().unwrap_or(0);
        self.stages.get(stage).map_or(0, |s| s.pp_rank)
    }

    /// Whether pipeline rank `pp_rank` holds `bucket`.
    pub fn holds(&self, pp_rank: usize, bucket: &Bucket) -> bool {
        self.bucket_stages(bucket)
            .any(|s| self.stages.get(s).map_or(0, |stage| stage.pp_rank) == pp_rank)
    }

    /// Whether `bucket` is the embedding's, held by the first and the last
    /// stage with its gradients summed across the two.
    pub fn is_shared_bucket(&self, bucket: &Bucket) -> bool {
        self.bucket_stages(bucket).nth(1).is_some()
    }

    /// The schedule nodes each stage runs: a contiguous range per stage
    /// (empty for a stage with no layers), in node order.
    pub fn stage_nodes(&self) -> Vec<Range<usize>> {
        let mut out = vec![0..0; self.stages.len().max(1)];
        for (i, node) in self.schedule.nodes.iter().enumerate() {
            let range = &mut out[self.node_stage(node)];
            if range.start == range.end {
                *range = i..i + 1;
            } else {
                range.end = i + 1;
            }
        }
        out
    }

    /// The stages that run anything, in model order: the path of an
    /// activation from the embedding to the heads.
    pub fn stage_chain(&self) -> Vec<usize> {
        self.stage_nodes()
            .iter()
            .enumerate()
            .filter(|(_, nodes)| !nodes.is_empty())
            .map(|(s, _)| s)
            .collect()
    }
}

//! The optimizer on shards: AdamW or SGD on each rank's f32 master shards,
//! with gradient clipping by the global norm.
//!
//! The global norm does not depend on how buckets are sharded. Every bucket
//! is cut into fixed pieces, its ZeRO-3 shards (`Bucket::shard_range` for
//! the bucket's ZeRO-3 group), and under both ZeRO-3 and `no_shard` rank
//! `r` computes the f64 sum of squares of the piece it would own under
//! ZeRO-3: its own shard, or that piece of the whole bucket it holds (the
//! part past its buffer is padding, zero either way). One kernel per bucket
//! writes each rank's partial into one device buffer, read once; the host
//! all-gathers one value per bucket and rank and sums them in one canonical
//! order (buckets by id, pieces in order, expert buckets once per EP rank).
//! ZeRO-3 and `no_shard` therefore clip by the same bits on the CPU, which
//! the parity tests need (on GPUs, where the two reduce gradients through
//! different collectives, equal gradients and so equal norms become a
//! tolerance).
//!
//! The update is one launch per bucket: AdamW (or SGD) over the whole
//! shard, with weight decay on the matrices' element ranges (an u32 device
//! buffer made once) and the clipping factor folded in as a gradient scale,
//! then one cast of the master shard to the compute-precision parameters.
//! Alignment gaps and padding ride along: zero parameters with zero
//! gradients stay zero under both optimizers.

use crate::backend::{AdamMoments, AdamStep, Backend, SgdStep};
use crate::collective::Collective;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::{FsdpEngine, ShardLayout, Sharding};
use crate::lane::{Event, Label, Lane};
use crate::view::DType;
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::Bucket;
use std::ops::Range;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    Adam,
    Sgd,
}

/// Optimizer hyper-parameters.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerConfig {
    pub kind: OptimizerKind,
    /// Peak learning rate.
    pub lr: f32,
    /// Steps of linear warm-up from 0 to `lr`.
    pub warmup_steps: u64,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay, applied to matrices only: norms, biases and
    /// other 1-D parameters are not decayed (Megatron's default rule).
    pub weight_decay: f32,
    /// SGD momentum (0 for plain SGD).
    pub momentum: f32,
    /// Clip gradients to this global L2 norm; `None` disables clipping.
    pub clip_grad: Option<f32>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Adam,
            lr: 3e-3,
            warmup_steps: 0,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            clip_grad: Some(1.0),
        }
    }
}

impl OptimizerConfig {
    /// Refuses hyper-parameters that cannot train.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(RuntimeError::Unsupported(what));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "learning rate {} must be a positive number",
                self.lr
            ));
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad(format!(
                "Adam betas ({}, {}) must lie in [0, 1)",
                self.beta1, self.beta2
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("Adam eps {} must be positive", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay {} must be 0 or positive",
                self.weight_decay
            ));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(format!("SGD momentum {} must lie in [0, 1)", self.momentum));
        }
        if let Some(c) = self.clip_grad
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!("gradient clip {c} must be positive (or off)"));
        }
        Ok(())
    }

    /// The learning rate at 1-based step `step`.
    pub fn lr_at(&self, step: u64) -> f32 {
        if self.warmup_steps == 0 || step >= self.warmup_steps {
            self.lr
        } else {
            self.lr * step as f32 / self.warmup_steps as f32
        }
    }
}

/// Optimizer state of one bucket's shard.
pub struct MomentState<B: Backend> {
    /// Adam's first moment, or SGD's momentum buffer.
    pub exp_avg: B::Buf,
    /// Adam's second moment (empty for SGD).
    pub exp_avg_sq: B::Buf,
}

/// What the optimizer keeps per bucket besides the moments.
struct BucketLayout<B: Backend> {
    /// u32 `[start, end)` pairs of the shard's elements that are decayed
    /// (matrices), ascending.
    decayed: B::Buf,
    /// The elements of the shard whose squares make this rank's partial of
    /// the norm (its ZeRO-3 piece, clipped to the shard).
    norm_piece: Range<usize>,
}

/// The optimizer of one rank.
pub struct Optimizer<D: Device> {
    config: OptimizerConfig,
    plan: Arc<Plan>,
    /// Steps taken (the next is `steps + 1`).
    steps: u64,
    states: Vec<Arc<MomentState<D::Backend>>>,
    buckets: Arc<Vec<BucketLayout<D::Backend>>>,
    /// f64, one per bucket: this rank's norm partials of the step.
    norm_partials: Arc<<D::Backend as Backend>::Buf>,
}

/// The ZeRO-3 layout of `layout`'s ranks: where the norm's pieces are,
/// whatever the run's sharding.
fn norm_pieces(layout: ShardLayout) -> ShardLayout {
    ShardLayout {
        sharding: Sharding::Zero3,
        ..layout
    }
}

/// The elements of rank `r`'s shard of `bucket` (under `layout`) whose
/// squares make its partial of the norm: its ZeRO-3 piece of the bucket, in
/// shard coordinates, clipped to the shard (what lies past a `no_shard`
/// buffer's end is padding).
fn norm_piece(plan: &Plan, layout: ShardLayout, bucket: &Bucket, r: usize) -> Range<usize> {
    let owned = layout.owned_range(plan, bucket, r);
    let piece = norm_pieces(layout).owned_range(plan, bucket, r);
    let start = piece.start.clamp(owned.start, owned.end);
    let end = piece.end.clamp(owned.start, owned.end);
    start - owned.start..end - owned.start
}

/// The elements of the shard `owned` (bucket coordinates) that weight decay
/// applies to, as u32 `[start, end)` pairs in shard coordinates: the
/// matrices (Megatron's rule; norms, biases and other 1-D parameters are
/// not decayed).
fn decayed_ranges(plan: &Plan, bucket: &Bucket, owned: Range<usize>) -> Result<Vec<u32>> {
    let mut ranges = Vec::new();
    for &p in bucket.params.iter() {
        let param = &plan.params[p];
        let def = plan.def(param);
        let start = param.offset.max(owned.start);
        let end = (param.offset + def.numel()).min(owned.end);
        if start < end && def.shape.len() > 1 {
            for at in [start - owned.start, end - owned.start] {
                ranges.push(u32::try_from(at).map_err(|_| {
                    RuntimeError::Unsupported(format!(
                        "bucket {} has a shard of {} elements; the optimizer indexes shards \
                         with 32 bits",
                        bucket.id,
                        owned.len()
                    ))
                })?);
            }
        }
    }
    Ok(ranges)
}

impl<D: Device> Optimizer<D> {
    pub fn new(
        config: OptimizerConfig,
        plan: Arc<Plan>,
        engine: &FsdpEngine<D>,
        rank: &RankContext<D>,
    ) -> Result<Self> {
        config.validate()?;
        let backend = &rank.backend;
        let mut states = Vec::new();
        let mut buckets = Vec::new();
        for bucket in plan.buckets.iter() {
            let owned = engine.owned_range(bucket.id, rank);
            let len = owned.len();
            let second = if config.kind == OptimizerKind::Adam {
                len
            } else {
                0
            };
            states.push(Arc::new(MomentState {
                exp_avg: backend.alloc(len, DType::F32)?,
                exp_avg_sq: backend.alloc(second, DType::F32)?,
            }));
            let decayed = decayed_ranges(&plan, bucket, owned)?;
            let ranges = backend.alloc(decayed.len(), DType::U32)?;
            backend.upload(&decayed, backend.view_mut(&ranges)?)?;
            buckets.push(BucketLayout {
                decayed: ranges,
                norm_piece: norm_piece(&plan, engine.layout(), bucket, rank.rank),
            });
        }
        Ok(Optimizer {
            config,
            norm_partials: Arc::new(backend.alloc(plan.buckets.len(), DType::F64)?),
            plan,
            steps: 0,
            states,
            buckets: Arc::new(buckets),
        })
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Resumes the step count (from a checkpoint).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Per bucket, the moment buffers (for checkpoints).
    pub fn states(&self) -> &[Arc<MomentState<D::Backend>>] {
        &self.states
    }

    /// This rank's partials of the squared gradient norm, one per bucket in
    /// id order (see the module doc), computed on the compute lane and read
    /// once. Call after the step's reduces ran.
    pub fn norm_partials(&self, engine: &FsdpEngine<D>, rank: &RankContext<D>) -> Result<Vec<f64>> {
        let shards = engine.shards().to_vec();
        let buckets = self.buckets.clone();
        let out = self.norm_partials.clone();
        let done = rank.compute.submit(
            Label::new("gradient norm partials", "optimizer"),
            &[],
            Box::new(move |b: &D::Backend| {
                b.zero(b.view_mut(&out)?)?;
                for (i, (shard, bucket)) in shards.iter().zip(buckets.iter()).enumerate() {
                    let piece = bucket.norm_piece.clone();
                    if piece.is_empty() {
                        continue;
                    }
                    let len = piece.len();
                    b.sum_squares(
                        b.slice(&shard.grad, piece)?,
                        len,
                        b.slice_mut(&out, i..i + 1)?,
                    )?;
                }
                Ok(())
            }),
        );
        done.wait()?;
        let mut partials = vec![0.0f64; self.plan.buckets.len()];
        rank.backend
            .download(rank.backend.view(&self.norm_partials)?, &mut partials)?;
        Ok(partials)
    }

    /// The global L2 norm of the accumulated gradients, identical on every
    /// rank and under every sharding. Call after the step's reduces ran.
    pub fn grad_norm(&self, engine: &FsdpEngine<D>, rank: &RankContext<D>) -> Result<f64> {
        let mine = self.norm_partials(engine, rank)?;
        let all = rank.host.all_gather_host(&mine)?;
        let pieces = norm_pieces(engine.layout());
        let buckets = self.plan.buckets.len();
        let mut total = 0.0f64;
        for bucket in self.plan.buckets.iter() {
            let copies = if bucket.expert { rank.ep.max(1) } else { 1 };
            for e in 0..copies {
                for r in pieces.holders(bucket.expert, e) {
                    let partial = all
                        .get(r)
                        .filter(|v| v.len() == buckets)
                        .map(|v| v[bucket.id])
                        .ok_or_else(|| RuntimeError::Peer {
                            rank: r,
                            message: "sent gradient-norm partials of the wrong length".into(),
                        })?;
                    total += partial;
                }
            }
        }
        Ok(total.sqrt())
    }

    /// Clips (when configured) and takes one step on every shard, then
    /// refreshes the compute-precision copies. Returns the gradient norm
    /// before clipping.
    pub fn step(&mut self, engine: &FsdpEngine<D>, rank: &RankContext<D>) -> Result<f64> {
        let norm = self.grad_norm(engine, rank)?;
        if !norm.is_finite() {
            return Err(RuntimeError::Numeric(format!(
                "the gradient norm is {norm} at step {}: the loss diverged; lower the learning rate or enable clipping",
                self.steps + 1
            )));
        }
        // Clipping multiplies every gradient by this before the update
        // (exactly what scaling the gradient buffers first did).
        let grad_scale = match self.config.clip_grad {
            Some(max) if norm > f64::from(max) => (f64::from(max) / (norm + 1e-6)) as f32,
            _ => 1.0,
        };
        self.steps += 1;
        let lr = self.config.lr_at(self.steps);
        let config = self.config.clone();
        let step = self.steps;
        let shards = engine.shards().to_vec();
        let states = self.states.clone();
        let buckets = self.buckets.clone();
        let done = rank.compute.submit(
            Label::new(format!("optimizer step {step}"), "optimizer"),
            &[],
            Box::new(move |backend: &D::Backend| {
                for ((shard, state), bucket) in shards.iter().zip(&states).zip(buckets.iter()) {
                    let param = backend.view_mut(&shard.master)?;
                    let grad = backend.view(&shard.grad)?;
                    let decayed = backend.view(&bucket.decayed)?;
                    match config.kind {
                        OptimizerKind::Adam => backend.adam_update(
                            param,
                            grad,
                            AdamMoments {
                                m: backend.view_mut(&state.exp_avg)?,
                                v: backend.view_mut(&state.exp_avg_sq)?,
                            },
                            decayed,
                            AdamStep {
                                lr,
                                beta1: config.beta1,
                                beta2: config.beta2,
                                eps: config.eps,
                                weight_decay: config.weight_decay,
                                grad_scale,
                                step,
                            },
                        )?,
                        OptimizerKind::Sgd => {
                            let momentum = if config.momentum != 0.0 {
                                Some(backend.view_mut(&state.exp_avg)?)
                            } else {
                                None
                            };
                            backend.sgd_update(
                                param,
                                grad,
                                momentum,
                                decayed,
                                SgdStep {
                                    lr,
                                    momentum: config.momentum,
                                    weight_decay: config.weight_decay,
                                    grad_scale,
                                },
                            )?
                        }
                    }
                    backend.cast(
                        backend.view(&shard.master)?,
                        backend.view_mut(&shard.param)?,
                    )?;
                }
                Ok(())
            }),
        );
        done.wait()?;
        Ok(norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

    fn plan(pattern: &str, ranks: usize, ep: usize) -> Plan {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = pattern.to_string();
        let options = PlanOptions {
            layout: ParallelLayout::new(ranks, ep),
            ..PlanOptions::default()
        };
        Plan::new(&model, &options).unwrap()
    }

    /// Every rank's norm partial covers the same elements of the bucket
    /// under ZeRO-3 and `no_shard`, and the partials the canonical sum reads
    /// cover each EP copy of every bucket exactly once.
    #[test]
    fn norm_pieces_are_the_zero3_shards_under_every_sharding() {
        for (ranks, ep) in [(2, 1), (2, 2), (4, 2)] {
            let plan = plan("[M*E][*E]-", ranks, ep);
            let layout = |sharding| ShardLayout {
                sharding,
                world: ranks,
                ep,
            };
            let (zero3, no_shard) = (layout(Sharding::Zero3), layout(Sharding::NoShard));
            for bucket in plan.buckets.iter() {
                for r in 0..ranks {
                    // In bucket coordinates.
                    let at = |l: ShardLayout| {
                        let start = l.owned_range(&plan, bucket, r).start;
                        let piece = norm_piece(&plan, l, bucket, r);
                        start + piece.start..start + piece.end
                    };
                    let (a, b) = (at(zero3), at(no_shard));
                    assert_eq!(a, zero3.owned_range(&plan, bucket, r));
                    // `no_shard` holds the whole bucket padded to 128 only:
                    // what lies past it is padding.
                    let whole = no_shard.owned_range(&plan, bucket, r).end;
                    assert_eq!(
                        b,
                        a.start.min(whole)..a.end.min(whole),
                        "bucket {}",
                        bucket.id
                    );
                }
                for e in 0..if bucket.expert { ep } else { 1 } {
                    let mut covered = 0;
                    for r in zero3.holders(bucket.expert, e) {
                        let piece = zero3.owned_range(&plan, bucket, r);
                        assert_eq!(piece.start, covered, "pieces in order");
                        covered = piece.end;
                    }
                    assert_eq!(covered, bucket.padded_numel(plan.bucket_world(bucket)));
                }
            }
        }
    }

    #[test]
    fn weight_decay_covers_the_matrices_and_nothing_else() {
        let plan = plan("[M*E]-", 2, 2);
        let layout = ShardLayout {
            sharding: Sharding::Zero3,
            world: 2,
            ep: 2,
        };
        let mut decayed_matrices = 0;
        for bucket in plan.buckets.iter() {
            let mut decayed = 0;
            // One copy of the bucket (an expert bucket has one per EP rank).
            for r in layout.holders(bucket.expert, 0) {
                let owned = layout.owned_range(&plan, bucket, r);
                let ranges = decayed_ranges(&plan, bucket, owned.clone()).unwrap();
                let mut at = 0;
                for pair in ranges.chunks(2) {
                    let (start, end) = (
                        pair[0] as usize + owned.start,
                        pair[1] as usize + owned.start,
                    );
                    assert!(at <= start && start < end, "ascending, disjoint, non-empty");
                    at = end;
                    decayed += end - start;
                    // Inside one matrix.
                    let p = bucket
                        .params
                        .iter()
                        .map(|&p| &plan.params[p])
                        .find(|p| p.offset <= start && end <= p.offset + plan.def(p).numel())
                        .expect("a range inside one parameter");
                    assert!(plan.def(p).shape.len() > 1, "{}", plan.param_name(p));
                }
            }
            let matrices: usize = bucket
                .params
                .iter()
                .map(|&p| plan.def(&plan.params[p]))
                .filter(|d| d.shape.len() > 1)
                .map(|d| d.numel())
                .sum();
            assert_eq!(decayed, matrices, "bucket {}", bucket.id);
            decayed_matrices += matrices;
        }
        assert!(decayed_matrices > 0);
    }
}

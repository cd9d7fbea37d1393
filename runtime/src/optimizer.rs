//! The optimizer on shards: AdamW or SGD on each rank's f32 master shards,
//! with gradient clipping by the global norm.
//!
//! The global norm is computed so that it does not depend on how buckets are
//! sharded: every bucket is cut into 128-element blocks (shards always start
//! on a block boundary), each block's sum of squares is taken in f64, and
//! the partials are summed in one canonical order on every rank. ZeRO-3 and
//! `no_shard` therefore clip by the same bits, which the parity tests need.

use crate::backend::{AdamStep, Backend, NORM_BLOCK, SgdStep};
use crate::view::DType;
use crate::collective::Collective;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::FsdpEngine;
use crate::lane::{Event, Label, Lane};
use hybridgen_dsl::Plan;
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

/// A run of a shard the optimizer treats alike: one parameter's owned
/// elements, decayed or not. Alignment gaps and padding are skipped (their
/// gradients and values stay zero).
#[derive(Clone, Debug)]
struct Segment {
    range: Range<usize>,
    decay: bool,
}

/// Optimizer state of one bucket's shard.
pub struct MomentState<B: Backend> {
    /// Adam's first moment, or SGD's momentum buffer.
    pub exp_avg: B::Buf,
    /// Adam's second moment (empty for SGD).
    pub exp_avg_sq: B::Buf,
}

/// The optimizer of one rank.
pub struct Optimizer<D: Device> {
    config: OptimizerConfig,
    plan: Arc<Plan>,
    /// Steps taken (the next is `steps + 1`).
    steps: u64,
    states: Vec<Arc<MomentState<D::Backend>>>,
    segments: Vec<Vec<Segment>>,
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
        let mut segments = Vec::new();
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
            let mut runs = Vec::new();
            for &p in bucket.params.iter() {
                let param = &plan.params[p];
                let def = plan.def(param);
                let span = param.offset..param.offset + def.numel();
                let start = span.start.max(owned.start);
                let end = span.end.min(owned.end);
                if start < end {
                    runs.push(Segment {
                        range: start - owned.start..end - owned.start,
                        decay: def.shape.len() > 1,
                    });
                }
            }
            segments.push(runs);
        }
        Ok(Optimizer {
            config,
            plan,
            steps: 0,
            states,
            segments,
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

    /// The global L2 norm of the accumulated gradients, identical on every
    /// rank and under every sharding. Call after the step's reduces ran.
    pub fn grad_norm(&self, engine: &FsdpEngine<D>, rank: &RankContext<D>) -> Result<f64> {
        let backend = &rank.backend;
        // This rank's block partials, bucket after bucket.
        let mut mine = Vec::new();
        for shard in engine.shards() {
            let len = backend.buf_len(&shard.grad);
            let mut blocks = vec![0.0f64; len.div_ceil(NORM_BLOCK)];
            backend.sum_squares_blocks(backend.view(&shard.grad)?, &mut blocks)?;
            mine.extend(blocks);
        }
        let all = rank.host.all_gather_host(&mine)?;
        // Where each rank's partials of each bucket start.
        let blocks_of = |b: usize| {
            let bucket = &self.plan.buckets[b];
            bucket
                .shard_numel(engine.world_of(bucket))
                .div_ceil(NORM_BLOCK)
        };
        let mut starts = Vec::with_capacity(self.plan.buckets.len());
        let mut at = 0;
        for b in 0..self.plan.buckets.len() {
            starts.push(at);
            at += blocks_of(b);
        }
        let mut total = 0.0f64;
        // Canonical order: buckets by id; within a bucket, its blocks in
        // bucket order (pieces in group order); expert buckets once per EP
        // rank, since each holds different experts.
        let layout = engine.layout();
        for bucket in self.plan.buckets.iter() {
            let b = bucket.id;
            let copies = if bucket.expert { rank.ep.max(1) } else { 1 };
            for e in 0..copies {
                for r in layout.holders(bucket.expert, e) {
                    let partials = all
                        .get(r)
                        .and_then(|v| v.get(starts[b]..starts[b] + blocks_of(b)))
                        .ok_or_else(|| RuntimeError::Peer {
                            rank: r,
                            message: "sent gradient-norm partials of the wrong length".into(),
                        })?;
                    for x in partials {
                        total += x;
                    }
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
        let clip = match self.config.clip_grad {
            Some(max) if norm > f64::from(max) => Some((f64::from(max) / (norm + 1e-6)) as f32),
            _ => None,
        };
        self.steps += 1;
        let lr = self.config.lr_at(self.steps);
        let config = self.config.clone();
        let step = self.steps;
        let jobs: Vec<_> = engine
            .shards()
            .iter()
            .cloned()
            .zip(self.states.iter().cloned())
            .zip(self.segments.iter().cloned())
            .collect();
        let done = rank.compute.submit(
            Label::new(format!("optimizer step {step}"), "optimizer"),
            &[],
            Box::new(move |backend: &D::Backend| {
                for ((shard, state), segments) in &jobs {
                    if let Some(scale) = clip {
                        backend.scale(backend.view_mut(&shard.grad)?, scale)?;
                    }
                    for seg in segments {
                        let wd = if seg.decay { config.weight_decay } else { 0.0 };
                        let param = backend.slice_mut(&shard.master, seg.range.clone())?;
                        let grad = backend.slice(&shard.grad, seg.range.clone())?;
                        match config.kind {
                            OptimizerKind::Adam => backend.adam_update(
                                param,
                                grad,
                                backend.slice_mut(&state.exp_avg, seg.range.clone())?,
                                backend.slice_mut(&state.exp_avg_sq, seg.range.clone())?,
                                AdamStep {
                                    lr,
                                    beta1: config.beta1,
                                    beta2: config.beta2,
                                    eps: config.eps,
                                    weight_decay: wd,
                                    step,
                                },
                            )?,
                            OptimizerKind::Sgd => {
                                let momentum = if config.momentum != 0.0 {
                                    Some(backend.slice_mut(&state.exp_avg, seg.range.clone())?)
                                } else {
                                    None
                                };
                                backend.sgd_update(
                                    param,
                                    grad,
                                    momentum,
                                    SgdStep {
                                        lr,
                                        momentum: config.momentum,
                                        weight_decay: wd,
                                    },
                                )?
                            }
                        }
                    }
                    backend.cast(backend.view(&shard.master)?, backend.view_mut(&shard.param)?)?;
                }
                Ok(())
            }),
        );
        done.wait()?;
        Ok(norm)
    }
}

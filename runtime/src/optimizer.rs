//! The optimizer on shards: AdamW or SGD on each rank's f32 master shards,
//! with gradient clipping by the global norm.
//!
//! The global norm is computed so that it does not depend on how buckets are
//! sharded: every bucket is cut into 128-element blocks (shards always start
//! on a block boundary), each block's sum of squares is taken in f64, and
//! the partials are summed in one canonical order on every rank. ZeRO-3 and
//! `no_shard` therefore clip by the same bits, which the parity tests need.

use crate::backend::{AdamStep, Backend, NORM_BLOCK, Precision, SgdStep};
use crate::collective::Collective;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::FsdpEngine;
use crate::lane::{Event, Label, Lane};
use crate::shared::{Shared, lock, shared};
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
    /// Refuses hyper-parameters that cannot train, naming the field and the
    /// accepted range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(RuntimeError::Unsupported(what));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "the learning rate (lr) is {}; it must be a finite number above 0 (e.g. 3e-3)",
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
            return bad(format!(
                "Adam eps is {}; it must be a finite number above 0",
                self.eps
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay is {}; it must be a finite number, 0 or above",
                self.weight_decay
            ));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad(format!("SGD momentum {} must lie in [0, 1)", self.momentum));
        }
        if let Some(c) = self.clip_grad
            && !(c.is_finite() && c > 0.0)
        {
            return bad(format!(
                "the gradient clip (clip_grad) is {c}; it must be a finite norm above 0, or \
                 None to turn clipping off"
            ));
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

/// `value` as people write it: `0.003`, `1e30`.
fn number(value: f32) -> String {
    if value != 0.0 && !(1e-4..1e5).contains(&value.abs()) {
        format!("{value:e}")
    } else {
        value.to_string()
    }
}

/// A quantity of a step found non-finite: the first stops the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NonFinite {
    /// The main cross-entropy, mean over the step's tokens.
    Loss(f64),
    /// The mean MTP cross-entropy.
    MtpLoss(f64),
    /// The MoE load-balancing loss.
    AuxLoss(f64),
    /// The global gradient norm (the losses were finite).
    GradNorm(f64),
}

impl NonFinite {
    /// The quantity's value.
    pub fn value(self) -> f64 {
        match self {
            NonFinite::Loss(v)
            | NonFinite::MtpLoss(v)
            | NonFinite::AuxLoss(v)
            | NonFinite::GradNorm(v) => v,
        }
    }
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NonFinite::Loss(v) => write!(f, "the loss is {v}"),
            NonFinite::MtpLoss(v) => write!(f, "the MTP loss is {v} (the main loss is finite)"),
            NonFinite::AuxLoss(v) => write!(
                f,
                "the MoE load-balancing loss is {v} (the main loss is finite)"
            ),
            NonFinite::GradNorm(v) => write!(f, "the gradient norm is {v}"),
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
    /// The step count of the checkpoint this optimizer resumed from.
    resumed_at: Option<u64>,
    states: Vec<Shared<MomentState<D::Backend>>>,
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
            states.push(shared(MomentState {
                exp_avg: backend.alloc(len, Precision::F32)?,
                exp_avg_sq: backend.alloc(second, Precision::F32)?,
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
            resumed_at: None,
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
        self.resumed_at = Some(steps);
    }

    /// Per bucket, the moment buffers (for checkpoints).
    pub fn states(&self) -> &[Shared<MomentState<D::Backend>>] {
        &self.states
    }

    /// The global L2 norm of the accumulated gradients, identical on every
    /// rank and under every sharding. Call after the step's reduces ran.
    pub fn grad_norm(&self, engine: &FsdpEngine<D>, rank: &RankContext<D>) -> Result<f64> {
        let backend = &rank.backend;
        // This rank's block partials, bucket after bucket.
        let mut mine = Vec::new();
        for shard in engine.shards() {
            let shard = lock(shard, "a gradient shard")?;
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

    /// The error that stops a run whose step `steps + 1` produced the
    /// non-finite `quantity`: names it, the first parameter whose value or
    /// gradient is non-finite, the settings that matter (learning rate,
    /// clipping, a resumed checkpoint), and the causes that fit them.
    /// Collective: every rank calls it (the quantity is the same on every
    /// rank) and gets the same message.
    pub fn divergence(
        &self,
        engine: &FsdpEngine<D>,
        rank: &RankContext<D>,
        quantity: NonFinite,
    ) -> Result<RuntimeError> {
        let step = self.steps + 1;
        let [bad_value, bad_grad] = self.first_non_finite(engine, rank)?;
        let name = |at: Option<(usize, usize)>| {
            at.map(|(b, element)| {
                let bucket = &self.plan.buckets[b];
                bucket
                    .params
                    .iter()
                    .map(|&p| &self.plan.params[p])
                    .find(|p| (p.offset..p.offset + self.plan.def(p).numel()).contains(&element))
                    .map_or_else(|| format!("bucket {b}"), |p| self.plan.param_name(p))
            })
        };
        let (bad_value, bad_grad) = (name(bad_value), name(bad_grad));
        let mut out = format!("training diverged at step {step}: {quantity}",);
        match (&bad_value, &bad_grad) {
            (Some(p), _) => out += &format!("\n  the parameter {p} is already non-finite"),
            (None, Some(p)) => {
                out += &format!(
                    "\n  the first non-finite gradient is {p}'s (the parameters are finite)"
                )
            }
            (None, None) => out += "\n  the parameters and their gradients are finite",
        }
        let lr = number(self.config.lr_at(step));
        let clipping = match self.config.clip_grad {
            Some(c) => format!("gradient clipping at norm {}", number(c)),
            None => "no gradient clipping".to_string(),
        };
        out += &format!("\n  settings: learning rate {lr} at this step");
        if self.config.lr_at(step) != self.config.lr {
            out += &format!(
                " (peak {}, warm-up {} steps)",
                number(self.config.lr),
                self.config.warmup_steps
            );
        }
        out += &format!(", {clipping}");
        if let Some(at) = self.resumed_at {
            out += &format!(", resumed from a checkpoint of step {at}");
        }
        // No update ran since the weights were made or loaded: the learning
        // rate cannot be the cause.
        let first_step = step == self.resumed_at.unwrap_or(0) + 1;
        let lower_lr = match self.config.clip_grad {
            None => format!(
                "lower the learning rate (--lr, {lr} at this step), or turn gradient clipping \
                 on (--clip-grad 1)"
            ),
            Some(c) => format!(
                "lower the learning rate (--lr, {lr} at this step) or warm it up (--warmup): \
                 clipping at {c} bounds the gradient, not how far each update moves the \
                 weights"
            ),
        };
        let cause = match (bad_value.is_some(), first_step, self.resumed_at) {
            (true, true, Some(at)) => format!(
                "the checkpoint of step {at} holds non-finite weights: it is corrupt or was \
                 saved by a run that had already diverged; resume from an earlier checkpoint"
            ),
            (true, true, None) => "the initial weights are non-finite: check init_std and the \
                 model's dimensions"
                .to_string(),
            (true, false, _) => format!("an earlier update wrote non-finite weights: {lower_lr}"),
            (false, true, Some(at)) => format!(
                "the weights loaded from the checkpoint of step {at} overflow this step: the \
                 checkpoint may come from a run that was already diverging; resume from an \
                 earlier checkpoint or lower the learning rate"
            ),
            (false, true, None) => "the first step overflows with the initial weights, before \
                 any update (the learning rate is not the cause): check init_std, the model's \
                 dimensions and the data"
                .to_string(),
            (false, false, _) => {
                format!("earlier updates grew the weights until this step overflowed: {lower_lr}")
            }
        };
        out += &format!("\n  likely cause: {cause}");
        Ok(RuntimeError::Numeric(out))
    }

    /// The first (bucket, element of the bucket) whose master value, and the
    /// first whose gradient, is non-finite, over every rank.
    fn first_non_finite(
        &self,
        engine: &FsdpEngine<D>,
        rank: &RankContext<D>,
    ) -> Result<[Option<(usize, usize)>; 2]> {
        let backend = &rank.backend;
        // -1: none found on this rank.
        let mut mine = [-1.0f64; 4];
        let mut host = Vec::new();
        for (b, shard) in engine.shards().iter().enumerate() {
            let shard = lock(shard, "a parameter shard")?;
            let start = engine.owned_range(b, rank).start;
            for (i, buf) in [&shard.master, &shard.grad].into_iter().enumerate() {
                if mine[2 * i] >= 0.0 {
                    continue;
                }
                host.clear();
                host.resize(backend.buf_len(buf), 0.0);
                backend.download(backend.view(buf)?, &mut host)?;
                if let Some(at) = host.iter().position(|v| !v.is_finite()) {
                    mine[2 * i] = b as f64;
                    mine[2 * i + 1] = (start + at) as f64;
                }
            }
        }
        let all = rank.host.all_gather_host(&mine)?;
        let first = |i: usize| {
            all.iter()
                .filter(|v| v.len() == 4 && v[2 * i] >= 0.0)
                .map(|v| (v[2 * i] as usize, v[2 * i + 1] as usize))
                .min()
        };
        Ok([first(0), first(1)])
    }

    /// Clips (when configured) and takes one step on every shard, then
    /// refreshes the compute-precision copies. Returns the gradient norm
    /// before clipping.
    pub fn step(&mut self, engine: &FsdpEngine<D>, rank: &RankContext<D>) -> Result<f64> {
        let norm = self.grad_norm(engine, rank)?;
        if !norm.is_finite() {
            return Err(self.divergence(engine, rank, NonFinite::GradNorm(norm))?);
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
        let backend = rank.backend.clone();
        let done = rank.compute.submit(
            Label::new(format!("optimizer step {step}"), "optimizer"),
            &[],
            Box::new(move || {
                for ((shard, state), segments) in &jobs {
                    let mut shard = lock(shard, "a parameter shard")?;
                    let mut state = lock(state, "optimizer state")?;
                    let shard = &mut *shard;
                    let state = &mut *state;
                    if let Some(scale) = clip {
                        backend.scale(backend.view_mut(&mut shard.grad)?, scale)?;
                    }
                    for seg in segments {
                        let wd = if seg.decay { config.weight_decay } else { 0.0 };
                        let param = backend.slice_mut(&mut shard.master, seg.range.clone())?;
                        let grad = backend.slice(&shard.grad, seg.range.clone())?;
                        match config.kind {
                            OptimizerKind::Adam => backend.adam_update(
                                param,
                                grad,
                                backend.slice_mut(&mut state.exp_avg, seg.range.clone())?,
                                backend.slice_mut(&mut state.exp_avg_sq, seg.range.clone())?,
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
                                    Some(backend.slice_mut(&mut state.exp_avg, seg.range.clone())?)
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
                    backend.copy(
                        backend.view(&shard.master)?,
                        backend.view_mut(&mut shard.param)?,
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
    use crate::cpu::CpuBackend;
    use crate::cpu::collective::CpuWorld;
    use crate::cpu::lane::CpuLane;
    use crate::device::Cpu;
    use crate::fsdp::Sharding;
    use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

    #[test]
    fn validate_names_the_field_and_the_range() {
        let refused = |edit: &dyn Fn(&mut OptimizerConfig)| {
            let mut config = OptimizerConfig::default();
            edit(&mut config);
            config.validate().unwrap_err().to_string()
        };
        assert!(refused(&|c| c.lr = f32::NEG_INFINITY).contains("learning rate (lr) is -inf"));
        assert!(refused(&|c| c.lr = 0.0).contains("above 0"));
        assert!(refused(&|c| c.weight_decay = -0.1).contains("weight decay is -0.1"));
        assert!(refused(&|c| c.weight_decay = f32::NAN).contains("weight decay is NaN"));
        for clip in [f32::NAN, -1.0, 0.0, f32::INFINITY] {
            let message = refused(&|c| c.clip_grad = Some(clip));
            assert!(message.contains("gradient clip (clip_grad)"), "{message}");
            assert!(message.contains("None to turn clipping off"), "{message}");
        }
        assert!(refused(&|c| c.beta1 = f32::NAN).contains("betas"));
        let off = OptimizerConfig {
            clip_grad: None,
            ..OptimizerConfig::default()
        };
        off.validate().unwrap();
    }

    /// One rank of a tiny `*-` model whose parameter `poisoned` (if any) is
    /// NaN, and its optimizer.
    fn one_rank(
        config: OptimizerConfig,
        poisoned: Option<usize>,
    ) -> (RankContext<Cpu>, FsdpEngine<Cpu>, Optimizer<Cpu>, Arc<Plan>) {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = "*-".into();
        let options = PlanOptions {
            layout: ParallelLayout::new(1, 1),
            ..PlanOptions::default()
        };
        let plan = Arc::new(Plan::new(&model, &options).unwrap());
        let world = CpuWorld::new(1).unwrap();
        let comm = world.comm(0).unwrap();
        let rank = RankContext::<Cpu> {
            rank: 0,
            world: 1,
            ep: 1,
            backend: Arc::new(CpuBackend),
            compute: Arc::new(CpuLane::new("compute").unwrap()),
            comm: Arc::new(CpuLane::new("comm").unwrap()),
            ep_group: Arc::new(comm.split(0).unwrap()),
            edp: Arc::new(comm.split(0).unwrap()),
            host: Arc::new(comm.split(0).unwrap()),
            dp: Arc::new(comm),
        };
        let init = |p: usize, out: &mut [f32]| {
            out.fill(if Some(p) == poisoned { f32::NAN } else { 0.01 });
            Ok(())
        };
        let engine = FsdpEngine::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init).unwrap();
        let optimizer = Optimizer::new(config, plan.clone(), &engine, &rank).unwrap();
        (rank, engine, optimizer, plan)
    }

    #[test]
    fn divergence_names_the_parameter_and_the_causes_that_fit() {
        let explain = |config: OptimizerConfig,
                       poisoned: Option<usize>,
                       resumed: Option<u64>,
                       updates: usize,
                       quantity: NonFinite| {
            let (rank, engine, mut optimizer, plan) = one_rank(config, poisoned);
            if let Some(step) = resumed {
                optimizer.set_steps(step);
            }
            for _ in 0..updates {
                optimizer.step(&engine, &rank).unwrap();
            }
            let name = poisoned.map(|p| plan.param_name(&plan.params[p]));
            let error = optimizer.divergence(&engine, &rank, quantity).unwrap();
            assert!(matches!(error, RuntimeError::Numeric(_)));
            (error.to_string(), name)
        };
        let clipped = OptimizerConfig::default();
        let unclipped = OptimizerConfig {
            clip_grad: None,
            ..OptimizerConfig::default()
        };
        // Corrupt weights loaded from a checkpoint: the checkpoint, not the
        // learning rate.
        let (message, name) = explain(
            clipped.clone(),
            Some(3),
            Some(5),
            0,
            NonFinite::Loss(f64::NAN),
        );
        assert!(
            message.starts_with("training diverged at step 6: the loss is NaN"),
            "{message}"
        );
        let name = name.unwrap();
        assert!(
            message.contains(&format!("the parameter {name} is already non-finite")),
            "{message}"
        );
        assert!(
            message.contains("resumed from a checkpoint of step 5"),
            "{message}"
        );
        assert!(
            message.contains("the checkpoint of step 5 holds non-finite weights"),
            "{message}"
        );
        assert!(!message.contains("lower the learning rate"), "{message}");
        // The first step of a fresh run: no update ran, the learning rate is
        // not the cause.
        let (message, _) = explain(
            clipped.clone(),
            None,
            None,
            0,
            NonFinite::Loss(f64::INFINITY),
        );
        assert!(
            message.contains("the learning rate is not the cause"),
            "{message}"
        );
        assert!(
            message.contains("the parameters and their gradients are finite"),
            "{message}"
        );
        // After updates: the learning rate, with advice that fits clipping.
        let (message, _) = explain(clipped, None, None, 2, NonFinite::GradNorm(f64::NAN));
        assert!(
            message.starts_with("training diverged at step 3: the gradient norm is NaN"),
            "{message}"
        );
        assert!(message.contains("gradient clipping at norm 1"), "{message}");
        assert!(
            message.contains("clipping at 1 bounds the gradient"),
            "{message}"
        );
        let (message, _) = explain(unclipped, None, Some(5), 1, NonFinite::MtpLoss(f64::NAN));
        assert!(message.contains("the MTP loss is NaN"), "{message}");
        assert!(message.contains("no gradient clipping"), "{message}");
        assert!(
            message.contains("turn gradient clipping on (--clip-grad 1)"),
            "{message}"
        );
        assert!(
            message.contains("earlier updates grew the weights"),
            "{message}"
        );
    }
}

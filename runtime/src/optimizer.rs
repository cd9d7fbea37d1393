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
//! then the compute-precision parameters refreshed from the master shard
//! (Adam writes them as it updates; SGD's are cast after).
//! Alignment gaps and padding ride along: zero parameters with zero
//! gradients stay zero under both optimizers.

use crate::backend::{AdamMoments, AdamStep, Backend, SgdStep};
use crate::collective::Collective;
use crate::device::{Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::{FsdpEngine, ShardLayout, Sharding};
use crate::lane::{Event, Label, Lane};
use crate::setting::{Setting, SettingSpelling};
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
    /// How the learning rate decays after the warm-up. Checkpoints written
    /// before the field existed kept it constant.
    #[serde(default)]
    pub schedule: LrSchedule,
}

/// How the learning rate decays after the warm-up (Megatron's
/// `lr_decay_style`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrDecayStyle {
    /// The peak rate until the end.
    #[default]
    Constant,
    /// Straight down to the minimum.
    Linear,
    /// Half a cosine down to the minimum.
    Cosine,
    /// Warm-up, stable, decay: the peak rate until the last
    /// `wsd_decay_steps` of the decay, then down to the minimum.
    Wsd,
}

/// The shape of a WSD schedule's final decay (Megatron's
/// `lr_wsd_decay_style`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WsdDecayStyle {
    Linear,
    Cosine,
    /// `2 * 0.5^ratio - 1`: Megatron's default.
    #[default]
    Exponential,
    MinusSqrt,
}

/// The learning-rate schedule after the warm-up, as Megatron's
/// `OptimizerParamScheduler` computes it.
#[derive(Clone, Debug, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub decay_style: LrDecayStyle,
    /// The rate the decay ends at, and stays at after `decay_steps`.
    pub min_lr: f32,
    /// The step the decay ends at, counted from the start (warm-up
    /// included), as Megatron's `lr_decay_iters`.
    pub decay_steps: u64,
    /// WSD only: the steps of the final decay.
    pub wsd_decay_steps: u64,
    pub wsd_decay_style: WsdDecayStyle,
}

impl LrSchedule {
    /// One line for messages: `cosine to 3e-4 by step 1000`.
    pub fn describe(&self) -> String {
        match self.decay_style {
            LrDecayStyle::Constant => "constant".to_string(),
            LrDecayStyle::Linear | LrDecayStyle::Cosine => format!(
                "{} to {} by step {}",
                if self.decay_style == LrDecayStyle::Linear {
                    "linear"
                } else {
                    "cosine"
                },
                number(self.min_lr),
                self.decay_steps
            ),
            LrDecayStyle::Wsd => format!(
                "wsd ({:?} over the last {} steps) to {} by step {}",
                self.wsd_decay_style,
                self.wsd_decay_steps,
                number(self.min_lr),
                self.decay_steps
            )
            .replace("MinusSqrt", "minus-sqrt")
            .to_lowercase(),
        }
    }
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
            schedule: LrSchedule::default(),
        }
    }
}

impl OptimizerConfig {
    /// Refuses hyper-parameters that cannot train, naming the setting (as
    /// `spelling` spells it) and the accepted range.
    pub fn validate(&self, spelling: SettingSpelling) -> Result<()> {
        let bad = |what: String| Err(RuntimeError::Unsupported(what));
        let name = |setting| spelling.name(setting);
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "the learning rate ({}) is {}; it must be a finite number above 0 (e.g. 3e-3)",
                name(Setting::Lr),
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
                "the gradient clip ({}) is {c}; it must be a finite norm above 0, or \
                 None to turn clipping off",
                name(Setting::ClipGrad)
            ));
        }
        let s = &self.schedule;
        if !(s.min_lr.is_finite() && s.min_lr >= 0.0 && s.min_lr <= self.lr) {
            return bad(format!(
                "the minimum learning rate ({}) is {}; it must be a finite number from 0 \
                 to the peak rate {}",
                name(Setting::MinLr),
                number(s.min_lr),
                spelling.given(Setting::Lr, number(self.lr))
            ));
        }
        if s.decay_style != LrDecayStyle::Constant && s.decay_steps <= self.warmup_steps {
            return bad(format!(
                "the learning rate decays until step {} ({}), which must come \
                 after the {} warm-up steps ({}); give {} above {}",
                s.decay_steps,
                name(Setting::LrDecaySteps),
                self.warmup_steps,
                name(Setting::Warmup),
                name(Setting::LrDecaySteps),
                self.warmup_steps
            ));
        }
        if s.decay_style == LrDecayStyle::Wsd
            && !(1..=s.decay_steps - self.warmup_steps).contains(&s.wsd_decay_steps)
        {
            return bad(format!(
                "the WSD schedule decays over the last {} steps ({}); give 1 \
                 to {} (the steps from the end of the warm-up, {}, to {})",
                s.wsd_decay_steps,
                name(Setting::LrWsdDecaySteps),
                s.decay_steps - self.warmup_steps,
                self.warmup_steps,
                spelling.given(Setting::LrDecaySteps, s.decay_steps)
            ));
        }
        Ok(())
    }

    /// The learning rate of the update at 1-based step `step`: Megatron's
    /// `OptimizerParamScheduler.get_lr` with `num_steps = step` and an
    /// initial rate of 0 (linear warm-up from 0 reaches `lr` at step
    /// `warmup_steps`), then the decay of [`LrSchedule`], and `min_lr` after
    /// `decay_steps`.
    pub fn lr_at(&self, step: u64) -> f32 {
        let s = &self.schedule;
        if self.warmup_steps > 0 && step < self.warmup_steps {
            return self.lr * step as f32 / self.warmup_steps as f32;
        }
        if s.decay_style == LrDecayStyle::Constant {
            return self.lr;
        }
        if step > s.decay_steps {
            return s.min_lr;
        }
        let (max, min) = (f64::from(self.lr), f64::from(s.min_lr));
        let ratio = (step - self.warmup_steps) as f64
            / s.decay_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let cosine = |r: f64| 0.5 * ((std::f64::consts::PI * r).cos() + 1.0);
        let coeff = match s.decay_style {
            LrDecayStyle::Constant => 1.0,
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => cosine(ratio),
            LrDecayStyle::Wsd => {
                let anneal_start = s.decay_steps.saturating_sub(s.wsd_decay_steps);
                if step <= anneal_start {
                    1.0
                } else {
                    let r = (step - anneal_start) as f64 / s.wsd_decay_steps.max(1) as f64;
                    match s.wsd_decay_style {
                        WsdDecayStyle::Linear => 1.0 - r,
                        WsdDecayStyle::Cosine => cosine(r),
                        WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
                        WsdDecayStyle::MinusSqrt => 1.0 - r.sqrt(),
                    }
                }
            }
        };
        (min + coeff * (max - min)) as f32
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
    /// The `D` layers' indexer loss.
    IndexerLoss(f64),
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
            | NonFinite::IndexerLoss(v)
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
            NonFinite::IndexerLoss(v) => {
                write!(f, "the DSA indexer loss is {v} (the main loss is finite)")
            }
            NonFinite::GradNorm(v) => write!(f, "the gradient norm is {v}"),
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
    /// Whether this rank holds the bucket (its pipeline stages' buckets).
    held: bool,
}

/// The optimizer of one rank.
pub struct Optimizer<D: Device> {
    config: OptimizerConfig,
    plan: Arc<Plan>,
    /// Steps taken (the next is `steps + 1`).
    steps: u64,
    /// The step count of the checkpoint this optimizer resumed from.
    resumed_at: Option<u64>,
    states: Vec<Arc<MomentState<D::Backend>>>,
    buckets: Arc<Vec<BucketLayout<D::Backend>>>,
    /// The engine's shard layout: where the norm's pieces are.
    layout: ShardLayout,
    /// How a divergence's advice names the settings.
    spelling: SettingSpelling,
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
        spelling: SettingSpelling,
    ) -> Result<Self> {
        config.validate(spelling)?;
        let backend = &rank.backend;
        let mut states = Vec::new();
        let mut buckets = Vec::new();
        for bucket in plan.buckets.iter() {
            // Another pipeline stage's bucket: nothing here to update.
            let held = engine.holds(bucket.id);
            let owned = match held {
                true => engine.owned_range(bucket.id, rank),
                false => 0..0,
            };
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
            let ranges = backend.alloc_uninit(decayed.len(), DType::U32)?;
            backend.upload(&decayed, backend.view_mut(&ranges)?)?;
            // The shared embedding's gradients are the same on both its
            // stages' ranks once summed: the norm counts the first's.
            let counted = held && plan.bucket_owner(bucket) == rank.pp_rank;
            buckets.push(BucketLayout {
                decayed: ranges,
                norm_piece: match counted {
                    true => norm_piece(&plan, engine.layout(), bucket, rank.rank),
                    false => 0..0,
                },
                held,
            });
        }
        Ok(Optimizer {
            config,
            plan,
            steps: 0,
            resumed_at: None,
            states,
            buckets: Arc::new(buckets),
            layout: engine.layout(),
            spelling,
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
    pub fn states(&self) -> &[Arc<MomentState<D::Backend>>] {
        &self.states
    }

    /// Submits, on the compute lane after `after` (the step's reduces into
    /// the shards), the partials of this rank's squared gradient norm, one
    /// per bucket in id order (see the module doc), written into `out` from
    /// index `at` on; the returned event completes with them. The host
    /// reads them with the step's losses ([`crate::schedule::StepTotals`]).
    pub fn norm_partials(
        &self,
        engine: &FsdpEngine<D>,
        rank: &RankContext<D>,
        out: Arc<<D::Backend as Backend>::Buf>,
        at: usize,
        after: &[EventOf<D>],
    ) -> EventOf<D> {
        let shards = engine.shards().to_vec();
        let buckets = self.buckets.clone();
        rank.compute.submit(
            Label::new("gradient norm partials", "optimizer"),
            after,
            Box::new(move |b: &D::Backend| {
                b.zero(b.slice_mut(&out, at..at + buckets.len())?)?;
                for (i, (shard, bucket)) in shards.iter().zip(buckets.iter()).enumerate() {
                    let piece = bucket.norm_piece.clone();
                    if piece.is_empty() {
                        continue;
                    }
                    let len = piece.len();
                    b.sum_squares(
                        shard.grad.piece(b, piece)?,
                        len,
                        b.slice_mut(&out, at + i..at + i + 1)?,
                    )?;
                }
                Ok(())
            }),
        )
    }

    /// The global L2 norm of the accumulated gradients from every rank's
    /// norm partials (`mine` is this rank's): identical on every rank and
    /// under every sharding.
    pub fn grad_norm(&self, rank: &RankContext<D>, mine: &[f64]) -> Result<f64> {
        let all = rank.host.all_gather_host(mine)?;
        let pieces = norm_pieces(self.layout);
        let buckets = self.plan.buckets.len();
        let mut total = 0.0f64;
        for bucket in self.plan.buckets.iter() {
            let copies = if bucket.expert {
                self.plan.layout.ep
            } else {
                1
            };
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
        // Every stage's total (the same on its ranks), added in pipeline
        // order; without a pipeline, 0 + total is the total's bits.
        let stages = rank.pipe_host.all_gather_host(&[total])?;
        let total = stages
            .iter()
            .map(|v| v.first().copied().unwrap_or(0.0))
            .fold(0.0, |a, b| a + b);
        Ok(total.sqrt())
    }

    /// The error that stops a run whose step `steps + 1` produced the
    /// non-finite `quantity`: names it, the first parameter whose value or
    /// gradient is non-finite, the settings that matter (learning rate,
    /// clipping, a resumed checkpoint, spelled as the run spells them), and
    /// the causes that fit them. Collective: every rank calls it (the
    /// quantity is the same on every rank) and gets the same message.
    pub fn divergence(
        &self,
        engine: &FsdpEngine<D>,
        rank: &RankContext<D>,
        quantity: NonFinite,
    ) -> Result<RuntimeError> {
        let spelling = self.spelling;
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
        let lr_setting = spelling.name(Setting::Lr);
        let lower_lr = match self.config.clip_grad {
            None => format!(
                "lower the learning rate ({lr_setting}, {lr} at this step), or turn gradient clipping \
                 on ({})",
                spelling.given(Setting::ClipGrad, 1)
            ),
            Some(c) => format!(
                "lower the learning rate ({lr_setting}, {lr} at this step) or warm it up ({}): \
                 clipping at {c} bounds the gradient, not how far each update moves the \
                 weights",
                spelling.name(Setting::Warmup)
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
        let mut host: Vec<f32> = Vec::new();
        for (b, shard) in engine.shards().iter().enumerate() {
            let start = engine.owned_range(b, rank).start;
            let views = [backend.view(&shard.master)?, shard.grad.view(backend)?];
            for (i, view) in views.into_iter().enumerate() {
                if mine[2 * i] >= 0.0 {
                    continue;
                }
                host.clear();
                host.resize(backend.slice_len(view), 0.0);
                backend.download(view, &mut host)?;
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
    pub fn step(
        &mut self,
        engine: &FsdpEngine<D>,
        rank: &RankContext<D>,
        norm_partials: &[f64],
    ) -> Result<f64> {
        let norm = self.grad_norm(rank, norm_partials)?;
        if !norm.is_finite() {
            return Err(self.divergence(engine, rank, NonFinite::GradNorm(norm))?);
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
                    if !bucket.held {
                        continue;
                    }
                    let param = backend.view_mut(&shard.master)?;
                    let grad = shard.grad.view(backend)?;
                    let decayed = backend.view(&bucket.decayed)?;
                    match config.kind {
                        OptimizerKind::Adam => backend.adam_update(
                            param,
                            Some(shard.param.view_mut(backend)?),
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
                                Some(shard.param.view_mut(backend)?),
                                grad,
                                momentum,
                                decayed,
                                SgdStep {
                                    lr,
                                    momentum: config.momentum,
                                    weight_decay: config.weight_decay,
                                    grad_scale,
                                },
                            )?;
                        }
                    }
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
    use crate::device::Cpu;
    use crate::platform::{CpuPlatform, Platform, RankSettings};
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

    #[test]
    fn validate_names_the_field_and_the_range() {
        let refused = |edit: &dyn Fn(&mut OptimizerConfig)| {
            let mut config = OptimizerConfig::default();
            edit(&mut config);
            config
                .validate(SettingSpelling::FIELDS)
                .unwrap_err()
                .to_string()
        };
        assert!(
            refused(&|c| c.lr = f32::NEG_INFINITY)
                .contains("learning rate (config.optimizer.lr) is -inf")
        );
        assert!(refused(&|c| c.lr = 0.0).contains("above 0"));
        assert!(refused(&|c| c.weight_decay = -0.1).contains("weight decay is -0.1"));
        assert!(refused(&|c| c.weight_decay = f32::NAN).contains("weight decay is NaN"));
        for clip in [f32::NAN, -1.0, 0.0, f32::INFINITY] {
            let message = refused(&|c| c.clip_grad = Some(clip));
            assert!(
                message.contains("gradient clip (config.optimizer.clip_grad)"),
                "{message}"
            );
            assert!(message.contains("None to turn clipping off"), "{message}");
        }
        assert!(refused(&|c| c.beta1 = f32::NAN).contains("betas"));
        let off = OptimizerConfig {
            clip_grad: None,
            ..OptimizerConfig::default()
        };
        off.validate(SettingSpelling::FIELDS).unwrap();
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
        let settings = RankSettings::for_tests();
        let platform = CpuPlatform::new(1, settings.timeout).unwrap();
        let rank = platform.rank(0, &settings).unwrap();
        let init = |p: usize, _: Range<usize>, out: &mut [f32]| {
            out.fill(if Some(p) == poisoned { f32::NAN } else { 0.01 });
            Ok(())
        };
        let engine = FsdpEngine::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init).unwrap();
        let optimizer = Optimizer::new(
            config,
            plan.clone(),
            &engine,
            &rank,
            SettingSpelling::FIELDS,
        )
        .unwrap();
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
                let b = &rank.backend;
                let out = Arc::new(b.alloc(plan.buckets.len(), DType::F64).unwrap());
                optimizer
                    .norm_partials(&engine, &rank, out.clone(), 0, &[])
                    .wait()
                    .unwrap();
                let mut partials = vec![0.0; plan.buckets.len()];
                b.download(b.view(&*out).unwrap(), &mut partials).unwrap();
                optimizer.step(&engine, &rank, &partials).unwrap();
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
            message.contains("turn gradient clipping on (config.optimizer.clip_grad = 1)"),
            "{message}"
        );
        assert!(
            message.contains("earlier updates grew the weights"),
            "{message}"
        );
    }

    /// lr 1, min 0.1, 10 warm-up steps, decay until step 110.
    fn scheduled(style: LrDecayStyle, wsd: WsdDecayStyle) -> OptimizerConfig {
        OptimizerConfig {
            lr: 1.0,
            warmup_steps: 10,
            schedule: LrSchedule {
                decay_style: style,
                min_lr: 0.1,
                decay_steps: 110,
                wsd_decay_steps: 20,
                wsd_decay_style: wsd,
            },
            ..OptimizerConfig::default()
        }
    }

    #[test]
    fn schedules_equal_megatrons_formulas_at_chosen_steps() {
        use LrDecayStyle as S;
        use WsdDecayStyle as W;
        let close = |got: f32, want: f64, what: &str| {
            assert!(
                (f64::from(got) - want).abs() < 1e-6,
                "{what}: {got} != {want}"
            );
        };
        // Megatron: warm-up lr = max_lr * num_steps / warmup; then
        // min + coeff * (max - min) with ratio = (n - warmup) / (decay - warmup).
        let quarter_cos = 0.5 * ((std::f64::consts::PI * 0.25).cos() + 1.0); // 0.853553
        let cases: [(S, W, u64, f64); 17] = [
            (S::Linear, W::Exponential, 5, 0.5),
            (S::Linear, W::Exponential, 10, 1.0),
            (S::Linear, W::Exponential, 60, 0.1 + 0.9 * 0.5),
            (S::Linear, W::Exponential, 35, 0.1 + 0.9 * 0.75),
            (S::Linear, W::Exponential, 110, 0.1),
            (S::Linear, W::Exponential, 500, 0.1),
            (S::Cosine, W::Exponential, 60, 0.1 + 0.9 * 0.5),
            (S::Cosine, W::Exponential, 35, 0.1 + 0.9 * quarter_cos),
            (S::Cosine, W::Exponential, 111, 0.1),
            (S::Constant, W::Exponential, 3, 0.3),
            (S::Constant, W::Exponential, 1000, 1.0),
            // WSD: stable until 110 - 20 = 90, then r = (n - 90) / 20.
            (S::Wsd, W::Exponential, 90, 1.0),
            (
                S::Wsd,
                W::Exponential,
                100,
                0.1 + 0.9 * (2.0 * 0.5f64.sqrt() - 1.0),
            ),
            (S::Wsd, W::Linear, 100, 0.1 + 0.9 * 0.5),
            (S::Wsd, W::Cosine, 95, 0.1 + 0.9 * quarter_cos),
            (S::Wsd, W::MinusSqrt, 100, 0.1 + 0.9 * (1.0 - 0.5f64.sqrt())),
            (S::Wsd, W::Exponential, 110, 0.1),
        ];
        for (style, wsd, step, want) in cases {
            let config = scheduled(style, wsd);
            config.validate(SettingSpelling::FIELDS).unwrap();
            close(
                config.lr_at(step),
                want,
                &format!("{style:?}/{wsd:?} at {step}"),
            );
        }
        // Without a warm-up the first update already decays.
        let mut config = scheduled(S::Linear, W::Exponential);
        config.warmup_steps = 0;
        close(
            config.lr_at(11),
            0.1 + 0.9 * (1.0 - 0.1),
            "no warm-up at 11",
        );
        // Older checkpoints (no schedule field) keep the rate constant.
        let mut value = serde_json::to_value(OptimizerConfig::default()).unwrap();
        value.as_object_mut().unwrap().remove("schedule");
        let old: OptimizerConfig = serde_json::from_value(value).unwrap();
        assert_eq!(old.schedule.decay_style, S::Constant);
    }

    #[test]
    fn impossible_schedules_are_refused() {
        let refused = |f: &dyn Fn(&mut OptimizerConfig)| {
            let mut c = scheduled(LrDecayStyle::Wsd, WsdDecayStyle::Linear);
            f(&mut c);
            c.validate(SettingSpelling::FIELDS).unwrap_err().to_string()
        };
        assert!(refused(&|c| c.schedule.min_lr = 2.0).contains("min_lr) is 2"));
        assert!(refused(&|c| c.schedule.min_lr = f32::NAN).contains("schedule.min_lr"));
        assert!(
            refused(&|c| c.schedule.decay_steps = 10)
                .contains("give config.optimizer.schedule.decay_steps above 10")
        );
        assert!(refused(&|c| c.schedule.wsd_decay_steps = 0).contains("give 1 to 100"));
        assert!(
            refused(&|c| c.schedule.wsd_decay_steps = 101).contains("schedule.wsd_decay_steps")
        );
    }
}

//! One rank's run, on the thread that drives it: its start-up
//! ([`RankRun::start`]: the engine, the optimizer, a resume's load), then
//! each step in the phases llm.c's step reads as: the batch and the forward
//! and backward ([`RankRun::forward_backward`]), the step's sums added over
//! ranks ([`RankRun::reduce`]), the update ([`RankRun::update`]), an
//! evaluation where one is due, then the report and the checkpoint.

use super::hash::param_hash;
use super::prepare::batch_shape;
use super::{Prepared, StartupTimes, StepReport, TrainConfig};
use crate::backend::{Backend, Tokens};
use crate::checkpoint::{self, RankSaves, SavedState};
use crate::collective::Collective;
use crate::data::{BatchKey, BatchShape, DataSource};
use crate::device::{Device, RankContext};
use crate::error::Result;
use crate::fsdp::FsdpEngine;
use crate::loader::{MicroBatchLoader, StreamRange, micro_batch_tokens};
use crate::model::ModelRuntime;
use crate::optimizer::{NonFinite, Optimizer};
use crate::schedule::{
    MicroBatchTokens, Program, StepContext, StepReadout, StepSums, build, build_forward_only,
    run_step,
};
use hybridgen_dsl::{LayerKind, Plan};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What one rank's run returns.
pub(super) struct RankOutcome {
    pub(super) param_hash: u64,
    pub(super) startup: StartupTimes,
    /// The final parameter hash's time.
    pub(super) hash_time: Duration,
    /// The checkpoints' time.
    pub(super) save_time: Duration,
    /// Checkpoints written behind the steps.
    pub(super) saves_behind: u64,
}

/// One rank's whole run, on the thread that drives it (`opening`: how
/// long its device and communicators took): start-up, the steps (each
/// reported on `reports`, the first local rank's, and saved where due),
/// the last save and the parameter hash.
pub(super) fn run_rank<D: Device>(
    config: &TrainConfig,
    prepared: &Prepared,
    rank: RankContext<D>,
    reports: Option<mpsc::Sender<StepReport>>,
    opening: Duration,
) -> Result<RankOutcome> {
    let (mut run, startup) = RankRun::start(config, prepared, rank, opening)?;
    // This rank's saves, the first behind the steps (`async_save`) given
    // its host memory from now on, while the first steps run.
    let mut saves = run.saves();
    let loader = run.loader()?;
    while run.step < config.steps {
        let report = run.train_step(&loader)?;
        if let Some(reports) = &reports {
            // The receiver only goes away when the caller stopped listening.
            let _ = reports.send(report);
        }
        if let Some(saves) = &mut saves {
            saves.after_step(run.step, &run.saved_state(), &run.rank)?;
        }
    }
    if let Some(saves) = &mut saves {
        saves.finish(run.step, &run.saved_state(), &run.rank)?;
    }
    let hashing = Instant::now();
    let param_hash = param_hash(&run.plan, &run.engine, &run.rank)?;
    Ok(RankOutcome {
        param_hash,
        startup,
        hash_time: hashing.elapsed(),
        save_time: saves.as_ref().map_or(Duration::ZERO, |s| s.waited),
        saves_behind: saves.as_ref().map_or(0, |s| s.behind),
    })
}

/// A step's losses, added over every rank: the same on every rank.
struct StepLossValues {
    /// Main cross-entropy, mean over every token of the step.
    loss: f64,
    /// Mean MTP cross-entropy over depths, when the model has MTP.
    mtp_loss: Option<f64>,
    /// MoE load-balancing loss, mean over micro-batches and ranks.
    aux_loss: f64,
    /// The `D` layers' indexer loss, mean over micro-batches, ranks and
    /// `D` layers, when the model trains an indexer.
    indexer_loss: Option<f64>,
}

/// The `D` layers a step's indexer loss is averaged over (the decoder's
/// and the MTP depths'), when there are any and their loss is on: a zero
/// coefficient computes no loss, so none is reported.
pub(crate) fn indexer_layers(plan: &Plan) -> Option<usize> {
    let coeff = plan.model.dsa.as_ref()?.indexer_loss_coeff;
    let layers = plan
        .layers
        .iter()
        .map(|l| l.kind)
        .chain(plan.mtp_layers.iter().flatten().map(|l| l.kind))
        .filter(|&kind| kind == LayerKind::Dsa)
        .count();
    (coeff > 0.0 && layers > 0).then_some(layers)
}

/// One rank between steps: what its start-up built, and the steps done.
struct RankRun<'a, D: Device> {
    config: &'a TrainConfig,
    prepared: &'a Prepared,
    rank: RankContext<D>,
    plan: Arc<Plan>,
    /// The training step's program.
    program: Program,
    /// The evaluation's (forward only), when the run evaluates.
    eval_program: Option<Program>,
    engine: FsdpEngine<D>,
    optimizer: Optimizer<D>,
    cx: Arc<StepContext<D>>,
    shape: BatchShape,
    /// Steps done, a resumed checkpoint's included.
    step: u64,
}

impl<'a, D: Device> RankRun<'a, D> {
    /// The rank's start-up: the model and the schedule's program, the
    /// parameters (drawn, read from `init_from`, or left for a resume to
    /// fill), the optimizer and the step context, then a resume's load;
    /// and where its time went.
    fn start(
        config: &'a TrainConfig,
        prepared: &'a Prepared,
        rank: RankContext<D>,
        opening: Duration,
    ) -> Result<(Self, StartupTimes)> {
        let mut startup = StartupTimes {
            device: opening,
            ..StartupTimes::default()
        };
        let phase = Instant::now();
        let plan = prepared.plan.clone();
        let model = Arc::new(ModelRuntime::new(plan.clone())?);
        let program = build(&plan, rank.pp_rank, config.micro_batches, config.schedule)?;
        let ep_rank = rank.ep_rank();
        let drawn = AtomicU64::new(0);
        // A resume overwrites every parameter element this rank holds from
        // the checkpoint (the load refuses one that does not cover them
        // all), so the values are not drawn first: that took 12 s of a
        // 5 B-parameter model's start-up.
        let resuming = prepared.checkpoints.resume.is_some();
        let engine = FsdpEngine::new(
            plan.clone(),
            config.sharding,
            &rank,
            program.max_resident_units,
            program.max_grad_buffers,
            &|p, range, out| {
                let start = Instant::now();
                let filled = match &config.init_from {
                    _ if resuming => {
                        out.fill(0.0);
                        Ok(())
                    }
                    Some(weights) => weights.fill(&plan, p, ep_rank, range, out),
                    None => model.init_param(config.seed, p, ep_rank, range, out),
                };
                let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
                drawn.fetch_add(nanos, Ordering::Relaxed);
                filled
            },
        )?;
        startup.params = phase.elapsed();
        startup.params_drawn = Duration::from_nanos(drawn.load(Ordering::Relaxed));
        let phase = Instant::now();
        let mut optimizer = Optimizer::new(
            config.optimizer.clone(),
            plan.clone(),
            &engine,
            &rank,
            config.spelling,
        )?;
        let places = (0..plan.params.len())
            .map(|p| engine.param_place(p))
            .collect();
        let cx = Arc::new(StepContext::<D>::new(
            model,
            rank.ep_group.clone(),
            rank.pipe.clone(),
            Arc::new(places),
            Tokens::new(config.micro_batch_size, config.seq_length),
            1.0 / (config.micro_batches * config.dp()) as f32,
            config.recompute,
            &rank.backend,
        )?);
        startup.optimizer = phase.elapsed();
        let mut step = 0;
        if let Some(resume) = &prepared.checkpoints.resume {
            let phase = Instant::now();
            checkpoint::load(resume, &plan, &engine, &mut optimizer, &cx.balance, &rank)?;
            step = resume.step();
            startup.resume = phase.elapsed();
        }
        if let Some(weights) = &config.init_from {
            // The published routers' correction biases are the expert biases.
            for (key, values) in weights.biases() {
                cx.balance.set_bias(key, values)?;
            }
        }
        let eval_program = config
            .eval_every
            .map(|_| build_forward_only(&plan, rank.pp_rank, config.micro_batches));
        let run = RankRun {
            config,
            prepared,
            rank,
            plan,
            program,
            eval_program,
            engine,
            optimizer,
            cx,
            shape: batch_shape(config),
            step,
        };
        Ok((run, startup))
    }

    /// This rank's saves, when the run saves.
    fn saves(&self) -> Option<RankSaves<'a>> {
        let config = self.config;
        self.prepared.checkpoints.save.as_ref().map(|target| {
            RankSaves::new(
                target,
                config.save_every,
                config.async_save,
                (self.step, config.steps),
                || {
                    let bytes = checkpoint::snapshot_bytes(
                        &self.plan,
                        &self.engine.layout(),
                        config.optimizer.kind,
                        self.rank.world_rank(),
                    );
                    (bytes / 4) as usize
                },
            )
        })
    }

    /// The training stream's micro-batches from this step on, made ahead
    /// on a thread of their own so the executor never stops issuing work to
    /// make one.
    fn loader(&self) -> Result<MicroBatchLoader> {
        MicroBatchLoader::start(
            self.prepared.data.clone(),
            self.shape,
            self.plan.mtp_depths(),
            StreamRange {
                seed: self.config.seed,
                dp_rank: self.rank.rank,
                first_step: self.step,
                end_step: self.config.steps,
                micro_batches: self.config.micro_batches,
            },
        )
    }

    /// What a checkpoint of this rank now writes.
    fn saved_state(&self) -> SavedState<'_, D> {
        SavedState::new(&self.plan, &self.engine, &self.optimizer, &self.cx.balance)
    }

    /// One training step, phase by phase; returns its report.
    fn train_step(&mut self, loader: &MicroBatchLoader) -> Result<StepReport> {
        let started = Instant::now();
        let counted = self.rank.backend.stats();
        let StepReadout {
            losses,
            loads,
            norm_partials,
        } = self.forward_backward(loader)?;
        let sums = self.reduce(StepSums::mine(&losses, loads))?;
        let losses = self.losses(&sums);
        let grad_norm = self.update(&losses, &sums, &norm_partials)?;
        let device = self.rank.backend.stats() - counted;
        let elapsed = started.elapsed();
        self.step += 1;
        let eval_loss = self.evaluate()?;
        Ok(StepReport {
            step: self.step,
            loss: losses.loss,
            mtp_loss: losses.mtp_loss,
            aux_loss: losses.aux_loss,
            indexer_loss: losses.indexer_loss,
            grad_norm,
            elapsed,
            eval_loss,
            device,
        })
    }

    /// The batch, the forward and the backward: the step's program over
    /// the loader's micro-batches, the gradients reduced into the shards
    /// and the optimizer's norm partials queued behind them; then the
    /// step's one read: its loss sums, its expert loads and its
    /// gradient-norm partials.
    fn forward_backward(&mut self, loader: &MicroBatchLoader) -> Result<StepReadout> {
        let (seed, step, dp_rank) = (self.config.seed, self.step, self.rank.rank);
        let mut micro_batch = |micro_batch: usize| -> Result<MicroBatchTokens> {
            loader.next(BatchKey {
                seed,
                step,
                dp_rank,
                micro_batch,
            })
        };
        let (optimizer, rank, totals) = (&self.optimizer, &self.rank, &self.cx.totals);
        let mut norm_partials = |engine: &FsdpEngine<_>, reduced: &[_]| {
            // Its event fails with the lane's synchronize, which run_step
            // calls next.
            let _ = optimizer.norm_partials(
                engine,
                rank,
                totals.buffer(),
                totals.partials_at(),
                reduced,
            );
        };
        let counts = run_step(
            &self.program,
            &self.cx,
            &mut self.engine,
            &self.rank,
            &mut micro_batch,
            &mut norm_partials,
        )?;
        totals.read(&self.rank.backend, &counts)
    }

    /// Every rank's sums, added in rank order within each stage, then the
    /// stages' in pipeline order: the same bits everywhere. A stage adds
    /// only its own (the heads' losses are the last stage's, a MoE layer's
    /// load its stage's), so without a pipeline this is the stage's sum,
    /// and with one every sum but the MoE layers' aux losses is made of the
    /// same additions as without.
    fn reduce(&self, mine: StepSums) -> Result<StepSums> {
        let stage = mine.total(&self.rank.host.all_gather_host(mine.values())?);
        Ok(stage.total(&self.rank.pipe_host.all_gather_host(stage.values())?))
    }

    /// The step's losses from every rank's sums.
    fn losses(&self, sums: &StepSums) -> StepLossValues {
        let per_micro_batch = (self.config.micro_batches * self.config.dp()) as f64;
        StepLossValues {
            loss: sums.main_loss(),
            mtp_loss: sums.mean_mtp_loss(),
            aux_loss: sums.aux_sum() / per_micro_batch,
            // Megatron's "indexer loss": each layer's loss over the
            // micro-batches, averaged over the `D` layers.
            indexer_loss: indexer_layers(&self.plan)
                .map(|layers| sums.indexer_sum() / (per_micro_batch * layers as f64)),
        }
    }

    /// The update: refuses non-finite losses, then the optimizer's step
    /// (returning the gradient norm before clipping) and the expert biases'
    /// from the step's loads.
    fn update(
        &mut self,
        losses: &StepLossValues,
        sums: &StepSums,
        norm_partials: &[f64],
    ) -> Result<f64> {
        // The losses are the same on every rank, so every rank stops here
        // together, before an update from non-finite gradients.
        let non_finite = [
            NonFinite::Loss(losses.loss),
            NonFinite::MtpLoss(losses.mtp_loss.unwrap_or(0.0)),
            NonFinite::AuxLoss(losses.aux_loss),
            NonFinite::IndexerLoss(losses.indexer_loss.unwrap_or(0.0)),
        ]
        .into_iter()
        .find(|q| !q.value().is_finite());
        if let Some(quantity) = non_finite {
            return Err(self
                .optimizer
                .divergence(&self.engine, &self.rank, quantity)?);
        }
        let grad_norm = self
            .optimizer
            .step(&self.engine, &self.rank, norm_partials)?;
        let loads = sums.expert_loads();
        if !loads.is_empty() {
            self.cx.balance.update(loads)?;
        }
        Ok(grad_norm)
    }

    /// The evaluation loss, on steps that evaluate.
    fn evaluate(&mut self) -> Result<Option<f64>> {
        match (&self.eval_program, self.config.eval_every) {
            (Some(program), Some(every)) if self.step.is_multiple_of(every) => {
                let eval = Evaluation {
                    program,
                    cx: &self.cx,
                    data: &self.prepared.data,
                    shape: self.shape,
                    seed: self.config.seed,
                    batches: self.config.eval_steps,
                };
                Ok(Some(eval.run(&mut self.engine, &self.rank)?))
            }
            _ => Ok(None),
        }
    }
}

/// One evaluation: the forward of `batches` fixed evaluation batches
/// (each `micro_batches` micro-batches per rank).
///
/// Forward only: the program takes no gradient buffer and reduces nothing,
/// and the optimizer does not run, so the weights, the optimizer state and
/// the training stream (a function of the step) are as they were. The
/// gradient accumulators it leaves zeroed are zeroed again by the next
/// step's start. Collective: every rank evaluates at the same steps.
struct Evaluation<'a, D: Device> {
    program: &'a Program,
    cx: &'a Arc<StepContext<D>>,
    data: &'a DataSource,
    shape: BatchShape,
    seed: u64,
    batches: u64,
}

impl<D: Device> Evaluation<'_, D> {
    /// The mean main-head cross-entropy over every token of the batches,
    /// every rank's included: the same value on every rank.
    fn run(&self, engine: &mut FsdpEngine<D>, rank: &RankContext<D>) -> Result<f64> {
        let depths = self.cx.model.plan.mtp_depths();
        // This rank's (loss sum, token count) of each batch, gathered once.
        let mut mine = Vec::with_capacity(2 * self.batches as usize);
        for k in 0..self.batches {
            let mut micro_batch = |mb: usize| -> Result<MicroBatchTokens> {
                let key = BatchKey {
                    seed: self.seed,
                    step: k,
                    dp_rank: rank.rank,
                    micro_batch: mb,
                };
                Ok(micro_batch_tokens(
                    &self.data.eval_batch(key, self.shape)?,
                    depths,
                ))
            };
            let counts = run_step(
                self.program,
                self.cx,
                engine,
                rank,
                &mut micro_batch,
                &mut |_, _| {},
            )?;
            let losses = self.cx.totals.read(&rank.backend, &counts)?.losses;
            mine.extend([losses.main.0, losses.main.1 as f64]);
        }
        let all = rank.host.all_gather_host(&mine)?;
        // Added batch by batch, in rank order within a batch: the same
        // bits on every rank of the stage.
        let (mut sum, mut count) = (0.0f64, 0.0f64);
        for k in 0..self.batches as usize {
            for theirs in &all {
                sum += theirs.get(2 * k).copied().unwrap_or(0.0);
                count += theirs.get(2 * k + 1).copied().unwrap_or(0.0);
            }
        }
        // The last stage's heads made the losses: every stage takes its
        // sums, added in pipeline order (the others' are zero).
        let stages = rank.pipe_host.all_gather_host(&[sum, count])?;
        let (mut sum, mut count) = (0.0f64, 0.0f64);
        for theirs in &stages {
            sum += theirs.first().copied().unwrap_or(0.0);
            count += theirs.get(1).copied().unwrap_or(0.0);
        }
        Ok(sum / count.max(1.0))
    }
}

//! Training: the main job. Plans the model, checks everything that can be
//! checked before any memory is touched ([`prepare`]), starts one thread
//! rank per data-parallel rank (each with a compute and a comm lane), and
//! runs the steps (`rank`): batches, the schedule's program, the optimizer,
//! losses, traces and checkpoints. Modules: `prepare` (the checks before
//! any work), `rank` (one rank's start-up and step phases), `hash` (the
//! closing parameter hash), `report` (step reports and the summary).

mod hash;
mod prepare;
mod rank;
mod report;

pub use prepare::{GPU_OVERHEAD, Prepared, memory_need, prepare, prepare_on};
pub use report::{StartupTimes, StepReport, TrainSummary};

use crate::backend::{AttentionBackend, ExpertGemm, Precision};
use crate::checkpoint::{ResumeFrom, RunSettings};
use crate::data::DataChoice;
use crate::error::{Result, RuntimeError};
use crate::fsdp::Sharding;
use crate::optimizer::OptimizerConfig;
use crate::platform::{DeviceChoice, OnPlatform, Platform, RankSettings, Transport, with_platform};
use crate::recompute::Recompute;
use crate::schedule::ScheduleKind;
use crate::setting::{Setting, SettingSpelling};
use crate::trace::TraceRecorder;
use hybridgen_dsl::{ModelConfig, Plan, UnitFilter};
use rank::{RankOutcome, run_rank};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The most tokens one micro-batch may hold on one rank: activations are
/// kept per micro-batch, and a typo should be an error, not an
/// out-of-memory abort.
pub const MAX_MICRO_BATCH_TOKENS: usize = 1 << 22;

/// The longest a rank may wait for its peers: a week. Longer is a typo, and
/// `Instant + timeout` must stay far from overflowing.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// Everything a training run needs.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: ModelConfig,
    /// Ranks of the run: `pp` pipeline stages of `ranks / pp`
    /// data-parallel ranks each ([`TrainConfig::dp`]).
    pub ranks: usize,
    /// Expert-parallel size (divides the data-parallel size).
    pub ep: usize,
    /// Pipeline-parallel size (divides `ranks`): the pattern's `|` segments
    /// (or, without them, an even split of its layers) run on `pp` ranks,
    /// several segments a rank interleaved when there are more than `pp`.
    pub pp: usize,
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Tokens per sequence (defaults to the model's `seq_length`).
    pub seq_length: usize,
    /// Train until the step count reaches this: a resumed run continues
    /// from its checkpoint's step, so a preempted job restarts with the
    /// same configuration and ends where it would have.
    pub steps: u64,
    pub schedule: ScheduleKind,
    pub sharding: Sharding,
    /// Which layers run their forward again in the backward instead of
    /// keeping their activations ([`Recompute`]). `Auto` by default: none
    /// where the run fits, else the fewest that make it fit.
    pub recompute: Recompute,
    /// The attention kernels on GPUs ([`AttentionBackend`]).
    pub attention: AttentionBackend,
    /// How GPUs run the experts' GEMMs ([`ExpertGemm`]).
    pub expert_gemm: ExpertGemm,
    /// Whether GPU kernels launch while the one before them drains
    /// (programmatic dependent launch, Hopper; the same bits either way).
    pub dependent_launch: bool,
    /// How the GPU ranks of one process exchange data ([`Transport`]).
    pub transport: Transport,
    /// Parameters and activations in bf16 or f32 (master weights, gradients
    /// and optimizer state are f32 either way).
    pub precision: Precision,
    pub data: DataChoice,
    pub seed: u64,
    pub optimizer: OptimizerConfig,
    pub unit_filter: UnitFilter,
    /// The checkpoint root to save to, at the end (and every `save_every`
    /// steps): one directory per step (`checkpoint::root`).
    pub save: Option<PathBuf>,
    pub save_every: Option<u64>,
    /// Keep only the newest N steps in the save root.
    pub keep_last: Option<u64>,
    /// Write each checkpoint before the last behind the steps
    /// ([`crate::checkpoint::RankSaves`]):
    /// the steps wait for a copy of each rank's tensors into host memory,
    /// not for the files, at the cost of that copy's host memory until the
    /// files are written. Off: each rank file is streamed from the device
    /// a chunk at a time while the steps wait.
    pub async_save: bool,
    pub resume: Option<ResumeFrom>,
    /// Settings a resume takes from its checkpoint instead of from this
    /// configuration (the CLI lists the flags the user left out). Every
    /// other setting must agree with the checkpoint, except the layout,
    /// which may change (checkpoints reshard).
    pub from_checkpoint: BTreeSet<Setting>,
    /// Write a Chrome trace of every lane here.
    pub trace: Option<PathBuf>,
    /// How long a rank waits for its peers before giving up (at most
    /// [`MAX_TIMEOUT`]).
    pub timeout: Duration,
    /// The memory this process may use, in bytes, for the check before
    /// anything is allocated; `None`: what the operating system reports
    /// available (Linux: `MemAvailable` or a lower cgroup limit; elsewhere
    /// no check).
    pub memory_available: Option<u64>,
    /// A plan made at build time (a `model!` model's `plan`, assembled from
    /// its `const` tables): the run takes it as it is instead of planning
    /// `model` again. It must be `model`'s plan for `ranks` and `ep`; its
    /// units are the ones trained, whatever `unit_filter` says.
    /// [`TrainConfig::from_plan`] sets all of these from it.
    pub plan: Option<Arc<Plan>>,
    /// Where to train: the CPU (the library's default, so a run is the same
    /// everywhere), the GPUs, or `Auto` (the GPUs when a usable one is
    /// visible: `hybridgen train`'s default).
    pub device: DeviceChoice,
    /// Evaluate every N steps: the mean loss over `eval_steps` fixed
    /// batches of held-out data, forward only ([`StepReport::eval_loss`]).
    pub eval_every: Option<u64>,
    /// Batches (each `micro_batches` micro-batches per rank) per evaluation.
    pub eval_steps: u64,
    /// Start from these weights (a Hugging Face folder, checked against
    /// `model`) instead of the seeded initialisation; a fresh run otherwise.
    pub init_from: Option<Arc<crate::hf::HfWeights>>,
    /// How messages name the settings: this configuration's fields by
    /// default (`config.ranks`); a command line hands its flags.
    pub spelling: SettingSpelling,
}

impl TrainConfig {
    /// The defaults of `hybridgen train` for `model`: two thread ranks,
    /// expert parallelism 2 when the model has MoE layers, the overlap
    /// schedule, ZeRO-3, synthetic data.
    pub fn new(model: ModelConfig) -> Self {
        let seq_length = model.seq_length;
        TrainConfig {
            model,
            ranks: 2,
            ep: 2,
            pp: 1,
            micro_batches: 4,
            micro_batch_size: 4,
            seq_length,
            steps: 120,
            schedule: ScheduleKind::Overlap,
            sharding: Sharding::Zero3,
            recompute: Recompute::Auto,
            attention: AttentionBackend::Flash,
            expert_gemm: ExpertGemm::default(),
            dependent_launch: true,
            transport: Transport::default(),
            precision: Precision::F32,
            data: DataChoice::Synthetic,
            seed: 0,
            optimizer: OptimizerConfig::default(),
            unit_filter: UnitFilter::default(),
            save: None,
            save_every: None,
            keep_last: None,
            async_save: false,
            resume: None,
            from_checkpoint: BTreeSet::new(),
            trace: None,
            timeout: crate::collective::DEFAULT_TIMEOUT,
            memory_available: None,
            plan: None,
            device: DeviceChoice::Cpu,
            eval_every: None,
            eval_steps: 10,
            init_from: None,
            spelling: SettingSpelling::FIELDS,
        }
    }

    /// The defaults of [`TrainConfig::new`] for a plan made at build time:
    /// its model, its data-parallel size as `ranks`, its `ep` and unit
    /// filter, and the plan itself, trained as it is.
    ///
    /// ```ignore
    /// let config = TrainConfig::from_plan(Small::plan(&Small::layout(2))?);
    /// ```
    pub fn from_plan(plan: Plan) -> Self {
        let mut config = TrainConfig::new(plan.model.clone());
        config.ranks = plan.layout.dp * plan.layout.pp;
        config.ep = plan.layout.ep;
        config.pp = plan.layout.pp;
        config.unit_filter = plan.unit_filter.clone();
        config.plan = Some(Arc::new(plan));
        config
    }

    /// The settings its checkpoints record and a resume settles against
    /// them, and where it resumes and saves.
    pub fn run_settings(&self) -> RunSettings {
        RunSettings {
            model: self.model.clone(),
            seed: self.seed,
            data: self.data.clone(),
            micro_batches: self.micro_batches,
            micro_batch_size: self.micro_batch_size,
            seq_length: self.seq_length,
            optimizer: self.optimizer.clone(),
            precision: self.precision,
            ranks: self.ranks,
            ep: self.ep,
            pp: self.pp,
            sharding: self.sharding,
            schedule: self.schedule,
            save: self.save.clone(),
            keep_last: self.keep_last,
            resume: self.resume.clone(),
            from_checkpoint: self.from_checkpoint.clone(),
            spelling: self.spelling,
        }
    }

    /// This configuration with `settings` (a resume's, settled against its
    /// checkpoint) in place of its own.
    fn with_run_settings(&self, settings: RunSettings) -> TrainConfig {
        let RunSettings {
            model,
            seed,
            data,
            micro_batches,
            micro_batch_size,
            seq_length,
            optimizer,
            precision,
            ranks,
            ep,
            pp,
            sharding,
            schedule,
            save,
            keep_last,
            resume,
            from_checkpoint,
            spelling,
        } = settings;
        TrainConfig {
            model,
            seed,
            data,
            micro_batches,
            micro_batch_size,
            seq_length,
            optimizer,
            precision,
            ranks,
            ep,
            pp,
            sharding,
            schedule,
            save,
            keep_last,
            resume,
            from_checkpoint,
            spelling,
            ..self.clone()
        }
    }

    /// Data-parallel ranks: the ranks of one pipeline stage.
    pub fn dp(&self) -> usize {
        self.ranks / self.pp.max(1)
    }

    /// Tokens one step trains on, over all ranks.
    pub fn tokens_per_step(&self) -> u64 {
        [
            self.dp(),
            self.micro_batches,
            self.micro_batch_size,
            self.seq_length,
        ]
        .into_iter()
        .fold(1u64, |n, x| n.saturating_mul(x as u64))
    }
}

/// Trains `config` on the platform it asks for (today: thread ranks on the
/// CPU). `on_step` sees every step's report as it completes.
pub fn train(config: &TrainConfig, on_step: &mut dyn FnMut(&StepReport)) -> Result<TrainSummary> {
    let prepared = prepare(config)?;
    train_prepared(&prepared, on_step)
}

/// [`train`] with the checks of [`prepare`] already done (for callers that
/// report a configuration before running it).
pub fn train_prepared(
    prepared: &Prepared,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<TrainSummary> {
    let config = &prepared.config;
    with_platform(
        &prepared.device,
        config.ranks,
        config.timeout,
        config.transport,
        TrainOn {
            prepared,
            on_step,
            begun: Instant::now(),
        },
    )?
}

/// [`train_on`] as work [`with_platform`] runs on the platform it makes.
struct TrainOn<'a> {
    prepared: &'a Prepared,
    on_step: &'a mut dyn FnMut(&StepReport),
    /// When the platform began to be made (its time is start-up's).
    begun: Instant,
}

impl OnPlatform for TrainOn<'_> {
    type Output = Result<TrainSummary>;

    fn run<P: Platform>(self, platform: &P) -> Self::Output {
        let platform_time = self.begun.elapsed();
        train_on(platform, self.prepared, self.on_step).map(|mut summary| {
            summary.startup.platform = platform_time;
            summary
        })
    }
}

/// Trains a prepared run on `platform`'s ranks: a thread per local rank,
/// each building its handles with [`Platform::rank`] and running every step.
/// Reports come from the first rank this process runs.
pub fn train_on<P: Platform>(
    platform: &P,
    prepared: &Prepared,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<TrainSummary> {
    let config = &prepared.config;
    if platform.world() != config.ranks {
        return Err(RuntimeError::Unsupported(format!(
            "the run has {} ranks but {} provides {}; set {} to {}",
            config.ranks,
            platform.describe(),
            platform.world(),
            config.spelling.name(Setting::Ranks),
            platform.world()
        )));
    }
    // Without a trace file, spans are folded into the summary's figures as
    // they come: memory does not grow with the steps and micro-batches run.
    let recorder = Arc::new(match prepared.trace_file {
        Some(_) => TraceRecorder::new(),
        None => TraceRecorder::statistics_only(),
    });
    if config.pp > 1 {
        recorder.name_stages(config.dp());
    }
    let settings = RankSettings {
        ep: prepared.plan.layout.ep,
        pp: prepared.plan.layout.pp,
        precision: config.precision,
        timeout: config.timeout,
        trace: recorder.clone(),
        attention: config.attention,
        expert_gemm: config.expert_gemm,
        dependent_launch: config.dependent_launch,
    };
    let (reports, received) = mpsc::channel::<StepReport>();
    let (mut first_loss, mut final_loss, mut final_eval_loss) = (None, None, None);
    let (mut peak_allocated_bytes, mut reserved_bytes) = (0, 0);
    let started = Instant::now();
    // Reports come from the first rank this process runs (rank 0 unless
    // a launcher started one process per rank): every rank sees the same
    // losses.
    let reporter = platform.local_ranks().start;
    let outcomes: Vec<(usize, Result<RankOutcome>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = platform
            .local_ranks()
            .map(|r| {
                let reports = (r == reporter).then(|| reports.clone());
                let settings = &settings;
                let handle = std::thread::Builder::new()
                    .name(format!("rank-{r}"))
                    .spawn_scoped(scope, move || {
                        let opened = Instant::now();
                        let result = platform.rank(r, settings).and_then(|rank| {
                            run_rank(config, prepared, rank, reports, opened.elapsed())
                        });
                        if let Err(e) = &result {
                            platform.abort(r, &e.to_string());
                        }
                        result
                    });
                (r, handle)
            })
            .collect();
        drop(reports);
        for report in received.iter() {
            first_loss.get_or_insert(report.loss);
            final_loss = Some(report.loss);
            final_eval_loss = report.eval_loss.or(final_eval_loss);
            peak_allocated_bytes = peak_allocated_bytes.max(report.device.peak_in_use_bytes);
            reserved_bytes = reserved_bytes.max(report.device.reserved_bytes);
            on_step(&report);
        }
        handles
            .into_iter()
            .map(|(r, h)| {
                let outcome = match h {
                    Ok(handle) => handle.join().unwrap_or_else(|_| {
                        Err(RuntimeError::Peer {
                            rank: r,
                            message: "panicked".into(),
                        })
                    }),
                    Err(e) => Err(RuntimeError::Unsupported(format!(
                        "cannot start rank {r}: {e}"
                    ))),
                };
                (r, outcome)
            })
            .collect()
    });
    let wall = started.elapsed();
    // The trace of what ran, even when the run failed: it shows where.
    let traced = match (&prepared.trace_file, &config.trace) {
        (Some(file), Some(path)) => write_trace(&recorder, file, path),
        _ => Ok(()),
    };
    let mut first = None;
    let mut failures = Vec::new();
    for (r, outcome) in outcomes {
        match outcome {
            // The first local rank's, as the reports are.
            Ok(o) if first.is_none() => first = Some(o),
            Ok(_) => {}
            Err(e) => failures.push((r, e)),
        }
    }
    if let Some(failure) = root_failure(failures) {
        return Err(failure);
    }
    traced?;
    let RankOutcome {
        param_hash,
        startup,
        hash_time,
        save_time,
        saves_behind,
    } = first
        .ok_or_else(|| RuntimeError::InvalidArgument("no rank returned a parameter hash".into()))?;
    let stats = recorder.stats();
    let comm_busy = stats.iter().map(|s| s.comm_busy).sum();
    let comm_hidden = stats.iter().map(|s| s.hidden).sum();
    let (pp, dp) = (config.pp.max(1), config.dp().max(1));
    let stage_waits = match pp {
        1 => Vec::new(),
        _ => (0..pp)
            .map(|stage| {
                let waits: Vec<f64> = stats
                    .iter()
                    .filter(|s| s.rank / dp == stage)
                    .map(|s| s.waited_fraction())
                    .collect();
                waits.iter().sum::<f64>() / waits.len().max(1) as f64
            })
            .collect(),
    };
    let ideal_bubble = (pp > 1).then(|| {
        let shape = crate::schedule::PipelineShape::of(&prepared.plan);
        let v = shape.virtual_stages().unwrap_or(1).max(1);
        (pp - 1) as f64 / (v * config.micro_batches + pp - 1) as f64
    });
    let start = prepared.resume_step().unwrap_or(0);
    let (steps, last_step) = (config.steps.saturating_sub(start), start.max(config.steps));
    let tokens = config.tokens_per_step() * steps;
    let wall_s = wall.as_secs_f64().max(1e-9);
    let checkpoints = &prepared.checkpoints;
    Ok(TrainSummary {
        steps,
        last_step,
        first_loss,
        final_loss,
        final_eval_loss,
        entropy_floor: prepared.data.entropy_floor(),
        data: prepared.data.describe(),
        tokens,
        wall,
        tokens_per_second: tokens as f64 / wall_s,
        mean_step_time: wall.div_f64(steps.max(1) as f64),
        comm_busy,
        comm_hidden,
        stage_waits,
        ideal_bubble,
        param_hash,
        resumed_from: prepared.resume_step(),
        resumed_dir: checkpoints.resume.as_ref().map(|r| r.dir.clone()),
        saved_to: checkpoints
            .save
            .as_ref()
            .map(|s| s.root.step_dir(last_step)),
        trace: config.trace.clone(),
        startup,
        hash_time,
        save_time,
        saves_behind,
        flops_per_token: hybridgen_dsl::flops::flops_per_token(&config.model, config.seq_length),
        peak_allocated_bytes,
        reserved_bytes,
    })
}

/// Writes the recorded spans as a Chrome trace into the file made by
/// [`prepare`].
fn write_trace(
    recorder: &TraceRecorder,
    file: &std::fs::File,
    path: &std::path::Path,
) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut out, &recorder.chrome_trace())
        .map_err(std::io::Error::from)
        .and_then(|()| out.flush())
        .map_err(|e| RuntimeError::io(path.display(), e))
}

/// The error of a failed run: the first rank that failed on its own (not
/// because a peer aborted), its root cause first, with every rank that
/// failed of the same cause; then the other failures, summarised.
fn root_failure(failures: Vec<(usize, RuntimeError)>) -> Option<RuntimeError> {
    let own = |e: &RuntimeError| !matches!(e.root_cause(), RuntimeError::Peer { .. });
    let at = failures
        .iter()
        .position(|(_, e)| own(e))
        .or((!failures.is_empty()).then_some(0))?;
    let root = failures[at].1.root_cause().to_string();
    let (mut ranks, mut others, mut stopped) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (r, e)) in failures.iter().enumerate() {
        if i == at || (own(e) && e.root_cause().to_string() == root) {
            ranks.push(*r);
        } else if own(e) {
            others.push((*r, e.root_cause().to_string()));
        } else {
            stopped.push(*r);
        }
    }
    let (_, cause) = failures.into_iter().nth(at)?;
    Some(RuntimeError::RankFailed {
        ranks,
        cause: Box::new(cause),
        others,
        stopped,
    })
}

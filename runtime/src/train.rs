//! Training: the main job. Plans the model, checks everything that can be
//! checked before any memory is touched, starts one thread rank per
//! data-parallel rank (each with a compute and a comm lane), and runs the
//! steps: batches, the schedule's program, the optimizer, losses, traces and
//! checkpoints.

use crate::backend::{AttentionBackend, Backend, DeviceStats, ExpertGemm, Precision, Tokens};
use crate::checkpoint::{self, RankSaves, ResumeFrom, RunCheckpoints, RunSetting, SavedState};
use crate::collective::Collective;
use crate::cuda::{GpuDevice, GpuInfo};
use crate::data::{
    BatchKey, BatchShape, ByteFile, DataSource, IndexedSource, IndexedSpec, MarkovChain,
    SampleLayout,
};
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::{FsdpEngine, ShardLayout, Sharding};
use crate::rendezvous::Launch;
use crate::loader::{MicroBatchLoader, StreamRange, micro_batch_tokens};
use crate::memory::{AvailableMemory, ElementSizes, FitHints, MemoryNeed, StateLayout};
use crate::model::ModelRuntime;
use crate::optimizer::{NonFinite, Optimizer, OptimizerConfig};
use crate::platform::{
    ChosenDevice, DeviceChoice, OnPlatform, Platform, RankSettings, Transport, choose_device,
    with_platform,
};
use crate::recompute::Recompute;
use crate::schedule::{
    MicroBatchTokens, Program, ScheduleKind, StepContext, StepReadout, build, build_forward_only,
    run_step,
};
use crate::trace::TraceRecorder;
use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions, UnitFilter};
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

/// Where tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataChoice {
    /// A seeded sparse Markov chain over the model's vocabulary, with a
    /// known entropy floor.
    Synthetic,
    /// A file read as bytes (tokens 0..256).
    File(PathBuf),
    /// Megatron indexed datasets (`--data-path`), split into parts.
    Indexed(IndexedSpec),
}

/// Everything a training run needs.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: ModelConfig,
    /// Data-parallel thread ranks.
    pub ranks: usize,
    /// Expert-parallel size (divides `ranks`).
    pub ep: usize,
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
    /// ([`checkpoint::RankSaves`]):
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
    pub from_checkpoint: BTreeSet<RunSetting>,
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
        config.ranks = plan.layout.dp;
        config.ep = plan.layout.ep;
        config.unit_filter = plan.unit_filter.clone();
        config.plan = Some(Arc::new(plan));
        config
    }

    /// Tokens one step trains on, over all ranks.
    pub fn tokens_per_step(&self) -> u64 {
        [
            self.ranks,
            self.micro_batches,
            self.micro_batch_size,
            self.seq_length,
        ]
        .into_iter()
        .fold(1u64, |n, x| n.saturating_mul(x as u64))
    }
}

/// One step's results, the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// 1-based step number (continuing a resumed run's count).
    pub step: u64,
    /// Main cross-entropy, mean over every token of the step (nats).
    pub loss: f64,
    /// Mean MTP cross-entropy over depths, when the model has MTP.
    pub mtp_loss: Option<f64>,
    /// MoE load-balancing loss, mean over micro-batches and ranks.
    pub aux_loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub elapsed: Duration,
    /// The validation loss after this step's update, on steps that
    /// evaluate (`TrainConfig::eval_every`): the mean cross-entropy over
    /// every token of the fixed evaluation batches.
    pub eval_loss: Option<f64>,
    /// What rank 0's device did for the step (its forward, backward and
    /// optimizer step). Host reads: one per MoE layer and micro-batch (the
    /// all-to-all's counts) and two at the step's end (the loss sums and the
    /// gradient-norm partials); every read waits for the device, so this is
    /// a budget the runtime keeps. Allocations: none after the first step.
    pub device: DeviceStats,
}

/// The closing summary of a run.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub steps: u64,
    /// The step count after the run (includes a resumed checkpoint's).
    pub last_step: u64,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    /// The last evaluation's loss, when the run evaluated.
    pub final_eval_loss: Option<f64>,
    pub entropy_floor: Option<f64>,
    pub data: String,
    pub tokens: u64,
    pub wall: Duration,
    pub tokens_per_second: f64,
    pub mean_step_time: Duration,
    /// Comm-lane busy time summed over ranks, and how much of it overlapped
    /// compute.
    pub comm_busy: Duration,
    pub comm_hidden: Duration,
    /// A hash of every final parameter's bits, in plan order (experts of
    /// every EP rank included): equal hashes mean equal parameters.
    pub param_hash: u64,
    pub resumed_from: Option<u64>,
    /// The checkpoint resumed: its step directory.
    pub resumed_dir: Option<PathBuf>,
    /// The last checkpoint saved: its step directory.
    pub saved_to: Option<PathBuf>,
    /// The time the first local rank's steps waited on checkpoints, all of
    /// them: writing its rank file (with `async_save`, copying its tensors
    /// to host memory instead), waiting for its peers' and the index.
    pub save_time: Duration,
    /// Checkpoints the first local rank wrote behind the steps
    /// (`async_save`); the others streamed (the last step's, or where the
    /// host gave no memory for the copy).
    pub saves_behind: u64,
    pub trace: Option<PathBuf>,
    /// Where the first local rank's start-up went, before its first step.
    pub startup: StartupTimes,
    /// The parameter hash's own time at the end of the run (gathering and
    /// hashing every final parameter on the first local rank).
    pub hash_time: Duration,
    /// The model's FLOPs per token, forward and backward, at the run's
    /// sequence length (`hybridgen_dsl::flops`): what MFU divides by;
    /// `None` for layer kinds the formula does not cover.
    pub flops_per_token: Option<u64>,
}

/// Where a rank's start-up goes, phase by phase, before its first step
/// (the first step's own time is its step report's).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StartupTimes {
    /// The platform: loading the driver and making the world every rank
    /// joins (a launched job's rendezvous included).
    pub platform: Duration,
    /// The device and the communicators: opening the GPU, loading (or
    /// compiling) the kernels, NCCL.
    pub device: Duration,
    /// The parameters: initialising (or reading) them, placing their
    /// shards on the device.
    pub params: Duration,
    /// The time spent drawing (or reading) the values on the host, on a
    /// thread that overlaps it with allocating and uploading: `params` is
    /// at least this, and at most this plus the uploads.
    pub params_drawn: Duration,
    /// The optimizer's state and the step context.
    pub optimizer: Duration,
    /// Loading the checkpoint resumed (zero without one).
    pub resume: Duration,
}

impl StartupTimes {
    pub fn total(&self) -> Duration {
        self.platform + self.device + self.params + self.optimizer + self.resume
    }
}

impl TrainSummary {
    /// The share of comm-lane time hidden under compute.
    pub fn hidden_fraction(&self) -> Option<f64> {
        (!self.comm_busy.is_zero())
            .then(|| self.comm_hidden.as_secs_f64() / self.comm_busy.as_secs_f64())
    }
}

/// The plan and data a run will use, or why the run cannot start. Nothing
/// is allocated on any device before this passes.
pub struct Prepared {
    /// The configuration to run: the given one, with what a resume takes
    /// from its checkpoint.
    pub config: TrainConfig,
    pub plan: Arc<Plan>,
    pub data: DataSource,
    /// The checkpoint resumed and the locked save root.
    pub checkpoints: RunCheckpoints,
    /// What the run needs in memory (checked against what is available):
    /// per process on the CPU, per GPU on GPUs.
    pub memory: MemoryNeed,
    /// The device the run takes.
    pub device: ChosenDevice,
    /// The trace file, created (truncated) up front so a path that cannot be
    /// written fails now rather than after the run.
    trace_file: Option<std::fs::File>,
}

impl Prepared {
    pub fn resume_step(&self) -> Option<u64> {
        self.checkpoints.resume.as_ref().map(|r| r.step())
    }

    /// The layers that recompute their forward in the backward (as
    /// `config.recompute`, settled, chooses them), and those that could:
    /// every layer but the MoE ones.
    pub fn recomputed_layers(&self) -> (usize, usize) {
        let kinds: Vec<_> = crate::memory::layer_kinds(&self.plan).collect();
        (
            self.config.recompute.count(&kinds),
            Recompute::candidates(kinds),
        )
    }
}

/// Checks a configuration completely before any work starts. A resume's
/// checkpoint is read first: the settings it supplies are checked like
/// the rest. The save root is made and locked last.
pub fn prepare(config: &TrainConfig) -> Result<Prepared> {
    prepare_on(config, choose_device(config.device)?)
}

/// [`prepare`] on a device already chosen for `config.device` (the command
/// line chooses it first, for its defaults, and probes the GPUs once).
pub fn prepare_on(config: &TrainConfig, device: ChosenDevice) -> Result<Prepared> {
    let settled = checkpoint::settle(config)?;
    let config = &settled.config;
    let refuse = |m: String| Err(RuntimeError::Unsupported(m));
    if config.ranks == 0 {
        return refuse("--ranks must be at least 1".into());
    }
    if config.ep == 0 || !config.ranks.is_multiple_of(config.ep) {
        return refuse(format!(
            "--ranks {} is not divisible by --ep {}: expert-parallel groups are sets of ep consecutive ranks",
            config.ranks, config.ep
        ));
    }
    if config.micro_batches == 0 || config.micro_batch_size == 0 || config.seq_length == 0 {
        return refuse(format!(
            "micro-batches ({}), micro-batch size ({}) and sequence length ({}) must all be at least 1",
            config.micro_batches, config.micro_batch_size, config.seq_length
        ));
    }
    let rows = config.micro_batch_size.saturating_mul(config.seq_length);
    if rows > MAX_MICRO_BATCH_TOKENS {
        return refuse(format!(
            "a micro-batch of {} sequences x {} tokens is {rows} tokens, over the limit of {MAX_MICRO_BATCH_TOKENS} per rank; \
             use more micro-batches of fewer tokens",
            config.micro_batch_size, config.seq_length
        ));
    }
    config.optimizer.validate()?;
    if let Some(weights) = &config.init_from {
        if settled.resume_dir().is_some() {
            return refuse(
                "--init-from starts a run from other weights, --resume continues one; give one of them".into(),
            );
        }
        weights.check_model(&config.model)?;
    }
    if config.timeout.is_zero() || config.timeout > MAX_TIMEOUT {
        return refuse(format!(
            "the peer timeout of {:?} must lie between 1 ms and {} s (a week)",
            config.timeout,
            MAX_TIMEOUT.as_secs()
        ));
    }
    let available = match (configured_memory(config), &device) {
        (Some(configured), _) => Some(configured),
        (None, ChosenDevice::Cpu { .. }) => crate::memory::available(),
        (None, ChosenDevice::Cuda { info, launch }) => {
            gpu_available(info, launch, config.ranks, config.transport)
        }
    };
    // On GPUs each rank has a device of its own, and its kernels' scratch.
    let gpu_scratch = hybridgen_dsl::Pattern::parse(&config.model.pattern).map_or(0, |p| {
        crate::memory::gpu_kernel_scratch(
            &config.model,
            &p.kinds(),
            Tokens::new(config.micro_batch_size, config.seq_length),
            config.precision.compute_dtype(),
            config.attention,
            (
                crate::cuda::launch::ATTENTION_GEMM_SCRATCH_BYTES,
                crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES,
            ),
        )
    });
    let on_device = |need: MemoryNeed| match &device {
        ChosenDevice::Cpu { .. } => need,
        ChosenDevice::Cuda { .. } => need.on_one_gpu(GPU_OVERHEAD, gpu_scratch),
    };
    // Planning 100,000 layers takes seconds: a bound from the pattern alone
    // refuses what cannot fit first.
    let schedule_live = match config.schedule {
        ScheduleKind::Plain => 1,
        ScheduleKind::Overlap => config.micro_batches.min(2),
    };
    if let Some(available) = &available
        && let Some(need) = MemoryNeed::lower_bound(
            &config.model,
            state_layout(config, 0, 0),
            Tokens::new(config.micro_batch_size, config.seq_length),
            schedule_live,
            ElementSizes::cpu(config.precision),
            config.recompute,
        )
        && let Some(refusal) = on_device(need).check(available, &fit_hints(config))
    {
        return Err(RuntimeError::OutOfMemory(refusal));
    }
    let plan = match &config.plan {
        Some(plan) => {
            check_given_plan(plan, config)?;
            plan.clone()
        }
        None => {
            let options = PlanOptions {
                layout: ParallelLayout::new(config.ranks, config.ep),
                unit_filter: config.unit_filter.clone(),
                ..PlanOptions::default()
            };
            let plan = Plan::new(&config.model, &options)
                .map_err(|d| RuntimeError::Unsupported(d.to_string()))?;
            Arc::new(plan)
        }
    };
    if plan.stages.len() > 1 {
        return refuse("this runtime trains without pipeline parallelism; plan with --pp 1".into());
    }
    // Builds every layer: refuses kinds the runtime lacks (`G`, `D`).
    ModelRuntime::new(plan.clone())?;
    let program = build(&plan.schedule, config.micro_batches.min(3), config.schedule)?;
    let need = |recompute| on_device(need_of(config, &plan, &program, recompute));
    let recompute = settle_recompute(config.recompute, &plan, available.as_ref(), need);
    let memory = need(recompute);
    if let Some(available) = &available
        && let Some(refusal) = memory.check(available, &fit_hints(config))
    {
        return Err(RuntimeError::OutOfMemory(refusal));
    }
    if config.eval_every == Some(0) || (config.eval_every.is_some() && config.eval_steps == 0) {
        return refuse(format!(
            "--eval-every {} --eval-steps {}: both must be at least 1",
            config.eval_every.unwrap_or(0),
            config.eval_steps
        ));
    }
    let data = match &config.data {
        DataChoice::Synthetic => DataSource::Markov(MarkovChain::random(
            config.model.vocab_size,
            4,
            config.seed ^ 0xDA7A,
        )?),
        DataChoice::File(path) => DataSource::Bytes(ByteFile::open(path, config.model.vocab_size)?),
        DataChoice::Indexed(spec) => DataSource::Indexed(Arc::new(IndexedSource::open(
            spec,
            config.model.vocab_size,
            config.seed,
            batch_shape(config),
            SampleLayout {
                ranks: config.ranks,
                micro_batches: config.micro_batches,
            },
            config.eval_every.is_some(),
            crate::data::UPFRONT_TOKEN_SCAN,
        )?)),
    };
    if data.vocab() > config.model.vocab_size {
        return refuse(format!(
            "the data has {} distinct tokens but the model's vocabulary is {}",
            data.vocab(),
            config.model.vocab_size
        ));
    }
    data.check_shape(batch_shape(config))?;
    if config.save_every == Some(0) {
        return refuse("--save-every must be at least 1".into());
    }
    if config.async_save {
        check_async_save(config, &plan, &device, available.as_ref(), &memory)?;
    }
    // Last: the checks that write (the save root, the trace file).
    let trace_file = config.trace.as_deref().map(open_trace).transpose()?;
    let (mut config, checkpoints) = settled.open(&plan)?;
    config.recompute = recompute;
    Ok(Prepared {
        config,
        plan,
        data,
        checkpoints,
        memory,
        device,
        trace_file,
    })
}

/// Refuses `--async-save` without `--save`, and where the host lacks the
/// memory for the copies of the checkpoint tensors it keeps while the files
/// are written: every rank of this process on the CPU, beside the run's
/// own need; on GPUs this process's ranks, times the processes a launcher
/// started on this host (their shares are near equal).
fn check_async_save(
    config: &TrainConfig,
    plan: &Plan,
    device: &ChosenDevice,
    available: Option<&AvailableMemory>,
    memory: &MemoryNeed,
) -> Result<()> {
    if config.save.is_none() {
        return Err(RuntimeError::Unsupported(
            "--async-save writes the checkpoints of --save DIR behind the steps; give --save"
                .into(),
        ));
    }
    let layout = ShardLayout {
        sharding: config.sharding,
        world: config.ranks,
        ep: config.ep,
    };
    let copy = |r| checkpoint::snapshot_bytes(plan, &layout, config.optimizer.kind, r);
    let (host, copies, beside) = match device {
        ChosenDevice::Cpu { .. } => (
            available.cloned(),
            (0..config.ranks).map(copy).sum(),
            memory.total,
        ),
        ChosenDevice::Cuda { launch, .. } => {
            let copies = match launch {
                Launch::SingleProcess => (0..config.ranks).map(copy).sum(),
                Launch::Distributed(info) => copy(info.rank) * info.local_world_size as u64,
            };
            (crate::memory::available(), copies, 0)
        }
    };
    let Some(host) = host else { return Ok(()) };
    if beside.saturating_add(copies) > host.bytes {
        return Err(RuntimeError::OutOfMemory(format!(
            "--async-save keeps a copy of each rank's checkpoint tensors in host memory while the files are written: \
             {} for this host's ranks, beside the run's {}, but {} is available ({})\n\
             tip: leave out --async-save: each rank file is then streamed a chunk at a time while the steps wait",
            crate::memory::bytes(copies),
            crate::memory::bytes(beside),
            crate::memory::bytes(host.bytes),
            host.source
        )));
    }
    Ok(())
}

/// What each GPU holds besides the run's buffers: the CUDA context and
/// loaded kernels (about 500 MiB on Hopper), cuBLAS workspaces of 32 MiB
/// (one a queue, and two more for each queue whose grouped GEMMs spread
/// over side streams), and NCCL's channel buffers (a few hundred MiB with
/// 2 to 8 peers). Measured on an H200 (the side streams' workspaces took
/// the benchmark's peak from 28.2 to 28.4 GiB); the check errs on the
/// safe side.
pub const GPU_OVERHEAD: u64 = 5 << 28;

/// The least free memory among the GPUs this process's ranks run on, as
/// the device reported it when probed; a rank's share of it where ranks
/// share GPUs (the copy transport's ranks beyond the GPUs).
fn gpu_available(
    info: &GpuInfo,
    launch: &Launch,
    ranks: usize,
    transport: Transport,
) -> Option<AvailableMemory> {
    let sharing = match (launch, transport) {
        (Launch::SingleProcess, Transport::Copy) if !info.devices.is_empty() => {
            ranks.div_ceil(info.devices.len()).max(1)
        }
        _ => 1,
    };
    let used: Vec<&GpuDevice> = match launch {
        Launch::SingleProcess => info.devices.iter().take(ranks.max(1)).collect(),
        Launch::Distributed(r) => {
            crate::cuda::platform::launched_gpu(info.devices.len(), r.local_rank)
                .and_then(|gpu| info.devices.get(gpu))
                .into_iter()
                .collect()
        }
    };
    let least = used.into_iter().min_by_key(|d| d.free_memory)?;
    let shared = match sharing {
        1 => String::new(),
        n => format!(", shared by {n} ranks"),
    };
    Some(AvailableMemory {
        bytes: least.free_memory as u64 / sharing as u64,
        source: format!(
            "free on cuda:{} ({}) of {}{shared}",
            least.ordinal,
            least.name,
            crate::memory::bytes(least.total_memory as u64)
        ),
    })
}

/// Refuses a plan given with the configuration that is not the plan of its
/// model and layout: the run would train other shapes than it reports.
fn check_given_plan(plan: &Plan, config: &TrainConfig) -> Result<()> {
    let mut wrong = Vec::new();
    if plan.layout.dp != config.ranks {
        wrong.push(format!(
            "it was made for {} data-parallel ranks, the run has {}",
            plan.layout.dp, config.ranks
        ));
    }
    if plan.layout.ep != config.ep {
        wrong.push(format!(
            "it was made for ep = {}, the run has {}",
            plan.layout.ep, config.ep
        ));
    }
    if plan.model != config.model {
        wrong.push(
            "its model differs from the run's (a resumed checkpoint's model, or one changed after the plan was made)"
                .into(),
        );
    }
    if wrong.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::Unsupported(format!(
        "the plan given with the configuration does not fit the run: {}; make the plan for the run's layout \
         (a model! model's `plan(&Model::layout(ranks))`) or leave `plan` unset to plan at run time",
        wrong.join("; ")
    )))
}

/// What a run of `config` needs in memory on the CPU, from its plan: state
/// per rank, the activations of the micro-batches its schedule keeps in
/// flight. [`Recompute::Auto`] is settled as a CPU run settles it, against
/// `config.memory_available` or else what the host has available.
pub fn memory_need(config: &TrainConfig, plan: &Plan) -> Result<MemoryNeed> {
    let program = build(&plan.schedule, config.micro_batches.min(3), config.schedule)?;
    let available = configured_memory(config).or_else(crate::memory::available);
    let need = |recompute| need_of(config, plan, &program, recompute);
    Ok(need(settle_recompute(
        config.recompute,
        plan,
        available.as_ref(),
        need,
    )))
}

/// `config.memory_available` as the memory check takes it.
fn configured_memory(config: &TrainConfig) -> Option<AvailableMemory> {
    config.memory_available.map(|bytes| AvailableMemory {
        bytes,
        source: "the configured limit".into(),
    })
}

/// [`memory_need`] with `recompute` and the run's schedule `program`.
fn need_of(
    config: &TrainConfig,
    plan: &Plan,
    program: &Program,
    recompute: Recompute,
) -> MemoryNeed {
    MemoryNeed::of_plan(
        plan,
        state_layout(config, program.max_resident_units, program.max_grad_buffers),
        Tokens::new(config.micro_batch_size, config.seq_length),
        program.in_flight(),
        ElementSizes::cpu(config.precision),
        recompute,
    )
}

/// `recompute` with [`Recompute::Auto`] settled for `plan`: the fewest
/// layers recomputed (taken as [`Recompute::Largest`] takes them: those
/// that keep the most first) with which the run's `need` fits
/// `available`. Each layer recomputed keeps its input instead of all it
/// saves, so the need falls as layers are added and a bisection finds the
/// fewest in a few estimates (7 for the 9B's 56 layers). Where even all of them do not fit, all of them: the
/// check then refuses with the figures of the smallest need. Where the
/// memory available is unknown (the check is skipped), none.
fn settle_recompute(
    recompute: Recompute,
    plan: &Plan,
    available: Option<&AvailableMemory>,
    need: impl Fn(Recompute) -> MemoryNeed,
) -> Recompute {
    let (Recompute::Auto, Some(available)) = (recompute, available) else {
        return match recompute {
            Recompute::Auto => Recompute::None,
            fixed => fixed,
        };
    };
    let fits = |n| need(Recompute::Largest(n)).total <= available.bytes;
    let candidates = Recompute::candidates(crate::memory::layer_kinds(plan));
    if !fits(candidates) {
        return Recompute::Full;
    }
    let (mut fewest, mut most) = (0, candidates);
    while fewest < most {
        let mid = fewest + (most - fewest) / 2;
        if fits(mid) {
            most = mid;
        } else {
            fewest = mid + 1;
        }
    }
    match fewest {
        0 => Recompute::None,
        n if n == candidates => Recompute::Full,
        n => Recompute::Largest(n),
    }
}

fn state_layout(config: &TrainConfig, resident_units: usize, grad_buffers: usize) -> StateLayout {
    StateLayout {
        sharding: config.sharding,
        ranks: config.ranks,
        ep: config.ep,
        optimizer: config.optimizer.kind,
        resident_units,
        grad_buffers,
    }
}

fn fit_hints(config: &TrainConfig) -> FitHints {
    FitHints {
        micro_batch_size: config.micro_batch_size,
        seq_length: config.seq_length,
        sharding: config.sharding,
        optimizer: config.optimizer.kind,
        recompute: config.recompute,
    }
}

/// Creates (or truncates) the trace file at `path`, refusing a directory or
/// a missing parent by name.
fn open_trace(path: &std::path::Path) -> Result<std::fs::File> {
    let name = path.display();
    if path.as_os_str().is_empty() {
        return Err(RuntimeError::io(
            "--trace",
            "the path is empty; give a file such as trace.json",
        ));
    }
    if path.is_dir() {
        return Err(RuntimeError::io(
            &name,
            "this is a directory; give a file path such as trace.json inside it",
        ));
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        let why = if parent.exists() {
            "is not a directory"
        } else {
            "does not exist"
        };
        return Err(RuntimeError::io(
            &name,
            format!("cannot write the trace here: {} {why}", parent.display()),
        ));
    }
    std::fs::File::create(path).map_err(|e| RuntimeError::io(&name, e))
}

/// Samples of `seq + 1` tokens: MTP depths read inside them (layers.md,
/// Model), so the plan does not change the shape.
fn batch_shape(config: &TrainConfig) -> BatchShape {
    BatchShape::new(config.micro_batch_size, config.seq_length)
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
            "the run has {} ranks but {} provides {}; set --ranks to {}",
            config.ranks,
            platform.describe(),
            platform.world(),
            platform.world()
        )));
    }
    // Without a trace file, spans are folded into the summary's figures as
    // they come: memory does not grow with the steps and micro-batches run.
    let recorder = Arc::new(match prepared.trace_file {
        Some(_) => TraceRecorder::new(),
        None => TraceRecorder::statistics_only(),
    });
    let settings = RankSettings {
        ep: config.ep,
        precision: config.precision,
        timeout: config.timeout,
        trace: recorder.clone(),
        attention: config.attention,
        expert_gemm: config.expert_gemm,
        dependent_launch: config.dependent_launch,
    };
    let (reports, received) = mpsc::channel::<StepReport>();
    let (mut first_loss, mut final_loss, mut final_eval_loss) = (None, None, None);
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

/// What one rank's run returns.
struct RankOutcome {
    param_hash: u64,
    startup: StartupTimes,
    /// The final parameter hash's time.
    hash_time: Duration,
    /// The checkpoints' time.
    save_time: Duration,
    /// Checkpoints written behind the steps.
    saves_behind: u64,
}

/// One rank's whole run, on the thread that drives it (`opening`: how
/// long its device and communicators took). Returns the parameter hash on
/// rank 0, and where the start-up went.
fn run_rank<D: Device>(
    config: &TrainConfig,
    prepared: &Prepared,
    rank: RankContext<D>,
    reports: Option<mpsc::Sender<StepReport>>,
    opening: Duration,
) -> Result<RankOutcome> {
    let mut startup = StartupTimes {
        device: opening,
        ..StartupTimes::default()
    };
    let phase = Instant::now();
    let r = rank.rank;
    let plan = prepared.plan.clone();
    let model = Arc::new(ModelRuntime::new(plan.clone())?);
    let program = build(&plan.schedule, config.micro_batches, config.schedule)?;
    let ep_rank = rank.ep_rank();
    let drawn = std::sync::atomic::AtomicU64::new(0);
    // A resume overwrites every parameter element this rank holds from the
    // checkpoint (the load refuses one that does not cover them all), so
    // the values are not drawn first: that took 12 s of a 5 B-parameter
    // model's start-up.
    let resuming = prepared.checkpoints.resume.is_some();
    let mut engine = FsdpEngine::new(
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
            drawn.fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
            filled
        },
    )?;
    startup.params = phase.elapsed();
    startup.params_drawn = Duration::from_nanos(drawn.load(std::sync::atomic::Ordering::Relaxed));
    let phase = Instant::now();
    let mut optimizer = Optimizer::new(config.optimizer.clone(), plan.clone(), &engine, &rank)?;
    let places = (0..plan.params.len())
        .map(|p| engine.param_place(p))
        .collect();
    let tokens = Tokens::new(config.micro_batch_size, config.seq_length);
    let cx = Arc::new(StepContext::<D>::new(
        model.clone(),
        rank.ep_group.clone(),
        Arc::new(places),
        tokens,
        1.0 / (config.micro_batches * config.ranks) as f32,
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
    let shape = batch_shape(config);
    let eval_program = config
        .eval_every
        .map(|_| build_forward_only(&plan.schedule, config.micro_batches));
    // This rank's saves, the first behind the steps (`async_save`) given
    // its host memory from now on, while the first steps run.
    let mut saves = prepared.checkpoints.save.as_ref().map(|target| {
        RankSaves::new(
            target,
            config.save_every,
            config.async_save,
            (step, config.steps),
            || {
                let bytes =
                    checkpoint::snapshot_bytes(&plan, &engine.layout(), config.optimizer.kind, r);
                (bytes / 4) as usize
            },
        )
    });
    let depths = plan.mtp_depths();
    // The training stream's micro-batches, made ahead on a thread of their
    // own so the executor never stops issuing work to make one.
    let loader = MicroBatchLoader::start(
        prepared.data.clone(),
        shape,
        depths,
        StreamRange {
            seed: config.seed,
            dp_rank: r,
            first_step: step,
            end_step: config.steps,
            micro_batches: config.micro_batches,
        },
    )?;
    while step < config.steps {
        let started = Instant::now();
        let counted = rank.backend.stats();
        let mut micro_batch = |mb: usize| -> Result<MicroBatchTokens> {
            loader.next(BatchKey {
                seed: config.seed,
                step,
                dp_rank: r,
                micro_batch: mb,
            })
        };
        let totals = &cx.totals;
        let mut norm_partials = |engine: &FsdpEngine<_>, reduced: &[_]| {
            // Its event fails with the lane's synchronize, which run_step
            // calls next.
            let _ = optimizer.norm_partials(
                engine,
                &rank,
                totals.buffer(),
                totals.partials_at(),
                reduced,
            );
        };
        let counts = run_step(
            &program,
            &cx,
            &mut engine,
            &rank,
            &mut micro_batch,
            &mut norm_partials,
        )?;
        // The step's one read: its losses and its gradient-norm partials.
        let StepReadout {
            losses,
            norm_partials,
        } = totals.read(&rank.backend, &counts)?;
        // Every rank's sums, added in rank order: the same bits everywhere.
        let mut mine = vec![losses.main.0, losses.main.1 as f64, losses.aux];
        for (sum, count) in &losses.mtp {
            mine.push(*sum);
            mine.push(*count as f64);
        }
        // The tokens each expert got this step (aux-loss-free balancing),
        // summed over ranks with the losses: integers, exact in f64.
        let loads_at = mine.len();
        mine.extend(cx.balance.take_loads());
        let all = rank.host.all_gather_host(&mine)?;
        let total = |i: usize| {
            all.iter()
                .map(|v| v.get(i).copied().unwrap_or(0.0))
                .fold(0.0, |a, b| a + b)
        };
        let loss = total(0) / total(1).max(1.0);
        let mtp_loss = (depths > 0).then(|| {
            (0..depths)
                .map(|d| total(3 + 2 * d) / total(4 + 2 * d).max(1.0))
                .sum::<f64>()
                / depths as f64
        });
        let aux_loss = total(2) / (config.micro_batches * config.ranks) as f64;
        // The losses are the same on every rank, so every rank stops here
        // together, before an update from non-finite gradients.
        let non_finite = [
            NonFinite::Loss(loss),
            NonFinite::MtpLoss(mtp_loss.unwrap_or(0.0)),
            NonFinite::AuxLoss(aux_loss),
        ]
        .into_iter()
        .find(|q| !q.value().is_finite());
        if let Some(quantity) = non_finite {
            return Err(optimizer.divergence(&engine, &rank, quantity)?);
        }
        let grad_norm = optimizer.step(&engine, &rank, &norm_partials)?;
        if loads_at < mine.len() {
            let loads: Vec<f64> = (loads_at..mine.len()).map(total).collect();
            cx.balance.update(&loads)?;
        }
        let device = rank.backend.stats() - counted;
        let elapsed = started.elapsed();
        step += 1;
        let eval_loss = match (&eval_program, config.eval_every) {
            (Some(program), Some(every)) if step % every == 0 => {
                let eval = Evaluation {
                    program,
                    cx: &cx,
                    data: &prepared.data,
                    shape,
                    seed: config.seed,
                    batches: config.eval_steps,
                };
                Some(eval.run(&mut engine, &rank)?)
            }
            _ => None,
        };
        if let Some(reports) = &reports {
            // The receiver only goes away when the caller stopped listening.
            let _ = reports.send(StepReport {
                step,
                loss,
                mtp_loss,
                aux_loss,
                grad_norm,
                elapsed,
                eval_loss,
                device,
            });
        }
        if let Some(saves) = &mut saves {
            saves.after_step(
                step,
                &SavedState::new(&plan, &engine, &optimizer, &cx.balance),
                &rank,
            )?;
        }
    }
    if let Some(saves) = &mut saves {
        saves.finish(
            step,
            &SavedState::new(&plan, &engine, &optimizer, &cx.balance),
            &rank,
        )?;
    }
    let hashing = Instant::now();
    let param_hash = param_hash(&plan, &engine, &rank)?;
    Ok(RankOutcome {
        param_hash,
        startup,
        hash_time: hashing.elapsed(),
        save_time: saves.as_ref().map_or(Duration::ZERO, |s| s.waited),
        saves_behind: saves.as_ref().map_or(0, |s| s.behind),
    })
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
        // bits on every rank.
        let (mut sum, mut count) = (0.0f64, 0.0f64);
        for k in 0..self.batches as usize {
            for theirs in &all {
                sum += theirs.get(2 * k).copied().unwrap_or(0.0);
                count += theirs.get(2 * k + 1).copied().unwrap_or(0.0);
            }
        }
        Ok(sum / count.max(1.0))
    }
}

/// Every rank's `shard` (f32), by rank, on every rank, into `all` (one
/// vector a rank, reused from bucket to bucket so the host pages are
/// touched once). Shards of one length everywhere (every bucket of the
/// planner's layouts) are gathered on the device and downloaded once; the
/// host exchange's f64 copies they replace took 25 s for the 0.9 B
/// parameters of the benchmark model on two ranks. Shards of different
/// lengths go through the host.
fn every_ranks_shard<D: Device>(
    rank: &RankContext<D>,
    shard: &<D::Backend as Backend>::Buf,
    all: &mut Vec<Vec<f32>>,
) -> Result<()> {
    let backend = &*rank.backend;
    let len = backend.buf_len(shard);
    let n = rank.host.size();
    all.resize_with(n, Vec::new);
    if n == 1 {
        all[0].resize(len, 0.0);
        return backend.download(backend.view(shard)?, &mut all[0]);
    }
    let lengths = rank.host.all_gather_host(&[len as f64])?;
    if lengths.iter().all(|l| l.first() == Some(&(len as f64))) {
        let full = backend.alloc(n * len, crate::view::DType::F32)?;
        rank.host
            .all_gather(backend.view(shard)?, backend.view_mut(&full)?)?;
        for (r, host) in all.iter_mut().enumerate() {
            host.resize(len, 0.0);
            let theirs = backend.view(&full)?.slice(r * len..(r + 1) * len)?;
            backend.download(theirs, host)?;
        }
        return Ok(());
    }
    let mut mine = vec![0.0f32; len];
    backend.download(backend.view(shard)?, &mut mine)?;
    let mine: Vec<f64> = mine.iter().map(|&v| f64::from(v)).collect();
    // f32 -> f64 -> f32 is exact.
    for (host, theirs) in all.iter_mut().zip(rank.host.all_gather_host(&mine)?) {
        host.clear();
        host.extend(theirs.iter().map(|&x| x as f32));
    }
    Ok(())
}

/// The digest ([`crate::digest`]) of every parameter's bits in plan order,
/// experts once per EP rank. Collective; every rank returns it (so does
/// every process of a multi-process job). Buckets are gathered one at a
/// time, so the hash needs the memory of one bucket, not of the model, and
/// each bucket's parameters are hashed in one go, straight from the
/// downloaded shards.
fn param_hash<D: Device>(
    plan: &Plan,
    engine: &FsdpEngine<D>,
    rank: &RankContext<D>,
) -> Result<u64> {
    let ep = rank.ep.max(1);
    let layout = engine.layout();
    let mut digest = crate::digest::StreamDigest::new();
    // Every rank's shard of the bucket in hand, by rank.
    let mut all: Vec<Vec<f32>> = Vec::new();
    // The plan's parameters in runs of one bucket each.
    for params in plan.params.chunk_by(|a, b| a.bucket == b.bucket) {
        let b = params[0].bucket;
        every_ranks_shard(rank, &engine.shards()[b].master, &mut all)?;
        let bucket = &plan.buckets[b];
        let piece = bucket.shard_numel(engine.world_of(bucket)).max(1);
        let mut runs: Vec<&[f32]> = Vec::new();
        for param in params {
            let numel = plan.def(param).numel();
            let copies = if bucket.expert { ep } else { 1 };
            for e in 0..copies {
                // The whole bucket as EP rank `e` holds it is its holders'
                // pieces one after another: the parameter is a run of
                // slices of them (a per-element lookup took 18 s for the
                // 0.9 B parameters of the benchmark model).
                let holders = layout.holders(bucket.expert, e);
                let (mut i, end) = (param.offset, param.offset + numel);
                while i < end {
                    let (j, at) = (i / piece, i % piece);
                    let n = (piece - at).min(end - i);
                    let values = holders
                        .get(j)
                        .and_then(|&r| all.get(r))
                        .and_then(|v| v.get(at..at + n))
                        .ok_or_else(|| RuntimeError::Peer {
                            rank: holders.get(j).copied().unwrap_or(0),
                            message: "sent a parameter shard of the wrong length for the hash"
                                .into(),
                        })?;
                    runs.push(values);
                    i += n;
                }
            }
        }
        digest.extend(&runs);
    }
    Ok(digest.finish())
}

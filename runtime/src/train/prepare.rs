//! The checks before any work: a configuration is settled against the
//! checkpoint it resumes, planned, and checked against the memory
//! available, the data and the save root before any device memory is
//! touched ([`prepare`]).

use super::{MAX_MICRO_BATCH_TOKENS, MAX_TIMEOUT, TrainConfig};
use crate::backend::Tokens;
use crate::checkpoint::{self, RunCheckpoints};
use crate::cuda::{GpuDevice, GpuInfo};
use crate::data::{
    BatchShape, ByteFile, DataChoice, DataSource, IndexedSource, MarkovChain, SampleLayout,
};
use crate::error::{Result, RuntimeError};
use crate::fsdp::ShardLayout;
use crate::memory::{
    AvailableMemory, ElementSizes, FitHints, MemoryNeed, RankProgram, StateLayout,
};
use crate::model::ModelRuntime;
use crate::platform::{ChosenDevice, Transport, choose_device};
use crate::recompute::Recompute;
use crate::rendezvous::Launch;
use crate::schedule::{Instr, Program, ScheduleKind, build};
use crate::setting::Setting;
use hybridgen_dsl::{ParallelLayout, Plan, PlanOptions};
use std::sync::Arc;

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
    pub(super) trace_file: Option<std::fs::File>,
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
    prepare_on(config, choose_device(config.device, config.spelling)?)
}

/// [`prepare`] on a device already chosen for `config.device` (the command
/// line chooses it first, for its defaults, and probes the GPUs once).
pub fn prepare_on(config: &TrainConfig, device: ChosenDevice) -> Result<Prepared> {
    let settled = checkpoint::settle(&config.run_settings())?;
    let config = &config.with_run_settings(settled.settings.clone());
    let refuse = |m: String| Err(RuntimeError::Unsupported(m));
    let spelling = config.spelling;
    // The GPU kernels of `G` and `D` take heads up to a width: refused here,
    // not at the first launch.
    if matches!(device, ChosenDevice::Cuda { .. })
        && let Ok(pattern) = hybridgen_dsl::Pattern::parse(&config.model.pattern)
    {
        let kinds = pattern.kinds();
        if kinds.contains(&hybridgen_dsl::LayerKind::GatedDeltaNet) {
            crate::cuda::ops::delta::check_model(&config.model)?;
        }
        if kinds.contains(&hybridgen_dsl::LayerKind::Dsa) {
            crate::cuda::ops::sparse_attention::check_model(&config.model)?;
        }
    }
    if config.ranks == 0 {
        return refuse(format!(
            "{} must be at least 1",
            spelling.name(Setting::Ranks)
        ));
    }
    if config.pp == 0 || !config.ranks.is_multiple_of(config.pp) {
        return refuse(format!(
            "{} is not divisible by {}: the ranks are pp pipeline stages of ranks / pp \
             data-parallel ranks each; give a {} that is a multiple of {}",
            spelling.given(Setting::Ranks, config.ranks),
            spelling.given(Setting::Pp, config.pp),
            spelling.name(Setting::Ranks),
            spelling.name(Setting::Pp)
        ));
    }
    if config.ep == 0 || !config.dp().is_multiple_of(config.ep) {
        return refuse(format!(
            "{} data-parallel ranks ({} over {}) are not divisible by {}: expert-parallel \
             groups are sets of ep consecutive ranks of one stage; pick an {} that divides {}",
            config.dp(),
            spelling.given(Setting::Ranks, config.ranks),
            spelling.given(Setting::Pp, config.pp),
            spelling.given(Setting::Ep, config.ep),
            spelling.name(Setting::Ep),
            config.dp()
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
    config.optimizer.validate(spelling)?;
    if let Some(weights) = &config.init_from {
        if settled.resume_dir().is_some() {
            return refuse(format!(
                "{} starts a run from other weights, {} continues one; give one of them",
                spelling.name(Setting::InitFrom),
                spelling.name(Setting::Resume)
            ));
        }
        weights.check_model(&config.model, spelling)?;
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
    // Under a pipeline, a stage's share of the whole model's bound.
    if let Some(available) = &available
        && let Some(need) = MemoryNeed::lower_bound(
            &config.model,
            state_layout(config, &parallel_layout(config), 0, 0),
            Tokens::new(config.micro_batch_size, config.seq_length),
            schedule_live,
            ElementSizes::cpu(config.precision),
            config.recompute,
        )
        && let Some(refusal) =
            on_device(need.over_pipeline(config.pp)).check(available, &fit_hints(config))
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
                layout: parallel_layout(config),
                unit_filter: config.unit_filter.clone(),
                ..PlanOptions::default()
            };
            let plan = Plan::new(&config.model, &options)
                .map_err(|d| RuntimeError::Unsupported(d.to_string()))?;
            Arc::new(plan)
        }
    };
    crate::schedule::check_pipeline(&plan, config.micro_batches, spelling)?;
    // Builds every layer: refuses kinds the runtime lacks (`D`).
    ModelRuntime::new(plan.clone())?;
    let programs = rank_programs(config, &plan)?;
    let need = |recompute| on_device(need_of(config, &plan, &programs, recompute));
    let recompute = settle_recompute(config.recompute, &plan, available.as_ref(), need);
    let memory = need(recompute);
    if let Some(available) = &available
        && let Some(refusal) = memory.check(available, &fit_hints(config))
    {
        return Err(RuntimeError::OutOfMemory(refusal));
    }
    if config.eval_every == Some(0) || (config.eval_every.is_some() && config.eval_steps == 0) {
        return refuse(format!(
            "{} {}: both must be at least 1",
            spelling.given(Setting::EvalEvery, config.eval_every.unwrap_or(0)),
            spelling.given(Setting::EvalSteps, config.eval_steps)
        ));
    }
    let data = match &config.data {
        DataChoice::Synthetic => DataSource::Markov(MarkovChain::random(
            config.model.vocab_size,
            4,
            config.seed ^ 0xDA7A,
        )?),
        DataChoice::File(path) => {
            DataSource::Bytes(ByteFile::open(path, config.model.vocab_size, spelling)?)
        }
        DataChoice::Indexed(spec) => DataSource::Indexed(Arc::new(IndexedSource::open(
            spec,
            config.model.vocab_size,
            config.seed,
            batch_shape(config),
            SampleLayout {
                ranks: config.dp(),
                micro_batches: config.micro_batches,
            },
            config.eval_every.is_some(),
            crate::data::UPFRONT_TOKEN_SCAN,
            spelling,
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
        return refuse(format!(
            "{} must be at least 1",
            spelling.name(Setting::SaveEvery)
        ));
    }
    if config.async_save {
        check_async_save(config, &plan, &device, available.as_ref(), &memory)?;
    }
    // Last: the checks that write (the save root, the trace file).
    let trace_file = config
        .trace
        .as_deref()
        .map(|path| open_trace(path, spelling.name(Setting::Trace)))
        .transpose()?;
    let (settings, checkpoints) = settled.open(&plan)?;
    let mut config = config.with_run_settings(settings);
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

/// Refuses `async_save` without `save`, and where the host lacks the
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
    let spelling = config.spelling;
    let async_save = spelling.name(Setting::AsyncSave);
    if config.save.is_none() {
        return Err(RuntimeError::Unsupported(format!(
            "{async_save} writes the checkpoints of {} behind the steps; give {}",
            spelling.given(Setting::Save, "DIR"),
            spelling.name(Setting::Save)
        )));
    }
    let layout = ShardLayout::of(plan, config.sharding);
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
            "{async_save} keeps a copy of each rank's checkpoint tensors in host memory while the files are written: \
             {} for this host's ranks, beside the run's {}, but {} is available ({})\n\
             tip: leave out {async_save}: each rank file is then streamed a chunk at a time while the steps wait",
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

/// The parallel layout `config` asks for.
fn parallel_layout(config: &TrainConfig) -> ParallelLayout {
    ParallelLayout {
        pp: config.pp,
        ..ParallelLayout::new(config.dp(), config.ep)
    }
}

/// Refuses a plan given with the configuration that is not the plan of its
/// model and layout: the run would train other shapes than it reports.
fn check_given_plan(plan: &Plan, config: &TrainConfig) -> Result<()> {
    let mut wrong = Vec::new();
    if plan.layout.dp != config.dp() || plan.layout.pp != config.pp {
        wrong.push(match (plan.layout.pp, config.pp) {
            (1, 1) => format!(
                "it was made for {} data-parallel ranks, the run has {}",
                plan.layout.dp,
                config.dp()
            ),
            (pp, _) => format!(
                "it was made for {pp} pipeline stage{} of {} data-parallel ranks, the run has {} of {}",
                if pp == 1 { "" } else { "s" },
                plan.layout.dp,
                config.pp,
                config.dp()
            ),
        });
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
/// flight; under a pipeline, each pipeline rank's (its stages' buckets and
/// layers, its program's micro-batches in flight), every rank's added up
/// ([`MemoryNeed::stages`]). [`Recompute::Auto`] is settled as a CPU run
/// settles it, against `config.memory_available` or else what the host has
/// available.
pub fn memory_need(config: &TrainConfig, plan: &Plan) -> Result<MemoryNeed> {
    let programs = rank_programs(config, plan)?;
    let available = configured_memory(config).or_else(crate::memory::available);
    let need = |recompute| need_of(config, plan, &programs, recompute);
    Ok(need(settle_recompute(
        config.recompute,
        plan,
        available.as_ref(),
        need,
    )))
}

/// Every pipeline rank's program (checked as it is built), in rank order,
/// as the memory check takes it: 1F1B keeps about pp micro-batches in
/// flight on the first stage, 1 or 2 on the last. Without a pipeline, the
/// one program; its figures settle once a step has three micro-batches,
/// so more are not built.
fn rank_programs(config: &TrainConfig, plan: &Plan) -> Result<Vec<RankProgram>> {
    let micro_batches = match plan.layout.pp {
        1 => config.micro_batches.min(3),
        _ => config.micro_batches,
    };
    (0..plan.layout.pp.max(1))
        .map(|pp_rank| {
            let program = build(plan, pp_rank, micro_batches, config.schedule)?;
            Ok(RankProgram {
                pp_rank,
                layout: state_layout(
                    config,
                    &plan.layout,
                    program.max_resident_units,
                    program.max_grad_buffers,
                ),
                in_flight: program.in_flight(),
                receives: most_receives(&program),
            })
        })
        .collect()
}

/// The most stage-to-stage receives one exchange of `program` makes (each
/// a `[tokens, hidden]` buffer): 0 without a pipeline, at most 2.
fn most_receives(program: &Program) -> usize {
    let mut most = 0;
    for instr in program.instrs() {
        if let Instr::Exchange { recvs, .. } = instr {
            most = most.max(recvs.iter().flatten().count());
            if most >= recvs.len() {
                break;
            }
        }
    }
    most
}

/// `config.memory_available` as the memory check takes it.
fn configured_memory(config: &TrainConfig) -> Option<AvailableMemory> {
    config.memory_available.map(|bytes| AvailableMemory {
        bytes,
        source: "the configured limit".into(),
    })
}

/// [`memory_need`] with `recompute` and the run's pipeline ranks'
/// `programs` (one without a pipeline).
fn need_of(
    config: &TrainConfig,
    plan: &Plan,
    programs: &[RankProgram],
    recompute: Recompute,
) -> MemoryNeed {
    MemoryNeed::of_pipeline(
        plan,
        programs,
        Tokens::new(config.micro_batch_size, config.seq_length),
        ElementSizes::cpu(config.precision),
        recompute,
    )
}

/// `recompute` with [`Recompute::Auto`] settled for `plan`: the fewest
/// layers recomputed (taken as [`Recompute::Largest`] takes them: those
/// that keep the most first) with which the run's `need` fits
/// `available` (under a pipeline, every stage's: the choice is the whole
/// model's, so the stage that needs the most settles it). Each layer recomputed keeps its input instead of all it
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

/// The state `config` keeps on each rank under `layout` (checked: the
/// plan's, or the configuration's ranks and ep once [`prepare_on`] checked
/// them).
fn state_layout(
    config: &TrainConfig,
    layout: &ParallelLayout,
    resident_units: usize,
    grad_buffers: usize,
) -> StateLayout {
    StateLayout {
        sharding: config.sharding,
        ranks: layout.dp,
        ep: layout.ep,
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
/// a missing parent by name (an empty path by its setting's, `setting`).
fn open_trace(path: &std::path::Path, setting: &str) -> Result<std::fs::File> {
    let name = path.display();
    if path.as_os_str().is_empty() {
        return Err(RuntimeError::io(
            setting,
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
pub(super) fn batch_shape(config: &TrainConfig) -> BatchShape {
    BatchShape::new(config.micro_batch_size, config.seq_length)
}

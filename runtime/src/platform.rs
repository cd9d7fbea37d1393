//! Platforms: where a run's ranks come from and which device they drive.
//!
//! Training is written once against [`Device`]; a platform is the one place
//! that knows a concrete device. It says which ranks of the world this
//! process runs and builds each rank's handles (its device bound to a compute
//! and a comm lane, and its communicators) on the thread that will drive the
//! rank. The CPU platform runs every rank as a thread of this process; a GPU
//! platform runs one rank per GPU, either one process per GPU started by
//! torchrun or srun (ranks found with `crate::rendezvous`) or one process
//! driving every local GPU from a thread each.

use crate::backend::{AttentionBackend, ExpertGemm, Precision};
use crate::cpu::CpuBackend;
use crate::cpu::collective::CpuWorld;
use crate::cuda::{CudaPlatform, GpuInfo};
use crate::device::{Cpu, Device, RankContext};
use crate::error::Result;
use crate::error::RuntimeError;
use crate::lane::thread::{CpuLane, LaneConfig};
use crate::rendezvous::Launch;
use crate::setting::{Setting, SettingSpelling};
use crate::trace::TraceRecorder;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// What every rank of a run is built with.
#[derive(Clone)]
pub struct RankSettings {
    /// Expert-parallel size: ranks `r` with equal `r / ep` form an EP group.
    /// The plan's (its checked layout's): at least 1, dividing the ranks.
    pub ep: usize,
    /// Pipeline-parallel size: the run's ranks are `pp` stages of
    /// `ranks / pp` data-parallel ranks each (pp divides the ranks).
    pub pp: usize,
    pub precision: Precision,
    /// How long a rank waits for its peers before reporting them stalled.
    pub timeout: Duration,
    /// Where lanes record what they ran.
    pub trace: Arc<TraceRecorder>,
    /// The attention kernels a GPU rank takes.
    pub attention: AttentionBackend,
    /// How a GPU rank runs the experts' GEMMs.
    pub expert_gemm: ExpertGemm,
    /// Whether a GPU rank's kernels launch while the one before them
    /// drains (programmatic dependent launch, where the GPU has it).
    pub dependent_launch: bool,
}

#[cfg(test)]
impl RankSettings {
    /// What the unit tests build ranks with: f32, EP 1, the default
    /// timeout, a trace that keeps statistics only.
    pub(crate) fn for_tests() -> RankSettings {
        RankSettings {
            ep: 1,
            pp: 1,
            precision: Precision::F32,
            timeout: crate::collective::DEFAULT_TIMEOUT,
            trace: Arc::new(TraceRecorder::statistics_only()),
            attention: AttentionBackend::default(),
            expert_gemm: ExpertGemm::default(),
            dependent_launch: true,
        }
    }
}

/// How the GPU ranks of one process exchange data.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// NCCL: one rank a GPU, in one process or many (torchrun, srun).
    #[default]
    Nccl,
    /// The GPUs' copy engines, between the ranks of one process
    /// ([`crate::cuda::peer_copy`]): all-gathers and all-to-alls take no
    /// SMs, and ranks may share a GPU (more ranks than GPUs puts them
    /// round-robin), which runs the multi-rank code on one GPU.
    Copy,
}

/// The ranks of a run and the device they run on.
pub trait Platform: Sync {
    type Device: Device;

    /// Ranks in the world (every process).
    fn world(&self) -> usize;

    /// The ranks this process runs, each on a thread of its own.
    fn local_ranks(&self) -> Range<usize>;

    /// Rank `r`'s handles. Called on the thread that drives rank `r`, by
    /// every local rank at once (building communicators is collective).
    fn rank(&self, r: usize, settings: &RankSettings) -> Result<RankContext<Self::Device>>;

    /// Makes every rank's collectives fail promptly with an error naming
    /// `rank` and `reason`: a failing rank calls it so its peers stop instead
    /// of waiting for the timeout.
    fn abort(&self, rank: usize, reason: &str);

    /// What the run uses, for people (`2 CPU thread ranks`).
    fn describe(&self) -> String;
}

/// Work written once for every platform: [`with_platform`] runs it on the
/// one it makes. (A closure cannot be generic over the platform, so this
/// trait stands for one.)
pub trait OnPlatform {
    type Output;

    fn run<P: Platform>(self, platform: &P) -> Self::Output;
}

/// Which device a run asks for ([`Setting::Device`]).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum DeviceChoice {
    /// The GPUs when a usable one is visible, the CPU otherwise.
    Auto,
    /// Thread ranks on the CPU.
    #[default]
    Cpu,
    /// NVIDIA GPUs; an error naming what is missing when none is usable.
    Cuda,
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
        })
    }
}

/// The device a run takes, and how it was started.
#[derive(Clone, Debug)]
pub enum ChosenDevice {
    /// The CPU; with [`DeviceChoice::Auto`], why no GPU was taken.
    Cpu { no_gpu: Option<String> },
    /// GPUs, as `probe` found them, started as `launch` says.
    Cuda { info: GpuInfo, launch: Launch },
}

impl ChosenDevice {
    /// What was taken and why, for people ([`DeviceChoice::Auto`] says
    /// which).
    pub fn describe(&self) -> String {
        match self {
            ChosenDevice::Cpu { no_gpu: None } => "the CPU".into(),
            // The reason is `DeviceChoice::Cuda`'s error; here it would only be
            // noise on every machine without a GPU.
            ChosenDevice::Cpu { no_gpu: Some(_) } => "the CPU (no usable GPU)".into(),
            ChosenDevice::Cuda { info, launch } => {
                let n = match launch {
                    Launch::SingleProcess => info.devices.len(),
                    Launch::Distributed(_) => 1,
                };
                let name = info.devices.first().map_or("", |d| d.name.as_str());
                format!("{n} GPU{} ({name})", if n == 1 { "" } else { "s" })
            }
        }
    }

    /// GPUs this process can run ranks on (one per process under a
    /// launcher); `None` on the CPU.
    pub fn local_gpus(&self) -> Option<usize> {
        match self {
            ChosenDevice::Cpu { .. } => None,
            ChosenDevice::Cuda {
                launch: Launch::Distributed(_),
                ..
            } => Some(1),
            ChosenDevice::Cuda { info, .. } => Some(info.devices.len()),
        }
    }

    /// Ranks of the whole job when a launcher says so (torchrun, srun).
    pub fn launched_world(&self) -> Option<usize> {
        match self {
            ChosenDevice::Cuda {
                launch: Launch::Distributed(info),
                ..
            } => Some(info.world_size),
            _ => None,
        }
    }

    pub fn is_gpu(&self) -> bool {
        matches!(self, ChosenDevice::Cuda { .. })
    }
}

/// Resolves `choice`: probes for a usable GPU (driver, device, compute
/// capability, NVRTC, cuBLAS) unless the CPU was asked for, and reads the
/// launcher's variables for a GPU run. A refusal names the setting as
/// `spelling` spells it.
pub fn choose_device(choice: DeviceChoice, spelling: SettingSpelling) -> Result<ChosenDevice> {
    if choice == DeviceChoice::Cpu {
        return Ok(ChosenDevice::Cpu { no_gpu: None });
    }
    match crate::cuda::probe() {
        Ok(info) => Ok(ChosenDevice::Cuda {
            info,
            launch: Launch::from_process_env()?,
        }),
        Err(why) if choice == DeviceChoice::Auto => Ok(ChosenDevice::Cpu {
            no_gpu: Some(why.to_string()),
        }),
        Err(why) => Err(RuntimeError::Device {
            device: "cuda".into(),
            message: format!("{}: {why}", spelling.given(Setting::Device, "cuda")),
        }),
    }
}

/// Makes the platform of `device` for a run of `ranks` ranks whose
/// collectives give up after `timeout` (on GPUs, over `transport`), and
/// runs `work` on it.
pub fn with_platform<W: OnPlatform>(
    device: &ChosenDevice,
    ranks: usize,
    timeout: Duration,
    transport: Transport,
    work: W,
) -> Result<W::Output> {
    match device {
        ChosenDevice::Cpu { .. } => {
            let platform = CpuPlatform::new(ranks, timeout)?;
            Ok(work.run(&platform))
        }
        ChosenDevice::Cuda { info, launch } => {
            let platform = CudaPlatform::new(info, launch.clone(), ranks, transport, timeout)?;
            Ok(work.run(&platform))
        }
    }
}

/// The CPU: every rank is a thread of this process, exchanging through
/// shared memory.
pub struct CpuPlatform {
    world: CpuWorld,
}

impl CpuPlatform {
    /// `ranks` thread ranks whose collectives give up after `timeout`.
    pub fn new(ranks: usize, timeout: Duration) -> Result<Self> {
        Ok(CpuPlatform {
            world: CpuWorld::with_timeout(ranks, timeout)?,
        })
    }
}

impl Platform for CpuPlatform {
    type Device = Cpu;

    fn world(&self) -> usize {
        self.world.size()
    }

    fn local_ranks(&self) -> Range<usize> {
        0..self.world.size()
    }

    fn rank(&self, r: usize, settings: &RankSettings) -> Result<RankContext<Cpu>> {
        rank_context(&self.world, r, settings)
    }

    fn abort(&self, rank: usize, reason: &str) {
        self.world.abort(rank, reason);
    }

    fn describe(&self) -> String {
        let n = self.world.size();
        format!("{n} CPU thread rank{}", if n == 1 { "" } else { "s" })
    }
}

/// Builds one CPU rank: its device (one arena set shared by both lanes),
/// a compute and a comm lane, and its communicators split from the world
/// (`w` is its world rank; the layout is [`RankContext`]'s).
fn rank_context(world: &CpuWorld, w: usize, settings: &RankSettings) -> Result<RankContext<Cpu>> {
    let (ep, pp) = (settings.ep, settings.pp);
    let dp_size = world.size() / pp;
    let (pp_rank, r) = (w / dp_size, w % dp_size);
    let all = world.comm(w)?;
    // Every rank splits in the same order (the splits are collective over
    // the world, then over the stage).
    let dp = all.split(pp_rank)?;
    let pipe = all.split(r)?;
    let ep_group = dp.split(r / ep)?;
    let edp = dp.split(r % ep)?;
    let host = dp.split(0)?;
    let pipe_host = pipe.split(0)?;
    let device = CpuBackend::new(settings.precision);
    let lanes = LaneConfig::default()
        .device(device.clone())
        .rank(w)
        .wait_timeout(settings.timeout.saturating_mul(2))
        .trace(settings.trace.clone());
    Ok(RankContext::<Cpu> {
        rank: r,
        world: dp_size,
        ep,
        pp,
        pp_rank,
        backend: Arc::new(device),
        compute: Arc::new(CpuLane::with_config("compute", lanes.clone())?),
        comm: Arc::new(CpuLane::with_config("comm", lanes)?),
        dp: Arc::new(dp),
        ep_group: Arc::new(ep_group),
        edp: Arc::new(edp),
        host: Arc::new(host),
        pipe: Arc::new(pipe),
        pipe_host: Arc::new(pipe_host),
    })
}

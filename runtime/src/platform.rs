//! Platforms: where a run's ranks come from and which device they drive.
//!
//! Training is written once against [`Device`]; a platform is the one place
//! that knows a concrete device. It says which ranks of the world this
//! process runs and builds each rank's handles (its device bound to a compute
//! and a comm lane, and its communicators) on the thread that will drive the
//! rank. The CPU platform runs every rank as a thread of this process; a GPU
//! platform runs one rank per GPU, either one process per GPU started by
//! torchrun or srun (ranks found with `crate::launch`) or one process
//! driving every local GPU from a thread each.

use crate::backend::Precision;
use crate::cpu::CpuBackend;
use crate::cpu::collective::CpuWorld;
use crate::device::{Cpu, Device, RankContext};
use crate::error::Result;
use crate::lane::thread::{CpuLane, LaneConfig};
use crate::trace::TraceRecorder;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// What every rank of a run is built with.
#[derive(Clone)]
pub struct RankSettings {
    /// Expert-parallel size: ranks `r` with equal `r / ep` form an EP group.
    pub ep: usize,
    pub precision: Precision,
    /// How long a rank waits for its peers before reporting them stalled.
    pub timeout: Duration,
    /// Where lanes record what they ran.
    pub trace: Arc<TraceRecorder>,
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

/// Makes the platform for a run of `ranks` ranks whose collectives give up
/// after `timeout`, and runs `work` on it. The CPU's thread ranks are the
/// only platform so far; the place where a GPU platform will be chosen.
pub fn with_platform<W: OnPlatform>(ranks: usize, timeout: Duration, work: W) -> Result<W::Output> {
    let platform = CpuPlatform::new(ranks, timeout)?;
    Ok(work.run(&platform))
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
/// a compute and a comm lane, and its communicators split from the world.
fn rank_context(world: &CpuWorld, r: usize, settings: &RankSettings) -> Result<RankContext<Cpu>> {
    let ep = settings.ep.max(1);
    let dp = world.comm(r)?;
    let ep_group = dp.split(r / ep)?;
    let edp = dp.split(r % ep)?;
    let host = dp.split(0)?;
    let device = CpuBackend::new(settings.precision);
    let lanes = LaneConfig::default()
        .device(device.clone())
        .rank(r)
        .wait_timeout(settings.timeout.saturating_mul(2))
        .trace(settings.trace.clone());
    Ok(RankContext::<Cpu> {
        rank: r,
        world: world.size(),
        ep,
        backend: Arc::new(device),
        compute: Arc::new(CpuLane::with_config("compute", lanes.clone())?),
        comm: Arc::new(CpuLane::with_config("comm", lanes)?),
        dp: Arc::new(dp),
        ep_group: Arc::new(ep_group),
        edp: Arc::new(edp),
        host: Arc::new(host),
    })
}

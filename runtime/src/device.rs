//! A device: the backend, lane and communicator types one platform uses,
//! bundled so the engine, schedules and trainer are written once.

use crate::backend::Backend;
use crate::collective::Collective;
use crate::cpu::CpuBackend;
use crate::cpu::collective::CpuComm;
use crate::lane::Lane;
use crate::lane::thread::CpuLane;
use std::sync::Arc;

/// The types of one platform.
pub trait Device: Send + Sync + 'static {
    type Backend: Backend;
    type Lane: Lane<Backend = Self::Backend> + 'static;
    type Comm: Collective<Self::Backend> + 'static;
}

/// The CPU: f32 loops, worker-thread lanes, thread ranks.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Device for Cpu {
    type Backend = CpuBackend;
    type Lane = CpuLane;
    type Comm = CpuComm;
}

/// A device buffer of `D`.
pub type Buf<D> = <<D as Device>::Backend as Backend>::Buf;
/// An event of `D`'s lanes.
pub type EventOf<D> = <<D as Device>::Lane as Lane>::Event;

/// One rank's handles: its lanes, its communicators and where it sits in the
/// parallel layout. Ranks are laid out as Megatron does with no tensor or
/// pipeline parallelism: expert-parallel groups are consecutive ranks, so
/// rank `r` is EP rank `r % ep` and expert-data-parallel rank `r / ep`.
pub struct RankContext<D: Device> {
    pub rank: usize,
    /// Data-parallel size (every rank).
    pub world: usize,
    /// Expert-parallel size: the plan's (at least 1, dividing `world`).
    pub ep: usize,
    pub backend: Arc<D::Backend>,
    pub compute: Arc<D::Lane>,
    pub comm: Arc<D::Lane>,
    /// All ranks: dense buckets are sharded over it. Used on the comm lane.
    pub dp: Arc<D::Comm>,
    /// This rank's expert-parallel group: the all-to-alls. Comm lane.
    pub ep_group: Arc<D::Comm>,
    /// This rank's expert-data-parallel group: expert buckets. Comm lane.
    pub edp: Arc<D::Comm>,
    /// All ranks again, for host-side exchanges from the driver thread
    /// (losses, gradient-norm partials), so they never overlap the comm
    /// lane's calls on one communicator.
    pub host: Arc<D::Comm>,
}

impl<D: Device> RankContext<D> {
    pub fn ep_rank(&self) -> usize {
        self.rank % self.ep
    }
}

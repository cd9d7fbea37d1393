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
/// parallel layout. Ranks are laid out as Megatron does with no tensor
/// parallelism: pipeline-parallel outermost, so world rank `w` is pipeline
/// rank `w / dp` and data-parallel rank `w % dp` of its stage; within a
/// stage, expert-parallel groups are consecutive ranks, so data-parallel
/// rank `r` is EP rank `r % ep` and expert-data-parallel rank `r / ep`.
pub struct RankContext<D: Device> {
    /// This rank's data-parallel rank within its pipeline stage.
    pub rank: usize,
    /// Data-parallel size: the ranks of one pipeline stage.
    pub world: usize,
    /// Expert-parallel size: the plan's (at least 1, dividing `world`).
    pub ep: usize,
    /// Pipeline-parallel size (1: no pipeline).
    pub pp: usize,
    /// This rank's pipeline rank: which stages it runs.
    pub pp_rank: usize,
    pub backend: Arc<D::Backend>,
    pub compute: Arc<D::Lane>,
    pub comm: Arc<D::Lane>,
    /// The stage's ranks: dense buckets are sharded over it. Comm lane.
    pub dp: Arc<D::Comm>,
    /// This rank's expert-parallel group: the all-to-alls. Comm lane.
    pub ep_group: Arc<D::Comm>,
    /// This rank's expert-data-parallel group: expert buckets. Comm lane.
    pub edp: Arc<D::Comm>,
    /// The stage's ranks again, for host-side exchanges from the driver
    /// thread (losses, gradient-norm partials), so they never overlap the
    /// comm lane's calls on one communicator.
    pub host: Arc<D::Comm>,
    /// The ranks of every pipeline stage with this rank's data-parallel
    /// rank, by pipeline rank: stage-to-stage transfers. Comm lane.
    pub pipe: Arc<D::Comm>,
    /// `pipe` again, for host-side exchanges from the driver thread (the
    /// stages' sums of the step's losses and norms).
    pub pipe_host: Arc<D::Comm>,
}

impl<D: Device> RankContext<D> {
    pub fn ep_rank(&self) -> usize {
        self.rank % self.ep
    }

    /// This rank's index among every rank of the run.
    pub fn world_rank(&self) -> usize {
        self.pp_rank * self.world + self.rank
    }
}

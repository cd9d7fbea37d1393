//! The CUDA platform: one rank per GPU, either every visible GPU driven by
//! a thread of this process, or one GPU per process for jobs started by
//! torchrun or srun ([`crate::rendezvous`]), NCCL between them either way; or,
//! with the copy transport ([`Transport::Copy`]), the ranks of this process
//! on its GPUs round-robin (several may share one), exchanging through the
//! copy engines.

use super::CudaBackend;
use super::backend::Gpu;
use super::comm::CudaComm;
use super::lane::CudaLane;
use super::nccl::{AbortSignal, NcclComm, NcclUniqueId};
use super::peer_copy::{PeerCopyComm, RetiredEvents};
use super::probe::GpuInfo;
use crate::backend::{AttentionBackend, ExpertGemm};
use crate::collective::Collective;
use crate::cpu::collective::CpuWorld;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::lane::Lane;
use crate::platform::{Platform, RankSettings, Transport};
use crate::rendezvous::{Launch, RankInfo};
use cudarc::driver::{CudaContext, sys};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

/// The types of the CUDA platform.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cuda;

impl Device for Cuda {
    type Backend = CudaBackend;
    type Lane = CudaLane;
    type Comm = CudaComm;
}

/// The GPU a launched process runs on, among the `gpus` it sees: the one
/// of its local rank, or the only one when the launcher gave each process
/// its own (srun's `--gpus-per-task 1` sets `CUDA_VISIBLE_DEVICES` per task).
/// `None` when the local rank has no GPU.
pub fn launched_gpu(gpus: usize, local_rank: usize) -> Option<usize> {
    match gpus {
        1 => Some(0),
        _ => (local_rank < gpus).then_some(local_rank),
    }
}

/// The ranks of a run on GPUs.
pub struct CudaPlatform {
    world: usize,
    local: Range<usize>,
    /// The GPU (ordinal after `CUDA_VISIBLE_DEVICES`) of each local rank.
    ordinals: Vec<usize>,
    names: Vec<String>,
    launch: Launch,
    /// The NCCL id every local rank joins with (one process driving
    /// several GPUs); a launched job gets it through the rendezvous.
    unique_id: Option<NcclUniqueId>,
    /// Raised by the first rank of this process that fails: every other
    /// rank's waits end with an error naming it, and its communicators are
    /// aborted, so nothing waits on a GPU stuck in a collective.
    signal: AbortSignal,
    /// The copy transport's state, when it is the transport.
    copy: Option<CopyTransport>,
}

/// What the copy transport's ranks share, for as long as the platform
/// lives (past every rank's thread).
struct CopyTransport {
    /// The host-side rendezvous of this process's ranks.
    world: CpuWorld,
    /// The events of communicators that are gone.
    retired: Arc<RetiredEvents>,
    /// The peer GPUs' contexts each rank enabled access to, held so that
    /// none is released (taking the access with it) mid-run.
    peers: Mutex<Vec<Arc<CudaContext>>>,
}

impl CudaPlatform {
    /// `ranks` ranks on the GPUs `info` found, started as `launch` says:
    /// alone, a thread per GPU (`ranks` at most the GPUs, or any number on
    /// them round-robin with the copy transport); under torchrun or srun,
    /// this process's rank on GPU `LOCAL_RANK` (or on its only GPU). The
    /// copy transport's collectives give up after `timeout`.
    pub fn new(
        info: &GpuInfo,
        launch: Launch,
        ranks: usize,
        transport: Transport,
        timeout: Duration,
    ) -> Result<Self> {
        let gpus = info.devices.len();
        if let (Transport::Copy, Launch::Distributed(_)) = (transport, &launch) {
            return Err(RuntimeError::Unsupported(
                "the copy transport moves data between the GPUs of one process, but the \
                 launcher started a process a GPU; take the NCCL transport, or start one \
                 process (without torchrun or srun) that drives every GPU"
                    .into(),
            ));
        }
        let (world, local, ordinals) = match &launch {
            Launch::SingleProcess if transport == Transport::Copy => {
                if gpus == 0 {
                    return Err(RuntimeError::Unsupported(
                        "the copy transport found no GPU (CUDA_VISIBLE_DEVICES counts); make \
                         one visible, or train on the CPU"
                            .into(),
                    ));
                }
                (ranks, 0..ranks, (0..ranks).map(|r| r % gpus).collect())
            }
            Launch::SingleProcess => {
                if ranks > gpus {
                    return Err(RuntimeError::Unsupported(format!(
                        "{ranks} ranks need {ranks} GPUs but {gpus} {} visible \
                         (CUDA_VISIBLE_DEVICES counts); take fewer ranks, the copy transport \
                         (ranks on the GPUs round-robin), or one process per GPU on several \
                         machines started by torchrun or srun",
                        if gpus == 1 { "is" } else { "are" }
                    )));
                }
                (ranks, 0..ranks, (0..ranks).collect())
            }
            Launch::Distributed(RankInfo {
                rank,
                world_size,
                local_rank,
                ..
            }) => {
                if *world_size != ranks {
                    return Err(RuntimeError::Unsupported(format!(
                        "the launcher started {world_size} processes (WORLD_SIZE) but the run \
                         has {ranks} ranks; take {world_size} ranks, one per process"
                    )));
                }
                let Some(ordinal) = launched_gpu(gpus, *local_rank) else {
                    return Err(RuntimeError::Unsupported(format!(
                        "this process is local rank {local_rank} but {gpus} GPUs are \
                         visible; start at most one process per GPU (torchrun's \
                         --nproc-per-node), or give each process one GPU (srun's \
                         --gpus-per-task 1)"
                    )));
                };
                (*world_size, *rank..*rank + 1, vec![ordinal])
            }
        };
        if world > 1 && transport == Transport::Nccl && !info.nccl {
            return Err(RuntimeError::Device {
                device: "cuda".into(),
                message: "a run on more than one GPU needs NCCL, and libnccl.so.2 could not \
                          be loaded; install NCCL (or put it on LD_LIBRARY_PATH), or train on \
                          one GPU"
                    .into(),
            });
        }
        let names = ordinals
            .iter()
            .map(|&o| info.devices[o].name.clone())
            .collect();
        let unique_id = match (&launch, world, transport) {
            (Launch::SingleProcess, 2.., Transport::Nccl) => Some(NcclUniqueId::new()?),
            _ => None,
        };
        let copy = match transport {
            Transport::Copy => Some(CopyTransport {
                world: CpuWorld::with_timeout(world, timeout)?,
                retired: Arc::new(RetiredEvents::default()),
                peers: Mutex::new(Vec::new()),
            }),
            Transport::Nccl => None,
        };
        Ok(CudaPlatform {
            world,
            local,
            ordinals,
            names,
            launch,
            unique_id,
            signal: AbortSignal::new(),
            copy,
        })
    }
}

/// Lets `context`'s kernels and copies reach the memory of the other GPUs
/// this process's ranks run on, where the hardware can (NVLink or PCIe peer
/// access): the copy transport's peer copies then go GPU to GPU instead of
/// through the host. Returns the peers' contexts, which must outlive the
/// run.
fn enable_peer_access(
    context: &CudaContext,
    ordinals: &[usize],
    name: &str,
) -> Result<Vec<Arc<CudaContext>>> {
    let fail = |what: &str, e: sys::CUresult| RuntimeError::Device {
        device: name.to_string(),
        message: format!("{what}: {e:?}"),
    };
    context
        .bind_to_thread()
        .map_err(|e| fail("binding the context", e.0))?;
    let mine = context.cu_device();
    let mut others: Vec<usize> = ordinals
        .iter()
        .copied()
        .filter(|&o| o != context.ordinal())
        .collect();
    others.sort_unstable();
    others.dedup();
    let mut peers = Vec::new();
    for ordinal in others {
        let peer = CudaContext::new(ordinal).map_err(|e| fail("opening a peer GPU", e.0))?;
        let mut can = 0;
        // SAFETY: both are valid device handles; `can` outlives the call.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, mine, peer.cu_device()) }
            .result()
            .map_err(|e| fail("asking for peer access", e.0))?;
        if can == 0 {
            continue;
        }
        // SAFETY: `peer`'s primary context is live; this context is current.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            }
            e => return Err(fail("enabling peer access", e)),
        }
        peers.push(peer);
    }
    Ok(peers)
}

impl Platform for CudaPlatform {
    type Device = Cuda;

    fn world(&self) -> usize {
        self.world
    }

    fn local_ranks(&self) -> Range<usize> {
        self.local.clone()
    }

    fn rank(&self, r: usize, settings: &RankSettings) -> Result<RankContext<Cuda>> {
        let ordinal = self.ordinals[r - self.local.start];
        let gpu = Gpu::open(ordinal, settings.precision, settings.timeout)?;
        gpu.kernels.set_dependent_launch(settings.dependent_launch);
        let host = gpu
            .backend("host")?
            .with_flash_attention(settings.attention == AttentionBackend::Flash)
            .with_grouped_gemm(settings.expert_gemm == ExpertGemm::Grouped);
        let wait = settings.timeout.saturating_mul(2);
        let trace = Some(settings.trace.clone());
        let compute = CudaLane::on_gpu("compute", &host, r, wait, trace.clone())?;
        let comm = CudaLane::on_gpu("comm", &host, r, wait, trace)?;
        // The plan's checked layout: at least 1 and dividing the ranks
        // (`RankSettings::ep`), so the EP and expert-data-parallel splits
        // below divide by it as it is.
        let (ep, pp) = (settings.ep, settings.pp);
        let dp_size = self.world / pp;
        let (pp_rank, dp_rank) = (r / dp_size, r % dp_size);
        let on_comm = comm.backend();
        // From the world: the stage's ranks (split by pipeline rank), then
        // its EP, expert-data-parallel and host groups; the pipe (split by
        // data-parallel rank) and its host copy. Every rank splits in the
        // same order (the splits are collective over the world, then over
        // the stage).
        let groups = |world: CudaComm| -> Result<[CudaComm; 6]> {
            let stage = world.split(pp_rank)?;
            let pipe = world.split(dp_rank)?;
            let ep_group = stage.split(dp_rank / ep)?;
            let edp = stage.split(dp_rank % ep)?;
            let host_comm = stage.split_onto(&host)?;
            let pipe_host = pipe.split_onto(&host)?;
            Ok([stage, ep_group, edp, host_comm, pipe, pipe_host])
        };
        let [dp, ep_group, edp, host_comm, pipe, pipe_host] = if let Some(copy) = &self.copy {
            let peers = enable_peer_access(gpu.context(), &self.ordinals, gpu.name())?;
            let reachable = peers.iter().map(|p| p.cu_ctx() as usize).collect();
            copy.peers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(peers);
            groups(CudaComm::copy(PeerCopyComm::new(
                copy.world.comm(r)?,
                on_comm.clone(),
                copy.retired.clone(),
                reachable,
            )?))?
        } else if self.world == 1 {
            let world = CudaComm::solo(on_comm);
            [
                world.split(0)?,
                world.split(0)?,
                world.split(0)?,
                CudaComm::solo(&host),
                world,
                CudaComm::solo(&host),
            ]
        } else {
            let stream = on_comm.stream().clone();
            let (timeout, signal) = (settings.timeout, self.signal.clone());
            let world = match (&self.launch, &self.unique_id) {
                (Launch::Distributed(info), _) => {
                    NcclComm::from_rendezvous(info, stream, timeout, signal)?
                }
                (Launch::SingleProcess, Some(id)) => {
                    NcclComm::from_unique_id(id, r, self.world, stream, timeout, signal)?
                }
                (Launch::SingleProcess, None) => {
                    return Err(RuntimeError::InvalidArgument(
                        "a multi-GPU platform without an NCCL id".into(),
                    ));
                }
            };
            groups(CudaComm::nccl(world, on_comm.queue_index()))?
        };
        let [dp, ep_group, edp, host_comm, pipe, pipe_host] =
            [dp, ep_group, edp, host_comm, pipe, pipe_host].map(Arc::new);
        // A wait on this GPU also ends when a peer failed or NCCL reported
        // an error: the communicators are aborted, so their kernels end.
        let comms: Vec<Weak<CudaComm>> = [&dp, &ep_group, &edp, &host_comm, &pipe, &pipe_host]
            .into_iter()
            .map(Arc::downgrade)
            .collect();
        let signal = self.signal.clone();
        gpu.queues().set_watch(Arc::new(move || {
            for comm in comms.iter().filter_map(Weak::upgrade) {
                let Some(nccl) = comm.as_nccl() else {
                    continue;
                };
                if let Some(cause) = signal.cause() {
                    nccl.abort_with(cause.rank, &cause.reason);
                }
                nccl.check()?;
            }
            Ok(())
        }));
        Ok(RankContext::<Cuda> {
            rank: dp_rank,
            world: dp_size,
            ep,
            pp,
            pp_rank,
            backend: Arc::new(host),
            compute: Arc::new(compute),
            comm: Arc::new(comm),
            dp,
            ep_group,
            edp,
            host: host_comm,
            pipe,
            pipe_host,
        })
    }

    fn abort(&self, rank: usize, reason: &str) {
        self.signal.raise(rank, reason);
        if let Some(copy) = &self.copy {
            copy.world.abort(rank, reason);
        }
    }

    fn describe(&self) -> String {
        let n = self.local.len();
        let mut names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        names.dedup();
        match &self.launch {
            Launch::SingleProcess if self.copy.is_some() => {
                let gpus = self.ordinals.iter().max().map_or(0, |m| m + 1);
                format!(
                    "{n} rank{} on {gpus} GPU{} ({}), copy transport",
                    if n == 1 { "" } else { "s" },
                    if gpus == 1 { "" } else { "s" },
                    names.join(", ")
                )
            }
            Launch::SingleProcess => format!(
                "{n} GPU{} ({})",
                if n == 1 { "" } else { "s" },
                names.join(", ")
            ),
            Launch::Distributed(info) => format!(
                "GPU {} ({}) as rank {} of {} processes",
                self.ordinals[0],
                names.join(", "),
                info.rank,
                info.world_size
            ),
        }
    }
}

impl std::fmt::Debug for CudaPlatform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::{CudaPlatform, launched_gpu};
    use crate::cuda::{GpuDevice, GpuInfo};
    use crate::error::RuntimeError;
    use crate::platform::{Platform, Transport};
    use crate::rendezvous::{Launch, Launcher, RankInfo};
    use std::time::Duration;

    fn platform(
        info: &GpuInfo,
        launch: Launch,
        ranks: usize,
        transport: Transport,
    ) -> crate::error::Result<CudaPlatform> {
        CudaPlatform::new(info, launch, ranks, transport, Duration::from_secs(60))
    }

    fn info(gpus: usize, nccl: bool) -> GpuInfo {
        GpuInfo {
            driver_version: 13000,
            nvrtc_version: (13, 0),
            nccl,
            devices: (0..gpus)
                .map(|ordinal| GpuDevice {
                    ordinal,
                    name: "NVIDIA H200".into(),
                    compute_capability: (9, 0),
                    total_memory: 140 << 30,
                    free_memory: 139 << 30,
                })
                .collect(),
        }
    }

    fn launched(rank: usize, world_size: usize, local_rank: usize) -> Launch {
        Launch::Distributed(RankInfo {
            rank,
            world_size,
            local_rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            launcher: Launcher::Torchrun,
        })
    }

    fn refusal(info: &GpuInfo, launch: Launch, ranks: usize) -> String {
        refusal_on(info, launch, ranks, Transport::Nccl)
    }

    fn refusal_on(info: &GpuInfo, launch: Launch, ranks: usize, transport: Transport) -> String {
        match platform(info, launch, ranks, transport) {
            Ok(p) => panic!("accepted: {p:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// Layouts the GPUs cannot run are refused before any device is
    /// touched, saying what to change.
    #[test]
    fn impossible_gpu_layouts_are_refused_with_what_to_change() {
        let m = refusal(&info(1, true), Launch::SingleProcess, 2);
        assert!(m.contains("2 ranks need 2 GPUs but 1 is visible"), "{m}");
        assert!(m.contains("the copy transport"), "{m}");
        let m = refusal_on(&info(8, true), launched(0, 8, 0), 8, Transport::Copy);
        assert!(
            m.contains("the copy transport") && m.contains("the NCCL transport"),
            "{m}"
        );
        let m = refusal(&info(8, true), launched(0, 4, 0), 8);
        assert!(
            m.contains("started 4 processes") && m.contains("take 4 ranks"),
            "{m}"
        );
        let m = refusal(&info(2, true), launched(3, 4, 3), 4);
        assert!(m.contains("local rank 3 but 2 GPUs"), "{m}");
        let err = platform(&info(2, false), Launch::SingleProcess, 2, Transport::Nccl).unwrap_err();
        assert!(matches!(err, RuntimeError::Device { .. }), "{err}");
        assert!(err.to_string().contains("needs NCCL"), "{err}");
    }

    /// One GPU needs no NCCL; a launched process runs its own rank on its
    /// local rank's GPU.
    #[test]
    fn possible_layouts_describe_what_they_run() {
        let one = platform(&info(1, false), Launch::SingleProcess, 1, Transport::Nccl).unwrap();
        assert_eq!(one.describe(), "1 GPU (NVIDIA H200)");
        let third = platform(&info(8, true), launched(10, 16, 2), 16, Transport::Nccl).unwrap();
        assert_eq!(third.world(), 16);
        assert_eq!(third.local_ranks(), 10..11);
        assert_eq!(
            third.describe(),
            "GPU 2 (NVIDIA H200) as rank 10 of 16 processes"
        );
    }

    /// The copy transport puts any number of ranks on the GPUs round-robin,
    /// without NCCL.
    #[test]
    fn the_copy_transport_shares_gpus_round_robin_without_nccl() {
        let shared = platform(&info(1, false), Launch::SingleProcess, 3, Transport::Copy).unwrap();
        assert_eq!(shared.world(), 3);
        assert_eq!(shared.ordinals, [0, 0, 0]);
        assert_eq!(
            shared.describe(),
            "3 ranks on 1 GPU (NVIDIA H200), copy transport"
        );
        let spread = platform(&info(2, false), Launch::SingleProcess, 3, Transport::Copy).unwrap();
        assert_eq!(spread.ordinals, [0, 1, 0]);
        let one_each =
            platform(&info(4, false), Launch::SingleProcess, 2, Transport::Copy).unwrap();
        assert_eq!(one_each.ordinals, [0, 1]);
    }

    #[test]
    fn a_launched_process_takes_its_local_ranks_gpu_or_its_only_one() {
        assert_eq!(launched_gpu(8, 3), Some(3));
        assert_eq!(launched_gpu(1, 3), Some(0), "srun's --gpus-per-task 1");
        assert_eq!(launched_gpu(1, 0), Some(0));
        assert_eq!(launched_gpu(2, 2), None);
        assert_eq!(launched_gpu(0, 0), None);
    }
}

//! The CUDA device's communicator: NCCL between GPUs, the copy transport
//! between the GPUs (or ranks sharing a GPU) of this process
//! ([`super::peer_copy`]), and a group of one (a run on one GPU, or a
//! group the layout makes of one rank, such as the expert-parallel group at
//! `--ep 1`) without either, so one GPU trains without libnccl.
//!
//! A communicator is bound to one queue's stream (the comm lane's, or the
//! rank's host queue for host-side exchanges): its collectives are enqueued
//! there, and the buffers they touch are noted as used by that queue, so
//! their arena regions are fenced on it when they are dropped.

use super::CudaBackend;
use super::buffer::{view_mut_on, view_on};
use super::launch::GpuView;
use super::nccl::NcclComm;
use super::peer_copy::PeerCopyComm;
use super::queue::QueueSet;
use crate::backend::{Slice, SliceMut};
use crate::collective::Collective;
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use cudarc::driver::{CudaStream, result};
use std::sync::Arc;

/// A group of one rank on one GPU: every collective is a copy or nothing.
pub struct SoloComm {
    queues: Arc<QueueSet>,
    stream: Arc<CudaStream>,
}

enum Group {
    Solo(SoloComm),
    Nccl(Box<NcclComm>),
    Copy(Box<PeerCopyComm>),
}

/// One rank's communicator on a GPU.
pub struct CudaComm {
    group: Group,
    /// The queue (stream index) the collectives run on.
    queue: usize,
}

impl CudaComm {
    /// A group of one, running on `backend`'s queue.
    pub fn solo(backend: &CudaBackend) -> CudaComm {
        CudaComm {
            group: Group::Solo(SoloComm {
                queues: backend.gpu().queues().clone(),
                stream: backend.stream().clone(),
            }),
            queue: backend.queue_index(),
        }
    }

    /// NCCL's communicator on `stream`'s queue `queue`.
    pub fn nccl(comm: NcclComm, queue: usize) -> CudaComm {
        CudaComm {
            group: Group::Nccl(Box::new(comm)),
            queue,
        }
    }

    /// The copy transport's communicator on its backend's queue.
    pub fn copy(comm: PeerCopyComm) -> CudaComm {
        let queue = comm.backend().queue_index();
        CudaComm {
            group: Group::Copy(Box::new(comm)),
            queue,
        }
    }

    /// The NCCL communicator, when the group is NCCL's.
    pub fn as_nccl(&self) -> Option<&NcclComm> {
        match &self.group {
            Group::Nccl(comm) => Some(comm),
            Group::Solo(_) | Group::Copy(_) => None,
        }
    }

    /// A new communicator of the same members on another queue (NCCL:
    /// `ncclCommSplit` with one colour), for host-side exchanges that must
    /// not queue behind the comm lane's collectives.
    pub fn split_onto(&self, backend: &CudaBackend) -> Result<CudaComm> {
        Ok(match &self.group {
            Group::Solo(_) => CudaComm::solo(backend),
            Group::Nccl(comm) => CudaComm {
                group: Group::Nccl(Box::new(comm.split_on(0, backend.stream().clone())?)),
                queue: backend.queue_index(),
            },
            Group::Copy(comm) => CudaComm::copy(comm.split_on(0, backend)?),
        })
    }

    fn v(&self, view: Slice<'_, CudaBackend>) -> GpuView {
        view_on(view, self.queue)
    }

    fn m(&self, view: &SliceMut<'_, CudaBackend>) -> GpuView {
        view_mut_on(view, self.queue)
    }
}

fn mismatch(op: &str, message: String) -> RuntimeError {
    RuntimeError::InvalidArgument(format!("{op}: {message}"))
}

impl SoloComm {
    fn copy(&self, op: &str, src: GpuView, dst: GpuView) -> Result<()> {
        if src.dtype != dst.dtype || src.len != dst.len {
            return Err(mismatch(
                op,
                format!(
                    "a group of one rank sends {} x {} and receives {} x {}; they must match",
                    src.len, src.dtype, dst.len, dst.dtype
                ),
            ));
        }
        let bytes = src.len * src.dtype.bytes();
        if bytes == 0 || src.ptr == dst.ptr {
            return Ok(());
        }
        // SAFETY: both views hold `bytes` bytes of live buffers.
        unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, bytes, self.stream.cu_stream()) }
            .map_err(|e| self.queues.error(op, e))
    }
}

impl Collective<CudaBackend> for CudaComm {
    fn rank(&self) -> usize {
        match &self.group {
            Group::Solo(_) => 0,
            Group::Nccl(comm) => comm.rank(),
            Group::Copy(comm) => comm.rank(),
        }
    }

    fn size(&self) -> usize {
        match &self.group {
            Group::Solo(_) => 1,
            Group::Nccl(comm) => comm.size(),
            Group::Copy(comm) => comm.size(),
        }
    }

    fn all_gather(
        &self,
        shard: Slice<'_, CudaBackend>,
        full: SliceMut<'_, CudaBackend>,
    ) -> Result<()> {
        match &self.group {
            Group::Solo(solo) => solo.copy("all_gather", self.v(shard), self.m(&full)),
            Group::Nccl(comm) => comm.all_gather(self.v(shard), self.m(&full)),
            Group::Copy(comm) => comm.all_gather(shard, full),
        }
    }

    fn reduce_scatter(
        &self,
        full: Slice<'_, CudaBackend>,
        shard: SliceMut<'_, CudaBackend>,
    ) -> Result<()> {
        if full.dtype() != DType::F32 {
            return Err(mismatch(
                "reduce_scatter",
                format!(
                    "`full` is {}, but gradients are reduced in f32",
                    full.dtype()
                ),
            ));
        }
        match &self.group {
            Group::Solo(solo) => solo.copy("reduce_scatter", self.v(full), self.m(&shard)),
            Group::Nccl(comm) => comm.reduce_scatter(self.v(full), self.m(&shard)),
            Group::Copy(comm) => comm.reduce_scatter(full, shard),
        }
    }

    fn all_reduce(&self, buf: SliceMut<'_, CudaBackend>) -> Result<()> {
        if buf.dtype() != DType::F32 {
            return Err(mismatch(
                "all_reduce",
                format!("`buf` is {}, but sums are taken in f32", buf.dtype()),
            ));
        }
        match &self.group {
            Group::Solo(_) => Ok(()),
            Group::Nccl(comm) => comm.all_reduce(self.m(&buf)),
            Group::Copy(comm) => comm.all_reduce(buf),
        }
    }

    fn all_to_all(
        &self,
        send: Slice<'_, CudaBackend>,
        send_counts: &[usize],
        recv: SliceMut<'_, CudaBackend>,
        recv_counts: &[usize],
    ) -> Result<()> {
        match &self.group {
            Group::Solo(solo) => {
                let (send, recv) = (self.v(send), self.m(&recv));
                if send_counts != [send.len] || recv_counts != [recv.len] {
                    return Err(mismatch(
                        "all_to_all",
                        format!(
                            "a group of one rank takes one count each, equal to the views' \
                             lengths; got send counts {send_counts:?} for {} elements and \
                             receive counts {recv_counts:?} for {}",
                            send.len, recv.len
                        ),
                    ));
                }
                solo.copy("all_to_all", send, recv)
            }
            Group::Nccl(comm) => {
                comm.all_to_all(self.v(send), send_counts, self.m(&recv), recv_counts)
            }
            Group::Copy(comm) => comm.all_to_all(send, send_counts, recv, recv_counts),
        }
    }

    fn all_to_all_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        match &self.group {
            Group::Solo(_) => match send {
                [only] => Ok(vec![only.clone()]),
                _ => Err(mismatch(
                    "all_to_all_counts",
                    format!("a group of one rank takes one vector, got {}", send.len()),
                )),
            },
            Group::Nccl(comm) => comm.all_to_all_counts(send),
            Group::Copy(comm) => comm.host().all_to_all_counts(send),
        }
    }

    fn all_gather_host(&self, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        match &self.group {
            Group::Solo(_) => Ok(vec![values.to_vec()]),
            Group::Nccl(comm) => comm.all_gather_host(values),
            Group::Copy(comm) => comm.host().all_gather_host(values),
        }
    }

    fn barrier(&self) -> Result<()> {
        match &self.group {
            Group::Solo(_) => Ok(()),
            Group::Nccl(comm) => comm.barrier(),
            Group::Copy(comm) => comm.host().barrier(),
        }
    }

    fn send_recv(
        &self,
        send: Option<(Slice<'_, CudaBackend>, usize)>,
        recv: Option<(SliceMut<'_, CudaBackend>, usize)>,
    ) -> Result<()> {
        match &self.group {
            Group::Solo(_) => {
                let peers: Vec<String> = [
                    send.as_ref().map(|(_, to)| format!("send to rank {to}")),
                    recv.as_ref()
                        .map(|(_, from)| format!("receive from rank {from}")),
                ]
                .into_iter()
                .flatten()
                .collect();
                let asked = if peers.is_empty() {
                    "neither a send nor a receive was given".to_string()
                } else {
                    format!("asked to {}", peers.join(" and "))
                };
                Err(mismatch(
                    "send_recv",
                    format!(
                        "a group of one rank has no peer to send to or receive from ({asked}); \
                         point-to-point transfers need a group of two ranks or more"
                    ),
                ))
            }
            Group::Nccl(comm) => comm.send_recv(
                send.map(|(view, to)| (self.v(view), to)),
                recv.map(|(view, from)| (self.m(&view), from)),
            ),
            Group::Copy(comm) => comm.send_recv(send, recv),
        }
    }

    fn exchange(
        &self,
        sends: Vec<(Slice<'_, CudaBackend>, usize)>,
        recvs: Vec<(SliceMut<'_, CudaBackend>, usize)>,
    ) -> Result<()> {
        match &self.group {
            // An NCCL send waits on its stream for its receive: one group,
            // or two neighbours sending to each other first would wait on
            // each other.
            Group::Nccl(comm) if !sends.is_empty() || !recvs.is_empty() => {
                let sends: Vec<(GpuView, usize)> =
                    sends.into_iter().map(|(v, to)| (self.v(v), to)).collect();
                let recvs: Vec<(GpuView, usize)> =
                    recvs.iter().map(|(v, from)| (self.m(v), *from)).collect();
                comm.send_recv_all(&sends, &recvs)
            }
            // Buffered sends (the copy transport) need no group; a group of
            // one refuses any transfer.
            _ => {
                for send in sends {
                    self.send_recv(Some(send), None)?;
                }
                for recv in recvs {
                    self.send_recv(None, Some(recv))?;
                }
                Ok(())
            }
        }
    }

    fn split(&self, color: usize) -> Result<Self> {
        match &self.group {
            // A group of one splits into itself, whatever the colour.
            Group::Solo(solo) => Ok(CudaComm {
                group: Group::Solo(SoloComm {
                    queues: solo.queues.clone(),
                    stream: solo.stream.clone(),
                }),
                queue: self.queue,
            }),
            Group::Nccl(comm) => Ok(CudaComm {
                group: Group::Nccl(Box::new(comm.split(color)?)),
                queue: self.queue,
            }),
            Group::Copy(comm) => Ok(CudaComm::copy(comm.split_on(color, comm.backend())?)),
        }
    }
}

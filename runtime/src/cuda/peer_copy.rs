//! The copy transport (`--transport copy`): collectives between the ranks
//! of this process, a thread each, on GPUs of their own or sharing one,
//! whose data the GPUs' copy engines move. All-gathers and all-to-alls take
//! no SM from the compute running beside them; sums run on the receiving
//! GPU in rank order (`((p0 + p1) + p2) + ...`), so every rank gets the
//! same bits, as the CPU's collectives give. Ranks sharing a GPU is how one
//! GPU runs the multi-rank code (ZeRO-3, expert parallelism, the overlap
//! schedule) for real; NCCL refuses two ranks on one device.
//!
//! Every rank pulls: its queue copies what it receives out of its peers'
//! buffers into its own, and a sum reads every rank's share where it lies
//! (this GPU's memory, or a peer GPU's the context has peer access to) in
//! one kernel; only where a peer's memory is out of reach do its shares
//! come over by copy first. A collective is two rounds of the host-side
//! rendezvous the CPU's collectives use (`DeviceRound`: the group's calls
//! numbered and checked alike, a peer that fails, leaves or stalls past the
//! timeout reported instead of waited on):
//! 1. each rank posts its buffer's address and an event recorded on its
//!    queue, which says the buffer is ready (everything its queue was
//!    given before the call is done); each queue waits on its peers'
//!    events, then copies;
//! 2. each rank posts an event recorded after its copies, and its queue
//!    waits on its peers': no queue goes on to reuse or free a buffer (or,
//!    in an all-reduce, to write the sum over it) while a peer still reads
//!    it. Arena regions are fenced on the queues that used them, so a
//!    buffer freed after the call is safe too.
//!
//! Events are taken once from the GPU's pool, two sets a communicator used
//! by alternate calls.
//! A peer issues its waits on call k's events before it leaves call k, and
//! this rank records the same set again in call k + 2, after call k + 1's
//! first round, which every peer has entered, so no wait still pending on
//! the host can see a later record. The events go, when the communicator
//! does, to the platform's [`RetiredEvents`], back to their pools only
//! when the platform goes (after every rank's thread has ended), so no
//! peer thread can pass a destroyed or reused event to the driver.
//!
//! Point-to-point transfers ([`PeerCopyComm::send_recv`]) are buffered, as
//! on the CPU, and take no round: the send copies its view into a new
//! buffer of its GPU, records an event after the copy on its queue, and
//! leaves both (a `Parcel`) in the rendezvous's mailbox to the receiver
//! (`DeviceP2p`: matched in order, checked for dtype and length, waited
//! for under the timeout); the receiver's queue waits on the event, on the
//! GPU, and copies the buffer out. The event goes back to its pool once
//! that wait is issued; the buffer is freed once the receiver's copy has
//! run, which its next transfer (or its communicator's drop) finds by an
//! event recorded after the copy.

use super::buffer::{view_mut_on, view_on};
use super::launch::MAX_SHARES;
use super::nccl::arguments;
use super::queue::{QueueSet, RawEvent};
use super::{CudaBackend, CudaBuf, GpuView};
use crate::backend::{Backend, Slice, SliceMut};
use crate::collective::Collective;
use crate::cpu::collective::{CpuComm, DeviceP2p, DeviceRound, Half, OpKind};
use crate::error::Result;
use crate::view::DType;
use cudarc::driver::{result, sys};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Events of communicators that are gone, kept out of their GPUs' pools
/// until every rank's thread has ended (see the module's comment), then
/// given back. The platform holds one.
#[derive(Default)]
pub struct RetiredEvents(Mutex<Vec<(Arc<QueueSet>, RawEvent)>>);

impl RetiredEvents {
    fn keep(&self, queues: &Arc<QueueSet>, events: impl IntoIterator<Item = RawEvent>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(events.into_iter().map(|e| (queues.clone(), e)));
    }
}

impl Drop for RetiredEvents {
    fn drop(&mut self) {
        let retired = self.0.get_mut().unwrap_or_else(PoisonError::into_inner);
        for (queues, event) in retired.drain(..) {
            queues.give_event(event);
        }
    }
}

/// What a rank posts in a round: its buffer (in its GPU's context, the
/// context as a plain number), an all-to-all's send and receive counts,
/// and an event recorded on its queue. The handles stay valid while any
/// peer can use them (see the module's comment).
struct Posting {
    ptr: u64,
    context: usize,
    event: RawEvent,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
}

/// A point-to-point message: the sent elements, copied into a buffer of
/// the sender's GPU (none when empty), and an event recorded on the
/// sender's queue after that copy. The event goes back to the sender's
/// pool when the parcel is dropped: by then the receiver's wait on it has
/// been issued (a wait captures the record it waits for), or never will be.
struct Parcel {
    stage: Option<CudaBuf>,
    /// The buffer's device address (0 when empty).
    ptr: u64,
    /// The sender's context, as a plain number.
    context: usize,
    ready: RawEvent,
    queues: Arc<QueueSet>,
}

impl Parcel {
    /// Gives up the buffer without freeing it: a copy out of it may still
    /// be queued, with no event to say when it has run.
    fn leak(&mut self) {
        std::mem::forget(self.stage.take());
    }
}

impl Drop for Parcel {
    fn drop(&mut self) {
        self.queues.give_event(self.ready);
    }
}

/// A received parcel whose buffer this rank's queue may still be copying
/// out of, until `copied` (recorded after the copy) completes.
struct Received {
    parcel: Parcel,
    copied: RawEvent,
}

/// One rank's communicator on the copy transport.
pub struct PeerCopyComm {
    /// The rendezvous, and every host-side collective.
    host: CpuComm,
    /// The queue the copies and sums run on, and the arena of the sums'
    /// scratch.
    backend: CudaBackend,
    /// Its GPU's streams and events.
    queues: Arc<QueueSet>,
    /// Two sets of (ready, done) events, for alternate calls: set `k % 2`
    /// at `2 (k % 2)` and the next index.
    events: Vec<RawEvent>,
    calls: AtomicU64,
    retired: Arc<RetiredEvents>,
    /// The peers' contexts (as plain numbers) this rank's kernels may read
    /// the memory of: peer access is on.
    reachable: Arc<[usize]>,
    /// Parcels received, freed once their copies have run.
    received: Mutex<Vec<Received>>,
}

impl PeerCopyComm {
    /// `host`'s group on the GPU of `backend`, whose queue runs the copies;
    /// its kernels may read the memory of the `reachable` contexts' GPUs.
    pub fn new(
        host: CpuComm,
        backend: CudaBackend,
        retired: Arc<RetiredEvents>,
        reachable: Arc<[usize]>,
    ) -> Result<Self> {
        let queues = backend.gpu().queues().clone();
        let events = (0..4)
            .map(|_| queues.take_event())
            .collect::<Result<Vec<_>>>()?;
        Ok(PeerCopyComm {
            host,
            backend,
            queues,
            events,
            calls: AtomicU64::new(0),
            retired,
            reachable,
            received: Mutex::new(Vec::new()),
        })
    }

    pub fn rank(&self) -> usize {
        Collective::<crate::cpu::CpuBackend>::rank(&self.host)
    }

    pub fn size(&self) -> usize {
        Collective::<crate::cpu::CpuBackend>::size(&self.host)
    }

    /// The host-side rendezvous (and its host collectives).
    pub fn host(&self) -> &CpuComm {
        &self.host
    }

    /// A communicator of the ranks that pass the same `color`, on
    /// `backend`'s queue (collective, as [`Collective::split`]).
    pub fn split_on(&self, color: usize, backend: &CudaBackend) -> Result<PeerCopyComm> {
        PeerCopyComm::new(
            self.host.split(color)?,
            backend.clone(),
            self.retired.clone(),
            self.reachable.clone(),
        )
    }

    /// The backend the copies run on.
    pub fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    fn raw_stream(&self) -> sys::CUstream {
        self.backend.stream().cu_stream()
    }

    /// Records `event` on this rank's queue and posts it with `ptr` and
    /// `counts` (an all-to-all's send and receive counts, else empty);
    /// returns every rank's posting.
    fn post(
        &self,
        round: &mut DeviceRound<'_>,
        event: RawEvent,
        ptr: u64,
        counts: (Vec<usize>, Vec<usize>),
    ) -> Result<Vec<Arc<Posting>>> {
        self.queues.record(event, self.backend.stream())?;
        round.exchange(Posting {
            ptr,
            context: self.backend.gpu().context().cu_ctx() as usize,
            event,
            send_counts: counts.0,
            recv_counts: counts.1,
        })
    }

    /// Makes this rank's queue wait on every peer's posted event.
    fn wait_for_peers(&self, postings: &[Arc<Posting>]) -> Result<()> {
        let me = self.rank();
        for (j, posting) in postings.iter().enumerate() {
            if j == me {
                continue;
            }
            // The peer's event stays live while it can be waited on (the
            // module's comment); a stream may wait on another GPU's event.
            self.queues.wait_on(self.backend.stream(), posting.event)?;
        }
        Ok(())
    }

    /// Copies `bytes` from `src` in context `from_context` to `dst` in this
    /// rank's, on this rank's queue: within one GPU a device copy, else a
    /// peer copy (the copy engines, over NVLink where peers can reach each
    /// other).
    fn copy(&self, from_context: usize, src: u64, dst: u64, bytes: usize) -> Result<()> {
        // An in-place all-gather's own shard is where it goes already.
        if bytes == 0 || src == dst {
            return Ok(());
        }
        let mine = self.backend.gpu().context().cu_ctx();
        // SAFETY: both ranges are live device memory of `bytes` bytes: the
        // caller checked the lengths, and the peer's buffer is held until
        // this queue's copies are done (the second round).
        unsafe {
            if from_context == mine as usize {
                result::memcpy_dtod_async(dst, src, bytes, self.raw_stream())
            } else {
                result::memcpy_peer_async(
                    mine,
                    dst,
                    from_context as sys::CUcontext,
                    src,
                    bytes,
                    self.raw_stream(),
                )
            }
        }
        .map_err(|e| self.queues.error("a copy transport copy", e))
    }

    /// The (ready, done) events of this call, alternating between the sets.
    fn call_events(&self) -> (RawEvent, RawEvent) {
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let set = 2 * (call % 2) as usize;
        (self.events[set], self.events[set + 1])
    }

    /// The second round: posts `done` (recorded after this rank's reads of
    /// its peers' buffers) and makes this queue wait on the peers'.
    fn finish(&self, round: &mut DeviceRound<'_>, done: RawEvent) -> Result<()> {
        let postings = self.post(round, done, 0, Default::default())?;
        self.wait_for_peers(&postings)
    }

    /// Runs the rest of a call after its checks; a failure breaks the
    /// round, so the peers stop waiting for this rank's second round.
    fn finish_or_abandon(
        &self,
        mut round: DeviceRound<'_>,
        body: impl FnOnce(&mut DeviceRound<'_>) -> Result<()>,
    ) -> Result<()> {
        let result = body(&mut round);
        if let Err(error) = &result {
            round.abandon(error);
        }
        result
    }

    pub fn all_gather(
        &self,
        shard: Slice<'_, CudaBackend>,
        full: SliceMut<'_, CudaBackend>,
    ) -> Result<()> {
        let n = self.size();
        let queue = self.backend.queue_index();
        let (shard, full) = (view_on(shard, queue), view_mut_on(&full, queue));
        let round =
            self.host
                .device_round(OpKind::AllGather, Some(shard.len), Some(shard.dtype))?;
        if let Err(problem) = arguments::all_gather(n, self.rank(), &shard, &full) {
            return Err(round.reject(problem));
        }
        self.finish_or_abandon(round, |round| {
            let (ready, done) = self.call_events();
            let postings = self.post(round, ready, shard.ptr, Default::default())?;
            self.wait_for_peers(&postings)?;
            let bytes = shard.len * shard.dtype.bytes();
            for (j, posting) in postings.iter().enumerate() {
                self.copy(
                    posting.context,
                    posting.ptr,
                    full.ptr + (j * bytes) as u64,
                    bytes,
                )?;
            }
            self.finish(round, done)
        })
    }

    /// Whether this rank's kernels may read `posting`'s buffer where it
    /// lies: on this GPU, or a peer's with peer access on.
    fn reads_directly(&self, posting: &Posting) -> bool {
        posting.context == self.backend.gpu().context().cu_ctx() as usize
            || self.reachable.contains(&posting.context)
    }

    /// Sums every rank's `s` f32 at byte `offset` of its posted buffer, in
    /// rank order, into `out` (which may be this rank's share itself, in
    /// place, but none a peer reads). One kernel reads the shares where
    /// they lie when it can reach them all; else each share is copied into
    /// a slot of new scratch first, and the slots are added.
    fn sum_of_shares(
        &self,
        postings: &[Arc<Posting>],
        offset: u64,
        s: usize,
        mut out: SliceMut<'_, CudaBackend>,
    ) -> Result<()> {
        let b = &self.backend;
        if postings.len() <= MAX_SHARES && postings.iter().all(|p| self.reads_directly(p)) {
            let mut shares = [0u64; MAX_SHARES];
            for (share, posting) in shares.iter_mut().zip(postings) {
                *share = posting.ptr + offset;
            }
            // SAFETY: each share is `s` f32 at `offset` of a buffer whose
            // length the call's checks held to it, which this context may
            // read (`reads_directly`); its rank leaves it alone until this
            // queue's copies are done (the second round), and `out` is none
            // a peer reads.
            return unsafe { b.sum_shares(&shares[..postings.len()], out) };
        }
        let parts = b.alloc_uninit(s * postings.len(), DType::F32)?;
        let slots = view_on(b.view(&parts)?, b.queue_index()).ptr;
        for (j, posting) in postings.iter().enumerate() {
            let slot = slots + (j * s * 4) as u64;
            self.copy(posting.context, posting.ptr + offset, slot, s * 4)?;
        }
        b.copy(b.view(&parts)?.slice(0..s)?, out.reborrow())?;
        for j in 1..postings.len() {
            b.axpy(
                1.0,
                b.view(&parts)?.slice(j * s..(j + 1) * s)?,
                out.reborrow(),
            )?;
        }
        Ok(())
    }

    pub fn reduce_scatter(
        &self,
        full: Slice<'_, CudaBackend>,
        shard: SliceMut<'_, CudaBackend>,
    ) -> Result<()> {
        let (n, me) = (self.size(), self.rank());
        let queue = self.backend.queue_index();
        let (full_view, shard_view) = (view_on(full, queue), view_mut_on(&shard, queue));
        let round = self.host.device_round(
            OpKind::ReduceScatter,
            Some(full_view.len),
            Some(full_view.dtype),
        )?;
        if let Err(problem) = arguments::reduce_scatter(n, me, &full_view, &shard_view) {
            return Err(round.reject(problem));
        }
        let s = shard_view.len;
        self.finish_or_abandon(round, |round| {
            let (ready, done) = self.call_events();
            let postings = self.post(round, ready, full_view.ptr, Default::default())?;
            self.wait_for_peers(&postings)?;
            self.sum_of_shares(&postings, (me * s * 4) as u64, s, shard)?;
            self.finish(round, done)
        })
    }

    pub fn all_reduce(&self, mut buf: SliceMut<'_, CudaBackend>) -> Result<()> {
        let view = view_mut_on(&buf, self.backend.queue_index());
        let round = self
            .host
            .device_round(OpKind::AllReduce, Some(view.len), Some(view.dtype))?;
        if let Err(problem) = arguments::all_reduce(&view) {
            return Err(round.reject(problem));
        }
        self.finish_or_abandon(round, |round| {
            let (ready, done) = self.call_events();
            let postings = self.post(round, ready, view.ptr, Default::default())?;
            self.wait_for_peers(&postings)?;
            // The sum goes to scratch first: the peers read `buf` until the
            // second round.
            let b = &self.backend;
            let sum = b.alloc_uninit(view.len, DType::F32)?;
            self.sum_of_shares(&postings, 0, view.len, b.view_mut(&sum)?)?;
            self.finish(round, done)?;
            b.copy(b.view(&sum)?, buf.reborrow())
        })
    }

    pub fn all_to_all(
        &self,
        send: Slice<'_, CudaBackend>,
        send_counts: &[usize],
        recv: SliceMut<'_, CudaBackend>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (n, me) = (self.size(), self.rank());
        let queue = self.backend.queue_index();
        let (send, recv) = (view_on(send, queue), view_mut_on(&recv, queue));
        let round = self
            .host
            .device_round(OpKind::AllToAll, None, Some(send.dtype))?;
        if let Err(problem) = arguments::all_to_all(n, me, &send, send_counts, &recv, recv_counts) {
            return Err(round.reject(problem));
        }
        self.finish_or_abandon(round, |round| {
            let (ready, done) = self.call_events();
            let counts = (send_counts.to_vec(), recv_counts.to_vec());
            let postings = self.post(round, ready, send.ptr, counts)?;
            let sends: Vec<&[usize]> = postings.iter().map(|p| p.send_counts.as_slice()).collect();
            let recvs: Vec<&[usize]> = postings.iter().map(|p| p.recv_counts.as_slice()).collect();
            round.check_all_to_all(&sends, &recvs)?;
            self.wait_for_peers(&postings)?;
            let size = send.dtype.bytes();
            let mut at = 0;
            for (i, sender) in postings.iter().enumerate() {
                let offset: usize = sender.send_counts[..me].iter().sum();
                let count = recv_counts[i];
                let src = sender.ptr + (offset * size) as u64;
                self.copy(
                    sender.context,
                    src,
                    recv.ptr + (at * size) as u64,
                    count * size,
                )?;
                at += count;
            }
            self.finish(round, done)
        })
    }
}

impl PeerCopyComm {
    /// Point-to-point ([`Collective::send_recv`]): `send` to a rank of the
    /// group and/or `recv` from one, buffered (see the module's comment).
    /// The send's copy and the receive's wait and copy run on this rank's
    /// queue; the host waits only for the peer's message to be posted.
    pub fn send_recv(
        &self,
        send: Option<(Slice<'_, CudaBackend>, usize)>,
        recv: Option<(SliceMut<'_, CudaBackend>, usize)>,
    ) -> Result<()> {
        let queue = self.backend.queue_index();
        let send_view = send.map(|(view, to)| (view_on(view, queue), to));
        let recv_view = recv
            .as_ref()
            .map(|(view, from)| (view_mut_on(view, queue), *from));
        let half = |(view, peer): &(GpuView, usize)| Half {
            peer: *peer,
            dtype: view.dtype,
            len: view.len,
        };
        let p2p = self
            .host
            .device_p2p(send_view.as_ref().map(half), recv_view.as_ref().map(half))?;
        if let Err(problem) = arguments::send_recv(
            self.size(),
            self.rank(),
            send_view.as_slice(),
            recv_view.as_slice(),
        ) {
            return Err(p2p.reject(problem));
        }
        let result = (|| {
            self.reclaim()?;
            if let Some((view, _)) = send {
                self.send_parcel(&p2p, view)?;
            }
            if let Some((view, _)) = recv_view {
                self.receive_parcel(&p2p, view)?;
            }
            Ok(())
        })();
        if let Err(error) = &result {
            p2p.abandon(error);
        }
        result
    }

    /// Copies `view` into a new buffer on this rank's queue, records the
    /// parcel's event after it and posts the parcel.
    fn send_parcel(&self, p2p: &DeviceP2p<'_>, view: Slice<'_, CudaBackend>) -> Result<()> {
        let b = &self.backend;
        let stage = if !view.is_empty() {
            let stage = b.alloc_uninit(view.len(), view.dtype())?;
            b.copy(view, b.view_mut(&stage)?)?;
            Some(stage)
        } else {
            None
        };
        let parcel = Parcel {
            ptr: stage.as_ref().map_or(0, CudaBuf::device_ptr),
            stage,
            context: b.gpu().context().cu_ctx() as usize,
            ready: self.queues.take_event()?,
            queues: self.queues.clone(),
        };
        // A parcel dropped on a failure frees its buffer fenced on this
        // queue, behind the copy into it.
        self.queues.record(parcel.ready, b.stream())?;
        p2p.send(parcel)
    }

    /// Takes the peer's parcel, makes this rank's queue wait for its event
    /// and copies it into `view`; the parcel is kept until the copy has run.
    fn receive_parcel(&self, p2p: &DeviceP2p<'_>, view: GpuView) -> Result<()> {
        let mut parcel: Parcel = p2p.receive()?;
        let stream = self.backend.stream();
        // Taken before the copy is queued, so that a failure to take one
        // leaves nothing reading the parcel's buffer.
        let copied = self.queues.take_event()?;
        let queued = (|| {
            self.queues.wait_on(stream, parcel.ready)?;
            self.copy(
                parcel.context,
                parcel.ptr,
                view.ptr,
                view.len * view.dtype.bytes(),
            )?;
            self.queues.record(copied, stream)
        })();
        if let Err(error) = queued {
            // Whether the copy was queued is unknown: the buffer stays
            // allocated rather than be reused under it.
            parcel.leak();
            self.queues.give_event(copied);
            return Err(error);
        }
        self.received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Received { parcel, copied });
        Ok(())
    }

    /// Frees the parcels whose copies out have run.
    fn reclaim(&self) -> Result<()> {
        self.queues.bind()?;
        let done = {
            let mut received = self.received.lock().unwrap_or_else(PoisonError::into_inner);
            let mut done = Vec::new();
            let mut i = 0;
            while i < received.len() {
                if self.queues.query(received[i].copied)? {
                    done.push(received.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            done
        };
        if done.is_empty() {
            return Ok(());
        }
        for Received { parcel, copied } in done {
            self.queues.give_event(copied);
            drop(parcel);
        }
        // Freeing a buffer of another GPU made its context current here.
        self.queues.bind()
    }
}

impl Drop for PeerCopyComm {
    fn drop(&mut self) {
        self.retired.keep(&self.queues, self.events.drain(..));
        // The parcels still being copied out are freed once the copies have
        // run (a bounded wait: the queue is normally idle by now), or
        // leaked if they never do.
        let received = std::mem::take(
            self.received
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for Received { mut parcel, copied } in received {
            let what = || "the copy out of a point-to-point message".to_string();
            if self.queues.wait_event(copied, &what).is_ok() {
                self.queues.give_event(copied);
            } else {
                parcel.leak();
                self.retired.keep(&self.queues, [copied]);
            }
        }
    }
}

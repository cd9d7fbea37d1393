//! The NCCL communicator: one group of GPU ranks, bound to one CUDA stream
//! (the lane it is used from), with the collectives of
//! [`Collective`](crate::Collective) on [`GpuView`]s.
//!
//! - Device collectives (all-gather of any dtype, reduce-scatter and
//!   all-reduce of f32 sums, the variable all-to-all as grouped
//!   `ncclSend`/`ncclRecv`) are enqueued on the stream and return: the host
//!   never waits for the GPU in them. Their arguments are checked first
//!   (errors name the call, the rank and the numbers).
//! - Host-side exchanges (count vectors, small f64 vectors, barriers, the
//!   colours of a split) go through NCCL too, on a small device staging
//!   buffer allocated at construction (grown only when a call needs more),
//!   followed by a bounded wait; their encoding is in `host_exchange`.
//! - Every communicator is non-blocking (`ncclCommInitRankConfig` with
//!   `blocking = 0`): NCCL calls return at once and the caller polls
//!   `ncclCommGetAsyncError`, so joining a communicator, splitting one and
//!   connecting to peers are all bounded by the timeout. A non-blocking
//!   collective costs NCCL a helper thread per call; that is the price of
//!   a host thread that can never hang inside NCCL.
//! - Failure: [`NcclComm::check`] reports NCCL's asynchronous errors,
//!   [`NcclComm::abort`] aborts from any thread (idempotent; later calls
//!   fail with the cause at once; `ncclCommAbort`, which can block until
//!   the device drains, runs on a thread of its own, joined when the
//!   communicator is dropped), an [`AbortSignal`] shared by a process's
//!   communicators stops every wait at once, and [`StreamWait`] is the
//!   bounded wait lanes and platforms use instead of a stream
//!   synchronisation.
//!
//! Ranks: a group's members are world ranks (those of the communicator it
//! was split from, as on the CPU), so every error names world ranks.
//! Determinism: NCCL's sums follow its ring or tree, fixed for a given
//! size, topology and environment, so the same call on the same data gives
//! the same bits; its order differs from the CPU's rank order, so results
//! agree with the CPU's to rounding only.

pub(crate) mod arguments;
mod collectives;
mod host_exchange;
mod library;
mod wait;

pub use library::{NcclUniqueId, NcclVersion, nccl_version};
pub use wait::{AbortCause, AbortSignal, StreamWait};

use crate::cuda::GpuView;
use crate::error::{Result, RuntimeError};
use crate::lane::thread::deadline_after;
use crate::rendezvous::{self, RankInfo};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::sys;
use host_exchange::{Contribution, HostCall, HostOp, Outgoing};
use library::{NcclApi, NcclStatus, api};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;
use wait::{aborted_error, device_error, poll_until};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these locks are held (what runs under them is
    // NCCL's and CUDA's C functions on checked arguments), so a poisoned
    // lock still holds consistent state.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// NCCL's handle. NCCL allows a communicator to be used from any thread
/// as long as its calls do not overlap; [`CommHandle`] serialises them.
#[derive(Clone, Copy)]
struct RawComm(sys::ncclComm_t);

// SAFETY: see above: every use goes through CommHandle's mutex.
unsafe impl Send for RawComm {}

enum HandleState {
    Live(RawComm),
    /// Aborted (`ncclCommAbort` called, the handle gone), and why.
    Aborted(AbortCause),
}

/// The raw communicator behind a mutex that every NCCL call on it takes,
/// for the call only (never across a wait), so an abort from another
/// thread gets in between two polls of a waiting one.
struct CommHandle {
    api: &'static NcclApi,
    /// The device's context, current on the thread that aborts.
    context: Arc<CudaContext>,
    state: Mutex<HandleState>,
    /// The thread running `ncclCommAbort`, once aborted.
    reaper: Mutex<Option<JoinHandle<()>>>,
}

impl CommHandle {
    fn new(api: &'static NcclApi, context: Arc<CudaContext>, raw: sys::ncclComm_t) -> Self {
        CommHandle {
            api,
            context,
            state: Mutex::new(HandleState::Live(RawComm(raw))),
            reaper: Mutex::new(None),
        }
    }

    /// Runs `call` on the live handle, or gives the abort's cause.
    fn with_raw<T>(&self, call: impl FnOnce(sys::ncclComm_t) -> T) -> Result<T, AbortCause> {
        match &*lock(&self.state) {
            HandleState::Live(raw) => Ok(call(raw.0)),
            HandleState::Aborted(cause) => Err(cause.clone()),
        }
    }

    fn is_live(&self) -> bool {
        matches!(&*lock(&self.state), HandleState::Live(_))
    }

    /// Aborts once; later calls keep the first cause. The handle is marked
    /// aborted at once, under the lock, so every other thread's next call
    /// or poll fails with the cause. `ncclCommAbort` itself runs on a
    /// thread of its own: it can block until all of the device's work has
    /// drained (seen on a GPU: it waited for a stalled stream), and that
    /// work may include kernels of other communicators being aborted at
    /// the same time; started together, every abort sets its kernels'
    /// abort flag before any of them blocks, and no waiting rank is held
    /// up by the freeing.
    fn abort(&self, cause: AbortCause) {
        let raw = {
            let mut state = lock(&self.state);
            match std::mem::replace(&mut *state, HandleState::Aborted(cause)) {
                HandleState::Live(raw) => raw,
                aborted => {
                    // Already aborted: keep the first cause.
                    *state = aborted;
                    return;
                }
            }
        };
        let (api, context) = (self.api, self.context.clone());
        match std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || reap(api, &context, raw))
        {
            Ok(reaper) => *lock(&self.reaper) = Some(reaper),
            Err(_) => reap(self.api, &self.context, raw),
        }
    }
}

/// How long dropping an aborted communicator waits for its
/// `ncclCommAbort` to finish.
const REAP_LIMIT: Duration = Duration::from_secs(30);

impl Drop for CommHandle {
    fn drop(&mut self) {
        // A handle is dropped once its abort has finished, or after a
        // bounded wait: an abort still freeing NCCL's resources when the
        // process exits crashes in the teardown of CUDA (seen on a GPU,
        // after all tests passed).
        let Some(reaper) = lock(&self.reaper).take() else {
            return;
        };
        let finished =
            poll_until(deadline_after(REAP_LIMIT), || Ok(reaper.is_finished())).unwrap_or(false);
        if finished {
            let _ = reaper.join();
        }
    }
}

/// `ncclCommAbort`: ends the communicator's kernels and frees it. Its
/// result says nothing worth acting on (NCCL may report the failure that
/// led to the abort).
fn reap(api: &NcclApi, context: &CudaContext, raw: RawComm) {
    let _ = context.bind_to_thread();
    // SAFETY: a handle taken out of a live CommHandle, aborted once (the
    // state changed to Aborted under the handle's lock, so no other call
    // uses it any more).
    let _ = unsafe { (api.comm_abort)(raw.0) };
}

/// The staging buffers of host-side exchanges: device words NCCL gathers
/// (`[send: per-rank block | recv: ranks x block]`) and a pinned host
/// mirror the copies go through without blocking the host.
struct HostStaging {
    /// Words per rank of the next exchange's first round.
    block: usize,
    /// Words in each buffer.
    capacity: usize,
    device: CudaSlice<u64>,
    device_ptr: u64,
    host: PinnedWords,
    /// Recorded after each exchange's copy back.
    done: CudaEvent,
    /// An exchange whose wait failed: its copies may still be in flight.
    pending: bool,
}

/// Page-locked host memory (asynchronous copies need it: to pageable
/// memory they block the host until the stream gets there).
struct PinnedWords {
    ptr: *mut u64,
    len: usize,
}

// SAFETY: plain memory owned by this value; HostStaging's mutex orders
// every access.
unsafe impl Send for PinnedWords {}

impl PinnedWords {
    fn new(len: usize) -> std::result::Result<Self, cudarc::driver::DriverError> {
        // SAFETY: allocates `len` words (flags 0: cached, readable by the
        // host at full speed); freed on drop.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len.max(1) * 8, 0) }?;
        Ok(PinnedWords {
            ptr: ptr.cast(),
            len,
        })
    }

    fn words(&mut self) -> &mut [u64] {
        // SAFETY: `len` words allocated by `new`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedWords {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // SAFETY: allocated by malloc_host; HostStaging leaks instead of
        // dropping while a copy into it may be in flight.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

impl HostStaging {
    fn new(stream: &Arc<CudaStream>, ranks: usize) -> std::result::Result<Self, String> {
        let block = host_exchange::FIRST_BLOCK_WORDS;
        let capacity = block * (ranks + 1);
        let device = stream
            .alloc_zeros::<u64>(capacity)
            .map_err(|e| format!("allocating {} bytes of device staging: {e}", capacity * 8))?;
        let device_ptr = {
            let (ptr, _record) = device.device_ptr(stream);
            ptr
        };
        let host = PinnedWords::new(capacity).map_err(|e| {
            format!(
                "allocating {} bytes of pinned host memory: {e}",
                capacity * 8
            )
        })?;
        let done = stream
            .context()
            .new_event(None)
            .map_err(|e| format!("creating an event: {e}"))?;
        Ok(HostStaging {
            block,
            capacity,
            device,
            device_ptr,
            host,
            done,
            pending: false,
        })
    }

    /// Makes room for `words` in each buffer (only between exchanges that
    /// completed, so nothing in flight uses the old buffers).
    fn reserve(
        &mut self,
        stream: &Arc<CudaStream>,
        words: usize,
    ) -> std::result::Result<(), String> {
        if words <= self.capacity {
            return Ok(());
        }
        let capacity = words.next_power_of_two();
        let device = stream
            .alloc_zeros::<u64>(capacity)
            .map_err(|e| format!("growing the device staging to {} bytes: {e}", capacity * 8))?;
        let device_ptr = {
            let (ptr, _record) = device.device_ptr(stream);
            ptr
        };
        self.host = PinnedWords::new(capacity)
            .map_err(|e| format!("growing the pinned staging to {} bytes: {e}", capacity * 8))?;
        // The old device buffer is freed in stream order (after any work
        // still queued on it).
        self.device = device;
        self.device_ptr = device_ptr;
        self.capacity = capacity;
        Ok(())
    }
}

impl Drop for HostStaging {
    fn drop(&mut self) {
        // Freeing pinned memory wants its context current.
        let _ = self.device.stream().context().bind_to_thread();
        if self.pending && !self.done.try_is_complete().unwrap_or(false) {
            // A copy into the pinned buffer may still land (the stream is
            // stuck behind an aborted collective): leak the buffer rather
            // than free memory the GPU may write.
            let host = std::mem::replace(
                &mut self.host,
                PinnedWords {
                    ptr: std::ptr::null_mut(),
                    len: 0,
                },
            );
            std::mem::forget(host);
        }
    }
}

/// Where NCCL writes a new communicator's handle. It writes it from its own
/// init thread as well as from the call, so the slot lives on the heap: it
/// is freed once the init has settled, and leaked when the init is
/// abandoned (8 bytes, rather than freeing memory NCCL might still write).
struct HandleSlot(*mut AtomicPtr<sys::ncclComm>);

impl HandleSlot {
    fn new() -> Self {
        HandleSlot(Box::into_raw(Box::new(
            AtomicPtr::new(std::ptr::null_mut()),
        )))
    }

    /// For NCCL's `ncclComm_t*` argument (an AtomicPtr has a pointer's
    /// layout).
    fn as_out(&self) -> *mut sys::ncclComm_t {
        self.0.cast()
    }

    fn load(&self) -> sys::ncclComm_t {
        // SAFETY: the slot is live until `release` (never freed otherwise).
        unsafe { &*self.0 }.load(Ordering::Acquire)
    }

    /// Frees the slot: call only once NCCL has settled the init.
    fn release(self) {
        // SAFETY: made by Box::into_raw in `new`, freed once, here.
        drop(unsafe { Box::from_raw(self.0) });
    }
}

/// Clears a communicator's in-call flag when a call ends, however it ends.
struct InCall<'a>(&'a AtomicBool);

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// How long a communicator being dropped lets work already on its stream
/// finish before aborting (at most its timeout).
const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// One rank's handle on a group of GPU ranks; see the module documentation.
pub struct NcclComm {
    handle: CommHandle,
    rank: usize,
    size: usize,
    /// World ranks of the members, in group-rank order.
    members: Arc<[usize]>,
    group_name: Arc<str>,
    stream: Arc<CudaStream>,
    timeout: Duration,
    signal: AbortSignal,
    version: NcclVersion,
    staging: Mutex<HostStaging>,
    next_host_seq: AtomicU64,
    in_call: AtomicBool,
}

/// NCCL ranks and counts are C ints.
fn as_c_int(what: &str, value: usize) -> Result<c_int> {
    c_int::try_from(value).map_err(|_| {
        RuntimeError::InvalidArgument(format!(
            "{what} {value} is larger than NCCL takes ({})",
            c_int::MAX
        ))
    })
}

impl NcclComm {
    /// Joins the communicator `id` names as rank `rank` of `size`, bound to
    /// `stream` (its device is the current one of `stream`'s context).
    /// Every rank calls this at once, each from its own thread or process;
    /// it returns when all have joined, or fails after `timeout` naming the
    /// ranks that did not come. `signal` (shared by the process's
    /// communicators) stops it, and every later wait, early.
    pub fn from_unique_id(
        id: &NcclUniqueId,
        rank: usize,
        size: usize,
        stream: Arc<CudaStream>,
        timeout: Duration,
        signal: AbortSignal,
    ) -> Result<NcclComm> {
        let api = api()?;
        let version = api.version;
        if size == 0 || rank >= size {
            return Err(RuntimeError::InvalidArgument(format!(
                "rank {rank} is out of range for an NCCL communicator of {size} ranks"
            )));
        }
        let (c_size, c_rank) = (as_c_int("size", size)?, as_c_int("rank", rank)?);
        let device = format!("cuda:{}", stream.context().ordinal());
        let joining = format!("joining the NCCL communicator of {size} ranks as rank {rank}");
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| device_error(&device, &joining, e))?;
        let staging =
            HostStaging::new(&stream, size).map_err(|e| device_error(&device, &joining, e))?;
        let slot = HandleSlot::new();
        let mut config = library::nonblocking_config(version);
        // SAFETY: `slot` is live, `config` outlives the call (NCCL copies
        // it), the id is 128 bytes; the context is current on this thread.
        let started = NcclStatus(unsafe {
            (api.comm_init_rank_config)(slot.as_out(), c_size, id.to_sys(), c_rank, &mut config)
        });
        let raw = slot.load();
        if !started.is_accepted() {
            if !raw.is_null() {
                CommHandle::new(api, stream.context().clone(), raw).abort(AbortCause {
                    rank,
                    reason: "its NCCL init failed".into(),
                });
            }
            return Err(RuntimeError::Lane {
                lane: device,
                message: format!(
                    "{joining}: ncclCommInitRankConfig failed: {}",
                    library::error_text(api, started, None)
                ),
            });
        }
        if raw.is_null() {
            return Err(RuntimeError::Lane {
                lane: device,
                message: format!("{joining}: NCCL returned no communicator"),
            });
        }
        let comm = NcclComm {
            handle: CommHandle::new(api, stream.context().clone(), raw),
            rank,
            size,
            members: (0..size).collect(),
            group_name: Arc::from("world"),
            stream,
            timeout,
            signal,
            version,
            staging: Mutex::new(staging),
            next_host_seq: AtomicU64::new(1),
            in_call: AtomicBool::new(false),
        };
        let others = size - 1;
        comm.settle(&joining, || {
            format!(
                "timed out after {timeout:?} {joining}: {} did not join (a rank that \
                 failed before joining says why in its own error); if {} only slow to \
                 start, raise --timeout",
                if others == 1 {
                    format!("the other rank (rank {})", 1 - rank)
                } else {
                    format!("some of the other {others} ranks")
                },
                if others == 1 { "it is" } else { "they are" },
            )
        })?;
        // The init has settled, so NCCL writes the slot no more.
        slot.release();
        Ok(comm)
    }

    /// The world communicator of a job started by torchrun or srun (one
    /// process per GPU): rank 0 makes the unique id and
    /// [`rendezvous`] hands it to the others, then every rank joins.
    pub fn from_rendezvous(
        info: &RankInfo,
        stream: Arc<CudaStream>,
        timeout: Duration,
        signal: AbortSignal,
    ) -> Result<NcclComm> {
        let bytes = rendezvous::hand_out(
            info,
            || NcclUniqueId::new().map(|id| id.as_bytes().to_vec()),
            timeout,
        )?;
        let id = NcclUniqueId::from_bytes(&bytes)?;
        Self::from_unique_id(&id, info.rank, info.world_size, stream, timeout, signal)
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index in the world the group was split from.
    pub fn world_rank(&self) -> usize {
        self.members[self.rank]
    }

    /// World ranks of the group's members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// `world`, `copy of world` or `group of ranks [..]`.
    pub fn group_name(&self) -> &str {
        &self.group_name
    }

    /// The stream its collectives are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn signal(&self) -> &AbortSignal {
        &self.signal
    }

    /// The NCCL release loaded.
    pub fn nccl_version(&self) -> NcclVersion {
        self.version
    }

    fn device(&self) -> String {
        format!("cuda:{}", self.stream.context().ordinal())
    }

    // ---- failure -----------------------------------------------------------------

    /// Ok while the communicator is healthy; otherwise the error that ended
    /// it: NCCL's asynchronous error (naming this rank and NCCL's message;
    /// the communicator is aborted then, as NCCL requires), the abort's
    /// cause, or the raised [`AbortSignal`]'s.
    pub fn check(&self) -> Result<()> {
        self.health(&format!("checking its communicator on {}", self.group_name))
    }

    /// Aborts the communicator (`ncclCommAbort`): its kernels end, work
    /// waiting on them drains, and every later call fails. Safe from any
    /// thread while another waits on it; idempotent.
    pub fn abort(&self) {
        self.abort_because(AbortCause {
            rank: self.world_rank(),
            reason: format!(
                "rank {} aborted its communicator on {}",
                self.world_rank(),
                self.group_name
            ),
        });
    }

    /// Aborts with the cause later calls report: rank `rank` failed with
    /// `reason` (for a platform that saw a rank fail).
    pub fn abort_with(&self, rank: usize, reason: &str) {
        self.abort_because(AbortCause {
            rank,
            reason: reason.to_string(),
        });
    }

    /// Whether the communicator was aborted.
    pub fn is_aborted(&self) -> bool {
        !self.handle.is_live()
    }

    pub(crate) fn abort_because(&self, cause: AbortCause) {
        // ncclCommAbort sets the device, but the CUDA calls around it want
        // the context current.
        let _ = self.stream.context().bind_to_thread();
        self.handle.abort(cause);
    }

    /// Whether NCCL has finished the work this communicator's last call
    /// started (`Ok(true)`) or still runs it in the background
    /// (`Ok(false)`); `Err` when it failed, was aborted or the signal was
    /// raised (aborting it then).
    fn settled(&self, doing: &str) -> Result<bool> {
        if let Some(cause) = self.signal.cause() {
            self.abort_because(cause.clone());
            return Err(aborted_error(&cause, self.world_rank(), doing));
        }
        let mut state = 0u32;
        let api = self.handle.api;
        let queried = self.handle.with_raw(|raw| {
            // SAFETY: a live handle, under its lock; writes one result.
            NcclStatus(unsafe { (api.comm_get_async_error)(raw, &mut state) })
        });
        let returned = match queried {
            Err(cause) => return Err(aborted_error(&cause, self.world_rank(), doing)),
            Ok(returned) => returned,
        };
        let state = NcclStatus(state);
        let failure = match (returned.is_success(), state) {
            (true, NcclStatus::SUCCESS) => return Ok(true),
            (true, NcclStatus::IN_PROGRESS) => return Ok(false),
            (true, failed) => failed,
            (false, _) => returned,
        };
        let text = library::error_text(api, failure, None);
        self.abort_because(AbortCause {
            rank: self.world_rank(),
            reason: format!("NCCL failed on {}: {text}", self.group_name),
        });
        Err(RuntimeError::Peer {
            rank: self.world_rank(),
            message: format!(
                "NCCL failed on {} ({}) while {doing}: {text}",
                self.group_name,
                self.device()
            ),
        })
    }

    /// [`Self::settled`] for a wait on the stream: in progress is healthy.
    pub(crate) fn health(&self, doing: &str) -> Result<()> {
        self.settled(doing).map(|_| ())
    }

    /// Polls until NCCL has finished what a call started; at the deadline
    /// aborts and fails with `timed_out()`.
    fn settle(&self, doing: &str, timed_out: impl FnOnce() -> String) -> Result<()> {
        let done = poll_until(deadline_after(self.timeout), || self.settled(doing))?;
        if done {
            return Ok(());
        }
        let message = timed_out();
        self.abort_because(AbortCause {
            rank: self.world_rank(),
            reason: message.clone(),
        });
        Err(RuntimeError::Peer {
            rank: self.world_rank(),
            message,
        })
    }

    /// The other members, for messages: "rank 1", "ranks [1, 3]".
    fn peers(&self) -> String {
        let others: Vec<usize> = self
            .members
            .iter()
            .copied()
            .filter(|&r| r != self.world_rank())
            .collect();
        match others.as_slice() {
            [one] => format!("rank {one}"),
            _ => format!("ranks {others:?}"),
        }
    }

    // ---- issuing NCCL calls ----------------------------------------------------------

    /// Marks the communicator busy for one call: calls on one communicator
    /// must not overlap (NCCL's rule too), and one that would is refused
    /// instead of interleaving with the other.
    fn begin(&self, call: &str) -> Result<InCall<'_>> {
        if self.in_call.swap(true, Ordering::Acquire) {
            return Err(RuntimeError::InvalidArgument(format!(
                "rank {} called {call} on {} while another call on the same communicator was in \
                 flight; calls on one communicator must be ordered (give each lane its own \
                 communicator with NcclComm::split)",
                self.world_rank(),
                self.group_name
            )));
        }
        Ok(InCall(&self.in_call))
    }

    fn refuse(&self, call: &str, problem: String) -> RuntimeError {
        RuntimeError::InvalidArgument(format!(
            "rank {}: {call} on {}: {problem}",
            self.world_rank(),
            self.group_name
        ))
    }

    /// Runs one NCCL call (or group of calls) that enqueues work on the
    /// stream, and polls until NCCL has enqueued it: what follows on the
    /// stream then comes after it.
    fn issue(
        &self,
        call: &str,
        enqueue: impl FnOnce(&NcclApi, sys::ncclComm_t, sys::cudaStream_t) -> u32,
    ) -> Result<()> {
        self.issue_with(call, &self.peers(), enqueue)
    }

    /// [`Self::issue`], naming `peers` (the ranks the call connects to) if
    /// NCCL is still connecting at the timeout.
    fn issue_with(
        &self,
        call: &str,
        peers: &str,
        enqueue: impl FnOnce(&NcclApi, sys::ncclComm_t, sys::cudaStream_t) -> u32,
    ) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| device_error(&self.device(), call, e))?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let doing = format!("issuing {call} on {}", self.group_name);
        let returned = self
            .handle
            .with_raw(|raw| NcclStatus(enqueue(self.handle.api, raw, stream)));
        let returned = match returned {
            Err(cause) => return Err(aborted_error(&cause, self.world_rank(), &doing)),
            Ok(returned) => returned,
        };
        match returned {
            accepted if accepted.is_accepted() => {}
            failed => {
                let text = library::error_text(self.handle.api, failed, None);
                // NCCL may have enqueued part of a group; a communicator out
                // of step with its peers is of no further use.
                self.abort_because(AbortCause {
                    rank: self.world_rank(),
                    reason: format!("{call} on {} failed: {text}", self.group_name),
                });
                return Err(RuntimeError::Lane {
                    lane: self.device(),
                    message: format!("NCCL {call} on {} failed: {text}", self.group_name),
                });
            }
        }
        let timeout = self.timeout;
        self.settle(&doing, || {
            format!(
                "timed out after {timeout:?} issuing {call} on {}: NCCL was still connecting \
                 to {peers} (a peer that stalled or died says why in its own error); if the \
                 peers are only slow, raise --timeout",
                self.group_name,
            )
        })
    }

    /// Collective: every rank of the group calls it; ranks that pass the
    /// same `color` form a new group on the same stream, ordered by their
    /// rank in this group (`ncclCommSplit`). `split(0)` everywhere
    /// duplicates the group.
    pub fn split(&self, color: usize) -> Result<NcclComm> {
        self.split_on(color, self.stream.clone())
    }

    /// [`Self::split`], the new communicator bound to `stream` (of the same
    /// device): a communicator for another lane.
    pub fn split_on(&self, color: usize, stream: Arc<CudaStream>) -> Result<NcclComm> {
        let call = format!("split (colour {color})");
        let _busy = self.begin(&call)?;
        let contribution = if color > c_int::MAX as usize {
            Contribution::Refused(format!(
                "colour {color} is larger than NCCL takes ({})",
                c_int::MAX
            ))
        } else if stream.context().cu_ctx() != self.stream.context().cu_ctx() {
            Contribution::Refused(format!(
                "the new communicator's stream belongs to cuda:{}, but this rank's device is {}",
                stream.context().ordinal(),
                self.device()
            ))
        } else {
            Contribution::Words(vec![color as u64])
        };
        // The colours go round first, so every rank knows every new group's
        // members (world ranks, for messages) and a colour NCCL cannot take
        // fails every rank alike instead of leaving the others waiting.
        let (exchange, all) = self.host_exchange(HostOp::Split, contribution)?;
        let colors: Vec<u64> = all
            .iter()
            .enumerate()
            .map(|(r, p)| match p.as_slice() {
                [c] => Ok(*c),
                _ => Err(RuntimeError::Peer {
                    rank: self.members[r],
                    message: format!(
                        "sent a malformed colour in {exchange} on {}",
                        self.group_name
                    ),
                }),
            })
            .collect::<Result<_>>()?;
        let mine = colors[self.rank];
        let members: Arc<[usize]> = colors
            .iter()
            .zip(self.members.iter())
            .filter(|(c, _)| **c == mine)
            .map(|(_, &world)| world)
            .collect();
        let rank = colors[..self.rank].iter().filter(|&&c| c == mine).count();
        let group_name: Arc<str> = if members.len() == self.size {
            Arc::from(format!("copy of {}", self.group_name))
        } else {
            Arc::from(format!("group of ranks {:?}", &*members))
        };
        let device = self.device();
        let staging = HostStaging::new(&stream, members.len())
            .map_err(|e| device_error(&device, &call, e))?;
        let slot = HandleSlot::new();
        let mut config = library::nonblocking_config(self.version);
        let key = self.rank as c_int;
        let issued = self.issue(&call, |api, raw, _| {
            // SAFETY: a live parent handle; `slot` outlives the split (it is
            // leaked if the split is abandoned); NCCL copies `config`.
            unsafe { (api.comm_split)(raw, mine as c_int, key, slot.as_out(), &mut config) }
        });
        let raw = slot.load();
        if let Err(error) = issued {
            if !raw.is_null() {
                CommHandle::new(self.handle.api, stream.context().clone(), raw).abort(AbortCause {
                    rank: self.world_rank(),
                    reason: error.to_string(),
                });
            }
            return Err(error);
        }
        // The split has settled (the parent's state said so): NCCL writes
        // the slot no more.
        slot.release();
        if raw.is_null() {
            return Err(device_error(
                &device,
                &call,
                "NCCL returned no communicator",
            ));
        }
        let child = NcclComm {
            handle: CommHandle::new(self.handle.api, stream.context().clone(), raw),
            rank,
            size: members.len(),
            members,
            group_name,
            stream,
            timeout: self.timeout,
            signal: self.signal.clone(),
            version: self.version,
            staging: Mutex::new(staging),
            next_host_seq: AtomicU64::new(1),
            in_call: AtomicBool::new(false),
        };
        let timeout = self.timeout;
        let setting_up = format!("setting up the communicator split from {}", self.group_name);
        child.settle(&setting_up, || {
            format!("timed out after {timeout:?} {setting_up}")
        })?;
        child.verify_layout()?;
        Ok(child)
    }

    /// Checks that NCCL's idea of the group matches this one's.
    fn verify_layout(&self) -> Result<()> {
        let (mut count, mut rank) = (0 as c_int, 0 as c_int);
        let api = self.handle.api;
        let read = self.handle.with_raw(|raw| {
            // SAFETY: a live handle; each call writes one int.
            unsafe {
                (
                    (api.comm_count)(raw, &mut count),
                    (api.comm_user_rank)(raw, &mut rank),
                )
            }
        });
        let ok = matches!(read, Ok((0, 0)));
        if ok && count as usize == self.size && rank as usize == self.rank {
            Ok(())
        } else {
            Err(RuntimeError::Peer {
                rank: self.world_rank(),
                message: format!(
                    "internal error: NCCL made {} a group of {count} with this rank at {rank}, but \
                     the colours say {} ranks with this rank at {}",
                    self.group_name, self.size, self.rank
                ),
            })
        }
    }

    /// Waits (bounded) for the work on the stream to finish; false when it
    /// did not.
    fn drain(&self, limit: Duration) -> bool {
        let Ok(event) = self.stream.context().new_event(None) else {
            return false;
        };
        if event.record(&self.stream).is_err() {
            return false;
        }
        poll_until(deadline_after(limit), || {
            Ok(event.try_is_complete().unwrap_or(true))
        })
        .unwrap_or(false)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // A healthy communicator lets the work already on its stream finish
        // (bounded) before its abort, so dropping it does not cut short
        // collectives the caller still reads; a failed one goes at once.
        // Abort, not destroy: ncclCommDestroy may wait on peers, unbounded.
        if self.handle.is_live() && !self.signal.is_raised() {
            let _ = self.stream.context().bind_to_thread();
            self.drain(self.timeout.min(DRAIN_LIMIT));
        }
        self.abort_because(AbortCause {
            rank: self.world_rank(),
            reason: format!(
                "rank {}'s communicator on {} was dropped",
                self.world_rank(),
                self.group_name
            ),
        });
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("group", &self.group_name)
            .field("device", &self.device())
            .field("aborted", &self.is_aborted())
            .finish()
    }
}

//! CPU collectives: ranks as threads of one process, exchanging through
//! shared memory with sums in rank order.
//!
//! A [`CpuWorld`] is the shared state of N thread ranks; each rank takes its
//! [`CpuComm`] and calls collectives on it. Every call is one *round* of its
//! group, numbered by a per-group sequence number: each rank deposits its
//! contribution (an owned copy) into the round, waits on a condition variable
//! until every rank has deposited, takes shared references to all
//! contributions, and computes its own output from them outside the lock.
//! Nothing is written into another rank's memory, so there is no unsafe code
//! and no second synchronisation point per call.
//!
//! Sums run strictly in rank order (`((x0 + x1) + x2) + ...` per element),
//! so every rank gets the same bits on every run.
//!
//! Faults end in errors, never hangs: a rank that calls a different
//! collective (or a different size) than its peers, a rank that does not
//! arrive within the timeout, a rank whose communicator is dropped (its
//! thread ended or panicked) and a rank that calls [`CpuComm::abort`] all
//! make the waiting ranks fail with an error naming that rank. One lock and
//! one condition variable serve a world and every group split from it, so an
//! abort wakes ranks blocked in any group.
//!
//! Point-to-point transfers ([`Collective::send_recv`]) are no rounds: they
//! take no sequence number, so the group's collectives are numbered alike
//! on every rank whatever transfers each makes. A send puts an owned copy
//! into the group's mailbox from its rank to the receiver (a FIFO, so
//! messages between two ranks are matched in the order they were sent) and
//! returns; a receive waits for the head of the mailbox from its peer, under
//! the same lock, condition variable, timeout, abort and dropped-peer rules
//! as a round, and checks the message's dtype and length against its view.

use crate::backend::{Slice, SliceMut};
use crate::collective::Collective;
use crate::cpu::CpuBackend;
use crate::cpu::buffer::KernelAccess;
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

mod ops;
mod p2p;
#[cfg(test)]
mod tests;

pub use crate::collective::DEFAULT_TIMEOUT;
pub(crate) use p2p::DeviceP2p;

/// Which collective a call is; with its size, what every rank must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllGather,
    ReduceScatter,
    AllReduce,
    /// The second round of an all-reduce: gathering the reduced chunks.
    AllReduceGather,
    AllToAll,
    AllToAllCounts,
    AllGatherHost,
    Barrier,
    Split,
}

impl OpKind {
    fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllReduce => "all_reduce",
            OpKind::AllReduceGather => "all_reduce (gather phase)",
            OpKind::AllToAll => "all_to_all",
            OpKind::AllToAllCounts => "all_to_all_counts",
            OpKind::AllGatherHost => "all_gather_host",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }
}

/// One collective call of one rank: what, how big, and its sequence number.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Call {
    kind: OpKind,
    /// Elements every rank must agree on (per-rank shard for all_gather,
    /// whole buffer otherwise); `None` when sizes may differ per rank.
    elements: Option<usize>,
    /// The element type every rank must agree on, for data collectives.
    dtype: Option<DType>,
    seq: u64,
    /// Rounds within one call (all_reduce has two); shares the call's `seq`.
    phase: u8,
}

impl Call {
    fn agrees_with(&self, other: &Call) -> bool {
        self.kind == other.kind && self.elements == other.elements && self.dtype == other.dtype
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.kind.name(), self.seq)?;
        let dtype = self.dtype.map(|d| format!("{d} ")).unwrap_or_default();
        match (self.kind, self.elements) {
            (OpKind::AllGather, Some(n)) => write!(f, " ({n} {dtype}elements per rank)"),
            (_, Some(n)) => write!(f, " ({n} {dtype}elements)"),
            (_, None) => Ok(()),
        }
    }
}

/// What one rank deposits into a round (or what a round's finisher made).
#[derive(Debug)]
enum Payload {
    Empty,
    Floats(Vec<f32>),
    Bytes(Vec<u8>),
    AllToAll {
        /// The send buffer's bytes; counts are in elements.
        data: Vec<u8>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    },
    Counts(Vec<Vec<usize>>),
    Host(Vec<f64>),
    Color(usize),
    /// The groups a split made: (color, group id, world ranks).
    Groups(Vec<(usize, u64, Arc<[usize]>)>),
    /// Another transport's posting, opaque here ([`DeviceRound`]).
    Token(Token),
}

/// A point-to-point message waiting in its mailbox: what the receiving
/// view must match, and the data.
#[derive(Debug)]
struct Letter {
    dtype: DType,
    len: usize,
    contents: Contents,
}

/// A message's data: bytes on the CPU, another transport's parcel (device
/// memory and an event, say) opaque here ([`DeviceP2p`]). Owned, not
/// shared: exactly one receiver takes it.
enum Contents {
    Bytes(Vec<u8>),
    Parcel(Box<dyn Any + Send>),
}

impl fmt::Debug for Contents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Contents::Bytes(bytes) => write!(f, "Bytes({})", bytes.len()),
            Contents::Parcel(_) => f.write_str("Parcel"),
        }
    }
}

/// One half of a point-to-point call: the peer (a rank of the group) and
/// the dtype and length sent to or received from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Half {
    pub(crate) peer: usize,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

/// What another transport's rank posts in a round: its device buffers'
/// addresses and the events that say when they are ready, say. This module
/// only carries it.
#[derive(Clone)]
struct Token(Arc<dyn Any + Send + Sync>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token")
    }
}

#[derive(Debug)]
struct Round {
    /// The first depositor's call; everyone else must agree with it.
    call: Call,
    first: usize,
    contributions: Vec<Option<Arc<Payload>>>,
    arrived: usize,
    taken: usize,
    /// Made once, under the lock, by the first rank to see the round full.
    result: Option<Arc<Payload>>,
}

#[derive(Debug)]
struct Group {
    /// World ranks, in group-rank order.
    members: Arc<[usize]>,
    name: Arc<str>,
    /// Open rounds by (sequence number, phase).
    rounds: BTreeMap<(u64, u8), Round>,
    /// Point-to-point messages sent and not yet received, by (sender,
    /// receiver) in group ranks, oldest first.
    mailboxes: HashMap<(usize, usize), VecDeque<Letter>>,
    /// Whether each rank's communicator has been handed out / dropped.
    taken: Vec<bool>,
    departed: Vec<bool>,
    /// Set when the group can no longer agree on its sequence of calls
    /// (mismatch, timeout, invalid arguments); every later call fails.
    broken: Option<RuntimeError>,
}

impl Group {
    fn new(members: Arc<[usize]>, name: Arc<str>, taken: bool) -> Self {
        let n = members.len();
        Group {
            members,
            name,
            rounds: BTreeMap::new(),
            mailboxes: HashMap::new(),
            taken: vec![taken; n],
            departed: vec![false; n],
            broken: None,
        }
    }
}

#[derive(Debug)]
struct FamilyState {
    /// The first abort: (world rank, reason).
    aborted: Option<(usize, String)>,
    groups: HashMap<u64, Group>,
    next_group: u64,
}

/// A world and every group split from it.
#[derive(Debug)]
struct Family {
    size: usize,
    timeout: Duration,
    state: Mutex<FamilyState>,
    /// Signalled whenever a round fills, a message is posted, a group
    /// breaks, a rank departs or the family aborts.
    changed: Condvar,
}

impl Family {
    fn lock(&self) -> MutexGuard<'_, FamilyState> {
        // Nothing panics while holding this lock (no user code runs under
        // it), so a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn abort(&self, world_rank: usize, reason: &str) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some((world_rank, reason.to_string()));
        }
        drop(state);
        self.changed.notify_all();
    }
}

const WORLD_GROUP: u64 = 0;

/// Shared state of `size` thread ranks in one process. Cloning shares it.
#[derive(Clone, Debug)]
pub struct CpuWorld {
    family: Arc<Family>,
}

impl CpuWorld {
    /// A world of `size` ranks with the default timeout.
    pub fn new(size: usize) -> Result<Self> {
        Self::with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// A world of `size` ranks whose collectives wait at most `timeout` for
    /// every rank to join (groups split from it inherit the timeout).
    pub fn with_timeout(size: usize, timeout: Duration) -> Result<Self> {
        if size == 0 {
            return Err(RuntimeError::InvalidArgument(
                "a CPU world needs at least one rank (got size 0)".into(),
            ));
        }
        let members: Arc<[usize]> = (0..size).collect();
        let mut groups = HashMap::new();
        groups.insert(WORLD_GROUP, Group::new(members, Arc::from("world"), false));
        Ok(CpuWorld {
            family: Arc::new(Family {
                size,
                timeout,
                state: Mutex::new(FamilyState {
                    aborted: None,
                    groups,
                    next_group: WORLD_GROUP + 1,
                }),
                changed: Condvar::new(),
            }),
        })
    }

    pub fn size(&self) -> usize {
        self.family.size
    }

    pub fn timeout(&self) -> Duration {
        self.family.timeout
    }

    /// Rank `rank`'s communicator. Each rank's communicator can be taken
    /// once: two handles for one rank would number their calls apart.
    pub fn comm(&self, rank: usize) -> Result<CpuComm> {
        let size = self.family.size;
        if rank >= size {
            return Err(RuntimeError::InvalidArgument(format!(
                "rank {rank} is out of range for a world of {size} ranks"
            )));
        }
        let mut state = self.family.lock();
        let group = state.groups.get_mut(&WORLD_GROUP).ok_or_else(|| {
            RuntimeError::InvalidArgument(
                "every communicator of this world was taken and dropped; make a new world".into(),
            )
        })?;
        if group.taken[rank] {
            return Err(RuntimeError::InvalidArgument(format!(
                "rank {rank}'s communicator was already taken from this world; take each \
                 rank's once and use CpuComm::split for more"
            )));
        }
        group.taken[rank] = true;
        let members = group.members.clone();
        let name = group.name.clone();
        drop(state);
        Ok(CpuComm::new(
            self.family.clone(),
            WORLD_GROUP,
            rank,
            members,
            name,
        ))
    }

    /// Every rank's communicator, in rank order.
    pub fn comms(&self) -> Result<Vec<CpuComm>> {
        (0..self.family.size).map(|r| self.comm(r)).collect()
    }

    /// Fails every collective of this world and its groups, now and later,
    /// with "rank `rank`: aborted: `reason`" (for a driver that saw a rank
    /// die).
    pub fn abort(&self, rank: usize, reason: &str) {
        self.family.abort(rank, reason);
    }

    /// The first abort, if any: (world rank, reason).
    pub fn aborted(&self) -> Option<(usize, String)> {
        self.family.lock().aborted.clone()
    }
}

/// One rank's handle on a group. Calls on one communicator must not overlap
/// (give each lane its own, via [`CpuComm::split`]); an overlapping call is
/// refused instead of corrupting the sequence.
#[derive(Debug)]
pub struct CpuComm {
    family: Arc<Family>,
    group: u64,
    rank: usize,
    members: Arc<[usize]>,
    group_name: Arc<str>,
    next_seq: AtomicU64,
    in_call: AtomicBool,
}

/// Clears the in-call flag when a call ends, however it ends.
struct InCall<'a>(&'a AtomicBool);

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// What a finished round gives a rank: every contribution, in group-rank
/// order, and the finisher's result if the call has one.
struct Exchanged {
    contributions: Vec<Arc<Payload>>,
    result: Option<Arc<Payload>>,
}

type Finisher<'a> = &'a dyn Fn(&mut FamilyState, &[Arc<Payload>]) -> Payload;

fn floats(payload: &Payload) -> &[f32] {
    match payload {
        Payload::Floats(v) => v,
        _ => &[],
    }
}

fn bytes(payload: &Payload) -> &[u8] {
    match payload {
        Payload::Bytes(v) => v,
        _ => &[],
    }
}

/// `[start, end)` of chunk `index` when `len` elements are cut into `parts`
/// chunks whose sizes differ by at most one (the larger ones first).
fn chunk(len: usize, parts: usize, index: usize) -> (usize, usize) {
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    (start, start + size)
}

impl CpuComm {
    fn new(
        family: Arc<Family>,
        group: u64,
        rank: usize,
        members: Arc<[usize]>,
        group_name: Arc<str>,
    ) -> Self {
        CpuComm {
            family,
            group,
            rank,
            members,
            group_name,
            next_seq: AtomicU64::new(1),
            in_call: AtomicBool::new(false),
        }
    }

    /// This rank's index in the world the group was split from.
    pub fn world_rank(&self) -> usize {
        self.members[self.rank]
    }

    /// World ranks of the group's members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// `world` or `group of ranks [..]`.
    pub fn group_name(&self) -> &str {
        &self.group_name
    }

    pub fn timeout(&self) -> Duration {
        self.family.timeout
    }

    /// Makes every collective of every group of this world fail, now and
    /// later, with "rank N: aborted: `reason`". Call it when this rank fails,
    /// so its peers stop promptly instead of waiting for the timeout.
    pub fn abort(&self, reason: &str) {
        self.family.abort(self.world_rank(), reason);
    }

    /// Collective: every rank of the group calls it; ranks that pass the
    /// same `color` form a new group, ordered by their rank in this group.
    /// E.g. with 4 ranks and EP = 2: `split(rank / 2)` gives the
    /// expert-parallel groups {0,1}, {2,3}; `split(rank % 2)` the
    /// expert-data-parallel groups {0,2}, {1,3}; `split(0)` a duplicate of
    /// this group (a communicator for another lane).
    pub fn split(&self, color: usize) -> Result<CpuComm> {
        let (_in_call, call) = self.begin(OpKind::Split, None, None)?;
        let parent_name = self.group_name.clone();
        let finisher = move |state: &mut FamilyState, contributions: &[Arc<Payload>]| {
            let colors: Vec<usize> = contributions
                .iter()
                .map(|p| match **p {
                    Payload::Color(c) => c,
                    _ => usize::MAX,
                })
                .collect();
            let members_of_parent = self.members.clone();
            let distinct: BTreeSet<usize> = colors.iter().copied().collect();
            let mut groups = Vec::new();
            for color in distinct {
                let members: Arc<[usize]> = colors
                    .iter()
                    .zip(members_of_parent.iter())
                    .filter(|(c, _)| **c == color)
                    .map(|(_, world)| *world)
                    .collect();
                let id = state.next_group;
                state.next_group += 1;
                let name: Arc<str> = if members.len() == members_of_parent.len() {
                    Arc::from(format!("copy of {parent_name}"))
                } else {
                    Arc::from(format!("group of ranks {:?}", &*members))
                };
                state
                    .groups
                    .insert(id, Group::new(members.clone(), name, true));
                groups.push((color, id, members));
            }
            Payload::Groups(groups)
        };
        let exchanged = self.exchange(&call, Payload::Color(color), Some(&finisher))?;
        let groups = match exchanged.result.as_deref() {
            Some(Payload::Groups(groups)) => groups,
            _ => return Err(self.internal(&call, "the split made no groups")),
        };
        let (_, id, members) = groups
            .iter()
            .find(|(c, _, _)| *c == color)
            .ok_or_else(|| self.internal(&call, "no group for this rank's color"))?;
        let me = self.world_rank();
        let rank = members
            .iter()
            .position(|w| *w == me)
            .ok_or_else(|| self.internal(&call, "this rank is missing from its new group"))?;
        let name = self
            .family
            .lock()
            .groups
            .get(id)
            .map(|g| g.name.clone())
            .unwrap_or_else(|| Arc::from("group"));
        Ok(CpuComm::new(
            self.family.clone(),
            *id,
            rank,
            members.clone(),
            name,
        ))
    }

    fn internal(&self, call: &dyn fmt::Display, what: &str) -> RuntimeError {
        RuntimeError::Peer {
            rank: self.world_rank(),
            message: format!("internal error in {call} on {}: {what}", self.group_name),
        }
    }

    /// Marks the communicator busy for a call named `name`.
    fn enter(&self, name: &str) -> Result<InCall<'_>> {
        if self.in_call.swap(true, Ordering::Acquire) {
            return Err(RuntimeError::InvalidArgument(format!(
                "rank {} called {name} on {} while another collective on the same communicator \
                 was in flight; calls on one communicator must be ordered (give each lane \
                 its own communicator with CpuComm::split)",
                self.world_rank(),
                self.group_name
            )));
        }
        Ok(InCall(&self.in_call))
    }

    /// Numbers the call and marks the communicator busy.
    fn begin(
        &self,
        kind: OpKind,
        elements: Option<usize>,
        dtype: Option<DType>,
    ) -> Result<(InCall<'_>, Call)> {
        let guard = self.enter(kind.name())?;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        Ok((
            guard,
            Call {
                kind,
                elements,
                dtype,
                seq,
                phase: 0,
            },
        ))
    }

    /// Refuses a call whose arguments are wrong on this rank, and breaks
    /// the group so peers waiting in the same call fail now instead of at
    /// the timeout.
    fn reject(&self, call: &dyn fmt::Display, problem: String) -> RuntimeError {
        let mut state = self.family.lock();
        if let Some(group) = state.groups.get_mut(&self.group)
            && group.broken.is_none()
        {
            group.broken = Some(RuntimeError::Peer {
                rank: self.world_rank(),
                message: format!(
                    "called {call} on {} with invalid arguments: {problem}",
                    self.group_name
                ),
            });
        }
        drop(state);
        self.family.changed.notify_all();
        RuntimeError::InvalidArgument(format!(
            "rank {}: {call} on {}: {problem}",
            self.world_rank(),
            self.group_name
        ))
    }

    fn aborted_error(&self, call: &dyn fmt::Display, rank: usize, reason: &str) -> RuntimeError {
        RuntimeError::Peer {
            rank,
            message: format!(
                "aborted: {reason} (rank {} was in {call} on {})",
                self.world_rank(),
                self.group_name
            ),
        }
    }

    /// Deposits `payload` as this rank's part of round `call.seq` and waits
    /// until every rank of the group has deposited, or fails.
    fn exchange(
        &self,
        call: &Call,
        payload: Payload,
        finisher: Option<Finisher<'_>>,
    ) -> Result<Exchanged> {
        let n = self.members.len();
        let deadline = crate::lane::thread::deadline_after(self.family.timeout);
        let mut state = self.family.lock();
        if let Some((rank, reason)) = &state.aborted {
            return Err(self.aborted_error(call, *rank, reason));
        }
        let group = self.group_mut(&mut state, call)?;
        if let Some(error) = &group.broken {
            return Err(error.clone());
        }
        let round = group
            .rounds
            .entry((call.seq, call.phase))
            .or_insert_with(|| Round {
                call: call.clone(),
                first: self.rank,
                contributions: vec![None; n],
                arrived: 0,
                taken: 0,
                result: None,
            });
        if !round.call.agrees_with(call) {
            let error = RuntimeError::Peer {
                rank: self.world_rank(),
                message: format!(
                    "called {call} but rank {} called {} on {}: every rank of a group must \
                     issue the same collectives, with the same sizes, in the same order",
                    group.members[round.first], round.call, group.name
                ),
            };
            group.broken = Some(error.clone());
            drop(state);
            self.family.changed.notify_all();
            return Err(error);
        }
        round.contributions[self.rank] = Some(Arc::new(payload));
        round.arrived += 1;
        if round.arrived == n {
            self.family.changed.notify_all();
        }
        loop {
            // A round that is already complete holds valid data even if an
            // abort came after it; one that is not fails on abort.
            let round = self.round_mut(&mut state, call)?;
            if round.arrived == n {
                return self.take(&mut state, call, finisher);
            }
            if let Some((rank, reason)) = &state.aborted {
                return Err(self.aborted_error(call, *rank, reason));
            }
            let group = self.group_mut(&mut state, call)?;
            if let Some(error) = &group.broken {
                return Err(error.clone());
            }
            let Some(round) = group.rounds.get(&(call.seq, call.phase)) else {
                return Err(self.internal(call, "the round is gone"));
            };
            let missing: Vec<usize> = (0..n)
                .filter(|r| round.contributions[*r].is_none())
                .collect();
            if let Some(gone) = missing.iter().find(|r| group.departed[**r]) {
                return Err(RuntimeError::Peer {
                    rank: group.members[*gone],
                    message: format!(
                        "left {} before joining {call}: its communicator was dropped (its \
                         thread ended or panicked)",
                        group.name
                    ),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let missing_world: Vec<usize> = missing.iter().map(|r| group.members[*r]).collect();
                let others = if missing_world.len() > 1 {
                    format!(" (ranks {missing_world:?} are all missing)")
                } else {
                    String::new()
                };
                let error = RuntimeError::Peer {
                    rank: missing_world.first().copied().unwrap_or(0),
                    message: format!(
                        "did not join {call} on {} within {:?}: it may have died or \
                         stalled{others}; rank {} gave up waiting",
                        group.name,
                        self.family.timeout,
                        self.world_rank()
                    ),
                };
                group.broken = Some(error.clone());
                drop(state);
                self.family.changed.notify_all();
                return Err(error);
            }
            state = self
                .family
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    fn group_mut<'s>(
        &self,
        state: &'s mut FamilyState,
        call: &dyn fmt::Display,
    ) -> Result<&'s mut Group> {
        state
            .groups
            .get_mut(&self.group)
            .ok_or_else(|| self.internal(call, "the group is gone"))
    }

    fn round_mut<'s>(&self, state: &'s mut FamilyState, call: &Call) -> Result<&'s mut Round> {
        self.group_mut(state, call)?
            .rounds
            .get_mut(&(call.seq, call.phase))
            .ok_or_else(|| self.internal(call, "the round is gone"))
    }

    /// Takes this rank's view of a complete round (making the finisher's
    /// result first if nobody has); the last rank to take closes the round.
    fn take(
        &self,
        state: &mut FamilyState,
        call: &Call,
        finisher: Option<Finisher<'_>>,
    ) -> Result<Exchanged> {
        let round = self.round_mut(state, call)?;
        let contributions: Vec<Arc<Payload>> =
            round.contributions.iter().flatten().cloned().collect();
        if let Some(finish) = finisher
            && round.result.is_none()
        {
            let made = Arc::new(finish(state, &contributions));
            self.round_mut(state, call)?.result = Some(made);
        }
        let n = self.members.len();
        let group = self.group_mut(state, call)?;
        let key = (call.seq, call.phase);
        let round = group
            .rounds
            .get_mut(&key)
            .ok_or_else(|| self.internal(call, "the round is gone"))?;
        let result = round.result.clone();
        round.taken += 1;
        if round.taken == n {
            group.rounds.remove(&key);
        }
        Ok(Exchanged {
            contributions,
            result,
        })
    }

    /// Checks that every rank's all_to_all counts agree pairwise: what rank
    /// i sends to rank j is what rank j expects from rank i. Every rank runs
    /// the same check over the same data, so all fail alike.
    fn check_all_to_all(&self, call: &Call, contributions: &[Arc<Payload>]) -> Result<()> {
        let mut send = Vec::with_capacity(contributions.len());
        let mut recv = Vec::with_capacity(contributions.len());
        for payload in contributions {
            let Payload::AllToAll {
                send_counts,
                recv_counts,
                ..
            } = &**payload
            else {
                return Err(self.internal(call, "a rank deposited no all_to_all data"));
            };
            send.push(send_counts.as_slice());
            recv.push(recv_counts.as_slice());
        }
        self.check_all_to_all_counts(call, &send, &recv)
    }

    /// The pairwise check of [`CpuComm::check_all_to_all`], on every rank's
    /// `send` and `recv` counts in group-rank order.
    fn check_all_to_all_counts(
        &self,
        call: &Call,
        send: &[&[usize]],
        recv: &[&[usize]],
    ) -> Result<()> {
        for (i, send_counts) in send.iter().enumerate() {
            for (j, recv_counts) in recv.iter().enumerate() {
                if send_counts[j] != recv_counts[i] {
                    return Err(RuntimeError::Peer {
                        rank: self.members[i],
                        message: format!(
                            "sends {} elements to rank {} in {call} on {}, but rank {} expects \
                             recv_counts[{i}] = {}; exchange the counts first \
                             (all_to_all_counts) so both sides agree",
                            send_counts[j],
                            self.members[j],
                            self.group_name,
                            self.members[j],
                            recv_counts[i]
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

/// One collective of a transport that moves its data elsewhere (the CUDA
/// copy transport, between the GPUs of this process), numbered and checked
/// here like a CPU collective: every rank of the group must call the same
/// kind, size and dtype in the same order, and a rank that errs, aborts,
/// leaves or stalls past the timeout fails its peers' calls instead of
/// hanging them. Each [`DeviceRound::exchange`] is one more round of the
/// call (a phase): every rank posts a token and gets every rank's, in
/// group-rank order.
pub(crate) struct DeviceRound<'a> {
    comm: &'a CpuComm,
    _in_call: InCall<'a>,
    call: Call,
}

impl DeviceRound<'_> {
    /// Posts this rank's `token` and returns every rank's, in group-rank
    /// order, once all have posted.
    pub(crate) fn exchange<T: Any + Send + Sync>(&mut self, token: T) -> Result<Vec<Arc<T>>> {
        let exchanged =
            self.comm
                .exchange(&self.call, Payload::Token(Token(Arc::new(token))), None)?;
        self.call.phase = self.call.phase.wrapping_add(1);
        exchanged
            .contributions
            .iter()
            .map(|p| match &**p {
                Payload::Token(Token(t)) => t.clone().downcast::<T>().ok(),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                self.comm
                    .internal(&self.call, "a rank posted another kind of token")
            })
    }

    /// Refuses the call for `problem` on this rank, failing the peers
    /// waiting in it (see [`CpuComm::reject`]).
    pub(crate) fn reject(&self, problem: String) -> RuntimeError {
        self.comm.reject(&self.call, problem)
    }

    /// Breaks the group after this rank failed in the call with `error`,
    /// so peers waiting in a later round of it fail now, naming this rank,
    /// instead of at the timeout.
    pub(crate) fn abandon(&self, error: &RuntimeError) {
        self.comm.abandon(&self.call, error);
    }

    /// An all-to-all's counts, every rank's in group-rank order, checked
    /// pairwise as the CPU's all-to-all checks them (every rank sees the
    /// same counts, so all fail alike).
    pub(crate) fn check_all_to_all(&self, send: &[&[usize]], recv: &[&[usize]]) -> Result<()> {
        self.comm.check_all_to_all_counts(&self.call, send, recv)
    }
}

impl CpuComm {
    /// Begins a collective whose data another transport moves: `kind` with
    /// `elements` and `dtype` for the peers to agree on ([`DeviceRound`]).
    pub(crate) fn device_round(
        &self,
        kind: OpKind,
        elements: Option<usize>,
        dtype: Option<DType>,
    ) -> Result<DeviceRound<'_>> {
        let (in_call, call) = self.begin(kind, elements, dtype)?;
        Ok(DeviceRound {
            comm: self,
            _in_call: in_call,
            call,
        })
    }
}

impl Drop for CpuComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.family.abort(
                self.world_rank(),
                "its thread panicked while holding this communicator",
            );
        }
        let mut state = self.family.lock();
        let emptied = match state.groups.get_mut(&self.group) {
            Some(group) => {
                group.departed[self.rank] = true;
                group.departed.iter().all(|d| *d)
            }
            None => false,
        };
        // Messages nobody received go with the group, outside the lock:
        // another transport's parcels free device memory when dropped.
        let removed = if emptied {
            state.groups.remove(&self.group)
        } else {
            None
        };
        drop(state);
        self.family.changed.notify_all();
        drop(removed);
    }
}

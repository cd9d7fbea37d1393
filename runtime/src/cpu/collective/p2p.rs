//! Point-to-point transfers between two ranks of a group: per (sender,
//! receiver) mailboxes under the world's lock, no round of the group
//! (`Collective::send_recv` for the CPU, and [`DeviceP2p`] for a transport
//! that moves its data elsewhere).

use super::*;

/// A point-to-point call of one rank, as messages name it: "send_recv
/// (sending 4 f32 elements to rank 1, receiving 4 f32 elements from rank
/// 3)", in world ranks.
#[derive(Clone, Debug)]
pub(super) struct P2p {
    pub(super) send: Option<Half>,
    pub(super) recv: Option<Half>,
    /// The group's world ranks, to name the peers.
    pub(super) members: Arc<[usize]>,
}

impl P2p {
    /// The world rank of group rank `peer` (itself when out of range, for
    /// the message refusing it).
    fn world(&self, peer: usize) -> usize {
        self.members.get(peer).copied().unwrap_or(peer)
    }
}

impl fmt::Display for P2p {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("send_recv (")?;
        let halves = [
            (self.send, "sending", "to"),
            (self.recv, "receiving", "from"),
        ];
        let mut first = true;
        for (half, verb, preposition) in halves {
            let Some(h) = half else { continue };
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            let peer = self.world(h.peer);
            write!(
                f,
                "{verb} {} {} elements {preposition} rank {peer}",
                h.len, h.dtype
            )?;
        }
        if first {
            f.write_str("nothing")?;
        }
        f.write_str(")")
    }
}

impl CpuComm {
    /// Marks the communicator busy for a point-to-point call (no sequence
    /// number: transfers are no rounds of the group) and checks its peers.
    /// A refused call breaks the group, as a refused collective does, so
    /// the peer waiting for its message fails now instead of at the
    /// timeout.
    pub(super) fn begin_p2p(
        &self,
        send: Option<Half>,
        recv: Option<Half>,
    ) -> Result<(InCall<'_>, P2p)> {
        let p2p = P2p {
            send,
            recv,
            members: self.members.clone(),
        };
        let in_call = self.enter("send_recv")?;
        if let Err(problem) = self.check_p2p(&p2p) {
            return Err(self.reject(&p2p, problem));
        }
        Ok((in_call, p2p))
    }

    pub(super) fn check_p2p(&self, p2p: &P2p) -> std::result::Result<(), String> {
        let n = self.members.len();
        if p2p.send.is_none() && p2p.recv.is_none() {
            return Err("neither a send nor a receive was given".into());
        }
        for (half, verb) in [(p2p.send, "send to"), (p2p.recv, "receive from")] {
            let Some(half) = half else { continue };
            if half.peer >= n {
                return Err(format!(
                    "cannot {verb} rank {}: the group has {n} ranks",
                    half.peer
                ));
            }
            if half.peer == self.rank {
                return Err(format!(
                    "cannot {verb} itself (rank {} is this rank)",
                    half.peer
                ));
            }
        }
        Ok(())
    }

    /// Puts a message to `half.peer` at the back of its mailbox and wakes
    /// the receiver; never waits (sends are buffered). Fails in an aborted
    /// family or a broken group, as every call after those does.
    pub(super) fn post(&self, p2p: &P2p, half: Half, contents: Contents) -> Result<()> {
        let mut state = self.family.lock();
        if let Some((rank, reason)) = &state.aborted {
            return Err(self.aborted_error(p2p, *rank, reason));
        }
        let me = self.world_rank();
        let group = self.group_mut(&mut state, p2p)?;
        if let Some(error) = &group.broken {
            return Err(error.clone());
        }
        if group.departed[half.peer] {
            return Err(RuntimeError::Peer {
                rank: group.members[half.peer],
                message: format!(
                    "left {} before rank {me} sent to it in {p2p}: its communicator was \
                     dropped (its thread ended or panicked)",
                    group.name
                ),
            });
        }
        group
            .mailboxes
            .entry((self.rank, half.peer))
            .or_default()
            .push_back(Letter {
                dtype: half.dtype,
                len: half.len,
                contents,
            });
        drop(state);
        self.family.changed.notify_all();
        Ok(())
    }

    /// Waits for the oldest message from `half.peer` to this rank and takes
    /// it, once it has `half`'s dtype and length. A mismatch, a timeout or
    /// a peer that left breaks the group (the two ranks' transfers are out
    /// of step), so the sender's next call fails too; an abort or a broken
    /// group fails the wait, but not a message posted before it.
    pub(super) fn collect(&self, p2p: &P2p, half: Half) -> Result<Contents> {
        let deadline = crate::lane::thread::deadline_after(self.family.timeout);
        let me = self.world_rank();
        let mut state = self.family.lock();
        loop {
            let aborted = state.aborted.clone();
            let group = self.group_mut(&mut state, p2p)?;
            let from = group.members[half.peer];
            // A message posted before an abort or a break is still taken,
            // as a round that completed before one still gives its data.
            let letter = group
                .mailboxes
                .get_mut(&(half.peer, self.rank))
                .and_then(VecDeque::pop_front);
            let (error, letter) = match letter {
                Some(letter) if letter.dtype == half.dtype && letter.len == half.len => {
                    return Ok(letter.contents);
                }
                Some(letter) => {
                    let error = RuntimeError::Peer {
                        rank: me,
                        message: format!(
                            "receives {} {} elements from rank {from} on {}, but rank {from} \
                             sent {} {} elements: every send must be paired with a receive of \
                             the same dtype and length",
                            half.len, half.dtype, group.name, letter.len, letter.dtype
                        ),
                    };
                    (error, Some(letter))
                }
                None => {
                    if let Some((rank, reason)) = aborted {
                        return Err(self.aborted_error(p2p, rank, &reason));
                    }
                    if let Some(error) = &group.broken {
                        return Err(error.clone());
                    }
                    let message = if group.departed[half.peer] {
                        format!(
                            "left {} before sending what rank {me} waits for in {p2p}: its \
                             communicator was dropped (its thread ended or panicked)",
                            group.name
                        )
                    } else if Instant::now() >= deadline {
                        format!(
                            "did not send to rank {me} on {} within {:?}: it may have died or \
                             stalled, or its schedule has no send to match this receive; rank \
                             {me} gave up waiting in {p2p}",
                            group.name, self.family.timeout
                        )
                    } else {
                        let left = deadline.saturating_duration_since(Instant::now());
                        state = self
                            .family
                            .changed
                            .wait_timeout(state, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        continue;
                    };
                    let error = RuntimeError::Peer {
                        rank: from,
                        message,
                    };
                    (error, None)
                }
            };
            group.broken = Some(error.clone());
            drop(state);
            self.family.changed.notify_all();
            // Outside the lock: another transport's parcel frees device
            // memory when dropped.
            drop(letter);
            return Err(error);
        }
    }
}

/// One point-to-point call of a transport that moves its data elsewhere
/// (the CUDA copy transport): its messages are parcels of that transport's
/// own, matched, checked and waited for here like the CPU's. Made by
/// [`CpuComm::device_p2p`], which refuses bad peers.
pub(crate) struct DeviceP2p<'a> {
    comm: &'a CpuComm,
    _in_call: InCall<'a>,
    p2p: P2p,
}

impl DeviceP2p<'_> {
    /// Posts `parcel` as the message of this call's send half.
    pub(crate) fn send<T: Any + Send>(&self, parcel: T) -> Result<()> {
        let half = self
            .p2p
            .send
            .ok_or_else(|| self.comm.internal(&self.p2p, "the call has no send"))?;
        self.comm
            .post(&self.p2p, half, Contents::Parcel(Box::new(parcel)))
    }

    /// Waits for the message of this call's receive half and takes its
    /// parcel.
    pub(crate) fn receive<T: Any + Send>(&self) -> Result<T> {
        let half = self
            .p2p
            .recv
            .ok_or_else(|| self.comm.internal(&self.p2p, "the call has no receive"))?;
        match self.comm.collect(&self.p2p, half)? {
            Contents::Parcel(parcel) => {
                parcel.downcast::<T>().map(|parcel| *parcel).map_err(|_| {
                    self.comm
                        .internal(&self.p2p, "a rank sent another kind of parcel")
                })
            }
            Contents::Bytes(_) => Err(self
                .comm
                .internal(&self.p2p, "a rank sent bytes, not a parcel")),
        }
    }

    /// Refuses the call for `problem` on this rank, failing the peers
    /// (see [`CpuComm::reject`]).
    pub(crate) fn reject(&self, problem: String) -> RuntimeError {
        self.comm.reject(&self.p2p, problem)
    }

    /// Breaks the group after this rank failed in the call with `error`,
    /// so a peer waiting for its message fails now, naming this rank.
    pub(crate) fn abandon(&self, error: &RuntimeError) {
        self.comm.abandon(&self.p2p, error);
    }
}

impl CpuComm {
    /// Begins a point-to-point call whose data another transport moves
    /// ([`DeviceP2p`]); refuses a call with neither half, or a peer that is
    /// this rank or outside the group.
    pub(crate) fn device_p2p(
        &self,
        send: Option<Half>,
        recv: Option<Half>,
    ) -> Result<DeviceP2p<'_>> {
        let (in_call, p2p) = self.begin_p2p(send, recv)?;
        Ok(DeviceP2p {
            comm: self,
            _in_call: in_call,
            p2p,
        })
    }

    /// Breaks the group: this rank failed in `call` with `error`.
    pub(super) fn abandon(&self, call: &dyn fmt::Display, error: &RuntimeError) {
        let mut state = self.family.lock();
        if let Some(group) = state.groups.get_mut(&self.group)
            && group.broken.is_none()
        {
            group.broken = Some(RuntimeError::Peer {
                rank: self.world_rank(),
                message: format!("failed in {call} on {}: {error}", self.group_name),
            });
        }
        drop(state);
        self.family.changed.notify_all();
    }
}

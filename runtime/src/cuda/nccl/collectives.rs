//! A communicator's calls: the device collectives, enqueued on its stream,
//! and the host-side exchanges (counts, small f64 vectors, barriers),
//! encoded by [`super::host_exchange`] and moved through the staging buffer.

use super::*;

impl NcclComm {
    // ---- device collectives ------------------------------------------------------------

    /// Every rank contributes `shard` (S elements of any dtype, the same
    /// on every rank); `full` (S x size of that dtype) receives all shards
    /// in rank order. In place when `shard` is this rank's slot of `full`.
    pub fn all_gather(&self, shard: GpuView, full: GpuView) -> Result<()> {
        let call = format!(
            "all_gather ({} {} elements per rank)",
            shard.len, shard.dtype
        );
        let _busy = self.begin(&call)?;
        arguments::all_gather(self.size, self.rank, &shard, &full)
            .map_err(|p| self.refuse(&call, p))?;
        if shard.len == 0 {
            return self.check();
        }
        let dtype = arguments::nccl_type(shard.dtype);
        self.issue(&call, |api, raw, stream| {
            // SAFETY: both views were checked: lengths, dtypes, and an
            // overlap only in NCCL's in-place layout.
            unsafe {
                (api.all_gather)(
                    shard.ptr as *const c_void,
                    full.ptr as *mut c_void,
                    shard.len,
                    dtype,
                    raw,
                    stream,
                )
            }
        })
    }

    /// Every rank contributes `full` (S x size f32); the element-wise sum's
    /// elements `[rank*S, (rank+1)*S)` land in `shard`. In place when
    /// `shard` is this rank's slot of `full`.
    pub fn reduce_scatter(&self, full: GpuView, shard: GpuView) -> Result<()> {
        let call = format!("reduce_scatter ({} {} elements)", full.len, full.dtype);
        let _busy = self.begin(&call)?;
        arguments::reduce_scatter(self.size, self.rank, &full, &shard)
            .map_err(|p| self.refuse(&call, p))?;
        if shard.len == 0 {
            return self.check();
        }
        self.issue(&call, |api, raw, stream| {
            // SAFETY: both f32, lengths checked, overlap only in place.
            unsafe {
                (api.reduce_scatter)(
                    full.ptr as *const c_void,
                    shard.ptr as *mut c_void,
                    shard.len,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    raw,
                    stream,
                )
            }
        })
    }

    /// Element-wise sum of an f32 buffer over the group, in place.
    pub fn all_reduce(&self, buf: GpuView) -> Result<()> {
        let call = format!("all_reduce ({} {} elements)", buf.len, buf.dtype);
        let _busy = self.begin(&call)?;
        arguments::all_reduce(&buf).map_err(|p| self.refuse(&call, p))?;
        if buf.len == 0 {
            return self.check();
        }
        self.issue(&call, |api, raw, stream| {
            // SAFETY: an f32 buffer of `len` elements, reduced in place.
            unsafe {
                (api.all_reduce)(
                    buf.ptr as *const c_void,
                    buf.ptr as *mut c_void,
                    buf.len,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    raw,
                    stream,
                )
            }
        })
    }

    /// Variable all-to-all of one dtype: `send` is cut into `size`
    /// segments of `send_counts[j]` elements, segment j going to rank j;
    /// `recv` receives `recv_counts[i]` elements from rank i, in rank
    /// order. Counts must agree pairwise (exchange them first with
    /// [`Self::all_to_all_counts`]): a rank cannot see its peers' counts
    /// here without a host round trip, so a disagreement shows as a stall
    /// that the timeout ends. This rank's own segment moves by a
    /// device-to-device copy; zero counts move nothing.
    pub fn all_to_all(
        &self,
        send: GpuView,
        send_counts: &[usize],
        recv: GpuView,
        recv_counts: &[usize],
    ) -> Result<()> {
        let call = format!("all_to_all ({} elements)", send.dtype);
        let _busy = self.begin(&call)?;
        arguments::all_to_all(self.size, self.rank, &send, send_counts, &recv, recv_counts)
            .map_err(|p| self.refuse(&call, p))?;
        self.check()?;
        let bytes = send.dtype.bytes() as u64;
        let (send_at, recv_at) = (
            arguments::offsets(send_counts),
            arguments::offsets(recv_counts),
        );
        let me = self.rank;
        if send_counts[me] > 0 {
            self.stream
                .context()
                .bind_to_thread()
                .map_err(|e| device_error(&self.device(), &call, e))?;
            // SAFETY: both segments lie inside views whose lengths match
            // their counts (checked), and the views do not overlap.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    recv.ptr + recv_at[me] as u64 * bytes,
                    send.ptr + send_at[me] as u64 * bytes,
                    send_counts[me] * send.dtype.bytes(),
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| device_error(&self.device(), &call, e))?;
        }
        let peers_move =
            (0..self.size).any(|j| j != me && (send_counts[j] > 0 || recv_counts[j] > 0));
        if !peers_move {
            return Ok(());
        }
        let dtype = arguments::nccl_type(send.dtype);
        self.issue(&call, |api, raw, stream| {
            // SAFETY: as for the copy above; every segment is inside its
            // view. The group is always closed, so NCCL's thread-local
            // group state stays balanced even when a call in it fails.
            unsafe {
                let started = (api.group_start)();
                if started != 0 {
                    return started;
                }
                let mut first_failure = 0;
                for peer in (0..self.size).filter(|&j| j != me) {
                    let c_peer = peer as c_int;
                    if send_counts[peer] > 0 {
                        let sent = (api.send)(
                            (send.ptr + send_at[peer] as u64 * bytes) as *const c_void,
                            send_counts[peer],
                            dtype,
                            c_peer,
                            raw,
                            stream,
                        );
                        if first_failure == 0 {
                            first_failure = sent;
                        }
                    }
                    if recv_counts[peer] > 0 {
                        let received = (api.recv)(
                            (recv.ptr + recv_at[peer] as u64 * bytes) as *mut c_void,
                            recv_counts[peer],
                            dtype,
                            c_peer,
                            raw,
                            stream,
                        );
                        if first_failure == 0 {
                            first_failure = received;
                        }
                    }
                }
                let ended = (api.group_end)();
                if first_failure == 0 {
                    ended
                } else {
                    first_failure
                }
            }
        })
    }

    /// Point-to-point: `send` (a view and a rank of this group) is sent to
    /// that rank and/or `recv` receives from one, as one NCCL group, so
    /// two ranks that send to each other in one call do not wait on each
    /// other ([`Self::send_recv_all`] with at most one of each).
    pub fn send_recv(
        &self,
        send: Option<(GpuView, usize)>,
        recv: Option<(GpuView, usize)>,
    ) -> Result<()> {
        self.send_recv_all(send.as_slice(), recv.as_slice())
    }

    /// Every transfer of `sends` and `recvs` (each a view and a rank of
    /// this group) as one NCCL group (`ncclSend` and `ncclRecv` between
    /// `ncclGroupStart` and `ncclGroupEnd`): none waits on another, so a
    /// stage can exchange with both neighbours at once. Enqueued on the
    /// stream like the other device collectives: NCCL moves each transfer
    /// once both ranks have posted it, pairs a pair's transfers in the
    /// order they were posted, and the stream waits there until then. The
    /// peers' dtypes and lengths are not checked (NCCL does not see them
    /// without a host round trip, as for [`Self::all_to_all`]'s counts): a
    /// mismatch shows as a stall that the timeout ends. Empty views move
    /// nothing.
    pub fn send_recv_all(
        &self,
        sends: &[(GpuView, usize)],
        recvs: &[(GpuView, usize)],
    ) -> Result<()> {
        let call = self.p2p_name(sends, recvs);
        let _busy = self.begin(&call)?;
        arguments::send_recv(self.size, self.rank, sends, recvs)
            .map_err(|p| self.refuse(&call, p))?;
        self.check()?;
        let moving = |halves: &[(GpuView, usize)]| -> Vec<(GpuView, usize)> {
            halves
                .iter()
                .copied()
                .filter(|(view, _)| view.len > 0)
                .collect()
        };
        let (sends, recvs) = (moving(sends), moving(recvs));
        let mut peers: Vec<usize> = sends
            .iter()
            .chain(&recvs)
            .map(|(_, p)| self.members[*p])
            .collect();
        peers.sort_unstable();
        peers.dedup();
        let peers = match peers.as_slice() {
            [] => return Ok(()),
            [one] => format!("rank {one}"),
            many => format!("ranks {many:?}"),
        };
        self.issue_with(&call, &peers, |api, raw, stream| {
            // SAFETY: each view lies inside a live buffer (its length and
            // dtype are the view's), no receive shares a byte with another
            // view (checked), and the peers are ranks of this communicator
            // other than this one (checked). The group is always closed, so
            // NCCL's thread-local group state stays balanced even when a
            // call in it fails.
            unsafe {
                let started = (api.group_start)();
                if started != 0 {
                    return started;
                }
                let mut first_failure = 0;
                for (view, to) in &sends {
                    let sent = (api.send)(
                        view.ptr as *const c_void,
                        view.len,
                        arguments::nccl_type(view.dtype),
                        *to as c_int,
                        raw,
                        stream,
                    );
                    if first_failure == 0 {
                        first_failure = sent;
                    }
                }
                for (view, from) in &recvs {
                    let received = (api.recv)(
                        view.ptr as *mut c_void,
                        view.len,
                        arguments::nccl_type(view.dtype),
                        *from as c_int,
                        raw,
                        stream,
                    );
                    if first_failure == 0 {
                        first_failure = received;
                    }
                }
                let ended = (api.group_end)();
                if first_failure == 0 {
                    ended
                } else {
                    first_failure
                }
            }
        })
    }

    /// "send_recv (sending 4 f32 elements to rank 1, receiving 4 f32
    /// elements from rank 3)", in world ranks.
    fn p2p_name(&self, sends: &[(GpuView, usize)], recvs: &[(GpuView, usize)]) -> String {
        let world = |peer: usize| self.members.get(peer).copied().unwrap_or(peer);
        let halves: Vec<String> = sends
            .iter()
            .map(|half| (half, "sending", "to"))
            .chain(recvs.iter().map(|half| (half, "receiving", "from")))
            .map(|((view, peer), verb, preposition)| {
                format!(
                    "{verb} {} {} elements {preposition} rank {}",
                    view.len,
                    view.dtype,
                    world(*peer)
                )
            })
            .collect();
        if halves.is_empty() {
            "send_recv (nothing)".into()
        } else {
            format!("send_recv ({})", halves.join(", "))
        }
    }

    // ---- host-side exchanges -------------------------------------------------------------

    /// Host-side all-to-all of small count vectors: `send[j]` goes to rank
    /// j; returns what each rank sent to this one, in rank order. Vectors
    /// may have any length (different per peer).
    pub fn all_to_all_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        let _busy = self.begin(HostOp::AllToAllCounts.name())?;
        let n = self.size;
        let contribution = if send.len() != n {
            Contribution::Refused(format!(
                "{} count vectors were given but the group has {n} ranks (one per destination)",
                send.len()
            ))
        } else {
            self.bounded(host_exchange::encode_counts(send))
        };
        let (call, all) = self.host_exchange(HostOp::AllToAllCounts, contribution)?;
        all.iter()
            .enumerate()
            .map(|(from, payload)| {
                host_exchange::decode_counts(payload, n, self.rank).ok_or_else(|| {
                    RuntimeError::Peer {
                        rank: self.members[from],
                        message: format!(
                            "sent a malformed count exchange in {call} on {}",
                            self.group_name
                        ),
                    }
                })
            })
            .collect()
    }

    /// Host-side all-gather of small f64 vectors (losses, norm partials):
    /// every rank's `values` in rank order (lengths may differ).
    pub fn all_gather_host(&self, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        let _busy = self.begin(HostOp::AllGatherHost.name())?;
        let contribution = self.bounded(host_exchange::encode_values(values));
        let (_, all) = self.host_exchange(HostOp::AllGatherHost, contribution)?;
        Ok(all
            .iter()
            .map(|p| host_exchange::decode_values(p))
            .collect())
    }

    /// Returns once every rank of the group has called it.
    pub fn barrier(&self) -> Result<()> {
        let _busy = self.begin(HostOp::Barrier.name())?;
        self.host_exchange(HostOp::Barrier, Contribution::Words(Vec::new()))
            .map(|_| ())
    }

    /// A payload, or the refusal of one too long for a host exchange.
    fn bounded(&self, words: Vec<u64>) -> Contribution {
        if words.len() > host_exchange::MAX_PAYLOAD_WORDS {
            Contribution::Refused(format!(
                "{} words is more than a host-side exchange carries ({}); these carry counts \
                 and a few values, not tensors",
                words.len(),
                host_exchange::MAX_PAYLOAD_WORDS
            ))
        } else {
            Contribution::Words(words)
        }
    }

    /// One host-side exchange (the caller holds the in-call flag): every
    /// rank's payload, after checking that all made the same call and none
    /// refused it. A refusal of this rank's own is exchanged too (so the
    /// peers fail at once, naming it) and then returned as its error.
    pub(super) fn host_exchange(
        &self,
        op: HostOp,
        contribution: Contribution,
    ) -> Result<(HostCall, Vec<Vec<u64>>)> {
        let call = HostCall {
            op,
            seq: self.next_host_seq.fetch_add(1, Ordering::Relaxed),
        };
        let outgoing = Outgoing::new(call, &contribution);
        let mut staging = lock(&self.staging);
        let block = staging.block;
        let first = self.gather_words(&mut staging, &outgoing.first_block(block), block, call)?;
        let headers = host_exchange::headers(&first, self.size, block);
        if let Some((rank, len)) = host_exchange::oversized(&headers) {
            return Err(RuntimeError::Peer {
                rank: self.members[rank],
                message: format!(
                    "sent {len} words in {call} on {}, more than a host-side exchange carries",
                    self.group_name
                ),
            });
        }
        let overflow = host_exchange::overflow_words(&headers, block);
        let second = if overflow > 0 {
            let words = outgoing.second_block(block, overflow);
            self.gather_words(&mut staging, &words, overflow, call)?
        } else {
            Vec::new()
        };
        staging.block = host_exchange::next_block_words(&headers, block);
        drop(staging);
        let all = host_exchange::payloads(&headers, &first, &second, block, overflow);
        host_exchange::check_agreement(call, self.rank, &headers, &all)
            .map_err(|d| self.disagreement(call, d))?;
        if let Contribution::Refused(reason) = contribution {
            return Err(self.refuse(&call.to_string(), reason));
        }
        Ok((call, all))
    }

    fn disagreement(&self, mine: HostCall, d: host_exchange::Disagreement) -> RuntimeError {
        match d {
            host_exchange::Disagreement::OtherCall { rank, theirs } => RuntimeError::Peer {
                rank: self.members[rank],
                message: format!(
                    "called {} but rank {} called {mine} on {}: every rank of a group must \
                     issue the same collectives, with the same sizes, in the same order",
                    theirs
                        .map(|c| c.to_string())
                        .unwrap_or_else(|| "an exchange this build does not know".into()),
                    self.world_rank(),
                    self.group_name
                ),
            },
            host_exchange::Disagreement::Refused { rank, reason } => RuntimeError::Peer {
                rank: self.members[rank],
                message: format!(
                    "called {mine} on {} with invalid arguments: {reason}",
                    self.group_name
                ),
            },
        }
    }

    /// One round: `words` (this rank's block of `per_rank` words) gathered
    /// from every rank through the staging buffers; returns `size x
    /// per_rank` words, in rank order.
    fn gather_words(
        &self,
        staging: &mut HostStaging,
        words: &[u64],
        per_rank: usize,
        call: HostCall,
    ) -> Result<Vec<u64>> {
        let what = format!("{call} on {}", self.group_name);
        let device_failed = |e: &dyn std::fmt::Display| device_error(&self.device(), &what, e);
        // An aborted communicator enqueues nothing (so no copy is left
        // behind in flight).
        self.check()?;
        if staging.pending {
            return Err(device_failed(
                &"an earlier host-side exchange never finished",
            ));
        }
        let total = per_rank
            .checked_mul(self.size + 1)
            .ok_or_else(|| device_failed(&"the exchange is too large"))?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| device_failed(&e))?;
        staging
            .reserve(&self.stream, total)
            .map_err(|e| device_failed(&e))?;
        let received = per_rank * self.size;
        let (send_ptr, recv_ptr) = (staging.device_ptr, staging.device_ptr + per_rank as u64 * 8);
        let cu_stream = self.stream.cu_stream();
        staging.pending = true;
        let enqueued = (|| {
            let host = staging.host.words();
            host[..per_rank].copy_from_slice(words);
            // SAFETY: `per_rank` words of pinned memory to the device send
            // area (both inside their buffers: `reserve` made room for
            // (size + 1) x per_rank). The host words stay untouched until
            // the exchange's wait returns.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(send_ptr, &host[..per_rank], cu_stream)
            }
            .map_err(|e| device_failed(&e))?;
            self.issue(&what, |api, raw, stream| {
                // SAFETY: send and receive areas are disjoint parts of one
                // device buffer of (size + 1) x per_rank words.
                unsafe {
                    (api.all_gather)(
                        send_ptr as *const c_void,
                        recv_ptr as *mut c_void,
                        per_rank,
                        sys::ncclDataType_t::ncclUint64,
                        raw,
                        stream,
                    )
                }
            })?;
            // SAFETY: the receive area back into the pinned buffer after
            // the send area; read only once the event below completes.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host[per_rank..per_rank + received],
                    recv_ptr,
                    cu_stream,
                )
            }
            .map_err(|e| device_failed(&e))
        })();
        // Marks where this exchange's copies end, also when a step failed
        // after one was queued: the pinned buffer is freed only after it.
        let recorded = staging.done.record(&self.stream);
        enqueued?;
        recorded.map_err(|e| device_failed(&e))?;
        StreamWait {
            rank: self.world_rank(),
            timeout: self.timeout,
            comms: &[self],
            signal: None,
        }
        .event(&staging.done, &what)?;
        staging.pending = false;
        Ok(staging.host.words()[per_rank..per_rank + received].to_vec())
    }

    // ---- split -----------------------------------------------------------------------
}

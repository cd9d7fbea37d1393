//! The [`Collective`] calls of a CPU rank: each one round of its group
//! (see the parent module), with sums in rank order.

use super::*;

impl Collective<CpuBackend> for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_gather(
        &self,
        shard: Slice<'_, CpuBackend>,
        full: SliceMut<'_, CpuBackend>,
    ) -> Result<()> {
        let n = self.members.len();
        let (_in_call, call) =
            self.begin(OpKind::AllGather, Some(shard.len()), Some(shard.dtype()))?;
        if full.len() != shard.len() * n || full.dtype() != shard.dtype() {
            return Err(self.reject(
                &call,
                format!(
                    "the output holds {} {} elements but {n} ranks x {} shard elements of {} = {}",
                    full.len(),
                    full.dtype(),
                    shard.len(),
                    shard.dtype(),
                    shard.len() * n
                ),
            ));
        }
        let k = KernelAccess::new("all_gather", "comm");
        let mine = k.bytes_in(shard)?.to_vec();
        let exchanged = self.exchange(&call, Payload::Bytes(mine), None)?;
        let full = k.bytes_out(full)?;
        let size = full.len() / n.max(1);
        if size > 0 {
            for (out, part) in full.chunks_exact_mut(size).zip(&exchanged.contributions) {
                out.copy_from_slice(bytes(part));
            }
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        full: Slice<'_, CpuBackend>,
        shard: SliceMut<'_, CpuBackend>,
    ) -> Result<()> {
        let n = self.members.len();
        let (_in_call, call) =
            self.begin(OpKind::ReduceScatter, Some(full.len()), Some(full.dtype()))?;
        if full.len() != shard.len() * n {
            return Err(self.reject(
                &call,
                format!(
                    "the input holds {} elements but {n} ranks x {} shard elements = {}",
                    full.len(),
                    shard.len(),
                    shard.len() * n
                ),
            ));
        }
        let k = KernelAccess::new("reduce_scatter", "comm");
        let mine = k
            .typed_in::<f32>("full", full)
            .map_err(|e| self.reject(&call, e.to_string()))?;
        let exchanged = self.exchange(&call, Payload::Floats(mine.to_vec()), None)?;
        let shard = k.typed_out::<f32>("shard", shard)?;
        let range = self.rank * shard.len()..(self.rank + 1) * shard.len();
        sum_in_rank_order(&exchanged.contributions, range, shard);
        Ok(())
    }

    fn all_reduce(&self, buf: SliceMut<'_, CpuBackend>) -> Result<()> {
        let n = self.members.len();
        let len = buf.len();
        let (_in_call, call) = self.begin(OpKind::AllReduce, Some(len), Some(buf.dtype()))?;
        let k = KernelAccess::new("all_reduce", "comm");
        let buf = k
            .typed_out::<f32>("buf", buf)
            .map_err(|e| self.reject(&call, e.to_string()))?;
        // Round 1: everyone deposits the whole buffer; rank r sums chunk r.
        // Round 2: everyone gathers the summed chunks. Each element is still
        // summed in rank order, by exactly one rank, so all ranks agree.
        let exchanged = self.exchange(&call, Payload::Floats(buf.to_vec()), None)?;
        let (start, end) = chunk(len, n, self.rank);
        let mut mine = vec![0.0f32; end - start];
        sum_in_rank_order(&exchanged.contributions, start..end, &mut mine);
        drop(exchanged);
        let gather = Call {
            kind: OpKind::AllReduceGather,
            phase: 1,
            ..call.clone()
        };
        let gathered = self.exchange(&gather, Payload::Floats(mine), None)?;
        for (r, part) in gathered.contributions.iter().enumerate() {
            let (start, end) = chunk(len, n, r);
            buf[start..end].copy_from_slice(floats(part));
        }
        Ok(())
    }

    fn all_to_all(
        &self,
        send: Slice<'_, CpuBackend>,
        send_counts: &[usize],
        recv: SliceMut<'_, CpuBackend>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let n = self.members.len();
        let (_in_call, call) = self.begin(OpKind::AllToAll, None, Some(send.dtype()))?;
        if send.dtype() != recv.dtype() {
            return Err(self.reject(
                &call,
                format!("send is {} but recv is {}", send.dtype(), recv.dtype()),
            ));
        }
        for (what, counts, buffer) in [
            ("send", send_counts, send.len()),
            ("recv", recv_counts, recv.len()),
        ] {
            if counts.len() != n {
                return Err(self.reject(
                    &call,
                    format!(
                        "{what}_counts has {} entries but the group has {n} ranks",
                        counts.len()
                    ),
                ));
            }
            let total: usize = counts.iter().sum();
            if total != buffer {
                return Err(self.reject(
                    &call,
                    format!(
                        "{what}_counts add up to {total} but the {what} buffer holds {buffer} \
                         elements"
                    ),
                ));
            }
        }
        let size = send.dtype().bytes();
        let k = KernelAccess::new("all_to_all", "comm");
        let payload = Payload::AllToAll {
            data: k.bytes_in(send)?.to_vec(),
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
        };
        let exchanged = self.exchange(&call, payload, None)?;
        self.check_all_to_all(&call, &exchanged.contributions)?;
        let recv = k.bytes_out(recv)?;
        let mut at = 0;
        for (i, sender) in exchanged.contributions.iter().enumerate() {
            if let Payload::AllToAll {
                data, send_counts, ..
            } = &**sender
            {
                let offset: usize = send_counts[..self.rank].iter().sum();
                let count = recv_counts[i];
                recv[at * size..(at + count) * size]
                    .copy_from_slice(&data[offset * size..(offset + count) * size]);
                at += count;
            }
        }
        Ok(())
    }

    fn all_to_all_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        let n = self.members.len();
        let (_in_call, call) = self.begin(OpKind::AllToAllCounts, None, None)?;
        if send.len() != n {
            return Err(self.reject(
                &call,
                format!(
                    "{} count vectors were given but the group has {n} ranks (one per \
                     destination)",
                    send.len()
                ),
            ));
        }
        let exchanged = self.exchange(&call, Payload::Counts(send.to_vec()), None)?;
        exchanged
            .contributions
            .iter()
            .map(|p| match &**p {
                Payload::Counts(counts) => Ok(counts[self.rank].clone()),
                _ => Err(self.internal(&call, "a rank deposited no counts")),
            })
            .collect()
    }

    fn all_gather_host(&self, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        let (_in_call, call) = self.begin(OpKind::AllGatherHost, None, None)?;
        let exchanged = self.exchange(&call, Payload::Host(values.to_vec()), None)?;
        exchanged
            .contributions
            .iter()
            .map(|p| match &**p {
                Payload::Host(values) => Ok(values.clone()),
                _ => Err(self.internal(&call, "a rank deposited no values")),
            })
            .collect()
    }

    fn barrier(&self) -> Result<()> {
        let (_in_call, call) = self.begin(OpKind::Barrier, None, None)?;
        self.exchange(&call, Payload::Empty, None).map(|_| ())
    }

    fn split(&self, color: usize) -> Result<CpuComm> {
        CpuComm::split(self, color)
    }

    fn send_recv(
        &self,
        send: Option<(Slice<'_, CpuBackend>, usize)>,
        recv: Option<(SliceMut<'_, CpuBackend>, usize)>,
    ) -> Result<()> {
        let half = |peer: usize, dtype: DType, len: usize| Half { peer, dtype, len };
        let (_in_call, p2p) = self.begin_p2p(
            send.as_ref().map(|(v, to)| half(*to, v.dtype(), v.len())),
            recv.as_ref()
                .map(|(v, from)| half(*from, v.dtype(), v.len())),
        )?;
        // Both views are registered before anything moves, so a receive
        // that aliases the send is refused rather than half done.
        let k = KernelAccess::new("send_recv", "comm");
        let outgoing = match send {
            Some((view, _)) => Some(
                k.bytes_in(view)
                    .map_err(|e| self.reject(&p2p, e.to_string()))?
                    .to_vec(),
            ),
            None => None,
        };
        let incoming = match recv {
            Some((view, _)) => Some(
                k.bytes_out(view)
                    .map_err(|e| self.reject(&p2p, e.to_string()))?,
            ),
            None => None,
        };
        if let (Some(bytes), Some(half)) = (outgoing, p2p.send) {
            self.post(&p2p, half, Contents::Bytes(bytes))?;
        }
        if let (Some(out), Some(half)) = (incoming, p2p.recv) {
            match self.collect(&p2p, half)? {
                Contents::Bytes(bytes) => out.copy_from_slice(&bytes),
                Contents::Parcel(_) => {
                    return Err(self.internal(&p2p, "a rank sent a parcel, not bytes"));
                }
            }
        }
        Ok(())
    }
}

/// `out[k] = ((c0[range][k] + c1[range][k]) + c2[range][k]) + ...`.
fn sum_in_rank_order(
    contributions: &[Arc<Payload>],
    range: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let mut parts = contributions.iter().map(|p| &floats(p)[range.clone()]);
    if let Some(first) = parts.next() {
        out.copy_from_slice(first);
    }
    for part in parts {
        for (o, x) in out.iter_mut().zip(part) {
            *o += *x;
        }
    }
}

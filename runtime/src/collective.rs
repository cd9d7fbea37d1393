//! Collectives (docs/architecture.md): all-gather, reduce-scatter,
//! all-reduce, variable-size all-to-all, barrier and split, each called from
//! the lane it runs on. CPU: ranks are threads of one process exchanging
//! through shared memory. CUDA: NCCL, one process (or one thread) per GPU.
//!
//! What every implementation promises is determinism: the same inputs and
//! sizes give the same bits on every run. The order in which ranks'
//! contributions are summed is the implementation's own (the CPU sums in
//! rank order, NCCL in the order its ring or tree gives), so two *different*
//! sequences of collectives over the same data, such as ZeRO-3's
//! reduce-scatters and `no_shard`'s all-reduces, agree bit for bit on the
//! CPU only; on GPUs they agree to a tolerance, and tests say so.
//!
//! Every rank of a group must call the same collectives in the same order;
//! an implementation detects a mismatch or a rank that stalls past its
//! timeout and fails with an error naming the rank, rather than hanging.
//!
//! Point-to-point ([`Collective::send_recv`]) is the exception: a pipeline
//! stage sends its activations to the next stage and its gradients back, so
//! only the two ranks of a transfer take part, and the other ranks of the
//! group go on with their own calls. Messages from one rank to another are
//! matched in the order they were sent; a call's send and receive progress
//! together, so neighbours that exchange in one call never wait on each
//! other. The CPU and the copy transport buffer a send (it returns before
//! the receive is posted) and check that the receiving view has the sent
//! dtype and length; NCCL moves the data once both halves are posted, and
//! sees no peer's arguments (as for all-to-all's counts), so there the
//! callers must pair them right.

use crate::backend::{Backend, Slice, SliceMut};
use crate::error::Result;
use std::time::Duration;

/// How long a rank waits for its peers to join a collective by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// One communicator: a group of ranks.
pub trait Collective<B: Backend>: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Every rank contributes `shard` (S elements of any dtype, the same on
    /// every rank); `full` (S x size elements of that dtype) receives all
    /// shards in rank order.
    fn all_gather(&self, shard: Slice<'_, B>, full: SliceMut<'_, B>) -> Result<()>;

    /// Every rank contributes `full` (S x size f32 elements: gradients are
    /// reduced in f32); they are summed element-wise, and rank r receives
    /// elements `[r*S, (r+1)*S)` of the sum in `shard`.
    fn reduce_scatter(&self, full: Slice<'_, B>, shard: SliceMut<'_, B>) -> Result<()>;

    /// Element-wise sum of f32 buffers; every rank gets the result.
    fn all_reduce(&self, buf: SliceMut<'_, B>) -> Result<()>;

    /// Variable-size all-to-all of one dtype. `send` is cut into `size` consecutive
    /// segments of `send_counts[j]` elements, segment j going to rank j.
    /// `recv` receives, in rank order, `recv_counts[i]` elements from rank i.
    /// Counts must agree pairwise (see [`Collective::all_to_all_counts`]).
    fn all_to_all(
        &self,
        send: Slice<'_, B>,
        send_counts: &[usize],
        recv: SliceMut<'_, B>,
        recv_counts: &[usize],
    ) -> Result<()>;

    /// Host-side all-to-all of small count vectors: `send[j]` goes to rank
    /// j; returns what each rank sent to this one, in rank order.
    fn all_to_all_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>>;

    /// Host-side all-gather of small f64 vectors (losses, norm partials):
    /// returns every rank's `values` in rank order.
    fn all_gather_host(&self, values: &[f64]) -> Result<Vec<Vec<f64>>>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Point-to-point, a pipeline's stage-to-stage transfer: sends `send`
    /// to rank `to` of this group and/or receives into `recv` from rank
    /// `from` (each optional; a call with neither is an error). Only the
    /// two ranks of a transfer take part; it is no round of the whole
    /// group. Messages from one rank to another are matched in the order
    /// they were sent. The receiving view must have the sent dtype and
    /// length: where the transport sees both (the CPU, the copy transport)
    /// a mismatch fails the receiver, and the sender at its next call on
    /// the group (or at once if it is waiting in one), with an error naming
    /// the two ranks, dtypes and lengths; NCCL cannot see the peer's
    /// arguments without a host round trip, so there a mismatch is the
    /// callers' error, shown as a stall that the timeout ends.
    ///
    /// The two halves of one call progress together (NCCL: one group), so
    /// two ranks that send to each other in the same call never wait on
    /// each other. A send may be done before its receive is posted (the CPU
    /// and the copy transport buffer it) or may not (NCCL enqueues it, and
    /// its stream waits there for the peer); callers pair their calls so
    /// that neither matters (each rank's schedule issues the partner halves
    /// in the same order). Sending to or receiving from oneself, or a rank
    /// outside the group, is an error. A peer that never posts the matching
    /// half makes the call fail after the group's timeout, naming the peer
    /// (NCCL: the bounded wait on the stream that holds the transfer).
    fn send_recv(
        &self,
        send: Option<(Slice<'_, B>, usize)>,
        recv: Option<(SliceMut<'_, B>, usize)>,
    ) -> Result<()>;

    /// A pipeline rank's stage-to-stage exchange: every send of `sends`
    /// and every receive of `recvs` (views with the peer's rank in this
    /// group) as one step, so that neighbours exchanging in both
    /// directions at once never wait on each other. The default posts the
    /// sends first, then the receives, for transports whose sends do not
    /// wait for their receive (the CPU, the copy transport); NCCL issues
    /// them all as one group.
    fn exchange(
        &self,
        sends: Vec<(Slice<'_, B>, usize)>,
        recvs: Vec<(SliceMut<'_, B>, usize)>,
    ) -> Result<()> {
        for send in sends {
            self.send_recv(Some(send), None)?;
        }
        for recv in recvs {
            self.send_recv(None, Some(recv))?;
        }
        Ok(())
    }

    /// Collective: every rank of the group calls it; ranks that pass the
    /// same `color` form a new group, ordered by their rank in this group
    /// (NCCL: `ncclCommSplit`). `split(0)` everywhere duplicates the group,
    /// which gives another lane a communicator of its own.
    fn split(&self, color: usize) -> Result<Self>
    where
        Self: Sized;
}

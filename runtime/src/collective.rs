//! Collectives (shared/spec/runtime.md): all-gather, reduce-scatter,
//! all-reduce, variable-size all-to-all and barrier, each called from the
//! lane it runs on. CPU: ranks are threads of one process exchanging through
//! shared memory with a fixed reduction order (sums in rank order 0..size),
//! so results are deterministic. CUDA: NCCL, one process per GPU.
//!
//! Every rank of a group must call the same collectives in the same order;
//! an implementation detects a mismatch or a rank that stalls past its
//! timeout and fails with an error naming the rank, rather than hanging.

use crate::backend::Backend;
use crate::error::Result;

/// One communicator: a group of ranks.
pub trait Collective<B: Backend>: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Every rank contributes `shard` (S elements); `full` (S x size
    /// elements) receives all shards in rank order.
    fn all_gather(&self, shard: B::Slice<'_>, full: B::SliceMut<'_>) -> Result<()>;

    /// Every rank contributes `full` (S x size elements); they are summed
    /// element-wise in rank order 0..size, and rank r receives elements
    /// `[r*S, (r+1)*S)` of the sum in `shard`.
    fn reduce_scatter(&self, full: B::Slice<'_>, shard: B::SliceMut<'_>) -> Result<()>;

    /// Element-wise sum in rank order 0..size; every rank gets the result.
    fn all_reduce(&self, buf: B::SliceMut<'_>) -> Result<()>;

    /// Variable-size all-to-all. `send` is cut into `size` consecutive
    /// segments of `send_counts[j]` elements, segment j going to rank j.
    /// `recv` receives, in rank order, `recv_counts[i]` elements from rank i.
    /// Counts must agree pairwise (see [`Collective::all_to_all_counts`]).
    fn all_to_all(
        &self,
        send: B::Slice<'_>,
        send_counts: &[usize],
        recv: B::SliceMut<'_>,
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
}

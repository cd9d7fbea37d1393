//! The `Backend` trait: device memory and the kernels layers need
//! (shared/spec/runtime.md). Layers, the FSDP engine and the optimizer are
//! written once against it; the CPU backend (f32, deterministic loops) is the
//! reference the CUDA backend (bf16 storage, f32 accumulation, cuBLAS, NVRTC)
//! is checked against.
//!
//! Kernels run on the lane whose worker thread calls them (CUDA: the stream
//! bound to that lane's host thread). Every kernel is deterministic: the same
//! inputs give the same bits, whatever else runs.

use crate::error::Result;
use std::ops::Range;

/// How a buffer stores its elements. The CPU keeps everything in f32; the
/// CUDA backend keeps `Compute` buffers (parameters, activations) in bf16 and
/// `F32` buffers (master weights, gradient shards, optimizer moments) in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    Compute,
    F32,
}

/// Device memory and kernels.
pub trait Backend: Send + Sync + 'static {
    /// One device allocation: a flat array of elements.
    type Buf: Send + Sync + 'static;
    /// A read-only view of part of a buffer (`&[f32]` on the CPU).
    type Slice<'a>: Copy + Send
    where
        Self: 'a;
    /// A writable view of part of a buffer (`&mut [f32]` on the CPU).
    type SliceMut<'a>: Send
    where
        Self: 'a;

    /// A short name (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    // ---- memory -----------------------------------------------------------

    /// A zero-filled buffer of `len` elements.
    fn alloc(&self, len: usize, precision: Precision) -> Result<Self::Buf>;
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// `buf[range]`; an error (not a panic) when the range is out of bounds.
    fn slice<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Result<Self::Slice<'a>>;
    fn slice_mut<'a>(
        &self,
        buf: &'a mut Self::Buf,
        range: Range<usize>,
    ) -> Result<Self::SliceMut<'a>>;
    /// Splits a writable view in two at `mid`, as `split_at_mut` does.
    fn split_mut<'a>(
        &self,
        slice: Self::SliceMut<'a>,
        mid: usize,
    ) -> Result<(Self::SliceMut<'a>, Self::SliceMut<'a>)>
    where
        Self: 'a;
    /// Reborrows a writable view as a read-only one.
    fn as_slice<'a, 'b>(&self, slice: &'b Self::SliceMut<'a>) -> Self::Slice<'b>
    where
        'a: 'b;
    fn slice_len(&self, slice: Self::Slice<'_>) -> usize;
    fn upload(&self, src: &[f32], dst: Self::SliceMut<'_>) -> Result<()>;
    fn download(&self, src: Self::Slice<'_>, dst: &mut [f32]) -> Result<()>;
    fn copy(&self, src: Self::Slice<'_>, dst: Self::SliceMut<'_>) -> Result<()>;
    fn fill(&self, dst: Self::SliceMut<'_>, value: f32) -> Result<()>;

    // ---- kernels ----------------------------------------------------------
    // The kernel set is owned by the layers (see layers/); each kernel is
    // documented where it is declared, with the maths it computes.
}

//! GPU device memory: a buffer is a region of one of the GPU's arenas
//! (`cuda::arena`), with a dtype and a length, and the set of streams
//! that used it (so that dropping it fences the region on exactly those);
//! and a view of device memory as kernels and cuBLAS take it
//! ([`GpuView`]).

use super::arena::{GpuArena, Region};
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// A view of device memory as a kernel takes it: a device address, a
/// length and a dtype (what a backend view becomes on a GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuView {
    /// The device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
    pub dtype: DType,
}

impl GpuView {
    pub fn new(ptr: u64, len: usize, dtype: DType) -> Self {
        GpuView { ptr, len, dtype }
    }

    /// Its length and dtype, as a kernel's check takes them.
    pub fn operand(&self) -> Operand {
        Operand::new(self.len, self.dtype)
    }
}

/// One GPU allocation.
pub struct CudaBuf {
    dtype: DType,
    len: usize,
    region: Region,
    arena: Arc<GpuArena>,
    /// Bit `i` set: stream `i` of the GPU's queue set used this buffer.
    users: AtomicU32,
}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaBuf({} x {} at {:#x})",
            self.len, self.dtype, self.region.ptr
        )
    }
}

impl DeviceBuffer for CudaBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        self.dtype
    }
}

impl CudaBuf {
    pub(crate) fn new(
        arena: Arc<GpuArena>,
        region: Region,
        len: usize,
        dtype: DType,
        user: usize,
    ) -> Self {
        CudaBuf {
            dtype,
            len,
            region,
            arena,
            users: AtomicU32::new(1 << user),
        }
    }

    /// The device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.region.ptr
    }

    /// Notes that stream `index` uses this buffer.
    pub(crate) fn used_by(&self, index: usize) {
        let bit = 1 << index;
        if self.users.load(Ordering::Relaxed) & bit == 0 {
            self.users.fetch_or(bit, Ordering::Relaxed);
        }
    }
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        self.arena
            .give(&self.region, self.users.load(Ordering::Acquire));
    }
}

/// A read-only view as kernels take it, noting the stream that uses it.
pub(crate) fn view_on(view: View<'_, CudaBuf>, stream: usize) -> GpuView {
    let buf = view.buffer();
    buf.used_by(stream);
    let offset = (view.range().start * view.dtype().bytes()) as u64;
    GpuView::new(buf.device_ptr() + offset, view.len(), view.dtype())
}

/// A writable view as kernels take it, noting the stream that uses it.
pub(crate) fn view_mut_on(view: &ViewMut<'_, CudaBuf>, stream: usize) -> GpuView {
    view_on(view.as_view(), stream)
}

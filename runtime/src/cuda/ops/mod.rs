//! The CUDA backend's kernels, one module a kernel family (mirroring
//! `crate::backend`'s): each implements its family's trait for
//! [`CudaBackend`](crate::cuda::CudaBackend) and holds the launchers of
//! its kernels on [`KernelSet`](crate::cuda::KernelSet). A launcher takes
//! [`GpuView`](crate::cuda::GpuView)s the family's checks accepted, checks
//! what only a GPU limits (grid sizes, alignment, what fits a block), sizes
//! the grid from the dimensions alone (so a reduction's shape, and with it
//! its bits, depends on nothing else) and enqueues the kernel.

pub mod dense;
pub mod layout;
pub mod norm;

//! The CUDA device: what the CUDA backend is built from. Compiled on every
//! machine; CUDA, NVRTC, cuBLAS and NCCL are loaded at run time (cudarc's
//! dynamic loading), so a binary built without CUDA runs on a machine with
//! it, and on a machine without it every entry point here returns an error
//! saying what is missing instead of panicking.
//!
//! - [`probe`](mod@probe): is there a usable GPU (driver, device, compute capability,
//!   free memory, NVRTC)?
//! - [`kernels`]: the CUDA C sources (`kernels/*.cu`), compiled with NVRTC
//!   for the device's architecture at start-up.
//! - [`kernel_cache`]: the compiled kernels kept once per process and on
//!   disk (`$HYBRIDGEN_KERNEL_CACHE`), so NVRTC runs once, not at every
//!   start-up.
//! - [`launch`]: the compiled kernels loaded on a device ([`KernelSet`]),
//!   and what every launcher shares; [`fault`]: the bad indices kernels
//!   report from the device.
//! - [`ops`]: the kernels, one module a kernel family of
//!   [`Backend`](crate::Backend): the family's trait for [`CudaBackend`]
//!   and its launchers on [`KernelSet`].
//! - [`nccl`]: the communicator between GPU ranks (NCCL, non-blocking,
//!   every wait bounded).
//! - [`peer_copy`]: the copy transport between the ranks of one process
//!   (copy engines; ranks may share a GPU).

mod arena;
pub mod backend;
mod blas;
mod blas_lt;
pub mod buffer;
pub mod comm;
pub mod fault;
pub mod host_read;
pub mod kernel_cache;
pub mod kernels;
pub mod lane;
pub mod launch;
pub mod nccl;
pub mod ops;
pub mod peer_copy;
pub mod platform;
pub mod probe;
pub mod queue;

pub use backend::{CudaBackend, Gpu};
pub use buffer::CudaBuf;
pub use buffer::GpuView;
pub use comm::CudaComm;
pub use fault::DeviceFault;
pub use host_read::{HostRead, StagedRead};
pub use kernels::{Diagnostic, KernelBuildError, KernelSource, Target};
pub use lane::{CudaEvent, CudaLane, CudaMark, CudaQueue};
pub use launch::KernelSet;
pub use nccl::{AbortSignal, NcclComm, NcclUniqueId, StreamWait};
pub use platform::{Cuda, CudaPlatform};
pub use probe::{CudaUnavailable, GpuDevice, GpuInfo, probe};

/// Runs `f`, turning a panic inside cudarc (it panics when a library or a
/// symbol it needs is missing) into `Err` with the panic's message.
pub(crate) fn catch_cudarc_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "cudarc panicked".to_string())
    })
}

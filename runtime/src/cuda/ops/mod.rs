//! The CUDA backend's kernels, one module a kernel family (mirroring
//! `crate::backend`'s): each implements its family's trait for
//! [`CudaBackend`](crate::cuda::CudaBackend) and holds the launchers of
//! its kernels on [`KernelSet`]. A launcher takes
//! [`GpuView`](crate::cuda::GpuView)s the family's checks accepted, checks
//! what only a GPU limits (grid sizes, alignment, what fits a block), sizes
//! the grid from the dimensions alone (so a reduction's shape, and with it
//! its bits, depends on nothing else) and enqueues the kernel.

pub mod attention;
pub mod attention_flash;
pub mod conv;
pub mod delta;
pub mod dense;
pub mod grouped_gemm;
pub mod layout;
pub mod lookup;
pub mod memory;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod scan;
pub mod scan_chunked;
pub mod sparse_attention;

use crate::cuda::kernel_cache;
use crate::cuda::kernels::{self, CompiledSource, Target};
use crate::cuda::launch::{KernelSet, Reserved, load_modules, setup_error};
use crate::error::Result;
use cudarc::driver::CudaContext;
use std::sync::Arc;

impl KernelSet {
    /// Compiles every source for `context`'s device (once per process,
    /// through the on-disk kernel cache) and loads it.
    pub fn new(context: &Arc<CudaContext>) -> Result<KernelSet> {
        let (major, minor) = context.compute_capability().map_err(setup_error)?;
        let target = Target::for_device(major, minor);
        let include = kernels::include_dir().map_err(setup_error)?;
        let compiled = kernel_cache::compile_all_once(target, &include).map_err(setup_error)?;
        KernelSet::load(context, &compiled.sources)
    }

    /// Loads sources compiled for `context`'s device, and gives the kernel
    /// families that ask for more shared memory than a block has by default
    /// what they ask for.
    pub fn load(context: &Arc<CudaContext>, compiled: &[CompiledSource]) -> Result<KernelSet> {
        let loaded = load_modules(context, compiled)?;
        let (functions, target) = (&loaded.functions, loaded.target);
        let reserved = Reserved {
            flash_attention: attention_flash::reserve_shared_memory(functions, target),
            scan_mma_sums: scan_chunked::reserve_shared_memory(functions),
            grouped_gemm_grid: grouped_gemm::reserve_shared_memory(context, functions, target),
            sparse_attention: sparse_attention::reserve_shared_memory(functions, target),
            delta: delta::reserve_shared_memory(context, functions),
        };
        KernelSet::assemble(context, loaded, reserved)
    }
}

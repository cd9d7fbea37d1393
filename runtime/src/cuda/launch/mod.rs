//! The compiled kernels loaded on one device ([`KernelSet`]): loading the
//! modules and finding their entry points, the device's fault word, and
//! what every launcher shares (the argument list, the launch itself, the
//! grid shapes, dtype tags and launch limits). The launchers themselves
//! are in `crate::cuda::ops`, one module a kernel family; they take
//! [`GpuView`]s the family's checks accepted and size the grid from the
//! dimensions alone (so a reduction's shape, and with it its bits, depends
//! on nothing else). Nothing here waits for the GPU except
//! [`KernelSet::take_fault`] and `KernelSet::clear_fault`.
//!
//! Index data (token targets, selected experts, row indices) lives on the
//! device, so it is checked there: a kernel that finds a bad index reports
//! it into the set's fault word and skips it; [`KernelSet::take_fault`]
//! reads the word (at the end of a step, where the host reads the loss
//! anyway) and says which index of which kind was bad
//! ([`DeviceFault`]).

pub(crate) mod args;
pub(crate) mod tensor_map;

use super::kernels::{self, CompiledSource, Output, Target};
use super::ops::delta::DeltaShared;
use super::ops::sparse_attention::SparseAttentionShared;
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use args::KernelArgs;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The most scratch (scores in f32 plus probabilities, 8 bytes an entry in
/// f32 and in bf16) one batched call of attention's GEMM path takes by
/// default. It bounds how many KV heads a call batches; a sequence whose
/// one KV head alone does not fit (past about 9,400 tokens in bf16) takes
/// the tiled kernels instead. The GPU's fixed memory overhead in the memory
/// plan covers it.
pub const ATTENTION_GEMM_SCRATCH_BYTES: usize = 512 << 20;

/// The most scratch a chunked Mamba scan call takes by default (1.25 GiB):
/// a sequence of 4,096 tokens of the benchmark model's Mamba (64 heads of
/// 64 x 128 states, 16 chunks of 256: 1.08 GiB) in one slice. The memory
/// plan counts it.
pub const SCAN_CHUNKED_SCRATCH_BYTES: usize = 5 << 28;

/// A CUDA grid's limits along x and along y.
pub(crate) const MAX_GRID_X: usize = i32::MAX as usize;
pub(crate) const MAX_GRID_Y: usize = 65_535;
/// Where the `wgmma` kernels' swizzled tiles start: their dynamic shared
/// memory's first 1024-byte boundary (`aligned_shared` in wgmma.cuh), so
/// each asks for this much more than its tiles.
pub(crate) const WGMMA_SHARED_ALIGN: usize = 1024;
/// The shared memory a Hopper block may have, static included.
pub(crate) const HOPPER_SHARED_BYTES: usize = 227 * 1024;

pub use super::buffer::GpuView;
pub use super::fault::DeviceFault;
pub(crate) use crate::view::{as_u32, ensure, product};

/// The dtype tag a kernel reads (`DTYPE_*` in `common.cuh`).
pub(crate) fn dtype_tag(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F64 => 2,
        // No kernel takes a u32 view through a tag; the dtype checks refuse
        // one before it gets here.
        DType::U32 => -1,
    }
}

/// Threads of the element-wise kernels' blocks.
const BLOCK: u32 = 256;
/// Most blocks of a grid-stride launch (enough to fill any current GPU).
const MAX_BLOCKS: u64 = 8192;
/// The most shares one `sum_shares` launch adds (`MAX_SHARES` of reduce.cu).
pub(crate) const MAX_SHARES: usize = 16;

pub(crate) fn grid_for(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether kernels with a `vec8` path can move these views 8 bf16 channels
/// (16 bytes) at a time: all bf16 and 16-byte aligned, in rows (or groups)
/// of `row` elements, a multiple of 8.
pub(crate) fn bf16_words(views: &[GpuView], row: usize) -> bool {
    row.is_multiple_of(8)
        && views
            .iter()
            .all(|v| v.dtype == DType::Bf16 && v.ptr.is_multiple_of(16))
}

/// Whether kernels whose `vec8` path takes bf16 and f32 alike (through
/// `common.cuh`'s `Bf16Words8`, `F32Words8`, `AnyWords8`) can move these
/// views 8 channels at a time: each bf16 or f32 (one or two 16-byte
/// words) and 16-byte aligned, in rows of `row` elements, a multiple of 8.
pub(crate) fn words8(views: &[GpuView], row: usize) -> bool {
    row.is_multiple_of(8)
        && views
            .iter()
            .all(|v| matches!(v.dtype, DType::Bf16 | DType::F32) && v.ptr.is_multiple_of(16))
}

/// A block of `threads` (a multiple of 32, at most 1024) per item.
pub(crate) fn per_item(items: usize, threads: u32) -> Result<LaunchConfig> {
    let blocks = u32::try_from(items)
        .ok()
        .filter(|&b| b < i32::MAX as u32)
        .ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("{items} blocks exceed a CUDA grid"))
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Threads for a block that reduces `n` values: the power of two at least
/// `n`, between 32 and `max`. A function of the size alone, so the
/// reduction tree is too.
pub(crate) fn reduce_threads(n: usize, max: u32) -> u32 {
    (n.max(32).next_power_of_two() as u64).min(u64::from(max)) as u32
}

/// The column-sum shape: 32 columns by 32 row slices a block.
pub(crate) fn column_blocks(cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(32).max(1) as u32, 1, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of 256 threads per row (rows past the grid's cap take turns).
pub(crate) fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u64).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per item, 8 warps a block.
pub(crate) fn warp_per_item(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(8).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Everything [`KernelSet::new`] can fail with, as one message.
pub(crate) fn setup_error(what: impl fmt::Display) -> RuntimeError {
    RuntimeError::Unsupported(format!("the CUDA kernels could not be set up: {what}"))
}

/// The compiled sources loaded on one device: the modules (kept alive for
/// their functions) and every kernel entry point by name.
pub(crate) struct LoadedModules {
    pub(crate) target: Target,
    pub(crate) modules: Vec<Arc<CudaModule>>,
    pub(crate) functions: HashMap<&'static str, CudaFunction>,
}

/// Loads sources compiled for `context`'s device and finds every entry
/// point [`kernels::SOURCES`] lists.
pub(crate) fn load_modules(
    context: &Arc<CudaContext>,
    compiled: &[CompiledSource],
) -> Result<LoadedModules> {
    let mut modules = Vec::with_capacity(compiled.len());
    let mut functions = HashMap::new();
    let mut target = Target::PORTABLE;
    for unit in compiled {
        target = unit.target;
        let image = match unit.target.output {
            Output::Cubin => cudarc::nvrtc::Ptx::from_binary(unit.image.clone()),
            Output::Ptx => {
                cudarc::nvrtc::Ptx::from_src(String::from_utf8_lossy(&unit.image).into_owned())
            }
        };
        let module = context
            .load_module(image)
            .map_err(|e| setup_error(format!("loading {} for {}: {e}", unit.file, unit.target)))?;
        let source = kernels::SOURCES
            .iter()
            .find(|s| s.file == unit.file)
            .ok_or_else(|| setup_error(format!("{} is not a kernel source", unit.file)))?;
        for &entry in source.entry_points {
            let function = module
                .load_function(entry)
                .map_err(|e| setup_error(format!("{}: kernel `{entry}`: {e}", unit.file)))?;
            functions.insert(entry, function);
        }
        modules.push(module);
    }
    Ok(LoadedModules {
        target,
        modules,
        functions,
    })
}

/// Lets `f` take `bytes` of dynamic shared memory (past the 48 KiB a launch
/// gets without asking): false where the device cannot give it (or the
/// amount is past what an attribute holds), and the family's other path
/// runs.
pub(crate) fn reserve_dynamic_shared(f: &CudaFunction, bytes: usize) -> bool {
    i32::try_from(bytes).is_ok_and(|bytes| {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes,
        )
        .is_ok()
    })
}

/// What the kernel families set up on the loaded functions: the dynamic
/// shared memory their largest kernels ask for, where the device gave it.
pub(crate) struct Reserved {
    /// Whether the flash attention kernels got their shared memory.
    pub(crate) flash_attention: bool,
    /// Whether the Mamba scan's tensor-core backward scores have theirs.
    pub(crate) scan_mma_sums: bool,
    /// The grouped GEMM kernels' persistent grid (a block an SM), where
    /// they got theirs (Hopper).
    pub(crate) grouped_gemm_grid: Option<u32>,
    /// Which of the sparse attention's tensor-core kernels got theirs.
    pub(crate) sparse_attention: SparseAttentionShared,
    /// What the gated delta rule's tensor-core kernels were granted.
    pub(crate) delta: DeltaShared,
}

/// The kernels of [`kernels::SOURCES`] loaded on one device, and the
/// device's fault word.
pub struct KernelSet {
    pub(crate) context: Arc<CudaContext>,
    pub(crate) target: Target,
    /// Kept alive for the functions.
    _modules: Vec<Arc<CudaModule>>,
    pub(crate) functions: HashMap<&'static str, CudaFunction>,
    /// Whether the flash attention kernels got their shared memory.
    pub(crate) flash_attention: bool,
    /// Whether the Mamba scan's tensor-core backward scores have their
    /// shared memory ([`scan_chunked::reserve_shared_memory`]).
    pub(crate) scan_mma_sums: bool,
    /// The grouped GEMM kernels' persistent grid (a block an SM), where
    /// they got their shared memory (Hopper).
    pub(crate) grouped_gemm_grid: Option<u32>,
    /// Which of the sparse attention's tensor-core kernels got their
    /// shared memory (`ops::sparse_attention::reserve_shared_memory`).
    pub(crate) sparse_attention_shared: SparseAttentionShared,
    /// The shared memory the delta rule's tensor-core kernels were granted
    /// (`ops::delta::reserve_shared_memory`).
    pub(crate) delta_shared: DeltaShared,
    /// Whether launches carry programmatic stream serialisation
    /// ([`args`]): on by default where the device has it (sm_90).
    dependent_launch: AtomicBool,
    fault: cudarc::driver::CudaSlice<u64>,
    pub(crate) fault_ptr: u64,
}

impl fmt::Debug for KernelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelSet")
            .field("device", &self.context.ordinal())
            .field("target", &self.target)
            .field("kernels", &self.functions.len())
            .finish()
    }
}

impl KernelSet {
    /// The set of `loaded`'s functions with what the families `reserved`,
    /// and a fault word of its own.
    pub(crate) fn assemble(
        context: &Arc<CudaContext>,
        loaded: LoadedModules,
        reserved: Reserved,
    ) -> Result<KernelSet> {
        let stream = context.default_stream();
        let fault = stream
            .clone_htod(&[DeviceFault::NONE])
            .map_err(|e| setup_error(format!("allocating the fault word: {e}")))?;
        let fault_ptr = {
            use cudarc::driver::DevicePtr;
            let (ptr, _sync) = fault.device_ptr(&stream);
            ptr
        };
        stream.synchronize().map_err(setup_error)?;
        let target = loaded.target;
        Ok(KernelSet {
            context: context.clone(),
            target,
            _modules: loaded.modules,
            functions: loaded.functions,
            flash_attention: reserved.flash_attention,
            scan_mma_sums: reserved.scan_mma_sums,
            grouped_gemm_grid: reserved.grouped_gemm_grid,
            sparse_attention_shared: reserved.sparse_attention,
            delta_shared: reserved.delta,
            dependent_launch: AtomicBool::new(target.dependent_launch()),
            fault,
            fault_ptr,
        })
    }

    /// The architecture the kernels were compiled for.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Turns programmatic dependent launch on (where the target has it) or
    /// off for every launch after this call. Off, each kernel starts
    /// after the one before has finished, as without PDL; the kernels and
    /// their bits are the same either way.
    pub fn set_dependent_launch(&self, on: bool) {
        let on = on && self.target.dependent_launch();
        self.dependent_launch.store(on, Ordering::Relaxed);
    }

    /// Whether launches carry programmatic dependent launch.
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch.load(Ordering::Relaxed)
    }

    /// Waits for `stream`, then returns (and clears) the first bad index any
    /// kernel reported since the last call.
    pub fn take_fault(&self, stream: &Arc<CudaStream>) -> Result<Option<DeviceFault>> {
        let word = stream
            .clone_dtoh(&self.fault)
            .map_err(|e| self.device_error("reading the fault word", e))?;
        let fault = DeviceFault::decode(word.first().copied().unwrap_or(DeviceFault::NONE));
        if fault.is_some() {
            self.clear_fault(stream)?;
        }
        Ok(fault)
    }

    /// The fault word's device address (a host read copies it with its
    /// data: [`crate::cuda::host_read`]).
    pub(crate) fn fault_word(&self) -> u64 {
        self.fault_ptr
    }

    /// Resets the fault word, on `stream`, once it has been reported.
    pub(crate) fn clear_fault(&self, stream: &Arc<CudaStream>) -> Result<()> {
        // SAFETY: the fault word is one live u64 of this context.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                self.fault_ptr,
                &[DeviceFault::NONE],
                stream.cu_stream(),
            )
        }
        .map_err(|e| self.device_error("clearing the fault word", e))?;
        stream
            .synchronize()
            .map_err(|e| self.device_error("clearing the fault word", e))
    }

    pub(crate) fn device_error(&self, what: &str, e: impl fmt::Display) -> RuntimeError {
        RuntimeError::Lane {
            lane: format!("cuda:{}", self.context.ordinal()),
            message: format!("{what}: {e}"),
        }
    }

    pub(crate) fn function(&self, name: &'static str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| setup_error(format!("kernel `{name}` was not loaded")))
    }

    /// Enqueues `memset(0)` of `bytes` bytes at `ptr`.
    pub(crate) fn zero_bytes(&self, stream: &CudaStream, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's view covers `bytes` bytes at `ptr`.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }
            .map_err(|e| self.device_error("memset", e))
    }

    // ---- normalisation and activations -----------------------------------------

    // ---- rotary, head splits --------------------------------------------------------

    // ---- loss -------------------------------------------------------------------------

    // ---- mixture of experts ---------------------------------------------------------

    // ---- optimizer ----------------------------------------------------------------

    /// Launches a built argument list.
    pub(crate) fn go(
        &self,
        kernel: &str,
        args: &mut KernelArgs<'_>,
        config: LaunchConfig,
    ) -> Result<()> {
        // SAFETY: every argument was pushed in the order and with the types
        // of the kernel's C signature (one launch method per kernel, next to
        // its checks), and every pointer is a view whose length the method
        // checked against the dimensions the kernel indexes with.
        unsafe { args.launch(config, self.dependent_launch()) }
            .map_err(|e| self.device_error(&format!("launching `{kernel}`"), e))
    }
}

/// The kernel source `file`, after asserting that it says `#define NAME
/// value` (an unsigned suffix allowed) for each of `defines`: how a
/// launcher's tests hold its sizes to the kernels'.
#[cfg(test)]
pub(crate) fn source_with_defines(
    file: &str,
    defines: &[(&str, usize)],
) -> &'static crate::cuda::kernels::KernelSource {
    let source = crate::cuda::kernels::SOURCES
        .iter()
        .find(|s| s.file == file)
        .unwrap_or_else(|| panic!("{file} is listed"));
    assert_defines(file, source.text, defines);
    source
}

/// [`source_with_defines`] for a header the sources include.
#[cfg(test)]
pub(crate) fn header_with_defines(file: &str, defines: &[(&str, usize)]) {
    let (_, text) = crate::cuda::kernels::HEADERS
        .iter()
        .find(|(name, _)| *name == file)
        .unwrap_or_else(|| panic!("{file} is listed"));
    assert_defines(file, text, defines);
}

#[cfg(test)]
fn assert_defines(file: &str, text: &str, defines: &[(&str, usize)]) {
    for (define, value) in defines {
        let line = format!("#define {define} {value}");
        let found = text
            .lines()
            .any(|l| l.trim_end().trim_end_matches('u') == line);
        assert!(found, "{file} should say `{line}`");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sum_shares` takes as many share addresses as reduce.cu's struct
    /// holds.
    #[test]
    fn the_sum_of_shares_takes_the_kernels_count() {
        source_with_defines("reduce.cu", &[("MAX_SHARES", MAX_SHARES)]);
    }
}

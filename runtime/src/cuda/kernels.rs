//! The CUDA C kernels and their compilation with NVRTC.
//!
//! Each `kernels/*.cu` file holds one concept (casts, norms, routing, ...)
//! and is embedded in the binary; [`compile`] turns one into a module image
//! for a [`Target`] at start-up ([`crate::cuda::kernel_cache`] keeps the
//! images, so that this happens once, not at every start-up). NVRTC is a compiler library, not a GPU
//! API, so this works on a machine without a GPU: the
//! `cuda_kernels_compile` test compiles every source for both targets and
//! fails on any error or warning. Errors come back as [`Diagnostic`]s with
//! the file and line NVRTC reported.
//!
//! Every source is compiled without FMA contraction (`--fmad=false`): these
//! kernels are memory-bound, so contraction buys nothing, and without it
//! their arithmetic rounds exactly as the CPU reference's does.

use std::ffi::{CStr, CString, c_char};
use std::fmt;
use std::path::{Path, PathBuf};

/// One kernel source file and the entry points (`extern "C"` kernels) it
/// defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// The file name under `runtime/src/cuda/kernels/` (what diagnostics name).
    pub file: &'static str,
    pub text: &'static str,
    pub entry_points: &'static [&'static str],
}

/// The headers sources include (`common.cuh` every one, `wgmma.cuh` those
/// that stage tiles in shared memory, `delta.cuh` the two of the gated delta
/// rule), handed to NVRTC from memory so that
/// a diagnostic inside one names it and its own line.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("wgmma.cuh", include_str!("kernels/wgmma.cuh")),
    ("delta.cuh", include_str!("kernels/delta.cuh")),
];

macro_rules! source {
    ($file:literal, [$($entry:literal),+ $(,)?]) => {
        KernelSource {
            file: $file,
            text: include_str!(concat!("kernels/", $file)),
            entry_points: &[$($entry),+],
        }
    };
}

/// Every kernel source, in the order [`crate::cuda::KernelSet`] loads them.
pub const SOURCES: &[KernelSource] = &[
    source!("cast.cu", ["cast", "fill"]),
    source!("elementwise.cu", ["axpy", "scale"]),
    source!(
        "activation.cu",
        [
            "unary_forward",
            "unary_backward",
            "silu_mul_forward",
            "silu_mul_backward"
        ]
    ),
    source!(
        "reduce.cu",
        [
            "accumulate_sum",
            "column_sum",
            "sum_squares_tiles",
            "sum_squares_pieces",
            "sum_shares"
        ]
    ),
    source!(
        "rmsnorm.cu",
        [
            "rmsnorm_forward",
            "rmsnorm_forward_warps",
            "rmsnorm_backward_input",
            "rmsnorm_backward",
            "rmsnorm_weight_partials",
            "rmsnorm_weight_partials_vec8"
        ]
    ),
    source!(
        "cross_entropy.cu",
        [
            "cross_entropy_forward",
            "cross_entropy_backward",
            "cross_entropy_gradient",
            "cross_entropy_loss"
        ]
    ),
    source!("rotary.cu", ["rotary"]),
    source!(
        "layout.cu",
        [
            "copy_cols",
            "qkv_split",
            "qkv_join",
            "mla_kv_split",
            "mla_kv_join"
        ]
    ),
    source!(
        "routing.cu",
        [
            "moe_route_forward",
            "moe_prob_sum",
            "moe_route_backward",
            "moe_aux_loss_forward",
            "moe_aux_loss_backward"
        ]
    ),
    source!(
        "dispatch.cu",
        [
            "moe_expert_counts",
            "moe_sort_by_expert",
            "moe_expert_major_order",
            "moe_load_accumulate"
        ]
    ),
    source!(
        "permute.cu",
        [
            "gather_rows",
            "scatter_rows",
            "moe_unpermute",
            "moe_unpermute_backward_rows",
            "moe_unpermute_backward_weights"
        ]
    ),
    source!("optimizer.cu", ["adam_update", "sgd_update"]),
    source!(
        "attention.cu",
        [
            "attention_forward",
            "attention_backward_dq",
            "attention_backward_dkdv"
        ]
    ),
    source!(
        "attention_rows.cu",
        ["attention_probs", "attention_scores_grad"]
    ),
    source!(
        "attention_flash.cu",
        [
            "flash_forward_d64",
            "flash_backward_dq_d64",
            "flash_backward_dkdv_d64",
            "flash_forward_d128",
            "flash_backward_dq_d128",
            "flash_backward_dkdv_d128",
            "flash_forward_wgmma_d128",
            "flash_backward_dq_wgmma_d128",
            "flash_backward_dkdv_wgmma_d128",
            "flash_group_sum"
        ]
    ),
    source!(
        "lookup.cu",
        [
            "embedding_forward",
            "embedding_backward_order",
            "embedding_backward"
        ]
    ),
    source!(
        "grouped_gemm.cu",
        [
            "grouped_gemm_wgmma_nn",
            "grouped_gemm_wgmma_nt",
            "grouped_gemm_wgmma_tn",
            "grouped_gemm_wgmma_tt",
            "grouped_gemm_rows_nn",
            "grouped_gemm_rows_nt",
            "grouped_gemm_depth_tn"
        ]
    ),
    source!(
        "conv.cu",
        [
            "conv1d_forward",
            "conv1d_forward_words",
            "conv1d_backward_input",
            "conv1d_backward_input_words",
            "conv1d_backward_weight",
            "conv1d_backward_weight_window"
        ]
    ),
    source!(
        "delta.cu",
        [
            "delta_chunk_prep",
            "delta_forward_states",
            "delta_backward_states",
            "delta_backward_chunk",
            "delta_backward_norm",
            "delta_backward_a_log"
        ]
    ),
    source!(
        "delta_tensor_core.cu",
        [
            "delta_tc_prep",
            "delta_tc_walk",
            "delta_tc_output",
            "delta_tc_dvl",
            "delta_tc_back_walk",
            "delta_tc_back_chunk"
        ]
    ),
    source!(
        "sparse_attention.cu",
        [
            "dsa_indexer_scores",
            "dsa_indexer_topk",
            "dsa_indexer_loss",
            "dsa_indexer_backward_q",
            "dsa_indexer_backward_k",
            "dsa_indexer_scores_mma",
            "dsa_indexer_backward_q_mma",
            "dsa_indexer_backward_k_mma",
            "dsa_mqa_forward",
            "dsa_mqa_backward_dq",
            "dsa_mqa_backward_dkv",
            "dsa_mqa_forward_mma",
            "dsa_mqa_forward_wgmma",
            "dsa_mqa_backward_mma",
            "dsa_mqa_backward_wgmma",
            "dsa_mqa_partials_sum",
            "dsa_indexer_loss_target_mma",
            "dsa_indexer_loss_target_wgmma",
            "dsa_layer_norm_forward",
            "dsa_layer_norm_backward",
            "dsa_layer_norm_weight_grad"
        ]
    ),
    source!(
        "scan.cu",
        [
            "ssd_scan_forward_n32",
            "ssd_scan_forward_n64",
            "ssd_scan_forward_n128",
            "ssd_scan_forward_n256",
            "ssd_scan_factors",
            "ssd_scan_chunk_carry_n32",
            "ssd_scan_chunk_carry_n64",
            "ssd_scan_chunk_carry_n128",
            "ssd_scan_chunk_carry_n256",
            "ssd_scan_carry_combine",
            "ssd_scan_backward_head_n32",
            "ssd_scan_backward_head_n64",
            "ssd_scan_backward_head_n128",
            "ssd_scan_backward_head_n256",
            "ssd_scan_backward_group",
            "ssd_scan_backward_params"
        ]
    ),
    source!(
        "scan_chunked.cu",
        [
            "ssd_chunk_factors",
            "ssd_chunk_pack",
            "ssd_chunk_pack_bf16",
            "ssd_chunk_pack_quads",
            "ssd_chunk_pack_quads_bf16",
            "ssd_chunk_scores",
            "ssd_chunk_scores_bf16",
            "ssd_chunk_scores_quads",
            "ssd_chunk_scores_quads_bf16",
            "ssd_chunk_scores_sums",
            "ssd_chunk_scores_sums_bf16",
            "ssd_chunk_scores_sums_mma_p64",
            "ssd_chunk_scores_sums_mma_p80",
            "ssd_chunk_scores_times_mma_p64",
            "ssd_chunk_scores_times_mma_p80",
            "ssd_chunk_sums",
            "ssd_chunk_final",
            "ssd_chunk_unpack",
            "ssd_chunk_unpack_quads",
            "ssd_scan_state_combine",
            "ssd_chunk_output",
            "ssd_chunk_output_quads"
        ]
    ),
];

/// The variable naming the CUDA include directory (the one holding
/// `cuda_bf16.h`); `/usr/local/cuda/include` when unset.
pub const INCLUDE_ENV: &str = "HYBRIDGEN_CUDA_INCLUDE";
const DEFAULT_INCLUDE: &str = "/usr/local/cuda/include";

/// What NVRTC produces for a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Output {
    /// Machine code for one architecture (`sm_XX`), loaded as is.
    Cubin,
    /// PTX for a virtual architecture (`compute_XX`), compiled by the driver
    /// when the module is loaded; runs on that architecture and newer.
    Ptx,
}

/// An architecture to compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// NVRTC's `--gpu-architecture` value.
    pub arch: &'static str,
    pub output: Output,
}

impl Target {
    /// Hopper (H100, H200) machine code with its architecture-specific
    /// instructions (wgmma, setmaxnreg) available.
    pub const HOPPER: Target = Target {
        arch: "sm_90a",
        output: Output::Cubin,
    };
    /// PTX for every GPU from Ampere on, compiled by the driver at load.
    pub const PORTABLE: Target = Target {
        arch: "compute_80",
        output: Output::Ptx,
    };
    /// The oldest compute capability the CUDA backend runs on: bf16 storage
    /// and cuBLAS's bf16 GEMMs need Ampere (8.0).
    pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

    /// What to compile for a device of compute capability `major.minor`.
    pub fn for_device(major: i32, minor: i32) -> Target {
        if (major, minor) == (9, 0) {
            Target::HOPPER
        } else {
            Target::PORTABLE
        }
    }

    /// Whether kernels built for this target may be launched with
    /// programmatic dependent launch: their `grid_dependency_sync()`
    /// (`common.cuh`) is compiled in from sm_90 on; below that it is
    /// empty, and an overlapping launch would read unfinished inputs.
    pub fn dependent_launch(self) -> bool {
        self == Target::HOPPER
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.arch)
    }
}

/// How bad a [`Diagnostic`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Error,
    Warning,
}

/// One message from the compiler: where (file and line, when NVRTC gave
/// them) and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// The source or header it is in, or `nvrtc`/`ptxas` for messages about
    /// the compilation as a whole.
    pub file: String,
    pub line: Option<u32>,
    pub severity: Severity,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let severity = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        match self.line {
            Some(line) => write!(
                f,
                "runtime/src/cuda/kernels/{}:{line}: {severity}: {}",
                self.file, self.message
            ),
            None => write!(f, "{}: {severity}: {}", self.file, self.message),
        }
    }
}

/// Why kernels could not be compiled.
#[derive(Clone, Debug, thiserror::Error)]
pub enum KernelBuildError {
    /// libnvrtc could not be loaded.
    #[error(
        "NVRTC (libnvrtc.so.13) could not be loaded: {0}. Install the CUDA toolkit or the \
         `nvidia-cuda-nvrtc` wheel and put its lib directory on LD_LIBRARY_PATH"
    )]
    NvrtcMissing(String),
    /// The CUDA headers the kernels include are not where we looked.
    #[error(
        "the CUDA headers are not in {dir} (no cuda_bf16.h there): set {INCLUDE_ENV} to the \
         directory holding cuda_bf16.h (the toolkit's include/, or the `nvidia-cuda-runtime` \
         wheel's nvidia/cu13/include)"
    )]
    HeadersMissing { dir: PathBuf },
    /// The compiler rejected a source.
    #[error("{file} does not compile for {target}:\n{}", list(diagnostics, log))]
    Compile {
        file: &'static str,
        target: Target,
        /// Every error and warning, in the compiler's order.
        diagnostics: Vec<Diagnostic>,
        /// The whole log, for what the parser did not recognise.
        log: String,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("{file} for {target}: {call} failed: {message}")]
    Nvrtc {
        file: &'static str,
        target: Target,
        call: &'static str,
        message: String,
    },
}

fn list(diagnostics: &[Diagnostic], log: &str) -> String {
    if diagnostics.is_empty() {
        return log.trim_end().to_string();
    }
    let lines: Vec<String> = diagnostics.iter().map(|d| format!("  {d}")).collect();
    lines.join("\n")
}

/// One source compiled for one target.
#[derive(Clone, Debug)]
pub struct CompiledSource {
    pub file: &'static str,
    pub target: Target,
    /// The cubin, or the PTX text (without its terminating NUL).
    pub image: Vec<u8>,
    /// Warnings of a compilation that succeeded (a clean build has none).
    pub warnings: Vec<Diagnostic>,
}

/// The CUDA include directory: `$HYBRIDGEN_CUDA_INCLUDE`, else
/// `/usr/local/cuda/include`; an error unless it holds `cuda_bf16.h`.
pub fn include_dir() -> Result<PathBuf, KernelBuildError> {
    include_dir_from(std::env::var_os(INCLUDE_ENV).map(PathBuf::from))
}

/// [`include_dir`] with the variable's value given (`None`: unset).
pub fn include_dir_from(configured: Option<PathBuf>) -> Result<PathBuf, KernelBuildError> {
    let dir = configured.unwrap_or_else(|| PathBuf::from(DEFAULT_INCLUDE));
    if dir.join("cuda_bf16.h").is_file() {
        Ok(dir)
    } else {
        Err(KernelBuildError::HeadersMissing { dir })
    }
}

/// Whether libnvrtc can be loaded, or why not. Checked before any NVRTC
/// call: cudarc panics on a library it cannot load.
pub fn nvrtc_available() -> Result<(), KernelBuildError> {
    // SAFETY: only tries to open the library under its candidate names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelBuildError::NvrtcMissing(format!(
            "none of {:?} was found",
            cudarc::get_lib_name_candidates("nvrtc")
        )))
    }
}

/// NVRTC's version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), KernelBuildError> {
    nvrtc_available()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the call writes two ints.
    let result = crate::cuda::catch_cudarc_panic(|| unsafe {
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor)
    })
    .map_err(KernelBuildError::NvrtcMissing)?;
    if result != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(KernelBuildError::NvrtcMissing(format!(
            "nvrtcVersion returned {result:?}"
        )));
    }
    Ok((major, minor))
}

/// Compiles `source` for `target` with the CUDA headers in `include_dir`.
/// Errors are [`KernelBuildError::Compile`] with the compiler's diagnostics;
/// a compilation that succeeds reports its warnings in the result.
pub fn compile(
    source: &KernelSource,
    target: Target,
    include_dir: &Path,
) -> Result<CompiledSource, KernelBuildError> {
    nvrtc_available()?;
    crate::cuda::catch_cudarc_panic(|| compile_loaded(source, target, include_dir, &[]))
        .map_err(KernelBuildError::NvrtcMissing)?
        .map(|(compiled, _)| compiled)
}

/// What the assembler gave one kernel of a source compiled for Hopper:
/// registers a thread, and the bytes of its stack frame and of its spills
/// (registers it ran out of, stored to and loaded from local memory).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelResources {
    pub kernel: String,
    pub registers: u32,
    pub stack_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

/// Every kernel of `source` compiled for Hopper with the assembler's
/// report (`--ptxas-options=-v`): what a launch bound or a held array costs
/// in registers, found without a GPU (a kernel whose launch bounds left it
/// 64 registers spilled the row it had fetched, and ran slower than the two
/// kernels it replaced, until the timeline showed it).
pub fn resources(
    source: &KernelSource,
    include_dir: &Path,
) -> Result<Vec<KernelResources>, KernelBuildError> {
    nvrtc_available()?;
    let verbose = ["--ptxas-options=-v"];
    crate::cuda::catch_cudarc_panic(|| {
        compile_loaded(source, Target::HOPPER, include_dir, &verbose)
    })
    .map_err(KernelBuildError::NvrtcMissing)?
    .map(|(_, log)| parse_resources(&log))
}

/// The assembler's report in an NVRTC log: per kernel, a line naming it
/// (`Compiling entry function 'k' for 'sm_90a'`), then its stack frame
/// and spills, then its registers.
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    // The number before `marker` on `line`.
    fn before(line: &str, marker: &str) -> Option<u32> {
        let head = &line[..line.find(marker)?];
        head.split_whitespace().next_back()?.parse().ok()
    }
    let mut kernels: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            kernels.push(KernelResources {
                kernel: name.to_string(),
                registers: 0,
                stack_bytes: 0,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
            });
            continue;
        }
        let Some(current) = kernels.last_mut() else {
            continue;
        };
        if let Some(stack) = before(line, "bytes stack frame") {
            current.stack_bytes = stack;
            current.spill_store_bytes = before(line, "bytes spill stores").unwrap_or(0);
            current.spill_load_bytes = before(line, "bytes spill loads").unwrap_or(0);
        } else if let Some(registers) = before(line, "registers") {
            current.registers = registers;
        }
    }
    kernels
}

/// Every source in [`SOURCES`], compiled for `target`.
pub fn compile_all(
    target: Target,
    include_dir: &Path,
) -> Result<Vec<CompiledSource>, KernelBuildError> {
    compile_each(SOURCES, |source| compile(source, target, include_dir))
}

/// `compile` applied to every source on threads of their own, at most one
/// a core: the results in `sources`' order, or the first error in that
/// order. The sources are independent programs and NVRTC compiles
/// separate programs at once, so a start without the kernel cache waits
/// for about its slowest source rather than for all of them in turn:
/// Hopper's twenty took 36 s one after another on an H200's host, and on a
/// two-core machine 14.0 s at once against 21.1 s one by one.
pub fn compile_each<F>(
    sources: &[KernelSource],
    compile: F,
) -> Result<Vec<CompiledSource>, KernelBuildError>
where
    F: Fn(&KernelSource) -> Result<CompiledSource, KernelBuildError> + Sync,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(sources.len())
        .max(1);
    // Each worker takes the next source not yet taken and keeps its index.
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, Result<CompiledSource, KernelBuildError>)> =
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(source) = sources.get(i) else {
                                return mine;
                            };
                            mine.push((i, compile(source)));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, result)| result).collect()
}

/// The options every source is compiled with for `target`: what NVRTC is
/// given, and part of the kernel cache's key.
pub fn compile_options(target: Target, include_dir: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", target.arch),
        format!("--include-path={}", include_dir.display()),
        "--std=c++17".to_string(),
        "--fmad=false".to_string(),
    ]
}

/// An NVRTC program, destroyed on drop.
struct Program(cudarc::nvrtc::sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here. A
        // failure to free is not worth a panic in a destructor.
        unsafe {
            let _ = cudarc::nvrtc::sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn nvrtc_message(result: cudarc::nvrtc::sys::nvrtcResult) -> String {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
    let text = unsafe { cudarc::nvrtc::sys::nvrtcGetErrorString(result) };
    if text.is_null() {
        format!("{result:?}")
    } else {
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// [`compile`] with `extra` options after the usual ones; also returns the
/// whole log.
fn compile_loaded(
    source: &KernelSource,
    target: Target,
    include_dir: &Path,
    extra: &[&str],
) -> Result<(CompiledSource, String), KernelBuildError> {
    use cudarc::nvrtc::sys::{self, nvrtcResult::NVRTC_SUCCESS};
    let fail = |call: &'static str, result| KernelBuildError::Nvrtc {
        file: source.file,
        target,
        call,
        message: nvrtc_message(result),
    };
    let interior_nul = |what: &str| KernelBuildError::Nvrtc {
        file: source.file,
        target,
        call: "nvrtcCreateProgram",
        message: format!("{what} contains a NUL byte"),
    };
    let text = CString::new(source.text).map_err(|_| interior_nul("the source"))?;
    let name = CString::new(source.file).map_err(|_| interior_nul("the file name"))?;
    let mut header_texts = Vec::with_capacity(HEADERS.len());
    let mut header_names = Vec::with_capacity(HEADERS.len());
    for (name, text) in HEADERS {
        header_texts.push(CString::new(*text).map_err(|_| interior_nul(name))?);
        header_names.push(CString::new(*name).map_err(|_| interior_nul(name))?);
    }
    let headers: Vec<_> = header_texts.iter().map(|h| h.as_ptr()).collect();
    let header_names: Vec<_> = header_names.iter().map(|h| h.as_ptr()).collect();
    let mut program = Program(std::ptr::null_mut());
    // SAFETY: every pointer is a live NUL-terminated string for the call;
    // NVRTC copies the sources.
    let result = unsafe {
        sys::nvrtcCreateProgram(
            &mut program.0,
            text.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            headers.as_ptr(),
            header_names.as_ptr(),
        )
    };
    if result != NVRTC_SUCCESS {
        return Err(fail("nvrtcCreateProgram", result));
    }
    let mut options = compile_options(target, include_dir);
    options.extend(extra.iter().map(|o| o.to_string()));
    let options: Vec<CString> = options
        .iter()
        .map(|o| {
            CString::new(o.as_str()).map_err(|_| interior_nul("an option (the include path?)"))
        })
        .collect::<Result<_, _>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: the program is live and the options are NUL-terminated
    // strings that outlive the call. The count is tiny.
    let compiled = unsafe {
        sys::nvrtcCompileProgram(program.0, option_ptrs.len() as i32, option_ptrs.as_ptr())
    };
    let log = program_log(&program).map_err(|r| fail("nvrtcGetProgramLog", r))?;
    let diagnostics = parse_log(&log);
    if compiled != NVRTC_SUCCESS {
        return Err(KernelBuildError::Compile {
            file: source.file,
            target,
            diagnostics,
            log,
        });
    }
    let image = match target.output {
        Output::Cubin => read_output(&program, sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN)
            .map_err(|r| fail("nvrtcGetCUBIN", r))?,
        Output::Ptx => {
            let mut ptx = read_output(&program, sys::nvrtcGetPTXSize, sys::nvrtcGetPTX)
                .map_err(|r| fail("nvrtcGetPTX", r))?;
            // The size counts the terminating NUL.
            while ptx.last() == Some(&0) {
                ptx.pop();
            }
            ptx
        }
    };
    let compiled = CompiledSource {
        file: source.file,
        target,
        image,
        warnings: diagnostics
            .into_iter()
            .filter(|d| d.severity == Severity::Warning)
            .collect(),
    };
    Ok((compiled, log))
}

type SizeFn =
    unsafe fn(cudarc::nvrtc::sys::nvrtcProgram, *mut usize) -> cudarc::nvrtc::sys::nvrtcResult;
type ReadFn =
    unsafe fn(cudarc::nvrtc::sys::nvrtcProgram, *mut c_char) -> cudarc::nvrtc::sys::nvrtcResult;

/// One of the program's outputs (log, PTX, cubin) through its size and read
/// calls.
fn read_output(
    program: &Program,
    size: SizeFn,
    read: ReadFn,
) -> Result<Vec<u8>, cudarc::nvrtc::sys::nvrtcResult> {
    use cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS;
    let mut len = 0usize;
    // SAFETY: the program is live; the call writes one usize.
    let result = unsafe { size(program.0, &mut len) };
    if result != NVRTC_SUCCESS {
        return Err(result);
    }
    let mut bytes = vec![0u8; len];
    if len > 0 {
        // SAFETY: `bytes` holds the `len` bytes the call writes.
        let result = unsafe { read(program.0, bytes.as_mut_ptr().cast()) };
        if result != NVRTC_SUCCESS {
            return Err(result);
        }
    }
    Ok(bytes)
}

fn program_log(program: &Program) -> Result<String, cudarc::nvrtc::sys::nvrtcResult> {
    use cudarc::nvrtc::sys;
    let bytes = read_output(
        program,
        sys::nvrtcGetProgramLogSize,
        sys::nvrtcGetProgramLog,
    )?;
    let text = CStr::from_bytes_until_nul(&bytes)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
    Ok(text)
}

/// The errors and warnings of an NVRTC log. Front-end messages read
/// `file(line): error: message` or `file(line): warning #177-D: message`;
/// the compilation's own read `nvrtc: error: ...` or `ptxas warning : ...`.
/// Source excerpts and caret lines between them are skipped.
pub fn parse_log(log: &str) -> Vec<Diagnostic> {
    log.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Diagnostic> {
    let line = line.trim_end();
    if let Some((place, rest)) = line.split_once("): ")
        && let Some((file, number)) = place.rsplit_once('(')
        && let Ok(number) = number.parse::<u32>()
        && let Some((severity, message)) = severity_and_message(rest)
    {
        return Some(Diagnostic {
            file: file.trim().to_string(),
            line: Some(number),
            severity,
            message,
        });
    }
    for tool in ["nvrtc", "ptxas"] {
        if let Some(rest) = line.strip_prefix(tool) {
            let rest = rest.trim_start_matches([':', ' ']);
            if let Some((severity, message)) = severity_and_message(rest) {
                return Some(Diagnostic {
                    file: tool.to_string(),
                    line: None,
                    severity,
                    message,
                });
            }
        }
    }
    None
}

/// `error: msg`, `warning #177-D: msg` or `warning : msg` split into a
/// severity and the message.
fn severity_and_message(rest: &str) -> Option<(Severity, String)> {
    let (severity, after) = if let Some(after) = rest.strip_prefix("error") {
        (Severity::Error, after)
    } else if let Some(after) = rest.strip_prefix("warning") {
        (Severity::Warning, after)
    } else {
        return None;
    };
    let (code, message) = after.split_once(':')?;
    let code = code.trim();
    let message = message.trim();
    Some((
        severity,
        if code.is_empty() {
            message.to_string()
        } else {
            format!("{message} ({code})")
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sources compiled at once come back in their own order, whichever
    /// finished first, and of two that fail the earlier source's error is
    /// the one reported (here the later one fails first).
    #[test]
    fn compile_each_keeps_the_sources_order_and_their_first_error() {
        const NAMES: [&str; 9] = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
        let sources: Vec<KernelSource> = NAMES
            .iter()
            .map(|&file| KernelSource {
                file,
                text: "",
                entry_points: &[],
            })
            .collect();
        // The earlier a source, the longer it takes.
        let slow = |source: &KernelSource| {
            let rank = NAMES.iter().position(|&n| n == source.file).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(5 * (9 - rank) as u64));
        };
        let compiled = compile_each(&sources, |source| {
            slow(source);
            Ok(CompiledSource {
                file: source.file,
                target: Target::HOPPER,
                image: source.file.as_bytes().to_vec(),
                warnings: Vec::new(),
            })
        })
        .unwrap();
        let files: Vec<&str> = compiled.iter().map(|c| c.file).collect();
        assert_eq!(files, NAMES);
        let failed = compile_each(&sources, |source| {
            slow(source);
            if matches!(source.file, "c" | "h") {
                return Err(KernelBuildError::Compile {
                    file: source.file,
                    target: Target::HOPPER,
                    diagnostics: Vec::new(),
                    log: String::new(),
                });
            }
            Ok(CompiledSource {
                file: source.file,
                target: Target::HOPPER,
                image: Vec::new(),
                warnings: Vec::new(),
            })
        });
        assert!(
            matches!(failed, Err(KernelBuildError::Compile { file: "c", .. })),
            "{failed:?}"
        );
    }

    #[test]
    fn the_assemblers_report_is_read_per_kernel() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'rmsnorm_backward' for 'sm_90a'\n\
            ptxas info    : Function properties for rmsnorm_backward\n\
            ptxas         .     152 bytes stack frame, 524 bytes spill stores, 508 bytes spill loads\n\
            ptxas info    : Used 64 registers, used 1 barriers, 152 bytes cumulative stack size, 256 bytes smem\n\
            ptxas info    : Compiling entry function 'axpy' for 'sm_90a'\n\
            ptxas info    : Function properties for axpy\n\
            ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 30 registers, used 0 barriers\n";
        assert_eq!(
            parse_resources(log),
            [
                KernelResources {
                    kernel: "rmsnorm_backward".into(),
                    registers: 64,
                    stack_bytes: 152,
                    spill_store_bytes: 524,
                    spill_load_bytes: 508,
                },
                KernelResources {
                    kernel: "axpy".into(),
                    registers: 30,
                    stack_bytes: 0,
                    spill_store_bytes: 0,
                    spill_load_bytes: 0,
                },
            ]
        );
    }

    #[test]
    fn log_lines_become_diagnostics_with_places() {
        let log = "routing.cu(12): error: identifier \"x\" is undefined\n  x = 1;\n  ^\n\n\
                   common.cuh(40): warning #177-D: variable \"y\" was declared but never referenced\n\
                   nvrtc: error: failed to open libnvrtc-builtins.so.13.0.\n\
                   ptxas warning : Registers are spilled to local memory in function 'f'\n\
                   1 error detected in the compilation of \"routing.cu\".\n";
        let found = parse_log(log);
        assert_eq!(found.len(), 4, "{found:?}");
        assert_eq!(
            found[0].to_string(),
            "runtime/src/cuda/kernels/routing.cu:12: error: identifier \"x\" is undefined"
        );
        assert_eq!(found[1].severity, Severity::Warning);
        assert_eq!(found[1].line, Some(40));
        assert_eq!(
            found[1].message,
            "variable \"y\" was declared but never referenced (#177-D)"
        );
        assert_eq!(found[2].file, "nvrtc");
        assert_eq!(found[2].severity, Severity::Error);
        assert_eq!(found[3].file, "ptxas");
        assert_eq!(found[3].severity, Severity::Warning);
    }

    /// The kernels a source defines: each `__global__` function, and each
    /// use of a macro whose body defines one (a kernel instantiated per
    /// size, `SCAN_FORWARD(ssd_scan_forward_n32, 1)`), by name.
    fn defined_kernels(text: &str) -> Vec<String> {
        let mut names = Vec::new();
        let mut macros = Vec::new();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if let Some(rest) = line.trim_start().strip_prefix("#define ") {
                // The whole definition, over its continued lines.
                let mut body = line.to_string();
                while body.trim_end().ends_with('\\') {
                    match lines.next() {
                        Some(next) => body += next,
                        None => break,
                    }
                }
                if body.contains("__global__") {
                    macros.push(
                        rest.split('(')
                            .next()
                            .unwrap_or_default()
                            .trim()
                            .to_string(),
                    );
                }
                continue;
            }
            if let Some(at) = line.find("__global__") {
                // The name is the identifier before the parameter list,
                // after any `__launch_bounds__(...)`.
                let mut decl = &line[at + "__global__".len()..];
                for qualifier in ["__launch_bounds__", "__maxnreg__"] {
                    if let Some(at) = decl.find(qualifier) {
                        decl = decl[at..].split_once(')').map_or("", |(_, rest)| rest);
                    }
                }
                let head = decl.split('(').next().unwrap_or_default();
                if let Some(name) = head.split_whitespace().last() {
                    names.push(name.to_string());
                }
                continue;
            }
            for m in &macros {
                if let Some(args) = line.trim_start().strip_prefix(&format!("{m}(")) {
                    names.push(
                        args.split([',', ')'])
                            .next()
                            .unwrap_or_default()
                            .trim()
                            .to_string(),
                    );
                }
            }
        }
        names
    }

    #[test]
    fn every_source_is_listed_once_with_its_entry_points_defined() {
        let mut files: Vec<&str> = SOURCES.iter().map(|s| s.file).collect();
        files.sort_unstable();
        files.dedup();
        assert_eq!(files.len(), SOURCES.len());
        for source in SOURCES {
            let mut defined = defined_kernels(source.text);
            let mut listed: Vec<String> =
                source.entry_points.iter().map(|e| e.to_string()).collect();
            defined.sort_unstable();
            listed.sort_unstable();
            // Every entry point is defined, and every kernel defined is
            // listed (none forgotten).
            assert_eq!(defined, listed, "{}: defined vs listed", source.file);
        }
    }

    /// The bodies of `text`'s `__global__` functions (macro bodies
    /// included) that do not begin with `grid_dependency_sync();`, by the
    /// line of their `__global__`.
    fn kernels_without_the_dependency_wait(text: &str) -> Vec<usize> {
        let mut missing = Vec::new();
        let mut from = 0;
        while let Some(at) = text[from..].find("__global__").map(|i| from + i) {
            from = at + "__global__".len();
            let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
            if text[line_start..at].trim_start().starts_with("//") {
                continue;
            }
            // The body opens at the first brace: a kernel's parameters and
            // qualifiers have none.
            let Some(open) = text[at..].find('{').map(|i| at + i + 1) else {
                missing.push(text[..at].lines().count());
                continue;
            };
            let body = text[open..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
            if !body.starts_with("grid_dependency_sync();") {
                missing.push(text[..at].lines().count());
            }
        }
        missing
    }

    /// The parameter count of each of `text`'s `__global__` functions (macro
    /// bodies included): the parenthesised list just before its body.
    fn kernel_parameter_counts(text: &str) -> Vec<usize> {
        let mut counts = Vec::new();
        let mut from = 0;
        while let Some(at) = text[from..].find("__global__").map(|i| from + i) {
            from = at + "__global__".len();
            let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
            if text[line_start..at].trim_start().starts_with("//") {
                continue;
            }
            let Some(open) = text[at..].find('{').map(|i| at + i) else {
                continue;
            };
            let head = &text[at..open];
            let (Some(close), Some(start)) = (head.rfind(')'), head.rfind('(')) else {
                continue;
            };
            let params = &head[start + 1..close];
            counts.push(match params.trim() {
                "" => 0,
                _ => params.matches(',').count() + 1,
            });
        }
        counts
    }

    /// Our launches carry at most `MAX_ARGS` arguments (a fixed array, no
    /// allocation a launch): every kernel must fit it.
    #[test]
    fn every_kernel_takes_at_most_the_launch_arguments() {
        use crate::cuda::launch::args::MAX_ARGS;
        let mut widest = 0;
        for source in SOURCES {
            for count in kernel_parameter_counts(source.text) {
                assert!(
                    count <= MAX_ARGS,
                    "{}: a kernel takes {count} arguments",
                    source.file
                );
                widest = widest.max(count);
            }
        }
        assert!(
            widest > 20,
            "the parameter lists were not found (widest {widest})"
        );
        assert_eq!(
            kernel_parameter_counts(
                "extern \"C\" __global__ void __launch_bounds__(64) k(int a, float* b) {}"
            ),
            [2]
        );
    }

    /// Launches carry programmatic dependent launch on Hopper, which is
    /// safe only if every kernel waits for the one before it before it
    /// touches memory.
    #[test]
    fn every_kernel_begins_with_the_dependency_wait() {
        for source in SOURCES {
            assert_eq!(
                kernels_without_the_dependency_wait(source.text),
                Vec::<usize>::new(),
                "{}: kernels (by line) that do not begin with grid_dependency_sync()",
                source.file
            );
        }
        let text = "extern \"C\" __global__ void a(int x) {\n    grid_dependency_sync();\n}\n\
                    // __global__ in a comment\n\
                    #define K(NAME) \\\n    extern \"C\" __global__ void NAME(int x) { \\\n        \
                    grid_dependency_sync(); \\\n    }\n\
                    extern \"C\" __global__ void __launch_bounds__(64) b(int x) {\n    int y = x;\n}\n";
        assert_eq!(kernels_without_the_dependency_wait(text), [9]);
    }

    #[test]
    fn macro_instantiated_kernels_are_found() {
        let text = "#define K(NAME, R) \\\n  extern \"C\" __global__ void NAME(int x) { f<R>(x); }\n\
                    K(k_a, 1)\nK(k_b, 2)\n\
                    extern \"C\" __global__ void __launch_bounds__(256) plain(int x) {}\n\
                    extern \"C\" __global__ void other(int x) {}\n";
        let mut found = defined_kernels(text);
        found.sort_unstable();
        assert_eq!(found, ["k_a", "k_b", "other", "plain"]);
    }

    #[test]
    fn targets_follow_the_device() {
        assert_eq!(Target::for_device(9, 0), Target::HOPPER);
        assert_eq!(Target::for_device(8, 0), Target::PORTABLE);
        assert_eq!(Target::for_device(10, 0), Target::PORTABLE);
        assert!(Target::HOPPER.dependent_launch());
        assert!(!Target::PORTABLE.dependent_launch());
    }
}

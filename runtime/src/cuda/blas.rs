//! GEMMs through cuBLAS: one handle per stream, with a workspace of its own
//! (cuBLAS is deterministic for a given handle, stream and workspace), f32
//! compute whatever the storage (bf16 in, f32 accumulate; no TF32, so f32
//! mode is comparable with the CPU), `accumulate` as beta = 1.
//!
//! The runtime's matrices are row-major and cuBLAS's column-major: a
//! row-major `C [m, n] = op(A) op(B)` is the column-major
//! `C^T [n, m] = op(B)^T op(A)^T`, so every call swaps the operands.

use super::blas_lt::LtGemm;
use super::buffer::GpuView;
use super::queue::QueueSet;
use crate::backend::MatmulDims;
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasMath_t, cublasOperation_t,
    cudaDataType,
};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaStream, result};
use std::ffi::c_void;

/// cuBLAS's recommended workspace on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle bound to one stream, and cuBLASLt for bf16 GEMMs.
pub(crate) struct Blas {
    handle: cublasHandle_t,
    workspace: u64,
    lt: LtGemm,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it
// do not overlap; each handle belongs to one queue, used by one thread at a
// time (the lane's), in order.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Blas")
    }
}

fn blas_error(queues: &QueueSet, what: &str, e: impl std::fmt::Debug) -> RuntimeError {
    queues.error(what, format!("{e:?}"))
}

impl Blas {
    /// A handle on `stream`, with its workspace (default math: no TF32
    /// unless a call asks for it, and none does).
    pub(crate) fn new(queues: &QueueSet, stream: &CudaStream) -> Result<Blas> {
        queues.bind()?;
        let lt = LtGemm::new(queues, stream)?;
        let handle = super::catch_cudarc_panic(blas::create_handle)
            .map_err(|e| queues.error("loading cuBLAS (libcublas.so)", e))?
            .map_err(|e| blas_error(queues, "creating a cuBLAS handle", e))?;
        // SAFETY: a plain device allocation, freed in `drop`.
        let workspace = unsafe { result::malloc_sync(WORKSPACE_BYTES) }
            .map_err(|e| queues.error("allocating the cuBLAS workspace", e))?;
        let blas = Blas {
            handle,
            workspace,
            lt,
        };
        // SAFETY: the handle, stream and workspace are live.
        unsafe {
            blas::set_stream(handle, stream.cu_stream() as _)
                .map_err(|e| blas_error(queues, "binding cuBLAS to a stream", e))?;
            blas_sys::cublasSetWorkspace_v2(handle, workspace as *mut c_void, WORKSPACE_BYTES)
                .result()
                .map_err(|e| blas_error(queues, "setting the cuBLAS workspace", e))?;
            blas_sys::cublasSetMathMode(handle, cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| blas_error(queues, "setting cuBLAS's math mode", e))?;
        }
        Ok(blas)
    }

    /// `C (+)= op(A) op(B)` (see [`crate::Backend::matmul`]); the views'
    /// dtypes and lengths are checked by the caller. `A` and `B` share a
    /// dtype; `C` is bf16 or f32.
    pub(crate) fn gemm(
        &self,
        queues: &QueueSet,
        a: GpuView,
        b: GpuView,
        c: GpuView,
        dims: MatmulDims,
    ) -> Result<()> {
        let MatmulDims { m, n, k, .. } = dims;
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| {
                RuntimeError::InvalidArgument(format!(
                    "kernel `matmul`: {what} = {v} is past cuBLAS's 32-bit limit"
                ))
            })
        };
        // bf16 operands: cuBLASLt with the algorithm of the shape's class
        // (blas_lt.rs says why); f32 ones keep cuBLAS's strict f32.
        if a.dtype == DType::Bf16 {
            [m, n, k]
                .iter()
                .try_for_each(|&v| int(v, "a dimension").map(drop))?;
            if self
                .lt
                .gemm(queues, (self.workspace, WORKSPACE_BYTES), [a, b, c], dims)?
            {
                return Ok(());
            }
        }
        // Column-major view: C^T [n, m] = op(B)^T [n, k] op(A)^T [k, m].
        let lda_b = if dims.b_trans { k } else { n };
        let ldb_a = if dims.a_trans { m } else { k };
        let compute = compute_type(a.dtype);
        let alpha = 1.0f32;
        let beta = if dims.accumulate { 1.0f32 } else { 0.0 };
        // SAFETY: the caller checked that `a`, `b` and `c` hold exactly the
        // elements the dimensions address; the handle is bound to the stream
        // the views are used on.
        unsafe {
            blas_sys::cublasGemmEx(
                self.handle,
                op(dims.b_trans),
                op(dims.a_trans),
                int(n, "n")?,
                int(m, "m")?,
                int(k, "k")?,
                (&alpha as *const f32).cast(),
                b.ptr as *const c_void,
                ty(b.dtype),
                int(lda_b, "the leading dimension of B")?,
                a.ptr as *const c_void,
                ty(a.dtype),
                int(ldb_a, "the leading dimension of A")?,
                (&beta as *const f32).cast(),
                c.ptr as *mut c_void,
                ty(c.dtype),
                int(n, "n")?,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
            .map_err(|e| {
                blas_error(
                    queues,
                    &format!(
                        "cuBLAS GEMM {m}x{n}x{k} ({} x {} -> {})",
                        a.dtype, b.dtype, c.dtype
                    ),
                    e,
                )
            })
        }
    }
}

/// One row-major matrix of a strided batch: where item 0 starts (a device
/// address), its dtype, the distance between its rows (`ld`) and between
/// consecutive items (`stride`), both in elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StridedMatrix {
    pub ptr: u64,
    pub dtype: DType,
    pub ld: usize,
    pub stride: usize,
}

/// `C_i = alpha op(A_i) op(B_i) + beta C_i` for `batch` items, row-major:
/// `op(A_i)` is `[m, k]` (`A_i` stored `[k, m]` when `a_trans`), `op(B_i)`
/// `[k, n]`, `C_i` `[m, n]`. The caller checks that every item lies inside
/// its buffer; `A` and `B` share a dtype.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StridedGemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: StridedMatrix,
    pub a_trans: bool,
    pub b: StridedMatrix,
    pub b_trans: bool,
    pub c: StridedMatrix,
    pub alpha: f32,
    pub beta: f32,
    pub batch: usize,
}

impl Blas {
    /// A strided batch of GEMMs (`cublasGemmStridedBatchedEx`), with the
    /// same compute types as [`Blas::gemm`]: strict f32 for f32 operands,
    /// f32 accumulation for bf16 ones (whose `C` may be f32).
    ///
    /// # Safety
    /// Every item of `A`, `B` and `C` must lie inside a live device
    /// allocation used on this handle's stream.
    pub(crate) unsafe fn gemm_strided(&self, queues: &QueueSet, g: StridedGemm) -> Result<()> {
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(());
        }
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| {
                RuntimeError::InvalidArgument(format!(
                    "a batched cuBLAS GEMM: {what} = {v} is past cuBLAS's 32-bit limit"
                ))
            })
        };
        let long = |v: usize| v as std::ffi::c_longlong;
        let compute = compute_type(g.a.dtype);
        // Column-major: C^T [n, m] = op(B)^T [n, k] op(A)^T [k, m]; a
        // row-major matrix with row stride ld is a column-major one with
        // leading dimension ld, so the strides carry over unchanged.
        // SAFETY: the caller guarantees every item lies in live memory.
        unsafe {
            blas_sys::cublasGemmStridedBatchedEx(
                self.handle,
                op(g.b_trans),
                op(g.a_trans),
                int(g.n, "n")?,
                int(g.m, "m")?,
                int(g.k, "k")?,
                (&g.alpha as *const f32).cast(),
                g.b.ptr as *const c_void,
                ty(g.b.dtype),
                int(g.b.ld, "the leading dimension of B")?,
                long(g.b.stride),
                g.a.ptr as *const c_void,
                ty(g.a.dtype),
                int(g.a.ld, "the leading dimension of A")?,
                long(g.a.stride),
                (&g.beta as *const f32).cast(),
                g.c.ptr as *mut c_void,
                ty(g.c.dtype),
                int(g.c.ld, "the leading dimension of C")?,
                long(g.c.stride),
                int(g.batch, "the batch")?,
                compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
            .map_err(|e| {
                blas_error(
                    queues,
                    &format!(
                        "batched cuBLAS GEMM {} x {}x{}x{} ({} x {} -> {})",
                        g.batch, g.m, g.n, g.k, g.a.dtype, g.b.dtype, g.c.dtype
                    ),
                    e,
                )
            })
        }
    }
}

/// cuBLAS's transpose flag.
fn op(transpose: bool) -> cublasOperation_t {
    if transpose {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// cuBLAS's name of a float storage type (bf16 or f32).
fn ty(dtype: DType) -> cudaDataType {
    match dtype {
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
        _ => cudaDataType::CUDA_R_32F,
    }
}

/// f32 operands compute strictly in f32 (no TF32, no reduced-precision
/// reductions): the checking mode. bf16 operands use the tensor cores with
/// f32 accumulation.
fn compute_type(operands: DType) -> cublasComputeType_t {
    if operands == DType::F32 {
        cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC
    } else {
        cublasComputeType_t::CUBLAS_COMPUTE_32F
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        unsafe {
            let _ = blas::destroy_handle(self.handle);
            let _ = result::free_sync(self.workspace);
        }
    }
}

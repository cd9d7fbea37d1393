//! bf16 GEMMs through cuBLASLt with an algorithm chosen once per shape
//! class, not once per call.
//!
//! `cublasGemmEx` runs cuBLAS's heuristic on every call whose exact shape
//! it has not cached, and that costs 100 to 300 µs of host time: the MoE
//! experts' GEMMs change their row count with every routing, so on the
//! benchmark model a third of the GEMM calls missed and the host, not the
//! GPU, set the step time (`run.sh LOGDIR timeline` showed it). Here each
//! dimension is rounded up to a [`class`] (four per octave), the heuristic
//! runs once per class on that class's largest shape, and the algorithm it
//! picks serves every shape of the class. Rounding up matters: an
//! algorithm's workspace and split-K fit the largest shape of its class,
//! so they fit the smaller ones.
//!
//! The algorithm is a function of the shape class alone (never of which
//! shape came first), so the bits a GEMM gives do not depend on the order
//! of earlier calls, a resume or a schedule. A shape its class's algorithm
//! does not support (cuBLASLt says so at the call) and a class with no
//! algorithm go through `cublasGemmEx`, as before.

use super::buffer::GpuView;
use super::queue::QueueSet;
use crate::backend::MatmulDims;
use crate::error::Result;
use crate::view::DType;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self, cublasComputeType_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDescAttributes_t as Desc, cublasLtMatmulPreferenceAttributes_t as Pref,
    cublasLtMatrixLayout_t, cublasStatus_t, cudaDataType,
};
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, PoisonError};

/// The class of a dimension: from 64 up, `x` rounded up to a multiple of
/// a quarter of its octave (1,000 and 1,017 share the class 1,024; 1,100
/// is in 1,280); up to 8, the power of two at least `x` (a matrix-vector
/// product keeps a class of its own); in between, `x` rounded up to a
/// multiple of 8. Small dimensions need classes too: an expert that the
/// routing gives a few tokens has a new row count nearly every step, and a
/// heuristic run per count cost 200 to 300 µs of host time each, about 20
/// a step on the benchmark model early on. Multiples of a quarter octave
/// (and of 8 below 64) are their own class, so fixed shapes keep their own
/// algorithm.
pub(crate) fn class(x: usize) -> usize {
    if x <= 8 {
        return x.next_power_of_two();
    }
    if x < 64 {
        return x.next_multiple_of(8);
    }
    let octave = usize::BITS - 1 - x.leading_zeros();
    let step = 1usize << (octave - 2);
    x.div_ceil(step) * step
}

/// log2 of the largest power of two (at most 256) dividing every byte
/// offset a matrix is read at: its address and its rows' stride.
fn alignment(ptr: u64, ld: usize, dtype: DType) -> u32 {
    let stride = (ld * dtype.bytes()) as u64;
    (ptr | stride | 256).trailing_zeros()
}

/// What an algorithm is chosen for: the column-major problem's
/// transposes, dimension classes, dtypes and operand alignments.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct ShapeClass {
    trans: [bool; 2],
    dims: [usize; 3],
    ab: DType,
    c: DType,
    accumulate: bool,
    /// log2 of the byte alignment of A, B and C.
    align: [u32; 3],
}

/// cuBLASLt's handle, the heuristic's preferences, and the algorithm of
/// every shape class met so far (`None`: the heuristic had none).
pub(crate) struct LtGemm {
    handle: cublasLtHandle_t,
    stream: sys::cudaStream_t,
    algos: Mutex<HashMap<ShapeClass, Option<cublasLtMatmulAlgo_t>>>,
    /// Whether its class's algorithm serves an exact shape
    /// (`cublasLtMatmulAlgoCheck`, once per shape: cuBLASLt's matmul does
    /// not check everything, and an unchecked algorithm gave wrong values
    /// for a matrix-vector product).
    serves: Mutex<HashMap<(ShapeClass, [usize; 3]), bool>>,
}

// SAFETY: as `Blas`: one queue's handle, used by one thread at a time.
unsafe impl Send for LtGemm {}
unsafe impl Sync for LtGemm {}

/// A cuBLASLt object destroyed when dropped.
struct Owned<T: Copy>(T, unsafe fn(T) -> std::result::Result<(), lt::CublasError>);

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: created by the matching create call, destroyed once.
        let _ = unsafe { (self.1)(self.0) };
    }
}

/// A column-major problem `C [M, N] = op(A) [M, K] op(B) [K, N]`, operands
/// stored contiguously (`ld` = stored rows).
#[derive(Clone, Copy)]
struct Problem {
    trans: [bool; 2],
    /// M, N, K.
    dims: [usize; 3],
    ab: DType,
    c: DType,
}

impl Problem {
    /// Stored rows and columns of A, B and C.
    fn shapes(&self) -> [(usize, usize); 3] {
        let [m, n, k] = self.dims;
        let a = if self.trans[0] { (k, m) } else { (m, k) };
        let b = if self.trans[1] { (n, k) } else { (k, n) };
        [a, b, (m, n)]
    }

    fn layouts(&self) -> std::result::Result<[Owned<cublasLtMatrixLayout_t>; 3], lt::CublasError> {
        let [a, b, c] = self.shapes();
        let layout = |(rows, cols): (usize, usize), dtype| {
            lt::create_matrix_layout(lt_type(dtype), rows as u64, cols as u64, rows as i64)
                .map(|l| Owned(l, lt::destroy_matrix_layout))
        };
        Ok([layout(a, self.ab)?, layout(b, self.ab)?, layout(c, self.c)?])
    }

    fn desc(&self) -> std::result::Result<Owned<sys::cublasLtMatmulDesc_t>, lt::CublasError> {
        let desc = lt::create_matmul_desc(
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cudaDataType::CUDA_R_32F,
        )?;
        let desc = Owned(desc, lt::destroy_matmul_desc);
        for (attr, t) in [
            Desc::CUBLASLT_MATMUL_DESC_TRANSA,
            Desc::CUBLASLT_MATMUL_DESC_TRANSB,
        ]
        .into_iter()
        .zip(self.trans)
        {
            // cublasOperation_t, an int32: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
            let op = i32::from(t);
            // SAFETY: a live descriptor; the value is the attribute's type.
            unsafe {
                lt::set_matmul_desc_attribute(desc.0, attr, (&op as *const i32).cast(), 4)?;
            }
        }
        Ok(desc)
    }
}

fn lt_type(dtype: DType) -> cudaDataType {
    match dtype {
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
        _ => cudaDataType::CUDA_R_32F,
    }
}

impl LtGemm {
    /// cuBLASLt on `stream`.
    pub(crate) fn new(queues: &QueueSet, stream: &CudaStream) -> Result<LtGemm> {
        let handle = super::catch_cudarc_panic(lt::create_handle)
            .map_err(|e| queues.error("loading cuBLASLt (libcublasLt.so)", e))?
            .map_err(|e| queues.error("creating a cuBLASLt handle", format!("{e:?}")))?;
        Ok(LtGemm {
            handle,
            stream: stream.cu_stream() as sys::cudaStream_t,
            algos: Mutex::new(HashMap::new()),
            serves: Mutex::new(HashMap::new()),
        })
    }

    /// `C (+)= op(A) op(B)` for bf16 `A` and `B` (row-major, as
    /// [`crate::Backend::matmul`]), checked by the caller, with `workspace`
    /// (address, bytes: the cuBLAS handle's, since calls on one stream never
    /// overlap). `Ok(false)`: no algorithm of this shape's class serves it;
    /// use `cublasGemmEx`.
    pub(crate) fn gemm(
        &self,
        queues: &QueueSet,
        workspace: (u64, usize),
        [a, b, c]: [GpuView; 3],
        dims: MatmulDims,
    ) -> Result<bool> {
        let MatmulDims { m, n, k, .. } = dims;
        // Column-major: C^T [n, m] = op(B)^T [n, k] op(A)^T [k, m].
        let problem = Problem {
            trans: [dims.b_trans, dims.a_trans],
            dims: [n, m, k],
            ab: a.dtype,
            c: c.dtype,
        };
        let [sa, sb, _] = problem.shapes();
        let key = ShapeClass {
            trans: problem.trans,
            dims: problem.dims.map(class),
            ab: a.dtype,
            c: c.dtype,
            accumulate: dims.accumulate,
            align: [
                alignment(b.ptr, sa.0, b.dtype),
                alignment(a.ptr, sb.0, a.dtype),
                alignment(c.ptr, n, c.dtype),
            ],
        };
        let fail = |what: &str, e: lt::CublasError| {
            queues.error(
                &format!(
                    "cuBLASLt {what} for a {m}x{n}x{k} GEMM ({} -> {})",
                    a.dtype, c.dtype
                ),
                format!("{e:?}"),
            )
        };
        let Some(algo) = self
            .algo(key, workspace.1)
            .map_err(|e| fail("heuristic", e))?
        else {
            return Ok(false);
        };
        let desc = problem.desc().map_err(|e| fail("descriptor", e))?;
        let [la, lb, lc] = problem.layouts().map_err(|e| fail("layout", e))?;
        let serves = {
            let mut serves = self.serves.lock().unwrap_or_else(PoisonError::into_inner);
            *serves.entry((key, problem.dims)).or_insert_with(|| {
                let mut result = std::mem::MaybeUninit::uninit();
                // SAFETY: live descriptors and layouts of this problem.
                let status = unsafe {
                    sys::cublasLtMatmulAlgoCheck(
                        self.handle,
                        desc.0,
                        la.0,
                        lb.0,
                        lc.0,
                        lc.0,
                        &algo,
                        result.as_mut_ptr(),
                    )
                };
                // SAFETY: written by a successful check.
                status == cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && unsafe { result.assume_init() }.workspaceSize <= workspace.1
            })
        };
        if !serves {
            return Ok(false);
        }
        let alpha = 1.0f32;
        let beta = if dims.accumulate { 1.0f32 } else { 0.0 };
        // SAFETY: the caller checked that the views hold exactly the
        // elements the dimensions address; the workspace and the stream are
        // this queue's and live; C is also D (in place).
        let status = unsafe {
            sys::cublasLtMatmul(
                self.handle,
                desc.0,
                (&alpha as *const f32).cast(),
                b.ptr as *const c_void,
                la.0,
                a.ptr as *const c_void,
                lb.0,
                (&beta as *const f32).cast(),
                c.ptr as *const c_void,
                lc.0,
                c.ptr as *mut c_void,
                lc.0,
                &algo,
                workspace.0 as *mut c_void,
                workspace.1,
                self.stream,
            )
        };
        match status {
            cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(true),
            cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Ok(false),
            other => Err(fail("matmul", lt::CublasError(other))),
        }
    }

    /// The algorithm of a shape class: the heuristic's first choice for the
    /// class's largest shape within `workspace_bytes`, found once.
    fn algo(
        &self,
        key: ShapeClass,
        workspace_bytes: usize,
    ) -> std::result::Result<Option<cublasLtMatmulAlgo_t>, lt::CublasError> {
        let mut algos = self.algos.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(found) = algos.get(&key) {
            return Ok(*found);
        }
        let problem = Problem {
            trans: key.trans,
            dims: key.dims,
            ab: key.ab,
            c: key.c,
        };
        let desc = problem.desc()?;
        let [la, lb, lc] = problem.layouts()?;
        let pref = Owned(lt::create_matmul_pref()?, lt::destroy_matmul_pref);
        let workspace = workspace_bytes as u64;
        // SAFETY: a live preference; the workspace limit is a u64.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const u64).cast(),
                8,
            )?;
        }
        // Split-K only with partial sums in f32: the other schemes add the
        // parts in C's type. Without this mask an H200's heuristic gave a
        // 5 x 200 x 136 bf16 GEMM on unaligned views an algorithm whose
        // outputs missed the one-rounding bound in 3 of 10 elements.
        let f32_parts =
            sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        // SAFETY: a live preference; the mask is a u32.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                Pref::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                (&f32_parts as *const u32).cast(),
                4,
            )?;
        }
        for (attr, log2) in [
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ]
        .into_iter()
        .zip([key.align[0], key.align[1], key.align[2], key.align[2]])
        {
            let bytes = 1u32 << log2;
            // SAFETY: a live preference; the alignments are u32s.
            unsafe {
                lt::set_matmul_pref_attribute(pref.0, attr, (&bytes as *const u32).cast(), 4)?;
            }
        }
        // SAFETY: live descriptors and layouts of this problem.
        let found = match unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc.0, la.0, lb.0, lc.0, lc.0, pref.0)
        } {
            Ok(result) => Some(result.algo),
            Err(lt::CublasError(cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => None,
            Err(e) => return Err(e),
        };
        algos.insert(key, found);
        Ok(found)
    }
}

impl Drop for LtGemm {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl std::fmt::Debug for LtGemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LtGemm")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_to_a_quarter_octave() {
        assert_eq!(class(1), 1);
        assert_eq!(class(3), 4);
        assert_eq!(class(8), 8);
        assert_eq!(class(9), 16);
        assert_eq!(class(33), 40);
        assert_eq!(class(63), 64);
        assert_eq!(class(64), 64);
        assert_eq!(class(65), 80);
        assert_eq!(class(100), 112);
        assert_eq!(class(1000), 1024);
        assert_eq!(class(1017), 1024);
        assert_eq!(class(1024), 1024);
        assert_eq!(class(1025), 1280);
        assert_eq!(class(1100), 1280);
        assert_eq!(class(2048), 2048);
        assert_eq!(class(6144), 6144);
        assert_eq!(class(32768), 32768);
        // Never smaller than the dimension; from 64 up less than a quarter
        // larger, below it less than 8 larger and at most twice.
        for x in 1..5000 {
            let c = class(x);
            let close = if x >= 64 {
                4 * c < 5 * x
            } else {
                c - x < 8 && c <= 2 * x
            };
            assert!(c >= x && close, "{x} -> {c}");
        }
        // A few classes below 64, not one per dimension.
        let mut small: Vec<usize> = (1..64).map(class).collect();
        small.dedup();
        assert_eq!(small, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]);
    }

    #[test]
    fn alignments_take_the_address_and_the_row_stride() {
        assert_eq!(alignment(0x1000, 2048, DType::Bf16), 8);
        assert_eq!(alignment(0x1002, 2048, DType::Bf16), 1);
        assert_eq!(alignment(0x1000, 3, DType::Bf16), 1);
        assert_eq!(alignment(0x1000, 4, DType::F32), 4);
        assert_eq!(alignment(0x1040, 1024, DType::F32), 6);
    }
}

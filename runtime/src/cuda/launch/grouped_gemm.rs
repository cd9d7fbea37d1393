//! [`Backend::grouped_matmul`](crate::Backend::grouped_matmul)'s bf16
//! problems in one launch on Hopper (`grouped_gemm.cu`): every problem's
//! 128 x 128 tiles of C in one grid, so the MoE experts' small GEMMs fill
//! the GPU together instead of a fraction of it one after another.
//!
//! The problem table travels in the kernel's parameters (no upload, no
//! allocation); a launch takes up to [`MAX_PROBLEMS`] problems of one
//! layout, and a longer group or one of mixed layouts takes several.

use super::{GpuView, HOPPER_SHARED_BYTES, KernelSet, MAX_GRID_X, WGMMA_SHARED_ALIGN, setup_error};
use crate::backend::MatmulDims;
use crate::cuda::kernels::Target;
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use std::ops::Range;

/// Problems one launch takes (`GG_MAX_PROBLEMS`: the table must fit the
/// 4 KiB of a kernel's parameters).
const MAX_PROBLEMS: usize = 48;
/// C's tile a block computes (`GG_TILE_M`, `GG_TILE_N`).
const TILE_M: usize = 128;
const TILE_N: usize = 128;
/// `GG_THREADS`: two warpgroups.
const THREADS: u32 = 256;
/// `GG_STAGES`: K-steps staged at once.
const STAGES: usize = 6;
/// Dynamic shared memory: `GG_STAGES` stages of a 128 x 64 bf16 tile of
/// each operand, and room to align the first to the swizzle's atom.
const SHARED_BYTES: usize = STAGES * 2 * TILE_M * 64 * 2 + WGMMA_SHARED_ALIGN;
/// A problem's flags (`GG_ACCUMULATE`, `GG_C_F32`).
const ACCUMULATE: u32 = 1;
const C_F32: u32 = 2;
const _: () = assert!(SHARED_BYTES <= HOPPER_SHARED_BYTES);

/// The entry points, indexed by `2 * a_trans + b_trans`.
const KERNELS: [&str; 4] = [
    "grouped_gemm_wgmma_nn",
    "grouped_gemm_wgmma_nt",
    "grouped_gemm_wgmma_tn",
    "grouped_gemm_wgmma_tt",
];

fn kernel_of(dims: &MatmulDims) -> usize {
    2 * usize::from(dims.a_trans) + usize::from(dims.b_trans)
}

/// One problem as the kernel reads it (`GroupedProblem`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ProblemArg {
    a: u64,
    b: u64,
    c: u64,
    m: u32,
    n: u32,
    k: u32,
    flags: u32,
}

/// One launch's problems and where each one's tiles start
/// (`GroupedProblems`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ProblemsArg {
    problem: [ProblemArg; MAX_PROBLEMS],
    first_tile: [u32; MAX_PROBLEMS + 1],
    count: u32,
}

// SAFETY: plain data, laid out (`repr(C)`) as `GroupedProblems` in
// grouped_gemm.cu: three u64 and four u32 a problem, then u32s.
unsafe impl DeviceRepr for ProblemsArg {}

/// Tiles of C a problem has.
fn tiles(dims: &MatmulDims) -> usize {
    dims.m.div_ceil(TILE_M) * dims.n.div_ceil(TILE_N)
}

/// Whether the grouped kernel takes a problem on `target`: Hopper; bf16
/// A and B and a bf16 or f32 C, each 16-byte aligned; something to
/// compute (m, n and k above zero; an empty K is the plain path's); the
/// contiguous dimension of every stored operand a multiple of 8, since
/// tiles are fetched 16 bytes at a time (k for a K-major operand, m or n
/// for an MN-major one, n for C); and dimensions in the kernel's u32s.
pub fn grouped_gemm_takes(
    target: Target,
    a: &GpuView,
    b: &GpuView,
    c: &GpuView,
    dims: &MatmulDims,
) -> bool {
    let MatmulDims { m, n, k, .. } = *dims;
    let a_inner = if dims.a_trans { m } else { k };
    let b_inner = if dims.b_trans { k } else { n };
    target == Target::HOPPER
        && a.dtype == DType::Bf16
        && b.dtype == DType::Bf16
        && matches!(c.dtype, DType::Bf16 | DType::F32)
        && [a, b, c].iter().all(|v| v.ptr.is_multiple_of(16))
        && m > 0
        && n > 0
        && k > 0
        && [a_inner, b_inner, n].iter().all(|d| d.is_multiple_of(8))
        && [m, n, k].iter().all(|&d| u32::try_from(d).is_ok())
        && u32::try_from(tiles(dims)).is_ok()
}

/// The launches of one layout's problems (given each one's tile count):
/// consecutive runs of at most [`MAX_PROBLEMS`] problems whose tiles fit
/// one grid.
fn launches(tile_counts: &[usize]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut grid) = (0, 0usize);
    for (i, &t) in tile_counts.iter().enumerate() {
        if i > start && (i - start == MAX_PROBLEMS || grid + t > MAX_GRID_X) {
            out.push(start..i);
            (start, grid) = (i, 0);
        }
        grid += t;
    }
    if start < tile_counts.len() {
        out.push(start..tile_counts.len());
    }
    out
}

/// Lets the grouped kernels take their dynamic shared memory (past the 48
/// KiB a launch gets without asking). False off Hopper, or where the
/// device cannot give it: the grouped problems then take cuBLAS.
pub(super) fn reserve_shared_memory(
    functions: &HashMap<&'static str, CudaFunction>,
    target: Target,
) -> bool {
    target == Target::HOPPER
        && KERNELS.iter().all(|name| {
            functions.get(name).is_some_and(|f| {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    SHARED_BYTES as i32,
                )
                .is_ok()
            })
        })
}

impl KernelSet {
    /// Whether [`KernelSet::grouped_gemm`] runs on this device.
    pub fn has_grouped_gemm(&self) -> bool {
        self.grouped_gemm
    }

    /// Enqueues `problems` (`A`, `B`, `C`, dims each; every one taken by
    /// [`grouped_gemm_takes`], their `C`s disjoint, checked by the caller
    /// as `grouped_matmul` checks them) on `stream`: one launch for each
    /// layout present, more past [`MAX_PROBLEMS`].
    pub fn grouped_gemm(
        &self,
        stream: &CudaStream,
        problems: &[(GpuView, GpuView, GpuView, MatmulDims)],
    ) -> Result<()> {
        if !self.grouped_gemm {
            return Err(setup_error(
                "the grouped GEMM kernels did not load on this device (they need a Hopper GPU \
                 and 193 KiB of shared memory a block); `--expert-gemm cublas` runs the \
                 experts without them",
            ));
        }
        for (kernel, name) in KERNELS.iter().enumerate() {
            let mine: Vec<&(GpuView, GpuView, GpuView, MatmulDims)> = problems
                .iter()
                .filter(|(_, _, _, d)| kernel_of(d) == kernel)
                .collect();
            let counts: Vec<usize> = mine.iter().map(|(_, _, _, d)| tiles(d)).collect();
            for range in launches(&counts) {
                let mut arg = ProblemsArg {
                    problem: [ProblemArg::default(); MAX_PROBLEMS],
                    first_tile: [0; MAX_PROBLEMS + 1],
                    count: range.len() as u32,
                };
                let mut grid = 0usize;
                for (slot, &&(a, b, c, d)) in mine[range.clone()].iter().enumerate() {
                    if !grouped_gemm_takes(self.target, &a, &b, &c, &d) {
                        return Err(RuntimeError::InvalidArgument(format!(
                            "{name}: problem {m}x{n}x{k} ({} x {} -> {}) is not one the grouped \
                             kernel takes (bf16 A and B, 16-byte aligned views, contiguous \
                             dimensions in multiples of 8); pass only problems \
                             `grouped_gemm_takes` accepts and give the rest to cuBLAS",
                            a.dtype,
                            b.dtype,
                            c.dtype,
                            m = d.m,
                            n = d.n,
                            k = d.k
                        )));
                    }
                    arg.first_tile[slot] = grid as u32;
                    grid += counts[range.start + slot];
                    arg.problem[slot] = ProblemArg {
                        a: a.ptr,
                        b: b.ptr,
                        c: c.ptr,
                        // In range: `grouped_gemm_takes` checked them.
                        m: d.m as u32,
                        n: d.n as u32,
                        k: d.k as u32,
                        flags: if d.accumulate { ACCUMULATE } else { 0 }
                            | if c.dtype == DType::F32 { C_F32 } else { 0 },
                    };
                }
                arg.first_tile[range.len()] = grid as u32;
                let config = LaunchConfig {
                    grid_dim: (grid as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: SHARED_BYTES as u32,
                };
                let mut builder = stream.launch_builder(self.function(name)?);
                builder.arg(&arg);
                // SAFETY: every problem's views hold exactly the elements
                // its dims address (checked by the caller), the kernel
                // reads A and B and writes C inside them, and C's are
                // disjoint.
                unsafe { builder.launch(config) }
                    .map_err(|e| self.device_error(&format!("launching {name}"), e))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(dtype: DType) -> GpuView {
        GpuView::new(1 << 20, 1, dtype)
    }

    fn dims(m: usize, n: usize, k: usize, a_trans: bool, b_trans: bool) -> MatmulDims {
        MatmulDims {
            m,
            n,
            k,
            a_trans,
            b_trans,
            accumulate: false,
        }
    }

    #[test]
    fn the_problem_table_has_the_kernels_layout() {
        // GroupedProblem: 3 x u64 + 4 x u32; GroupedProblems: the table,
        // 49 tile starts and the count (2,120 bytes, under 4 KiB).
        assert_eq!(std::mem::size_of::<ProblemArg>(), 40);
        assert_eq!(std::mem::offset_of!(ProblemsArg, first_tile), 40 * 48);
        assert_eq!(std::mem::offset_of!(ProblemsArg, count), 40 * 48 + 4 * 49);
        assert!(std::mem::size_of::<ProblemsArg>() <= 4096);
        let source = crate::cuda::kernels::SOURCES
            .iter()
            .find(|s| s.file == "grouped_gemm.cu")
            .expect("grouped_gemm.cu is listed");
        for (define, value) in [
            ("GG_MAX_PROBLEMS", MAX_PROBLEMS),
            ("GG_TILE_M", TILE_M),
            ("GG_TILE_N", TILE_N),
            ("GG_THREADS", THREADS as usize),
            ("GG_STAGES", STAGES),
            ("GG_ACCUMULATE", ACCUMULATE as usize),
            ("GG_C_F32", C_F32 as usize),
        ] {
            let line = format!("#define {define} {value}");
            let found = source
                .text
                .lines()
                .any(|l| l.trim_end().trim_end_matches('u') == line);
            assert!(found, "grouped_gemm.cu should say `{line}`");
        }
        assert_eq!(KERNELS.to_vec(), source.entry_points.to_vec());
    }

    #[test]
    fn the_kernel_takes_hopper_bf16_problems_with_aligned_rows() {
        let (bf, f) = (view(DType::Bf16), view(DType::F32));
        let fwd = dims(1000, 1024, 2048, false, true);
        let wgrad = dims(1024, 2048, 1001, true, false);
        assert!(grouped_gemm_takes(Target::HOPPER, &bf, &bf, &bf, &fwd));
        // The weight gradient: an odd row count is K, the rows of both
        // MN-major operands, which are staged row by row.
        assert!(grouped_gemm_takes(Target::HOPPER, &bf, &bf, &f, &wgrad));
        assert!(!grouped_gemm_takes(Target::PORTABLE, &bf, &bf, &bf, &fwd));
        assert!(!grouped_gemm_takes(Target::HOPPER, &f, &f, &f, &fwd));
        let odd = GpuView::new((1 << 20) + 2, 1, DType::Bf16);
        assert!(!grouped_gemm_takes(Target::HOPPER, &odd, &bf, &bf, &fwd));
        // The contiguous dimension of each operand: k for a K-major A, m
        // for an MN-major one; n for C.
        assert!(!grouped_gemm_takes(
            Target::HOPPER,
            &bf,
            &bf,
            &bf,
            &dims(8, 8, 12, false, true)
        ));
        assert!(grouped_gemm_takes(
            Target::HOPPER,
            &bf,
            &bf,
            &bf,
            &dims(5, 8, 16, false, true)
        ));
        assert!(!grouped_gemm_takes(
            Target::HOPPER,
            &bf,
            &bf,
            &bf,
            &dims(5, 8, 16, true, true)
        ));
        assert!(!grouped_gemm_takes(
            Target::HOPPER,
            &bf,
            &bf,
            &bf,
            &dims(8, 12, 16, false, false)
        ));
        assert!(!grouped_gemm_takes(
            Target::HOPPER,
            &bf,
            &bf,
            &bf,
            &dims(8, 8, 0, false, true)
        ));
        assert!(!grouped_gemm_takes(
            Target::HOPPER,
            &bf,
            &bf,
            &bf,
            &dims(0, 8, 8, false, true)
        ));
    }

    #[test]
    fn launches_split_at_the_table_size_and_keep_order() {
        assert!(launches(&[]).is_empty());
        assert_eq!(launches(&[3, 1, 4]), vec![0..3]);
        let many = vec![1; 2 * MAX_PROBLEMS + 5];
        assert_eq!(
            launches(&many),
            vec![
                0..MAX_PROBLEMS,
                MAX_PROBLEMS..2 * MAX_PROBLEMS,
                2 * MAX_PROBLEMS..2 * MAX_PROBLEMS + 5
            ]
        );
        // A grid past CUDA's limit splits too.
        assert_eq!(launches(&[MAX_GRID_X, 1, 2]), vec![0..1, 1..3]);
    }

    #[test]
    fn a_layout_picks_its_entry_point() {
        assert_eq!(
            KERNELS[kernel_of(&dims(1, 1, 1, false, false))],
            "grouped_gemm_wgmma_nn"
        );
        assert_eq!(
            KERNELS[kernel_of(&dims(1, 1, 1, false, true))],
            "grouped_gemm_wgmma_nt"
        );
        assert_eq!(
            KERNELS[kernel_of(&dims(1, 1, 1, true, false))],
            "grouped_gemm_wgmma_tn"
        );
        assert_eq!(
            KERNELS[kernel_of(&dims(1, 1, 1, true, true))],
            "grouped_gemm_wgmma_tt"
        );
        assert_eq!(tiles(&dims(129, 256, 7, false, false)), 4);
    }
}

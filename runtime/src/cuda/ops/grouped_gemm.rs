//! [`Backend::grouped_matmul`](crate::Backend::grouped_matmul)'s bf16
//! problems in one launch on Hopper (`grouped_gemm.cu`): every problem's
//! 128 x 256 tiles of C shared out among one persistent block an SM, so
//! the MoE experts' small GEMMs fill the GPU together instead of a
//! fraction of it one after another.
//!
//! The problem table and each operand's tensor map (encoded here, on the
//! host) travel in the kernel's parameters (no upload, no allocation); a
//! launch takes up to `MAX_PROBLEMS` problems of one layout, and a longer
//! group or one of mixed layouts takes several.

use crate::backend::MatmulDims;
use crate::cuda::kernels::Target;
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::reserve_dynamic_shared;
use crate::cuda::launch::tensor_map::tiled_map;
use crate::cuda::launch::{
    GpuView, HOPPER_SHARED_BYTES, KernelSet, MAX_GRID_X, WGMMA_SHARED_ALIGN, setup_error,
};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use cudarc::driver::sys::{self, CUtensorMap};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig};
use std::collections::HashMap;
use std::ops::Range;

/// Problems one launch takes (`GG_MAX_PROBLEMS`: the table and three
/// tensor maps a problem must fit the 32 KiB of a kernel's parameters).
const MAX_PROBLEMS: usize = 32;
/// C's tile a block computes at a time (`GG_TILE_M`, `GG_TILE_N`).
const TILE_M: usize = 128;
const TILE_N: usize = 256;
/// `GG_THREADS`: two consumer warpgroups and a producer warp.
const THREADS: u32 = 288;
/// `GG_TILE_K`: K's step, 128 bytes of bf16 (the swizzle's row).
const TILE_K: usize = 64;
/// `GG_STAGES`: K-steps in the ring of buffers.
const STAGES: usize = 4;
/// Dynamic shared memory: `GG_STAGES` stages of a 128 x 64 bf16 tile of
/// A and a 256 x 64 one of B, two boxes of C a consumer warpgroup, two
/// 8-byte barriers a stage, and room to align the first to the swizzle's
/// atom. One block fills an SM.
const SHARED_BYTES: usize = STAGES * (TILE_M + TILE_N) * TILE_K * 2
    + 4 * C_BOX_BYTES as usize
    + STAGES * 16
    + WGMMA_SHARED_ALIGN;
/// A problem's flags (`GG_ACCUMULATE`, `GG_C_F32`, `GG_C_MAP`).
const ACCUMULATE: u32 = 1;
const C_F32: u32 = 2;
const C_MAP: u32 = 4;
const _: () = assert!(SHARED_BYTES <= HOPPER_SHARED_BYTES);
/// A box of C that TMA stores or adds: 128 bytes of columns (64 bf16 or
/// 32 f32) by a warpgroup's 64 rows.
const C_BOX_BYTES: u32 = 128 * C_BOX_ROWS;
const C_BOX_ROWS: u32 = 64;

/// The entry points, indexed by `2 * a_trans + b_trans`.
const KERNELS: [&str; 4] = [
    "grouped_gemm_wgmma_nn",
    "grouped_gemm_wgmma_nt",
    "grouped_gemm_wgmma_tn",
    "grouped_gemm_wgmma_tt",
];
/// The segmented entry points: rows (indexed by `b_trans`), then depth.
const ROWS_KERNELS: [&str; 2] = ["grouped_gemm_rows_nn", "grouped_gemm_rows_nt"];
const DEPTH_KERNEL: &str = "grouped_gemm_depth_tn";

fn kernel_of(dims: &MatmulDims) -> usize {
    2 * usize::from(dims.a_trans) + usize::from(dims.b_trans)
}

/// One problem as the kernel reads it (`GroupedProblem`); its operands
/// are read through their tensor maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ProblemArg {
    c: u64,
    m: u32,
    n: u32,
    k: u32,
    flags: u32,
}

/// One launch's problems, their operands' tensor maps (A's of problem `p`
/// at `3 p`, B's at `3 p + 1`, and C's at `3 p + 2` where it is added to
/// through TMA) and where each one's tiles start (`GroupedProblems`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ProblemsArg {
    map: [CUtensorMap; 3 * MAX_PROBLEMS],
    problem: [ProblemArg; MAX_PROBLEMS],
    first_tile: [u32; MAX_PROBLEMS + 1],
    count: u32,
    split_from: u32,
    /// A segmented launch's: each problem's segment, the device's u32 rows
    /// a segment and how many, and the persistent grid.
    segment: [u32; MAX_PROBLEMS],
    rows: u64,
    segments: u32,
    blocks: u32,
}

impl ProblemsArg {
    fn empty(count: usize) -> Self {
        ProblemsArg {
            map: [CUtensorMap { opaque: [0; 16] }; 3 * MAX_PROBLEMS],
            problem: [ProblemArg::default(); MAX_PROBLEMS],
            first_tile: [0; MAX_PROBLEMS + 1],
            count: count as u32,
            split_from: 0,
            segment: [0; MAX_PROBLEMS],
            rows: 0,
            segments: 0,
            blocks: 0,
        }
    }
}

/// A [`Backend::segmented_matmul`](crate::Backend::segmented_matmul)
/// problem on the GPU: the shared operands and the per-segment ones.
#[derive(Clone, Debug)]
pub enum SegmentedOperands {
    Rows {
        a: GpuView,
        b: Vec<GpuView>,
        c: GpuView,
        dims: MatmulDims,
    },
    Depth {
        a: GpuView,
        b: GpuView,
        c: Vec<GpuView>,
        dims: MatmulDims,
    },
}

impl SegmentedOperands {
    /// Segment `e`'s operands and dims as the kernel's checks see them: the
    /// shared operands whole, with the whole problem's dims (what its maps
    /// span).
    fn segment(&self, e: usize) -> (GpuView, GpuView, GpuView, MatmulDims) {
        match self {
            SegmentedOperands::Rows { a, b, c, dims } => (*a, b[e], *c, *dims),
            SegmentedOperands::Depth { a, b, c, dims } => (*a, *b, c[e], *dims),
        }
    }

    fn segments(&self) -> usize {
        match self {
            SegmentedOperands::Rows { b, .. } => b.len(),
            SegmentedOperands::Depth { c, .. } => c.len(),
        }
    }

    /// Whether the segmented kernels take every segment.
    pub fn taken(&self, target: Target) -> bool {
        (0..self.segments()).all(|e| {
            let (a, b, c, d) = self.segment(e);
            grouped_gemm_takes(target, &a, &b, &c, &d)
        })
    }
}

// SAFETY: plain data, laid out (`repr(C)`) as `GroupedProblems` in
// grouped_gemm.cu: 128-byte aligned maps of 16 u64, then one u64 and four
// u32 a problem, then u32s, a u64 and two u32s.
unsafe impl DeviceRepr for ProblemsArg {}

/// Tiles of C a problem has.
fn tiles(dims: &MatmulDims) -> usize {
    dims.m.div_ceil(TILE_M) * dims.n.div_ceil(TILE_N)
}

/// The first of a launch's `tiles` that `blocks` persistent blocks compute
/// as two halves each (`GroupedProblems::split_from`): the tiles of a last
/// round that would leave at least half the blocks idle, so that round
/// takes half as long. `tiles` when no split pays.
fn split_from(tiles: usize, blocks: usize) -> usize {
    let last_round = tiles % blocks;
    if last_round > 0 && 2 * last_round <= blocks {
        tiles - last_round
    } else {
        tiles
    }
}

/// The tensor map of a stored array of `rows` rows of `inner` contiguous
/// elements of `dtype` (bf16 or f32) at `ptr`, in boxes of `box_inner`
/// elements (128 bytes, the swizzle's row) by `box_rows` rows.
/// `grouped_gemm_takes` has checked what TMA needs: a 16-byte aligned base
/// and a row of a multiple of 16 bytes.
fn tensor_map(
    ptr: u64,
    dtype: DType,
    inner: usize,
    rows: usize,
    box_inner: u32,
    box_rows: u32,
) -> Result<CUtensorMap> {
    tiled_map(
        ptr,
        dtype,
        [inner as u64, rows as u64],
        [box_inner, box_rows],
    )
    .map_err(|why| {
        setup_error(format!(
            "{why}; the cuBLAS expert GEMMs run the experts without the grouped kernel"
        ))
    })
}

/// The tensor maps of a problem's A and B: a K-major operand is read in
/// boxes of its tile's 128 (A) or 256 (B) rows (M or N) of 64 K-elements,
/// an MN-major one in boxes of 64 rows (K) of 64 M- or N-elements, two
/// (A) or four (B) a K-step.
fn operand_maps(a: &GpuView, b: &GpuView, dims: &MatmulDims) -> Result<[CUtensorMap; 2]> {
    let MatmulDims { m, n, k, .. } = *dims;
    let bf = DType::Bf16;
    let a_map = if dims.a_trans {
        tensor_map(a.ptr, bf, m, k, TILE_K as u32, TILE_K as u32)?
    } else {
        tensor_map(a.ptr, bf, k, m, TILE_K as u32, TILE_M as u32)?
    };
    let b_map = if dims.b_trans {
        tensor_map(b.ptr, bf, k, n, TILE_K as u32, TILE_N as u32)?
    } else {
        tensor_map(b.ptr, bf, n, k, TILE_K as u32, TILE_K as u32)?
    };
    Ok([a_map, b_map])
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
/// consecutive runs of at most [`MAX_PROBLEMS`] problems whose units (at
/// most two a tile) the kernel's u32 indices count.
fn launches(tile_counts: &[usize]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut grid) = (0, 0usize);
    for (i, &t) in tile_counts.iter().enumerate() {
        if i > start && (i - start == MAX_PROBLEMS || grid + t > MAX_GRID_X / 2) {
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
/// KiB a launch gets without asking) and returns their persistent grid:
/// one block for each of the device's SMs. None off Hopper, or where the
/// device cannot give it: the grouped problems then take cuBLAS.
pub(super) fn reserve_shared_memory(
    context: &CudaContext,
    functions: &HashMap<&'static str, CudaFunction>,
    target: Target,
) -> Option<u32> {
    let reserved = target == Target::HOPPER
        && KERNELS
            .iter()
            .chain(&ROWS_KERNELS)
            .chain([&DEPTH_KERNEL])
            .all(|name| {
                functions
                    .get(name)
                    .is_some_and(|f| reserve_dynamic_shared(f, SHARED_BYTES))
            });
    let sms = context
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .ok()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n > 0);
    sms.filter(|_| reserved)
}

impl KernelSet {
    /// Whether [`KernelSet::grouped_gemm`] runs on this device.
    pub fn has_grouped_gemm(&self) -> bool {
        self.grouped_gemm_grid.is_some()
    }

    /// Launches entry point `name` on `arg`'s problems: `units` units of
    /// work walked by at most `persistent_grid` blocks (one an SM).
    ///
    /// # Safety
    /// Every problem in `arg` addresses only memory its views hold, and
    /// its C's are disjoint.
    unsafe fn launch_units(
        &self,
        stream: &CudaStream,
        name: &'static str,
        arg: &ProblemsArg,
        units: usize,
        persistent_grid: u32,
    ) -> Result<()> {
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from(units)
                    .unwrap_or(u32::MAX)
                    .min(persistent_grid),
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SHARED_BYTES as u32,
        };
        let mut builder = KernelArgs::new(stream, self.function(name)?);
        builder.arg(arg);
        // SAFETY: the caller's contract.
        unsafe { builder.launch(config, self.dependent_launch()) }
            .map_err(|e| self.device_error(&format!("launching {name}"), e))
    }

    /// Enqueues `problems` (`A`, `B`, `C`, dims each; every one taken by
    /// [`grouped_gemm_takes`], their `C`s disjoint, checked by the caller
    /// as `grouped_matmul` checks them) on `stream`: one launch for each
    /// layout present, more past `MAX_PROBLEMS`.
    pub fn grouped_gemm(
        &self,
        stream: &CudaStream,
        problems: &[(GpuView, GpuView, GpuView, MatmulDims)],
    ) -> Result<()> {
        let Some(persistent_grid) = self.grouped_gemm_grid else {
            return Err(setup_error(
                "the grouped GEMM kernels did not load on this device (they need a Hopper GPU \
                 and 225 KiB of shared memory a block); the cuBLAS expert GEMMs run the \
                 experts without them",
            ));
        };
        for (kernel, name) in KERNELS.iter().enumerate() {
            let mine: Vec<&(GpuView, GpuView, GpuView, MatmulDims)> = problems
                .iter()
                .filter(|(_, _, _, d)| kernel_of(d) == kernel)
                .collect();
            let counts: Vec<usize> = mine.iter().map(|(_, _, _, d)| tiles(d)).collect();
            for range in launches(&counts) {
                let mut arg = ProblemsArg::empty(range.len());
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
                    [arg.map[3 * slot], arg.map[3 * slot + 1]] = operand_maps(&a, &b, &d)?;
                    (arg.map[3 * slot + 2], arg.problem[slot]) = c_of(&c, &d)?;
                }
                arg.first_tile[range.len()] = grid as u32;
                // One block an SM walks the units (fewer where there are
                // fewer): `grid` tiles, split or not, fit a u32 (`launches`).
                let split = split_from(grid, persistent_grid as usize);
                arg.split_from = split as u32;
                let units = grid + (grid - split);
                // SAFETY: every problem's views hold exactly the elements
                // its dims address (checked by the caller), the kernel
                // reads A and B and writes C inside them, and C's are
                // disjoint.
                unsafe { self.launch_units(stream, name, &arg, units, persistent_grid) }?;
            }
        }
        Ok(())
    }
}

/// A problem's C: its tensor map where C goes through TMA, and its row of
/// the problem table.
fn c_of(c: &GpuView, d: &MatmulDims) -> Result<(CUtensorMap, ProblemArg)> {
    // C through TMA: stored, or an f32 C added to in L2 (TMA reduce-add), so
    // the SMs never read C. A bf16 C added to is read and written by the
    // consumers: L2 would add the product rounded to bf16, not round the
    // sum once.
    let through_map = !d.accumulate || c.dtype == DType::F32;
    let map = if through_map {
        let columns = 128 / c.dtype.bytes() as u32;
        tensor_map(c.ptr, c.dtype, d.n, d.m, columns, C_BOX_ROWS)?
    } else {
        CUtensorMap { opaque: [0; 16] }
    };
    let problem = ProblemArg {
        c: c.ptr,
        // In range: `grouped_gemm_takes` checked them.
        m: d.m as u32,
        n: d.n as u32,
        k: d.k as u32,
        flags: if d.accumulate { ACCUMULATE } else { 0 }
            | if c.dtype == DType::F32 { C_F32 } else { 0 }
            | if through_map { C_MAP } else { 0 },
    };
    Ok((map, problem))
}

/// Tiles a rows launch may have at most: its problems' segments split
/// their rows `total` between them, so their tiles along M number at most
/// `ceil(total / TILE_M)` plus one partial tile a segment.
fn worst_rows_tiles(segments: &[(usize, MatmulDims)]) -> usize {
    // Segments of one shared problem share its rows: group by problem.
    let mut tiles = 0;
    let mut i = 0;
    while i < segments.len() {
        let (problem, d) = segments[i];
        let run = segments[i..]
            .iter()
            .take_while(|(p, _)| *p == problem)
            .count();
        tiles += (d.m.div_ceil(TILE_M) + run) * d.n.div_ceil(TILE_N);
        i += run;
    }
    tiles
}

impl KernelSet {
    /// Enqueues a [`Backend::segmented_matmul`](crate::Backend::segmented_matmul)
    /// (every problem's segments taken by [`SegmentedOperands::taken`],
    /// checked by the caller) on `stream`: `rows` is the device's u32
    /// count a segment. Each launch takes up to `MAX_PROBLEMS` segments
    /// of one entry point; the kernels read the counts themselves, so
    /// nothing here waits for them.
    pub fn segmented_gemm(
        &self,
        stream: &CudaStream,
        rows: &GpuView,
        problems: &[SegmentedOperands],
    ) -> Result<()> {
        let Some(persistent_grid) = self.grouped_gemm_grid else {
            return Err(setup_error(
                "the grouped GEMM kernels did not load on this device (they need a Hopper GPU \
                 and 225 KiB of shared memory a block); `--expert-gemm cublas` runs the \
                 experts without them",
            ));
        };
        let segments = rows.len;
        // (problem, segment) pairs by entry point, problems in order.
        let mut by_kernel: [Vec<(usize, usize)>; 3] = Default::default();
        for (p, problem) in problems.iter().enumerate() {
            let kernel = match problem {
                SegmentedOperands::Rows { dims, .. } => usize::from(dims.b_trans),
                SegmentedOperands::Depth { .. } => 2,
            };
            // Nothing to compute: no rows (a rows problem writes nothing, a
            // depth one adds nothing) or an empty C.
            let d = problem.segment(0).3;
            if d.m == 0 || d.n == 0 || d.k == 0 {
                continue;
            }
            by_kernel[kernel].extend((0..segments).map(|e| (p, e)));
        }
        for (kernel, pairs) in by_kernel.iter().enumerate() {
            let name = if kernel < 2 {
                ROWS_KERNELS[kernel]
            } else {
                DEPTH_KERNEL
            };
            for chunk in pairs.chunks(MAX_PROBLEMS) {
                let mut arg = ProblemsArg::empty(chunk.len());
                arg.rows = rows.ptr;
                arg.segments = segments as u32;
                arg.blocks = persistent_grid;
                let mut grid = 0usize;
                let mut shapes = Vec::with_capacity(chunk.len());
                for (slot, &(p, e)) in chunk.iter().enumerate() {
                    let (a, b, c, d) = problems[p].segment(e);
                    if !grouped_gemm_takes(self.target, &a, &b, &c, &d) {
                        return Err(RuntimeError::InvalidArgument(format!(
                            "{name}: problem {p} ({m}x{n}x{k}) is not one the grouped kernel \
                             takes; run it as host segments instead",
                            m = d.m,
                            n = d.n,
                            k = d.k
                        )));
                    }
                    arg.segment[slot] = e as u32;
                    arg.first_tile[slot] = grid as u32;
                    grid += tiles(&d);
                    shapes.push((p, d));
                    [arg.map[3 * slot], arg.map[3 * slot + 1]] = operand_maps(&a, &b, &d)?;
                    (arg.map[3 * slot + 2], arg.problem[slot]) = c_of(&c, &d)?;
                }
                arg.first_tile[chunk.len()] = grid as u32;
                // A depth launch's tiles are the table's (C is whole a
                // segment); a rows launch counts its own on the device, at
                // most `worst` of them.
                let worst = if kernel < 2 {
                    worst_rows_tiles(&shapes)
                } else {
                    arg.split_from = split_from(grid, persistent_grid as usize) as u32;
                    grid
                };
                if u32::try_from(2 * worst).is_err() || 2 * worst > MAX_GRID_X {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "{name}: {worst} tiles overflow the kernel's indices"
                    )));
                }
                let units = if kernel < 2 {
                    2 * worst
                } else {
                    2 * grid - arg.split_from as usize
                };
                if units == 0 {
                    continue;
                }
                // SAFETY: every segment's views hold the elements its dims
                // address (checked by the caller); the kernel clips each
                // segment's rows at the shared operands' and writes C inside
                // them; C's are disjoint (checked by the caller).
                unsafe { self.launch_units(stream, name, &arg, units, persistent_grid) }?;
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
        // GroupedProblems: 96 maps of 128 bytes, then GroupedProblem's
        // u64 + 4 x u32 a problem, 33 tile starts and the count (13,192
        // bytes, 13,312 with the maps' alignment: under the 32 KiB of a
        // kernel's parameters).
        assert_eq!(std::mem::size_of::<CUtensorMap>(), 128);
        assert_eq!(std::mem::align_of::<CUtensorMap>(), 128);
        assert_eq!(std::mem::size_of::<ProblemArg>(), 24);
        assert_eq!(std::mem::offset_of!(ProblemsArg, problem), 128 * 96);
        assert_eq!(
            std::mem::offset_of!(ProblemsArg, first_tile),
            128 * 96 + 24 * 32
        );
        assert_eq!(
            std::mem::offset_of!(ProblemsArg, count),
            128 * 96 + 24 * 32 + 4 * 33
        );
        assert_eq!(
            std::mem::offset_of!(ProblemsArg, split_from),
            128 * 96 + 24 * 32 + 4 * 34
        );
        // The segmented launch's fields after them, `rows` padded to its
        // 8-byte alignment as C pads it.
        let segment = 128 * 96 + 24 * 32 + 4 * 35;
        assert_eq!(std::mem::offset_of!(ProblemsArg, segment), segment);
        assert_eq!(
            std::mem::offset_of!(ProblemsArg, rows),
            segment + 4 * 32 + 4
        );
        assert_eq!(
            std::mem::offset_of!(ProblemsArg, segments),
            segment + 4 * 32 + 12
        );
        assert_eq!(
            std::mem::offset_of!(ProblemsArg, blocks),
            segment + 4 * 32 + 16
        );
        assert!(std::mem::size_of::<ProblemsArg>() <= 32764);
        let source = crate::cuda::launch::source_with_defines(
            "grouped_gemm.cu",
            &[
                ("GG_MAX_PROBLEMS", MAX_PROBLEMS),
                ("GG_TILE_M", TILE_M),
                ("GG_TILE_N", TILE_N),
                ("GG_THREADS", THREADS as usize),
                ("GG_TILE_K", TILE_K),
                ("GG_STAGES", STAGES),
                ("GG_ACCUMULATE", ACCUMULATE as usize),
                ("GG_C_F32", C_F32 as usize),
                ("GG_C_MAP", C_MAP as usize),
            ],
        );
        // The table launches, then the segmented ones, in the source's order.
        let launched: Vec<&str> = KERNELS
            .into_iter()
            .chain(ROWS_KERNELS)
            .chain([DEPTH_KERNEL])
            .collect();
        assert_eq!(launched, source.entry_points.to_vec());
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
        assert_eq!(launches(&[MAX_GRID_X / 2, 1, 2]), vec![0..1, 1..3]);
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
        assert_eq!(tiles(&dims(129, 512, 7, false, false)), 4);
    }

    #[test]
    fn a_thin_last_round_is_split_in_halves() {
        // The benchmark's fc1 forward: 548 tiles on 132 SMs leave 20 for a
        // fifth round, which runs as 40 halves.
        assert_eq!(split_from(548, 132), 528);
        // A full last round, or one whose halves would need two rounds:
        // no split.
        assert_eq!(split_from(528, 132), 528);
        assert_eq!(split_from(600, 132), 600);
        assert_eq!(split_from(594, 132), 528);
        // Fewer tiles than blocks: halves where they fit one round.
        assert_eq!(split_from(66, 132), 0);
        assert_eq!(split_from(67, 132), 67);
        assert_eq!(split_from(1, 1), 1);
    }
}

//! The dense kernels on a GPU: [`DenseKernels`] for [`CudaBackend`]
//! (matrix products through cuBLAS, or `grouped_gemm.cu` for a group's
//! bf16 problems on Hopper), and the launchers of the element-wise and
//! reduction kernels on [`KernelSet`] (`elementwise.cu`, `reduce.cu`),
//! which take views `backend::dense`'s checks accepted.

use super::grouped_gemm::{SegmentedOperands, grouped_gemm_takes};
use crate::backend::dense::segments_as_problems;
use crate::backend::{
    Backend, BatchedMatmulDims, CopyCols, DenseKernels, MatmulDims, MatmulProblem, SegmentedMatmul,
};
use crate::cuda::backend::SideStream;
use crate::cuda::blas::{StridedGemm, StridedMatrix};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, column_blocks, dtype_tag, grid_for, per_item, reduce_threads,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, View, ViewMut};
use cudarc::driver::CudaStream;

impl DenseKernels<CudaBuf> for CudaBackend {
    fn matmul_unchecked(
        &self,
        a: View<'_, CudaBuf>,
        b: View<'_, CudaBuf>,
        c: ViewMut<'_, CudaBuf>,
        dims: MatmulDims,
    ) -> Result<()> {
        let (a, b, c) = (self.v(a), self.v(b), self.m(&c));
        self.gemm(a, b, c, dims)
    }

    fn grouped_matmul_unchecked(
        &self,
        problems: Vec<MatmulProblem<View<'_, CudaBuf>, ViewMut<'_, CudaBuf>>>,
    ) -> Result<()> {
        let k = "grouped_matmul";
        let operands: Vec<_> = problems
            .iter()
            .map(|p| (self.v(p.a), self.v(p.b), self.m(&p.c), p.dims))
            .collect();
        disjoint_outputs(k, operands.iter().map(|(_, _, c, _)| *c))?;
        // With the grouped kernel on (Hopper), the bf16 problems it takes
        // run as one launch a layout; the rest go to cuBLAS.
        let kernels = self.k();
        let on = self.grouped_gemm && kernels.has_grouped_gemm();
        let (grouped, rest): (Vec<_>, Vec<_>) = operands
            .into_iter()
            .partition(|(a, b, c, d)| on && grouped_gemm_takes(kernels.target(), a, b, c, d));
        if !grouped.is_empty() {
            kernels.grouped_gemm(self.s(), &grouped)?;
        }
        self.spread_gemms(rest)
    }

    fn batched_matmul_unchecked(
        &self,
        a: View<'_, CudaBuf>,
        b: View<'_, CudaBuf>,
        c: ViewMut<'_, CudaBuf>,
        dims: BatchedMatmulDims,
    ) -> Result<()> {
        let (a, b, c) = (self.v(a), self.v(b), self.m(&c));
        self.gemm_batched(a, b, c, dims)
    }

    fn segmented_matmul_unchecked(
        &self,
        rows: View<'_, CudaBuf>,
        problems: Vec<SegmentedMatmul<View<'_, CudaBuf>, ViewMut<'_, CudaBuf>>>,
    ) -> Result<()> {
        let operands: Vec<SegmentedOperands> = problems
            .iter()
            .map(|p| match p {
                SegmentedMatmul::Rows { a, b, c, dims } => SegmentedOperands::Rows {
                    a: self.v(*a),
                    b: b.iter().map(|v| self.v(*v)).collect(),
                    c: self.m(c),
                    dims: *dims,
                },
                SegmentedMatmul::Depth { a, b, c, dims } => SegmentedOperands::Depth {
                    a: self.v(*a),
                    b: self.v(*b),
                    c: c.iter().map(|v| self.m(v)).collect(),
                    dims: *dims,
                },
            })
            .collect();
        let outs = operands.iter().flat_map(|p| match p {
            SegmentedOperands::Rows { c, .. } => vec![*c],
            SegmentedOperands::Depth { c, .. } => c.clone(),
        });
        disjoint_outputs("segmented_matmul", outs)?;
        let kernels = self.k();
        let on = self.grouped_gemm && kernels.has_grouped_gemm();
        if on && operands.iter().all(|p| p.taken(kernels.target())) {
            return kernels.segmented_gemm(self.s(), &self.v(rows), &operands);
        }
        // Without the grouped kernel (off Hopper, `--expert-gemm cublas`,
        // or problems it does not take), cuBLAS needs every segment's size
        // on the host: one read, then the grouped call of the segments.
        let mut counts = vec![0u32; rows.len()];
        self.download(rows, &mut counts)?;
        let problems = segments_as_problems(&counts, problems)?;
        self.grouped_matmul_unchecked(problems)
    }

    fn axpy_unchecked(
        &self,
        alpha: f32,
        x: View<'_, CudaBuf>,
        y: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k().axpy(self.s(), alpha, self.v(x), self.m(&y))
    }

    fn scale_unchecked(&self, x: ViewMut<'_, CudaBuf>, alpha: f32) -> Result<()> {
        self.k().scale(self.s(), self.m(&x), alpha)
    }

    fn column_sum_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        out: ViewMut<'_, CudaBuf>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.k()
            .column_sum(self.s(), self.v(x), self.m(&out), rows, cols)
    }

    fn accumulate_sum_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        out: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k().accumulate_sum(self.s(), self.v(x), self.m(&out))
    }
}

/// The C views of a grouped call must not overlap: sorted by address, each
/// must end before the next starts (the i-th view is `problems[i].C`).
fn disjoint_outputs(kernel: &str, outs: impl Iterator<Item = GpuView>) -> Result<()> {
    let mut outs: Vec<(u64, u64, usize)> = outs
        .enumerate()
        .map(|(i, c)| (c.ptr, c.ptr + (c.len * c.dtype.bytes()) as u64, i))
        .filter(|(start, end, _)| end > start)
        .collect();
    outs.sort_unstable();
    for pair in outs.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(RuntimeError::InvalidArgument(format!(
                "{kernel}: `problems[{}].C` and `problems[{}].C` overlap; give each \
                 problem an output of its own",
                pair[0].2, pair[1].2
            )));
        }
    }
    Ok(())
}

impl CudaBackend {
    /// Checked, non-overlapping GEMMs (a grouped call's problems): each
    /// exactly the matmul it describes, with the same bits wherever it
    /// runs (an algorithm is a function of the shape, and each stream has
    /// a cuBLAS handle and workspace of its own). Problems with bf16
    /// operands (but for sums into a bf16 C, which `gemm` takes through
    /// scratch on the queue) are dealt, largest first, to whichever of the
    /// queue's stream and its side streams has the fewest FLOPs so far (a
    /// function of the shapes alone); the side streams start after everything the
    /// queue enqueued before, and the queue waits for them before this
    /// returns, so to every later call the group ran on the queue.
    pub(crate) fn spread_gemms(
        &self,
        operands: Vec<(GpuView, GpuView, GpuView, MatmulDims)>,
    ) -> Result<()> {
        let flops = |d: &MatmulDims| d.m as f64 * d.n as f64 * d.k as f64;
        // Sums into bf16 stay on the queue's stream: `gemm` takes them
        // through f32 scratch from the arena, which fences a dropped
        // buffer on the queue's stream alone, not on a side stream.
        let movable = |(a, _, c, d): &(GpuView, GpuView, GpuView, MatmulDims)| {
            a.dtype == DType::Bf16
                && !(c.dtype == DType::Bf16 && d.accumulate)
                && d.m > 0
                && d.n > 0
                && d.k > 0
        };
        let spread = operands.iter().filter(|o| movable(o)).count() >= 2;
        let side = if spread { self.side_streams()? } else { &[] };
        let work: Vec<Option<f64>> = operands
            .iter()
            .map(|o| movable(o).then(|| flops(&o.3)))
            .collect();
        let lane_of = deal(&work, 1 + side.len());
        let used: Vec<&SideStream> = side
            .iter()
            .enumerate()
            .filter(|(l, _)| lane_of.contains(&(l + 1)))
            .map(|(_, s)| s)
            .collect();
        let queues = &self.gpu().queues;
        if !used.is_empty() {
            let fork = queues.take_event()?;
            let forked = queues.record(fork, self.s()).and_then(|()| {
                used.iter()
                    .try_for_each(|s| queues.wait_on(&s.stream, fork))
            });
            queues.give_event(fork);
            forked?;
        }
        let mut launched = Ok(());
        for ((a, b, c, dims), lane) in operands.into_iter().zip(lane_of) {
            launched = match lane {
                0 => self.gemm(a, b, c, dims),
                l => side[l - 1].blas.gemm(queues, a, b, c, dims),
            };
            if launched.is_err() {
                break;
            }
        }
        // Join even after a failed launch: what did launch must finish
        // before the queue's later work reuses its memory.
        for s in used {
            let join = queues.take_event()?;
            let joined = queues
                .record(join, &s.stream)
                .and_then(|()| queues.wait_on(self.s(), join));
            queues.give_event(join);
            joined?;
        }
        launched
    }

    /// One GEMM of checked operands, on this queue.
    pub(crate) fn gemm(&self, a: GpuView, b: GpuView, c: GpuView, dims: MatmulDims) -> Result<()> {
        if dims.m == 0 || dims.n == 0 {
            return Ok(());
        }
        if dims.k == 0 {
            // An empty sum: C = 0, or C unchanged when accumulating.
            return if dims.accumulate {
                Ok(())
            } else {
                self.k().zero(self.s(), c)
            };
        }
        if a.dtype == DType::F32 && c.dtype == DType::Bf16 {
            // cuBLAS has no f32 x f32 -> bf16 GEMM: compute into f32 and
            // round once at the store, as the contract says. The scratch
            // comes from the arena, so a repeated step allocates nothing.
            let scratch = self.alloc_uninit(c.len, DType::F32)?;
            let wide = GpuView::new(scratch.device_ptr(), c.len, DType::F32);
            if dims.accumulate {
                self.k().cast(self.s(), c, wide)?;
            }
            self.queue.blas.gemm(&self.gpu().queues, a, b, wide, dims)?;
            return self.k().cast(self.s(), wide, c);
        }
        if c.dtype == DType::Bf16 && dims.accumulate {
            // cuBLAS's bf16 epilogue rounds the product to bf16 before it
            // adds C (on an H200, sums into bf16 missed by up to 15 ulps of
            // C: a rounding at the product's scale, not C's). The product
            // goes to f32 scratch instead, and `axpy` adds it to C with the
            // contract's one rounding.
            let scratch = self.alloc_uninit(c.len, DType::F32)?;
            let wide = GpuView::new(scratch.device_ptr(), c.len, DType::F32);
            let product = MatmulDims {
                accumulate: false,
                ..dims
            };
            self.queue
                .blas
                .gemm(&self.gpu().queues, a, b, wide, product)?;
            return self.k().axpy(self.s(), 1.0, wide, c);
        }
        self.queue.blas.gemm(&self.gpu().queues, a, b, c, dims)
    }
}

impl CudaBackend {
    /// A strided batch of GEMMs of checked operands, on this queue, with
    /// `gemm`'s precision for every dtype pair: one
    /// `cublasGemmStridedBatchedEx` (strict f32 compute for f32 operands,
    /// f32 accumulation for bf16 ones) writing `C` in place, except where
    /// `gemm` takes a detour through f32 (f32 operands into bf16, sums into
    /// bf16): there the batch's products go to packed f32 scratch in one
    /// call and each matrix is rounded (or added) into `C` once, as `gemm`
    /// does, then copied to its place.
    pub(crate) fn gemm_batched(
        &self,
        a: GpuView,
        b: GpuView,
        c: GpuView,
        dims: BatchedMatmulDims,
    ) -> Result<()> {
        let BatchedMatmulDims { batch, dims: d, .. } = dims;
        let (m, n) = (d.m, d.n);
        if batch == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        let kernels = self.k();
        let per_matrix = m * n;
        // `C`'s matrix `i` as a 2-D copy's destination.
        let place = |i: usize, accumulate: bool| CopyCols {
            rows: m,
            cols: n,
            src_stride: n,
            src_offset: i * per_matrix,
            dst_stride: dims.c.pitch,
            dst_offset: dims.at(2, i, 0, 0),
            accumulate,
        };
        if d.k == 0 {
            // An empty sum: each matrix of C zeroed, or left as it is.
            if d.accumulate {
                return Ok(());
            }
            let zeros = self.alloc_uninit(per_matrix * batch, c.dtype)?;
            let zeros = GpuView::new(zeros.device_ptr(), per_matrix * batch, c.dtype);
            kernels.zero(self.s(), zeros)?;
            for i in 0..batch {
                kernels.copy_cols(self.s(), zeros, c, place(i, false))?;
            }
            return Ok(());
        }
        let matrix = |v: GpuView, which: usize| StridedMatrix {
            ptr: v.ptr,
            dtype: v.dtype,
            // cuBLAS asks for a leading dimension of at least 1 even
            // where no element is addressed with it.
            ld: dims.layouts()[which].pitch.max(1),
            stride: dims.layouts()[which].stride,
        };
        let detour = c.dtype == DType::Bf16 && (a.dtype == DType::F32 || d.accumulate);
        let gemm = |out: StridedMatrix, beta: f32| StridedGemm {
            m,
            n,
            k: d.k,
            a: matrix(a, 0),
            a_trans: d.a_trans,
            b: matrix(b, 1),
            b_trans: d.b_trans,
            c: out,
            alpha: 1.0,
            beta,
            batch,
        };
        let queues = &self.gpu().queues;
        if !detour {
            let beta = if d.accumulate { 1.0 } else { 0.0 };
            // SAFETY: the check bounded every matrix of A, B and C by its
            // view's length; the views are live on this queue's stream.
            return unsafe {
                self.queue
                    .blas
                    .gemm_strided(queues, gemm(matrix(c, 2), beta))
            };
        }
        // The products, packed, in f32 (the scratch from the arena: a
        // repeated step allocates nothing).
        let scratch = self.alloc_uninit(per_matrix * batch, DType::F32)?;
        let wide = GpuView::new(scratch.device_ptr(), per_matrix * batch, DType::F32);
        let packed = StridedMatrix {
            ptr: wide.ptr,
            dtype: DType::F32,
            ld: n,
            stride: per_matrix,
        };
        // SAFETY: as above; the scratch holds `batch` packed `[m, n]`s.
        unsafe { self.queue.blas.gemm_strided(queues, gemm(packed, 0.0))? };
        // Each matrix rounded to bf16 once: `C_i + P_i` in f32 (axpy onto a
        // copy of `C_i`) or `P_i` alone (cast), then moved to its place.
        let narrow = self.alloc_uninit(per_matrix * batch, DType::Bf16)?;
        let narrow = GpuView::new(narrow.device_ptr(), per_matrix * batch, DType::Bf16);
        if d.accumulate {
            for i in 0..batch {
                let to_packed = CopyCols {
                    src_stride: dims.c.pitch,
                    src_offset: dims.at(2, i, 0, 0),
                    dst_stride: n,
                    dst_offset: i * per_matrix,
                    ..place(i, false)
                };
                kernels.copy_cols(self.s(), c, narrow, to_packed)?;
            }
            kernels.axpy(self.s(), 1.0, wide, narrow)?;
        } else {
            kernels.cast(self.s(), wide, narrow)?;
        }
        for i in 0..batch {
            kernels.copy_cols(self.s(), narrow, c, place(i, false))?;
        }
        Ok(())
    }
}

/// The lane (0: the queue's own stream) of each of a grouped call's
/// problems, given each movable one's work (`None`: it stays on the queue's
/// stream): largest first, each to the lane with the least work so far,
/// ties to the earlier problem and the lower lane. A function of the work
/// alone, so a step deals its problems the same way every time.
fn deal(work: &[Option<f64>], lanes: usize) -> Vec<usize> {
    let mut order: Vec<(usize, f64)> = work
        .iter()
        .enumerate()
        .filter_map(|(i, w)| w.map(|w| (i, w)))
        .collect();
    order.sort_by(|(i, a), (j, b)| b.total_cmp(a).then(i.cmp(j)));
    let mut lane_of = vec![0usize; work.len()];
    let mut load = vec![0.0f64; lanes.max(1)];
    for (i, w) in order {
        let lane = (0..load.len())
            .min_by(|&x, &y| load[x].total_cmp(&load[y]).then(x.cmp(&y)))
            .unwrap_or(0);
        lane_of[i] = lane;
        load[lane] += w;
    }
    lane_of
}

impl KernelSet {
    /// `Backend::axpy`: `y += alpha x`.
    pub fn axpy(&self, stream: &CudaStream, alpha: f32, x: GpuView, y: GpuView) -> Result<()> {
        let k = "axpy";
        let (xt, yt) = (dtype_tag(x.dtype), dtype_tag(y.dtype));
        if x.len == 0 {
            return Ok(());
        }
        let n = x.len as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&alpha)
            .arg(&x.ptr)
            .arg(&xt)
            .arg(&y.ptr)
            .arg(&yt)
            .arg(&n);
        self.go(k, &mut b, grid_for(x.len))
    }

    /// `Backend::scale`: `x *= alpha`.
    pub fn scale(&self, stream: &CudaStream, x: GpuView, alpha: f32) -> Result<()> {
        let k = "scale";
        let t = dtype_tag(x.dtype);
        if x.len == 0 {
            return Ok(());
        }
        let n = x.len as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&x.ptr).arg(&t).arg(&n).arg(&alpha);
        self.go(k, &mut b, grid_for(x.len))
    }

    /// `Backend::column_sum`: `out[j] += sum_r x[r, j]`.
    pub fn column_sum(
        &self,
        stream: &CudaStream,
        x: GpuView,
        out: GpuView,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let k = "column_sum";
        let (xt, ot) = (dtype_tag(x.dtype), dtype_tag(out.dtype));
        if cols == 0 {
            return Ok(());
        }
        let (r, c) = (rows as u64, cols as u64);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&x.ptr)
            .arg(&xt)
            .arg(&out.ptr)
            .arg(&ot)
            .arg(&r)
            .arg(&c);
        self.go(k, &mut b, column_blocks(cols))
    }

    /// `Backend::accumulate_sum`: `out[0] += sum_i x[i]` in f64.
    pub fn accumulate_sum(&self, stream: &CudaStream, x: GpuView, out: GpuView) -> Result<()> {
        let k = "accumulate_sum";
        let (xt, n) = (dtype_tag(x.dtype), x.len as u64);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&x.ptr).arg(&xt).arg(&n).arg(&out.ptr);
        self.go(k, &mut b, per_item(1, reduce_threads(x.len, 1024))?)
    }
}

#[cfg(test)]
mod tests {
    use super::deal;

    #[test]
    fn grouped_gemms_are_dealt_largest_first_to_the_least_loaded_stream() {
        // Work 8, 1, 4, 4, 2 and one problem that stays put, over 3 lanes:
        // 8 -> 0, 4 (index 2) -> 1, 4 (index 3) -> 2, 2 -> 1 (4 < 8 and
        // 4 ties with lane 2, the lower wins), 1 -> 2 (lanes 1 and 2 hold
        // 6 and 4).
        let work = [Some(8.0), Some(1.0), Some(4.0), Some(4.0), Some(2.0), None];
        assert_eq!(deal(&work, 3), vec![0, 2, 1, 2, 1, 0]);
        // One lane: everything on the queue's stream.
        assert_eq!(deal(&work, 1), vec![0; 6]);
        // Nothing to deal.
        assert_eq!(deal(&[None, None], 3), vec![0, 0]);
        // Equal work: in problem order over the lanes.
        assert_eq!(deal(&[Some(1.0); 4], 3), vec![0, 1, 2, 0]);
    }
}

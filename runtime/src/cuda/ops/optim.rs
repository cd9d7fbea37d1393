//! Optimizer steps on a GPU: [`OptimKernels`] for [`CudaBackend`], and the
//! launchers of `kernels/optimizer.cu` (AdamW and SGD over a shard, its
//! decayed ranges checked on the device) and of the gradient norm's sums
//! of squares (`kernels/reduce.cu`) on [`KernelSet`], which take views
//! `backend::optim`'s checks accepted.

use crate::backend::optim::sum_squares_pieces;
use crate::backend::{AdamMoments, AdamStep, OptimKernels, SgdStep};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, as_u32, dtype_tag, grid_for, per_item, product, reduce_threads,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::Result;
use crate::view::{DType, View, ViewMut};
use cudarc::driver::CudaStream;

impl OptimKernels<CudaBuf> for CudaBackend {
    fn adam_update_unchecked(
        &self,
        param: ViewMut<'_, CudaBuf>,
        copy: Option<ViewMut<'_, CudaBuf>>,
        grad: View<'_, CudaBuf>,
        moments: AdamMoments<ViewMut<'_, CudaBuf>>,
        decayed: View<'_, CudaBuf>,
        step: AdamStep,
    ) -> Result<()> {
        let moments = AdamMoments {
            m: self.m(&moments.m),
            v: self.m(&moments.v),
        };
        self.k().adam_update(
            self.s(),
            (self.m(&param), copy.as_ref().map(|c| self.m(c))),
            self.v(grad),
            moments,
            self.v(decayed),
            step,
        )
    }

    fn sgd_update_unchecked(
        &self,
        param: ViewMut<'_, CudaBuf>,
        copy: Option<ViewMut<'_, CudaBuf>>,
        grad: View<'_, CudaBuf>,
        momentum: Option<ViewMut<'_, CudaBuf>>,
        decayed: View<'_, CudaBuf>,
        step: SgdStep,
    ) -> Result<()> {
        let momentum = momentum.as_ref().map(|m| self.m(m));
        self.k().sgd_update(
            self.s(),
            (self.m(&param), copy.as_ref().map(|c| self.m(c))),
            self.v(grad),
            momentum,
            self.v(decayed),
            step,
        )
    }

    fn sum_squares_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        piece: usize,
        out: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        // Per-tile partials from the arena: a repeated step allocates nothing.
        let len = KernelSet::sum_squares_scratch_len(x.len(), piece)?;
        let (scratch, _partials) = self.scratch(len, DType::F64)?;
        self.k()
            .sum_squares(self.s(), self.v(x), piece, self.m(&out), scratch)
    }
}

/// Tiles a piece of `sum_squares` is cut into: spans of at least
/// `SUM_SQUARES_SPAN` elements (64 per thread of a 256-thread block), and at
/// most `SUM_SQUARES_MAX_TILES` (8 blocks per SM of an H200), so a bucket of
/// any size keeps every SM reading at full bandwidth.
fn sum_squares_tiles(piece: usize) -> usize {
    const SUM_SQUARES_SPAN: usize = 16_384;
    const SUM_SQUARES_MAX_TILES: usize = 1_056;
    piece
        .div_ceil(SUM_SQUARES_SPAN)
        .clamp(1, SUM_SQUARES_MAX_TILES)
}

impl KernelSet {
    /// The f64 scratch `sum_squares` needs for `len` elements in pieces of
    /// `piece`: one partial per tile of every piece.
    pub fn sum_squares_scratch_len(len: usize, piece: usize) -> Result<usize> {
        let pieces = sum_squares_pieces(len, piece)?;
        product("sum_squares", &[pieces, sum_squares_tiles(piece)])
    }

    /// `Backend::sum_squares`: per-piece sums of squares in f64, each piece
    /// cut into tiles summed by a block each (`sum_squares_tiles`), then the
    /// tiles added per piece in a fixed order (`sum_squares_pieces`).
    /// `scratch` holds [`Self::sum_squares_scratch_len`] f64s.
    pub fn sum_squares(
        &self,
        stream: &CudaStream,
        x: GpuView,
        piece: usize,
        out: GpuView,
        scratch: GpuView,
    ) -> Result<()> {
        let k = "sum_squares";
        scratch.operand().exactly(DType::F64, k, "scratch")?;
        let partials = Self::sum_squares_scratch_len(x.len, piece)?;
        let pieces = x.len.div_ceil(piece);
        scratch.operand().has_len(k, "scratch", partials)?;
        if pieces == 0 {
            return Ok(());
        }
        let tiles = sum_squares_tiles(piece);
        let (n, p, t) = (x.len as u64, piece as u64, tiles as u64);
        let span = piece.div_ceil(tiles);
        let tk = "sum_squares_tiles";
        let mut b = KernelArgs::new(stream, self.function(tk)?);
        b.arg(&x.ptr).arg(&n).arg(&p).arg(&t).arg(&scratch.ptr);
        self.go(tk, &mut b, per_item(partials, reduce_threads(span, 256))?)?;
        let pk = "sum_squares_pieces";
        let mut b = KernelArgs::new(stream, self.function(pk)?);
        b.arg(&scratch.ptr).arg(&t).arg(&out.ptr);
        self.go(pk, &mut b, per_item(pieces, reduce_threads(tiles, 256))?)
    }

    /// The shard's length and its count of decayed ranges, as the kernels
    /// take them (u32).
    fn shard_counts(k: &str, param: &GpuView, decayed: &GpuView) -> Result<u32> {
        as_u32(k, "shard length", param.len)?;
        as_u32(k, "decayed ranges", decayed.len / 2)
    }

    /// An optimizer's `copy` argument: its address and dtype tag; (0, 0)
    /// without one (the kernel never reads the tag then).
    fn copy_arg(copy: Option<GpuView>) -> (u64, i32) {
        copy.map_or((0, 0), |c| (c.ptr, dtype_tag(c.dtype)))
    }

    /// `Backend::adam_update`.
    pub fn adam_update(
        &self,
        stream: &CudaStream,
        (param, copy): (GpuView, Option<GpuView>),
        grad: GpuView,
        moments: AdamMoments<GpuView>,
        decayed: GpuView,
        step: AdamStep,
    ) -> Result<()> {
        let k = "adam_update";
        let ranges = Self::shard_counts(k, &param, &decayed)?;
        let AdamMoments { m, v } = moments;
        let (copy_ptr, copy_dtype) = Self::copy_arg(copy);
        if param.len == 0 {
            return Ok(());
        }
        let t = i32::try_from(step.step).unwrap_or(i32::MAX);
        // Bias corrections in f64 on the host, then f32, as the CPU does.
        let bc1 = (1.0 - f64::from(step.beta1).powi(t)) as f32;
        let bc2 = (1.0 - f64::from(step.beta2).powi(t)) as f32;
        let decay = 1.0 - step.lr * step.weight_decay;
        let n = param.len as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&param.ptr)
            .arg(&copy_ptr)
            .arg(&copy_dtype)
            .arg(&grad.ptr)
            .arg(&m.ptr)
            .arg(&v.ptr)
            .arg(&decayed.ptr)
            .arg(&ranges);
        b.arg(&n)
            .arg(&step.lr)
            .arg(&step.beta1)
            .arg(&step.beta2)
            .arg(&step.eps)
            .arg(&decay);
        b.arg(&step.grad_scale)
            .arg(&bc1)
            .arg(&bc2)
            .arg(&self.fault_ptr);
        self.go(k, &mut b, grid_for(param.len))
    }

    /// `Backend::sgd_update`.
    pub fn sgd_update(
        &self,
        stream: &CudaStream,
        (param, copy): (GpuView, Option<GpuView>),
        grad: GpuView,
        momentum: Option<GpuView>,
        decayed: GpuView,
        step: SgdStep,
    ) -> Result<()> {
        let k = "sgd_update";
        let ranges = Self::shard_counts(k, &param, &decayed)?;
        // A null pointer: no momentum.
        let buffer = momentum.map_or(0, |buf| buf.ptr);
        let (copy_ptr, copy_dtype) = Self::copy_arg(copy);
        if param.len == 0 {
            return Ok(());
        }
        let n = param.len as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&param.ptr)
            .arg(&copy_ptr)
            .arg(&copy_dtype)
            .arg(&grad.ptr)
            .arg(&buffer)
            .arg(&decayed.ptr)
            .arg(&ranges)
            .arg(&n);
        b.arg(&step.lr)
            .arg(&step.momentum)
            .arg(&step.weight_decay)
            .arg(&step.grad_scale);
        b.arg(&self.fault_ptr);
        self.go(k, &mut b, grid_for(param.len))
    }
}

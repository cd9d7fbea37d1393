//! Mamba's causal depthwise conv1d on a GPU: [`ConvKernels`] for
//! [`CudaBackend`], and the launchers of `kernels/conv.cu` on
//! [`KernelSet`], which take views `backend::conv`'s checks accepted.

use crate::backend::{ConvDims, ConvKernels};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{GpuView, KernelSet, bf16_words, dtype_tag, grid_for};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{View, ViewMut};
use cudarc::driver::{CudaStream, LaunchConfig};

impl ConvKernels<CudaBuf> for CudaBackend {
    fn conv1d_forward_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        weight: View<'_, CudaBuf>,
        bias: View<'_, CudaBuf>,
        y: ViewMut<'_, CudaBuf>,
        dims: ConvDims,
    ) -> Result<()> {
        self.k().conv1d_forward(
            self.s(),
            self.v(x),
            self.v(weight),
            self.v(bias),
            self.m(&y),
            dims,
        )
    }

    fn conv1d_backward_input_unchecked(
        &self,
        dy: View<'_, CudaBuf>,
        weight: View<'_, CudaBuf>,
        dx: ViewMut<'_, CudaBuf>,
        dims: ConvDims,
    ) -> Result<()> {
        self.k()
            .conv1d_backward_input(self.s(), self.v(dy), self.v(weight), self.m(&dx), dims)
    }

    fn conv1d_backward_weight_unchecked(
        &self,
        dy: View<'_, CudaBuf>,
        x: View<'_, CudaBuf>,
        dw: ViewMut<'_, CudaBuf>,
        dbias: ViewMut<'_, CudaBuf>,
        dims: ConvDims,
    ) -> Result<()> {
        self.k().conv1d_backward_weight(
            self.s(),
            self.v(dy),
            self.v(x),
            self.m(&dw),
            self.m(&dbias),
            dims,
        )
    }
}

/// The dimensions as the kernels take them: rows, seq, channels, taps.
fn dims_args(rows: usize, dims: ConvDims) -> [u64; 4] {
    [rows, dims.tokens.seq, dims.channels, dims.kernel].map(|v| v as u64)
}

/// The widest conv kernel `conv1d_backward_weight_window` takes
/// (`WINDOW_TAPS` in `conv.cu`).
const WINDOW_TAPS: usize = 16;

/// The widest kernel the `_words` kernels take (`WORD_TAPS` in `conv.cu`),
/// and the rows each of their threads walks (`CONV_WORD_ROWS`).
const WORD_TAPS: usize = 4;
const WORD_ROWS: usize = 32;
/// Threads of a `_words` block: 128 words, 1,024 channels of a run.
const WORD_THREADS: u32 = 128;

/// The launch of a `_words` kernel (8 bf16 channels a thread, a run of
/// `WORD_ROWS` rows each) where every view qualifies, else `None` (the
/// element kernel then runs): bf16, 16-byte aligned, channels a multiple of
/// 8, at most `WORD_TAPS` taps, and the rows' runs within a grid's height.
fn word_launch(views: &[GpuView], rows: usize, dims: ConvDims) -> Option<LaunchConfig> {
    if dims.kernel > WORD_TAPS || !bf16_words(views, dims.channels) {
        return None;
    }
    let runs = u32::try_from(rows.div_ceil(WORD_ROWS))
        .ok()
        .filter(|&r| r <= 65_535)?;
    let words = u32::try_from((dims.channels / 8).div_ceil(WORD_THREADS as usize)).ok()?;
    Some(LaunchConfig {
        grid_dim: (words, runs, 1),
        block_dim: (WORD_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl KernelSet {
    /// `Backend::conv1d_forward` (overwrites `y`).
    pub fn conv1d_forward(
        &self,
        stream: &CudaStream,
        x: GpuView,
        weight: GpuView,
        bias: GpuView,
        y: GpuView,
        dims: ConvDims,
    ) -> Result<()> {
        let k = "conv1d_forward";
        let (xt, wt, bt) = (
            dtype_tag(x.dtype),
            dtype_tag(weight.dtype),
            dtype_tag(bias.dtype),
        );
        let yt = dtype_tag(y.dtype);
        let rows = dims.tokens.batch * dims.tokens.seq;
        if y.len == 0 {
            return Ok(());
        }
        if let Some(config) = word_launch(&[x, y], rows, dims) {
            let mut b = KernelArgs::new(stream, self.function("conv1d_forward_words")?);
            b.arg(&x.ptr)
                .arg(&weight.ptr)
                .arg(&wt)
                .arg(&bias.ptr)
                .arg(&bt)
                .arg(&y.ptr);
            let args = dims_args(rows, dims);
            for v in &args {
                b.arg(v);
            }
            return self.go(k, &mut b, config);
        }
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&x.ptr)
            .arg(&xt)
            .arg(&weight.ptr)
            .arg(&wt)
            .arg(&bias.ptr)
            .arg(&bt);
        b.arg(&y.ptr).arg(&yt);
        let args = dims_args(rows, dims);
        for v in &args {
            b.arg(v);
        }
        self.go(k, &mut b, grid_for(y.len))
    }

    /// `Backend::conv1d_backward_input` (overwrites `dx`).
    pub fn conv1d_backward_input(
        &self,
        stream: &CudaStream,
        dy: GpuView,
        weight: GpuView,
        dx: GpuView,
        dims: ConvDims,
    ) -> Result<()> {
        let k = "conv1d_backward_input";
        let (dyt, wt, dxt) = (
            dtype_tag(dy.dtype),
            dtype_tag(weight.dtype),
            dtype_tag(dx.dtype),
        );
        let rows = dims.tokens.batch * dims.tokens.seq;
        if dx.len == 0 {
            return Ok(());
        }
        if let Some(config) = word_launch(&[dy, dx], rows, dims) {
            let mut b = KernelArgs::new(stream, self.function("conv1d_backward_input_words")?);
            b.arg(&dy.ptr).arg(&weight.ptr).arg(&wt).arg(&dx.ptr);
            let args = dims_args(rows, dims);
            for v in &args {
                b.arg(v);
            }
            return self.go(k, &mut b, config);
        }
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&dy.ptr)
            .arg(&dyt)
            .arg(&weight.ptr)
            .arg(&wt)
            .arg(&dx.ptr)
            .arg(&dxt);
        let args = dims_args(rows, dims);
        for v in &args {
            b.arg(v);
        }
        self.go(k, &mut b, grid_for(dx.len))
    }

    /// `Backend::conv1d_backward_weight` (accumulates into `dw` and
    /// `dbias`): one block per 32 channels, all taps and the bias at once
    /// (kernels up to 16 taps wide), else one per 32 channels and
    /// tap (the bias as one more tap); each a fixed tree over the rows.
    pub fn conv1d_backward_weight(
        &self,
        stream: &CudaStream,
        dy: GpuView,
        x: GpuView,
        dw: GpuView,
        dbias: GpuView,
        dims: ConvDims,
    ) -> Result<()> {
        let k = "conv1d_backward_weight";
        let (dyt, xt) = (dtype_tag(dy.dtype), dtype_tag(x.dtype));
        let (dwt, dbt) = (dtype_tag(dw.dtype), dtype_tag(dbias.dtype));
        let rows = dims.tokens.batch * dims.tokens.seq;
        if dims.channels == 0 || rows == 0 {
            return Ok(());
        }
        // One grid row per tap and one for the bias (a grid's y is at most 65535).
        let taps = u32::try_from(dims.kernel + 1)
            .ok()
            .filter(|&t| t <= 65_535)
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!(
                    "{k}: the CUDA kernel takes widths up to 65534 ({} asked)",
                    dims.kernel
                ))
            })?;
        let config = LaunchConfig {
            grid_dim: (
                dims.channels.div_ceil(32) as u32,
                if dims.kernel <= WINDOW_TAPS { 1 } else { taps },
                1,
            ),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        // Kernels up to WINDOW_TAPS wide read each row once for every tap;
        // wider ones take a pass per tap.
        let kernel = if dims.kernel <= WINDOW_TAPS {
            "conv1d_backward_weight_window"
        } else {
            k
        };
        let mut b = KernelArgs::new(stream, self.function(kernel)?);
        b.arg(&dy.ptr)
            .arg(&dyt)
            .arg(&x.ptr)
            .arg(&xt)
            .arg(&dw.ptr)
            .arg(&dwt)
            .arg(&dbias.ptr)
            .arg(&dbt);
        let args = dims_args(rows, dims);
        for v in &args {
            b.arg(v);
        }
        self.go(k, &mut b, config)
    }
}

//! Memory moves on a GPU: the launchers of `kernels/cast.cu` and
//! `elementwise.cu`'s fill on [`KernelSet`] (the views `backend::memory`'s
//! checks accepted), zeroing, and the copy transport's sums of shares
//! (`kernels/reduce.cu`).

use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{GpuView, KernelSet, MAX_SHARES, dtype_tag, ensure, grid_for};
use crate::error::Result;
use crate::view::DType;
use cudarc::driver::CudaStream;

impl KernelSet {
    /// `Backend::cast`: bf16, f32 or f64 on either side.
    pub fn cast(&self, stream: &CudaStream, src: GpuView, dst: GpuView) -> Result<()> {
        let k = "cast";
        if src.len == 0 {
            return Ok(());
        }
        let f = self.function(k)?;
        let (st, dt, n) = (dtype_tag(src.dtype), dtype_tag(dst.dtype), src.len as u64);
        let mut b = KernelArgs::new(stream, f);
        b.arg(&src.ptr).arg(&st).arg(&dst.ptr).arg(&dt).arg(&n);
        self.go(k, &mut b, grid_for(src.len))
    }

    /// `Backend::fill`.
    pub fn fill(&self, stream: &CudaStream, dst: GpuView, value: f32) -> Result<()> {
        let k = "fill";
        if dst.len == 0 {
            return Ok(());
        }
        let f = self.function(k)?;
        let (t, n) = (dtype_tag(dst.dtype), dst.len as u64);
        let mut b = KernelArgs::new(stream, f);
        b.arg(&dst.ptr).arg(&t).arg(&n).arg(&value);
        self.go(k, &mut b, grid_for(dst.len))
    }

    /// `Backend::zero`: any dtype.
    pub fn zero(&self, stream: &CudaStream, dst: GpuView) -> Result<()> {
        self.zero_bytes(stream, dst.ptr, dst.len * dst.dtype.bytes())
    }

    /// `out = ((shares[0] + shares[1]) + shares[2]) + ...` in f32, read
    /// straight from where each share lies (this GPU, or a peer GPU this
    /// context has peer access to): the copy transport's sums, one pass
    /// instead of a copy of each share and an add. `out` may be one of the
    /// shares.
    ///
    /// # Safety
    /// Every address in `shares` is the start of `out.len` f32 of device
    /// memory this context may read, left alone by every other queue
    /// until this launch has run.
    pub unsafe fn sum_shares(
        &self,
        stream: &CudaStream,
        shares: &[u64],
        out: GpuView,
    ) -> Result<()> {
        let k = "sum_shares";
        out.operand().exactly(DType::F32, k, "out")?;
        ensure(!shares.is_empty() && shares.len() <= MAX_SHARES, || {
            format!(
                "kernel `{k}`: {} shares, but it adds 1 to {MAX_SHARES}",
                shares.len()
            )
        })?;
        if out.len == 0 {
            return Ok(());
        }
        let mut at = [0u64; MAX_SHARES];
        at[..shares.len()].copy_from_slice(shares);
        let count = shares.len() as i32;
        let n = out.len as u64;
        let words = n.is_multiple_of(4) && shares.iter().chain([&out.ptr]).all(|p| p % 16 == 0);
        let grid = grid_for(if words { out.len / 4 } else { out.len });
        let words = i32::from(words);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&at).arg(&count).arg(&out.ptr).arg(&n).arg(&words);
        self.go(k, &mut b, grid)
    }
}

//! The layout kernels on a GPU: [`LayoutKernels`] for [`CudaBackend`],
//! and their launchers on [`KernelSet`] (`layout.cu`). The launchers take
//! views `backend::layout`'s checks accepted.

use crate::backend::{AttentionInputs, CopyCols, LayoutKernels, MlaKvDims, QkvDims};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{GpuView, KernelSet, dtype_tag, grid_for};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};
use cudarc::driver::CudaStream;

impl LayoutKernels<CudaBuf> for CudaBackend {
    fn copy_cols_unchecked(
        &self,
        src: View<'_, CudaBuf>,
        dst: ViewMut<'_, CudaBuf>,
        dims: CopyCols,
    ) -> Result<()> {
        self.k()
            .copy_cols(self.s(), self.v(src), self.m(&dst), dims)
    }

    fn qkv_split_unchecked(
        &self,
        qkv: View<'_, CudaBuf>,
        out: AttentionInputs<ViewMut<'_, CudaBuf>>,
        dims: QkvDims,
    ) -> Result<()> {
        self.k().qkv_split(
            self.s(),
            self.v(qkv),
            self.m(&out.q),
            self.m(&out.k),
            self.m(&out.v),
            dims,
        )
    }

    fn qkv_join_unchecked(
        &self,
        grads: AttentionInputs<View<'_, CudaBuf>>,
        dqkv: ViewMut<'_, CudaBuf>,
        dims: QkvDims,
    ) -> Result<()> {
        self.k().qkv_join(
            self.s(),
            self.v(grads.q),
            self.v(grads.k),
            self.v(grads.v),
            self.m(&dqkv),
            dims,
        )
    }

    fn mla_kv_split_unchecked(
        &self,
        kv: View<'_, CudaBuf>,
        k_rope: View<'_, CudaBuf>,
        k: ViewMut<'_, CudaBuf>,
        v: ViewMut<'_, CudaBuf>,
        dims: MlaKvDims,
    ) -> Result<()> {
        self.k().mla_kv_split(
            self.s(),
            self.v(kv),
            self.v(k_rope),
            self.m(&k),
            self.m(&v),
            dims,
        )
    }

    fn mla_kv_join_unchecked(
        &self,
        dk: View<'_, CudaBuf>,
        dv: View<'_, CudaBuf>,
        d_kv: ViewMut<'_, CudaBuf>,
        d_k_rope: ViewMut<'_, CudaBuf>,
        dims: MlaKvDims,
    ) -> Result<()> {
        self.k().mla_kv_join(
            self.s(),
            self.v(dk),
            self.v(dv),
            self.m(&d_kv),
            self.m(&d_k_rope),
            dims,
        )
    }
}

/// Elements a thread of `qkv_split` / `qkv_join` moves: a 16-byte word's
/// where every head is whole words and every view 16-byte aligned, else 1.
fn qkv_words(views: &[GpuView], head_dim: usize) -> usize {
    let per_word = 16 / views[0].dtype.bytes();
    let whole = head_dim.is_multiple_of(per_word) && views.iter().all(|v| v.ptr.is_multiple_of(16));
    if whole { per_word } else { 1 }
}

impl KernelSet {
    /// `Backend::copy_cols`.
    pub fn copy_cols(
        &self,
        stream: &CudaStream,
        src: GpuView,
        dst: GpuView,
        d: CopyCols,
    ) -> Result<()> {
        let k = "copy_cols";
        let t = dtype_tag(src.dtype);
        let n = d.rows * d.cols;
        if n == 0 {
            return Ok(());
        }
        let dims = [
            d.rows,
            d.cols,
            d.src_stride,
            d.src_offset,
            d.dst_stride,
            d.dst_offset,
        ]
        .map(|v| v as u64);
        let acc = i32::from(d.accumulate);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&src.ptr).arg(&dst.ptr).arg(&t);
        for v in &dims {
            b.arg(v);
        }
        b.arg(&acc);
        self.go(k, &mut b, grid_for(n))
    }

    /// `Backend::qkv_split`.
    pub fn qkv_split(
        &self,
        stream: &CudaStream,
        qkv: GpuView,
        q: GpuView,
        kk: GpuView,
        v: GpuView,
        d: QkvDims,
    ) -> Result<()> {
        let k = "qkv_split";
        let t = dtype_tag(qkv.dtype);
        if qkv.len == 0 {
            return Ok(());
        }
        let dims = [d.rows, d.groups, d.heads_per_group, d.head_dim].map(|x| x as u64);
        let per_word = qkv_words(&[qkv, q, kk, v], d.head_dim);
        let words = i32::from(per_word > 1);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&qkv.ptr).arg(&q.ptr).arg(&kk.ptr).arg(&v.ptr).arg(&t);
        for x in &dims {
            b.arg(x);
        }
        b.arg(&words);
        self.go(k, &mut b, grid_for(qkv.len / per_word))
    }

    /// `Backend::qkv_join`.
    pub fn qkv_join(
        &self,
        stream: &CudaStream,
        dq: GpuView,
        dk: GpuView,
        dv: GpuView,
        dqkv: GpuView,
        d: QkvDims,
    ) -> Result<()> {
        let k = "qkv_join";
        let t = dtype_tag(dqkv.dtype);
        if dqkv.len == 0 {
            return Ok(());
        }
        let dims = [d.rows, d.groups, d.heads_per_group, d.head_dim].map(|x| x as u64);
        let per_word = qkv_words(&[dqkv, dq, dk, dv], d.head_dim);
        let words = i32::from(per_word > 1);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&dq.ptr)
            .arg(&dk.ptr)
            .arg(&dv.ptr)
            .arg(&dqkv.ptr)
            .arg(&t);
        for x in &dims {
            b.arg(x);
        }
        b.arg(&words);
        self.go(k, &mut b, grid_for(dqkv.len / per_word))
    }

    /// `Backend::mla_kv_split`.
    pub fn mla_kv_split(
        &self,
        stream: &CudaStream,
        kv: GpuView,
        k_rope: GpuView,
        k_out: GpuView,
        v: GpuView,
        d: MlaKvDims,
    ) -> Result<()> {
        let k = "mla_kv_split";
        let t = dtype_tag(kv.dtype);
        let n = k_out.len + v.len;
        if n == 0 {
            return Ok(());
        }
        let dims = [d.rows, d.heads, d.nope_dim, d.rope_dim, d.v_dim].map(|x| x as u64);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&kv.ptr)
            .arg(&k_rope.ptr)
            .arg(&k_out.ptr)
            .arg(&v.ptr)
            .arg(&t);
        for x in &dims {
            b.arg(x);
        }
        self.go(k, &mut b, grid_for(n))
    }

    /// `Backend::mla_kv_join`.
    pub fn mla_kv_join(
        &self,
        stream: &CudaStream,
        dk: GpuView,
        dv: GpuView,
        d_kv: GpuView,
        d_k_rope: GpuView,
        d: MlaKvDims,
    ) -> Result<()> {
        let k = "mla_kv_join";
        let t = dtype_tag(dk.dtype);
        let n = d_kv.len + d_k_rope.len;
        if n == 0 {
            return Ok(());
        }
        let dims = [d.rows, d.heads, d.nope_dim, d.rope_dim, d.v_dim].map(|x| x as u64);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&dk.ptr)
            .arg(&dv.ptr)
            .arg(&d_kv.ptr)
            .arg(&d_k_rope.ptr)
            .arg(&t);
        for x in &dims {
            b.arg(x);
        }
        self.go(k, &mut b, grid_for(n))
    }
}

//! Layout moves: strided column copies and the splits and joins of fused
//! attention projections (one launch each on a GPU, where a strided copy
//! per head and tensor would be `3 x heads` launches).
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `layout_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`LayoutKernels`] method on each backend (`cpu::ops::layout`,
//! `cuda::ops::layout`).

use super::AttentionInputs;
#[cfg(doc)]
use super::Backend;
use crate::error::Result;
use crate::view::{DeviceBuffer, Operand, View, ViewMut, ensure, product, same_dtype};

/// Dimensions of [`Backend::copy_cols`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyCols {
    pub rows: usize,
    pub cols: usize,
    pub src_stride: usize,
    pub src_offset: usize,
    pub dst_stride: usize,
    pub dst_offset: usize,
    pub accumulate: bool,
}

/// Dimensions of [`Backend::qkv_split`] and [`Backend::qkv_join`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QkvDims {
    pub rows: usize,
    /// KV groups (key/value heads).
    pub groups: usize,
    /// Query heads per group.
    pub heads_per_group: usize,
    pub head_dim: usize,
}

impl QkvDims {
    /// Elements of one fused `qkv` row.
    pub const fn width(&self) -> usize {
        self.groups * (self.heads_per_group + 2) * self.head_dim
    }
}

/// Dimensions of [`Backend::mla_kv_split`] and [`Backend::mla_kv_join`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaKvDims {
    pub rows: usize,
    pub heads: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
}

/// The layout kernels as a backend implements them: each runs once
/// [`Backend`]'s method of the same name (without `_unchecked`) has checked
/// its arguments here, so their dtypes and lengths are right.
pub trait LayoutKernels<Buf: DeviceBuffer> {
    fn copy_cols_unchecked(
        &self,
        src: View<'_, Buf>,
        dst: ViewMut<'_, Buf>,
        dims: CopyCols,
    ) -> Result<()>;

    fn qkv_split_unchecked(
        &self,
        qkv: View<'_, Buf>,
        out: AttentionInputs<ViewMut<'_, Buf>>,
        dims: QkvDims,
    ) -> Result<()>;

    fn qkv_join_unchecked(
        &self,
        grads: AttentionInputs<View<'_, Buf>>,
        dqkv: ViewMut<'_, Buf>,
        dims: QkvDims,
    ) -> Result<()>;

    fn mla_kv_split_unchecked(
        &self,
        kv: View<'_, Buf>,
        k_rope: View<'_, Buf>,
        k: ViewMut<'_, Buf>,
        v: ViewMut<'_, Buf>,
        dims: MlaKvDims,
    ) -> Result<()>;

    fn mla_kv_join_unchecked(
        &self,
        dk: View<'_, Buf>,
        dv: View<'_, Buf>,
        d_kv: ViewMut<'_, Buf>,
        d_k_rope: ViewMut<'_, Buf>,
        dims: MlaKvDims,
    ) -> Result<()>;
}

/// [`Backend::copy_cols`]'s arguments.
pub fn check_copy_cols(src: Operand, dst: Operand, d: CopyCols) -> Result<()> {
    let k = "copy_cols";
    src.float(k, "src")?;
    same_dtype(k, ("src", src.dtype), ("dst", dst.dtype))?;
    ensure(
        d.src_offset + d.cols <= d.src_stride && d.dst_offset + d.cols <= d.dst_stride,
        || format!("{k}: the column block does not fit its row stride ({d:?})"),
    )?;
    src.has_len(k, "src", product(k, &[d.rows, d.src_stride])?)?;
    dst.has_len(k, "dst", product(k, &[d.rows, d.dst_stride])?)
}

/// The fused projection `[fused_name, fused]` and the heads `[names, ...]`
/// of a QKV split or join: all of one float dtype, each as long as `d`
/// says.
fn check_qkv(
    kernel: &str,
    [fused_name, q_name, k_name, v_name]: [&str; 4],
    [fused, q, k, v]: [Operand; 4],
    d: QkvDims,
) -> Result<()> {
    fused.float(kernel, fused_name)?;
    for (name, head) in [(q_name, q), (k_name, k), (v_name, v)] {
        same_dtype(kernel, (fused_name, fused.dtype), (name, head.dtype))?;
    }
    let heads = product(kernel, &[d.groups, d.heads_per_group])?;
    let width = product(kernel, &[d.groups, d.heads_per_group + 2, d.head_dim])?;
    fused.has_len(kernel, fused_name, product(kernel, &[d.rows, width])?)?;
    q.has_len(
        kernel,
        q_name,
        product(kernel, &[d.rows, heads, d.head_dim])?,
    )?;
    let kv = product(kernel, &[d.rows, d.groups, d.head_dim])?;
    k.has_len(kernel, k_name, kv)?;
    v.has_len(kernel, v_name, kv)
}

/// [`Backend::qkv_split`]'s arguments.
pub fn check_qkv_split(qkv: Operand, q: Operand, k: Operand, v: Operand, d: QkvDims) -> Result<()> {
    check_qkv("qkv_split", ["qkv", "q", "k", "v"], [qkv, q, k, v], d)
}

/// [`Backend::qkv_join`]'s arguments.
pub fn check_qkv_join(
    dq: Operand,
    dk: Operand,
    dv: Operand,
    dqkv: Operand,
    d: QkvDims,
) -> Result<()> {
    check_qkv(
        "qkv_join",
        ["dqkv", "dq", "dk", "dv"],
        [dqkv, dq, dk, dv],
        d,
    )
}

/// The four views of an MLA split or join (named as `names` in errors, in
/// the split's order `kv`, `k_rope`, `k`, `v`): each as long as `d` says.
fn check_mla(kernel: &str, names: [&str; 4], views: [Operand; 4], d: MlaKvDims) -> Result<()> {
    let kv_w = product(kernel, &[d.heads, d.nope_dim + d.v_dim])?;
    let k_w = product(kernel, &[d.heads, d.nope_dim + d.rope_dim])?;
    let v_w = product(kernel, &[d.heads, d.v_dim])?;
    let widths = [kv_w, d.rope_dim, k_w, v_w];
    for ((name, view), width) in names.into_iter().zip(views).zip(widths) {
        view.has_len(kernel, name, product(kernel, &[d.rows, width])?)?;
    }
    Ok(())
}

/// [`Backend::mla_kv_split`]'s arguments.
pub fn check_mla_kv_split(
    kv: Operand,
    k_rope: Operand,
    k: Operand,
    v: Operand,
    d: MlaKvDims,
) -> Result<()> {
    let kernel = "mla_kv_split";
    kv.float(kernel, "kv")?;
    for (name, view) in [("k_rope", k_rope), ("k", k), ("v", v)] {
        same_dtype(kernel, ("kv", kv.dtype), (name, view.dtype))?;
    }
    check_mla(kernel, ["kv", "k_rope", "k", "v"], [kv, k_rope, k, v], d)
}

/// [`Backend::mla_kv_join`]'s arguments.
pub fn check_mla_kv_join(
    dk: Operand,
    dv: Operand,
    d_kv: Operand,
    d_k_rope: Operand,
    d: MlaKvDims,
) -> Result<()> {
    let kernel = "mla_kv_join";
    dk.float(kernel, "dk")?;
    for (name, view) in [("dv", dv), ("d_kv", d_kv), ("d_k_rope", d_k_rope)] {
        same_dtype(kernel, ("dk", dk.dtype), (name, view.dtype))?;
    }
    let names = ["d_kv", "d_k_rope", "dk", "dv"];
    check_mla(kernel, names, [d_kv, d_k_rope, dk, dv], d)
}

/// [`Backend`]'s layout methods: each checks its arguments, then runs its
/// [`LayoutKernels`] method.
macro_rules! layout_methods {
    () => {
        /// A strided 2-D copy of a block of columns (cudaMemcpy2D): for every row
        /// `r < rows` and column `j < cols`,
        /// `dst[r*dst_stride + dst_offset + j] (+)= src[r*src_stride + src_offset + j]`
        /// (`+=` with `accumulate`). Splits and joins column blocks, e.g. the MTP
        /// entry's `[e | h]` rows. `src` and `dst` share a dtype (bf16 or f32).
        fn copy_cols(
            &self,
            src: Slice<'_, Self>,
            dst: SliceMut<'_, Self>,
            dims: CopyCols,
        ) -> Result<()> {
            $crate::backend::layout::check_copy_cols(src.operand(), dst.operand(), dims)?;
            self.copy_cols_unchecked(src, dst, dims)
        }

        /// The GQA split of the fused projection: each `qkv` row holds, per KV
        /// group `g`, `[q heads of g | k_g | v_g]` (`heads_per_group + 2` heads of
        /// `head_dim`); writes `q` `[rows, groups * heads_per_group, head_dim]`,
        /// `k` and `v` `[rows, groups, head_dim]` (overwritten). One launch for
        /// every group and head. All four views share a dtype (bf16 or f32);
        /// values are copied exactly.
        fn qkv_split(
            &self,
            qkv: Slice<'_, Self>,
            out: AttentionInputs<SliceMut<'_, Self>>,
            dims: QkvDims,
        ) -> Result<()> {
            $crate::backend::layout::check_qkv_split(
                qkv.operand(),
                out.q.operand(),
                out.k.operand(),
                out.v.operand(),
                dims,
            )?;
            self.qkv_split_unchecked(qkv, out, dims)
        }

        /// The inverse of [`Backend::qkv_split`]: `dqkv` (overwritten) from `dq`,
        /// `dk`, `dv`, in the fused layout.
        fn qkv_join(
            &self,
            grads: AttentionInputs<Slice<'_, Self>>,
            dqkv: SliceMut<'_, Self>,
            dims: QkvDims,
        ) -> Result<()> {
            $crate::backend::layout::check_qkv_join(
                grads.q.operand(),
                grads.k.operand(),
                grads.v.operand(),
                dqkv.operand(),
                dims,
            )?;
            self.qkv_join_unchecked(grads, dqkv, dims)
        }

        /// The MLA key/value split: each `kv` row holds, per head `i`,
        /// `[k_nope_i (nope_dim) | v_i (v_dim)]`; `k_rope` `[rows, rope_dim]` is
        /// shared by the heads. Writes `k` `[rows, heads, nope_dim + rope_dim]`
        /// with `k_i = [k_nope_i | k_rope]` and `v` `[rows, heads, v_dim]`
        /// (overwritten). All views share a dtype (bf16 or f32); exact copies.
        fn mla_kv_split(
            &self,
            kv: Slice<'_, Self>,
            k_rope: Slice<'_, Self>,
            k: SliceMut<'_, Self>,
            v: SliceMut<'_, Self>,
            dims: MlaKvDims,
        ) -> Result<()> {
            $crate::backend::layout::check_mla_kv_split(
                kv.operand(),
                k_rope.operand(),
                k.operand(),
                v.operand(),
                dims,
            )?;
            self.mla_kv_split_unchecked(kv, k_rope, k, v, dims)
        }

        /// The backward of [`Backend::mla_kv_split`] (both outputs overwritten):
        /// `d_kv` in the fused layout from `dk`'s nope part and `dv`, and
        /// `d_k_rope[r] = sum_i dk[r, i, rope part]`, heads in order from zero,
        /// in f32 (one rounding at the store for bf16).
        fn mla_kv_join(
            &self,
            dk: Slice<'_, Self>,
            dv: Slice<'_, Self>,
            d_kv: SliceMut<'_, Self>,
            d_k_rope: SliceMut<'_, Self>,
            dims: MlaKvDims,
        ) -> Result<()> {
            $crate::backend::layout::check_mla_kv_join(
                dk.operand(),
                dv.operand(),
                d_kv.operand(),
                d_k_rope.operand(),
                dims,
            )?;
            self.mla_kv_join_unchecked(dk, dv, d_kv, d_k_rope, dims)
        }
    };
}
pub(super) use layout_methods;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::DType;

    fn f32s(len: usize) -> Operand {
        Operand::new(len, DType::F32)
    }

    #[test]
    fn head_splits_refuse_views_one_element_short() {
        let d = QkvDims {
            rows: 3,
            groups: 2,
            heads_per_group: 2,
            head_dim: 4,
        };
        let (fused, q, kv) = (3 * d.width(), 3 * 2 * 2 * 4, 3 * 2 * 4);
        assert!(check_qkv_split(f32s(fused), f32s(q), f32s(kv), f32s(kv), d).is_ok());
        assert!(check_qkv_split(f32s(fused - 1), f32s(q), f32s(kv), f32s(kv), d).is_err());
        assert!(check_qkv_join(f32s(q), f32s(kv - 1), f32s(kv), f32s(fused), d).is_err());
        let m = MlaKvDims {
            rows: 2,
            heads: 3,
            nope_dim: 4,
            rope_dim: 2,
            v_dim: 5,
        };
        let (kv, rope, k, v) = (2 * 3 * 9, 2 * 2, 2 * 3 * 6, 2 * 3 * 5);
        assert!(check_mla_kv_split(f32s(kv), f32s(rope), f32s(k), f32s(v), m).is_ok());
        assert!(check_mla_kv_split(f32s(kv), f32s(rope - 1), f32s(k), f32s(v), m).is_err());
        assert!(check_mla_kv_join(f32s(k), f32s(v), f32s(kv - 1), f32s(rope), m).is_err());
    }
}

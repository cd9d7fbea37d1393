//! Layout moves: strided column copies, and the attention layers' head
//! splits (a fused projection's rows cut into per-head query, key and value
//! tensors in one pass, and their gradients joined back the same way).

use super::dense::axpy_row;
use crate::backend::{AttentionInputs, CopyCols, LayoutKernels, MlaKvDims, QkvDims};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl LayoutKernels<CpuBuf> for CpuBackend {
    fn copy_cols_unchecked(
        &self,
        src: View<'_, CpuBuf>,
        dst: ViewMut<'_, CpuBuf>,
        dims: CopyCols,
    ) -> Result<()> {
        let k = self.access("copy_cols");
        let src = k.f32_in("src", src)?;
        copy_cols(&src, &mut k.f32_out("dst", dst)?, dims);
        Ok(())
    }

    fn qkv_split_unchecked(
        &self,
        qkv: View<'_, CpuBuf>,
        out: AttentionInputs<ViewMut<'_, CpuBuf>>,
        dims: QkvDims,
    ) -> Result<()> {
        let k = self.access("qkv_split");
        let qkv = k.f32_in("qkv", qkv)?;
        qkv_split(
            &qkv,
            &mut k.f32_out("q", out.q)?,
            &mut k.f32_out("k", out.k)?,
            &mut k.f32_out("v", out.v)?,
            dims,
        );
        Ok(())
    }

    fn qkv_join_unchecked(
        &self,
        grads: AttentionInputs<View<'_, CpuBuf>>,
        dqkv: ViewMut<'_, CpuBuf>,
        dims: QkvDims,
    ) -> Result<()> {
        let k = self.access("qkv_join");
        let (dq, dk, dv) = (
            k.f32_in("dq", grads.q)?,
            k.f32_in("dk", grads.k)?,
            k.f32_in("dv", grads.v)?,
        );
        qkv_join(&dq, &dk, &dv, &mut k.f32_out("dqkv", dqkv)?, dims);
        Ok(())
    }

    fn mla_kv_split_unchecked(
        &self,
        kv: View<'_, CpuBuf>,
        k_rope: View<'_, CpuBuf>,
        k_out: ViewMut<'_, CpuBuf>,
        v: ViewMut<'_, CpuBuf>,
        dims: MlaKvDims,
    ) -> Result<()> {
        let k = self.access("mla_kv_split");
        let (kv, k_rope) = (k.f32_in("kv", kv)?, k.f32_in("k_rope", k_rope)?);
        mla_kv_split(
            &kv,
            &k_rope,
            &mut k.f32_out("k", k_out)?,
            &mut k.f32_out("v", v)?,
            dims,
        );
        Ok(())
    }

    fn mla_kv_join_unchecked(
        &self,
        dk: View<'_, CpuBuf>,
        dv: View<'_, CpuBuf>,
        d_kv: ViewMut<'_, CpuBuf>,
        d_k_rope: ViewMut<'_, CpuBuf>,
        dims: MlaKvDims,
    ) -> Result<()> {
        let k = self.access("mla_kv_join");
        let (dk, dv) = (k.f32_in("dk", dk)?, k.f32_in("dv", dv)?);
        mla_kv_join(
            &dk,
            &dv,
            &mut k.f32_out("d_kv", d_kv)?,
            &mut k.f32_out("d_k_rope", d_k_rope)?,
            dims,
        );
        Ok(())
    }
}

pub fn copy_cols(src: &[f32], dst: &mut [f32], dims: CopyCols) {
    if dims.rows == 0 || dims.cols == 0 {
        return;
    }
    let src_rows = src.chunks_exact(dims.src_stride);
    let dst_rows = dst.chunks_exact_mut(dims.dst_stride);
    for (s, d) in src_rows.zip(dst_rows) {
        let s = &s[dims.src_offset..dims.src_offset + dims.cols];
        let d = &mut d[dims.dst_offset..dims.dst_offset + dims.cols];
        if dims.accumulate {
            axpy_row(1.0, s, d);
        } else {
            d.copy_from_slice(s);
        }
    }
}

/// The row widths of an MLA split's `kv`, `k` and `v`.
fn row_widths(d: MlaKvDims) -> (usize, usize, usize) {
    (
        d.heads * (d.nope_dim + d.v_dim),
        d.heads * (d.nope_dim + d.rope_dim),
        d.heads * d.v_dim,
    )
}

/// The row-local offsets of group `g`'s blocks: (`qkv` start of its query
/// heads, of its key, of its value; `q` start of its query heads).
fn group_offsets(d: QkvDims, g: usize) -> (usize, usize, usize, usize) {
    let c = d.head_dim;
    let qc = d.heads_per_group * c;
    let start = g * (qc + 2 * c);
    (start, start + qc, start + qc + c, g * qc)
}

pub fn qkv_split(qkv: &[f32], q: &mut [f32], k: &mut [f32], v: &mut [f32], dims: QkvDims) {
    let (c, width) = (dims.head_dim, dims.width());
    let qw = dims.groups * dims.heads_per_group * c;
    let kw = dims.groups * c;
    if width == 0 {
        return;
    }
    let qc = dims.heads_per_group * c;
    for r in 0..dims.rows {
        let row = &qkv[r * width..][..width];
        for g in 0..dims.groups {
            let (qs, ks, vs, qd) = group_offsets(dims, g);
            q[r * qw + qd..][..qc].copy_from_slice(&row[qs..qs + qc]);
            k[r * kw + g * c..][..c].copy_from_slice(&row[ks..ks + c]);
            v[r * kw + g * c..][..c].copy_from_slice(&row[vs..vs + c]);
        }
    }
}

pub fn qkv_join(dq: &[f32], dk: &[f32], dv: &[f32], dqkv: &mut [f32], dims: QkvDims) {
    let (c, width) = (dims.head_dim, dims.width());
    let qw = dims.groups * dims.heads_per_group * c;
    let kw = dims.groups * c;
    if width == 0 {
        return;
    }
    let qc = dims.heads_per_group * c;
    for r in 0..dims.rows {
        let row = &mut dqkv[r * width..][..width];
        for g in 0..dims.groups {
            let (qs, ks, vs, qd) = group_offsets(dims, g);
            row[qs..qs + qc].copy_from_slice(&dq[r * qw + qd..][..qc]);
            row[ks..ks + c].copy_from_slice(&dk[r * kw + g * c..][..c]);
            row[vs..vs + c].copy_from_slice(&dv[r * kw + g * c..][..c]);
        }
    }
}

pub fn mla_kv_split(kv: &[f32], k_rope: &[f32], k: &mut [f32], v: &mut [f32], dims: MlaKvDims) {
    let (kv_w, k_w, v_w) = row_widths(dims);
    let MlaKvDims {
        rows,
        heads,
        nope_dim: dn,
        rope_dim: dr,
        v_dim: dv,
    } = dims;
    for r in 0..rows {
        let rope = &k_rope[r * dr..][..dr];
        for i in 0..heads {
            let src = &kv[r * kv_w + i * (dn + dv)..][..dn + dv];
            let k_head = &mut k[r * k_w + i * (dn + dr)..][..dn + dr];
            k_head[..dn].copy_from_slice(&src[..dn]);
            k_head[dn..].copy_from_slice(rope);
            v[r * v_w + i * dv..][..dv].copy_from_slice(&src[dn..]);
        }
    }
}

pub fn mla_kv_join(
    dk: &[f32],
    dv: &[f32],
    d_kv: &mut [f32],
    d_k_rope: &mut [f32],
    dims: MlaKvDims,
) {
    let (kv_w, k_w, v_w) = row_widths(dims);
    let MlaKvDims {
        rows,
        heads,
        nope_dim: dn,
        rope_dim: dr,
        v_dim: dvd,
    } = dims;
    for r in 0..rows {
        let rope = &mut d_k_rope[r * dr..][..dr];
        rope.fill(0.0);
        for i in 0..heads {
            let k_head = &dk[r * k_w + i * (dn + dr)..][..dn + dr];
            let dst = &mut d_kv[r * kv_w + i * (dn + dvd)..][..dn + dvd];
            dst[..dn].copy_from_slice(&k_head[..dn]);
            dst[dn..].copy_from_slice(&dv[r * v_w + i * dvd..][..dvd]);
            for (acc, &g) in rope.iter_mut().zip(&k_head[dn..]) {
                *acc += g;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;
    use crate::backend::Precision;
    use crate::backend::layout::check_copy_cols;
    use crate::cpu::ops::refusals::{buf, refused};

    use crate::view::{DType, Operand};
    use half::bf16;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2000)
            .map(|v| v as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// The layout spelled out element by element.
    fn qkv_reference(qkv: &[f32], d: QkvDims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (c, p, g_n) = (d.head_dim, d.heads_per_group, d.groups);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..d.rows {
            for g in 0..g_n {
                for h in 0..p {
                    for j in 0..c {
                        q.push(qkv[r * d.width() + g * (p + 2) * c + h * c + j]);
                    }
                }
            }
            for g in 0..g_n {
                for j in 0..c {
                    k.push(qkv[r * d.width() + g * (p + 2) * c + p * c + j]);
                }
            }
            for g in 0..g_n {
                for j in 0..c {
                    v.push(qkv[r * d.width() + g * (p + 2) * c + (p + 1) * c + j]);
                }
            }
        }
        (q, k, v)
    }

    #[test]
    fn qkv_split_matches_the_layout_and_join_inverts_it() {
        for (groups, per, c) in [(1, 1, 3), (2, 3, 2), (3, 2, 4)] {
            let d = QkvDims {
                rows: 5,
                groups,
                heads_per_group: per,
                head_dim: c,
            };
            let qkv = values(5 * d.width(), 7);
            let (mut q, mut k, mut v) = (
                vec![9.0; 5 * groups * per * c],
                vec![9.0; 5 * groups * c],
                vec![9.0; 5 * groups * c],
            );
            qkv_split(&qkv, &mut q, &mut k, &mut v, d);
            assert_eq!((q.clone(), k.clone(), v.clone()), qkv_reference(&qkv, d));
            let mut back = vec![9.0; qkv.len()];
            qkv_join(&q, &k, &v, &mut back, d);
            assert_eq!(back, qkv);
        }
    }

    #[test]
    fn mla_split_broadcasts_the_rope_key_and_join_sums_it_over_heads() {
        let d = MlaKvDims {
            rows: 3,
            heads: 4,
            nope_dim: 2,
            rope_dim: 2,
            v_dim: 3,
        };
        let (dn, dr, dv) = (2, 2, 3);
        let kv = values(3 * 4 * (dn + dv), 3);
        let k_rope = values(3 * dr, 5);
        let (mut k, mut v) = (vec![9.0; 3 * 4 * (dn + dr)], vec![9.0; 3 * 4 * dv]);
        mla_kv_split(&kv, &k_rope, &mut k, &mut v, d);
        for r in 0..3 {
            for i in 0..4 {
                for j in 0..dn {
                    assert_eq!(
                        k[(r * 4 + i) * (dn + dr) + j],
                        kv[(r * 4 + i) * (dn + dv) + j]
                    );
                }
                for j in 0..dr {
                    assert_eq!(k[(r * 4 + i) * (dn + dr) + dn + j], k_rope[r * dr + j]);
                }
                for j in 0..dv {
                    assert_eq!(
                        v[(r * 4 + i) * dv + j],
                        kv[(r * 4 + i) * (dn + dv) + dn + j]
                    );
                }
            }
        }
        let dk = values(k.len(), 11);
        let dvv = values(v.len(), 13);
        let (mut d_kv, mut d_rope) = (vec![9.0; kv.len()], vec![9.0; k_rope.len()]);
        mla_kv_join(&dk, &dvv, &mut d_kv, &mut d_rope, d);
        for r in 0..3 {
            for i in 0..4 {
                for j in 0..dn {
                    assert_eq!(
                        d_kv[(r * 4 + i) * (dn + dv) + j],
                        dk[(r * 4 + i) * (dn + dr) + j]
                    );
                }
                for j in 0..dv {
                    assert_eq!(
                        d_kv[(r * 4 + i) * (dn + dv) + dn + j],
                        dvv[(r * 4 + i) * dv + j]
                    );
                }
            }
            for j in 0..dr {
                // Heads summed in order from zero.
                let mut want = 0.0f32;
                for i in 0..4 {
                    want += dk[(r * 4 + i) * (dn + dr) + dn + j];
                }
                assert_eq!(d_rope[r * dr + j], want);
            }
        }
    }

    #[test]
    fn copy_cols_moves_and_accumulates_a_column_block() {
        let src: Vec<f32> = (0..12).map(|v| v as f32).collect(); // [3, 4]
        let mut dst = vec![0.0; 6]; // [3, 2]
        let dims = CopyCols {
            rows: 3,
            cols: 2,
            src_stride: 4,
            src_offset: 1,
            dst_stride: 2,
            dst_offset: 0,
            accumulate: false,
        };
        copy_cols(&src, &mut dst, dims);
        assert_eq!(dst, vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
        copy_cols(
            &src,
            &mut dst,
            CopyCols {
                accumulate: true,
                ..dims
            },
        );
        assert_eq!(dst, vec![2.0, 4.0, 10.0, 12.0, 18.0, 20.0]);
        let src = Operand::new(12, DType::F32);
        let dst = Operand::new(6, DType::F32);
        let misfit = CopyCols {
            src_offset: 3,
            ..dims
        };
        assert!(check_copy_cols(src, dst, misfit).is_err());
        let short = Operand::new(11, DType::F32);
        assert!(check_copy_cols(short, dst, dims).is_err());
    }

    #[test]
    fn head_splits_copy_bf16_exactly_and_refuse_mixed_dtypes() {
        let b = CpuBackend::new(Precision::Bf16);
        let dims = QkvDims {
            rows: 2,
            groups: 2,
            heads_per_group: 1,
            head_dim: 2,
        };
        let values: Vec<bf16> = (0..dims.rows * dims.width())
            .map(|i| bf16::from_f32(i as f32 * 0.3 - 1.7))
            .collect();
        let qkv = buf(&b, values.len(), DType::Bf16);
        b.upload(&values, ViewMut::whole(&qkv)).unwrap();
        let [q, k, v] = [0; 3].map(|_| buf(&b, 8, DType::Bf16));
        let out = |q, k, v| AttentionInputs {
            q: ViewMut::whole(q),
            k: ViewMut::whole(k),
            v: ViewMut::whole(v),
        };
        b.qkv_split(View::whole(&qkv), out(&q, &k, &v), dims)
            .unwrap();
        let joined = buf(&b, values.len(), DType::Bf16);
        let grads = AttentionInputs {
            q: View::whole(&q),
            k: View::whole(&k),
            v: View::whole(&v),
        };
        b.qkv_join(grads, ViewMut::whole(&joined), dims).unwrap();
        let mut back = vec![bf16::ZERO; values.len()];
        b.download(View::whole(&joined), &mut back).unwrap();
        assert_eq!(back, values);
        let f32_k = buf(&b, 8, DType::F32);
        refused(
            b.qkv_split(View::whole(&qkv), out(&q, &f32_k, &v), dims),
            "qkv_split",
            "k",
        );
        let f32_joined = buf(&b, values.len(), DType::F32);
        refused(
            b.qkv_join(grads, ViewMut::whole(&f32_joined), dims),
            "qkv_join",
            "dqkv",
        );
        let mla = MlaKvDims {
            rows: 1,
            heads: 2,
            nope_dim: 1,
            rope_dim: 2,
            v_dim: 1,
        };
        let (kv, rope) = (buf(&b, 4, DType::Bf16), buf(&b, 2, DType::F32));
        let (mk, mv) = (buf(&b, 6, DType::Bf16), buf(&b, 2, DType::Bf16));
        refused(
            b.mla_kv_split(
                View::whole(&kv),
                View::whole(&rope),
                ViewMut::whole(&mk),
                ViewMut::whole(&mv),
                mla,
            ),
            "mla_kv_split",
            "k_rope",
        );
        refused(
            b.mla_kv_join(
                View::whole(&mk),
                View::whole(&mv),
                ViewMut::whole(&kv),
                ViewMut::whole(&rope),
                mla,
            ),
            "mla_kv_join",
            "d_k_rope",
        );
    }
}

//! The attention layers' head splits: a fused projection's rows cut into
//! per-head query, key and value tensors in one pass, and their gradients
//! joined back the same way (one launch each on a GPU, where a strided copy
//! per head and tensor would be `3 x heads` launches).

use super::check;
use crate::backend::{MlaKvDims, QkvDims};
use crate::error::Result;

fn check_qkv(kernel: &str, fused: usize, q: usize, k: usize, v: usize, d: QkvDims) -> Result<()> {
    let heads = check::product(kernel, &[d.groups, d.heads_per_group])?;
    let width = check::product(kernel, &[d.groups, d.heads_per_group + 2, d.head_dim])?;
    check::len(
        kernel,
        "qkv",
        fused,
        check::product(kernel, &[d.rows, width])?,
    )?;
    check::len(
        kernel,
        "q",
        q,
        check::product(kernel, &[d.rows, heads, d.head_dim])?,
    )?;
    let kv = check::product(kernel, &[d.rows, d.groups, d.head_dim])?;
    check::len(kernel, "k", k, kv)?;
    check::len(kernel, "v", v, kv)
}

/// The row-local offsets of group `g`'s blocks: (`qkv` start of its query
/// heads, of its key, of its value; `q` start of its query heads).
fn group_offsets(d: QkvDims, g: usize) -> (usize, usize, usize, usize) {
    let c = d.head_dim;
    let qc = d.heads_per_group * c;
    let start = g * (qc + 2 * c);
    (start, start + qc, start + qc + c, g * qc)
}

pub fn qkv_split(
    qkv: &[f32],
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
    dims: QkvDims,
) -> Result<()> {
    check_qkv("qkv_split", qkv.len(), q.len(), k.len(), v.len(), dims)?;
    let (c, width) = (dims.head_dim, dims.width());
    let qw = dims.groups * dims.heads_per_group * c;
    let kw = dims.groups * c;
    if width == 0 {
        return Ok(());
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
    Ok(())
}

pub fn qkv_join(dq: &[f32], dk: &[f32], dv: &[f32], dqkv: &mut [f32], dims: QkvDims) -> Result<()> {
    check_qkv("qkv_join", dqkv.len(), dq.len(), dk.len(), dv.len(), dims)?;
    let (c, width) = (dims.head_dim, dims.width());
    let qw = dims.groups * dims.heads_per_group * c;
    let kw = dims.groups * c;
    if width == 0 {
        return Ok(());
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
    Ok(())
}

/// Checks every view of the MLA split against `d`; returns the row widths
/// of `kv`, `k` and `v`.
fn check_mla(
    kernel: &str,
    kv: usize,
    k_rope: usize,
    k: usize,
    v: usize,
    d: MlaKvDims,
) -> Result<(usize, usize, usize)> {
    let kv_w = check::product(kernel, &[d.heads, d.nope_dim + d.v_dim])?;
    let k_w = check::product(kernel, &[d.heads, d.nope_dim + d.rope_dim])?;
    let v_w = check::product(kernel, &[d.heads, d.v_dim])?;
    check::len(kernel, "kv", kv, check::product(kernel, &[d.rows, kv_w])?)?;
    check::len(
        kernel,
        "k_rope",
        k_rope,
        check::product(kernel, &[d.rows, d.rope_dim])?,
    )?;
    check::len(kernel, "k", k, check::product(kernel, &[d.rows, k_w])?)?;
    check::len(kernel, "v", v, check::product(kernel, &[d.rows, v_w])?)?;
    Ok((kv_w, k_w, v_w))
}

pub fn mla_kv_split(
    kv: &[f32],
    k_rope: &[f32],
    k: &mut [f32],
    v: &mut [f32],
    dims: MlaKvDims,
) -> Result<()> {
    let (kv_w, k_w, v_w) = check_mla(
        "mla_kv_split",
        kv.len(),
        k_rope.len(),
        k.len(),
        v.len(),
        dims,
    )?;
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
    Ok(())
}

pub fn mla_kv_join(
    dk: &[f32],
    dv: &[f32],
    d_kv: &mut [f32],
    d_k_rope: &mut [f32],
    dims: MlaKvDims,
) -> Result<()> {
    let (kv_w, k_w, v_w) = check_mla(
        "mla_kv_join",
        d_kv.len(),
        d_k_rope.len(),
        dk.len(),
        dv.len(),
        dims,
    )?;
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
            qkv_split(&qkv, &mut q, &mut k, &mut v, d).unwrap();
            assert_eq!((q.clone(), k.clone(), v.clone()), qkv_reference(&qkv, d));
            let mut back = vec![9.0; qkv.len()];
            qkv_join(&q, &k, &v, &mut back, d).unwrap();
            assert_eq!(back, qkv);
            assert!(qkv_split(&qkv[1..], &mut q, &mut k, &mut v, d).is_err());
            assert!(qkv_join(&q, &k[1..], &v, &mut back, d).is_err());
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
        mla_kv_split(&kv, &k_rope, &mut k, &mut v, d).unwrap();
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
        mla_kv_join(&dk, &dvv, &mut d_kv, &mut d_rope, d).unwrap();
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
        assert!(mla_kv_split(&kv, &k_rope[1..], &mut k, &mut v, d).is_err());
        assert!(mla_kv_join(&dk, &dvv, &mut d_kv[1..], &mut d_rope, d).is_err());
    }
}

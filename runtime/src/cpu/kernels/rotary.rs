//! Rotary position embedding, in place on a channel block of every head,
//! with positions counted from each sequence's start; rotate-half or
//! interleaved pairs ([`RotaryPairing`](crate::backend::RotaryPairing)).

use super::check;
use crate::backend::RotaryDims;
use crate::error::Result;

fn validate(kernel: &str, x: usize, dims: RotaryDims) -> Result<()> {
    check::ensure(dims.dim.is_multiple_of(2), || {
        format!("{kernel}: rotary dim {} is odd", dims.dim)
    })?;
    check::ensure(dims.offset + dims.dim <= dims.head_stride, || {
        format!(
            "{kernel}: channels {}..{} do not fit a head of {}",
            dims.offset,
            dims.offset + dims.dim,
            dims.head_stride
        )
    })?;
    let rows = dims.tokens.rows()?;
    check::len(
        kernel,
        "x",
        x,
        check::product(kernel, &[rows, dims.heads, dims.head_stride])?,
    )
}

/// Rotates every pair by `sign * theta` (sign -1 is the inverse rotation).
fn rotate(x: &mut [f32], dims: RotaryDims, sign: f32) {
    let half = dims.dim / 2;
    if half == 0 || dims.heads == 0 {
        return;
    }
    // inv_freq_i = 1 / base^(2i/dim), as Megatron computes it in f32.
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / dims.base.powf((2 * i) as f32 / dims.dim as f32))
        .collect();
    let row_len = dims.heads * dims.head_stride;
    for (r, row) in x.chunks_exact_mut(row_len).enumerate() {
        let pos = (r % dims.tokens.seq) as f32;
        for head in row.chunks_exact_mut(dims.head_stride) {
            let block = &mut head[dims.offset..dims.offset + dims.dim];
            for (i, &f) in inv_freq.iter().enumerate() {
                let (sin, cos) = (pos * f).sin_cos();
                let sin = sign * sin;
                let (a, b) = dims.pairing.pair(i, dims.dim);
                let (x1, x2) = (block[a], block[b]);
                block[a] = x1 * cos - x2 * sin;
                block[b] = x2 * cos + x1 * sin;
            }
        }
    }
}

pub fn rotary_forward(x: &mut [f32], dims: RotaryDims) -> Result<()> {
    validate("rotary_forward", x.len(), dims)?;
    rotate(x, dims, 1.0);
    Ok(())
}

pub fn rotary_backward(dx: &mut [f32], dims: RotaryDims) -> Result<()> {
    validate("rotary_backward", dx.len(), dims)?;
    rotate(dx, dims, -1.0);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{RotaryPairing, Tokens};

    fn dims() -> RotaryDims {
        RotaryDims {
            tokens: Tokens::new(2, 3),
            heads: 2,
            head_stride: 6,
            offset: 2,
            dim: 4,
            base: 10_000.0,
            pairing: RotaryPairing::RotateHalf,
        }
    }

    /// Each pairing turns its pair (a, b) of the rotated channels by
    /// `t * base^(-2i/dim)` and leaves the other channels: rotate-half
    /// pairs channel i with i + dim/2; MLA's interleaved pairing
    /// (Megatron's `mla_rotary_interleaved`) pairs 2i with 2i + 1.
    #[test]
    fn each_pairing_turns_its_pairs_and_leaves_other_channels() {
        let x: Vec<f32> = (0..72).map(|i| (i as f32 * 0.3).cos()).collect();
        for (pairing, pair) in [
            (
                RotaryPairing::RotateHalf,
                (|i| (i, i + 2)) as fn(usize) -> (usize, usize),
            ),
            (RotaryPairing::Interleaved, |i| (2 * i, 2 * i + 1)),
        ] {
            let d = RotaryDims { pairing, ..dims() };
            let mut y = x.clone();
            rotary_forward(&mut y, d).unwrap();
            for r in 0..6 {
                let pos = (r % 3) as f64;
                for h in 0..2 {
                    let base = (r * 2 + h) * 6;
                    assert_eq!(&y[base..base + 2], &x[base..base + 2]);
                    for i in 0..2 {
                        let theta = pos * 10_000f64.powf(-(2.0 * i as f64) / 4.0);
                        let (ia, ib) = pair(i);
                        let (at, bt) = (base + 2 + ia, base + 2 + ib);
                        let (a, b) = (x[at] as f64, x[bt] as f64);
                        let want_a = a * theta.cos() - b * theta.sin();
                        let want_b = b * theta.cos() + a * theta.sin();
                        let why = format!("{pairing:?}: row {r} head {h} pair {i}");
                        assert!((y[at] as f64 - want_a).abs() < 1e-5, "{why}");
                        assert!((y[bt] as f64 - want_b).abs() < 1e-5, "{why}");
                    }
                }
            }
        }
    }

    #[test]
    fn backward_is_the_transpose_of_forward() {
        for pairing in [RotaryPairing::RotateHalf, RotaryPairing::Interleaved] {
            transpose_holds(RotaryDims { pairing, ..dims() });
        }
    }

    // <R x, g> == <x, R^T g> for random x and g.
    fn transpose_holds(d: RotaryDims) {
        let x: Vec<f32> = (0..72).map(|i| (i as f32 * 0.7).sin()).collect();
        let g: Vec<f32> = (0..72).map(|i| (i as f32 * 1.1).cos()).collect();
        let mut rx = x.clone();
        rotary_forward(&mut rx, d).unwrap();
        let mut rtg = g.clone();
        rotary_backward(&mut rtg, d).unwrap();
        let lhs: f64 = rx.iter().zip(&g).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = x.iter().zip(&rtg).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!((lhs - rhs).abs() < 1e-4);
        assert!(rotary_forward(&mut rx[..71], d).is_err());
        assert!(rotary_forward(&mut rx, RotaryDims { offset: 3, ..d }).is_err());
    }
}

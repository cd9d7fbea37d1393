//! RMSNorm (plain and grouped) with its input- and weight-gradient halves.

use super::check;
use crate::backend::NormDims;
use crate::error::Result;

/// Checks the views and returns the group size.
fn validate(kernel: &str, dims: NormDims, x: usize, rstd: usize) -> Result<usize> {
    check::ensure(
        dims.groups > 0 && dims.dim.is_multiple_of(dims.groups),
        || {
            format!(
                "{kernel}: {} groups do not divide dim {}",
                dims.groups, dims.dim
            )
        },
    )?;
    check::len(
        kernel,
        "x",
        x,
        check::product(kernel, &[dims.rows, dims.dim])?,
    )?;
    check::len(
        kernel,
        "rstd",
        rstd,
        check::product(kernel, &[dims.rows, dims.groups])?,
    )?;
    Ok(dims.dim / dims.groups)
}

/// `kn` names the kernel in errors (the backend's method that called it).
pub fn rmsnorm_forward(
    kn: &str,
    x: &[f32],
    weight: &[f32],
    y: &mut [f32],
    rstd: &mut [f32],
    dims: NormDims,
) -> Result<()> {
    let gs = validate(kn, dims, x.len(), rstd.len())?;
    check::len(kn, "weight", weight.len(), dims.dim)?;
    check::len(kn, "y", y.len(), x.len())?;
    if gs == 0 {
        return Ok(());
    }
    let groups = x.chunks_exact(gs).zip(y.chunks_exact_mut(gs));
    for (i, ((xg, yg), r)) in groups.zip(rstd.iter_mut()).enumerate() {
        let wg = &weight[(i % dims.groups) * gs..][..gs];
        let mut sum = 0.0f32;
        for v in xg {
            sum += v * v;
        }
        let rs = 1.0 / (sum / gs as f32 + dims.eps).sqrt();
        *r = rs;
        for ((y, x), w) in yg.iter_mut().zip(xg).zip(wg) {
            *y = x * rs * w;
        }
    }
    Ok(())
}

/// `kn` names the kernel in errors (the backend's method that called it).
pub fn rmsnorm_backward_input(
    kn: &str,
    dy: &[f32],
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
    dims: NormDims,
) -> Result<()> {
    let gs = validate(kn, dims, x.len(), rstd.len())?;
    check::len(kn, "weight", weight.len(), dims.dim)?;
    check::len(kn, "dy", dy.len(), x.len())?;
    check::len(kn, "dx", dx.len(), x.len())?;
    if gs == 0 {
        return Ok(());
    }
    let groups = dy
        .chunks_exact(gs)
        .zip(x.chunks_exact(gs))
        .zip(dx.chunks_exact_mut(gs));
    for (i, (((dyg, xg), dxg), &rs)) in groups.zip(rstd).enumerate() {
        let wg = &weight[(i % dims.groups) * gs..][..gs];
        let mut gx = 0.0f32;
        for ((dy, x), w) in dyg.iter().zip(xg).zip(wg) {
            gx += w * dy * x;
        }
        let c = rs * rs * rs * gx / gs as f32;
        for (((dx, dy), x), w) in dxg.iter_mut().zip(dyg).zip(xg).zip(wg) {
            *dx += rs * (w * dy) - x * c;
        }
    }
    Ok(())
}

/// The weight gradient's partial sums (`Backend::rmsnorm_backward_input`):
/// `partials[s, j]` sums `dy * x * rstd` over slice `s`'s rows in row
/// order. `kn` names the kernel in errors.
pub fn rmsnorm_weight_partials(
    kn: &str,
    dy: &[f32],
    x: &[f32],
    rstd: &[f32],
    partials: &mut [f32],
    dims: NormDims,
) -> Result<()> {
    let gs = validate(kn, dims, x.len(), rstd.len())?;
    check::len(kn, "dy", dy.len(), x.len())?;
    check::len(kn, "partials", partials.len(), dims.weight_partials_len())?;
    partials.fill(0.0);
    if gs == 0 {
        return Ok(());
    }
    let slice_rows = dims.weight_slice_rows();
    let rows = dy.chunks_exact(dims.dim).zip(x.chunks_exact(dims.dim));
    for (r, (dyr, xr)) in rows.enumerate() {
        let slice = &mut partials[(r / slice_rows) * dims.dim..][..dims.dim];
        let rs = &rstd[r * dims.groups..][..dims.groups];
        let groups = slice.chunks_exact_mut(gs).zip(dyr.chunks_exact(gs));
        for ((pg, dyg), (xg, &rs)) in groups.zip(xr.chunks_exact(gs).zip(rs)) {
            for ((p, dy), x) in pg.iter_mut().zip(dyg).zip(xg) {
                *p += dy * x * rs;
            }
        }
    }
    Ok(())
}

/// `dw[j] += sum_s partials[s, j]`, the slices summed in order first.
pub fn rmsnorm_backward_weight(partials: &[f32], dw: &mut [f32], dims: NormDims) -> Result<()> {
    let kn = "rmsnorm_backward_weight";
    check::len(kn, "partials", partials.len(), dims.weight_partials_len())?;
    check::len(kn, "dw", dw.len(), dims.dim)?;
    if dims.dim == 0 {
        return Ok(());
    }
    for (j, dw) in dw.iter_mut().enumerate() {
        let sum: f32 = partials.iter().skip(j).step_by(dims.dim).sum();
        *dw += sum;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 1.3)
            .collect()
    }

    /// The forward in f64 from the definition.
    fn reference(x: &[f32], w: &[f32], dims: NormDims) -> Vec<f64> {
        let gs = dims.dim / dims.groups;
        let mut y = vec![0.0; x.len()];
        for (g, chunk) in x.chunks(gs).enumerate() {
            let ms: f64 = chunk.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / gs as f64;
            let rs = 1.0 / (ms + dims.eps as f64).sqrt();
            for (i, &v) in chunk.iter().enumerate() {
                y[g * gs + i] = v as f64 * rs * w[(g % dims.groups) * gs + i] as f64;
            }
        }
        y
    }

    #[test]
    fn forward_matches_reference_with_and_without_groups() {
        for groups in [1, 2, 4] {
            let dims = NormDims {
                rows: 3,
                dim: 8,
                groups,
                eps: 1e-5,
            };
            let x = data(24, 0.1);
            let w = data(8, 2.0);
            let (mut y, mut rstd) = (vec![0.0; 24], vec![0.0; 3 * groups]);
            rmsnorm_forward("rmsnorm_forward", &x, &w, &mut y, &mut rstd, dims).unwrap();
            for (a, b) in y.iter().zip(reference(&x, &w, dims)) {
                assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences_of_the_reference() {
        let dims = NormDims {
            rows: 2,
            dim: 6,
            groups: 2,
            eps: 1e-5,
        };
        let x = data(12, 0.4);
        let w = data(6, 1.1);
        let dy = data(12, 3.0);
        let (mut y, mut rstd) = (vec![0.0; 12], vec![0.0; 4]);
        rmsnorm_forward("rmsnorm_forward", &x, &w, &mut y, &mut rstd, dims).unwrap();
        let mut dx = vec![0.5; 12];
        rmsnorm_backward_input("rmsnorm_backward_input", &dy, &x, &w, &rstd, &mut dx, dims)
            .unwrap();
        let mut partials = vec![0.0; dims.weight_partials_len()];
        let kn = "rmsnorm_backward_input";
        rmsnorm_weight_partials(kn, &dy, &x, &rstd, &mut partials, dims).unwrap();
        let mut dw = vec![0.0; 6];
        rmsnorm_backward_weight(&partials, &mut dw, dims).unwrap();
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            reference(x, w, dims)
                .iter()
                .zip(&dy)
                .map(|(y, d)| y * *d as f64)
                .sum()
        };
        let h = 1e-3f32;
        for i in 0..12 {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let fd = (loss(&xp, &w) - loss(&xm, &w)) / (2.0 * h as f64);
            assert!(
                (dx[i] as f64 - 0.5 - fd).abs() < 1e-3,
                "dx[{i}] {} vs {fd}",
                dx[i] - 0.5
            );
        }
        for i in 0..6 {
            let (mut wp, mut wm) = (w.clone(), w.clone());
            wp[i] += h;
            wm[i] -= h;
            let fd = (loss(&x, &wp) - loss(&x, &wm)) / (2.0 * h as f64);
            assert!(
                (dw[i] as f64 - fd).abs() < 1e-3,
                "dw[{i}] {} vs {fd}",
                dw[i]
            );
        }
    }

    #[test]
    fn bad_group_counts_and_sizes_are_errors() {
        let dims = NormDims {
            rows: 1,
            dim: 6,
            groups: 4,
            eps: 1e-5,
        };
        let (mut y, mut r) = (vec![0.0; 6], vec![0.0; 4]);
        assert!(
            rmsnorm_forward(
                "rmsnorm_forward",
                &[0.0; 6],
                &[1.0; 6],
                &mut y,
                &mut r,
                dims
            )
            .is_err()
        );
        let dims = NormDims { groups: 1, ..dims };
        assert!(
            rmsnorm_forward(
                "rmsnorm_forward",
                &[0.0; 6],
                &[1.0; 5],
                &mut y,
                &mut r[..1],
                dims
            )
            .is_err()
        );
        assert!(
            rmsnorm_forward(
                "rmsnorm_forward",
                &[0.0; 6],
                &[1.0; 6],
                &mut y,
                &mut r[..1],
                dims
            )
            .is_ok()
        );
    }
}

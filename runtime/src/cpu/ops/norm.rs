//! RMSNorm (plain and grouped) with its input- and weight-gradient halves,
//! and the element-wise activations: SiLU, exact GELU, squared ReLU, and
//! the SiLU gate shared by SwiGLU and Mamba's output gate.

use crate::backend::{NormDims, NormKernels, Unary};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

impl NormKernels<CpuBuf> for CpuBackend {
    fn rmsnorm_forward_unchecked(
        &self,
        x: View<'_, CpuBuf>,
        weight: View<'_, CpuBuf>,
        y: ViewMut<'_, CpuBuf>,
        rstd: ViewMut<'_, CpuBuf>,
        x_copy: Option<ViewMut<'_, CpuBuf>>,
        dims: NormDims,
    ) -> Result<()> {
        let k = self.access("rmsnorm_forward");
        // Every view is registered before anything is written.
        let copy = match x_copy {
            Some(copy) => Some((k.bytes_in(x)?, k.bytes_out(copy)?)),
            None => None,
        };
        let (xs, w) = (k.f32_in("x", x)?, k.f32_in("weight", weight)?);
        let rstd = k.typed_out::<f32>("rstd", rstd)?;
        rmsnorm_forward(&xs, &w, &mut k.f32_out("y", y)?, rstd, dims);
        if let Some((src, dst)) = copy {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    fn rmsnorm_backward_input_unchecked(
        &self,
        dy: View<'_, CpuBuf>,
        x: View<'_, CpuBuf>,
        weight: View<'_, CpuBuf>,
        rstd: View<'_, CpuBuf>,
        dx: ViewMut<'_, CpuBuf>,
        dx_before: Option<ViewMut<'_, CpuBuf>>,
        partials: ViewMut<'_, CpuBuf>,
        dims: NormDims,
    ) -> Result<()> {
        let k = self.access("rmsnorm_backward_input");
        let (dy, x, w) = (
            k.f32_in("dy", dy)?,
            k.f32_in("x", x)?,
            k.f32_in("weight", weight)?,
        );
        let rstd = k.typed_in::<f32>("rstd", rstd)?;
        let partials = k.typed_out::<f32>("partials", partials)?;
        let mut dx = k.f32_out("dx", dx)?;
        if let Some(before) = dx_before {
            // Exact: dx's values widened to f32 go back to the same dtype.
            k.f32_out("dx_before", before)?.copy_from_slice(&dx);
        }
        rmsnorm_backward_input(&dy, &x, &w, rstd, &mut dx, dims);
        rmsnorm_weight_partials(&dy, &x, rstd, partials, dims);
        Ok(())
    }

    fn rmsnorm_backward_weight_unchecked(
        &self,
        partials: View<'_, CpuBuf>,
        dw: ViewMut<'_, CpuBuf>,
        dims: NormDims,
    ) -> Result<()> {
        let k = self.access("rmsnorm_backward_weight");
        let partials = k.typed_in::<f32>("partials", partials)?;
        rmsnorm_backward_weight(partials, &mut k.f32_out("dw", dw)?, dims);
        Ok(())
    }

    fn unary_forward_unchecked(
        &self,
        op: Unary,
        x: View<'_, CpuBuf>,
        y: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("unary_forward");
        let x = k.f32_in("x", x)?;
        unary_forward(op, &x, &mut k.f32_out("y", y)?);
        Ok(())
    }

    fn unary_backward_unchecked(
        &self,
        op: Unary,
        x: View<'_, CpuBuf>,
        dy: View<'_, CpuBuf>,
        dx: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("unary_backward");
        let (x, dy) = (k.f32_in("x", x)?, k.f32_in("dy", dy)?);
        unary_backward(op, &x, &dy, &mut k.f32_out("dx", dx)?);
        Ok(())
    }

    fn unary_backward_recompute_unchecked(
        &self,
        op: Unary,
        x: View<'_, CpuBuf>,
        dy_then_y: ViewMut<'_, CpuBuf>,
        dx: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("unary_backward_recompute");
        let x = k.f32_in("x", x)?;
        let mut dy_then_y = k.f32_out("dy_then_y", dy_then_y)?;
        unary_backward(op, &x, &dy_then_y, &mut k.f32_out("dx", dx)?);
        unary_forward(op, &x, &mut dy_then_y);
        Ok(())
    }

    fn silu_mul_forward_unchecked(
        &self,
        gate: View<'_, CpuBuf>,
        up: View<'_, CpuBuf>,
        y: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("silu_mul_forward");
        let (gate, up) = (k.f32_in("gate", gate)?, k.f32_in("up", up)?);
        silu_mul_forward(&gate, &up, &mut k.f32_out("y", y)?);
        Ok(())
    }

    fn silu_mul_backward_unchecked(
        &self,
        gate: View<'_, CpuBuf>,
        up: View<'_, CpuBuf>,
        dy: View<'_, CpuBuf>,
        dgate: ViewMut<'_, CpuBuf>,
        dup: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("silu_mul_backward");
        let (gate, up, dy) = (
            k.f32_in("gate", gate)?,
            k.f32_in("up", up)?,
            k.f32_in("dy", dy)?,
        );
        silu_mul_backward(
            &gate,
            &up,
            &dy,
            &mut k.f32_out("dgate", dgate)?,
            &mut k.f32_out("dup", dup)?,
        );
        Ok(())
    }

    fn silu_mul_backward_recompute_unchecked(
        &self,
        gate: View<'_, CpuBuf>,
        up: View<'_, CpuBuf>,
        dy_then_y: ViewMut<'_, CpuBuf>,
        dgate: ViewMut<'_, CpuBuf>,
        dup: ViewMut<'_, CpuBuf>,
    ) -> Result<()> {
        let k = self.access("silu_mul_backward_recompute");
        let (gate, up) = (k.f32_in("gate", gate)?, k.f32_in("up", up)?);
        let mut dy_then_y = k.f32_out("dy_then_y", dy_then_y)?;
        silu_mul_backward(
            &gate,
            &up,
            &dy_then_y,
            &mut k.f32_out("dgate", dgate)?,
            &mut k.f32_out("dup", dup)?,
        );
        silu_mul_forward(&gate, &up, &mut dy_then_y);
        Ok(())
    }
}

// ---- RMSNorm ------------------------------------------------------------------
// The loops take slices whose lengths `backend::norm`'s checks accepted.

pub fn rmsnorm_forward(x: &[f32], weight: &[f32], y: &mut [f32], rstd: &mut [f32], dims: NormDims) {
    let gs = dims.dim / dims.groups;
    if gs == 0 {
        return;
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
}

pub fn rmsnorm_backward_input(
    dy: &[f32],
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
    dims: NormDims,
) {
    let gs = dims.dim / dims.groups;
    if gs == 0 {
        return;
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
}

/// The weight gradient's partial sums (`Backend::rmsnorm_backward_input`):
/// `partials[s, j]` sums `dy * x * rstd` over slice `s`'s rows in row
/// order.
pub fn rmsnorm_weight_partials(
    dy: &[f32],
    x: &[f32],
    rstd: &[f32],
    partials: &mut [f32],
    dims: NormDims,
) {
    partials.fill(0.0);
    let gs = dims.dim / dims.groups;
    if gs == 0 {
        return;
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
}

/// `dw[j] += sum_s partials[s, j]`, the slices summed in order first.
pub fn rmsnorm_backward_weight(partials: &[f32], dw: &mut [f32], dims: NormDims) {
    if dims.dim == 0 {
        return;
    }
    for (j, dw) in dw.iter_mut().enumerate() {
        let sum: f32 = partials.iter().skip(j).step_by(dims.dim).sum();
        *dw += sum;
    }
}

// ---- activations ---------------------------------------------------------------

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// erf in f64: its Maclaurin series below 3 (terms fall below 1e-17
/// relative within ~60 terms), a continued fraction for erfc above.
fn erf(x: f64) -> f64 {
    let a = x.abs();
    let value = if a < 3.0 {
        let x2 = a * a;
        let mut term = a;
        let mut sum = a;
        let mut n = 0.0f64;
        while n < 100.0 {
            n += 1.0;
            term *= -x2 / n;
            let t = term / (2.0 * n + 1.0);
            sum += t;
            if t.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        // erfc(a) = exp(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + ...)))).
        let mut f = a;
        for n in (1..=60).rev() {
            f = a + (n as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
    };
    value.copysign(x)
}

/// `Phi(x) = (1 + erf(x / sqrt 2)) / 2`.
fn normal_cdf(x: f32) -> f32 {
    (0.5 * (1.0 + erf(x as f64 * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

fn forward_one(op: Unary, x: f32) -> f32 {
    match op {
        Unary::Silu => x * sigmoid(x),
        Unary::Gelu => x * normal_cdf(x),
        Unary::SquaredRelu => {
            let r = x.max(0.0);
            r * r
        }
    }
}

fn derivative(op: Unary, x: f32) -> f32 {
    match op {
        Unary::Silu => {
            let s = sigmoid(x);
            s * (1.0 + x * (1.0 - s))
        }
        Unary::Gelu => {
            let pdf = (-0.5 * x * x).exp()
                * (0.5 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2);
            normal_cdf(x) + x * pdf
        }
        Unary::SquaredRelu => 2.0 * x.max(0.0),
    }
}

pub fn unary_forward(op: Unary, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = forward_one(op, x);
    }
}

pub fn unary_backward(op: Unary, x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        *dx = dy * derivative(op, x);
    }
}

pub fn silu_mul_forward(gate: &[f32], up: &[f32], y: &mut [f32]) {
    for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
        *y = g * sigmoid(g) * u;
    }
}

pub fn silu_mul_backward(gate: &[f32], up: &[f32], dy: &[f32], dgate: &mut [f32], dup: &mut [f32]) {
    let inputs = gate.iter().zip(up).zip(dy);
    for (((&g, &u), &d), (dg, du)) in inputs.zip(dgate.iter_mut().zip(dup.iter_mut())) {
        let s = sigmoid(g);
        *dg = d * u * s * (1.0 + g * (1.0 - s));
        *du = d * g * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_known_values() {
        // Values from tables of the error function.
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (2.9, 0.999_958_902_121_900_1),
            (3.0, 0.999_977_909_503_001_4),
            (4.0, 0.999_999_984_582_742_1),
            (-1.0, -0.842_700_792_949_714_9),
        ] {
            assert!(
                (erf(x) - want).abs() < 1e-11,
                "erf({x}) = {} vs {want}",
                erf(x)
            );
        }
    }

    #[test]
    fn derivatives_match_central_differences() {
        let xs: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.1 + 0.013).collect();
        for op in [Unary::Silu, Unary::Gelu, Unary::SquaredRelu] {
            let mut dx = vec![0.0; xs.len()];
            unary_backward(op, &xs, &vec![1.0; xs.len()], &mut dx);
            for (&x, &d) in xs.iter().zip(&dx) {
                let h = 1e-3f64;
                let f = |x: f64| -> f64 {
                    match op {
                        Unary::Silu => x / (1.0 + (-x).exp()),
                        Unary::Gelu => 0.5 * x * (1.0 + erf(x / 2f64.sqrt())),
                        Unary::SquaredRelu => x.max(0.0).powi(2),
                    }
                };
                let fd = (f(x as f64 + h) - f(x as f64 - h)) / (2.0 * h);
                assert!((d as f64 - fd).abs() < 1e-4, "{op:?}'({x}) = {d} vs {fd}");
                let mut y = [0.0f32];
                unary_forward(op, &[x], &mut y);
                assert!((y[0] as f64 - f(x as f64)).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn silu_gate_backward_matches_central_differences() {
        let gate: Vec<f32> = (0..9).map(|i| i as f32 * 0.7 - 3.0).collect();
        let up: Vec<f32> = (0..9).map(|i| 1.5 - i as f32 * 0.3).collect();
        let dy = vec![1.0f32; 9];
        let (mut dg, mut du) = (vec![0.0; 9], vec![0.0; 9]);
        silu_mul_backward(&gate, &up, &dy, &mut dg, &mut du);
        let f = |g: f64, u: f64| g / (1.0 + (-g).exp()) * u;
        for i in 0..9 {
            let (g, u, h) = (gate[i] as f64, up[i] as f64, 1e-4);
            let fdg = (f(g + h, u) - f(g - h, u)) / (2.0 * h);
            let fdu = (f(g, u + h) - f(g, u - h)) / (2.0 * h);
            assert!((dg[i] as f64 - fdg).abs() < 1e-4);
            assert!((du[i] as f64 - fdu).abs() < 1e-4);
        }
    }

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
            rmsnorm_forward(&x, &w, &mut y, &mut rstd, dims);
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
        rmsnorm_forward(&x, &w, &mut y, &mut rstd, dims);
        let mut dx = vec![0.5; 12];
        rmsnorm_backward_input(&dy, &x, &w, &rstd, &mut dx, dims);
        let mut partials = vec![0.0; dims.weight_partials_len()];
        rmsnorm_weight_partials(&dy, &x, &rstd, &mut partials, dims);
        let mut dw = vec![0.0; 6];
        rmsnorm_backward_weight(&partials, &mut dw, dims);
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
}

//! Element-wise activations and their derivatives: SiLU, exact GELU,
//! squared ReLU, and the SiLU gate shared by SwiGLU and Mamba's output gate.

use super::check;
use crate::backend::Unary;
use crate::error::Result;

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

pub fn unary_forward(op: Unary, x: &[f32], y: &mut [f32]) -> Result<()> {
    check::len("unary_forward", "y", y.len(), x.len())?;
    for (y, &x) in y.iter_mut().zip(x) {
        *y = forward_one(op, x);
    }
    Ok(())
}

pub fn unary_backward(op: Unary, x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<()> {
    check::len("unary_backward", "dy", dy.len(), x.len())?;
    check::len("unary_backward", "dx", dx.len(), x.len())?;
    for ((dx, &dy), &x) in dx.iter_mut().zip(dy).zip(x) {
        *dx = dy * derivative(op, x);
    }
    Ok(())
}

pub fn silu_mul_forward(gate: &[f32], up: &[f32], y: &mut [f32]) -> Result<()> {
    check::len("silu_mul_forward", "up", up.len(), gate.len())?;
    check::len("silu_mul_forward", "y", y.len(), gate.len())?;
    for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
        *y = g * sigmoid(g) * u;
    }
    Ok(())
}

pub fn silu_mul_backward(
    gate: &[f32],
    up: &[f32],
    dy: &[f32],
    dgate: &mut [f32],
    dup: &mut [f32],
) -> Result<()> {
    let kn = "silu_mul_backward";
    for (view, len) in [
        ("up", up.len()),
        ("dy", dy.len()),
        ("dgate", dgate.len()),
        ("dup", dup.len()),
    ] {
        check::len(kn, view, len, gate.len())?;
    }
    let inputs = gate.iter().zip(up).zip(dy);
    for (((&g, &u), &d), (dg, du)) in inputs.zip(dgate.iter_mut().zip(dup.iter_mut())) {
        let s = sigmoid(g);
        *dg = d * u * s * (1.0 + g * (1.0 - s));
        *du = d * g * s;
    }
    Ok(())
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
            unary_backward(op, &xs, &vec![1.0; xs.len()], &mut dx).unwrap();
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
                unary_forward(op, &[x], &mut y).unwrap();
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
        silu_mul_backward(&gate, &up, &dy, &mut dg, &mut du).unwrap();
        let f = |g: f64, u: f64| g / (1.0 + (-g).exp()) * u;
        for i in 0..9 {
            let (g, u, h) = (gate[i] as f64, up[i] as f64, 1e-4);
            let fdg = (f(g + h, u) - f(g - h, u)) / (2.0 * h);
            let fdu = (f(g, u + h) - f(g, u - h)) / (2.0 * h);
            assert!((dg[i] as f64 - fdg).abs() < 1e-4);
            assert!((du[i] as f64 - fdu).abs() < 1e-4);
        }
        assert!(silu_mul_backward(&gate, &up[..8], &dy, &mut dg, &mut du).is_err());
    }
}

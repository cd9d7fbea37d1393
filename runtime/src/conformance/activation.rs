//! Element-wise activations: every [`Unary`] op forward and backward, and
//! the SiLU gate forward and backward, over a range that reaches the
//! saturated tails and includes zero.

use super::Suite;
use super::case::{Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{Backend, Unary};

/// Inputs from -8 to 8 plus the points where the functions change form.
fn inputs<B: Backend>(s: &mut Suite<'_, B>, len: usize) -> Vec<f64> {
    let mut x = vec![0.0, -0.0, 1e-3, -1e-3, 8.0, -8.0, 3.0, -3.0];
    x.extend(s.rng.values(len, -6.0, 6.0));
    x
}

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, op) in [Unary::Silu, Unary::Gelu, Unary::SquaredRelu]
        .into_iter()
        .enumerate()
    {
        let x = inputs(s, 300);
        let n = x.len();
        let fwd = KernelCase::new("unary_forward", format!("{op:?}, {n} elements"))
            .input("x", x.clone())
            .output("y", n)
            .tolerance(8.0 * U, 16.0 * U);
        let fwd = if i == 0 { fwd.with_refusals() } else { fwd };
        s.check_kernel(
            fwd,
            |x| {
                let y = x["x"].iter().map(|&v| r::unary(op, v)).collect();
                vec![Expected::new("y", y)]
            },
            |dev, b| {
                dev.unary_forward(op, b.view("x")?, b.view_mut("y")?)?;
                Ok(vec![])
            },
        );
        let bwd = KernelCase::new("unary_backward", format!("{op:?}, {n} elements"))
            .input("x", x)
            .input("dy", s.rng.values(n, -2.0, 2.0))
            .output("dx", n)
            .tolerance(16.0 * U, 16.0 * U);
        let bwd = if i == 0 { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let dx = x["x"].iter().zip(&x["dy"]);
                let dx = dx.map(|(&v, g)| g * r::unary_derivative(op, v)).collect();
                vec![Expected::new("dx", dx)]
            },
            |dev, b| {
                dev.unary_backward(op, b.view("x")?, b.view("dy")?, b.view_mut("dx")?)?;
                Ok(vec![])
            },
        );
        let recompute =
            KernelCase::new("unary_backward_recompute", format!("{op:?}, {n} elements"))
                .input("x", inputs(s, n - 8))
                .inout("dy_then_y", s.rng.values(n, -2.0, 2.0))
                .output("dx", n)
                .tolerance(16.0 * U, 16.0 * U);
        let recompute = if i == 0 {
            recompute.with_refusals()
        } else {
            recompute
        };
        s.check_kernel(
            recompute,
            |x| {
                let dx = x["x"].iter().zip(&x["dy_then_y"]);
                let dx = dx.map(|(&v, g)| g * r::unary_derivative(op, v)).collect();
                let y = x["x"].iter().map(|&v| r::unary(op, v)).collect();
                vec![Expected::new("dx", dx), Expected::new("dy_then_y", y)]
            },
            |dev, b| {
                dev.unary_backward_recompute(
                    op,
                    b.view("x")?,
                    b.view_mut("dy_then_y")?,
                    b.view_mut("dx")?,
                )?;
                Ok(vec![])
            },
        );
    }

    // A length of whole 8-element words (a GPU's 8-a-thread path in bf16)
    // and one past it.
    for len in [200, 201] {
        let gate = inputs(s, len);
        let n = gate.len();
        let up = s.rng.values(n, -2.0, 2.0);
        let fwd = KernelCase::new("silu_mul_forward", format!("{n} elements"))
            .input("gate", gate.clone())
            .input("up", up.clone())
            .output("y", n)
            .tolerance(8.0 * U, 16.0 * U)
            .with_refusals();
        s.check_kernel(
            fwd,
            |x| {
                let y = x["gate"].iter().zip(&x["up"]);
                let y = y.map(|(&g, u)| r::unary(Unary::Silu, g) * u).collect();
                vec![Expected::new("y", y)]
            },
            |dev, b| {
                dev.silu_mul_forward(b.view("gate")?, b.view("up")?, b.view_mut("y")?)?;
                Ok(vec![])
            },
        );
        let bwd = KernelCase::new("silu_mul_backward", format!("{n} elements"))
            .input("gate", gate.clone())
            .input("up", up.clone())
            .input("dy", s.rng.values(n, -2.0, 2.0))
            .output("dgate", n)
            .output("dup", n)
            .tolerance(16.0 * U, 16.0 * U)
            .with_refusals();
        s.check_kernel(
            bwd,
            |x| {
                let (g, u, dy) = (&x["gate"], &x["up"], &x["dy"]);
                let dgate = (0..g.len())
                    .map(|i| dy[i] * u[i] * r::unary_derivative(Unary::Silu, g[i]))
                    .collect();
                let dup = (0..g.len())
                    .map(|i| dy[i] * r::unary(Unary::Silu, g[i]))
                    .collect();
                vec![Expected::new("dgate", dgate), Expected::new("dup", dup)]
            },
            |dev, b| {
                dev.silu_mul_backward(
                    b.view("gate")?,
                    b.view("up")?,
                    b.view("dy")?,
                    b.view_mut("dgate")?,
                    b.view_mut("dup")?,
                )?;
                Ok(vec![])
            },
        );
        let recompute = KernelCase::new("silu_mul_backward_recompute", format!("{n} elements"))
            .input("gate", gate)
            .input("up", up)
            .inout("dy_then_y", s.rng.values(n, -2.0, 2.0))
            .output("dgate", n)
            .output("dup", n)
            .tolerance(16.0 * U, 16.0 * U)
            .with_refusals();
        s.check_kernel(
            recompute,
            |x| {
                let (g, u, dy) = (&x["gate"], &x["up"], &x["dy_then_y"]);
                let silu = |i: usize| r::unary(Unary::Silu, g[i]);
                let dgate = (0..g.len())
                    .map(|i| dy[i] * u[i] * r::unary_derivative(Unary::Silu, g[i]))
                    .collect();
                let dup = (0..g.len()).map(|i| dy[i] * silu(i)).collect();
                let y = (0..g.len()).map(|i| silu(i) * u[i]).collect();
                vec![
                    Expected::new("dgate", dgate),
                    Expected::new("dup", dup),
                    Expected::new("dy_then_y", y),
                ]
            },
            |dev, b| {
                dev.silu_mul_backward_recompute(
                    b.view("gate")?,
                    b.view("up")?,
                    b.view_mut("dy_then_y")?,
                    b.view_mut("dgate")?,
                    b.view_mut("dup")?,
                )?;
                Ok(vec![])
            },
        );
    }
}

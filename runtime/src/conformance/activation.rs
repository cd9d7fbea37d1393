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
        // The recomputing form also ends with f(x) in the gradient's buffer.
        for recompute in [false, true] {
            let (kernel, dy) = if recompute {
                ("unary_backward_recompute", "dy_then_y")
            } else {
                ("unary_backward", "dy")
            };
            let case =
                KernelCase::new(kernel, format!("{op:?}, {n} elements")).input("x", x.clone());
            let g = s.rng.values(n, -2.0, 2.0);
            let case = if recompute {
                case.inout(dy, g)
            } else {
                case.input(dy, g)
            };
            let case = case.output("dx", n).tolerance(16.0 * U, 16.0 * U);
            let case = if i == 0 { case.with_refusals() } else { case };
            s.check_kernel(
                case,
                |x| {
                    let dx = x["x"].iter().zip(&x[dy]);
                    let dx = dx.map(|(&v, g)| g * r::unary_derivative(op, v)).collect();
                    let mut expected = vec![Expected::new("dx", dx)];
                    if recompute {
                        let y = x["x"].iter().map(|&v| r::unary(op, v)).collect();
                        expected.push(Expected::new(dy, y));
                    }
                    expected
                },
                |dev, b| {
                    let (x, dx) = (b.view("x")?, b.view_mut("dx")?);
                    if recompute {
                        dev.unary_backward_recompute(op, x, b.view_mut(dy)?, dx)?;
                    } else {
                        dev.unary_backward(op, x, b.view(dy)?, dx)?;
                    }
                    Ok(vec![])
                },
            );
        }
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
        // The recomputing form also ends with silu(gate) * up in the
        // gradient's buffer.
        for recompute in [false, true] {
            let (kernel, dy) = if recompute {
                ("silu_mul_backward_recompute", "dy_then_y")
            } else {
                ("silu_mul_backward", "dy")
            };
            let case = KernelCase::new(kernel, format!("{n} elements"))
                .input("gate", gate.clone())
                .input("up", up.clone());
            let g = s.rng.values(n, -2.0, 2.0);
            let case = if recompute {
                case.inout(dy, g)
            } else {
                case.input(dy, g)
            };
            let case = case
                .output("dgate", n)
                .output("dup", n)
                .tolerance(16.0 * U, 16.0 * U)
                .with_refusals();
            s.check_kernel(
                case,
                |x| {
                    let (g, u, d) = (&x["gate"], &x["up"], &x[dy]);
                    let silu = |i: usize| r::unary(Unary::Silu, g[i]);
                    let dgate = (0..g.len())
                        .map(|i| d[i] * u[i] * r::unary_derivative(Unary::Silu, g[i]))
                        .collect();
                    let dup = (0..g.len()).map(|i| d[i] * silu(i)).collect();
                    let mut expected =
                        vec![Expected::new("dgate", dgate), Expected::new("dup", dup)];
                    if recompute {
                        let y = (0..g.len()).map(|i| silu(i) * u[i]).collect();
                        expected.push(Expected::new(dy, y));
                    }
                    expected
                },
                |dev, b| {
                    let (gate, up) = (b.view("gate")?, b.view("up")?);
                    let (dgate, dup) = (b.view_mut("dgate")?, b.view_mut("dup")?);
                    if recompute {
                        dev.silu_mul_backward_recompute(gate, up, b.view_mut(dy)?, dgate, dup)?;
                    } else {
                        dev.silu_mul_backward(gate, up, b.view(dy)?, dgate, dup)?;
                    }
                    Ok(vec![])
                },
            );
        }
    }
}

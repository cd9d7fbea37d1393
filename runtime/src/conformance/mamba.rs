//! Mamba kernels: the causal depthwise conv1d (forward, input and weight
//! gradients) over several sequences, some shorter than the kernel, and the
//! SSD selective scan forward and backward with chunk lengths that do and
//! do not divide the sequence.

use super::Suite;
use super::case::{Expected, KernelCase, Values};
use super::dense::U;
use super::reference::{self as r, ScanValues};
use crate::backend::{Backend, ConvDims, ScanDims, ScanGrads, ScanInputs, Tokens};

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    conv1d(s);
    scan(s);
}

fn conv1d<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, channels, kernel width
    let shapes = [
        (2, 5, 17, 4),
        (1, 1, 3, 4),
        (3, 7, 5, 1),
        (2, 2, 4, 4),
        (1, 9, 2, 3),
    ];
    for (i, (batch, seq, channels, kernel)) in shapes.into_iter().enumerate() {
        let dims = ConvDims {
            tokens: Tokens::new(batch, seq),
            channels,
            kernel,
        };
        let rows = batch * seq;
        let name = format!("{batch} x {seq} tokens, {channels} channels, width {kernel}");
        let x = s.rng.values(rows * channels, -2.0, 2.0);
        let w = s.rng.values(channels * kernel, -2.0, 2.0);
        let dy = s.rng.values(rows * channels, -2.0, 2.0);
        let refusals = i == 0;
        let taps = kernel as f64 + 1.0;

        let fwd = KernelCase::new("conv1d_forward", name.clone())
            .input("x", x.clone())
            .input("weight", w.clone())
            .input("bias", s.rng.values(channels, -2.0, 2.0))
            .output("y", rows * channels)
            .tolerance(32.0 * U * taps, 16.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        if refusals {
            let bad = ConvDims { kernel: 0, ..dims };
            s.check_refusal(&fwd, "kernel width 0", &[], |dev, b| {
                dev.conv1d_forward(
                    b.view("x")?,
                    b.view("weight")?,
                    b.view("bias")?,
                    b.view_mut("y")?,
                    bad,
                )?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            fwd,
            |x| {
                let y = r::conv1d_forward(&x["x"], &x["weight"], &x["bias"], dims);
                vec![Expected::new("y", y)]
            },
            |dev, b| {
                dev.conv1d_forward(
                    b.view("x")?,
                    b.view("weight")?,
                    b.view("bias")?,
                    b.view_mut("y")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let bwd = KernelCase::new("conv1d_backward_input", name.clone())
            .input("dy", dy.clone())
            .input("weight", w)
            .output("dx", rows * channels)
            .tolerance(32.0 * U * taps, 16.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let dx = r::conv1d_backward_input(&x["dy"], &x["weight"], dims);
                vec![Expected::new("dx", dx)]
            },
            |dev, b| {
                dev.conv1d_backward_input(
                    b.view("dy")?,
                    b.view("weight")?,
                    b.view_mut("dx")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let wgrad = KernelCase::new("conv1d_backward_weight", name)
            .input("dy", dy)
            .input("x", x)
            .inout("dw", s.rng.values(channels * kernel, -2.0, 2.0))
            .inout("dbias", s.rng.values(channels, -2.0, 2.0))
            .tolerance(32.0 * U * (rows as f64 + 1.0), 16.0 * U);
        let wgrad = if refusals {
            wgrad.with_refusals()
        } else {
            wgrad
        };
        s.check_kernel(
            wgrad,
            |x| {
                let (dw, dbias) =
                    r::conv1d_backward_weight(&x["dy"], &x["x"], &x["dw"], &x["dbias"], dims);
                vec![Expected::new("dw", dw), Expected::new("dbias", dbias)]
            },
            |dev, b| {
                dev.conv1d_backward_weight(
                    b.view("dy")?,
                    b.view("x")?,
                    b.view_mut("dw")?,
                    b.view_mut("dbias")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

fn scan_values<'a>(x: &'a Values) -> ScanValues<'a> {
    ScanValues {
        xbc: &x["xbc"],
        dt: &x["dt"],
        dt_bias: &x["dt_bias"],
        a_log: &x["a_log"],
        d: &x["d"],
    }
}

/// The gradient of `sum dy . y` with respect to `xbc | dt | a_log | d`,
/// by finite differences of the f64 forward (the trait defines the scan's
/// backward only as the gradient of its forward).
fn scan_gradient(x: &Values, dims: ScanDims) -> Vec<f64> {
    let (nx, nt, h) = (x["xbc"].len(), x["dt"].len(), dims.heads);
    let mut at = Vec::with_capacity(nx + nt + 2 * h);
    for name in ["xbc", "dt", "a_log", "d"] {
        at.extend_from_slice(&x[name]);
    }
    let dy = &x["dy"];
    r::gradient(&at, |v| {
        let values = ScanValues {
            xbc: &v[..nx],
            dt: &v[nx..nx + nt],
            dt_bias: &x["dt_bias"],
            a_log: &v[nx + nt..nx + nt + h],
            d: &v[nx + nt + h..],
        };
        let (y, _) = r::ssd_scan_forward(&values, dims);
        y.iter().zip(dy).map(|(a, b)| a * b).sum()
    })
}

fn scan_inputs<'b, B: Backend>(
    b: &'b super::case::Bufs<B>,
) -> crate::Result<ScanInputs<crate::backend::Slice<'b, B>>> {
    Ok(ScanInputs {
        xbc: b.view("xbc")?,
        dt: b.view("dt")?,
        dt_bias: b.view("dt_bias")?,
        a_log: b.view("a_log")?,
        d: b.view("d")?,
    })
}

fn scan<B: Backend>(s: &mut Suite<'_, B>) {
    // batch, seq, heads, head dim, groups, state, chunk
    let shapes = [
        (2, 7, 4, 3, 2, 5, 3),
        (1, 5, 1, 2, 1, 3, 8),
        (2, 6, 2, 4, 2, 2, 2),
        (1, 4, 4, 1, 1, 1, 1),
    ];
    for (i, (batch, seq, heads, head_dim, groups, state, chunk)) in shapes.into_iter().enumerate() {
        let dims = ScanDims {
            tokens: Tokens::new(batch, seq),
            heads,
            head_dim,
            groups,
            state,
            chunk,
        };
        let rows = batch * seq;
        let name = format!(
            "{batch} x {seq} tokens, H={heads} P={head_dim} G={groups} N={state}, chunk {chunk}"
        );
        let xbc = s.rng.values(rows * dims.xbc_width(), -1.5, 1.5);
        // softplus(dt + bias) spans ~0.05..1.7 and A = -exp(a_log) ~ -0.4..-2.7:
        // per-step decays from ~0.01 to ~0.98.
        let dt = s.rng.values(rows * heads, -2.0, 1.0);
        let dt_bias = s.rng.values(heads, -1.0, 0.5);
        let a_log = s.rng.values(heads, -1.0, 1.0);
        let d = s.rng.values(heads, -1.0, 1.0);
        let refusals = i == 0;
        let y_len = rows * heads * head_dim;
        // Errors grow along the recurrence (seq steps) and with the state size.
        let steps = (seq as f64).max(1.0) * state as f64;

        let fwd = KernelCase::new("ssd_scan_forward", name.clone())
            .input("xbc", xbc.clone())
            .input("dt", dt.clone())
            .input("dt_bias", dt_bias.clone())
            .input("a_log", a_log.clone())
            .input("d", d.clone())
            .output("y", y_len)
            .output_f32("states", dims.states_len())
            .tolerance(64.0 * U * steps, 64.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        if refusals {
            for (what, bad) in [
                (
                    "groups that do not divide heads",
                    ScanDims { groups: 3, ..dims },
                ),
                ("chunk length 0", ScanDims { chunk: 0, ..dims }),
            ] {
                s.check_refusal(&fwd, what, &[], |dev, b| {
                    dev.ssd_scan_forward(
                        scan_inputs(b)?,
                        b.view_mut("y")?,
                        b.view_mut("states")?,
                        bad,
                    )?;
                    Ok(vec![])
                });
            }
        }
        s.check_kernel(
            fwd,
            |x| {
                let (y, states) = r::ssd_scan_forward(&scan_values(x), dims);
                vec![Expected::new("y", y), Expected::new("states", states)]
            },
            |dev, b| {
                dev.ssd_scan_forward(
                    scan_inputs(b)?,
                    b.view_mut("y")?,
                    b.view_mut("states")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let bwd = KernelCase::new("ssd_scan_backward", name)
            .input("xbc", xbc)
            .input("dt", dt)
            .input("dt_bias", dt_bias)
            .input("a_log", a_log)
            .input("d", d)
            .input("dy", s.rng.values(y_len, -2.0, 2.0))
            .input_f32_from("states", move |x| {
                r::ssd_scan_forward(&scan_values(x), dims).1
            })
            .output("d_xbc", rows * dims.xbc_width())
            .output("d_dt", rows * heads)
            .inout("d_a_log", s.rng.values(heads, -2.0, 2.0))
            .inout("d_d", s.rng.values(heads, -2.0, 2.0))
            .tolerance(256.0 * U * steps, 64.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let g = scan_gradient(x, dims);
                let (nx, nt) = (x["xbc"].len(), x["dt"].len());
                let acc = |init: &[f64], grad: &[f64]| -> Vec<f64> {
                    init.iter().zip(grad).map(|(a, b)| a + b).collect()
                };
                vec![
                    Expected::new("d_xbc", g[..nx].to_vec()),
                    Expected::new("d_dt", g[nx..nx + nt].to_vec()),
                    Expected::new("d_a_log", acc(&x["d_a_log"], &g[nx + nt..nx + nt + heads])),
                    Expected::new("d_d", acc(&x["d_d"], &g[nx + nt + heads..])),
                ]
            },
            |dev, b| {
                dev.ssd_scan_backward(
                    scan_inputs(b)?,
                    b.view("states")?,
                    b.view("dy")?,
                    ScanGrads {
                        xbc: b.view_mut("d_xbc")?,
                        dt: b.view_mut("d_dt")?,
                        a_log: b.view_mut("d_a_log")?,
                        d: b.view_mut("d_d")?,
                    },
                    dims,
                )?;
                Ok(vec![])
            },
        );
    }
}

//! RMSNorm, plain and grouped: forward, input gradient (with the weight
//! gradient's partial sums), weight gradient from those sums.

use super::Suite;
use super::case::{Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{Backend, NormDims};

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    let shapes = [
        (5, 24, 1),
        (5, 24, 2),
        (5, 24, 4),
        (3, 130, 1),
        (3, 130, 5),
        (1, 1, 1),
        // Groups of a multiple of 8 channels (the GPU's 8-channels-a-thread
        // paths), rows over several slices of the weight gradient's sums.
        (1100, 96, 2),
        // The GPU's one-pass backward: a group a warp, groups of 16 and 4
        // words inside a warp (the last with idle lanes, and rows past the
        // most slices), groups of 8 and of 2 warps (the benchmark's pre-norm
        // and Mamba's gated norm, a block a group), a row of more than 512
        // words in groups of 256 (a block a group); then a row of more than
        // 512 words in one group, which it leaves to the two-pass way.
        (1100, 256, 1),
        (300, 512, 4),
        (5000, 64, 2),
        (40, 2048, 1),
        (33, 4096, 8),
        (9, 8192, 4),
        (20, 8200, 1),
    ];
    for (i, (rows, dim, groups)) in shapes.into_iter().enumerate() {
        let dims = NormDims {
            rows,
            dim,
            groups,
            eps: 1e-5,
        };
        let name = format!("{rows} rows of {dim}, {groups} groups");
        let x = s.rng.values(rows * dim, -2.0, 2.0);
        let w = s.rng.values(dim, -2.0, 2.0);
        let dy = s.rng.values(rows * dim, -2.0, 2.0);
        let gs = (dim / groups) as f64;
        // The backwards take `rstd` from the forward, as f32: give them the
        // reference's, so each kernel is checked on its own (the reference
        // backward uses the `rstd` given, as the kernel does).
        let rstd = r::rmsnorm_forward(&x, &w, dims).1;
        let refusals = i == 1;
        let (slices, partials) = (dims.weight_slices(), dims.weight_partials_len());
        let slice_rows = dims.weight_slice_rows() as f64;

        // Each pass plain, and keeping a copy in the same pass (of x; of dx
        // as it was): the same outputs, and the copy exact.
        for keep in [false, true] {
            let case = match keep {
                false => name.clone(),
                true => format!("{name}, keeping a copy"),
            };
            let fwd = KernelCase::new("rmsnorm_forward", case.clone())
                .input("x", x.clone())
                .input("weight", w.clone())
                .output("y", rows * dim)
                .output_f32("rstd", rows * groups)
                .tolerance(32.0 * U * gs.sqrt(), 32.0 * U);
            let fwd = match keep {
                false => fwd,
                true => fwd.output("x_copy", rows * dim).same_dtype("x", "x_copy"),
            };
            let fwd = if refusals { fwd.with_refusals() } else { fwd };
            if refusals && !keep {
                let bad = NormDims {
                    groups: groups + 1,
                    ..dims
                };
                s.check_refusal(&fwd, "groups that do not divide dim", &[], |dev, b| {
                    dev.rmsnorm_forward(
                        b.view("x")?,
                        b.view("weight")?,
                        b.view_mut("y")?,
                        b.view_mut("rstd")?,
                        None,
                        bad,
                    )?;
                    Ok(vec![])
                });
            }
            s.check_kernel(
                fwd,
                |x| {
                    let (y, rstd) = r::rmsnorm_forward(&x["x"], &x["weight"], dims);
                    let mut expected = vec![Expected::new("y", y), Expected::new("rstd", rstd)];
                    if keep {
                        expected.push(Expected::new("x_copy", x["x"].to_vec()));
                    }
                    expected
                },
                |dev, b| {
                    let (x, weight) = (b.view("x")?, b.view("weight")?);
                    let (y, rstd) = (b.view_mut("y")?, b.view_mut("rstd")?);
                    let x_copy = keep.then(|| b.view_mut("x_copy")).transpose()?;
                    dev.rmsnorm_forward(x, weight, y, rstd, x_copy, dims)?;
                    Ok(vec![])
                },
            );

            let bwd = KernelCase::new("rmsnorm_backward_input", case)
                .input("dy", dy.clone())
                .input("x", x.clone())
                .input("weight", w.clone())
                .input_f32("rstd", rstd.clone())
                .inout("dx", s.rng.values(rows * dim, -2.0, 2.0))
                .output_f32("partials", partials)
                .tolerance(64.0 * U * gs.sqrt(), 32.0 * U);
            let bwd = match keep {
                false => bwd,
                true => bwd
                    .output("dx_before", rows * dim)
                    .same_dtype("dx", "dx_before"),
            };
            let bwd = if refusals { bwd.with_refusals() } else { bwd };
            s.check_kernel(
                bwd,
                |x| {
                    let dx = r::rmsnorm_backward_input(
                        &x["dy"],
                        &x["x"],
                        &x["weight"],
                        &x["rstd"],
                        &x["dx"],
                        dims,
                    );
                    let sums = r::rmsnorm_weight_partials(&x["dy"], &x["x"], &x["rstd"], dims);
                    let mut expected = vec![
                        Expected::new("dx", dx),
                        Expected::new("partials", sums)
                            .tolerance(32.0 * U * (slice_rows + 1.0), 32.0 * U),
                    ];
                    if keep {
                        expected.push(Expected::new("dx_before", x["dx"].to_vec()));
                    }
                    expected
                },
                |dev, b| {
                    let (dy, x) = (b.view("dy")?, b.view("x")?);
                    let (weight, rstd) = (b.view("weight")?, b.view("rstd")?);
                    let dx = b.view_mut("dx")?;
                    let dx_before = keep.then(|| b.view_mut("dx_before")).transpose()?;
                    let sums = b.view_mut("partials")?;
                    dev.rmsnorm_backward_input(dy, x, weight, rstd, dx, dx_before, sums, dims)?;
                    Ok(vec![])
                },
            );
        }

        let wgrad = KernelCase::new("rmsnorm_backward_weight", name)
            .input_f32("partials", s.rng.values(partials, -2.0, 2.0))
            .inout("dw", s.rng.values(dim, -2.0, 2.0))
            .tolerance(32.0 * U * (slices as f64 + 1.0), 32.0 * U);
        let wgrad = if refusals {
            wgrad.with_refusals()
        } else {
            wgrad
        };
        s.check_kernel(
            wgrad,
            |x| {
                let dw = r::rmsnorm_backward_weight(&x["partials"], &x["dw"], dims);
                vec![Expected::new("dw", dw)]
            },
            |dev, b| {
                dev.rmsnorm_backward_weight(b.view("partials")?, b.view_mut("dw")?, dims)?;
                Ok(vec![])
            },
        );
    }
}

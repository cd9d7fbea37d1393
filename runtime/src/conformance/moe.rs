//! Mixture-of-experts kernels: routing (softmax and sigmoid scores, with and
//! without the selection bias, k = 1..3, ties) forward and backward, row
//! gathers and scatters, and the weighted unpermute and its backward.

use super::Suite;
use super::case::{Expected, KernelCase};
use super::dense::U;
use super::reference as r;
use crate::backend::{
    Backend, RouteDims, RouteOutputs, RouterScores, UnpermuteDims, UnpermuteGrads,
};
use hybridgen_dsl::config::ScoreFunction;

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    route(s);
    gather_scatter(s);
    unpermute(s);
}

fn as_f64(v: &[u32]) -> Vec<f64> {
    v.iter().map(|&i| f64::from(i)).collect()
}

/// Random logits whose top-k keys are clearly separated, except row 0 when
/// `tie` (all equal: the selection must then be experts 0, 1, ...).
fn route_logits<B: Backend>(
    s: &mut Suite<'_, B>,
    dims: RouteDims,
    bias: Option<&[f64]>,
    tie: bool,
) -> Vec<f64> {
    let e = dims.experts;
    let mut logits = Vec::with_capacity(dims.rows * e);
    for row in 0..dims.rows {
        if tie && row == 0 {
            logits.extend(std::iter::repeat_n(0.5, e));
            continue;
        }
        loop {
            let z: Vec<f64> = s
                .rng
                .values(e, -3.0, 3.0)
                .iter()
                .map(|&v| f64::from(v as f32))
                .collect();
            let scores = r::route_scores(&z, dims.score);
            let mut keys: Vec<f64> = (0..e)
                .map(|i| scores[i] + bias.map_or(0.0, |b| b[i]))
                .collect();
            keys.sort_by(|a, b| b.total_cmp(a));
            // A gap far above f32 rounding keeps the selection unambiguous.
            if dims.top_k == e || keys[dims.top_k - 1] - keys[dims.top_k] > 1e-3 {
                logits.extend(z);
                break;
            }
        }
    }
    logits
}

fn route<B: Backend>(s: &mut Suite<'_, B>) {
    let mut configs = Vec::new();
    for score in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
        for top_k in 1..=3 {
            for bias in [false, true] {
                configs.push((8, top_k, score, bias));
            }
        }
        configs.push((3, 3, score, false));
    }
    let rows = 9;
    for (i, (experts, top_k, score, with_bias)) in configs.into_iter().enumerate() {
        let dims = RouteDims {
            rows,
            experts,
            top_k,
            score,
        };
        let bias_f32: Option<Vec<f32>> = with_bias.then(|| {
            (0..experts)
                .map(|_| s.rng.uniform(-0.3, 0.3) as f32)
                .collect()
        });
        let bias: Option<Vec<f64>> = bias_f32
            .as_ref()
            .map(|b| b.iter().map(|&v| f64::from(v)).collect());
        let logits = route_logits(s, dims, bias.as_deref(), !with_bias);
        let name = format!(
            "{rows} rows, {experts} experts, top-{top_k}, {score:?}{}",
            if with_bias { ", bias" } else { "" }
        );
        let refusals = i == 0;
        // The selection the reference makes (unambiguous by construction).
        let selected: Vec<Vec<usize>> = logits
            .chunks(experts)
            .map(|z| r::top_k(&r::route_scores(z, score), bias.as_deref(), top_k))
            .collect();
        let selected_u32: Vec<u32> = selected.iter().flatten().map(|&e| e as u32).collect();

        let fwd = KernelCase::new("moe_route_forward", name.clone())
            .input_f32("logits", logits.clone())
            .output_f32("scores", rows * experts)
            .output_f32("weights", rows * top_k)
            .inout_f32("softmax_sum", s.rng.values(experts, 0.0, 2.0))
            .tolerance(16.0 * U * (rows + experts) as f64, 32.0 * U);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        let launch_fwd = |dims: RouteDims, bias: Option<Vec<f32>>, selected_len: usize| {
            move |dev: &B, b: &super::case::Bufs<B>| -> crate::Result<super::case::HostOutputs> {
                let mut sel = vec![0u32; selected_len];
                dev.moe_route_forward(
                    b.view("logits")?,
                    bias.as_deref(),
                    RouteOutputs {
                        scores: b.view_mut("scores")?,
                        weights: b.view_mut("weights")?,
                        softmax_sum: b.view_mut("softmax_sum")?,
                    },
                    &mut sel,
                    dims,
                )?;
                Ok(vec![("selected", as_f64(&sel))])
            }
        };
        if refusals {
            let zero_k = RouteDims { top_k: 0, ..dims };
            s.check_refusal(&fwd, "top-k 0", &[], launch_fwd(zero_k, None, 0));
            let too_many = RouteDims {
                top_k: experts + 1,
                ..dims
            };
            let n = rows * (experts + 1);
            s.check_refusal(
                &fwd,
                "top-k above the experts",
                &[],
                launch_fwd(too_many, None, n),
            );
            s.check_refusal(
                &fwd,
                "`selected` one too short",
                &[],
                launch_fwd(dims, None, rows * top_k - 1),
            );
            let short_bias = vec![0.0f32; experts - 1];
            s.check_refusal(
                &fwd,
                "`expert_bias` one too short",
                &[],
                launch_fwd(dims, Some(short_bias), rows * top_k),
            );
        }
        s.check_kernel(
            fwd,
            |x| {
                let (mut scores, mut weights) = (Vec::new(), Vec::new());
                let mut softmax_sum = x["softmax_sum"].to_vec();
                for (z, sel) in x["logits"].chunks(experts).zip(&selected) {
                    scores.extend(r::route_scores(z, score));
                    let (w, p) = r::route_row(z, sel, score);
                    weights.extend(w);
                    for (acc, p) in softmax_sum.iter_mut().zip(p) {
                        *acc += p;
                    }
                }
                vec![
                    Expected::new("scores", scores),
                    Expected::new("weights", weights),
                    Expected::new("softmax_sum", softmax_sum),
                    Expected::new("selected", as_f64(&selected_u32)).exact(),
                ]
            },
            launch_fwd(dims, bias_f32.clone(), rows * top_k),
        );

        let aux_grad: Vec<f32> = (0..experts)
            .map(|_| s.rng.uniform(-1.0, 1.0) as f32)
            .collect();
        let bwd = KernelCase::new("moe_route_backward", name)
            .input_f32("logits", logits)
            .input_f32_from("scores", move |x| {
                x["logits"]
                    .chunks(experts)
                    .flat_map(|z| r::route_scores(z, score))
                    .collect()
            })
            .input_f32("d_weights", s.rng.values(rows * top_k, -2.0, 2.0))
            .output_f32("d_logits", rows * experts)
            .tolerance(64.0 * U, 32.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        let launch_bwd = |selected: &[u32], aux_grad: &[f32]| {
            let (selected, aux_grad) = (selected.to_vec(), aux_grad.to_vec());
            move |dev: &B, b: &super::case::Bufs<B>| -> crate::Result<super::case::HostOutputs> {
                dev.moe_route_backward(
                    RouterScores {
                        logits: b.view("logits")?,
                        scores: b.view("scores")?,
                    },
                    &selected,
                    b.view("d_weights")?,
                    &aux_grad,
                    b.view_mut("d_logits")?,
                    dims,
                )?;
                Ok(vec![])
            }
        };
        if refusals {
            let mut bad = selected_u32.clone();
            bad[0] = experts as u32;
            s.check_refusal(
                &bwd,
                "a selected expert past the experts",
                &[],
                launch_bwd(&bad, &aux_grad),
            );
            s.check_refusal(
                &bwd,
                "`aux_grad` one too short",
                &[],
                launch_bwd(&selected_u32, &aux_grad[1..]),
            );
        }
        let aux: Vec<f64> = aux_grad.iter().map(|&v| f64::from(v)).collect();
        s.check_kernel(
            bwd,
            |x| {
                // The gradient of sum_j dW_j w_j + aux . softmax(z), row by
                // row, with the selection held fixed.
                let mut d_logits = Vec::new();
                let dw = &x["d_weights"];
                for (row, (z, sel)) in x["logits"].chunks(experts).zip(&selected).enumerate() {
                    let dw = &dw[row * top_k..][..top_k];
                    d_logits.extend(r::gradient(z, |z| {
                        let (w, p) = r::route_row(z, sel, score);
                        let weighted: f64 = w.iter().zip(dw).map(|(a, b)| a * b).sum();
                        weighted + p.iter().zip(&aux).map(|(a, b)| a * b).sum::<f64>()
                    }));
                }
                vec![Expected::new("d_logits", d_logits)]
            },
            launch_bwd(&selected_u32, &aux_grad),
        );
    }
}

fn gather_scatter<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (src_rows, dst_rows, width)) in
        [(9, 12, 5), (4, 1, 16), (3, 0, 2)].into_iter().enumerate()
    {
        let index = s.rng.indices(dst_rows, src_rows);
        let case = KernelCase::new(
            "gather_rows",
            format!("{dst_rows} rows of {width} from {src_rows}"),
        )
        .input("src", s.rng.values(src_rows * width, -2.0, 2.0))
        .output("dst", dst_rows * width)
        .same_dtype("src", "dst");
        let case = if i == 0 { case.with_refusals() } else { case };
        if i == 0 {
            let mut bad = index.clone();
            bad[0] = src_rows as u32;
            s.check_refusal(&case, "a row index past the source", &[], |dev, b| {
                dev.gather_rows(b.view("src")?, &bad, b.view_mut("dst")?, width)?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            case,
            |x| {
                let src = &x["src"];
                let dst = index
                    .iter()
                    .flat_map(|&r| src[r as usize * width..][..width].to_vec())
                    .collect();
                vec![Expected::new("dst", dst)]
            },
            |dev, b| {
                dev.gather_rows(b.view("src")?, &index, b.view_mut("dst")?, width)?;
                Ok(vec![])
            },
        );
    }

    for (i, (src_rows, dst_rows, width)) in
        [(6, 9, 5), (1, 1, 16), (0, 3, 2)].into_iter().enumerate()
    {
        let index: Vec<u32> = s.rng.permutation(dst_rows)[..src_rows].to_vec();
        let case = KernelCase::new(
            "scatter_rows",
            format!("{src_rows} rows of {width} into {dst_rows}"),
        )
        .input("src", s.rng.values(src_rows * width, -2.0, 2.0))
        .inout("dst", s.rng.values(dst_rows * width, -2.0, 2.0))
        .same_dtype("src", "dst");
        let case = if i == 0 { case.with_refusals() } else { case };
        if i == 0 {
            let mut bad = index.clone();
            bad[0] = dst_rows as u32;
            s.check_refusal(&case, "a row index past the destination", &[], |dev, b| {
                dev.scatter_rows(b.view("src")?, &bad, b.view_mut("dst")?, width)?;
                Ok(vec![])
            });
        }
        s.check_kernel(
            case,
            |x| {
                let mut dst = x["dst"].to_vec();
                for (row, &t) in index.iter().enumerate() {
                    let t = t as usize;
                    dst[t * width..][..width].copy_from_slice(&x["src"][row * width..][..width]);
                }
                vec![Expected::new("dst", dst)]
            },
            |dev, b| {
                dev.scatter_rows(b.view("src")?, &index, b.view_mut("dst")?, width)?;
                Ok(vec![])
            },
        );
    }
}

fn unpermute<B: Backend>(s: &mut Suite<'_, B>) {
    let (tokens, width) = (5, 7);
    let mut first = true;
    for top_k in 1..=3 {
        let rows = tokens * top_k;
        let dims = UnpermuteDims {
            tokens,
            top_k,
            rows,
            width,
        };
        let positions = s.rng.permutation(rows);
        let row_values = s.rng.values(rows * width, -2.0, 2.0);
        let weights = s.rng.values(tokens * top_k, 0.0, 1.0);
        let name = format!("{tokens} tokens, top-{top_k}, width {width}");
        let refusals = std::mem::take(&mut first);

        for weighted in [true, false] {
            let case = KernelCase::new(
                "moe_unpermute",
                format!("{name}{}", if weighted { ", weighted" } else { "" }),
            )
            .input("rows", row_values.clone());
            let case = if weighted {
                case.input_f32("weights", weights.clone())
            } else {
                case
            };
            let case = case
                .output("out", tokens * width)
                .tolerance(16.0 * U * top_k as f64, 16.0 * U);
            let case = if refusals && weighted {
                case.with_refusals()
            } else {
                case
            };
            let launch = |positions: &[u32]| {
                let positions = positions.to_vec();
                move |dev: &B,
                      b: &super::case::Bufs<B>|
                      -> crate::Result<super::case::HostOutputs> {
                    let w = if weighted {
                        Some(b.view("weights")?)
                    } else {
                        None
                    };
                    dev.moe_unpermute(b.view("rows")?, w, &positions, b.view_mut("out")?, dims)?;
                    Ok(vec![])
                }
            };
            if refusals && weighted {
                let mut bad = positions.clone();
                bad[0] = rows as u32;
                s.check_refusal(&case, "a position past the rows", &[], launch(&bad));
                s.check_refusal(&case, "one position too few", &[], launch(&positions[1..]));
            }
            s.check_kernel(
                case,
                |x| {
                    let mut out = vec![0.0; tokens * width];
                    for t in 0..tokens {
                        for j in 0..top_k {
                            let w = if weighted {
                                x["weights"][t * top_k + j]
                            } else {
                                1.0
                            };
                            let p = positions[t * top_k + j] as usize;
                            for c in 0..width {
                                out[t * width + c] += w * x["rows"][p * width + c];
                            }
                        }
                    }
                    vec![Expected::new("out", out)]
                },
                launch(&positions),
            );
        }

        let bwd = KernelCase::new("moe_unpermute_backward", name)
            .input("dout", s.rng.values(tokens * width, -2.0, 2.0))
            .input("rows", row_values)
            .input_f32("weights", weights)
            .output("d_rows", rows * width)
            .output_f32("d_weights", tokens * top_k)
            .tolerance(16.0 * U * width as f64, 16.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        let launch = |positions: &[u32]| {
            let positions = positions.to_vec();
            move |dev: &B, b: &super::case::Bufs<B>| -> crate::Result<super::case::HostOutputs> {
                dev.moe_unpermute_backward(
                    b.view("dout")?,
                    b.view("rows")?,
                    b.view("weights")?,
                    &positions,
                    UnpermuteGrads {
                        rows: b.view_mut("d_rows")?,
                        weights: b.view_mut("d_weights")?,
                    },
                    dims,
                )?;
                Ok(vec![])
            }
        };
        if refusals {
            let mut bad = positions.clone();
            bad[0] = rows as u32;
            s.check_refusal(&bwd, "a position past the rows", &[], launch(&bad));
        }
        s.check_kernel(
            bwd,
            |x| {
                let mut d_rows = vec![0.0; rows * width];
                let mut d_weights = vec![0.0; tokens * top_k];
                for t in 0..tokens {
                    let g = &x["dout"][t * width..][..width];
                    for j in 0..top_k {
                        let p = positions[t * top_k + j] as usize;
                        let row = &x["rows"][p * width..][..width];
                        d_weights[t * top_k + j] = g.iter().zip(row).map(|(a, b)| a * b).sum();
                        for c in 0..width {
                            d_rows[p * width + c] += x["weights"][t * top_k + j] * g[c];
                        }
                    }
                }
                vec![
                    Expected::new("d_rows", d_rows),
                    Expected::new("d_weights", d_weights),
                ]
            },
            launch(&positions),
        );
    }
}

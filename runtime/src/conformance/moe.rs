//! Mixture-of-experts kernels: routing (softmax and sigmoid scores, with and
//! without the selection bias and its unbiased selection, k = 1..3, ties,
//! with and without a top-k scaling factor) forward and backward; the
//! per-expert histogram, the dispatch sort and the regroup after the
//! all-to-all (experts nobody chose, ranks that send nothing); the
//! load-balancing loss and its gradient; the balancing load's running sum
//! (exact past f32's and u32's integers); row gathers and scatters; the
//! weighted unpermute and its backward. Every index is a u32 device view.

use super::Suite;
use super::case::{BadInput, Bufs, Expected, HostOutputs, KernelCase, Values};
use super::dense::U;
use super::reference as r;
use crate::backend::{
    AuxLossDims, Backend, ExpertBias, ExpertOrder, ReceivedDims, RouteDims, RouteOutputs,
    RoutedSlots, RouterScores, UnpermuteDims, UnpermuteGrads,
};
use crate::error::Result;
use hybridgen_dsl::config::ScoreFunction;

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    route(s);
    counts_and_sort(s);
    expert_major_order(s);
    aux_loss(s);
    load_accumulate(s);
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
            // A gap far above f32 rounding keeps the selection unambiguous,
            // with the bias and (the load-balancing loss's) without it.
            let separated = |bias: Option<&[f64]>| {
                let mut keys: Vec<f64> = (0..e)
                    .map(|i| scores[i] + bias.map_or(0.0, |b| b[i]))
                    .collect();
                keys.sort_by(|a, b| b.total_cmp(a));
                dims.top_k == e || keys[dims.top_k - 1] - keys[dims.top_k] > 1e-3
            };
            if separated(bias) && separated(None) {
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
                configs.push((8, top_k, score, bias, 1.0));
            }
            configs.push((8, top_k, score, false, 2.5));
        }
        configs.push((3, 3, score, false, 1.0));
    }
    let rows = 9;
    for (i, (experts, top_k, score, with_bias, topk_scale)) in configs.into_iter().enumerate() {
        let dims = RouteDims {
            rows,
            experts,
            top_k,
            score,
            topk_scale,
        };
        // f32 values, so the reference sees the bias the kernel reads.
        let bias: Option<Vec<f64>> = with_bias.then(|| {
            (0..experts)
                .map(|_| f64::from(s.rng.uniform(-0.3, 0.3) as f32))
                .collect()
        });
        let logits = route_logits(s, dims, bias.as_deref(), !with_bias);
        let name = format!(
            "{rows} rows, {experts} experts, top-{top_k}, {score:?}{}, scale {topk_scale}",
            if with_bias { ", bias" } else { "" }
        );
        let refusals = i == 1;
        // The selection the reference makes (unambiguous by construction).
        let selected: Vec<Vec<usize>> = logits
            .chunks(experts)
            .map(|z| r::top_k(&r::route_scores(z, score), bias.as_deref(), top_k))
            .collect();
        let selected_u32: Vec<u32> = selected.iter().flatten().map(|&e| e as u32).collect();
        let unbiased_u32: Vec<u32> = logits
            .chunks(experts)
            .flat_map(|z| r::top_k(&r::route_scores(z, score), None, top_k))
            .map(|e| e as u32)
            .collect();

        let start_sums = s.rng.values(experts, 0.0, 2.0);
        let fwd_case = |name: String| {
            let fwd =
                KernelCase::new("moe_route_forward", name).input_f32("logits", logits.clone());
            let fwd = match &bias {
                Some(b) => fwd
                    .input_f32("expert_bias", b.clone())
                    .output_u32("unbiased", rows * top_k),
                None => fwd,
            };
            fwd.output_f32("scores", rows * experts)
                .output_f32("weights", rows * top_k)
                .inout_f32("prob_sum", start_sums.clone())
                .output_u32("selected", rows * top_k)
                .tolerance(16.0 * U * (rows + experts) as f64, 32.0 * U)
        };
        let fwd = fwd_case(name.clone());
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        // `sums`: whether the launch asks for `prob_sum` (a router without
        // a load-balancing loss does not, and must find it untouched).
        let launch_fwd = |dims: RouteDims, sums: bool| {
            move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                let bias = if with_bias {
                    Some(ExpertBias {
                        bias: b.view("expert_bias")?,
                        unbiased: b.view_mut("unbiased")?,
                    })
                } else {
                    None
                };
                dev.moe_route_forward(
                    b.view("logits")?,
                    bias,
                    RouteOutputs {
                        scores: b.view_mut("scores")?,
                        weights: b.view_mut("weights")?,
                        prob_sum: if sums {
                            Some(b.view_mut("prob_sum")?)
                        } else {
                            None
                        },
                    },
                    b.view_mut("selected")?,
                    dims,
                )?;
                Ok(vec![])
            }
        };
        if refusals {
            let zero_k = RouteDims { top_k: 0, ..dims };
            s.check_refusal(&fwd, "top-k 0", &[], launch_fwd(zero_k, true));
            let too_many = RouteDims {
                top_k: experts + 1,
                ..dims
            };
            s.check_bad_input(
                &fwd,
                BadInput::new("top-k above the experts")
                    .with("weights", vec![0.0; rows * (experts + 1)])
                    .with("selected", vec![0.0; rows * (experts + 1)]),
                launch_fwd(too_many, true),
            );
            s.check_bad_input(
                &fwd,
                BadInput::new("`selected` one too short")
                    .with("selected", vec![0.0; rows * top_k - 1]),
                launch_fwd(dims, true),
            );
        }
        let expected = |x: &Values, sums: bool| {
            let (mut scores, mut weights) = (Vec::new(), Vec::new());
            let mut prob_sum = x["prob_sum"].to_vec();
            for (z, sel) in x["logits"].chunks(experts).zip(&selected) {
                scores.extend(r::route_scores(z, score));
                let (w, p) = r::route_row(z, sel, score, f64::from(topk_scale));
                weights.extend(w);
                if sums {
                    for (acc, p) in prob_sum.iter_mut().zip(p) {
                        *acc += p;
                    }
                }
            }
            let mut expected = vec![
                Expected::new("scores", scores),
                Expected::new("weights", weights),
                Expected::new("prob_sum", prob_sum),
                Expected::new("selected", as_f64(&selected_u32)).exact(),
            ];
            if with_bias {
                expected.push(Expected::new("unbiased", as_f64(&unbiased_u32)).exact());
            }
            expected
        };
        s.check_kernel(fwd, |x| expected(x, true), launch_fwd(dims, true));
        s.check_kernel(
            fwd_case(format!("{name}, no prob_sum")),
            |x| expected(x, false),
            launch_fwd(dims, false),
        );

        let aux_grad: Vec<f64> = (0..experts)
            .map(|_| f64::from(s.rng.uniform(-1.0, 1.0) as f32))
            .collect();
        let bwd = KernelCase::new("moe_route_backward", name)
            .input_f32("logits", logits)
            .input_f32_from("scores", move |x| {
                x["logits"]
                    .chunks(experts)
                    .flat_map(|z| r::route_scores(z, score))
                    .collect()
            })
            .input_u32("selected", &selected_u32)
            .input_f32("d_weights", s.rng.values(rows * top_k, -2.0, 2.0))
            .input_f32("aux_grad", aux_grad.clone())
            .output_f32("d_logits", rows * experts)
            .tolerance(64.0 * U, 32.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        let launch_bwd = |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.moe_route_backward(
                RouterScores {
                    logits: b.view("logits")?,
                    scores: b.view("scores")?,
                },
                b.view("selected")?,
                b.view("d_weights")?,
                b.view("aux_grad")?,
                b.view_mut("d_logits")?,
                dims,
            )?;
            Ok(vec![])
        };
        if refusals {
            let mut bad = selected_u32.clone();
            bad[rows * top_k - 1] = experts as u32;
            s.check_bad_input(
                &bwd,
                BadInput::new("a selected expert past the experts").with_u32("selected", &bad),
                launch_bwd,
            );
        }
        s.check_kernel(
            bwd,
            |x| {
                // The gradient of sum_j dW_j w_j + aux . p(z), row by row,
                // with the selection held fixed.
                let mut d_logits = Vec::new();
                let dw = &x["d_weights"];
                for (row, (z, sel)) in x["logits"].chunks(experts).zip(&selected).enumerate() {
                    let dw = &dw[row * top_k..][..top_k];
                    d_logits.extend(r::gradient(z, |z| {
                        let (w, p) = r::route_row(z, sel, score, f64::from(topk_scale));
                        let weighted: f64 = w.iter().zip(dw).map(|(a, b)| a * b).sum();
                        weighted + p.iter().zip(&aux_grad).map(|(a, b)| a * b).sum::<f64>()
                    }));
                }
                vec![Expected::new("d_logits", d_logits)]
            },
            launch_bwd,
        );
    }
}

/// A routing of `tokens` tokens, `top_k` distinct experts each out of
/// `experts`, where expert `experts - 1` is never chosen (when there are
/// more than `top_k`), so empty experts are covered.
fn random_routing<B: Backend>(s: &mut Suite<'_, B>, slots: RoutedSlots) -> Vec<u32> {
    let usable = if slots.experts > slots.top_k {
        slots.experts - 1
    } else {
        slots.experts
    };
    let mut selected = Vec::with_capacity(slots.tokens * slots.top_k);
    for _ in 0..slots.tokens {
        selected.extend_from_slice(&s.rng.permutation(usable)[..slots.top_k]);
    }
    selected
}

fn counts_and_sort<B: Backend>(s: &mut Suite<'_, B>) {
    let shapes = [(13, 2, 6), (1, 1, 1), (9, 3, 3), (40, 1, 8), (0, 2, 4)];
    for (i, (tokens, top_k, experts)) in shapes.into_iter().enumerate() {
        let slots = RoutedSlots {
            tokens,
            top_k,
            experts,
        };
        let n = tokens * top_k;
        let selected = random_routing(s, slots);
        let counts = r::expert_counts(&selected, experts);
        let name = format!("{tokens} tokens, top-{top_k} of {experts} experts");
        let refusals = i == 0;

        let case = KernelCase::new("moe_expert_counts", name.clone())
            .input_u32("selected", &selected)
            .output_u32("counts", experts);
        let case = if refusals { case.with_refusals() } else { case };
        let launch = |slots: RoutedSlots| {
            move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                dev.moe_expert_counts(b.view("selected")?, b.view_mut("counts")?, slots)?;
                Ok(vec![])
            }
        };
        if refusals {
            let mut bad = selected.clone();
            bad[n - 1] = experts as u32;
            s.check_bad_input(
                &case,
                BadInput::new("a selected expert past the experts").with_u32("selected", &bad),
                launch(slots),
            );
            let zero_k = RoutedSlots { top_k: 0, ..slots };
            s.check_bad_input(
                &case,
                BadInput::new("top-k 0").with("selected", vec![]),
                launch(zero_k),
            );
        }
        s.check_kernel(
            case,
            |_| vec![Expected::new("counts", as_f64(&counts)).exact()],
            launch(slots),
        );

        let case = KernelCase::new("moe_sort_by_expert", name)
            .input_u32("selected", &selected)
            .input_u32("counts", &counts)
            .output_u32("positions", n)
            .output_u32("sources", n);
        let case = if refusals { case.with_refusals() } else { case };
        let launch = |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.moe_sort_by_expert(
                b.view("selected")?,
                b.view("counts")?,
                ExpertOrder {
                    positions: b.view_mut("positions")?,
                    sources: b.view_mut("sources")?,
                },
                slots,
            )?;
            Ok(vec![])
        };
        if refusals {
            // One pair moved from the first chosen expert to the empty one:
            // the counts still sum to the slots, but no longer match.
            let mut moved = counts.clone();
            let from = moved.iter().position(|&c| c > 0).unwrap_or(0);
            moved[from] -= 1;
            moved[experts - 1] += 1;
            s.check_bad_input(
                &case,
                BadInput::new("counts that do not match the selection").with_u32("counts", &moved),
                launch,
            );
            let mut short = counts.clone();
            short[from] -= 1;
            s.check_bad_input(
                &case,
                BadInput::new("counts that sum to one slot too few").with_u32("counts", &short),
                launch,
            );
            let mut bad = selected.clone();
            bad[0] = experts as u32;
            s.check_bad_input(
                &case,
                BadInput::new("a selected expert past the experts").with_u32("selected", &bad),
                launch,
            );
        }
        s.check_kernel(
            case,
            |_| {
                let (positions, sources) = r::sort_by_expert(&selected, top_k);
                vec![
                    Expected::new("positions", as_f64(&positions)).exact(),
                    Expected::new("sources", as_f64(&sources)).exact(),
                ]
            },
            launch,
        );
    }
}

fn expert_major_order<B: Backend>(s: &mut Suite<'_, B>) {
    // ranks, local experts; some blocks empty, one rank sending nothing.
    let shapes = [(3, 4), (1, 1), (2, 3), (4, 1), (1, 5), (2, 0)];
    for (i, (ranks, local_experts)) in shapes.into_iter().enumerate() {
        let dims = ReceivedDims {
            ranks,
            local_experts,
        };
        let mut recv: Vec<u32> = (0..ranks * local_experts)
            .map(|_| s.rng.below(5) as u32)
            .collect();
        if let Some(first) = recv.first_mut() {
            *first += 1;
        }
        if ranks > 1 {
            recv[local_experts..2 * local_experts].fill(0);
        }
        let total = recv.iter().sum::<u32>() as usize;
        let case = KernelCase::new(
            "moe_expert_major_order",
            format!("{ranks} ranks x {local_experts} local experts, {total} rows"),
        )
        .input_u32("recv_counts", &recv)
        .output_u32("order", total);
        let case = if i == 0 { case.with_refusals() } else { case };
        let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.moe_expert_major_order(b.view("recv_counts")?, b.view_mut("order")?, dims)?;
            Ok(vec![])
        };
        if i == 0 {
            s.check_bad_input(
                &case,
                BadInput::new("`order` one row short").with("order", vec![0.0; total - 1]),
                launch,
            );
        }
        s.check_kernel(
            case,
            |_| {
                let order = r::expert_major_order(&recv, local_experts.max(1));
                vec![Expected::new("order", as_f64(&order)).exact()]
            },
            launch,
        );
    }
}

fn aux_loss<B: Backend>(s: &mut Suite<'_, B>) {
    // tokens, top-k, experts, coefficient
    let configs = [
        (13, 2, 6, 0.01f32),
        (1, 1, 1, 1.0),
        (40, 3, 8, 0.37),
        (0, 2, 4, 0.01),
        (9, 1, 4, 0.0),
    ];
    for (i, (tokens, top_k, experts, coeff)) in configs.into_iter().enumerate() {
        let slots = RoutedSlots {
            tokens,
            top_k,
            experts,
        };
        let dims = AuxLossDims { slots, coeff };
        let counts = r::expert_counts(&random_routing(s, slots), experts);
        // Each row's softmax sums to one, so the sums total `tokens`.
        let weights = s.rng.values(experts, 0.1, 1.0);
        let total: f64 = weights.iter().sum();
        let prob_sum: Vec<f64> = weights.iter().map(|w| w / total * tokens as f64).collect();
        let name = format!("{tokens} tokens, top-{top_k} of {experts} experts, coeff {coeff}");
        let refusals = i == 0;
        let c = f64::from(coeff);

        let fwd = KernelCase::new("moe_aux_loss_forward", name.clone())
            .input_u32("counts", &counts)
            .input_f32("prob_sum", prob_sum)
            .inout_f64("loss", vec![s.rng.uniform(0.0, 3.0)])
            // Summed in f64 from exact inputs: any order is within a few
            // f64 ulps.
            .tolerance(0.0, 1e-13);
        let fwd = if refusals { fwd.with_refusals() } else { fwd };
        s.check_kernel(
            fwd,
            |x| {
                let loss =
                    x["loss"][0] + r::aux_loss(&x["counts"], &x["prob_sum"], tokens, top_k, c);
                vec![Expected::new("loss", vec![loss])]
            },
            |dev, b| {
                dev.moe_aux_loss_forward(
                    b.view("counts")?,
                    b.view("prob_sum")?,
                    b.view_mut("loss")?,
                    dims,
                )?;
                Ok(vec![])
            },
        );

        let scale = 0.625f32;
        let bwd = KernelCase::new("moe_aux_loss_backward", name)
            .input_u32("counts", &counts)
            .output_f32("aux_grad", experts)
            // Computed in f64 and rounded once to f32.
            .tolerance(0.0, 2.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        s.check_kernel(
            bwd,
            |x| {
                let grad = r::aux_loss_grad(&x["counts"], tokens, top_k, c, f64::from(scale));
                vec![Expected::new("aux_grad", grad)]
            },
            |dev, b| {
                dev.moe_aux_loss_backward(b.view("counts")?, b.view_mut("aux_grad")?, dims, scale)?;
                Ok(vec![])
            },
        );
    }
}

fn load_accumulate<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, experts) in [6usize, 1, 9, 0].into_iter().enumerate() {
        let mut counts: Vec<u32> = (0..experts).map(|_| s.rng.below(40) as u32).collect();
        // Totals past u32's range, and counts past f32's exact integers:
        // the sum must still be the integer sum.
        let mut load: Vec<f64> = (0..experts)
            .map(|_| (s.rng.below(1 << 20) as u64 * (1 << 20)) as f64)
            .collect();
        if let (Some(c), Some(l)) = (counts.first_mut(), load.first_mut()) {
            *c = u32::MAX;
            *l = (1u64 << 52) as f64;
        }
        if let Some(c) = counts.get_mut(1) {
            *c = (1 << 24) + 1;
        }
        let case = KernelCase::new("moe_load_accumulate", format!("{experts} experts"))
            .input_u32("counts", &counts)
            .inout_f64("load", load);
        let case = if i == 0 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                let sum = x["load"].iter().zip(&x["counts"]).map(|(l, c)| l + c);
                vec![Expected::new("load", sum.collect()).exact()]
            },
            |dev, b| {
                dev.moe_load_accumulate(b.view("counts")?, b.view_mut("load")?)?;
                Ok(vec![])
            },
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
        .input_u32("index", &index)
        .output("dst", dst_rows * width)
        .same_dtype("src", "dst");
        let case = if i == 0 { case.with_refusals() } else { case };
        let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.gather_rows(b.view("src")?, b.view("index")?, b.view_mut("dst")?, width)?;
            Ok(vec![])
        };
        if i == 0 {
            let mut bad = index.clone();
            bad[dst_rows - 1] = src_rows as u32;
            s.check_bad_input(
                &case,
                BadInput::new("a row index past the source").with_u32("index", &bad),
                launch,
            );
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
            launch,
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
        .input_u32("index", &index)
        .inout("dst", s.rng.values(dst_rows * width, -2.0, 2.0))
        .same_dtype("src", "dst");
        let case = if i == 0 { case.with_refusals() } else { case };
        let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.scatter_rows(b.view("src")?, b.view("index")?, b.view_mut("dst")?, width)?;
            Ok(vec![])
        };
        if i == 0 {
            let mut bad = index.clone();
            bad[src_rows - 1] = dst_rows as u32;
            s.check_bad_input(
                &case,
                BadInput::new("a row index past the destination").with_u32("index", &bad),
                launch,
            );
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
            launch,
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
        let mut bad = positions.clone();
        bad[rows - 1] = rows as u32;

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
                .input_u32("positions", &positions)
                .output("out", tokens * width)
                .tolerance(16.0 * U * top_k as f64, 16.0 * U);
            let case = if refusals && weighted {
                case.with_refusals()
            } else {
                case
            };
            let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                let w = if weighted {
                    Some(b.view("weights")?)
                } else {
                    None
                };
                dev.moe_unpermute(
                    b.view("rows")?,
                    w,
                    b.view("positions")?,
                    b.view_mut("out")?,
                    dims,
                )?;
                Ok(vec![])
            };
            if refusals && weighted {
                s.check_bad_input(
                    &case,
                    BadInput::new("a position past the rows").with_u32("positions", &bad),
                    launch,
                );
                s.check_bad_input(
                    &case,
                    BadInput::new("one position too few").with_u32("positions", &positions[1..]),
                    launch,
                );
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
                launch,
            );
        }

        for with_shared in [true, false] {
            let case = KernelCase::new(
                "moe_combine",
                format!("{name}{}", if with_shared { ", shared" } else { "" }),
            )
            .input("rows", row_values.clone())
            .input_f32("weights", weights.clone())
            .input_u32("positions", &positions);
            let case = if with_shared {
                case.input("shared", s.rng.values(tokens * width, -2.0, 2.0))
            } else {
                case
            };
            let case = case
                .inout("x", s.rng.values(tokens * width, -2.0, 2.0))
                .tolerance(16.0 * U * (top_k + 2) as f64, 16.0 * U);
            let case = if refusals && with_shared {
                case.with_refusals()
            } else {
                case
            };
            let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
                let shared = if with_shared {
                    Some(b.view("shared")?)
                } else {
                    None
                };
                dev.moe_combine(
                    b.view("rows")?,
                    b.view("weights")?,
                    b.view("positions")?,
                    shared,
                    b.view_mut("x")?,
                    dims,
                )?;
                Ok(vec![])
            };
            if refusals && with_shared {
                s.check_bad_input(
                    &case,
                    BadInput::new("a position past the rows").with_u32("positions", &bad),
                    launch,
                );
                s.check_bad_input(
                    &case,
                    BadInput::new("a shared row too few")
                        .with("shared", vec![0.0; (tokens - 1) * width]),
                    launch,
                );
            }
            s.check_kernel(
                case,
                |x| {
                    let mut out = x["x"].to_vec();
                    for t in 0..tokens {
                        for c in 0..width {
                            let mut sum = 0.0;
                            for j in 0..top_k {
                                let p = positions[t * top_k + j] as usize;
                                sum += x["weights"][t * top_k + j] * x["rows"][p * width + c];
                            }
                            if with_shared {
                                sum += x["shared"][t * width + c];
                            }
                            out[t * width + c] += sum;
                        }
                    }
                    vec![Expected::new("x", out)]
                },
                launch,
            );
        }

        let bwd = KernelCase::new("moe_unpermute_backward", name)
            .input("dout", s.rng.values(tokens * width, -2.0, 2.0))
            .input("rows", row_values)
            .input_f32("weights", weights)
            .input_u32("positions", &positions)
            .output("d_rows", rows * width)
            .output_f32("d_weights", tokens * top_k)
            .tolerance(16.0 * U * width as f64, 16.0 * U);
        let bwd = if refusals { bwd.with_refusals() } else { bwd };
        let launch = move |dev: &B, b: &Bufs<B>| -> Result<HostOutputs> {
            dev.moe_unpermute_backward(
                b.view("dout")?,
                b.view("rows")?,
                b.view("weights")?,
                b.view("positions")?,
                UnpermuteGrads {
                    rows: b.view_mut("d_rows")?,
                    weights: b.view_mut("d_weights")?,
                },
                dims,
            )?;
            Ok(vec![])
        };
        if refusals {
            s.check_bad_input(
                &bwd,
                BadInput::new("a position past the rows").with_u32("positions", &bad),
                launch,
            );
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
            launch,
        );
    }
}

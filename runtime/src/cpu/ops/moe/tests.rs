//! The MoE loops against their definitions, and the backend's dtype rules
//! for the MoE kernels.

use super::*;

fn dims(rows: usize, experts: usize, top_k: usize, score: ScoreFunction) -> RouteDims {
    RouteDims {
        rows,
        experts,
        top_k,
        score,
        topk_scale: 1.0,
    }
}

/// Scores, weights, selection and `prob_sum` of a routing.
type Routed = (Vec<f32>, Vec<f32>, Vec<u32>, Vec<f32>);

/// A routing, and (with a bias) its unbiased selection.
fn route_full(logits: &[f32], bias: Option<&[f32]>, dims: RouteDims) -> (Routed, Vec<u32>) {
    let mut scores = vec![0.0; logits.len()];
    let mut weights = vec![0.0; dims.rows * dims.top_k];
    let mut sum = vec![0.0; dims.experts];
    let mut sel = vec![0; dims.rows * dims.top_k];
    let mut unbiased = vec![0; dims.rows * dims.top_k];
    let out = RouteOutputs {
        scores: &mut scores[..],
        weights: &mut weights[..],
        prob_sum: Some(&mut sum[..]),
    };
    let bias = bias.map(|bias| ExpertBias {
        bias,
        unbiased: &mut unbiased[..],
    });
    moe_route_forward(logits, bias, out, &mut sel, dims).unwrap();
    ((scores, weights, sel, sum), unbiased)
}

fn route(logits: &[f32], bias: Option<&[f32]>, dims: RouteDims) -> Routed {
    route_full(logits, bias, dims).0
}

fn sigmoid64(x: f32) -> f64 {
    1.0 / (1.0 + (-(x as f64)).exp())
}

#[test]
fn top_k_is_best_first_with_ties_to_the_lower_index_and_bias_only_selects() {
    let dims = dims(2, 4, 2, ScoreFunction::Softmax);
    let logits = [0.5, 2.0, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0];
    let (scores, weights, sel, sum) = route(&logits, None, dims);
    assert_eq!(sel, [1, 2, 0, 1]);
    assert!((weights[0] - 0.5).abs() < 1e-6 && (weights[2] - 0.5).abs() < 1e-6);
    let z: f32 = logits[..4].iter().map(|v| v.exp()).sum();
    assert!((scores[1] - 2f32.exp() / z).abs() < 1e-6);
    assert!((sum[0] - (scores[0] + 0.25)).abs() < 1e-6);
    // A bias moves the choice but not the weights' definition.
    let bias = [0.0, 0.0, 0.0, 1.0];
    let ((_, weights_b, sel_b, _), unbiased) = route_full(&logits, Some(&bias), dims);
    assert_eq!(sel_b, [3, 1, 3, 0]);
    assert_eq!(unbiased, sel, "the unbiased selection ignores the bias");
    let w0 = scores[3] / (scores[1] + scores[3]);
    assert!((weights_b[0] - w0).abs() < 1e-6);
    let sig = RouteDims {
        score: ScoreFunction::Sigmoid,
        ..dims
    };
    let (s, w, sel_s, _) = route(&logits, None, sig);
    assert_eq!(sel_s, [1, 2, 0, 1]);
    assert!((s[0] - 1.0 / (1.0 + (-0.5f32).exp())).abs() < 1e-6);
    assert!((w[0] - 0.5).abs() < 1e-6);
}

/// layers.md `E` step 2 with order-one logits, against f64 by hand:
/// sigmoid with k = 1 keeps the raw score (Megatron normalises only when
/// k > 1), the scaling factor multiplies the weights after the
/// normalisation, and with sigmoid the load-balancing `P` sums each
/// row's sigmoid scores over their total.
#[test]
fn sigmoid_weights_scaling_and_load_balancing_probabilities_follow_megatron() {
    let logits = [0.8f32, -1.3, 2.1, 0.4, -0.6, 1.7, 0.9, -2.0];
    let sig = |z: &[f32]| z.iter().map(|&v| sigmoid64(v)).collect::<Vec<f64>>();
    for topk_scale in [1.0f32, 2.5] {
        let top1 = RouteDims {
            topk_scale,
            ..dims(2, 4, 1, ScoreFunction::Sigmoid)
        };
        let (_, w, sel, sum) = route(&logits, None, top1);
        assert_eq!(sel, [2, 1]);
        for (r, (&e, &w)) in sel.iter().zip(&w).enumerate() {
            let want = topk_scale as f64 * sigmoid64(logits[r * 4 + e as usize]);
            assert!((w as f64 - want).abs() < 1e-6, "top-1 weight {w} vs {want}");
        }
        // P: each row's sigmoids over their sum, summed over rows.
        let (s0, s1) = (sig(&logits[..4]), sig(&logits[4..]));
        let (t0, t1): (f64, f64) = (s0.iter().sum(), s1.iter().sum());
        for e in 0..4 {
            let want = s0[e] / t0 + s1[e] / t1;
            assert!(
                (sum[e] as f64 - want).abs() < 1e-6,
                "P[{e}] {} vs {want}",
                sum[e]
            );
        }
        let top2 = RouteDims {
            topk_scale,
            ..dims(2, 4, 2, ScoreFunction::Sigmoid)
        };
        let (_, w, sel, _) = route(&logits, None, top2);
        assert_eq!(sel, [2, 0, 1, 2]);
        let want0 = topk_scale as f64 * s0[2] / (s0[2] + s0[0]);
        assert!((w[0] as f64 - want0).abs() < 1e-6, "{} vs {want0}", w[0]);
        let soft = RouteDims {
            topk_scale,
            ..dims(2, 4, 2, ScoreFunction::Softmax)
        };
        let (_, w, _, _) = route(&logits, None, soft);
        let want = topk_scale as f64 / (1.0 + ((0.8 - 2.1f32) as f64).exp());
        assert!((w[0] as f64 - want).abs() < 1e-6, "{} vs {want}", w[0]);
    }
}

#[test]
fn route_backward_matches_finite_differences() {
    for score in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
        for top_k in [1, 2, 3] {
            let dims = RouteDims {
                topk_scale: 2.5,
                ..dims(3, 5, top_k, score)
            };
            let logits: Vec<f32> = (0..15).map(|i| (i as f32 * 1.37).sin() * 2.0).collect();
            let dw: Vec<f32> = (0..3 * top_k).map(|i| (i as f32 * 0.77).cos()).collect();
            let aux: Vec<f32> = (0..5).map(|i| 0.3 * i as f32 - 0.5).collect();
            let (scores, _, sel, _) = route(&logits, None, dims);
            let mut dz = vec![0.0; 15];
            let saved = RouterScores {
                logits: &logits[..],
                scores: &scores[..],
            };
            moe_route_backward(saved, &sel, &dw, &aux, &mut dz, dims).unwrap();
            // L = sum dw * weights + sum_r aux . p_r, selection held fixed.
            let loss = |z: &[f32]| -> f64 {
                let (_, w, s, sum) = route(z, None, dims);
                assert_eq!(s, sel, "the perturbation changed the selection");
                let a: f64 = w.iter().zip(&dw).map(|(a, b)| *a as f64 * *b as f64).sum();
                a + sum
                    .iter()
                    .zip(&aux)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            };
            for i in 0..15 {
                let (mut p, mut m) = (logits.clone(), logits.clone());
                p[i] += 1e-3;
                m[i] -= 1e-3;
                let fd = (loss(&p) - loss(&m)) / 2e-3;
                assert!(
                    (dz[i] as f64 - fd).abs() < 4e-3,
                    "{score:?} k={top_k} [{i}]: {} vs {fd}",
                    dz[i]
                );
            }
        }
    }
}

#[test]
fn gather_scatter_and_unpermute_round_trip() {
    let src: Vec<f32> = (0..8).map(|v| v as f32).collect(); // 4 rows of 2
    let index = [2u32, 0, 3, 1];
    let mut g = vec![0.0; 8];
    gather_rows(&src, &index, &mut g, 2).unwrap();
    assert_eq!(g, [4.0, 5.0, 0.0, 1.0, 6.0, 7.0, 2.0, 3.0]);
    let mut back = vec![0.0; 8];
    scatter_rows(&g, &index, &mut back, 2).unwrap();
    assert_eq!(back, src);
    assert!(scatter_rows(&g, &[0, 0, 1, 2], &mut back, 2).is_err());
    assert!(gather_rows(&src, &[4], &mut g[..2], 2).is_err());
    // Two tokens, k = 2, rows permuted.
    let dims = UnpermuteDims {
        tokens: 2,
        top_k: 2,
        rows: 4,
        width: 2,
    };
    let positions = [1u32, 3, 0, 2];
    let weights = [0.25, 0.75, 0.5, 0.5];
    let mut out = vec![0.0; 4];
    moe_unpermute(&src, Some(&weights), &positions, &mut out, dims).unwrap();
    assert_eq!(
        out,
        [0.25 * 2.0 + 0.75 * 6.0, 0.25 * 3.0 + 0.75 * 7.0, 2.0, 3.0]
    );
    let dout = [1.0, 2.0, 3.0, 4.0];
    let (mut drows, mut dw) = (vec![0.0; 8], vec![0.0; 4]);
    let grads = UnpermuteGrads {
        rows: &mut drows[..],
        weights: &mut dw[..],
    };
    moe_unpermute_backward(&dout, &src, &weights, &positions, grads, dims).unwrap();
    assert_eq!(
        dw,
        [
            1.0 * 2.0 + 2.0 * 3.0,
            6.0 + 14.0,
            3.0 * 0.0 + 4.0,
            3.0 * 4.0 + 4.0 * 5.0
        ]
    );
    assert_eq!(drows, [1.5, 2.0, 0.25, 0.5, 1.5, 2.0, 0.75, 1.5]);
    let mut sums = vec![0.0; 4];
    moe_unpermute(&src, None, &positions, &mut sums, dims).unwrap();
    assert_eq!(sums, [2.0 + 6.0, 3.0 + 7.0, 0.0 + 4.0, 1.0 + 5.0]);
}

// ---- routing bookkeeping against naive references ----------------------------

/// Deterministic order-one test data.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u32) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % u64::from(n)) as u32
    }
}

/// A routing of `tokens` tokens: k distinct experts per token.
fn random_selection(rng: &mut Lcg, slots: RoutedSlots) -> Vec<u32> {
    let mut sel = Vec::with_capacity(slots.tokens * slots.top_k);
    for _ in 0..slots.tokens {
        let mut row: Vec<u32> = Vec::new();
        while row.len() < slots.top_k {
            let e = rng.below(slots.experts as u32);
            if !row.contains(&e) {
                row.push(e);
            }
        }
        sel.extend(row);
    }
    sel
}

const SLOTS: [RoutedSlots; 4] = [
    RoutedSlots {
        tokens: 7,
        top_k: 2,
        experts: 4,
    },
    RoutedSlots {
        tokens: 1,
        top_k: 3,
        experts: 3,
    },
    RoutedSlots {
        tokens: 12,
        top_k: 1,
        experts: 5,
    },
    RoutedSlots {
        tokens: 0,
        top_k: 2,
        experts: 4,
    },
];

#[test]
fn expert_counts_are_the_histogram_of_the_selection() {
    let mut rng = Lcg(3);
    for slots in SLOTS {
        let sel = random_selection(&mut rng, slots);
        let mut counts = vec![99u32; slots.experts];
        moe_expert_counts(&sel, &mut counts, slots).unwrap();
        let want: Vec<u32> = (0..slots.experts as u32)
            .map(|e| sel.iter().filter(|&&s| s == e).count() as u32)
            .collect();
        assert_eq!(counts, want, "{slots:?}");
    }
    let slots = SLOTS[0];
    let mut sel = random_selection(&mut rng, slots);
    sel[5] = 4;
    let err = moe_expert_counts(&sel, &mut [0; 4], slots)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("moe_expert_counts: selected expert 4"),
        "{err}"
    );
}

#[test]
fn sort_by_expert_is_the_stable_sort_by_expert_token_slot() {
    let mut rng = Lcg(5);
    for slots in SLOTS {
        let k = slots.top_k;
        let sel = random_selection(&mut rng, slots);
        let mut counts = vec![0u32; slots.experts];
        moe_expert_counts(&sel, &mut counts, slots).unwrap();
        let n = sel.len();
        let (mut positions, mut sources) = (vec![0u32; n], vec![0u32; n]);
        let out = ExpertOrder {
            positions: &mut positions[..],
            sources: &mut sources[..],
        };
        moe_sort_by_expert(&sel, &counts, out, slots).unwrap();
        // Reference: the slot indices sorted by (expert, token, k-slot).
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&slot| (sel[slot], slot / k, slot % k));
        for (row, &slot) in order.iter().enumerate() {
            assert_eq!(positions[slot] as usize, row, "{slots:?} slot {slot}");
            assert_eq!(sources[row] as usize, slot / k, "{slots:?} row {row}");
        }
    }
    // Counts that do not describe the selection are refused.
    let slots = SLOTS[0];
    let sel = random_selection(&mut rng, slots);
    let mut counts = vec![0u32; 4];
    moe_expert_counts(&sel, &mut counts, slots).unwrap();
    let (mut p, mut q) = (vec![0u32; 14], vec![0u32; 14]);
    let mut moved = counts.clone();
    let from = moved.iter().position(|&c| c > 0).unwrap();
    moved[from] -= 1;
    moved[(from + 1) % 4] += 1;
    let out = ExpertOrder {
        positions: &mut p[..],
        sources: &mut q[..],
    };
    let err = moe_sort_by_expert(&sel, &moved, out, slots)
        .unwrap_err()
        .to_string();
    assert!(err.contains("is selected more often than counts"), "{err}");
    let mut short = counts.clone();
    short[0] += 1;
    let out = ExpertOrder {
        positions: &mut p[..],
        sources: &mut q[..],
    };
    let err = moe_sort_by_expert(&sel, &short, out, slots)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the counts sum to 15, but the routing has 14 slots"),
        "{err}"
    );
}

#[test]
fn expert_major_order_groups_received_rows_by_expert_then_rank() {
    let mut rng = Lcg(11);
    for (ranks, l) in [(1, 4), (2, 2), (3, 1), (4, 3)] {
        let counts: Vec<u32> = (0..ranks * l).map(|_| rng.below(4)).collect();
        let total = counts.iter().sum::<u32>() as usize;
        // Reference: label every received row (rank, expert, arrival),
        // then sort the labels expert-major.
        let mut labels = Vec::new();
        for i in 0..ranks {
            for j in 0..l {
                for a in 0..counts[i * l + j] {
                    labels.push((j, i, a));
                }
            }
        }
        let mut want: Vec<u32> = (0..total as u32).collect();
        want.sort_by_key(|&row| labels[row as usize]);
        let mut order = vec![0u32; total];
        let dims = ReceivedDims {
            ranks,
            local_experts: l,
        };
        moe_expert_major_order(&counts, &mut order, dims).unwrap();
        assert_eq!(order, want, "{ranks} ranks x {l} experts: {counts:?}");
        let err = moe_expert_major_order(&counts, &mut vec![0; total + 1], dims)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`order` has"), "{err}");
    }
}

#[test]
fn load_sums_micro_batches_exactly() {
    // Two micro-batches of one layer, then counts past f32's exact
    // integers onto a total past u32's: every sum is the integer sum.
    let mut load = vec![0.0f64; 3];
    moe_load_accumulate(&[1, 2, 3], &mut load);
    moe_load_accumulate(&[4, 0, 1], &mut load);
    assert_eq!(load, [5.0, 2.0, 4.0]);
    let mut load = [(1u64 << 40) as f64, 0.0];
    moe_load_accumulate(&[u32::MAX, (1 << 24) + 1], &mut load);
    assert_eq!(
        load,
        [((1u64 << 40) + u64::from(u32::MAX)) as f64, 16_777_217.0]
    );
}

#[test]
fn aux_loss_and_its_gradient_match_the_switch_formula() {
    let slots = SLOTS[0];
    let (t, k, e) = (
        slots.tokens as f64,
        slots.top_k as f64,
        slots.experts as f64,
    );
    let counts = [5u32, 0, 6, 3];
    let sums = [1.75f32, 0.5, 3.25, 1.5];
    let dims = AuxLossDims { slots, coeff: 0.1 };
    let mut loss = [0.5f64];
    moe_aux_loss_forward(&counts, &sums, &mut loss, dims);
    let want: f64 = 0.1f32 as f64
        * e
        * (0..4)
            .map(|i| counts[i] as f64 / (t * k) * sums[i] as f64 / t)
            .sum::<f64>();
    assert!(
        (loss[0] - 0.5 - want).abs() < 1e-12,
        "{} vs {want}",
        loss[0] - 0.5
    );
    let mut grad = [9.0f32; 4];
    moe_aux_loss_backward(&counts, &mut grad, dims, 0.7);
    for i in 0..4 {
        let want = 0.1f32 as f64 * e * counts[i] as f64 / (t * k) / t * 0.7f32 as f64;
        assert!(
            (grad[i] as f64 - want).abs() < 1e-7,
            "[{i}] {} vs {want}",
            grad[i]
        );
    }
    // Off (coefficient 0) and empty micro-batches add nothing.
    let off = AuxLossDims { coeff: 0.0, ..dims };
    moe_aux_loss_forward(&counts, &sums, &mut loss, off);
    let empty = AuxLossDims {
        slots: RoutedSlots { tokens: 0, ..slots },
        ..dims
    };
    moe_aux_loss_forward(&counts, &sums, &mut loss, empty);
    assert!((loss[0] - 0.5 - want).abs() < 1e-12);
    moe_aux_loss_backward(&counts, &mut grad, empty, 1.0);
    assert_eq!(grad, [0.0; 4]);
}

// ---- the backend's dtype rules --------------------------------------------------

mod dtypes {
    use crate::backend::{
        AuxLossDims, Backend, ExpertBias, ExpertOrder, ReceivedDims, RouteDims, RouteOutputs,
        RoutedSlots, RouterScores, UnpermuteDims,
    };
    use crate::cpu::ops::refusals::buf;
    use crate::cpu::{CpuBackend, CpuBuf};
    use crate::view::{DType, View, ViewMut};
    use hybridgen_dsl::config::ScoreFunction;

    /// Refused with a dtype error of `arg` (not only naming it).
    fn refused(result: crate::Result<()>, kernel: &str, arg: &str) {
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains(&format!("kernel `{kernel}`: `{arg}` is")),
            "{kernel}/{arg}: {err}"
        );
    }

    fn w(buf: &CpuBuf) -> View<'_, CpuBuf> {
        View::whole(buf)
    }

    fn m(buf: &CpuBuf) -> ViewMut<'_, CpuBuf> {
        ViewMut::whole(buf)
    }

    #[test]
    fn index_arguments_must_be_u32_and_routing_state_f32() {
        let b = CpuBackend::default();
        let slots = RoutedSlots {
            tokens: 2,
            top_k: 1,
            experts: 2,
        };
        let (u32s, f32s) = (buf(&b, 2, DType::U32), buf(&b, 2, DType::F32));
        let (f64s, bf16s) = (buf(&b, 1, DType::F64), buf(&b, 2, DType::Bf16));
        refused(
            b.moe_expert_counts(w(&f32s), m(&u32s), slots),
            "moe_expert_counts",
            "selected",
        );
        refused(
            b.moe_expert_counts(w(&u32s), m(&f32s), slots),
            "moe_expert_counts",
            "counts",
        );
        let (p, q) = (buf(&b, 2, DType::U32), buf(&b, 2, DType::F32));
        let out = ExpertOrder {
            positions: m(&p),
            sources: m(&q),
        };
        refused(
            b.moe_sort_by_expert(w(&u32s), w(&u32s), out, slots),
            "moe_sort_by_expert",
            "sources",
        );
        let dims = ReceivedDims {
            ranks: 1,
            local_experts: 2,
        };
        refused(
            b.moe_expert_major_order(w(&bf16s), m(&u32s), dims),
            "moe_expert_major_order",
            "recv_counts",
        );
        let aux = AuxLossDims { slots, coeff: 0.1 };
        refused(
            b.moe_aux_loss_forward(w(&u32s), w(&f32s), m(&buf(&b, 1, DType::F32)), aux),
            "moe_aux_loss_forward",
            "loss",
        );
        refused(
            b.moe_aux_loss_forward(w(&u32s), w(&bf16s), m(&f64s), aux),
            "moe_aux_loss_forward",
            "prob_sum",
        );
        refused(
            b.moe_aux_loss_backward(w(&u32s), m(&bf16s), aux, 1.0),
            "moe_aux_loss_backward",
            "aux_grad",
        );
        let rows = buf(&b, 4, DType::F32);
        refused(
            b.gather_rows(w(&rows), w(&f32s), m(&buf(&b, 4, DType::F32)), 2),
            "gather_rows",
            "index",
        );
        refused(
            b.scatter_rows(w(&rows), w(&f32s), m(&buf(&b, 4, DType::F32)), 2),
            "scatter_rows",
            "index",
        );
        let err = b
            .gather_rows(w(&rows), w(&u32s), m(&buf(&b, 4, DType::Bf16)), 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`src` is f32 but `dst` is bf16"), "{err}");
        let un = UnpermuteDims {
            tokens: 2,
            top_k: 1,
            rows: 2,
            width: 2,
        };
        refused(
            b.moe_unpermute(
                w(&rows),
                Some(w(&f32s)),
                w(&f32s),
                m(&buf(&b, 4, DType::F32)),
                un,
            ),
            "moe_unpermute",
            "positions",
        );
        refused(
            b.moe_unpermute(
                w(&rows),
                Some(w(&bf16s)),
                w(&u32s),
                m(&buf(&b, 4, DType::F32)),
                un,
            ),
            "moe_unpermute",
            "weights",
        );
        let route = RouteDims {
            rows: 1,
            experts: 2,
            top_k: 1,
            score: ScoreFunction::Softmax,
            topk_scale: 1.0,
        };
        let scores = buf(&b, 2, DType::F32);
        let (weights, sums) = (buf(&b, 1, DType::F32), buf(&b, 2, DType::F32));
        let out = || RouteOutputs {
            scores: m(&scores),
            weights: m(&weights),
            prob_sum: Some(m(&sums)),
        };
        refused(
            b.moe_route_forward(w(&f32s), None, out(), m(&buf(&b, 1, DType::F32)), route),
            "moe_route_forward",
            "selected",
        );
        refused(
            b.moe_route_forward(w(&bf16s), None, out(), m(&buf(&b, 1, DType::U32)), route),
            "moe_route_forward",
            "logits",
        );
        refused(
            b.moe_route_forward(
                w(&f32s),
                Some(ExpertBias {
                    bias: w(&bf16s),
                    unbiased: m(&buf(&b, 1, DType::U32)),
                }),
                out(),
                m(&buf(&b, 1, DType::U32)),
                route,
            ),
            "moe_route_forward",
            "expert_bias",
        );
        let saved = RouterScores {
            logits: w(&f32s),
            scores: w(&scores),
        };
        refused(
            b.moe_route_backward(
                saved,
                w(&buf(&b, 1, DType::U32)),
                w(&weights),
                w(&bf16s),
                m(&buf(&b, 2, DType::F32)),
                route,
            ),
            "moe_route_backward",
            "aux_grad",
        );
    }
}

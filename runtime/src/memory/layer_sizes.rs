//! What one layer of each kind keeps from its forward to its backward and
//! the working set while it runs (`layers/*.rs`), and the widest operands a
//! backend that widens bf16 copies to f32.

use super::Elements;
use crate::backend::Tokens;
use hybridgen_dsl::config::{Activation, DsaConfig};
use hybridgen_dsl::{LayerKind, ModelConfig};

/// What one layer of `kind` keeps from forward to backward, and the extra
/// working set while it runs, for one micro-batch (`layers/*.rs`).
pub(super) fn layer(model: &ModelConfig, kind: LayerKind, tokens: Tokens) -> (Elements, Elements) {
    let n = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
    let h = model.hidden_size as u64;
    let per_token = |saved_compute: u64, saved_f32: u64, extra_compute: u64| {
        (
            Elements::new(n.saturating_mul(saved_compute), n.saturating_mul(saved_f32)),
            Elements::new(n.saturating_mul(extra_compute), 0),
        )
    };
    let ffn = |width: usize, activation: Activation| {
        let w = width as u64;
        (w * activation.fc1_factor() as u64, w)
    };
    match kind {
        LayerKind::Mamba => {
            let Some(m) = &model.mamba else {
                return Default::default();
            };
            let (heads, d, groups) = (
                m.num_heads as u64,
                (m.num_heads * m.head_dim) as u64,
                m.num_groups as u64,
            );
            let c = d + 2 * groups * m.state_size as u64;
            // x_in, u, z, xBC before the conv, dt, y; the input norm's rstd.
            // The backward recomputes the rest in two phases: first gated
            // and normed with d_normed and d_gated (4 d), then, with normed,
            // d_z and the conv's output, d_xBC, its gradient before the
            // SiLU and d_xBC_in, d_dt and d_out (h + 2 d + 4 c); d_u in
            // f32, the gated norm's rstd.
            let (mut saved, mut extra) =
                per_token(2 * h + 2 * d + c + heads, 1, h + 4 * d + 4 * c + heads);
            extra.f32 = n.saturating_mul(h + groups);
            // The scan's chunk states: per sequence, chunk, head, P x N.
            let chunks = (tokens.seq.div_ceil(m.chunk_size.max(1))) as u64;
            saved.f32 = saved.f32.saturating_add(
                (tokens.batch as u64)
                    .saturating_mul(chunks)
                    .saturating_mul(d)
                    .saturating_mul(m.state_size as u64),
            );
            (saved, extra)
        }
        LayerKind::Attention => {
            let Some(a) = &model.attention else {
                return Default::default();
            };
            let c = model.attention_head_dim().unwrap_or(0) as u64;
            let (q, kv) = (a.num_heads as u64 * c, a.num_kv_groups as u64 * c);
            let norm = if a.qk_norm {
                (q + kv, a.num_heads + a.num_kv_groups)
            } else {
                (0, 0)
            };
            // x_in, u, q, k, v, o (+ pre-norm q, k); rstd, lse (+ q/k rstd).
            // Forward drops the fused qkv; backward holds d_out, d_o, dq,
            // dk, dv, d_qkv, d_u.
            per_token(
                2 * h + 2 * q + 2 * kv + norm.0,
                1 + a.num_heads as u64 + norm.1 as u64,
                2 * h + 3 * q + 4 * kv + norm.0,
            )
        }
        LayerKind::Mla | LayerKind::Dsa => {
            let Some(m) = &model.mla else {
                return Default::default();
            };
            let a = m.num_heads as u64;
            let (dqk, dv) = (
                (m.qk_head_dim + m.qk_rope_head_dim) as u64,
                m.v_head_dim as u64,
            );
            let (kr, qr) = (m.kv_lora_rank as u64, m.q_lora_rank.unwrap_or(0) as u64);
            let dr = m.qk_rope_head_dim as u64;
            // Backward through the projections, either form: d_out, d_u,
            // d_k_rope and the latents' gradients (raw and normed).
            let projection_grads = 2 * h + dr + 2 * kr + 2 * qr;
            let (attention, attention_grads) = match kind {
                // `D` attends over the latent, one shared row of width
                // `dl` a token: it keeps q, the absorbed queries, the
                // shared rows [c | rope(k_rope)], the output over the
                // latent and the heads' outputs. Its backward holds d_o,
                // the output over the latent's gradient, the absorbed
                // queries' and the shared rows' through the sparse
                // attention's backward, then d_o, the absorbed queries'
                // gradient and dq beside the projections' backward.
                LayerKind::Dsa => {
                    let dl = kr + dr;
                    (
                        a * dqk + a * dl + dl + a * kr + a * dv,
                        (a * dv + a * kr + a * dl + dl)
                            .max(projection_grads + a * dv + a * dl + a * dqk),
                    )
                }
                // q, k, v, o, per head; backward d_o, dq, dk, dv and the
                // up-projected keys' and values' gradient.
                _ => (
                    2 * a * dqk + 2 * a * dv,
                    projection_grads + 2 * a * dqk + 2 * a * dv + a * (m.qk_head_dim as u64 + dv),
                ),
            };
            // The latents, raw and (with their norms) normed, and the
            // norms' rstd.
            let (latents, latent_rstds) = if m.qk_norm {
                (2 * (qr + kr), 1 + u64::from(qr > 0))
            } else {
                (qr + kr, 0)
            };
            // x_in, u, the latents, the attention's; the input's rstd, the
            // latents', lse.
            let (mut saved, mut extra) = per_token(
                2 * h + latents + attention,
                1 + latent_rstds + a,
                attention_grads,
            );
            if let (LayerKind::Dsa, Some(d)) = (kind, &model.dsa) {
                let (kept, forward, backward) = dsa_indexer(d, tokens);
                saved = saved.plus(kept);
                extra = either(forward, extra.plus(backward));
            }
            (saved, extra)
        }
        LayerKind::Mlp => {
            let Some(m) = &model.mlp else {
                return Default::default();
            };
            let (pre, act) = ffn(m.ffn_hidden_size, m.activation);
            // x_in, u, fc1 output; rstd (the activation is recomputed in
            // the backward). Backward: d_out, d_pre, d_act (then the
            // recomputed activation in its place), d_u.
            per_token(2 * h + pre, 1, 2 * h + pre + act)
        }
        LayerKind::Moe => {
            let Some(m) = &model.moe else {
                return Default::default();
            };
            let (e, k) = (m.num_experts as u64, m.top_k as u64);
            let (pre, act) = ffn(m.ffn_hidden_size, m.activation);
            let (shared_pre, shared_act) = m
                .shared_expert_ffn_hidden_size
                .map_or((0, 0), |w| ffn(w, m.activation));
            let (shared_saved, shared) = if m.shared_expert_ffn_hidden_size.is_some() {
                (shared_pre, shared_pre + shared_act + h)
            } else {
                (0, 0)
            };
            // x_in, u, the shared expert's fc1 output (its output is
            // dropped once combined); per routed row (k per token): the
            // experts' input, fc1 output and the returned row (the
            // activations are recomputed in the backward). In f32: rstd, the router's logits, scores and
            // weights, and the u32 indices (selected, positions, regroup).
            // Forward also holds the send, received and output rows and
            // the activations for a while; backward their gradients, the
            // recomputed activations, the logits' gradient (f32, and cast
            // to the compute dtype for the router's GEMMs), the weights'
            // gradient and the norm's output gradient (f32).
            let (saved, mut extra) = per_token(
                2 * h + shared_saved + k * (2 * h + pre),
                1 + 2 * e + k + 3 * k,
                h + e + shared + k * (4 * h + pre + act),
            );
            extra.f32 = n.saturating_mul(e + k + h);
            (saved, extra)
        }
        LayerKind::GatedDeltaNet => {
            let Some(g) = &model.gdn else {
                return Default::default();
            };
            let (hv, kd, vd) = (
                g.value_heads as u64,
                (g.key_heads * g.key_head_dim) as u64,
                (g.value_heads * g.value_head_dim) as u64,
            );
            let c = 2 * kd + vd;
            // x_in, u, q|k|v before the conv, o, z, beta and alpha; the
            // input norm's rstd. The backward recomputes q|k|v after the
            // conv (before and after the SiLU), o's norm (and its rstd) and
            // the gated output, a phase at a time beside d_out and the same
            // widths' gradients (at most the conv's input and output, its
            // gradients at both ends, and three of vd); d_u, the gates' and
            // the norm's rstd in f32 (`layers/gdn.rs`).
            let (mut saved, mut extra) =
                per_token(2 * h + c + 2 * vd + 2 * hv, 1, h + 4 * c + 5 * vd + 2 * hv);
            extra.f32 = n.saturating_mul(h + 2 * hv);
            // The recurrence's states at every chunk start: per sequence,
            // chunk and value head, dv' x dk in f32.
            let chunks = tokens.seq.div_ceil(crate::layers::gdn::STATE_CHUNK) as u64;
            saved.f32 = saved.f32.saturating_add(
                (tokens.batch as u64)
                    .saturating_mul(chunks)
                    .saturating_mul(hv)
                    .saturating_mul((g.value_head_dim * g.key_head_dim) as u64),
            );
            (saved, extra)
        }
    }
}

/// What a `D` layer's lightning indexer adds to its MLA's activations
/// (`layers/dsa.rs`), for one micro-batch: what it keeps, its forward's
/// working set, and its backward's. Kept: each query's selected keys
/// (u32, counted with the f32s) and, with the indexer loss on, the
/// indexer's q, raw and normed k and head weights, its key norm's stats,
/// the loss's per-row shares and its score gradient, f32 `[rows, seq]` (a
/// row a query, a column a key: `seq` floats a token). The forward holds
/// the scores, f32 `[rows, seq]` again, until the keys are chosen (and the
/// indexer's outputs, when no loss keeps them); the backward, the
/// indexer's gradients.
fn dsa_indexer(d: &DsaConfig, tokens: Tokens) -> (Elements, Elements, Elements) {
    let n = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
    let (ni, di, seq) = (
        d.index_heads as u64,
        d.index_head_dim as u64,
        tokens.seq as u64,
    );
    let outputs = ni * di + 2 * di + ni;
    let topk = d.index_topk as u64;
    let per_token =
        |compute: u64, f32s: u64| Elements::new(n.saturating_mul(compute), n.saturating_mul(f32s));
    if d.indexer_loss_coeff > 0.0 {
        (
            per_token(outputs, topk + 2 + 1 + seq),
            per_token(0, seq),
            per_token(outputs, 0),
        )
    } else {
        (
            per_token(0, topk),
            per_token(outputs, seq + 2),
            Elements::default(),
        )
    }
}

/// A bound on the larger of two working sets that are never alive
/// together (a layer's forward and its backward), whether a compute
/// element takes 2 bytes or 4: the larger compute count, and the f32s the
/// other needs beyond what the compute elements it lacks already cover (at
/// least 2 bytes each, so half an f32 each). Adding them would count the
/// indexer's `[rows, seq]` scores on top of the MLA's backward, which the
/// forward has long freed.
fn either(a: Elements, b: Elements) -> Elements {
    let (big, small) = if a.compute >= b.compute {
        (a, b)
    } else {
        (b, a)
    };
    let covered = (big.compute - small.compute) / 2;
    Elements::new(big.compute, big.f32.max(small.f32.saturating_sub(covered)))
}

/// The elements of the largest matrix product's operands, which a backend
/// that widens bf16 operands ([`ElementSizes::widened`]) copies to f32 while
/// it runs: the weight (the largest parameter, or a MoE layer's
/// `local_experts` fc1 weights, one grouped product), and the widest input
/// and output rows of any product of the layers `kinds` or the head, one
/// per token (the routed rows of a MoE layer: `top_k` per token); the
/// head's only where the rank runs it (`head`).
pub(super) fn widened_operands(
    model: &ModelConfig,
    kinds: impl IntoIterator<Item = LayerKind>,
    head: bool,
    local_experts: usize,
    largest_param: u64,
    tokens: Tokens,
) -> u64 {
    let n = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
    let h = model.hidden_size as u64;
    let mut weight = largest_param;
    // The head: `[tokens, h] x [V, h]^T`, or its logit gradients back.
    let mut rows = if head {
        h.saturating_add(model.padded_vocab_size() as u64)
    } else {
        0
    };
    let mut seen = [false; LayerKind::ALL.len()];
    for kind in kinds {
        if std::mem::replace(&mut seen[kind as usize], true) {
            continue;
        }
        // Input plus output width per token, for each product of the layer.
        let widths: Vec<u64> = match kind {
            LayerKind::Mamba => model.mamba.as_ref().map_or(vec![], |m| {
                let d = (m.num_heads * m.head_dim) as u64;
                let xbc = d + 2 * (m.num_groups * m.state_size) as u64;
                vec![h + d + xbc + m.num_heads as u64, d + h]
            }),
            LayerKind::Attention => model.attention.as_ref().map_or(vec![], |a| {
                let c = model.attention_head_dim().unwrap_or(0) as u64;
                let (q, kv) = (a.num_heads as u64 * c, a.num_kv_groups as u64 * c);
                vec![h + q + 2 * kv, q + h]
            }),
            LayerKind::Mla | LayerKind::Dsa => model.mla.as_ref().map_or(vec![], |m| {
                let a = m.num_heads as u64;
                let (kr, qr) = (m.kv_lora_rank as u64, m.q_lora_rank.unwrap_or(0) as u64);
                let (dqk, rope, dv) = (
                    m.qk_head_dim as u64,
                    m.qk_rope_head_dim as u64,
                    m.v_head_dim as u64,
                );
                // Queries through the low-rank latent when there is one.
                let q = a * (dqk + rope);
                let mut widths = vec![
                    h + if qr > 0 { qr } else { q },
                    qr + q,
                    h + kr + rope,
                    kr + a * (dqk + dv),
                    a * dv + h,
                ];
                // A `D` layer's indexer: its queries from the compressed
                // query, its key and head weights from the input.
                if let (LayerKind::Dsa, Some(d)) = (kind, &model.dsa) {
                    let (ni, di) = (d.index_heads as u64, d.index_head_dim as u64);
                    widths.extend([qr + ni * di, h + di, h + ni]);
                }
                widths
            }),
            LayerKind::Mlp => model.mlp.as_ref().map_or(vec![], |m| {
                let w = m.ffn_hidden_size as u64;
                vec![h + w * m.activation.fc1_factor() as u64, w + h]
            }),
            LayerKind::Moe => model.moe.as_ref().map_or(vec![], |m| {
                let (w, k) = (m.ffn_hidden_size as u64, m.top_k as u64);
                let pre = w * m.activation.fc1_factor() as u64;
                weight = weight.max((local_experts as u64).saturating_mul(pre * h));
                let shared = m
                    .shared_expert_ffn_hidden_size
                    .map_or(0, |s| h + s as u64 * m.activation.fc1_factor() as u64);
                vec![h + m.num_experts as u64, k * (h + pre), k * (w + h), shared]
            }),
            LayerKind::GatedDeltaNet => model.gdn.as_ref().map_or(vec![], |g| {
                let (hv, kd, vd) = (
                    g.value_heads as u64,
                    (g.key_heads * g.key_head_dim) as u64,
                    (g.value_heads * g.value_head_dim) as u64,
                );
                // in_proj's q|k|v, z, beta and alpha; out_proj.
                vec![h + 2 * kd + 2 * vd + 2 * hv, vd + h]
            }),
        };
        rows = widths.into_iter().fold(rows, u64::max);
    }
    weight.saturating_add(n.saturating_mul(rows))
}

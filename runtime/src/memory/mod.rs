//! How much memory a training run needs, estimated before anything is
//! allocated, and how much the machine has.
//!
//! Per rank a run holds its weights and their state (what [`FsdpEngine::new`]
//! and [`Optimizer::new`] allocate: shards, master weights, gradients,
//! optimizer moments, the unit pool and the non-unit buffers), plus the
//! activations of the micro-batches its schedule keeps in flight, plus, for
//! a moment, scratch (the largest bucket, initialised or hashed). Activations are
//! counted from what each layer kind's forward keeps for its backward
//! (`layers/*.rs`, the `...Saved` structs), the largest working set of one
//! layer's backward, and the output heads, whose `[tokens, vocab]` f32
//! probabilities are often the largest single buffer. Thread ranks share one
//! process, so the process needs every rank's share.
//!
//! [`FsdpEngine::new`]: crate::fsdp::FsdpEngine::new
//! [`Optimizer::new`]: crate::optimizer::Optimizer::new

use crate::backend::{
    AttentionBackend, AttentionDims, Backend, Precision, ScanDims, ScratchCall, ScratchSettings,
    Tokens,
};
use crate::cuda::CudaBackend;
use crate::fsdp::{ShardLayout, Sharding};
use crate::optimizer::OptimizerKind;
use crate::recompute::Recompute;
use crate::view::DType;
use hybridgen_dsl::config::Activation;
use hybridgen_dsl::params::layer_params;
use hybridgen_dsl::{LayerKind, ModelConfig, Plan};
use std::path::Path;

/// Bytes per element of each precision ([`crate::Precision`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementSizes {
    /// Parameters and activations.
    pub compute: u64,
    /// Master weights, gradients (shards, unit buffers and non-unit
    /// buffers), optimizer moments, norms' `rstd`, softmax statistics,
    /// router scores and the heads' logits.
    pub f32: u64,
    /// Bytes per compute element that a kernel holds beside its operands
    /// while it runs: the CPU backend computes in f32, so its kernels widen
    /// bf16 operands into f32 copies (and round outputs back from one);
    /// 0 where kernels read their operands in place (f32 on the CPU, a GPU).
    pub widened: u64,
}

impl ElementSizes {
    /// The CPU backend in f32, its default.
    pub const CPU: ElementSizes = ElementSizes::cpu(Precision::F32);

    /// The CPU backend storing parameters and activations in `precision`
    /// (`crate::cpu::CpuBuf` stores bf16 in two bytes) and widening bf16
    /// operands to f32 for each kernel.
    pub const fn cpu(precision: Precision) -> ElementSizes {
        match precision {
            Precision::F32 => ElementSizes {
                compute: 4,
                f32: 4,
                widened: 0,
            },
            Precision::Bf16 => ElementSizes {
                compute: 2,
                f32: 4,
                widened: 4,
            },
        }
    }
}

/// Elements of each precision (host index vectors count as `f32`: 4 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Elements {
    compute: u64,
    f32: u64,
}

impl Elements {
    fn new(compute: u64, f32: u64) -> Self {
        Elements { compute, f32 }
    }

    fn bytes(self, sizes: ElementSizes) -> u64 {
        self.compute
            .saturating_mul(sizes.compute)
            .saturating_add(self.f32.saturating_mul(sizes.f32))
    }

    fn plus(self, other: Elements) -> Self {
        Elements::new(
            self.compute.saturating_add(other.compute),
            self.f32.saturating_add(other.f32),
        )
    }
}

/// Activations of one micro-batch on one rank, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ActivationEstimate {
    /// What every decoder and MTP layer keeps from its forward for its
    /// backward.
    pub layers: u64,
    /// Residual streams and their gradients, final norms, MTP entries and
    /// the micro-batch's tokens.
    pub streams: u64,
    /// The output heads (the main one and one per MTP depth): their input
    /// and `[tokens, vocab]` counted in f32, a bound on what a head holds
    /// (the logit gradients its forward keeps, in the compute dtype, or a
    /// chunk of logits in the compute dtype when it recomputes them).
    pub heads: u64,
    /// The largest extra working set of one layer while it runs (gradients
    /// of its intermediates in backward, or buffers its forward drops).
    pub working_set: u64,
    pub total: u64,
}

/// Activations of one micro-batch of `tokens` through the layers `kinds`
/// (decoder and MTP layers alike) with `mtp_depths` MTP depths, each layer
/// kind's dimensions taken from `model`; MoE layers route `top_k` rows per
/// token to experts (balanced: the expected rows per rank). A layer
/// `recompute` recomputes keeps its `[tokens, hidden]` input, and what it
/// would have kept is working set while its forward or backward runs
/// (`Auto` counts as `Full`: see [`Recompute::Auto`]).
pub fn activations(
    model: &ModelConfig,
    kinds: impl IntoIterator<Item = LayerKind>,
    mtp_depths: usize,
    tokens: Tokens,
    sizes: ElementSizes,
    recompute: Recompute,
) -> ActivationEstimate {
    let n = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
    let h = model.hidden_size as u64;
    let mut layers = Elements::default();
    let mut working = Elements::default();
    // Each kind's footprint is the same for every layer of it: compute once.
    let mut by_kind: [Option<(Elements, Elements)>; LayerKind::ALL.len()] =
        [None; LayerKind::ALL.len()];
    let kinds: Vec<LayerKind> = kinds.into_iter().collect();
    let chosen = recomputed(model, &kinds, tokens, recompute);
    for (&kind, recomputes) in kinds.iter().zip(chosen) {
        let (saved, extra) =
            *by_kind[kind as usize].get_or_insert_with(|| layer(model, kind, tokens));
        let (kept, extra) = if recomputes {
            (Elements::new(n.saturating_mul(h), 0), extra.plus(saved))
        } else {
            (saved, extra)
        };
        layers = layers.plus(kept);
        working = Elements::new(
            working.compute.max(extra.compute),
            working.f32.max(extra.f32),
        );
    }
    let depths = mtp_depths as u64;
    // x, dx, the final norm's output and its saved input (its weight
    // gradient keeps partial sums, not its input's gradient); per MTP depth
    // its entry (embedding, normed inputs, concatenation), its stream, final
    // norm and their gradients; the tokens (inputs, targets per head, MTP
    // inputs).
    let streams = Elements::new(
        n.saturating_mul(h)
            .saturating_mul(4u64.saturating_add(depths.saturating_mul(12))),
        n.saturating_mul(1 + depths.saturating_mul(3) + 1 + (depths + 1) + depths),
    );
    // Each head keeps its input and at most `[tokens, vocab]` f32.
    let vocab = model.padded_vocab_size() as u64;
    let heads = Elements::new(
        n.saturating_mul(h).saturating_mul(depths + 1),
        n.saturating_mul(vocab.saturating_add(2))
            .saturating_mul(depths + 1),
    );
    let [layers, streams, heads, working_set] =
        [layers, streams, heads, working].map(|e| e.bytes(sizes));
    ActivationEstimate {
        layers,
        streams,
        heads,
        working_set,
        total: layers
            .saturating_add(streams)
            .saturating_add(heads)
            .saturating_add(working_set),
    }
}

/// Every decoder and MTP layer's kind, in order: the order
/// [`Recompute::chosen`] takes them in and the runtime indexes layers in.
pub fn layer_kinds(plan: &Plan) -> impl Iterator<Item = LayerKind> + Clone + '_ {
    plan.layers
        .iter()
        .map(|l| l.kind)
        .chain(plan.mtp_layers.iter().flatten().map(|l| l.kind))
}

/// [`activations`] of a planned model's decoder and MTP layers.
pub fn plan_activations(
    plan: &Plan,
    tokens: Tokens,
    sizes: ElementSizes,
    recompute: Recompute,
) -> ActivationEstimate {
    activations(
        &plan.model,
        layer_kinds(plan),
        plan.mtp_depths(),
        tokens,
        sizes,
        recompute,
    )
}

/// For each of `model`'s layers of `kinds` (the decoder's, then each MTP
/// depth's), whether `recompute` has it keep only its input at `tokens` a
/// micro-batch: what the memory plan counts and the runtime runs.
pub fn recomputed(
    model: &ModelConfig,
    kinds: &[LayerKind],
    tokens: Tokens,
    recompute: Recompute,
) -> Vec<bool> {
    recompute.chosen(kinds, &kinds_by_kept(model, tokens))
}

/// The kinds of layer that can recompute, the one whose layer keeps the
/// most (elements of both widths) at `tokens` first, ties in
/// [`LayerKind::ALL`]'s order: the order [`Recompute::Largest`] takes them
/// in.
fn kinds_by_kept(model: &ModelConfig, tokens: Tokens) -> Vec<LayerKind> {
    let mut kinds: Vec<LayerKind> = LayerKind::ALL
        .into_iter()
        .filter(|&k| Recompute::can_recompute(k))
        .collect();
    kinds.sort_by_key(|&kind| {
        let (saved, _) = layer(model, kind, tokens);
        std::cmp::Reverse(saved.compute.saturating_add(saved.f32))
    });
    kinds
}

/// What one layer of `kind` keeps from forward to backward, and the extra
/// working set while it runs, for one micro-batch (`layers/*.rs`).
fn layer(model: &ModelConfig, kind: LayerKind, tokens: Tokens) -> (Elements, Elements) {
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
            // x_in, u, z, xBC before and after conv and SiLU, dt, y, gated,
            // normed; rstd of both norms. Backward: d_out, d_normed,
            // d_gated, d_z, d_y, d_xBC (three), d_dt; d_u in f32.
            let (mut saved, mut extra) = per_token(
                2 * h + 4 * d + 3 * c + heads,
                1 + groups,
                h + 4 * d + 3 * c + heads,
            );
            extra.f32 = n.saturating_mul(h);
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
            // x_in, u, the latents (raw and normed), q, k, v, o; rstds, lse.
            // Backward: d_out, d_o, dq, dk, dv, d_kv, d_k_rope, the latents'
            // gradients, d_u.
            per_token(
                2 * h + 2 * qr + 2 * kr + 2 * a * dqk + 2 * a * dv,
                3 + a,
                2 * h
                    + 2 * a * dqk
                    + 2 * a * dv
                    + a * (m.qk_head_dim as u64 + dv)
                    + m.qk_rope_head_dim as u64
                    + 2 * kr
                    + 2 * qr,
            )
        }
        LayerKind::Mlp => {
            let Some(m) = &model.mlp else {
                return Default::default();
            };
            let (pre, act) = ffn(m.ffn_hidden_size, m.activation);
            // x_in, u, fc1 output, activation; rstd. Backward: d_out, d_pre,
            // d_act, d_u.
            per_token(2 * h + pre + act, 1, 2 * h + pre + act)
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
            let shared = if m.shared_expert_ffn_hidden_size.is_some() {
                shared_pre + shared_act + h
            } else {
                0
            };
            // x_in, u, the shared expert; per routed row (k per token): the
            // experts' input, fc1 output and activation, and the returned
            // row. In f32: rstd, the router's logits, scores and weights,
            // and the u32 indices (selected, positions, regroup). Forward
            // also holds the send, received and output rows for a while;
            // backward their gradients, the logits' gradient (f32, and
            // cast to the compute dtype for the router's GEMMs), the
            // weights' gradient and the norm's output gradient (f32).
            let (saved, mut extra) = per_token(
                2 * h + shared + k * (2 * h + pre + act),
                1 + 2 * e + k + 3 * k,
                h + e + shared + k * (4 * h + pre + act),
            );
            extra.f32 = n.saturating_mul(e + k + h);
            (saved, extra)
        }
        // Planned, not trained by this runtime (refused before estimating).
        LayerKind::GatedDeltaNet => Default::default(),
    }
}

/// The elements of the largest matrix product's operands, which a backend
/// that widens bf16 operands ([`ElementSizes::widened`]) copies to f32 while
/// it runs: the weight (the largest parameter, or a MoE layer's
/// `local_experts` fc1 weights, one grouped product), and the widest input
/// and output rows of any product of the layers `kinds` or the head, one
/// per token (the routed rows of a MoE layer: `top_k` per token).
fn widened_operands(
    model: &ModelConfig,
    kinds: impl IntoIterator<Item = LayerKind>,
    local_experts: usize,
    largest_param: u64,
    tokens: Tokens,
) -> u64 {
    let n = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
    let h = model.hidden_size as u64;
    let mut weight = largest_param;
    // The head: `[tokens, h] x [V, h]^T`, or its logit gradients back.
    let mut rows = h.saturating_add(model.padded_vocab_size() as u64);
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
                vec![
                    h + if qr > 0 { qr } else { q },
                    qr + q,
                    h + kr + rope,
                    kr + a * (dqk + dv),
                    a * dv + h,
                ]
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
            LayerKind::GatedDeltaNet => vec![],
        };
        rows = widths.into_iter().fold(rows, u64::max);
    }
    weight.saturating_add(n.saturating_mul(rows))
}

/// Memory of one rank's weights, gradients, optimizer state and parameter
/// buffers, as [`crate::fsdp::FsdpEngine::new`] and
/// [`crate::optimizer::Optimizer::new`] allocate them, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StateEstimate {
    /// Parameter shards, master shards and gradient shards.
    pub shards: u64,
    /// Optimizer moments (two per element for Adam, one for SGD).
    pub optimizer: u64,
    /// Gathered units' parameters and gradients (ZeRO-3: the pool the
    /// schedule's dry run sizes; `no_shard`: every unit), the non-unit
    /// buffers and the reduce scratch.
    pub buffers: u64,
    /// Host scratch for the largest bucket, briefly: the whole bucket in f32
    /// while it is initialised, or every rank's shard of it in f64 while the
    /// final parameter hash gathers it, whichever is larger.
    pub scratch: u64,
    pub total: u64,
}

/// What [`StateEstimate`] depends on besides the plan.
#[derive(Clone, Copy, Debug)]
pub struct StateLayout {
    pub sharding: Sharding,
    pub ranks: usize,
    /// Expert-parallel size, checked as a plan's layout is: at least 1,
    /// dividing `ranks`.
    pub ep: usize,
    pub optimizer: OptimizerKind,
    /// The schedule's dry run: units resident at once, gradient buffers.
    pub resident_units: usize,
    pub grad_buffers: usize,
}

/// The state of one rank of `plan` under `layout`.
pub fn state(plan: &Plan, layout: StateLayout, sizes: ElementSizes) -> StateEstimate {
    let shard_layout = ShardLayout {
        sharding: layout.sharding,
        world: layout.ranks,
        ep: layout.ep,
    };
    let mut shard_elems = 0u64;
    let mut max_shard = 0u64;
    let mut max_padded = 0u64;
    let mut non_unit = 0u64;
    let mut unit_len = vec![0u64; plan.units.len()];
    for bucket in plan.buckets.iter() {
        let world = shard_layout.group_size(plan, bucket).max(1);
        let padded = bucket.padded_numel(world) as u64;
        let shard = bucket.shard_numel(world) as u64;
        shard_elems = shard_elems.saturating_add(shard);
        max_shard = max_shard.max(shard);
        max_padded = max_padded.max(padded);
        match bucket.unit {
            // Held buckets (and sole non-unit ones) live in their shards: no
            // room in the pool, no gradient buffer beyond the shard's
            // (`fsdp.rs`).
            Some(_) if shard_layout.sole(plan, bucket) => {}
            Some(u) => unit_len[u] = unit_len[u].saturating_add(padded),
            None => non_unit = non_unit.saturating_add(padded),
        }
    }
    let pooled: Vec<u64> = unit_len.iter().copied().filter(|&len| len > 0).collect();
    if shard_layout.sole_non_unit(plan) {
        non_unit = 0;
    }
    let slot = pooled.iter().copied().max().unwrap_or(0);
    let units = pooled.len() as u64;
    let param_slots = match layout.sharding {
        Sharding::NoShard => pooled.iter().fold(0u64, |a, &l| a.saturating_add(l)),
        Sharding::Zero3 => slot.saturating_mul((layout.resident_units as u64).min(units)),
    };
    let grad_slots = slot.saturating_mul((layout.grad_buffers.max(1) as u64).min(units));
    let moments = match layout.optimizer {
        OptimizerKind::Adam => 2,
        OptimizerKind::Sgd => 1,
    };
    let shards = Elements::new(shard_elems, shard_elems.saturating_mul(2)).bytes(sizes);
    let optimizer = Elements::new(0, shard_elems.saturating_mul(moments)).bytes(sizes);
    // Gathered parameters are in the compute dtype; their gradients are
    // accumulated in f32 (`fsdp.rs`).
    let buffers = Elements::new(
        param_slots.saturating_add(non_unit),
        grad_slots
            .saturating_add(non_unit)
            .saturating_add(max_shard),
    )
    .bytes(sizes);
    // The hash's gather: this rank's shard, its copy in the collective, and
    // every rank's shard.
    let hash = max_shard
        .saturating_mul(8)
        .saturating_mul(2 + layout.ranks as u64);
    StateEstimate {
        shards,
        optimizer,
        buffers,
        scratch: max_padded.saturating_mul(4).max(hash),
        total: shards.saturating_add(optimizer).saturating_add(buffers),
    }
}

/// What a run needs in memory: every figure the refusal prints.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemoryNeed {
    /// Thread ranks in this process.
    pub ranks: usize,
    /// Per rank.
    pub state: StateEstimate,
    /// Per micro-batch on one rank.
    pub activations: ActivationEstimate,
    /// Micro-batches the schedule keeps in flight per rank.
    pub live_micro_batches: usize,
    /// Per rank, while a matrix product runs: the CPU matmul packs its
    /// operands into f32 blocks, at most the size of its weight, so the
    /// largest weight (often the output layer, `[vocab, hidden]`) sets it.
    /// Where kernels widen bf16 operands ([`ElementSizes::widened`]), the
    /// f32 copies of the largest product's operands are added.
    pub kernel_scratch: u64,
    /// Per rank: what the arenas of the micro-batches in flight may hold
    /// beyond their activations. An arena grows by a quarter of its size
    /// (at least 1 MiB) when no free region fits, so it can end a quarter
    /// plus 1 MiB above its peak. Zero in a lower bound.
    pub arena_headroom: u64,
    /// Per rank: threads, lanes, the model's layer descriptions, the
    /// schedule and the engine's tables (about 1 MiB plus 2 KiB a layer,
    /// measured on the CPU backend).
    pub bookkeeping: u64,
    /// Per rank: state plus the larger of the live micro-batches'
    /// activations and the scratch (they are never needed at once).
    pub per_rank: u64,
    /// Every rank of the process.
    pub total: u64,
    /// A lower bound made before planning (state without padding or
    /// buffers), or the full estimate.
    pub lower_bound: bool,
    /// On GPUs: what each GPU holds besides the run's buffers (the CUDA
    /// context, cuBLAS workspaces, NCCL's buffers); `None` on the CPU.
    pub gpu_overhead: Option<u64>,
}

/// The kernel calls of `model`'s layers of `kinds` at `tokens` a
/// micro-batch that may take scratch while they run: attention (`*` and
/// MLA layers) and the Mamba scan.
pub fn scratch_calls(model: &ModelConfig, kinds: &[LayerKind], tokens: Tokens) -> Vec<ScratchCall> {
    let attention = |heads: usize, kv_heads: usize, qk_dim: usize, v_dim: usize| {
        ScratchCall::Attention(AttentionDims {
            tokens,
            heads,
            kv_heads,
            qk_dim,
            v_dim,
            scale: 1.0,
        })
    };
    let mut calls = Vec::new();
    if kinds.contains(&LayerKind::Attention)
        && let (Some(a), Some(c)) = (&model.attention, model.attention_head_dim())
    {
        calls.push(attention(a.num_heads, a.num_kv_groups, c, c));
    }
    if kinds.contains(&LayerKind::Mla)
        && let Some(m) = &model.mla
    {
        let qk = m.qk_head_dim + m.qk_rope_head_dim;
        calls.push(attention(m.num_heads, m.num_heads, qk, m.v_head_dim));
    }
    if kinds.contains(&LayerKind::Mamba)
        && let Some(m) = &model.mamba
    {
        calls.push(ScratchCall::Scan(ScanDims {
            tokens,
            heads: m.num_heads,
            head_dim: m.head_dim,
            groups: m.num_groups,
            state: m.state_size,
            chunk: m.chunk_size,
        }));
    }
    calls
}

/// The most scratch one call of `B`'s kernels takes for `model`'s layers
/// of `kinds` at `tokens` a micro-batch ([`Backend::kernel_scratch`] of
/// each of [`scratch_calls`]), in bytes. Calls run one at a time on a
/// lane, so the largest counts; the arena reuses it.
pub fn kernel_scratch<B: Backend>(
    model: &ModelConfig,
    kinds: &[LayerKind],
    tokens: Tokens,
    settings: ScratchSettings,
) -> u64 {
    scratch_calls(model, kinds, tokens)
        .into_iter()
        .map(|call| B::kernel_scratch(call, settings))
        .max()
        .unwrap_or(0)
}

/// [`kernel_scratch`] of the CUDA backend, activations in `dtype`, its
/// attention kernels `backend`, its GEMM attention and chunked scan capped
/// at `attention_cap` and `scan_cap` bytes a call.
pub fn gpu_kernel_scratch(
    model: &ModelConfig,
    kinds: &[LayerKind],
    tokens: Tokens,
    dtype: DType,
    backend: AttentionBackend,
    (attention_cap, scan_cap): (usize, usize),
) -> u64 {
    let settings = ScratchSettings {
        dtype,
        attention: backend,
        attention_cap,
        scan_cap,
    };
    kernel_scratch::<CudaBackend>(model, kinds, tokens, settings)
}

impl MemoryNeed {
    fn new(
        ranks: usize,
        state: StateEstimate,
        activations: ActivationEstimate,
        live_micro_batches: usize,
        kernel_scratch: u64,
        layers: usize,
        lower_bound: bool,
    ) -> Self {
        let bookkeeping = (1u64 << 20).saturating_add((layers as u64).saturating_mul(2048));
        let arena_headroom = if lower_bound {
            0
        } else {
            (activations.total / 4)
                .saturating_add(1 << 20)
                .saturating_mul(live_micro_batches as u64)
        };
        let mut need = MemoryNeed {
            ranks,
            per_rank: 0,
            total: 0,
            state,
            activations,
            live_micro_batches,
            kernel_scratch,
            arena_headroom,
            bookkeeping,
            lower_bound,
            gpu_overhead: None,
        };
        need.settle();
        need
    }

    /// Per rank and in all, from the parts.
    fn settle(&mut self) {
        self.per_rank = self
            .state
            .total
            .saturating_add(self.bookkeeping)
            .saturating_add(self.live().max(self.state.scratch));
        self.total = self.per_rank.saturating_mul(self.ranks as u64);
    }

    /// The need of one GPU, which runs one rank: the rank's memory, with
    /// the GPU kernels' scratch ([`gpu_kernel_scratch`]) where it is more
    /// than the CPU's, plus `overhead` for what the device itself takes.
    pub fn on_one_gpu(mut self, overhead: u64, kernel_scratch: u64) -> Self {
        self.kernel_scratch = self.kernel_scratch.max(kernel_scratch);
        self.settle();
        self.gpu_overhead = Some(overhead);
        self.total = self.per_rank.saturating_add(overhead);
        self
    }

    /// Per rank: the activations of the micro-batches in flight, with the
    /// kernel scratch and the arenas' headroom.
    fn live(&self) -> u64 {
        self.activations
            .total
            .saturating_mul(self.live_micro_batches as u64)
            .saturating_add(self.kernel_scratch)
            .saturating_add(self.arena_headroom)
    }

    /// The full estimate for a planned run.
    pub fn of_plan(
        plan: &Plan,
        layout: StateLayout,
        tokens: Tokens,
        live_micro_batches: usize,
        sizes: ElementSizes,
        recompute: Recompute,
    ) -> Self {
        let activations = plan_activations(plan, tokens, sizes, recompute);
        let largest = plan
            .param_defs
            .iter()
            .map(|d| d.numel() as u64)
            .max()
            .unwrap_or(0);
        // The plan's layout passed its check: ep is at least 1.
        let local_experts = plan.model.moe.as_ref().map_or(0, |m| m.num_experts) / plan.layout.ep;
        let widened = widened_operands(
            &plan.model,
            layer_kinds(plan),
            local_experts,
            largest,
            tokens,
        )
        .saturating_mul(sizes.widened);
        Self::new(
            layout.ranks,
            state(plan, layout, sizes),
            activations,
            live_micro_batches,
            largest.saturating_mul(sizes.f32).saturating_add(widened),
            plan.layers.len() + plan.mtp_layers.iter().map(Vec::len).sum::<usize>(),
            false,
        )
    }

    /// A lower bound from the pattern alone, cheap enough to run before
    /// planning (which takes seconds for 100,000 layers): the parameters'
    /// shards, masters, gradients and moments without padding or buffers,
    /// and the activations. `None` when the pattern does not parse (planning
    /// reports why). `layout` is checked as a plan's would be (its `ep` at
    /// least 1, dividing its ranks): the training checks its configuration's
    /// ranks and ep before it asks.
    pub fn lower_bound(
        model: &ModelConfig,
        layout: StateLayout,
        tokens: Tokens,
        live_micro_batches: usize,
        sizes: ElementSizes,
        recompute: Recompute,
    ) -> Option<Self> {
        let pattern = hybridgen_dsl::pattern::Pattern::parse(&model.pattern).ok()?;
        let mut dense = 0u64;
        let mut experts = 0u64;
        let kinds: Vec<LayerKind> = pattern
            .layers()
            .chain(pattern.mtp_depths.iter().flat_map(|d| &d.layers))
            .map(|l| l.kind)
            .collect();
        let mut per_kind: [Option<(u64, u64)>; LayerKind::ALL.len()] = [None; LayerKind::ALL.len()];
        for &kind in &kinds {
            let (d, e) = *per_kind[kind as usize].get_or_insert_with(|| {
                let experts = model.moe.as_ref().map_or(0, |m| m.num_experts);
                layer_params(kind, model, experts)
                    .iter()
                    .fold((0, 0), |(d, e), p| {
                        let numel = p.numel() as u64;
                        if p.expert {
                            (d, e + numel)
                        } else {
                            (d + numel, e)
                        }
                    })
            });
            dense = dense.saturating_add(d);
            experts = experts.saturating_add(e);
        }
        let embedding = (model.padded_vocab_size() as u64).saturating_mul(model.hidden_size as u64);
        dense = dense.saturating_add(if model.tie_embeddings {
            embedding
        } else {
            2 * embedding
        });
        let ranks = layout.ranks.max(1) as u64;
        // Per rank, on average: ZeRO-3 shards everything over the ranks
        // (experts over their expert-data-parallel group, each EP rank
        // holding its share of the experts); no_shard keeps it whole. The
        // checked layout's ep is at least 1.
        let elems = match layout.sharding {
            Sharding::Zero3 => dense.saturating_add(experts) / ranks,
            Sharding::NoShard => dense.saturating_add(experts / layout.ep as u64),
        };
        let moments = match layout.optimizer {
            OptimizerKind::Adam => 2,
            OptimizerKind::Sgd => 1,
        };
        let shards = Elements::new(elems, elems.saturating_mul(2)).bytes(sizes);
        let optimizer = Elements::new(0, elems.saturating_mul(moments)).bytes(sizes);
        let state = StateEstimate {
            shards,
            optimizer,
            buffers: 0,
            scratch: 0,
            total: shards.saturating_add(optimizer),
        };
        let layers = kinds.len();
        let activations = activations(
            model,
            kinds,
            pattern.mtp_depth_count(),
            tokens,
            sizes,
            recompute,
        );
        Some(Self::new(
            layout.ranks,
            state,
            activations,
            live_micro_batches,
            0,
            layers,
            true,
        ))
    }

    /// The refusal when this need exceeds `available`, with the figures and
    /// what to change; `None` when it fits. The tips name settings by what
    /// they are (the micro-batch size), not by a flag or field: `hints`
    /// carries no [`SettingSpelling`](crate::setting::SettingSpelling), and
    /// the wording reads the same from the command line and a library run.
    pub fn check(&self, available: &AvailableMemory, hints: &FitHints) -> Option<String> {
        if self.total <= available.bytes {
            return None;
        }
        let about = if self.lower_bound {
            "at least"
        } else {
            "about"
        };
        let live = self.live();
        let mut out = format!(
            "this run needs {about} {} of memory, but {} is available ({})\n",
            bytes(self.total),
            bytes(available.bytes),
            available.source
        );
        out += &format!(
            "  per rank: {} = {} parameters, gradients and optimizer state + {} activations \
             ({} micro-batch{} in flight x {}: layers {}, heads {}, streams {}, working set {}; \
             kernel scratch {}; arena headroom {})",
            bytes(self.per_rank),
            bytes(self.state.total),
            bytes(live),
            self.live_micro_batches,
            if self.live_micro_batches == 1 {
                ""
            } else {
                "es"
            },
            bytes(self.activations.total),
            bytes(self.activations.layers),
            bytes(self.activations.heads),
            bytes(self.activations.streams),
            bytes(self.activations.working_set),
            bytes(self.kernel_scratch),
            bytes(self.arena_headroom),
        );
        if self.state.scratch > live {
            out += &format!(
                " (the largest bucket's scratch, at the start and the end, takes {} more than \
                 the activations)",
                bytes(self.state.scratch - live)
            );
        }
        out += &match self.gpu_overhead {
            None => format!(
                "\n  {} thread rank{} in this process: {}\n  to fit, try:",
                self.ranks,
                if self.ranks == 1 { "" } else { "s" },
                bytes(self.total)
            ),
            Some(overhead) => format!(
                "\n  each GPU rank, plus {} for its CUDA context, cuBLAS and NCCL: {}\n  to \
                 fit, try:",
                bytes(overhead),
                bytes(self.total)
            ),
        };
        let mut tips = Vec::new();
        if live > self.state.total / 8 {
            tips.push(format!(
                "a smaller micro-batch size (now {}) or sequence length (now {}): activations \
                 grow with the tokens of a micro-batch",
                hints.micro_batch_size, hints.seq_length
            ));
            if self.live_micro_batches > 1 {
                tips.push(format!(
                    "the plain schedule: one micro-batch in flight instead of {}",
                    self.live_micro_batches
                ));
            }
            if matches!(hints.recompute, Recompute::None | Recompute::Layers(_))
                && self.activations.layers > 0
            {
                tips.push(format!(
                    "automatic recomputation: as few layers as it takes (up to all but MoE \
                     ones) keep only their input and run their forward again in the backward \
                     (layers now keep {} a micro-batch)",
                    bytes(self.activations.layers)
                ));
            }
        }
        if hints.sharding == Sharding::NoShard {
            tips.push(
                "ZeRO-3: shard parameters, gradients and optimizer state over the ranks"
                    .to_string(),
            );
        }
        if self.gpu_overhead.is_some() && hints.sharding == Sharding::Zero3 {
            tips.push(
                "more GPUs (more ranks): ZeRO-3 shards parameters, gradients and optimizer \
                 state over them"
                    .to_string(),
            );
        }
        if self.ranks > 1 && self.gpu_overhead.is_none() {
            tips.push(format!(
                "fewer ranks (now {}): every thread rank holds its own activations and buffers",
                self.ranks
            ));
        }
        if hints.optimizer == OptimizerKind::Adam && self.state.optimizer > available.bytes / 4 {
            tips.push("the SGD optimizer: one moment per parameter instead of Adam's two".into());
        }
        tips.push("a smaller model (fewer or narrower layers, a smaller vocabulary)".into());
        for tip in tips {
            out += &format!("\n    - {tip}");
        }
        Some(out)
    }
}

/// The settings a refusal suggests changing.
#[derive(Clone, Copy, Debug)]
pub struct FitHints {
    pub micro_batch_size: usize,
    pub seq_length: usize,
    pub sharding: Sharding,
    pub optimizer: OptimizerKind,
    pub recompute: Recompute,
}

/// Memory this process may still use, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AvailableMemory {
    pub bytes: u64,
    pub source: String,
}

/// What the operating system says this process may still allocate: Linux's
/// `MemAvailable`, or less when a cgroup (v2 or v1) limits the process
/// (a container). `None` where neither can be read (other systems).
pub fn available() -> Option<AvailableMemory> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text))
        .map(|bytes| AvailableMemory {
            bytes,
            source: "MemAvailable in /proc/meminfo".into(),
        });
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| cgroup_headroom(&text, Path::new("/sys/fs/cgroup")));
    match (meminfo, cgroup) {
        (Some(m), Some(c)) => Some(if c.bytes < m.bytes { c } else { m }),
        (m, c) => m.or(c),
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    let unit = match words.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(unit)
}

/// The least headroom (limit minus usage) of the cgroups this process is in
/// and their ancestors: `cgroup` is `/proc/self/cgroup`, `root` where the
/// cgroup file systems are mounted.
fn cgroup_headroom(cgroup: &str, root: &Path) -> Option<AvailableMemory> {
    let read = |path: &Path| -> Option<u64> {
        let text = std::fs::read_to_string(path).ok()?;
        text.trim().parse().ok()
    };
    let mut best: Option<AvailableMemory> = None;
    let mut consider = |limit: Option<u64>, usage: Option<u64>, path: &Path| {
        // v1 writes "no limit" as a number near i64::MAX.
        if let Some(limit) = limit.filter(|&l| l < 1 << 60) {
            let bytes = limit.saturating_sub(usage.unwrap_or(0));
            if best.as_ref().is_none_or(|b| bytes < b.bytes) {
                best = Some(AvailableMemory {
                    bytes,
                    source: format!("the cgroup limit in {}", path.display()),
                });
            }
        }
    };
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            // v2: the limit may sit on any ancestor.
            let mut dir = root.join(relative);
            loop {
                let max = dir.join("memory.max");
                consider(read(&max), read(&dir.join("memory.current")), &max);
                if dir == root || !dir.pop() || !dir.starts_with(root) {
                    break;
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            // v1; inside a container the path may not exist under the mount.
            let base = root.join("memory");
            for dir in [base.join(relative), base.clone()] {
                let limit = dir.join("memory.limit_in_bytes");
                if limit.exists() {
                    consider(
                        read(&limit),
                        read(&dir.join("memory.usage_in_bytes")),
                        &limit,
                    );
                    break;
                }
            }
        }
    }
    best
}

/// `bytes` for people: `1.5 GiB`, `640.0 KiB`.
pub fn bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests;

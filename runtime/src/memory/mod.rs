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
//! layer's backward, and the output heads, whose `[tokens, vocab]` logit
//! gradients are often the largest single buffer. Thread ranks share one
//! process, so the process needs every rank's share.
//!
//! Modules: `layer_sizes` (what each layer kind keeps and works in),
//! `scratch` (the GPU kernels' scratch), `refusal` (a rank's figures and
//! stages as a refusal words them), `available` (what the machine has:
//! Linux's `MemAvailable`, a cgroup's limit).
//!
//! [`FsdpEngine::new`]: crate::fsdp::FsdpEngine::new
//! [`Optimizer::new`]: crate::optimizer::Optimizer::new

mod available;
mod layer_sizes;
mod refusal;
mod scratch;

pub use available::{AvailableMemory, available};
#[cfg(test)]
use available::{cgroup_headroom, mem_available};
use layer_sizes::{layer, widened_operands};
use refusal::{describe_share, rank_figures};
pub use scratch::{gpu_kernel_scratch, kernel_scratch, scratch_calls};

use crate::backend::{Precision, Tokens};
use crate::fsdp::{ShardLayout, Sharding};
use crate::optimizer::OptimizerKind;
use crate::recompute::Recompute;
use hybridgen_dsl::params::layer_params;
use hybridgen_dsl::plan::{Bucket, LayerRef};
use hybridgen_dsl::{LayerKind, ModelConfig, Plan};

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
pub(super) struct Elements {
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
    /// The output heads (the main one and one per MTP depth): what each
    /// keeps (its input, and the logit gradients its forward computed, in
    /// the compute dtype, where a micro-batch's fit the kept limit).
    pub heads: u64,
    /// The largest extra working set of one layer or head while it runs
    /// (gradients of its intermediates in backward, or buffers its forward
    /// drops; a head's chunk of logits).
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
    let kinds: Vec<LayerKind> = kinds.into_iter().collect();
    let chosen = recomputed(model, &kinds, tokens, recompute);
    let ends = Ends {
        first: true,
        last: true,
        mtp_depths,
    };
    activations_of(model, &kinds, &chosen, ends, tokens, sizes)
}

/// What a rank runs besides its layers: the embedding (`first`), the final
/// norm and the heads (`last`), and `mtp_depths` MTP depths. Every rank
/// holds the residual stream and its gradient.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ends {
    first: bool,
    last: bool,
    mtp_depths: usize,
}

/// [`activations`] of the layers `kinds`, those `chosen` recomputing, on a
/// rank running `ends`.
fn activations_of(
    model: &ModelConfig,
    kinds: &[LayerKind],
    chosen: &[bool],
    ends: Ends,
    tokens: Tokens,
    sizes: ElementSizes,
) -> ActivationEstimate {
    let n = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
    let h = model.hidden_size as u64;
    let mut layers = Elements::default();
    let mut working = Elements::default();
    // Each kind's footprint is the same for every layer of it: compute once.
    let mut by_kind: [Option<(Elements, Elements)>; LayerKind::ALL.len()] =
        [None; LayerKind::ALL.len()];
    for (&kind, &recomputes) in kinds.iter().zip(chosen) {
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
    let depths = ends.mtp_depths as u64;
    // x, dx, the final norm's output and its saved input (its weight
    // gradient keeps partial sums, not its input's gradient); per MTP depth
    // its entry (embedding, normed inputs, concatenation), its stream, final
    // norm and their gradients; the tokens (inputs, targets per head, MTP
    // inputs), on the ranks that embed or run the heads.
    let stream_width = 2u64
        .saturating_add(if ends.last { 2 } else { 0 })
        .saturating_add(depths.saturating_mul(12));
    let token_rows = if ends.first || ends.last {
        n.saturating_mul(1 + depths.saturating_mul(3) + 1 + (depths + 1) + depths)
    } else {
        0
    };
    let streams = Elements::new(n.saturating_mul(h).saturating_mul(stream_width), token_rows);
    // Each head keeps its buffers until its backward; its working set, like
    // a layer's, is alive only while it runs.
    let heads = if ends.last {
        let head = head_activations(model, n);
        working = Elements::new(
            working.compute.max(head.working.compute),
            working.f32.max(head.working.f32),
        );
        Elements::new(
            head.kept.compute.saturating_mul(depths + 1),
            head.kept.f32.saturating_mul(depths + 1),
        )
    } else {
        Elements::default()
    };
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

/// What the output heads of a micro-batch of `n` tokens hold, as
/// [`crate::layers::Head`] runs them ([`Head::kept_elements`]): each head
/// keeps its input and, where `[n, vocab]` fits its limit, the logit
/// gradients its forward computed, in the compute dtype, until its
/// backward; one at a time, a head works on one chunk of logits (compute
/// dtype) and the rows' losses (f32). A model without a vocabulary has no
/// head to count.
///
/// [`Head::kept_elements`]: crate::layers::Head::kept_elements
pub(super) fn head_activations(model: &ModelConfig, n: u64) -> HeadActivations {
    let rows = usize::try_from(n).unwrap_or(usize::MAX);
    let Ok(head) = crate::layers::Head::new(model) else {
        return HeadActivations::default();
    };
    HeadActivations {
        kept: Elements::new(head.kept_elements(rows) as u64, 0),
        working: Elements::new(head.chunk_elements(rows) as u64, n),
    }
}

/// [`head_activations`]: what each head keeps, and what one head works in.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct HeadActivations {
    kept: Elements,
    working: Elements,
}

/// What pipeline rank `pp_rank` of `plan` runs: the indices (into
/// [`layer_kinds`]) of the layers of its stages' schedule nodes, in order,
/// and the ends it runs (the embedding, the final norm and heads, MTP
/// depths). Without a pipeline, every layer and both ends.
fn rank_share(plan: &Plan, pp_rank: usize) -> (Vec<usize>, Ends) {
    let decoder = plan.layers.len();
    let mut mtp_offsets = Vec::with_capacity(plan.mtp_layers.len());
    let mut offset = decoder;
    for depth in &plan.mtp_layers {
        mtp_offsets.push(offset);
        offset += depth.len();
    }
    let index = |layer: LayerRef| match layer {
        LayerRef::Decoder(i) => i,
        LayerRef::Mtp { depth, index } => mtp_offsets.get(depth).map_or(offset, |o| o + index),
    };
    let mut layers = Vec::new();
    let mut ends = Ends {
        first: false,
        last: false,
        mtp_depths: 0,
    };
    for (stage, nodes) in plan.stage_nodes().into_iter().enumerate() {
        if plan.stages.get(stage).map_or(0, |s| s.pp_rank) != pp_rank {
            continue;
        }
        for node in &plan.schedule.nodes[nodes] {
            layers.extend(node.pre_layers.iter().map(|&l| index(l)));
            layers.extend(node.terminal.map(|(l, _)| index(l)));
            ends.first |= node.embed;
            ends.last |= node.final_norm || !node.heads.is_empty();
            ends.mtp_depths += usize::from(node.mtp_enter.is_some());
        }
    }
    layers.sort_unstable();
    (layers, ends)
}

/// [`plan_activations`] of one pipeline rank: the layers of its stages
/// (with what `recompute` chooses for the whole model: the runtime numbers
/// layers across stages), the residual stream and its gradient, and the
/// embedding's tokens, the final norm and the heads where it runs them
/// (the first and the last stage's rank). Without a pipeline, the same as
/// [`plan_activations`].
pub fn stage_activations(
    plan: &Plan,
    pp_rank: usize,
    tokens: Tokens,
    sizes: ElementSizes,
    recompute: Recompute,
) -> ActivationEstimate {
    let kinds: Vec<LayerKind> = layer_kinds(plan).collect();
    let chosen = recomputed(&plan.model, &kinds, tokens, recompute);
    let (layers, ends) = rank_share(plan, pp_rank);
    let (kinds, chosen): (Vec<LayerKind>, Vec<bool>) =
        layers.iter().map(|&i| (kinds[i], chosen[i])).unzip();
    activations_of(&plan.model, &kinds, &chosen, ends, tokens, sizes)
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
    state_held(plan, layout, sizes, |_| true)
}

/// The state of one rank of pipeline rank `pp_rank` of `plan` under
/// `layout`: its stages' buckets ([`Plan::holds`]), sharded over the
/// stage's data-parallel ranks; the FSDP engine gives the others no shard
/// and no room. Without a pipeline, [`state`].
pub fn stage_state(
    plan: &Plan,
    pp_rank: usize,
    layout: StateLayout,
    sizes: ElementSizes,
) -> StateEstimate {
    state_held(plan, layout, sizes, |b| plan.holds(pp_rank, b))
}

/// [`state`] of a rank holding the buckets `held` says it does.
fn state_held(
    plan: &Plan,
    layout: StateLayout,
    sizes: ElementSizes,
    held: impl Fn(&Bucket) -> bool,
) -> StateEstimate {
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
    for bucket in plan.buckets.iter().filter(|b| held(b)) {
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
    if plan
        .non_unit_buckets()
        .filter(|b| held(b))
        .all(|b| shard_layout.sole(plan, b))
    {
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
    /// Per rank: what the micro-batches' arena may hold beyond their
    /// activations. The arena grows by a quarter of its size (at least
    /// 1 MiB) when no free region fits, so it can end a quarter plus 1 MiB
    /// above its peak. Zero in a lower bound.
    pub arena_headroom: u64,
    /// Per rank: threads, lanes, the model's layer descriptions, the
    /// schedule and the engine's tables (about 1 MiB plus 2 KiB a layer,
    /// measured on the CPU backend).
    pub bookkeeping: u64,
    /// Per rank: the stage-to-stage receive buffers, one `[tokens, hidden]`
    /// tensor a receive of one exchange (0 without a pipeline).
    pub transfers: u64,
    /// Per rank: state plus the larger of the live micro-batches'
    /// activations and the scratch (they are never needed at once).
    pub per_rank: u64,
    /// Every rank of the process (on the CPU), or one GPU rank.
    pub total: u64,
    /// Pipeline ranks: 1 without pipeline parallelism.
    pub pp: usize,
    /// With pp > 1, every pipeline rank's figures, in rank order: a rank
    /// holds its stages' buckets and the activations of its stages' layers
    /// only. The per-rank fields above are then those of the rank that
    /// needs the most. Empty without a pipeline, and in a lower bound (whose
    /// per-rank fields are then a pipeline rank's share on average).
    pub stages: Vec<StageNeed>,
    /// A lower bound made before planning (state without padding or
    /// buffers), or the full estimate.
    pub lower_bound: bool,
    /// On GPUs: what each GPU holds besides the run's buffers (the CUDA
    /// context, cuBLAS workspaces, NCCL's buffers); `None` on the CPU.
    pub gpu_overhead: Option<u64>,
}

/// What one pipeline rank needs ([`MemoryNeed::stages`]), per rank of it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StageNeed {
    pub pp_rank: usize,
    /// What it runs, for people: `stage 1 (layers 6..9) with the final
    /// norm and the heads`.
    pub runs: String,
    pub state: StateEstimate,
    /// Per micro-batch: its stages' layers, and the heads where it runs
    /// them.
    pub activations: ActivationEstimate,
    /// Micro-batches its program keeps in flight (1F1B: about pp on the
    /// first stage, 1 or 2 on the last).
    pub live_micro_batches: usize,
    pub kernel_scratch: u64,
    pub arena_headroom: u64,
    pub transfers: u64,
    pub per_rank: u64,
}

/// One pipeline rank's program, as the memory check takes it
/// ([`MemoryNeed::of_pipeline`]).
#[derive(Clone, Copy, Debug)]
pub struct RankProgram {
    pub pp_rank: usize,
    /// The state its program keeps (its units resident at once, its
    /// gradient buffers).
    pub layout: StateLayout,
    /// Micro-batches its program keeps in flight.
    pub in_flight: usize,
    /// The most stage-to-stage receives one exchange of its program makes.
    pub receives: usize,
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
            arena_headroom(&activations, live_micro_batches)
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
            transfers: 0,
            lower_bound,
            gpu_overhead: None,
            pp: 1,
            stages: Vec::new(),
        };
        need.settle();
        need
    }

    /// Per rank and in all, from the parts: with pipeline stages, each
    /// pipeline rank's, the per-rank fields taken from the one that needs
    /// the most, and in all every rank's (thread ranks share the process).
    fn settle(&mut self) {
        if self.stages.is_empty() {
            self.per_rank = self
                .state
                .total
                .saturating_add(self.bookkeeping)
                .saturating_add(self.live().max(self.state.scratch));
            self.total = self.per_rank.saturating_mul(self.ranks as u64);
            return;
        }
        let mut sum = 0u64;
        for stage in &mut self.stages {
            stage.per_rank = stage
                .state
                .total
                .saturating_add(self.bookkeeping)
                .saturating_add(stage.live().max(stage.state.scratch));
            sum = sum.saturating_add(stage.per_rank);
        }
        let largest = self.largest_stage().clone();
        self.state = largest.state;
        self.activations = largest.activations;
        self.live_micro_batches = largest.live_micro_batches;
        self.kernel_scratch = largest.kernel_scratch;
        self.arena_headroom = largest.arena_headroom;
        self.transfers = largest.transfers;
        self.per_rank = largest.per_rank;
        // Each pipeline rank has ranks / pp data-parallel ranks.
        self.total = sum.saturating_mul((self.ranks / self.pp.max(1)) as u64);
    }

    /// The pipeline rank that needs the most (the first of equals). Only
    /// with [`MemoryNeed::stages`].
    fn largest_stage(&self) -> &StageNeed {
        let mut largest = &self.stages[0];
        for stage in &self.stages[1..] {
            if stage.per_rank > largest.per_rank {
                largest = stage;
            }
        }
        largest
    }

    /// The need of one GPU, which runs one rank: the rank's memory, with
    /// the GPU kernels' scratch ([`gpu_kernel_scratch`]) where it is more
    /// than the CPU's, plus `overhead` for what the device itself takes.
    pub fn on_one_gpu(mut self, overhead: u64, kernel_scratch: u64) -> Self {
        self.kernel_scratch = self.kernel_scratch.max(kernel_scratch);
        for stage in &mut self.stages {
            stage.kernel_scratch = stage.kernel_scratch.max(kernel_scratch);
        }
        self.settle();
        self.gpu_overhead = Some(overhead);
        self.total = self.per_rank.saturating_add(overhead);
        self
    }

    /// Per rank: the activations of the micro-batches in flight, with the
    /// kernel scratch, the arenas' headroom and the receive buffers.
    pub(super) fn live(&self) -> u64 {
        live(
            &self.activations,
            self.live_micro_batches,
            self.kernel_scratch,
            self.arena_headroom,
            self.transfers,
        )
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
            true,
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

    /// The full estimate for a planned run with pipeline stages: each
    /// pipeline rank of `programs` (every one of the plan's, in rank
    /// order) holds its stages' buckets ([`stage_state`]), sharded over its
    /// `layout.ranks` data-parallel ranks, with its program's units and
    /// gradient buffers, and keeps its program's micro-batches in flight
    /// through its stages' layers ([`stage_activations`]), plus a
    /// `[tokens, hidden]` buffer a receive. The run needs the most any
    /// pipeline rank needs on a GPU of its own; on the CPU, every rank's
    /// share. Without a pipeline (one program), [`MemoryNeed::of_plan`].
    pub fn of_pipeline(
        plan: &Plan,
        programs: &[RankProgram],
        tokens: Tokens,
        sizes: ElementSizes,
        recompute: Recompute,
    ) -> Self {
        let layers = plan.layers.len() + plan.mtp_layers.iter().map(Vec::len).sum::<usize>();
        if let [program] = programs
            && plan.layout.pp <= 1
        {
            return Self::of_plan(
                plan,
                program.layout,
                tokens,
                program.in_flight,
                sizes,
                recompute,
            );
        }
        let kinds: Vec<LayerKind> = layer_kinds(plan).collect();
        let local_experts = plan.model.moe.as_ref().map_or(0, |m| m.num_experts) / plan.layout.ep;
        let rows = (tokens.batch as u64).saturating_mul(tokens.seq as u64);
        let hidden = rows.saturating_mul(plan.model.hidden_size as u64);
        let stages: Vec<StageNeed> = programs
            .iter()
            .map(|program| {
                let r = program.pp_rank;
                let activations = stage_activations(plan, r, tokens, sizes, recompute);
                let (own, ends) = rank_share(plan, r);
                let largest = plan
                    .buckets
                    .iter()
                    .filter(|b| plan.holds(r, b))
                    .flat_map(|b| b.params.iter())
                    .map(|&p| plan.def(&plan.params[p]).numel() as u64)
                    .max()
                    .unwrap_or(0);
                let widened = widened_operands(
                    &plan.model,
                    own.iter().map(|&i| kinds[i]),
                    ends.last,
                    local_experts,
                    largest,
                    tokens,
                )
                .saturating_mul(sizes.widened);
                let live_micro_batches = program.in_flight;
                StageNeed {
                    pp_rank: r,
                    runs: describe_share(plan, r, ends),
                    state: stage_state(plan, r, program.layout, sizes),
                    arena_headroom: arena_headroom(&activations, live_micro_batches),
                    activations,
                    live_micro_batches,
                    kernel_scratch: largest.saturating_mul(sizes.f32).saturating_add(widened),
                    transfers: hidden
                        .saturating_mul(program.receives as u64)
                        .saturating_mul(sizes.compute),
                    per_rank: 0,
                }
            })
            .collect();
        let first = programs.first().map(|p| p.layout);
        let mut need = Self::new(
            first.map_or(1, |l| l.ranks).saturating_mul(programs.len()),
            StateEstimate::default(),
            ActivationEstimate::default(),
            1,
            0,
            layers,
            false,
        );
        need.pp = programs.len();
        need.stages = stages;
        need.settle();
        need
    }

    /// This lower bound (made for one stage holding the whole model) for
    /// `pp` pipeline ranks of `self.ranks` data-parallel ranks each. The
    /// ranks' states and activations (one micro-batch in flight, the least
    /// a stage keeps) add up to at least the whole model's, so a pipeline
    /// rank's share of them on average bounds the rank that needs the
    /// most from below, and `pp` times it every pipeline rank's. Without a
    /// pipeline (`pp` 1), unchanged.
    pub fn over_pipeline(mut self, pp: usize) -> Self {
        if pp <= 1 {
            return self;
        }
        let share = |bytes: u64| bytes / pp as u64;
        let state = &mut self.state;
        state.shards = share(state.shards);
        state.optimizer = share(state.optimizer);
        state.buffers = share(state.buffers);
        state.total = state.shards + state.optimizer + state.buffers;
        let a = &mut self.activations;
        a.layers = share(a.layers);
        a.streams = share(a.streams);
        a.heads = share(a.heads);
        a.working_set = share(a.working_set);
        a.total = a.layers + a.streams + a.heads + a.working_set;
        self.live_micro_batches = 1;
        self.ranks = self.ranks.saturating_mul(pp);
        self.pp = pp;
        self.settle();
        self
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
        if self.stages.is_empty() {
            let per_rank = match self.pp {
                1 => "per rank".to_string(),
                pp => format!("per rank, a pipeline rank's share on average over {pp}"),
            };
            out += &format!("  {per_rank}: ");
            out += &rank_figures(
                self.per_rank,
                &self.state,
                &self.activations,
                self.live_micro_batches,
                self.kernel_scratch,
                self.arena_headroom,
                self.transfers,
            );
        } else {
            // Every pipeline rank's figures, the ones that do not fit (on
            // a GPU of their own) or the one that needs the most (in a
            // process of all of them) named.
            let largest = self.largest_stage().pp_rank;
            for (i, stage) in self.stages.iter().enumerate() {
                let verdict = match self.gpu_overhead {
                    Some(overhead) if stage.per_rank.saturating_add(overhead) > available.bytes => {
                        ", does not fit"
                    }
                    Some(_) => ", fits",
                    None if stage.pp_rank == largest => ", needs the most",
                    None => "",
                };
                if i > 0 {
                    out += "\n";
                }
                out += &format!(
                    "  pipeline rank {}: {}{verdict}\n    per rank: ",
                    stage.pp_rank, stage.runs
                );
                out += &rank_figures(
                    stage.per_rank,
                    &stage.state,
                    &stage.activations,
                    stage.live_micro_batches,
                    stage.kernel_scratch,
                    stage.arena_headroom,
                    stage.transfers,
                );
            }
        }
        let of_pipeline = match self.pp {
            1 => String::new(),
            pp => format!(
                " ({pp} pipeline ranks of {} data-parallel ranks)",
                self.ranks / pp
            ),
        };
        out += &match self.gpu_overhead {
            None => format!(
                "\n  {} thread rank{} in this process{of_pipeline}: {}\n  to fit, try:",
                self.ranks,
                if self.ranks == 1 { "" } else { "s" },
                bytes(self.total)
            ),
            Some(overhead) if !self.stages.is_empty() => format!(
                "\n  each GPU rank, plus {} for its CUDA context, cuBLAS and NCCL: {} on \
                 pipeline rank {}'s\n  to fit, try:",
                bytes(overhead),
                bytes(self.total),
                self.largest_stage().pp_rank
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
            // Under a pipeline, 1F1B keeps its micro-batches in flight
            // whichever schedule runs inside a stage.
            if self.live_micro_batches > 1 && self.pp == 1 {
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
        if self.gpu_overhead.is_some() && self.pp > 1 {
            tips.push(format!(
                "more pipeline stages (now {}): a GPU rank holds the buckets and the activations \
                 of its own stages' layers only",
                self.pp
            ));
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

impl StageNeed {
    /// As [`MemoryNeed::live`], for this pipeline rank.
    fn live(&self) -> u64 {
        live(
            &self.activations,
            self.live_micro_batches,
            self.kernel_scratch,
            self.arena_headroom,
            self.transfers,
        )
    }
}

/// The activations of `in_flight` micro-batches, with the kernel scratch,
/// the arena's headroom and the receive buffers. The micro-batches share
/// one arena and one layer runs at a time on the compute lane, so the
/// largest working set counts once, whatever the micro-batches in flight.
fn live(
    activations: &ActivationEstimate,
    in_flight: usize,
    kernel_scratch: u64,
    arena_headroom: u64,
    transfers: u64,
) -> u64 {
    kept(activations, in_flight)
        .saturating_add(activations.working_set)
        .saturating_add(kernel_scratch)
        .saturating_add(arena_headroom)
        .saturating_add(transfers)
}

/// What `in_flight` micro-batches keep, their working set aside.
fn kept(activations: &ActivationEstimate, in_flight: usize) -> u64 {
    activations
        .total
        .saturating_sub(activations.working_set)
        .saturating_mul(in_flight as u64)
}

/// What the micro-batches' arena may hold beyond their activations
/// ([`MemoryNeed::arena_headroom`]): it grows by a quarter of what it holds.
fn arena_headroom(activations: &ActivationEstimate, in_flight: usize) -> u64 {
    (kept(activations, in_flight).saturating_add(activations.working_set) / 4)
        .saturating_add(1 << 20)
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

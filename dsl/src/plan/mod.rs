//! The planner: pattern + model dimensions + parallel layout -> a validated
//! [`Plan`] of layers, parameters, FSDP units, buckets, shards, per-rank
//! memory and the overlap schedule's slot tables.

mod buckets;
mod layout;
mod memory;
mod schedule;
mod units;

pub use buckets::{
    Bucket, DEFAULT_NON_UNIT_BUCKET_CAP, DType, PARAM_ALIGN, SHARD_ALIGN, padded_numel, round_up,
    shard_numel, shard_range,
};
pub use layout::{ParallelLayout, Stage};
pub use memory::MemoryEstimate;
pub use schedule::{LaneKind, LayerRef, Op, ScheduleNode, SchedulePlan, Slot};
pub use units::{FsdpUnit, Module, ModuleKind, UnitFilter, UnitKind, UnitShape};

use crate::config::ModelConfig;
use crate::diagnostic::{Diagnostic, Diagnostics};
use crate::params::{ParamDef, layer_params};
use crate::pattern::{Item, LayerKind, Pattern};
use serde::Serialize;
use std::borrow::Cow;
use std::collections::HashMap;

/// Choices the planner takes besides the model and the layout.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub layout: ParallelLayout,
    pub unit_filter: UnitFilter,
    /// Size cap of non-unit buckets, in elements.
    pub non_unit_bucket_cap: usize,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            layout: ParallelLayout::default(),
            unit_filter: UnitFilter::default(),
            non_unit_bucket_cap: DEFAULT_NON_UNIT_BUCKET_CAP,
        }
    }
}

/// One physical decoder layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayerInfo {
    /// Physical index (0-based).
    pub index: usize,
    pub kind: LayerKind,
    /// Ordinal of the group the layer is in, if any.
    pub group: Option<usize>,
    /// Position inside its group.
    pub member: Option<usize>,
    /// Logical index: the item it belongs to.
    pub logical: usize,
    /// 1-based and physical, continuing through groups.
    pub layer_number: usize,
    /// Index into [`Plan::stages`].
    pub stage: usize,
}

impl LayerInfo {
    /// State-dict path: `decoder.layers.L` or, in a group,
    /// `decoder.layers.L.layers.j`.
    pub fn path(&self) -> String {
        match self.member {
            Some(j) => format!("decoder.layers.{}.layers.{j}", self.logical),
            None => format!("decoder.layers.{}", self.logical),
        }
    }

    /// Checkpoint prefix: groups flatten, so every member publishes under
    /// `decoder.layers.L.`.
    pub fn checkpoint_prefix(&self) -> String {
        format!("decoder.layers.{}.", self.logical)
    }
}

/// One layer of an MTP depth.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MtpLayerInfo {
    pub depth: usize,
    pub index: usize,
    pub kind: LayerKind,
}

impl MtpLayerInfo {
    pub fn path(&self) -> String {
        format!(
            "mtp.layers.{}.mtp_model_layer.layers.{}",
            self.depth, self.index
        )
    }
}

/// One logical decoder layer: a group or an ungrouped symbol.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LogicalLayer {
    pub index: usize,
    pub is_group: bool,
    /// Physical layers `[start, end)`.
    pub layers: std::ops::Range<usize>,
}

impl LogicalLayer {
    pub fn path(&self) -> String {
        format!("decoder.layers.{}", self.index)
    }
}

/// Who owns a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    Embedding,
    Layer(LayerRef),
    FinalNorm,
    /// An MTP depth's own parameters: enorm, hnorm, eh_proj, final_layernorm.
    MtpBlock(usize),
    OutputLayer,
}

/// One parameter as one rank holds it (experts by local index), placed in
/// its bucket. Its name and shape live in [`Plan::param_defs`], shared by
/// every layer of a kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Param {
    pub owner: Owner,
    /// Index into [`Plan::param_defs`].
    pub def: usize,
    pub bucket: usize,
    /// Element offset inside the bucket (a multiple of 64).
    pub offset: usize,
}

/// A validated plan. Built by [`Plan::new`]; everything in it is derived from
/// the model, the layout and the unit filter.
#[derive(Clone, Debug)]
pub struct Plan {
    pub model: ModelConfig,
    pub pattern: Pattern,
    pub layout: ParallelLayout,
    pub unit_filter: UnitFilter,
    pub layers: Vec<LayerInfo>,
    pub logical_layers: Vec<LogicalLayer>,
    /// Per MTP depth, its layers.
    pub mtp_layers: Vec<Vec<MtpLayerInfo>>,
    pub stages: Vec<Stage>,
    /// One rank's parameters in model (`named_parameters()`) order.
    pub params: Cow<'static, [Param]>,
    /// Names (relative to their owner), shapes and expert-ness, one entry per
    /// distinct definition.
    pub param_defs: Cow<'static, [ParamDef]>,
    /// Parameters of the whole model, every expert counted.
    pub total_params: u64,
    /// Parameters one token passes through: all but the input embedding and
    /// the unchosen experts.
    pub active_params: u64,
    pub units: Cow<'static, [FsdpUnit]>,
    /// Every bucket, indexed by id (forward order).
    pub buckets: Cow<'static, [Bucket]>,
    pub schedule: SchedulePlan,
    /// ZeRO-3 memory per rank under the overlap schedule.
    pub memory: MemoryEstimate,
    /// The same under the plain schedule.
    pub memory_plain: MemoryEstimate,
}

impl Plan {
    /// Plans `model` under `options`, or reports every mistake found: in the
    /// pattern, the dimensions, and the layout.
    pub fn new(model: &ModelConfig, options: &PlanOptions) -> Result<Plan, Diagnostics> {
        let source = model.pattern.as_str();
        let pattern = match Pattern::parse(source) {
            Ok(pattern) => pattern,
            Err(mut diagnostics) => {
                // Dimension errors are independent of the pattern's.
                let empty = Pattern {
                    segments: Vec::new(),
                    mtp_depths: Vec::new(),
                };
                diagnostics.items.extend(model.check(&empty));
                return Err(diagnostics);
            }
        };
        Plan::from_pattern(model, pattern, options)
    }

    /// Plans an already parsed pattern (it replaces `model.pattern`).
    pub fn from_pattern(
        model: &ModelConfig,
        pattern: Pattern,
        options: &PlanOptions,
    ) -> Result<Plan, Diagnostics> {
        let mut model = model.clone();
        let source = std::mem::take(&mut model.pattern);
        let fail = |items: Vec<Diagnostic>| Diagnostics::new(source.clone(), "pattern", items);
        let mut problems = model.check(&pattern);
        problems.extend(options.layout.check(&model, &pattern));
        if !problems.is_empty() {
            return Err(fail(problems));
        }
        let stages = layout::stages(&pattern, &options.layout).map_err(fail)?;
        model.pattern = source;
        Ok(Builder::new(model, pattern, options, stages).build())
    }

    /// The definition (relative name, shape) of a parameter.
    pub fn def(&self, param: &Param) -> &ParamDef {
        &self.param_defs[param.def]
    }

    /// Full state-dict name of a parameter (rank-local expert index).
    pub fn param_name(&self, param: &Param) -> String {
        format!(
            "{}{}",
            self.owner_prefix(param.owner, false),
            self.def(param).name
        )
    }

    /// Ranks bucket `bucket` is sharded over: the data-parallel group for
    /// dense buckets, the expert-data-parallel group for expert buckets.
    pub fn bucket_world(&self, bucket: &Bucket) -> usize {
        if bucket.expert {
            self.layout.expert_dp()
        } else {
            self.layout.dp.max(1)
        }
    }

    /// Checkpoint key of a parameter: groups flattened, `final_layernorm` for
    /// patterns with brackets, and an expert's global index for EP rank
    /// `ep_rank` (`r * E/ep + j`).
    pub fn checkpoint_key(&self, param: &Param, ep_rank: usize) -> String {
        let def = self.def(param);
        let name = match def.local_expert {
            Some(j) => {
                let local = self.local_experts();
                let global = ep_rank * local + j;
                let stem = def.name.trim_end_matches(|c: char| c.is_ascii_digit());
                format!("{stem}{global}")
            }
            None => def.name.to_string(),
        };
        format!("{}{name}", self.owner_prefix(param.owner, true))
    }

    fn owner_prefix(&self, owner: Owner, checkpoint: bool) -> String {
        match owner {
            Owner::Embedding => "embedding.word_embeddings.".to_string(),
            Owner::Layer(LayerRef::Decoder(i)) if checkpoint => self.layers[i].checkpoint_prefix(),
            Owner::Layer(LayerRef::Decoder(i)) => format!("{}.", self.layers[i].path()),
            Owner::Layer(LayerRef::Mtp { depth, index }) => {
                format!("{}.", self.mtp_layers[depth][index].path())
            }
            Owner::FinalNorm if checkpoint && self.pattern.has_groups() => {
                "decoder.final_layernorm.".to_string()
            }
            Owner::FinalNorm => "decoder.final_norm.".to_string(),
            Owner::MtpBlock(d) => format!("mtp.layers.{d}."),
            Owner::OutputLayer => "output_layer.".to_string(),
        }
    }

    /// Experts each EP rank holds.
    pub fn local_experts(&self) -> usize {
        self.model
            .moe
            .as_ref()
            .map_or(0, |m| m.num_experts / self.layout.ep.max(1))
    }

    pub fn physical_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn mtp_depths(&self) -> usize {
        self.mtp_layers.len()
    }

    /// Buckets that belong to no unit, in id order.
    pub fn non_unit_buckets(&self) -> impl Iterator<Item = &Bucket> + '_ {
        self.buckets.iter().filter(|b| b.unit.is_none())
    }

    /// The layer a [`LayerRef`] names.
    pub fn layer_kind(&self, layer: LayerRef) -> LayerKind {
        match layer {
            LayerRef::Decoder(i) => self.layers[i].kind,
            LayerRef::Mtp { depth, index } => self.mtp_layers[depth][index].kind,
        }
    }

    /// Parameters owned by `owner`, in order (indices into `params`).
    pub fn params_of(&self, owner: Owner) -> impl Iterator<Item = usize> + '_ {
        self.params
            .iter()
            .enumerate()
            .filter(move |(_, p)| p.owner == owner)
            .map(|(i, _)| i)
    }
}

/// Assembles a plan from checked inputs; cannot fail.
struct Builder<'o> {
    model: ModelConfig,
    pattern: Pattern,
    options: &'o PlanOptions,
    stages: Vec<Stage>,
    /// The definition table: every layer kind's parameters (built once and
    /// shared by all layers of the kind), then the model-level ones.
    defs: Vec<ParamDef>,
    kind_defs: HashMap<LayerKind, std::ops::Range<usize>>,
}

/// Model-level definitions, appended after the layer kinds' in the table.
#[derive(Clone, Copy)]
enum ModelDef {
    Embedding,
    FinalNorm,
    MtpEnorm,
    MtpHnorm,
    MtpEhProj,
    MtpFinalNorm,
    Output,
}

impl<'o> Builder<'o> {
    fn new(
        model: ModelConfig,
        pattern: Pattern,
        options: &'o PlanOptions,
        stages: Vec<Stage>,
    ) -> Self {
        let local = model
            .moe
            .as_ref()
            .map_or(0, |m| m.num_experts / options.layout.ep.max(1));
        let mut defs = Vec::new();
        let mut kind_defs = HashMap::new();
        for kind in pattern.kinds() {
            let start = defs.len();
            defs.extend(layer_params(kind, &model, local));
            kind_defs.insert(kind, start..defs.len());
        }
        let (h, vocab) = (model.hidden_size, model.padded_vocab_size());
        defs.extend([
            ParamDef::new("weight", &[vocab, h]),
            ParamDef::new("weight", &[h]),
            ParamDef::new("enorm.weight", &[h]),
            ParamDef::new("hnorm.weight", &[h]),
            ParamDef::new("eh_proj.weight", &[h, 2 * h]),
            ParamDef::new("final_layernorm.weight", &[h]),
            ParamDef::new("weight", &[vocab, h]),
        ]);
        Builder {
            model,
            pattern,
            options,
            stages,
            defs,
            kind_defs,
        }
    }

    fn model_def(&self, def: ModelDef) -> usize {
        self.defs.len() - 7 + def as usize
    }

    fn build(self) -> Plan {
        let (layers, logical_layers) = self.layers();
        let mtp_layers: Vec<Vec<MtpLayerInfo>> = self
            .pattern
            .mtp_depths
            .iter()
            .enumerate()
            .map(|(depth, d)| {
                d.layers
                    .iter()
                    .enumerate()
                    .map(|(index, l)| MtpLayerInfo {
                        depth,
                        index,
                        kind: l.kind,
                    })
                    .collect()
            })
            .collect();
        let (mut params, param_unit, mut units) =
            self.params_and_units(&layers, &logical_layers, &mtp_layers);
        let buckets = self.buckets(&mut params, &param_unit);
        let mut unit_buckets = vec![Vec::new(); units.len()];
        for bucket in &buckets {
            if let Some(u) = bucket.unit {
                unit_buckets[u].push(bucket.id);
            }
        }
        for (unit, ids) in units.iter_mut().zip(unit_buckets) {
            unit.buckets = Cow::Owned(ids);
        }
        let schedule = self.schedule(&logical_layers, &layers, &mtp_layers, &units);
        let (total_params, active_params) = self.totals();
        let memory = MemoryEstimate::of(&units, &buckets, &self.options.layout, 4);
        let memory_plain = MemoryEstimate::of(&units, &buckets, &self.options.layout, 2);
        Plan {
            model: self.model,
            pattern: self.pattern,
            layout: self.options.layout.clone(),
            unit_filter: self.options.unit_filter.clone(),
            layers,
            logical_layers,
            mtp_layers,
            stages: self.stages,
            params: Cow::Owned(params),
            param_defs: Cow::Owned(self.defs),
            total_params,
            active_params,
            units: Cow::Owned(units),
            buckets: Cow::Owned(buckets),
            schedule,
            memory,
            memory_plain,
        }
    }

    fn layers(&self) -> (Vec<LayerInfo>, Vec<LogicalLayer>) {
        let mut layers = Vec::with_capacity(self.pattern.physical_count());
        let mut logical = Vec::with_capacity(self.pattern.logical_count());
        let mut groups = 0;
        let mut stage = 0;
        for (l, item) in self.pattern.items().enumerate() {
            let start = layers.len();
            let group = item.is_group().then(|| {
                groups += 1;
                groups - 1
            });
            for (j, layer) in item.layers().iter().enumerate() {
                let index = layers.len();
                while stage + 1 < self.stages.len() && !self.stages[stage].layers.contains(&index) {
                    stage += 1;
                }
                layers.push(LayerInfo {
                    index,
                    kind: layer.kind,
                    group,
                    member: group.map(|_| j),
                    logical: l,
                    layer_number: index + 1,
                    stage,
                });
            }
            logical.push(LogicalLayer {
                index: l,
                is_group: matches!(item, Item::Group(_)),
                layers: start..layers.len(),
            });
        }
        (layers, logical)
    }

    /// The parameter inventory in model order, each parameter's unit (by
    /// walking the module tree with the filter), and the units.
    fn params_and_units(
        &self,
        layers: &[LayerInfo],
        logical: &[LogicalLayer],
        mtp: &[Vec<MtpLayerInfo>],
    ) -> (Vec<Param>, Vec<Option<usize>>, Vec<FsdpUnit>) {
        let mut walk = UnitWalk {
            filter: &self.options.unit_filter,
            params: Vec::new(),
            param_unit: Vec::new(),
            units: Vec::new(),
        };

        let unit = walk.leaf("embedding", ModuleKind::Embedding);
        walk.push(Owner::Embedding, self.model_def(ModelDef::Embedding), unit);

        let mut kinds = Vec::new();
        for item in logical {
            kinds.clear();
            kinds.extend(item.layers.clone().map(|i| layers[i].kind));
            let (kind, shape) = if item.is_group {
                (ModuleKind::Group, UnitShape::Group)
            } else {
                (ModuleKind::Layer, UnitShape::Layer)
            };
            let unit = walk.candidate(
                item.path(),
                kind,
                &kinds,
                shape,
                item.layers.clone().collect(),
                None,
            );
            for i in item.layers.clone() {
                for def in self.kind_defs[&layers[i].kind].clone() {
                    walk.push(Owner::Layer(LayerRef::Decoder(i)), def, unit);
                }
            }
        }

        let unit = walk.leaf("decoder.final_norm", ModuleKind::FinalNorm);
        walk.push(Owner::FinalNorm, self.model_def(ModelDef::FinalNorm), unit);

        for (d, depth) in mtp.iter().enumerate() {
            kinds.clear();
            kinds.extend(depth.iter().map(|l| l.kind));
            let depth_unit = walk.candidate(
                format!("mtp.layers.{d}"),
                ModuleKind::MtpDepth,
                &kinds,
                UnitShape::Mtp,
                Vec::new(),
                Some(d),
            );
            for def in [ModelDef::MtpEnorm, ModelDef::MtpHnorm, ModelDef::MtpEhProj] {
                walk.push(Owner::MtpBlock(d), self.model_def(def), depth_unit);
            }
            for layer in depth {
                // Outermost match wins: a depth's layers are asked only when
                // the depth itself is not a unit.
                let unit = depth_unit.or_else(|| {
                    walk.candidate(
                        layer.path(),
                        ModuleKind::Layer,
                        std::slice::from_ref(&layer.kind),
                        UnitShape::Layer,
                        Vec::new(),
                        Some(d),
                    )
                });
                let owner = Owner::Layer(LayerRef::Mtp {
                    depth: d,
                    index: layer.index,
                });
                for def in self.kind_defs[&layer.kind].clone() {
                    walk.push(owner, def, unit);
                }
            }
            walk.push(
                Owner::MtpBlock(d),
                self.model_def(ModelDef::MtpFinalNorm),
                depth_unit,
            );
        }

        if !self.model.tie_embeddings {
            let unit = walk.leaf("output_layer", ModuleKind::OutputLayer);
            walk.push(Owner::OutputLayer, self.model_def(ModelDef::Output), unit);
        }
        (walk.params, walk.param_unit, walk.units)
    }

    /// Groups parameters into buckets by (unit, dtype, dense/expert) in
    /// parameter order, splits non-unit buckets at the cap, and lays out
    /// offsets (64-aligned) in each.
    fn buckets(&self, params: &mut [Param], param_unit: &[Option<usize>]) -> Vec<Bucket> {
        let cap = self.options.non_unit_bucket_cap.max(1);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        // (unit, expert) -> open bucket. A unit's parameters are contiguous,
        // so its buckets are created together, in forward order.
        let mut open: HashMap<(Option<usize>, bool), usize> = HashMap::new();
        for (i, param) in params.iter_mut().enumerate() {
            let def = &self.defs[param.def];
            let unit = param_unit[i];
            let numel = def.numel();
            let key = (unit, def.expert);
            let reuse = open.get(&key).copied().filter(|&b| {
                // Non-unit buckets close at the size cap.
                unit.is_some() || buckets[b].numel == 0 || buckets[b].numel + numel <= cap
            });
            let b = match reuse {
                Some(b) => b,
                None => {
                    let id = buckets.len();
                    buckets.push(Bucket {
                        id,
                        unit,
                        dtype: DType::Bf16,
                        expert: def.expert,
                        params: Cow::Borrowed(&[]),
                        numel: 0,
                        end: 0,
                        megatron_row_lcm: Some(1),
                    });
                    members.push(Vec::new());
                    open.insert(key, id);
                    id
                }
            };
            let bucket = &mut buckets[b];
            let offset = round_up(bucket.end, PARAM_ALIGN);
            param.bucket = b;
            param.offset = offset;
            members[b].push(i);
            bucket.numel += numel;
            bucket.end = offset + numel;
            bucket.megatron_row_lcm = bucket
                .megatron_row_lcm
                .and_then(|l| buckets::lcm(l, def.row_numel() as u64));
        }
        for (bucket, ids) in buckets.iter_mut().zip(members) {
            bucket.params = Cow::Owned(ids);
        }
        buckets
    }

    fn schedule(
        &self,
        logical: &[LogicalLayer],
        layers: &[LayerInfo],
        mtp: &[Vec<MtpLayerInfo>],
        units: &[FsdpUnit],
    ) -> SchedulePlan {
        let unit_of_path: HashMap<&str, usize> =
            units.iter().map(|u| (u.name.as_ref(), u.index)).collect();
        let mut nodes =
            Vec::with_capacity(logical.len() + mtp.iter().map(Vec::len).sum::<usize>() + 1);
        for item in logical {
            let path = item.path();
            let unit = unit_of_path.get(path.as_str()).copied();
            let members = item
                .layers
                .clone()
                .map(|i| (LayerRef::Decoder(i), layers[i].kind))
                .collect();
            nodes.push(node(
                nodes.len(),
                path,
                Some(item.index),
                None,
                unit,
                members,
            ));
        }
        if nodes.is_empty() {
            // No decoder layers: one empty node still carries the embedding,
            // the final norm and the head, so every model has the same chain.
            nodes.push(node(0, "decoder".to_string(), None, None, None, Vec::new()));
        }
        nodes[0].embed = true;
        let last_decoder = nodes.len() - 1;
        nodes[last_decoder].final_norm = true;
        nodes[last_decoder].heads.to_mut().push(None);
        for (d, depth) in mtp.iter().enumerate() {
            let depth_unit = unit_of_path
                .get(format!("mtp.layers.{d}").as_str())
                .copied();
            let first = nodes.len();
            for layer in depth {
                let path = layer.path();
                let unit = depth_unit.or_else(|| unit_of_path.get(path.as_str()).copied());
                let member = vec![(
                    LayerRef::Mtp {
                        depth: d,
                        index: layer.index,
                    },
                    layer.kind,
                )];
                nodes.push(node(nodes.len(), path, None, Some(d), unit, member));
            }
            nodes[first].mtp_enter = Some(d);
            let last = nodes.len() - 1;
            nodes[last].heads.to_mut().push(Some(d));
        }
        SchedulePlan {
            nodes: Cow::Owned(nodes),
        }
    }

    fn totals(&self) -> (u64, u64) {
        let h = self.model.hidden_size as u64;
        let vocab = self.model.padded_vocab_size() as u64;
        let embedding = vocab * h;
        let output = if self.model.tie_embeddings {
            0
        } else {
            vocab * h
        };
        let moe = self.model.moe.as_ref();
        let experts = moe.map_or(0, |m| m.num_experts);
        let per_expert = moe.map_or(0, |m| {
            let fc1 = m.activation.fc1_factor() * m.ffn_hidden_size * self.model.hidden_size;
            (fc1 + m.ffn_hidden_size * self.model.hidden_size) as u64
        });
        let unchosen =
            moe.map_or(0, |m| (m.num_experts - m.top_k.min(m.num_experts)) as u64) * per_expert;
        let layer_total = |kind: LayerKind| -> u64 {
            layer_params(kind, &self.model, experts)
                .iter()
                .map(|p| p.numel() as u64)
                .sum()
        };
        let mut counts: HashMap<LayerKind, u64> = HashMap::new();
        for layer in self
            .pattern
            .layers()
            .chain(self.pattern.mtp_depths.iter().flat_map(|d| &d.layers))
        {
            *counts.entry(layer.kind).or_default() += 1;
        }
        let mtp_blocks = self.pattern.mtp_depths.len() as u64 * (3 * h + 2 * h * h);
        let mut total = embedding + h + mtp_blocks + output;
        let mut inactive = embedding;
        for (&kind, &n) in &counts {
            total += n * layer_total(kind);
            if kind == LayerKind::Moe {
                inactive += n * unchosen;
            }
        }
        (total, total - inactive)
    }
}

/// The top-down walk of the module tree that asks the unit filter about each
/// candidate and records which unit every parameter lands in.
struct UnitWalk<'f> {
    filter: &'f UnitFilter,
    params: Vec<Param>,
    param_unit: Vec<Option<usize>>,
    units: Vec<FsdpUnit>,
}

impl UnitWalk<'_> {
    fn push(&mut self, owner: Owner, def: usize, unit: Option<usize>) {
        self.params.push(Param {
            owner,
            def,
            bucket: 0,
            offset: 0,
        });
        self.param_unit.push(unit);
    }

    /// Asks the filter about a module; makes it a unit if it matches.
    fn candidate(
        &mut self,
        path: String,
        kind: ModuleKind,
        layer_kinds: &[LayerKind],
        shape: UnitShape,
        layers: Vec<usize>,
        mtp_depth: Option<usize>,
    ) -> Option<usize> {
        let module = Module {
            path: &path,
            kind,
            layer_kinds,
        };
        if !self.filter.is_unit(&module) {
            return None;
        }
        let index = self.units.len();
        self.units.push(FsdpUnit {
            index,
            name: Cow::Owned(path),
            shape,
            layers: Cow::Owned(layers),
            mtp_depth,
            buckets: Cow::Borrowed(&[]),
        });
        Some(index)
    }

    /// A leaf module with no layers inside (embedding, final norm, output).
    fn leaf(&mut self, path: &str, kind: ModuleKind) -> Option<usize> {
        self.candidate(
            path.to_string(),
            kind,
            &[],
            UnitShape::Layer,
            Vec::new(),
            None,
        )
    }
}

fn node(
    index: usize,
    name: String,
    logical: Option<usize>,
    mtp_depth: Option<usize>,
    unit: Option<usize>,
    members: Vec<(LayerRef, LayerKind)>,
) -> ScheduleNode {
    let terminal = members
        .last()
        .copied()
        .filter(|(_, kind)| kind.is_terminal());
    let pre = &members[..members.len() - usize::from(terminal.is_some())];
    ScheduleNode {
        index,
        name: Cow::Owned(name),
        logical,
        mtp_depth,
        unit,
        pre_layers: pre.iter().map(|(layer, _)| *layer).collect(),
        terminal,
        embed: false,
        mtp_enter: None,
        final_norm: false,
        heads: Cow::Borrowed(&[]),
    }
}

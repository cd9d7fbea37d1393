//! The planner: pattern + model dimensions + parallel layout -> a validated
//! [`Plan`] of layers, parameters, FSDP units, buckets, shards, per-rank
//! memory and the overlap schedule's slot tables.

mod buckets;
mod layout;
mod memory;
mod pipeline;
mod schedule;
mod units;

pub use buckets::{
    Bucket, DEFAULT_NON_UNIT_BUCKET_CAP, DType, PARAM_ALIGN, SHARD_ALIGN, padded_numel, round_up,
    shard_numel, shard_range,
};
pub use layout::{ParallelLayout, Stage};
pub use memory::{MemoryEstimate, StageMemory};
pub use schedule::{LaneKind, LayerRef, Op, ScheduleNode, SchedulePlan, Slot};
pub use units::{FsdpUnit, Module, ModuleKind, UnitFilter, UnitKind, UnitShape};

use crate::config::ModelConfig;
use crate::diagnostic::{Code, Diagnostic, Diagnostics};
use crate::params::{ParamDef, layer_params};
use crate::pattern::{Item, LayerKind, Pattern};
use crate::span::Span;
use serde::Serialize;
use std::borrow::Cow;

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
        decoder_layer_path(self.logical, self.member, "")
    }

    /// Checkpoint prefix: groups flatten, so every member publishes under
    /// `decoder.layers.L.`.
    pub fn checkpoint_prefix(&self) -> String {
        decoder_layer_path(self.logical, None, ".")
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
        decoder_layer_path(self.index, None, "")
    }
}

/// `decoder.layers.{index}`, then `.layers.{member}` for a group member, then
/// `suffix`. Written by hand rather than with `format!`: a 100,000-layer plan
/// builds several of these per layer.
fn decoder_layer_path(index: usize, member: Option<usize>, suffix: &str) -> String {
    // Sized exactly: a plan holds two of these per logical layer.
    let digits = |n: usize| n.checked_ilog10().map_or(1, |d| d as usize + 1);
    let len = "decoder.layers.".len()
        + digits(index)
        + member.map_or(0, |j| ".layers.".len() + digits(j))
        + suffix.len();
    let mut path = String::with_capacity(len);
    path.push_str("decoder.layers.");
    push_number(&mut path, index);
    if let Some(j) = member {
        path.push_str(".layers.");
        push_number(&mut path, j);
    }
    path.push_str(suffix);
    path
}

/// Appends `n` in decimal.
fn push_number(out: &mut String, n: usize) {
    if n >= 10 {
        push_number(out, n / 10);
    }
    out.push(char::from(b'0' + (n % 10) as u8));
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
    /// ZeRO-3 memory per rank under the overlap schedule, every bucket
    /// counted: under pipeline parallelism a rank holds its stages' only
    /// ([`Plan::stage_memory`]).
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
                // Dimension and layout errors are independent of the pattern's.
                let empty = Pattern {
                    segments: Vec::new(),
                    mtp_depths: Vec::new(),
                };
                diagnostics.items.extend(model.check(&empty));
                diagnostics
                    .items
                    .extend(options.layout.check(model, &empty));
                return Err(diagnostics);
            }
        };
        Plan::from_pattern(model, pattern, options)
    }

    /// The plan of a model planned at build time, assembled from its `const`
    /// tables instead of planned again: the pattern is parsed and checked
    /// against the layout as [`Plan::new`] does (the layer lists and stages
    /// are read off it, which checking needs anyway), and the parameters,
    /// units, buckets and schedule are the tables themselves, borrowed.
    /// `tables` must come from planning `model` with `options` at build
    /// time, as `model!` and `hybridgen::build` emit them; what
    /// [`Plan::new`] would make is equal (`tests/macro_layout.rs` checks it).
    pub fn from_tables(
        model: &ModelConfig,
        options: &PlanOptions,
        tables: &PlanTables,
    ) -> Result<Plan, Diagnostics> {
        let pattern = Pattern::parse(&model.pattern)?;
        let checked = Plan::checked(model, pattern, options)?;
        Ok(checked.build_from(tables))
    }

    /// Plans an already parsed pattern instead of parsing `model.pattern`.
    /// Diagnostics point into `model.pattern`, so it should be the text
    /// `pattern` was parsed from; the plan keeps both.
    pub fn from_pattern(
        model: &ModelConfig,
        pattern: Pattern,
        options: &PlanOptions,
    ) -> Result<Plan, Diagnostics> {
        Ok(Plan::checked(model, pattern, options)?.build())
    }

    /// Checks `pattern` with `model`'s dimensions and `options`' layout: a
    /// builder that cannot fail, or every mistake found.
    fn checked<'o>(
        model: &ModelConfig,
        pattern: Pattern,
        options: &'o PlanOptions,
    ) -> Result<Builder<'o>, Diagnostics> {
        let mut model = model.clone();
        let source = std::mem::take(&mut model.pattern);
        let fail = |items: Vec<Diagnostic>| Diagnostics::new(source.clone(), "pattern", items);
        let mut problems = model.check(&pattern);
        if pattern.layers().next().is_none() && pattern.mtp_depths.is_empty() {
            problems.push(
                Diagnostic::new(Code::H028, "the pattern has no layers")
                    .at(Span::new(0, source.len()))
                    .label("a model needs at least one layer")
                    .help("write the model's layers, e.g. `M[*E]M[*E]`; an empty pattern is often an unset variable"),
            );
        }
        problems.extend(options.layout.check(&model, &pattern));
        // Where the stages fall depends only on the pattern and pp, so its
        // errors are reported with the others (unless pp is 0, reported above).
        let stages = match layout::stages(&pattern, &options.layout) {
            Ok(stages) => stages,
            Err(cuts) => {
                if options.layout.pp > 0 {
                    problems.extend(cuts);
                }
                Vec::new()
            }
        };
        if !problems.is_empty() {
            return Err(fail(problems));
        }
        model.pattern = source;
        Ok(Builder::new(model, pattern, options, stages))
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
            .map_or(0, |m| m.num_experts / self.layout.ep)
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

/// A plan's tables as `const` data: what `model!` and `hybridgen::build`
/// emit, and [`Plan::from_tables`] assembles a plan from.
#[derive(Clone, Debug)]
pub struct PlanTables {
    pub params: &'static [Param],
    pub param_defs: &'static [ParamDef],
    pub units: &'static [FsdpUnit],
    pub buckets: &'static [Bucket],
    pub schedule: SchedulePlan,
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
    /// Per layer kind (indexed by `LayerKind as usize`), its definitions.
    kind_defs: [std::ops::Range<usize>; LayerKind::ALL.len()],
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
            .map_or(0, |m| m.num_experts / options.layout.ep);
        let mut defs = Vec::new();
        let mut kind_defs: [std::ops::Range<usize>; LayerKind::ALL.len()] = Default::default();
        for kind in pattern.kinds() {
            let start = defs.len();
            defs.extend(layer_params(kind, &model, local));
            kind_defs[kind as usize] = start..defs.len();
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

    /// The plan with the tables planned at build time instead of planned
    /// here.
    fn build_from(self, tables: &PlanTables) -> Plan {
        let (layers, logical_layers) = self.layers();
        let mtp_layers = self.mtp_layers();
        let (total_params, active_params) = self.totals();
        let [memory, memory_plain] =
            MemoryEstimate::of(tables.units, tables.buckets, &self.options.layout, [4, 2]);
        Plan {
            model: self.model,
            pattern: self.pattern,
            layout: self.options.layout.clone(),
            unit_filter: self.options.unit_filter.clone(),
            layers,
            logical_layers,
            mtp_layers,
            stages: self.stages,
            params: Cow::Borrowed(tables.params),
            param_defs: Cow::Borrowed(tables.param_defs),
            total_params,
            active_params,
            units: Cow::Borrowed(tables.units),
            buckets: Cow::Borrowed(tables.buckets),
            schedule: tables.schedule.clone(),
            memory,
            memory_plain,
        }
    }

    fn mtp_layers(&self) -> Vec<Vec<MtpLayerInfo>> {
        self.pattern
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
            .collect()
    }

    fn build(self) -> Plan {
        let (layers, logical_layers) = self.layers();
        let mtp_layers = self.mtp_layers();
        let UnitWalk {
            params,
            mut units,
            item_unit,
            mtp_unit,
            buckets,
            ..
        } = self.params_and_units(&layers, &logical_layers, &mtp_layers);
        let (buckets, unit_buckets) = buckets.finish();
        for (unit, ids) in units.iter_mut().zip(unit_buckets) {
            unit.buckets = Cow::Owned(ids);
        }
        let schedule = self.schedule(&logical_layers, &layers, &mtp_layers, &item_unit, &mtp_unit);
        let (total_params, active_params) = self.totals();
        let [memory, memory_plain] =
            MemoryEstimate::of(&units, &buckets, &self.options.layout, [4, 2]);
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
    ) -> UnitWalk<'_> {
        let defs_of = |kind: LayerKind| self.kind_defs[kind as usize].len();
        let count = 3
            + layers.iter().map(|l| defs_of(l.kind)).sum::<usize>()
            + mtp
                .iter()
                .map(|depth| 4 + depth.iter().map(|l| defs_of(l.kind)).sum::<usize>())
                .sum::<usize>();
        // Dense and expert definitions per layer kind: how many parameters a
        // unit will put in each of its buckets, to size them up front.
        let mut per_kind = [[0usize; 2]; LayerKind::ALL.len()];
        for kind in LayerKind::ALL {
            for def in &self.defs[self.kind_defs[kind as usize].clone()] {
                per_kind[kind as usize][usize::from(def.expert)] += 1;
            }
        }
        let sizes = |kinds: &mut dyn Iterator<Item = LayerKind>, extra: usize| {
            kinds.fold([extra, 0], |[dense, expert], kind| {
                let [d, e] = per_kind[kind as usize];
                [dense + d, expert + e]
            })
        };
        // Modules the filter is asked about, at most: the embedding, final
        // norm and output layer, each logical layer, each MTP depth and layer.
        let candidates = 3 + logical.len() + mtp.iter().map(|d| 1 + d.len()).sum::<usize>();
        let mut walk = UnitWalk {
            filter: &self.options.unit_filter,
            params: Vec::with_capacity(count),
            units: Vec::with_capacity(candidates),
            item_unit: Vec::with_capacity(logical.len()),
            mtp_unit: Vec::with_capacity(mtp.len()),
            buckets: BucketLayout::new(&self.defs, self.options.non_unit_bucket_cap, candidates),
        };

        // Non-unit buckets close where the pipeline rank changes
        // (`pipeline`): every parameter is placed under its stage's rank,
        // the embedding under a key of its own when the last stage's rank
        // shares it. One rank: one key, and the buckets of a plan without
        // pipeline stages.
        let stage_of = |item: &LogicalLayer| {
            let stage = layers[item.layers.start].stage;
            self.stages.get(stage).map_or(0, |s| s.pp_rank)
        };
        let first_stage = logical.first().map_or(0, stage_of);
        let last_stage = logical.last().map_or(0, stage_of);
        let shared = first_stage != last_stage && (self.model.tie_embeddings || !mtp.is_empty());
        walk.buckets.key = if shared { usize::MAX } else { first_stage };
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
            let unit = walk.candidate(item.path(), kind, &kinds, shape, item.layers.clone(), None);
            walk.item_unit.push(unit);
            walk.buckets.key = stage_of(item);
            walk.buckets.expect = sizes(&mut kinds.iter().copied(), 0);
            for i in item.layers.clone() {
                for def in self.kind_defs[layers[i].kind as usize].clone() {
                    walk.push(Owner::Layer(LayerRef::Decoder(i)), def, unit);
                }
            }
        }

        walk.buckets.key = last_stage;
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
                0..0,
                Some(d),
            );
            walk.buckets.expect = sizes(&mut kinds.iter().copied(), 4);
            for def in [ModelDef::MtpEnorm, ModelDef::MtpHnorm, ModelDef::MtpEhProj] {
                walk.push(Owner::MtpBlock(d), self.model_def(def), depth_unit);
            }
            let mut layer_units = Vec::with_capacity(depth.len());
            for layer in depth {
                // Outermost match wins: a depth's layers are asked only when
                // the depth itself is not a unit.
                let unit = depth_unit.or_else(|| {
                    walk.candidate(
                        layer.path(),
                        ModuleKind::Layer,
                        std::slice::from_ref(&layer.kind),
                        UnitShape::Layer,
                        0..0,
                        Some(d),
                    )
                });
                layer_units.push(unit);
                if depth_unit.is_none() {
                    walk.buckets.expect = sizes(&mut std::iter::once(layer.kind), 0);
                }
                let owner = Owner::Layer(LayerRef::Mtp {
                    depth: d,
                    index: layer.index,
                });
                for def in self.kind_defs[layer.kind as usize].clone() {
                    walk.push(owner, def, unit);
                }
            }
            walk.mtp_unit.push(layer_units);
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
        walk
    }

    fn schedule(
        &self,
        logical: &[LogicalLayer],
        layers: &[LayerInfo],
        mtp: &[Vec<MtpLayerInfo>],
        item_unit: &[Option<usize>],
        mtp_unit: &[Vec<Option<usize>>],
    ) -> SchedulePlan {
        let mut nodes =
            Vec::with_capacity(logical.len() + mtp.iter().map(Vec::len).sum::<usize>() + 1);
        for (item, &unit) in logical.iter().zip(item_unit) {
            let last_kind = item.layers.clone().last().map(|i| layers[i].kind);
            // Sized to leave out a terminal, so a lone `-` or `E` allocates nothing.
            let pre =
                item.layers.len() - usize::from(last_kind.is_some_and(LayerKind::is_terminal));
            let mut members = Vec::with_capacity(pre);
            members.extend(item.layers.clone().take(pre).map(LayerRef::Decoder));
            let terminal = item
                .layers
                .clone()
                .nth(pre)
                .map(|i| (LayerRef::Decoder(i), layers[i].kind));
            nodes.push(node(
                nodes.len(),
                item.path(),
                Some(item.index),
                None,
                unit,
                members,
                terminal,
            ));
        }
        if nodes.is_empty() {
            // No decoder layers: one empty node still carries the embedding,
            // the final norm and the head, so every model has the same chain.
            nodes.push(node(
                0,
                "decoder".to_string(),
                None,
                None,
                None,
                Vec::new(),
                None,
            ));
        }
        nodes[0].embed = true;
        let last_decoder = nodes.len() - 1;
        nodes[last_decoder].final_norm = true;
        nodes[last_decoder].heads.to_mut().push(None);
        for ((d, depth), units) in mtp.iter().enumerate().zip(mtp_unit) {
            let first = nodes.len();
            for (layer, &unit) in depth.iter().zip(units) {
                let this = LayerRef::Mtp {
                    depth: d,
                    index: layer.index,
                };
                let (pre, terminal) = if layer.kind.is_terminal() {
                    (Vec::new(), Some((this, layer.kind)))
                } else {
                    (vec![this], None)
                };
                nodes.push(node(
                    nodes.len(),
                    layer.path(),
                    None,
                    Some(d),
                    unit,
                    pre,
                    terminal,
                ));
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
        let mut counts = [0u64; LayerKind::ALL.len()];
        for layer in self
            .pattern
            .layers()
            .chain(self.pattern.mtp_depths.iter().flat_map(|d| &d.layers))
        {
            counts[layer.kind as usize] += 1;
        }
        let mtp_blocks = self.pattern.mtp_depths.len() as u64 * (3 * h + 2 * h * h);
        let mut total = embedding + h + mtp_blocks + output;
        let mut inactive = embedding;
        for kind in LayerKind::ALL {
            let n = counts[kind as usize];
            if n == 0 {
                continue;
            }
            total += n * layer_total(kind);
            if kind == LayerKind::Moe {
                inactive += n * unchosen;
            }
        }
        (total, total - inactive)
    }
}

/// The top-down walk of the module tree that asks the unit filter about each
/// candidate and places every parameter in a bucket of its unit as it goes.
struct UnitWalk<'f> {
    filter: &'f UnitFilter,
    params: Vec<Param>,
    units: Vec<FsdpUnit>,
    /// The unit of each logical decoder layer, if it is one.
    item_unit: Vec<Option<usize>>,
    /// Per MTP depth, the unit each of its layers computes with (the depth's,
    /// or the layer's own).
    mtp_unit: Vec<Vec<Option<usize>>>,
    buckets: BucketLayout,
}

impl UnitWalk<'_> {
    fn push(&mut self, owner: Owner, def: usize, unit: Option<usize>) {
        let (bucket, offset) = self.buckets.place(self.params.len(), def, unit);
        self.params.push(Param {
            owner,
            def,
            bucket,
            offset,
        });
    }

    /// Asks the filter about a module; makes it a unit if it matches.
    fn candidate(
        &mut self,
        path: String,
        kind: ModuleKind,
        layer_kinds: &[LayerKind],
        shape: UnitShape,
        layers: std::ops::Range<usize>,
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
        self.buckets.open.push([None, None]);
        // At most a dense and an expert bucket (one dtype; units are not capped).
        self.buckets.unit_buckets.push(Vec::with_capacity(2));
        self.units.push(FsdpUnit {
            index,
            name: Cow::Owned(path),
            shape,
            layers: Cow::Owned(layers.collect()),
            mtp_depth,
            buckets: Cow::Borrowed(&[]),
        });
        Some(index)
    }

    /// A leaf module with no layers inside (embedding, final norm, output).
    fn leaf(&mut self, path: &str, kind: ModuleKind) -> Option<usize> {
        self.candidate(path.to_string(), kind, &[], UnitShape::Layer, 0..0, None)
    }
}

/// Buckets as parameters arrive in model order: grouped by (unit, dtype,
/// dense/expert), non-unit buckets split at the size cap, every parameter at
/// a 64-aligned offset.
struct BucketLayout {
    buckets: Vec<Bucket>,
    /// The open bucket of each (unit, dense/expert): row 0 for non-unit
    /// parameters, row u + 1 for unit u. A unit's parameters are contiguous,
    /// so its buckets are created together, in forward order.
    open: Vec<[Option<usize>; 2]>,
    cap: usize,
    /// Per definition: elements, elements per row, and whether it is an
    /// expert weight (computed once, not per parameter).
    defs: Vec<(usize, u64, bool)>,
    /// Each bucket's parameters (indices into the plan's parameters).
    members: Vec<Vec<usize>>,
    /// Each unit's buckets, in id order.
    unit_buckets: Vec<Vec<usize>>,
    /// Parameters the walk expects the current unit to put in its dense and
    /// expert buckets: the capacity a new unit bucket is created with.
    expect: [usize; 2],
    /// The stage key of the parameters being placed: a non-unit bucket only
    /// takes parameters of its own key.
    key: usize,
    /// Per bucket, the key it was opened under.
    keys: Vec<usize>,
}

impl BucketLayout {
    /// `units` is how many units the walk may create at most: a unit has at
    /// most two buckets (dense and expert), which sizes the tables up front.
    fn new(defs: &[ParamDef], cap: usize, units: usize) -> Self {
        let mut open = Vec::with_capacity(units + 1);
        open.push([None, None]);
        let buckets = 2 * units + 8;
        BucketLayout {
            buckets: Vec::with_capacity(buckets),
            open,
            cap: cap.max(1),
            defs: defs
                .iter()
                .map(|d| (d.numel(), d.row_numel() as u64, d.expert))
                .collect(),
            members: Vec::with_capacity(buckets),
            unit_buckets: Vec::with_capacity(units),
            expect: [0, 0],
            key: 0,
            keys: Vec::with_capacity(buckets),
        }
    }

    /// The buckets, each with its parameters, and each unit's buckets.
    fn finish(self) -> (Vec<Bucket>, Vec<Vec<usize>>) {
        let mut buckets = self.buckets;
        for (bucket, ids) in buckets.iter_mut().zip(self.members) {
            bucket.params = Cow::Owned(ids);
        }
        (buckets, self.unit_buckets)
    }

    /// The bucket and offset of parameter `param`, of definition `def`.
    fn place(&mut self, param: usize, def: usize, unit: Option<usize>) -> (usize, usize) {
        let (numel, row, expert) = self.defs[def];
        let buckets = &mut self.buckets;
        let slot = &mut self.open[unit.map_or(0, |u| u + 1)][usize::from(expert)];
        let (keys, key) = (&self.keys, self.key);
        let reuse = slot.filter(|&b| {
            // Non-unit buckets close at the size cap and at stage boundaries.
            unit.is_some()
                || (keys[b] == key
                    && (buckets[b].numel == 0 || buckets[b].numel + numel <= self.cap))
        });
        let b = match reuse {
            Some(b) => b,
            None => {
                let id = buckets.len();
                buckets.push(Bucket {
                    id,
                    unit,
                    dtype: DType::Bf16,
                    expert,
                    params: Cow::Borrowed(&[]),
                    numel: 0,
                    end: 0,
                    megatron_row_lcm: Some(1),
                });
                *slot = Some(id);
                self.keys.push(key);
                self.members.push(match unit {
                    Some(u) => {
                        self.unit_buckets[u].push(id);
                        Vec::with_capacity(self.expect[usize::from(expert)])
                    }
                    None => Vec::new(),
                });
                id
            }
        };
        self.members[b].push(param);
        let bucket = &mut buckets[b];
        let offset = round_up(bucket.end, PARAM_ALIGN);
        bucket.numel += numel;
        bucket.end = offset + numel;
        bucket.megatron_row_lcm = match bucket.megatron_row_lcm {
            // The common cases without a gcd: a bucket's first parameter, and
            // a row size the lcm already covers.
            Some(1) => Some(row),
            Some(l) if l % row == 0 => Some(l),
            l => l.and_then(|l| buckets::lcm(l, row)),
        };
        (b, offset)
    }
}

/// One schedule node: `pre_layers` are the logical layer's members before its
/// terminal (all of them if it has none), `terminal` its last member if that
/// is `-` or `E`.
fn node(
    index: usize,
    name: String,
    logical: Option<usize>,
    mtp_depth: Option<usize>,
    unit: Option<usize>,
    pre_layers: Vec<LayerRef>,
    terminal: Option<(LayerRef, LayerKind)>,
) -> ScheduleNode {
    ScheduleNode {
        index,
        name: Cow::Owned(name),
        logical,
        mtp_depth,
        unit,
        pre_layers: Cow::Owned(pre_layers),
        terminal,
        embed: false,
        mtp_enter: None,
        final_norm: false,
        heads: Cow::Borrowed(&[]),
    }
}

//! What a generated model module is made of, besides the planner's own
//! types: a handle per physical layer, the slot table of each schedule node
//! as `const` data, and the [`StaticModel`] trait every generated model
//! implements so the runtime can be generic over models planned at build
//! time.
//!
//! Everything here is `const`-constructible: the `model!` macro and
//! `build.rs` generation (both in `hybridgen-codegen`) emit values of these
//! types as `const` items, and large tables in the compact text form of
//! [`rows`], whose `const fn` readers and writer live side by side here.
//! Nothing here needs `syn`: the runtime and generated code use these types
//! without compiling the generator.

pub mod rows;

use crate::config::ModelConfig;
use crate::diagnostic::Diagnostics;
use crate::params::ParamDef;
use crate::pattern::LayerKind;
use crate::plan::{
    Bucket, FsdpUnit, LayerRef, Op, ParallelLayout, Param, Plan, PlanOptions, PlanTables,
    SchedulePlan, Slot, Stage, UnitFilter, UnitKind,
};
use std::ops::Range;

/// One physical layer of a generated model: what it is, where it lives in
/// the module tree, and which entries of the model's `PARAMS` table are its
/// parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerHandle {
    pub layer: LayerRef,
    pub kind: LayerKind,
    /// State-dict path (`decoder.layers.1.layers.0`).
    pub path: &'static str,
    /// The layer's parameters are `PARAMS[first_param..end_param]`.
    pub first_param: usize,
    pub end_param: usize,
}

impl LayerHandle {
    /// Indices of the layer's parameters in the model's `PARAMS` table.
    pub const fn params(&self) -> Range<usize> {
        self.first_param..self.end_param
    }
}

/// The forward work of one schedule node's five slots
/// ([`ScheduleNode::ops`](crate::plan::ScheduleNode::ops)), computed at
/// build time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotTable {
    pub pre_dispatch: &'static [Op],
    pub dispatch: &'static [Op],
    pub mlp: &'static [Op],
    pub combine: &'static [Op],
    pub mtp_post_process: &'static [Op],
}

impl SlotTable {
    /// A node with no work in any slot.
    pub const EMPTY: SlotTable = SlotTable {
        pre_dispatch: &[],
        dispatch: &[],
        mlp: &[],
        combine: &[],
        mtp_post_process: &[],
    };

    /// The forward work of `slot`, in order; empty for a no-op slot.
    pub const fn ops(&self, slot: Slot) -> &'static [Op] {
        match slot {
            Slot::PreDispatch => self.pre_dispatch,
            Slot::Dispatch => self.dispatch,
            Slot::Mlp => self.mlp,
            Slot::Combine => self.combine,
            Slot::MtpPostProcess => self.mtp_post_process,
        }
    }
}

/// A model planned at build time by `model!` or `hybridgen::build`. The
/// associated constants are the static plan for expert-parallel size
/// [`EP`](StaticModel::EP): every other layout choice (the data-parallel
/// size `W` a bucket is sharded over) enters only through the `const fn`s of
/// [`Bucket`].
pub trait StaticModel {
    /// The model struct's name.
    const NAME: &'static str;
    /// The pattern as written.
    const PATTERN: &'static str;
    /// The pattern in plain Megatron syntax.
    const CANONICAL_PATTERN: &'static str;
    /// The expert-parallel size the tables were planned for.
    const EP: usize;
    /// The pipeline-parallel size the stages were planned for.
    const PP: usize;
    /// The declared FSDP unit kinds; `None` is the planner's default rule.
    const UNIT_KINDS: Option<&'static [UnitKind]>;
    /// Size cap of non-unit buckets, in elements.
    const NON_UNIT_BUCKET_CAP: usize;
    /// Names (relative to their owner), shapes and expert-ness.
    const PARAM_DEFS: &'static [ParamDef];
    /// One rank's parameters in model order, each placed in its bucket.
    const PARAMS: &'static [Param];
    /// Full state-dict name of each entry of `PARAMS`.
    const PARAM_NAMES: &'static [&'static str];
    const UNITS: &'static [FsdpUnit];
    const BUCKETS: &'static [Bucket];
    const STAGES: &'static [Stage];
    const SCHEDULE: SchedulePlan;
    /// The slot table of each node of `SCHEDULE`.
    const SLOT_TABLES: &'static [SlotTable];

    /// The model dimensions the tables were planned from.
    fn config() -> ModelConfig;
    /// The FSDP unit filter the tables were planned with, as generated code.
    fn unit_filter() -> UnitFilter;
    /// The planner's options for `layout` (same filter and bucket cap as
    /// the static tables).
    fn plan_options(layout: &ParallelLayout) -> PlanOptions;
    /// The plan for data-parallel size `layout.dp`, assembled from the
    /// static tables without planning again; an H023 error when `layout`
    /// differs from the declared `ep` or pipeline split.
    fn plan(layout: &ParallelLayout) -> Result<Plan, Diagnostics>;
}

/// A generated model's plan for `options.layout`, assembled from its
/// `const` tables ([`Plan::from_tables`]). The tables hold for one
/// expert-parallel size and one pipeline split (the data-parallel size
/// enters only through [`Bucket`]'s `const fn`s), so a layout that differs
/// from the declared one in those is refused (H023).
pub fn plan_declared(
    config: &ModelConfig,
    options: &PlanOptions,
    declared: &ParallelLayout,
    tables: &PlanTables,
) -> Result<Plan, Diagnostics> {
    let given = &options.layout;
    let mut mismatches = Vec::new();
    for (name, declared, given) in [
        ("ep", Some(declared.ep), Some(given.ep)),
        ("pp", Some(declared.pp), Some(given.pp)),
        (
            "first_stage_layers",
            declared.first_stage_layers,
            given.first_stage_layers,
        ),
        (
            "last_stage_layers",
            declared.last_stage_layers,
            given.last_stage_layers,
        ),
    ] {
        if declared != given {
            let show = |v: Option<usize>| v.map_or("none".to_string(), |v| v.to_string());
            mismatches.push(crate::diagnostic::Diagnostic::new(
                crate::diagnostic::Code::H023,
                format!(
                    "the model was planned at build time for {name} = {}, but the layout has {name} = {}",
                    show(declared),
                    show(given)
                ),
            )
            .help(format!(
                "use the declared {name} (the generated `layout(dp)` builds it), or change `{name}` in the model declaration"
            )));
        }
    }
    if !mismatches.is_empty() {
        return Err(Diagnostics::new(
            config.pattern.clone(),
            "pattern",
            mismatches,
        ));
    }
    Plan::from_tables(config, options, tables)
}

/// A [`ParamDef`] in a `const`: what generated `PARAM_DEFS` tables are
/// written with.
pub const fn param_def(
    name: &'static str,
    shape: &'static [usize],
    expert: bool,
    local_expert: Option<usize>,
) -> ParamDef {
    ParamDef {
        name: std::borrow::Cow::Borrowed(name),
        shape: std::borrow::Cow::Borrowed(shape),
        expert,
        local_expert,
    }
}

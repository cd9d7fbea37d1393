//! `hybridgen plan`: a readable table or one JSON document.

use super::{Failure, human};
use hybridgen_dsl::config::ModelConfig;
use hybridgen_dsl::plan::{Bucket, FsdpUnit, Slot, UnitFilter, UnitShape};
use hybridgen_dsl::{ParallelLayout, Plan, PlanOptions};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub(crate) struct PlanArgs {
    /// The layer pattern, e.g. 'M[*E]M[*E]'. Without --model or --preset it
    /// takes the `tiny` preset's dimensions (which cover every layer kind).
    #[arg(conflicts_with = "model", allow_hyphen_values = true)]
    pattern: Option<String>,
    /// A model file (TOML: `pattern` plus dimensions; see `hybridgen preset tiny`).
    #[arg(long, value_name = "FILE", conflicts_with = "preset")]
    model: Option<PathBuf>,
    /// A built-in preset (`hybridgen preset` lists them); a PATTERN given too
    /// takes this preset's dimensions.
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,
    /// Data-parallel size: dense buckets are sharded over this many ranks.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    dp: u32,
    /// Expert-parallel size: experts split over ep ranks; expert buckets are
    /// sharded over dp / ep.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    ep: u32,
    /// Pipeline-parallel size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pp: u32,
    /// Physical layers on the first pipeline stage (uneven split).
    #[arg(long, value_name = "N")]
    first_stage_layers: Option<usize>,
    /// Physical layers on the last pipeline stage (uneven split).
    #[arg(long, value_name = "N")]
    last_stage_layers: Option<usize>,
    /// FSDP units by kind instead of the default rule: layer symbols, `group`
    /// and `mtp`, comma-separated (e.g. `group,E`); empty selects nothing.
    #[arg(long, value_name = "KINDS")]
    units: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Text,
    Json,
}

pub(crate) fn run(args: &PlanArgs) -> Result<(), Failure> {
    let model = resolve_model(
        args.pattern.as_deref(),
        args.model.as_ref(),
        args.preset.as_deref(),
    )?;
    let unit_filter = match &args.units {
        Some(kinds) => UnitFilter::parse_kinds(kinds).map_err(|d| {
            eprint!("{}", d.render("", "--units"));
            Failure::Invalid
        })?,
        None => UnitFilter::default(),
    };
    let options = PlanOptions {
        layout: ParallelLayout {
            dp: args.dp as usize,
            ep: args.ep as usize,
            pp: args.pp as usize,
            first_stage_layers: args.first_stage_layers,
            last_stage_layers: args.last_stage_layers,
        },
        unit_filter,
        ..PlanOptions::default()
    };
    let plan = Plan::new(&model, &options).map_err(|diagnostics| {
        eprintln!("{diagnostics}");
        Failure::Invalid
    })?;
    match args.format {
        Format::Text => super::emit(&text(&plan)),
        Format::Json => super::emit(&format!("{}\n", json(&plan))),
    }
}

/// The model a command works on: a model file, a preset, or a pattern with a
/// preset's dimensions (`tiny` unless another is named).
pub(crate) fn resolve_model(
    pattern: Option<&str>,
    file: Option<&PathBuf>,
    preset: Option<&str>,
) -> Result<ModelConfig, Failure> {
    let mut model = match (file, preset) {
        (Some(path), _) => ModelConfig::from_file(path),
        (None, Some(name)) => ModelConfig::preset(name),
        (None, None) => ModelConfig::preset("tiny"),
    }
    .map_err(|e| Failure::Message(e.to_string()))?;
    if let Some(pattern) = pattern {
        model.pattern = pattern.to_string();
    }
    Ok(model)
}

/// The readable report.
fn text(plan: &Plan) -> String {
    let mut out = String::new();
    let layout = &plan.layout;
    let _ = writeln!(
        out,
        "plan for {}\n  layout: dp {}, ep {} (expert shards over dp/ep = {}), pp {}",
        plan.pattern.canonical(),
        layout.dp,
        layout.ep,
        layout.expert_dp(),
        layout.pp
    );
    let _ = writeln!(
        out,
        "  {} physical layers, {} logical, {} MTP depths; {} parameters ({} active per token)",
        plan.physical_layers(),
        plan.logical_layers.len(),
        plan.mtp_depths(),
        human::count(plan.total_params),
        human::count(plan.active_params)
    );
    let _ = writeln!(out, "  unit filter: {}", plan.unit_filter.description());
    if plan.stages.len() > 1 {
        let _ = writeln!(out, "\npipeline stages ({})", plan.stages.len());
        let _ = writeln!(out, "  pp rank  vp stage  layers      logical");
        for s in &plan.stages {
            let layers = format!("{}..{}", s.layers.start, s.layers.end);
            let _ = writeln!(
                out,
                "  {:<8} {:<9} {layers:<11} {}..{}{}",
                s.pp_rank,
                s.vp_stage,
                s.logical.start,
                s.logical.end,
                if s.has_mtp { "  + MTP" } else { "" }
            );
        }
    }

    let _ = writeln!(out, "\nFSDP units ({})", plan.units.len());
    let _ = writeln!(
        out,
        "  {:<4} {:<34} {:<6} {:>8} {:>9} {:>10} {:>11}",
        "#", "unit", "kind", "layers", "params", "gathered", "shard/rank"
    );
    for unit in plan.units.iter() {
        let buckets: Vec<&Bucket> = unit.buckets.iter().map(|&b| &plan.buckets[b]).collect();
        let numel: usize = buckets.iter().map(|b| b.numel).sum();
        let padded: usize = buckets
            .iter()
            .map(|b| b.padded_numel(plan.bucket_world(b)))
            .sum();
        let shard: usize = buckets
            .iter()
            .map(|b| b.shard_numel(plan.bucket_world(b)))
            .sum();
        let _ = writeln!(
            out,
            "  {:<4} {:<34} {:<6} {:>8} {:>9} {:>10} {:>11}",
            unit.index,
            unit.name,
            shape_name(unit),
            unit_layers(unit),
            human::count(numel as u64),
            human::count(padded as u64),
            human::count(shard as u64)
        );
    }

    let _ = writeln!(
        out,
        "\nbuckets ({}; padding: ours vs Megatron's rule)",
        plan.buckets.len()
    );
    let _ = writeln!(
        out,
        "  {:<4} {:<6} {:<7} {:>3} {:>9} {:>9} {:>10} {:>10} {:>12}",
        "id", "unit", "kind", "W", "numel", "padded", "shard", "padding", "megatron pad"
    );
    let (mut ours, mut theirs, mut theirs_known) = (0u64, 0u64, true);
    for b in plan.buckets.iter() {
        let w = plan.bucket_world(b);
        let padding = b.padding(w) as u64;
        let megatron = b
            .megatron_padded_numel(w)
            .map(|m| m.saturating_sub(b.numel as u64));
        ours += padding;
        match megatron {
            Some(m) => theirs += m,
            None => theirs_known = false,
        }
        let _ = writeln!(
            out,
            "  {:<4} {:<6} {:<7} {:>3} {:>9} {:>9} {:>10} {:>10} {:>12}",
            b.id,
            b.unit.map_or("-".to_string(), |u| u.to_string()),
            if b.expert { "expert" } else { "dense" },
            w,
            human::count(b.numel as u64),
            human::count(b.padded_numel(w) as u64),
            human::count(b.shard_numel(w) as u64),
            human::count(padding),
            megatron.map_or("overflow".to_string(), human::count)
        );
    }
    let _ = writeln!(
        out,
        "  total padding: {} elements (Megatron's rule: {})",
        human::count(ours),
        if theirs_known {
            human::count(theirs)
        } else {
            "overflows 64 bits".to_string()
        }
    );

    let m = &plan.memory;
    let _ = writeln!(
        out,
        "\nmemory per rank, ZeRO-3 (overlap schedule: {} live units; plain: {})",
        m.live_units, plan.memory_plain.live_units
    );
    for (what, bytes) in [
        ("parameter shards (bf16)", m.param_shards),
        ("master weights (f32)", m.master_weights),
        ("gradient shards (f32)", m.grad_shards),
        ("Adam moments (f32)", m.optimizer_states),
        ("unit pool (bf16, unsharded)", m.unit_pool),
        ("non-unit buckets (bf16)", m.non_unit),
    ] {
        let _ = writeln!(out, "  {what:<30} {:>12}", human::bytes(bytes));
    }
    let _ = writeln!(
        out,
        "  {:<30} {:>12}   (plain schedule: {}; activations not included)",
        "total",
        human::bytes(m.total),
        human::bytes(plan.memory_plain.total)
    );
    out
}

fn slot_key(slot: Slot) -> &'static str {
    match slot {
        Slot::PreDispatch => "pre_dispatch",
        Slot::Dispatch => "dispatch",
        Slot::Mlp => "mlp",
        Slot::Combine => "combine",
        Slot::MtpPostProcess => "mtp_post_process",
    }
}

fn shape_name(unit: &FsdpUnit) -> &'static str {
    match unit.shape {
        UnitShape::Group => "group",
        UnitShape::Layer => "layer",
        UnitShape::Mtp => "mtp",
    }
}

fn unit_layers(unit: &FsdpUnit) -> String {
    match (unit.layers.first(), unit.layers.last()) {
        (Some(first), Some(last)) if first == last => first.to_string(),
        (Some(first), Some(last)) => format!("{first}-{last}"),
        _ => unit
            .mtp_depth
            .map_or("-".to_string(), |d| format!("mtp {d}")),
    }
}

/// The JSON document (see README for the schema).
fn json(plan: &Plan) -> Value {
    let bucket = |b: &Bucket| {
        let w = plan.bucket_world(b);
        json!({
            "id": b.id,
            "dtype": b.dtype,
            "expert": b.expert,
            "world": w,
            "numel": b.numel,
            "padded_numel": b.padded_numel(w),
            "shard_numel": b.shard_numel(w),
            "megatron_padded_numel": b.megatron_padded_numel(w),
            "params": b.params.iter().map(|&i| {
                let p = &plan.params[i];
                json!({ "name": plan.param_name(p), "shape": plan.def(p).shape, "offset": p.offset })
            }).collect::<Vec<_>>(),
        })
    };
    let layers: Vec<Value> = plan
        .layers
        .iter()
        .map(|l| {
            json!({
                "index": l.index,
                "symbol": l.kind.symbol().to_string(),
                "group": l.group,
                "logical": l.logical,
                "layer_number": l.layer_number,
                "path": l.path(),
                "checkpoint_prefix": l.checkpoint_prefix(),
                "stage": l.stage,
            })
        })
        .collect();
    let mtp_layers: Vec<Value> = plan
        .mtp_layers
        .iter()
        .flatten()
        .map(|l| json!({ "depth": l.depth, "index": l.index, "symbol": l.kind.symbol().to_string(), "path": l.path() }))
        .collect();
    let units: Vec<Value> = plan
        .units
        .iter()
        .map(|u| {
            json!({
                "name": u.name,
                "kind": u.shape,
                "layers": u.layers,
                "mtp_depth": u.mtp_depth,
                "buckets": u.buckets.iter().map(|&b| bucket(&plan.buckets[b])).collect::<Vec<_>>(),
            })
        })
        .collect();
    let schedule: Vec<Value> = plan
        .schedule
        .nodes
        .iter()
        .map(|n| {
            let slots: serde_json::Map<String, Value> = Slot::ALL
                .iter()
                .map(|&s| (slot_key(s).to_string(), json!(n.ops(s))))
                .collect();
            json!({ "node": n.index, "name": n.name, "unit": n.unit, "slots": slots })
        })
        .collect();
    json!({
        "pattern": plan.pattern.canonical(),
        "layout": {
            "dp": plan.layout.dp, "ep": plan.layout.ep, "pp": plan.layout.pp,
            "expert_dp": plan.layout.expert_dp(),
        },
        "physical_layers": plan.physical_layers(),
        "logical_layers": plan.logical_layers.len(),
        "mtp_depths": plan.mtp_depths(),
        "total_params": plan.total_params,
        "active_params": plan.active_params,
        "layers": layers,
        "mtp_layers": mtp_layers,
        "stages": plan.stages,
        "unit_filter": plan.unit_filter.description(),
        "units": units,
        "non_unit_buckets": plan.non_unit_buckets().map(bucket).collect::<Vec<_>>(),
        "memory": plan.memory,
        "memory_plain": plan.memory_plain,
        "schedule": schedule,
    })
}

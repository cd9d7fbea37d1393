//! `hybridgen plan`: a readable table or one JSON document.

use super::{Failure, human};
use hybridgen_dsl::config::ModelConfig;
use hybridgen_dsl::pattern::LayerKind;
use hybridgen_dsl::plan::{
    Bucket, FsdpUnit, LayerInfo, MtpLayerInfo, ScheduleNode, Slot, Stage, StageMemory, UnitFilter,
    UnitShape,
};
use hybridgen_dsl::{ParallelLayout, Plan, PlanOptions};
use hybridgen_runtime::backend::{Precision, Tokens};
use hybridgen_runtime::memory::{
    ElementSizes, activations, layer_kinds, plan_activations, stage_activations,
};
use hybridgen_runtime::recompute::Recompute;
use serde::Serialize;
use serde::ser::{SerializeMap, SerializeStruct, Serializer};
use std::io::{self, Write};
use std::ops::Range;
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
    /// Tokens per sequence for the activation figures [default: the
    /// model's seq_length].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    seq_len: Option<u32>,
    /// Sequences per micro-batch for the activation figures.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    micro_batch_size: u32,
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
    let tokens = Tokens::new(
        args.micro_batch_size as usize,
        args.seq_len.map_or(model.seq_length, |s| s as usize),
    );
    match args.format {
        Format::Text => emit_streamed(|out| write_text(&plan, tokens, out)),
        Format::Json => emit_streamed(|out| write_json(&plan, out)),
    }
}

/// Writes a report to stdout as it is produced, through a buffer: a plan of
/// a million layers is hundreds of megabytes of report, never held whole. A
/// reader that went away (`| head`) ends the output quietly.
fn emit_streamed(write: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<(), Failure> {
    let mut out = io::BufWriter::with_capacity(1 << 16, io::stdout().lock());
    match write(&mut out).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::Message(format!("cannot write to stdout: {e}"))),
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

/// The readable report, written line by line.
fn write_text(plan: &Plan, tokens: Tokens, out: &mut dyn Write) -> io::Result<()> {
    let layout = &plan.layout;
    writeln!(
        out,
        "plan for {}\n  layout: dp {}, ep {} (expert shards over dp/ep = {}), pp {}",
        plan.pattern,
        layout.dp,
        layout.ep,
        layout.expert_dp(),
        layout.pp
    )?;
    writeln!(
        out,
        "  {} physical layers, {} logical, {} MTP depths; {} parameters ({} active per token)",
        plan.physical_layers(),
        plan.logical_layers.len(),
        plan.mtp_depths(),
        human::count(plan.total_params),
        human::count(plan.active_params)
    )?;
    writeln!(out, "  unit filter: {}", plan.unit_filter.description())?;
    if plan.stages.len() > 1 {
        writeln!(out, "\npipeline stages ({})", plan.stages.len())?;
        writeln!(out, "  pp rank  vp stage  layers      logical")?;
        for s in &plan.stages {
            let layers = format!("{}..{}", s.layers.start, s.layers.end);
            writeln!(
                out,
                "  {:<8} {:<9} {layers:<11} {}..{}{}",
                s.pp_rank,
                s.vp_stage,
                s.logical.start,
                s.logical.end,
                if s.has_mtp { "  + MTP" } else { "" }
            )?;
        }
    }

    writeln!(out, "\nFSDP units ({})", plan.units.len())?;
    writeln!(
        out,
        "  {:<4} {:<34} {:<6} {:>8} {:>9} {:>10} {:>11}",
        "#", "unit", "kind", "layers", "params", "gathered", "shard/rank"
    )?;
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
        writeln!(
            out,
            "  {:<4} {:<34} {:<6} {:>8} {:>9} {:>10} {:>11}",
            unit.index,
            unit.name,
            shape_name(unit),
            unit_layers(unit),
            human::count(numel as u64),
            human::count(padded as u64),
            human::count(shard as u64)
        )?;
    }

    writeln!(
        out,
        "\nbuckets ({}; padding: ours vs Megatron's rule)",
        plan.buckets.len()
    )?;
    writeln!(
        out,
        "  {:<4} {:<6} {:<7} {:>3} {:>9} {:>9} {:>10} {:>10} {:>12}",
        "id", "unit", "kind", "W", "numel", "padded", "shard", "padding", "megatron pad"
    )?;
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
        writeln!(
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
        )?;
    }
    writeln!(
        out,
        "  total padding: {} elements (Megatron's rule: {})",
        human::count(ours),
        if theirs_known {
            human::count(theirs)
        } else {
            "overflows 64 bits".to_string()
        }
    )?;

    let m = &plan.memory;
    writeln!(
        out,
        "\nmemory per rank, ZeRO-3 (overlap schedule: {} live units; plain: {})",
        m.live_units, plan.memory_plain.live_units
    )?;
    for (what, bytes) in [
        ("parameter shards (bf16)", m.param_shards),
        ("master weights (f32)", m.master_weights),
        ("gradient shards (f32)", m.grad_shards),
        ("Adam moments (f32)", m.optimizer_states),
        ("unit pool (bf16, unsharded)", m.unit_pool),
        ("non-unit buckets (bf16)", m.non_unit),
    ] {
        writeln!(out, "  {what:<30} {:>12}", human::bytes(bytes))?;
    }
    writeln!(
        out,
        "  {:<30} {:>12}   (plain schedule: {}; activations not included)",
        "total",
        human::bytes(m.total),
        human::bytes(plan.memory_plain.total)
    )?;
    if plan.layout.pp > 1 {
        write_stage_memory(plan, tokens, out)?;
    }
    write_activations(plan, tokens, out)
}

/// Under pipeline parallelism, a row per pipeline rank: the buckets of its
/// stages (what a rank of it holds, the shared embedding on the first and
/// the last stage's rank) as the block above counts a rank's, and one
/// micro-batch's activations of its stages' layers in bf16.
fn write_stage_memory(plan: &Plan, tokens: Tokens, out: &mut dyn Write) -> io::Result<()> {
    let sizes = ElementSizes::cpu(Precision::Bf16);
    writeln!(
        out,
        "\nmemory per pipeline rank, ZeRO-3: the buckets of its stages (the figures above count \
         every stage's), and one micro-batch's activations of its stages' layers in bf16, kept"
    )?;
    writeln!(
        out,
        "  {:<8} {:<7} {:<11} {:>9} {:>12} {:>12} {:>12}  also runs",
        "pp rank", "stages", "layers", "params", "overlap", "plain", "activations"
    )?;
    for stage in plan.stage_memory() {
        let join = |items: Vec<String>| items.join(",");
        let stages = join(stage.stages.iter().map(usize::to_string).collect());
        let layers = join(
            stage
                .layers
                .iter()
                .map(|l| format!("{}..{}", l.start, l.end))
                .collect(),
        );
        let activations =
            stage_activations(plan, stage.pp_rank, tokens, sizes, Recompute::None).total;
        let mut also = Vec::new();
        if stage.embedding {
            also.push("embedding");
        }
        if stage.heads {
            also.push("final norm");
            if plan.mtp_depths() > 0 {
                also.push("MTP");
            }
            also.push("heads");
        }
        let also = if also.is_empty() {
            "-".to_string()
        } else {
            also.join(", ")
        };
        writeln!(
            out,
            "  {:<8} {stages:<7} {layers:<11} {:>9} {:>12} {:>12} {:>12}  {also}",
            stage.pp_rank,
            human::count(stage.params),
            human::bytes(stage.memory.total),
            human::bytes(stage.memory_plain.total),
            human::bytes(activations),
        )?;
    }
    Ok(())
}

/// One micro-batch's activations in bf16 (as on GPUs), with every layer
/// kept and with `--recompute full`: how a run's need grows with its
/// tokens, and what recomputation saves.
fn write_activations(plan: &Plan, tokens: Tokens, out: &mut dyn Write) -> io::Result<()> {
    let sizes = ElementSizes::cpu(Precision::Bf16);
    let [kept, recomputed] =
        [Recompute::None, Recompute::Full].map(|r| plan_activations(plan, tokens, sizes, r));
    writeln!(
        out,
        "\nactivations of one micro-batch of {} x {} tokens in bf16 (the overlap schedule keeps 2 \
         in flight, plain 1)",
        tokens.batch, tokens.seq
    )?;
    writeln!(
        out,
        "  {:<30} {:>12}   {:>12}",
        "", "kept", "--recompute full"
    )?;
    for (what, a, b) in [
        ("layers", kept.layers, recomputed.layers),
        ("streams", kept.streams, recomputed.streams),
        ("heads", kept.heads, recomputed.heads),
        ("working set", kept.working_set, recomputed.working_set),
        ("total", kept.total, recomputed.total),
    ] {
        writeln!(
            out,
            "  {what:<30} {:>12}   {:>12}",
            human::bytes(a),
            human::bytes(b)
        )?;
    }
    // What one layer of each kind saves recomputed (it keeps its input
    // instead of all it saves): how many `--recompute N` takes to fit.
    let mut kinds: Vec<LayerKind> = layer_kinds(plan)
        .filter(|&k| Recompute::can_recompute(k))
        .collect();
    kinds.sort_by_key(|&k| k as usize);
    kinds.dedup();
    // A kind with nothing to save (none today) is left out.
    let saves = kinds
        .iter()
        .filter_map(|&kind| {
            let [kept, recomputed] = [Recompute::None, Recompute::Full]
                .map(|r| activations(&plan.model, [kind], 0, tokens, sizes, r).layers);
            let saved = kept.saturating_sub(recomputed);
            (saved > 0).then(|| format!("{} {}", kind.symbol(), human::bytes(saved)))
        })
        .collect::<Vec<_>>();
    if !saves.is_empty() {
        writeln!(
            out,
            "  a layer recomputed saves {} (--recompute N: the first N layers but MoE ones; \
             largest:N and auto: the kinds that save the most first)",
            saves.join(", ")
        )?;
    }
    Ok(())
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

/// The JSON document (see README for the schema), serialized straight into
/// `out`: beyond the plan itself, memory holds one layer's worth of it at a
/// time, however many layers the plan has.
///
/// Every object's keys are in alphabetical order, as the document has always
/// been written (it was once a `serde_json::Value`, whose maps sort); the
/// views below list their fields in that order.
pub fn write_json(plan: &Plan, out: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer(&mut *out, &PlanJson(plan))?;
    out.write_all(b"\n")
}

/// A JSON array written from an iterator while it is serialized, never
/// collected.
struct Streamed<F>(F);

impl<F, I> Serialize for Streamed<F>
where
    F: Fn() -> I,
    I: IntoIterator,
    I::Item: Serialize,
{
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq((self.0)())
    }
}

/// A value written through its `Display`, never collected into a `String`
/// (the canonical pattern of a million layers is megabytes).
struct Displayed<'a, T>(&'a T);

impl<T: std::fmt::Display> Serialize for Displayed<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self.0)
    }
}

struct PlanJson<'p>(&'p Plan);

impl Serialize for PlanJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let plan = self.0;
        let mut doc = serializer.serialize_struct("Plan", 17)?;
        doc.serialize_field("active_params", &plan.active_params)?;
        doc.serialize_field(
            "layers",
            &Streamed(|| plan.layers.iter().map(LayerJson::of)),
        )?;
        doc.serialize_field(
            "layout",
            &LayoutJson {
                dp: plan.layout.dp,
                ep: plan.layout.ep,
                expert_dp: plan.layout.expert_dp(),
                pp: plan.layout.pp,
            },
        )?;
        doc.serialize_field("logical_layers", &plan.logical_layers.len())?;
        // A few numbers each: through a `Value`, whose map sorts the keys.
        let memory = |m| serde_json::to_value(m).map_err(serde::ser::Error::custom);
        doc.serialize_field("memory", &memory(&plan.memory)?)?;
        doc.serialize_field("memory_plain", &memory(&plan.memory_plain)?)?;
        doc.serialize_field("mtp_depths", &plan.mtp_depths())?;
        doc.serialize_field(
            "mtp_layers",
            &Streamed(|| plan.mtp_layers.iter().flatten().map(MtpLayerJson::of)),
        )?;
        doc.serialize_field(
            "non_unit_buckets",
            &Streamed(|| {
                plan.non_unit_buckets()
                    .map(|bucket| BucketJson { plan, bucket })
            }),
        )?;
        doc.serialize_field("pattern", &Displayed(&plan.pattern))?;
        doc.serialize_field("physical_layers", &plan.physical_layers())?;
        // Under pipeline parallelism only: without one it is `memory`.
        if plan.layout.pp > 1 {
            doc.serialize_field(
                "pipeline_memory",
                &Streamed(|| plan.stage_memory().into_iter().map(StageMemoryJson)),
            )?;
        } else {
            doc.skip_field("pipeline_memory")?;
        }
        doc.serialize_field(
            "schedule",
            &Streamed(|| plan.schedule.nodes.iter().map(NodeJson)),
        )?;
        doc.serialize_field(
            "stages",
            &Streamed(|| plan.stages.iter().map(StageJson::of)),
        )?;
        doc.serialize_field("total_params", &plan.total_params)?;
        doc.serialize_field("unit_filter", plan.unit_filter.description())?;
        doc.serialize_field(
            "units",
            &Streamed(|| plan.units.iter().map(|unit| UnitJson { plan, unit })),
        )?;
        doc.end()
    }
}

/// One pipeline rank's memory, its keys sorted (through a `Value`).
struct StageMemoryJson(StageMemory);

impl Serialize for StageMemoryJson {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serde_json::to_value(&self.0)
            .map_err(serde::ser::Error::custom)?
            .serialize(serializer)
    }
}

#[derive(Serialize)]
struct LayoutJson {
    dp: usize,
    ep: usize,
    expert_dp: usize,
    pp: usize,
}

#[derive(Serialize)]
struct LayerJson {
    checkpoint_prefix: String,
    group: Option<usize>,
    index: usize,
    layer_number: usize,
    logical: usize,
    path: String,
    stage: usize,
    symbol: char,
}

impl LayerJson {
    fn of(l: &LayerInfo) -> Self {
        LayerJson {
            checkpoint_prefix: l.checkpoint_prefix(),
            group: l.group,
            index: l.index,
            layer_number: l.layer_number,
            logical: l.logical,
            path: l.path(),
            stage: l.stage,
            symbol: l.kind.symbol(),
        }
    }
}

#[derive(Serialize)]
struct MtpLayerJson {
    depth: usize,
    index: usize,
    path: String,
    symbol: char,
}

impl MtpLayerJson {
    fn of(l: &MtpLayerInfo) -> Self {
        MtpLayerJson {
            depth: l.depth,
            index: l.index,
            path: l.path(),
            symbol: l.kind.symbol(),
        }
    }
}

#[derive(Serialize)]
struct StageJson {
    has_mtp: bool,
    layers: RangeJson,
    logical: RangeJson,
    pp_rank: usize,
    vp_stage: usize,
}

impl StageJson {
    fn of(s: &Stage) -> Self {
        StageJson {
            has_mtp: s.has_mtp,
            layers: RangeJson::of(&s.layers),
            logical: RangeJson::of(&s.logical),
            pp_rank: s.pp_rank,
            vp_stage: s.vp_stage,
        }
    }
}

#[derive(Serialize)]
struct RangeJson {
    end: usize,
    start: usize,
}

impl RangeJson {
    fn of(r: &Range<usize>) -> Self {
        RangeJson {
            end: r.end,
            start: r.start,
        }
    }
}

struct UnitJson<'p> {
    plan: &'p Plan,
    unit: &'p FsdpUnit,
}

impl Serialize for UnitJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (plan, unit) = (self.plan, self.unit);
        let mut json = serializer.serialize_struct("Unit", 5)?;
        json.serialize_field(
            "buckets",
            &Streamed(|| {
                unit.buckets.iter().map(|&b| BucketJson {
                    plan,
                    bucket: &plan.buckets[b],
                })
            }),
        )?;
        json.serialize_field("kind", &unit.shape)?;
        json.serialize_field("layers", &unit.layers)?;
        json.serialize_field("mtp_depth", &unit.mtp_depth)?;
        json.serialize_field("name", &unit.name)?;
        json.end()
    }
}

struct BucketJson<'p> {
    plan: &'p Plan,
    bucket: &'p Bucket,
}

impl Serialize for BucketJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (plan, b) = (self.plan, self.bucket);
        let w = plan.bucket_world(b);
        let mut json = serializer.serialize_struct("Bucket", 9)?;
        json.serialize_field("dtype", &b.dtype)?;
        json.serialize_field("expert", &b.expert)?;
        json.serialize_field("id", &b.id)?;
        json.serialize_field("megatron_padded_numel", &b.megatron_padded_numel(w))?;
        json.serialize_field("numel", &b.numel)?;
        json.serialize_field("padded_numel", &b.padded_numel(w))?;
        json.serialize_field(
            "params",
            &Streamed(|| {
                b.params.iter().map(|&i| {
                    let p = &plan.params[i];
                    ParamJson {
                        name: plan.param_name(p),
                        offset: p.offset,
                        shape: &plan.def(p).shape,
                    }
                })
            }),
        )?;
        json.serialize_field("shard_numel", &b.shard_numel(w))?;
        json.serialize_field("world", &w)?;
        json.end()
    }
}

#[derive(Serialize)]
struct ParamJson<'p> {
    name: String,
    offset: usize,
    shape: &'p [usize],
}

struct NodeJson<'p>(&'p ScheduleNode);

impl Serialize for NodeJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let n = self.0;
        let mut json = serializer.serialize_struct("Node", 4)?;
        json.serialize_field("name", &n.name)?;
        json.serialize_field("node", &n.index)?;
        json.serialize_field("slots", &SlotsJson(n))?;
        json.serialize_field("unit", &n.unit)?;
        json.end()
    }
}

/// A node's slots by name, in the names' alphabetical order.
struct SlotsJson<'p>(&'p ScheduleNode);

impl Serialize for SlotsJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut slots = Slot::ALL;
        slots.sort_by_key(|&slot| slot_key(slot));
        let mut json = serializer.serialize_map(Some(slots.len()))?;
        for slot in slots {
            json.serialize_entry(slot_key(slot), &self.0.ops(slot))?;
        }
        json.end()
    }
}

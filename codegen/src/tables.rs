//! The plan's tables as `const` items of the planner's own types. Large
//! tables are written in the compact row form of
//! [`hybridgen_dsl::static_model::rows`] and decoded by `const fn`s while
//! the compiler evaluates the constants; the small, shared ones (parameter
//! definitions, stages) as plain expressions.

use hybridgen_dsl::params::ParamDef;
use hybridgen_dsl::plan::{LayerRef, Owner, Plan, Slot, Stage};
use hybridgen_dsl::static_model::rows::{Writer, param_runs};
use proc_macro2::{Literal, TokenStream};
use quote::quote;
use std::collections::HashMap;

fn lit(n: usize) -> Literal {
    Literal::usize_unsuffixed(n)
}

fn opt(n: Option<usize>) -> TokenStream {
    match n {
        Some(n) => {
            let n = lit(n);
            quote!(Some(#n))
        }
        None => quote!(None),
    }
}

/// A string literal of `text` as it is written, newlines and all. Table
/// text holds no quote or backslash, so its source form is itself; writing
/// it that way spares escaping every character (a third of the expansion
/// time of a large model) and prints one table row a line.
fn text(text: &str) -> Literal {
    if !text.contains(['"', '\\', '\r'])
        && let Ok(literal) = format!("\"{text}\"").parse::<Literal>()
    {
        return literal;
    }
    Literal::string(text)
}

/// `"a", "b", ...`: string literals are constants the compiler interns as
/// it parses them, with nothing for the `const` interpreter to do.
fn strings(items: &[String]) -> TokenStream {
    let mut out = TokenStream::new();
    for item in items {
        out.extend([
            proc_macro2::TokenTree::Literal(text(item)),
            proc_macro2::TokenTree::Punct(proc_macro2::Punct::new(
                ',',
                proc_macro2::Spacing::Alone,
            )),
        ]);
    }
    out
}

/// Module paths, interned: tables refer to a path by its line in `__PATHS`.
#[derive(Default)]
struct Paths {
    lines: Vec<String>,
    index: HashMap<String, usize>,
}

impl Paths {
    fn intern(&mut self, path: &str) -> usize {
        if let Some(&i) = self.index.get(path) {
            return i;
        }
        let i = self.lines.len();
        self.lines.push(path.to_string());
        self.index.insert(path.to_string(), i);
        i
    }
}

/// `[first, end)` into `params`.
type ParamRange = (usize, usize);

/// Each decoder layer's parameter range, and each MTP depth's layers'.
fn param_ranges(plan: &Plan) -> (Vec<ParamRange>, Vec<Vec<ParamRange>>) {
    let mut decoder = vec![(0, 0); plan.layers.len()];
    let mut mtp: Vec<Vec<ParamRange>> = plan
        .mtp_layers
        .iter()
        .map(|d| vec![(0, 0); d.len()])
        .collect();
    let record = |range: &mut ParamRange, i: usize| {
        if range.1 == 0 {
            range.0 = i;
        }
        range.1 = i + 1;
    };
    for (i, param) in plan.params.iter().enumerate() {
        match param.owner {
            Owner::Layer(LayerRef::Decoder(l)) => {
                if let Some(range) = decoder.get_mut(l) {
                    record(range, i);
                }
            }
            Owner::Layer(LayerRef::Mtp { depth, index }) => {
                if let Some(range) = mtp.get_mut(depth).and_then(|d| d.get_mut(index)) {
                    record(range, i);
                }
            }
            _ => {}
        }
    }
    (decoder, mtp)
}

/// Every table of the generated module.
pub fn tables(plan: &Plan) -> TokenStream {
    let mut paths = Paths::default();
    let mut out = TokenStream::new();
    out.extend(param_defs(&plan.param_defs));
    out.extend(params(plan));
    out.extend(buckets(plan));
    out.extend(units(plan, &mut paths));
    out.extend(stages(&plan.stages));
    out.extend(schedule(plan, &mut paths));
    out.extend(layers(plan, &mut paths));
    let paths = strings(&paths.lines);
    out.extend(quote! {
        /// Module paths; the tables refer to them by index.
        const __PATHS: &[&str] = &[#paths];
    });
    out
}

fn param_defs(defs: &[ParamDef]) -> TokenStream {
    let defs = defs.iter().map(|def| {
        let name = def.name.as_ref();
        let shape = def.shape.iter().map(|&n| lit(n));
        let expert = def.expert;
        let local = opt(def.local_expert);
        quote!(__param_def(#name, &[#(#shape),*], #expert, #local))
    });
    quote! {
        /// Parameter definitions: name relative to the owner, full shape,
        /// expert-ness, local expert index. Every layer of a kind shares its
        /// definitions.
        pub const PARAM_DEFS: &[__dsl::params::ParamDef] = &[#(#defs),*];
    }
}

/// `1, 2, 3,`: a number array's elements.
fn numbers(items: &[usize]) -> TokenStream {
    let mut out = TokenStream::new();
    for &n in items {
        out.extend([
            proc_macro2::TokenTree::Literal(lit(n)),
            proc_macro2::TokenTree::Punct(proc_macro2::Punct::new(
                ',',
                proc_macro2::Spacing::Alone,
            )),
        ]);
    }
    out
}

fn params(plan: &Plan) -> TokenStream {
    let names: Vec<String> = plan.params.iter().map(|p| plan.param_name(p)).collect();
    let (runs, offsets) = param_runs(&plan.params);
    let count = lit(plan.params.len());
    let (runs, offsets, names) = (numbers(&runs), numbers(&offsets), strings(&names));
    quote! {
        /// Parameter runs: `owner (3 numbers), first definition, count,
        /// bucket` for consecutive parameters of one owner and bucket.
        const __PARAM_RUNS: &[usize] = &[#runs];
        /// Each parameter's offset in its bucket (a multiple of 64).
        const __PARAM_OFFSETS: &[usize] = &[#offsets];
        /// One rank's parameters in model (`named_parameters()`) order:
        /// owner, definition (index into `PARAM_DEFS`), bucket, and offset in
        /// the bucket (a multiple of 64).
        #[allow(long_running_const_eval)]
        pub const PARAMS: &[__plan::Param] = &__rows::params::<#count>(__PARAM_RUNS, __PARAM_OFFSETS);
        /// The full state-dict name of each entry of `PARAMS`.
        pub const PARAM_NAMES: &[&str] = &[#names];
    }
}

fn buckets(plan: &Plan) -> TokenStream {
    let mut rows = Writer::new();
    for b in plan.buckets.iter() {
        rows.index_option(b.unit);
        rows.flag(b.expert);
        rows.index(b.numel);
        rows.index(b.end);
        rows.option(b.megatron_row_lcm);
        rows.index(b.params.len());
        rows.end_row();
    }
    let (count, params) = (lit(plan.buckets.len()), lit(plan.params.len()));
    let rows = text(&rows.finish());
    quote! {
        /// Each bucket's parameters (indices into `PARAMS`), bucket after
        /// bucket, derived from `PARAMS`.
        #[allow(long_running_const_eval)]
        const __BUCKET_PARAMS: &[usize] = &__rows::bucket_members::<#params, #count>(PARAMS);
        /// Every bucket by id (forward order): unit, expert-ness, elements,
        /// end of the last parameter, Megatron's padding unit, parameter
        /// count. Offsets are fixed; the padded length and shard ranges are
        /// `const fn`s of the shard group size `W`:
        /// `BUCKETS[b].padded_numel(W)`, `BUCKETS[b].shard_range(W, rank)`.
        #[allow(long_running_const_eval)]
        pub const BUCKETS: &[__plan::Bucket] = &__rows::buckets::<#count>(#rows, __BUCKET_PARAMS);

        /// Bucket `bucket`'s padded length when sharded over `world` ranks.
        pub const fn padded_numel(bucket: usize, world: usize) -> usize {
            BUCKETS[bucket].padded_numel(world)
        }

        /// The elements of bucket `bucket` that rank `rank` of `world` owns.
        pub const fn shard_range(bucket: usize, world: usize, rank: usize) -> ::core::ops::Range<usize> {
            BUCKETS[bucket].shard_range(world, rank)
        }
    }
}

fn units(plan: &Plan, paths: &mut Paths) -> TokenStream {
    let mut rows = Writer::new();
    let mut lists = Writer::new();
    let mut list_len = 0;
    for u in plan.units.iter() {
        rows.index(paths.intern(&u.name));
        rows.unit_shape(u.shape);
        rows.index(u.layers.len());
        rows.index_option(u.mtp_depth);
        rows.index(u.buckets.len());
        rows.end_row();
        for &n in u.layers.iter().chain(u.buckets.iter()) {
            lists.index(n);
        }
        lists.end_row();
        list_len += u.layers.len() + u.buckets.len();
    }
    let (count, list_len) = (lit(plan.units.len()), lit(list_len));
    let (rows, lists) = (text(&rows.finish()), text(&lists.finish()));
    quote! {
        /// Each unit's physical layers, then its buckets, unit after unit.
        const __UNIT_LISTS: &[usize] = &__rows::numbers::<#list_len>(#lists);
        /// FSDP units in forward order, as the unit filter picked them:
        /// module path, shape, layers, MTP depth, buckets.
        #[allow(long_running_const_eval)]
        pub const UNITS: &[__plan::FsdpUnit] = &__rows::units::<#count>(#rows, __PATHS, __UNIT_LISTS);
    }
}

fn stages(stages: &[Stage]) -> TokenStream {
    let stages = stages.iter().map(|s| {
        let (rank, vp) = (lit(s.pp_rank), lit(s.vp_stage));
        let (l0, l1) = (lit(s.layers.start), lit(s.layers.end));
        let (g0, g1) = (lit(s.logical.start), lit(s.logical.end));
        let mtp = s.has_mtp;
        quote! {
            __plan::Stage { pp_rank: #rank, vp_stage: #vp, layers: #l0..#l1, logical: #g0..#g1, has_mtp: #mtp }
        }
    });
    quote! {
        /// Pipeline stages for `PP` ranks.
        pub const STAGES: &[__plan::Stage] = &[#(#stages),*];
    }
}

fn schedule(plan: &Plan, paths: &mut Paths) -> TokenStream {
    let nodes = &plan.schedule.nodes;
    let (mut rows, mut layers, mut heads) = (Writer::new(), Writer::new(), Writer::new());
    let (mut layer_count, mut head_count) = (0, 0);
    let (mut slot_rows, mut ops) = (Writer::new(), Writer::new());
    let mut op_count = 0;
    for n in nodes.iter() {
        rows.index(paths.intern(&n.name));
        rows.index_option(n.logical);
        rows.index_option(n.mtp_depth);
        rows.index_option(n.unit);
        rows.index(n.pre_layers.len());
        match n.terminal {
            Some((layer, kind)) => {
                rows.kind(kind);
                rows.layer(layer);
            }
            None => rows.none(),
        }
        rows.flag(n.embed);
        rows.index_option(n.mtp_enter);
        rows.flag(n.final_norm);
        rows.index(n.heads.len());
        rows.end_row();
        for &layer in n.pre_layers.iter() {
            layers.layer(layer);
            layers.end_row();
        }
        layer_count += n.pre_layers.len();
        for &head in n.heads.iter() {
            heads.index_option(head);
        }
        head_count += n.heads.len();
        for slot in Slot::ALL {
            let slot_ops = n.ops(slot);
            slot_rows.index(slot_ops.len());
            for op in &slot_ops {
                ops.op(*op);
                ops.end_row();
            }
            op_count += slot_ops.len();
        }
        slot_rows.end_row();
    }
    let count = lit(nodes.len());
    let (layer_count, head_count, op_count) = (lit(layer_count), lit(head_count), lit(op_count));
    let (rows, layers, heads) = (
        text(&rows.finish()),
        text(&layers.finish()),
        text(&heads.finish()),
    );
    let (slot_rows, ops) = (text(&slot_rows.finish()), text(&ops.finish()));
    quote! {
        /// Each node's pre-layers, node after node.
        const __NODE_LAYERS: &[__plan::LayerRef] = &__rows::layers::<#layer_count>(#layers);
        /// Each node's output heads, node after node.
        const __NODE_HEADS: &[::core::option::Option<usize>] = &__rows::options::<#head_count>(#heads);
        #[allow(long_running_const_eval)]
        const __NODES: &[__plan::ScheduleNode] =
            &__rows::nodes::<#count>(#rows, __PATHS, __NODE_LAYERS, __NODE_HEADS);
        /// The overlap schedule's forward chain: one node per logical
        /// layer, then one per MTP layer.
        pub const SCHEDULE: __plan::SchedulePlan = __plan::SchedulePlan { nodes: __Cow::Borrowed(__NODES) };
        /// Every slot's ops, node after node and slot after slot.
        #[allow(long_running_const_eval)]
        const __SLOT_OPS: &[__plan::Op] = &__rows::ops::<#op_count>(#ops);
        /// Each schedule node's five slots (pre-dispatch, dispatch, mlp,
        /// combine, MTP post-process), as `const` data.
        #[allow(long_running_const_eval)]
        pub const SLOT_TABLES: &[__model::SlotTable] = &__rows::slot_tables::<#count>(#slot_rows, __SLOT_OPS);
    }
}

/// The handle of every physical layer (decoder layers, then each MTP depth's
/// layers) and the module entry of every logical layer and MTP depth, which
/// the typed layer structs are read from.
fn layers(plan: &Plan, paths: &mut Paths) -> TokenStream {
    let (decoder_ranges, mtp_ranges) = param_ranges(plan);
    let mut handles = Writer::new();
    let mut handle_count = 0;
    let mut first_mtp_handle = Vec::with_capacity(plan.mtp_depths());
    for info in &plan.layers {
        let (first, end) = decoder_ranges[info.index];
        handles.layer(LayerRef::Decoder(info.index));
        handles.kind(info.kind);
        handles.index(paths.intern(&info.path()));
        handles.index(first);
        handles.index(end);
        handles.end_row();
        handle_count += 1;
    }
    for (d, depth) in plan.mtp_layers.iter().enumerate() {
        first_mtp_handle.push(handle_count);
        for layer in depth {
            let (first, end) = mtp_ranges[d][layer.index];
            handles.layer(LayerRef::Mtp {
                depth: d,
                index: layer.index,
            });
            handles.kind(layer.kind);
            handles.index(paths.intern(&layer.path()));
            handles.index(first);
            handles.index(end);
            handles.end_row();
            handle_count += 1;
        }
    }

    let unit_of: HashMap<&str, usize> = plan
        .units
        .iter()
        .map(|u| (u.name.as_ref(), u.index))
        .collect();
    let mut first_node_of_depth = vec![0; plan.mtp_depths()];
    let mut logical_node = vec![0; plan.logical_layers.len()];
    for node in plan.schedule.nodes.iter().rev() {
        if let Some(slot) = node.logical.and_then(|l| logical_node.get_mut(l)) {
            *slot = node.index;
        }
        if let Some(slot) = node.mtp_depth.and_then(|d| first_node_of_depth.get_mut(d)) {
            *slot = node.index;
        }
    }
    let mut modules = Writer::new();
    for logical in &plan.logical_layers {
        let path = logical.path();
        modules.index(paths.intern(&path));
        modules.index_option(unit_of.get(path.as_str()).copied());
        modules.index(logical_node[logical.index]);
        modules.index(logical.layers.start);
        modules.end_row();
    }
    for d in 0..plan.mtp_depths() {
        let path = format!("mtp.layers.{d}");
        modules.index(paths.intern(&path));
        modules.index_option(unit_of.get(path.as_str()).copied());
        modules.index(first_node_of_depth[d]);
        modules.index(first_mtp_handle[d]);
        modules.end_row();
    }
    let handle_count = lit(handle_count);
    let module_count = lit(plan.logical_layers.len() + plan.mtp_depths());
    let (handles, modules) = (text(&handles.finish()), text(&modules.finish()));
    quote! {
        /// Every physical layer: decoder layers in order, then each MTP
        /// depth's layers; each with its kind, path and parameters.
        #[allow(long_running_const_eval)]
        pub const LAYER_HANDLES: &[__model::LayerHandle] = &__rows::handles::<#handle_count>(#handles, __PATHS);
        /// Logical layers in order, then MTP depths: path, FSDP unit, first
        /// schedule node, first layer handle.
        #[allow(long_running_const_eval)]
        pub const MODULES: &[__rows::ModuleEntry] = &__rows::modules::<#module_count>(#modules, __PATHS);
    }
}

//! Properties of the pattern language and the planner over random inputs:
//! valid patterns round-trip through the canonical form (plain and sugared),
//! no input makes the parser panic or point outside itself, and plans of
//! random valid patterns and layouts keep every bucket and unit invariant of
//! docs/fsdp.md.

use hybridgen_dsl::plan::{LayerRef, Op, Owner, Slot};
use hybridgen_dsl::{Code, ModelConfig, ParallelLayout, Pattern, Plan, PlanOptions, UnitFilter};
use proptest::prelude::*;
use std::collections::HashSet;

// ---- a generator of valid patterns -----------------------------------------------------

/// One logical layer of a generated pattern.
#[derive(Clone, Debug, PartialEq)]
enum Item {
    Layer(char),
    Group(Vec<char>),
}

/// A valid pattern as data: segments of items, and MTP depths (all equal).
#[derive(Clone, Debug)]
struct Ast {
    segments: Vec<Vec<Item>>,
    mtp: Vec<Vec<char>>,
}

impl Item {
    fn symbols(&self) -> &[char] {
        match self {
            Item::Layer(c) => std::slice::from_ref(c),
            Item::Group(members) => members,
        }
    }

    fn canonical(&self) -> String {
        match self {
            Item::Layer(c) => c.to_string(),
            Item::Group(members) => format!("[{}]", members.iter().collect::<String>()),
        }
    }
}

impl Ast {
    fn canonical(&self) -> String {
        let main: Vec<String> = self
            .segments
            .iter()
            .map(|s| s.iter().map(Item::canonical).collect())
            .collect();
        let mut out = main.join("|");
        for depth in &self.mtp {
            out.push('/');
            out.extend(depth);
        }
        out
    }

    fn items(&self) -> impl Iterator<Item = &Item> {
        self.segments.iter().flatten()
    }

    fn physical(&self) -> usize {
        self.items().map(|i| i.symbols().len()).sum()
    }

    fn logical(&self) -> usize {
        self.items().count()
    }
}

/// The attention symbols of one family: GQA `*` or latent `+ D`; the gated
/// delta net `G` goes with either (H009 is about `*` with `+`/`D` only).
fn attention(latent: bool) -> BoxedStrategy<char> {
    if latent {
        prop_oneof![Just('+'), Just('D'), Just('G')].boxed()
    } else {
        prop_oneof![Just('*'), Just('G')].boxed()
    }
}

fn symbol(latent: bool) -> BoxedStrategy<char> {
    prop_oneof![Just('M'), attention(latent), Just('-'), Just('E')].boxed()
}

/// A group obeying H004-H008: at most one `M` and one attention-family
/// member, in either order, then at most one terminal, last.
fn group(latent: bool) -> BoxedStrategy<Vec<char>> {
    (
        any::<bool>(),
        proptest::option::of(attention(latent)),
        proptest::option::of(prop_oneof![Just('-'), Just('E')]),
        any::<bool>(),
    )
        .prop_filter_map("a group has a member", |(mamba, attn, terminal, swap)| {
            let mut members: Vec<char> = mamba.then_some('M').into_iter().chain(attn).collect();
            if swap {
                members.reverse();
            }
            members.extend(terminal);
            (!members.is_empty()).then_some(members)
        })
        .boxed()
}

fn item(latent: bool) -> BoxedStrategy<Item> {
    prop_oneof![
        3 => symbol(latent).prop_map(Item::Layer),
        2 => group(latent).prop_map(Item::Group),
    ]
    .boxed()
}

/// A segment: a short run of items, sometimes repeated whole (so the sugar
/// printer has blocks to compress).
fn segment(latent: bool) -> BoxedStrategy<Vec<Item>> {
    (proptest::collection::vec(item(latent), 0..4), 1usize..4)
        .prop_map(|(items, times)| std::iter::repeat_n(items, times).flatten().collect())
        .boxed()
}

fn ast() -> BoxedStrategy<Ast> {
    any::<bool>()
        .prop_flat_map(|latent| {
            (
                proptest::collection::vec(segment(latent), 1..4),
                0usize..3,
                proptest::collection::vec(symbol(latent), 1..4),
            )
                .prop_map(|(segments, depths, depth)| Ast {
                    segments,
                    mtp: vec![depth; depths],
                })
        })
        .boxed()
}

// ---- a sugar printer ---------------------------------------------------------------------

/// A small deterministic source of choices for the printer.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }

    fn coin(&mut self) -> bool {
        self.roll(2) == 0
    }

    /// White space, often none.
    fn space(&mut self) -> &'static str {
        ["", "", "", " ", "  ", "\t", "\n", "\r\n"][self.roll(8) as usize]
    }
}

/// `ast` with random sugar: white space between any two tokens, runs of
/// equal items as `X{N}`, whole repeated segments as `( ... ){N}`, and the
/// occasional `{1}`. It must expand back to `ast.canonical()`.
fn sugared(ast: &Ast, dice: &mut Dice) -> String {
    let mut out = String::new();
    out.push_str(dice.space());
    for (s, segment) in ast.segments.iter().enumerate() {
        if s > 0 {
            out.push('|');
            out.push_str(dice.space());
        }
        sugar_items(segment, dice, &mut out);
    }
    for depth in &ast.mtp {
        out.push('/');
        out.push_str(dice.space());
        let mut i = 0;
        while i < depth.len() {
            let run = depth[i..].iter().take_while(|&&c| c == depth[i]).count();
            out.push(depth[i]);
            out.push_str(dice.space());
            if run > 1 && dice.coin() {
                count(run, dice, &mut out);
                i += run;
            } else {
                i += 1;
            }
        }
    }
    out
}

fn count(n: usize, dice: &mut Dice, out: &mut String) {
    out.push('{');
    out.push_str(dice.space());
    out.push_str(&n.to_string());
    out.push_str(dice.space());
    out.push('}');
    out.push_str(dice.space());
}

fn sugar_items(items: &[Item], dice: &mut Dice, out: &mut String) {
    // The whole run as `( period ){k}` when it is a repetition.
    if !items.is_empty() && dice.coin() {
        for period in 1..=items.len() {
            if items.len().is_multiple_of(period)
                && items
                    .iter()
                    .enumerate()
                    .all(|(i, it)| *it == items[i % period])
            {
                out.push('(');
                out.push_str(dice.space());
                sugar_run(&items[..period], dice, out);
                out.push(')');
                out.push_str(dice.space());
                count(items.len() / period, dice, out);
                return;
            }
        }
    }
    sugar_run(items, dice, out);
}

/// Items one by one, runs of equal items sometimes as `X{N}`.
fn sugar_run(items: &[Item], dice: &mut Dice, out: &mut String) {
    let mut i = 0;
    while i < items.len() {
        let run = items[i..].iter().take_while(|&it| *it == items[i]).count();
        match &items[i] {
            Item::Layer(c) => out.push(*c),
            Item::Group(members) => {
                out.push('[');
                out.push_str(dice.space());
                for m in members {
                    out.push(*m);
                    out.push_str(dice.space());
                    if dice.roll(6) == 0 {
                        count(1, dice, out);
                    }
                }
                out.push(']');
            }
        }
        out.push_str(dice.space());
        let take = if run > 1 && dice.coin() {
            run
        } else if dice.roll(8) == 0 {
            1
        } else {
            0
        };
        if take > 0 {
            count(take, dice, out);
            i += take;
        } else {
            i += 1;
        }
    }
}

// ---- checks shared by the random-input properties ------------------------------------------

/// Whatever `source` is: no panic, and either a pattern whose canonical form
/// reads back as itself, or diagnostics that point inside the source on
/// character boundaries, with a pattern code, a message and a help line.
fn check_any_input(source: &str) -> Result<(), TestCaseError> {
    match Pattern::parse(source) {
        Ok(pattern) => {
            let canonical = pattern.canonical();
            let again = Pattern::parse(&canonical).map_err(|d| {
                TestCaseError::fail(format!("{canonical:?} does not reparse:\n{d}"))
            })?;
            prop_assert_eq!(again.canonical(), canonical);
        }
        Err(diagnostics) => {
            prop_assert!(!diagnostics.items.is_empty());
            for d in &diagnostics.items {
                let span = d
                    .span
                    .ok_or_else(|| TestCaseError::fail(format!("{} has no span", d.code)))?;
                prop_assert!(
                    span.start <= span.end && span.end <= source.len(),
                    "{:?}",
                    span
                );
                prop_assert!(source.is_char_boundary(span.start), "{:?}", span);
                prop_assert!(source.is_char_boundary(span.end), "{:?}", span);
                prop_assert!(d.code <= Code::H012, "{}", d.code);
                prop_assert!(!d.message.is_empty() && !d.help.is_empty());
                // The tolerant grammar reads every input: the fallback for
                // an input it could not read never fires.
                prop_assert!(!d.message.contains("could not be read"), "{}", d.message);
                let _ = d.render_inline(source);
            }
            let rendered = diagnostics.to_string();
            prop_assert!(rendered.starts_with("error["));
        }
    }
    Ok(())
}

// ---- the properties -----------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn valid_patterns_round_trip_through_the_canonical_form(ast in ast()) {
        let canonical = ast.canonical();
        let pattern = Pattern::parse(&canonical)
            .map_err(|d| TestCaseError::fail(format!("{canonical:?}:\n{d}")))?;
        prop_assert_eq!(pattern.canonical(), canonical.clone());
        prop_assert_eq!(pattern.physical_count(), ast.physical());
        prop_assert_eq!(pattern.logical_count(), ast.logical());
        prop_assert_eq!(pattern.segments.len(), ast.segments.len());
        prop_assert_eq!(pattern.mtp_depth_count(), ast.mtp.len());
        // Spans point at the symbols that wrote each layer.
        for layer in pattern.layers() {
            prop_assert_eq!(&canonical[layer.span.start..layer.span.end], layer.kind.symbol().to_string());
        }
    }

    #[test]
    fn sugared_patterns_expand_to_the_canonical_form(ast in ast(), seed in any::<u64>()) {
        let sugar = sugared(&ast, &mut Dice(seed));
        let pattern = Pattern::parse(&sugar)
            .map_err(|d| TestCaseError::fail(format!("{sugar:?}:\n{d}")))?;
        prop_assert_eq!(pattern.canonical(), ast.canonical(), "sugar {:?}", sugar);
    }

    #[test]
    fn random_strings_never_panic(source in any::<String>()) {
        check_any_input(&source)?;
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        check_any_input(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn strings_over_the_pattern_alphabet_never_panic(
        source in "[M*+DGE\\-\\[\\]()|/{}0-9 \\n\\txmé×]{0,60}"
    ) {
        check_any_input(&source)?;
    }
}

// ---- plan invariants ----------------------------------------------------------------------------

/// (dp, ep) layouts valid for `tiny`'s 4 experts.
const LAYOUTS: [(usize, usize); 10] = [
    (1, 1),
    (2, 1),
    (2, 2),
    (3, 1),
    (4, 1),
    (4, 2),
    (4, 4),
    (6, 2),
    (8, 2),
    (8, 4),
];

#[derive(Clone, Debug)]
enum FilterChoice {
    Default,
    Kinds(String),
}

fn filter_choice() -> impl Strategy<Value = FilterChoice> {
    prop_oneof![
        3 => Just(FilterChoice::Default),
        1 => proptest::sample::subsequence(vec!["M", "*", "+", "D", "G", "-", "E", "group", "mtp"], 0..4)
            .prop_map(|kinds| FilterChoice::Kinds(kinds.join(","))),
    ]
}

/// The unit each parameter's owner belongs to, worked out from the units'
/// own descriptions (their layers, depth and path), not from the buckets.
fn owner_unit(plan: &Plan, owner: Owner) -> Option<usize> {
    let named = |name: &str| plan.units.iter().position(|u| u.name == name);
    let depth = |d: usize| {
        plan.units
            .iter()
            .position(|u| u.mtp_depth == Some(d) && u.name == format!("mtp.layers.{d}"))
    };
    match owner {
        Owner::Embedding => named("embedding"),
        Owner::FinalNorm => named("decoder.final_norm"),
        Owner::OutputLayer => named("output_layer"),
        Owner::MtpBlock(d) => depth(d),
        Owner::Layer(LayerRef::Decoder(i)) => plan
            .units
            .iter()
            .position(|u| u.mtp_depth.is_none() && u.layers.contains(&i)),
        Owner::Layer(LayerRef::Mtp { depth: d, index }) => {
            depth(d).or_else(|| named(&format!("mtp.layers.{d}.mtp_model_layer.layers.{index}")))
        }
    }
}

fn check_plan(plan: &Plan, ast: &Ast, default_filter: bool) -> Result<(), TestCaseError> {
    // Every parameter in exactly one bucket, the one it names.
    let mut seen = vec![0usize; plan.params.len()];
    for (id, bucket) in plan.buckets.iter().enumerate() {
        prop_assert_eq!(bucket.id, id);
        prop_assert!(!bucket.params.is_empty());
        for &i in bucket.params.iter() {
            seen[i] += 1;
            prop_assert_eq!(plan.params[i].bucket, id);
        }
    }
    prop_assert!(seen.iter().all(|&n| n == 1), "{:?}", seen);

    for bucket in plan.buckets.iter() {
        // Offsets 64-aligned, in order, disjoint, inside `end`.
        let mut cursor = 0;
        let mut numel = 0;
        for &i in bucket.params.iter() {
            let param = &plan.params[i];
            let def = plan.def(param);
            prop_assert_eq!(param.offset % 64, 0);
            prop_assert!(param.offset >= cursor, "overlap at {}", param.offset);
            cursor = param.offset + def.numel();
            numel += def.numel();
            // Dense and expert parameters never share a bucket.
            prop_assert_eq!(def.expert, bucket.expert);
            prop_assert_eq!(def.expert, plan.param_name(param).contains(".experts."));
            // Units never mix: every parameter belongs to the bucket's unit.
            prop_assert_eq!(
                owner_unit(plan, param.owner),
                bucket.unit,
                "{}",
                plan.param_name(param)
            );
        }
        prop_assert_eq!(cursor, bucket.end);
        prop_assert_eq!(numel, bucket.numel);
        // Padding to W x 128, shards partition it.
        let world = plan.bucket_world(bucket);
        let padded = bucket.padded_numel(world);
        prop_assert_eq!(padded % (world * 128), 0);
        prop_assert!(padded >= bucket.end && padded < bucket.end + world * 128);
        let mut next = 0;
        for rank in 0..world {
            let shard = bucket.shard_range(world, rank);
            prop_assert_eq!(shard.start, next);
            prop_assert_eq!(shard.len(), padded / world);
            next = shard.end;
        }
        prop_assert_eq!(next, padded);
    }

    // Bucket ids follow forward order; each unit's buckets are exactly those
    // marked with it, in id order (the reduce-scatter order).
    let firsts: Vec<usize> = plan.buckets.iter().map(|b| b.params[0]).collect();
    prop_assert!(firsts.windows(2).all(|w| w[0] < w[1]));
    for (u, unit) in plan.units.iter().enumerate() {
        prop_assert_eq!(unit.index, u);
        let marked: Vec<usize> = plan
            .buckets
            .iter()
            .filter(|b| b.unit == Some(u))
            .map(|b| b.id)
            .collect();
        prop_assert_eq!(unit.buckets.to_vec(), marked);
    }

    if default_filter {
        // One unit per logical layer and per MTP depth.
        prop_assert_eq!(plan.units.len(), ast.logical() + ast.mtp.len());
        for (unit, logical) in plan.units.iter().zip(&plan.logical_layers) {
            prop_assert_eq!(
                unit.layers.to_vec(),
                logical.layers.clone().collect::<Vec<_>>()
            );
        }
    }

    // With every expert on this rank, the rank holds the whole model.
    if plan.layout.ep == 1 {
        let held: u64 = plan.params.iter().map(|p| plan.def(p).numel() as u64).sum();
        prop_assert_eq!(held, plan.total_params);
    }

    // Checkpoint keys unique on every EP rank.
    for rank in 0..plan.layout.ep {
        let keys: HashSet<String> = plan
            .params
            .iter()
            .map(|p| plan.checkpoint_key(p, rank))
            .collect();
        prop_assert_eq!(keys.len(), plan.params.len());
    }

    // The schedule runs every layer once, and the embedding, final norm and
    // each head exactly once.
    let mut layers = HashSet::new();
    let (mut embeds, mut norms, mut heads) = (0, 0, Vec::new());
    for node in plan.schedule.nodes.iter() {
        for slot in Slot::ALL {
            for op in node.ops(slot) {
                match op {
                    Op::Layer(l) | Op::MoePrepare(l) | Op::Mlp(l) => {
                        prop_assert!(layers.insert(l), "{:?} twice", l);
                    }
                    Op::Embed => embeds += 1,
                    Op::FinalNorm => norms += 1,
                    Op::Head(h) => heads.push(h),
                    _ => {}
                }
            }
        }
    }
    let mtp_layers: usize = ast.mtp.iter().map(Vec::len).sum();
    prop_assert_eq!(layers.len(), ast.physical() + mtp_layers);
    prop_assert_eq!((embeds, norms), (1, 1));
    let expected: Vec<Option<usize>> = std::iter::once(None)
        .chain((0..ast.mtp.len()).map(Some))
        .collect();
    prop_assert_eq!(heads, expected);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn plans_keep_every_bucket_and_unit_invariant(
        ast in ast(),
        layout in proptest::sample::select(LAYOUTS.to_vec()),
        filter in filter_choice(),
        cap in prop_oneof![Just(40_000_000usize), 1usize..20_000],
    ) {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = ast.canonical();
        let unit_filter = match &filter {
            FilterChoice::Default => UnitFilter::default(),
            FilterChoice::Kinds(kinds) => UnitFilter::parse_kinds(kinds).unwrap(),
        };
        let options = PlanOptions {
            layout: ParallelLayout::new(layout.0, layout.1),
            unit_filter,
            non_unit_bucket_cap: cap,
        };
        let parsed = Pattern::parse(&model.pattern).unwrap();
        if parsed.layers().next().is_none() && parsed.mtp_depths.is_empty() {
            // No layers at all: not a model (H028), and nothing else wrong.
            let codes = Plan::new(&model, &options).map(|_| ()).map_err(|d| d.codes());
            prop_assert_eq!(codes, Err(vec![Code::H028]));
            return Ok(());
        }
        let plan = Plan::new(&model, &options)
            .map_err(|d| TestCaseError::fail(format!("{}:\n{d}", model.pattern)))?;
        check_plan(&plan, &ast, matches!(filter, FilterChoice::Default))?;
    }
}

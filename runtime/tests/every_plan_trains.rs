//! The planner and the trainer agree, from the grammar up: every plan the
//! planner accepts either trains, or is refused before any work with a
//! coded reason (virtual stages that empty segments leave uneven over the
//! ranks); and where it trains, the
//! overlap schedule gives the plain schedule's bits and ZeRO-3 gives
//! no-shard's, step by step and in the final parameter hash.
//!
//! The inputs are generated: patterns of every symbol, grouped and
//! ungrouped, with and without MTP depths; every kind of unit choice (the
//! default, `group`, kind lists, mixes of both, the empty filter, which
//! leaves layers in no unit between units); `|` stage boundaries (empty
//! segments included) and pipeline parallelism, with and without virtual
//! stages; ranks, expert parallelism, schedule, sharding, recomputation and
//! precision. A case with stages also trains as one stage, and the two
//! agree: bit for bit, but for the sums pipeline parallelism groups
//! otherwise (docs/pipeline.md). The seed is fixed, so a
//! run is reproducible, and a failure is shrunk to a minimal case before it
//! is reported. `HYBRIDGEN_PLAN_CASES=N` runs N cases instead of the
//! default; `HYBRIDGEN_PLAN_SEED=S` draws another set.

use hybridgen_dsl::plan::{UnitFilter, UnitKind};
use hybridgen_dsl::{LayerKind, ModelConfig, ParallelLayout, Plan, PlanOptions};
use hybridgen_runtime::Precision;
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{TrainConfig, prepare, train_prepared};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

/// Cases that trained (not refused) in this process: the property must not
/// hold only because nearly every case was refused.
static TRAINED: AtomicU32 = AtomicU32::new(0);

/// Cases in the normal test run: a few hundred, seconds on two cores.
const DEFAULT_CASES: u32 = 400;

/// One item of a generated pattern: a layer or a group.
#[derive(Clone, Debug)]
enum Item {
    Layer(char),
    /// Pre-layers (at most one Mamba and one of the attention family, in
    /// either order) and an optional terminal (`-` or `E`) after them.
    Group(Vec<char>, Option<char>),
}

/// Which modules are FSDP units.
#[derive(Clone, Debug)]
enum Units {
    Default,
    Kinds(Vec<UnitKind>),
}

impl Units {
    fn filter(&self) -> UnitFilter {
        match self {
            Units::Default => UnitFilter::default(),
            Units::Kinds(kinds) => UnitFilter::kinds(kinds),
        }
    }
}

/// The `[dsa]` settings every case trains with (see [`Case::model`]).
const DSA_TOPK: usize = 4;
const DSA_COEFF: f32 = 0.01;

/// One generated run: a pattern, its units and a layout to train it on.
#[derive(Clone)]
struct Case {
    items: Vec<Item>,
    /// Each MTP depth's layers (every depth the same, as the grammar asks).
    mtp: Vec<char>,
    mtp_depths: usize,
    units: Units,
    /// Data-parallel ranks a stage.
    ranks: usize,
    ep: usize,
    /// Pipeline ranks, and where the `|`s go: before item `i` for each `i`
    /// listed (repeats make empty segments); `pp x` virtual stages of them.
    pp: usize,
    bars: Vec<usize>,
    micro_batches: usize,
    schedule: ScheduleKind,
    sharding: Sharding,
    recompute: Recompute,
    precision: Precision,
}

impl Case {
    fn pattern(&self) -> String {
        let mut out = String::new();
        for (i, item) in self.items.iter().enumerate() {
            for _ in self.bars.iter().filter(|&&b| b == i) {
                out.push('|');
            }
            match item {
                Item::Layer(c) => out.push(*c),
                Item::Group(pre, terminal) => {
                    out.push('[');
                    out.extend(pre.iter());
                    out.extend(terminal.iter());
                    out.push(']');
                }
            }
        }
        for _ in self.bars.iter().filter(|&&b| b >= self.items.len()) {
            out.push('|');
        }
        for _ in 0..self.mtp_depths {
            out.push('/');
            out.extend(self.mtp.iter());
        }
        out
    }

    /// The same model on one pipeline rank: no bars, every stage's ranks'
    /// data-parallel rank alone.
    fn one_stage(&self) -> Case {
        Case {
            pp: 1,
            bars: Vec::new(),
            ..self.clone()
        }
    }

    /// The training configuration of this case, on `schedule` and
    /// `sharding`.
    fn config(&self, schedule: ScheduleKind, sharding: Sharding) -> TrainConfig {
        let mut config = TrainConfig::new(self.model());
        config.steps = 2;
        config.micro_batches = self.micro_batches;
        config.micro_batch_size = 1;
        config.seq_length = 16;
        config.ranks = self.ranks * self.pp;
        config.ep = self.ep;
        config.pp = self.pp;
        config.schedule = schedule;
        config.sharding = sharding;
        config.recompute = self.recompute;
        config.precision = self.precision;
        config.unit_filter = self.units.filter();
        config
    }

    /// The tiny preset with this pattern, and its `D` layers' indexer
    /// choosing 4 of the 16 keys and trained (the preset keeps every key
    /// and leaves the indexer untrained).
    fn model(&self) -> ModelConfig {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = self.pattern();
        let dsa = model.dsa.as_mut().unwrap();
        dsa.index_topk = DSA_TOPK;
        dsa.indexer_loss_coeff = DSA_COEFF;
        model
    }

    fn plan(&self) -> Result<Plan, String> {
        let model = self.model();
        let options = PlanOptions {
            layout: ParallelLayout {
                pp: self.pp,
                ..ParallelLayout::new(self.ranks, self.ep)
            },
            unit_filter: self.units.filter(),
            ..PlanOptions::default()
        };
        Plan::new(&model, &options).map_err(|d| d.to_string())
    }
}

impl fmt::Debug for Case {
    /// As a command line, so a failure can be run again by hand.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = match &self.units {
            Units::Default => String::new(),
            Units::Kinds(kinds) => format!(
                " --units '{}'",
                kinds
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        };
        let recompute = match self.recompute {
            Recompute::None => "none".to_string(),
            Recompute::Full => "full".to_string(),
            Recompute::Layers(n) => n.to_string(),
            Recompute::Largest(n) => format!("largest:{n}"),
            Recompute::Auto => "auto".to_string(),
        };
        // The command line has no flags for `[dsa]`: a case with `D`
        // layers says what to put in a model file.
        let dsa = if self.pattern().contains('D') {
            format!(
                " (with the tiny preset's [dsa] index_topk = {DSA_TOPK}, indexer_loss_coeff = \
                 {DSA_COEFF}: --model)"
            )
        } else {
            String::new()
        };
        write!(
            f,
            "hybridgen train --device cpu --pattern '{}'{units} --ranks {} --ep {} --pp {} \
             --micro-batches {} --micro-batch-size 1 --seq-len 16 --steps 2 --schedule {} \
             --zero {} --recompute {recompute} --precision {}{dsa}",
            self.pattern(),
            self.ranks * self.pp,
            self.ep,
            self.pp,
            self.micro_batches,
            match self.schedule {
                ScheduleKind::Overlap => "overlap",
                ScheduleKind::Plain => "plain",
            },
            match self.sharding {
                Sharding::Zero3 => 3,
                Sharding::NoShard => 0,
            },
            match self.precision {
                Precision::F32 => "f32",
                Precision::Bf16 => "bf16",
            },
        )
    }
}

/// A layer symbol of the model's attention family (`*`, or `+` with `D`
/// beside it now and then: H009 keeps `*` and `D` apart), the dense and MoE
/// terminals, Mamba, and `G` now and then.
fn layer(attention: char) -> impl Strategy<Value = char> {
    let rare = if attention == '+' { 'D' } else { 'G' };
    prop_oneof![
        4 => Just('M'),
        4 => Just(attention),
        3 => Just('-'),
        4 => Just('E'),
        1 => Just(rare),
    ]
}

fn group(attention: char) -> impl Strategy<Value = Item> {
    let rare = if attention == '+' { 'D' } else { 'G' };
    (
        any::<bool>(),
        prop_oneof![4 => Just(Some(attention)), 1 => Just(Some(rare)), 2 => Just(None)],
        any::<bool>(),
        prop_oneof![Just(None), Just(Some('-')), Just(Some('E'))],
    )
        .prop_map(|(mamba, mixer, mamba_first, terminal)| {
            let mut pre: Vec<char> = mixer.into_iter().collect();
            if mamba {
                if mamba_first {
                    pre.insert(0, 'M');
                } else {
                    pre.push('M');
                }
            }
            if pre.is_empty() && terminal.is_none() {
                pre.push('M');
            }
            Item::Group(pre, terminal)
        })
}

fn item(attention: char) -> impl Strategy<Value = Item> {
    prop_oneof![
        3 => layer(attention).prop_map(Item::Layer),
        2 => group(attention),
    ]
}

fn units() -> impl Strategy<Value = Units> {
    let kinds = [
        UnitKind::Group,
        UnitKind::Mtp,
        UnitKind::Layer(LayerKind::Mamba),
        UnitKind::Layer(LayerKind::Attention),
        UnitKind::Layer(LayerKind::Mla),
        UnitKind::Layer(LayerKind::Dsa),
        UnitKind::Layer(LayerKind::Mlp),
        UnitKind::Layer(LayerKind::Moe),
    ];
    prop_oneof![
        1 => Just(Units::Default),
        1 => Just(Units::Kinds(vec![UnitKind::Group])),
        1 => Just(Units::Kinds(Vec::new())),
        3 => proptest::sample::subsequence(kinds.to_vec(), 1..=kinds.len()).prop_map(Units::Kinds),
    ]
}

/// (ranks, ep): ep divides the ranks and the tiny preset's 4 experts.
fn layout() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        2 => Just((1, 1)),
        2 => Just((2, 1)),
        4 => Just((2, 2)),
        1 => Just((4, 2)),
        1 => Just((4, 4)),
    ]
}

/// (pp, virtual stages a rank): one rank now and then with `|`s anyway.
fn pipeline() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        4 => Just((1, 1)),
        1 => Just((1, 2)),
        3 => Just((2, 1)),
        1 => Just((2, 2)),
        1 => Just((4, 1)),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![3 => Just('*'), 1 => Just('+')]
        .prop_flat_map(|attention| {
            (
                proptest::collection::vec(item(attention), 0..6),
                pipeline(),
                proptest::collection::vec(any::<u8>(), 8),
                proptest::collection::vec(layer(attention), 1..3),
                prop_oneof![3 => Just(0usize), 2 => Just(1), 1 => Just(2)],
                units(),
                layout(),
                1usize..4,
                prop_oneof![Just(ScheduleKind::Overlap), Just(ScheduleKind::Plain)],
                prop_oneof![Just(Sharding::Zero3), Just(Sharding::NoShard)],
                prop_oneof![
                    3 => Just(Recompute::None),
                    1 => Just(Recompute::Full),
                    1 => (1usize..4).prop_map(Recompute::Layers),
                ],
                prop_oneof![3 => Just(Precision::F32), 1 => Just(Precision::Bf16)],
            )
        })
        .prop_map(
            |(
                items,
                (pp, virtual_stages),
                cuts,
                mtp,
                mtp_depths,
                units,
                (ranks, ep),
                micro_batches,
                schedule,
                sharding,
                recompute,
                precision,
            )| {
                // Segments at item boundaries, so no bar cuts a group;
                // empty ones now and then.
                let segments = pp * virtual_stages;
                let mut bars: Vec<usize> = cuts
                    .iter()
                    .take(segments - 1)
                    .map(|&c| usize::from(c) % (items.len() + 1))
                    .collect();
                bars.sort_unstable();
                // Eight threads at most: pp 4 with two ranks a stage.
                let (ranks, ep) = if pp * ranks > 8 {
                    (2, ep.min(2))
                } else {
                    (ranks, ep)
                };
                // Interleaving takes micro-batches in groups of pp.
                let micro_batches = match virtual_stages {
                    1 => micro_batches,
                    _ => micro_batches.div_ceil(pp) * pp,
                };
                Case {
                    items,
                    mtp,
                    mtp_depths,
                    units,
                    ranks,
                    ep,
                    pp,
                    bars,
                    micro_batches,
                    schedule,
                    sharding,
                    recompute,
                    precision,
                }
            },
        )
        // A model needs a layer somewhere.
        .prop_filter("no layers", |c| !c.items.is_empty() || c.mtp_depths > 0)
}

/// Per step, the bits of the main, MTP, aux and indexer losses and the
/// gradient norm; then the final parameter hash.
type Curve = (Vec<[u64; 5]>, u64);

/// Trains `config`: `Ok(None)` when it was refused before any work (with
/// the refusal checked), the curve when it trained.
fn trained(config: &TrainConfig) -> Result<Option<Curve>, TestCaseError> {
    let prepared = match prepare(config) {
        Ok(prepared) => prepared,
        Err(e) => {
            // The one refusal a valid plan may meet here: virtual stages
            // that empty segments leave uneven over the ranks, named as
            // such, as the configuration's fault. Every layer kind trains
            // on the CPU.
            let message = e.to_string();
            prop_assert!(
                message.contains("different numbers of virtual stages"),
                "refused a plan it must train: {}",
                e
            );
            prop_assert_eq!(e.code(), "invalid_config", "{}", e);
            return Ok(None);
        }
    };
    let mut steps = Vec::new();
    let summary = train_prepared(&prepared, &mut |r| {
        steps.push([
            r.loss.to_bits(),
            r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
            r.aux_loss.to_bits(),
            r.indexer_loss.unwrap_or(f64::NAN).to_bits(),
            r.grad_norm.to_bits(),
        ])
    })
    .map_err(|e| TestCaseError::fail(format!("a plan that prepared failed to train: {e}")))?;
    prop_assert_eq!(steps.len(), 2);
    prop_assert!(
        steps.iter().all(|s| f64::from_bits(s[0]).is_finite()),
        "a non-finite loss"
    );
    // An indexer loss exactly when the model has `D` layers (their
    // coefficient is on), and then above 0.
    let dsa = config.model.pattern.contains('D');
    prop_assert!(
        steps.iter().all(|s| {
            let indexer = f64::from_bits(s[3]);
            if dsa {
                indexer.is_finite() && indexer > 0.0
            } else {
                indexer.is_nan()
            }
        }),
        "indexer losses {:?}",
        steps
            .iter()
            .map(|s| f64::from_bits(s[3]))
            .collect::<Vec<_>>()
    );
    Ok(Some((steps, summary.param_hash)))
}

fn other_schedule(kind: ScheduleKind) -> ScheduleKind {
    match kind {
        ScheduleKind::Overlap => ScheduleKind::Plain,
        ScheduleKind::Plain => ScheduleKind::Overlap,
    }
}

fn other_sharding(sharding: Sharding) -> Sharding {
    match sharding {
        Sharding::Zero3 => Sharding::NoShard,
        Sharding::NoShard => Sharding::Zero3,
    }
}

/// The property, for one case.
fn agrees(case: &Case) -> Result<(), TestCaseError> {
    // Generated patterns are valid by construction: the planner must take
    // every one.
    let plan = case
        .plan()
        .map_err(|e| TestCaseError::fail(format!("the planner refused a valid pattern: {e}")))?;
    let first = trained(&case.config(case.schedule, case.sharding))?;
    let Some(first) = first else {
        return Ok(());
    };
    let schedule = trained(&case.config(other_schedule(case.schedule), case.sharding))?;
    prop_assert_eq!(
        Some(&first),
        schedule.as_ref(),
        "the overlap and plain schedules disagree ({} units)",
        plan.units.len()
    );
    let sharding = trained(&case.config(case.schedule, other_sharding(case.sharding)))?;
    prop_assert_eq!(
        Some(&first),
        sharding.as_ref(),
        "ZeRO-3 and no-shard disagree ({} units)",
        plan.units.len()
    );
    if case.pp > 1 || !case.bars.is_empty() {
        let one = case.one_stage();
        let Some(alone) = trained(&one.config(case.schedule, case.sharding))? else {
            return Err(TestCaseError::fail("one stage refused what stages trained"));
        };
        stages_agree(&first, &alone, plan.shares_embedding())?;
    }
    TRAINED.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// A pipeline's curve against one stage's: the losses bit for bit and the
/// parameter hash; the aux and indexer losses' reports and the gradient
/// norm, which stages sum in other groups, to rounding. Where the last stage shares the
/// embedding, its gradient is summed in another order too: the first
/// step's losses are still equal, the rest to a tolerance.
fn stages_agree(staged: &Curve, alone: &Curve, shared: bool) -> Result<(), TestCaseError> {
    let close = |a: u64, b: u64, rel: f64| {
        let (a, b) = (f64::from_bits(a), f64::from_bits(b));
        (a.is_nan() && b.is_nan()) || (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
    };
    for (step, (s, a)) in staged.0.iter().zip(&alone.0).enumerate() {
        let exact = !shared || step == 0;
        for (i, what) in ["loss", "MTP loss"].into_iter().enumerate() {
            if exact {
                prop_assert_eq!(
                    s[i],
                    a[i],
                    "step {} {} with stages vs one stage",
                    step,
                    what
                );
            } else {
                prop_assert!(close(s[i], a[i], 1e-4), "step {} {}", step, what);
            }
        }
        let rel = if shared { 1e-4 } else { 1e-9 };
        prop_assert!(close(s[2], a[2], rel), "step {} aux loss", step);
        prop_assert!(close(s[3], a[3], rel), "step {} indexer loss", step);
        prop_assert!(close(s[4], a[4], rel), "step {} gradient norm", step);
    }
    if !shared {
        prop_assert_eq!(
            staged.1,
            alone.1,
            "final parameters with stages vs one stage"
        );
    }
    Ok(())
}

fn env_number(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    Some(
        text.parse()
            .unwrap_or_else(|_| panic!("{name}={text} is not a whole number")),
    )
}

#[test]
fn every_plan_the_planner_accepts_trains_and_the_schedules_agree() {
    let cases = env_number("HYBRIDGEN_PLAN_CASES").map_or(DEFAULT_CASES, |n| n as u32);
    let seed = env_number("HYBRIDGEN_PLAN_SEED").unwrap_or(0x4859_4252_4944);
    let mut runner = TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        // A shrink step trains up to three runs: bound the time spent.
        max_shrink_iters: 256,
        ..Config::default()
    });
    let result = runner.run(&case(), |case| agrees(&case));
    if let Err(e) = result {
        panic!("{e}\n(seed {seed}; HYBRIDGEN_PLAN_SEED and HYBRIDGEN_PLAN_CASES rerun it)");
    }
    let trained = TRAINED.load(Ordering::Relaxed);
    eprintln!("{trained} of {cases} cases trained; the others were refused as they must be");
    assert!(
        trained >= cases * 3 / 5,
        "only {trained} of {cases} cases trained: the generator must mostly make trainable plans"
    );
}

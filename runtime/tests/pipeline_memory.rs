//! The memory check on GPUs and under pipeline parallelism. On GPUs each
//! rank's need is checked against its own device. Under pipelines each
//! pipeline rank holds its stages' buckets and the activations of its
//! stages' layers only, so a stage needs less than a rank holding the whole
//! model; the refusal names the stage; `recompute: auto` settles so that
//! every stage fits.

use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions};
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::memory::{
    AvailableMemory, ElementSizes, FitHints, MemoryNeed, StateLayout, bytes, stage_state, state,
};
use hybridgen_runtime::optimizer::OptimizerKind;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::train::{GPU_OVERHEAD, TrainConfig, memory_need, prepare, train};

/// Eight layers without bars or groups: pp 2 splits them 4 + 4, pp 4
/// 2 + 2 + 2 + 2. `/*E` adds an MTP depth on the last stage, which then
/// shares the embedding with the first.
const PATTERNS: [&str; 2] = ["M*E-M*E-", "M*E-M*E-/*E"];

/// `pattern` with the tiny preset's dimensions on `pp` pipeline ranks of 2
/// data-parallel ranks (ep 1), the figure the check compares with fixed.
fn config(pattern: &str, pp: usize) -> TrainConfig {
    config_of("tiny", pattern, pp)
}

/// [`config`] with `preset`'s dimensions.
fn config_of(preset: &str, pattern: &str, pp: usize) -> TrainConfig {
    let mut model = ModelConfig::preset(preset).unwrap();
    model.pattern = pattern.to_string();
    let mut config = TrainConfig::new(model);
    config.pp = pp;
    config.ranks = 2 * pp;
    config.ep = 1;
    config.steps = 1;
    config.micro_batches = 8;
    config.micro_batch_size = 4;
    config.seq_length = 128;
    config.recompute = Recompute::None;
    config.memory_available = Some(16 << 30);
    config
}

fn plan_of(config: &TrainConfig) -> Plan {
    let options = PlanOptions {
        layout: ParallelLayout {
            pp: config.pp,
            ..ParallelLayout::new(config.ranks / config.pp, config.ep)
        },
        ..PlanOptions::default()
    };
    Plan::new(&config.model, &options).unwrap()
}

fn hints(config: &TrainConfig) -> FitHints {
    FitHints {
        micro_batch_size: config.micro_batch_size,
        seq_length: config.seq_length,
        sharding: config.sharding,
        optimizer: config.optimizer.kind,
        recompute: config.recompute,
    }
}

/// A stage holds a fraction of the model: every pipeline rank needs less
/// than the one rank of pp 1 (the benchmark model at one 4,096-token
/// sequence a micro-batch, its groups 4 + 4 and 2 + 2 + 2 + 2 a stage), and
/// the stages' parameters (and their shards) add up to the whole model's,
/// the shared embedding once more where the last stage needs it too.
#[test]
fn a_stage_needs_less_than_the_whole_model_and_the_stages_hold_it_all() {
    let groups = "[ME][*E][ME][*E][ME][*E][ME][*E]";
    for pattern in [groups.to_string(), format!("{groups}/*E")] {
        let at = |pp| {
            let mut c = config_of("bench-hybrid-moe", &pattern, pp);
            c.micro_batch_size = 1;
            c.seq_length = 4096;
            c
        };
        let whole = memory_need(&at(1), &plan_of(&at(1))).unwrap();
        assert_eq!(whole.pp, 1);
        assert!(whole.stages.is_empty());
        for pp in [2, 4] {
            let c = at(pp);
            let plan = plan_of(&c);
            let need = memory_need(&c, &plan).unwrap();
            let case = format!("{pattern} pp {pp}");
            assert_eq!(need.pp, pp, "{case}");
            assert_eq!(need.stages.len(), pp, "{case}");
            assert_eq!(need.ranks, 2 * pp, "{case}: thread ranks");
            for stage in &need.stages {
                assert!(
                    stage.per_rank < whole.per_rank,
                    "{case}: pipeline rank {} needs {} of a rank, the whole model {}",
                    stage.pp_rank,
                    stage.per_rank,
                    whole.per_rank
                );
                assert!(stage.state.total < whole.state.total, "{case}");
                assert!(stage.activations.total < whole.activations.total, "{case}");
                // One activation or gradient received at a time, or both.
                let tensor = (c.micro_batch_size * c.seq_length * 2048 * 4) as u64;
                assert!(
                    [tensor, 2 * tensor].contains(&stage.transfers),
                    "{case}: {}",
                    stage.transfers
                );
            }
            // The heads belong to the last stage; the first keeps the most
            // micro-batches in flight.
            let (first, last) = (&need.stages[0], &need.stages[pp - 1]);
            assert!(last.activations.heads > 0, "{case}");
            assert!(
                need.stages[..pp - 1]
                    .iter()
                    .all(|s| s.activations.heads == 0),
                "{case}"
            );
            assert!(
                first.live_micro_batches >= last.live_micro_batches,
                "{case}"
            );
            assert!(
                first.runs.contains("with the embedding"),
                "{case}: {}",
                first.runs
            );
            assert!(last.runs.contains("the heads"), "{case}: {}", last.runs);
            // The per-rank figures are the largest stage's; the process
            // holds every rank's share.
            let largest = need.stages.iter().map(|s| s.per_rank).max().unwrap();
            assert_eq!(need.per_rank, largest, "{case}");
            let sum: u64 = need.stages.iter().map(|s| s.per_rank).sum();
            assert_eq!(need.total, 2 * sum, "{case}");

            // Parameters: every bucket on one stage's rank, the shared
            // embedding on two.
            let shared = plan.shares_embedding();
            assert_eq!(shared, pattern.contains('/'), "{case}");
            let embedding = plan.buckets.iter().find(|b| plan.is_shared_bucket(b));
            assert_eq!(embedding.is_some(), shared, "{case}");
            let once = embedding.map_or(0, |b| b.numel as u64);
            let stages = plan.stage_memory();
            assert_eq!(stages.len(), pp, "{case}");
            let params: u64 = stages.iter().map(|s| s.params).sum();
            assert_eq!(params, plan.total_params + once, "{case}: parameters");
            // Their bytes, in the runtime's estimate and the planner's.
            let layout = StateLayout {
                sharding: Sharding::Zero3,
                ranks: 2,
                ep: 1,
                optimizer: OptimizerKind::Adam,
                resident_units: 2,
                grad_buffers: 2,
            };
            let sizes = ElementSizes::CPU;
            let all = state(&plan, layout, sizes);
            let shards: u64 = (0..pp)
                .map(|r| stage_state(&plan, r, layout, sizes).shards)
                .sum();
            // Parameter, master and gradient shards: 4 + 4 + 4 bytes an
            // element in f32 on 2 ranks.
            let shared_shard = embedding.map_or(0, |b| 12 * b.shard_numel(2) as u64);
            assert_eq!(shards, all.shards + shared_shard, "{case}: shards");
            let planned: u64 = stages.iter().map(|s| s.memory.param_shards).sum();
            let shard_bf16 = embedding.map_or(0, |b| 2 * b.shard_numel(2) as u64);
            assert_eq!(planned, plan.memory.param_shards + shard_bf16, "{case}");
            for s in &stages {
                assert!(s.memory.total < plan.memory.total, "{case}");
            }
        }
    }
}

/// Virtual stages: a pipeline rank holds and runs both of its stages.
#[test]
fn a_rank_of_virtual_stages_counts_both() {
    let mut c = config("M*|E-|ME|*-", 2);
    c.unit_filter = hybridgen_dsl::UnitFilter::parse_kinds("M,*").unwrap();
    let options = PlanOptions {
        layout: ParallelLayout {
            pp: 2,
            ..ParallelLayout::new(2, 1)
        },
        unit_filter: c.unit_filter.clone(),
        ..PlanOptions::default()
    };
    let plan = Plan::new(&c.model, &options).unwrap();
    let need = memory_need(&c, &plan).unwrap();
    let runs: Vec<&str> = need.stages.iter().map(|s| s.runs.as_str()).collect();
    assert_eq!(
        runs,
        [
            "stages 0, 2 (layers 0..2, 4..6) with the embedding",
            "stages 1, 3 (layers 2..4, 6..8) with the final norm and the heads",
        ]
    );
    let stages = plan.stage_memory();
    assert_eq!(stages[0].stages, [0, 2]);
    assert_eq!(stages[1].layers, [2..4, 6..8]);
    let params: u64 = stages.iter().map(|s| s.params).sum();
    assert_eq!(params, plan.total_params);
}

/// Without a pipeline, the planner's one entry is the plan's own figures.
#[test]
fn one_stage_is_the_plans_memory() {
    let c = config("M*E-M*E-/*E", 1);
    let plan = plan_of(&c);
    let stages = plan.stage_memory();
    assert_eq!(stages.len(), 1);
    assert_eq!(stages[0].memory, plan.memory);
    assert_eq!(stages[0].memory_plain, plan.memory_plain);
    assert!(stages[0].embedding && stages[0].heads);
    let numel: u64 = plan.buckets.iter().map(|b| b.numel as u64).sum();
    assert_eq!(stages[0].params, numel);
}

/// On GPUs each rank has a device of its own: a refusal names the
/// pipeline rank that does not fit, and the one that does.
#[test]
fn a_gpu_refusal_names_the_stage_that_does_not_fit() {
    let c = config("M*E-M*E-", 2);
    let need = memory_need(&c, &plan_of(&c))
        .unwrap()
        .on_one_gpu(GPU_OVERHEAD, 0);
    let (small, large) = {
        let mut stages: Vec<_> = need.stages.iter().collect();
        stages.sort_by_key(|s| s.per_rank);
        (stages[0], stages[1])
    };
    assert!(small.per_rank < large.per_rank);
    assert_eq!(need.total, large.per_rank + GPU_OVERHEAD);
    let free = |bytes| AvailableMemory {
        bytes,
        source: "free on cuda:0 (NVIDIA H100) of 79.1 GiB".into(),
    };
    assert_eq!(need.check(&free(need.total), &hints(&c)), None);
    let refusal = need
        .check(&free(small.per_rank + GPU_OVERHEAD), &hints(&c))
        .unwrap();
    println!("{refusal}");
    assert!(
        refusal.starts_with(&format!(
            "this run needs about {} of memory",
            bytes(need.total)
        )),
        "{refusal}"
    );
    let named = |s: &hybridgen_runtime::memory::StageNeed, verdict: &str| {
        format!("pipeline rank {}: {}, {verdict}", s.pp_rank, s.runs)
    };
    assert!(refusal.contains(&named(large, "does not fit")), "{refusal}");
    assert!(refusal.contains(&named(small, "fits")), "{refusal}");
    assert!(
        refusal.contains(&format!("on pipeline rank {}'s", large.pp_rank)),
        "{refusal}"
    );
    assert!(
        refusal.contains("more pipeline stages (now 2)"),
        "{refusal}"
    );
    assert!(!refusal.contains("the plain schedule"), "{refusal}");
}

/// `train` with pp 2 and too little memory is refused before any step,
/// every stage's figures named and the one that needs the most marked.
#[test]
fn a_pipelined_run_that_cannot_fit_is_refused_with_each_stages_figures() {
    let mut c = config("M*E-M*E-", 2);
    let need = memory_need(&c, &plan_of(&c)).unwrap();
    c.memory_available = Some(need.total - 1);
    let error = train(&c, &mut |r| panic!("step {} ran", r.step)).unwrap_err();
    assert_eq!(error.code(), "out_of_memory");
    let message = error.to_string();
    println!("{message}");
    assert!(
        message.starts_with(&format!(
            "this run needs about {} of memory",
            bytes(need.total)
        )),
        "{message}"
    );
    let largest = need
        .stages
        .iter()
        .find(|s| s.per_rank == need.per_rank)
        .unwrap();
    for stage in &need.stages {
        let line = format!("pipeline rank {}: {}", stage.pp_rank, stage.runs);
        assert!(message.contains(&line), "{line}: {message}");
        let figures = format!("per rank: {} = ", bytes(stage.per_rank));
        assert!(message.contains(&figures), "{figures}: {message}");
    }
    assert!(
        message.contains(&format!(
            "pipeline rank {}: {}, needs the most",
            largest.pp_rank, largest.runs
        )),
        "{message}"
    );
    assert!(
        message.contains("stage 0 (layers 0..4) with the embedding"),
        "{message}"
    );
    assert!(
        message.contains("stage 1 (layers 4..8) with the final norm and the heads"),
        "{message}"
    );
    assert!(
        message
            .contains("4 thread ranks in this process (2 pipeline ranks of 2 data-parallel ranks)"),
        "{message}"
    );
    // It fits with exactly what it needs.
    c.memory_available = Some(need.total);
    assert_eq!(prepare(&c).unwrap().memory, need);
}

/// `recompute: auto` settles on the fewest layers with which every stage
/// fits, as without a pipeline.
#[test]
fn auto_recomputation_settles_for_the_stages() {
    let mut c = config("M*E-M*E-", 2);
    c.micro_batch_size = 8;
    c.seq_length = 256;
    let plan = plan_of(&c);
    let need = |recompute| {
        let mut c = c.clone();
        c.recompute = recompute;
        memory_need(&c, &plan).unwrap().total
    };
    let candidates = 6;
    let needs: Vec<u64> = (0..=candidates)
        .map(|n| need(Recompute::Largest(n)))
        .collect();
    assert!(
        needs.windows(2).all(|w| w[1] <= w[0]) && needs[candidates] < needs[0],
        "recomputing layers needs less: {needs:?}"
    );
    c.recompute = Recompute::Auto;
    for n in [0, 2, candidates] {
        // The fewest layers with which it fits.
        let fewest = (0..=candidates).find(|&k| needs[k] <= needs[n]).unwrap();
        c.memory_available = Some(needs[n]);
        let prepared = prepare(&c).unwrap();
        let settled = match fewest {
            0 => Recompute::None,
            k if k == candidates => Recompute::Full,
            k => Recompute::Largest(k),
        };
        assert_eq!(prepared.config.recompute, settled, "{} bytes", needs[n]);
        assert_eq!(prepared.memory.total, needs[fewest]);
        assert_eq!(prepared.memory.stages.len(), 2);
    }
}

/// The bound made from the pattern before planning stays below the full
/// estimate under a pipeline, in a process of every rank and on a GPU.
#[test]
fn the_bound_before_planning_stays_below_a_pipelines_need() {
    for pattern in PATTERNS {
        for pp in [2, 4] {
            let c = config(pattern, pp);
            let layout = StateLayout {
                sharding: c.sharding,
                ranks: c.ranks / pp,
                ep: c.ep,
                optimizer: c.optimizer.kind,
                resident_units: 0,
                grad_buffers: 0,
            };
            let tokens = hybridgen_runtime::backend::Tokens::new(c.micro_batch_size, c.seq_length);
            let bound = MemoryNeed::lower_bound(
                &c.model,
                layout,
                tokens,
                2,
                ElementSizes::CPU,
                c.recompute,
            )
            .unwrap()
            .over_pipeline(pp);
            let need = memory_need(&c, &plan_of(&c)).unwrap();
            let case = format!("{pattern} pp {pp}");
            assert_eq!(bound.ranks, c.ranks, "{case}");
            assert!(
                bound.total <= need.total,
                "{case}: {} > {}",
                bound.total,
                need.total
            );
            let (bound, need) = (
                bound.on_one_gpu(GPU_OVERHEAD, 1 << 20),
                need.on_one_gpu(GPU_OVERHEAD, 1 << 20),
            );
            assert!(
                bound.total <= need.total,
                "{case}: {} > {}",
                bound.total,
                need.total
            );
            let refusal = bound
                .check(
                    &AvailableMemory {
                        bytes: 0,
                        source: "none".into(),
                    },
                    &hints(&c),
                )
                .unwrap();
            assert!(refusal.starts_with("this run needs at least"), "{refusal}");
            assert!(
                refusal.contains(&format!("a pipeline rank's share on average over {pp}")),
                "{refusal}"
            );
        }
    }
}

/// On GPUs each rank has a device of its own: the need checked is one
/// rank's plus what the device itself takes, against the GPU's free memory,
/// and the refusal says so (and does not suggest fewer thread ranks).
#[test]
fn a_gpu_run_is_checked_per_gpu_with_the_devices_overhead() {
    let config = TrainConfig::new(ModelConfig::preset("tiny").unwrap());
    let plan = Plan::new(
        &config.model,
        &PlanOptions {
            layout: ParallelLayout::new(config.ranks, config.ep),
            ..PlanOptions::default()
        },
    )
    .unwrap();
    let need = memory_need(&config, &plan).unwrap();
    assert_eq!(
        need.total,
        need.per_rank * 2,
        "two thread ranks share the host"
    );
    // A GPU kernel scratch below the CPU's changes nothing.
    let per_gpu = need.clone().on_one_gpu(GPU_OVERHEAD, 0);
    assert_eq!(per_gpu.total, need.per_rank + GPU_OVERHEAD);
    let hints = FitHints {
        micro_batch_size: config.micro_batch_size,
        seq_length: config.seq_length,
        sharding: Sharding::Zero3,
        optimizer: OptimizerKind::Adam,
        recompute: config.recompute,
    };
    let free = |bytes| AvailableMemory {
        bytes,
        source: "free on cuda:0 (NVIDIA H200) of 139.8 GiB".into(),
    };
    assert_eq!(per_gpu.check(&free(per_gpu.total), &hints), None);
    let refusal = per_gpu.check(&free(GPU_OVERHEAD), &hints).unwrap();
    assert!(refusal.contains("each GPU rank, plus 1.2 GiB"), "{refusal}");
    assert!(refusal.contains("free on cuda:0"), "{refusal}");
    assert!(refusal.contains("more GPUs"), "{refusal}");
    assert!(!refusal.contains("fewer ranks"), "{refusal}");
}

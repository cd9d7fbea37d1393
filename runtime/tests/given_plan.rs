//! A plan made before the run (a `model!` model's, assembled from its
//! `const` tables) is trained as it is: the same run as planning at run
//! time, and refused when it is not the run's plan.

use hybridgen_dsl::{ModelConfig, ParallelLayout, Plan, PlanOptions, UnitFilter};
use hybridgen_runtime::train::{TrainConfig, train};

fn model() -> ModelConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = "M[*E]-/*E".into();
    model
}

fn short(mut config: TrainConfig) -> TrainConfig {
    config.steps = 2;
    config.micro_batches = 2;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config
}

fn plan(ranks: usize, ep: usize, filter: UnitFilter) -> Plan {
    let options = PlanOptions {
        layout: ParallelLayout::new(ranks, ep),
        unit_filter: filter,
        ..PlanOptions::default()
    };
    Plan::new(&model(), &options).unwrap()
}

fn losses_and_hash(config: &TrainConfig) -> (Vec<u64>, u64) {
    let mut losses = Vec::new();
    let summary =
        train(config, &mut |r| losses.push(r.loss.to_bits())).unwrap_or_else(|e| panic!("{e}"));
    (losses, summary.param_hash)
}

#[test]
fn a_given_plan_trains_as_planning_at_run_time_does() {
    let given = short(TrainConfig::from_plan(plan(2, 2, UnitFilter::default())));
    assert_eq!((given.ranks, given.ep), (2, 2));
    let mut planned = short(TrainConfig::new(model()));
    (planned.ranks, planned.ep) = (2, 2);
    assert_eq!(losses_and_hash(&given), losses_and_hash(&planned));
}

#[test]
fn the_given_plans_units_are_the_ones_trained() {
    // Other units change the buckets, so the sums, so the bits: the run must
    // take the plan's units, not plan its own from `unit_filter`.
    let kinds = UnitFilter::kinds(&[hybridgen_dsl::plan::UnitKind::Layer(
        hybridgen_dsl::LayerKind::Mamba,
    )]);
    let mut given = short(TrainConfig::from_plan(plan(2, 2, kinds.clone())));
    given.unit_filter = UnitFilter::default();
    let mut planned = short(TrainConfig::new(model()));
    (planned.ranks, planned.ep, planned.unit_filter) = (2, 2, kinds);
    assert_eq!(losses_and_hash(&given), losses_and_hash(&planned));
}

#[test]
fn a_plan_for_another_layout_or_model_is_refused() {
    let mut config = short(TrainConfig::from_plan(plan(2, 2, UnitFilter::default())));
    config.ranks = 4;
    let err = train(&config, &mut |_| {}).unwrap_err().to_string();
    assert!(
        err.contains("made for 2 data-parallel ranks, the run has 4"),
        "{err}"
    );

    let mut config = short(TrainConfig::from_plan(plan(2, 2, UnitFilter::default())));
    config.ep = 1;
    let err = train(&config, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("ep = 2, the run has 1"), "{err}");

    let mut config = short(TrainConfig::from_plan(plan(2, 2, UnitFilter::default())));
    config.model.hidden_size *= 2;
    let err = train(&config, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("its model differs"), "{err}");
}

//! The `const` tables `model!` emits equal the planner's run-time plan for
//! the same input: definition by definition, parameter by parameter (owner,
//! bucket, offset), bucket by bucket (padded lengths and shards for several
//! world sizes), unit by unit, node by node and slot by slot. And the
//! generated unit filter agrees with the planner's rule.

use hybridgen::dsl::LayerKind;
use hybridgen::dsl::plan::{Module, ModuleKind, Slot};
use hybridgen::{ParallelLayout, Plan, PlanOptions, StaticModel, UnitFilter};
use std::borrow::Cow;

hybridgen::model! { struct Grouped { preset: "tiny", pattern: "[*E][*E]", ep: 2 } }
hybridgen::model! { struct Mixed { preset: "tiny", pattern: "M[*E]M-[*E]" } }
hybridgen::model! { struct Ungrouped { preset: "tiny", pattern: "M*E-", ep: 4 } }
hybridgen::model! { struct WithMtp { preset: "tiny", pattern: "[M*E](M[*E]){2}/*E/*E", ep: 2 } }
hybridgen::model! { struct Piped { preset: "tiny", pattern: "M[*E]|M-|[GE]|G-", pp: 2 } }
hybridgen::model! {
    struct Kinds {
        preset: "tiny",
        pattern: "M[+E]M-[DE]/G-",
        unit_kinds: ["E", "mtp"],
        non_unit_bucket_cap: 20_000,
    }
}
hybridgen::model! { struct Nano9b { preset: "nemotron-nano-9b-v2" } }
hybridgen::model! { struct Nano30b { preset: "nemotron-3-nano-30b-a3b", ep: 8 } }
hybridgen::model! { struct Nano30bNoEp { preset: "nemotron-3-nano-30b-a3b" } }

/// The planner's plan for the declaration, with the planner's own filter.
fn planner_plan<M: StaticModel>(dp: usize) -> Plan {
    let options = PlanOptions {
        layout: ParallelLayout {
            dp,
            ep: M::EP,
            pp: M::PP,
            first_stage_layers: None,
            last_stage_layers: None,
        },
        unit_filter: match M::UNIT_KINDS {
            Some(kinds) => UnitFilter::kinds(kinds),
            None => UnitFilter::default(),
        },
        non_unit_bucket_cap: M::NON_UNIT_BUCKET_CAP,
    };
    Plan::new(&M::config(), &options).expect("the declaration plans")
}

fn assert_agrees<M: StaticModel>() {
    let dp = M::EP * 2;
    let plan = planner_plan::<M>(dp);
    let name = M::NAME;
    assert_eq!(plan.param_defs.len(), M::PARAM_DEFS.len(), "{name}: defs");
    for (i, (run, built)) in plan.param_defs.iter().zip(M::PARAM_DEFS).enumerate() {
        assert_eq!(run, built, "{name}: definition {i}");
    }
    assert_eq!(plan.params.len(), M::PARAMS.len(), "{name}: params");
    for (i, (run, built)) in plan.params.iter().zip(M::PARAMS).enumerate() {
        assert_eq!(run, built, "{name}: parameter {i} ({})", M::PARAM_NAMES[i]);
        assert_eq!(plan.param_name(run), M::PARAM_NAMES[i], "{name}: name {i}");
    }
    assert_eq!(plan.buckets.len(), M::BUCKETS.len(), "{name}: buckets");
    for (run, built) in plan.buckets.iter().zip(M::BUCKETS) {
        assert_eq!(run, built, "{name}: bucket {}", run.id);
        for world in [1, 2, 3, 8, 64] {
            assert_eq!(run.padded_numel(world), built.padded_numel(world));
            for rank in 0..world {
                assert_eq!(run.shard_range(world, rank), built.shard_range(world, rank));
            }
        }
    }
    assert_eq!(plan.units.as_ref(), M::UNITS, "{name}: units");
    assert_eq!(plan.stages.as_slice(), M::STAGES, "{name}: stages");
    assert_eq!(plan.schedule, M::SCHEDULE, "{name}: schedule");
    assert_eq!(plan.schedule.nodes.len(), M::SLOT_TABLES.len());
    for (node, table) in plan.schedule.nodes.iter().zip(M::SLOT_TABLES) {
        for slot in Slot::ALL {
            assert_eq!(
                node.ops(slot).as_slice(),
                table.ops(slot),
                "{name}: node {} slot {}",
                node.index,
                slot.name()
            );
        }
    }
    // The generated filter, through the generated `plan`, gives the same plan.
    let generated = M::plan(&ParallelLayout {
        dp,
        ep: M::EP,
        pp: M::PP,
        first_stage_layers: None,
        last_stage_layers: None,
    })
    .expect("the declared layout plans");
    assert_eq!(
        generated.units, plan.units,
        "{name}: generated filter units"
    );
    assert_eq!(
        generated.buckets, plan.buckets,
        "{name}: generated filter buckets"
    );
    // `plan` is assembled from the tables, not planned again: the tables are
    // borrowed as they are, and everything else equals the planner's plan.
    for (what, borrowed) in [
        ("params", matches!(generated.params, Cow::Borrowed(_))),
        (
            "param_defs",
            matches!(generated.param_defs, Cow::Borrowed(_)),
        ),
        ("units", matches!(generated.units, Cow::Borrowed(_))),
        ("buckets", matches!(generated.buckets, Cow::Borrowed(_))),
        (
            "schedule",
            matches!(generated.schedule.nodes, Cow::Borrowed(_)),
        ),
    ] {
        assert!(
            borrowed,
            "{name}: the generated plan's {what} are not the const table"
        );
    }
    assert_eq!(generated.params, plan.params, "{name}: params");
    assert_eq!(generated.param_defs, plan.param_defs, "{name}: defs");
    assert_eq!(generated.schedule, plan.schedule, "{name}: schedule");
    assert_eq!(generated.stages, plan.stages, "{name}: stages");
    assert_eq!(generated.layers, plan.layers, "{name}: layers");
    assert_eq!(
        generated.logical_layers, plan.logical_layers,
        "{name}: logical layers"
    );
    assert_eq!(generated.mtp_layers, plan.mtp_layers, "{name}: MTP layers");
    assert_eq!(generated.model, plan.model, "{name}: model");
    assert_eq!(
        (generated.total_params, generated.active_params),
        (plan.total_params, plan.active_params),
        "{name}: totals"
    );
    assert_eq!(generated.memory, plan.memory, "{name}: memory");
    assert_eq!(
        generated.memory_plain, plan.memory_plain,
        "{name}: memory (plain)"
    );
}

#[test]
fn grouped_mixed_and_ungrouped_agree() {
    assert_agrees::<Grouped>();
    assert_agrees::<Mixed>();
    assert_agrees::<Ungrouped>();
    assert_eq!(grouped::UNITS.len(), 2);
    assert_eq!(mixed::UNITS.len(), 5);
    assert_eq!(ungrouped::UNITS.len(), 4);
}

#[test]
fn mtp_pipeline_and_unit_kinds_agree() {
    assert_agrees::<WithMtp>();
    assert_agrees::<Piped>();
    assert_agrees::<Kinds>();
}

#[test]
fn nemotron_presets_agree() {
    assert_agrees::<Nano9b>();
    assert_agrees::<Nano30b>();
    assert_agrees::<Nano30bNoEp>();
    assert_eq!(nano9b::TOTAL_PARAMS, 8_888_227_328);
    assert_eq!(nano30b::TOTAL_PARAMS, 31_577_937_344);
}

#[test]
fn layer_structs_point_at_their_parameters() {
    let model = Mixed::new();
    for handle in [
        model.layer_1.attention,
        model.layer_1.moe,
        model.layer_0.mamba,
    ] {
        for i in handle.params() {
            assert!(
                mixed::PARAM_NAMES[i].starts_with(handle.path),
                "{}",
                mixed::PARAM_NAMES[i]
            );
        }
        assert!(!handle.params().is_empty());
    }
    assert_eq!(model.layer_1.slots(), mixed::SLOT_TABLES[1]);
    assert_eq!(model.layer_4.module.path, "decoder.layers.4");
    let with_mtp = WithMtp::new();
    assert_eq!(with_mtp.mtp_1.module.path, "mtp.layers.1");
    assert_eq!(
        with_mtp.mtp_1.attention.path,
        "mtp.layers.1.mtp_model_layer.layers.0"
    );
}

#[test]
fn a_layout_other_than_the_declared_one_is_refused() {
    let error = Grouped::plan(&ParallelLayout::new(4, 4)).unwrap_err();
    assert_eq!(error.codes(), [hybridgen::Code::H023]);
}

/// The generated typed filter answers exactly as the planner's rule does,
/// for every kind of module and every set of member kinds up to three.
#[test]
fn generated_unit_filters_agree_with_the_planner_rule() {
    let default = UnitFilter::default();
    let kinds = UnitFilter::kinds(kinds::UNIT_KINDS.unwrap());
    let mut sets: Vec<Vec<LayerKind>> = vec![Vec::new()];
    for a in LayerKind::ALL {
        sets.push(vec![a]);
        for b in LayerKind::ALL {
            sets.push(vec![a, b]);
            for c in LayerKind::ALL {
                sets.push(vec![a, b, c]);
            }
        }
    }
    for kind in [
        ModuleKind::Embedding,
        ModuleKind::Layer,
        ModuleKind::Group,
        ModuleKind::FinalNorm,
        ModuleKind::MtpDepth,
        ModuleKind::OutputLayer,
    ] {
        for set in &sets {
            let module = Module {
                path: "x",
                kind,
                layer_kinds: set,
            };
            assert_eq!(
                mixed::is_unit(&module),
                default.is_unit(&module),
                "{module:?}"
            );
            assert_eq!(
                kinds::is_unit(&module),
                kinds.is_unit(&module),
                "{module:?}"
            );
        }
    }
    for unit in mixed::UNITS {
        assert_eq!(mixed::unit_of_path(&unit.name), Some(unit.index));
    }
    assert_eq!(mixed::unit_of_path("decoder.layers.1.layers.0"), None);
    assert_eq!(mixed::unit_of_path("embedding"), None);
}

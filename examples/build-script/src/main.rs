//! Uses the module `build.rs` generated from `models/hybrid-moe.toml`.
//!
//! Run with `cargo run -p hybridgen-example-build-script`.

hybridgen::include_model!("hybrid_moe");

use hybridgen::dsl::plan::Slot;

fn main() {
    let model = HybridMoe::new();
    println!(
        "{} `{}`: {} layers, {} FSDP units, {} buckets, {} parameters",
        hybrid_moe::NAME,
        hybrid_moe::CANONICAL_PATTERN,
        hybrid_moe::PHYSICAL_LAYERS,
        hybrid_moe::UNITS.len(),
        hybrid_moe::BUCKETS.len(),
        hybrid_moe::TOTAL_PARAMS,
    );

    // Typed layers: the group `[*E]` at logical index 1 is an
    // `AttentionMoeGroup` whose fields name its members.
    let group: hybrid_moe::AttentionMoeGroup = model.layer_1;
    println!(
        "{} (unit {:?}): attention params {:?}, MoE params {:?}",
        group.module.path,
        group.module.unit,
        group.attention.params(),
        group.moe.params(),
    );
    for slot in Slot::ALL {
        println!("  {:>16}: {:?}", slot.name(), group.slots().ops(slot));
    }

    // Bucket layouts are fixed at build time; only the shard-group size is
    // a run-time number, and the padding is a `const fn` of it.
    const WORLD: usize = 4;
    for bucket in hybrid_moe::BUCKETS {
        // Expert buckets are sharded over the expert-data-parallel group.
        let world = if bucket.expert {
            WORLD / hybrid_moe::EP
        } else {
            WORLD
        };
        println!(
            "bucket {:>2} unit {:?} expert {:<5} {:>6} elements -> padded {:>6} over {world} ranks, rank 1 owns {:?}",
            bucket.id,
            bucket.unit,
            bucket.expert,
            bucket.numel,
            bucket.padded_numel(world),
            bucket.shard_range(world, 1),
        );
    }

    // The run-time planner agrees with the static tables.
    match HybridMoe::plan(&HybridMoe::layout(WORLD)) {
        Ok(plan) => assert_eq!(plan.buckets.as_ref(), hybrid_moe::BUCKETS),
        Err(diagnostics) => {
            eprintln!("{diagnostics}");
            std::process::exit(1);
        }
    }
    println!("run-time plan == build-time tables");
}

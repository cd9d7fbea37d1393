//! Declares a small hybrid model with `hybridgen::model!` and looks at what
//! the build planned: typed layers, FSDP units, bucket layouts, the overlap
//! schedule's slots, and the run-time plan agreeing with all of it.
//!
//! Run with `cargo run --example macro_model`.

use hybridgen::dsl::plan::Slot;

hybridgen::model! {
    /// Mamba layers between grouped attention + MoE layers, a dense MLP at
    /// the end, and one multi-token-prediction depth; two expert-parallel
    /// ranks.
    pub struct Hybrid {
        preset: "tiny",
        pattern: "(M [*E]){2} - / *E",
        moe: { num_experts: 4, top_k: 2 },
        ep: 2,
    }
}

fn main() {
    println!(
        "`{}`: {} physical / {} logical layers, {} MTP depth, {} parameters ({} active)",
        hybrid::CANONICAL_PATTERN,
        hybrid::PHYSICAL_LAYERS,
        hybrid::LOGICAL_LAYERS,
        hybrid::MTP_DEPTHS,
        hybrid::TOTAL_PARAMS,
        hybrid::ACTIVE_PARAMS,
    );

    // One struct per layer shape; a group's struct names its members.
    let model = Hybrid::new();
    let group: hybrid::AttentionMoeGroup = model.layer_1;
    println!(
        "\n{} is FSDP unit {:?}; its MoE member `{}` owns parameters {:?}:",
        group.module.path,
        group.module.unit,
        group.moe.path,
        group.moe.params()
    );
    for i in group.moe.params() {
        let param = hybrid::PARAMS[i];
        let def = &hybrid::PARAM_DEFS[param.def];
        println!(
            "  {:<64} {:?} bucket {} offset {}",
            hybrid::PARAM_NAMES[i],
            def.shape,
            param.bucket,
            param.offset
        );
    }
    println!("its overlap-schedule slots:");
    for slot in Slot::ALL {
        println!("  {:>16}: {:?}", slot.name(), group.slots().ops(slot));
    }

    // The unit filter is generated code.
    for path in [
        "decoder.layers.1",
        "decoder.layers.1.layers.0",
        "mtp.layers.0",
        "embedding",
    ] {
        println!("is_unit_path({path:?}) = {}", hybrid::is_unit_path(path));
    }

    // Buckets: offsets fixed at build time, padding a `const fn` of the
    // shard group size.
    const DP: usize = 8;
    const FIRST_PADDED: usize = hybrid::padded_numel(0, DP);
    println!("\nbucket 0 is padded to {FIRST_PADDED} elements over {DP} ranks");
    for bucket in hybrid::BUCKETS {
        let world = if bucket.expert { DP / hybrid::EP } else { DP };
        println!(
            "bucket {:>2}: unit {:?}, {:>6}, {:>6} elements, padded {:>6} over {world}, rank 0 owns {:?}",
            bucket.id,
            bucket.unit,
            if bucket.expert { "expert" } else { "dense" },
            bucket.numel,
            bucket.padded_numel(world),
            bucket.shard_range(world, 0),
        );
    }

    // The same model planned at run time (as the runtime would) agrees.
    match Hybrid::plan(&Hybrid::layout(DP)) {
        Ok(plan) => {
            assert_eq!(plan.buckets.as_ref(), hybrid::BUCKETS);
            assert_eq!(plan.params.as_ref(), hybrid::PARAMS);
            println!("\nrun-time plan == build-time tables");
        }
        Err(diagnostics) => {
            eprintln!("{diagnostics}");
            std::process::exit(1);
        }
    }
}

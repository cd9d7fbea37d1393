//! Trains a model declared with `hybridgen::model!`, from Rust: the library
//! path next to the `hybridgen train` command line.
//!
//! Run with `cargo run --release --example train_declared_model`.

use hybridgen::runtime::train::{TrainConfig, train};

hybridgen::model! {
    /// Two grouped attention + MoE layers between Mamba layers, with the
    /// `tiny` preset's dimensions, planned for two expert-parallel ranks.
    pub struct Small {
        preset: "tiny",
        pattern: "M[*E]M[*E]",
        ep: 2,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = TrainConfig::new(Small::config());
    config.ranks = 2;
    config.ep = small::EP;
    config.steps = 40;

    // The runtime plans the model again at run time; it is the plan the
    // build already laid out, bucket by bucket.
    let plan = Small::plan(&Small::layout(config.ranks))?;
    assert_eq!(plan.buckets.as_ref(), small::BUCKETS);
    println!(
        "training `{}`: {} parameters in {} FSDP units",
        small::CANONICAL_PATTERN,
        small::TOTAL_PARAMS,
        plan.units.len()
    );

    let summary = train(&config, &mut |step| {
        if step.step % 10 == 0 {
            println!("step {:>3}  loss {:.4}", step.step, step.loss);
        }
    })?;
    println!(
        "{:.0} tokens/s; parameter hash {:016x}; data entropy floor {:.4}",
        summary.tokens_per_second,
        summary.param_hash,
        summary.entropy_floor.unwrap_or(f64::NAN)
    );
    Ok(())
}

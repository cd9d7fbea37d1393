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
    // The plan is the one the build laid out: `plan` assembles it from the
    // generated `const` tables, and the runtime trains it as it is.
    let plan = Small::plan(&Small::layout(2))?;
    println!(
        "training `{}`: {} parameters in {} FSDP units, {} buckets",
        small::CANONICAL_PATTERN,
        small::TOTAL_PARAMS,
        plan.units.len(),
        plan.buckets.len()
    );
    let mut config = TrainConfig::from_plan(plan);
    config.steps = 40;

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

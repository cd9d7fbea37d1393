//! Turns `models/hybrid-moe.toml` into `$OUT_DIR/hybridgen/hybrid_moe.rs`:
//! the same module `hybridgen::model!` would generate, planned for two
//! expert-parallel ranks. Cargo re-runs this when the model file changes.

use hybridgen::build::ModelFile;

fn main() {
    let model = ModelFile::new("models/hybrid-moe.toml").ep(2);
    if let Err(error) = hybridgen::build::compile(&model) {
        // Cargo shows a failing build script's stderr: the planner's report
        // with the culprit's line and column.
        eprintln!("{error}");
        std::process::exit(1);
    }
}

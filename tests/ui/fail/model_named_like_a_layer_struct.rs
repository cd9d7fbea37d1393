// a model named like one of its generated layer structs: one error, at the
// name, and nothing from the stub that stands in for the module.
hybridgen::model! {
    pub struct MambaLayer {
        preset: "tiny",
        pattern: "M*",
    }
}

fn main() {
    let _ = MambaLayer::new();
    let _ = mamba_layer::BUCKETS.len();
}

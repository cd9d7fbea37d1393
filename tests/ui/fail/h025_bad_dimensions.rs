// h025 bad dimensions: the error points at the culprit and carries its code.
hybridgen::model! {
    pub struct Model {
        preset: "tiny",
        pattern: "M*E",
        attention: { num_kv_groups: 3 },
    }
}

fn main() {
    // The stub module keeps uses of the model free of follow-up errors.
    let _ = Model::new();
    let _ = model::BUCKETS.len();
}

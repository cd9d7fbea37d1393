// h028 a model without layers: an empty pattern is valid, but not a model.
hybridgen::model! {
    pub struct Model {
        preset: "tiny",
        pattern: "",
    }
}

fn main() {
    // The stub module keeps uses of the model free of follow-up errors.
    let _ = Model::new();
    let _ = model::BUCKETS.len();
}

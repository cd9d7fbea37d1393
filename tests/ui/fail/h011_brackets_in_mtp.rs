// h011 brackets in mtp: the error points at the culprit and carries its code.
hybridgen::model! {
    pub struct Model {
        preset: "tiny",
        pattern: "M*/[ME]",
    }
}

fn main() {
    // The stub module keeps uses of the model free of follow-up errors.
    let _ = Model::new();
    let _ = model::BUCKETS.len();
}

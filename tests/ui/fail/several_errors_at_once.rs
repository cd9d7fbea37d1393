// several errors at once: the error points at the culprit and carries its code.
hybridgen::model! {
    pub struct Model {
        preset: "tiny",
        pattern: "M[*E]x",
        moe: { top_k: 9 },
        seq_lenght: 10,
    }
}

fn main() {
    // The stub module keeps uses of the model free of follow-up errors.
    let _ = Model::new();
    let _ = model::BUCKETS.len();
}

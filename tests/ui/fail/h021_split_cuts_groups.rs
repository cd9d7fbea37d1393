// h021 split cuts groups: a split with an explicit first stage (2 + 5 + 5
// layers) cuts two groups; each is named at its place, with the split.
hybridgen::model! {
    pub struct Model {
        preset: "tiny",
        pattern: "[M*E][M*E][M*E][M*E]",
        pp: 3,
        first_stage_layers: 2,
    }
}

fn main() {
    // The stub module keeps uses of the model free of follow-up errors.
    let _ = Model::new();
    let _ = model::BUCKETS.len();
}

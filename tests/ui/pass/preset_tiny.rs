hybridgen::model! {
    /// The `tiny` preset as it is.
    pub struct Tiny {
        preset: "tiny",
    }
}

fn main() {
    assert_eq!(Tiny::config(), hybridgen::ModelConfig::preset("tiny").unwrap());
}

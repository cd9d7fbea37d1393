// A model is declared like a struct.
hybridgen::model! {
    enum Model { pattern: "M*" }
}

fn main() {}

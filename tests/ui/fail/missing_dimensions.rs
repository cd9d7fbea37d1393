// Without a preset every required dimension must be declared.
hybridgen::model! {
    struct Bare {
        pattern: "M*",
        mamba: { num_heads: 4 },
    }
}

fn main() {}

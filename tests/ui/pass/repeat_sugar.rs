hybridgen::model! {
    struct Repeated {
        preset: "tiny",
        pattern: "(M[*E]){4} -{2}",
    }
}

fn main() {
    assert_eq!(repeated::CANONICAL_PATTERN, "M[*E]M[*E]M[*E]M[*E]--");
    assert_eq!(repeated::PHYSICAL_LAYERS, 14);
    assert_eq!(repeated::LOGICAL_LAYERS, 10);
}

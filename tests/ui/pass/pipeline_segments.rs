hybridgen::model! {
    struct Piped {
        preset: "tiny",
        pattern: "M[*E]|M[*E]",
        pp: 2,
    }
}

fn main() {
    assert_eq!(piped::STAGES.len(), 2);
    assert_eq!(piped::STAGES[1].pp_rank, 1);
    assert_eq!(piped::STAGES[1].logical, 2..4);
    let _ = Piped::new();
}

hybridgen::model! {
    pub struct Nemotron3Nano30bA3b {
        preset: "nemotron-3-nano-30b-a3b",
        ep: 8,
    }
}

fn main() {
    assert_eq!(nemotron3_nano30b_a3b::TOTAL_PARAMS, 31_577_937_344);
    assert_eq!(nemotron3_nano30b_a3b::LOCAL_EXPERTS, 16);
}

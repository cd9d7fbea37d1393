hybridgen::model! {
    pub struct NemotronNano9bV2 {
        preset: "nemotron-nano-9b-v2",
    }
}

fn main() {
    assert_eq!(nemotron_nano9b_v2::TOTAL_PARAMS, 8_888_227_328);
    assert_eq!(nemotron_nano9b_v2::PHYSICAL_LAYERS, 56);
}

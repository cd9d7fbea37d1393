hybridgen::model! {
    /// Two GPT-like layers: each group `[*E]` is one logical layer and one FSDP unit.
    pub struct Grouped {
        preset: "tiny",
        pattern: "[*E][*E]",
    }
}

fn main() {
    assert_eq!(grouped::UNITS.len(), 2);
    assert_eq!(grouped::LOGICAL_LAYERS, 2);
    let model = Grouped::new();
    assert_eq!(model.layer_1.attention.path, "decoder.layers.1.layers.0");
    assert_eq!(model.layer_1.moe.path, "decoder.layers.1.layers.1");
    assert!(grouped::is_unit_path("decoder.layers.1"));
    assert!(!grouped::is_unit_path("decoder.layers.1.layers.0"));
}

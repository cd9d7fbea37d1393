hybridgen::model! {
    pub(crate) struct Mixed {
        preset: "tiny",
        pattern: "M[*E]M[*E]",
        ep: 2,
    }
}

fn main() {
    assert_eq!(mixed::UNITS.len(), 4);
    assert_eq!(mixed::LOCAL_EXPERTS, 2);
    let model = Mixed::new();
    // Layers are typed by shape: `M` is a `MambaLayer`, `[*E]` an `AttentionMoeGroup`.
    let group: mixed::AttentionMoeGroup = model.layer_1;
    assert_eq!(group.module.path, "decoder.layers.1");
    assert_eq!(group.module.unit, Some(1));
    let mamba: mixed::MambaLayer = model.layer_0;
    assert_eq!(mamba.mamba.kind, hybridgen::dsl::LayerKind::Mamba);
}

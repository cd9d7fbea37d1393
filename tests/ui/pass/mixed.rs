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
    assert_eq!(mixed::Layer1::PATH, "decoder.layers.1");
    assert_eq!(mixed::Layer1::UNIT, Some(1));
    assert_eq!(Mixed::new().layer_0.mamba.kind, hybridgen::dsl::LayerKind::Mamba);
}

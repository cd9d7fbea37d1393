hybridgen::model! {
    struct WithMtp {
        preset: "tiny",
        pattern: "[M*E][M*E]/*E",
    }
}

fn main() {
    use hybridgen::dsl::plan::{Op, Slot};
    assert_eq!(with_mtp::MTP_DEPTHS, 1);
    let model = WithMtp::new();
    assert_eq!(model.mtp_0.attention.path, "mtp.layers.0.mtp_model_layer.layers.0");
    assert_eq!(model.mtp_0.module.unit, Some(2));
    assert_eq!(model.mtp_0.module.path, "mtp.layers.0");
    assert!(with_mtp::SLOT_TABLES.iter().any(|t| t.ops(Slot::MtpPostProcess).contains(&Op::Head(Some(0)))));
}

hybridgen::model! {
    struct Ungrouped {
        preset: "tiny",
        pattern: "M*E",
    }
}

fn main() {
    assert_eq!(ungrouped::UNITS.len(), 3);
    // Buckets are laid out at build time; only the world size is a run-time number.
    const PADDED: usize = ungrouped::BUCKETS[1].padded_numel(8);
    assert_eq!(PADDED % (8 * 128), 0);
    let _ = Ungrouped::default();
}

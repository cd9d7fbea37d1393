hybridgen::model! {
    /// Dimensions written out, attributes passed through.
    #[cfg(not(any()))]
    pub struct Custom {
        pattern: "M * -",
        hidden_size: 32,
        vocab_size: 1000,
        tie_embeddings: true,
        init_std: 0.01,
        attention: { num_heads: 4, num_kv_groups: 2, position: "rope", qk_norm: true },
        mamba: {
            /// Doc comments on fields are allowed.
            num_heads: 2,
            head_dim: 16,
            num_groups: 1,
            state_size: 8,
        },
        mlp: { ffn_hidden_size: 64, activation: swiglu },
        unit_kinds: ["M", "-"],
        non_unit_bucket_cap: 1_000,
    }
}

fn main() {
    let config = Custom::config();
    assert_eq!(config.vocab_size, 1000);
    assert_eq!(custom::UNITS.len(), 2);
    assert!(custom::is_unit_path("decoder.layers.0"));
    assert!(!custom::is_unit_path("decoder.layers.1"));
    let plan = Custom::plan(&Custom::layout(4)).unwrap();
    assert_eq!(plan.buckets.as_ref(), custom::BUCKETS);
}

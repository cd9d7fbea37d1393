//! Hugging Face interop as transformers' `qwen3_next`: checkpoint -> folder
//! -> checkpoint is bit-identical in f32 (groups, dense and MoE layers, tied
//! embeddings, rotary or no positions, `Hv/Hk` of 1 and 2); the folder holds
//! qwen3_next's layouts (per-key-head `in_proj_qkvz`/`in_proj_ba`, zero
//! gates with doubled projections, zero-centred norms); what qwen3_next
//! cannot compute is refused, naming the layer or tensor, with nothing
//! written; and transformers' loss on an export of the `tiny-gdn` preset
//! (tests/fixtures/hf/qwen3-next-tiny-gdn.json, written by
//! scripts/hf_check.py) is hybridgen's.

use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::config::{Activation, MlpConfig, Position, ScoreFunction};
use hybridgen_runtime::checkpoint::CheckpointReader;
use hybridgen_runtime::hf::{self, HfDtype};
use hybridgen_runtime::train::{TrainConfig, train};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[path = "support/checkpoints.rs"]
mod checkpoints;
use checkpoints::{param_bits, trained};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hybridgen-q3n-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// tiny-gdn (qk-norm, rotary, softmax routing, SwiGLU experts), on
/// `pattern`, with a SwiGLU MLP for `-` layers.
fn tiny_gdn(pattern: &str) -> ModelConfig {
    let mut model = ModelConfig::preset("tiny-gdn").unwrap();
    model.pattern = pattern.to_string();
    model.seq_length = 16;
    model.mlp = Some(MlpConfig {
        ffn_hidden_size: 48,
        activation: Activation::Swiglu,
    });
    model
}

fn read_f32(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap_or_else(|_| panic!("{name} missing"))
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn checkpoint_to_qwen3_next_to_checkpoint_is_bit_identical_in_f32() {
    for (name, pattern, edit) in [
        ("preset", "[GE][GE][GE][*E]", None),
        ("dense", "G-[*E]G-*E", Some(())),
    ] {
        let dir = scratch(&format!("round-{name}"));
        let mut model = tiny_gdn(pattern);
        if edit.is_some() {
            // No positions (rotary fraction 0), tied embeddings, one
            // value head a key head, top-1 routing.
            model.tie_embeddings = true;
            model.attention.as_mut().unwrap().position = Position::None;
            model.gdn.as_mut().unwrap().value_heads = 2;
            model.moe.as_mut().unwrap().top_k = 1;
        }
        let ckpt = trained(&dir, model.clone());
        let out = dir.join("hf");
        hf::export(&ckpt, &out, HfDtype::F32).unwrap();
        let config: Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["model_type"], "qwen3_next", "{pattern}");
        let (back, imported) =
            hf::import_checkpoint(&out, &dir.join("back"), Some(pattern)).unwrap();
        assert_eq!(imported.pattern, pattern);
        assert_eq!(param_bits(&ckpt), param_bits(&back), "{pattern}");
        // Flat (the default), the same values under the flat keys.
        let (flat, _) = hf::import_checkpoint(&out, &dir.join("flat"), None).unwrap();
        let values = |p: Vec<(String, Vec<u32>)>| {
            let mut v: Vec<Vec<u32>> = p.into_iter().map(|(_, v)| v).collect();
            v.sort();
            v
        };
        assert_eq!(
            values(param_bits(&ckpt)),
            values(param_bits(&flat)),
            "{pattern}"
        );
        // The model reads back as itself (the sections its pattern uses).
        let mut want = model;
        want.pattern = imported.pattern.clone();
        want.seq_length = imported.seq_length;
        want.mla = None;
        want.dsa = None;
        want.mamba = None;
        if !pattern.contains('-') {
            want.mlp = None;
        }
        assert_eq!(imported, want, "{pattern}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_folder_holds_qwen3_next_layouts() {
    let dir = scratch("layout");
    let ckpt = trained(&dir, tiny_gdn("GE*E"));
    let out = dir.join("hf");
    hf::export(&ckpt, &out, HfDtype::F32).unwrap();
    let reader = CheckpointReader::open(&ckpt, "c").unwrap();
    let ours = |k: &str| reader.param(k).unwrap();
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let theirs = |n: &str| read_f32(&st, n);
    let h = 64;
    // Hk = 2, Hv = 4, dk = dv = 16: hybridgen's rows [q 32 | k 32 | v 64 |
    // z 64 | b 4 | a 4]; qwen3_next's per key head [q 16 | k 16 | v 32 | z 32].
    let w = ours("decoder.layers.0.self_attention.in_proj.weight");
    let row = |r: usize| &w[r * h..(r + 1) * h];
    let qkvz = theirs("model.layers.0.linear_attn.in_proj_qkvz.weight");
    let hf_row = |r: usize| &qkvz[r * h..(r + 1) * h];
    assert_eq!(hf_row(0), row(0)); // q of key head 0
    assert_eq!(hf_row(16), row(32)); // k of key head 0
    assert_eq!(hf_row(32), row(64)); // v of value head 0
    assert_eq!(hf_row(64), row(128)); // z of value head 0
    assert_eq!(hf_row(96), row(16)); // q of key head 1
    assert_eq!(hf_row(128), row(96)); // v of value head 2
    assert_eq!(hf_row(160), row(160)); // z of value head 2
    let ba = theirs("model.layers.0.linear_attn.in_proj_ba.weight");
    // Per key head [b b | a a].
    assert_eq!(&ba[..h], row(192));
    assert_eq!(&ba[2 * h..3 * h], row(196));
    assert_eq!(&ba[4 * h..5 * h], row(194));
    assert_eq!(&ba[7 * h..8 * h], row(199));
    // Zero-centred norms: w - 1.
    let norm = ours("decoder.layers.0.self_attention.in_proj.layer_norm_weight");
    let stored = theirs("model.layers.0.input_layernorm.weight");
    assert!(norm.iter().any(|w| *w != 1.0), "the norm never trained");
    for (w, e) in norm.iter().zip(&stored) {
        assert_eq!(1.0 + e, *w);
    }
    // The gated output norm is not zero-centred.
    assert_eq!(
        theirs("model.layers.0.linear_attn.norm.weight"),
        ours("decoder.layers.0.self_attention.out_norm.weight")
    );
    // Attention: per head [q | zero gate]; o_proj doubled.
    let qkv = ours("decoder.layers.2.self_attention.linear_qkv.weight");
    let q = theirs("model.layers.1.self_attn.q_proj.weight");
    let c = 16;
    // Head 2 is the first of KV group 1 (fused rows 64..80).
    assert_eq!(&q[4 * c * h..5 * c * h], &qkv[64 * h..80 * h]);
    assert!(q[5 * c * h..6 * c * h].iter().all(|v| *v == 0.0));
    let proj = ours("decoder.layers.2.self_attention.linear_proj.weight");
    let o = theirs("model.layers.1.self_attn.o_proj.weight");
    assert!(proj.iter().zip(&o).all(|(w, d)| 2.0 * w == *d));
    // The shared expert: its gate zero, its down projection doubled.
    assert!(
        theirs("model.layers.0.mlp.shared_expert_gate.weight")
            .iter()
            .all(|v| *v == 0.0)
    );
    let down = ours("decoder.layers.1.mlp.shared_experts.linear_fc2.weight");
    let d = theirs("model.layers.0.mlp.shared_expert.down_proj.weight");
    assert!(down.iter().zip(&d).all(|(w, x)| 2.0 * w == *x));
    // Experts one tensor each, SwiGLU's [gate | up] split.
    let fc1 = ours("decoder.layers.3.mlp.experts.linear_fc1.weight3");
    assert_eq!(
        theirs("model.layers.1.mlp.experts.3.up_proj.weight"),
        fc1[64 * h..]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn what_qwen3_next_cannot_compute_is_refused_before_anything_is_written() {
    type Edit = Box<dyn Fn(&mut ModelConfig)>;
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "GGE-",
            Box::new(|_| {}),
            &["decoder layer 1 is `G`", "`G` or `*`) followed by"],
        ),
        (
            "GE*",
            Box::new(|_| {}),
            &["decoder layer 2 is `*`", "no MLP after it"],
        ),
        (
            "GEG-/*E",
            Box::new(|_| {}),
            &["MTP depths", "without `/...`"],
        ),
        (
            "GE*E",
            Box::new(|m| m.attention.as_mut().unwrap().qk_norm = false),
            &["`qk_norm = true`"],
        ),
        (
            "GE",
            Box::new(|m| m.moe.as_mut().unwrap().score_function = ScoreFunction::Sigmoid),
            &["score_function = \"softmax\""],
        ),
        (
            "GE",
            Box::new(|m| m.moe.as_mut().unwrap().activation = Activation::SquaredRelu),
            &["[moe] uses activation `squared_relu`"],
        ),
        (
            "GE",
            Box::new(|m| m.moe.as_mut().unwrap().shared_expert_ffn_hidden_size = None),
            &["shared_expert_ffn_hidden_size"],
        ),
        (
            "GE",
            Box::new(|m| m.moe.as_mut().unwrap().topk_scaling_factor = 2.5),
            &["topk_scaling_factor = 1"],
        ),
    ];
    for (pattern, edit, wants) in cases {
        let mut model = tiny_gdn(pattern);
        edit(&mut model);
        let err = hf::dry_run(&model, HfDtype::F32).unwrap_err().to_string();
        for want in wants {
            assert!(err.contains(want), "{pattern}: {err}");
        }
        // A `G` pattern names qwen3_next as its only model type.
        assert!(err.contains("qwen3_next"), "{pattern}: {err}");
    }
    // Neither model type: both reasons.
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = "M*".into();
    model.attention.as_mut().unwrap().position = Position::Rope;
    let err = hf::dry_run(&model, HfDtype::F32).unwrap_err().to_string();
    assert!(
        err.contains("neither") && err.contains("nemotron_h") && err.contains("qwen3_next"),
        "{err}"
    );
    assert!(err.contains("decoder layer 0 is `M`"), "{err}");
    // From a checkpoint: nothing is written.
    let dir = scratch("refused");
    let mut model = tiny_gdn("GE");
    model.attention.as_mut().unwrap().qk_norm = false;
    model.pattern = "GE*E".into();
    let ckpt = trained(&dir, model);
    let out = dir.join("hf");
    assert!(hf::export(&ckpt, &out, HfDtype::F32).is_err());
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of export `from` at `to` with element `at` of tensor `name` set
/// to `value`.
fn with_element(from: &Path, to: &Path, name: &str, at: usize, value: f32) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let (_, _, data) = tensors.iter_mut().find(|(n, _, _)| n == name).unwrap();
    data[4 * at..4 * at + 4].copy_from_slice(&value.to_le_bytes());
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        to.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
}

#[test]
fn gates_hybridgen_lacks_import_only_when_zero() {
    let dir = scratch("gates");
    let ckpt = trained(&dir, tiny_gdn("GE*E"));
    let out = dir.join("hf");
    hf::export(&ckpt, &out, HfDtype::F32).unwrap();
    let gate = "model.layers.0.mlp.shared_expert_gate.weight";
    let q = "model.layers.1.self_attn.q_proj.weight";
    for (case, name, at, want) in [
        (
            "shared",
            gate,
            3,
            "tensor `model.layers.0.mlp.shared_expert_gate.weight` element 3 is 2.5e-1",
        ),
        // Head 0's rows: 16 query rows, then 16 gate rows (h = 64).
        (
            "q-gate",
            q,
            16 * 64 + 5,
            "tensor `model.layers.1.self_attn.q_proj.weight` element 1029 is 2.5e-1",
        ),
    ] {
        let bad = dir.join(case);
        with_element(&out, &bad, name, at, 0.25);
        let back = dir.join(format!("{case}-back"));
        let err = hf::import_checkpoint(&bad, &back, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err}");
        assert!(!back.exists());
    }
    // A query row of q_proj is a weight like any other.
    let fine = dir.join("q-row");
    with_element(&out, &fine, q, 5, 0.25);
    hf::import_checkpoint(&fine, &dir.join("q-row-back"), None).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// transformers' loss on the export of tiny-gdn after 20 steps (the
/// fixture, from scripts/hf_check.py) is hybridgen's own, to 1e-5.
#[test]
fn transformers_computes_hybridgens_loss_on_a_tiny_gdn_export() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/qwen3-next-tiny-gdn.json");
    let fixture: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let dir = scratch("fixture");
    let mut config = TrainConfig::new(ModelConfig::preset("tiny-gdn").unwrap());
    config.steps = fixture["steps"].as_u64().unwrap();
    config.save = Some(dir.join("ckpt"));
    train(&config, &mut |_| {}).unwrap();
    let out = dir.join("hf");
    hf::export(&dir.join("ckpt"), &out, HfDtype::F32).unwrap();
    let tokens: Vec<u32> = fixture["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let check = hf::loss_check(&out, tokens.len() - 1, 0).unwrap();
    assert_eq!(check.tokens, tokens);
    // The same run as the fixture's (`train --preset tiny-gdn --steps 20`).
    let recorded = fixture["hybridgen_loss"].as_f64().unwrap();
    assert!(
        (check.loss - recorded).abs() <= 1e-6 * recorded,
        "hybridgen's loss {} is not the fixture's {recorded}: the run differs",
        check.loss
    );
    let theirs = fixture["transformers_loss"].as_f64().unwrap();
    let rel = (check.loss - theirs).abs() / theirs.abs();
    assert!(
        rel < 1e-5,
        "hybridgen {} (fixture {}), transformers {theirs}: {rel:e}",
        check.loss,
        fixture["hybridgen_loss"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The config.json transformers writes when it saves a loaded export of
/// tiny-gdn again (`save_pretrained`, with the fields it adds) imports as
/// the same model as the export's own.
#[test]
fn a_config_transformers_saved_again_imports_as_the_same_model() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf/qwen3-next-tiny-gdn-resaved-config.json");
    let saved: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let ours = hf::to_hf_config(&ModelConfig::preset("tiny-gdn").unwrap(), HfDtype::F32)
        .unwrap()
        .0;
    assert_eq!(
        hf::from_hf_config(&saved, "saved").unwrap(),
        hf::from_hf_config(&ours, "ours").unwrap()
    );
    if let Ok(dir) = std::env::var("HYBRIDGEN_QWEN3_NEXT_RESAVED") {
        // A whole folder transformers saved (not in the repository).
        let dir = PathBuf::from(dir);
        let scratch = scratch("resaved");
        hf::import_checkpoint(&dir, &scratch.join("back"), None).unwrap();
        let _ = std::fs::remove_dir_all(&scratch);
    }
}

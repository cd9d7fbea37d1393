//! Hugging Face interop through the library: checkpoint -> Hugging Face
//! folder -> checkpoint is bit-identical in f32 (bf16: the rounded values),
//! for patterns with every exportable kind, groups, MTP, shared experts and
//! tied embeddings, from checkpoints written by two ranks with experts
//! split over them; and everything that cannot be mapped is refused, naming
//! the tensor or field, with nothing written.

use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::config::{Position, ScoreFunction};
use hybridgen_runtime::checkpoint::CheckpointReader;
use hybridgen_runtime::hf::{self, HfDtype};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[path = "support/checkpoints.rs"]
mod checkpoints;
use checkpoints::{params, trained};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hybridgen-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny preset as transformers' nemotron_h can compute it: attention
/// without rotary positions, sigmoid routing.
fn tiny_hf(pattern: &str) -> ModelConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    model.seq_length = 16;
    model.attention.as_mut().unwrap().position = Position::None;
    let moe = model.moe.as_mut().unwrap();
    moe.score_function = ScoreFunction::Sigmoid;
    // transformers' router always has the correction bias, so an import
    // routes with one: the round trips train theirs (a rate large enough
    // to move it in two steps) and carry it both ways.
    moe.expert_bias = true;
    moe.expert_bias_update_rate = 0.05;
    model
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn checkpoint_to_hf_to_checkpoint_is_bit_identical_in_f32() {
    for (name, pattern, tied) in [
        ("tiny", "M[*E]M-[*E]", false),
        ("flat", "M*-E", false),
        ("mtp", "[M*E]-/*E/*E", false),
        ("tied", "ME*-", true),
    ] {
        let dir = scratch(&format!("round-{name}"));
        let mut model = tiny_hf(pattern);
        model.tie_embeddings = tied;
        let ckpt = trained(&dir, model);
        let out = dir.join("hf");
        let report = hf::export(&ckpt, &out, HfDtype::F32).unwrap();
        assert_eq!(report.step, 3);
        let (back, imported) = hf::import_checkpoint(&out, &dir.join("back"), None).unwrap();
        let (before, after) = (params(&ckpt), params(&back));
        assert_eq!(before.len(), after.len(), "{pattern}: the keys differ");
        // The trained expert biases are carried, not zeros.
        assert!(
            before
                .iter()
                .any(|(k, v)| k.ends_with("expert_bias") && v.iter().any(|x| *x != 0.0)),
            "{pattern}: no expert bias moved in training"
        );
        let same = |a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|((ka, va), (kb, vb))| ka == kb && bits(va) == bits(vb))
        };
        if pattern.contains('[') {
            // Groups flatten on export; imported with the original pattern
            // (regrouped), every key and value is the original's.
            assert!(!imported.pattern.contains('['));
            let (regrouped, _) =
                hf::import_checkpoint(&out, &dir.join("regrouped"), Some(pattern)).unwrap();
            assert!(same(&before, &params(&regrouped)), "{pattern} regrouped");
            let flat: usize = after.iter().map(|(_, v)| v.len()).sum();
            let grouped: usize = before.iter().map(|(_, v)| v.len()).sum();
            assert_eq!(flat, grouped, "{pattern}");
        } else {
            assert!(same(&before, &after), "{pattern}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_bf16_export_imports_as_the_bf16_rounded_values() {
    let dir = scratch("bf16");
    let ckpt = trained(&dir, tiny_hf("M*E-"));
    let out = dir.join("hf");
    hf::export(&ckpt, &out, HfDtype::Bf16).unwrap();
    let (back, _) = hf::import_checkpoint(&out, &dir.join("back"), None).unwrap();
    let mut changed = 0;
    let (before, after) = (params(&ckpt), params(&back));
    assert_eq!(before.len(), after.len(), "the keys differ");
    for ((k, a), (_, b)) in before.iter().zip(&after) {
        // transformers keeps the router's correction bias in f32.
        let rounded: Vec<f32> = if k.ends_with("expert_bias") {
            a.clone()
        } else {
            a.iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect()
        };
        assert_eq!(bits(&rounded), bits(b), "{k}");
        changed += usize::from(bits(a) != bits(b));
    }
    assert!(
        changed > 0,
        "bf16 rounded nothing: the test cannot see a bf16 export"
    );
    let header = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&header).unwrap();
    assert_eq!(
        st.tensor("backbone.layers.1.mixer.q_proj.weight")
            .unwrap()
            .dtype(),
        Dtype::BF16
    );
    assert_eq!(
        st.tensor("backbone.layers.2.mixer.gate.e_score_correction_bias")
            .unwrap()
            .dtype(),
        Dtype::F32
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_split_attention_projections_hold_megatrons_interleaved_rows() {
    // a = 4 heads, g = 2 KV groups, c = 16: fused rows per group are
    // [q q | k | v]; q_proj must be groups' q rows in order, and so on.
    let dir = scratch("qkv");
    let ckpt = trained(&dir, tiny_hf("*E"));
    let out = dir.join("hf");
    hf::export(&ckpt, &out, HfDtype::F32).unwrap();
    let fused = CheckpointReader::open(&ckpt, "c")
        .unwrap()
        .param("decoder.layers.0.self_attention.linear_qkv.weight")
        .unwrap();
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let read = |name: &str| -> Vec<f32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let h = 64;
    let row = |r: usize| &fused[r * h..(r + 1) * h];
    let q = read("backbone.layers.0.mixer.q_proj.weight");
    let k = read("backbone.layers.0.mixer.k_proj.weight");
    let v = read("backbone.layers.0.mixer.v_proj.weight");
    // q head 2 (the first head of group 1) is fused row 64.
    assert_eq!(&q[32 * h..33 * h], row(64));
    assert_eq!(&k[16 * h..17 * h], row(96));
    assert_eq!(&v[..h], row(48));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of export `from` at `to` with its tensors changed by `edit`
/// (name -> (dtype, shape, bytes)) and its config by `config`.
fn mutated(
    from: &Path,
    to: &Path,
    edit: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
    config: impl FnOnce(&mut serde_json::Map<String, Value>),
) {
    std::fs::create_dir_all(to).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(
        to.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let mut c: Value =
        serde_json::from_slice(&std::fs::read(from.join("config.json")).unwrap()).unwrap();
    config(c.as_object_mut().unwrap());
    std::fs::write(to.join("config.json"), c.to_string()).unwrap();
}

#[test]
fn what_cannot_be_mapped_is_refused_by_name_before_anything_is_written() {
    let dir = scratch("refusals");
    let ckpt = trained(&dir, tiny_hf("M*E-"));
    let out = dir.join("hf");
    hf::export(&ckpt, &out, HfDtype::F32).unwrap();
    let d = "backbone.layers.0.mixer.D";
    type Edit = Box<dyn FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>)>;
    type ConfigEdit = Box<dyn FnOnce(&mut serde_json::Map<String, Value>)>;
    let none = || -> ConfigEdit { Box::new(|_| {}) };
    let keep = || -> Edit { Box::new(|_| {}) };
    let cases: Vec<(&str, Edit, ConfigEdit, &[&str])> = vec![
        (
            "missing",
            Box::new(move |t| {
                t.remove(d);
            }),
            none(),
            &["has no tensor `backbone.layers.0.mixer.D`"],
        ),
        (
            "misshapen",
            Box::new(move |t| {
                t.insert(d.into(), (Dtype::F32, vec![5], vec![0; 20]));
            }),
            none(),
            &["`backbone.layers.0.mixer.D` is [5]", "needs [4]"],
        ),
        (
            "dtype",
            Box::new(move |t| {
                t.insert(d.into(), (Dtype::I8, vec![4], vec![0; 4]));
            }),
            none(),
            &["`backbone.layers.0.mixer.D`", "dtype I8"],
        ),
        (
            "extra",
            Box::new(|t| {
                t.insert(
                    "backbone.layers.0.mixer.extra".into(),
                    (Dtype::F32, vec![1], vec![0; 4]),
                );
            }),
            none(),
            &["`backbone.layers.0.mixer.extra`"],
        ),
        (
            "unknown-field",
            keep(),
            Box::new(|c| {
                c.insert("frobnicate".into(), Value::from(3));
            }),
            &["`frobnicate` is not a field hybridgen models"],
        ),
        (
            "scaling",
            keep(),
            Box::new(|c| {
                c.insert("routed_scaling_factor".into(), Value::from(0.0));
            }),
            &["`routed_scaling_factor` is 0", "a number above 0"],
        ),
        (
            "kind",
            keep(),
            Box::new(|c| {
                c.insert("hybrid_override_pattern".into(), Value::from("M*E+"));
            }),
            &["`hybrid_override_pattern`", "`+`"],
        ),
        (
            "kind-dsa",
            keep(),
            Box::new(|c| {
                c.insert("hybrid_override_pattern".into(), Value::from("M*ED"));
            }),
            &["`hybrid_override_pattern`", "`D`"],
        ),
        (
            "layers",
            keep(),
            Box::new(|c| {
                c.insert("num_hidden_layers".into(), Value::from(5));
            }),
            &["`num_hidden_layers` is 5", "4 layers"],
        ),
        (
            "width",
            keep(),
            Box::new(|c| {
                c.insert("mamba_head_dim".into(), Value::from(8));
            }),
            &[
                "`backbone.layers.0.mixer.conv1d.weight` is [128, 1, 4]",
                "needs [96, 1, 4]",
            ],
        ),
    ];
    for (name, edit, config, wants) in cases {
        let folder = dir.join(format!("hf-{name}"));
        mutated(&out, &folder, edit, config);
        let target = dir.join(format!("ckpt-{name}"));
        let err = hf::import_checkpoint(&folder, &target, None)
            .unwrap_err()
            .to_string();
        for want in wants {
            assert!(err.contains(want), "{name}: `{want}` not in: {err}");
        }
        assert!(
            !target.exists(),
            "{name}: the import wrote {}",
            target.display()
        );
    }
    // A pattern may regroup, not change, the layers.
    let err = hf::import_checkpoint(&out, &dir.join("ckpt-pattern"), Some("M*E"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("may regroup"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn exports_transformers_cannot_compute_are_refused_with_nothing_written() {
    let dir = scratch("export-refusals");
    // The tiny preset itself: rotary attention and softmax routing.
    let mut tiny = ModelConfig::preset("tiny").unwrap();
    tiny.seq_length = 16;
    let ckpt = trained(&dir, tiny.clone());
    let out = dir.join("hf");
    let err = hf::export(&ckpt, &out, HfDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("position = \"rope\""), "{err}");
    assert!(!out.exists() && !dir.join("hf.partial").exists());
    for (model, want) in [
        (
            {
                let mut m = tiny_hf("M*E");
                m.moe.as_mut().unwrap().score_function = ScoreFunction::Softmax;
                m
            },
            "score_function = \"sigmoid\"",
        ),
        (tiny_hf("M+E"), "decoder layer 1 is `+`"),
        (tiny_hf("M/G"), "MTP layer 0 is `G`"),
        (
            tiny_hf("M[DE]"),
            "decoder layer 1 is `D` (DeepSeek sparse attention)",
        ),
        (tiny_hf("M-/D"), "MTP layer 0 is `D`"),
        (
            {
                let mut m = tiny_hf("M*E");
                m.moe.as_mut().unwrap().shared_expert_ffn_hidden_size = None;
                m
            },
            "no shared expert",
        ),
        (
            {
                let mut m = tiny_hf("M-");
                m.mlp.as_mut().unwrap().activation = hybridgen_dsl::config::Activation::Swiglu;
                m
            },
            "activation `swiglu`",
        ),
    ] {
        let err = hf::dry_run(&model, HfDtype::Bf16).unwrap_err().to_string();
        assert!(
            err.contains(want),
            "{}: `{want}` not in {err}",
            model.pattern
        );
    }
    // A folder that is there already is never written into.
    let ok = trained(&dir.join("ok"), tiny_hf("M*E"));
    std::fs::create_dir_all(dir.join("taken")).unwrap();
    std::fs::write(dir.join("taken/keep.txt"), "mine").unwrap();
    let err = hf::export(&ok, &dir.join("taken"), HfDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not empty"), "{err}");
    assert_eq!(
        std::fs::read_dir(dir.join("taken")).unwrap().count(),
        1,
        "the taken folder was written into"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_checkpoint_is_refused_before_the_export_writes() {
    let dir = scratch("damaged");
    let ckpt = trained(&dir, tiny_hf("M*E"));
    let file = ckpt.join("step-000003/rank-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let out = dir.join("hf");
    let err = hf::export(&ckpt, &out, HfDtype::F32)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("checksum mismatch"),
        "{err}"
    );
    assert!(!out.exists() && !dir.join("hf.partial").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

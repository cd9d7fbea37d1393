//! `hybridgen export` / `import` / `train --init-from` as a user runs them,
//! and the exports of the Nemotron presets held against the published
//! models (tests/fixtures/hf: their public configs, and tensor lists
//! derived from transformers' modeling code; each file says where its data
//! came from), and tiny-gdn as transformers' qwen3_next.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Output;

mod support;
use support::stderr;

fn hybridgen_in(cwd: &Path, args: &[&str]) -> Output {
    support::hybridgen_in(cwd, args, &[])
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    support::scratch("hfcli", name)
}

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/hf/{name}.json"));
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The fixture's tensors, expanded over its pattern: name -> (shape, dtype).
fn published_tensors(fixture: &Value) -> BTreeMap<String, (Vec<u64>, String)> {
    let t = &fixture["tensors"];
    let pattern = fixture["config"]["hybrid_override_pattern"]
        .as_str()
        .unwrap();
    let mut out = BTreeMap::new();
    let mut add = |row: &Value, i: usize, j: usize| {
        let name = row[0]
            .as_str()
            .unwrap()
            .replace("{i}", &i.to_string())
            .replace("{j}", &j.to_string());
        let shape = row[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let dtype = row
            .get(2)
            .and_then(Value::as_str)
            .unwrap_or("BF16")
            .to_string();
        assert!(
            out.insert(name.clone(), (shape, dtype)).is_none(),
            "{name} twice"
        );
    };
    for row in t["model"].as_array().unwrap() {
        add(row, 0, 0);
    }
    for (i, symbol) in pattern.chars().enumerate() {
        for row in t[symbol.to_string()].as_array().unwrap() {
            add(row, i, 0);
        }
        if symbol == 'E' {
            for j in 0..t["E experts"].as_u64().unwrap() as usize {
                for row in t["E per expert"].as_array().unwrap() {
                    add(row, i, j);
                }
            }
        }
    }
    out
}

fn dry_run(preset: &str) -> Value {
    let text = ok(hybridgen_in(
        Path::new("."),
        &[
            "export",
            "--preset",
            preset,
            "--to",
            "hf",
            "--dry-run",
            "--format",
            "json",
        ],
    ));
    serde_json::from_str(&text).unwrap()
}

/// Fields whose exported value differs from the published one, and why.
/// `max_position_embeddings`: hybridgen writes its training length.
const KNOWN_DIFFERENCES: [&str; 1] = ["max_position_embeddings"];

fn check_against_published(preset: &str, published_is_whole: bool) {
    let fixture = fixture(preset);
    let listing = dry_run(preset);
    let ours: BTreeMap<String, (Vec<u64>, String)> = listing["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            (
                t["name"].as_str().unwrap().to_string(),
                (shape, t["dtype"].as_str().unwrap().to_string()),
            )
        })
        .collect();
    let theirs = published_tensors(&fixture);
    let only_ours: Vec<_> = ours
        .keys()
        .filter(|k| !theirs.contains_key(*k))
        .take(5)
        .collect();
    let only_theirs: Vec<_> = theirs
        .keys()
        .filter(|k| !ours.contains_key(*k))
        .take(5)
        .collect();
    assert!(
        only_ours.is_empty() && only_theirs.is_empty(),
        "{preset}: names differ: only in the export {only_ours:?}, only published {only_theirs:?}"
    );
    for (name, theirs) in &theirs {
        assert_eq!(&ours[name], theirs, "{preset}: {name}");
    }
    let total: u64 = theirs
        .iter()
        .filter(|(n, _)| !n.ends_with("e_score_correction_bias"))
        .map(|(_, (s, _))| s.iter().product::<u64>())
        .sum();
    assert_eq!(
        total,
        fixture["total_params"].as_u64().unwrap(),
        "{preset}: fixture total"
    );

    let config = listing["config"].as_object().unwrap();
    let published = fixture["config"].as_object().unwrap();
    for (field, value) in config {
        let Some(theirs) = published.get(field) else {
            // A partial fixture lists only the fields it could cite; the
            // whole one must hold every field the export writes, save
            // transformers' default for no MTP.
            assert!(
                !published_is_whole || field == "num_nextn_predict_layers",
                "{preset}: the export writes `{field}`, which the published config does not have"
            );
            continue;
        };
        if KNOWN_DIFFERENCES.contains(&field.as_str()) {
            continue;
        }
        let same = match (value.as_f64(), theirs.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => value == theirs,
        };
        assert!(same, "{preset}: `{field}` is {value}, published {theirs}");
    }
    let files: BTreeSet<&str> = listing["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["file"].as_str().unwrap())
        .collect();
    assert_eq!(files.len(), listing["files"].as_array().unwrap().len());
    // Tens of gigabytes in bf16: sharded at 5 GB with an index.
    assert!(
        files.len() > 1 && files.iter().all(|f| f.starts_with("model-")),
        "{files:?}"
    );
    if let Some(shards) = fixture.get("shards") {
        assert_eq!(
            files.len() as u64,
            shards.as_u64().unwrap(),
            "{preset}: shards"
        );
    }
}

#[test]
fn the_nemotron_3_nano_export_matches_the_published_model() {
    check_against_published("nemotron-3-nano-30b-a3b", true);
}

#[test]
fn the_nemotron_nano_9b_v2_export_matches_the_published_model() {
    check_against_published("nemotron-nano-9b-v2", false);
}

#[test]
fn the_published_configs_import_as_the_presets() {
    let published = fixture("nemotron-3-nano-30b-a3b")["config"].clone();
    let model = hybridgen_runtime::hf::from_hf_config(&published, "config.json").unwrap();
    assert_eq!(model.moe.as_ref().unwrap().topk_scaling_factor, 2.5);
    let mut preset = hybridgen_dsl::ModelConfig::preset("nemotron-3-nano-30b-a3b").unwrap();
    // hybridgen's training length and aux-loss weight are training
    // settings, not part of the published model.
    preset.seq_length = model.seq_length;
    preset.moe.as_mut().unwrap().aux_loss_coeff = model.moe.as_ref().unwrap().aux_loss_coeff;
    assert_eq!(model, preset);
    let mut bad = published.clone();
    bad["routed_scaling_factor"] = Value::from(-1.0);
    let err = hybridgen_runtime::hf::from_hf_config(&bad, "config.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("routed_scaling_factor"), "{err}");
    let mut nine = hybridgen_dsl::ModelConfig::preset("nemotron-nano-9b-v2").unwrap();
    let published9 = fixture("nemotron-nano-9b-v2")["config"].clone();
    let model9 = hybridgen_runtime::hf::from_hf_config(&published9, "config.json").unwrap();
    nine.seq_length = model9.seq_length;
    assert_eq!(model9, nine);
}

/// tests/fixtures/hf/tiny-hf.toml (the tiny preset as transformers
/// computes it) with 32-token sequences, in `dir`.
fn tiny_hf_model(dir: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/tiny-hf.toml");
    let text = std::fs::read_to_string(fixture)
        .unwrap()
        .replace("seq_length = 64", "seq_length = 32");
    let path = dir.join("tiny-hf.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn step_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("step").is_some())
        .map(|mut v| {
            v.as_object_mut().unwrap().remove("step_ms");
            v.to_string()
        })
        .collect()
}

#[test]
fn export_import_and_init_from_on_the_command_line() {
    let dir = scratch("cli");
    let model = tiny_hf_model(&dir);
    let model = model.to_str().unwrap();
    let run = |args: &[&str]| ok(hybridgen_in(&dir, args));
    run(&[
        "train",
        "--model",
        model,
        "--pattern",
        "M[*E]M-[*E]",
        "--steps",
        "2",
        "--save",
        "ckpt",
        "--device",
        "cpu",
    ]);
    let text = run(&[
        "export",
        "ckpt",
        "--to",
        "hf",
        "out",
        "--dtype",
        "f32",
        "--loss-check",
        "loss.json",
        "--loss-tokens",
        "32",
    ]);
    assert!(text.contains("exported flat as `M*EM-*E`"), "{text}");
    assert!(text.contains("exported step 2 to out"), "{text}");

    // The loss file: 33 tokens and hybridgen's loss on them, which is the
    // first step's loss of a one-sequence run from the exported weights.
    let check: Value =
        serde_json::from_slice(&std::fs::read(dir.join("loss.json")).unwrap()).unwrap();
    assert_eq!(check["tokens"].as_array().unwrap().len(), 33);
    let one = run(&[
        "train",
        "--init-from",
        "out",
        "--ranks",
        "1",
        "--ep",
        "1",
        "--micro-batches",
        "1",
        "--micro-batch-size",
        "1",
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--format",
        "json",
        "--device",
        "cpu",
    ]);
    let first: Value = serde_json::from_str(one.lines().next().unwrap()).unwrap();
    assert_eq!(first["loss"], check["loss"]);

    // --model-only prints a model file that reads back as the model.
    let toml = run(&["import", "out", "--model-only", "--pattern", "M[*E]M-[*E]"]);
    let printed = hybridgen_dsl::ModelConfig::from_toml(&toml, "printed").unwrap();
    assert_eq!(printed.pattern, "M[*E]M-[*E]");
    assert_eq!(printed.hidden_size, 64);

    // Training from the folder is training from its imported checkpoint.
    let imported = run(&["import", "out", "--output", "back"]);
    assert!(imported.contains("back/step-000000"), "{imported}");
    let layout = [
        "--ranks",
        "2",
        "--ep",
        "2",
        "--zero",
        "3",
        "--schedule",
        "overlap",
    ];
    let common = ["--steps", "2", "--format", "json", "--device", "cpu"];
    let from_folder = run(&[&["train", "--init-from", "out"][..], &layout, &common].concat());
    let resumed = run(&[&["train", "--resume", "back"][..], &layout, &common].concat());
    assert_eq!(step_lines(&from_folder), step_lines(&resumed));
    assert_eq!(step_lines(&from_folder).len(), 2);
    // Regrouped, the first step computes the same loss.
    let regrouped = run(&[
        &["train", "--init-from", "out", "--pattern", "M[*E]M-[*E]"][..],
        &layout,
        &common,
    ]
    .concat());
    let loss = |text: &str| -> Value {
        serde_json::from_str::<Value>(text.lines().next().unwrap()).unwrap()["loss"].clone()
    };
    assert_eq!(loss(&regrouped), loss(&from_folder));

    // Refusals: a changed pattern, a taken output, --init-from with --resume.
    let out = hybridgen_in(
        &dir,
        &[
            "train",
            "--init-from",
            "out",
            "--pattern",
            "M*E",
            "--steps",
            "1",
            "--device",
            "cpu",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("may regroup"), "{}", stderr(&out));
    let out = hybridgen_in(&dir, &["import", "out", "--output", "back"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("import to a new directory"),
        "{}",
        stderr(&out)
    );
    let out = hybridgen_in(&dir, &["export", "ckpt", "--to", "hf", "out"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not empty"), "{}", stderr(&out));
    let out = hybridgen_in(&dir, &["train", "--init-from", "out", "--resume", "back"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = hybridgen_in(&dir, &["export", "ckpt", "--to", "hf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("OUT_DIR"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tiny_gdn_exports_as_qwen3_next_and_trains_from_it_on_the_command_line() {
    let dir = scratch("qwen3-next");
    let run = |args: &[&str]| ok(hybridgen_in(&dir, args));
    // The dry run names the model type and lists qwen3_next's tensors.
    let listing: Value = serde_json::from_str(&run(&[
        "export",
        "--preset",
        "tiny-gdn",
        "--to",
        "hf",
        "--dry-run",
        "--format",
        "json",
    ]))
    .unwrap();
    assert_eq!(listing["config"]["model_type"], "qwen3_next");
    let names = listing.to_string();
    for want in [
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.3.mlp.shared_expert_gate.weight",
    ] {
        assert!(names.contains(want), "{want} not listed");
    }
    let common = [
        "--ranks",
        "1",
        "--ep",
        "1",
        "--micro-batches",
        "1",
        "--micro-batch-size",
        "1",
        "--seq-len",
        "32",
        "--format",
        "json",
        "--device",
        "cpu",
    ];
    run(&[
        &[
            "train", "--preset", "tiny-gdn", "--steps", "2", "--save", "ckpt",
        ][..],
        &common,
    ]
    .concat());
    let text = run(&[
        "export",
        "ckpt",
        "--to",
        "hf",
        "out",
        "--dtype",
        "f32",
        "--loss-check",
        "loss.json",
        "--loss-tokens",
        "32",
    ]);
    assert!(text.contains("4 qwen3_next decoder layers"), "{text}");
    let check: Value =
        serde_json::from_slice(&std::fs::read(dir.join("loss.json")).unwrap()).unwrap();
    // Training from the folder starts from the same weights: its first
    // step's loss on the check's sequence is the check's.
    let one = run(&[
        &["train", "--init-from", "out", "--steps", "1"][..],
        &common,
    ]
    .concat());
    let first: Value = serde_json::from_str(one.lines().next().unwrap()).unwrap();
    assert_eq!(first["loss"], check["loss"]);
    // The import regroups back into the preset's pattern.
    let toml = run(&[
        "import",
        "out",
        "--model-only",
        "--pattern",
        "[GE][GE][GE][*E]",
    ]);
    let printed = hybridgen_dsl::ModelConfig::from_toml(&toml, "printed").unwrap();
    let mut preset = hybridgen_dsl::ModelConfig::preset("tiny-gdn").unwrap();
    preset.mla = None;
    preset.dsa = None;
    preset.mamba = None;
    preset.mlp = None;
    assert_eq!(printed, preset);
    // A `G` model qwen3_next cannot compute: the layer, the reason, the fix.
    let model = dir.join("odd.toml");
    let source = hybridgen_dsl::ModelConfig::preset_source("tiny-gdn")
        .unwrap()
        .replace("[GE][GE][GE][*E]", "[GE][GE]G");
    std::fs::write(&model, source).unwrap();
    let out = hybridgen_in(
        &dir,
        &[
            "export",
            "--model",
            model.to_str().unwrap(),
            "--to",
            "hf",
            "--dry-run",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("decoder layer 4 is `G` (gated delta net) with no MLP after it"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

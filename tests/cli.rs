//! The `hybridgen` command line as a user runs it: exit codes (0 ok, 1
//! invalid input, 2 usage errors), what goes to stdout and stderr, the JSON
//! contracts, and no panic on any input.

use proptest::prelude::*;
use serde_json::Value;

mod support;
use support::{hybridgen, stderr, stdout};

#[test]
fn check_accepts_a_valid_pattern_with_a_summary() {
    let out = hybridgen(&["check", "M[M*]-"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        "ok: 4 physical layers, 3 logical, 1 group, 0 MTP depths; canonical: M[M*]-\n"
    );
    let out = hybridgen(&["check", "(M [*E]){2} | - / *E"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        stdout(&out).contains("canonical: M[*E]M[*E]|-/*E"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn check_reports_every_error_with_code_and_column() {
    let out = hybridgen(&["check", "M[[M]]x[-E]"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).is_empty());
    let err = stderr(&out);
    for (code, at) in [("H005", "1:3"), ("H001", "1:7"), ("H007", "1:9")] {
        assert!(
            err.contains(&format!("error[{code}]")),
            "{code} missing:\n{err}"
        );
        assert!(
            err.contains(&format!("pattern:{at}")),
            "{at} missing:\n{err}"
        );
    }
    assert!(err.contains("3 errors"));
}

#[test]
fn explain_describes_codes_and_refuses_unknown_ones() {
    let out = hybridgen(&["explain", "H008"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        stdout(&out).starts_with("H008: two members of a group publish the same checkpoint names")
    );
    let out = hybridgen(&["explain", "H999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not a hybridgen error code"));
}

#[test]
fn plan_json_is_one_document_with_the_documented_fields() {
    let out = hybridgen(&[
        "plan",
        "M[*E]M[*E]",
        "--dp",
        "4",
        "--ep",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let plan: Value = serde_json::from_str(&stdout(&out)).expect("one JSON document");
    assert_eq!(plan["physical_layers"], 6);
    assert_eq!(plan["logical_layers"], 4);
    assert_eq!(plan["mtp_depths"], 0);
    let layers = plan["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 6);
    assert_eq!(layers[2]["path"], "decoder.layers.1.layers.1");
    assert_eq!(layers[2]["symbol"], "E");
    assert_eq!(layers[2]["group"], 0);
    assert_eq!(layers[2]["logical"], 1);
    assert_eq!(layers[2]["layer_number"], 3);
    assert_eq!(layers[0]["group"], Value::Null);
    let units = plan["units"].as_array().unwrap();
    assert_eq!(units.len(), 4);
    assert_eq!(units[1]["name"], "decoder.layers.1");
    assert_eq!(units[1]["kind"], "group");
    assert_eq!(units[1]["layers"], serde_json::json!([1, 2]));
    // The group's expert bucket: 4 experts over ep 2 leaves 2 local ones,
    // sharded over dp / ep = 2 ranks.
    let expert = units[1]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["expert"] == true)
        .expect("an expert bucket");
    assert_eq!(expert["world"], 2);
    let names: Vec<&str> = expert["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"decoder.layers.1.layers.1.mlp.experts.linear_fc1.weight1"));
    assert!(!names.iter().any(|n| n.ends_with("weight2")), "{names:?}");
    let padded = expert["padded_numel"].as_u64().unwrap();
    assert_eq!(padded % (2 * 128), 0);
    assert_eq!(expert["shard_numel"].as_u64().unwrap() * 2, padded);
    assert!(!plan["non_unit_buckets"].as_array().unwrap().is_empty());
}

#[test]
fn plan_totals_match_the_published_models() {
    for (preset, total) in [
        ("nemotron-nano-9b-v2", 8_888_227_328u64),
        ("nemotron-3-nano-30b-a3b", 31_577_937_344),
    ] {
        let out = hybridgen(&["plan", "--preset", preset, "--format", "json"]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let plan: Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(plan["total_params"], total, "{preset}");
    }
}

#[test]
fn plan_text_shows_units_buckets_padding_and_memory() {
    let out = hybridgen(&["plan", "[*E][*E]", "--dp", "2", "--ep", "2"]);
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    for needle in [
        "FSDP units (2)",
        "buckets (5",
        "megatron pad",
        "memory per rank, ZeRO-3",
        "Adam moments",
    ] {
        assert!(text.contains(needle), "`{needle}` missing:\n{text}");
    }
}

#[test]
fn plan_refuses_impossible_layouts_with_codes() {
    let out = hybridgen(&["plan", "[*E]", "--dp", "3", "--ep", "3"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("error[H023]"), "{}", stderr(&out));
    let out = hybridgen(&["plan", "M*|M*|M*", "--pp", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("error[H020]"));
    let out = hybridgen(&["plan", "[*E]", "--units", "E,banana"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("H027"));
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["plan", "--dp", "0"][..],
        &["plan", "M*", "--model", "x.toml"],
        &["plan", "M*", "--format", "yaml"],
        &["check"],
        &["frobnicate"],
        &["train", "--zero", "2"],
        &["train", "--precision", "f16"],
    ] {
        let out = hybridgen(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
}

/// Every built-in preset prints as a model file that plans; the ones made
/// for the CPU (`tiny*`) train on it, their loss falling over a few steps.
#[test]
fn every_preset_plans_and_the_cpu_presets_train() {
    let list = hybridgen(&["preset"]);
    assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
    let names: Vec<String> = hybridgen_dsl::config::PRESET_NAMES
        .iter()
        .map(|n| n.to_string())
        .collect();
    for name in &names {
        assert!(stdout(&list).contains(name.as_str()), "{name} is listed");
        let out = hybridgen(&["plan", "--preset", name, "--format", "json"]);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", stderr(&out));
        if !name.starts_with("tiny") {
            continue;
        }
        let out = hybridgen(&[
            "train", "--preset", name, "--steps", "6", "--lr", "3e-3", "--format", "json",
        ]);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", stderr(&out));
        let lines: Vec<Value> = stdout(&out)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
            .collect();
        let losses: Vec<f64> = lines.iter().filter_map(|l| l["loss"].as_f64()).collect();
        assert_eq!(losses.len(), 6, "{name}");
        // The indexer loss on every step of a model that trains a DSA
        // indexer, on none of the others.
        let indexer: Vec<f64> = lines
            .iter()
            .filter_map(|l| l["indexer_loss"].as_f64())
            .collect();
        let want = if name == "tiny-dsa" { 6 } else { 0 };
        assert_eq!(indexer.len(), want, "{name}: {indexer:?}");
        assert!(
            indexer.iter().all(|l| l.is_finite() && *l > 0.0),
            "{name}: {indexer:?}"
        );
        assert!(
            losses[5] < losses[0],
            "{name}: the loss did not fall: {losses:?}"
        );
    }
    assert!(names.iter().any(|n| n == "tiny-gdn"));
    assert!(names.iter().any(|n| n == "tiny-dsa"));
}

#[test]
fn missing_model_files_and_presets_are_invalid_input() {
    let out = hybridgen(&["plan", "--model", "/nonexistent/model.toml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("cannot read model file"));
    let out = hybridgen(&["plan", "--preset", "gpt-5"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("the presets are: tiny"));
}

#[test]
fn plan_prints_a_micro_batchs_activations_kept_and_recomputed() {
    let out = hybridgen(&["plan", "--preset", "bench-hybrid-moe", "--seq-len", "8192"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("activations of one micro-batch of 1 x 8192 tokens in bf16"),
        "{text}"
    );
    // The layers' line: what they keep, and with recomputation (the `E`
    // layers still keep theirs, the others only their inputs): less.
    let layers = text
        .lines()
        .find(|l| l.trim_start().starts_with("layers "))
        .unwrap_or_else(|| panic!("{text}"));
    let gib: Vec<f64> = layers
        .split_whitespace()
        .skip(1)
        .collect::<Vec<_>>()
        .chunks(2)
        .filter_map(|pair| {
            let value: f64 = pair[0].parse().ok()?;
            Some(match *pair.get(1)? {
                "GiB" => value,
                "MiB" => value / 1024.0,
                _ => return None,
            })
        })
        .collect();
    assert!(
        gib.len() == 2 && gib[1] < gib[0] && gib[1] > 0.0,
        "{layers}"
    );
    // What one layer of each kind that can recompute saves: a Mamba
    // layer's 64 heads of 64 channels keep more than attention's outputs,
    // and `E` layers, which keep theirs, are not named.
    let saves = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("a layer recomputed saves "))
        .and_then(|l| l.split(" (").next())
        .unwrap_or_else(|| panic!("{text}"));
    let mib = |kind: &str| -> f64 {
        let figure = saves
            .split(", ")
            .find_map(|part| part.strip_prefix(&format!("{kind} ")))
            .unwrap_or_else(|| panic!("no {kind}: {saves}"));
        let mut words = figure.split_whitespace();
        let value: f64 = words.next().unwrap().parse().unwrap();
        match words.next() {
            Some("GiB") => value * 1024.0,
            Some("MiB") => value,
            other => panic!("{other:?}: {saves}"),
        }
    };
    assert!(mib("M") > mib("*") && mib("*") > 0.0, "{saves}");
    assert!(
        saves.split(", ").all(|part| !part.starts_with("E ")),
        "{saves}"
    );
}

#[test]
fn train_json_prints_a_line_per_step_and_a_summary() {
    let out = hybridgen(&[
        "train",
        "--pattern",
        "[*E][*E]",
        "--steps",
        "3",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "2",
        "--seq-len",
        "16",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let lines: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 4);
    for (i, line) in lines[..3].iter().enumerate() {
        assert_eq!(line["step"], i as u64 + 1);
        assert!(line["loss"].as_f64().unwrap() > 0.0);
    }
    let summary = &lines[3]["summary"];
    assert_eq!(summary["param_hash"].as_str().unwrap().len(), 16);
    assert!(summary["tokens_per_s"].as_f64().unwrap() > 0.0);
    // The CPU default.
    assert_eq!(summary["precision"], "f32");
    // Start-up, phase by phase: every phase that ran took some time, the
    // resume (none here) none, and together less than the whole run.
    let startup = &summary["startup_s"];
    let phase = |name: &str| startup[name].as_f64().expect(name);
    for name in ["device", "params", "optimizer"] {
        assert!(phase(name) > 0.0, "{name}: {startup}");
    }
    assert_eq!(phase("resume"), 0.0);
    // Drawing the values is part of the parameters' phase.
    assert!(
        phase("params_drawn") > 0.0 && phase("params_drawn") <= phase("params"),
        "{startup}"
    );
    // The model's FLOPs a token, for MFU.
    assert!(
        summary["flops_per_token"].as_u64().unwrap() > 0,
        "{summary}"
    );
    let total: f64 = ["device", "params", "optimizer"].map(phase).iter().sum();
    assert!(total < summary["wall_s"].as_f64().unwrap(), "{summary}");
    // The command's own clock: checked, then the first step reported after
    // the phases before it, then the run returned (the final hash in it).
    let clock = &summary["clock_s"];
    let at = |name: &str| clock[name].as_f64().expect(name);
    assert!(phase("platform") >= 0.0, "{startup}");
    assert!(at("prepared") > 0.0, "{clock}");
    assert!(at("first_step") > at("prepared") + total, "{summary}");
    assert!(at("trained") > at("first_step"), "{clock}");
    let hash = summary["hash_s"].as_f64().unwrap();
    assert!(
        hash > 0.0 && hash < at("trained") - at("first_step"),
        "{summary}"
    );
}

#[test]
fn train_text_names_the_precision() {
    let out = hybridgen(&[
        "train",
        "--pattern",
        "M*",
        "--ep",
        "1",
        "--steps",
        "1",
        "--micro-batches",
        "1",
        "--seq-len",
        "8",
        "--precision",
        "bf16",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("ZeRO-3, bf16, 1 steps"), "{text}");
    assert!(
        text.contains("precision       bf16 (parameters and activations;"),
        "{text}"
    );
}

#[test]
fn train_refuses_bad_layouts_before_starting() {
    let out = hybridgen(&["train", "--ranks", "3", "--ep", "2", "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    // No step ran: stdout is only the error object.
    let error: Value = serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
    assert_eq!(error["error"]["code"], "invalid_config");
    assert!(
        stderr(&out).contains("not divisible by --ep 2"),
        "{}",
        stderr(&out)
    );
    // Pipeline stages: the ranks must split into --pp stages evenly.
    let out = hybridgen(&[
        "train",
        "--pattern",
        "M[*E]|M-[*E]",
        "--ranks",
        "3",
        "--pp",
        "2",
        "--ep",
        "1",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let error: Value = serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
    assert_eq!(error["error"]["code"], "invalid_config");
    assert!(
        stderr(&out).contains("--ranks 3 is not divisible by --pp 2")
            && stderr(&out).contains("a multiple of --pp"),
        "{}",
        stderr(&out)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Any text is either a valid pattern or invalid input: never a crash,
    /// whether it follows `--` or not. (A bare `--` is the command line's
    /// end of options, so the pattern `--` needs one in front.)
    #[test]
    fn check_never_panics(text in "[\\[\\]()|/{}0-9M*+DGE\\-x é]{0,24}") {
        let after_marker = hybridgen(&["check", "--", &text]);
        prop_assert!(
            matches!(after_marker.status.code(), Some(0) | Some(1)),
            "-- {:?}: {}", text, stderr(&after_marker)
        );
        if text != "--" {
            let out = hybridgen(&["check", &text]);
            prop_assert!(matches!(out.status.code(), Some(0) | Some(1)), "{:?}: {}", text, stderr(&out));
        }
    }
}

/// Without a usable GPU, `--device cuda` stops before anything starts with
/// a `device_failed` error naming what is missing, and `--device auto`
/// (the default) says it took the CPU.
#[test]
fn train_device_cuda_without_a_gpu_is_refused_and_auto_takes_the_cpu() {
    if hybridgen_runtime::cuda::probe().is_ok() {
        println!("skipped: a GPU is visible here");
        return;
    }
    let out = hybridgen(&["train", "--device", "cuda", "--format", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let last = stdout(&out).lines().last().unwrap_or_default().to_string();
    let error: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(error["error"]["code"], "device_failed", "{last}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("--device cuda"), "{message}");
    assert!(
        message.contains("libcuda") || message.contains("no CUDA device"),
        "names what is missing: {message}"
    );
    let out = hybridgen(&["train", "--steps", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("on the CPU (no usable GPU), 2 ranks"),
        "{}",
        stdout(&out)
    );
}

/// The pattern `--` (two MLP layers) reads as the end of the options on a
/// command line, so it is written after one, as the help says.
#[test]
fn the_pattern_of_two_mlps_follows_an_end_of_options_marker() {
    let out = hybridgen(&["check", "--", "--"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("2 physical layers"),
        "{}",
        stdout(&out)
    );
    let help = hybridgen(&["check", "--help"]);
    assert!(stdout(&help).contains("check -- --"), "{}", stdout(&help));
}

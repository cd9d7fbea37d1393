//! `hybridgen train --tensorboard-dir`: the event files read back with
//! TensorBoard's own reader (the `tensorboard` Python package's event
//! accumulator, which `.ci/run` installs), every tag holding the values of
//! the run's JSON lines: bit for bit where the value is an f32 (the learning
//! rate), and as the f32 TensorBoard stores for the f64 losses and norms.
//! A model with `D` layers logs its indexer loss, others do not. A resumed
//! run adds a file of its own whose steps continue the curves; a
//! directory that cannot be written is refused before the first step.

mod support;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use support::{hybridgen, scratch, stderr};

/// Per tag, the (step, value) pairs TensorBoard reads from `dir`, and the
/// text summaries as (tag, step, text).
struct Read {
    scalars: BTreeMap<String, Vec<(u64, f64)>>,
    texts: Vec<(String, u64, String)>,
    files: usize,
}

/// Reads `dir` with TensorBoard's event accumulator, as TensorBoard's
/// scalars and text dashboards do.
fn tensorboard_reads(dir: &Path) -> Read {
    let script = r#"
import json, os, sys
from tensorboard.backend.event_processing import event_accumulator as ea
d = sys.argv[1]
acc = ea.EventAccumulator(d, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {}, "texts": [], "files": len([f for f in os.listdir(d) if "tfevents" in f])}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, e.value] for e in acc.Scalars(tag)]
for tag in tags["tensors"]:
    for e in acc.Tensors(tag):
        for s in e.tensor_proto.string_val:
            out["texts"].append([tag, e.step, s.decode()])
print(json.dumps(out))
"#;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(dir)
        .output()
        .expect("python3 runs (.ci/run installs it with the tensorboard package)");
    assert!(
        out.status.success(),
        "TensorBoard's reader failed (is the `tensorboard` Python package installed? \
         .ci/run installs it):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: Value = serde_json::from_slice(&out.stdout).unwrap();
    let scalars = read["scalars"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(tag, points)| {
            let points = points
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
                .collect();
            (tag.clone(), points)
        })
        .collect();
    let texts = read["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t[0].as_str().unwrap().to_string(),
                t[1].as_u64().unwrap(),
                t[2].as_str().unwrap().to_string(),
            )
        })
        .collect();
    Read {
        scalars,
        texts,
        files: read["files"].as_u64().unwrap() as usize,
    }
}

/// The step lines of a `--log-file`.
fn json_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v.get("step").is_some() && v.get("loss").is_some())
        .collect()
}

/// The f32 TensorBoard stores for a JSON line's number.
fn as_f32(value: &Value) -> u32 {
    (value.as_f64().unwrap() as f32).to_bits()
}

/// `tag`'s value at `step`, as the f32 it is stored as.
fn at(read: &Read, tag: &str, step: u64) -> u32 {
    let points = read
        .scalars
        .get(tag)
        .unwrap_or_else(|| panic!("no `{tag}` in {:?}", read.scalars.keys()));
    let found: Vec<f64> = points
        .iter()
        .filter(|(s, _)| *s == step)
        .map(|&(_, v)| v)
        .collect();
    assert_eq!(found.len(), 1, "`{tag}` at step {step}: {found:?}");
    (found[0] as f32).to_bits()
}

fn train(dir: &Path, extra: &[&str]) {
    let tb = dir.join("tb");
    let log = dir.join("run.jsonl");
    let mut args = vec![
        "train",
        "--device",
        "cpu",
        "--pattern",
        "M[*E]M-[*E]/*E",
        "--seq-len",
        "32",
        "--micro-batches",
        "2",
        "--eval-every",
        "3",
        "--tensorboard-dir",
        tb.to_str().unwrap(),
        "--log-file",
        log.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = hybridgen(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn tensorboard_reads_every_tag_with_the_values_of_the_json_lines() {
    let dir = scratch("tensorboard", "tags");
    train(&dir, &["--steps", "6"]);
    let read = tensorboard_reads(&dir.join("tb"));
    let lines = json_lines(&dir.join("run.jsonl"));
    assert_eq!(lines.len(), 6);
    assert_eq!(read.files, 1);
    for line in &lines {
        let step = line["step"].as_u64().unwrap();
        assert_eq!(
            at(&read, "lm loss", step),
            as_f32(&line["loss"]),
            "step {step}"
        );
        // The rate is an f32 in the optimizer: the same bits.
        assert_eq!(at(&read, "learning-rate", step), as_f32(&line["lr"]));
        assert_eq!(at(&read, "grad-norm", step), as_f32(&line["grad_norm"]));
        assert_eq!(
            at(&read, "load_balancing_loss", step),
            as_f32(&line["aux_loss"])
        );
        assert_eq!(at(&read, "mtp_1 loss", step), as_f32(&line["mtp_loss"]));
        assert_eq!(
            at(&read, "iteration-time", step),
            ((line["step_ms"].as_f64().unwrap() / 1e3) as f32).to_bits()
        );
        match line.get("eval_loss") {
            Some(eval) => assert_eq!(at(&read, "lm loss validation", step), as_f32(eval)),
            None => assert!(
                read.scalars["lm loss validation"]
                    .iter()
                    .all(|(s, _)| *s != step)
            ),
        }
    }
    // Steps 3 and 6 evaluated.
    assert_eq!(read.scalars["lm loss validation"].len(), 2);
    for tag in ["tokens-per-second", "comm-hidden-fraction"] {
        assert!(read.scalars.contains_key(tag), "no `{tag}`");
    }
    // The run's settings, once, as text.
    let settings: Vec<_> = read.texts.iter().filter(|t| t.0 == "settings").collect();
    assert_eq!(settings.len(), 1, "{:?}", read.texts);
    assert!(
        settings[0].2.contains("M[*E]M-[*E]/*E"),
        "{}",
        settings[0].2
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model that trains a DSA indexer logs Megatron's `indexer loss` with
/// the values of the JSON lines' `indexer_loss`; the run above, which has no
/// `D` layer, logs none.
#[test]
fn a_dsa_model_logs_its_indexer_loss() {
    let dir = scratch("tensorboard", "indexer");
    let (tb, log) = (dir.join("tb"), dir.join("run.jsonl"));
    let out = hybridgen(&[
        "train",
        "--device",
        "cpu",
        "--preset",
        "tiny-dsa",
        "--seq-len",
        "32",
        "--micro-batches",
        "2",
        "--steps",
        "3",
        "--tensorboard-dir",
        tb.to_str().unwrap(),
        "--log-file",
        log.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let read = tensorboard_reads(&tb);
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 3);
    for line in &lines {
        let step = line["step"].as_u64().unwrap();
        assert!(
            line["indexer_loss"].as_f64().is_some_and(|l| l > 0.0),
            "{line}"
        );
        assert_eq!(
            at(&read, "indexer loss", step),
            as_f32(&line["indexer_loss"]),
            "step {step}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    let dir = scratch("tensorboard", "no-indexer");
    train(&dir, &["--steps", "1"]);
    let read = tensorboard_reads(&dir.join("tb"));
    assert!(read.scalars.contains_key("lm loss"));
    assert!(!read.scalars.contains_key("indexer loss"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_resumed_run_adds_a_file_whose_steps_continue_the_curves() {
    let dir = scratch("tensorboard", "resume");
    let save = dir.join("ckpt");
    let save = save.to_str().unwrap();
    train(&dir, &["--steps", "3", "--save", save]);
    train(&dir, &["--steps", "5", "--save", save, "--resume", save]);
    let read = tensorboard_reads(&dir.join("tb"));
    assert_eq!(read.files, 2);
    let steps: Vec<u64> = read.scalars["lm loss"].iter().map(|p| p.0).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5]);
    let lines = json_lines(&dir.join("run.jsonl"));
    for line in &lines {
        let step = line["step"].as_u64().unwrap();
        assert_eq!(at(&read, "lm loss", step), as_f32(&line["loss"]));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pipeline's run logs each stage's measured bubble beside 1F1B's, at
/// its last step, with the summary's values.
#[test]
fn a_pipeline_logs_each_stages_bubble() {
    let dir = scratch("tensorboard", "pipeline");
    let tb = dir.join("tb");
    let out = hybridgen(&[
        "train",
        "--device",
        "cpu",
        "--pattern",
        "M[*E]|M-[*E]",
        "--ranks",
        "2",
        "--pp",
        "2",
        "--ep",
        "1",
        "--steps",
        "3",
        "--format",
        "json",
        "--tensorboard-dir",
        tb.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: Value = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|l| l.get("summary").cloned())
        .expect("a summary line");
    let read = tensorboard_reads(&tb);
    let waits = summary["stage_waits"].as_array().unwrap();
    assert_eq!(waits.len(), 2);
    for (s, wait) in waits.iter().enumerate() {
        assert_eq!(
            at(&read, &format!("pipeline-bubble/stage-{s}"), 3),
            as_f32(wait)
        );
    }
    assert_eq!(
        at(&read, "pipeline-bubble/1f1b", 3),
        as_f32(&summary["ideal_bubble"])
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_that_cannot_be_written_is_refused_before_the_first_step() {
    let dir = scratch("tensorboard", "refused");
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let out = hybridgen(&[
        "train",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--tensorboard-dir",
        file.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("--tensorboard-dir"), "{err}");
    assert!(!err.contains("step "), "refused after a step: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

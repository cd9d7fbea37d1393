//! Checkpoints refuse what they cannot trust: flipped bytes in a rank file
//! (named with the tensor they hit) or in the index, files the index names
//! outside the checkpoint, numbers out of range, shapes that are not the
//! model's. Each is an error before any step, never a panic, a huge
//! allocation or a silent load.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::checkpoint::{self, ResumeFrom};
use hybridgen_runtime::fsdp::ShardLayout;
use hybridgen_runtime::optimizer::OptimizerKind;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::setting::Setting;
use hybridgen_runtime::train::{StepReport, TrainConfig, memory_need, prepare, train};
use safetensors::SafeTensors;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn config() -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = "[*E][*E]".to_string();
    let mut config = TrainConfig::new(model);
    config.steps = 2;
    config.micro_batches = 2;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config.seed = 7;
    config
}

/// A root holding step 2 of the run above; returns the step's directory.
fn saved(name: &str) -> PathBuf {
    let root =
        std::env::temp_dir().join(format!("hybridgen-ckpt-lib-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut c = config();
    c.save = Some(root.clone());
    train(&c, &mut |_| {}).unwrap_or_else(|e| panic!("{e}"));
    root.join("step-000002")
}

/// The error of resuming from `dir` (no step may run).
fn resume_error(dir: &Path) -> String {
    let mut c = config();
    c.steps = 3;
    c.resume = Some(ResumeFrom::Dir(dir.to_path_buf()));
    let err = train(&c, &mut |_| panic!("no step may run"))
        .unwrap_err()
        .to_string();
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    err
}

/// Rewrites the index with `edit` applied, sealed again, as a forger (or a
/// buggy tool) would: the seal alone does not make an index trusted.
fn forge_index(dir: &Path, edit: impl Fn(&mut Value)) {
    let path = dir.join(checkpoint::INDEX);
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let before = index.clone();
    edit(&mut index);
    assert_ne!(index, before, "the edit changed nothing");
    // `crc32c` stays the first field: keys print sorted, and it sorts first.
    let text = format!("{}\n", serde_json::to_string_pretty(&index).unwrap());
    std::fs::write(&path, checkpoint::seal(&text).unwrap()).unwrap();
}

fn flip_byte(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x10;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn an_untouched_checkpoint_verifies_and_resumes() {
    // The baseline the refusals below are measured against.
    let dir = saved("untouched");
    let index = checkpoint::verify(&dir).unwrap();
    assert_eq!(index.step, 2);
    assert_eq!(index.run.seed, 7);
    let mut c = config();
    c.steps = 3;
    c.resume = Some(ResumeFrom::Dir(dir.clone()));
    let summary = train(&c, &mut |_| {}).unwrap();
    assert_eq!((summary.resumed_from, summary.last_step), (Some(2), 3));
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn a_flipped_byte_in_a_rank_file_names_the_file_and_the_tensor() {
    let dir = saved("flip-data");
    let file = dir.join("rank-00001.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    // The tensor whose data holds the file's last byte.
    let (header, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    let data_len = bytes.len() - 8 - header;
    let last = metadata
        .tensors()
        .into_iter()
        .find(|(_, info)| info.data_offsets.1 == data_len)
        .map(|(name, _)| name)
        .unwrap();
    flip_byte(&file, bytes.len() - 1);
    let err = resume_error(&dir);
    assert!(err.contains("rank-00001.safetensors"), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(
        err.contains(&format!("the damage is in tensor `{last}`")),
        "{err}"
    );
}

#[test]
fn a_flipped_byte_in_a_rank_file_header_is_found() {
    let dir = saved("flip-header");
    // Byte 20 lies in the JSON header, past its 8-byte length.
    flip_byte(&dir.join("rank-00000.safetensors"), 20);
    let err = resume_error(&dir);
    assert!(err.contains("rank-00000.safetensors"), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(err.contains("header"), "{err}");
}

#[test]
fn a_truncated_rank_file_is_refused() {
    let dir = saved("truncated");
    let file = dir.join("rank-00001.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = resume_error(&dir);
    assert!(err.contains("rank-00001.safetensors"), "{err}");
    assert!(err.contains("but the index records"), "{err}");
}

#[test]
fn a_flipped_byte_in_the_index_is_found() {
    // A digit of the seed: still valid JSON, a silently different run
    // without the index's own checksum.
    let dir = saved("flip-index");
    let path = dir.join(checkpoint::INDEX);
    let text = std::fs::read_to_string(&path).unwrap();
    let at = text.find("\"seed\": 7").unwrap() + "\"seed\": ".len();
    flip_byte(&path, at);
    let err = resume_error(&dir);
    assert!(err.contains("checkpoint.json"), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
}

#[test]
fn index_file_names_must_stay_inside_the_checkpoint() {
    for (case, name) in [
        ("up", "../../../etc/passwd"),
        ("absolute", "/etc/passwd"),
        ("dot", ".."),
    ] {
        let dir = saved(&format!("path-{case}"));
        forge_index(&dir, |index| {
            let files = index["files"].as_object_mut().unwrap();
            let entry = files.remove("rank-00000.safetensors").unwrap();
            files.insert(name.to_string(), entry);
            for tensor in index["tensors"].as_object_mut().unwrap().values_mut() {
                for piece in tensor["pieces"].as_array_mut().unwrap() {
                    if piece["file"] == "rank-00000.safetensors" {
                        piece["file"] = json!(name);
                    }
                }
            }
        });
        let err = resume_error(&dir);
        assert!(err.contains("not a plain file name"), "{name}: {err}");
    }
}

/// A change to an index's JSON.
type IndexEdit = fn(&mut Value);

#[test]
fn numbers_out_of_range_are_refused() {
    let cases: [(&str, IndexEdit, &str); 6] = [
        ("step", |i| i["step"] = json!(u64::MAX), "out of range"),
        (
            "ranks",
            |i| i["layout"]["ranks"] = json!(0),
            "is impossible",
        ),
        ("ep", |i| i["layout"]["ep"] = json!(3), "is impossible"),
        (
            "piece",
            |i| i["tensors"]["output_layer.weight"]["pieces"][1]["end"] = json!(u64::MAX),
            "must cover it exactly once",
        ),
        (
            "shape",
            |i| i["tensors"]["embedding.word_embeddings.weight"]["shape"][0] = json!(u64::MAX),
            "over 2^48 elements",
        ),
        (
            "batch",
            |i| i["run"]["micro_batches"] = json!(0),
            "must all be at least 1",
        ),
    ];
    for (case, edit, message) in cases {
        let dir = saved(&format!("range-{case}"));
        forge_index(&dir, edit);
        let err = resume_error(&dir);
        assert!(err.contains(message), "{case}: {err}");
        assert!(err.contains("checkpoint.json"), "{case}: {err}");
    }
}

#[test]
fn shapes_must_be_the_models() {
    let dir = saved("shape-plan");
    // The embedding as 128 x 128: as many elements, pieces intact, another
    // model.
    forge_index(&dir, |index| {
        index["tensors"]["embedding.word_embeddings.weight"]["shape"] = json!([128, 128]);
    });
    let err = resume_error(&dir);
    assert!(
        err.contains("tensor `embedding.word_embeddings.weight` has shape [128, 128]"),
        "{err}"
    );
}

#[test]
fn a_step_directory_must_hold_its_step() {
    let dir = saved("renamed");
    let renamed = dir.with_file_name("step-000003");
    std::fs::rename(&dir, &renamed).unwrap();
    let err = resume_error(&renamed);
    assert!(err.contains("named for step 3"), "{err}");
}

#[test]
fn an_oversized_index_is_not_read() {
    let dir = saved("oversized");
    // A sparse terabyte: refused from its size, without reading it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(checkpoint::INDEX))
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let err = resume_error(&dir);
    assert!(err.contains("over 256 MiB"), "{err}");
}

#[test]
fn settings_left_to_the_checkpoint_are_taken_from_it() {
    let dir = saved("inherit");
    let mut straight = config();
    straight.steps = 4;
    // Each step's loss, aux loss and gradient norm, as bits.
    let bits = |r: &StepReport| [r.loss, r.aux_loss, r.grad_norm].map(f64::to_bits);
    let mut reference = Vec::new();
    train(&straight, &mut |r| reference.push(bits(r))).unwrap();
    // Another seed, batch shape and learning rate, all left to the
    // checkpoint: the run continues the seed-7 curve.
    let mut c = config();
    c.steps = 4;
    c.seed = 0;
    c.micro_batches = 5;
    c.seq_length = 32;
    c.optimizer.lr = 0.1;
    c.resume = Some(ResumeFrom::Dir(dir.clone()));
    c.from_checkpoint = Setting::ALL.into_iter().collect();
    let prepared = hybridgen_runtime::train::prepare(&c).unwrap();
    let inherited = &prepared.checkpoints.resume.as_ref().unwrap().inherited;
    for setting in [
        "config.seed = 7",
        "config.micro_batches = 2",
        "config.seq_length = 16",
        "config.optimizer.lr = 0.003",
    ] {
        assert!(inherited.iter().any(|s| s == setting), "{inherited:?}");
    }
    drop(prepared);
    let mut resumed = Vec::new();
    train(&c, &mut |r| resumed.push(bits(r))).unwrap();
    assert_eq!(resumed[..], reference[2..]);
    // Given explicitly, the same values are contradictions.
    c.from_checkpoint.clear();
    let err = train(&c, &mut |_| panic!("no step may run"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.seed is 0 but"), "{err}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn a_layout_left_out_is_the_checkpoints_where_it_fits() {
    let root =
        std::env::temp_dir().join(format!("hybridgen-ckpt-lib-{}-layout", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut c = config();
    (c.ranks, c.ep) = (4, 4);
    c.save = Some(root.clone());
    train(&c, &mut |_| {}).unwrap();
    // Only the layout left out: four ranks and ep 4 come from the checkpoint.
    let mut c = config();
    c.steps = 3;
    c.resume = Some(ResumeFrom::Dir(root.clone()));
    c.from_checkpoint = [Setting::Ranks, Setting::Ep].into();
    let prepared = hybridgen_runtime::train::prepare(&c).unwrap();
    assert_eq!((prepared.config.ranks, prepared.config.ep), (4, 4));
    drop(prepared);
    // Two ranks given: ep 4 cannot divide them, so this run's ep 2 stays.
    c.ranks = 2;
    c.from_checkpoint = [Setting::Ep].into();
    let prepared = hybridgen_runtime::train::prepare(&c).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((prepared.config.ranks, prepared.config.ep), (2, 2));
    drop(prepared);
    let _ = std::fs::remove_dir_all(&root);
}

/// A fresh scratch root for `name`.
fn scratch_root(name: &str) -> PathBuf {
    let root =
        std::env::temp_dir().join(format!("hybridgen-ckpt-lib-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

/// Two ranks, experts split between them, saving every second step.
fn two_ranks_saving(root: &Path, async_save: bool) -> TrainConfig {
    let mut c = config();
    c.ranks = 2;
    c.ep = 2;
    c.steps = 5;
    c.save_every = Some(2);
    c.save = Some(root.to_path_buf());
    c.async_save = async_save;
    c
}

/// Files written behind the steps are the streamed save's bytes, at every
/// step saved (2 and 4 behind the steps, 5 at the end) and on every rank;
/// each rank file's data is exactly the host copy `snapshot_bytes` counts
/// (what the memory check allows for).
#[test]
fn an_async_save_writes_the_bytes_a_streamed_save_writes() {
    let (streamed, behind) = (scratch_root("streamed"), scratch_root("behind"));
    let plain = train(&two_ranks_saving(&streamed, false), &mut |_| {}).unwrap();
    let summary = train(&two_ranks_saving(&behind, true), &mut |_| {}).unwrap();
    assert_eq!(summary.param_hash, plain.param_hash);
    assert_eq!(summary.saved_to, Some(behind.join("step-000005")));
    // Steps 2 and 4 behind the steps; 5, the last, streamed.
    assert_eq!((plain.saves_behind, summary.saves_behind), (0, 2));
    let plan = prepare(&two_ranks_saving(&scratch_root("plan"), true))
        .unwrap()
        .plan;
    let layout = ShardLayout {
        sharding: config().sharding,
        world: 2,
        ep: 2,
    };
    for step in ["step-000002", "step-000004", "step-000005"] {
        checkpoint::verify(&behind.join(step)).unwrap();
        for file in [
            "checkpoint.json",
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ] {
            let (a, b) = (behind.join(step).join(file), streamed.join(step).join(file));
            assert!(
                std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                "{} differs from the streamed save's",
                a.display()
            );
        }
        for r in 0..2 {
            let bytes =
                std::fs::read(behind.join(step).join(format!("rank-0000{r}.safetensors"))).unwrap();
            let (header, _) = SafeTensors::read_metadata(&bytes).unwrap();
            let copy = checkpoint::snapshot_bytes(&plan, &layout, OptimizerKind::Adam, r);
            assert_eq!((bytes.len() - 8 - header) as u64, copy, "rank {r}");
        }
    }
    for root in [streamed, behind, scratch_root("plan")] {
        let _ = std::fs::remove_dir_all(root);
    }
}

/// A last step's save streams (it would be waited for at once), after the
/// save still in flight is committed: `latest` names the last step.
#[test]
fn a_save_in_flight_is_committed_before_the_last_steps() {
    let root = scratch_root("in-order");
    let mut c = two_ranks_saving(&root, true);
    c.steps = 4;
    let summary = train(&c, &mut |_| {}).unwrap();
    assert_eq!(summary.saved_to, Some(root.join("step-000004")));
    assert_eq!(summary.saves_behind, 1);
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap(),
        "step-000004\n"
    );
    for step in ["step-000002", "step-000004"] {
        checkpoint::verify(&root.join(step)).unwrap();
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// `async_save` needs a save root, and host memory for its copies beside
/// the run's own need: one byte short is refused before anything is
/// written, naming the way out; exactly enough runs.
#[test]
fn an_async_save_needs_a_root_and_host_memory_for_its_copy() {
    let root = scratch_root("async-memory");
    let mut c = two_ranks_saving(&root, true);
    c.recompute = Recompute::None;
    c.save = None;
    c.save_every = None;
    let err = prepare(&c).err().unwrap().to_string();
    assert!(err.contains("give config.save"), "{err}");

    c.save = Some(root.clone());
    let plan = prepare(&c).unwrap().plan;
    let _ = std::fs::remove_dir_all(&root);
    let layout = ShardLayout {
        sharding: c.sharding,
        world: 2,
        ep: 2,
    };
    let copies: u64 = (0..2)
        .map(|r| checkpoint::snapshot_bytes(&plan, &layout, OptimizerKind::Adam, r))
        .sum();
    let need = memory_need(&c, &plan).unwrap().total;
    c.memory_available = Some(need + copies - 1);
    let err = prepare(&c).err().unwrap().to_string();
    assert!(err.contains("config.async_save keeps a copy"), "{err}");
    assert!(err.contains("leave out config.async_save"), "{err}");
    assert!(!root.exists(), "a refused run made its save root");
    c.memory_available = Some(need + copies);
    prepare(&c).unwrap();
    let _ = std::fs::remove_dir_all(&root);
}

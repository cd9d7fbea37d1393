//! Checkpoints under pipeline parallelism, on the CPU: every world rank
//! writes the pieces of its stages' buckets (the shared embedding once, by
//! the first stage's ranks), and a checkpoint written at one pipeline size
//! resumes at another.
//!
//! A pattern's stages train the same model at every pipeline size, bit for
//! bit (`tests/pipeline.rs`), so a run saved at one pipeline size and
//! resumed at another (the same data-parallel and expert-parallel sizes, so
//! the same batches) continues the uninterrupted run at the reader's layout
//! bit for bit: losses, aux losses, gradient norms and the final
//! parameters. Where
//! the last stage needs the embedding table too (MTP depths), its gradient
//! is summed across two stages in another order than one rank adds it, so
//! runs of different pipeline sizes drift apart by rounding: a resume at
//! another pipeline size stays within `tests/pipeline.rs`'s tolerances of
//! the reader's uninterrupted run, and a resume at the writer's own layout
//! continues it bit for bit.

use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::checkpoint::{self, ResumeFrom};
use hybridgen_runtime::fsdp::{ShardLayout, Sharding};
use hybridgen_runtime::optimizer::OptimizerKind;
use hybridgen_runtime::setting::Setting;
use hybridgen_runtime::train::{StepReport, TrainConfig, TrainSummary, prepare, train};
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How a run's ranks are laid out: `pp` stages of `dp` data-parallel ranks,
/// expert parallelism `ep` within a stage.
#[derive(Clone, Copy, Debug)]
struct Layout {
    pp: usize,
    dp: usize,
    ep: usize,
}

const fn at(pp: usize, dp: usize, ep: usize) -> Layout {
    Layout { pp, dp, ep }
}

/// The tiny preset with `pattern`, short sequences, at `layout`.
fn config(pattern: &str, layout: Layout) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let mut config = TrainConfig::new(model);
    config.micro_batches = 4;
    config.micro_batch_size = 2;
    config.seq_length = 16;
    config.seed = 7;
    config.pp = layout.pp;
    config.ranks = layout.pp * layout.dp;
    config.ep = layout.ep;
    config
}

/// A fresh scratch root for `name`.
fn scratch_root(name: &str) -> PathBuf {
    let root =
        std::env::temp_dir().join(format!("hybridgen-pp-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

fn run(config: &TrainConfig) -> (Vec<StepReport>, TrainSummary) {
    let mut reports = Vec::new();
    let summary = train(config, &mut |r| reports.push(r.clone())).unwrap_or_else(|e| {
        panic!(
            "pp {} ranks {} ep {}: {e}",
            config.pp, config.ranks, config.ep
        )
    });
    (reports, summary)
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
}

/// Trains `pattern` for 2 steps at `writer`, saving; checks the checkpoint
/// and that its index records the writer's layout; resumes it at `reader`
/// for 2 more steps and compares those with 4 uninterrupted steps at
/// `reader`: bit for bit where `exact`, else within the pipeline tests'
/// tolerances.
fn resharded(pattern: &str, writer: Layout, reader: Layout, exact: bool) {
    let case = format!("{pattern}: {writer:?} -> {reader:?}");
    let root = scratch_root(&format!(
        "reshard-{}-{}-{}-{}-{}-{}",
        writer.pp, writer.dp, writer.ep, reader.pp, reader.dp, reader.ep
    ));
    let mut first = config(pattern, writer);
    first.steps = 2;
    first.save = Some(root.clone());
    let (_, saved) = run(&first);
    let step = root.join("step-000002");
    assert_eq!(saved.saved_to.as_deref(), Some(step.as_path()), "{case}");
    let index = checkpoint::verify(&step).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_eq!(
        (index.layout.ranks, index.layout.pp, index.layout.ep),
        (writer.pp * writer.dp, writer.pp, writer.ep),
        "{case}"
    );
    assert_eq!(index.files.len(), writer.pp * writer.dp, "{case}");

    let mut second = config(pattern, reader);
    second.steps = 4;
    second.resume = Some(ResumeFrom::Dir(root.clone()));
    let (resumed, summary) = run(&second);
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(summary.resumed_from, Some(2), "{case}");
    assert_eq!(
        resumed.iter().map(|r| r.step).collect::<Vec<_>>(),
        [3, 4],
        "{case}"
    );

    let mut straight = config(pattern, reader);
    straight.steps = 4;
    let (want, want_summary) = run(&straight);
    for (w, g) in want[2..].iter().zip(&resumed) {
        let step = g.step;
        if exact {
            let bits = |r: &StepReport| {
                [
                    r.loss.to_bits(),
                    r.mtp_loss.map_or(0, f64::to_bits),
                    r.aux_loss.to_bits(),
                    r.grad_norm.to_bits(),
                ]
            };
            assert_eq!(bits(w), bits(g), "{case} step {step}: {w:?} {g:?}");
        } else {
            assert!(
                close(w.loss, g.loss, 1e-5),
                "{case} step {step}: {w:?} {g:?}"
            );
            assert!(
                close(w.mtp_loss.unwrap(), g.mtp_loss.unwrap(), 1e-5),
                "{case} step {step}: {w:?} {g:?}"
            );
            assert!(
                close(w.aux_loss, g.aux_loss, 1e-4),
                "{case} step {step}: {w:?} {g:?}"
            );
            assert!(
                close(w.grad_norm, g.grad_norm, 1e-4),
                "{case} step {step}: {w:?} {g:?}"
            );
        }
    }
    if exact {
        assert_eq!(
            summary.param_hash, want_summary.param_hash,
            "{case}: final parameters"
        );
    }
}

#[test]
fn two_stages_resume_on_one_and_one_on_two() {
    let pattern = "M[*E]|M-[*E]";
    resharded(pattern, at(2, 1, 1), at(1, 1, 1), true);
    resharded(pattern, at(1, 1, 1), at(2, 1, 1), true);
    // Two ranks a stage, their experts split.
    resharded(pattern, at(2, 2, 2), at(1, 2, 2), true);
}

#[test]
fn four_stages_reshard_to_two_and_back() {
    // Four segments: one a rank at pp 4, two virtual stages a rank at pp 2.
    let pattern = "[ME]*|E[*E]|M-|[*E]E";
    resharded(pattern, at(2, 1, 1), at(4, 1, 1), true);
    resharded(pattern, at(4, 1, 1), at(2, 1, 1), true);
}

#[test]
fn a_shared_embedding_reshards_across_pipeline_sizes() {
    let pattern = "M[*E]|M-[*E]/*E";
    // At the writer's own layout the run goes on bit for bit.
    resharded(pattern, at(2, 2, 2), at(2, 2, 2), true);
    // At another pipeline size, the embedding's gradient is summed in
    // another order: the runs agree within the pipeline's tolerances.
    resharded(pattern, at(2, 2, 2), at(1, 2, 2), false);
    resharded(pattern, at(1, 2, 2), at(2, 2, 2), false);
}

/// `no_shard` stages reshard onto ZeRO-3 without a pipeline (`no_shard`
/// and ZeRO-3 give the same bits): under `no_shard` each stage's first
/// rank writes its buckets whole.
#[test]
fn unsharded_stages_reshard_onto_zero3() {
    let pattern = "M[*E]|M-[*E]";
    let root = scratch_root("no-shard");
    let mut first = config(pattern, at(2, 2, 1));
    first.sharding = Sharding::NoShard;
    first.steps = 2;
    first.save = Some(root.clone());
    run(&first);
    let mut second = config(pattern, at(1, 2, 1));
    second.steps = 4;
    second.resume = Some(ResumeFrom::Dir(root.clone()));
    let (resumed, summary) = run(&second);
    let _ = std::fs::remove_dir_all(&root);
    let mut straight = config(pattern, at(1, 2, 1));
    straight.steps = 4;
    let (want, want_summary) = run(&straight);
    let losses = |r: &[StepReport]| r.iter().map(|r| r.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(losses(&resumed), losses(&want[2..]));
    assert_eq!(summary.param_hash, want_summary.param_hash);
}

/// The tensor names of a rank file, with their lengths in elements.
fn stored(path: &Path) -> BTreeMap<String, usize> {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().len() / 4))
        .collect()
}

/// A pp 2 checkpoint of a model whose last stage shares the embedding: the
/// index lists each key's elements exactly once (the embedding written by
/// the first stage's ranks alone), the files are named by world rank, each
/// file holds its stage's pieces only, and the expert biases are written
/// once, by world rank 0.
#[test]
fn a_pipeline_checkpoint_lists_each_element_once() {
    let pattern = "M[*E]|M-[*E]/*E";
    let (writer, root) = (at(2, 2, 2), scratch_root("index"));
    let mut c = config(pattern, writer);
    c.steps = 1;
    c.save = Some(root.clone());
    let moe = c.model.moe.as_mut().unwrap();
    moe.score_function = hybridgen_dsl::config::ScoreFunction::Sigmoid;
    moe.expert_bias = true;
    moe.expert_bias_update_rate = 1e-3;
    let mut plan_config = c.clone();
    plan_config.save = None;
    let plan = prepare(&plan_config).unwrap().plan;
    assert!(plan.shares_embedding());
    run(&c);
    let step = root.join("step-000001");
    let index = checkpoint::verify(&step).unwrap();
    let files: Vec<String> = (0..4).map(|w| format!("rank-{w:05}.safetensors")).collect();
    assert_eq!(
        index.files.keys().collect::<Vec<_>>(),
        files.iter().collect::<Vec<_>>()
    );
    let in_files: Vec<BTreeMap<String, usize>> =
        files.iter().map(|f| stored(&step.join(f))).collect();
    // The world rank of each file: pipeline rank w / dp.
    let pp_rank = |file: &str| files.iter().position(|f| f == file).unwrap() / writer.dp;
    let writing = |key: &str| {
        let param = plan
            .params
            .iter()
            .enumerate()
            .find(|(_, p)| (0..writer.ep).any(|e| plan.checkpoint_key(p, e) == key))
            .map(|(i, _)| i);
        param.map(|p| {
            let bucket = &plan.buckets[plan.params[p].bucket];
            let stage = plan.bucket_stages(bucket).next().unwrap();
            plan.stages[stage].pp_rank
        })
    };
    let mut biases = 0;
    for (key, entry) in &index.tensors {
        let numel: usize = entry.shape.iter().product();
        let mut pieces: Vec<_> = entry.pieces.iter().collect();
        pieces.sort_by_key(|p| p.start);
        let mut next = 0;
        for piece in pieces {
            assert_eq!(piece.start, next, "{key}: elements listed twice or missed");
            next = piece.end;
            // The file holds the piece, with its moments.
            let held = &in_files[files.iter().position(|f| *f == piece.file).unwrap()];
            assert_eq!(
                held.get(&format!("param/{key}")),
                Some(&(piece.end - piece.start))
            );
            match writing(key) {
                Some(stage) => {
                    assert_eq!(pp_rank(&piece.file), stage, "{key} in {}", piece.file);
                    assert!(held.contains_key(&format!("exp_avg/{key}")), "{key}");
                }
                None => {
                    assert!(key.ends_with(".mlp.router.expert_bias"), "{key}");
                    assert_eq!(piece.file, files[0], "{key}");
                    biases += 1;
                }
            }
        }
        assert_eq!(next, numel, "{key}");
    }
    let routers = index
        .tensors
        .keys()
        .filter(|k| k.ends_with(".mlp.router.weight"))
        .count();
    assert!(routers >= 2);
    assert_eq!(biases, routers, "one bias a MoE layer, every stage's");
    // The embedding: once, on the first stage's ranks only.
    let embedding = &index.tensors["embedding.word_embeddings.weight"];
    assert!(embedding.pieces.iter().all(|p| pp_rank(&p.file) == 0));
    // Nothing in the files but what the index lists.
    let listed: usize = index
        .tensors
        .values()
        .flat_map(|e| &e.pieces)
        .map(|p| p.end - p.start)
        .sum();
    let params: usize = in_files
        .iter()
        .flat_map(|f| f.iter())
        .filter(|(name, _)| name.starts_with("param/"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(params, listed);
    let _ = std::fs::remove_dir_all(&root);
}

/// Rewrites the index of checkpoint `step` with its layout's `pp` set,
/// sealed again.
fn forge_pp(step: &Path, pp: usize) {
    let path = step.join(checkpoint::INDEX);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut index: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(index["layout"].get("pp").is_none(), "pp 1 is not written");
    index["layout"]["pp"] = serde_json::json!(pp);
    let text = format!("{}\n", serde_json::to_string_pretty(&index).unwrap());
    std::fs::write(&path, checkpoint::seal(&text).unwrap()).unwrap();
}

/// Under a pipeline, a save behind the steps (its progress exchanged over
/// every stage's ranks) writes the bytes a streamed save writes, and each
/// world rank's file holds exactly the host copy `snapshot_bytes` counts
/// for that world rank (what the memory check allows for).
#[test]
fn an_async_save_across_stages_writes_the_streamed_bytes() {
    let pattern = "M[*E]|M-[*E]/*E";
    let (streamed, behind) = (scratch_root("streamed"), scratch_root("behind"));
    let saving = |root: &Path, async_save: bool| {
        let mut c = config(pattern, at(2, 2, 2));
        c.steps = 4;
        c.save_every = Some(2);
        c.save = Some(root.to_path_buf());
        c.async_save = async_save;
        c
    };
    let plain = run(&saving(&streamed, false)).1;
    let summary = run(&saving(&behind, true)).1;
    assert_eq!(summary.param_hash, plain.param_hash);
    // Step 2 behind the steps; 4, the last, streamed.
    assert_eq!((plain.saves_behind, summary.saves_behind), (0, 1));
    let mut c = saving(&behind, true);
    c.save = None;
    c.async_save = false;
    let plan = prepare(&c).unwrap().plan;
    let layout = ShardLayout::of(&plan, c.sharding);
    for step in ["step-000002", "step-000004"] {
        checkpoint::verify(&behind.join(step)).unwrap();
        let mut names = vec![checkpoint::INDEX.to_string()];
        names.extend((0..4).map(|w| format!("rank-{w:05}.safetensors")));
        for file in &names {
            let (a, b) = (behind.join(step).join(file), streamed.join(step).join(file));
            assert!(
                std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                "{} differs from the streamed save's",
                a.display()
            );
        }
        for w in 0..4 {
            let bytes = std::fs::read(behind.join(step).join(&names[w + 1])).unwrap();
            let (header, _) = SafeTensors::read_metadata(&bytes).unwrap();
            let copy = checkpoint::snapshot_bytes(&plan, &layout, OptimizerKind::Adam, w);
            assert_eq!((bytes.len() - 8 - header) as u64, copy, "world rank {w}");
        }
    }
    for root in [streamed, behind] {
        let _ = std::fs::remove_dir_all(root);
    }
}

/// A resume that leaves the pipeline size out takes the checkpoint's where
/// it divides the ranks (as it takes the ranks and ep), and one given may
/// differ from the checkpoint's: checkpoints reshard. (Settling reads the
/// index alone: a pp 1 checkpoint of 4 ranks is made to say pp 2.)
#[test]
fn a_pipeline_size_left_out_is_the_checkpoints_where_it_fits() {
    let pattern = "M[*E]|M-[*E]";
    let root = scratch_root("settle");
    let mut c = config(pattern, at(1, 4, 2));
    c.steps = 1;
    c.save = Some(root.clone());
    run(&c);
    forge_pp(&root.join("step-000001"), 2);
    let mut c = config(pattern, at(1, 1, 1));
    c.steps = 2;
    c.resume = Some(ResumeFrom::Dir(root.clone()));
    c.from_checkpoint = [Setting::Ranks, Setting::Pp, Setting::Ep].into();
    let prepared = prepare(&c).unwrap_or_else(|e| panic!("{e}"));
    let settled = &prepared.config;
    assert_eq!((settled.ranks, settled.pp, settled.ep), (4, 2, 2));
    let inherited = &prepared.checkpoints.resume.as_ref().unwrap().inherited;
    assert!(
        inherited.iter().any(|s| s == "config.pp = 2"),
        "{inherited:?}"
    );
    drop(prepared);
    // Two ranks given: pp 2 divides them, ep 2 not their one rank a stage.
    c.ranks = 2;
    c.from_checkpoint = [Setting::Pp, Setting::Ep].into();
    let prepared = prepare(&c).unwrap_or_else(|e| panic!("{e}"));
    let settled = &prepared.config;
    assert_eq!((settled.ranks, settled.pp, settled.ep), (2, 2, 1));
    drop(prepared);
    // Three ranks given: pp 2 cannot divide them, so this run's pp 1 stays.
    c.ranks = 3;
    let prepared = prepare(&c).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((prepared.config.ranks, prepared.config.pp), (3, 1));
    drop(prepared);
    // Given, another pipeline size is a layout change, not a contradiction.
    c.ranks = 4;
    c.from_checkpoint.clear();
    let prepared = prepare(&c).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((prepared.config.ranks, prepared.config.pp), (4, 1));
    drop(prepared);
    let _ = std::fs::remove_dir_all(&root);
}

/// An index whose pipeline size cannot lay out its ranks is damaged.
#[test]
fn an_impossible_pipeline_size_is_refused() {
    let pattern = "M[*E]|M-[*E]";
    let root = scratch_root("forged-pp");
    let mut c = config(pattern, at(1, 2, 2));
    c.steps = 1;
    c.save = Some(root.clone());
    run(&c);
    let step = root.join("step-000001");
    // ep 2 cannot divide the one rank a stage of pp 2 leaves.
    forge_pp(&step, 2);
    let err = checkpoint::verify(&step).unwrap_err().to_string();
    assert!(
        err.contains("pp 2") && err.contains("is impossible"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

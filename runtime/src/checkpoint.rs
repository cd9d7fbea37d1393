//! Checkpoints (shared/spec/runtime.md): sharded safetensors for tensors plus
//! one small JSON for the plan, the step and what a resume needs.
//!
//! Each rank writes the pieces of parameters it owns, under their checkpoint
//! keys (groups flattened, experts by global index; pattern.md), with its
//! optimizer moments beside them. The JSON index says which file holds which
//! element range of each key, so a checkpoint can be loaded onto another
//! layout (other rank counts, ZeRO-3 or `no_shard`) as well as the one that
//! wrote it. Everything is written under a temporary name and renamed into
//! place once complete, so a crash never leaves a torn checkpoint.
//!
//! Batches are a function of (seed, step, rank, micro-batch) and routing is
//! deterministic, so the step and the seed are all the state a resume needs
//! beyond the tensors: resuming continues the same loss curve bit for bit.

use crate::backend::Backend;
use crate::collective::Collective;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::{FsdpEngine, ShardLayout, Sharding};
use crate::optimizer::{Optimizer, OptimizerKind};
use hybridgen_dsl::{ModelConfig, Plan};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "hybridgen-checkpoint";
pub const VERSION: u32 = 1;
const INDEX: &str = "checkpoint.json";

/// What the JSON index records.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointIndex {
    pub format: String,
    pub version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// The run's seed (data and initialisation).
    pub seed: u64,
    /// The canonical pattern the tensors belong to.
    pub pattern: String,
    pub model: ModelConfig,
    pub ranks: usize,
    pub ep: usize,
    pub sharding: Sharding,
    pub optimizer: OptimizerKind,
    /// Free-form settings of the run that wrote it (for people).
    pub run: serde_json::Value,
    /// Per checkpoint key: its shape and where its elements are.
    pub tensors: BTreeMap<String, TensorEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorEntry {
    pub shape: Vec<usize>,
    pub pieces: Vec<Piece>,
}

/// Elements `[start, end)` of a flattened parameter, in file `file`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Piece {
    pub file: String,
    pub start: usize,
    pub end: usize,
}

/// One owned piece of one parameter on one rank.
struct OwnedPiece {
    key: String,
    /// Parameter index into `plan.params`.
    param: usize,
    /// Elements of the flattened parameter.
    elements: Range<usize>,
    /// Where they are in the rank's shard of the bucket.
    in_shard: Range<usize>,
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Whether world rank `r` writes the bucket kind at all: the ranks holding
/// an EP rank's copy of a bucket write it (under `no_shard`, only the first
/// of each group, since every rank holds whole buckets).
fn writes(layout: &ShardLayout, expert: bool, r: usize) -> bool {
    layout.holders(expert, r % layout.ep.max(1)).contains(&r)
}

/// The pieces world rank `r` holds: what it loads. Computable for any
/// rank, so rank 0 can write the whole index without asking the others.
fn held_pieces(plan: &Plan, layout: &ShardLayout, r: usize) -> Vec<(usize, OwnedPiece)> {
    let ep = layout.ep.max(1);
    let mut out = Vec::new();
    for bucket in plan.buckets.iter() {
        let owned = layout.owned_range(plan, bucket, r);
        for &p in bucket.params.iter() {
            let param = &plan.params[p];
            let span = param.offset..param.offset + plan.def(param).numel();
            let (start, end) = (span.start.max(owned.start), span.end.min(owned.end));
            if start < end {
                out.push((
                    bucket.id,
                    OwnedPiece {
                        key: plan.checkpoint_key(param, r % ep),
                        param: p,
                        elements: start - span.start..end - span.start,
                        in_shard: start - owned.start..end - owned.start,
                    },
                ));
            }
        }
    }
    out
}

/// The pieces world rank `r` writes: those it holds, once per copy.
fn written_pieces(plan: &Plan, layout: &ShardLayout, r: usize) -> Vec<(usize, OwnedPiece)> {
    held_pieces(plan, layout, r)
        .into_iter()
        .filter(|(b, _)| writes(layout, plan.buckets[*b].expert, r))
        .collect()
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The tensor names a piece is stored under in its rank file.
fn names(key: &str) -> [String; 3] {
    [
        format!("param/{key}"),
        format!("exp_avg/{key}"),
        format!("exp_avg_sq/{key}"),
    ]
}

/// What a checkpoint records besides tensors.
#[derive(Clone, Debug)]
pub struct CheckpointMeta {
    /// Optimizer steps completed.
    pub step: u64,
    pub seed: u64,
    /// The run's settings, for people.
    pub run: serde_json::Value,
}

/// Writes a checkpoint of the state after `meta.step` steps into `dir`.
/// Every rank calls it (it synchronises them).
pub fn save<D: Device>(
    dir: &Path,
    meta: &CheckpointMeta,
    plan: &Plan,
    engine: &FsdpEngine<D>,
    optimizer: &Optimizer<D>,
    rank: &RankContext<D>,
) -> Result<()> {
    let tmp = sibling(dir, "tmp")?;
    if rank.rank == 0 {
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| RuntimeError::io(tmp.display(), e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| RuntimeError::io(tmp.display(), e))?;
    }
    rank.host.barrier()?;

    // This rank's file.
    let backend = &rank.backend;
    let ep = rank.ep.max(1);
    let mut tensors: Vec<(String, Vec<u8>, usize)> = Vec::new();
    for (b, piece) in written_pieces(plan, &engine.layout(), rank.rank) {
        let shard = &engine.shards()[b];
        let state = &optimizer.states()[b];
        let [p, m, v] = names(&piece.key);
        let read = |buf: &<D::Backend as Backend>::Buf| -> Result<Vec<u8>> {
            let mut host = vec![0.0f32; piece.in_shard.len()];
            backend.download(backend.slice(buf, piece.in_shard.clone())?, &mut host)?;
            Ok(to_bytes(&host))
        };
        let n = piece.in_shard.len();
        tensors.push((p, read(&shard.master)?, n));
        tensors.push((m, read(&state.exp_avg)?, n));
        if backend.buf_len(&state.exp_avg_sq) > 0 {
            tensors.push((v, read(&state.exp_avg_sq)?, n));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, bytes, n)| {
            TensorView::new(Dtype::F32, vec![*n], bytes)
                .map(|view| (name.clone(), view))
                .map_err(|e| RuntimeError::io(name, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let file = tmp.join(rank_file(rank.rank));
    safetensors::serialize_to_file(views, None, &file)
        .map_err(|e| RuntimeError::io(file.display(), e))?;
    rank.host.barrier()?;

    if rank.rank == 0 {
        let mut entries: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for r in 0..rank.world {
            for (_, piece) in written_pieces(plan, &engine.layout(), r) {
                let shape = plan.def(&plan.params[piece.param]).shape.to_vec();
                entries
                    .entry(piece.key)
                    .or_insert_with(|| TensorEntry {
                        shape,
                        pieces: Vec::new(),
                    })
                    .pieces
                    .push(Piece {
                        file: rank_file(r),
                        start: piece.elements.start,
                        end: piece.elements.end,
                    });
            }
        }
        let index = CheckpointIndex {
            format: FORMAT.to_string(),
            version: VERSION,
            step: meta.step,
            seed: meta.seed,
            pattern: plan.pattern.canonical(),
            model: plan.model.clone(),
            ranks: rank.world,
            ep,
            sharding: engine.sharding(),
            optimizer: optimizer.config().kind,
            run: meta.run.clone(),
            tensors: entries,
        };
        let text = serde_json::to_string_pretty(&index).map_err(|e| RuntimeError::io(INDEX, e))?;
        let path = tmp.join(INDEX);
        std::fs::write(&path, text).map_err(|e| RuntimeError::io(path.display(), e))?;
        // Swap the complete checkpoint into place.
        let old = sibling(dir, "old")?;
        if dir.exists() {
            if old.exists() {
                std::fs::remove_dir_all(&old).map_err(|e| RuntimeError::io(old.display(), e))?;
            }
            std::fs::rename(dir, &old).map_err(|e| RuntimeError::io(dir.display(), e))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| RuntimeError::io(dir.display(), e))?;
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| RuntimeError::io(old.display(), e))?;
        }
    }
    rank.host.barrier()
}

/// `dir` with a suffix, next to it: `ckpt` -> `ckpt.tmp`.
fn sibling(dir: &Path, suffix: &str) -> Result<PathBuf> {
    let name = dir
        .file_name()
        .ok_or_else(|| RuntimeError::io(dir.display(), "a checkpoint needs a directory name"))?;
    let mut name = name.to_os_string();
    name.push(format!(".{suffix}"));
    Ok(dir.with_file_name(name))
}

/// Reads a checkpoint's index, checking it is one and fits `plan`.
pub fn read_index(dir: &Path, plan: &Plan) -> Result<CheckpointIndex> {
    let path = dir.join(INDEX);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        RuntimeError::io(
            path.display(),
            format!(
                "{e} (is {} a checkpoint written by `hybridgen train --save`?)",
                dir.display()
            ),
        )
    })?;
    let index: CheckpointIndex = serde_json::from_str(&text)
        .map_err(|e| RuntimeError::io(path.display(), format!("not a checkpoint index: {e}")))?;
    if index.format != FORMAT || index.version != VERSION {
        return Err(RuntimeError::io(
            path.display(),
            format!(
                "format {} v{} is not {FORMAT} v{VERSION}",
                index.format, index.version
            ),
        ));
    }
    if index.pattern != plan.pattern.canonical() {
        return Err(RuntimeError::Unsupported(format!(
            "the checkpoint in {} is of pattern {} but this run trains {}; resume with the model that wrote it",
            dir.display(),
            index.pattern,
            plan.pattern.canonical()
        )));
    }
    let mut theirs = index.model.clone();
    theirs.pattern = plan.model.pattern.clone();
    if theirs != plan.model {
        return Err(RuntimeError::Unsupported(format!(
            "the checkpoint in {} was written for other model dimensions; resume with the model file or preset that wrote it",
            dir.display()
        )));
    }
    Ok(index)
}

/// Loads the tensors of checkpoint `dir` into this rank's shards and
/// optimizer state, whatever layout wrote them. Returns the index.
pub fn load<D: Device>(
    dir: &Path,
    plan: &Plan,
    engine: &FsdpEngine<D>,
    optimizer: &mut Optimizer<D>,
    rank: &RankContext<D>,
) -> Result<CheckpointIndex> {
    let index = read_index(dir, plan)?;
    if index.optimizer != optimizer.config().kind {
        return Err(RuntimeError::Unsupported(format!(
            "the checkpoint in {} holds {:?} state but this run uses {:?}",
            dir.display(),
            index.optimizer,
            optimizer.config().kind
        )));
    }
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let backend = &rank.backend;
    for (b, piece) in held_pieces(plan, &engine.layout(), rank.rank) {
        let entry = index.tensors.get(&piece.key).ok_or_else(|| {
            RuntimeError::io(
                dir.join(INDEX).display(),
                format!("no tensor `{}` in the checkpoint", piece.key),
            )
        })?;
        let (shard, state) = (&engine.shards()[b], &optimizer.states()[b]);
        let [p, m, v] = names(&piece.key);
        let targets: [(&str, Option<&<D::Backend as Backend>::Buf>); 3] = [
            (&p, Some(&shard.master)),
            (&m, Some(&state.exp_avg)),
            (
                &v,
                (index.optimizer == OptimizerKind::Adam).then_some(&state.exp_avg_sq),
            ),
        ];
        for (name, target) in targets {
            let Some(target) = target else { continue };
            let values = assemble(dir, entry, name, &piece.elements, &mut files)?;
            backend.upload(&values, backend.slice_mut(target, piece.in_shard.clone())?)?;
        }
        backend.cast(
            backend.slice(&shard.master, piece.in_shard.clone())?,
            backend.slice_mut(&shard.param, piece.in_shard.clone())?,
        )?;
    }
    optimizer.set_steps(index.step);
    Ok(index)
}

/// Elements `want` of tensor `name` (one of a key's three), assembled from
/// the pieces of `entry` across rank files.
fn assemble(
    dir: &Path,
    entry: &TensorEntry,
    name: &str,
    want: &Range<usize>,
    files: &mut BTreeMap<String, Vec<u8>>,
) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; want.len()];
    let mut covered = 0;
    for piece in &entry.pieces {
        let (start, end) = (piece.start.max(want.start), piece.end.min(want.end));
        if start >= end {
            continue;
        }
        if !files.contains_key(&piece.file) {
            let path = dir.join(&piece.file);
            let bytes = std::fs::read(&path).map_err(|e| RuntimeError::io(path.display(), e))?;
            files.insert(piece.file.clone(), bytes);
        }
        let bytes = &files[&piece.file];
        let tensors = SafeTensors::deserialize(bytes)
            .map_err(|e| RuntimeError::io(dir.join(&piece.file).display(), e))?;
        let view = tensors.tensor(name).map_err(|e| {
            RuntimeError::io(dir.join(&piece.file).display(), format!("{name}: {e}"))
        })?;
        let values = from_bytes(view.data());
        if values.len() != piece.end - piece.start {
            return Err(RuntimeError::io(
                dir.join(&piece.file).display(),
                format!(
                    "{name} holds {} elements, the index says {}",
                    values.len(),
                    piece.end - piece.start
                ),
            ));
        }
        out[start - want.start..end - want.start]
            .copy_from_slice(&values[start - piece.start..end - piece.start]);
        covered += end - start;
    }
    if covered != want.len() {
        return Err(RuntimeError::io(
            dir.join(INDEX).display(),
            format!(
                "the pieces of {name} cover {covered} of the {} elements needed",
                want.len()
            ),
        ));
    }
    Ok(out)
}

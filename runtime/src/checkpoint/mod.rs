//! Checkpoints (docs/checkpoints.md): sharded safetensors for tensors plus
//! one small JSON index for the plan, the step and the run's state, in a
//! checkpoint root that holds one directory per saved step.
//!
//! Each rank writes the pieces of parameters it owns, under their checkpoint
//! keys (groups flattened, experts by global index; pattern.md), with its
//! optimizer moments beside them. Under pipeline parallelism a rank owns
//! pieces of its stages' buckets only, and its file is named by its world
//! rank; the shared embedding's bucket is written by the first stage's
//! ranks alone. The index says which file holds which element range of
//! each key, so a checkpoint can be loaded onto another layout (other rank
//! counts, ZeRO-3 or `no_shard`, another pipeline size) as well as the one
//! that wrote it. It also records every file's CRC-32C (and each rank file its
//! tensors'), checked on load, so damage is found and named rather than
//! trained on.
//!
//! Rank files are written a chunk at a time and read a tensor at a time
//! (`stream`), so saving takes the host memory of a chunk and resuming that
//! of a few tensors, not of the rank's state; or, with `async_save`, they
//! are written from a host copy behind the steps (`save`). A resume reads each byte once, a tensor ahead of the uploads:
//! the index vouches for each tensor's own checksum, checked as the tensor
//! is read.
//!
//! Modules: [`root`] (the root's layout, `latest`, the lock, `keep_last`),
//! [`index`] (the index, its seal and its range checks), [`run`] (the run's
//! state and how a resume settles against it), `save` (a save, streamed or
//! behind the steps), `load` (a resume's reads, planned, then read ahead),
//! `stream` (rank files written and read a chunk at a time), [`durable`]
//! (fsynced writes and failpoints), [`crc32c`].

pub mod crc32c;
pub mod durable;
pub mod index;
mod load;
pub mod root;
pub mod run;
mod save;
mod stream;

pub use durable::{FAILPOINT_ENV, FAILPOINTS};
pub use index::{
    CheckpointIndex, FORMAT, FileEntry, INDEX, LayoutRecord, Piece, TensorEntry, VERSION,
    read_index, seal,
};
pub use load::load;
pub use root::{CheckpointRoot, LATEST, LOCK, ROOT_MARKER, step_dir_name};
pub use run::{DataRecord, RunSettings, RunState};
pub use save::{RankSaves, SavedState, save, snapshot_bytes};

use crate::backend::Backend;
use crate::collective::Collective;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::ShardLayout;
use crate::optimizer::OptimizerKind;
use crate::setting::{Setting, SettingSpelling};
use crc32c::hex;
use hybridgen_dsl::Plan;
use root::rank_file;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Where a run resumes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResumeFrom {
    /// The newest complete step in the run's save root; a fresh start
    /// when it holds none (so a preempted job restarts with the same
    /// command).
    Auto,
    /// A checkpoint root (its newest complete step) or one step's directory.
    Dir(PathBuf),
}

/// The checkpoint a run resumes from, read and checked.
#[derive(Clone, Debug)]
pub struct Resume {
    /// The step's directory.
    pub dir: PathBuf,
    pub index: CheckpointIndex,
    /// Each setting taken from the checkpoint rather than from the
    /// configuration, with its value, as the settings' spelling gives it
    /// (`config.seed = 7`).
    pub inherited: Vec<String>,
}

impl Resume {
    pub fn step(&self) -> u64 {
        self.index.step
    }
}

/// Where a run saves: its locked root and what every index records of it.
#[derive(Debug)]
pub struct SaveTarget {
    pub root: CheckpointRoot,
    pub run: RunState,
    pub layout: LayoutRecord,
}

/// A run's checkpoints, settled before any work starts.
#[derive(Debug, Default)]
pub struct RunCheckpoints {
    pub resume: Option<Resume>,
    pub save: Option<SaveTarget>,
}

/// A run's settings settled against the checkpoint it resumes (if any).
pub struct Settled {
    /// The settings to run with: the given ones with those left to the
    /// checkpoint taken from it.
    pub settings: RunSettings,
    resume: Option<Resume>,
    data: Option<DataRecord>,
}

/// Finds the checkpoint `settings` resume from, reads and checks its index,
/// and settles the settings against it. Changes nothing on disk.
pub fn settle(settings: &RunSettings) -> Result<Settled> {
    let fresh = || Settled {
        settings: settings.clone(),
        resume: None,
        data: None,
    };
    let spelling = &settings.spelling;
    let dir = match &settings.resume {
        None => return Ok(fresh()),
        Some(ResumeFrom::Auto) => {
            let Some(save) = &settings.save else {
                return Err(RuntimeError::Unsupported(format!(
                    "{} resumes from the {} directory; give {}",
                    spelling.given(Setting::Resume, "auto"),
                    spelling.name(Setting::Save),
                    spelling.given(Setting::Save, "DIR")
                )));
            };
            match root::newest_checkpoint(save, spelling.name(Setting::Save))? {
                Some(dir) => dir,
                None => return Ok(fresh()),
            }
        }
        Some(ResumeFrom::Dir(dir)) => root::newest_checkpoint(dir, spelling.name(Setting::Resume))?
            .ok_or_else(|| {
                RuntimeError::io(
                    dir.display(),
                    if dir.exists() {
                        format!(
                            "holds no complete checkpoint yet; train with {} to start fresh when there is none",
                            spelling.given(Setting::Resume, "auto")
                        )
                    } else {
                        "no such checkpoint".to_string()
                    },
                )
            })?,
    };
    let index = read_index(&dir)?;
    if let Some(named) = root::step_of_dir(&dir)
        && named != index.step
    {
        return Err(RuntimeError::io(
            dir.join(INDEX).display(),
            format!(
                "records step {}, but its directory is named for step {named}; the checkpoint is damaged",
                index.step
            ),
        ));
    }
    let settled = run::settle(settings, &index, &dir)?;
    Ok(Settled {
        settings: settled.settings,
        resume: Some(Resume {
            dir,
            index,
            inherited: settled.inherited,
        }),
        data: settled.data,
    })
}

impl Settled {
    /// The step directory the run resumes from, if it resumes.
    pub fn resume_dir(&self) -> Option<&Path> {
        self.resume.as_ref().map(|r| r.dir.as_path())
    }

    /// Checks the resumed checkpoint against the run's plan and opens (makes,
    /// validates, locks) the save root: the last check before work starts.
    /// Returns the settings to run with them.
    pub fn open(self, plan: &Plan) -> Result<(RunSettings, RunCheckpoints)> {
        let settings = self.settings;
        let spelling = settings.spelling;
        if let Some(resume) = &self.resume {
            resume.index.check_fits(plan, &resume.dir, spelling)?;
        }
        if settings.save.is_none() && settings.keep_last.is_some() {
            return Err(RuntimeError::Unsupported(format!(
                "{} removes old checkpoints of {}; give {}",
                spelling.name(Setting::KeepLast),
                spelling.given(Setting::Save, "DIR"),
                spelling.name(Setting::Save)
            )));
        }
        let save = match &settings.save {
            None => None,
            Some(dir) => {
                let data = match self.data {
                    Some(data) => data,
                    None => DataRecord::of(&settings.data)?,
                };
                let start = self.resume.as_ref().map_or(0, Resume::step);
                Some(SaveTarget {
                    root: CheckpointRoot::open(dir, start, settings.keep_last, spelling)?,
                    run: RunState::of(&settings, data),
                    layout: LayoutRecord {
                        ranks: settings.ranks,
                        ep: settings.ep,
                        pp: settings.pp,
                        sharding: settings.sharding,
                        schedule: settings.schedule,
                    },
                })
            }
        };
        let checkpoints = RunCheckpoints {
            resume: self.resume,
            save,
        };
        Ok((settings, checkpoints))
    }
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

/// Whether data-parallel rank `r` writes the bucket kind at all: the ranks
/// holding an EP rank's copy of a bucket write it (under `no_shard`, only
/// the first of each group, since every rank holds whole buckets).
fn writes(layout: &ShardLayout, expert: bool, r: usize) -> bool {
    layout.holders(expert, r % layout.ep).contains(&r)
}

/// Where world rank `w` is: its pipeline rank and its data-parallel rank
/// within the stage (ranks are laid out pp x dp, `w = pp_rank * dp +
/// dp_rank`, `layout.world` being dp). Without a pipeline, `(0, w)`.
fn placed(layout: &ShardLayout, w: usize) -> (usize, usize) {
    let dp = layout.world.max(1);
    (w / dp, w % dp)
}

/// The pieces world rank `w` holds: what it loads (its pipeline stages'
/// buckets only). Computable for any rank, so rank 0 can write the whole
/// index without asking the others.
fn held_pieces(plan: &Plan, layout: &ShardLayout, w: usize) -> Vec<(usize, OwnedPiece)> {
    let ep = layout.ep;
    let (pp_rank, r) = placed(layout, w);
    let mut out = Vec::new();
    for bucket in plan.buckets.iter().filter(|b| plan.holds(pp_rank, b)) {
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

/// The pieces world rank `w` writes: those it holds, once per copy, and
/// of a bucket two stages hold (the shared embedding), the first stage's.
fn written_pieces(plan: &Plan, layout: &ShardLayout, w: usize) -> Vec<(usize, OwnedPiece)> {
    let (pp_rank, r) = placed(layout, w);
    held_pieces(plan, layout, w)
        .into_iter()
        .filter(|(b, _)| {
            let bucket = &plan.buckets[*b];
            writes(layout, bucket.expert, r) && plan.bucket_owner(bucket) == pp_rank
        })
        .collect()
}

/// Every world rank's `values` (the same length on every rank), by world
/// rank: the stage's ranks' gathered over `host`, then the stages' over
/// `pipe_host`, in pipeline order. Without a pipeline, `host`'s alone.
fn world_all_gather_host<D: Device>(
    rank: &RankContext<D>,
    values: &[f64],
) -> Result<Vec<Vec<f64>>> {
    let stage = rank.host.all_gather_host(values)?;
    if rank.pipe_host.size() <= 1 {
        return Ok(stage);
    }
    let n = values.len().max(1);
    let stages = rank.pipe_host.all_gather_host(&stage.concat())?;
    Ok(stages
        .iter()
        .flat_map(|theirs| theirs.chunks(n).map(<[f64]>::to_vec))
        .collect())
}

/// Returns once every rank of the run (every stage's) has called it: the
/// stage's ranks meet, then each with its peers of the other stages, so
/// no rank leaves before every rank has come.
fn world_barrier<D: Device>(rank: &RankContext<D>) -> Result<()> {
    rank.host.barrier()?;
    if rank.pipe_host.size() > 1 {
        rank.pipe_host.barrier()?;
    }
    Ok(())
}

/// Where a tensor `save` writes comes from: a range of a device buffer, or
/// values on the host.
enum TensorSource<'a, B: Backend> {
    Device(&'a B::Buf, Range<usize>),
    Host(&'a [f32]),
}

impl<B: Backend> TensorSource<'_, B> {
    /// Its values.
    fn len(&self) -> usize {
        match self {
            TensorSource::Device(_, range) => range.len(),
            TensorSource::Host(values) => values.len(),
        }
    }
}

/// The tensor names a piece is stored under in its rank file.
fn names(key: &str) -> [String; 3] {
    [
        format!("param/{key}"),
        format!("exp_avg/{key}"),
        format!("exp_avg_sq/{key}"),
    ]
}

/// Checks checkpoint `dir` whole: its index, and every file's size and
/// checksum. Loading checks the same as it reads; this is for tools, and
/// for tests that a crash left only complete checkpoints behind.
pub fn verify(dir: &Path) -> Result<CheckpointIndex> {
    let index = read_index(dir)?;
    for (name, entry) in &index.files {
        stream::checked(dir, name, entry)?;
    }
    Ok(index)
}

/// Whole parameters read from a checkpoint, whatever layout wrote it: for
/// tools that convert checkpoints (`hybridgen export`). Every file's size
/// and CRC-32C are checked once, streaming, when it is opened; a parameter
/// is then read from the byte ranges that hold it (each piece checked
/// against its tensor's own CRC-32C), so memory holds one parameter, not
/// the checkpoint.
pub struct CheckpointReader {
    /// The step's directory.
    pub dir: PathBuf,
    pub index: CheckpointIndex,
    /// Per rank file: each tensor's byte range and CRC-32C.
    files: BTreeMap<String, stream::StoredTensors>,
}

impl CheckpointReader {
    /// Opens checkpoint `dir`: a root (its newest complete step) or one
    /// step's directory; `what` names the argument in errors.
    pub fn open(dir: &Path, what: &str) -> Result<Self> {
        let (step, index) = open_index(dir, what)?;
        let mut files = BTreeMap::new();
        for (name, entry) in &index.files {
            files.insert(name.clone(), stream::checked(&step, name, entry)?);
        }
        Ok(CheckpointReader {
            dir: step,
            index,
            files,
        })
    }

    /// The whole value of the parameter with checkpoint key `key`.
    pub fn param(&self, key: &str) -> Result<Vec<f32>> {
        let index_path = || self.dir.join(INDEX).display().to_string();
        let entry = self.index.tensors.get(key).ok_or_else(|| {
            RuntimeError::io(index_path(), format!("no tensor `{key}` in the checkpoint"))
        })?;
        let numel = entry.shape.iter().product::<usize>();
        let [name, _, _] = names(key);
        let mut out = vec![0.0f32; numel];
        let mut covered = 0;
        for piece in &entry.pieces {
            let path = self.dir.join(&piece.file);
            let stored = self
                .files
                .get(&piece.file)
                .ok_or_else(|| {
                    RuntimeError::io(
                        index_path(),
                        format!("`{}` is not a file of the checkpoint", piece.file),
                    )
                })?
                .get(&name)
                .ok_or_else(|| RuntimeError::io(path.display(), format!("no tensor {name}")))?;
            let n = piece.end.saturating_sub(piece.start);
            if stored.len != n as u64 * 4 || piece.end > numel {
                return Err(RuntimeError::io(
                    path.display(),
                    format!(
                        "{name} holds {} bytes, the index says elements {}..{} of {numel}",
                        stored.len, piece.start, piece.end
                    ),
                ));
            }
            let values = stream::read_tensor(&path, &name, stored)?;
            out[piece.start..piece.end].copy_from_slice(&values);
            covered += n;
        }
        if covered != numel {
            return Err(RuntimeError::io(
                index_path(),
                format!("the pieces of {name} cover {covered} of its {numel} elements"),
            ));
        }
        Ok(out)
    }
}

/// The newest complete step of checkpoint `dir` (a root or one step's
/// directory) and its checked index, without reading the rank files: for a
/// caller that only wants the model or the settings.
pub fn open_index(dir: &Path, what: &str) -> Result<(PathBuf, CheckpointIndex)> {
    let step = root::newest_checkpoint(dir, what)?.ok_or_else(|| {
        RuntimeError::io(
            dir.display(),
            if dir.exists() {
                "holds no complete checkpoint"
            } else {
                "no such checkpoint"
            },
        )
    })?;
    let index = read_index(&step)?;
    Ok((step, index))
}

/// Writes a checkpoint of fresh training state into root `dir` as step 0:
/// every parameter of `plan` (an `ep` 1 plan: every expert) whole, from
/// `value(p)`, with zero optimizer moments, in one rank file, as a
/// one-rank `no_shard` run would have saved it. It loads onto any layout
/// like any checkpoint. `dir` is opened as a run's save root is.
pub fn write_fresh(
    dir: &Path,
    plan: &Plan,
    run: RunState,
    value: &mut dyn FnMut(usize) -> Result<Vec<f32>>,
    biases: &[(String, Vec<f32>)],
) -> Result<PathBuf> {
    if plan.layout.ep != 1 {
        return Err(RuntimeError::InvalidArgument(
            "write_fresh needs a plan holding every expert (ep 1)".into(),
        ));
    }
    // The routers' expert biases, as `save` keeps them (no optimizer state):
    // exactly the model's, one value an expert, or the loader refuses the
    // checkpoint later.
    let mut wanted: Vec<String> = crate::layers::expert_bias_keys(plan)
        .into_iter()
        .map(|(_, key)| key)
        .collect();
    let mut given: Vec<&String> = biases.iter().map(|(key, _)| key).collect();
    wanted.sort();
    given.sort();
    if given != wanted.iter().collect::<Vec<_>>() {
        return Err(RuntimeError::InvalidArgument(format!(
            "the expert biases given ({given:?}) are not this model's ({wanted:?})"
        )));
    }
    let experts = plan.model.moe.as_ref().map_or(0, |m| m.num_experts);
    if let Some((key, values)) = biases.iter().find(|(_, v)| v.len() != experts) {
        return Err(RuntimeError::InvalidArgument(format!(
            "`{key}` came with {} values, not one for each of the {experts} experts",
            values.len()
        )));
    }
    let root = CheckpointRoot::open(dir, 0, None, SettingSpelling::FIELDS)?;
    let partial = root.begin(0)?;
    let file = rank_file(0);
    let adam = run.optimizer.kind == OptimizerKind::Adam;
    let piece = |n: usize| Piece {
        file: file.clone(),
        start: 0,
        end: n,
    };
    // Every tensor's name and length first (the writer puts the header
    // before the bytes), then one parameter in memory at a time: a
    // published 30B model imports in the memory of its largest tensor.
    let mut tensors: Vec<(String, usize)> = Vec::new();
    let mut entries: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for param in plan.params.iter() {
        let def = plan.def(param);
        let key = plan.checkpoint_key(param, 0);
        let n = def.numel();
        let [pn, mn, vn] = names(&key);
        tensors.push((pn, n));
        tensors.push((mn, n));
        if adam {
            tensors.push((vn, n));
        }
        entries.insert(
            key,
            TensorEntry {
                shape: def.shape.to_vec(),
                pieces: vec![piece(n)],
            },
        );
    }
    for (key, values) in biases {
        let [pn, _, _] = names(key);
        tensors.push((pn, values.len()));
        entries.insert(
            key.clone(),
            TensorEntry {
                shape: vec![values.len()],
                pieces: vec![piece(values.len())],
            },
        );
    }
    let path = partial.join(&file);
    let mut writer = stream::RankFileWriter::create(&path, "rank-file", tensors)?;
    let zeros = vec![0.0f32; stream::CHUNK];
    let put_zeros = |writer: &mut stream::RankFileWriter, mut n: usize| {
        while n > 0 {
            let now = n.min(zeros.len());
            writer.put(&zeros[..now])?;
            n -= now;
        }
        Ok::<(), RuntimeError>(())
    };
    for (p, param) in plan.params.iter().enumerate() {
        let n = plan.def(param).numel();
        let values = value(p)?;
        if values.len() != n {
            return Err(RuntimeError::InvalidArgument(format!(
                "`{}` came with {} values, not {n}",
                plan.checkpoint_key(param, 0),
                values.len(),
            )));
        }
        writer.put(&values)?;
        drop(values);
        put_zeros(&mut writer, n)?;
        if adam {
            put_zeros(&mut writer, n)?;
        }
    }
    for (_, values) in biases {
        writer.put(values)?;
    }
    let (bytes, crc) = writer.finish()?;
    let index = CheckpointIndex {
        crc32c: String::new(),
        format: FORMAT.to_string(),
        version: VERSION,
        step: 0,
        pattern: plan.pattern.canonical(),
        model: plan.model.clone(),
        layout: LayoutRecord {
            ranks: 1,
            ep: 1,
            pp: 1,
            sharding: crate::fsdp::Sharding::NoShard,
            schedule: crate::schedule::ScheduleKind::Overlap,
        },
        run,
        files: BTreeMap::from([(
            file,
            FileEntry {
                bytes,
                crc32c: hex(crc),
            },
        )]),
        tensors: entries,
    };
    let text = index.to_sealed_text()?;
    durable::write_file(&partial.join(INDEX), text.as_bytes(), "index")?;
    root.commit(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsdp::Sharding;
    use hybridgen_dsl::plan::Owner;
    use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

    fn plan(pattern: &str, pp: usize, dp: usize, ep: usize) -> Plan {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = pattern.into();
        let options = PlanOptions {
            layout: ParallelLayout {
                pp,
                ..ParallelLayout::new(dp, ep)
            },
            ..PlanOptions::default()
        };
        Plan::new(&model, &options).unwrap_or_else(|e| panic!("{pattern} pp {pp}: {e}"))
    }

    /// Under every pipeline layout the world ranks' written pieces tile
    /// every key exactly once (the shared embedding's included), each
    /// rank writes and loads its own stages' buckets only, and both
    /// holders of the shared embedding load it.
    #[test]
    fn world_ranks_write_every_element_once_and_load_their_stages() {
        for (pattern, pp, dp, ep) in [
            ("M[*E]|M-[*E]", 2, 1, 1),
            ("M[*E]|M-[*E]", 2, 2, 2),
            ("M[*E]|M-[*E]/*E", 2, 2, 2),
            ("[ME]*|E[*E]|M-|[*E]E", 4, 2, 2),
            ("[ME]*|E[*E]|M-|[*E]E", 2, 2, 1),
            ("M[*E]-", 1, 2, 2),
        ] {
            let plan = plan(pattern, pp, dp, ep);
            let shared = plan.shares_embedding();
            let tied = plan.model.tie_embeddings;
            assert_eq!(
                shared,
                pp > 1 && (tied || pattern.contains('/')),
                "{pattern} pp {pp}"
            );
            for sharding in [Sharding::Zero3, Sharding::NoShard] {
                let layout = ShardLayout::of(&plan, sharding);
                let case = format!("{pattern} pp {pp} dp {dp} ep {ep} {sharding:?}");
                let mut written: BTreeMap<String, Vec<Range<usize>>> = BTreeMap::new();
                for w in 0..pp * dp {
                    let pp_rank = w / dp;
                    for (b, piece) in written_pieces(&plan, &layout, w) {
                        let bucket = &plan.buckets[b];
                        assert_eq!(plan.bucket_owner(bucket), pp_rank, "{case}: rank {w}");
                        written.entry(piece.key).or_default().push(piece.elements);
                    }
                    for (b, piece) in held_pieces(&plan, &layout, w) {
                        assert!(plan.holds(pp_rank, &plan.buckets[b]), "{case}: rank {w}");
                        let embedding = plan.params[piece.param].owner == Owner::Embedding;
                        if embedding && shared {
                            assert!(plan.is_shared_bucket(&plan.buckets[b]), "{case}");
                        }
                    }
                    // A holder of the embedding loads all of it over its
                    // stage's ranks: the last stage too where it is shared.
                    let embedding_loaded = (0..dp)
                        .flat_map(|r| held_pieces(&plan, &layout, pp_rank * dp + r))
                        .filter(|(_, p)| plan.params[p.param].owner == Owner::Embedding)
                        .count()
                        > 0;
                    let pp_rank_of = |s: usize| plan.stages.get(s).map_or(0, |s| s.pp_rank);
                    let (first, last) = (
                        pp_rank_of(plan.first_stage()),
                        pp_rank_of(plan.last_stage()),
                    );
                    assert_eq!(
                        embedding_loaded,
                        pp_rank == first || (shared && pp_rank == last),
                        "{case}: rank {w}"
                    );
                }
                let mut expected = BTreeMap::new();
                for param in plan.params.iter() {
                    let def = plan.def(param);
                    let copies = if def.local_expert.is_some() { ep } else { 1 };
                    for e in 0..copies {
                        expected.insert(plan.checkpoint_key(param, e), def.numel());
                    }
                }
                assert_eq!(
                    written.keys().collect::<Vec<_>>(),
                    expected.keys().collect::<Vec<_>>(),
                    "{case}"
                );
                for (key, mut pieces) in written {
                    pieces.sort_by_key(|p| p.start);
                    let mut at = 0;
                    for piece in pieces {
                        assert_eq!(piece.start, at, "{case}: {key} written twice or not at all");
                        at = piece.end;
                    }
                    assert_eq!(at, expected[&key], "{case}: {key}");
                }
            }
        }
    }
}

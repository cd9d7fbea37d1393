//! Saving a checkpoint: each rank writes its rank file (named by its world
//! rank, every pipeline stage's ranks counted) into the step's `.partial`
//! directory, then world rank 0 writes the index and commits the step
//! (`root`). The exchanges of a save (the directory made before any file,
//! the files' sizes and checksums, the progress of saves behind the steps)
//! span every stage's ranks: the stage's over `host`, then the stages'
//! over `pipe_host`. The rank file is written one of two ways:
//!
//! - [`save`] streams it from the device a chunk at a time while the steps
//!   wait: a chunk of host memory, and the step time of the whole write.
//! - `SaveInFlight` (`async_save`, Megatron's asynchronous save)
//!   copies the rank's tensors into host memory at the step boundary and
//!   writes them on a thread of its own while training goes on. The steps
//!   wait only for the copy; the host holds the rank's state once more
//!   until the file is written. The step is committed at the first step
//!   boundary where every rank's file is written, or before the next save
//!   starts, or at the run's end: one save is in flight at a time, and the
//!   previous complete step stays in the root until the new one is.
//!
//! Both write the same bytes, and a crash at any point leaves the previous
//! step loadable, as a crash during a streamed save does.

use super::crc32c::hex;
use super::durable;
use super::index::{CheckpointIndex, FORMAT, FileEntry, INDEX, Piece, TensorEntry, VERSION};
use super::root::rank_file;
use super::stream::{self, RankFileWriter};
use super::{
    SaveTarget, TensorSource, names, world_all_gather_host, world_barrier, written_pieces,
};
use crate::backend::Backend;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::{FsdpEngine, ShardLayout};
use crate::layers::ExpertBalance;
use crate::optimizer::{Optimizer, OptimizerKind};
use hybridgen_dsl::Plan;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a save writes from: the run's plan, and this rank's parameters,
/// optimizer state and expert biases.
pub struct SavedState<'a, D: Device> {
    pub plan: &'a Plan,
    pub engine: &'a FsdpEngine<D>,
    pub optimizer: &'a Optimizer<D>,
    pub balance: &'a ExpertBalance<D::Backend>,
}

impl<'a, D: Device> SavedState<'a, D> {
    pub fn new(
        plan: &'a Plan,
        engine: &'a FsdpEngine<D>,
        optimizer: &'a Optimizer<D>,
        balance: &'a ExpertBalance<D::Backend>,
    ) -> Self {
        SavedState {
            plan,
            engine,
            optimizer,
            balance,
        }
    }
}

/// Writes the checkpoint of `state` after `step` steps into `target`'s
/// root as `step-N`, durably, then points `latest` at it, streaming this
/// rank's file from the device. Every rank calls it (it synchronises
/// them). Returns the step's directory.
pub fn save<D: Device>(
    target: &SaveTarget,
    step: u64,
    state: &SavedState<'_, D>,
    rank: &RankContext<D>,
) -> Result<PathBuf> {
    let biases = state.balance.biases();
    let begun = Begun::new(target, step, state, &biases, rank)?;
    let tensors = rank_tensors(state, &biases, rank);
    let written = write_streamed(&begun.path, &tensors, &rank.backend)?;
    begun.commit(target, written, rank)
}

/// A save begun: its `.partial` directory made, this rank's file named,
/// and on world rank 0 the index without its files' sizes and checksums
/// (the layout and the expert biases' keys fix everything else at the
/// start).
struct Begun {
    step: u64,
    path: PathBuf,
    draft: Option<CheckpointIndex>,
}

impl Begun {
    fn new<D: Device>(
        target: &SaveTarget,
        step: u64,
        state: &SavedState<'_, D>,
        biases: &[(String, Vec<f32>)],
        rank: &RankContext<D>,
    ) -> Result<Begun> {
        let root = &target.root;
        let me = rank.world_rank();
        if me == 0 {
            root.begin(step)?;
        }
        // Every stage's ranks write into the directory world rank 0 made.
        world_barrier(rank)?;
        let layout = state.engine.layout();
        let world = rank.world * rank.pp.max(1);
        let draft =
            (me == 0).then(|| draft_index(target, step, state.plan, &layout, biases, world));
        Ok(Begun {
            step,
            path: root.partial_dir(step).join(rank_file(me)),
            draft,
        })
    }

    /// Gathers every rank's file size and checksum (by world rank); world
    /// rank 0 writes the index and commits the step. Every rank calls it.
    fn commit<D: Device>(
        &self,
        target: &SaveTarget,
        (bytes, crc): (u64, u32),
        rank: &RankContext<D>,
    ) -> Result<PathBuf> {
        // Both exact in f64.
        let all = world_all_gather_host(rank, &[f64::from(crc), bytes as f64])?;
        if let Some(draft) = &self.draft {
            let mut index = draft.clone();
            index.files = all
                .iter()
                .enumerate()
                .map(|(r, v)| {
                    let entry = FileEntry {
                        bytes: v[1] as u64,
                        crc32c: hex(v[0] as u32),
                    };
                    (rank_file(r), entry)
                })
                .collect();
            let text = index.to_sealed_text()?;
            let partial = target.root.partial_dir(self.step);
            durable::write_file(&partial.join(INDEX), text.as_bytes(), "index")?;
            target.root.commit(self.step)?;
        }
        world_barrier(rank)?;
        Ok(target.root.step_dir(self.step))
    }
}

/// The index of step `step` as the `world` ranks (every stage's, `layout`
/// giving a stage's) write it, with no files yet: which file holds which
/// elements of each key.
fn draft_index(
    target: &SaveTarget,
    step: u64,
    plan: &Plan,
    layout: &ShardLayout,
    biases: &[(String, Vec<f32>)],
    world: usize,
) -> CheckpointIndex {
    let mut entries: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for r in 0..world {
        for (_, piece) in written_pieces(plan, layout, r) {
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
    // The expert biases are the same on every rank (every stage's too: each
    // keeps every layer's, moved by the loads summed over all ranks):
    // world rank 0 keeps them.
    for (key, values) in biases {
        let piece = Piece {
            file: rank_file(0),
            start: 0,
            end: values.len(),
        };
        let entry = TensorEntry {
            shape: vec![values.len()],
            pieces: vec![piece],
        };
        entries.insert(key.clone(), entry);
    }
    CheckpointIndex {
        crc32c: String::new(),
        format: FORMAT.to_string(),
        version: VERSION,
        step,
        pattern: plan.pattern.canonical(),
        model: plan.model.clone(),
        layout: target.layout.clone(),
        run: target.run.clone(),
        files: BTreeMap::new(),
        tensors: entries,
    }
}

/// This rank's tensors in its file's order, each named and with where its
/// values come from: each written piece's master weights and moments, and
/// on world rank 0 the expert biases.
fn rank_tensors<'a, D: Device>(
    state: &SavedState<'a, D>,
    biases: &'a [(String, Vec<f32>)],
    rank: &RankContext<D>,
) -> Vec<(String, TensorSource<'a, D::Backend>)> {
    let backend = &rank.backend;
    let (engine, optimizer) = (state.engine, state.optimizer);
    let mut tensors = Vec::new();
    let me = rank.world_rank();
    for (b, piece) in written_pieces(state.plan, &engine.layout(), me) {
        let shard = &engine.shards()[b];
        let state = &optimizer.states()[b];
        let [p, m, v] = names(&piece.key);
        let from = |buf| TensorSource::Device(buf, piece.in_shard.clone());
        tensors.push((p, from(&shard.master)));
        tensors.push((m, from(&state.exp_avg)));
        if backend.buf_len(&state.exp_avg_sq) > 0 {
            tensors.push((v, from(&state.exp_avg_sq)));
        }
    }
    if me == 0 {
        for (key, values) in biases {
            let [p, _, _] = names(key);
            tensors.push((p, TensorSource::Host(values)));
        }
    }
    tensors
}

/// Each tensor's name and length, for the file's header.
fn lengths<B: Backend>(tensors: &[(String, TensorSource<'_, B>)]) -> Vec<(String, usize)> {
    tensors
        .iter()
        .map(|(name, source)| (name.clone(), source.len()))
        .collect()
}

/// Writes `tensors` into the rank file at `path` a chunk at a time:
/// memory holds a chunk, not the rank's state. Returns its size and
/// CRC-32C.
fn write_streamed<B: Backend>(
    path: &std::path::Path,
    tensors: &[(String, TensorSource<'_, B>)],
    backend: &B,
) -> Result<(u64, u32)> {
    let lengths = lengths(tensors);
    let longest = lengths.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let mut writer = RankFileWriter::create(path, "rank-file", lengths)?;
    let mut chunk = vec![0.0f32; longest.min(stream::CHUNK)];
    for (_, source) in tensors {
        match source {
            TensorSource::Host(values) => writer.put(values)?,
            TensorSource::Device(buf, range) => {
                for start in range.clone().step_by(stream::CHUNK) {
                    let end = (start + stream::CHUNK).min(range.end);
                    let host = &mut chunk[..end - start];
                    backend.download(backend.slice(buf, start..end)?, host)?;
                    writer.put(host)?;
                }
            }
        }
    }
    writer.finish()
}

/// The host memory a save behind the steps (`SaveInFlight`) takes for
/// world rank `r`'s copy of its checkpoint tensors (bytes): its written
/// pieces' master weights and moments (of its pipeline stages' buckets),
/// and on world rank 0 the expert biases. `r` counts every stage's ranks
/// (`pp_rank * dp + dp_rank`, `layout.world` being dp).
pub fn snapshot_bytes(
    plan: &Plan,
    layout: &ShardLayout,
    optimizer: OptimizerKind,
    r: usize,
) -> u64 {
    let tensors_a_piece = if optimizer == OptimizerKind::Adam {
        3
    } else {
        2
    };
    let pieces: usize = written_pieces(plan, layout, r)
        .iter()
        .map(|(_, piece)| piece.in_shard.len() * tensors_a_piece)
        .sum();
    let biases = if r == 0 {
        crate::layers::expert_bias_keys(plan).len()
            * plan.model.moe.as_ref().map_or(0, |m| m.num_experts)
    } else {
        0
    };
    (pieces + biases) as u64 * 4
}

/// One rank's saves over a run: which steps save, whether a save goes
/// behind the steps (`SaveInFlight`) or streams ([`save`]), and the time
/// the steps waited on them. Every rank drives its own at the same steps.
pub struct RankSaves<'a> {
    target: &'a SaveTarget,
    every: Option<u64>,
    last_step: u64,
    /// The newest step in the root: the run's end saves unless it is the
    /// last step.
    saved: Option<u64>,
    /// Where saves behind the steps copy to: `async_save` and a save due
    /// after the run's first step and before its last.
    buffer: Option<SnapshotBuffer>,
    in_flight: Option<SaveInFlight>,
    /// The time the steps waited on saves.
    pub waited: Duration,
    /// Saves written behind the steps.
    pub behind: u64,
}

impl<'a> RankSaves<'a> {
    /// The saves of a run from `first_step` (0, or the step resumed) to
    /// `last_step`, every `every` steps and at the end; `async_save` puts
    /// those before the last step behind the steps, into a buffer of
    /// `snapshot_elements()` allocated from now on.
    pub fn new(
        target: &'a SaveTarget,
        every: Option<u64>,
        async_save: bool,
        (first_step, last_step): (u64, u64),
        snapshot_elements: impl FnOnce() -> usize,
    ) -> Self {
        let behind_due = every.is_some_and(|every| {
            async_save && (first_step / every + 1).saturating_mul(every) < last_step
        });
        RankSaves {
            target,
            every,
            last_step,
            saved: target.root.newest_at_open(),
            buffer: behind_due.then(|| SnapshotBuffer::allocate(snapshot_elements())),
            in_flight: None,
            waited: Duration::ZERO,
            behind: 0,
        }
    }

    /// After step `step`: commits the save in flight once every rank's
    /// file is written, then saves if `step` is due.
    pub fn after_step<D: Device>(
        &mut self,
        step: u64,
        state: &SavedState<'_, D>,
        rank: &RankContext<D>,
    ) -> Result<()> {
        let due = self.every.is_some_and(|every| step.is_multiple_of(every));
        if self.in_flight.is_none() && !due {
            return Ok(());
        }
        let started = Instant::now();
        let out = self.settle_and_save(due, step, state, rank);
        self.waited += started.elapsed();
        out
    }

    /// [`RankSaves::after_step`]'s work, `due` whether `step` saves.
    fn settle_and_save<D: Device>(
        &mut self,
        due: bool,
        step: u64,
        state: &SavedState<'_, D>,
        rank: &RankContext<D>,
    ) -> Result<()> {
        if let (Some(saving), Some(buffer)) = (&mut self.in_flight, &mut self.buffer)
            && saving.try_commit(self.target, buffer, rank)?.is_some()
        {
            self.in_flight = None;
        }
        if !due {
            return Ok(());
        }
        // One save in flight at a time (its copy is the memory the check
        // allowed for), and committed before the next, so `latest` and
        // `keep_last` see the steps in order.
        self.commit_in_flight(rank)?;
        match &mut self.buffer {
            // The last step's save would be waited for at once: it streams.
            Some(buffer) if step < self.last_step => {
                let saving = SaveInFlight::start(self.target, step, state, buffer, rank)?;
                self.behind += u64::from(saving.is_behind());
                self.in_flight = Some(saving);
            }
            _ => {
                save(self.target, step, state, rank)?;
            }
        }
        self.saved = Some(step);
        Ok(())
    }

    /// At the run's end, after step `step`: commits the save in flight,
    /// then saves `step` unless it is saved already.
    pub fn finish<D: Device>(
        &mut self,
        step: u64,
        state: &SavedState<'_, D>,
        rank: &RankContext<D>,
    ) -> Result<()> {
        if self.in_flight.is_none() && self.saved == Some(step) {
            return Ok(());
        }
        let started = Instant::now();
        let mut out = self.commit_in_flight(rank);
        if out.is_ok() && self.saved != Some(step) {
            out = save(self.target, step, state, rank).map(|_| ());
        }
        self.waited += started.elapsed();
        out
    }

    /// Waits for the save in flight, if any, and commits it.
    fn commit_in_flight<D: Device>(&mut self, rank: &RankContext<D>) -> Result<()> {
        if let (Some(saving), Some(buffer)) = (self.in_flight.take(), &mut self.buffer) {
            saving.commit_when_written(self.target, buffer, rank)?;
        }
        Ok(())
    }
}

/// A rank file's writing as [`SaveInFlight`]'s thread reports it to the
/// other ranks (exact in f64).
const WRITING: f64 = 0.0;
const WRITTEN: f64 = 1.0;
const FAILED: f64 = 2.0;

/// The host memory a rank's saves behind the steps copy its tensors into:
/// allocated and faulted in once, on a thread of its own while the first
/// steps run, then reused by every save. A fresh allocation filled at the
/// save step made the steps wait about 6.5 s for 10.8 GB on an H200 host,
/// against 2.6 s into this buffer: first touches of fresh pages cost more
/// than the copy.
pub struct SnapshotBuffer {
    values: Vec<f32>,
    filling: Option<JoinHandle<Vec<f32>>>,
}

impl SnapshotBuffer {
    /// Starts allocating room for `elements` values. Where the host
    /// refuses the memory, the buffer stays empty and saves stream instead.
    pub fn allocate(elements: usize) -> SnapshotBuffer {
        let filling = std::thread::Builder::new()
            .name("save-snapshot-alloc".into())
            .spawn(move || {
                let mut values = Vec::new();
                if values.try_reserve_exact(elements).is_ok() {
                    values.resize(elements, 0.0);
                }
                values
            })
            .ok();
        SnapshotBuffer {
            values: Vec::new(),
            filling,
        }
    }

    /// The buffer, once allocated (waiting for that if need be).
    fn take(&mut self) -> Vec<f32> {
        if let Some(filling) = self.filling.take() {
            self.values = filling.join().unwrap_or_default();
        }
        std::mem::take(&mut self.values)
    }
}

/// What a writer thread hands back: its file's size and checksum, and the
/// snapshot buffer for the next save.
type Written = (Result<(u64, u32)>, Vec<f32>);

/// A checkpoint being written behind the training steps (`async_save`):
/// this rank's tensors copied to host memory at its step, its rank file
/// written by a thread of its own. Every rank holds one for the same step;
/// [`SaveInFlight::try_commit`] at each step boundary commits the step
/// once every rank's file is written. Dropped before that (the run
/// failed), it stops the thread and leaves the step `.partial`, for the
/// next run to remove.
pub struct SaveInFlight {
    begun: Begun,
    writer: Option<JoinHandle<Written>>,
    /// The thread's result, once joined.
    written: Option<Result<(u64, u32)>>,
    /// Set when the save is abandoned: the thread stops at its next chunk.
    abandon: Arc<AtomicBool>,
}

impl SaveInFlight {
    /// Copies this rank's checkpoint tensors of the state after `step`
    /// steps into `buffer` and starts writing them. Every rank calls it.
    /// Where the buffer could not be allocated, the file is streamed now
    /// instead, as [`save`] writes it.
    pub fn start<D: Device>(
        target: &SaveTarget,
        step: u64,
        state: &SavedState<'_, D>,
        buffer: &mut SnapshotBuffer,
        rank: &RankContext<D>,
    ) -> Result<SaveInFlight> {
        let biases = state.balance.biases();
        let begun = Begun::new(target, step, state, &biases, rank)?;
        let tensors = rank_tensors(state, &biases, rank);
        let lengths = lengths(&tensors);
        let total: usize = lengths.iter().map(|(_, n)| n).sum();
        let abandon = Arc::new(AtomicBool::new(false));
        let mut snapshot = buffer.take();
        if snapshot.len() != total {
            buffer.values = snapshot;
            let written = write_streamed(&begun.path, &tensors, &rank.backend);
            return Ok(SaveInFlight {
                begun,
                writer: None,
                written: Some(written),
                abandon,
            });
        }
        let backend = &rank.backend;
        let mut at = 0;
        for (_, source) in &tensors {
            let into = &mut snapshot[at..at + source.len()];
            match source {
                TensorSource::Host(values) => into.copy_from_slice(values),
                TensorSource::Device(buf, range) => {
                    backend.download(backend.slice(buf, range.clone())?, into)?
                }
            }
            at += source.len();
        }
        let mut file = RankFileWriter::create(&begun.path, "rank-file", lengths)?;
        let stop = abandon.clone();
        let path = begun.path.clone();
        let writer = std::thread::Builder::new()
            .name(format!("save-rank-{}", rank.world_rank()))
            .spawn(move || {
                let write = || {
                    for part in snapshot.chunks(stream::CHUNK) {
                        if stop.load(Ordering::Relaxed) {
                            return Err(RuntimeError::io(path.display(), "the save was abandoned"));
                        }
                        file.put(part)?;
                    }
                    file.finish()
                };
                let result = write();
                (result, snapshot)
            })
            .map_err(|e| {
                RuntimeError::io(
                    begun.path.display(),
                    format!("cannot start the writer thread: {e}"),
                )
            })?;
        Ok(SaveInFlight {
            begun,
            writer: Some(writer),
            written: None,
            abandon,
        })
    }

    /// Whether the file is being written behind the steps, asked before
    /// the save is committed (else it was streamed at the start, the host
    /// having given no memory for the copy).
    pub fn is_behind(&self) -> bool {
        self.writer.is_some()
    }

    /// Commits the step if every rank's file is written: `Some` of its
    /// directory, `None` while a rank still writes. Every rank calls it at
    /// the same step boundary (it exchanges each rank's progress); a rank
    /// whose file failed fails them all. A finished writer's buffer goes
    /// back into `buffer`.
    pub fn try_commit<D: Device>(
        &mut self,
        target: &SaveTarget,
        buffer: &mut SnapshotBuffer,
        rank: &RankContext<D>,
    ) -> Result<Option<PathBuf>> {
        self.exchange(false, target, buffer, rank)
    }

    /// Waits for this rank's file, then commits the step once every rank's
    /// is written. Every rank calls it.
    pub fn commit_when_written<D: Device>(
        mut self,
        target: &SaveTarget,
        buffer: &mut SnapshotBuffer,
        rank: &RankContext<D>,
    ) -> Result<PathBuf> {
        match self.exchange(true, target, buffer, rank)? {
            Some(dir) => Ok(dir),
            None => Err(RuntimeError::Unsupported(format!(
                "the save of step {} was waited for but a rank reported it still writing",
                self.begun.step
            ))),
        }
    }

    /// Joins the writer if it is done (or `wait`s for it), tells the other
    /// ranks, and commits when every file is written.
    fn exchange<D: Device>(
        &mut self,
        wait: bool,
        target: &SaveTarget,
        buffer: &mut SnapshotBuffer,
        rank: &RankContext<D>,
    ) -> Result<Option<PathBuf>> {
        if self
            .writer
            .as_ref()
            .is_some_and(|w| wait || w.is_finished())
            && let Some(writer) = self.writer.take()
        {
            self.written = Some(match writer.join() {
                Ok((result, snapshot)) => {
                    buffer.values = snapshot;
                    result
                }
                Err(_) => Err(RuntimeError::io(
                    self.begun.path.display(),
                    "the writer thread panicked",
                )),
            });
        }
        let state = match &self.written {
            None => WRITING,
            Some(Ok(_)) => WRITTEN,
            Some(Err(_)) => FAILED,
        };
        let all = world_all_gather_host(rank, &[state])?;
        if state == FAILED
            && let Some(Err(e)) = self.written.take()
        {
            return Err(e);
        }
        if let Some(failed) = all.iter().position(|v| v[0] == FAILED) {
            return Err(RuntimeError::io(
                self.begun.path.display(),
                format!(
                    "rank {failed} could not write its file of step {}; its own error says why",
                    self.begun.step
                ),
            ));
        }
        if all.iter().any(|v| v[0] != WRITTEN) {
            return Ok(None);
        }
        match self.written.take() {
            Some(Ok(written)) => self.begun.commit(target, written, rank).map(Some),
            _ => Err(RuntimeError::io(
                self.begun.path.display(),
                "reported written but holds no result",
            )),
        }
    }
}

impl Drop for SaveInFlight {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            self.abandon.store(true, Ordering::Relaxed);
            let _ = writer.join();
        }
    }
}

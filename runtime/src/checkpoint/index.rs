//! A checkpoint's index, `checkpoint.json`: the model, the step, the run's
//! state, each file's size and CRC-32C, and where every tensor's elements
//! are. The index checks itself too: its first field is the CRC-32C of the
//! file as written with that field's digits read as `00000000`, so a flipped
//! byte anywhere in it is found, and it stays a JSON file `jq` can read.
//!
//! Nothing in an index is trusted: it is read with a size cap, every file it
//! names must be a plain name inside the checkpoint, and every number is
//! range-checked (against the plan of the run loading it, too) before
//! anything is allocated from it.

use super::crc32c::{crc32c, hex};
use super::run::RunState;
use crate::error::{Result, RuntimeError};
use crate::fsdp::Sharding;
use crate::schedule::ScheduleKind;
use crate::setting::{Setting, SettingSpelling};
use hybridgen_dsl::{ModelConfig, Plan};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

pub const FORMAT: &str = "hybridgen-checkpoint";
/// 2: checksums, the run's state, the checkpoint root. 1 had neither.
pub const VERSION: u32 = 2;
/// The index's file name inside a checkpoint.
pub const INDEX: &str = "checkpoint.json";
/// The largest index read: far above any real one (a few hundred bytes per
/// tensor and rank), far below an allocation that could hurt.
pub const MAX_INDEX_BYTES: u64 = 256 << 20;
/// The largest step a checkpoint may record: steps are counted exactly in
/// f64 by the optimizer's schedule, and no run gets near it.
pub const MAX_STEP: u64 = 1 << 53;
/// The most ranks a checkpoint may say wrote it.
pub const MAX_RANKS: usize = 1 << 20;
/// The most elements one tensor may have (2^48: 1 PiB of f32).
const MAX_ELEMENTS: usize = 1 << 48;

/// What the JSON index records.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointIndex {
    /// CRC-32C of this file with these digits read as `00000000`. First, so
    /// it sits at a fixed place (see [`seal`]).
    pub crc32c: String,
    pub format: String,
    pub version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// The canonical pattern the tensors belong to.
    pub pattern: String,
    pub model: ModelConfig,
    /// The layout that wrote it; a resume may use another.
    pub layout: LayoutRecord,
    /// Everything besides the tensors that decides how the run continues.
    pub run: RunState,
    /// Every other file of the checkpoint: its size and CRC-32C.
    pub files: BTreeMap<String, FileEntry>,
    /// Per checkpoint key: its shape and where its elements are.
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// How the run that wrote a checkpoint was laid out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayoutRecord {
    /// Every rank, every pipeline stage's: the rank files.
    pub ranks: usize,
    pub ep: usize,
    /// Pipeline stages (`ranks / pp` data-parallel ranks each). Written
    /// only when above 1, so a run without a pipeline writes the index it
    /// always did; checkpoints written before the field existed read as 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pp: usize,
    pub sharding: Sharding,
    pub schedule: ScheduleKind,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    /// Eight lowercase hex digits.
    pub crc32c: String,
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

/// Where the seal's digits are: the first field of the pretty-printed index.
const SEAL_FIELD: &str = "{\n  \"crc32c\": \"";
const UNSEALED: &str = "00000000";

/// The seal's stored digits and the CRC the text actually has, or `None`
/// when the text does not start with a seal field.
fn seal_parts(text: &str) -> Option<(&str, u32)> {
    let at = SEAL_FIELD.len();
    if !text.starts_with(SEAL_FIELD) {
        return None;
    }
    let stored = text.get(at..at + UNSEALED.len())?;
    let zeroed = format!("{SEAL_FIELD}{UNSEALED}{}", text.get(at + UNSEALED.len()..)?);
    Some((stored, crc32c(zeroed.as_bytes())))
}

/// `text` (an index as `serde_json::to_string_pretty` writes it) with its
/// seal recomputed: for tools and tests that edit an index by hand. `None`
/// when the text does not start with the `crc32c` field.
pub fn seal(text: &str) -> Option<String> {
    let (_, crc) = seal_parts(text)?;
    let at = SEAL_FIELD.len();
    Some(format!(
        "{SEAL_FIELD}{}{}",
        hex(crc),
        &text[at + UNSEALED.len()..]
    ))
}

impl CheckpointIndex {
    /// The index as written to disk: pretty JSON, sealed.
    pub fn to_sealed_text(&self) -> Result<String> {
        let mut unsealed = self.clone();
        unsealed.crc32c = UNSEALED.to_string();
        let text =
            serde_json::to_string_pretty(&unsealed).map_err(|e| RuntimeError::io(INDEX, e))?;
        seal(&format!("{text}\n"))
            .ok_or_else(|| RuntimeError::io(INDEX, "the serialised index lost its seal field"))
    }

    /// Checks every value that needs no plan: format, step, layout, file
    /// names and sizes, checksums' form, tensor shapes and piece ranges.
    fn check_values(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(RuntimeError::io(path.display(), m));
        if self.step > MAX_STEP {
            return bad(format!(
                "step {} is out of range (at most 2^53); the index is damaged",
                self.step
            ));
        }
        let l = &self.layout;
        if l.ranks == 0 || l.ranks > MAX_RANKS || l.ep == 0 || !l.ranks.is_multiple_of(l.ep) {
            return bad(format!(
                "layout of {} ranks with ep {} is impossible (1 to {MAX_RANKS} ranks, ep dividing them); the index is damaged",
                l.ranks, l.ep
            ));
        }
        if l.pp == 0 || !l.ranks.is_multiple_of(l.pp) || !(l.ranks / l.pp).is_multiple_of(l.ep) {
            return bad(format!(
                "layout of {} ranks with pp {} and ep {} is impossible (pp dividing the ranks, ep the \
                 data-parallel ranks of a stage); the index is damaged",
                l.ranks, l.pp, l.ep
            ));
        }
        self.run
            .check()
            .or_else(|m| bad(format!("{m}; the index is damaged")))?;
        for (name, entry) in &self.files {
            if !is_plain_file_name(name) {
                return bad(format!(
                    "file `{name}` is not a plain file name inside the checkpoint \
                     (letters, digits, `.`, `_`, `-`; no directories); the index is damaged or forged"
                ));
            }
            if !is_hex_crc(&entry.crc32c) {
                return bad(format!(
                    "file `{name}` has checksum `{}`, not eight hex digits",
                    entry.crc32c
                ));
            }
        }
        for (key, entry) in &self.tensors {
            let numel = entry
                .shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .filter(|&n| n <= MAX_ELEMENTS);
            let Some(numel) = numel else {
                return bad(format!(
                    "tensor `{key}` has shape {:?}, over 2^48 elements",
                    entry.shape
                ));
            };
            let mut pieces: Vec<&Piece> = entry.pieces.iter().collect();
            pieces.sort_by_key(|p| p.start);
            let mut next = 0;
            for piece in pieces {
                if !self.files.contains_key(&piece.file) {
                    return bad(format!(
                        "tensor `{key}` has a piece in `{}`, a file the index does not list",
                        piece.file
                    ));
                }
                if piece.start != next || piece.end <= piece.start || piece.end > numel {
                    return bad(format!(
                        "tensor `{key}` of {numel} elements has a piece of elements {}..{} (expected one starting at {next}); \
                         its pieces must cover it exactly once",
                        piece.start, piece.end
                    ));
                }
                next = piece.end;
            }
            if next != numel {
                return bad(format!(
                    "the pieces of tensor `{key}` cover {next} of its {numel} elements"
                ));
            }
        }
        Ok(())
    }

    /// Checks the index against the plan of the run that loads it: the same
    /// pattern and dimensions, and exactly the plan's tensors with the
    /// plan's shapes.
    /// `spelling` names the model's settings in a refusal.
    pub fn check_fits(&self, plan: &Plan, dir: &Path, spelling: SettingSpelling) -> Result<()> {
        let refuse = |m: String| Err(RuntimeError::Unsupported(m));
        let model = spelling.name(Setting::Model);
        if self.pattern != plan.pattern.canonical() {
            return refuse(format!(
                "the checkpoint in {} is of pattern {} but this run trains {}; leave out {model} \
                 to train the checkpoint's model, or give the ones that wrote it",
                dir.display(),
                self.pattern,
                plan.pattern.canonical()
            ));
        }
        let mut theirs = self.model.clone();
        theirs.pattern = plan.model.pattern.clone();
        if theirs != plan.model {
            return refuse(format!(
                "the checkpoint in {} was written for other model dimensions; leave out {model} \
                 to train the checkpoint's model, or give the model file or preset that wrote it",
                dir.display()
            ));
        }
        let path = dir.join(INDEX);
        let bad = |m: String| Err(RuntimeError::io(path.display(), m));
        let ep = plan.layout.ep;
        let mut expected: BTreeMap<String, &[usize]> = BTreeMap::new();
        for param in plan.params.iter() {
            let def = plan.def(param);
            let copies = if def.local_expert.is_some() { ep } else { 1 };
            for e in 0..copies {
                expected.insert(plan.checkpoint_key(param, e), &def.shape[..]);
            }
        }
        let experts = plan.model.moe.as_ref().map_or(0, |m| m.num_experts);
        let bias_shape = [experts];
        for (_, key) in crate::layers::expert_bias_keys(plan) {
            expected.insert(key, &bias_shape[..]);
        }
        for (key, shape) in &expected {
            match self.tensors.get(key) {
                None => return bad(format!("no tensor `{key}` in the checkpoint")),
                Some(entry) if entry.shape != *shape => {
                    return bad(format!(
                        "tensor `{key}` has shape {:?} in the checkpoint but {shape:?} in this model",
                        entry.shape
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some(key) = self.tensors.keys().find(|k| !expected.contains_key(*k)) {
            return bad(format!(
                "the checkpoint holds tensor `{key}`, which this model does not have"
            ));
        }
        Ok(())
    }
}

/// A name that stays inside the checkpoint directory: no separators, no
/// `.`/`..`, nothing hidden, not the index itself.
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name != INDEX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn is_hex_crc(text: &str) -> bool {
    text.len() == 8 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Reads and checks the index of checkpoint `dir` (not yet against a plan).
pub fn read_index(dir: &Path) -> Result<CheckpointIndex> {
    let path = dir.join(INDEX);
    let err = |m: String| RuntimeError::io(path.display(), m);
    let file = std::fs::File::open(&path).map_err(|e| {
        err(format!(
            "{e} (is {} a checkpoint a training run saved?)",
            dir.display()
        ))
    })?;
    let too_big = || {
        err(format!(
            "over {} MiB: not an index hybridgen wrote",
            MAX_INDEX_BYTES >> 20
        ))
    };
    if file.metadata().is_ok_and(|m| m.len() > MAX_INDEX_BYTES) {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    file.take(MAX_INDEX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| err(e.to_string()))?;
    if bytes.len() as u64 > MAX_INDEX_BYTES {
        return Err(too_big());
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| err("not UTF-8 text: the index is damaged".to_string()))?;
    let Some((stored, computed)) = seal_parts(&text) else {
        return Err(err(unsealed_message(&text)));
    };
    if stored != hex(computed) {
        return Err(err(format!(
            "checksum mismatch (the index records {stored}, its bytes give {}): the index is damaged; {}",
            hex(computed),
            super::root::other_step_hint(dir)
        )));
    }
    let index: CheckpointIndex =
        serde_json::from_str(&text).map_err(|e| err(format!("not a checkpoint index: {e}")))?;
    if index.format != FORMAT || index.version != VERSION {
        return Err(err(format!(
            "format {} v{} is not {FORMAT} v{VERSION}",
            index.format, index.version
        )));
    }
    index.check_values(&path)?;
    Ok(index)
}

/// Why an index without a seal cannot be used.
fn unsealed_message(text: &str) -> String {
    let value: Option<serde_json::Value> = serde_json::from_str(text).ok();
    let field = |name: &str| value.as_ref().and_then(|v| v.get(name)).cloned();
    match (field("format"), field("version")) {
        (Some(f), Some(v)) if f == FORMAT && v == 1 => format!(
            "a checkpoint of format v1, written by an earlier hybridgen without checksums; this version reads \
             v{VERSION} only: retrain it, or resume it with the hybridgen that wrote it"
        ),
        _ => "not a sealed checkpoint index (it must start with its `crc32c` field): the index is damaged or \
              was not written by hybridgen"
            .to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_stay_inside_the_checkpoint() {
        for ok in ["rank-00000.safetensors", "a_b-c.d"] {
            assert!(is_plain_file_name(ok), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "/etc/passwd",
            "a/b",
            "a\\b",
            ".hidden",
            INDEX,
            "nul\0",
            "é",
        ] {
            assert!(!is_plain_file_name(bad), "{bad:?}");
        }
    }

    /// A pipeline size is recorded where there is a pipeline; an index
    /// without one (a run without a pipeline, or one written before the
    /// field existed) reads as pp 1.
    #[test]
    fn the_pipeline_size_is_recorded_above_one_and_reads_as_one_when_absent() {
        let record = |pp| LayoutRecord {
            ranks: 4,
            ep: 2,
            pp,
            sharding: Sharding::Zero3,
            schedule: ScheduleKind::Overlap,
        };
        let two = serde_json::to_value(record(2)).unwrap();
        assert_eq!(two["pp"], 2);
        assert_eq!(
            serde_json::from_value::<LayoutRecord>(two).unwrap(),
            record(2)
        );
        let one = serde_json::to_value(record(1)).unwrap();
        assert!(one.get("pp").is_none(), "{one}");
        assert_eq!(
            serde_json::from_value::<LayoutRecord>(one).unwrap(),
            record(1)
        );
    }

    #[test]
    fn a_seal_finds_any_changed_byte() {
        let text = "{\n  \"crc32c\": \"00000000\",\n  \"step\": 12\n}\n";
        let sealed = seal(text).unwrap();
        let (stored, computed) = seal_parts(&sealed).unwrap();
        assert_eq!(stored, hex(computed));
        let flipped = sealed.replace("12", "13");
        let (stored, computed) = seal_parts(&flipped).unwrap();
        assert_ne!(stored, hex(computed));
        assert!(seal("{\"step\": 1}").is_none());
    }
}

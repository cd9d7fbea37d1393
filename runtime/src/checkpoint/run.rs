//! What a checkpoint records of its run besides tensors, and how a resuming
//! configuration is settled against it.
//!
//! Batches are a function of (seed, step, rank, micro-batch) and routing is
//! deterministic, so the data's position is the step, and the run's future
//! is decided by the tensors, the step and the settings recorded here. A
//! resume takes each setting the user left out from the checkpoint; one the
//! user gave must agree with it, except the layout (ranks, ep, pp, ZeRO
//! stage, schedule), which may change because checkpoints reshard.

use super::ResumeFrom;
use super::crc32c::{Crc32c, hex};
use super::index::CheckpointIndex;
use crate::backend::Precision;
use crate::data::DataChoice;
use crate::data::{IndexedDataset, IndexedSpec, Split};
use crate::error::{Result, RuntimeError};
use crate::fsdp::Sharding;
use crate::optimizer::{OptimizerConfig, OptimizerKind};
use crate::schedule::ScheduleKind;
use crate::setting::{Setting, SettingSpelling};
use hybridgen_dsl::ModelConfig;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The settings of a run that its checkpoints record and a resume settles
/// against them, with where the run resumes and saves: the part of a
/// training configuration that checkpoints concern.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSettings {
    pub model: ModelConfig,
    pub seed: u64,
    pub data: DataChoice,
    pub micro_batches: usize,
    pub micro_batch_size: usize,
    pub seq_length: usize,
    pub optimizer: OptimizerConfig,
    pub precision: Precision,
    pub ranks: usize,
    pub ep: usize,
    pub pp: usize,
    pub sharding: Sharding,
    pub schedule: ScheduleKind,
    /// The checkpoint root the run saves to.
    pub save: Option<PathBuf>,
    /// Keep only the newest N steps in the save root.
    pub keep_last: Option<u64>,
    pub resume: Option<ResumeFrom>,
    /// The settings a resume takes from its checkpoint (those the user
    /// left out); every other one must agree with it, except the layout.
    pub from_checkpoint: BTreeSet<Setting>,
    /// How messages name the settings.
    pub spelling: SettingSpelling,
}

/// The settings that decide how a run continues.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Seeds the data stream (and the initialisation it replaced).
    pub seed: u64,
    pub data: DataRecord,
    pub micro_batches: usize,
    pub micro_batch_size: usize,
    pub seq_length: usize,
    /// Every hyper-parameter, the learning-rate schedule's included.
    pub optimizer: OptimizerConfig,
    /// The dtype parameters and activations were stored in. Checkpoints
    /// written before the field existed trained in f32.
    #[serde(default)]
    pub precision: Precision,
}

impl RunState {
    pub fn of(settings: &RunSettings, data: DataRecord) -> Self {
        RunState {
            seed: settings.seed,
            data,
            micro_batches: settings.micro_batches,
            micro_batch_size: settings.micro_batch_size,
            seq_length: settings.seq_length,
            optimizer: settings.optimizer.clone(),
            precision: settings.precision,
        }
    }

    /// Range checks for a state read from disk.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        if self.micro_batches == 0 || self.micro_batch_size == 0 || self.seq_length == 0 {
            return Err(format!(
                "micro-batches ({}), micro-batch size ({}) and sequence length ({}) must all be at least 1",
                self.micro_batches, self.micro_batch_size, self.seq_length
            ));
        }
        self.optimizer
            .validate(SettingSpelling::FIELDS)
            .map_err(|e| e.to_string())?;
        if let DataRecord::File { crc32c, .. } = &self.data
            && !(crc32c.len() == 8 && crc32c.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(format!("data checksum `{crc32c}` is not eight hex digits"));
        }
        Ok(())
    }
}

/// Which data a run trains on. A file is known by its contents, so the same
/// bytes under another path are the same data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataRecord {
    Synthetic,
    File {
        path: String,
        bytes: u64,
        crc32c: String,
    },
    /// Megatron indexed datasets: each known by its index's checksum and
    /// its token file's length (checksumming a corpus of many gigabytes at
    /// every resume would take minutes; the index pins every sequence's
    /// place and length).
    Indexed {
        datasets: Vec<IndexedRecord>,
        split: String,
    },
}

/// One dataset of an indexed blend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexedRecord {
    pub weight: f64,
    pub prefix: String,
    pub idx_crc32c: String,
    pub bin_bytes: u64,
}

// Weights are parsed from text, never NaN.
impl Eq for IndexedRecord {}

impl DataRecord {
    /// Records `choice`, reading a file once to checksum it.
    pub fn of(choice: &DataChoice) -> Result<Self> {
        match choice {
            DataChoice::Synthetic => Ok(DataRecord::Synthetic),
            DataChoice::File(path) => {
                let err = |e: std::io::Error| RuntimeError::io(path.display(), e);
                let mut file = std::fs::File::open(path).map_err(err)?;
                let mut crc = Crc32c::default();
                let mut buf = vec![0u8; 1 << 20];
                let mut bytes = 0u64;
                loop {
                    let n = file.read(&mut buf).map_err(err)?;
                    if n == 0 {
                        break;
                    }
                    crc.update(&buf[..n]);
                    bytes += n as u64;
                }
                Ok(DataRecord::File {
                    path: path.to_string_lossy().into_owned(),
                    bytes,
                    crc32c: hex(crc.finish()),
                })
            }
            DataChoice::Indexed(spec) => {
                let datasets = spec
                    .blend
                    .iter()
                    .map(|(weight, prefix)| {
                        let dataset = IndexedDataset::open(prefix)?;
                        Ok(IndexedRecord {
                            weight: *weight,
                            prefix: prefix.to_string_lossy().into_owned(),
                            idx_crc32c: hex(super::crc32c::crc32c(dataset.index_bytes())),
                            bin_bytes: dataset.bin_bytes(),
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(DataRecord::Indexed {
                    datasets,
                    split: spec.split.text().to_string(),
                })
            }
        }
    }

    /// The data choice that reads this record's data.
    fn choice(&self, spelling: SettingSpelling) -> Result<DataChoice> {
        Ok(match self {
            DataRecord::Synthetic => DataChoice::Synthetic,
            DataRecord::File { path, .. } => DataChoice::File(PathBuf::from(path)),
            DataRecord::Indexed { datasets, split } => DataChoice::Indexed(IndexedSpec {
                blend: datasets
                    .iter()
                    .map(|d| (d.weight, PathBuf::from(&d.prefix)))
                    .collect(),
                split: Split::parse(split, spelling).map_err(RuntimeError::InvalidArgument)?,
            }),
        })
    }

    fn same_data(&self, other: &DataRecord) -> bool {
        match (self, other) {
            (DataRecord::Synthetic, DataRecord::Synthetic) => true,
            (
                DataRecord::File { bytes, crc32c, .. },
                DataRecord::File {
                    bytes: b2,
                    crc32c: c2,
                    ..
                },
            ) => bytes == b2 && crc32c == c2,
            (
                DataRecord::Indexed { datasets, split },
                DataRecord::Indexed {
                    datasets: d2,
                    split: s2,
                },
            ) => {
                split == s2
                    && datasets.len() == d2.len()
                    && datasets.iter().zip(d2).all(|(a, b)| {
                        a.weight == b.weight
                            && a.idx_crc32c == b.idx_crc32c
                            && a.bin_bytes == b.bin_bytes
                    })
            }
            _ => false,
        }
    }

    fn describe(&self) -> String {
        match self {
            DataRecord::Synthetic => "synthetic".to_string(),
            DataRecord::File {
                path,
                bytes,
                crc32c,
            } => format!("{path} ({bytes} bytes, CRC-32C {crc32c})"),
            DataRecord::Indexed { datasets, split } => format!(
                "indexed {} split {split}",
                datasets
                    .iter()
                    .map(|d| if datasets.len() == 1 {
                        format!("{} (index CRC-32C {})", d.prefix, d.idx_crc32c)
                    } else {
                        format!("{} {} (index CRC-32C {})", d.weight, d.prefix, d.idx_crc32c)
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        }
    }
}

/// A resume's settings settled against its checkpoint.
pub(crate) struct Settled {
    pub settings: RunSettings,
    /// Each setting taken from the checkpoint that the configuration had
    /// another value for, with its value, as the settings' spelling gives
    /// it (`config.seed = 7`).
    pub inherited: Vec<String>,
    /// The data's record, when settling computed it.
    pub data: Option<DataRecord>,
}

struct Settler<'a> {
    settings: RunSettings,
    index: &'a CheckpointIndex,
    dir: &'a Path,
    inherited: Vec<String>,
}

impl Settler<'_> {
    fn inherits(&self, setting: Setting) -> bool {
        self.settings.from_checkpoint.contains(&setting)
    }

    /// Settles one setting: equal, taken from the checkpoint, a layout
    /// change, or a contradiction.
    fn setting<T: PartialEq + Clone>(
        &mut self,
        setting: Setting,
        theirs: &T,
        show: impl Fn(&T) -> String,
        field: impl Fn(&mut RunSettings) -> &mut T,
    ) -> Result<()> {
        let inherit = self.inherits(setting);
        let spelling = self.settings.spelling;
        let mine = field(&mut self.settings);
        if mine == theirs || (setting.is_layout() && !inherit) {
            return Ok(());
        }
        if inherit {
            self.inherited.push(spelling.given(setting, show(theirs)));
            *mine = theirs.clone();
            return Ok(());
        }
        let mine = show(mine);
        Err(self.contradiction(setting, &mine, &show(theirs)))
    }

    fn contradiction(&self, setting: Setting, mine: &str, theirs: &str) -> RuntimeError {
        let spelling = &self.settings.spelling;
        let at = format!(
            "the checkpoint {} (step {})",
            self.dir.display(),
            self.index.step
        );
        RuntimeError::Unsupported(match spelling.flag(setting) {
            Some(flag) => format!(
                "{flag} {mine} contradicts {at}, whose run used {flag} {theirs}: a resume continues that run, \
                 so it keeps its settings. Leave {flag} out to continue with {theirs}, or start a new run \
                 (without {}, and {} to a new directory)",
                spelling.name(Setting::Resume),
                spelling.name(Setting::Save)
            ),
            None => format!(
                "{} is {mine} but {at} was trained with {theirs}; set it to {theirs} to continue that run",
                setting.field()
            ),
        })
    }

    fn data(&mut self) -> Result<Option<DataRecord>> {
        let theirs = &self.index.run.data;
        if self.inherits(Setting::Data) {
            let choice = theirs.choice(self.settings.spelling)?;
            let now = DataRecord::of(&choice).map_err(|e| {
                RuntimeError::Unsupported(format!(
                    "the checkpoint {} trained on {}, which cannot be read now ({e}); give {} with that file",
                    self.dir.display(),
                    theirs.describe(),
                    self.settings.spelling.name(Setting::Data)
                ))
            })?;
            if !now.same_data(theirs) {
                return Err(RuntimeError::Unsupported(format!(
                    "the checkpoint {} trained on {}, which has changed since: it is now {}; give {} with \
                     the original file",
                    self.dir.display(),
                    theirs.describe(),
                    now.describe(),
                    self.settings.spelling.name(Setting::Data)
                )));
            }
            if self.settings.data != choice {
                self.inherited.push(
                    self.settings
                        .spelling
                        .given(Setting::Data, theirs.describe()),
                );
                self.settings.data = choice;
            }
            return Ok(Some(now));
        }
        let mine = DataRecord::of(&self.settings.data)?;
        if !mine.same_data(theirs) {
            return Err(self.contradiction(Setting::Data, &mine.describe(), &theirs.describe()));
        }
        Ok(Some(mine))
    }
}

/// Settles `settings` against the checkpoint `index` in `dir` that they
/// resume.
pub(crate) fn settle(
    settings: &RunSettings,
    index: &CheckpointIndex,
    dir: &Path,
) -> Result<Settled> {
    let mut s = Settler {
        settings: settings.clone(),
        index,
        dir,
        inherited: Vec::new(),
    };
    // The model is compared with the plan once it is made (`check_fits`).
    if s.inherits(Setting::Model) && s.settings.model != index.model {
        s.settings.model = index.model.clone();
        s.inherited
            .push(format!("the model {}", index.model.pattern));
    }
    let run = &index.run;
    let plain = |v: &dyn std::fmt::Display| v.to_string();
    s.setting(Setting::Seed, &run.seed, |v| plain(v), |c| &mut c.seed)?;
    s.setting(
        Setting::MicroBatches,
        &run.micro_batches,
        |v| plain(v),
        |c| &mut c.micro_batches,
    )?;
    s.setting(
        Setting::MicroBatchSize,
        &run.micro_batch_size,
        |v| plain(v),
        |c| &mut c.micro_batch_size,
    )?;
    s.setting(
        Setting::SeqLength,
        &run.seq_length,
        |v| plain(v),
        |c| &mut c.seq_length,
    )?;
    let o = &run.optimizer;
    s.setting(
        Setting::Optimizer,
        &o.kind,
        |k| match k {
            OptimizerKind::Adam => "adam".into(),
            OptimizerKind::Sgd => "sgd".into(),
        },
        |c| &mut c.optimizer.kind,
    )?;
    s.setting(Setting::Lr, &o.lr, |v| plain(v), |c| &mut c.optimizer.lr)?;
    s.setting(
        Setting::Warmup,
        &o.warmup_steps,
        |v| plain(v),
        |c| &mut c.optimizer.warmup_steps,
    )?;
    s.setting(
        Setting::WeightDecay,
        &o.weight_decay,
        |v| plain(v),
        |c| &mut c.optimizer.weight_decay,
    )?;
    s.setting(
        Setting::ClipGrad,
        &o.clip_grad,
        |v| v.map_or("0 (off)".to_string(), |c| c.to_string()),
        |c| &mut c.optimizer.clip_grad,
    )?;
    s.setting(
        Setting::LrSchedule,
        &o.schedule,
        |v| v.describe(),
        |c| &mut c.optimizer.schedule,
    )?;
    s.setting(
        Setting::Beta1,
        &o.beta1,
        |v| plain(v),
        |c| &mut c.optimizer.beta1,
    )?;
    s.setting(
        Setting::Beta2,
        &o.beta2,
        |v| plain(v),
        |c| &mut c.optimizer.beta2,
    )?;
    s.setting(Setting::Eps, &o.eps, |v| plain(v), |c| &mut c.optimizer.eps)?;
    s.setting(
        Setting::Momentum,
        &o.momentum,
        |v| plain(v),
        |c| &mut c.optimizer.momentum,
    )?;
    // The master weights and optimizer state are f32 in either precision,
    // but a run continued in another one would follow another curve than
    // the one it started: a contradiction, like a new seed.
    s.setting(
        Setting::Precision,
        &run.precision,
        |v| v.to_string(),
        |c| &mut c.precision,
    )?;
    let layout = &index.layout;
    s.setting(
        Setting::Ranks,
        &layout.ranks,
        |v| plain(v),
        |c| &mut c.ranks,
    )?;
    // The checkpoint's pp only where it divides the ranks this run has,
    // and its ep only where it divides their stages' data-parallel ranks.
    if s.settings.ranks.is_multiple_of(layout.pp) {
        s.setting(Setting::Pp, &layout.pp, |v| plain(v), |c| &mut c.pp)?;
    }
    let dp = s.settings.ranks / s.settings.pp.max(1);
    if dp.is_multiple_of(layout.ep) {
        s.setting(Setting::Ep, &layout.ep, |v| plain(v), |c| &mut c.ep)?;
    }
    s.setting(
        Setting::Sharding,
        &layout.sharding,
        |v| match v {
            Sharding::Zero3 => "3".into(),
            Sharding::NoShard => "0".into(),
        },
        |c| &mut c.sharding,
    )?;
    s.setting(
        Setting::Schedule,
        &layout.schedule,
        |v| match v {
            ScheduleKind::Overlap => "overlap".into(),
            ScheduleKind::Plain => "plain".into(),
        },
        |c| &mut c.schedule,
    )?;
    let data = s.data()?;
    Ok(Settled {
        settings: s.settings,
        inherited: s.inherited,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_precision_is_recorded_and_older_states_read_as_f32() {
        let state = RunState {
            seed: 0,
            data: DataRecord::Synthetic,
            micro_batches: 4,
            micro_batch_size: 4,
            seq_length: 64,
            optimizer: OptimizerConfig::default(),
            precision: Precision::Bf16,
        };
        let mut value = serde_json::to_value(&state).unwrap();
        assert_eq!(value["precision"], "bf16");
        let read: RunState = serde_json::from_value(value.clone()).unwrap();
        assert_eq!(read, state);
        // A checkpoint written before the field existed trained in f32.
        value.as_object_mut().unwrap().remove("precision");
        let old: RunState = serde_json::from_value(value).unwrap();
        assert_eq!(old.precision, Precision::F32);
    }
}

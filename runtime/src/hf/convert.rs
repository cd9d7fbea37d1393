//! Export (checkpoint -> Hugging Face folder), import (Hugging Face folder
//! -> checkpoint), and the weights a run starts from (`init_from`), all
//! through [`hf_tensors`]: the mapping is applied in one place, so the
//! three cannot disagree.

use super::config::{HfDtype, family_of, from_hf_config, to_hf_config};
use super::files::{self, HfFolder, Planned};
use super::mapping::{Family, HfTensor, Piece, Source, ValueMap, hf_tensors};
use super::qwen3_next::{export_value, import_value};
use crate::checkpoint::{CheckpointReader, DataRecord, RunState, write_fresh};
use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use crate::train::TrainConfig;
use hybridgen_dsl::{LayerKind, ModelConfig, Pattern, Plan, PlanOptions};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// `model`'s plan on one rank, which holds every expert.
pub fn one_rank_plan(model: &ModelConfig) -> Result<Plan> {
    Plan::new(model, &PlanOptions::default()).map_err(|d| RuntimeError::Unsupported(d.to_string()))
}

/// What an export would write, without any weights.
#[derive(Clone, Debug)]
pub struct DryRun {
    pub config: Value,
    pub tensors: Vec<Planned>,
    /// Each file and the tensors (indices into `tensors`) in it.
    pub files: Vec<(String, Vec<usize>)>,
    pub notes: Vec<String>,
}

/// An export's tensors, their stored dtypes and files.
fn planned(tensors: &[HfTensor], dtype: HfDtype) -> Vec<Planned> {
    tensors
        .iter()
        .map(|t| Planned {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: if t.always_f32() { HfDtype::F32 } else { dtype },
        })
        .collect()
}

/// What exporting `model` in `dtype` writes: config, tensors, files.
pub fn dry_run(model: &ModelConfig, dtype: HfDtype) -> Result<DryRun> {
    let (config, notes) = to_hf_config(model, dtype)?;
    let plan = one_rank_plan(model)?;
    let tensors = planned(&hf_tensors(&plan, family_of(model)?)?, dtype);
    let files = files::shard(&tensors, files::SHARD_BYTES);
    Ok(DryRun {
        config,
        tensors,
        files,
        notes,
    })
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct ExportReport {
    pub out: PathBuf,
    /// The checkpoint step exported.
    pub step: u64,
    pub files: Vec<String>,
    pub tensors: usize,
    pub bytes: u64,
    pub notes: Vec<String>,
}

/// The pieces of a `[n, cols]` row-major tensor, concatenated (zero rows
/// for [`Piece::Zeros`]).
fn gather_rows(values: &[f32], cols: usize, pieces: &[Piece]) -> Vec<f32> {
    let mut out = Vec::with_capacity(pieces.iter().map(Piece::len).sum::<usize>() * cols);
    for piece in pieces {
        match piece {
            Piece::Rows(r) => out.extend_from_slice(&values[r.start * cols..r.end * cols]),
            Piece::Zeros(n) => out.resize(out.len() + n * cols, 0.0),
        }
    }
    out
}

/// `values` as the export stores them under `map`. In f32 every value must
/// come back exactly (transformers computes hybridgen's weight from it);
/// bf16 rounds anyway.
fn export_values(values: &mut [f32], map: ValueMap, dtype: HfDtype, name: &str) -> Result<()> {
    if map == ValueMap::Same {
        return Ok(());
    }
    for (at, v) in values.iter_mut().enumerate() {
        *v = match (export_value(map, *v), dtype) {
            (Ok(e), _) => e,
            (Err(_), HfDtype::Bf16) if map == ValueMap::ZeroCentred => *v - 1.0,
            (Err(why), _) => {
                return Err(RuntimeError::Unsupported(format!(
                    "`{name}` element {at}: {why}; the export cannot be exact (a bf16 export, which \
                     rounds every weight, stores it rounded)"
                )));
            }
        };
    }
    Ok(())
}

/// Exports checkpoint `checkpoint` (a root's newest step, or a step
/// directory) as a Hugging Face folder `out` in `dtype`. Everything that
/// cannot be mapped is refused before anything is written; the folder is
/// written under a temporary name and renamed.
pub fn export(checkpoint: &Path, out: &Path, dtype: HfDtype) -> Result<ExportReport> {
    let reader = CheckpointReader::open(checkpoint, "CHECKPOINT")?;
    let model = reader.index.model.clone();
    let plan = one_rank_plan(&model)?;
    let (config, notes) = to_hf_config(&model, dtype)?;
    let tensors = hf_tensors(&plan, family_of(&model)?)?;
    let planned = planned(&tensors, dtype);
    files::check_output(out)?;
    // Each parameter once, even when it feeds several tensors (q, k, v).
    let mut cached: Option<(usize, Vec<f32>)> = None;
    let mut bytes_of = |i: usize| -> Result<Vec<u8>> {
        let t = &tensors[i];
        match &t.source {
            Source::ExpertBias { key: None } => {
                Ok(files::encode(&vec![0.0; t.numel()], HfDtype::F32))
            }
            Source::Zeros => Ok(files::encode(&vec![0.0; t.numel()], planned[i].dtype)),
            Source::ExpertBias { key: Some(key) } => {
                let bias = reader.param(key)?;
                if bias.len() != t.numel() {
                    return Err(RuntimeError::io(
                        checkpoint.display(),
                        format!(
                            "`{key}` holds {} values, the router has {} experts",
                            bias.len(),
                            t.numel()
                        ),
                    ));
                }
                Ok(files::encode(&bias, HfDtype::F32))
            }
            Source::Rows {
                param,
                key,
                pieces,
                map,
            } => {
                if cached.as_ref().is_none_or(|(p, _)| p != param) {
                    cached = Some((*param, reader.param(key)?));
                }
                let values = &cached.as_ref().expect("cached above").1;
                let def = plan.def(&plan.params[*param]);
                if values.len() != def.numel() {
                    return Err(RuntimeError::io(
                        checkpoint.display(),
                        format!(
                            "`{key}` holds {} values, but the model's shape {:?} needs {}",
                            values.len(),
                            def.shape,
                            def.numel()
                        ),
                    ));
                }
                let mut stored = gather_rows(values, def.row_numel(), pieces);
                export_values(&mut stored, *map, planned[i].dtype, key)?;
                Ok(files::encode(&stored, planned[i].dtype))
            }
        }
    };
    let written = files::write_folder(out, &config, &planned, files::SHARD_BYTES, &mut bytes_of)?;
    Ok(ExportReport {
        out: out.to_path_buf(),
        step: reader.index.step,
        files: written,
        tensors: planned.len(),
        bytes: planned.iter().map(Planned::bytes).sum(),
        notes,
    })
}

/// The layer kinds of a pattern, flat: decoder, then each MTP depth.
fn flat_kinds(pattern: &str) -> Result<Vec<LayerKind>> {
    let parsed = Pattern::parse(pattern).map_err(|d| RuntimeError::Unsupported(d.to_string()))?;
    Ok(parsed
        .layers()
        .map(|l| l.kind)
        .chain(
            parsed
                .mtp_depths
                .iter()
                .flat_map(|d| d.layers.iter().map(|l| l.kind)),
        )
        .collect())
}

/// Where one hybridgen parameter's rows are in the folder.
#[derive(Clone, Debug)]
struct ParamParts {
    numel: usize,
    cols: usize,
    parts: Vec<(String, Vec<Piece>, ValueMap)>,
}

/// A Hugging Face folder checked against a model: every tensor present,
/// of the right shape and a readable dtype, nothing left over. Values are
/// read when asked, one parameter at a time.
#[derive(Debug)]
pub struct HfWeights {
    folder: HfFolder,
    family: Family,
    /// The model the folder's `config.json` describes.
    pub model: ModelConfig,
    /// The model the weights were checked against (perhaps regrouped).
    bound: ModelConfig,
    by_key: HashMap<String, ParamParts>,
    /// The routers' expert biases (`e_score_correction_bias`) by the
    /// checkpoint key hybridgen keeps them under.
    biases: Vec<(String, Vec<f32>)>,
}

impl HfWeights {
    /// Opens folder `dir` and checks its tensors against its own config's
    /// model, regrouped by `pattern` when given (the same layers in the
    /// same order, grouped another way).
    pub fn open(dir: &Path, pattern: Option<&str>) -> Result<Self> {
        let folder = HfFolder::open(dir)?;
        let origin = dir.join(files::CONFIG).display().to_string();
        let model = from_hf_config(&folder.config, &origin)?;
        let family = match folder.config.get("model_type").and_then(Value::as_str) {
            Some("qwen3_next") => Family::Qwen3Next,
            _ => Family::NemotronH,
        };
        let mut bound = model.clone();
        if let Some(pattern) = pattern {
            bound.pattern = pattern.to_string();
        }
        let mut weights = HfWeights {
            folder,
            family,
            model,
            bound: bound.clone(),
            by_key: HashMap::new(),
            biases: Vec::new(),
        };
        weights.bind(&bound)?;
        Ok(weights)
    }

    /// The routers' expert biases, by the checkpoint key hybridgen keeps
    /// them under (empty for a model routing without one).
    pub fn biases(&self) -> &[(String, Vec<f32>)] {
        &self.biases
    }

    /// Checks the folder against `model` and records where each of its
    /// parameters is.
    fn bind(&mut self, model: &ModelConfig) -> Result<()> {
        let (ours, theirs) = (
            flat_kinds(&model.pattern)?,
            flat_kinds(&self.model.pattern)?,
        );
        if ours != theirs {
            let show = |k: &[LayerKind]| k.iter().map(|k| k.symbol()).collect::<String>();
            return Err(RuntimeError::Unsupported(format!(
                "the pattern `{}` has the layers `{}`, but {} has `{}`: a pattern may regroup the \
                 checkpoint's layers, not change them",
                model.pattern,
                show(&ours),
                self.folder.dir.join(files::CONFIG).display(),
                show(&theirs)
            )));
        }
        let plan = one_rank_plan(model)?;
        let tensors = hf_tensors(&plan, self.family)?;
        let dir = self.folder.dir.clone();
        let bad = |m: String| RuntimeError::io(dir.display(), m);
        let mut expected = BTreeSet::new();
        let mut by_key: HashMap<String, ParamParts> = HashMap::new();
        for t in &tensors {
            expected.insert(t.name.as_str());
            let stored = self.folder.tensors.get(&t.name).ok_or_else(|| {
                bad(format!(
                    "has no tensor `{}` ({:?}), which the model of its config.json needs",
                    t.name, t.shape
                ))
            })?;
            if stored.shape != t.shape {
                return Err(bad(format!(
                    "tensor `{}` is {:?}, but the model of its config.json needs {:?}",
                    t.name, stored.shape, t.shape
                )));
            }
            match &t.source {
                // An imported model always routes with an expert bias
                // (`from_hf_config`), so each router's has a key.
                Source::ExpertBias { key: Some(key) } => {
                    self.biases
                        .push((key.clone(), self.folder.read_f32(&t.name)?));
                }
                Source::ExpertBias { key: None } => {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "tensor `{}`: the model bound to the folder routes without an expert \
                         bias, which an imported model always has",
                        t.name
                    )));
                }
                Source::Zeros => {
                    // A gate hybridgen does not have: exact only when it is
                    // zero (sigmoid 0.5 for every token).
                    let values = self.folder.read_f32(&t.name)?;
                    if let Some(at) = values.iter().position(|v| *v != 0.0) {
                        return Err(bad(format!(
                            "tensor `{}` element {at} is {:e}: hybridgen's layer has no such gate, so \
                             it imports only an all-zero one (a constant 0.5)",
                            t.name, values[at]
                        )));
                    }
                }
                Source::Rows {
                    param,
                    key,
                    pieces,
                    map,
                } => {
                    let def = plan.def(&plan.params[*param]);
                    by_key
                        .entry(key.clone())
                        .or_insert_with(|| ParamParts {
                            numel: def.numel(),
                            cols: def.row_numel(),
                            parts: Vec::new(),
                        })
                        .parts
                        .push((t.name.clone(), pieces.clone(), *map));
                }
            }
        }
        if let Some(extra) = self
            .folder
            .tensors
            .keys()
            .find(|n| !expected.contains(n.as_str()))
        {
            return Err(bad(format!(
                "holds tensor `{extra}`, which is no tensor of the model its config.json describes \
                 (hybridgen maps every tensor or none)"
            )));
        }
        self.by_key = by_key;
        Ok(())
    }

    /// The model the weights were checked against.
    pub fn bound_model(&self) -> &ModelConfig {
        &self.bound
    }

    /// Refuses `model` unless it is the one the weights were checked
    /// against, naming the settings as `spelling` spells them.
    pub fn check_model(&self, model: &ModelConfig, spelling: SettingSpelling) -> Result<()> {
        if *model == self.bound {
            return Ok(());
        }
        let pattern = spelling.name(Setting::Pattern);
        Err(RuntimeError::Unsupported(format!(
            "{}: the run's model differs from the one its config.json describes \
             (with {pattern} `{}`); train that model (give {pattern} only to regroup it)",
            spelling.given(Setting::InitFrom, self.folder.dir.display()),
            self.bound.pattern
        )))
    }

    /// The whole value of the parameter with checkpoint key `key`.
    pub fn values(&self, key: &str) -> Result<Vec<f32>> {
        let parts = self.by_key.get(key).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("no Hugging Face tensor holds `{key}`"))
        })?;
        let mut out = vec![0.0f32; parts.numel];
        let bad = |name: &str, m: String| {
            RuntimeError::io(self.folder.dir.display(), format!("tensor `{name}` {m}"))
        };
        for (name, pieces, map) in &parts.parts {
            let values = self.folder.read_f32(name)?;
            let mut at = 0;
            for piece in pieces {
                let n = piece.len() * parts.cols;
                let stored = &values[at..at + n];
                match piece {
                    Piece::Rows(r) => {
                        let into = &mut out[r.start * parts.cols..r.end * parts.cols];
                        for (k, (o, v)) in into.iter_mut().zip(stored).enumerate() {
                            *o = import_value(*map, *v)
                                .map_err(|why| bad(name, format!("element {}: {why}", at + k)))?;
                        }
                    }
                    Piece::Zeros(_) => {
                        if let Some(k) = stored.iter().position(|v| *v != 0.0) {
                            return Err(bad(
                                name,
                                format!(
                                    "element {} is {:e}: it is an output gate hybridgen's layer \
                                     does not have, so it imports only as zero (a constant 0.5)",
                                    at + k,
                                    stored[k]
                                ),
                            ));
                        }
                    }
                }
                at += n;
            }
        }
        Ok(out)
    }

    /// Fills `out` with elements `range` of parameter `p` of `plan` (the
    /// run's plan, any `ep`) as EP rank `ep_rank` holds it.
    pub fn fill(
        &self,
        plan: &Plan,
        p: usize,
        ep_rank: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let param = &plan.params[p];
        let key = plan.checkpoint_key(param, ep_rank);
        let values = self.values(&key)?;
        let numel = plan.def(param).numel();
        if values.len() != numel {
            return Err(RuntimeError::InvalidArgument(format!(
                "`{key}`: the Hugging Face folder holds {} values for a parameter of {numel}: \
                 its config.json and its tensors disagree (fetch the folder again)",
                values.len()
            )));
        }
        if range.end > numel || range.len() != out.len() {
            return Err(RuntimeError::InvalidArgument(format!(
                "`{key}`: elements {range:?} of {numel} asked into {} values",
                out.len()
            )));
        }
        out.copy_from_slice(&values[range]);
        Ok(())
    }
}

/// Imports Hugging Face folder `hf_dir` as a checkpoint root `output`
/// holding step 0: the weights, zero optimizer moments, and the settings of
/// `hybridgen train`'s defaults. `pattern` regroups the layers. Every
/// tensor's name, shape and dtype is checked before anything is written;
/// the values then stream one parameter at a time (a published model
/// imports in the memory of its largest tensor), and a read that fails
/// removes the output again.
pub fn import_checkpoint(
    hf_dir: &Path,
    output: &Path,
    pattern: Option<&str>,
) -> Result<(PathBuf, ModelConfig)> {
    files::check_new(output, "import")?;
    let weights = HfWeights::open(hf_dir, pattern)?;
    let model = weights.bound.clone();
    let plan = one_rank_plan(&model)?;
    let run = RunState::of(
        &TrainConfig::new(model.clone()).run_settings(),
        DataRecord::Synthetic,
    );
    let written = write_fresh(
        output,
        &plan,
        run,
        &mut |p| weights.values(&plan.checkpoint_key(&plan.params[p], 0)),
        &weights.biases,
    );
    match written {
        Ok(dir) => Ok((dir, model)),
        Err(e) => {
            // `check_new` found no output: everything there is ours.
            let _ = std::fs::remove_dir_all(output);
            Err(e)
        }
    }
}

/// hybridgen's own loss on one fixed sequence, for comparing an export with
/// what transformers computes from it.
#[derive(Clone, Debug, PartialEq)]
pub struct LossCheck {
    /// `seq_length + 1` tokens: inputs are the first `seq_length`, labels
    /// the last `seq_length` (transformers' `labels=input_ids` shift).
    pub tokens: Vec<u32>,
    /// Main cross-entropy, mean over the sequence (nats).
    pub loss: f64,
    /// The MoE load-balancing loss (not part of `loss`).
    pub aux_loss: f64,
}

/// Runs the model of Hugging Face folder `hf_dir`, with its weights, on the
/// first sequence of the seeded synthetic stream (one CPU rank, f32) and
/// returns the tokens and the loss.
pub fn loss_check(hf_dir: &Path, seq_length: usize, seed: u64) -> Result<LossCheck> {
    use crate::data::{BatchKey, BatchShape};
    let weights = HfWeights::open(hf_dir, None)?;
    let mut config = TrainConfig::new(weights.bound_model().clone());
    config.ranks = 1;
    config.ep = 1;
    config.micro_batches = 1;
    config.micro_batch_size = 1;
    config.seq_length = seq_length;
    config.steps = 1;
    config.seed = seed;
    config.init_from = Some(std::sync::Arc::new(weights));
    let prepared = crate::train::prepare(&config)?;
    let key = BatchKey {
        seed,
        step: 0,
        dp_rank: 0,
        micro_batch: 0,
    };
    let shape = BatchShape::new(1, seq_length);
    let batch = prepared.data.batch(key, shape)?;
    let tokens = batch.tokens()[..seq_length + 1].to_vec();
    let mut first = None;
    crate::train::train_prepared(&prepared, &mut |report| {
        first.get_or_insert((report.loss, report.aux_loss));
    })?;
    let (loss, aux_loss) = first
        .ok_or_else(|| RuntimeError::InvalidArgument("the one-step run reported no step".into()))?;
    Ok(LossCheck {
        tokens,
        loss,
        aux_loss,
    })
}

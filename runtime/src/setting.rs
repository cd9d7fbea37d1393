//! The runtime's settings by name ([`Setting`]), and how its messages spell
//! them ([`SettingSpelling`]). The runtime speaks in settings: a message
//! that tells the user what to change names the setting, spelled as the
//! user gave it. A library run's are the fields of its configuration
//! (`config.ranks`, the default); `hybridgen train` hands its flags
//! (`--ranks`) from the one table of them, in the command line's code.

use std::fmt::Display;

/// A user-facing setting of a training run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Setting {
    /// The model: pattern and dimensions.
    Model,
    Seed,
    Data,
    MicroBatches,
    MicroBatchSize,
    SeqLength,
    Optimizer,
    Lr,
    Warmup,
    WeightDecay,
    ClipGrad,
    /// The decay after the warm-up: style, minimum rate, decay steps.
    LrSchedule,
    Beta1,
    Beta2,
    Eps,
    Momentum,
    Ranks,
    Ep,
    Sharding,
    Schedule,
    Precision,
    /// The pattern the model's layers are grouped by.
    Pattern,
    /// Pipeline-parallel size of a plan.
    Pp,
    /// The rate the decay ends at.
    MinLr,
    /// The step the decay reaches the minimum rate.
    LrDecaySteps,
    /// The final steps of a WSD decay.
    LrWsdDecaySteps,
    /// Megatron indexed datasets: a prefix, or weighted prefixes.
    DataPath,
    /// How indexed data is split into train, validation and test parts.
    Split,
    /// The checkpoint root a run saves to.
    Save,
    SaveEvery,
    KeepLast,
    AsyncSave,
    Resume,
    /// Weights a fresh run starts from.
    InitFrom,
    Trace,
    EvalEvery,
    EvalSteps,
    Device,
}

impl Setting {
    /// Every setting.
    pub const ALL: [Setting; 38] = [
        Setting::Model,
        Setting::Seed,
        Setting::Data,
        Setting::MicroBatches,
        Setting::MicroBatchSize,
        Setting::SeqLength,
        Setting::Optimizer,
        Setting::Lr,
        Setting::Warmup,
        Setting::WeightDecay,
        Setting::ClipGrad,
        Setting::LrSchedule,
        Setting::Beta1,
        Setting::Beta2,
        Setting::Eps,
        Setting::Momentum,
        Setting::Ranks,
        Setting::Ep,
        Setting::Sharding,
        Setting::Schedule,
        Setting::Precision,
        Setting::Pattern,
        Setting::Pp,
        Setting::MinLr,
        Setting::LrDecaySteps,
        Setting::LrWsdDecaySteps,
        Setting::DataPath,
        Setting::Split,
        Setting::Save,
        Setting::SaveEvery,
        Setting::KeepLast,
        Setting::AsyncSave,
        Setting::Resume,
        Setting::InitFrom,
        Setting::Trace,
        Setting::EvalEvery,
        Setting::EvalSteps,
        Setting::Device,
    ];

    /// Where a library run sets it: the training configuration's field
    /// (`crate::train::TrainConfig`, named `config`).
    pub fn field(self) -> &'static str {
        match self {
            Setting::Model => "config.model",
            Setting::Seed => "config.seed",
            Setting::Data => "config.data",
            Setting::MicroBatches => "config.micro_batches",
            Setting::MicroBatchSize => "config.micro_batch_size",
            Setting::SeqLength => "config.seq_length",
            Setting::Optimizer => "config.optimizer.kind",
            Setting::Lr => "config.optimizer.lr",
            Setting::Warmup => "config.optimizer.warmup_steps",
            Setting::WeightDecay => "config.optimizer.weight_decay",
            Setting::ClipGrad => "config.optimizer.clip_grad",
            Setting::LrSchedule => "config.optimizer.schedule",
            Setting::Beta1 => "config.optimizer.beta1",
            Setting::Beta2 => "config.optimizer.beta2",
            Setting::Eps => "config.optimizer.eps",
            Setting::Momentum => "config.optimizer.momentum",
            Setting::Ranks => "config.ranks",
            Setting::Ep => "config.ep",
            Setting::Sharding => "config.sharding",
            Setting::Schedule => "config.schedule",
            Setting::Precision => "config.precision",
            Setting::Pattern => "config.model.pattern",
            Setting::Pp => "config.pp",
            Setting::MinLr => "config.optimizer.schedule.min_lr",
            Setting::LrDecaySteps => "config.optimizer.schedule.decay_steps",
            Setting::LrWsdDecaySteps => "config.optimizer.schedule.wsd_decay_steps",
            Setting::DataPath => "the indexed data's blend",
            Setting::Split => "the indexed data's split",
            Setting::Save => "config.save",
            Setting::SaveEvery => "config.save_every",
            Setting::KeepLast => "config.keep_last",
            Setting::AsyncSave => "config.async_save",
            Setting::Resume => "config.resume",
            Setting::InitFrom => "config.init_from",
            Setting::Trace => "config.trace",
            Setting::EvalEvery => "config.eval_every",
            Setting::EvalSteps => "config.eval_steps",
            Setting::Device => "config.device",
        }
    }

    /// How the run is spread over ranks: a resume may change it
    /// (checkpoints reshard), and takes the checkpoint's only when left out.
    pub fn is_layout(self) -> bool {
        matches!(
            self,
            Setting::Ranks | Setting::Ep | Setting::Pp | Setting::Sharding | Setting::Schedule
        )
    }
}

/// How messages spell settings: as the fields of the configuration (the
/// default), or as the flags of a command line, from its table (settings
/// without a flag keep their field's name).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SettingSpelling {
    flags: &'static [(Setting, &'static str)],
}

impl SettingSpelling {
    /// The configuration's field names (`config.ranks`).
    pub const FIELDS: SettingSpelling = SettingSpelling { flags: &[] };

    /// A command line's: each setting in `flags` by its flag (`--ranks`).
    pub const fn flags(flags: &'static [(Setting, &'static str)]) -> Self {
        SettingSpelling { flags }
    }

    /// The flag that gives `setting`, when spelled as flags and it has one.
    pub fn flag(&self, setting: Setting) -> Option<&'static str> {
        self.flags
            .iter()
            .find(|(s, _)| *s == setting)
            .map(|&(_, flag)| flag)
    }

    /// `setting`'s name: its flag, or else its field.
    pub fn name(&self, setting: Setting) -> &'static str {
        self.flag(setting).unwrap_or(setting.field())
    }

    /// `setting` given `value`: `--seed 7`, or `config.seed = 7`.
    pub fn given(&self, setting: Setting, value: impl Display) -> String {
        match self.flag(setting) {
            Some(flag) => format!("{flag} {value}"),
            None => format!("{} = {value}", setting.field()),
        }
    }
}

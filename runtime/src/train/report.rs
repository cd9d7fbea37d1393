//! What a run tells its caller: each step's report as it completes, and
//! the summary at its end.

use crate::backend::DeviceStats;
use std::path::PathBuf;
use std::time::Duration;

/// One step's results, the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// 1-based step number (continuing a resumed run's count).
    pub step: u64,
    /// Main cross-entropy, mean over every token of the step (nats).
    pub loss: f64,
    /// Mean MTP cross-entropy over depths, when the model has MTP.
    pub mtp_loss: Option<f64>,
    /// MoE load-balancing loss, mean over micro-batches and ranks.
    pub aux_loss: f64,
    /// The `D` layers' indexer loss (Megatron's "indexer loss": its
    /// coefficient applied, mean over micro-batches, ranks and `D` layers),
    /// when the model has `D` layers and a nonzero
    /// `dsa.indexer_loss_coeff`.
    pub indexer_loss: Option<f64>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub elapsed: Duration,
    /// The validation loss after this step's update, on steps that
    /// evaluate (`TrainConfig::eval_every`): the mean cross-entropy over
    /// every token of the fixed evaluation batches.
    pub eval_loss: Option<f64>,
    /// What rank 0's device did for the step (its forward, backward and
    /// optimizer step). Host reads: one per MoE layer and micro-batch (the
    /// all-to-all's counts) and two at the step's end (the loss sums and the
    /// gradient-norm partials); every read waits for the device, so this is
    /// a budget the runtime keeps. Allocations: none after the first step.
    pub device: DeviceStats,
}

/// The closing summary of a run.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub steps: u64,
    /// The step count after the run (includes a resumed checkpoint's).
    pub last_step: u64,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    /// The last evaluation's loss, when the run evaluated.
    pub final_eval_loss: Option<f64>,
    pub entropy_floor: Option<f64>,
    pub data: String,
    pub tokens: u64,
    pub wall: Duration,
    pub tokens_per_second: f64,
    pub mean_step_time: Duration,
    /// Comm-lane busy time summed over ranks, and how much of it overlapped
    /// compute.
    pub comm_busy: Duration,
    pub comm_hidden: Duration,
    /// Under pipeline parallelism, per pipeline rank: the measured bubble,
    /// the share of its ranks' time their compute lane sat idle while a
    /// stage-to-stage exchange was in flight (`trace::RankStats::waited`),
    /// over the ranks this process ran. Empty without a pipeline.
    pub stage_waits: Vec<f64>,
    /// 1F1B's bubble in theory, `(p - 1) / (m + p - 1)` for `p` pipeline
    /// ranks and `m` micro-batches (`(p - 1) / (v m + p - 1)` with `v`
    /// virtual stages a rank); `None` without a pipeline.
    pub ideal_bubble: Option<f64>,
    /// A hash of every final parameter's bits, in plan order (experts of
    /// every EP rank included): equal hashes mean equal parameters.
    pub param_hash: u64,
    pub resumed_from: Option<u64>,
    /// The checkpoint resumed: its step directory.
    pub resumed_dir: Option<PathBuf>,
    /// The last checkpoint saved: its step directory.
    pub saved_to: Option<PathBuf>,
    /// The time the first local rank's steps waited on checkpoints, all of
    /// them: writing its rank file (with `async_save`, copying its tensors
    /// to host memory instead), waiting for its peers' and the index.
    pub save_time: Duration,
    /// Checkpoints the first local rank wrote behind the steps
    /// (`async_save`); the others streamed (the last step's, or where the
    /// host gave no memory for the copy).
    pub saves_behind: u64,
    pub trace: Option<PathBuf>,
    /// Where the first local rank's start-up went, before its first step.
    pub startup: StartupTimes,
    /// The parameter hash's own time at the end of the run (gathering and
    /// hashing every final parameter on the first local rank).
    pub hash_time: Duration,
    /// The model's FLOPs per token, forward and backward, at the run's
    /// sequence length (`hybridgen_dsl::flops`): what MFU divides by;
    /// `None` for layer kinds the formula does not cover.
    pub flops_per_token: Option<u64>,
    /// The first local rank's device memory over the run: the most its
    /// buffers held at once, and what its arenas held at the end (in use
    /// or free). Both leave out what the device's libraries and context
    /// hold beside the arenas.
    pub peak_allocated_bytes: u64,
    pub reserved_bytes: u64,
}

/// Where a rank's start-up goes, phase by phase, before its first step
/// (the first step's own time is its step report's).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StartupTimes {
    /// The platform: loading the driver and making the world every rank
    /// joins (a launched job's rendezvous included).
    pub platform: Duration,
    /// The device and the communicators: opening the GPU, loading (or
    /// compiling) the kernels, NCCL.
    pub device: Duration,
    /// The parameters: initialising (or reading) them, placing their
    /// shards on the device.
    pub params: Duration,
    /// The time spent drawing (or reading) the values on the host, on a
    /// thread that overlaps it with allocating and uploading: `params` is
    /// at least this, and at most this plus the uploads.
    pub params_drawn: Duration,
    /// The optimizer's state and the step context.
    pub optimizer: Duration,
    /// Loading the checkpoint resumed (zero without one).
    pub resume: Duration,
}

impl StartupTimes {
    pub fn total(&self) -> Duration {
        self.platform + self.device + self.params + self.optimizer + self.resume
    }
}

impl TrainSummary {
    /// The share of comm-lane time hidden under compute.
    pub fn hidden_fraction(&self) -> Option<f64> {
        (!self.comm_busy.is_zero())
            .then(|| self.comm_hidden.as_secs_f64() / self.comm_busy.as_secs_f64())
    }
}

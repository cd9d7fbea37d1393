//! `hybridgen train`: the main job. With no flags it trains the `tiny`
//! preset on synthetic data on the CPU with two thread ranks, expert
//! parallelism 2 and the overlap schedule.

use super::{Failure, board, human};
use clap::ArgMatches;
use clap::parser::ValueSource;
use hybridgen_dsl::plan::UnitFilter;
use hybridgen_runtime::backend::{AttentionBackend, ExpertGemm};
use hybridgen_runtime::checkpoint::ResumeFrom;
use hybridgen_runtime::data::{DataChoice, IndexedSpec, Split};
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::optimizer::{
    LrDecayStyle, LrSchedule, OptimizerConfig, OptimizerKind, WsdDecayStyle,
};
use hybridgen_runtime::platform::{ChosenDevice, DeviceChoice, Transport, choose_device};
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::setting::{Setting, SettingSpelling};
use hybridgen_runtime::train::{
    MAX_TIMEOUT, StepReport, TrainConfig, TrainSummary, prepare_on, train_prepared,
};
use hybridgen_runtime::{Precision, RuntimeError};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub(crate) struct TrainArgs {
    /// A built-in preset (`hybridgen preset` lists them).
    #[arg(
        long,
        value_name = "NAME",
        default_value = "tiny",
        conflicts_with = "model"
    )]
    preset: String,
    /// A model file (TOML) instead of a preset.
    #[arg(long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// Train this pattern with the preset's (or model file's) dimensions.
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    pattern: Option<String>,
    /// `auto`: the GPUs when a usable one is visible, else the CPU (the
    /// run says which it took); `cpu`: thread ranks on the CPU; `cuda`:
    /// NVIDIA GPUs, refusing to start without a usable one.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Ranks (CPU: threads of this process; GPUs: one per GPU): --pp
    /// pipeline stages of ranks / pp data-parallel ranks each [default: 2
    /// on the CPU; on GPUs every visible GPU, or the launcher's
    /// WORLD_SIZE].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    ranks: Option<u32>,
    /// Expert-parallel size; must divide the data-parallel size (--ranks
    /// over --pp) [default: 2, or 1 when that is odd on GPUs].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    ep: Option<u32>,
    /// Pipeline-parallel size; must divide --ranks. The pattern's `|`
    /// segments are the stages (a multiple of pp of them: segment s runs on
    /// pipeline rank s % pp, several a rank interleaved), or else its
    /// layers split evenly; the schedule is 1F1B [default: 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pp: Option<u32>,
    /// Micro-batches per step (per rank).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    micro_batches: u32,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    micro_batch_size: u32,
    /// Tokens per sequence [default: the model's seq_length].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    seq_len: Option<u32>,
    /// Train until step N. A resumed run continues from its checkpoint's
    /// step, so a restarted job ends where it would have.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// `overlap`: combined 1F1B with expert-parallel overlap; `plain`:
    /// forward then backward per micro-batch.
    #[arg(long, value_enum, default_value = "overlap")]
    schedule: ScheduleArg,
    /// `full`: every layer but the MoE (`E`) ones keeps only its input and
    /// runs its forward again in the backward (Megatron's full
    /// recomputation): far less activation memory for about one more
    /// forward pass, the same bits; `none` keeps every activation; a
    /// number N: the first N layers but MoE ones (Megatron's `block`
    /// method); `largest:N`: the N of them that keep the most (the kind
    /// whose layers keep the most first); `auto`: the fewest with which the
    /// run fits the memory available, taken as `largest:N` takes them (the
    /// memory check's estimate; none where it fits as it is), the fastest
    /// run that fits.
    #[arg(
        long,
        value_name = "none|full|auto|N|largest:N",
        default_value = "auto"
    )]
    recompute: Recompute,
    /// Attention kernels on GPUs: `flash` runs bf16 heads of 64 or 128
    /// channels fused (FlashAttention-2's tiling; the probabilities and
    /// score gradients round to bf16 between their two products, as
    /// FlashAttention's do) and the rest unfused; `unfused` takes the
    /// materialised scores through cuBLAS everywhere (one rounding, at the
    /// store). The CPU has the unfused path only.
    #[arg(long, value_enum, default_value = "flash")]
    attention_backend: AttentionBackendArg,
    /// How GPUs run the MoE experts' GEMMs: `grouped` (one launch of the
    /// grouped TMA + wgmma kernel for all experts, on Hopper; cuBLAS
    /// elsewhere) or `cublas` (one GEMM an expert, over three streams).
    /// Both give the same bits on the benchmark model. The CPU has one
    /// path.
    #[arg(long, value_enum, default_value = "grouped")]
    expert_gemm: ExpertGemmArg,
    /// `on`: on Hopper GPUs each kernel launches while the one before it
    /// drains and waits on the device for its results (programmatic
    /// dependent launch), hiding the launch gap between kernels; `off`
    /// launches each after the one before has finished. The same bits
    /// either way; other GPUs and the CPU ignore it.
    #[arg(long, value_enum, default_value = "on")]
    dependent_launch: Switch,
    /// How the GPU ranks of one process exchange data: `nccl` (one rank a
    /// GPU; the only choice under torchrun or srun) or `copy` (the GPUs'
    /// copy engines move all-gathers and all-to-alls without SMs and sums
    /// run on the receiving GPU in rank order; `--ranks` may exceed the
    /// GPUs, which then hold ranks round-robin, so one GPU runs ZeRO-3 and
    /// expert parallelism). The CPU ignores it.
    #[arg(long, value_enum, default_value = "nccl")]
    transport: TransportArg,
    /// ZeRO stage: 3 shards parameters, gradients and optimizer state; 0 is
    /// plain data parallelism (no_shard).
    #[arg(long, value_parser = ["0", "3"], default_value = "3")]
    zero: String,
    /// What parameters and activations are stored in: `bf16` (Megatron's
    /// mixed precision: master weights, gradients and optimizer state stay
    /// f32); `f32` keeps everything in f32 (on GPUs without TF32: the
    /// checking mode) [default: bf16 on GPUs, f32 on the CPU].
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// `synthetic` (a Markov stream with a known entropy floor) or a file
    /// path (bytes as tokens).
    #[arg(long, value_name = "synthetic|FILE", default_value = "synthetic")]
    data: String,
    /// Megatron indexed datasets (PREFIX.idx + PREFIX.bin, e.g. from
    /// `hybridgen data prepare`): one PREFIX, or a weighted blend `0.3 A
    /// 0.7 B`, as Megatron's flag takes it. Replaces --data.
    #[arg(long, value_name = "[WEIGHT] PREFIX", num_args = 1.., conflicts_with = "data")]
    data_path: Vec<String>,
    /// How --data-path's documents are split into train, validation and
    /// test parts (relative sizes; a part given a size must get a document).
    #[arg(long, value_name = "TRAIN,VALID,TEST", default_value = "969,30,1", value_parser = split_arg)]
    split: Split,
    /// The tokenizer.json the data was prepared with: the run refuses to
    /// start when the model's vocabulary does not cover it.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Seed of initialisation and data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: OptimizerArg,
    /// Peak learning rate (a finite number above 0).
    #[arg(long, default_value_t = 3e-3, allow_hyphen_values = true, value_parser = learning_rate)]
    lr: f32,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// The decay after the warm-up, as Megatron's: `constant`, or
    /// `linear`, `cosine` or `wsd` (warm-up, stable, decay) down to
    /// --min-lr at --lr-decay-steps.
    #[arg(long, value_enum, default_value = "constant")]
    lr_decay_style: DecayStyleArg,
    /// The learning rate the decay ends at (0 to --lr).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = min_lr)]
    min_lr: f32,
    /// The step the decay reaches --min-lr (warm-up included) [default:
    /// --steps].
    #[arg(long, value_name = "N")]
    lr_decay_steps: Option<u64>,
    /// `wsd`: the final steps over which the rate falls [default: a tenth
    /// of the steps after the warm-up].
    #[arg(long, value_name = "N")]
    lr_wsd_decay_steps: Option<u64>,
    /// `wsd`: the shape of the final decay.
    #[arg(long, value_enum, default_value = "exponential")]
    lr_wsd_decay_style: WsdStyleArg,
    /// Decoupled weight decay (matrices only; 0 or above).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true, value_parser = weight_decay)]
    weight_decay: f32,
    /// Clip gradients to this global norm; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true, value_parser = clip_norm)]
    clip_grad: f32,
    /// FSDP units by kind instead of the default rule (see `hybridgen plan --help`).
    #[arg(long, value_name = "KINDS")]
    units: Option<String>,
    /// Save checkpoints under DIR at the end of the run: one directory per
    /// step (DIR/step-000120) and DIR/latest naming the newest. DIR must be
    /// new, empty or a checkpoint root; one run at a time writes it.
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Also save every N steps.
    #[arg(long, value_name = "N", requires = "save")]
    save_every: Option<u64>,
    /// Keep only the newest N steps under --save (older ones are removed
    /// once a newer one is complete).
    #[arg(long, value_name = "N", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    keep_last: Option<u64>,
    /// Write checkpoints behind the steps: the steps wait for a copy of
    /// each rank's tensors in host memory, not for the files (refused when
    /// the host lacks the memory for the copy).
    #[arg(long, requires = "save")]
    async_save: bool,
    /// Resume from a checkpoint root (its newest complete step), one step's
    /// directory, or `auto`: the --save root's newest step when it has one,
    /// else a fresh start. Settings left out (seed, data, batch sizes,
    /// optimizer, precision, layout, model) are the checkpoint's; a contradicting
    /// flag is refused, except the layout flags (checkpoints reshard). A
    /// directory named `auto` is `./auto`.
    #[arg(long, value_name = "auto|DIR")]
    resume: Option<PathBuf>,
    /// Start from the weights of a Hugging Face Nemotron-H or Qwen3-Next folder; its
    /// config.json is the model (--pattern may regroup its layers).
    #[arg(long, value_name = "HF_DIR", conflicts_with_all = ["preset", "model", "resume"])]
    init_from: Option<PathBuf>,
    /// Write a Chrome trace (open in Perfetto or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Print a loss line every N steps (text format).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: u64,
    /// Evaluate every N steps: the loss on held-out data (--data-path's
    /// validation part; for other data, fixed batches the run never trains
    /// on), forward only, printed and in the JSON lines as "eval_loss".
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    eval_every: Option<u64>,
    /// Batches per evaluation (each as large as a training step's).
    #[arg(long, value_name = "K", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..), requires = "eval_every")]
    eval_steps: u64,
    /// Append every step's JSON line (and the summary's) to FILE, whatever
    /// --format says; `hybridgen plot FILE` draws its curves.
    #[arg(long, value_name = "FILE")]
    log_file: Option<PathBuf>,
    /// Write the run's curves as TensorBoard event files into DIR (made if
    /// missing; the process of rank 0 only), under Megatron's tags (`lm
    /// loss`, `learning-rate`, `grad-norm`, ...), flushed at every logged
    /// step so a TensorBoard watching DIR shows the run live. A resumed run
    /// adds a file whose steps continue the same curves.
    #[arg(long, value_name = "DIR")]
    tensorboard_dir: Option<PathBuf>,
    /// Seconds a rank waits for its peers before reporting them stalled (1
    /// to 604800, a week).
    #[arg(long, default_value_t = 60, allow_hyphen_values = true, value_parser = timeout_seconds)]
    timeout: u64,
    /// `text`: progress bar, loss lines and a summary; `json`: one JSON
    /// object per step on stdout, then a summary object, or on failure an
    /// `{"error": {"code", "message"}}` object.
    #[arg(long, value_enum, default_value = "text")]
    format: FormatArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ScheduleArg {
    Overlap,
    Plain,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum AttentionBackendArg {
    Flash,
    Unfused,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Switch {
    On,
    Off,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum TransportArg {
    Nccl,
    Copy,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum ExpertGemmArg {
    Cublas,
    Grouped,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum DeviceArg {
    Auto,
    Cpu,
    Cuda,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum PrecisionArg {
    F32,
    Bf16,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum DecayStyleArg {
    Constant,
    Linear,
    Cosine,
    Wsd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum WsdStyleArg {
    Linear,
    Cosine,
    Exponential,
    MinusSqrt,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum OptimizerArg {
    Adam,
    Sgd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum FormatArg {
    Text,
    Json,
}

/// Parses a float flag's value and checks it is finite and in range.
fn float_in(value: &str, ok: impl Fn(f32) -> bool, range: &str) -> Result<f32, String> {
    let parsed: f32 = value
        .trim()
        .parse()
        .map_err(|_| format!("`{value}` is not a number; give {range}"))?;
    if !parsed.is_finite() {
        Err(format!("{parsed} is not a finite number; give {range}"))
    } else if ok(parsed) {
        Ok(parsed)
    } else {
        Err(format!("{parsed} is out of range; give {range}"))
    }
}

fn learning_rate(value: &str) -> Result<f32, String> {
    float_in(
        value,
        |v| v > 0.0,
        "a finite learning rate above 0 (e.g. 3e-3)",
    )
}

fn min_lr(value: &str) -> Result<f32, String> {
    float_in(
        value,
        |v| v >= 0.0,
        "a finite learning rate of 0 or more, at most --lr",
    )
}

fn split_arg(value: &str) -> Result<Split, String> {
    Split::parse(value, SPELLING)
}

fn weight_decay(value: &str) -> Result<f32, String> {
    float_in(
        value,
        |v| v >= 0.0,
        "a finite decay of 0 or more (0 turns it off)",
    )
}

fn clip_norm(value: &str) -> Result<f32, String> {
    float_in(
        value,
        |v| v >= 0.0,
        "a finite norm above 0, or 0 to turn clipping off",
    )
}

fn timeout_seconds(value: &str) -> Result<u64, String> {
    let max = MAX_TIMEOUT.as_secs();
    match value.trim().parse::<u64>() {
        Ok(s) if (1..=max).contains(&s) => Ok(s),
        _ => Err(format!(
            "`{value}` is not a timeout; give whole seconds from 1 to {max} (a week)"
        )),
    }
}

/// The environment variable that overrides the memory the run may use.
const MEMORY_VARIABLE: &str = "HYBRIDGEN_MEMORY_AVAILABLE";

/// Bytes from `HYBRIDGEN_MEMORY_AVAILABLE`: a whole number with an optional
/// binary suffix (`K`, `M`, `G`, `T`, optionally followed by `iB` or `B`).
fn memory_override() -> Result<Option<u64>, String> {
    let Some(raw) = std::env::var_os(MEMORY_VARIABLE) else {
        return Ok(None);
    };
    let text = raw.to_string_lossy();
    let bad = || {
        format!(
            "{MEMORY_VARIABLE}={text} is not a memory size; give bytes, or a number with K, M, \
             G or T (e.g. 16G)"
        )
    };
    let trimmed = text.trim();
    let digits = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(digits);
    let number: u64 = number.parse().map_err(|_| bad())?;
    let shift = match suffix
        .trim()
        .trim_end_matches("iB")
        .trim_end_matches('B')
        .to_ascii_uppercase()
        .as_str()
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad()),
    };
    number.checked_mul(1 << shift).map(Some).ok_or_else(bad)
}

/// The code of an error found before the run started: the configuration's
/// fault unless a file, the memory, the device or hybridgen itself (an
/// internal check on what it built from a valid plan) failed.
fn prepare_code(error: &RuntimeError) -> &'static str {
    if matches!(error.root_cause(), RuntimeError::Internal(_)) {
        return "internal";
    }
    match error.code() {
        code @ ("io" | "out_of_memory" | "device_failed") => code,
        _ => "invalid_config",
    }
}

/// `matches`: the parsed command line, to tell the flags given from those
/// left at their defaults.
pub(crate) fn run(args: &TrainArgs, matches: Option<&ArgMatches>) -> Result<(), Failure> {
    let started = Instant::now();
    let json = args.format == FormatArg::Json;
    let (config, device) = config(args, matches).map_err(|f| f.coded("invalid_config", json))?;
    // Everything is checked before anything is printed or allocated.
    let prepared = prepare_on(&config, device).map_err(|e| Failure::Coded {
        code: prepare_code(&e),
        message: runtime_message(&e),
        json,
    })?;
    let mut clock = CommandClock {
        prepared: started.elapsed(),
        first_step: None,
        trained: Duration::ZERO,
    };
    let config = &prepared.config;
    let resume = prepared.checkpoints.resume.as_ref();
    let steps = config
        .steps
        .saturating_sub(prepared.resume_step().unwrap_or(0));
    // Opened before anything is printed: a directory that cannot be
    // written is refused before the first step.
    let board = match &args.tensorboard_dir {
        Some(dir) if first_rank() => {
            Some(open_board(dir, &prepared, args).map_err(|e| e.coded("io", json))?)
        }
        _ => None,
    };
    let text = args.format == FormatArg::Text;
    if text {
        match (resume, &config.resume, &config.save) {
            (Some(resume), _, _) => {
                let mut line = format!(
                    "resuming {} at step {}",
                    resume.dir.display(),
                    resume.step()
                );
                if !resume.inherited.is_empty() {
                    line += &format!(" (from the checkpoint: {})", resume.inherited.join(", "));
                }
                super::emit(&format!("{line}\n"))?;
            }
            (None, Some(ResumeFrom::Auto), Some(save)) => super::emit(&format!(
                "no checkpoint in {} yet: starting fresh\n",
                save.display()
            ))?,
            _ => {}
        }
        let model_inherited = resume.is_some() && config.from_checkpoint.contains(&Setting::Model);
        super::emit(&format!(
            "training {} ({}) on {}, {} rank{}, ep {}{}, {} schedule, ZeRO-{}, {}, {}{} steps of {} tokens\n",
            config.model.pattern,
            if model_inherited {
                "the checkpoint's model".to_string()
            } else {
                args.model.as_ref().map_or_else(
                    || format!("preset {}", args.preset),
                    |p| p.display().to_string(),
                )
            },
            prepared.device.describe(),
            config.ranks,
            if config.ranks == 1 { "" } else { "s" },
            config.ep,
            match config.pp {
                1 => String::new(),
                pp => format!(", pp {pp} (1F1B)"),
            },
            match config.schedule {
                ScheduleKind::Overlap => "overlap",
                ScheduleKind::Plain => "plain",
            },
            if config.sharding == Sharding::Zero3 {
                3
            } else {
                0
            },
            config.precision,
            match prepared.recomputed_layers() {
                (0, _) => String::new(),
                (n, of) => format!("recomputing {n} of {of} layers, "),
            },
            steps,
            config.tokens_per_step(),
        ))?;
    }
    let bar = if text && std::io::stderr().is_terminal() {
        let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  loss {msg}  [{elapsed} < {eta}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Some(bar)
    } else {
        None
    };
    let mut output_error = None;
    let mut log = args
        .log_file
        .as_deref()
        .map(LogFile::open)
        .transpose()
        .map_err(|e| e.coded("io", json))?;
    let mut on_step = |report: &StepReport| {
        clock.first_step.get_or_insert_with(|| started.elapsed());
        let line = if text {
            if let Some(bar) = &bar {
                bar.set_message(format!("{:.4}", report.loss));
                bar.inc(1);
            }
            let due = report.step.is_multiple_of(args.log_every)
                || report.step == config.steps
                || report.eval_loss.is_some();
            due.then(|| {
                let mut line = format!(
                    "step {:>5}  loss {:.4}  grad norm {:.3}  {:.0} ms",
                    report.step,
                    report.loss,
                    report.grad_norm,
                    report.elapsed.as_secs_f64() * 1e3
                );
                if let Some(mtp) = report.mtp_loss {
                    line += &format!("  mtp {mtp:.4}");
                }
                if report.aux_loss != 0.0 {
                    line += &format!("  aux {:.4}", report.aux_loss);
                }
                // Scientific, as Megatron prints its losses: the indexer
                // loss carries its coefficient (0.01 in Megatron's DSA
                // test), which leaves nothing to see in four decimals.
                if let Some(indexer) = report.indexer_loss {
                    line += &format!("  indexer {indexer:.3e}");
                }
                if let Some(eval) = report.eval_loss {
                    line += &format!("  eval loss {eval:.4}");
                }
                line
            })
        } else {
            Some(step_json(report, &config.optimizer))
        };
        if let Some(board) = &board {
            let due = report.step.is_multiple_of(args.log_every)
                || report.step == config.steps
                || report.eval_loss.is_some();
            board.step(report, config.optimizer.lr_at(report.step), due);
        }
        if let Some(log) = &mut log {
            let json = if text {
                step_json(report, &config.optimizer)
            } else {
                line.clone().unwrap_or_default()
            };
            if let Err(e) = log.append(&json) {
                output_error.get_or_insert(e);
            }
        }
        if let Some(line) = line {
            let written = match &bar {
                Some(bar) => {
                    bar.println(&line);
                    Ok(())
                }
                None => super::emit(&format!("{line}\n")),
            };
            if let Err(e) = written {
                output_error.get_or_insert(e);
            }
        }
    };
    let result = train_prepared(&prepared, &mut on_step);
    clock.trained = started.elapsed();
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    if let Some(e) = output_error {
        return Err(e.coded("io", json));
    }
    let summary = result.map_err(|e| Failure::Coded {
        code: e.code(),
        message: runtime_message(&e),
        json,
    })?;
    if let Some(board) = board {
        board.finish(&summary).map_err(|e| e.coded("io", json))?;
    }
    let record = summary_json(
        &summary,
        &clock,
        config.precision,
        prepared.recomputed_layers().0,
    );
    if let Some(log) = &mut log {
        log.append(&record.to_string())
            .map_err(|e| e.coded("io", json))?;
    }
    if text {
        super::emit(&summary_text(&summary, &clock, config.precision))
    } else {
        super::emit(&format!("{record}\n"))
    }
}

/// The flag that gives each setting: how the runtime's messages spell the
/// settings for `hybridgen train` ([`SPELLING`]). The few settings without
/// a flag keep their configuration field's name.
const FLAGS: &[(Setting, &str)] = &[
    (Setting::Model, "--preset, --model and --pattern"),
    (Setting::Seed, "--seed"),
    (Setting::Data, "--data"),
    (Setting::MicroBatches, "--micro-batches"),
    (Setting::MicroBatchSize, "--micro-batch-size"),
    (Setting::SeqLength, "--seq-len"),
    (Setting::Optimizer, "--optimizer"),
    (Setting::Lr, "--lr"),
    (Setting::Warmup, "--warmup"),
    (Setting::WeightDecay, "--weight-decay"),
    (Setting::ClipGrad, "--clip-grad"),
    (Setting::LrSchedule, "--lr-decay-style"),
    (Setting::Ranks, "--ranks"),
    (Setting::Ep, "--ep"),
    (Setting::Sharding, "--zero"),
    (Setting::Schedule, "--schedule"),
    (Setting::Precision, "--precision"),
    (Setting::Pattern, "--pattern"),
    (Setting::Pp, "--pp"),
    (Setting::MinLr, "--min-lr"),
    (Setting::LrDecaySteps, "--lr-decay-steps"),
    (Setting::LrWsdDecaySteps, "--lr-wsd-decay-steps"),
    (Setting::DataPath, "--data-path"),
    (Setting::Split, "--split"),
    (Setting::Save, "--save"),
    (Setting::SaveEvery, "--save-every"),
    (Setting::KeepLast, "--keep-last"),
    (Setting::AsyncSave, "--async-save"),
    (Setting::Resume, "--resume"),
    (Setting::InitFrom, "--init-from"),
    (Setting::Trace, "--trace"),
    (Setting::EvalEvery, "--eval-every"),
    (Setting::EvalSteps, "--eval-steps"),
    (Setting::Device, "--device"),
];

/// The runtime's messages for `hybridgen train` name settings by flag.
pub(crate) const SPELLING: SettingSpelling = SettingSpelling::flags(FLAGS);

/// The `TrainArgs` fields (clap's argument ids) that set each setting.
fn arg_ids(setting: Setting) -> &'static [&'static str] {
    match setting {
        Setting::Model => &["preset", "model", "pattern"],
        Setting::Seed => &["seed"],
        Setting::Data => &["data", "data_path", "split"],
        Setting::MicroBatches => &["micro_batches"],
        Setting::MicroBatchSize => &["micro_batch_size"],
        Setting::SeqLength => &["seq_len"],
        Setting::Optimizer => &["optimizer"],
        Setting::Lr => &["lr"],
        Setting::Warmup => &["warmup"],
        Setting::WeightDecay => &["weight_decay"],
        Setting::ClipGrad => &["clip_grad"],
        Setting::LrSchedule => &[
            "lr_decay_style",
            "min_lr",
            "lr_decay_steps",
            "lr_wsd_decay_steps",
            "lr_wsd_decay_style",
        ],
        Setting::Beta1 | Setting::Beta2 | Setting::Eps | Setting::Momentum => &[],
        Setting::Pp => &["pp"],
        Setting::Ranks => &["ranks"],
        Setting::Ep => &["ep"],
        Setting::Sharding => &["zero"],
        Setting::Schedule => &["schedule"],
        Setting::Precision => &["precision"],
        Setting::Pattern => &["pattern"],
        Setting::MinLr => &["min_lr"],
        Setting::LrDecaySteps => &["lr_decay_steps"],
        Setting::LrWsdDecaySteps => &["lr_wsd_decay_steps"],
        Setting::DataPath => &["data_path"],
        Setting::Split => &["split"],
        Setting::Save => &["save"],
        Setting::SaveEvery => &["save_every"],
        Setting::KeepLast => &["keep_last"],
        Setting::AsyncSave => &["async_save"],
        Setting::Resume => &["resume"],
        Setting::InitFrom => &["init_from"],
        Setting::Trace => &["trace"],
        Setting::EvalEvery => &["eval_every"],
        Setting::EvalSteps => &["eval_steps"],
        Setting::Device => &["device"],
    }
}

/// The settings whose flags the user left out: a resume takes those it
/// records from its checkpoint. Without the matches, every flag counts as
/// given.
fn left_out(matches: Option<&ArgMatches>) -> BTreeSet<Setting> {
    let Some(matches) = matches else {
        return BTreeSet::new();
    };
    let given = |id: &&str| matches.value_source(id) == Some(ValueSource::CommandLine);
    Setting::ALL
        .into_iter()
        .filter(|s| !arg_ids(*s).iter().any(given))
        .collect()
}

/// Builds the run's configuration from the flags, and the device it takes,
/// refusing what cannot work before anything starts.
fn config(
    args: &TrainArgs,
    matches: Option<&ArgMatches>,
) -> Result<(TrainConfig, ChosenDevice), Failure> {
    let weights = match &args.init_from {
        Some(dir) => Some(std::sync::Arc::new(
            hybridgen_runtime::hf::HfWeights::open(dir, args.pattern.as_deref())
                .map_err(|e| Failure::Message(format!("--init-from: {e}")))?,
        )),
        None => None,
    };
    let model = match &weights {
        Some(weights) => weights.bound_model().clone(),
        None => super::plan::resolve_model(
            args.pattern.as_deref(),
            args.model.as_ref(),
            Some(&args.preset),
        )?,
    };
    let mut config = TrainConfig::new(model);
    config.spelling = SPELLING;
    config.init_from = weights;
    // The device first: the defaults of --ranks, --ep and --precision
    // depend on it. The run takes the same one (`prepare_on`), so the GPUs
    // are probed once.
    config.device = match args.device {
        DeviceArg::Auto => DeviceChoice::Auto,
        DeviceArg::Cpu => DeviceChoice::Cpu,
        DeviceArg::Cuda => DeviceChoice::Cuda,
    };
    let device = choose_device(config.device, SPELLING).map_err(|e| Failure::Coded {
        code: e.code(),
        message: e.to_string(),
        json: args.format == FormatArg::Json,
    })?;
    let gpu_ranks = device.launched_world().or(device.local_gpus());
    config.ranks = match (args.ranks, gpu_ranks) {
        (Some(ranks), _) => ranks as usize,
        (None, Some(gpus)) => gpus,
        (None, None) => 2,
    };
    config.pp = args.pp.map_or(1, |pp| pp as usize);
    config.ep = match args.ep {
        Some(ep) => ep as usize,
        None if !config.dp().is_multiple_of(2) && (device.is_gpu() || config.pp > 1) => 1,
        None => 2,
    };
    config.micro_batches = args.micro_batches as usize;
    config.micro_batch_size = args.micro_batch_size as usize;
    if let Some(seq) = args.seq_len {
        config.seq_length = seq as usize;
    }
    config.steps = args.steps;
    config.schedule = match args.schedule {
        ScheduleArg::Overlap => ScheduleKind::Overlap,
        ScheduleArg::Plain => ScheduleKind::Plain,
    };
    config.recompute = args.recompute;
    config.attention = match args.attention_backend {
        AttentionBackendArg::Flash => AttentionBackend::Flash,
        AttentionBackendArg::Unfused => AttentionBackend::Unfused,
    };
    config.expert_gemm = match args.expert_gemm {
        ExpertGemmArg::Cublas => ExpertGemm::Cublas,
        ExpertGemmArg::Grouped => ExpertGemm::Grouped,
    };
    config.dependent_launch = args.dependent_launch == Switch::On;
    config.transport = match args.transport {
        TransportArg::Nccl => Transport::Nccl,
        TransportArg::Copy => Transport::Copy,
    };
    config.sharding = if args.zero == "0" {
        Sharding::NoShard
    } else {
        Sharding::Zero3
    };
    config.precision = match args.precision {
        Some(PrecisionArg::F32) => Precision::F32,
        Some(PrecisionArg::Bf16) => Precision::Bf16,
        None if device.is_gpu() => Precision::Bf16,
        None => Precision::F32,
    };
    config.data = match args.data.as_str() {
        _ if !args.data_path.is_empty() => DataChoice::Indexed(
            IndexedSpec::parse(&args.data_path, args.split.clone(), SPELLING)
                .map_err(Failure::Message)?,
        ),
        "synthetic" => DataChoice::Synthetic,
        "" => {
            return Err(Failure::Message(
                "--data is empty: give a file to train on, or `synthetic`".into(),
            ));
        }
        path => DataChoice::File(PathBuf::from(path)),
    };
    if let Some(path) = &args.tokenizer {
        let datasets: Vec<PathBuf> = match &config.data {
            DataChoice::Indexed(spec) => spec.blend.iter().map(|(_, p)| p.clone()).collect(),
            _ => Vec::new(),
        };
        super::data::check_tokenizer_fits(path, config.model.vocab_size, &datasets)
            .map_err(Failure::Message)?;
    }
    config.eval_every = args.eval_every;
    config.eval_steps = args.eval_steps;
    config.seed = args.seed;
    config.optimizer = OptimizerConfig {
        kind: match args.optimizer {
            OptimizerArg::Adam => OptimizerKind::Adam,
            OptimizerArg::Sgd => OptimizerKind::Sgd,
        },
        lr: args.lr,
        warmup_steps: args.warmup,
        schedule: lr_schedule(args),
        weight_decay: args.weight_decay,
        clip_grad: (args.clip_grad > 0.0).then_some(args.clip_grad),
        ..OptimizerConfig::default()
    };
    if let Some(kinds) = &args.units {
        config.unit_filter = UnitFilter::parse_kinds(kinds)
            .map_err(|d| Failure::Message(format!("--units: {}. {}", d.message, d.help)))?;
    }
    config.save = args.save.clone();
    config.save_every = args.save_every;
    config.keep_last = args.keep_last;
    config.async_save = args.async_save;
    config.resume = args.resume.as_ref().map(|dir| {
        if dir.as_os_str() == "auto" {
            ResumeFrom::Auto
        } else {
            ResumeFrom::Dir(dir.clone())
        }
    });
    config.from_checkpoint = left_out(matches);
    config.trace = args.trace.clone();
    config.timeout = Duration::from_secs(args.timeout);
    config.memory_available = memory_override().map_err(Failure::Message)?;
    Ok((config, device))
}

/// The decay flags as a schedule; the decay ends at --steps unless told.
/// Fields the style does not use keep their defaults, so a resume that
/// runs to another --steps does not see a schedule change that is none.
fn lr_schedule(args: &TrainArgs) -> LrSchedule {
    let decay_style = match args.lr_decay_style {
        DecayStyleArg::Constant => LrDecayStyle::Constant,
        DecayStyleArg::Linear => LrDecayStyle::Linear,
        DecayStyleArg::Cosine => LrDecayStyle::Cosine,
        DecayStyleArg::Wsd => LrDecayStyle::Wsd,
    };
    let mut schedule = LrSchedule {
        decay_style,
        min_lr: args.min_lr,
        ..LrSchedule::default()
    };
    if decay_style == LrDecayStyle::Constant {
        return schedule;
    }
    schedule.decay_steps = args.lr_decay_steps.unwrap_or(args.steps);
    if decay_style == LrDecayStyle::Wsd {
        schedule.wsd_decay_steps = args
            .lr_wsd_decay_steps
            .unwrap_or((schedule.decay_steps.saturating_sub(args.warmup) / 10).max(1));
        schedule.wsd_decay_style = match args.lr_wsd_decay_style {
            WsdStyleArg::Linear => WsdDecayStyle::Linear,
            WsdStyleArg::Cosine => WsdDecayStyle::Cosine,
            WsdStyleArg::Exponential => WsdDecayStyle::Exponential,
            WsdStyleArg::MinusSqrt => WsdDecayStyle::MinusSqrt,
        };
    }
    schedule
}

fn runtime_message(error: &RuntimeError) -> String {
    match error {
        RuntimeError::Unsupported(m) => format!("cannot train this configuration:\n{m}"),
        other => other.to_string(),
    }
}

/// A step's JSON line. Shortest round-trip formatting: equal strings mean
/// equal bits. `eval_loss` only on steps that evaluated, `indexer_loss` only
/// for a model that trains a DSA indexer.
fn step_json(report: &StepReport, optimizer: &OptimizerConfig) -> String {
    let lr = optimizer.lr_at(report.step);
    // The f32 rate as people write it (0.0006, not 0.0006000000284984708).
    let lr_json = lr.to_string().parse::<f64>().unwrap_or(f64::from(lr));
    let mut value = json!({
        "step": report.step,
        "loss": report.loss,
        "mtp_loss": report.mtp_loss,
        "aux_loss": report.aux_loss,
        "grad_norm": report.grad_norm,
        "lr": lr_json,
        "step_ms": report.elapsed.as_secs_f64() * 1e3,
    });
    if let Some(indexer) = report.indexer_loss {
        value["indexer_loss"] = json!(indexer);
    }
    if let Some(eval) = report.eval_loss {
        value["eval_loss"] = json!(eval);
    }
    value.to_string()
}

/// Whether this process is rank 0 of its job (every single-process run
/// is): the one that writes the run's TensorBoard curves.
fn first_rank() -> bool {
    use hybridgen_runtime::rendezvous::{EnvVars, Launch};
    match Launch::discover(&EnvVars::from_process()) {
        Ok(Launch::Distributed(info)) => info.rank == 0,
        _ => true,
    }
}

/// What MFU divides: the model's FLOPs a token and one rank's peak FLOP/s,
/// for bf16 runs on GPUs whose dense bf16 peak is known.
fn mfu_basis(prepared: &hybridgen_runtime::train::Prepared) -> Option<(f64, f64)> {
    let config = &prepared.config;
    let ChosenDevice::Cuda { info, .. } = &prepared.device else {
        return None;
    };
    if config.precision != Precision::Bf16 {
        return None;
    }
    let peak = board::bf16_peak(&info.devices.first()?.name)?;
    let flops = hybridgen_dsl::flops::flops_per_token(&config.model, config.seq_length)?;
    Some((flops as f64, peak))
}

/// `--tensorboard-dir`'s event file for this run, with the run's settings
/// written at the step it starts from.
fn open_board(
    dir: &std::path::Path,
    prepared: &hybridgen_runtime::train::Prepared,
    args: &TrainArgs,
) -> Result<board::Board, Failure> {
    let config = &prepared.config;
    let plan = &prepared.plan;
    let board = board::Board::open(
        dir,
        config.tokens_per_step(),
        plan.layers
            .iter()
            .any(|l| l.kind == hybridgen_dsl::LayerKind::Moe),
        plan.mtp_depths(),
        config.ranks,
        mfu_basis(prepared),
    )?;
    let settings = [
        ("pattern", config.model.pattern.clone()),
        (
            "model",
            args.model.as_ref().map_or_else(
                || format!("preset {}", args.preset),
                |p| p.display().to_string(),
            ),
        ),
        ("device", prepared.device.describe()),
        ("ranks", config.ranks.to_string()),
        ("ep", config.ep.to_string()),
        ("pp", config.pp.to_string()),
        ("schedule", format!("{:?}", config.schedule).to_lowercase()),
        (
            "zero",
            if config.sharding == Sharding::Zero3 {
                "3"
            } else {
                "0"
            }
            .to_string(),
        ),
        ("precision", config.precision.to_string()),
        ("micro-batches", config.micro_batches.to_string()),
        ("micro-batch size", config.micro_batch_size.to_string()),
        ("sequence length", config.seq_length.to_string()),
        ("steps", config.steps.to_string()),
        ("lr", config.optimizer.lr_at(1).to_string()),
        ("seed", config.seed.to_string()),
        ("units", config.unit_filter.description().to_string()),
    ];
    board.settings(prepared.resume_step().unwrap_or(0), &settings);
    Ok(board)
}

/// `--log-file`: JSON lines appended, each flushed as it is written, so a
/// run that stops keeps every line before it.
struct LogFile {
    path: PathBuf,
    file: std::fs::File,
}

impl LogFile {
    fn open(path: &std::path::Path) -> Result<Self, Failure> {
        let name = path.display();
        if path.as_os_str().is_empty() {
            return Err(Failure::Message(
                "--log-file is empty: give a file such as run.jsonl".into(),
            ));
        }
        if path.is_dir() {
            return Err(Failure::Message(format!(
                "--log-file {name}: this is a directory; give a file such as {name}/run.jsonl"
            )));
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Failure::Message(format!("--log-file {name}: cannot open it: {e}")))?;
        Ok(LogFile {
            path: path.to_path_buf(),
            file,
        })
    }

    fn append(&mut self, line: &str) -> Result<(), Failure> {
        use std::io::Write;
        // One write per line: concurrent appenders never interleave inside
        // a line.
        self.file
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| {
                Failure::Message(format!(
                    "--log-file {}: cannot write: {e}",
                    self.path.display()
                ))
            })
    }
}

/// Where the command's own time went, from its start: what start-up means
/// to someone waiting for a job (the checks, the platform and device, the
/// parameters, the first step), and what the run's end cost.
struct CommandClock {
    /// The configuration checked and the run prepared (data opened,
    /// memory checked, GPUs probed).
    prepared: Duration,
    /// The first step's report received: start-up, first step included.
    first_step: Option<Duration>,
    /// The run returned: the last step, the final hash, the ranks joined.
    trained: Duration,
}

fn summary_text(s: &TrainSummary, clock: &CommandClock, precision: Precision) -> String {
    let mut out = String::from("\nsummary\n");
    if let (Some(first), Some(last)) = (s.first_loss, s.final_loss) {
        out += &format!("  loss            {first:.4} -> {last:.4}");
        if let Some(floor) = s.entropy_floor {
            out += &format!("  (data entropy floor {floor:.4})");
        }
        out += "\n";
    }
    if let Some(eval) = s.final_eval_loss {
        out += &format!("  eval loss       {eval:.4} (held-out data, at the last evaluation)\n");
    }
    out += &format!("  data            {}\n", s.data);
    out += &format!(
        "  precision       {precision}{}\n",
        match precision {
            Precision::F32 => "",
            Precision::Bf16 => {
                " (parameters and activations; master weights, gradients and optimizer state f32)"
            }
        }
    );
    out += &format!(
        "  throughput      {} tokens/s  ({} tokens in {:.1} s)\n",
        human::count(s.tokens_per_second as u64),
        human::count(s.tokens),
        s.wall.as_secs_f64()
    );
    out += &format!(
        "  step time       {:.0} ms\n",
        s.mean_step_time.as_secs_f64() * 1e3
    );
    if let Some(flops) = s.flops_per_token {
        let (value, unit) = if flops >= 1_000_000_000 {
            (flops as f64 / 1e9, "GFLOP")
        } else {
            (flops as f64 / 1e6, "MFLOP")
        };
        out += &format!(
            "  model FLOPs     {value:.2} {unit} a token, forward and backward (what MFU divides by)\n"
        );
    }
    let t = &s.startup;
    if let Some(first) = clock.first_step {
        out += &format!(
            "  start-up        {:.1} s from the command to the end of the first step \
             (checks {:.1} s)\n",
            first.as_secs_f64(),
            clock.prepared.as_secs_f64()
        );
    }
    out += &format!(
        "  before step 1   {:.1} s: platform {:.1} s, device {:.1} s, parameters {:.1} s \
         ({:.1} s drawing them), optimizer {:.1} s{}\n",
        t.total().as_secs_f64(),
        t.platform.as_secs_f64(),
        t.device.as_secs_f64(),
        t.params.as_secs_f64(),
        t.params_drawn.as_secs_f64(),
        t.optimizer.as_secs_f64(),
        if t.resume.is_zero() {
            String::new()
        } else {
            format!(", resume {:.1} s", t.resume.as_secs_f64())
        }
    );
    if s.reserved_bytes > 0 {
        out += &format!(
            "  device memory   {} at most in use, {} held (the first rank's arenas; the \
             device's context and libraries come on top)\n",
            human::bytes(s.peak_allocated_bytes),
            human::bytes(s.reserved_bytes)
        );
    }
    out += &format!(
        "  comm lane       {:.2} s busy over all ranks, {:.2} s hidden under compute ({})\n",
        s.comm_busy.as_secs_f64(),
        s.comm_hidden.as_secs_f64(),
        s.hidden_fraction()
            .map_or("no communication".to_string(), |f| format!(
                "{:.0}% hidden",
                f * 100.0
            ))
    );
    if let Some(ideal) = s.ideal_bubble {
        let stages: Vec<String> = s
            .stage_waits
            .iter()
            .enumerate()
            .map(|(r, w)| format!("{r}: {:.0}%", w * 100.0))
            .collect();
        out += &format!(
            "  pipeline        stages waited {} of the run (1F1B's bubble: {:.0}%)\n",
            stages.join(", "),
            ideal * 100.0
        );
    }
    out += &format!(
        "  parameters      hash {:016x} ({:.1} s)\n",
        s.param_hash,
        s.hash_time.as_secs_f64()
    );
    if let (Some(step), Some(dir)) = (s.resumed_from, &s.resumed_dir) {
        out += &format!(
            "  resumed         from {} (step {step}), now at step {}\n",
            dir.display(),
            s.last_step
        );
    }
    if let Some(dir) = &s.saved_to {
        out += &format!(
            "  checkpoint      {} (the steps waited {:.1} s on saves{})\n",
            dir.display(),
            s.save_time.as_secs_f64(),
            match s.saves_behind {
                0 => String::new(),
                n => format!("; {n} written behind them"),
            }
        );
    }
    if let Some(path) = &s.trace {
        out += &format!(
            "  trace           {} (open in https://ui.perfetto.dev)\n",
            path.display()
        );
    }
    out
}

fn summary_json(
    s: &TrainSummary,
    clock: &CommandClock,
    precision: Precision,
    recomputed_layers: usize,
) -> serde_json::Value {
    json!({
        "summary": {
            "steps": s.steps,
            "last_step": s.last_step,
            "final_loss": s.final_loss,
            "final_eval_loss": s.final_eval_loss,
            "entropy_floor": s.entropy_floor,
            "precision": precision.to_string(),
            "recomputed_layers": recomputed_layers,
            "tokens": s.tokens,
            "wall_s": s.wall.as_secs_f64(),
            "tokens_per_s": s.tokens_per_second,
            "step_ms": s.mean_step_time.as_secs_f64() * 1e3,
            "comm_busy_s": s.comm_busy.as_secs_f64(),
            "comm_hidden_s": s.comm_hidden.as_secs_f64(),
            "hidden_fraction": s.hidden_fraction(),
            "stage_waits": s.stage_waits,
            "ideal_bubble": s.ideal_bubble,
            "param_hash": format!("{:016x}", s.param_hash),
            "resumed_from": s.resumed_from,
            "resumed_dir": s.resumed_dir.as_ref().map(|p| p.display().to_string()),
            "checkpoint": s.saved_to.as_ref().map(|p| p.display().to_string()),
            "trace": s.trace.as_ref().map(|p| p.display().to_string()),
            "flops_per_token": s.flops_per_token,
            "peak_allocated_bytes": s.peak_allocated_bytes,
            "reserved_bytes": s.reserved_bytes,
            "hash_s": s.hash_time.as_secs_f64(),
            "save_s": s.save_time.as_secs_f64(),
            "saves_behind": s.saves_behind,
            // Seconds from the command's start at which each point came.
            "clock_s": {
                "prepared": clock.prepared.as_secs_f64(),
                "first_step": clock.first_step.map(|d| d.as_secs_f64()),
                "trained": clock.trained.as_secs_f64(),
            },
            "startup_s": {
                "platform": s.startup.platform.as_secs_f64(),
                "device": s.startup.device.as_secs_f64(),
                "params": s.startup.params.as_secs_f64(),
                "params_drawn": s.startup.params_drawn.as_secs_f64(),
                "optimizer": s.startup.optimizer.as_secs_f64(),
                "resume": s.startup.resume.as_secs_f64(),
            },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_internal_failure_before_the_run_is_not_the_configurations() {
        let internal = RuntimeError::Internal("a schedule out of order".into());
        assert_eq!(prepare_code(&internal), "internal");
        assert!(runtime_message(&internal).contains("a bug in hybridgen"));
        let refused = RuntimeError::Unsupported("`G` layers do not train".into());
        assert_eq!(prepare_code(&refused), "invalid_config");
    }
}

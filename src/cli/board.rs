//! `train --tensorboard-dir`: a run's curves as TensorBoard event files,
//! under the tags Megatron-LM writes where it has one, so dashboards built
//! for Megatron runs show hybridgen's too.
//!
//! | tag | value |
//! | --- | --- |
//! | `lm loss` | the step's main loss |
//! | `learning-rate` | the step's rate (the optimizer's f32) |
//! | `grad-norm` | the global gradient norm before clipping |
//! | `load_balancing_loss` | the MoE auxiliary loss (models with `E`) |
//! | `indexer loss` | the DSA indexer loss (models with `D` and a nonzero `dsa.indexer_loss_coeff`) |
//! | `mtp_1 loss` | the MTP loss (one depth; `mtp loss`, the mean over depths, with several) |
//! | `lm loss validation` | the evaluation loss, on steps that evaluate |
//! | `iteration-time` | the step's seconds |
//! | `tokens-per-second` | the step's tokens over its time, every rank's |
//! | `mfu` | model FLOPs a second a rank over the GPU's dense bf16 peak (bf16 runs on GPUs whose peak is known) |
//! | `mem-max-allocated-bytes` | the most device memory alive at once so far (rank 0) |
//! | `comm-hidden-fraction` | at the last step: the share of the comm lane's time hidden under compute |
//! | `throughput` | at the last step: model TFLOP/s a rank, over the run |
//!
//! and the run's settings once, as a text summary (`settings`). Only the
//! process of rank 0 writes; each run writes a file of its own, so a
//! resumed run's steps continue the curves of the run it resumes.

use super::Failure;
use crate::tensorboard::EventWriter;
use hybridgen_runtime::train::{StepReport, TrainSummary};
use std::path::Path;

/// The event file of one run, and what its tags need to know of the run.
pub(crate) struct Board {
    writer: EventWriter,
    tokens_per_step: u64,
    moe: bool,
    mtp_depths: usize,
    ranks: usize,
    /// Model FLOPs a token, and the peak FLOP/s of one rank's device, when
    /// both are known: what `mfu` divides.
    mfu: Option<(f64, f64)>,
}

/// Dense bf16 peak FLOP/s of the GPUs whose figure NVIDIA publishes, by
/// the name the driver reports.
pub(crate) fn bf16_peak(gpu_name: &str) -> Option<f64> {
    let name = gpu_name.to_ascii_uppercase();
    if name.contains("H100") || name.contains("H200") || name.contains("GH200") {
        Some(989.4e12)
    } else if name.contains("A100") {
        Some(312e12)
    } else {
        None
    }
}

impl Board {
    /// Opens a new event file in `dir`: refused, naming the flag, when the
    /// directory cannot be made or written.
    pub(crate) fn open(
        dir: &Path,
        tokens_per_step: u64,
        moe: bool,
        mtp_depths: usize,
        ranks: usize,
        mfu: Option<(f64, f64)>,
    ) -> Result<Board, Failure> {
        let writer = EventWriter::create(dir).map_err(|e| {
            Failure::Message(format!(
                "--tensorboard-dir {}: cannot write an event file there: {e}",
                dir.display()
            ))
        })?;
        Ok(Board {
            writer,
            tokens_per_step,
            moe,
            mtp_depths,
            ranks,
            mfu,
        })
    }

    /// The run's settings as a Markdown table, at `step` (the step the run
    /// starts from).
    pub(crate) fn settings(&self, step: u64, settings: &[(&str, String)]) {
        let mut text = String::from("| setting | value |\n| --- | --- |\n");
        for (name, value) in settings {
            text += &format!("| {name} | `{}` |\n", value.replace('|', "\\|"));
        }
        self.writer.text(step, "settings", &text);
        self.writer.flush();
    }

    /// One step's scalars; `flush` on the steps the run logs, so a
    /// TensorBoard watching the directory shows them then.
    pub(crate) fn step(&self, report: &StepReport, lr: f32, flush: bool) {
        let seconds = report.elapsed.as_secs_f64();
        let mut scalars = vec![
            ("lm loss", report.loss as f32),
            ("learning-rate", lr),
            ("grad-norm", report.grad_norm as f32),
            ("iteration-time", seconds as f32),
            (
                "mem-max-allocated-bytes",
                report.device.peak_in_use_bytes as f32,
            ),
        ];
        if seconds > 0.0 {
            let tokens_per_second = self.tokens_per_step as f64 / seconds;
            scalars.push(("tokens-per-second", tokens_per_second as f32));
            if let Some((flops_per_token, peak)) = self.mfu {
                let per_rank = flops_per_token * tokens_per_second / self.ranks as f64;
                scalars.push(("mfu", (per_rank / peak) as f32));
            }
        }
        if self.moe {
            scalars.push(("load_balancing_loss", report.aux_loss as f32));
        }
        if let Some(indexer) = report.indexer_loss {
            scalars.push(("indexer loss", indexer as f32));
        }
        if let Some(mtp) = report.mtp_loss {
            let tag = if self.mtp_depths == 1 {
                "mtp_1 loss"
            } else {
                "mtp loss"
            };
            scalars.push((tag, mtp as f32));
        }
        if let Some(eval) = report.eval_loss {
            scalars.push(("lm loss validation", eval as f32));
        }
        self.writer.scalars(report.step, &scalars);
        if flush {
            self.writer.flush();
        }
    }

    /// The run's closing figures at its last step, then the file closed.
    pub(crate) fn finish(self, summary: &TrainSummary) -> Result<(), Failure> {
        let mut scalars = Vec::new();
        if let Some(hidden) = summary.hidden_fraction() {
            scalars.push(("comm-hidden-fraction", hidden as f32));
        }
        if let Some(flops) = summary.flops_per_token {
            let per_rank = flops as f64 * summary.tokens_per_second / self.ranks as f64;
            scalars.push(("throughput", (per_rank / 1e12) as f32));
        }
        // The measured pipeline bubble per stage, beside 1F1B's.
        let stages: Vec<String> = (0..summary.stage_waits.len())
            .map(|s| format!("pipeline-bubble/stage-{s}"))
            .collect();
        for (tag, wait) in stages.iter().zip(&summary.stage_waits) {
            scalars.push((tag.as_str(), *wait as f32));
        }
        if let Some(ideal) = summary.ideal_bubble {
            scalars.push(("pipeline-bubble/1f1b", ideal as f32));
        }
        if !scalars.is_empty() {
            self.writer.scalars(summary.last_step, &scalars);
        }
        let path = self.writer.path().to_path_buf();
        self.writer.close().map_err(|e| {
            Failure::Message(format!(
                "--tensorboard-dir: cannot write {}: {e}",
                path.display()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_and_ampere_peaks_are_known_by_name() {
        assert_eq!(bf16_peak("NVIDIA H100 80GB HBM3"), Some(989.4e12));
        assert_eq!(bf16_peak("NVIDIA H200"), Some(989.4e12));
        assert_eq!(bf16_peak("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(bf16_peak("NVIDIA GeForce RTX 4090"), None);
    }
}

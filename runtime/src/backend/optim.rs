//! Optimizer steps over a bucket's f32 shard, and the gradient norm's
//! partial sums.

/// Adam's two moment buffers of one shard (f32, the shard's length).
#[derive(Debug)]
pub struct AdamMoments<M> {
    pub m: M,
    pub v: M,
}

/// Hyper-parameters of one AdamW step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Applied to the decayed ranges only.
    pub weight_decay: f32,
    /// Multiplies every gradient first: the clipping factor, or 1.
    pub grad_scale: f32,
    /// 1-based step count, for the bias corrections.
    pub step: u64,
}

/// Hyper-parameters of one SGD step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    pub lr: f32,
    pub momentum: f32,
    /// Applied to the decayed ranges only.
    pub weight_decay: f32,
    /// Multiplies every gradient first: the clipping factor, or 1.
    pub grad_scale: f32,
}

//! The causal depthwise conv1d of Mamba layers.

use super::Tokens;

/// Dimensions of the conv1d kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub tokens: Tokens,
    pub channels: usize,
    pub kernel: usize,
}

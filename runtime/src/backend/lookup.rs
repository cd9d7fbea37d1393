//! Embedding lookups and the softmax cross-entropy loss.

/// Dimensions of the embedding kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LookupDims {
    pub vocab: usize,
    pub hidden: usize,
}

/// A target that contributes no loss (positions past the end for MTP).
pub const IGNORE_TARGET: u32 = u32::MAX;

/// Dimensions of the cross-entropy kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LossDims {
    pub rows: usize,
    pub vocab: usize,
}

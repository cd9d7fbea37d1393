//! The Mamba-2 selective (SSD) scan.

use super::Tokens;

/// Dimensions of the SSD scan kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScanDims {
    pub tokens: Tokens,
    /// H.
    pub heads: usize,
    /// P.
    pub head_dim: usize,
    /// G; divides `heads`.
    pub groups: usize,
    /// N.
    pub state: usize,
    /// Steps between saved states.
    pub chunk: usize,
}

impl ScanDims {
    /// Row width of `xbc`: `H*P + 2*G*N`.
    pub const fn xbc_width(&self) -> usize {
        self.heads * self.head_dim + 2 * self.groups * self.state
    }

    /// Elements of the saved chunk-start states.
    pub const fn states_len(&self) -> usize {
        self.tokens.batch
            * self.tokens.seq.div_ceil(self.chunk)
            * self.heads
            * self.head_dim
            * self.state
    }
}

/// The read-only inputs of the SSD scan.
#[derive(Clone, Copy, Debug)]
pub struct ScanInputs<S> {
    /// `[rows, H*P + 2*G*N]`: `x | B | C`.
    pub xbc: S,
    /// `[rows, H]`, before softplus and bias.
    pub dt: S,
    pub dt_bias: S,
    pub a_log: S,
    /// The skip `D`, `[H]`.
    pub d: S,
}

/// The gradients the SSD scan backward writes.
#[derive(Debug)]
pub struct ScanGrads<M> {
    pub xbc: M,
    pub dt: M,
    pub a_log: M,
    pub d: M,
}

//! Normalisation and activations: RMSNorm (plain and grouped) with its
//! input- and weight-gradient halves, and the element-wise activations.

/// Dimensions of the RMSNorm kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormDims {
    pub rows: usize,
    pub dim: usize,
    /// Groups normalised separately; must divide `dim`.
    pub groups: usize,
    pub eps: f32,
}

impl NormDims {
    /// Rows a slice of the weight gradient's partial sums aims at; with at
    /// most [`NormDims::MAX_WEIGHT_SLICES`] slices, a GPU gives each slice a
    /// block (enough blocks to keep every SM reading) and adds the slices'
    /// sums in one small pass.
    const WEIGHT_SLICE_ROWS: usize = 16;
    const MAX_WEIGHT_SLICES: usize = 256;

    /// Slices of rows the weight gradient's partial sums are taken over
    /// (one rule for every backend: a function of the rows alone, so the
    /// sums' order is too).
    pub fn weight_slices(&self) -> usize {
        self.rows
            .div_ceil(Self::WEIGHT_SLICE_ROWS)
            .clamp(1, Self::MAX_WEIGHT_SLICES)
    }

    /// Rows in each slice: slice `s` holds rows `[s * n, (s + 1) * n)` that
    /// exist (the last ones may hold fewer, or none).
    pub fn weight_slice_rows(&self) -> usize {
        self.rows.div_ceil(self.weight_slices())
    }

    /// f32 elements of the partial sums: `dim` a slice.
    pub fn weight_partials_len(&self) -> usize {
        self.weight_slices().saturating_mul(self.dim)
    }
}

/// Element-wise functions of [`Backend::unary_forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    /// `x * sigmoid(x)`.
    Silu,
    /// `x * Phi(x)`, the exact (erf) GELU, as PyTorch's default.
    Gelu,
    /// `relu(x)^2` (Nemotron-H).
    SquaredRelu,
}

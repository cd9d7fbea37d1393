//! Dense algebra: matrix products (one, or many as one grouped call) and
//! the element-wise sums and scalings built on them.

use super::{Slice, SliceMut};

/// Dimensions of [`Backend::matmul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_trans: bool,
    pub b_trans: bool,
    pub accumulate: bool,
}

impl MatmulDims {
    /// `y[rows, out] = x[rows, in] W^T` with `W` `[out, in]`.
    pub const fn linear(rows: usize, in_features: usize, out_features: usize) -> Self {
        MatmulDims {
            m: rows,
            n: out_features,
            k: in_features,
            a_trans: false,
            b_trans: true,
            accumulate: false,
        }
    }

    /// `dx[rows, in] (+)= dy[rows, out] W`.
    pub const fn linear_input_grad(
        rows: usize,
        in_features: usize,
        out_features: usize,
        accumulate: bool,
    ) -> Self {
        MatmulDims {
            m: rows,
            n: in_features,
            k: out_features,
            a_trans: false,
            b_trans: false,
            accumulate,
        }
    }

    /// `dW[out, in] += dy[rows, out]^T x[rows, in]`.
    pub const fn linear_weight_grad(rows: usize, in_features: usize, out_features: usize) -> Self {
        MatmulDims {
            m: out_features,
            n: in_features,
            k: rows,
            a_trans: true,
            b_trans: false,
            accumulate: true,
        }
    }
}

/// How a GPU backend runs the MoE experts' GEMMs
/// ([`Backend::grouped_matmul`]'s bf16 problems). The CPU backend has one
/// path.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ExpertGemm {
    /// One cuBLAS GEMM a problem, dealt over three streams.
    Cublas,
    /// One launch of `grouped_gemm.cu` for every problem of a layout, on
    /// Hopper (TMA and `wgmma`; the faster on an H200: README, "How it is
    /// built"); elsewhere, and for problems it does not take, cuBLAS. The
    /// same bits as cuBLAS on the benchmark model.
    #[default]
    Grouped,
}

/// One problem of [`Backend::grouped_matmul`]: `c (+)= op(a) op(b)` as
/// [`Backend::matmul`] with `dims`.
#[derive(Debug)]
pub struct MatmulProblem<S, M> {
    pub a: S,
    pub b: S,
    pub c: M,
    pub dims: MatmulDims,
}

/// A [`MatmulProblem`] on `B`'s views.
pub type GroupedMatmul<'a, B> = MatmulProblem<Slice<'a, B>, SliceMut<'a, B>>;

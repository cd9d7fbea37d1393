//! The gated delta rule of `G` layers (Megatron-LM's `GatedDeltaNet`, the
//! recurrence of flash-linear-attention's `chunk_gated_delta_rule`),
//! forward and backward, with the L2 norm of the queries and keys and the
//! gates `beta` and `g` computed inside the kernel from the projection's
//! raw outputs.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `delta_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`DeltaKernels`] method on each backend (`cpu::ops::delta`,
//! `cuda::ops::delta`).

#[cfg(doc)]
use super::Backend;
use super::Tokens;
use crate::error::{Result, RuntimeError};
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, ensure, product};

/// The epsilon of the L2 norm of queries and keys: `x / sqrt(sum x^2 +
/// eps)`, flash-linear-attention's `l2norm` default, which Megatron's
/// `GatedDeltaNet` calls without an epsilon of its own.
pub const DELTA_L2_EPS: f32 = 1e-6;

/// Dimensions of the gated delta rule kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeltaDims {
    pub tokens: Tokens,
    /// Hk: query and key heads.
    pub key_heads: usize,
    /// Hv: value heads, a multiple of `key_heads`; value head `j` reads key
    /// head `j / (Hv/Hk)` (Megatron's `repeat_interleave` of q and k).
    pub value_heads: usize,
    /// dk.
    pub key_dim: usize,
    /// dv'.
    pub value_dim: usize,
    /// Steps between saved states.
    pub chunk: usize,
}

impl DeltaDims {
    /// Row width of `qkv`: `2*Hk*dk + Hv*dv'` (`q | k | v`).
    pub const fn qkv_width(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Row width of the output: `Hv*dv'`.
    pub const fn out_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// Elements of the saved chunk-start states, `[batch, chunks, Hv, dv', dk]`.
    pub const fn states_len(&self) -> usize {
        self.tokens.batch
            * self.tokens.seq.div_ceil(self.chunk)
            * self.value_heads
            * self.value_dim
            * self.key_dim
    }

    /// The query scale `1/sqrt(dk)` (flash-linear-attention's default,
    /// which Megatron leaves in place).
    pub fn scale(&self) -> f32 {
        (1.0 / (self.key_dim as f64).sqrt()) as f32
    }
}

/// The read-only inputs of the gated delta rule.
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<S> {
    /// `[rows, 2*Hk*dk + Hv*dv']`: `q | k | v` after the conv and SiLU,
    /// before the L2 norm.
    pub qkv: S,
    /// `[rows, Hv]`: the projection's `beta` block, before the sigmoid.
    pub beta: S,
    /// `[rows, Hv]`: the projection's `alpha` block, before `dt_bias`.
    pub alpha: S,
    /// `[Hv]`.
    pub dt_bias: S,
    /// `[Hv]`.
    pub a_log: S,
}

/// The gradients the gated delta rule backward writes.
#[derive(Debug)]
pub struct DeltaGrads<M> {
    pub qkv: M,
    pub beta: M,
    pub alpha: M,
    pub a_log: M,
}

/// The gated delta rule kernels as a backend implements them: each runs
/// once [`Backend`]'s method of the same name (without `_unchecked`) has
/// checked its arguments here, so their dtypes and lengths are right.
pub trait DeltaKernels<Buf: DeviceBuffer> {
    fn gated_delta_forward_unchecked(
        &self,
        inputs: DeltaInputs<View<'_, Buf>>,
        out: ViewMut<'_, Buf>,
        states: ViewMut<'_, Buf>,
        dims: DeltaDims,
    ) -> Result<()>;

    fn gated_delta_backward_unchecked(
        &self,
        inputs: DeltaInputs<View<'_, Buf>>,
        states: View<'_, Buf>,
        d_out: View<'_, Buf>,
        grads: DeltaGrads<ViewMut<'_, Buf>>,
        dims: DeltaDims,
    ) -> Result<()>;
}

impl<T: DeviceBuffer> DeltaInputs<View<'_, T>> {
    /// The inputs' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> DeltaInputs<Operand> {
        DeltaInputs {
            qkv: self.qkv.operand(),
            beta: self.beta.operand(),
            alpha: self.alpha.operand(),
            dt_bias: self.dt_bias.operand(),
            a_log: self.a_log.operand(),
        }
    }
}

impl<T: DeviceBuffer> DeltaGrads<ViewMut<'_, T>> {
    /// The gradients' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> DeltaGrads<Operand> {
        DeltaGrads {
            qkv: self.qkv.operand(),
            beta: self.beta.operand(),
            alpha: self.alpha.operand(),
            a_log: self.a_log.operand(),
        }
    }
}

/// What a gated delta rule's checks derive from its dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// `batch * seq`.
    pub rows: usize,
    /// Chunks of a sequence, the last one possibly short.
    pub chunks: usize,
}

/// The inputs every gated delta rule kernel reads: bf16 or f32, each as
/// long as `dims` says, with value heads a multiple of the key heads, head
/// dims of at least one and a chunk of at least one step.
fn check_inputs(
    kernel: &str,
    inputs: &DeltaInputs<Operand>,
    dims: DeltaDims,
) -> Result<DeltaShape> {
    let named = [
        ("qkv", inputs.qkv),
        ("beta", inputs.beta),
        ("alpha", inputs.alpha),
        ("dt_bias", inputs.dt_bias),
        ("a_log", inputs.a_log),
    ];
    for (name, view) in named {
        view.float(kernel, name)?;
    }
    let rows = dims.tokens.rows()?;
    ensure(
        dims.key_heads > 0
            && dims.value_heads > 0
            && dims.value_heads.is_multiple_of(dims.key_heads),
        || {
            format!(
                "{kernel}: {} value heads are not a multiple of {} key heads",
                dims.value_heads, dims.key_heads
            )
        },
    )?;
    ensure(dims.key_dim > 0 && dims.value_dim > 0, || {
        format!(
            "{kernel}: head dims must be at least 1 (key {}, value {})",
            dims.key_dim, dims.value_dim
        )
    })?;
    ensure(dims.chunk > 0, || {
        format!("{kernel}: the chunk length is 0")
    })?;
    let chunks = dims.tokens.seq.div_ceil(dims.chunk);
    let width = product(kernel, &[2, dims.key_heads, dims.key_dim])?
        .checked_add(product(kernel, &[dims.value_heads, dims.value_dim])?)
        .ok_or_else(|| RuntimeError::InvalidArgument(format!("{kernel}: width overflows")))?;
    inputs
        .qkv
        .has_len(kernel, "qkv", product(kernel, &[rows, width])?)?;
    let per_head = product(kernel, &[rows, dims.value_heads])?;
    inputs.beta.has_len(kernel, "beta", per_head)?;
    inputs.alpha.has_len(kernel, "alpha", per_head)?;
    inputs
        .dt_bias
        .has_len(kernel, "dt_bias", dims.value_heads)?;
    inputs.a_log.has_len(kernel, "a_log", dims.value_heads)?;
    product(
        kernel,
        &[
            dims.tokens.batch,
            chunks,
            dims.value_heads,
            dims.value_dim,
            dims.key_dim,
        ],
    )?;
    Ok(DeltaShape { rows, chunks })
}

/// [`Backend::gated_delta_forward`]'s arguments.
pub fn check_gated_delta_forward(
    inputs: DeltaInputs<Operand>,
    out: Operand,
    states: Operand,
    dims: DeltaDims,
) -> Result<DeltaShape> {
    let k = "gated_delta_forward";
    let shape = check_inputs(k, &inputs, dims)?;
    states.exactly(DType::F32, k, "states")?;
    out.float(k, "out")?;
    out.has_len(k, "out", shape.rows * dims.out_width())?;
    states.has_len(k, "states", dims.states_len())?;
    Ok(shape)
}

/// [`Backend::gated_delta_backward`]'s arguments.
pub fn check_gated_delta_backward(
    inputs: DeltaInputs<Operand>,
    states: Operand,
    d_out: Operand,
    grads: DeltaGrads<Operand>,
    dims: DeltaDims,
) -> Result<DeltaShape> {
    let k = "gated_delta_backward";
    let shape = check_inputs(k, &inputs, dims)?;
    states.exactly(DType::F32, k, "states")?;
    d_out.float(k, "d_out")?;
    let named = [
        ("d_qkv", grads.qkv),
        ("d_beta", grads.beta),
        ("d_alpha", grads.alpha),
        ("d_a_log", grads.a_log),
    ];
    for (name, view) in named {
        view.float(k, name)?;
    }
    states.has_len(k, "states", dims.states_len())?;
    d_out.has_len(k, "d_out", shape.rows * dims.out_width())?;
    grads.qkv.has_len(k, "grads.qkv", inputs.qkv.len)?;
    grads.beta.has_len(k, "grads.beta", inputs.beta.len)?;
    grads.alpha.has_len(k, "grads.alpha", inputs.alpha.len)?;
    grads.a_log.has_len(k, "grads.a_log", dims.value_heads)?;
    Ok(shape)
}

/// [`Backend`]'s gated delta rule methods: each checks its arguments, then
/// runs its [`DeltaKernels`] method.
macro_rules! delta_methods {
    () => {
        /// The gated delta rule (layers.md `G` steps 3-5), per sequence and
        /// value head `j` (key head `i = j / (Hv/Hk)`), state `S` `[dv', dk]`
        /// from zero. Per step, in f32:
        /// `q = scale * q_i / sqrt(|q_i|^2 + eps)` and
        /// `k = k_i / sqrt(|k_i|^2 + eps)` (`scale = 1/sqrt(dk)`,
        /// `eps = DELTA_L2_EPS`), `beta = sigmoid(beta_raw[t, j])`,
        /// `g = -exp(A_log[j]) * softplus(alpha[t, j] + dt_bias[j])`;
        /// `S = exp(g) S`, `u = beta (v_j - S k)`, `S = S + u k^T`,
        /// `out_j = S q`: that is
        /// `S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`.
        /// `qkv` is `[rows, 2*Hk*dk + Hv*dv']` holding `q | k | v` per row
        /// (the conv output after SiLU), `beta` and `alpha` `[rows, Hv]`
        /// raw, `out` `[rows, Hv*dv']`. `states` receives the state at the
        /// start of every chunk of `dims.chunk` steps,
        /// `[batch, ceil(seq/chunk), Hv, dv', dk]`, so backward can
        /// recompute inside a chunk instead of keeping every step's state.
        fn gated_delta_forward(
            &self,
            inputs: DeltaInputs<Slice<'_, Self>>,
            out: SliceMut<'_, Self>,
            states: SliceMut<'_, Self>,
            dims: DeltaDims,
        ) -> Result<()> {
            $crate::backend::delta::check_gated_delta_forward(
                inputs.operands(),
                out.operand(),
                states.operand(),
                dims,
            )?;
            self.gated_delta_forward_unchecked(inputs, out, states, dims)
        }

        /// Backward of [`Backend::gated_delta_forward`] given `d_out`:
        /// overwrites `grads.qkv` (all of `q | k | v`, before the L2 norm),
        /// `grads.beta` and `grads.alpha` (w.r.t. the raw blocks), and
        /// accumulates `grads.a_log` (`[Hv]`). The `dt_bias` gradient is the
        /// column sum of `grads.alpha`.
        fn gated_delta_backward(
            &self,
            inputs: DeltaInputs<Slice<'_, Self>>,
            states: Slice<'_, Self>,
            d_out: Slice<'_, Self>,
            grads: DeltaGrads<SliceMut<'_, Self>>,
            dims: DeltaDims,
        ) -> Result<()> {
            $crate::backend::delta::check_gated_delta_backward(
                inputs.operands(),
                states.operand(),
                d_out.operand(),
                grads.operands(),
                dims,
            )?;
            self.gated_delta_backward_unchecked(inputs, states, d_out, grads, dims)
        }
    };
}
pub(super) use delta_methods;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    #[test]
    fn bad_shapes_are_errors() {
        let dims = DeltaDims {
            tokens: Tokens::new(2, 5),
            key_heads: 2,
            value_heads: 4,
            key_dim: 3,
            value_dim: 2,
            chunk: 2,
        };
        let f32s = |len| Operand::new(len, DType::F32);
        let inputs = DeltaInputs {
            qkv: f32s(10 * dims.qkv_width()),
            beta: f32s(10 * 4),
            alpha: f32s(10 * 4),
            dt_bias: f32s(4),
            a_log: f32s(4),
        };
        let states = f32s(dims.states_len());
        let out = f32s(10 * dims.out_width());
        let shape = check_gated_delta_forward(inputs, out, states, dims).unwrap();
        assert_eq!(
            shape,
            DeltaShape {
                rows: 10,
                chunks: 3
            }
        );
        let odd_heads = DeltaDims {
            value_heads: 3,
            ..dims
        };
        assert!(check_gated_delta_forward(inputs, out, states, odd_heads).is_err());
        let no_chunk = DeltaDims { chunk: 0, ..dims };
        assert!(check_gated_delta_forward(inputs, out, states, no_chunk).is_err());
        let no_key = DeltaDims { key_dim: 0, ..dims };
        assert!(check_gated_delta_forward(inputs, out, states, no_key).is_err());
        assert!(check_gated_delta_forward(inputs, out, f32s(1000), dims).is_err());
        assert!(check_gated_delta_forward(inputs, f32s(79), states, dims).is_err());
        let bf16_states = Operand::new(dims.states_len(), DType::Bf16);
        assert!(check_gated_delta_forward(inputs, out, bf16_states, dims).is_err());
    }
}

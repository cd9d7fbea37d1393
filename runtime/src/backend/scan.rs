//! The Mamba-2 selective (SSD) scan, forward and backward.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `scan_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`ScanKernels`] method on each backend (`cpu::ops::scan`,
//! `cuda::ops::scan`).

#[cfg(doc)]
use super::Backend;
use super::Tokens;
use crate::error::{Result, RuntimeError};
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, ensure, product};

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

/// The scan kernels as a backend implements them: each runs once
/// [`Backend`]'s method of the same name (without `_unchecked`) has checked
/// its arguments here, so their dtypes and lengths are right.
pub trait ScanKernels<Buf: DeviceBuffer> {
    fn ssd_scan_forward_unchecked(
        &self,
        inputs: ScanInputs<View<'_, Buf>>,
        y: ViewMut<'_, Buf>,
        states: ViewMut<'_, Buf>,
        dims: ScanDims,
    ) -> Result<()>;

    fn ssd_scan_backward_unchecked(
        &self,
        inputs: ScanInputs<View<'_, Buf>>,
        states: View<'_, Buf>,
        dy: View<'_, Buf>,
        grads: ScanGrads<ViewMut<'_, Buf>>,
        dims: ScanDims,
    ) -> Result<()>;
}

impl<T: DeviceBuffer> ScanInputs<View<'_, T>> {
    /// The inputs' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> ScanInputs<Operand> {
        ScanInputs {
            xbc: self.xbc.operand(),
            dt: self.dt.operand(),
            dt_bias: self.dt_bias.operand(),
            a_log: self.a_log.operand(),
            d: self.d.operand(),
        }
    }
}

impl<T: DeviceBuffer> ScanGrads<ViewMut<'_, T>> {
    /// The gradients' lengths and dtypes, as the checks take them.
    pub fn operands(&self) -> ScanGrads<Operand> {
        ScanGrads {
            xbc: self.xbc.operand(),
            dt: self.dt.operand(),
            a_log: self.a_log.operand(),
            d: self.d.operand(),
        }
    }
}

/// What a scan's checks derive from its dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanShape {
    /// `batch * seq`.
    pub rows: usize,
    /// Chunks of a sequence, the last one possibly short.
    pub chunks: usize,
}

/// The inputs every scan kernel reads: bf16 or f32, each as long as `dims`
/// says, with groups that divide the heads and a chunk of at least one step.
fn check_inputs(kernel: &str, inputs: &ScanInputs<Operand>, dims: ScanDims) -> Result<ScanShape> {
    let named = [
        ("xbc", inputs.xbc),
        ("dt", inputs.dt),
        ("dt_bias", inputs.dt_bias),
        ("a_log", inputs.a_log),
        ("d", inputs.d),
    ];
    for (name, view) in named {
        view.float(kernel, name)?;
    }
    let rows = dims.tokens.rows()?;
    ensure(
        dims.heads > 0 && dims.groups > 0 && dims.heads.is_multiple_of(dims.groups),
        || {
            format!(
                "{kernel}: {} groups do not divide {} heads",
                dims.groups, dims.heads
            )
        },
    )?;
    let chunks = chunks(kernel, dims)?;
    let width = product(kernel, &[dims.heads, dims.head_dim])?
        .checked_add(product(kernel, &[2, dims.groups, dims.state])?)
        .ok_or_else(|| RuntimeError::InvalidArgument(format!("{kernel}: width overflows")))?;
    inputs
        .xbc
        .has_len(kernel, "xbc", product(kernel, &[rows, width])?)?;
    inputs
        .dt
        .has_len(kernel, "dt", product(kernel, &[rows, dims.heads])?)?;
    inputs.dt_bias.has_len(kernel, "dt_bias", dims.heads)?;
    inputs.a_log.has_len(kernel, "a_log", dims.heads)?;
    inputs.d.has_len(kernel, "d", dims.heads)?;
    let states = [
        dims.tokens.batch,
        chunks,
        dims.heads,
        dims.head_dim,
        dims.state,
    ];
    product(kernel, &states)?;
    Ok(ScanShape { rows, chunks })
}

/// The chunks of a sequence of `dims` (the last one possibly short), or an
/// error for `kernel` where a chunk is empty.
pub fn chunks(kernel: &str, dims: ScanDims) -> Result<usize> {
    ensure(dims.chunk > 0, || {
        format!("{kernel}: the chunk length is 0")
    })?;
    Ok(dims.tokens.seq.div_ceil(dims.chunk))
}

/// [`Backend::ssd_scan_forward`]'s arguments.
pub fn check_ssd_scan_forward(
    inputs: ScanInputs<Operand>,
    y: Operand,
    states: Operand,
    dims: ScanDims,
) -> Result<ScanShape> {
    let k = "ssd_scan_forward";
    let shape = check_inputs(k, &inputs, dims)?;
    states.exactly(DType::F32, k, "states")?;
    y.float(k, "y")?;
    y.has_len(k, "y", shape.rows * dims.heads * dims.head_dim)?;
    states.has_len(k, "states", dims.states_len())?;
    Ok(shape)
}

/// [`Backend::ssd_scan_backward`]'s arguments.
pub fn check_ssd_scan_backward(
    inputs: ScanInputs<Operand>,
    states: Operand,
    dy: Operand,
    grads: ScanGrads<Operand>,
    dims: ScanDims,
) -> Result<ScanShape> {
    let k = "ssd_scan_backward";
    let shape = check_inputs(k, &inputs, dims)?;
    states.exactly(DType::F32, k, "states")?;
    dy.float(k, "dy")?;
    let named = [
        ("d_xbc", grads.xbc),
        ("d_dt", grads.dt),
        ("d_a_log", grads.a_log),
        ("d_d", grads.d),
    ];
    for (name, view) in named {
        view.float(k, name)?;
    }
    states.has_len(k, "states", dims.states_len())?;
    dy.has_len(k, "dy", shape.rows * dims.heads * dims.head_dim)?;
    grads.xbc.has_len(k, "grads.xbc", inputs.xbc.len)?;
    grads.dt.has_len(k, "grads.dt", inputs.dt.len)?;
    grads.a_log.has_len(k, "grads.a_log", dims.heads)?;
    grads.d.has_len(k, "grads.d", dims.heads)?;
    Ok(shape)
}

/// [`Backend`]'s scan methods: each checks its arguments, then runs its
/// [`ScanKernels`] method.
macro_rules! scan_methods {
    () => {
        /// The Mamba-2 selective scan (layers.md `M` steps 3-4), per sequence
        /// and head `h` (group `g = h / (H/G)`), state `S` `[P, N]` from zero:
        /// `dt_t = softplus(dt_raw[t, h] + dt_bias[h])`, `A = -exp(A_log[h])`,
        /// `S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`, `y_t = S_t C_t + D[h] x_t`.
        /// `xbc` is `[rows, H*P + 2*G*N]` holding `x | B | C` per row (the
        /// conv output after SiLU), `dt` `[rows, H]` raw, `y` `[rows, H*P]`.
        /// `states` receives the state at the start of every chunk of
        /// `dims.chunk` steps, `[batch, ceil(seq/chunk), H, P, N]`, so backward
        /// can recompute inside a chunk instead of keeping every step's state.
        fn ssd_scan_forward(
            &self,
            inputs: ScanInputs<Slice<'_, Self>>,
            y: SliceMut<'_, Self>,
            states: SliceMut<'_, Self>,
            dims: ScanDims,
        ) -> Result<()> {
            $crate::backend::scan::check_ssd_scan_forward(
                inputs.operands(),
                y.operand(),
                states.operand(),
                dims,
            )?;
            self.ssd_scan_forward_unchecked(inputs, y, states, dims)
        }

        /// Backward of [`Backend::ssd_scan_forward`] given `dy`: overwrites
        /// `grads.xbc` (all of `x | B | C`) and `grads.dt` (w.r.t. the raw `dt`),
        /// and accumulates `grads.a_log` and `grads.d` (`[H]` each). The
        /// `dt_bias` gradient is the column sum of `grads.dt`.
        fn ssd_scan_backward(
            &self,
            inputs: ScanInputs<Slice<'_, Self>>,
            states: Slice<'_, Self>,
            dy: Slice<'_, Self>,
            grads: ScanGrads<SliceMut<'_, Self>>,
            dims: ScanDims,
        ) -> Result<()> {
            $crate::backend::scan::check_ssd_scan_backward(
                inputs.operands(),
                states.operand(),
                dy.operand(),
                grads.operands(),
                dims,
            )?;
            self.ssd_scan_backward_unchecked(inputs, states, dy, grads, dims)
        }
    };
}
pub(super) use scan_methods;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    #[test]
    fn bad_shapes_are_errors() {
        let dims = ScanDims {
            tokens: Tokens::new(2, 5),
            heads: 4,
            head_dim: 3,
            groups: 2,
            state: 2,
            chunk: 2,
        };
        let f32s = |len| Operand::new(len, DType::F32);
        let inputs = ScanInputs {
            xbc: f32s(10 * dims.xbc_width()),
            dt: f32s(10 * 4),
            dt_bias: f32s(4),
            a_log: f32s(4),
            d: f32s(4),
        };
        let states = f32s(dims.states_len());
        let shape = check_ssd_scan_forward(inputs, f32s(120), states, dims).unwrap();
        assert_eq!(
            shape,
            ScanShape {
                rows: 10,
                chunks: 3
            }
        );
        let odd_groups = ScanDims { groups: 3, ..dims };
        assert!(check_ssd_scan_forward(inputs, f32s(120), states, odd_groups).is_err());
        assert!(check_ssd_scan_forward(inputs, f32s(120), f32s(1000), dims).is_err());
        assert!(check_ssd_scan_forward(inputs, f32s(119), states, dims).is_err());
    }
}

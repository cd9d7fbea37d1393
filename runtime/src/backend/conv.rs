//! The causal depthwise conv1d of Mamba layers (PyTorch `conv1d` with
//! padding `K-1`, truncated), restarting at every sequence.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `conv_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`ConvKernels`] method on each backend (`cpu::ops::conv`,
//! `cuda::ops::conv`).

#[cfg(doc)]
use super::Backend;
use super::Tokens;
use crate::error::Result;
use crate::view::{DeviceBuffer, Operand, View, ViewMut, ensure, product};

/// Dimensions of the conv1d kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub tokens: Tokens,
    pub channels: usize,
    pub kernel: usize,
}

/// The conv1d kernels as a backend implements them: each runs once
/// [`Backend`]'s method of the same name (without `_unchecked`) has checked
/// its arguments here, so their dtypes and lengths are right.
pub trait ConvKernels<Buf: DeviceBuffer> {
    fn conv1d_forward_unchecked(
        &self,
        x: View<'_, Buf>,
        weight: View<'_, Buf>,
        bias: View<'_, Buf>,
        y: ViewMut<'_, Buf>,
        dims: ConvDims,
    ) -> Result<()>;

    fn conv1d_backward_input_unchecked(
        &self,
        dy: View<'_, Buf>,
        weight: View<'_, Buf>,
        dx: ViewMut<'_, Buf>,
        dims: ConvDims,
    ) -> Result<()>;

    fn conv1d_backward_weight_unchecked(
        &self,
        dy: View<'_, Buf>,
        x: View<'_, Buf>,
        dw: ViewMut<'_, Buf>,
        dbias: ViewMut<'_, Buf>,
        dims: ConvDims,
    ) -> Result<()>;
}

/// `x` (a `[rows, channels]` activation, named `x_name` in errors) and the
/// weight (`w_name`) of a conv of `dims`; gives the rows.
fn check_shape(
    kernel: &str,
    dims: ConvDims,
    (x_name, x): (&str, Operand),
    (w_name, w): (&str, Operand),
) -> Result<usize> {
    let rows = dims.tokens.rows()?;
    ensure(dims.kernel > 0, || {
        format!("{kernel}: the kernel width is 0")
    })?;
    x.has_len(kernel, x_name, product(kernel, &[rows, dims.channels])?)?;
    w.has_len(
        kernel,
        w_name,
        product(kernel, &[dims.channels, dims.kernel])?,
    )?;
    Ok(rows)
}

/// [`Backend::conv1d_forward`]'s arguments; gives the rows.
pub fn check_conv1d_forward(
    x: Operand,
    weight: Operand,
    bias: Operand,
    y: Operand,
    dims: ConvDims,
) -> Result<usize> {
    let k = "conv1d_forward";
    for (name, view) in [("x", x), ("weight", weight), ("bias", bias), ("y", y)] {
        view.float(k, name)?;
    }
    let rows = check_shape(k, dims, ("x", x), ("weight", weight))?;
    bias.has_len(k, "bias", dims.channels)?;
    y.has_len(k, "y", x.len)?;
    Ok(rows)
}

/// [`Backend::conv1d_backward_input`]'s arguments; gives the rows.
pub fn check_conv1d_backward_input(
    dy: Operand,
    weight: Operand,
    dx: Operand,
    dims: ConvDims,
) -> Result<usize> {
    let k = "conv1d_backward_input";
    for (name, view) in [("dy", dy), ("weight", weight), ("dx", dx)] {
        view.float(k, name)?;
    }
    let rows = check_shape(k, dims, ("dy", dy), ("weight", weight))?;
    dx.has_len(k, "dx", dy.len)?;
    Ok(rows)
}

/// [`Backend::conv1d_backward_weight`]'s arguments; gives the rows.
pub fn check_conv1d_backward_weight(
    dy: Operand,
    x: Operand,
    dw: Operand,
    dbias: Operand,
    dims: ConvDims,
) -> Result<usize> {
    let k = "conv1d_backward_weight";
    for (name, view) in [("dy", dy), ("x", x), ("dw", dw), ("dbias", dbias)] {
        view.float(k, name)?;
    }
    let rows = check_shape(k, dims, ("x", x), ("dw", dw))?;
    dy.has_len(k, "dy", x.len)?;
    dbias.has_len(k, "dbias", dims.channels)?;
    Ok(rows)
}

/// [`Backend`]'s conv1d methods: each checks its arguments, then runs its
/// [`ConvKernels`] method.
macro_rules! conv_methods {
    () => {
        /// Causal depthwise conv1d along time, restarting at every sequence:
        /// `y[t, c] = bias[c] + sum_{j<K} w[c, j] * x[t - (K-1) + j, c]`, terms
        /// before the sequence start being zero (PyTorch `conv1d` with padding
        /// `K-1`, truncated). `x`, `y` `[rows, channels]`, `w` `[channels, K]`.
        fn conv1d_forward(
            &self,
            x: Slice<'_, Self>,
            weight: Slice<'_, Self>,
            bias: Slice<'_, Self>,
            y: SliceMut<'_, Self>,
            dims: ConvDims,
        ) -> Result<()> {
            $crate::backend::conv::check_conv1d_forward(
                x.operand(),
                weight.operand(),
                bias.operand(),
                y.operand(),
                dims,
            )?;
            self.conv1d_forward_unchecked(x, weight, bias, y, dims)
        }

        /// `dx` of [`Backend::conv1d_forward`] (overwritten):
        /// `dx[s, c] = sum_j w[c, j] * dy[s + (K-1) - j, c]` within the sequence.
        fn conv1d_backward_input(
            &self,
            dy: Slice<'_, Self>,
            weight: Slice<'_, Self>,
            dx: SliceMut<'_, Self>,
            dims: ConvDims,
        ) -> Result<()> {
            $crate::backend::conv::check_conv1d_backward_input(
                dy.operand(),
                weight.operand(),
                dx.operand(),
                dims,
            )?;
            self.conv1d_backward_input_unchecked(dy, weight, dx, dims)
        }

        /// Weight and bias gradients of [`Backend::conv1d_forward`], accumulated:
        /// `dw[c, j] += sum_t dy[t, c] * x[t - (K-1) + j, c]`,
        /// `dbias[c] += sum_t dy[t, c]`.
        fn conv1d_backward_weight(
            &self,
            dy: Slice<'_, Self>,
            x: Slice<'_, Self>,
            dw: SliceMut<'_, Self>,
            dbias: SliceMut<'_, Self>,
            dims: ConvDims,
        ) -> Result<()> {
            $crate::backend::conv::check_conv1d_backward_weight(
                dy.operand(),
                x.operand(),
                dw.operand(),
                dbias.operand(),
                dims,
            )?;
            self.conv1d_backward_weight_unchecked(dy, x, dw, dbias, dims)
        }
    };
}
pub(super) use conv_methods;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;
    use crate::view::DType;

    #[test]
    fn a_weight_of_other_width_is_an_error() {
        let dims = ConvDims {
            tokens: Tokens::new(2, 3),
            channels: 1,
            kernel: 4,
        };
        let f32s = |len| Operand::new(len, DType::F32);
        assert_eq!(
            check_conv1d_forward(f32s(6), f32s(4), f32s(1), f32s(6), dims).unwrap(),
            6
        );
        assert!(check_conv1d_forward(f32s(6), f32s(3), f32s(1), f32s(6), dims).is_err());
        let no_width = ConvDims { kernel: 0, ..dims };
        assert!(check_conv1d_backward_input(f32s(6), f32s(0), f32s(6), no_width).is_err());
    }
}

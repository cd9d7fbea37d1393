//! Normalisation and activations: RMSNorm (plain and grouped) with its
//! input- and weight-gradient halves, and the element-wise activations.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `norm_methods`, which the trait
//! expands; the check a `check_` function of the kernel's name), and its
//! [`NormKernels`] method on each backend (`cpu::ops::norm`,
//! `cuda::ops::norm`).

#[cfg(doc)]
use super::Backend;
use crate::error::Result;
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, ensure, product, same_dtype};

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

/// The norm and activation kernels as a backend implements them: each runs
/// once [`Backend`]'s method of the same name (without `_unchecked`) has
/// checked its arguments here, so their dtypes and lengths are right.
pub trait NormKernels<Buf: DeviceBuffer> {
    fn rmsnorm_forward_unchecked(
        &self,
        x: View<'_, Buf>,
        weight: View<'_, Buf>,
        y: ViewMut<'_, Buf>,
        rstd: ViewMut<'_, Buf>,
        x_copy: Option<ViewMut<'_, Buf>>,
        dims: NormDims,
    ) -> Result<()>;

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward_input_unchecked(
        &self,
        dy: View<'_, Buf>,
        x: View<'_, Buf>,
        weight: View<'_, Buf>,
        rstd: View<'_, Buf>,
        dx: ViewMut<'_, Buf>,
        dx_before: Option<ViewMut<'_, Buf>>,
        partials: ViewMut<'_, Buf>,
        dims: NormDims,
    ) -> Result<()>;

    fn rmsnorm_backward_weight_unchecked(
        &self,
        partials: View<'_, Buf>,
        dw: ViewMut<'_, Buf>,
        dims: NormDims,
    ) -> Result<()>;

    fn unary_forward_unchecked(
        &self,
        op: Unary,
        x: View<'_, Buf>,
        y: ViewMut<'_, Buf>,
    ) -> Result<()>;

    fn unary_backward_unchecked(
        &self,
        op: Unary,
        x: View<'_, Buf>,
        dy: View<'_, Buf>,
        dx: ViewMut<'_, Buf>,
    ) -> Result<()>;

    fn unary_backward_recompute_unchecked(
        &self,
        op: Unary,
        x: View<'_, Buf>,
        dy_then_y: ViewMut<'_, Buf>,
        dx: ViewMut<'_, Buf>,
    ) -> Result<()>;

    fn silu_mul_forward_unchecked(
        &self,
        gate: View<'_, Buf>,
        up: View<'_, Buf>,
        y: ViewMut<'_, Buf>,
    ) -> Result<()>;

    fn silu_mul_backward_unchecked(
        &self,
        gate: View<'_, Buf>,
        up: View<'_, Buf>,
        dy: View<'_, Buf>,
        dgate: ViewMut<'_, Buf>,
        dup: ViewMut<'_, Buf>,
    ) -> Result<()>;

    fn silu_mul_backward_recompute_unchecked(
        &self,
        gate: View<'_, Buf>,
        up: View<'_, Buf>,
        dy_then_y: ViewMut<'_, Buf>,
        dgate: ViewMut<'_, Buf>,
        dup: ViewMut<'_, Buf>,
    ) -> Result<()>;
}

/// The group size (`dim / groups`) of a norm over `x` with `rstd`, after
/// checking that the groups divide the rows and that `x` and `rstd` fit.
fn group_size(kernel: &str, d: NormDims, x: Operand, rstd: Operand) -> Result<usize> {
    ensure(d.groups > 0 && d.dim.is_multiple_of(d.groups), || {
        format!("{kernel}: {} groups do not divide dim {}", d.groups, d.dim)
    })?;
    x.has_len(kernel, "x", product(kernel, &[d.rows, d.dim])?)?;
    rstd.exactly(DType::F32, kernel, "rstd")?;
    rstd.has_len(kernel, "rstd", product(kernel, &[d.rows, d.groups])?)?;
    Ok(d.dim / d.groups)
}

/// [`Backend::rmsnorm_forward`]'s arguments; gives the group size.
pub fn check_rmsnorm_forward(
    x: Operand,
    weight: Operand,
    y: Operand,
    rstd: Operand,
    x_copy: Option<Operand>,
    d: NormDims,
) -> Result<usize> {
    let k = "rmsnorm_forward";
    x.float(k, "x")?;
    weight.float(k, "weight")?;
    y.float(k, "y")?;
    let group_size = group_size(k, d, x, rstd)?;
    weight.has_len(k, "weight", d.dim)?;
    y.has_len(k, "y", x.len)?;
    if let Some(copy) = x_copy {
        same_dtype(k, ("x", x.dtype), ("x_copy", copy.dtype))?;
        copy.has_len(k, "x_copy", x.len)?;
    }
    Ok(group_size)
}

/// [`Backend::rmsnorm_backward_input`]'s arguments; gives the group size.
#[allow(clippy::too_many_arguments)]
pub fn check_rmsnorm_backward_input(
    dy: Operand,
    x: Operand,
    weight: Operand,
    rstd: Operand,
    dx: Operand,
    dx_before: Option<Operand>,
    partials: Operand,
    d: NormDims,
) -> Result<usize> {
    let k = "rmsnorm_backward_input";
    for (arg, operand) in [("dy", dy), ("x", x), ("weight", weight), ("dx", dx)] {
        operand.float(k, arg)?;
    }
    let group_size = group_size(k, d, x, rstd)?;
    weight.has_len(k, "weight", d.dim)?;
    dy.has_len(k, "dy", x.len)?;
    dx.has_len(k, "dx", x.len)?;
    if let Some(before) = dx_before {
        same_dtype(k, ("dx", dx.dtype), ("dx_before", before.dtype))?;
        before.has_len(k, "dx_before", dx.len)?;
    }
    partials.exactly(DType::F32, k, "partials")?;
    partials.has_len(k, "partials", d.weight_partials_len())?;
    Ok(group_size)
}

/// [`Backend::rmsnorm_backward_weight`]'s arguments.
pub fn check_rmsnorm_backward_weight(partials: Operand, dw: Operand, d: NormDims) -> Result<()> {
    let k = "rmsnorm_backward_weight";
    partials.exactly(DType::F32, k, "partials")?;
    partials.has_len(k, "partials", d.weight_partials_len())?;
    dw.float(k, "dw")?;
    dw.has_len(k, "dw", d.dim)
}

/// Element-wise arguments of `kernel`: every one bf16 or f32, each as long
/// as the first.
fn elementwise(kernel: &str, operands: &[(&str, Operand)]) -> Result<()> {
    for (arg, operand) in operands {
        operand.float(kernel, arg)?;
    }
    let len = operands.first().map_or(0, |(_, first)| first.len);
    for (arg, operand) in operands.iter().skip(1) {
        operand.has_len(kernel, arg, len)?;
    }
    Ok(())
}

/// [`Backend::unary_forward`]'s arguments.
pub fn check_unary_forward(x: Operand, y: Operand) -> Result<()> {
    elementwise("unary_forward", &[("x", x), ("y", y)])
}

/// [`Backend::unary_backward`]'s arguments.
pub fn check_unary_backward(x: Operand, dy: Operand, dx: Operand) -> Result<()> {
    elementwise("unary_backward", &[("x", x), ("dy", dy), ("dx", dx)])
}

/// [`Backend::unary_backward_recompute`]'s arguments.
pub fn check_unary_backward_recompute(x: Operand, dy_then_y: Operand, dx: Operand) -> Result<()> {
    let operands = [("x", x), ("dy_then_y", dy_then_y), ("dx", dx)];
    elementwise("unary_backward_recompute", &operands)
}

/// [`Backend::silu_mul_forward`]'s arguments.
pub fn check_silu_mul_forward(gate: Operand, up: Operand, y: Operand) -> Result<()> {
    elementwise("silu_mul_forward", &[("gate", gate), ("up", up), ("y", y)])
}

/// [`Backend::silu_mul_backward`]'s arguments.
pub fn check_silu_mul_backward(
    gate: Operand,
    up: Operand,
    dy: Operand,
    dgate: Operand,
    dup: Operand,
) -> Result<()> {
    silu_mul_gradients("silu_mul_backward", "dy", [gate, up, dy, dgate, dup])
}

/// [`Backend::silu_mul_backward_recompute`]'s arguments.
pub fn check_silu_mul_backward_recompute(
    gate: Operand,
    up: Operand,
    dy_then_y: Operand,
    dgate: Operand,
    dup: Operand,
) -> Result<()> {
    let operands = [gate, up, dy_then_y, dgate, dup];
    silu_mul_gradients("silu_mul_backward_recompute", "dy_then_y", operands)
}

/// The SiLU gate's backward operands (`gate`, `up`, the output gradient
/// named `dy`, `dgate`, `dup`), element-wise.
fn silu_mul_gradients(
    kernel: &str,
    dy: &str,
    [gate, up, d, dgate, dup]: [Operand; 5],
) -> Result<()> {
    let operands = [
        ("gate", gate),
        ("up", up),
        (dy, d),
        ("dgate", dgate),
        ("dup", dup),
    ];
    elementwise(kernel, &operands)
}

/// [`Backend`]'s norm and activation methods: each checks its arguments,
/// then runs its [`NormKernels`] method.
macro_rules! norm_methods {
    () => {
        /// RMSNorm over groups: each row of `dim` channels is cut into `groups`
        /// groups of `dim / groups` consecutive channels (1 group is the plain
        /// norm; `G` groups is Mamba's gated norm). Per group
        /// `rstd = 1 / sqrt(mean(x^2) + eps)`, `y = x * rstd * w` (w over all
        /// `dim` channels). Writes `y` `[rows, dim]` and `rstd` `[rows, groups]`
        /// (kept for backward). Computed in f32. With `x_copy` (of `x`'s dtype
        /// and length, else refused) it also copies `x` there: how a layer
        /// keeps its input for its backward while the residual stream it reads
        /// from moves on; a GPU writes the copy in the norm's own pass over `x`.
        fn rmsnorm_forward(
            &self,
            x: Slice<'_, Self>,
            weight: Slice<'_, Self>,
            y: SliceMut<'_, Self>,
            rstd: SliceMut<'_, Self>,
            x_copy: Option<SliceMut<'_, Self>>,
            dims: NormDims,
        ) -> Result<()> {
            $crate::backend::norm::check_rmsnorm_forward(
                x.operand(),
                weight.operand(),
                y.operand(),
                rstd.operand(),
                x_copy.as_ref().map(ViewMut::operand),
                dims,
            )?;
            self.rmsnorm_forward_unchecked(x, weight, y, rstd, x_copy, dims)
        }

        /// Input gradient of [`Backend::rmsnorm_forward`], accumulated:
        /// per group, with `g = w * dy`,
        /// `dx += rstd * g - x * rstd^3 * mean(g * x)`. With `dx_before` (of
        /// `dx`'s dtype and length, else refused) it first copies `dx` as it was
        /// there: how a layer keeps the gradient of its output for its weight
        /// gradients while adding its input's gradient into the same buffer; a
        /// GPU writes the copy in the norm's own pass over `dx`.
        ///
        /// It also writes the weight gradient's partial sums into `partials`
        /// (f32, [`NormDims::weight_partials_len`]): `partials[s, j]` sums
        /// `dy[r, j] * x[r, j] * rstd[r, group(j)]` over slice `s` of the rows
        /// ([`NormDims::weight_slice_rows`] each). A GPU reads dy and x once for
        /// both gradients, and the layer keeps the partials, not dy and x, for
        /// [`Backend::rmsnorm_backward_weight`].
        #[allow(clippy::too_many_arguments)]
        fn rmsnorm_backward_input(
            &self,
            dy: Slice<'_, Self>,
            x: Slice<'_, Self>,
            weight: Slice<'_, Self>,
            rstd: Slice<'_, Self>,
            dx: SliceMut<'_, Self>,
            dx_before: Option<SliceMut<'_, Self>>,
            partials: SliceMut<'_, Self>,
            dims: NormDims,
        ) -> Result<()> {
            $crate::backend::norm::check_rmsnorm_backward_input(
                dy.operand(),
                x.operand(),
                weight.operand(),
                rstd.operand(),
                dx.operand(),
                dx_before.as_ref().map(ViewMut::operand),
                partials.operand(),
                dims,
            )?;
            self.rmsnorm_backward_input_unchecked(
                dy, x, weight, rstd, dx, dx_before, partials, dims,
            )
        }

        /// Weight gradient of [`Backend::rmsnorm_forward`], accumulated from
        /// the partial sums [`Backend::rmsnorm_backward_input`] wrote:
        /// `dw[j] += sum_s partials[s, j]`, in an order fixed by the
        /// dimensions.
        fn rmsnorm_backward_weight(
            &self,
            partials: Slice<'_, Self>,
            dw: SliceMut<'_, Self>,
            dims: NormDims,
        ) -> Result<()> {
            $crate::backend::norm::check_rmsnorm_backward_weight(
                partials.operand(),
                dw.operand(),
                dims,
            )?;
            self.rmsnorm_backward_weight_unchecked(partials, dw, dims)
        }

        /// `y = f(x)` element-wise for `op` (see [`Unary`]).
        fn unary_forward(
            &self,
            op: Unary,
            x: Slice<'_, Self>,
            y: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::norm::check_unary_forward(x.operand(), y.operand())?;
            self.unary_forward_unchecked(op, x, y)
        }

        /// `dx = dy * f'(x)` element-wise (overwrites `dx`).
        fn unary_backward(
            &self,
            op: Unary,
            x: Slice<'_, Self>,
            dy: Slice<'_, Self>,
            dx: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::norm::check_unary_backward(x.operand(), dy.operand(), dx.operand())?;
            self.unary_backward_unchecked(op, x, dy, dx)
        }

        /// [`Backend::unary_backward`], then `f(x)` into `dy`'s buffer, each
        /// element in the same pass: the backward of a block that dropped its
        /// activation's output in the forward and needs it again for a weight
        /// gradient. `f(x)` has the bits [`Backend::unary_forward`] gives it,
        /// and `dx` those of [`Backend::unary_backward`]; one read of `x`
        /// and no second buffer.
        fn unary_backward_recompute(
            &self,
            op: Unary,
            x: Slice<'_, Self>,
            dy_then_y: SliceMut<'_, Self>,
            dx: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::norm::check_unary_backward_recompute(
                x.operand(),
                dy_then_y.operand(),
                dx.operand(),
            )?;
            self.unary_backward_recompute_unchecked(op, x, dy_then_y, dx)
        }

        /// `y = silu(gate) * up` element-wise: SwiGLU, and Mamba's `y * silu(z)`.
        fn silu_mul_forward(
            &self,
            gate: Slice<'_, Self>,
            up: Slice<'_, Self>,
            y: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::norm::check_silu_mul_forward(
                gate.operand(),
                up.operand(),
                y.operand(),
            )?;
            self.silu_mul_forward_unchecked(gate, up, y)
        }

        /// Gradients of [`Backend::silu_mul_forward`] (overwritten):
        /// `dgate = dy * up * silu'(gate)`, `dup = dy * silu(gate)`.
        fn silu_mul_backward(
            &self,
            gate: Slice<'_, Self>,
            up: Slice<'_, Self>,
            dy: Slice<'_, Self>,
            dgate: SliceMut<'_, Self>,
            dup: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::norm::check_silu_mul_backward(
                gate.operand(),
                up.operand(),
                dy.operand(),
                dgate.operand(),
                dup.operand(),
            )?;
            self.silu_mul_backward_unchecked(gate, up, dy, dgate, dup)
        }

        /// [`Backend::silu_mul_backward`], then `silu(gate) * up` into `dy`'s
        /// buffer in the same pass, as [`Backend::unary_backward_recompute`]
        /// does for one input: each value the bits the forward and the
        /// backward give it.
        fn silu_mul_backward_recompute(
            &self,
            gate: Slice<'_, Self>,
            up: Slice<'_, Self>,
            dy_then_y: SliceMut<'_, Self>,
            dgate: SliceMut<'_, Self>,
            dup: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::norm::check_silu_mul_backward_recompute(
                gate.operand(),
                up.operand(),
                dy_then_y.operand(),
                dgate.operand(),
                dup.operand(),
            )?;
            self.silu_mul_backward_recompute_unchecked(gate, up, dy_then_y, dgate, dup)
        }
    };
}
pub(super) use norm_methods;

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(len: usize) -> Operand {
        Operand::new(len, DType::F32)
    }

    #[test]
    fn bad_group_counts_and_sizes_are_errors() {
        let dims = NormDims {
            rows: 1,
            dim: 6,
            groups: 4,
            eps: 1e-5,
        };
        let forward = |weight, rstd, dims| {
            check_rmsnorm_forward(f32s(6), f32s(weight), f32s(6), f32s(rstd), None, dims)
        };
        assert!(forward(6, 4, dims).is_err());
        let dims = NormDims { groups: 1, ..dims };
        assert!(forward(5, 1, dims).is_err());
        assert_eq!(forward(6, 1, dims).unwrap(), 6);
        let copy = Some(Operand::new(6, DType::Bf16));
        let err = check_rmsnorm_forward(f32s(6), f32s(6), f32s(6), f32s(1), copy, dims);
        assert!(err.unwrap_err().to_string().contains("`x_copy`"));
        assert!(check_silu_mul_backward(f32s(9), f32s(8), f32s(9), f32s(9), f32s(9)).is_err());
        let short = check_unary_backward_recompute(f32s(9), f32s(8), f32s(9));
        assert!(short.unwrap_err().to_string().contains("`dy_then_y`"));
        let short = check_silu_mul_backward_recompute(f32s(9), f32s(9), f32s(9), f32s(9), f32s(7));
        assert!(short.unwrap_err().to_string().contains("`dup`"));
    }
}

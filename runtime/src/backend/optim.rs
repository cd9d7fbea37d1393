//! Optimizer steps over a bucket's f32 shard (AdamW, SGD), and the
//! gradient norm's partial sums.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `optim_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`OptimKernels`] method on each backend (`cpu::ops::optim`,
//! `cuda::ops::optim`).

#[cfg(doc)]
use super::Backend;
use crate::error::Result;
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, ensure};

/// Adam's two moment buffers of one shard (f32, the shard's length).
#[derive(Clone, Copy, Debug)]
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

/// The optimizer kernels as a backend implements them: each runs once
/// [`Backend`]'s method of the same name (without `_unchecked`) has checked
/// its arguments here, so their dtypes and lengths are right.
pub trait OptimKernels<Buf: DeviceBuffer> {
    fn adam_update_unchecked(
        &self,
        param: ViewMut<'_, Buf>,
        copy: Option<ViewMut<'_, Buf>>,
        grad: View<'_, Buf>,
        moments: AdamMoments<ViewMut<'_, Buf>>,
        decayed: View<'_, Buf>,
        step: AdamStep,
    ) -> Result<()>;

    fn sgd_update_unchecked(
        &self,
        param: ViewMut<'_, Buf>,
        copy: Option<ViewMut<'_, Buf>>,
        grad: View<'_, Buf>,
        momentum: Option<ViewMut<'_, Buf>>,
        decayed: View<'_, Buf>,
        step: SgdStep,
    ) -> Result<()>;

    fn sum_squares_unchecked(
        &self,
        x: View<'_, Buf>,
        piece: usize,
        out: ViewMut<'_, Buf>,
    ) -> Result<()>;
}

/// A bucket's f32 shard, its gradient and its decayed ranges (u32
/// `[start, end)` pairs; whether they are in order and inside the shard is
/// data, which each backend checks where it lies), and the optional copy
/// of the updated parameters (bf16 or f32, the shard's length).
fn check_shard(
    kernel: &str,
    param: Operand,
    copy: Option<Operand>,
    grad: Operand,
    decayed: Operand,
) -> Result<()> {
    param.exactly(DType::F32, kernel, "param")?;
    grad.exactly(DType::F32, kernel, "grad")?;
    decayed.exactly(DType::U32, kernel, "decayed")?;
    grad.has_len(kernel, "grad", param.len)?;
    ensure(decayed.len.is_multiple_of(2), || {
        format!(
            "{kernel}: `decayed` holds [start, end) pairs, but it has {} values",
            decayed.len
        )
    })?;
    if let Some(copy) = copy {
        copy.has_len(kernel, "copy", param.len)?;
        copy.float(kernel, "copy")?;
    }
    Ok(())
}

/// [`Backend::adam_update`]'s arguments.
pub fn check_adam_update(
    param: Operand,
    copy: Option<Operand>,
    grad: Operand,
    moments: AdamMoments<Operand>,
    decayed: Operand,
    step: AdamStep,
) -> Result<()> {
    let k = "adam_update";
    check_shard(k, param, copy, grad, decayed)?;
    for (name, moment) in [("m", moments.m), ("v", moments.v)] {
        moment.exactly(DType::F32, k, name)?;
        moment.has_len(k, name, param.len)?;
    }
    ensure(step.step >= 1, || format!("{k}: steps count from 1"))
}

/// [`Backend::sgd_update`]'s arguments: a momentum buffer exactly when
/// the step has momentum.
pub fn check_sgd_update(
    param: Operand,
    copy: Option<Operand>,
    grad: Operand,
    momentum: Option<Operand>,
    decayed: Operand,
    step: SgdStep,
) -> Result<()> {
    let k = "sgd_update";
    check_shard(k, param, copy, grad, decayed)?;
    match momentum {
        Some(buf) => {
            ensure(step.momentum != 0.0, || {
                format!("{k}: a momentum buffer without momentum")
            })?;
            buf.exactly(DType::F32, k, "momentum")?;
            buf.has_len(k, "momentum", param.len)
        }
        None => ensure(step.momentum == 0.0, || {
            format!("{k}: momentum {} needs a buffer", step.momentum)
        }),
    }
}

/// [`Backend::sum_squares`]'s arguments.
pub fn check_sum_squares(x: Operand, piece: usize, out: Operand) -> Result<()> {
    let k = "sum_squares";
    x.exactly(DType::F32, k, "x")?;
    out.exactly(DType::F64, k, "out")?;
    out.has_len(k, "out", sum_squares_pieces(x.len, piece)?)
}

/// The pieces [`Backend::sum_squares`] cuts `len` elements into, `piece`
/// a piece (the last may be shorter), or an error where a piece is empty.
pub fn sum_squares_pieces(len: usize, piece: usize) -> Result<usize> {
    ensure(piece > 0, || {
        "sum_squares: pieces must hold at least one element".to_string()
    })?;
    Ok(len.div_ceil(piece))
}

/// [`Backend`]'s optimizer methods: each checks its arguments, then runs
/// its [`OptimKernels`] method.
macro_rules! optim_methods {
    () => {
        /// One AdamW step over a whole bucket's f32 shard (decoupled weight
        /// decay, as torch `AdamW` and Megatron), with `g = grad * grad_scale`
        /// (the clipping factor, 1 without clipping) and `wd = weight_decay` on
        /// the elements inside `decayed`, 0 elsewhere:
        /// `p *= 1 - lr * wd`; `m = b1 m + (1-b1) g`; `v = b2 v + (1-b2) g^2`;
        /// `p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
        /// `decayed` is u32 `[2n]`: `n` element ranges `[start, end)` of the
        /// shard, ascending and disjoint (the matrices; norms, biases and other
        /// 1-D parameters are not decayed). Alignment gaps and padding hold zero
        /// parameters and gradients, which stay zero (so do their moments).
        /// With `copy` (f32 or bf16, the shard's length), the updated parameters
        /// are also written there, rounded once: the compute-precision copy,
        /// which a cast would otherwise read the shard again for.
        fn adam_update(
            &self,
            param: SliceMut<'_, Self>,
            copy: Option<SliceMut<'_, Self>>,
            grad: Slice<'_, Self>,
            moments: AdamMoments<SliceMut<'_, Self>>,
            decayed: Slice<'_, Self>,
            step: AdamStep,
        ) -> Result<()> {
            $crate::backend::optim::check_adam_update(
                param.operand(),
                copy.as_ref().map(ViewMut::operand),
                grad.operand(),
                AdamMoments {
                    m: moments.m.operand(),
                    v: moments.v.operand(),
                },
                decayed.operand(),
                step,
            )?;
            self.adam_update_unchecked(param, copy, grad, moments, decayed, step)
        }

        /// One SGD step over a whole bucket's f32 shard (torch semantics), with
        /// `g = grad * grad_scale` and `wd` as in [`Backend::adam_update`]:
        /// `g' = g + wd * p`; with momentum `mu`, `buf = mu * buf + g'` and
        /// `p -= lr * buf`, else `p -= lr * g'`. `momentum` must be `Some`
        /// exactly when `step.momentum != 0`. `copy` as in
        /// [`Backend::adam_update`].
        fn sgd_update(
            &self,
            param: SliceMut<'_, Self>,
            copy: Option<SliceMut<'_, Self>>,
            grad: Slice<'_, Self>,
            momentum: Option<SliceMut<'_, Self>>,
            decayed: Slice<'_, Self>,
            step: SgdStep,
        ) -> Result<()> {
            $crate::backend::optim::check_sgd_update(
                param.operand(),
                copy.as_ref().map(ViewMut::operand),
                grad.operand(),
                momentum.as_ref().map(ViewMut::operand),
                decayed.operand(),
                step,
            )?;
            self.sgd_update_unchecked(param, copy, grad, momentum, decayed, step)
        }

        /// `out[i] = sum of x[j]^2` over piece `i` of `x`, pieces of `piece`
        /// elements (the last may be shorter), each summed in f64 in an order
        /// fixed by the piece's length (the CPU: index order from zero; a GPU: a
        /// fixed tree): the gradient norm's partial sums. `x` is f32 (gradients),
        /// `out` f64 with `ceil(len / piece)` elements; `piece` must be positive.
        fn sum_squares(
            &self,
            x: Slice<'_, Self>,
            piece: usize,
            out: SliceMut<'_, Self>,
        ) -> Result<()> {
            $crate::backend::optim::check_sum_squares(x.operand(), piece, out.operand())?;
            self.sum_squares_unchecked(x, piece, out)
        }
    };
}
pub(super) use optim_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_take_pairs_of_range_bounds_and_momentum_takes_a_buffer() {
        let f32s = |len| Operand::new(len, DType::F32);
        let u32s = |len| Operand::new(len, DType::U32);
        let adam = AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_scale: 1.0,
            step: 1,
        };
        let moments = AdamMoments {
            m: f32s(4),
            v: f32s(4),
        };
        assert!(check_adam_update(f32s(4), None, f32s(4), moments, u32s(2), adam).is_ok());
        let err = check_adam_update(f32s(4), None, f32s(4), moments, u32s(1), adam).unwrap_err();
        assert!(err.to_string().contains("decayed"), "{err}");
        let first = AdamStep { step: 0, ..adam };
        assert!(check_adam_update(f32s(4), None, f32s(4), moments, u32s(2), first).is_err());
        let sgd = SgdStep {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
            grad_scale: 1.0,
        };
        assert!(check_sgd_update(f32s(4), None, f32s(4), None, u32s(0), sgd).is_err());
        let buf = Some(f32s(4));
        assert!(check_sgd_update(f32s(4), None, f32s(4), buf, u32s(0), sgd).is_ok());
        let out = Operand::new(2, DType::F64);
        assert!(check_sum_squares(f32s(4), 0, out).is_err());
        assert!(check_sum_squares(f32s(4), 2, out).is_ok());
    }
}

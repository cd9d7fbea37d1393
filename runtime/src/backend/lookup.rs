//! Embedding lookups and the softmax cross-entropy loss of the output head.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `lookup_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`LookupKernels`] method on each backend (`cpu::ops::lookup`,
//! `cuda::ops::lookup`). Token ids and targets are device data: a backend
//! checks their range where they lie (see each method).

#[cfg(doc)]
use super::Backend;
use crate::error::Result;
use crate::view::{DType, DeviceBuffer, Operand, View, ViewMut, product, same_dtype};

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

/// The lookup and loss kernels as a backend implements them: each runs
/// once [`Backend`]'s method of the same name (without `_unchecked`) has
/// checked its arguments here, so their dtypes and lengths are right.
pub trait LookupKernels<Buf: DeviceBuffer> {
    fn embedding_forward_unchecked(
        &self,
        table: View<'_, Buf>,
        ids: View<'_, Buf>,
        out: ViewMut<'_, Buf>,
        dims: LookupDims,
    ) -> Result<()>;

    fn embedding_backward_unchecked(
        &self,
        dout: View<'_, Buf>,
        ids: View<'_, Buf>,
        dtable: ViewMut<'_, Buf>,
        dims: LookupDims,
    ) -> Result<()>;

    fn cross_entropy_forward_unchecked(
        &self,
        logits: ViewMut<'_, Buf>,
        targets: View<'_, Buf>,
        losses: ViewMut<'_, Buf>,
        dims: LossDims,
    ) -> Result<()>;

    fn cross_entropy_backward_unchecked(
        &self,
        probs: ViewMut<'_, Buf>,
        targets: View<'_, Buf>,
        scale: f32,
        dims: LossDims,
    ) -> Result<()>;

    fn cross_entropy_loss_unchecked(
        &self,
        logits: ViewMut<'_, Buf>,
        targets: View<'_, Buf>,
        losses: ViewMut<'_, Buf>,
        dims: LossDims,
    ) -> Result<()>;

    fn cross_entropy_gradient_unchecked(
        &self,
        logits: ViewMut<'_, Buf>,
        targets: View<'_, Buf>,
        scale: f32,
        out: Option<ViewMut<'_, Buf>>,
        losses: Option<ViewMut<'_, Buf>>,
        dims: LossDims,
    ) -> Result<()>;
}

/// [`Backend::embedding_forward`]'s arguments; gives the rows (one an id).
pub fn check_embedding_forward(
    table: Operand,
    ids: Operand,
    out: Operand,
    dims: LookupDims,
) -> Result<usize> {
    let k = "embedding_forward";
    same_dtype(k, ("table", table.dtype), ("out", out.dtype))?;
    table.float(k, "table")?;
    ids.exactly(DType::U32, k, "ids")?;
    out.float(k, "out")?;
    table.has_len(k, "table", product(k, &[dims.vocab, dims.hidden])?)?;
    out.has_len(k, "out", product(k, &[ids.len, dims.hidden])?)?;
    Ok(ids.len)
}

/// [`Backend::embedding_backward`]'s arguments; gives the rows.
pub fn check_embedding_backward(
    dout: Operand,
    ids: Operand,
    dtable: Operand,
    dims: LookupDims,
) -> Result<usize> {
    let k = "embedding_backward";
    dout.float(k, "dout")?;
    ids.exactly(DType::U32, k, "ids")?;
    dtable.float(k, "dtable")?;
    dtable.has_len(k, "dtable", product(k, &[dims.vocab, dims.hidden])?)?;
    dout.has_len(k, "dout", product(k, &[ids.len, dims.hidden])?)?;
    Ok(ids.len)
}

/// The head's logits (bf16 or f32: the compute dtype; `name` as the
/// method calls them) and the targets (u32, one a row).
fn check_logits(
    kernel: &str,
    name: &str,
    logits: Operand,
    targets: Operand,
    d: LossDims,
) -> Result<()> {
    logits.float(kernel, name)?;
    targets.exactly(DType::U32, kernel, "targets")?;
    logits.has_len(kernel, name, product(kernel, &[d.rows, d.vocab])?)?;
    targets.has_len(kernel, "targets", d.rows)
}

/// f32 probabilities or logits the kernel works on in place, and targets.
fn check_in_place(
    kernel: &str,
    name: &str,
    probs: Operand,
    targets: Operand,
    d: LossDims,
) -> Result<()> {
    probs.exactly(DType::F32, kernel, name)?;
    check_logits(kernel, name, probs, targets, d)
}

/// One f32 loss a row.
fn check_losses(kernel: &str, losses: Operand, d: LossDims) -> Result<()> {
    losses.exactly(DType::F32, kernel, "losses")?;
    losses.has_len(kernel, "losses", d.rows)
}

/// [`Backend::cross_entropy_forward`]'s arguments.
pub fn check_cross_entropy_forward(
    logits: Operand,
    targets: Operand,
    losses: Operand,
    dims: LossDims,
) -> Result<()> {
    let k = "cross_entropy_forward";
    check_in_place(k, "logits", logits, targets, dims)?;
    check_losses(k, losses, dims)
}

/// [`Backend::cross_entropy_backward`]'s arguments.
pub fn check_cross_entropy_backward(
    probs: Operand,
    targets: Operand,
    dims: LossDims,
) -> Result<()> {
    check_in_place("cross_entropy_backward", "probs", probs, targets, dims)
}

/// [`Backend::cross_entropy_loss`]'s arguments.
pub fn check_cross_entropy_loss(
    logits: Operand,
    targets: Operand,
    losses: Operand,
    dims: LossDims,
) -> Result<()> {
    let k = "cross_entropy_loss";
    check_logits(k, "logits", logits, targets, dims)?;
    check_losses(k, losses, dims)
}

/// [`Backend::cross_entropy_gradient`]'s arguments.
pub fn check_cross_entropy_gradient(
    logits: Operand,
    targets: Operand,
    out: Option<Operand>,
    losses: Option<Operand>,
    dims: LossDims,
) -> Result<()> {
    let k = "cross_entropy_gradient";
    check_logits(k, "logits", logits, targets, dims)?;
    if let Some(out) = out {
        out.float(k, "out")?;
        out.has_len(k, "out", logits.len)?;
    }
    if let Some(losses) = losses {
        check_losses(k, losses, dims)?;
    }
    Ok(())
}

/// [`Backend`]'s lookup and loss methods: each checks its arguments, then
/// runs its [`LookupKernels`] method.
macro_rules! lookup_methods {
    () => {
        /// `out[r] = table[ids[r]]`: `table` `[vocab, hidden]` (bf16 or f32),
        /// `ids` u32 `[rows]`, `out` `[rows, hidden]` of the table's dtype. An id
        /// at or past `vocab` is an error, and nothing is written.
        fn embedding_forward(
            &self,
            table: Slice<'_, Self>,
            ids: Slice<'_, Self>,
            out: SliceMut<'_, Self>,
            dims: LookupDims,
        ) -> Result<()> {
            $crate::backend::lookup::check_embedding_forward(
                table.operand(),
                ids.operand(),
                out.operand(),
                dims,
            )?;
            self.embedding_forward_unchecked(table, ids, out, dims)
        }

        /// `dtable[ids[r]] += dout[r]`, rows in order (deterministic: every
        /// backend adds each id's rows in row order).
        /// `dout` bf16 or f32, `ids` u32, `dtable` bf16 or f32 (f32 when it is a
        /// gradient accumulator). A bad id is an error and nothing is added.
        fn embedding_backward(
            &self,
            dout: Slice<'_, Self>,
            ids: Slice<'_, Self>,
            dtable: SliceMut<'_, Self>,
            dims: LookupDims,
        ) -> Result<()> {
            $crate::backend::lookup::check_embedding_backward(
                dout.operand(),
                ids.operand(),
                dtable.operand(),
                dims,
            )?;
            self.embedding_backward_unchecked(dout, ids, dtable, dims)
        }

        /// Softmax cross-entropy in f32, in place: `logits` f32 `[rows, vocab]`
        /// becomes the probabilities `softmax(logits)`; `losses` f32 `[rows]`
        /// gets `logsumexp(logits_r) - logits_r[targets[r]]`, or exactly 0 where
        /// `targets[r] == IGNORE_TARGET`, so the plain sum of `losses` is the
        /// masked sum. `targets` is u32 `[rows]`; a target at or past `vocab`
        /// (other than [`IGNORE_TARGET`]) is an error.
        fn cross_entropy_forward(
            &self,
            logits: SliceMut<'_, Self>,
            targets: Slice<'_, Self>,
            losses: SliceMut<'_, Self>,
            dims: LossDims,
        ) -> Result<()> {
            $crate::backend::lookup::check_cross_entropy_forward(
                logits.operand(),
                targets.operand(),
                losses.operand(),
                dims,
            )?;
            self.cross_entropy_forward_unchecked(logits, targets, losses, dims)
        }

        /// Backward of [`Backend::cross_entropy_forward`] for loss `scale *
        /// sum_r losses[r]`, in place on f32 `probs` `[rows, vocab]`: they become
        /// `scale * (p - onehot(target))`, and rows with an ignored target 0.
        /// `targets` is u32 `[rows]`.
        fn cross_entropy_backward(
            &self,
            probs: SliceMut<'_, Self>,
            targets: Slice<'_, Self>,
            scale: f32,
            dims: LossDims,
        ) -> Result<()> {
            $crate::backend::lookup::check_cross_entropy_backward(
                probs.operand(),
                targets.operand(),
                dims,
            )?;
            self.cross_entropy_backward_unchecked(probs, targets, scale, dims)
        }

        /// The losses of [`Backend::cross_entropy_forward`] without the
        /// probabilities, from f32 or bf16 `logits` (widened to f32): `logits`
        /// are left unspecified. The head's forward calls it (a GPU reads each
        /// row once and writes no probabilities).
        fn cross_entropy_loss(
            &self,
            logits: SliceMut<'_, Self>,
            targets: Slice<'_, Self>,
            losses: SliceMut<'_, Self>,
            dims: LossDims,
        ) -> Result<()> {
            $crate::backend::lookup::check_cross_entropy_loss(
                logits.operand(),
                targets.operand(),
                losses.operand(),
                dims,
            )?;
            self.cross_entropy_loss_unchecked(logits, targets, losses, dims)
        }

        /// [`Backend::cross_entropy_forward`] then
        /// [`Backend::cross_entropy_backward`] without the losses: the gradient
        /// of the loss `scale * sum_r losses[r]` with respect to `logits`
        /// `[rows, vocab]` (f32, or bf16 widened to f32: the head's logits in
        /// the compute dtype), the same values those two compute on the widened
        /// logits. With `out` (`[rows, vocab]`, f32 or bf16) the gradients are
        /// written there, rounded once, and `logits` are left unspecified;
        /// without it they replace the logits, rounded once to their dtype.
        /// With `losses` (`[rows]` f32), each row's loss too, as
        /// [`Backend::cross_entropy_loss`] gives it. The head calls it
        /// once a chunk (a GPU reads each row once, with no f32 probabilities in
        /// between): its forward with the losses, keeping the gradients for the
        /// backward, or its backward, recomputing them.
        fn cross_entropy_gradient(
            &self,
            logits: SliceMut<'_, Self>,
            targets: Slice<'_, Self>,
            scale: f32,
            out: Option<SliceMut<'_, Self>>,
            losses: Option<SliceMut<'_, Self>>,
            dims: LossDims,
        ) -> Result<()> {
            $crate::backend::lookup::check_cross_entropy_gradient(
                logits.operand(),
                targets.operand(),
                out.as_ref().map(ViewMut::operand),
                losses.as_ref().map(ViewMut::operand),
                dims,
            )?;
            self.cross_entropy_gradient_unchecked(logits, targets, scale, out, losses, dims)
        }
    };
}
pub(super) use lookup_methods;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_and_targets_are_u32_and_sized_by_rows() {
        let f32s = |len| Operand::new(len, DType::F32);
        let u32s = |len| Operand::new(len, DType::U32);
        let dims = LookupDims {
            vocab: 3,
            hidden: 2,
        };
        assert_eq!(
            check_embedding_forward(f32s(6), u32s(2), f32s(4), dims).unwrap(),
            2
        );
        assert!(check_embedding_forward(f32s(6), f32s(2), f32s(4), dims).is_err());
        assert!(check_embedding_backward(f32s(4), u32s(2), f32s(5), dims).is_err());
        let loss = LossDims { rows: 2, vocab: 3 };
        assert!(check_cross_entropy_forward(f32s(6), u32s(2), f32s(2), loss).is_ok());
        assert!(check_cross_entropy_forward(f32s(6), u32s(3), f32s(2), loss).is_err());
        let bf16_logits = Operand::new(6, DType::Bf16);
        assert!(check_cross_entropy_backward(bf16_logits, u32s(2), loss).is_err());
        assert!(check_cross_entropy_loss(bf16_logits, u32s(2), f32s(2), loss).is_ok());
        let out = Some(f32s(5));
        assert!(check_cross_entropy_gradient(f32s(6), u32s(2), out, None, loss).is_err());
    }
}

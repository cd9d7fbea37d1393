//! The output head: `logits = h W^T` (W `[V, h]`, the output layer or the
//! tied embedding) and softmax cross-entropy in f32 against targets, with
//! [`IGNORE_TARGET`] masking positions past the end (MTP). The logits are
//! stored in the compute dtype: in bf16 the GEMM rounds them once, as
//! Megatron's output layer does (its cross-entropy widens them to f32), and
//! the loss kernels read half the bytes.
//!
//! The head works on chunks of rows whose logits hold at most
//! [`HEAD_CHUNK_ELEMENTS`] values (256 MiB in f32), so it never holds a
//! `[tokens, vocab]` matrix of logits for a whole micro-batch: a 131,072-token
//! vocabulary at 16k tokens per micro-batch runs 512 rows at a time.
//!
//! The logit gradients of a training step depend only on the logits, the
//! targets and the loss's scale, all known in the forward: the forward
//! turns each chunk's logits into its losses and gradients in one pass
//! (`Backend::cross_entropy_gradient`) and keeps the gradients, in the
//! compute dtype, for the backward, which then only runs the `dh` and `dW`
//! products chunk by chunk. That spares the backward a second logits GEMM.
//! Where a micro-batch's gradients would pass
//! [`HEAD_KEPT_GRADIENT_ELEMENTS`], or no backward follows (an
//! evaluation), the forward keeps only the hidden states and the backward
//! recomputes each chunk's logits and gradients. Both ways give the same
//! bits: the same GEMM on the same operands, the same loss kernels.
//!
//! Chunking changes no bit on the CPU: a row's logits, loss and `dh` depend
//! on that row alone, and `dW` sums the rows onto the gradient in row order,
//! chunk after chunk, exactly as one product over all rows does. A GPU GEMM
//! may split its reduction differently for a chunk than for the whole; every
//! schedule uses the same chunking, so they still agree bit for bit.

use super::{check_len, copy_of, positive, uninit_f32};
use crate::backend::{Backend, IGNORE_TARGET, LossDims, MatmulDims, Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use hybridgen_dsl::ModelConfig;
use std::ops::Range;

/// The most logits one chunk of the head holds (256 MiB in f32, 128 MiB in
/// bf16).
/// Each chunk adds its `dW` into the f32 gradient, a read and a write of
/// the whole `[V, h]` matrix: at 64 MiB the benchmark model's 4,096-token
/// micro-batch took 8 such passes, whose memory traffic held the `dW`
/// GEMMs at half their speed; at 256 MiB it takes 2.
pub const HEAD_CHUNK_ELEMENTS: usize = 1 << 26;

/// The most logit gradients a micro-batch's head keeps from its forward
/// for its backward (in the compute dtype: 512 MiB in bf16); past it the
/// backward recomputes them. The benchmark model's 4,096 x 32,768 keep;
/// a 131,072-token vocabulary at 4,096 tokens recomputes. The memory plan
/// counts what [`Head::kept_elements`] and [`Head::chunk_elements`] say
/// ([`crate::memory::activations`]).
pub const HEAD_KEPT_GRADIENT_ELEMENTS: usize = 1 << 28;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    vocab: usize,
    hidden: usize,
    /// Rows per chunk.
    chunk_rows: usize,
    /// The most logit gradients the forward keeps.
    kept_limit: usize,
}

/// What [`Head::forward`] keeps: the hidden states, and the logit
/// gradients when it computed them (else the backward recomputes them
/// chunk by chunk).
pub struct HeadSaved<B: Backend> {
    rows: usize,
    hidden_states: B::Buf,
    /// `[rows, vocab]` in the compute dtype, and the loss scale they were
    /// computed for.
    logit_grads: Option<(f32, B::Buf)>,
}

/// Targets that count towards the loss (not [`IGNORE_TARGET`]): the
/// denominator of a mean loss, known on the host from the tokens.
pub fn counted_targets(targets: &[u32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE_TARGET).count()
}

impl Head {
    /// The head of `config`: `padded_vocab_size() x hidden_size`, in chunks
    /// of at most [`HEAD_CHUNK_ELEMENTS`] logits.
    pub fn new(config: &ModelConfig) -> Result<Self> {
        let vocab = positive("the vocabulary size", config.padded_vocab_size())?;
        Ok(Head {
            vocab,
            hidden: positive("hidden_size", config.hidden_size)?,
            chunk_rows: (HEAD_CHUNK_ELEMENTS / vocab).max(1),
            kept_limit: HEAD_KEPT_GRADIENT_ELEMENTS,
        })
    }

    /// The same head keeping at most `elements` logit gradients from its
    /// forward (0: never).
    pub fn with_kept_limit(self, elements: usize) -> Self {
        Head {
            kept_limit: elements,
            ..self
        }
    }

    /// The same head working `rows` rows at a time (at least 1).
    pub fn with_chunk_rows(self, rows: usize) -> Result<Self> {
        Ok(Head {
            chunk_rows: positive("the head's chunk rows", rows)?,
            ..self
        })
    }

    /// Rows per chunk.
    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }

    /// Whether a training forward of `rows` rows keeps its logit gradients
    /// for the backward (else the backward recomputes them).
    fn keeps_gradients(&self, rows: usize) -> bool {
        rows.saturating_mul(self.vocab) <= self.kept_limit
    }

    /// Elements (compute dtype) a training forward of `rows` rows keeps for
    /// its backward: its input, and the logit gradients where it keeps them.
    pub fn kept_elements(&self, rows: usize) -> usize {
        let grads = if self.keeps_gradients(rows) {
            rows.saturating_mul(self.vocab)
        } else {
            0
        };
        rows.saturating_mul(self.hidden).saturating_add(grads)
    }

    /// Elements (compute dtype) of the one chunk of logits the forward, or a
    /// recomputing backward, works in for `rows` rows; the forward also
    /// holds the rows' losses, `rows` f32.
    pub fn chunk_elements(&self, rows: usize) -> usize {
        self.chunk_rows.min(rows).saturating_mul(self.vocab)
    }

    /// The row ranges of the chunks of `rows` rows.
    fn chunks(&self, rows: usize) -> impl Iterator<Item = Range<usize>> + use<> {
        let step = self.chunk_rows;
        (0..rows)
            .step_by(step)
            .map(move |start| start..(start + step).min(rows))
    }

    fn check<B: Backend>(
        &self,
        b: &B,
        name: &str,
        weight: Slice<'_, B>,
        hidden_states: Slice<'_, B>,
        rows: usize,
    ) -> Result<()> {
        check_len(
            name,
            "weight",
            b.slice_len(weight),
            self.vocab * self.hidden,
        )?;
        check_len(
            name,
            "hidden_states",
            b.slice_len(hidden_states),
            rows * self.hidden,
        )
    }

    /// A buffer for one chunk's logits of a micro-batch of `rows` rows, in
    /// the compute dtype.
    fn chunk_buffer<B: Backend>(&self, b: &B, rows: usize) -> Result<B::Buf> {
        b.alloc_uninit(self.chunk_elements(rows), b.compute_dtype())
    }

    /// `logits[..n * V] = h[rows] W^T` for chunk `rows`, `n` its length.
    fn chunk_logits<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        hidden_states: Slice<'_, B>,
        logits: &B::Buf,
        rows: &Range<usize>,
    ) -> Result<()> {
        let (v, h, n) = (self.vocab, self.hidden, rows.len());
        b.matmul(
            b.subslice(hidden_states, rows.start * h..rows.end * h)?,
            weight,
            b.slice_mut(logits, 0..n * v)?,
            MatmulDims::linear(n, h, v),
        )
    }

    /// Cross-entropy of `hidden_states` `[rows, h]` against `targets` (a u32
    /// view of `rows` ids, [`IGNORE_TARGET`] for none): adds the sum of the
    /// per-token losses (f64, rows in order; masked rows add nothing) to
    /// `loss_sum`, one f64 on the device. With `grad_scale` (a backward
    /// follows, for the loss `grad_scale * loss_sum`), also the logit
    /// gradients, kept for [`Head::backward`] where they fit the kept limit.
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        hidden_states: Slice<'_, B>,
        targets: Slice<'_, B>,
        loss_sum: SliceMut<'_, B>,
        grad_scale: Option<f32>,
    ) -> Result<HeadSaved<B>> {
        let rows = b.slice_len(targets);
        self.check(b, "head", weight, hidden_states, rows)?;
        let v = self.vocab;
        let logits = self.chunk_buffer(b, rows)?;
        let losses = uninit_f32(b, rows)?;
        let kept = match grad_scale {
            Some(scale) if self.keeps_gradients(rows) => {
                Some((scale, b.alloc_uninit(rows * v, b.compute_dtype())?))
            }
            _ => None,
        };
        for chunk in self.chunks(rows) {
            self.chunk_logits(b, weight, hidden_states, &logits, &chunk)?;
            let dims = LossDims {
                rows: chunk.len(),
                vocab: v,
            };
            let chunk_logits = b.slice_mut(&logits, 0..chunk.len() * v)?;
            let chunk_targets = b.subslice(targets, chunk.clone())?;
            let chunk_losses = b.slice_mut(&losses, chunk.clone())?;
            match &kept {
                Some((scale, grads)) => b.cross_entropy_gradient(
                    chunk_logits,
                    chunk_targets,
                    *scale,
                    Some(b.slice_mut(grads, chunk.start * v..chunk.end * v)?),
                    Some(chunk_losses),
                    dims,
                )?,
                None => b.cross_entropy_loss(chunk_logits, chunk_targets, chunk_losses, dims)?,
            }
        }
        b.accumulate_sum(b.view(&losses)?, loss_sum)?;
        Ok(HeadSaved {
            rows,
            hidden_states: copy_of(b, hidden_states)?,
            logit_grads: kept,
        })
    }

    /// For the loss `grad_scale * loss_sum` (e.g. `1 / tokens` for a mean):
    /// `dh = dlogits W` (written whole: each chunk writes its rows once, so
    /// no sum into bf16, which costs a GPU a pass through f32) and
    /// `dW += dlogits^T h` (into the output layer's or, tied, the
    /// embedding's gradient), chunk by chunk, from the logit gradients the
    /// forward kept (for this `grad_scale`) or recomputed.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        saved: HeadSaved<B>,
        targets: Slice<'_, B>,
        grad_scale: f32,
        mut dh: SliceMut<'_, B>,
        mut dw: SliceMut<'_, B>,
    ) -> Result<()> {
        let (v, h, rows) = (self.vocab, self.hidden, saved.rows);
        let hidden_states = b.view(&saved.hidden_states)?;
        let name = "head backward";
        self.check(b, name, weight, hidden_states, rows)?;
        check_len(name, "targets", b.slice_len(targets), rows)?;
        check_len(name, "dh", b.slice_len(b.as_slice(&dh)), rows * h)?;
        check_len(name, "dw", b.slice_len(b.as_slice(&dw)), v * h)?;
        if let Some((kept_scale, _)) = &saved.logit_grads
            && kept_scale.to_bits() != grad_scale.to_bits()
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "{name}: the forward kept the logit gradients of the loss scaled by \
                 {kept_scale}, the backward asks for {grad_scale}; pass the forward the \
                 backward's scale (or none, to recompute)"
            )));
        }
        // The forward's `[rows, vocab]` gradients, or a chunk's buffer the
        // backward recomputes them into (in the compute dtype).
        let (grads, recompute) = match saved.logit_grads {
            Some((_, grads)) => (grads, false),
            None => (self.chunk_buffer(b, rows)?, true),
        };
        for chunk in self.chunks(rows) {
            let n = chunk.len();
            let d_logits = if recompute {
                self.chunk_logits(b, weight, hidden_states, &grads, &chunk)?;
                // In place: the gradients replace the logits, rounded once
                // to the compute dtype (the GEMMs' operand).
                b.cross_entropy_gradient(
                    b.slice_mut(&grads, 0..n * v)?,
                    b.subslice(targets, chunk.clone())?,
                    grad_scale,
                    None,
                    None,
                    LossDims { rows: n, vocab: v },
                )?;
                b.slice(&grads, 0..n * v)?
            } else {
                b.slice(&grads, chunk.start * v..chunk.end * v)?
            };
            b.matmul(
                d_logits,
                weight,
                b.subslice_mut(&mut dh, chunk.start * h..chunk.end * h)?,
                MatmulDims::linear_input_grad(n, h, v, false),
            )?;
            b.matmul(
                d_logits,
                b.subslice(hidden_states, chunk.start * h..chunk.end * h)?,
                b.reborrow_mut(&mut dw),
                MatmulDims::linear_weight_grad(n, h, v),
            )?;
        }
        Ok(())
    }
}

//! The output head: `logits = h W^T` (W `[V, h]`, the output layer or the
//! tied embedding) and softmax cross-entropy in f32 against targets, with
//! [`IGNORE_TARGET`] masking positions past the end (MTP). Keeps one
//! micro-batch's probabilities (turned into logit gradients in place by the
//! backward) and nothing bigger.

use super::{check_len, copy_of, positive, zeros_f32};
use crate::backend::{Backend, IGNORE_TARGET, LossDims, MatmulDims, Slice, SliceMut};
use crate::error::Result;
use hybridgen_dsl::ModelConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    vocab: usize,
    hidden: usize,
}

/// What [`Head::forward`] returns.
pub struct HeadForward<B: Backend> {
    /// Sum of the per-token losses over unmasked targets (f64, row order).
    pub loss_sum: f64,
    /// Unmasked targets.
    pub count: usize,
    pub saved: HeadSaved<B>,
}

/// What [`Head::forward`] keeps.
pub struct HeadSaved<B: Backend> {
    rows: usize,
    hidden_states: B::Buf,
    probs: B::Buf,
    targets: Vec<u32>,
}

/// What [`Head::backward_input`] keeps.
pub struct HeadWgrad<B: Backend> {
    rows: usize,
    hidden_states: B::Buf,
    d_logits: B::Buf,
}

impl Head {
    /// The head of `config`: `padded_vocab_size() x hidden_size`.
    pub fn new(config: &ModelConfig) -> Result<Self> {
        Ok(Head {
            vocab: positive("the vocabulary size", config.padded_vocab_size())?,
            hidden: positive("hidden_size", config.hidden_size)?,
        })
    }

    /// Cross-entropy of `hidden_states` `[rows, h]` against `targets`
    /// (`rows` values, [`IGNORE_TARGET`] for none).
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        hidden_states: Slice<'_, B>,
        targets: &[u32],
    ) -> Result<HeadForward<B>> {
        let (v, h, rows) = (self.vocab, self.hidden, targets.len());
        check_len("head", "weight", b.slice_len(weight), v * h)?;
        check_len(
            "head",
            "hidden_states",
            b.slice_len(hidden_states),
            rows * h,
        )?;
        let probs = zeros_f32(b, rows * v)?;
        b.matmul(
            hidden_states,
            weight,
            b.view_mut(&probs)?,
            MatmulDims::linear(rows, h, v),
        )?;
        let losses = zeros_f32(b, rows)?;
        let dims = LossDims { rows, vocab: v };
        b.cross_entropy_forward(b.view_mut(&probs)?, targets, b.view_mut(&losses)?, dims)?;
        let mut host = vec![0.0f32; rows];
        b.download(b.view(&losses)?, &mut host)?;
        let mut loss_sum = 0.0f64;
        let mut count = 0usize;
        for (&loss, &t) in host.iter().zip(targets) {
            if t != IGNORE_TARGET {
                loss_sum += loss as f64;
                count += 1;
            }
        }
        Ok(HeadForward {
            loss_sum,
            count,
            saved: HeadSaved {
                rows,
                hidden_states: copy_of(b, hidden_states)?,
                probs,
                targets: targets.to_vec(),
            },
        })
    }

    /// For the loss `grad_scale * loss_sum` (e.g. `1 / tokens` for a mean):
    /// `dh += dlogits W`.
    pub fn backward_input<B: Backend>(
        &self,
        b: &B,
        weight: Slice<'_, B>,
        saved: HeadSaved<B>,
        grad_scale: f32,
        dh: SliceMut<'_, B>,
    ) -> Result<HeadWgrad<B>> {
        let (v, h, rows) = (self.vocab, self.hidden, saved.rows);
        check_len("head backward", "weight", b.slice_len(weight), v * h)?;
        check_len(
            "head backward",
            "dh",
            b.slice_len(b.as_slice(&dh)),
            rows * h,
        )?;
        let d_logits = saved.probs;
        let dims = LossDims { rows, vocab: v };
        b.cross_entropy_backward(b.view_mut(&d_logits)?, &saved.targets, grad_scale, dims)?;
        b.matmul(
            b.view(&d_logits)?,
            weight,
            dh,
            MatmulDims::linear_input_grad(rows, h, v, true),
        )?;
        Ok(HeadWgrad {
            rows,
            hidden_states: saved.hidden_states,
            d_logits,
        })
    }

    /// `dW += dlogits^T h` (into the output layer's or, tied, the
    /// embedding's gradient).
    pub fn backward_weight<B: Backend>(
        &self,
        b: &B,
        wgrad: HeadWgrad<B>,
        dw: SliceMut<'_, B>,
    ) -> Result<()> {
        check_len(
            "head",
            "dw",
            b.slice_len(b.as_slice(&dw)),
            self.vocab * self.hidden,
        )?;
        b.matmul(
            b.view(&wgrad.d_logits)?,
            b.view(&wgrad.hidden_states)?,
            dw,
            MatmulDims::linear_weight_grad(wgrad.rows, self.hidden, self.vocab),
        )
    }
}

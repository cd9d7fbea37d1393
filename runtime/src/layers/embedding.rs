//! The token embedding (`embedding.word_embeddings.weight`, `[V, h]` with V
//! padded to a multiple of 128): a row gather, and a scatter-add backward in
//! row order.

use super::{check_len, positive};
use crate::backend::{Backend, LookupDims, Slice, SliceMut};
use crate::error::Result;
use hybridgen_dsl::ModelConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding {
    vocab: usize,
    hidden: usize,
}

impl Embedding {
    /// The embedding of `config`: `padded_vocab_size() x hidden_size`.
    pub fn new(config: &ModelConfig) -> Result<Self> {
        Ok(Embedding {
            vocab: positive("the vocabulary size", config.padded_vocab_size())?,
            hidden: positive("hidden_size", config.hidden_size)?,
        })
    }

    /// Rows of the table (the padded vocabulary).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    fn dims(&self) -> LookupDims {
        LookupDims {
            vocab: self.vocab,
            hidden: self.hidden,
        }
    }

    /// `out[r] = table[ids[r]]`: `ids` is a u32 device view of `rows` token
    /// ids, `out` `[rows, h]`.
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        table: Slice<'_, B>,
        ids: Slice<'_, B>,
        out: SliceMut<'_, B>,
    ) -> Result<()> {
        check_len(
            "embedding",
            "out",
            b.slice_len(b.as_slice(&out)),
            b.slice_len(ids) * self.hidden,
        )?;
        b.embedding_forward(table, ids, out, self.dims())
    }

    /// `dtable[ids[r]] += dout[r]` in row order (accumulates over calls).
    pub fn backward<B: Backend>(
        &self,
        b: &B,
        dout: Slice<'_, B>,
        ids: Slice<'_, B>,
        dtable: SliceMut<'_, B>,
    ) -> Result<()> {
        check_len(
            "embedding backward",
            "dout",
            b.slice_len(dout),
            b.slice_len(ids) * self.hidden,
        )?;
        b.embedding_backward(dout, ids, dtable, self.dims())
    }
}

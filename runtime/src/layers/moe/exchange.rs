//! The all-to-alls around the experts: an [`ExpertExchange`] moves counts
//! (host values: the all-to-all's sizes) and rows (device buffers, taken by
//! value). A [`LocalExchange`] serves expert parallelism 1 (the rows stay
//! where they are: no copy); a [`CollectiveExchange`] runs over an
//! expert-parallel communicator.

use crate::backend::Backend;
use crate::collective::Collective;
use crate::error::{Result, RuntimeError};
use crate::layers::check_len;

/// Rows sent to and received from each EP rank by one micro-batch.
pub(super) struct ExchangeRows {
    pub send: Vec<usize>,
    pub recv: Vec<usize>,
}

/// The all-to-alls around the experts, as the staged calls need them.
pub trait ExpertExchange<B: Backend> {
    /// `send[j]`: rows this rank sends to rank j, per local expert of rank j.
    /// Returns, per source rank i, the rows it sends here per local expert.
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>>;

    /// Sends `send_rows[j]` rows (of `width`) to rank j, in rank order, and
    /// returns the `recv_rows[i]` rows received from each rank i, in rank
    /// order. Takes the send buffer: an exchange within one rank hands it
    /// back as the received rows.
    fn exchange_rows(
        &self,
        b: &B,
        send: B::Buf,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<B::Buf>;
}

/// The exchange of expert parallelism 1: every expert is local, so the rows
/// stay where they are.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExchange;

impl<B: Backend> ExpertExchange<B> for LocalExchange {
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        if send.len() != 1 {
            return Err(RuntimeError::InvalidArgument(format!(
                "the local expert exchange serves expert parallelism 1, not {}; use a \
                 CollectiveExchange (or the staged calls) under expert parallelism",
                send.len()
            )));
        }
        Ok(send.to_vec())
    }

    fn exchange_rows(
        &self,
        b: &B,
        send: B::Buf,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<B::Buf> {
        if send_rows != recv_rows || send_rows.len() != 1 {
            return Err(RuntimeError::InvalidArgument(format!(
                "local expert exchange: sending {send_rows:?} rows but receiving {recv_rows:?}"
            )));
        }
        check_len(
            "local expert exchange",
            "send",
            b.buf_len(&send),
            send_rows[0] * width,
        )?;
        Ok(send)
    }
}

/// The exchange over an expert-parallel communicator: counts with
/// [`Collective::all_to_all_counts`], rows with [`Collective::all_to_all`].
pub struct CollectiveExchange<'c, C> {
    pub collective: &'c C,
}

impl<B: Backend, C: Collective<B>> ExpertExchange<B> for CollectiveExchange<'_, C> {
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        self.collective.all_to_all_counts(send)
    }

    fn exchange_rows(
        &self,
        b: &B,
        send: B::Buf,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<B::Buf> {
        // A group of one sends its rows to itself: they are already where
        // they would be received (the all-to-all would be a 64 MiB copy a
        // layer and pass for the benchmark model).
        if self.collective.size() == 1 {
            return LocalExchange.exchange_rows(b, send, send_rows, recv_rows, width);
        }
        let send_counts: Vec<usize> = send_rows.iter().map(|r| r * width).collect();
        let recv_counts: Vec<usize> = recv_rows.iter().map(|r| r * width).collect();
        // The all-to-all writes every received row.
        let recv = b.alloc_uninit(recv_counts.iter().sum(), b.compute_dtype())?;
        self.collective.all_to_all(
            b.view(&send)?,
            &send_counts,
            b.view_mut(&recv)?,
            &recv_counts,
        )?;
        Ok(recv)
    }
}

//! The training stream's micro-batches, made ahead on a thread of their own.
//!
//! Making a micro-batch's tokens takes the host about a millisecond (a
//! Markov walk, or reads from an indexed corpus). The schedule's executor
//! asks for each one when it first issues work for it, in the middle of
//! the step, and while it made them it issued nothing else: on an H200 the
//! GPU sat idle 70-190 µs at each `E` layer of the first micro-batch,
//! waiting for the expert work the executor had not submitted yet, and
//! for most of a millisecond at the start of every step. Here a loader
//! thread walks the stream in order, `(step, micro-batch)` by
//! `(step, micro-batch)`, a few micro-batches ahead: the executor takes
//! finished ones. The stream is the one the executor would make itself
//! (each micro-batch is a function of its [`BatchKey`]), so the bits of a
//! run do not change.

use crate::data::{Batch, BatchKey, BatchShape, DataSource};
use crate::error::{Result, RuntimeError};
use crate::schedule::MicroBatchTokens;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// Micro-batches the loader makes ahead of the executor: enough that one
/// is always ready, few enough that host memory does not grow with the
/// number of micro-batches.
const AHEAD: usize = 2;

/// Which micro-batches a loader makes: every micro-batch of steps
/// `first_step..end_step` of one data-parallel rank's stream.
#[derive(Clone, Copy, Debug)]
pub struct StreamRange {
    pub seed: u64,
    pub dp_rank: usize,
    pub first_step: u64,
    pub end_step: u64,
    pub micro_batches: usize,
}

impl StreamRange {
    fn keys(self) -> impl Iterator<Item = BatchKey> {
        (self.first_step..self.end_step).flat_map(move |step| {
            (0..self.micro_batches).map(move |micro_batch| BatchKey {
                seed: self.seed,
                step,
                dp_rank: self.dp_rank,
                micro_batch,
            })
        })
    }
}

/// A thread making a rank's training micro-batches in stream order.
pub struct MicroBatchLoader {
    made: Option<Receiver<(BatchKey, Result<MicroBatchTokens>)>>,
    worker: Option<JoinHandle<()>>,
}

impl MicroBatchLoader {
    /// Starts the thread on `range` of `data`'s stream, in batches of
    /// `shape`, with `depths` MTP depths.
    pub fn start(
        data: DataSource,
        shape: BatchShape,
        depths: usize,
        range: StreamRange,
    ) -> Result<MicroBatchLoader> {
        let (send, made) = sync_channel(AHEAD);
        let worker = std::thread::Builder::new()
            .name(format!("data loader, rank {}", range.dp_rank))
            .spawn(move || make_stream(&data, shape, depths, range, &send))
            .map_err(|e| {
                RuntimeError::Unsupported(format!("cannot start the data loader thread: {e}"))
            })?;
        Ok(MicroBatchLoader {
            made: Some(made),
            worker: Some(worker),
        })
    }

    /// The next micro-batch of the stream, which must be `key`'s: the
    /// executor asks for them in order.
    pub fn next(&self, key: BatchKey) -> Result<MicroBatchTokens> {
        let stopped = || {
            RuntimeError::InvalidArgument(format!(
                "the data loader stopped before step {} micro-batch {} (it panicked, or the run \
                 asked for more steps than it was started for)",
                key.step, key.micro_batch
            ))
        };
        let (made_key, tokens) = self
            .made
            .as_ref()
            .ok_or_else(stopped)?
            .recv()
            .map_err(|_| stopped())?;
        if made_key != key {
            return Err(RuntimeError::InvalidArgument(format!(
                "asked the data loader for step {} micro-batch {}, but its next is step {} \
                 micro-batch {}: micro-batches must be taken in stream order",
                key.step, key.micro_batch, made_key.step, made_key.micro_batch
            )));
        }
        tokens
    }
}

impl Drop for MicroBatchLoader {
    fn drop(&mut self) {
        // The thread's next send fails once the receiver is gone, and it
        // returns.
        self.made = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The loader thread: makes `range`'s micro-batches in order until the
/// range ends, the receiver goes away or one fails (the failure is sent).
fn make_stream(
    data: &DataSource,
    shape: BatchShape,
    depths: usize,
    range: StreamRange,
    send: &SyncSender<(BatchKey, Result<MicroBatchTokens>)>,
) {
    for key in range.keys() {
        let tokens = data
            .batch(key, shape)
            .map(|batch| micro_batch_tokens(&batch, depths));
        let failed = tokens.is_err();
        if send.send((key, tokens)).is_err() || failed {
            return;
        }
    }
}

/// A micro-batch's inputs and targets (and MTP inputs) from its batch.
/// Head 0's tokens (the next token), and for MTP depth k the inputs and
/// targets rolled by k inside the sample, the last k positions masked.
pub(crate) fn micro_batch_tokens(batch: &Batch, depths: usize) -> MicroBatchTokens {
    MicroBatchTokens {
        inputs: batch.mtp_inputs(0),
        targets: (0..=depths).map(|k| batch.mtp_targets(k)).collect(),
        mtp_inputs: (1..=depths).map(|k| batch.mtp_inputs(k)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::MarkovChain;

    fn range(first_step: u64, end_step: u64) -> StreamRange {
        StreamRange {
            seed: 7,
            dp_rank: 1,
            first_step,
            end_step,
            micro_batches: 3,
        }
    }

    fn shape() -> BatchShape {
        BatchShape { batch: 2, seq: 16 }
    }

    fn markov() -> DataSource {
        DataSource::Markov(MarkovChain::random(64, 3, 5).unwrap())
    }

    fn made_here(data: &DataSource, key: BatchKey) -> MicroBatchTokens {
        micro_batch_tokens(&data.batch(key, shape()).unwrap(), 1)
    }

    /// The loader's micro-batches are the ones the executor would make,
    /// in stream order, from any first step.
    #[test]
    fn the_loader_makes_the_stream_in_order() {
        let data = markov();
        let loader = MicroBatchLoader::start(data.clone(), shape(), 1, range(2, 5)).unwrap();
        for key in range(2, 5).keys() {
            let got = loader.next(key).unwrap();
            let want = made_here(&data, key);
            assert_eq!(got.inputs, want.inputs, "{key:?}");
            assert_eq!(got.targets, want.targets, "{key:?}");
            assert_eq!(got.mtp_inputs, want.mtp_inputs, "{key:?}");
        }
        let past = BatchKey {
            step: 5,
            ..range(2, 5).keys().next().unwrap()
        };
        let error = loader.next(past).unwrap_err().to_string();
        assert!(error.contains("stopped before step 5"), "{error}");
    }

    #[test]
    fn a_micro_batch_out_of_order_is_refused_naming_both() {
        let loader = MicroBatchLoader::start(markov(), shape(), 0, range(0, 2)).unwrap();
        let second = range(0, 2).keys().nth(1).unwrap();
        let error = loader.next(second).unwrap_err().to_string();
        assert!(
            error.contains("step 0 micro-batch 1") && error.contains("step 0 micro-batch 0"),
            "{error}"
        );
    }

    /// Dropped while its thread waits to hand over a micro-batch, a loader
    /// stops the thread (the test would hang otherwise).
    #[test]
    fn a_loader_dropped_early_stops_its_thread() {
        let loader = MicroBatchLoader::start(markov(), shape(), 0, range(0, 1000)).unwrap();
        loader.next(range(0, 1000).keys().next().unwrap()).unwrap();
        drop(loader);
    }
}

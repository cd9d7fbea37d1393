//! Training data: a synthetic stream with a known entropy floor, or a file
//! read as bytes.
//!
//! - [`MarkovChain`]: a seeded sparse Markov chain over the vocabulary. Each
//!   token has a few successors with fixed probabilities; its entropy rate
//!   (computed exactly from the stationary distribution) is the lowest loss
//!   any model can reach, so "the loss went down to X" can be compared with
//!   [`MarkovChain::entropy_floor`]. Windows start in the stationary
//!   distribution, so every position of every window has that floor.
//! - [`ByteFile`]: a file's bytes as tokens 0..256.
//! - [`IndexedSource`]: Megatron's indexed datasets ([`indexed`]), one or a
//!   weighted blend, split into train and validation parts and cut into
//!   samples as Megatron's GPT dataset does ([`gpt`]).
//!
//! A [`Batch`] is a function of (seed, step, data-parallel rank, micro-batch)
//! alone ([`BatchKey`]): resuming at step k reproduces exactly the batches
//! of an uninterrupted run, and every rank sees different data. Each row is
//! a sample of `seq + 1` tokens: inputs and next-token targets.
//! Multi-token prediction reads inside the sample, as Megatron rolls it
//! ([`Batch::mtp_inputs`], [`Batch::mtp_targets`]).
//!
//! Evaluation batches ([`DataSource::eval_batch`]) are a fixed set: the
//! validation part of indexed data, or for the other sources batches of
//! their own stream under a seed training never uses.
//!
//! Modules: `markov` ([`MarkovChain`]), `bytes` ([`ByteFile`]), `source`
//! ([`DataSource`] and [`IndexedSource`]: the sources as a run reads them),
//! [`indexed`] (the dataset files) and [`gpt`] (samples, splits and
//! blends).

mod bytes;
pub mod gpt;
pub mod indexed;
mod markov;
mod source;
#[cfg(test)]
mod tests;

pub use bytes::{BYTE_VOCAB, ByteFile};
pub use gpt::{Blend, GptPart, IndexedSpec, Split};
pub use indexed::{IndexedDataset, IndexedWriter, TokenDtype};
pub use markov::MarkovChain;
pub use source::{DataSource, IndexedSource, SampleLayout, UPFRONT_TOKEN_SCAN};

use crate::backend::{IGNORE_TARGET, Tokens};
use crate::error::{Result, RuntimeError};
use bytes::open_regular;
use std::path::PathBuf;

/// Where a run's tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataChoice {
    /// A seeded sparse Markov chain over the model's vocabulary, with a
    /// known entropy floor ([`MarkovChain`]).
    Synthetic,
    /// A file read as bytes (tokens 0..256, [`ByteFile`]).
    File(PathBuf),
    /// Megatron indexed datasets, split into parts ([`IndexedSource`]).
    Indexed(IndexedSpec),
}

// ---- random numbers -----------------------------------------------------

/// SplitMix64: turns any 64-bit seed into well-mixed state (Steele, Lea,
/// Flood 2014). Used to seed [`Xoshiro256`] and to hash batch keys.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }
}

/// SplitMix64's output function: a bijection on u64 with good avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** (Blackman, Vigna 2018): a small, fast generator with a
/// 2^256 - 1 period; the same seed gives the same numbers on every machine.
#[derive(Clone, Debug)]
pub struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut sm = SplitMix64::new(seed);
        let s = [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()];
        // SplitMix64 never yields four zeros in a row, the one bad state.
        Xoshiro256 { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n) without modulo bias (Lemire's method); 0 for n = 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let threshold = n.wrapping_neg() % n;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(n);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }
}

// ---- batches ------------------------------------------------------------

/// Everything a batch depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchKey {
    pub seed: u64,
    /// The optimizer step (0-based).
    pub step: u64,
    /// This rank's index in the data-parallel group.
    pub dp_rank: usize,
    /// The micro-batch within the step.
    pub micro_batch: usize,
}

impl BatchKey {
    /// The seed of row `row` of this batch: each row has its own stream, so
    /// rows do not depend on one another or on the batch size before them.
    fn row_seed(&self, row: usize) -> u64 {
        let mut h = mix64(self.seed ^ 0x6879_6272_6964_6765); // "hybridge"
        for part in [
            self.step,
            self.dp_rank as u64,
            self.micro_batch as u64,
            row as u64,
        ] {
            h = mix64(h.wrapping_add(0x9E37_79B9_7F4A_7C15) ^ part);
        }
        h
    }
}

/// The shape of a batch: `batch` samples of `seq` inputs (and `seq + 1`
/// tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchShape {
    pub batch: usize,
    pub seq: usize,
}

impl BatchShape {
    pub fn new(batch: usize, seq: usize) -> Self {
        BatchShape { batch, seq }
    }

    /// Tokens per row: `seq + 1`.
    pub fn window(&self) -> usize {
        self.seq + 1
    }

    fn validate(&self) -> Result<usize> {
        if self.batch == 0 || self.seq == 0 {
            return Err(RuntimeError::InvalidArgument(format!(
                "a batch needs at least one row and one position (got batch {} x seq {})",
                self.batch, self.seq
            )));
        }
        self.seq
            .checked_add(1)
            .and_then(|w| w.checked_mul(self.batch))
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "a batch of {} x ({} + 1) tokens does not fit in memory",
                    self.batch, self.seq
                ))
            })
    }
}

/// `batch` token windows, row-major (`[batch, seq + 1]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    shape: BatchShape,
    tokens: Vec<u32>,
}

impl Batch {
    pub fn shape(&self) -> BatchShape {
        self.shape
    }

    /// The rows the inputs and targets fill: `batch` sequences of `seq`.
    pub fn dims(&self) -> Tokens {
        Tokens::new(self.shape.batch, self.shape.seq)
    }

    /// All windows, row after row.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn row(&self, row: usize) -> Result<&[u32]> {
        let w = self.shape.window();
        self.tokens.get(row * w..(row + 1) * w).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "row {row} is out of range for a batch of {} rows",
                self.shape.batch
            ))
        })
    }

    /// The `seq` input tokens of `row`.
    pub fn inputs(&self, row: usize) -> Result<&[u32]> {
        Ok(&self.row(row)?[..self.shape.seq])
    }

    /// The `seq` next-token targets of `row`.
    pub fn targets(&self, row: usize) -> Result<&[u32]> {
        Ok(&self.row(row)?[1..1 + self.shape.seq])
    }

    /// Depth `k`'s inputs, every row concatenated (`[batch * seq]`, token
    /// `t` of row `b` at `b * seq + t`, the layout of [`Tokens`]). Depth 0
    /// is the model's own; for MTP depth `k` Megatron rolls the inputs left
    /// by one per depth, so position `t` reads token `t + k` of the sample's
    /// inputs, and the positions past them read 0 (their targets are
    /// masked).
    pub fn mtp_inputs(&self, k: usize) -> Vec<u32> {
        let seq = self.shape.seq;
        self.tokens
            .chunks_exact(self.shape.window())
            .flat_map(|w| (0..seq).map(move |t| if t + k < seq { w[t + k] } else { 0 }))
            .collect()
    }

    /// Depth `k`'s targets, every row concatenated: token `t + k + 1` of the
    /// sample (depth 0: the next token), [`IGNORE_TARGET`] for the last `k`
    /// positions, whose label would lie past the sample (Megatron's rolled
    /// loss mask), so depth k's loss is the mean over `seq - k` positions.
    pub fn mtp_targets(&self, k: usize) -> Vec<u32> {
        let seq = self.shape.seq;
        self.tokens
            .chunks_exact(self.shape.window())
            .flat_map(|w| {
                (0..seq).map(move |t| {
                    if t + k < seq {
                        w[t + k + 1]
                    } else {
                        IGNORE_TARGET
                    }
                })
            })
            .collect()
    }
}

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

pub mod gpt;
pub mod indexed;

pub use gpt::{Blend, GptPart, IndexedSpec, Split};
pub use indexed::{IndexedDataset, IndexedWriter, TokenDtype};

use crate::backend::{IGNORE_TARGET, Tokens};
use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

// ---- the Markov chain ---------------------------------------------------

/// A sparse Markov chain over tokens `0..vocab` with an exactly known
/// entropy rate.
#[derive(Clone, Debug)]
pub struct MarkovChain {
    vocab: usize,
    /// Row `t`'s successors are `next[offsets[t]..offsets[t + 1]]`.
    offsets: Vec<usize>,
    next: Vec<u32>,
    prob: Vec<f64>,
    /// Running sums of `prob` within each row, for sampling.
    cumulative: Vec<f64>,
    stationary: Vec<f64>,
    stationary_cumulative: Vec<f64>,
    entropy_rate: f64,
}

/// Power iteration stops when successive distributions differ by less than
/// this in L1 norm.
const STATIONARY_TOLERANCE: f64 = 1e-13;
const STATIONARY_MAX_ITERATIONS: usize = 100_000;

impl MarkovChain {
    /// A random chain: every token gets `branching` distinct successors
    /// (one of them always the next token id, so every token is reachable
    /// from every other) with fixed, decreasing-on-average probabilities.
    pub fn random(vocab: usize, branching: usize, seed: u64) -> Result<Self> {
        if vocab < 2 || vocab > u32::MAX as usize {
            return Err(RuntimeError::InvalidArgument(format!(
                "a synthetic Markov stream needs a vocabulary of 2 to {} tokens (got {vocab})",
                u32::MAX
            )));
        }
        if branching == 0 || branching > vocab {
            return Err(RuntimeError::InvalidArgument(format!(
                "each token needs 1 to {vocab} successors (the vocabulary size); got \
                 branching {branching}"
            )));
        }
        let mut rng = Xoshiro256::seed_from_u64(seed ^ 0x6d61_726b_6f76); // "markov"
        let mut rows = Vec::with_capacity(vocab);
        for token in 0..vocab {
            let mut successors = vec![((token + 1) % vocab) as u32];
            while successors.len() < branching {
                let candidate = rng.below(vocab as u64) as u32;
                if !successors.contains(&candidate) {
                    successors.push(candidate);
                }
            }
            // Shuffle so the ring successor is not always the likeliest.
            for i in (1..successors.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                successors.swap(i, j);
            }
            let weights: Vec<f64> = (0..branching)
                .map(|j| (0.5 + rng.next_f64()) / (j + 1) as f64)
                .collect();
            let total: f64 = weights.iter().sum();
            rows.push(
                successors
                    .into_iter()
                    .zip(weights)
                    .map(|(s, w)| (s, w / total))
                    .collect(),
            );
        }
        Self::from_transitions(rows)
    }

    /// A chain from explicit transition rows: `rows[t]` lists `(successor,
    /// probability)` pairs of token `t`, summing to 1. The chain must be
    /// irreducible (every token reachable from every other), so that its
    /// stationary distribution and entropy rate are unique.
    pub fn from_transitions(rows: Vec<Vec<(u32, f64)>>) -> Result<Self> {
        let vocab = rows.len();
        if vocab == 0 {
            return Err(RuntimeError::InvalidArgument(
                "a Markov chain needs at least one token".into(),
            ));
        }
        let mut offsets = Vec::with_capacity(vocab + 1);
        let mut next = Vec::new();
        let mut prob = Vec::new();
        let mut cumulative = Vec::new();
        offsets.push(0);
        for (token, row) in rows.iter().enumerate() {
            let mut sum = 0.0;
            for (i, &(succ, p)) in row.iter().enumerate() {
                if succ as usize >= vocab {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "token {token} has successor {succ}, outside the vocabulary of {vocab}"
                    )));
                }
                if !p.is_finite() || p <= 0.0 {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "token {token} -> {succ} has probability {p}; give only successors \
                         with probabilities above 0"
                    )));
                }
                if row[..i].iter().any(|(s, _)| *s == succ) {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "token {token} lists successor {succ} twice"
                    )));
                }
                sum += p;
                next.push(succ);
                prob.push(p);
                cumulative.push(sum);
            }
            if row.is_empty() || (sum - 1.0).abs() > 1e-9 {
                return Err(RuntimeError::InvalidArgument(format!(
                    "the probabilities of token {token}'s successors add up to {sum}, not 1"
                )));
            }
            // Guard sampling against rounding: the last successor takes
            // whatever is left.
            if let Some(last) = cumulative.last_mut() {
                *last = f64::INFINITY;
            }
            offsets.push(next.len());
        }
        let mut chain = MarkovChain {
            vocab,
            offsets,
            next,
            prob,
            cumulative,
            stationary: Vec::new(),
            stationary_cumulative: Vec::new(),
            entropy_rate: 0.0,
        };
        chain.check_irreducible()?;
        chain.stationary = chain.stationary_distribution()?;
        let mut running = 0.0;
        chain.stationary_cumulative = chain
            .stationary
            .iter()
            .map(|p| {
                running += p;
                running
            })
            .collect();
        if let Some(last) = chain.stationary_cumulative.last_mut() {
            *last = f64::INFINITY;
        }
        chain.entropy_rate = (0..vocab)
            .map(|t| {
                let row: f64 = chain.row(t).map(|(_, p)| -p * p.ln()).sum();
                chain.stationary[t] * row
            })
            .sum();
        Ok(chain)
    }

    fn row(&self, token: usize) -> impl Iterator<Item = (u32, f64)> + '_ {
        let range = self.offsets[token]..self.offsets[token + 1];
        self.next[range.clone()]
            .iter()
            .copied()
            .zip(self.prob[range].iter().copied())
    }

    /// Fails unless every token reaches token 0 and token 0 reaches every
    /// token (then every token reaches every other).
    fn check_irreducible(&self) -> Result<()> {
        let mut reverse = vec![Vec::new(); self.vocab];
        for t in 0..self.vocab {
            for (s, _) in self.row(t) {
                reverse[s as usize].push(t as u32);
            }
        }
        for (direction, edges) in [("reached from", None), ("reach", Some(&reverse))] {
            let mut seen = vec![false; self.vocab];
            let mut stack = vec![0usize];
            seen[0] = true;
            while let Some(t) = stack.pop() {
                let neighbours: Vec<u32> = match edges {
                    None => self.row(t).map(|(s, _)| s).collect(),
                    Some(reverse) => reverse[t].clone(),
                };
                for s in neighbours {
                    if !seen[s as usize] {
                        seen[s as usize] = true;
                        stack.push(s as usize);
                    }
                }
            }
            if let Some(token) = seen.iter().position(|s| !s) {
                return Err(RuntimeError::InvalidArgument(format!(
                    "the Markov chain is not irreducible: token {token} cannot {direction} \
                     token 0, so its entropy rate depends on where it starts"
                )));
            }
        }
        Ok(())
    }

    /// The stationary distribution by power iteration on the lazy chain
    /// `(I + P) / 2`, which has the same stationary distribution as `P` but
    /// converges even when `P` is periodic. Starts from uniform, which is
    /// already stationary for doubly stochastic chains.
    fn stationary_distribution(&self) -> Result<Vec<f64>> {
        let mut pi = vec![1.0 / self.vocab as f64; self.vocab];
        let mut next = vec![0.0; self.vocab];
        let mut change = f64::INFINITY;
        for _ in 0..STATIONARY_MAX_ITERATIONS {
            for (n, p) in next.iter_mut().zip(&pi) {
                *n = 0.5 * p;
            }
            for (t, &mass) in pi.iter().enumerate() {
                for (s, p) in self.row(t) {
                    next[s as usize] += 0.5 * mass * p;
                }
            }
            let total: f64 = next.iter().sum();
            change = 0.0;
            for (p, n) in pi.iter_mut().zip(&next) {
                let v = n / total;
                change += (v - *p).abs();
                *p = v;
            }
            if change < STATIONARY_TOLERANCE {
                return Ok(pi);
            }
        }
        Err(RuntimeError::Numeric(format!(
            "the stationary distribution of the {}-token Markov chain did not converge in \
             {STATIONARY_MAX_ITERATIONS} iterations (last change {change:e}); give tokens more \
             successors",
            self.vocab
        )))
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The chain's entropy rate `-sum_i pi_i sum_j P_ij ln P_ij` in nats
    /// per token: the expected loss of the best possible model.
    pub fn entropy_floor(&self) -> f64 {
        self.entropy_rate
    }

    pub fn stationary(&self) -> &[f64] {
        &self.stationary
    }

    /// Token `token`'s successors and their probabilities.
    pub fn successors(&self, token: u32) -> Vec<(u32, f64)> {
        if (token as usize) < self.vocab {
            self.row(token as usize).collect()
        } else {
            Vec::new()
        }
    }

    fn sample_next(&self, token: u32, rng: &mut Xoshiro256) -> u32 {
        let range = self.offsets[token as usize]..self.offsets[token as usize + 1];
        let u = rng.next_f64();
        let i = self.cumulative[range.clone()].partition_point(|c| *c <= u);
        self.next[range.start + i]
    }

    /// Fills `out` with a walk that starts in the stationary distribution.
    fn sample_window(&self, rng: &mut Xoshiro256, out: &mut [u32]) {
        let u = rng.next_f64();
        let mut token = self.stationary_cumulative.partition_point(|c| *c <= u) as u32;
        for slot in out {
            *slot = token;
            token = self.sample_next(token, rng);
        }
    }
}

// ---- a file of bytes ----------------------------------------------------

/// A file's bytes as tokens 0..256; windows start at random offsets.
///
/// A file is never loaded whole: each window is read where it lies with one
/// positioned read (`pread`), so a corpus of any size trains in the memory
/// of one batch, and the page cache, not this process, keeps what is hot.
/// Positioned reads rather than a memory map: no `unsafe` (a mapped file
/// truncated by another process is undefined behaviour, a short read is an
/// error), no dependency, and the same bytes.
#[derive(Clone, Debug)]
pub struct ByteFile {
    name: String,
    bytes: ByteStore,
}

/// Where a [`ByteFile`]'s bytes are.
#[derive(Clone, Debug)]
enum ByteStore {
    /// Bytes handed over in memory ([`ByteFile::from_bytes`]).
    Memory(Arc<[u8]>),
    /// An open regular file and its length when it was opened.
    File { file: Arc<std::fs::File>, len: u64 },
}

/// Tokens a byte file produces.
pub const BYTE_VOCAB: usize = 256;

/// Opens `path` as a regular file, refusing directories, FIFOs and devices
/// by name (`hint` follows the refusal): `metadata` follows symlinks and
/// never opens, so a FIFO cannot block it, and the opened file is checked
/// again in case the path was replaced between the two calls.
pub(crate) fn open_regular(path: &Path, hint: &str) -> Result<(std::fs::File, std::fs::Metadata)> {
    let name = path.display().to_string();
    let not_a_file = |meta: &std::fs::Metadata| {
        RuntimeError::io(
            &name,
            format!(
                "this is {}, not a data file{hint}",
                kind_of(&meta.file_type())
            ),
        )
    };
    let meta = std::fs::metadata(path).map_err(|e| RuntimeError::io(&name, e))?;
    if !meta.is_file() {
        return Err(not_a_file(&meta));
    }
    let file = std::fs::File::open(path).map_err(|e| RuntimeError::io(&name, e))?;
    let meta = file.metadata().map_err(|e| RuntimeError::io(&name, e))?;
    if !meta.is_file() {
        return Err(not_a_file(&meta));
    }
    Ok((file, meta))
}

/// What `metadata` says a path is, for refusing what is not a data file.
fn kind_of(file_type: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if file_type.is_char_device() {
            return "a character device";
        }
        if file_type.is_block_device() {
            return "a block device";
        }
        if file_type.is_socket() {
            return "a socket";
        }
    }
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

impl ByteFile {
    /// Opens `path` for a model whose vocabulary has `vocab` tokens. Only a
    /// regular, non-empty file is accepted: a FIFO or a device would block or
    /// never end, and is refused by name before it is opened (an empty
    /// path by its setting's name, as `spelling` spells it).
    pub fn open(path: &Path, vocab: usize, spelling: SettingSpelling) -> Result<Self> {
        let name = path.display().to_string();
        if path.as_os_str().is_empty() {
            return Err(RuntimeError::io(
                spelling.name(Setting::Data),
                "the path is empty; give a file to train on, or `synthetic`",
            ));
        }
        Self::check_vocab(&name, vocab)?;
        let (file, meta) = open_regular(path, "; give a regular file of text")?;
        if meta.len() == 0 {
            return Err(RuntimeError::io(
                &name,
                "the file is empty; give a text file to train on",
            ));
        }
        Ok(ByteFile {
            name,
            bytes: ByteStore::File {
                file: Arc::new(file),
                len: meta.len(),
            },
        })
    }

    /// Bytes already in memory; `name` is used in messages.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>, vocab: usize) -> Result<Self> {
        let name = name.into();
        Self::check_vocab(&name, vocab)?;
        if bytes.is_empty() {
            return Err(RuntimeError::io(
                &name,
                "the file is empty; give a text file to train on",
            ));
        }
        Ok(ByteFile {
            name,
            bytes: ByteStore::Memory(bytes.into()),
        })
    }

    fn check_vocab(name: &str, vocab: usize) -> Result<()> {
        if vocab < BYTE_VOCAB {
            return Err(RuntimeError::InvalidArgument(format!(
                "{name}: a file is read as bytes (tokens 0..256), but the model's vocabulary \
                 has only {vocab} tokens; use vocab_size >= 256"
            )));
        }
        Ok(())
    }

    /// The file's length in bytes (saturating on 32-bit targets).
    pub fn len(&self) -> usize {
        match &self.bytes {
            ByteStore::Memory(bytes) => bytes.len(),
            ByteStore::File { len, .. } => usize::try_from(*len).unwrap_or(usize::MAX),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `out` with the window at a random offset (the file holds at
    /// least `out.len()` bytes: [`DataSource::check_shape`]).
    fn sample_window(&self, rng: &mut Xoshiro256, out: &mut [u32]) -> Result<()> {
        let starts = (self.len() - out.len() + 1) as u64;
        let start = rng.below(starts);
        match &self.bytes {
            ByteStore::Memory(bytes) => {
                for (t, b) in out.iter_mut().zip(&bytes[start as usize..]) {
                    *t = u32::from(*b);
                }
            }
            ByteStore::File { file, .. } => {
                let mut window = vec![0u8; out.len()];
                read_exact_at(file, &mut window, start).map_err(|e| {
                    let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                        "the file shrank while training (was it overwritten?)".to_string()
                    } else {
                        e.to_string()
                    };
                    RuntimeError::io(
                        &self.name,
                        format!("cannot read {} bytes at offset {start}: {why}", out.len()),
                    )
                })?;
                for (t, b) in out.iter_mut().zip(&window) {
                    *t = u32::from(*b);
                }
            }
        }
        Ok(())
    }
}

/// `buf.len()` bytes of `file` from `offset`, without moving a shared cursor
/// (ranks read one file concurrently).
#[cfg(unix)]
fn read_exact_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(file: &std::fs::File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ---- the source ---------------------------------------------------------

/// Where training tokens come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    Markov(MarkovChain),
    Bytes(ByteFile),
    Indexed(Arc<IndexedSource>),
}

impl DataSource {
    /// Tokens produced lie in `0..vocab()`.
    pub fn vocab(&self) -> usize {
        match self {
            DataSource::Markov(chain) => chain.vocab(),
            DataSource::Bytes(_) => BYTE_VOCAB,
            DataSource::Indexed(source) => source.vocab,
        }
    }

    /// The lowest achievable loss in nats per token, when known.
    pub fn entropy_floor(&self) -> Option<f64> {
        match self {
            DataSource::Markov(chain) => Some(chain.entropy_floor()),
            DataSource::Bytes(_) | DataSource::Indexed(_) => None,
        }
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        match self {
            DataSource::Markov(chain) => format!(
                "synthetic Markov stream over {} tokens (entropy floor {:.4} nats/token)",
                chain.vocab(),
                chain.entropy_floor()
            ),
            DataSource::Bytes(file) => format!("{} ({} bytes)", file.name, file.len()),
            DataSource::Indexed(source) => source.description.clone(),
        }
    }

    /// Checks that batches of `shape` can be made (call it while validating
    /// the configuration, before any device memory is touched); returns the
    /// tokens per batch.
    pub fn check_shape(&self, shape: BatchShape) -> Result<usize> {
        let total = shape.validate()?;
        let window = shape.window();
        if let DataSource::Bytes(file) = self
            && file.len() < window
        {
            return Err(RuntimeError::io(
                &file.name,
                format!(
                    "the file has {} bytes but one training window needs {window} (seq {} + 1 \
                     target); use a longer file or a shorter sequence",
                    file.len(),
                    shape.seq,
                ),
            ));
        }
        if let DataSource::Indexed(source) = self
            && shape.seq != source.seq
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "the indexed data was cut into samples of {} + 1 tokens, not {} + 1",
                source.seq, shape.seq
            )));
        }
        Ok(total)
    }

    /// The batch for `key`: the same key always gives the same tokens.
    pub fn batch(&self, key: BatchKey, shape: BatchShape) -> Result<Batch> {
        let total = self.check_shape(shape)?;
        let window = shape.window();
        let mut tokens = vec![0u32; total];
        for (row, out) in tokens.chunks_exact_mut(window).enumerate() {
            let mut rng = Xoshiro256::seed_from_u64(key.row_seed(row));
            match self {
                DataSource::Markov(chain) => chain.sample_window(&mut rng, out),
                DataSource::Bytes(file) => file.sample_window(&mut rng, out)?,
                DataSource::Indexed(source) => {
                    let g = source.layout.sample(key, shape.batch, row);
                    source.train.sample(g, out)?;
                }
            }
        }
        Ok(Batch { shape, tokens })
    }

    /// Evaluation batch `k` (of the run's fixed set) of `dp_rank`'s
    /// `micro_batch`: the validation part of indexed data; for the other
    /// sources, batches of their stream under a seed no training batch
    /// uses. Fails for indexed data without a validation part.
    pub fn eval_batch(&self, key: BatchKey, shape: BatchShape) -> Result<Batch> {
        match self {
            DataSource::Indexed(source) => {
                let total = self.check_shape(shape)?;
                let validation = source.validation.as_ref().ok_or_else(|| {
                    RuntimeError::InvalidArgument(format!(
                        "{}: evaluation needs a validation part, and {} leaves none; \
                         give the second number of {} above 0 (e.g. 90,10,0)",
                        source.description,
                        source.spelling.given(Setting::Split, source.split.text()),
                        source.spelling.name(Setting::Split)
                    ))
                })?;
                let mut tokens = vec![0u32; total];
                for (row, out) in tokens.chunks_exact_mut(shape.window()).enumerate() {
                    validation.sample(source.layout.sample(key, shape.batch, row), out)?;
                }
                Ok(Batch { shape, tokens })
            }
            _ => self.batch(
                BatchKey {
                    seed: key.seed ^ EVAL_SEED,
                    ..key
                },
                shape,
            ),
        }
    }
}

/// Mixed into the seed of evaluation batches of the synthetic and byte
/// streams: "evaluate".
const EVAL_SEED: u64 = 0x6576_616c_7561_7465;

/// The most tokens a blend has for its ids to be scanned before the first
/// step (about 3 s at the 1.2 G tokens/s `cargo bench --bench indexed_data`
/// measures from the page cache). A larger corpus would spend minutes of
/// every start reading itself, so its samples check their ids as they are
/// read instead, with the same error.
pub const UPFRONT_TOKEN_SCAN: u64 = 4_000_000_000;

/// How a step's samples are spread over ranks and micro-batches, as
/// Megatron's pretraining sampler does: each micro-batch round takes the
/// next `ranks x micro_batch_size` samples, rank `r` its `r`-th slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleLayout {
    pub ranks: usize,
    pub micro_batches: usize,
}

impl SampleLayout {
    /// The global sample number of `row` of `key`'s micro-batch of `batch`
    /// rows.
    pub fn sample(&self, key: BatchKey, batch: usize, row: usize) -> u64 {
        let per_round = (self.ranks * batch) as u64;
        let per_step = per_round * self.micro_batches as u64;
        key.step * per_step
            + key.micro_batch as u64 * per_round
            + (key.dp_rank * batch + row) as u64
    }
}

/// Megatron indexed datasets as training data: the train parts of the
/// blend, and the validation parts when the split has one.
#[derive(Debug)]
pub struct IndexedSource {
    train: Blend,
    validation: Option<Blend>,
    split: Split,
    layout: SampleLayout,
    seq: usize,
    /// One more than the largest token id of the datasets (the model's
    /// vocabulary when they were too large to scan).
    vocab: usize,
    description: String,
    /// How refusals name the settings.
    spelling: SettingSpelling,
}

impl IndexedSource {
    /// Opens every dataset of `spec`, checks them (format, token ids within
    /// `vocab`, the split's parts), and cuts the train and validation parts
    /// into samples of `seq + 1` tokens shuffled with `seed`.
    /// `need_validation`: the run evaluates, so the validation part must
    /// not be empty. Token ids are checked by one scan before the run when
    /// the blend has at most `scan_limit` tokens (runs pass
    /// [`UPFRONT_TOKEN_SCAN`]), else as they are read. Refusals name the
    /// settings as `spelling` spells them.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        spec: &IndexedSpec,
        vocab: usize,
        seed: u64,
        shape: BatchShape,
        layout: SampleLayout,
        need_validation: bool,
        scan_limit: u64,
        spelling: SettingSpelling,
    ) -> Result<Self> {
        let seq = shape.seq;
        let mut trains = Vec::new();
        let mut validations = Vec::new();
        let mut largest = 0u64;
        let mut lines = Vec::new();
        let opened = spec
            .blend
            .iter()
            .map(|(_, prefix)| IndexedDataset::open(prefix))
            .collect::<Result<Vec<_>>>()?;
        let total: u64 = opened.iter().map(|d| d.tokens()).sum();
        let scan = total <= scan_limit;
        for (d, dataset) in opened.into_iter().enumerate() {
            if dataset.documents() == 0 || dataset.tokens() == 0 {
                return Err(RuntimeError::io(
                    dataset.idx_name(),
                    format!(
                        "the corpus is empty ({} documents, {} tokens); prepare it from a text \
                         with content (`hybridgen data prepare`)",
                        dataset.documents(),
                        dataset.tokens()
                    ),
                ));
            }
            let dataset = Arc::new(if scan {
                largest = largest.max(dataset.check_tokens(vocab)?);
                dataset
            } else {
                // Too many tokens to read before the first step: every
                // sample checks its own as it is read.
                largest = largest.max(vocab.saturating_sub(1) as u64);
                dataset.check_reads_against(vocab)
            });
            let ranges = spec.split.ranges(dataset.sequences());
            let weights = spec.split.weights();
            for (part, range) in ranges.iter().enumerate() {
                let needed = weights[part] > 0.0 || (part == 1 && need_validation);
                if range.is_empty() && needed {
                    let split = spelling.given(Setting::Split, spec.split.text());
                    let why = if weights[part] > 0.0 {
                        format!(
                            "{split} gives its {} part no documents of the {}",
                            gpt::PART_NAMES[part],
                            dataset.sequences()
                        )
                    } else {
                        format!(
                            "{} evaluates on the validation part, but {split} gives it none",
                            spelling.name(Setting::EvalEvery)
                        )
                    };
                    return Err(RuntimeError::io(
                        dataset.idx_name(),
                        format!(
                            "{why}; use more documents, or a split whose parts each get one \
                             (e.g. {} for a small corpus)",
                            spelling.given(Setting::Split, "90,10,0")
                        ),
                    ));
                }
            }
            // Each dataset's parts shuffle with their own seed.
            let part_seed = mix64(seed ^ (d as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let train = GptPart::new(
                dataset.clone(),
                0,
                ranges[0].clone(),
                part_seed,
                seq,
                spelling,
            )?;
            let mut line = format!("{} ({}", dataset.prefix().display(), train.describe());
            trains.push(train);
            if !ranges[1].is_empty() {
                let validation = GptPart::new(
                    dataset.clone(),
                    1,
                    ranges[1].clone(),
                    part_seed,
                    seq,
                    spelling,
                )?;
                line += &format!("; {}", validation.describe());
                validations.push(validation);
            }
            lines.push(line + ")");
        }
        let weights: Vec<f64> = spec.blend.iter().map(|(w, _)| *w).collect();
        let validation = if validations.len() == trains.len() {
            Some(Blend::new(validations, weights.clone())?)
        } else {
            None
        };
        let train = Blend::new(trains, weights)?;
        let description = match spec.blend.as_slice() {
            [_] => format!("indexed dataset {}", lines.join("")),
            many => format!(
                "blend of {} indexed datasets: {}",
                many.len(),
                many.iter()
                    .zip(&lines)
                    .map(|((w, _), line)| format!("{w} x {line}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        Ok(IndexedSource {
            train,
            validation,
            split: spec.split.clone(),
            layout,
            seq,
            vocab: largest as usize + 1,
            description,
            spelling,
        })
    }

    pub fn train(&self) -> &Blend {
        &self.train
    }

    pub fn validation(&self) -> Option<&Blend> {
        self.validation.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn key(step: u64, dp_rank: usize, micro_batch: usize) -> BatchKey {
        BatchKey {
            seed: 7,
            step,
            dp_rank,
            micro_batch,
        }
    }

    fn binary_entropy(p: f64) -> f64 {
        -(p * p.ln() + (1.0 - p) * (1.0 - p).ln())
    }

    /// A blend within the up-front scan's bound is refused before the run
    /// for an id past the vocabulary; past the bound it opens at once, and
    /// the sample that holds the id fails with the same message.
    #[test]
    fn a_corpus_too_large_to_scan_checks_its_ids_as_samples_are_read() {
        use super::indexed::by_hand::{Scratch, write_u16};
        let dir = Scratch::new("scan-bound");
        let prefix = dir.prefix("c");
        write_u16(&prefix, &[vec![1; 60], vec![2, 3, 300, 4], vec![5; 60]]);
        let spec = IndexedSpec {
            blend: vec![(1.0, prefix)],
            split: Split::parse("100,0,0", SettingSpelling::FIELDS).unwrap(),
        };
        let shape = BatchShape::new(1, 8);
        let layout = SampleLayout {
            ranks: 1,
            micro_batches: 1,
        };
        let message = "c.bin: token 2 of sequence 1 is id 300, past the model's vocabulary of 256";
        let open = |limit| {
            IndexedSource::open(
                &spec,
                256,
                1,
                shape,
                layout,
                false,
                limit,
                SettingSpelling::FIELDS,
            )
        };
        let scanned = open(UPFRONT_TOKEN_SCAN).unwrap_err();
        assert!(scanned.to_string().contains(message), "{scanned}");
        let source = open(0).unwrap();
        assert_eq!(source.vocab, 256);
        let data = DataSource::Indexed(Arc::new(source));
        // 14 samples of 9 tokens an epoch: every one is read within 14 steps.
        let results: Vec<_> = (0..14)
            .map(|step| data.batch(key(step, 0, 0), shape))
            .collect();
        let failed: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
            .collect();
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].contains(message), "{}", failed[0]);
        assert!(results.iter().filter(|r| r.is_ok()).count() == 13);
    }

    #[test]
    fn splitmix_and_xoshiro_match_reference_values() {
        // Reference outputs of the published C implementations.
        let mut sm = SplitMix64::new(0);
        assert_eq!(sm.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(sm.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut x = Xoshiro256 { s: [1, 2, 3, 4] };
        assert_eq!(x.next_u64(), 11520);
        assert_eq!(x.next_u64(), 0);
        assert_eq!(x.next_u64(), 1509978240);
        assert_eq!(x.next_u64(), 1215971899390074240);
    }

    #[test]
    fn below_and_f64_stay_in_range() {
        let mut rng = Xoshiro256::seed_from_u64(1);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let v = rng.below(7);
            assert!(v < 7);
            seen[v as usize] = true;
            let f = rng.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(rng.below(0), 0);
    }

    #[test]
    fn two_state_chain_entropy_matches_the_hand_computation() {
        // P = [[1/2, 1/2], [1/4, 3/4]]: pi = (1/3, 2/3),
        // H = 1/3 ln 2 + 2/3 h(1/4).
        let chain = MarkovChain::from_transitions(vec![
            vec![(0, 0.5), (1, 0.5)],
            vec![(0, 0.25), (1, 0.75)],
        ])
        .unwrap();
        let pi = chain.stationary();
        assert!((pi[0] - 1.0 / 3.0).abs() < 1e-12, "{pi:?}");
        assert!((pi[1] - 2.0 / 3.0).abs() < 1e-12, "{pi:?}");
        let expected = std::f64::consts::LN_2 / 3.0 + 2.0 / 3.0 * binary_entropy(0.25);
        assert!((chain.entropy_floor() - expected).abs() < 1e-12);
    }

    #[test]
    fn periodic_and_deterministic_chains() {
        // A 3-cycle is periodic: the lazy iteration still finds pi = 1/3.
        let cycle =
            MarkovChain::from_transitions(vec![vec![(1, 1.0)], vec![(2, 1.0)], vec![(0, 1.0)]])
                .unwrap();
        assert_eq!(cycle.entropy_floor(), 0.0);
        assert!(
            cycle
                .stationary()
                .iter()
                .all(|p| (p - 1.0 / 3.0).abs() < 1e-12)
        );
        // Bipartite 0 <-> {1, 2}: pi = (1/2, 1/4, 1/4), H = 1/2 ln 2.
        let star = MarkovChain::from_transitions(vec![
            vec![(1, 0.5), (2, 0.5)],
            vec![(0, 1.0)],
            vec![(0, 1.0)],
        ])
        .unwrap();
        assert!((star.stationary()[0] - 0.5).abs() < 1e-12);
        assert!((star.entropy_floor() - 0.5 * std::f64::consts::LN_2).abs() < 1e-12);
    }

    #[test]
    fn bad_chains_are_refused() {
        let err = |rows: Vec<Vec<(u32, f64)>>| {
            MarkovChain::from_transitions(rows).unwrap_err().to_string()
        };
        assert!(err(vec![]).contains("at least one token"));
        assert!(err(vec![vec![(0, 0.5)]]).contains("add up to 0.5"));
        assert!(err(vec![vec![(3, 1.0)]]).contains("outside the vocabulary"));
        assert!(err(vec![vec![(0, 1.5), (0, -0.5)]]).contains("probability -0.5"));
        assert!(err(vec![vec![(0, 0.5), (0, 0.5)]]).contains("twice"));
        assert!(err(vec![vec![], vec![(0, 1.0)]]).contains("token 0's successors"));
        // 1 -> 1 forever: token 0 is never reached again.
        assert!(err(vec![vec![(1, 1.0)], vec![(1, 1.0)]]).contains("not irreducible: token 1"));
        assert!(MarkovChain::random(1, 1, 0).is_err());
        assert!(MarkovChain::random(8, 9, 0).is_err());
        assert!(MarkovChain::random(8, 0, 0).is_err());
    }

    #[test]
    fn random_chain_floor_matches_sampled_loss() {
        let chain = MarkovChain::random(64, 4, 3).unwrap();
        let floor = chain.entropy_floor();
        assert!(floor > 0.3 && floor < 4f64.ln(), "{floor}");
        let source = DataSource::Markov(chain.clone());
        // The average log-loss of the true model over sampled transitions
        // estimates the entropy rate (deterministic seed: no flakiness).
        let mut total = 0.0;
        let mut count = 0usize;
        let mut first_counts = vec![0usize; 64];
        for step in 0..40 {
            let batch = source
                .batch(key(step, 0, 0), BatchShape::new(16, 128))
                .unwrap();
            for row in batch.tokens().chunks_exact(129) {
                first_counts[row[0] as usize] += 1;
                for pair in row.windows(2) {
                    let p = chain
                        .successors(pair[0])
                        .iter()
                        .find(|(s, _)| *s == pair[1])
                        .map(|(_, p)| *p)
                        .expect("sampled a transition the chain does not have");
                    total -= p.ln();
                    count += 1;
                }
            }
        }
        let estimate = total / count as f64;
        assert!((estimate - floor).abs() < 0.02, "{estimate} vs {floor}");
        assert_eq!(first_counts.iter().sum::<usize>(), 640);
    }

    #[test]
    fn batches_depend_on_the_key_alone() {
        let source = DataSource::Markov(MarkovChain::random(32, 3, 11).unwrap());
        let shape = BatchShape::new(4, 18);
        let a = source.batch(key(5, 1, 2), shape).unwrap();
        // Resuming: an unrelated earlier batch does not change this one.
        let _ = source.batch(key(4, 1, 2), shape).unwrap();
        let b = source.batch(key(5, 1, 2), shape).unwrap();
        assert_eq!(a, b);
        let distinct: HashSet<Vec<u32>> = [
            key(5, 1, 2),
            key(6, 1, 2),
            key(5, 0, 2),
            key(5, 1, 3),
            BatchKey {
                seed: 8,
                ..key(5, 1, 2)
            },
        ]
        .iter()
        .map(|k| source.batch(*k, shape).unwrap().tokens().to_vec())
        .collect();
        assert_eq!(distinct.len(), 5);
        // A row does not depend on how many rows come before or after it.
        let bigger = source.batch(key(5, 1, 2), BatchShape::new(6, 18)).unwrap();
        assert_eq!(&bigger.tokens()[..a.tokens().len()], a.tokens());
    }

    /// layers.md, Model: MTP depth k reads nothing past the sample's S + 1
    /// tokens; inputs are rolled left by k (0 past the end), targets too,
    /// masked for the last k positions.
    #[test]
    fn mtp_inputs_and_targets_roll_inside_the_sample() {
        let source = DataSource::Markov(MarkovChain::random(16, 2, 1).unwrap());
        let batch = source.batch(key(0, 0, 0), BatchShape::new(2, 5)).unwrap();
        assert_eq!(batch.tokens().len(), 2 * 6);
        for k in 1..=3 {
            let (inputs, targets) = (batch.mtp_inputs(k), batch.mtp_targets(k));
            assert_eq!((inputs.len(), targets.len()), (10, 10));
            for row in 0..2 {
                let w = &batch.tokens()[row * 6..(row + 1) * 6];
                for t in 0..5 {
                    let (input, target) = (inputs[row * 5 + t], targets[row * 5 + t]);
                    if t + k < 5 {
                        assert_eq!((input, target), (w[t + k], w[t + k + 1]), "k={k} t={t}");
                    } else {
                        assert_eq!((input, target), (0, IGNORE_TARGET), "k={k} t={t}");
                    }
                }
            }
            let counted = targets.iter().filter(|&&t| t != IGNORE_TARGET).count();
            assert_eq!(counted, 2 * (5 - k), "the S - k labelled positions per row");
        }
    }

    #[test]
    fn inputs_and_targets_are_shifted_views() {
        let source = DataSource::Markov(MarkovChain::random(16, 2, 1).unwrap());
        let batch = source.batch(key(0, 0, 0), BatchShape::new(2, 5)).unwrap();
        assert_eq!(batch.tokens().len(), 2 * 6);
        for row in 0..2 {
            let w = &batch.tokens()[row * 6..(row + 1) * 6];
            assert_eq!(batch.inputs(row).unwrap(), &w[..5]);
            assert_eq!(batch.targets(row).unwrap(), &w[1..6]);
        }
        assert!(batch.inputs(2).is_err());
        assert!(batch.targets(2).is_err());
        assert_eq!(batch.mtp_inputs(0).len(), 10);
        assert_eq!(batch.dims().rows().unwrap(), 10);
        assert_eq!(&batch.mtp_targets(0)[5..], batch.targets(1).unwrap());
        assert!(batch.tokens().iter().all(|t| *t < 16));
        assert!(source.batch(key(0, 0, 0), BatchShape::new(0, 5)).is_err());
        assert!(source.batch(key(0, 0, 0), BatchShape::new(2, 0)).is_err());
        assert!(
            source
                .batch(key(0, 0, 0), BatchShape::new(usize::MAX, 2))
                .is_err()
        );
    }

    #[test]
    fn byte_file_windows_and_errors() {
        let text: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let source = DataSource::Bytes(ByteFile::from_bytes("t.txt", text.clone(), 256).unwrap());
        assert_eq!(source.vocab(), 256);
        assert_eq!(source.entropy_floor(), None);
        let batch = source.batch(key(3, 0, 0), BatchShape::new(3, 21)).unwrap();
        for row in batch.tokens().chunks_exact(22) {
            // Windows are contiguous runs of the file.
            let start = text.iter().position(|b| u32::from(*b) == row[0]).unwrap();
            for (i, t) in row.iter().enumerate() {
                assert_eq!(*t, u32::from(text[(start + i) % 256]));
            }
        }
        assert_eq!(
            batch,
            source.batch(key(3, 0, 0), BatchShape::new(3, 21)).unwrap()
        );
        // Exactly one window fits.
        let exact = DataSource::Bytes(ByteFile::from_bytes("e", vec![1, 2, 3, 4], 300).unwrap());
        let b = exact.batch(key(0, 0, 0), BatchShape::new(2, 3)).unwrap();
        assert_eq!(b.tokens(), &[1, 2, 3, 4, 1, 2, 3, 4]);
        assert_eq!(exact.check_shape(BatchShape::new(2, 3)).unwrap(), 8);
        let short = exact
            .batch(key(0, 0, 0), BatchShape::new(1, 4))
            .unwrap_err()
            .to_string();
        assert!(
            short.contains("e: the file has 4 bytes but one training window needs 5"),
            "{short}"
        );

        let empty = ByteFile::from_bytes("empty.txt", vec![], 256)
            .unwrap_err()
            .to_string();
        assert!(empty.contains("empty.txt: the file is empty"), "{empty}");
        let small = ByteFile::from_bytes("t", vec![1], 128)
            .unwrap_err()
            .to_string();
        assert!(small.contains("only 128 tokens"), "{small}");
        let missing = ByteFile::open(
            Path::new("/nonexistent/corpus.txt"),
            256,
            SettingSpelling::FIELDS,
        )
        .unwrap_err();
        assert!(missing.to_string().starts_with("/nonexistent/corpus.txt:"));
    }

    /// A file of `bytes` under the temp dir, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(tag: &str, bytes: &[u8]) -> Self {
            let path = std::env::temp_dir()
                .join(format!("hybridgen-data-{tag}-{}.bin", std::process::id()));
            std::fs::write(&path, bytes).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn file_windows_are_bit_identical_to_the_whole_file_reader() {
        // Golden values from the implementation that read the whole file into
        // memory (before windows were read in place): FNV-1a of each batch's
        // tokens and its first eight tokens.
        let bytes: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let file = TempFile::new("golden", &bytes);
        let on_disk =
            DataSource::Bytes(ByteFile::open(&file.0, 256, SettingSpelling::FIELDS).unwrap());
        let in_memory = DataSource::Bytes(ByteFile::from_bytes("m", bytes, 256).unwrap());
        let at = |seed, step, dp_rank, micro_batch| BatchKey {
            seed,
            step,
            dp_rank,
            micro_batch,
        };
        let golden: [(BatchKey, BatchShape, u64, [u32; 8]); 4] = [
            (
                at(7, 0, 0, 0),
                BatchShape::new(3, 21),
                0x7475_8657_c1f2_44a9,
                [138, 70, 2, 190, 122, 53, 241, 173],
            ),
            (
                at(7, 5, 1, 2),
                BatchShape::new(4, 64),
                0x0d1a_ec73_d127_98d9,
                [245, 176, 108, 40, 228, 160, 91, 23],
            ),
            (
                at(123, 99, 3, 7),
                BatchShape::new(2, 302),
                0x126c_41cb_5101_8061,
                [102, 34, 222, 154, 86, 17, 205, 137],
            ),
            // One window of the whole file: offset 0 is the only start.
            (
                at(0, 0, 0, 0),
                BatchShape::new(1, 4999),
                0xd826_f322_a2a2_051c,
                [0, 187, 119, 51, 239, 171, 102, 34],
            ),
        ];
        for (key, shape, hash, first) in golden {
            for source in [&on_disk, &in_memory] {
                let batch = source.batch(key, shape).unwrap();
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for t in batch.tokens() {
                    h ^= u64::from(*t);
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
                assert_eq!(h, hash, "{key:?} {shape:?}");
                assert_eq!(&batch.tokens()[..8], &first, "{key:?} {shape:?}");
            }
        }
    }

    #[test]
    fn only_regular_non_empty_files_are_data() {
        let err = |path: &Path| {
            ByteFile::open(path, 256, SettingSpelling::FIELDS)
                .unwrap_err()
                .to_string()
        };
        let dir = std::env::temp_dir();
        let message = err(&dir);
        assert!(
            message.contains("this is a directory, not a data file"),
            "{message}"
        );
        let empty = err(Path::new(""));
        assert!(empty.contains("config.data: the path is empty"), "{empty}");
        let file = TempFile::new("empty", b"");
        let message = err(&file.0);
        assert!(message.contains("the file is empty"), "{message}");
        #[cfg(unix)]
        {
            let message = err(Path::new("/dev/zero"));
            assert_eq!(
                message,
                "/dev/zero: this is a character device, not a data file; give a regular \
                 file of text"
            );
            let fifo = std::env::temp_dir().join(format!("hybridgen-fifo-{}", std::process::id()));
            let _ = std::fs::remove_file(&fifo);
            let made = std::process::Command::new("mkfifo").arg(&fifo).status();
            if made.is_ok_and(|s| s.success()) {
                let message = err(&fifo);
                let _ = std::fs::remove_file(&fifo);
                assert!(message.contains("this is a FIFO (named pipe)"), "{message}");
            }
        }
        // A file that shrinks under a run fails its next read by name.
        let file = TempFile::new("shrinks", &[7u8; 64]);
        let source =
            DataSource::Bytes(ByteFile::open(&file.0, 256, SettingSpelling::FIELDS).unwrap());
        std::fs::write(&file.0, [7u8; 4]).unwrap();
        let message = source
            .batch(key(0, 0, 0), BatchShape::new(2, 30))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("the file shrank while training"),
            "{message}"
        );
    }
}

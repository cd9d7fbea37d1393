//! A seeded sparse Markov chain over the vocabulary: synthetic data with a
//! known entropy floor.

use super::Xoshiro256;
use crate::error::{Result, RuntimeError};

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
    pub(super) fn sample_window(&self, rng: &mut Xoshiro256, out: &mut [u32]) {
        let u = rng.next_f64();
        let mut token = self.stationary_cumulative.partition_point(|c| *c <= u) as u32;
        for slot in out {
            *slot = token;
            token = self.sample_next(token, rng);
        }
    }
}

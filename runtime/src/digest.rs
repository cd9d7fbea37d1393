//! The parameter hash a run prints (`param_hash`): a 64-bit digest of a
//! stream of f32 bit patterns that splits over threads. The stream is cut
//! into blocks of [`BLOCK`] values; the blocks' FNV-1a hashes are computed
//! on threads, straight from the slices the values lie in, and the digest
//! is the FNV-1a of the blocks' hashes and the stream's length. The result depends on the values and their order
//! alone, never on the thread count: the 36 GB of an 8.9 B-parameter model
//! take seconds on a GPU host's cores instead of the half minute one
//! byte-serial FNV-1a takes.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// Values a block holds.
pub const BLOCK: usize = 1 << 20;

/// FNV-1a of `bytes`, continuing from `hash`.
fn fnv(mut hash: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    for byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// FNV-1a over `values`' bit patterns' little-endian bytes, continuing
/// from `hash`.
fn fnv_values(hash: u64, values: &[f32]) -> u64 {
    fnv(hash, values.iter().flat_map(|v| v.to_bits().to_le_bytes()))
}

/// Values given as runs of slices, one stream: where each run starts in it.
struct Runs<'a> {
    runs: &'a [&'a [f32]],
    starts: Vec<usize>,
}

impl<'a> Runs<'a> {
    fn new(runs: &'a [&'a [f32]]) -> Runs<'a> {
        let starts = runs
            .iter()
            .scan(0, |at, run| {
                let start = *at;
                *at += run.len();
                Some(start)
            })
            .collect();
        Runs { runs, starts }
    }

    /// FNV-1a of the stream's values `from..to`, continuing from `hash`.
    fn fnv(&self, mut hash: u64, from: usize, to: usize) -> u64 {
        // The last run starting at or before `from` (empty runs skipped by
        // the clamps below).
        let mut r = self
            .starts
            .partition_point(|&s| s <= from)
            .saturating_sub(1);
        let mut at = from;
        while at < to && r < self.runs.len() {
            let (run, start) = (self.runs[r], self.starts[r]);
            let (a, b) = (at - start, (to - start).min(run.len()));
            if a < b {
                hash = fnv_values(hash, &run[a..b]);
                at = start + b;
            }
            r += 1;
        }
        hash
    }
}

/// A digest being built: values given in order, whole blocks hashed in
/// parallel straight from the caller's slices (no copy), the block being
/// filled kept as its hash so far.
pub struct StreamDigest {
    /// The hash and length of the block being filled.
    open: (u64, usize),
    block_hashes: Vec<u64>,
    len: u64,
    /// Threads that hash whole blocks.
    threads: usize,
}

impl Default for StreamDigest {
    fn default() -> Self {
        StreamDigest::new()
    }
}

impl StreamDigest {
    pub fn new() -> StreamDigest {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        StreamDigest::with_threads(threads)
    }

    /// A digest that hashes on up to `threads` threads (the digest is the
    /// same for any count).
    pub fn with_threads(threads: usize) -> StreamDigest {
        StreamDigest {
            open: (FNV_OFFSET, 0),
            block_hashes: Vec::new(),
            len: 0,
            threads: threads.max(1),
        }
    }

    /// Every value of `runs`, in order, as one stream. The more a call
    /// gives, the more of it is hashed in parallel: the block left open
    /// by the call before is finished, and this call's last part block
    /// is begun, on this thread.
    pub fn extend(&mut self, runs: &[&[f32]]) {
        let runs = Runs::new(runs);
        let total: usize = runs.runs.iter().map(|r| r.len()).sum();
        self.len += total as u64;
        // The block left open, finished (or carried on) here.
        let mut first = 0;
        if self.open.1 > 0 {
            first = (BLOCK - self.open.1).min(total);
            self.open = (runs.fnv(self.open.0, 0, first), self.open.1 + first);
            if self.open.1 < BLOCK {
                return;
            }
            self.block_hashes.push(self.open.0);
        }
        // Whole blocks, a share of them a thread.
        let whole = (total - first) / BLOCK;
        let block = |k: usize| {
            let from = first + k * BLOCK;
            runs.fnv(FNV_OFFSET, from, from + BLOCK)
        };
        let mut hashes = vec![0u64; whole];
        let per_thread = whole.div_ceil(self.threads).max(1);
        if whole > per_thread {
            std::thread::scope(|scope| {
                for (t, chunk) in hashes.chunks_mut(per_thread).enumerate() {
                    let block = &block;
                    scope.spawn(move || {
                        for (i, hash) in chunk.iter_mut().enumerate() {
                            *hash = block(t * per_thread + i);
                        }
                    });
                }
            });
        } else {
            for (k, hash) in hashes.iter_mut().enumerate() {
                *hash = block(k);
            }
        }
        self.block_hashes.extend(hashes);
        // The rest begins the next open block.
        let rest = first + whole * BLOCK;
        self.open = (runs.fnv(FNV_OFFSET, rest, total), total - rest);
    }

    /// The digest's state as f64 words (every u64 as two exact 32-bit
    /// halves), for a host exchange: a pipeline's stages hash their
    /// parameters in turn, each going on from the state the one before
    /// left ([`StreamDigest::resume`]).
    pub fn state(&self) -> Vec<f64> {
        let words = [self.open.0, self.open.1 as u64, self.len]
            .into_iter()
            .chain(self.block_hashes.iter().copied());
        words
            .flat_map(|w| [(w >> 32) as f64, (w & 0xFFFF_FFFF) as f64])
            .collect()
    }

    /// A digest going on from `state` (what [`StreamDigest::state`] gave),
    /// or `None` when it is not one.
    pub fn resume(state: &[f64]) -> Option<StreamDigest> {
        if state.len() < 6 || !state.len().is_multiple_of(2) {
            return None;
        }
        let mut words = state.chunks(2).map(|p| ((p[0] as u64) << 32) | p[1] as u64);
        let open = (words.next()?, usize::try_from(words.next()?).ok()?);
        let len = words.next()?;
        let mut digest = StreamDigest::new();
        digest.open = open;
        digest.len = len;
        digest.block_hashes = words.collect();
        Some(digest)
    }

    /// The digest of every value given.
    pub fn finish(mut self) -> u64 {
        if self.open.1 > 0 {
            self.block_hashes.push(self.open.0);
        }
        let hashes = self.block_hashes.iter().flat_map(|h| h.to_le_bytes());
        fnv(fnv(FNV_OFFSET, hashes), self.len.to_le_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A digest carried through its state, in pieces at odd places, gives
    /// the digest of the whole stream.
    #[test]
    fn a_resumed_state_goes_on_where_it_stopped() {
        let values: Vec<f32> = (0..3 * BLOCK + 17).map(|i| i as f32 * 0.37 - 5.0).collect();
        let mut whole = StreamDigest::with_threads(2);
        whole.extend(&[&values]);
        for cut in [0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 5, values.len()] {
            let mut first = StreamDigest::with_threads(3);
            first.extend(&[&values[..cut]]);
            let mut second = StreamDigest::resume(&first.state()).unwrap();
            second.extend(&[&values[cut..]]);
            let mut again = StreamDigest::with_threads(2);
            again.extend(&[&values]);
            assert_eq!(second.finish(), again.finish(), "cut at {cut}");
        }
        assert_ne!(whole.finish(), StreamDigest::new().finish());
        assert!(StreamDigest::resume(&[1.0; 5]).is_none());
    }

    /// The digest's definition, one value at a time on one thread: each
    /// block's FNV-1a, then the FNV-1a of the blocks' hashes and the length.
    fn reference(values: &[u32]) -> u64 {
        let hashes: Vec<u64> = values
            .chunks(BLOCK)
            .map(|block| fnv(FNV_OFFSET, block.iter().flat_map(|v| v.to_le_bytes())))
            .collect();
        let bytes = hashes.iter().flat_map(|h| h.to_le_bytes());
        fnv(fnv(FNV_OFFSET, bytes), (values.len() as u64).to_le_bytes())
    }

    fn floats(bits: &[u32]) -> Vec<f32> {
        bits.iter().map(|&b| f32::from_bits(b)).collect()
    }

    /// The digest of `values` given in calls of `calls` values each, every
    /// call's values cut into runs of `run`, on `threads` threads.
    fn digest(values: &[f32], calls: usize, run: usize, threads: usize) -> u64 {
        let mut d = StreamDigest::with_threads(threads);
        for call in values.chunks(calls) {
            let mut runs: Vec<&[f32]> = call.chunks(run).collect();
            // Empty runs anywhere change nothing.
            runs.insert(runs.len() / 2, &[]);
            runs.push(&[]);
            d.extend(&runs);
        }
        d.finish()
    }

    /// However the values are cut into calls and runs (across block
    /// boundaries too), on any number of threads, the digest is the
    /// definition's.
    #[test]
    fn calls_runs_and_threads_do_not_change_the_digest() {
        let bits: Vec<u32> = (0..(3 * BLOCK + 99) as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) ^ 0x5bd1_e995)
            .collect();
        let want = reference(&bits);
        let values = floats(&bits);
        for (calls, run) in [
            (values.len(), values.len()),
            (values.len(), 7),
            (values.len(), BLOCK - 1),
            (BLOCK + 3, 1000),
            (BLOCK - 1, BLOCK + 1),
            (2 * BLOCK + 5, 2 * BLOCK + 5),
            (100_003, 4099),
        ] {
            for threads in [1, 2, 3, 8] {
                assert_eq!(
                    digest(&values, calls, run, threads),
                    want,
                    "calls of {calls}, runs of {run}, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn the_digest_sees_every_value_its_place_and_the_length() {
        let bits: Vec<u32> = (0..(BLOCK + 7) as u32).collect();
        let of = |bits: &[u32]| digest(&floats(bits), bits.len().max(1), 1000, 2);
        let base = of(&bits);
        assert_eq!(base, reference(&bits));
        // A change in the last, short block; in a whole block; a swap of
        // two values; one value more.
        let mut last = bits.clone();
        *last.last_mut().unwrap() ^= 1;
        let mut first = bits.clone();
        first[3] ^= 1 << 31;
        let mut swapped = bits.clone();
        swapped.swap(10, 11);
        let mut longer = bits.clone();
        longer.push(0);
        for other in [last, first, swapped, longer] {
            assert_ne!(of(&other), base);
        }
        // Streams of zeros of different lengths differ too.
        assert_ne!(of(&[0; 3]), of(&[0; 4]));
        assert_ne!(of(&[]), of(&[0]));
    }
}

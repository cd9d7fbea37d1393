//! Megatron-LM's indexed dataset: `PREFIX.bin` holds the token ids of every
//! sequence back to back, `PREFIX.idx` says where each one lies (the
//! `MMIDIDX` format of `megatron/core/datasets/indexed_dataset.py`).
//!
//! `.idx`, all little-endian:
//!
//! | bytes        | what                                                  |
//! |--------------|-------------------------------------------------------|
//! | 9            | magic `MMIDIDX\0\0`                                   |
//! | 8 (u64)      | version, 1                                            |
//! | 1 (u8)       | dtype code of the tokens in `.bin` ([`TokenDtype`])   |
//! | 8 (u64)      | sequence count `n`                                    |
//! | 8 (u64)      | document count `d` (entries of the document index)    |
//! | 4 `n` (i32)  | sequence lengths, in tokens                           |
//! | 8 `n` (i64)  | sequence pointers, byte offsets into `.bin`           |
//! | 8 `d` (i64)  | document index: 0, then the end (in sequences) of each document |
//! | `n` (i8)     | optional: sequence modes (multimodal datasets; ignored) |
//!
//! Both files are memory-mapped: the corpus is never read into memory, the
//! page cache keeps what is hot. Everything the index says is checked
//! against both files' lengths when they are opened, so a truncated or
//! corrupt pair is an error naming the file, never an out-of-bounds read.

use crate::error::{Result, RuntimeError};
use memmap2::Mmap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The first 9 bytes of every `.idx`.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only version Megatron writes.
pub const VERSION: u64 = 1;
/// Magic, version, dtype code, sequence count, document count.
const HEADER_BYTES: usize = 9 + 8 + 1 + 8 + 8;

/// The integer type of the tokens in `.bin` (Megatron's `DType` codes).
/// The float codes (6: float64, 7: float32) are not token ids and are
/// refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    U8,
    I8,
    I16,
    I32,
    I64,
    U16,
}

impl TokenDtype {
    pub fn code(self) -> u8 {
        match self {
            TokenDtype::U8 => 1,
            TokenDtype::I8 => 2,
            TokenDtype::I16 => 3,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 5,
            TokenDtype::U16 => 8,
        }
    }

    /// The dtype of code `code`, or what is wrong with it.
    pub fn from_code(code: u8) -> std::result::Result<Self, String> {
        Ok(match code {
            1 => TokenDtype::U8,
            2 => TokenDtype::I8,
            3 => TokenDtype::I16,
            4 => TokenDtype::I32,
            5 => TokenDtype::I64,
            8 => TokenDtype::U16,
            6 | 7 => {
                return Err(format!(
                    "its tokens are stored as {} (dtype code {code}), which cannot hold token \
                     ids; re-tokenize the corpus into an integer dtype (uint16 or int32)",
                    if code == 6 { "float64" } else { "float32" }
                ));
            }
            other => {
                return Err(format!(
                    "dtype code {other} is not one of Megatron's (1 uint8, 2 int8, 3 int16, 4 \
                     int32, 5 int64, 8 uint16)"
                ));
            }
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U8 | TokenDtype::I8 => 1,
            TokenDtype::I16 | TokenDtype::U16 => 2,
            TokenDtype::I32 => 4,
            TokenDtype::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U8 => "uint8",
            TokenDtype::I8 => "int8",
            TokenDtype::I16 => "int16",
            TokenDtype::I32 => "int32",
            TokenDtype::I64 => "int64",
            TokenDtype::U16 => "uint16",
        }
    }

    /// The dtype Megatron's preprocessing picks for a vocabulary: uint16
    /// below 65500 tokens, int32 above.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab < 65_500 {
            TokenDtype::U16
        } else {
            TokenDtype::I32
        }
    }

    /// Token `i` of `bytes`, as a signed value (`bytes` holds whole tokens).
    fn read(self, bytes: &[u8], i: usize) -> i64 {
        let s = self.size();
        let b = &bytes[i * s..(i + 1) * s];
        match self {
            TokenDtype::U8 => i64::from(b[0]),
            TokenDtype::I8 => i64::from(b[0] as i8),
            TokenDtype::I16 => i64::from(i16::from_le_bytes([b[0], b[1]])),
            TokenDtype::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            TokenDtype::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            TokenDtype::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        }
    }

    /// Calls `f` with every token of `bytes` (whole tokens) in order; the
    /// dtype is matched once, not per token.
    fn for_each(self, bytes: &[u8], mut f: impl FnMut(i64)) {
        match self {
            TokenDtype::U8 => bytes.iter().for_each(|b| f(i64::from(*b))),
            TokenDtype::I8 => bytes.iter().for_each(|b| f(i64::from(*b as i8))),
            TokenDtype::I16 => bytes
                .chunks_exact(2)
                .for_each(|b| f(i64::from(i16::from_le_bytes([b[0], b[1]])))),
            TokenDtype::U16 => bytes
                .chunks_exact(2)
                .for_each(|b| f(i64::from(u16::from_le_bytes([b[0], b[1]])))),
            TokenDtype::I32 => bytes
                .chunks_exact(4)
                .for_each(|b| f(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))),
            TokenDtype::I64 => bytes.chunks_exact(8).for_each(|b| {
                f(i64::from_le_bytes([
                    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
                ]))
            }),
        }
    }

    fn write(self, token: u32, out: &mut Vec<u8>) {
        match self {
            TokenDtype::U8 | TokenDtype::I8 => out.push(token as u8),
            TokenDtype::I16 | TokenDtype::U16 => {
                out.extend_from_slice(&(token as u16).to_le_bytes())
            }
            TokenDtype::I32 => out.extend_from_slice(&(token as i32).to_le_bytes()),
            TokenDtype::I64 => out.extend_from_slice(&i64::from(token).to_le_bytes()),
        }
    }

    /// The largest token id the dtype stores.
    pub fn max_token(self) -> u64 {
        match self {
            TokenDtype::U8 => u64::from(u8::MAX),
            TokenDtype::I8 => i8::MAX as u64,
            TokenDtype::I16 => i16::MAX as u64,
            TokenDtype::U16 => u64::from(u16::MAX),
            TokenDtype::I32 => i32::MAX as u64,
            TokenDtype::I64 => u64::from(u32::MAX),
        }
    }
}

/// `PREFIX.idx` and `PREFIX.bin` for a prefix.
pub fn paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |ext: &str| {
        let mut name = prefix.as_os_str().to_owned();
        name.push(ext);
        PathBuf::from(name)
    };
    (with(".idx"), with(".bin"))
}

/// One indexed dataset, memory-mapped and checked.
#[derive(Debug)]
pub struct IndexedDataset {
    prefix: PathBuf,
    idx_name: String,
    bin_name: String,
    idx: Mmap,
    bin: Option<Mmap>,
    dtype: TokenDtype,
    sequences: usize,
    documents: usize,
    /// Token ids every read checks against (see
    /// [`IndexedDataset::check_reads_against`]).
    vocab: Option<usize>,
}

/// Whether ids from `low` to `high` leave a vocabulary of `vocab` tokens.
fn outside(low: i64, high: i64, vocab: usize) -> bool {
    low < 0 || high as u128 >= vocab as u128
}

/// Maps `file` read-only.
fn map(file: &std::fs::File, name: &str) -> Result<Option<Mmap>> {
    let len = file
        .metadata()
        .map_err(|e| RuntimeError::io(name, e))?
        .len();
    if len == 0 {
        // An empty file cannot be mapped; it has nothing to read either.
        return Ok(None);
    }
    // SAFETY: the map is read-only and private to this process. The one
    // hazard is another process truncating the file while it is mapped
    // (reads past the new end fault); Megatron's reader shares it, and a
    // corpus is not rewritten under a run. Every offset read is checked
    // against the length the map had when it was made.
    unsafe { Mmap::map(file) }
        .map(Some)
        .map_err(|e| RuntimeError::io(name, format!("cannot memory-map the file: {e}")))
}

impl IndexedDataset {
    /// Opens `PREFIX.idx` and `PREFIX.bin` and checks that they agree: the
    /// header, every array's length, the document index, and that every
    /// sequence lies inside `.bin`.
    pub fn open(prefix: &Path) -> Result<Self> {
        if prefix.as_os_str().is_empty() {
            return Err(RuntimeError::io(
                "an indexed dataset",
                "its prefix is empty; give PREFIX of PREFIX.idx and PREFIX.bin",
            ));
        }
        let (idx_path, bin_path) = paths(prefix);
        let idx_name = idx_path.display().to_string();
        let bin_name = bin_path.display().to_string();
        let (idx_file, _) = super::open_regular(&idx_path, "")?;
        let (bin_file, _) = super::open_regular(&bin_path, "")?;
        let idx = map(&idx_file, &idx_name)?;
        let bin = map(&bin_file, &bin_name)?;
        let bad = |what: String| Err(RuntimeError::io(&idx_name, what));
        let Some(idx) = idx else {
            return bad("the index is empty (0 bytes); it was not written completely".into());
        };
        if idx.len() < HEADER_BYTES {
            return bad(format!(
                "the index is truncated: {} bytes, but its header alone is {HEADER_BYTES}",
                idx.len()
            ));
        }
        if &idx[..9] != MAGIC {
            return bad(
                "this is not a Megatron indexed dataset index (it does not start with the \
                 MMIDIDX magic); give the prefix of files written by Megatron's \
                 preprocess_data.py or `hybridgen data prepare`"
                    .into(),
            );
        }
        let u64_at = |at: usize| u64::from_le_bytes(idx[at..at + 8].try_into().unwrap_or([0; 8]));
        let version = u64_at(9);
        if version != VERSION {
            return bad(format!(
                "index version {version}; only version {VERSION} is known"
            ));
        }
        let dtype = match TokenDtype::from_code(idx[17]) {
            Ok(dtype) => dtype,
            Err(why) => return bad(why),
        };
        let (sequences, documents) = (u64_at(18), u64_at(26));
        // Sizes in u128: a corrupt count cannot overflow the arithmetic.
        let arrays = u128::from(sequences) * 12 + u128::from(documents) * 8;
        let expected = HEADER_BYTES as u128 + arrays;
        let len = idx.len() as u128;
        // Multimodal datasets append one mode byte per sequence.
        if len != expected && len != expected + u128::from(sequences) {
            return bad(if len < expected {
                format!(
                    "the index is truncated: its header announces {sequences} sequences and \
                     {documents} document-index entries ({expected} bytes), but the file has \
                     {len}"
                )
            } else {
                format!(
                    "the index has {} bytes after the {sequences} sequences and {documents} \
                     document-index entries its header announces; the file is corrupt",
                    len - expected
                )
            });
        }
        let (sequences, documents) = (sequences as usize, documents as usize);
        let dataset = IndexedDataset {
            prefix: prefix.to_path_buf(),
            idx_name,
            bin_name,
            idx,
            bin,
            dtype,
            sequences,
            documents,
            vocab: None,
        };
        dataset.check()?;
        Ok(dataset)
    }

    /// The arrays against each other and against `.bin`'s length.
    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(RuntimeError::io(&self.idx_name, what));
        if self.documents == 0 {
            return bad(
                "the document index is empty; it must start with 0 (the file is corrupt)".into(),
            );
        }
        let bin_len = self.bin_bytes() as u128;
        let size = self.dtype.size() as u128;
        for i in 0..self.sequences {
            let (length, pointer) = (self.raw_length(i), self.raw_pointer(i));
            if length < 0 || pointer < 0 {
                return bad(format!(
                    "sequence {i} has length {length} and pointer {pointer}; neither may be \
                     negative (the file is corrupt)"
                ));
            }
            if !(pointer as u128).is_multiple_of(size) {
                return bad(format!(
                    "sequence {i} starts at byte {pointer}, not a multiple of the {}-byte {} \
                     tokens (the file is corrupt)",
                    size,
                    self.dtype.name()
                ));
            }
            let end = pointer as u128 + length as u128 * size;
            if end > bin_len {
                return Err(RuntimeError::io(
                    &self.bin_name,
                    format!(
                        "the token file is truncated: sequence {i} of {} needs bytes up to \
                         {end}, but the file has {bin_len}",
                        self.sequences
                    ),
                ));
            }
        }
        let mut previous = 0i64;
        for j in 0..self.documents {
            let at = self.raw_document(j);
            let wrong = if j == 0 && at != 0 {
                Some("the first entry must be 0")
            } else if at < previous {
                Some("entries must not decrease")
            } else if at as u128 > self.sequences as u128 {
                Some("entries must not pass the sequence count")
            } else if j + 1 == self.documents && at as usize != self.sequences {
                Some("the last entry must be the sequence count")
            } else {
                None
            };
            if let Some(rule) = wrong {
                return bad(format!(
                    "document-index entry {j} is {at} with {} sequences: {rule} (the file is \
                     corrupt)",
                    self.sequences
                ));
            }
            previous = at;
        }
        Ok(())
    }

    fn lengths_at(&self) -> usize {
        HEADER_BYTES
    }

    fn pointers_at(&self) -> usize {
        HEADER_BYTES + 4 * self.sequences
    }

    fn documents_at(&self) -> usize {
        HEADER_BYTES + 12 * self.sequences
    }

    fn raw_length(&self, i: usize) -> i32 {
        let at = self.lengths_at() + 4 * i;
        i32::from_le_bytes(self.idx[at..at + 4].try_into().unwrap_or([0; 4]))
    }

    fn raw_pointer(&self, i: usize) -> i64 {
        let at = self.pointers_at() + 8 * i;
        i64::from_le_bytes(self.idx[at..at + 8].try_into().unwrap_or([0; 8]))
    }

    fn raw_document(&self, j: usize) -> i64 {
        let at = self.documents_at() + 8 * j;
        i64::from_le_bytes(self.idx[at..at + 8].try_into().unwrap_or([0; 8]))
    }

    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Sequences in the dataset.
    pub fn sequences(&self) -> usize {
        self.sequences
    }

    /// Tokens of sequence `i` (checked non-negative when opened).
    pub fn sequence_length(&self, i: usize) -> usize {
        self.raw_length(i) as usize
    }

    /// The document index: `0`, then the end (in sequences) of each
    /// document; document `k` is sequences `[doc[k], doc[k + 1])`.
    pub fn document_index(&self) -> Vec<u64> {
        (0..self.documents)
            .map(|j| self.raw_document(j) as u64)
            .collect()
    }

    /// Documents in the dataset.
    pub fn documents(&self) -> usize {
        self.documents - 1
    }

    /// Tokens in the whole dataset.
    pub fn tokens(&self) -> u64 {
        (0..self.sequences)
            .map(|i| self.sequence_length(i) as u64)
            .sum()
    }

    /// `.bin`'s length in bytes.
    pub fn bin_bytes(&self) -> u64 {
        self.bin.as_ref().map_or(0, |b| b.len() as u64)
    }

    /// The bytes of `.idx` (for checksums).
    pub fn index_bytes(&self) -> &[u8] {
        &self.idx
    }

    /// The raw bytes of sequence `i` (checked inside `.bin` when opened).
    fn sequence_bytes(&self, i: usize) -> &[u8] {
        let start = self.raw_pointer(i) as usize;
        let len = self.sequence_length(i) * self.dtype.size();
        match &self.bin {
            Some(bin) => &bin[start..start + len],
            None => &[],
        }
    }

    /// Fills `out` with the tokens of sequence `i` from `offset` on.
    pub fn read(&self, i: usize, offset: usize, out: &mut [u32]) -> Result<()> {
        if i >= self.sequences || offset + out.len() > self.sequence_length(i) {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: tokens {offset}..{} of sequence {i} are out of range (it has {} tokens of \
                 {} sequences)",
                self.bin_name,
                offset + out.len(),
                if i < self.sequences {
                    self.sequence_length(i)
                } else {
                    0
                },
                self.sequences
            )));
        }
        let size = self.dtype.size();
        let bytes = &self.sequence_bytes(i)[offset * size..(offset + out.len()) * size];
        let mut slots = out.iter_mut();
        let (mut low, mut high) = (i64::MAX, i64::MIN);
        self.dtype.for_each(bytes, |t| {
            low = low.min(t);
            high = high.max(t);
            if let Some(slot) = slots.next() {
                *slot = t as u32;
            }
        });
        // Every id past the vocabulary is caught here when the whole
        // corpus was not scanned before the run (or the scan is skipped).
        match self.vocab {
            Some(vocab) if !out.is_empty() && outside(low, high, vocab) => {
                Err(self.bad_token(i, offset, out.len(), vocab))
            }
            _ => Ok(()),
        }
    }

    /// From now on, every [`IndexedDataset::read`] checks the ids it reads
    /// against a vocabulary of `vocab` tokens: what a run does when its
    /// corpus is too large to scan before the first step
    /// ([`IndexedDataset::check_tokens`]).
    pub fn check_reads_against(mut self, vocab: usize) -> Self {
        self.vocab = Some(vocab);
        self
    }

    /// The error naming the first token of sequence `i` in `[offset,
    /// offset + len)` that is not an id of a `vocab`-token vocabulary (the
    /// caller knows there is one).
    fn bad_token(&self, i: usize, offset: usize, len: usize, vocab: usize) -> RuntimeError {
        let bytes = self.sequence_bytes(i);
        let at = (offset..offset + len)
            .find(|&k| {
                let t = self.dtype.read(bytes, k);
                outside(t, t, vocab)
            })
            .unwrap_or(offset);
        let t = self.dtype.read(bytes, at);
        RuntimeError::io(
            &self.bin_name,
            if t < 0 {
                format!(
                    "token {at} of sequence {i} is {t}, a negative id; the file is corrupt or \
                     not written by a tokenizer"
                )
            } else {
                format!(
                    "token {at} of sequence {i} is id {t}, past the model's vocabulary of \
                     {vocab} tokens; train a model with vocab_size above {t} (the tokenizer's \
                     vocabulary size), or re-tokenize with the model's tokenizer"
                )
            },
        )
    }

    /// The tokens of sequence `i`.
    pub fn sequence(&self, i: usize) -> Result<Vec<u32>> {
        let mut out = vec![
            0u32;
            if i < self.sequences {
                self.sequence_length(i)
            } else {
                0
            }
        ];
        self.read(i, 0, &mut out)?;
        Ok(out)
    }

    /// Checks every token of the dataset is an id of a vocabulary of
    /// `vocab` tokens; returns the largest. One pass over `.bin`.
    pub fn check_tokens(&self, vocab: usize) -> Result<u64> {
        let mut largest = 0i64;
        for i in 0..self.sequences {
            let bytes = self.sequence_bytes(i);
            let n = self.sequence_length(i);
            let (mut low, mut high) = (i64::MAX, i64::MIN);
            self.dtype.for_each(bytes, |t| {
                low = low.min(t);
                high = high.max(t);
            });
            if n == 0 {
                continue;
            }
            if outside(low, high, vocab) {
                return Err(self.bad_token(i, 0, n, vocab));
            }
            largest = largest.max(high);
        }
        Ok(largest as u64)
    }

    /// Names for messages.
    pub fn bin_name(&self) -> &str {
        &self.bin_name
    }

    pub fn idx_name(&self) -> &str {
        &self.idx_name
    }
}

/// Writes an indexed dataset, one sequence per document (as Megatron's
/// preprocessing does without sentence splitting). Both files are written
/// under temporary names and renamed when [`IndexedWriter::finish`] succeeds,
/// so a failed or interrupted run never leaves a half-written corpus under
/// the final names.
pub struct IndexedWriter {
    prefix: PathBuf,
    dtype: TokenDtype,
    bin_tmp: PathBuf,
    bin: std::io::BufWriter<std::fs::File>,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    written: u64,
    encoded: Vec<u8>,
}

/// `path` with `.tmp-PID` appended.
fn temporary(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp-{}", std::process::id()));
    PathBuf::from(name)
}

impl IndexedWriter {
    pub fn create(prefix: &Path, dtype: TokenDtype) -> Result<Self> {
        let (_, bin_path) = paths(prefix);
        let bin_tmp = temporary(&bin_path);
        let file =
            std::fs::File::create(&bin_tmp).map_err(|e| RuntimeError::io(bin_path.display(), e))?;
        Ok(IndexedWriter {
            prefix: prefix.to_path_buf(),
            dtype,
            bin_tmp,
            bin: std::io::BufWriter::with_capacity(1 << 20, file),
            lengths: Vec::new(),
            pointers: Vec::new(),
            written: 0,
            encoded: Vec::new(),
        })
    }

    /// Appends one document of `tokens` (each within the dtype's range).
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        let bin_name = || paths(&self.prefix).1.display().to_string();
        if let Some(t) = tokens
            .iter()
            .find(|t| u64::from(**t) > self.dtype.max_token())
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: token id {t} does not fit the {} tokens of this dataset",
                bin_name(),
                self.dtype.name()
            )));
        }
        let length = i32::try_from(tokens.len()).map_err(|_| {
            RuntimeError::InvalidArgument(format!(
                "{}: a document of {} tokens is longer than the format's limit of {}",
                bin_name(),
                tokens.len(),
                i32::MAX
            ))
        })?;
        self.encoded.clear();
        for t in tokens {
            self.dtype.write(*t, &mut self.encoded);
        }
        self.bin
            .write_all(&self.encoded)
            .map_err(|e| RuntimeError::io(bin_name(), e))?;
        self.pointers.push(self.written as i64);
        self.lengths.push(length);
        self.written += self.encoded.len() as u64;
        Ok(())
    }

    /// Documents written so far.
    pub fn documents(&self) -> usize {
        self.lengths.len()
    }

    /// Writes the index and renames both files into place.
    pub fn finish(mut self) -> Result<(PathBuf, PathBuf)> {
        let (idx_path, bin_path) = paths(&self.prefix);
        let idx_tmp = temporary(&idx_path);
        let result = (|| {
            self.bin
                .flush()
                .and_then(|()| self.bin.get_ref().sync_all())
                .map_err(|e| RuntimeError::io(bin_path.display(), e))?;
            let mut idx = Vec::with_capacity(HEADER_BYTES + 20 * self.lengths.len() + 8);
            idx.extend_from_slice(MAGIC);
            idx.extend_from_slice(&VERSION.to_le_bytes());
            idx.push(self.dtype.code());
            let n = self.lengths.len() as u64;
            idx.extend_from_slice(&n.to_le_bytes());
            idx.extend_from_slice(&(n + 1).to_le_bytes());
            for l in &self.lengths {
                idx.extend_from_slice(&l.to_le_bytes());
            }
            for p in &self.pointers {
                idx.extend_from_slice(&p.to_le_bytes());
            }
            for d in 0..=n {
                idx.extend_from_slice(&(d as i64).to_le_bytes());
            }
            let mut file = std::fs::File::create(&idx_tmp)
                .map_err(|e| RuntimeError::io(idx_path.display(), e))?;
            file.write_all(&idx)
                .and_then(|()| file.sync_all())
                .map_err(|e| RuntimeError::io(idx_path.display(), e))?;
            std::fs::rename(&self.bin_tmp, &bin_path)
                .map_err(|e| RuntimeError::io(bin_path.display(), e))?;
            std::fs::rename(&idx_tmp, &idx_path)
                .map_err(|e| RuntimeError::io(idx_path.display(), e))
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&self.bin_tmp);
            let _ = std::fs::remove_file(&idx_tmp);
        }
        result.map(|()| (idx_path, bin_path))
    }
}

impl Drop for IndexedWriter {
    /// A writer dropped before [`IndexedWriter::finish`] (a failed run)
    /// leaves no temporary file; after it, the file was renamed away.
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.bin_tmp);
    }
}

/// Datasets written byte by byte from the format's description (not
/// through [`IndexedWriter`]), for tests here and in [`super::gpt`].
#[cfg(test)]
pub(crate) mod by_hand {
    use std::path::{Path, PathBuf};

    /// A scratch directory, removed on drop.
    pub struct Scratch(pub PathBuf);

    impl Scratch {
        pub fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("hybridgen-indexed-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        pub fn prefix(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The `.idx` bytes of sequences of `lengths` tokens of `size` bytes
    /// each, back to back, with `docs` as the document index.
    pub fn index(code: u8, size: usize, lengths: &[i32], docs: &[i64]) -> Vec<u8> {
        let mut idx = b"MMIDIDX\x00\x00".to_vec();
        idx.extend(1u64.to_le_bytes());
        idx.push(code);
        idx.extend((lengths.len() as u64).to_le_bytes());
        idx.extend((docs.len() as u64).to_le_bytes());
        for l in lengths {
            idx.extend(l.to_le_bytes());
        }
        let mut pointer = 0i64;
        for l in lengths {
            idx.extend(pointer.to_le_bytes());
            pointer += i64::from(*l) * size as i64;
        }
        for d in docs {
            idx.extend(d.to_le_bytes());
        }
        idx
    }

    /// Writes `PREFIX.idx` and `PREFIX.bin` of one sequence per document,
    /// tokens as little-endian uint16 (code 8).
    pub fn write_u16(prefix: &Path, documents: &[Vec<u16>]) {
        let lengths: Vec<i32> = documents.iter().map(|d| d.len() as i32).collect();
        let docs: Vec<i64> = (0..=documents.len() as i64).collect();
        let bin: Vec<u8> = documents
            .iter()
            .flatten()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        write(prefix, &index(8, 2, &lengths, &docs), &bin);
    }

    pub fn write(prefix: &Path, idx: &[u8], bin: &[u8]) {
        let (i, b) = super::paths(prefix);
        std::fs::write(i, idx).unwrap();
        std::fs::write(b, bin).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::by_hand::{Scratch, index, write, write_u16};
    use super::*;

    #[test]
    fn a_dataset_written_byte_by_byte_reads_back() {
        let dir = Scratch::new("read");
        // int32 tokens (code 4), three sequences in two documents:
        // document 0 = sequences 0 and 1, document 1 = sequence 2.
        let seqs: [&[i32]; 3] = [&[5, 70000, 2], &[], &[9, 8, 7, 6]];
        let lengths: Vec<i32> = seqs.iter().map(|s| s.len() as i32).collect();
        let bin: Vec<u8> = seqs
            .iter()
            .flat_map(|s| s.iter())
            .flat_map(|t| t.to_le_bytes())
            .collect();
        let prefix = dir.prefix("int32");
        write(&prefix, &index(4, 4, &lengths, &[0, 2, 3]), &bin);
        let d = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(d.dtype(), TokenDtype::I32);
        assert_eq!(d.sequences(), 3);
        assert_eq!(d.documents(), 2);
        assert_eq!(d.document_index(), vec![0, 2, 3]);
        assert_eq!(d.tokens(), 7);
        assert_eq!(d.sequence(0).unwrap(), vec![5, 70000, 2]);
        assert_eq!(d.sequence(1).unwrap(), Vec::<u32>::new());
        assert_eq!(d.sequence(2).unwrap(), vec![9, 8, 7, 6]);
        let mut part = [0u32; 2];
        d.read(2, 1, &mut part).unwrap();
        assert_eq!(part, [8, 7]);
        assert!(d.read(2, 3, &mut part).is_err());
        assert_eq!(d.check_tokens(70001).unwrap(), 70000);
        // uint16, and the writer produces exactly the bytes of the format.
        let docs = vec![vec![1u16, 2, 3], vec![65535], vec![4, 5]];
        let hand = dir.prefix("hand");
        write_u16(&hand, &docs);
        let written = dir.prefix("written");
        let mut writer = IndexedWriter::create(&written, TokenDtype::U16).unwrap();
        for doc in &docs {
            writer
                .add_document(&doc.iter().map(|t| u32::from(*t)).collect::<Vec<_>>())
                .unwrap();
        }
        writer.finish().unwrap();
        let (hand_idx, hand_bin) = paths(&hand);
        let (idx, bin) = paths(&written);
        assert_eq!(
            std::fs::read(idx).unwrap(),
            std::fs::read(hand_idx).unwrap()
        );
        assert_eq!(
            std::fs::read(bin).unwrap(),
            std::fs::read(hand_bin).unwrap()
        );
        let d = IndexedDataset::open(&written).unwrap();
        assert_eq!(d.sequence(1).unwrap(), vec![65535]);
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// The error of opening a dataset of these bytes.
    fn refused(idx: &[u8], bin: &[u8]) -> String {
        let dir = Scratch::new("refused");
        let prefix = dir.prefix("bad");
        write(&prefix, idx, bin);
        IndexedDataset::open(&prefix).unwrap_err().to_string()
    }

    #[test]
    fn corrupt_and_truncated_files_are_refused_by_name() {
        let good = index(8, 2, &[2, 3], &[0, 1, 2]);
        let bin = [1u8, 0, 2, 0, 3, 0, 4, 0, 5, 0];
        // Sanity: the good pair opens.
        let dir = Scratch::new("good");
        write(&dir.prefix("ok"), &good, &bin);
        IndexedDataset::open(&dir.prefix("ok")).unwrap();

        let m = refused(&good[..20], &bin);
        assert!(
            m.contains("bad.idx: the index is truncated: 20 bytes"),
            "{m}"
        );
        let m = refused(&good[..good.len() - 3], &bin);
        assert!(
            m.contains("bad.idx: the index is truncated: its header announces 2 sequences"),
            "{m}"
        );
        let mut long = good.clone();
        long.extend([0u8; 5]);
        assert!(refused(&long, &bin).contains("has 5 bytes after"));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(refused(&magic, &bin).contains("not a Megatron indexed dataset index"));
        let mut version = good.clone();
        version[9] = 2;
        assert!(refused(&version, &bin).contains("index version 2"));
        let m = refused(&index(7, 4, &[2, 3], &[0, 1, 2]), &[0; 20]);
        assert!(
            m.contains("stored as float32 (dtype code 7), which cannot hold token ids"),
            "{m}"
        );
        let m = refused(&index(6, 8, &[2, 3], &[0, 1, 2]), &[0; 40]);
        assert!(m.contains("float64"), "{m}");
        let m = refused(&index(9, 2, &[2, 3], &[0, 1, 2]), &bin);
        assert!(m.contains("dtype code 9 is not one of Megatron's"), "{m}");
        let m = refused(&good, &bin[..8]);
        assert!(
            m.contains("bad.bin: the token file is truncated: sequence 1 of 2 needs bytes up to 10, but the file has 8"),
            "{m}"
        );
        let m = refused(&good, &[]);
        assert!(m.contains("bad.bin: the token file is truncated"), "{m}");
        let m = refused(&index(8, 2, &[2, -3], &[0, 1, 2]), &bin);
        assert!(m.contains("sequence 1 has length -3"), "{m}");
        let m = refused(&index(8, 2, &[2, 3], &[1, 2]), &bin);
        assert!(m.contains("document-index entry 0 is 1"), "{m}");
        let m = refused(&index(8, 2, &[2, 3], &[0, 1]), &bin);
        assert!(
            m.contains("the last entry must be the sequence count"),
            "{m}"
        );
        let m = refused(&index(8, 2, &[2, 3], &[0, 2, 1]), &bin);
        assert!(m.contains("must not decrease"), "{m}");
        assert!(refused(&[], &bin).contains("bad.idx: the index is empty"));
        let missing = IndexedDataset::open(Path::new("/nonexistent/corpus")).unwrap_err();
        assert!(
            missing.to_string().starts_with("/nonexistent/corpus.idx:"),
            "{missing}"
        );
        let dir = Scratch::new("dir");
        std::fs::create_dir(dir.prefix("d.idx")).unwrap();
        std::fs::write(dir.prefix("d.bin"), b"").unwrap();
        let m = IndexedDataset::open(&dir.prefix("d"))
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("d.idx: this is a directory, not a data file"),
            "{m}"
        );
    }

    #[test]
    fn reads_check_their_token_ids_when_asked_to() {
        let dir = Scratch::new("vocab-reads");
        let prefix = dir.prefix("c");
        write_u16(&prefix, &[vec![1, 2], vec![3, 4, 300, 5]]);
        let d = IndexedDataset::open(&prefix).unwrap();
        // Unchecked, the id reads through (the up-front scan's business).
        assert_eq!(d.sequence(1).unwrap(), vec![3, 4, 300, 5]);
        let d = d.check_reads_against(256);
        let mut two = [0u32; 2];
        d.read(1, 0, &mut two).unwrap();
        assert_eq!(two, [3, 4]);
        d.read(0, 0, &mut two).unwrap();
        let m = d.read(1, 1, &mut two).unwrap_err().to_string();
        assert!(
            m.contains(
                "c.bin: token 2 of sequence 1 is id 300, past the model's vocabulary of 256 tokens"
            ),
            "{m}"
        );
        let mut one = [0u32; 1];
        d.read(1, 3, &mut one).unwrap();
        assert_eq!(one, [5]);
    }

    #[test]
    fn token_ids_are_checked_against_the_vocabulary() {
        let dir = Scratch::new("vocab");
        let prefix = dir.prefix("c");
        write_u16(&prefix, &[vec![1, 2], vec![3, 300, 4]]);
        let d = IndexedDataset::open(&prefix).unwrap();
        assert_eq!(d.check_tokens(301).unwrap(), 300);
        let m = d.check_tokens(256).unwrap_err().to_string();
        assert!(
            m.contains(
                "c.bin: token 1 of sequence 1 is id 300, past the model's vocabulary of 256 tokens"
            ),
            "{m}"
        );
        // A negative id in a signed dtype.
        let signed = dir.prefix("s");
        write(&signed, &index(3, 2, &[2], &[0, 1]), &[1, 0, 0xff, 0xff]);
        let m = IndexedDataset::open(&signed)
            .unwrap()
            .check_tokens(100)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("token 1 of sequence 0 is -1, a negative id"),
            "{m}"
        );
        // The writer refuses ids its dtype cannot store.
        let mut writer = IndexedWriter::create(&dir.prefix("w"), TokenDtype::U16).unwrap();
        let m = writer.add_document(&[70000]).unwrap_err().to_string();
        assert!(
            m.contains("token id 70000 does not fit the uint16 tokens"),
            "{m}"
        );
    }
}

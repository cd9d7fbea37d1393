//! Rank files written and read a piece at a time: memory holds a chunk of
//! one tensor, never the file, so saving or resuming a model of any size
//! needs no more host memory than a small model does (a rank of the 9B
//! model holds 53 GB of master weights and moments; two copies of that in
//! host memory, as a whole-file writer makes, do not fit a GPU host).
//!
//! A rank file is safetensors: an 8-byte header length, the JSON header
//! (each tensor's dtype, shape and byte range; each tensor's CRC-32C in
//! `__metadata__`), then the tensors' bytes back to back. The writer knows
//! every tensor's length up front, so it writes the header first with
//! placeholder checksums of the same width, streams the bytes, then writes
//! the header again with the real ones; the file's own CRC-32C comes from
//! the header's and the data's ([`crc32c::combine`]), so nothing is read
//! back.

use super::crc32c::{self, Crc32c, hex};
use super::durable;
use super::index::FileEntry;
use super::root;
use crate::error::{Result, RuntimeError};
use crate::tensor_file::Header;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Values a writer or reader moves at a time (16 MiB of f32).
pub(crate) const CHUNK: usize = 4 << 20;

/// The JSON header of f32 tensors `(name, elements)` in that order, with
/// their checksums (`sums`, one a tensor), padded with spaces to a multiple
/// of 8 bytes as safetensors writes it.
fn header(path: &Path, tensors: &[(String, usize)], sums: &[u32]) -> Result<Vec<u8>> {
    let mut json = serde_json::Map::new();
    let metadata = tensors
        .iter()
        .zip(sums)
        .map(|((name, _), sum)| (name.clone(), serde_json::Value::from(hex(*sum))))
        .collect();
    json.insert("__metadata__".into(), serde_json::Value::Object(metadata));
    let mut offset = 0usize;
    for (name, n) in tensors {
        let end = offset + n * 4;
        json.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": [n], "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut bytes =
        serde_json::to_vec(&json).map_err(|e| RuntimeError::io(path.display(), e.to_string()))?;
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    Ok(bytes)
}

/// A rank file being written: create it with every tensor's name and
/// length, [`RankFileWriter::put`] each tensor's values in order (in as
/// many pieces as convenient), then [`RankFileWriter::finish`]. Failpoints
/// `{op}-write` (when half the data is written) and `{op}-fsync`, as
/// [`durable::write_file`] has them.
pub(crate) struct RankFileWriter {
    path: PathBuf,
    op: &'static str,
    file: std::io::BufWriter<File>,
    tensors: Vec<(String, usize)>,
    sums: Vec<u32>,
    /// The tensor being written, its CRC so far and its values so far.
    current: usize,
    tensor_crc: Crc32c,
    written: usize,
    header_len: usize,
    /// The CRC-32C of the tensors closed so far, back to back.
    data_crc: u32,
    /// The data's bytes written so far, and in all.
    data_bytes: u64,
    total_bytes: u64,
    /// Past half the data: the write failpoint has been passed.
    halfway_passed: bool,
    /// Little-endian bytes of a piece, where the machine's are not.
    bytes: Vec<u8>,
}

/// `values` as little-endian bytes: their own memory on a little-endian
/// machine (every one hybridgen runs on), else converted into `scratch`.
fn le_bytes<'a>(values: &'a [f32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        // SAFETY: an f32 is 4 initialised bytes with no padding, u8 needs
        // no alignment, and the length is the values' bytes.
        unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) }
    } else {
        scratch.clear();
        scratch.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        scratch
    }
}

/// Where `values`' little-endian bytes are read into: their own memory on a
/// little-endian machine, else `scratch` (converted by the caller).
fn le_bytes_mut<'a>(values: &'a mut [f32], scratch: &'a mut Vec<u8>) -> &'a mut [u8] {
    if cfg!(target_endian = "little") {
        // SAFETY: every bit pattern is a valid f32, u8 needs no alignment,
        // and the length is the values' bytes.
        unsafe {
            std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), size_of_val(values))
        }
    } else {
        scratch.clear();
        scratch.resize(size_of_val(values), 0);
        scratch
    }
}

impl RankFileWriter {
    pub(crate) fn create(
        path: &Path,
        op: &'static str,
        tensors: Vec<(String, usize)>,
    ) -> Result<RankFileWriter> {
        let io = |e: std::io::Error| RuntimeError::io(path.display(), e);
        let placeholder = header(path, &tensors, &vec![0; tensors.len()])?;
        let mut file = std::io::BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
        file.write_all(&(placeholder.len() as u64).to_le_bytes())
            .and_then(|()| file.write_all(&placeholder))
            .map_err(io)?;
        let total_bytes = tensors.iter().map(|(_, n)| *n as u64 * 4).sum();
        let mut writer = RankFileWriter {
            path: path.to_path_buf(),
            op,
            file,
            sums: Vec::with_capacity(tensors.len()),
            tensors,
            current: 0,
            tensor_crc: Crc32c::default(),
            written: 0,
            header_len: placeholder.len(),
            data_crc: 0,
            data_bytes: 0,
            total_bytes,
            halfway_passed: false,
            bytes: Vec::new(),
        };
        writer.close_complete_tensors();
        Ok(writer)
    }

    /// Closes the tensors from the current one on that are complete (empty
    /// ones included), recording their checksums.
    fn close_complete_tensors(&mut self) {
        while self.current < self.tensors.len() && self.written == self.tensors[self.current].1 {
            let sum = std::mem::take(&mut self.tensor_crc).finish();
            // The data's checksum from the tensors', so each byte is
            // summed once.
            let len = self.tensors[self.current].1 as u64 * 4;
            self.data_crc = crc32c::combine(self.data_crc, sum, len);
            self.sums.push(sum);
            self.current += 1;
            self.written = 0;
        }
    }

    /// The next `values` of the current tensor (and of the ones after it,
    /// when they run past its end).
    pub(crate) fn put(&mut self, mut values: &[f32]) -> Result<()> {
        while !values.is_empty() {
            let Some((name, n)) = self.tensors.get(self.current) else {
                return Err(RuntimeError::InvalidArgument(format!(
                    "{}: {} values past the last tensor",
                    self.path.display(),
                    values.len()
                )));
            };
            let take = (n - self.written).min(values.len());
            let (now, rest) = values.split_at(take);
            let bytes = le_bytes(now, &mut self.bytes);
            self.file
                .write_all(bytes)
                .map_err(|e| RuntimeError::io(self.path.display(), format!("{name}: {e}")))?;
            self.tensor_crc.update(bytes);
            self.data_bytes += bytes.len() as u64;
            self.written += take;
            values = rest;
            self.close_complete_tensors();
            if !self.halfway_passed && self.data_bytes * 2 >= self.total_bytes {
                self.halfway_passed = true;
                self.file
                    .flush()
                    .map_err(|e| RuntimeError::io(self.path.display(), e))?;
                durable::failpoint(self.op, "write");
            }
        }
        Ok(())
    }

    /// Writes the header with the checksums, fsyncs the file and returns
    /// its size and CRC-32C, for the index. Every tensor must be complete.
    pub(crate) fn finish(self) -> Result<(u64, u32)> {
        let io = |e: std::io::Error| RuntimeError::io(self.path.display(), e);
        if let Some((name, n)) = self.tensors.get(self.current) {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: tensor `{name}` got {} of its {n} values",
                self.path.display(),
                self.written
            )));
        }
        if !self.halfway_passed {
            durable::failpoint(self.op, "write");
        }
        let header = header(&self.path, &self.tensors, &self.sums)?;
        // The checksums' hex digits are as wide as the placeholders', so
        // every offset stands.
        if header.len() != self.header_len {
            return Err(RuntimeError::InvalidArgument(format!(
                "{}: the header changed length ({} -> {} bytes)",
                self.path.display(),
                self.header_len,
                header.len()
            )));
        }
        let mut file = self.file.into_inner().map_err(|e| io(e.into_error()))?;
        file.seek(SeekFrom::Start(8))
            .and_then(|_| file.write_all(&header))
            .map_err(io)?;
        let mut head = Crc32c::default();
        head.update(&(header.len() as u64).to_le_bytes());
        head.update(&header);
        let crc = crc32c::combine(head.finish(), self.data_crc, self.data_bytes);
        durable::failpoint(self.op, "fsync");
        file.sync_all().map_err(io)?;
        Ok((8 + header.len() as u64 + self.data_bytes, crc))
    }
}

/// Where one tensor of a rank file is, and its own checksum.
#[derive(Clone)]
pub(crate) struct StoredTensor {
    pub start: u64,
    pub len: u64,
    pub crc32c: Option<String>,
}

/// A rank file checked whole against the index: its tensors by name.
pub(crate) type StoredTensors = BTreeMap<String, StoredTensor>;

/// Checks rank file `name` of checkpoint `dir` against the index's size and
/// CRC-32C, reading it a chunk at a time, and returns where its F32
/// tensors are. A file whose checksum fails is searched for the damage:
/// the first tensor whose bytes no longer match their own checksum, or
/// the header.
pub(crate) fn checked(dir: &Path, name: &str, entry: &FileEntry) -> Result<StoredTensors> {
    let path = dir.join(name);
    let io = |e: String| RuntimeError::io(path.display(), e);
    let damaged = |what: String| {
        io(format!(
            "{what}. The checkpoint is damaged; {}",
            root::other_step_hint(dir)
        ))
    };
    let mut file = File::open(&path).map_err(|e| io(e.to_string()))?;
    let len = file.metadata().map_err(|e| io(e.to_string()))?.len();
    if len != entry.bytes {
        return Err(damaged(format!(
            "{len} bytes, but the index records {}",
            entry.bytes
        )));
    }
    let mut crc = Crc32c::default();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| io(e.to_string()))?;
        if n == 0 {
            break;
        }
        crc.update(&buf[..n]);
    }
    let sum = hex(crc.finish());
    let tensors = read_header(&mut file, len).map(|header| header.tensors);
    if sum != entry.crc32c {
        let site = match &tensors {
            Err(_) => "its safetensors header is damaged".to_string(),
            Ok(tensors) => damage_site(&mut file, tensors).map_err(|e| io(e.to_string()))?,
        };
        return Err(damaged(format!(
            "checksum mismatch (the index records CRC-32C {}, the file's bytes give {sum}); {site}",
            entry.crc32c
        )));
    }
    tensors.map_err(damaged)
}

/// Rank file `name` of checkpoint `dir`, opened against the index without
/// reading its data: its size, and its CRC-32C as the index records it
/// rebuilt from the header's bytes and the checksums the header records
/// for its tensors ([`crc32c::combine`], as the writer made it). That
/// vouches for every tensor's own checksum, which [`read_tensor`] checks
/// as it reads the tensor, so a resume reads each byte once rather than
/// once to check the file and again to load it. A file this does not
/// vouch for (a damaged header, a tensor without its checksum, gaps
/// between tensors) is checked whole by [`checked`], which also says where
/// the damage is.
pub(crate) fn opened(dir: &Path, name: &str, entry: &FileEntry) -> Result<StoredTensors> {
    let path = dir.join(name);
    let mut file = File::open(&path).map_err(|e| RuntimeError::io(path.display(), e))?;
    let len = file
        .metadata()
        .map_err(|e| RuntimeError::io(path.display(), e))?
        .len();
    if len == entry.bytes
        && let Ok(header) = read_header(&mut file, len)
        && combined_crc(&header, len).is_some_and(|crc| hex(crc) == entry.crc32c)
    {
        return Ok(header.tensors);
    }
    checked(dir, name, entry)
}

/// A file's CRC-32C from its header's and its tensors' own, where the
/// tensors, each with its checksum, fill the data back to back from the
/// header's end to the file's (`len`).
fn combined_crc(header: &RankFileHeader, len: u64) -> Option<u32> {
    let mut in_file: Vec<&StoredTensor> = header.tensors.values().collect();
    // Empty tensors first where they share an offset with the next one.
    in_file.sort_by_key(|t| (t.start, t.len));
    let (mut crc, mut at) = (header.crc32c, header.data_start);
    for tensor in in_file {
        let sum = u32::from_str_radix(tensor.crc32c.as_deref()?, 16).ok()?;
        if tensor.start != at {
            return None;
        }
        crc = crc32c::combine(crc, sum, tensor.len);
        at += tensor.len;
    }
    (at == len).then_some(crc)
}

/// A rank file's header as read: its tensors, where its data starts, and
/// the CRC-32C of its bytes (the length prefix included).
struct RankFileHeader {
    tensors: StoredTensors,
    data_start: u64,
    crc32c: u32,
}

/// A rank file's header: the tensors it lists (F32 only, each inside the
/// file), where the data starts and the header's own checksum; `Err` says
/// what is wrong with the header.
fn read_header(file: &mut File, len: u64) -> std::result::Result<RankFileHeader, String> {
    let mut prefix = [0u8; 8];
    file.seek(SeekFrom::Start(0))
        .and_then(|_| file.read_exact(&mut prefix))
        .map_err(|_| "no safetensors header".to_string())?;
    let header_len = Header::length(prefix, len)?;
    let mut bytes = vec![0u8; header_len as usize];
    file.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    let mut head_crc = Crc32c::default();
    head_crc.update(&prefix);
    head_crc.update(&bytes);
    let header = Header::parse(&bytes)?;
    let mut out = BTreeMap::new();
    for (tensor, info) in &header.tensors {
        if info.get("dtype").and_then(|d| d.as_str()) != Some("F32") {
            return Err(format!("{tensor} is not F32"));
        }
        let offsets = header
            .range(info, len)
            .ok_or_else(|| format!("{tensor} has no byte range inside the file"))?;
        out.insert(
            tensor.clone(),
            StoredTensor {
                start: header.data_start + offsets.0,
                len: offsets.1 - offsets.0,
                crc32c: header
                    .metadata
                    .get(tensor)
                    .and_then(|v| v.as_str())
                    .map(str::to_string),
            },
        );
    }
    Ok(RankFileHeader {
        tensors: out,
        data_start: header.data_start,
        crc32c: head_crc.finish(),
    })
}

/// Where the damage is in a rank file whose checksum failed but whose
/// header parses: the first tensor (by name) whose bytes do not match its
/// own checksum, or else the header.
fn damage_site(file: &mut File, tensors: &StoredTensors) -> std::io::Result<String> {
    let mut buf = vec![0u8; 1 << 20];
    for (name, stored) in tensors {
        let Some(want) = &stored.crc32c else { continue };
        file.seek(SeekFrom::Start(stored.start))?;
        let mut crc = Crc32c::default();
        let mut left = stored.len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            file.read_exact(&mut buf[..n])?;
            crc.update(&buf[..n]);
            left -= n as u64;
        }
        if *want != hex(crc.finish()) {
            return Ok(format!("the damage is in tensor `{name}`"));
        }
    }
    Ok(
        "every tensor's data matches its own checksum, so the damage is in the file's header"
            .to_string(),
    )
}

/// Tensor `name` of rank file `path` (opened by [`opened`] or [`checked`]):
/// its values, after its bytes are checked against its own checksum (the
/// one check of its data after [`opened`]; the file may also have changed
/// since it was checked).
pub(crate) fn read_tensor(path: &Path, name: &str, stored: &StoredTensor) -> Result<Vec<f32>> {
    let io = |e: String| RuntimeError::io(path.display(), e);
    let mut file = File::open(path).map_err(|e| io(e.to_string()))?;
    file.seek(SeekFrom::Start(stored.start))
        .map_err(|e| io(format!("{name}: {e}")))?;
    let mut out = vec![0.0f32; (stored.len / 4) as usize];
    let mut crc = Crc32c::default();
    let mut scratch = Vec::new();
    for part in out.chunks_mut(CHUNK) {
        let bytes = le_bytes_mut(part, &mut scratch);
        file.read_exact(bytes)
            .map_err(|e| io(format!("{name}: {e}")))?;
        crc.update(bytes);
        if cfg!(target_endian = "big") {
            for (v, c) in part.iter_mut().zip(scratch.chunks_exact(4)) {
                *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
    let sum = hex(crc.finish());
    if let Some(want) = &stored.crc32c
        && *want != sum
    {
        return Err(io(format!(
            "checksum mismatch (the header records CRC-32C {want} for tensor `{name}`, its bytes give {sum}); the damage is in tensor `{name}`. The checkpoint is damaged (or changed while it was read); {}",
            root::other_step_hint(path.parent().unwrap_or(Path::new(".")))
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("hybridgen-stream-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Values of order one, different in every tensor and place.
    fn values(t: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (t * 7919 + i) as f32 * 0.37 - 11.0)
            .collect()
    }

    /// Tensors of every kind of length: empty ones (first, between, last),
    /// short ones, and ones longer than a chunk.
    fn tensors() -> Vec<(String, usize)> {
        [0, 5, CHUNK + 3, 0, 1, 2 * CHUNK, 17, 0]
            .iter()
            .enumerate()
            .map(|(t, &n)| (format!("t{t:02}"), n))
            .collect()
    }

    /// Writes `tensors()` in pieces of `piece` values (a piece may span
    /// tensors) and returns the file's path and the writer's entry.
    fn write(dir: &Path, piece: usize) -> (PathBuf, FileEntry) {
        let path = dir.join("rank-00000.safetensors");
        let all: Vec<f32> = tensors()
            .iter()
            .enumerate()
            .flat_map(|(t, (_, n))| values(t, *n))
            .collect();
        let mut writer = RankFileWriter::create(&path, "rank-file", tensors()).unwrap();
        for part in all.chunks(piece) {
            writer.put(part).unwrap();
        }
        let (bytes, crc) = writer.finish().unwrap();
        (
            path,
            FileEntry {
                bytes,
                crc32c: hex(crc),
            },
        )
    }

    /// The file is safetensors as the crate reads it; each tensor's
    /// checksum in the metadata is its bytes'; the size and CRC-32C the
    /// writer reports are the file's, however the values came in.
    #[test]
    fn a_streamed_file_is_safetensors_with_its_checksums() {
        let dir = scratch("write");
        for piece in [1_000_003, CHUNK, 3 * CHUNK] {
            let (path, entry) = write(&dir, piece);
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(entry.bytes, bytes.len() as u64);
            assert_eq!(
                entry.crc32c,
                hex(crc32c::crc32c(&bytes)),
                "pieces of {piece}"
            );
            let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
            let sums = metadata.metadata().clone().unwrap();
            let file = SafeTensors::deserialize(&bytes).unwrap();
            for (t, (name, n)) in tensors().iter().enumerate() {
                let view = file.tensor(name).unwrap();
                assert_eq!(view.shape(), [*n]);
                let want: Vec<u8> = values(t, *n).iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(view.data(), want.as_slice(), "{name}");
                assert_eq!(sums[name], hex(crc32c::crc32c(&want)), "{name}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Reading back: the file checked whole, each tensor read alone.
    #[test]
    fn a_checked_file_gives_back_every_tensor() {
        let dir = scratch("read");
        let (path, entry) = write(&dir, 777_777);
        let stored = checked(&dir, "rank-00000.safetensors", &entry).unwrap();
        assert_eq!(stored.len(), tensors().len());
        for (t, (name, n)) in tensors().iter().enumerate() {
            assert_eq!(
                read_tensor(&path, name, &stored[name]).unwrap(),
                values(t, *n)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Damage is found and placed: a byte of a tensor's data names the
    /// tensor; a byte of the header says so; a tensor read after its file
    /// changed is refused.
    #[test]
    fn damage_is_found_and_placed() {
        let dir = scratch("damage");
        let (path, entry) = write(&dir, CHUNK);
        let stored = checked(&dir, "rank-00000.safetensors", &entry).unwrap();
        let original = std::fs::read(&path).unwrap();
        let flip = |at: u64| {
            let mut bytes = original.clone();
            bytes[at as usize] ^= 0x10;
            std::fs::write(&path, bytes).unwrap();
        };
        flip(stored["t05"].start + 123);
        let err = checked(&dir, "rank-00000.safetensors", &entry)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
        assert!(err.contains("the damage is in tensor `t05`"), "{err}");
        let err = read_tensor(&path, "t05", &stored["t05"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("the damage is in tensor `t05`"), "{err}");
        flip(20);
        let err = checked(&dir, "rank-00000.safetensors", &entry)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("header"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Opening a file reads its header only: a file whose data is damaged
    /// opens, and the damaged tensor is refused when it is read (while
    /// the others read back), so a resume reads each byte once. Damage
    /// in the header, or a size that is not the index's, is refused on
    /// opening, with the same words as [`checked`].
    #[test]
    fn opening_reads_the_header_and_reading_checks_each_tensor() {
        let dir = scratch("open");
        let name = "rank-00000.safetensors";
        let (path, entry) = write(&dir, CHUNK);
        let stored = opened(&dir, name, &entry).unwrap();
        assert_eq!(stored.len(), tensors().len());
        let original = std::fs::read(&path).unwrap();
        let write_flipped = |at: u64| {
            let mut bytes = original.clone();
            bytes[at as usize] ^= 0x10;
            std::fs::write(&path, bytes).unwrap();
        };
        write_flipped(stored["t02"].start + 4 * CHUNK as u64);
        let stored = opened(&dir, name, &entry).unwrap();
        let err = read_tensor(&path, "t02", &stored["t02"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
        assert!(err.contains("the damage is in tensor `t02`"), "{err}");
        assert_eq!(
            read_tensor(&path, "t05", &stored["t05"]).unwrap(),
            values(5, 2 * CHUNK)
        );
        write_flipped(20);
        let err = opened(&dir, name, &entry).err().unwrap().to_string();
        assert!(
            err.contains("checksum mismatch") && err.contains("header"),
            "{err}"
        );
        std::fs::write(&path, &original).unwrap();
        let other = FileEntry {
            crc32c: hex(0x1234_5678),
            ..entry.clone()
        };
        let err = opened(&dir, name, &other).err().unwrap().to_string();
        assert!(err.contains("the index records CRC-32C 12345678"), "{err}");
        std::fs::write(&path, &original[..original.len() - 1]).unwrap();
        let err = opened(&dir, name, &entry).err().unwrap().to_string();
        assert!(err.contains("but the index records"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The file's checksum rebuilt from the header's tensors is the file's
    /// own, however its tensors fall (empty ones between, first and last).
    #[test]
    fn the_checksum_from_the_header_is_the_files() {
        let dir = scratch("combined");
        let (path, entry) = write(&dir, 1_000_003);
        let mut file = File::open(&path).unwrap();
        let header = read_header(&mut file, entry.bytes).unwrap();
        let crc = combined_crc(&header, entry.bytes).unwrap();
        assert_eq!(hex(crc), entry.crc32c);
        assert_eq!(combined_crc(&header, entry.bytes + 4), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Values past the last tensor, and a tensor left short, are refused.
    #[test]
    fn every_tensor_gets_exactly_its_values() {
        let dir = scratch("counts");
        let path = dir.join("f.safetensors");
        let two = vec![("a".to_string(), 2), ("b".to_string(), 1)];
        let mut writer = RankFileWriter::create(&path, "rank-file", two.clone()).unwrap();
        let err = writer.put(&[1.0; 4]).unwrap_err().to_string();
        assert!(err.contains("past the last tensor"), "{err}");
        let mut writer = RankFileWriter::create(&path, "rank-file", two).unwrap();
        writer.put(&[1.0; 2]).unwrap();
        let err = writer.finish().unwrap_err().to_string();
        assert!(err.contains("tensor `b` got 0 of its 1 values"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

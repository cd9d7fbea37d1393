//! A file's bytes as tokens.

use super::Xoshiro256;
use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use std::path::Path;
use std::sync::Arc;

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
    pub(super) name: String,
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
    pub(super) fn sample_window(&self, rng: &mut Xoshiro256, out: &mut [u32]) -> Result<()> {
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

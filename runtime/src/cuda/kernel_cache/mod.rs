//! Compiled kernels kept so that NVRTC runs once, not at every start-up.
//!
//! Compiling every `kernels/*.cu` source takes about two seconds, so the
//! images are kept at two levels:
//!
//! - **In the process.** [`compile_all_once`] compiles [`SOURCES`] once per
//!   target and include directory; when one process drives several GPUs
//!   (a thread per GPU, each building a
//!   [`KernelSet`](crate::cuda::KernelSet)), the first thread compiles and
//!   the others wait for it and share the images.
//! - **On disk.** [`load_or_compile`] looks for a file holding the images
//!   for exactly these inputs and loads it instead of compiling; after a
//!   compilation it writes one. The next process (or each of the 8 ranks
//!   `torchrun` starts) loads it in milliseconds.
//!
//! # Where
//!
//! `$HYBRIDGEN_KERNEL_CACHE` when set (empty or `off` turns the disk cache
//! off), else `$XDG_CACHE_HOME/hybridgen/kernels`, else
//! `$HOME/.cache/hybridgen/kernels` ([`CacheLocation::from_env`]). The
//! files there are loaded onto the GPU as code: point the variable only at
//! a directory that you alone can write. The cache never fails a run: a
//! directory that cannot be created or written means the kernels are
//! compiled as if there were no cache, with a one-line notice on stderr.
//!
//! # The key
//!
//! A file is used only for the inputs it was compiled from: a 128-bit
//! FNV-1a hash ([`CacheKey`]) of the hybridgen version, NVRTC's version,
//! the target architecture and output, every compile option (the include
//! directory among them), the text of every source and of `common.cuh`,
//! and the text of the CUDA headers they include (`cuda_bf16.h` and the
//! fp16/bf16 headers behind it, which change with the toolkit's patch
//! release while NVRTC's version does not). FNV is not a cryptographic
//! hash; it need only tell honest inputs apart, and at 128 bits a chance
//! collision is out of reach. Editing a kernel, upgrading CUDA or
//! installing a new hybridgen changes the key, so a stale image is never
//! loaded.
//!
//! # The file
//!
//! `hybridgen-kernels-{arch}-{key as 32 hex digits}.bin`:
//!
//! ```text
//! magic "HGKERNEL" | format u32 | CRC-32C of the payload u32 |
//! key u128 | payload length u64 | payload
//! payload: source count u32, then per source:
//!          name length u32, name, image length u64, image
//! ```
//!
//! (little-endian). A file whose magic, format, key, length, checksum or
//! source names do not match is not loaded; the kernels are compiled and
//! the file is replaced. Writes go to a temporary file in the same
//! directory, are fsynced and renamed over the entry, so a reader sees a
//! whole file or none, and writers racing (every rank of a fresh job) each
//! leave a whole file. After a write, entries for the same architecture
//! under another key (an older hybridgen or CUDA) are deleted, as are
//! temporary files left for over an hour by a writer that died; only files
//! named as above are ever deleted.
//!
//! A compilation with warnings is not stored: a cache hit reports no
//! warnings, so storing one would hide them.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::hash::Hash;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use crate::checkpoint::crc32c::crc32c;
use crate::cuda::kernels::{
    self, CompiledSource, HEADERS, KernelBuildError, KernelSource, Output, SOURCES, Target,
};

/// The variable naming the cache directory; empty or `off` turns the disk
/// cache off.
pub const CACHE_ENV: &str = "HYBRIDGEN_KERNEL_CACHE";

/// The CUDA headers (in the include directory) whose text is part of the
/// key: `common.cuh` includes `cuda_bf16.h`, which includes the others.
const TOOLKIT_HEADERS: &[&str] = &[
    "cuda_bf16.h",
    "cuda_bf16.hpp",
    "cuda_fp16.h",
    "cuda_fp16.hpp",
];

const FILE_PREFIX: &str = "hybridgen-kernels-";
const FILE_SUFFIX: &str = ".bin";
const TEMP_MARKER: &str = ".tmp-";
const MAGIC: &[u8; 8] = b"HGKERNEL";
const FORMAT: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 4 + 16 + 8;
/// No kernel set comes near this; a bigger file is not ours to read.
const MAX_FILE_LEN: u64 = 1 << 30;
/// Writing an entry takes milliseconds; a temporary file this old belongs
/// to a writer that died.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// Where the compiled kernels are kept on disk, if anywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheLocation {
    /// This directory (created when first written).
    Dir(PathBuf),
    /// Turned off: `HYBRIDGEN_KERNEL_CACHE` is empty or `off`.
    Disabled,
    /// No directory could be derived (the reason).
    Unavailable(String),
}

impl CacheLocation {
    /// From `$HYBRIDGEN_KERNEL_CACHE`, `$XDG_CACHE_HOME` and `$HOME`.
    pub fn from_env() -> CacheLocation {
        CacheLocation::from_vars(
            std::env::var_os(CACHE_ENV),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        )
    }

    /// [`from_env`](Self::from_env) with the variables' values given
    /// (`None`: unset). Like the XDG specification, a relative
    /// `XDG_CACHE_HOME` (or `HOME`) is ignored; `HYBRIDGEN_KERNEL_CACHE` is
    /// taken as written.
    pub fn from_vars(
        setting: Option<OsString>,
        xdg_cache_home: Option<OsString>,
        home: Option<OsString>,
    ) -> CacheLocation {
        if let Some(setting) = setting {
            if setting.is_empty() || setting.eq_ignore_ascii_case("off") {
                return CacheLocation::Disabled;
            }
            return CacheLocation::Dir(PathBuf::from(setting));
        }
        let absolute =
            |value: Option<OsString>| value.map(PathBuf::from).filter(|path| path.is_absolute());
        if let Some(xdg) = absolute(xdg_cache_home) {
            return CacheLocation::Dir(xdg.join("hybridgen").join("kernels"));
        }
        if let Some(home) = absolute(home) {
            return CacheLocation::Dir(home.join(".cache").join("hybridgen").join("kernels"));
        }
        CacheLocation::Unavailable(format!(
            "none of {CACHE_ENV}, XDG_CACHE_HOME or HOME is set to a usable directory"
        ))
    }
}

/// What the disk cache did for one [`load_or_compile`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from this file; nothing was compiled.
    Hit { path: PathBuf },
    /// Compiled and written to `path`. `replaced` says why a file already
    /// there was not loaded (corrupt, truncated, another format or key).
    Stored {
        path: PathBuf,
        replaced: Option<String>,
    },
    /// Compiled, but `path` could not be written (why).
    NotStored { path: PathBuf, why: String },
    /// Compiled, and not stored because this source compiled with
    /// warnings (in its [`CompiledSource::warnings`]), which a hit would
    /// not report.
    HasWarnings { file: &'static str },
    /// Compiled; the disk cache is turned off.
    Disabled,
    /// Compiled; there is no directory to cache in (why).
    Unavailable(String),
}

impl CacheOutcome {
    /// What the user should hear about: the cache could not be used
    /// though it was not turned off. `None` otherwise.
    pub fn notice(&self) -> Option<String> {
        let how = format!(
            "the kernels are compiled again at every start-up; set {CACHE_ENV} to a writable \
             directory, or to `off` to silence this"
        );
        match self {
            CacheOutcome::NotStored { path, why } => Some(format!(
                "the kernel cache {} could not be written ({why}); {how}",
                path.display()
            )),
            CacheOutcome::Unavailable(why) => Some(format!("no kernel cache ({why}); {how}")),
            CacheOutcome::Hit { .. }
            | CacheOutcome::Stored { .. }
            | CacheOutcome::HasWarnings { .. }
            | CacheOutcome::Disabled => None,
        }
    }
}

/// Every source compiled for one target, and where the images came from.
#[derive(Clone, Debug)]
pub struct CompiledKernels {
    /// In the order of the sources given.
    pub sources: Vec<CompiledSource>,
    pub cache: CacheOutcome,
}

/// The identity of a compilation's inputs; see the module docs for what
/// goes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey(u128);

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl CacheKey {
    /// The key of compiling `sources` for `target` with the headers in
    /// `include_dir` by NVRTC `nvrtc_version`. Reads the toolkit headers;
    /// one that cannot be read counts as absent (NVRTC will say more).
    pub fn new(
        sources: &[KernelSource],
        target: Target,
        include_dir: &Path,
        nvrtc_version: (i32, i32),
    ) -> CacheKey {
        let toolkit_headers: Vec<(&str, Option<Vec<u8>>)> = TOOLKIT_HEADERS
            .iter()
            .map(|&name| (name, fs::read(include_dir.join(name)).ok()))
            .collect();
        KeyInputs {
            hybridgen_version: env!("CARGO_PKG_VERSION"),
            nvrtc_version,
            target,
            options: &kernels::compile_options(target, include_dir),
            headers: HEADERS,
            toolkit_headers: &toolkit_headers,
            sources,
        }
        .key()
    }
}

/// Everything a compiled image depends on.
struct KeyInputs<'a> {
    hybridgen_version: &'a str,
    nvrtc_version: (i32, i32),
    target: Target,
    options: &'a [String],
    headers: &'a [(&'a str, &'a str)],
    toolkit_headers: &'a [(&'a str, Option<Vec<u8>>)],
    sources: &'a [KernelSource],
}

impl KeyInputs<'_> {
    fn key(&self) -> CacheKey {
        let mut hash = Fnv1a128::new();
        // Every field is length-prefixed (and lists counted), so no two
        // different inputs hash the same bytes.
        hash.field(b"hybridgen kernel cache key 1");
        hash.field(self.hybridgen_version.as_bytes());
        hash.field(&self.nvrtc_version.0.to_le_bytes());
        hash.field(&self.nvrtc_version.1.to_le_bytes());
        hash.field(self.target.arch.as_bytes());
        hash.field(match self.target.output {
            Output::Cubin => b"cubin",
            Output::Ptx => b"ptx",
        });
        hash.count(self.options.len());
        for option in self.options {
            hash.field(option.as_bytes());
        }
        hash.count(self.headers.len());
        for (name, text) in self.headers {
            hash.field(name.as_bytes());
            hash.field(text.as_bytes());
        }
        hash.count(self.toolkit_headers.len());
        for (name, text) in self.toolkit_headers {
            hash.field(name.as_bytes());
            match text {
                Some(text) => {
                    hash.field(b"present");
                    hash.field(text);
                }
                None => hash.field(b"absent"),
            }
        }
        hash.count(self.sources.len());
        for source in self.sources {
            hash.field(source.file.as_bytes());
            hash.field(source.text.as_bytes());
            hash.count(source.entry_points.len());
            for entry in source.entry_points {
                hash.field(entry.as_bytes());
            }
        }
        CacheKey(hash.0)
    }
}

/// FNV-1a with 128-bit state: a few lines, no dependency, and wide enough
/// that distinct inputs do not collide by chance.
struct Fnv1a128(u128);

impl Fnv1a128 {
    const OFFSET_BASIS: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;

    fn new() -> Self {
        Fnv1a128(Self::OFFSET_BASIS)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 ^= u128::from(byte);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    fn count(&mut self, n: usize) {
        self.bytes(&(n as u64).to_le_bytes());
    }

    fn field(&mut self, bytes: &[u8]) {
        self.count(bytes.len());
        self.bytes(bytes);
    }
}

/// Every source in [`SOURCES`] compiled for `target`, once per process:
/// the first caller for a target and include directory loads the images
/// from the disk cache or compiles them; every later caller (the other
/// GPUs' threads) gets the same images. A failed compilation is not kept,
/// so a later call tries again. Prints the cache's [notice] on stderr
/// when it could not be used.
///
/// [notice]: CacheOutcome::notice
pub fn compile_all_once(
    target: Target,
    include_dir: &Path,
) -> Result<Arc<CompiledKernels>, KernelBuildError> {
    static COMPILED: OnceLock<Memo<(Target, PathBuf), CompiledKernels>> = OnceLock::new();
    COMPILED
        .get_or_init(Memo::new)
        .get_or_try_make((target, include_dir.to_path_buf()), || {
            let compiled =
                load_or_compile(&CacheLocation::from_env(), SOURCES, target, include_dir)?;
            if let Some(notice) = compiled.cache.notice() {
                eprintln!("hybridgen: {notice}");
            }
            Ok(compiled)
        })
}

/// `sources` compiled for `target`: loaded from `location` when it holds
/// them under their [`CacheKey`], else compiled with NVRTC and stored
/// there. Fails only when compiling fails; a cache that cannot be read or
/// written is reported in [`CompiledKernels::cache`].
pub fn load_or_compile(
    location: &CacheLocation,
    sources: &[KernelSource],
    target: Target,
    include_dir: &Path,
) -> Result<CompiledKernels, KernelBuildError> {
    let nvrtc_version = kernels::nvrtc_version()?;
    let key = CacheKey::new(sources, target, include_dir, nvrtc_version);
    load_or_compile_with(location, key, sources, target, |source| {
        kernels::compile(source, target, include_dir)
    })
}

/// [`load_or_compile`] with the key computed and the compiler given (the
/// tests count its calls); sources are compiled at once
/// ([`kernels::compile_each`]).
fn load_or_compile_with(
    location: &CacheLocation,
    key: CacheKey,
    sources: &[KernelSource],
    target: Target,
    compile: impl Fn(&KernelSource) -> Result<CompiledSource, KernelBuildError> + Sync,
) -> Result<CompiledKernels, KernelBuildError> {
    let dir = match location {
        CacheLocation::Dir(dir) => dir,
        CacheLocation::Disabled => {
            return Ok(CompiledKernels {
                sources: kernels::compile_each(sources, compile)?,
                cache: CacheOutcome::Disabled,
            });
        }
        CacheLocation::Unavailable(why) => {
            return Ok(CompiledKernels {
                sources: kernels::compile_each(sources, compile)?,
                cache: CacheOutcome::Unavailable(why.clone()),
            });
        }
    };
    let path = dir.join(entry_name(target, key));
    let replaced = match read_entry(&path, key, sources, target) {
        Ok(Some(compiled)) => {
            return Ok(CompiledKernels {
                sources: compiled,
                cache: CacheOutcome::Hit { path },
            });
        }
        Ok(None) => None,
        Err(why) => Some(why),
    };
    let compiled: Vec<CompiledSource> = kernels::compile_each(sources, compile)?;
    let cache = if let Some(noisy) = compiled.iter().find(|c| !c.warnings.is_empty()) {
        CacheOutcome::HasWarnings { file: noisy.file }
    } else {
        match write_entry(dir, &path, &encode(key, &compiled)) {
            Ok(()) => {
                prune(dir, target, key);
                CacheOutcome::Stored { path, replaced }
            }
            Err(why) => CacheOutcome::NotStored { path, why },
        }
    };
    Ok(CompiledKernels {
        sources: compiled,
        cache,
    })
}

/// The file holding `target`'s kernels under `key`.
fn entry_name(target: Target, key: CacheKey) -> String {
    format!("{FILE_PREFIX}{}-{key}{FILE_SUFFIX}", target.arch)
}

/// A file name this module writes: an entry or a temporary file.
#[derive(Debug, PartialEq, Eq)]
struct OwnFile<'a> {
    arch: &'a str,
    key: CacheKey,
    temporary: bool,
}

impl OwnFile<'_> {
    /// `hybridgen-kernels-{arch}-{32 hex}.bin`, optionally followed by
    /// `.tmp-{pid}-{n}`; anything else is not ours.
    fn parse(name: &str) -> Option<OwnFile<'_>> {
        let rest = name.strip_prefix(FILE_PREFIX)?;
        let (stem, tail) = rest.split_once(FILE_SUFFIX)?;
        let (arch, hex) = stem.rsplit_once('-')?;
        let arch_ok = !arch.is_empty()
            && arch
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        let hex_ok = hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !arch_ok || !hex_ok {
            return None;
        }
        let key = CacheKey(u128::from_str_radix(hex, 16).ok()?);
        let temporary = match tail {
            "" => false,
            _ => {
                let (pid, n) = tail.strip_prefix(TEMP_MARKER)?.split_once('-')?;
                let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
                if !digits(pid) || !digits(n) {
                    return None;
                }
                true
            }
        };
        Some(OwnFile {
            arch,
            key,
            temporary,
        })
    }
}

/// The file's images if it is a valid entry for `key`; `Ok(None)` when
/// there is no file; `Err(why)` when there is one that must not be loaded.
fn read_entry(
    path: &Path,
    key: CacheKey,
    sources: &[KernelSource],
    target: Target,
) -> Result<Option<Vec<CompiledSource>>, String> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot be opened: {e}")),
    };
    let len = file
        .metadata()
        .map_err(|e| format!("cannot be read: {e}"))?
        .len();
    if len > MAX_FILE_LEN {
        return Err(format!("{len} bytes, more than a kernel cache file holds"));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.read_to_end(&mut bytes)
        .map_err(|e| format!("cannot be read: {e}"))?;
    decode(&bytes, key, sources, target).map(Some)
}

/// The file for `compiled` under `key`.
fn encode(key: CacheKey, compiled: &[CompiledSource]) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&(compiled.len() as u32).to_le_bytes());
    for unit in compiled {
        payload.extend_from_slice(&(unit.file.len() as u32).to_le_bytes());
        payload.extend_from_slice(unit.file.as_bytes());
        payload.extend_from_slice(&(unit.image.len() as u64).to_le_bytes());
        payload.extend_from_slice(&unit.image);
    }
    let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&FORMAT.to_le_bytes());
    bytes.extend_from_slice(&crc32c(&payload).to_le_bytes());
    bytes.extend_from_slice(&key.0.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// The images in a file, checked against everything the header and the
/// sources say; `Err` says what does not match.
fn decode(
    bytes: &[u8],
    key: CacheKey,
    sources: &[KernelSource],
    target: Target,
) -> Result<Vec<CompiledSource>, String> {
    let mut header = Reader(bytes);
    if header.take(MAGIC.len()) != Some(MAGIC.as_slice()) {
        return Err("not a hybridgen kernel cache file (wrong magic)".to_string());
    }
    let short = || format!("truncated: {} bytes, shorter than the header", bytes.len());
    let format = header.u32().ok_or_else(short)?;
    if format != FORMAT {
        return Err(format!(
            "format {format}, where this hybridgen reads format {FORMAT}"
        ));
    }
    let checksum = header.u32().ok_or_else(short)?;
    let stored_key = CacheKey(u128::from_le_bytes(header.array().ok_or_else(short)?));
    if stored_key != key {
        return Err(format!("holds key {stored_key}, not {key}"));
    }
    let payload_len = header.u64().ok_or_else(short)?;
    let payload = header.0;
    if payload.len() as u64 != payload_len {
        return Err(format!(
            "truncated or extended: the header says {payload_len} payload bytes, the file \
             holds {}",
            payload.len()
        ));
    }
    if crc32c(payload) != checksum {
        return Err("corrupt: the payload's CRC-32C does not match the header's".to_string());
    }
    // The checksum matched, so what follows was written by `encode`; these
    // checks guard against a writer's bug, not against the disk.
    let mut payload = Reader(payload);
    let malformed = || "malformed payload".to_string();
    let count = payload.u32().ok_or_else(malformed)? as usize;
    if count != sources.len() {
        return Err(format!("holds {count} sources, not {}", sources.len()));
    }
    let mut compiled = Vec::with_capacity(count);
    for source in sources {
        let name_len = payload.u32().ok_or_else(malformed)? as usize;
        let name = payload.take(name_len).ok_or_else(malformed)?;
        if name != source.file.as_bytes() {
            return Err(format!(
                "holds {} where {} was expected",
                String::from_utf8_lossy(name),
                source.file
            ));
        }
        let image_len =
            usize::try_from(payload.u64().ok_or_else(malformed)?).map_err(|_| malformed())?;
        let image = payload.take(image_len).ok_or_else(malformed)?;
        compiled.push(CompiledSource {
            file: source.file,
            target,
            image: image.to_vec(),
            warnings: Vec::new(),
        });
    }
    if !payload.0.is_empty() {
        return Err(malformed());
    }
    Ok(compiled)
}

/// Little-endian fields off the front of a byte slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Writes `bytes` as `path` atomically: to a new temporary file in `dir`,
/// fsynced, renamed over `path`, the directory fsynced. A concurrent
/// writer of the same entry writes its own temporary file, so whichever
/// rename comes last leaves a whole file (both hold the same images).
fn write_entry(dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), String> {
    static TEMP_SEQUENCE: AtomicU64 = AtomicU64::new(0);
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{} is not an entry path", path.display()))?;
    let mut attempts = 0;
    let (temp, mut file) = loop {
        let n = TEMP_SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let temp = dir.join(format!("{name}{TEMP_MARKER}{}-{n}", std::process::id()));
        attempts += 1;
        match OpenOptions::new().write(true).create_new(true).open(&temp) {
            Ok(file) => break (temp, file),
            // Left by a dead process whose id this one reuses: take the
            // next number.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => continue,
            Err(e) => return Err(format!("cannot create {}: {e}", temp.display())),
        }
    };
    let written = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", temp.display()))
        .and_then(|()| {
            drop(file);
            fs::rename(&temp, path).map_err(|e| {
                format!(
                    "cannot rename {} to {}: {e}",
                    temp.display(),
                    path.display()
                )
            })
        });
    if written.is_err() {
        let _ = fs::remove_file(&temp);
        return written;
    }
    // Only durability of the rename is at stake, and a lost entry is only
    // compiled again.
    #[cfg(unix)]
    let _ = File::open(dir).and_then(|d| d.sync_all());
    Ok(())
}

/// Deletes `target`'s entries under keys other than `keep`, and its stale
/// temporary files. Only regular files with this module's names; errors
/// are ignored (another process may be pruning too).
fn prune(dir: &Path, target: Target, keep: CacheKey) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(own) = name.to_str().and_then(OwnFile::parse) else {
            continue;
        };
        if own.arch != target.arch {
            continue;
        }
        // `DirEntry::metadata` does not follow symbolic links: a link is
        // not a file we wrote.
        let Ok(metadata) = entry.metadata() else {
            continue;
        };
        if !metadata.file_type().is_file() {
            continue;
        }
        let obsolete = if own.temporary {
            metadata
                .modified()
                .ok()
                .and_then(|modified| modified.elapsed().ok())
                .is_some_and(|age| age > STALE_TEMP)
        } else {
            own.key != keep
        };
        if obsolete {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Values made once per key and shared: the first caller for a key makes
/// it while later callers for that key wait; callers for other keys do
/// not wait.
struct Memo<K, T> {
    slots: Mutex<HashMap<K, Slot<T>>>,
}

/// One key's value: `None` until made; its lock is held while making it.
type Slot<T> = Arc<Mutex<Option<Arc<T>>>>;

impl<K: Eq + Hash, T> Memo<K, T> {
    fn new() -> Self {
        Memo {
            slots: Mutex::new(HashMap::new()),
        }
    }

    fn get_or_try_make<E>(&self, key: K, make: impl FnOnce() -> Result<T, E>) -> Result<Arc<T>, E> {
        let slot = lock(&self.slots).entry(key).or_default().clone();
        let mut value = lock(&slot);
        if let Some(made) = value.as_ref() {
            return Ok(made.clone());
        }
        let made = Arc::new(make()?);
        *value = Some(made.clone());
        Ok(made)
    }
}

/// A poisoned lock still guards consistent data here: a slot is written
/// only with a whole value.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;

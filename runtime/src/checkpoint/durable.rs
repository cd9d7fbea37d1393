//! File operations that survive a crash at any instant, and the failpoints
//! that prove it.
//!
//! A file is written whole and fsynced before anything refers to it; a
//! rename is followed by an fsync of the directory holding it, so the new
//! name is on disk before the next step relies on it (POSIX makes neither
//! durable by itself).
//!
//! Every write, fsync and rename on the save path passes a failpoint. Setting
//! `HYBRIDGEN_FAILPOINT=<name>` (or `<name>:<nth>`, the nth time it is
//! reached, counted over the whole process) makes the process abort there, as
//! a kill or a power cut would. A write's failpoint sits halfway through the
//! write, so the file it leaves is torn. The check is one load of a cached
//! value, so failpoints stay in release builds, where tests run the real
//! binary.

use crate::error::{Result, RuntimeError};
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that arms a failpoint.
pub const FAILPOINT_ENV: &str = "HYBRIDGEN_FAILPOINT";

/// Every failpoint, in the order a run reaches them: creating the root,
/// taking its lock, then each save (each rank's file, the index, the step
/// directory, `latest`, and `keep_last`'s removal of old steps).
pub const FAILPOINTS: &[&str] = &[
    "root-marker-write",
    "root-marker-fsync",
    "root-marker-rename",
    "root-marker-rename-fsync",
    "lock-write",
    "rank-file-write",
    "rank-file-fsync",
    "index-write",
    "index-fsync",
    "step-dir-fsync",
    "step-rename",
    "step-rename-fsync",
    "latest-write",
    "latest-fsync",
    "latest-rename",
    "latest-rename-fsync",
    "keep-last-rename",
    "keep-last-rename-fsync",
    "keep-last-remove",
];

/// The armed failpoint: its name, which hit aborts, and the hits so far.
struct Armed {
    name: String,
    nth: u64,
    hits: AtomicU64,
}

/// Parses the variable's value: `<name>` or `<name>:<nth>`.
fn parse(value: &str) -> std::result::Result<(String, u64), String> {
    let (name, nth) = match value.split_once(':') {
        Some((name, nth)) => {
            let nth = nth
                .parse::<u64>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| format!("`{nth}` is not a hit count (1, 2, ...)"))?;
            (name, nth)
        }
        None => (value, 1),
    };
    if !FAILPOINTS.contains(&name) {
        return Err(format!(
            "`{name}` is not a failpoint; the failpoints are {}",
            FAILPOINTS.join(", ")
        ));
    }
    Ok((name.to_string(), nth))
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let value = std::env::var(FAILPOINT_ENV).ok()?;
            let (name, nth) = parse(&value).ok()?;
            Some(Armed {
                name,
                nth,
                hits: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Refuses a malformed `HYBRIDGEN_FAILPOINT` before a run starts, rather
/// than letting a typo silently test nothing.
pub fn check_failpoint_env() -> Result<()> {
    match std::env::var(FAILPOINT_ENV) {
        Ok(value) => parse(&value)
            .map(drop)
            .map_err(|e| RuntimeError::InvalidArgument(format!("{FAILPOINT_ENV}={value}: {e}"))),
        Err(_) => Ok(()),
    }
}

/// Failpoint `{op}-{stage}`: aborts the process when it is the armed one
/// and this is its nth hit.
pub(crate) fn failpoint(op: &str, stage: &str) {
    let Some(armed) = armed() else { return };
    debug_assert!(
        FAILPOINTS.contains(&format!("{op}-{stage}").as_str()),
        "failpoint {op}-{stage} is missing from FAILPOINTS"
    );
    let name = &armed.name;
    let matches = name.len() == op.len() + 1 + stage.len()
        && name.starts_with(op)
        && name.ends_with(stage)
        && name.as_bytes()[op.len()] == b'-';
    if matches && armed.hits.fetch_add(1, Ordering::SeqCst) + 1 == armed.nth {
        eprintln!(
            "hybridgen: failpoint {name} reached (hit {}); aborting",
            armed.nth
        );
        std::process::abort();
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::io(path.display(), e)
}

/// Writes `bytes` as file `path` (replacing any file there) and fsyncs it.
/// Failpoints `{op}-write` (halfway) and `{op}-fsync`.
pub(crate) fn write_file(path: &Path, bytes: &[u8], op: &str) -> Result<()> {
    let mut file = File::create(path).map_err(|e| io(path, e))?;
    let half = bytes.len() / 2;
    file.write_all(&bytes[..half]).map_err(|e| io(path, e))?;
    failpoint(op, "write");
    file.write_all(&bytes[half..]).map_err(|e| io(path, e))?;
    failpoint(op, "fsync");
    file.sync_all().map_err(|e| io(path, e))
}

/// Makes directory `dir`'s entries durable. Failpoint `{op}-fsync`.
pub(crate) fn sync_dir(dir: &Path, op: &str) -> Result<()> {
    failpoint(op, "fsync");
    sync_dir_quietly(dir)
}

/// [`sync_dir`] without a failpoint.
pub(crate) fn sync_dir_quietly(dir: &Path) -> Result<()> {
    // Windows cannot open a directory as a file; its renames are durable
    // once they return.
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Renames `from` to `to` (in the same directory) and fsyncs that
/// directory. Failpoints `{op}-rename` and `{op}-rename-fsync`.
pub(crate) fn rename(from: &Path, to: &Path, op: &str) -> Result<()> {
    failpoint(op, "rename");
    std::fs::rename(from, to)
        .map_err(|e| io(to, format!("cannot rename {}: {e}", from.display())))?;
    failpoint(op, "rename-fsync");
    sync_dir_quietly(to.parent().unwrap_or(Path::new(".")))
}

/// Replaces file `path` with `bytes` atomically: written whole to
/// `path.tmp`, fsynced, renamed over `path`, the directory fsynced. Readers
/// see the old file or the new one, never a mix. Failpoints `{op}-write`,
/// `{op}-fsync`, `{op}-rename`, `{op}-rename-fsync`.
pub(crate) fn replace_file(path: &Path, bytes: &[u8], op: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_os_string();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    write_file(&tmp, bytes, op)?;
    rename(&tmp, path, op)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_names_a_known_failpoint_and_a_positive_hit() {
        assert_eq!(parse("index-fsync"), Ok(("index-fsync".into(), 1)));
        assert_eq!(parse("latest-rename:3"), Ok(("latest-rename".into(), 3)));
        assert!(
            parse("index-fsnyc")
                .unwrap_err()
                .contains("not a failpoint")
        );
        assert!(parse("index-fsync:0").unwrap_err().contains("hit count"));
        assert!(parse("index-fsync:x").unwrap_err().contains("hit count"));
    }
}

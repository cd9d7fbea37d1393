//! The checkpoint root a run saves to: one directory per saved step, a
//! `latest` pointer, a marker saying the directory is hybridgen's, and a
//! lock so that one run at a time writes it.
//!
//! ```text
//! DIR/
//!   hybridgen-checkpoints.json   marker: {"format": "hybridgen-checkpoint-root", "version": 1}
//!   lock                         pid, host and start of the run writing DIR (held with an OS file lock)
//!   latest                       "step-000120\n": the newest complete step
//!   step-000100/                 a complete checkpoint (checkpoint.json + rank-NNNNN.safetensors)
//!   step-000120/
//!   step-000140.partial/         a step being written (or left by a crash)
//!   step-000100.deleting/        a step `keep_last` is removing
//! ```
//!
//! A step is written under `step-N.partial`, every file and the directory
//! fsynced, then renamed to `step-N` and the root fsynced: a directory named
//! `step-N` is always complete. `latest` is replaced atomically after that,
//! for people and scripts; a resume scans the step directories, so it also
//! finds a step completed just before a crash kept `latest` from moving.
//! Old steps go (`keep_last`) only after a newer one is complete, renamed
//! to `.deleting` first so a half-removed step is never taken for a
//! checkpoint. Nothing is deleted but what these rules name: a root's other
//! files are left alone, and a directory that is not a root is refused.

use super::durable::{self, failpoint};
use super::index::INDEX;
use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The file that makes a directory a checkpoint root.
pub const ROOT_MARKER: &str = "hybridgen-checkpoints.json";
const ROOT_FORMAT: &str = "hybridgen-checkpoint-root";
const ROOT_VERSION: u32 = 1;
/// The pointer to the newest complete step.
pub const LATEST: &str = "latest";
/// The lock file (never removed: removing a lock file races with takers).
pub const LOCK: &str = "lock";
const PARTIAL: &str = ".partial";
const DELETING: &str = ".deleting";

/// A step's directory name: `step-000120`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// The step a directory name holds, and its suffix (`""`, `.partial`,
/// `.deleting`). Only the canonical spelling counts, so a step has one name.
fn parse_step_name(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix("step-")?;
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(digits);
    let step: u64 = number.parse().ok()?;
    (step_dir_name(step) == name[..5 + digits] && ["", PARTIAL, DELETING].contains(&suffix))
        .then_some((step, suffix))
}

/// A rank file's name: `rank-00003.safetensors`.
pub(crate) fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn is_rank_file(name: &str) -> bool {
    name.strip_prefix("rank-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// What a path given to save to or resume from is.
pub(crate) enum Found {
    Missing,
    /// An empty directory (or one holding only a root marker's temporary
    /// file, left by a crash while the root was made).
    Empty,
    Root,
    /// A single checkpoint: a directory with `checkpoint.json`.
    Checkpoint,
    NotADirectory,
    /// A directory holding other things: a few of their names, and how many.
    Foreign(Vec<String>, usize),
}

fn io(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::io(path.display(), e)
}

/// Looks at `dir` without changing anything. A symbolic link is followed.
pub(crate) fn inspect(dir: &Path) -> Result<Found> {
    let meta = match std::fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Ok(target) = std::fs::read_link(dir) {
                return Err(io(
                    dir,
                    format!(
                        "a symbolic link to {}, which does not exist; create that directory or name another",
                        target.display()
                    ),
                ));
            }
            return Ok(Found::Missing);
        }
        Err(e) => return Err(io(dir, e)),
    };
    if !meta.is_dir() {
        return Ok(Found::NotADirectory);
    }
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let mut name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            name.push('/');
        }
        names.push(name);
    }
    names.sort();
    if names.iter().any(|n| n == ROOT_MARKER) {
        check_marker(&dir.join(ROOT_MARKER))?;
        return Ok(Found::Root);
    }
    if names.iter().any(|n| n == INDEX) {
        return Ok(Found::Checkpoint);
    }
    let marker_tmp = format!("{ROOT_MARKER}.tmp");
    if names.iter().all(|n| *n == marker_tmp) {
        return Ok(Found::Empty);
    }
    let count = names.len();
    names.truncate(5);
    Ok(Found::Foreign(names, count))
}

fn check_marker(path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| io(path, format!("not a checkpoint root marker: {e}")))?;
    if value["format"] != ROOT_FORMAT || value["version"] != ROOT_VERSION {
        return Err(io(
            path,
            format!(
                "marks a checkpoint root of format {} v{}, not {ROOT_FORMAT} v{ROOT_VERSION}",
                value["format"], value["version"]
            ),
        ));
    }
    Ok(())
}

/// Why `dir` cannot be a checkpoint root, with what to do instead; `flag`
/// names the setting that gave it.
pub(crate) fn refusal(dir: &Path, found: &Found, flag: &str) -> Option<RuntimeError> {
    let shown = dir.display();
    let message = match found {
        Found::NotADirectory => format!(
            "{flag} {shown}: it is a file, not a directory. {flag} takes a directory of checkpoints: \
             name a new or empty directory"
        ),
        Found::Checkpoint => format!(
            "{flag} {shown}: it is a single checkpoint (it holds {INDEX}), not a checkpoint root. \
             Name its root (the directory above it) or a new directory"
        ),
        Found::Foreign(names, count) => format!(
            "{flag} {shown}: it is not empty ({}{}) and not a hybridgen checkpoint root (no {ROOT_MARKER}). \
             Checkpoints need a directory of their own, and nothing in {shown} is touched: name a new or \
             empty directory, e.g. {flag} {}",
            names.join(", "),
            if *count > names.len() {
                format!(" and {} more", count - names.len())
            } else {
                String::new()
            },
            dir.join("checkpoints").display()
        ),
        Found::Missing | Found::Empty | Found::Root => return None,
    };
    Some(RuntimeError::Unsupported(message))
}

/// The complete steps in root `dir`, ascending.
pub(crate) fn complete_steps(dir: &Path) -> Result<Vec<u64>> {
    let mut steps = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        if let Some((step, "")) = entry.file_name().to_str().and_then(parse_step_name)
            && entry.file_type().is_ok_and(|t| t.is_dir())
        {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Who holds a root's lock, as its lock file says.
#[derive(serde::Serialize, serde::Deserialize)]
struct LockHolder {
    pid: u32,
    host: String,
    started: String,
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "an unknown host".to_string())
}

/// Now, as an RFC 3339 UTC time.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's days-to-civil.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A checkpoint root opened for writing: validated, created if needed,
/// and locked for as long as this value lives.
#[derive(Debug)]
pub struct CheckpointRoot {
    dir: PathBuf,
    keep_last: Option<u64>,
    /// The newest complete step when the root was opened (under the lock,
    /// so only this run changes it afterwards).
    newest_at_open: Option<u64>,
    /// Holds the OS lock until dropped (or the process ends).
    _lock: File,
}

impl CheckpointRoot {
    /// Opens `dir` as the root a run saves to, from step `start` on: makes
    /// it if missing or empty, refuses anything else that is not a root,
    /// takes its lock, clears what a crashed save left, and refuses a root
    /// holding steps newer than `start` (another history).
    pub fn open(
        dir: &Path,
        start: u64,
        keep_last: Option<u64>,
        spelling: SettingSpelling,
    ) -> Result<Self> {
        durable::check_failpoint_env()?;
        let save = spelling.name(Setting::Save);
        if keep_last == Some(0) {
            return Err(RuntimeError::Unsupported(format!(
                "{} must be at least 1: the newest checkpoint is always kept",
                spelling.name(Setting::KeepLast)
            )));
        }
        let found = inspect(dir)?;
        if let Some(refusal) = refusal(dir, &found, save) {
            return Err(refusal);
        }
        if let Found::Missing = found {
            std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                durable::sync_dir_quietly(parent)?;
            }
        }
        if matches!(found, Found::Missing | Found::Empty) {
            let marker = serde_json::json!({"format": ROOT_FORMAT, "version": ROOT_VERSION});
            durable::replace_file(
                &dir.join(ROOT_MARKER),
                format!("{marker}\n").as_bytes(),
                "root-marker",
            )?;
        }
        let lock = lock(dir, save)?;
        for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            let entry = entry.map_err(|e| io(dir, e))?;
            if let Some((_, PARTIAL | DELETING)) =
                entry.file_name().to_str().and_then(parse_step_name)
            {
                remove_step(&entry.path(), false)?;
            }
        }
        let newest_at_open = complete_steps(dir)?.last().copied();
        if let Some(newest) = newest_at_open.filter(|&n| n > start) {
            return Err(RuntimeError::Unsupported(format!(
                "{save} {}: it holds {}, newer than step {start} this run starts from; saving there would mix \
                 two runs' histories. Resume its newest step ({}), or {save} to a new directory",
                dir.display(),
                dir.join(step_dir_name(newest)).display(),
                spelling.given(Setting::Resume, "auto")
            )));
        }
        Ok(CheckpointRoot {
            dir: dir.to_path_buf(),
            keep_last,
            newest_at_open,
            _lock: lock,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where step `step` is once complete.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.dir.join(step_dir_name(step))
    }

    /// Where step `step` is written before it is complete.
    pub(crate) fn partial_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{}{PARTIAL}", step_dir_name(step)))
    }

    pub fn newest_at_open(&self) -> Option<u64> {
        self.newest_at_open
    }

    /// Makes an empty directory to write step `step` into.
    pub(crate) fn begin(&self, step: u64) -> Result<PathBuf> {
        let done = self.step_dir(step);
        if done.exists() {
            return Err(io(&done, "this step is already saved"));
        }
        let partial = self.partial_dir(step);
        if partial.exists() {
            remove_step(&partial, false)?;
        }
        std::fs::create_dir(&partial).map_err(|e| io(&partial, e))?;
        Ok(partial)
    }

    /// Completes step `step` once every file is written and fsynced in
    /// its partial directory: the directory is fsynced and renamed into
    /// place, `latest` moves to it, and `keep_last` removes old steps.
    pub(crate) fn commit(&self, step: u64) -> Result<PathBuf> {
        let partial = self.partial_dir(step);
        let done = self.step_dir(step);
        durable::sync_dir(&partial, "step-dir")?;
        durable::rename(&partial, &done, "step")?;
        durable::replace_file(
            &self.dir.join(LATEST),
            format!("{}\n", step_dir_name(step)).as_bytes(),
            "latest",
        )?;
        if let Some(keep) = self.keep_last {
            let steps = complete_steps(&self.dir)?;
            let surplus = steps.len().saturating_sub(keep as usize);
            for &old in steps[..surplus].iter().filter(|&&s| s < step) {
                let from = self.step_dir(old);
                let to = self.dir.join(format!("{}{DELETING}", step_dir_name(old)));
                durable::rename(&from, &to, "keep-last")?;
                remove_step(&to, true)?;
            }
        }
        Ok(done)
    }
}

/// Takes `dir`'s lock, or says who holds it.
fn lock(dir: &Path, save: &str) -> Result<File> {
    let path = dir.join(LOCK);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            let holder = serde_json::from_str::<LockHolder>(&text).map_or_else(
                |_| "another process".to_string(),
                |h| format!("pid {} on {}, started {}", h.pid, h.host, h.started),
            );
            return Err(RuntimeError::Unsupported(format!(
                "{save} {}: another run is writing checkpoints there ({holder}; it holds {}). Two runs saving \
                 to one directory would overwrite each other's steps: wait for it to finish, or {save} to \
                 another directory",
                dir.display(),
                path.display()
            )));
        }
        Err(TryLockError::Error(e)) => return Err(io(&path, format!("cannot lock: {e}"))),
    }
    let holder = LockHolder {
        pid: std::process::id(),
        host: host_name(),
        started: utc_now(),
    };
    let text = serde_json::to_string(&holder).map_err(|e| io(&path, e))?;
    file.set_len(0).map_err(|e| io(&path, e))?;
    failpoint("lock", "write");
    file.write_all(format!("{text}\n").as_bytes())
        .map_err(|e| io(&path, e))?;
    Ok(file)
}

/// Removes a step directory's own files (the index and rank files) and
/// then the directory; anything else someone put there stays, and with it
/// the directory. `failpoints`: pass `keep-last-remove` after the first file.
fn remove_step(dir: &Path, failpoints: bool) -> Result<()> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let name = entry.file_name();
        let ours = name.to_str().is_some_and(|n| n == INDEX || is_rank_file(n));
        if ours && entry.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::remove_file(entry.path()).map_err(|e| io(&entry.path(), e))?;
            removed += 1;
            if failpoints && removed == 1 {
                failpoint("keep-last", "remove");
            }
        }
    }
    // Not empty: someone else's files are in it; they stay.
    let _ = std::fs::remove_dir(dir);
    Ok(())
}

/// The checkpoint a resume from `dir` loads: the newest complete step of a
/// root, or `dir` itself when it is one checkpoint. `Ok(None)`: `dir` is a
/// root (or empty, or missing) without a complete step yet.
pub(crate) fn newest_checkpoint(dir: &Path, flag: &str) -> Result<Option<PathBuf>> {
    let found = inspect(dir)?;
    match found {
        Found::Missing | Found::Empty => Ok(None),
        Found::Root => Ok(complete_steps(dir)?
            .last()
            .map(|&s| dir.join(step_dir_name(s)))),
        Found::Checkpoint => {
            let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some((_, PARTIAL | DELETING)) = parse_step_name(name) {
                return Err(io(
                    dir,
                    "this step was never completed (or is being removed); resume from its root to take the newest complete step",
                ));
            }
            Ok(Some(dir.to_path_buf()))
        }
        Found::NotADirectory | Found::Foreign(..) => {
            Err(refusal(dir, &found, flag).unwrap_or_else(|| io(dir, "not a checkpoint")))
        }
    }
}

/// What to do about damaged checkpoint `dir`: resume from the newest other
/// complete step of its root, when there is one.
pub(crate) fn other_step_hint(dir: &Path) -> String {
    let this = step_of_dir(dir);
    let root = dir.parent().filter(|p| p.join(ROOT_MARKER).is_file());
    let other = root.and_then(|root| {
        let steps = complete_steps(root).ok()?;
        let step = steps.into_iter().rev().find(|&s| Some(s) != this)?;
        Some(root.join(step_dir_name(step)))
    });
    match other {
        Some(other) => format!("resume from another step: {}", other.display()),
        None => "no other complete step is beside it to resume from".to_string(),
    }
}

/// The step a checkpoint directory's name says, when it is `step-N`.
pub(crate) fn step_of_dir(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    parse_step_name(name).map(|(step, _)| step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_have_one_spelling() {
        assert_eq!(step_dir_name(120), "step-000120");
        assert_eq!(step_dir_name(12_345_678), "step-12345678");
        assert_eq!(parse_step_name("step-000120"), Some((120, "")));
        assert_eq!(parse_step_name("step-12345678"), Some((12_345_678, "")));
        assert_eq!(parse_step_name("step-000120.partial"), Some((120, PARTIAL)));
        assert_eq!(
            parse_step_name("step-000120.deleting"),
            Some((120, DELETING))
        );
        for other in [
            "step-120",
            "step-0000120",
            "step-000120.old",
            "step-",
            "step-x",
            "latest",
            "step-99999999999999999999999",
        ] {
            assert_eq!(parse_step_name(other), None, "{other}");
        }
    }

    #[test]
    fn rank_files_are_recognised_by_their_exact_form() {
        assert!(is_rank_file(&rank_file(3)));
        assert!(is_rank_file("rank-123456.safetensors"));
        for other in [
            "rank-.safetensors",
            "rank-1.bin",
            "notes.txt",
            "rank-a.safetensors",
        ] {
            assert!(!is_rank_file(other), "{other}");
        }
    }

    #[test]
    fn times_are_rfc3339_utc() {
        let now = utc_now();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.starts_with("20") && now.ends_with('Z'), "{now}");
    }
}

//! How much memory this process may still use, as the operating system
//! says: Linux's `MemAvailable`, or less under a cgroup's limit.

use std::path::Path;

/// Memory this process may still use, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AvailableMemory {
    pub bytes: u64,
    pub source: String,
}

/// What the operating system says this process may still allocate: Linux's
/// `MemAvailable`, or less when a cgroup (v2 or v1) limits the process
/// (a container). `None` where neither can be read (other systems).
pub fn available() -> Option<AvailableMemory> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text))
        .map(|bytes| AvailableMemory {
            bytes,
            source: "MemAvailable in /proc/meminfo".into(),
        });
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| cgroup_headroom(&text, Path::new("/sys/fs/cgroup")));
    match (meminfo, cgroup) {
        (Some(m), Some(c)) => Some(if c.bytes < m.bytes { c } else { m }),
        (m, c) => m.or(c),
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub(super) fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    let unit = match words.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(unit)
}

/// The least headroom (limit minus usage) of the cgroups this process is in
/// and their ancestors: `cgroup` is `/proc/self/cgroup`, `root` where the
/// cgroup file systems are mounted.
pub(super) fn cgroup_headroom(cgroup: &str, root: &Path) -> Option<AvailableMemory> {
    let read = |path: &Path| -> Option<u64> {
        let text = std::fs::read_to_string(path).ok()?;
        text.trim().parse().ok()
    };
    let mut best: Option<AvailableMemory> = None;
    let mut consider = |limit: Option<u64>, usage: Option<u64>, path: &Path| {
        // v1 writes "no limit" as a number near i64::MAX.
        if let Some(limit) = limit.filter(|&l| l < 1 << 60) {
            let bytes = limit.saturating_sub(usage.unwrap_or(0));
            if best.as_ref().is_none_or(|b| bytes < b.bytes) {
                best = Some(AvailableMemory {
                    bytes,
                    source: format!("the cgroup limit in {}", path.display()),
                });
            }
        }
    };
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            // v2: the limit may sit on any ancestor.
            let mut dir = root.join(relative);
            loop {
                let max = dir.join("memory.max");
                consider(read(&max), read(&dir.join("memory.current")), &max);
                if dir == root || !dir.pop() || !dir.starts_with(root) {
                    break;
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            // v1; inside a container the path may not exist under the mount.
            let base = root.join("memory");
            for dir in [base.join(relative), base.clone()] {
                let limit = dir.join("memory.limit_in_bytes");
                if limit.exists() {
                    consider(
                        read(&limit),
                        read(&dir.join("memory.usage_in_bytes")),
                        &limit,
                    );
                    break;
                }
            }
        }
    }
    best
}

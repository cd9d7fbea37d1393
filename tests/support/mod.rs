//! What the command-line tests share: the `hybridgen` binary run as a user
//! runs it (never under a checkpoint failpoint left in the environment),
//! its output as text, and scratch directories.
//!
//! Each test file takes what it needs (`mod support;`), so some of these
//! go unused in some files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `hybridgen ARGS` in `cwd` with `env` added to the environment.
pub fn hybridgen_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hybridgen"));
    command
        .current_dir(cwd)
        .args(args)
        .env_remove(hybridgen_runtime::checkpoint::FAILPOINT_ENV);
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("the hybridgen binary runs")
}

/// `hybridgen ARGS` in the current directory.
pub fn hybridgen(args: &[&str]) -> Output {
    hybridgen_in(Path::new("."), args, &[])
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A fresh, empty directory `hybridgen-{prefix}-{pid}-{name}` under the
/// system's temporary directory.
pub fn scratch(prefix: &str, name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("hybridgen-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

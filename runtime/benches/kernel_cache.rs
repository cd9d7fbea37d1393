//! Start-up time of the CUDA kernels with and without the on-disk kernel
//! cache: each figure is a fresh process doing what a rank's
//! `KernelSet::new` does before it touches the GPU (`compile_all_once` for
//! Hopper), timed from the parent (process start to exit, library loading
//! included) and inside the child (the call alone). Needs NVRTC and the
//! CUDA headers, as the `cuda_kernels_compile` test does:
//!
//! ```text
//! LD_LIBRARY_PATH=DIR/nvidia/cu13/lib HYBRIDGEN_CUDA_INCLUDE=DIR/nvidia/cu13/include \
//!     cargo bench -p hybridgen-runtime --bench kernel_cache
//! ```
//!
//! Rows: `off` (HYBRIDGEN_KERNEL_CACHE=off: NVRTC every time), `cold` (an
//! empty cache directory: compile and write), `warm` (the entry is there).
//! Prints the best and the median of several processes (the machine is
//! shared; the best is the least disturbed). Asserts nothing about time.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use hybridgen_runtime::cuda::kernel_cache::{self, CACHE_ENV, CacheOutcome};
use hybridgen_runtime::cuda::kernels::{self, Target};

/// Set in the child processes.
const CHILD_ENV: &str = "HYBRIDGEN_KERNEL_CACHE_BENCH_CHILD";

fn main() {
    if let Err(why) = kernels::nvrtc_available() {
        println!("skipped: {why}");
        return;
    }
    let include = match kernels::include_dir() {
        Ok(dir) => dir,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    if std::env::var_os(CHILD_ENV).is_some() {
        let start = Instant::now();
        let compiled = kernel_cache::compile_all_once(Target::HOPPER, &include)
            .unwrap_or_else(|e| panic!("{e}"));
        let outcome = match compiled.cache {
            CacheOutcome::Hit { .. } => "hit",
            CacheOutcome::Stored { .. } => "stored",
            CacheOutcome::Disabled => "off",
            _ => "not cached",
        };
        println!("{outcome} {:.6}", start.elapsed().as_secs_f64());
        return;
    }

    let root = std::env::temp_dir().join(format!(
        "hybridgen-kernel-cache-bench-{}",
        std::process::id()
    ));
    let run = |cache: &std::ffi::OsStr| -> (String, f64, f64) {
        let start = Instant::now();
        let output = Command::new(std::env::current_exe().unwrap())
            .env(CHILD_ENV, "1")
            .env(CACHE_ENV, cache)
            .output()
            .unwrap();
        let wall = start.elapsed().as_secs_f64();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "the child failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let (outcome, inside) = stdout.trim().split_once(' ').expect("outcome and time");
        (outcome.to_string(), wall, inside.parse().unwrap())
    };
    let runs = 5;
    let warm = root.join("warm");
    run(warm.as_os_str()); // fills it
    // What HYBRIDGEN_KERNEL_CACHE is set to for the `i`th process of a row.
    let setting = |row: &str, i: usize| match row {
        "off" => PathBuf::from("off"),
        "cold" => root.join(format!("cold-{i}")),
        _ => warm.clone(),
    };
    println!(
        "kernel start-up for {}, {} sources, {runs} processes each (seconds)",
        Target::HOPPER,
        kernels::SOURCES.len()
    );
    println!(
        "{:<6} {:>14} {:>14} {:>14} {:>14}",
        "cache", "process best", "process median", "call best", "call median"
    );
    for (name, expected) in [("off", "off"), ("cold", "stored"), ("warm", "hit")] {
        let mut walls = Vec::new();
        let mut calls = Vec::new();
        for i in 0..runs {
            let (outcome, wall, call) = run(setting(name, i).as_os_str());
            assert_eq!(outcome, expected, "{name}");
            walls.push(wall);
            calls.push(call);
        }
        let best = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (v[0], v[v.len() / 2])
        };
        let (wall_best, wall_median) = best(&mut walls);
        let (call_best, call_median) = best(&mut calls);
        println!(
            "{name:<6} {wall_best:>14.4} {wall_median:>14.4} {call_best:>14.4} {call_median:>14.4}"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

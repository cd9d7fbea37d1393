//! The on-disk kernel cache with the real compiler: a second start-up
//! loads what the first compiled (the same bytes, nothing compiled), a
//! changed source, option or target misses, a damaged file is replaced,
//! processes racing to fill an empty cache (as the ranks of a fresh
//! `torchrun` job do) leave one valid file, and the threads of one process
//! share one compilation. The file format, pruning and every refusal are
//! covered without NVRTC by the unit tests in `cuda/kernel_cache.rs`.
//!
//! Needs NVRTC and the CUDA headers, as `cuda_kernels_compile` does:
//!
//! ```text
//! LD_LIBRARY_PATH=DIR/nvidia/cu13/lib HYBRIDGEN_CUDA_INCLUDE=DIR/nvidia/cu13/include \
//!     cargo test -p hybridgen-runtime --test cuda_kernel_cache -- --nocapture
//! ```
//!
//! Skips, saying why, where libnvrtc cannot be loaded. Times are printed,
//! never asserted (`cargo bench --bench kernel_cache` measures start-up).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use hybridgen_runtime::cuda::kernel_cache::{
    self, CACHE_ENV, CacheLocation, CacheOutcome, CompiledKernels,
};
use hybridgen_runtime::cuda::kernels::{self, KernelSource, SOURCES, Target};

/// Set in the child processes `racing_processes_leave_one_valid_file`
/// starts.
const CHILD_ENV: &str = "HYBRIDGEN_KERNEL_CACHE_TEST_CHILD";

/// The include directory, or `None` (after saying why) when NVRTC is absent.
fn nvrtc_and_headers() -> Option<PathBuf> {
    if let Err(why) = kernels::nvrtc_available() {
        eprintln!("skipped: {why}");
        return None;
    }
    match kernels::include_dir() {
        Ok(dir) => Some(dir),
        Err(why) => panic!("{why}"),
    }
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hybridgen-kernel-cache-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn timed(
    location: &CacheLocation,
    sources: &[KernelSource],
    target: Target,
    include: &Path,
) -> (CompiledKernels, f64) {
    let start = Instant::now();
    let compiled = kernel_cache::load_or_compile(location, sources, target, include)
        .unwrap_or_else(|e| panic!("{e}"));
    (compiled, start.elapsed().as_secs_f64())
}

fn images(compiled: &CompiledKernels) -> Vec<(&'static str, Vec<u8>)> {
    compiled
        .sources
        .iter()
        .map(|c| (c.file, c.image.clone()))
        .collect()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_second_start_up_loads_the_same_bytes_without_compiling() {
    let Some(include) = nvrtc_and_headers() else {
        return;
    };
    let dir = scratch("second");
    let location = CacheLocation::Dir(dir.clone());
    let (first, compile_s) = timed(&location, SOURCES, Target::HOPPER, &include);
    assert!(
        matches!(first.cache, CacheOutcome::Stored { replaced: None, .. }),
        "{:?}",
        first.cache
    );
    let (second, hit_s) = timed(&location, SOURCES, Target::HOPPER, &include);
    let CacheOutcome::Hit { path } = &second.cache else {
        panic!("the second lookup compiled: {:?}", second.cache);
    };
    assert_eq!(images(&second), images(&first));
    assert!(second.sources.iter().all(|c| c.target == Target::HOPPER));
    let bytes = std::fs::metadata(path).unwrap().len();
    println!(
        "{} sources for {}: compiled and stored in {:.3} s, loaded from the cache ({bytes} \
         bytes) in {:.4} s",
        SOURCES.len(),
        Target::HOPPER,
        compile_s,
        hit_s
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn a_changed_source_option_or_target_misses_and_a_damaged_file_is_replaced() {
    let Some(include) = nvrtc_and_headers() else {
        return;
    };
    let dir = scratch("changes");
    let location = CacheLocation::Dir(dir.clone());
    let one = &SOURCES[..1];
    let (original, _) = timed(&location, one, Target::HOPPER, &include);
    let stored = |compiled: &CompiledKernels| match &compiled.cache {
        CacheOutcome::Stored { path, replaced } => (path.clone(), replaced.clone()),
        other => panic!("expected a miss, got {other:?}"),
    };
    let (path, _) = stored(&original);

    let edited_text: &'static str =
        Box::leak(format!("{}\n// edited\n", SOURCES[0].text).into_boxed_str());
    let edited = [KernelSource {
        text: edited_text,
        ..SOURCES[0]
    }];
    let (after_edit, _) = timed(&location, &edited, Target::HOPPER, &include);
    assert_ne!(stored(&after_edit).0, path, "an edited source hit");

    let (portable, _) = timed(&location, one, Target::PORTABLE, &include);
    stored(&portable);

    // The same headers through another path: `--include-path` differs.
    let link = dir.join("include-link");
    std::os::unix::fs::symlink(&include, &link).unwrap();
    let (other_option, _) = timed(&location, one, Target::HOPPER, &link);
    stored(&other_option);

    // Damage the entry the original inputs hit: it is compiled again and
    // rewritten, never loaded.
    let (again, _) = timed(&location, one, Target::HOPPER, &link);
    let CacheOutcome::Hit { path: hit } = again.cache else {
        panic!("unchanged inputs missed: {:?}", again.cache);
    };
    let mut bytes = std::fs::read(&hit).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&hit, &bytes).unwrap();
    let (repaired, _) = timed(&location, one, Target::HOPPER, &link);
    let (_, replaced) = stored(&repaired);
    assert!(
        replaced
            .as_deref()
            .is_some_and(|why| why.contains("CRC-32C")),
        "{replaced:?}"
    );
    assert_eq!(images(&repaired), images(&other_option));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn off_and_an_unwritable_directory_still_compile() {
    let Some(include) = nvrtc_and_headers() else {
        return;
    };
    let dir = scratch("off");
    let one = &SOURCES[..1];
    let (off, _) = timed(&CacheLocation::Disabled, one, Target::HOPPER, &include);
    assert_eq!(off.cache, CacheOutcome::Disabled);
    assert!(!off.sources[0].image.is_empty());
    std::fs::write(dir.join("file"), b"").unwrap();
    let location = CacheLocation::Dir(dir.join("file").join("kernels"));
    let (unwritable, _) = timed(&location, one, Target::HOPPER, &include);
    assert!(
        matches!(unwritable.cache, CacheOutcome::NotStored { .. }),
        "{:?}",
        unwritable.cache
    );
    assert_eq!(images(&unwritable), images(&off));
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a child process does: what every rank's [`KernelSet`] does, from
/// four threads at once (one per GPU of a process driving four). Prints
/// the outcome for the parent.
///
/// [`KernelSet`]: hybridgen_runtime::cuda::KernelSet
fn child(include: &Path) {
    let start = Instant::now();
    let sets: Vec<Arc<CompiledKernels>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    kernel_cache::compile_all_once(Target::PORTABLE, include)
                        .unwrap_or_else(|e| panic!("{e}"))
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(
        sets.iter().all(|set| Arc::ptr_eq(set, &sets[0])),
        "the threads of one process compiled separately"
    );
    let outcome = match &sets[0].cache {
        CacheOutcome::Hit { .. } => "hit",
        CacheOutcome::Stored { .. } => "stored",
        other => panic!("{other:?}"),
    };
    println!(
        "child outcome: {outcome} in {:.3} s",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn racing_processes_leave_one_valid_file() {
    let Some(include) = nvrtc_and_headers() else {
        return;
    };
    if std::env::var_os(CHILD_ENV).is_some() {
        child(&include);
        return;
    }
    let dir = scratch("race");
    let spawn = || {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "racing_processes_leave_one_valid_file",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .env(CACHE_ENV, &dir)
            .output()
            .unwrap()
    };
    let outcomes = |outputs: Vec<std::process::Output>| -> Vec<String> {
        outputs
            .into_iter()
            .map(|output| {
                let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
                assert!(
                    output.status.success(),
                    "a child failed:\n{stdout}\n{}",
                    String::from_utf8_lossy(&output.stderr)
                );
                let line = stdout
                    .lines()
                    // The harness's `test name ... ` may precede it.
                    .find_map(|l| l.split_once("child outcome: ").map(|(_, o)| o))
                    .unwrap_or_else(|| panic!("no outcome in\n{stdout}"));
                line.to_string()
            })
            .collect()
    };
    let racers = 4;
    let outputs: Vec<_> = std::thread::scope(|scope| {
        let children: Vec<_> = (0..racers).map(|_| scope.spawn(spawn)).collect();
        children.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let raced = outcomes(outputs);
    println!("{racers} processes racing on an empty cache: {raced:?}");
    assert!(raced.iter().any(|o| o.starts_with("stored")), "{raced:?}");

    let names = entries(&dir);
    assert_eq!(
        names.len(),
        1,
        "one entry and no temporary files: {names:?}"
    );
    let location = CacheLocation::Dir(dir.clone());
    let (loaded, _) = timed(&location, SOURCES, Target::PORTABLE, &include);
    assert!(
        matches!(loaded.cache, CacheOutcome::Hit { .. }),
        "{:?}",
        loaded.cache
    );
    for unit in &loaded.sources {
        let ptx = String::from_utf8_lossy(&unit.image);
        let source = SOURCES.iter().find(|s| s.file == unit.file).unwrap();
        for entry in source.entry_points {
            assert!(ptx.contains(&format!(".entry {entry}(")), "{}", unit.file);
        }
    }
    let late = outcomes(vec![spawn()]);
    println!("a process started afterwards: {late:?}");
    assert!(late[0].starts_with("hit"), "{late:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

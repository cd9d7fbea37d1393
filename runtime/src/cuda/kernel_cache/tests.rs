//! The kernel cache with a fake compiler: its keys and locations, hits and
//! misses, bad and stale files, racing writers, the memo, and compilations
//! that are not stored.

use super::*;
use crate::cuda::kernels::{Diagnostic, Severity};
use std::collections::HashSet;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicUsize};

const FAKE: &[KernelSource] = &[
    KernelSource {
        file: "one.cu",
        text: "extern \"C\" __global__ void one() {}",
        entry_points: &["one"],
    },
    KernelSource {
        file: "two.cu",
        text: "extern \"C\" __global__ void two() {}",
        entry_points: &["two"],
    },
];

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hybridgen-kernel-cache-unit-{}-{name}",
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// A stand-in for NVRTC: the image names the target and the source,
/// and every call is counted (from the compiling threads).
fn fake_compile<'a>(
    target: Target,
    calls: &'a AtomicUsize,
) -> impl Fn(&KernelSource) -> Result<CompiledSource, KernelBuildError> + Sync + 'a {
    move |source| {
        calls.fetch_add(1, Ordering::Relaxed);
        Ok(CompiledSource {
            file: source.file,
            target,
            image: format!("image of {} for {target}: {}", source.file, source.text).into_bytes(),
            warnings: Vec::new(),
        })
    }
}

fn key(n: u128) -> CacheKey {
    CacheKey(0x1234_5678_9abc_def0_0000_0000_0000_0000 + n)
}

/// Runs one lookup with the fake compiler; returns the outcome and how
/// many sources it compiled.
fn run(location: &CacheLocation, key: CacheKey, target: Target) -> (CompiledKernels, usize) {
    let calls = AtomicUsize::new(0);
    let compiled =
        load_or_compile_with(location, key, FAKE, target, fake_compile(target, &calls)).unwrap();
    (compiled, calls.into_inner())
}

fn images(compiled: &CompiledKernels) -> Vec<(&'static str, Vec<u8>)> {
    compiled
        .sources
        .iter()
        .map(|c| (c.file, c.image.clone()))
        .collect()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn fnv1a_128_matches_the_published_vectors() {
    for (input, expected) in [
        ("", 0x6c62272e07bb014262b821756295c58d_u128),
        ("a", 0xd228cb696f1a8caf78912b704e4a8964),
        ("foobar", 0x343e1662793c64bf6f0d3597ba446f18),
    ] {
        let mut hash = Fnv1a128::new();
        hash.bytes(input.as_bytes());
        assert_eq!(hash.0, expected, "FNV-1a 128 of {input:?}");
    }
}

#[test]
fn the_location_follows_the_variables() {
    let some = |s: &str| Some(OsString::from(s));
    assert_eq!(
        CacheLocation::from_vars(some("/c"), some("/x"), some("/h")),
        CacheLocation::Dir("/c".into())
    );
    for off in ["", "off", "OFF"] {
        assert_eq!(
            CacheLocation::from_vars(some(off), some("/x"), some("/h")),
            CacheLocation::Disabled,
            "{off:?}"
        );
    }
    assert_eq!(
        CacheLocation::from_vars(None, some("/x"), some("/h")),
        CacheLocation::Dir("/x/hybridgen/kernels".into())
    );
    // A relative XDG_CACHE_HOME is ignored, as the XDG spec says.
    assert_eq!(
        CacheLocation::from_vars(None, some("rel"), some("/h")),
        CacheLocation::Dir("/h/.cache/hybridgen/kernels".into())
    );
    assert_eq!(
        CacheLocation::from_vars(None, None, some("/h")),
        CacheLocation::Dir("/h/.cache/hybridgen/kernels".into())
    );
    let CacheLocation::Unavailable(why) = CacheLocation::from_vars(None, some(""), some("")) else {
        panic!("no usable variable, yet a location");
    };
    assert!(why.contains(CACHE_ENV), "{why}");
}

#[test]
fn a_second_lookup_loads_the_file_without_compiling() {
    let dir = scratch("hit");
    let location = CacheLocation::Dir(dir.join("nested/kernels"));
    let (first, compiled) = run(&location, key(1), Target::HOPPER);
    assert_eq!(compiled, FAKE.len());
    let path = dir
        .join("nested/kernels")
        .join(entry_name(Target::HOPPER, key(1)));
    assert_eq!(
        first.cache,
        CacheOutcome::Stored {
            path: path.clone(),
            replaced: None
        }
    );
    let (second, compiled) = run(&location, key(1), Target::HOPPER);
    assert_eq!(compiled, 0, "a hit compiled something");
    assert_eq!(second.cache, CacheOutcome::Hit { path });
    assert_eq!(images(&second), images(&first));
    assert!(second.sources.iter().all(|c| c.target == Target::HOPPER));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn every_input_changes_the_key() {
    let options = ["--gpu-architecture=sm_90a".to_string(), "-I/x".to_string()];
    let headers = [("cuda_bf16.h", Some(b"bf16".to_vec()))];
    let base = || KeyInputs {
        hybridgen_version: "0.1.0",
        nvrtc_version: (13, 0),
        target: Target::HOPPER,
        options: &options,
        headers: &[("common.cuh", "// common")],
        toolkit_headers: &headers,
        sources: FAKE,
    };
    let more_options = [options[0].clone(), options[1].clone(), "-lineinfo".into()];
    let other_option = [options[0].clone(), "-I/y".to_string()];
    let other_headers = [("cuda_bf16.h", Some(b"bf16 patched".to_vec()))];
    let absent_headers = [("cuda_bf16.h", None)];
    let edited = [
        FAKE[0],
        KernelSource {
            text: "// edited",
            ..FAKE[1]
        },
    ];
    let renamed = [
        FAKE[0],
        KernelSource {
            file: "three.cu",
            ..FAKE[1]
        },
    ];
    let entries = [
        FAKE[0],
        KernelSource {
            entry_points: &["three"],
            ..FAKE[1]
        },
    ];
    let variants = [
        base(),
        KeyInputs {
            hybridgen_version: "0.1.1",
            ..base()
        },
        KeyInputs {
            nvrtc_version: (13, 1),
            ..base()
        },
        KeyInputs {
            target: Target::PORTABLE,
            ..base()
        },
        KeyInputs {
            target: Target {
                output: Output::Ptx,
                ..Target::HOPPER
            },
            ..base()
        },
        KeyInputs {
            options: &more_options,
            ..base()
        },
        KeyInputs {
            options: &other_option,
            ..base()
        },
        KeyInputs {
            headers: &[("common.cuh", "// common!")],
            ..base()
        },
        KeyInputs {
            headers: &[("common.cuh", "// common"), ("wgmma.cuh", "// wgmma")],
            ..base()
        },
        KeyInputs {
            headers: &[("common.cuh", "// common"), ("wgmma.cuh", "// wgmma!")],
            ..base()
        },
        KeyInputs {
            toolkit_headers: &other_headers,
            ..base()
        },
        KeyInputs {
            toolkit_headers: &absent_headers,
            ..base()
        },
        KeyInputs {
            sources: &edited,
            ..base()
        },
        KeyInputs {
            sources: &renamed,
            ..base()
        },
        KeyInputs {
            sources: &entries,
            ..base()
        },
        KeyInputs {
            sources: &FAKE[..1],
            ..base()
        },
    ];
    let keys: HashSet<CacheKey> = variants.iter().map(KeyInputs::key).collect();
    assert_eq!(
        keys.len(),
        variants.len(),
        "two different inputs share a key"
    );
    assert_eq!(
        base().key(),
        base().key(),
        "the key is not a function of its inputs"
    );
}

#[test]
fn another_key_or_target_misses() {
    let dir = scratch("miss");
    let location = CacheLocation::Dir(dir.clone());
    run(&location, key(1), Target::HOPPER);
    let (other_key, compiled) = run(&location, key(2), Target::HOPPER);
    assert_eq!(compiled, FAKE.len());
    assert!(matches!(
        other_key.cache,
        CacheOutcome::Stored { replaced: None, .. }
    ));
    let (other_target, compiled) = run(&location, key(2), Target::PORTABLE);
    assert_eq!(compiled, FAKE.len());
    assert!(matches!(
        other_target.cache,
        CacheOutcome::Stored { replaced: None, .. }
    ));
    assert!(
        other_target
            .sources
            .iter()
            .all(|c| c.target == Target::PORTABLE)
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_file_is_never_loaded_and_is_replaced() {
    let dir = scratch("corrupt");
    let location = CacheLocation::Dir(dir.clone());
    let (good, _) = run(&location, key(1), Target::HOPPER);
    let path = dir.join(entry_name(Target::HOPPER, key(1)));
    let valid = fs::read(&path).unwrap();
    let mut flipped = valid.clone();
    *flipped.last_mut().unwrap() ^= 0x01;
    let mut bad_format = valid.clone();
    bad_format[8] = 9;
    let mut bad_header_crc = valid.clone();
    bad_header_crc[12] ^= 0xff;
    let mut extended = valid.clone();
    extended.push(0);
    let wrong_count = encode(key(1), &good.sources[..1]);
    let swapped: Vec<CompiledSource> = good.sources.iter().rev().cloned().collect();
    let cases: [(&str, Vec<u8>, &str); 9] = [
        ("a flipped payload bit", flipped, "CRC-32C"),
        ("a corrupted checksum", bad_header_crc, "CRC-32C"),
        (
            "a truncated file",
            valid[..valid.len() - 7].to_vec(),
            "truncated",
        ),
        (
            "a file cut inside the header",
            valid[..20].to_vec(),
            "truncated",
        ),
        ("an extended file", extended, "extended"),
        ("an empty file", Vec::new(), "magic"),
        (
            "a foreign file",
            b"#!/bin/sh\necho not a kernel\n".to_vec(),
            "magic",
        ),
        ("another format", bad_format, "format 9"),
        (
            "another key's file",
            encode(key(2), &good.sources),
            "holds key",
        ),
    ];
    let more: [(&str, Vec<u8>, &str); 2] = [
        ("fewer sources", wrong_count, "holds 1 sources"),
        (
            "sources out of order",
            encode(key(1), &swapped),
            "two.cu where one.cu",
        ),
    ];
    for (what, bytes, because) in cases.into_iter().chain(more) {
        fs::write(&path, &bytes).unwrap();
        let (compiled, calls) = run(&location, key(1), Target::HOPPER);
        assert_eq!(calls, FAKE.len(), "{what} was loaded");
        let CacheOutcome::Stored {
            replaced: Some(why),
            ..
        } = &compiled.cache
        else {
            panic!("{what}: {:?}", compiled.cache);
        };
        assert!(why.contains(because), "{what}: {why}");
        assert_eq!(images(&compiled), images(&good), "{what}");
        assert_eq!(fs::read(&path).unwrap(), valid, "{what} was not rewritten");
        let (again, calls) = run(&location, key(1), Target::HOPPER);
        assert_eq!(
            (calls, matches!(again.cache, CacheOutcome::Hit { .. })),
            (0, true)
        );
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn only_this_targets_other_entries_and_stale_temporaries_are_deleted() {
    let dir = scratch("prune");
    let location = CacheLocation::Dir(dir.clone());
    run(&location, key(1), Target::HOPPER);
    run(&location, key(1), Target::PORTABLE);
    let old_temp = format!("{}.tmp-1-2", entry_name(Target::HOPPER, key(3)));
    let fresh_temp = format!("{}.tmp-1-3", entry_name(Target::HOPPER, key(3)));
    let near_miss = [
        "notes.txt".to_string(),
        "hybridgen-kernels-sm_90a-1234.bin".to_string(),
        format!("{}.bak", entry_name(Target::HOPPER, key(4))),
        format!("x{}", entry_name(Target::HOPPER, key(4))),
        entry_name(Target::HOPPER, key(4)).to_uppercase(),
    ];
    for name in near_miss.iter().chain([&old_temp, &fresh_temp]) {
        fs::write(dir.join(name), b"keep?").unwrap();
    }
    let hour_ago = std::time::SystemTime::now() - STALE_TEMP - Duration::from_secs(60);
    File::options()
        .write(true)
        .open(dir.join(&old_temp))
        .unwrap()
        .set_modified(hour_ago)
        .unwrap();
    // A directory and a link named like an entry are not files we wrote.
    fs::create_dir(dir.join(entry_name(Target::HOPPER, key(5)))).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(
        dir.join("notes.txt"),
        dir.join(entry_name(Target::HOPPER, key(6))),
    )
    .unwrap();

    run(&location, key(2), Target::HOPPER);

    let mut expected: Vec<String> = near_miss.to_vec();
    expected.extend([
        fresh_temp,
        entry_name(Target::PORTABLE, key(1)),
        entry_name(Target::HOPPER, key(2)),
        entry_name(Target::HOPPER, key(5)),
    ]);
    #[cfg(unix)]
    expected.push(entry_name(Target::HOPPER, key(6)));
    expected.sort();
    assert_eq!(names(&dir), expected);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn racing_writers_leave_one_whole_file_and_no_temporaries() {
    let dir = scratch("race");
    let location = CacheLocation::Dir(dir.clone());
    let writers = 8;
    // Every writer misses before any writes, as the ranks of a fresh
    // job do.
    let all_missed = Barrier::new(writers);
    let stored = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..writers {
            scope.spawn(|| {
                let calls = AtomicUsize::new(0);
                let compile = fake_compile(Target::HOPPER, &calls);
                let first = AtomicBool::new(true);
                let compiled = load_or_compile_with(
                    &location,
                    key(1),
                    FAKE,
                    Target::HOPPER,
                    |source: &KernelSource| {
                        if first.swap(false, Ordering::Relaxed) {
                            all_missed.wait();
                        }
                        compile(source)
                    },
                )
                .unwrap();
                assert_eq!(calls.load(Ordering::Relaxed), FAKE.len());
                if matches!(compiled.cache, CacheOutcome::Stored { replaced: None, .. }) {
                    stored.fetch_add(1, Ordering::Relaxed);
                } else {
                    panic!("{:?}", compiled.cache);
                }
            });
        }
    });
    assert_eq!(stored.load(Ordering::Relaxed), writers);
    assert_eq!(names(&dir), [entry_name(Target::HOPPER, key(1))]);
    let (after, calls) = run(&location, key(1), Target::HOPPER);
    assert_eq!(
        (calls, matches!(after.cache, CacheOutcome::Hit { .. })),
        (0, true)
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn off_compiles_every_time_and_says_nothing() {
    for _ in 0..2 {
        let (compiled, calls) = run(&CacheLocation::Disabled, key(1), Target::HOPPER);
        assert_eq!(calls, FAKE.len());
        assert_eq!(compiled.cache, CacheOutcome::Disabled);
        assert_eq!(compiled.cache.notice(), None);
    }
    let (compiled, calls) = run(
        &CacheLocation::Unavailable("no HOME".into()),
        key(1),
        Target::HOPPER,
    );
    assert_eq!(calls, FAKE.len());
    let notice = compiled.cache.notice().unwrap();
    assert!(
        notice.contains("no HOME") && notice.contains(CACHE_ENV),
        "{notice}"
    );
}

#[test]
fn an_unwritable_directory_still_compiles() {
    let dir = scratch("unwritable");
    // A directory under a regular file cannot be created, even by root.
    fs::write(dir.join("file"), b"").unwrap();
    let location = CacheLocation::Dir(dir.join("file/kernels"));
    for _ in 0..2 {
        let (compiled, calls) = run(&location, key(1), Target::HOPPER);
        assert_eq!(calls, FAKE.len());
        assert_eq!(compiled.sources.len(), FAKE.len());
        let CacheOutcome::NotStored { why, .. } = &compiled.cache else {
            panic!("{:?}", compiled.cache);
        };
        assert!(why.contains("cannot create"), "{why}");
        let notice = compiled.cache.notice().unwrap();
        assert!(notice.contains(CACHE_ENV), "{notice}");
    }
    assert_eq!(names(&dir), ["file"]);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_compilation_with_warnings_is_not_stored() {
    let dir = scratch("warnings");
    let location = CacheLocation::Dir(dir.clone());
    let calls = AtomicUsize::new(0);
    let compile = fake_compile(Target::HOPPER, &calls);
    let compiled = load_or_compile_with(&location, key(1), FAKE, Target::HOPPER, |source| {
        let mut unit = compile(source)?;
        if source.file == "two.cu" {
            unit.warnings.push(Diagnostic {
                file: "two.cu".into(),
                line: Some(1),
                severity: Severity::Warning,
                message: "unused".into(),
            });
        }
        Ok(unit)
    })
    .unwrap();
    assert_eq!(compiled.cache, CacheOutcome::HasWarnings { file: "two.cu" });
    assert_eq!(compiled.sources[1].warnings.len(), 1);
    assert!(names(&dir).is_empty());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_compile_error_is_returned_and_nothing_is_stored() {
    let dir = scratch("error");
    let location = CacheLocation::Dir(dir.clone());
    let result = load_or_compile_with(&location, key(1), FAKE, Target::HOPPER, |source| {
        Err(KernelBuildError::Compile {
            file: source.file,
            target: Target::HOPPER,
            diagnostics: Vec::new(),
            log: "boom".into(),
        })
    });
    assert!(matches!(result, Err(KernelBuildError::Compile { .. })));
    assert!(names(&dir).is_empty());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn own_file_names_parse_and_nothing_else_does() {
    let entry = entry_name(Target::HOPPER, key(7));
    assert_eq!(
        OwnFile::parse(&entry),
        Some(OwnFile {
            arch: "sm_90a",
            key: key(7),
            temporary: false
        })
    );
    let temp = format!("{entry}.tmp-41-0");
    assert_eq!(OwnFile::parse(&temp).map(|f| f.temporary), Some(true));
    let portable = entry_name(Target::PORTABLE, key(7));
    assert_eq!(
        OwnFile::parse(&portable).map(|f| f.arch),
        Some("compute_80")
    );
    for foreign in [
        "notes.txt".to_string(),
        format!("{entry}.tmp-41"),
        format!("{entry}.tmp-x-1"),
        format!("{entry}.old"),
        entry.replace(".bin", ".cubin"),
        entry.replace("sm_90a", ""),
        entry.replace("sm_90a", "SM_90A"),
        entry.replace("hybridgen-", "other-"),
        format!("{FILE_PREFIX}sm_90a-{}{FILE_SUFFIX}", "g".repeat(32)),
        format!("{FILE_PREFIX}sm_90a-{}{FILE_SUFFIX}", "a".repeat(31)),
    ] {
        assert_eq!(OwnFile::parse(&foreign), None, "{foreign}");
    }
}

#[test]
fn the_memo_makes_each_value_once_however_many_threads_ask() {
    let memo: Memo<&str, usize> = Memo::new();
    let made = AtomicUsize::new(0);
    let start = Barrier::new(8);
    let values: Vec<Arc<usize>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    memo.get_or_try_make("sm_90a", || {
                        std::thread::sleep(Duration::from_millis(50));
                        Ok::<_, ()>(made.fetch_add(1, Ordering::SeqCst))
                    })
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(made.load(Ordering::SeqCst), 1);
    assert!(values.iter().all(|v| Arc::ptr_eq(v, &values[0])));
    // Another key is made separately; a failure is not kept.
    assert_eq!(
        memo.get_or_try_make("compute_80", || Err::<usize, _>("no")),
        Err("no")
    );
    let other = memo
        .get_or_try_make("compute_80", || Ok::<_, ()>(7))
        .unwrap();
    assert_eq!(*other, 7);
    assert_eq!(made.load(Ordering::SeqCst), 1);
}

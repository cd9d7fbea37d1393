//! Checkpoints as a user runs them: a kill at any point of a save loses
//! nothing and the same command resumes onto the same loss curve; a second
//! writer, a foreign directory, a file, `.` or `/` as `--save` are refused
//! before any step with nothing touched; a resume takes what it is not told
//! from the checkpoint and refuses what contradicts it.

use hybridgen_runtime::checkpoint::{self, FAILPOINT_ENV, FAILPOINTS};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

mod support;
use support::{hybridgen, hybridgen_in, stderr};

/// A fresh, empty scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    support::scratch("ckpt", name)
}

/// The step objects of a `--format json` run, minus their wall-clock
/// times, as strings: numbers print shortest-round-trip, so equal strings
/// are equal bits.
fn step_lines(out: &Output) -> Vec<(u64, String)> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|v| v.get("step").is_some())
        .map(|mut v| {
            v.as_object_mut().unwrap().remove("step_ms");
            (v["step"].as_u64().unwrap(), v.to_string())
        })
        .collect()
}

fn summary(out: &Output) -> Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str::<Value>(last).unwrap_or_else(|_| panic!("no summary in:\n{text}"))
        ["summary"]
        .clone()
}

/// A tiny run (steps given separately).
const RUN: &[&str] = &[
    "train",
    "--seq-len",
    "16",
    "--micro-batches",
    "2",
    "--micro-batch-size",
    "2",
    "--seed",
    "7",
    "--format",
    "json",
];

/// The tiny run to step `steps`, with `extra` flags.
fn run_args<'a>(steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    RUN.iter()
        .copied()
        .chain(["--steps", steps])
        .chain(extra.iter().copied())
        .collect()
}

/// The complete step directories of a root, ascending.
fn complete_steps(root: &Path) -> Vec<PathBuf> {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(root)
        .map(|entries| {
            entries
                .map(|e| e.unwrap().path())
                .filter(|p| {
                    let name = p.file_name().unwrap().to_string_lossy();
                    name.starts_with("step-") && !name.contains('.') && p.is_dir()
                })
                .collect()
        })
        .unwrap_or_default();
    steps.sort();
    steps
}

/// Which hit of `name` falls in save number `save` of the run above (two
/// ranks; `--keep-last 1` first removes a step during the second save).
fn nth_hit(name: &str, save: u64) -> u64 {
    if name.starts_with("root-marker") || name.starts_with("lock") {
        1
    } else if name.starts_with("rank-file") {
        2 * (save - 1) + 1
    } else if name.starts_with("keep-last") {
        save - 1
    } else {
        save
    }
}

#[test]
fn a_kill_at_any_failpoint_resumes_onto_the_same_curve() {
    kill_at_each_failpoint_then_resume("failpoints", &[], 0);
}

/// The same with the files written behind the steps: a kill in a writer
/// thread, or at a commit made steps after the save began, leaves a root
/// the same command resumes from.
#[test]
fn a_kill_at_any_failpoint_of_an_async_save_resumes_onto_the_same_curve() {
    // Steps 1 to 3 save behind the steps; the last, 4, streams.
    kill_at_each_failpoint_then_resume("failpoints-async", &["--async-save"], 3);
}

/// Kills the run at each failpoint (with `extra` flags, under which the
/// uninterrupted run writes `behind` saves behind the steps), checks what
/// it leaves, and resumes it with the same command.
fn kill_at_each_failpoint_then_resume(name: &str, extra: &[&str], behind: u64) {
    let base = scratch(name);
    let command = |root: &Path| -> Vec<String> {
        let mut flags = extra.to_vec();
        flags.extend([
            "--save-every",
            "1",
            "--keep-last",
            "1",
            "--resume",
            "auto",
            "--save",
        ]);
        let mut args: Vec<String> = run_args("4", &flags)
            .into_iter()
            .map(String::from)
            .collect();
        args.push(root.display().to_string());
        args
    };
    let run = |root: &Path, env: &[(&str, &str)]| {
        let args = command(root);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        hybridgen_in(&base, &args, env)
    };
    let straight = run(&base.join("straight"), &[]);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let curve = step_lines(&straight);
    assert_eq!(curve.len(), 4);
    let hash = summary(&straight)["param_hash"].clone();
    assert_eq!(summary(&straight)["saves_behind"], behind);

    // Every failpoint, each during the second or the third save (or at the
    // start, for those reached only there): the cases run in a few threads,
    // as each mostly waits on fsync.
    let cases: Vec<(usize, &str)> = FAILPOINTS.iter().copied().enumerate().collect();
    std::thread::scope(|scope| {
        for chunk in cases.chunks(FAILPOINTS.len().div_ceil(4)) {
            let run = &run;
            let (base, curve, hash) = (&base, &curve, &hash);
            scope.spawn(move || {
                for &(k, name) in chunk {
                    let save = 2 + (k as u64 % 2);
                    let point = format!("{name}:{}", nth_hit(name, save));
                    let root = base.join(name);
                    let killed = run(&root, &[(FAILPOINT_ENV, &point)]);
                    let err = stderr(&killed);
                    assert!(!killed.status.success(), "{point} was never reached");
                    assert!(
                        err.contains(&format!("failpoint {name} reached")),
                        "{point}: {err}"
                    );
                    // Up to the kill, the curve is the straight run's.
                    let before = step_lines(&killed);
                    assert_eq!(before[..], curve[..before.len()], "{point}");

                    // Every step directory left is complete and loads;
                    // `latest` names one; once a save completed, one stays.
                    let complete = complete_steps(&root);
                    for dir in &complete {
                        checkpoint::verify(dir)
                            .unwrap_or_else(|e| panic!("{point}: {}: {e}", dir.display()));
                    }
                    if let Ok(latest) = std::fs::read_to_string(root.join("latest")) {
                        assert!(
                            root.join(latest.trim()).is_dir(),
                            "{point}: latest {latest}"
                        );
                    }
                    let reached_saves = !name.starts_with("root-marker") && name != "lock-write";
                    if reached_saves {
                        assert!(
                            !complete.is_empty(),
                            "{point}: no complete checkpoint after a save had completed"
                        );
                    }

                    // The same command resumes and ends on the same bits.
                    let resumed = run(&root, &[]);
                    assert!(resumed.status.success(), "{point}: {}", stderr(&resumed));
                    let after = step_lines(&resumed);
                    let start = 4 - after.len();
                    assert_eq!(after[..], curve[start..], "{point}");
                    if reached_saves {
                        assert!(start as u64 >= save - 1, "{point}: resumed at step {start}");
                    }
                    let summary = summary(&resumed);
                    assert_eq!(summary["param_hash"], *hash, "{point}");
                    assert_eq!(summary["last_step"], 4, "{point}");
                    let steps = complete_steps(&root);
                    assert_eq!(
                        steps,
                        vec![root.join("step-000004")],
                        "{point}: --keep-last 1 leaves the newest step only"
                    );
                    assert_eq!(
                        std::fs::read_to_string(root.join("latest")).unwrap(),
                        "step-000004\n"
                    );
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_misspelt_failpoint_is_refused_before_any_step() {
    let base = scratch("failpoint-typo");
    let out = hybridgen_in(
        &base,
        &run_args("4", &["--save", "ckpt"]),
        &[(FAILPOINT_ENV, "index-fsnyc")],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(step_lines(&out).is_empty());
    assert!(
        stderr(&out).contains("`index-fsnyc` is not a failpoint"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_second_writer_fails_at_start_naming_the_holder() {
    let base = scratch("lock");
    let root = base.join("ckpt");
    // This test process holds the root, as a run in progress would.
    let mut config = hybridgen_runtime::train::TrainConfig::new(
        hybridgen_dsl::ModelConfig::preset("tiny").unwrap(),
    );
    config.save = Some(root.clone());
    let holder = hybridgen_runtime::train::prepare(&config).unwrap();
    let out = hybridgen(&run_args("4", &["--save", root.to_str().unwrap()]));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(step_lines(&out).is_empty(), "no step may run");
    assert!(
        err.contains("another run is writing checkpoints there"),
        "{err}"
    );
    assert!(
        err.contains(&format!("pid {}", std::process::id())),
        "{err}"
    );
    // Once the holder is gone, the root is free.
    drop(holder);
    let out = hybridgen(&run_args("4", &["--save", root.to_str().unwrap()]));
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&base);
}

/// Asserts `--save target` (run in `cwd`) is refused before any step with
/// `message`.
fn refused(cwd: &Path, target: &str, message: &str) {
    let out = hybridgen_in(cwd, &run_args("4", &["--save", target]), &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "--save {target}: {err}");
    assert!(step_lines(&out).is_empty(), "--save {target}: a step ran");
    assert!(err.contains(message), "--save {target}: {err}");
}

#[test]
fn save_refuses_anything_but_a_checkpoint_root_before_any_step() {
    let base = scratch("refusals");
    let project = base.join("project");
    std::fs::create_dir_all(project.join("src")).unwrap();
    std::fs::write(project.join("notes.txt"), "mine").unwrap();
    std::fs::write(project.join("src/main.rs"), "fn main() {}").unwrap();
    std::fs::write(base.join("report.txt"), "results").unwrap();
    let foreign = "not a hybridgen checkpoint root";
    refused(&base, "project", foreign);
    refused(&project, ".", foreign);
    refused(&project.join("src"), "..", foreign);
    refused(&base, "/", foreign);
    refused(&base, "report.txt", "it is a file, not a directory");
    // Nothing was moved, deleted or added.
    assert_eq!(
        std::fs::read_to_string(project.join("notes.txt")).unwrap(),
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(project.join("src/main.rs")).unwrap(),
        "fn main() {}"
    );
    assert_eq!(std::fs::read_dir(&project).unwrap().count(), 2);
    assert_eq!(
        std::fs::read_to_string(base.join("report.txt")).unwrap(),
        "results"
    );
    // A single checkpoint is not a root either.
    let ok = hybridgen_in(&base, &run_args("1", &["--save", "ckpt"]), &[]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    refused(&base, "ckpt/step-000001", "a single checkpoint");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_root_keeps_files_it_did_not_write() {
    let base = scratch("foreign-in-root");
    let run = |steps: &str| {
        let out = hybridgen_in(
            &base,
            &run_args(
                steps,
                &[
                    "--save",
                    "ckpt",
                    "--save-every",
                    "1",
                    "--keep-last",
                    "2",
                    "--resume",
                    "auto",
                ],
            ),
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
    };
    run("2");
    std::fs::write(base.join("ckpt/README"), "my notes").unwrap();
    std::fs::write(base.join("ckpt/step-000001/eval.txt"), "ppl 12").unwrap();
    run("5");
    // --keep-last 2: steps 4 and 5 remain; the notes too, and step 1's
    // directory, which holds a file hybridgen did not write, with it.
    let names: Vec<String> = complete_steps(&base.join("ckpt"))
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["step-000004", "step-000005"]);
    assert_eq!(
        std::fs::read_to_string(base.join("ckpt/README")).unwrap(),
        "my notes"
    );
    assert_eq!(
        std::fs::read_to_string(base.join("ckpt/step-000001.deleting/eval.txt")).unwrap(),
        "ppl 12"
    );
    assert!(
        !base
            .join("ckpt/step-000001.deleting/checkpoint.json")
            .exists()
    );
    assert_eq!(
        std::fs::read_to_string(base.join("ckpt/latest")).unwrap(),
        "step-000005\n"
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[cfg(unix)]
#[test]
fn a_symlinked_root_is_followed_never_replaced() {
    let base = scratch("symlink");
    std::fs::create_dir(base.join("real")).unwrap();
    std::os::unix::fs::symlink("real", base.join("link")).unwrap();
    let args = run_args("2", &["--save", "link", "--save-every", "1"]);
    let out = hybridgen_in(&base, &args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = hybridgen_in(
        &base,
        &run_args("3", &["--save", "link", "--resume", "auto"]),
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(summary(&out)["resumed_from"], 2);
    let link = std::fs::symlink_metadata(base.join("link")).unwrap();
    assert!(link.file_type().is_symlink(), "the link was replaced");
    assert_eq!(complete_steps(&base.join("real")).len(), 3);
    // A link to nothing is refused, and stays as it was.
    std::os::unix::fs::symlink("missing", base.join("dangling")).unwrap();
    refused(&base, "dangling", "which does not exist");
    assert!(!base.join("missing").exists());
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_resume_takes_the_seed_from_its_checkpoint() {
    let base = scratch("seed");
    let straight = hybridgen_in(&base, &run_args("4", &[]), &[]);
    assert!(straight.status.success());
    let curve = step_lines(&straight);
    // Two steps with seed 7, then a resume that does not repeat the seed.
    let first = hybridgen_in(&base, &run_args("2", &["--save", "ckpt"]), &[]);
    assert!(first.status.success(), "{}", stderr(&first));
    let args = [
        "train",
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--resume",
        "ckpt",
        "--save",
        "ckpt",
        "--format",
        "json",
    ];
    let second = hybridgen_in(&base, &args, &[]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert_eq!(step_lines(&second)[..], curve[2..]);
    assert_eq!(
        summary(&second)["param_hash"],
        summary(&straight)["param_hash"]
    );
    // Not by chance: the default seed trains another curve.
    let seed0: Vec<&str> = RUN
        .iter()
        .copied()
        .filter(|a| *a != "--seed" && *a != "7")
        .collect();
    let other = hybridgen_in(&base, &seed0, &[]);
    assert_ne!(step_lines(&other)[2..], curve[2..]);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_flag_contradicting_the_checkpoint_is_refused_naming_it() {
    let base = scratch("contradiction");
    let first = hybridgen_in(&base, &run_args("2", &["--save", "ckpt"]), &[]);
    assert!(first.status.success(), "{}", stderr(&first));
    for (flag, value, theirs) in [
        ("--seed", "8", "7"),
        ("--lr", "0.01", "0.003"),
        ("--micro-batches", "3", "2"),
        ("--data", "synthetic", "synthetic"),
    ] {
        let mut args = vec!["train", "--steps", "4", "--resume", "ckpt", flag, value];
        if flag == "--data" {
            std::fs::write(base.join("corpus.txt"), "some text ".repeat(100)).unwrap();
            args[6] = "corpus.txt";
        }
        let out = hybridgen_in(&base, &args, &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{flag}: {err}");
        assert!(step_lines(&out).is_empty());
        assert!(
            err.contains(&format!("{flag} ")) && err.contains("contradicts"),
            "{err}"
        );
        assert!(err.contains(&format!("Leave {flag} out")), "{err}");
        assert!(err.contains(theirs), "{err}");
    }
    // Repeating a setting is fine, and the layout may change: checkpoints
    // reshard.
    let out = hybridgen_in(
        &base,
        &[
            "train", "--steps", "3", "--resume", "ckpt", "--seed", "7", "--ranks", "1", "--ep", "1",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn resume_auto_without_a_checkpoint_starts_fresh_and_needs_save() {
    let base = scratch("auto");
    let out = hybridgen_in(
        &base,
        &run_args("4", &["--save", "ckpt", "--resume", "auto"]),
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(summary(&out)["resumed_from"], Value::Null);
    assert_eq!(summary(&out)["checkpoint"], "ckpt/step-000004");
    // The save's own time is part of the run's.
    let save = summary(&out)["save_s"].as_f64().unwrap();
    assert!(
        save > 0.0 && save < summary(&out)["wall_s"].as_f64().unwrap(),
        "{}",
        summary(&out)
    );
    // Run again, the job is done: no step, nothing written.
    let again = hybridgen_in(
        &base,
        &run_args("4", &["--save", "ckpt", "--resume", "auto"]),
        &[],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(step_lines(&again).is_empty());
    assert_eq!(summary(&again)["resumed_from"], 4);
    assert_eq!(summary(&again)["save_s"], 0.0);
    // Without --save, auto has nowhere to look.
    let out = hybridgen_in(&base, &run_args("4", &["--resume", "auto"]), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("give --save DIR"), "{}", stderr(&out));
    // A fresh run into a root that holds a later history is refused.
    let out = hybridgen_in(&base, &run_args("4", &["--save", "ckpt"]), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("newer than step 0"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_resume_takes_the_precision_from_its_checkpoint_and_refuses_another() {
    let base = scratch("precision");
    let straight = hybridgen_in(&base, &run_args("4", &["--precision", "bf16"]), &[]);
    assert!(straight.status.success(), "{}", stderr(&straight));
    assert_eq!(summary(&straight)["precision"], "bf16");
    let first = hybridgen_in(
        &base,
        &run_args("2", &["--precision", "bf16", "--save", "ckpt"]),
        &[],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    // Left out: the checkpoint's bf16, onto the same curve.
    let second = hybridgen_in(&base, &run_args("4", &["--resume", "ckpt"]), &[]);
    assert!(second.status.success(), "{}", stderr(&second));
    assert_eq!(summary(&second)["precision"], "bf16");
    assert_eq!(step_lines(&second)[..], step_lines(&straight)[2..]);
    assert_eq!(
        summary(&second)["param_hash"],
        summary(&straight)["param_hash"]
    );
    // Given and different: refused before any step, naming both.
    let out = hybridgen_in(
        &base,
        &run_args("4", &["--resume", "ckpt", "--precision", "f32"]),
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(step_lines(&out).is_empty());
    assert!(
        err.contains("--precision f32 contradicts") && err.contains("--precision bf16"),
        "{err}"
    );
    assert!(err.contains("Leave --precision out"), "{err}");
    let _ = std::fs::remove_dir_all(&base);
}

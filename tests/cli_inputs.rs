//! `hybridgen train` on inputs that used to hang, exhaust memory or fail
//! late: each is refused promptly with a clear message, and with `--format
//! json` stdout ends with an `{"error": {"code", "message"}}` object.
//! Every run has a deadline, so a regression fails instead of hanging.

use serde_json::Value;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `hybridgen train ARGS` with 16 GiB of memory available (the same
/// figure on every machine), killing it after `deadline`.
fn train(args: &[&str], deadline: Duration) -> Run {
    train_with(args, deadline, &[("HYBRIDGEN_MEMORY_AVAILABLE", "16G")])
}

fn train_with(args: &[&str], deadline: Duration, env: &[(&str, &str)]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_hybridgen"));
    command
        .arg("train")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("the hybridgen binary runs");
    // Drain the pipes while waiting, so a chatty child cannot block.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hybridgen train {args:?} still ran after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

const PROMPT: Duration = Duration::from_secs(60);

/// The `{"error": ...}` object that must end stdout, as (code, message).
fn error_object(run: &Run) -> (String, String) {
    let last = run
        .stdout
        .lines()
        .last()
        .unwrap_or_else(|| panic!("stdout is empty; stderr:\n{}", run.stderr));
    let value: Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("the last stdout line is not JSON ({e}): {last}"));
    let error = &value["error"];
    (
        error["code"]
            .as_str()
            .unwrap_or_else(|| panic!("no code: {last}"))
            .to_string(),
        error["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no message: {last}"))
            .to_string(),
    )
}

#[test]
fn data_that_would_block_or_never_end_is_refused_by_name() {
    let fifo = std::env::temp_dir().join(format!("hybridgen-cli-fifo-{}", std::process::id()));
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status();
    assert!(
        made.is_ok_and(|s| s.success()),
        "mkfifo is needed for this test"
    );
    let fifo = fifo.to_str().unwrap().to_string();
    let dir = std::env::temp_dir();
    let dir = dir.to_str().unwrap().trim_end_matches('/').to_string();
    for (path, expected) in [
        (
            "/dev/zero",
            "/dev/zero: this is a character device, not a data file",
        ),
        (
            fifo.as_str(),
            "this is a FIFO (named pipe), not a data file",
        ),
        (dir.as_str(), "this is a directory, not a data file"),
    ] {
        let run = train(&["--data", path, "--steps", "1"], PROMPT);
        assert_eq!(run.code, Some(1), "{path}: {}", run.stderr);
        assert!(run.stderr.contains(expected), "{path}: {}", run.stderr);
        assert!(run.stdout.is_empty(), "{path}: {}", run.stdout);
        let run = train(&["--data", path, "--format", "json"], PROMPT);
        let (code, message) = error_object(&run);
        assert_eq!(code, "io", "{message}");
        assert!(message.contains(expected), "{message}");
    }
    let _ = std::fs::remove_file(&fifo);
    let run = train(&["--data", "", "--format", "json"], PROMPT);
    assert_eq!(run.code, Some(1));
    let (code, message) = error_object(&run);
    assert_eq!(code, "invalid_config");
    assert_eq!(
        message,
        "--data is empty: give a file to train on, or `synthetic`"
    );
}

#[test]
fn runs_that_cannot_fit_in_memory_are_refused_with_the_figures() {
    for args in [
        &["--preset", "nemotron-nano-9b-v2"][..],
        &["--pattern", "M{100000}"],
        &["--micro-batch-size", "128", "--seq-len", "16384"],
    ] {
        let run = train(args, PROMPT);
        assert_eq!(run.code, Some(1), "{args:?}: {}", run.stderr);
        assert!(run.stdout.is_empty(), "{args:?}: nothing may start");
        for figure in [
            "error: this run needs ",
            "but 16.0 GiB is available (the configured limit)",
            "per rank: ",
            "activations (2 micro-batches in flight",
            "2 thread ranks in this process",
            "to fit, try:",
        ] {
            assert!(
                run.stderr.contains(figure),
                "{args:?} lacks {figure:?}:\n{}",
                run.stderr
            );
        }
        let mut json = args.to_vec();
        json.extend(["--format", "json"]);
        let (code, message) = error_object(&train(&json, PROMPT));
        assert_eq!(code, "out_of_memory", "{message}");
    }
    // The override itself is checked.
    let run = train_with(
        &["--steps", "1"],
        PROMPT,
        &[("HYBRIDGEN_MEMORY_AVAILABLE", "lots")],
    );
    assert_eq!(run.code, Some(1));
    assert!(
        run.stderr
            .contains("HYBRIDGEN_MEMORY_AVAILABLE=lots is not a memory size"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_refusal_for_activations_offers_recomputation_and_recomputation_needs_less() {
    let args = [
        "--pattern",
        "M*-M*-",
        "--micro-batch-size",
        "128",
        "--seq-len",
        "16384",
    ];
    let with = |recompute: &'static str| {
        let mut args = args.to_vec();
        args.extend(["--recompute", recompute]);
        train(&args, PROMPT)
    };
    let need = |run: &Run| {
        let line = run
            .stderr
            .lines()
            .find(|l| l.contains("per rank: "))
            .unwrap_or("");
        line.split_whitespace()
            .nth(2)
            .and_then(|v| v.parse::<f64>().ok())
    };
    let keep = with("none");
    assert_eq!(keep.code, Some(1), "{}", keep.stderr);
    assert!(
        keep.stderr.contains("automatic recomputation"),
        "{}",
        keep.stderr
    );
    // auto is the default.
    let (again, auto) = (with("full"), train(&args, PROMPT));
    for run in [&again, &auto] {
        assert_eq!(run.code, Some(1), "{}", run.stderr);
        assert!(
            !run.stderr.contains("automatic recomputation"),
            "{}",
            run.stderr
        );
    }
    match (need(&keep), need(&again), need(&auto)) {
        (Some(a), Some(b), Some(c)) => {
            assert!(b < a, "{b} GiB with recomputation, {a} without");
            // Where nothing fits, auto recomputes all it can.
            assert_eq!(c, b);
        }
        other => panic!(
            "no per-rank figures: {other:?}\n{}\n{}\n{}",
            keep.stderr, again.stderr, auto.stderr
        ),
    }
}

/// The default, `--recompute auto`, trains where `none` is refused: with
/// memory between what keeping everything and recomputing everything need,
/// it recomputes some of the layers, and the start line says how many.
#[test]
fn auto_recomputation_trains_what_keeping_everything_cannot() {
    let args = [
        "--pattern",
        "M*-M*-",
        "--micro-batch-size",
        "8",
        "--seq-len",
        "512",
        "--steps",
        "1",
    ];
    // The refusal's figure: "this run needs at least 165.4 MiB" (the bound
    // made before planning), or "about" (the full estimate) once the memory
    // given passes the bound.
    let refused = |recompute: &str, available: &str| {
        let mut args = args.to_vec();
        args.extend(["--recompute", recompute]);
        let run = train_with(&args, PROMPT, &[("HYBRIDGEN_MEMORY_AVAILABLE", available)]);
        assert_eq!(run.code, Some(1), "{}", run.stderr);
        let figure = run
            .stderr
            .split_once("this run needs ")
            .map(|(_, rest)| {
                rest.trim_start_matches("at least ")
                    .trim_start_matches("about ")
            })
            .unwrap_or_else(|| panic!("no need figure: {}", run.stderr));
        let words: Vec<&str> = figure.split_whitespace().take(2).collect();
        let unit = match words[1] {
            "KiB" => 1u64 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            other => panic!("unit {other}: {}", run.stderr),
        };
        let bytes = (words[0].parse::<f64>().unwrap() * unit as f64) as u64;
        (bytes, run.stderr.contains("needs about"))
    };
    let need = |recompute: &str| {
        let (bound, estimate) = refused(recompute, "1K");
        assert!(!estimate);
        // 1% over the bound (its figure rounds to 0.1 MiB) passes it; the
        // full estimate, with the arenas' headroom, is well above.
        let (need, estimate) = refused(recompute, &(bound + bound / 100).to_string());
        assert!(estimate && need > bound);
        need
    };
    let (keep, again) = (need("none"), need("full"));
    assert!(again < keep, "{again} recomputed, {keep} kept");
    let between = ((keep + again) / 2).to_string();
    let env = [("HYBRIDGEN_MEMORY_AVAILABLE", between.as_str())];
    let mut none = args.to_vec();
    none.extend(["--recompute", "none"]);
    let run = train_with(&none, PROMPT, &env);
    assert_eq!(run.code, Some(1), "none is refused: {}", run.stderr);
    let run = train_with(&args, PROMPT, &env);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    // "..., recomputing 3 of 6 layers, 1 steps of ..."
    let start = run.stdout.lines().next().unwrap_or("");
    let n = start
        .split_once("recomputing ")
        .and_then(|(_, rest)| rest.split_once(" of 6 layers"))
        .and_then(|(n, _)| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no recomputation in the start line: {start}"));
    assert!((1..6).contains(&n), "{start}");
}

#[test]
fn timeouts_are_whole_seconds_up_to_a_week() {
    for value in ["18446744073709551615", "604801", "0", "-5", "1e3"] {
        let run = train(&["--timeout", value], PROMPT);
        assert_eq!(run.code, Some(2), "{value}: {}", run.stderr);
        assert!(
            run.stderr.contains(&format!(
                "`{value}` is not a timeout; give whole seconds from 1 to 604800 (a week)"
            )),
            "{value}: {}",
            run.stderr
        );
        assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    }
    let run = train(&["--timeout", "604800", "--steps", "1"], PROMPT);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
}

#[test]
fn float_flags_are_finite_and_in_range() {
    for (flag, value, expected) in [
        (
            "--lr",
            "-inf",
            "-inf is not a finite number; give a finite learning rate above 0",
        ),
        ("--lr", "nan", "NaN is not a finite number"),
        ("--lr", "inf", "inf is not a finite number"),
        (
            "--lr",
            "0",
            "0 is out of range; give a finite learning rate above 0",
        ),
        ("--lr", "-1e-3", "-0.001 is out of range"),
        ("--lr", "fast", "`fast` is not a number"),
        (
            "--clip-grad",
            "nan",
            "NaN is not a finite number; give a finite norm above 0, or 0 to turn clipping off",
        ),
        (
            "--clip-grad",
            "-1",
            "-1 is out of range; give a finite norm above 0, or 0 to turn clipping off",
        ),
        ("--clip-grad", "inf", "inf is not a finite number"),
        (
            "--weight-decay",
            "-0.1",
            "-0.1 is out of range; give a finite decay of 0 or more",
        ),
        ("--weight-decay", "nan", "NaN is not a finite number"),
    ] {
        for args in [vec![flag, value], vec![&*format!("{flag}={value}")]] {
            let run = train(&args, PROMPT);
            assert_eq!(run.code, Some(2), "{args:?}: {}", run.stderr);
            assert!(
                run.stderr
                    .contains(&format!("invalid value '{value}' for '{flag}")),
                "{args:?}: {}",
                run.stderr
            );
            assert!(run.stderr.contains(expected), "{args:?}: {}", run.stderr);
        }
    }
    // 0 is the documented off switch for clipping.
    let run = train(&["--clip-grad", "0", "--steps", "1"], PROMPT);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
}

#[test]
fn a_trace_path_that_cannot_be_written_fails_before_the_first_step() {
    let dir = std::env::temp_dir();
    let dir = dir.to_str().unwrap();
    let run = train(&["--trace", dir, "--steps", "1"], PROMPT);
    assert_eq!(run.code, Some(1));
    assert!(run.stdout.is_empty(), "a step ran: {}", run.stdout);
    assert!(run.stderr.contains("this is a directory"), "{}", run.stderr);
    let run = train(
        &[
            "--trace",
            "/nonexistent-hybridgen/t.json",
            "--format",
            "json",
        ],
        PROMPT,
    );
    assert_eq!(run.stdout.lines().count(), 1, "{}", run.stdout);
    let (code, message) = error_object(&run);
    assert_eq!(code, "io");
    assert!(
        message.contains("/nonexistent-hybridgen does not exist"),
        "{message}"
    );
}

#[test]
fn json_output_ends_with_an_error_object_whatever_stopped_the_run() {
    // A usage error, a refused configuration, and a run that diverged after
    // printing its first step.
    let run = train(&["--format", "json", "--lr", "-1"], PROMPT);
    assert_eq!(run.code, Some(2));
    let (code, message) = error_object(&run);
    assert_eq!(code, "usage");
    assert!(
        message.starts_with("invalid value '-1' for '--lr <LR>'"),
        "{message}"
    );
    assert!(!message.contains("--help"), "{message}");

    let run = train(&["--format=json", "--ranks", "3", "--ep", "2"], PROMPT);
    assert_eq!(run.code, Some(1));
    let (code, message) = error_object(&run);
    assert_eq!(code, "invalid_config");
    assert!(message.contains("not divisible by --ep 2"), "{message}");

    let run = train(
        &[
            "--format",
            "json",
            "--lr",
            "1e30",
            "--clip-grad",
            "0",
            "--steps",
            "4",
        ],
        PROMPT,
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "one step, then the error: {}", run.stdout);
    let step: Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(step["step"], 1);
    let (code, message) = error_object(&run);
    assert_eq!(code, "diverged");
    assert!(
        message.starts_with("ranks 0, 1: training diverged at step 2: the loss is NaN"),
        "{message}"
    );
    assert!(message.contains("no gradient clipping"), "{message}");

    // Text mode puts the same root cause first on stderr.
    let run = train(
        &["--lr", "1e30", "--clip-grad", "0", "--steps", "4"],
        PROMPT,
    );
    assert_eq!(run.code, Some(1));
    assert!(
        run.stderr
            .starts_with("error: ranks 0, 1: training diverged at step 2: the loss is NaN\n"),
        "{}",
        run.stderr
    );
}

/// `--attention-backend` picks GPU kernels: the CPU has one attention path,
/// so both values train to the same bits there; another value is refused
/// with the ones there are.
#[test]
fn the_attention_backend_is_a_gpu_choice() {
    let hash = |backend: &str| {
        let args = [
            "--device",
            "cpu",
            "--steps",
            "2",
            "--seq-len",
            "16",
            "--format",
            "json",
            "--attention-backend",
            backend,
        ];
        let run = train(&args, PROMPT);
        assert_eq!(run.code, Some(0), "{backend}: {}", run.stderr);
        let summary = run
            .stdout
            .lines()
            .find(|l| l.contains("\"summary\""))
            .unwrap_or_else(|| panic!("{backend}: no summary in\n{}", run.stdout))
            .to_string();
        let v: serde_json::Value = serde_json::from_str(&summary).unwrap();
        v["summary"]["param_hash"].as_str().unwrap().to_string()
    };
    assert_eq!(hash("flash"), hash("unfused"));
    let run = train(&["--attention-backend", "fused"], PROMPT);
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(
        run.stderr.contains("possible values: flash, unfused"),
        "{}",
        run.stderr
    );
}

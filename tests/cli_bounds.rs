//! The command line on inputs that could hang it or exhaust it: a flood of
//! pattern errors prints a bounded report, model files that are not regular
//! files are refused at once, bad real-valued fields and empty patterns are
//! coded errors, and `plan` streams its report (byte-identical to the
//! documented format, held in golden files) without holding it in memory.

use hybridgen::cli::plan::write_json;
use hybridgen::{ModelConfig, Plan, PlanOptions};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `hybridgen args`, failing (not hanging) when it takes over 60 s.
fn hybridgen(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hybridgen"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the hybridgen binary runs");
    // Drain the pipes on threads so a large report cannot block the child.
    let read = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            pipe.read_to_end(&mut bytes).map(|_| bytes)
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("hybridgen {args:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap().unwrap(),
        stderr: stderr.join().unwrap().unwrap(),
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A fresh directory under the target's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-bounds-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The `tiny` preset as a model file with `pattern`, and `extra` (top-level
/// keys) after it.
fn model_file(dir: &Path, name: &str, pattern: &str, extra: &str) -> String {
    let tiny = ModelConfig::preset_source("tiny").unwrap();
    let start = tiny.find("pattern = ").unwrap();
    let end = start + tiny[start..].find('\n').unwrap();
    let text = format!(
        "{}pattern = \"{pattern}\"{extra}{}",
        &tiny[..start],
        &tiny[end..]
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

// ---- bounded reports ---------------------------------------------------------------------------

#[test]
fn check_on_a_flood_of_errors_prints_a_bounded_report() {
    let out = hybridgen(&["check", &"]".repeat(120_000)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let err = stderr(&out);
    // 17 GB before: the 120,000-character line twice per error.
    assert!(err.len() < 20_000, "{} bytes", err.len());
    assert_eq!(err.matches("error[H003]").count(), 50);
    assert!(
        err.ends_with("\n... and 119950 more errors\n120000 errors\n"),
        "{}",
        &err[err.len() - 300..]
    );
}

#[test]
fn a_ten_megabyte_pattern_in_a_model_file_gets_a_short_report() {
    let dir = scratch("long-pattern");
    // Too long to read: one error.
    let model = model_file(&dir, "long.toml", &"M".repeat(10_000_000), "");
    let out = hybridgen(&["plan", "--model", &model]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.len() < 1_000, "{err}");
    assert!(err.contains(
        "error[H012]: the pattern is 10000000 bytes long, over the limit of 1048576 (1 MiB)"
    ));
    assert!(err.contains(" --> pattern:1:1048577\n"), "{err}");
    // Read (white space is free), with an error at its far end: the line
    // is cut to a window around it (2 MB before).
    let model = model_file(
        &dir,
        "spaces.toml",
        &format!("{}x", " ".repeat(1_000_000)),
        "",
    );
    let out = hybridgen(&["plan", "--model", &model]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.len() < 1_000, "{err}");
    assert!(
        err.contains(&format!("1 | ...{}x\n", " ".repeat(40))),
        "{err}"
    );
}

// ---- model files -------------------------------------------------------------------------------

#[test]
fn model_files_that_are_not_regular_files_are_refused_at_once() {
    let dir = scratch("kinds");
    let refused = |path: &str, kind: &str| {
        let out = hybridgen(&["plan", "--model", path]);
        assert_eq!(out.status.code(), Some(1), "{path}");
        assert_eq!(
            stderr(&out),
            format!("error: cannot read model file {path}: it is {kind}, not a regular file\n")
        );
    };
    refused(&dir.display().to_string(), "a directory");
    #[cfg(unix)]
    {
        // Read until memory ran out before.
        refused("/dev/zero", "a character device");
        // Blocked forever before, waiting for a writer.
        let fifo = dir.join("model.fifo");
        assert!(
            Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .expect("mkfifo runs")
                .success()
        );
        refused(&fifo.display().to_string(), "a FIFO (named pipe)");
    }
}

#[test]
fn oversized_model_files_are_refused() {
    let dir = scratch("size");
    let big = dir.join("big.toml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(16 * 1024 * 1024 + 1)
        .unwrap();
    let out = hybridgen(&["plan", "--model", &big.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("is larger than the limit of 16777216 bytes"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_real_valued_fields_are_coded_errors() {
    let dir = scratch("reals");
    for (extra, field, value) in [
        ("\ninit_std = 0.0", "init_std", "0"),
        ("\ninit_std = nan", "init_std", "NaN"),
        ("\nmtp = { loss_scale = -inf }", "mtp.loss_scale", "-inf"),
    ] {
        let model = model_file(&dir, "model.toml", "M*E", extra);
        let out = hybridgen(&["plan", "--model", &model]);
        assert_eq!(out.status.code(), Some(1), "{extra}");
        let err = stderr(&out);
        assert!(
            err.contains(&format!(
                "error[H025]: `{field} = {value}` is not a finite number"
            )),
            "{err}"
        );
    }
    // rope_base sits in [attention]; the tiny preset has the section.
    let tiny = ModelConfig::preset_source("tiny").unwrap();
    for value in ["nan", "0", "-1.5", "inf"] {
        let path = dir.join("rope.toml");
        let text = tiny.replace(
            "position = \"rope\"",
            &format!("position = \"rope\"\nrope_base = {value}"),
        );
        std::fs::write(&path, text).unwrap();
        let out = hybridgen(&["plan", "--model", &path.display().to_string()]);
        assert_eq!(out.status.code(), Some(1), "{value}");
        assert!(
            stderr(&out).contains("error[H025]: `attention.rope_base = "),
            "{}",
            stderr(&out)
        );
    }
}

#[test]
fn an_empty_pattern_checks_but_does_not_plan() {
    let out = hybridgen(&["check", ""]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = hybridgen(&["plan", ""]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with("error[H028]: the pattern has no layers\n"),
        "{}",
        stderr(&out)
    );
    let out = hybridgen(&["explain", "H028"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("H028: a model without layers\n"));
}

// ---- plan output: the same bytes, streamed ------------------------------------------------------

/// Plans written by the command line before `plan` streamed its output,
/// compared byte for byte in both formats.
const GOLDEN: [(&str, &[&str]); 5] = [
    ("grouped_moe", &["M[*E]M[*E]", "--dp", "4", "--ep", "2"]),
    (
        "pipeline_mtp_units",
        &[
            "(M*){3}|[*E]-/*E/*E",
            "--pp",
            "2",
            "--dp",
            "2",
            "--ep",
            "2",
            "--units",
            "group,E",
        ],
    ),
    (
        "latent_attention",
        &["+D[G-]|[+E]/DE", "--pp", "2", "--dp", "4", "--ep", "4"],
    ),
    ("empty_decoder", &["/MM/MM"]),
    (
        "nemotron_nano_9b_v2",
        &["--preset", "nemotron-nano-9b-v2", "--pp", "2", "--dp", "8"],
    ),
];

#[test]
fn plan_output_is_byte_identical_to_the_golden_files() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/plan");
    for (name, args) in GOLDEN {
        for (format, extension) in [("json", "json"), ("text", "txt")] {
            let mut all = vec!["plan"];
            all.extend_from_slice(args);
            all.extend(["--format", format]);
            let out = hybridgen(&all);
            assert_eq!(out.status.code(), Some(0), "{name}: {}", stderr(&out));
            let path = golden.join(format!("{name}.{extension}"));
            let expected = std::fs::read(&path).unwrap();
            if out.stdout != expected {
                let at = out
                    .stdout
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a != b)
                    .unwrap_or(out.stdout.len().min(expected.len()));
                let context = |bytes: &[u8]| {
                    String::from_utf8_lossy(
                        &bytes[at.saturating_sub(80)..(at + 80).min(bytes.len())],
                    )
                    .into_owned()
                };
                panic!(
                    "{} differs at byte {at}:\n got: {}\nwant: {}",
                    path.display(),
                    context(&out.stdout),
                    context(&expected)
                );
            }
        }
    }
}

#[test]
fn every_object_of_the_json_plan_has_its_keys_in_order() {
    // Re-serializing through `serde_json::Value` sorts every map's keys:
    // a streamed document equal to its re-serialization writes each object
    // in the order the document has always had.
    for (name, args) in GOLDEN {
        let mut all = vec!["plan"];
        all.extend_from_slice(args);
        all.extend(["--format", "json"]);
        let out = hybridgen(&all);
        let text = String::from_utf8(out.stdout).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(text, format!("{value}\n"), "{name}");
    }
}

// ---- plan output: memory -------------------------------------------------------------------------

/// Counts the heap this thread holds, and its peak, so a test can measure
/// what one call allocates even while other tests run.
struct ThreadHeap;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(change: isize) {
    let _ = HELD.try_with(|held| {
        let now = held.get() + change;
        held.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is passed to the system allocator unchanged; the
// bookkeeping touches only thread-locals of plain integers (no allocation).
unsafe impl GlobalAlloc for ThreadHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, layout) };
        account(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let q = unsafe { System.realloc(p, layout, new_size) };
        if !q.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        q
    }
}

#[global_allocator]
static HEAP: ThreadHeap = ThreadHeap;

/// Bytes `f` allocated on this thread at its peak, beyond what was held
/// before.
fn peak_heap_of(f: impl FnOnce()) -> usize {
    let before = HELD.with(Cell::get);
    PEAK.with(|peak| peak.set(before));
    f();
    (PEAK.with(Cell::get) - before).max(0) as usize
}

/// Counts bytes written and keeps none.
struct CountingSink(usize);

impl std::io::Write for CountingSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len();
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_json_plan_is_written_without_holding_it() {
    let mut model = ModelConfig::preset("tiny").unwrap();
    for layers in [1_000, 20_000] {
        model.pattern = format!("(M[*E]M-){{{}}}", layers / 5);
        let plan = Plan::new(&model, &PlanOptions::default()).unwrap();
        let mut sink = CountingSink(0);
        let peak = peak_heap_of(|| write_json(&plan, &mut sink).unwrap());
        // A 20,000-layer plan is 20 MB of JSON; building it as a document
        // first took over twenty times that. Streamed, the writer holds
        // one element's strings at a time.
        assert!(sink.0 > 1_000 * layers, "{} bytes", sink.0);
        assert!(peak < 64 * 1024, "{layers} layers: {peak} bytes held");
    }
}

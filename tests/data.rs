//! Real training runs as a user makes them: text tokenized by `data
//! prepare` with a tokenizer made here, trained through `--data-path` with
//! a schedule, evaluation and a log file, plotted; resumes that continue
//! bit-exactly; and every bad input refused with a message that says what
//! is wrong, before any step.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

mod support;
use support::{hybridgen, stderr, stdout};

/// A fresh scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        Scratch(support::scratch("data", name))
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const WORDS: [&str; 20] = [
    "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "saw", "bird", "in",
    "tree", "big", "small", "red", "blue", "house",
];

/// A WordLevel tokenizer.json over `WORDS` and `.`, with `<|endoftext|>`
/// as token 0 (`extra` more filler tokens make its vocabulary larger).
fn tokenizer_json(extra: usize) -> String {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<|endoftext|>", "<unk>", "."]
        .iter()
        .chain(WORDS.iter())
        .enumerate()
    {
        vocab.insert(t.to_string(), Value::from(i));
    }
    for i in 0..extra {
        let id = vocab.len();
        vocab.insert(format!("filler{i}"), Value::from(id));
    }
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

/// `paragraphs` paragraphs of simple sentences (a fixed pseudo-random
/// choice), separated by blank lines: a text a small model learns fast.
fn story(paragraphs: usize) -> String {
    let mut state = 12345u64;
    let mut pick = |n: usize| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as usize % n
    };
    let subjects = ["the cat", "a dog", "the bird", "a small cat", "the big dog"];
    let verbs = ["sat on", "ran to", "saw"];
    let objects = [
        "the mat",
        "the park",
        "a tree",
        "the red house",
        "the blue house",
    ];
    let mut text = String::new();
    for _ in 0..paragraphs {
        let sentences = 2 + pick(4);
        for s in 0..sentences {
            if s > 0 {
                text.push(' ');
            }
            text += &format!(
                "{} {} {} .",
                subjects[pick(5)],
                verbs[pick(3)],
                objects[pick(5)]
            );
        }
        text += "\n\n";
    }
    text
}

/// A corpus prepared from `story(paragraphs)` at `dir/name`; returns the
/// prefix and `data prepare`'s output (it succeeded).
fn prepare(dir: &Scratch, name: &str, paragraphs: usize) -> (String, Output) {
    let tokenizer = dir.path("tokenizer.json");
    std::fs::write(&tokenizer, tokenizer_json(0)).unwrap();
    let text = dir.path(&format!("{name}.txt"));
    std::fs::write(&text, story(paragraphs)).unwrap();
    let prefix = dir.path(name);
    let out = hybridgen(&[
        "data",
        "prepare",
        "--input",
        &text,
        "--tokenizer",
        &tokenizer,
        "--output",
        &prefix,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    (prefix, out)
}

/// The prefix of [`prepare`]'s corpus.
fn prepared(dir: &Scratch, name: &str, paragraphs: usize) -> String {
    prepare(dir, name, paragraphs).0
}

/// The JSON objects of stdout (or of a log file's text).
fn objects(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

/// Step objects without their wall-clock time, as strings: equal strings
/// are equal bits.
fn steps(text: &str) -> Vec<(u64, String)> {
    objects(text)
        .into_iter()
        .filter(|v| v.get("step").is_some())
        .map(|mut v| {
            v.as_object_mut().unwrap().remove("step_ms");
            (v["step"].as_u64().unwrap(), v.to_string())
        })
        .collect()
}

/// `hybridgen train --device cpu --resume checkpoint` with `extra` flags.
fn resume(checkpoint: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--device", "cpu", "--resume", checkpoint];
    args.extend_from_slice(extra);
    hybridgen(&args)
}

/// A small run on `prefix` (steps and more flags in `extra`).
fn train_args<'a>(prefix: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        "--device",
        "cpu",
        "--data-path",
        prefix,
        "--split",
        "90,10,0",
        "--seq-len",
        "32",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "4",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn a_prepared_corpus_trains_with_a_schedule_evaluation_a_log_and_a_plot() {
    let dir = Scratch::new("e2e");
    let (prefix, out) = prepare(&dir, "story", 300);
    let tokenizer = dir.path("tokenizer.json");
    let summary = stdout(&out);
    assert!(summary.contains("documents       300\n"), "{summary}");
    assert!(
        summary.contains("end-of-document <|endoftext|> = 0"),
        "{summary}"
    );
    assert!(summary.contains("vocab_size >= 23"), "{summary}");
    assert!(summary.contains("tokens/s"), "{summary}");
    // The corpus holds the tokenizer's ids, each document ended by 0.
    let idx = std::fs::read(format!("{prefix}.idx")).unwrap();
    assert_eq!(&idx[..9], b"MMIDIDX\x00\x00");
    assert_eq!(idx[17], 8, "uint16 tokens for a small vocabulary");
    let bin = std::fs::read(format!("{prefix}.bin")).unwrap();
    let first_len = i32::from_le_bytes(idx[34..38].try_into().unwrap()) as usize;
    let first: Vec<u16> = bin[..2 * first_len]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(first.last(), Some(&0));
    assert!(first[..first_len - 1].iter().all(|t| (2..23).contains(t)));

    let log = dir.path("run.jsonl");
    let out = hybridgen(&train_args(
        &prefix,
        &[
            "--steps",
            "40",
            "--tokenizer",
            &tokenizer,
            "--warmup",
            "5",
            "--lr-decay-style",
            "cosine",
            "--min-lr",
            "3e-4",
            "--eval-every",
            "10",
            "--eval-steps",
            "2",
            "--log-file",
            &log,
        ],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let lines = objects(&stdout(&out));
    let step_lines: Vec<&Value> = lines.iter().filter(|v| v.get("step").is_some()).collect();
    assert_eq!(step_lines.len(), 40);
    let loss = |i: usize| step_lines[i]["loss"].as_f64().unwrap();
    assert!(loss(39) < 0.5 * loss(0), "{} -> {}", loss(0), loss(39));
    // Evaluation on steps 10, 20, 30, 40 only, and it falls too.
    let evals: Vec<(u64, f64)> = step_lines
        .iter()
        .filter_map(|v| Some((v["step"].as_u64()?, v.get("eval_loss")?.as_f64()?)))
        .collect();
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        [10, 20, 30, 40]
    );
    assert!(evals[3].1 < evals[0].1, "{evals:?}");
    // The cosine schedule: peak at the end of the warm-up, min at the end.
    let lr = |i: usize| step_lines[i]["lr"].as_f64().unwrap();
    assert_eq!(lr(4), 3e-3);
    assert!((lr(39) - 3e-4).abs() < 1e-9, "{}", lr(39));
    assert!(lr(20) < lr(10) && lr(30) < lr(20));
    // The log has the same step lines and the summary.
    let logged = std::fs::read_to_string(&log).unwrap();
    assert_eq!(steps(&logged), steps(&stdout(&out)));
    let summary = objects(&logged).last().unwrap()["summary"].clone();
    assert_eq!(summary["final_eval_loss"], step_lines[39]["eval_loss"]);
    // A second run appends.
    let out = hybridgen(&train_args(&prefix, &["--steps", "3", "--log-file", &log]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(steps(&std::fs::read_to_string(&log).unwrap()).len(), 43);

    let other = dir.path("other.jsonl");
    let out = hybridgen(&train_args(
        &prefix,
        &[
            "--steps",
            "12",
            "--eval-every",
            "4",
            "--lr",
            "1e-3",
            "--log-file",
            &other,
        ],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let svg = dir.path("curves.svg");
    let out = hybridgen(&["plot", &log, &other, "--output", &svg]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("(2 runs,"), "{}", stdout(&out));
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.starts_with("<svg"),
        "{}",
        &picture[..100.min(picture.len())]
    );
    assert!(picture.contains("run.jsonl eval loss"));
    assert!(picture.contains("other.jsonl loss"));
    // Two loss lines and two dashed eval lines.
    assert!(picture.matches("<polyline").count() >= 4, "{picture}");
}

/// GPT-2's byte-level BPE alphabet: bytes to the characters that stand
/// for them in its vocabulary.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut by_byte = vec!['?'; 256];
    for (b, c) in printable.iter().zip(&chars) {
        by_byte[*b as usize] = char::from_u32(*c).unwrap();
    }
    by_byte
}

#[test]
fn byte_level_bpe_tokenizers_prepare_text() {
    let dir = Scratch::new("bpe");
    // 256 byte tokens (in GPT-2's order: printable bytes first), three
    // merges, then <|endoftext|>.
    let alphabet = byte_chars();
    let mut order: Vec<u8> = (b'!'..=b'~')
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    order.extend(
        (0..=255u8)
            .filter(|b| !order.contains(b))
            .collect::<Vec<_>>(),
    );
    let mut vocab = serde_json::Map::new();
    for (id, b) in order.iter().enumerate() {
        vocab.insert(alphabet[*b as usize].to_string(), Value::from(id));
    }
    for (id, token) in ["\u{120}t", "he", "\u{120}the", "<|endoftext|>"]
        .iter()
        .enumerate()
    {
        vocab.insert(token.to_string(), Value::from(256 + id));
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 259, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
            "merges": ["\u{120} t", "h e", "\u{120}t he"]}
    });
    let path = dir.path("bpe.json");
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let text = dir.path("t.txt");
    std::fs::write(&text, "the cat on the mat.\n\n\u{fc}\n").unwrap();
    let prefix = dir.path("bpe");
    let out = hybridgen(&[
        "data",
        "prepare",
        "--input",
        &text,
        "--tokenizer",
        &path,
        "--output",
        &prefix,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("vocabulary      260 tokens"),
        "{}",
        stdout(&out)
    );
    let bin = std::fs::read(format!("{prefix}.bin")).unwrap();
    let ids: Vec<u16> = bin
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    // By hand: printable byte b has id b - 33 (t = 83); the others follow
    // in byte order from 188 (the space, byte 32, is 220). "the" is t + the
    // merge "he" (257), " the" the merge 258, "." has no merge, and "\u{fc}"
    // is two bytes, 0xC3 0xBC, a token each. Every document ends with 259.
    let id = |b: u8| order.iter().position(|x| *x == b).unwrap() as u16;
    let mut want: Vec<u16> = vec![id(b't'), 257, id(b' '), id(b'c'), id(b'a'), id(b't')];
    want.extend([
        id(b' '),
        id(b'o'),
        id(b'n'),
        258,
        id(b' '),
        id(b'm'),
        id(b'a'),
        id(b't'),
        id(b'.'),
        259,
    ]);
    want.extend([id(0xC3), id(0xBC), 259]);
    assert_eq!(ids, want);
    assert_eq!((id(b't'), id(b' ')), (83, 220));
}

#[test]
fn text_output_shows_the_eval_loss() {
    let dir = Scratch::new("text");
    let prefix = prepared(&dir, "c", 60);
    let mut args = train_args(
        &prefix,
        &["--steps", "4", "--eval-every", "2", "--eval-steps", "1"],
    );
    let at = args.iter().position(|a| *a == "json").unwrap();
    args[at] = "text";
    let out = hybridgen(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("indexed dataset"), "{text}");
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("step") && l.contains("eval loss"))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("step     2"), "{text}");
    let last = lines[1].split("eval loss ").nth(1).unwrap();
    assert!(
        text.contains(&format!("  eval loss       {last} (held-out data")),
        "{text}"
    );
}

#[test]
fn evaluation_leaves_training_untouched_and_resumes_continue_bit_exactly() {
    let dir = Scratch::new("resume");
    let prefix = prepared(&dir, "c", 120);
    let save = dir.path("ckpt");
    let schedule = [
        "--warmup",
        "2",
        "--lr-decay-style",
        "wsd",
        "--lr-wsd-decay-steps",
        "3",
    ];
    let mut full_args = vec![
        "--steps",
        "6",
        "--save",
        &save,
        "--save-every",
        "1",
        "--eval-every",
        "2",
    ];
    full_args.extend(schedule);
    let full = hybridgen(&train_args(&prefix, &full_args));
    assert_eq!(full.status.code(), Some(0), "{}", stderr(&full));
    let full_steps = steps(&stdout(&full));
    assert_eq!(full_steps.len(), 6);
    let hash =
        |out: &Output| objects(&stdout(out)).last().unwrap()["summary"]["param_hash"].clone();
    // The same run without evaluation: the same steps and parameters.
    let mut plain_args = vec!["--steps", "6"];
    plain_args.extend(schedule);
    let plain = hybridgen(&train_args(&prefix, &plain_args));
    assert_eq!(plain.status.code(), Some(0), "{}", stderr(&plain));
    let without_eval: Vec<(u64, String)> = steps(&stdout(&full))
        .into_iter()
        .map(|(s, line)| {
            let mut v: Value = serde_json::from_str(&line).unwrap();
            v.as_object_mut().unwrap().remove("eval_loss");
            (s, v.to_string())
        })
        .collect();
    assert_eq!(steps(&stdout(&plain)), without_eval);
    assert_eq!(hash(&plain), hash(&full));
    // From every checkpoint, the same command continues onto the same
    // steps, evaluations included; the data and schedule come from the
    // checkpoint (left out here), and the schedule of the overlap run
    // does not change the samples.
    for k in 1..6 {
        let from = format!("{save}/step-{k:06}");
        let out = resume(
            &from,
            &[
                "--steps",
                "6",
                "--eval-every",
                "2",
                "--format",
                "json",
                "--schedule",
                "plain",
            ],
        );
        assert_eq!(out.status.code(), Some(0), "from {k}: {}", stderr(&out));
        assert_eq!(
            steps(&stdout(&out)),
            full_steps[k..].to_vec(),
            "from step {k}"
        );
        assert_eq!(hash(&out), hash(&full), "from step {k}");
    }
    // A resume that names another schedule is refused, naming both.
    let out = resume(&save, &["--steps", "7", "--lr-decay-style", "cosine"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("--lr-decay-style cosine to 0 by step 7 contradicts the checkpoint")
            && stderr(&out).contains(
                "used --lr-decay-style wsd (exponential over the last 3 steps) to 0 by step 6"
            ),
        "{}",
        stderr(&out)
    );
    // A constant rate is the same schedule whatever --steps says.
    let constant = dir.path("constant");
    let out = hybridgen(&train_args(&prefix, &["--steps", "2", "--save", &constant]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = resume(&constant, &["--steps", "3", "--lr-decay-style", "constant"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A resume that names other data is refused.
    let other = prepared(&dir, "d", 50);
    let out = resume(
        &save,
        &["--steps", "7", "--data-path", &other, "--split", "90,10,0"],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("contradicts the checkpoint"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn blends_train_on_both_datasets() {
    let dir = Scratch::new("blend");
    let a = prepared(&dir, "a", 80);
    let b = prepared(&dir, "b", 40);
    let out = hybridgen(&[
        "train",
        "--device",
        "cpu",
        "--data-path",
        "0.3",
        &a,
        "0.7",
        &b,
        "--split",
        "90,10,0",
        "--seq-len",
        "16",
        "--micro-batches",
        "1",
        "--micro-batch-size",
        "2",
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--eval-steps",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("blend of 2 indexed datasets: 0.3 x "),
        "{}",
        stdout(&out)
    );
}

/// Runs `args`, expects exit 1 with `message` on stderr and no step run.
fn refused(args: &[&str], message: &str) {
    let out = hybridgen(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains(message), "{args:?}:\n{err}\nwanted: {message}");
    assert!(steps(&stdout(&out)).is_empty(), "{args:?} ran steps");
}

/// Writes `PREFIX.idx` (uint16 tokens, one sequence per document) and
/// `PREFIX.bin` byte by byte.
fn write_by_hand(prefix: &str, documents: &[Vec<u16>]) {
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8);
    idx.extend((documents.len() as u64).to_le_bytes());
    idx.extend((documents.len() as u64 + 1).to_le_bytes());
    for d in documents {
        idx.extend((d.len() as i32).to_le_bytes());
    }
    let mut pointer = 0i64;
    for d in documents {
        idx.extend(pointer.to_le_bytes());
        pointer += 2 * d.len() as i64;
    }
    for i in 0..=documents.len() as i64 {
        idx.extend(i.to_le_bytes());
    }
    std::fs::write(format!("{prefix}.idx"), idx).unwrap();
    let bin: Vec<u8> = documents
        .iter()
        .flatten()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(format!("{prefix}.bin"), bin).unwrap();
}

#[test]
fn bad_corpora_are_refused_before_any_step() {
    let dir = Scratch::new("bad");
    let docs: Vec<Vec<u16>> = (0..20)
        .map(|d| (0..40).map(|t| (d * 7 + t) % 200).collect())
        .collect();
    let good = dir.path("good");
    write_by_hand(&good, &docs);
    // Damaged corpora: each is a good one changed one way, refused by name.
    type TokenDamage = fn(&mut [Vec<u16>]);
    type FileDamage<'a> = &'a dyn Fn(&str);
    let rewrite = |path: String, edit: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = std::fs::read(&path).unwrap();
        edit(&mut bytes);
        std::fs::write(&path, bytes).unwrap();
    };
    let cases: [(&str, TokenDamage, FileDamage, &str); 4] = [
        (
            // A token id past the tiny preset's vocabulary of 256.
            "past",
            |docs| docs[3][5] = 300,
            &|_| {},
            "past.bin: token 5 of sequence 3 is id 300, past the model's vocabulary of 256 tokens",
        ),
        (
            "cut",
            |_| {},
            &|prefix| rewrite(format!("{prefix}.bin"), &|b| b.truncate(b.len() - 10)),
            "cut.bin: the token file is truncated",
        ),
        (
            "short",
            |_| {},
            &|prefix| rewrite(format!("{prefix}.idx"), &|b| b.truncate(b.len() - 8)),
            "short.idx: the index is truncated",
        ),
        (
            // The dtype code of float32 tokens.
            "float",
            |_| {},
            &|prefix| rewrite(format!("{prefix}.idx"), &|b| b[17] = 7),
            "float.idx: its tokens are stored as float32",
        ),
    ];
    for (name, damage_tokens, damage_files, message) in cases {
        let prefix = dir.path(name);
        let mut tokens = docs.clone();
        damage_tokens(&mut tokens);
        write_by_hand(&prefix, &tokens);
        damage_files(&prefix);
        refused(&train_args(&prefix, &["--steps", "1"]), message);
    }
    // An empty corpus.
    let empty = dir.path("empty");
    write_by_hand(&empty, &[]);
    refused(
        &train_args(&empty, &["--steps", "1"]),
        "empty.idx: the corpus is empty",
    );
    // A split whose test part gets none of 20 documents.
    let mut args = train_args(&good, &["--steps", "1"]);
    let at = args.iter().position(|a| *a == "90,10,0").unwrap();
    args[at] = "969,30,1";
    refused(
        &args,
        "--split 969,30,1 gives its test part no documents of the 20",
    );
    // Evaluation without a validation part.
    args[at] = "1,0,0";
    args.extend(["--eval-every", "1"]);
    refused(
        &args,
        "--eval-every evaluates on the validation part, but --split 1,0,0 gives it none",
    );
    // A validation part too small for one sample.
    args[at] = "19,1,0";
    let at_seq = args.iter().position(|a| *a == "32").unwrap();
    args[at_seq] = "64";
    refused(
        &args,
        "good.idx (validation part): its 1 documents hold 40 tokens, but one sample needs 65",
    );
    // An int8 corpus cannot hold the ids of a 223-token tokenizer: it was
    // written for another one.
    let narrow = dir.path("narrow");
    write_by_hand(&narrow, &docs);
    let mut idx = std::fs::read(format!("{narrow}.idx")).unwrap();
    idx[17] = 2;
    std::fs::write(format!("{narrow}.idx"), idx).unwrap();
    let big = dir.path("big.json");
    std::fs::write(&big, tokenizer_json(200)).unwrap();
    refused(
        &train_args(&narrow, &["--steps", "1", "--tokenizer", &big]),
        "narrow.idx: its tokens are int8 (ids up to 127), which cannot hold the 223 ids of --tokenizer",
    );
    // Missing files and bad flags.
    refused(
        &train_args(&dir.path("none"), &["--steps", "1"]),
        "none.idx: No such file",
    );
    refused(
        &["train", "--data-path", "0.3", &good, "0.7"],
        "an odd number, so they are not WEIGHT PREFIX pairs",
    );
    refused(
        &["train", "--data-path", &good, &good],
        "is not a weight above 0",
    );
    let out = hybridgen(&["train", "--data-path", &good, "--split", "1,2,3,4"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("up to three sizes"),
        "{}",
        stderr(&out)
    );
    refused(
        &train_args(
            &good,
            &[
                "--steps",
                "10",
                "--warmup",
                "10",
                "--lr-decay-style",
                "cosine",
            ],
        ),
        "give --lr-decay-steps above 10",
    );
    refused(
        &train_args(&good, &["--steps", "10", "--min-lr", "1"]),
        "--min-lr) is 1",
    );
}

#[test]
fn prepare_and_plot_refuse_bad_inputs() {
    let dir = Scratch::new("inputs");
    let tokenizer = dir.path("tokenizer.json");
    std::fs::write(&tokenizer, tokenizer_json(0)).unwrap();
    let out_prefix = dir.path("out");
    let prepare = |input: &str, extra: &[&str]| {
        let mut args = vec![
            "data",
            "prepare",
            "--input",
            input,
            "--tokenizer",
            &tokenizer,
            "--output",
            &out_prefix,
        ];
        args.extend_from_slice(extra);
        hybridgen(&args)
    };
    let check = |out: Output, message: &str| {
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(message),
            "{}\nwanted: {message}",
            stderr(&out)
        );
        // Nothing is left behind, under the final or a temporary name.
        let left: Vec<String> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("out"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    };
    let jsonl = dir.path("docs.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\": \"the cat sat .\"}\n{\"body\": \"a dog\"}\n",
    )
    .unwrap();
    check(
        prepare(&jsonl, &[]),
        "docs.jsonl:2: the line has no \"text\" string",
    );
    std::fs::write(&jsonl, "{\"text\": \"the cat\"}\nnot json\n").unwrap();
    check(prepare(&jsonl, &[]), "docs.jsonl:2: not a JSON line");
    let blank = dir.path("blank.txt");
    std::fs::write(&blank, "\n\n  \n").unwrap();
    check(
        prepare(&blank, &[]),
        "no document has any text; nothing was written",
    );
    let text = dir.path("story.txt");
    std::fs::write(&text, story(5)).unwrap();
    check(
        prepare(&text, &["--eod-token", "<eos>"]),
        "--eod-token <eos>: the tokenizer",
    );
    check(
        prepare(&dir.path("missing.txt"), &[]),
        "missing.txt: cannot read it",
    );
    check(
        prepare(&dir.0.display().to_string(), &[]),
        "this is not a regular file",
    );
    let bad_tokenizer = dir.path("bad.json");
    std::fs::write(&bad_tokenizer, "{\"model\": 3}").unwrap();
    let out = hybridgen(&[
        "data",
        "prepare",
        "--input",
        &text,
        "--tokenizer",
        &bad_tokenizer,
        "--output",
        &out_prefix,
    ]);
    check(out, "not a tokenizer this build reads");
    // JSONL with its key, and a good run.
    std::fs::write(
        &jsonl,
        "{\"body\": \"the cat sat .\"}\n\n{\"body\": \"a dog ran .\"}\n",
    )
    .unwrap();
    let out = prepare(&jsonl, &["--json-key", "body"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("documents       2\n"),
        "{}",
        stdout(&out)
    );

    // A tokenizer larger than the model's vocabulary.
    let big = dir.path("big.json");
    std::fs::write(&big, tokenizer_json(300)).unwrap();
    refused(
        &["train", "--tokenizer", &big, "--steps", "1"],
        "it has 323 tokens but the model's vocabulary has only 256 (vocab_size); use a model with vocab_size of at least 323",
    );

    // plot
    let log = dir.path("log.jsonl");
    std::fs::write(&log, "{\"step\": 1, \"loss\": 2.0}\nnot json\n").unwrap();
    refused(
        &["plot", &log, "-o", &dir.path("x.svg")],
        "log.jsonl:2: not a JSON line",
    );
    std::fs::write(&log, "{\"summary\": {}}\n").unwrap();
    refused(
        &["plot", &log, "-o", &dir.path("x.svg")],
        "log.jsonl: no step has a loss",
    );
    std::fs::write(&log, "{\"step\": 1, \"loss\": 2.0}\n").unwrap();
    refused(
        &["plot", &log, "-o", &dir.path("x.png")],
        "this build draws SVG only",
    );
    refused(
        &["plot", &log, "-o", &dir.path("x.pdf")],
        "give a file ending in .svg",
    );
    refused(
        &["plot", &dir.path("nope.jsonl")],
        "nope.jsonl: cannot read it",
    );
    let out = hybridgen(&["plot", &log, "-o", &dir.path("one.svg")]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(Path::new(&dir.path("one.svg")).is_file());
}

/// Indexed data gives every step the same samples however they are spread
/// over ranks and micro-batches (Megatron's sampler). One rank keeps its
/// units in its shards and adds each micro-batch's gradients to them in
/// place; two ranks reduce theirs into their shards. On the same 6 samples
/// a step (3 micro-batches of 2, one of 6, or 3 of 1 on each of 2 ranks)
/// the three runs differ only in rounding (a model without MoE layers,
/// whose aux loss depends on how tokens are grouped).
#[test]
fn micro_batches_and_ranks_sum_the_same_gradients() {
    let dir = Scratch::new("sums");
    let prefix = prepared(&dir, "story", 200);
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = vec!["train", "--device", "cpu", "--data-path", &prefix];
        args.extend_from_slice(&["--split", "90,10,0", "--seq-len", "32", "--format", "json"]);
        // MLPs for the experts: the MoE aux loss of a micro-batch is not
        // linear in its tokens, so how they are grouped would change it.
        args.extend_from_slice(&["--steps", "3", "--ep", "1", "--pattern", "M[*-]M-[*-]"]);
        args.extend_from_slice(extra);
        let out = hybridgen(&args);
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        objects(&stdout(&out))
            .into_iter()
            .filter(|v| v.get("step").is_some())
            .map(|v| {
                (
                    v["loss"].as_f64().unwrap(),
                    v["grad_norm"].as_f64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    let split = run(&[
        "--ranks",
        "1",
        "--micro-batches",
        "3",
        "--micro-batch-size",
        "2",
    ]);
    let whole = run(&[
        "--ranks",
        "1",
        "--micro-batches",
        "1",
        "--micro-batch-size",
        "6",
    ]);
    let ranks = run(&[
        "--ranks",
        "2",
        "--micro-batches",
        "3",
        "--micro-batch-size",
        "1",
    ]);
    assert_eq!(split.len(), 3);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs();
    for (i, ((s, w), r)) in split.iter().zip(&whole).zip(&ranks).enumerate() {
        for (what, got, want) in [("one micro-batch", w, s), ("two ranks", r, s)] {
            assert!(
                close(got.0, want.0) && close(got.1, want.1),
                "step {}: {what} gives loss {} and grad norm {}, 3 micro-batches {} and {}",
                i + 1,
                got.0,
                got.1,
                want.0,
                want.1
            );
        }
    }
}

//! `hybridgen data prepare`: text to a Megatron indexed dataset with a
//! Hugging Face `tokenizer.json`, as Megatron's `preprocess_data.py` does
//! (one sequence per document, an end-of-document token appended).
//!
//! Input: `.jsonl` (one JSON object per line, the document in `--json-key`,
//! `text` by default), or any other file as plain text with documents
//! separated by blank lines. Written under temporary names and renamed when
//! complete: a failed run leaves nothing behind.

use super::{Failure, human};
use hybridgen_runtime::data::{IndexedDataset, IndexedWriter, TokenDtype};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{BufRead, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenizers::Tokenizer;

#[derive(clap::Args, Debug)]
pub(crate) struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(clap::Subcommand, Debug)]
enum DataCommand {
    /// Tokenize a text or JSONL file into PREFIX.idx + PREFIX.bin
    /// (Megatron's indexed dataset), for `train --data-path PREFIX`.
    Prepare(PrepareArgs),
}

#[derive(clap::Args, Debug)]
pub(crate) struct PrepareArgs {
    /// The text: FILE.jsonl (one JSON object per line) or any other file
    /// as plain text, documents separated by blank lines.
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// A Hugging Face tokenizer.json (BPE, byte-level BPE or WordLevel).
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// Writes PREFIX.idx and PREFIX.bin.
    #[arg(long, value_name = "PREFIX")]
    output: PathBuf,
    /// The key of each JSONL object that holds its document.
    #[arg(long, value_name = "KEY", default_value = "text")]
    json_key: String,
    /// The end-of-document token appended to every document [default: the
    /// tokenizer's first of `<|endoftext|>`, `</s>`, `<eos>`, `<|end_of_text|>`,
    /// [SEP]].
    #[arg(long, value_name = "TOKEN")]
    eod_token: Option<String>,
}

pub(crate) fn run(args: &DataArgs) -> Result<(), Failure> {
    match &args.command {
        DataCommand::Prepare(args) => prepare(args),
    }
}

/// End-of-document tokens tried, in order, when none is named.
const EOD_CANDIDATES: [&str; 5] = ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]"];

/// Loads a tokenizer.json, refusing what is not a regular file first (a
/// FIFO would block the read).
pub(crate) fn load_tokenizer(path: &Path, flag: &str) -> Result<Tokenizer, String> {
    let name = path.display();
    let meta =
        std::fs::metadata(path).map_err(|e| format!("{flag} {name}: cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "{flag} {name}: this is not a regular file; give a tokenizer.json"
        ));
    }
    Tokenizer::from_file(path).map_err(|e| {
        format!(
            "{flag} {name}: not a tokenizer this build reads ({e}); give a Hugging Face \
             tokenizer.json with a BPE, byte-level BPE or WordLevel model"
        )
    })
}

/// Refuses a model whose vocabulary does not cover the tokenizer's, and
/// indexed datasets whose token dtype cannot hold the tokenizer's ids (a
/// corpus written for another tokenizer).
pub(crate) fn check_tokenizer_fits(
    path: &Path,
    vocab: usize,
    datasets: &[PathBuf],
) -> Result<(), String> {
    let tokenizer = load_tokenizer(path, "--tokenizer")?;
    let needed = tokenizer.get_vocab_size(true);
    if needed > vocab {
        return Err(format!(
            "--tokenizer {}: it has {needed} tokens but the model's vocabulary has only {vocab} \
             (vocab_size); use a model with vocab_size of at least {needed}",
            path.display()
        ));
    }
    for prefix in datasets {
        let dataset = IndexedDataset::open(prefix).map_err(|e| e.to_string())?;
        let dtype = dataset.dtype();
        if dtype.max_token() < needed as u64 - 1 {
            return Err(format!(
                "{}: its tokens are {} (ids up to {}), which cannot hold the {needed} ids of \
                 --tokenizer {}; the corpus was written for another tokenizer: prepare it \
                 again with this one (`hybridgen data prepare`)",
                dataset.idx_name(),
                dtype.name(),
                dtype.max_token(),
                path.display()
            ));
        }
    }
    Ok(())
}

/// The documents of the input, one at a time.
enum Documents {
    Jsonl {
        lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
        line: usize,
        key: String,
    },
    Text {
        reader: std::io::BufReader<std::fs::File>,
    },
}

impl Documents {
    /// The next document and the input bytes it took, or `None` at the end.
    fn next(&mut self, name: &str) -> Result<Option<(String, u64)>, String> {
        match self {
            Documents::Jsonl { lines, line, key } => loop {
                let Some(text) = lines.next() else {
                    return Ok(None);
                };
                *line += 1;
                let text = text.map_err(|e| format!("{name}:{line}: cannot read: {e}"))?;
                let bytes = text.len() as u64 + 1;
                if text.trim().is_empty() {
                    continue;
                }
                let value: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| format!("{name}:{line}: not a JSON line ({e})"))?;
                return match value.get(key.as_str()) {
                    Some(serde_json::Value::String(doc)) => Ok(Some((doc.clone(), bytes))),
                    _ => Err(format!(
                        "{name}:{line}: the line has no \"{key}\" string; give each line as \
                         {{\"{key}\": \"...\"}}, or name the key with --json-key"
                    )),
                };
            },
            Documents::Text { reader } => {
                // Lines up to the next blank one.
                let mut doc = String::new();
                let mut bytes = 0u64;
                let mut line = String::new();
                loop {
                    line.clear();
                    let n = reader
                        .read_line(&mut line)
                        .map_err(|e| format!("{name}: cannot read: {e}"))?;
                    bytes += n as u64;
                    // The line break before the blank line (or the end)
                    // separates documents; the ones inside a document stay.
                    let finish = |mut doc: String| {
                        let kept = doc.trim_end_matches(['\n', '\r']).len();
                        doc.truncate(kept);
                        doc
                    };
                    if n == 0 {
                        return Ok((!doc.trim().is_empty()).then(|| (finish(doc), bytes)));
                    }
                    if line.trim().is_empty() {
                        if !doc.trim().is_empty() {
                            return Ok(Some((finish(doc), bytes)));
                        }
                        continue;
                    }
                    doc.push_str(&line);
                }
            }
        }
    }
}

fn prepare(args: &PrepareArgs) -> Result<(), Failure> {
    let started = Instant::now();
    let name = args.input.display().to_string();
    let meta = std::fs::metadata(&args.input)
        .map_err(|e| Failure::Message(format!("--input {name}: cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(Failure::Message(format!(
            "--input {name}: this is not a regular file; give a .jsonl or text file"
        )));
    }
    if args.output.as_os_str().is_empty() || args.output.to_string_lossy().ends_with('/') {
        return Err(Failure::Message(format!(
            "--output `{}`: give a PREFIX such as data/corpus (writes data/corpus.idx and \
             data/corpus.bin)",
            args.output.display()
        )));
    }
    let tokenizer = load_tokenizer(&args.tokenizer, "--tokenizer").map_err(Failure::Message)?;
    let vocab = tokenizer.get_vocab_size(true);
    let (eod_name, eod) = match &args.eod_token {
        Some(token) => (
            token.clone(),
            tokenizer.token_to_id(token).ok_or_else(|| {
                Failure::Message(format!(
                    "--eod-token {token}: the tokenizer {} has no such token; name one of its \
                     tokens",
                    args.tokenizer.display()
                ))
            })?,
        ),
        None => EOD_CANDIDATES
            .iter()
            .find_map(|t| tokenizer.token_to_id(t).map(|id| (t.to_string(), id)))
            .ok_or_else(|| {
                Failure::Message(format!(
                    "the tokenizer {} has none of the usual end-of-document tokens ({}); name \
                     its end-of-document token with --eod-token",
                    args.tokenizer.display(),
                    EOD_CANDIDATES.join(", ")
                ))
            })?,
    };
    let file = std::fs::File::open(&args.input)
        .map_err(|e| Failure::Message(format!("--input {name}: cannot open it: {e}")))?;
    let reader = std::io::BufReader::with_capacity(1 << 20, file);
    let jsonl = args
        .input
        .extension()
        .is_some_and(|e| e == "jsonl" || e == "json");
    let mut documents = if jsonl {
        Documents::Jsonl {
            lines: reader.lines(),
            line: 0,
            key: args.json_key.clone(),
        }
    } else {
        Documents::Text { reader }
    };
    let dtype = TokenDtype::for_vocab(vocab);
    let runtime = |e: hybridgen_runtime::RuntimeError| Failure::Message(e.to_string());
    let mut writer = IndexedWriter::create(&args.output, dtype).map_err(runtime)?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::with_draw_target(Some(meta.len()), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {bytes}/{total_bytes}  {msg}  [{elapsed} < {eta}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let mut tokens = 0u64;
    let mut empty = 0u64;
    let mut ids = Vec::new();
    while let Some((doc, bytes)) = documents.next(&name).map_err(Failure::Message)? {
        let encoding = tokenizer.encode(doc.as_str(), false).map_err(|e| {
            Failure::Message(format!(
                "{name}: document {} cannot be tokenized: {e}",
                writer.documents() + 1
            ))
        })?;
        if let Some(bar) = &bar {
            bar.inc(bytes);
        }
        if encoding.get_ids().is_empty() {
            empty += 1;
            continue;
        }
        ids.clear();
        ids.extend_from_slice(encoding.get_ids());
        ids.push(eod);
        writer.add_document(&ids).map_err(runtime)?;
        tokens += ids.len() as u64;
        if let Some(bar) = &bar
            && writer.documents().is_multiple_of(256)
        {
            bar.set_message(format!(
                "{} documents, {} tokens",
                human::count(writer.documents() as u64),
                human::count(tokens)
            ));
        }
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let count = writer.documents();
    if count == 0 {
        // The writer is dropped: its temporary file goes, nothing is left.
        return Err(Failure::Message(format!(
            "--input {name}: no document has any text{}; nothing was written",
            if jsonl {
                format!(" under \"{}\"", args.json_key)
            } else {
                String::new()
            }
        )));
    }
    let (idx, bin) = writer.finish().map_err(runtime)?;
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    super::emit(&format!(
        "wrote {} and {}\n  documents       {}{}\n  tokens          {} ({}, end-of-document {eod_name} = {eod})\n  \
         vocabulary      {vocab} tokens: train a model with vocab_size >= {vocab}\n  \
         speed           {} tokens/s ({seconds:.1} s)\n",
        idx.display(),
        bin.display(),
        human::count(count as u64),
        if empty > 0 {
            format!(" ({empty} without tokens skipped)")
        } else {
            String::new()
        },
        human::count(tokens),
        dtype.name(),
        human::count((tokens as f64 / seconds) as u64),
    ))
}

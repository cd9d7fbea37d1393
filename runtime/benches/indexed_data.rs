//! Throughput of Megatron indexed datasets: writing a corpus, opening it
//! (the checks of the index against both files), the scan that checks every
//! token id against the vocabulary before a run starts, and reading
//! training samples (a shuffled epoch index, then windows across document
//! boundaries through the memory map).
//!
//! ```text
//! cargo bench -p hybridgen-runtime --bench indexed_data [-- TOKENS]
//! ```
//!
//! TOKENS (default 50,000,000) uint16 tokens in documents of 200 to 1,800
//! tokens, written to the temp directory and removed after. Prints each
//! figure; asserts nothing about time.

use hybridgen_runtime::data::{
    BatchKey, BatchShape, IndexedDataset, IndexedSource, IndexedSpec, IndexedWriter, SampleLayout,
    Split, TokenDtype, UPFRONT_TOKEN_SCAN, Xoshiro256,
};
use hybridgen_runtime::setting::SettingSpelling;
use std::time::Instant;

fn rate(n: u64, seconds: f64) -> String {
    format!("{:.1} M/s", n as f64 / seconds.max(1e-9) / 1e6)
}

fn main() {
    let tokens: u64 = std::env::args()
        .nth(1)
        .filter(|a| !a.starts_with('-'))
        .and_then(|a| a.replace(',', "").parse().ok())
        .unwrap_or(50_000_000);
    let dir = std::env::temp_dir().join(format!("hybridgen-bench-indexed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let prefix = dir.join("corpus");

    let started = Instant::now();
    let mut writer = IndexedWriter::create(&prefix, TokenDtype::U16).expect("create");
    let mut rng = Xoshiro256::seed_from_u64(1);
    let mut written = 0u64;
    let mut doc = Vec::new();
    while written < tokens {
        let len = 200 + rng.below(1600) as usize;
        doc.clear();
        doc.extend((0..len).map(|_| rng.below(50_000) as u32));
        writer.add_document(&doc).expect("write");
        written += len as u64;
    }
    let documents = writer.documents();
    writer.finish().expect("finish");
    let write_s = started.elapsed().as_secs_f64();
    println!("corpus: {written} tokens in {documents} documents");
    println!(
        "write           {:>8.2} s  {} tokens",
        write_s,
        rate(written, write_s)
    );

    let started = Instant::now();
    let dataset = IndexedDataset::open(&prefix).expect("open");
    let open_s = started.elapsed().as_secs_f64();
    println!(
        "open + check    {:>8.3} s  ({} sequences)",
        open_s,
        dataset.sequences()
    );
    let started = Instant::now();
    dataset.check_tokens(50_000).expect("ids");
    let scan_s = started.elapsed().as_secs_f64();
    println!(
        "token id scan   {:>8.2} s  {} tokens",
        scan_s,
        rate(written, scan_s)
    );

    let shape = BatchShape::new(8, 4096);
    let spec = IndexedSpec {
        blend: vec![(1.0, prefix.clone())],
        split: Split::parse("99,1,0", SettingSpelling::FIELDS).expect("split"),
    };
    let layout = SampleLayout {
        ranks: 1,
        micro_batches: 1,
    };
    let started = Instant::now();
    let source = IndexedSource::open(
        &spec,
        50_000,
        0,
        shape,
        layout,
        true,
        UPFRONT_TOKEN_SCAN,
        SettingSpelling::FIELDS,
    )
    .expect("source");
    let source = hybridgen_runtime::data::DataSource::Indexed(std::sync::Arc::new(source));
    println!(
        "source open     {:>8.2} s  (every check, the token scan included)",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let batches = 200u64;
    for step in 0..batches {
        let key = BatchKey {
            seed: 0,
            step,
            dp_rank: 0,
            micro_batch: 0,
        };
        std::hint::black_box(source.batch(key, shape).expect("batch"));
    }
    let read_s = started.elapsed().as_secs_f64();
    let read = batches * shape.batch as u64 * shape.window() as u64;
    println!(
        "samples         {:>8.2} s  {} tokens ({batches} batches of 8 x 4097, the first epoch index built on the way)",
        read_s,
        rate(read, read_s)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

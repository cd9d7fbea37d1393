//! Memory under pipeline parallelism on the command line: `plan --pp N`
//! prints a row per pipeline rank (its stages' buckets and activations),
//! and `train --pp N` that cannot fit is refused with each stage's figures.

use serde_json::Value;
use std::path::Path;

mod support;
use support::{hybridgen, hybridgen_in, stderr, stdout};

/// The rows of the text report's per-pipeline-rank section.
fn stage_rows(text: &str) -> Vec<Vec<String>> {
    let Some((_, section)) = text.split_once("\nmemory per pipeline rank, ZeRO-3") else {
        return Vec::new();
    };
    section
        .lines()
        .skip(2)
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn plan_prints_the_memory_of_each_pipeline_rank() {
    let out = hybridgen(&["plan", "M*E-M*E-/*E", "--pp", "2", "--dp", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    let rows = stage_rows(&text);
    assert_eq!(rows.len(), 2, "{text}");
    // pp rank, stages, layers, params, then the overlap, plain and
    // activation figures (a number and a unit each), then what else the
    // rank runs.
    assert_eq!(rows[0][..3], ["0", "0", "0..4"], "{text}");
    assert_eq!(rows[1][..3], ["1", "1", "4..8"], "{text}");
    assert_eq!(rows[0][10..], ["embedding"], "{text}");
    assert_eq!(rows[1][10..], ["final", "norm,", "MTP,", "heads"], "{text}");
    for row in &rows {
        for unit in [&row[5], &row[7], &row[9]] {
            assert!(["KiB", "MiB"].contains(&unit.as_str()), "{row:?}");
        }
    }

    // Virtual stages: a rank's two stages on one row.
    let out = hybridgen(&["plan", "M*|E-|ME|*-", "--pp", "2", "--units", "M,*"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let rows = stage_rows(&stdout(&out));
    assert_eq!(rows[0][..3], ["0", "0,2", "0..2,4..6"], "{}", stdout(&out));
    assert_eq!(rows[1][..3], ["1", "1,3", "2..4,6..8"], "{}", stdout(&out));
    assert_eq!(
        rows[1][10..],
        ["final", "norm,", "heads"],
        "{}",
        stdout(&out)
    );

    // Without a pipeline, no such section.
    let out = hybridgen(&["plan", "M*E-M*E-/*E", "--dp", "2"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(stage_rows(&stdout(&out)).is_empty(), "{}", stdout(&out));
}

#[test]
fn plan_json_has_the_pipeline_ranks_memory_under_a_pipeline_only() {
    let json = |args: &[&str]| -> Value {
        let mut all = vec!["plan"];
        all.extend_from_slice(args);
        all.extend(["--format", "json"]);
        let out = hybridgen(&all);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        serde_json::from_str(&stdout(&out)).unwrap()
    };
    let one = json(&["M*E-M*E-/*E", "--dp", "2"]);
    assert!(one.get("pipeline_memory").is_none());
    for pp in ["2", "4"] {
        let plan = json(&["M*E-M*E-/*E", "--pp", pp, "--dp", "2"]);
        let ranks = plan["pipeline_memory"].as_array().unwrap();
        assert_eq!(ranks.len(), pp.parse::<usize>().unwrap());
        // Every parameter on one rank; the embedding, which the MTP depth
        // on the last stage looks its tokens up in, on the first and last.
        let params: u64 = ranks.iter().map(|r| r["params"].as_u64().unwrap()).sum();
        let embedding = 256 * 64;
        assert_eq!(
            params,
            one["total_params"].as_u64().unwrap() + embedding,
            "pp {pp}"
        );
        for (i, rank) in ranks.iter().enumerate() {
            assert_eq!(rank["pp_rank"], i);
            assert_eq!(rank["embedding"], i == 0);
            assert_eq!(rank["heads"], i + 1 == ranks.len());
            let total = rank["memory"]["total"].as_u64().unwrap();
            assert!(total < one["memory"]["total"].as_u64().unwrap(), "pp {pp}");
            assert!(rank["memory_plain"]["total"].as_u64().unwrap() <= total);
        }
    }
}

#[test]
fn train_with_a_pipeline_that_cannot_fit_names_each_stage() {
    let args = [
        "train",
        "--pattern",
        "M*E-M*E-",
        "--ranks",
        "4",
        "--pp",
        "2",
        "--steps",
        "1",
        "--micro-batches",
        "4",
        "--micro-batch-size",
        "2",
        "--seq-len",
        "16",
        "--recompute",
        "none",
    ];
    // Above the bound made from the pattern, below the stages' need.
    let out = hybridgen_in(
        Path::new("."),
        &args,
        &[("HYBRIDGEN_MEMORY_AVAILABLE", "18M")],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    for needle in [
        "this run needs about ",
        "but 18.0 MiB is available (the configured limit)",
        "pipeline rank 0: stage 0 (layers 0..4) with the embedding\n    per rank: ",
        "pipeline rank 1: stage 1 (layers 4..8) with the final norm and the heads, needs the most\n    per rank: ",
        "receive buffers ",
        "4 thread ranks in this process (2 pipeline ranks of 2 data-parallel ranks): ",
    ] {
        assert!(err.contains(needle), "`{needle}` missing:\n{err}");
    }
}

//! How long `model!` takes to expand large patterns: a plain `main` that
//! times `hybridgen_codegen::expand` and prints the figures (no
//! assertions: machines differ; the target is under 20 ms for 1,000 layers).
//!
//! `cargo bench -p hybridgen-codegen --bench expand`

use hybridgen_codegen::expand;
use hybridgen_dsl::{ModelConfig, Plan, PlanOptions};
use proc_macro2::TokenStream;
use quote::quote;
use std::time::{Duration, Instant};

/// Five physical layers a block: Mamba, a grouped attention + MoE, Mamba, MLP.
const BLOCK: &str = "M[*E]M-";
const BLOCK_LAYERS: usize = 5;

fn input(layers: usize) -> (String, TokenStream) {
    let pattern = format!("({BLOCK}){{{}}}", layers / BLOCK_LAYERS);
    let tokens = quote! {
        /// A deep model for timing.
        pub struct Deep {
            preset: "tiny",
            pattern: #pattern,
            ep: 2,
        }
    };
    (pattern, tokens)
}

/// Min and median of `runs` timings of `f`.
fn time(runs: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    let mut samples: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    samples.sort_unstable();
    (samples[0], samples[samples.len() / 2])
}

fn main() {
    println!("expand(TokenStream) of `model!` inputs, tiny preset, ep 2");
    println!(
        "{:>8} {:>12} {:>12} {:>12} {:>10} {:>10}",
        "layers", "expand min", "expand med", "plan med", "tokens", "out KiB"
    );
    for (layers, runs) in [(1_000, 30), (10_000, 5)] {
        let (pattern, tokens) = input(layers);
        let output = match expand(tokens.clone()) {
            Ok(output) => output,
            Err(e) => {
                eprintln!("expand failed: {e}");
                std::process::exit(1);
            }
        };
        let token_count = count(&output);
        let size = output.to_string().len() / 1024;
        let (min, median) = time(runs, || {
            std::hint::black_box(expand(tokens.clone()).ok());
        });
        let mut config = ModelConfig::preset("tiny").expect("the tiny preset exists");
        config.pattern = pattern;
        let mut options = PlanOptions::default();
        options.layout.dp = 2;
        options.layout.ep = 2;
        let (_, plan_median) = time(runs, || {
            std::hint::black_box(Plan::new(&config, &options).ok());
        });
        println!(
            "{layers:>8} {:>9.2} ms {:>9.2} ms {:>9.2} ms {token_count:>10} {size:>10}",
            ms(min),
            ms(median),
            ms(plan_median)
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn count(tokens: &TokenStream) -> usize {
    tokens
        .clone()
        .into_iter()
        .map(|tt| match tt {
            proc_macro2::TokenTree::Group(g) => 1 + count(&g.stream()),
            _ => 1,
        })
        .sum()
}

//! How fast parameters are drawn at start-up (`layers::init`): values a
//! second for a normal-initialised weight (Box–Muller, the bulk of every
//! model) and a uniform one, on every core the machine has. The benchmark
//! model's 0.9 B values and the 9B preset's 8.9 B are drawn this way before
//! the first step. Run with `cargo bench -p hybridgen-runtime --bench
//! param_init`. Prints figures; asserts nothing about time.

use hybridgen_dsl::params::ParamDef;
use hybridgen_runtime::layers::init::{InitScale, init_param};
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let scale = InitScale {
        std: 0.02,
        num_layers: 8,
        conv_kernel: 4,
        gdn_conv_kernel: 4,
    };
    // One expert's fc1 of the benchmark model, and a large weight.
    for (name, shape) in [
        (
            "decoder.layers.0.mlp.experts.linear_fc1.weight0",
            [2048usize, 1024],
        ),
        ("output_layer.weight", [32768, 2048]),
        ("decoder.layers.0.mixer.conv1d_weight", [8192, 4]),
    ] {
        let def = ParamDef::new(name, &shape);
        let mut out = vec![0.0f32; def.numel()];
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let start = Instant::now();
            init_param(1234, name, &def, &scale, black_box(&mut out)).expect("init");
            best = best.min(start.elapsed().as_secs_f64());
        }
        let per = best / def.numel() as f64;
        println!(
            "{name} {shape:?}: {:.1} M values/s on {threads} threads ({:.1} ns a value a thread), best of 5",
            def.numel() as f64 / best / 1e6,
            per * 1e9 * threads as f64
        );
    }
}

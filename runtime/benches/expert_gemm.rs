//! The MoE experts' GEMMs on a GPU, cuBLAS (one call an expert over the
//! backend's streams, `--expert-gemm cublas`) against the grouped TMA +
//! `wgmma` kernel (`--expert-gemm grouped`, training's default on
//! Hopper): one `grouped_matmul` call of each kind a
//! `bench-hybrid-moe` layer makes per micro-batch (16 experts, hidden
//! 2,048, width 1,024, 16,384 routed rows of 700 to 1,345 an expert), in
//! microseconds a call and TFLOP/s, and how far the grouped kernel's
//! results are from cuBLAS's. Then the dense layers' GEMMs of one
//! micro-batch (4,096 tokens) the same two ways: `matmul` (cuBLAS, what
//! training runs) and the grouped kernel with that one problem (a
//! one-problem `grouped_matmul`): on an H200 cuBLAS ran these at 650-840
//! TFLOP/s and the kernel was no faster, so dense layers stay on cuBLAS.
//! Prints figures; asserts nothing about time.
//!
//! Run where there is a GPU: `cargo bench -p hybridgen-runtime --bench
//! expert_gemm` (or the binary `scripts/cuda_bundle.sh` collects, as
//! `gpu-bundle/bench/expert_gemm`). Without one it says why and exits.

use hybridgen_runtime::backend::{Backend, GroupedMatmul, MatmulDims};
use hybridgen_runtime::cuda::{CudaBackend, Gpu, probe};
use hybridgen_runtime::view::DType;
use hybridgen_runtime::{Precision, Result};
use std::ops::Range;
use std::time::{Duration, Instant};

const EXPERTS: usize = 16;
const HIDDEN: usize = 2048;
const WIDTH: usize = 1024;
const ROUTED: usize = 16384;
const WARM: usize = 3;
const CALLS: usize = 20;

/// Rows an expert: an uneven spread (700 to about 1,350) summing to
/// [`ROUTED`], as a softmax router's top-4 gives at initialisation.
fn expert_rows() -> Vec<usize> {
    let mut rows: Vec<usize> = (0..EXPERTS).map(|e| 700 + (e * 389) % 650).collect();
    let total: usize = rows.iter().sum();
    let last = rows.last_mut().expect("experts");
    *last = (*last + ROUTED).saturating_sub(total).max(1);
    rows
}

fn uniform(seed: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Order-one values in a new buffer of `dtype` (uploaded as f32, cast on
/// the device).
fn put(
    dev: &CudaBackend,
    seed: &mut u64,
    n: usize,
    dtype: DType,
) -> Result<<CudaBackend as Backend>::Buf> {
    let wide = dev.alloc(n, DType::F32)?;
    dev.upload(&uniform(seed, n), dev.view_mut(&wide)?)?;
    let buf = dev.alloc(n, dtype)?;
    dev.cast(dev.view(&wide)?, dev.view_mut(&buf)?)?;
    Ok(buf)
}

type Buf = <CudaBackend as Backend>::Buf;

/// A layer's operands: routed rows grouped by expert, stacked weights and
/// f32 weight gradients.
struct Layer {
    rows: Vec<Range<usize>>,
    x: Buf,
    pre: Buf,
    act: Buf,
    out: Buf,
    d_out: Buf,
    d_act: Buf,
    d_pre: Buf,
    d_in: Buf,
    w1: Buf,
    w2: Buf,
    dw1: Buf,
    dw2: Buf,
}

impl Layer {
    fn new(dev: &CudaBackend) -> Result<Layer> {
        let mut seed = 11;
        let mut start = 0;
        let rows = expert_rows()
            .into_iter()
            .map(|n| {
                start += n;
                start - n..start
            })
            .collect();
        let bf = DType::Bf16;
        Ok(Layer {
            rows,
            x: put(dev, &mut seed, ROUTED * HIDDEN, bf)?,
            pre: dev.alloc(ROUTED * WIDTH, bf)?,
            act: put(dev, &mut seed, ROUTED * WIDTH, bf)?,
            out: dev.alloc(ROUTED * HIDDEN, bf)?,
            d_out: put(dev, &mut seed, ROUTED * HIDDEN, bf)?,
            d_act: dev.alloc(ROUTED * WIDTH, bf)?,
            d_pre: put(dev, &mut seed, ROUTED * WIDTH, bf)?,
            d_in: dev.alloc(ROUTED * HIDDEN, bf)?,
            w1: put(dev, &mut seed, EXPERTS * WIDTH * HIDDEN, bf)?,
            w2: put(dev, &mut seed, EXPERTS * WIDTH * HIDDEN, bf)?,
            dw1: put(dev, &mut seed, EXPERTS * WIDTH * HIDDEN, DType::F32)?,
            dw2: put(dev, &mut seed, EXPERTS * WIDTH * HIDDEN, DType::F32)?,
        })
    }
}

/// The products a layer's experts make per micro-batch, as the MoE layer
/// groups them.
#[derive(Clone, Copy, Debug)]
enum Call {
    Fc1,
    Fc2,
    Fc2InputGrad,
    Fc1InputGrad,
    WeightGrads,
}

impl Call {
    const ALL: [Call; 5] = [
        Call::Fc1,
        Call::Fc2,
        Call::Fc2InputGrad,
        Call::Fc1InputGrad,
        Call::WeightGrads,
    ];

    fn name(self) -> &'static str {
        match self {
            Call::Fc1 => "fc1 forward (x W1^T)",
            Call::Fc2 => "fc2 forward (act W2^T)",
            Call::Fc2InputGrad => "fc2 input grad (d_out W2)",
            Call::Fc1InputGrad => "fc1 input grad (d_pre W1)",
            Call::WeightGrads => "weight grads (dW += dY^T X, f32)",
        }
    }

    fn flops(self) -> f64 {
        let per_product = 2.0 * (ROUTED * HIDDEN * WIDTH) as f64;
        match self {
            Call::WeightGrads => 2.0 * per_product,
            _ => per_product,
        }
    }

    fn run<'a>(self, dev: &'a CudaBackend, l: &'a Layer) -> Result<()> {
        let (h, f) = (HIDDEN, WIDTH);
        let mut problems: Vec<GroupedMatmul<'_, CudaBackend>> = Vec::new();
        for (e, r) in l.rows.iter().enumerate() {
            let n = r.len();
            let rows = |buf, width| dev.slice(buf, r.start * width..r.end * width);
            let weight = |buf| dev.slice(buf, e * h * f..(e + 1) * h * f);
            let weight_mut = |buf| dev.slice_mut(buf, e * h * f..(e + 1) * h * f);
            let rows_mut = |buf, width| dev.slice_mut(buf, r.start * width..r.end * width);
            match self {
                Call::Fc1 => problems.push(GroupedMatmul::<CudaBackend> {
                    a: rows(&l.x, h)?,
                    b: weight(&l.w1)?,
                    c: rows_mut(&l.pre, f)?,
                    dims: MatmulDims::linear(n, h, f),
                }),
                Call::Fc2 => problems.push(GroupedMatmul::<CudaBackend> {
                    a: rows(&l.act, f)?,
                    b: weight(&l.w2)?,
                    c: rows_mut(&l.out, h)?,
                    dims: MatmulDims::linear(n, f, h),
                }),
                Call::Fc2InputGrad => problems.push(GroupedMatmul::<CudaBackend> {
                    a: rows(&l.d_out, h)?,
                    b: weight(&l.w2)?,
                    c: rows_mut(&l.d_act, f)?,
                    dims: MatmulDims::linear_input_grad(n, f, h, false),
                }),
                Call::Fc1InputGrad => problems.push(GroupedMatmul::<CudaBackend> {
                    a: rows(&l.d_pre, f)?,
                    b: weight(&l.w1)?,
                    c: rows_mut(&l.d_in, h)?,
                    dims: MatmulDims::linear_input_grad(n, h, f, false),
                }),
                Call::WeightGrads => {
                    problems.push(GroupedMatmul::<CudaBackend> {
                        a: rows(&l.d_out, h)?,
                        b: rows(&l.act, f)?,
                        c: weight_mut(&l.dw2)?,
                        dims: MatmulDims::linear_weight_grad(n, f, h),
                    });
                    problems.push(GroupedMatmul::<CudaBackend> {
                        a: rows(&l.d_pre, f)?,
                        b: rows(&l.x, h)?,
                        c: weight_mut(&l.dw1)?,
                        dims: MatmulDims::linear_weight_grad(n, h, f),
                    });
                }
            }
        }
        dev.grouped_matmul(problems)
    }

    /// The buffers the call writes, and their lengths.
    fn outputs(self, l: &Layer) -> Vec<(&Buf, usize)> {
        match self {
            Call::Fc1 => vec![(&l.pre, ROUTED * WIDTH)],
            Call::Fc2 => vec![(&l.out, ROUTED * HIDDEN)],
            Call::Fc2InputGrad => vec![(&l.d_act, ROUTED * WIDTH)],
            Call::Fc1InputGrad => vec![(&l.d_in, ROUTED * HIDDEN)],
            Call::WeightGrads => vec![
                (&l.dw1, EXPERTS * WIDTH * HIDDEN),
                (&l.dw2, EXPERTS * WIDTH * HIDDEN),
            ],
        }
    }

    /// The call's outputs, widened to f32, one after another.
    fn output(self, dev: &CudaBackend, l: &Layer) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for (buf, len) in self.outputs(l) {
            out.extend(widened(dev, buf, len)?);
        }
        Ok(out)
    }

    /// Puts back outputs the call adds to (the weight gradients) from
    /// `values`, what [`Call::output`] read before.
    fn restore(self, dev: &CudaBackend, l: &Layer, values: &[f32]) -> Result<()> {
        if let Call::WeightGrads = self {
            let mut at = 0;
            for (buf, len) in self.outputs(l) {
                let wide = dev.alloc(len, DType::F32)?;
                dev.upload(&values[at..at + len], dev.view_mut(&wide)?)?;
                dev.copy(dev.view(&wide)?, dev.view_mut(buf)?)?;
                at += len;
            }
        }
        Ok(())
    }
}

/// The dense layers' projections of `bench-hybrid-moe`: name, input and
/// output features, and how many a micro-batch runs.
const DENSE: [(&str, usize, usize, usize); 7] = [
    ("Mamba in_proj", 2048, 10304, 4),
    ("Mamba out_proj", 4096, 2048, 4),
    ("attention qkv", 2048, 3072, 4),
    ("attention proj", 2048, 2048, 4),
    ("shared expert fc1, fc2", 2048, 2048, 16),
    ("output layer", 2048, 32768, 1),
    ("router", 2048, 16, 8),
];

/// Tokens of a micro-batch.
const TOKENS: usize = 4096;

/// One projection's operands: input, weight, output, their gradients
/// (the weight's f32, as training keeps it).
struct Dense {
    dims: [MatmulDims; 3],
    x: Buf,
    w: Buf,
    y: Buf,
    dy: Buf,
    dx: Buf,
    dw: Buf,
}

impl Dense {
    fn new(dev: &CudaBackend, seed: &mut u64, input: usize, output: usize) -> Result<Dense> {
        let bf = DType::Bf16;
        Ok(Dense {
            dims: [
                MatmulDims::linear(TOKENS, input, output),
                MatmulDims::linear_input_grad(TOKENS, input, output, false),
                MatmulDims::linear_weight_grad(TOKENS, input, output),
            ],
            x: put(dev, seed, TOKENS * input, bf)?,
            w: put(dev, seed, output * input, bf)?,
            y: dev.alloc(TOKENS * output, bf)?,
            dy: put(dev, seed, TOKENS * output, bf)?,
            dx: dev.alloc(TOKENS * input, bf)?,
            dw: dev.alloc(output * input, DType::F32)?,
        })
    }

    /// Product `which` (0 forward, 1 input gradient, 2 weight gradient),
    /// by `matmul` (cuBLAS) or as a one-problem `grouped_matmul` (the
    /// grouped kernel, where it takes the problem).
    fn run(&self, dev: &CudaBackend, which: usize, grouped: bool) -> Result<()> {
        let (a, b, c) = match which {
            0 => (&self.x, &self.w, &self.y),
            1 => (&self.dy, &self.w, &self.dx),
            _ => (&self.dy, &self.x, &self.dw),
        };
        let (a, b, c, dims) = (
            dev.view(a)?,
            dev.view(b)?,
            dev.view_mut(c)?,
            self.dims[which],
        );
        if grouped {
            dev.grouped_matmul(vec![GroupedMatmul::<CudaBackend> { a, b, c, dims }])
        } else {
            dev.matmul(a, b, c, dims)
        }
    }

    /// Product `which`'s output, widened to f32, after one call from a
    /// zeroed output (the weight gradient adds to it).
    fn output(&self, dev: &CudaBackend, which: usize, grouped: bool) -> Result<Vec<f32>> {
        let out = [&self.y, &self.dx, &self.dw][which];
        dev.zero(dev.view_mut(out)?)?;
        self.run(dev, which, grouped)?;
        widened(dev, out, dev.buf_len(out))
    }
}

/// `len` values of `buf` on the host, widened to f32 on the device.
fn widened(dev: &CudaBackend, buf: &Buf, len: usize) -> Result<Vec<f32>> {
    let wide = dev.alloc(len, DType::F32)?;
    dev.cast(dev.view(buf)?, dev.view_mut(&wide)?)?;
    let mut host = vec![0.0; len];
    dev.download(dev.view(&wide)?, &mut host)?;
    Ok(host)
}

/// The header of a table of [`print_row`]s.
fn print_header() {
    println!(
        "{:<34} {:>12} {:>9} {:>12} {:>9} {:>8} {:>10}",
        "call", "cuBLAS us", "TFLOP/s", "grouped us", "TFLOP/s", "ratio", "max diff"
    );
}

/// One call's row: both times and rates, their ratio, and the largest
/// difference between the two results relative to cuBLAS's largest value.
fn print_row(name: &str, flops: f64, us: (f64, f64), results: (&[f32], &[f32])) {
    let (t_cublas, t_grouped) = us;
    let (by_cublas, by_grouped) = results;
    let scale = by_cublas.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = by_cublas
        .iter()
        .zip(by_grouped)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    println!(
        "{:<34} {:>12.1} {:>9.1} {:>12.1} {:>9.1} {:>8.2} {:>10.2e}",
        name,
        t_cublas,
        flops / t_cublas / 1e6,
        t_grouped,
        flops / t_grouped / 1e6,
        t_grouped / t_cublas,
        diff / scale.max(f32::MIN_POSITIVE)
    );
}

/// Microseconds a call of `run`, over [`CALLS`] calls after [`WARM`].
fn time_calls(dev: &CudaBackend, run: impl Fn() -> Result<()>) -> Result<f64> {
    for _ in 0..WARM {
        run()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..CALLS {
        run()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e6 / CALLS as f64)
}

/// The dense table: each projection's three products both ways, and the
/// micro-batch's total.
fn dense_table(dev: &CudaBackend) -> Result<()> {
    println!(
        "\ndense layers' GEMMs of one bench-hybrid-moe micro-batch ({TOKENS} tokens): \
         cuBLAS against the grouped kernel with one problem"
    );
    print_header();
    let mut seed = 23;
    let (mut total_cublas, mut total_grouped) = (0.0, 0.0);
    for (name, input, output, count) in DENSE {
        let layer = Dense::new(dev, &mut seed, input, output)?;
        let flops = 2.0 * (TOKENS * input * output) as f64;
        for (which, kind) in ["forward", "input grad", "weight grad"]
            .into_iter()
            .enumerate()
        {
            let by_cublas = layer.output(dev, which, false)?;
            let by_grouped = layer.output(dev, which, true)?;
            let t_cublas = time_calls(dev, || layer.run(dev, which, false))?;
            let t_grouped = time_calls(dev, || layer.run(dev, which, true))?;
            total_cublas += t_cublas * count as f64;
            total_grouped += t_grouped * count as f64;
            print_row(
                &format!("{name} {kind}"),
                flops,
                (t_cublas, t_grouped),
                (&by_cublas, &by_grouped),
            );
        }
    }
    println!(
        "a micro-batch's dense GEMMs (each call times its count): cuBLAS {:.2} ms, grouped {:.2} ms",
        total_cublas / 1e3,
        total_grouped / 1e3
    );
    Ok(())
}

fn main() -> Result<()> {
    if let Err(why) = probe() {
        println!("expert_gemm: skipped: {why}");
        return Ok(());
    }
    let gpu = Gpu::open(0, Precision::Bf16, Duration::from_secs(60))?;
    let host = gpu.backend("host")?;
    let cublas = host.clone().with_grouped_gemm(false);
    let grouped = host.with_grouped_gemm(true);
    let layer = Layer::new(&cublas)?;
    println!(
        "experts' GEMMs of one bench-hybrid-moe layer and micro-batch: {EXPERTS} experts, rows {:?}",
        expert_rows()
    );
    print_header();
    for call in Call::ALL {
        // The same inputs each way; the weight gradients add onto the
        // same starting values (restored from a copy).
        let start = call.output(&cublas, &layer)?;
        call.run(&cublas, &layer)?;
        let by_cublas = call.output(&cublas, &layer)?;
        call.restore(&grouped, &layer, &start)?;
        call.run(&grouped, &layer)?;
        let by_grouped = call.output(&grouped, &layer)?;
        let t_cublas = time_calls(&cublas, || call.run(&cublas, &layer))?;
        let t_grouped = time_calls(&grouped, || call.run(&grouped, &layer))?;
        print_row(
            call.name(),
            call.flops(),
            (t_cublas, t_grouped),
            (&by_cublas, &by_grouped),
        );
    }
    dense_table(&grouped)
}

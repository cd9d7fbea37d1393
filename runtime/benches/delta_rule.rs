//! The gated delta rule's GPU kernels (`G` layers): forward and backward
//! timed with CUDA events (the median of many calls), at a realistic small
//! model's widths by default (one sequence of 4,096 tokens, Hk = 16 key
//! heads, Hv = 32 value heads, dk = dv' = 128, bf16), or on inputs another
//! program wrote, whose forward output it writes back for comparison
//! (`scripts/bench_delta_fla.py` times flash-linear-attention's
//! `chunk_gated_delta_rule` on the same inputs and compares).
//!
//! ```text
//! delta_rule                 # random inputs at the default widths
//! delta_rule DIR             # DIR/dims.txt and DIR/*.f32 in, DIR/out.f32 out
//! ```
//!
//! `DIR/dims.txt` holds `batch seq Hk Hv dk dv dtype` (dtype `bf16` or
//! `f32`); `qkv.f32` (`[rows, 2 Hk dk + Hv dv]`, q | k | v after the conv
//! and SiLU), `beta.f32` and `alpha.f32` (`[rows, Hv]`, raw), `dt_bias.f32`
//! and `a_log.f32` (`[Hv]`) and `d_out.f32` (`[rows, Hv dv]`) are raw
//! little-endian f32, rounded to bf16 here where the dtype says so.
//! `out.f32` is the forward's output, widened to f32.
//!
//! Run where there is a GPU: `cargo bench -p hybridgen-runtime --bench
//! delta_rule` (or the binary `scripts/cuda_bundle.sh` collects, as
//! `gpu-bundle/bench/delta_rule`). Without one it says why and exits.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use hybridgen_runtime::backend::{DeltaDims, DeltaGrads, DeltaInputs, Tokens};
use hybridgen_runtime::cuda::kernels;
use hybridgen_runtime::cuda::ops::delta::{
    DELTA_CHUNK, delta_scratch_len, tensor_core_backward, tensor_core_forward,
};
use hybridgen_runtime::cuda::{GpuView, KernelSet, probe};
use hybridgen_runtime::view::DType;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const WARM: usize = 3;
const CALLS: usize = 25;

type BenchResult<T> = std::result::Result<T, String>;

/// A device buffer of either storage dtype.
enum Buf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl Buf {
    fn new(stream: &Arc<CudaStream>, values: &[f32], dtype: DType) -> BenchResult<Buf> {
        let err = |e| format!("upload: {e}");
        Ok(match dtype {
            DType::Bf16 => {
                let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
                Buf::Bf16(stream.clone_htod(&v).map_err(err)?)
            }
            _ => Buf::F32(stream.clone_htod(values).map_err(err)?),
        })
    }

    fn zeros(stream: &Arc<CudaStream>, len: usize, dtype: DType) -> BenchResult<Buf> {
        Buf::new(stream, &vec![0.0; len.max(1)], dtype)
    }

    fn view(&self, stream: &Arc<CudaStream>, len: usize) -> GpuView {
        match self {
            Buf::F32(x) => GpuView::new(x.device_ptr(stream).0, len, DType::F32),
            Buf::Bf16(x) => GpuView::new(x.device_ptr(stream).0, len, DType::Bf16),
        }
    }

    fn read(&self, stream: &Arc<CudaStream>, len: usize) -> BenchResult<Vec<f32>> {
        let err = |e| format!("download: {e}");
        Ok(match self {
            Buf::F32(x) => stream.clone_dtoh(x).map_err(err)?[..len].to_vec(),
            Buf::Bf16(x) => stream.clone_dtoh(x).map_err(err)?[..len]
                .iter()
                .map(|v| v.to_f32())
                .collect(),
        })
    }
}

/// The problem: its dimensions, storage dtype and host inputs.
struct Problem {
    dims: DeltaDims,
    dtype: DType,
    qkv: Vec<f32>,
    beta: Vec<f32>,
    alpha: Vec<f32>,
    dt_bias: Vec<f32>,
    a_log: Vec<f32>,
    d_out: Vec<f32>,
}

fn dims(batch: usize, seq: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> DeltaDims {
    DeltaDims {
        tokens: Tokens::new(batch, seq),
        key_heads: hk,
        value_heads: hv,
        key_dim: dk,
        value_dim: dv,
        chunk: DELTA_CHUNK,
    }
}

/// Order-one inputs at the default widths (gates as a trained model's:
/// decays between about 0.1 and 0.96 a step).
fn random_problem() -> Problem {
    let d = dims(1, 4096, 16, 32, 128, 128);
    let mut seed = 0x5eedu64;
    let mut uniform = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                lo + (hi - lo) * ((seed >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    };
    let rows = d.tokens.rows().unwrap_or(0);
    let hv = d.value_heads;
    Problem {
        dims: d,
        dtype: DType::Bf16,
        qkv: uniform(rows * d.qkv_width(), -1.5, 1.5),
        beta: uniform(rows * hv, -3.0, 3.0),
        alpha: uniform(rows * hv, -2.0, 1.0),
        dt_bias: uniform(hv, -0.5, 0.5),
        a_log: uniform(hv, -1.0, 0.5),
        d_out: uniform(rows * d.out_width(), -1.0, 1.0),
    }
}

fn read_f32(dir: &Path, name: &str, len: usize) -> BenchResult<Vec<f32>> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() != 4 * len {
        return Err(format!(
            "{}: {} bytes, the dimensions need {} ({len} f32)",
            path.display(),
            bytes.len(),
            4 * len
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

fn read_problem(dir: &Path) -> BenchResult<Problem> {
    let path = dir.join("dims.txt");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let fields: Vec<&str> = text.split_whitespace().collect();
    let bad = || {
        format!(
            "{}: expected `batch seq Hk Hv dk dv dtype`, found `{}`",
            path.display(),
            text.trim()
        )
    };
    if fields.len() != 7 {
        return Err(bad());
    }
    let n: Vec<usize> = fields[..6]
        .iter()
        .map(|f| f.parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad())?;
    let dtype = match fields[6] {
        "bf16" => DType::Bf16,
        "f32" => DType::F32,
        _ => return Err(bad()),
    };
    let d = dims(n[0], n[1], n[2], n[3], n[4], n[5]);
    let rows = d.tokens.rows().map_err(|e| e.to_string())?;
    let hv = d.value_heads;
    Ok(Problem {
        dims: d,
        dtype,
        qkv: read_f32(dir, "qkv.f32", rows * d.qkv_width())?,
        beta: read_f32(dir, "beta.f32", rows * hv)?,
        alpha: read_f32(dir, "alpha.f32", rows * hv)?,
        dt_bias: read_f32(dir, "dt_bias.f32", hv)?,
        a_log: read_f32(dir, "a_log.f32", hv)?,
        d_out: read_f32(dir, "d_out.f32", rows * d.out_width())?,
    })
}

/// The median of `CALLS` timed calls of `call` (after `WARM`), in ms.
fn median_ms(
    context: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    call: impl Fn() -> BenchResult<()>,
) -> BenchResult<f64> {
    for _ in 0..WARM {
        call()?;
    }
    let event = || {
        context
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| format!("event: {e}"))
    };
    let mut times = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let (start, end) = (event()?, event()?);
        start.record(stream).map_err(|e| e.to_string())?;
        call()?;
        end.record(stream).map_err(|e| e.to_string())?;
        times.push(f64::from(
            start.elapsed_ms(&end).map_err(|e| e.to_string())?,
        ));
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn bench(dir: Option<PathBuf>) -> BenchResult<()> {
    let problem = match &dir {
        Some(dir) => read_problem(dir)?,
        None => random_problem(),
    };
    let info = probe().map_err(|e| e.to_string())?;
    let device = &info.devices[0];
    let include = kernels::include_dir().map_err(|e| e.to_string())?;
    let compiled = kernels::compile_all(device.target(), &include).map_err(|e| e.to_string())?;
    let context = CudaContext::new(device.ordinal).map_err(|e| e.to_string())?;
    let set = KernelSet::load(&context, &compiled).map_err(|e| e.to_string())?;
    let stream = context.new_stream().map_err(|e| e.to_string())?;
    let (d, a) = (problem.dims, problem.dtype);
    let rows = d.tokens.rows().map_err(|e| e.to_string())?;
    let hv = d.value_heads;
    let inputs = [
        (&problem.qkv, rows * d.qkv_width()),
        (&problem.beta, rows * hv),
        (&problem.alpha, rows * hv),
        (&problem.dt_bias, hv),
        (&problem.a_log, hv),
    ]
    .map(|(values, len)| Buf::new(&stream, values, a).map(|b| (b, len)));
    let [qkv, beta, alpha, dt_bias, a_log] = inputs;
    let (qkv, beta, alpha, dt_bias, a_log) = (qkv?, beta?, alpha?, dt_bias?, a_log?);
    let input_views = DeltaInputs {
        qkv: qkv.0.view(&stream, qkv.1),
        beta: beta.0.view(&stream, beta.1),
        alpha: alpha.0.view(&stream, alpha.1),
        dt_bias: dt_bias.0.view(&stream, dt_bias.1),
        a_log: a_log.0.view(&stream, a_log.1),
    };
    let out_len = rows * d.out_width();
    let out = Buf::zeros(&stream, out_len, a)?;
    let states = Buf::zeros(&stream, d.states_len(), DType::F32)?;
    let d_out = Buf::new(&stream, &problem.d_out, a)?;
    let d_qkv = Buf::zeros(&stream, rows * d.qkv_width(), a)?;
    let d_beta = Buf::zeros(&stream, rows * hv, a)?;
    let d_alpha = Buf::zeros(&stream, rows * hv, a)?;
    let d_a_log = Buf::zeros(&stream, hv, DType::F32)?;
    let too_big = || "the scratch overflows".to_string();
    let forward_len = delta_scratch_len(d, false).ok_or_else(too_big)?;
    let backward_len = delta_scratch_len(d, true).ok_or_else(too_big)?;
    let scratch = Buf::zeros(&stream, backward_len, DType::F32)?;
    let forward = || {
        set.gated_delta_forward(
            &stream,
            input_views,
            out.view(&stream, out_len),
            states.view(&stream, d.states_len()),
            scratch.view(&stream, forward_len),
            d,
        )
        .map_err(|e| e.to_string())
    };
    let backward = || {
        set.gated_delta_backward(
            &stream,
            input_views,
            states.view(&stream, d.states_len()),
            d_out.view(&stream, out_len),
            DeltaGrads {
                qkv: d_qkv.view(&stream, rows * d.qkv_width()),
                beta: d_beta.view(&stream, rows * hv),
                alpha: d_alpha.view(&stream, rows * hv),
                a_log: d_a_log.view(&stream, hv),
            },
            scratch.view(&stream, backward_len),
            d,
        )
        .map_err(|e| e.to_string())
    };
    forward()?;
    stream.synchronize().map_err(|e| e.to_string())?;
    let output = out.read(&stream, out_len)?;
    let forward_ms = median_ms(&context, &stream, forward)?;
    let backward_ms = median_ms(&context, &stream, backward)?;
    let both_ms = median_ms(&context, &stream, || {
        forward()?;
        backward()
    })?;
    println!(
        "hybridgen delta_rule on {device}: batch {} x {} tokens, Hk {} Hv {} dk {} dv {} {}",
        d.tokens.batch, d.tokens.seq, d.key_heads, d.value_heads, d.key_dim, d.value_dim, a
    );
    // The launchers' choices, where the device gives the tensor-core
    // kernels their shared memory.
    let path = |tensor_cores: bool| {
        if tensor_cores {
            "tensor cores (bf16 products)"
        } else {
            "f32 kernels"
        }
    };
    println!(
        "forward: {}; backward: {}",
        path(tensor_core_forward(a, a, d)),
        path(tensor_core_backward(a, a, d))
    );
    println!(
        "forward {forward_ms:.3} ms, backward {backward_ms:.3} ms, forward+backward {both_ms:.3} ms \
         (median of {CALLS}, CUDA events)"
    );
    if let Some(dir) = dir {
        let bytes: Vec<u8> = output.iter().flat_map(|v| v.to_le_bytes()).collect();
        let path = dir.join("out.f32");
        std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let timing = format!("{forward_ms} {backward_ms} {both_ms}\n");
        let path = dir.join("hybridgen_ms.txt");
        std::fs::write(&path, timing).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn main() {
    if let Err(why) = probe() {
        println!("delta_rule: skipped: {why}");
        return;
    }
    // `cargo bench` passes `--bench`; a directory is the first other
    // argument.
    let dir = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from);
    if let Err(why) = bench(dir) {
        eprintln!("delta_rule: {why}");
        std::process::exit(1);
    }
}

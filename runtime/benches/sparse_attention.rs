//! DeepSeek sparse attention's GPU kernels (`D` layers) against dense
//! attention: a `D` layer's core, forward and backward with its indexer,
//! against the same attention over every causal key through the flash
//! kernels, timed with CUDA events (the median of several calls after a
//! warm-up), at 4,096, 8,192, 16,384 and 32,768 tokens (one sequence).
//!
//! The widths are a DeepSeek-V3.2-like layer's: 16 attention heads over
//! MLA's shared latent rows (the absorbed form the layer runs,
//! `sparse_mqa_*`): absorbed queries of 576 channels (kv_rank 512 + rope
//! 64), one key row of 576 a token shared by the heads, values its first
//! 512; an indexer of 64 heads of 128 channels selecting 2,048 keys a
//! query, bf16 storage. The flash kernels take one head width for q/k and
//! v (64 or 128), so the dense rows are attention of the same heads of 128
//! (MLA's own heads are 192/128 before absorption). `--heads N` sets the
//! attention heads of both sides (DeepSeek-V3.2 has 128; the indexer keeps
//! its 64 x 128), and `--calls N` the timed calls a row (after one
//! warm-up; 5 from 16,384 tokens on, else 11, by default).
//!
//! Rows of the table, each forward + backward where there is one:
//!
//! - `scores`: the indexer's scores (`indexer_scores`);
//! - `top-k`: the selection (`indexer_topk`);
//! - `loss`: the indexer's KL loss over every causal key (`indexer_loss`);
//! - `sp loss`: the same loss over the selected keys (`sparse: true`);
//! - `ix bwd`: the indexer's backward (`indexer_backward`);
//! - `sparse fwd`, `sparse bwd`: attention over the selected latent rows;
//! - `D total`: all of the above, one after the other;
//! - `dense`: flash attention forward + backward over every causal key.
//!
//! Run where there is a GPU: `cargo bench -p hybridgen-runtime --bench
//! sparse_attention [-- [--heads N] [--calls N] MAX_TOKENS]` (or `gpu-bundle/bench/sparse_attention`,
//! which `scripts/cuda_bundle.sh` collects). Without one it says why and
//! exits.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use hybridgen_runtime::backend::{
    AttentionDims, AttentionInputs, IndexerDims, IndexerInputs, IndexerLossDims, SparseMqaDims,
    Tokens,
};
use hybridgen_runtime::cuda::kernels;
use hybridgen_runtime::cuda::ops::attention_flash::flash_attention_scratch_len;
use hybridgen_runtime::cuda::ops::sparse_attention::sparse_mqa_scratch_len;
use hybridgen_runtime::cuda::{GpuView, KernelSet, probe};
use hybridgen_runtime::view::DType;
use std::sync::Arc;

type BenchResult<T> = std::result::Result<T, String>;

/// Attention heads unless `--heads` says otherwise.
const HEADS: usize = 16;
/// The shared latent row (kv_rank + rope) and its value part (kv_rank).
const QK: usize = 576;
const V: usize = 512;
/// MLA's query/key head before absorption (its softmax scale's width).
const MLA_QK: usize = 192;
const INDEX_HEADS: usize = 64;
const INDEX_DIM: usize = 128;
const TOPK: usize = 2048;
const DENSE_DIM: usize = 128;
const SEQS: [usize; 4] = [4096, 8192, 16_384, 32_768];

/// A device buffer and the view of its first `len` elements.
enum Buf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
    U32(CudaSlice<u32>),
}

impl Buf {
    fn view(&self, stream: &Arc<CudaStream>, len: usize) -> GpuView {
        match self {
            Buf::F32(x) => GpuView::new(x.device_ptr(stream).0, len, DType::F32),
            Buf::Bf16(x) => GpuView::new(x.device_ptr(stream).0, len, DType::Bf16),
            Buf::U32(x) => GpuView::new(x.device_ptr(stream).0, len, DType::U32),
        }
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// `len` bf16 values uniform in `[-scale, scale)`.
fn random(stream: &Arc<CudaStream>, len: usize, scale: f32, seed: u64) -> BenchResult<Buf> {
    let mut s = seed;
    let values: Vec<bf16> = (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let unit = (s >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32(scale * (2.0 * unit - 1.0))
        })
        .collect();
    Ok(Buf::Bf16(stream.clone_htod(&values).map_err(err)?))
}

fn zeros(stream: &Arc<CudaStream>, len: usize, dtype: DType) -> BenchResult<Buf> {
    let len = len.max(1);
    Ok(match dtype {
        DType::Bf16 => Buf::Bf16(stream.alloc_zeros::<bf16>(len).map_err(err)?),
        DType::U32 => Buf::U32(stream.alloc_zeros::<u32>(len).map_err(err)?),
        _ => Buf::F32(stream.alloc_zeros::<f32>(len).map_err(err)?),
    })
}

/// The median of `calls` timed calls of `call` (after one warm-up), in ms.
fn median_ms(
    context: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    calls: usize,
    call: &dyn Fn() -> BenchResult<()>,
) -> BenchResult<f64> {
    call()?;
    let event = || {
        context
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)
    };
    let mut times = Vec::with_capacity(calls);
    for _ in 0..calls {
        let (start, end) = (event()?, event()?);
        start.record(stream).map_err(err)?;
        call()?;
        end.record(stream).map_err(err)?;
        times.push(f64::from(start.elapsed_ms(&end).map_err(err)?));
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// What the command line chose.
struct Settings {
    max_tokens: usize,
    heads: usize,
    /// Timed calls a row; `None`: 5 from 16,384 tokens on, else 11.
    calls: Option<usize>,
}

fn bench(settings: &Settings) -> BenchResult<()> {
    let max_tokens = settings.max_tokens;
    let heads = settings.heads;
    let info = probe().map_err(err)?;
    let device = &info.devices[0];
    let include = kernels::include_dir().map_err(err)?;
    let compiled = kernels::compile_all(device.target(), &include).map_err(err)?;
    let context = CudaContext::new(device.ordinal).map_err(err)?;
    let set = KernelSet::load(&context, &compiled).map_err(err)?;
    let stream = context.new_stream().map_err(err)?;
    let seqs: Vec<usize> = SEQS.into_iter().filter(|&s| s <= max_tokens).collect();
    let n = *seqs
        .last()
        .ok_or("no sequence length at most the maximum given")?;
    // Every buffer at the largest length; each length uses their prefixes.
    let iq = random(&stream, n * INDEX_HEADS * INDEX_DIM, 1.0, 1)?;
    let ik = random(&stream, n * INDEX_DIM, 1.0, 2)?;
    let iw = random(&stream, n * INDEX_HEADS, 1.0, 3)?;
    let q = random(&stream, n * heads * QK, 1.0, 4)?;
    let kv = random(&stream, n * QK, 1.0, 5)?;
    // Dense attention's keys and values (its queries are q's prefix).
    let k = random(&stream, n * heads * DENSE_DIM, 1.0, 6)?;
    let v = random(&stream, n * heads * DENSE_DIM, 1.0, 8)?;
    let dout = random(&stream, n * heads * V, 1.0, 7)?;
    let scores = zeros(&stream, n * n, DType::F32)?;
    let d_scores = zeros(&stream, n * n, DType::F32)?;
    let indices = zeros(&stream, n * TOPK, DType::U32)?;
    let loss = zeros(&stream, n, DType::F32)?;
    let out = zeros(&stream, n * heads * V, DType::Bf16)?;
    let lse = zeros(&stream, n * heads, DType::F32)?;
    let (dq, dkv) = (
        zeros(&stream, n * heads * QK, DType::Bf16)?,
        zeros(&stream, n * QK, DType::Bf16)?,
    );
    let (dk, dv) = (
        zeros(&stream, n * heads * DENSE_DIM, DType::Bf16)?,
        zeros(&stream, n * heads * DENSE_DIM, DType::Bf16)?,
    );
    let (d_iq, d_ik, d_iw) = (
        zeros(&stream, n * INDEX_HEADS * INDEX_DIM, DType::Bf16)?,
        zeros(&stream, n * INDEX_DIM, DType::Bf16)?,
        zeros(&stream, n * INDEX_HEADS, DType::Bf16)?,
    );
    let sparse_dims = |seq: usize| SparseMqaDims {
        tokens: Tokens::new(1, seq),
        heads,
        qk_dim: QK,
        v_dim: V,
        topk: TOPK,
        scale: 1.0 / (MLA_QK as f32).sqrt(),
    };
    let dense_dims = |seq: usize| AttentionDims {
        tokens: Tokens::new(1, seq),
        heads,
        kv_heads: heads,
        qk_dim: DENSE_DIM,
        v_dim: DENSE_DIM,
        scale: 1.0 / (DENSE_DIM as f32).sqrt(),
    };
    // The sparse backward's scratch on tensor cores or not, whichever is larger.
    let sparse_scratch = |dims: SparseMqaDims| {
        let len = |tc| sparse_mqa_scratch_len(dims, tc).ok_or("the scratch overflows");
        Ok::<usize, &str>(len(true)?.max(len(false)?))
    };
    let scratch_len =
        sparse_scratch(sparse_dims(n))?.max(flash_attention_scratch_len(dense_dims(n)));
    let scratch = zeros(&stream, scratch_len, DType::F32)?;
    println!(
        "hybridgen sparse_attention on {device}: one sequence, bf16; D: {heads} heads over shared \
         latent rows of {QK} (values {V}), \
         indexer {INDEX_HEADS} x {INDEX_DIM}, top-{TOPK}; dense: flash attention {heads} heads of \
         {DENSE_DIM}, causal over every key. Median ms (CUDA events)."
    );
    println!(
        "{:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9} {:>8}",
        "tokens",
        "scores",
        "top-k",
        "loss",
        "sp loss",
        "ix bwd",
        "sparse fwd",
        "sparse bwd",
        "D total",
        "dense",
        "D/dense"
    );
    for &seq in &seqs {
        let tokens = Tokens::new(1, seq);
        let idims = IndexerDims {
            tokens,
            heads: INDEX_HEADS,
            head_dim: INDEX_DIM,
            topk: TOPK,
            weight_scale: 1.0 / ((INDEX_HEADS * INDEX_DIM) as f32).sqrt(),
        };
        let sd = sparse_dims(seq);
        let dd = dense_dims(seq);
        let inputs = IndexerInputs {
            q: iq.view(&stream, seq * INDEX_HEADS * INDEX_DIM),
            k: ik.view(&stream, seq * INDEX_DIM),
            weights: iw.view(&stream, seq * INDEX_HEADS),
        };
        let grads = IndexerInputs {
            q: d_iq.view(&stream, seq * INDEX_HEADS * INDEX_DIM),
            k: d_ik.view(&stream, seq * INDEX_DIM),
            weights: d_iw.view(&stream, seq * INDEX_HEADS),
        };
        let s_view = scores.view(&stream, seq * seq);
        let ds_view = d_scores.view(&stream, seq * seq);
        let ix_view = indices.view(&stream, seq * TOPK);
        let (q_view, kv_view) = (
            q.view(&stream, seq * heads * QK),
            kv.view(&stream, seq * QK),
        );
        let (dq_view, dkv_view) = (
            dq.view(&stream, seq * heads * QK),
            dkv.view(&stream, seq * QK),
        );
        let o_view = out.view(&stream, seq * heads * V);
        let lse_view = lse.view(&stream, seq * heads);
        let g_view = dout.view(&stream, seq * heads * V);
        let sa_scratch = scratch.view(&stream, sparse_scratch(sd)?);
        let loss_dims = IndexerLossDims {
            tokens,
            topk: TOPK,
            heads,
            qk_dim: QK,
            scale: sd.scale,
            coeff: 0.01,
            sparse: false,
        };
        let sparse_loss_dims = IndexerLossDims {
            sparse: true,
            ..loss_dims
        };
        let score = || {
            set.indexer_scores(&stream, inputs, s_view, idims)
                .map_err(err)
        };
        let topk = || {
            set.indexer_topk(&stream, s_view, ix_view, idims)
                .map_err(err)
        };
        let loss_over = |dims: IndexerLossDims| {
            set.indexer_loss(
                &stream,
                s_view,
                (q_view, kv_view),
                ix_view,
                loss.view(&stream, seq),
                ds_view,
                dims,
            )
            .map_err(err)
        };
        let ix_loss = || loss_over(loss_dims);
        let ix_sparse_loss = || loss_over(sparse_loss_dims);
        let ix_bwd = || {
            set.indexer_backward(&stream, inputs, ds_view, grads, idims, 1.0)
                .map_err(err)
        };
        let fwd = || {
            set.sparse_mqa_forward(&stream, (q_view, kv_view), ix_view, o_view, lse_view, sd)
                .map_err(err)
        };
        let bwd = || {
            set.sparse_mqa_backward(
                &stream,
                (q_view, kv_view),
                ix_view,
                (o_view, lse_view, g_view),
                (dq_view, dkv_view),
                sa_scratch,
                sd,
            )
            .map_err(err)
        };
        let total = || {
            score()?;
            topk()?;
            ix_loss()?;
            fwd()?;
            bwd()?;
            ix_bwd()
        };
        // Dense: the queries' prefix and the dense keys and values, heads
        // of 128.
        let dense_in = AttentionInputs {
            q: q.view(&stream, seq * heads * DENSE_DIM),
            k: k.view(&stream, seq * heads * DENSE_DIM),
            v: v.view(&stream, seq * heads * DENSE_DIM),
        };
        let dense_grads = AttentionInputs {
            q: dq.view(&stream, seq * heads * DENSE_DIM),
            k: dk.view(&stream, seq * heads * DENSE_DIM),
            v: dv.view(&stream, seq * heads * DENSE_DIM),
        };
        let flash_scratch = scratch.view(&stream, flash_attention_scratch_len(dd));
        let dense = || {
            set.attention_forward_flash(&stream, dense_in, o_view, lse_view, dd)
                .map_err(err)?;
            set.attention_backward_flash(
                &stream,
                dense_in,
                (o_view, lse_view, g_view),
                dense_grads,
                flash_scratch,
                dd,
            )
            .map_err(err)
        };
        let calls = settings.calls.unwrap_or(if seq >= 16_384 { 5 } else { 11 });
        // The selection the attention reads is the indexer's: run the
        // chain once before timing its parts.
        total()?;
        stream.synchronize().map_err(err)?;
        let time = |f: &dyn Fn() -> BenchResult<()>| median_ms(&context, &stream, calls, f);
        let t = [
            time(&score)?,
            time(&topk)?,
            time(&ix_loss)?,
            time(&ix_sparse_loss)?,
            time(&ix_bwd)?,
            time(&fwd)?,
            time(&bwd)?,
            time(&total)?,
        ];
        let dense_ms = if set.has_flash_attention() {
            time(&dense)?
        } else {
            f64::NAN
        };
        if let Some(fault) = set.take_fault(&stream).map_err(err)? {
            return Err(format!("a kernel reported a fault: {fault}"));
        }
        println!(
            "{seq:>7} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.2} {:>10.2} {:>9.2} {:>9.2} {:>8.2}",
            t[0],
            t[1],
            t[2],
            t[3],
            t[4],
            t[5],
            t[6],
            t[7],
            dense_ms,
            t[7] / dense_ms
        );
    }
    println!(
        "D/dense below 1 is where the sparse layer (its indexer included) is the cheaper one; \
         `sparse fwd + sparse bwd` against `dense` compares the attention alone."
    );
    Ok(())
}

fn main() {
    if let Err(why) = probe() {
        println!("sparse_attention: skipped: {why}");
        return;
    }
    let settings = settings(std::env::args().skip(1)).unwrap_or_else(|why| {
        eprintln!("sparse_attention: {why}");
        std::process::exit(2);
    });
    if let Err(why) = bench(&settings) {
        eprintln!("sparse_attention: {why}");
        std::process::exit(1);
    }
}

/// The command line: `--heads N` and `--calls N` take the next argument;
/// other flags (`cargo bench` passes `--bench`) are ignored, and the
/// largest length is the first other argument.
fn settings(mut args: impl Iterator<Item = String>) -> BenchResult<Settings> {
    let mut settings = Settings {
        max_tokens: 32_768,
        heads: HEADS,
        calls: None,
    };
    let mut tokens_given = false;
    let count = |flag: &str, value: Option<String>| -> BenchResult<usize> {
        value
            .as_deref()
            .unwrap_or("")
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{flag} takes a positive count, found {value:?}"))
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--heads" => settings.heads = count("--heads", args.next())?,
            "--calls" => settings.calls = Some(count("--calls", args.next())?),
            flag if flag.starts_with("--") => {}
            tokens if !tokens_given => {
                settings.max_tokens = tokens
                    .parse::<usize>()
                    .map_err(|e| format!("the argument is a token count: {e}"))?;
                tokens_given = true;
            }
            _ => {}
        }
    }
    Ok(settings)
}

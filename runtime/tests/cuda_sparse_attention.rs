//! DeepSeek sparse attention (`D`) on a GPU against the CPU backend.
//!
//! - Every kernel of the family (`indexer_scores`, `indexer_topk`,
//!   `indexer_loss` dense and sparse, `indexer_backward`,
//!   `sparse_mqa_forward` and `_backward`, `layer_norm_forward`,
//!   `_backward`, `_weight_grad`) on random order-one inputs over several
//!   shapes (sequences that are no multiple of a tile, top-k below and at
//!   or past the sequence, a row past a top-k block's threads, rows of
//!   selected keys past an attention block's), f32 and bf16 storage, with
//!   tied scores (key rows repeated). Each GPU kernel takes the CPU's
//!   inputs (the CPU's scores into top-k, its indices into the loss and the
//!   attention, ...), so each is compared alone. Its outputs are poisoned
//!   (NaN, or a bad index) before each call, it runs twice and must give
//!   the same bits, and it must match the CPU: the indices exactly, f32
//!   outputs within 1e-5 of their norm, bf16 outputs within 2^-8, the
//!   indexer loss within 1e-5 of the scale of its terms (`loss_error`).
//! - The conformance suite's sparse attention family (f64 references).
//! - Training: `[DE]-` and `M[DE]` on one GPU in f32 follow the CPU's run
//!   (every step's loss within 1e-5 relative, its indexer loss within
//!   1e-5 of the coefficient times ln(keys)), and the
//!   overlap schedule gives the plain schedule's bits (f32, and bf16 with
//!   a latent the tensor-core kernels take).
//! - The tensor-core kernels (bf16, rows of 576) at many heads: the MQA
//!   forward and backward and the indexer loss's target against the CPU,
//!   and the indexer.
//!
//! The tests are `#[ignore = "needs a GPU"]`: built anywhere, run on a GPU
//! machine with `--include-ignored` (the GPU bundle's `run.sh` does);
//! without a GPU they fail, saying why. Each prints what it compared.

use half::bf16;
use hybridgen_dsl::ModelConfig;
use hybridgen_runtime::backend::{
    IndexerDims, IndexerInputs, IndexerLossDims, LayerNormDims, SparseMqaDims, Tokens,
};
use hybridgen_runtime::conformance::{self, Options};
use hybridgen_runtime::cpu::CpuBackend;
use hybridgen_runtime::cuda::{CudaBackend, Gpu, probe};
use hybridgen_runtime::platform::DeviceChoice;
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{StepReport, TrainConfig, TrainSummary, train};
use hybridgen_runtime::view::DType;
use hybridgen_runtime::{Backend, Precision};
use std::collections::BTreeMap;
use std::time::Duration;

/// The first GPU bound to a host queue; a machine without one fails the
/// test, saying why.
fn gpu(precision: Precision) -> CudaBackend {
    if let Err(why) = probe() {
        panic!("needs a GPU: {why}");
    }
    let gpu = Gpu::open(0, precision, Duration::from_secs(60)).expect("the probed GPU opens");
    gpu.backend("host").expect("a host queue")
}

/// The conformance suite's generator, drawing `f32`s in `[-scale, scale)`.
struct Rng(conformance::Rng);

impl Rng {
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        let s = f64::from(scale);
        let drawn = self.0.values(n, -s, s);
        drawn.into_iter().map(|x| x as f32).collect()
    }
}

/// One shape of the family.
#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    seq: usize,
    /// Indexer heads and their width.
    ni: usize,
    di: usize,
    topk: usize,
    /// Attention heads, the width of a query head and of the shared key
    /// row, and of the value (the row's first `v` channels).
    heads: usize,
    qk: usize,
    v: usize,
    /// Indexer key rows repeat every `ties` positions (0: never), so that
    /// scores tie.
    ties: usize,
}

const SHAPES: &[Shape] = &[
    Shape {
        batch: 2,
        seq: 37,
        ni: 3,
        di: 20,
        topk: 8,
        heads: 2,
        qk: 24,
        v: 20,
        ties: 0,
    },
    Shape {
        batch: 1,
        seq: 45,
        ni: 4,
        di: 64,
        topk: 16,
        heads: 3,
        qk: 72,
        v: 40,
        ties: 5,
    },
    // top-k at and past the sequence: every causal key.
    Shape {
        batch: 2,
        seq: 29,
        ni: 2,
        di: 16,
        topk: 29,
        heads: 2,
        qk: 16,
        v: 16,
        ties: 0,
    },
    Shape {
        batch: 1,
        seq: 33,
        ni: 2,
        di: 16,
        topk: 40,
        heads: 1,
        qk: 16,
        v: 8,
        ties: 3,
    },
    // Rows longer than a top-k block (512 threads), selections longer than
    // an attention block's chunk (128), 128-channel indexer heads, the
    // latent rows of DeepSeek-V3.2 (512 + 64, values the first 512).
    Shape {
        batch: 1,
        seq: 700,
        ni: 2,
        di: 128,
        topk: 200,
        heads: 2,
        qk: 576,
        v: 512,
        ties: 7,
    },
];

/// A result of one backend: f32 values (widened from bf16) or indices.
#[derive(Clone, Debug)]
enum Out {
    F(Vec<f32>, DType),
    U(Vec<u32>),
}

impl Out {
    fn bits(&self) -> Vec<u32> {
        match self {
            Out::F(v, _) => v.iter().map(|x| x.to_bits()).collect(),
            Out::U(v) => v.clone(),
        }
    }
}

type Outs = BTreeMap<&'static str, Out>;

/// The host inputs of a shape.
struct Inputs {
    iq: Vec<f32>,
    ik: Vec<f32>,
    iw: Vec<f32>,
    q: Vec<f32>,
    /// The shared key/value rows `[rows, qk]`.
    kv: Vec<f32>,
    dout: Vec<f32>,
    ln_w: Vec<f32>,
    ln_b: Vec<f32>,
    ln_dy: Vec<f32>,
    dw0: Vec<f32>,
    db0: Vec<f32>,
}

fn inputs(s: Shape, seed: u64) -> Inputs {
    let mut rng = Rng(conformance::Rng::new(seed));
    let rows = s.batch * s.seq;
    let mut ik = rng.vec(rows * s.di, 1.0);
    if s.ties > 0 {
        for r in 0..rows {
            let from = r - r % s.ties;
            let row: Vec<f32> = ik[from * s.di..][..s.di].to_vec();
            ik[r * s.di..][..s.di].copy_from_slice(&row);
        }
    }
    Inputs {
        iq: rng.vec(rows * s.ni * s.di, 1.0),
        ik,
        // Equal indexer weights where keys tie, otherwise order one.
        iw: if s.ties > 0 {
            vec![0.75; rows * s.ni]
        } else {
            rng.vec(rows * s.ni, 1.0)
        },
        q: rng.vec(rows * s.heads * s.qk, 1.0),
        kv: rng.vec(rows * s.qk, 1.0),
        dout: rng.vec(rows * s.heads * s.v, 1.0),
        ln_w: rng.vec(s.di, 1.0),
        ln_b: rng.vec(s.di, 1.0),
        ln_dy: rng.vec(rows * s.di, 1.0),
        dw0: rng.vec(s.di, 1.0),
        db0: rng.vec(s.di, 1.0),
    }
}

/// A buffer of `dtype` holding `values`.
fn up<B: Backend>(b: &B, values: &[f32], dtype: DType) -> B::Buf {
    let buf = b.alloc(values.len(), dtype).expect("alloc");
    let dst = b.view_mut(&buf).expect("view");
    match dtype {
        DType::Bf16 => {
            let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
            b.upload(&v, dst).expect("upload");
        }
        _ => b.upload(values, dst).expect("upload"),
    }
    buf
}

fn up_u32<B: Backend>(b: &B, values: &[u32]) -> B::Buf {
    let buf = b.alloc(values.len(), DType::U32).expect("alloc");
    b.upload(values, b.view_mut(&buf).expect("view"))
        .expect("upload");
    buf
}

fn down<B: Backend>(b: &B, buf: &B::Buf, dtype: DType) -> Out {
    let n = b.buf_len(buf);
    let src = b.view(buf).expect("view");
    match dtype {
        DType::U32 => {
            let mut v = vec![0u32; n];
            b.download(src, &mut v).expect("download");
            Out::U(v)
        }
        DType::Bf16 => {
            let mut v = vec![bf16::ZERO; n];
            b.download(src, &mut v).expect("download");
            Out::F(v.iter().map(|x| x.to_f32()).collect(), dtype)
        }
        _ => {
            let mut v = vec![0f32; n];
            b.download(src, &mut v).expect("download");
            Out::F(v, dtype)
        }
    }
}

/// An output buffer poisoned: NaN, or for indices a value no kernel
/// writes.
fn poisoned<B: Backend>(b: &B, len: usize, dtype: DType) -> B::Buf {
    if dtype == DType::U32 {
        return up_u32(b, &vec![0xdead_beef; len]);
    }
    let buf = b.alloc(len, dtype).expect("alloc");
    b.fill(b.view_mut(&buf).expect("view"), f32::NAN)
        .expect("fill");
    buf
}

fn f32s(out: &Out) -> Vec<f32> {
    match out {
        Out::F(v, _) => v.clone(),
        Out::U(v) => panic!("expected floats, found {} indices", v.len()),
    }
}

fn u32s(out: &Out) -> Vec<u32> {
    match out {
        Out::U(v) => v.clone(),
        Out::F(..) => panic!("expected indices"),
    }
}

/// Runs every kernel of the family on `b`. With `chain`, each kernel takes
/// its inputs that another kernel makes (scores, indices, the loss's
/// gradient, the attention's out and lse) from `chain` (the CPU's), so each
/// is compared alone; without, from its own results.
fn run_family<B: Backend>(b: &B, s: Shape, x: &Inputs, a: DType, chain: Option<&Outs>) -> Outs {
    let tokens = Tokens::new(s.batch, s.seq);
    let rows = s.batch * s.seq;
    let mut outs = Outs::new();
    let idims = IndexerDims {
        tokens,
        heads: s.ni,
        head_dim: s.di,
        topk: s.topk,
        weight_scale: 1.0 / ((s.ni * s.di) as f32).sqrt(),
    };
    let (iq, ik, iw) = (up(b, &x.iq, a), up(b, &x.ik, a), up(b, &x.iw, a));
    let iview = || IndexerInputs {
        q: b.view(&iq).unwrap(),
        k: b.view(&ik).unwrap(),
        weights: b.view(&iw).unwrap(),
    };
    // Scores.
    let scores = poisoned(b, rows * s.seq, DType::F32);
    b.indexer_scores(iview(), b.view_mut(&scores).unwrap(), idims)
        .expect("indexer_scores");
    outs.insert("scores", down(b, &scores, DType::F32));
    let scores_in = match chain {
        Some(c) => up(b, &f32s(&c["scores"]), DType::F32),
        None => scores,
    };
    // Top-k.
    let indices = poisoned(b, rows * s.topk, DType::U32);
    b.indexer_topk(
        b.view(&scores_in).unwrap(),
        b.view_mut(&indices).unwrap(),
        idims,
    )
    .expect("indexer_topk");
    outs.insert("indices", down(b, &indices, DType::U32));
    let indices_in = match chain {
        Some(c) => up_u32(b, &u32s(&c["indices"])),
        None => indices,
    };
    // The loss, dense and sparse.
    let (q, kv) = (up(b, &x.q, a), up(b, &x.kv, a));
    let scale = 1.0 / (s.qk as f32).sqrt();
    for (sparse, loss_name, grad_name) in [
        (false, "loss", "d_scores"),
        (true, "loss_sparse", "d_scores_sparse"),
    ] {
        let loss = poisoned(b, rows, DType::F32);
        let d_scores = poisoned(b, rows * s.seq, DType::F32);
        b.indexer_loss(
            b.view(&scores_in).unwrap(),
            b.view(&q).unwrap(),
            b.view(&kv).unwrap(),
            b.view(&indices_in).unwrap(),
            b.view_mut(&loss).unwrap(),
            b.view_mut(&d_scores).unwrap(),
            IndexerLossDims {
                tokens,
                topk: s.topk,
                heads: s.heads,
                qk_dim: s.qk,
                scale,
                coeff: LOSS_COEFF,
                sparse,
            },
        )
        .expect("indexer_loss");
        outs.insert(loss_name, down(b, &loss, DType::F32));
        outs.insert(grad_name, down(b, &d_scores, DType::F32));
    }
    // The indexer's backward from the dense loss's gradient.
    let d_scores_in = up(
        b,
        &f32s(chain.map_or(&outs["d_scores"], |c| &c["d_scores"])),
        DType::F32,
    );
    let (dq, dk, dw) = (
        poisoned(b, rows * s.ni * s.di, a),
        poisoned(b, rows * s.di, a),
        poisoned(b, rows * s.ni, a),
    );
    b.indexer_backward(
        iview(),
        b.view(&d_scores_in).unwrap(),
        IndexerInputs {
            q: b.view_mut(&dq).unwrap(),
            k: b.view_mut(&dk).unwrap(),
            weights: b.view_mut(&dw).unwrap(),
        },
        idims,
        1.5,
    )
    .expect("indexer_backward");
    outs.insert("indexer_dq", down(b, &dq, a));
    outs.insert("indexer_dk", down(b, &dk, a));
    outs.insert("indexer_dw", down(b, &dw, a));
    // Sparse attention over the shared rows.
    let adims = SparseMqaDims {
        tokens,
        heads: s.heads,
        qk_dim: s.qk,
        v_dim: s.v,
        topk: s.topk,
        scale,
    };
    let out = poisoned(b, rows * s.heads * s.v, a);
    let lse = poisoned(b, rows * s.heads, DType::F32);
    b.sparse_mqa_forward(
        b.view(&q).unwrap(),
        b.view(&kv).unwrap(),
        b.view(&indices_in).unwrap(),
        b.view_mut(&out).unwrap(),
        b.view_mut(&lse).unwrap(),
        adims,
    )
    .expect("sparse_mqa_forward");
    outs.insert("out", down(b, &out, a));
    outs.insert("lse", down(b, &lse, DType::F32));
    let (out_in, lse_in) = match chain {
        Some(c) => (
            up(b, &f32s(&c["out"]), a),
            up(b, &f32s(&c["lse"]), DType::F32),
        ),
        None => (out, lse),
    };
    let dout = up(b, &x.dout, a);
    let (gq, gkv) = (
        poisoned(b, rows * s.heads * s.qk, a),
        poisoned(b, rows * s.qk, a),
    );
    b.sparse_mqa_backward(
        b.view(&q).unwrap(),
        b.view(&kv).unwrap(),
        b.view(&indices_in).unwrap(),
        b.view(&out_in).unwrap(),
        b.view(&lse_in).unwrap(),
        b.view(&dout).unwrap(),
        b.view_mut(&gq).unwrap(),
        b.view_mut(&gkv).unwrap(),
        adims,
    )
    .expect("sparse_mqa_backward");
    outs.insert("dq", down(b, &gq, a));
    outs.insert("dkv", down(b, &gkv, a));
    // LayerNorm over the indexer keys' rows.
    let ldims = LayerNormDims {
        rows,
        width: s.di,
        eps: 1e-5,
    };
    let (w, bias, dy) = (up(b, &x.ln_w, a), up(b, &x.ln_b, a), up(b, &x.ln_dy, a));
    let y = poisoned(b, rows * s.di, a);
    let stats = poisoned(b, rows * 2, DType::F32);
    b.layer_norm_forward(
        b.view(&ik).unwrap(),
        b.view(&w).unwrap(),
        b.view(&bias).unwrap(),
        b.view_mut(&y).unwrap(),
        b.view_mut(&stats).unwrap(),
        ldims,
    )
    .expect("layer_norm_forward");
    outs.insert("ln_y", down(b, &y, a));
    outs.insert("ln_stats", down(b, &stats, DType::F32));
    let stats_in = match chain {
        Some(c) => up(b, &f32s(&c["ln_stats"]), DType::F32),
        None => stats,
    };
    let dx = poisoned(b, rows * s.di, a);
    b.layer_norm_backward(
        b.view(&ik).unwrap(),
        b.view(&w).unwrap(),
        b.view(&stats_in).unwrap(),
        b.view(&dy).unwrap(),
        b.view_mut(&dx).unwrap(),
        ldims,
    )
    .expect("layer_norm_backward");
    outs.insert("ln_dx", down(b, &dx, a));
    // The parameter gradients accumulate onto f32 sums.
    let (gw, gb) = (up(b, &x.dw0, DType::F32), up(b, &x.db0, DType::F32));
    b.layer_norm_weight_grad(
        b.view(&ik).unwrap(),
        b.view(&stats_in).unwrap(),
        b.view(&dy).unwrap(),
        b.view_mut(&gw).unwrap(),
        b.view_mut(&gb).unwrap(),
        ldims,
    )
    .expect("layer_norm_weight_grad");
    outs.insert("ln_dw", down(b, &gw, DType::F32));
    outs.insert("ln_db", down(b, &gb, DType::F32));
    outs
}

/// `|gpu - cpu| / |cpu|` over the whole output (norms), with non-finite
/// values compared by position: a NaN where the CPU has a finite value
/// (poison left unwritten) is infinitely wrong.
fn error(gpu: &[f32], cpu: &[f32]) -> f64 {
    assert_eq!(gpu.len(), cpu.len());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        if !c.is_finite() || !g.is_finite() {
            if g.to_bits() != c.to_bits() && !(g.is_nan() && c.is_nan()) {
                return f64::INFINITY;
            }
            continue;
        }
        diff += (f64::from(g) - f64::from(c)).powi(2);
        norm += f64::from(c).powi(2);
    }
    diff.sqrt() / norm.sqrt().max(1e-30)
}

/// The indexer loss's coefficient in the kernel tests.
const LOSS_COEFF: f32 = 0.37;

/// The indexer loss's error: a row's KL is the difference of two sums of
/// terms up to `ln(keys)` in size, and for a selection close to the main
/// attention's it is far smaller than either: f32 (on the CPU or the GPU,
/// in any order) gets it right only to the rounding of those terms. So
/// the error is measured against that scale, `coeff / rows * ln(seq)` a
/// row, not against the loss itself (which would ask an f32 KL near zero
/// for digits no f32 sum has).
fn loss_error(gpu: &[f32], cpu: &[f32], seq: usize) -> f64 {
    let rows = cpu.len();
    let term = f64::from(LOSS_COEFF) / rows as f64 * (seq as f64).ln().max(1.0);
    let mut diff = 0.0f64;
    for (&g, &c) in gpu.iter().zip(cpu) {
        if !g.is_finite() || !c.is_finite() {
            return f64::INFINITY;
        }
        diff += (f64::from(g) - f64::from(c)).powi(2);
    }
    (diff / rows.max(1) as f64).sqrt() / term
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::Bf16 => 1.0 / 256.0,
        _ => 1e-5,
    }
}

/// Every kernel of every shape, in `a` storage, against the CPU.
fn family_matches_the_cpu(a: DType, precision: Precision) {
    let cuda = gpu(precision);
    let cpu = CpuBackend::new(precision);
    let mut failures = Vec::new();
    for (i, &s) in SHAPES.iter().enumerate() {
        let x = inputs(s, 0x5eed + i as u64);
        let want = run_family(&cpu, s, &x, a, None);
        let got = run_family(&cuda, s, &x, a, Some(&want));
        let again = run_family(&cuda, s, &x, a, Some(&want));
        // The GPU's top-k on its own scores too (they are the CPU's bits
        // when the scores kernel sums in the CPU's order).
        let own = run_family(&cuda, s, &x, a, None);
        let label = format!(
            "{a} b{} s{} ni{} di{} k{} h{} qk{} v{} ties{}",
            s.batch, s.seq, s.ni, s.di, s.topk, s.heads, s.qk, s.v, s.ties
        );
        for (name, w) in &want {
            let g = &got[name];
            let repeat = g.bits() == again[name].bits();
            let (err, tol, exact) = match (g, w) {
                (Out::U(gv), Out::U(wv)) => {
                    let wrong = gv.iter().zip(wv).filter(|(x, y)| x != y).count();
                    (wrong as f64, 0.0, wrong == 0)
                }
                (Out::F(gv, dt), Out::F(wv, _)) => {
                    let same = gv.iter().zip(wv).all(|(x, y)| x.to_bits() == y.to_bits());
                    let err = if name.starts_with("loss") {
                        loss_error(gv, wv, s.seq)
                    } else {
                        error(gv, wv)
                    };
                    (err, tolerance(*dt), same)
                }
                _ => panic!("{name}: kinds differ"),
            };
            let ok = err <= tol && repeat;
            println!(
                "{label:44} {name:16} err {err:9.2e} (tol {tol:.1e}) {} {}{}",
                if exact { "bit-exact" } else { "         " },
                if repeat {
                    "repeats"
                } else {
                    "DIFFERS between runs"
                },
                if ok { "" } else { "  FAIL" }
            );
            if !ok {
                failures.push(format!("{label} {name}: err {err:.3e} repeat {repeat}"));
            }
        }
        let own_indices = u32s(&own["indices"]);
        let cpu_indices = u32s(&want["indices"]);
        let wrong = own_indices
            .iter()
            .zip(&cpu_indices)
            .filter(|(x, y)| x != y)
            .count();
        println!("{label:44} top-k of the GPU's own scores: {wrong} slots differ from the CPU's");
        if wrong != 0 {
            failures.push(format!(
                "{label} top-k of the GPU's scores: {wrong} slots differ"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a GPU"]
fn sparse_attention_kernels_match_the_cpu_in_f32() {
    family_matches_the_cpu(DType::F32, Precision::F32);
}

#[test]
#[ignore = "needs a GPU"]
fn sparse_attention_kernels_match_the_cpu_in_bf16() {
    family_matches_the_cpu(DType::Bf16, Precision::Bf16);
}

/// The conformance suite's sparse attention family (its f64 references),
/// with the slack `cuda_backend` gives the other families (CUDA's expf and
/// logf are within 2 ulp of libm's).
#[test]
#[ignore = "needs a GPU"]
fn sparse_attention_conforms() {
    for precision in [Precision::F32, Precision::Bf16] {
        let backend = gpu(precision);
        let options = Options {
            slack: 2.0,
            ..Options::default()
        };
        let mut suite = conformance::Suite::new(&backend, &options);
        suite.run(conformance::Family::SparseAttention);
        let report = suite.finish();
        println!("{precision:?}:\n{report}");
        assert!(report.is_clean(), "{report}");
    }
}

/// A bf16 output of a tensor-core kernel against the CPU's: within bf16's
/// tolerance of its norm and the same bits on a rerun (`got`, `again`,
/// `want`); see [`check_output`].
fn check_bf16_output(
    label: &str,
    name: &str,
    (got, again, want): (&Out, &Out, &Out),
    failures: &mut Vec<String>,
) {
    let err = error(&f32s(got), &f32s(want));
    let repeat = got.bits() == again.bits();
    check_output(label, name, (err, tolerance(DType::Bf16)), repeat, failures);
}

/// Prints one output's comparison and adds a failure to `failures` unless
/// its error is at most `tol` and a rerun gave the same bits.
fn check_output(
    label: &str,
    name: &str,
    (err, tol): (f64, f64),
    repeat: bool,
    failures: &mut Vec<String>,
) {
    println!(
        "{label}: {name} err {err:.2e} (tol {tol:.1e}) {}",
        if repeat {
            "repeats"
        } else {
            "DIFFERS between runs"
        }
    );
    if err.is_nan() || err > tol || !repeat {
        failures.push(format!("{label} {name}: err {err:.3e} repeat {repeat}"));
    }
}

/// The shared-row attention's forward on `b` (bf16 q and kv): out (bf16)
/// and lse.
fn mqa_forward<B: Backend>(
    b: &B,
    (q, kv): (&[f32], &[f32]),
    indices: &[u32],
    dims: SparseMqaDims,
) -> (Out, Out) {
    let rows = dims.tokens.rows().unwrap();
    let (qb, kvb, ix) = (
        up(b, q, DType::Bf16),
        up(b, kv, DType::Bf16),
        up_u32(b, indices),
    );
    let out = poisoned(b, rows * dims.heads * dims.v_dim, DType::Bf16);
    let lse = poisoned(b, rows * dims.heads, DType::F32);
    b.sparse_mqa_forward(
        b.view(&qb).unwrap(),
        b.view(&kvb).unwrap(),
        b.view(&ix).unwrap(),
        b.view_mut(&out).unwrap(),
        b.view_mut(&lse).unwrap(),
        dims,
    )
    .expect("sparse_mqa_forward");
    (down(b, &out, DType::Bf16), down(b, &lse, DType::F32))
}

/// The tensor-core forward of the shared-row attention (bf16 q and kv)
/// against the CPU: DeepSeek's rows of 576 and values of 512
/// (`dsa_mqa_forward_wgmma` on Hopper, `dsa_mqa_forward_mma` elsewhere)
/// with the heads over two blocks (64 + 16, the second mostly padding) and
/// with 20 heads, selections over several key blocks and rows with fewer
/// keys than top-k; and rows of 80, values of 64 (`dsa_mqa_forward_mma`
/// everywhere: a group padded from 4 heads to 16). Within bf16's
/// tolerance, the same bits on a rerun.
#[test]
#[ignore = "needs a GPU"]
fn tensor_core_mqa_forward_matches_the_cpu() {
    let cuda = gpu(Precision::Bf16);
    let cpu = CpuBackend::new(Precision::Bf16);
    let mut failures = Vec::new();
    for (heads, seq, topk, qk, v) in [
        (80usize, 70usize, 40usize, 576usize, 512usize),
        (20, 130, 72, 576, 512),
        (20, 130, 72, 80, 64),
    ] {
        let batch = 2;
        let rows = batch * seq;
        let mut rng = Rng(conformance::Rng::new(0xa11 + heads as u64));
        let q = rng.vec(rows * heads * qk, 1.0);
        let kv = rng.vec(rows * qk, 1.0);
        let indices = every_third_key(rows, seq, topk);
        let dims = SparseMqaDims {
            tokens: Tokens::new(batch, seq),
            heads,
            qk_dim: qk,
            v_dim: v,
            topk,
            scale: 1.0 / 192f32.sqrt(),
        };
        let want = mqa_forward(&cpu, (&q, &kv), &indices, dims);
        let got = mqa_forward(&cuda, (&q, &kv), &indices, dims);
        let again = mqa_forward(&cuda, (&q, &kv), &indices, dims);
        let label = format!(
            "tensor-core MQA forward, {heads} heads of {qk} / {v}, {seq} tokens x {batch}, top {topk}"
        );
        for (name, g, a, w) in [
            ("out", &got.0, &again.0, &want.0),
            ("lse", &got.1, &again.1, &want.1),
        ] {
            check_bf16_output(&label, name, (g, a, w), &mut failures);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every third causal key of each query row from the newest, at most
/// `topk`, ascending, padded with `NO_KEY`.
fn every_third_key(rows: usize, seq: usize, topk: usize) -> Vec<u32> {
    let mut indices = vec![u32::MAX; rows * topk];
    for r in 0..rows {
        let t = r % seq;
        let mut keys: Vec<u32> = (0..=t as u32).rev().step_by(3).take(topk).collect();
        keys.sort_unstable();
        indices[r * topk..][..keys.len()].copy_from_slice(&keys);
    }
    indices
}

/// The tensor-core backward of the shared-row attention (bf16 q, kv and
/// dout, rows of 576 or 512, values 512: `dsa_mqa_backward_mma` or, on
/// Hopper from 33 heads, `dsa_mqa_backward_wgmma`, their partial key rows
/// summed by `dsa_mqa_partials_sum`) against the CPU from the same forward
/// outputs: 80 heads (a pass of 64 and one of 16), 20 (a group padded from
/// 4 heads to 16), 128 (two full passes) and 48 of 512 channels over two
/// key blocks of 64; blocks taking
/// one query and several (batch 1 of 300 tokens: 128 blocks, 2 or 3 each);
/// rows with fewer keys than top-k. dq and dkv within bf16's tolerance, the
/// same bits on a rerun; and a key selected twice is a device fault naming
/// the row.
#[test]
#[ignore = "needs a GPU"]
fn tensor_core_mqa_backward_matches_the_cpu() {
    let cuda = gpu(Precision::Bf16);
    let cpu = CpuBackend::new(Precision::Bf16);
    let mut failures = Vec::new();
    // More than 32 heads of 576 or 512 channels take the warpgroup kernel on
    // Hopper (its third warpgroup holds two of 512's eight dq atoms, and 80
    // heads make a pass of 16); the others the `mma.sync` one.
    for (heads, seq, batch, topk, qk) in [
        (80usize, 70usize, 2usize, 40usize, 576usize),
        (20, 130, 2, 72, 576),
        (128, 40, 2, 24, 576),
        (48, 260, 1, 80, 512),
        (16, 300, 1, 64, 576),
    ] {
        let v = 512;
        let rows = batch * seq;
        let mut rng = Rng(conformance::Rng::new(0xb11 + heads as u64));
        let q = rng.vec(rows * heads * qk, 1.0);
        let kv = rng.vec(rows * qk, 1.0);
        let dout = rng.vec(rows * heads * v, 1.0);
        let indices = every_third_key(rows, seq, topk);
        let dims = SparseMqaDims {
            tokens: Tokens::new(batch, seq),
            heads,
            qk_dim: qk,
            v_dim: v,
            topk,
            scale: 1.0 / 192f32.sqrt(),
        };
        // The forward once, on the CPU: both backwards read its outputs.
        let (out, lse) = mqa_forward(&cpu, (&q, &kv), &indices, dims);
        let (out, lse) = (f32s(&out), f32s(&lse));
        /// dq and dkv, launched (not read back).
        fn backward<B: Backend>(
            b: &B,
            (q, kv, dout): (&[f32], &[f32], &[f32]),
            (out, lse): (&[f32], &[f32]),
            indices: &[u32],
            dims: SparseMqaDims,
        ) -> [B::Buf; 2] {
            let rows = dims.tokens.rows().unwrap();
            let (qb, kvb, gb, ob, lb, ix) = (
                up(b, q, DType::Bf16),
                up(b, kv, DType::Bf16),
                up(b, dout, DType::Bf16),
                up(b, out, DType::Bf16),
                up(b, lse, DType::F32),
                up_u32(b, indices),
            );
            let dq = poisoned(b, rows * dims.heads * dims.qk_dim, DType::Bf16);
            let dkv = poisoned(b, rows * dims.qk_dim, DType::Bf16);
            b.sparse_mqa_backward(
                b.view(&qb).unwrap(),
                b.view(&kvb).unwrap(),
                b.view(&ix).unwrap(),
                b.view(&ob).unwrap(),
                b.view(&lb).unwrap(),
                b.view(&gb).unwrap(),
                b.view_mut(&dq).unwrap(),
                b.view_mut(&dkv).unwrap(),
                dims,
            )
            .expect("sparse_mqa_backward");
            [dq, dkv]
        }
        fn read<B: Backend>(b: &B, [dq, dkv]: [B::Buf; 2]) -> (Out, Out) {
            (down(b, &dq, DType::Bf16), down(b, &dkv, DType::Bf16))
        }
        let inputs = (&q[..], &kv[..], &dout[..]);
        let want = read(&cpu, backward(&cpu, inputs, (&out, &lse), &indices, dims));
        let got = read(&cuda, backward(&cuda, inputs, (&out, &lse), &indices, dims));
        let again = read(&cuda, backward(&cuda, inputs, (&out, &lse), &indices, dims));
        let label = format!(
            "tensor-core MQA backward, {heads} heads of {qk}, {seq} tokens x {batch}, top {topk}"
        );
        for (name, g, a, w) in [
            ("dq", &got.0, &again.0, &want.0),
            ("dkv", &got.1, &again.1, &want.1),
        ] {
            check_bf16_output(&label, name, (g, a, w), &mut failures);
        }
        // Row 21 (token 21 of the first sequence) selects one key twice.
        let mut twice = indices.clone();
        twice[21 * topk + 1] = twice[21 * topk];
        let [_, dkv] = backward(&cuda, inputs, (&out, &lse), &twice, dims);
        let mut host = vec![bf16::ZERO; cuda.buf_len(&dkv)];
        let fault = cuda.download(cuda.view(&dkv).unwrap(), &mut host);
        match fault {
            Err(e) if e.to_string().contains("query row 21 ") => {}
            other => failures.push(format!(
                "{heads} heads: a key selected twice by row 21 gave {other:?}"
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The indexer loss with its target on tensor cores (bf16 q and shared
/// rows of 576: `dsa_indexer_loss_target_mma`, then the CUDA-core kernel
/// for the KL) against the CPU, dense and sparse: 80 heads (a pass of 64
/// and one of 16), 20 (a group padded from 4 heads to 16; dense, 2 rows a
/// block), 128 (two full passes), 16 and 3 (dense, 4 rows a block, the
/// sequences' last blocks short of rows), rows of more items than a key
/// block and fewer. The loss within
/// 1e-5 of the scale of its terms (`loss_error`), the gradient within 1e-5
/// of its norm, the same bits on a rerun.
#[test]
#[ignore = "needs a GPU"]
fn tensor_core_indexer_loss_matches_the_cpu() {
    let cuda = gpu(Precision::Bf16);
    let cpu = CpuBackend::new(Precision::Bf16);
    let mut failures = Vec::new();
    for (heads, seq, batch, topk) in [
        (80usize, 70usize, 2usize, 40usize),
        (20, 130, 1, 72),
        (128, 45, 1, 24),
        (16, 67, 2, 16),
        (3, 41, 2, 8),
    ] {
        let qk = 576;
        let rows = batch * seq;
        let mut rng = Rng(conformance::Rng::new(0xc11 + heads as u64));
        let q = rng.vec(rows * heads * qk, 1.0);
        let kv = rng.vec(rows * qk, 1.0);
        let scores = rng.vec(rows * seq, 2.0);
        let indices = every_third_key(rows, seq, topk);
        for sparse in [false, true] {
            let dims = IndexerLossDims {
                tokens: Tokens::new(batch, seq),
                topk,
                heads,
                qk_dim: qk,
                scale: 1.0 / 192f32.sqrt(),
                coeff: LOSS_COEFF,
                sparse,
            };
            fn loss<B: Backend>(
                b: &B,
                (scores, q, kv): (&[f32], &[f32], &[f32]),
                indices: &[u32],
                dims: IndexerLossDims,
            ) -> (Out, Out) {
                let rows = dims.tokens.rows().unwrap();
                let (sb, qb, kvb, ix) = (
                    up(b, scores, DType::F32),
                    up(b, q, DType::Bf16),
                    up(b, kv, DType::Bf16),
                    up_u32(b, indices),
                );
                let loss = poisoned(b, rows, DType::F32);
                let d_scores = poisoned(b, rows * dims.tokens.seq, DType::F32);
                b.indexer_loss(
                    b.view(&sb).unwrap(),
                    b.view(&qb).unwrap(),
                    b.view(&kvb).unwrap(),
                    b.view(&ix).unwrap(),
                    b.view_mut(&loss).unwrap(),
                    b.view_mut(&d_scores).unwrap(),
                    dims,
                )
                .expect("indexer_loss");
                (down(b, &loss, DType::F32), down(b, &d_scores, DType::F32))
            }
            let inputs = (&scores[..], &q[..], &kv[..]);
            let want = loss(&cpu, inputs, &indices, dims);
            let got = loss(&cuda, inputs, &indices, dims);
            let again = loss(&cuda, inputs, &indices, dims);
            for (name, g, a, w) in [
                ("loss", &got.0, &again.0, &want.0),
                ("d_scores", &got.1, &again.1, &want.1),
            ] {
                let err = if name == "loss" {
                    loss_error(&f32s(g), &f32s(w), seq)
                } else {
                    error(&f32s(g), &f32s(w))
                };
                let label = format!(
                    "tensor-core indexer loss, {heads} heads, {seq} tokens x {batch}, top {topk}, \
                     sparse {sparse}"
                );
                check_output(
                    &label,
                    name,
                    (err, 1e-5),
                    g.bits() == a.bits(),
                    &mut failures,
                );
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A selected key past the sequence (forward) or selected twice by one
/// query (backward) is reported through the device fault word, naming the
/// query row, at the next host read.
#[test]
#[ignore = "needs a GPU"]
fn bad_selections_are_device_faults() {
    let b = gpu(Precision::F32);
    let s = SHAPES[0];
    let x = inputs(s, 7);
    let rows = s.batch * s.seq;
    let tokens = Tokens::new(s.batch, s.seq);
    let adims = SparseMqaDims {
        tokens,
        heads: s.heads,
        qk_dim: s.qk,
        v_dim: s.v,
        topk: s.topk,
        scale: 0.25,
    };
    // Every row selects its first min(t + 1, topk) keys.
    let good: Vec<u32> = (0..rows * s.topk)
        .map(|i| {
            let (t, slot) = ((i / s.topk) % s.seq, i % s.topk);
            if slot <= t { slot as u32 } else { u32::MAX }
        })
        .collect();
    let (q, kv) = (up(&b, &x.q, DType::F32), up(&b, &x.kv, DType::F32));
    let out = poisoned(&b, rows * s.heads * s.v, DType::F32);
    let lse = poisoned(&b, rows * s.heads, DType::F32);
    let read = |buf| {
        let mut host = vec![0f32; b.buf_len(buf)];
        b.download(b.view(buf).unwrap(), &mut host)
    };
    // Row 9's slot 2 past the sequence.
    let mut past = good.clone();
    past[9 * s.topk + 2] = s.seq as u32;
    let ix = up_u32(&b, &past);
    b.sparse_mqa_forward(
        b.view(&q).unwrap(),
        b.view(&kv).unwrap(),
        b.view(&ix).unwrap(),
        b.view_mut(&out).unwrap(),
        b.view_mut(&lse).unwrap(),
        adims,
    )
    .expect("launches");
    let err = read(&out).expect_err("a key past the sequence is a fault");
    println!("past the sequence: {err}");
    assert!(err.to_string().contains("query row 9 "), "{err}");
    // The faults are cleared once read: a good selection runs clean.
    let ix = up_u32(&b, &good);
    b.sparse_mqa_forward(
        b.view(&q).unwrap(),
        b.view(&kv).unwrap(),
        b.view(&ix).unwrap(),
        b.view_mut(&out).unwrap(),
        b.view_mut(&lse).unwrap(),
        adims,
    )
    .expect("launches");
    read(&out).expect("a good selection");
    // Row 12 (token 12, 8 keys selected) selects key 3 twice.
    let mut twice = good;
    twice[12 * s.topk + 5] = 3;
    let ix = up_u32(&b, &twice);
    let dout = up(&b, &x.dout, DType::F32);
    let grads = [
        poisoned(&b, rows * s.heads * s.qk, DType::F32),
        poisoned(&b, rows * s.qk, DType::F32),
    ];
    b.sparse_mqa_backward(
        b.view(&q).unwrap(),
        b.view(&kv).unwrap(),
        b.view(&ix).unwrap(),
        b.view(&out).unwrap(),
        b.view(&lse).unwrap(),
        b.view(&dout).unwrap(),
        b.view_mut(&grads[0]).unwrap(),
        b.view_mut(&grads[1]).unwrap(),
        adims,
    )
    .expect("launches");
    let err = read(&grads[1]).expect_err("a key selected twice is a fault");
    println!("selected twice: {err}");
    assert!(err.to_string().contains("query row 12 "), "{err}");
}

// ---- training --------------------------------------------------------------------

/// A small run of `pattern` on the tiny preset (its `[dsa]`: 2 indexer
/// heads of 16) on one rank: 40-token sequences of which each query keeps
/// 8 keys, the indexer loss on.
const INDEXER_COEFF: f32 = 0.01;
const SEQ: usize = 40;

fn config(pattern: &str, device: DeviceChoice, precision: Precision) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let dsa = model.dsa.as_mut().expect("tiny has [dsa]");
    dsa.index_topk = 8;
    dsa.indexer_loss_coeff = INDEXER_COEFF;
    let mut config = TrainConfig::new(model);
    config.device = device;
    config.precision = precision;
    config.ranks = 1;
    config.ep = 1;
    config.steps = 4;
    config.micro_batches = 2;
    config.micro_batch_size = 2;
    config.seq_length = SEQ;
    config.recompute = Recompute::None;
    config
}

/// Widens the tiny preset's latent to rows the tensor-core MQA kernels
/// take (kv_rank 64 + rope 16 = 80 channels, values 64): in bf16 its `D`
/// layers then train through `dsa_mqa_forward_mma`, `dsa_mqa_backward_mma`
/// and `dsa_indexer_loss_target_mma`.
fn tensor_core_latent(model: &mut ModelConfig) {
    let mla = model.mla.as_mut().expect("tiny has [mla]");
    mla.kv_lora_rank = 64;
    mla.qk_rope_head_dim = 16;
    let dsa = model.dsa.as_mut().expect("tiny has [dsa]");
    dsa.index_head_dim = dsa.index_head_dim.max(16);
}

fn run(config: &TrainConfig) -> (Vec<StepReport>, TrainSummary) {
    let mut reports = Vec::new();
    let summary = train(config, &mut |r| reports.push(r.clone()))
        .unwrap_or_else(|e| panic!("{} on {}: {e}", config.model.pattern, config.device));
    (reports, summary)
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// Per step the bits of the loss, the aux and indexer losses and the
/// gradient norm; then the parameter hash.
type Curve = (Vec<[u64; 4]>, u64);

fn curve(reports: &[StepReport], summary: &TrainSummary) -> Curve {
    let steps = reports
        .iter()
        .map(|r| {
            [
                r.loss.to_bits(),
                r.aux_loss.to_bits(),
                r.indexer_loss.unwrap_or(f64::NAN).to_bits(),
                r.grad_norm.to_bits(),
            ]
        })
        .collect();
    (steps, summary.param_hash)
}

#[test]
#[ignore = "needs a GPU"]
fn dsa_training_on_a_gpu_matches_the_cpu_and_overlap_equals_plain() {
    if let Err(why) = probe() {
        panic!("needs a GPU: {why}");
    }
    let mut failures = Vec::new();
    for pattern in ["[DE]-", "M[DE]"] {
        let cpu = run(&config(pattern, DeviceChoice::Cpu, Precision::F32)).0;
        let gpu = run(&config(pattern, DeviceChoice::Cuda, Precision::F32)).0;
        assert_eq!(cpu.len(), gpu.len(), "{pattern}: steps");
        for (c, g) in cpu.iter().zip(&gpu) {
            let (ci, gi) = (
                c.indexer_loss.unwrap_or(f64::NAN),
                g.indexer_loss.unwrap_or(f64::NAN),
            );
            // The indexer loss against the scale of its terms (see
            // `loss_error`): the coefficient times ln(keys).
            let ri = (gi - ci).abs() / (f64::from(INDEXER_COEFF) * (SEQ as f64).ln());
            let rl = relative(g.loss, c.loss);
            println!(
                "{pattern:8} step {}: loss cpu {:.9} gpu {:.9} (rel {rl:.1e}); indexer cpu {ci:.9e} \
                 gpu {gi:.9e} (rel {ri:.1e}); grad norm rel {:.1e}",
                c.step,
                c.loss,
                g.loss,
                relative(g.grad_norm, c.grad_norm)
            );
            if !(rl <= 1e-5 && ri <= 1e-5) {
                failures.push(format!(
                    "{pattern} step {}: loss rel {rl:.2e}, indexer loss err {ri:.2e}",
                    c.step
                ));
            }
        }
        for precision in [Precision::F32, Precision::Bf16] {
            let with = |schedule| {
                let mut c = config(pattern, DeviceChoice::Cuda, precision);
                if precision == Precision::Bf16 {
                    tensor_core_latent(&mut c.model);
                }
                c.micro_batches = 3;
                c.schedule = schedule;
                let (r, s) = run(&c);
                curve(&r, &s)
            };
            let overlap = with(ScheduleKind::Overlap);
            let plain = with(ScheduleKind::Plain);
            let again = with(ScheduleKind::Overlap);
            println!(
                "{pattern:8} {precision:?}: overlap {} plain, {} the same run again",
                if overlap == plain { "==" } else { "!=" },
                if overlap == again { "==" } else { "!=" }
            );
            if overlap != plain || overlap != again {
                failures.push(format!(
                    "{pattern} {precision:?}: overlap {overlap:?}\nplain {plain:?}\nagain {again:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- the indexer on tensor cores ---------------------------------------------------

/// A shape of the tensor-core indexer (bf16 q and k, heads a multiple of
/// 16 channels): sequences past and short of its 128-, 64- and 32-row
/// tiles, batches of 2, one head (the dk kernel's second head group idle),
/// an odd head count, DeepSeek-V3.2's 64 heads of 128, tied keys.
#[derive(Clone, Copy, Debug)]
struct IndexerShape {
    batch: usize,
    seq: usize,
    ni: usize,
    di: usize,
    topk: usize,
    /// Key rows repeat every `ties` positions (0: never).
    ties: usize,
}

const TC_SHAPES: &[IndexerShape] = &[
    IndexerShape {
        batch: 2,
        seq: 200,
        ni: 64,
        di: 128,
        topk: 64,
        ties: 0,
    },
    IndexerShape {
        batch: 1,
        seq: 301,
        ni: 3,
        di: 32,
        topk: 40,
        ties: 5,
    },
    IndexerShape {
        batch: 2,
        seq: 77,
        ni: 1,
        di: 16,
        topk: 77,
        ties: 0,
    },
    IndexerShape {
        batch: 1,
        seq: 130,
        ni: 4,
        di: 64,
        topk: 16,
        ties: 0,
    },
    IndexerShape {
        batch: 1,
        seq: 1100,
        ni: 8,
        di: 128,
        topk: 300,
        ties: 7,
    },
];

/// The tensor-core indexer's outputs on `b`: scores, the top-k of those
/// scores, and the backward (f32 gradients, so that only the kernels'
/// arithmetic is compared) from `d_scores`.
fn run_indexer<B: Backend>(
    b: &B,
    s: IndexerShape,
    (iq, ik, iw): (&[f32], &[f32], &[f32]),
    d_scores: &[f32],
) -> Outs {
    let tokens = Tokens::new(s.batch, s.seq);
    let rows = s.batch * s.seq;
    let dims = IndexerDims {
        tokens,
        heads: s.ni,
        head_dim: s.di,
        topk: s.topk,
        weight_scale: 1.0 / ((s.ni * s.di) as f32).sqrt(),
    };
    let (q, k, w) = (
        up(b, iq, DType::Bf16),
        up(b, ik, DType::Bf16),
        up(b, iw, DType::Bf16),
    );
    let inputs = || IndexerInputs {
        q: b.view(&q).unwrap(),
        k: b.view(&k).unwrap(),
        weights: b.view(&w).unwrap(),
    };
    let mut outs = Outs::new();
    let scores = poisoned(b, rows * s.seq, DType::F32);
    b.indexer_scores(inputs(), b.view_mut(&scores).unwrap(), dims)
        .expect("indexer_scores");
    let indices = poisoned(b, rows * s.topk, DType::U32);
    b.indexer_topk(
        b.view(&scores).unwrap(),
        b.view_mut(&indices).unwrap(),
        dims,
    )
    .expect("indexer_topk");
    outs.insert("scores", down(b, &scores, DType::F32));
    outs.insert("indices", down(b, &indices, DType::U32));
    let ds = up(b, d_scores, DType::F32);
    let (dq, dk, dw) = (
        poisoned(b, rows * s.ni * s.di, DType::F32),
        poisoned(b, rows * s.di, DType::F32),
        poisoned(b, rows * s.ni, DType::F32),
    );
    b.indexer_backward(
        inputs(),
        b.view(&ds).unwrap(),
        IndexerInputs {
            q: b.view_mut(&dq).unwrap(),
            k: b.view_mut(&dk).unwrap(),
            weights: b.view_mut(&dw).unwrap(),
        },
        dims,
        1.5,
    )
    .expect("indexer_backward");
    outs.insert("indexer_dq", down(b, &dq, DType::F32));
    outs.insert("indexer_dk", down(b, &dk, DType::F32));
    outs.insert("indexer_dw", down(b, &dw, DType::F32));
    outs
}

/// Each query row's score scale: `sum_h |weight_scale w[t, h]| |q[t, h]|
/// max_u |k[u]|` (Euclidean norms), which bounds `sum_h |weight_scale w|
/// sum_c |q_c k_c|` (Cauchy-Schwarz), the sum of the magnitudes of every
/// product a score adds.
fn score_scales(s: IndexerShape, (iq, ik, iw): (&[f32], &[f32], &[f32])) -> Vec<f64> {
    let ws = 1.0 / ((s.ni * s.di) as f64).sqrt();
    let norm = |x: &[f32]| x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    let mut scales = Vec::with_capacity(s.batch * s.seq);
    for b in 0..s.batch {
        let rows = b * s.seq..(b + 1) * s.seq;
        let kmax = rows
            .clone()
            .map(|r| norm(&ik[r * s.di..][..s.di]))
            .fold(0.0, f64::max);
        for r in rows {
            let sum: f64 = (0..s.ni)
                .map(|h| {
                    (ws * f64::from(iw[r * s.ni + h])).abs()
                        * norm(&iq[(r * s.ni + h) * s.di..][..s.di])
                })
                .sum();
            scales.push(sum * kmax);
        }
    }
    scales
}

/// Relative tolerance of a tensor-core score against the CPU's, as a
/// fraction of its row's scale ([`score_scales`]). Both sum the same
/// exact products (bf16 x bf16 is exact in f32) in different orders:
/// f32 rounding of a sum of n terms moves it by at most about n 2^-24 of
/// the sum of their magnitudes, n = di + ni <= 192 here (1.1e-5 at worst,
/// about sqrt(n) 2^-24 ~ 1e-6 as the roundings fall), and the rows'
/// logits cancel little. A kernel that drops a head, a channel block or a
/// key tile is off by a whole term, orders of magnitude above this.
const SCORE_TOLERANCE: f64 = 4e-6;

/// Whether `selected` (a row of the GPU's top-k) is a valid top-k of the
/// CPU's scores `cpu` (the row's causal keys 0..=t): the right count of
/// distinct causal keys in ascending order padded with `NO_KEY`, and no
/// unselected key scoring above a selected one by more than `tol` (ties
/// and near-ties, within the scores' error, may go either way).
fn valid_selection(selected: &[u32], cpu: &[f32], t: usize, tol: f64) -> Result<(), String> {
    let want = (t + 1).min(selected.len());
    let keys: Vec<usize> = selected
        .iter()
        .take_while(|&&u| u != u32::MAX)
        .map(|&u| u as usize)
        .collect();
    if keys.len() != want || selected[want..].iter().any(|&u| u != u32::MAX) {
        return Err(format!("{} keys and padding {:?}", keys.len(), selected));
    }
    if keys.windows(2).any(|p| p[0] >= p[1]) || keys.last().is_some_and(|&u| u > t) {
        return Err(format!("keys not ascending and causal: {keys:?}"));
    }
    let mut chosen = vec![false; t + 1];
    for &u in &keys {
        chosen[u] = true;
    }
    let worst_in = keys
        .iter()
        .map(|&u| f64::from(cpu[u]))
        .fold(f64::INFINITY, f64::min);
    let best_out = (0..=t)
        .filter(|&u| !chosen[u])
        .map(|u| f64::from(cpu[u]))
        .fold(f64::NEG_INFINITY, f64::max);
    if best_out > worst_in + tol {
        return Err(format!(
            "an unselected key scores {best_out} above a selected {worst_in} (tolerance {tol:.2e})"
        ));
    }
    Ok(())
}

/// The tensor-core indexer (bf16 q and k) against the CPU in bf16
/// storage: the scores within [`SCORE_TOLERANCE`] of their row's scale
/// (and exactly the CPU's -inf after each query), the top-k of the GPU's
/// own scores a valid top-k of the CPU's, the backward (f32 gradients)
/// within 2^-8 of each output's norm (the GPU rounds the gradient weights
/// P to bf16 for the second product: about 2^-9 / sqrt(3) relative in a
/// sum of terms of random sign, one part in 900; the CPU sums in f32);
/// every output the same bits on a rerun, and written whole (the outputs
/// are poisoned with NaN, the non-causal entries of d_scores are NaN and
/// must not be read).
#[test]
#[ignore = "needs a GPU"]
fn tensor_core_indexer_matches_the_cpu() {
    let cuda = gpu(Precision::Bf16);
    let cpu = CpuBackend::new(Precision::Bf16);
    let mut failures = Vec::new();
    for (i, &s) in TC_SHAPES.iter().enumerate() {
        let mut rng = Rng(conformance::Rng::new(0x7c + i as u64));
        let rows = s.batch * s.seq;
        let round = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
        };
        let mut ik = round(rng.vec(rows * s.di, 1.0));
        if s.ties > 0 {
            for r in 0..rows {
                let from = r - r % s.ties;
                let row: Vec<f32> = ik[from * s.di..][..s.di].to_vec();
                ik[r * s.di..][..s.di].copy_from_slice(&row);
            }
        }
        let iq = round(rng.vec(rows * s.ni * s.di, 1.0));
        let iw = if s.ties > 0 {
            vec![0.75; rows * s.ni]
        } else {
            round(rng.vec(rows * s.ni, 1.0))
        };
        let mut d_scores = rng.vec(rows * s.seq, 1.0);
        for r in 0..rows {
            for u in r % s.seq + 1..s.seq {
                d_scores[r * s.seq + u] = f32::NAN;
            }
        }
        let x = (&iq[..], &ik[..], &iw[..]);
        let want = run_indexer(&cpu, s, x, &d_scores);
        let got = run_indexer(&cuda, s, x, &d_scores);
        let again = run_indexer(&cuda, s, x, &d_scores);
        let label = format!(
            "b{} s{} ni{} di{} k{} ties{}",
            s.batch, s.seq, s.ni, s.di, s.topk, s.ties
        );
        for name in got.keys() {
            if got[name].bits() != again[name].bits() {
                failures.push(format!("{label} {name}: differs between runs"));
            }
        }
        // Scores: elementwise against the row's scale.
        let scales = score_scales(s, x);
        let (gs, cs) = (f32s(&got["scores"]), f32s(&want["scores"]));
        let mut worst = 0.0f64;
        for r in 0..rows {
            for u in 0..s.seq {
                let (g, c) = (gs[r * s.seq + u], cs[r * s.seq + u]);
                let err = if c.is_finite() && g.is_finite() {
                    (f64::from(g) - f64::from(c)).abs() / scales[r].max(1e-30)
                } else if g.to_bits() == c.to_bits() {
                    0.0
                } else {
                    f64::INFINITY
                };
                worst = worst.max(err);
            }
        }
        let norm_err = error(&gs, &cs);
        println!(
            "{label:32} scores: worst {worst:9.2e} of the row scale (tol {SCORE_TOLERANCE:.0e}), \
             {norm_err:9.2e} of the norm"
        );
        if worst.is_nan() || worst > SCORE_TOLERANCE {
            failures.push(format!("{label} scores: {worst:.3e} of the row scale"));
        }
        // Top-k of the GPU's own scores: valid against the CPU's scores.
        let ix = u32s(&got["indices"]);
        let mut invalid = 0;
        for r in 0..rows {
            let t = r % s.seq;
            let tol = 2.0 * SCORE_TOLERANCE * scales[r];
            if let Err(why) =
                valid_selection(&ix[r * s.topk..][..s.topk], &cs[r * s.seq..][..=t], t, tol)
            {
                if invalid == 0 {
                    failures.push(format!("{label} top-k row {r}: {why}"));
                }
                invalid += 1;
            }
        }
        let same = ix == u32s(&want["indices"]);
        println!(
            "{label:32} top-k of the GPU's scores: {invalid} rows invalid{}",
            if same { ", every slot the CPU's" } else { "" }
        );
        if invalid > 0 {
            failures.push(format!("{label} top-k: {invalid} rows invalid"));
        }
        for name in ["indexer_dq", "indexer_dk", "indexer_dw"] {
            let err = error(&f32s(&got[name]), &f32s(&want[name]));
            let tol = 1.0 / 256.0;
            println!("{label:32} {name:12} err {err:9.2e} (tol {tol:.1e})");
            if err.is_nan() || err > tol {
                failures.push(format!("{label} {name}: err {err:.3e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

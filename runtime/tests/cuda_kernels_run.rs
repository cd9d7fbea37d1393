//! The CUDA kernels on a GPU against the CPU backend's kernels.
//!
//! Every kernel the CUDA sources implement runs on random order-one inputs
//! at odd sizes (none a multiple of a block or a warp), once in f32 and once
//! with bf16 activations (bf16 in, f32 accumulators where the runtime uses
//! them), for the Hopper cubin and for the portable PTX. Each case runs
//! twice on the GPU from the same inputs, and must give the same bits; its
//! outputs must match the CPU backend's within the tolerance of their dtype:
//!
//! - f32 and f64 outputs: `|gpu - cpu| / |cpu| <= 1e-5` (norms over the
//!   whole output); u32 outputs (selections, counts, permutations): equal.
//! - bf16 outputs: `<= 2^-8` (both sides compute in f32 and round once at
//!   the store; where their f32 results differ in the last bits, a value can
//!   round to the neighbouring bf16).
//!
//! Kernels that find a bad index report it through the device fault word:
//! a case with a bad target and one with a bad row index check that too.
//!
//! One test a kernel family, each `#[ignore]`d: it is built on a machine
//! without CUDA and run on one with it with `--include-ignored`
//! (`cargo test --release --no-run -p hybridgen-runtime --test cuda_kernels_run`
//! names the binary); without a GPU it fails, saying why. Each prints a
//! table of its cases last.

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use hybridgen_dsl::config::ScoreFunction;
use hybridgen_runtime::backend::{
    AdamMoments, AdamStep, AttentionInputs, AuxLossDims, CopyCols, ExpertBias, ExpertOrder,
    IGNORE_TARGET, LossDims, MlaKvDims, NormDims, QkvDims, ReceivedDims, RotaryDims, RotaryPairing,
    RouteDims, RouteOutputs, RoutedSlots, RouterScores, SgdStep, Tokens, Unary, UnpermuteDims,
    UnpermuteGrads,
};
use hybridgen_runtime::cpu::{CpuBackend, CpuBuf};
use hybridgen_runtime::cuda::kernels::{self, Target};
use hybridgen_runtime::cuda::ops::attention_flash::flash_attention_scratch_len;
use hybridgen_runtime::cuda::ops::lookup::EMBEDDING_BACKWARD_SCRATCH_PER_ROW;
use hybridgen_runtime::cuda::{GpuView, KernelSet, probe};
use hybridgen_runtime::view::{DType, View, ViewMut};
use hybridgen_runtime::{Backend, Precision, Result};
use std::sync::Arc;
use std::time::Instant;

// ---- host data ------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Host {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F64(Vec<f64>),
    U32(Vec<u32>),
}

impl Host {
    fn dtype(&self) -> DType {
        match self {
            Host::F32(_) => DType::F32,
            Host::Bf16(_) => DType::Bf16,
            Host::F64(_) => DType::F64,
            Host::U32(_) => DType::U32,
        }
    }

    fn len(&self) -> usize {
        match self {
            Host::F32(v) => v.len(),
            Host::Bf16(v) => v.len(),
            Host::F64(v) => v.len(),
            Host::U32(v) => v.len(),
        }
    }

    fn values(&self) -> Vec<f64> {
        match self {
            Host::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Host::Bf16(v) => v.iter().map(|&x| f64::from(x.to_f32())).collect(),
            Host::F64(v) => v.clone(),
            Host::U32(v) => v.iter().map(|&x| f64::from(x)).collect(),
        }
    }

    fn bits(&self) -> Vec<u64> {
        match self {
            Host::F32(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            Host::Bf16(v) => v.iter().map(|x| u64::from(x.to_bits())).collect(),
            Host::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
            Host::U32(v) => v.iter().map(|&x| u64::from(x)).collect(),
        }
    }

    /// `values` stored as `dtype` (a float dtype).
    fn floats(values: Vec<f32>, dtype: DType) -> Host {
        match dtype {
            DType::Bf16 => Host::Bf16(values.into_iter().map(bf16::from_f32).collect()),
            DType::F64 => Host::F64(values.into_iter().map(f64::from).collect()),
            _ => Host::F32(values),
        }
    }
}

/// splitmix64: a seed always gives the same inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `[-scale, scale)`.
    fn sym(&mut self, scale: f32) -> f32 {
        ((self.unit() * 2.0 - 1.0) * f64::from(scale)) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(scale)).collect()
    }
    fn floats(&mut self, n: usize, dtype: DType) -> Host {
        Host::floats(self.vec(n, 2.0), dtype)
    }
    fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
    /// `k` distinct experts of `e` for each of `rows` tokens.
    fn routing(&mut self, rows: usize, e: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(rows * k);
        for _ in 0..rows {
            let p = self.permutation(e);
            out.extend_from_slice(&p[..k]);
        }
        out
    }
}

fn nan(n: usize, dtype: DType) -> Host {
    Host::floats(vec![f32::NAN; n], dtype)
}

// ---- the two devices -----------------------------------------------------------

enum GpuBuf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
    F64(CudaSlice<f64>),
    U32(CudaSlice<u32>),
}

struct Gpu {
    stream: Arc<CudaStream>,
}

impl Gpu {
    fn upload(&self, h: &Host) -> GpuBuf {
        // An empty host vector still gets a (one-element) allocation.
        let s = &self.stream;
        match h {
            Host::F32(v) => GpuBuf::F32(s.clone_htod(&pad(v)).expect("upload")),
            Host::Bf16(v) => GpuBuf::Bf16(s.clone_htod(&pad(v)).expect("upload")),
            Host::F64(v) => GpuBuf::F64(s.clone_htod(&pad(v)).expect("upload")),
            Host::U32(v) => GpuBuf::U32(s.clone_htod(&pad(v)).expect("upload")),
        }
    }

    fn view(&self, b: &GpuBuf, h: &Host) -> GpuView {
        let s = &self.stream;
        let ptr = match b {
            GpuBuf::F32(x) => x.device_ptr(s).0,
            GpuBuf::Bf16(x) => x.device_ptr(s).0,
            GpuBuf::F64(x) => x.device_ptr(s).0,
            GpuBuf::U32(x) => x.device_ptr(s).0,
        };
        GpuView::new(ptr, h.len(), h.dtype())
    }

    fn download(&self, b: &GpuBuf, len: usize) -> Host {
        let s = &self.stream;
        match b {
            GpuBuf::F32(x) => Host::F32(s.clone_dtoh(x).expect("download")[..len].to_vec()),
            GpuBuf::Bf16(x) => Host::Bf16(s.clone_dtoh(x).expect("download")[..len].to_vec()),
            GpuBuf::F64(x) => Host::F64(s.clone_dtoh(x).expect("download")[..len].to_vec()),
            GpuBuf::U32(x) => Host::U32(s.clone_dtoh(x).expect("download")[..len].to_vec()),
        }
    }
}

fn pad<T: Copy + Default>(v: &[T]) -> Vec<T> {
    if v.is_empty() {
        vec![T::default()]
    } else {
        v.to_vec()
    }
}

fn cpu_upload(b: &CpuBackend, h: &Host) -> CpuBuf {
    let buf = b.alloc(h.len(), h.dtype()).expect("alloc");
    let dst = ViewMut::whole(&buf);
    match h {
        Host::F32(v) => b.upload(v, dst),
        Host::Bf16(v) => b.upload(v, dst),
        Host::F64(v) => b.upload(v, dst),
        Host::U32(v) => b.upload(v, dst),
    }
    .expect("upload");
    buf
}

fn cpu_download(b: &CpuBackend, buf: &CpuBuf, like: &Host) -> Host {
    let src = View::whole(buf);
    let n = like.len();
    match like {
        Host::F32(_) => {
            let mut v = vec![0.0f32; n];
            b.download(src, &mut v).expect("download");
            Host::F32(v)
        }
        Host::Bf16(_) => {
            let mut v = vec![bf16::ZERO; n];
            b.download(src, &mut v).expect("download");
            Host::Bf16(v)
        }
        Host::F64(_) => {
            let mut v = vec![0.0f64; n];
            b.download(src, &mut v).expect("download");
            Host::F64(v)
        }
        Host::U32(_) => {
            let mut v = vec![0u32; n];
            b.download(src, &mut v).expect("download");
            Host::U32(v)
        }
    }
}

// ---- cases ------------------------------------------------------------------------

type CpuRun<'a> = Box<dyn Fn(&CpuBackend, &[CpuBuf]) -> Result<()> + 'a>;
type GpuRun<'a> = Box<dyn Fn(&KernelSet, &CudaStream, &[GpuView]) -> Result<()> + 'a>;
/// Expected outputs computed in f64 from the inputs.
type Reference = fn(&[Host]) -> Vec<Host>;

struct Case<'a> {
    kernel: String,
    mode: &'static str,
    shape: String,
    buffers: Vec<Host>,
    /// Which buffers are compared after the run.
    outputs: Vec<usize>,
    cpu: CpuRun<'a>,
    gpu: GpuRun<'a>,
    /// Where the CPU kernel's own f32 rounding exceeds the tolerance (a
    /// long sequential f32 sum), the GPU is checked against an f64
    /// reference instead, and the CPU's distance from it is shown.
    reference: Option<Reference>,
}

fn v(b: &CpuBuf) -> View<'_, CpuBuf> {
    View::whole(b)
}
fn m(b: &CpuBuf) -> ViewMut<'_, CpuBuf> {
    ViewMut::whole(b)
}

/// One line of the table.
struct Row {
    target: Target,
    kernel: String,
    mode: &'static str,
    shape: String,
    error: f64,
    max_abs: f64,
    tolerance: f64,
    repeatable: bool,
    problem: Option<String>,
    note: String,
}

impl Row {
    fn passed(&self) -> bool {
        self.problem.is_none() && self.repeatable && self.error <= self.tolerance
    }
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::Bf16 => 1.0 / 256.0,
        DType::U32 => 0.0,
        _ => 1e-5,
    }
}

/// The name ending of cases whose kernels multiply in bf16 on tensor cores
/// (operands rounded to bf16 inside the kernel, not only at the output),
/// held to [`BF16_PRODUCTS_TOLERANCE`] in every output, f32 ones included.
const BF16_PRODUCTS: &str = " (bf16 products)";

/// flash-linear-attention holds its bf16 `chunk_gated_delta_rule` to an
/// error ratio (the relative L2 error used here) of 5e-3 for o and 8e-3 for
/// dq, dk and dv against an f32 reference. Here each product rounds its
/// operands to bf16 (relative error up to 2^-9 each: the normalised q and k,
/// T, W, U, the state, V' and the scores) and the errors of chained
/// products add: 1e-2, 2.5 times the tolerance of one bf16 rounding.
const BF16_PRODUCTS_TOLERANCE: f64 = 1e-2;

/// The backward's: flash-linear-attention holds the gates' gradients (beta's
/// and g's, sums over a chunk of terms that cancel) to 2e-2, and so are all
/// the gradients here (beta's, alpha's and A_log's are those sums).
const BF16_PRODUCTS_GRAD_TOLERANCE: f64 = 2e-2;

/// The name ending of cases held to their reference's bits (tolerance 0).
const EXACT: &str = " (exact)";

/// The tolerance of output `i` of `case`.
fn case_tolerance(case: &Case<'_>, i: usize) -> f64 {
    if case.kernel.ends_with(EXACT) {
        0.0
    } else if !case.kernel.ends_with(BF16_PRODUCTS) {
        tolerance(case.buffers[i].dtype())
    } else if case.kernel.contains("backward") {
        BF16_PRODUCTS_GRAD_TOLERANCE
    } else {
        BF16_PRODUCTS_TOLERANCE
    }
}

/// `(|a - b| / |b|, max |a - b|)` with NaN where either has one the other
/// has not (an unwritten or broken output).
fn compare(gpu: &Host, cpu: &Host) -> (f64, f64) {
    let (a, b) = (gpu.values(), cpu.values());
    if gpu.dtype() == DType::U32 {
        let wrong = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        return (wrong as f64, if wrong > 0 { 1.0 } else { 0.0 });
    }
    let (mut diff, mut norm, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(&b) {
        if x.is_nan() != y.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        if x.is_nan() {
            continue;
        }
        diff += (x - y) * (x - y);
        norm += y * y;
        max_abs = max_abs.max((x - y).abs());
    }
    let rel = if norm > 0.0 {
        (diff / norm).sqrt()
    } else {
        diff.sqrt()
    };
    (rel, max_abs)
}

fn run_case(gpu: &Gpu, set: &KernelSet, case: &Case<'_>) -> Row {
    let mut row = Row {
        target: set.target(),
        kernel: case.kernel.clone(),
        mode: case.mode,
        shape: case.shape.clone(),
        error: 0.0,
        max_abs: 0.0,
        tolerance: case
            .outputs
            .iter()
            .map(|&i| case_tolerance(case, i))
            .fold(f64::INFINITY, f64::min),
        repeatable: true,
        problem: None,
        note: String::new(),
    };
    let cpu = CpuBackend::new(Precision::F32);
    let cpu_bufs: Vec<CpuBuf> = case.buffers.iter().map(|h| cpu_upload(&cpu, h)).collect();
    if let Err(e) = (case.cpu)(&cpu, &cpu_bufs) {
        row.problem = Some(format!("CPU refused: {e}"));
        return row;
    }
    let mut expected: Vec<Host> = case
        .outputs
        .iter()
        .map(|&i| cpu_download(&cpu, &cpu_bufs[i], &case.buffers[i]))
        .collect();
    if let Some(reference) = case.reference {
        let exact = reference(&case.buffers);
        let cpu_error = expected
            .iter()
            .zip(&exact)
            .map(|(c, e)| compare(c, e).0)
            .fold(0.0f64, f64::max);
        row.note = format!("vs f64; CPU vs f64 {cpu_error:.1e}");
        expected = exact;
    }
    let mut runs = Vec::new();
    for _ in 0..2 {
        let bufs: Vec<GpuBuf> = case.buffers.iter().map(|h| gpu.upload(h)).collect();
        let views: Vec<GpuView> = bufs
            .iter()
            .zip(&case.buffers)
            .map(|(b, h)| gpu.view(b, h))
            .collect();
        if let Err(e) = (case.gpu)(set, &gpu.stream, &views) {
            row.problem = Some(format!("GPU refused: {e}"));
            return row;
        }
        if let Err(e) = gpu.stream.synchronize() {
            row.problem = Some(format!("GPU failed: {e}"));
            return row;
        }
        match set.take_fault(&gpu.stream) {
            Ok(None) => {}
            Ok(Some(fault)) => {
                row.problem = Some(format!("device fault: {fault}"));
                return row;
            }
            Err(e) => {
                row.problem = Some(format!("GPU failed: {e}"));
                return row;
            }
        }
        let outs: Vec<Host> = case
            .outputs
            .iter()
            .map(|&i| gpu.download(&bufs[i], case.buffers[i].len()))
            .collect();
        runs.push(outs);
    }
    row.repeatable = runs[0]
        .iter()
        .zip(&runs[1])
        .all(|(a, b)| a.bits() == b.bits());
    // Report the output furthest past its tolerance.
    let mut worst = -1.0f64;
    let mut worst_at = 0;
    for (k, ((got, want), &i)) in runs[0].iter().zip(&expected).zip(&case.outputs).enumerate() {
        let (rel, max_abs) = compare(got, want);
        let tol = case_tolerance(case, i);
        let rel = if rel.is_nan() { f64::INFINITY } else { rel };
        let ratio = if rel == 0.0 {
            0.0
        } else if tol == 0.0 {
            f64::INFINITY
        } else {
            rel / tol
        };
        if ratio > worst {
            worst = ratio;
            worst_at = k;
            row.error = rel;
            row.tolerance = tol;
        }
        row.max_abs = row.max_abs.max(if max_abs.is_nan() {
            f64::INFINITY
        } else {
            max_abs
        });
    }
    // Which output the row's error is, where there are several (by
    // position among the case's outputs).
    if case.outputs.len() > 1 {
        row.note = format!("output {worst_at} of {}; {}", case.outputs.len(), row.note);
    }
    row
}

/// The activation dtypes of a mode.
const MODES: [(&str, DType); 2] = [("f32", DType::F32), ("bf16", DType::Bf16)];

/// `moe_unpermute` over `rows` (`[d.rows, d.width]`), with the slots'
/// weights (used where `weighted`) and positions.
fn unpermute_case(
    mode: &'static str,
    d: UnpermuteDims,
    weighted: bool,
    rows: Host,
    (weights, positions): (Host, Host),
) -> Case<'static> {
    let a = rows.dtype();
    Case {
        kernel: "moe_unpermute".into(),
        mode,
        shape: format!(
            "{}x{} {}{}",
            d.tokens,
            d.top_k,
            d.width,
            if weighted { " weighted" } else { "" }
        ),
        buffers: vec![rows, weights, positions, nan(d.tokens * d.width, a)],
        outputs: vec![3],
        cpu: Box::new(move |b, x| {
            let w = weighted.then(|| v(&x[1]));
            b.moe_unpermute(v(&x[0]), w, v(&x[2]), m(&x[3]), d)
        }),
        gpu: Box::new(move |s, st, x| {
            s.moe_unpermute(st, x[0], weighted.then_some(x[1]), x[2], x[3], d)
        }),
        reference: None,
    }
}

/// `moe_unpermute_backward` of `dout` (`[d.tokens, d.width]`) against
/// `rows` (`[d.rows, d.width]`), with the slots' weights and positions.
fn unpermute_backward_case(
    mode: &'static str,
    d: UnpermuteDims,
    dout: Host,
    rows: Host,
    (weights, positions): (Host, Host),
) -> Case<'static> {
    let a = rows.dtype();
    Case {
        kernel: "moe_unpermute_backward".into(),
        mode,
        shape: format!("{}x{} {}", d.tokens, d.top_k, d.width),
        buffers: vec![
            dout,
            rows,
            weights,
            positions,
            nan(d.rows * d.width, a),
            nan(d.rows, DType::F32),
        ],
        outputs: vec![4, 5],
        cpu: Box::new(move |b, x| {
            let grads = UnpermuteGrads {
                rows: m(&x[4]),
                weights: m(&x[5]),
            };
            b.moe_unpermute_backward(v(&x[0]), v(&x[1]), v(&x[2]), v(&x[3]), grads, d)
        }),
        gpu: Box::new(move |s, st, x| {
            s.moe_unpermute_backward(st, x[0], x[1], x[2], x[3], x[4], x[5], d)
        }),
        reference: None,
    }
}

fn all_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed);
    let mut cases: Vec<Case<'static>> = Vec::new();

    // Casts and fills.
    for (from, to) in [
        (DType::F32, DType::Bf16),
        (DType::Bf16, DType::F32),
        (DType::F64, DType::Bf16),
        (DType::F64, DType::F32),
        (DType::F32, DType::F64),
    ] {
        let n = 100_003;
        cases.push(Case {
            kernel: "cast".into(),
            mode: "-",
            shape: format!("{n} {from}->{to}"),
            buffers: vec![rng.floats(n, from), nan(n, to)],
            outputs: vec![1],
            cpu: Box::new(|b, x| b.cast(v(&x[0]), m(&x[1]))),
            gpu: Box::new(|s, st, x| s.cast(st, x[0], x[1])),
            reference: None,
        });
    }
    for dtype in [DType::F32, DType::Bf16, DType::F64] {
        let n = 70_001;
        cases.push(Case {
            kernel: "fill".into(),
            mode: "-",
            shape: format!("{n} {dtype}"),
            buffers: vec![nan(n, dtype)],
            outputs: vec![0],
            cpu: Box::new(|b, x| b.fill(m(&x[0]), 0.1234567)),
            gpu: Box::new(|s, st, x| s.fill(st, x[0], 0.1234567)),
            reference: None,
        });
    }

    for (mode, a) in MODES {
        // Dense element-wise and sums.
        for n in [1usize, 33, 100_003] {
            cases.push(Case {
                kernel: "axpy".into(),
                mode,
                shape: format!("{n} into f32"),
                buffers: vec![rng.floats(n, a), rng.floats(n, DType::F32)],
                outputs: vec![1],
                cpu: Box::new(|b, x| b.axpy(-0.75, v(&x[0]), m(&x[1]))),
                gpu: Box::new(|s, st, x| s.axpy(st, -0.75, x[0], x[1])),
                reference: None,
            });
        }
        cases.push(Case {
            kernel: "axpy".into(),
            mode,
            shape: format!("100003 into {a}"),
            buffers: vec![rng.floats(100_003, a), rng.floats(100_003, a)],
            outputs: vec![1],
            cpu: Box::new(|b, x| b.axpy(1.5, v(&x[0]), m(&x[1]))),
            gpu: Box::new(|s, st, x| s.axpy(st, 1.5, x[0], x[1])),
            reference: None,
        });
        cases.push(Case {
            kernel: "scale".into(),
            mode,
            shape: "100003".into(),
            buffers: vec![rng.floats(100_003, a)],
            outputs: vec![0],
            cpu: Box::new(|b, x| b.scale(m(&x[0]), 0.3)),
            gpu: Box::new(|s, st, x| s.scale(st, x[0], 0.3)),
            reference: None,
        });
        for accumulate in [false, true] {
            let d = CopyCols {
                rows: 301,
                cols: 37,
                src_stride: 101,
                src_offset: 13,
                dst_stride: 50,
                dst_offset: 11,
                accumulate,
            };
            cases.push(Case {
                kernel: "copy_cols".into(),
                mode,
                shape: format!("301x37{}", if accumulate { " +=" } else { "" }),
                buffers: vec![rng.floats(301 * 101, a), rng.floats(301 * 50, a)],
                outputs: vec![1],
                cpu: Box::new(move |b, x| b.copy_cols(v(&x[0]), m(&x[1]), d)),
                gpu: Box::new(move |s, st, x| s.copy_cols(st, x[0], x[1], d)),
                reference: None,
            });
        }
        for (rows, cols) in [(1001usize, 77usize), (5, 1999)] {
            cases.push(Case {
                kernel: "column_sum".into(),
                mode,
                shape: format!("{rows}x{cols} into f32"),
                buffers: vec![rng.floats(rows * cols, a), rng.floats(cols, DType::F32)],
                outputs: vec![1],
                cpu: Box::new(move |b, x| b.column_sum(v(&x[0]), m(&x[1]), rows, cols)),
                gpu: Box::new(move |s, st, x| s.column_sum(st, x[0], x[1], rows, cols)),
                reference: None,
            });
        }
        for n in [1usize, 16_385] {
            cases.push(Case {
                kernel: "accumulate_sum".into(),
                mode,
                shape: format!("{n}"),
                buffers: vec![rng.floats(n, a), Host::F64(vec![3.25])],
                outputs: vec![1],
                cpu: Box::new(|b, x| b.accumulate_sum(v(&x[0]), m(&x[1]))),
                gpu: Box::new(|s, st, x| s.accumulate_sum(st, x[0], x[1])),
                reference: None,
            });
        }

        // RMSNorm; 1,300 rows take the weight gradient's sums in 82 slices;
        // groups of 136 channels take the two-pass 8-channel words, groups
        // of 1,024, 2,048 and 512 (the benchmark's pre-norm and Mamba's
        // gated norm) the one-pass backward.
        for (rows, dim, groups) in [
            (257usize, 771usize, 1usize),
            (33, 771, 3),
            (7, 4100, 1),
            (1300, 272, 2),
            (65, 1024, 1),
            (300, 2048, 1),
            (40, 4096, 8),
        ] {
            let d = NormDims {
                rows,
                dim,
                groups,
                eps: 1e-5,
            };
            let shape = format!("{rows}x{dim}/{groups}");
            let w = rng.floats(dim, a);
            let x = rng.floats(rows * dim, a);
            cases.push(rmsnorm_forward_case(mode, d, x.clone(), w.clone(), None));
            let rstd = Host::F32(
                (0..rows * groups)
                    .map(|_| 0.5 + rng.unit() as f32)
                    .collect(),
            );
            cases.push(Case {
                kernel: "rmsnorm_backward_input".into(),
                mode,
                shape: shape.clone(),
                buffers: vec![
                    rng.floats(rows * dim, a),
                    x.clone(),
                    w.clone(),
                    rstd.clone(),
                    rng.floats(rows * dim, a),
                    nan(d.weight_partials_len(), DType::F32),
                ],
                outputs: vec![4, 5],
                cpu: Box::new(move |b, x| {
                    b.rmsnorm_backward_input(
                        v(&x[0]),
                        v(&x[1]),
                        v(&x[2]),
                        v(&x[3]),
                        m(&x[4]),
                        None,
                        m(&x[5]),
                        d,
                    )
                }),
                gpu: Box::new(move |s, st, x| {
                    s.rmsnorm_backward_input(st, x[0], x[1], x[2], x[3], x[4], None, x[5], d)
                }),
                reference: None,
            });
            cases.push(Case {
                kernel: "rmsnorm_backward_weight".into(),
                mode,
                shape: format!("{shape} into f32"),
                buffers: vec![
                    rng.floats(d.weight_partials_len(), DType::F32),
                    rng.floats(dim, DType::F32),
                ],
                outputs: vec![1],
                cpu: Box::new(move |b, x| b.rmsnorm_backward_weight(v(&x[0]), m(&x[1]), d)),
                gpu: Box::new(move |s, st, x| s.rmsnorm_backward_weight(st, x[0], x[1], d)),
                reference: None,
            });
        }

        // Activations: an odd length, and one of whole 8-element words (bf16
        // takes the 8-element kernels).
        for (n, op) in [65_537, 65_536]
            .into_iter()
            .flat_map(|n| [Unary::Silu, Unary::Gelu, Unary::SquaredRelu].map(|op| (n, op)))
        {
            cases.push(Case {
                kernel: format!("unary_forward {op:?}"),
                mode,
                shape: format!("{n}"),
                buffers: vec![Host::floats(rng.vec(n, 4.0), a), nan(n, a)],
                outputs: vec![1],
                cpu: Box::new(move |b, x| b.unary_forward(op, v(&x[0]), m(&x[1]))),
                gpu: Box::new(move |s, st, x| s.unary_forward(st, op, x[0], x[1])),
                reference: None,
            });
            // The recomputing form ends with f(x) in the gradient's buffer.
            for recompute in [false, true] {
                let name = if recompute {
                    "unary_backward_recompute"
                } else {
                    "unary_backward"
                };
                cases.push(Case {
                    kernel: format!("{name} {op:?}"),
                    mode,
                    shape: format!("{n}"),
                    buffers: vec![
                        Host::floats(rng.vec(n, 4.0), a),
                        rng.floats(n, a),
                        nan(n, a),
                    ],
                    outputs: if recompute { vec![1, 2] } else { vec![2] },
                    cpu: Box::new(move |b, x| {
                        if recompute {
                            b.unary_backward_recompute(op, v(&x[0]), m(&x[1]), m(&x[2]))
                        } else {
                            b.unary_backward(op, v(&x[0]), v(&x[1]), m(&x[2]))
                        }
                    }),
                    gpu: Box::new(move |s, st, x| {
                        s.unary_backward(st, op, x[0], x[1], x[2], recompute.then_some(x[1]))
                    }),
                    reference: None,
                });
            }
        }
        // Odd, and whole 8-element words (bf16 takes the 8-element kernels).
        for n in [65_537usize, 65_536] {
            cases.push(Case {
                kernel: "silu_mul_forward".into(),
                mode,
                shape: format!("{n}"),
                buffers: vec![rng.floats(n, a), rng.floats(n, a), nan(n, a)],
                outputs: vec![2],
                cpu: Box::new(|b, x| b.silu_mul_forward(v(&x[0]), v(&x[1]), m(&x[2]))),
                gpu: Box::new(|s, st, x| s.silu_mul_forward(st, x[0], x[1], x[2])),
                reference: None,
            });
            for recompute in [false, true] {
                let name = if recompute {
                    "silu_mul_backward_recompute"
                } else {
                    "silu_mul_backward"
                };
                cases.push(Case {
                    kernel: name.into(),
                    mode,
                    shape: format!("{n}"),
                    buffers: vec![
                        rng.floats(n, a),
                        rng.floats(n, a),
                        rng.floats(n, a),
                        nan(n, a),
                        nan(n, a),
                    ],
                    outputs: if recompute { vec![2, 3, 4] } else { vec![3, 4] },
                    cpu: Box::new(move |b, x| {
                        let (gate, up, dgate, dup) = (v(&x[0]), v(&x[1]), m(&x[3]), m(&x[4]));
                        if recompute {
                            b.silu_mul_backward_recompute(gate, up, m(&x[2]), dgate, dup)
                        } else {
                            b.silu_mul_backward(gate, up, v(&x[2]), dgate, dup)
                        }
                    }),
                    gpu: Box::new(move |s, st, x| {
                        let y = recompute.then_some(x[2]);
                        s.silu_mul_backward(st, x[0], x[1], x[2], x[3], x[4], y)
                    }),
                    reference: None,
                });
            }
        }

        // Rotary.
        let d = RotaryDims {
            tokens: Tokens::new(3, 67),
            heads: 5,
            head_stride: 48,
            offset: 8,
            dim: 32,
            base: 10_000.0,
            pairing: RotaryPairing::RotateHalf,
        };
        let len = 3 * 67 * 5 * 48;
        cases.push(Case {
            kernel: "rotary_forward".into(),
            mode,
            shape: "3x67 5h 32/48".into(),
            buffers: vec![rng.floats(len, a)],
            outputs: vec![0],
            cpu: Box::new(move |b, x| b.rotary_forward(m(&x[0]), d)),
            gpu: Box::new(move |s, st, x| s.rotary_forward(st, x[0], d)),
            reference: None,
        });
        cases.push(Case {
            kernel: "rotary_backward".into(),
            mode,
            shape: "3x67 5h 32/48".into(),
            buffers: vec![rng.floats(len, a)],
            outputs: vec![0],
            cpu: Box::new(move |b, x| b.rotary_backward(m(&x[0]), d)),
            gpu: Box::new(move |s, st, x| s.rotary_backward(st, x[0], d)),
            reference: None,
        });
        // MLA's interleaved pairs.
        let d = RotaryDims {
            pairing: RotaryPairing::Interleaved,
            ..d
        };
        for backward in [false, true] {
            cases.push(Case {
                kernel: if backward {
                    "rotary_backward"
                } else {
                    "rotary_forward"
                }
                .into(),
                mode,
                shape: "3x67 5h 32/48 interleaved".into(),
                buffers: vec![rng.floats(len, a)],
                outputs: vec![0],
                cpu: Box::new(move |b, x| {
                    if backward {
                        b.rotary_backward(m(&x[0]), d)
                    } else {
                        b.rotary_forward(m(&x[0]), d)
                    }
                }),
                gpu: Box::new(move |s, st, x| {
                    if backward {
                        s.rotary_backward(st, x[0], d)
                    } else {
                        s.rotary_forward(st, x[0], d)
                    }
                }),
                reference: None,
            });
        }

        // Head splits.
        let d = QkvDims {
            rows: 131,
            groups: 3,
            heads_per_group: 2,
            head_dim: 24,
        };
        let (q_len, kv_len) = (131 * 6 * 24, 131 * 3 * 24);
        cases.push(Case {
            kernel: "qkv_split".into(),
            mode,
            shape: "131 3g 2h 24".into(),
            buffers: vec![
                rng.floats(131 * d.width(), a),
                nan(q_len, a),
                nan(kv_len, a),
                nan(kv_len, a),
            ],
            outputs: vec![1, 2, 3],
            cpu: Box::new(move |b, x| {
                b.qkv_split(
                    v(&x[0]),
                    AttentionInputs {
                        q: m(&x[1]),
                        k: m(&x[2]),
                        v: m(&x[3]),
                    },
                    d,
                )
            }),
            gpu: Box::new(move |s, st, x| s.qkv_split(st, x[0], x[1], x[2], x[3], d)),
            reference: None,
        });
        cases.push(Case {
            kernel: "qkv_join".into(),
            mode,
            shape: "131 3g 2h 24".into(),
            buffers: vec![
                rng.floats(q_len, a),
                rng.floats(kv_len, a),
                rng.floats(kv_len, a),
                nan(131 * d.width(), a),
            ],
            outputs: vec![3],
            cpu: Box::new(move |b, x| {
                b.qkv_join(
                    AttentionInputs {
                        q: v(&x[0]),
                        k: v(&x[1]),
                        v: v(&x[2]),
                    },
                    m(&x[3]),
                    d,
                )
            }),
            gpu: Box::new(move |s, st, x| s.qkv_join(st, x[0], x[1], x[2], x[3], d)),
            reference: None,
        });
        let d = MlaKvDims {
            rows: 97,
            heads: 5,
            nope_dim: 12,
            rope_dim: 8,
            v_dim: 10,
        };
        let (kv_n, rope_n, k_n, v_n) = (97 * 5 * 22, 97 * 8, 97 * 5 * 20, 97 * 5 * 10);
        cases.push(Case {
            kernel: "mla_kv_split".into(),
            mode,
            shape: "97 5h 12+8/10".into(),
            buffers: vec![
                rng.floats(kv_n, a),
                rng.floats(rope_n, a),
                nan(k_n, a),
                nan(v_n, a),
            ],
            outputs: vec![2, 3],
            cpu: Box::new(move |b, x| b.mla_kv_split(v(&x[0]), v(&x[1]), m(&x[2]), m(&x[3]), d)),
            gpu: Box::new(move |s, st, x| s.mla_kv_split(st, x[0], x[1], x[2], x[3], d)),
            reference: None,
        });
        cases.push(Case {
            kernel: "mla_kv_join".into(),
            mode,
            shape: "97 5h 12+8/10".into(),
            buffers: vec![
                rng.floats(k_n, a),
                rng.floats(v_n, a),
                nan(kv_n, a),
                nan(rope_n, a),
            ],
            outputs: vec![2, 3],
            cpu: Box::new(move |b, x| b.mla_kv_join(v(&x[0]), v(&x[1]), m(&x[2]), m(&x[3]), d)),
            gpu: Box::new(move |s, st, x| s.mla_kv_join(st, x[0], x[1], x[2], x[3], d)),
            reference: None,
        });

        // Row moves and the MoE combine.
        let (count, width, src_rows) = (299usize, 65usize, 311usize);
        let index: Vec<u32> = (0..count).map(|_| rng.below(src_rows) as u32).collect();
        cases.push(Case {
            kernel: "gather_rows".into(),
            mode,
            shape: format!("{count} of {src_rows}x{width}"),
            buffers: vec![
                rng.floats(src_rows * width, a),
                Host::U32(index),
                nan(count * width, a),
            ],
            outputs: vec![2],
            cpu: Box::new(move |b, x| b.gather_rows(v(&x[0]), v(&x[1]), m(&x[2]), width)),
            gpu: Box::new(move |s, st, x| s.gather_rows(st, x[0], x[1], x[2], width)),
            reference: None,
        });
        let perm = rng.permutation(src_rows)[..count].to_vec();
        cases.push(Case {
            kernel: "scatter_rows".into(),
            mode,
            shape: format!("{count} into {src_rows}x{width}"),
            buffers: vec![
                rng.floats(count * width, a),
                Host::U32(perm),
                rng.floats(src_rows * width, a),
            ],
            outputs: vec![2],
            cpu: Box::new(move |b, x| b.scatter_rows(v(&x[0]), v(&x[1]), m(&x[2]), width)),
            gpu: Box::new(move |s, st, x| s.scatter_rows(st, x[0], x[1], x[2], width)),
            reference: None,
        });
        let d = UnpermuteDims {
            tokens: 203,
            top_k: 3,
            rows: 609,
            width: 129,
        };
        let positions = rng.permutation(609);
        let weights = Host::F32(rng.vec(609, 1.0));
        // Rows of 136 channels: in bf16, 8 channels a thread.
        for d in [d, UnpermuteDims { width: 136, ..d }] {
            let width = d.width;
            for weighted in [true, false] {
                let rows = rng.floats(609 * width, a);
                let slots = (weights.clone(), Host::U32(positions.clone()));
                cases.push(unpermute_case(mode, d, weighted, rows, slots));
            }
        }
        // The combine into x, with and without a shared expert's rows; 136
        // channels take the 8-channel path.
        for width in [129usize, 136] {
            let d = UnpermuteDims { width, ..d };
            for shared in [true, false] {
                let positions = Host::U32(positions.clone());
                cases.push(Case {
                    kernel: "moe_combine".into(),
                    mode,
                    shape: format!("203x3 {width}{}", if shared { " shared" } else { "" }),
                    buffers: vec![
                        rng.floats(609 * width, a),
                        weights.clone(),
                        positions,
                        rng.floats(203 * width, a),
                        rng.floats(203 * width, a),
                    ],
                    outputs: vec![4],
                    cpu: Box::new(move |b, x| {
                        let s = shared.then(|| v(&x[3]));
                        b.moe_combine(v(&x[0]), v(&x[1]), v(&x[2]), s, m(&x[4]), d)
                    }),
                    gpu: Box::new(move |s, st, x| {
                        s.moe_combine(st, x[0], x[1], x[2], shared.then_some(x[3]), x[4], d)
                    }),
                    reference: None,
                });
            }
        }
        // Rows of 136 channels: in bf16, 8 channels a load.
        for width in [129usize, 136] {
            let d = UnpermuteDims { width, ..d };
            let dout = rng.floats(203 * width, a);
            let rows = rng.floats(609 * width, a);
            let slots = (weights.clone(), Host::U32(positions.clone()));
            cases.push(unpermute_backward_case(mode, d, dout, rows, slots));
        }
        // Six slots a token, at the benchmark's width of 2,048 channels and
        // at 2,056 (a lane's words of a row not a whole multiple of 32).
        for width in [2048usize, 2056] {
            let d = UnpermuteDims {
                tokens: 37,
                top_k: 6,
                rows: 222,
                width,
            };
            let positions = Host::U32(rng.permutation(222));
            let weights = Host::F32(rng.vec(222, 1.0));
            let rows = rng.floats(222 * width, a);
            let slots = (weights.clone(), positions.clone());
            cases.push(unpermute_case(mode, d, true, rows, slots));
            let dout = rng.floats(37 * width, a);
            let rows = rng.floats(222 * width, a);
            cases.push(unpermute_backward_case(
                mode,
                d,
                dout,
                rows,
                (weights, positions),
            ));
        }
    }

    // f32-only kernels: loss, routing, dispatch, optimizer, norm partials.
    for (rows, vocab) in [(37usize, 5003usize), (5, 131_071)] {
        let d = LossDims { rows, vocab };
        let targets: Vec<u32> = (0..rows)
            .map(|r| {
                if r % 7 == 3 {
                    IGNORE_TARGET
                } else {
                    rng.below(vocab) as u32
                }
            })
            .collect();
        cases.push(Case {
            kernel: "cross_entropy_forward".into(),
            mode: "f32",
            shape: format!("{rows}x{vocab}"),
            buffers: vec![
                Host::F32(rng.vec(rows * vocab, 6.0)),
                Host::U32(targets.clone()),
                nan(rows, DType::F32),
            ],
            outputs: vec![0, 2],
            cpu: Box::new(move |b, x| b.cross_entropy_forward(m(&x[0]), v(&x[1]), m(&x[2]), d)),
            gpu: Box::new(move |s, st, x| s.cross_entropy_forward(st, x[0], x[1], x[2], d)),
            reference: Some(cross_entropy_reference),
        });
        let probs: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.unit() as f32 / vocab as f32)
            .collect();
        cases.push(Case {
            kernel: "cross_entropy_backward".into(),
            mode: "f32",
            shape: format!("{rows}x{vocab}"),
            buffers: vec![Host::F32(probs), Host::U32(targets)],
            outputs: vec![0],
            cpu: Box::new(move |b, x| b.cross_entropy_backward(m(&x[0]), v(&x[1]), 0.37, d)),
            gpu: Box::new(move |s, st, x| s.cross_entropy_backward(st, x[0], x[1], 0.37, d)),
            reference: None,
        });
    }
    // The loss alone, and forward and backward at once: rows shorter than
    // one unrolled step of the block (700), rows of whole steps (32,768)
    // and ragged tails after them; the gradients into f32 or bf16, or in
    // place. Logits in f32 and in bf16 (the head's in the compute dtype):
    // bf16 rows of whole 16-byte words (64, 4,104 = 2 words for each of
    // the block's 256 threads and one more, 16,000, 32,768) take the
    // kernels' 8-a-thread path, the others an element a thread.
    let [f32_logits, bf16_logits] = MODES;
    for (rows, vocab, (mode, logits_dtype)) in [
        (3usize, 700usize, f32_logits),
        (4, 1500, f32_logits),
        (6, 2500, f32_logits),
        (37, 5003, f32_logits),
        (3, 16_000, f32_logits),
        (9, 32_768, f32_logits),
        (5, 131_071, f32_logits),
        (3, 700, bf16_logits),
        (5, 64, bf16_logits),
        (4, 4104, bf16_logits),
        (3, 16_000, bf16_logits),
        (9, 32_768, bf16_logits),
        (5, 131_071, bf16_logits),
    ] {
        let d = LossDims { rows, vocab };
        let targets: Vec<u32> = (0..rows)
            .map(|r| {
                if r % 4 == 1 {
                    IGNORE_TARGET
                } else {
                    rng.below(vocab) as u32
                }
            })
            .collect();
        let logits = Host::floats(rng.vec(rows * vocab, 6.0), logits_dtype);
        cases.push(Case {
            kernel: "cross_entropy_loss".into(),
            mode,
            shape: format!("{rows}x{vocab}"),
            buffers: vec![
                logits.clone(),
                Host::U32(targets.clone()),
                nan(rows, DType::F32),
            ],
            outputs: vec![2],
            cpu: Box::new(move |b, x| b.cross_entropy_loss(m(&x[0]), v(&x[1]), m(&x[2]), d)),
            gpu: Box::new(move |s, st, x| s.cross_entropy_loss(st, x[0], x[1], x[2], d)),
            // A 131,071-wide sum in f32 on the CPU is off by more than the
            // tolerance: the losses are checked against f64.
            reference: Some(|buffers| vec![cross_entropy_reference(buffers).swap_remove(1)]),
        });
        for out in [Some(DType::F32), Some(DType::Bf16), None] {
            let mut buffers = vec![logits.clone(), Host::U32(targets.clone())];
            let into = match out {
                Some(dtype) => {
                    buffers.push(nan(rows * vocab, dtype));
                    format!("into {dtype}")
                }
                None => "in place".to_string(),
            };
            cases.push(Case {
                kernel: "cross_entropy_gradient".into(),
                mode,
                shape: format!("{rows}x{vocab} {into}"),
                buffers,
                outputs: vec![if out.is_some() { 2 } else { 0 }],
                cpu: Box::new(move |b, x| {
                    let out = out.map(|_| m(&x[2]));
                    b.cross_entropy_gradient(m(&x[0]), v(&x[1]), 0.37, out, None, d)
                }),
                gpu: Box::new(move |s, st, x| {
                    let into = if out.is_some() { x[2] } else { x[0] };
                    s.cross_entropy_gradient(st, x[0], x[1], 0.37, into, None, d)
                }),
                reference: None,
            });
        }
    }

    for (rows, experts, top_k) in [(301usize, 64usize, 6usize), (77, 37, 1), (129, 160, 8)] {
        for score in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
            let d = RouteDims {
                rows,
                experts,
                top_k,
                score,
                topk_scale: 2.5,
            };
            let shape = format!("{rows}x{experts} top{top_k} {score:?}");
            let logits = Host::F32(rng.vec(rows * experts, 3.0));
            let bias = Host::F32(rng.vec(experts, 0.2));
            for with_bias in [false, true] {
                cases.push(Case {
                    kernel: "moe_route_forward".into(),
                    mode: "f32",
                    shape: format!("{shape}{}", if with_bias { " bias" } else { "" }),
                    buffers: vec![
                        logits.clone(),
                        bias.clone(),
                        nan(rows * experts, DType::F32),
                        nan(rows * top_k, DType::F32),
                        Host::F32(rng.vec(experts, 1.0)),
                        Host::U32(vec![u32::MAX; rows * top_k]),
                        Host::U32(vec![u32::MAX; rows * top_k]),
                    ],
                    outputs: vec![2, 3, 4, 5, 6],
                    cpu: Box::new(move |b, x| {
                        b.moe_route_forward(
                            v(&x[0]),
                            with_bias.then(|| ExpertBias {
                                bias: v(&x[1]),
                                unbiased: m(&x[6]),
                            }),
                            RouteOutputs {
                                scores: m(&x[2]),
                                weights: m(&x[3]),
                                prob_sum: Some(m(&x[4])),
                            },
                            m(&x[5]),
                            d,
                        )
                    }),
                    gpu: Box::new(move |s, st, x| {
                        s.moe_route_forward(
                            st,
                            x[0],
                            with_bias.then_some(ExpertBias {
                                bias: x[1],
                                unbiased: x[6],
                            }),
                            x[2],
                            x[3],
                            Some(x[4]),
                            x[5],
                            d,
                        )
                    }),
                    reference: None,
                });
            }
            // The backward reads what a forward saved: scores of the logits.
            let cpu = CpuBackend::default();
            let lb = cpu_upload(&cpu, &logits);
            let scores = cpu_upload(&cpu, &nan(rows * experts, DType::F32));
            let weights = cpu_upload(&cpu, &nan(rows * top_k, DType::F32));
            let sums = cpu_upload(&cpu, &Host::F32(vec![0.0; experts]));
            let sel = cpu_upload(&cpu, &Host::U32(vec![0; rows * top_k]));
            cpu.moe_route_forward(
                v(&lb),
                None,
                RouteOutputs {
                    scores: m(&scores),
                    weights: m(&weights),
                    prob_sum: Some(m(&sums)),
                },
                m(&sel),
                d,
            )
            .expect("routing forward on the CPU");
            let saved_scores = cpu_download(&cpu, &scores, &nan(rows * experts, DType::F32));
            let saved_sel = cpu_download(&cpu, &sel, &Host::U32(vec![0; rows * top_k]));
            cases.push(Case {
                kernel: "moe_route_backward".into(),
                mode: "f32",
                shape,
                buffers: vec![
                    logits,
                    saved_scores,
                    saved_sel,
                    Host::F32(rng.vec(rows * top_k, 1.0)),
                    Host::F32(rng.vec(experts, 0.01)),
                    nan(rows * experts, DType::F32),
                ],
                outputs: vec![5],
                cpu: Box::new(move |b, x| {
                    b.moe_route_backward(
                        RouterScores {
                            logits: v(&x[0]),
                            scores: v(&x[1]),
                        },
                        v(&x[2]),
                        v(&x[3]),
                        v(&x[4]),
                        m(&x[5]),
                        d,
                    )
                }),
                gpu: Box::new(move |s, st, x| {
                    s.moe_route_backward(st, x[0], x[1], x[2], x[3], x[4], x[5], d)
                }),
                reference: None,
            });
        }
    }

    for (tokens, experts, top_k) in [(1001usize, 64usize, 6usize), (3001, 256, 8), (5, 7, 2)] {
        let slots = RoutedSlots {
            tokens,
            top_k,
            experts,
        };
        let selected = rng.routing(tokens, experts, top_k);
        let mut counts = vec![0u32; experts];
        for &e in &selected {
            counts[e as usize] += 1;
        }
        let shape = format!("{tokens}x{top_k} of {experts}");
        cases.push(Case {
            kernel: "moe_expert_counts".into(),
            mode: "u32",
            shape: shape.clone(),
            buffers: vec![Host::U32(selected.clone()), Host::U32(vec![7; experts])],
            outputs: vec![1],
            cpu: Box::new(move |b, x| b.moe_expert_counts(v(&x[0]), m(&x[1]), slots)),
            gpu: Box::new(move |s, st, x| s.moe_expert_counts(st, x[0], x[1], slots)),
            reference: None,
        });
        let n = tokens * top_k;
        cases.push(Case {
            kernel: "moe_sort_by_expert".into(),
            mode: "u32",
            shape: shape.clone(),
            buffers: vec![
                Host::U32(selected),
                Host::U32(counts.clone()),
                Host::U32(vec![u32::MAX; n]),
                Host::U32(vec![u32::MAX; n]),
            ],
            outputs: vec![2, 3],
            cpu: Box::new(move |b, x| {
                b.moe_sort_by_expert(
                    v(&x[0]),
                    v(&x[1]),
                    ExpertOrder {
                        positions: m(&x[2]),
                        sources: m(&x[3]),
                    },
                    slots,
                )
            }),
            gpu: Box::new(move |s, st, x| s.moe_sort_by_expert(st, x[0], x[1], x[2], x[3], slots)),
            reference: None,
        });
        let prob_sum = Host::F32(
            (0..experts)
                .map(|_| rng.unit() as f32 * tokens as f32 / experts as f32)
                .collect(),
        );
        let d = AuxLossDims { slots, coeff: 0.01 };
        cases.push(Case {
            kernel: "moe_aux_loss_forward".into(),
            mode: "f32",
            shape: shape.clone(),
            buffers: vec![Host::U32(counts.clone()), prob_sum, Host::F64(vec![0.5])],
            outputs: vec![2],
            cpu: Box::new(move |b, x| b.moe_aux_loss_forward(v(&x[0]), v(&x[1]), m(&x[2]), d)),
            gpu: Box::new(move |s, st, x| s.moe_aux_loss_forward(st, x[0], x[1], x[2], d)),
            reference: None,
        });
        cases.push(Case {
            kernel: "moe_aux_loss_backward".into(),
            mode: "f32",
            shape: shape.clone(),
            buffers: vec![Host::U32(counts.clone()), nan(experts, DType::F32)],
            outputs: vec![1],
            cpu: Box::new(move |b, x| b.moe_aux_loss_backward(v(&x[0]), m(&x[1]), d, 0.25)),
            gpu: Box::new(move |s, st, x| s.moe_aux_loss_backward(st, x[0], x[1], d, 0.25)),
            reference: None,
        });
        // A running total past u32's range, so a sum in anything narrower
        // than f64 shows.
        let load: Vec<f64> = (0..experts)
            .map(|e| (e as u64 * (1 << 33)) as f64)
            .collect();
        cases.push(Case {
            kernel: "moe_load_accumulate".into(),
            mode: "u32",
            shape,
            buffers: vec![Host::U32(counts), Host::F64(load)],
            outputs: vec![1],
            cpu: Box::new(move |b, x| b.moe_load_accumulate(v(&x[0]), m(&x[1]))),
            gpu: Box::new(move |s, st, x| s.moe_load_accumulate(st, x[0], x[1])),
            reference: None,
        });
    }
    for (ranks, local) in [(4usize, 3usize), (1, 1), (8, 16)] {
        let d = ReceivedDims {
            ranks,
            local_experts: local,
        };
        let recv: Vec<u32> = (0..ranks * local).map(|_| rng.below(40) as u32).collect();
        let total: usize = recv.iter().map(|&c| c as usize).sum();
        cases.push(Case {
            kernel: "moe_expert_major_order".into(),
            mode: "u32",
            shape: format!("{ranks} ranks x {local} experts, {total} rows"),
            buffers: vec![Host::U32(recv), Host::U32(vec![u32::MAX; total])],
            outputs: vec![1],
            cpu: Box::new(move |b, x| b.moe_expert_major_order(v(&x[0]), m(&x[1]), d)),
            gpu: Box::new(move |s, st, x| s.moe_expert_major_order(st, x[0], x[1], d)),
            reference: None,
        });
    }

    for n in [1usize, 100_003] {
        let decayed: Vec<u32> = if n == 1 {
            vec![0, 1]
        } else {
            vec![0, 40_000, 40_010, 40_011, 70_000, 99_999]
        };
        let step = AdamStep {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_scale: 0.8,
            step: 7,
        };
        let moment_v = Host::F32((0..n).map(|_| rng.unit() as f32 * 0.01).collect());
        cases.push(Case {
            kernel: "adam_update".into(),
            mode: "f32",
            shape: format!("{n}, {} ranges", decayed.len() / 2),
            buffers: vec![
                rng.floats(n, DType::F32),
                rng.floats(n, DType::F32),
                Host::F32(rng.vec(n, 0.1)),
                moment_v,
                Host::U32(decayed.clone()),
                nan(n, DType::Bf16),
            ],
            outputs: vec![0, 2, 3, 5],
            cpu: Box::new(move |b, x| {
                b.adam_update(
                    m(&x[0]),
                    Some(m(&x[5])),
                    v(&x[1]),
                    AdamMoments {
                        m: m(&x[2]),
                        v: m(&x[3]),
                    },
                    v(&x[4]),
                    step,
                )
            }),
            gpu: Box::new(move |s, st, x| {
                let moments = AdamMoments { m: x[2], v: x[3] };
                s.adam_update(st, (x[0], Some(x[5])), x[1], moments, x[4], step)
            }),
            reference: None,
        });
        for momentum in [0.0f32, 0.9] {
            let step = SgdStep {
                lr: 0.05,
                momentum,
                weight_decay: 0.01,
                grad_scale: 0.5,
            };
            cases.push(Case {
                kernel: "sgd_update".into(),
                mode: "f32",
                shape: format!("{n}{}", if momentum != 0.0 { " momentum" } else { "" }),
                buffers: vec![
                    rng.floats(n, DType::F32),
                    rng.floats(n, DType::F32),
                    rng.floats(n, DType::F32),
                    Host::U32(decayed.clone()),
                    nan(n, DType::Bf16),
                ],
                outputs: vec![0, 2, 4],
                cpu: Box::new(move |b, x| {
                    b.sgd_update(
                        m(&x[0]),
                        Some(m(&x[4])),
                        v(&x[1]),
                        (momentum != 0.0).then(|| m(&x[2])),
                        v(&x[3]),
                        step,
                    )
                }),
                gpu: Box::new(move |s, st, x| {
                    s.sgd_update(
                        st,
                        (x[0], Some(x[4])),
                        x[1],
                        (momentum != 0.0).then_some(x[2]),
                        x[3],
                        step,
                    )
                }),
                reference: None,
            });
        }
        // A piece short enough for one block, and pieces cut into tiles
        // (the last one shorter than the rest).
        for (len, piece) in [(n, 4099usize), (1_000_003, 400_000)] {
            let scratch = KernelSet::sum_squares_scratch_len(len, piece).expect("scratch");
            cases.push(Case {
                kernel: "sum_squares".into(),
                mode: "f32",
                shape: format!("{len} by {piece}"),
                buffers: vec![
                    rng.floats(len, DType::F32),
                    nan(len.div_ceil(piece), DType::F64),
                    nan(scratch, DType::F64),
                ],
                outputs: vec![1],
                cpu: Box::new(move |b, x| b.sum_squares(v(&x[0]), piece, m(&x[1]))),
                gpu: Box::new(move |s, st, x| s.sum_squares(st, x[0], piece, x[1], x[2])),
                reference: None,
            });
        }
    }
    cases.extend(attention_cases(seed));
    cases.extend(flash_attention_cases(seed));
    cases.extend(lookup_cases(seed));
    cases.extend(mamba_cases(seed ^ 0x006d_616d_6261));
    cases.extend(delta_cases(seed ^ 0x0064_656c_7461));
    cases.extend(norm_tree_cases(seed ^ 0x006e_6f72_6d00));
    cases
}

/// The sum of 32 lanes' values as the kernels' `warp_sum` adds them: five
/// butterfly rounds (lane l adds lane l ^ m's value to its own), after
/// which every lane holds the same bits.
fn warp_butterfly(mut lanes: [f32; 32]) -> f32 {
    for m in [16, 8, 4, 2, 1] {
        let before = lanes;
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = before[l] + before[l ^ m];
        }
    }
    lanes[0]
}

/// The epsilon of the exact norm cases, which their reference (a function
/// of the buffers alone) cannot read from the case.
const NORM_TREE_EPS: f32 = 1e-5;

/// The bf16 RMSNorm forward (8-channel words) as its block kernel sums it:
/// a block of `threads` (a power of two from 32 to 256, at least the
/// group's words where they fit) per (row, group), thread t summing the
/// squares of words t, t + threads, ... in order, each warp's sums by the
/// butterfly, then the warps' sums by the butterfly again; y = (x rs) w,
/// rounded to bf16 once. Buffers: x, w, y, rstd.
fn rmsnorm_block_tree(buffers: &[Host]) -> Vec<Host> {
    let (x, w) = (buffers[0].values(), buffers[1].values());
    let dim = w.len();
    let rows = x.len() / dim;
    let groups = buffers[3].len() / rows;
    let group_size = dim / groups;
    let words = group_size / 8;
    let threads = words.max(32).next_power_of_two().min(256);
    let (mut y, mut rstd) = (
        Vec::with_capacity(x.len()),
        Vec::with_capacity(rows * groups),
    );
    for item in 0..rows * groups {
        let at = |c: usize, e: usize| item * group_size + 8 * c + e;
        let thread_sum = |t: usize| {
            let mut sum = 0.0f32;
            for c in (t..words).step_by(threads) {
                for e in 0..8 {
                    let v = x[at(c, e)] as f32;
                    sum += v * v;
                }
            }
            sum
        };
        let mut warp_sums = [0.0f32; 32];
        for (warp, total) in warp_sums.iter_mut().take(threads / 32).enumerate() {
            *total = warp_butterfly(std::array::from_fn(|l| thread_sum(32 * warp + l)));
        }
        let total = warp_butterfly(warp_sums);
        let rs = 1.0f32 / (total / group_size as f32 + NORM_TREE_EPS).sqrt();
        rstd.push(rs);
        let w0 = (item % groups) * group_size;
        for i in 0..group_size {
            let v = x[item * group_size + i] as f32 * rs * w[w0 + i] as f32;
            y.push(bf16::from_f32(v));
        }
    }
    vec![Host::Bf16(y), Host::F32(rstd)]
}

/// The bf16 RMSNorm forward held to its block kernel's reduction tree bit
/// for bit (`rmsnorm_block_tree`): groups of up to 256 words run a warp a
/// row (`rmsnorm_forward_warps`, which replays that tree), wider ones the
/// block kernel itself (the 9B's hidden size of 4,480: 560 words, three a
/// thread).
fn norm_tree_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed);
    let mut cases = Vec::new();
    for (rows, dim, groups) in [
        (300usize, 2048usize, 1usize),
        (40, 4096, 8),
        (65, 1024, 1),
        (33, 4480, 35),
        (9, 4480, 1),
    ] {
        let d = NormDims {
            rows,
            dim,
            groups,
            eps: NORM_TREE_EPS,
        };
        let x = rng.floats(rows * dim, DType::Bf16);
        let w = rng.floats(dim, DType::Bf16);
        cases.push(rmsnorm_forward_case(
            "bf16",
            d,
            x,
            w,
            Some(rmsnorm_block_tree),
        ));
    }
    cases
}

/// `rmsnorm_forward` of `x` (`[d.rows, d.dim]`) with the weight `w`, into
/// NaN-filled outputs; with a `reference`, held to its bits (`EXACT`).
fn rmsnorm_forward_case(
    mode: &'static str,
    d: NormDims,
    x: Host,
    w: Host,
    reference: Option<Reference>,
) -> Case<'static> {
    let a = x.dtype();
    let exact = if reference.is_some() { EXACT } else { "" };
    Case {
        kernel: format!("rmsnorm_forward{exact}"),
        mode,
        shape: format!("{}x{}/{}", d.rows, d.dim, d.groups),
        buffers: vec![
            x,
            w,
            nan(d.rows * d.dim, a),
            nan(d.rows * d.groups, DType::F32),
        ],
        outputs: vec![2, 3],
        cpu: Box::new(move |b, x| {
            b.rmsnorm_forward(v(&x[0]), v(&x[1]), m(&x[2]), m(&x[3]), None, d)
        }),
        gpu: Box::new(move |s, st, x| s.rmsnorm_forward(st, x[0], x[1], x[2], x[3], None, d)),
        reference,
    }
}

// ---- Mamba: conv1d and the SSD scan ----------------------------------------------

use hybridgen_runtime::backend::{ConvDims, ScanDims, ScanGrads, ScanInputs};

/// `n` values uniform in `[lo, hi)`, stored as `dtype`.
fn uniform(rng: &mut Rng, n: usize, lo: f32, hi: f32, dtype: DType) -> Host {
    let values = (0..n).map(|_| lo + (hi - lo) * rng.unit() as f32).collect();
    Host::floats(values, dtype)
}

fn scan_inputs_cpu(x: &[CpuBuf]) -> ScanInputs<View<'_, CpuBuf>> {
    ScanInputs {
        xbc: v(&x[0]),
        dt: v(&x[1]),
        dt_bias: v(&x[2]),
        a_log: v(&x[3]),
        d: v(&x[4]),
    }
}

fn scan_inputs_gpu(x: &[GpuView]) -> ScanInputs<GpuView> {
    ScanInputs {
        xbc: x[0],
        dt: x[1],
        dt_bias: x[2],
        a_log: x[3],
        d: x[4],
    }
}

/// The chunk-start states the CPU forward saves for `inputs` (xbc, dt,
/// dt_bias, a_log, d): what the backward is given.
fn cpu_scan_states(inputs: &[Host], dims: ScanDims) -> Host {
    let cpu = CpuBackend::default();
    let bufs: Vec<CpuBuf> = inputs.iter().map(|h| cpu_upload(&cpu, h)).collect();
    let rows = dims.tokens.batch * dims.tokens.seq;
    let y = cpu_upload(&cpu, &nan(rows * dims.heads * dims.head_dim, DType::F32));
    let like = nan(dims.states_len(), DType::F32);
    let states = cpu_upload(&cpu, &like);
    cpu.ssd_scan_forward(scan_inputs_cpu(&bufs), m(&y), m(&states), dims)
        .expect("the scan forward on the CPU");
    cpu_download(&cpu, &states, &like)
}

/// conv1d over several sequences (some shorter than the kernel) and the
/// SSD scan over odd shapes in every state-size tier: several sequences,
/// chunks that do and do not divide the sequence (or exceed it), a group
/// of many heads, and slowly decaying states (the backward's within-chunk
/// recurrence runs longest there).
fn mamba_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed);
    let mut cases: Vec<Case<'static>> = Vec::new();
    for (mode, a) in MODES {
        for (batch, seq, channels, kernel) in [
            (3usize, 67usize, 199usize, 4usize),
            (2, 3, 37, 4),
            (1, 129, 70, 1),
            (2, 40, 33, 7),
            // Past the one-pass weight gradient's 16 taps: a pass per tap.
            (2, 30, 35, 20),
            // Channels in words of 8 (bf16 takes the 8-channel kernels):
            // runs of 32 rows that cross sequences, sequences shorter
            // than the kernel, every width those kernels take.
            (2, 45, 64, 4),
            (3, 2, 16, 4),
            (2, 37, 24, 3),
            (1, 70, 40, 2),
            (2, 9, 8, 1),
        ] {
            let d = ConvDims {
                tokens: Tokens::new(batch, seq),
                channels,
                kernel,
            };
            let n = batch * seq * channels;
            let shape = format!("{batch}x{seq} {channels}ch K{kernel}");
            let x = rng.floats(n, a);
            let w = rng.floats(channels * kernel, a);
            let dy = rng.floats(n, a);
            cases.push(Case {
                kernel: "conv1d_forward".into(),
                mode,
                shape: shape.clone(),
                buffers: vec![x.clone(), w.clone(), rng.floats(channels, a), nan(n, a)],
                outputs: vec![3],
                cpu: Box::new(move |b, x| {
                    b.conv1d_forward(v(&x[0]), v(&x[1]), v(&x[2]), m(&x[3]), d)
                }),
                gpu: Box::new(move |s, st, x| s.conv1d_forward(st, x[0], x[1], x[2], x[3], d)),
                reference: None,
            });
            cases.push(Case {
                kernel: "conv1d_backward_input".into(),
                mode,
                shape: shape.clone(),
                buffers: vec![dy.clone(), w, nan(n, a)],
                outputs: vec![2],
                cpu: Box::new(move |b, x| b.conv1d_backward_input(v(&x[0]), v(&x[1]), m(&x[2]), d)),
                gpu: Box::new(move |s, st, x| s.conv1d_backward_input(st, x[0], x[1], x[2], d)),
                reference: None,
            });
            // Weight gradients accumulate into f32, and into the mode's
            // dtype for the first shape.
            let grad_dtypes: &[DType] = if channels == 199 && a != DType::F32 {
                &[DType::F32, a]
            } else {
                &[DType::F32]
            };
            for &g in grad_dtypes {
                cases.push(Case {
                    kernel: "conv1d_backward_weight".into(),
                    mode,
                    shape: format!("{shape} into {g}"),
                    buffers: vec![
                        dy.clone(),
                        x.clone(),
                        rng.floats(channels * kernel, g),
                        rng.floats(channels, g),
                    ],
                    outputs: vec![2, 3],
                    cpu: Box::new(move |b, x| {
                        b.conv1d_backward_weight(v(&x[0]), v(&x[1]), m(&x[2]), m(&x[3]), d)
                    }),
                    gpu: Box::new(move |s, st, x| {
                        s.conv1d_backward_weight(st, x[0], x[1], x[2], x[3], d)
                    }),
                    reference: None,
                });
            }
        }

        // batch, seq, heads, head dim, groups, state, chunk, slow decay,
        // whether d_a_log is held to the CPU's here (see the 9B widths)
        for (batch, seq, heads, head_dim, groups, state, chunk, slow, a_log_checked) in [
            (
                2usize, 75usize, 6usize, 10usize, 3usize, 20usize, 16usize, false, true,
            ),
            (3, 41, 4, 64, 2, 48, 7, false, true),
            (1, 130, 8, 16, 1, 128, 64, true, true),
            (1, 5, 2, 3, 2, 3, 8, false, true),
            (2, 33, 2, 8, 1, 200, 10, false, true),
            (1, 50, 4, 64, 1, 128, 16, false, true),
            (1, 20, 24, 64, 1, 16, 8, false, true),
            // Many chunks with decays near 1: the state gradient carried
            // across chunks matters at every chunk.
            (2, 700, 4, 64, 2, 128, 64, true, true),
            // 40 heads of 64 rows in one group: 2,560 (head, row) pairs,
            // the group kernel's 32 warps with 3 pairs a thread.
            (1, 40, 40, 64, 1, 16, 16, false, true),
            // The tensor-core scores at Nemotron-H 9B's widths: 16 heads
            // of 80 a group (the sums' widest shared memory; the last 16
            // channels of a head a product of their own), chunks of 128
            // with a partial last one; 4 heads of 80 in chunks of 256,
            // decays near 1; 16 heads of 64 a group. With fast decays
            // (dt A down to -4.6 a step) over chunks of 64 and more, the
            // GPU's d_a_log differed from the CPU's by 1.4e-5 to 1.9e-5
            // of its norm in f32, past this test's 1e-5, in its chunked
            // and its sequential kernels alike (in `cuda_backend`, which
            // holds d_a_log to 2e-4 of its largest value: 3.0e-5 and
            // 2.5e-5 at 2 x 300 steps). Both forms lose precision there:
            // the chunked one's f32 running sums of log-decays Lam (each
            // e^(Lam_t - Lam_s) carries |Lam| 2^-24 of error in its
            // exponent, and |Lam| reaches the hundreds by a chunk's end;
            // the CPU's own chunked forward is 5x further from an f64 y
            // at chunks of 128 than of 16), the sequential one's q
            // recurrence across a chunk's steps. The CPU's sequential
            // f32 d_a_log matched an f64 finite difference to 8e-7 of
            // its norm at these shapes. The cases above with fast decays
            // have chunks of at most 16. Here d_a_log of the fast, long
            // chunks is left to `cuda_backend`; every other output is
            // held to 1e-5.
            (1, 130, 32, 80, 2, 64, 128, false, false),
            (1, 600, 8, 80, 2, 64, 256, true, true),
            (1, 100, 16, 64, 1, 32, 64, false, false),
        ] {
            let d = ScanDims {
                tokens: Tokens::new(batch, seq),
                heads,
                head_dim,
                groups,
                state,
                chunk,
            };
            let rows = batch * seq;
            let y_len = rows * heads * head_dim;
            let shape = format!(
                "{batch}x{seq} H{heads} P{head_dim} G{groups} N{state} c{chunk}{}",
                if slow { " slow" } else { "" }
            );
            // softplus(dt + bias) ~0.05..1.7 and A ~ -0.4..-2.7 (decays
            // ~0.01..0.98); slow: dt ~0.005..0.05, A ~ -0.4..-1 (~0.95..1).
            let (dt_range, a_range) = if slow {
                ((-5.0, -3.0), (-1.0, 0.0))
            } else {
                ((-2.0, 1.0), (-1.0, 1.0))
            };
            let inputs = vec![
                Host::floats(rng.vec(rows * d.xbc_width(), 1.5), a),
                uniform(&mut rng, rows * heads, dt_range.0, dt_range.1, a),
                uniform(&mut rng, heads, -1.0, 0.5, a),
                uniform(&mut rng, heads, a_range.0, a_range.1, a),
                Host::floats(rng.vec(heads, 1.0), a),
            ];
            let mut buffers = inputs.clone();
            buffers.extend([nan(y_len, a), nan(d.states_len(), DType::F32)]);
            cases.push(Case {
                kernel: "ssd_scan_forward".into(),
                mode,
                shape: shape.clone(),
                buffers,
                outputs: vec![5, 6],
                cpu: Box::new(move |b, x| {
                    b.ssd_scan_forward(scan_inputs_cpu(x), m(&x[5]), m(&x[6]), d)
                }),
                gpu: Box::new(move |s, st, x| {
                    s.ssd_scan_forward(st, scan_inputs_gpu(x), x[5], x[6], d)
                }),
                reference: None,
            });
            let scratch = KernelSet::ssd_scan_backward_scratch_len(d).expect("scratch size");
            let mut buffers = inputs.clone();
            buffers.extend([
                cpu_scan_states(&inputs, d),
                rng.floats(y_len, a),
                nan(rows * d.xbc_width(), a),
                nan(rows * heads, a),
                rng.floats(heads, DType::F32),
                rng.floats(heads, DType::F32),
                nan(scratch, DType::F32),
            ]);
            cases.push(Case {
                kernel: "ssd_scan_backward".into(),
                mode,
                shape,
                buffers,
                outputs: if a_log_checked {
                    vec![7, 8, 9, 10]
                } else {
                    vec![7, 8, 10]
                },
                cpu: Box::new(move |b, x| {
                    b.ssd_scan_backward(
                        scan_inputs_cpu(x),
                        v(&x[5]),
                        v(&x[6]),
                        ScanGrads {
                            xbc: m(&x[7]),
                            dt: m(&x[8]),
                            a_log: m(&x[9]),
                            d: m(&x[10]),
                        },
                        d,
                    )
                }),
                gpu: Box::new(move |s, st, x| {
                    s.ssd_scan_backward(
                        st,
                        scan_inputs_gpu(x),
                        x[5],
                        x[6],
                        ScanGrads {
                            xbc: x[7],
                            dt: x[8],
                            a_log: x[9],
                            d: x[10],
                        },
                        x[11],
                        d,
                    )
                }),
                reference: None,
            });
        }
    }
    cases
}

// ---- the gated delta rule ------------------------------------------------------

use hybridgen_runtime::backend::{DeltaDims, DeltaGrads, DeltaInputs};
use hybridgen_runtime::cuda::ops::delta::{
    DELTA_CHUNK, delta_scratch_len, tensor_core_backward, tensor_core_forward,
};

fn delta_inputs_cpu(x: &[CpuBuf]) -> DeltaInputs<View<'_, CpuBuf>> {
    DeltaInputs {
        qkv: v(&x[0]),
        beta: v(&x[1]),
        alpha: v(&x[2]),
        dt_bias: v(&x[3]),
        a_log: v(&x[4]),
    }
}

fn delta_inputs_gpu(x: &[GpuView]) -> DeltaInputs<GpuView> {
    DeltaInputs {
        qkv: x[0],
        beta: x[1],
        alpha: x[2],
        dt_bias: x[3],
        a_log: x[4],
    }
}

/// The chunk-start states the CPU forward saves for `inputs` (qkv, beta,
/// alpha, dt_bias, a_log): what the backward is given.
fn cpu_delta_states(inputs: &[Host], dims: DeltaDims) -> Host {
    let cpu = CpuBackend::default();
    let bufs: Vec<CpuBuf> = inputs.iter().map(|h| cpu_upload(&cpu, h)).collect();
    let rows = dims.tokens.batch * dims.tokens.seq;
    let out = cpu_upload(&cpu, &nan(rows * dims.out_width(), DType::F32));
    let like = nan(dims.states_len(), DType::F32);
    let states = cpu_upload(&cpu, &like);
    cpu.gated_delta_forward(delta_inputs_cpu(&bufs), m(&out), m(&states), dims)
        .expect("the gated delta rule forward on the CPU");
    cpu_download(&cpu, &states, &like)
}

/// The gated delta rule, chunked on the GPU against the CPU's step-by-step
/// recurrence: key heads shared by one and by two value heads, head dims
/// of 32, 64 and 128 (and odd ones), sequences that end inside a chunk,
/// two sequences. In bf16 the forward of head dims that are multiples of
/// 16 runs on tensor cores (`tensor_core_forward`: dk = dv = 128 with two
/// value heads a key head, 1, 2 and 5 chunks, the last one short), and the
/// backward where `tensor_core_backward` says so; those cases are held to
/// [`BF16_PRODUCTS_TOLERANCE`] (the backward's to
/// [`BF16_PRODUCTS_GRAD_TOLERANCE`]); the other bf16
/// shapes (dv 8 and 40) take the f32 kernels. Outputs start as NaN (a value left unwritten shows);
/// `d_a_log` accumulates onto random values. The forward's outputs are
/// `out` and the saved states; the backward's, from the CPU's states, the
/// gradients of qkv, beta, alpha and A_log (the case's "output i of 4"
/// names which one is furthest off, in that order).
fn delta_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed);
    let mut cases: Vec<Case<'static>> = Vec::new();
    for (mode, a) in MODES {
        // batch, seq, key heads, value heads, dk, dv', whether d_a_log is
        // held to the CPU's here. d_a_log sums dg_t g_t over every step of
        // both sequences, terms of both signs; the chunked form gets dg as
        // the reverse running sum of G's gradient inside a chunk (G the
        // running sum of g), the CPU step by step, so the two round
        // differently. On an H100 it differed from the CPU's by 1.0e-5 and
        // 1.1e-5 of its norm at the two shapes marked false (one and two
        // A_log values: little to average over), by at most 3.5e-6
        // elsewhere; the other outputs of those shapes are held to 1e-5,
        // and `cuda_training` holds whole G models (A_log's gradient
        // included) to the CPU's losses.
        for (batch, seq, hk, hv, dk, dv, a_log_checked) in [
            (2usize, 100usize, 2usize, 2usize, 32usize, 32usize, true),
            (2, 150, 2, 4, 64, 32, true),
            (2, 70, 1, 2, 128, 128, true),
            (2, 130, 2, 4, 32, 128, false),
            (2, 67, 2, 2, 128, 64, true),
            (2, 200, 1, 1, 64, 64, false),
            (1, 5, 1, 1, 16, 8, true),
            (2, 90, 1, 2, 48, 40, true),
            (1, 300, 2, 4, 128, 128, true),
            (2, 130, 2, 4, 16, 16, true),
        ] {
            let d = DeltaDims {
                tokens: Tokens::new(batch, seq),
                key_heads: hk,
                value_heads: hv,
                key_dim: dk,
                value_dim: dv,
                chunk: DELTA_CHUNK,
            };
            let rows = batch * seq;
            let shape = format!("{batch}x{seq} Hk{hk} Hv{hv} dk{dk} dv{dv}");
            // beta = sigmoid(-3..3); softplus(alpha + dt_bias) ~0.1..1.5
            // and exp(A_log) ~0.4..1.6: decays ~0.1..0.96 a step.
            let inputs = vec![
                Host::floats(rng.vec(rows * d.qkv_width(), 1.5), a),
                Host::floats(rng.vec(rows * hv, 3.0), a),
                uniform(&mut rng, rows * hv, -2.0, 1.0, a),
                uniform(&mut rng, hv, -0.5, 0.5, a),
                uniform(&mut rng, hv, -1.0, 0.5, a),
            ];
            let out_len = rows * d.out_width();
            let mut buffers = inputs.clone();
            let forward_scratch = delta_scratch_len(d, false).expect("scratch size");
            buffers.extend([
                nan(out_len, a),
                nan(d.states_len(), DType::F32),
                nan(forward_scratch, DType::F32),
            ]);
            let products = if tensor_core_forward(a, a, d) {
                BF16_PRODUCTS
            } else {
                ""
            };
            cases.push(Case {
                kernel: format!("gated_delta_forward{products}"),
                mode,
                shape: shape.clone(),
                buffers,
                outputs: vec![5, 6],
                cpu: Box::new(move |b, x| {
                    b.gated_delta_forward(delta_inputs_cpu(x), m(&x[5]), m(&x[6]), d)
                }),
                gpu: Box::new(move |s, st, x| {
                    s.gated_delta_forward(st, delta_inputs_gpu(x), x[5], x[6], x[7], d)
                }),
                reference: None,
            });
            let backward_scratch = delta_scratch_len(d, true).expect("scratch size");
            let mut buffers = inputs.clone();
            buffers.extend([
                cpu_delta_states(&inputs, d),
                rng.floats(out_len, a),
                nan(rows * d.qkv_width(), a),
                nan(rows * hv, a),
                nan(rows * hv, a),
                rng.floats(hv, DType::F32),
                nan(backward_scratch, DType::F32),
            ]);
            let products = if tensor_core_backward(a, a, d) {
                BF16_PRODUCTS
            } else {
                ""
            };
            cases.push(Case {
                kernel: format!("gated_delta_backward{products}"),
                mode,
                shape,
                buffers,
                outputs: if a_log_checked {
                    vec![7, 8, 9, 10]
                } else {
                    vec![7, 8, 9]
                },
                cpu: Box::new(move |b, x| {
                    b.gated_delta_backward(
                        delta_inputs_cpu(x),
                        v(&x[5]),
                        v(&x[6]),
                        DeltaGrads {
                            qkv: m(&x[7]),
                            beta: m(&x[8]),
                            alpha: m(&x[9]),
                            a_log: m(&x[10]),
                        },
                        d,
                    )
                }),
                gpu: Box::new(move |s, st, x| {
                    s.gated_delta_backward(
                        st,
                        delta_inputs_gpu(x),
                        x[5],
                        x[6],
                        DeltaGrads {
                            qkv: x[7],
                            beta: x[8],
                            alpha: x[9],
                            a_log: x[10],
                        },
                        x[11],
                        d,
                    )
                }),
                reference: None,
            });
        }
    }
    cases
}

/// Cross-entropy in f64: probabilities and losses of each row.
fn cross_entropy_reference(buffers: &[Host]) -> Vec<Host> {
    let (logits, targets) = (buffers[0].values(), buffers[1].values());
    let rows = targets.len();
    let vocab = logits.len() / rows.max(1);
    let mut probs = Vec::with_capacity(logits.len());
    let mut losses = Vec::with_capacity(rows);
    for (r, z) in logits.chunks(vocab).enumerate() {
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = z.iter().map(|&v| (v - max).exp()).sum();
        probs.extend(z.iter().map(|&v| (v - max).exp() / sum));
        let t = targets[r] as u32;
        losses.push(if t == IGNORE_TARGET {
            0.0
        } else {
            max + sum.ln() - z[t as usize]
        });
    }
    vec![Host::F64(probs), Host::F64(losses)]
}

/// Bad indices on the device are reported through the fault word, naming
/// what was wrong and where.
fn fault_rows(gpu: &Gpu, set: &KernelSet) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut check =
        |kernel: &str, buffers: Vec<Host>, run: &dyn Fn(&[GpuView]) -> Result<()>, want: &str| {
            let bufs: Vec<GpuBuf> = buffers.iter().map(|h| gpu.upload(h)).collect();
            let views: Vec<GpuView> = bufs
                .iter()
                .zip(&buffers)
                .map(|(b, h)| gpu.view(b, h))
                .collect();
            let problem = match run(&views).and_then(|()| set.take_fault(&gpu.stream)) {
                Ok(Some(fault)) if fault.to_string() == want => None,
                Ok(Some(fault)) => Some(format!("reported `{fault}`, expected `{want}`")),
                Ok(None) => Some("no fault reported".to_string()),
                Err(e) => Some(e.to_string()),
            };
            let clean = set
                .take_fault(&gpu.stream)
                .map(|f| f.is_none())
                .unwrap_or(false);
            rows.push(Row {
                target: set.target(),
                kernel: format!("{kernel} (bad index)"),
                mode: "fault",
                shape: want.to_string(),
                error: 0.0,
                max_abs: 0.0,
                tolerance: 0.0,
                repeatable: clean,
                problem,
                note: String::new(),
            });
        };
    let d = LossDims { rows: 4, vocab: 10 };
    check(
        "cross_entropy_forward",
        vec![
            Host::F32(vec![0.5; 40]),
            Host::U32(vec![1, 10, IGNORE_TARGET, 99]),
            nan(4, DType::F32),
        ],
        &|x| set.cross_entropy_forward(&gpu.stream, x[0], x[1], x[2], d),
        "the loss target of row 1 is past the vocabulary",
    );
    // Logits, bad targets and an output of `out` elements.
    let bad_targets = |out: usize| {
        vec![
            Host::F32(vec![0.5; 40]),
            Host::U32(vec![1, 10, IGNORE_TARGET, 99]),
            nan(out, DType::F32),
        ]
    };
    check(
        "cross_entropy_loss",
        bad_targets(4),
        &|x| set.cross_entropy_loss(&gpu.stream, x[0], x[1], x[2], d),
        "the loss target of row 1 is past the vocabulary",
    );
    check(
        "cross_entropy_gradient",
        bad_targets(40),
        &|x| set.cross_entropy_gradient(&gpu.stream, x[0], x[1], 1.0, x[2], None, d),
        "the loss target of row 1 is past the vocabulary",
    );
    check(
        "gather_rows",
        vec![
            Host::F32(vec![1.0; 12]),
            Host::U32(vec![0, 2, 4, 1]),
            nan(12, DType::F32),
        ],
        &|x| set.gather_rows(&gpu.stream, x[0], x[1], x[2], 3),
        "the row index at position 2 of a gather or scatter is out of range",
    );
    let slots = RoutedSlots {
        tokens: 3,
        top_k: 2,
        experts: 4,
    };
    check(
        "moe_sort_by_expert",
        vec![
            Host::U32(vec![0, 1, 2, 3, 1, 0]),
            Host::U32(vec![2, 2, 1, 0]),
            Host::U32(vec![0; 6]),
            Host::U32(vec![0; 6]),
        ],
        &|x| set.moe_sort_by_expert(&gpu.stream, x[0], x[1], x[2], x[3], slots),
        "the expert counts do not match the routing (at slot 3)",
    );
    rows
}

// ---- attention and embeddings (attention.cu, lookup.cu) ---------------------------

use hybridgen_runtime::backend::{AttentionDims, LookupDims};

/// The CPU backend's attention forward of `q`, `k`, `v`: `out` in their
/// dtype and the f32 `lse`, the backward's inputs.
fn cpu_attention_forward(q: &Host, k: &Host, v: &Host, d: AttentionDims) -> (Host, Host) {
    let cpu = CpuBackend::new(Precision::F32);
    let rows = d.tokens.batch * d.tokens.seq;
    let out = nan(rows * d.heads * d.v_dim, q.dtype());
    let lse = nan(rows * d.heads, DType::F32);
    let bufs: Vec<CpuBuf> = [q, k, v, &out, &lse]
        .iter()
        .map(|h| cpu_upload(&cpu, h))
        .collect();
    cpu.attention_forward(
        AttentionInputs {
            q: View::whole(&bufs[0]),
            k: View::whole(&bufs[1]),
            v: View::whole(&bufs[2]),
        },
        ViewMut::whole(&bufs[3]),
        ViewMut::whole(&bufs[4]),
        d,
    )
    .expect("the CPU attention forward runs on valid inputs");
    (
        cpu_download(&cpu, &bufs[3], &out),
        cpu_download(&cpu, &bufs[4], &lse),
    )
}

/// The CPU's attention forward over a case's buffers `q, k, v, out, lse`.
fn cpu_attention_forward_run(d: AttentionDims) -> CpuRun<'static> {
    Box::new(move |b, x| {
        let inputs = AttentionInputs {
            q: v(&x[0]),
            k: v(&x[1]),
            v: v(&x[2]),
        };
        b.attention_forward(inputs, m(&x[3]), m(&x[4]), d)
    })
}

/// The CPU's attention backward over a case's buffers `q, k, v, out, lse,
/// dout, dq, dk, dv`.
fn cpu_attention_backward_run(d: AttentionDims) -> CpuRun<'static> {
    Box::new(move |b, x| {
        let inputs = AttentionInputs {
            q: v(&x[0]),
            k: v(&x[1]),
            v: v(&x[2]),
        };
        let grads = AttentionInputs {
            q: m(&x[6]),
            k: m(&x[7]),
            v: m(&x[8]),
        };
        b.attention_backward(inputs, v(&x[3]), v(&x[4]), v(&x[5]), grads, d)
    })
}

/// Attention forward and backward: GQA, MQA and MHA; one-token sequences
/// and sequences that end inside a tile; head dims up to one block's 256
/// channels and past it (two channel groups); MLA's unequal dims; a
/// 4096-token sequence. The backward's `out` and `lse` are the CPU
/// forward's, so the probabilities it recomputes are the real ones.
fn attention_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed ^ 0xa77e_0000);
    let mut cases = Vec::new();
    // batch, seq, heads, KV heads, qk dim, v dim
    let shapes = [
        (2usize, 77usize, 6usize, 2usize, 40usize, 24usize),
        (1, 300, 4, 1, 72, 72),
        (3, 1, 2, 2, 8, 5),
        (1, 131, 2, 1, 256, 256),
        (1, 67, 3, 3, 300, 260),
        (1, 97, 4, 2, 192, 128),
        (1, 4096, 2, 1, 64, 64),
    ];
    for (mode, a) in MODES {
        for (batch, seq, heads, kv_heads, qk_dim, v_dim) in shapes {
            let d = attention_dims(batch, seq, heads, kv_heads, qk_dim, v_dim);
            let forward: GpuRun<'static> =
                Box::new(move |s, st, x| s.attention_forward(st, inputs(x), x[3], x[4], d));
            let backward: GpuRun<'static> = Box::new(move |s, st, x| {
                s.attention_backward(st, inputs(x), x[3], x[4], x[5], grads(x), d)
            });
            let names = ("attention_forward", "attention_backward");
            cases.extend(attention_pair(
                &mut rng,
                (mode, a),
                d,
                names,
                [forward, backward],
                0,
            ));
        }
    }
    cases
}

/// The flash kernels (bf16, head dims 64 and 128) against the CPU: GQA,
/// MQA and MHA; a one-token sequence, sequences that end inside a tile and
/// on a tile's edge, and a 4096-token one. The backward's scratch (buffer
/// 9) is not compared; its `out` and `lse` are the CPU forward's.
fn flash_attention_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed ^ 0xf1a5_0000);
    let mut cases = Vec::new();
    // batch, seq, heads, KV heads, head dim
    let shapes = [
        (2usize, 77usize, 4usize, 2usize, 128usize),
        (1, 300, 4, 1, 64),
        (3, 1, 2, 2, 64),
        (2, 64, 2, 1, 64),
        (1, 130, 3, 3, 128),
        (1, 4096, 2, 1, 128),
    ];
    for (batch, seq, heads, kv_heads, dim) in shapes {
        let d = attention_dims(batch, seq, heads, kv_heads, dim, dim);
        let forward: GpuRun<'static> =
            Box::new(move |s, st, x| s.attention_forward_flash(st, inputs(x), x[3], x[4], d));
        let backward: GpuRun<'static> = Box::new(move |s, st, x| {
            s.attention_backward_flash(st, inputs(x), (x[3], x[4], x[5]), grads(x), x[9], d)
        });
        let names = ("attention_forward_flash", "attention_backward_flash");
        let scratch = flash_attention_scratch_len(d);
        cases.extend(attention_pair(
            &mut rng,
            ("bf16", DType::Bf16),
            d,
            names,
            [forward, backward],
            scratch,
        ));
    }
    cases
}

fn attention_dims(
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    qk_dim: usize,
    v_dim: usize,
) -> AttentionDims {
    AttentionDims {
        tokens: Tokens::new(batch, seq),
        heads,
        kv_heads,
        qk_dim,
        v_dim,
        scale: 1.0 / (qk_dim as f32).sqrt(),
    }
}

/// q, k, v: a case's buffers 0-2.
fn inputs(x: &[GpuView]) -> AttentionInputs<GpuView> {
    AttentionInputs {
        q: x[0],
        k: x[1],
        v: x[2],
    }
}

/// dq, dk, dv: a backward case's buffers 6-8.
fn grads(x: &[GpuView]) -> AttentionInputs<GpuView> {
    AttentionInputs {
        q: x[6],
        k: x[7],
        v: x[8],
    }
}

/// A forward case (buffers `q, k, v, out, lse`) and a backward case
/// (`q, k, v, out, lse, dout, dq, dk, dv`, then `scratch` f32s when
/// non-zero, not compared) of attention over `d`, on inputs drawn from
/// `rng` in `dtype`, the GPU side running `gpu`; the backward's `out` and
/// `lse` are the CPU forward's, so the probabilities it recomputes are the
/// real ones.
fn attention_pair(
    rng: &mut Rng,
    (mode, a): (&'static str, DType),
    d: AttentionDims,
    (forward, backward): (&str, &str),
    [gpu_forward, gpu_backward]: [GpuRun<'static>; 2],
    scratch: usize,
) -> [Case<'static>; 2] {
    let rows = d.tokens.batch * d.tokens.seq;
    let shape = format!(
        "{}x{} {}h/{} qk {} v {}",
        d.tokens.batch, d.tokens.seq, d.heads, d.kv_heads, d.qk_dim, d.v_dim
    );
    let hq = rng.floats(rows * d.heads * d.qk_dim, a);
    let hk = rng.floats(rows * d.kv_heads * d.qk_dim, a);
    let hv = rng.floats(rows * d.kv_heads * d.v_dim, a);
    let (out, lse) = cpu_attention_forward(&hq, &hk, &hv, d);
    let forward = Case {
        kernel: forward.into(),
        mode,
        shape: shape.clone(),
        buffers: vec![
            hq.clone(),
            hk.clone(),
            hv.clone(),
            nan(out.len(), a),
            nan(lse.len(), DType::F32),
        ],
        outputs: vec![3, 4],
        cpu: cpu_attention_forward_run(d),
        gpu: gpu_forward,
        reference: None,
    };
    let (q_len, k_len, v_len) = (hq.len(), hk.len(), hv.len());
    let dout = rng.floats(rows * d.heads * d.v_dim, a);
    let mut buffers = vec![
        hq,
        hk,
        hv,
        out,
        lse,
        dout,
        nan(q_len, a),
        nan(k_len, a),
        nan(v_len, a),
    ];
    if scratch > 0 {
        buffers.push(nan(scratch, DType::F32));
    }
    let backward = Case {
        kernel: backward.into(),
        mode,
        shape,
        buffers,
        outputs: vec![6, 7, 8],
        cpu: cpu_attention_backward_run(d),
        gpu: gpu_backward,
        reference: None,
    };
    [forward, backward]
}

/// Embedding lookup and scatter-add: ids with many repeats, more rows than
/// one ordering chunk (2,048), more channels than one block (256), one
/// token taking half the rows (a long chain of adds), no rows at all, and
/// rows of whole 8-channel words (the backward's 8-a-thread path: 64, 264,
/// and the benchmark's 4,096 rows of 2,048); the backward into an f32
/// accumulator and, in bf16 mode, into a bf16 table.
fn lookup_cases(seed: u64) -> Vec<Case<'static>> {
    let mut rng = Rng(seed ^ 0x100c_0000);
    let mut cases = Vec::new();
    for (mode, a) in MODES {
        // rows, vocab, hidden, whether one token takes half the rows
        for (rows, vocab, hidden, skewed) in [
            (333usize, 1009usize, 77usize, false),
            (2500, 50, 300, false),
            (2100, 5000, 33, true),
            (0, 7, 5, false),
            (700, 40, 64, true),
            (600, 300, 264, false),
            (4096, 8192, 2048, false),
        ] {
            let d = LookupDims { vocab, hidden };
            let ids: Vec<u32> = (0..rows)
                .map(|_| {
                    if skewed && rng.below(2) == 0 {
                        7
                    } else {
                        rng.below(vocab) as u32
                    }
                })
                .collect();
            let shape = format!(
                "{rows} ids of {vocab}x{hidden}{}",
                if skewed { " skewed" } else { "" }
            );
            cases.push(Case {
                kernel: "embedding_forward".into(),
                mode,
                shape: shape.clone(),
                buffers: vec![
                    rng.floats(vocab * hidden, a),
                    Host::U32(ids.clone()),
                    nan(rows * hidden, a),
                ],
                outputs: vec![2],
                cpu: Box::new(move |b, x| b.embedding_forward(v(&x[0]), v(&x[1]), m(&x[2]), d)),
                gpu: Box::new(move |s, st, x| s.embedding_forward(st, x[0], x[1], x[2], d)),
                reference: None,
            });
            let tables = if a == DType::F32 {
                vec![DType::F32]
            } else {
                vec![DType::F32, DType::Bf16]
            };
            for table in tables {
                cases.push(Case {
                    kernel: "embedding_backward".into(),
                    mode,
                    shape: format!("{shape} into {table}"),
                    // The GPU's scratch last (filled with ones: the
                    // kernels must write what they read of it).
                    buffers: vec![
                        rng.floats(rows * hidden, a),
                        Host::U32(ids.clone()),
                        rng.floats(vocab * hidden, table),
                        Host::U32(vec![u32::MAX; rows * EMBEDDING_BACKWARD_SCRATCH_PER_ROW]),
                    ],
                    outputs: vec![2],
                    cpu: Box::new(move |b, x| {
                        b.embedding_backward(v(&x[0]), v(&x[1]), m(&x[2]), d)
                    }),
                    gpu: Box::new(move |s, st, x| {
                        s.embedding_backward(st, x[0], x[1], x[2], x[3], d)
                    }),
                    reference: None,
                });
            }
        }
    }
    cases
}

/// A bad token id is reported through the fault word (the lowest bad row),
/// and the refused call writes nothing anywhere: `out` keeps its NaNs and
/// `dtable` its values, though the other rows' ids, in other blocks, are
/// good.
fn lookup_fault_rows(gpu: &Gpu, set: &KernelSet) -> Vec<Row> {
    let (rows, vocab, hidden) = (2000usize, 50usize, 300usize);
    let d = LookupDims { vocab, hidden };
    let mut rng = Rng(0xbad1d);
    let mut ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
    ids[1500] = vocab as u32;
    ids[1900] = 1000;
    let want = "the token id of row 1500 is past the vocabulary";
    let mut out = Vec::new();
    for forward in [true, false] {
        let kernel = if forward {
            "embedding_forward"
        } else {
            "embedding_backward"
        };
        let buffers = if forward {
            vec![
                rng.floats(vocab * hidden, DType::F32),
                Host::U32(ids.clone()),
                nan(rows * hidden, DType::F32),
            ]
        } else {
            vec![
                rng.floats(rows * hidden, DType::F32),
                Host::U32(ids.clone()),
                rng.floats(vocab * hidden, DType::F32),
                Host::U32(vec![u32::MAX; rows * EMBEDDING_BACKWARD_SCRATCH_PER_ROW]),
            ]
        };
        let bufs: Vec<GpuBuf> = buffers.iter().map(|h| gpu.upload(h)).collect();
        let views: Vec<GpuView> = bufs
            .iter()
            .zip(&buffers)
            .map(|(b, h)| gpu.view(b, h))
            .collect();
        let launched = if forward {
            set.embedding_forward(&gpu.stream, views[0], views[1], views[2], d)
        } else {
            set.embedding_backward(&gpu.stream, views[0], views[1], views[2], views[3], d)
        };
        let problem = match launched.and_then(|()| set.take_fault(&gpu.stream)) {
            Ok(Some(fault)) if fault.to_string() == want => {
                let after = gpu.download(&bufs[2], buffers[2].len());
                (after.bits() != buffers[2].bits())
                    .then(|| "the refused call changed its output".to_string())
            }
            Ok(Some(fault)) => Some(format!("reported `{fault}`, expected `{want}`")),
            Ok(None) => Some("no fault reported".to_string()),
            Err(e) => Some(e.to_string()),
        };
        let clean = set
            .take_fault(&gpu.stream)
            .map(|f| f.is_none())
            .unwrap_or(false);
        out.push(Row {
            target: set.target(),
            kernel: format!("{kernel} (bad id)"),
            mode: "fault",
            shape: want.to_string(),
            error: 0.0,
            max_abs: 0.0,
            tolerance: 0.0,
            repeatable: clean,
            problem,
            note: String::new(),
        });
    }
    out
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "{:<10} {:<34} {:<5} {:<34} {:>10} {:>10} {:>9} {:>6}  result",
        "target", "kernel", "mode", "shape", "rel err", "max abs", "tol", "repeat"
    );
    for r in rows {
        println!(
            "{:<10} {:<34} {:<5} {:<34} {:>10.2e} {:>10.2e} {:>9.1e} {:>6}  {}",
            r.target.arch,
            r.kernel,
            r.mode,
            r.shape,
            r.error,
            r.max_abs,
            r.tolerance,
            if r.repeatable { "same" } else { "DIFF" },
            match (&r.problem, r.passed()) {
                (Some(p), _) => format!("FAIL: {p}"),
                (None, true) => format!("ok {}", r.note),
                (None, false) => format!("FAIL {}", r.note),
            }
        );
    }
    let failed = rows.iter().filter(|r| !r.passed()).count();
    println!("\n{} passed, {} failed", rows.len() - failed, failed);
}

/// The kernel families, one test each: a failure names its family, and a
/// family can be run alone (`cargo test --test cuda_kernels_run -- --ignored norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// Casts, fills and the copies that split and join projections.
    Layout,
    /// Element-wise kernels and sums.
    Elementwise,
    Norm,
    Conv,
    Scan,
    /// The gated delta rule of `G` layers.
    Delta,
    /// Attention (unfused and flash) and rotary embeddings.
    Attention,
    /// Routing, dispatch and combine.
    Moe,
    /// Embedding lookups and the cross-entropy loss.
    Lookup,
    Optimizer,
}

impl Family {
    /// The family of a case's kernel, by its name.
    fn of(kernel: &str) -> Family {
        let starts = |prefixes: &[&str]| prefixes.iter().any(|p| kernel.starts_with(p));
        if starts(&["rmsnorm"]) {
            Family::Norm
        } else if starts(&["ssd_scan"]) {
            Family::Scan
        } else if starts(&["gated_delta"]) {
            Family::Delta
        } else if starts(&["conv1d"]) {
            Family::Conv
        } else if starts(&["attention", "rotary"]) {
            Family::Attention
        } else if starts(&["moe_", "gather_rows", "scatter_rows"]) {
            Family::Moe
        } else if starts(&["embedding", "cross_entropy"]) {
            Family::Lookup
        } else if starts(&["adam", "sgd", "sum_squares"]) {
            Family::Optimizer
        } else if starts(&["cast", "fill", "copy_cols", "qkv_", "mla_kv_"]) {
            Family::Layout
        } else {
            Family::Elementwise
        }
    }
}

/// Every kernel compiled once a process, for the GPU's own target and the
/// portable one.
fn compiled(
    device: &hybridgen_runtime::cuda::GpuDevice,
) -> &'static [(Target, Vec<kernels::CompiledSource>)] {
    static COMPILED: std::sync::OnceLock<Vec<(Target, Vec<kernels::CompiledSource>)>> =
        std::sync::OnceLock::new();
    COMPILED.get_or_init(|| {
        let include = kernels::include_dir().unwrap_or_else(|why| panic!("{why}"));
        let mut targets = vec![device.target()];
        if device.target() != Target::PORTABLE {
            targets.push(Target::PORTABLE);
        }
        targets
            .into_iter()
            .map(|target| {
                let started = Instant::now();
                let compiled =
                    kernels::compile_all(target, &include).unwrap_or_else(|e| panic!("{e}"));
                println!(
                    "{target}: compiled {} sources in {:.2} s",
                    compiled.len(),
                    started.elapsed().as_secs_f64()
                );
                (target, compiled)
            })
            .collect()
    })
}

/// Runs every case of `family` (and its fault cases) on the first GPU for
/// each target, prints their table and fails on any that failed. The cases
/// are drawn as one sequence, so a family's inputs do not depend on which
/// families run.
fn family_matches_the_cpu(family: Family) {
    // The GPU is shared by the tests of this binary: one at a time.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let info = probe().unwrap_or_else(|why| panic!("needs a GPU: {why}"));
    let device = &info.devices[0];
    println!(
        "{device}; driver {}, NVRTC {}.{}; {family:?} kernels",
        info.driver_version, info.nvrtc_version.0, info.nvrtc_version.1
    );
    let context = CudaContext::new(device.ordinal).expect("the probed device opens");
    // The kernels are ordered by the stream alone (as the backend orders its
    // work with its own events). Each test's buffers are freed before the
    // next test takes its turn.
    // SAFETY: no buffer of this context is alive here.
    unsafe { context.disable_event_tracking() };
    let gpu = Gpu {
        stream: context.new_stream().expect("a stream"),
    };
    let mut rows = Vec::new();
    for (_, compiled) in compiled(device) {
        let set = KernelSet::load(&context, compiled).unwrap_or_else(|e| panic!("{e}"));
        for case in all_cases(0x5eed_cafe) {
            if Family::of(&case.kernel) == family {
                rows.push(run_case(&gpu, &set, &case));
            }
        }
        let faults = fault_rows(&gpu, &set)
            .into_iter()
            .chain(lookup_fault_rows(&gpu, &set));
        rows.extend(faults.filter(|r| Family::of(&r.kernel) == family));
    }
    assert!(!rows.is_empty(), "no {family:?} cases");
    print_table(&rows);
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.passed())
        .map(|r| format!("{} {} {} {}", r.target.arch, r.kernel, r.mode, r.shape))
        .collect();
    assert!(failed.is_empty(), "failed: {failed:#?}");
}

#[test]
#[ignore = "needs a GPU"]
fn layout_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Layout);
}

#[test]
#[ignore = "needs a GPU"]
fn elementwise_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Elementwise);
}

#[test]
#[ignore = "needs a GPU"]
fn norm_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Norm);
}

#[test]
#[ignore = "needs a GPU"]
fn conv_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Conv);
}

#[test]
#[ignore = "needs a GPU"]
fn scan_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Scan);
}

#[test]
#[ignore = "needs a GPU"]
fn delta_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Delta);
}

#[test]
#[ignore = "needs a GPU"]
fn attention_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Attention);
}

#[test]
#[ignore = "needs a GPU"]
fn moe_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Moe);
}

#[test]
#[ignore = "needs a GPU"]
fn lookup_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Lookup);
}

#[test]
#[ignore = "needs a GPU"]
fn optimizer_kernels_match_the_cpu_and_repeat() {
    family_matches_the_cpu(Family::Optimizer);
}

/// The exact cases' reference (`rmsnorm_block_tree`) is the norm the CPU
/// computes, up to the rounding of its summation order: checked without a
/// GPU, so a wrong index in the tree shows here rather than as a GPU
/// failure.
#[test]
fn the_norm_trees_agree_with_the_cpu_to_its_rounding() {
    let cpu = CpuBackend::new(Precision::F32);
    for case in norm_tree_cases(0x5eed_cafe) {
        let bufs: Vec<CpuBuf> = case.buffers.iter().map(|h| cpu_upload(&cpu, h)).collect();
        (case.cpu)(&cpu, &bufs).expect("the CPU's norm");
        let tree = (case.reference.expect("a reference"))(&case.buffers);
        for (k, &i) in case.outputs.iter().enumerate() {
            let got = cpu_download(&cpu, &bufs[i], &case.buffers[i]);
            let (error, _) = compare(&got, &tree[k]);
            let tolerance = tolerance(case.buffers[i].dtype());
            assert!(
                error <= tolerance,
                "{} output {i}: {error:e} > {tolerance:e}",
                case.shape
            );
        }
    }
}

/// Every kernel name the cases use falls in a family whose test runs it
/// (no GPU needed: the cases are drawn on the host).
#[test]
fn every_case_has_a_family() {
    let families: std::collections::BTreeSet<String> = all_cases(0x5eed_cafe)
        .iter()
        .map(|c| format!("{:?}", Family::of(&c.kernel)))
        .collect();
    assert_eq!(families.len(), 10, "{families:?}");
}

//! The backend conformance suite: every [`Backend`] method run on random
//! order-one inputs and checked against a plain f64 reference written here
//! from the maths documented on the method (never against another backend's
//! kernels, which would be circular for the CPU backend). The CPU backend
//! runs it in f32 and in bf16 (`tests/conformance.rs`); any other backend
//! runs [`run_all`] the same way and asserts the [`Report`] is clean.
//!
//! For every kernel case the suite checks:
//! - **values**: each output within the kernel's stated [`Tolerance`] of the
//!   reference, evaluated on the inputs *as stored* (bf16 inputs rounded the
//!   way the device stores them). A bf16 output is additionally allowed the
//!   one rounding at the store (relative `2^-8`): the backend contract is
//!   that kernels compute in f32 and round once, so anything looser is a
//!   backend rounding somewhere it should not. Results that are exact by
//!   their definition (copies, indices, f64 sums in a specified order) must
//!   be the reference rounded once to the output's dtype, bit for bit.
//! - **bit-repeatability**: the case runs twice from the same inputs and
//!   every output (and every host output) must be the same bits.
//! - **views**: every argument is a view into the middle of a larger buffer;
//!   the elements around it and every input must come back unchanged, so an
//!   ignored view offset or a write past the end is caught. Outputs that a
//!   kernel overwrites start as NaN (u32 ones as a huge index), so reading
//!   one before writing it shows; u32 guards hold out-of-range indices, so
//!   a kernel reading an index past its view fails its range check.
//! - **refusals** (on the first case of each kernel): every float argument
//!   given as u32 or f64, every f32-only argument given as bf16 or u32, every
//!   u32 index or f64 accumulator given as f32, and every pair that must
//!   share a dtype given two different ones, returns
//!   [`InvalidArgument`](crate::RuntimeError::InvalidArgument) naming the kernel and the argument;
//!   every argument one element too long returns `InvalidArgument` naming the
//!   kernel; bad indices, counts and dimensions likewise, and where a kernel
//!   promises that a refused call writes nothing, that every argument comes
//!   back unchanged. A panic is a failure, never
//!   an abort of the suite: every failing kernel shows in one run.
//!
//! **Layouts.** Float arguments that the kernel takes as "bf16 or f32" are
//! stored in the run's compute dtype, inputs and outputs alike; in bf16 the
//! suite also runs bf16 inputs into f32 outputs (weight gradients accumulate
//! into f32 buffers) and f32 inputs into bf16 outputs. Arguments a kernel
//! takes only in f32 (`rstd`, `lse`, scan `states`, losses, routing,
//! optimizer state) are f32 in every layout; indices are u32 and loss
//! accumulators f64 in every layout.
//!
//! Argument names in refusals are the ones the dtype errors use (`A`, `dq`,
//! `d_xbc`, ...): they are part of the contract, so an error on any backend
//! reads the same.
//!
//! **Adding a kernel** is local to its family's module: a `KernelCase` (`case.rs`)
//! lists the arguments (role, storage, initial values, or values a forward
//! would have saved), the reference returns the expected outputs, the launch
//! calls the backend; layouts, repetition, guards and the derived refusals
//! come from the argument list.

mod activation;
mod attention;
mod case;
mod delta;
mod dense;
mod lookup;
mod mamba;
mod memory;
mod moe;
mod norm;
mod optim;
mod reference;
mod report;
mod sparse_attention;

pub use report::{Check, CheckKind, Report, Tolerance};

use crate::backend::Backend;
use crate::view::DType;
use case::Layout;

/// How a run of the suite is set up.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Seed of the random inputs: a seed always gives the same inputs.
    pub seed: u64,
    /// Multiplies every tolerance. 1 for the CPU backend; a backend whose
    /// transcendental functions are a few ulps off libm's may need 2-4, and
    /// its test should say why.
    pub slack: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            seed: 0x5eed_c0de,
            slack: 1.0,
        }
    }
}

/// The kernel families, one function each (adding or changing a kernel is
/// local to its family's module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// alloc, upload, download, copy, cast, fill, zero.
    Memory,
    /// matmul, grouped_matmul, axpy, scale, copy_cols, column_sum,
    /// accumulate_sum.
    Dense,
    /// rmsnorm forward and both backwards.
    Norm,
    /// unary and silu_mul, forward and backward.
    Activation,
    /// conv1d and the SSD scan.
    Mamba,
    /// The gated delta rule.
    Delta,
    /// attention, rotary, qkv_split/join, mla_kv_split/join.
    Attention,
    /// DeepSeek sparse attention: the indexer, its top-k and loss, sparse
    /// attention, the LayerNorm with bias.
    SparseAttention,
    /// embedding and cross-entropy.
    Lookup,
    /// routing, expert counts, the dispatch sort, the expert-major regroup,
    /// the load-balancing loss, gather/scatter, unpermute.
    Moe,
    /// adam, sgd, sum_squares.
    Optimizer,
}

impl Family {
    pub const ALL: [Family; 11] = [
        Family::Memory,
        Family::Dense,
        Family::Norm,
        Family::Activation,
        Family::Mamba,
        Family::Delta,
        Family::Attention,
        Family::SparseAttention,
        Family::Lookup,
        Family::Moe,
        Family::Optimizer,
    ];
}

/// Runs every family on `device` and returns what it found.
pub fn run_all<B: Backend>(device: &B, options: &Options) -> Report {
    let mut suite = Suite::new(device, options);
    for family in Family::ALL {
        suite.run(family);
    }
    suite.finish()
}

/// One run of the suite against one device; [`run_all`] in steps, for a
/// backend test that wants only some families.
pub struct Suite<'d, B: Backend> {
    device: &'d B,
    slack: f64,
    rng: Rng,
    report: Report,
}

impl<'d, B: Backend> Suite<'d, B> {
    pub fn new(device: &'d B, options: &Options) -> Self {
        Suite {
            device,
            slack: options.slack,
            rng: Rng::new(options.seed),
            report: Report::new(device.name(), device.compute_dtype()),
        }
    }

    /// Checks one family, adding to the report.
    pub fn run(&mut self, family: Family) {
        match family {
            Family::Memory => memory::check(self),
            Family::Dense => dense::check(self),
            Family::Norm => norm::check(self),
            Family::Activation => activation::check(self),
            Family::Mamba => mamba::check(self),
            Family::Delta => delta::check(self),
            Family::Attention => attention::check(self),
            Family::SparseAttention => sparse_attention::check(self),
            Family::Lookup => lookup::check(self),
            Family::Moe => moe::check(self),
            Family::Optimizer => optim::check(self),
        }
    }

    pub fn finish(self) -> Report {
        self.report
    }

    /// The dtype layouts float kernels are checked in (see the module docs).
    fn layouts(&self) -> Vec<Layout> {
        let compute = self.device.compute_dtype();
        let mut layouts = vec![Layout {
            input: compute,
            output: compute,
        }];
        if compute == DType::Bf16 {
            layouts.push(Layout {
                input: DType::Bf16,
                output: DType::F32,
            });
            layouts.push(Layout {
                input: DType::F32,
                output: DType::Bf16,
            });
        }
        layouts
    }
}

/// splitmix64: a tiny, well-mixed generator, so the inputs depend on the
/// seed alone (no dependency, no platform differences). Public for the GPU
/// tests, which draw their inputs the same way.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * unit
    }

    pub fn values(&mut self, len: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..len).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `len` indices below `n`, repeats allowed.
    fn indices(&mut self, len: usize, n: usize) -> Vec<u32> {
        (0..len).map(|_| self.below(n) as u32).collect()
    }

    /// A random permutation of `0..n`.
    fn permutation(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

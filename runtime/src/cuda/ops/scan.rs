//! The Mamba-2 selective scan on a GPU: [`ScanKernels`] for
//! [`CudaBackend`] (the chunked form of [`super::scan_chunked`] where its
//! plan fits the backend's scratch cap, else the sequential kernels), and
//! the launchers of `kernels/scan.cu` on [`KernelSet`], which take views
//! `backend::scan`'s checks accepted.
//!
//! The kernels keep a thread's state elements in registers, so they come
//! in tiers by the state size N (a lane holds N/32 columns, rounded up to a
//! power of two) and the backward takes shapes whose per-thread share fits
//! (see [`KernelSet::ssd_scan_backward`]); other shapes are refused as
//! `Unsupported`, naming the limit. The backward needs a scratch area whose
//! size [`KernelSet::ssd_scan_backward_scratch_len`] gives, so that a step
//! allocates nothing.

use super::scan_chunked::ScanChunkPlan;
use crate::backend::ScanKernels;
use crate::backend::scan;
use crate::backend::{ScanDims, ScanGrads, ScanInputs, ScratchSettings};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{GpuView, KernelSet, dtype_tag, ensure, grid_for, per_item, product};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use crate::view::{View, ViewMut};
use cudarc::driver::CudaStream;

impl ScanKernels<CudaBuf> for CudaBackend {
    fn ssd_scan_forward_unchecked(
        &self,
        inputs: ScanInputs<View<'_, CudaBuf>>,
        y: ViewMut<'_, CudaBuf>,
        states: ViewMut<'_, CudaBuf>,
        dims: ScanDims,
    ) -> Result<()> {
        let inputs = self.scan_inputs(inputs);
        if let Some((plan, scratch, _scratch_buf)) = self.scan_chunk_plan(dims)? {
            return self.k().ssd_scan_forward_chunked(
                self.s(),
                &self.queue.blas,
                &self.gpu().queues,
                inputs,
                self.m(&y),
                self.m(&states),
                scratch,
                dims,
                plan,
            );
        }
        self.k()
            .ssd_scan_forward(self.s(), inputs, self.m(&y), self.m(&states), dims)
    }

    fn ssd_scan_backward_unchecked(
        &self,
        inputs: ScanInputs<View<'_, CudaBuf>>,
        states: View<'_, CudaBuf>,
        dy: View<'_, CudaBuf>,
        grads: ScanGrads<ViewMut<'_, CudaBuf>>,
        dims: ScanDims,
    ) -> Result<()> {
        let inputs = self.scan_inputs(inputs);
        let grads = ScanGrads {
            xbc: self.m(&grads.xbc),
            dt: self.m(&grads.dt),
            a_log: self.m(&grads.a_log),
            d: self.m(&grads.d),
        };
        if let Some((plan, scratch, _scratch_buf)) = self.scan_chunk_plan(dims)? {
            return self.k().ssd_scan_backward_chunked(
                self.s(),
                &self.queue.blas,
                &self.gpu().queues,
                inputs,
                self.v(states),
                self.v(dy),
                grads,
                scratch,
                dims,
                plan,
            );
        }
        let len = KernelSet::ssd_scan_backward_scratch_len(dims)?;
        let (scratch, _partials) = self.scratch(len, DType::F32)?;
        self.k().ssd_scan_backward(
            self.s(),
            inputs,
            self.v(states),
            self.v(dy),
            grads,
            scratch,
            dims,
        )
    }
}

impl CudaBackend {
    fn scan_inputs(&self, inputs: ScanInputs<View<'_, CudaBuf>>) -> ScanInputs<GpuView> {
        ScanInputs {
            xbc: self.v(inputs.xbc),
            dt: self.v(inputs.dt),
            dt_bias: self.v(inputs.dt_bias),
            a_log: self.v(inputs.a_log),
            d: self.v(inputs.d),
        }
    }

    /// The chunked scan's plan for `dims` under this backend's cap, with
    /// its scratch from the arena (a repeated step allocates nothing);
    /// `None`: the sequential kernels take the problem.
    fn scan_chunk_plan(&self, dims: ScanDims) -> Result<Option<(ScanChunkPlan, GpuView, CudaBuf)>> {
        let Some(plan) = ScanChunkPlan::new(dims, self.scan_scratch) else {
            return Ok(None);
        };
        let (scratch, buf) = self.scratch_uninit(plan.scratch_len(dims), DType::F32)?;
        Ok(Some((plan, scratch, buf)))
    }
}

/// Warps of a forward block (one state row each).
const FORWARD_WARPS: usize = 8;
/// Warps of a backward block at most (1024 threads).
const MAX_WARPS: usize = 32;
/// State elements a thread of the backward head kernel holds
/// (`HEAD_MAX_ELEMENTS` in `scan.cu`).
const HEAD_MAX_ELEMENTS: usize = 16;
/// State columns a block of the group kernel takes, and the (head, row)
/// pairs a thread holds at most (`GROUP_COLUMNS`, `GROUP_MAX_ROWS`).
const GROUP_COLUMNS: usize = 2;
const GROUP_MAX_ROWS: usize = 8;

/// Kernels compiled for states of at most `state` columns, each lane
/// holding `per_lane` of them.
struct Tier {
    state: usize,
    per_lane: usize,
    forward: &'static str,
    carry: &'static str,
    head: &'static str,
}

const TIERS: [Tier; 4] = [
    Tier {
        state: 32,
        per_lane: 1,
        forward: "ssd_scan_forward_n32",
        carry: "ssd_scan_chunk_carry_n32",
        head: "ssd_scan_backward_head_n32",
    },
    Tier {
        state: 64,
        per_lane: 2,
        forward: "ssd_scan_forward_n64",
        carry: "ssd_scan_chunk_carry_n64",
        head: "ssd_scan_backward_head_n64",
    },
    Tier {
        state: 128,
        per_lane: 4,
        forward: "ssd_scan_forward_n128",
        carry: "ssd_scan_chunk_carry_n128",
        head: "ssd_scan_backward_head_n128",
    },
    Tier {
        state: 256,
        per_lane: 8,
        forward: "ssd_scan_forward_n256",
        carry: "ssd_scan_chunk_carry_n256",
        head: "ssd_scan_backward_head_n256",
    },
];

fn unsupported(message: String) -> RuntimeError {
    RuntimeError::Unsupported(message)
}

fn tier(kernel: &str, state: usize) -> Result<&'static Tier> {
    TIERS.iter().find(|t| state <= t.state).ok_or_else(|| {
        unsupported(format!(
            "{kernel}: the CUDA scan takes state sizes up to 256 (N = {state}); use a smaller \
             `mamba.state_size` or run on the CPU"
        ))
    })
}

/// What the launchers take of a scan call's views: the inputs' dtype tags
/// (xbc, dt, dt_bias, a_log, d), the other float views' (forward: y;
/// backward: dy, d_xbc, d_dt), and the rows and chunks of the problem.
pub(super) struct Tagged<const N: usize> {
    pub inputs: [i32; 5],
    pub others: [i32; N],
    pub rows: usize,
    pub chunks: usize,
}

impl<const N: usize> Tagged<N> {
    fn new(dims: ScanDims, inputs: &ScanInputs<GpuView>, others: [&GpuView; N]) -> Self {
        let ScanInputs {
            xbc,
            dt,
            dt_bias,
            a_log,
            d,
        } = inputs;
        Tagged {
            inputs: [xbc, dt, dt_bias, a_log, d].map(|v| dtype_tag(v.dtype)),
            others: others.map(|v| dtype_tag(v.dtype)),
            rows: dims.tokens.batch * dims.tokens.seq,
            chunks: dims.tokens.seq.div_ceil(dims.chunk),
        }
    }
}

/// A scan forward's tags: its inputs' and `y`'s.
pub(super) fn forward_tags(dims: ScanDims, inputs: &ScanInputs<GpuView>, y: &GpuView) -> Tagged<1> {
    Tagged::new(dims, inputs, [y])
}

/// A scan backward's tags: its inputs', `dy`'s and the two overwritten
/// gradients'.
pub(super) fn backward_tags(
    dims: ScanDims,
    inputs: &ScanInputs<GpuView>,
    dy: &GpuView,
    grads: &ScanGrads<GpuView>,
) -> Tagged<3> {
    Tagged::new(dims, inputs, [dy, &grads.xbc, &grads.dt])
}

/// The dimensions every scan kernel takes after its pointers:
/// seq, heads, head_dim, groups, state, chunk.
pub(super) fn dims_args(dims: ScanDims) -> [u64; 6] {
    [
        dims.tokens.seq,
        dims.heads,
        dims.head_dim,
        dims.groups,
        dims.state,
        dims.chunk,
    ]
    .map(|v| v as u64)
}

/// How the backward spreads one shape over its blocks.
struct BackwardShape {
    tier: &'static Tier,
    head_warps: usize,
    /// Warps of a block of the group kernel (`ssd_scan_backward_group`).
    group_warps: usize,
}

impl BackwardShape {
    fn new(kernel: &str, dims: ScanDims) -> Result<BackwardShape> {
        let tier = tier(kernel, dims.state)?;
        // The head kernel: a warp per state row (rows p = w + warps j), a
        // thread holding rows_per_warp x per_lane elements of S and of G.
        let head_warps = dims.head_dim.min(MAX_WARPS);
        let rows_per_warp = dims.head_dim.div_ceil(head_warps);
        if rows_per_warp * tier.per_lane > HEAD_MAX_ELEMENTS {
            return Err(unsupported(format!(
                "{kernel}: the CUDA scan backward holds a head's state in 1024 threads, at most \
                 {HEAD_MAX_ELEMENTS} elements each, so head_dim x state_size (rounded up to \
                 {} columns) is at most 16384; P = {} and N = {} need {} a thread",
                tier.state,
                dims.head_dim,
                dims.state,
                rows_per_warp * tier.per_lane
            )));
        }
        // The group kernel: the group's (head, row) pairs over up to 32
        // warps, GROUP_MAX_ROWS a thread at most.
        let pairs = (dims.heads / dims.groups) * dims.head_dim;
        let group_warps = pairs.div_ceil(32).clamp(1, MAX_WARPS);
        if pairs.div_ceil(32 * group_warps) > GROUP_MAX_ROWS {
            return Err(unsupported(format!(
                "{kernel}: the CUDA scan backward takes at most {} (head, row) pairs a group \
                 (heads / groups x head_dim = {pairs}); use more groups",
                32 * MAX_WARPS * GROUP_MAX_ROWS
            )));
        }
        Ok(BackwardShape {
            tier,
            head_warps,
            group_warps,
        })
    }
}

impl KernelSet {
    /// Elements (f32) of the scratch [`KernelSet::ssd_scan_backward`]
    /// needs for `dims`: each step's dt and decay, each step's readout
    /// `dy . (S C)` (all `[rows, heads]`), every chunk's A_log and D
    /// gradient partials (`[batch, heads, chunks, 2]`) and total decay
    /// (`[batch, chunks, heads]`), and every chunk's carried state gradient
    /// (as many as `states`).
    pub fn ssd_scan_backward_scratch_len(dims: ScanDims) -> Result<usize> {
        let k = "ssd_scan_backward";
        let chunks = scan::chunks(k, dims)?;
        let parts = [
            product(k, &[3, dims.tokens.rows()?, dims.heads])?,
            product(k, &[3, dims.tokens.batch, dims.heads, chunks])?,
            product(
                k,
                &[
                    dims.tokens.batch,
                    chunks,
                    dims.heads,
                    dims.head_dim,
                    dims.state,
                ],
            )?,
        ];
        parts
            .into_iter()
            .try_fold(0usize, usize::checked_add)
            .ok_or_else(|| RuntimeError::InvalidArgument(format!("{k}: the scratch overflows")))
    }

    /// `Backend::ssd_scan_forward` (overwrites `y` and `states`). One warp
    /// per (sequence, head, state row), sequential in time.
    pub fn ssd_scan_forward(
        &self,
        stream: &CudaStream,
        inputs: ScanInputs<GpuView>,
        y: GpuView,
        states: GpuView,
        dims: ScanDims,
    ) -> Result<()> {
        let k = "ssd_scan_forward";
        let Tagged {
            inputs: [xt, dtt, bt, at, skt],
            others: [yt],
            rows,
            ..
        } = forward_tags(dims, &inputs, &y);
        if dims.head_dim == 0 || dims.state == 0 {
            return self.zero(stream, y);
        }
        if rows == 0 {
            return Ok(());
        }
        let tier = tier(k, dims.state)?;
        let warps = dims.head_dim.min(FORWARD_WARPS);
        let tiles = dims.head_dim.div_ceil(warps);
        let blocks = product(k, &[dims.tokens.batch, dims.heads, tiles])?;
        let config = per_item(blocks, (32 * warps) as u32)?;
        let ScanInputs {
            xbc,
            dt,
            dt_bias,
            a_log,
            d,
        } = inputs;
        let mut b = KernelArgs::new(stream, self.function(tier.forward)?);
        b.arg(&xbc.ptr)
            .arg(&xt)
            .arg(&dt.ptr)
            .arg(&dtt)
            .arg(&dt_bias.ptr)
            .arg(&bt);
        b.arg(&a_log.ptr)
            .arg(&at)
            .arg(&d.ptr)
            .arg(&skt)
            .arg(&y.ptr)
            .arg(&yt)
            .arg(&states.ptr);
        let args = dims_args(dims);
        for v in &args {
            b.arg(v);
        }
        self.go(tier.forward, &mut b, config)
    }

    /// `Backend::ssd_scan_backward` (overwrites `grads.xbc` and `grads.dt`,
    /// accumulates into `grads.a_log` and `grads.d`), with `scratch` an f32
    /// view of at least [`KernelSet::ssd_scan_backward_scratch_len`]
    /// elements that nothing else uses until it returns (its contents on
    /// entry do not matter).
    ///
    /// Six launches, every chunk of every sequence in parallel after the
    /// third: the steps' dt and decay; one block per (sequence, chunk,
    /// head) for the state gradient the chunk alone sends back, and a pass
    /// over the chunks that turns those into what enters each chunk (see
    /// `scan.cu`); one block per (sequence, head, chunk) for dx, d dt and
    /// the A_log and D partials, holding up to 16 state elements a thread
    /// (head_dim x state_size up to 16384); one block per (sequence, group,
    /// two state columns, chunk) for dB and dC, over the group's heads x
    /// head_dim (up to 8192) rows; and the partials' sum over the chunks
    /// and sequences.
    #[allow(clippy::too_many_arguments)]
    pub fn ssd_scan_backward(
        &self,
        stream: &CudaStream,
        inputs: ScanInputs<GpuView>,
        states: GpuView,
        dy: GpuView,
        grads: ScanGrads<GpuView>,
        scratch: GpuView,
        dims: ScanDims,
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let Tagged {
            inputs: [xt, dtt, bt, at, skt],
            others: [dyt, dxt, ddtt],
            rows,
            ..
        } = backward_tags(dims, &inputs, &dy, &grads);
        let ScanGrads {
            xbc: d_xbc,
            dt: d_dt,
            a_log: d_a_log,
            d: d_d,
        } = grads;
        scratch.operand().exactly(DType::F32, k, "scratch")?;
        let need = Self::ssd_scan_backward_scratch_len(dims)?;
        ensure(scratch.len >= need, || {
            format!(
                "{k}: `scratch` has {} elements, but these dimensions need at least {need} \
                 (KernelSet::ssd_scan_backward_scratch_len)",
                scratch.len
            )
        })?;
        if dims.head_dim == 0 || dims.state == 0 || rows == 0 {
            self.zero(stream, d_xbc)?;
            return self.zero(stream, d_dt);
        }
        let shape = BackwardShape::new(k, dims)?;
        let ScanInputs {
            xbc,
            dt,
            dt_bias,
            a_log,
            d,
        } = inputs;
        let (heads_u, batch_u, seq_u) = (
            dims.heads as u64,
            dims.tokens.batch as u64,
            dims.tokens.seq as u64,
        );
        let chunks = dims.tokens.seq.div_ceil(dims.chunk);
        let chunks_u = chunks as u64;
        let args = dims_args(dims);

        let kf = "ssd_scan_factors";
        let mut b = KernelArgs::new(stream, self.function(kf)?);
        b.arg(&dt.ptr)
            .arg(&dtt)
            .arg(&dt_bias.ptr)
            .arg(&bt)
            .arg(&a_log.ptr)
            .arg(&at);
        b.arg(&scratch.ptr)
            .arg(&batch_u)
            .arg(&seq_u)
            .arg(&heads_u)
            .arg(&chunks_u);
        self.go(kf, &mut b, grid_for(rows * dims.heads))?;

        let kc = shape.tier.carry;
        let head_threads = (32 * shape.head_warps) as u32;
        let chunk_blocks = product(k, &[dims.tokens.batch, chunks, dims.heads])?;
        let mut b = KernelArgs::new(stream, self.function(kc)?);
        b.arg(&xbc.ptr).arg(&xt).arg(&dy.ptr).arg(&dyt);
        b.arg(&scratch.ptr).arg(&batch_u);
        for v in &args {
            b.arg(v);
        }
        self.go(kc, &mut b, per_item(chunk_blocks, head_threads)?)?;

        let parts = SequentialScratch::new(scratch, rows, dims, chunks);
        self.ssd_scan_carry_combine(stream, (parts.carry, 0), parts.chunk_decay, dims, chunks)?;

        let kh = shape.tier.head;
        let head_blocks = product(k, &[dims.tokens.batch, dims.heads, chunks])?;
        let mut b = KernelArgs::new(stream, self.function(kh)?);
        b.arg(&xbc.ptr)
            .arg(&xt)
            .arg(&dt.ptr)
            .arg(&dtt)
            .arg(&dt_bias.ptr)
            .arg(&bt);
        b.arg(&a_log.ptr).arg(&at).arg(&d.ptr).arg(&skt);
        b.arg(&states.ptr)
            .arg(&dy.ptr)
            .arg(&dyt)
            .arg(&d_xbc.ptr)
            .arg(&dxt)
            .arg(&d_dt.ptr)
            .arg(&ddtt);
        b.arg(&scratch.ptr);
        for v in &args {
            b.arg(v);
        }
        self.go(kh, &mut b, per_item(head_blocks, head_threads)?)?;

        let kg = "ssd_scan_backward_group";
        let group_blocks = product(
            k,
            &[
                dims.tokens.batch,
                dims.groups,
                dims.state.div_ceil(GROUP_COLUMNS),
                chunks,
            ],
        )?;
        let mut b = KernelArgs::new(stream, self.function(kg)?);
        b.arg(&xbc.ptr)
            .arg(&xt)
            .arg(&states.ptr)
            .arg(&dy.ptr)
            .arg(&dyt)
            .arg(&d_xbc.ptr)
            .arg(&dxt);
        b.arg(&scratch.ptr).arg(&batch_u);
        for v in &args {
            b.arg(v);
        }
        self.go(
            kg,
            &mut b,
            per_item(group_blocks, (32 * shape.group_warps) as u32)?,
        )?;

        self.ssd_scan_backward_params(stream, parts.partials, dims, chunks, d_a_log, d_d)
    }

    /// `ssd_scan_carry_combine`: the carry entering each chunk from the
    /// chunks' own (`carry`, `[batch, chunks, H, P, N]`, in place) and
    /// their total decays (`chunk_decay`, `[batch, chunks, H]`), and into
    /// `copy` (the same layout in bf16) unless it is 0. Both backward paths
    /// share it.
    pub(super) fn ssd_scan_carry_combine(
        &self,
        stream: &CudaStream,
        (carry, copy): (u64, u64),
        chunk_decay: u64,
        dims: ScanDims,
        chunks: usize,
    ) -> Result<()> {
        let k = "ssd_scan_carry_combine";
        let [batch, heads, pn, chunks_u] = [
            dims.tokens.batch,
            dims.heads,
            dims.head_dim * dims.state,
            chunks,
        ]
        .map(|v| v as u64);
        let quads = combine_quads(pn, carry, copy);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&carry)
            .arg(&copy)
            .arg(&chunk_decay)
            .arg(&batch)
            .arg(&heads);
        b.arg(&pn).arg(&chunks_u).arg(&quads);
        let elements = product(
            k,
            &[dims.tokens.batch, dims.heads, dims.head_dim, dims.state],
        )?;
        self.go(
            k,
            &mut b,
            grid_for(elements / if quads == 1 { 4 } else { 1 }),
        )
    }

    /// `ssd_scan_backward_params`: adds the chunks' A_log and D gradient
    /// partials (`partials`, `[batch, H, chunks, 2]`) into `d_a_log` and
    /// `d_d`, sequence by sequence. Both backward paths share it.
    pub(super) fn ssd_scan_backward_params(
        &self,
        stream: &CudaStream,
        partials: u64,
        dims: ScanDims,
        chunks: usize,
        d_a_log: GpuView,
        d_d: GpuView,
    ) -> Result<()> {
        let k = "ssd_scan_backward_params";
        let (dat, ddt) = (dtype_tag(d_a_log.dtype), dtype_tag(d_d.dtype));
        let [batch, heads, chunks_u] = [dims.tokens.batch, dims.heads, chunks].map(|v| v as u64);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&partials).arg(&batch).arg(&heads).arg(&chunks_u);
        b.arg(&d_a_log.ptr).arg(&dat).arg(&d_d.ptr).arg(&ddt);
        self.go(k, &mut b, grid_for(dims.heads))
    }
}

/// Where the sequential backward's scratch keeps what the shared kernels
/// read (device addresses; `ScanScratch` in `scan.cu`): after each step's
/// dt, decay and readout (`3 rows H`), the chunks' partials (`[batch, H,
/// chunks, 2]`), total decays (`[batch, chunks, H]`) and carries.
struct SequentialScratch {
    partials: u64,
    chunk_decay: u64,
    carry: u64,
}

impl SequentialScratch {
    fn new(scratch: GpuView, rows: usize, dims: ScanDims, chunks: usize) -> SequentialScratch {
        let f32_bytes = DType::F32.bytes() as u64;
        let per_chunk = (dims.tokens.batch * dims.heads * chunks) as u64;
        let partials = scratch.ptr + 3 * (rows * dims.heads) as u64 * f32_bytes;
        let chunk_decay = partials + 2 * per_chunk * f32_bytes;
        SequentialScratch {
            partials,
            chunk_decay,
            carry: chunk_decay + per_chunk * f32_bytes,
        }
    }
}

/// Whether the carry and state combines take four elements a thread (their
/// `quads`, 1 or 0): `[.., P N]` rows of a multiple of 4, the f32 array
/// 16-byte and its bf16 copy (if any, else 0) 8-byte aligned.
pub(super) fn combine_quads(pn: u64, values: u64, copy: u64) -> i32 {
    i32::from(pn.is_multiple_of(4) && values.is_multiple_of(16) && copy.is_multiple_of(8))
}

/// The most scratch (bytes) one scan call takes under `settings`
/// (`Backend::kernel_scratch`): the chunked form's, forward and backward
/// alike, where its plan fits the cap, else the sequential backward's.
pub fn scan_scratch_bytes(dims: ScanDims, settings: ScratchSettings) -> u64 {
    let bytes = match ScanChunkPlan::new(dims, settings.scan_cap) {
        Some(plan) => plan.scratch_bytes(dims),
        None => KernelSet::ssd_scan_backward_scratch_len(dims)
            .unwrap_or(usize::MAX / 4)
            .saturating_mul(4),
    };
    bytes as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    fn dims(head_dim: usize, state: usize, heads: usize, groups: usize) -> ScanDims {
        ScanDims {
            tokens: Tokens::new(2, 100),
            heads,
            head_dim,
            groups,
            state,
            chunk: 64,
        }
    }

    #[test]
    fn state_sizes_pick_the_smallest_tier_that_holds_them() {
        let per_lane = |n| tier("k", n).map(|t| t.per_lane).unwrap();
        assert_eq!(
            [1, 32, 33, 64, 65, 128, 129, 256].map(per_lane),
            [1, 1, 2, 2, 4, 4, 8, 8]
        );
        let err = tier("ssd_scan_forward", 257).err().unwrap().to_string();
        assert!(
            err.contains("ssd_scan_forward") && err.contains("257"),
            "{err}"
        );
    }

    #[test]
    fn the_backward_takes_realistic_shapes_and_names_the_limit_of_others() {
        // Mamba-2 / Nemotron-H: P = 64, N = 128, 8 heads a group.
        let shape = BackwardShape::new("k", dims(64, 128, 64, 8)).unwrap();
        assert_eq!(shape.head_warps, 32);
        assert_eq!(shape.group_warps, 16);
        // A warp for each 32 of a group's (head, row) pairs, up to 32.
        assert_eq!(
            BackwardShape::new("k", dims(3, 16, 2, 1))
                .unwrap()
                .group_warps,
            1
        );
        assert_eq!(
            BackwardShape::new("k", dims(64, 16, 33, 1))
                .unwrap()
                .group_warps,
            32
        );
        for (p, n) in [(128, 128), (64, 256), (512, 32), (3, 3)] {
            assert!(
                BackwardShape::new("k", dims(p, n, 2, 1)).is_ok(),
                "{p} x {n}"
            );
        }
        let err = BackwardShape::new("ssd_scan_backward", dims(256, 128, 2, 1))
            .err()
            .unwrap();
        assert!(matches!(err, RuntimeError::Unsupported(_)));
        assert!(err.to_string().contains("P = 256 and N = 128"), "{err}");
        // 129 heads of 64 rows in one group: 8256 (head, row) pairs.
        let err = BackwardShape::new("k", dims(64, 16, 129, 1)).err().unwrap();
        assert!(err.to_string().contains("8256"), "{err}");
        assert!(BackwardShape::new("k", dims(64, 16, 128, 1)).is_ok());
    }

    #[test]
    fn the_scratch_holds_three_values_a_step_and_head_three_a_chunk_and_head_and_the_carries() {
        // 2 sequences of 100 steps in chunks of 64: 2 chunks each.
        let d = dims(64, 128, 6, 2);
        assert_eq!(
            KernelSet::ssd_scan_backward_scratch_len(d).unwrap(),
            3 * 200 * 6 + 3 * 2 * 6 * 2 + 2 * 2 * 6 * 64 * 128
        );
        let huge = ScanDims {
            tokens: Tokens::new(usize::MAX / 2, 3),
            ..d
        };
        assert!(KernelSet::ssd_scan_backward_scratch_len(huge).is_err());
    }
}

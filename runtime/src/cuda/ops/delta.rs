//! The gated delta rule on a GPU: [`DeltaKernels`] for [`CudaBackend`],
//! and the launchers of `kernels/delta.cu` (which has the maths; f32) and
//! `kernels/delta_tensor_core.cu` (bf16 on tensor cores) on
//! [`KernelSet`], taking views `backend::delta`'s checks accepted.
//!
//! The recurrence runs in chunked form, chunks of [`DELTA_CHUNK`] steps:
//! a kernel prepares every chunk at once (the UT transform: the chunk's
//! `T = (I + A)^-1`, `W` and `U`, and its intra-chunk scores), one block
//! a (sequence, value head, 16 state columns) then walks the chunks in
//! order with the state in shared memory. The backward prepares the
//! chunks again from the saved states, walks them in reverse with the
//! state's gradient, then computes every chunk's gradients at once. All of
//! it is f32; only the inputs and outputs keep their dtype.
//!
//! Where the storage is bf16 (`qkv` and the output) and both head dims are
//! multiples of 16 up to 128 ([`tensor_core_forward`]), the forward runs on
//! tensor cores instead (`delta_tc_prep`, `delta_tc_walk`,
//! `delta_tc_output`: bf16 operands, f32 sums, the state kept in f32), as
//! flash-linear-attention's `chunk_gated_delta_rule` does; its results are
//! those of bf16 products, not the f32 path's. The backward's tensor-core
//! kernels (`delta_tc_dvl`, `delta_tc_back_walk`, `delta_tc_back_chunk`,
//! then the f32 path's norm and A_log kernels) are written and compile, but
//! wait behind [`tensor_core_backward`] for a run on a GPU; until then the
//! backward is the f32 path's for every storage.
//!
//! The kernels need scratch in proportion to the chunks
//! ([`delta_scratch_len`]), taken from the arena through
//! `CudaBackend::scratch_uninit` (a repeated step allocates nothing) and
//! counted by the memory plan ([`delta_scratch_bytes`]). The chunk must be
//! [`DELTA_CHUNK`] (the `G` layer's `STATE_CHUNK`) and the key head at most
//! [`DELTA_MAX_DK`] wide; other shapes are refused as `Unsupported`.

use crate::backend::{DeltaDims, DeltaGrads, DeltaInputs, DeltaKernels, ScratchSettings};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{GpuView, KernelSet, dtype_tag, per_item, reserve_dynamic_shared};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, View, ViewMut};
use cudarc::driver::{CudaContext, CudaFunction, sys};
use cudarc::driver::{CudaStream, DeviceRepr, LaunchConfig};
use std::collections::HashMap;

/// The steps of a chunk (`DELTA_CHUNK` in `delta.cuh`).
pub const DELTA_CHUNK: usize = 64;
/// The widest key head (`DELTA_MAX_DK`): the state kernels keep a key
/// head's rows of 16 state columns in shared memory.
pub const DELTA_MAX_DK: usize = 128;
/// Refuses, before any work, `G` layers the GPU kernels cannot run (`train`
/// calls it for a GPU run whose pattern has `G`); the same limit the
/// launchers check, said in the model file's terms.
pub fn check_model(model: &hybridgen_dsl::ModelConfig) -> Result<()> {
    match &model.gdn {
        Some(g) if g.key_head_dim > DELTA_MAX_DK => Err(RuntimeError::Unsupported(format!(
            "`gdn.key_head_dim = {}` is wider than the GPU's gated delta rule kernels take \
             ({DELTA_MAX_DK}): give key heads of at most {DELTA_MAX_DK} channels, or train \
             this model on the CPU",
            g.key_head_dim
        ))),
        _ => Ok(()),
    }
}

/// State columns a state block takes (`DELTA_TILE`).
const DELTA_TILE: usize = 16;
/// Threads of every block (`DELTA_THREADS`).
const THREADS: u32 = 256;
/// The most blocks (each with a workspace of its own) the per-chunk
/// backward runs: two an SM of an H100 or H200, and a fixed number, so
/// that the scratch does not depend on the device.
const WORKSPACES: usize = 264;

/// Threads of the tensor-core kernels' blocks (`DELTA_TC_THREADS`).
const TC_THREADS: u32 = 128;
/// Threads of `delta_tc_back_chunk`'s blocks (`DELTA_TC_CHUNK_THREADS`):
/// eight warps, since its shared memory allows one block an SM.
const TC_CHUNK_THREADS: u32 = 256;
/// State columns a tensor-core walk block takes (`DELTA_TC_COLS`).
const TC_COLS: usize = 16;
/// The widest head either dim may have on the tensor-core path: a warp's
/// accumulators hold 128 output columns, the walk's warps 128 key rows.
const TC_MAX_DIM: usize = 128;
/// Pitches (`DELTA_T_PITCH`, `DELTA_F_PITCH`, `DELTA_COL_PITCH`).
const TC_T_PITCH: usize = 72;
const TC_F_PITCH: usize = 65;
const TC_COL_PITCH: usize = 24;

/// Whether the forward runs on tensor cores: bf16 `qkv` and output, both
/// head dims multiples of 16 up to `TC_MAX_DIM` (the mma tiles' 16 and
/// the accumulators a warp holds), and the alignments the kernels' pair and
/// 16-byte accesses need.
pub fn tensor_core_forward(qkv: DType, out: DType, dims: DeltaDims) -> bool {
    let dim_fits = |d: usize| d > 0 && d.is_multiple_of(16) && d <= TC_MAX_DIM;
    qkv == DType::Bf16 && out == DType::Bf16 && dim_fits(dims.key_dim) && dim_fits(dims.value_dim)
}

/// Whether the backward runs on tensor cores: for the storage and dims
/// [`tensor_core_forward`] takes (`d_out` in place of the output).
pub fn tensor_core_backward(qkv: DType, d_out: DType, dims: DeltaDims) -> bool {
    tensor_core_forward(qkv, d_out, dims)
}

/// f32 elements of one (sequence, chunk, value head) item's part of the
/// tensor-core kernels' scratch (`tc_item_bytes` in
/// `delta_tensor_core.cu`): G and
/// beta in f32, then the normalised k and q, W, U, V' and T in bf16.
fn tc_item_len(dims: DeltaDims) -> usize {
    128 + 32 * (3 * dims.key_dim + 2 * dims.value_dim) + 2048
}

/// f32 elements of one item's part of what the tensor-core backward's walk
/// leaves (`tc_back_at`): M^T dO and dV' `[64, dv]`, dH_L `[dv, dk]`, bf16.
/// Checked (by the tests) to fit the f32 path's part, which
/// [`delta_scratch_len`] counts.
#[cfg(test)]
fn tc_back_len(dims: DeltaDims) -> usize {
    64 * dims.value_dim + dims.value_dim * dims.key_dim / 2
}

/// Dynamic shared memory (bytes) of `delta_tc_dvl`, `delta_tc_back_walk`
/// and `delta_tc_back_chunk`, as the kernels carve it.
fn tc_backward_shared_bytes(dk: usize, dv: usize) -> [usize; 3] {
    let (pk, pv) = (dk + 8, dv + 8);
    let bf16 = DType::Bf16.bytes();
    let f32 = DType::F32.bytes();
    let dvl = bf16 * DELTA_CHUNK * (2 * pk + pv);
    // Two W buffers, K, Q; H_0, dH, gamma dO and -dV' (pitch
    // TC_COL_PITCH); dO's, U's and M^T dO's columns as loaded, H_0's f32
    // columns, G.
    let walk = bf16
        * (4 * DELTA_CHUNK * pk
            + 2 * (dk + DELTA_CHUNK) * TC_COL_PITCH
            + 3 * DELTA_CHUNK * TC_COLS)
        + f32 * (TC_COLS * dk + DELTA_CHUNK);
    let chunk = bf16
        * (3 * DELTA_CHUNK * pk + 4 * DELTA_CHUNK * pv + dv * pk + 4 * DELTA_CHUNK * TC_T_PITCH)
        + f32 * (2 * DELTA_CHUNK * TC_F_PITCH + 17 * DELTA_CHUNK + 32);
    [dvl, walk, chunk]
}

/// The tensor-core backward's own kernels, in launch order (after
/// `delta_tc_prep`).
const TC_BACKWARD_KERNELS: [&str; 3] =
    ["delta_tc_dvl", "delta_tc_back_walk", "delta_tc_back_chunk"];

/// Dynamic shared memory (bytes) of `delta_tc_prep`, `delta_tc_walk` and
/// `delta_tc_output`, as the kernels carve it.
fn tc_shared_bytes(dk: usize, dv: usize) -> [usize; 3] {
    let (pk, pv) = (dk + 8, dv + 8);
    let bf16 = DType::Bf16.bytes();
    let f32 = DType::F32.bytes();
    let prep = bf16 * (DELTA_CHUNK * (pk + pv) + 2 * DELTA_CHUNK * TC_T_PITCH)
        + f32 * (2 * DELTA_CHUNK * TC_F_PITCH + 3 * 256 + 2 * DELTA_CHUNK);
    let walk = bf16 * (2 * DELTA_CHUNK * pk + (dk + DELTA_CHUNK) * TC_COL_PITCH)
        + bf16 * DELTA_CHUNK * TC_COLS
        + f32 * DELTA_CHUNK;
    let output = bf16 * (2 * DELTA_CHUNK * pk + dv * pk + DELTA_CHUNK * pv);
    [prep, walk, output]
}

/// The tensor-core forward's kernels, in launch order.
const TC_KERNELS: [&str; 3] = ["delta_tc_prep", "delta_tc_walk", "delta_tc_output"];

/// The dynamic shared memory (bytes) each tensor-core kernel may take, by
/// its place in [`TC_KERNELS`] and [`TC_BACKWARD_KERNELS`], granted when
/// the kernels load ([`reserve_shared_memory`]). What a kernel needs grows
/// with the head sizes, so a call whose needs are within the grants runs
/// on tensor cores without asking the driver anything.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DeltaShared {
    forward: [usize; 3],
    backward: [usize; 3],
}

/// Whether every kernel's need in `bytes` is within its grant.
fn granted(grants: [usize; 3], bytes: [usize; 3]) -> bool {
    bytes.iter().zip(grants).all(|(&need, grant)| need <= grant)
}

/// Grants each tensor-core kernel what it needs at the widest heads it
/// takes ([`TC_MAX_DIM`]), or the most a block may opt into where that is
/// less (a device with less shared memory still runs narrower heads on
/// tensor cores); 0 where the device grants nothing.
pub(super) fn reserve_shared_memory(
    context: &CudaContext,
    functions: &HashMap<&'static str, CudaFunction>,
) -> DeltaShared {
    let opt_in = context
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .ok()
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(0);
    let grant = |kernels: [&str; 3], widest: [usize; 3]| {
        let mut grants = [0; 3];
        for ((kernel, bytes), grant) in kernels.into_iter().zip(widest).zip(&mut grants) {
            let bytes = bytes.min(opt_in);
            if functions
                .get(kernel)
                .is_some_and(|f| reserve_dynamic_shared(f, bytes))
            {
                *grant = bytes;
            }
        }
        grants
    };
    DeltaShared {
        forward: grant(TC_KERNELS, tc_shared_bytes(TC_MAX_DIM, TC_MAX_DIM)),
        backward: grant(
            TC_BACKWARD_KERNELS,
            tc_backward_shared_bytes(TC_MAX_DIM, TC_MAX_DIM),
        ),
    }
}

/// The launch's views and dimensions, laid out as `DeltaParams` in
/// `delta.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DeltaParams {
    qkv: u64,
    beta: u64,
    alpha: u64,
    dt_bias: u64,
    a_log: u64,
    out: u64,
    states: u64,
    scratch: u64,
    d_qkv: u64,
    d_beta: u64,
    d_alpha: u64,
    d_a_log: u64,
    t_qkv: i32,
    t_beta: i32,
    t_alpha: i32,
    t_dt_bias: i32,
    t_a_log: i32,
    t_out: i32,
    t_d_qkv: i32,
    t_d_beta: i32,
    t_d_alpha: i32,
    t_d_a_log: i32,
    batch: i32,
    seq: i32,
    key_heads: i32,
    value_heads: i32,
    dk: i32,
    dv: i32,
    chunks: i32,
    workspaces: i32,
    scale: f32,
    pad: i32,
}

// SAFETY: plain data, laid out (`repr(C)`) as `DeltaParams` in delta.cuh:
// twelve u64, then twenty 4-byte fields (176 bytes, no padding).
unsafe impl DeviceRepr for DeltaParams {}
const _: () = assert!(std::mem::size_of::<DeltaParams>() == 176);

/// The shape the kernels take, or why not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DeltaPlan {
    rows: usize,
    chunks: usize,
    /// (sequence, chunk, value head) items.
    items: usize,
    /// State blocks: (sequence, value head, 16 state columns).
    state_blocks: usize,
    workspaces: usize,
}

impl DeltaPlan {
    fn new(kernel: &str, dims: DeltaDims) -> Result<DeltaPlan> {
        let unsupported = |why: String| Err(RuntimeError::Unsupported(format!("{kernel}: {why}")));
        if dims.chunk != DELTA_CHUNK {
            return unsupported(format!(
                "the GPU kernels take chunks of {DELTA_CHUNK} steps, not {} (the G layer's \
                 STATE_CHUNK)",
                dims.chunk
            ));
        }
        if dims.key_dim > DELTA_MAX_DK {
            return unsupported(format!(
                "key heads of {} channels exceed the GPU kernels' {DELTA_MAX_DK}: give \
                 `gdn.key_head_dim` at most {DELTA_MAX_DK}, or train on the CPU",
                dims.key_dim
            ));
        }
        let rows = dims.tokens.rows()?;
        let chunks = dims.tokens.seq.div_ceil(DELTA_CHUNK);
        let items = dims.tokens.batch * chunks * dims.value_heads;
        let state_blocks =
            dims.tokens.batch * dims.value_heads * dims.value_dim.div_ceil(DELTA_TILE);
        let fits = |n: usize| i32::try_from(n).is_ok();
        let big = [
            rows,
            items,
            state_blocks,
            rows * dims.key_heads,
            dims.value_heads * dims.value_dim,
        ];
        if !big.into_iter().all(fits) || delta_scratch_len(dims, true).is_none() {
            return unsupported(format!(
                "{} sequences of {} steps with {} value heads exceed the kernels' indexing",
                dims.tokens.batch, dims.tokens.seq, dims.value_heads
            ));
        }
        Ok(DeltaPlan {
            rows,
            chunks,
            items,
            state_blocks,
            workspaces: items.min(WORKSPACES),
        })
    }
}

/// Elements (f32) of the scratch the forward (`backward` false) or the
/// backward takes for `dims` (the layout in `delta.cuh`): per
/// (sequence, chunk, value head) the chunk's preparation, and for the
/// backward also its `V'`, `dV'` and end-state gradient, the per-value-head
/// query and key gradients of every row, A_log's partials and the
/// per-chunk blocks' workspaces. `None` past `usize`.
pub fn delta_scratch_len(dims: DeltaDims, backward: bool) -> Option<usize> {
    let (dk, dv) = (dims.key_dim, dims.value_dim);
    let chunks = dims.tokens.seq.div_ceil(DELTA_CHUNK);
    let items = dims
        .tokens
        .batch
        .checked_mul(chunks)?
        .checked_mul(dims.value_heads)?;
    let square = DELTA_CHUNK * DELTA_CHUNK;
    let prep = (5 * dk)
        .checked_add(dv)?
        .checked_mul(DELTA_CHUNK)?
        .checked_add(2 * DELTA_CHUNK + 3 * square)?;
    let forward = items.checked_mul(prep)?;
    if !backward {
        return Some(forward);
    }
    let back = dv.checked_mul(2 * DELTA_CHUNK + dk)?;
    let rows = dims.tokens.rows().ok()?;
    let per_row = rows.checked_mul(dims.value_heads)?.checked_mul(dk)?;
    let partials = dims
        .tokens
        .batch
        .checked_mul(dims.value_heads)?
        .checked_mul(chunks)?;
    let work = (4 * dk)
        .checked_add(dv)?
        .checked_mul(DELTA_CHUNK)?
        .checked_add(5 * square)?;
    forward
        .checked_add(items.checked_mul(back)?)?
        .checked_add(per_row.checked_mul(2)?)?
        .checked_add(partials)?
        .checked_add(items.min(WORKSPACES).checked_mul(work)?)
}

/// The most scratch (bytes) one gated delta rule call takes
/// (`Backend::kernel_scratch`): the backward's.
pub fn delta_scratch_bytes(dims: DeltaDims, _settings: ScratchSettings) -> u64 {
    delta_scratch_len(dims, true)
        .map_or(u64::MAX / 4, |len| len as u64)
        .saturating_mul(DType::F32.bytes() as u64)
}

impl DeltaKernels<CudaBuf> for CudaBackend {
    fn gated_delta_forward_unchecked(
        &self,
        inputs: DeltaInputs<View<'_, CudaBuf>>,
        out: ViewMut<'_, CudaBuf>,
        states: ViewMut<'_, CudaBuf>,
        dims: DeltaDims,
    ) -> Result<()> {
        let plan = DeltaPlan::new("gated_delta_forward", dims)?;
        if plan.rows == 0 {
            return Ok(());
        }
        let len = delta_scratch_len(dims, false).unwrap_or(0);
        let (scratch, _scratch_buf) = self.scratch_uninit(len, DType::F32)?;
        self.k().gated_delta_forward(
            self.s(),
            self.delta_inputs(inputs),
            self.m(&out),
            self.m(&states),
            scratch,
            dims,
        )
    }

    fn gated_delta_backward_unchecked(
        &self,
        inputs: DeltaInputs<View<'_, CudaBuf>>,
        states: View<'_, CudaBuf>,
        d_out: View<'_, CudaBuf>,
        grads: DeltaGrads<ViewMut<'_, CudaBuf>>,
        dims: DeltaDims,
    ) -> Result<()> {
        let plan = DeltaPlan::new("gated_delta_backward", dims)?;
        if plan.rows == 0 {
            return Ok(());
        }
        let len = delta_scratch_len(dims, true).unwrap_or(0);
        let (scratch, _scratch_buf) = self.scratch_uninit(len, DType::F32)?;
        let grads = DeltaGrads {
            qkv: self.m(&grads.qkv),
            beta: self.m(&grads.beta),
            alpha: self.m(&grads.alpha),
            a_log: self.m(&grads.a_log),
        };
        self.k().gated_delta_backward(
            self.s(),
            self.delta_inputs(inputs),
            self.v(states),
            self.v(d_out),
            grads,
            scratch,
            dims,
        )
    }
}

impl CudaBackend {
    fn delta_inputs(&self, inputs: DeltaInputs<View<'_, CudaBuf>>) -> DeltaInputs<GpuView> {
        DeltaInputs {
            qkv: self.v(inputs.qkv),
            beta: self.v(inputs.beta),
            alpha: self.v(inputs.alpha),
            dt_bias: self.v(inputs.dt_bias),
            a_log: self.v(inputs.a_log),
        }
    }
}

/// The parameters every kernel of a call reads: the inputs, dimensions
/// and scratch; the caller sets the outputs.
fn params(
    inputs: &DeltaInputs<GpuView>,
    scratch: GpuView,
    dims: DeltaDims,
    plan: &DeltaPlan,
) -> DeltaParams {
    // DeltaPlan::new checked that every count fits an i32.
    let int = |n: usize| n as i32;
    DeltaParams {
        qkv: inputs.qkv.ptr,
        beta: inputs.beta.ptr,
        alpha: inputs.alpha.ptr,
        dt_bias: inputs.dt_bias.ptr,
        a_log: inputs.a_log.ptr,
        scratch: scratch.ptr,
        t_qkv: dtype_tag(inputs.qkv.dtype),
        t_beta: dtype_tag(inputs.beta.dtype),
        t_alpha: dtype_tag(inputs.alpha.dtype),
        t_dt_bias: dtype_tag(inputs.dt_bias.dtype),
        t_a_log: dtype_tag(inputs.a_log.dtype),
        batch: int(dims.tokens.batch),
        seq: int(dims.tokens.seq),
        key_heads: int(dims.key_heads),
        value_heads: int(dims.value_heads),
        dk: int(dims.key_dim),
        dv: int(dims.value_dim),
        chunks: int(plan.chunks),
        workspaces: int(plan.workspaces),
        scale: dims.scale(),
        ..DeltaParams::default()
    }
}

impl KernelSet {
    /// One launch of `kernel` with `params` as its only argument.
    fn delta_launch(
        &self,
        stream: &CudaStream,
        kernel: &'static str,
        params: &DeltaParams,
        config: LaunchConfig,
    ) -> Result<()> {
        let mut b = KernelArgs::new(stream, self.function(kernel)?);
        b.arg(params);
        self.go(kernel, &mut b, config)
    }

    /// The scratch view's length, checked against what `dims` need.
    fn delta_scratch(kernel: &str, scratch: GpuView, need: Option<usize>) -> Result<()> {
        scratch.operand().exactly(DType::F32, kernel, "scratch")?;
        let need = need.unwrap_or(usize::MAX);
        crate::cuda::launch::ensure(scratch.len >= need, || {
            format!(
                "{kernel}: `scratch` has {} elements, these dimensions need {need} \
                 (delta_scratch_len)",
                scratch.len
            )
        })
    }

    /// `Backend::gated_delta_forward`, with `scratch` f32 of at least
    /// [`delta_scratch_len`]`(dims, false)` elements.
    pub fn gated_delta_forward(
        &self,
        stream: &CudaStream,
        inputs: DeltaInputs<GpuView>,
        out: GpuView,
        states: GpuView,
        scratch: GpuView,
        dims: DeltaDims,
    ) -> Result<()> {
        let k = "gated_delta_forward";
        let plan = DeltaPlan::new(k, dims)?;
        if plan.rows == 0 {
            return Ok(());
        }
        Self::delta_scratch(k, scratch, delta_scratch_len(dims, false))?;
        let mut p = params(&inputs, scratch, dims, &plan);
        p.out = out.ptr;
        p.t_out = dtype_tag(out.dtype);
        p.states = states.ptr;
        // The tensor-core kernels read qkv and write out in bf16 pairs, and
        // states and scratch in 16-byte words.
        let aligned = [inputs.qkv.ptr, out.ptr]
            .iter()
            .all(|p| p.is_multiple_of(4))
            && [states.ptr, scratch.ptr]
                .iter()
                .all(|p| p.is_multiple_of(16))
            && scratch.len >= plan.items * tc_item_len(dims);
        let (dk, dv) = (dims.key_dim, dims.value_dim);
        if aligned
            && tensor_core_forward(inputs.qkv.dtype, out.dtype, dims)
            && granted(self.delta_shared.forward, tc_shared_bytes(dk, dv))
        {
            return self.gated_delta_forward_tc(stream, &p, dims, &plan);
        }
        self.delta_launch(
            stream,
            "delta_chunk_prep",
            &p,
            per_item(plan.items, THREADS)?,
        )?;
        self.delta_launch(
            stream,
            "delta_forward_states",
            &p,
            per_item(plan.state_blocks, THREADS)?,
        )
    }

    /// The tensor-core forward: every chunk's preparation, the walks (a
    /// block a sequence, value head and 16 state columns), every chunk's
    /// output.
    fn gated_delta_forward_tc(
        &self,
        stream: &CudaStream,
        p: &DeltaParams,
        dims: DeltaDims,
        plan: &DeltaPlan,
    ) -> Result<()> {
        let walks = dims.tokens.batch * dims.value_heads * (dims.value_dim / TC_COLS);
        let blocks = [plan.items, walks, plan.items];
        for ((kernel, bytes), blocks) in TC_KERNELS
            .into_iter()
            .zip(tc_shared_bytes(dims.key_dim, dims.value_dim))
            .zip(blocks)
        {
            let mut config = per_item(blocks, TC_THREADS)?;
            // Within its grant, which fits an i32.
            config.shared_mem_bytes = bytes as u32;
            self.delta_launch(stream, kernel, p, config)?;
        }
        Ok(())
    }

    /// `Backend::gated_delta_backward`, with `scratch` f32 of at least
    /// [`delta_scratch_len`]`(dims, true)` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_backward(
        &self,
        stream: &CudaStream,
        inputs: DeltaInputs<GpuView>,
        states: GpuView,
        d_out: GpuView,
        grads: DeltaGrads<GpuView>,
        scratch: GpuView,
        dims: DeltaDims,
    ) -> Result<()> {
        let k = "gated_delta_backward";
        let plan = DeltaPlan::new(k, dims)?;
        if plan.rows == 0 {
            return Ok(());
        }
        Self::delta_scratch(k, scratch, delta_scratch_len(dims, true))?;
        let mut p = params(&inputs, scratch, dims, &plan);
        p.out = d_out.ptr;
        p.t_out = dtype_tag(d_out.dtype);
        p.states = states.ptr;
        p.d_qkv = grads.qkv.ptr;
        p.t_d_qkv = dtype_tag(grads.qkv.dtype);
        p.d_beta = grads.beta.ptr;
        p.t_d_beta = dtype_tag(grads.beta.dtype);
        p.d_alpha = grads.alpha.ptr;
        p.t_d_alpha = dtype_tag(grads.alpha.dtype);
        p.d_a_log = grads.a_log.ptr;
        p.t_d_a_log = dtype_tag(grads.a_log.dtype);
        // The tensor-core kernels also read qkv's and d_out's rows in
        // 16-byte words; they keep their items and walks' results inside
        // the f32 path's parts of the scratch, and the per-value-head
        // gradients where it keeps them.
        let aligned = [inputs.qkv.ptr, d_out.ptr, states.ptr, scratch.ptr]
            .iter()
            .all(|p| p.is_multiple_of(16));
        let (dk, dv) = (dims.key_dim, dims.value_dim);
        if aligned
            && tensor_core_backward(inputs.qkv.dtype, d_out.dtype, dims)
            && granted(self.delta_shared.forward, tc_shared_bytes(dk, dv))
            && granted(self.delta_shared.backward, tc_backward_shared_bytes(dk, dv))
        {
            let walks = dims.tokens.batch * dims.value_heads * (dims.value_dim / TC_COLS);
            let [prep, ..] = tc_shared_bytes(dk, dv);
            let [dvl, walk, chunk] = tc_backward_shared_bytes(dk, dv);
            let launches = [
                ("delta_tc_prep", prep, plan.items, TC_THREADS),
                ("delta_tc_dvl", dvl, plan.items, TC_THREADS),
                ("delta_tc_back_walk", walk, walks, TC_THREADS),
                ("delta_tc_back_chunk", chunk, plan.items, TC_CHUNK_THREADS),
            ];
            for (kernel, bytes, blocks, threads) in launches {
                let mut config = per_item(blocks, threads)?;
                // Within its grant, which fits an i32.
                config.shared_mem_bytes = bytes as u32;
                self.delta_launch(stream, kernel, &p, config)?;
            }
            return self.delta_backward_finish(stream, &p, dims, &plan);
        }
        self.delta_launch(
            stream,
            "delta_chunk_prep",
            &p,
            per_item(plan.items, THREADS)?,
        )?;
        self.delta_launch(
            stream,
            "delta_backward_states",
            &p,
            per_item(plan.state_blocks, THREADS)?,
        )?;
        self.delta_launch(
            stream,
            "delta_backward_chunk",
            &p,
            per_item(plan.workspaces, THREADS)?,
        )?;
        self.delta_backward_finish(stream, &p, dims, &plan)
    }

    /// The backward's last kernels, on either path: the query and key
    /// gradients through the L2 norms, and A_log's.
    fn delta_backward_finish(
        &self,
        stream: &CudaStream,
        p: &DeltaParams,
        dims: DeltaDims,
        plan: &DeltaPlan,
    ) -> Result<()> {
        let pairs = plan.rows * dims.key_heads;
        self.delta_launch(
            stream,
            "delta_backward_norm",
            p,
            per_item(pairs.div_ceil(THREADS as usize / 32), THREADS)?,
        )?;
        self.delta_launch(
            stream,
            "delta_backward_a_log",
            p,
            per_item(dims.value_heads.div_ceil(THREADS as usize), THREADS)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;
    use crate::cuda::launch::{header_with_defines, source_with_defines};

    fn dims(seq: usize, dk: usize, dv: usize) -> DeltaDims {
        DeltaDims {
            tokens: Tokens::new(2, seq),
            key_heads: 2,
            value_heads: 4,
            key_dim: dk,
            value_dim: dv,
            chunk: DELTA_CHUNK,
        }
    }

    /// The grants are made once, at the widest heads: every head size the
    /// tensor-core kernels take needs at most that, kernel by kernel.
    #[test]
    fn the_widest_heads_need_the_most_shared_memory() {
        let widest = (
            tc_shared_bytes(TC_MAX_DIM, TC_MAX_DIM),
            tc_backward_shared_bytes(TC_MAX_DIM, TC_MAX_DIM),
        );
        let grants = DeltaShared {
            forward: widest.0,
            backward: widest.1,
        };
        for dk in (16..=TC_MAX_DIM).step_by(16) {
            for dv in (16..=TC_MAX_DIM).step_by(16) {
                assert!(
                    granted(grants.forward, tc_shared_bytes(dk, dv)),
                    "{dk} x {dv}"
                );
                assert!(
                    granted(grants.backward, tc_backward_shared_bytes(dk, dv)),
                    "{dk} x {dv}"
                );
            }
        }
        // One past the widest needs more: the grants are not larger than
        // what the kernels take.
        let wider = TC_MAX_DIM + 16;
        assert!(!granted(grants.forward, tc_shared_bytes(wider, wider)));
        assert!(!granted(
            grants.backward,
            tc_backward_shared_bytes(wider, wider)
        ));
    }

    #[test]
    fn the_sizes_are_the_kernels() {
        header_with_defines(
            "delta.cuh",
            &[
                ("DELTA_CHUNK", DELTA_CHUNK),
                ("DELTA_MAX_DK", DELTA_MAX_DK),
                ("DELTA_TILE", DELTA_TILE),
                ("DELTA_THREADS", THREADS as usize),
            ],
        );
    }

    #[test]
    fn the_scratch_counts_each_part() {
        // 2 sequences of 100 steps: 2 chunks each, 16 items.
        let d = dims(100, 32, 64);
        let prep = 64 * (5 * 32 + 64) + 128 + 3 * 4096;
        assert_eq!(delta_scratch_len(d, false), Some(16 * prep));
        let back = 128 * 64 + 32 * 64;
        let work = 64 * (4 * 32 + 64) + 5 * 4096;
        assert_eq!(
            delta_scratch_len(d, true),
            Some(16 * (prep + back) + 2 * 200 * 4 * 32 + 2 * 4 * 2 + 16 * work)
        );
        let huge = DeltaDims {
            tokens: Tokens::new(usize::MAX / 2, 3),
            ..d
        };
        assert_eq!(delta_scratch_len(huge, true), None);
    }

    #[test]
    fn the_tensor_core_path_fits_the_scratch_and_shared_memory() {
        source_with_defines(
            "delta_tensor_core.cu",
            &[
                ("DELTA_TC_THREADS", TC_THREADS as usize),
                ("DELTA_TC_CHUNK_THREADS", TC_CHUNK_THREADS as usize),
                ("DELTA_TC_COLS", TC_COLS),
                ("DELTA_T_PITCH", TC_T_PITCH),
                ("DELTA_F_PITCH", TC_F_PITCH),
                ("DELTA_COL_PITCH", TC_COL_PITCH),
            ],
        );
        for (dk, dv) in [(16, 16), (32, 128), (128, 64), (128, 128)] {
            let d = dims(100, dk, dv);
            assert!(tensor_core_forward(DType::Bf16, DType::Bf16, d));
            // Its items' scratch and the backward walk's are inside the
            // f32 path's, which delta_scratch_len counts.
            let prep = 128 + 64 * (5 * dk + dv) + 3 * 4096;
            assert!(tc_item_len(d) <= prep);
            assert!(tc_back_len(d) <= 128 * dv + dk * dv);
            // An H100's 227 KiB a block, two prep or output blocks an SM,
            // one backward chunk block.
            assert!(tc_shared_bytes(dk, dv).iter().all(|&b| 2 * b <= 227 * 1024));
            assert!(
                tc_backward_shared_bytes(dk, dv)
                    .iter()
                    .all(|&b| b <= 227 * 1024)
            );
        }
        let [prep, walk, output] = tc_shared_bytes(128, 128);
        assert_eq!((prep, walk, output), (90_112, 46_336, 87_040));
        let [dvl, walk, chunk] = tc_backward_shared_bytes(128, 128);
        assert_eq!((dvl, walk, chunk), (52_224, 102_656, 231_296));
        // The backward walk double-buffers W and still fits two blocks an SM.
        assert!(2 * walk <= 227 * 1024);
        // f32 storage, an f32 output, a head dim no multiple of 16, one
        // past the widest: the f32 kernels.
        for (qkv, out, dk, dv) in [
            (DType::F32, DType::F32, 64, 64),
            (DType::Bf16, DType::F32, 64, 64),
            (DType::Bf16, DType::Bf16, 48, 40),
            (DType::Bf16, DType::Bf16, 256, 64),
        ] {
            assert!(
                !tensor_core_forward(qkv, out, dims(100, dk, dv)),
                "{qkv:?} {out:?} dk {dk} dv {dv}"
            );
        }
    }

    #[test]
    fn other_chunks_and_wide_keys_are_refused_naming_the_limit() {
        let err = DeltaPlan::new(
            "k",
            DeltaDims {
                chunk: 32,
                ..dims(10, 8, 8)
            },
        )
        .unwrap_err();
        assert!(matches!(err, RuntimeError::Unsupported(_)));
        assert!(err.to_string().contains("64"), "{err}");
        let err = DeltaPlan::new("k", dims(10, 256, 8)).unwrap_err();
        assert!(err.to_string().contains("128"), "{err}");
        let plan = DeltaPlan::new("k", dims(100, 128, 100)).unwrap();
        assert_eq!(plan.items, 16);
        assert_eq!(plan.state_blocks, 2 * 4 * 7);
        assert_eq!(plan.workspaces, 16);
    }
}

//! Launchers of `kernels/attention_flash.cu`: causal attention on tensor
//! cores (FlashAttention-2's tiling) for bf16 problems whose q/k and v head
//! dims are one [`FLASH_HEAD_DIMS`] value. They replace the GEMM path
//! there: no `[seq, seq]` scratch, and none of its row kernels (the softmax
//! and its gradient over materialised scores were a tenth of the
//! benchmark's step). Other problems keep the GEMM path or the tiled
//! kernels of `attention.cu`. On Hopper (`sm_90a`) head dim 128 runs on
//! warpgroup MMAs (`wgmma`, two warpgroups a block); everywhere else, and
//! for head dim 64, on `mma.sync` (four warps a block).
//!
//! Probabilities and score gradients round to bf16 before their second
//! product, as in FlashAttention: results differ from the f32 reference by
//! about one bf16 rounding (the kernel tests hold them to the bf16
//! tolerance). The grids depend on the dimensions and the device's
//! architecture alone, and no floats are added with atomics, so the same
//! inputs give the same bits on the same kind of GPU.

use super::attention::KernelDims;
use crate::backend::{AttentionDims, AttentionInputs};
use crate::cuda::kernels::Target;
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::reserve_dynamic_shared;
use crate::cuda::launch::tensor_map::tiled_map;
use crate::cuda::launch::{GpuView, KernelSet, MAX_GRID_X, WGMMA_SHARED_ALIGN, ensure};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use cudarc::driver::sys::CUtensorMap;
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig};
use std::collections::HashMap;

/// The head dims the kernels are compiled for (a template instance each).
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];
/// Threads of an `mma.sync` block: four warps (`FLASH_THREADS`).
const THREADS: u32 = 128;
/// The query tile of a forward or dq block, 32 rows a warp (`QUERY_ROWS`).
const QUERY_ROWS: usize = 128;
/// The key tiles the forward and dq walk (`FWD_KEYS`, `DQ_KEYS`).
const FWD_KEYS: usize = 32;
const DQ_KEYS: usize = 32;
/// The key tile of a dk/dv block, 16 rows a warp, and the query tile it
/// walks (`DKDV_KEYS`, `DKDV_QUERIES`).
const DKDV_KEYS: usize = 64;
const DKDV_QUERIES: usize = 32;
/// The `wgmma` kernels' head dim, threads (two warpgroups, `WG_THREADS`)
/// and tiles (`WG_QUERY_ROWS`, `WG_FWD_KEYS`, `WG_DQ_KEYS`,
/// `WG_DKDV_KEYS`, `WG_DKDV_QUERIES`).
const WG_HEAD_DIM: usize = 128;
const WG_THREADS: u32 = 256;
const WG_QUERY_ROWS: usize = 128;
const WG_FWD_KEYS: usize = 128;
const WG_DQ_KEYS: usize = 64;
const WG_DKDV_KEYS: usize = 128;
const WG_DKDV_QUERIES: usize = 64;
/// The 8-byte mbarriers after each `wgmma` kernel's tiles
/// (`WG_FWD_BARRIERS`, `WG_DQ_BARRIERS`, `WG_DKDV_BARRIERS`).
const WG_FWD_BARRIERS: usize = 7;
const WG_DQ_BARRIERS: usize = 8;
const WG_DKDV_BARRIERS: usize = 4;
const BARRIER_BYTES: usize = 8;

/// The three kernels of one head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FlashKernel {
    Forward,
    BackwardDq,
    BackwardDkdv,
}

/// Which instance of a kernel runs: `mma.sync` (every head dim, every
/// device) or `wgmma` (head dim 128 on `sm_90a`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FlashPath {
    Mma,
    Wgmma,
}

impl FlashPath {
    fn of(target: Target, head_dim: usize) -> FlashPath {
        if target == Target::HOPPER && head_dim == WG_HEAD_DIM {
            FlashPath::Wgmma
        } else {
            FlashPath::Mma
        }
    }

    fn threads(self) -> u32 {
        match self {
            FlashPath::Mma => THREADS,
            FlashPath::Wgmma => WG_THREADS,
        }
    }
}

impl FlashKernel {
    const ALL: [FlashKernel; 3] = [
        FlashKernel::Forward,
        FlashKernel::BackwardDq,
        FlashKernel::BackwardDkdv,
    ];

    fn name(self, head_dim: usize, path: FlashPath) -> &'static str {
        match (path, self, head_dim) {
            (FlashPath::Wgmma, FlashKernel::Forward, _) => "flash_forward_wgmma_d128",
            (FlashPath::Wgmma, FlashKernel::BackwardDq, _) => "flash_backward_dq_wgmma_d128",
            (FlashPath::Wgmma, FlashKernel::BackwardDkdv, _) => "flash_backward_dkdv_wgmma_d128",
            (FlashPath::Mma, FlashKernel::Forward, 64) => "flash_forward_d64",
            (FlashPath::Mma, FlashKernel::Forward, _) => "flash_forward_d128",
            (FlashPath::Mma, FlashKernel::BackwardDq, 64) => "flash_backward_dq_d64",
            (FlashPath::Mma, FlashKernel::BackwardDq, _) => "flash_backward_dq_d128",
            (FlashPath::Mma, FlashKernel::BackwardDkdv, 64) => "flash_backward_dkdv_d64",
            (FlashPath::Mma, FlashKernel::BackwardDkdv, _) => "flash_backward_dkdv_d128",
        }
    }

    /// Dynamic shared memory of a block: its staged tiles, the walked
    /// side's double-buffered (`mma.sync` rows are `D + 8` elements apart;
    /// `wgmma` tiles are dense, 128-byte swizzled).
    fn shared_bytes(self, head_dim: usize, path: FlashPath) -> usize {
        let f32s = |n: usize| n * DType::F32.bytes();
        match path {
            FlashPath::Mma => {
                let row = (head_dim + 8) * DType::Bf16.bytes();
                match self {
                    // q, then k and v twice.
                    FlashKernel::Forward => (QUERY_ROWS + 4 * FWD_KEYS) * row,
                    // q and dout, then k and v twice.
                    FlashKernel::BackwardDq => (2 * QUERY_ROWS + 4 * DQ_KEYS) * row,
                    // k and v, then q and dout twice, and lse and D twice.
                    FlashKernel::BackwardDkdv => {
                        (2 * DKDV_KEYS + 4 * DKDV_QUERIES) * row + f32s(4 * DKDV_QUERIES)
                    }
                }
            }
            FlashPath::Wgmma => {
                let row = WG_HEAD_DIM * DType::Bf16.bytes();
                WGMMA_SHARED_ALIGN
                    + match self {
                        // q, then k and v three times (see the kernel on
                        // the rings' sizes), then the tiles' seven 8-byte
                        // barriers.
                        FlashKernel::Forward => {
                            (WG_QUERY_ROWS + 6 * WG_FWD_KEYS) * row
                                + WG_FWD_BARRIERS * BARRIER_BYTES
                        }
                        // q and dout, then k four times and v three
                        // times (see the kernel on the rings' sizes), then
                        // the tiles' eight 8-byte barriers.
                        FlashKernel::BackwardDq => {
                            (2 * WG_QUERY_ROWS + 7 * WG_DQ_KEYS) * row
                                + WG_DQ_BARRIERS * BARRIER_BYTES
                        }
                        // k and v, then q and dout three times, lse and
                        // D three times, and the tiles' four barriers.
                        FlashKernel::BackwardDkdv => {
                            (2 * WG_DKDV_KEYS + 6 * WG_DKDV_QUERIES) * row
                                + f32s(6 * WG_DKDV_QUERIES)
                                + WG_DKDV_BARRIERS * BARRIER_BYTES
                        }
                    }
            }
        }
    }

    /// Rows of the tile a block owns (the grid has one block per tile of
    /// each sequence and head).
    fn block_rows(self, path: FlashPath) -> usize {
        match (path, self) {
            (FlashPath::Mma, FlashKernel::Forward | FlashKernel::BackwardDq) => QUERY_ROWS,
            (FlashPath::Mma, FlashKernel::BackwardDkdv) => DKDV_KEYS,
            (FlashPath::Wgmma, FlashKernel::Forward | FlashKernel::BackwardDq) => WG_QUERY_ROWS,
            (FlashPath::Wgmma, FlashKernel::BackwardDkdv) => WG_DKDV_KEYS,
        }
    }
}

/// Lets every flash kernel `target` runs take its dynamic shared memory
/// (past the 48 KiB a launch gets without asking). False when the device
/// cannot give it (older GPUs have less shared memory a block): the
/// kernels are then never launched and attention takes its other paths.
pub(super) fn reserve_shared_memory(
    functions: &HashMap<&'static str, CudaFunction>,
    target: Target,
) -> bool {
    FLASH_HEAD_DIMS.iter().all(|&d| {
        let path = FlashPath::of(target, d);
        FlashKernel::ALL.iter().all(|&kernel| {
            let Some(f) = functions.get(kernel.name(d, path)) else {
                return false;
            };
            reserve_dynamic_shared(f, kernel.shared_bytes(d, path))
        })
    })
}

/// The tensor map of a `[batch, seq, heads, D]` bf16 array (q, k, v or
/// dout, D = [`WG_HEAD_DIM`]) that the `wgmma` kernels load with TMA: in
/// boxes of one head's `rows` rows of 64 channels (a staged tile is two,
/// its two 128-byte swizzled atoms); rows past a sequence load as zeros.
fn head_map(
    kn: &str,
    view: &GpuView,
    heads: usize,
    dims: AttentionDims,
    rows: usize,
) -> Result<CUtensorMap> {
    let sizes = [WG_HEAD_DIM, heads, dims.tokens.seq, dims.tokens.batch].map(|n| n as u64);
    tiled_map(view.ptr, DType::Bf16, sizes, [64, 1, rows as u32, 1]).map_err(|why| {
        RuntimeError::Unsupported(format!(
            "{kn}: {why}; the unfused attention backend runs attention without the flash kernels"
        ))
    })
}

/// The `wgmma` forward's tensor maps (`FlashMaps` in `attention_flash.cu`):
/// q, k and v in boxes of its query and key tiles' rows (both
/// [`WG_QUERY_ROWS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FlashMaps {
    q: CUtensorMap,
    k: CUtensorMap,
    v: CUtensorMap,
}

// SAFETY: plain data, laid out (`repr(C)`) as `FlashMaps` in
// attention_flash.cu: three 128-byte maps.
unsafe impl DeviceRepr for FlashMaps {}

impl FlashMaps {
    fn new(kn: &str, inputs: &AttentionInputs<GpuView>, dims: AttentionDims) -> Result<FlashMaps> {
        const { assert!(WG_QUERY_ROWS == WG_FWD_KEYS) };
        Ok(FlashMaps {
            q: head_map(kn, &inputs.q, dims.heads, dims, WG_QUERY_ROWS)?,
            k: head_map(kn, &inputs.k, dims.kv_heads, dims, WG_FWD_KEYS)?,
            v: head_map(kn, &inputs.v, dims.kv_heads, dims, WG_FWD_KEYS)?,
        })
    }
}

/// A `wgmma` backward kernel's tensor maps (`FlashGradMaps`): q and dout
/// in boxes of `query_rows`, k and v of `key_rows` (the kernel's tiles).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FlashGradMaps {
    q: CUtensorMap,
    k: CUtensorMap,
    v: CUtensorMap,
    dout: CUtensorMap,
}

// SAFETY: plain data, laid out (`repr(C)`) as `FlashGradMaps` in
// attention_flash.cu: four 128-byte maps.
unsafe impl DeviceRepr for FlashGradMaps {}

impl FlashGradMaps {
    fn new(
        kn: &str,
        inputs: &AttentionInputs<GpuView>,
        dout: &GpuView,
        dims: AttentionDims,
        (query_rows, key_rows): (usize, usize),
    ) -> Result<FlashGradMaps> {
        Ok(FlashGradMaps {
            q: head_map(kn, &inputs.q, dims.heads, dims, query_rows)?,
            k: head_map(kn, &inputs.k, dims.kv_heads, dims, key_rows)?,
            v: head_map(kn, &inputs.v, dims.kv_heads, dims, key_rows)?,
            dout: head_map(kn, dout, dims.heads, dims, query_rows)?,
        })
    }
}

/// Pushes `batch, seq, heads, kv_heads, scale` (the tail of every flash
/// kernel's arguments).
fn push_dims<'a>(shape: &'a KernelDims, b: &mut KernelArgs<'a>) {
    b.arg(&shape.batch)
        .arg(&shape.seq)
        .arg(&shape.heads)
        .arg(&shape.kv_heads)
        .arg(&shape.scale);
}

/// A grid of the kernel's tiles of a `seq`-token sequence for each of
/// `pairs` (sequence, head) pairs.
fn flash_grid(
    kernel: FlashKernel,
    d: usize,
    path: FlashPath,
    seq: usize,
    pairs: usize,
) -> Result<LaunchConfig> {
    let name = kernel.name(d, path);
    let tiles = seq.div_ceil(kernel.block_rows(path));
    let blocks = tiles
        .checked_mul(pairs)
        .filter(|&b| b <= MAX_GRID_X)
        .ok_or_else(|| {
            RuntimeError::Unsupported(format!(
                "{name}: {tiles} tiles x {pairs} (sequence, head) pairs exceed a CUDA grid"
            ))
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (path.threads(), 1, 1),
        shared_mem_bytes: kernel.shared_bytes(d, path) as u32,
    })
}

/// Whether the flash kernels are compiled for these dimensions: one head
/// dim of [`FLASH_HEAD_DIMS`] for q/k and v, KV heads dividing heads.
pub fn flash_attention_dims(dims: AttentionDims) -> bool {
    dims.qk_dim == dims.v_dim
        && FLASH_HEAD_DIMS.contains(&dims.qk_dim)
        && dims.kv_heads > 0
        && dims.heads.is_multiple_of(dims.kv_heads)
}

/// Whether the flash kernels take a problem: its dimensions, and every
/// tensor view bf16 and 16-byte aligned (tiles are fetched 16 bytes at a
/// time).
pub fn flash_attention_takes(dims: AttentionDims, tensors: &[GpuView]) -> bool {
    flash_attention_dims(dims)
        && tensors
            .iter()
            .all(|v| v.dtype == DType::Bf16 && v.ptr.is_multiple_of(16))
}

/// f32 elements of one flash backward's scratch: with grouped KV heads,
/// each query head's share of dk and of dv (`[rows, heads, D]` each);
/// then `D_t`, one for each (row, head).
/// (Saturating: a size past memory is refused where it is allocated.)
pub fn flash_attention_scratch_len(dims: AttentionDims) -> usize {
    let rows_heads = dims
        .tokens
        .batch
        .saturating_mul(dims.tokens.seq)
        .saturating_mul(dims.heads);
    let shares = if dims.heads > dims.kv_heads {
        rows_heads.saturating_mul(2 * dims.qk_dim)
    } else {
        0
    };
    shares.saturating_add(rows_heads)
}

/// That the flash kernels take the problem (bf16 views, 16-byte aligned,
/// a head dim they have); gives the rows.
fn check_flash(
    kn: &str,
    d: AttentionDims,
    inputs: &AttentionInputs<GpuView>,
    out: &GpuView,
) -> Result<usize> {
    ensure(
        flash_attention_takes(d, &[inputs.q, inputs.k, inputs.v, *out]),
        || {
            format!(
                "{kn}: the flash kernels take bf16 views, 16-byte aligned, with one head dim of \
                 {FLASH_HEAD_DIMS:?} (got qk {} and v {}); other problems take the unfused \
                 attention (the unfused attention backend takes it everywhere)",
                d.qk_dim, d.v_dim
            )
        },
    )?;
    Ok(d.tokens.batch * d.tokens.seq)
}

impl KernelSet {
    /// Whether this set's flash kernels can run on its device (see
    /// `reserve_shared_memory`).
    pub fn has_flash_attention(&self) -> bool {
        self.flash_attention
    }

    fn flash_function(&self, kernel: FlashKernel, d: usize) -> Result<&CudaFunction> {
        let name = kernel.name(d, FlashPath::of(self.target, d));
        ensure(self.flash_attention, || {
            format!(
                "{name}: this device cannot give the flash kernels their shared memory; \
                 the unfused attention backend runs attention without them"
            )
        })?;
        self.function(name)
    }

    /// `Backend::attention_forward` on tensor cores: `out` and the f32
    /// log-sum-exp of each (row, head) in `lse`.
    pub fn attention_forward_flash(
        &self,
        stream: &CudaStream,
        inputs: AttentionInputs<GpuView>,
        out: GpuView,
        lse: GpuView,
        dims: AttentionDims,
    ) -> Result<()> {
        let kn = "attention_forward_flash";
        let rows = check_flash(kn, dims, &inputs, &out)?;
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = KernelDims::new(kn, dims)?;
        let d = dims.qk_dim;
        let kernel = FlashKernel::Forward;
        let path = FlashPath::of(self.target, d);
        let config = flash_grid(
            kernel,
            d,
            path,
            dims.tokens.seq,
            dims.tokens.batch * dims.heads,
        )?;
        let mut b = KernelArgs::new(stream, self.flash_function(kernel, d)?);
        // The wgmma forward reads q, k and v through TMA.
        let maps;
        if path == FlashPath::Wgmma {
            maps = FlashMaps::new(kn, &inputs, dims)?;
            b.arg(&maps);
        } else {
            b.arg(&inputs.q.ptr).arg(&inputs.k.ptr).arg(&inputs.v.ptr);
        }
        b.arg(&out.ptr).arg(&lse.ptr);
        push_dims(&shape, &mut b);
        self.go(kernel.name(d, path), &mut b, config)
    }

    /// `Backend::attention_backward` on tensor cores: overwrites
    /// `grads.q`, `grads.k` and `grads.v`. `scratch` holds
    /// [`flash_attention_scratch_len`] f32s: the dq kernel writes
    /// `D_t = dout_t . out_t` into its tail, which the dk/dv kernel reads;
    /// with grouped KV heads, the dk/dv kernel writes each query head's
    /// share into its head, and `flash_group_sum` adds them up.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward_flash(
        &self,
        stream: &CudaStream,
        inputs: AttentionInputs<GpuView>,
        (out, lse, dout): (GpuView, GpuView, GpuView),
        grads: AttentionInputs<GpuView>,
        scratch: GpuView,
        dims: AttentionDims,
    ) -> Result<()> {
        let kn = "attention_backward_flash";
        let rows = check_flash(kn, dims, &inputs, &out)?;
        ensure(
            flash_attention_takes(dims, &[dout, grads.q, grads.k, grads.v]),
            || format!("{kn}: dout and the gradients must be bf16 views, 16-byte aligned"),
        )?;
        scratch.operand().exactly(DType::F32, kn, "scratch")?;
        scratch
            .operand()
            .has_len(kn, "scratch", flash_attention_scratch_len(dims))?;
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shares = inputs.q.len;
        let f32_at = |offset: usize, len: usize| {
            GpuView::new(
                scratch.ptr + (offset * DType::F32.bytes()) as u64,
                len,
                DType::F32,
            )
        };
        let grouped = dims.heads > dims.kv_heads;
        let (dk_part, dv_part, delta) = if grouped {
            (
                f32_at(0, shares),
                f32_at(shares, shares),
                f32_at(2 * shares, lse.len),
            )
        } else {
            (f32_at(0, 0), f32_at(0, 0), f32_at(0, lse.len))
        };
        let shape = KernelDims::new(kn, dims)?;
        let d = dims.qk_dim;
        let seq = dims.tokens.seq;
        let path = FlashPath::of(self.target, d);

        // The wgmma kernels read q, k, v and dout through TMA.
        let wgmma = path == FlashPath::Wgmma;
        let kernel = FlashKernel::BackwardDq;
        let config = flash_grid(kernel, d, path, seq, dims.tokens.batch * dims.heads)?;
        let mut b = KernelArgs::new(stream, self.flash_function(kernel, d)?);
        let dq_maps;
        if wgmma {
            dq_maps = FlashGradMaps::new(kn, &inputs, &dout, dims, (WG_QUERY_ROWS, WG_DQ_KEYS))?;
            b.arg(&dq_maps);
        } else {
            b.arg(&inputs.q.ptr).arg(&inputs.k.ptr).arg(&inputs.v.ptr);
        }
        b.arg(&out.ptr)
            .arg(&lse.ptr)
            .arg(&dout.ptr)
            .arg(&grads.q.ptr)
            .arg(&delta.ptr);
        push_dims(&shape, &mut b);
        self.go(kernel.name(d, path), &mut b, config)?;

        let kernel = FlashKernel::BackwardDkdv;
        let config = flash_grid(kernel, d, path, seq, dims.tokens.batch * dims.heads)?;
        let mut b = KernelArgs::new(stream, self.flash_function(kernel, d)?);
        let dkdv_maps;
        if wgmma {
            dkdv_maps =
                FlashGradMaps::new(kn, &inputs, &dout, dims, (WG_DKDV_QUERIES, WG_DKDV_KEYS))?;
            b.arg(&dkdv_maps).arg(&lse.ptr).arg(&delta.ptr);
        } else {
            b.arg(&inputs.q.ptr)
                .arg(&inputs.k.ptr)
                .arg(&inputs.v.ptr)
                .arg(&lse.ptr)
                .arg(&dout.ptr)
                .arg(&delta.ptr);
        }
        b.arg(&grads.k.ptr)
            .arg(&grads.v.ptr)
            .arg(&dk_part.ptr)
            .arg(&dv_part.ptr);
        push_dims(&shape, &mut b);
        self.go(kernel.name(d, path), &mut b, config)?;
        if !grouped {
            return Ok(());
        }

        let sum = "flash_group_sum";
        let rows = rows as u64;
        let channel_pairs = grads.k.len / 2;
        let mut b = KernelArgs::new(stream, self.function(sum)?);
        b.arg(&dk_part.ptr)
            .arg(&dv_part.ptr)
            .arg(&grads.k.ptr)
            .arg(&grads.v.ptr)
            .arg(&rows)
            .arg(&shape.heads)
            .arg(&shape.kv_heads)
            .arg(&shape.qk_dim);
        self.go(sum, &mut b, crate::cuda::launch::grid_for(channel_pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::HOPPER_SHARED_BYTES;

    /// `delta_tile`, the dq kernels' static shared memory.
    const DQ_STATIC_BYTES: usize = 4 * QUERY_ROWS;

    #[test]
    fn wgmma_runs_head_dim_128_on_hopper_only() {
        assert_eq!(FlashPath::of(Target::HOPPER, 128), FlashPath::Wgmma);
        assert_eq!(FlashPath::of(Target::HOPPER, 64), FlashPath::Mma);
        assert_eq!(FlashPath::of(Target::PORTABLE, 128), FlashPath::Mma);
        assert_eq!(FlashPath::of(Target::PORTABLE, 64), FlashPath::Mma);
        // The portable build's wgmma entry points are empty: never named
        // off Hopper.
        for kernel in FlashKernel::ALL {
            for d in FLASH_HEAD_DIMS {
                let name = kernel.name(d, FlashPath::of(Target::PORTABLE, d));
                assert!(!name.contains("wgmma"), "{name}");
            }
        }
    }

    /// The launcher's threads, tiles and barriers are the ones
    /// attention_flash.cu defines, and the maps it passes are the kernels'
    /// structs of 128-byte maps.
    #[test]
    fn the_launchers_sizes_are_the_kernels_defines() {
        crate::cuda::launch::source_with_defines(
            "attention_flash.cu",
            &[
                ("FLASH_THREADS", THREADS as usize),
                ("QUERY_ROWS", QUERY_ROWS),
                ("FWD_KEYS", FWD_KEYS),
                ("DQ_KEYS", DQ_KEYS),
                ("DKDV_KEYS", DKDV_KEYS),
                ("DKDV_QUERIES", DKDV_QUERIES),
                ("WG_THREADS", WG_THREADS as usize),
                ("WG_QUERY_ROWS", WG_QUERY_ROWS),
                ("WG_FWD_KEYS", WG_FWD_KEYS),
                ("WG_DQ_KEYS", WG_DQ_KEYS),
                ("WG_DKDV_KEYS", WG_DKDV_KEYS),
                ("WG_DKDV_QUERIES", WG_DKDV_QUERIES),
                ("WG_D", WG_HEAD_DIM),
                ("WG_FWD_BARRIERS", WG_FWD_BARRIERS),
                ("WG_DQ_BARRIERS", WG_DQ_BARRIERS),
                ("WG_DKDV_BARRIERS", WG_DKDV_BARRIERS),
            ],
        );
        assert_eq!(std::mem::size_of::<FlashMaps>(), 3 * 128);
        assert_eq!(std::mem::size_of::<FlashGradMaps>(), 4 * 128);
    }

    /// Every kernel a Hopper runs gets the tiles its source lays out (the
    /// wgmma ones 1024 bytes more, to align their swizzled tiles) within
    /// what a block may have.
    #[test]
    fn the_kernels_fit_hopper_shared_memory() {
        let tiles =
            |kernel: FlashKernel| kernel.shared_bytes(128, FlashPath::Wgmma) - WGMMA_SHARED_ALIGN;
        // q, then k and v three times; 128 channels of bf16 a row; then
        // seven barriers.
        assert_eq!(tiles(FlashKernel::Forward), (128 + 6 * 128) * 256 + 56);
        // q and dout, then k four times and v three times; then eight
        // barriers.
        assert_eq!(
            tiles(FlashKernel::BackwardDq),
            (2 * 128 + 7 * 64) * 256 + 64
        );
        // k and v, then q and dout three times, then lse and D three times;
        // then four barriers.
        assert_eq!(
            tiles(FlashKernel::BackwardDkdv),
            (2 * 128 + 6 * 64) * 256 + 6 * 64 * 4 + 32
        );
        for d in FLASH_HEAD_DIMS {
            let path = FlashPath::of(Target::HOPPER, d);
            for kernel in FlashKernel::ALL {
                let bytes = kernel.shared_bytes(d, path) + DQ_STATIC_BYTES;
                assert!(
                    bytes <= HOPPER_SHARED_BYTES,
                    "{}: {bytes} bytes",
                    kernel.name(d, path)
                );
            }
        }
    }

    /// A grid has a block for each tile of each (sequence, head) pair, of
    /// the path's width.
    #[test]
    fn grids_cover_every_tile_with_the_paths_threads() {
        let pairs = 2 * 16;
        for (path, threads) in [(FlashPath::Mma, 128), (FlashPath::Wgmma, 256)] {
            for kernel in FlashKernel::ALL {
                let config = flash_grid(kernel, 128, path, 4097, pairs).unwrap();
                let tiles = 4097usize.div_ceil(kernel.block_rows(path));
                assert_eq!(config.grid_dim, ((tiles * pairs) as u32, 1, 1));
                assert_eq!(config.block_dim, (threads, 1, 1));
            }
        }
        assert!(
            flash_grid(
                FlashKernel::Forward,
                128,
                FlashPath::Wgmma,
                usize::MAX / 2,
                4
            )
            .is_err()
        );
    }
}

//! DeepSeek sparse attention on a GPU: [`SparseAttentionKernels`] for
//! [`CudaBackend`], and the launchers of `kernels/sparse_attention.cu`
//! (which has the maths) on [`KernelSet`], taking views
//! `backend::sparse_attention`'s checks accepted.
//!
//! - The indexer's scores: a block a (32-key tile, 32-query tile,
//!   sequence), the key tile in shared memory while each head's query tile
//!   passes; every dot product in the CPU's order, so the scores are the
//!   CPU's bits. With q and k in bf16 and heads of a multiple of 16
//!   channels ([`indexer_on_tensor_cores`]) the scores and the backward
//!   run on tensor cores instead (`mma.sync`, 128 x 128 tiles, tiles
//!   after every query of theirs skipped): the same maths in another
//!   summation order (a bf16 product is exact in f32), still one order a
//!   sum, so a rerun gives the same bits.
//! - Top-k: a block a query row, a radix select on the scores' bits (in
//!   `total_cmp`'s order) then one pass in position order writing the keys
//!   above the k-th and the lowest-positioned ties.
//! - The indexer's loss: a block a query row; its target (each head's
//!   softmax summed over the heads) on tensor cores with bf16 q and k
//!   ([`loss_target_on_tensor_cores`]), otherwise a head's logits computed
//!   on CUDA cores (kept in shared memory between its two passes up to
//!   4,096 keys a row). Its backward: a query-tile
//!   kernel (dq, d_weights) and a key-tile kernel (dk), each summing in a
//!   fixed order.
//! - Sparse attention, every head reading one shared key/value row a token
//!   (`sparse_mqa_*`, `D`'s absorbed MLA). With bf16 operands and rows of
//!   up to 576 channels ([`mqa_on_tensor_cores`]) on tensor cores: the
//!   forward a block a query row and up to 64 of its heads (on Hopper,
//!   DeepSeek's rows of 512 to 576 channels and values of 512, more than
//!   32 heads, on warpgroup MMAs, [`mqa_on_warpgroups`]); the backward (on
//!   warpgroup MMAs where the forward is) query by query, `dq` in registers and each block's own partial copy
//!   of the key rows (one add an element between two barriers), the copies
//!   then summed in block order ([`mqa_backward_fits_tensor_cores`]).
//!   Otherwise (the checking mode) on CUDA cores: a block a (query row,
//!   head) over its selected keys (online softmax in f32); the backward's
//!   dq the same way, and the shared rows' gradient key-major over a bitmap
//!   of the (key, query) pairs selected, each key's (query, head) pairs in
//!   ascending order. No sum's order depends on timing.
//! - LayerNorm: a warp a row; its parameter gradients as column sums.
//!
//! The backward's bitmap and partial key rows (tensor cores) or per-(row,
//! head) `dout . out` (CUDA cores) are scratch
//! ([`sparse_mqa_scratch_len`]) from the arena; the memory plan counts them
//! ([`sparse_mqa_scratch_bytes`]). The indexer's heads must be at most
//! [`INDEXER_MAX_DIM`] channels and the shared rows at most
//! [`MQA_MAX_DIM`]; other shapes are refused as `Unsupported`.

use crate::backend::{
    IndexerDims, IndexerInputs, IndexerLossDims, LayerNormDims, SparseAttentionKernels,
    SparseMqaDims,
};
use crate::cuda::kernels::Target;
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, MAX_GRID_Y, dtype_tag, ensure, reserve_dynamic_shared,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, View, ViewMut};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use std::collections::HashMap;

/// The widest indexer head the tiled indexer kernels take (`IX_MAX_DIM`).
pub const INDEXER_MAX_DIM: usize = 128;
/// Refuses, before any work, `D` layers the GPU kernels cannot run (`train`
/// calls it for a GPU run whose pattern has `D`); the same limits the
/// launchers check, said in the model file's terms.
pub fn check_model(model: &hybridgen_dsl::ModelConfig) -> Result<()> {
    let refuse = |what: String, limit: usize| {
        Err(RuntimeError::Unsupported(format!(
            "{what} is wider than the GPU's sparse attention kernels take ({limit}): make it \
             at most {limit}, or train this model on the CPU"
        )))
    };
    if let Some(d) = &model.dsa
        && d.index_head_dim > INDEXER_MAX_DIM
    {
        return refuse(
            format!("`dsa.index_head_dim = {}`", d.index_head_dim),
            INDEXER_MAX_DIM,
        );
    }
    if let (Some(_), Some(m)) = (&model.dsa, &model.mla) {
        // `D` attends over MLA's latent rows: kv_lora_rank + rope channels.
        let width = m.kv_lora_rank + m.qk_rope_head_dim;
        if width > MQA_MAX_DIM {
            return refuse(
                format!(
                    "the latent row of `mla.kv_lora_rank + mla.qk_rope_head_dim = {width}` \
                     channels"
                ),
                MQA_MAX_DIM,
            );
        }
    }
    Ok(())
}

/// Query and key rows of an indexer tile (`IX_TILE`).
const IX_TILE: usize = 32;
/// Elements between two staged rows of a tensor-core indexer tile
/// (`IXT_PITCH`: the widest head and 8, so that `ldmatrix` reads no bank
/// twice).
const IXT_PITCH: usize = INDEXER_MAX_DIM + 8;
/// The tensor-core scores kernel's block and tile (`IXT_SCORE_*`).
const IXT_SCORE_THREADS: u32 = 256;
const IXT_SCORE_QUERIES: usize = 128;
const IXT_SCORE_KEYS: usize = 128;
/// The tensor-core dq / d_weights kernel's (`IXT_DQ_*`).
const IXT_DQ_THREADS: u32 = 128;
const IXT_DQ_QUERIES: usize = 128;
const IXT_DQ_KEYS: usize = 32;
/// The tensor-core dk kernel's (`IXT_DK_*`).
const IXT_DK_THREADS: u32 = 256;
const IXT_DK_KEYS: usize = 64;
const IXT_DK_QUERIES: usize = 64;
/// Row pitch (f32) of the dk kernel's gradient tile (`IXT_G_PITCH`).
const IXT_G_PITCH: usize = IXT_DK_KEYS + 4;

/// Dynamic shared memory (bytes) of the tensor-core scores kernel: the
/// key tile and two query tiles, bf16.
const IXT_SCORE_SHARED: usize = (IXT_SCORE_KEYS + 2 * IXT_SCORE_QUERIES) * IXT_PITCH * 2;
/// Of the dq kernel: the query tile and two key tiles.
const IXT_DQ_SHARED: usize = (IXT_DQ_QUERIES + 2 * IXT_DQ_KEYS) * IXT_PITCH * 2;
/// Of the dk kernel: the key tile, two steps' query tiles for each of its
/// two head groups, the f32 gradient tile and two steps' weights.
const IXT_DK_SHARED: usize = (IXT_DK_KEYS + 4 * IXT_DK_QUERIES) * IXT_PITCH * 2
    + IXT_DK_QUERIES * IXT_G_PITCH * 4
    + 4 * IXT_DK_QUERIES * 4;

/// Whether the indexer runs on tensor cores: q and k stored in bf16 at
/// 16-byte aligned addresses (staged 16 bytes at a time), heads a multiple
/// of 16 channels (one `mma` k-step) and at most [`INDEXER_MAX_DIM`].
/// Otherwise the CUDA-core kernels run (the CPU's bits).
pub fn indexer_on_tensor_cores(q: &GpuView, k: &GpuView, head_dim: usize) -> bool {
    q.dtype == DType::Bf16
        && k.dtype == DType::Bf16
        && head_dim > 0
        && head_dim.is_multiple_of(16)
        && head_dim <= INDEXER_MAX_DIM
        && q.ptr.is_multiple_of(16)
        && k.ptr.is_multiple_of(16)
}
/// The widest shared key row of the sparse attention kernels and of the
/// indexer loss (`MQA_MAX_DIM`).
pub const MQA_MAX_DIM: usize = 1024;
/// The tensor-core MQA forward's key block, widest row and value, and
/// heads a block (`MQT_*`), and its staged rows' pitches (elements).
const MQT_KEYS: usize = 32;
pub const MQT_MAX_QK: usize = 576;
pub const MQT_MAX_V: usize = 512;
const MQT_HEADS: usize = 64;
const MQT_PITCH: usize = MQT_MAX_QK + 8;
const MQT_P_PITCH: usize = MQT_KEYS + 8;

/// Dynamic shared memory (bytes) of the tensor-core MQA forward with
/// `groups` groups of 16 heads: the query heads, two key blocks and the
/// probabilities (bf16), the row maxima (f32) and two blocks' positions.
fn mqt_shared(groups: usize) -> usize {
    let rows = groups * 16;
    (rows * MQT_PITCH + 2 * MQT_KEYS * MQT_PITCH + rows * MQT_P_PITCH) * 2
        + rows * 4 * 4
        + 2 * MQT_KEYS * 4
}

/// Whether shared-row attention of these dimensions fits the tensor-core
/// kernels: rows a multiple of 16 channels up to [`MQT_MAX_QK`], values a
/// multiple of 64 up to [`MQT_MAX_V`].
pub fn mqa_shape_on_tensor_cores(dims: SparseMqaDims) -> bool {
    dims.qk_dim > 0
        && dims.qk_dim.is_multiple_of(16)
        && dims.qk_dim <= MQT_MAX_QK
        && dims.v_dim > 0
        && dims.v_dim.is_multiple_of(64)
        && dims.v_dim <= MQT_MAX_V
}

/// Whether the MQA forward runs on tensor cores: q and kv stored in bf16
/// at 16-byte aligned addresses and a shape [`mqa_shape_on_tensor_cores`]
/// takes. Otherwise the CUDA-core kernel runs.
pub fn mqa_on_tensor_cores(q: &GpuView, kv: &GpuView, dims: SparseMqaDims) -> bool {
    q.dtype == DType::Bf16
        && kv.dtype == DType::Bf16
        && mqa_shape_on_tensor_cores(dims)
        && q.ptr.is_multiple_of(16)
        && kv.ptr.is_multiple_of(16)
}

/// Query heads a block of the warpgroup MQA forward takes (`MQW_HEADS`),
/// keys a gathered block (`MQW_KEYS`) and its value width (`MQW_V`).
const MQW_HEADS: usize = 64;
const MQW_KEYS: usize = 64;
const MQW_V: usize = 512;

/// Dynamic shared memory (bytes) of the warpgroup MQA forward: the query
/// heads and two key blocks (64 rows of `qk_dim` bf16 channels each),
/// three blocks' positions, and 1,024 bytes to align the tiles.
fn mqw_shared(qk_dim: usize) -> usize {
    3 * MQW_KEYS * qk_dim * 2 + 3 * MQW_KEYS * 4 + 1024
}

/// Whether the MQA forward's and backward's tensor-core work runs on
/// Hopper's warpgroup MMAs (`dsa_mqa_forward_wgmma`,
/// `dsa_mqa_backward_wgmma`): rows of a multiple of 64 channels from
/// the values' 512 up to [`MQT_MAX_QK`] and values of 512 (DeepSeek's
/// absorbed MLA: 576 and 512), for more than 32 heads. Other shapes the
/// tensor cores take run on `mma.sync`: a block of the warpgroup kernel
/// computes 64 heads whatever the row has, and below half of them the
/// padding costs more than the warpgroup MMAs gain (at 16 heads of 576 / 512
/// and 16,384 tokens on an H100, 27.7 ms a forward against 19.9 on
/// `mma.sync`; at 128 heads and 4,096 tokens, 14.0 against 20.7).
pub fn mqa_on_warpgroups(dims: SparseMqaDims) -> bool {
    dims.heads > MQW_HEADS / 2
        && dims.v_dim == MQW_V
        && dims.qk_dim.is_multiple_of(64)
        && (MQW_V..=MQT_MAX_QK).contains(&dims.qk_dim)
}

/// Threads of a block of the warpgroup MQA backward (`MQBW_THREADS`): three
/// warpgroups, each holding a third of the heads' `dq` in registers.
const MQBW_THREADS: u32 = 384;

/// Dynamic shared memory (bytes) of the warpgroup MQA backward: the query
/// and dout heads, one key block (64 rows of `qk_dim` or 512 bf16 channels
/// each), P and dS (64 x 64 bf16 each), three blocks' positions, each
/// head's delta and lse, and 1,024 bytes to align the tiles.
fn mqbw_shared(qk_dim: usize) -> usize {
    (2 * MQW_KEYS * qk_dim + MQW_HEADS * MQW_V + 2 * MQW_HEADS * MQW_KEYS) * 2
        + 3 * MQW_KEYS * 4
        + 2 * MQW_HEADS * 4
        + 1024
}

/// Whether the MQA backward can run on tensor cores: what the forward
/// needs ([`mqa_on_tensor_cores`]), dout in bf16 too, and dout and out
/// (bf16 or f32) 16-byte aligned. The launcher also needs the kernel's
/// shared memory ([`KernelSet::mqa_backward_on_tensor_cores`]).
pub fn mqa_backward_fits_tensor_cores(
    (q, kv): (&GpuView, &GpuView),
    (out, dout): (&GpuView, &GpuView),
    dims: SparseMqaDims,
) -> bool {
    mqa_on_tensor_cores(q, kv, dims)
        && dout.dtype == DType::Bf16
        && matches!(out.dtype, DType::Bf16 | DType::F32)
        && dout.ptr.is_multiple_of(16)
        && out.ptr.is_multiple_of(16)
}

/// Blocks the tensor-core MQA backward aims to run at once: about one a
/// streaming multiprocessor of an H100 or H200 (its shared memory allows
/// one). Each of a sequence's blocks keeps its own partial key rows.
const MQB_BLOCKS: usize = 128;

/// The tensor-core MQA backward's blocks a sequence (`splits`): each takes
/// every `splits`-th query position and sums into its own partial copy of
/// the sequence's key rows, so the partials' memory grows with `splits`.
fn mqa_backward_splits(dims: SparseMqaDims) -> usize {
    (MQB_BLOCKS / dims.tokens.batch.max(1))
        .max(1)
        .min(dims.tokens.seq.max(1))
}

/// Elements of bf16 between two staged dout rows of the tensor-core
/// backward (`MQB_G_PITCH`).
const MQB_G_PITCH: usize = MQT_MAX_V + 8;

/// Dynamic shared memory (bytes) of the tensor-core MQA backward with
/// `groups` groups of 16 heads: the query and dout heads, two key blocks,
/// P and dS (bf16), each head's delta and lse (f32) and two blocks'
/// positions.
fn mqb_shared(groups: usize) -> usize {
    let rows = groups * 16;
    (rows * MQT_PITCH + rows * MQB_G_PITCH + 2 * MQT_KEYS * MQT_PITCH + 2 * rows * MQT_P_PITCH) * 2
        + 2 * rows * 4
        + 2 * MQT_KEYS * 4
}

/// Whether the indexer loss's target (each head's softmax over the row's
/// items, summed over the heads) runs on tensor cores: q and the shared
/// rows k stored in bf16 at 16-byte aligned addresses, rows a multiple of
/// 16 channels up to [`MQT_MAX_QK`]. Otherwise the CUDA-core loss kernel
/// computes it (the CPU's dot products).
pub fn loss_target_on_tensor_cores(q: &GpuView, k: &GpuView, dim: usize) -> bool {
    q.dtype == DType::Bf16
        && k.dtype == DType::Bf16
        && dim > 0
        && dim.is_multiple_of(16)
        && dim <= MQT_MAX_QK
        && q.ptr.is_multiple_of(16)
        && k.ptr.is_multiple_of(16)
}

/// Query rows a block of the tensor-core loss target takes: for the dense
/// loss, as many as fill its four groups of 16 heads (4 rows of up to 16
/// heads, 2 of up to 32), which share the gathered key rows (every causal
/// key of the last row); one otherwise (sparse rows select their own keys).
fn loss_target_rows_per_block(dims: IndexerLossDims) -> usize {
    let row_groups = dims.heads.min(MQT_HEADS).div_ceil(16).max(1);
    if dims.sparse || row_groups > 2 {
        1
    } else {
        4 / row_groups
    }
}

/// Dynamic shared memory (bytes) of the tensor-core loss target with
/// `groups` groups of 16 heads: the query heads and two key blocks (bf16),
/// the row maxima or sums and the groups' item sums (f32), two blocks'
/// positions.
fn ltm_shared(groups: usize) -> usize {
    let rows = groups * 16;
    (rows * MQT_PITCH + 2 * MQT_KEYS * MQT_PITCH) * 2
        + rows * 4 * 4
        + 4 * MQT_KEYS * 4
        + 2 * MQT_KEYS * 4
}

/// Keys a block of the warpgroup loss target gathers (`LTW_KEYS`).
const LTW_KEYS: usize = 32;

/// Dynamic shared memory (bytes) of the warpgroup loss target: two
/// warpgroups' query tiles (64 heads each) and two key blocks of `dim`
/// bf16 channels, three blocks' positions, the eight warps' item sums, and
/// 1,024 bytes to align the tiles.
fn ltw_shared(dim: usize) -> usize {
    (2 * MQW_HEADS + 2 * LTW_KEYS) * dim * 2 + 3 * LTW_KEYS * 4 + 8 * LTW_KEYS * 4 + 1024
}

/// Whether the loss target runs on Hopper's warpgroup MMAs
/// (`dsa_indexer_loss_target_wgmma`): more than 64 heads (a block takes
/// 128, two warpgroups of 64) and rows of a multiple of 64 channels up to
/// [`MQT_MAX_QK`] (DeepSeek's 128 heads of 576). Fewer heads take the
/// `mma.sync` kernel, which packs rows of few heads into a block.
pub fn loss_target_on_warpgroups(dims: IndexerLossDims) -> bool {
    dims.heads > MQW_HEADS && dims.qk_dim.is_multiple_of(64) && dims.qk_dim <= MQT_MAX_QK
}

/// Which tensor-core kernels of the family got their dynamic shared memory
/// (past the 48 KiB a launch gets without asking) when the kernels were
/// loaded; where one did not (a device with less shared memory a block),
/// its CUDA-core counterpart runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SparseAttentionShared {
    pub(crate) indexer_scores: bool,
    /// Both kernels of the indexer's backward.
    pub(crate) indexer_backward: bool,
    pub(crate) loss_target: bool,
    /// The warpgroup loss target: only on Hopper.
    pub(crate) loss_target_wgmma: bool,
    pub(crate) mqa_forward: bool,
    /// The warpgroup forward: only on Hopper (elsewhere its body is empty).
    pub(crate) mqa_forward_wgmma: bool,
    pub(crate) mqa_backward: bool,
    /// The warpgroup backward: only on Hopper.
    pub(crate) mqa_backward_wgmma: bool,
}

/// Gives the family's tensor-core kernels their largest dynamic shared
/// memory, once, as the kernels are loaded.
pub(crate) fn reserve_shared_memory(
    functions: &HashMap<&'static str, CudaFunction>,
    target: Target,
) -> SparseAttentionShared {
    let reserve = |kernel: &str, bytes: usize| {
        functions
            .get(kernel)
            .is_some_and(|f| reserve_dynamic_shared(f, bytes))
    };
    let full = MQT_HEADS / 16;
    SparseAttentionShared {
        indexer_scores: reserve("dsa_indexer_scores_mma", IXT_SCORE_SHARED),
        indexer_backward: reserve("dsa_indexer_backward_q_mma", IXT_DQ_SHARED)
            && reserve("dsa_indexer_backward_k_mma", IXT_DK_SHARED),
        loss_target: reserve("dsa_indexer_loss_target_mma", ltm_shared(full)),
        loss_target_wgmma: target == Target::HOPPER
            && reserve("dsa_indexer_loss_target_wgmma", ltw_shared(MQT_MAX_QK)),
        mqa_forward: reserve("dsa_mqa_forward_mma", mqt_shared(full)),
        mqa_forward_wgmma: target == Target::HOPPER
            && reserve("dsa_mqa_forward_wgmma", mqw_shared(MQT_MAX_QK)),
        mqa_backward: reserve("dsa_mqa_backward_mma", mqb_shared(full)),
        mqa_backward_wgmma: target == Target::HOPPER
            && reserve("dsa_mqa_backward_wgmma", mqbw_shared(MQT_MAX_QK)),
    }
}

/// Threads of a sparse attention block (`SA_THREADS`).
const SA_THREADS: u32 = 128;
/// Threads of a top-k block (`TOPK_THREADS`).
const TOPK_THREADS: u32 = 512;
/// Threads of an indexer loss block (`LOSS_THREADS`).
const LOSS_THREADS: u32 = 256;

/// u32 words of one key's bitmap row: a bit a query position.
fn bitmap_words(seq: usize) -> usize {
    seq.div_ceil(32)
}

/// Elements (4 bytes each) of the scratch [`KernelSet::sparse_mqa_backward`]
/// takes, on tensor cores or not: first the tensor-core kernel's partial
/// key rows (f32 `[splits, rows, qk_dim]`) or the CUDA-core kernels'
/// `dout . out` a (row, head), then the `[rows, ceil(seq / 32)]` bitmap of
/// selected (key, query) pairs. `None` past `usize`.
pub fn sparse_mqa_scratch_len(dims: SparseMqaDims, tensor_cores: bool) -> Option<usize> {
    let rows = dims.tokens.rows().ok()?;
    let first = if tensor_cores {
        mqa_backward_splits(dims)
            .checked_mul(rows)?
            .checked_mul(dims.qk_dim)?
    } else {
        rows.checked_mul(dims.heads)?
    };
    first.checked_add(rows.checked_mul(bitmap_words(dims.tokens.seq))?)
}

/// The most scratch (bytes) one sparse MQA call takes with activations in
/// `dtype`: the backward's ([`sparse_mqa_scratch_len`]), on tensor cores
/// where bf16 and the shape allow it (the CUDA-core kernels' otherwise, or
/// where a GPU cannot give the tensor-core kernel its shared memory).
pub fn sparse_mqa_scratch_bytes(dims: SparseMqaDims, dtype: DType) -> u64 {
    let tensor_cores = dtype == DType::Bf16 && mqa_shape_on_tensor_cores(dims);
    let len = |tc: bool| sparse_mqa_scratch_len(dims, tc).map_or(u64::MAX / 4, |len| len as u64);
    let most = if tensor_cores {
        len(true).max(len(false))
    } else {
        len(false)
    };
    most.saturating_mul(DType::F32.bytes() as u64)
}

fn unsupported(kernel: &str, why: String) -> RuntimeError {
    RuntimeError::Unsupported(format!("{kernel}: {why}"))
}

/// A u32 the kernels take, or `Unsupported`.
fn u32_of(kernel: &str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|&v| v < i32::MAX as u32)
        .ok_or_else(|| unsupported(kernel, format!("{what} {n} exceeds the GPU kernels' range")))
}

/// The indexer kernels' tile grid: (key or query tiles, `y`, sequences).
fn tile_grid(kernel: &str, seq: usize, y: usize, batch: usize) -> Result<LaunchConfig> {
    let tiles = seq.div_ceil(IX_TILE);
    if tiles > MAX_GRID_Y || y > MAX_GRID_Y || batch > MAX_GRID_Y {
        return Err(unsupported(
            kernel,
            format!("{batch} sequences of {seq} tokens exceed a CUDA grid"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (tiles as u32, y as u32, batch as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A grid of `blocks` (x, y, z) of `threads` threads and `shared` bytes of
/// dynamic shared memory; y and z within a CUDA grid's 65,535.
fn grid_of(kernel: &str, blocks: [usize; 3], threads: u32, shared: usize) -> Result<LaunchConfig> {
    let [x, y, z] = blocks;
    if y > MAX_GRID_Y || z > MAX_GRID_Y {
        return Err(unsupported(
            kernel,
            format!("a grid of {x} x {y} x {z} blocks exceeds a CUDA grid"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (u32_of(kernel, "blocks", x)?, y as u32, z as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    })
}

/// A block a (row, head) of `threads` threads, rows along x.
fn row_head_grid(kernel: &str, rows: usize, heads: usize, threads: u32) -> Result<LaunchConfig> {
    let rows = u32_of(kernel, "rows", rows)?;
    if heads > MAX_GRID_Y {
        return Err(unsupported(
            kernel,
            format!("{heads} heads exceed a CUDA grid"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (rows, heads as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn indexer_shape(kernel: &str, d: IndexerDims) -> Result<(u32, u32, u32)> {
    if d.head_dim > INDEXER_MAX_DIM {
        return Err(unsupported(
            kernel,
            format!(
                "indexer heads of {} channels exceed the GPU kernels' {INDEXER_MAX_DIM}",
                d.head_dim
            ),
        ));
    }
    Ok((
        u32_of(kernel, "sequence length", d.tokens.seq)?,
        u32_of(kernel, "indexer heads", d.heads)?,
        d.head_dim as u32,
    ))
}

impl SparseAttentionKernels<CudaBuf> for CudaBackend {
    fn indexer_scores_unchecked(
        &self,
        inputs: IndexerInputs<View<'_, CudaBuf>>,
        scores: ViewMut<'_, CudaBuf>,
        dims: IndexerDims,
    ) -> Result<()> {
        let inputs = self.indexer_inputs(inputs);
        self.k()
            .indexer_scores(self.s(), inputs, self.m(&scores), dims)
    }

    fn indexer_topk_unchecked(
        &self,
        scores: View<'_, CudaBuf>,
        indices: ViewMut<'_, CudaBuf>,
        dims: IndexerDims,
    ) -> Result<()> {
        self.k()
            .indexer_topk(self.s(), self.v(scores), self.m(&indices), dims)
    }

    fn indexer_loss_unchecked(
        &self,
        scores: View<'_, CudaBuf>,
        q: View<'_, CudaBuf>,
        k: View<'_, CudaBuf>,
        indices: View<'_, CudaBuf>,
        loss: ViewMut<'_, CudaBuf>,
        d_scores: ViewMut<'_, CudaBuf>,
        dims: IndexerLossDims,
    ) -> Result<()> {
        self.k().indexer_loss(
            self.s(),
            self.v(scores),
            (self.v(q), self.v(k)),
            self.v(indices),
            self.m(&loss),
            self.m(&d_scores),
            dims,
        )
    }

    fn indexer_backward_unchecked(
        &self,
        inputs: IndexerInputs<View<'_, CudaBuf>>,
        d_scores: View<'_, CudaBuf>,
        grads: IndexerInputs<ViewMut<'_, CudaBuf>>,
        dims: IndexerDims,
        scale: f32,
    ) -> Result<()> {
        let inputs = self.indexer_inputs(inputs);
        let grads = IndexerInputs {
            q: self.m(&grads.q),
            k: self.m(&grads.k),
            weights: self.m(&grads.weights),
        };
        self.k()
            .indexer_backward(self.s(), inputs, self.v(d_scores), grads, dims, scale)
    }

    fn sparse_mqa_forward_unchecked(
        &self,
        q: View<'_, CudaBuf>,
        kv: View<'_, CudaBuf>,
        indices: View<'_, CudaBuf>,
        out: ViewMut<'_, CudaBuf>,
        lse: ViewMut<'_, CudaBuf>,
        dims: SparseMqaDims,
    ) -> Result<()> {
        self.k().sparse_mqa_forward(
            self.s(),
            (self.v(q), self.v(kv)),
            self.v(indices),
            self.m(&out),
            self.m(&lse),
            dims,
        )
    }

    fn sparse_mqa_backward_unchecked(
        &self,
        q: View<'_, CudaBuf>,
        kv: View<'_, CudaBuf>,
        indices: View<'_, CudaBuf>,
        out: View<'_, CudaBuf>,
        lse: View<'_, CudaBuf>,
        dout: View<'_, CudaBuf>,
        dq: ViewMut<'_, CudaBuf>,
        dkv: ViewMut<'_, CudaBuf>,
        dims: SparseMqaDims,
    ) -> Result<()> {
        let (q, kv, out, dout) = (self.v(q), self.v(kv), self.v(out), self.v(dout));
        let tensor_cores = self
            .k()
            .mqa_backward_on_tensor_cores((&q, &kv), (&out, &dout), dims);
        let len = sparse_mqa_scratch_len(dims, tensor_cores).ok_or_else(|| {
            unsupported("sparse_mqa_backward", "the scratch overflows".to_string())
        })?;
        let (scratch, _scratch_buf) = self.scratch_uninit(len.max(1), DType::F32)?;
        self.k().sparse_mqa_backward(
            self.s(),
            (q, kv),
            self.v(indices),
            (out, self.v(lse), dout),
            (self.m(&dq), self.m(&dkv)),
            scratch,
            dims,
        )
    }

    fn layer_norm_forward_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        weight: View<'_, CudaBuf>,
        bias: View<'_, CudaBuf>,
        y: ViewMut<'_, CudaBuf>,
        stats: ViewMut<'_, CudaBuf>,
        dims: LayerNormDims,
    ) -> Result<()> {
        self.k().layer_norm_forward(
            self.s(),
            (self.v(x), self.v(weight), self.v(bias)),
            self.m(&y),
            self.m(&stats),
            dims,
        )
    }

    fn layer_norm_backward_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        weight: View<'_, CudaBuf>,
        stats: View<'_, CudaBuf>,
        dy: View<'_, CudaBuf>,
        dx: ViewMut<'_, CudaBuf>,
        dims: LayerNormDims,
    ) -> Result<()> {
        self.k().layer_norm_backward(
            self.s(),
            (self.v(x), self.v(weight), self.v(stats)),
            self.v(dy),
            self.m(&dx),
            dims,
        )
    }

    fn layer_norm_weight_grad_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        stats: View<'_, CudaBuf>,
        dy: View<'_, CudaBuf>,
        d_weight: ViewMut<'_, CudaBuf>,
        d_bias: ViewMut<'_, CudaBuf>,
        dims: LayerNormDims,
    ) -> Result<()> {
        self.k().layer_norm_weight_grad(
            self.s(),
            (self.v(x), self.v(stats), self.v(dy)),
            (self.m(&d_weight), self.m(&d_bias)),
            dims,
        )
    }
}

impl CudaBackend {
    fn indexer_inputs(&self, inputs: IndexerInputs<View<'_, CudaBuf>>) -> IndexerInputs<GpuView> {
        IndexerInputs {
            q: self.v(inputs.q),
            k: self.v(inputs.k),
            weights: self.v(inputs.weights),
        }
    }
}

impl KernelSet {
    /// `Backend::indexer_scores` (`scores` f32 `[rows, seq]`).
    pub fn indexer_scores(
        &self,
        stream: &CudaStream,
        inputs: IndexerInputs<GpuView>,
        scores: GpuView,
        dims: IndexerDims,
    ) -> Result<()> {
        let kn = "dsa_indexer_scores";
        let (seq, heads, dim) = indexer_shape(kn, dims)?;
        if dims.tokens.rows()? == 0 {
            return Ok(());
        }
        if indexer_on_tensor_cores(&inputs.q, &inputs.k, dims.head_dim)
            && self.sparse_attention_shared.indexer_scores
        {
            return self.indexer_scores_mma(stream, inputs, scores, dims);
        }
        let config = tile_grid(
            kn,
            dims.tokens.seq,
            dims.tokens.seq.div_ceil(IX_TILE),
            dims.tokens.batch,
        )?;
        let IndexerInputs { q, k, weights: w } = inputs;
        let [qt, kt, wt] = [q, k, w].map(|v| dtype_tag(v.dtype));
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&q.ptr)
            .arg(&qt)
            .arg(&k.ptr)
            .arg(&kt)
            .arg(&w.ptr)
            .arg(&wt);
        b.arg(&scores.ptr).arg(&seq).arg(&heads).arg(&dim);
        b.arg(&dims.weight_scale);
        self.go(kn, &mut b, config)
    }

    /// [`KernelSet::indexer_scores`] on tensor cores (bf16 q and k; see
    /// [`indexer_on_tensor_cores`]): a block a (128-key tile, 128-query
    /// tile, sequence).
    fn indexer_scores_mma(
        &self,
        stream: &CudaStream,
        inputs: IndexerInputs<GpuView>,
        scores: GpuView,
        dims: IndexerDims,
    ) -> Result<()> {
        let kn = "dsa_indexer_scores_mma";
        let (seq, heads, dim) = indexer_shape(kn, dims)?;
        let key_tiles = dims.tokens.seq.div_ceil(IXT_SCORE_KEYS);
        let query_tiles = dims.tokens.seq.div_ceil(IXT_SCORE_QUERIES);
        let config = grid_of(
            kn,
            [key_tiles, query_tiles, dims.tokens.batch],
            IXT_SCORE_THREADS,
            IXT_SCORE_SHARED,
        )?;
        let IndexerInputs { q, k, weights: w } = inputs;
        let wt = dtype_tag(w.dtype);
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&q.ptr).arg(&k.ptr).arg(&w.ptr).arg(&wt);
        b.arg(&scores.ptr).arg(&seq).arg(&heads).arg(&dim);
        b.arg(&dims.weight_scale);
        self.go(kn, &mut b, config)
    }

    /// [`KernelSet::indexer_backward`] on tensor cores: the query side (a
    /// block a (head, 128-query tile, sequence): dq and d_weights), then
    /// the key side (a block a 64-key tile: dk).
    fn indexer_backward_mma(
        &self,
        stream: &CudaStream,
        inputs: IndexerInputs<GpuView>,
        d_scores: GpuView,
        grads: IndexerInputs<GpuView>,
        dims: IndexerDims,
        scale: f32,
    ) -> Result<()> {
        let kq = "dsa_indexer_backward_q_mma";
        let (seq, heads, dim) = indexer_shape(kq, dims)?;
        let IndexerInputs { q, k, weights: w } = inputs;
        let wt = dtype_tag(w.dtype);
        let [dqt, dkt, dwt] = [grads.q, grads.k, grads.weights].map(|v| dtype_tag(v.dtype));
        let config = grid_of(
            kq,
            [
                dims.heads,
                dims.tokens.seq.div_ceil(IXT_DQ_QUERIES),
                dims.tokens.batch,
            ],
            IXT_DQ_THREADS,
            IXT_DQ_SHARED,
        )?;
        let mut b = KernelArgs::new(stream, self.function(kq)?);
        b.arg(&q.ptr).arg(&k.ptr).arg(&w.ptr).arg(&wt);
        b.arg(&d_scores.ptr).arg(&grads.q.ptr).arg(&dqt);
        b.arg(&grads.weights.ptr).arg(&dwt);
        b.arg(&seq)
            .arg(&heads)
            .arg(&dim)
            .arg(&dims.weight_scale)
            .arg(&scale);
        self.go(kq, &mut b, config)?;
        let kk = "dsa_indexer_backward_k_mma";
        let config = grid_of(
            kk,
            [dims.tokens.seq.div_ceil(IXT_DK_KEYS), 1, dims.tokens.batch],
            IXT_DK_THREADS,
            IXT_DK_SHARED,
        )?;
        let mut b = KernelArgs::new(stream, self.function(kk)?);
        b.arg(&q.ptr).arg(&k.ptr).arg(&w.ptr).arg(&wt);
        b.arg(&d_scores.ptr).arg(&grads.k.ptr).arg(&dkt);
        b.arg(&seq)
            .arg(&heads)
            .arg(&dim)
            .arg(&dims.weight_scale)
            .arg(&scale);
        self.go(kk, &mut b, config)
    }

    /// `Backend::indexer_topk` (`indices` u32 `[rows, topk]`).
    pub fn indexer_topk(
        &self,
        stream: &CudaStream,
        scores: GpuView,
        indices: GpuView,
        dims: IndexerDims,
    ) -> Result<()> {
        let kn = "dsa_indexer_topk";
        let rows = dims.tokens.rows()?;
        if rows == 0 {
            return Ok(());
        }
        let seq = u32_of(kn, "sequence length", dims.tokens.seq)?;
        let topk = u32_of(kn, "top-k", dims.topk)?;
        let config = row_head_grid(kn, rows, 1, TOPK_THREADS)?;
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&scores.ptr).arg(&indices.ptr).arg(&seq).arg(&topk);
        self.go(kn, &mut b, config)
    }

    /// `Backend::indexer_loss`: `loss` f32 `[rows]`, `d_scores` f32
    /// `[rows, seq]` (every entry written).
    #[allow(clippy::too_many_arguments)]
    pub fn indexer_loss(
        &self,
        stream: &CudaStream,
        scores: GpuView,
        (q, k): (GpuView, GpuView),
        indices: GpuView,
        loss: GpuView,
        d_scores: GpuView,
        dims: IndexerLossDims,
    ) -> Result<()> {
        let kn = "dsa_indexer_loss";
        if dims.qk_dim > MQA_MAX_DIM {
            return Err(unsupported(
                kn,
                format!(
                    "a shared key row of {} channels; the GPU kernel takes at most {MQA_MAX_DIM}",
                    dims.qk_dim
                ),
            ));
        }
        let rows = dims.tokens.rows()?;
        if rows == 0 {
            return Ok(());
        }
        let seq = u32_of(kn, "sequence length", dims.tokens.seq)?;
        let topk = u32_of(kn, "top-k", dims.topk)?;
        let heads = u32_of(kn, "heads", dims.heads)?;
        let dim = dims.qk_dim as u32;
        let factor = dims.coeff / rows as f32;
        let sparse = i32::from(dims.sparse);
        let tensor_cores = loss_target_on_tensor_cores(&q, &k, dims.qk_dim);
        let warpgroups = tensor_cores
            && loss_target_on_warpgroups(dims)
            && self.sparse_attention_shared.loss_target_wgmma;
        let target_ready = warpgroups || (tensor_cores && self.sparse_attention_shared.loss_target);
        if target_ready {
            // The warpgroup kernel takes a row a block; the `mma.sync` one
            // packs `rows_per_block` rows of few heads.
            let (km, config, rows_per_block) = if warpgroups {
                let km = "dsa_indexer_loss_target_wgmma";
                let blocks = [dims.tokens.seq, dims.tokens.batch, 1];
                (km, grid_of(km, blocks, 256, ltw_shared(dims.qk_dim))?, 1)
            } else {
                let km = "dsa_indexer_loss_target_mma";
                let rows_per_block = loss_target_rows_per_block(dims);
                let groups = rows_per_block * dims.heads.min(MQT_HEADS).div_ceil(16);
                let blocks = [
                    dims.tokens.seq.div_ceil(rows_per_block),
                    dims.tokens.batch,
                    1,
                ];
                let config = grid_of(km, blocks, (groups * 128) as u32, ltm_shared(groups))?;
                (km, config, rows_per_block as u32)
            };
            let mut b = KernelArgs::new(stream, self.function(km)?);
            b.arg(&q.ptr)
                .arg(&k.ptr)
                .arg(&indices.ptr)
                .arg(&d_scores.ptr);
            b.arg(&seq).arg(&topk).arg(&heads).arg(&dim);
            b.arg(&dims.scale).arg(&sparse);
            if !warpgroups {
                b.arg(&rows_per_block);
            }
            b.arg(&self.fault_ptr);
            self.go(km, &mut b, config)?;
        }
        let target_ready = i32::from(target_ready);
        let config = row_head_grid(kn, rows, 1, LOSS_THREADS)?;
        let [qt, kt] = [q, k].map(|v| dtype_tag(v.dtype));
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&scores.ptr).arg(&q.ptr).arg(&qt).arg(&k.ptr).arg(&kt);
        b.arg(&indices.ptr).arg(&loss.ptr).arg(&d_scores.ptr);
        b.arg(&seq).arg(&topk).arg(&heads).arg(&dim);
        b.arg(&dims.scale)
            .arg(&factor)
            .arg(&sparse)
            .arg(&target_ready)
            .arg(&self.fault_ptr);
        self.go(kn, &mut b, config)
    }

    /// `Backend::indexer_backward`: overwrites `grads` (two kernels, the
    /// query side then the key side).
    pub fn indexer_backward(
        &self,
        stream: &CudaStream,
        inputs: IndexerInputs<GpuView>,
        d_scores: GpuView,
        grads: IndexerInputs<GpuView>,
        dims: IndexerDims,
        scale: f32,
    ) -> Result<()> {
        let kq = "dsa_indexer_backward_q";
        let (seq, heads, dim) = indexer_shape(kq, dims)?;
        if dims.tokens.rows()? == 0 {
            return Ok(());
        }
        if indexer_on_tensor_cores(&inputs.q, &inputs.k, dims.head_dim)
            && self.sparse_attention_shared.indexer_backward
        {
            return self.indexer_backward_mma(stream, inputs, d_scores, grads, dims, scale);
        }
        let IndexerInputs { q, k, weights: w } = inputs;
        let [qt, kt, wt] = [q, k, w].map(|v| dtype_tag(v.dtype));
        let [dqt, dkt, dwt] = [grads.q, grads.k, grads.weights].map(|v| dtype_tag(v.dtype));
        let config = tile_grid(kq, dims.tokens.seq, dims.heads, dims.tokens.batch)?;
        let mut b = KernelArgs::new(stream, self.function(kq)?);
        b.arg(&q.ptr)
            .arg(&qt)
            .arg(&k.ptr)
            .arg(&kt)
            .arg(&w.ptr)
            .arg(&wt);
        b.arg(&d_scores.ptr).arg(&grads.q.ptr).arg(&dqt);
        b.arg(&grads.weights.ptr).arg(&dwt);
        b.arg(&seq)
            .arg(&heads)
            .arg(&dim)
            .arg(&dims.weight_scale)
            .arg(&scale);
        self.go(kq, &mut b, config)?;
        let kk = "dsa_indexer_backward_k";
        let config = tile_grid(kk, dims.tokens.seq, 1, dims.tokens.batch)?;
        let mut b = KernelArgs::new(stream, self.function(kk)?);
        b.arg(&q.ptr)
            .arg(&qt)
            .arg(&k.ptr)
            .arg(&kt)
            .arg(&w.ptr)
            .arg(&wt);
        b.arg(&d_scores.ptr).arg(&grads.k.ptr).arg(&dkt);
        b.arg(&seq)
            .arg(&heads)
            .arg(&dim)
            .arg(&dims.weight_scale)
            .arg(&scale);
        self.go(kk, &mut b, config)
    }

    /// `Backend::sparse_mqa_forward`: `out` in its dtype and `lse` f32
    /// `[rows, heads]`.
    pub fn sparse_mqa_forward(
        &self,
        stream: &CudaStream,
        (q, kv): (GpuView, GpuView),
        indices: GpuView,
        out: GpuView,
        lse: GpuView,
        dims: SparseMqaDims,
    ) -> Result<()> {
        let kn = "dsa_mqa_forward";
        let rows = dims.tokens.rows()?;
        if rows == 0 {
            return Ok(());
        }
        let shape = MqaShape::new(kn, dims)?;
        let tensor_cores = mqa_on_tensor_cores(&q, &kv, dims);
        let warpgroups = tensor_cores
            && mqa_on_warpgroups(dims)
            && self.sparse_attention_shared.mqa_forward_wgmma;
        if warpgroups || (tensor_cores && self.sparse_attention_shared.mqa_forward) {
            let (km, config) = if warpgroups {
                let km = "dsa_mqa_forward_wgmma";
                let blocks = [rows, dims.heads.div_ceil(MQW_HEADS), 1];
                (km, grid_of(km, blocks, 256, mqw_shared(dims.qk_dim))?)
            } else {
                let km = "dsa_mqa_forward_mma";
                let groups = dims.heads.min(MQT_HEADS).div_ceil(16);
                let blocks = [rows, dims.heads.div_ceil(MQT_HEADS), 1];
                (
                    km,
                    grid_of(km, blocks, (groups * 128) as u32, mqt_shared(groups))?,
                )
            };
            let ot = dtype_tag(out.dtype);
            let mut b = KernelArgs::new(stream, self.function(km)?);
            b.arg(&q.ptr).arg(&kv.ptr).arg(&indices.ptr);
            b.arg(&out.ptr).arg(&ot).arg(&lse.ptr);
            b.arg(&shape.seq)
                .arg(&shape.heads)
                .arg(&shape.qk)
                .arg(&shape.v);
            b.arg(&shape.topk).arg(&dims.scale).arg(&self.fault_ptr);
            return self.go(km, &mut b, config);
        }
        let config = row_head_grid(kn, rows, dims.heads, SA_THREADS)?;
        let [qt, kvt, ot] = [q, kv, out].map(|x| dtype_tag(x.dtype));
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&q.ptr).arg(&qt).arg(&kv.ptr).arg(&kvt);
        b.arg(&indices.ptr).arg(&out.ptr).arg(&ot).arg(&lse.ptr);
        b.arg(&shape.seq)
            .arg(&shape.heads)
            .arg(&shape.qk)
            .arg(&shape.v);
        b.arg(&shape.topk).arg(&dims.scale).arg(&self.fault_ptr);
        self.go(kn, &mut b, config)
    }

    /// Whether [`KernelSet::sparse_mqa_backward`] runs on tensor cores for
    /// these operands: [`mqa_backward_fits_tensor_cores`] and the kernel's
    /// shared memory granted at load.
    pub fn mqa_backward_on_tensor_cores(
        &self,
        (q, kv): (&GpuView, &GpuView),
        (out, dout): (&GpuView, &GpuView),
        dims: SparseMqaDims,
    ) -> bool {
        mqa_backward_fits_tensor_cores((q, kv), (out, dout), dims)
            && self.sparse_attention_shared.mqa_backward
    }

    /// `Backend::sparse_mqa_backward`, with `scratch` (4-byte elements) of
    /// at least [`sparse_mqa_scratch_len`] (zeroed here). On tensor cores
    /// ([`KernelSet::mqa_backward_on_tensor_cores`]): query by query, dq
    /// and each block's partial key rows, then the partials summed into dkv.
    /// On CUDA cores: the query side (dq, `dout . out`, and the bitmap of
    /// selected pairs), then the key side (dkv).
    #[allow(clippy::too_many_arguments)]
    pub fn sparse_mqa_backward(
        &self,
        stream: &CudaStream,
        (q, kv): (GpuView, GpuView),
        indices: GpuView,
        (out, lse, dout): (GpuView, GpuView, GpuView),
        (dq, dkv): (GpuView, GpuView),
        scratch: GpuView,
        dims: SparseMqaDims,
    ) -> Result<()> {
        let kq = "dsa_mqa_backward_dq";
        let rows = dims.tokens.rows()?;
        if rows == 0 {
            return Ok(());
        }
        let shape = MqaShape::new(kq, dims)?;
        let tensor_cores = self.mqa_backward_on_tensor_cores((&q, &kv), (&out, &dout), dims);
        let need = sparse_mqa_scratch_len(dims, tensor_cores)
            .ok_or_else(|| unsupported(kq, "the scratch overflows".to_string()))?;
        ensure(
            scratch.len >= need && scratch.dtype.bytes() == 4 && scratch.ptr.is_multiple_of(16),
            || {
                format!(
                    "{kq}: `scratch` has {} elements of {} at {:#x}, these dimensions need {need} \
                     of 4 bytes, 16-byte aligned (sparse_mqa_scratch_len)",
                    scratch.len, scratch.dtype, scratch.ptr
                )
            },
        )?;
        let words = bitmap_words(dims.tokens.seq);
        let bitmap = scratch.ptr + ((need - rows * words) * 4) as u64;
        let words = u32_of(kq, "bitmap words", words)?;
        if tensor_cores {
            // The partials and the bitmap, one zeroing.
            self.zero_bytes(stream, scratch.ptr, need * 4)?;
            return self.sparse_mqa_backward_tensor_cores(
                stream,
                (q, kv, indices),
                (out, lse, dout),
                (dq, dkv),
                (scratch.ptr, bitmap, words),
                dims,
            );
        }
        let delta = scratch.ptr;
        self.zero_bytes(stream, bitmap, rows * bitmap_words(dims.tokens.seq) * 4)?;
        let [qt, kvt, ot, gt, dqt, dkvt] = [q, kv, out, dout, dq, dkv].map(|x| dtype_tag(x.dtype));
        let config = row_head_grid(kq, rows, dims.heads, SA_THREADS)?;
        let mut b = KernelArgs::new(stream, self.function(kq)?);
        b.arg(&q.ptr).arg(&qt).arg(&kv.ptr).arg(&kvt);
        b.arg(&indices.ptr).arg(&out.ptr).arg(&ot).arg(&lse.ptr);
        b.arg(&dout.ptr).arg(&gt).arg(&dq.ptr).arg(&dqt);
        b.arg(&delta).arg(&bitmap).arg(&words);
        b.arg(&shape.seq)
            .arg(&shape.heads)
            .arg(&shape.qk)
            .arg(&shape.v);
        b.arg(&shape.topk).arg(&dims.scale).arg(&self.fault_ptr);
        self.go(kq, &mut b, config)?;
        let kk = "dsa_mqa_backward_dkv";
        let config = row_head_grid(kk, rows, 1, SA_THREADS)?;
        let mut b = KernelArgs::new(stream, self.function(kk)?);
        b.arg(&q.ptr).arg(&qt).arg(&kv.ptr).arg(&kvt);
        b.arg(&lse.ptr)
            .arg(&dout.ptr)
            .arg(&gt)
            .arg(&delta)
            .arg(&bitmap);
        b.arg(&words).arg(&dkv.ptr).arg(&dkvt);
        b.arg(&shape.seq)
            .arg(&shape.heads)
            .arg(&shape.qk)
            .arg(&shape.v);
        b.arg(&dims.scale);
        self.go(kk, &mut b, config)
    }

    /// [`KernelSet::sparse_mqa_backward`] on tensor cores (Hopper's
    /// warpgroup MMAs where [`mqa_on_warpgroups`]): a block a (split,
    /// sequence) writing dq and its partial key rows at `partial` (zeroed),
    /// then the partials summed in split order into dkv.
    #[allow(clippy::too_many_arguments)]
    fn sparse_mqa_backward_tensor_cores(
        &self,
        stream: &CudaStream,
        (q, kv, indices): (GpuView, GpuView, GpuView),
        (out, lse, dout): (GpuView, GpuView, GpuView),
        (dq, dkv): (GpuView, GpuView),
        (partial, bitmap, words): (u64, u64, u32),
        dims: SparseMqaDims,
    ) -> Result<()> {
        let splits = mqa_backward_splits(dims);
        let blocks = [splits, dims.tokens.batch, 1];
        let (km, config) =
            if mqa_on_warpgroups(dims) && self.sparse_attention_shared.mqa_backward_wgmma {
                let km = "dsa_mqa_backward_wgmma";
                (
                    km,
                    grid_of(km, blocks, MQBW_THREADS, mqbw_shared(dims.qk_dim))?,
                )
            } else {
                let km = "dsa_mqa_backward_mma";
                let groups = dims.heads.min(MQT_HEADS).div_ceil(16);
                (
                    km,
                    grid_of(km, blocks, (groups * 128) as u32, mqb_shared(groups))?,
                )
            };
        let shape = MqaShape::new(km, dims)?;
        let splits = u32_of(km, "splits", splits)?;
        let [ot, dqt, dkvt] = [out, dq, dkv].map(|x| dtype_tag(x.dtype));
        let mut b = KernelArgs::new(stream, self.function(km)?);
        b.arg(&q.ptr).arg(&kv.ptr).arg(&indices.ptr);
        b.arg(&out.ptr).arg(&ot).arg(&lse.ptr).arg(&dout.ptr);
        b.arg(&dq.ptr)
            .arg(&dqt)
            .arg(&partial)
            .arg(&bitmap)
            .arg(&words);
        b.arg(&shape.seq)
            .arg(&shape.heads)
            .arg(&shape.qk)
            .arg(&shape.v);
        b.arg(&shape.topk)
            .arg(&dims.scale)
            .arg(&splits)
            .arg(&self.fault_ptr);
        self.go(km, &mut b, config)?;
        let ks = "dsa_mqa_partials_sum";
        let count = (dims.tokens.rows()? * dims.qk_dim) as u64;
        let config = grid_of(
            ks,
            [(count as usize / 4).div_ceil(256).clamp(1, 4096), 1, 1],
            256,
            0,
        )?;
        let mut b = KernelArgs::new(stream, self.function(ks)?);
        b.arg(&partial)
            .arg(&splits)
            .arg(&count)
            .arg(&dkv.ptr)
            .arg(&dkvt);
        self.go(ks, &mut b, config)
    }

    /// `Backend::layer_norm_forward` (`stats` f32 `[rows, 2]`).
    pub fn layer_norm_forward(
        &self,
        stream: &CudaStream,
        (x, w, bias): (GpuView, GpuView, GpuView),
        y: GpuView,
        stats: GpuView,
        dims: LayerNormDims,
    ) -> Result<()> {
        let kn = "dsa_layer_norm_forward";
        if dims.rows == 0 {
            return Ok(());
        }
        let (rows, width) = (dims.rows as u64, u32_of(kn, "width", dims.width)?);
        let config = warp_rows(kn, dims.rows)?;
        let [xt, wt, bt, yt] = [x, w, bias, y].map(|v| dtype_tag(v.dtype));
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&x.ptr)
            .arg(&xt)
            .arg(&w.ptr)
            .arg(&wt)
            .arg(&bias.ptr)
            .arg(&bt);
        b.arg(&y.ptr)
            .arg(&yt)
            .arg(&stats.ptr)
            .arg(&rows)
            .arg(&width);
        b.arg(&dims.eps);
        self.go(kn, &mut b, config)
    }

    /// `Backend::layer_norm_backward`: overwrites `dx`.
    pub fn layer_norm_backward(
        &self,
        stream: &CudaStream,
        (x, w, stats): (GpuView, GpuView, GpuView),
        dy: GpuView,
        dx: GpuView,
        dims: LayerNormDims,
    ) -> Result<()> {
        let kn = "dsa_layer_norm_backward";
        if dims.rows == 0 {
            return Ok(());
        }
        let (rows, width) = (dims.rows as u64, u32_of(kn, "width", dims.width)?);
        let config = warp_rows(kn, dims.rows)?;
        let [xt, wt, gt, dxt] = [x, w, dy, dx].map(|v| dtype_tag(v.dtype));
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&x.ptr).arg(&xt).arg(&w.ptr).arg(&wt).arg(&stats.ptr);
        b.arg(&dy.ptr)
            .arg(&gt)
            .arg(&dx.ptr)
            .arg(&dxt)
            .arg(&rows)
            .arg(&width);
        self.go(kn, &mut b, config)
    }

    /// `Backend::layer_norm_weight_grad`: adds to `d_weight` and `d_bias`.
    pub fn layer_norm_weight_grad(
        &self,
        stream: &CudaStream,
        (x, stats, dy): (GpuView, GpuView, GpuView),
        (dw, db): (GpuView, GpuView),
        dims: LayerNormDims,
    ) -> Result<()> {
        let kn = "dsa_layer_norm_weight_grad";
        if dims.rows == 0 {
            return Ok(());
        }
        let (rows, width) = (dims.rows as u64, u32_of(kn, "width", dims.width)?);
        let config = LaunchConfig {
            grid_dim: (dims.width.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        let [xt, gt, dwt, dbt] = [x, dy, dw, db].map(|v| dtype_tag(v.dtype));
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&x.ptr).arg(&xt).arg(&stats.ptr).arg(&dy.ptr).arg(&gt);
        b.arg(&dw.ptr)
            .arg(&dwt)
            .arg(&db.ptr)
            .arg(&dbt)
            .arg(&rows)
            .arg(&width);
        self.go(kn, &mut b, config)
    }
}

/// A warp a row, 8 rows a block.
fn warp_rows(kernel: &str, rows: usize) -> Result<LaunchConfig> {
    let blocks = u32_of(kernel, "row blocks", rows.div_ceil(8))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The MQA kernels' dimensions as they take them; rows wider than
/// [`MQA_MAX_DIM`] are `Unsupported`.
struct MqaShape {
    seq: u32,
    heads: u32,
    qk: u32,
    v: u32,
    topk: u32,
}

impl MqaShape {
    fn new(kernel: &str, d: SparseMqaDims) -> Result<MqaShape> {
        if d.qk_dim > MQA_MAX_DIM {
            return Err(unsupported(
                kernel,
                format!(
                    "a shared key row of {} channels; the GPU kernels take at most {MQA_MAX_DIM}",
                    d.qk_dim
                ),
            ));
        }
        Ok(MqaShape {
            seq: u32_of(kernel, "sequence length", d.tokens.seq)?,
            heads: u32_of(kernel, "heads", d.heads)?,
            qk: d.qk_dim as u32,
            v: d.v_dim as u32,
            topk: u32_of(kernel, "top-k", d.topk)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::source_with_defines;

    /// The launcher's sizes are the kernels'.
    #[test]
    fn the_launchers_sizes_are_the_kernels() {
        source_with_defines(
            "sparse_attention.cu",
            &[
                ("IX_MAX_DIM", INDEXER_MAX_DIM),
                ("IX_TILE", IX_TILE),
                ("SA_THREADS", SA_THREADS as usize),
                ("MQA_MAX_DIM", MQA_MAX_DIM),
                ("MQT_KEYS", MQT_KEYS),
                ("MQT_MAX_QK", MQT_MAX_QK),
                ("MQT_MAX_V", MQT_MAX_V),
                ("MQT_HEADS", MQT_HEADS),
                ("MQB_G_PITCH", MQB_G_PITCH),
                ("TOPK_THREADS", TOPK_THREADS as usize),
                ("LOSS_THREADS", LOSS_THREADS as usize),
                ("IXT_PITCH", IXT_PITCH),
                ("IXT_SCORE_THREADS", IXT_SCORE_THREADS as usize),
                ("IXT_SCORE_QUERIES", IXT_SCORE_QUERIES),
                ("IXT_SCORE_KEYS", IXT_SCORE_KEYS),
                ("IXT_DQ_THREADS", IXT_DQ_THREADS as usize),
                ("IXT_DQ_QUERIES", IXT_DQ_QUERIES),
                ("IXT_DQ_KEYS", IXT_DQ_KEYS),
                ("IXT_DK_THREADS", IXT_DK_THREADS as usize),
                ("IXT_DK_KEYS", IXT_DK_KEYS),
                ("IXT_DK_QUERIES", IXT_DK_QUERIES),
            ],
        );
    }

    #[test]
    fn the_scratch_holds_a_value_a_row_and_head_and_a_bit_a_pair() {
        let dims = SparseMqaDims {
            tokens: crate::backend::Tokens::new(2, 33),
            heads: 3,
            qk_dim: 8,
            v_dim: 6,
            topk: 4,
            scale: 1.0,
        };
        assert_eq!(sparse_mqa_scratch_len(dims, false), Some(66 * 3 + 66 * 2));
        assert_eq!(sparse_mqa_scratch_bytes(dims, DType::F32), 4 * (66 * 5));
    }

    /// On tensor cores the scratch holds a partial copy of every key row for
    /// each of a sequence's blocks (64 a sequence with 2 sequences, at most
    /// one a query position), then the bitmap; bf16 activations count it,
    /// f32 ones (which never take that kernel) do not.
    #[test]
    fn the_tensor_core_scratch_holds_a_partial_key_row_a_block() {
        let dims = |batch, seq| SparseMqaDims {
            tokens: crate::backend::Tokens::new(batch, seq),
            heads: 128,
            qk_dim: 576,
            v_dim: 512,
            topk: 2048,
            scale: 1.0,
        };
        let bitmap = 2 * 4096 * 128;
        assert_eq!(
            sparse_mqa_scratch_len(dims(2, 4096), true),
            Some(64 * 2 * 4096 * 576 + bitmap)
        );
        assert_eq!(
            sparse_mqa_scratch_len(dims(1, 40), true),
            Some(40 * 40 * 576 + 40 * 2)
        );
        assert_eq!(
            sparse_mqa_scratch_bytes(dims(2, 4096), DType::Bf16),
            4 * (64 * 2 * 4096 * 576 + bitmap) as u64
        );
        assert_eq!(
            sparse_mqa_scratch_bytes(dims(2, 4096), DType::F32),
            4 * (2 * 4096 * 128 + bitmap) as u64
        );
        // 576-channel rows wider than the tensor-core kernels take.
        let wide = SparseMqaDims {
            qk_dim: 592,
            ..dims(2, 4096)
        };
        assert_eq!(
            sparse_mqa_scratch_bytes(wide, DType::Bf16),
            sparse_mqa_scratch_bytes(wide, DType::F32)
        );
    }

    /// Which operands take the tensor-core MQA backward and the loss's
    /// tensor-core target: bf16 q, kv and dout at 16-byte aligned
    /// addresses (out bf16 or f32, aligned), rows a multiple of 16 up to
    /// 576 and values a multiple of 64 up to 512; anything else runs on
    /// CUDA cores.
    #[test]
    fn the_tensor_core_paths_take_bf16_aligned_operands_of_their_shapes() {
        let view = |ptr: u64, dtype| GpuView::new(ptr, 1 << 20, dtype);
        let bf = |ptr| view(ptr, DType::Bf16);
        let dims = SparseMqaDims {
            tokens: crate::backend::Tokens::new(1, 64),
            heads: 20,
            qk_dim: 576,
            v_dim: 512,
            topk: 8,
            scale: 1.0,
        };
        let fits =
            |q, kv, out, dout, dims| mqa_backward_fits_tensor_cores((&q, &kv), (&out, &dout), dims);
        assert!(fits(bf(256), bf(512), bf(768), bf(1024), dims));
        assert!(fits(
            bf(256),
            bf(512),
            view(768, DType::F32),
            bf(1024),
            dims
        ));
        // A dtype, an alignment or a shape off: CUDA cores.
        assert!(!fits(
            bf(256),
            bf(512),
            bf(768),
            view(1024, DType::F32),
            dims
        ));
        assert!(!fits(
            view(256, DType::F32),
            bf(512),
            bf(768),
            bf(1024),
            dims
        ));
        assert!(!fits(bf(256), bf(520), bf(768), bf(1024), dims));
        assert!(!fits(bf(256), bf(512), bf(776), bf(1024), dims));
        assert!(!fits(bf(256), bf(512), bf(768), bf(1032), dims));
        for (qk_dim, v_dim) in [(584, 512), (568, 512), (576, 480), (576, 576), (40, 32)] {
            let odd = SparseMqaDims {
                qk_dim,
                v_dim,
                ..dims
            };
            assert!(
                !fits(bf(256), bf(512), bf(768), bf(1024), odd),
                "{qk_dim} / {v_dim}"
            );
        }
        assert!(fits(
            bf(256),
            bf(512),
            bf(768),
            bf(1024),
            SparseMqaDims {
                qk_dim: 80,
                v_dim: 64,
                ..dims
            }
        ));
        // The loss's target: bf16 q and k, rows a multiple of 16 up to 576.
        assert!(loss_target_on_tensor_cores(&bf(256), &bf(512), 576));
        assert!(loss_target_on_tensor_cores(&bf(256), &bf(512), 16));
        assert!(!loss_target_on_tensor_cores(&bf(256), &bf(512), 592));
        assert!(!loss_target_on_tensor_cores(&bf(256), &bf(512), 40));
        assert!(!loss_target_on_tensor_cores(&bf(256), &bf(520), 576));
        assert!(!loss_target_on_tensor_cores(
            &view(256, DType::F32),
            &bf(512),
            576
        ));
    }

    /// The dense loss target packs rows of few heads into a block's four
    /// groups; sparse rows and rows of more heads take a block each.
    #[test]
    fn the_dense_loss_target_packs_rows_of_few_heads() {
        let dims = |heads, sparse| IndexerLossDims {
            tokens: crate::backend::Tokens::new(1, 100),
            topk: 8,
            heads,
            qk_dim: 576,
            scale: 1.0,
            coeff: 1.0,
            sparse,
        };
        let packed: Vec<usize> = [1, 16, 17, 32, 33, 64, 128]
            .into_iter()
            .map(|h| loss_target_rows_per_block(dims(h, false)))
            .collect();
        assert_eq!(packed, [4, 4, 2, 2, 1, 1, 1]);
        assert_eq!(loss_target_rows_per_block(dims(16, true)), 1);
    }

    /// The tensor-core MQA kernels' shared memory at 64 heads fits what an
    /// H100 or H200 grants a block (227 KiB).
    #[test]
    fn the_tensor_core_kernels_fit_a_hopper_block() {
        assert!(mqb_shared(MQT_HEADS / 16) <= 227 * 1024);
        assert!(mqt_shared(MQT_HEADS / 16) <= 227 * 1024);
        assert!(ltm_shared(MQT_HEADS / 16) <= 227 * 1024);
        assert!(mqw_shared(MQT_MAX_QK) <= 227 * 1024);
        assert!(ltw_shared(MQT_MAX_QK) <= 227 * 1024);
    }

    /// More than 64 heads of whole 64-channel steps up to 576 take the
    /// warpgroup loss target; fewer heads or other rows, the `mma.sync` one.
    #[test]
    fn many_heads_take_the_warpgroup_loss_target() {
        let dims = |heads, qk_dim| IndexerLossDims {
            tokens: crate::backend::Tokens::new(1, 100),
            topk: 8,
            heads,
            qk_dim,
            scale: 1.0,
            coeff: 1.0,
            sparse: false,
        };
        assert!(loss_target_on_warpgroups(dims(128, 576)));
        assert!(loss_target_on_warpgroups(dims(65, 64)));
        for (heads, qk) in [(64, 576), (16, 576), (128, 80), (128, 640)] {
            assert!(
                !loss_target_on_warpgroups(dims(heads, qk)),
                "{heads} / {qk}"
            );
        }
    }

    /// DeepSeek's shape takes the warpgroup forward from 33 heads; fewer
    /// heads, a row not whole 64-channel atoms, narrower than the values or
    /// past 576 channels, or values other than 512, the `mma.sync` one.
    #[test]
    fn deepseeks_shape_takes_the_warpgroup_forward() {
        let dims = |heads, qk_dim, v_dim| SparseMqaDims {
            tokens: crate::backend::Tokens::new(1, 100),
            heads,
            qk_dim,
            v_dim,
            topk: 8,
            scale: 1.0,
        };
        for heads in [33, 64, 80, 128] {
            assert!(mqa_on_warpgroups(dims(heads, 576, 512)), "{heads}");
        }
        assert!(mqa_on_warpgroups(dims(128, 512, 512)));
        for (heads, qk, v) in [
            (16, 576, 512),
            (32, 576, 512),
            (128, 80, 64),
            (128, 560, 512),
            (128, 640, 512),
            (128, 448, 512),
            (128, 576, 256),
            (128, 576, 448),
        ] {
            assert!(
                !mqa_on_warpgroups(dims(heads, qk, v)),
                "{heads} x {qk} / {v}"
            );
        }
    }
}

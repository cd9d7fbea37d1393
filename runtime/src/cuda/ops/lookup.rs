//! Launchers of `kernels/lookup.cu`: the token embedding's lookup and its
//! deterministic scatter-add.
//!
//! Token ids live on the device, so a bad one is found there: the kernel
//! reports the lowest bad row into the fault word (`the token id of row i is
//! past the vocabulary`, read by [`KernelSet::take_fault`]) and, as the
//! `Backend` documents, the call writes or adds nothing. Unlike the CPU
//! backend, the launch itself returns `Ok`: the refusal surfaces where the
//! fault word is read.
//!
//! The backward orders the rows by (id, row) into scratch (three u32 a
//! row, from the arena), then adds each id's rows, in row order, onto its
//! table row (see `lookup.cu`). It adds in the CPU's order, so an f32 table
//! gets the CPU's bits.

use crate::backend::LookupDims;
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, MAX_GRID_X, MAX_GRID_Y, exactly, float, len, product, words8,
};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, same_dtype};
use cudarc::driver::{CudaStream, LaunchConfig};

/// Threads of a lookup block (`LOOKUP_THREADS`): one channel each, or 8 in
/// the backward's 8-channel path.
const THREADS: u32 = 256;
/// Rows (a warp each) of a block of `embedding_backward_order`
/// (`ORDER_WARPS`).
const ORDER_WARPS: usize = 8;
/// The backward's scratch: u32s a row (`order`, `start`, `count`).
pub const EMBEDDING_BACKWARD_SCRATCH_PER_ROW: usize = 3;
/// Most blocks of the forward: each reads every id once to know whether the
/// call is refused, so more blocks would only repeat that read.
const MAX_FORWARD_BLOCKS: usize = 512;

impl KernelSet {
    /// `Backend::embedding_forward`: `out[r] = table[ids[r]]` (table and
    /// out of one dtype). A bad id is reported through the fault word and
    /// nothing is written.
    pub fn embedding_forward(
        &self,
        stream: &CudaStream,
        table: GpuView,
        ids: GpuView,
        out: GpuView,
        dims: LookupDims,
    ) -> Result<()> {
        let kn = "embedding_forward";
        same_dtype(kn, ("table", table.dtype), ("out", out.dtype))?;
        let t = float(kn, "table", &table)?;
        exactly(kn, "ids", &ids, DType::U32)?;
        float(kn, "out", &out)?;
        len(
            kn,
            "table",
            &table,
            product(kn, &[dims.vocab, dims.hidden])?,
        )?;
        len(kn, "out", &out, product(kn, &[ids.len, dims.hidden])?)?;
        if ids.len == 0 {
            return Ok(());
        }
        // Launched with hidden == 0 too: the ids are still checked.
        let config = LaunchConfig {
            grid_dim: (ids.len.min(MAX_FORWARD_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows, vocab, hidden) = (ids.len as u64, dims.vocab as u64, dims.hidden as u64);
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&table.ptr)
            .arg(&ids.ptr)
            .arg(&out.ptr)
            .arg(&t)
            .arg(&rows)
            .arg(&vocab)
            .arg(&hidden);
        b.arg(&self.fault_ptr);
        self.go(kn, &mut b, config)
    }

    /// `Backend::embedding_backward`: `dtable[ids[r]] += dout[r]`, each id's
    /// rows added in row order onto its table row, through `scratch` (u32,
    /// [`EMBEDDING_BACKWARD_SCRATCH_PER_ROW`] a row). A bad id is reported
    /// through the fault word and nothing is added.
    pub fn embedding_backward(
        &self,
        stream: &CudaStream,
        dout: GpuView,
        ids: GpuView,
        dtable: GpuView,
        scratch: GpuView,
        dims: LookupDims,
    ) -> Result<()> {
        let kn = "embedding_backward";
        let dt = float(kn, "dout", &dout)?;
        exactly(kn, "ids", &ids, DType::U32)?;
        let tt = float(kn, "dtable", &dtable)?;
        len(
            kn,
            "dtable",
            &dtable,
            product(kn, &[dims.vocab, dims.hidden])?,
        )?;
        len(kn, "dout", &dout, product(kn, &[ids.len, dims.hidden])?)?;
        exactly(kn, "scratch", &scratch, DType::U32)?;
        len(
            kn,
            "scratch",
            &scratch,
            product(kn, &[ids.len, EMBEDDING_BACKWARD_SCRATCH_PER_ROW])?,
        )?;
        if ids.len == 0 {
            return Ok(());
        }
        let vec8 = words8(&[dout, dtable], dims.hidden);
        let per_thread = if vec8 { 8 } else { 1 };
        let channel_groups = dims.hidden.div_ceil(per_thread * THREADS as usize).max(1);
        let order_blocks = ids.len.div_ceil(ORDER_WARPS);
        // Within the grid's bound, row indices also fit the scratch's u32s.
        if ids.len > MAX_GRID_X || channel_groups > MAX_GRID_Y {
            return Err(RuntimeError::Unsupported(format!(
                "{kn}: {} rows of {} channels exceed a CUDA grid (at most {} rows); \
                 give a micro-batch fewer tokens",
                ids.len, dims.hidden, MAX_GRID_X
            )));
        }
        let (rows, vocab, hidden) = (ids.len as u64, dims.vocab as u64, dims.hidden as u64);
        let u32_bytes = DType::U32.bytes() as u64;
        let [order, start, count] = [0u64, 1, 2].map(|i| scratch.ptr + i * rows * u32_bytes);
        let order_kn = "embedding_backward_order";
        let mut b = KernelArgs::new(stream, self.function(order_kn)?);
        b.arg(&ids.ptr)
            .arg(&order)
            .arg(&start)
            .arg(&count)
            .arg(&rows)
            .arg(&vocab);
        b.arg(&self.fault_ptr);
        let config = LaunchConfig {
            grid_dim: (order_blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.go(order_kn, &mut b, config)?;
        let vec8 = i32::from(vec8);
        let mut b = KernelArgs::new(stream, self.function(kn)?);
        b.arg(&dout.ptr)
            .arg(&dt)
            .arg(&ids.ptr)
            .arg(&order)
            .arg(&start)
            .arg(&count)
            .arg(&dtable.ptr)
            .arg(&tt)
            .arg(&hidden)
            .arg(&vec8);
        let config = LaunchConfig {
            grid_dim: (ids.len as u32, channel_groups as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.go(kn, &mut b, config)
    }
}

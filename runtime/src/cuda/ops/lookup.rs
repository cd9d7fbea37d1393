//! Lookups and losses on a GPU: [`LookupKernels`] for [`CudaBackend`], and
//! the launchers of `kernels/lookup.cu` (the token embedding's lookup and its
//! deterministic scatter-add) and of `kernels/cross_entropy.cu` on
//! [`KernelSet`], which take views `backend::lookup`'s checks accepted.
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

use crate::backend::{Backend, LookupDims, LookupKernels, LossDims};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, MAX_GRID_X, MAX_GRID_Y, dtype_tag, per_item, product, reduce_threads,
    words8,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use crate::view::{View, ViewMut};
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

/// The block of `cross_entropy_loss` and `cross_entropy_gradient` (a row
/// each; `LOSS_THREADS` in `cross_entropy.cu`).
const LOSS_THREADS: u32 = 256;

impl LookupKernels<CudaBuf> for CudaBackend {
    fn embedding_forward_unchecked(
        &self,
        table: View<'_, CudaBuf>,
        ids: View<'_, CudaBuf>,
        out: ViewMut<'_, CudaBuf>,
        dims: LookupDims,
    ) -> Result<()> {
        self.k()
            .embedding_forward(self.s(), self.v(table), self.v(ids), self.m(&out), dims)
    }

    fn embedding_backward_unchecked(
        &self,
        dout: View<'_, CudaBuf>,
        ids: View<'_, CudaBuf>,
        dtable: ViewMut<'_, CudaBuf>,
        dims: LookupDims,
    ) -> Result<()> {
        let ids = self.v(ids);
        // The rows' order by id, from the arena (a repeated step allocates
        // nothing).
        let scratch_len = ids.len * EMBEDDING_BACKWARD_SCRATCH_PER_ROW;
        let scratch = self.alloc_uninit(scratch_len, DType::U32)?;
        let scratch = GpuView::new(scratch.device_ptr(), scratch_len, DType::U32);
        self.k()
            .embedding_backward(self.s(), self.v(dout), ids, self.m(&dtable), scratch, dims)
    }

    fn cross_entropy_forward_unchecked(
        &self,
        logits: ViewMut<'_, CudaBuf>,
        targets: View<'_, CudaBuf>,
        losses: ViewMut<'_, CudaBuf>,
        dims: LossDims,
    ) -> Result<()> {
        self.k().cross_entropy_forward(
            self.s(),
            self.m(&logits),
            self.v(targets),
            self.m(&losses),
            dims,
        )
    }

    fn cross_entropy_backward_unchecked(
        &self,
        probs: ViewMut<'_, CudaBuf>,
        targets: View<'_, CudaBuf>,
        scale: f32,
        dims: LossDims,
    ) -> Result<()> {
        self.k()
            .cross_entropy_backward(self.s(), self.m(&probs), self.v(targets), scale, dims)
    }

    fn cross_entropy_loss_unchecked(
        &self,
        logits: ViewMut<'_, CudaBuf>,
        targets: View<'_, CudaBuf>,
        losses: ViewMut<'_, CudaBuf>,
        dims: LossDims,
    ) -> Result<()> {
        self.k().cross_entropy_loss(
            self.s(),
            self.m(&logits),
            self.v(targets),
            self.m(&losses),
            dims,
        )
    }

    fn cross_entropy_gradient_unchecked(
        &self,
        logits: ViewMut<'_, CudaBuf>,
        targets: View<'_, CudaBuf>,
        scale: f32,
        out: Option<ViewMut<'_, CudaBuf>>,
        losses: Option<ViewMut<'_, CudaBuf>>,
        dims: LossDims,
    ) -> Result<()> {
        let from = self.m(&logits);
        let into = out.as_ref().map_or(from, |o| self.m(o));
        let losses = losses.as_ref().map(|l| self.m(l));
        self.k()
            .cross_entropy_gradient(self.s(), from, self.v(targets), scale, into, losses, dims)
    }
}

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
        let t = dtype_tag(table.dtype);
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
        let (dt, tt) = (dtype_tag(dout.dtype), dtype_tag(dtable.dtype));
        scratch.operand().exactly(DType::U32, kn, "scratch")?;
        let per_row = product(kn, &[ids.len, EMBEDDING_BACKWARD_SCRATCH_PER_ROW])?;
        scratch.operand().has_len(kn, "scratch", per_row)?;
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

impl KernelSet {
    /// Whether the loss kernels take bf16 `logits` (and `out`, f32 or
    /// bf16, where they write one) 8 a 16-byte word: `words8`'s rule.
    fn logit_words(logits: &GpuView, out: Option<&GpuView>, d: LossDims) -> i32 {
        let aligned = match out {
            Some(out) => words8(&[*logits, *out], d.vocab),
            None => words8(&[*logits], d.vocab),
        };
        i32::from(logits.dtype == DType::Bf16 && aligned)
    }

    /// `Backend::cross_entropy_forward`, in place.
    pub fn cross_entropy_forward(
        &self,
        stream: &CudaStream,
        logits: GpuView,
        targets: GpuView,
        losses: GpuView,
        d: LossDims,
    ) -> Result<()> {
        let k = "cross_entropy_forward";
        if d.vocab == 0 || d.rows == 0 {
            return Ok(());
        }
        let vocab = d.vocab as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&logits.ptr)
            .arg(&targets.ptr)
            .arg(&losses.ptr)
            .arg(&vocab)
            .arg(&self.fault_ptr);
        self.go(k, &mut b, per_item(d.rows, reduce_threads(d.vocab, 1024))?)
    }

    /// `Backend::cross_entropy_backward`, in place.
    pub fn cross_entropy_backward(
        &self,
        stream: &CudaStream,
        probs: GpuView,
        targets: GpuView,
        scale: f32,
        d: LossDims,
    ) -> Result<()> {
        let k = "cross_entropy_backward";
        if d.vocab == 0 || d.rows == 0 {
            return Ok(());
        }
        let vocab = d.vocab as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&probs.ptr)
            .arg(&targets.ptr)
            .arg(&scale)
            .arg(&vocab)
            .arg(&self.fault_ptr);
        self.go(k, &mut b, per_item(d.rows, reduce_threads(d.vocab, 1024))?)
    }

    /// `Backend::cross_entropy_gradient`: the gradients of `logits` (f32
    /// or bf16, read only) into `out` (f32 or bf16, `[rows, vocab]`; it may
    /// be `logits` itself), and with `losses` each row's loss.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_gradient(
        &self,
        stream: &CudaStream,
        logits: GpuView,
        targets: GpuView,
        scale: f32,
        out: GpuView,
        losses: Option<GpuView>,
        d: LossDims,
    ) -> Result<()> {
        let k = "cross_entropy_gradient";
        let (logits_dtype, out_dtype) = (dtype_tag(logits.dtype), dtype_tag(out.dtype));
        if d.vocab == 0 || d.rows == 0 {
            return Ok(());
        }
        let vocab = d.vocab as u64;
        let words = Self::logit_words(&logits, Some(&out), d);
        // A null pointer: no losses.
        let losses = losses.map_or(0u64, |l| l.ptr);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&logits.ptr)
            .arg(&logits_dtype)
            .arg(&words)
            .arg(&targets.ptr)
            .arg(&scale)
            .arg(&out.ptr)
            .arg(&out_dtype)
            .arg(&losses)
            .arg(&vocab)
            .arg(&self.fault_ptr);
        self.go(k, &mut b, per_item(d.rows, LOSS_THREADS)?)
    }

    /// `Backend::cross_entropy_loss`: the losses of f32 or bf16 `logits`,
    /// which it only reads.
    pub fn cross_entropy_loss(
        &self,
        stream: &CudaStream,
        logits: GpuView,
        targets: GpuView,
        losses: GpuView,
        d: LossDims,
    ) -> Result<()> {
        let k = "cross_entropy_loss";
        let logits_dtype = dtype_tag(logits.dtype);
        if d.vocab == 0 || d.rows == 0 {
            return Ok(());
        }
        let vocab = d.vocab as u64;
        let words = Self::logit_words(&logits, None, d);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&logits.ptr)
            .arg(&logits_dtype)
            .arg(&words)
            .arg(&targets.ptr)
            .arg(&losses.ptr)
            .arg(&vocab)
            .arg(&self.fault_ptr);
        self.go(k, &mut b, per_item(d.rows, LOSS_THREADS)?)
    }
}

//! DeepSeek sparse attention on a GPU: [`SparseAttentionKernels`] for
//! [`CudaBackend`]. There are no CUDA kernels for it yet, so every method
//! refuses with `Unsupported`; `train::prepare` refuses a `D` layer on a GPU
//! before any work with the same message, so a run never gets this far.

use crate::backend::{
    AttentionInputs, IndexerDims, IndexerInputs, IndexerLossDims, LayerNormDims,
    SparseAttentionDims, SparseAttentionKernels,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{View, ViewMut};

/// Why a `D` layer does not run on a GPU.
pub const NO_GPU_KERNEL: &str = "DeepSeek sparse attention (`D`) has no GPU kernels yet \
     (the indexer, its top-k and the sparse attention run on the CPU only); train D layers \
     with --device cpu";

fn refused() -> Result<()> {
    Err(RuntimeError::Unsupported(NO_GPU_KERNEL.into()))
}

impl SparseAttentionKernels<CudaBuf> for CudaBackend {
    fn indexer_scores_unchecked(
        &self,
        _inputs: IndexerInputs<View<'_, CudaBuf>>,
        _scores: ViewMut<'_, CudaBuf>,
        _dims: IndexerDims,
    ) -> Result<()> {
        refused()
    }

    fn indexer_topk_unchecked(
        &self,
        _scores: View<'_, CudaBuf>,
        _indices: ViewMut<'_, CudaBuf>,
        _dims: IndexerDims,
    ) -> Result<()> {
        refused()
    }

    fn indexer_loss_unchecked(
        &self,
        _scores: View<'_, CudaBuf>,
        _q: View<'_, CudaBuf>,
        _k: View<'_, CudaBuf>,
        _indices: View<'_, CudaBuf>,
        _loss: ViewMut<'_, CudaBuf>,
        _d_scores: ViewMut<'_, CudaBuf>,
        _dims: IndexerLossDims,
    ) -> Result<()> {
        refused()
    }

    fn indexer_backward_unchecked(
        &self,
        _inputs: IndexerInputs<View<'_, CudaBuf>>,
        _d_scores: View<'_, CudaBuf>,
        _grads: IndexerInputs<ViewMut<'_, CudaBuf>>,
        _dims: IndexerDims,
        _scale: f32,
    ) -> Result<()> {
        refused()
    }

    fn sparse_attention_forward_unchecked(
        &self,
        _inputs: AttentionInputs<View<'_, CudaBuf>>,
        _indices: View<'_, CudaBuf>,
        _out: ViewMut<'_, CudaBuf>,
        _lse: ViewMut<'_, CudaBuf>,
        _dims: SparseAttentionDims,
    ) -> Result<()> {
        refused()
    }

    fn sparse_attention_backward_unchecked(
        &self,
        _inputs: AttentionInputs<View<'_, CudaBuf>>,
        _indices: View<'_, CudaBuf>,
        _out: View<'_, CudaBuf>,
        _lse: View<'_, CudaBuf>,
        _dout: View<'_, CudaBuf>,
        _grads: AttentionInputs<ViewMut<'_, CudaBuf>>,
        _dims: SparseAttentionDims,
    ) -> Result<()> {
        refused()
    }

    fn layer_norm_forward_unchecked(
        &self,
        _x: View<'_, CudaBuf>,
        _weight: View<'_, CudaBuf>,
        _bias: View<'_, CudaBuf>,
        _y: ViewMut<'_, CudaBuf>,
        _stats: ViewMut<'_, CudaBuf>,
        _dims: LayerNormDims,
    ) -> Result<()> {
        refused()
    }

    fn layer_norm_backward_unchecked(
        &self,
        _x: View<'_, CudaBuf>,
        _weight: View<'_, CudaBuf>,
        _stats: View<'_, CudaBuf>,
        _dy: View<'_, CudaBuf>,
        _dx: ViewMut<'_, CudaBuf>,
        _dims: LayerNormDims,
    ) -> Result<()> {
        refused()
    }

    fn layer_norm_weight_grad_unchecked(
        &self,
        _x: View<'_, CudaBuf>,
        _stats: View<'_, CudaBuf>,
        _dy: View<'_, CudaBuf>,
        _d_weight: ViewMut<'_, CudaBuf>,
        _d_bias: ViewMut<'_, CudaBuf>,
        _dims: LayerNormDims,
    ) -> Result<()> {
        refused()
    }
}

//! The gated delta rule on a GPU: [`DeltaKernels`] for [`CudaBackend`].
//! There is no CUDA kernel for it yet, so both methods refuse with
//! `Unsupported`; `train::prepare` refuses a `G` layer on a GPU before any
//! work with the same message, so a run never gets this far.

use crate::backend::{DeltaDims, DeltaGrads, DeltaInputs, DeltaKernels};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{View, ViewMut};

/// Why a `G` layer does not run on a GPU.
pub const NO_GPU_KERNEL: &str =
    "the gated delta rule has no GPU kernel yet; train G layers on the CPU";

impl DeltaKernels<CudaBuf> for CudaBackend {
    fn gated_delta_forward_unchecked(
        &self,
        _inputs: DeltaInputs<View<'_, CudaBuf>>,
        _out: ViewMut<'_, CudaBuf>,
        _states: ViewMut<'_, CudaBuf>,
        _dims: DeltaDims,
    ) -> Result<()> {
        Err(RuntimeError::Unsupported(NO_GPU_KERNEL.into()))
    }

    fn gated_delta_backward_unchecked(
        &self,
        _inputs: DeltaInputs<View<'_, CudaBuf>>,
        _states: View<'_, CudaBuf>,
        _d_out: View<'_, CudaBuf>,
        _grads: DeltaGrads<ViewMut<'_, CudaBuf>>,
        _dims: DeltaDims,
    ) -> Result<()> {
        Err(RuntimeError::Unsupported(NO_GPU_KERNEL.into()))
    }
}

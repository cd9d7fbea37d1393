//! Tensor maps: the 128-byte descriptors of global arrays that Hopper's
//! TMA loads and stores read (`TensorMap` in `wgmma.cuh`), encoded on the
//! host and passed in a kernel's parameters. Every map here is tiled with
//! the 128-byte swizzle the `wgmma` kernels stage their tiles in, so a
//! box's inner dimension is 128 bytes; loads past the array's sizes give
//! zeros (and still count their bytes), stores and adds there are dropped.

use crate::view::DType;
use cudarc::driver::sys::{self, CUtensorMap};

/// The map of an array of `dtype` (bf16 or f32) at `ptr` with `sizes`
/// elements along each dimension (the first contiguous), `strides` bytes
/// between consecutive indices of each dimension after the first, read
/// or written in boxes of `boxes` elements. The error says why the driver
/// refused it (the caller says what runs instead); TMA needs a 16-byte
/// aligned base and strides that are multiples of 16 bytes.
pub(super) fn tiled_map<const RANK: usize>(
    ptr: u64,
    dtype: DType,
    sizes: [u64; RANK],
    strides: &[u64],
    boxes: [u32; RANK],
) -> Result<CUtensorMap, String> {
    use sys::{
        CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
        CUtensorMapL2promotion, CUtensorMapSwizzle,
    };
    let element = match dtype {
        DType::F32 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        DType::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        other => return Err(format!("TMA maps here hold bf16 or f32, not {other}")),
    };
    if strides.len() + 1 != RANK {
        return Err(format!(
            "a {RANK}-dimensional map takes {} strides, not {}",
            RANK - 1,
            strides.len()
        ));
    }
    let steps = [1u32; RANK];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is to a live local holding the rank's (or,
    // for the strides, one fewer) values; encoding reads no device memory.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            element,
            RANK as u32,
            ptr as *mut std::ffi::c_void,
            sizes.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "encoding the TMA map of a {sizes:?} {dtype} array at {ptr:#x} (strides {strides:?} \
             bytes, boxes {boxes:?}) failed ({result:?})"
        ));
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arguments the driver would misread are refused before it is called
    /// (so these run without a GPU): a stride for each dimension after the
    /// first, and an element type the kernels read.
    #[test]
    fn a_map_needs_a_stride_a_dimension_after_the_first_and_a_kernels_dtype() {
        let two = tiled_map(
            0,
            DType::Bf16,
            [128u64, 16, 4096, 1],
            &[256, 4096],
            [64, 1, 128, 1],
        );
        assert!(
            two.as_ref().unwrap_err().contains("takes 3 strides, not 2"),
            "{two:?}"
        );
        let int = tiled_map(0, DType::U32, [128u64, 64], &[512], [32, 64]);
        assert!(
            int.as_ref().unwrap_err().contains("bf16 or f32, not"),
            "{int:?}"
        );
    }
}

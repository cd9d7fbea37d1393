//! Tensor maps: the 128-byte descriptors of global arrays that Hopper's
//! TMA loads and stores read (`TensorMap` in `wgmma.cuh`), encoded on the
//! host and passed in a kernel's parameters. Every map here is tiled with
//! the 128-byte swizzle the `wgmma` kernels stage their tiles in, so a
//! box's inner dimension is 128 bytes; loads past the array's sizes give
//! zeros (and still count their bytes), stores and adds there are dropped.

use crate::view::DType;
use cudarc::driver::sys::{self, CUtensorMap};

/// The map of a dense array of `dtype` (bf16 or f32) at `ptr` with `sizes`
/// elements along each dimension (the first contiguous, each next one
/// right after the one before), read or written in boxes of `boxes`
/// elements. The error says why the driver refused it (the caller says
/// what runs instead); TMA needs a 16-byte aligned base and rows of a
/// multiple of 16 bytes.
pub(crate) fn tiled_map<const RANK: usize>(
    ptr: u64,
    dtype: DType,
    sizes: [u64; RANK],
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
    let strides = dense_strides(dtype, sizes);
    let strides = &strides[..RANK.saturating_sub(1)];
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

/// Bytes from one index of dimension i + 1 to the next, for each i, of a
/// dense array of `sizes` (the driver reads the first RANK - 1).
fn dense_strides<const RANK: usize>(dtype: DType, sizes: [u64; RANK]) -> [u64; RANK] {
    let mut strides = [0u64; RANK];
    let mut bytes = dtype.bytes() as u64;
    for (stride, size) in strides.iter_mut().zip(sizes) {
        bytes = bytes.saturating_mul(size);
        *stride = bytes;
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense array's strides: a q of 16 heads of 128 bf16 channels and
    /// 4,096 rows a sequence is 256 bytes a head, 4 KiB a row and 16 MiB a
    /// sequence; a [rows, 1024] f32 matrix 4 KiB a row.
    #[test]
    fn strides_are_the_sizes_before_them_in_bytes() {
        assert_eq!(
            dense_strides(DType::Bf16, [128u64, 16, 4096, 2]),
            [256, 4096, 16 << 20, 32 << 20]
        );
        assert_eq!(dense_strides(DType::F32, [1024u64, 300]), [4096, 1_228_800]);
    }

    /// An element type the kernels do not read is refused before the driver
    /// is called (so this runs without a GPU).
    #[test]
    fn a_map_holds_bf16_or_f32() {
        let int = tiled_map(0, DType::U32, [128u64, 64], [32, 64]);
        assert!(
            int.as_ref().unwrap_err().contains("bf16 or f32, not"),
            "{int:?}"
        );
    }
}

// Dtype conversion and fills: `Backend::cast` and `Backend::fill`.
#include "common.cuh"

__device__ __forceinline__ double load_wide(const void* p, int dtype, u64 i) {
    if (dtype == DTYPE_F64) {
        return static_cast<const double*>(p)[i];
    }
    return static_cast<double>(load(p, dtype, i));
}

// Every source value is exact in f64, so converting from f64 rounds once:
// `__double2bfloat16` rounds to nearest even straight from f64, which is
// what the CPU backend's round-to-odd-then-bf16 computes.
__device__ __forceinline__ void store_wide(void* p, int dtype, u64 i, double v) {
    if (dtype == DTYPE_F64) {
        static_cast<double*>(p)[i] = v;
    } else if (dtype == DTYPE_BF16) {
        static_cast<__nv_bfloat16*>(p)[i] = __double2bfloat16(v);
    } else {
        static_cast<float*>(p)[i] = __double2float_rn(v);
    }
}

// dst[i] = src[i] converted, for bf16, f32 and f64 on either side.
extern "C" __global__ void cast(const void* src, int src_dtype, void* dst, int dst_dtype, u64 n) {
    grid_dependency_sync();
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        store_wide(dst, dst_dtype, i, load_wide(src, src_dtype, i));
    }
}

// dst[i] = value rounded to the view's dtype (f64 gets the f32 value exactly).
extern "C" __global__ void fill(void* dst, int dtype, u64 n, float value) {
    grid_dependency_sync();
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        if (dtype == DTYPE_F64) {
            static_cast<double*>(dst)[i] = static_cast<double>(value);
        } else {
            store(dst, dtype, i, value);
        }
    }
}

// Shared by every kernel source (handed to NVRTC as an in-memory header).
//
// Storage types are tagged at run time: a float view is f32 or bf16 (f64
// where a kernel says so), and each kernel argument carries its tag. The
// tag is the same for every thread of a launch, so the branch costs no
// divergence, and one kernel serves every mix of dtypes the `Backend` trait
// allows (bf16 activations into f32 gradient accumulators, ...). Values are
// widened to f32 on load and rounded once on store, as the CPU backend does.
//
// Determinism: every reduction has a fixed shape (per-thread partial sums in
// a fixed stride order, then a butterfly across a warp and a fixed tree
// across warps), chosen from the problem's dimensions alone; no kernel adds
// floats with atomics. Integer atomics (histograms, the error status) give
// the same result in any order.
#pragma once
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;
typedef __nv_bfloat16 bf16;

// The dtype tags: `cuda::launch::dtype_tag` on the Rust side.
#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F64 2

// `backend::IGNORE_TARGET`.
#define IGNORE_TARGET 0xffffffffu

__device__ __forceinline__ float neg_inf() {
    return __int_as_float(0xff800000u);
}

__device__ __forceinline__ float load(const void* p, int dtype, u64 i) {
    if (dtype == DTYPE_BF16) {
        return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    }
    return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store(void* p, int dtype, u64 i, float v) {
    if (dtype == DTYPE_BF16) {
        static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    } else {
        static_cast<float*>(p)[i] = v;
    }
}

// The first index of this thread in a grid-stride loop, and the stride.
__device__ __forceinline__ u64 grid_start() {
    return static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ u64 grid_stride() {
    return static_cast<u64>(gridDim.x) * blockDim.x;
}

// W consecutive f32 (W = 1 or 4: one 16-byte word, the pointer 16-byte
// aligned) loaded and stored as one access, and stored rounded to bf16
// (W = 4: one 8-byte word, the pointer 8-byte aligned).
template <int W>
__device__ __forceinline__ void load_run(const float* p, float (&v)[W]) {
    if constexpr (W == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
    } else {
        v[0] = p[0];
    }
}
template <int W>
__device__ __forceinline__ void store_run(float* p, const float (&v)[W]) {
    if constexpr (W == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        p[0] = v[0];
    }
}
template <int W>
__device__ __forceinline__ void store_run_bf16(bf16* p, const float (&v)[W]) {
    if constexpr (W == 4) {
        __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3])};
        *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(pair);
    } else {
        p[0] = __float2bfloat16_rn(v[0]);
    }
}

// Programmatic dependent launch (`cuda::launch::args`). Every kernel calls
// this first: launched with the attribute, it may start while the kernel
// before it on the stream drains, and `griddepcontrol.wait` holds it until
// that kernel has finished and its writes are visible; then it lets the
// kernel after it launch (whose blocks take SMs only as this one's last
// blocks leave them, and wait here in turn). Without the attribute the
// wait returns at once. Below sm_90 there is no such launch (the host only
// sets the attribute for sm_90 builds), and this is empty.
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- errors found on the device --------------------------------------------
// Kernels that read indices (token targets, experts, rows) check them and
// report a bad one into a status word instead of reading out of bounds. The
// word holds `code << 40 | index` of the lowest failure (atomicMin), or all
// ones when nothing failed, so the report does not depend on thread order.
// `cuda::launch::DeviceFault` decodes it.
#define FAULT_TARGET 1u        // a loss target at or past the vocabulary
#define FAULT_EXPERT 2u        // a selected expert at or past the expert count
#define FAULT_COUNTS 3u        // expert counts that do not match the routing
#define FAULT_ROW_INDEX 4u     // a gather/scatter row index out of range
#define FAULT_POSITION 5u      // an unpermute position out of range
#define FAULT_DECAYED 6u       // a decayed range out of order or out of the shard
#define FAULT_TOKEN 7u         // a token id at or past the vocabulary
#define FAULT_SELECTED_KEY 8u  // a query row whose selected keys are out of range or repeated

__device__ __forceinline__ void report_fault(u64* status, u32 code, u64 index) {
    atomicMin(status, (static_cast<u64>(code) << 40) | (index & ((1ull << 40) - 1)));
}

// ---- fixed-shape reductions ------------------------------------------------
// A butterfly over the 32 lanes: every lane ends with the same bits, because
// each step adds the same two values (a + b == b + a in IEEE arithmetic).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int m = 16; m > 0; m >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, m);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int m = 16; m > 0; m >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    }
    return v;
}

// Sums the columns of a (32, 32) block's values `v` (thread (x, y) gives
// row y of column x) as a fixed tree over the rows in `partial` (`[32][33]`,
// padded against bank conflicts), leaving column x's sum in
// `partial[0][x]`. Every thread of the block calls it; it ends with a
// barrier.
__device__ __forceinline__ void column_tree_sum(float (*partial)[33], float v) {
    partial[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (threadIdx.y < s) {
            partial[threadIdx.y][threadIdx.x] += partial[threadIdx.y + s][threadIdx.x];
        }
        __syncthreads();
    }
}

// The sum of `v` over a block whose size is a multiple of 32 (at most 1024),
// returned to every thread. `scratch` holds 32 values; the call ends with a
// barrier, so the same scratch can be used again right after.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    T total = lane < warps ? scratch[lane] : T(0);
    total = warp_sum(total);
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float total = lane < warps ? scratch[lane] : neg_inf();
    total = warp_max(total);
    __syncthreads();
    return total;
}

// 8 bf16 channels moved as one 16-byte word (`vec8` paths), widened to
// f32 and rounded back to nearest.
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 p = __bfloat1622float2(h[e]);
        f[2 * e] = p.x;
        f[2 * e + 1] = p.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        h[e] = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
    }
    return v;
}

// Two floats as a bf16 pair, the first in the low half (the
// lower-indexed element).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

// Four floats as 4 bf16 channels in one 8-byte word.
__device__ __forceinline__ uint2 pack4(float a, float b, float c, float d) {
    return make_uint2(pack_bf16(a, b), pack_bf16(c, d));
}

// Word `word` (8 channels) of a bf16 or f32 tensor: one 16-byte access
// for bf16, two for f32 (the launcher checks 16-byte alignment). For
// kernels whose operands mix the two (an f32 gradient sum read beside bf16
// activations).
__device__ __forceinline__ void load8(const void* p, int dtype, u64 word, float (&f)[8]) {
    if (dtype == DTYPE_BF16) {
        unpack8(static_cast<const uint4*>(p)[word], f);
        return;
    }
    const float4* q = static_cast<const float4*>(p) + 2 * word;
    const float4 a = q[0];
    const float4 b = q[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

__device__ __forceinline__ void store8(void* p, int dtype, u64 word, const float (&f)[8]) {
    if (dtype == DTYPE_BF16) {
        static_cast<uint4*>(p)[word] = pack8(f);
        return;
    }
    float4* q = static_cast<float4*>(p) + 2 * word;
    q[0] = make_float4(f[0], f[1], f[2], f[3]);
    q[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// The same with the dtype fixed at compile time, for kernels that
// instantiate their 8-channel paths per dtype mix: `Bf16Words8` and
// `F32Words8` ignore the run-time tag, `AnyWords8` reads it. A tag read per
// access kept the compiler from overlapping a thread's loads (rmsnorm's
// backward with an f32 dy ran at 60% of its bf16 speed).
struct Bf16Words8 {
    static __device__ __forceinline__ void load(const void* p, int, u64 word, float (&f)[8]) {
        unpack8(static_cast<const uint4*>(p)[word], f);
    }
    static __device__ __forceinline__ void store(void* p, int, u64 word, const float (&f)[8]) {
        static_cast<uint4*>(p)[word] = pack8(f);
    }
};
struct F32Words8 {
    static __device__ __forceinline__ void load(const void* p, int, u64 word, float (&f)[8]) {
        load8(p, DTYPE_F32, word, f);
    }
    static __device__ __forceinline__ void store(void* p, int, u64 word, const float (&f)[8]) {
        store8(p, DTYPE_F32, word, f);
    }
};
struct AnyWords8 {
    static __device__ __forceinline__ void load(const void* p, int dtype, u64 word, float (&f)[8]) {
        load8(p, dtype, word, f);
    }
    static __device__ __forceinline__ void store(void* p, int dtype, u64 word, const float (&f)[8]) {
        store8(p, dtype, word, f);
    }
};

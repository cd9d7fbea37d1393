// Optimizer steps over one bucket's f32 shard (`Backend::adam_update`,
// `Backend::sgd_update`). Weight decay applies to the elements inside the
// `decayed` ranges ([start, end) pairs, ascending, disjoint): a thread finds
// its element's range by binary search. The arithmetic is the CPU
// reference's, operation for operation (this source compiles without FMA
// contraction), so f32 runs agree with it bit for bit where the inputs do.
#include "common.cuh"

// The first of the n ranges of `decayed` whose end is past i (n if none).
__device__ __forceinline__ u32 range_after(const u32* decayed, u32 n, u64 i) {
    u32 lo = 0;
    u32 hi = n;
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2;
        if (decayed[2 * mid + 1] <= i) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Whether element i lies inside one of the n ranges of `decayed`.
__device__ __forceinline__ bool is_decayed(const u32* decayed, u32 n, u64 i) {
    const u32 r = range_after(decayed, n, i);
    return r < n && decayed[2 * r] <= i;
}

// Whether each of elements i .. i + 3 lies inside a range: one search for
// the quad where no range ends inside it (the ranges are matrices, so
// nearly every quad), which decides all four the way is_decayed does each.
__device__ __forceinline__ void quad_decayed(const u32* decayed, u32 n, u64 i, bool (&d)[4]) {
    const u32 r = range_after(decayed, n, i);
    if (r == n) {
        d[0] = d[1] = d[2] = d[3] = false;
        return;
    }
    const u64 start = decayed[2 * r];
    if (i + 3 < decayed[2 * r + 1]) {
        // Range r is each element's first range ending past it.
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            d[e] = start <= i + e;
        }
        return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        d[e] = is_decayed(decayed, n, i + e);
    }
}

// Range checks: pair r must start at or after the previous end and end
// inside the shard; a bad pair is reported (the update still runs).
__device__ __forceinline__ void check_ranges(const u32* decayed, u32 n, u64 len, u64* status) {
    for (u64 r = grid_start(); r < n; r += grid_stride()) {
        const u32 start = decayed[2 * r];
        const u32 end = decayed[2 * r + 1];
        const u32 previous_end = r == 0 ? 0 : decayed[2 * r - 1];
        if (start < previous_end || end < start || end > len) {
            report_fault(status, FAULT_DECAYED, r);
        }
    }
}

// The constants of one Adam step: decay = 1 - lr * weight_decay; bc1, bc2
// the bias corrections (host-computed in f64, rounded to f32, as the CPU
// reference does).
struct AdamStep {
    float lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2;

    // One element, in the CPU reference's order of operations.
    __device__ __forceinline__ void apply(float& p, float grad, float& m, float& v, bool decayed) const {
        const float g = grad * grad_scale;
        if (decayed) {
            p *= decay;
        }
        const float mi = beta1 * m + (1.0f - beta1) * g;
        const float vi = beta2 * v + (1.0f - beta2) * g * g;
        m = mi;
        v = vi;
        const float m_hat = mi / bc1;
        const float v_hat = vi / bc2;
        p = p - lr * m_hat / (sqrtf(v_hat) + eps);
    }
};

// Four elements a thread (16-byte loads and stores) where all four arrays
// are 16-byte aligned, so more of the memory's bandwidth is in flight, with
// one search of the decayed ranges a quad rather than one an element (each
// search is a chain of dependent loads); then the elements past the last
// whole quad (or all of them) one a thread.
// With `copy` (of dtype `copy_dtype`), the updated parameters are also
// stored there, rounded once (the compute-precision copy).
extern "C" __global__ void adam_update(
    float* param, void* copy, int copy_dtype, const float* grad, float* m, float* v,
    const u32* decayed, u32 n_ranges, u64 n, float lr, float beta1, float beta2, float eps,
    float decay, float grad_scale, float bc1, float bc2, u64* status) {
    grid_dependency_sync();
    check_ranges(decayed, n_ranges, n, status);
    const AdamStep step{lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2};
    const u64 address_bits = reinterpret_cast<u64>(param) | reinterpret_cast<u64>(grad) |
                             reinterpret_cast<u64>(m) | reinterpret_cast<u64>(v);
    const u64 quads = address_bits % 16 == 0 ? n / 4 : 0;
    // A bf16 copy 8-byte aligned takes a quad's four values in one store.
    const bool packed_copy = copy_dtype == DTYPE_BF16 && reinterpret_cast<u64>(copy) % 8 == 0;
    for (u64 q = grid_start(); q < quads; q += grid_stride()) {
        float4 p4 = reinterpret_cast<float4*>(param)[q];
        const float4 g4 = reinterpret_cast<const float4*>(grad)[q];
        float4 m4 = reinterpret_cast<float4*>(m)[q];
        float4 v4 = reinterpret_cast<float4*>(v)[q];
        const u64 i = 4 * q;
        bool d[4];
        quad_decayed(decayed, n_ranges, i, d);
        step.apply(p4.x, g4.x, m4.x, v4.x, d[0]);
        step.apply(p4.y, g4.y, m4.y, v4.y, d[1]);
        step.apply(p4.z, g4.z, m4.z, v4.z, d[2]);
        step.apply(p4.w, g4.w, m4.w, v4.w, d[3]);
        reinterpret_cast<float4*>(m)[q] = m4;
        reinterpret_cast<float4*>(v)[q] = v4;
        reinterpret_cast<float4*>(param)[q] = p4;
        if (copy == nullptr) {
            continue;
        }
        if (packed_copy) {
            reinterpret_cast<uint2*>(copy)[q] = pack4(p4.x, p4.y, p4.z, p4.w);
        } else {
            store(copy, copy_dtype, i, p4.x);
            store(copy, copy_dtype, i + 1, p4.y);
            store(copy, copy_dtype, i + 2, p4.z);
            store(copy, copy_dtype, i + 3, p4.w);
        }
    }
    for (u64 i = 4 * quads + grid_start(); i < n; i += grid_stride()) {
        float p = param[i];
        float mi = m[i];
        float vi = v[i];
        step.apply(p, grad[i], mi, vi, is_decayed(decayed, n_ranges, i));
        m[i] = mi;
        v[i] = vi;
        param[i] = p;
        if (copy != nullptr) {
            store(copy, copy_dtype, i, p);
        }
    }
}

// g' = g * grad_scale + wd * p; with a momentum buffer buf = mu buf + g',
// p -= lr buf; else p -= lr g'. `copy` as in adam_update.
extern "C" __global__ void sgd_update(
    float* param, void* copy, int copy_dtype, const float* grad, float* momentum,
    const u32* decayed, u32 n_ranges, u64 n, float lr, float mu, float weight_decay,
    float grad_scale, u64* status) {
    grid_dependency_sync();
    check_ranges(decayed, n_ranges, n, status);
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float wd = is_decayed(decayed, n_ranges, i) ? weight_decay : 0.0f;
        float p = param[i];
        const float g = grad[i] * grad_scale + wd * p;
        if (momentum != nullptr) {
            const float b = mu * momentum[i] + g;
            momentum[i] = b;
            p -= lr * b;
        } else {
            p -= lr * g;
        }
        param[i] = p;
        if (copy != nullptr) {
            store(copy, copy_dtype, i, p);
        }
    }
}

// Optimizer steps over one bucket's f32 shard (`Backend::adam_update`,
// `Backend::sgd_update`). Weight decay applies to the elements inside the
// `decayed` ranges ([start, end) pairs, ascending, disjoint): a thread finds
// its element's range by binary search. The arithmetic is the CPU
// reference's, operation for operation (this source compiles without FMA
// contraction), so f32 runs agree with it bit for bit where the inputs do.
#include "common.cuh"

// Whether element i lies inside one of the n ranges of `decayed`.
__device__ __forceinline__ bool is_decayed(const u32* decayed, u32 n, u64 i) {
    u32 lo = 0;
    u32 hi = n;
    while (lo < hi) {  // first range whose end is past i
        const u32 mid = (lo + hi) / 2;
        if (decayed[2 * mid + 1] <= i) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < n && decayed[2 * lo] <= i;
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
// are 16-byte aligned, so more of the memory's bandwidth is in flight;
// then the elements past the last whole quad (or all of them) one a thread.
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
    for (u64 q = grid_start(); q < quads; q += grid_stride()) {
        float4 p4 = reinterpret_cast<float4*>(param)[q];
        const float4 g4 = reinterpret_cast<const float4*>(grad)[q];
        float4 m4 = reinterpret_cast<float4*>(m)[q];
        float4 v4 = reinterpret_cast<float4*>(v)[q];
        const u64 i = 4 * q;
        step.apply(p4.x, g4.x, m4.x, v4.x, is_decayed(decayed, n_ranges, i));
        step.apply(p4.y, g4.y, m4.y, v4.y, is_decayed(decayed, n_ranges, i + 1));
        step.apply(p4.z, g4.z, m4.z, v4.z, is_decayed(decayed, n_ranges, i + 2));
        step.apply(p4.w, g4.w, m4.w, v4.w, is_decayed(decayed, n_ranges, i + 3));
        reinterpret_cast<float4*>(m)[q] = m4;
        reinterpret_cast<float4*>(v)[q] = v4;
        reinterpret_cast<float4*>(param)[q] = p4;
        if (copy != nullptr) {
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

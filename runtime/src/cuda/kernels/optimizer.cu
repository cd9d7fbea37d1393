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

// decay = 1 - lr * weight_decay; bc1, bc2 the bias corrections (host-computed
// in f64, rounded to f32, as the CPU reference does).
extern "C" __global__ void adam_update(
    float* param, const float* grad, float* m, float* v, const u32* decayed, u32 n_ranges, u64 n,
    float lr, float beta1, float beta2, float eps, float decay, float grad_scale, float bc1,
    float bc2, u64* status) {
    check_ranges(decayed, n_ranges, n, status);
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float g = grad[i] * grad_scale;
        float p = param[i];
        if (is_decayed(decayed, n_ranges, i)) {
            p *= decay;
        }
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float m_hat = mi / bc1;
        const float v_hat = vi / bc2;
        param[i] = p - lr * m_hat / (sqrtf(v_hat) + eps);
    }
}

// g' = g * grad_scale + wd * p; with a momentum buffer buf = mu buf + g',
// p -= lr buf; else p -= lr g'.
extern "C" __global__ void sgd_update(
    float* param, const float* grad, float* momentum, const u32* decayed, u32 n_ranges, u64 n,
    float lr, float mu, float weight_decay, float grad_scale, u64* status) {
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
    }
}

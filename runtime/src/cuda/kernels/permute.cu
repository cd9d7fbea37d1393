// Moving rows by index: gathers, scatters, and the MoE combine (unpermute)
// with its backward (`Backend::gather_rows`, `scatter_rows`, `moe_unpermute`,
// `moe_unpermute_backward`). Row moves copy the stored bits; the combine sums
// a token's k rows in slot order in f32.
#include "common.cuh"

__device__ __forceinline__ void copy_element(const void* src, u64 s, void* dst, u64 d, int dtype) {
    if (dtype == DTYPE_BF16) {
        static_cast<unsigned short*>(dst)[d] = static_cast<const unsigned short*>(src)[s];
    } else {
        static_cast<u32*>(dst)[d] = static_cast<const u32*>(src)[s];
    }
}

// dst[i] = src[index[i]], rows of `width`; `src_rows` rows in src.
extern "C" __global__ void gather_rows(
    const void* src, const u32* index, void* dst, int dtype, u64 count, u64 width, u64 src_rows, u64* status) {
    const u64 n = count * width;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        const u64 i = t / width;
        const u32 from = index[i];
        if (from >= src_rows) {
            report_fault(status, FAULT_ROW_INDEX, i);
            continue;
        }
        copy_element(src, static_cast<u64>(from) * width + t % width, dst, t, dtype);
    }
}

// dst[index[i]] = src[i]; `index` must be distinct (a permutation).
extern "C" __global__ void scatter_rows(
    const void* src, const u32* index, void* dst, int dtype, u64 count, u64 width, u64 dst_rows, u64* status) {
    const u64 n = count * width;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        const u64 i = t / width;
        const u32 to = index[i];
        if (to >= dst_rows) {
            report_fault(status, FAULT_ROW_INDEX, i);
            continue;
        }
        copy_element(src, t, dst, static_cast<u64>(to) * width + t % width, dtype);
    }
}

// out[t] = sum_{j<k} w[t, j] rows[positions[t*k + j]] (w = 1 without weights).
extern "C" __global__ void moe_unpermute(
    const void* rows, int rows_dtype, const float* weights, const u32* positions, void* out,
    int out_dtype, u64 tokens, u64 top_k, u64 n_rows, u64 width, u64* status) {
    const u64 n = tokens * width;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        const u64 token = t / width;
        const u64 c = t % width;
        float acc = 0.0f;
        for (u64 j = 0; j < top_k; ++j) {
            const u32 p = positions[token * top_k + j];
            if (p >= n_rows) {
                report_fault(status, FAULT_POSITION, token * top_k + j);
                continue;
            }
            const float w = weights != nullptr ? weights[token * top_k + j] : 1.0f;
            acc += w * load(rows, rows_dtype, static_cast<u64>(p) * width + c);
        }
        store(out, out_dtype, t, acc);
    }
}

// d_rows[positions[t*k + j]] = w[t, j] * dout[t]. The launcher zeroes d_rows
// first (rows no slot points at get no gradient); positions are distinct.
extern "C" __global__ void moe_unpermute_backward_rows(
    const void* dout, int dout_dtype, const float* weights, const u32* positions, void* d_rows,
    int d_rows_dtype, u64 tokens, u64 top_k, u64 n_rows, u64 width, u64* status) {
    const u64 n = tokens * top_k * width;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        const u64 slot = t / width;
        const u64 c = t % width;
        const u32 p = positions[slot];
        if (p >= n_rows) {
            report_fault(status, FAULT_POSITION, slot);
            continue;
        }
        const float g = load(dout, dout_dtype, (slot / top_k) * width + c);
        store(d_rows, d_rows_dtype, static_cast<u64>(p) * width + c, weights[slot] * g);
    }
}

// d_weights[t, j] = dout[t] . rows[positions[t*k + j]]: one warp per slot,
// lane-strided partial sums then the warp butterfly.
extern "C" __global__ void moe_unpermute_backward_weights(
    const void* dout, int dout_dtype, const void* rows, int rows_dtype, const u32* positions,
    float* d_weights, u64 tokens, u64 top_k, u64 n_rows, u64 width) {
    const int lane = threadIdx.x & 31;
    const u64 slot = static_cast<u64>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (slot >= tokens * top_k) {
        return;
    }
    const u32 p = positions[slot];
    if (p >= n_rows) {
        return;  // reported by the rows kernel
    }
    const u64 token = slot / top_k;
    float sum = 0.0f;
    for (u64 c = lane; c < width; c += 32) {
        sum += load(dout, dout_dtype, token * width + c) * load(rows, rows_dtype, static_cast<u64>(p) * width + c);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
        d_weights[slot] = sum;
    }
}

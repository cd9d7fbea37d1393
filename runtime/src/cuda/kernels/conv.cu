// Mamba's short convolution: causal depthwise conv1d along time that
// restarts at every sequence (`Backend::conv1d_forward`,
// `conv1d_backward_input`, `conv1d_backward_weight`). `x`, `y`, `dy`, `dx`
// are `[rows, channels]` with rows = batch * seq, `w` is `[channels, K]`.
// Tap j of output step t reads step t - (K-1) + j of the same sequence.
//
// The forward and the input gradient are one output element a thread,
// summing the taps in the CPU reference's order (so, without FMA
// contraction, to the same bits). The weight and bias gradients are sums
// over every row: a fixed tree per (channel, tap), never atomics.
#include "common.cuh"

// y[r, c] = bias[c] + sum_j w[c, j] x[r - (K-1) + j, c], taps before the
// sequence start skipped.
extern "C" __global__ void conv1d_forward(
    const void* x, int x_dtype, const void* w, int w_dtype, const void* bias, int bias_dtype,
    void* y, int y_dtype, u64 rows, u64 seq, u64 channels, u64 taps) {
    const u64 n = rows * channels;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u64 r = i / channels;
        const u64 c = i - r * channels;
        const u64 t = r % seq;
        float acc = load(bias, bias_dtype, c);
        // The first tap that reads inside the sequence.
        const u64 first = taps - 1 > t ? taps - 1 - t : 0;
        for (u64 j = first; j < taps; ++j) {
            const u64 src = r + j + 1 - taps;
            acc += load(w, w_dtype, c * taps + j) * load(x, x_dtype, src * channels + c);
        }
        store(y, y_dtype, i, acc);
    }
}

// dx[r, c] = sum_j w[c, j] dy[r + (K-1) - j, c], outputs past the sequence
// end skipped.
extern "C" __global__ void conv1d_backward_input(
    const void* dy, int dy_dtype, const void* w, int w_dtype, void* dx, int dx_dtype, u64 rows,
    u64 seq, u64 channels, u64 taps) {
    const u64 n = rows * channels;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u64 r = i / channels;
        const u64 c = i - r * channels;
        const u64 s = r % seq;
        float acc = 0.0f;
        for (u64 j = 0; j < taps; ++j) {
            const u64 ahead = taps - 1 - j;
            if (s + ahead >= seq) {
                continue;
            }
            acc += load(w, w_dtype, c * taps + j) * load(dy, dy_dtype, (r + ahead) * channels + c);
        }
        store(dx, dx_dtype, i, acc);
    }
}

// Adds a block's 32 row-slice sums `v` of channel c's tap j (j == taps:
// its bias) as a fixed tree and accumulates the total into `dw` (or
// `dbias`). Every thread of the (32, 32) block calls it.
__device__ __forceinline__ void add_slice_sums(
    float (*partial)[33], float v, u64 c, u64 j, u64 taps, u64 channels, void* dw, int dw_dtype,
    void* dbias, int dbias_dtype) {
    partial[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (threadIdx.y < s) {
            partial[threadIdx.y][threadIdx.x] += partial[threadIdx.y + s][threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.y == 0 && c < channels) {
        if (j == taps) {
            store(dbias, dbias_dtype, c, load(dbias, dbias_dtype, c) + partial[0][threadIdx.x]);
        } else {
            const u64 at = c * taps + j;
            store(dw, dw_dtype, at, load(dw, dw_dtype, at) + partial[0][threadIdx.x]);
        }
    }
    __syncthreads();
}

// dw[c, j] += sum_r dy[r, c] x[r - (K-1) + j, c] (blockIdx.y = j < K) and
// dbias[c] += sum_r dy[r, c] (blockIdx.y = K). Block (32, 32): threadIdx.x
// picks a channel of a 32-channel tile (coalesced rows), threadIdx.y a slice
// of rows r = y, y+32, ...; the 32 slice sums are then added as a fixed tree.
extern "C" __global__ void conv1d_backward_weight(
    const void* dy, int dy_dtype, const void* x, int x_dtype, void* dw, int dw_dtype, void* dbias,
    int dbias_dtype, u64 rows, u64 seq, u64 channels, u64 taps) {
    __shared__ float partial[32][33];
    const u64 c = static_cast<u64>(blockIdx.x) * 32 + threadIdx.x;
    const u64 j = blockIdx.y;
    const bool bias = j == taps;
    float sum = 0.0f;
    if (c < channels) {
        // Rows r with r - (K-1) + j before their sequence's start read nothing.
        const u64 lag = bias ? 0 : taps - 1 - j;
        for (u64 r = threadIdx.y; r < rows; r += 32) {
            const float g = load(dy, dy_dtype, r * channels + c);
            if (bias) {
                sum += g;
            } else if (r % seq >= lag) {
                sum += g * load(x, x_dtype, (r - lag) * channels + c);
            }
        }
    }
    add_slice_sums(partial, sum, c, j, taps, channels, dw, dw_dtype, dbias, dbias_dtype);
}

// The widest kernel `conv1d_backward_weight_window` takes
// (`cuda::launch::conv`'s `WINDOW_TAPS`).
#define WINDOW_TAPS 16

// `conv1d_backward_weight` for kernels of at most WINDOW_TAPS taps, every
// tap and the bias in one pass: block (32, 32), threadIdx.x a channel of a
// 32-channel tile, threadIdx.y a slice of consecutive rows, each row's dy
// and x read once, the last taps' x kept in registers. The 32 slice sums of
// each tap are then added as a fixed tree, tap by tap.
extern "C" __global__ void conv1d_backward_weight_window(
    const void* dy, int dy_dtype, const void* x, int x_dtype, void* dw, int dw_dtype, void* dbias,
    int dbias_dtype, u64 rows, u64 seq, u64 channels, u64 taps) {
    __shared__ float partial[32][33];
    const u64 c = static_cast<u64>(blockIdx.x) * 32 + threadIdx.x;
    const u64 slice = (rows + 31) / 32;
    const u64 r0 = threadIdx.y * slice;
    const u64 r1 = min(r0 + slice, rows);
    // sums[l] for lag l (tap K-1-l), sums[WINDOW_TAPS] for the bias;
    // window[l] = x[r - l].
    float sums[WINDOW_TAPS + 1];
    float window[WINDOW_TAPS];
#pragma unroll
    for (int l = 0; l <= WINDOW_TAPS; ++l) {
        sums[l] = 0.0f;
    }
    if (c < channels) {
        // One row behind: window[l] = x[r0 - 1 - l] (the lags the first
        // row needs once shifted), zero before row 0.
#pragma unroll
        for (int l = 0; l < WINDOW_TAPS; ++l) {
            const u64 back = static_cast<u64>(l) + 1;
            window[l] = back < taps && r0 >= back ? load(x, x_dtype, (r0 - back) * channels + c)
                                                  : 0.0f;
        }
        for (u64 r = r0; r < r1; ++r) {
#pragma unroll
            for (int l = WINDOW_TAPS - 1; l > 0; --l) {
                window[l] = window[l - 1];
            }
            window[0] = load(x, x_dtype, r * channels + c);
            const float g = load(dy, dy_dtype, r * channels + c);
            const u64 t = r % seq;
            sums[WINDOW_TAPS] += g;
            // Tap j reads x[r - (K-1) + j], lag l = K-1-j, inside the
            // sequence when t >= l.
#pragma unroll
            for (int l = 0; l < WINDOW_TAPS; ++l) {
                if (l < static_cast<int>(taps) && t >= static_cast<u64>(l)) {
                    sums[l] += g * window[l];
                }
            }
        }
    }
    // sums[l] is lag l's; tap j = taps - 1 - l. The bias is sums[WINDOW_TAPS].
    for (u64 j = 0; j <= taps; ++j) {
        float v = 0.0f;
#pragma unroll
        for (int l = 0; l <= WINDOW_TAPS; ++l) {
            const bool mine = j == taps ? l == WINDOW_TAPS : l == static_cast<int>(taps - 1 - j);
            v = mine ? sums[l] : v;
        }
        add_slice_sums(partial, v, c, j, taps, channels, dw, dw_dtype, dbias, dbias_dtype);
    }
}

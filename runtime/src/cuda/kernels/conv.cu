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
    grid_dependency_sync();
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
    grid_dependency_sync();
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

// ---- 8 channels a thread ---------------------------------------------------------
// `conv1d_forward_words` and `conv1d_backward_input_words`: x, y (dy, dx)
// bf16, 16-byte aligned, channels a multiple of 8 and kernels of at most
// WORD_TAPS taps (the launcher checks). A thread takes one 16-byte word (8
// channels) of CONV_WORD_ROWS consecutive rows, its taps' weights in
// registers and the rows its taps share in a sliding window, so each row
// is read once a thread instead of once a tap, and no element pays for
// 64-bit index divisions. Every output sums the same products in the same
// order as the element kernels above, so the bits are the same.
// The forward keeps CONV_AHEAD rows' loads in flight: with one, the few
// threads an SM has (a word of 32 rows each) leave most of the memory's
// latency uncovered (on an H100, 61.6 us a call with one, 54.4 with
// three). The input gradient's kernel keeps one: three cost it a block an
// SM in registers and 50.1 us a call against 45.4.
#define WORD_TAPS 4
#define CONV_WORD_ROWS 32
#define CONV_AHEAD 3

// The weights of the 8 channels from c0: wk[j][e] is channel c0 + e's tap j.
template <int TAPS>
__device__ __forceinline__ void word_weights(
    const void* w, int w_dtype, u64 c0, float (&wk)[TAPS][8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
#pragma unroll
        for (int j = 0; j < TAPS; ++j) {
            wk[j][e] = load(w, w_dtype, (c0 + e) * TAPS + j);
        }
    }
}

template <int TAPS>
__device__ __forceinline__ void conv1d_forward_rows(
    const uint4* x, const void* w, int w_dtype, const void* bias, int bias_dtype, uint4* y,
    u64 word, u64 words, u64 r0, u64 r1, u64 seq) {
    float wk[TAPS][8], b[8];
    word_weights<TAPS>(w, w_dtype, word * 8, wk);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        b[e] = load(bias, bias_dtype, word * 8 + e);
    }
    // win[j] holds x[r - (TAPS-1) + j]; rows before the sequence's start
    // are never read (their taps are skipped below).
    u64 t = r0 % seq;
    float win[TAPS][8] = {};
#pragma unroll
    for (int j = 0; j + 1 < TAPS; ++j) {
        const u64 back = TAPS - 1 - j;
        if (t >= back) {
            unpack8(x[(r0 - back) * words + word], win[j]);
        }
    }
    // The next CONV_AHEAD rows' words, loaded before they are summed.
    uint4 next[CONV_AHEAD];
#pragma unroll
    for (int a = 0; a < CONV_AHEAD; ++a) {
        if (r0 + a < r1) {
            next[a] = x[(r0 + a) * words + word];
        }
    }
    for (u64 r = r0; r < r1; ++r) {
        unpack8(next[0], win[TAPS - 1]);
#pragma unroll
        for (int a = 0; a + 1 < CONV_AHEAD; ++a) {
            next[a] = next[a + 1];
        }
        if (r + CONV_AHEAD < r1) {
            next[CONV_AHEAD - 1] = x[(r + CONV_AHEAD) * words + word];
        }
        float out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float acc = b[e];
#pragma unroll
            for (int j = 0; j < TAPS; ++j) {
                // Tap j reads inside the sequence when t - (TAPS-1) + j >= 0.
                if (t + j + 1 >= TAPS) {
                    acc += wk[j][e] * win[j][e];
                }
            }
            out[e] = acc;
        }
        y[r * words + word] = pack8(out);
#pragma unroll
        for (int j = 0; j + 1 < TAPS; ++j) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                win[j][e] = win[j + 1][e];
            }
        }
        t = t + 1 == seq ? 0 : t + 1;
    }
}

template <int TAPS>
__device__ __forceinline__ void conv1d_backward_input_rows(
    const uint4* dy, const void* w, int w_dtype, uint4* dx, u64 word, u64 words, u64 r0, u64 r1,
    u64 seq) {
    float wk[TAPS][8];
    word_weights<TAPS>(w, w_dtype, word * 8, wk);
    // Last row first; ahead[a] holds dy[r + a], rows past the sequence's
    // end never read (their taps are skipped below).
    u64 s = (r1 - 1) % seq;
    float ahead[TAPS][8] = {};
#pragma unroll
    for (int a = 1; a < TAPS; ++a) {
        if (s + a < seq) {
            unpack8(dy[(r1 - 1 + a) * words + word], ahead[a]);
        }
    }
    for (u64 r = r1; r-- > r0;) {
        unpack8(dy[r * words + word], ahead[0]);
        float out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < TAPS; ++j) {
                const int a = TAPS - 1 - j;
                if (s + a < seq) {
                    acc += wk[j][e] * ahead[a][e];
                }
            }
            out[e] = acc;
        }
        dx[r * words + word] = pack8(out);
#pragma unroll
        for (int a = TAPS - 1; a > 0; --a) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                ahead[a][e] = ahead[a - 1][e];
            }
        }
        s = s == 0 ? seq - 1 : s - 1;
    }
}

// Grid (words / blockDim.x rounded up, rows / CONV_WORD_ROWS rounded up):
// a thread's word of 8 channels and its rows [r0, r1) (false: past the
// channels or the rows).
__device__ __forceinline__ bool word_rows(
    u64 rows, u64 channels, u64& words, u64& word, u64& r0, u64& r1) {
    words = channels / 8;
    word = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
    r0 = static_cast<u64>(blockIdx.y) * CONV_WORD_ROWS;
    r1 = min(r0 + CONV_WORD_ROWS, rows);
    return word < words && r0 < rows;
}

extern "C" __global__ void conv1d_forward_words(
    const uint4* x, const void* w, int w_dtype, const void* bias, int bias_dtype, uint4* y,
    u64 rows, u64 seq, u64 channels, u64 taps) {
    grid_dependency_sync();
    u64 words, word, r0, r1;
    if (!word_rows(rows, channels, words, word, r0, r1)) {
        return;
    }
    switch (taps) {
        case 1: conv1d_forward_rows<1>(x, w, w_dtype, bias, bias_dtype, y, word, words, r0, r1, seq); break;
        case 2: conv1d_forward_rows<2>(x, w, w_dtype, bias, bias_dtype, y, word, words, r0, r1, seq); break;
        case 3: conv1d_forward_rows<3>(x, w, w_dtype, bias, bias_dtype, y, word, words, r0, r1, seq); break;
        default: conv1d_forward_rows<WORD_TAPS>(x, w, w_dtype, bias, bias_dtype, y, word, words, r0, r1, seq); break;
    }
}

extern "C" __global__ void conv1d_backward_input_words(
    const uint4* dy, const void* w, int w_dtype, uint4* dx, u64 rows, u64 seq, u64 channels,
    u64 taps) {
    grid_dependency_sync();
    u64 words, word, r0, r1;
    if (!word_rows(rows, channels, words, word, r0, r1)) {
        return;
    }
    switch (taps) {
        case 1: conv1d_backward_input_rows<1>(dy, w, w_dtype, dx, word, words, r0, r1, seq); break;
        case 2: conv1d_backward_input_rows<2>(dy, w, w_dtype, dx, word, words, r0, r1, seq); break;
        case 3: conv1d_backward_input_rows<3>(dy, w, w_dtype, dx, word, words, r0, r1, seq); break;
        default: conv1d_backward_input_rows<WORD_TAPS>(dy, w, w_dtype, dx, word, words, r0, r1, seq); break;
    }
}

// Adds a block's 32 row-slice sums `v` of channel c's tap j (j == taps:
// its bias) as a fixed tree and accumulates the total into `dw` (or
// `dbias`). Every thread of the (32, 32) block calls it.
__device__ __forceinline__ void add_slice_sums(
    float (*partial)[33], float v, u64 c, u64 j, u64 taps, u64 channels, void* dw, int dw_dtype,
    void* dbias, int dbias_dtype) {
    column_tree_sum(partial, v);
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
    grid_dependency_sync();
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
// each tap are then added as a fixed tree, tap by tap. `W` is the window
// the registers hold (at least the taps): the kernel takes the smallest
// that fits, since every lag of the window costs each row its test.
template <int W>
__device__ __forceinline__ void conv1d_backward_weight_slices(
    const void* dy, int dy_dtype, const void* x, int x_dtype, void* dw, int dw_dtype, void* dbias,
    int dbias_dtype, u64 rows, u64 seq, u64 channels, u64 taps, float (*partial)[33]) {
    const u64 c = static_cast<u64>(blockIdx.x) * 32 + threadIdx.x;
    const u64 slice = (rows + 31) / 32;
    const u64 r0 = threadIdx.y * slice;
    const u64 r1 = min(r0 + slice, rows);
    // sums[l] for lag l (tap K-1-l), sums[W] for the bias; window[l] =
    // x[r - l].
    float sums[W + 1];
    float window[W];
#pragma unroll
    for (int l = 0; l <= W; ++l) {
        sums[l] = 0.0f;
    }
    if (c < channels && r0 < r1) {
        // One row behind: window[l] = x[r0 - 1 - l] (the lags the first
        // row needs once shifted), zero before row 0.
#pragma unroll
        for (int l = 0; l < W; ++l) {
            const u64 back = static_cast<u64>(l) + 1;
            window[l] = back < taps && r0 >= back ? load(x, x_dtype, (r0 - back) * channels + c)
                                                  : 0.0f;
        }
        // The row's step in its sequence, advanced per row rather than
        // divided out (a 64-bit division per row was most of the cost).
        u64 t = r0 % seq;
        for (u64 r = r0; r < r1; ++r) {
#pragma unroll
            for (int l = W - 1; l > 0; --l) {
                window[l] = window[l - 1];
            }
            window[0] = load(x, x_dtype, r * channels + c);
            const float g = load(dy, dy_dtype, r * channels + c);
            sums[W] += g;
            // Tap j reads x[r - (K-1) + j], lag l = K-1-j, inside the
            // sequence when t >= l.
#pragma unroll
            for (int l = 0; l < W; ++l) {
                if (l < static_cast<int>(taps) && t >= static_cast<u64>(l)) {
                    sums[l] += g * window[l];
                }
            }
            t = t + 1 == seq ? 0 : t + 1;
        }
    }
    // sums[l] is lag l's; tap j = taps - 1 - l. The bias is sums[W].
    for (u64 j = 0; j <= taps; ++j) {
        float v = 0.0f;
#pragma unroll
        for (int l = 0; l <= W; ++l) {
            const bool mine = j == taps ? l == W : l == static_cast<int>(taps - 1 - j);
            v = mine ? sums[l] : v;
        }
        add_slice_sums(partial, v, c, j, taps, channels, dw, dw_dtype, dbias, dbias_dtype);
    }
}

extern "C" __global__ void conv1d_backward_weight_window(
    const void* dy, int dy_dtype, const void* x, int x_dtype, void* dw, int dw_dtype, void* dbias,
    int dbias_dtype, u64 rows, u64 seq, u64 channels, u64 taps) {
    grid_dependency_sync();
    __shared__ float partial[32][33];
    if (taps <= WORD_TAPS) {
        conv1d_backward_weight_slices<WORD_TAPS>(dy, dy_dtype, x, x_dtype, dw, dw_dtype, dbias,
                                                 dbias_dtype, rows, seq, channels, taps, partial);
    } else {
        conv1d_backward_weight_slices<WINDOW_TAPS>(dy, dy_dtype, x, x_dtype, dw, dw_dtype, dbias,
                                                   dbias_dtype, rows, seq, channels, taps,
                                                   partial);
    }
}

// Causal softmax attention with grouped KV heads (`Backend::attention_forward`
// and `attention_backward`), tiled the flash-attention way: a block keeps a
// tile of rows of one side (queries, or keys for dk/dv) and walks the tiles of
// the other, so scores and probabilities exist one 64-wide tile at a time, in
// registers and shared memory; no [seq, seq] matrix is ever in global memory,
// and the backward recomputes the probabilities from the saved lse.
//
// Layouts (the CPU's): q [rows, heads, qk_dim], k [rows, kv_heads, qk_dim],
// v [rows, kv_heads, v_dim], out and dout [rows, heads, v_dim], lse
// [rows, heads]; row = b * seq + t; query head j reads KV head
// j / (heads / kv_heads).
//
// A block is 256 threads seen as 16 x 16: ty = threadIdx.x / 16 owns R rows
// of the block's tile (ty*R .. ty*R + R-1), tx = threadIdx.x % 16 owns the
// columns tx, tx+16, tx+32, tx+48 of the other side's 64-wide tile, and the
// output channels tx + 16n (n < 16) of the block's group of 256 channels.
// blockIdx.y picks the channel group, so any head dim works (one group up to
// 256 channels; larger dims recompute the scores once per group).
//
// Determinism: every sum has one order, fixed by the dimensions: a score adds
// its head-dim products in channel order; a row's max and sum over a tile
// take a thread's four values in order, then a butterfly over the row's 16
// threads; an output channel adds tile after tile, row after row. dk and dv
// are summed by the one block that owns their key tile, over query tiles in
// order and the query heads of the group in order: no floats are added with
// atomics. Compiled without FMA contraction, like every source.
//
// The backward is two kernels that each recompute the probabilities:
// attention_backward_dq (a block per query tile) and attention_backward_dkdv
// (a block per key tile). D_t = dout_t . out_t is recomputed by the blocks
// that need it rather than stored, so the backward takes no scratch memory.
#include "common.cuh"

#define ATT_THREADS 256
// The other side's tile, and the query tile of forward and dq blocks (R = 4).
#define TILE 64
// The key tile of a dk/dv block (R = 2).
#define KEYS_DKDV 32
// Head channels of a score product staged at a time, and the padded pitch of
// a staged row (33: rows start in different banks).
#define CHUNK 32
#define CHUNK_PITCH 33
// Padded pitch of a [rows][64] tile of probabilities or score gradients.
#define W_PITCH 65
// Output channels of a block; one per thread when staging.
#define COLS 256
// Rows of the right-hand matrix of a product staged at a time.
#define STAGE 16
// The staging buffer: two score slices (64 + 64 rows) or STAGE rows of COLS.
#define STAGE_FLOATS ((2 * TILE) * CHUNK_PITCH)

static_assert(ATT_THREADS == 16 * 16, "the 16 x 16 thread grid");
static_assert(ATT_THREADS == COLS, "one staged channel per thread");
static_assert(STAGE * COLS <= STAGE_FLOATS, "staged rows fit the staging buffer");

// Rows of one head of a [rows, heads, dim] tensor from a first row on:
// element (i, d) is row first_row + i, channel d. Rows past the sequence read
// as 0.
struct HeadRows {
    const void* base;
    int dtype;
    u64 first;   // element offset of (first row, head, channel 0)
    u64 stride;  // elements between rows: heads * dim
    u32 rows;    // rows that exist from the first on

    __device__ __forceinline__ float at(u32 i, u32 d) const {
        return i < rows ? load(base, dtype, first + static_cast<u64>(i) * stride + d) : 0.0f;
    }
};

__device__ __forceinline__ HeadRows head_rows(
    const void* base, int dtype, u64 first_row, u32 heads, u32 head, u32 dim, u32 rows) {
    HeadRows h;
    h.base = base;
    h.dtype = dtype;
    h.first = (first_row * heads + head) * dim;
    h.stride = static_cast<u64>(heads) * dim;
    h.rows = rows;
    return h;
}

// The butterflies over the 16 threads of a row (lanes differing in bits 0-3):
// every thread of the row ends with the same bits.
__device__ __forceinline__ float row_max16(float v) {
    for (int m = 8; m > 0; m >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    }
    return v;
}

__device__ __forceinline__ float row_sum16(float v) {
    for (int m = 8; m > 0; m >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, m);
    }
    return v;
}

// s[i][c] = sum over d < dim of A(ty*R + i, d) * B(tx + 16c, d), for the 16R
// rows of A and the 64 rows of B; the head dim passes through shared memory
// CHUNK channels at a time. Starts and ends with the block in step.
template <int R>
__device__ __forceinline__ void score_tile(
    const HeadRows& a, const HeadRows& b, u32 dim, float* stage, float (&s)[R][4]) {
    float* as = stage;
    float* bs = stage + TILE * CHUNK_PITCH;
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            s[i][c] = 0.0f;
        }
    }
    for (u32 d0 = 0; d0 < dim; d0 += CHUNK) {
        const u32 width = min(static_cast<u32>(CHUNK), dim - d0);
        for (u32 e = threadIdx.x; e < 16 * R * CHUNK; e += ATT_THREADS) {
            const u32 i = e / CHUNK;
            const u32 d = e % CHUNK;
            if (d < width) {
                as[i * CHUNK_PITCH + d] = a.at(i, d0 + d);
            }
        }
        for (u32 e = threadIdx.x; e < TILE * CHUNK; e += ATT_THREADS) {
            const u32 i = e / CHUNK;
            const u32 d = e % CHUNK;
            if (d < width) {
                bs[i * CHUNK_PITCH + d] = b.at(i, d0 + d);
            }
        }
        __syncthreads();
        for (u32 d = 0; d < width; ++d) {
            float av[R];
            float bv[4];
#pragma unroll
            for (int i = 0; i < R; ++i) {
                av[i] = as[(ty * R + i) * CHUNK_PITCH + d];
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                bv[c] = bs[(tx + 16 * c) * CHUNK_PITCH + d];
            }
#pragma unroll
            for (int i = 0; i < R; ++i) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    s[i][c] += av[i] * bv[c];
                }
            }
        }
        __syncthreads();
    }
}

// acc[i][n] += sum over r < 64 of w[ty*R + i][r] * M(r, col0 + tx + 16n) for
// the block's ncols channels: M's rows pass through shared memory STAGE at a
// time, and every channel adds its terms in row order. `w` must be complete
// (the block in step) on entry; ends with the block in step.
template <int R>
__device__ __forceinline__ void accumulate_rows(
    const float* w, const HeadRows& m, u32 col0, u32 ncols, float* stage, float (&acc)[R][16]) {
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    for (u32 r0 = 0; r0 < TILE && r0 < m.rows; r0 += STAGE) {
        if (threadIdx.x < ncols) {
            for (u32 r = 0; r < STAGE; ++r) {
                stage[r * COLS + threadIdx.x] = m.at(r0 + r, col0 + threadIdx.x);
            }
        }
        __syncthreads();
        for (u32 r = 0; r < STAGE; ++r) {
            float wv[R];
#pragma unroll
            for (int i = 0; i < R; ++i) {
                wv[i] = w[(ty * R + i) * W_PITCH + r0 + r];
            }
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                if (tx + 16 * n < ncols) {
                    const float mv = stage[r * COLS + tx + 16 * n];
#pragma unroll
                    for (int i = 0; i < R; ++i) {
                        acc[i][n] += wv[i] * mv;
                    }
                }
            }
        }
        __syncthreads();
    }
}

// The channels [col0, col0 + ncols) of a dim that the block's group holds.
__device__ __forceinline__ u32 group_channels(u32 dim, u32 col0) {
    return dim > col0 ? min(dim - col0, static_cast<u32>(COLS)) : 0u;
}

// Blocks along x are (tile rank, pair) with the pair fastest, so every pair's
// tile of one rank is launched before any of the next rank; `heaviest_first`
// turns rank 0 into the last tile (the query tile that walks the most keys).
__device__ __forceinline__ void tile_and_pair(u32 tiles, u32 pairs, bool heaviest_first, u32& tile, u32& pair) {
    const u32 rank = blockIdx.x / pairs;
    pair = blockIdx.x % pairs;
    tile = heaviest_first ? tiles - 1 - rank : rank;
}

// o_t = sum_{u<=t} softmax_u(scale q_t . k_u) v_u and lse_t, by online
// softmax over key tiles. Grid: x = query tiles x (batch * heads), y =
// channel groups of v_dim (at least one: lse is written by group 0).
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_forward(
    const void* q, int q_dtype, const void* k, int k_dtype, const void* v, int v_dtype, void* out,
    int out_dtype, float* lse, u32 batch, u32 seq, u32 heads, u32 kv_heads, u32 qk_dim, u32 v_dim,
    float scale) {
    grid_dependency_sync();
    __shared__ float stage[STAGE_FLOATS];
    __shared__ float probs[TILE * W_PITCH];
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    u32 tile, pair;
    tile_and_pair((seq + TILE - 1) / TILE, batch * heads, true, tile, pair);
    const u32 b = pair / heads;
    const u32 j = pair % heads;
    const u32 g = j / (heads / kv_heads);
    const u32 col0 = blockIdx.y * COLS;
    const u32 ncols = group_channels(v_dim, col0);
    const u32 t0 = tile * TILE;
    const u64 row0 = static_cast<u64>(b) * seq;
    const HeadRows qs = head_rows(q, q_dtype, row0 + t0, heads, j, qk_dim, seq - t0);

    float m[4];
    float l[4];
    float acc[4][16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = neg_inf();
        l[i] = 0.0f;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            acc[i][n] = 0.0f;
        }
    }
    // Key tiles up to the diagonal one (u0 == t0).
    for (u32 u0 = 0; u0 <= t0; u0 += TILE) {
        const HeadRows ks = head_rows(k, k_dtype, row0 + u0, kv_heads, g, qk_dim, seq - u0);
        float s[4][4];
        score_tile<4>(qs, ks, qk_dim, stage, s);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 t = t0 + ty * 4 + i;
            float tile_max = neg_inf();
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const u32 u = u0 + tx + 16 * c;
                s[i][c] = (u <= t && t < seq) ? scale * s[i][c] : neg_inf();
                tile_max = fmaxf(tile_max, s[i][c]);
            }
            tile_max = row_max16(tile_max);
            const float m_new = fmaxf(m[i], tile_max);
            // A row past the sequence sees no key: it stays empty.
            const bool any = m_new != neg_inf();
            const float alpha = any ? expf(m[i] - m_new) : 1.0f;
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                s[i][c] = any ? expf(s[i][c] - m_new) : 0.0f;
                sum += s[i][c];
            }
            sum = row_sum16(sum);
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                acc[i][n] *= alpha;
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                probs[(ty * 4 + i) * W_PITCH + tx + 16 * c] = s[i][c];
            }
        }
        __syncthreads();
        const HeadRows vs = head_rows(v, v_dtype, row0 + u0, kv_heads, g, v_dim, seq - u0);
        accumulate_rows<4>(probs, vs, col0, ncols, stage, acc);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 t = t0 + ty * 4 + i;
        if (t >= seq) {
            continue;
        }
        const u64 row = row0 + t;
        const float inv = 1.0f / l[i];
        const u64 base = (row * heads + j) * v_dim + col0;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            if (tx + 16 * n < ncols) {
                store(out, out_dtype, base + tx + 16 * n, acc[i][n] * inv);
            }
        }
        if (blockIdx.y == 0 && tx == 0) {
            lse[row * heads + j] = m[i] + logf(l[i]);
        }
    }
}

// lse_t and D_t = dout_t . out_t of the 64 query rows from t0 for head j, a
// warp per row (lane-strided products, then the warp butterfly); 0 past the
// sequence.
__device__ __forceinline__ void query_row_stats(
    const float* lse, const void* out, int out_dtype, const void* dout, int dout_dtype, u64 row0,
    u32 t0, u32 seq, u32 heads, u32 j, u32 v_dim, float* row_lse, float* row_delta) {
    const u32 lane = threadIdx.x & 31;
    for (u32 r = threadIdx.x >> 5; r < TILE; r += ATT_THREADS / 32) {
        const u32 t = t0 + r;
        float delta = 0.0f;
        float l = 0.0f;
        if (t < seq) {
            const u64 row = row0 + t;
            const u64 base = (row * heads + j) * v_dim;
            for (u32 c = lane; c < v_dim; c += 32) {
                delta += load(dout, dout_dtype, base + c) * load(out, out_dtype, base + c);
            }
            l = lse[row * heads + j];
        }
        delta = warp_sum(delta);
        if (lane == 0) {
            row_lse[r] = l;
            row_delta[r] = delta;
        }
    }
}

// dq_t = scale sum_{u<=t} p_tu (dout_t . v_u - D_t) k_u, a block per query
// tile walking the key tiles up to the diagonal. Grid: x = query tiles x
// (batch * heads), y = channel groups of qk_dim.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_backward_dq(
    const void* q, int q_dtype, const void* k, int k_dtype, const void* v, int v_dtype,
    const void* out, int out_dtype, const float* lse, const void* dout, int dout_dtype, void* dq,
    int dq_dtype, u32 batch, u32 seq, u32 heads, u32 kv_heads, u32 qk_dim, u32 v_dim,
    float scale) {
    grid_dependency_sync();
    __shared__ float stage[STAGE_FLOATS];
    __shared__ float dscores[TILE * W_PITCH];
    __shared__ float row_lse[TILE];
    __shared__ float row_delta[TILE];
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    u32 tile, pair;
    tile_and_pair((seq + TILE - 1) / TILE, batch * heads, true, tile, pair);
    const u32 b = pair / heads;
    const u32 j = pair % heads;
    const u32 g = j / (heads / kv_heads);
    const u32 col0 = blockIdx.y * COLS;
    const u32 ncols = group_channels(qk_dim, col0);
    const u32 t0 = tile * TILE;
    const u64 row0 = static_cast<u64>(b) * seq;
    query_row_stats(lse, out, out_dtype, dout, dout_dtype, row0, t0, seq, heads, j, v_dim, row_lse,
                    row_delta);
    __syncthreads();
    const HeadRows qs = head_rows(q, q_dtype, row0 + t0, heads, j, qk_dim, seq - t0);
    const HeadRows gs = head_rows(dout, dout_dtype, row0 + t0, heads, j, v_dim, seq - t0);

    float acc[4][16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            acc[i][n] = 0.0f;
        }
    }
    for (u32 u0 = 0; u0 <= t0; u0 += TILE) {
        const HeadRows ks = head_rows(k, k_dtype, row0 + u0, kv_heads, g, qk_dim, seq - u0);
        const HeadRows vs = head_rows(v, v_dtype, row0 + u0, kv_heads, g, v_dim, seq - u0);
        float s[4][4];
        float dp[4][4];
        score_tile<4>(qs, ks, qk_dim, stage, s);
        score_tile<4>(gs, vs, v_dim, stage, dp);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 r = ty * 4 + i;
            const u32 t = t0 + r;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const u32 u = u0 + tx + 16 * c;
                float ds = 0.0f;
                if (u <= t && t < seq) {
                    const float p = expf(scale * s[i][c] - row_lse[r]);
                    ds = p * (dp[i][c] - row_delta[r]) * scale;
                }
                dscores[r * W_PITCH + tx + 16 * c] = ds;
            }
        }
        __syncthreads();
        accumulate_rows<4>(dscores, ks, col0, ncols, stage, acc);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 t = t0 + ty * 4 + i;
        if (t >= seq) {
            continue;
        }
        const u64 base = ((row0 + t) * heads + j) * qk_dim + col0;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            if (tx + 16 * n < ncols) {
                store(dq, dq_dtype, base + tx + 16 * n, acc[i][n]);
            }
        }
    }
}

// dk_u = scale sum_j sum_{t>=u} ds_tu q_t and dv_u = sum_j sum_{t>=u} p_tu
// dout_t over the query heads j of KV head g: a block per 32-key tile walks
// the query tiles from the diagonal on, and within each the group's heads in
// order. Grid: x = key tiles x (batch * kv_heads), y = channel groups of
// max(qk_dim, v_dim).
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_backward_dkdv(
    const void* q, int q_dtype, const void* k, int k_dtype, const void* v, int v_dtype,
    const void* out, int out_dtype, const float* lse, const void* dout, int dout_dtype, void* dk,
    int dk_dtype, void* dv, int dv_dtype, u32 batch, u32 seq, u32 heads, u32 kv_heads,
    u32 qk_dim, u32 v_dim, float scale) {
    grid_dependency_sync();
    __shared__ float stage[STAGE_FLOATS];
    __shared__ float probs[KEYS_DKDV * W_PITCH];
    __shared__ float dscores[KEYS_DKDV * W_PITCH];
    __shared__ float row_lse[TILE];
    __shared__ float row_delta[TILE];
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    // The first key tiles see the most queries: rank 0 is tile 0.
    u32 tile, pair;
    tile_and_pair((seq + KEYS_DKDV - 1) / KEYS_DKDV, batch * kv_heads, false, tile, pair);
    const u32 b = pair / kv_heads;
    const u32 g = pair % kv_heads;
    const u32 group = heads / kv_heads;
    const u32 col0 = blockIdx.y * COLS;
    const u32 k_cols = group_channels(qk_dim, col0);
    const u32 v_cols = group_channels(v_dim, col0);
    const u32 u0 = tile * KEYS_DKDV;
    const u64 row0 = static_cast<u64>(b) * seq;
    const HeadRows ks = head_rows(k, k_dtype, row0 + u0, kv_heads, g, qk_dim, seq - u0);
    const HeadRows vs = head_rows(v, v_dtype, row0 + u0, kv_heads, g, v_dim, seq - u0);

    float acc_k[2][16];
    float acc_v[2][16];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            acc_k[i][n] = 0.0f;
            acc_v[i][n] = 0.0f;
        }
    }
    for (u32 t0 = u0 / TILE * TILE; t0 < seq; t0 += TILE) {
        for (u32 j = g * group; j < (g + 1) * group; ++j) {
            query_row_stats(lse, out, out_dtype, dout, dout_dtype, row0, t0, seq, heads, j, v_dim,
                            row_lse, row_delta);
            __syncthreads();
            const HeadRows qs = head_rows(q, q_dtype, row0 + t0, heads, j, qk_dim, seq - t0);
            const HeadRows gs = head_rows(dout, dout_dtype, row0 + t0, heads, j, v_dim, seq - t0);
            float s[2][4];
            float dp[2][4];
            score_tile<2>(ks, qs, qk_dim, stage, s);
            score_tile<2>(vs, gs, v_dim, stage, dp);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 r = ty * 2 + i;
                const u32 u = u0 + r;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const u32 tc = tx + 16 * c;
                    const u32 t = t0 + tc;
                    float p = 0.0f;
                    float ds = 0.0f;
                    if (u <= t && t < seq) {
                        p = expf(scale * s[i][c] - row_lse[tc]);
                        ds = p * (dp[i][c] - row_delta[tc]) * scale;
                    }
                    probs[r * W_PITCH + tc] = p;
                    dscores[r * W_PITCH + tc] = ds;
                }
            }
            __syncthreads();
            accumulate_rows<2>(probs, gs, col0, v_cols, stage, acc_v);
            accumulate_rows<2>(dscores, qs, col0, k_cols, stage, acc_k);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 u = u0 + ty * 2 + i;
        if (u >= seq) {
            continue;
        }
        const u64 row = (row0 + u) * kv_heads + g;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            const u32 c = tx + 16 * n;
            if (c < k_cols) {
                store(dk, dk_dtype, row * qk_dim + col0 + c, acc_k[i][n]);
            }
            if (c < v_cols) {
                store(dv, dv_dtype, row * v_dim + col0 + c, acc_v[i][n]);
            }
        }
    }
}

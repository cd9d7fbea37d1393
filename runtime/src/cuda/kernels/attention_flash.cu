// Causal attention with grouped KV heads on tensor cores, the flash-attention
// way (FA2): `Backend::attention_forward` and `attention_backward` when every
// operand is bf16 and the q/k and v head dims are one D of 64 or 128 (other
// problems take `attention.cu` or the GEMM path). Layouts as `attention.cu`:
// q [rows, heads, D], k and v [rows, kv_heads, D], out and dout
// [rows, heads, D], lse [rows, heads] (f32, natural log); row = b * seq + t;
// query head h reads KV head h / (heads / kv_heads).
//
// Products are `mma.sync.m16n8k16` (bf16 in, f32 accumulate) on fragments
// read from shared memory with `ldmatrix`; a block is 4 warps and each warp
// owns 32 rows of the block's 128-row query tile (16 of a 64-row key tile
// in the dk/dv kernel). Scores, probabilities and their
// gradients live in registers only: the accumulator layout of a 16 x 16
// product tile is the operand layout of the next product, so P (and dS)
// feed the next `mma` after a round to bf16, as in FlashAttention-2. Softmax
// runs in base 2 with the scale folded into log2(e).
//
// Tiles of the side a block walks are double-buffered: `cp.async` fetches
// tile i + 1 while the warps compute on tile i (rows past the sequence are
// filled with zeros). Rows of a staged tile are D + 8 elements apart, so
// the eight 16-byte rows an `ldmatrix` reads fall in different banks.
//
// Determinism: every sum has one order, fixed by the dimensions: a product
// accumulates its k-blocks in order, a row's max and sum take a thread's
// values in order and then a butterfly over the row's 4 threads; dk and dv
// are summed by the one block that owns their key tile, over the group's
// query heads in order and their query tiles in order. No atomics.
//
// The backward is two kernels, three with grouped KV heads.
// flash_backward_dq (a block per query tile) first computes
// D_t = dout_t . out_t for its rows and writes it to `delta` ([rows, heads]
// f32); flash_backward_dkdv (a block per key tile of a query head) runs
// after it on the same stream and reads it. A block per query head, not
// per KV head, keeps the causal work of the first key tiles (all queries
// of a whole group) from holding up the grid: with grouped heads each
// block writes its head's share of dk and dv in f32 to `dk_part` and
// `dv_part` ([rows, heads, D]), and flash_group_sum adds a group's shares
// in head order.
#include "common.cuh"
#include "wgmma.cuh"

#define FLASH_THREADS 128
// Rows of the forward's and dq's query tile: 32 a warp, two 16-row
// fragment tiles that share every fragment of the other side read from
// shared memory (16 a warp left the kernels bound by `ldmatrix`).
#define QUERY_ROWS 128
// The key tile the forward walks.
#define FWD_KEYS 32
// The key tile dq walks (smaller: dq holds two score tiles, S and dP).
#define DQ_KEYS 32
// Rows of the dk/dv key tile, 16 a warp (it holds two D-wide
// accumulators), and the query tile it walks.
#define DKDV_KEYS 64
#define DKDV_QUERIES 32

// One f32 from global to shared memory, asynchronously; zero when !valid.
__device__ __forceinline__ void copy4_async(u32 dst, const float* src, bool valid) {
    const int bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// Stages `ROWS` rows of one head (D channels each, `stride` elements apart
// from `first`) into `tile` with a pitch of D + 8; rows from `valid` on are
// zeros.
template <int D, int ROWS>
__device__ __forceinline__ void stage_rows(bf16* tile, const bf16* first, u64 stride, u32 valid) {
    constexpr int CHUNKS = D / 8;
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += FLASH_THREADS) {
        const u32 r = c / CHUNKS;
        const u32 col = (c % CHUNKS) * 8;
        const bool ok = r < valid;
        copy16_async(shared_address(tile + r * (D + 8) + col), ok ? first + r * stride + col : first, ok);
    }
}

// `ROWS` values of one head's column of a [rows, heads] f32 tensor.
template <int ROWS>
__device__ __forceinline__ void stage_column(float* dst, const float* first, u32 heads, u32 valid) {
    for (int r = threadIdx.x; r < ROWS; r += FLASH_THREADS) {
        const bool ok = static_cast<u32>(r) < valid;
        copy4_async(shared_address(dst + r), ok ? first + static_cast<u64>(r) * heads : first, ok);
    }
}

// Stages key tile `j` (KEYS rows from j * KEYS of KV head g of sequence
// row0) of k and v into buffer `buf` of `ks` and `vs`.
template <int D, int KEYS>
__device__ __forceinline__ void stage_keys(bf16* ks, bf16* vs, u32 buf, const bf16* k, const bf16* v, u64 row0,
                                           u32 j, u32 seq, u32 kv_heads, u32 g) {
    constexpr u32 ELEMS = KEYS * (D + 8);
    const u32 u = j * KEYS;
    const u64 first = ((row0 + u) * kv_heads + g) * D;
    const u64 stride = static_cast<u64>(kv_heads) * D;
    stage_rows<D, KEYS>(ks + buf * ELEMS, k + first, stride, seq - u);
    stage_rows<D, KEYS>(vs + buf * ELEMS, v + first, stride, seq - u);
}

// The A fragment of the 16 x 16 block of a staged tile at (row0, col0).
template <int D>
__device__ __forceinline__ void load_a(u32 (&a)[4], const bf16* tile, u32 row0, u32 col0) {
    const u32 lane = threadIdx.x & 31;
    ldmatrix_x4(a, shared_address(tile + (row0 + (lane & 15)) * (D + 8) + col0 + (lane >> 4) * 8));
}

// B fragments of two 8-column blocks from a staged tile read as its
// transpose: B(k, n) = tile[n0 + n][k0 + k] for n < 16, k < 16; b[0], b[1]
// are columns n0..n0+7 and b[2], b[3] columns n0+8..n0+15.
template <int D>
__device__ __forceinline__ void load_b_rows(u32 (&b)[4], const bf16* tile, u32 n0, u32 k0) {
    const u32 lane = threadIdx.x & 31;
    const u32 row = n0 + (lane & 7) + (lane >> 4) * 8;
    const u32 col = k0 + ((lane >> 3) & 1) * 8;
    ldmatrix_x4(b, shared_address(tile + row * (D + 8) + col));
}

// B fragments of two 8-column blocks from a staged tile read as it is:
// B(k, n) = tile[k0 + k][n0 + n]; same fragment order as load_b_rows.
template <int D>
__device__ __forceinline__ void load_b_cols(u32 (&b)[4], const bf16* tile, u32 k0, u32 n0) {
    const u32 lane = threadIdx.x & 31;
    const u32 row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const u32 col = n0 + (lane >> 4) * 8;
    ldmatrix_x4_trans(b, shared_address(tile + row * (D + 8) + col));
}

// s[m][n] (m < M, n < N; 16 rows and 8 columns each) = A B^T for the
// warp's M * 16 rows of `a` (from row a0) and N * 8 rows of `b`, over D
// channels. Each B fragment read from shared memory feeds M products.
template <int D, int M, int N>
__device__ __forceinline__ void product_rows(float (&s)[M][N][4], const bf16* a, u32 a0, const bf16* b) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
        }
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 fa[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            load_a<D>(fa[m], a, a0 + m * 16, kk * 16);
        }
#pragma unroll
        for (int np = 0; np < N / 2; ++np) {
            u32 fb[4];
            load_b_rows<D>(fb, b, np * 16, kk * 16);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                mma_bf16(s[m][2 * np], fa[m], fb[0], fb[1]);
                mma_bf16(s[m][2 * np + 1], fa[m], fb[2], fb[3]);
            }
        }
    }
}

// acc[m][n] (D / 8 blocks of 8 columns) += W V, W the warp's
// (M * 16) x (N * 8) register tile `w` (rounded to bf16) and V the first
// N * 8 rows of `v`.
template <int D, int M, int N>
__device__ __forceinline__ void accumulate(float (&acc)[M][D / 8][4], const float (&w)[M][N][4], const bf16* v) {
#pragma unroll
    for (int kk = 0; kk < N / 2; ++kk) {
        u32 fa[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc_as_a(fa[m], w[m][2 * kk], w[m][2 * kk + 1]);
        }
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
            u32 fb[4];
            load_b_cols<D>(fb, v, kk * 16, np * 16);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                mma_bf16(acc[m][2 * np], fa[m], fb[0], fb[1]);
                mma_bf16(acc[m][2 * np + 1], fa[m], fb[2], fb[3]);
            }
        }
    }
}

// Writes the warp's (M * 16) x D f32 tile `acc` times `factor` (as bf16 or
// f32, T) in rows `stride` elements apart from `first`: this thread's rows
// are r0 + 16m and r0 + 16m + 8, skipped past `seq`.
template <int D, int M, typename T>
__device__ __forceinline__ void store_rows(T* first, u64 stride, const float (&acc)[M][D / 8][4], u32 r0, u32 seq,
                                           float factor) {
    const u32 t = threadIdx.x & 3;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 r = r0 + m * 16 + half * 8;
            if (r >= seq) {
                continue;
            }
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                store_pair(first + r * stride + n * 8 + 2 * t, acc[m][n][2 * half] * factor,
                           acc[m][n][2 * half + 1] * factor);
            }
        }
    }
}

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// 2^x on the special-function unit, results below 2^-126 flushed to zero
// (exp2(-inf) is 0). exp2f keeps those subnormal results with a compare and
// two multiplies around the same instruction, three more instructions an
// element in loops that are bound by issuing them; a probability below
// 2^-126 adds nothing a bf16 sum can hold.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Block (tile, pair) of a grid of `tiles` tiles for each of `pairs` pairs,
// blockIdx.x = rank * pairs + pair; heaviest tiles run first.
__device__ __forceinline__ void flash_block(u32 tiles, u32 pairs, bool last_first, u32& tile, u32& pair) {
    const u32 rank = blockIdx.x / pairs;
    pair = blockIdx.x % pairs;
    tile = last_first ? tiles - 1 - rank : rank;
}

// Where a query-tile block (the forward's, dq's) and its thread work: head
// h, its KV head g, the tile's first row t0, the warp's index, the lane, the
// warp's first row w0, this thread's rows r0 + 16m and r0 + 16m + 8, the batch's first row
// row0 and the query rows' stride. The tiles with the most keys run first.
struct QueryTile {
    u32 h, g, t0, warp, lane, w0, r0;
    u64 row0, q_stride;
};

template <int D>
__device__ __forceinline__ QueryTile query_tile(u32 batch, u32 seq, u32 heads, u32 kv_heads) {
    u32 tile, pair;
    flash_block((seq + QUERY_ROWS - 1) / QUERY_ROWS, batch * heads, true, tile, pair);
    QueryTile at;
    at.h = pair % heads;
    at.g = at.h / (heads / kv_heads);
    at.t0 = tile * QUERY_ROWS;
    at.warp = threadIdx.x >> 5;
    at.lane = threadIdx.x & 31;
    at.w0 = at.t0 + at.warp * 32;
    at.r0 = at.w0 + (at.lane >> 2);
    at.row0 = static_cast<u64>(pair / heads) * seq;
    at.q_stride = static_cast<u64>(heads) * D;
    return at;
}

// o_t = sum_{u<=t} softmax_u(scale q_t . k_u) v_u and lse_t. Grid: query
// tiles x (batch * heads), the last tiles (the most keys) first.
template <int D>
__device__ __forceinline__ void flash_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse,
                                              u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {
    extern __shared__ __align__(16) unsigned char shared[];
    constexpr u32 KEY_ELEMS = FWD_KEYS * (D + 8);
    bf16* qs = reinterpret_cast<bf16*>(shared);
    bf16* ks = qs + QUERY_ROWS * (D + 8);  // two buffers
    bf16* vs = ks + 2 * KEY_ELEMS;  // two buffers
    const auto [h, g, t0, warp, lane, w0, r0, row0, q_stride] = query_tile<D>(batch, seq, heads, kv_heads);
    const float c = scale * LOG2E;
    // Key tiles up to the block's last row.
    const u32 key_tiles = (min(t0 + QUERY_ROWS, seq) + FWD_KEYS - 1) / FWD_KEYS;

    stage_rows<D, QUERY_ROWS>(qs, q + ((row0 + t0) * heads + h) * D, q_stride, seq - t0);
    stage_keys<D, FWD_KEYS>(ks, vs, 0, k, v, row0, 0, seq, kv_heads, g);
    commit_async();

    float acc[2][D / 8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
        }
    }
    // Row maxima and partial sums of this thread's rows r0 + 8i.
    float mx[4] = {neg_inf(), neg_inf(), neg_inf(), neg_inf()};
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 j = 0; j < key_tiles; ++j) {
        const u32 u0 = j * FWD_KEYS;
        const u32 buf = j & 1;
        if (j + 1 < key_tiles) {
            stage_keys<D, FWD_KEYS>(ks, vs, buf ^ 1, k, v, row0, j + 1, seq, kv_heads, g);
        }
        commit_async();
        wait_async<1>();
        __syncthreads();
        // A warp whose rows all precede the tile has nothing to add.
        if (u0 < w0 + 32) {
            float s[2][FWD_KEYS / 8][4];
            product_rows<D, 2, FWD_KEYS / 8>(s, qs, warp * 32, ks + buf * KEY_ELEMS);
            // Only tiles on the diagonal or past the sequence hold masked keys.
            const bool masked = u0 + FWD_KEYS > w0 || u0 + FWD_KEYS > seq;
            float x[4] = {neg_inf(), neg_inf(), neg_inf(), neg_inf()};
#pragma unroll
            for (int m = 0; m < 2; ++m) {
#pragma unroll
                for (int n = 0; n < FWD_KEYS / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 key = u0 + n * 8 + 2 * (lane & 3) + (e & 1);
                        const u32 row = r0 + m * 16 + (e >> 1) * 8;
                        s[m][n][e] = (!masked || (key <= row && key < seq)) ? s[m][n][e] * c : neg_inf();
                        x[2 * m + (e >> 1)] = fmaxf(x[2 * m + (e >> 1)], s[m][n][e]);
                    }
                }
            }
            float alpha[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // Key 0 is in every row's first tile, so the max is finite
                // from then on.
                const float next = fmaxf(mx[i], quad_max(x[i]));
                alpha[i] = exp2_ftz(mx[i] - next);
                mx[i] = next;
                sum[i] *= alpha[i];
            }
#pragma unroll
            for (int m = 0; m < 2; ++m) {
#pragma unroll
                for (int n = 0; n < FWD_KEYS / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = 2 * m + (e >> 1);
                        s[m][n][e] = exp2_ftz(s[m][n][e] - mx[i]);
                        sum[i] += s[m][n][e];
                    }
                }
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    acc[m][n][0] *= alpha[2 * m];
                    acc[m][n][1] *= alpha[2 * m];
                    acc[m][n][2] *= alpha[2 * m + 1];
                    acc[m][n][3] *= alpha[2 * m + 1];
                }
            }
            accumulate<D, 2, FWD_KEYS / 8>(acc, s, vs + buf * KEY_ELEMS);
        }
        // Every warp is done with this buffer before the next fetch into it.
        __syncthreads();
    }
    const u32 t = lane & 3;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = 2 * m + half;
            const float l = quad_sum(sum[i]);
            const u32 r = r0 + m * 16 + half * 8;
            if (r >= seq) {
                continue;
            }
            const float inv = 1.0f / l;
            bf16* dst = out + ((row0 + r) * heads + h) * D;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                *reinterpret_cast<u32*>(dst + n * 8 + 2 * t) =
                    pack_bf16(acc[m][n][2 * half] * inv, acc[m][n][2 * half + 1] * inv);
            }
            if (t == 0) {
                lse[(row0 + r) * heads + h] = (mx[i] + log2f(l)) * LN2;
            }
        }
    }
}

// D_t = dout_t . out_t of the block's ROWS query rows (THREADS threads; a warp per
// row, lanes strided over the channels, then the warp butterfly) into
// `delta_tile` and, for rows in the sequence, `delta`.
template <int D, int THREADS, int ROWS>
__device__ __forceinline__ void row_deltas(const bf16* out, const bf16* dout, float* delta, float* delta_tile,
                                           u64 row0, u32 t0, u32 seq, u32 heads, u32 h) {
    const u32 lane = threadIdx.x & 31;
    for (u32 r = threadIdx.x >> 5; r < ROWS; r += THREADS / 32) {
        const u32 t = t0 + r;
        float d = 0.0f;
        if (t < seq) {
            const u64 base = ((row0 + t) * heads + h) * D;
            for (u32 c = lane; c < D; c += 32) {
                d += __bfloat162float(dout[base + c]) * __bfloat162float(out[base + c]);
            }
        }
        d = warp_sum(d);
        if (lane == 0) {
            delta_tile[r] = d;
            if (t < seq) {
                delta[(row0 + t) * heads + h] = d;
            }
        }
    }
}

// dq_t = scale sum_{u<=t} p_tu (dout_t . v_u - D_t) k_u, and D_t into
// `delta`. Grid: query tiles x (batch * heads), the last tiles first.
template <int D>
__device__ __forceinline__ void flash_backward_dq(const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                                                  const float* lse, const bf16* dout, bf16* dq, float* delta,
                                                  u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {
    extern __shared__ __align__(16) unsigned char shared[];
    __shared__ float delta_tile[QUERY_ROWS];
    constexpr u32 QUERY_ELEMS = QUERY_ROWS * (D + 8);
    constexpr u32 KEY_ELEMS = DQ_KEYS * (D + 8);
    bf16* qs = reinterpret_cast<bf16*>(shared);
    bf16* dos = qs + QUERY_ELEMS;
    bf16* ks = dos + QUERY_ELEMS;  // two buffers
    bf16* vs = ks + 2 * KEY_ELEMS;  // two buffers
    const auto [h, g, t0, warp, lane, w0, r0, row0, q_stride] = query_tile<D>(batch, seq, heads, kv_heads);
    const float c = scale * LOG2E;
    const u32 key_tiles = (min(t0 + QUERY_ROWS, seq) + DQ_KEYS - 1) / DQ_KEYS;

    stage_rows<D, QUERY_ROWS>(qs, q + ((row0 + t0) * heads + h) * D, q_stride, seq - t0);
    stage_rows<D, QUERY_ROWS>(dos, dout + ((row0 + t0) * heads + h) * D, q_stride, seq - t0);
    stage_keys<D, DQ_KEYS>(ks, vs, 0, k, v, row0, 0, seq, kv_heads, g);
    commit_async();
    row_deltas<D, FLASH_THREADS, QUERY_ROWS>(out, dout, delta, delta_tile, row0, t0, seq, heads, h);
    __syncthreads();
    // This thread's rows r0 + 8i: D_t, and lse in base 2 (rows past the
    // sequence have zero q and dout; their lse is taken as 0).
    float dr[4], er[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 r = r0 + 8 * i;
        dr[i] = delta_tile[r - t0];
        er[i] = r < seq ? lse[(row0 + r) * heads + h] * LOG2E : 0.0f;
    }

    float acc[2][D / 8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
        }
    }
    for (u32 j = 0; j < key_tiles; ++j) {
        const u32 u0 = j * DQ_KEYS;
        const u32 buf = j & 1;
        if (j + 1 < key_tiles) {
            stage_keys<D, DQ_KEYS>(ks, vs, buf ^ 1, k, v, row0, j + 1, seq, kv_heads, g);
        }
        commit_async();
        wait_async<1>();
        __syncthreads();
        if (u0 < w0 + 32) {
            const bf16* kt = ks + buf * KEY_ELEMS;
            float s[2][DQ_KEYS / 8][4];
            product_rows<D, 2, DQ_KEYS / 8>(s, qs, warp * 32, kt);
            float dp[2][DQ_KEYS / 8][4];
            product_rows<D, 2, DQ_KEYS / 8>(dp, dos, warp * 32, vs + buf * KEY_ELEMS);
            const bool masked = u0 + DQ_KEYS > w0 || u0 + DQ_KEYS > seq;
#pragma unroll
            for (int m = 0; m < 2; ++m) {
#pragma unroll
                for (int n = 0; n < DQ_KEYS / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = 2 * m + (e >> 1);
                        const u32 key = u0 + n * 8 + 2 * (lane & 3) + (e & 1);
                        const u32 row = r0 + 8 * i;
                        const bool live = !masked || (key <= row && key < seq);
                        const float p = live ? exp2_ftz(s[m][n][e] * c - er[i]) : 0.0f;
                        s[m][n][e] = p * (dp[m][n][e] - dr[i]);
                    }
                }
            }
            accumulate<D, 2, DQ_KEYS / 8>(acc, s, kt);
        }
        __syncthreads();
    }
    store_rows<D, 2>(dq + (row0 * heads + h) * D, q_stride, acc, r0, seq, scale);
}

// dk_u = scale sum_{t>=u} ds_tu q_t and dv_u = sum_{t>=u} p_tu dout_t for
// one query head: into dk and dv (bf16, [rows, kv_heads, D]) when each KV
// head serves one query head, else into dk_part and dv_part (f32,
// [rows, heads, D]). Grid: key tiles x (batch * heads), the first tiles
// (the most queries) first.
template <int D>
__device__ __forceinline__ void flash_backward_dkdv(const bf16* q, const bf16* k, const bf16* v,
                                                    const float* lse, const bf16* dout, const float* delta,
                                                    bf16* dk, bf16* dv, float* dk_part, float* dv_part,
                                                    u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {
    extern __shared__ __align__(16) unsigned char shared[];
    constexpr u32 KEY_ELEMS = DKDV_KEYS * (D + 8);
    constexpr u32 QUERY_ELEMS = DKDV_QUERIES * (D + 8);
    bf16* ks = reinterpret_cast<bf16*>(shared);
    bf16* vs = ks + KEY_ELEMS;
    bf16* qs = vs + KEY_ELEMS;  // two buffers
    bf16* dos = qs + 2 * QUERY_ELEMS;  // two buffers
    float* lses = reinterpret_cast<float*>(dos + 2 * QUERY_ELEMS);  // two buffers
    float* deltas = lses + 2 * DKDV_QUERIES;  // two buffers
    u32 tile, pair;
    flash_block((seq + DKDV_KEYS - 1) / DKDV_KEYS, batch * heads, false, tile, pair);
    const u32 b = pair / heads;
    const u32 h = pair % heads;
    const u32 group = heads / kv_heads;
    const u32 g = h / group;
    const u32 k0 = tile * DKDV_KEYS;
    const u64 row0 = static_cast<u64>(b) * seq;
    const u64 q_stride = static_cast<u64>(heads) * D;
    const u64 kv_stride = static_cast<u64>(kv_heads) * D;
    const u32 warp = threadIdx.x >> 5;
    const u32 lane = threadIdx.x & 31;
    const u32 r0 = k0 + warp * 16 + (lane >> 2);  // this thread's keys: r0, r0 + 8
    const float c = scale * LOG2E;
    const u32 steps = (seq - k0 + DKDV_QUERIES - 1) / DKDV_QUERIES;

    stage_keys<D, DKDV_KEYS>(ks, vs, 0, k, v, row0, tile, seq, kv_heads, g);
    // Step i: queries from k0 + i * DKDV_QUERIES.
    auto stage_step = [&](u32 i, u32 buf) {
        const u32 t0 = k0 + i * DKDV_QUERIES;
        const u64 first = (row0 + t0) * heads + h;
        stage_rows<D, DKDV_QUERIES>(qs + buf * QUERY_ELEMS, q + first * D, q_stride, seq - t0);
        stage_rows<D, DKDV_QUERIES>(dos + buf * QUERY_ELEMS, dout + first * D, q_stride, seq - t0);
        stage_column<DKDV_QUERIES>(lses + buf * DKDV_QUERIES, lse + first, heads, seq - t0);
        stage_column<DKDV_QUERIES>(deltas + buf * DKDV_QUERIES, delta + first, heads, seq - t0);
    };
    stage_step(0, 0);
    commit_async();

    float acc_k[1][D / 8][4];
    float acc_v[1][D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        acc_k[0][n][0] = acc_k[0][n][1] = acc_k[0][n][2] = acc_k[0][n][3] = 0.0f;
        acc_v[0][n][0] = acc_v[0][n][1] = acc_v[0][n][2] = acc_v[0][n][3] = 0.0f;
    }
    for (u32 i = 0; i < steps; ++i) {
        const u32 buf = i & 1;
        if (i + 1 < steps) {
            stage_step(i + 1, buf ^ 1);
        }
        commit_async();
        wait_async<1>();
        __syncthreads();
        const u32 t0 = k0 + i * DKDV_QUERIES;
        const bf16* qt = qs + buf * QUERY_ELEMS;
        const bf16* dot = dos + buf * QUERY_ELEMS;
        const float* lt = lses + buf * DKDV_QUERIES;
        const float* dt = deltas + buf * DKDV_QUERIES;
        // Scores and their gradients transposed: rows are the warp's keys.
        float p[1][DKDV_QUERIES / 8][4];
        product_rows<D, 1, DKDV_QUERIES / 8>(p, ks, warp * 16, qt);
        float dp[1][DKDV_QUERIES / 8][4];
        product_rows<D, 1, DKDV_QUERIES / 8>(dp, vs, warp * 16, dot);
        const bool masked = t0 < k0 + warp * 16 + 16 || t0 + DKDV_QUERIES > seq;
#pragma unroll
        for (int n = 0; n < DKDV_QUERIES / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 col = n * 8 + 2 * (lane & 3) + (e & 1);
                const u32 query = t0 + col;
                const u32 key = e < 2 ? r0 : r0 + 8;
                const bool live = !masked || (key <= query && query < seq);
                p[0][n][e] = live ? exp2_ftz(p[0][n][e] * c - lt[col] * LOG2E) : 0.0f;
                dp[0][n][e] = p[0][n][e] * (dp[0][n][e] - dt[col]);
            }
        }
        accumulate<D, 1, DKDV_QUERIES / 8>(acc_v, p, dot);
        accumulate<D, 1, DKDV_QUERIES / 8>(acc_k, dp, qt);
        __syncthreads();
    }
    if (group == 1) {
        const u64 first = (row0 * kv_heads + g) * D;
        store_rows<D, 1>(dk + first, kv_stride, acc_k, r0, seq, scale);
        store_rows<D, 1>(dv + first, kv_stride, acc_v, r0, seq, 1.0f);
    } else {
        const u64 first = (row0 * heads + h) * D;
        store_rows<D, 1>(dk_part + first, q_stride, acc_k, r0, seq, scale);
        store_rows<D, 1>(dv_part + first, q_stride, acc_v, r0, seq, 1.0f);
    }
}

// dk[row, g, c] = sum over i < heads / kv_heads, in order, of
// dk_part[row, g * group + i, c]; dv likewise. A thread per pair of
// channels (D is even).
extern "C" __global__ void flash_group_sum(const float* dk_part, const float* dv_part, bf16* dk, bf16* dv,
                                           u64 rows, u32 heads, u32 kv_heads, u32 dim) {
    grid_dependency_sync();
    const u32 group = heads / kv_heads;
    const u64 pairs = rows * kv_heads * (dim / 2);
    for (u64 i = grid_start(); i < pairs; i += grid_stride()) {
        const u64 c = (i % (dim / 2)) * 2;
        const u64 rg = i / (dim / 2);  // row * kv_heads + g
        const u64 first = (rg * group) * dim + c;  // (row, g * group, c)
        float k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
        for (u32 j = 0; j < group; ++j) {
            const float2 dkp = *reinterpret_cast<const float2*>(dk_part + first + j * dim);
            const float2 dvp = *reinterpret_cast<const float2*>(dv_part + first + j * dim);
            k0 += dkp.x;
            k1 += dkp.y;
            v0 += dvp.x;
            v1 += dvp.y;
        }
        *reinterpret_cast<u32*>(dk + rg * dim + c) = pack_bf16(k0, k1);
        *reinterpret_cast<u32*>(dv + rg * dim + c) = pack_bf16(v0, v1);
    }
}

// ---- Hopper: the same three kernels on warpgroup MMAs (sm_90a) -------------
// For D = 128 on sm_90a the launchers take these instead: `wgmma` runs a
// 64 x N x 16 product on a warpgroup (four warps) asynchronously, reading
// its B operand (and A, where A is a staged tile) straight from shared
// memory, so no `ldmatrix` traffic goes through registers (which bound the
// kernels above). A block is two warpgroups; each owns 64 rows of the
// block's tile. Softmax and its gradient are the kernels' above, in
// registers: a warpgroup's accumulator gives each warp 16 rows in the
// mma.sync layout, so P and dS feed the next product as register A
// operands after a round to bf16, as before, and every sum keeps one order.
//
// Staged tiles use the 128-byte swizzled layout that `wgmma` reads at full
// speed (unswizzled core matrices, tried first, made the kernels slower in
// all than the mma.sync ones: the reads of 8 core matrices 2 KiB apart fall
// in the same banks). A tile of ROWS rows of 128 bf16 channels is two atoms
// of 64 channels, one after the other (ROWS * 128 bytes each); in an atom
// row r is 128 bytes at r * 128 and its 16-byte chunk c sits at chunk
// c ^ (r % 8). Atoms start on 1024-byte boundaries, so the swizzle is the
// hardware's (address bits 4-6 XOR bits 7-9). A tile is read as a K-major
// operand (K along the channels: q, k, v and dout in S = Q K^T, dP = dO V^T
// and their transposes; K-step kk starts 32 kk bytes into atom kk / 4, the
// next 8 rows 1024 bytes on) or as an MN-major B (K along the rows: v in
// O = P V, k in dQ = dS K, q and dout in dK and dV; K-step kk starts at row
// 16 kk, the next 8 rows 1024 bytes on, the second 64 channels an atom on).
// One staged tile serves both. Tiles of q, k, v and dout arrive by TMA:
// one thread issues a tile as two boxes (its atoms), TMA writes them in
// this swizzle, and the threads wait on the buffer's mbarrier, so no thread
// computes a fetch's address and the only block barrier an iteration is
// the one that frees the buffers the next loads fill.
#define WG_THREADS 256
// The forward's and dq's query tile (64 rows a warpgroup), the key tiles
// they walk, the dk/dv key tile (64 keys a warpgroup) and its query tile.
#define WG_QUERY_ROWS 128
#define WG_FWD_KEYS 128
#define WG_DQ_KEYS 64
#define WG_DKDV_KEYS 128
#define WG_DKDV_QUERIES 64
#define WG_D 128
// The mbarriers after each kernel's tiles (8 bytes each): the forward's q
// and three of K and V each; dq's q-and-dout, four of K and three of V;
// dk/dv's K-and-V and three of q-and-dout.
#define WG_FWD_BARRIERS 7
#define WG_DQ_BARRIERS 8
#define WG_DKDV_BARRIERS 4

// The forward's operands as TMA reads them: q [batch, seq, heads, D] and k,
// v [batch, seq, kv_heads, D], each a four-dimensional map (D contiguous)
// whose box is one head's 128 rows of 64 channels, 128-byte swizzled: a
// tile is two boxes, its two atoms. Rows past a sequence load as zeros.
struct FlashMaps {
    TensorMap q, k, v;
};
// The backward kernels' operands the same way, dout [batch, seq, heads, D]
// too; the boxes are each kernel's tiles: dq's query tile for q and dout
// and its key tile for k and v, dk/dv's key tile for k and v and its query
// tile for q and dout.
struct FlashGradMaps {
    TensorMap q, k, v, dout;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A staged tile of ROWS rows as a K-major operand (K-step `kk`: channels
// 16 kk .. 16 kk + 15, rows from `row0`, a multiple of 8; the leading
// offset is unused), and as an MN-major B (K-step `kk`: rows 16 kk .. 16 kk
// + 15; the leading offset steps to the second atom): see the layout above.
template <int ROWS>
__device__ __forceinline__ u64 k_major(const bf16* tile, u32 row0, u32 kk) {
    return swizzled_desc(shared_address(tile) + (kk / 4) * ROWS * 128 + row0 * 128 + (kk % 4) * 32, 16, 1024);
}
template <int ROWS>
__device__ __forceinline__ u64 mn_major(const bf16* tile, u32 kk) {
    return swizzled_desc(shared_address(tile) + kk * 2048, ROWS * 128, 1024);
}

// Thread 0 initialises `count` mbarriers 8 bytes apart from `first`, each
// completing a phase at `arrivals` arrivals (and its loads' bytes).
__device__ __forceinline__ void init_barriers(u32 first, u32 count, u32 arrivals) {
    if (threadIdx.x == 0) {
        for (u32 i = 0; i < count; ++i) {
            mbarrier_init(first + 8 * i, arrivals);
        }
    }
}
// Makes the initialised barriers visible to TMA and to every thread
// before any load is issued or waited for.
__device__ __forceinline__ void publish_barriers() {
    if (threadIdx.x == 0) {
        mbarrier_init_fence();
    }
    __syncthreads();
}

// ROWS rows of head `head` from row `t` of sequence `b` into `tile` (both
// channel halves, an atom each) through `map`, whose box is ROWS rows of
// 64 channels, completing on barrier `bar`; rows past the sequence load
// as zeros. Issued by one thread.
template <u32 ROWS>
__device__ __forceinline__ void load_head_rows(const TensorMap* map, bf16* tile, u32 head, u32 t, u32 b, u32 bar) {
    const u32 at = shared_address(tile);
    mbarrier_expect(bar, ROWS * WG_D * 2);
    tma_load_4d(at, map, 0, head, t, b, bar);
    tma_load_4d(at + ROWS * 128, map, 64, head, t, b, bar);
}

// Issues d = A B^T over the WG_D channels, d 64 x B_ROWS: A the 64 rows
// from `a_row0` of a staged tile of A_ROWS rows, B every row of a staged
// tile of B_ROWS rows (both read K-major). The first K-step overwrites d.
template <int A_ROWS, int B_ROWS>
__device__ __forceinline__ void issue_scores(float (&d)[B_ROWS / 2], const bf16* a, u32 a_row0, const bf16* b) {
#pragma unroll
    for (int kk = 0; kk < WG_D / 16; ++kk) {
        wgmma_ss(d, k_major<A_ROWS>(a, a_row0, kk), k_major<B_ROWS>(b, 0, kk), kk);
    }
}

// Issues d += A B, d 64 x WG_D: A the register operands of B_ROWS / 16
// K-steps, B every row of a staged tile of B_ROWS rows (read MN-major).
template <int B_ROWS>
__device__ __forceinline__ void issue_weighted_rows(float (&d)[WG_D / 2], const u32 (&a)[B_ROWS / 16][4],
                                                    const bf16* b) {
#pragma unroll
    for (int kk = 0; kk < B_ROWS / 16; ++kk) {
        wgmma_rs(d, a[kk], mn_major<B_ROWS>(b, kk));
    }
}

// Writes a 64 x D accumulator times `factor` (bf16 or f32, T) in rows
// `stride` elements apart from `first`: this thread's rows are `row` and
// `row + 8` of rows from `r0`, skipped past `seq`.
template <typename T>
__device__ __forceinline__ void store_group_rows(T* first, u64 stride, const float (&acc)[WG_D / 2], u32 r0,
                                                 u32 row, u32 seq, float factor) {
    const u32 t = threadIdx.x & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 r = r0 + row + half * 8;
        if (r >= seq) {
            continue;
        }
#pragma unroll
        for (int n = 0; n < WG_D / 8; ++n) {
            store_pair(first + r * stride + n * 8 + 2 * t, acc[4 * n + 2 * half] * factor,
                       acc[4 * n + 2 * half + 1] * factor);
        }
    }
}

template <int N>
__device__ __forceinline__ void zero(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        d[i] = 0.0f;
    }
}

// The helpers below take MASKED as a template parameter and are called
// with `true` only for tiles that hold masked elements (on the diagonal or
// past the sequence): the others, most of a causal row's, compile to loops
// without the per-element index arithmetic and selects, doing the same
// arithmetic on every live element (so the same bits).

// Scales a forward tile's scores (KEYS keys from u0, this thread's rows
// `row` and `row + 8` from g0), masking keys past the row or the sequence,
// and gives each row's tile max in `x`. The max takes four running maxima
// a row, then their max: the same value in any order, in a quarter of the
// dependent steps (on the path from the scores to the exponentials).
template <bool MASKED, int KEYS>
__device__ __forceinline__ void scale_scores(float (&s)[KEYS / 2], u32 u0, u32 g0, u32 row, u32 lane, u32 seq,
                                             float c, float (&x)[2]) {
    float part[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            part[i][q] = neg_inf();
        }
    }
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 key = u0 + n * 8 + 2 * (lane & 3) + (e & 1);
            const u32 r = g0 + row + (e >> 1) * 8;
            float& sv = s[4 * n + e];
            sv = (!MASKED || (key <= r && key < seq)) ? sv * c : neg_inf();
            float& m = part[e >> 1][(n & 1) * 2 + (e & 1)];
            m = fmaxf(m, sv);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        x[i] = fmaxf(fmaxf(part[i][0], part[i][1]), fmaxf(part[i][2], part[i][3]));
    }
}

// dq's dS = P (dP - D) in place of S, P recomputed from S and the rows'
// lse in base 2 (`er`; `dr` is D), for KEYS keys from u0.
template <bool MASKED, int KEYS>
__device__ __forceinline__ void tile_score_gradients(float (&s)[KEYS / 2], const float (&dp)[KEYS / 2], u32 u0, u32 g0,
                                                u32 row, u32 lane, u32 seq, float c, const float (&er)[2],
                                                const float (&dr)[2]) {
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = e >> 1;
            const u32 key = u0 + n * 8 + 2 * (lane & 3) + (e & 1);
            const u32 r = g0 + row + 8 * i;
            const bool live = !MASKED || (key <= r && key < seq);
            const float p = live ? exp2_ftz(s[4 * n + e] * c - er[i]) : 0.0f;
            s[4 * n + e] = p * (dp[4 * n + e] - dr[i]);
        }
    }
}

// dk/dv's transposed P (rows this thread's keys `row`, `row + 8` from
// kg0; QUERIES queries from t0, their lse `lt` and D `dt` in shared
// memory) in place of the scores, and dS = P (dP - D) in place of dP.
template <bool MASKED, int QUERIES>
__device__ __forceinline__ void key_probabilities(float (&p)[QUERIES / 2], float (&dp)[QUERIES / 2], u32 t0,
                                                  u32 kg0, u32 row, u32 lane, u32 seq, float c, const float* lt,
                                                  const float* dt) {
#pragma unroll
    for (int n = 0; n < QUERIES / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 col = n * 8 + 2 * (lane & 3) + (e & 1);
            const u32 query = t0 + col;
            const u32 key = kg0 + row + (e >> 1) * 8;
            const bool live = !MASKED || (key <= query && query < seq);
            float& pv = p[4 * n + e];
            pv = live ? exp2_ftz(pv * c - lt[col] * LOG2E) : 0.0f;
            dp[4 * n + e] = pv * (dp[4 * n + e] - dt[col]);
        }
    }
}

// Tile scores to probabilities for this thread's two rows (`row`, `row`
// + 8 of the warpgroup's rows from g0), the keys from u0: masks keys past
// the row or the sequence, folds the tile into the running max `mx` and sum
// `sum`, and gives each row's rescale of what came before in `alpha`.
template <bool MASKED, int KEYS>
__device__ __forceinline__ void tile_softmax(float (&s)[KEYS / 2], u32 u0, u32 g0, u32 row, u32 lane, u32 seq,
                                             float c, float (&mx)[2], float (&sum)[2], float (&alpha)[2]) {
    float x[2] = {neg_inf(), neg_inf()};
    scale_scores<MASKED, KEYS>(s, u0, g0, row, lane, seq, c, x);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        // Key 0 is in every row's first tile, so the max is finite from
        // then on.
        const float next = fmaxf(mx[i], quad_max(x[i]));
        alpha[i] = exp2_ftz(mx[i] - next);
        mx[i] = next;
        sum[i] *= alpha[i];
    }
#pragma unroll
    for (int n = 0; n < KEYS / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[4 * n + e] = exp2_ftz(s[4 * n + e] - mx[e >> 1]);
            sum[e >> 1] += s[4 * n + e];
        }
    }
}

// The same, the masked or unmasked way as the tile needs. The whole
// softmax is in the branch, not only the masking: ptxas places a
// warpgroup wait that follows at the top of its basic block, so after the
// branch's join the wait for the P V in flight comes after the
// exponentials (with only the masking branched, it hoisted that wait above
// them and the softmax no longer overlapped the product).
template <int KEYS>
__device__ __forceinline__ void online_softmax(float (&s)[KEYS / 2], u32 u0, u32 g0, u32 row, u32 lane, u32 seq,
                                               float c, float (&mx)[2], float (&sum)[2], float (&alpha)[2]) {
    if (u0 + KEYS > g0 || u0 + KEYS > seq) {
        tile_softmax<true, KEYS>(s, u0, g0, row, lane, seq, c, mx, sum, alpha);
    } else {
        tile_softmax<false, KEYS>(s, u0, g0, row, lane, seq, c, mx, sum, alpha);
    }
}

// The forward of `flash_forward` on warpgroups: a block per 128-row query
// tile, key tiles of 128. The products of consecutive tiles overlap the
// softmax (FlashAttention-3's intra-warpgroup pipelining): while the
// warpgroup turns tile j's scores into probabilities, its tensor cores add
// tile j - 1's P V into the output. The output still takes each tile's
// rescale after that tile's P V and before the next one's, so every sum
// keeps the unpipelined kernel's order (and bits). K runs one tile ahead
// of V: iteration j fetches K of tile j + 1 and V of tile j. The block's
// one barrier an iteration comes before those loads, so iteration j - 1
// is done everywhere when they are issued. Rings of two would then do
// (the loads replace K_{j-1} and V_{j-2}); they have three, the size
// measured when the loads came before the barrier (`cp.async`, where a
// warpgroup could still be an iteration behind), and two are not yet
// measured.
__device__ __forceinline__ void flash_forward_wgmma(const FlashMaps& maps, bf16* out, float* lse, u32 batch,
                                                    u32 seq, u32 heads, u32 kv_heads, float scale) {
    constexpr u32 D = WG_D;
    constexpr u32 KEYS = WG_FWD_KEYS;
    constexpr u32 KEY_ELEMS = KEYS * D;
    extern __shared__ __align__(128) unsigned char shared[];
    bf16* qs = reinterpret_cast<bf16*>(aligned_shared(shared));
    bf16* ks = qs + WG_QUERY_ROWS * D;  // three buffers
    bf16* vs = ks + 3 * KEY_ELEMS;  // three buffers
    // The tiles' barriers: q's, then K's and V's, one a buffer.
    const u32 q_bar = shared_address(vs + 3 * KEY_ELEMS);
    const u32 k_bar = q_bar + 8;
    const u32 v_bar = k_bar + 3 * 8;
    u32 tile, pair;
    flash_block((seq + WG_QUERY_ROWS - 1) / WG_QUERY_ROWS, batch * heads, true, tile, pair);
    const u32 h = pair % heads;
    const u32 g = h / (heads / kv_heads);
    const u32 b = pair / heads;
    const u32 t0 = tile * WG_QUERY_ROWS;
    const u64 row0 = static_cast<u64>(b) * seq;
    const auto [group, lane, row] = group_lane();
    const u32 g0 = t0 + group * 64;  // the warpgroup's first row
    const float c = scale * LOG2E;
    // Both warpgroups have rows at or after the first key of each of these
    // tiles (t0 is a multiple of the key tile), so they walk them all.
    const u32 key_tiles = (min(t0 + WG_QUERY_ROWS, seq) + KEYS - 1) / KEYS;
    const bool producer = threadIdx.x == 0;
    init_barriers(q_bar, WG_FWD_BARRIERS, 1);
    publish_barriers();
    // Fetches K_{j+1} and V_j, and waits for K_j and V_{j-1}. The block's
    // one barrier an iteration comes first: once every thread is past it,
    // iteration j - 1 is done everywhere, so the buffers these loads fill
    // (K_{j-2}'s and V_{j-3}'s) are free.
    auto advance = [&](u32 j) {
        __syncthreads();
        if (producer) {
            if (j + 1 < key_tiles) {
                const u32 u = j + 1;
                load_head_rows<KEYS>(&maps.k, ks + (u % 3) * KEY_ELEMS, g, u * KEYS, b, k_bar + 8 * (u % 3));
            }
            if (j < key_tiles) {
                load_head_rows<KEYS>(&maps.v, vs + (j % 3) * KEY_ELEMS, g, j * KEYS, b, v_bar + 8 * (j % 3));
            }
        }
        if (j < key_tiles) {
            mbarrier_wait(k_bar + 8 * (j % 3), (j / 3) & 1);
        }
        if (j > 0) {
            mbarrier_wait(v_bar + 8 * ((j - 1) % 3), ((j - 1) / 3) & 1);
        }
    };
    if (producer) {
        load_head_rows<KEYS>(&maps.q, qs, h, t0, b, q_bar);
        load_head_rows<KEYS>(&maps.k, ks, g, 0, b, k_bar);
    }
    mbarrier_wait(q_bar, 0);

    float acc[D / 2];
    zero(acc);
    float mx[2] = {neg_inf(), neg_inf()};
    float sum[2] = {0.0f, 0.0f};
    float alpha[2];
    // The previous tile's probabilities, rounded to bf16: the A operand of
    // its P V.
    u32 p[KEYS / 16][4];
    {
        advance(0);
        float s[KEYS / 2];
        wgmma_fence();
        issue_scores<WG_QUERY_ROWS, KEYS>(s, qs, group * 64, ks);
        wgmma_finish();
        online_softmax<KEYS>(s, 0, g0, row, lane, seq, c, mx, sum, alpha);
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk) {
            a_operand(p[kk], s, kk);
        }
    }
    for (u32 j = 1; j < key_tiles; ++j) {
        advance(j);
        float s[KEYS / 2];
        fence_operands(acc);
        fence_operands(p);
        wgmma_fence();
        issue_scores<WG_QUERY_ROWS, KEYS>(s, qs, group * 64, ks + (j % 3) * KEY_ELEMS);
        wgmma_commit();
        issue_weighted_rows<KEYS>(acc, p, vs + ((j - 1) % 3) * KEY_ELEMS);
        wgmma_commit();
        wgmma_wait<1>();  // the scores; P V may still run
        fence_operands(s);
        online_softmax<KEYS>(s, j * KEYS, g0, row, lane, seq, c, mx, sum, alpha);
        wgmma_wait<0>();  // P V of tile j - 1 is in acc; p is free
        fence_operands(acc);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            acc[4 * n + 0] *= alpha[0];
            acc[4 * n + 1] *= alpha[0];
            acc[4 * n + 2] *= alpha[1];
            acc[4 * n + 3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk) {
            a_operand(p[kk], s, kk);
        }
    }
    advance(key_tiles);
    fence_operands(acc);
    fence_operands(p);
    wgmma_fence();
    issue_weighted_rows<KEYS>(acc, p, vs + ((key_tiles - 1) % 3) * KEY_ELEMS);
    wgmma_finish();
    const u32 t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float l = quad_sum(sum[i]);
        const u32 r = g0 + row + i * 8;
        if (r >= seq) {
            continue;
        }
        const float inv = 1.0f / l;
        bf16* dst = out + ((row0 + r) * heads + h) * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<u32*>(dst + n * 8 + 2 * t) =
                pack_bf16(acc[4 * n + 2 * i] * inv, acc[4 * n + 2 * i + 1] * inv);
        }
        if (t == 0) {
            lse[(row0 + r) * heads + h] = (mx[i] + log2f(l)) * LN2;
        }
    }
}

// dq of `flash_backward_dq` on warpgroups (and D_t into `delta`): a block
// per 128-row query tile, key tiles of 64, pipelined as the forward: while
// the warpgroup turns tile j's S and dP into dS, its tensor cores add tile
// j - 1's dS K into dq (the same sums in the same order). Iteration j
// reads K_{j-1}, K_j and V_j and fetches K_{j+1} and V_{j+1}, after the
// block's one barrier an iteration (iteration j - 1 is then done
// everywhere). K has four buffers and V three, one more each than that
// order needs: the sizes measured when the loads came before the barrier
// (a warpgroup could then still read K_{j-2}, K_{j-1} and V_{j-1}); the
// smaller rings are not yet measured.
__device__ __forceinline__ void flash_backward_dq_wgmma(const FlashGradMaps& maps, const bf16* out,
                                                        const float* lse, const bf16* dout, bf16* dq, float* delta,
                                                        u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {
    constexpr u32 D = WG_D;
    constexpr u32 QUERY_ELEMS = WG_QUERY_ROWS * D;
    constexpr u32 KEY_ELEMS = WG_DQ_KEYS * D;
    extern __shared__ __align__(128) unsigned char shared[];
    __shared__ float delta_tile[WG_QUERY_ROWS];
    bf16* qs = reinterpret_cast<bf16*>(aligned_shared(shared));
    bf16* dos = qs + QUERY_ELEMS;
    bf16* ks = dos + QUERY_ELEMS;  // four buffers
    bf16* vs = ks + 4 * KEY_ELEMS;  // three buffers
    // The tiles' barriers: q's and dout's (one), then K's and V's, one a
    // buffer.
    const u32 q_bar = shared_address(vs + 3 * KEY_ELEMS);
    const u32 k_bar = q_bar + 8;
    const u32 v_bar = k_bar + 4 * 8;
    u32 tile, pair;
    flash_block((seq + WG_QUERY_ROWS - 1) / WG_QUERY_ROWS, batch * heads, true, tile, pair);
    const u32 h = pair % heads;
    const u32 g = h / (heads / kv_heads);
    const u32 t0 = tile * WG_QUERY_ROWS;
    const u32 b = pair / heads;
    const u64 row0 = static_cast<u64>(b) * seq;
    // Named, not bound: the lambdas below capture them.
    const GroupLane at = group_lane();
    const u32 group = at.group, lane = at.lane, row = at.row;
    const u32 g0 = t0 + group * 64;
    const float c = scale * LOG2E;
    const u32 key_tiles = (min(t0 + WG_QUERY_ROWS, seq) + WG_DQ_KEYS - 1) / WG_DQ_KEYS;
    // The tiles with a key at or before this warpgroup's last row: a
    // prefix of them (the first warpgroup's rows all precede the last).
    const u32 active = min(key_tiles, g0 / WG_DQ_KEYS + 1);
    const bool producer = threadIdx.x == 0;
    // q's barrier waits for two arrivals, q's and dout's.
    init_barriers(q_bar, 1, 2);
    init_barriers(k_bar, WG_DQ_BARRIERS - 1, 1);
    publish_barriers();
    // Key tile j's K and V (one thread issues them).
    auto load_keys_at = [&](u32 j) {
        load_head_rows<WG_DQ_KEYS>(&maps.k, ks + (j % 4) * KEY_ELEMS, g, j * WG_DQ_KEYS, b, k_bar + 8 * (j % 4));
        load_head_rows<WG_DQ_KEYS>(&maps.v, vs + (j % 3) * KEY_ELEMS, g, j * WG_DQ_KEYS, b, v_bar + 8 * (j % 3));
    };
    auto await_keys_at = [&](u32 j) {
        mbarrier_wait(k_bar + 8 * (j % 4), (j / 4) & 1);
        mbarrier_wait(v_bar + 8 * (j % 3), (j / 3) & 1);
    };
    if (producer) {
        // q and dout on one barrier: twice the bytes.
        load_head_rows<WG_QUERY_ROWS>(&maps.q, qs, h, t0, b, q_bar);
        load_head_rows<WG_QUERY_ROWS>(&maps.dout, dos, h, t0, b, q_bar);
        load_keys_at(0);
        if (key_tiles > 1) {
            load_keys_at(1);
        }
    }
    row_deltas<D, WG_THREADS, WG_QUERY_ROWS>(out, dout, delta, delta_tile, row0, t0, seq, heads, h);
    __syncthreads();
    // This thread's rows g0 + row + 8i: D_t, and lse in base 2 (rows past
    // the sequence have zero q and dout; their lse is taken as 0).
    float dr[2], er[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 r = g0 + row + 8 * i;
        dr[i] = delta_tile[r - t0];
        er[i] = r < seq ? lse[(row0 + r) * heads + h] * LOG2E : 0.0f;
    }

    // Tile j's S and dP (issued together), and dS = P (dP - D) from them,
    // in place of S.
    auto issue_scores_at = [&](float (&s)[WG_DQ_KEYS / 2], float (&dp)[WG_DQ_KEYS / 2], u32 j) {
        issue_scores<WG_QUERY_ROWS, WG_DQ_KEYS>(s, qs, group * 64, ks + (j % 4) * KEY_ELEMS);
        issue_scores<WG_QUERY_ROWS, WG_DQ_KEYS>(dp, dos, group * 64, vs + (j % 3) * KEY_ELEMS);
    };
    auto score_gradients = [&](float (&s)[WG_DQ_KEYS / 2], const float (&dp)[WG_DQ_KEYS / 2], u32 j) {
        const u32 u0 = j * WG_DQ_KEYS;
        if (u0 + WG_DQ_KEYS > g0 || u0 + WG_DQ_KEYS > seq) {
            tile_score_gradients<true, WG_DQ_KEYS>(s, dp, u0, g0, row, lane, seq, c, er, dr);
        } else {
            tile_score_gradients<false, WG_DQ_KEYS>(s, dp, u0, g0, row, lane, seq, c, er, dr);
        }
    };

    float acc[D / 2];
    zero(acc);
    // The previous tile's dS: the A operand of its dS K.
    u32 ds[WG_DQ_KEYS / 16][4];
    {
        mbarrier_wait(q_bar, 0);
        await_keys_at(0);
        float s[WG_DQ_KEYS / 2];
        float dp[WG_DQ_KEYS / 2];
        wgmma_fence();
        issue_scores_at(s, dp, 0);
        wgmma_finish();
        score_gradients(s, dp, 0);
#pragma unroll
        for (int kk = 0; kk < WG_DQ_KEYS / 16; ++kk) {
            a_operand(ds[kk], s, kk);
        }
    }
    for (u32 j = 1; j <= key_tiles; ++j) {
        // The block's one barrier an iteration: once every thread is past
        // it, iteration j - 1 is done everywhere, so the buffers the next
        // loads fill (K_{j-3}'s and V_{j-2}'s) are free.
        __syncthreads();
        if (producer && j + 1 < key_tiles) {
            load_keys_at(j + 1);
        }
        // K_j and V_j are in shared memory; K_{j-1} still is.
        if (j < key_tiles) {
            await_keys_at(j);
        }
        const bf16* k_prev = ks + ((j - 1) % 4) * KEY_ELEMS;
        if (j < active) {
            float s[WG_DQ_KEYS / 2];
            float dp[WG_DQ_KEYS / 2];
            fence_operands(acc);
            fence_operands(ds);
            wgmma_fence();
            issue_scores_at(s, dp, j);
            wgmma_commit();
            issue_weighted_rows<WG_DQ_KEYS>(acc, ds, k_prev);
            wgmma_commit();
            wgmma_wait<1>();  // S and dP; dS K may still run
            fence_operands(s);
            fence_operands(dp);
            score_gradients(s, dp, j);
            wgmma_wait<0>();  // dS K of tile j - 1 is in acc; ds is free
            fence_operands(acc);
#pragma unroll
            for (int kk = 0; kk < WG_DQ_KEYS / 16; ++kk) {
                a_operand(ds[kk], s, kk);
            }
        } else if (j == active) {
            fence_operands(acc);
            fence_operands(ds);
            wgmma_fence();
            issue_weighted_rows<WG_DQ_KEYS>(acc, ds, k_prev);
            wgmma_finish();
        }
    }
    store_group_rows(dq + (row0 * heads + h) * D, static_cast<u64>(heads) * D, acc, g0, row, seq, scale);
}

// dk and dv of `flash_backward_dkdv` on warpgroups: a block per 128-key
// tile of one query head, query tiles of 64; the same outputs (dk and dv,
// or each query head's f32 share of them).
__device__ __forceinline__ void flash_backward_dkdv_wgmma(const FlashGradMaps& maps, const float* lse,
                                                          const float* delta, bf16* dk, bf16* dv, float* dk_part,
                                                          float* dv_part, u32 batch, u32 seq, u32 heads,
                                                          u32 kv_heads, float scale) {
    constexpr u32 D = WG_D;
    constexpr u32 KEY_ELEMS = WG_DKDV_KEYS * D;
    constexpr u32 QUERY_ELEMS = WG_DKDV_QUERIES * D;
    extern __shared__ __align__(128) unsigned char shared[];
    bf16* ks = reinterpret_cast<bf16*>(aligned_shared(shared));
    bf16* vs = ks + KEY_ELEMS;
    // Three buffers of each step's tiles, one more than the order of the
    // loop below needs (its barrier comes before a step's loads): the size
    // measured when the loads came first; two are not yet measured.
    bf16* qs = vs + KEY_ELEMS;
    bf16* dos = qs + 3 * QUERY_ELEMS;
    float* lses = reinterpret_cast<float*>(dos + 3 * QUERY_ELEMS);
    float* deltas = lses + 3 * WG_DKDV_QUERIES;
    // The tiles' barriers: k's and v's (one), then each buffer's of q and
    // dout (one a buffer); each waits for two arrivals, a tile's each.
    const u32 kv_bar = shared_address(deltas + 3 * WG_DKDV_QUERIES);
    const u32 q_bar = kv_bar + 8;
    u32 tile, pair;
    flash_block((seq + WG_DKDV_KEYS - 1) / WG_DKDV_KEYS, batch * heads, false, tile, pair);
    const u32 h = pair % heads;
    const u32 group_size = heads / kv_heads;
    const u32 g = h / group_size;
    const u32 k0 = tile * WG_DKDV_KEYS;
    const u32 b = pair / heads;
    const u64 row0 = static_cast<u64>(b) * seq;
    const u64 q_stride = static_cast<u64>(heads) * D;
    const u64 kv_stride = static_cast<u64>(kv_heads) * D;
    const auto [group, lane, row] = group_lane();
    const u32 kg0 = k0 + group * 64;  // the warpgroup's first key
    const float c = scale * LOG2E;
    const u32 steps = (seq - k0 + WG_DKDV_QUERIES - 1) / WG_DKDV_QUERIES;

    const bool producer = threadIdx.x == 0;
    init_barriers(kv_bar, WG_DKDV_BARRIERS, 2);
    publish_barriers();
    // Step i: queries from k0 + i * WG_DKDV_QUERIES. One thread loads q's
    // and dout's tiles with TMA; lse's and D's columns (4-byte values a
    // row apart, below TMA's 16-byte boxes) come through the first threads'
    // `cp.async`.
    auto stage_step = [&](u32 i, u32 buf) {
        const u32 t0 = k0 + i * WG_DKDV_QUERIES;
        if (producer) {
            const u32 bar = q_bar + 8 * buf;
            load_head_rows<WG_DKDV_QUERIES>(&maps.q, qs + buf * QUERY_ELEMS, h, t0, b, bar);
            load_head_rows<WG_DKDV_QUERIES>(&maps.dout, dos + buf * QUERY_ELEMS, h, t0, b, bar);
        }
        const u64 first = (row0 + t0) * heads + h;
        stage_column<WG_DKDV_QUERIES>(lses + buf * WG_DKDV_QUERIES, lse + first, heads, seq - t0);
        stage_column<WG_DKDV_QUERIES>(deltas + buf * WG_DKDV_QUERIES, delta + first, heads, seq - t0);
        commit_async();
    };
    if (producer) {
        load_head_rows<WG_DKDV_KEYS>(&maps.k, ks, g, k0, b, kv_bar);
        load_head_rows<WG_DKDV_KEYS>(&maps.v, vs, g, k0, b, kv_bar);
    }
    stage_step(0, 0);

    float acc_k[D / 2];
    float acc_v[D / 2];
    zero(acc_k);
    zero(acc_v);
    for (u32 i = 0; i < steps; ++i) {
        const u32 buf = i % 3;
        // This thread's columns of step i have landed; after the block's
        // barrier everyone's have, and step i - 1 is done everywhere, so
        // the buffers step i + 1 fills (step i - 2's) are free.
        wait_async<0>();
        __syncthreads();
        if (i + 1 < steps) {
            stage_step(i + 1, (i + 1) % 3);
        }
        if (i == 0) {
            mbarrier_wait(kv_bar, 0);
        }
        mbarrier_wait(q_bar + 8 * buf, (i / 3) & 1);
        const u32 t0 = k0 + i * WG_DKDV_QUERIES;
        // A warpgroup whose keys all follow the step's queries has nothing
        // to add.
        if (t0 + WG_DKDV_QUERIES > kg0) {
            const bf16* qt = qs + buf * QUERY_ELEMS;
            const bf16* dot = dos + buf * QUERY_ELEMS;
            const float* lt = lses + buf * WG_DKDV_QUERIES;
            const float* dt = deltas + buf * WG_DKDV_QUERIES;
            // Scores and their gradients transposed: rows are the group's
            // keys.
            float p[WG_DKDV_QUERIES / 2];
            float dp[WG_DKDV_QUERIES / 2];
            wgmma_fence();
            issue_scores<WG_DKDV_KEYS, WG_DKDV_QUERIES>(p, ks, group * 64, qt);
            issue_scores<WG_DKDV_KEYS, WG_DKDV_QUERIES>(dp, vs, group * 64, dot);
            wgmma_finish();
            if (t0 < kg0 + 64 || t0 + WG_DKDV_QUERIES > seq) {
                key_probabilities<true, WG_DKDV_QUERIES>(p, dp, t0, kg0, row, lane, seq, c, lt, dt);
            } else {
                key_probabilities<false, WG_DKDV_QUERIES>(p, dp, t0, kg0, row, lane, seq, c, lt, dt);
            }
            u32 pa[WG_DKDV_QUERIES / 16][4];
            u32 da[WG_DKDV_QUERIES / 16][4];
#pragma unroll
            for (int kk = 0; kk < WG_DKDV_QUERIES / 16; ++kk) {
                a_operand(pa[kk], p, kk);
                a_operand(da[kk], dp, kk);
            }
            wgmma_fence();
            issue_weighted_rows<WG_DKDV_QUERIES>(acc_v, pa, dot);
            issue_weighted_rows<WG_DKDV_QUERIES>(acc_k, da, qt);
            wgmma_finish();
        }
    }
    if (group_size == 1) {
        const u64 first = (row0 * kv_heads + g) * D;
        store_group_rows(dk + first, kv_stride, acc_k, kg0, row, seq, scale);
        store_group_rows(dv + first, kv_stride, acc_v, kg0, row, seq, 1.0f);
    } else {
        const u64 first = (row0 * heads + h) * D;
        store_group_rows(dk_part + first, q_stride, acc_k, kg0, row, seq, scale);
        store_group_rows(dv_part + first, q_stride, acc_v, kg0, row, seq, 1.0f);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Their entry points: present for every target (kernels.rs lists them),
// empty where there are no warpgroup MMAs; the launchers take them on
// sm_90a only.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) flash_forward_wgmma_d128(
    const __grid_constant__ FlashMaps maps, bf16* out, float* lse, u32 batch, u32 seq, u32 heads, u32 kv_heads,
    float scale) {
grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    flash_forward_wgmma(maps, out, lse, batch, seq, heads, kv_heads, scale);
#endif
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) flash_backward_dq_wgmma_d128(
    const __grid_constant__ FlashGradMaps maps, const bf16* out, const float* lse, const bf16* dout, bf16* dq,
    float* delta, u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {
grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    flash_backward_dq_wgmma(maps, out, lse, dout, dq, delta, batch, seq, heads, kv_heads, scale);
#endif
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) flash_backward_dkdv_wgmma_d128(
    const __grid_constant__ FlashGradMaps maps, const float* lse, const float* delta, bf16* dk, bf16* dv,
    float* dk_part, float* dv_part, u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {
grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    flash_backward_dkdv_wgmma(maps, lse, delta, dk, dv, dk_part, dv_part, batch, seq, heads, kv_heads, scale);
#endif
}

// The entry points, one instance per head dim (named first, as
// kernels.rs's listing check reads them).
#define FLASH_FORWARD(NAME, D)                                                                                \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                                \
        NAME(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, u32 batch, u32 seq, u32 heads, \
             u32 kv_heads, float scale) {                                                                      \
        grid_dependency_sync();                                                                                \
        flash_forward<D>(q, k, v, out, lse, batch, seq, heads, kv_heads, scale);                              \
    }
#define FLASH_BACKWARD_DQ(NAME, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                                \
        NAME(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,  \
             bf16* dq, float* delta, u32 batch, u32 seq, u32 heads, u32 kv_heads, float scale) {              \
        grid_dependency_sync();                                                                               \
        flash_backward_dq<D>(q, k, v, out, lse, dout, dq, delta, batch, seq, heads, kv_heads, scale);         \
    }
#define FLASH_BACKWARD_DKDV(NAME, D)                                                                          \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                                \
        NAME(const bf16* q, const bf16* k, const bf16* v, const float* lse, const bf16* dout,                 \
             const float* delta, bf16* dk, bf16* dv, float* dk_part, float* dv_part, u32 batch, u32 seq,       \
             u32 heads, u32 kv_heads, float scale) {                                                           \
        grid_dependency_sync();                                                                                \
        flash_backward_dkdv<D>(q, k, v, lse, dout, delta, dk, dv, dk_part, dv_part, batch, seq, heads,        \
                               kv_heads, scale);                                                               \
    }

FLASH_FORWARD(flash_forward_d64, 64)
FLASH_BACKWARD_DQ(flash_backward_dq_d64, 64)
FLASH_BACKWARD_DKDV(flash_backward_dkdv_d64, 64)
FLASH_FORWARD(flash_forward_d128, 128)
FLASH_BACKWARD_DQ(flash_backward_dq_d128, 128)
FLASH_BACKWARD_DKDV(flash_backward_dkdv_d128, 128)

// The gated delta rule of `G` layers (`backend::delta`) on tensor cores: the
// chunked form of `delta.cu` (its header has the maths) for bf16 storage.
//
// ==== the forward ==============================================================
// Where q, k, v and the output are bf16 and both head dims are multiples of
// 16 up to 128, the forward runs on tensor cores (`mma.sync` m16n8k16, bf16
// operands, f32 accumulators), as flash-linear-attention's
// `chunk_gated_delta_rule` does:
//   `delta_tc_prep` (a block a (sequence, chunk, value head), every chunk at
//     once): the normalised q and k, G, A = beta K K^T with its decays (one
//     product), T = (I + A)^-1 in f32 (16 x 16 diagonal blocks by
//     substitution, then the blocks below them), W = T diag(beta gamma) K and
//     U = T diag(beta) V (two products), saved in bf16 with G (f32);
//   `delta_tc_walk` (a block a (sequence, value head, 16 state columns)):
//     the chunks in order with H [dk, 16] in f32 accumulators, per chunk
//     the saved state (f32: the `states` the backward reads, which the
//     contract makes f32), V' = U - W H and H = gamma_L H + K^T (decayed V'),
//     the products on H rounded to bf16; W and K of the next chunk load
//     (cp.async) while the current one is multiplied;
//   `delta_tc_output` (a block a (sequence, chunk, value head)):
//     o = gamma Q H_0 + (the masked, decayed Q K^T) V'.
// Every product's operands are bf16 (inputs, H, T, V' rounded once), its
// sums f32 in the order the mma hardware fixes; nothing is added with
// atomics, so equal inputs give equal bits. The f32 kernels of `delta.cu`
// stay the path for f32 storage and other head dims.
#include "delta.cuh"
#include "wgmma.cuh"

#define DELTA_TC_THREADS 128
// Pitch (bf16 elements) of the 64 x 64 tiles of T.
#define DELTA_T_PITCH 72
// Pitch (f32) of the 64 x 64 f32 tiles of A and T.
#define DELTA_F_PITCH 65
// State columns a walk block takes, and the pitch of its 16-column tiles.
#define DELTA_TC_COLS 16
#define DELTA_COL_PITCH 24

// One item's part of the scratch (bytes): G f32 [64] | beta f32 [64] |
// normalised k bf16 [64, dk] | normalised, scaled q [64, dk] | W [64, dk] |
// U [64, dv] | V' [64, dv] | T [64, 64]. Smaller than the f32 path's
// `prep_len`, so `delta_scratch_len` covers it (`tc_item_len` in
// `cuda/ops/delta.rs`).
struct TcItem {
    float* g;
    float* beta;
    bf16* kn;
    bf16* qn;
    bf16* w;
    bf16* u;
    bf16* vn;
    bf16* t;
};

__device__ __forceinline__ u64 tc_item_bytes(const DeltaParams& p) {
    return 512ull + 128ull * (3ull * p.dk + 2ull * p.dv) + 8192ull;
}

__device__ __forceinline__ TcItem tc_item_at(const DeltaParams& p, u64 item) {
    char* base = reinterpret_cast<char*>(p.scratch) + item * tc_item_bytes(p);
    const u64 keys = 64ull * p.dk;
    TcItem r;
    r.g = reinterpret_cast<float*>(base);
    r.beta = r.g + 64;
    r.kn = reinterpret_cast<bf16*>(base + 512);
    r.qn = r.kn + keys;
    r.w = r.qn + keys;
    r.u = r.w + keys;
    r.vn = r.u + 64ull * p.dv;
    r.t = r.vn + 64ull * p.dv;
    return r;
}

// What the tensor-core backward's reverse walk leaves for each item (bytes,
// after the f32 path's preparations, where `back_at` would be): M^T dO
// bf16 [64, dv] | dV' [64, dv] | dH_L bf16 [dv, dk] (the states' layout).
// Inside the f32 path's `back_len`.
struct TcBack {
    bf16* dvl;
    bf16* dvn;
    bf16* dh;
};

__device__ __forceinline__ TcBack tc_back_at(const DeltaParams& p, u64 item) {
    char* base = reinterpret_cast<char*>(reinterpret_cast<float*>(p.scratch) + items_of(p) * prep_len(p)) +
                 item * (256ull * p.dv + 2ull * p.dv * p.dk);
    TcBack r;
    r.dvl = reinterpret_cast<bf16*>(base);
    r.dvn = r.dvl + 64ull * p.dv;
    r.dh = r.dvn + 64ull * p.dv;
    return r;
}

// ---- fragments ---------------------------------------------------------------
// Tiles are row-major bf16 with a pitch of `pitch` elements, an odd multiple
// of 16 bytes (a width that is a multiple of 16, plus 8), so that the eight
// rows an `ldmatrix` reads fall in distinct banks.

// A(m, k) = tile[m0 + m][k0 + k], m, k < 16.
__device__ __forceinline__ void tc_load_a(u32 (&a)[4], const bf16* tile, int pitch, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(a, shared_address(tile + (m0 + (lane & 15)) * pitch + k0 + (lane >> 4) * 8));
}

// A(m, k) = tile[k0 + k][m0 + m]: the tile read as its transpose. Lanes
// 8i..8i+7 address matrix i (a0: m 0-7 k 0-7, a1: m 8-15, a2: k 8-15, a3
// both), transposed by the load.
__device__ __forceinline__ void tc_load_a_trans(u32 (&a)[4], const bf16* tile, int pitch, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    const int matrix = lane >> 3;
    const int row = k0 + (lane & 7) + (matrix >> 1) * 8;
    const int col = m0 + (matrix & 1) * 8;
    ldmatrix_x4_trans(a, shared_address(tile + row * pitch + col));
}

// B(k, n) = tile[n0 + n][k0 + k] for n < 16: b[0], b[1] the columns n0..n0+7,
// b[2], b[3] the columns n0+8..n0+15.
__device__ __forceinline__ void tc_load_b_rows(u32 (&b)[4], const bf16* tile, int pitch, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    const int row = n0 + (lane & 7) + (lane >> 4) * 8;
    const int col = k0 + ((lane >> 3) & 1) * 8;
    ldmatrix_x4(b, shared_address(tile + row * pitch + col));
}

// B(k, n) = tile[k0 + k][n0 + n]; the same fragment order.
__device__ __forceinline__ void tc_load_b_cols(u32 (&b)[4], const bf16* tile, int pitch, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int col = n0 + (lane >> 4) * 8;
    ldmatrix_x4_trans(b, shared_address(tile + row * pitch + col));
}

// Copies `rows` rows of `width` bf16 (a multiple of 8) from `src` (rows
// `width` apart) into `tile` (rows `pitch` apart), asynchronously.
// acc = A B^T on and below the diagonal of a 64 x 64 tile, for warp
// `warp`'s 16 rows (the 16 x 16 blocks np <= warp; the others stay zero):
// A and B are [64, dk] bf16 tiles of pitch `pitch`, read as rows.
__device__ __forceinline__ void tc_lower_product(float (&acc)[8][4], const bf16* a, const bf16* b, int pitch,
                                                 int warp, int dk) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[nt][e] = 0.0f;
        }
    }
    for (int k0 = 0; k0 < dk; k0 += 16) {
        u32 af[4];
        tc_load_a(af, a, pitch, 16 * warp, k0);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            if (np <= warp) {
                u32 bf[4];
                tc_load_b_rows(bf, b, pitch, 16 * np, k0);
                mma_bf16(acc[2 * np], af, bf[0], bf[1]);
                mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
            }
        }
    }
}

__device__ __forceinline__ void tc_stage(bf16* tile, int pitch, const bf16* src, int rows, int width) {
    const int words = width / 8;
    for (int idx = threadIdx.x; idx < rows * words; idx += blockDim.x) {
        const int r = idx / words;
        const int c = (idx % words) * 8;
        copy16_async(shared_address(tile + r * pitch + c), src + static_cast<u64>(r) * width + c, true);
    }
}

// dst [64, n] (bf16, rows n apart) = L B for a lower-triangular 64 x 64 L
// (bf16, pitch DELTA_T_PITCH) and B [64, n] (bf16, pitch `pb`), n a multiple
// of 16 up to 128. Warp w writes rows 16w..16w+15; L's blocks above the
// diagonal are zeros and skipped.
__device__ __forceinline__ void tc_lower_times(const bf16* l, const bf16* b, int pb, int n, bf16* dst) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const int m0 = 16 * warp;
    for (int n0 = 0; n0 < n; n0 += 64) {
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[nt][e] = 0.0f;
            }
        }
        for (int kk = 0; kk <= warp; ++kk) {
            u32 af[4];
            tc_load_a(af, l, DELTA_T_PITCH, m0, 16 * kk);
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                if (n0 + 16 * np < n) {
                    u32 bf[4];
                    tc_load_b_cols(bf, b, pb, 16 * kk, n0 + 16 * np);
                    mma_bf16(acc[2 * np], af, bf[0], bf[1]);
                    mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = n0 + 8 * nt + 2 * q;
            if (col < n) {
                store_pair(dst + (m0 + g) * n + col, acc[nt][0], acc[nt][1]);
                store_pair(dst + (m0 + g + 8) * n + col, acc[nt][2], acc[nt][3]);
            }
        }
    }
}

// ---- the chunk's preparation ------------------------------------------------------
// Dynamic shared memory (`tc_prep_shared` in `cuda/ops/delta.rs`): K and V
// (bf16), T diag(beta gamma) and T diag(beta) (bf16), A and T (f32), the
// blocks' partial products, G and beta.
extern "C" __global__ void __launch_bounds__(DELTA_TC_THREADS) delta_tc_prep(DeltaParams p) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char delta_shared[];
    const int dk = p.dk;
    const int dv = p.dv;
    const int pk = dk + 8;
    const int pv = dv + 8;
    bf16* s_k = reinterpret_cast<bf16*>(delta_shared);
    bf16* s_v = s_k + 64 * pk;
    bf16* s_tk = s_v + 64 * pv;
    bf16* s_tv = s_tk + 64 * DELTA_T_PITCH;
    float* s_a = reinterpret_cast<float*>(s_tv + 64 * DELTA_T_PITCH);
    float* s_t = s_a + 64 * DELTA_F_PITCH;
    float* s_x = s_t + 64 * DELTA_F_PITCH;
    float* s_g = s_x + 3 * 256;
    float* s_beta = s_g + 64;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const u64 item = blockIdx.x;
    const Item it = item_of(p, item);
    const TcItem ti = tc_item_at(p, item);
    const bf16* qkv = reinterpret_cast<const bf16*>(p.qkv);
    const u64 width = qkv_width(p);
    const float a = expf(load(reinterpret_cast<const void*>(p.a_log), p.t_a_log, it.j));
    const float dt_bias = load(reinterpret_cast<const void*>(p.dt_bias), p.t_dt_bias, it.j);
    // A warp a step: its q and k normalised (a lane holds channel pairs
    // 2 lane + 64 e), v copied, g and beta. Steps past the sequence's end
    // are zeros with g = 0 and beta = 0: steps that change nothing.
    for (int t = warp; t < DELTA_CHUNK; t += DELTA_TC_THREADS / 32) {
        const bool live = t < it.len;
        const u64 r = live ? row_of(p, it, t) : 0;
        const bf16* q_row = qkv + r * width + static_cast<u64>(it.i) * dk;
        const bf16* k_row = qkv + r * width + static_cast<u64>(p.key_heads + it.i) * dk;
        const bf16* v_row = qkv + r * width + 2ull * p.key_heads * dk + static_cast<u64>(it.j) * dv;
        float2 qv[2];
        float2 kv[2];
        float qq = 0.0f;
        float kk = 0.0f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int x = 2 * lane + 64 * e;
            const bool in = live && x < dk;
            qv[e] = in ? load_pair(q_row + x) : make_float2(0.0f, 0.0f);
            kv[e] = in ? load_pair(k_row + x) : make_float2(0.0f, 0.0f);
            qq += qv[e].x * qv[e].x + qv[e].y * qv[e].y;
            kk += kv[e].x * kv[e].x + kv[e].y * kv[e].y;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float rq = p.scale / sqrtf(qq + DELTA_L2_EPS);
        const float rk = 1.0f / sqrtf(kk + DELTA_L2_EPS);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int x = 2 * lane + 64 * e;
            if (x < dk) {
                store_pair(s_k + t * pk + x, kv[e].x * rk, kv[e].y * rk);
                store_pair(ti.kn + t * dk + x, kv[e].x * rk, kv[e].y * rk);
                store_pair(ti.qn + t * dk + x, qv[e].x * rq, qv[e].y * rq);
            }
            if (x < dv) {
                const float2 vv = live ? load_pair(v_row + x) : make_float2(0.0f, 0.0f);
                store_pair(s_v + t * pv + x, vv.x, vv.y);
            }
        }
        if (lane == 0) {
            float g = 0.0f;
            float beta = 0.0f;
            if (live) {
                const u64 at = r * p.value_heads + it.j;
                const float raw = load(reinterpret_cast<const void*>(p.alpha), p.t_alpha, at) + dt_bias;
                g = -a * delta_softplus(raw);
                beta = delta_sigmoid(load(reinterpret_cast<const void*>(p.beta), p.t_beta, at));
            }
            s_g[t] = g;
            s_beta[t] = beta;
        }
    }
    for (int idx = tid; idx < 64 * DELTA_F_PITCH; idx += DELTA_TC_THREADS) {
        s_t[idx] = 0.0f;
    }
    __syncthreads();
    if (tid == 0) {
        float sum = 0.0f;
        for (int t = 0; t < DELTA_CHUNK; ++t) {
            sum += s_g[t];
            s_g[t] = sum;
        }
    }
    __syncthreads();
    if (tid < DELTA_CHUNK) {
        ti.g[tid] = s_g[tid];
        ti.beta[tid] = s_beta[tid];
    }
    // A = beta_t (k_t . k_s) e_ts for s < t: warp w the rows 16w..16w+15,
    // the blocks on and below the diagonal.
    {
        const int g = lane >> 2;
        const int q = lane & 3;
        const int m0 = 16 * warp;
        float acc[8][4];
        tc_lower_product(acc, s_k, s_k, pk, warp, dk);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = m0 + g + (e >> 1) * 8;
                const int s = 8 * nt + 2 * q + (e & 1);
                s_a[t * DELTA_F_PITCH + s] = s < t ? s_beta[t] * acc[nt][e] * expf(s_g[t] - s_g[s]) : 0.0f;
            }
        }
    }
    __syncthreads();
    // T = (I + A)^-1, unit lower triangular. Its diagonal 16 x 16 blocks
    // invert those of I + A: a thread a column, by substitution down it.
    if (tid < DELTA_CHUNK) {
        const int r0 = (tid / 16) * 16;
        const int col = tid % 16;
        float column[16];
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            float v = t == col ? 1.0f : 0.0f;
#pragma unroll
            for (int s = 0; s < t; ++s) {
                if (s >= col) {
                    v = __fmaf_rn(-s_a[(r0 + t) * DELTA_F_PITCH + r0 + s], column[s], v);
                }
            }
            column[t] = t < col ? 0.0f : v;
            s_t[(r0 + t) * DELTA_F_PITCH + r0 + col] = column[t];
        }
    }
    __syncthreads();
    // Below the diagonal, a block row at a time: (I + A) T = I gives
    // T_IJ = -T_II sum_{J <= K < I} A_IK T_KJ, from the rows above.
    for (int bi = 1; bi < 4; ++bi) {
        for (int e = tid; e < bi * 256; e += DELTA_TC_THREADS) {
            const int bj = e / 256;
            const int r = (e / 16) % 16;
            const int cc = e % 16;
            float x = 0.0f;
            for (int bk = bj; bk < bi; ++bk) {
                for (int m = 0; m < 16; ++m) {
                    x = __fmaf_rn(s_a[(16 * bi + r) * DELTA_F_PITCH + 16 * bk + m],
                                  s_t[(16 * bk + m) * DELTA_F_PITCH + 16 * bj + cc], x);
                }
            }
            s_x[e] = x;
        }
        __syncthreads();
        for (int e = tid; e < bi * 256; e += DELTA_TC_THREADS) {
            const int bj = e / 256;
            const int r = (e / 16) % 16;
            const int cc = e % 16;
            float v = 0.0f;
            for (int m = 0; m <= r; ++m) {
                v = __fmaf_rn(-s_t[(16 * bi + r) * DELTA_F_PITCH + 16 * bi + m], s_x[bj * 256 + m * 16 + cc], v);
            }
            s_t[(16 * bi + r) * DELTA_F_PITCH + 16 * bj + cc] = v;
        }
        __syncthreads();
    }
    // T with its columns scaled (beta_s gamma_s for W, beta_s for U), in
    // bf16: W = (T diag(beta gamma)) K, U = (T diag(beta)) V.
    for (int idx = tid; idx < DELTA_CHUNK * DELTA_CHUNK / 2; idx += DELTA_TC_THREADS) {
        const int t = idx / 32;
        const int s = (idx % 32) * 2;
        // T itself, for the backward.
        store_pair(ti.t + t * DELTA_CHUNK + s, s_t[t * DELTA_F_PITCH + s], s_t[t * DELTA_F_PITCH + s + 1]);
        const float t0 = s_t[t * DELTA_F_PITCH + s] * s_beta[s];
        const float t1 = s_t[t * DELTA_F_PITCH + s + 1] * s_beta[s + 1];
        store_pair(s_tv + t * DELTA_T_PITCH + s, t0, t1);
        store_pair(s_tk + t * DELTA_T_PITCH + s, t0 * expf(s_g[s]), t1 * expf(s_g[s + 1]));
    }
    __syncthreads();
    tc_lower_times(s_tk, s_k, pk, dk, ti.w);
    tc_lower_times(s_tv, s_v, pv, dv, ti.u);
}

// ---- the forward's walk over the chunks -------------------------------------------
// One block a (sequence, value head, DELTA_TC_COLS state columns); warp w
// keeps H's rows 32w..32w+31 (keys) of the block's columns in f32
// accumulators. Dynamic shared memory (`tc_walk_shared`): W and K of the
// chunk (bf16, pitch dk + 8), H in bf16 [dk, 16], the decayed V' [64, 16],
// U's 16 columns [64, 16] and G (f32 [64]). U and G come with W's group of
// copies, so no load from global memory waits inside a chunk.
extern "C" __global__ void __launch_bounds__(DELTA_TC_THREADS) delta_tc_walk(DeltaParams p) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char delta_shared[];
    const int dk = p.dk;
    const int dv = p.dv;
    const int pk = dk + 8;
    bf16* s_w = reinterpret_cast<bf16*>(delta_shared);
    bf16* s_k = s_w + 64 * pk;
    bf16* s_h = s_k + 64 * pk;
    bf16* s_vn = s_h + dk * DELTA_COL_PITCH;
    bf16* s_u = s_vn + DELTA_CHUNK * DELTA_COL_PITCH;
    float* s_g = reinterpret_cast<float*>(s_u + DELTA_CHUNK * DELTA_TC_COLS);
    const int tiles = dv / DELTA_TC_COLS;
    const int tile = blockIdx.x % tiles;
    const int j = (blockIdx.x / tiles) % p.value_heads;
    const int b = blockIdx.x / (tiles * p.value_heads);
    const int p0 = tile * DELTA_TC_COLS;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    // A chunk's U columns p0.. and G, into s_u and s_g (in the caller's
    // group of copies): a row of 16 bf16 is two 16-byte words.
    const auto stage_u_g = [&](const TcItem& ti) {
        const int t = threadIdx.x / 2;
        const int half = (threadIdx.x % 2) * 8;
        copy16_async(shared_address(s_u + t * DELTA_TC_COLS + half), ti.u + t * dv + p0 + half, true);
        if (threadIdx.x < DELTA_CHUNK / 4) {
            copy16_async(shared_address(s_g + 4 * threadIdx.x), ti.g + 4 * threadIdx.x, true);
        }
    };
    float h[2][2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                h[mt][nt][e] = 0.0f;
            }
        }
    }
    const u64 first = static_cast<u64>(b) * p.chunks * p.value_heads + j;
    {
        const TcItem ti = tc_item_at(p, first);
        tc_stage(s_w, pk, ti.w, DELTA_CHUNK, dk);
        stage_u_g(ti);
        commit_async();
        tc_stage(s_k, pk, ti.kn, DELTA_CHUNK, dk);
        commit_async();
    }
    for (int c = 0; c < p.chunks; ++c) {
        const u64 item = first + static_cast<u64>(c) * p.value_heads;
        const TcItem ti = tc_item_at(p, item);
        // The chunk's starting state: f32 to `states` (S = H^T), bf16 for
        // the products.
        float* state = reinterpret_cast<float*>(p.states) + item * dv * dk;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int x0 = 32 * warp + 16 * mt;
            if (x0 < dk) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int col = 8 * nt + 2 * q;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int x = x0 + g + (e >> 1) * 8;
                        state[static_cast<u64>(p0 + col + (e & 1)) * dk + x] = h[mt][nt][e];
                    }
                    store_pair(s_h + (x0 + g) * DELTA_COL_PITCH + col, h[mt][nt][0], h[mt][nt][1]);
                    store_pair(s_h + (x0 + g + 8) * DELTA_COL_PITCH + col, h[mt][nt][2], h[mt][nt][3]);
                }
            }
        }
        // W's group (with U and G) is in (K's may still be on its way).
        wait_async<1>();
        __syncthreads();
        // V' = U - W H: warp w the steps 16w..16w+15.
        const int t0 = 16 * warp + g;
        const int t1 = t0 + 8;
        const float g_last = s_g[DELTA_CHUNK - 1];
        {
            float acc[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[nt][e] = 0.0f;
                }
            }
            for (int k0 = 0; k0 < dk; k0 += 16) {
                u32 af[4];
                u32 bf[4];
                tc_load_a(af, s_w, pk, 16 * warp, k0);
                tc_load_b_cols(bf, s_h, DELTA_COL_PITCH, k0, 0);
                mma_bf16(acc[0], af, bf[0], bf[1]);
                mma_bf16(acc[1], af, bf[2], bf[3]);
            }
            const float decay0 = expf(g_last - s_g[t0]);
            const float decay1 = expf(g_last - s_g[t1]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int col = 8 * nt + 2 * q;
                const float2 u0 = load_pair(s_u + t0 * DELTA_TC_COLS + col);
                const float2 u1 = load_pair(s_u + t1 * DELTA_TC_COLS + col);
                const float v00 = u0.x - acc[nt][0];
                const float v01 = u0.y - acc[nt][1];
                const float v10 = u1.x - acc[nt][2];
                const float v11 = u1.y - acc[nt][3];
                store_pair(ti.vn + t0 * dv + p0 + col, v00, v01);
                store_pair(ti.vn + t1 * dv + p0 + col, v10, v11);
                store_pair(s_vn + t0 * DELTA_COL_PITCH + col, v00 * decay0, v01 * decay0);
                store_pair(s_vn + t1 * DELTA_COL_PITCH + col, v10 * decay1, v11 * decay1);
            }
        }
        __syncthreads();
        if (c + 1 == p.chunks) {
            break;
        }
        const TcItem next = tc_item_at(p, item + p.value_heads);
        tc_stage(s_w, pk, next.w, DELTA_CHUNK, dk);
        stage_u_g(next);
        commit_async();
        // K's group is in (the next W's may still be on its way).
        wait_async<1>();
        __syncthreads();
        // H = gamma_L H + K^T (exp(G_L - G_s) V'_s).
        const float decay = expf(g_last);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int x0 = 32 * warp + 16 * mt;
            if (x0 < dk) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        h[mt][nt][e] *= decay;
                    }
                }
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    u32 af[4];
                    u32 bf[4];
                    tc_load_a_trans(af, s_k, pk, x0, 16 * kk);
                    tc_load_b_cols(bf, s_vn, DELTA_COL_PITCH, 16 * kk, 0);
                    mma_bf16(h[mt][0], af, bf[0], bf[1]);
                    mma_bf16(h[mt][1], af, bf[2], bf[3]);
                }
            }
        }
        __syncthreads();
        tc_stage(s_k, pk, next.kn, DELTA_CHUNK, dk);
        commit_async();
    }
    wait_async<0>();
}

// ---- the forward's outputs ----------------------------------------------------------
// One block a (sequence, chunk, value head), warp w the steps
// 16w..16w+15: o = gamma Q H_0 + P V' with P = (Q K^T) e_ts masked to
// s <= t, P kept in registers as the second product's A fragments.
// Dynamic shared memory (`tc_output_shared`): Q, K (bf16, pitch dk + 8),
// S_0 = H_0^T in bf16 [dv, dk + 8], V' [64, dv + 8].
extern "C" __global__ void __launch_bounds__(DELTA_TC_THREADS) delta_tc_output(DeltaParams p) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char delta_shared[];
    const int dk = p.dk;
    const int dv = p.dv;
    const int pk = dk + 8;
    const int pv = dv + 8;
    bf16* s_q = reinterpret_cast<bf16*>(delta_shared);
    bf16* s_k = s_q + 64 * pk;
    bf16* s_s = s_k + 64 * pk;
    bf16* s_vn = s_s + dv * pk;
    const u64 item = blockIdx.x;
    const Item it = item_of(p, item);
    const TcItem ti = tc_item_at(p, item);
    tc_stage(s_q, pk, ti.qn, DELTA_CHUNK, dk);
    tc_stage(s_k, pk, ti.kn, DELTA_CHUNK, dk);
    tc_stage(s_vn, pv, ti.vn, DELTA_CHUNK, dv);
    commit_async();
    const float4* state = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p.states) + item * dv * dk);
    for (int idx = threadIdx.x; idx < dv * dk / 4; idx += DELTA_TC_THREADS) {
        const float4 s = state[idx];
        const int col = (4 * idx) / dk;
        const int x = (4 * idx) % dk;
        store_pair(s_s + col * pk + x, s.x, s.y);
        store_pair(s_s + col * pk + x + 2, s.z, s.w);
    }
    wait_async<0>();
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const int m0 = 16 * warp;
    const int t0 = m0 + g;
    const int t1 = t0 + 8;
    const float g0 = ti.g[t0];
    const float g1 = ti.g[t1];
    float o[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[nt][e] = 0.0f;
        }
    }
    // Q H_0 (B(x, col) = S_0[col][x]), then gamma_t on each row.
    for (int k0 = 0; k0 < dk; k0 += 16) {
        u32 af[4];
        tc_load_a(af, s_q, pk, m0, k0);
#pragma unroll
        for (int np = 0; np < 8; ++np) {
            if (16 * np < dv) {
                u32 bf[4];
                tc_load_b_rows(bf, s_s, pk, 16 * np, k0);
                mma_bf16(o[2 * np], af, bf[0], bf[1]);
                mma_bf16(o[2 * np + 1], af, bf[2], bf[3]);
            }
        }
    }
    const float gamma0 = expf(g0);
    const float gamma1 = expf(g1);
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
        o[nt][0] *= gamma0;
        o[nt][1] *= gamma0;
        o[nt][2] *= gamma1;
        o[nt][3] *= gamma1;
    }
    // The scores of the blocks on and below the diagonal.
    float sc[8][4];
    tc_lower_product(sc, s_q, s_k, pk, warp, dk);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = e < 2 ? t0 : t1;
            const int s = 8 * nt + 2 * q + (e & 1);
            const float gt = e < 2 ? g0 : g1;
            sc[nt][e] = s <= t ? sc[nt][e] * expf(gt - ti.g[s]) : 0.0f;
        }
    }
    // P V': the scores' accumulators are the A fragments of steps
    // 16kk..16kk+15 (two 8-column blocks side by side).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        if (kk <= warp) {
            u32 af[4];
            acc_as_a(af, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < 8; ++np) {
                if (16 * np < dv) {
                    u32 bf[4];
                    tc_load_b_cols(bf, s_vn, pv, 16 * kk, 16 * np);
                    mma_bf16(o[2 * np], af, bf[0], bf[1]);
                    mma_bf16(o[2 * np + 1], af, bf[2], bf[3]);
                }
            }
        }
    }
    bf16* out = reinterpret_cast<bf16*>(p.out);
    const u64 out_width = static_cast<u64>(p.value_heads) * dv;
    const u64 col0 = static_cast<u64>(it.j) * dv;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
        const int col = 8 * nt + 2 * q;
        if (col < dv) {
            if (t0 < it.len) {
                store_pair(out + row_of(p, it, t0) * out_width + col0 + col, o[nt][0], o[nt][1]);
            }
            if (t1 < it.len) {
                store_pair(out + row_of(p, it, t1) * out_width + col0 + col, o[nt][2], o[nt][3]);
            }
        }
    }
}

// ==== the backward ==============================================================
// The same split as flash-linear-attention's backward, on the f32 path's
// formulas (`delta_backward_chunk`): `delta_tc_prep` again (with T and
// beta), then
//   `delta_tc_dvl` (a block an item): M^T dO, the outputs' part of dV';
//   `delta_tc_back_walk` (a block a (sequence, value head, 16 columns), the
//     chunks in reverse, dH in f32 accumulators): per chunk dH_L saved,
//     V' = U - W H_0 (H_0 from `states`), dV' = M^T dO + Kd dH_L, and
//     dH_0 = gamma_L dH_L + Q^T (gamma dO) - W^T dV';
//   `delta_tc_back_chunk` (a block an item): every gradient of the chunk.
// `delta_backward_norm` and `delta_backward_a_log` finish, as on the f32
// path (the per-value-head dq, dk and A_log's partials sit where they
// read them).

// The 16-column blocks of a product's output a warp computes: first,
// first + 16 stride, ...; its accumulator tiles 2i and 2i + 1 are block i's
// two 8-column halves. TC_ALL_COLS: every block, in order.
struct TcCols {
    int first;
    int stride;
};
#define TC_ALL_COLS (TcCols{0, 1})

// The first of the two columns this lane holds in accumulator tile nt.
__device__ __forceinline__ int tc_col(TcCols cols, int nt) {
    return cols.first + 16 * cols.stride * (nt >> 1) + 8 * (nt & 1) + 2 * (threadIdx.x & 3);
}

// acc += A B over k in [k_begin, k_end), for the warp's 16 rows from m0
// and the column blocks of `cols` in [n_begin, n_end) (multiples of 16;
// columns are never negative, so the lower bound is compared unsigned and
// a start of 0 compiles to no test at all). A(m, k) = a[k][m] where
// A_TRANS, else a[m][k]; B(k, n) = b[n][k] where B_ROWS, else b[k][n].
template <bool A_TRANS, bool B_ROWS, int NT>
__device__ __forceinline__ void tc_product(float (&acc)[NT][4], const bf16* a, int pa, int m0, const bf16* b, int pb,
                                           TcCols cols, int n_begin, int n_end, int k_begin, int k_end) {
    for (int k0 = k_begin; k0 < k_end; k0 += 16) {
        u32 af[4];
        if (A_TRANS) {
            tc_load_a_trans(af, a, pa, m0, k0);
        } else {
            tc_load_a(af, a, pa, m0, k0);
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            const int n = cols.first + 16 * cols.stride * np;
            if (static_cast<unsigned>(n) >= static_cast<unsigned>(n_begin) && n < n_end) {
                u32 bf[4];
                if (B_ROWS) {
                    tc_load_b_rows(bf, b, pb, n, k0);
                } else {
                    tc_load_b_cols(bf, b, pb, k0, n);
                }
                mma_bf16(acc[2 * np], af, bf[0], bf[1]);
                mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
            }
        }
    }
}

template <int NT>
__device__ __forceinline__ void tc_zero(float (&acc)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc[nt][e] = 0.0f;
        }
    }
}

// ---- M^T dO ---------------------------------------------------------------------------
// One block an item, warp w the steps s = 16w..16w+15: (K Q^T)_st e_ts for
// t >= s, then times dO. Dynamic shared memory (`tc_dvl_shared`): Q, K
// (pitch dk + 8), dO (pitch dv + 8).
extern "C" __global__ void __launch_bounds__(DELTA_TC_THREADS) delta_tc_dvl(DeltaParams p) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char delta_shared[];
    const int dk = p.dk;
    const int dv = p.dv;
    const int pk = dk + 8;
    const int pv = dv + 8;
    bf16* s_q = reinterpret_cast<bf16*>(delta_shared);
    bf16* s_k = s_q + 64 * pk;
    bf16* s_do = s_k + 64 * pk;
    const u64 item = blockIdx.x;
    const Item it = item_of(p, item);
    const TcItem ti = tc_item_at(p, item);
    const TcBack bk = tc_back_at(p, item);
    const u64 out_width = static_cast<u64>(p.value_heads) * dv;
    const bf16* d_out = reinterpret_cast<const bf16*>(p.out) + row_of(p, it, 0) * out_width + static_cast<u64>(it.j) * dv;
    tc_stage(s_q, pk, ti.qn, DELTA_CHUNK, dk);
    tc_stage(s_k, pk, ti.kn, DELTA_CHUNK, dk);
    stage_rows(s_do, pv, d_out, out_width, it.len, DELTA_CHUNK, dv);
    commit_async();
    wait_async<0>();
    __syncthreads();
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const int m0 = 16 * warp;
    const int s0 = m0 + g;
    const int s1 = s0 + 8;
    float sc[8][4];
    tc_zero(sc);
    tc_product<false, true, 8>(sc, s_k, pk, m0, s_q, pk, TC_ALL_COLS, m0, DELTA_CHUNK, 0, dk);
    const float g0 = ti.g[s0];
    const float g1 = ti.g[s1];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int s = e < 2 ? s0 : s1;
            const int t = 8 * nt + 2 * q + (e & 1);
            const float gs = e < 2 ? g0 : g1;
            sc[nt][e] = t >= s ? sc[nt][e] * expf(ti.g[t] - gs) : 0.0f;
        }
    }
    float acc[16][4];
    tc_zero(acc);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        if (kk >= warp) {
            u32 af[4];
            acc_as_a(af, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < 8; ++np) {
                if (16 * np < dv) {
                    u32 bf[4];
                    tc_load_b_cols(bf, s_do, pv, 16 * kk, 16 * np);
                    mma_bf16(acc[2 * np], af, bf[0], bf[1]);
                    mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
                }
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
        const int col = 8 * nt + 2 * q;
        if (col < dv) {
            store_pair(bk.dvl + s0 * dv + col, acc[nt][0], acc[nt][1]);
            store_pair(bk.dvl + s1 * dv + col, acc[nt][2], acc[nt][3]);
        }
    }
}

// ---- the backward's reverse walk -----------------------------------------------------
// One block a (sequence, value head, DELTA_TC_COLS columns); warp w keeps
// dH's rows 32w..32w+31 in f32 accumulators. A chunk's inputs arrive in
// three groups of asynchronous copies issued during the chunk after it (in
// walk order), each as soon as its buffer is free, so the walk never waits
// on global memory that it could have asked for earlier:
//   W, into the other of two buffers, at the chunk's start;
//   the small inputs and K, once the chunk's V' and dV' are done;
//   Q, once its dH update is done.
// Every chunk commits all three groups (empty after the first chunk), so
// the counts `wait_async` takes are the same for every chunk.
// Dynamic shared memory (`tc_back_walk_shared`): two W buffers, K, Q of
// the chunk (pitch dk + 8), H_0 and dH in bf16 [dk, 16], gamma dO and -dV'
// [64, 16], then as loaded: H_0's f32 columns [16, dk], dO's, U's and
// M^T dO's columns [64, 16], G.
extern "C" __global__ void __launch_bounds__(DELTA_TC_THREADS) delta_tc_back_walk(DeltaParams p) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char delta_shared[];
    const int dk = p.dk;
    const int dv = p.dv;
    const int pk = dk + 8;
    bf16* s_wb = reinterpret_cast<bf16*>(delta_shared);
    bf16* s_k = s_wb + 2 * 64 * pk;
    bf16* s_q = s_k + 64 * pk;
    bf16* s_h = s_q + 64 * pk;
    bf16* s_dh = s_h + dk * DELTA_COL_PITCH;
    bf16* s_dog = s_dh + dk * DELTA_COL_PITCH;
    bf16* s_ndv = s_dog + DELTA_CHUNK * DELTA_COL_PITCH;
    bf16* s_dor = s_ndv + DELTA_CHUNK * DELTA_COL_PITCH;
    bf16* s_u = s_dor + DELTA_CHUNK * DELTA_TC_COLS;
    bf16* s_dvl = s_u + DELTA_CHUNK * DELTA_TC_COLS;
    float* s_hf = reinterpret_cast<float*>(s_dvl + DELTA_CHUNK * DELTA_TC_COLS);
    float* s_gc = s_hf + DELTA_TC_COLS * dk;
    const int tiles = dv / DELTA_TC_COLS;
    const int tile = blockIdx.x % tiles;
    const int j = (blockIdx.x / tiles) % p.value_heads;
    const int b = blockIdx.x / (tiles * p.value_heads);
    const int p0 = tile * DELTA_TC_COLS;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const u64 out_width = static_cast<u64>(p.value_heads) * dv;
    const bf16* d_out = reinterpret_cast<const bf16*>(p.out);
    const u64 first = static_cast<u64>(b) * p.chunks * p.value_heads + j;
    // Chunk c's W goes to buffer c % 2.
    const auto w_buffer = [&](int c) { return s_wb + (c & 1) * 64 * pk; };
    const auto stage_w = [&](int c) {
        if (c >= 0) {
            tc_stage(w_buffer(c), pk, tc_item_at(p, first + static_cast<u64>(c) * p.value_heads).w, DELTA_CHUNK, dk);
        }
        commit_async();
    };
    // H_0's columns p0.. (f32 rows of the saved state), 16 columns of dO
    // (zeros past the sequence's end), U and M^T dO, G, and K.
    const auto stage_small_and_k = [&](int c) {
        if (c >= 0) {
            const u64 item = first + static_cast<u64>(c) * p.value_heads;
            const Item it = item_of(p, item);
            const TcItem ti = tc_item_at(p, item);
            const TcBack bk = tc_back_at(p, item);
            const float* state =
                reinterpret_cast<const float*>(p.states) + item * dv * dk + static_cast<u64>(p0) * dk;
            for (int idx = threadIdx.x; idx < DELTA_TC_COLS * dk / 4; idx += DELTA_TC_THREADS) {
                copy16_async(shared_address(s_hf + 4 * idx), state + 4 * idx, true);
            }
            const int t = threadIdx.x / 2;
            const int half = (threadIdx.x % 2) * 8;
            const bool live = t < it.len;
            const bf16* src = live ? d_out + row_of(p, it, t) * out_width + static_cast<u64>(j) * dv + p0 + half : d_out;
            copy16_async(shared_address(s_dor + t * DELTA_TC_COLS + half), src, live);
            copy16_async(shared_address(s_u + t * DELTA_TC_COLS + half), ti.u + t * dv + p0 + half, true);
            copy16_async(shared_address(s_dvl + t * DELTA_TC_COLS + half), bk.dvl + t * dv + p0 + half, true);
            if (threadIdx.x < DELTA_CHUNK / 4) {
                copy16_async(shared_address(s_gc + 4 * threadIdx.x), ti.g + 4 * threadIdx.x, true);
            }
            tc_stage(s_k, pk, ti.kn, DELTA_CHUNK, dk);
        }
        commit_async();
    };
    const auto stage_q = [&](int c) {
        if (c >= 0) {
            tc_stage(s_q, pk, tc_item_at(p, first + static_cast<u64>(c) * p.value_heads).qn, DELTA_CHUNK, dk);
        }
        commit_async();
    };
    float dh[2][2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        tc_zero(dh[mt]);
    }
    // Outstanding at every chunk c's start: W(c), then the small inputs and
    // K of c, then Q(c).
    stage_w(p.chunks - 1);
    stage_small_and_k(p.chunks - 1);
    stage_q(p.chunks - 1);
    for (int c = p.chunks - 1; c >= 0; --c) {
        const u64 item = first + static_cast<u64>(c) * p.value_heads;
        const TcItem ti = tc_item_at(p, item);
        const TcBack bk = tc_back_at(p, item);
        const bf16* s_w = w_buffer(c);
        // The other W buffer was chunk c + 1's, whose last reader passed
        // the barrier that ended it.
        stage_w(c - 1);
        // dH at this chunk's end: for the chunk's gradients and the products.
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int x0 = 32 * warp + 16 * mt;
            if (x0 < dk) {
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int col = 8 * nt + 2 * q;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int x = x0 + g + (e >> 1) * 8;
                        bk.dh[static_cast<u64>(p0 + col + (e & 1)) * dk + x] = __float2bfloat16(dh[mt][nt][e]);
                    }
                    store_pair(s_dh + (x0 + g) * DELTA_COL_PITCH + col, dh[mt][nt][0], dh[mt][nt][1]);
                    store_pair(s_dh + (x0 + g + 8) * DELTA_COL_PITCH + col, dh[mt][nt][2], dh[mt][nt][3]);
                }
            }
        }
        // W(c) and the small inputs and K of c are in (Q(c) and W(c - 1)
        // may still be on their way).
        wait_async<2>();
        __syncthreads();
        // H_0 in bf16 [dk, 16]; gamma_t dO.
        for (int idx = threadIdx.x; idx < DELTA_TC_COLS * dk; idx += DELTA_TC_THREADS) {
            const int col = idx / dk;
            const int x = idx % dk;
            s_h[x * DELTA_COL_PITCH + col] = __float2bfloat16(s_hf[idx]);
        }
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * DELTA_TC_COLS; idx += DELTA_TC_THREADS) {
            const int t = idx / DELTA_TC_COLS;
            const int col = idx % DELTA_TC_COLS;
            const float d = expf(s_gc[t]) * __bfloat162float(s_dor[idx]);
            s_dog[t * DELTA_COL_PITCH + col] = __float2bfloat16(d);
        }
        __syncthreads();
        const int t0 = 16 * warp + g;
        const int t1 = t0 + 8;
        const float g_last = s_gc[DELTA_CHUNK - 1];
        {
            // V' = U - W H_0.
            float acc[2][4];
            tc_zero(acc);
            tc_product<false, false, 2>(acc, s_w, pk, 16 * warp, s_h, DELTA_COL_PITCH, TC_ALL_COLS, 0, DELTA_TC_COLS,
                                        0, dk);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int c8 = 8 * nt + 2 * q;
                const int col = p0 + c8;
                const float2 u0 = load_pair(s_u + t0 * DELTA_TC_COLS + c8);
                const float2 u1 = load_pair(s_u + t1 * DELTA_TC_COLS + c8);
                store_pair(ti.vn + t0 * dv + col, u0.x - acc[nt][0], u0.y - acc[nt][1]);
                store_pair(ti.vn + t1 * dv + col, u1.x - acc[nt][2], u1.y - acc[nt][3]);
            }
        }
        {
            // dV' = M^T dO + exp(G_L - G_s) K dH_L.
            float acc[2][4];
            tc_zero(acc);
            tc_product<false, false, 2>(acc, s_k, pk, 16 * warp, s_dh, DELTA_COL_PITCH, TC_ALL_COLS, 0, DELTA_TC_COLS,
                                        0, dk);
            const float d0 = expf(g_last - s_gc[t0]);
            const float d1 = expf(g_last - s_gc[t1]);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const int c8 = 8 * nt + 2 * q;
                const int col = p0 + c8;
                const float2 l0 = load_pair(s_dvl + t0 * DELTA_TC_COLS + c8);
                const float2 l1 = load_pair(s_dvl + t1 * DELTA_TC_COLS + c8);
                const float v00 = __fmaf_rn(d0, acc[nt][0], l0.x);
                const float v01 = __fmaf_rn(d0, acc[nt][1], l0.y);
                const float v10 = __fmaf_rn(d1, acc[nt][2], l1.x);
                const float v11 = __fmaf_rn(d1, acc[nt][3], l1.y);
                store_pair(bk.dvn + t0 * dv + col, v00, v01);
                store_pair(bk.dvn + t1 * dv + col, v10, v11);
                store_pair(s_ndv + t0 * DELTA_COL_PITCH + c8, -v00, -v01);
                store_pair(s_ndv + t1 * DELTA_COL_PITCH + c8, -v10, -v11);
            }
        }
        // Every reader of the small inputs and K is past this barrier.
        __syncthreads();
        stage_small_and_k(c - 1);
        // Q(c) is in.
        wait_async<2>();
        __syncthreads();
        if (c > 0) {
            // dH_0 = gamma_L dH_L + Q^T (gamma dO) + W^T (-dV').
            const float decay = expf(g_last);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int x0 = 32 * warp + 16 * mt;
                if (x0 < dk) {
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            dh[mt][nt][e] *= decay;
                        }
                    }
                    tc_product<true, false, 2>(dh[mt], s_q, pk, x0, s_dog, DELTA_COL_PITCH, TC_ALL_COLS, 0,
                                               DELTA_TC_COLS, 0, DELTA_CHUNK);
                    tc_product<true, false, 2>(dh[mt], s_w, pk, x0, s_ndv, DELTA_COL_PITCH, TC_ALL_COLS, 0,
                                               DELTA_TC_COLS, 0, DELTA_CHUNK);
                }
            }
        }
        // Every reader of Q and of W(c) is past this barrier.
        __syncthreads();
        stage_q(c - 1);
    }
    wait_async<0>();
}

// ---- a chunk's gradients on tensor cores ------------------------------------------------
// One block an item, 8 warps: warp w the steps t = 16 (w mod 4) .. +15 and
// every other 16-column block of each product's output, from 16 (w / 4)
// (`TcCols`), so two warps share a row block and every product is split
// in two alike; the f32 path's formulas (`delta_backward_chunk`), each
// product an mma over bf16 tiles:
//   dM = dO V'^T, m = (Q K^T) e and kke = (K K^T) e (masked),
//   dQi = dO S_0, dq = gamma dQi + (dM e) K,
//   dW = -dV' S_0, d(beta gamma K) = T^T dW, d(beta V) = T^T dV',
//   dT = beta_s (dV' V^T + gamma_s dW K^T) (s < t), X = T^T dT,
//   dA = -X T^T (s < t), dKd = V' dH_L^T,
//   dk = e^(G_L - G_t) dKd + beta gamma d(beta gamma K) + Z K + Z^T K
//        + (dM e)^T Q with Z = beta_t dA e,
// the per-step sums for beta's and G's gradients in f32 (a row's sum: each
// column half's across a quad of lanes, then the two halves in order;
// column sums a thread a column, each in a fixed order). An element of
// every product and every global dq, dk row is one warp's throughout, so
// the read-modify-writes of dk need no barrier between them.
// Dynamic shared memory (`tc_back_chunk_shared`), bf16 tiles: Q, K, W's
// gradient (pitch dk + 8), V, dO, V', dV' (pitch dv + 8), S_0 then dH_L
// [dv, dk + 8], T, dM e, dT then Z, X (pitch 72); f32: dM m and kke then
// beta dA kke (pitch 65), and the per-step values (the row sums' two
// halves each).
// Why 8 warps: the block holds 226 KiB of shared memory, so one fits an
// SM, and 4 warps leave the SM waiting on each warp's chain of loads and
// mmas (on an H100, 2.25 ms a call at the benchmark's widths with 4, 1.23
// with 8); 8 warps at up to 255 registers fit its register file.
#define DELTA_TC_CHUNK_THREADS 256

// This lane's part of (row g + 8 half of the warp's block of acc) . (row
// `row` of `tile`), over the warp's columns below n_end.
template <int NT>
__device__ __forceinline__ float tc_row_dot(const float (&acc)[NT][4], int half, const bf16* tile, int pitch, int row,
                                            TcCols cols, int n_end) {
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int col = tc_col(cols, nt);
        if (col < n_end) {
            const float2 v = load_pair(tile + row * pitch + col);
            sum = __fmaf_rn(acc[nt][2 * half], v.x, sum);
            sum = __fmaf_rn(acc[nt][2 * half + 1], v.y, sum);
        }
    }
    return sum;
}

extern "C" __global__ void __launch_bounds__(DELTA_TC_CHUNK_THREADS, 1) delta_tc_back_chunk(DeltaParams p) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char delta_shared[];
    const int dk = p.dk;
    const int dv = p.dv;
    const int pk = dk + 8;
    const int pv = dv + 8;
    bf16* s_q = reinterpret_cast<bf16*>(delta_shared);
    bf16* s_k = s_q + 64 * pk;
    bf16* s_v = s_k + 64 * pk;
    bf16* s_do = s_v + 64 * pv;
    bf16* s_vn = s_do + 64 * pv;
    bf16* s_dvn = s_vn + 64 * pv;
    bf16* s_s = s_dvn + 64 * pv;
    bf16* s_dw = s_s + dv * pk;
    bf16* s_t = s_dw + 64 * pk;
    bf16* s_dme = s_t + 64 * DELTA_T_PITCH;
    bf16* s_dt = s_dme + 64 * DELTA_T_PITCH;
    bf16* s_x = s_dt + 64 * DELTA_T_PITCH;
    float* f_dmm = reinterpret_cast<float*>(s_x + 64 * DELTA_T_PITCH);
    float* f_akk = f_dmm + 64 * DELTA_F_PITCH;
    float* s_g = f_akk + 64 * DELTA_F_PITCH;
    float* s_beta = s_g + 64;
    float* s_kdd = s_beta + 64;
    float* s_dg = s_kdd + 64;
    float* s_dbeta = s_dg + 64;
    // The row sums, each column half's: [half][64].
    float* s_qi = s_dbeta + 64;
    float* s_mrow = s_qi + 128;
    float* s_kdd_half = s_mrow + 128;
    float* s_kb = s_kdd_half + 128;
    float* s_vb = s_kb + 128;
    float* s_arow = s_vb + 128;
    float* s_sum = s_arow + 128;
    const int tid = threadIdx.x;
    const u64 item = blockIdx.x;
    const Item it = item_of(p, item);
    const TcItem ti = tc_item_at(p, item);
    const TcBack bk = tc_back_at(p, item);
    const u64 width = qkv_width(p);
    const u64 out_width = static_cast<u64>(p.value_heads) * dv;
    const u64 v_col = 2ull * p.key_heads * dk + static_cast<u64>(it.j) * dv;
    const u64 r0 = row_of(p, it, 0);
    tc_stage(s_q, pk, ti.qn, DELTA_CHUNK, dk);
    tc_stage(s_k, pk, ti.kn, DELTA_CHUNK, dk);
    stage_rows(s_v, pv, reinterpret_cast<const bf16*>(p.qkv) + r0 * width + v_col, width, it.len, DELTA_CHUNK, dv);
    stage_rows(s_do, pv, reinterpret_cast<const bf16*>(p.out) + r0 * out_width + static_cast<u64>(it.j) * dv,
               out_width, it.len, DELTA_CHUNK, dv);
    tc_stage(s_vn, pv, ti.vn, DELTA_CHUNK, dv);
    tc_stage(s_dvn, pv, bk.dvn, DELTA_CHUNK, dv);
    tc_stage(s_t, DELTA_T_PITCH, ti.t, DELTA_CHUNK, DELTA_CHUNK);
    commit_async();
    // S_0 in bf16, and <S_0, dH_L> (G_L's gradient through gamma_L H_0).
    const float4* state = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p.states) + item * dv * dk);
    float hd = 0.0f;
    for (int idx = tid; idx < dv * dk / 4; idx += DELTA_TC_CHUNK_THREADS) {
        const float4 s = state[idx];
        const int col = (4 * idx) / dk;
        const int x = (4 * idx) % dk;
        store_pair(s_s + col * pk + x, s.x, s.y);
        store_pair(s_s + col * pk + x + 2, s.z, s.w);
        const float2 h01 = load_pair(bk.dh + 4 * idx);
        const float2 h23 = load_pair(bk.dh + 4 * idx + 2);
        hd = __fmaf_rn(s.x, h01.x, hd);
        hd = __fmaf_rn(s.y, h01.y, hd);
        hd = __fmaf_rn(s.z, h23.x, hd);
        hd = __fmaf_rn(s.w, h23.y, hd);
    }
    if (tid < DELTA_CHUNK) {
        s_g[tid] = ti.g[tid];
        s_beta[tid] = ti.beta[tid];
    }
    hd = block_sum(hd, s_sum);
    wait_async<0>();
    __syncthreads();
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int q = lane & 3;
    const int rows = warp & 3;
    const int half = warp >> 2;
    const TcCols cols{16 * half, 2};
    const int m0 = 16 * rows;
    const int t0 = m0 + g;
    const int t1 = t0 + 8;
    const int diag = 16 * (rows + 1);
    const float g0 = s_g[t0];
    const float g1 = s_g[t1];
    const float gamma0 = expf(g0);
    const float gamma1 = expf(g1);
    const float g_last = s_g[DELTA_CHUNK - 1];
    const bool live0 = t0 < it.len;
    const bool live1 = t1 < it.len;
    // This warp's slots of the row sums.
    const int h0 = half * 64 + t0;
    const int h1 = half * 64 + t1;
    float* dq_all = dq_rows(p);
    float* dk_all = dk_rows(p);
    const u64 at0 = live0 ? (row_of(p, it, t0) * p.value_heads + it.j) * dk : 0;
    const u64 at1 = live1 ? (row_of(p, it, t1) * p.value_heads + it.j) * dk : 0;
    {
        // The scores m = (Q K^T) e and dM = dO V'^T, s <= t: dM m (for
        // G's gradient) and dM e (for the products).
        float sc[4][4];
        float dm[4][4];
        tc_zero(sc);
        tc_zero(dm);
        tc_product<false, true, 4>(sc, s_q, pk, m0, s_k, pk, cols, 0, diag, 0, dk);
        tc_product<false, true, 4>(dm, s_do, pv, m0, s_vn, pv, cols, 0, diag, 0, dv);
        float mrow0 = 0.0f;
        float mrow1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int col = tc_col(cols, nt);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e < 2 ? t0 : t1;
                const int s = col + (e & 1);
                const bool on = s <= t;
                const float decay = on ? expf((e < 2 ? g0 : g1) - s_g[s]) : 0.0f;
                const float d = on ? dm[nt][e] : 0.0f;
                const float dmm = d * (sc[nt][e] * decay);
                f_dmm[t * DELTA_F_PITCH + s] = dmm;
                if (e < 2) {
                    mrow0 += dmm;
                } else {
                    mrow1 += dmm;
                }
                dm[nt][e] = d * decay;
            }
            store_pair(s_dme + t0 * DELTA_T_PITCH + col, dm[nt][0], dm[nt][1]);
            store_pair(s_dme + t1 * DELTA_T_PITCH + col, dm[nt][2], dm[nt][3]);
        }
        mrow0 = quad_sum(mrow0);
        mrow1 = quad_sum(mrow1);
        if (q == 0) {
            s_mrow[h0] = mrow0;
            s_mrow[h1] = mrow1;
        }
    }
    {
        // kke = (K K^T) e, s < t.
        float kk[4][4];
        tc_zero(kk);
        tc_product<false, true, 4>(kk, s_k, pk, m0, s_k, pk, cols, 0, diag, 0, dk);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e < 2 ? t0 : t1;
                const int s = tc_col(cols, nt) + (e & 1);
                f_akk[t * DELTA_F_PITCH + s] = s < t ? kk[nt][e] * expf((e < 2 ? g0 : g1) - s_g[s]) : 0.0f;
            }
        }
    }
    __syncthreads();
    {
        // dQi = dO S_0; dq = gamma dQi + (dM e) K.
        float acc[8][4];
        tc_zero(acc);
        tc_product<false, false, 8>(acc, s_do, pv, m0, s_s, pk, cols, 0, dk, 0, dv);
        const float qi0 = quad_sum(tc_row_dot(acc, 0, s_q, pk, t0, cols, dk));
        const float qi1 = quad_sum(tc_row_dot(acc, 1, s_q, pk, t1, cols, dk));
        if (q == 0) {
            s_qi[h0] = qi0;
            s_qi[h1] = qi1;
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            acc[nt][0] *= gamma0;
            acc[nt][1] *= gamma0;
            acc[nt][2] *= gamma1;
            acc[nt][3] *= gamma1;
        }
        tc_product<false, false, 8>(acc, s_dme, DELTA_T_PITCH, m0, s_k, pk, cols, 0, dk, 0, diag);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = tc_col(cols, nt);
            if (col < dk) {
                if (live0) {
                    store_pair(dq_all + at0 + col, acc[nt][0], acc[nt][1]);
                }
                if (live1) {
                    store_pair(dq_all + at1 + col, acc[nt][2], acc[nt][3]);
                }
            }
        }
    }
    {
        // dW = -dV' S_0.
        float acc[8][4];
        tc_zero(acc);
        tc_product<false, false, 8>(acc, s_dvn, pv, m0, s_s, pk, cols, 0, dk, 0, dv);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = tc_col(cols, nt);
            if (col < dk) {
                store_pair(s_dw + t0 * pk + col, -acc[nt][0], -acc[nt][1]);
                store_pair(s_dw + t1 * pk + col, -acc[nt][2], -acc[nt][3]);
            }
        }
    }
    __syncthreads();
    // dH_L takes S_0's place (read by the dKd product below).
    tc_stage(s_s, pk, bk.dh, dv, dk);
    commit_async();
    {
        // d(beta gamma K) = T^T dW (T^T is upper triangular): kb, and dk's
        // first term.
        float acc[8][4];
        tc_zero(acc);
        tc_product<true, false, 8>(acc, s_t, DELTA_T_PITCH, m0, s_dw, pk, cols, 0, dk, m0, DELTA_CHUNK);
        const float kb0 = quad_sum(tc_row_dot(acc, 0, s_k, pk, t0, cols, dk));
        const float kb1 = quad_sum(tc_row_dot(acc, 1, s_k, pk, t1, cols, dk));
        if (q == 0) {
            s_kb[h0] = kb0;
            s_kb[h1] = kb1;
        }
        const float c0 = s_beta[t0] * gamma0;
        const float c1 = s_beta[t1] * gamma1;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = tc_col(cols, nt);
            if (col < dk) {
                if (live0) {
                    store_pair(dk_all + at0 + col, c0 * acc[nt][0], c0 * acc[nt][1]);
                }
                if (live1) {
                    store_pair(dk_all + at1 + col, c1 * acc[nt][2], c1 * acc[nt][3]);
                }
            }
        }
    }
    {
        // d(beta V) = T^T dV': vb, and v's gradient beta d(beta V).
        float acc[8][4];
        tc_zero(acc);
        tc_product<true, false, 8>(acc, s_t, DELTA_T_PITCH, m0, s_dvn, pv, cols, 0, dv, m0, DELTA_CHUNK);
        const float vb0 = quad_sum(tc_row_dot(acc, 0, s_v, pv, t0, cols, dv));
        const float vb1 = quad_sum(tc_row_dot(acc, 1, s_v, pv, t1, cols, dv));
        if (q == 0) {
            s_vb[h0] = vb0;
            s_vb[h1] = vb1;
        }
        void* d_qkv = reinterpret_cast<void*>(p.d_qkv);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = tc_col(cols, nt);
            if (col < dv) {
                if (live0) {
                    const u64 at = row_of(p, it, t0) * width + v_col + col;
                    store(d_qkv, p.t_d_qkv, at, s_beta[t0] * acc[nt][0]);
                    store(d_qkv, p.t_d_qkv, at + 1, s_beta[t0] * acc[nt][1]);
                }
                if (live1) {
                    const u64 at = row_of(p, it, t1) * width + v_col + col;
                    store(d_qkv, p.t_d_qkv, at, s_beta[t1] * acc[nt][2]);
                    store(d_qkv, p.t_d_qkv, at + 1, s_beta[t1] * acc[nt][3]);
                }
            }
        }
    }
    {
        // dT = beta_s (dV' V^T + gamma_s dW K^T), s < t.
        float dt[4][4];
        tc_zero(dt);
        tc_product<false, true, 4>(dt, s_dw, pk, m0, s_k, pk, cols, 0, diag, 0, dk);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                dt[nt][e] *= expf(s_g[tc_col(cols, nt) + (e & 1)]);
            }
        }
        tc_product<false, true, 4>(dt, s_dvn, pv, m0, s_v, pv, cols, 0, diag, 0, dv);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int col = tc_col(cols, nt);
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e < 2 ? t0 : t1;
                const int s = col + (e & 1);
                v[e] = s < t ? s_beta[s] * dt[nt][e] : 0.0f;
            }
            store_pair(s_dt + t0 * DELTA_T_PITCH + col, v[0], v[1]);
            store_pair(s_dt + t1 * DELTA_T_PITCH + col, v[2], v[3]);
        }
    }
    wait_async<0>();
    __syncthreads();
    {
        // X = T^T dT.
        float x[4][4];
        tc_zero(x);
        tc_product<true, false, 4>(x, s_t, DELTA_T_PITCH, m0, s_dt, DELTA_T_PITCH, cols, 0, DELTA_CHUNK, m0,
                                          DELTA_CHUNK);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int col = tc_col(cols, nt);
            store_pair(s_x + t0 * DELTA_T_PITCH + col, x[nt][0], x[nt][1]);
            store_pair(s_x + t1 * DELTA_T_PITCH + col, x[nt][2], x[nt][3]);
        }
    }
    {
        // dKd = V' dH_L^T: kdd and dk's decayed-key term.
        float acc[8][4];
        tc_zero(acc);
        tc_product<false, false, 8>(acc, s_vn, pv, m0, s_s, pk, cols, 0, dk, 0, dv);
        const float e0 = expf(g_last - g0);
        const float e1 = expf(g_last - g1);
        const float kdd0 = quad_sum(tc_row_dot(acc, 0, s_k, pk, t0, cols, dk));
        const float kdd1 = quad_sum(tc_row_dot(acc, 1, s_k, pk, t1, cols, dk));
        if (q == 0) {
            s_kdd_half[h0] = kdd0;
            s_kdd_half[h1] = kdd1;
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = tc_col(cols, nt);
            if (col < dk) {
                if (live0) {
                    const float2 was = load_pair(dk_all + at0 + col);
                    store_pair(dk_all + at0 + col, __fmaf_rn(e0, acc[nt][0], was.x), __fmaf_rn(e0, acc[nt][1], was.y));
                }
                if (live1) {
                    const float2 was = load_pair(dk_all + at1 + col);
                    store_pair(dk_all + at1 + col, __fmaf_rn(e1, acc[nt][2], was.x), __fmaf_rn(e1, acc[nt][3], was.y));
                }
            }
        }
    }
    __syncthreads();
    {
        // dA = -X T^T, s < t: a_row; Z = beta_t dA e (over dT's tile);
        // beta_t dA kke (over kke's) for the column sums.
        float da[4][4];
        tc_zero(da);
        tc_product<false, true, 4>(da, s_x, DELTA_T_PITCH, m0, s_t, DELTA_T_PITCH, cols, 0, diag, 0, diag);
        float arow0 = 0.0f;
        float arow1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int col = tc_col(cols, nt);
            float z[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e < 2 ? t0 : t1;
                const int s = col + (e & 1);
                const bool on = s < t;
                const float d = on ? -da[nt][e] : 0.0f;
                const float kke = f_akk[t * DELTA_F_PITCH + s];
                if (e < 2) {
                    arow0 = __fmaf_rn(d, kke, arow0);
                } else {
                    arow1 = __fmaf_rn(d, kke, arow1);
                }
                f_akk[t * DELTA_F_PITCH + s] = d * s_beta[t] * kke;
                z[e] = on ? s_beta[t] * d * expf((e < 2 ? g0 : g1) - s_g[s]) : 0.0f;
            }
            store_pair(s_dt + t0 * DELTA_T_PITCH + col, z[0], z[1]);
            store_pair(s_dt + t1 * DELTA_T_PITCH + col, z[2], z[3]);
        }
        arow0 = quad_sum(arow0);
        arow1 = quad_sum(arow1);
        if (q == 0) {
            s_arow[h0] = arow0;
            s_arow[h1] = arow1;
        }
    }
    __syncthreads();
    {
        // dk += Z K + Z^T K + (dM e)^T Q.
        float acc[8][4];
        tc_zero(acc);
        tc_product<false, false, 8>(acc, s_dt, DELTA_T_PITCH, m0, s_k, pk, cols, 0, dk, 0, diag);
        tc_product<true, false, 8>(acc, s_dt, DELTA_T_PITCH, m0, s_k, pk, cols, 0, dk, m0, DELTA_CHUNK);
        tc_product<true, false, 8>(acc, s_dme, DELTA_T_PITCH, m0, s_q, pk, cols, 0, dk, m0, DELTA_CHUNK);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = tc_col(cols, nt);
            if (col < dk) {
                if (live0) {
                    const float2 was = load_pair(dk_all + at0 + col);
                    store_pair(dk_all + at0 + col, was.x + acc[nt][0], was.y + acc[nt][1]);
                }
                if (live1) {
                    const float2 was = load_pair(dk_all + at1 + col);
                    store_pair(dk_all + at1 + col, was.x + acc[nt][2], was.y + acc[nt][3]);
                }
            }
        }
    }
    // Per step: the row sums' halves added, the column sums (a thread a
    // step, rows in order), then beta's and G's gradients as
    // `delta_backward_chunk` has them.
    if (tid < DELTA_CHUNK) {
        const int t = tid;
        const float qi = s_qi[t] + s_qi[64 + t];
        const float mrow = s_mrow[t] + s_mrow[64 + t];
        const float kb = s_kb[t] + s_kb[64 + t];
        const float vb = s_vb[t] + s_vb[64 + t];
        const float arow = s_arow[t] + s_arow[64 + t];
        const float kdd = expf(g_last - s_g[t]) * (s_kdd_half[t] + s_kdd_half[64 + t]);
        s_kdd[t] = kdd;
        float m_col = 0.0f;
        float a_col = 0.0f;
        for (int s = t; s < DELTA_CHUNK; ++s) {
            m_col += f_dmm[s * DELTA_F_PITCH + t];
        }
        for (int s = t + 1; s < DELTA_CHUNK; ++s) {
            a_col += f_akk[s * DELTA_F_PITCH + t];
        }
        float dbeta = 0.0f;
        float dg = 0.0f;
        if (t < it.len) {
            const float gamma = expf(s_g[t]);
            const float beta = s_beta[t];
            dbeta = vb + gamma * kb + arow;
            dg = gamma * qi + mrow - m_col + beta * gamma * kb + beta * arow - a_col - kdd;
        }
        s_dbeta[t] = dbeta;
        s_dg[t] = dg;
    }
    __syncthreads();
    if (tid == 0) {
        delta_gate_grads(p, it, hd, s_g, s_kdd, s_beta, s_dbeta, s_dg);
    }
}

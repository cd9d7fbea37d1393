// The gated delta rule of `G` layers (`backend::delta`), forward and
// backward, in chunked form: the steps of a sequence are cut into chunks of
// DELTA_CHUNK, and inside a chunk the recurrence
//   S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,  o_t = S_t q_t
// becomes matrix products. Written with the state transposed, H = S^T
// [dk, dv], and G_t the cumulative sum of g from the chunk's start
// (gamma_t = exp(G_t), e_ts = exp(G_t - G_s)):
//   A_ts = beta_t (k_t . k_s) e_ts for s < t (strictly lower), T = (I + A)^-1,
//   W = T (beta gamma K), U = T (beta V)              (the WY / UT transform)
//   V' = U - W H_0                                    (each step's update u_t)
//   o_t = gamma_t H_0^T q_t + sum_{s<=t} (q_t . k_s) e_ts V'_s
//   H_L = gamma_L H_0 + sum_s exp(G_L - G_s) k_s V'_s^T
// That the u_t of the step-by-step form equal V': unrolled, H_t = gamma_t
// H_0 + sum_{s<=t} e_ts k_s u_s^T, so u_t = beta_t (v_t - decayed H^T k_t)
// reads (I + A) U' = beta V - beta gamma K H_0.
//
// Forward: `delta_chunk_prep` (one block a (sequence, chunk, value head),
// every chunk at once) normalises q and k, computes G, A, T, W, U and the
// intra-chunk scores; `delta_forward_states` (one block a (sequence, value
// head, 16 state columns)) walks the chunks in order with the state in
// shared memory, saving each chunk's starting state (the `states` the
// backward reads) and writing o. Backward: the same preparation, then
// `delta_backward_states` walks the chunks in reverse with the state
// gradient, `delta_backward_chunk` turns each chunk's V' and state
// gradients into the gradients of q, k (per value head), v, beta and G,
// and `delta_backward_norm` sums the query and key gradients over a key
// head's value heads (in order) and takes them through the L2 norm;
// `delta_backward_a_log` adds A_log's per-chunk partials in a fixed order.
//
// Everything is f32 (the state, the products, the saved states, the
// scratch); only the inputs and outputs are stored in their own dtype.
// (With bf16 storage and head dims that are multiples of 16, the same
// chunked form runs on tensor cores instead: `delta_tensor_core.cu`. What
// both share, the parameters, the scratch's layout and the gates, is in
// `delta.cuh`.)
// Every sum runs in a fixed order set by the dimensions alone, and no
// float is added with atomics, so equal inputs give equal bits.
#include "delta.cuh"

// ---- 64 x 64 products ---------------------------------------------------------
// acc (entry (t, s) = threadIdx.x + e * DELTA_THREADS as t * 64 + s) += the
// sum over x < width of a(t, x) b(s, x): both operands staged in slices of
// DELTA_SLICE columns (row by row, so the loads run along rows), each slice
// added in order. The rows' reductions run along contiguous memory; read
// straight from global memory, each lane of a warp would read another row.
// `s_a` and `s_b` hold 64 * (DELTA_SLICE + 1) floats each (the pad keeps
// the rows of `s_b` that a warp reads in distinct banks).
#define GRAM_PER_THREAD (DELTA_CHUNK * DELTA_CHUNK / DELTA_THREADS)
template <typename A, typename B>
__device__ __forceinline__ void gram_64(float (&acc)[GRAM_PER_THREAD], int width, A a, B b, float* s_a, float* s_b) {
    constexpr int pitch = DELTA_SLICE + 1;
    for (int x0 = 0; x0 < width; x0 += DELTA_SLICE) {
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * DELTA_SLICE; idx += DELTA_THREADS) {
            const int r = idx / DELTA_SLICE;
            const int x = idx % DELTA_SLICE;
            const bool in = x0 + x < width;
            s_a[r * pitch + x] = in ? a(r, x0 + x) : 0.0f;
            s_b[r * pitch + x] = in ? b(r, x0 + x) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < GRAM_PER_THREAD; ++e) {
            const int idx = threadIdx.x + e * DELTA_THREADS;
            const int t = idx / DELTA_CHUNK;
            const int s = idx % DELTA_CHUNK;
            float v = acc[e];
#pragma unroll
            for (int x = 0; x < DELTA_SLICE; ++x) {
                v = __fmaf_rn(s_a[t * pitch + x], s_b[s * pitch + x], v);
            }
            acc[e] = v;
        }
        __syncthreads();
    }
}

// ---- the chunk's preparation ------------------------------------------------
// One block a (sequence, chunk, value head): the normalised q and k (a warp a
// step), beta, g and its cumulative sum G, then A's entries, T by forward
// substitution (a row at a time), W, U, gamma q, the decayed keys, and the
// masked scores. Steps past the sequence's end are zeros with g = 0 and
// beta = 0: steps that change nothing.
extern "C" __global__ void __launch_bounds__(DELTA_THREADS) delta_chunk_prep(DeltaParams p) {
    grid_dependency_sync();
    __shared__ float s_g[DELTA_CHUNK];
    __shared__ float s_beta[DELTA_CHUNK];
    __shared__ float s_cum[DELTA_CHUNK];
    __shared__ float s_bk[DELTA_CHUNK];
    __shared__ float s_a[DELTA_CHUNK * DELTA_CHUNK];
    __shared__ float s_t[DELTA_CHUNK * DELTA_CHUNK];
    __shared__ float s_slice_a[DELTA_CHUNK * (DELTA_SLICE + 1)];
    __shared__ float s_slice_b[DELTA_CHUNK * (DELTA_SLICE + 1)];
    const u64 item = blockIdx.x;
    const Item it = item_of(p, item);
    const Prep pr = prep_at(p, item);
    const int dk = p.dk;
    const int dv = p.dv;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = DELTA_THREADS / 32;
    const u64 width = qkv_width(p);
    const float a = expf(load(reinterpret_cast<const void*>(p.a_log), p.t_a_log, it.j));
    const float dt_bias = load(reinterpret_cast<const void*>(p.dt_bias), p.t_dt_bias, it.j);
    for (int t = warp; t < DELTA_CHUNK; t += warps) {
        if (t >= it.len) {
            for (int x = lane; x < dk; x += 32) {
                pr.kn[t * dk + x] = 0.0f;
                pr.qn[t * dk + x] = 0.0f;
            }
            if (lane == 0) {
                s_g[t] = 0.0f;
                s_beta[t] = 0.0f;
            }
            continue;
        }
        const u64 r = row_of(p, it, t);
        const void* qkv = reinterpret_cast<const void*>(p.qkv);
        const u64 q_at = r * width + static_cast<u64>(it.i) * dk;
        const u64 k_at = r * width + static_cast<u64>(p.key_heads + it.i) * dk;
        float qq = 0.0f;
        float kk = 0.0f;
        for (int x = lane; x < dk; x += 32) {
            const float q = load(qkv, p.t_qkv, q_at + x);
            const float k = load(qkv, p.t_qkv, k_at + x);
            qq += q * q;
            kk += k * k;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float rq = 1.0f / sqrtf(qq + DELTA_L2_EPS);
        const float rk = 1.0f / sqrtf(kk + DELTA_L2_EPS);
        for (int x = lane; x < dk; x += 32) {
            pr.qn[t * dk + x] = load(qkv, p.t_qkv, q_at + x) * rq * p.scale;
            pr.kn[t * dk + x] = load(qkv, p.t_qkv, k_at + x) * rk;
        }
        if (lane == 0) {
            const u64 at = r * p.value_heads + it.j;
            const float raw = load(reinterpret_cast<const void*>(p.alpha), p.t_alpha, at) + dt_bias;
            s_g[t] = -a * delta_softplus(raw);
            s_beta[t] = delta_sigmoid(load(reinterpret_cast<const void*>(p.beta), p.t_beta, at));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int t = 0; t < DELTA_CHUNK; ++t) {
            sum += s_g[t];
            s_cum[t] = sum;
        }
    }
    __syncthreads();
    if (threadIdx.x < DELTA_CHUNK) {
        const int t = threadIdx.x;
        pr.g[t] = s_cum[t];
        pr.beta[t] = s_beta[t];
        s_bk[t] = s_beta[t] * expf(s_cum[t]);
    }
    // A (in shared memory, for the substitution), K K^T and the scores.
    float kk[GRAM_PER_THREAD];
    float qk[GRAM_PER_THREAD];
#pragma unroll
    for (int e = 0; e < GRAM_PER_THREAD; ++e) {
        kk[e] = 0.0f;
        qk[e] = 0.0f;
    }
    const float* kn = pr.kn;
    const float* qn = pr.qn;
    auto key = [=](int r, int x) { return kn[r * dk + x]; };
    auto query = [=](int r, int x) { return qn[r * dk + x]; };
    gram_64(kk, dk, key, key, s_slice_a, s_slice_b);
    gram_64(qk, dk, query, key, s_slice_a, s_slice_b);
#pragma unroll
    for (int e = 0; e < GRAM_PER_THREAD; ++e) {
        const int idx = threadIdx.x + e * DELTA_THREADS;
        const int t = idx / DELTA_CHUNK;
        const int s = idx % DELTA_CHUNK;
        const float decay = s <= t ? expf(s_cum[t] - s_cum[s]) : 0.0f;
        const float kke = s < t ? kk[e] * decay : 0.0f;
        pr.kke[idx] = kke;
        s_a[idx] = s_beta[t] * kke;
        pr.m[idx] = s <= t ? qk[e] * decay : 0.0f;
    }
    __syncthreads();
    // T = (I + A)^-1, lower triangular with a unit diagonal: row t is
    // e_t - sum_{s<t} A_ts T_s, from the rows before it.
    for (int t = 0; t < DELTA_CHUNK; ++t) {
        if (threadIdx.x < DELTA_CHUNK) {
            const int col = threadIdx.x;
            float v = col == t ? 1.0f : 0.0f;
            for (int s = col; s < t; ++s) {
                v = __fmaf_rn(-s_a[t * DELTA_CHUNK + s], s_t[s * DELTA_CHUNK + col], v);
            }
            s_t[t * DELTA_CHUNK + col] = col <= t ? v : 0.0f;
        }
        __syncthreads();
    }
    for (int idx = threadIdx.x; idx < DELTA_CHUNK * DELTA_CHUNK; idx += DELTA_THREADS) {
        pr.t[idx] = s_t[idx];
    }
    const float g_last = s_cum[DELTA_CHUNK - 1];
    // W = T (beta gamma K), gamma q, the decayed keys.
    for (int idx = threadIdx.x; idx < DELTA_CHUNK * dk; idx += DELTA_THREADS) {
        const int t = idx / dk;
        const int x = idx % dk;
        float w = 0.0f;
        for (int s = 0; s <= t; ++s) {
            const float bk = s_bk[s] * pr.kn[s * dk + x];
            w = __fmaf_rn(s_t[t * DELTA_CHUNK + s], bk, w);
        }
        pr.w[idx] = w;
        pr.qg[idx] = expf(s_cum[t]) * pr.qn[idx];
        pr.kd[idx] = expf(g_last - s_cum[t]) * pr.kn[idx];
    }
    // U = T (beta V).
    const void* qkv = reinterpret_cast<const void*>(p.qkv);
    const u64 v_col = 2ull * p.key_heads * dk + static_cast<u64>(it.j) * dv;
    for (int idx = threadIdx.x; idx < DELTA_CHUNK * dv; idx += DELTA_THREADS) {
        const int t = idx / dv;
        const int c = idx % dv;
        float u = 0.0f;
        const int last = min(t, it.len - 1);
        for (int s = 0; s <= last; ++s) {
            const float bv = s_beta[s] * load(qkv, p.t_qkv, row_of(p, it, s) * width + v_col + c);
            u = __fmaf_rn(s_t[t * DELTA_CHUNK + s], bv, u);
        }
        pr.u[idx] = u;
    }
}

// ---- products with a block of state columns ---------------------------------------
// The state kernels' products, each against DELTA_TILE columns held in
// shared memory (`b`, rows of DELTA_TILE), a thread holding the outputs of
// column `threadIdx.x % DELTA_TILE` and rows `threadIdx.x / DELTA_TILE +
// 16 e`. The other operand comes from global memory, staged in `stage`
// (DELTA_STAGE floats) a slice at a time with loads along its rows, then
// read from shared memory by every column: each slice's terms are added in
// order, so the sums' order is fixed.
#define DELTA_STAGE (DELTA_CHUNK * 33 > 16 * (DELTA_MAX_DK + 1) ? DELTA_CHUNK * 33 : 16 * (DELTA_MAX_DK + 1))
#define DELTA_ROW_STEP (DELTA_THREADS / DELTA_TILE)

// acc[e] += sum_{x < width} a[t * lda + x] b[x][col] for the 64 rows t.
__device__ __forceinline__ void rows_times_tile(float (&acc)[DELTA_CHUNK / DELTA_ROW_STEP], const float* a, int lda,
                                                int width, const float* b, float* stage) {
    const int col = threadIdx.x % DELTA_TILE;
    const int r0 = threadIdx.x / DELTA_TILE;
    for (int x0 = 0; x0 < width; x0 += 32) {
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * 32; idx += DELTA_THREADS) {
            const int r = idx / 32;
            const int x = idx % 32;
            stage[r * 33 + x] = x0 + x < width ? a[r * lda + x0 + x] : 0.0f;
        }
        __syncthreads();
        // Past `width` the slice holds zeros, and `b` has rows to 32 past
        // any slice's start (DELTA_MAX_DK rows for the key width, which is
        // at most that; DELTA_CHUNK for the scores' 64): whole slices,
        // unrolled.
#pragma unroll 8
        for (int x = 0; x < 32; ++x) {
            const float bx = b[(x0 + x) * DELTA_TILE + col];
#pragma unroll
            for (int e = 0; e < DELTA_CHUNK / DELTA_ROW_STEP; ++e) {
                acc[e] = __fmaf_rn(stage[(r0 + DELTA_ROW_STEP * e) * 33 + x], bx, acc[e]);
            }
        }
        __syncthreads();
    }
}

// acc[e] += sum_{s < 64} a[s * lda + x] b[s][col] for the rows x < rows
// (at most DELTA_MAX_DK): a product with `a` transposed.
template <int N>
__device__ __forceinline__ void cols_times_tile(float (&acc)[N], const float* a, int lda, int rows, const float* b,
                                                float* stage) {
    const int col = threadIdx.x % DELTA_TILE;
    const int r0 = threadIdx.x / DELTA_TILE;
    constexpr int pitch = DELTA_MAX_DK + 1;
    for (int s0 = 0; s0 < DELTA_CHUNK; s0 += 16) {
        for (int idx = threadIdx.x; idx < 16 * rows; idx += DELTA_THREADS) {
            const int s = idx / rows;
            const int x = idx % rows;
            stage[s * pitch + x] = a[(s0 + s) * lda + x];
        }
        __syncthreads();
#pragma unroll 4
        for (int s = 0; s < 16; ++s) {
            const float bs = b[(s0 + s) * DELTA_TILE + col];
#pragma unroll
            for (int e = 0; e < N; ++e) {
                const int x = r0 + DELTA_ROW_STEP * e;
                if (x < rows) {
                    acc[e] = __fmaf_rn(stage[s * pitch + x], bs, acc[e]);
                }
            }
        }
        __syncthreads();
    }
}

// ---- the forward's walk over the chunks ---------------------------------------
// One block a (sequence, value head, DELTA_TILE state columns): the state's
// columns H [dk, tile] stay in shared memory from chunk to chunk. Per chunk:
// save H (as S = H^T, the `states` layout), V' = U - W H, o = gamma Q H +
// M V', H = gamma_L H + Kd^T V'.
extern "C" __global__ void __launch_bounds__(DELTA_THREADS) delta_forward_states(DeltaParams p) {
    grid_dependency_sync();
    __shared__ float s_h[DELTA_MAX_DK * DELTA_TILE];
    __shared__ float s_vn[DELTA_CHUNK * DELTA_TILE];
    __shared__ float s_stage[DELTA_STAGE];
    constexpr int ROWS = DELTA_CHUNK / DELTA_ROW_STEP;
    constexpr int KEYS = DELTA_MAX_DK / DELTA_ROW_STEP;
    const int dk = p.dk;
    const int dv = p.dv;
    const int tiles = (dv + DELTA_TILE - 1) / DELTA_TILE;
    const int tile = blockIdx.x % tiles;
    const int j = (blockIdx.x / tiles) % p.value_heads;
    const int b = blockIdx.x / (tiles * p.value_heads);
    const int p0 = tile * DELTA_TILE;
    const int cols = min(DELTA_TILE, dv - p0);
    const int out_width = p.value_heads * dv;
    const int col = threadIdx.x % DELTA_TILE;
    const int r0 = threadIdx.x / DELTA_TILE;
    for (int idx = threadIdx.x; idx < DELTA_MAX_DK * DELTA_TILE; idx += DELTA_THREADS) {
        s_h[idx] = 0.0f;
    }
    __syncthreads();
    for (int c = 0; c < p.chunks; ++c) {
        const u64 item = (static_cast<u64>(b) * p.chunks + c) * p.value_heads + j;
        const Item it = item_of(p, item);
        const Prep pr = prep_at(p, item);
        float* state = reinterpret_cast<float*>(p.states) + item * dv * dk;
        for (int idx = threadIdx.x; idx < cols * dk; idx += DELTA_THREADS) {
            const int cc = idx / dk;
            const int x = idx % dk;
            state[static_cast<u64>(p0 + cc) * dk + x] = s_h[x * DELTA_TILE + cc];
        }
        float wh[ROWS];
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            wh[e] = 0.0f;
        }
        rows_times_tile(wh, pr.w, dk, dk, s_h, s_stage);
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            const int t = r0 + DELTA_ROW_STEP * e;
            s_vn[t * DELTA_TILE + col] = col < cols ? pr.u[t * dv + p0 + col] - wh[e] : 0.0f;
        }
        __syncthreads();
        float o[ROWS];
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            o[e] = 0.0f;
        }
        rows_times_tile(o, pr.qg, dk, dk, s_h, s_stage);
        rows_times_tile(o, pr.m, DELTA_CHUNK, DELTA_CHUNK, s_vn, s_stage);
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            const int t = r0 + DELTA_ROW_STEP * e;
            if (t < it.len && col < cols) {
                const u64 r = row_of(p, it, t);
                store(reinterpret_cast<void*>(p.out), p.t_out, r * out_width + static_cast<u64>(j) * dv + p0 + col, o[e]);
            }
        }
        if (c + 1 == p.chunks) {
            break;
        }
        const float decay = expf(pr.g[DELTA_CHUNK - 1]);
        float next[KEYS];
#pragma unroll
        for (int e = 0; e < KEYS; ++e) {
            next[e] = 0.0f;
        }
        cols_times_tile(next, pr.kd, dk, dk, s_vn, s_stage);
        // Each (row, column) of H is this thread's alone.
#pragma unroll
        for (int e = 0; e < KEYS; ++e) {
            const int x = r0 + DELTA_ROW_STEP * e;
            if (x < dk) {
                s_h[x * DELTA_TILE + col] = __fmaf_rn(decay, s_h[x * DELTA_TILE + col], next[e]);
            }
        }
        __syncthreads();
    }
}

// ---- the backward's reverse walk ---------------------------------------------------
// One block a (sequence, value head, DELTA_TILE columns), the chunks in
// reverse with dH (the gradient of the state at the current chunk's end) in
// shared memory. Per chunk: V' = U - W H_0 again (H_0 the saved state),
// dV' = M^T dO + Kd dH, both kept for `delta_backward_chunk` with dH, then
// dH_0 = gamma_L dH + (gamma Q)^T dO - W^T dV' becomes the previous chunk's.
extern "C" __global__ void __launch_bounds__(DELTA_THREADS) delta_backward_states(DeltaParams p) {
    grid_dependency_sync();
    __shared__ float s_h[DELTA_MAX_DK * DELTA_TILE];
    __shared__ float s_dh[DELTA_MAX_DK * DELTA_TILE];
    __shared__ float s_do[DELTA_CHUNK * DELTA_TILE];
    __shared__ float s_dvn[DELTA_CHUNK * DELTA_TILE];
    __shared__ float s_stage[DELTA_STAGE];
    constexpr int ROWS = DELTA_CHUNK / DELTA_ROW_STEP;
    constexpr int KEYS = DELTA_MAX_DK / DELTA_ROW_STEP;
    const int dk = p.dk;
    const int dv = p.dv;
    const int tiles = (dv + DELTA_TILE - 1) / DELTA_TILE;
    const int tile = blockIdx.x % tiles;
    const int j = (blockIdx.x / tiles) % p.value_heads;
    const int b = blockIdx.x / (tiles * p.value_heads);
    const int p0 = tile * DELTA_TILE;
    const int cols = min(DELTA_TILE, dv - p0);
    const int out_width = p.value_heads * dv;
    const int col = threadIdx.x % DELTA_TILE;
    const int r0 = threadIdx.x / DELTA_TILE;
    for (int idx = threadIdx.x; idx < DELTA_MAX_DK * DELTA_TILE; idx += DELTA_THREADS) {
        s_dh[idx] = 0.0f;
        s_h[idx] = 0.0f;
    }
    __syncthreads();
    for (int c = p.chunks - 1; c >= 0; --c) {
        const u64 item = (static_cast<u64>(b) * p.chunks + c) * p.value_heads + j;
        const Item it = item_of(p, item);
        const Prep pr = prep_at(p, item);
        const Back bk = back_at(p, item);
        const float* state = reinterpret_cast<const float*>(p.states) + item * dv * dk;
        for (int idx = threadIdx.x; idx < cols * dk; idx += DELTA_THREADS) {
            const int cc = idx / dk;
            const int x = idx % dk;
            s_h[x * DELTA_TILE + cc] = state[static_cast<u64>(p0 + cc) * dk + x];
        }
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * DELTA_TILE; idx += DELTA_THREADS) {
            const int t = idx / DELTA_TILE;
            const int cc = idx % DELTA_TILE;
            float d = 0.0f;
            if (t < it.len && cc < cols) {
                const u64 r = row_of(p, it, t);
                d = load(reinterpret_cast<const void*>(p.out), p.t_out, r * out_width + static_cast<u64>(j) * dv + p0 + cc);
            }
            s_do[idx] = d;
        }
        // The state gradient at this chunk's end, for the chunk's own
        // gradients.
        for (int idx = threadIdx.x; idx < cols * dk; idx += DELTA_THREADS) {
            const int cc = idx / dk;
            const int x = idx % dk;
            bk.dh[static_cast<u64>(p0 + cc) * dk + x] = s_dh[x * DELTA_TILE + cc];
        }
        __syncthreads();
        float wh[ROWS];
        float dvn[ROWS];
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            wh[e] = 0.0f;
            dvn[e] = 0.0f;
        }
        rows_times_tile(wh, pr.w, dk, dk, s_h, s_stage);
        cols_times_tile(dvn, pr.m, DELTA_CHUNK, DELTA_CHUNK, s_do, s_stage);
        rows_times_tile(dvn, pr.kd, dk, dk, s_dh, s_stage);
#pragma unroll
        for (int e = 0; e < ROWS; ++e) {
            const int t = r0 + DELTA_ROW_STEP * e;
            if (col < cols) {
                bk.vn[t * dv + p0 + col] = pr.u[t * dv + p0 + col] - wh[e];
                bk.dvn[t * dv + p0 + col] = dvn[e];
            }
            s_dvn[t * DELTA_TILE + col] = col < cols ? dvn[e] : 0.0f;
        }
        __syncthreads();
        if (c == 0) {
            break;
        }
        const float decay = expf(pr.g[DELTA_CHUNK - 1]);
        float from_out[KEYS];
        float from_w[KEYS];
#pragma unroll
        for (int e = 0; e < KEYS; ++e) {
            from_out[e] = 0.0f;
            from_w[e] = 0.0f;
        }
        cols_times_tile(from_out, pr.qg, dk, dk, s_do, s_stage);
        cols_times_tile(from_w, pr.w, dk, dk, s_dvn, s_stage);
#pragma unroll
        for (int e = 0; e < KEYS; ++e) {
            const int x = r0 + DELTA_ROW_STEP * e;
            if (x < dk) {
                const float d = from_out[e] - from_w[e];
                s_dh[x * DELTA_TILE + col] = __fmaf_rn(decay, s_dh[x * DELTA_TILE + col], d);
            }
        }
        __syncthreads();
    }
}

// ---- a chunk's gradients ------------------------------------------------------------
// A block takes items `blockIdx.x, + gridDim.x, ...` with a workspace of its
// own. From dO, V', dV', dH_L and the saved H_0 (S layout: S_0[p][x]):
//   dM = dO V'^T (s <= t), dQi = dO S_0 (the state's part of dq),
//   dKd = V' dH_L^T, dW = -dV' S_0, d(beta V) = T^T dV', d(beta gamma K) = T^T dW,
//   dT = dV' (beta V)^T + dW (beta gamma K)^T (strictly lower),
//   dA = -(T^T dT) T^T (strictly lower),
// then per step the gradients of q, k, v, beta and G, and from G's the
// gates' (g's is the reverse cumulative sum of G's).
extern "C" __global__ void __launch_bounds__(DELTA_THREADS) delta_backward_chunk(DeltaParams p) {
    grid_dependency_sync();
    __shared__ float s_g[DELTA_CHUNK];
    __shared__ float s_beta[DELTA_CHUNK];
    __shared__ float s_dg[DELTA_CHUNK];
    __shared__ float s_dbeta[DELTA_CHUNK];
    __shared__ float s_kd[DELTA_CHUNK];
    __shared__ float s_sum[32];
    __shared__ float s_slice_a[DELTA_CHUNK * (DELTA_SLICE + 1)];
    __shared__ float s_slice_b[DELTA_CHUNK * (DELTA_SLICE + 1)];
    const int dk = p.dk;
    const int dv = p.dv;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = DELTA_THREADS / 32;
    const u64 width = qkv_width(p);
    const int out_width = p.value_heads * dv;
    const Work wk = work_at(p, blockIdx.x);
    const void* qkv = reinterpret_cast<const void*>(p.qkv);
    const void* d_out = reinterpret_cast<const void*>(p.out);
    float* dq_all = dq_rows(p);
    float* dk_all = dk_rows(p);
    for (u64 item = blockIdx.x; item < items_of(p); item += gridDim.x) {
        const Item it = item_of(p, item);
        const Prep pr = prep_at(p, item);
        const Back bk = back_at(p, item);
        const float* s0 = reinterpret_cast<const float*>(p.states) + item * dv * dk;
        const u64 v_col = 2ull * p.key_heads * dk + static_cast<u64>(it.j) * dv;
        const u64 o_col = static_cast<u64>(it.j) * dv;
        if (threadIdx.x < DELTA_CHUNK) {
            s_g[threadIdx.x] = pr.g[threadIdx.x];
            s_beta[threadIdx.x] = pr.beta[threadIdx.x];
        }
        // <S_0, dH_L> (H_0 = S_0^T), for G_L's gradient.
        float hd = 0.0f;
        for (int idx = threadIdx.x; idx < dk * dv; idx += DELTA_THREADS) {
            hd = __fmaf_rn(s0[idx], bk.dh[idx], hd);
        }
        hd = block_sum(hd, s_sum);
        // dM = dO V'^T, masked to s <= t within the chunk; the decays.
        {
            float acc[GRAM_PER_THREAD];
#pragma unroll
            for (int e = 0; e < GRAM_PER_THREAD; ++e) {
                acc[e] = 0.0f;
            }
            const int len = it.len;
            const Item at_item = it;
            const int t_out = p.t_out;
            const float* vn = bk.vn;
            auto grad_out = [=](int t, int c) {
                return t < len ? load(d_out, t_out, row_of(p, at_item, t) * out_width + o_col + c) : 0.0f;
            };
            auto update = [=](int s, int c) { return vn[s * dv + c]; };
            gram_64(acc, dv, grad_out, update, s_slice_a, s_slice_b);
#pragma unroll
            for (int e = 0; e < GRAM_PER_THREAD; ++e) {
                const int idx = threadIdx.x + e * DELTA_THREADS;
                const int t = idx / DELTA_CHUNK;
                const int s = idx % DELTA_CHUNK;
                wk.dm[idx] = s <= t ? acc[e] : 0.0f;
                wk.e[idx] = s <= t ? expf(s_g[t] - s_g[s]) : 0.0f;
            }
        }
        // dQi, dKd, dW: [64, dk] each.
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * dk; idx += DELTA_THREADS) {
            const int t = idx / dk;
            const int x = idx % dk;
            float qi = 0.0f;
            float kd = 0.0f;
            float w = 0.0f;
            const bool live = t < it.len;
            const u64 at = live ? row_of(p, it, t) * out_width + o_col : 0;
            for (int c = 0; c < dv; ++c) {
                const float s = s0[static_cast<u64>(c) * dk + x];
                if (live) {
                    qi = __fmaf_rn(load(d_out, p.t_out, at + c), s, qi);
                }
                kd = __fmaf_rn(bk.vn[t * dv + c], bk.dh[static_cast<u64>(c) * dk + x], kd);
                w = __fmaf_rn(-bk.dvn[t * dv + c], s, w);
            }
            wk.dqi[idx] = qi;
            wk.dkd[idx] = kd;
            wk.dw[idx] = w;
        }
        // d(beta V) = T^T dV'.
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * dv; idx += DELTA_THREADS) {
            const int t = idx / dv;
            const int c = idx % dv;
            float d = 0.0f;
            for (int s = t; s < DELTA_CHUNK; ++s) {
                d = __fmaf_rn(pr.t[s * DELTA_CHUNK + t], bk.dvn[s * dv + c], d);
            }
            wk.dbv[idx] = d;
        }
        __syncthreads();
        // d(beta gamma K) = T^T dW; dT (strictly lower).
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * dk; idx += DELTA_THREADS) {
            const int t = idx / dk;
            const int x = idx % dk;
            float d = 0.0f;
            for (int s = t; s < DELTA_CHUNK; ++s) {
                d = __fmaf_rn(pr.t[s * DELTA_CHUNK + t], wk.dw[s * dk + x], d);
            }
            wk.dbk[idx] = d;
        }
        {
            float dvv[GRAM_PER_THREAD];
            float dkk[GRAM_PER_THREAD];
#pragma unroll
            for (int e = 0; e < GRAM_PER_THREAD; ++e) {
                dvv[e] = 0.0f;
                dkk[e] = 0.0f;
            }
            const int len = it.len;
            const Item at_item = it;
            const int t_qkv = p.t_qkv;
            const float* dvn = bk.dvn;
            const float* dw = wk.dw;
            const float* kn = pr.kn;
            auto update_grad = [=](int t, int c) { return dvn[t * dv + c]; };
            auto value = [=](int s, int c) {
                return s < len ? load(qkv, t_qkv, row_of(p, at_item, s) * width + v_col + c) : 0.0f;
            };
            auto w_grad = [=](int t, int x) { return dw[t * dk + x]; };
            auto key = [=](int s, int x) { return kn[s * dk + x]; };
            gram_64(dvv, dv, update_grad, value, s_slice_a, s_slice_b);
            gram_64(dkk, dk, w_grad, key, s_slice_a, s_slice_b);
#pragma unroll
            for (int e = 0; e < GRAM_PER_THREAD; ++e) {
                const int idx = threadIdx.x + e * DELTA_THREADS;
                const int t = idx / DELTA_CHUNK;
                const int s = idx % DELTA_CHUNK;
                const bool live = s < t && s < len;
                wk.dt[idx] = live ? s_beta[s] * dvv[e] + s_beta[s] * expf(s_g[s]) * dkk[e] : 0.0f;
            }
        }
        __syncthreads();
        // X = T^T dT.
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * DELTA_CHUNK; idx += DELTA_THREADS) {
            const int t = idx / DELTA_CHUNK;
            const int s = idx % DELTA_CHUNK;
            float d = 0.0f;
            for (int a = max(t, s + 1); a < DELTA_CHUNK; ++a) {
                d = __fmaf_rn(pr.t[a * DELTA_CHUNK + t], wk.dt[a * DELTA_CHUNK + s], d);
            }
            wk.x[idx] = d;
        }
        __syncthreads();
        // dA = -X T^T, strictly lower.
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * DELTA_CHUNK; idx += DELTA_THREADS) {
            const int t = idx / DELTA_CHUNK;
            const int s = idx % DELTA_CHUNK;
            float d = 0.0f;
            if (s < t) {
                for (int b = 0; b <= s; ++b) {
                    d = __fmaf_rn(-wk.x[t * DELTA_CHUNK + b], pr.t[s * DELTA_CHUNK + b], d);
                }
            }
            wk.da[idx] = d;
        }
        __syncthreads();
        // Per step (a warp a step): beta's and G's gradients, and v's.
        for (int t = warp; t < DELTA_CHUNK; t += warps) {
            float dbeta = 0.0f;
            float dg = 0.0f;
            float kd = 0.0f;
            if (t < it.len) {
                const float gamma = expf(s_g[t]);
                float qi = 0.0f;
                float kb = 0.0f;
                float kdd = 0.0f;
                for (int x = lane; x < dk; x += 32) {
                    qi = __fmaf_rn(wk.dqi[t * dk + x], pr.qn[t * dk + x], qi);
                    kb = __fmaf_rn(pr.kn[t * dk + x], wk.dbk[t * dk + x], kb);
                    kdd = __fmaf_rn(pr.kd[t * dk + x], wk.dkd[t * dk + x], kdd);
                }
                float vb = 0.0f;
                const u64 v_at = row_of(p, it, t) * width + v_col;
                for (int c = lane; c < dv; c += 32) {
                    const float dbv = wk.dbv[t * dv + c];
                    vb = __fmaf_rn(load(qkv, p.t_qkv, v_at + c), dbv, vb);
                    store(reinterpret_cast<void*>(p.d_qkv), p.t_d_qkv, v_at + c, s_beta[t] * dbv);
                }
                // The scores' and A's entries of row t (as the later step)
                // and column t (as the earlier one).
                float m_row = 0.0f;
                float a_row = 0.0f;
                float m_col = 0.0f;
                float a_col = 0.0f;
                for (int s = lane; s < DELTA_CHUNK; s += 32) {
                    if (s <= t) {
                        m_row = __fmaf_rn(wk.dm[t * DELTA_CHUNK + s], pr.m[t * DELTA_CHUNK + s], m_row);
                        a_row = __fmaf_rn(wk.da[t * DELTA_CHUNK + s], pr.kke[t * DELTA_CHUNK + s], a_row);
                    }
                    if (s >= t) {
                        m_col = __fmaf_rn(wk.dm[s * DELTA_CHUNK + t], pr.m[s * DELTA_CHUNK + t], m_col);
                        a_col = __fmaf_rn(wk.da[s * DELTA_CHUNK + t] * s_beta[s], pr.kke[s * DELTA_CHUNK + t], a_col);
                    }
                }
                qi = warp_sum(qi);
                kb = warp_sum(kb);
                kdd = warp_sum(kdd);
                vb = warp_sum(vb);
                m_row = warp_sum(m_row);
                a_row = warp_sum(a_row);
                m_col = warp_sum(m_col);
                a_col = warp_sum(a_col);
                dbeta = vb + gamma * kb + a_row;
                dg = gamma * qi + m_row - m_col + s_beta[t] * gamma * kb + s_beta[t] * a_row - a_col - kdd;
                kd = kdd;
            }
            if (lane == 0) {
                s_dbeta[t] = dbeta;
                s_dg[t] = dg;
                s_kd[t] = kd;
            }
        }
        // The normalised q's and k's gradients of this value head.
        for (int idx = threadIdx.x; idx < DELTA_CHUNK * dk; idx += DELTA_THREADS) {
            const int t = idx / dk;
            const int x = idx % dk;
            if (t >= it.len) {
                continue;
            }
            const float gt = s_g[t];
            float dq = expf(gt) * wk.dqi[idx];
            float dkx = expf(s_g[it.len - 1] - gt) * wk.dkd[idx];
            dkx = __fmaf_rn(s_beta[t] * expf(gt), wk.dbk[idx], dkx);
            for (int s = 0; s <= t; ++s) {
                const float e = wk.e[t * DELTA_CHUNK + s];
                dq = __fmaf_rn(wk.dm[t * DELTA_CHUNK + s] * e, pr.kn[s * dk + x], dq);
                if (s < t) {
                    dkx = __fmaf_rn(s_beta[t] * wk.da[t * DELTA_CHUNK + s] * e, pr.kn[s * dk + x], dkx);
                }
            }
            for (int s = t; s < it.len; ++s) {
                const float e = wk.e[s * DELTA_CHUNK + t];
                dkx = __fmaf_rn(wk.dm[s * DELTA_CHUNK + t] * e, pr.qn[s * dk + x], dkx);
                if (s > t) {
                    dkx = __fmaf_rn(s_beta[s] * wk.da[s * DELTA_CHUNK + t] * e, pr.kn[s * dk + x], dkx);
                }
            }
            const u64 at = (row_of(p, it, t) * p.value_heads + it.j) * dk + x;
            dq_all[at] = dq;
            dk_all[at] = dkx;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            delta_gate_grads(p, it, hd, s_g, s_kd, s_beta, s_dbeta, s_dg);
        }
        __syncthreads();
    }
}

// ---- through the L2 norms ---------------------------------------------------------
// A warp a (row, key head): the normalised q's and k's gradients summed over
// the key head's value heads in order, then y = x r (times the scale for q):
// dx = r (s dy - y (y . s dy)) with y = x r, as the CPU reference. A lane
// keeps its channels (x = lane + 32 m, m < DELTA_NORM_SLOTS) of x and of the
// summed gradient in registers, and both tensors' loads are issued before
// the first sum waits on them: one pass over memory, not three dependent
// ones, so the warps wait once a row.
#define DELTA_NORM_SLOTS (DELTA_MAX_DK / 32)
extern "C" __global__ void __launch_bounds__(DELTA_THREADS) delta_backward_norm(DeltaParams p) {
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const u64 pair = static_cast<u64>(blockIdx.x) * (DELTA_THREADS / 32) + (threadIdx.x >> 5);
    const u64 rows = static_cast<u64>(p.batch) * p.seq;
    if (pair >= rows * p.key_heads) {
        return;
    }
    const u64 r = pair / p.key_heads;
    const int i = static_cast<int>(pair % p.key_heads);
    const int dk = p.dk;
    const int per_key = p.value_heads / p.key_heads;
    const u64 width = qkv_width(p);
    const void* qkv = reinterpret_cast<const void*>(p.qkv);
    float xs[2][DELTA_NORM_SLOTS];
    float dys[2][DELTA_NORM_SLOTS];
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const float* grads = which == 0 ? dq_rows(p) : dk_rows(p);
        const u64 at = r * width + static_cast<u64>(which * p.key_heads + i) * dk;
#pragma unroll
        for (int m = 0; m < DELTA_NORM_SLOTS; ++m) {
            const int x = lane + 32 * m;
            float dy = 0.0f;
            float v = 0.0f;
            if (x < dk) {
                v = load(qkv, p.t_qkv, at + x);
                for (int j = i * per_key; j < (i + 1) * per_key; ++j) {
                    dy += grads[(r * p.value_heads + j) * dk + x];
                }
            }
            xs[which][m] = v;
            dys[which][m] = dy;
        }
    }
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const float s = which == 0 ? p.scale : 1.0f;
        const u64 at = r * width + static_cast<u64>(which * p.key_heads + i) * dk;
        float ss = 0.0f;
#pragma unroll
        for (int m = 0; m < DELTA_NORM_SLOTS; ++m) {
            ss += xs[which][m] * xs[which][m];
        }
        const float rstd = 1.0f / sqrtf(warp_sum(ss) + DELTA_L2_EPS);
        float y_dy = 0.0f;
#pragma unroll
        for (int m = 0; m < DELTA_NORM_SLOTS; ++m) {
            if (lane + 32 * m < dk) {
                y_dy += xs[which][m] * rstd * (dys[which][m] * s);
            }
        }
        y_dy = warp_sum(y_dy);
#pragma unroll
        for (int m = 0; m < DELTA_NORM_SLOTS; ++m) {
            const int x = lane + 32 * m;
            if (x < dk) {
                const float xv = xs[which][m];
                store(reinterpret_cast<void*>(p.d_qkv), p.t_d_qkv, at + x,
                      rstd * (dys[which][m] * s - xv * rstd * y_dy));
            }
        }
    }
}

// A_log's gradient: a thread a value head adds its (sequence, chunk)
// partials in order, then onto what `d_a_log` holds.
extern "C" __global__ void __launch_bounds__(DELTA_THREADS) delta_backward_a_log(DeltaParams p) {
    grid_dependency_sync();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= p.value_heads) {
        return;
    }
    const float* parts = a_log_parts(p);
    double sum = 0.0;
    for (int b = 0; b < p.batch; ++b) {
        for (int c = 0; c < p.chunks; ++c) {
            sum += parts[(static_cast<u64>(b) * p.value_heads + j) * p.chunks + c];
        }
    }
    void* d = reinterpret_cast<void*>(p.d_a_log);
    store(d, p.t_d_a_log, j, load(d, p.t_d_a_log, j) + static_cast<float>(sum));
}

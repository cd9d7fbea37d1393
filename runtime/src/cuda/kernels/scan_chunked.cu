// The Mamba-2 scan in chunked form (`ssd_scan_forward` and
// `ssd_scan_backward` when the backend's scratch cap allows it;
// `cuda::launch::scan_chunked`): the chunk's recurrence written as matrix
// products, which cuBLAS computes on f32 operands, and these kernels for
// what lies between the products.
//
// Per sequence b, head h (group g = h / J, J heads a group) and chunk c of
// Q steps t (the last chunk padded with steps of dt = 0 and x = B = C =
// dy = 0, which change nothing), with the log-decay l_t = dt_t A and its
// running sum Lam_t = sum_{u <= t} l_u inside the chunk, the forward is
//   Y     = M X + diag(e^Lam) C S_in^T (+ D X),   M_ts = (C_t . B_s) e^(Lam_t - Lam_s) dt_s, s <= t
//   S_out = e^Lam_last S_in + X^T diag(w) B,       w_s  = e^(Lam_last - Lam_s) dt_s
// with S_in the state entering the chunk (`states[c]`, saved by the
// forward) and S_out the one leaving it (`states[c + 1]`). The forward
// computes every chunk's own X^T diag(w) B, passes the states along the
// chunks (`ssd_scan_state_combine`), then Y. Given dY and
// the state gradient K leaving the chunk (the carry from the later chunks;
// 0 after the last), the backward is
//   dX   = M^T dY + diag(w) B K^T + D dY
//   dB   = dCB^T C + sum_heads diag(w) X K         dCB_ts = sum_heads dM_ts e^(Lam_t - Lam_s) dt_s
//   dC   = dCB B   + sum_heads diag(e^Lam) dY S_in dM     = dY X^T
//   dS_in = e^Lam_last K + dY^T diag(e^Lam) C      (the carry into the chunk before)
// and the log-decays' gradient, with R = dM o M,
//   dLam_t = sum_s R_ts - sum_t' R_t't + e^Lam_t dY_t . (S_in C_t) - w_t x_t . (K B_t)
//            + [t = last] <K, S_out>
//   dl_t   = sum_{t' >= t} dLam_t'
//   d dt_t = A dl_t + sum_t' dM_t't (C_t' . B_t) e^(Lam_t' - Lam_t) + e^(Lam_last - Lam_t) x_t . (K B_t)
//   dA     = sum_t dt_t dl_t.
// The launcher works on a slice of (sequence, chunk) items at a time; the
// scratch of a slice is laid out per item with the group's heads side by
// side (`[item, G, Q, J * P]`, an `xbc` row's order) so that one strided
// batch of GEMMs covers every (item, group), one call a head of the group.
//
// Determinism: no atomics; every sum has a fixed order (warp butterflies,
// sequential loops), and cuBLAS is deterministic for a given handle.
#include "common.cuh"
#include "wgmma.cuh"

// The longest chunk the chunked path takes (the final kernel keeps a
// chunk's per-step values in shared memory): `CHUNKED_MAX_CHUNK` in
// `cuda::launch::scan_chunked`.
#define CHUNKED_MAX_CHUNK 1024

// Chunks whose states `ssd_scan_state_combine` loads before it updates them:
// 16, a 4,096-token sequence's chunks of 256 in one run of loads.
#define COMBINE_RUN 16

__device__ __forceinline__ float chunk_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float chunk_softplus_derivative(float x) {
    return x > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-x));
}

// The GEMMs' operands are stored as `T`: f32 where an output of the call is
// f32 (strict f32 products, as the CPU), bf16 where every output is bf16
// (tensor-core products on bf16 operands with f32 accumulation, as
// mamba_ssm computes them). x, dY, B and C are bf16 inputs, so their bf16
// operands are exact; w x, e^Lam dY, M, dCB and the states round once.

__device__ __forceinline__ void put(float* p, u64 i, float v) {
    p[i] = v;
}
__device__ __forceinline__ void put(bf16* p, u64 i, float v) {
    p[i] = __float2bfloat16_rn(v);
}

// Quad k (elements 4k..4k+3) of an operand array: one 16-byte store in
// f32, one 8-byte store in bf16.
__device__ __forceinline__ void put4(float* p, u32 k, const float (&v)[4]) {
    reinterpret_cast<float4*>(p)[k] = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void put4(bf16* p, u32 k, const float (&v)[4]) {
    reinterpret_cast<uint2*>(p)[k] = pack4(v[0], v[1], v[2], v[3]);
}

// Quad k of an operand array (f32, or bf16 where the operands are) as four
// floats: one 16-byte load in f32, one 8-byte load in bf16.
__device__ __forceinline__ void load4(const void* p, int dtype, u32 k, float (&v)[4]) {
    if (dtype == DTYPE_BF16) {
        const uint2 w = static_cast<const uint2*>(p)[k];
        const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&w.x);
        const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&w.y);
        v[0] = __low2float(lo);
        v[1] = __high2float(lo);
        v[2] = __low2float(hi);
        v[3] = __high2float(hi);
    } else {
        const float4 f = static_cast<const float4*>(p)[k];
        v[0] = f.x;
        v[1] = f.y;
        v[2] = f.z;
        v[3] = f.w;
    }
}

// What every kernel needs to place a slice's item i: its sequence, chunk
// and first row, and the problem's shape.
struct ChunkShape {
    u64 seq, heads, head_dim, groups, state, chunk, chunks;
    __device__ u64 group_heads() const { return heads / groups; }
    __device__ u64 group_width() const { return group_heads() * head_dim; }
    __device__ u64 d_inner() const { return heads * head_dim; }
    __device__ u64 width() const { return d_inner() + 2 * groups * state; }
};

// Where element k of a slice's `[item, G, Q, N]` array (B, C, dB, dC)
// lies in `xbc`: the index of its B entry (its C entry is G N further),
// and whether its step is real (not padding past the sequence's end).
struct NarrowAt {
    bool real;
    u64 b_column;
};

__device__ __forceinline__ NarrowAt narrow_at(const ChunkShape& s, u64 k, u64 first_item) {
    const u64 col = k % s.state;
    const u64 t = (k / s.state) % s.chunk;
    const u64 g = (k / (s.state * s.chunk)) % s.groups;
    const u64 item = first_item + k / (s.state * s.chunk * s.groups);
    const u64 t_abs = (item % s.chunks) * s.chunk + t;
    const u64 row = (item / s.chunks) * s.seq + t_abs;
    return NarrowAt{t_abs < s.seq, row * s.width() + s.d_inner() + g * s.state + col};
}

// Where element k of a slice's `[item, G, Q, J * P]` array (x, dY, ...)
// lies: its step's row among all sequences' rows, its column among the
// `H * P` of a row (y's and dY's column; x's in `xbc`), its step value's
// index (`[item, H, Q]`) and head, and whether the step is real.
struct WideAt {
    bool real;
    u64 row, column, step, head;
};

__device__ __forceinline__ WideAt wide_at(const ChunkShape& s, u64 k, u64 first_item) {
    const u64 jp = s.group_width();
    const u64 e = k % jp;
    const u64 t = (k / jp) % s.chunk;
    const u64 g = (k / (jp * s.chunk)) % s.groups;
    const u64 i = k / (jp * s.chunk * s.groups);
    const u64 item = first_item + i;
    const u64 t_abs = (item % s.chunks) * s.chunk + t;
    const u64 head = g * s.group_heads() + e / s.head_dim;
    return WideAt{t_abs < s.seq, (item / s.chunks) * s.seq + t_abs, g * jp + e,
                  (i * s.heads + head) * s.chunk + t, head};
}

__device__ __forceinline__ ChunkShape chunk_shape(
    u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    return ChunkShape{seq, heads, head_dim, groups, state, chunk, (seq + chunk - 1) / chunk};
}

// The per-step values of a slice, each `[item, H, Q]`: dt, Lam, e^Lam, w,
// and the row sums of R, the column sums of dM o CB o e^(Lam_t - Lam_s)
// (R's column sums without dt) and dY_t . (S_in C_t).
struct StepValues {
    float *dt, *lam, *elam, *w, *row_r, *col_v, *y_dot;
};

__device__ __forceinline__ StepValues step_values(float* base, u64 items, u64 heads, u64 chunk) {
    const u64 n = items * heads * chunk;
    return StepValues{base, base + n, base + 2 * n, base + 3 * n,
                      base + 4 * n, base + 5 * n, base + 6 * n};
}

// dt, Lam, e^Lam and w of every (item, head, step), and each chunk's total
// decay e^Lam_last into `chunk_decay` (`[batch * chunks, H]`, indexed by
// the global item). One block per (item, head): the steps' dt in parallel,
// their running sum by one thread (a fixed order), then e^Lam and w in
// parallel.
extern "C" __global__ void __launch_bounds__(256) ssd_chunk_factors(
    const void* dt_raw, int dt_dtype, const void* dt_bias, int bias_dtype, const void* a_log,
    int a_dtype, float* values, float* chunk_decay, u64 first_item, u64 items, u64 seq, u64 heads,
    u64 chunk) {
    grid_dependency_sync();
    __shared__ float lam[CHUNKED_MAX_CHUNK];
    const u64 chunks = (seq + chunk - 1) / chunk;
    const StepValues v = step_values(values, items, heads, chunk);
    const u64 k = blockIdx.x;  // local item * heads + h
    const u64 h = k % heads;
    const u64 item = first_item + k / heads;
    const u64 b = item / chunks;
    const u64 t0 = (item % chunks) * chunk;
    const float a = -expf(load(a_log, a_dtype, h));
    const float bias = load(dt_bias, bias_dtype, h);
    const u64 base = k * chunk;
    for (u64 t = threadIdx.x; t < chunk; t += blockDim.x) {
        float dt = 0.0f;
        if (t0 + t < seq) {
            dt = chunk_softplus(load(dt_raw, dt_dtype, (b * seq + t0 + t) * heads + h) + bias);
        }
        v.dt[base + t] = dt;
        lam[t] = dt * a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float running = 0.0f;
        for (u64 t = 0; t < chunk; ++t) {
            running += lam[t];
            lam[t] = running;
        }
        chunk_decay[item * heads + h] = expf(running);
    }
    __syncthreads();
    const float last = lam[chunk - 1];
    for (u64 t = threadIdx.x; t < chunk; t += blockDim.x) {
        v.lam[base + t] = lam[t];
        v.elam[base + t] = expf(lam[t]);
        v.w[base + t] = expf(last - lam[t]) * v.dt[base + t];
    }
}

// The slice's operands, zero past the sequence's end, as the GEMMs'
// operands (`T`): w x, e^Lam dY, B and C, and x and dY themselves, which
// the per-step kernels read too: in f32 `x_p` and `dy_p` (`x_o`, `dy_o`
// null), in bf16 `x_o` and `dy_o` (`x_p`, `dy_p` null: x and dY are bf16
// inputs, so their bf16 copies are exact, and an f32 copy would double
// this kernel's writes for nothing). Wide arrays are `[item, G, Q, J * P]`,
// B and C `[item, G, Q, N]`; the forward passes no dy, and gets no dY or
// e^Lam dY.
template <typename T>
__device__ __forceinline__ void chunk_pack(
    const void* xbc, int xbc_dtype, const void* dy, int dy_dtype, const float* values, float* x_p,
    float* dy_p, T* dy_e, T* x_w, T* b_p, T* c_p, T* x_o, T* dy_o, u64 first_item, u64 items,
    u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    // One block per (item, group, step) row, its threads over the row's
    // columns: the row's place is decoded once, not per element (64-bit
    // divisions per element held this kernel at a quarter of the memory's
    // bandwidth).
    const ChunkShape s = chunk_shape(seq, heads, head_dim, groups, state, chunk);
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u64 jp = s.group_width();
    const u64 rows = items * groups * chunk;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const WideAt at = wide_at(s, r * jp, first_item);
        for (u64 e = threadIdx.x; e < jp; e += blockDim.x) {
            const u64 k = r * jp + e;
            // Element e of the row is head `at.head + e / P`'s.
            const u64 step = at.step + (e / head_dim) * chunk;
            float x = 0.0f, g_y = 0.0f;
            if (at.real) {
                x = load(xbc, xbc_dtype, at.row * s.width() + at.column + e);
                if (dy != nullptr) {
                    g_y = load(dy, dy_dtype, at.row * s.d_inner() + at.column + e);
                }
            }
            if (x_p != nullptr) {
                x_p[k] = x;
            }
            put(x_w, k, x * v.w[step]);
            if (x_o != nullptr) {
                put(x_o, k, x);
            }
            if (dy != nullptr) {
                if (dy_p != nullptr) {
                    dy_p[k] = g_y;
                }
                put(dy_e, k, g_y * v.elam[step]);
                if (dy_o != nullptr) {
                    put(dy_o, k, g_y);
                }
            }
        }
        const NarrowAt nat = narrow_at(s, r * state, first_item);
        for (u64 col = threadIdx.x; col < state; col += blockDim.x) {
            const u64 k = r * state + col;
            put(b_p, k, nat.real ? load(xbc, xbc_dtype, nat.b_column + col) : 0.0f);
            put(c_p, k, nat.real ? load(xbc, xbc_dtype, nat.b_column + col + groups * state) : 0.0f);
        }
    }
}

#define CHUNK_PACK(NAME, T)                                                                         \
    extern "C" __global__ void NAME(const void* xbc, int xbc_dtype, const void* dy, int dy_dtype,   \
                                    const float* values, float* x_p, float* dy_p, T* dy_e, T* x_w, \
                                    T* b_p, T* c_p, T* x_o, T* dy_o, u64 first_item, u64 items,     \
                                    u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state,        \
                                    u64 chunk) {                                                     \
        grid_dependency_sync();                                                                      \
        chunk_pack<T>(xbc, xbc_dtype, dy, dy_dtype, values, x_p, dy_p, dy_e, x_w, b_p, c_p, x_o,   \
                      dy_o, first_item, items, seq, heads, head_dim, groups, state, chunk);         \
    }
CHUNK_PACK(ssd_chunk_pack, float)
CHUNK_PACK(ssd_chunk_pack_bf16, bf16)

// ---- 4 elements a thread ----------------------------------------------------------
// The `_quads` kernels compute what the kernels of the same name compute,
// with the same expressions (so the same bits), a thread per 4 consecutive
// elements of a row (16-byte loads and stores of the f32 scratch) and
// 32-bit index arithmetic: 64-bit divisions per element were most of
// those kernels' time. The launcher takes them where a slice's arrays fit
// 32-bit indices, every scratch view is 16-byte aligned, and P, N and Q
// are multiples of 4 (so a quad never straddles two heads or two rows).

// Quad k of a slice's `[item, G, Q, width]` array (width J P or N): its
// first column, its (item, group, step) row, and where that row lies.
struct QuadAt {
    u32 column;  // of the row's `width`
    u32 row;     // (i * G + g) * Q + t
    u32 t, g, i;
    bool real;
    u64 source_row;  // among all sequences' rows, when real
};

__device__ __forceinline__ QuadAt quad_at(
    u32 k, u32 width, u32 first_item, u32 seq, u32 groups, u32 chunk, u32 chunks) {
    QuadAt q;
    const u32 per_row = width / 4;
    q.column = (k % per_row) * 4;
    q.row = k / per_row;
    q.t = q.row % chunk;
    const u32 ig = q.row / chunk;
    q.g = ig % groups;
    q.i = ig / groups;
    const u32 item = first_item + q.i;
    const u32 t_abs = (item % chunks) * chunk + q.t;
    q.real = t_abs < seq;
    q.source_row = static_cast<u64>(item / chunks) * seq + t_abs;
    return q;
}

// `ssd_chunk_pack` a quad a thread: the wide arrays' quads first, then the
// narrow ones.
template <typename T>
__device__ __forceinline__ void chunk_pack_quads(
    const void* xbc, int xbc_dtype, const void* dy, int dy_dtype, const float* values, float4* x_p,
    float4* dy_p, T* dy_e, T* x_w, T* b_p, T* c_p, T* x_o, T* dy_o, u32 first_item, u32 items,
    u32 seq, u32 heads, u32 head_dim, u32 groups, u32 state, u32 chunk) {
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u32 chunks = (seq + chunk - 1) / chunk;
    const u32 jp = heads / groups * head_dim;
    const u64 d_inner = static_cast<u64>(heads) * head_dim;
    const u64 width = d_inner + 2ull * groups * state;
    const u32 wide = items * groups * chunk * (jp / 4);
    const u32 narrow = items * groups * chunk * (state / 4);
    for (u32 k = static_cast<u32>(grid_start()); k < wide + narrow;
         k += static_cast<u32>(grid_stride())) {
        if (k < wide) {
            const QuadAt q = quad_at(k, jp, first_item, seq, groups, chunk, chunks);
            const u32 head = q.g * (heads / groups) + q.column / head_dim;
            const u32 step = (q.i * heads + head) * chunk + q.t;
            const u64 col = static_cast<u64>(q.g) * jp + q.column;
            float x[4] = {0.0f, 0.0f, 0.0f, 0.0f}, g_y[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (q.real) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    x[e] = load(xbc, xbc_dtype, q.source_row * width + col + e);
                    if (dy != nullptr) {
                        g_y[e] = load(dy, dy_dtype, q.source_row * d_inner + col + e);
                    }
                }
            }
            const float w = v.w[step];
            if (x_p != nullptr) {
                x_p[k] = make_float4(x[0], x[1], x[2], x[3]);
            }
            const float xw[4] = {x[0] * w, x[1] * w, x[2] * w, x[3] * w};
            put4(x_w, k, xw);
            if (x_o != nullptr) {
                put4(x_o, k, x);
            }
            if (dy != nullptr) {
                const float el = v.elam[step];
                if (dy_p != nullptr) {
                    dy_p[k] = make_float4(g_y[0], g_y[1], g_y[2], g_y[3]);
                }
                const float ye[4] = {g_y[0] * el, g_y[1] * el, g_y[2] * el, g_y[3] * el};
                put4(dy_e, k, ye);
                if (dy_o != nullptr) {
                    put4(dy_o, k, g_y);
                }
            }
        } else {
            const u32 kn = k - wide;
            const QuadAt q = quad_at(kn, state, first_item, seq, groups, chunk, chunks);
            float b[4] = {0.0f, 0.0f, 0.0f, 0.0f}, c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (q.real) {
                const u64 at = q.source_row * width + d_inner + static_cast<u64>(q.g) * state + q.column;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    b[e] = load(xbc, xbc_dtype, at + e);
                    c[e] = load(xbc, xbc_dtype, at + e + static_cast<u64>(groups) * state);
                }
            }
            put4(b_p, kn, b);
            put4(c_p, kn, c);
        }
    }
}

#define CHUNK_PACK_QUADS(NAME, T)                                                                    \
    extern "C" __global__ void NAME(const void* xbc, int xbc_dtype, const void* dy, int dy_dtype,    \
                                    const float* values, float4* x_p, float4* dy_p, T* dy_e, T* x_w, \
                                    T* b_p, T* c_p, T* x_o, T* dy_o, u32 first_item, u32 items,      \
                                    u32 seq, u32 heads, u32 head_dim, u32 groups, u32 state,         \
                                    u32 chunk) {                                                      \
        grid_dependency_sync();                                                                       \
        chunk_pack_quads<T>(xbc, xbc_dtype, dy, dy_dtype, values, x_p, dy_p, dy_e, x_w, b_p, c_p,   \
                            x_o, dy_o, first_item, items, seq, heads, head_dim, groups, state,       \
                            chunk);                                                                  \
    }
CHUNK_PACK_QUADS(ssd_chunk_pack_quads, float)
CHUNK_PACK_QUADS(ssd_chunk_pack_quads_bf16, bf16)

// Head `ih`'s decays e^(Lam_t - Lam_s) from step s to step t (zero for s
// past t) and its dt_s, for row t and the quad of steps s .. s + 3: what
// both quad kernels below weigh the scores with, one expression for both
// (so the same bits).
__device__ __forceinline__ void quad_decays(const StepValues& v, u32 ih, u32 chunk, u32 t, u32 s, float (&l)[4],
                                            float (&dt_s)[4]) {
    const float lam_t = v.lam[ih * chunk + t];
    const float4 lam4 = *reinterpret_cast<const float4*>(v.lam + ih * chunk + s);
    const float4 dt4 = *reinterpret_cast<const float4*>(v.dt + ih * chunk + s);
    const float lam_s[4] = {lam4.x, lam4.y, lam4.z, lam4.w};
    dt_s[0] = dt4.x;
    dt_s[1] = dt4.y;
    dt_s[2] = dt4.z;
    dt_s[3] = dt4.w;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        l[e] = s + e <= t ? expf(lam_t - lam_s[e]) : 0.0f;
    }
}

// `ssd_chunk_scores` a quad of s a thread.
template <typename T>
__device__ __forceinline__ void chunk_scores_quads(
    const float4* cb, float4* dm, T* m, T* dcb, const float* values, u32 items, u32 heads,
    u32 groups, u32 chunk) {
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u32 quads = chunk / 4;
    const u32 group_heads = heads / groups;
    const u32 n = items * groups * chunk * quads;
    for (u32 k = static_cast<u32>(grid_start()); k < n; k += static_cast<u32>(grid_stride())) {
        const u32 s = (k % quads) * 4;
        const u32 row = k / quads;  // (item * groups + g) * chunk + t
        const u32 t = row % chunk;
        const u32 ig = row / chunk;
        const float4 score = cb[k];
        const float sc[4] = {score.x, score.y, score.z, score.w};
        float d_score[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 j = 0; j < group_heads; ++j) {
            const u32 ih = ig * group_heads + j;  // item * heads + h
            float l[4], dt_s[4];
            quad_decays(v, ih, chunk, t, s, l, dt_s);
            // The head's quad: row t of its [Q, Q] block, columns s...s+3.
            const u32 at = (ih * chunk + t) * quads + s / 4;
            float out[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                out[e] = sc[e] * l[e] * dt_s[e];
            }
            put4(m, at, out);
            if (dm != nullptr) {
                const float4 g4 = dm[at];
                const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    out[e] = g[e] * sc[e] * l[e];
                    d_score[e] += g[e] * l[e] * dt_s[e];
                }
                dm[at] = make_float4(out[0], out[1], out[2], out[3]);
            }
        }
        if (dcb != nullptr) {
            put4(dcb, k, d_score);
        }
    }
}

#define CHUNK_SCORES_QUADS(NAME, T)                                                                  \
    extern "C" __global__ void NAME(const float4* cb, float4* dm, T* m, T* dcb, const float* values,  \
                                    u32 items, u32 heads, u32 groups, u32 chunk) {                    \
        grid_dependency_sync();                                                                       \
        chunk_scores_quads<T>(cb, dm, m, dcb, values, items, heads, groups, chunk);                  \
    }
CHUNK_SCORES_QUADS(ssd_chunk_scores_quads, float)
CHUNK_SCORES_QUADS(ssd_chunk_scores_quads_bf16, bf16)

// Per (item, group, t, s): from CB (`[item, G, Q, Q]`), each head's M =
// CB o e^(Lam_t - Lam_s) dt_s (`[item, H, Q, Q]`, zero above the
// diagonal); in the backward, from each head's dM (same layout,
// overwritten), also the products dM o CB o e^(Lam_t - Lam_s) (in dM's
// place) and dCB, summed over the group's heads in order. The forward
// passes null `dm` and `dcb`.
template <typename T>
__device__ __forceinline__ void chunk_scores(
    const float* cb, float* dm, T* m, T* dcb, const float* values, u64 items, u64 heads,
    u64 groups, u64 chunk) {
    // One block per (item, group, t) row, its threads over s.
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u64 qq = chunk * chunk;
    const u64 group_heads = heads / groups;
    const u64 rows = items * groups * chunk;
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const u64 t = row % chunk;
        const u64 ig = row / chunk;  // item * groups + g
        for (u64 s = threadIdx.x; s < chunk; s += blockDim.x) {
            const u64 ts = t * chunk + s;
            const u64 k = ig * qq + ts;
            const float score = cb[k];
            float d_score = 0.0f;
            for (u64 j = 0; j < group_heads; ++j) {
                const u64 ih = ig * group_heads + j;  // item * heads + h
                const u64 at = ih * qq + ts;
                const float l = s <= t ? expf(v.lam[ih * chunk + t] - v.lam[ih * chunk + s]) : 0.0f;
                const float dt_s = v.dt[ih * chunk + s];
                put(m, at, score * l * dt_s);
                if (dm != nullptr) {
                    const float g = dm[at];
                    dm[at] = g * score * l;
                    d_score += g * l * dt_s;
                }
            }
            if (dcb != nullptr) {
                put(dcb, k, d_score);
            }
        }
    }
}

#define CHUNK_SCORES(NAME, T)                                                                        \
    extern "C" __global__ void NAME(const float* cb, float* dm, T* m, T* dcb, const float* values,    \
                                    u64 items, u64 heads, u64 groups, u64 chunk) {                    \
        grid_dependency_sync();                                                                       \
        chunk_scores<T>(cb, dm, m, dcb, values, items, heads, groups, chunk);                         \
    }
CHUNK_SCORES(ssd_chunk_scores, float)
CHUNK_SCORES(ssd_chunk_scores_bf16, bf16)

// ---- the backward's scores with their sums --------------------------------------
// `ssd_chunk_scores_sums` does what `ssd_chunk_scores_quads` does in the
// backward and what `ssd_chunk_sums` does with E = dM o CB o e^(Lam_t -
// Lam_s), in one pass that never stores E (two [item, H, Q, Q] f32 passes
// over memory saved): the column sums sum_t E_ts whole, and the row sums
// sum_s E_ts dt_s in partials, one per block of SUMS_COLUMNS columns
// (`row_parts`, `[item, H, Q, Q / SUMS_COLUMNS]`), which `ssd_chunk_sums`
// adds in order. A block per (item, group, block of columns); its threads
// are 8 quads of columns by SUMS_ROWS rows, walking the rows SUMS_ROWS
// apart; each holds its columns' partial sums for every head of the group
// (at most SUMS_MAX_HEADS). The launcher takes it where Q is a multiple of
// SUMS_COLUMNS, the heads a group are at most SUMS_MAX_HEADS and the
// `_quads` kernels apply.
#define SUMS_COLUMNS 32
#define SUMS_ROWS 32
#define SUMS_WARPS 8
#define SUMS_MAX_HEADS 16

template <typename T>
__device__ __forceinline__ void chunk_scores_sums(
    const float4* cb, const float4* dm, T* m, T* dcb, float* row_parts, float* values, u32 items,
    u32 heads, u32 groups, u32 chunk) {
    __shared__ float col_part[SUMS_WARPS][SUMS_MAX_HEADS][SUMS_COLUMNS];
    const StepValues v = step_values(values, items, heads, chunk);
    const u32 column_blocks = chunk / SUMS_COLUMNS;
    const u32 cblock = blockIdx.x % column_blocks;
    const u32 ig = blockIdx.x / column_blocks;  // item * groups + g
    const u32 q4 = threadIdx.x % 8;
    const u32 r = threadIdx.x / 8;
    const u32 s = cblock * SUMS_COLUMNS + q4 * 4;
    const u32 group_heads = heads / groups;
    const u32 quads = chunk / 4;
    float col[SUMS_MAX_HEADS][4];
#pragma unroll
    for (int j = 0; j < SUMS_MAX_HEADS; ++j) {
        col[j][0] = col[j][1] = col[j][2] = col[j][3] = 0.0f;
    }
    for (u32 t = r; t < chunk; t += SUMS_ROWS) {
        const u32 k = (ig * chunk + t) * quads + s / 4;
        const float4 score = cb[k];
        const float sc[4] = {score.x, score.y, score.z, score.w};
        float d_score[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < SUMS_MAX_HEADS; ++j) {
            if (static_cast<u32>(j) >= group_heads) {
                break;
            }
            const u32 ih = ig * group_heads + j;  // item * heads + h
            float l[4], dt_s[4];
            quad_decays(v, ih, chunk, t, s, l, dt_s);
            const u32 at = (ih * chunk + t) * quads + s / 4;
            const float4 g4 = dm[at];
            const float g[4] = {g4.x, g4.y, g4.z, g4.w};
            float out[4];
            float row = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                out[e] = sc[e] * l[e] * dt_s[e];
                const float big_e = g[e] * sc[e] * l[e];
                d_score[e] += g[e] * l[e] * dt_s[e];
                row += big_e * dt_s[e];
                col[j][e] += big_e;
            }
            put4(m, at, out);
            // The row's 8 quads are lanes differing in bits 0-2.
            row += __shfl_xor_sync(0xffffffffu, row, 1);
            row += __shfl_xor_sync(0xffffffffu, row, 2);
            row += __shfl_xor_sync(0xffffffffu, row, 4);
            if (q4 == 0) {
                row_parts[(ih * chunk + t) * column_blocks + cblock] = row;
            }
        }
        put4(dcb, k, d_score);
    }
    // The columns' sums: over a warp's 4 rows (lanes differing in bits 3-4),
    // then over the warps in order.
    const u32 warp = threadIdx.x / 32;
    const u32 lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < SUMS_MAX_HEADS; ++j) {
        if (static_cast<u32>(j) >= group_heads) {
            break;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float c = col[j][e];
            c += __shfl_xor_sync(0xffffffffu, c, 8);
            c += __shfl_xor_sync(0xffffffffu, c, 16);
            if (lane < 8) {
                col_part[warp][j][q4 * 4 + e] = c;
            }
        }
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < group_heads * SUMS_COLUMNS; i += blockDim.x) {
        const u32 j = i / SUMS_COLUMNS;
        const u32 c = i % SUMS_COLUMNS;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < SUMS_WARPS; ++w) {
            sum += col_part[w][j][c];
        }
        v.col_v[(ig * group_heads + j) * chunk + cblock * SUMS_COLUMNS + c] = sum;
    }
}

#define CHUNK_SCORES_SUMS(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(SUMS_WARPS * 32)                                     \
        NAME(const float4* cb, const float4* dm, T* m, T* dcb, float* row_parts, float* values,      \
             u32 items, u32 heads, u32 groups, u32 chunk) {                                          \
        grid_dependency_sync();                                                                      \
        chunk_scores_sums<T>(cb, dm, m, dcb, row_parts, values, items, heads, groups, chunk);        \
    }
CHUNK_SCORES_SUMS(ssd_chunk_scores_sums, float)
CHUNK_SCORES_SUMS(ssd_chunk_scores_sums_bf16, bf16)

// ---- the backward's scores on tensor cores ---------------------------------------
// `ssd_chunk_scores_sums_mma` does, for bf16 operands, what the J dM = dY
// X^T GEMMs and `ssd_chunk_scores_sums_bf16` do, without dM ever in
// memory: each head's dM tile is multiplied on tensor cores (mma.sync,
// bf16 in, f32 accumulate, as cuBLAS does it) and used where it is made.
// The GEMMs wrote dM as f32 `[item, H, Q, Q]` and the sums read it back,
// 2 x 268 MB a benchmark layer; only the lower triangle (s <= t) is
// multiplied, since the decays zero the rest. The outputs are those of
// `ssd_chunk_scores_sums`: M (the same expression, so the same bits), dCB,
// the column sums of E and the row sums' partials per block of
// SUMS_COLUMNS columns; E and dCB differ from the GEMM path's only in the
// order dM's products are summed.
//
// A block per (item, group, block of SUMS_COLUMNS columns s), its X rows
// staged in shared memory; warp w walks the 16-row tiles of t w, w +
// MMA_SUMS_WARPS, ..., and a tile's heads one after another, fetching head
// j + 1's dY while it works on head j's epilogue (the loop over heads is
// not unrolled: eight unrolled heads made 8,000 instructions and ran
// slower than the GEMMs). A thread's fragments are rows g = lane / 4 and g + 8
// and columns 2c, 2c + 1 of each 8-column block (c = lane % 4). The
// product's k order is permuted in both operands alike (thread c holds
// channels 8c .. 8c + 7 of each 32, one 16-byte load, and 4c .. 4c + 3 of
// a last 16, one 8-byte load), which leaves every dot product's terms the
// same. The decays are computed without a branch (`masked_decay`), and M
// and dCB leave through the warp's staging rows as whole 32-byte sectors
// (the fragments' 4-byte stores touched 8 rows each). P, the head width,
// is a template parameter (a multiple of 16: Mamba-2's 64, Nemotron-H
// 9B's 80); the group's X rows take dynamic shared memory (`mma_sums_shared`;
// 16 heads of 80 take 99 KiB), which the kernel set reserves at load. The
// launcher takes it where the `_quads` kernels do, the operands are bf16, P
// has a kernel, J is at most its `MMA_SUMS_HEADS` (16: what the reservation
// holds) and the reservation held.
#define MMA_SUMS_WARPS 4
// A warp's staging rows: 80 bytes apart, so that the fragments' 4-byte
// writes (8 rows, 4 words each) fall in 32 different banks.
#define MMA_STAGE_PITCH (SUMS_COLUMNS + 8)

// e^(lam_t - lam_s) for s <= t, else 0: quad_decays' value, without a
// branch. Where s <= t the exponent is at most 0 (Lam only falls), so the
// clamp changes nothing there; past t it keeps the unused exponential
// finite. A NaN exponent fails the comparison and stays NaN (fminf would
// have made it 0), and the mask is a select, so a masked NaN is still 0.
__device__ __forceinline__ float masked_decay(float lam_t, float lam_s, bool live) {
    const float x = lam_t - lam_s;
    const float decay = expf(x > 0.0f ? 0.0f : x);
    return live ? decay : 0.0f;
}

// Writes a warp's 16 x SUMS_COLUMNS bf16 tile, held as fragments (pairs
// [r][n]: row g + 8r, columns 8n + 2c and the next), to `dst` (rows
// `pitch` apart) through `stage`: each lane then stores 8 bytes of rows
// lane / 8 + 4k, and each store instruction covers 4 whole rows.
__device__ __forceinline__ void store_tile(bf16* stage, const u32 (&pairs)[2][4], bf16* dst, u64 pitch, u32 lane) {
    const u32 g = lane / 4;
    const u32 c = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            *reinterpret_cast<u32*>(stage + (g + 8 * r) * MMA_STAGE_PITCH + 8 * n + 2 * c) = pairs[r][n];
        }
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 row = lane / 8 + 4 * k;
        const u32 col = (lane % 8) * 4;
        *reinterpret_cast<uint2*>(dst + row * pitch + col) =
            *reinterpret_cast<const uint2*>(stage + row * MMA_STAGE_PITCH + col);
    }
    __syncwarp();
}

// Zeros a 16 x SUMS_COLUMNS bf16 tile of `dst`, in the stores' pattern of
// `store_tile`.
__device__ __forceinline__ void zero_tile(bf16* dst, u64 pitch, u32 lane) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        *reinterpret_cast<uint2*>(dst + (lane / 8 + 4 * k) * pitch + (lane % 8) * 4) = make_uint2(0, 0);
    }
}

// The staged X rows' pitch in elements: J P rounded up to 64, plus 32.
// Rows 64 bytes apart modulo 128 put the 8 rows a 16-byte load phase reads
// in different banks, so they never collide (the 8-byte loads of a last
// 16 channels collide two ways).
__device__ __forceinline__ u32 mma_sums_pitch(u32 jp) {
    return (jp + 63) / 64 * 64 + 32;
}

// The dynamic shared memory of a block (`mma_sums_shared_bytes` in
// `cuda::launch::scan_chunked` computes the same): X's SUMS_COLUMNS rows,
// the warps' staging rows, Lam_s and dt_s of each head's columns, and
// each warp's column sums per head.
struct MmaSumsShared {
    bf16* xs;
    bf16* stage;
    float* lam_s;
    float* dt_s;
    float* col_part;
};

__device__ __forceinline__ MmaSumsShared mma_sums_shared(unsigned char* base, u32 pitch, u32 group_heads) {
    MmaSumsShared sh;
    sh.xs = reinterpret_cast<bf16*>(base);
    sh.stage = sh.xs + SUMS_COLUMNS * pitch;
    sh.lam_s = reinterpret_cast<float*>(sh.stage + MMA_SUMS_WARPS * 16 * MMA_STAGE_PITCH);
    sh.dt_s = sh.lam_s + group_heads * SUMS_COLUMNS;
    sh.col_part = sh.dt_s + group_heads * SUMS_COLUMNS;
    return sh;
}

template <u32 P>
__device__ __forceinline__ void scores_sums_mma(const bf16* dy_op, const bf16* x_op, const float* cb, bf16* m,
                                                bf16* dcb, float* row_parts, float* values, u32 items, u32 heads,
                                                u32 groups, u32 chunk) {
    static_assert(P % 16 == 0, "the head width is whole 16-channel blocks");
    // Whole 32-channel blocks (two products each), then a last 16 if any.
    constexpr u32 KB = P / 32;
    constexpr u32 TAIL = (P % 32) / 16;
    extern __shared__ __align__(16) unsigned char scan_shared[];
    const StepValues v = step_values(values, items, heads, chunk);
    const u32 column_blocks = chunk / SUMS_COLUMNS;
    const u32 cblock = blockIdx.x % column_blocks;
    const u32 ig = blockIdx.x / column_blocks;  // item * groups + g
    const u32 group_heads = heads / groups;
    const u32 jp = group_heads * P;
    const u32 pitch = mma_sums_pitch(jp);
    const MmaSumsShared sh = mma_sums_shared(scan_shared, pitch, group_heads);
    bf16* const xs = sh.xs;
    // Lam_s, dt_s: [J][SUMS_COLUMNS]; col_part: [MMA_SUMS_WARPS][J][SUMS_COLUMNS].
    float* const lam_s = sh.lam_s;
    float* const dt_s = sh.dt_s;
    float* const col_part = sh.col_part;
    const u32 s0 = cblock * SUMS_COLUMNS;
    const u32 lane = threadIdx.x % 32;
    const u32 warp = threadIdx.x / 32;
    const u32 g = lane / 4;
    const u32 c = lane % 4;
    const u64 qq = static_cast<u64>(chunk) * chunk;
    bf16* const stage = sh.stage + warp * 16 * MMA_STAGE_PITCH;

    const u32 row_words = jp / 8;
    const uint4* x_rows = reinterpret_cast<const uint4*>(x_op + (static_cast<u64>(ig) * chunk + s0) * jp);
    for (u32 i = threadIdx.x; i < SUMS_COLUMNS * row_words; i += blockDim.x) {
        *reinterpret_cast<uint4*>(xs + (i / row_words) * pitch + (i % row_words) * 8) = x_rows[i];
    }
    for (u32 i = threadIdx.x; i < group_heads * SUMS_COLUMNS; i += blockDim.x) {
        const u32 at = (ig * group_heads + i / SUMS_COLUMNS) * chunk + s0 + i % SUMS_COLUMNS;
        lam_s[i] = v.lam[at];
        dt_s[i] = v.dt[at];
    }
    for (u32 i = threadIdx.x; i < MMA_SUMS_WARPS * group_heads * SUMS_COLUMNS; i += blockDim.x) {
        col_part[i] = 0.0f;
    }
    __syncthreads();
    for (u32 tile = warp; tile < chunk / 16; tile += MMA_SUMS_WARPS) {
        const u32 t0 = tile * 16;
        // The tile's first row of dCB's [Q, Q] block, at column s0.
        bf16* dcb_tile = dcb + static_cast<u64>(ig) * qq + static_cast<u64>(t0) * chunk + s0;
        if (t0 + 15 < s0) {
            // Above the diagonal: M, dCB and the row sums are zero.
            for (u32 j = 0; j < group_heads; ++j) {
                const u64 ih = static_cast<u64>(ig) * group_heads + j;
                zero_tile(m + ih * qq + static_cast<u64>(t0) * chunk + s0, chunk, lane);
                if (c == 0) {
                    row_parts[(ih * chunk + t0 + g) * column_blocks + cblock] = 0.0f;
                    row_parts[(ih * chunk + t0 + g + 8) * column_blocks + cblock] = 0.0f;
                }
            }
            zero_tile(dcb_tile, chunk, lane);
            continue;
        }
        const u32 rows[2] = {t0 + g, t0 + g + 8};
        float sc[2][4][2];
        float d_score[2][4][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const float2 pair = *reinterpret_cast<const float2*>(
                    cb + static_cast<u64>(ig) * qq + static_cast<u64>(rows[r]) * chunk + s0 + 8 * n + 2 * c);
                sc[r][n][0] = pair.x;
                sc[r][n][1] = pair.y;
                d_score[r][n][0] = d_score[r][n][1] = 0.0f;
            }
        }
        const bf16* dy_rows[2] = {dy_op + (static_cast<u64>(ig) * chunk + rows[0]) * jp,
                                  dy_op + (static_cast<u64>(ig) * chunk + rows[1]) * jp};
        // Head j's dY words (rows g and g + 8) and Lam_t, fetched a head ahead.
        uint4 next[2][KB];
        uint2 next_tail[2];
        float next_lam[2];
        auto fetch = [&](u32 j) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#pragma unroll
                for (u32 kb = 0; kb < KB; ++kb) {
                    next[r][kb] = *reinterpret_cast<const uint4*>(dy_rows[r] + j * P + kb * 32 + 8 * c);
                }
                if (TAIL) {
                    next_tail[r] = *reinterpret_cast<const uint2*>(dy_rows[r] + j * P + KB * 32 + 4 * c);
                }
                next_lam[r] = v.lam[(ig * group_heads + j) * chunk + rows[r]];
            }
        };
        fetch(0);
#pragma unroll 1
        for (u32 j = 0; j < group_heads; ++j) {
            const float lam_t[2] = {next_lam[0], next_lam[1]};
            // dM of the tile: rows t of dY times rows s of X, head j.
            float acc[4][4];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
            }
#pragma unroll
            for (u32 kb = 0; kb < KB; ++kb) {
                const uint4 wa = next[0][kb];
                const uint4 wb = next[1][kb];
                const u32 lo[4] = {wa.x, wb.x, wa.y, wb.y};
                const u32 hi[4] = {wa.z, wb.z, wa.w, wb.w};
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const uint4 xw =
                        *reinterpret_cast<const uint4*>(xs + (8 * n + g) * pitch + j * P + kb * 32 + 8 * c);
                    mma_bf16(acc[n], lo, xw.x, xw.y);
                    mma_bf16(acc[n], hi, xw.z, xw.w);
                }
            }
            if (TAIL) {
                const u32 tail[4] = {next_tail[0].x, next_tail[1].x, next_tail[0].y, next_tail[1].y};
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const uint2 xw =
                        *reinterpret_cast<const uint2*>(xs + (8 * n + g) * pitch + j * P + KB * 32 + 4 * c);
                    mma_bf16(acc[n], tail, xw.x, xw.y);
                }
            }
            // The next head's operands load while this one's epilogue runs.
            if (j + 1 < group_heads) {
                fetch(j + 1);
            }
            // The thread's columns' Lam_s and dt_s (the same for both rows).
            float2 ls[4], ds[4];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                ls[n] = *reinterpret_cast<const float2*>(&lam_s[j * SUMS_COLUMNS + 8 * n + 2 * c]);
                ds[n] = *reinterpret_cast<const float2*>(&dt_s[j * SUMS_COLUMNS + 8 * n + 2 * c]);
            }
            const u32 ih = ig * group_heads + j;  // item * heads + h
            u32 out[2][4];
            float col[4][2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 t = rows[r];
                float row = 0.0f;
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const u32 s = s0 + 8 * n + 2 * c;
                    const float l[2] = {masked_decay(lam_t[r], ls[n].x, s <= t),
                                        masked_decay(lam_t[r], ls[n].y, s + 1 <= t)};
                    const float dt[2] = {ds[n].x, ds[n].y};
                    float o[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float dm = acc[n][2 * r + e];
                        // quad_decays' product, so M has its bits.
                        o[e] = sc[r][n][e] * l[e] * dt[e];
                        const float big_e = dm * sc[r][n][e] * l[e];
                        d_score[r][n][e] += dm * l[e] * dt[e];
                        row += big_e * dt[e];
                        col[n][e] = r == 0 ? big_e : col[n][e] + big_e;
                    }
                    out[r][n] = pack_bf16(o[0], o[1]);
                }
                // The row's columns are the 4 lanes differing in bits 0-1.
                row += __shfl_xor_sync(0xffffffffu, row, 1);
                row += __shfl_xor_sync(0xffffffffu, row, 2);
                if (c == 0) {
                    row_parts[(ih * chunk + t) * column_blocks + cblock] = row;
                }
            }
            store_tile(stage, out, m + static_cast<u64>(ih) * qq + static_cast<u64>(t0) * chunk + s0, chunk,
                       lane);
            // The tile's column sums: over its 16 rows (lanes differing in
            // bits 2-4), onto the warp's.
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float sum = col[n][e];
                    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
                    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
                    if (g == 0) {
                        col_part[(warp * group_heads + j) * SUMS_COLUMNS + 8 * n + 2 * c + e] += sum;
                    }
                }
            }
        }
        u32 scores[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                scores[r][n] = pack_bf16(d_score[r][n][0], d_score[r][n][1]);
            }
        }
        store_tile(stage, scores, dcb_tile, chunk, lane);
    }

    // The columns' sums over the warps, in order.
    __syncthreads();
    for (u32 i = threadIdx.x; i < group_heads * SUMS_COLUMNS; i += blockDim.x) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < MMA_SUMS_WARPS; ++w) {
            sum += col_part[w * group_heads * SUMS_COLUMNS + i];
        }
        v.col_v[(ig * group_heads + i / SUMS_COLUMNS) * chunk + s0 + i % SUMS_COLUMNS] = sum;
    }
}

#define CHUNK_SCORES_SUMS_MMA(NAME, P)                                                                     \
    extern "C" __global__ void __launch_bounds__(MMA_SUMS_WARPS * 32, 3)                                   \
        NAME(const bf16* dy_op, const bf16* x_op, const float* cb, bf16* m, bf16* dcb, float* row_parts,  \
             float* values, u32 items, u32 heads, u32 groups, u32 chunk) {                                \
        grid_dependency_sync();                                                                           \
        scores_sums_mma<P>(dy_op, x_op, cb, m, dcb, row_parts, values, items, heads, groups, chunk);      \
    }
CHUNK_SCORES_SUMS_MMA(ssd_chunk_scores_sums_mma_p64, 64)
CHUNK_SCORES_SUMS_MMA(ssd_chunk_scores_sums_mma_p80, 80)

// ---- the forward's scores times x on tensor cores --------------------------------
// `ssd_chunk_scores_times_mma_p{64,80}` do, for bf16 operands, what the
// forward's `ssd_chunk_scores_quads_bf16` and its J M X GEMMs do, without
// M in memory: M X (into `t_acc`, f32 `[item, G, Q, J P]`) with each
// head's M made where it is multiplied, rounded to bf16 as the GEMMs'
// operand was (the same expression, so the same operand bits; the products
// are summed in another order). Only the lower triangle (s <= t) is
// multiplied. A block per (item, head, block of MMA_TIMES_ROWS rows t), the
// last rows' blocks first (they walk the most columns); X's rows s up to
// the block's last staged in shared memory; warp w takes 16 rows and walks
// the columns s 16 at a time, making its M fragment (rows g, g + 8; columns
// 2c, 2c + 1 and 2c + 8, 2c + 9) from CB and the decays (`masked_decay`,
// no branch). P, the head width, is a template parameter (a multiple of
// 16: Mamba-2's 64, Nemotron-H 9B's 80), so its P / 8 accumulator blocks
// stay in registers. The launcher takes it where the `_quads` kernels do,
// the operands are bf16, P has a kernel, and Q is whole blocks of rows up
// to MMA_TIMES_MAX_CHUNK.
#define MMA_TIMES_ROWS 64
#define MMA_TIMES_MAX_CHUNK 256

template <u32 P>
__device__ __forceinline__ void scores_times_mma(const bf16* x_op, const float* cb, float* t_acc,
                                                 const float* values, u32 items, u32 heads, u32 groups, u32 chunk) {
    static_assert(P % 16 == 0, "the head width is whole 16-column blocks");
    // P + 8 elements: the 8 rows an `ldmatrix` reads fall in different
    // banks (144 bytes apart at P = 64, 176 at P = 80).
    constexpr u32 PITCH = P + 8;
    // The most shared memory a block takes without asking for more.
    static_assert(MMA_TIMES_MAX_CHUNK * (PITCH * 2 + 8) <= 48 * 1024, "X's rows fit static shared memory");
    __shared__ __align__(16) bf16 xs[MMA_TIMES_MAX_CHUNK * PITCH];
    __shared__ __align__(8) float lam[MMA_TIMES_MAX_CHUNK];
    __shared__ __align__(8) float dts[MMA_TIMES_MAX_CHUNK];
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u32 row_blocks = chunk / MMA_TIMES_ROWS;
    const u32 rb = row_blocks - 1 - blockIdx.x % row_blocks;
    const u32 ih = blockIdx.x / row_blocks;  // item * heads + h
    const u32 group_heads = heads / groups;
    const u32 ig = ih / group_heads;  // item * groups + g
    const u32 j = ih % group_heads;
    const u32 jp = group_heads * P;
    const u32 rows_end = (rb + 1) * MMA_TIMES_ROWS;
    const bf16* x_rows = x_op + static_cast<u64>(ig) * chunk * jp + j * P;
    for (u32 i = threadIdx.x; i < rows_end * (P / 8); i += blockDim.x) {
        const u32 r = i / (P / 8);
        const u32 w = i % (P / 8);
        copy16_async(shared_address(xs + r * PITCH + w * 8), x_rows + static_cast<u64>(r) * jp + w * 8, true);
    }
    commit_async();
    for (u32 i = threadIdx.x; i < rows_end; i += blockDim.x) {
        lam[i] = v.lam[ih * chunk + i];
        dts[i] = v.dt[ih * chunk + i];
    }
    wait_async<0>();
    __syncthreads();

    const u32 lane = threadIdx.x % 32;
    const u32 g = lane / 4;
    const u32 c = lane % 4;
    const u32 t0 = rb * MMA_TIMES_ROWS + threadIdx.x / 32 * 16;
    const u32 rows[2] = {t0 + g, t0 + g + 8};
    const float lam_t[2] = {lam[rows[0]], lam[rows[1]]};
    const float* cb_rows[2] = {cb + (static_cast<u64>(ig) * chunk + rows[0]) * chunk,
                               cb + (static_cast<u64>(ig) * chunk + rows[1]) * chunk};
    constexpr int NB = P / 8;
    float acc[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    }
    for (u32 s0 = 0; s0 < t0 + 16; s0 += 16) {
        // M's A fragment: a[2 half + r] holds row r's columns s0 + 8 half +
        // 2c and the next, with quad_decays' expression.
        u32 a[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 s = s0 + 8 * half + 2 * c;
            const float2 ls = *reinterpret_cast<const float2*>(&lam[s]);
            const float2 ds = *reinterpret_cast<const float2*>(&dts[s]);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float2 score = *reinterpret_cast<const float2*>(cb_rows[r] + s);
                const float l0 = masked_decay(lam_t[r], ls.x, s <= rows[r]);
                const float l1 = masked_decay(lam_t[r], ls.y, s + 1 <= rows[r]);
                a[2 * half + r] = pack_bf16(score.x * l0 * ds.x, score.y * l1 * ds.y);
            }
        }
#pragma unroll
        for (int n = 0; n < NB; n += 2) {
            u32 b[4];
            const u32 row = s0 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const u32 col = n * 8 + (lane >> 4) * 8;
            ldmatrix_x4_trans(b, shared_address(xs + row * PITCH + col));
            mma_bf16(acc[n], a, b[0], b[1]);
            mma_bf16(acc[n + 1], a, b[2], b[3]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float* out = t_acc + (static_cast<u64>(ig) * chunk + rows[r]) * jp + j * P + 2 * c;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            *reinterpret_cast<float2*>(out + 8 * n) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
        }
    }
}

#define CHUNK_SCORES_TIMES_MMA(NAME, P)                                                                 \
    extern "C" __global__ void __launch_bounds__(MMA_TIMES_ROWS / 16 * 32)                             \
        NAME(const bf16* x_op, const float* cb, float* t_acc, const float* values, u32 items, u32 heads, \
             u32 groups, u32 chunk) {                                                                  \
        grid_dependency_sync();                                                                        \
        scores_times_mma<P>(x_op, cb, t_acc, values, items, heads, groups, chunk);                     \
    }
CHUNK_SCORES_TIMES_MMA(ssd_chunk_scores_times_mma_p64, 64)
CHUNK_SCORES_TIMES_MMA(ssd_chunk_scores_times_mma_p80, 80)

// One block per (item, head): the row sums sum_s E_ts dt_s (= R's), the
// column sums sum_t E_ts of E = dM o CB o e^(Lam_t - Lam_s), and dY_t .
// Yo_t with Yo = C S_in^T (in `y_off`, `[item, G, Q, J * P]`). With
// `row_parts` (from `ssd_chunk_scores_sums`, `e` then unused) the row
// sums are its `column_blocks` partials added in order, and the column
// sums are already in place. dY (`dy_p`) is the operands' copy, of
// `dy_dtype`.
extern "C" __global__ void __launch_bounds__(256) ssd_chunk_sums(
    const float* e, const float* row_parts, u64 column_blocks, const float* y_off,
    const void* dy_p, int dy_dtype, float* values, u64 items, u64 heads, u64 head_dim, u64 groups, u64 chunk) {
    grid_dependency_sync();
    const StepValues v = step_values(values, items, heads, chunk);
    const int lane = threadIdx.x & 31;
    const u64 warp = threadIdx.x >> 5;
    const u64 warps = blockDim.x >> 5;
    const u64 ih = blockIdx.x;
    const u64 group_heads = heads / groups;
    const u64 jp = group_heads * head_dim;
    const u64 j = (ih % heads) % group_heads;
    const u64 ig = ih / group_heads;  // item * groups + g
    const float* rows = e + ih * chunk * chunk;
    const float* dt = v.dt + ih * chunk;
    for (u64 t = warp; t < chunk; t += warps) {
        float acc = 0.0f;
        if (row_parts != nullptr) {
            for (u64 b = 0; b < column_blocks; ++b) {
                acc += row_parts[(ih * chunk + t) * column_blocks + b];
            }
        } else {
            for (u64 s = lane; s <= t; s += 32) {
                acc += rows[t * chunk + s] * dt[s];
            }
            acc = warp_sum(acc);
        }
        float dot = 0.0f;
        const u64 at = (ig * chunk + t) * jp + j * head_dim;
        for (u64 p = lane; p < head_dim; p += 32) {
            dot += load(dy_p, dy_dtype, at + p) * y_off[at + p];
        }
        dot = warp_sum(dot);
        if (lane == 0) {
            v.row_r[ih * chunk + t] = acc;
            v.y_dot[ih * chunk + t] = dot;
        }
    }
    if (row_parts != nullptr) {
        return;
    }
    for (u64 s = threadIdx.x; s < chunk; s += blockDim.x) {
        float acc = 0.0f;
        for (u64 t = s; t < chunk; ++t) {
            acc += rows[t * chunk + s];
        }
        v.col_v[ih * chunk + s] = acc;
    }
}

// One block per (item, head): dx (into `dxbc`'s x columns) and d dt of the
// chunk's steps, and the chunk's A_log and D gradient partials
// (`partials`, `[batch, H, chunks, 2]`). `t_acc` holds M^T dY and `u` B
// K^T (both `[item, G, Q, J * P]`); `carry` is K (`[batch * chunks, H, P,
// N]`) and `states` S_in (the same layout); x and dY (`x_p`, `dy_p`) are
// the operands' copies, of `x_dtype`.
extern "C" __global__ void __launch_bounds__(256) ssd_chunk_final(
    const void* dt_raw, int dt_dtype, const void* dt_bias, int bias_dtype, const void* a_log,
    int a_dtype, const void* d_skip, int d_dtype, const float* states, const float* carry,
    const void* x_p, const void* dy_p, int x_dtype, const float* t_acc, const float* u,
    const float* values, void* dxbc, int dxbc_dtype, void* ddt, int ddt_dtype, float* partials, u64 first_item,
    u64 items, u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    grid_dependency_sync();
    __shared__ float d_lam[CHUNKED_MAX_CHUNK];
    __shared__ float direct[CHUNKED_MAX_CHUNK];
    // The steps' dt, for the one thread's suffix sums below: from shared
    // memory its loop does not wait on a global load a step.
    __shared__ float step_dt[CHUNKED_MAX_CHUNK];
    __shared__ float sums[32];
    __shared__ float d_a_total;
    const ChunkShape s = chunk_shape(seq, heads, head_dim, groups, state, chunk);
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const int lane = threadIdx.x & 31;
    const u64 warp = threadIdx.x >> 5;
    const u64 warps = blockDim.x >> 5;
    const u64 ih = blockIdx.x;
    const u64 h = ih % heads;
    const u64 i = ih / heads;
    const u64 item = first_item + i;
    const u64 b = item / s.chunks;
    const u64 c = item % s.chunks;
    const u64 group_heads = s.group_heads();
    const u64 jp = s.group_width();
    const u64 j = h % group_heads;
    const u64 ig = i * groups + h / group_heads;
    const u64 pn = head_dim * state;
    const float a = -expf(load(a_log, a_dtype, h));
    const float skip = load(d_skip, d_dtype, h);
    const float bias = load(dt_bias, bias_dtype, h);
    const u64 steps = ih * chunk;
    const float lam_last = v.lam[steps + chunk - 1];

    // <K, S_out>: what Lam_last owes to the state leaving the chunk (none
    // after the last chunk, whose K is 0).
    float inner = 0.0f;
    if (c + 1 < s.chunks) {
        const float* k_state = carry + (item * heads + h) * pn;
        const float* out_state = states + ((item + 1) * heads + h) * pn;
        for (u64 e = threadIdx.x; e < pn; e += blockDim.x) {
            inner += k_state[e] * out_state[e];
        }
    }
    const float leaving = block_sum(inner, sums);

    float skip_part = 0.0f;
    for (u64 t = warp; t < chunk; t += warps) {
        const u64 at = (ig * chunk + t) * jp + j * head_dim;
        const u64 t_abs = c * chunk + t;
        const float w = v.w[steps + t];
        float xu = 0.0f;
        for (u64 p = lane; p < head_dim; p += 32) {
            const float x = load(x_p, x_dtype, at + p);
            const float g_y = load(dy_p, x_dtype, at + p);
            xu += x * u[at + p];
            skip_part += g_y * x;
            if (t_abs < seq) {
                const u64 row = b * seq + t_abs;
                store(dxbc, dxbc_dtype, row * s.width() + h * head_dim + p,
                      skip * g_y + t_acc[at + p] + w * u[at + p]);
            }
        }
        xu = warp_sum(xu);
        if (lane == 0) {
            const float dt = v.dt[steps + t];
            step_dt[t] = dt;
            d_lam[t] = v.row_r[steps + t] - dt * v.col_v[steps + t] +
                       v.elam[steps + t] * v.y_dot[steps + t] - w * xu +
                       (t + 1 == chunk ? leaving : 0.0f);
            direct[t] = v.col_v[steps + t] + expf(lam_last - v.lam[steps + t]) * xu;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // dl_t = sum_{t' >= t} dLam_t', last step first; dA = sum_t dt_t dl_t.
        float acc = 0.0f, d_a = 0.0f;
        for (u64 t = chunk; t-- > 0;) {
            acc += d_lam[t];
            d_lam[t] = acc;
            d_a += step_dt[t] * acc;
        }
        d_a_total = d_a;
    }
    __syncthreads();
    for (u64 t = threadIdx.x; t < chunk; t += blockDim.x) {
        const u64 t_abs = c * chunk + t;
        if (t_abs < seq) {
            const u64 at = (b * seq + t_abs) * heads + h;
            const float raw = load(dt_raw, dt_dtype, at) + bias;
            store(ddt, ddt_dtype, at, (a * d_lam[t] + direct[t]) * chunk_softplus_derivative(raw));
        }
    }
    const float skip_total = block_sum(skip_part, sums);
    if (threadIdx.x == 0) {
        // A = -exp(A_log), so dA/dA_log = A.
        const u64 slot = ((b * heads + h) * s.chunks + c) * 2;
        partials[slot] = d_a_total * a;
        partials[slot + 1] = skip_total;
    }
}

// dB and dC of the slice's real steps into `dxbc`'s B and C columns.
extern "C" __global__ void ssd_chunk_unpack(
    const float* d_b, const float* d_c, void* dxbc, int dxbc_dtype, u64 first_item, u64 items,
    u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    grid_dependency_sync();
    const ChunkShape s = chunk_shape(seq, heads, head_dim, groups, state, chunk);
    const u64 n = items * groups * chunk * state;
    for (u64 k = grid_start(); k < n; k += grid_stride()) {
        const NarrowAt at = narrow_at(s, k, first_item);
        if (at.real) {
            store(dxbc, dxbc_dtype, at.b_column, d_b[k]);
            store(dxbc, dxbc_dtype, at.b_column + groups * state, d_c[k]);
        }
    }
}

// `ssd_chunk_unpack` a quad of state columns a thread (`takes_quads`, and
// `dxbc` 16-byte aligned: its rows are whole quads, since P and N are):
// a 16-byte load of dB and of dC and one 8- or 16-byte store of each, its
// position worked out once a quad in 32 bits, where the scalar kernel
// spent most of its time on 64-bit divisions for every element. The same
// values round the same way, so the same bits.
extern "C" __global__ void ssd_chunk_unpack_quads(
    const float4* d_b, const float4* d_c, void* dxbc, int dxbc_dtype, u32 first_item, u32 items,
    u32 seq, u32 heads, u32 head_dim, u32 groups, u32 state, u32 chunk) {
    grid_dependency_sync();
    const u32 chunks = (seq + chunk - 1) / chunk;
    const u64 d_inner = static_cast<u64>(heads) * head_dim;
    const u64 width = d_inner + 2ull * groups * state;
    const u64 c_offset = static_cast<u64>(groups) * state;
    const u32 n = items * groups * chunk * (state / 4);
    for (u32 k = static_cast<u32>(grid_start()); k < n; k += static_cast<u32>(grid_stride())) {
        const QuadAt q = quad_at(k, state, first_item, seq, groups, chunk, chunks);
        if (!q.real) {
            continue;
        }
        const u64 at = q.source_row * width + d_inner + static_cast<u64>(q.g) * state + q.column;
        const float4 b4 = d_b[k];
        const float4 c4 = d_c[k];
        const float b[4] = {b4.x, b4.y, b4.z, b4.w};
        const float c[4] = {c4.x, c4.y, c4.z, c4.w};
        if (dxbc_dtype == DTYPE_BF16) {
            store_run_bf16<4>(static_cast<bf16*>(dxbc) + at, b);
            store_run_bf16<4>(static_cast<bf16*>(dxbc) + at + c_offset, c);
        } else {
            store_run<4>(static_cast<float*>(dxbc) + at, b);
            store_run<4>(static_cast<float*>(dxbc) + at + c_offset, c);
        }
    }
}

// ---- forward ------------------------------------------------------------------------

// A thread takes W consecutive state elements (W = 4 where `pn` is a
// multiple of 4 and the arrays are aligned to it: one 16-byte access a
// chunk instead of four).
template <int W>
__device__ __forceinline__ void state_combine(float* states, bf16* copy, const float* chunk_decay,
                                              u64 batch, u64 heads, u64 pn, u64 chunks) {
    const u64 n = batch * heads * pn / W;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u64 e = (i % (pn / W)) * W;
        const u64 h = (i / (pn / W)) % heads;
        const u64 b = i / (pn / W * heads);
        float running[W];
#pragma unroll
        for (int w = 0; w < W; ++w) {
            running[w] = 0.0f;
        }
        // COMBINE_RUN chunks' loads at a time, then their sequential
        // updates: the loads do not wait on the stores before them.
        for (u64 c0 = 0; c0 < chunks; c0 += COMBINE_RUN) {
            float own[COMBINE_RUN][W], decay[COMBINE_RUN];
#pragma unroll
            for (int u = 0; u < COMBINE_RUN; ++u) {
                const u64 c = c0 + u;
                if (c < chunks) {
                    load_run<W>(states + ((b * chunks + c) * heads + h) * pn + e, own[u]);
                    decay[u] = chunk_decay[(b * chunks + c) * heads + h];
                }
            }
#pragma unroll
            for (int u = 0; u < COMBINE_RUN; ++u) {
                const u64 c = c0 + u;
                if (c < chunks) {
                    const u64 at = ((b * chunks + c) * heads + h) * pn + e;
                    store_run<W>(states + at, running);
                    if (copy != nullptr) {
                        store_run_bf16<W>(copy + at, running);
                    }
#pragma unroll
                    for (int w = 0; w < W; ++w) {
                        running[w] = decay[u] * running[w] + own[u][w];
                    }
                }
            }
        }
    }
}

// The states entering each chunk from the chunks' own X^T diag(w) B
// (`states`, `[batch, chunks, H, P, N]`, in place) and their total decays
// (`chunk_decay`, `[batch, chunks, H]`), per (sequence, head, state
// element), first chunk first: S_0 = 0, S_{c+1} = e^Lam_last,c S_c + own_c.
// With `copy` (same layout, bf16) the states also go there as the GEMMs'
// bf16 operands. `quads`: four elements a thread (see `state_combine`).
extern "C" __global__ void ssd_scan_state_combine(
    float* states, bf16* copy, const float* chunk_decay, u64 batch, u64 heads, u64 pn, u64 chunks,
    int quads) {
    grid_dependency_sync();
    if (quads) {
        state_combine<4>(states, copy, chunk_decay, batch, heads, pn, chunks);
    } else {
        state_combine<1>(states, copy, chunk_decay, batch, heads, pn, chunks);
    }
}

// y = M X + e^Lam (C S_in^T) + D x of the slice's real steps, from M X in
// `t_acc` and C S_in^T in `y_off` (both `[item, G, Q, J * P]`); x (`x_p`)
// is the operands' copy, of `x_dtype`.
extern "C" __global__ void ssd_chunk_output(
    const void* x_p, int x_dtype, const float* t_acc, const float* y_off, const float* values,
    const void* d_skip, int d_dtype, void* y, int y_dtype, u64 first_item, u64 items, u64 seq,
    u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    grid_dependency_sync();
    const ChunkShape s = chunk_shape(seq, heads, head_dim, groups, state, chunk);
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u64 n = items * groups * chunk * s.group_width();
    for (u64 k = grid_start(); k < n; k += grid_stride()) {
        const WideAt at = wide_at(s, k, first_item);
        if (at.real) {
            store(y, y_dtype, at.row * s.d_inner() + at.column,
                  t_acc[k] + v.elam[at.step] * y_off[k] + load(d_skip, d_dtype, at.head) * load(x_p, x_dtype, k));
        }
    }
}

// `ssd_chunk_output` a quad a thread.
extern "C" __global__ void ssd_chunk_output_quads(
    const void* x_p, int x_dtype, const float4* t_acc, const float4* y_off, const float* values,
    const void* d_skip, int d_dtype, void* y, int y_dtype, u32 first_item, u32 items, u32 seq,
    u32 heads, u32 head_dim, u32 groups, u32 state, u32 chunk) {
    grid_dependency_sync();
    const StepValues v = step_values(const_cast<float*>(values), items, heads, chunk);
    const u32 chunks = (seq + chunk - 1) / chunk;
    const u32 jp = heads / groups * head_dim;
    const u64 d_inner = static_cast<u64>(heads) * head_dim;
    const u32 n = items * groups * chunk * (jp / 4);
    for (u32 k = static_cast<u32>(grid_start()); k < n; k += static_cast<u32>(grid_stride())) {
        const QuadAt q = quad_at(k, jp, first_item, seq, groups, chunk, chunks);
        if (!q.real) {
            continue;
        }
        const u32 head = q.g * (heads / groups) + q.column / head_dim;
        const float el = v.elam[(q.i * heads + head) * chunk + q.t];
        const float skip = load(d_skip, d_dtype, head);
        const float4 a4 = t_acc[k], o4 = y_off[k];
        const float a[4] = {a4.x, a4.y, a4.z, a4.w}, o[4] = {o4.x, o4.y, o4.z, o4.w};
        float x[4];
        load4(x_p, x_dtype, k, x);
        const u64 at = q.source_row * d_inner + static_cast<u64>(q.g) * jp + q.column;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            store(y, y_dtype, at + e, a[e] + el * o[e] + skip * x[e]);
        }
    }
}

// The Mamba-2 selective scan (`Backend::ssd_scan_forward`,
// `ssd_scan_backward`), evaluated sequentially in time like the CPU
// reference, with the state's P x N elements spread over threads.
//
// Per sequence b and head h (group g = h / (H/G)), with
// `dt_t = softplus(dt_raw[t, h] + dt_bias[h])`, `A = -exp(A_log[h])` and
// `a_t = exp(dt_t A)`:
//   S_t = a_t S_{t-1} + dt_t x_t B_t^T      (S is [P, N], from zero)
//   y_t = S_t C_t + D x_t
// Each state element follows its own scalar recurrence, so threads own
// elements and step through time; y's sum over N is a warp reduction.
// `xbc` rows are `x | B | C` (`H*P + 2*G*N` wide), `states` holds the state
// at the start of every chunk, `[batch, chunks, H, P, N]`.
//
// Backward. The state gradient G_t = dL/dS_t runs backwards,
// G_t = a_{t+1} G_{t+1} + dy_t C_t^T, and gives
//   dx_t = D dy_t + dt_t (G_t B_t)          dB_t = dt_t G_t^T x_t (summed over the group's heads)
//   dC_t = S_t^T dy_t (group-summed)        q_t  = a_t <G_t, S_{t-1}>
//   d dt_t = x_t . (G_t B_t) + q_t A        d A  = sum_t q_t dt_t
// where q_t = dL/d(log a_t) is the one term that needs S and G at the same
// step. Instead of keeping every step's state (or P*N values per step per
// head) it uses <G_t, S_t> = q_t + dt_t x_t . (G_t B_t) = q_{t+1} + w_t with
// the readout w_t = dy_t . (S_t C_t):
//   q_t = q_{t+1} + w_t - dt_t x_t . (G_t B_t),
// a per-step scalar recurrence. It runs only inside a chunk: at the first
// step t0 of every chunk q_t0 is computed directly from the saved chunk
// start (`a_t0 <G_t0, states[c]>`), so rounding never accumulates over
// more than one chunk.
//
// Chunks run in parallel: S restarts from `states` at every chunk start,
// and G at a chunk's end comes from the later chunks through the carry
// K_c = a_t0' G_t0' (t0' the next chunk's first step; 0 after the last):
// K_{c-1} = L_c + (prod_{t in c} a_t) K_c, where L_c is the chunk's own
// contribution, G run through the chunk from zero
// (`ssd_scan_chunk_carry`, one block per (sequence, chunk, head), then
// `ssd_scan_carry_combine` over the chunks in reverse, per state element).
// The per-head quantities come from one block per (sequence, head, chunk)
// (`ssd_scan_backward_head`), which recomputes its chunk's states forward
// from `states` (readouts w_t) and then walks it backwards with G from K_c;
// the chunk's last q is <K_c, states[c + 1]>. dB and dC, which sum over the
// group's heads and over P, come from one block per (sequence, group, pair
// of state columns, chunk) (`ssd_scan_backward_group`), which runs the two
// elementwise recurrences again for its columns. Neither needs a history of
// states.
//
// Determinism: sums over N are per-lane sums in a fixed order then a warp
// butterfly; sums over warps are per-step partials in shared memory added
// in warp order; the q recurrence and the A and D gradients are sequential
// in a fixed order (the chunk and batch sums last, in
// `ssd_scan_backward_params`).
#include "common.cuh"

#define FULL_MASK 0xffffffffu
// Chunks whose carries `ssd_scan_carry_combine` loads before it updates them:
// 16, a 4,096-token sequence's chunks of 256 in one run of loads.
#define CARRY_RUN 16
// Steps whose per-warp partials are gathered before they are reduced.
#define WINDOW 32
// State elements one thread of the backward head kernel holds (per array):
// `cuda::launch::scan` refuses shapes that need more.
#define HEAD_MAX_ELEMENTS 16
// State columns one block of the group kernel takes, and the most (head,
// row) pairs one of its threads holds.
#define GROUP_COLUMNS 2
#define GROUP_MAX_ROWS 8

// `log(1 + exp(x))`, linear above 20 (PyTorch's threshold), as the CPU.
__device__ __forceinline__ float softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

__device__ __forceinline__ float softplus_derivative(float x) {
    return x > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-x));
}

// A step's dt and decay: the forward computes them where it needs them and
// the backward once into its scratch, with this same code, so both see the
// same bits.
__device__ __forceinline__ void step_factors(float raw, float a, float* dt, float* decay) {
    *dt = softplus(raw);
    *decay = expf(*dt * a);
}

// The backward's scratch (f32), `KernelSet::ssd_scan_backward_scratch_len`:
// [0, rows*H) dt, [rows*H, 2 rows*H) decay, [2 rows*H, 3 rows*H) readouts
// w, then per (sequence, head, chunk) the A_log and D gradient partials
// (2 each), per (sequence, chunk, head) the chunk's total decay, and the
// carries K, `[batch, chunks, H, P, N]` like `states`.
struct ScanScratch {
    float* dt;
    float* decay;
    float* readout;
    float* partials;
    float* chunk_decay;
    float* carry;
};

__device__ __forceinline__ ScanScratch scan_scratch(
    float* base, u64 batch, u64 seq, u64 heads, u64 chunks) {
    const u64 n = batch * seq * heads;
    const u64 per_chunk = batch * heads * chunks;
    float* partials = base + 3 * n;
    float* chunk_decay = partials + 2 * per_chunk;
    return ScanScratch{base, base + n, base + 2 * n, partials, chunk_decay, chunk_decay + per_chunk};
}

// ---- forward --------------------------------------------------------------------

// One warp per state row p of one (sequence, head); lane l holds the state
// columns n = l + 32k, k < R (R = 32 * R covers N). Block: up to 8 warps,
// blockIdx.x = (b * H + h) * tiles + tile, row p = tile * warps + warp.
template <int R>
__device__ __forceinline__ void scan_forward(
    const void* xbc, int xbc_dtype, const void* dt_raw, int dt_dtype, const void* dt_bias,
    int bias_dtype, const void* a_log, int a_dtype, const void* d_skip, int d_dtype, void* y,
    int y_dtype, float* states, u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state,
    u64 chunk) {
    const int lane = threadIdx.x & 31;
    const u64 warps = blockDim.x >> 5;
    const u64 tiles = (head_dim + warps - 1) / warps;
    const u64 tile = blockIdx.x % tiles;
    const u64 bh = blockIdx.x / tiles;
    const u64 h = bh % heads;
    const u64 b = bh / heads;
    const u64 p = tile * warps + (threadIdx.x >> 5);
    if (p >= head_dim) {
        return;  // the whole warp: nothing below synchronises the block
    }
    const u64 d_inner = heads * head_dim;
    const u64 width = d_inner + 2 * groups * state;
    const u64 g = h / (heads / groups);
    const u64 x_col = h * head_dim + p;
    const u64 b_col = d_inner + g * state;
    const u64 c_col = d_inner + (groups + g) * state;
    const u64 chunks = (seq + chunk - 1) / chunk;
    const u64 pn = head_dim * state;
    const float a = -expf(load(a_log, a_dtype, h));
    const float skip = load(d_skip, d_dtype, h);
    const float bias = load(dt_bias, bias_dtype, h);

    float s[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {
        s[k] = 0.0f;
    }
    u64 next_save = 0;
    for (u64 w0 = 0; w0 < seq; w0 += WINDOW) {
        // Lane i works out step w0 + i's factors; the loop broadcasts them.
        float lane_dt = 0.0f, lane_decay = 0.0f;
        if (w0 + lane < seq) {
            const float raw = load(dt_raw, dt_dtype, (b * seq + w0 + lane) * heads + h) + bias;
            step_factors(raw, a, &lane_dt, &lane_decay);
        }
        const int steps = static_cast<int>(min(static_cast<u64>(WINDOW), seq - w0));
        for (int i = 0; i < steps; ++i) {
            const u64 t = w0 + i;
            const float dt = __shfl_sync(FULL_MASK, lane_dt, i);
            const float decay = __shfl_sync(FULL_MASK, lane_decay, i);
            if (t == next_save) {
                float* out = states + ((b * chunks + t / chunk) * heads + h) * pn + p * state;
#pragma unroll
                for (int k = 0; k < R; ++k) {
                    const u64 n = lane + 32 * k;
                    if (n < state) {
                        out[n] = s[k];
                    }
                }
                next_save += chunk;
            }
            const u64 row = (b * seq + t) * width;
            const float xp = load(xbc, xbc_dtype, row + x_col);
            const float dx = dt * xp;
            float acc = 0.0f;
#pragma unroll
            for (int k = 0; k < R; ++k) {
                const u64 n = lane + 32 * k;
                if (n < state) {
                    s[k] = decay * s[k] + dx * load(xbc, xbc_dtype, row + b_col + n);
                    acc += s[k] * load(xbc, xbc_dtype, row + c_col + n);
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) {
                store(y, y_dtype, (b * seq + t) * d_inner + x_col, acc + skip * xp);
            }
        }
    }
}

#define SCAN_FORWARD(NAME, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                        \
        const void* xbc, int xbc_dtype, const void* dt_raw, int dt_dtype, const void* dt_bias,     \
        int bias_dtype, const void* a_log, int a_dtype, const void* d_skip, int d_dtype, void* y,  \
        int y_dtype, float* states, u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state,       \
        u64 chunk) {                                                                               \
        grid_dependency_sync();                                                                    \
        scan_forward<R>(xbc, xbc_dtype, dt_raw, dt_dtype, dt_bias, bias_dtype, a_log, a_dtype,     \
                        d_skip, d_dtype, y, y_dtype, states, seq, heads, head_dim, groups, state,  \
                        chunk);                                                                    \
    }

// The suffix is the most state columns N each one takes.
SCAN_FORWARD(ssd_scan_forward_n32, 1)
SCAN_FORWARD(ssd_scan_forward_n64, 2)
SCAN_FORWARD(ssd_scan_forward_n128, 4)
SCAN_FORWARD(ssd_scan_forward_n256, 8)

// ---- backward -------------------------------------------------------------------

// dt and decay of every (row, head), into the scratch.
extern "C" __global__ void ssd_scan_factors(
    const void* dt_raw, int dt_dtype, const void* dt_bias, int bias_dtype, const void* a_log,
    int a_dtype, float* scratch, u64 batch, u64 seq, u64 heads, u64 chunks) {
    grid_dependency_sync();
    const ScanScratch sc = scan_scratch(scratch, batch, seq, heads, chunks);
    const u64 n = batch * seq * heads;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u64 h = i % heads;
        const float a = -expf(load(a_log, a_dtype, h));
        const float raw = load(dt_raw, dt_dtype, i) + load(dt_bias, bias_dtype, h);
        step_factors(raw, a, &sc.dt[i], &sc.decay[i]);
    }
}

// L_c of every chunk but the first (whose carry nothing reads): one block
// per (sequence, chunk, head), blockIdx.x = (b * chunks + c) * H + h, laid
// out as the head kernel (warp w holds rows p = w + warps j, lane l
// columns n = l + 32k). G runs backwards through the chunk from zero,
// exactly as the head kernel's loop: G += dy_t C_t^T, then G *= a_t. Writes
// L_c into the carry slot of chunk c, and the chunk's total decay (the
// product of its a_t, last step first).
template <int R>
__device__ __forceinline__ void scan_chunk_carry(
    const void* xbc, int xbc_dtype, const void* dy, int dy_dtype, float* scratch, u64 batch,
    u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    constexpr int MAX_J = HEAD_MAX_ELEMENTS / R;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const u64 chunks = (seq + chunk - 1) / chunk;
    const u64 h = blockIdx.x % heads;
    const u64 c = (blockIdx.x / heads) % chunks;
    const u64 b = blockIdx.x / (heads * chunks);
    const ScanScratch sc = scan_scratch(scratch, batch, seq, heads, chunks);
    const u64 t0 = c * chunk;
    const u64 t1 = min(t0 + chunk, seq);
    if (c == 0) {
        return;  // the whole block
    }
    const u64 d_inner = heads * head_dim;
    const u64 width = d_inner + 2 * groups * state;
    const u64 g = h / (heads / groups);
    const u64 x_col = h * head_dim;
    const u64 c_col = d_inner + (groups + g) * state;
    const int rows_per_warp = static_cast<int>((head_dim + warps - 1) / warps);
    const int P = static_cast<int>(head_dim);
    const int N = static_cast<int>(state);
    const auto row_p = [&](int j) { return warp + warps * j; };
    const auto row_ok = [&](int j) { return j < rows_per_warp && row_p(j) < P; };
    float gr[MAX_J][R];
#pragma unroll
    for (int j = 0; j < MAX_J; ++j) {
#pragma unroll
        for (int k = 0; k < R; ++k) {
            gr[j][k] = 0.0f;
        }
    }
    float total = 1.0f;
    for (u64 t = t1; t-- > t0;) {
        const u64 r = b * seq + t;
        const u64 row = r * width;
        const float decay = sc.decay[r * heads + h];
        float cn[R];
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const int n = lane + 32 * k;
            cn[k] = n < N ? load(xbc, xbc_dtype, row + c_col + n) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < MAX_J; ++j) {
            if (row_ok(j)) {
                const float dyp = load(dy, dy_dtype, r * d_inner + x_col + row_p(j));
#pragma unroll
                for (int k = 0; k < R; ++k) {
                    gr[j][k] = (gr[j][k] + dyp * cn[k]) * decay;
                }
            }
        }
        total *= decay;
    }
    float* out = sc.carry + ((b * chunks + c) * heads + h) * head_dim * state;
#pragma unroll
    for (int j = 0; j < MAX_J; ++j) {
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const int n = lane + 32 * k;
            if (row_ok(j) && n < N) {
                out[row_p(j) * state + n] = gr[j][k];
            }
        }
    }
    if (threadIdx.x == 0) {
        sc.chunk_decay[(b * chunks + c) * heads + h] = total;
    }
}

#define SCAN_CHUNK_CARRY(NAME, R)                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) NAME(                                       \
        const void* xbc, int xbc_dtype, const void* dy, int dy_dtype, float* scratch, u64 batch,   \
        u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {                      \
        grid_dependency_sync();                                                                    \
        scan_chunk_carry<R>(xbc, xbc_dtype, dy, dy_dtype, scratch, batch, seq, heads, head_dim,    \
                            groups, state, chunk);                                                 \
    }

SCAN_CHUNK_CARRY(ssd_scan_chunk_carry_n32, 1)
SCAN_CHUNK_CARRY(ssd_scan_chunk_carry_n64, 2)
SCAN_CHUNK_CARRY(ssd_scan_chunk_carry_n128, 4)
SCAN_CHUNK_CARRY(ssd_scan_chunk_carry_n256, 8)

// A thread takes W consecutive state elements (W = 4 where `pn` is a
// multiple of 4 and the arrays are aligned to it).
template <int W>
__device__ __forceinline__ void carry_combine(float* carry, __nv_bfloat16* copy,
                                              const float* chunk_decay, u64 batch, u64 heads,
                                              u64 pn, u64 chunks) {
    const u64 n = batch * heads * pn / W;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u64 e = (i % (pn / W)) * W;
        const u64 h = (i / (pn / W)) % heads;
        const u64 b = i / (pn / W * heads);
        float next[W];
#pragma unroll
        for (int w = 0; w < W; ++w) {
            next[w] = 0.0f;
        }
        // CARRY_RUN chunks' loads at a time (last first), then their
        // sequential updates: the loads do not wait on the stores before
        // them.
        for (u64 end = chunks; end > 0; end = end > CARRY_RUN ? end - CARRY_RUN : 0) {
            float own[CARRY_RUN][W], decay[CARRY_RUN];
#pragma unroll
            for (int u = 0; u < CARRY_RUN; ++u) {
                if (static_cast<u64>(u) < end) {
                    const u64 c = end - 1 - u;
                    if (c > 0) {
                        load_run<W>(carry + ((b * chunks + c) * heads + h) * pn + e, own[u]);
                    }
                    decay[u] = chunk_decay[(b * chunks + c) * heads + h];
                }
            }
#pragma unroll
            for (int u = 0; u < CARRY_RUN; ++u) {
                if (static_cast<u64>(u) < end) {
                    const u64 c = end - 1 - u;
                    const u64 at = ((b * chunks + c) * heads + h) * pn + e;
                    store_run<W>(carry + at, next);
                    if (copy != nullptr) {
                        store_run_bf16<W>(copy + at, next);
                    }
                    if (c > 0) {
#pragma unroll
                        for (int w = 0; w < W; ++w) {
                            next[w] = own[u][w] + decay[u] * next[w];
                        }
                    }
                }
            }
        }
    }
}

// The carries K_c from the chunks' own L_c, per (sequence, head, state
// element), last chunk first: K_last = 0, K_{c-1} = L_c + decay_c K_c
// (overwriting L_c's slot with K_c as it goes). `carry` is `[batch, chunks,
// H, P, N]` and `chunk_decay` `[batch, chunks, H]`; the chunked backward
// (`scan_chunked.cu`) shares this kernel, and may pass `copy` (same layout,
// bf16) for the carries as its GEMMs' bf16 operands (null: none).
// `quads`: four elements a thread (see `carry_combine`).
extern "C" __global__ void ssd_scan_carry_combine(
    float* carry, __nv_bfloat16* copy, const float* chunk_decay, u64 batch, u64 heads, u64 pn,
    u64 chunks, int quads) {
    grid_dependency_sync();
    if (quads) {
        carry_combine<4>(carry, copy, chunk_decay, batch, heads, pn, chunks);
    } else {
        carry_combine<1>(carry, copy, chunk_decay, batch, heads, pn, chunks);
    }
}

// One block per (sequence, head, chunk): blockIdx.x = (b * H + h) * chunks
// + c. Warp w holds the state rows p = w + warps * j (j < J), lane l the
// columns n = l + 32k (k < R): J * R <= HEAD_MAX_ELEMENTS elements of S and
// of G a thread. Writes the chunk's dx (the head's x columns of dxbc) and
// d dt, and its A_log and D gradient partials.
template <int R>
__device__ __forceinline__ void scan_backward_head(
    const void* xbc, int xbc_dtype, const void* dt_raw, int dt_dtype, const void* dt_bias,
    int bias_dtype, const void* a_log, int a_dtype, const void* d_skip, int d_dtype,
    const float* states, const void* dy, int dy_dtype, void* dxbc, int dxbc_dtype, void* ddt,
    int ddt_dtype, float* scratch, u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state,
    u64 chunk) {
    constexpr int MAX_J = HEAD_MAX_ELEMENTS / R;
    // Per-step, per-warp partial sums (w, then x . G B) of one window.
    __shared__ float part[WINDOW][33];
    __shared__ float window_m[WINDOW];
    __shared__ float window_xgb[WINDOW];
    __shared__ float window_q[WINDOW];
    __shared__ float sum_scratch[32];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const u64 chunks = (seq + chunk - 1) / chunk;
    const u64 batch = gridDim.x / (heads * chunks);
    const u64 c = blockIdx.x % chunks;
    const u64 h = (blockIdx.x / chunks) % heads;
    const u64 b = blockIdx.x / (chunks * heads);
    const ScanScratch sc = scan_scratch(scratch, batch, seq, heads, chunks);
    const u64 d_inner = heads * head_dim;
    const u64 width = d_inner + 2 * groups * state;
    const u64 g = h / (heads / groups);
    const u64 x_col = h * head_dim;
    const u64 b_col = d_inner + g * state;
    const u64 c_col = d_inner + (groups + g) * state;
    const u64 pn = head_dim * state;
    const int rows_per_warp = static_cast<int>((head_dim + warps - 1) / warps);
    const float a = -expf(load(a_log, a_dtype, h));
    const float skip = load(d_skip, d_dtype, h);
    const float bias = load(dt_bias, bias_dtype, h);

    // Slot (j, k) of a thread holds row p = warp + warps j (a state row when
    // j < rows_per_warp and p < P, the same for the whole warp) and column
    // n = lane + 32 k (a state column when n < N). The launcher keeps P and
    // N far below 2^31.
    const int P = static_cast<int>(head_dim);
    const int N = static_cast<int>(state);
    const auto row_p = [&](int j) { return warp + warps * j; };
    const auto row_ok = [&](int j) { return j < rows_per_warp && row_p(j) < P; };
    float s[MAX_J][R];
    float gr[MAX_J][R];
    // G enters the chunk's last step as the carry K_c; the q after that
    // step is a_t1 <G_t1, S_{t1-1}> = <K_c, states[c + 1]> (0 after the
    // last chunk, whose carry is 0).
    const float* carry = sc.carry + ((b * chunks + c) * heads + h) * pn;
    const float* next_start =
        states + ((b * chunks + min(c + 1, chunks - 1)) * heads + h) * pn;
    float next_inner = 0.0f;
#pragma unroll
    for (int j = 0; j < MAX_J; ++j) {
#pragma unroll
        for (int k = 0; k < R; ++k) {
            const int n = lane + 32 * k;
            const bool ok = row_ok(j) && n < N;
            gr[j][k] = ok ? carry[row_p(j) * state + n] : 0.0f;
            if (ok && c + 1 < chunks) {
                next_inner += gr[j][k] * next_start[row_p(j) * state + n];
            }
        }
    }
    // Thread 0 of warp 0 carries the q recurrence and the A gradient.
    float q_next = block_sum(next_inner, sum_scratch), d_a = 0.0f;
    // Every lane of a warp holds its warp's sum of dy . x.
    float d_skip_sum = 0.0f;
    float anchor = 0.0f;

    {
        const u64 t0 = c * chunk;
        const u64 t1 = min(t0 + chunk, seq);
        const float* start = states + ((b * chunks + c) * heads + h) * pn;
#pragma unroll
        for (int j = 0; j < MAX_J; ++j) {
#pragma unroll
            for (int k = 0; k < R; ++k) {
                const int n = lane + 32 * k;
                s[j][k] = row_ok(j) && n < N ? start[row_p(j) * state + n] : 0.0f;
            }
        }

        // Forward through the chunk: S_t and the readouts w_t = dy_t . (S_t C_t).
        for (u64 w0 = t0; w0 < t1; w0 += WINDOW) {
            const int steps = static_cast<int>(min(static_cast<u64>(WINDOW), t1 - w0));
            for (int i = 0; i < steps; ++i) {
                const u64 r = b * seq + w0 + i;
                const u64 row = r * width;
                const float dt = sc.dt[r * heads + h];
                const float decay = sc.decay[r * heads + h];
                float bn[R], cn[R];
#pragma unroll
                for (int k = 0; k < R; ++k) {
                    const int n = lane + 32 * k;
                    bn[k] = n < N ? load(xbc, xbc_dtype, row + b_col + n) : 0.0f;
                    cn[k] = n < N ? load(xbc, xbc_dtype, row + c_col + n) : 0.0f;
                }
                float w_part = 0.0f;
#pragma unroll
                for (int j = 0; j < MAX_J; ++j) {
                    if (row_ok(j)) {  // the same for the whole warp
                        const float xp = load(xbc, xbc_dtype, row + x_col + row_p(j));
                        const float dyp = load(dy, dy_dtype, r * d_inner + x_col + row_p(j));
                        const float dx = dt * xp;
                        float acc = 0.0f;
#pragma unroll
                        for (int k = 0; k < R; ++k) {
                            if (lane + 32 * k < N) {
                                s[j][k] = decay * s[j][k] + dx * bn[k];
                                acc += s[j][k] * cn[k];
                            }
                        }
                        w_part += dyp * warp_sum(acc);
                        d_skip_sum += dyp * xp;
                    }
                }
                if (lane == 0) {
                    part[i][warp] = w_part;
                }
            }
            __syncthreads();
            if (static_cast<int>(threadIdx.x) < steps) {
                float w_sum = 0.0f;
                for (int v = 0; v < warps; ++v) {
                    w_sum += part[threadIdx.x][v];
                }
                sc.readout[(b * seq + w0 + threadIdx.x) * heads + h] = w_sum;
            }
            __syncthreads();
        }

        // Backward through the chunk, a window at a time: G, dx, x . (G B);
        // then the window's q, d dt and d A in step order by warp 0.
        for (u64 w1 = t1; w1 > t0;) {
            const u64 w0 = w1 - t0 > WINDOW ? w1 - WINDOW : t0;
            const int steps = static_cast<int>(w1 - w0);
            for (int i = steps - 1; i >= 0; --i) {
                const u64 t = w0 + i;
                const u64 r = b * seq + t;
                const u64 row = r * width;
                const float dt = sc.dt[r * heads + h];
                const float decay = sc.decay[r * heads + h];
                float bn[R], cn[R];
#pragma unroll
                for (int k = 0; k < R; ++k) {
                    const int n = lane + 32 * k;
                    bn[k] = n < N ? load(xbc, xbc_dtype, row + b_col + n) : 0.0f;
                    cn[k] = n < N ? load(xbc, xbc_dtype, row + c_col + n) : 0.0f;
                }
                float xgb_part = 0.0f;
#pragma unroll
                for (int j = 0; j < MAX_J; ++j) {
                    if (row_ok(j)) {
                        const float xp = load(xbc, xbc_dtype, row + x_col + row_p(j));
                        const float dyp = load(dy, dy_dtype, r * d_inner + x_col + row_p(j));
                        float acc = 0.0f;
#pragma unroll
                        for (int k = 0; k < R; ++k) {
                            if (lane + 32 * k < N) {
                                gr[j][k] = gr[j][k] + dyp * cn[k];
                                acc += gr[j][k] * bn[k];
                            }
                        }
                        const float gb = warp_sum(acc);
                        if (lane == 0) {
                            store(dxbc, dxbc_dtype, row + x_col + row_p(j), skip * dyp + dt * gb);
                        }
                        xgb_part += xp * gb;
                    }
                }
                if (lane == 0) {
                    part[i][warp] = xgb_part;
                }
#pragma unroll
                for (int j = 0; j < MAX_J; ++j) {
#pragma unroll
                    for (int k = 0; k < R; ++k) {
                        gr[j][k] *= decay;
                    }
                }
                if (t == t0) {
                    // q_t0 = a_t0 <G_t0, S_{t0-1}>, S_{t0-1} being the saved start.
                    float inner = 0.0f;
#pragma unroll
                    for (int j = 0; j < MAX_J; ++j) {
#pragma unroll
                        for (int k = 0; k < R; ++k) {
                            const int n = lane + 32 * k;
                            if (row_ok(j) && n < N) {
                                inner += gr[j][k] * start[row_p(j) * state + n];
                            }
                        }
                    }
                    anchor = block_sum(inner, sum_scratch);
                }
            }
            __syncthreads();
            if (warp == 0) {
                if (lane < steps) {
                    const u64 r = b * seq + w0 + lane;
                    float xgb = 0.0f;
                    for (int v = 0; v < warps; ++v) {
                        xgb += part[lane][v];
                    }
                    window_xgb[lane] = xgb;
                    window_m[lane] = sc.readout[r * heads + h] - sc.dt[r * heads + h] * xgb;
                }
                __syncwarp();
                if (lane == 0) {
                    float q = q_next;
                    for (int i = steps - 1; i >= 0; --i) {
                        const u64 t = w0 + i;
                        q = t == t0 ? anchor : q + window_m[i];
                        window_q[i] = q;
                        d_a += q * sc.dt[(b * seq + t) * heads + h];
                    }
                    q_next = q;
                }
                __syncwarp();
                if (lane < steps) {
                    const u64 at = (b * seq + w0 + lane) * heads + h;
                    const float raw = load(dt_raw, dt_dtype, at) + bias;
                    const float d_dt = window_xgb[lane] + window_q[lane] * a;
                    store(ddt, ddt_dtype, at, d_dt * softplus_derivative(raw));
                }
            }
            __syncthreads();
            w1 = w0;
        }
    }
    // A = -exp(A_log), so dA/dA_log = A.
    const float skip_total = block_sum(lane == 0 ? d_skip_sum : 0.0f, sum_scratch);
    if (threadIdx.x == 0) {
        const u64 slot = ((b * heads + h) * chunks + c) * 2;
        sc.partials[slot] = d_a * a;
        sc.partials[slot + 1] = skip_total;
    }
}

#define SCAN_BACKWARD_HEAD(NAME, R)                                                                \
    extern "C" __global__ void __launch_bounds__(1024) NAME(                                       \
        const void* xbc, int xbc_dtype, const void* dt_raw, int dt_dtype, const void* dt_bias,     \
        int bias_dtype, const void* a_log, int a_dtype, const void* d_skip, int d_dtype,           \
        const float* states, const void* dy, int dy_dtype, void* dxbc, int dxbc_dtype, void* ddt,  \
        int ddt_dtype, float* scratch, u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state,    \
        u64 chunk) {                                                                               \
        grid_dependency_sync();                                                                    \
        scan_backward_head<R>(xbc, xbc_dtype, dt_raw, dt_dtype, dt_bias, bias_dtype, a_log,        \
                              a_dtype, d_skip, d_dtype, states, dy, dy_dtype, dxbc, dxbc_dtype,    \
                              ddt, ddt_dtype, scratch, seq, heads, head_dim, groups, state,        \
                              chunk);                                                              \
    }

SCAN_BACKWARD_HEAD(ssd_scan_backward_head_n32, 1)
SCAN_BACKWARD_HEAD(ssd_scan_backward_head_n64, 2)
SCAN_BACKWARD_HEAD(ssd_scan_backward_head_n128, 4)
SCAN_BACKWARD_HEAD(ssd_scan_backward_head_n256, 8)

// Adds a window's per-warp partials of the group kernel in warp order and
// stores column n0 + c of rows first_row + i (i < steps) at `col`.
__device__ __forceinline__ void window_columns(
    const float (*part)[GROUP_COLUMNS][33], int steps, int warps, u64 n0, u64 state, u64 first_row,
    u64 width, u64 col, void* dxbc, int dxbc_dtype) {
    for (int e = threadIdx.x; e < steps * GROUP_COLUMNS; e += blockDim.x) {
        const int i = e / GROUP_COLUMNS;
        const int c = e % GROUP_COLUMNS;
        if (n0 + c < state) {
            float sum = 0.0f;
            for (int w = 0; w < warps; ++w) {
                sum += part[i][c][w];
            }
            store(dxbc, dxbc_dtype, (first_row + i) * width + col + n0 + c, sum);
        }
    }
}

// Where a block of a group kernel works: blockIdx.x = ((b * G + g) *
// tiles + tile) * chunks + c, `columns` state columns a tile, and the
// layout of the group's rows in an `xbc` row (x, B, C columns).
struct GroupBlock {
    u64 b, g, n0, chunk_index, t0, t1, chunks;
    u64 d_inner, width, x_col, b_col, c_col, pn, first_head, heads_per_group;
};

__device__ __forceinline__ GroupBlock group_block(
    u64 columns, u64 seq, u64 heads, u64 head_dim, u64 groups, u64 state, u64 chunk) {
    GroupBlock k;
    k.chunks = (seq + chunk - 1) / chunk;
    k.chunk_index = blockIdx.x % k.chunks;
    k.t0 = k.chunk_index * chunk;
    k.t1 = min(k.t0 + chunk, seq);
    const u64 tiles = (state + columns - 1) / columns;
    k.n0 = (blockIdx.x / k.chunks % tiles) * columns;
    const u64 bg = blockIdx.x / k.chunks / tiles;
    k.g = bg % groups;
    k.b = bg / groups;
    k.heads_per_group = heads / groups;
    k.first_head = k.g * k.heads_per_group;
    k.d_inner = heads * head_dim;
    k.width = k.d_inner + 2 * groups * state;
    k.x_col = k.first_head * head_dim;
    k.b_col = k.d_inner + k.g * state;
    k.c_col = k.d_inner + (groups + k.g) * state;
    k.pn = head_dim * state;
    return k;
}

// dB and dC: one block per (sequence, group, pair of state columns,
// chunk), blockIdx.x = ((b * G + g) * ceil(N / 2) + pair) * chunks + c.
// The group's heads' rows
// q = hl * P + p (Q = H/G * P of them, contiguous in an `xbc` row) are
// spread over the block: warp w, lane l holds q = l + 32 (w + warps j),
// j < J <= GROUP_MAX_ROWS, for both columns. Forward, S from the chunk
// starts gives dC_t[n] = sum_q S_t[q, n] dy_t[q]; backward, G gives
// dB_t[n] = sum_q (dt_t G_t[q, n]) x_t[q], G entering the chunk as its
// carry.
extern "C" __global__ void __launch_bounds__(1024) ssd_scan_backward_group(
    const void* xbc, int xbc_dtype, const float* states, const void* dy, int dy_dtype, void* dxbc,
    int dxbc_dtype, float* scratch, u64 batch, u64 seq, u64 heads, u64 head_dim, u64 groups,
    u64 state, u64 chunk) {
    grid_dependency_sync();
    __shared__ float part[WINDOW][GROUP_COLUMNS][33];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const GroupBlock k = group_block(GROUP_COLUMNS, seq, heads, head_dim, groups, state, chunk);
    const u64 chunks = k.chunks, c_index = k.chunk_index, t0 = k.t0, t1 = k.t1, n0 = k.n0;
    const u64 g = k.g, b = k.b, heads_per_group = k.heads_per_group;
    const u64 q_count = heads_per_group * head_dim;
    const u64 d_inner = k.d_inner, width = k.width, x_col = k.x_col;
    const u64 b_col = k.b_col, c_col = k.c_col, pn = k.pn;
    const int rows_per_thread =
        static_cast<int>((q_count + 32 * static_cast<u64>(warps) - 1) / (32 * static_cast<u64>(warps)));
    const ScanScratch sc = scan_scratch(scratch, batch, seq, heads, chunks);

    // Slot j of a thread holds pair q = lane + 32 (warp + warps j) when
    // j < rows_per_thread and q < Q (the launcher keeps Q below 2^31), whose
    // head is head_of[j].
    const int Q = static_cast<int>(q_count);
    const auto q_of = [&](int j) { return lane + 32 * (warp + warps * j); };
    const auto q_ok = [&](int j) { return j < rows_per_thread && q_of(j) < Q; };
    u64 head_of[GROUP_MAX_ROWS];
#pragma unroll
    for (int j = 0; j < GROUP_MAX_ROWS; ++j) {
        head_of[j] = g * heads_per_group + (q_ok(j) ? q_of(j) / head_dim : 0);
    }
    bool col_ok[GROUP_COLUMNS];
#pragma unroll
    for (int i = 0; i < GROUP_COLUMNS; ++i) {
        col_ok[i] = n0 + i < state;
    }
    float v[GROUP_MAX_ROWS][GROUP_COLUMNS];

    // Forward through the chunk: S (from its saved start), dC.
    u64 next_start = t0;
    for (u64 w0 = t0; w0 < t1; w0 += WINDOW) {
        const int steps = static_cast<int>(min(static_cast<u64>(WINDOW), t1 - w0));
        for (int i = 0; i < steps; ++i) {
            const u64 t = w0 + i;
            const u64 r = b * seq + t;
            const u64 row = r * width;
            if (t == next_start) {
                // The group's first head: its rows q continue over the group's heads.
                const float* start = states + ((b * chunks + t / chunk) * heads + g * heads_per_group) * pn;
#pragma unroll
                for (int j = 0; j < GROUP_MAX_ROWS; ++j) {
#pragma unroll
                    for (int c = 0; c < GROUP_COLUMNS; ++c) {
                        v[j][c] = q_ok(j) && col_ok[c] ? start[q_of(j) * state + n0 + c] : 0.0f;
                    }
                }
                next_start += chunk;
            }
            float bn[GROUP_COLUMNS], acc[GROUP_COLUMNS];
#pragma unroll
            for (int c = 0; c < GROUP_COLUMNS; ++c) {
                bn[c] = col_ok[c] ? load(xbc, xbc_dtype, row + b_col + n0 + c) : 0.0f;
                acc[c] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < GROUP_MAX_ROWS; ++j) {
                if (q_ok(j)) {
                    const float dt = sc.dt[r * heads + head_of[j]];
                    const float decay = sc.decay[r * heads + head_of[j]];
                    const float dx = dt * load(xbc, xbc_dtype, row + x_col + q_of(j));
                    const float dyq = load(dy, dy_dtype, r * d_inner + x_col + q_of(j));
#pragma unroll
                    for (int c = 0; c < GROUP_COLUMNS; ++c) {
                        if (col_ok[c]) {
                            v[j][c] = decay * v[j][c] + dx * bn[c];
                            acc[c] += v[j][c] * dyq;
                        }
                    }
                }
            }
#pragma unroll
            for (int c = 0; c < GROUP_COLUMNS; ++c) {
                acc[c] = warp_sum(acc[c]);
                if (lane == 0) {
                    part[i][c][warp] = acc[c];
                }
            }
        }
        __syncthreads();
        window_columns(part, steps, warps, n0, state, b * seq + w0, width, c_col, dxbc, dxbc_dtype);
        __syncthreads();
    }

    // Backward through the chunk: G (from its carry), dB.
    const float* carry = sc.carry + ((b * chunks + c_index) * heads + g * heads_per_group) * pn;
#pragma unroll
    for (int j = 0; j < GROUP_MAX_ROWS; ++j) {
#pragma unroll
        for (int c = 0; c < GROUP_COLUMNS; ++c) {
            v[j][c] = q_ok(j) && col_ok[c] ? carry[q_of(j) * state + n0 + c] : 0.0f;
        }
    }
    for (u64 w1 = t1; w1 > t0;) {
        const u64 w0 = w1 - t0 > WINDOW ? w1 - WINDOW : t0;
        const int steps = static_cast<int>(w1 - w0);
        for (int i = steps - 1; i >= 0; --i) {
            const u64 r = b * seq + w0 + i;
            const u64 row = r * width;
            float cn[GROUP_COLUMNS], acc[GROUP_COLUMNS];
#pragma unroll
            for (int c = 0; c < GROUP_COLUMNS; ++c) {
                cn[c] = col_ok[c] ? load(xbc, xbc_dtype, row + c_col + n0 + c) : 0.0f;
                acc[c] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < GROUP_MAX_ROWS; ++j) {
                if (q_ok(j)) {
                    const float dt = sc.dt[r * heads + head_of[j]];
                    const float decay = sc.decay[r * heads + head_of[j]];
                    const float xq = load(xbc, xbc_dtype, row + x_col + q_of(j));
                    const float dyq = load(dy, dy_dtype, r * d_inner + x_col + q_of(j));
#pragma unroll
                    for (int c = 0; c < GROUP_COLUMNS; ++c) {
                        if (col_ok[c]) {
                            v[j][c] = v[j][c] + dyq * cn[c];
                            acc[c] += dt * v[j][c] * xq;
                            v[j][c] *= decay;
                        }
                    }
                }
            }
#pragma unroll
            for (int c = 0; c < GROUP_COLUMNS; ++c) {
                acc[c] = warp_sum(acc[c]);
                if (lane == 0) {
                    part[i][c][warp] = acc[c];
                }
            }
        }
        __syncthreads();
        window_columns(part, steps, warps, n0, state, b * seq + w0, width, b_col, dxbc, dxbc_dtype);
        __syncthreads();
        w1 = w0;
    }
}

// grads.a_log[h] += sum_b sum_c partial_a[b, h, c] and grads.d[h] += sum_b
// sum_c partial_d[b, h, c]: each sequence's chunks summed (in order), then
// added in sequence order (as the CPU adds each sequence's). `partials` is
// `[batch, H, chunks, 2]`; the chunked backward shares this kernel.
extern "C" __global__ void ssd_scan_backward_params(
    const float* partials, u64 batch, u64 heads, u64 chunks, void* d_a_log, int a_dtype,
    void* d_d, int d_dtype) {
    grid_dependency_sync();
    for (u64 h = grid_start(); h < heads; h += grid_stride()) {
        float da = load(d_a_log, a_dtype, h);
        float dd = load(d_d, d_dtype, h);
        for (u64 b = 0; b < batch; ++b) {
            float sa = 0.0f, sd = 0.0f;
            for (u64 c = 0; c < chunks; ++c) {
                sa += partials[((b * heads + h) * chunks + c) * 2];
                sd += partials[((b * heads + h) * chunks + c) * 2 + 1];
            }
            da += sa;
            dd += sd;
        }
        store(d_a_log, a_dtype, h, da);
        store(d_d, d_dtype, h, dd);
    }
}

// What both paths of the gated delta rule share (`delta.cu`, the f32
// kernels on CUDA cores, and `delta_tensor_core.cu`, the bf16 kernels on
// tensor cores): the launch parameters, the scratch's layout, the gates and
// where an item (a sequence's chunk of a value head) is. The backward's
// last two kernels (`delta_backward_norm`, `delta_backward_a_log`) finish
// both paths, so both write the per-value-head gradients and A_log's
// partials where this layout puts them.
#pragma once
#include "common.cuh"

#define DELTA_CHUNK 64
#define DELTA_THREADS 256
// The widest key head the state kernels hold in shared memory.
#define DELTA_MAX_DK 128
// State columns (value channels) a state block takes.
#define DELTA_TILE 16
// Columns of the operands' slices `gram_64` stages in shared memory.
#define DELTA_SLICE 16
// `backend::delta::DELTA_L2_EPS`.
#define DELTA_L2_EPS 1e-6f

// The launch's views and dimensions (`DeltaParams` in `cuda/ops/delta.rs`,
// the same layout).
struct DeltaParams {
    u64 qkv, beta, alpha, dt_bias, a_log;
    // The forward's `out`, the backward's `d_out`.
    u64 out;
    // f32 `[batch, chunks, Hv, dv, dk]`.
    u64 states;
    // f32, `delta_scratch_len` elements.
    u64 scratch;
    u64 d_qkv, d_beta, d_alpha, d_a_log;
    int t_qkv, t_beta, t_alpha, t_dt_bias, t_a_log, t_out;
    int t_d_qkv, t_d_beta, t_d_alpha, t_d_a_log;
    int batch, seq, key_heads, value_heads, dk, dv, chunks, workspaces;
    float scale;
    int pad;
};

// ---- the scratch's layout (f32 elements) -------------------------------------
// [items][prep] | [items][back] | dq [rows, Hv, dk] | dk [rows, Hv, dk] |
// A_log partials [batch, Hv, chunks] | [workspaces][ws], items ordered
// (sequence, chunk, value head) as `states`. The forward uses the first part
// only. `delta_scratch_len` in `cuda/ops/delta.rs` sums the same sizes.
struct Prep {
    float* g;     // G [64]
    float* beta;  // beta [64]
    float* kn;    // normalised k [64, dk]
    float* qn;    // normalised, scaled q [64, dk]
    float* w;     // W [64, dk]
    float* qg;    // gamma_t q_t [64, dk]
    float* kd;    // exp(G_L - G_s) k_s [64, dk]
    float* u;     // U [64, dv]
    float* m;     // (q_t . k_s) e_ts, s <= t [64, 64]
    float* t;     // T [64, 64]
    float* kke;   // (k_t . k_s) e_ts, s < t [64, 64]
};

__device__ __forceinline__ u64 prep_len(const DeltaParams& p) {
    return 128ull + 64ull * (5ull * p.dk + p.dv) + 3ull * 4096ull;
}

__device__ __forceinline__ u64 back_len(const DeltaParams& p) {
    return 128ull * p.dv + static_cast<u64>(p.dk) * p.dv;
}

__device__ __forceinline__ u64 items_of(const DeltaParams& p) {
    return static_cast<u64>(p.batch) * p.chunks * p.value_heads;
}

__device__ __forceinline__ Prep prep_at(const DeltaParams& p, u64 item) {
    float* base = reinterpret_cast<float*>(p.scratch) + item * prep_len(p);
    const u64 dk64 = 64ull * p.dk;
    Prep r;
    r.g = base;
    r.beta = base + 64;
    r.kn = base + 128;
    r.qn = r.kn + dk64;
    r.w = r.qn + dk64;
    r.qg = r.w + dk64;
    r.kd = r.qg + dk64;
    r.u = r.kd + dk64;
    r.m = r.u + 64ull * p.dv;
    r.t = r.m + 4096;
    r.kke = r.t + 4096;
    return r;
}

// What the reverse walk over the chunks leaves for each item: V', its
// gradient and the gradient of the state at the chunk's end (H layout).
struct Back {
    float* vn;   // V' [64, dv]
    float* dvn;  // dV' [64, dv]
    float* dh;   // dH_L, transposed as the states: [dv, dk]
};

__device__ __forceinline__ Back back_at(const DeltaParams& p, u64 item) {
    float* base = reinterpret_cast<float*>(p.scratch) + items_of(p) * prep_len(p) + item * back_len(p);
    Back r;
    r.vn = base;
    r.dvn = base + 64ull * p.dv;
    r.dh = base + 128ull * p.dv;
    return r;
}

// The per-value-head gradients of the normalised q and k, `[rows, Hv, dk]`.
__device__ __forceinline__ float* dq_rows(const DeltaParams& p) {
    return reinterpret_cast<float*>(p.scratch) + items_of(p) * (prep_len(p) + back_len(p));
}
__device__ __forceinline__ float* dk_rows(const DeltaParams& p) {
    return dq_rows(p) + static_cast<u64>(p.batch) * p.seq * p.value_heads * p.dk;
}
__device__ __forceinline__ float* a_log_parts(const DeltaParams& p) {
    return dk_rows(p) + static_cast<u64>(p.batch) * p.seq * p.value_heads * p.dk;
}

// A `delta_backward_chunk` block's workspace.
struct Work {
    float* dqi;  // dO H_0^T [64, dk]
    float* dkd;  // V' dH_L^T [64, dk]
    float* dw;   // dW [64, dk]
    float* dbk;  // d(beta gamma K) [64, dk]
    float* dbv;  // d(beta V) [64, dv]
    float* dm;   // dM [64, 64]
    float* dt;   // dT [64, 64]
    float* x;    // T^T dT [64, 64]
    float* da;   // dA [64, 64]
    float* e;    // e_ts = exp(G_t - G_s), s <= t [64, 64]
};

__device__ __forceinline__ u64 work_len(const DeltaParams& p) {
    return 64ull * (4ull * p.dk + p.dv) + 5ull * 4096ull;
}

__device__ __forceinline__ Work work_at(const DeltaParams& p, u64 block) {
    float* base = a_log_parts(p) + static_cast<u64>(p.batch) * p.value_heads * p.chunks + block * work_len(p);
    const u64 dk64 = 64ull * p.dk;
    Work r;
    r.dqi = base;
    r.dkd = base + dk64;
    r.dw = base + 2 * dk64;
    r.dbk = base + 3 * dk64;
    r.dbv = base + 4 * dk64;
    r.dm = r.dbv + 64ull * p.dv;
    r.dt = r.dm + 4096;
    r.x = r.dt + 4096;
    r.da = r.x + 4096;
    r.e = r.da + 4096;
    return r;
}

// ---- gates -----------------------------------------------------------------
// As the CPU reference computes them (`cpu::ops::delta`): softplus linear
// above 20.
__device__ __forceinline__ float delta_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}
__device__ __forceinline__ float delta_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}
__device__ __forceinline__ float delta_softplus_derivative(float x) {
    return x > 20.0f ? 1.0f : delta_sigmoid(x);
}

// Where an item is: sequence, chunk, value head, key head, first step and
// steps (the last chunk may be short).
struct Item {
    int b, c, j, i, t0, len;
};

__device__ __forceinline__ Item item_of(const DeltaParams& p, u64 item) {
    Item it;
    it.j = static_cast<int>(item % p.value_heads);
    it.c = static_cast<int>((item / p.value_heads) % p.chunks);
    it.b = static_cast<int>(item / (static_cast<u64>(p.value_heads) * p.chunks));
    it.i = it.j / (p.value_heads / p.key_heads);
    it.t0 = it.c * DELTA_CHUNK;
    it.len = min(DELTA_CHUNK, p.seq - it.t0);
    return it;
}

__device__ __forceinline__ u64 qkv_width(const DeltaParams& p) {
    return 2ull * p.key_heads * p.dk + static_cast<u64>(p.value_heads) * p.dv;
}

// The row of step `t` of the item's chunk.
__device__ __forceinline__ u64 row_of(const DeltaParams& p, const Item& it, int t) {
    return static_cast<u64>(it.b) * p.seq + it.t0 + t;
}

// The gates' gradients of one item, by one thread, once `s_dg` holds G's
// gradient per step (without G_L's own terms) and `s_dbeta` beta's: G_L's
// own terms (through gamma_L H_0, `hd` = the sum of H_0 dH_L, and the
// decayed keys `s_kd`), then g's gradient (the reverse running sum of G's)
// into d_alpha, beta's through its sigmoid into d_beta, and the item's
// partial of A_log's gradient. The running sum and A_log's (a sum over steps
// with cancellation) are kept in f64.
__device__ __forceinline__ void delta_gate_grads(const DeltaParams& p, const Item& it, float hd, const float* s_g,
                                                 const float* s_kd, const float* s_beta, const float* s_dbeta,
                                                 float* s_dg) {
    float last = expf(s_g[it.len - 1]) * hd;
    for (int s = 0; s < it.len; ++s) {
        last += s_kd[s];
    }
    s_dg[it.len - 1] += last;
    const float a = expf(load(reinterpret_cast<const void*>(p.a_log), p.t_a_log, it.j));
    const float dt_bias = load(reinterpret_cast<const void*>(p.dt_bias), p.t_dt_bias, it.j);
    double dg_sum = 0.0;
    double a_log = 0.0;
    for (int t = it.len - 1; t >= 0; --t) {
        dg_sum += s_dg[t];
        const float dg = static_cast<float>(dg_sum);
        const u64 at = row_of(p, it, t) * p.value_heads + it.j;
        const float raw = load(reinterpret_cast<const void*>(p.alpha), p.t_alpha, at) + dt_bias;
        const float g = -a * delta_softplus(raw);
        const float beta = s_beta[t];
        store(reinterpret_cast<void*>(p.d_beta), p.t_d_beta, at, s_dbeta[t] * beta * (1.0f - beta));
        store(reinterpret_cast<void*>(p.d_alpha), p.t_d_alpha, at, dg * -a * delta_softplus_derivative(raw));
        a_log += dg_sum * g;
    }
    a_log_parts(p)[(static_cast<u64>(it.b) * p.value_heads + it.j) * p.chunks + it.c] = static_cast<float>(a_log);
}

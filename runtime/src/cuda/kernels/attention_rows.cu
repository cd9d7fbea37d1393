// The row-wise half of attention computed through cuBLAS
// (`cuda::launch::attention`, the GEMM path): cuBLAS makes the scaled scores
// `scale q k^T` and the probability gradient `dout v^T` as whole
// `[seq, seq]` f32 matrices per head (a strided batch of `items` heads);
// these kernels turn scores into probabilities and probability gradients
// into score gradients, one block per (item, query row t),
// blockIdx.x = item * seq + t. The causal mask is applied here: entries with
// u > t are written as exact zeros, so the full-matrix GEMMs that follow
// compute causal sums.
//
// In bf16 the matrices these kernels write feed bf16 GEMMs, and rounding a
// probability (or a score gradient) to bf16 once would put an error of
// 2^-9 of it into every product, more than the one rounding at the store
// the backend contract allows. So they are written as two bf16 matrices,
// `high = bf16(v)` and `low = bf16(v - high)` (v to about 2^-17), and the
// GEMMs run once over each into an f32 accumulator. In f32, `low` is null
// and `high` holds v.
//
// Every sum is per-thread strided partials then the block tree, a fixed
// order for given sizes: equal inputs give equal bits.
#include "common.cuh"

// Stores v at i of `high`, and its remainder at i of `low` when there is one.
__device__ __forceinline__ void store_split(void* high, void* low, int dtype, u64 i, float v) {
    store(high, dtype, i, v);
    if (low != nullptr) {
        store(low, dtype, i, v - load(high, dtype, i));
    }
}

// The value `store_split` stored at i.
__device__ __forceinline__ float load_split(const void* high, const void* low, int dtype, u64 i) {
    const float v = load(high, dtype, i);
    return low != nullptr ? v + load(low, dtype, i) : v;
}

// probs[i, t, u] = exp(scores[i, t, u] - lse(i, t)) for u <= t, else 0,
// stored split in `probs_dtype` (`low` null in f32). With `find_lse`, lse(i, t) = m + log(sum_{u<=t}
// exp(scores - m)), m the row's maximum, is computed and stored at
// lse[t * lse_row + i * lse_item]; without, it is read from there (the
// backward recomputes the forward's probabilities bit for bit).
extern "C" __global__ void attention_probs(
    const float* scores, void* probs, void* low, int probs_dtype, float* lse, u32 seq,
    u32 lse_row, u32 lse_item, int find_lse) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    const u64 item = blockIdx.x / seq;
    const u64 t = blockIdx.x % seq;
    const u64 base = (item * seq + t) * seq;
    const float* s = scores + base;
    float* row_lse = lse + t * lse_row + item * lse_item;
    float l;
    if (find_lse) {
        float m = neg_inf();
        for (u64 u = threadIdx.x; u <= t; u += blockDim.x) {
            m = fmaxf(m, s[u]);
        }
        m = block_max(m, scratch);
        float sum = 0.0f;
        for (u64 u = threadIdx.x; u <= t; u += blockDim.x) {
            sum += expf(s[u] - m);
        }
        sum = block_sum(sum, scratch);
        l = m + logf(sum);
        if (threadIdx.x == 0) {
            *row_lse = l;
        }
    } else {
        l = *row_lse;
    }
    for (u64 u = threadIdx.x; u < seq; u += blockDim.x) {
        store_split(probs, low, probs_dtype, base + u, u <= t ? expf(s[u] - l) : 0.0f);
    }
}

// In place over the (split) probabilities: ds[i, t, u] = p (dp[i, t, u] -
// D) with D = dout_t . out_t over the head's v_dim channels (row t of item i
// at t * o_row + i * o_item in both), stored split in `probs_dtype`; zero
// for u > t.
extern "C" __global__ void attention_scores_grad(
    const float* dp, void* probs, void* low, int probs_dtype, const void* dout, int dout_dtype,
    const void* out, int out_dtype, u32 seq, u32 o_row, u32 o_item, u32 v_dim) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    const u64 item = blockIdx.x / seq;
    const u64 t = blockIdx.x % seq;
    const u64 base = (item * seq + t) * seq;
    const u64 o = t * o_row + item * o_item;
    float d = 0.0f;
    for (u64 c = threadIdx.x; c < v_dim; c += blockDim.x) {
        d += load(dout, dout_dtype, o + c) * load(out, out_dtype, o + c);
    }
    d = block_sum(d, scratch);
    for (u64 u = threadIdx.x; u < seq; u += blockDim.x) {
        const float ds =
            u <= t ? load_split(probs, low, probs_dtype, base + u) * (dp[base + u] - d) : 0.0f;
        store_split(probs, low, probs_dtype, base + u, ds);
    }
}

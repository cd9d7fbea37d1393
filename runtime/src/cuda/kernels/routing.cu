// MoE routing: router scores, top-k selection and weights, their backward,
// the per-expert sums of the normalised scores and the load-balancing loss
// (`Backend::moe_route_forward`, `moe_route_backward`,
// `moe_aux_loss_forward`, `moe_aux_loss_backward`). Routing state is f32.
//
// One warp per row: lane l holds experts l, l+32, ... (at most
// MAX_EXPERTS), so a row's softmax and each top-k arg-max are warp
// reductions, and selection needs no shared memory.
#include "common.cuh"

#define MAX_EXPERTS 256
#define PER_LANE (MAX_EXPERTS / 32)
// `hybridgen_dsl::config::ScoreFunction`, in declaration order.
#define SCORE_SOFTMAX 0
#define SCORE_SIGMOID 1

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// The softmax of a row held PER_LANE values a lane (absent experts -inf).
__device__ __forceinline__ void warp_softmax(const float (&z)[PER_LANE], float (&p)[PER_LANE]) {
    float max = neg_inf();
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        max = fmaxf(max, z[j]);
    }
    max = warp_max(max);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        p[j] = z[j] == neg_inf() ? 0.0f : expf(z[j] - max);
        sum += p[j];
    }
    const float inv = 1.0f / warp_sum(sum);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        p[j] *= inv;
    }
}

// The warp's top_k experts by `key` (best first, ties to the lower index)
// into out[0..top_k]; returns, on lane j < top_k, the score `p` of slot j's
// expert, and in `sum` (every lane) the selected scores' sum in slot order.
__device__ __forceinline__ float warp_top_k(
    const float (&key)[PER_LANE], const float (&p)[PER_LANE], u32 experts, u32 top_k, u32* out,
    float& sum) {
    const int lane = threadIdx.x & 31;
    bool taken[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        taken[j] = lane + 32 * j >= experts;
    }
    float my_score = 0.0f;
    sum = 0.0f;
    for (u32 slot = 0; slot < top_k; ++slot) {
        // This lane's best untaken expert, then the warp's: larger key wins,
        // equal keys go to the lower expert index.
        float best_key = neg_inf();
        u32 best = 0xffffffffu;
        float best_score = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            const u32 e = lane + 32 * j;
            if (!taken[j] && (best == 0xffffffffu || key[j] > best_key)) {
                best_key = key[j];
                best = e;
                best_score = p[j];
            }
        }
        for (int m = 16; m > 0; m >>= 1) {
            const float other_key = __shfl_xor_sync(0xffffffffu, best_key, m);
            const u32 other = __shfl_xor_sync(0xffffffffu, best, m);
            const float other_score = __shfl_xor_sync(0xffffffffu, best_score, m);
            const bool other_wins = other != 0xffffffffu &&
                (best == 0xffffffffu || other_key > best_key || (other_key == best_key && other < best));
            if (other_wins) {
                best_key = other_key;
                best = other;
                best_score = other_score;
            }
        }
        if (best % 32 == static_cast<u32>(lane)) {
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                if (lane + 32 * j == best) {
                    taken[j] = true;
                }
            }
        }
        if (static_cast<u32>(lane) == slot) {
            my_score = best_score;
            out[slot] = best;
        }
        sum += best_score;
    }
    return my_score;
}

// scores = softmax or sigmoid of the logits; selected = the top_k experts by
// scores + bias (best first, ties to the lower index); with a bias,
// unbiased = the top_k by the scores alone. weights = topk_scale times the
// selected scores normalised to sum 1, or times the raw score with sigmoid
// and top_k = 1 (Megatron normalises only when k > 1). top_k <= 32 (lane j
// keeps slot j).
extern "C" __global__ void moe_route_forward(
    const float* logits, const float* bias, float* scores, float* weights, u32* selected,
    u32* unbiased, u64 rows, u32 experts, u32 top_k, int score_function, float topk_scale) {
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const u64 r = static_cast<u64>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (r >= rows) {
        return;
    }
    float z[PER_LANE], p[PER_LANE], key[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const u32 e = lane + 32 * j;
        z[j] = e < experts ? logits[r * experts + e] : neg_inf();
    }
    if (score_function == SCORE_SOFTMAX) {
        warp_softmax(z, p);
    }
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const u32 e = lane + 32 * j;
        if (e < experts) {
            const float s = score_function == SCORE_SOFTMAX ? p[j] : sigmoid(z[j]);
            scores[r * experts + e] = s;
            p[j] = s;
            key[j] = s + (bias != nullptr ? bias[e] : 0.0f);
        } else {
            p[j] = 0.0f;
            key[j] = neg_inf();
        }
    }
    float sum = 0.0f;
    const float my_score = warp_top_k(key, p, experts, top_k, selected + r * top_k, sum);
    if (unbiased != nullptr) {
        float unused = 0.0f;
        warp_top_k(p, p, experts, top_k, unbiased + r * top_k, unused);
    }
    if (static_cast<u32>(lane) < top_k) {
        const bool raw = score_function == SCORE_SIGMOID && top_k == 1;
        weights[r * top_k + lane] = topk_scale * (raw ? my_score : my_score / sum);
    }
}

// prob_sum[e] += sum_r p_r[e], p_r the row's normalised scores: the softmax,
// or the sigmoids over their sum. Each thread recomputes its rows' max and
// denominator (E reads of a row the block's other experts also read, from
// the cache).
extern "C" __global__ void moe_prob_sum(
    const float* logits, float* prob_sum, u64 rows, u32 experts, int score_function) {
    grid_dependency_sync();
    // One block per expert, its threads striding over the rows: every SM a
    // block can take works (one block of 32 x 32 threads summed all 16
    // experts of the benchmark model, 0.2 ms a layer), and the fixed
    // stride and tree keep the sum's order, so its bits, fixed.
    __shared__ float scratch[32];
    const u32 e = blockIdx.x;
    float acc = 0.0f;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) {
        const float* z = logits + r * experts;
        if (score_function == SCORE_SOFTMAX) {
            float max = neg_inf();
            for (u32 c = 0; c < experts; ++c) {
                max = fmaxf(max, z[c]);
            }
            float sum = 0.0f;
            for (u32 c = 0; c < experts; ++c) {
                sum += expf(z[c] - max);
            }
            acc += expf(z[e] - max) * (1.0f / sum);
        } else {
            float sum = 0.0f;
            for (u32 c = 0; c < experts; ++c) {
                sum += sigmoid(z[c]);
            }
            acc += sigmoid(z[e]) / sum;
        }
    }
    const float total = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        prob_sum[e] += total;
    }
}

// d_logits from d_weights (through the scaling, the weight normalisation and
// the score function) plus aux_grad through the normalised scores p. Warp
// per row, as forward.
extern "C" __global__ void moe_route_backward(
    const float* logits, const float* scores, const u32* selected, const float* d_weights,
    const float* aux_grad, float* d_logits, u64 rows, u32 experts, u32 top_k, int score_function,
    float topk_scale, u64* status) {
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const u64 r = static_cast<u64>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (r >= rows) {
        return;
    }
    const u32* sel = selected + r * top_k;
    const float* dw = d_weights + r * top_k;
    const float* s_row = scores + r * experts;
    // Every lane computes the same two sums, slots in order.
    float sum = 0.0f;
    for (u32 j = 0; j < top_k; ++j) {
        if (sel[j] >= experts) {
            if (lane == 0) {
                report_fault(status, FAULT_EXPERT, r * top_k + j);
            }
            return;
        }
        sum += s_row[sel[j]];
    }
    // Sigmoid with k = 1: w = scale * s, no normalisation.
    const bool raw = score_function == SCORE_SIGMOID && top_k == 1;
    float weighted = 0.0f;
    for (u32 j = 0; j < top_k; ++j) {
        weighted += dw[j] * s_row[sel[j]] / sum;
    }
    float ds[PER_LANE], s[PER_LANE], a[PER_LANE];
#pragma unroll
    for (int q = 0; q < PER_LANE; ++q) {
        const u32 e = lane + 32 * q;
        ds[q] = 0.0f;
        s[q] = e < experts ? s_row[e] : 0.0f;
        a[q] = e < experts ? aux_grad[e] : 0.0f;
        if (e < experts) {
            for (u32 j = 0; j < top_k; ++j) {
                if (sel[j] == e) {
                    ds[q] += raw ? topk_scale * dw[j] : topk_scale * ((dw[j] - weighted) / sum);
                }
            }
        }
    }
    float dz[PER_LANE];
    if (score_function == SCORE_SOFTMAX) {
        // The scores are the softmax and p: one Jacobian for both terms.
        float pg = 0.0f;
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            ds[q] += a[q];
            pg += s[q] * ds[q];
        }
        pg = warp_sum(pg);
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            dz[q] = s[q] * (ds[q] - pg);
        }
    } else {
        // p_e = s_e / S over all experts: ds_j += (a_j - p . a) / S.
        float total = 0.0f;
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            total += s[q];
        }
        total = warp_sum(total);
        float pa = 0.0f;
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            pa += s[q] / total * a[q];
        }
        pa = warp_sum(pa);
#pragma unroll
        for (int q = 0; q < PER_LANE; ++q) {
            dz[q] = (ds[q] + (a[q] - pa) / total) * s[q] * (1.0f - s[q]);
        }
    }
#pragma unroll
    for (int q = 0; q < PER_LANE; ++q) {
        const u32 e = lane + 32 * q;
        if (e < experts) {
            d_logits[r * experts + e] = dz[q];
        }
    }
}

// loss[0] += coeff * E * sum_e (counts[e] / (T k)) (prob_sum[e] / T), in
// f64, experts in order. One thread: E is small and the order is the CPU's.
extern "C" __global__ void moe_aux_loss_forward(
    const u32* counts, const float* prob_sum, double* loss, u64 tokens, u64 top_k, u32 experts,
    float coeff) {
    grid_dependency_sync();
    if (threadIdx.x != 0 || blockIdx.x != 0 || tokens == 0 || coeff == 0.0f) {
        return;
    }
    const double slots = static_cast<double>(tokens * top_k);
    double sum = 0.0;
    for (u32 e = 0; e < experts; ++e) {
        sum += (static_cast<double>(counts[e]) / slots) * (static_cast<double>(prob_sum[e]) / static_cast<double>(tokens));
    }
    loss[0] += static_cast<double>(coeff) * static_cast<double>(experts) * sum;
}

// aux_grad[e] = coeff * E * (counts[e] / (T k)) / T * scale in f64, rounded once.
extern "C" __global__ void moe_aux_loss_backward(
    const u32* counts, float* aux_grad, u64 tokens, u64 top_k, u32 experts, float coeff, float scale) {
    grid_dependency_sync();
    const u32 e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= experts) {
        return;
    }
    if (tokens == 0) {
        aux_grad[e] = 0.0f;
        return;
    }
    const double slots = static_cast<double>(tokens * top_k);
    aux_grad[e] = static_cast<float>(static_cast<double>(coeff) * static_cast<double>(experts) *
                                     (static_cast<double>(counts[e]) / slots) /
                                     static_cast<double>(tokens) * static_cast<double>(scale));
}

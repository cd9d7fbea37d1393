// DeepSeek sparse attention (`D` layers, `backend::sparse_attention`): the
// lightning indexer's scores, its causal top-k, its KL loss against the main
// attention and its backward, softmax attention over the selected keys and
// its backward, and the LayerNorm (with bias) of the indexer's keys.
//
// Every dot product is summed in the CPU backend's order (`dot`: eight
// interleaved partial sums over the whole groups of eight channels, combined
// as a fixed tree, then the tail), and with FMA contraction off it rounds as
// the CPU's does: the indexer's scores are the CPU's bits, so is the ReLU's
// mask in its backward, and top-k selects what the CPU selects.
//
// Determinism: no float atomics. The sparse attention's key and value
// gradients are summed key-major: the query-major pass marks, for every
// (key, query) pair a query selected, one bit of a `[rows, ceil(seq/32)]`
// bitmap (an integer atomicOr, the same bits in any order), and the key pass
// walks each key's bits in ascending query order, so every key's sum runs in
// the CPU's order. The indexer's key gradient runs key tiles over query
// tiles in a fixed order.
#include "common.cuh"

// The padding of a row of selected keys (`backend::sparse_attention::NO_KEY`).
#define NO_KEY 0xffffffffu

// Widest indexer head (di) the tiled indexer kernels hold in shared memory.
#define IX_MAX_DIM 128
// Query and key rows of an indexer tile.
#define IX_TILE 32u
// Padded row of an indexer tile in shared memory (bank-conflict free).
#define IX_LD (IX_MAX_DIM + 1)

// Threads of a sparse attention block (one (query row, head)), and the keys
// (or queries) it takes at a time.
#define SA_THREADS 128u
// Widest q/k and v head of the sparse attention kernels.
#define SA_MAX_DIM 512u
#define SA_PER_THREAD 4
// Query positions one key pass gathers at a time (32 bitmap words).
#define SA_GATHER 1024u

// Threads of a top-k block (one query row).
#define TOPK_THREADS 512u

// Threads of an indexer loss block (one query row).
#define LOSS_THREADS 256u


// ---- the CPU's dot product ---------------------------------------------------

struct Dot8 {
    float acc[8];
    float tail;
    __device__ __forceinline__ Dot8() : tail(0.0f) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            acc[l] = 0.0f;
        }
    }
    __device__ __forceinline__ float total() const {
        return (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail;
    }
};

// `dot(a, b[base..])` over n channels: `a` f32 (shared memory), `b` a
// stored tensor. Where `b`'s row starts on a 16-byte boundary its groups
// of eight are read as whole words (one for bf16, two for f32); the sums
// are the same either way.
__device__ __forceinline__ float dot_shared_stored(const float* a, const void* b, int bt, u64 base, u32 n) {
    Dot8 d;
    const u32 whole = n & ~7u;
    const u64 size = bt == DTYPE_BF16 ? 2 : 4;
    const bool words = (bt == DTYPE_BF16 || bt == DTYPE_F32) &&
                       ((reinterpret_cast<u64>(b) + base * size) & 15u) == 0;
    if (words) {
        for (u32 c = 0; c < whole; c += 8) {
            float f[8];
            load8(static_cast<const char*>(b) + base * size, bt, c / 8, f);
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                d.acc[l] += a[c + l] * f[l];
            }
        }
    } else {
        for (u32 c = 0; c < whole; c += 8) {
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                d.acc[l] += a[c + l] * load(b, bt, base + c + l);
            }
        }
    }
    for (u32 c = whole; c < n; ++c) {
        d.tail += a[c] * load(b, bt, base + c);
    }
    return d.total();
}

// `dot(a, b)` over n channels of two f32 rows (shared memory).
__device__ __forceinline__ float dot_shared(const float* a, const float* b, u32 n) {
    Dot8 d;
    const u32 whole = n & ~7u;
    for (u32 c = 0; c < whole; c += 8) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            d.acc[l] += a[c + l] * b[c + l];
        }
    }
    for (u32 c = whole; c < n; ++c) {
        d.tail += a[c] * b[c];
    }
    return d.total();
}

// ---- the indexer's tiles -------------------------------------------------------

// Rows [row0, row0 + IX_TILE) of a `[.., stride]` tensor, channels
// [offset, offset + dim), into a shared tile (rows past `limit` as zeros).
__device__ __forceinline__ void load_tile(
    float (*tile)[IX_LD], const void* x, int xt, u64 row0, u32 limit_rows, u64 stride, u64 offset, u32 dim) {
    for (u32 e = threadIdx.x; e < IX_TILE * dim; e += blockDim.x) {
        const u32 i = e / dim;
        const u32 c = e % dim;
        tile[i][c] = i < limit_rows ? load(x, xt, (row0 + i) * stride + offset + c) : 0.0f;
    }
}

// The 2 x 2 logits a thread of a 256-thread block owns in a 32 x 32 tile:
// queries (ty, ty + 16), keys (tx, tx + 16), each in the CPU's dot order.
__device__ __forceinline__ void tile_logits(
    const float (*qs)[IX_LD], const float (*ks)[IX_LD], u32 dim, float (&logit)[2][2]) {
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            logit[a][b] = dot_shared(qs[ty + 16 * a], ks[tx + 16 * b], dim);
        }
    }
}

// scores[r, u] = sum_h weight_scale * w[r, h] * relu(q[r, h] . k[u]) for
// u <= t, -inf after. Grid (key tiles, query tiles, batch), 256 threads:
// a block's K tile stays in shared memory while each head's Q tile passes.
extern "C" __global__ void __launch_bounds__(256) dsa_indexer_scores(
    const void* q, int qt, const void* k, int kt, const void* w, int wt, float* scores,
    u32 seq, u32 heads, u32 dim, float weight_scale) {
    grid_dependency_sync();
    __shared__ float qs[IX_TILE][IX_LD];
    __shared__ float ks[IX_TILE][IX_LD];
    const u32 k0 = blockIdx.x * IX_TILE;
    const u32 q0 = blockIdx.y * IX_TILE;
    const u64 base = static_cast<u64>(blockIdx.z) * seq;
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    float s[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    const bool live = k0 <= q0 + IX_TILE - 1;
    if (live) {
        load_tile(ks, k, kt, base + k0, min(IX_TILE, seq - k0), dim, 0, dim);
        for (u32 h = 0; h < heads; ++h) {
            load_tile(qs, q, qt, base + q0, min(IX_TILE, seq - q0), static_cast<u64>(heads) * dim,
                      static_cast<u64>(h) * dim, dim);
            __syncthreads();
            float logit[2][2];
            tile_logits(qs, ks, dim, logit);
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                const u32 t = q0 + ty + 16 * a;
                const float wh = t < seq ? weight_scale * load(w, wt, (base + t) * heads + h) : 0.0f;
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    s[a][b] += wh * fmaxf(logit[a][b], 0.0f);
                }
            }
            __syncthreads();
        }
    }
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const u32 t = q0 + ty + 16 * a;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const u32 u = k0 + tx + 16 * b;
            if (t < seq && u < seq) {
                scores[(base + t) * seq + u] = u <= t ? s[a][b] : neg_inf();
            }
        }
    }
}

// ---- top-k ---------------------------------------------------------------------

// The f32 bits as an unsigned key in `total_cmp`'s order.
__device__ __forceinline__ u32 order_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The exclusive prefix of `flag` over the block (in thread order) and the
// block's total: a ballot a warp, then the warps' counts in order.
// `counts` holds 32 values; ends with a barrier.
__device__ __forceinline__ u32 block_rank(bool flag, u32* counts, u32& total) {
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 warps = blockDim.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) {
        counts[warp] = __popc(ballot);
    }
    __syncthreads();
    u32 before = 0;
    total = 0;
    for (u32 i = 0; i < warps; ++i) {
        const u32 c = counts[i];
        before += i < warp ? c : 0;
        total += c;
    }
    __syncthreads();
    return before + __popc(ballot & ((1u << lane) - 1u));
}

// Each query row's top `topk` causal keys: the highest scores, ties to the
// lower position, written in ascending position; a row with t + 1 <= topk
// keys takes them all and pads with NO_KEY. A block a row: a radix select
// on the order-preserving keys (four passes of 8 bits over the row) finds
// the topk-th key K and how many keys equal to K to take (the lowest
// positions); a pass in position order then writes the keys above K and
// those first ties.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) dsa_indexer_topk(
    const float* scores, u32* indices, u32 seq, u32 topk) {
    grid_dependency_sync();
    __shared__ u32 hist[256];
    __shared__ u32 counts[32];
    __shared__ u32 chosen[2];
    const u64 r = blockIdx.x;
    const u32 t = static_cast<u32>(r % seq);
    const u32 n = t + 1;
    u32* out = indices + r * topk;
    if (n <= topk) {
        for (u32 i = threadIdx.x; i < topk; i += blockDim.x) {
            out[i] = i < n ? i : NO_KEY;
        }
        return;
    }
    const float* row = scores + r * seq;
    u32 prefix = 0;
    u32 mask = 0;
    u32 remaining = topk;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();
        for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
            const u32 key = order_key(row[i]);
            if ((key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 above = 0;
            for (int bin = 255; bin >= 0; --bin) {
                const u32 c = hist[bin];
                if (above + c >= remaining) {
                    chosen[0] = prefix | (static_cast<u32>(bin) << shift);
                    chosen[1] = remaining - above;
                    break;
                }
                above += c;
            }
        }
        __syncthreads();
        prefix = chosen[0];
        remaining = chosen[1];
        mask |= 255u << shift;
        __syncthreads();
    }
    // prefix: the topk-th key; remaining: how many of the keys equal to it
    // to take.
    u32 ties = 0;
    u32 written = 0;
    for (u32 i0 = 0; i0 < n; i0 += blockDim.x) {
        const u32 i = i0 + threadIdx.x;
        const u32 key = i < n ? order_key(row[i]) : 0;
        const bool above = i < n && key > prefix;
        const bool tie = i < n && key == prefix;
        u32 tie_total;
        const u32 tie_rank = ties + block_rank(tie, counts, tie_total);
        const bool take = above || (tie && tie_rank < remaining);
        u32 take_total;
        const u32 slot = written + block_rank(take, counts, take_total);
        if (take) {
            out[slot] = i;
        }
        ties += tie_total;
        written += take_total;
    }
}

// ---- the indexer's loss --------------------------------------------------------

// The loss's keys of query t: item i of the row is key i (every causal key)
// or the row's slot i (sparse: valid if selected and causal). Gives the key
// position, or NO_KEY for an item that is not a valid key.
__device__ __forceinline__ u32 loss_key(const u32* row_ix, u32 i, u32 t, u32 seq, int sparse, u64* status, u64 row) {
    if (!sparse) {
        return i;
    }
    const u32 u = row_ix[i];
    if (u == NO_KEY) {
        return NO_KEY;
    }
    if (u >= seq) {
        report_fault(status, FAULT_SELECTED_KEY, row);
        return NO_KEY;
    }
    return u <= t ? u : NO_KEY;
}

// The indexer's KL loss a row (block) against the main attention's
// probabilities summed over heads (`Backend::indexer_loss`). The row of
// `d_scores` holds the target's sums while they are built (each key is one
// thread's throughout), then the gradient.
extern "C" __global__ void __launch_bounds__(LOSS_THREADS) dsa_indexer_loss(
    const float* scores, const void* q, int qt, const void* k, int kt, const u32* indices,
    float* loss, float* d_scores, u32 seq, u32 topk, u32 heads, u32 dim, float scale, float factor,
    int sparse, u64* status) {
    grid_dependency_sync();
    __shared__ float qs[SA_MAX_DIM];
    __shared__ float red[32];
    const u64 r = blockIdx.x;
    const u32 t = static_cast<u32>(r % seq);
    const u64 base = r - t;
    const u32 items = sparse ? topk : t + 1;
    const u32* row_ix = indices + r * topk;
    const float* row = scores + r * seq;
    float* d_row = d_scores + r * seq;
    for (u32 u = threadIdx.x; u < seq; u += blockDim.x) {
        d_row[u] = 0.0f;
    }
    __syncthreads();
    for (u32 h = 0; h < heads; ++h) {
        for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
            qs[c] = load(q, qt, (r * heads + h) * dim + c);
        }
        __syncthreads();
        // This thread's keys: the max and the sum of exp(logit - max).
        float m = neg_inf();
        float l = 0.0f;
        for (u32 i = threadIdx.x; i < items; i += blockDim.x) {
            const u32 u = loss_key(row_ix, i, t, seq, sparse, status, r);
            if (u == NO_KEY) {
                continue;
            }
            const float x = scale * dot_shared_stored(qs, k, kt, ((base + u) * heads + h) * dim, dim);
            const float m2 = fmaxf(m, x);
            l = l * expf(m - m2) + expf(x - m2);
            m = m2;
        }
        const float big = block_max(m, red);
        const float mine = m == neg_inf() ? 0.0f : l * expf(m - big);
        const float sum = block_sum(mine, red);
        for (u32 i = threadIdx.x; i < items; i += blockDim.x) {
            const u32 u = loss_key(row_ix, i, t, seq, sparse, status, r);
            if (u == NO_KEY) {
                continue;
            }
            const float x = scale * dot_shared_stored(qs, k, kt, ((base + u) * heads + h) * dim, dim);
            d_row[u] += expf(x - big) / sum;
        }
        __syncthreads();
    }
    // The target's normaliser, and the indexer's log-softmax over the keys.
    float part = 0.0f;
    float smax = neg_inf();
    for (u32 i = threadIdx.x; i < items; i += blockDim.x) {
        const u32 u = loss_key(row_ix, i, t, seq, sparse, status, r);
        if (u != NO_KEY) {
            part += d_row[u];
            smax = fmaxf(smax, row[u]);
        }
    }
    const float total = fmaxf(block_sum(part, red), 1e-10f);
    smax = block_max(smax, red);
    float e = 0.0f;
    for (u32 i = threadIdx.x; i < items; i += blockDim.x) {
        const u32 u = loss_key(row_ix, i, t, seq, sparse, status, r);
        if (u != NO_KEY) {
            e += expf(row[u] - smax);
        }
    }
    const float log_sum = logf(block_sum(e, red));
    float kl = 0.0f;
    for (u32 i = threadIdx.x; i < items; i += blockDim.x) {
        const u32 u = loss_key(row_ix, i, t, seq, sparse, status, r);
        if (u == NO_KEY) {
            continue;
        }
        const float p_t = d_row[u] / total;
        const float log_p = row[u] - smax - log_sum;
        kl += p_t * (logf(fmaxf(p_t, 1e-10f)) - log_p);
        d_row[u] = factor * (expf(log_p) - p_t);
    }
    kl = block_sum(kl, red);
    if (threadIdx.x == 0) {
        loss[r] = factor * kl;
    }
}

// ---- the indexer's backward ----------------------------------------------------

// The query side of `Backend::indexer_backward`: with g = scale *
// d_scores[t, u] and the ReLU's mask q[t, h] . k[u] > 0, dq[t, h] = sum_u g
// weight_scale w[t, h] k[u] and dw[t, h] = sum_u g weight_scale (q . k), the
// keys in ascending order (the CPU's). Grid (query tiles, heads, batch), 256
// threads: a thread owns a query and every eighth channel of it.
extern "C" __global__ void __launch_bounds__(256) dsa_indexer_backward_q(
    const void* q, int qt, const void* k, int kt, const void* w, int wt, const float* d_scores,
    void* dq, int dqt, void* dw, int dwt, u32 seq, u32 heads, u32 dim, float weight_scale, float scale) {
    grid_dependency_sync();
    __shared__ float qs[IX_TILE][IX_LD];
    __shared__ float ks[IX_TILE][IX_LD];
    __shared__ float gw[IX_TILE][IX_TILE + 1];
    __shared__ float gl[IX_TILE][IX_TILE + 1];
    const u32 q0 = blockIdx.x * IX_TILE;
    const u32 h = blockIdx.y;
    const u64 base = static_cast<u64>(blockIdx.z) * seq;
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    const u32 qrows = min(IX_TILE, seq - q0);
    const u64 q_stride = static_cast<u64>(heads) * dim;
    load_tile(qs, q, qt, base + q0, qrows, q_stride, static_cast<u64>(h) * dim, dim);
    // This thread's query (mine) and channels c = part + 8 j.
    const u32 mine = threadIdx.x >> 3;
    const u32 part = threadIdx.x & 7;
    float acc[IX_MAX_DIM / 8];
#pragma unroll
    for (int j = 0; j < IX_MAX_DIM / 8; ++j) {
        acc[j] = 0.0f;
    }
    float dw_acc = 0.0f;
    for (u32 k0 = 0; k0 <= q0 + qrows - 1; k0 += IX_TILE) {
        const u32 krows = min(IX_TILE, seq - k0);
        __syncthreads();
        load_tile(ks, k, kt, base + k0, krows, dim, 0, dim);
        __syncthreads();
        float logit[2][2];
        tile_logits(qs, ks, dim, logit);
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            const u32 i = ty + 16 * a;
            const u32 t = q0 + i;
            const float wh = t < seq ? weight_scale * load(w, wt, (base + t) * heads + h) : 0.0f;
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const u32 j = tx + 16 * b;
                const u32 u = k0 + j;
                float g = 0.0f;
                if (t < seq && u <= t) {
                    g = scale * d_scores[(base + t) * seq + u];
                }
                const bool on = g != 0.0f && logit[a][b] > 0.0f;
                gw[i][j] = on ? g * wh : 0.0f;
                gl[i][j] = on ? g * weight_scale * logit[a][b] : 0.0f;
            }
        }
        __syncthreads();
        for (u32 j = 0; j < krows; ++j) {
            const float f = gw[mine][j];
            if (part == 0) {
                dw_acc += gl[mine][j];
            }
#pragma unroll
            for (int m = 0; m < IX_MAX_DIM / 8; ++m) {
                const u32 c = part + 8 * m;
                if (c < dim) {
                    acc[m] += f * ks[j][c];
                }
            }
        }
    }
    const u32 t = q0 + mine;
    if (t < seq) {
        const u64 at = ((base + t) * heads + h) * dim;
#pragma unroll
        for (int m = 0; m < IX_MAX_DIM / 8; ++m) {
            const u32 c = part + 8 * m;
            if (c < dim) {
                store(dq, dqt, at + c, acc[m]);
            }
        }
        if (part == 0) {
            store(dw, dwt, (base + t) * heads + h, dw_acc);
        }
    }
}

// The key side of `Backend::indexer_backward`: dk[u] = sum_{t >= u} sum_h g
// weight_scale w[t, h] q[t, h] where q[t, h] . k[u] > 0. Grid (key tiles, 1,
// batch), 256 threads; query tiles in ascending order, each head's in turn.
extern "C" __global__ void __launch_bounds__(256) dsa_indexer_backward_k(
    const void* q, int qt, const void* k, int kt, const void* w, int wt, const float* d_scores,
    void* dk, int dkt, u32 seq, u32 heads, u32 dim, float weight_scale, float scale) {
    grid_dependency_sync();
    __shared__ float qs[IX_TILE][IX_LD];
    __shared__ float ks[IX_TILE][IX_LD];
    __shared__ float gw[IX_TILE][IX_TILE + 1];
    const u32 k0 = blockIdx.x * IX_TILE;
    const u64 base = static_cast<u64>(blockIdx.z) * seq;
    const u32 tx = threadIdx.x & 15;
    const u32 ty = threadIdx.x >> 4;
    const u32 krows = min(IX_TILE, seq - k0);
    load_tile(ks, k, kt, base + k0, krows, dim, 0, dim);
    const u32 mine = threadIdx.x >> 3;
    const u32 part = threadIdx.x & 7;
    float acc[IX_MAX_DIM / 8];
#pragma unroll
    for (int j = 0; j < IX_MAX_DIM / 8; ++j) {
        acc[j] = 0.0f;
    }
    const u64 q_stride = static_cast<u64>(heads) * dim;
    for (u32 q0 = k0; q0 < seq; q0 += IX_TILE) {
        const u32 qrows = min(IX_TILE, seq - q0);
        for (u32 h = 0; h < heads; ++h) {
            __syncthreads();
            load_tile(qs, q, qt, base + q0, qrows, q_stride, static_cast<u64>(h) * dim, dim);
            __syncthreads();
            float logit[2][2];
            tile_logits(qs, ks, dim, logit);
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                const u32 i = ty + 16 * a;
                const u32 t = q0 + i;
                const float wh = t < seq ? weight_scale * load(w, wt, (base + t) * heads + h) : 0.0f;
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const u32 j = tx + 16 * b;
                    const u32 u = k0 + j;
                    float g = 0.0f;
                    if (t < seq && u <= t) {
                        g = scale * d_scores[(base + t) * seq + u];
                    }
                    gw[i][j] = g != 0.0f && logit[a][b] > 0.0f ? g * wh : 0.0f;
                }
            }
            __syncthreads();
            for (u32 i = 0; i < qrows; ++i) {
                const float f = gw[i][mine];
#pragma unroll
                for (int m = 0; m < IX_MAX_DIM / 8; ++m) {
                    const u32 c = part + 8 * m;
                    if (c < dim) {
                        acc[m] += f * qs[i][c];
                    }
                }
            }
        }
    }
    const u32 u = k0 + mine;
    if (u < seq) {
#pragma unroll
        for (int m = 0; m < IX_MAX_DIM / 8; ++m) {
            const u32 c = part + 8 * m;
            if (c < dim) {
                store(dk, dkt, (base + u) * dim + c, acc[m]);
            }
        }
    }
}

// ---- sparse attention ------------------------------------------------------------

// Key slot `slot` of query row r (token t): its position, or NO_KEY when it
// is padding, after the query, or out of range (reported with the row).
__device__ __forceinline__ u32 selected_key(const u32* indices, u64 r, u32 topk, u32 slot, u32 t, u32 seq, u64* status) {
    const u32 u = indices[r * topk + slot];
    if (u == NO_KEY) {
        return NO_KEY;
    }
    if (u >= seq) {
        report_fault(status, FAULT_SELECTED_KEY, r);
        return NO_KEY;
    }
    return u <= t ? u : NO_KEY;
}

// `Backend::sparse_attention_forward`: a block a (query row, head), the grid
// (rows, heads) so that the blocks running together read one head's keys.
// The selected keys pass SA_THREADS at a time (a thread a key's score), in
// slot order, with the online softmax's running max and sum in f32; a
// thread owns every SA_THREADS-th output channel.
extern "C" __global__ void __launch_bounds__(SA_THREADS) dsa_sparse_forward(
    const void* q, int qt, const void* k, int kt, const void* v, int vt, const u32* indices,
    void* out, int ot, float* lse, u32 seq, u32 heads, u32 qk_dim, u32 v_dim, u32 topk, float scale,
    u64* status) {
    grid_dependency_sync();
    __shared__ float qs[SA_MAX_DIM];
    __shared__ float ps[SA_THREADS];
    __shared__ u32 keys[SA_THREADS];
    __shared__ float red[32];
    const u64 r = blockIdx.x;
    const u32 h = blockIdx.y;
    const u32 t = static_cast<u32>(r % seq);
    const u64 base = r - t;
    for (u32 c = threadIdx.x; c < qk_dim; c += blockDim.x) {
        qs[c] = load(q, qt, (r * heads + h) * qk_dim + c);
    }
    float acc[SA_PER_THREAD];
#pragma unroll
    for (int m = 0; m < SA_PER_THREAD; ++m) {
        acc[m] = 0.0f;
    }
    float run_max = neg_inf();
    float run_sum = 0.0f;
    __syncthreads();
    for (u32 s0 = 0; s0 < topk; s0 += SA_THREADS) {
        const u32 slot = s0 + threadIdx.x;
        const u32 u = slot < topk ? selected_key(indices, r, topk, slot, t, seq, status) : NO_KEY;
        float x = neg_inf();
        if (u != NO_KEY) {
            x = scale * dot_shared_stored(qs, k, kt, ((base + u) * heads + h) * qk_dim, qk_dim);
        }
        const float chunk_max = block_max(x, red);
        const float next = fmaxf(run_max, chunk_max);
        if (next == neg_inf()) {
            continue;
        }
        const float p = u != NO_KEY ? expf(x - next) : 0.0f;
        ps[threadIdx.x] = p;
        keys[threadIdx.x] = u;
        const float rescale = run_max == neg_inf() ? 0.0f : expf(run_max - next);
        run_sum = run_sum * rescale + block_sum(p, red);
        run_max = next;
        const u32 n = min(SA_THREADS, topk - s0);
#pragma unroll
        for (int m = 0; m < SA_PER_THREAD; ++m) {
            acc[m] *= rescale;
        }
        for (u32 j = 0; j < n; ++j) {
            const u32 key = keys[j];
            if (key == NO_KEY) {
                continue;
            }
            const float pj = ps[j];
            const u64 at = ((base + key) * heads + h) * v_dim;
#pragma unroll
            for (int m = 0; m < SA_PER_THREAD; ++m) {
                const u32 c = threadIdx.x + SA_THREADS * m;
                if (c < v_dim) {
                    acc[m] += pj * load(v, vt, at + c);
                }
            }
        }
        __syncthreads();
    }
    const float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
    const u64 at = (r * heads + h) * v_dim;
#pragma unroll
    for (int m = 0; m < SA_PER_THREAD; ++m) {
        const u32 c = threadIdx.x + SA_THREADS * m;
        if (c < v_dim) {
            store(out, ot, at + c, acc[m] * inv);
        }
    }
    if (threadIdx.x == 0) {
        lse[r * heads + h] = run_sum > 0.0f ? run_max + logf(run_sum) : neg_inf();
    }
}

// The query side of `Backend::sparse_attention_backward`, a block a (query
// row, head): delta = dout . out (kept for the key pass), and over the
// selected keys in slot order p = exp(scale q . k - lse), ds = p (dout . v -
// delta) scale, dq = sum ds k. The head-0 blocks also mark each selected
// (key, query) pair in the bitmap `[rows, words]` (a repeated key is a
// fault).
extern "C" __global__ void __launch_bounds__(SA_THREADS) dsa_sparse_backward_dq(
    const void* q, int qt, const void* k, int kt, const void* v, int vt, const u32* indices,
    const void* out, int ot, const float* lse, const void* dout, int gt, void* dq, int dqt,
    float* delta, u32* bitmap, u32 words, u32 seq, u32 heads, u32 qk_dim, u32 v_dim, u32 topk,
    float scale, u64* status) {
    grid_dependency_sync();
    __shared__ float qs[SA_MAX_DIM];
    __shared__ float gs[SA_MAX_DIM];
    __shared__ float ds[SA_THREADS];
    __shared__ u32 keys[SA_THREADS];
    __shared__ float shared_delta;
    const u64 r = blockIdx.x;
    const u32 h = blockIdx.y;
    const u32 t = static_cast<u32>(r % seq);
    const u64 base = r - t;
    const u64 row_head = r * heads + h;
    for (u32 c = threadIdx.x; c < qk_dim; c += blockDim.x) {
        qs[c] = load(q, qt, row_head * qk_dim + c);
    }
    for (u32 c = threadIdx.x; c < v_dim; c += blockDim.x) {
        gs[c] = load(dout, gt, row_head * v_dim + c);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float d = dot_shared_stored(gs, out, ot, row_head * v_dim, v_dim);
        shared_delta = d;
        delta[row_head] = d;
    }
    __syncthreads();
    const float dlt = shared_delta;
    const float l = lse[row_head];
    float acc[SA_PER_THREAD];
#pragma unroll
    for (int m = 0; m < SA_PER_THREAD; ++m) {
        acc[m] = 0.0f;
    }
    for (u32 s0 = 0; s0 < topk; s0 += SA_THREADS) {
        const u32 slot = s0 + threadIdx.x;
        const u32 u = slot < topk ? selected_key(indices, r, topk, slot, t, seq, status) : NO_KEY;
        float d = 0.0f;
        if (u != NO_KEY) {
            const u64 kv = (base + u) * heads + h;
            const float p = expf(scale * dot_shared_stored(qs, k, kt, kv * qk_dim, qk_dim) - l);
            d = p * (dot_shared_stored(gs, v, vt, kv * v_dim, v_dim) - dlt) * scale;
            if (h == 0) {
                const u32 bit = 1u << (t & 31u);
                const u32 old = atomicOr(&bitmap[(base + u) * words + t / 32], bit);
                if (old & bit) {
                    report_fault(status, FAULT_SELECTED_KEY, r);
                }
            }
        }
        ds[threadIdx.x] = d;
        keys[threadIdx.x] = u;
        __syncthreads();
        const u32 n = min(SA_THREADS, topk - s0);
        for (u32 j = 0; j < n; ++j) {
            const u32 key = keys[j];
            if (key == NO_KEY) {
                continue;
            }
            const float f = ds[j];
            const u64 at = ((base + key) * heads + h) * qk_dim;
#pragma unroll
            for (int m = 0; m < SA_PER_THREAD; ++m) {
                const u32 c = threadIdx.x + SA_THREADS * m;
                if (c < qk_dim) {
                    acc[m] += f * load(k, kt, at + c);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < SA_PER_THREAD; ++m) {
        const u32 c = threadIdx.x + SA_THREADS * m;
        if (c < qk_dim) {
            store(dq, dqt, row_head * qk_dim + c, acc[m]);
        }
    }
}

// The key side of `Backend::sparse_attention_backward`, a block a (key row,
// head): the queries that selected the key, from its bitmap row in
// ascending order (SA_GATHER positions at a time, compacted by warp 0),
// SA_THREADS at a time: p = exp(scale q . k - lse), ds = p (dout . v -
// delta) scale, then dk = sum ds q and dv = sum p dout in query order.
extern "C" __global__ void __launch_bounds__(SA_THREADS) dsa_sparse_backward_dkdv(
    const void* q, int qt, const void* k, int kt, const void* v, int vt, const float* lse,
    const void* dout, int gt, const float* delta, const u32* bitmap, u32 words, void* dk, int dkt,
    void* dv, int dvt, u32 seq, u32 heads, u32 qk_dim, u32 v_dim, float scale) {
    grid_dependency_sync();
    __shared__ float ks[SA_MAX_DIM];
    __shared__ float vs[SA_MAX_DIM];
    __shared__ u32 queries[SA_GATHER];
    __shared__ float ps[SA_THREADS];
    __shared__ float ds[SA_THREADS];
    __shared__ u32 gathered;
    const u64 ru = blockIdx.x;
    const u32 h = blockIdx.y;
    const u32 u = static_cast<u32>(ru % seq);
    const u64 base = ru - u;
    const u64 kv = ru * heads + h;
    for (u32 c = threadIdx.x; c < qk_dim; c += blockDim.x) {
        ks[c] = load(k, kt, kv * qk_dim + c);
    }
    for (u32 c = threadIdx.x; c < v_dim; c += blockDim.x) {
        vs[c] = load(v, vt, kv * v_dim + c);
    }
    float acc_k[SA_PER_THREAD];
    float acc_v[SA_PER_THREAD];
#pragma unroll
    for (int m = 0; m < SA_PER_THREAD; ++m) {
        acc_k[m] = 0.0f;
        acc_v[m] = 0.0f;
    }
    const u32* bits = bitmap + ru * words;
    const u32 lane = threadIdx.x & 31;
    for (u32 w0 = u / 32; w0 < words; w0 += 32) {
        __syncthreads();
        if (threadIdx.x < 32) {
            const u32 word = w0 + lane < words ? bits[w0 + lane] : 0u;
            const u32 count = __popc(word);
            // The warp's exclusive prefix of the counts, lane order.
            u32 before = count;
            for (int d = 1; d < 32; d <<= 1) {
                const u32 other = __shfl_up_sync(0xffffffffu, before, d);
                if (lane >= static_cast<u32>(d)) {
                    before += other;
                }
            }
            const u32 total = __shfl_sync(0xffffffffu, before, 31);
            before -= count;
            u32 rest = word;
            while (rest != 0u) {
                const u32 b = __ffs(rest) - 1;
                queries[before++] = (w0 + lane) * 32 + b;
                rest &= rest - 1u;
            }
            if (lane == 0) {
                gathered = total;
            }
        }
        __syncthreads();
        const u32 n = gathered;
        for (u32 j0 = 0; j0 < n; j0 += SA_THREADS) {
            const u32 j = j0 + threadIdx.x;
            float p = 0.0f;
            float d = 0.0f;
            if (j < n) {
                const u64 row_head = (base + queries[j]) * heads + h;
                p = expf(scale * dot_shared_stored(ks, q, qt, row_head * qk_dim, qk_dim) - lse[row_head]);
                d = p * (dot_shared_stored(vs, dout, gt, row_head * v_dim, v_dim) - delta[row_head]) * scale;
            }
            ps[threadIdx.x] = p;
            ds[threadIdx.x] = d;
            __syncthreads();
            const u32 m_end = min(SA_THREADS, n - j0);
            for (u32 i = 0; i < m_end; ++i) {
                const u64 row_head = (base + queries[j0 + i]) * heads + h;
                const float pi = ps[i];
                const float di = ds[i];
#pragma unroll
                for (int m = 0; m < SA_PER_THREAD; ++m) {
                    const u32 c = threadIdx.x + SA_THREADS * m;
                    if (c < qk_dim) {
                        acc_k[m] += di * load(q, qt, row_head * qk_dim + c);
                    }
                    if (c < v_dim) {
                        acc_v[m] += pi * load(dout, gt, row_head * v_dim + c);
                    }
                }
            }
            __syncthreads();
        }
    }
#pragma unroll
    for (int m = 0; m < SA_PER_THREAD; ++m) {
        const u32 c = threadIdx.x + SA_THREADS * m;
        if (c < qk_dim) {
            store(dk, dkt, kv * qk_dim + c, acc_k[m]);
        }
        if (c < v_dim) {
            store(dv, dvt, kv * v_dim + c, acc_v[m]);
        }
    }
}

// ---- LayerNorm with bias ---------------------------------------------------------

// A warp a row: mean, rstd = 1 / sqrt(var + eps), y = (x - mean) rstd w + b;
// stats[r] = (mean, rstd). 8 warps a block.
extern "C" __global__ void __launch_bounds__(256) dsa_layer_norm_forward(
    const void* x, int xt, const void* w, int wt, const void* b, int bt, void* y, int yt,
    float* stats, u64 rows, u32 width, float eps) {
    grid_dependency_sync();
    const u64 r = static_cast<u64>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    const u32 lane = threadIdx.x & 31;
    if (r >= rows) {
        return;
    }
    const u64 at = r * width;
    float sum = 0.0f;
    for (u32 i = lane; i < width; i += 32) {
        sum += load(x, xt, at + i);
    }
    const float mean = warp_sum(sum) / static_cast<float>(width);
    float sq = 0.0f;
    for (u32 i = lane; i < width; i += 32) {
        const float d = load(x, xt, at + i) - mean;
        sq += d * d;
    }
    const float var = warp_sum(sq) / static_cast<float>(width);
    const float rstd = 1.0f / sqrtf(var + eps);
    for (u32 i = lane; i < width; i += 32) {
        const float xh = (load(x, xt, at + i) - mean) * rstd;
        store(y, yt, at + i, xh * load(w, wt, i) + load(b, bt, i));
    }
    if (lane == 0) {
        stats[2 * r] = mean;
        stats[2 * r + 1] = rstd;
    }
}

// A warp a row: g = dy w, dx = rstd (g - mean(g) - xh mean(g xh)).
extern "C" __global__ void __launch_bounds__(256) dsa_layer_norm_backward(
    const void* x, int xt, const void* w, int wt, const float* stats, const void* dy, int dyt,
    void* dx, int dxt, u64 rows, u32 width) {
    grid_dependency_sync();
    const u64 r = static_cast<u64>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    const u32 lane = threadIdx.x & 31;
    if (r >= rows) {
        return;
    }
    const u64 at = r * width;
    const float mean = stats[2 * r];
    const float rstd = stats[2 * r + 1];
    float sg = 0.0f;
    float sgx = 0.0f;
    for (u32 i = lane; i < width; i += 32) {
        const float g = load(dy, dyt, at + i) * load(w, wt, i);
        sg += g;
        sgx += g * ((load(x, xt, at + i) - mean) * rstd);
    }
    const float mean_g = warp_sum(sg) / static_cast<float>(width);
    const float mean_gx = warp_sum(sgx) / static_cast<float>(width);
    for (u32 i = lane; i < width; i += 32) {
        const float xh = (load(x, xt, at + i) - mean) * rstd;
        const float g = load(dy, dyt, at + i) * load(w, wt, i);
        store(dx, dxt, at + i, rstd * (g - mean_g - xh * mean_gx));
    }
}

// d_weight[i] += sum_r dy xh, d_bias[i] += sum_r dy. Block (32, 32):
// threadIdx.x a column of a 32-column tile, threadIdx.y the rows y, y + 32,
// ... in order; the 32 slices are then added as a fixed tree.
extern "C" __global__ void dsa_layer_norm_weight_grad(
    const void* x, int xt, const float* stats, const void* dy, int dyt, void* dw, int dwt,
    void* db, int dbt, u64 rows, u32 width) {
    grid_dependency_sync();
    __shared__ float pw[32][33];
    __shared__ float pb[32][33];
    const u32 i = blockIdx.x * 32 + threadIdx.x;
    float sw = 0.0f;
    float sb = 0.0f;
    if (i < width) {
        for (u64 r = threadIdx.y; r < rows; r += 32) {
            const float g = load(dy, dyt, r * width + i);
            sw += g * ((load(x, xt, r * width + i) - stats[2 * r]) * stats[2 * r + 1]);
            sb += g;
        }
    }
    pw[threadIdx.y][threadIdx.x] = sw;
    pb[threadIdx.y][threadIdx.x] = sb;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (threadIdx.y < s) {
            pw[threadIdx.y][threadIdx.x] += pw[threadIdx.y + s][threadIdx.x];
            pb[threadIdx.y][threadIdx.x] += pb[threadIdx.y + s][threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.y == 0 && i < width) {
        store(dw, dwt, i, load(dw, dwt, i) + pw[0][threadIdx.x]);
        store(db, dbt, i, load(db, dbt, i) + pb[0][threadIdx.x]);
    }
}

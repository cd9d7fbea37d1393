// DeepSeek sparse attention (`D` layers, `backend::sparse_attention`): the
// lightning indexer's scores, its causal top-k, its KL loss against the main
// attention and its backward, softmax attention over the selected keys and
// its backward (every head reading one shared key/value row a token), and
// the LayerNorm (with bias) of the indexer's keys.
//
// Every dot product is summed in the CPU backend's order (`dot`: eight
// interleaved partial sums over the whole groups of eight channels, combined
// as a fixed tree, then the tail), and with FMA contraction off it rounds as
// the CPU's does: the indexer's scores are the CPU's bits, so is the ReLU's
// mask in its backward, and top-k selects what the CPU selects.
//
// Determinism: no float atomics whose order could vary. On CUDA cores the
// sparse attention's shared rows' gradients are summed key-major: the
// query-major pass marks, for every (key, query) pair a query selected, one
// bit of a `[rows, ceil(seq/32)]` bitmap (an integer atomicOr, the same bits
// in any order), and the key pass walks each key's bits in ascending query
// order, so every key's sum runs in the CPU's order. On tensor cores they
// are summed query-major into each block's own partial rows, one add an
// element between two barriers, and the partials summed in block order. The
// indexer's key gradient runs key tiles over query tiles in a fixed order.
#include "common.cuh"
#include "wgmma.cuh"

// The padding of a row of selected keys (`backend::sparse_attention::NO_KEY`).
#define NO_KEY 0xffffffffu

// Widest indexer head (di) the tiled indexer kernels hold in shared memory.
#define IX_MAX_DIM 128
// Query and key rows of an indexer tile.
#define IX_TILE 32u
// Padded row of an indexer tile in shared memory (bank-conflict free).
#define IX_LD (IX_MAX_DIM + 1)

// Threads of a sparse attention block (one (query row, head), or one key
// row), and the keys (or queries) it takes at a time.
#define SA_THREADS 128u
// Widest shared key row (and query head) of the CUDA-core MQA kernels, and
// the channels a thread of their blocks owns.
#define MQA_MAX_DIM 1024u
#define MQA_PER_THREAD 8
// Query positions one key pass gathers at a time (32 bitmap words).
#define SA_GATHER 1024u

// Threads of a top-k block (one query row).
#define TOPK_THREADS 512u

// Threads of an indexer loss block (one query row).
#define LOSS_THREADS 256u
// Items of a row whose logits the loss keeps in shared memory between its
// two passes over a head (a longer row computes them twice).
#define LOSS_CACHED 4096u


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

// A position `u` the indexer selected for query row `row` (token t): u, or
// NO_KEY when it is padding, after the query, or out of range (reported
// with the row).
__device__ __forceinline__ u32 valid_key(u32 u, u32 t, u32 seq, u64* status, u64 row) {
    if (u == NO_KEY) {
        return NO_KEY;
    }
    if (u >= seq) {
        report_fault(status, FAULT_SELECTED_KEY, row);
        return NO_KEY;
    }
    return u <= t ? u : NO_KEY;
}

// The loss's keys of query t: item i of the row is key i (every causal key)
// or the row's slot i (sparse: valid if selected and causal). Gives the key
// position, or NO_KEY for an item that is not a valid key.
__device__ __forceinline__ u32 loss_key(const u32* row_ix, u32 i, u32 t, u32 seq, int sparse, u64* status, u64 row) {
    return sparse ? valid_key(row_ix[i], t, seq, status, row) : i;
}

// The indexer's KL loss a row (block) against the main attention's
// probabilities summed over heads (`Backend::indexer_loss`), every head
// reading the same key row k[u] `[dim]` (the attention's shared latent
// row). The row of
// `d_scores` holds the target's sums while they are built (each key is one
// thread's throughout), then the gradient; with `target_ready` the row
// holds them already (`dsa_indexer_loss_target_mma`). A row of at most LOSS_CACHED
// items keeps each head's logits in shared memory from the first pass (max
// and sum) to the second (the probabilities) instead of computing them
// again: the same bits, half the gathered key reads (the sparse loss reads
// topk keys of every head).
extern "C" __global__ void __launch_bounds__(LOSS_THREADS) dsa_indexer_loss(
    const float* scores, const void* q, int qt, const void* k, int kt, const u32* indices,
    float* loss, float* d_scores, u32 seq, u32 topk, u32 heads, u32 dim, float scale, float factor,
    int sparse, int target_ready, u64* status) {
    grid_dependency_sync();
    __shared__ float qs[MQA_MAX_DIM];
    __shared__ float red[32];
    __shared__ float logits[LOSS_CACHED];
    const u64 r = blockIdx.x;
    const u32 t = static_cast<u32>(r % seq);
    const u64 base = r - t;
    const u32 items = sparse ? topk : t + 1;
    const bool cached = items <= LOSS_CACHED;
    const u32* row_ix = indices + r * topk;
    const float* row = scores + r * seq;
    float* d_row = d_scores + r * seq;
    for (u32 u = threadIdx.x; u < seq && !target_ready; u += blockDim.x) {
        d_row[u] = 0.0f;
    }
    __syncthreads();
    for (u32 h = 0; h < heads && !target_ready; ++h) {
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
            const float x = scale * dot_shared_stored(qs, k, kt, (base + u) * dim, dim);
            if (cached) {
                logits[i] = x;
            }
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
            // This thread's own item of the first pass when cached.
            const float x = cached ? logits[i]
                                   : scale * dot_shared_stored(qs, k, kt, (base + u) * dim, dim);
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

// ---- the indexer on tensor cores (bf16 q and k) ----------------------------------
//
// When q and k are stored in bf16 and an indexer head is a multiple of 16
// channels (at most IX_MAX_DIM), the indexer's products run as
// `mma.sync.m16n8k16` (bf16 in, f32 accumulate) on tiles staged with
// `cp.async` (rows IXT_PITCH elements apart, so the eight 16-byte rows an
// `ldmatrix` reads fall in different banks; channels past the head are
// never read). A bf16 product is exact in f32, so a logit differs from the
// CPU's only by its summation order (the tensor core's within each 16
// channels, then the 16-channel blocks in order): the scores are no longer
// the CPU's bits, but every sum still has one order fixed by the
// dimensions, so a rerun gives the same bits. In the backward the ReLU's
// mask comes from these logits and the gradient weights P = g w (or its
// transpose) are rounded to bf16 to feed the second product, as
// FlashAttention rounds its probabilities.

// Elements between two staged rows of a tensor-core indexer tile.
#define IXT_PITCH 136
// The scores kernel: 8 warps, a 128-query x 128-key tile, each warp 32
// queries x 64 keys.
#define IXT_SCORE_THREADS 256
#define IXT_SCORE_QUERIES 128
#define IXT_SCORE_KEYS 128
// dq and d_weights: 4 warps, a 128-query tile of one head (32 a warp)
// walking 32-key tiles.
#define IXT_DQ_THREADS 128
#define IXT_DQ_QUERIES 128
#define IXT_DQ_KEYS 32
// dk: 8 warps in two groups of 4 that split the heads, a 64-key tile (16
// a warp) walking 64-query tiles.
#define IXT_DK_THREADS 256
#define IXT_DK_KEYS 64
#define IXT_DK_QUERIES 64
// Row pitch (f32) of dk's staged gradient tile [queries][keys].
#define IXT_G_PITCH (IXT_DK_KEYS + 4)

// Stages `rows` rows of `dim` bf16 channels (`stride` elements apart from
// `first`) into `tile`; rows from `valid` on are zeros.
// Head h's scaled weight of each query row a thread's accumulators hold:
// rows wq + 16 m + lane / 4 (+ 8 for the second half) of the tile whose
// first row is `first`; 0 past the tile's `valid` rows.
__device__ __forceinline__ void ixt_row_weights(float (&wh)[2][2], const void* w, int wt, u64 first, u32 wq, u32 lane,
                                                u32 valid, u32 heads, u32 h, float weight_scale) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 i = wq + m * 16 + (lane >> 2) + half * 8;
            wh[m][half] = i < valid ? weight_scale * load(w, wt, (first + i) * heads + h) : 0.0f;
        }
    }
}

__device__ __forceinline__ void ixt_stage(bf16* tile, const bf16* first, u64 stride, u32 rows, u32 valid, u32 dim,
                                          u32 thread, u32 threads) {
    const u32 chunks = dim / 8;
    for (u32 c = thread; c < rows * chunks; c += threads) {
        const u32 r = c / chunks;
        const u32 col = (c % chunks) * 8;
        const bool ok = r < valid;
        copy16_async(shared_address(tile + r * IXT_PITCH + col), ok ? first + r * stride + col : first, ok);
    }
}

// The A fragment of the 16 x 16 block of a staged tile at (row0, col0).
__device__ __forceinline__ void ixt_load_a(u32 (&a)[4], const bf16* tile, u32 row0, u32 col0) {
    const u32 lane = threadIdx.x & 31;
    ldmatrix_x4(a, shared_address(tile + (row0 + (lane & 15)) * IXT_PITCH + col0 + (lane >> 4) * 8));
}

// B fragments of two 8-column blocks read as the tile's transpose:
// B(k, n) = tile[n0 + n][k0 + k]; b[0], b[1] columns n0..n0+7, b[2], b[3]
// columns n0+8..n0+15.
__device__ __forceinline__ void ixt_load_b_rows(u32 (&b)[4], const bf16* tile, u32 n0, u32 k0) {
    const u32 lane = threadIdx.x & 31;
    const u32 row = n0 + (lane & 7) + (lane >> 4) * 8;
    const u32 col = k0 + ((lane >> 3) & 1) * 8;
    ldmatrix_x4(b, shared_address(tile + row * IXT_PITCH + col));
}

// B fragments read as the tile is: B(k, n) = tile[k0 + k][n0 + n].
__device__ __forceinline__ void ixt_load_b_cols(u32 (&b)[4], const bf16* tile, u32 k0, u32 n0) {
    const u32 lane = threadIdx.x & 31;
    const u32 row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    const u32 col = n0 + (lane >> 4) * 8;
    ldmatrix_x4_trans(b, shared_address(tile + row * IXT_PITCH + col));
}

// s[m][n] = A B^T over `dim` channels for the warp's M * 16 rows of `a`
// (from a0) and N * 8 rows of `b` (from b0); the 16-channel blocks in
// order.
template <int M, int N>
__device__ __forceinline__ void ixt_product(float (&s)[M][N][4], const bf16* a, u32 a0, const bf16* b, u32 b0,
                                            u32 dim) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
        }
    }
    for (u32 kk = 0; kk < dim; kk += 16) {
        u32 fa[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            ixt_load_a(fa[m], a, a0 + m * 16, kk);
        }
#pragma unroll
        for (int np = 0; np < N / 2; ++np) {
            u32 fb[4];
            ixt_load_b_rows(fb, b, b0 + np * 16, kk);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                mma_bf16(s[m][2 * np], fa[m], fb[0], fb[1]);
                mma_bf16(s[m][2 * np + 1], fa[m], fb[2], fb[3]);
            }
        }
    }
}

// acc[m] (`dim` channels in 8-column blocks) += P B, P the warp's
// (M * 16) x (N * 8) register tile `p` rounded to bf16 and B the first
// N * 8 rows of the staged tile `b`, read as it is.
template <int M, int N>
__device__ __forceinline__ void ixt_accumulate(float (&acc)[M][IX_MAX_DIM / 8][4], const float (&p)[M][N][4],
                                               const bf16* b, u32 dim) {
#pragma unroll
    for (int kk = 0; kk < N / 2; ++kk) {
        u32 fa[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            acc_as_a(fa[m], p[m][2 * kk], p[m][2 * kk + 1]);
        }
#pragma unroll
        for (int np = 0; np < IX_MAX_DIM / 16; ++np) {
            if (static_cast<u32>(np) * 16 < dim) {
                u32 fb[4];
                ixt_load_b_cols(fb, b, kk * 16, np * 16);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    mma_bf16(acc[m][2 * np], fa[m], fb[0], fb[1]);
                    mma_bf16(acc[m][2 * np + 1], fa[m], fb[2], fb[3]);
                }
            }
        }
    }
}

// Writes the warp's (M * 16) x dim f32 tile `acc` in `dtype` to rows
// `stride` elements apart from element `first` of `out`: this thread's rows
// are r0 + 16 m + lane / 4 (+ 8), skipped from `limit` on.
template <int M>
__device__ __forceinline__ void ixt_store_rows(void* out, int dtype, u64 first, u64 stride,
                                               const float (&acc)[M][IX_MAX_DIM / 8][4], u32 r0, u32 limit,
                                               u32 dim) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 r = r0 + m * 16 + (lane >> 2) + half * 8;
            if (r >= limit) {
                continue;
            }
#pragma unroll
            for (int n = 0; n < IX_MAX_DIM / 8; ++n) {
                const u32 c = n * 8 + 2 * (lane & 3);
                if (c < dim) {
                    const u64 at = first + r * stride + c;
                    store(out, dtype, at, acc[m][n][2 * half]);
                    store(out, dtype, at + 1, acc[m][n][2 * half + 1]);
                }
            }
        }
    }
}

// `Backend::indexer_scores` on tensor cores. Grid (key tiles, query tiles,
// batch) of IXT_SCORE_QUERIES x IXT_SCORE_KEYS tiles, IXT_SCORE_THREADS
// threads; dynamic shared memory: the key tile and two query tiles. A tile
// wholly after its queries writes -inf and does no products; otherwise the
// key tile stays while each head's query tile passes (the next head's
// staged during this one's products), and each thread sums its scores
// over the heads in order: s += (weight_scale w[t, h]) relu(q . k), the
// existing kernel's rounding of each term.
extern "C" __global__ void __launch_bounds__(IXT_SCORE_THREADS) dsa_indexer_scores_mma(
    const bf16* q, const bf16* k, const void* w, int wt, float* scores, u32 seq, u32 heads, u32 dim,
    float weight_scale) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char ixt_shared[];
    bf16* ks = reinterpret_cast<bf16*>(ixt_shared);
    bf16* qs = ks + IXT_SCORE_KEYS * IXT_PITCH;
    const u32 k0 = blockIdx.x * IXT_SCORE_KEYS;
    const u32 q0 = blockIdx.y * IXT_SCORE_QUERIES;
    const u64 base = static_cast<u64>(blockIdx.z) * seq;
    const u32 qrows = min(IXT_SCORE_QUERIES, seq - q0);
    const u32 krows = min(IXT_SCORE_KEYS, seq - k0);
    if (k0 > q0 + qrows - 1) {
        for (u32 e = threadIdx.x; e < qrows * IXT_SCORE_KEYS; e += IXT_SCORE_THREADS) {
            const u32 i = e / IXT_SCORE_KEYS;
            const u32 j = e % IXT_SCORE_KEYS;
            if (j < krows) {
                scores[(base + q0 + i) * seq + k0 + j] = neg_inf();
            }
        }
        return;
    }
    const u32 warp = threadIdx.x >> 5;
    const u32 lane = threadIdx.x & 31;
    const u32 wq = (warp & 3) * 32;
    const u32 wk = (warp >> 2) * 64;
    const u64 q_stride = static_cast<u64>(heads) * dim;
    const bf16* q_tile = q + (base + q0) * q_stride;
    ixt_stage(ks, k + (base + k0) * dim, dim, IXT_SCORE_KEYS, krows, dim, threadIdx.x, IXT_SCORE_THREADS);
    ixt_stage(qs, q_tile, q_stride, IXT_SCORE_QUERIES, qrows, dim, threadIdx.x, IXT_SCORE_THREADS);
    commit_async();
    float acc[2][8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
        }
    }
    for (u32 h = 0; h < heads; ++h) {
        // This thread's rows' weights: rows wq + 16 m + lane / 4 (+ 8).
        float wh[2][2];
        ixt_row_weights(wh, w, wt, base + q0, wq, lane, qrows, heads, h, weight_scale);
        wait_async<0>();
        __syncthreads();
        if (h + 1 < heads) {
            ixt_stage(qs + ((h + 1) & 1) * (IXT_SCORE_QUERIES * IXT_PITCH), q_tile + (h + 1) * dim, q_stride,
                      IXT_SCORE_QUERIES, qrows, dim, threadIdx.x, IXT_SCORE_THREADS);
        }
        commit_async();
        float s[2][8][4];
        ixt_product<2, 8>(s, qs + (h & 1) * (IXT_SCORE_QUERIES * IXT_PITCH), wq, ks, wk, dim);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int n = 0; n < 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[m][n][e] += wh[m][e >> 1] * fmaxf(s[m][n][e], 0.0f);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 i = wq + m * 16 + (lane >> 2) + half * 8;
            if (i >= qrows) {
                continue;
            }
            const u32 t = q0 + i;
            float* row = scores + (base + t) * seq;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const u32 u = k0 + wk + n * 8 + 2 * (lane & 3);
                const float a = u <= t ? acc[m][n][2 * half] : neg_inf();
                const float b = u + 1 <= t ? acc[m][n][2 * half + 1] : neg_inf();
                if (u + 1 < seq && (reinterpret_cast<u64>(row + u) & 7u) == 0) {
                    *reinterpret_cast<float2*>(row + u) = make_float2(a, b);
                } else {
                    if (u < seq) {
                        row[u] = a;
                    }
                    if (u + 1 < seq) {
                        row[u + 1] = b;
                    }
                }
            }
        }
    }
}

// The query side of `Backend::indexer_backward` on tensor cores: for head
// h and a 128-query tile, over its causal 32-key tiles in ascending order
// (each staged during the previous one's products): S = Q K^T, g = scale
// d_scores, P = g weight_scale w[t, h] where S > 0 (0 elsewhere),
// dq += P K (P rounded to bf16), dw += g weight_scale S where S > 0 (f32, a
// thread's keys in order, then its row's 4 threads as a fixed butterfly).
// Grid (heads, query tiles from the last, batch), IXT_DQ_THREADS threads;
// dynamic shared memory: the query tile and two key tiles.
extern "C" __global__ void __launch_bounds__(IXT_DQ_THREADS) dsa_indexer_backward_q_mma(
    const bf16* q, const bf16* k, const void* w, int wt, const float* d_scores, void* dq, int dqt, void* dw,
    int dwt, u32 seq, u32 heads, u32 dim, float weight_scale, float scale) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char ixt_shared[];
    bf16* qs = reinterpret_cast<bf16*>(ixt_shared);
    bf16* ks = qs + IXT_DQ_QUERIES * IXT_PITCH;
    const u32 h = blockIdx.x;
    const u32 q0 = (gridDim.y - 1 - blockIdx.y) * IXT_DQ_QUERIES;
    const u64 base = static_cast<u64>(blockIdx.z) * seq;
    const u32 qrows = min(IXT_DQ_QUERIES, seq - q0);
    const u32 warp = threadIdx.x >> 5;
    const u32 lane = threadIdx.x & 31;
    const u32 wq = warp * 32;
    const u64 q_stride = static_cast<u64>(heads) * dim;
    ixt_stage(qs, q + (base + q0) * q_stride + static_cast<u64>(h) * dim, q_stride, IXT_DQ_QUERIES, qrows, dim,
              threadIdx.x, IXT_DQ_THREADS);
    ixt_stage(ks, k + base * dim, dim, IXT_DQ_KEYS, min(IXT_DQ_KEYS, seq), dim, threadIdx.x, IXT_DQ_THREADS);
    commit_async();
    float wh[2][2];
    ixt_row_weights(wh, w, wt, base + q0, wq, lane, qrows, heads, h, weight_scale);
    float acc[2][IX_MAX_DIM / 8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int n = 0; n < IX_MAX_DIM / 8; ++n) {
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
        }
    }
    float dw_acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    const u32 key_tiles = (q0 + qrows - 1) / IXT_DQ_KEYS + 1;
    for (u32 j = 0; j < key_tiles; ++j) {
        wait_async<0>();
        __syncthreads();
        if (j + 1 < key_tiles) {
            const u32 u1 = (j + 1) * IXT_DQ_KEYS;
            ixt_stage(ks + ((j + 1) & 1) * (IXT_DQ_KEYS * IXT_PITCH), k + (base + u1) * dim, dim, IXT_DQ_KEYS,
                      min(IXT_DQ_KEYS, seq - u1), dim, threadIdx.x, IXT_DQ_THREADS);
        }
        commit_async();
        const bf16* kt = ks + (j & 1) * (IXT_DQ_KEYS * IXT_PITCH);
        float s[2][4][4];
        ixt_product<2, 4>(s, qs, wq, kt, 0, dim);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 t = q0 + wq + m * 16 + (lane >> 2) + (e >> 1) * 8;
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const u32 u = j * IXT_DQ_KEYS + n * 8 + 2 * (lane & 3) + (e & 1);
                    // Only causal entries are read (u <= t < seq).
                    const float g = t < seq && u <= t ? scale * d_scores[(base + t) * seq + u] : 0.0f;
                    const bool on = g != 0.0f && s[m][n][e] > 0.0f;
                    dw_acc[m][e >> 1] += on ? g * weight_scale * s[m][n][e] : 0.0f;
                    s[m][n][e] = on ? g * wh[m][e >> 1] : 0.0f;
                }
            }
        }
        ixt_accumulate<2, 4>(acc, s, kt, dim);
    }
    ixt_store_rows<2>(dq, dqt, (base + q0) * q_stride + static_cast<u64>(h) * dim, q_stride, acc, wq, qrows, dim);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float total = quad_sum(dw_acc[m][half]);
            const u32 i = wq + m * 16 + (lane >> 2) + half * 8;
            if ((lane & 3) == 0 && i < qrows) {
                store(dw, dwt, (base + q0 + i) * heads + h, total);
            }
        }
    }
}

// The key side of `Backend::indexer_backward` on tensor cores: dk[u] =
// sum_t sum_h P[t, u] q[t, h] for a 64-key tile. Its K fragments stay in
// registers; it walks its causal 64-query tiles in ascending order (each
// tile's g = scale d_scores staged once, zero off the causal entries), and
// within each the heads: warps 0-3 take heads 0 .. ceil(heads / 2) - 1 in
// order, warps 4-7 the rest, one head each a step (the next step's query
// tiles staged during this one's products): S^T = K Q^T, P^T = g w where
// S > 0 (rounded to bf16), dk += P^T Q. At the end the second group's sums
// are added to the first's (first + second), so every dk has one order.
// Grid (key tiles, 1, batch), IXT_DK_THREADS threads; dynamic shared
// memory: the key tile, two steps' query tiles for each group, the g tile
// and two steps' weights.
extern "C" __global__ void __launch_bounds__(IXT_DK_THREADS) dsa_indexer_backward_k_mma(
    const bf16* q, const bf16* k, const void* w, int wt, const float* d_scores, void* dk, int dkt, u32 seq,
    u32 heads, u32 dim, float weight_scale, float scale) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char ixt_shared[];
    constexpr u32 TILE = IXT_DK_QUERIES * IXT_PITCH;
    bf16* ks = reinterpret_cast<bf16*>(ixt_shared);
    bf16* qs = ks + IXT_DK_KEYS * IXT_PITCH;                         // [step buffer][group][TILE]
    float* gs = reinterpret_cast<float*>(qs + 4 * TILE);             // [query][IXT_G_PITCH]
    float* whs = gs + IXT_DK_QUERIES * IXT_G_PITCH;                  // [step buffer][group][query]
    const u32 k0 = blockIdx.x * IXT_DK_KEYS;
    const u64 base = static_cast<u64>(blockIdx.z) * seq;
    const u32 krows = min(IXT_DK_KEYS, seq - k0);
    const u32 warp = threadIdx.x >> 5;
    const u32 lane = threadIdx.x & 31;
    const u32 group = warp >> 2;
    const u32 wk = (warp & 3) * 16;
    const u64 q_stride = static_cast<u64>(heads) * dim;
    const u32 per_group = (heads + 1) / 2;
    const u32 query_tiles = (seq - k0 + IXT_DK_QUERIES - 1) / IXT_DK_QUERIES;
    const u32 steps = query_tiles * per_group;
    // Stages step `s`'s query tiles (and weights) into buffer s & 1.
    auto stage_step = [&](u32 s) {
        const u32 t0 = k0 + (s / per_group) * IXT_DK_QUERIES;
        const u32 rows = min(IXT_DK_QUERIES, seq - t0);
        for (u32 g = 0; g < 2; ++g) {
            const u32 head = g * per_group + s % per_group;
            if (head >= heads) {
                continue;
            }
            ixt_stage(qs + ((s & 1) * 2 + g) * TILE, q + (base + t0) * q_stride + static_cast<u64>(head) * dim,
                      q_stride, IXT_DK_QUERIES, rows, dim, threadIdx.x, IXT_DK_THREADS);
            for (u32 i = threadIdx.x; i < IXT_DK_QUERIES; i += IXT_DK_THREADS) {
                whs[((s & 1) * 2 + g) * IXT_DK_QUERIES + i] =
                    i < rows ? weight_scale * load(w, wt, (base + t0 + i) * heads + head) : 0.0f;
            }
        }
    };
    ixt_stage(ks, k + (base + k0) * dim, dim, IXT_DK_KEYS, krows, dim, threadIdx.x, IXT_DK_THREADS);
    commit_async();
    stage_step(0);
    commit_async();
    wait_async<1>();
    __syncthreads();
    u32 fk[IX_MAX_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < IX_MAX_DIM / 16; ++kk) {
        if (static_cast<u32>(kk) * 16 < dim) {
            ixt_load_a(fk[kk], ks, wk, kk * 16);
        }
    }
    float acc[1][IX_MAX_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < IX_MAX_DIM / 8; ++n) {
        acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.0f;
    }
    for (u32 s = 0; s < steps; ++s) {
        const u32 t0 = k0 + (s / per_group) * IXT_DK_QUERIES;
        wait_async<0>();
        __syncthreads();
        if (s % per_group == 0) {
            for (u32 e = threadIdx.x; e < IXT_DK_QUERIES * IXT_DK_KEYS; e += IXT_DK_THREADS) {
                const u32 i = e / IXT_DK_KEYS;
                const u32 j = e % IXT_DK_KEYS;
                const u32 t = t0 + i;
                const u32 u = k0 + j;
                // Only causal entries are read (u <= t < seq).
                gs[i * IXT_G_PITCH + j] = t < seq && u <= t ? scale * d_scores[(base + t) * seq + u] : 0.0f;
            }
            __syncthreads();
        }
        if (s + 1 < steps) {
            stage_step(s + 1);
        }
        commit_async();
        const u32 head = group * per_group + s % per_group;
        if (head >= heads) {
            continue;
        }
        const bf16* qt = qs + ((s & 1) * 2 + group) * TILE;
        const float* wrow = whs + ((s & 1) * 2 + group) * IXT_DK_QUERIES;
        float st[1][8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            st[0][n][0] = st[0][n][1] = st[0][n][2] = st[0][n][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < IX_MAX_DIM / 16; ++kk) {
            if (static_cast<u32>(kk) * 16 < dim) {
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    u32 fb[4];
                    ixt_load_b_rows(fb, qt, np * 16, kk * 16);
                    mma_bf16(st[0][2 * np], fk[kk], fb[0], fb[1]);
                    mma_bf16(st[0][2 * np + 1], fk[kk], fb[2], fb[3]);
                }
            }
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 j = wk + (lane >> 2) + (e >> 1) * 8;
                const u32 i = n * 8 + 2 * (lane & 3) + (e & 1);
                const float g = gs[i * IXT_G_PITCH + j];
                const bool on = g != 0.0f && st[0][n][e] > 0.0f;
                st[0][n][e] = on ? g * wrow[i] : 0.0f;
            }
        }
        ixt_accumulate<1, 8>(acc, st, qt, dim);
    }
    // The second group's sums through shared memory (the query tiles'
    // space, idle now), added to the first's.
    wait_async<0>();
    __syncthreads();
    float* red = reinterpret_cast<float*>(qs);
    const u32 slot = (warp & 3) * 32 + lane;
    if (group == 1) {
#pragma unroll
        for (int n = 0; n < IX_MAX_DIM / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                red[(n * 4 + e) * 128 + slot] = acc[0][n][e];
            }
        }
    }
    __syncthreads();
    if (group == 0) {
#pragma unroll
        for (int n = 0; n < IX_MAX_DIM / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[0][n][e] = acc[0][n][e] + red[(n * 4 + e) * 128 + slot];
            }
        }
        ixt_store_rows<1>(dk, dkt, (base + k0) * dim, dim, acc, wk, krows, dim);
    }
}

// ---- sparse attention ------------------------------------------------------------

// Key slot `slot` of query row r (token t): its position, or NO_KEY (see
// `valid_key`).
__device__ __forceinline__ u32 selected_key(const u32* indices, u64 r, u32 topk, u32 slot, u32 t, u32 seq, u64* status) {
    return valid_key(indices[r * topk + slot], t, seq, status, r);
}

// ---- sparse attention over one shared key/value row (MQA), CUDA cores ------------
//
// `Backend::sparse_mqa_forward` and `_backward` with every head reading the
// same key row kv[u] `[qk_dim]` of a token, the value being its first
// v_dim channels. These kernels are the checking mode (f32 storage, or any
// storage when the tensor-core kernels do not apply): every dot product in
// the CPU's order and the key pass summing each key's row in the CPU's
// order (query rows ascending, each row's heads ascending, `ds q` then
// `p dout`), so they match the CPU to the last few ulps (`expf` and the
// online softmax's rescaling are the only differences). Deterministic: the
// only atomics are the bitmap's integer atomicOr, whose result is the same
// in any order.

// acc += weight[j] kv[base + keys[j]] over the block's first `n` keys in
// slot order (missing keys skipped), each of a row's first `width`
// channels: a thread owns every SA_THREADS-th channel, MQA_PER_THREAD of
// them. Rows are `dim` channels apart.
__device__ __forceinline__ void add_weighted_rows(float (&acc)[MQA_PER_THREAD], const u32* keys, const float* weight,
                                                  u32 n, const void* kv, int kvt, u64 base, u32 dim, u32 width) {
    for (u32 j = 0; j < n; ++j) {
        const u32 key = keys[j];
        if (key == NO_KEY) {
            continue;
        }
        const float f = weight[j];
        const u64 at = (base + key) * dim;
#pragma unroll
        for (int m = 0; m < MQA_PER_THREAD; ++m) {
            const u32 c = threadIdx.x + SA_THREADS * m;
            if (c < width) {
                acc[m] += f * load(kv, kvt, at + c);
            }
        }
    }
}

// `Backend::sparse_mqa_forward` on CUDA cores: a block a (query row, head),
// the selected keys SA_THREADS at a time (a thread a key's score), in slot
// order, online softmax in f32; a thread owns every SA_THREADS-th output
// channel. q `[rows, heads, qk_dim]`, kv `[rows, qk_dim]` in any float
// dtype; out in its dtype; lse f32 `[rows, heads]`.
extern "C" __global__ void __launch_bounds__(SA_THREADS) dsa_mqa_forward(
    const void* q, int qt, const void* kv, int kvt, const u32* indices, void* out, int ot, float* lse,
    u32 seq, u32 heads, u32 qk_dim, u32 v_dim, u32 topk, float scale, u64* status) {
    grid_dependency_sync();
    __shared__ float qs[MQA_MAX_DIM];
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
    float acc[MQA_PER_THREAD];
#pragma unroll
    for (int m = 0; m < MQA_PER_THREAD; ++m) {
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
            x = scale * dot_shared_stored(qs, kv, kvt, (base + u) * qk_dim, qk_dim);
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
        for (int m = 0; m < MQA_PER_THREAD; ++m) {
            acc[m] *= rescale;
        }
        add_weighted_rows(acc, keys, ps, n, kv, kvt, base, qk_dim, v_dim);
        __syncthreads();
    }
    const float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
    const u64 at = (r * heads + h) * v_dim;
#pragma unroll
    for (int m = 0; m < MQA_PER_THREAD; ++m) {
        const u32 c = threadIdx.x + SA_THREADS * m;
        if (c < v_dim) {
            store(out, ot, at + c, acc[m] * inv);
        }
    }
    if (threadIdx.x == 0) {
        lse[r * heads + h] = run_sum > 0.0f ? run_max + logf(run_sum) : neg_inf();
    }
}

// Marks (key row `key_row`, query t) in the bitmap of selected pairs (a
// bit a pair, integer atomics: the same bits in any order); a pair already
// marked is a key the query selected twice, a fault naming its row r.
__device__ __forceinline__ void mark_selected(u32* bitmap, u32 words, u64 key_row, u32 t, u64* status, u64 r) {
    const u32 bit = 1u << (t & 31u);
    if (atomicOr(&bitmap[key_row * words + t / 32], bit) & bit) {
        report_fault(status, FAULT_SELECTED_KEY, r);
    }
}

// The query side of `Backend::sparse_mqa_backward` on CUDA cores, a block a
// (query row, head): delta = dout . out (f32 `[rows, heads]`, kept for the
// key pass), and over the selected keys in slot order p = exp(scale q . kv -
// lse), ds = p (dout . v - delta) scale, dq = sum ds kv (f32 sums, stored in
// dq's dtype). The head-0 blocks mark each selected (key, query) pair in
// the bitmap `[rows, words]` (an integer atomicOr; a repeated key is a
// fault).
extern "C" __global__ void __launch_bounds__(SA_THREADS) dsa_mqa_backward_dq(
    const void* q, int qt, const void* kv, int kvt, const u32* indices, const void* out, int ot,
    const float* lse, const void* dout, int gt, void* dq, int dqt, float* delta, u32* bitmap, u32 words,
    u32 seq, u32 heads, u32 qk_dim, u32 v_dim, u32 topk, float scale, u64* status) {
    grid_dependency_sync();
    __shared__ float qs[MQA_MAX_DIM];
    __shared__ float gs[MQA_MAX_DIM];
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
    float acc[MQA_PER_THREAD];
#pragma unroll
    for (int m = 0; m < MQA_PER_THREAD; ++m) {
        acc[m] = 0.0f;
    }
    for (u32 s0 = 0; s0 < topk; s0 += SA_THREADS) {
        const u32 slot = s0 + threadIdx.x;
        const u32 u = slot < topk ? selected_key(indices, r, topk, slot, t, seq, status) : NO_KEY;
        float d = 0.0f;
        if (u != NO_KEY) {
            const u64 at = (base + u) * qk_dim;
            const float p = expf(scale * dot_shared_stored(qs, kv, kvt, at, qk_dim) - l);
            d = p * (dot_shared_stored(gs, kv, kvt, at, v_dim) - dlt) * scale;
            if (h == 0) {
                mark_selected(bitmap, words, base + u, t, status, r);
            }
        }
        ds[threadIdx.x] = d;
        keys[threadIdx.x] = u;
        __syncthreads();
        const u32 n = min(SA_THREADS, topk - s0);
        add_weighted_rows(acc, keys, ds, n, kv, kvt, base, qk_dim, qk_dim);
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < MQA_PER_THREAD; ++m) {
        const u32 c = threadIdx.x + SA_THREADS * m;
        if (c < qk_dim) {
            store(dq, dqt, row_head * qk_dim + c, acc[m]);
        }
    }
}

// Compacts the set bits of bitmap words [w0, w0 + 32) of one key's row into
// `queries` (query positions, ascending) and returns how many; run by the
// whole block (warp 0 works, everyone waits).
__device__ __forceinline__ u32 gather_selecting_queries(const u32* bits, u32 w0, u32 words, u32* queries, u32* gathered) {
    __syncthreads();
    if (threadIdx.x < 32) {
        const u32 lane = threadIdx.x;
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
            *gathered = total;
        }
    }
    __syncthreads();
    return *gathered;
}

// The key side of `Backend::sparse_mqa_backward` on CUDA cores, a block a
// key row: the queries that selected the key, from its bitmap row in
// ascending order (SA_GATHER positions at a time), their (query, head)
// pairs SA_THREADS at a time in (query, head) order: p = exp(scale q . kv -
// lse), ds = p (dout . v - delta) scale, then dkv += ds q and dkv[..v_dim]
// += p dout, pair by pair (the CPU's order). A thread owns every
// SA_THREADS-th channel of the row; the sums are f32, stored once in dkv's
// dtype.
extern "C" __global__ void __launch_bounds__(SA_THREADS) dsa_mqa_backward_dkv(
    const void* q, int qt, const void* kv, int kvt, const float* lse, const void* dout, int gt,
    const float* delta, const u32* bitmap, u32 words, void* dkv, int dkvt, u32 seq, u32 heads,
    u32 qk_dim, u32 v_dim, float scale) {
    grid_dependency_sync();
    __shared__ float ks[MQA_MAX_DIM];
    __shared__ u32 queries[SA_GATHER];
    __shared__ float ps[SA_THREADS];
    __shared__ float ds[SA_THREADS];
    __shared__ u32 gathered;
    const u64 ru = blockIdx.x;
    const u32 u = static_cast<u32>(ru % seq);
    const u64 base = ru - u;
    for (u32 c = threadIdx.x; c < qk_dim; c += blockDim.x) {
        ks[c] = load(kv, kvt, ru * qk_dim + c);
    }
    float acc[MQA_PER_THREAD];
#pragma unroll
    for (int m = 0; m < MQA_PER_THREAD; ++m) {
        acc[m] = 0.0f;
    }
    const u32* bits = bitmap + ru * words;
    for (u32 w0 = u / 32; w0 < words; w0 += 32) {
        const u32 n = gather_selecting_queries(bits, w0, words, queries, &gathered);
        const u64 pairs = static_cast<u64>(n) * heads;
        for (u64 j0 = 0; j0 < pairs; j0 += SA_THREADS) {
            const u64 j = j0 + threadIdx.x;
            float p = 0.0f;
            float d = 0.0f;
            if (j < pairs) {
                const u64 row_head = (base + queries[j / heads]) * heads + j % heads;
                p = expf(scale * dot_shared_stored(ks, q, qt, row_head * qk_dim, qk_dim) - lse[row_head]);
                d = p * (dot_shared_stored(ks, dout, gt, row_head * v_dim, v_dim) - delta[row_head]) * scale;
            }
            ps[threadIdx.x] = p;
            ds[threadIdx.x] = d;
            __syncthreads();
            const u32 i_end = static_cast<u32>(min(static_cast<u64>(SA_THREADS), pairs - j0));
            for (u32 i = 0; i < i_end; ++i) {
                const u64 jj = j0 + i;
                const u64 row_head = (base + queries[jj / heads]) * heads + jj % heads;
                const float pi = ps[i];
                const float di = ds[i];
#pragma unroll
                for (int m = 0; m < MQA_PER_THREAD; ++m) {
                    const u32 c = threadIdx.x + SA_THREADS * m;
                    if (c < qk_dim) {
                        acc[m] += di * load(q, qt, row_head * qk_dim + c);
                        if (c < v_dim) {
                            acc[m] += pi * load(dout, gt, row_head * v_dim + c);
                        }
                    }
                }
            }
            __syncthreads();
        }
    }
#pragma unroll
    for (int m = 0; m < MQA_PER_THREAD; ++m) {
        const u32 c = threadIdx.x + SA_THREADS * m;
        if (c < qk_dim) {
            store(dkv, dkvt, ru * qk_dim + c, acc[m]);
        }
    }
}

// ---- sparse attention over one shared key/value row (MQA), tensor cores ------------
//
// `Backend::sparse_mqa_forward` with bf16 q and kv on tensor cores
// (`mma.sync.m16n8k16`, bf16 operands, f32 sums), the heads as the M
// dimension: a block takes one query row and up to MQT_HEADS of its heads
// (a group of 4 warps for each 16 heads; heads past the last are zero
// rows). The row's selected keys pass MQT_KEYS at a time: their kv rows are
// gathered into shared memory with `cp.async` (the next block's while this
// one is multiplied) and serve as both K and V. Per block, warp q of a
// group computes the scores of its 16 heads against keys [8q, 8q + 8)
// (S = Q K^T over the row's channels in 16-channel steps), the group's
// four partial row maxima meet in shared memory (in warp order), every
// warp rescales by the same running max, writes its probabilities (bf16)
// to shared memory, and then owns a quarter of the value channels: O +=
// P V over the block's keys (FlashAttention's online softmax, the
// probabilities rounded to bf16 for the second product as it does; the
// row sums are kept in f32 from the unrounded ones, a warp's keys then the
// four warps in order). Every sum has one order fixed by the shapes, so a
// rerun gives the same bits. Takes qk_dim a multiple of 16 up to
// MQT_MAX_QK and v_dim a multiple of 64 up to MQT_MAX_V, 16-byte aligned
// rows; the launcher falls back to the CUDA-core kernel otherwise. out in
// its dtype, lse f32 `[rows, heads]` (-inf and zeros for a row with no key).

// Keys a block gathers at a time, widest row, widest value, heads a block.
#define MQT_KEYS 32
#define MQT_MAX_QK 576
#define MQT_MAX_V 512
#define MQT_HEADS 64
// Elements between two staged rows (q and kv tiles), and of the
// probabilities' tile: 16 bytes past a multiple of 128, so the eight rows an
// `ldmatrix` reads fall in different banks.
#define MQT_PITCH (MQT_MAX_QK + 8)
#define MQT_P_PITCH (MQT_KEYS + 8)

// Two 8 x 8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
}

// After `keys` (MQT_KEYS positions, NO_KEY for none) is written: copies
// their rows of `kv` (`dim` channels, in sequence `base`) into `tile`,
// rows of a missing key as zeros. The whole block calls it; issues (does
// not wait for) the copies.
__device__ __forceinline__ void stage_key_rows(bf16* tile, const u32* keys, const bf16* kv, u64 base, u32 dim) {
    __syncthreads();
    const u32 chunks = dim / 8;
    for (u32 c = threadIdx.x; c < MQT_KEYS * chunks; c += blockDim.x) {
        const u32 i = c / chunks;
        const u32 col = (c % chunks) * 8;
        const u32 u = keys[i];
        const bool ok = u != NO_KEY;
        copy16_async(shared_address(tile + i * MQT_PITCH + col), ok ? kv + (base + u) * dim + col : kv, ok);
    }
    commit_async();
}

// Gathers the kv rows of slots [s0, s0 + MQT_KEYS) of query row r into
// `tile` (see `stage_key_rows`) after writing their positions to `keys`.
__device__ __forceinline__ void mqt_gather(bf16* tile, u32* keys, const bf16* kv, const u32* indices, u64 r, u32 topk,
                                           u32 s0, u32 t, u32 seq, u64 base, u32 qk_dim, u64* status) {
    if (threadIdx.x < MQT_KEYS) {
        const u32 slot = s0 + threadIdx.x;
        keys[threadIdx.x] = slot < topk ? selected_key(indices, r, topk, slot, t, seq, status) : NO_KEY;
    }
    stage_key_rows(tile, keys, kv, base, qk_dim);
}

// The double buffer's step before key block blk's products: issues block
// blk + 1's gather (if any) into the other buffer, then waits for block
// blk's copies and meets the block's barrier.
__device__ __forceinline__ void mqt_advance(bf16* ks, u32* keys, u32 blk, u32 blocks, const bf16* kv,
                                            const u32* indices, u64 r, u32 topk, u32 t, u32 seq, u64 base, u32 qk_dim,
                                            u64* status) {
    if (blk + 1 < blocks) {
        const u32 next = (blk + 1) & 1;
        mqt_gather(ks + next * MQT_KEYS * MQT_PITCH, keys + next * MQT_KEYS, kv, indices, r, topk,
                   (blk + 1) * MQT_KEYS, t, seq, base, qk_dim, status);
        wait_async<1>();
    } else {
        wait_async<0>();
    }
    __syncthreads();
}

// even += A B^T over the even 16-channel steps of `dim` channels, odd over
// the odd ones (two independent chains of mmas): `arow` is this lane's
// ldmatrix address of a staged 16-row A tile, `brow` of an 8-row B tile
// (rows of channels, read transposed as the forward reads keys).
__device__ __forceinline__ void group_products(float (&even)[4], float (&odd)[4], const bf16* arow, const bf16* brow,
                                               u32 dim) {
    for (u32 c0 = 0; c0 < dim; c0 += 32) {
        u32 fa[4];
        u32 fb[2];
        ldmatrix_x4(fa, shared_address(arow + c0));
        ldmatrix_x2(fb, shared_address(brow + c0));
        mma_bf16(even, fa, fb[0], fb[1]);
        if (c0 + 16 < dim) {
            ldmatrix_x4(fa, shared_address(arow + c0 + 16));
            ldmatrix_x2(fb, shared_address(brow + c0 + 16));
            mma_bf16(odd, fa, fb[0], fb[1]);
        }
    }
}

// S (scaled) for a group's 16 heads x keys [8 quarter, 8 quarter + 8) of a
// staged key block, -inf for a missing key: s[0], s[1] row lane / 4, keys
// col, col + 1; s[2], s[3] row + 8. Two chains of products (even and odd
// 16-channel steps) added at the end.
__device__ __forceinline__ void group_scores(float (&s)[4], const bf16* qs, const bf16* kt, const u32* kk, u32 g,
                                             u32 quarter, u32 lane, u32 dim, float scale) {
    float even[4] = {};
    float odd[4] = {};
    group_products(even, odd, qs + (g * 16 + (lane & 15)) * MQT_PITCH + (lane >> 4) * 8,
                   kt + (quarter * 8 + (lane & 7)) * MQT_PITCH + ((lane >> 3) & 1) * 8, dim);
    const u32 col = quarter * 8 + 2 * (lane & 3);
    const bool valid0 = kk[col] != NO_KEY;
    const bool valid1 = kk[col + 1] != NO_KEY;
    s[0] = valid0 ? scale * (even[0] + odd[0]) : neg_inf();
    s[1] = valid1 ? scale * (even[1] + odd[1]) : neg_inf();
    s[2] = valid0 ? scale * (even[2] + odd[2]) : neg_inf();
    s[3] = valid1 ? scale * (even[3] + odd[3]) : neg_inf();
}

// Puts this warp's parts of its two rows (row_a, row_a + 8; lane 4i's
// `part`) in `red` (`[rows, 4]` f32, one column a warp of the group), then
// meets the block's barrier, after which `red + row * 4` holds the group's
// four warps' parts of row `row`.
__device__ __forceinline__ void share_group_parts(float* red, const float (&part)[2], u32 row_a, u32 quarter,
                                                  u32 lane) {
    if ((lane & 3) == 0) {
        red[row_a * 4 + quarter] = part[0];
        red[(row_a + 8) * 4 + quarter] = part[1];
    }
    __syncthreads();
}

// The maxima of this thread's two rows of S (row_a, row_a + 8) over the
// block's keys: each warp's over its 8 keys (its lanes of a row), then the
// group's four warps' through `red` (`[rows, 4]` f32), read after a
// barrier the whole block reaches. Every thread of a row ends with the same
// value.
__device__ __forceinline__ void group_row_max(float (&block_max)[2], const float (&s)[4], float* red, u32 row_a,
                                              u32 quarter, u32 lane) {
    float part[2] = {fmaxf(s[0], s[1]), fmaxf(s[2], s[3])};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        part[half] = fmaxf(part[half], __shfl_xor_sync(0xffffffffu, part[half], 1));
        part[half] = fmaxf(part[half], __shfl_xor_sync(0xffffffffu, part[half], 2));
    }
    share_group_parts(red, part, row_a, quarter, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float* m4 = red + (row_a + half * 8) * 4;
        block_max[half] = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
    }
}

// The sums of this thread's two rows (row_a, row_a + 8) over the group's
// four warps' parts `part` (each warp's over its keys), in warp order,
// through `red` (`[rows, 4]` f32), read after a barrier the whole block
// reaches.
__device__ __forceinline__ void group_row_sum(float (&sum)[2], const float (&part)[2], float* red, u32 row_a,
                                              u32 quarter, u32 lane) {
    share_group_parts(red, part, row_a, quarter, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float* l4 = red + (row_a + half * 8) * 4;
        sum[half] = ((l4[0] + l4[1]) + l4[2]) + l4[3];
    }
}

extern "C" __global__ void __launch_bounds__(MQT_HEADS * 8) dsa_mqa_forward_mma(
    const bf16* q, const bf16* kv, const u32* indices, void* out, int ot, float* lse, u32 seq, u32 heads,
    u32 qk_dim, u32 v_dim, u32 topk, float scale, u64* status) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char mqt_shared[];
    const u32 groups = blockDim.x / 128;
    const u32 rows_q = groups * 16;
    bf16* qs = reinterpret_cast<bf16*>(mqt_shared);
    bf16* ks = qs + rows_q * MQT_PITCH;
    bf16* ps = ks + 2 * MQT_KEYS * MQT_PITCH;
    float* red = reinterpret_cast<float*>(ps + rows_q * MQT_P_PITCH);
    u32* keys = reinterpret_cast<u32*>(red + rows_q * 4);
    const u64 r = blockIdx.x;
    const u32 h0 = blockIdx.y * MQT_HEADS;
    const u32 nh = min(static_cast<u32>(MQT_HEADS), heads - h0);
    const u32 t = static_cast<u32>(r % seq);
    const u64 base = r - t;
    const u32 warp = threadIdx.x / 32;
    const u32 lane = threadIdx.x & 31;
    const u32 g = warp / 4;
    const u32 quarter = warp % 4;
    // The block's query heads (rows past nh as zeros).
    stage_rows<u32>(qs, MQT_PITCH, q + (r * heads + h0) * qk_dim, qk_dim, nh, rows_q, qk_dim);
    const u32 blocks = (topk + MQT_KEYS - 1) / MQT_KEYS;
    mqt_gather(ks, keys, kv, indices, r, topk, 0, t, seq, base, qk_dim, status);
    const u32 vq = v_dim / 4;
    float acc[MQT_MAX_V / 32][4];
#pragma unroll
    for (int n = 0; n < MQT_MAX_V / 32; ++n) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    }
    float run_max[2] = {neg_inf(), neg_inf()};
    float run_sum[2] = {0.0f, 0.0f};
    const u32 row_a = g * 16 + (lane >> 2);
    for (u32 blk = 0; blk < blocks; ++blk) {
        const u32 cur = blk & 1;
        const bf16* kt = ks + cur * MQT_KEYS * MQT_PITCH;
        const u32* kk = keys + cur * MQT_KEYS;
        mqt_advance(ks, keys, blk, blocks, kv, indices, r, topk, t, seq, base, qk_dim, status);
        // S for the group's 16 heads x keys [8 quarter, 8 quarter + 8).
        float s[4];
        group_scores(s, qs, kt, kk, g, quarter, lane, qk_dim, scale);
        const u32 col = quarter * 8 + 2 * (lane & 3);
        float block_max[2];
        group_row_max(block_max, s, red, row_a, quarter, lane);
        float alpha[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float next = fmaxf(run_max[half], block_max[half]);
            float p0 = 0.0f;
            float p1 = 0.0f;
            if (next != neg_inf()) {
                p0 = s[2 * half] == neg_inf() ? 0.0f : expf(s[2 * half] - next);
                p1 = s[2 * half + 1] == neg_inf() ? 0.0f : expf(s[2 * half + 1] - next);
            }
            alpha[half] = run_max[half] == neg_inf() ? (next == neg_inf() ? 1.0f : 0.0f) : expf(run_max[half] - next);
            float ps_sum = p0 + p1;
            ps_sum += __shfl_xor_sync(0xffffffffu, ps_sum, 1);
            ps_sum += __shfl_xor_sync(0xffffffffu, ps_sum, 2);
            run_sum[half] = run_sum[half] * alpha[half] + ps_sum;
            run_max[half] = next;
            *reinterpret_cast<u32*>(ps + (row_a + half * 8) * MQT_P_PITCH + col) = pack_bf16(p0, p1);
        }
#pragma unroll
        for (int n = 0; n < MQT_MAX_V / 32; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
        __syncthreads();
        // O[16 heads x this warp's quarter of the values] += P V.
#pragma unroll
        for (int k16 = 0; k16 < MQT_KEYS / 16; ++k16) {
            u32 fa[4];
            ldmatrix_x4(fa, shared_address(ps + (g * 16 + (lane & 15)) * MQT_P_PITCH + k16 * 16 + (lane >> 4) * 8));
#pragma unroll
            for (int np = 0; np < MQT_MAX_V / 64; ++np) {
                if (static_cast<u32>(np) * 16 < vq) {
                    u32 fb[4];
                    const u32 row = k16 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const u32 c = quarter * vq + np * 16 + (lane >> 4) * 8;
                    ldmatrix_x4_trans(fb, shared_address(kt + row * MQT_PITCH + c));
                    mma_bf16(acc[2 * np], fa, fb[0], fb[1]);
                    mma_bf16(acc[2 * np + 1], fa, fb[2], fb[3]);
                }
            }
        }
        __syncthreads();
    }
    // The row sums: the four warps' partial sums in warp order.
    float sums[2];
    group_row_sum(sums, run_sum, red, row_a, quarter, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 i = row_a + half * 8;
        const float sum = sums[half];
        if (i >= nh) {
            continue;
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const u64 at = (r * heads + h0 + i) * v_dim + quarter * vq;
#pragma unroll
        for (int n = 0; n < MQT_MAX_V / 32; ++n) {
            const u32 c = n * 8 + 2 * (lane & 3);
            if (c < vq) {
                store(out, ot, at + c, acc[n][2 * half] * inv);
                store(out, ot, at + c + 1, acc[n][2 * half + 1] * inv);
            }
        }
        if (quarter == 0 && (lane & 3) == 0) {
            lse[r * heads + h0 + i] = sum > 0.0f ? run_max[half] + logf(sum) : neg_inf();
        }
    }
}

// ---- the forward over one shared key/value row (MQA), Hopper warpgroup MMAs ----
//
// `dsa_mqa_forward_mma`'s attention on sm_90a for rows of a multiple of 64
// channels from 512 up to 576 and values of 512 (DeepSeek's 576 and 512).
// `wgmma` reads both operands of S = Q K^T and the values of P V straight
// from shared memory, so no warp stages fragments through `ldmatrix`, which
// bounds the `mma.sync` kernel (each of its warps reloads its heads' query
// fragments for every 8 keys). A block is a query row and up to 64 of its
// heads (the M of every product; fewer heads are zero rows), two
// warpgroups. The selected rows are gathered 64 at a time with `cp.async`
// (the next block's during this one's products) into the 128-byte
// swizzled layout `wgmma` reads (atom a: channels 64 a .. 64 a + 63 of the
// 64 rows, 128 bytes a row, 16-byte chunk c of row i at chunk c ^ (i % 8)),
// and serve as keys (read K-major, every channel) and values (read
// MN-major, the first 512). A warpgroup's registers hold 256 of the
// output's 512 columns (128 a thread), so warpgroup g owns columns 256 g ..
// 256 g + 255, and both compute the 64 x 64 scores: each then has every
// probability its P V needs without an exchange through shared memory,
// which the query heads and two key blocks (216 KiB at 576 channels) leave
// no room for. Both run the same products on the same tiles, so they keep
// the same maxima and sums. Every sum has one order fixed by the shapes.
#define MQW_THREADS 256
#define MQW_HEADS 64
#define MQW_KEYS 64
#define MQW_V 512
#define MQW_ATOM (64 * 128)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Issues (does not commit) the copies of ROWS rows of `dim` bf16 channels
// (a multiple of 64) into the swizzled atoms at `tile` (atom a: channels
// 64 a .. 64 a + 63 of the rows, ROWS * 128 bytes): row i from `row(i)`, a
// null row as zeros (`any` is read for none of them). The whole block
// (THREADS threads) calls it.
template <u32 ROWS, u32 THREADS = MQW_THREADS, typename Row>
__device__ __forceinline__ void mqw_stage(u32 tile, u32 dim, const bf16* any, Row row) {
    const u32 chunks = dim / 8;
    for (u32 c = threadIdx.x; c < ROWS * chunks; c += THREADS) {
        const u32 i = c / chunks;
        const u32 ch = c - i * chunks;
        const bf16* src = row(i);
        const u32 dst = tile + (ch / 8) * (ROWS * 128) + i * 128 + (((ch % 8) ^ (i % 8)) << 4);
        copy16_async(dst, src != nullptr ? src + ch * 8 : any, src != nullptr);
    }
}

// K-step kk (channels 16 kk .. 16 kk + 15) of a staged tile of ROWS rows
// read K-major: 32 kk bytes into atom kk / 4, the next 8 rows 1024 bytes on.
template <u32 ROWS>
__device__ __forceinline__ u64 mqw_k_major(u32 tile, u32 kk) {
    return swizzled_desc(tile + (kk / 4) * (ROWS * 128) + (kk % 4) * 32, 16, 1024);
}

// S = Q K^T over `dim` channels into a warpgroup's accumulator: Q the 64
// rows of a staged tile at `q_tile`, K the ROWS rows of one at `k_tile`
// (both read K-major). Issues the products and waits for them.
template <u32 ROWS>
__device__ __forceinline__ void mqw_scores(float (&s)[ROWS / 2], u32 q_tile, u32 k_tile, u32 dim) {
    wgmma_fence();
    for (u32 kk = 0; kk < dim / 16; ++kk) {
        wgmma_ss(s, mqw_k_major<64>(q_tile, kk), mqw_k_major<ROWS>(k_tile, kk), kk);
    }
    wgmma_finish();
    fence_operands(s);
}

// The double buffer's step before block blk's products: block blk + 1's
// positions (`select`, three buffers: a block's are written while the one
// before it is still read) and, after a barrier that also makes sure every
// warpgroup is done with the rows buffer they refill, its rows' copies
// (`gather`, issued and committed); then the wait for block blk's copies,
// made visible to the tensor cores for every thread's.
template <typename Select, typename Gather>
__device__ __forceinline__ void mqw_advance(u32 blk, u32 blocks, Select select, Gather gather) {
    if (blk + 1 < blocks) {
        select(blk + 1);
        __syncthreads();
        gather(blk + 1);
        wait_async<1>();
    } else {
        wait_async<0>();
    }
    fence_async_shared();
    __syncthreads();
}

// K-step kk (rows 16 kk .. 16 kk + 15) of a staged tile read MN-major from
// channel 64 `atom` on: the next 8 rows 1024 bytes on, the next 64
// channels an atom on.
__device__ __forceinline__ u64 mqw_mn_major(u32 tile, u32 atom, u32 kk) {
    return swizzled_desc(tile + atom * MQW_ATOM + kk * 2048, MQW_ATOM, 1024);
}
#endif

extern "C" __global__ void __launch_bounds__(MQW_THREADS, 1) dsa_mqa_forward_wgmma(
    const bf16* q, const bf16* kv, const u32* indices, void* out, int ot, float* lse, u32 seq, u32 heads,
    u32 qk_dim, u32 v_dim, u32 topk, float scale, u64* status) {
    grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char mqw_shared[];
    unsigned char* first = aligned_shared(mqw_shared);
    // The query heads, then two key blocks, then three blocks' positions
    // (a block's are written while the block before it is still read).
    const u32 tile_bytes = qk_dim * 128;
    const u32 qs = shared_address(first);
    const u32 ks = qs + tile_bytes;
    u32* keys = reinterpret_cast<u32*>(first + 3 * tile_bytes);
    const u64 r = blockIdx.x;
    const u32 h0 = blockIdx.y * MQW_HEADS;
    const u32 nh = min(static_cast<u32>(MQW_HEADS), heads - h0);
    const u32 t = static_cast<u32>(r % seq);
    const u64 base = r - t;
    const auto [group, lane, row] = group_lane();
    const u32 quad = lane & 3;
    // One block at least: with no selection its keys are all missing, and
    // the row's output is zeros and its lse -inf, as the other kernels'.
    const u32 blocks = max(1u, (topk + MQW_KEYS - 1) / MQW_KEYS);
    auto select = [&](u32 blk) {
        if (threadIdx.x < MQW_KEYS) {
            const u32 slot = blk * MQW_KEYS + threadIdx.x;
            keys[(blk % 3) * MQW_KEYS + threadIdx.x] =
                slot < topk ? selected_key(indices, r, topk, slot, t, seq, status) : NO_KEY;
        }
    };
    auto gather = [&](u32 blk) {
        const u32* kb = keys + (blk % 3) * MQW_KEYS;
        mqw_stage<MQW_KEYS>(ks + (blk & 1) * tile_bytes, qk_dim, kv, [&](u32 i) -> const bf16* {
            return kb[i] == NO_KEY ? nullptr : kv + (base + kb[i]) * qk_dim;
        });
        commit_async();
    };
    select(0);
    mqw_stage<MQW_HEADS>(qs, qk_dim, q,
              [&](u32 i) -> const bf16* { return i < nh ? q + (r * heads + h0 + i) * qk_dim : nullptr; });
    __syncthreads();
    gather(0);  // one group with the query heads' copies

    float o[2][64];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            o[w][i] = 0.0f;
        }
    }
    float mx[2] = {neg_inf(), neg_inf()};
    float sum[2] = {0.0f, 0.0f};
    for (u32 blk = 0; blk < blocks; ++blk) {
        mqw_advance(blk, blocks, select, gather);
        const u32 kt = ks + (blk & 1) * tile_bytes;
        const u32* kb = keys + (blk % 3) * MQW_KEYS;
        // S: the 64 heads x the block's 64 keys.
        float s[32];
        mqw_scores<MQW_KEYS>(s, qs, kt, qk_dim);
        // The online softmax of this thread's rows `row` and `row` + 8:
        // scaled scores (-inf for a missing key), the rows' running max,
        // the rescale of what came before, the probabilities.
        float x[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float& sv = s[4 * n + e];
                sv = kb[n * 8 + 2 * quad + (e & 1)] != NO_KEY ? sv * scale : neg_inf();
                x[e >> 1] = fmaxf(x[e >> 1], sv);
            }
        }
        float alpha[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float next = fmaxf(mx[i], quad_max(x[i]));
            // Nothing seen yet (the max still -inf): nothing to rescale.
            alpha[i] = next == neg_inf() ? 1.0f : expf(mx[i] - next);
            mx[i] = next;
            sum[i] *= alpha[i];
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float m = mx[e >> 1];
                float& sv = s[4 * n + e];
                sv = sv == neg_inf() ? 0.0f : expf(sv - m);
                sum[e >> 1] += sv;
            }
        }
#pragma unroll
        for (int w = 0; w < 2; ++w) {
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                o[w][4 * n + 0] *= alpha[0];
                o[w][4 * n + 1] *= alpha[0];
                o[w][4 * n + 2] *= alpha[1];
                o[w][4 * n + 3] *= alpha[1];
            }
        }
        // O += P V: P rounded to bf16 as the register A operand (as flash
        // attention feeds its probabilities), V this warpgroup's 256
        // channels of the rows as two products of 128.
        u32 p[MQW_KEYS / 16][4];
#pragma unroll
        for (int kk = 0; kk < MQW_KEYS / 16; ++kk) {
            a_operand(p[kk], s, kk);
        }
        fence_operands(o[0]);
        fence_operands(o[1]);
        fence_operands(p);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < MQW_KEYS / 16; ++kk) {
            wgmma_rs(o[0], p[kk], mqw_mn_major(kt, 4 * group, kk));
            wgmma_rs(o[1], p[kk], mqw_mn_major(kt, 4 * group + 2, kk));
        }
        wgmma_finish();
        fence_operands(o[0]);
        fence_operands(o[1]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float l = quad_sum(sum[i]);
        const u32 h = row + 8 * i;
        if (h >= nh) {
            continue;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const u64 at = (r * heads + h0 + h) * v_dim + group * (MQW_V / 2);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
#pragma unroll
            for (int n = 0; n < 16; ++n) {
                const u32 c = w * 128 + n * 8 + 2 * quad;
                store(out, ot, at + c, o[w][4 * n + 2 * i] * inv);
                store(out, ot, at + c + 1, o[w][4 * n + 2 * i + 1] * inv);
            }
        }
        if (group == 0 && quad == 0) {
            lse[r * heads + h0 + h] = l > 0.0f ? mx[i] + logf(l) : neg_inf();
        }
    }
#endif
}

// ---- the backward over one shared key/value row (MQA), tensor cores ---------------
//
// `Backend::sparse_mqa_backward` with bf16 q, kv and dout on tensor cores,
// summed query by query: a block takes query positions blockIdx.x,
// blockIdx.x + splits, ... of sequence blockIdx.y (interleaved, so every
// block meets as many short causal rows as long ones), each position's
// heads MQT_HEADS at a time (a group of 4 warps for each 16 heads, as the
// forward), and the selected keys MQT_KEYS at a time (gathered with
// `cp.async`, the next block's during this one's products). Per key block,
// warp q of a group computes for its 16 heads and keys [8q, 8q + 8):
// S = Q K^T and dP = dO V^T (each as two chains of products,
// `group_products`), P = exp(scale S - lse), dS = P (dP - delta)
// scale, delta = dout . out (a warp's fixed butterfly) and writes P and dS
// (bf16, as FlashAttention feeds its second products) to shared memory.
// Then dq += dS K (a warp's 16 heads, every fourth 8-channel block of the
// row, summed in registers over the whole selection) and the block's
// contribution to its keys' rows, dS^T Q + P^T dO over the heads (the
// value part only over the first v_dim channels), which each warp adds to
// the block's own f32 partial rows `[splits, rows, qk_dim]`
// (`add_pair_ordered`: no two threads of a block add into one element in
// one step, and the barriers between steps order the steps). A key's
// partials are summed in a fixed order afterwards (`dsa_mqa_partials_sum`):
// no adds race, every sum has one order fixed by the shapes and `splits`,
// so a rerun gives the same bits. The first head pass marks each selected
// (key, query) pair in the bitmap (a repeated key is a fault: it would add
// one element twice in one step). Takes what the forward takes (and dout
// as q); dq in its dtype.

// The pitch (elements) of staged dout rows: MQT_MAX_V + 8, 16 bytes past a
// multiple of 128 as MQT_PITCH.
#define MQB_G_PITCH 520
// 8-channel blocks of a key row's contribution a warp holds at a time.
#define MQB_KV_BLOCKS 3

// Two 8 x 8 b16 matrices, each transposed; lanes 8i..8i+7 give the row
// addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
}

// p[0] += a, p[1] += b in global memory without waiting for the sum: a
// reduction (`red`) the memory system applies. For the block-private
// partial rows only, where no two threads add into one element between two
// barriers: a barrier orders the adds before it ahead of those after it
// (the PTX memory model's coherence order follows happens-before), so each
// element's adds apply in step order and the bits repeat, while the thread
// never waits on a read of the row as a load-add-store would.
__device__ __forceinline__ void add_pair_ordered(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(b) : "memory");
#endif
}

// Each of `rows` heads' delta = dout . out (a warp a head at a time, its
// lanes over the channels, then its butterfly) into `dl`, and its lse into
// `ls`: heads `first`, `first` + 1, ... of the flat [rows x heads] rows,
// the first `valid` of them real; the rest 0 and +inf (so P is 0 there).
// The whole block calls it.
__device__ __forceinline__ void head_deltas(float* dl, float* ls, const void* out, int ot, const bf16* dout,
                                            const float* lse, u64 first, u32 valid, u32 rows, u32 v_dim) {
    const u32 lane = threadIdx.x & 31;
    for (u32 i = threadIdx.x / 32; i < rows; i += blockDim.x / 32) {
        float d = 0.0f;
        if (i < valid) {
            const u64 at = (first + i) * v_dim;
            for (u32 c = lane * 8; c < v_dim; c += 256) {
                float o[8];
                float gv[8];
                load8(out, ot, (at + c) / 8, o);
                load8(dout, DTYPE_BF16, (at + c) / 8, gv);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    d += gv[e] * o[e];
                }
            }
        }
        d = warp_sum(d);
        if (lane == 0) {
            dl[i] = d;
            ls[i] = i < valid ? lse[first + i] : -neg_inf();
        }
    }
}

extern "C" __global__ void __launch_bounds__(MQT_HEADS * 8) dsa_mqa_backward_mma(
    const bf16* q, const bf16* kv, const u32* indices, const void* out, int ot, const float* lse,
    const bf16* dout, void* dq, int dqt, float* partial, u32* bitmap, u32 words, u32 seq, u32 heads,
    u32 qk_dim, u32 v_dim, u32 topk, float scale, u32 splits, u64* status) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char mqb_shared[];
    const u32 groups = blockDim.x / 128;
    const u32 rows_q = groups * 16;
    bf16* qs = reinterpret_cast<bf16*>(mqb_shared);
    bf16* gs = qs + rows_q * MQT_PITCH;
    bf16* ks = gs + rows_q * MQB_G_PITCH;
    bf16* ps = ks + 2 * MQT_KEYS * MQT_PITCH;
    bf16* dss = ps + rows_q * MQT_P_PITCH;
    float* dl = reinterpret_cast<float*>(dss + rows_q * MQT_P_PITCH);
    float* ls = dl + rows_q;
    u32* keys = reinterpret_cast<u32*>(ls + rows_q);
    const u32 warp = threadIdx.x / 32;
    const u32 warps = blockDim.x / 32;
    const u32 lane = threadIdx.x & 31;
    const u32 g = warp / 4;
    const u32 quarter = warp % 4;
    const u32 row_a = g * 16 + (lane >> 2);
    const u64 base = static_cast<u64>(blockIdx.y) * seq;
    const u64 rows = static_cast<u64>(gridDim.y) * seq;
    float* mine = partial + (blockIdx.x * rows) * qk_dim;
    const u32 blocks = (topk + MQT_KEYS - 1) / MQT_KEYS;
    const u32 qk_blocks = qk_dim / 8;
    const u32 v_blocks = v_dim / 8;
    const u32 kv_items = 2 * ((qk_blocks + MQB_KV_BLOCKS - 1) / MQB_KV_BLOCKS);
    for (u32 t = blockIdx.x; t < seq; t += splits) {
        const u64 r = base + t;
        for (u32 h0 = 0; h0 < heads; h0 += MQT_HEADS) {
            const u32 nh = min(static_cast<u32>(MQT_HEADS), heads - h0);
            // The pass's query and dout heads (rows past nh as zeros).
            stage_rows<u32>(qs, MQT_PITCH, q + (r * heads + h0) * qk_dim, qk_dim, nh, rows_q, qk_dim);
            stage_rows<u32>(gs, MQB_G_PITCH, dout + (r * heads + h0) * v_dim, v_dim, nh, rows_q, v_dim);
            mqt_gather(ks, keys, kv, indices, r, topk, 0, t, seq, base, qk_dim, status);
            head_deltas(dl, ls, out, ot, dout, lse, r * heads + h0, nh, rows_q, v_dim);
            float acc[MQT_MAX_QK / 32][4];
#pragma unroll
            for (int n = 0; n < MQT_MAX_QK / 32; ++n) {
                acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
            }
            for (u32 blk = 0; blk < blocks; ++blk) {
                const u32 cur = blk & 1;
                const bf16* kt = ks + cur * MQT_KEYS * MQT_PITCH;
                const u32* kk = keys + cur * MQT_KEYS;
                if (h0 == 0 && threadIdx.x < MQT_KEYS && kk[threadIdx.x] != NO_KEY) {
                    mark_selected(bitmap, words, base + kk[threadIdx.x], t, status, r);
                }
                mqt_advance(ks, keys, blk, blocks, kv, indices, r, topk, t, seq, base, qk_dim, status);
                // S (scaled, -inf for a missing key) and dP for the group's
                // 16 heads x keys [8 quarter, 8 quarter + 8), dP as two
                // chains of products (even and odd 16-channel steps) as S.
                float s[4];
                group_scores(s, qs, kt, kk, g, quarter, lane, qk_dim, scale);
                float dp_even[4] = {};
                float dp_odd[4] = {};
                group_products(dp_even, dp_odd, gs + (g * 16 + (lane & 15)) * MQB_G_PITCH + (lane >> 4) * 8,
                               kt + (quarter * 8 + (lane & 7)) * MQT_PITCH + ((lane >> 3) & 1) * 8, v_dim);
                const u32 col = quarter * 8 + 2 * (lane & 3);
                // s[0], s[1]: row lane / 4, keys col, col + 1; s[2], s[3]: row + 8.
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const u32 i = row_a + half * 8;
                    const float l = ls[i];
                    const float d = dl[i];
                    float p[2];
                    float ds[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float x = s[2 * half + e];
                        p[e] = x == neg_inf() ? 0.0f : expf(x - l);
                        ds[e] = p[e] * ((dp_even[2 * half + e] + dp_odd[2 * half + e]) - d) * scale;
                    }
                    *reinterpret_cast<u32*>(ps + i * MQT_P_PITCH + col) = pack_bf16(p[0], p[1]);
                    *reinterpret_cast<u32*>(dss + i * MQT_P_PITCH + col) = pack_bf16(ds[0], ds[1]);
                }
                __syncthreads();
                // dq[16 heads x every fourth 8-channel block] += dS K.
#pragma unroll
                for (int k16 = 0; k16 < MQT_KEYS / 16; ++k16) {
                    u32 fa[4];
                    ldmatrix_x4(fa,
                                shared_address(dss + (g * 16 + (lane & 15)) * MQT_P_PITCH + k16 * 16 + (lane >> 4) * 8));
                    const bf16* brow = kt + (k16 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * MQT_PITCH;
#pragma unroll
                    for (int n = 0; n < MQT_MAX_QK / 32; ++n) {
                        const u32 j = quarter + 4 * n;
                        if (j < qk_blocks) {
                            u32 fb[2];
                            ldmatrix_x2_trans(fb, shared_address(brow + j * 8));
                            mma_bf16(acc[n], fa, fb[0], fb[1]);
                        }
                    }
                }
                // The keys' contribution: items of (16 keys, MQB_KV_BLOCKS
                // 8-channel blocks), dS^T Q + P^T dO over the pass's heads,
                // added to this block's partial rows.
                for (u32 item = warp; item < kv_items; item += warps) {
                    const u32 mb = item & 1;
                    const u32 j0 = (item >> 1) * MQB_KV_BLOCKS;
                    float c[MQB_KV_BLOCKS][4];
#pragma unroll
                    for (int n = 0; n < MQB_KV_BLOCKS; ++n) {
                        c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
                    }
                    for (u32 k16 = 0; k16 < groups; ++k16) {
                        // A = dS^T and P^T (keys x heads) read transposed.
                        const u32 at = (k16 * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * MQT_P_PITCH + mb * 16 +
                                       ((lane >> 3) & 1) * 8;
                        u32 fds[4];
                        u32 fp[4];
                        ldmatrix_x4_trans(fds, shared_address(dss + at));
                        ldmatrix_x4_trans(fp, shared_address(ps + at));
                        const u32 head = k16 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                        for (int n = 0; n < MQB_KV_BLOCKS; ++n) {
                            const u32 j = j0 + n;
                            if (j < qk_blocks) {
                                u32 fb[2];
                                ldmatrix_x2_trans(fb, shared_address(qs + head * MQT_PITCH + j * 8));
                                mma_bf16(c[n], fds, fb[0], fb[1]);
                                if (j < v_blocks) {
                                    ldmatrix_x2_trans(fb, shared_address(gs + head * MQB_G_PITCH + j * 8));
                                    mma_bf16(c[n], fp, fb[0], fb[1]);
                                }
                            }
                        }
                    }
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const u32 u = kk[mb * 16 + (lane >> 2) + half * 8];
                        if (u == NO_KEY) {
                            continue;
                        }
                        float* row = mine + (base + u) * qk_dim + 2 * (lane & 3);
#pragma unroll
                        for (int n = 0; n < MQB_KV_BLOCKS; ++n) {
                            const u32 j = j0 + n;
                            if (j < qk_blocks) {
                                add_pair_ordered(row + j * 8, c[n][2 * half], c[n][2 * half + 1]);
                            }
                        }
                    }
                }
                __syncthreads();
            }
            if (blocks == 0) {
                wait_async<0>();
                __syncthreads();
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 i = row_a + half * 8;
                if (i >= nh) {
                    continue;
                }
                const u64 at = (r * heads + h0 + i) * qk_dim + 2 * (lane & 3);
#pragma unroll
                for (int n = 0; n < MQT_MAX_QK / 32; ++n) {
                    const u32 j = quarter + 4 * n;
                    if (j < qk_blocks) {
                        store(dq, dqt, at + j * 8, acc[n][2 * half]);
                        store(dq, dqt, at + j * 8 + 1, acc[n][2 * half + 1]);
                    }
                }
            }
        }
    }
}

// ---- the backward over one shared key/value row (MQA), warpgroup MMAs ------------
//
// `dsa_mqa_backward_mma`'s work on sm_90a for the warpgroup forward's
// shapes (rows of a multiple of 64 channels from 512 up to 576, values of
// 512), with the same blocks (a block takes query positions blockIdx.x,
// blockIdx.x + splits, ... of sequence blockIdx.y, each position's heads 64
// at a time), the same partial key rows and the same bitmap of selected
// pairs. Three warpgroups; per 64 selected keys (gathered with `cp.async`
// into the swizzled layout of the forward, the next block's while this
// one's key gradients are computed):
//   A. warpgroup 0 computes S = Q K^T and P = exp(scale S - lse) (0 for a
//      missing key) and writes P (bf16) to shared memory; warpgroup 1
//      computes dP = dO V^T, reads P back and writes dS = P (dP - delta)
//      scale (bf16). Warpgroup 2 waits: by count, S and dP alone read as
//      much shared memory a cycle as the SM delivers.
//   B. dq += dS K: warpgroup g owns the 64-channel atoms g, g + 3, g + 6 of
//      dq (registers, summed over the whole selection); dS is read from
//      shared memory (K-major), the keys across their rows (MN-major).
//   C. the keys' gradient rows dS^T Q + P^T dO (the value part only over
//      the first 512 channels), 64 channels at a time (warpgroup g the
//      atoms g, g + 3, g + 6): dS^T and P^T read MN-major from the tiles
//      the products of A wrote, Q and dO across their rows; each chunk is
//      added to the block's partial rows (`add_pair_ordered`: one thread an
//      element between two barriers, as the `mma.sync` kernel). Trading
//      rows between lane pairs for 16-byte reductions, half as many, was
//      slower on an H100 (44.0 against 36.6 ms at 128 heads and 4,096
//      tokens; it also spilled twice the bytes).
// Q (72 KiB at 576 channels), dO (64 KiB), one key block (72 KiB), P and dS
// (8 KiB each) fill the 227 KiB a block gets, so the key block is single:
// the next block's copies are issued once B is done with it and land
// during C. Every sum has one order fixed by the shapes and `splits`.
#define MQBW_THREADS 384

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The bf16 pair of (row i, columns 2 quad + 8 n, + 1) of a staged 64 x 64
// tile (one atom: row i's 128 bytes at 128 i, chunk n at n ^ (i % 8)).
__device__ __forceinline__ u32* mqbw_pair(unsigned char* tile, u32 i, u32 n, u32 quad) {
    return reinterpret_cast<u32*>(tile + i * 128 + ((n ^ (i & 7)) << 4) + quad * 4);
}
#endif

extern "C" __global__ void __launch_bounds__(MQBW_THREADS, 1) dsa_mqa_backward_wgmma(
    const bf16* q, const bf16* kv, const u32* indices, const void* out, int ot, const float* lse,
    const bf16* dout, void* dq, int dqt, float* partial, u32* bitmap, u32 words, u32 seq, u32 heads,
    u32 qk_dim, u32 v_dim, u32 topk, float scale, u32 splits, u64* status) {
    grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char mqbw_shared[];
    unsigned char* first = aligned_shared(mqbw_shared);
    // Q, dO, the key block, P, dS (every tile 64 rows, atoms of 8 KiB),
    // then three blocks' positions, each head's delta and lse, and three
    // blocks' masks of present keys (bit i: key i is not missing).
    const u32 q_bytes = qk_dim * 128;
    const u32 qs0 = shared_address(first);
    const u32 gs0 = qs0 + q_bytes;
    const u32 kt0 = gs0 + v_dim * 128;
    unsigned char* p_tile = first + 2 * q_bytes + v_dim * 128;
    unsigned char* ds_tile = p_tile + MQW_ATOM;
    const u32 ps0 = shared_address(p_tile);
    const u32 dss0 = shared_address(ds_tile);
    u32* keys = reinterpret_cast<u32*>(ds_tile + MQW_ATOM);
    float* dl = reinterpret_cast<float*>(keys + 3 * MQW_KEYS);
    float* ls = dl + MQW_HEADS;
    u32* present = reinterpret_cast<u32*>(ls + MQW_HEADS);
    const auto [group, lane, row] = group_lane();
    const u32 quad = lane & 3;
    const u64 base = static_cast<u64>(blockIdx.y) * seq;
    const u64 rows = static_cast<u64>(gridDim.y) * seq;
    float* mine = partial + (blockIdx.x * rows) * qk_dim;
    const u32 atoms = qk_dim / 64;
    const u32 v_atoms = v_dim / 64;
    const u32 blocks = max(1u, (topk + MQW_KEYS - 1) / MQW_KEYS);
    for (u32 t = blockIdx.x; t < seq; t += splits) {
        const u64 r = base + t;
        auto select = [&](u32 blk) {
            if (threadIdx.x < MQW_KEYS) {
                const u32 slot = blk * MQW_KEYS + threadIdx.x;
                const u32 key = slot < topk ? selected_key(indices, r, topk, slot, t, seq, status) : NO_KEY;
                keys[(blk % 3) * MQW_KEYS + threadIdx.x] = key;
                const u32 mask = __ballot_sync(0xffffffffu, key != NO_KEY);
                if (threadIdx.x % 32 == 0) {
                    present[(blk % 3) * 2 + threadIdx.x / 32] = mask;
                }
            }
        };
        auto gather = [&](u32 blk) {
            const u32* kb = keys + (blk % 3) * MQW_KEYS;
            mqw_stage<MQW_KEYS, MQBW_THREADS>(kt0, qk_dim, kv, [&](u32 i) -> const bf16* {
                return kb[i] == NO_KEY ? nullptr : kv + (base + kb[i]) * qk_dim;
            });
            commit_async();
        };
        for (u32 h0 = 0; h0 < heads; h0 += MQW_HEADS) {
            const u32 nh = min(static_cast<u32>(MQW_HEADS), heads - h0);
            // Every warpgroup is done with the last pass's tiles and positions.
            __syncthreads();
            select(0);
            mqw_stage<MQW_HEADS, MQBW_THREADS>(
                qs0, qk_dim, q, [&](u32 i) -> const bf16* { return i < nh ? q + (r * heads + h0 + i) * qk_dim : nullptr; });
            mqw_stage<MQW_HEADS, MQBW_THREADS>(gs0, v_dim, dout, [&](u32 i) -> const bf16* {
                return i < nh ? dout + (r * heads + h0 + i) * v_dim : nullptr;
            });
            __syncthreads();
            gather(0);  // one group with the heads' copies
            head_deltas(dl, ls, out, ot, dout, lse, r * heads + h0, nh, MQW_HEADS, v_dim);
            float acc[3][32];
#pragma unroll
            for (int j = 0; j < 3; ++j) {
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    acc[j][i] = 0.0f;
                }
            }
            for (u32 blk = 0; blk < blocks; ++blk) {
                const u32* kb = keys + (blk % 3) * MQW_KEYS;
                // The tiles' addresses, opaque to the compiler each block:
                // otherwise it keeps every product's descriptors (fixed
                // addresses) live across the loop, and spills.
                u32 qs = qs0, gs = gs0, kt = kt0, ps = ps0, dss = dss0;
                asm volatile("" : "+r"(qs), "+r"(gs), "+r"(kt), "+r"(ps), "+r"(dss));
                // The key block's rows (and, the first time, the heads')
                // have landed; delta and lse are in place.
                wait_async<0>();
                fence_async_shared();
                __syncthreads();
                if (h0 == 0 && threadIdx.x < MQW_KEYS && kb[threadIdx.x] != NO_KEY) {
                    mark_selected(bitmap, words, base + kb[threadIdx.x], t, status, r);
                }
                if (blk + 1 < blocks) {
                    select(blk + 1);  // a buffer block blk - 2 last read
                }
                // A: P (warpgroup 0) and dS (warpgroup 1), each thread its
                // accumulator rows `row`, `row` + 8 and keys 8 n + 2 quad, + 1.
                // S, dP and C's chunks share one accumulator `x` (the
                // warpgroups' registers are allocated alike, and the
                // compiler gives each named accumulator its own registers,
                // which with dq's would not fit).
                float x[32];
                if (group < 2) {
                    mqw_scores<MQW_KEYS>(x, group == 0 ? qs : gs, kt, group == 0 ? qk_dim : v_dim);
                    if (group == 0) {
                        // Bit 8 n + e: key 8 n + 2 quad + e is present.
                        const u64 here = (present[(blk % 3) * 2] |
                                          static_cast<u64>(present[(blk % 3) * 2 + 1]) << 32) >>
                                         (2 * quad);
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const u32 i = row + 8 * h;
                                const float l = ls[i];
                                float p[2];
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const bool ok = (here >> (8 * n + e)) & 1;
                                    p[e] = ok ? expf(x[4 * n + 2 * h + e] * scale - l) : 0.0f;
                                }
                                *mqbw_pair(p_tile, i, n, quad) = pack_bf16(p[0], p[1]);
                            }
                        }
                        named_barrier<1, 256>();
                    } else {
                        named_barrier<1, 256>();
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const u32 i = row + 8 * h;
                                const float d = dl[i];
                                const float2 p = __bfloat1622float2(
                                    *reinterpret_cast<const __nv_bfloat162*>(mqbw_pair(p_tile, i, n, quad)));
                                const float ds0 = p.x * (x[4 * n + 2 * h] - d) * scale;
                                const float ds1 = p.y * (x[4 * n + 2 * h + 1] - d) * scale;
                                *mqbw_pair(ds_tile, i, n, quad) = pack_bf16(ds0, ds1);
                            }
                        }
                    }
                }
                fence_async_shared();
                __syncthreads();
                // B: dq (this warpgroup's atoms) += dS K.
#pragma unroll
                for (int j = 0; j < 3; ++j) {
                    fence_operands(acc[j]);
                }
                wgmma_fence();
#pragma unroll
                for (int j = 0; j < 3; ++j) {
                    const u32 a = group + 3 * j;
                    if (a < atoms) {
#pragma unroll
                        for (int kk = 0; kk < MQW_KEYS / 16; ++kk) {
                            wgmma_ss<0, 1>(acc[j], mqw_k_major<MQW_HEADS>(dss, kk), mqw_mn_major(kt, a, kk), 1);
                        }
                    }
                }
                wgmma_finish();
#pragma unroll
                for (int j = 0; j < 3; ++j) {
                    fence_operands(acc[j]);
                }
                // Every warpgroup is done with the key block: refill it.
                __syncthreads();
                if (blk + 1 < blocks) {
                    gather(blk + 1);
                }
                // C: the keys' rows, 64 channels at a time. dS^T and P^T
                // are MN-major A operands (64 keys one 128-byte row of a
                // head, the K-step 16 heads); Q and dO MN-major B ones.
                for (u32 c = group; c < atoms; c += 3) {
                    fence_operands(x);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < MQW_HEADS / 16; ++kk) {
                        wgmma_ss<1, 1>(x, mqw_mn_major(dss, 0, kk), mqw_mn_major(qs, c, kk), kk);
                    }
                    if (c < v_atoms) {
#pragma unroll
                        for (int kk = 0; kk < MQW_HEADS / 16; ++kk) {
                            wgmma_ss<1, 1>(x, mqw_mn_major(ps, 0, kk), mqw_mn_major(gs, c, kk), 1);
                        }
                    }
                    wgmma_finish();
                    fence_operands(x);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 u = kb[row + 8 * h];
                        if (u == NO_KEY) {
                            continue;
                        }
                        float* dst = mine + (base + u) * qk_dim + c * 64 + 2 * quad;
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
                            add_pair_ordered(dst + n * 8, x[4 * n + 2 * h], x[4 * n + 2 * h + 1]);
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 i = row + 8 * h;
                if (i >= nh) {
                    continue;
                }
                const u64 at = (r * heads + h0 + i) * qk_dim + 2 * quad;
#pragma unroll
                for (int j = 0; j < 3; ++j) {
                    const u32 a = group + 3 * j;
                    if (a < atoms) {
#pragma unroll
                        for (int n = 0; n < 8; ++n) {
                            store(dq, dqt, at + a * 64 + n * 8, acc[j][4 * n + 2 * h]);
                            store(dq, dqt, at + a * 64 + n * 8 + 1, acc[j][4 * n + 2 * h + 1]);
                        }
                    }
                }
            }
        }
    }
#endif
}

// dkv = the sum of the `splits` partial rows `[splits, count]` of
// `dsa_mqa_backward_mma` (or `_wgmma`), in split order, stored in dkv's dtype; a thread
// 4 consecutive elements (count a multiple of 4).
extern "C" __global__ void __launch_bounds__(256) dsa_mqa_partials_sum(const float* partial, u32 splits, u64 count,
                                                                       void* dkv, int dkvt) {
    grid_dependency_sync();
    for (u64 i = grid_start() * 4; i < count; i += grid_stride() * 4) {
        float4 sum = *reinterpret_cast<const float4*>(partial + i);
        for (u32 s = 1; s < splits; ++s) {
            const float4 v = *reinterpret_cast<const float4*>(partial + s * count + i);
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
        store(dkv, dkvt, i, sum.x);
        store(dkv, dkvt, i + 1, sum.y);
        store(dkv, dkvt, i + 2, sum.z);
        store(dkv, dkvt, i + 3, sum.w);
    }
}

// ---- the indexer's loss target on tensor cores -------------------------------------
//
// With bf16 q and k, the loss's target (each head's softmax over the row's
// items, summed over the heads) is computed on tensor cores as the MQA
// forward computes its scores: a block a query row, its heads MQT_HEADS at
// a time (a group of 4 warps a 16 heads); for the dense loss with at most
// 32 heads, 4 / (groups a row) consecutive rows a block, which share the
// last row's items (every causal key) and so each gathered key row (a
// row's groups mask the keys after it). The items' key rows are gathered
// MQT_KEYS at a time (the next block's during this one's products). A
// first pass over the items finds each head's max and sum (the group's
// four warps' maxima meet in shared memory each block, the sums in warp
// order at the end); a second computes the probabilities again, sums each
// item's over the group's 16 heads (a fixed butterfly) and the groups in
// order, and adds them to the row of `d_scores` (zeroed first, every
// position; each item one thread's). `dsa_indexer_loss` then takes the
// row as given (`target_ready`) for the KL and its gradient. Every sum has
// one order fixed by the shapes, so a rerun gives the same bits; they are
// not the CUDA-core kernel's (a bf16 product is exact in f32, the
// difference is the order of the sums).

// Gathers the key rows of items [s0, s0 + MQT_KEYS) of the loss's row (see
// `loss_key`) into `tile` (see `stage_key_rows`) after writing their
// positions to `keys`.
__device__ __forceinline__ void loss_gather(bf16* tile, u32* keys, const bf16* k, const u32* row_ix, u32 s0, u32 items,
                                            u32 t, u32 seq, int sparse, u64 base, u32 dim, u64* status, u64 r) {
    if (threadIdx.x < MQT_KEYS) {
        const u32 i = s0 + threadIdx.x;
        keys[threadIdx.x] = i < items ? loss_key(row_ix, i, t, seq, sparse, status, r) : NO_KEY;
    }
    stage_key_rows(tile, keys, k, base, dim);
}

extern "C" __global__ void __launch_bounds__(MQT_HEADS * 8) dsa_indexer_loss_target_mma(
    const bf16* q, const bf16* k, const u32* indices, float* d_scores, u32 seq, u32 topk, u32 heads, u32 dim,
    float scale, int sparse, u32 rows_per_block, u64* status) {
    grid_dependency_sync();
    extern __shared__ __align__(16) unsigned char ltm_shared[];
    const u32 groups = blockDim.x / 128;
    const u32 rows_q = groups * 16;
    // Groups a query row (its heads 16 at a time), and this warp's row.
    const u32 row_groups = groups / rows_per_block;
    bf16* qs = reinterpret_cast<bf16*>(ltm_shared);
    bf16* ks = qs + rows_q * MQT_PITCH;
    float* red = reinterpret_cast<float*>(ks + 2 * MQT_KEYS * MQT_PITCH);
    float* colsum = red + rows_q * 4;
    u32* keys = reinterpret_cast<u32*>(colsum + 4 * MQT_KEYS);
    const u64 base = static_cast<u64>(blockIdx.y) * seq;
    const u32 t0 = blockIdx.x * rows_per_block;
    // The block's last row: its items (dense) cover every other row's.
    const u32 t_last = min(t0 + rows_per_block, seq) - 1;
    const u32 warp = threadIdx.x / 32;
    const u32 lane = threadIdx.x & 31;
    const u32 g = warp / 4;
    const u32 quarter = warp % 4;
    const u32 row_a = g * 16 + (lane >> 2);
    const u32 t = t0 + g / row_groups;
    const u32 items = sparse ? topk : t_last + 1;
    const u32 blocks = (items + MQT_KEYS - 1) / MQT_KEYS;
    // Sparse rows are one a block (rows_per_block 1): their items.
    const u32* row_ix = indices + (base + t0) * topk;
    for (u32 j = 0; j < rows_per_block && t0 + j < seq; ++j) {
        float* d_row = d_scores + (base + t0 + j) * seq;
        for (u32 u = threadIdx.x; u < seq; u += blockDim.x) {
            d_row[u] = 0.0f;
        }
    }
    for (u32 h0 = 0; h0 < heads; h0 += MQT_HEADS) {
        // Each row's heads h0 .. in its groups' tile rows (zeros past the
        // heads or the sequence).
        const u32 row_heads = row_groups * 16;
        for (u32 j = 0; j < rows_per_block; ++j) {
            const u32 n = t0 + j < seq ? min(row_heads, heads - h0) : 0;
            stage_rows<u32>(qs + j * row_heads * MQT_PITCH, MQT_PITCH, q + ((base + t0 + j) * heads + h0) * dim, dim,
                            n, row_heads, dim);
        }
        const u32 head_a = h0 + (g % row_groups) * 16 + (lane >> 2);
        const bool live[2] = {head_a < heads && t < seq, head_a + 8 < heads && t < seq};
        float run_max[2] = {neg_inf(), neg_inf()};
        float run_sum[2] = {0.0f, 0.0f};
        // Pass 0: each head's max and sum; pass 1: the probabilities.
        for (int pass = 0; pass < 2; ++pass) {
            float inv[2] = {0.0f, 0.0f};
            if (pass == 1) {
                // The row sums: the four warps' partial sums in warp order.
                float sums[2];
                group_row_sum(sums, run_sum, red, row_a, quarter, lane);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    inv[half] = sums[half] > 0.0f ? 1.0f / sums[half] : 0.0f;
                }
                __syncthreads();
            }
            loss_gather(ks, keys, k, row_ix, 0, items, t_last, seq, sparse, base, dim, status, base + t0);
            for (u32 blk = 0; blk < blocks; ++blk) {
                const u32 cur = blk & 1;
                const bf16* kt = ks + cur * MQT_KEYS * MQT_PITCH;
                const u32* kk = keys + cur * MQT_KEYS;
                if (blk + 1 < blocks) {
                    loss_gather(ks + (cur ^ 1) * MQT_KEYS * MQT_PITCH, keys + (cur ^ 1) * MQT_KEYS, k, row_ix,
                                (blk + 1) * MQT_KEYS, items, t_last, seq, sparse, base, dim, status, base + t0);
                    wait_async<1>();
                } else {
                    wait_async<0>();
                }
                __syncthreads();
                float s[4];
                group_scores(s, qs, kt, kk, g, quarter, lane, dim, scale);
                // Keys after this warp's row (dense rows share the block's
                // items) are not its items.
                const u32 col = quarter * 8 + 2 * (lane & 3);
                if (kk[col] == NO_KEY || kk[col] > t) {
                    s[0] = s[2] = neg_inf();
                }
                if (kk[col + 1] == NO_KEY || kk[col + 1] > t) {
                    s[1] = s[3] = neg_inf();
                }
                if (pass == 0) {
                    float block_max[2];
                    group_row_max(block_max, s, red, row_a, quarter, lane);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float next = fmaxf(run_max[half], block_max[half]);
                        float p0 = 0.0f;
                        float p1 = 0.0f;
                        if (next != neg_inf()) {
                            p0 = s[2 * half] == neg_inf() ? 0.0f : expf(s[2 * half] - next);
                            p1 = s[2 * half + 1] == neg_inf() ? 0.0f : expf(s[2 * half + 1] - next);
                        }
                        const float alpha = run_max[half] == neg_inf() ? 0.0f : expf(run_max[half] - next);
                        float ps_sum = p0 + p1;
                        ps_sum += __shfl_xor_sync(0xffffffffu, ps_sum, 1);
                        ps_sum += __shfl_xor_sync(0xffffffffu, ps_sum, 2);
                        run_sum[half] = run_sum[half] * alpha + ps_sum;
                        run_max[half] = next;
                    }
                } else {
                    // Each item's probabilities summed over the group's 16
                    // heads: a lane's two rows, then the lanes of its
                    // column (a fixed butterfly over lane bits 2-4).
                    float c0 = 0.0f;
                    float c1 = 0.0f;
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        if (live[half] && run_max[half] != neg_inf()) {
                            c0 += s[2 * half] == neg_inf() ? 0.0f : expf(s[2 * half] - run_max[half]) * inv[half];
                            c1 += s[2 * half + 1] == neg_inf() ? 0.0f
                                                                : expf(s[2 * half + 1] - run_max[half]) * inv[half];
                        }
                    }
#pragma unroll
                    for (int m = 4; m < 32; m <<= 1) {
                        c0 += __shfl_xor_sync(0xffffffffu, c0, m);
                        c1 += __shfl_xor_sync(0xffffffffu, c1, m);
                    }
                    if (lane < 4) {
                        const u32 col = quarter * 8 + 2 * lane;
                        colsum[g * MQT_KEYS + col] = c0;
                        colsum[g * MQT_KEYS + col + 1] = c1;
                    }
                    __syncthreads();
                    // A thread a (row, item): the row's groups in order.
                    if (threadIdx.x < rows_per_block * MQT_KEYS) {
                        const u32 j = threadIdx.x / MQT_KEYS;
                        const u32 i = threadIdx.x % MQT_KEYS;
                        const u32 u = kk[i];
                        if (u != NO_KEY && u <= t0 + j && t0 + j < seq) {
                            float sum = 0.0f;
                            for (u32 gg = j * row_groups; gg < (j + 1) * row_groups; ++gg) {
                                sum += colsum[gg * MQT_KEYS + i];
                            }
                            d_scores[(base + t0 + j) * seq + u] += sum;
                        }
                    }
                }
                __syncthreads();
            }
            if (blocks == 0) {
                wait_async<0>();
                __syncthreads();
            }
        }
    }
}

// ---- the indexer's loss target on Hopper's warpgroup MMAs -------------------------
//
// `dsa_indexer_loss_target_mma`'s target on sm_90a for more than 64 heads
// and rows of a multiple of 64 channels up to 576 (DeepSeek's 128 heads of
// 576): a block a query row and its heads 128 at a time, warpgroup g the
// heads h0 + 64 g .. h0 + 64 g + 63 (its own query tile, zero rows past
// the heads), both reading the same key rows, gathered 32 at a time into
// the 128-byte swizzled layout `wgmma` reads (the next block's during this
// one's products). Each warpgroup's S = Q K^T (64 heads by 32 items, both
// operands from shared memory) gives each thread two heads' scores of the
// block, so a head's max and sum are its quad's (a fixed butterfly), in
// the first pass over the items; the second pass computes the
// probabilities again, sums each item's over the warp's 16 heads (a
// butterfly over the lanes of its column), then the block's eight warps in
// order, and adds that to the item's position in the row of `d_scores`
// (zeroed first; each item one thread's). Every sum has one order fixed by
// the shapes, so a rerun gives the same bits.
#define LTW_KEYS 32

extern "C" __global__ void __launch_bounds__(MQW_THREADS, 1) dsa_indexer_loss_target_wgmma(
    const bf16* q, const bf16* k, const u32* indices, float* d_scores, u32 seq, u32 topk, u32 heads, u32 dim,
    float scale, int sparse, u64* status) {
    grid_dependency_sync();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char ltw_shared[];
    unsigned char* first = aligned_shared(ltw_shared);
    // The two warpgroups' query tiles, then two key blocks, then three
    // blocks' positions and the warps' item sums.
    const u32 q_bytes = dim * 128;
    const u32 k_bytes = dim * 64;
    const u32 qs = shared_address(first);
    const u32 ks = qs + 2 * q_bytes;
    u32* keys = reinterpret_cast<u32*>(first + 2 * q_bytes + 2 * k_bytes);
    float* colsum = reinterpret_cast<float*>(keys + 3 * LTW_KEYS);
    const u32 t = blockIdx.x;
    const u64 base = static_cast<u64>(blockIdx.y) * seq;
    const u64 r = base + t;
    const auto [group, lane, row] = group_lane();
    const u32 warp = threadIdx.x / 32;
    const u32 quad = lane & 3;
    const u32* row_ix = indices + r * topk;
    const u32 items = sparse ? topk : t + 1;
    const u32 blocks = max(1u, (items + LTW_KEYS - 1) / LTW_KEYS);
    float* d_row = d_scores + r * seq;
    for (u32 u = threadIdx.x; u < seq; u += MQW_THREADS) {
        d_row[u] = 0.0f;
    }
    auto select = [&](u32 blk) {
        if (threadIdx.x < LTW_KEYS) {
            const u32 i = blk * LTW_KEYS + threadIdx.x;
            keys[(blk % 3) * LTW_KEYS + threadIdx.x] = i < items ? loss_key(row_ix, i, t, seq, sparse, status, r) : NO_KEY;
        }
    };
    auto gather = [&](u32 blk) {
        const u32* kb = keys + (blk % 3) * LTW_KEYS;
        mqw_stage<LTW_KEYS>(ks + (blk & 1) * k_bytes, dim, k, [&](u32 i) -> const bf16* {
            return kb[i] == NO_KEY ? nullptr : k + (base + kb[i]) * dim;
        });
        commit_async();
    };
    for (u32 h0 = 0; h0 < heads; h0 += 2 * MQW_HEADS) {
        // This thread's two heads, and whether each is one.
        const bool live[2] = {h0 + group * MQW_HEADS + row < heads, h0 + group * MQW_HEADS + row + 8 < heads};
        float mx[2] = {neg_inf(), neg_inf()};
        float sum[2] = {0.0f, 0.0f};
        float inv[2] = {0.0f, 0.0f};
        for (int pass = 0; pass < 2; ++pass) {
            // The block's previous use of the tiles and positions (the last
            // pass's last block) is done everywhere.
            __syncthreads();
            select(0);
            if (pass == 0) {
                // Each warpgroup's 64 heads (its tile's own atoms).
                for (u32 g = 0; g < 2; ++g) {
                    mqw_stage<MQW_HEADS>(qs + g * q_bytes, dim, q, [&](u32 i) -> const bf16* {
                        const u32 h = h0 + g * MQW_HEADS + i;
                        return h < heads ? q + (r * heads + h) * dim : nullptr;
                    });
                }
            }
            __syncthreads();
            gather(0);
            for (u32 blk = 0; blk < blocks; ++blk) {
                mqw_advance(blk, blocks, select, gather);
                const u32 kt = ks + (blk & 1) * k_bytes;
                const u32* kb = keys + (blk % 3) * LTW_KEYS;
                float s[16];
                mqw_scores<LTW_KEYS>(s, qs + group * q_bytes, kt, dim);
#pragma unroll
                for (int n = 0; n < LTW_KEYS / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float& sv = s[4 * n + e];
                        sv = kb[n * 8 + 2 * quad + (e & 1)] != NO_KEY ? sv * scale : neg_inf();
                    }
                }
                if (pass == 0) {
                    float x[2] = {neg_inf(), neg_inf()};
#pragma unroll
                    for (int i = 0; i < LTW_KEYS / 2; ++i) {
                        x[(i >> 1) & 1] = fmaxf(x[(i >> 1) & 1], s[i]);
                    }
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const float next = fmaxf(mx[i], quad_max(x[i]));
                        sum[i] *= next == neg_inf() ? 1.0f : expf(mx[i] - next);
                        mx[i] = next;
                    }
#pragma unroll
                    for (int i = 0; i < LTW_KEYS / 2; ++i) {
                        const int h = (i >> 1) & 1;
                        sum[h] += s[i] == neg_inf() ? 0.0f : expf(s[i] - mx[h]);
                    }
                } else {
                    // Each item's probabilities over this thread's two
                    // heads, then over the warp's 16 (lanes 4 apart).
                    float c[LTW_KEYS / 4];
#pragma unroll
                    for (int n = 0; n < LTW_KEYS / 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float v = 0.0f;
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const float sv = s[4 * n + 2 * h + e];
                                if (live[h] && sv != neg_inf()) {
                                    v += expf(sv - mx[h]) * inv[h];
                                }
                            }
#pragma unroll
                            for (int m = 4; m < 32; m <<= 1) {
                                v += __shfl_xor_sync(0xffffffffu, v, m);
                            }
                            c[2 * n + e] = v;
                        }
                    }
                    if (lane < 4) {
#pragma unroll
                        for (int n = 0; n < LTW_KEYS / 8; ++n) {
                            colsum[warp * LTW_KEYS + n * 8 + 2 * lane] = c[2 * n];
                            colsum[warp * LTW_KEYS + n * 8 + 2 * lane + 1] = c[2 * n + 1];
                        }
                    }
                    __syncthreads();
                    // A thread an item: the eight warps in order.
                    if (threadIdx.x < LTW_KEYS) {
                        const u32 u = kb[threadIdx.x];
                        if (u != NO_KEY) {
                            float total = 0.0f;
                            for (u32 w = 0; w < MQW_THREADS / 32; ++w) {
                                total += colsum[w * LTW_KEYS + threadIdx.x];
                            }
                            d_row[u] += total;
                        }
                    }
                }
            }
            if (pass == 0) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float l = quad_sum(sum[i]);
                    inv[i] = l > 0.0f ? 1.0f / l : 0.0f;
                }
            }
        }
    }
#endif
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

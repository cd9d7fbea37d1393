// Moving rows by index: gathers, scatters, and the MoE combine (unpermute)
// with its backward (`Backend::gather_rows`, `scatter_rows`, `moe_unpermute`,
// `moe_unpermute_backward`). Row moves copy the stored bits; the combine sums
// a token's k rows in slot order in f32.
#include "common.cuh"

// Row moves: one block per row (striding over rows), its threads over the
// row's words, 16 bytes each where the rows and pointers allow it (the
// launcher picks `word_bytes`: 16, 4 or 2). An element-per-thread loop
// with a 64-bit division per element moved a 64 MiB activation at a third
// of the memory's bandwidth.
template <typename W>
__device__ __forceinline__ void move_rows(
    const void* src, const u32* index, void* dst, bool gather, u64 count, u64 words, u64 bound,
    u64* status) {
    const W* s = static_cast<const W*>(src);
    W* d = static_cast<W*>(dst);
    for (u64 i = blockIdx.x; i < count; i += gridDim.x) {
        const u32 r = index[i];
        if (r >= bound) {
            if (threadIdx.x == 0) {
                report_fault(status, FAULT_ROW_INDEX, i);
            }
            continue;
        }
        const u64 from = (gather ? static_cast<u64>(r) : i) * words;
        const u64 to = (gather ? i : static_cast<u64>(r)) * words;
        for (u64 w = threadIdx.x; w < words; w += blockDim.x) {
            d[to + w] = s[from + w];
        }
    }
}

__device__ __forceinline__ void move_rows_of(
    const void* src, const u32* index, void* dst, bool gather, int word_bytes, u64 count,
    u64 words, u64 bound, u64* status) {
    if (word_bytes == 16) {
        move_rows<uint4>(src, index, dst, gather, count, words, bound, status);
    } else if (word_bytes == 4) {
        move_rows<u32>(src, index, dst, gather, count, words, bound, status);
    } else {
        move_rows<unsigned short>(src, index, dst, gather, count, words, bound, status);
    }
}

// dst[i] = src[index[i]] for `count` rows of `words` words; `src_rows` rows
// in src.
extern "C" __global__ void gather_rows(
    const void* src, const u32* index, void* dst, int word_bytes, u64 count, u64 words,
    u64 src_rows, u64* status) {
    grid_dependency_sync();
    move_rows_of(src, index, dst, true, word_bytes, count, words, src_rows, status);
}

// dst[index[i]] = src[i]; `index` must be distinct (a permutation).
extern "C" __global__ void scatter_rows(
    const void* src, const u32* index, void* dst, int word_bytes, u64 count, u64 words,
    u64 dst_rows, u64* status) {
    grid_dependency_sync();
    move_rows_of(src, index, dst, false, word_bytes, count, words, dst_rows, status);
}

// Slot `slot`'s row p and weight w (1 without weights); false, reported,
// when its position is past the rows.
__device__ __forceinline__ bool combine_slot(
    const float* weights, const u32* positions, u64 slot, u64 n_rows, u32& p, float& w,
    u64* status) {
    p = positions[slot];
    if (p >= n_rows) {
        report_fault(status, FAULT_POSITION, slot);
        return false;
    }
    w = weights != nullptr ? weights[slot] : 1.0f;
    return true;
}

// out[t] = sum_{j<k} w[t, j] rows[positions[t*k + j]] (w = 1 without
// weights), plus addend[t] where there is one, plus out[t] itself with
// `accumulate` (the MoE layer's combine into the residual stream): the sum
// in f32, in that order, rounded once. One block per token (striding over
// tokens), its threads over the columns. The `vec8` combine moves 8
// channels a thread (16-byte accesses; R, O and A read rows, out and
// addend as bf16 or f32, `Bf16Words8` and kin): the same sums in the same
// order as the element loop below, which spent its time on 2-byte loads
// and their index arithmetic.
template <typename R, typename O, typename A>
__device__ __forceinline__ void unpermute_x8(
    const void* rows, int rows_dtype, const float* weights, const u32* positions, const void* addend,
    int addend_dtype, void* out, int out_dtype, int accumulate, u64 tokens, u64 top_k, u64 n_rows, u64 words,
    u64* status) {
    for (u64 token = blockIdx.x; token < tokens; token += gridDim.x) {
        for (u64 c = threadIdx.x; c < words; c += blockDim.x) {
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (u64 j = 0; j < top_k; ++j) {
                u32 p;
                float w;
                if (!combine_slot(weights, positions, token * top_k + j, n_rows, p, w, status)) {
                    continue;
                }
                float f[8];
                R::load(rows, rows_dtype, static_cast<u64>(p) * words + c, f);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[e] += w * f[e];
                }
            }
            const u64 at = token * words + c;
            if (addend != nullptr) {
                float f[8];
                A::load(addend, addend_dtype, at, f);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[e] += f[e];
                }
            }
            if (accumulate) {
                float f[8];
                O::load(out, out_dtype, at, f);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    acc[e] += f[e];
                }
            }
            O::store(out, out_dtype, at, acc);
        }
    }
}

// `vec8`: rows, addend and out are bf16 or f32, 16-byte aligned, and width
// is a multiple of 8 (the launcher checks). `addend` may be null.
extern "C" __global__ void moe_unpermute(
    const void* rows, int rows_dtype, const float* weights, const u32* positions, const void* addend,
    int addend_dtype, void* out, int out_dtype, int accumulate, u64 tokens, u64 top_k, u64 n_rows, u64 width,
    int vec8, u64* status) {
    grid_dependency_sync();
    if (vec8) {
        // The layers' mixes with their dtypes fixed (`Bf16Words8`): the
        // combine into the residual stream, and the dispatch's backward
        // into an f32 sum.
        const bool rows_bf16 = rows_dtype == DTYPE_BF16;
        const bool addend_bf16 = addend == nullptr || addend_dtype == DTYPE_BF16;
        if (rows_bf16 && out_dtype == DTYPE_BF16 && addend_bf16) {
            unpermute_x8<Bf16Words8, Bf16Words8, Bf16Words8>(rows, rows_dtype, weights, positions, addend,
                                                             addend_dtype, out, out_dtype, accumulate, tokens,
                                                             top_k, n_rows, width / 8, status);
        } else if (rows_bf16 && out_dtype == DTYPE_F32 && addend == nullptr) {
            unpermute_x8<Bf16Words8, F32Words8, AnyWords8>(rows, rows_dtype, weights, positions, addend,
                                                           addend_dtype, out, out_dtype, accumulate, tokens,
                                                           top_k, n_rows, width / 8, status);
        } else {
            unpermute_x8<AnyWords8, AnyWords8, AnyWords8>(rows, rows_dtype, weights, positions, addend,
                                                          addend_dtype, out, out_dtype, accumulate, tokens,
                                                          top_k, n_rows, width / 8, status);
        }
        return;
    }
    for (u64 token = blockIdx.x; token < tokens; token += gridDim.x) {
        for (u64 c = threadIdx.x; c < width; c += blockDim.x) {
            float acc = 0.0f;
            for (u64 j = 0; j < top_k; ++j) {
                u32 p;
                float w;
                if (!combine_slot(weights, positions, token * top_k + j, n_rows, p, w, status)) {
                    continue;
                }
                acc += w * load(rows, rows_dtype, static_cast<u64>(p) * width + c);
            }
            const u64 at = token * width + c;
            if (addend != nullptr) {
                acc += load(addend, addend_dtype, at);
            }
            if (accumulate) {
                acc += load(out, out_dtype, at);
            }
            store(out, out_dtype, at, acc);
        }
    }
}

// d_rows[positions[t*k + j]] = w[t, j] * dout[t]. The launcher zeroes d_rows
// first unless the slots cover every row (rows no slot points at get no
// gradient); positions are distinct. One block per slot, threads over the
// columns; with `vec8` (every tensor bf16, 16-byte aligned, width a
// multiple of 8) 8 columns a thread, the same products.
extern "C" __global__ void moe_unpermute_backward_rows(
    const void* dout, int dout_dtype, const float* weights, const u32* positions, void* d_rows,
    int d_rows_dtype, u64 tokens, u64 top_k, u64 n_rows, u64 width, int vec8, u64* status) {
    grid_dependency_sync();
    for (u64 slot = blockIdx.x; slot < tokens * top_k; slot += gridDim.x) {
        const u32 p = positions[slot];
        if (p >= n_rows) {
            if (threadIdx.x == 0) {
                report_fault(status, FAULT_POSITION, slot);
            }
            continue;
        }
        const float w = weights[slot];
        const u64 token = slot / top_k;
        if (vec8) {
            const u64 words = width / 8;
            const uint4* g8 = static_cast<const uint4*>(dout) + token * words;
            uint4* out8 = static_cast<uint4*>(d_rows) + static_cast<u64>(p) * words;
            for (u64 c = threadIdx.x; c < words; c += blockDim.x) {
                float f[8];
                unpack8(g8[c], f);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    f[e] = w * f[e];
                }
                out8[c] = pack8(f);
            }
            continue;
        }
        for (u64 c = threadIdx.x; c < width; c += blockDim.x) {
            const float g = load(dout, dout_dtype, token * width + c);
            store(d_rows, d_rows_dtype, static_cast<u64>(p) * width + c, w * g);
        }
    }
}

// d_weights[t, j] = dout[t] . rows[positions[t*k + j]]: one warp per slot,
// lane-strided partial sums then the warp butterfly; with `vec8` (as the
// rows kernel's) a lane's partial sum runs over 8 columns a load.
extern "C" __global__ void moe_unpermute_backward_weights(
    const void* dout, int dout_dtype, const void* rows, int rows_dtype, const u32* positions,
    float* d_weights, u64 tokens, u64 top_k, u64 n_rows, u64 width, int vec8) {
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const u64 slot = static_cast<u64>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (slot >= tokens * top_k) {
        return;
    }
    const u32 p = positions[slot];
    if (p >= n_rows) {
        return;  // reported by the rows kernel
    }
    const u64 token = slot / top_k;
    float sum = 0.0f;
    if (vec8) {
        const u64 words = width / 8;
        const uint4* g8 = static_cast<const uint4*>(dout) + token * words;
        const uint4* r8 = static_cast<const uint4*>(rows) + static_cast<u64>(p) * words;
        for (u64 c = lane; c < words; c += 32) {
            float g[8], r[8];
            unpack8(g8[c], g);
            unpack8(r8[c], r);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                sum += g[e] * r[e];
            }
        }
    } else {
        for (u64 c = lane; c < width; c += 32) {
            sum += load(dout, dout_dtype, token * width + c) *
                   load(rows, rows_dtype, static_cast<u64>(p) * width + c);
        }
    }
    sum = warp_sum(sum);
    if (lane == 0) {
        d_weights[slot] = sum;
    }
}

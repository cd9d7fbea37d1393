// RMSNorm over groups of channels, forward and backward
// (`Backend::rmsnorm_forward`, `rmsnorm_backward_input`; the weight
// gradient's partial sums come out of the backward, and `column_sum` adds
// them into dw). Row `r`, group `g` covers channels [g*gs, (g+1)*gs) of the
// row; `rstd` is f32 `[rows, groups]`.
#include "common.cuh"

// One 8-channel word of the output, x rs w, from x's and w's words.
__device__ __forceinline__ uint4 normalized_word(uint4 x, uint4 w, float rs) {
    float f[8], g[8];
    unpack8(x, f);
    unpack8(w, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        f[e] = f[e] * rs * g[e];
    }
    return pack8(f);
}

// `vec8` kernels below: every tensor bf16, 16-byte aligned, and the group
// size a multiple of 8 (the launcher checks), so a thread moves 8 channels
// with one 16-byte load or store (`unpack8`, `pack8`); the element
// arithmetic is the same.
__device__ __forceinline__ void rmsnorm_forward_vec8(
    const uint4* x, const uint4* w, uint4* y, float* rstd, uint4* x_copy, u64 groups, u64 group_size,
    float eps, float* scratch) {
    const u64 block = blockIdx.x;
    const u64 words = group_size / 8;
    const uint4* xr = x + block * words;
    const uint4* wr = w + (block % groups) * words;
    uint4* yr = y + block * words;
    float sum = 0.0f;
    for (u64 c = threadIdx.x; c < words; c += blockDim.x) {
        const uint4 word = xr[c];
        if (x_copy != nullptr) {
            x_copy[block * words + c] = word;
        }
        float f[8];
        unpack8(word, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            sum += f[e] * f[e];
        }
    }
    sum = block_sum(sum, scratch);
    const float rs = 1.0f / sqrtf(sum / static_cast<float>(group_size) + eps);
    if (threadIdx.x == 0) {
        rstd[block] = rs;
    }
    for (u64 c = threadIdx.x; c < words; c += blockDim.x) {
        yr[c] = normalized_word(xr[c], wr[c], rs);
    }
}

// One block per (row, group): blockIdx.x = r * groups + g. Where `x_copy`
// is not null it gets x's values (x's dtype) in the same pass: how a layer
// keeps its input for the backward without a copy of its own.
extern "C" __global__ void rmsnorm_forward(
    const void* x, int x_dtype, const void* w, int w_dtype, void* y, int y_dtype, float* rstd,
    void* x_copy, u64 groups, u64 group_size, float eps, int vec8) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    if (vec8) {
        rmsnorm_forward_vec8(static_cast<const uint4*>(x), static_cast<const uint4*>(w),
                             static_cast<uint4*>(y), rstd, static_cast<uint4*>(x_copy), groups,
                             group_size, eps, scratch);
        return;
    }
    const u64 block = blockIdx.x;
    const u64 base = block * group_size;
    const u64 w_base = (block % groups) * group_size;
    float sum = 0.0f;
    for (u64 c = threadIdx.x; c < group_size; c += blockDim.x) {
        const float v = load(x, x_dtype, base + c);
        if (x_copy != nullptr) {
            // Exact: a bf16 or f32 value widened to f32 and stored back.
            store(x_copy, x_dtype, base + c, v);
        }
        sum += v * v;
    }
    sum = block_sum(sum, scratch);
    const float rs = 1.0f / sqrtf(sum / static_cast<float>(group_size) + eps);
    if (threadIdx.x == 0) {
        rstd[block] = rs;
    }
    for (u64 c = threadIdx.x; c < group_size; c += blockDim.x) {
        store(y, y_dtype, base + c, load(x, x_dtype, base + c) * rs * load(w, w_dtype, w_base + c));
    }
}

// `rmsnorm_forward`'s `vec8` path a warp a (row, group), for groups of at
// most RMSNORM_WARP_WORDS words: the same sums in the same order, so the
// same bits, without the block's barriers or its second read of x. The
// block kernel's thread t (of `threads`, a power of two from 32 to 256 at
// least the group's words) holds word t; here lane l holds the words
// l + 32 w of the block's warps w, all loaded before the first sum, sums
// each word's squares as thread t does, reduces each w with the block's
// warp tree, and then the warps' sums with its second tree. Launched 8
// warps a block; `threads` is the block kernel's.
#define RMSNORM_WARP_WORDS 256
extern "C" __global__ void __launch_bounds__(256) rmsnorm_forward_warps(
    const uint4* x, const uint4* w, uint4* y, float* rstd, uint4* x_copy, u64 items, u64 groups, u64 group_size,
    u32 threads, float eps) {
    grid_dependency_sync();
    const u64 item = static_cast<u64>(blockIdx.x) * 8 + (threadIdx.x >> 5);
    if (item >= items) {
        return;
    }
    const u32 lane = threadIdx.x & 31;
    const u64 words = group_size / 8;
    const u32 warps = threads / 32;
    const uint4* xr = x + item * words;
    const uint4* wr = w + (item % groups) * words;
    uint4 held[RMSNORM_WARP_WORDS / 32];
#pragma unroll
    for (u32 v = 0; v < RMSNORM_WARP_WORDS / 32; ++v) {
        const u64 c = lane + 32 * v;
        if (v < warps && c < words) {
            held[v] = xr[c];
        }
    }
    float total = 0.0f;
#pragma unroll
    for (u32 v = 0; v < RMSNORM_WARP_WORDS / 32; ++v) {
        if (v < warps) {
            float sum = 0.0f;
            if (lane + 32 * v < words) {
                float f[8];
                unpack8(held[v], f);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    sum += f[e] * f[e];
                }
            }
            sum = warp_sum(sum);
            // Every lane holds warp v's sum; lane v takes it, as lane v of
            // the block's second tree reads warp v's.
            if (lane == v) {
                total = sum;
            }
        }
    }
    total = warp_sum(total);
    const float rs = 1.0f / sqrtf(total / static_cast<float>(group_size) + eps);
    if (lane == 0) {
        rstd[item] = rs;
    }
#pragma unroll
    for (u32 v = 0; v < RMSNORM_WARP_WORDS / 32; ++v) {
        const u64 c = lane + 32 * v;
        if (v < warps && c < words) {
            if (x_copy != nullptr) {
                x_copy[item * words + c] = held[v];
            }
            y[item * words + c] = normalized_word(held[v], wr[c], rs);
        }
    }
}

// The backward's `vec8` path takes bf16 or f32 operands alike (the layers
// sum the norm's output gradient in f32): DY for dy, T for x, w and dx
// (`Bf16Words8`, `F32Words8`, or `AnyWords8` for other mixes).
template <typename DY, typename T>
__device__ __forceinline__ void rmsnorm_backward_input_vec8(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const void* w, int w_dtype,
    const float* rstd, void* dx, int dx_dtype, void* dx_before, u64 groups, u64 group_size,
    float* scratch) {
    const u64 block = blockIdx.x;
    const u64 words = group_size / 8;
    const u64 base = block * words;
    const u64 w_base = (block % groups) * words;
    float gx = 0.0f;
    for (u64 c = threadIdx.x; c < words; c += blockDim.x) {
        float fw[8], fd[8], fx[8];
        T::load(w, w_dtype, w_base + c, fw);
        DY::load(dy, dy_dtype, base + c, fd);
        T::load(x, x_dtype, base + c, fx);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            gx += fw[e] * fd[e] * fx[e];
        }
    }
    gx = block_sum(gx, scratch);
    const float rs = rstd[block];
    const float k = rs * rs * rs * gx / static_cast<float>(group_size);
    for (u64 c = threadIdx.x; c < words; c += blockDim.x) {
        float fw[8], fd[8], fx[8], out[8];
        T::load(w, w_dtype, w_base + c, fw);
        DY::load(dy, dy_dtype, base + c, fd);
        T::load(x, x_dtype, base + c, fx);
        T::load(dx, dx_dtype, base + c, out);
        if (dx_before != nullptr) {
            T::store(dx_before, dx_dtype, base + c, out);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float g = fw[e] * fd[e];
            out[e] = out[e] + (rs * g - fx[e] * k);
        }
        T::store(dx, dx_dtype, base + c, out);
    }
}

// dx += rstd * (w dy) - x * rstd^3 * mean(w dy x), per (row, group) block.
// Where `dx_before` is not null it gets dx's values from before (dx's
// dtype) in the same pass: how a layer keeps its output gradient for its
// weight gradients without a copy of its own.
extern "C" __global__ void rmsnorm_backward_input(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const void* w, int w_dtype,
    const float* rstd, void* dx, int dx_dtype, void* dx_before, u64 groups, u64 group_size,
    int vec8) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    if (vec8) {
        const bool bf16 = x_dtype == DTYPE_BF16 && w_dtype == DTYPE_BF16 && dx_dtype == DTYPE_BF16;
        if (bf16 && dy_dtype == DTYPE_BF16) {
            rmsnorm_backward_input_vec8<Bf16Words8, Bf16Words8>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, dx,
                                                                dx_dtype, dx_before, groups, group_size, scratch);
        } else if (bf16 && dy_dtype == DTYPE_F32) {
            rmsnorm_backward_input_vec8<F32Words8, Bf16Words8>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, dx,
                                                               dx_dtype, dx_before, groups, group_size, scratch);
        } else {
            rmsnorm_backward_input_vec8<AnyWords8, AnyWords8>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, dx,
                                                              dx_dtype, dx_before, groups, group_size, scratch);
        }
        return;
    }
    const u64 block = blockIdx.x;
    const u64 base = block * group_size;
    const u64 w_base = (block % groups) * group_size;
    float gx = 0.0f;
    for (u64 c = threadIdx.x; c < group_size; c += blockDim.x) {
        gx += load(w, w_dtype, w_base + c) * load(dy, dy_dtype, base + c) * load(x, x_dtype, base + c);
    }
    gx = block_sum(gx, scratch);
    const float rs = rstd[block];
    const float k = rs * rs * rs * gx / static_cast<float>(group_size);
    for (u64 c = threadIdx.x; c < group_size; c += blockDim.x) {
        const u64 i = base + c;
        const float g = load(w, w_dtype, w_base + c) * load(dy, dy_dtype, i);
        const float before = load(dx, dx_dtype, i);
        if (dx_before != nullptr) {
            store(dx_before, dx_dtype, i, before);
        }
        store(dx, dx_dtype, i, before + (rs * g - load(x, x_dtype, i) * k));
    }
}

// The weight gradient's partial sums where `rmsnorm_backward` cannot take
// the views: partials[y, j] = sum over slice y of the rows (blockIdx.y,
// `NormDims::weight_slice_rows` rows each) of dy[r, j] x[r, j]
// rstd[r, j / group_size]. A block of 32 columns by 32 row threads, the
// column-sum shape of `column_sum`.
extern "C" __global__ void rmsnorm_weight_partials(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const float* rstd, float* partials,
    u64 rows, u64 dim, u64 groups, u64 group_size) {
    grid_dependency_sync();
    __shared__ float partial[32][33];
    const u64 j = static_cast<u64>(blockIdx.x) * 32 + threadIdx.x;
    const u64 slice_rows = (rows + gridDim.y - 1) / gridDim.y;
    const u64 r0 = blockIdx.y * slice_rows;
    const u64 r1 = min(rows, r0 + slice_rows);
    float sum = 0.0f;
    if (j < dim) {
        const u64 g = j / group_size;
        for (u64 r = r0 + threadIdx.y; r < r1; r += 32) {
            const u64 i = r * dim + j;
            sum += load(dy, dy_dtype, i) * load(x, x_dtype, i) * rstd[r * groups + g];
        }
    }
    column_tree_sum(partial, sum);
    if (threadIdx.y == 0 && j < dim) {
        partials[blockIdx.y * dim + j] = partial[0][threadIdx.x];
    }
}

// `rmsnorm_weight_partials` 8 channels a thread (every view 16-byte
// aligned, dim and the group size multiples of 8; DY for dy, T for x): a
// block of 8 column threads (64 channels) by 32 row threads. Row thread y
// sums the rows of its slice that the scalar kernel's row thread y sums, in
// the same order and with the same expression, and the tree over the 32 is
// the same, so the partials are the same bits; what changes is that a warp
// reads 128 contiguous bytes of a row per load instead of 64, with 8
// channels in flight a thread.
#define PARTIALS_COLUMN_THREADS 8
template <typename DY, typename T>
__device__ __forceinline__ void rmsnorm_weight_partials_vec8(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const float* rstd, float* partials,
    u64 rows, u64 dim, u64 groups, u64 group_size, float (*partial)[PARTIALS_COLUMN_THREADS * 8 + 1]) {
    const u64 words = dim / 8;
    const u64 word = static_cast<u64>(blockIdx.x) * PARTIALS_COLUMN_THREADS + threadIdx.x;
    const u64 slice_rows = (rows + gridDim.y - 1) / gridDim.y;
    const u64 r0 = blockIdx.y * slice_rows;
    const u64 r1 = min(rows, r0 + slice_rows);
    float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (word < words) {
        const u64 g = word * 8 / group_size;
#pragma unroll 4
        for (u64 r = r0 + threadIdx.y; r < r1; r += 32) {
            float fd[8], fx[8];
            DY::load(dy, dy_dtype, r * words + word, fd);
            T::load(x, x_dtype, r * words + word, fx);
            const float rs = rstd[r * groups + g];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                sum[e] += fd[e] * fx[e] * rs;
            }
        }
    }
    const u32 c = threadIdx.x * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        partial[threadIdx.y][c + e] = sum[e];
    }
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (threadIdx.y < s) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                partial[threadIdx.y][c + e] += partial[threadIdx.y + s][c + e];
            }
        }
        __syncthreads();
    }
    if (threadIdx.y == 0 && word < words) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            partials[blockIdx.y * dim + word * 8 + e] = partial[0][c + e];
        }
    }
}

extern "C" __global__ void __launch_bounds__(PARTIALS_COLUMN_THREADS * 32) rmsnorm_weight_partials_vec8(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const float* rstd, float* partials,
    u64 rows, u64 dim, u64 groups, u64 group_size) {
    grid_dependency_sync();
    __shared__ float partial[32][PARTIALS_COLUMN_THREADS * 8 + 1];
    if (x_dtype == DTYPE_BF16 && dy_dtype == DTYPE_BF16) {
        rmsnorm_weight_partials_vec8<Bf16Words8, Bf16Words8>(dy, dy_dtype, x, x_dtype, rstd, partials, rows,
                                                              dim, groups, group_size, partial);
    } else if (x_dtype == DTYPE_BF16 && dy_dtype == DTYPE_F32) {
        rmsnorm_weight_partials_vec8<F32Words8, Bf16Words8>(dy, dy_dtype, x, x_dtype, rstd, partials, rows,
                                                             dim, groups, group_size, partial);
    } else {
        rmsnorm_weight_partials_vec8<AnyWords8, AnyWords8>(dy, dy_dtype, x, x_dtype, rstd, partials, rows,
                                                            dim, groups, group_size, partial);
    }
}

// The input gradient and the weight gradient's partial sums in one pass
// over dy and x (the two-kernel way read both twice): a block per slice of
// `slice_rows` rows, a thread per 8-channel word of a row (dim / 8 words,
// at most 512, the block rounded up to whole warps: at 1,024 the compiler
// had 64 registers a thread and spilled the fetched row). Where a group is
// whole warps and a row holds several (Mamba's gated norm), a block takes
// one group (blockIdx.y) of the slice's rows instead: blocks of a row's
// width were too few to keep the SMs reading. A thread keeps its
// words' weights and partial sums in registers and walks the slice's rows,
// fetching row r + 1 while it reduces row r. A group's sum: a shuffle tree
// inside a warp where a group is a power of two words up to 32, else each
// warp's sum, then the group's warp sums as a shuffle tree again, the
// shape of `block_sum` over a block of one group, so dx has the bits of
// `rmsnorm_backward_input`'s block per (row, group) for groups of up to
// 2,048 channels. `scratch` alternates by row: a warp writing row r + 1's
// sums cannot overwrite row r's before every warp read them, since every
// warp passes row r + 1's barrier only after its reads of row r.
template <typename DY, typename T>
__device__ __forceinline__ void rmsnorm_backward_rows(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const void* w, int w_dtype,
    const float* rstd, void* dx, int dx_dtype, void* dx_before, float* partials, u64 rows, u64 dim,
    u64 groups, u64 group_size, u64 slice_rows, float (*scratch)[32]) {
    const u64 words = dim / 8;
    const u32 c = blockIdx.y * blockDim.x + threadIdx.x;
    const bool live = c < words;
    const u32 group_words = static_cast<u32>(group_size / 8);
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u64 g = live ? c / group_words : 0;
    const u64 r0 = min(rows, static_cast<u64>(blockIdx.x) * slice_rows);
    const u64 r1 = min(rows, r0 + slice_rows);
    float fw[8], acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        fw[e] = 0.0f;
        acc[e] = 0.0f;
    }
    if (live) {
        T::load(w, w_dtype, c, fw);
    }
    // Row r + 1's operands, fetched ahead.
    float nd[8], nx[8], no[8];
    float nrs = 0.0f;
    auto fetch = [&](u64 r) {
        if (live && r < r1) {
            DY::load(dy, dy_dtype, r * words + c, nd);
            T::load(x, x_dtype, r * words + c, nx);
            T::load(dx, dx_dtype, r * words + c, no);
            nrs = rstd[r * groups + g];
        }
    };
    fetch(r0);
    for (u64 r = r0; r < r1; ++r) {
        float fd[8], fx[8], out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            fd[e] = nd[e];
            fx[e] = nx[e];
            out[e] = no[e];
        }
        const float rs = nrs;
        fetch(r + 1);
        float gx = 0.0f;
        if (live) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                gx += fw[e] * fd[e] * fx[e];
            }
        }
        if (group_words <= 32) {
            for (u32 m = group_words / 2; m > 0; m >>= 1) {
                gx += __shfl_xor_sync(0xffffffffu, gx, m);
            }
        } else {
            float* sums = scratch[r & 1];
            gx = warp_sum(gx);
            if (lane == 0) {
                sums[warp] = gx;
            }
            __syncthreads();
            // The block's groups, from its first (a block is whole groups).
            const u32 per_group = group_words / 32;
            const u64 local = g - blockIdx.y * (blockDim.x / group_words);
            gx = lane < per_group ? sums[local * per_group + lane] : 0.0f;
            gx = warp_sum(gx);
        }
        if (live) {
            const u64 at = r * words + c;
            if (dx_before != nullptr) {
                T::store(dx_before, dx_dtype, at, out);
            }
            const float k = rs * rs * rs * gx / static_cast<float>(group_size);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float gw = fw[e] * fd[e];
                out[e] = out[e] + (rs * gw - fx[e] * k);
                acc[e] += fd[e] * fx[e] * rs;
            }
            T::store(dx, dx_dtype, at, out);
        }
    }
    if (live) {
        float4* slice = reinterpret_cast<float4*>(partials + blockIdx.x * dim + c * 8);
        slice[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        slice[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
}

// Launched by `KernelSet::rmsnorm_backward_input` where the views take the
// `vec8` path, a block's words (a row's, or a group's) are at most 512,
// and a group's words are a power of two up to 32 or a multiple of 32;
// `partials` 16-byte aligned.
extern "C" __global__ void __launch_bounds__(512) rmsnorm_backward(
    const void* dy, int dy_dtype, const void* x, int x_dtype, const void* w, int w_dtype,
    const float* rstd, void* dx, int dx_dtype, void* dx_before, float* partials, u64 rows, u64 dim,
    u64 groups, u64 group_size, u64 slice_rows) {
    grid_dependency_sync();
    __shared__ float scratch[2][32];
    const bool bf16 = x_dtype == DTYPE_BF16 && w_dtype == DTYPE_BF16 && dx_dtype == DTYPE_BF16;
    if (bf16 && dy_dtype == DTYPE_BF16) {
        rmsnorm_backward_rows<Bf16Words8, Bf16Words8>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, dx, dx_dtype,
                                                      dx_before, partials, rows, dim, groups, group_size,
                                                      slice_rows, scratch);
    } else if (bf16 && dy_dtype == DTYPE_F32) {
        rmsnorm_backward_rows<F32Words8, Bf16Words8>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, dx, dx_dtype,
                                                     dx_before, partials, rows, dim, groups, group_size,
                                                     slice_rows, scratch);
    } else {
        rmsnorm_backward_rows<AnyWords8, AnyWords8>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, dx, dx_dtype,
                                                    dx_before, partials, rows, dim, groups, group_size,
                                                    slice_rows, scratch);
    }
}

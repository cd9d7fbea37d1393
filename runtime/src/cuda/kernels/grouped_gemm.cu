// Many independent bf16 GEMMs in one launch on Hopper's warpgroup MMAs:
// `Backend::grouped_matmul` on sm_90a (the MoE experts' GEMMs, one problem
// an expert). Problem p is, row-major, C_p [m, n] (+)= op(A_p) op(B_p) with
// op(A) [m, k] (A stored [m, k], or [k, m] for the `t?` kernels) and op(B)
// [k, n] (B stored [n, k] for the `?t` kernels, else [k, n]); C is bf16 or
// f32, overwritten or added to, a problem at a time.
//
// Why not cuBLAS: an expert's GEMM is small (about 1,000 rows under a
// balanced routing of the benchmark model), so one cuBLAS call fills a
// fraction of the SMs (32 tiles of 256 x 128 for an expert's forward on 132
// SMs) and its K-loop is too short to hide the loads; spread over three
// streams they still left the GPU half idle. Here every problem's tiles
// share one grid, so the SMs stay full until the last tiles.
//
// A block computes one 128 x 128 tile of C: two warpgroups, 64 rows each,
// `wgmma` m64n128k16 from shared memory. K is walked in steps of 64; a step
// stages a 128 x 64 tile of each operand through `cp.async` in the 128-byte
// swizzled layout (wgmma.cuh), GG_STAGES steps deep: the products of step
// s run while steps s + 1 to s + 4 load. A K-major operand (K along its
// stored rows) stages 128 rows of 128 bytes; an MN-major one 64 stored rows
// of 256 bytes, as two atoms of 64 elements. One staged layout serves both
// readings through the descriptor alone, so no operand is transposed.
// Elements past m, n or k are staged as zeros and never stored.
//
// Determinism: an element of C is one thread's sum of its K-steps in order,
// then (when adding) C's old value: its bits depend on its problem alone,
// never on the other problems in the launch or on the grid. No atomics.
//
// The launcher gives only problems this kernel takes: bf16 A and B, every
// operand 16-byte aligned, the contiguous dimension of each operand a
// multiple of 8 (k for K-major, m or n for MN-major, n for C), and k > 0.
#include "common.cuh"
#include "wgmma.cuh"

#define GG_THREADS 256
#define GG_TILE_M 128
#define GG_TILE_N 128
#define GG_TILE_K 64
#define GG_STAGES 6
// Problems a launch takes (the table travels in the kernel's parameters,
// which hold 4 KiB); the launcher splits longer groups.
#define GG_MAX_PROBLEMS 48
// A problem's flags.
#define GG_ACCUMULATE 1u
#define GG_C_F32 2u

struct GroupedProblem {
    u64 a, b, c;
    u32 m, n, k, flags;
};

// The problems of one launch and where each one's tiles start in the grid
// (block `first_tile[p] + i` computes tile i of problem p; tiles run along
// n first). `first_tile[count]` is the grid's size.
struct GroupedProblems {
    GroupedProblem problem[GG_MAX_PROBLEMS];
    u32 first_tile[GG_MAX_PROBLEMS + 1];
    u32 count;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Bytes of one operand's staged K-step, and of one pipeline stage (A then B).
#define GG_OPERAND_BYTES (GG_TILE_M * GG_TILE_K * 2)
#define GG_STAGE_BYTES (2 * GG_OPERAND_BYTES)
// An MN-major staged operand: its two 64-element atoms of 64 stored rows.
#define GG_ATOM_BYTES (GG_TILE_K * 128)

// Stages a K-major operand's K-step: stored rows `row0` .. + 127 of its
// `rows` (each `k` elements, contiguous), elements k0 .. k0 + 63 of each,
// at `tile`: row r is 128 bytes at r * 128, its chunk c at c ^ (r % 8).
__device__ __forceinline__ void stage_k_major(u32 tile, const bf16* src, u32 row0, u32 rows, u32 k0, u32 k) {
#pragma unroll
    for (u32 j = 0; j < GG_TILE_M * 8 / GG_THREADS; ++j) {
        const u32 i = threadIdx.x + j * GG_THREADS;
        const u32 r = i / 8, c = i % 8;
        const bool ok = row0 + r < rows && k0 + c * 8 < k;
        const bf16* from = ok ? src + static_cast<u64>(row0 + r) * k + k0 + c * 8 : src;
        copy16_async(tile + r * 128 + ((c ^ (r % 8)) << 4), from, ok);
    }
}

// Stages an MN-major operand's K-step: stored rows k0 .. k0 + 63 of its
// `k` (each `mn` elements, contiguous), elements mn0 .. mn0 + 127 of each,
// at `tile`: elements 64 j .. 64 j + 63 are atom j, in which stored row r
// is 128 bytes at r * 128, its chunk c at c ^ (r % 8).
__device__ __forceinline__ void stage_mn_major(u32 tile, const bf16* src, u32 mn0, u32 mn, u32 k0, u32 k) {
#pragma unroll
    for (u32 j = 0; j < GG_TILE_K * 16 / GG_THREADS; ++j) {
        const u32 i = threadIdx.x + j * GG_THREADS;
        const u32 r = i / 16, c = i % 16;
        const bool ok = k0 + r < k && mn0 + c * 8 < mn;
        const bf16* from = ok ? src + static_cast<u64>(k0 + r) * mn + mn0 + c * 8 : src;
        copy16_async(tile + (c / 8) * GG_ATOM_BYTES + r * 128 + (((c % 8) ^ (r % 8)) << 4), from, ok);
    }
}

// The descriptor of K-step `kk` (16 elements of K) of a staged operand,
// from its element `mn0` along M or N (a multiple of 64 for MN-major, of 8
// for K-major). K-major: 32 bytes a K-step, the next 8 rows 1024 bytes on.
// MN-major: 16 stored rows a K-step, the next 8 rows 1024 bytes on, the
// next 64 elements an atom on.
template <int TRANS>
__device__ __forceinline__ u64 operand_desc(u32 tile, u32 mn0, u32 kk) {
    if (TRANS) {
        return swizzled_desc(tile + (mn0 / 64) * GG_ATOM_BYTES + kk * 2048, GG_ATOM_BYTES, 1024);
    }
    return swizzled_desc(tile + mn0 * 128 + kk * 32, 16, 1024);
}

// Adds (or writes) this thread's share of a warpgroup's 64 x 128
// accumulator to C [m, n] from row `r0`, column `c0`: rows `row` and
// `row + 8`, two adjacent columns per 8.
template <typename T>
__device__ __forceinline__ void store_tile(T* c, const GroupedProblem& p, const float (&acc)[64], u32 r0, u32 c0,
                                           u32 row) {
    const bool add = p.flags & GG_ACCUMULATE;
    const u32 t = threadIdx.x & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 r = r0 + row + half * 8;
        if (r >= p.m) {
            continue;
        }
#pragma unroll
        for (int j = 0; j < GG_TILE_N / 8; ++j) {
            const u32 col = c0 + j * 8 + 2 * t;
            if (col >= p.n) {
                continue;
            }
            T* at = c + static_cast<u64>(r) * p.n + col;
            float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
            if (add) {
                const float2 old = load_pair(at);
                v0 += old.x;
                v1 += old.y;
            }
            store_pair(at, v0, v1);
        }
    }
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void grouped_gemm(const GroupedProblems& problems) {
    extern __shared__ unsigned char shared[];
    const u32 tiles = shared_address(aligned_shared(shared));
    const u32 block = blockIdx.x;
    u32 p = 0;
    while (p + 1 < problems.count && problems.first_tile[p + 1] <= block) {
        ++p;
    }
    const GroupedProblem problem = problems.problem[p];
    const u32 n_tiles = (problem.n + GG_TILE_N - 1) / GG_TILE_N;
    const u32 local = block - problems.first_tile[p];
    const u32 m0 = (local / n_tiles) * GG_TILE_M;
    const u32 n0 = (local % n_tiles) * GG_TILE_N;
    const u32 steps = (problem.k + GG_TILE_K - 1) / GG_TILE_K;
    const bf16* a = reinterpret_cast<const bf16*>(problem.a);
    const bf16* b = reinterpret_cast<const bf16*>(problem.b);

    // Stages K-step `s` into its buffer: A (M along the tile's rows or
    // atoms), then B.
    auto stage = [&](u32 s) {
        const u32 at = tiles + (s % GG_STAGES) * GG_STAGE_BYTES;
        const u32 k0 = s * GG_TILE_K;
        if (TRANS_A) {
            stage_mn_major(at, a, m0, problem.m, k0, problem.k);
        } else {
            stage_k_major(at, a, m0, problem.m, k0, problem.k);
        }
        if (TRANS_B) {
            stage_mn_major(at + GG_OPERAND_BYTES, b, n0, problem.n, k0, problem.k);
        } else {
            stage_k_major(at + GG_OPERAND_BYTES, b, n0, problem.n, k0, problem.k);
        }
    };

    // Steps are fetched GG_STAGES - 2 ahead: step s + GG_STAGES - 2 goes
    // into the buffer of step s - 2, whose products every warpgroup has
    // waited for before the barrier of step s (see below).
#pragma unroll
    for (u32 s = 0; s < GG_STAGES - 2; ++s) {
        if (s < steps) {
            stage(s);
        }
        commit_async();
    }
    const GroupLane at = group_lane();
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        acc[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; ++s) {
        // All but this thread's newest GG_STAGES - 3 fetch groups have
        // landed, step s's among them; the barrier makes every thread's
        // copies of it visible to `wgmma`.
        wait_async<GG_STAGES - 3>();
        fence_async_shared();
        __syncthreads();
        const u32 at_a = tiles + (s % GG_STAGES) * GG_STAGE_BYTES;
        const u32 at_b = at_a + GG_OPERAND_BYTES;
        wgmma_fence();
#pragma unroll
        for (u32 kk = 0; kk < GG_TILE_K / 16; ++kk) {
            wgmma_ss<TRANS_A, TRANS_B>(acc, operand_desc<TRANS_A>(at_a, at.group * 64, kk),
                                       operand_desc<TRANS_B>(at_b, 0, kk), 1);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        // Step s - 1's products are done; the next barrier tells every
        // warpgroup so (the fetch below reuses step s - 2's buffer).
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (s + GG_STAGES - 2 < steps) {
            stage(s + GG_STAGES - 2);
        }
        commit_async();
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wait_async<0>();

    const u32 r0 = m0 + at.group * 64;
    if (problem.flags & GG_C_F32) {
        store_tile(reinterpret_cast<float*>(problem.c), problem, acc, r0, n0, at.row);
    } else {
        store_tile(reinterpret_cast<bf16*>(problem.c), problem, acc, r0, n0, at.row);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The four layouts, named as `MatmulDims::a_trans` and `b_trans`: `t`
// where the stored operand is transposed (A stored [k, m]; B stored
// [n, k]). A transposed A is MN-major; B is MN-major unless transposed.
// Empty bodies off sm_90a, where the launcher never names them.
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) grouped_gemm_wgmma_nn(const GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<0, 1>(problems);
#endif
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) grouped_gemm_wgmma_nt(const GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<0, 0>(problems);
#endif
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) grouped_gemm_wgmma_tn(const GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<1, 1>(problems);
#endif
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) grouped_gemm_wgmma_tt(const GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<1, 0>(problems);
#endif
}

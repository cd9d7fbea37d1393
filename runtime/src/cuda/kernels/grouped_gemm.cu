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
// A block computes one 128 x 128 tile of C: two consumer warpgroups, 64
// rows each, `wgmma` m64n128k16 from shared memory, and a producer warp
// whose one thread loads the operands with TMA. K is walked in steps of
// 64; a step is a 128 x 64 tile of each operand in the 128-byte swizzled
// layout (wgmma.cuh), in a ring of GG_STAGES buffers: the producer fills a
// buffer once both warpgroups have released it (an `empty` barrier) and
// the consumers multiply it once its bytes have landed (a `full` barrier).
// Two blocks share an SM, so one's loads, fill and C update run while the
// other multiplies. A K-major operand (K along its stored rows) is one box
// of 128 rows of 128 bytes; an MN-major one two boxes (atoms) of 64 stored
// rows of 128 bytes. One staged layout serves both readings through the
// descriptor alone, so no operand is transposed. Each operand has its own
// tensor map with the problem's sizes, so elements past m, n or k load as
// zeros (an expert's rows end where its map ends, not where the next
// expert's begin) and are never stored.
//
// Determinism: an element of C is one thread's sum of its K-steps in order,
// then (when adding) C's old value, added once (in L2, by the tile's
// reduce-add, for an f32 C): its bits depend on its problem alone,
// never on the other problems in the launch or on the grid. No atomics.
//
// The launcher gives only problems this kernel takes: bf16 A and B, every
// operand 16-byte aligned, the contiguous dimension of each operand a
// multiple of 8 (k for K-major, m or n for MN-major, n for C), and k > 0.
#include "common.cuh"
#include "wgmma.cuh"

#define GG_THREADS 288
#define GG_CONSUMERS 256
#define GG_TILE_M 128
#define GG_TILE_N 128
#define GG_TILE_K 64
#define GG_STAGES 3
// Problems a launch takes (the table and three tensor maps a problem, A,
// B and C, travel in the kernel's parameters, which hold 32 KiB on CUDA
// 12.1 and later); the launcher splits longer groups.
#define GG_MAX_PROBLEMS 32
// A problem's flags.
#define GG_ACCUMULATE 1u
#define GG_C_F32 2u
// f32 C added to by TMA reduce-adds from shared memory (C's map is set).
#define GG_REDUCE 4u

struct GroupedProblem {
    u64 c;
    u32 m, n, k, flags;
};

// The problems of one launch, their operands' tensor maps (A's of problem
// p at 3 p, B's at 3 p + 1, C's at 3 p + 2 where GG_REDUCE) and where each one's tiles start in the grid
// (block `first_tile[p] + i` computes tile i of problem p; tiles run along
// n first). `first_tile[count]` is the grid's size.
struct GroupedProblems {
    TensorMap map[3 * GG_MAX_PROBLEMS];
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

// Loads K-step `k0` of an operand into `tile`, completing on `bar`: a
// K-major operand's rows `mn0` .. + 127 (one box), or an MN-major one's
// elements `mn0` .. + 127 of its stored rows k0 .. k0 + 63 (two atoms).
template <int TRANS>
__device__ __forceinline__ void load_operand(u32 tile, const TensorMap* map, u32 mn0, u32 k0, u32 bar) {
    if (TRANS) {
        tma_load_2d(tile, map, mn0, k0, bar);
        tma_load_2d(tile + GG_ATOM_BYTES, map, mn0 + 64, k0, bar);
    } else {
        tma_load_2d(tile, map, k0, mn0, bar);
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
    // The ring's barriers follow its buffers: `full` then `empty`, one
    // 8-byte barrier a stage each.
    const u32 full = tiles + GG_STAGES * GG_STAGE_BYTES;
    const u32 empty = full + GG_STAGES * 8;
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

    if (threadIdx.x == 0) {
#pragma unroll
        for (u32 i = 0; i < GG_STAGES; ++i) {
            mbarrier_init(full + 8 * i, 1);
            // One arrival from each consumer warpgroup.
            mbarrier_init(empty + 8 * i, 2);
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    if (threadIdx.x >= GG_CONSUMERS) {
        // The producer: the `u`-th use of a buffer waits for the consumers'
        // release of its use u - 1 (parity (u - 1) & 1; the first passes).
        if (threadIdx.x == GG_CONSUMERS) {
            const TensorMap* map_a = &problems.map[3 * p];
            const TensorMap* map_b = &problems.map[3 * p + 1];
            for (u32 s = 0; s < steps; ++s) {
                const u32 slot = s % GG_STAGES, use = s / GG_STAGES;
                mbarrier_wait(empty + 8 * slot, (use & 1) ^ 1);
                const u32 bar = full + 8 * slot;
                mbarrier_expect(bar, GG_STAGE_BYTES);
                const u32 at = tiles + slot * GG_STAGE_BYTES;
                load_operand<TRANS_A>(at, map_a, m0, s * GG_TILE_K, bar);
                load_operand<TRANS_B>(at + GG_OPERAND_BYTES, map_b, n0, s * GG_TILE_K, bar);
            }
        }
        return;
    }

    const GroupLane at = group_lane();
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        acc[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; ++s) {
        const u32 slot = s % GG_STAGES;
        mbarrier_wait(full + 8 * slot, (s / GG_STAGES) & 1);
        const u32 at_a = tiles + slot * GG_STAGE_BYTES;
        const u32 at_b = at_a + GG_OPERAND_BYTES;
        wgmma_fence();
#pragma unroll
        for (u32 kk = 0; kk < GG_TILE_K / 16; ++kk) {
            wgmma_ss<TRANS_A, TRANS_B>(acc, operand_desc<TRANS_A>(at_a, at.group * 64, kk),
                                       operand_desc<TRANS_B>(at_b, 0, kk), 1);
        }
        wgmma_commit();
        // Step s - 1's products are done in this warpgroup: its buffer
        // goes back to the producer.
        wgmma_wait<1>();
        if (s > 0 && (threadIdx.x & 127) == 0) {
            mbarrier_arrive(empty + 8 * ((s - 1) % GG_STAGES));
        }
    }
    wgmma_wait<0>();

    const u32 r0 = m0 + at.group * 64;
    if (problem.flags & GG_REDUCE) {
        // f32 C += the tile through L2's adders: the SMs never read C.
        // Both warpgroups' products are done before either overwrites the
        // ring with its 64 x 128 f32 rows (32 KiB): four boxes of 32
        // columns, 128-byte swizzled as C's map reads them.
        named_barrier<1, GG_CONSUMERS>();
        const u32 staged = tiles + at.group * (64 * GG_TILE_N * 4);
        const u32 t = threadIdx.x & 3;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 r = at.row + half * 8;
#pragma unroll
            for (int j = 0; j < GG_TILE_N / 8; ++j) {
                const u32 chunk = (j % 4) * 2 + (t >> 1);
                const u32 to = staged + (j / 4) * 8192 + r * 128 + ((chunk ^ (r % 8)) << 4) + (t & 1) * 8;
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(to), "f"(acc[4 * j + 2 * half]),
                             "f"(acc[4 * j + 2 * half + 1])
                             : "memory");
            }
        }
        fence_async_shared();
        if (at.group == 0) {
            named_barrier<2, 128>();
        } else {
            named_barrier<3, 128>();
        }
        if ((threadIdx.x & 127) == 0) {
#pragma unroll
            for (u32 box = 0; box < GG_TILE_N / 32; ++box) {
                tma_reduce_add_2d(&problems.map[3 * p + 2], n0 + box * 32, r0, staged + box * 8192);
            }
            bulk_commit();
            bulk_wait_read();
        }
        return;
    }
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
extern "C" __global__ void __launch_bounds__(GG_THREADS, 2) grouped_gemm_wgmma_nn(const __grid_constant__ GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<0, 1>(problems);
#endif
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 2) grouped_gemm_wgmma_nt(const __grid_constant__ GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<0, 0>(problems);
#endif
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 2) grouped_gemm_wgmma_tn(const __grid_constant__ GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<1, 1>(problems);
#endif
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 2) grouped_gemm_wgmma_tt(const __grid_constant__ GroupedProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grouped_gemm<1, 0>(problems);
#endif
}

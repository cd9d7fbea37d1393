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
// The grid is persistent: one block an SM, each walking the launch's units
// of work from its own index in strides of the grid. A unit is a 128 x 256
// tile of C (every problem's, in order), except at the end: the tiles
// that would leave most SMs idle in the last round (`split_from` on) are
// split into two 128 x 128 halves, so that round takes half as long. An
// element's sum is the same whatever its tile's width. A unit is computed
// by two consumer warpgroups, 64 rows each, with `wgmma` m64n256k16 (or
// m64n128k16 for a half) from shared memory, and a producer warp whose one
// thread loads the operands with TMA. K is walked in steps of 64; a step
// is a 128 x 64 tile of A and a 256 x 64 tile of B in the 128-byte
// swizzled layout (wgmma.cuh), in a ring of GG_STAGES buffers: the
// producer fills a buffer once both warpgroups have released it (an
// `empty` barrier) and the consumers multiply it once its bytes have
// landed (a `full` barrier). The ring runs across units, so while the
// consumers store one the producer already loads the next one's first
// K-steps. A K-major operand (K along its stored rows) is one box of 128
// (A) or 256 (B) rows of 128 bytes; an MN-major one two or four boxes
// (atoms) of 64 stored rows of 128 bytes. One staged layout serves both
// readings through the descriptor alone, so no operand is transposed.
// Each operand has its own tensor map with the problem's sizes, so
// elements past m, n or k load as zeros (an expert's rows end where its
// map ends, not where the next expert's begin) and are never stored.
// C goes out the same way: a warpgroup stages its rows 128 bytes of
// columns at a time in shared memory, and TMA stores them (or, for an f32
// C added to, adds them in L2), so the consumers neither wait for global
// stores nor read C.
//
// Determinism: an element of C is one thread's sum of its K-steps in order,
// then (when adding) C's old value, added once (in L2, by the tile's
// reduce-add, for an f32 C): its bits depend on its problem alone,
// never on the other problems in the launch or on the grid. No atomics.
//
// Segmented launches (`grouped_gemm_rows_*`, `grouped_gemm_depth_tn`,
// `Backend::segmented_matmul`: the MoE experts under expert parallelism 1)
// take each expert's rows from a u32 count a segment in device memory, so
// no host waits for them. A problem is then one segment of a shared
// operand: A's and C's maps (rows) or A's and B's (depth) span every
// segment's rows, and each block finds its segment's first row and end by
// a warp's prefix sum of the counts. Rows (variable M): the launch is
// sized for the worst split (each segment's partial last tile), the tiles
// past the real ones do nothing, and a tile's A rows past its segment's
// end (the next segment's) feed only accumulator rows that are never
// stored: a warpgroup whose 64 rows all lie in its segment stores through
// the map, one that straddles the end stores its rows by its own
// predicated stores. Depth (variable K, a weight gradient): the tiles are
// the host's (C is one matrix a segment), the K-steps walk the segment's
// rows, and the last step's rows past the end are zeroed in shared memory
// before the products read them (they would otherwise add the next
// segment's rows), which is what the per-problem maps' bounds give: the
// same bits as a grouped launch of the same segments. A segment without
// rows leaves its C alone.
//
// The launcher gives only problems this kernel takes: bf16 A and B, every
// operand 16-byte aligned, the contiguous dimension of each operand a
// multiple of 8 (k for K-major, m or n for MN-major, n for C), and k > 0.
#include "common.cuh"
#include "wgmma.cuh"

#define GG_THREADS 288
#define GG_CONSUMERS 256
#define GG_TILE_M 128
#define GG_TILE_N 256
#define GG_TILE_K 64
#define GG_STAGES 4
// Problems a launch takes (the table and three tensor maps a problem, A,
// B and C, travel in the kernel's parameters, which hold 32 KiB on CUDA
// 12.1 and later); the launcher splits longer groups.
#define GG_MAX_PROBLEMS 32
// A problem's flags.
#define GG_ACCUMULATE 1u
#define GG_C_F32 2u
// C is written (or, f32 and accumulating, added to) through its tensor
// map; else (a bf16 C added to) by the consumers' own loads and stores.
#define GG_C_MAP 4u
// How a launch finds its problems' rows: from the table, or a segment's
// rows on the device as the M (`GG_ROWS`) or the K (`GG_DEPTH`).
#define GG_TABLE 0
#define GG_ROWS 1
#define GG_DEPTH 2

struct GroupedProblem {
    u64 c;
    u32 m, n, k, flags;
};

// The problems of one launch, their operands' tensor maps (A's of problem
// p at 3 p, B's at 3 p + 1, C's at 3 p + 2 where GG_C_MAP) and where each
// one's tiles start in the launch's sequence of tiles (tile
// `first_tile[p] + i` is tile i of problem p; tiles run along n first).
// `first_tile[count]` is the number of tiles; those from `split_from` on
// are computed as two halves each.
//
// A segmented launch adds each problem's segment, the device's u32 rows a
// segment (`rows`, `segments` of them) and the persistent grid, which the
// split rule of a rows launch needs in the kernel. Its problems' m (rows)
// or k (depth) is the shared operands' rows, where segments are clipped.
struct GroupedProblems {
    TensorMap map[3 * GG_MAX_PROBLEMS];
    GroupedProblem problem[GG_MAX_PROBLEMS];
    u32 first_tile[GG_MAX_PROBLEMS + 1];
    u32 count;
    u32 split_from;
    u32 segment[GG_MAX_PROBLEMS];
    u64 rows;
    u32 segments;
    u32 blocks;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Bytes of one operand's staged K-step, and of one pipeline stage (A then B).
#define GG_A_BYTES (GG_TILE_M * GG_TILE_K * 2)
#define GG_B_BYTES (GG_TILE_N * GG_TILE_K * 2)
#define GG_STAGE_BYTES (GG_A_BYTES + GG_B_BYTES)
// An MN-major staged operand: its 64-element atoms of 64 stored rows.
#define GG_ATOM_BYTES (GG_TILE_K * 128)
// A box of C that TMA stores or adds: a warpgroup's 64 rows by 128 bytes
// of columns, staged in one of two buffers a warpgroup after the ring.
#define GG_BOX_BYTES (64 * 128)

// Where a launch's tiles and rows are: the table's, or (segmented) each
// problem's segment found on the device. `start` and `end` bound the
// segment's rows (M or K), clipped at the problem's shared rows.
struct Layout {
    u32 first_tile[GG_MAX_PROBLEMS + 1];
    u32 split_from;
    u32 start[GG_MAX_PROBLEMS];
    u32 end[GG_MAX_PROBLEMS];
};

// The first of `tiles` computed as halves on `blocks` blocks: as the
// launcher's `split_from`.
__device__ __forceinline__ u32 split_from(u32 tiles, u32 blocks) {
    const u32 last_round = tiles % blocks;
    return last_round > 0 && 2 * last_round <= blocks ? tiles - last_round : tiles;
}

// Fills the block's layout (before the block's first barrier). A
// segmented launch: warp 0 sums the segments' rows 32 at a time (an
// exclusive prefix a lane) and each problem takes its segment's; a rows
// launch then counts each problem's tiles from them.
template <int MODE>
__device__ __forceinline__ void load_layout(const GroupedProblems& problems, Layout& layout) {
    if (MODE == GG_TABLE) {
        return;
    }
    if (threadIdx.x < 32) {
        const u32 lane = threadIdx.x;
        const u32* rows = reinterpret_cast<const u32*>(problems.rows);
        u32 carry = 0;
        for (u32 base = 0; base < problems.segments; base += 32) {
            const u32 e = base + lane;
            const u32 n = e < problems.segments ? rows[e] : 0;
            u32 sum = n;
#pragma unroll
            for (u32 d = 1; d < 32; d *= 2) {
                const u32 up = __shfl_up_sync(0xffffffffu, sum, d);
                sum += lane >= d ? up : 0;
            }
            const u32 start = carry + sum - n;
            for (u32 p = 0; p < problems.count; ++p) {
                if (problems.segment[p] == e) {
                    const GroupedProblem& problem = problems.problem[p];
                    const u32 total = MODE == GG_ROWS ? problem.m : problem.k;
                    // Clipped, so that counts summing past the rows (a bad
                    // routing) stay inside the operands.
                    layout.start[p] = min(start, total);
                    layout.end[p] = start + n < start ? total : min(start + n, total);
                }
            }
            carry += __shfl_sync(0xffffffffu, sum, 31);
        }
        __syncwarp();
        if (lane == 0) {
            if (MODE == GG_ROWS) {
                u32 tiles = 0;
                for (u32 p = 0; p < problems.count; ++p) {
                    layout.first_tile[p] = tiles;
                    const u32 n_tiles = (problems.problem[p].n + GG_TILE_N - 1) / GG_TILE_N;
                    tiles += (layout.end[p] - layout.start[p] + GG_TILE_M - 1) / GG_TILE_M * n_tiles;
                }
                layout.first_tile[problems.count] = tiles;
                layout.split_from = split_from(tiles, problems.blocks);
            } else {
                for (u32 p = 0; p <= problems.count; ++p) {
                    layout.first_tile[p] = problems.first_tile[p];
                }
                layout.split_from = problems.split_from;
            }
        }
    }
}

// A unit of work: its problem, first row (of A and C; in a rows launch
// the segment's), first column, the first column of the tile whose B it
// loads, and its width (a tile's, or a half's); the end of its rows, and
// the first and the number of its K rows (in a depth launch the
// segment's).
struct Unit {
    u32 p, m0, n0, b0, width, m_end, k0, k;
};
template <int MODE>
__device__ __forceinline__ Unit locate(const GroupedProblems& problems, const Layout& layout, u32 unit) {
    const u32* first_tile = MODE == GG_TABLE ? problems.first_tile : layout.first_tile;
    const u32 split = MODE == GG_TABLE ? problems.split_from : layout.split_from;
    u32 tile = unit, half = 0;
    if (unit >= split) {
        tile = split + (unit - split) / 2;
        half = 1 + (unit - split) % 2;
    }
    Unit at;
    at.p = 0;
    while (at.p + 1 < problems.count && first_tile[at.p + 1] <= tile) {
        ++at.p;
    }
    const GroupedProblem& problem = problems.problem[at.p];
    const u32 n_tiles = (problem.n + GG_TILE_N - 1) / GG_TILE_N;
    const u32 local = tile - first_tile[at.p];
    at.m0 = (local / n_tiles) * GG_TILE_M + (MODE == GG_ROWS ? layout.start[at.p] : 0);
    at.b0 = (local % n_tiles) * GG_TILE_N;
    at.n0 = at.b0 + (half == 2 ? GG_TILE_N / 2 : 0);
    at.width = half == 0 ? GG_TILE_N : GG_TILE_N / 2;
    at.m_end = MODE == GG_ROWS ? layout.end[at.p] : problem.m;
    at.k0 = MODE == GG_DEPTH ? layout.start[at.p] : 0;
    at.k = MODE == GG_DEPTH ? layout.end[at.p] - layout.start[at.p] : problem.k;
    return at;
}

// The launch's units: its tiles, and one more for each split in two.
template <int MODE>
__device__ __forceinline__ u32 unit_count(const GroupedProblems& problems, const Layout& layout) {
    const u32 tiles = MODE == GG_TABLE ? problems.first_tile[problems.count] : layout.first_tile[problems.count];
    const u32 split = MODE == GG_TABLE ? problems.split_from : layout.split_from;
    return tiles + (tiles - split);
}

// Zeroes the stored rows `valid` .. 63 of a depth launch's last K-step:
// every atom of its MN-major A (two) and B (four), whole 128-byte rows
// (the swizzle moves chunks within a row only). The consumers share it
// out, then make the writes visible to the MMAs' reads and wait for each
// other, since both warpgroups read all of B.
__device__ __forceinline__ void zero_rows_past(u32 at_a, u32 at_b, u32 valid) {
    // 6 atoms x 64 rows x 8 chunks of 16 bytes: 12 a consumer thread.
#pragma unroll
    for (u32 j = 0; j < 6 * 64 * 8 / GG_CONSUMERS; ++j) {
        // Chunk j * 256 + thread: atom j / 2, row (j % 2) * 32 + thread / 8.
        const u32 atom = j / 2, row = (j % 2) * 32 + threadIdx.x / 8;
        if (row >= valid) {
            const u32 base = atom < 2 ? at_a + atom * GG_ATOM_BYTES : at_b + (atom - 2) * GG_ATOM_BYTES;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + row * 128 + (threadIdx.x % 8) * 16),
                         "r"(0u)
                         : "memory");
        }
    }
    fence_async_shared();
    named_barrier<3, GG_CONSUMERS>();
}

// Loads K-step `k0` of an operand into `tile`, completing on `bar`: a
// K-major operand's rows `mn0` .. + ROWS - 1 (one box), or an MN-major
// one's elements `mn0` .. + ROWS - 1 of its stored rows k0 .. k0 + 63
// (ROWS / 64 atoms).
template <int TRANS, int ROWS>
__device__ __forceinline__ void load_operand(u32 tile, const TensorMap* map, u32 mn0, u32 k0, u32 bar) {
    if (TRANS) {
#pragma unroll
        for (int atom = 0; atom < ROWS / 64; ++atom) {
            tma_load_2d(tile + atom * GG_ATOM_BYTES, map, mn0 + atom * 64, k0, bar);
        }
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

// Adds this thread's share of a warpgroup's 64 x N accumulator to a bf16
// C [m, n] from row `r0`, column `c0`, with its own loads and stores: rows
// `row` and `row + 8`, two adjacent columns per 8.
template <int N>
__device__ __forceinline__ void add_to_tile(bf16* c, const GroupedProblem& p, const float (&acc)[N / 2], u32 r0,
                                            u32 c0, u32 row) {
    const u32 t = threadIdx.x & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 r = r0 + row + half * 8;
        if (r >= p.m) {
            continue;
        }
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            const u32 col = c0 + j * 8 + 2 * t;
            if (col >= p.n) {
                continue;
            }
            bf16* at = c + static_cast<u64>(r) * p.n + col;
            const float2 old = load_pair(at);
            store_pair(at, acc[4 * j + 2 * half] + old.x, acc[4 * j + 2 * half + 1] + old.y);
        }
    }
}

// This thread's share of a warpgroup's 64 x N accumulator into C [.., n]
// (stored, or added to with `add`) from row `r0`, column `c0`, by its own
// stores and only in rows before `m_end`: a rows launch's warpgroup whose
// rows run past its segment's end, where the map would write the next
// segment's rows.
template <typename T, int N>
__device__ __forceinline__ void store_rows(T* c, u32 n, const float (&acc)[N / 2], bool add, u32 r0, u32 c0, u32 row,
                                           u32 m_end) {
    const u32 t = threadIdx.x & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 r = r0 + row + half * 8;
        if (r >= m_end) {
            continue;
        }
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            const u32 col = c0 + j * 8 + 2 * t;
            if (col >= n) {
                continue;
            }
            T* at = c + static_cast<u64>(r) * n + col;
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

// A warpgroup's 64 x N accumulator to C through its map: box by box of 128
// bytes of columns (64 bf16 or 32 f32), staged 128-byte swizzled as the
// map reads them, alternating between the warpgroup's two buffers; TMA
// stores each box, or adds it in L2 (`add`, f32 only). One thread issues
// them and, before a buffer is written again, waits until the store that
// read it last (two boxes ago, perhaps in the previous unit) has.
template <typename T, u32 BARRIER, int N>
__device__ __forceinline__ void store_boxes(const TensorMap* map, const float (&acc)[N / 2], bool add, u32 staged,
                                            u32 r0, u32 c0, u32 row) {
    constexpr int COLUMNS = 128 / sizeof(T);
    const bool leader = (threadIdx.x & 127) == 0;
    const u32 t = threadIdx.x & 3;
#pragma unroll
    for (int box = 0; box < N / COLUMNS; ++box) {
        const u32 buffer = staged + (box & 1) * GG_BOX_BYTES;
        if (leader) {
            bulk_wait_read<1>();
        }
        named_barrier<BARRIER, 128>();
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 r = row + half * 8;
#pragma unroll
            for (int jj = 0; jj < COLUMNS / 8; ++jj) {
                const int j = box * (COLUMNS / 8) + jj;
                const float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
                // Columns jj * 8 + 2 t and + 1 of the box: 16-byte chunk
                // `chunk` of the row, swizzled, at byte `within`.
                const u32 chunk = sizeof(T) == 4 ? jj * 2 + (t >> 1) : jj;
                const u32 within = sizeof(T) == 4 ? (t & 1) * 8 : t * 4;
                const u32 to = buffer + r * 128 + ((chunk ^ (r % 8)) << 4) + within;
                if constexpr (sizeof(T) == 4) {
                    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(to), "f"(v0), "f"(v1) : "memory");
                } else {
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(to), "r"(pack_bf16(v0, v1)) : "memory");
                }
            }
        }
        fence_async_shared();
        named_barrier<BARRIER, 128>();
        if (leader) {
            if (add) {
                tma_reduce_add_2d(map, c0 + box * COLUMNS, r0, buffer);
            } else {
                tma_store_2d(map, c0 + box * COLUMNS, r0, buffer);
            }
            bulk_commit();
        }
    }
}

// One unit's K-steps on this warpgroup's 64 rows and the unit's N columns
// (its tile's whole 256 or the half at `unit.n0`), then its C. `it` counts
// the ring's K-steps across units.
template <int MODE, int TRANS_A, int TRANS_B, int N>
__device__ __forceinline__ void consume_unit(const GroupedProblems& problems, const Unit& unit, u32 tiles, u32 full,
                                             u32 empty, u32 staged, u32& it) {
    const GroupLane lane = group_lane();
    const bool leader = (threadIdx.x & 127) == 0;
    const GroupedProblem problem = problems.problem[unit.p];
    const u32 steps = (unit.k + GG_TILE_K - 1) / GG_TILE_K;
    // A depth launch's segment without rows: nothing loaded, nothing added.
    if (MODE == GG_DEPTH && steps == 0) {
        return;
    }
    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        acc[i] = 0.0f;
    }
    for (u32 s = 0; s < steps; ++s, ++it) {
        const u32 slot = it % GG_STAGES;
        mbarrier_wait(full + 8 * slot, (it / GG_STAGES) & 1);
        const u32 at_a = tiles + slot * GG_STAGE_BYTES;
        const u32 at_b = at_a + GG_A_BYTES;
        if (MODE == GG_DEPTH && s + 1 == steps && unit.k % GG_TILE_K != 0) {
            zero_rows_past(at_a, at_b, unit.k % GG_TILE_K);
        }
        wgmma_fence();
#pragma unroll
        for (u32 kk = 0; kk < GG_TILE_K / 16; ++kk) {
            wgmma_ss<TRANS_A, TRANS_B>(acc, operand_desc<TRANS_A>(at_a, lane.group * 64, kk),
                                       operand_desc<TRANS_B>(at_b, unit.n0 - unit.b0, kk), 1);
        }
        wgmma_commit();
        // Step s - 1's products are done in this warpgroup: its buffer
        // goes back to the producer.
        wgmma_wait<1>();
        if (s > 0 && leader) {
            mbarrier_arrive(empty + 8 * ((it - 1) % GG_STAGES));
        }
    }
    wgmma_wait<0>();
    if (leader) {
        mbarrier_arrive(empty + 8 * ((it - 1) % GG_STAGES));
    }

    const u32 r0 = unit.m0 + lane.group * 64;
    const TensorMap* map_c = &problems.map[3 * unit.p + 2];
    const bool add = problem.flags & GG_ACCUMULATE;
    if (MODE == GG_ROWS && (!(problem.flags & GG_C_MAP) || r0 + 64 > unit.m_end)) {
        if (problem.flags & GG_C_F32) {
            store_rows<float, N>(reinterpret_cast<float*>(problem.c), problem.n, acc, add, r0, unit.n0, lane.row,
                                 unit.m_end);
        } else {
            store_rows<bf16, N>(reinterpret_cast<bf16*>(problem.c), problem.n, acc, add, r0, unit.n0, lane.row,
                                unit.m_end);
        }
    } else if (!(problem.flags & GG_C_MAP)) {
        add_to_tile<N>(reinterpret_cast<bf16*>(problem.c), problem, acc, r0, unit.n0, lane.row);
    } else if (problem.flags & GG_C_F32) {
        if (lane.group == 0) {
            store_boxes<float, 1, N>(map_c, acc, add, staged, r0, unit.n0, lane.row);
        } else {
            store_boxes<float, 2, N>(map_c, acc, add, staged, r0, unit.n0, lane.row);
        }
    } else if (lane.group == 0) {
        store_boxes<bf16, 1, N>(map_c, acc, false, staged, r0, unit.n0, lane.row);
    } else {
        store_boxes<bf16, 2, N>(map_c, acc, false, staged, r0, unit.n0, lane.row);
    }
}

template <int MODE, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void grouped_gemm(const GroupedProblems& problems) {
    extern __shared__ unsigned char shared[];
    __shared__ Layout layout;
    load_layout<MODE>(problems, layout);
    const u32 tiles = shared_address(aligned_shared(shared));
    // After the ring: each warpgroup's two boxes of C, then the ring's
    // barriers, `full` then `empty`, one 8-byte barrier a stage each.
    const u32 staging = tiles + GG_STAGES * GG_STAGE_BYTES;
    const u32 full = staging + 4 * GG_BOX_BYTES;
    const u32 empty = full + GG_STAGES * 8;

    if (threadIdx.x == 0) {
#pragma unroll
        for (u32 i = 0; i < GG_STAGES; ++i) {
            mbarrier_init(full + 8 * i, 1);
            // One arrival from each consumer warpgroup.
            mbarrier_init(empty + 8 * i, 2);
        }
        mbarrier_init_fence();
    }
    // Also publishes warp 0's layout: every thread must count the same
    // units (a warpgroup whose warps disagree would part at its wgmma).
    __syncthreads();
    const u32 units = unit_count<MODE>(problems, layout);

    if (threadIdx.x >= GG_CONSUMERS) {
        // The producer: the `u`-th use of a buffer waits for the consumers'
        // release of its use u - 1 (parity (u - 1) & 1; the first passes).
        // A half loads its whole tile's B (its map's box), of which the
        // consumers read their half.
        if (threadIdx.x == GG_CONSUMERS) {
            u32 it = 0;
            for (u32 u = blockIdx.x; u < units; u += gridDim.x) {
                const Unit at = locate<MODE>(problems, layout, u);
                const TensorMap* map_a = &problems.map[3 * at.p];
                const TensorMap* map_b = &problems.map[3 * at.p + 1];
                const u32 steps = (at.k + GG_TILE_K - 1) / GG_TILE_K;
                for (u32 s = 0; s < steps; ++s, ++it) {
                    const u32 slot = it % GG_STAGES, use = it / GG_STAGES;
                    mbarrier_wait(empty + 8 * slot, (use & 1) ^ 1);
                    const u32 bar = full + 8 * slot;
                    mbarrier_expect(bar, GG_STAGE_BYTES);
                    const u32 buffer = tiles + slot * GG_STAGE_BYTES;
                    load_operand<TRANS_A, GG_TILE_M>(buffer, map_a, at.m0, at.k0 + s * GG_TILE_K, bar);
                    load_operand<TRANS_B, GG_TILE_N>(buffer + GG_A_BYTES, map_b, at.b0, at.k0 + s * GG_TILE_K, bar);
                }
            }
        }
        return;
    }

    const u32 staged = staging + (threadIdx.x / 128) * 2 * GG_BOX_BYTES;
    u32 it = 0;
    for (u32 u = blockIdx.x; u < units; u += gridDim.x) {
        const Unit at = locate<MODE>(problems, layout, u);
        if (at.width == GG_TILE_N) {
            consume_unit<MODE, TRANS_A, TRANS_B, GG_TILE_N>(problems, at, tiles, full, empty, staged, it);
        } else {
            consume_unit<MODE, TRANS_A, TRANS_B, GG_TILE_N / 2>(problems, at, tiles, full, empty, staged, it);
        }
    }
    // The block's shared memory lives until its last stores have read it.
    if ((threadIdx.x & 127) == 0) {
        bulk_wait_read<0>();
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The four layouts, named as `MatmulDims::a_trans` and `b_trans`: `t`
// where the stored operand is transposed (A stored [k, m]; B stored
// [n, k]). A transposed A is MN-major; B is MN-major unless transposed.
// Empty bodies off sm_90a, where the launcher never names them. The
// block's nine warps leave three on one of an SM's four register files
// (16 K each), so a thread may hold 168 registers (ptxas spills 8 bytes
// a thread there; 177 registers failed to launch).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GG_ENTRY_BODY(MODE, TRANS_A, TRANS_B) grouped_gemm<MODE, TRANS_A, TRANS_B>(problems);
#else
#define GG_ENTRY_BODY(MODE, TRANS_A, TRANS_B)
#endif
#define GG_ENTRY(NAME, MODE, TRANS_A, TRANS_B)                                                  \
    extern "C" __global__ void __launch_bounds__(GG_THREADS, 1)                                 \
        NAME(const __grid_constant__ GroupedProblems problems) {                                \
        grid_dependency_sync();                                                                 \
        GG_ENTRY_BODY(MODE, TRANS_A, TRANS_B)                                                   \
    }

GG_ENTRY(grouped_gemm_wgmma_nn, GG_TABLE, 0, 1)
GG_ENTRY(grouped_gemm_wgmma_nt, GG_TABLE, 0, 0)
GG_ENTRY(grouped_gemm_wgmma_tn, GG_TABLE, 1, 1)
GG_ENTRY(grouped_gemm_wgmma_tt, GG_TABLE, 1, 0)
// Segmented launches: rows (variable M, A not transposed; `nn` and `nt`
// as above) and depth (variable K, the weight gradient's `tn`).
GG_ENTRY(grouped_gemm_rows_nn, GG_ROWS, 0, 1)
GG_ENTRY(grouped_gemm_rows_nt, GG_ROWS, 0, 0)
GG_ENTRY(grouped_gemm_depth_tn, GG_DEPTH, 1, 1)

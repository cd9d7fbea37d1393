// Token embedding lookup and its scatter-add (`Backend::embedding_forward`,
// `embedding_backward`).
//
// A bad id (at or past the vocabulary) is reported into the fault word, and,
// as on the CPU, the call then writes (or adds) nothing at all: every block
// reads every id before it writes, so each one knows whether the call is
// refused. The lowest bad row is the one reported.
//
// The backward is deterministic without float atomics and without scratch
// memory. All rows with one id are added onto that id's table row by the
// same thread (one per channel), in row order, starting from the table's
// value: the CPU's order exactly, so f32 results are the same bits, and a
// bf16 table is rounded once, at the store. That thread belongs to the block
// holding the id's first row (the id's "owner" row): a block takes 32
// consecutive rows and scans all ids once, a chunk at a time, to learn which
// of its rows come first for their id and which later rows share it. The
// work is rows x hidden for the sums and rows^2 / 32 id comparisons for the
// scan, whatever the vocabulary; nothing depends on timing.
#include "common.cuh"

#define LOOKUP_THREADS 256
// Rows a backward block may own.
#define OWNER_ROWS 32
// Ids a backward block scans at a time, and the 32-bit words of match bits
// per owned row that a chunk gives.
#define ID_CHUNK 1024
#define CHUNK_WORDS (ID_CHUNK / 32)
static_assert(CHUNK_WORDS <= 32, "a row's non-zero words are one 32-bit mask");
// Rows of one id whose loads a thread issues before adding them (in order).
#define GATHER 8

__device__ __forceinline__ void copy_stored(const void* src, u64 s, void* dst, u64 d, int dtype) {
    if (dtype == DTYPE_BF16) {
        static_cast<unsigned short*>(dst)[d] = static_cast<const unsigned short*>(src)[s];
    } else {
        static_cast<u32*>(dst)[d] = static_cast<const u32*>(src)[s];
    }
}

// Whether any of ids[0, rows) is at or past `vocab`, for every thread of the
// block; with `report`, the lowest bad row goes into the fault word.
__device__ __forceinline__ bool any_bad_id(const u32* ids, u64 rows, u64 vocab, u64* status, bool report) {
    bool bad = false;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) {
        if (ids[r] >= vocab) {
            // A thread's first bad row is its lowest; the fault word keeps
            // the lowest of all.
            if (report) {
                report_fault(status, FAULT_TOKEN, r);
            }
            bad = true;
            break;
        }
    }
    return __syncthreads_or(bad) != 0;
}

// out[r] = table[ids[r]], copying the stored bits (table and out share a
// dtype). Blocks take rows in a grid-stride loop, threads the channels.
extern "C" __global__ void __launch_bounds__(LOOKUP_THREADS) embedding_forward(
    const void* table, const u32* ids, void* out, int dtype, u64 rows, u64 vocab, u64 hidden,
    u64* status) {
    grid_dependency_sync();
    if (any_bad_id(ids, rows, vocab, status, blockIdx.x == 0)) {
        return;
    }
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 from = static_cast<u64>(ids[r]) * hidden;
        for (u64 c = threadIdx.x; c < hidden; c += blockDim.x) {
            copy_stored(table, from + c, out, r * hidden + c, dtype);
        }
    }
}

// dtable[ids[r]] += dout[r] for every row, each id's rows in row order.
// Grid: x = groups of OWNER_ROWS rows, y = groups of LOOKUP_THREADS channels;
// thread = one channel of the block's group.
extern "C" __global__ void __launch_bounds__(LOOKUP_THREADS) embedding_backward(
    const void* dout, int dout_dtype, const u32* ids, void* dtable, int dtable_dtype, u64 rows,
    u64 vocab, u64 hidden, u64* status) {
    grid_dependency_sync();
    __shared__ u32 chunk[ID_CHUNK];
    // Per owned row: the chunk positions at or after it that hold its id.
    // (Padded so that the 32 rows' words of one position are in 32 banks.)
    __shared__ u32 later[OWNER_ROWS][CHUNK_WORDS + 1];
    __shared__ u32 own_id[OWNER_ROWS];
    // Per owned row: which of its `later` words are not zero (bit w for
    // word w), so the adding threads visit only those (a thread walking
    // all 32 rows x 32 words of every chunk was most of the kernel's time).
    __shared__ u32 words_set[OWNER_ROWS];
    // A row of the block with a good id and no earlier row with that id yet.
    __shared__ int live[OWNER_ROWS];
    // An earlier row with its id was found in the current chunk.
    __shared__ int earlier[OWNER_ROWS];
    // The running sum of each row's id, one column per thread.
    __shared__ float sums[OWNER_ROWS][LOOKUP_THREADS];
    const u32 tid = threadIdx.x;
    const u64 first = static_cast<u64>(blockIdx.x) * OWNER_ROWS;
    const u64 c = static_cast<u64>(blockIdx.y) * LOOKUP_THREADS + tid;
    const bool has_channel = c < hidden;
    if (tid < OWNER_ROWS) {
        const u64 r = first + tid;
        const u32 id = r < rows ? ids[r] : 0u;
        own_id[tid] = id;
        live[tid] = r < rows && id < vocab;
        earlier[tid] = 0;
        // Each row is in one block: its column group 0 reports it.
        if (r < rows && id >= vocab && blockIdx.y == 0) {
            report_fault(status, FAULT_TOKEN, r);
        }
    }
    __syncthreads();
    for (u32 i = 0; i < OWNER_ROWS; ++i) {
        sums[i][tid] = live[i] && has_channel
                           ? load(dtable, dtable_dtype, static_cast<u64>(own_id[i]) * hidden + c)
                           : 0.0f;
    }
    bool bad = false;
    for (u64 s = 0; s < rows; s += ID_CHUNK) {
        const u32 n = static_cast<u32>(min(static_cast<u64>(ID_CHUNK), rows - s));
        bool found_bad = false;
        for (u32 p = tid; p < n; p += LOOKUP_THREADS) {
            const u32 id = ids[s + p];
            chunk[p] = id;
            found_bad = found_bad || id >= vocab;
        }
        bool owns = false;
        if (tid < OWNER_ROWS) {
            if (earlier[tid] != 0) {
                live[tid] = 0;
                earlier[tid] = 0;
            }
            owns = live[tid] != 0;
            words_set[tid] = 0;
        }
        bad = __syncthreads_or(found_bad) != 0 || bad;
        // A block that owns no id has nothing to write: done.
        if (__syncthreads_or(owns) == 0) {
            return;
        }
        // A warp takes one word of all 32 rows: the chunk reads broadcast.
        for (u32 x = tid; x < OWNER_ROWS * CHUNK_WORDS; x += LOOKUP_THREADS) {
            const u32 w = x / OWNER_ROWS;
            const u32 i = x % OWNER_ROWS;
            u32 bits = 0;
            if (live[i] != 0) {
                const u64 own_row = first + i;
                const u32 id = own_id[i];
                bool before = false;
                for (u32 bit = 0; bit < 32; ++bit) {
                    const u32 p = w * 32 + bit;
                    if (p < n && chunk[p] == id) {
                        if (s + p < own_row) {
                            before = true;
                        } else {
                            bits |= 1u << bit;
                        }
                    }
                }
                if (before) {
                    atomicOr(&earlier[i], 1);
                }
                if (bits != 0) {
                    atomicOr(&words_set[i], 1u << w);
                }
            }
            later[i][w] = bits;
        }
        __syncthreads();
        if (has_channel) {
            for (u32 i = 0; i < OWNER_ROWS; ++i) {
                if (live[i] == 0 || earlier[i] != 0) {
                    continue;
                }
                float sum = sums[i][tid];
                // The words in order, and their bits in order: row order.
                for (u32 set = words_set[i]; set != 0; set &= set - 1) {
                    const u32 w = __ffs(set) - 1;
                    u32 bits = later[i][w];
                    while (bits != 0) {
                        // Issue up to GATHER loads, then add them in order.
                        float values[GATHER];
                        int count = 0;
#pragma unroll
                        for (int q = 0; q < GATHER; ++q) {
                            values[q] = 0.0f;
                            if (bits != 0) {
                                const u32 bit = __ffs(bits) - 1;
                                bits &= bits - 1;
                                values[q] = load(dout, dout_dtype, (s + w * 32 + bit) * hidden + c);
                                count = q + 1;
                            }
                        }
#pragma unroll
                        for (int q = 0; q < GATHER; ++q) {
                            if (q < count) {
                                sum += values[q];
                            }
                        }
                    }
                }
                sums[i][tid] = sum;
            }
        }
        __syncthreads();
    }
    if (bad || !has_channel) {
        return;
    }
    for (u32 i = 0; i < OWNER_ROWS; ++i) {
        if (live[i] != 0 && earlier[i] == 0) {
            store(dtable, dtable_dtype, static_cast<u64>(own_id[i]) * hidden + c, sums[i][tid]);
        }
    }
}

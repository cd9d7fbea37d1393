// Token embedding lookup and its scatter-add (`Backend::embedding_forward`,
// `embedding_backward`).
//
// A bad id (at or past the vocabulary) is reported into the fault word, and,
// as on the CPU, the call then writes (or adds) nothing at all: every block
// of the forward, and every warp of the backward's ordering, reads every id
// before anything is written, so each knows whether the call is refused
// (the ordering then gives no id rows to add). The lowest bad row is the
// one reported.
//
// The backward is deterministic without float atomics. All rows with one id
// are added onto that id's table row in row order, starting from the
// table's value: the CPU's order exactly, so f32 results are the same bits,
// and a bf16 table is rounded once, at the store. It takes two kernels and
// 3 * rows u32 of scratch. `embedding_backward_order` sorts the rows by
// (id, row) without a sort: a warp a row counts, over all ids, the rows with
// a smaller id and the earlier rows with its id, which is the row's place in
// that order; the id's first row (its "owner") also records where its rows
// start and how many there are. `embedding_backward` then gives each owner
// a block, whose threads (8 channels each where the rows allow) load the
// id's rows from that contiguous list several at a time and add them in
// order. The counting is rows^2 comparisons in all, whatever the
// vocabulary; nothing depends on timing. (The one-kernel way before, a
// block owning 32 rows and rescanning every id for each 256 channels, took
// 205 µs for 4,096 rows of 2,048 channels on an H200; these two take 14 and
// 37 µs.)
#include "common.cuh"

#define LOOKUP_THREADS 256
// Rows (a warp each) of an ordering block, and the ids it stages at a time.
#define ORDER_WARPS 8
#define ORDER_CHUNK 2048
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

// The scratch of the backward: `order` (rows sorted by id, then row),
// `start` and `count` (for an id's first row, where its rows begin in
// `order` and how many there are; 0 for every other row, and for every row
// of a refused call). Grid: a warp a row.
extern "C" __global__ void __launch_bounds__(ORDER_WARPS * 32) embedding_backward_order(
    const u32* ids, u32* order, u32* start, u32* count, u64 rows, u64 vocab, u64* status) {
    grid_dependency_sync();
    __shared__ u32 chunk[ORDER_CHUNK];
    const u32 lane = threadIdx.x & 31;
    const u64 r = static_cast<u64>(blockIdx.x) * ORDER_WARPS + (threadIdx.x >> 5);
    const bool has_row = r < rows;
    const u32 id = has_row ? ids[r] : 0u;
    if (has_row && lane == 0 && id >= vocab) {
        report_fault(status, FAULT_TOKEN, r);
    }
    // Over all ids: rows with a smaller id, earlier rows with this id, all
    // rows with this id, and whether any id is bad.
    u32 smaller = 0, before = 0, same = 0;
    bool bad = false;
    for (u64 s = 0; s < rows; s += ORDER_CHUNK) {
        const u32 n = static_cast<u32>(min(static_cast<u64>(ORDER_CHUNK), rows - s));
        __syncthreads();
        for (u32 p = threadIdx.x; p < n; p += ORDER_WARPS * 32) {
            chunk[p] = ids[s + p];
        }
        __syncthreads();
        for (u32 p = lane; p < n; p += 32) {
            const u32 other = chunk[p];
            bad = bad || other >= vocab;
            smaller += other < id;
            if (other == id) {
                same += 1;
                before += s + p < r;
            }
        }
    }
    smaller = warp_sum(smaller);
    before = warp_sum(before);
    same = warp_sum(same);
    bad = __any_sync(0xffffffffu, bad);
    if (!has_row || lane != 0) {
        return;
    }
    const bool owner = !bad && before == 0;
    order[smaller + before] = static_cast<u32>(r);
    start[r] = owner ? smaller : 0u;
    count[r] = owner ? same : 0u;
}

// dtable[ids[r]] += dout[r] for every row, each id's rows in row order, from
// embedding_backward_order's scratch. Grid: x = rows (a block an id's first
// row; the others leave at once), y = groups of the block's channels: 8 a
// thread with `vec8` (hidden a multiple of 8, dout and dtable 16-byte
// aligned), else one.
extern "C" __global__ void __launch_bounds__(LOOKUP_THREADS) embedding_backward(
    const void* dout, int dout_dtype, const u32* ids, const u32* order, const u32* start, const u32* count,
    void* dtable, int dtable_dtype, u64 hidden, int vec8) {
    grid_dependency_sync();
    const u64 r = blockIdx.x;
    const u32 n = count[r];
    if (n == 0) {
        return;
    }
    const u32* rows_of_id = order + start[r];
    const u64 id = ids[r];
    const u64 c = static_cast<u64>(blockIdx.y) * LOOKUP_THREADS + threadIdx.x;
    if (vec8) {
        const u64 words = hidden / 8;
        if (c >= words) {
            return;
        }
        float sum[8];
        load8(dtable, dtable_dtype, id * words + c, sum);
        for (u32 j = 0; j < n; j += GATHER) {
            // Issue up to GATHER rows' loads, then add them in order.
            float values[GATHER][8];
#pragma unroll
            for (int q = 0; q < GATHER; ++q) {
                if (j + q < n) {
                    load8(dout, dout_dtype, rows_of_id[j + q] * words + c, values[q]);
                }
            }
#pragma unroll
            for (int q = 0; q < GATHER; ++q) {
                if (j + q < n) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        sum[e] += values[q][e];
                    }
                }
            }
        }
        store8(dtable, dtable_dtype, id * words + c, sum);
        return;
    }
    if (c >= hidden) {
        return;
    }
    float sum = load(dtable, dtable_dtype, id * hidden + c);
    for (u32 j = 0; j < n; j += GATHER) {
        float values[GATHER];
#pragma unroll
        for (int q = 0; q < GATHER; ++q) {
            values[q] = j + q < n ? load(dout, dout_dtype, rows_of_id[j + q] * hidden + c) : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < GATHER; ++q) {
            if (j + q < n) {
                sum += values[q];
            }
        }
    }
    store(dtable, dtable_dtype, id * hidden + c, sum);
}

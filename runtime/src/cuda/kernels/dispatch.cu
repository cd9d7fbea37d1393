// MoE dispatch bookkeeping on u32 indices: the per-expert histogram, the
// stable sort of (token, k-slot) pairs by expert, the expert-major regroup
// after the all-to-all, and the balancing load's running sum
// (`Backend::moe_expert_counts`, `moe_sort_by_expert`,
// `moe_expert_major_order`, `moe_load_accumulate`). Integer work only, so
// atomics here cannot change a result.
#include "common.cuh"

#define SORT_MAX_EXPERTS 256
#define SORT_THREADS 1024

// counts[e] += the slots choosing e (the launcher zeroes `counts` first).
// Each block builds a shared histogram, then adds it to `counts`.
extern "C" __global__ void moe_expert_counts(const u32* selected, u64 slots, u32* counts, u32 experts, u64* status) {
    grid_dependency_sync();
    extern __shared__ u32 local[];
    for (u32 e = threadIdx.x; e < experts; e += blockDim.x) {
        local[e] = 0;
    }
    __syncthreads();
    for (u64 i = grid_start(); i < slots; i += grid_stride()) {
        const u32 e = selected[i];
        if (e < experts) {
            atomicAdd(&local[e], 1u);
        } else {
            report_fault(status, FAULT_EXPERT, i);
        }
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < experts; e += blockDim.x) {
        if (local[e] != 0) {
            atomicAdd(&counts[e], local[e]);
        }
    }
}

// load[e] += counts[e], one thread an expert: a sum of integers below 2^53,
// exact in f64.
extern "C" __global__ void moe_load_accumulate(const u32* counts, double* load, u32 experts) {
    grid_dependency_sync();
    const u32 e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < experts) {
        load[e] += static_cast<double>(counts[e]);
    }
}

// The stable counting sort: slot (t, j) choosing e as its i-th pair in slot
// order goes to row start[e] + i; positions[slot] = that row, sources[row] = t.
// One block of SORT_THREADS walks the slots in tiles of SORT_THREADS: inside
// a warp, a slot's rank among equal experts is a popcount of the lanes that
// match it; across warps, per-warp counts are prefix-summed in warp order;
// across tiles, a running count per expert carries on. Counts that disagree
// with the routing are reported (and the offending slots not written).
extern "C" __global__ void __launch_bounds__(SORT_THREADS) moe_sort_by_expert(
    const u32* selected, const u32* counts, u32* positions, u32* sources, u64 slots, u32 top_k,
    u32 experts, u64* status) {
    grid_dependency_sync();
    __shared__ u32 start[SORT_MAX_EXPERTS];
    __shared__ u32 next[SORT_MAX_EXPERTS];
    __shared__ u32 tile_count[SORT_MAX_EXPERTS];
    __shared__ u32 warp_offset[SORT_THREADS / 32][SORT_MAX_EXPERTS];
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 warps = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        u64 at = 0;
        for (u32 e = 0; e < experts; ++e) {
            start[e] = static_cast<u32>(at);
            at += counts[e];
        }
        if (at != slots) {
            report_fault(status, FAULT_COUNTS, slots);
        }
    }
    for (u32 e = threadIdx.x; e < experts; e += blockDim.x) {
        next[e] = 0;
    }
    for (u64 tile = 0; tile < slots; tile += blockDim.x) {
        for (u32 i = threadIdx.x; i < warps * experts; i += blockDim.x) {
            warp_offset[i / experts][i % experts] = 0;
        }
        __syncthreads();
        const u64 slot = tile + threadIdx.x;
        const bool live = slot < slots;
        const u32 e = live ? selected[slot] : 0xffffffffu;
        const bool valid = live && e < experts;
        if (live && !valid) {
            report_fault(status, FAULT_EXPERT, slot);
        }
        // Lanes with equal experts (invalid ones match each other, unused).
        const u32 peers = __match_any_sync(0xffffffffu, valid ? e : 0xffffffffu);
        const u32 rank_in_warp = __popc(peers & ((1u << lane) - 1));
        if (valid && rank_in_warp == 0) {
            warp_offset[warp][e] = __popc(peers);
        }
        __syncthreads();
        // Per expert: the warps' counts become exclusive offsets, in warp order.
        for (u32 x = threadIdx.x; x < experts; x += blockDim.x) {
            u32 at = 0;
            for (u32 w = 0; w < warps; ++w) {
                const u32 c = warp_offset[w][x];
                warp_offset[w][x] = at;
                at += c;
            }
            tile_count[x] = at;
        }
        __syncthreads();
        if (valid) {
            const u32 i = next[e] + warp_offset[warp][e] + rank_in_warp;
            if (i < counts[e]) {
                const u32 row = start[e] + i;
                positions[slot] = row;
                sources[row] = static_cast<u32>(slot / top_k);
            } else {
                report_fault(status, FAULT_COUNTS, slot);
            }
        }
        __syncthreads();
        for (u32 x = threadIdx.x; x < experts; x += blockDim.x) {
            next[x] += tile_count[x];
        }
    }
}

// The expert-major regroup: received rows arrive by (source rank i, local
// expert j), recv_counts[i*L + j] each; order[g] = the received row at grouped
// position g of the order (expert j, then rank i, then arrival). One block
// per (i, j) pair: it sums the counts before it in both orders (R*L is small)
// and copies its run of row numbers. `order` must hold exactly the sum of the
// counts: a run past its end, or a last run short of it, is reported.
extern "C" __global__ void moe_expert_major_order(
    const u32* recv_counts, u32* order, u32 ranks, u32 local_experts, u64 order_len, u64* status) {
    grid_dependency_sync();
    __shared__ u64 bounds[2];
    const u32 i = blockIdx.x / local_experts;
    const u32 j = blockIdx.x % local_experts;
    const u32 count = recv_counts[blockIdx.x];
    if (threadIdx.x == 0) {
        u64 src = 0;
        u64 dst = 0;
        for (u32 ii = 0; ii < ranks; ++ii) {
            for (u32 jj = 0; jj < local_experts; ++jj) {
                const u32 c = recv_counts[ii * local_experts + jj];
                if (ii * local_experts + jj < blockIdx.x) {
                    src += c;
                }
                if (jj < j || (jj == j && ii < i)) {
                    dst += c;
                }
            }
        }
        const bool last = i == ranks - 1 && j == local_experts - 1;
        if (dst + count > order_len || (last && dst + count != order_len)) {
            report_fault(status, FAULT_COUNTS, blockIdx.x);
            dst = order_len;  // nothing to write
        }
        bounds[0] = src;
        bounds[1] = dst;
    }
    __syncthreads();
    if (bounds[1] >= order_len) {
        return;
    }
    for (u32 t = threadIdx.x; t < count; t += blockDim.x) {
        order[bounds[1] + t] = static_cast<u32>(bounds[0] + t);
    }
}

// Copies between layouts: strided column blocks (`Backend::copy_cols`) and
// the attention layers' head splits and joins (`qkv_split`, `qkv_join`,
// `mla_kv_split`, `mla_kv_join`). Plain copies move the stored bits (2 or 4
// bytes an element, `elem` below), so bf16 stays exact; only the sums round.
#include "common.cuh"

// `elem` bytes: 2 or 4 (an element), or 16 (a word of elements, where the
// launcher found every row's pieces whole words).
__device__ __forceinline__ void copy_element(const void* src, u64 s, void* dst, u64 d, int elem) {
    if (elem == 16) {
        static_cast<uint4*>(dst)[d] = static_cast<const uint4*>(src)[s];
    } else if (elem == 2) {
        static_cast<unsigned short*>(dst)[d] = static_cast<const unsigned short*>(src)[s];
    } else {
        static_cast<u32*>(dst)[d] = static_cast<const u32*>(src)[s];
    }
}

// dst[r*dst_stride + dst_offset + j] (+)= src[r*src_stride + src_offset + j].
extern "C" __global__ void copy_cols(
    const void* src, void* dst, int dtype, u64 rows, u64 cols, u64 src_stride, u64 src_offset,
    u64 dst_stride, u64 dst_offset, int accumulate) {
    grid_dependency_sync();
    const u64 n = rows * cols;
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        const u64 r = t / cols;
        const u64 j = t % cols;
        const u64 s = r * src_stride + src_offset + j;
        const u64 d = r * dst_stride + dst_offset + j;
        if (accumulate) {
            store(dst, dtype, d, load(dst, dtype, d) + load(src, dtype, s));
        } else {
            copy_element(src, s, dst, d, elem);
        }
    }
}

// Fused row layout per KV group g: [hpg query heads | k_g | v_g], each head
// `head_dim` wide. Thread per element of the fused tensor; `join` copies the
// other way. With `words` (heads of whole 16-byte words, every tensor
// 16-byte aligned: the launcher checks) a thread moves a word: the same
// layout counted in words, a sixteenth of the index arithmetic an element
// (which, in 64-bit divisions, bound the element-a-thread copy at about
// 1 TB/s on an H200).
__device__ __forceinline__ void qkv_move(
    const void* qkv_in, void* qkv_out, const void* q_in, void* q_out, const void* k_in, void* k_out,
    const void* v_in, void* v_out, int elem, u64 rows, u64 groups, u64 hpg, u64 head_dim, bool join) {
    const u64 group_width = (hpg + 2) * head_dim;
    const u64 width = groups * group_width;
    const u64 n = rows * width;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        const u64 r = t / width;
        const u64 in_row = t % width;
        const u64 g = in_row / group_width;
        const u64 in_group = in_row % group_width;
        const u64 q_width = hpg * head_dim;
        if (in_group < q_width) {
            const u64 i = r * groups * q_width + g * q_width + in_group;
            if (join) copy_element(q_in, i, qkv_out, t, elem); else copy_element(qkv_in, t, q_out, i, elem);
        } else if (in_group < q_width + head_dim) {
            const u64 i = (r * groups + g) * head_dim + (in_group - q_width);
            if (join) copy_element(k_in, i, qkv_out, t, elem); else copy_element(qkv_in, t, k_out, i, elem);
        } else {
            const u64 i = (r * groups + g) * head_dim + (in_group - q_width - head_dim);
            if (join) copy_element(v_in, i, qkv_out, t, elem); else copy_element(qkv_in, t, v_out, i, elem);
        }
    }
}

extern "C" __global__ void qkv_split(
    const void* qkv, void* q, void* k, void* v, int dtype, u64 rows, u64 groups, u64 hpg, u64 head_dim,
    int words) {
    grid_dependency_sync();
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const u64 unit = words ? head_dim * elem / 16 : head_dim;
    qkv_move(qkv, nullptr, nullptr, q, nullptr, k, nullptr, v, words ? 16 : elem, rows, groups, hpg, unit, false);
}

extern "C" __global__ void qkv_join(
    const void* dq, const void* dk, const void* dv, void* dqkv, int dtype, u64 rows, u64 groups,
    u64 hpg, u64 head_dim, int words) {
    grid_dependency_sync();
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const u64 unit = words ? head_dim * elem / 16 : head_dim;
    qkv_move(nullptr, dqkv, dq, nullptr, dk, nullptr, dv, nullptr, words ? 16 : elem, rows, groups, hpg, unit, true);
}

// MLA: kv rows hold, per head i, [k_nope_i (dn) | v_i (dv)]; k_rope [rows, dr]
// is shared by the heads. k[r, i] = [k_nope_i | k_rope_r], v[r, i] = v_i.
// Thread per element of k, then of v (one index space).
extern "C" __global__ void mla_kv_split(
    const void* kv, const void* k_rope, void* k, void* v, int dtype, u64 rows, u64 heads, u64 dn,
    u64 dr, u64 dv) {
    grid_dependency_sync();
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const u64 k_n = rows * heads * (dn + dr);
    const u64 n = k_n + rows * heads * dv;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        if (t < k_n) {
            const u64 c = t % (dn + dr);
            const u64 i = (t / (dn + dr)) % heads;
            const u64 r = t / ((dn + dr) * heads);
            if (c < dn) {
                copy_element(kv, (r * heads + i) * (dn + dv) + c, k, t, elem);
            } else {
                copy_element(k_rope, r * dr + (c - dn), k, t, elem);
            }
        } else {
            const u64 u = t - k_n;
            const u64 c = u % dv;
            const u64 ri = u / dv;
            copy_element(kv, ri * (dn + dv) + dn + c, v, u, elem);
        }
    }
}

// The backward: d_kv from dk's nope part and dv (copies), and
// d_k_rope[r, c] = sum_i dk[r, i, dn + c], heads in order from zero.
extern "C" __global__ void mla_kv_join(
    const void* dk, const void* dv, void* d_kv, void* d_k_rope, int dtype, u64 rows, u64 heads,
    u64 dn, u64 dr, u64 dvd) {
    grid_dependency_sync();
    const int elem = dtype == DTYPE_BF16 ? 2 : 4;
    const u64 kv_n = rows * heads * (dn + dvd);
    const u64 n = kv_n + rows * dr;
    for (u64 t = grid_start(); t < n; t += grid_stride()) {
        if (t < kv_n) {
            const u64 c = t % (dn + dvd);
            const u64 ri = t / (dn + dvd);
            if (c < dn) {
                copy_element(dk, ri * (dn + dr) + c, d_kv, t, elem);
            } else {
                copy_element(dv, ri * dvd + (c - dn), d_kv, t, elem);
            }
        } else {
            const u64 u = t - kv_n;
            const u64 c = u % dr;
            const u64 r = u / dr;
            float sum = 0.0f;
            for (u64 i = 0; i < heads; ++i) {
                sum += load(dk, dtype, (r * heads + i) * (dn + dr) + dn + c);
            }
            store(d_k_rope, dtype, u, sum);
        }
    }
}

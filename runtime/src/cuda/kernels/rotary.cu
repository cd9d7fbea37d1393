// Rotary position embedding, in place (`Backend::rotary_forward` and, with
// sign -1, `rotary_backward`). One thread per (row, i) with i < dim / 2,
// rotating pair i of every head of the row with one angle: the sine and
// cosine (an accurate sincosf of an argument up to seq rad, the kernel's
// cost) are computed once, not once per head. Pair i is channels
// (i, i + dim/2) (rotate-half) or (2i, 2i + 1) when `interleaved`
// (Megatron's MLA).
#include "common.cuh"

extern "C" __global__ void rotary(
    void* x, int dtype, u64 rows, u64 seq, u64 heads, u64 head_stride, u64 offset, u64 dim,
    float base, float sign, int interleaved) {
    grid_dependency_sync();
    const u64 half = dim / 2;
    const u64 angles = rows * half;
    for (u64 t = grid_start(); t < angles; t += grid_stride()) {
        const u64 i = t % half;
        const u64 r = t / half;
        // inv_freq_i = 1 / base^(2i/dim) in f32, as Megatron computes it.
        const float inv_freq = 1.0f / powf(base, static_cast<float>(2 * i) / static_cast<float>(dim));
        const float pos = static_cast<float>(r % seq);
        float s, c;
        sincosf(pos * inv_freq, &s, &c);
        s *= sign;
        // HEADS heads at a time: their loads are all issued before the
        // first store (stores to x would otherwise order every later load).
        constexpr u64 HEADS = 4;
        for (u64 h0 = 0; h0 < heads; h0 += HEADS) {
            u64 a[HEADS], b[HEADS];
            float x1[HEADS], x2[HEADS];
#pragma unroll
            for (u64 j = 0; j < HEADS; ++j) {
                const u64 block = (r * heads + min(h0 + j, heads - 1)) * head_stride + offset;
                a[j] = block + (interleaved ? 2 * i : i);
                b[j] = interleaved ? a[j] + 1 : a[j] + half;
                x1[j] = load(x, dtype, a[j]);
                x2[j] = load(x, dtype, b[j]);
            }
#pragma unroll
            for (u64 j = 0; j < HEADS; ++j) {
                if (h0 + j < heads) {
                    store(x, dtype, a[j], x1[j] * c - x2[j] * s);
                    store(x, dtype, b[j], x2[j] * c + x1[j] * s);
                }
            }
        }
    }
}

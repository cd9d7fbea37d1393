// Rotary position embedding, in place (`Backend::rotary_forward` and, with
// sign -1, `rotary_backward`). One thread per rotated pair: (row, head, i)
// with i < dim / 2; pair i is channels (i, i + dim/2) (rotate-half) or
// (2i, 2i + 1) when `interleaved` (Megatron's MLA).
#include "common.cuh"

extern "C" __global__ void rotary(
    void* x, int dtype, u64 rows, u64 seq, u64 heads, u64 head_stride, u64 offset, u64 dim,
    float base, float sign, int interleaved) {
    const u64 half = dim / 2;
    const u64 pairs = rows * heads * half;
    for (u64 t = grid_start(); t < pairs; t += grid_stride()) {
        const u64 i = t % half;
        const u64 head = (t / half) % heads;
        const u64 r = t / (half * heads);
        // inv_freq_i = 1 / base^(2i/dim) in f32, as Megatron computes it.
        const float inv_freq = 1.0f / powf(base, static_cast<float>(2 * i) / static_cast<float>(dim));
        const float pos = static_cast<float>(r % seq);
        float s, c;
        sincosf(pos * inv_freq, &s, &c);
        s *= sign;
        const u64 block = (r * heads + head) * head_stride + offset;
        const u64 a = block + (interleaved ? 2 * i : i);
        const u64 b = interleaved ? a + 1 : a + half;
        const float x1 = load(x, dtype, a);
        const float x2 = load(x, dtype, b);
        store(x, dtype, a, x1 * c - x2 * s);
        store(x, dtype, b, x2 * c + x1 * s);
    }
}

// Element-wise activations and their derivatives: `Backend::unary_forward`,
// `unary_backward`, `silu_mul_forward` and `silu_mul_backward`.
#include "common.cuh"

// `backend::Unary`, in declaration order (`cuda::launch::unary_code`).
#define UNARY_SILU 0
#define UNARY_GELU 1
#define UNARY_SQUARED_RELU 2

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// Phi(x) in f64 then rounded, as the CPU reference computes the exact GELU.
__device__ __forceinline__ float normal_cdf(float x) {
    return static_cast<float>(0.5 * (1.0 + erf(static_cast<double>(x) * 0.70710678118654752440)));
}

__device__ __forceinline__ float unary_value(int op, float x) {
    if (op == UNARY_SILU) {
        return x * sigmoid(x);
    }
    if (op == UNARY_GELU) {
        return x * normal_cdf(x);
    }
    const float r = fmaxf(x, 0.0f);
    return r * r;
}

__device__ __forceinline__ float unary_derivative(int op, float x) {
    if (op == UNARY_SILU) {
        const float s = sigmoid(x);
        return s * (1.0f + x * (1.0f - s));
    }
    if (op == UNARY_GELU) {
        // 1/sqrt(2 pi), as the CPU's (0.5 * 2/sqrt(pi) * 1/sqrt(2)) in f32.
        const float pdf = expf(-0.5f * x * x) * 0.3989422804014327f;
        return normal_cdf(x) + x * pdf;
    }
    return 2.0f * fmaxf(x, 0.0f);
}

// With `vec8` (every view bf16, 16-byte aligned, n a multiple of 8: the
// launcher checks), a thread takes 8 elements as one 16-byte word; the
// element arithmetic is the same.
extern "C" __global__ void unary_forward(
    int op, const void* x, int x_dtype, void* y, int y_dtype, u64 n, int vec8) {
    grid_dependency_sync();
    if (vec8) {
        for (u64 w = grid_start(); w < n / 8; w += grid_stride()) {
            float f[8];
            unpack8(static_cast<const uint4*>(x)[w], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                f[e] = unary_value(op, f[e]);
            }
            static_cast<uint4*>(y)[w] = pack8(f);
        }
        return;
    }
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        store(y, y_dtype, i, unary_value(op, load(x, x_dtype, i)));
    }
}

// dx = dy * f'(x). Where `y` is not null (it is then `dy` itself: the
// recomputing form, `Backend::unary_backward_recompute`) f(x) goes over dy,
// each element by the thread that read it, after the read; f(x) is
// `unary_forward`'s expression, so its bits.
extern "C" __global__ void unary_backward(
    int op, const void* x, int x_dtype, const void* dy, int dy_dtype, void* dx, int dx_dtype, void* y,
    u64 n, int vec8) {
    grid_dependency_sync();
    if (vec8) {
        for (u64 w = grid_start(); w < n / 8; w += grid_stride()) {
            float xs[8], g[8];
            unpack8(static_cast<const uint4*>(x)[w], xs);
            unpack8(static_cast<const uint4*>(dy)[w], g);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                g[e] = g[e] * unary_derivative(op, xs[e]);
            }
            static_cast<uint4*>(dx)[w] = pack8(g);
            if (y != nullptr) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    xs[e] = unary_value(op, xs[e]);
                }
                static_cast<uint4*>(y)[w] = pack8(xs);
            }
        }
        return;
    }
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float v = load(x, x_dtype, i);
        const float d = load(dy, dy_dtype, i) * unary_derivative(op, v);
        store(dx, dx_dtype, i, d);
        if (y != nullptr) {
            store(y, dy_dtype, i, unary_value(op, v));
        }
    }
}

// y = silu(gate) * up; with `vec8` (as `unary_forward`'s) 8 elements a
// thread, the same arithmetic.
extern "C" __global__ void silu_mul_forward(
    const void* gate, int gate_dtype, const void* up, int up_dtype, void* y, int y_dtype, u64 n, int vec8) {
    grid_dependency_sync();
    if (vec8) {
        for (u64 w = grid_start(); w < n / 8; w += grid_stride()) {
            float g[8], u[8];
            unpack8(static_cast<const uint4*>(gate)[w], g);
            unpack8(static_cast<const uint4*>(up)[w], u);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                g[e] = g[e] * sigmoid(g[e]) * u[e];
            }
            static_cast<uint4*>(y)[w] = pack8(g);
        }
        return;
    }
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float g = load(gate, gate_dtype, i);
        store(y, y_dtype, i, g * sigmoid(g) * load(up, up_dtype, i));
    }
}

// dgate = dy * up * silu'(gate), dup = dy * silu(gate); `vec8` as above.
// Where `y` is not null (then `dy` itself,
// `Backend::silu_mul_backward_recompute`) silu(gate) * up goes over dy as
// `unary_backward`'s f(x) does, `silu_mul_forward`'s expression.
extern "C" __global__ void silu_mul_backward(
    const void* gate, int gate_dtype, const void* up, int up_dtype, const void* dy, int dy_dtype,
    void* dgate, int dgate_dtype, void* dup, int dup_dtype, void* y, u64 n, int vec8) {
    grid_dependency_sync();
    if (vec8) {
        for (u64 w = grid_start(); w < n / 8; w += grid_stride()) {
            float g[8], u[8], d[8], dg[8], du[8];
            unpack8(static_cast<const uint4*>(gate)[w], g);
            unpack8(static_cast<const uint4*>(up)[w], u);
            unpack8(static_cast<const uint4*>(dy)[w], d);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float s = sigmoid(g[e]);
                dg[e] = d[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
                du[e] = d[e] * g[e] * s;
            }
            static_cast<uint4*>(dgate)[w] = pack8(dg);
            static_cast<uint4*>(dup)[w] = pack8(du);
            if (y != nullptr) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    g[e] = g[e] * sigmoid(g[e]) * u[e];
                }
                static_cast<uint4*>(y)[w] = pack8(g);
            }
        }
        return;
    }
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float g = load(gate, gate_dtype, i);
        const float u = load(up, up_dtype, i);
        const float d = load(dy, dy_dtype, i);
        const float s = sigmoid(g);
        store(dgate, dgate_dtype, i, d * u * s * (1.0f + g * (1.0f - s)));
        store(dup, dup_dtype, i, d * g * s);
        if (y != nullptr) {
            store(y, dy_dtype, i, g * sigmoid(g) * u);
        }
    }
}

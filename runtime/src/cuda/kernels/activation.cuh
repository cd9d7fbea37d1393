// The element-wise activations and their derivatives, shared by
// `activation.cu` (`Backend::unary_forward`, `unary_backward`) and the
// grouped GEMM's epilogue (`Backend::grouped_matmul_activation_grad`), so
// both compute the same expressions, to the bit. Included after
// common.cuh.
#pragma once

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

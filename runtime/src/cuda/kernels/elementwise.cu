// Element-wise linear algebra: `Backend::axpy` and `Backend::scale`.
#include "common.cuh"

// y += alpha * x (x and y each bf16 or f32).
extern "C" __global__ void axpy(float alpha, const void* x, int x_dtype, void* y, int y_dtype, u64 n) {
    grid_dependency_sync();
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        store(y, y_dtype, i, load(y, y_dtype, i) + alpha * load(x, x_dtype, i));
    }
}

// x *= alpha.
extern "C" __global__ void scale(void* x, int dtype, u64 n, float alpha) {
    grid_dependency_sync();
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        store(x, dtype, i, load(x, dtype, i) * alpha);
    }
}

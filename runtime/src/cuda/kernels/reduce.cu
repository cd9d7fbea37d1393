// Sums: `Backend::accumulate_sum` (a loss slot), `column_sum` (a bias
// gradient) and `sum_squares` (the gradient norm's partials). Each has a
// fixed reduction shape for given sizes, so equal inputs give equal bits.
#include "common.cuh"

__device__ __forceinline__ double load_f64(const void* p, int dtype, u64 i) {
    if (dtype == DTYPE_F64) {
        return static_cast<const double*>(p)[i];
    }
    return static_cast<double>(load(p, dtype, i));
}

// out[0] += sum_i x[i] in f64. One block: per-thread strided sums, then the
// block tree. Launch with one block of a multiple of 32 threads.
extern "C" __global__ void accumulate_sum(const void* x, int x_dtype, u64 n, double* out) {
    __shared__ double scratch[32];
    double sum = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {
        sum += load_f64(x, x_dtype, i);
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        out[0] += sum;
    }
}

// out[j] += sum_r x[r, j]. Block (32, 32): threadIdx.x picks a column of a
// 32-column tile (coalesced rows), threadIdx.y a slice of rows r = y, y+32,
// ...; the 32 slice sums are then added as a fixed tree.
extern "C" __global__ void column_sum(
    const void* x, int x_dtype, void* out, int out_dtype, u64 rows, u64 cols) {
    __shared__ float partial[32][33];
    const u64 j = static_cast<u64>(blockIdx.x) * 32 + threadIdx.x;
    float sum = 0.0f;
    if (j < cols) {
        for (u64 r = threadIdx.y; r < rows; r += 32) {
            sum += load(x, x_dtype, r * cols + j);
        }
    }
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (threadIdx.y < s) {
            partial[threadIdx.y][threadIdx.x] += partial[threadIdx.y + s][threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.y == 0 && j < cols) {
        store(out, out_dtype, j, load(out, out_dtype, j) + partial[0][threadIdx.x]);
    }
}

// out[b] = sum of x[i]^2 over piece b (elements [b*piece, min((b+1)*piece, n))),
// in f64. One block per piece.
extern "C" __global__ void sum_squares(const float* x, u64 n, u64 piece, double* out) {
    __shared__ double scratch[32];
    const u64 start = static_cast<u64>(blockIdx.x) * piece;
    const u64 end = min(start + piece, n);
    double sum = 0.0;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        const double v = static_cast<double>(x[i]);
        sum += v * v;
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = sum;
    }
}

// Sums: `Backend::accumulate_sum` (a loss slot), `column_sum` (a bias
// gradient), `sum_squares` (the gradient norm's partials) and `sum_shares`
// (the copy transport's reduce-scatters and all-reduces). Each has a fixed
// reduction shape for given sizes, so equal inputs give equal bits.
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
    grid_dependency_sync();
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
    grid_dependency_sync();
    __shared__ float partial[32][33];
    const u64 j = static_cast<u64>(blockIdx.x) * 32 + threadIdx.x;
    float sum = 0.0f;
    if (j < cols) {
        for (u64 r = threadIdx.y; r < rows; r += 32) {
            sum += load(x, x_dtype, r * cols + j);
        }
    }
    column_tree_sum(partial, sum);
    if (threadIdx.y == 0 && j < cols) {
        store(out, out_dtype, j, load(out, out_dtype, j) + partial[0][threadIdx.x]);
    }
}

// The gradient norm's partials, `Backend::sum_squares`: out[b] = sum of
// x[i]^2 over piece b (elements [b*piece, min((b+1)*piece, n))), in f64.
// A piece is a whole bucket (up to hundreds of millions of elements), so
// one block per piece would leave all but a few SMs idle: each piece is cut
// into `tiles` spans of ceil(piece / tiles) elements, a block sums each
// span into `partials[b * tiles + t]`, and `sum_squares_pieces` adds every
// piece's tiles in a fixed tree. The shape depends on the sizes only, so
// equal inputs give equal bits.
extern "C" __global__ void sum_squares_tiles(
    const float* x, u64 n, u64 piece, u64 tiles, double* partials) {
    grid_dependency_sync();
    __shared__ double scratch[32];
    const u64 b = blockIdx.x / tiles;
    const u64 t = blockIdx.x % tiles;
    const u64 span = (piece + tiles - 1) / tiles;
    const u64 piece_end = min((b + 1) * piece, n);
    const u64 start = min(b * piece + t * span, piece_end);
    const u64 end = min(start + span, piece_end);
    // A thread's elements are i, i + blockDim.x, ...; it loads 8 of them
    // before adding any, so 8 loads a thread are in flight instead of one
    // (the scalar loop reached about half the memory's bandwidth), and it
    // adds them in the same order, so the sum keeps its bits.
    const u64 stride = blockDim.x;
    double sum = 0.0;
    u64 i = start + threadIdx.x;
    for (; i + 7 * stride < end; i += 8 * stride) {
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            v[e] = x[i + e * stride];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const double d = static_cast<double>(v[e]);
            sum += d * d;
        }
    }
    for (; i < end; i += stride) {
        const double v = static_cast<double>(x[i]);
        sum += v * v;
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = sum;
    }
}

// out[b] = sum over t < tiles of partials[b * tiles + t]: one block a piece.
extern "C" __global__ void sum_squares_pieces(const double* partials, u64 tiles, double* out) {
    grid_dependency_sync();
    __shared__ double scratch[32];
    double sum = 0.0;
    for (u64 t = threadIdx.x; t < tiles; t += blockDim.x) {
        sum += partials[static_cast<u64>(blockIdx.x) * tiles + t];
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = sum;
    }
}

// The most shares one `sum_shares` launch adds (a launcher's test holds
// `cuda::launch` to it).
#define MAX_SHARES 16

// Where each rank's share lies: in this GPU's memory, or a peer GPU's this
// context may read (peer access).
struct Shares {
    const float* at[MAX_SHARES];
};

// out[i] = ((share0[i] + share1[i]) + share2[i]) + ...: the ranks' shares of
// a reduce-scatter or an all-reduce added in rank order, in f32, as the
// CPU's collectives add them, read straight from where they lie. `out` may
// be one of the shares (in place: each element is read before it is
// written, by the same thread). `words`: every pointer is 16-byte aligned
// and n a multiple of 4, so a thread moves 4 floats at a time.
extern "C" __global__ void sum_shares(Shares shares, int count, float* out, u64 n, int words) {
    grid_dependency_sync();
    if (words) {
        const u64 n4 = n / 4;
        for (u64 i = grid_start(); i < n4; i += grid_stride()) {
            float4 acc = reinterpret_cast<const float4*>(shares.at[0])[i];
            // Unrolled, so the shares' addresses are read from the kernel's
            // parameters by constant index instead of copied to local memory.
#pragma unroll
            for (int j = 1; j < MAX_SHARES; ++j) {
                if (j >= count) {
                    break;
                }
                const float4 v = reinterpret_cast<const float4*>(shares.at[j])[i];
                acc.x += v.x;
                acc.y += v.y;
                acc.z += v.z;
                acc.w += v.w;
            }
            reinterpret_cast<float4*>(out)[i] = acc;
        }
        return;
    }
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        float acc = shares.at[0][i];
#pragma unroll
        for (int j = 1; j < MAX_SHARES; ++j) {
            if (j >= count) {
                break;
            }
            acc += shares.at[j][i];
        }
        out[i] = acc;
    }
}

// Softmax cross-entropy of the output head, in place on f32 logits
// (`Backend::cross_entropy_forward` and `cross_entropy_backward`; both at
// once in `cross_entropy_gradient`, the losses alone in
// `cross_entropy_loss`). One block per row; the row's max and sum are block
// reductions of fixed shape.
#include "common.cuh"

// Whether row r's target is past the vocabulary (IGNORE_TARGET is not): the
// block's thread 0 reports it, and the caller's block leaves the row.
__device__ __forceinline__ bool target_faults(u32 target, u64 vocab, u64 r, u64* status) {
    if (target == IGNORE_TARGET || target < vocab) {
        return false;
    }
    if (threadIdx.x == 0) {
        report_fault(status, FAULT_TARGET, r);
    }
    return true;
}

// logits[r] becomes softmax(logits[r]); losses[r] = logsumexp - logit of the
// target (0 for IGNORE_TARGET). A target past the vocabulary is reported
// and its row left as it was.
extern "C" __global__ void cross_entropy_forward(
    float* logits, const u32* targets, float* losses, u64 vocab, u64* status) {
    grid_dependency_sync();
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    const u32 target = targets[r];
    if (target_faults(target, vocab, r, status)) {
        return;
    }
    float* row = logits + r * vocab;
    float max = neg_inf();
    for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
        max = fmaxf(max, row[c]);
    }
    max = block_max(max, scratch);
    float sum = 0.0f;
    for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
        sum += expf(row[c] - max);
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        losses[r] = target == IGNORE_TARGET ? 0.0f : max + logf(sum) - row[target];
    }
    // Every thread read the target's logit above only through thread 0; the
    // barrier keeps it unchanged until then.
    __syncthreads();
    const float inv = 1.0f / sum;
    for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
        row[c] = expf(row[c] - max) * inv;
    }
}

// probs[r] becomes scale * (probs[r] - onehot(target)), or zeros for an
// ignored target.
extern "C" __global__ void cross_entropy_backward(
    float* probs, const u32* targets, float scale, u64 vocab, u64* status) {
    grid_dependency_sync();
    const u64 r = blockIdx.x;
    const u32 target = targets[r];
    if (target_faults(target, vocab, r, status)) {
        return;
    }
    float* row = probs + r * vocab;
    for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
        if (target == IGNORE_TARGET) {
            row[c] = 0.0f;
        } else {
            row[c] = (c == target ? row[c] - 1.0f : row[c]) * scale;
        }
    }
}

// ---- the head's kernels: loss, and gradient in one pass ---------------------------
// `cross_entropy_loss` and `cross_entropy_gradient`: a block of
// LOSS_THREADS per row, on f32 logits or logits in the compute dtype (bf16:
// the head's GEMM rounds them once, as Megatron's output layer does, and
// the loss is computed in f32 from there). A thread reads its strided logits
// once, several in flight at a time, keeping the running max and the sum
// of exp(logit - max) (online softmax, rescaled as the max rises); the
// block merges the threads' pairs in a fixed order. f32 logits go an
// element a thread (c = threadIdx.x + i * LOSS_THREADS), bf16 ones a 16-byte
// word of 8 a thread where the rows are whole words (else an element a
// thread too). The loss kernel then only reads the target's logit. The
// gradient kernel (with the losses too where asked: the head's forward)
// reads the row a second time to write scale * (softmax - onehot) in
// `out`'s dtype (the head's GEMM operand); a block's row is partly still in
// L2 by then. Small blocks with few registers keep many rows in flight on
// each SM: holding a whole row in a block (registers or shared memory)
// allowed one row an SM and left memory idle while it reduced.
#define LOSS_THREADS 256
#define LOSS_UNROLL 4

// A running softmax normaliser: the max of the values seen and the sum of
// exp(value - max) over them (sum 0: none seen).
struct Normaliser {
    float max;
    float sum;
};

__device__ __forceinline__ Normaliser merge(Normaliser a, Normaliser b) {
    if (b.sum == 0.0f) {
        return a;
    }
    if (a.sum == 0.0f) {
        return b;
    }
    const float m = fmaxf(a.max, b.max);
    return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// The running normaliser `t` with N more values folded in at once.
template <int N>
__device__ __forceinline__ Normaliser fold(Normaliser t, const float (&x)[N]) {
    float m = t.max;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        m = fmaxf(m, x[i]);
    }
    float sum = t.sum * expf(t.max - m);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        sum += expf(x[i] - m);
    }
    return {m, sum};
}

__device__ __forceinline__ float widen(float v) {
    return v;
}
__device__ __forceinline__ float widen(bf16 v) {
    return __bfloat162float(v);
}

// The block's normaliser from each thread's, returned to every thread: a
// butterfly over the warp, then every thread merges the warps in order.
__device__ __forceinline__ Normaliser block_normaliser(Normaliser t) {
    __shared__ Normaliser warps[LOSS_THREADS / 32];
    for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) {
        const Normaliser other = {__shfl_xor_sync(0xffffffffu, t.max, lane_mask),
                                  __shfl_xor_sync(0xffffffffu, t.sum, lane_mask)};
        t = merge(t, other);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warps[warp] = t;
    }
    __syncthreads();
    Normaliser total = warps[0];
    for (int w = 1; w < LOSS_THREADS / 32; ++w) {
        total = merge(total, warps[w]);
    }
    return total;
}

// Row `row`'s normaliser, an element a thread (LOSS_UNROLL in flight).
template <typename T>
__device__ __forceinline__ Normaliser row_normaliser(const T* row, u64 vocab) {
    constexpr u64 STEP = LOSS_THREADS;
    Normaliser t = {neg_inf(), 0.0f};
    u64 c = threadIdx.x;
    for (; c + (LOSS_UNROLL - 1) * STEP < vocab; c += LOSS_UNROLL * STEP) {
        float x[LOSS_UNROLL];
#pragma unroll
        for (int i = 0; i < LOSS_UNROLL; ++i) {
            x[i] = widen(row[c + i * STEP]);
        }
        t = fold(t, x);
    }
    for (; c < vocab; c += STEP) {
        t = merge(t, {widen(row[c]), 1.0f});
    }
    return block_normaliser(t);
}

// The same for a bf16 row of `words` 16-byte words, a word a thread (two
// in flight).
__device__ __forceinline__ Normaliser row_normaliser_words(const uint4* row, u64 words) {
    constexpr u64 STEP = LOSS_THREADS;
    Normaliser t = {neg_inf(), 0.0f};
    u64 w = threadIdx.x;
    for (; w + STEP < words; w += 2 * STEP) {
        const uint4 a = row[w];
        const uint4 b = row[w + STEP];
        float x[16];
        unpack8(a, reinterpret_cast<float(&)[8]>(x[0]));
        unpack8(b, reinterpret_cast<float(&)[8]>(x[8]));
        t = fold(t, x);
    }
    if (w < words) {
        float x[8];
        unpack8(row[w], x);
        t = fold(t, x);
    }
    return block_normaliser(t);
}

// Row blockIdx.x's loss (where `losses` is not null) and gradients (where
// `out` is not null), from logits of type T (`words`: bf16 rows of whole
// 16-byte words, and `out` 16-byte aligned).
template <typename T>
__device__ __forceinline__ void cross_entropy_row(const T* logits, bool words, const u32* targets, float scale,
                                                  void* out, int out_dtype, float* losses, u64 vocab,
                                                  u64* status) {
    const u64 r = blockIdx.x;
    const u32 target = targets[r];
    if (target_faults(target, vocab, r, status)) {
        return;
    }
    const T* row = logits + r * vocab;
    const Normaliser n = words ? row_normaliser_words(reinterpret_cast<const uint4*>(row), vocab / 8)
                               : row_normaliser(row, vocab);
    if (losses != nullptr && threadIdx.x == 0) {
        losses[r] = target == IGNORE_TARGET ? 0.0f : n.max + logf(n.sum) - widen(row[target]);
    }
    if (out == nullptr) {
        return;
    }
    if (losses != nullptr) {
        // In place (`out` is `logits`), the loss's read of the target's
        // logit comes before any thread overwrites it.
        __syncthreads();
    }
    const u64 base = r * vocab;
    if (target == IGNORE_TARGET) {
        for (u64 c = threadIdx.x; c < vocab; c += LOSS_THREADS) {
            store(out, out_dtype, base + c, 0.0f);
        }
        return;
    }
    const float inv = 1.0f / n.sum;
    if (words) {
        // A thread reads a word before it writes that word (in place), and
        // no other thread reads it.
        const uint4* row_words = reinterpret_cast<const uint4*>(row);
        for (u64 w = threadIdx.x; w < vocab / 8; w += LOSS_THREADS) {
            float f[8];
            unpack8(row_words[w], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float p = expf(f[e] - n.max) * inv;
                f[e] = (8 * w + e == target ? p - 1.0f : p) * scale;
            }
            store8(out, out_dtype, base / 8 + w, f);
        }
        return;
    }
#pragma unroll LOSS_UNROLL
    for (u64 c = threadIdx.x; c < vocab; c += LOSS_THREADS) {
        const float p = expf(widen(row[c]) - n.max) * inv;
        store(out, out_dtype, base + c, (c == target ? p - 1.0f : p) * scale);
    }
}

// Either instance of cross_entropy_row, by the logits' dtype.
__device__ __forceinline__ void cross_entropy_row_of(const void* logits, int logits_dtype, int words,
                                                     const u32* targets, float scale, void* out, int out_dtype,
                                                     float* losses, u64 vocab, u64* status) {
    if (logits_dtype == DTYPE_BF16) {
        cross_entropy_row(static_cast<const bf16*>(logits), words != 0, targets, scale, out, out_dtype, losses,
                          vocab, status);
    } else {
        cross_entropy_row(static_cast<const float*>(logits), false, targets, scale, out, out_dtype, losses, vocab,
                          status);
    }
}

// `Backend::cross_entropy_gradient`: the gradients of f32 or bf16 `logits`
// into `out` (f32 or bf16; it may be `logits` itself: a thread reads each
// of its logits before it writes that element, and no other thread reads
// it then), and each row's loss where `losses` is not null. `words`: the
// launcher found bf16 logits in rows of whole 16-byte words, and `out`
// aligned for them.
extern "C" __global__ void __launch_bounds__(LOSS_THREADS) cross_entropy_gradient(
    const void* logits, int logits_dtype, int words, const u32* targets, float scale, void* out, int out_dtype,
    float* losses, u64 vocab, u64* status) {
    grid_dependency_sync();
    cross_entropy_row_of(logits, logits_dtype, words, targets, scale, out, out_dtype, losses, vocab, status);
}

// `Backend::cross_entropy_loss`: the forward's losses, the logits only read.
extern "C" __global__ void __launch_bounds__(LOSS_THREADS) cross_entropy_loss(
    const void* logits, int logits_dtype, int words, const u32* targets, float* losses, u64 vocab, u64* status) {
    grid_dependency_sync();
    cross_entropy_row_of(logits, logits_dtype, words, targets, 0.0f, nullptr, DTYPE_F32, losses, vocab, status);
}

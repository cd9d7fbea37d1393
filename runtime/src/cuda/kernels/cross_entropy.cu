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

// ---- forward and backward in one pass ----------------------------------------------
// `cross_entropy_gradient` (`Backend::cross_entropy_gradient`): the
// forward's softmax and the backward's `scale * (p - onehot)` of a row
// without the loss, written once, in `out`'s dtype (the head's GEMM
// operand) instead of f32 probabilities that a cast then narrows. The row
// is read from memory once: a thread keeps its strided logits (c =
// threadIdx.x + i * blockDim.x, the order in which the forward sums them)
// in registers (PER of them, PER > 0) or the block keeps the row in
// dynamic shared memory (PER == HELD_IN_SHARED); rows longer than either
// are read again for each pass (PER == 0). Every value is computed as the
// two kernels above compute it, so the bits are theirs.
#define HELD_IN_SHARED -1

// With `loss` (the row's slot of the losses), the row's loss is written
// instead of its gradients, as the forward computes it (`cross_entropy_loss`).
template <int PER>
__device__ __forceinline__ void gradient_row(
    const float* row, u32 target, float scale, u64 vocab, void* out, int out_dtype, u64 out_base,
    float* scratch, float* shared_row, float* loss) {
    constexpr int HELD = PER > 0 ? PER : 1;
    float v[HELD];
    // Where the later passes read the row.
    const float* held = PER == HELD_IN_SHARED ? shared_row : row;
    float max = neg_inf();
    if (PER > 0) {
#pragma unroll
        for (int i = 0; i < HELD; ++i) {
            const u64 c = threadIdx.x + static_cast<u64>(i) * blockDim.x;
            v[i] = c < vocab ? row[c] : 0.0f;
            if (c < vocab) {
                max = fmaxf(max, v[i]);
            }
        }
    } else {
        // Unrolled so that several loads are in flight before their stores.
#pragma unroll 8
        for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
            const float x = row[c];
            if (PER == HELD_IN_SHARED) {
                shared_row[c] = x;  // read back by this thread only
            }
            max = fmaxf(max, x);
        }
    }
    max = block_max(max, scratch);
    float sum = 0.0f;
    if (PER > 0) {
#pragma unroll
        for (int i = 0; i < HELD; ++i) {
            if (threadIdx.x + static_cast<u64>(i) * blockDim.x < vocab) {
                sum += expf(v[i] - max);
            }
        }
    } else {
        for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
            sum += expf(held[c] - max);
        }
    }
    sum = block_sum(sum, scratch);
    if (loss != nullptr) {
        if (threadIdx.x == 0) {
            *loss = target == IGNORE_TARGET ? 0.0f : max + logf(sum) - row[target];
        }
        return;
    }
    const float inv = 1.0f / sum;
    const auto gradient = [&](u64 c, float logit) {
        float g = 0.0f;
        if (target != IGNORE_TARGET) {
            const float p = expf(logit - max) * inv;
            g = (c == target ? p - 1.0f : p) * scale;
        }
        store(out, out_dtype, out_base + c, g);
    };
    if (PER > 0) {
#pragma unroll
        for (int i = 0; i < HELD; ++i) {
            const u64 c = threadIdx.x + static_cast<u64>(i) * blockDim.x;
            if (c < vocab) {
                gradient(c, v[i]);
            }
        }
    } else {
        for (u64 c = threadIdx.x; c < vocab; c += blockDim.x) {
            gradient(c, held[c]);
        }
    }
}

// One block (of at most 1024 threads) per row; `per` is the logits a
// thread holds (a power of two up to 8), HELD_IN_SHARED (the launch gives
// the row's bytes of dynamic shared memory) or 0, chosen by the launcher.
// With `losses` (`cross_entropy_loss`), each row's loss instead of its
// gradients.
__device__ __forceinline__ void held_rows(
    const float* logits, const u32* targets, float scale, void* out, int out_dtype, float* losses,
    u64 vocab, int per, u64* status) {
    __shared__ float scratch[32];
    extern __shared__ float shared_row[];
    const u64 r = blockIdx.x;
    const u32 target = targets[r];
    if (target_faults(target, vocab, r, status)) {
        return;
    }
    const float* row = logits + r * vocab;
    const u64 base = r * vocab;
    float* loss = losses != nullptr ? losses + r : nullptr;
#define ROW(P) \
    gradient_row<P>(row, target, scale, vocab, out, out_dtype, base, scratch, shared_row, loss)
    switch (per) {
        case 1: ROW(1); break;
        case 2: ROW(2); break;
        case 4: ROW(4); break;
        case 8: ROW(8); break;
        case HELD_IN_SHARED: ROW(HELD_IN_SHARED); break;
        default: ROW(0); break;
    }
#undef ROW
}

extern "C" __global__ void __launch_bounds__(1024) cross_entropy_gradient(
    const float* logits, const u32* targets, float scale, void* out, int out_dtype, u64 vocab,
    int per, u64* status) {
    held_rows(logits, targets, scale, out, out_dtype, nullptr, vocab, per, status);
}

// `Backend::cross_entropy_loss`: the forward's losses, the logits only read.
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_loss(
    const float* logits, const u32* targets, float* losses, u64 vocab, int per, u64* status) {
    held_rows(logits, targets, 0.0f, nullptr, DTYPE_F32, losses, vocab, per, status);
}

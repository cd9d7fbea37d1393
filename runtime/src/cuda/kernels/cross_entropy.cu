// Softmax cross-entropy of the output head, in place on f32 logits
// (`Backend::cross_entropy_forward` and `cross_entropy_backward`). One block
// per row; the row's max and sum are block reductions of fixed shape.
#include "common.cuh"

// logits[r] becomes softmax(logits[r]); losses[r] = logsumexp - logit of the
// target (0 for IGNORE_TARGET). A target past the vocabulary is reported
// and its row left as it was.
extern "C" __global__ void cross_entropy_forward(
    float* logits, const u32* targets, float* losses, u64 vocab, u64* status) {
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    const u32 target = targets[r];
    if (target != IGNORE_TARGET && target >= vocab) {
        if (threadIdx.x == 0) {
            report_fault(status, FAULT_TARGET, r);
        }
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
    if (target != IGNORE_TARGET && target >= vocab) {
        if (threadIdx.x == 0) {
            report_fault(status, FAULT_TARGET, r);
        }
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

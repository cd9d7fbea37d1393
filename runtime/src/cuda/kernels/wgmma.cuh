// Asynchronous copies, pair loads and stores, warp MMAs (`mma.sync`,
// sm_80 on) and Hopper's warpgroup MMAs (`wgmma`), shared by the kernels
// that stage tiles in shared memory and multiply them on tensor cores: the
// flash attention kernels, the grouped GEMM and the chunked scan's
// backward scores. Included after common.cuh.
#pragma once

__device__ __forceinline__ u32 shared_address(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// c += a b for a 16 x 16 bf16 a (row-major fragment), a 16 x 8 b (column
// fragment b0, b1) and a 16 x 8 f32 c.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of an m16n8k16 product whose 16 k-columns are two m16n8
// accumulators side by side (columns 0-7 in `lo`, 8-15 in `hi`), rounded
// to bf16: one product's output fed to the next, as flash attention feeds
// it its probabilities.
__device__ __forceinline__ void acc_as_a(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16(lo[0], lo[1]);
    a[1] = pack_bf16(lo[2], lo[3]);
    a[2] = pack_bf16(hi[0], hi[1]);
    a[3] = pack_bf16(hi[2], hi[3]);
}

// The sum and max over the 4 threads of a fragment row (lanes differing in
// bits 0-1); every thread ends with the same bits.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The register A operand of K-step `kk` from a 64 x N (or 16 x N) accumulator `w`:
// columns 16 kk .. 16 kk + 15, rounded to bf16 (the mma.sync pairing).
template <int R>
__device__ __forceinline__ void a_operand(u32 (&a)[4], const float (&w)[R], int kk) {
    a[0] = pack_bf16(w[8 * kk + 0], w[8 * kk + 1]);
    a[1] = pack_bf16(w[8 * kk + 2], w[8 * kk + 3]);
    a[2] = pack_bf16(w[8 * kk + 4], w[8 * kk + 5]);
    a[3] = pack_bf16(w[8 * kk + 6], w[8 * kk + 7]);
}

// 16 bytes from global to shared memory, asynchronously; zeros when !valid
// (nothing is read then).
__device__ __forceinline__ void copy16_async(u32 dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void commit_async() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most `N` of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void wait_async() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Copies rows [0, rows) of `width` bf16 channels (a multiple of 8) from
// `src` (rows `stride` elements apart) into `tile` (rows `pitch` elements
// apart) with `cp.async`; rows from `valid` on are zeros (nothing is read
// for them). The whole block calls it; it issues the copies (does not
// commit or wait for them). `I` is the type of the counts and indices and
// `Stride` of the row offsets, as the caller keeps them: the kernels short
// of registers pass u32 (unsigned divisions, 32-bit products), where int
// and a u64 stride would cost one a spill.
template <typename I, typename Stride>
__device__ __forceinline__ void stage_rows(bf16* tile, I pitch, const bf16* src, Stride stride, I valid, I rows, I width) {
    const I words = width / 8;
    for (I idx = threadIdx.x; idx < rows * words; idx += blockDim.x) {
        const I r = idx / words;
        const I c = (idx % words) * 8;
        const bool ok = r < valid;
        copy16_async(shared_address(tile + r * pitch + c), ok ? src + r * stride + c : src, ok);
    }
}

// Two adjacent outputs: a bf16 pair, or two f32s.
__device__ __forceinline__ void store_pair(bf16* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = pack_bf16(a, b);
}
__device__ __forceinline__ void store_pair(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
// The two adjacent values `p` points at, as f32.
__device__ __forceinline__ float2 load_pair(const bf16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 load_pair(const float* p) {
    return *reinterpret_cast<const float2*>(p);
}

// A tensor map: the 128-byte descriptor of a global array that TMA loads
// read (see the TMA section below), as the host's `CUtensorMap` lays it
// out. Plain data, so that kernel parameters can hold it on any target.
struct __align__(128) TensorMap {
    unsigned long long opaque[16];
};

// ---- Hopper only (sm_90a) ---------------------------------------------------
// Staged tiles use the 128-byte swizzled layout that `wgmma` reads at full
// speed: an atom is 8 rows of 128 bytes (1024 bytes, 1024-aligned), and the
// 16-byte chunk c of row r sits at chunk c ^ (r % 8), which is the
// hardware's swizzle (address bits 4-6 XOR bits 7-9).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A shared-memory matrix descriptor with the 128-byte swizzle: start
// address, leading and stride byte offsets (each in units of 16 bytes).
__device__ __forceinline__ u64 swizzled_desc(u32 address, u32 leading, u32 stride) {
    return static_cast<u64>((address & 0x3ffff) >> 4) | (static_cast<u64>(leading >> 4) << 16) |
           (static_cast<u64>(stride >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
// Closes the products issued since the last commit into a group.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most `N` of this warpgroup's committed groups are in
// flight (groups complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Closes the products issued since the fence into a group and waits for
// them: their results are in registers after this.
__device__ __forceinline__ void wgmma_finish() {
    wgmma_commit();
    wgmma_wait<0>();
}
// Keeps the compiler from moving a read of `d` above the wait before it:
// the registers of an accumulator are written by the tensor cores, which
// the compiler does not see (CUTLASS's `warpgroup_fence_operand`).
// Before a `wgmma_fence`, the same keeps the compiler from sinking the
// writes of an operand past it (ptxas would then wait for them itself).
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}
template <int N>
__device__ __forceinline__ void fence_operands(u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            asm volatile("" : "+r"(a[i][e])::"memory");
        }
    }
}
// Makes this thread's `cp.async` writes to shared memory visible to the
// async proxy that `wgmma` reads it through (before the block's barrier).
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}


// The products d (+)= A B from two shared-memory descriptors, one instance
// per width N the kernels use (32, 64, 128 and 256; the operand lists are long,
// not clever). TRANS_A and TRANS_B: the operand is MN-major (1) or K-major (0).
template <int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[16], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[128], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
}

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}


// The block's dynamic shared memory from its first 1024-byte boundary (the
// launchers give every `wgmma` kernel 1024 bytes more than its tiles).
__device__ __forceinline__ unsigned char* aligned_shared(unsigned char* shared) {
    return shared + ((1024 - (shared_address(shared) & 1023)) & 1023);
}

// A warpgroup's view of its 64 rows: which warp of the group, the lane,
// and this thread's accumulator rows `row` and `row + 8` (relative to the
// group's first).
struct GroupLane {
    u32 group, lane, row;
};
__device__ __forceinline__ GroupLane group_lane() {
    GroupLane at;
    at.group = threadIdx.x / 128;
    at.lane = threadIdx.x & 31;
    at.row = ((threadIdx.x & 127) >> 5) * 16 + (at.lane >> 2);
    return at;
}

// ---- Tensor memory accelerator (TMA) loads and their barriers ---------------
// A block's producer thread loads tiles with `cp.async.bulk.tensor` and the
// consumers wait on an mbarrier in shared memory, so no consumer computes
// an address or meets the others at a block barrier per K-step. A tensor
// map (a 128-byte descriptor the host encodes: the operand's base, sizes,
// row stride, box and swizzle) travels in the kernel's parameters, read
// through a `__grid_constant__` parameter's address. Loads past a map's
// sizes fill zeros and still count their bytes.

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA) before
// the block's barrier that follows.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// This thread's arrival, announcing `bytes` that loads will complete.
__device__ __forceinline__ void mbarrier_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of this parity has completed (a fresh
// barrier counts its phase before the first, parity 1, as complete).
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// The box of `map` at element (c0, c1) (c0 along the contiguous dimension)
// into shared memory at `dst`, completing its bytes on barrier `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, u32 c0, u32 c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// The box of a four-dimensional `map` at element (c0, c1, c2, c3) (c0
// along the contiguous dimension) into shared memory at `dst`, completing
// its bytes on barrier `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, u32 c0, u32 c1, u32 c2, u32 c3,
                                            u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Adds the box at `src` in shared memory into `map`'s array at element
// (c0, c1), element by element in L2 (one rounding each, as a load, add and
// store would), as one bulk group of this thread; parts past the map's
// sizes are dropped.
__device__ __forceinline__ void tma_reduce_add_2d(const TensorMap* map, u32 c0, u32 c1, u32 src) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
            reinterpret_cast<u64>(map)),
        "r"(c0), "r"(c1), "r"(src)
        : "memory");
}
// Stores the box at `src` in shared memory into `map`'s array at element
// (c0, c1), as one bulk group of this thread; parts past the map's sizes
// are dropped.
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, u32 c0, u32 c1, u32 src) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
            reinterpret_cast<u64>(map)),
        "r"(c0), "r"(c1), "r"(src)
        : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most `N` of this thread's bulk groups have yet to read
// their shared memory (the rest's may then be reused, or the block exit).
template <int N = 0>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// A barrier among `THREADS` threads of the block (whole warps) on
// hardware barrier `ID` (0 is `__syncthreads`'); a constant ID lets the
// compiler reserve only the barriers a kernel names.
template <u32 ID, u32 THREADS>
__device__ __forceinline__ void named_barrier() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(THREADS) : "memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The merge of KV-split partials (flash-decoding): one warp per output row. Used by the prefill kernel's split
// launch (flash_combine_kernel) and, fused, by the last block of the decode kernel.
#pragma once

#include "flash.h"
#include "ptx.cuh"

namespace llm_attn {

// Merges the KV-split partials of one output row (row_id over (batch, head, q_row)) with one warp:
// lse = log(sum_s exp(lse_s)); o = sum_s exp(lse_s - lse) o_s. Partials are read with ld.global.cg (L2, not L1):
// in the fused decode path they were written by other blocks of the same launch. The loop is L2-latency bound, so
// its loads go out kBatch splits at a time, and the first batch's loads go out before the lse pass (which needs
// every split's lse before any weight is known): at 33 splits and kBatch 16, three round trips where a max pass and
// batches of 8 took six.
template <typename T, int kHeadDim, int kBatch = 8>
__device__ __forceinline__ void combine_row(const FlashFwdParams& params, int64_t row_id, int lane) {
    constexpr int kPerLane = kHeadDim / 32;
    const int n = params.num_splits;
    const int64_t split_stride = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;
    const float* lse_row = params.lse_accum + row_id;
    const float* o_row = params.o_accum + row_id * kHeadDim + lane * kPerLane;
    float lse_s[kBatch], o_s[kBatch][kPerLane];
    auto load_batch = [&](int base) {
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            if (base + i < n) {
                const int64_t s = base + i;
                lse_s[i] = __ldcg(lse_row + s * split_stride);
#pragma unroll
                for (int c = 0; c < kPerLane; c += 2) {
                    const float2 x = __ldcg(reinterpret_cast<const float2*>(o_row + s * split_stride * kHeadDim + c));
                    o_s[i][c] = x.x;
                    o_s[i][c + 1] = x.y;
                }
            }
        }
    };
    load_batch(0);
    // The max over splits, 32 lanes at a time (unrolled for up to 128 splits, so those loads are in flight together).
    float max_lse = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (lane + 32 * k < n) max_lse = fmaxf(max_lse, __ldcg(lse_row + (lane + 32 * k) * split_stride));
    for (int s = lane + 128; s < n; s += 32) max_lse = fmaxf(max_lse, __ldcg(lse_row + s * split_stride));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, off));
    float acc[kPerLane] = {};
    float total = 0.f;
    if (max_lse != -INFINITY) {
        for (int base = 0; base < n; base += kBatch) {
            if (base > 0) load_batch(base);
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
                if (base + i < n) {
                    const float w = __expf(lse_s[i] - max_lse);
                    total += w;
#pragma unroll
                    for (int c = 0; c < kPerLane; ++c) acc[c] += w * o_s[i][c];
                }
            }
        }
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const int row = row_id % params.seqlen_q;
    const int head = (row_id / params.seqlen_q) % params.num_heads;
    const int batch = row_id / (static_cast<int64_t>(params.seqlen_q) * params.num_heads);
    T* o = reinterpret_cast<T*>(params.o) + batch * params.o_batch_stride + head * params.o_head_stride +
           static_cast<int64_t>(row) * params.o_row_stride + lane * kPerLane;
#pragma unroll
    for (int i = 0; i < kPerLane; i += 2) *reinterpret_cast<uint32_t*>(o + i) = pack2<T>(acc[i] * inv, acc[i + 1] * inv);
    if (params.lse != nullptr && lane == 0) params.lse[row_id] = total > 0.f ? max_lse + __logf(total) : -INFINITY;
}

// Merges the KV-split partials of the prefill kernel: one warp per output row.
template <typename T, int kHeadDim>
__global__ void flash_combine_kernel(const FlashFwdParams params) {
    const int64_t row_id = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (row_id >= static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q) return;
    combine_row<T, kHeadDim>(params, row_id, threadIdx.x % 32);
}

}  // namespace llm_attn

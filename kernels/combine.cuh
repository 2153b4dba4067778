// The merge of KV-split partials (flash-decoding): one warp per output row. Used by the prefill kernel's split
// launch (flash_combine_kernel) and, fused, by the last block of the decode kernel.
#pragma once

#include "flash.h"
#include "ptx.cuh"

namespace llm_attn {

// Merges the KV-split partials of one output row (row_id over (batch, head, q_row)) with one warp:
// lse = log(sum_s exp(lse_s)); o = sum_s exp(lse_s - lse) o_s. Partials are read with ld.global.cg (L2, not L1):
// in the fused decode path they were written by other blocks of the same launch.
template <typename T, int kHeadDim>
__device__ __forceinline__ void combine_row(const FlashFwdParams& params, int64_t row_id, int lane) {
    constexpr int kPerLane = kHeadDim / 32;
    const int64_t split_stride = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;
    float max_lse = -INFINITY;
    for (int s = lane; s < params.num_splits; s += 32) max_lse = fmaxf(max_lse, __ldcg(params.lse_accum + s * split_stride + row_id));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, off));
    float acc[kPerLane] = {};
    float total = 0.f;
    if (max_lse != -INFINITY) {
        // Unrolled so several splits' loads are in flight at once: this loop is L2-latency bound.
#pragma unroll 8
        for (int s = 0; s < params.num_splits; ++s) {
            const float w = __expf(__ldcg(params.lse_accum + s * split_stride + row_id) - max_lse);
            total += w;
            const float* o_s = params.o_accum + (s * split_stride + row_id) * kHeadDim + lane * kPerLane;
#pragma unroll
            for (int i = 0; i < kPerLane; i += 2) {
                const float2 x = __ldcg(reinterpret_cast<const float2*>(o_s + i));
                acc[i] += w * x.x;
                acc[i + 1] += w * x.y;
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

// Launch template of the split-KV decode kernel; included by one instantiation file per (head_dim, dtype).
#pragma once

#include "flash_decode_kernel.cuh"

namespace llm_attn {

template <typename T, typename Traits>
cudaError_t launch_decode(FlashFwdParams& params, cudaStream_t stream) {
    auto kernel = flash_decode_kernel<T, Traits>;
    constexpr int smem = Traits::kSmemBytes;
    if (smem > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return err;
    }
    dim3 grid(params.num_splits, params.num_kv_heads, params.batch);
    kernel<<<grid, Traits::kThreads, smem, stream>>>(params);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || params.num_splits == 1) return err;
    constexpr int kWarps = 4;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;
    flash_combine_kernel<T, Traits::kHeadDim><<<(rows + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(params);
    return cudaGetLastError();
}

// kStages: 3 stages of 64-key K/V tiles where a block may take > 99 KB of shared memory (sm_80, sm_87, sm_90);
// 2 stages on sm_86/sm_89 (99 KB per block at most).
template <typename T, int kHeadDim>
cudaError_t run_flash_decode_(FlashFwdParams& params, cudaStream_t stream) {
    const int rows = params.num_heads / params.num_kv_heads * params.seqlen_q;
    const bool deep = max_smem_per_block_current_device() >= DecodeTraits<kHeadDim, 2, 3>::kSmemBytes;
    if (rows <= 16) {
        return deep ? launch_decode<T, DecodeTraits<kHeadDim, 1, 3>>(params, stream)
                    : launch_decode<T, DecodeTraits<kHeadDim, 1, 2>>(params, stream);
    }
    return deep ? launch_decode<T, DecodeTraits<kHeadDim, 2, 3>>(params, stream)
                : launch_decode<T, DecodeTraits<kHeadDim, 2, 2>>(params, stream);
}

}  // namespace llm_attn

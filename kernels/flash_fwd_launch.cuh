// Launch templates: tile configuration per head_dim, grid shape, KV splits. Included by one instantiation file
// per (head_dim, dtype, causal) so the builds run in parallel.
#pragma once

#include "flash_fwd_kernel.cuh"
#include "flash_fwd_config.h"

namespace llm_attn {

template <typename T, typename Traits, bool kCausal, bool kSplit>
cudaError_t launch_fwd(FlashFwdParams& params, cudaStream_t stream) {
    auto kernel = flash_fwd_kernel<T, Traits, kCausal, kSplit>;
    constexpr int smem = Traits::kSmemBytes;
    if (smem > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return err;
    }
    const int m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    dim3 grid(m_blocks, params.num_heads, params.batch * (kSplit ? params.num_splits : 1));
    kernel<<<grid, Traits::kThreads, smem, stream>>>(params);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess || !kSplit) return err;
    constexpr int kWarps = 4;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;
    flash_combine_kernel<T, Traits::kHeadDim><<<(rows + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(params);
    return cudaGetLastError();
}

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_(FlashFwdParams& params, cudaStream_t stream) {
    using Config = FwdConfig<kHeadDim>;
    if (use_small_tiles(params, num_sms_current_device())) {
        return params.num_splits > 1 ? launch_fwd<T, typename Config::Small, kCausal, true>(params, stream)
                                     : launch_fwd<T, typename Config::Small, kCausal, false>(params, stream);
    }
    if (params.num_splits > 1) return launch_fwd<T, typename Config::Large, kCausal, true>(params, stream);
    // The wide tile needs two resident blocks per SM to keep 8 warps (sm_90); it has no split-KV variant.
    if constexpr (!kCausal || Config::kWideCausal) {
        if (max_smem_per_sm_current_device() >= 2 * Config::Wide::kSmemBytes) {
            return launch_fwd<T, typename Config::Wide, kCausal, false>(params, stream);
        }
    }
    return launch_fwd<T, typename Config::Large, kCausal, false>(params, stream);
}

}  // namespace llm_attn

// Launch templates: tile configuration per head_dim, grid shape, KV splits. Included by one instantiation file
// per (head_dim, dtype, causal) so the builds run in parallel.
#pragma once

#include "flash_fwd_kernel.cuh"
#include "flash_fwd_config.h"
#include "launch_smem.h"

namespace llm_attn {

template <typename T, typename Traits, bool kCausal, bool kSplit>
cudaError_t launch_fwd(FlashFwdParams& params, cudaStream_t stream) {
    auto kernel = flash_fwd_kernel<T, Traits, kCausal, kSplit>;
    constexpr int smem = Traits::kSmemBytes;
    if (const cudaError_t err = opt_in_dynamic_smem<flash_fwd_kernel<T, Traits, kCausal, kSplit>, smem>();
        err != cudaSuccess) {
        return err;
    }
    const int m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    // Causal, not split: heads in x so that blocks launch longest first across heads (flash_fwd_kernel). The
    // binding keeps m_blocks within gridDim.y's 65535.
    constexpr bool kHeadsFirst = kCausal && !kSplit;
    dim3 grid(kHeadsFirst ? params.num_heads : m_blocks, kHeadsFirst ? m_blocks : params.num_heads,
              params.batch * (kSplit ? params.num_splits : 1));
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
    const int smem_per_sm = max_smem_per_sm_current_device();
    // The wide tiles have no split-KV variant (flash_fwd_num_splits returns 1 when one is forced).
    if constexpr (!kCausal && Config::kHasWide64) {
        if (params.tile != kTileLarge && params.num_splits == 1 && cc_major_current_device() >= 9 &&
            smem_per_sm >= 2 * Config::Wide64::kSmemBytes) {
            return launch_fwd<T, typename Config::Wide64, kCausal, false>(params, stream);
        }
    }
    if (params.tile == kTileWide) return launch_fwd<T, typename Config::Wide, kCausal, false>(params, stream);
    if (params.num_splits > 1) return launch_fwd<T, typename Config::Large, kCausal, true>(params, stream);
    // Automatic: the wide tile where two blocks of it fit an SM (8 warps per SM) and, causal, from the grid size
    // where it measured faster than Large (kernels/NOTES.md).
    const long blocks = static_cast<long>((params.seqlen_q + Config::Wide::kBlockM - 1) / Config::Wide::kBlockM) *
                        params.num_heads * params.batch;
    if (params.tile == kTileAuto && smem_per_sm >= 2 * Config::Wide::kSmemBytes &&
        (!kCausal || blocks >= static_cast<long>(Config::kWideCausalMinBlocksPerSm) * num_sms_current_device())) {
        return launch_fwd<T, typename Config::Wide, kCausal, false>(params, stream);
    }
    return launch_fwd<T, typename Config::Large, kCausal, false>(params, stream);
}

}  // namespace llm_attn

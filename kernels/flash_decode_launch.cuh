// Launch template of the split-KV decode kernel; included by one instantiation file per (head_dim, dtype).
#pragma once

#include "flash_decode_kernel.cuh"
#include "kernel_tiles.h"
#include "launch_smem.h"

namespace llm_attn {

template <typename T, typename Traits>
cudaError_t launch_decode(FlashFwdParams& params, cudaStream_t stream) {
    auto kernel = flash_decode_kernel<T, Traits>;
    constexpr int smem = Traits::kSmemBytes;
    const cudaError_t err = opt_in_dynamic_smem<flash_decode_kernel<T, Traits>, smem>();
    if (err != cudaSuccess) return err;
    dim3 grid(params.num_splits, params.num_kv_heads, params.batch);
    kernel<<<grid, Traits::kThreads, smem, stream>>>(params);
    return cudaGetLastError();
}

// kStages: one m16 row tile takes 3 stages of 64-key K/V tiles where a block may have > 99 KB of shared memory
// (sm_80, sm_87, sm_90) and 2 on sm_86/sm_89 (99 KB per block at most). Two row tiles (q_len x heads per KV head
// of 17..32) always take 2 stages: with 3, head_dim 128 runs out of registers (spills) on sm_90.
template <typename T, int kHeadDim>
cudaError_t run_flash_decode_(FlashFwdParams& params, cudaStream_t stream) {
    const int rows = params.num_heads / params.num_kv_heads * params.seqlen_q;
    using Config = DecodeConfig<kHeadDim>;  // kernel_tiles.h (generated)
    // A forced configuration (tuning: llm_attn.ops.force_decode) whose row tiles hold the rows; else the automatic
    // choice below. Forcing one that needs more shared memory than the device has fails at the opt-in.
    switch (flash_decode_forced_config()) {
        case kDecodeTwoTiles: return launch_decode<T, typename Config::TwoTiles>(params, stream);
        case kDecodeDeep: if (rows <= 16) return launch_decode<T, typename Config::Deep>(params, stream); break;
        case kDecodeShallow: if (rows <= 16) return launch_decode<T, typename Config::Shallow>(params, stream); break;
        case kDecodeDeep4: if (rows <= 16) return launch_decode<T, typename Config::Deep4>(params, stream); break;
        default: break;
    }
    if (rows > 16) return launch_decode<T, typename Config::TwoTiles>(params, stream);
    const bool deep = max_smem_per_block_current_device() >= Config::Deep::kSmemBytes;
    return deep ? launch_decode<T, typename Config::Deep>(params, stream)
                : launch_decode<T, typename Config::Shallow>(params, stream);
}

}  // namespace llm_attn

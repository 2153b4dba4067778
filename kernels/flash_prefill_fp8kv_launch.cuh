// Launch template of the prefill over the FP8 KV cache (flash_prefill_fp8kv_kernel.cuh, v2 in
// flash_prefill_fp8kv_v2.cuh); included by one instantiation file per (head_dim, dtype of q and o).
// run_flash_decode_fp8kv (flash_decode_fp8kv.cu) calls it for the calls with more packed rows than the decode kernel
// holds; flash_prefill_fp8kv_version (the grid against the SM count, or LLM_ATTN_FP8KV_PREFILL_V) picks the version.
#pragma once

#include "flash_prefill_fp8kv_kernel.cuh"
#include "kernel_tiles.h"
#include "launch_smem.h"

namespace llm_attn {

// One configuration per version on every device (PrefillFp8KvConfig<D>, kernel_tiles.h, from
// kernels/generate_kernels.py).
// v1 (Tile): 4 warps x 16 packed rows, 64-key tiles, 3 stages. e4m3 tiles are half the bytes of fp16 ones and Q lives
// in the last stage, so the shared memory is 128 + 3 x 2 x 64 x head_dim bytes: 48.1 KB at head_dim 128 (24.1 KB at
// 64). Two blocks fit the 100 KB of an sm_86/sm_89 SM (99 KB per block; 4 stages, 64 KB, would fit one block only).
// Registers are the limit elsewhere: head_dim 128 takes 186-210 registers (nvcc and NVRTC, sm_80-90), so two 4-warp
// blocks per SM on every arch (bounding it to three blocks, 168 registers, spilled 48-96 bytes); head_dim 64 takes
// 125-139: 3-4. 16 rows per warp keep Q in registers (32 at head_dim 128) beside the 64 O accumulators and the 32 of a
// 64-key S tile: 32 rows per warp would need 128 O accumulators plus 64 of S.
// v2 (V2): 8 warps x 16 packed rows (a tile converted to fp16 once per 128 rows), 2 stages of e4m3 bytes and two
// fp16 tiles: 128 + 2 x 2 x 64 x head_dim + 2 x 2 x 64 x head_dim x 2 bytes = 96.1 KB at head_dim 128 (48.1 KB at
// 64), under the 99 KB of an sm_86/89 block (static_assert in PrefillFp8KvV2Traits). One 8-warp block per SM at
// head_dim 128 (its registers: 256 threads x > 128), as the portable kernel's 8-warp tile.
template <typename T, typename Traits>
cudaError_t launch_prefill_fp8kv(FlashDecodeFp8KvParams& params, cudaStream_t stream) {
    constexpr int smem = Traits::kSmemBytes;
    const cudaError_t err = opt_in_dynamic_smem<flash_prefill_fp8kv_kernel<T, Traits>, smem>();
    if (err != cudaSuccess) return err;
    const int rows = params.base.num_heads / params.base.num_kv_heads * params.base.seqlen_q;
    dim3 grid((rows + Traits::kRows - 1) / Traits::kRows, params.base.num_kv_heads, params.base.batch);
    flash_prefill_fp8kv_kernel<T, Traits><<<grid, Traits::kThreads, smem, stream>>>(params);
    return cudaGetLastError();
}

template <typename T, int kHeadDim>
cudaError_t run_flash_prefill_fp8kv_(FlashDecodeFp8KvParams& params, cudaStream_t stream) {
    using V2 = typename PrefillFp8KvConfig<kHeadDim>::V2;
    int device = 0, num_sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    if (flash_prefill_fp8kv_version(params, V2::kRows, num_sms) == 1)
        return launch_prefill_fp8kv<T, typename PrefillFp8KvConfig<kHeadDim>::Tile>(params, stream);
    return launch_prefill_fp8kv<T, V2>(params, stream);
}

}  // namespace llm_attn

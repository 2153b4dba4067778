// Launch template of the decode kernel over the FP8 KV cache; included by one instantiation file per
// (head_dim, dtype of q and o).
#pragma once

#include "flash_decode_fp8kv_kernel.cuh"
#include "kernel_tiles.h"
#include "launch_smem.h"

namespace llm_attn {

template <typename T, typename Traits>
cudaError_t launch_decode_fp8kv(FlashDecodeFp8KvParams& params, cudaStream_t stream) {
    constexpr int smem = Traits::kSmemBytes;
    const cudaError_t err = opt_in_dynamic_smem<flash_decode_fp8kv_kernel<T, Traits>, smem>();
    if (err != cudaSuccess) return err;
    dim3 grid(params.base.num_splits, params.base.num_kv_heads, params.base.batch);
    flash_decode_fp8kv_kernel<T, Traits><<<grid, Traits::kThreads, smem, stream>>>(params);
    return cudaGetLastError();
}

// One configuration per row count, on every device: e4m3 tiles are half the bytes of fp16 ones, so 3 stages of
// one m16 row tile (hd 128: 53 KB; 4 were slower on the H200, kernels/NOTES.md "The FP8-cache decode's stage count")
// and 3 of two (72 KB, the merge buffer's size) fit the 99 KB that sm_86/sm_89 give a block. Where the grid is at
// most one block an SM and the device has the shared memory (hd 128: 100.3 KB, so not sm_86/89), one row tile runs
// in blocks of two warp groups (OneTileWG2): 8 warps an SM instead of 4 (flash_decode_fp8kv_two_groups). The
// tables are kernel_tiles.h's DecodeFp8KvConfig<D> (kernels/generate_kernels.py).
template <typename T, int kHeadDim>
cudaError_t run_flash_decode_fp8kv_(FlashDecodeFp8KvParams& params, cudaStream_t stream) {
    using Config = DecodeFp8KvConfig<kHeadDim>;
    const int rows = params.base.num_heads / params.base.num_kv_heads * params.base.seqlen_q;
    if (rows > kDecodeMaxRows) return cudaErrorInvalidValue;
    if (flash_decode_fp8kv_two_groups(params, params.base.num_splits, num_sms_current_device(),
                                      max_smem_per_block_current_device()))
        return launch_decode_fp8kv<T, typename Config::OneTileWG2>(params, stream);
    return rows > 16 ? launch_decode_fp8kv<T, typename Config::TwoTiles>(params, stream)
                     : launch_decode_fp8kv<T, typename Config::OneTile>(params, stream);
}

}  // namespace llm_attn

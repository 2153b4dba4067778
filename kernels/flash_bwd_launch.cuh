// Backward launch templates: tile configuration per head_dim, grids of the three kernels. Included by one
// instantiation file per (head_dim, dtype, causal) so the builds run in parallel.
#pragma once

#include "flash_bwd_kernel.cuh"
#include "kernel_tiles.h"
#include "launch_smem.h"

namespace llm_attn {

// 64 keys per block (4 warps x 16 keys). Per thread: dK + dV accumulators (head_dim / 2 floats each) plus the P^T
// and dP^T tiles (kBlockM / 2 floats each). head_dim 64 takes 64 query rows per step (228-238 registers); head_dim
// 128 takes 32 (its 128 accumulators plus two 64-query tiles reached 255 registers and spilled 12-44 bytes on
// sm_80/sm_90, kernels/NOTES.md Backward). Shared memory: K, V (64 rows each), two stages of Q and dO
// (kBlockM rows each), dS^T, two stages of lse/dsum: 68.5 KB for head_dim 128 (fits the 99 KB per block of
// sm_86/89; two blocks per H100 SM), 57 KB for head_dim 64.
template <int kHeadDim>
using BwdConfig = BwdTraits<kHeadDim, BwdTile<kHeadDim>::kBlockM, BwdTile<kHeadDim>::kBlockN, BwdTile<kHeadDim>::kNWarps,
                            BwdTile<kHeadDim>::kSplitDp>;  // BwdTile: kernel_tiles.h (generated)

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_bwd_(FlashBwdParams& params, cudaStream_t stream) {
    using Traits = BwdConfig<kHeadDim>;
    constexpr int kChunks = kHeadDim / 8;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;

    constexpr int kPreThreads = 128;
    const int64_t pre_blocks = (rows * kChunks + kPreThreads - 1) / kPreThreads;
    flash_bwd_preprocess_kernel<T, kHeadDim><<<static_cast<unsigned>(pre_blocks), kPreThreads, 0, stream>>>(params);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    auto kernel = flash_bwd_dkdv_kernel<T, Traits, kCausal>;
    constexpr int smem = Traits::kSmemBytes;
    err = opt_in_dynamic_smem<flash_bwd_dkdv_kernel<T, Traits, kCausal>, smem>();
    if (err != cudaSuccess) return err;
    const int n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    // Causal: KV heads in x so the longest key blocks (the first ones) launch first across heads (the binding keeps
    // n_blocks within gridDim.y's 65535).
    dim3 grid(kCausal ? params.num_kv_heads : n_blocks, kCausal ? n_blocks : params.num_kv_heads,
              params.batch * params.num_splits);
    kernel<<<grid, Traits::kThreads, smem, stream>>>(params);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    constexpr int kConvThreads = 256;
    const int64_t conv_blocks = (rows * kChunks + kConvThreads - 1) / kConvThreads;
    flash_bwd_convert_dq_kernel<T, kHeadDim><<<static_cast<unsigned>(conv_blocks), kConvThreads, 0, stream>>>(params);
    if (params.num_splits == 1) return cudaGetLastError();
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const int64_t kv_rows = static_cast<int64_t>(params.batch) * params.num_kv_heads * params.seqlen_k;
    const int64_t kv_blocks = (kv_rows * kChunks + kConvThreads - 1) / kConvThreads;
    flash_bwd_convert_dkdv_kernel<T, kHeadDim><<<static_cast<unsigned>(kv_blocks), kConvThreads, 0, stream>>>(params);
    return cudaGetLastError();
}

}  // namespace llm_attn

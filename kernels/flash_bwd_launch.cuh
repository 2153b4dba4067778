// Backward launch templates: tile configuration per head_dim, grids of the three kernels. Included by one
// instantiation file per (head_dim, dtype, causal) so the builds run in parallel.
#pragma once

#include "flash_bwd_2d_kernel.cuh"
#include "flash_bwd_kernel.cuh"
#include "kernel_tiles.h"
#include "launch_smem.h"

#include <type_traits>

namespace llm_attn {

// BwdTile (kernel_tiles.h, generated): 128 keys per block, 8 warps x 16 keys. Per thread: dK + dV accumulators
// (head_dim / 2 floats each) plus the P^T and dP^T tiles (kBlockM / 2 floats each). head_dim 64 takes 64 query
// rows per step (221-230 registers); head_dim 128 takes 32 (64-query steps spill, kernels/NOTES.md Backward).
// Shared memory (bwd_smem_bytes): K, V, two stages of Q and dO, dS^T, two stages of lse/dsum: 104.5 KB for head_dim
// 128, 80.5 KB for head_dim 64. One 8-warp block per SM (registers). The 128-key block halves the Q/dO loads and
// dQ atomics per key against 64 keys (H200: backward 1.03-1.09x faster, NOTES "Backward v3").
// BwdTileNarrow: the tile a device with less shared memory per block takes (sm_86/89 allow 99 KB): head_dim 128's
// 4-warp 64-key tile (68.5 KB).
template <int kHeadDim, template <int> class Tile>
using BwdConfigOf = BwdTraits<kHeadDim, Tile<kHeadDim>::kBlockM, Tile<kHeadDim>::kBlockN, Tile<kHeadDim>::kNWarps,
                              Tile<kHeadDim>::kSplitDp>;

// One dK/dV kernel (flash_bwd_dkdv_kernel or flash_bwd_dkdv_2d_kernel: both read their block from BwdBlock::make) on
// its grid: (key block, KV head, batch x split). Causal: KV heads in x so the longest key blocks (the first ones)
// launch first across heads (the binding keeps n_blocks within gridDim.y's 65535).
template <auto kKernel, typename Traits, bool kCausal>
cudaError_t launch_bwd_dkdv(FlashBwdParams& params, cudaStream_t stream) {
    constexpr int smem = Traits::kSmemBytes;
    cudaError_t err = opt_in_dynamic_smem<kKernel, smem>();
    if (err != cudaSuccess) return err;
    const int n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    dim3 grid(kCausal ? params.num_kv_heads : n_blocks, kCausal ? n_blocks : params.num_kv_heads,
              params.batch * params.num_splits);
    kKernel<<<grid, Traits::kThreads, smem, stream>>>(params);
    return cudaGetLastError();
}

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_flash_bwd_dkdv(FlashBwdParams& params, cudaStream_t stream) {
    return launch_bwd_dkdv<flash_bwd_dkdv_kernel<T, Traits, kCausal>, Traits, kCausal>(params, stream);
}

// Preprocessing, the dK/dV kernel that `dkdv` launches (this file's, or the Hopper one: flash_bwd_sm90_launch.cuh),
// the dQ conversion and, for a split launch, the dK/dV conversion.
template <typename T, int kHeadDim, typename LaunchDkdv>
cudaError_t run_flash_bwd_common(FlashBwdParams& params, cudaStream_t stream, LaunchDkdv&& dkdv) {
    constexpr int kChunks = kHeadDim / 8;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;

    constexpr int kPreThreads = 128;
    const int64_t pre_blocks = (rows * kChunks + kPreThreads - 1) / kPreThreads;
    flash_bwd_preprocess_kernel<T, kHeadDim><<<static_cast<unsigned>(pre_blocks), kPreThreads, 0, stream>>>(params);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    err = dkdv();
    if (err != cudaSuccess) return err;

    constexpr int kConvThreads = 256;
    if (!params.dq_separate) {
        const int64_t conv_blocks = (rows * kChunks + kConvThreads - 1) / kConvThreads;
        flash_bwd_convert_dq_kernel<T, kHeadDim><<<static_cast<unsigned>(conv_blocks), kConvThreads, 0, stream>>>(params);
    }
    if (params.num_splits == 1) return cudaGetLastError();
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const int64_t kv_rows = static_cast<int64_t>(params.batch) * params.num_kv_heads * params.seqlen_k;
    const int64_t kv_blocks = (kv_rows * kChunks + kConvThreads - 1) / kConvThreads;
    flash_bwd_convert_dkdv_kernel<T, kHeadDim><<<static_cast<unsigned>(kv_blocks), kConvThreads, 0, stream>>>(params);
    return cudaGetLastError();
}

// The separate dQ kernel (dq_separate): one block per (64-query block, query head, batch), writing dq itself.
template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch_flash_bwd_dq(FlashBwdParams& params, cudaStream_t stream) {
    using Traits = BwdDqTraits<kHeadDim>;
    cudaError_t err = opt_in_dynamic_smem<flash_bwd_dq_kernel<T, Traits, kCausal>, Traits::kSmemBytes>();
    if (err != cudaSuccess) return err;
    const int m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const dim3 grid(kCausal ? params.num_heads : m_blocks, kCausal ? m_blocks : params.num_heads, params.batch);
    flash_bwd_dq_kernel<T, Traits, kCausal><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
    return cudaGetLastError();
}

// The two-dimensional kernel (flash_bwd_2d_kernel.cuh).
template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch_flash_bwd_dkdv_2d(FlashBwdParams& params, cudaStream_t stream) {
    using Traits = Bwd2dTraits<kHeadDim>;
    static_assert(Traits::kSmemBytes == bwd_2d_smem_bytes(kHeadDim), "flash.h's size of the layout");
    return launch_bwd_dkdv<flash_bwd_dkdv_2d_kernel<T, Traits, kCausal>, Traits, kCausal>(params, stream);
}

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_bwd_(FlashBwdParams& params, cudaStream_t stream) {
    using Tile = BwdConfigOf<kHeadDim, BwdTile>;
    using Narrow = BwdConfigOf<kHeadDim, BwdTileNarrow>;
    return run_flash_bwd_common<T, kHeadDim>(params, stream, [&] {
        cudaError_t err;
        if (params.layout2d) {
            err = launch_flash_bwd_dkdv_2d<T, kHeadDim, kCausal>(params, stream);
        } else if constexpr (std::is_same_v<Tile, Narrow>) {
            err = launch_flash_bwd_dkdv<T, Tile, kCausal>(params, stream);
        } else {
            err = params.narrow ? launch_flash_bwd_dkdv<T, Narrow, kCausal>(params, stream)
                                : launch_flash_bwd_dkdv<T, Tile, kCausal>(params, stream);
        }
        if (err != cudaSuccess || !params.dq_separate) return err;
        return launch_flash_bwd_dq<T, kHeadDim, kCausal>(params, stream);
    });
}

}  // namespace llm_attn

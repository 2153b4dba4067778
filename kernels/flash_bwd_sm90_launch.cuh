// Host side of the Hopper backward: tensor maps for Q, K, V and dO, then the same three launches as the portable
// backward (flash_bwd_launch.cuh) with the dK/dV kernel swapped for flash_bwd_sm90_kernel. Included by one
// instantiation file per (head_dim, dtype, causal).
#pragma once

#include "flash_bwd_launch.cuh"  // run_flash_bwd_common: preprocessing and the conversions
#include "flash_bwd_sm90_kernel.cuh"
#include "launch_smem.h"
#include "tma_host.h"

namespace llm_attn {
namespace sm90 {

// 128 keys x 64 query rows a step (head_dim 128) or x 128 (head_dim 64), two stages of Q/dO: head_dim 128 K 32 KB +
// V 32 KB + 2 x (Q 16 + dO 16) + 2 dS^T 16 KB + dQ 64 KB (+ lse/dsum, barriers, alignment) = 210 KB; head_dim 64
// K 16 + V 16 + 2 x (Q 16 + dO 16) + 2 dS^T 32 + dQ 32 = 195 KB.
template <int kHeadDim>
using BwdConfig = Sm90BwdTraits<kHeadDim, 2>;

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_bwd_dkdv(const FlashBwdParams& p, cudaStream_t stream) {
    constexpr int kHeadDim = Traits::kHeadDim;
    Sm90BwdParams sp;
    sp.p = p;
    const bool ok =
        make_qkv_maps<T>(p, kHeadDim, Traits::kBlockM, Traits::kBlockN, &sp.tma_q, &sp.tma_k, &sp.tma_v) &&
        make_tensor_map<T>(&sp.tma_do, p.dout, kHeadDim, p.seqlen_q, p.num_heads, p.batch, p.do_batch_stride,
                           p.do_head_stride, p.do_row_stride, Traits::kBlockM) &&
        make_tensor_map<float>(&sp.tma_dq, p.dq_accum, kHeadDim, p.seqlen_q, p.num_heads, p.batch,
                               static_cast<int64_t>(p.num_heads) * p.seqlen_q * kHeadDim,
                               static_cast<int64_t>(p.seqlen_q) * kHeadDim, kHeadDim, Traits::kDqRows);
    if (!ok) return cudaErrorInvalidValue;
    cudaError_t err = opt_in_dynamic_smem<flash_bwd_sm90_kernel<T, Traits, kCausal>, Traits::kSmemBytes>();
    if (err != cudaSuccess) return err;
    const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const dim3 grid(kCausal ? p.num_kv_heads : n_blocks, kCausal ? n_blocks : p.num_kv_heads, p.batch * p.num_splits);
    flash_bwd_sm90_kernel<T, Traits, kCausal><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(sp);
    return cudaGetLastError();
}

}  // namespace sm90

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_bwd_sm90_(FlashBwdParams& params, cudaStream_t stream) {
    return run_flash_bwd_common<T, kHeadDim>(params, stream, [&] {
        return sm90::launch_bwd_dkdv<T, sm90::BwdConfig<kHeadDim>, kCausal>(params, stream);
    });
}

}  // namespace llm_attn

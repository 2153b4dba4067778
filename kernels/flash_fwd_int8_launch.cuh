// Launch template of the INT8 forward's attention kernel (flash_fwd_int8_kernel.cuh), included by one instantiation
// file per (head_dim, dtype, causal) so the builds run in parallel. The pre-pass and the dispatch are in
// flash_fwd_int8.cu.
#pragma once

#include "flash_fwd_int8_kernel.cuh"
#include "launch_smem.h"

namespace llm_attn {

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_fwd_int8(FlashFwdInt8Params& params, cudaStream_t stream) {
    using int8fwd::flash_fwd_int8_kernel;
    constexpr int smem = Traits::kSmemBytes;
    if (const cudaError_t err = opt_in_dynamic_smem<flash_fwd_int8_kernel<T, Traits, kCausal>, smem>();
        err != cudaSuccess) {
        return err;
    }
    const int m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    // Causal: heads in x so that blocks launch longest first across heads (as the bf16 kernel). The binding keeps
    // m_blocks within gridDim.y's 65535.
    dim3 grid(kCausal ? params.num_heads : m_blocks, kCausal ? m_blocks : params.num_heads, params.batch);
    flash_fwd_int8_kernel<T, Traits, kCausal><<<grid, Traits::kThreads, smem, stream>>>(params);
    return cudaGetLastError();
}

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_int8_(FlashFwdInt8Params& params, cudaStream_t stream) {
    return params.fp8_pv ? launch_fwd_int8<T, int8fwd::Int8FwdTraits<kHeadDim, true>, kCausal>(params, stream)
                         : launch_fwd_int8<T, int8fwd::Int8FwdTraits<kHeadDim, false>, kCausal>(params, stream);
}

}  // namespace llm_attn

// Host side of the Hopper forward kernel: tensor maps for Q, K, V and O, and the launch. Included by one
// instantiation file per (head_dim, dtype, causal).
#pragma once

#include "flash_fwd_sm90_kernel.cuh"
#include "launch_smem.h"
#include "tma_host.h"  // tensor maps, tuning_env

namespace llm_attn {
namespace sm90 {

// Tiles per head_dim: 128 query rows (two consumer warpgroups) x 128 keys, two K/V stages.
// head_dim 128: Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB; head_dim 64: 80 KB, or with three consumer warpgroups
// (192 query rows, launch() picks it for most head_dim-64 calls) 88 KB.
template <int kHeadDim, int kBlockN = 128, int kStages = 2, int kConsumers = 2>
using Config = Sm90Traits<kHeadDim, kBlockN, kStages, kConsumers>;

// Tuning switches read once from the environment (tuning_env; kernel benchmarks compare variants in one build; NOTES.md
// H3): LLM_ATTN_SM90_BLOCKN=176 (head_dim 128 non-causal key tile; +0-3 %, within noise, so not the default),
// LLM_ATTN_SM90_PINGPONG=0|1 (default 1), LLM_ATTN_SM90_CONSUMERS=2|3 (head_dim 64: consumer warpgroups, 64 rows
// each; unset: launch() chooses).
template <typename T, typename Traits, bool kCausal>
cudaError_t launch_tile(const FlashFwdParams& p, cudaStream_t stream) {
    constexpr int kHeadDim = Traits::kHeadDim;
    static const int pingpong = tuning_env("LLM_ATTN_SM90_PINGPONG", 1);
    Sm90Params sp;
    sp.p = p;
    sp.pingpong = pingpong;
    const bool ok =
        make_qkv_maps<T>(p, kHeadDim, Traits::kBlockM, Traits::kBlockN, &sp.tma_q, &sp.tma_k, &sp.tma_v) &&
        make_tensor_map<T>(&sp.tma_o, p.o, kHeadDim, p.seqlen_q, p.num_heads, p.batch, p.o_batch_stride,
                           p.o_head_stride, p.o_row_stride, 64);
    if (!ok) return cudaErrorInvalidValue;
    auto kernel = flash_fwd_sm90_kernel<T, Traits, kCausal>;
    cudaError_t err = opt_in_dynamic_smem<flash_fwd_sm90_kernel<T, Traits, kCausal>, Traits::kSmemBytes>();
    if (err != cudaSuccess) return err;
    const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const dim3 grid = kCausal ? dim3(p.num_heads, m_blocks, p.batch) : dim3(m_blocks, p.num_heads, p.batch);
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(sp);
    return cudaGetLastError();
}

template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch(const FlashFwdParams& p, cudaStream_t stream) {
    if constexpr (kHeadDim == 128 && !kCausal) {
        static const int block_n = tuning_env("LLM_ATTN_SM90_BLOCKN", 128);
        if (block_n == 176) return launch_tile<T, Config<128, 176>, kCausal>(p, stream);
    }
    if constexpr (kHeadDim == 64) {
        // Three consumer warpgroups (192 query rows) for head_dim 64, whose GEMMs per tile are half of head_dim
        // 128's against the same softmax: 1.11-1.21x two consumers on the H200 (NOTES.md H5), except causal
        // prompts up to 1024 tokens (0.93-0.94x: a 192-row block wastes more of its keys above the diagonal).
        static const int consumers = tuning_env("LLM_ATTN_SM90_CONSUMERS", 0);
        if (consumers == 3 || (consumers != 2 && !(kCausal && p.seqlen_q <= 1024)))
            return launch_tile<T, Config<64, 128, 2, 3>, kCausal>(p, stream);
    }
    return launch_tile<T, Config<kHeadDim>, kCausal>(p, stream);
}

// Whether this build holds sm_90a machine code for the kernel (built with LLM_ATTN_CUDA_ARCHS containing 9.0 and
// running on a compute capability 9.0 device); otherwise the portable kernel runs.
template <typename T, int kHeadDim, bool kCausal>
bool has_device_code() {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, flash_fwd_sm90_kernel<T, Config<kHeadDim>, kCausal>) != cudaSuccess) {
        cudaGetLastError();  // clear: "no kernel image" is an answer here, not an error for the next launch
        return false;
    }
    return attr.binaryVersion == 90 && attr.ptxVersion == 90;
}

}  // namespace sm90

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_sm90_(FlashFwdParams& params, cudaStream_t stream) {
    return sm90::launch<T, kHeadDim, kCausal>(params, stream);
}
template <typename T, int kHeadDim, bool kCausal>
bool flash_fwd_sm90_built_() {
    return sm90::has_device_code<T, kHeadDim, kCausal>();
}

}  // namespace llm_attn

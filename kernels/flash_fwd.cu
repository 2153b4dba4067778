// Runtime -> compile-time dispatch for the forward kernel, and the KV-split heuristic.
#include "flash.h"
#include "flash_fwd_config.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace llm_attn {

int num_sms_current_device() {
    static int cached[64] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 1;
    if (dev < 64 && cached[dev] > 0) return cached[dev];
    int sms = 1;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (dev < 64) cached[dev] = sms;
    return sms;
}

int flash_fwd_num_splits(const FlashFwdParams& p, int num_sms) {
    const bool small = use_small_tiles(p, num_sms);
    const int block_m = small ? 64 : 128;
    const int block_n = p.head_dim == 64 ? FwdConfig<64>::kBlockN : FwdConfig<128>::kBlockN;
    const long blocks = static_cast<long>((p.seqlen_q + block_m - 1) / block_m) * p.num_heads * p.batch;
    const int n_blocks = (p.seqlen_k + block_n - 1) / block_n;
    // Split only when the grid covers less than most of one wave and there are enough key tiles to share out.
    if (blocks * 10 >= static_cast<long>(num_sms) * 8 || n_blocks < 4) return 1;
    // Fewest splits that reach ~2 blocks per SM, each split keeping at least 2 key tiles; at most 64.
    int splits = static_cast<int>((2L * num_sms + blocks - 1) / blocks);
    splits = splits < n_blocks / 2 ? splits : n_blocks / 2;
    splits = splits < 64 ? splits : 64;
    return splits > 1 ? splits : 1;
}

cudaError_t run_flash_fwd(FlashFwdParams& p, cudaStream_t stream) {
#define LLM_ATTN_CAUSAL_SWITCH(T, D)                                                   \
    return p.causal ? run_flash_fwd_<T, D, true>(p, stream) : run_flash_fwd_<T, D, false>(p, stream)
    if (p.head_dim == 128) {
        if (p.is_bf16) LLM_ATTN_CAUSAL_SWITCH(__nv_bfloat16, 128);
        LLM_ATTN_CAUSAL_SWITCH(half, 128);
    }
    if (p.head_dim == 64) {
        if (p.is_bf16) LLM_ATTN_CAUSAL_SWITCH(__nv_bfloat16, 64);
        LLM_ATTN_CAUSAL_SWITCH(half, 64);
    }
#undef LLM_ATTN_CAUSAL_SWITCH
    return cudaErrorInvalidValue;  // the binding validates head_dim first
}

}  // namespace llm_attn

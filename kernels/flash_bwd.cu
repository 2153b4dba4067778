// Runtime -> compile-time dispatch for the backward kernels.
#include "flash.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace llm_attn {

cudaError_t run_flash_bwd(FlashBwdParams& p, cudaStream_t stream) {
#define LLM_ATTN_BWD_CAUSAL_SWITCH(T, D) \
    return p.causal ? run_flash_bwd_<T, D, true>(p, stream) : run_flash_bwd_<T, D, false>(p, stream)
    if (p.head_dim == 128) {
        if (p.is_bf16) LLM_ATTN_BWD_CAUSAL_SWITCH(__nv_bfloat16, 128);
        LLM_ATTN_BWD_CAUSAL_SWITCH(half, 128);
    }
    if (p.head_dim == 64) {
        if (p.is_bf16) LLM_ATTN_BWD_CAUSAL_SWITCH(__nv_bfloat16, 64);
        LLM_ATTN_BWD_CAUSAL_SWITCH(half, 64);
    }
#undef LLM_ATTN_BWD_CAUSAL_SWITCH
    return cudaErrorInvalidValue;  // the binding validates head_dim first
}

}  // namespace llm_attn

// Runtime -> compile-time dispatch of the attention over the FP8 KV cache (flash_decode_fp8kv.h): the split-KV decode
// kernel for up to kDecodeMaxRows packed rows, the prefill kernel (flash_prefill_fp8kv_kernel.cuh; v2 where its
// blocks fill more than half the SMs, else v1; LLM_ATTN_FP8KV_PREFILL_V=1 or 2 forces one) above.
#include "flash_decode_fp8kv.h"
#include "flash_fwd_config.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>

namespace llm_attn {

int flash_prefill_fp8kv_version(const FlashDecodeFp8KvParams& p, int v2_rows, int num_sms) {
    const char* v = std::getenv("LLM_ATTN_FP8KV_PREFILL_V");
    if (v != nullptr && std::strcmp(v, "1") == 0) return 1;
    if (v != nullptr && std::strcmp(v, "2") == 0) return 2;
    const int rows = p.base.num_heads / p.base.num_kv_heads * p.base.seqlen_q;
    const int64_t blocks = static_cast<int64_t>((rows + v2_rows - 1) / v2_rows) * p.base.num_kv_heads * p.base.batch;
    return 2 * blocks > num_sms ? 2 : 1;
}

int flash_decode_fp8kv_num_splits(const FlashDecodeFp8KvParams& p, int num_sms) {
    return use_decode_kernel(p.base) ? flash_fwd_num_splits(p.base, num_sms) : 1;
}

cudaError_t run_flash_decode_fp8kv(FlashDecodeFp8KvParams& p, cudaStream_t stream) {
    if (!use_decode_kernel(p.base)) {  // a prefill over the cache: never split
        if (p.base.num_splits != 1) return cudaErrorInvalidValue;
        if (p.base.head_dim == 128) return p.base.is_bf16 ? run_flash_prefill_fp8kv_<__nv_bfloat16, 128>(p, stream)
                                                          : run_flash_prefill_fp8kv_<half, 128>(p, stream);
        if (p.base.head_dim == 64) return p.base.is_bf16 ? run_flash_prefill_fp8kv_<__nv_bfloat16, 64>(p, stream)
                                                         : run_flash_prefill_fp8kv_<half, 64>(p, stream);
        return cudaErrorInvalidValue;
    }
    if (p.base.head_dim == 128) return p.base.is_bf16 ? run_flash_decode_fp8kv_<__nv_bfloat16, 128>(p, stream)
                                                      : run_flash_decode_fp8kv_<half, 128>(p, stream);
    if (p.base.head_dim == 64) return p.base.is_bf16 ? run_flash_decode_fp8kv_<__nv_bfloat16, 64>(p, stream)
                                                     : run_flash_decode_fp8kv_<half, 64>(p, stream);
    return cudaErrorInvalidValue;
}

}  // namespace llm_attn

// The FP8 KV cache's one-token append: the AOT build's launch of fp8_cache_append_kernel.cuh's kernel.
#include "fp8_cache_append_kernel.cuh"

namespace llm_attn {
namespace {

template <typename T, int kHeadDim>
cudaError_t launch(const Fp8CacheAppendParams& p, cudaStream_t stream) {
    using fp8cache::kAppendThreads;
    fp8cache::fp8_cache_append_kernel<T, kHeadDim><<<dim3(p.kv_heads, p.batch), kAppendThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace

cudaError_t run_fp8_cache_append(const Fp8CacheAppendParams& p, cudaStream_t stream) {
    if (p.capacity <= 0 || p.capacity % kFp8CacheBlock != 0 || p.batch <= 0 || p.kv_heads <= 0) {
        return cudaErrorInvalidValue;
    }
    if (p.head_dim == 128) return p.is_bf16 ? launch<__nv_bfloat16, 128>(p, stream) : launch<half, 128>(p, stream);
    if (p.head_dim == 64) return p.is_bf16 ? launch<__nv_bfloat16, 64>(p, stream) : launch<half, 64>(p, stream);
    return cudaErrorInvalidValue;
}

}  // namespace llm_attn

// The FP8 KV cache's dequantised copy: the AOT build's checks and launch of fp8_cache_dequant_kernel.cuh's kernel.
#include "fp8_cache_dequant_kernel.cuh"

namespace llm_attn {
namespace {

template <typename T, int kHeadDim>
cudaError_t launch(const Fp8CacheDequantParams& p, cudaStream_t stream) {
    using fp8dequant::kDequantThreads;
    const int64_t chunks = static_cast<int64_t>(p.n) * (kHeadDim / 16);
    const dim3 grid(static_cast<unsigned>((chunks + kDequantThreads - 1) / kDequantThreads),
                    static_cast<unsigned>(p.batch * p.kv_heads), 2);
    fp8dequant::fp8_cache_dequant_kernel<T, kHeadDim><<<grid, kDequantThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

// The NVRTC build refuses what this does before its launch too (llm_attn/_nvrtc.py fp8_cache_dequant).
cudaError_t run_fp8_cache_dequant(const Fp8CacheDequantParams& p, cudaStream_t stream) {
    if ((p.head_dim != 64 && p.head_dim != 128) || p.n < 0 || p.n > p.capacity || p.batch <= 0 ||
        p.kv_heads <= 0 || static_cast<int64_t>(p.batch) * p.kv_heads > 65535 ||
        static_cast<int64_t>(p.scale_blocks) * fp8dequant::kScaleBlock < p.n) {
        return cudaErrorInvalidValue;
    }
    if (p.n == 0) return cudaSuccess;
    if (!aligned16(p.k_data) || !aligned16(p.v_data) || !aligned16(p.k_out) || !aligned16(p.v_out) ||
        (p.k_shift != nullptr && !aligned16(p.k_shift))) {
        return cudaErrorInvalidValue;
    }
    // x: ceil(n * head_dim / 16 / 256) blocks; at head_dim 64 that is n / 64: fine for any int n.
    if (p.is_bf16) {
        return p.head_dim == 64 ? launch<__nv_bfloat16, 64>(p, stream) : launch<__nv_bfloat16, 128>(p, stream);
    }
    return p.head_dim == 64 ? launch<half, 64>(p, stream) : launch<half, 128>(p, stream);
}

}  // namespace llm_attn

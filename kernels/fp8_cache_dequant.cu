// The FP8 KV cache's dequantised copy (fp8_cache_dequant.h says what it computes). Memory-bound: each thread turns
// 16 bytes of e4m3 (16 channels of one token) into 32 bytes of fp16/bf16, so a warp reads 512 contiguous bytes and
// writes 1 KB. Grid: x over one (batch, KV head)'s n x head_dim / 16 chunks, y over batch x KV heads, z = K (0) or
// V (1): no integer division by a runtime value (head_dim / 16 is 4 or 8, a shift).
//
// Bit-exactness with kv_cache_reference.dequantize under --use_fast_math: e4m3 -> float is exact (through half:
// every e4m3 value is an fp16 value), the product and the sum are __fmul_rn / __fadd_rn (never contracted), and
// the output rounds once, to nearest even, as torch's float32 -> fp16 / bf16 cast does.
#include "fp8_cache_dequant.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace llm_attn {
namespace {

constexpr int kThreads = 256;
constexpr int kScaleBlock = 64;  // tokens per scale (kv_cache_reference.BLOCK)

// Two e4m3 bytes (the low 16 bits of `pair`) -> two exact floats.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<half>(float a, float b) {
    const __half2 h = __halves2half2(__float2half_rn(a), __float2half_rn(b));
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 h = __halves2bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
    return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) fp8_cache_dequant_kernel(const Fp8CacheDequantParams p) {
    constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks per token
    const bool is_v = blockIdx.z == 1;
    const int bh = blockIdx.y;
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (chunk >= static_cast<int64_t>(p.n) * kChunks) return;
    const int token = static_cast<int>(chunk / kChunks);  // a shift: kChunks is 4 or 8
    const int c = static_cast<int>(chunk % kChunks);

    const uint8_t* data = is_v ? p.v_data : p.k_data;
    const float* scales = is_v ? p.v_scale : p.k_scale;
    const float* shift = is_v ? nullptr : p.k_shift;
    const uint4 bytes = *reinterpret_cast<const uint4*>(
        data + (static_cast<int64_t>(bh) * p.capacity + token) * kHeadDim + c * 16);
    const float s = __ldg(scales + static_cast<int64_t>(bh) * p.scale_blocks + token / kScaleBlock);

    float x[16];
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const float2 lo = e4m3x2_to_float2(words[w]), hi = e4m3x2_to_float2(words[w] >> 16);
        x[4 * w] = __fmul_rn(lo.x, s), x[4 * w + 1] = __fmul_rn(lo.y, s);
        x[4 * w + 2] = __fmul_rn(hi.x, s), x[4 * w + 3] = __fmul_rn(hi.y, s);
    }
    if (shift != nullptr) {
        const float4* sh = reinterpret_cast<const float4*>(shift + static_cast<int64_t>(bh) * kHeadDim + c * 16);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 v = __ldg(sh + q);
            x[4 * q] = __fadd_rn(x[4 * q], v.x), x[4 * q + 1] = __fadd_rn(x[4 * q + 1], v.y);
            x[4 * q + 2] = __fadd_rn(x[4 * q + 2], v.z), x[4 * q + 3] = __fadd_rn(x[4 * q + 3], v.w);
        }
    }
    uint4 out[2];
    out[0] = make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
    out[1] = make_uint4(pack2<T>(x[8], x[9]), pack2<T>(x[10], x[11]), pack2<T>(x[12], x[13]),
                        pack2<T>(x[14], x[15]));
    T* dst = static_cast<T*>(is_v ? p.v_out : p.k_out) +
             (static_cast<int64_t>(bh) * p.n + token) * kHeadDim + c * 16;
    reinterpret_cast<uint4*>(dst)[0] = out[0];
    reinterpret_cast<uint4*>(dst)[1] = out[1];
}

template <typename T, int kHeadDim>
cudaError_t launch(const Fp8CacheDequantParams& p, cudaStream_t stream) {
    const int64_t chunks = static_cast<int64_t>(p.n) * (kHeadDim / 16);
    const dim3 grid(static_cast<unsigned>((chunks + kThreads - 1) / kThreads),
                    static_cast<unsigned>(p.batch * p.kv_heads), 2);
    fp8_cache_dequant_kernel<T, kHeadDim><<<grid, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

cudaError_t run_fp8_cache_dequant(const Fp8CacheDequantParams& p, cudaStream_t stream) {
    if ((p.head_dim != 64 && p.head_dim != 128) || p.n < 0 || p.n > p.capacity || p.batch <= 0 ||
        p.kv_heads <= 0 || static_cast<int64_t>(p.batch) * p.kv_heads > 65535 ||
        static_cast<int64_t>(p.scale_blocks) * kScaleBlock < p.n) {
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

// The FP8 KV cache's dequantised-copy kernel (fp8_cache_dequant.h says what it computes): fp8_cache_dequant.cu
// launches it in the AOT build, llm_attn/_nvrtc.py (fp8_cache_dequant) in the NVRTC one. Memory-bound: each thread
// turns 16 bytes of e4m3 (16 channels of one token) into 32 bytes of fp16/bf16, so a warp reads 512 contiguous bytes
// and writes 1 KB. Grid: x over one (batch, KV head)'s n x head_dim / 16 chunks, y over batch x KV heads, z = K (0)
// or V (1): no integer division by a runtime value (head_dim / 16 is 4 or 8, a shift).
//
// Bit-exactness with kv_cache_reference.dequantize under --use_fast_math: e4m3 -> float is exact (through half:
// every e4m3 value is an fp16 value), the product and the sum are __fmul_rn / __fadd_rn (never contracted), and
// the output rounds once, to nearest even, as torch's float32 -> fp16 / bf16 cast does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "fp8_cache_dequant.h"

namespace llm_attn {
namespace fp8dequant {

constexpr int kDequantThreads = 256;
constexpr int kScaleBlock = 64;  // tokens per scale (kv_cache_reference.BLOCK)

// Two e4m3 bytes (the low 16 bits of `pair`) -> two exact floats.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Two floats -> two T in one word (low half = a), each rounded to nearest even. Its own rather than ptx.cuh's
// llm_attn::pack2 (__floats2half2_rn: the same values), so that the kernel's code stayed what it was measured as when
// it moved here from fp8_cache_dequant.cu; in this namespace it hides that one where a program includes both.
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
__global__ void __launch_bounds__(kDequantThreads) fp8_cache_dequant_kernel(const Fp8CacheDequantParams p) {
    constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks per token
    const bool is_v = blockIdx.z == 1;
    const int bh = blockIdx.y;
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kDequantThreads + threadIdx.x;
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

}  // namespace fp8dequant
}  // namespace llm_attn

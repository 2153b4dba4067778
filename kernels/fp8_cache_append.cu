// The FP8 KV cache's one-token append (fp8_cache_append.h says what it computes). One block per (KV head, batch),
// one thread per channel: each thread owns its channel's 64 slots of the open block, so only the block's amax needs
// the other threads (one shared-memory reduction per operand).
//
// Bit-exactness with kv_cache_reference.quantize under --use_fast_math: 1 / scale is __fdiv_rn, the products and
// the difference __fmul_rn / __fsub_rn (never contracted), and e4m3 is rounded by e4m3_rn_sat below (round to
// nearest even, saturating at 448, NaN kept), which is what torch's float32 -> float8_e4m3fn cast does after the
// reference's clamp.
#include "fp8_cache_append.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace llm_attn {
namespace {

constexpr float kE4m3Max = 448.f;
// float32(1 / 448), bits 0x3b124925: the scale is amax times it (kv_cache_reference.block_scales says why).
__device__ __forceinline__ float inv_e4m3_max() { return __uint_as_float(0x3b124925u); }

// float32 -> e4m3 (fn: no infinities, 0x7F NaN) bits, round to nearest even, |x| clamped to 448 first.
__device__ __forceinline__ uint8_t e4m3_rn_sat(float x) {
    const uint8_t sign = (__float_as_uint(x) >> 24) & 0x80;
    if (x != x) return sign | 0x7F;
    const float a = fminf(fabsf(x), kE4m3Max);
    if (a < 0.015625f) {  // below 2^-6: subnormal, steps of 2^-9 (a * 512 is exact; 8 rounds up to 2^-6 = 0x08)
        return sign | static_cast<uint8_t>(__float2int_rn(__fmul_rn(a, 512.f)));
    }
    int e = static_cast<int>((__float_as_uint(a) >> 23) & 0xFF) - 127;  // -6 .. 8
    int m = __float2int_rn(__fmul_rn(a, __int_as_float((130 - e) << 23)));  // a 2^(3 - e): 8 .. 16, exact
    if (m == 16) m = 8, ++e;                                              // rounded up to the next binade
    return sign | static_cast<uint8_t>(((e + 7) << 3) | (m - 8));         // a <= 448 keeps e <= 8, m <= 14 there
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<half>(half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// The lower median of x[0 .. n) (n >= 1): the value whose rank in ascending order is (n - 1) / 2, ties counted.
__device__ __forceinline__ float lower_median(const float* x, int stride, int n) {
    const int k = (n - 1) / 2;
    float found = x[0];
    for (int i = 0; i < n; ++i) {
        const float xi = x[i * stride];
        int less = 0, equal = 0;
        for (int j = 0; j < n; ++j) {
            const float xj = x[j * stride];
            less += xj < xi;
            equal += xj == xi;
        }
        if (less <= k && k < less + equal) found = xi;
    }
    return found;
}

template <int kThreads>
__device__ __forceinline__ float block_amax(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float m = red[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
    __syncthreads();  // red is reused by the next operand
    return m;
}

// Re-quantises the open block of one operand (column d of every slot; slots past `slot` are zeros) into
// data[64 rows] and its scale.
template <int kThreads>
__device__ __forceinline__ void quantize_block(const float* open, float shift, int slot, uint8_t* data, float* scale,
                                               float* red) {
    const int d = threadIdx.x;
    float x[kFp8CacheBlock];
    float amax = 0.f;
#pragma unroll
    for (int s = 0; s < kFp8CacheBlock; ++s) {
        x[s] = s <= slot ? __fsub_rn(open[s * kThreads + d], shift) : 0.f;
        amax = x[s] != x[s] ? INFINITY : fmaxf(amax, fabsf(x[s]));
    }
    // A NaN anywhere makes torch's amax NaN, and then `amax > 0` is false: scale 1 (carried here as +inf, which
    // no finite amax reaches).
    amax = block_amax<kThreads>(amax, red);
    const float sc = amax > 0.f && amax != INFINITY ? __fmul_rn(amax, inv_e4m3_max()) : 1.f;
    const float inv = __fdiv_rn(1.f, sc);
#pragma unroll
    for (int s = 0; s < kFp8CacheBlock; ++s) data[s * kThreads + d] = e4m3_rn_sat(__fmul_rn(x[s], inv));
    if (d == 0) *scale = sc;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kHeadDim) fp8_cache_append_kernel(const Fp8CacheAppendParams p) {
    __shared__ float red[kHeadDim / 32];
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    const int64_t pos = *p.position;
    const int slot = static_cast<int>(pos % kFp8CacheBlock);
    const int64_t last_block = p.capacity / kFp8CacheBlock - 1;
    const int64_t block = pos / kFp8CacheBlock < last_block ? pos / kFp8CacheBlock : last_block;
    const int64_t bh = static_cast<int64_t>(b) * p.kv_heads + h;

    float* k_open = p.k_open + bh * kFp8CacheBlock * kHeadDim;
    float* v_open = p.v_open + bh * kFp8CacheBlock * kHeadDim;
    const T* kn = reinterpret_cast<const T*>(p.k_new) + b * p.kn_batch_stride + h * p.kn_head_stride;
    const T* vn = reinterpret_cast<const T*>(p.v_new) + b * p.vn_batch_stride + h * p.vn_head_stride;
    k_open[slot * kHeadDim + d] = to_float(kn[d]);
    v_open[slot * kHeadDim + d] = to_float(vn[d]);  // each thread reads back only its own column: no barrier

    float shift;
    if (block == 0) {
        shift = lower_median(k_open + d, kHeadDim, slot + 1);
        p.k_shift[bh * kHeadDim + d] = shift;
    } else {
        shift = p.k_shift[bh * kHeadDim + d];
    }
    const int64_t row0 = (bh * p.capacity + block * kFp8CacheBlock) * kHeadDim;
    const int64_t sblock = bh * (p.capacity / kFp8CacheBlock) + block;
    quantize_block<kHeadDim>(k_open, shift, slot, p.k_data + row0, p.k_scale + sblock, red);
    quantize_block<kHeadDim>(v_open, 0.f, slot, p.v_data + row0, p.v_scale + sblock, red);
    if (h == 0 && d == 0) p.used[b] = static_cast<int32_t>(pos + 1 < p.max_cache_len ? pos + 1 : p.max_cache_len);
}

template <typename T, int kHeadDim>
cudaError_t launch(const Fp8CacheAppendParams& p, cudaStream_t stream) {
    fp8_cache_append_kernel<T, kHeadDim><<<dim3(p.kv_heads, p.batch), kHeadDim, 0, stream>>>(p);
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

// The FP8 KV cache's one-token append kernel (fp8_cache_append.h says what it computes): fp8_cache_append.cu launches
// it in the AOT build, llm_attn/_nvrtc.py (fp8_cache_append) in the NVRTC one. One block per (KV head, batch) of
// kAppendThreads threads: each owns one channel in an eighth (head_dim 128) or a sixteenth (64) of the open block's
// slots; the block's amaxes (K's and V's) are one shared-memory reduction.
//
// Bit-exactness with kv_cache_reference.quantize under --use_fast_math: 1 / scale is __fdiv_rn, the products and
// the difference __fmul_rn / __fsub_rn (never contracted), and e4m3 is rounded by e4m3_rn_sat below (round to
// nearest even, saturating at 448, NaN kept), which is what torch's float32 -> float8_e4m3fn cast does after the
// reference's clamp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp8_cache_append.h"

namespace llm_attn {
namespace fp8cache {

constexpr float kE4m3Max = 448.f;
// float32(1 / 448), bits 0x3b124925: the scale is amax times it (kv_cache_reference.block_scales says why).
__device__ __forceinline__ float inv_e4m3_max() { return __uint_as_float(0x3b124925u); }

// float32 -> e4m3 (fn: no infinities, 0x7F NaN) bits, round to nearest even, |x| clamped to 448 first. Both
// encodings are computed and one is selected: no branch, so a warp whose lanes hold normal and subnormal values
// runs one path.
__device__ __forceinline__ uint8_t e4m3_rn_sat(float x) {
    const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80;
    const float a = fminf(fabsf(x), kE4m3Max);
    // below 2^-6: subnormal, steps of 2^-9 (a * 512 is exact; 8 rounds up to 2^-6 = 0x08)
    const int sub = __float2int_rn(__fmul_rn(a, 512.f));
    // normal: m = a 2^(3 - e) in [8, 16], exact; m = 16 carries into the exponent field ((e + 8) << 3 | 0)
    const int e = max(static_cast<int>((__float_as_uint(a) >> 23) & 0xFF) - 127, -6);  // -6 .. 8
    const int m = __float2int_rn(__fmul_rn(a, __int_as_float((130 - e) << 23)));
    const int normal = ((e + 7) << 3) + (m - 8);  // a <= 448 keeps it <= 0x7E
    const uint32_t bits = x != x ? 0x7Fu : static_cast<uint32_t>(a < 0.015625f ? sub : normal);
    return static_cast<uint8_t>(sign | bits);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<half>(half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// kAppendThreads threads per (KV head, batch): thread t owns channel t % D and the slots s = t / D + kGroups i of
// the open block (kGroups = 8 at head_dim 128, 16 at 64). A warp's 32 threads share their slots (D is a multiple
// of 32), so every branch on a slot is uniform.
// (One thread per channel walking all 64 slots in turn was ~11k dependent instructions a thread with one warp a
// scheduler: 32-55 us a launch, 1.0-1.8 ms of an 8B decode step; kernels/NOTES.md "The FP8 cache's append, spread
// over the block".)
constexpr int kAppendThreads = 1024;

// The lower median of channel d's values open[0 .. n) (n >= 1): the value whose rank in ascending order is
// (n - 1) / 2, ties counted (torch.median); x[0] where no value has that rank (NaNs rank as neither less nor equal).
// Where several slots have that rank (equal values, or +0 and -0) the last of them, as a walk over all slots in
// order keeps. The candidates are split over the kGroups slot groups; `last` (kAppendThreads) collects each group's.
template <int kHeadDim>
__device__ __forceinline__ float lower_median(const float* open, int n, int* last) {
    constexpr int kGroups = kAppendThreads / kHeadDim;
    const int d = threadIdx.x % kHeadDim, g = threadIdx.x / kHeadDim, k = (n - 1) / 2;
    int found = -1;
    for (int i = g; i < n; i += kGroups) {
        const float xi = open[i * kHeadDim + d];
        int less = 0, equal = 0;
        for (int j = 0; j < n; ++j) {
            const float xj = open[j * kHeadDim + d];
            less += xj < xi;
            equal += xj == xi;
        }
        if (less <= k && k < less + equal) found = i;
    }
    last[threadIdx.x] = found;
    __syncthreads();
    int at = 0;
#pragma unroll
    for (int h = 0; h < kGroups; ++h) at = max(at, last[h * kHeadDim + d]);
    return open[at * kHeadDim + d];
}

// The block's amax of two values at once (K's and V's): one pair of barriers for both operands.
__device__ __forceinline__ float2 block_amax2(float2 v, float2* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v.x = fmaxf(v.x, __shfl_xor_sync(0xffffffffu, v.x, o));
        v.y = fmaxf(v.y, __shfl_xor_sync(0xffffffffu, v.y, o));
    }
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float2 m = red[0];
#pragma unroll
    for (int w = 1; w < kAppendThreads / 32; ++w) m = make_float2(fmaxf(m.x, red[w].x), fmaxf(m.y, red[w].y));
    return m;
}

// A NaN anywhere makes torch's amax NaN, and then `amax > 0` is false: scale 1 (carried here as +inf, which no
// finite amax reaches).
__device__ __forceinline__ float amax_with_nan(float amax, float x) {
    return x != x ? INFINITY : fmaxf(amax, fabsf(x));
}
__device__ __forceinline__ float block_scale(float amax) {
    return amax > 0.f && amax != INFINITY ? __fmul_rn(amax, inv_e4m3_max()) : 1.f;
}

// Re-quantises the open block of both operands (column d of every slot the thread owns; slots past `slot` are
// zeros, written as e4m3 zeros without a conversion) into 64 rows of k_data / v_data and their scales. K is
// k_open - shift, V is v_open.
template <int kHeadDim>
__device__ __forceinline__ void quantize_blocks(const float* k_open, const float* v_open, float shift, int slot,
                                                uint8_t* k_data, uint8_t* v_data, float* k_scale, float* v_scale,
                                                float2* red) {
    constexpr int kGroups = kAppendThreads / kHeadDim, kSlots = kFp8CacheBlock / kGroups;
    const int d = threadIdx.x % kHeadDim, g = threadIdx.x / kHeadDim;
    float xk[kSlots], xv[kSlots];
    float2 amax = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
        const int s = g + kGroups * i;
        const bool in = s <= slot;
        xk[i] = in ? __fsub_rn(k_open[s * kHeadDim + d], shift) : 0.f;
        xv[i] = in ? v_open[s * kHeadDim + d] : 0.f;
        amax = make_float2(amax_with_nan(amax.x, xk[i]), amax_with_nan(amax.y, xv[i]));
    }
    amax = block_amax2(amax, red);
    const float ks = block_scale(amax.x), vs = block_scale(amax.y);
    const float kinv = __fdiv_rn(1.f, ks), vinv = __fdiv_rn(1.f, vs);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
        const int s = g + kGroups * i;
        const bool in = s <= slot;
        k_data[s * kHeadDim + d] = in ? e4m3_rn_sat(__fmul_rn(xk[i], kinv)) : uint8_t{0};
        v_data[s * kHeadDim + d] = in ? e4m3_rn_sat(__fmul_rn(xv[i], vinv)) : uint8_t{0};
    }
    if (threadIdx.x == 0) *k_scale = ks, *v_scale = vs;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kAppendThreads) fp8_cache_append_kernel(const Fp8CacheAppendParams p) {
    constexpr int kGroups = kAppendThreads / kHeadDim;
    __shared__ float2 red[kAppendThreads / 32];
    __shared__ int last[kAppendThreads];
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x % kHeadDim, g = threadIdx.x / kHeadDim;
    const int64_t pos = *p.position;
    const int slot = static_cast<int>(pos % kFp8CacheBlock);
    const int64_t last_block = p.capacity / kFp8CacheBlock - 1;
    const int64_t block = pos / kFp8CacheBlock < last_block ? pos / kFp8CacheBlock : last_block;
    const int64_t bh = static_cast<int64_t>(b) * p.kv_heads + h;

    float* k_open = p.k_open + bh * kFp8CacheBlock * kHeadDim;
    float* v_open = p.v_open + bh * kFp8CacheBlock * kHeadDim;
    if (g == slot % kGroups) {  // the token's slot belongs to this group: only its threads read it back
        const T* kn = reinterpret_cast<const T*>(p.k_new) + b * p.kn_batch_stride + h * p.kn_head_stride;
        const T* vn = reinterpret_cast<const T*>(p.v_new) + b * p.vn_batch_stride + h * p.vn_head_stride;
        k_open[slot * kHeadDim + d] = to_float(kn[d]);
        v_open[slot * kHeadDim + d] = to_float(vn[d]);
    }

    float shift;
    if (block == 0) {  // K's shift follows block 0 while it is open: every group reads every slot of its channel
        __syncthreads();
        shift = lower_median<kHeadDim>(k_open, slot + 1, last);
        if (g == 0) p.k_shift[bh * kHeadDim + d] = shift;
    } else {
        shift = p.k_shift[bh * kHeadDim + d];
    }
    const int64_t row0 = (bh * p.capacity + block * kFp8CacheBlock) * kHeadDim;
    const int64_t sblock = bh * (p.capacity / kFp8CacheBlock) + block;
    quantize_blocks<kHeadDim>(k_open, v_open, shift, slot, p.k_data + row0, p.v_data + row0, p.k_scale + sblock,
                              p.v_scale + sblock, red);
    if (h == 0 && threadIdx.x == 0) {
        p.used[b] = static_cast<int32_t>(pos + 1 < p.max_cache_len ? pos + 1 : p.max_cache_len);
    }
}

}  // namespace fp8cache
}  // namespace llm_attn

// The FP8 forward's quantising pre-pass (flash_fp8.h says what it computes): three kernels, all memory-bound, each
// reading its bf16/fp16 input once in 16-byte chunks.
//   fp8_kv_stats_kernel   K's channel sums and V's channel amax over the valid keys (float atomics into `stats`)
//   fp8_quant_q_kernel    Q -> e4m3 (or int8, kQkInt8), one scale per row
//   fp8_quant_kv_kernel   128 keys per block: K - mean -> e4m3 or int8 (one scale per 64 keys; 32 without V^T),
//                         V -> e4m3 transposed (one scale per channel), key-permuted for the kernel's P registers
// With P V in the input dtype (the kernel's kPvInput) V is not touched: kStatsV / kWriteV false skip its amax and its
// e4m3 V^T, and the kernel reads the caller's V.
// Keys at or past a batch's valid length (seqused_k) may hold anything (NaN in an unused cache slot): they are never
// read into a statistic and are written as zeros.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "flash_fp8.h"
#include "hopper_fp8.cuh"

namespace llm_attn {
namespace fp8 {

constexpr float kE4m3Max = 448.f;
constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void load8(float (&x)[8], const T* src) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(w[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ int valid_keys(const FlashFwdParams& p, int batch) {
    return p.seqused_k ? max(0, min(p.seqused_k[batch], p.seqlen_k)) : p.seqlen_k;
}

// Max over the block's threads of each of N non-negative values, in place (every thread gets them).
template <int N>
__device__ __forceinline__ void block_max(float (&v)[N], float (&red)[N][kThreads / 32]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v[i] = fmaxf(v[i], __shfl_xor_sync(0xffffffff, v[i], o));
        if (threadIdx.x % 32 == 0) red[i][threadIdx.x / 32] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
        v[i] = red[i][0];
#pragma unroll
        for (int w = 1; w < kThreads / 32; ++w) v[i] = fmaxf(v[i], red[i][w]);
    }
}

// The scale of a block whose largest magnitude is amax (1 for an all-zero block, so that 0 / scale stays 0).
__device__ __forceinline__ float e4m3_scale(float amax) { return amax > 0.f ? amax / kE4m3Max : 1.f; }

// Q and K: e4m3 (scale amax / 448), or int8 for the INT8 S = Q K^T (kQkInt8: scale amax / 127, round to nearest
// even). V is e4m3 either way.
template <bool kQkInt8>
__device__ __forceinline__ float qk_scale(float amax) { return amax > 0.f ? amax / (kQkInt8 ? 127.f : kE4m3Max) : 1.f; }
template <bool kQkInt8>
__device__ __forceinline__ uint32_t pack4_qk(float a, float b, float c, float d) {
    return kQkInt8 ? sm90::pack4_s8(a, b, c, d) : sm90::pack4_e4m3(a, b, c, d);
}

// grid (ceil(seqlen_k / kRows), num_kv_heads, batch). stats: (2, batch, kv_heads, D) zeroed; sums, then amax bits.
template <typename T, int kHeadDim, bool kStatsV = true>
__global__ void __launch_bounds__(kThreads) fp8_kv_stats_kernel(const FlashFwdFp8Params params) {
    constexpr int kChunks = kHeadDim / 8, kRowStep = kThreads / kChunks, kRows = 512;
    const FlashFwdParams& p = params.p;
    const int b = blockIdx.z, h = blockIdx.y, c = threadIdx.x % kChunks;
    const int kv_len = valid_keys(p, b);
    __shared__ float sum_s[kHeadDim];
    __shared__ unsigned amax_s[kHeadDim];
    if (threadIdx.x < kHeadDim) sum_s[threadIdx.x] = 0.f, amax_s[threadIdx.x] = 0u;
    __syncthreads();
    float sum[8] = {}, amax[8] = {};
    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h * p.k_head_stride + c * 8;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride + c * 8;
    const int end = min(kv_len, (blockIdx.x + 1) * kRows);
    for (int key = blockIdx.x * kRows + threadIdx.x / kChunks; key < end; key += kRowStep) {
        float x[8];
        load8<T>(x, k + key * p.k_row_stride);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] += x[i];
        if constexpr (kStatsV) {
            float y[8];
            load8<T>(y, v + key * p.v_row_stride);
#pragma unroll
            for (int i = 0; i < 8; ++i) amax[i] = fmaxf(amax[i], fabsf(y[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        atomicAdd(&sum_s[c * 8 + i], sum[i]);
        if constexpr (kStatsV) atomicMax(&amax_s[c * 8 + i], __float_as_uint(amax[i]));  // non-negative floats order as their bits
    }
    __syncthreads();
    if (threadIdx.x < kHeadDim) {
        const int64_t i = (static_cast<int64_t>(b) * p.num_kv_heads + h) * kHeadDim + threadIdx.x;
        const int64_t n = static_cast<int64_t>(p.batch) * p.num_kv_heads * kHeadDim;
        atomicAdd(&params.stats[i], sum_s[threadIdx.x]);
        if constexpr (kStatsV) atomicMax(reinterpret_cast<unsigned*>(params.stats + n) + i, amax_s[threadIdx.x]);
    }
}

// grid (ceil(seqlen_q / kFp8QBlock), num_heads, batch). One scale per row: a row's amax over its head_dim values,
// reduced across the row's kChunks lanes (consecutive lanes of one warp). Per-row scales put a peaky row's int8
// step at amax / 127 of its own 128 values rather than of its block's 8192 (relative L1 on peaky rows ~0.87x,
// kernels/NOTES.md "per-row Q scales"); the kernel reads two a thread, before its loop.
template <typename T, int kHeadDim, bool kQkInt8 = false>
__global__ void __launch_bounds__(kThreads) fp8_quant_q_kernel(const FlashFwdFp8Params params) {
    constexpr int kChunks = kHeadDim / 8, kRowStep = kThreads / kChunks, kIters = kFp8QBlock / kRowStep;
    const FlashFwdParams& p = params.p;
    const int b = blockIdx.z, h = blockIdx.y, c = threadIdx.x % kChunks, blk = blockIdx.x;
    float x[kIters][8], inv[kIters];
    const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + c * 8;
    const int64_t bh = static_cast<int64_t>(b) * p.num_heads + h;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int row = blk * kFp8QBlock + it * kRowStep + threadIdx.x / kChunks;
        if (row < p.seqlen_q) {
            load8<T>(x[it], q + row * p.q_row_stride);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) x[it][i] = 0.f;
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[it][i]));
#pragma unroll
        for (int o = kChunks / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        const float scale = qk_scale<kQkInt8>(amax);
        inv[it] = 1.f / scale;
        if (c == 0 && row < p.seqlen_q) params.q_scale[bh * p.seqlen_q + row] = scale;
    }
    // q . mean(K) of each row (the smoothing's shift of its scores, for its lse).
    const int kv_len = valid_keys(p, b);
    const int64_t bkv = static_cast<int64_t>(b) * p.num_kv_heads + h / (p.num_heads / p.num_kv_heads);
    float mean[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) mean[i] = kv_len > 0 ? params.stats[bkv * kHeadDim + c * 8 + i] / kv_len : 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(x[it][i], mean[i], dot);
#pragma unroll
        for (int o = kChunks / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
        const int row = blk * kFp8QBlock + it * kRowStep + threadIdx.x / kChunks;
        if (c == 0 && row < p.seqlen_q) params.q_dot_kmean[bh * p.seqlen_q + row] = dot;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int row = blk * kFp8QBlock + it * kRowStep + threadIdx.x / kChunks;
        if (row >= p.seqlen_q) continue;
        const float s = inv[it];
        uint2 out;
        out.x = pack4_qk<kQkInt8>(x[it][0] * s, x[it][1] * s, x[it][2] * s, x[it][3] * s);
        out.y = pack4_qk<kQkInt8>(x[it][4] * s, x[it][5] * s, x[it][6] * s, x[it][7] * s);
        *reinterpret_cast<uint2*>(params.q8 + (bh * p.seqlen_q + row) * kHeadDim + c * 8) = out;
    }
}

// The key that V^T's position j of a 16-key group holds: the P registers of thread t cover keys 2t, 2t+1, 8+2t,
// 9+2t of each 16 (two n8 accumulator blocks), which the fp8 A operand reads as k = 4t .. 4t+3.
__device__ __forceinline__ int vt_key_of_position(int j) { return (j & 3) < 2 ? 2 * (j >> 2) + (j & 3) : 6 + 2 * (j >> 2) + (j & 3); }

// grid (seqlen_k_pad / kFp8KvChunk, num_kv_heads, batch). Reads `stats` (complete: the stats kernel ran before).
// Iteration `it` of a thread reads key it * kRowStep + threadIdx.x / kChunks: iterations [0, kIters / 2) cover the
// block's first 64 keys (K scale 2 blk), the rest its second 64 (2 blk + 1, written if the keys reach it).
template <typename T, int kHeadDim, bool kQkInt8 = false, bool kWriteV = true>
__global__ void __launch_bounds__(kThreads) fp8_quant_kv_kernel(const FlashFwdFp8Params params) {
    constexpr int kChunks = kHeadDim / 8, kRowStep = kThreads / kChunks, kIters = kFp8KvChunk / kRowStep;
    constexpr int kKBlock = fp8_k_block(/*pv_input=*/!kWriteV);  // no V^T exactly when P V runs in the input dtype
    constexpr int kScales = kFp8KvChunk / kKBlock, kItersPerScale = kIters / kScales;
    static_assert(kFp8KvChunk % kKBlock == 0 && kKBlock % kRowStep == 0, "whole scale blocks per iteration");
    constexpr int kPitch = kHeadDim + 16;  // V bytes of a key in shared memory, padded against bank conflicts
    const FlashFwdParams& p = params.p;
    const int b = blockIdx.z, h = blockIdx.y, c = threadIdx.x % kChunks, blk = blockIdx.x;
    const int kv_len = valid_keys(p, b);
    const int pad = fp8_seqlen_k_pad(p.seqlen_k);
    const int64_t bh = static_cast<int64_t>(b) * p.num_kv_heads + h;
    const int64_t n_stats = static_cast<int64_t>(p.batch) * p.num_kv_heads * kHeadDim;
    __shared__ float red[kScales][kThreads / 32];
    __shared__ __align__(16) uint8_t v_s[kWriteV ? kFp8KvChunk * kPitch : 16];

    float mean[8], v_inv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        mean[i] = kv_len > 0 ? params.stats[bh * kHeadDim + c * 8 + i] / kv_len : 0.f;
        if constexpr (kWriteV) {
            v_inv[i] = 1.f / e4m3_scale(__uint_as_float(reinterpret_cast<const unsigned*>(params.stats + n_stats)[bh * kHeadDim + c * 8 + i]));
        }
    }
    if (kWriteV && blk == 0 && threadIdx.x < kHeadDim) {
        params.v_scale[bh * kHeadDim + threadIdx.x] =
            e4m3_scale(__uint_as_float(reinterpret_cast<const unsigned*>(params.stats + n_stats)[bh * kHeadDim + threadIdx.x]));
    }

    const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h * p.k_head_stride + c * 8;
    const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride + c * 8;
    float x[kIters][8];
    float amax[kScales] = {};
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int r = it * kRowStep + threadIdx.x / kChunks, key = blk * kFp8KvChunk + r;
        float y[8];
        if (key < kv_len) {
            load8<T>(x[it], k + key * p.k_row_stride);
            if constexpr (kWriteV) load8<T>(y, v + key * p.v_row_stride);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) x[it][i] = mean[i], y[i] = 0.f;  // K row becomes exactly 0 after smoothing
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            x[it][i] -= mean[i];
            amax[it / kItersPerScale] = fmaxf(amax[it / kItersPerScale], fabsf(x[it][i]));
        }
        if constexpr (kWriteV) {
            uint2 vq;
            vq.x = sm90::pack4_e4m3(y[0] * v_inv[0], y[1] * v_inv[1], y[2] * v_inv[2], y[3] * v_inv[3]);
            vq.y = sm90::pack4_e4m3(y[4] * v_inv[4], y[5] * v_inv[5], y[6] * v_inv[6], y[7] * v_inv[7]);
            *reinterpret_cast<uint2*>(v_s + r * kPitch + c * 8) = vq;
        }
    }
    block_max(amax, red);  // its barrier also orders v_s
    const int k_blocks = (p.seqlen_k + kKBlock - 1) / kKBlock;
    float inv[kScales];
#pragma unroll
    for (int s = 0; s < kScales; ++s) {
        const float scale = qk_scale<kQkInt8>(amax[s]);
        inv[s] = 1.f / scale;
        if (threadIdx.x == 0 && blk * kScales + s < k_blocks) params.k_scale[bh * k_blocks + blk * kScales + s] = scale;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int key = blk * kFp8KvChunk + it * kRowStep + threadIdx.x / kChunks;
        if (key >= p.seqlen_k) continue;
        const float iv = inv[it / kItersPerScale];
        uint2 out;
        out.x = pack4_qk<kQkInt8>(x[it][0] * iv, x[it][1] * iv, x[it][2] * iv, x[it][3] * iv);
        out.y = pack4_qk<kQkInt8>(x[it][4] * iv, x[it][5] * iv, x[it][6] * iv, x[it][7] * iv);
        *reinterpret_cast<uint2*>(params.k8 + (bh * p.seqlen_k + key) * kHeadDim + c * 8) = out;
    }
    if constexpr (!kWriteV) return;
    // V^T: thread -> (channel d, group of 16 keys); 16 bytes out, consecutive threads along the keys of one channel.
    constexpr int kGroups = kFp8KvChunk / 16;
#pragma unroll
    for (int o = threadIdx.x; o < kHeadDim * kGroups; o += kThreads) {
        const int d = o / kGroups, g = o % kGroups;
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t word = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e)
                word |= static_cast<uint32_t>(v_s[(g * 16 + vt_key_of_position(4 * q + e)) * kPitch + d]) << (8 * e);
            w[q] = word;
        }
        *reinterpret_cast<uint4*>(params.vt8 + (bh * kHeadDim + d) * pad + blk * kFp8KvChunk + g * 16) =
            make_uint4(w[0], w[1], w[2], w[3]);
    }
}

}  // namespace fp8
}  // namespace llm_attn

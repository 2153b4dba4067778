// The INT8 forward's quantising pre-pass (flash_int8.h says what it computes): two memory-bound kernels, each reading
// its fp16/bf16 input once in 16-byte chunks. Deterministic: no atomics, so nothing to zero before the launch.
//   int8_kv_stats_kernel   per chunk of keys of a (batch, KV head): K's channel sums and (fp8_pv) V's channel amax
//                          over the valid keys, as partials in `stats`
//   int8_quant_kv_kernel   per 128-key tile: reduces the partials (the mean, V's scale), K - mean -> int8 with one
//                          scale per tile, and (fp8_pv) V -> e4m3 transposed and key-permuted
// Q is quantised inside the attention kernel (flash_fwd_int8_kernel.cuh): its block loads Q once anyway.
// Keys at or past a batch's valid length (seqused_k) may hold anything (NaN in an unused cache slot): they are never
// read into a statistic, and inside the last valid tile they are written as zeros. Tiles wholly past the valid keys
// are not written at all: the attention kernel never visits them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "flash_int8.h"
#include "ptx.cuh"

namespace llm_attn {
namespace int8fwd {

constexpr int kQuantThreads = 256;
constexpr float kE4m3Max = 448.f;

// Eight consecutive elements (one 16-byte chunk) as floats.
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

__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ int valid_keys(const FlashFwdInt8Params& p, int batch) {
    return p.seqused_k ? max(0, min(p.seqused_k[batch], p.seqlen_k)) : p.seqlen_k;
}

// Four ints in [-127, 127] -> four int8 bytes, a in the lowest.
__device__ __forceinline__ uint32_t pack4_s8(int a, int b, int c, int d) {
    return (static_cast<uint32_t>(a) & 0xffu) | ((static_cast<uint32_t>(b) & 0xffu) << 8) |
           ((static_cast<uint32_t>(c) & 0xffu) << 16) | (static_cast<uint32_t>(d) << 24);
}

// Four floats -> four e4m3 bytes (round to nearest even, saturating at +-448), a in the lowest. cuda_fp8.h: one cvt
// per pair from sm_89, emulated below (this kernel is built for every arch; it runs only when fp8_pv is set).
__device__ __forceinline__ uint32_t pack4_e4m3_any(float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}

// The position of key k (0..15) inside its 16-key group of the transposed V: the P fragment of mma.m16n8k32 holds,
// in the 4 bytes of thread t (k = 4t .. 4t+3), the S accumulator columns 2t, 2t+1 of two adjacent n8 tiles, i.e.
// keys 2t, 2t+1, 8+2t, 9+2t. Positions 4t+i hold those keys, so a V^T row's bytes 4t..4t+3 are the matching B
// fragment (flash_fwd_int8_kernel.cuh, pv_fp8). Key of position j: j < 16 -> {2t, 2t+1, 8+2t, 9+2t}[i], j = 4t+i.
__host__ __device__ constexpr int int8_v_key_of_position(int j) { return 2 * (j >> 2) + (j & 1) + ((j & 2) << 2); }

// Max over the block's threads of each of N non-negative values (every thread gets them).
template <int N>
__device__ __forceinline__ void block_max(float (&v)[N], float (&red)[N][kQuantThreads / 32]) {
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
        for (int w = 1; w < kQuantThreads / 32; ++w) v[i] = fmaxf(v[i], red[i][w]);
    }
}

// grid (int8_stat_chunks(seqlen_k), batch * num_kv_heads). Thread tid sums chunk tid % kChunks (8 channels) of rows
// tid / kChunks + i * kRowStep of its chunk of keys; the block then reduces the kRowStep partial rows per channel.
// stats[bh][chunk][0][c] = sum of K[key][c], stats[bh][chunk][1][c] = max |V[key][c]| (kVStats), keys valid only.
template <typename T, int kHeadDim, bool kVStats>
__global__ void __launch_bounds__(kQuantThreads, 2) int8_kv_stats_kernel(const FlashFwdInt8Params p) {
    constexpr int kChunks = kHeadDim / 8, kRowStep = kQuantThreads / kChunks;
    __shared__ float red_sum[kRowStep][kHeadDim];
    __shared__ float red_max[kVStats ? kRowStep : 1][kHeadDim];
    const int tid = threadIdx.x;
    const int bh = blockIdx.y;
    const int batch = bh / p.num_kv_heads, kv_head = bh % p.num_kv_heads;
    const int used = valid_keys(p, batch);
    const int chunk_keys = int8_stat_chunk_keys(p.seqlen_k);
    const int key0 = blockIdx.x * chunk_keys;
    const int key1 = min(key0 + chunk_keys, used);
    const int col = tid % kChunks, r = tid / kChunks;
    const T* kp = reinterpret_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride + col * 8;
    const T* vp = reinterpret_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride + col * 8;
    float sum[8] = {}, amax[8] = {};
#pragma unroll 4
    for (int key = key0 + r; key < key1; key += kRowStep) {
        float x[8];
        load8(x, kp + key * p.k_row_stride);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] += x[i];
        if constexpr (kVStats) {
            load8(x, vp + key * p.v_row_stride);
#pragma unroll
            for (int i = 0; i < 8; ++i) amax[i] = fmaxf(amax[i], fabsf(x[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        red_sum[r][col * 8 + i] = sum[i];
        if constexpr (kVStats) red_max[r][col * 8 + i] = amax[i];
    }
    __syncthreads();
    float* out = p.stats + (static_cast<int64_t>(bh) * int8_stat_chunks(p.seqlen_k) + blockIdx.x) * 2 * kHeadDim;
    for (int c = tid; c < kHeadDim; c += kQuantThreads) {
        float s = 0.f, m = 0.f;
#pragma unroll
        for (int i = 0; i < kRowStep; ++i) {
            s += red_sum[i][c];
            if constexpr (kVStats) m = fmaxf(m, red_max[i][c]);
        }
        out[c] = s;
        if constexpr (kVStats) out[kHeadDim + c] = m;
    }
}

// grid (seqlen_k_pad / kInt8BlockN, batch * num_kv_heads): one 128-key tile of one (batch, KV head), its K scales
// one per kInt8KBlock keys (iterations [g kItersPerScale, (g + 1) kItersPerScale) of a thread cover group g).
template <typename T, int kHeadDim, bool kFp8V>
__global__ void __launch_bounds__(kQuantThreads, 2) int8_quant_kv_kernel(const FlashFwdInt8Params p) {
    constexpr int kTile = kInt8BlockN;
    constexpr int kChunks = kHeadDim / 8, kRowStep = kQuantThreads / kChunks, kIters = kTile / kRowStep;
    constexpr int kScales = kTile / kInt8KBlock, kItersPerScale = kIters / kScales;
    static_assert(kTile % kRowStep == 0, "the tile's rows divide among the threads");
    static_assert(kTile % kInt8KBlock == 0 && kInt8KBlock % kRowStep == 0, "whole scale blocks per iteration");
    __shared__ float s_mean[kHeadDim];
    __shared__ float s_vinv[kFp8V ? kHeadDim : 1];
    __shared__ float s_red[kScales][kQuantThreads / 32];
    __shared__ __align__(16) T s_v[kFp8V ? kTile : 1][kHeadDim];  // V's tile, rows of keys, for the transpose

    const int tid = threadIdx.x;
    const int bh = blockIdx.y;
    const int batch = bh / p.num_kv_heads, kv_head = bh % p.num_kv_heads;
    const int used = valid_keys(p, batch);
    const int seqlen_k_pad = int8_seqlen_k_pad(p.seqlen_k);
    const int key0 = blockIdx.x * kTile;

    // The statistics of the whole (batch, KV head): every tile reduces the (at most kInt8MaxStatChunks) partials
    // itself; tile 0 also publishes them for the attention kernel (mean: the lse correction; v_scale: the epilogue).
    const int n_chunks = int8_stat_chunks(p.seqlen_k);
    const float* st = p.stats + static_cast<int64_t>(bh) * n_chunks * 2 * kHeadDim;
    for (int c = tid; c < kHeadDim; c += kQuantThreads) {
        float s = 0.f, m = 0.f;
        for (int i = 0; i < n_chunks; ++i) {
            s += st[i * 2 * kHeadDim + c];
            if constexpr (kFp8V) m = fmaxf(m, st[i * 2 * kHeadDim + kHeadDim + c]);
        }
        const float mean = used > 0 ? __fdiv_rn(s, static_cast<float>(used)) : 0.f;
        s_mean[c] = mean;
        if constexpr (kFp8V) s_vinv[c] = m > 0.f ? __fdiv_rn(kE4m3Max, m) : 0.f;
        if (blockIdx.x == 0) {
            p.k_mean[static_cast<int64_t>(bh) * kHeadDim + c] = mean;
            if constexpr (kFp8V) p.v_scale[static_cast<int64_t>(bh) * kHeadDim + c] = __fdiv_rn(m, kE4m3Max);
        }
    }
    __syncthreads();
    if (key0 >= used) return;  // never visited by the attention kernel (block-uniform)

    const int col = tid % kChunks, r = tid / kChunks;
    // K - mean over the tile (invalid keys: 0), its amax, then int8.
    {
        const T* kp = reinterpret_cast<const T*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride + col * 8;
        float x[kIters][8];
        float amax[kScales] = {};
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int key = key0 + r + it * kRowStep;
            if (key < used) {
                load8(x[it], kp + key * p.k_row_stride);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    x[it][i] -= s_mean[col * 8 + i];
                    amax[it / kItersPerScale] = fmaxf(amax[it / kItersPerScale], fabsf(x[it][i]));
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) x[it][i] = 0.f;
            }
        }
        block_max(amax, s_red);
        float inv[kScales];
#pragma unroll
        for (int s = 0; s < kScales; ++s) inv[s] = amax[s] > 0.f ? __fdiv_rn(127.f, amax[s]) : 0.f;
        int8_t* kq = p.k_int8 + (static_cast<int64_t>(bh) * seqlen_k_pad + key0 + r) * kHeadDim + col * 8;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            int q[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = __float2int_rn(x[it][i] * inv[it / kItersPerScale]);
            *reinterpret_cast<uint2*>(kq + it * kRowStep * kHeadDim) =
                make_uint2(pack4_s8(q[0], q[1], q[2], q[3]), pack4_s8(q[4], q[5], q[6], q[7]));
        }
        if (tid == 0) {
#pragma unroll
            for (int s = 0; s < kScales; ++s) {
                p.k_scale[static_cast<int64_t>(bh) * (seqlen_k_pad / kInt8KBlock) + blockIdx.x * kScales + s] =
                    __fdiv_rn(amax[s], 127.f);
            }
        }
    }

    if constexpr (kFp8V) {
        // V's tile into shared memory as it is (invalid keys: 0), then each thread makes one 16-key run of one
        // channel: 16 e4m3 bytes in the permuted order, one 16-byte store. Lanes take consecutive channels, so
        // their shared-memory reads are conflict-free.
        const T* vp = reinterpret_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride + col * 8;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int row = r + it * kRowStep;
            const int key = key0 + row;
            *reinterpret_cast<uint4*>(&s_v[row][col * 8]) =
                key < used ? *reinterpret_cast<const uint4*>(vp + key * p.v_row_stride) : make_uint4(0, 0, 0, 0);
        }
        __syncthreads();
        uint8_t* vq = p.v_fp8 + (static_cast<int64_t>(bh) * (seqlen_k_pad / kTile) + blockIdx.x) * kHeadDim * kTile;
        constexpr int kRuns = kHeadDim * (kTile / 16);
        static_assert(kRuns % kQuantThreads == 0, "the 16-key runs divide among the threads");
#pragma unroll
        for (int it = 0; it < kRuns / kQuantThreads; ++it) {
            const int idx = it * kQuantThreads + tid;
            const int c = idx % kHeadDim, run = idx / kHeadDim;
            const float inv = s_vinv[c];
            float f[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) f[k] = to_float(s_v[run * 16 + k][c]) * inv;
            uint32_t w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                w[j] = pack4_e4m3_any(f[int8_v_key_of_position(4 * j)], f[int8_v_key_of_position(4 * j + 1)],
                                      f[int8_v_key_of_position(4 * j + 2)], f[int8_v_key_of_position(4 * j + 3)]);
            *reinterpret_cast<uint4*>(vq + c * kTile + run * 16) =
                make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

}  // namespace int8fwd
}  // namespace llm_attn

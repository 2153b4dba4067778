// Split-KV decode kernel (flash-decoding) for small q_len, GQA packed.
//
// Decode has one (or a few) query rows per sequence, so a prefill-style grid leaves the GPU idle and a per-head
// grid reads every K/V head once per query head. Here one block owns (batch, KV head, KV split):
//  - its M dimension packs the query heads that share the KV head with the q_len rows: row r is query head
//    kv_head * G + r % G at query position r / G (G = heads per KV head). 4 query heads x q_len 1..4 = one m16
//    tile (kMTiles = 1); up to 32 rows with kMTiles = 2. K/V are read once per KV head.
//  - the split's key tiles (64 keys) stream through a kStages-deep cp.async pipeline;
//  - the 4 warps split each tile's keys (16 each: for decode, keys are the only parallel dimension), each with its
//    own online softmax; at the end the warps' states are merged through shared memory.
// Output: with one split, O (and lse) directly; otherwise float32 partials, merged in the same launch by the last
// block of each (batch, KV head) to finish (a counter per (batch, KV head), zero on entry and left zero on exit).
// The number of splits comes from the host (flash_fwd_num_splits); each block derives its key range from the
// batch's own valid length (seqused_k) on the device, so no host synchronisation is needed and a captured CUDA
// graph stays valid as the cache grows.
#pragma once

#include "combine.cuh"
#include "flash.h"
#include "mma_frag.cuh"
#include "ptx.cuh"
#include "smem_tile.cuh"
#include "softmax.cuh"

namespace llm_attn {

template <int kHeadDim_, int kMTiles_, int kStages_>
struct DecodeTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kMTiles = kMTiles_;
    static constexpr int kRows = 16 * kMTiles;
    static constexpr int kStages = kStages_;
    static constexpr int kNWarps = 4;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kBlockN = 16 * kNWarps;   // keys per tile, 16 per warp
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kSmemQ = kRows * kHeadDim;
    static constexpr int kSmemKV = kBlockN * kHeadDim;
    static constexpr int kSmemBytes = (kSmemQ + 2 * kStages * kSmemKV) * 2;
    // The warp merge reuses the K/V stages as a float32 [warps][rows][head_dim] buffer.
    static_assert(kNWarps * kRows * kHeadDim * 4 <= 2 * kStages * kSmemKV * 2, "merge buffer must fit in K/V smem");
    static_assert(kStages >= 2, "need at least double buffering");
    static_assert((kBlockN * kChunks) % kThreads == 0, "tile copy must divide evenly among threads");
    static_assert(kThreads / kChunks % 8 == 0, "row step must keep the swizzle phase fixed");
};

template <typename T, typename Traits>
__device__ __forceinline__ void flash_decode_body(const FlashFwdParams& params) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kMT = Traits::kMTiles;
    constexpr int kRows = Traits::kRows;
    constexpr int kStages = Traits::kStages;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kDT = kHeadDim / 8;
    constexpr int kKQ = kHeadDim / 16;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Traits::kSmemQ;                 // [kStages][kBlockN][kHeadDim]
    T* sV = sK + kStages * Traits::kSmemKV;      // [kStages][kBlockN][kHeadDim]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int split = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int group = params.num_heads / params.num_kv_heads;
    const int seqlen_q = params.seqlen_q;
    const int num_rows = group * seqlen_q;  // <= kRows (checked by the dispatcher)
    const int seqlen_k = params.seqused_k ? min(params.seqused_k[batch], params.seqlen_k) : params.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;

    const int n_tiles = (seqlen_k + kBlockN - 1) / kBlockN;
    const int per_split = (n_tiles + params.num_splits - 1) / params.num_splits;
    const int tile_begin = split * per_split;
    const int tile_end = min(n_tiles, tile_begin + per_split);
    const int num_tiles = max(tile_end - tile_begin, 0);

    const T* k_ptr = reinterpret_cast<const T*>(params.k) + batch * params.k_batch_stride + kv_head * params.k_head_stride;
    const T* v_ptr = reinterpret_cast<const T*>(params.v) + batch * params.v_batch_stride + kv_head * params.v_head_stride;

    auto load_kv = [&](int tile, int stage) {
        const int kv = tile * kBlockN;
        load_tile_async<Traits, kBlockN>(sK + stage * Traits::kSmemKV, k_ptr + kv * params.k_row_stride,
                                         params.k_row_stride, seqlen_k - kv, tid);
        load_tile_async<Traits, kBlockN>(sV + stage * Traits::kSmemKV, v_ptr + kv * params.v_row_stride,
                                         params.v_row_stride, seqlen_k - kv, tid);
    };

    // Q rows gathered from the group's heads (per-row addresses: rows are not one stride apart).
    {
        const T* q_base = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride;
        for (int idx = tid; idx < kRows * Traits::kChunks; idx += Traits::kThreads) {
            const int r = idx / Traits::kChunks, c = idx % Traits::kChunks;
            const bool ok = r < num_rows;
            const T* src = ok ? q_base + (kv_head * group + r % group) * params.q_head_stride +
                                    static_cast<int64_t>(r / group) * params.q_row_stride + c * 8
                              : q_base;
            cp_async_16(sQ + swz<kHeadDim>(r, c), src, ok);
        }
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_tiles) load_kv(tile_begin + s, s);
        cp_async_commit();  // always commit: keeps the group count uniform for cp_async_wait
    }

    SoftmaxState<kMT, kDT> st;
    st.init();
    // One m16 tile of Q stays in registers; with two, Q is re-read from shared memory per k-step (64 more
    // registers would spill next to the 128 of the O accumulators).
    constexpr bool kQInRegs = kMT == 1;
    uint32_t q_frag[kQInRegs ? kMT : 1][kQInRegs ? kKQ : 1][4];
    const float scale_log2 = params.scale_log2;

    for (int i = 0; i < num_tiles; ++i) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile i visible to all; everyone is done with the stage about to be refilled
        if constexpr (kQInRegs) {
            if (i == 0) {
#pragma unroll
                for (int kk = 0; kk < kKQ; ++kk)
                    ldmatrix_x4(q_frag[0][kk], sQ + swz<kHeadDim>(lane % 16, kk * 2 + lane / 16));
            }
        }
        if (i + kStages - 1 < num_tiles) load_kv(tile_begin + i + kStages - 1, (i + kStages - 1) % kStages);
        cp_async_commit();

        const int stage = i % kStages;
        const T* cK = sK + stage * Traits::kSmemKV + warp * 16 * kHeadDim;  // this warp's 16 keys
        const T* cV = sV + stage * Traits::kSmemKV + warp * 16 * kHeadDim;
        const int key0 = (tile_begin + i) * kBlockN + warp * 16;

        float acc_s[kMT][2][4];
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int n = 0; n < 2; ++n) acc_s[m][n][0] = acc_s[m][n][1] = acc_s[m][n][2] = acc_s[m][n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKQ; ++kk) {
            uint32_t b[4];
            // Rows of this warp's slice are 16-aligned in the tile, so (row & 7) is unchanged: same swizzle.
            ldmatrix_x4(b, cK + swz<kHeadDim>((lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2));
#pragma unroll
            for (int m = 0; m < kMT; ++m) {
                if constexpr (kQInRegs) {
                    mma_16816<T>(acc_s[m][0], q_frag[m][kk], b[0], b[1]);
                    mma_16816<T>(acc_s[m][1], q_frag[m][kk], b[2], b[3]);
                } else {
                    uint32_t qa[4];
                    ldmatrix_x4(qa, sQ + swz<kHeadDim>(m * 16 + lane % 16, kk * 2 + lane / 16));
                    mma_16816<T>(acc_s[m][0], qa, b[0], b[1]);
                    mma_16816<T>(acc_s[m][1], qa, b[2], b[3]);
                }
            }
        }
        // Mask keys past the end, and (causal, q_len > 1) keys after each row's position.
        if (key0 + 16 > seqlen_k || (params.causal && key0 + 15 > causal_offset)) {
#pragma unroll
            for (int m = 0; m < kMT; ++m)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    // Last key this row may see: its query position's diagonal, or the last valid key.
                    const int limit = params.causal ? min((m * 16 + g + 8 * r) / group + causal_offset, seqlen_k - 1)
                                                    : seqlen_k - 1;
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (key0 + n * 8 + 2 * t + e > limit) acc_s[m][n][2 * r + e] = -INFINITY;
                }
        }
        st.update(acc_s, scale_log2);
        uint32_t a[kMT][4];
        p_fragment<T>(a, acc_s, 0);
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, cV + swz<kHeadDim>((lane % 8) + ((lane / 8) % 2) * 8, dp * 2 + lane / 16));
#pragma unroll
            for (int m = 0; m < kMT; ++m) {
                mma_16816<T>(st.acc_o[m][2 * dp], a[m], b[0], b[1]);
                mma_16816<T>(st.acc_o[m][2 * dp + 1], a[m], b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // all warps done with K/V: the stages become the merge buffer

    // Merge the 4 warps' softmax states: M = max_w m_w, O = sum_w exp2(m_w - M) O_w / sum_w exp2(m_w - M) l_w.
    __shared__ float s_max[Traits::kNWarps][kRows], s_sum[Traits::kNWarps][kRows];
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float s = quad_sum(st.row_sum[m][r]);
            if (t == 0) {
                s_max[warp][m * 16 + g + 8 * r] = st.row_max[m][r];
                s_sum[warp][m * 16 + g + 8 * r] = s;
            }
        }
    __syncthreads();
    float* s_o = reinterpret_cast<float*>(sK);  // [warps][kRows][kHeadDim]
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m * 16 + g + 8 * r;
            float mx = -INFINITY;
#pragma unroll
            for (int w = 0; w < Traits::kNWarps; ++w) mx = fmaxf(mx, s_max[w][row]);
            const float mm = mx == -INFINITY ? 0.f : mx;
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < Traits::kNWarps; ++w) total += s_sum[w][row] * exp2f(s_max[w][row] - mm);
            const float f = total > 0.f ? exp2f(st.row_max[m][r] - mm) / total : 0.f;
#pragma unroll
            for (int d = 0; d < kDT; ++d)
                *reinterpret_cast<float2*>(s_o + (warp * kRows + row) * kHeadDim + d * 8 + 2 * t) =
                    make_float2(st.acc_o[m][d][2 * r] * f, st.acc_o[m][d][2 * r + 1] * f);
        }
    __syncthreads();

    // Each thread sums the warps for 2 consecutive elements and writes them (rows past num_rows are padding).
    const bool split_out = params.num_splits > 1;
    for (int idx = tid * 2; idx < num_rows * kHeadDim; idx += Traits::kThreads * 2) {
        const int row = idx / kHeadDim, d = idx % kHeadDim;
        float x = 0.f, y = 0.f;
#pragma unroll
        for (int w = 0; w < Traits::kNWarps; ++w) {
            x += s_o[(w * kRows + row) * kHeadDim + d];
            y += s_o[(w * kRows + row) * kHeadDim + d + 1];
        }
        const int head = kv_head * group + row % group, qi = row / group;
        if (split_out) {
            const int64_t r_id = ((static_cast<int64_t>(split) * params.batch + batch) * params.num_heads + head) *
                                     seqlen_q + qi;
            *reinterpret_cast<float2*>(params.o_accum + r_id * kHeadDim + d) = make_float2(x, y);
        } else {
            T* o = reinterpret_cast<T*>(params.o) + batch * params.o_batch_stride + head * params.o_head_stride +
                   static_cast<int64_t>(qi) * params.o_row_stride + d;
            *reinterpret_cast<uint32_t*>(o) = pack2<T>(x, y);
        }
    }
    // lse per row: natural log of sum_w exp(m_w) l_w.
    for (int row = tid; row < num_rows; row += Traits::kThreads) {
        float mx = -INFINITY;
        for (int w = 0; w < Traits::kNWarps; ++w) mx = fmaxf(mx, s_max[w][row]);
        const float mm = mx == -INFINITY ? 0.f : mx;
        float total = 0.f;
        for (int w = 0; w < Traits::kNWarps; ++w) total += s_sum[w][row] * exp2f(s_max[w][row] - mm);
        const float lse = total > 0.f ? (mm + __log2f(total)) * kLn2 : -INFINITY;
        const int head = kv_head * group + row % group, qi = row / group;
        const int64_t r_id = (static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + qi;
        if (split_out) {
            params.lse_accum[static_cast<int64_t>(split) * params.batch * params.num_heads * seqlen_q + r_id] = lse;
        } else if (params.lse != nullptr) {
            params.lse[r_id] = lse;
        }
    }
    if (!split_out) return;

    // Fused combine: the last split block of this (batch, KV head) to finish merges all splits' partials, so
    // decode needs no second kernel. Writers fence before counting.
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* counter = params.split_counters + batch * params.num_kv_heads + kv_head;
        const bool last = atomicAdd(counter, 1) == params.num_splits - 1;
        // Every split has counted: leave the counter zero for the next launch that uses it (the caller's counter
        // pool is zeroed once, not per call; the next launch on these counters is stream-ordered after this one).
        if (last) *counter = 0;
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int row = warp; row < num_rows; row += Traits::kNWarps) {
        const int head = kv_head * group + row % group, qi = row / group;
        const int64_t row_id = (static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + qi;
        combine_row<T, kHeadDim, kDecodeCombineBatch>(params, row_id, lane);
    }
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_decode_kernel(const FlashFwdParams params) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890)
    // sm_86/sm_89 blocks have at most 99 KB of shared memory: a larger variant (head_dim 128 with 3 or 4 stages)
    // cannot be launched there (its opt-in fails first), so it is not compiled for them.
    if constexpr (Traits::kSmemBytes > 99 * 1024) {
        __trap();
    } else
#endif
        flash_decode_body<T, Traits>(params);
}

}  // namespace llm_attn

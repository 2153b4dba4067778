// FlashAttention-2 forward kernel (mma.sync tensor cores, sm_80 .. sm_90).
//
// One thread block owns kBlockM query rows of one (batch, query head); each of its warps owns 16 or 32 of those
// rows (kMTiles), so warps split query rows and never exchange softmax state. With 16 rows per warp the Q tile
// is loaded once into registers (A fragments); with 32 it is re-read from shared memory. K/V tiles of kBlockN keys
// stream through double-buffered, XOR-swizzled shared memory with cp.async: tile j+1 is in flight while tile j is
// multiplied. Per tile: S = Q K^T (mma), masking only on tiles
// that cross the causal diagonal or the end of the keys, online softmax in base 2 with the scale folded into
// one FMA, P (the S accumulators re-packed as A fragments, never written to memory) times V (ldmatrix.trans).
// The N x N score matrix never leaves registers.
//
// kSplit: flash-decoding. blockIdx.z also enumerates KV splits; each split covers a contiguous range of key
// tiles and writes float32 partials (output normalised within the split, and its lse) that flash_combine_kernel merges.
//
// Built from the named parts beside it: smem_tile.cuh (swizzled tiles, cp.async copies), softmax.cuh (the online
// softmax state), mask.cuh, mma_frag.cuh (C -> A fragments, acc += A B) and combine.cuh (the KV-split merge). This
// file holds the kernel's own parts: FwdTraits, WarpTile (one warp's Q K^T and P V), the two main loops
// (fwd_mainloop_pipelined and fwd_mainloop_simple) and flash_fwd_block: the block's rows and keys, then a main loop,
// then the epilogue.
#pragma once

#include "combine.cuh"
#include "flash.h"
#include "mask.cuh"
#include "mma_frag.cuh"
#include "ptx.cuh"
#include "smem_tile.cuh"
#include "softmax.cuh"

namespace llm_attn {

// kMTiles: m16 row tiles per warp. With 2, every K/V fragment read from shared memory feeds two mma (half the
// shared-memory traffic per FLOP), at the price of 2x the accumulators; Q is then re-read from shared memory per
// k-step instead of living in registers.
// kPipeline: S of key tile j + 1 is computed while tile j goes through softmax and P V (two S tiles live: one
// m-tile per warp only, where the registers allow it).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMTiles_, bool kPipeline_, int kMinArch_ = 0>
struct FwdTraits {
    static constexpr bool kPipeline = kPipeline_;
    static constexpr int kMinArch = kMinArch_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kMTiles = kMTiles_;
    static constexpr int kWarpRows = 16 * kMTiles;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
    static constexpr int kSmemQ = kBlockM * kHeadDim;
    static constexpr int kSmemKV = kBlockN * kHeadDim;
    // Q tile + two stages of (K, V), 2-byte elements.
    static constexpr int kSmemBytes = (kSmemQ + 4 * kSmemKV) * 2;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim must be 64 or 128");
    static_assert(kBlockM == kWarpRows * kNWarps, "warps split the block's query rows");
    static_assert(kMTiles == 1 || kMTiles == 2, "one or two m16 tiles per warp");
    static_assert(!kPipeline || kMTiles == 1, "two live S tiles fit the registers with one m-tile per warp only");
    static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of the mma k-step (16)");
    static_assert(kChunks >= 8, "the XOR swizzle permutes 8 chunks per row");
    static_assert((kBlockN * kChunks) % kThreads == 0, "K/V tile copy must divide evenly among threads");
    static_assert((kBlockM * kChunks) % kThreads == 0, "Q tile copy must divide evenly among threads");
};

// One warp's share of the tile math: its rows x one K/V tile in shared memory. Holds this lane's fragment
// addressing (rows and swizzled columns of the K, V and Q ldmatrix patterns) and, with one m-tile per warp, the Q
// fragments of every head_dim k-step, loaded once.
template <typename T, typename Traits>
struct WarpTile {
    static constexpr int kHeadDim = Traits::kHeadDim;
    static constexpr int kMT = Traits::kMTiles;
    static constexpr int kNT = Traits::kBlockN / 8;  // n-tiles of S per m-tile
    static constexpr int kDT = kHeadDim / 8;         // n-tiles of O per m-tile
    static constexpr int kKQ = kHeadDim / 16;        // k-steps of Q K^T
    static constexpr bool kQInRegs = kMT == 1;
    using Scores = float[kMT][kNT][4];

    const T* sQ;
    SwzCols cols;
    int cbit_k, cbit_qv;  // (cbit ^ (lane & 1)) * 8 of the K pattern and of the Q / V^T pattern
    int k_row;            // + 16 np: this lane's key row for K fragments
    int v_row;            // + 16 kk: this lane's key row for V fragments
    int q_row;            // + 16 m: this lane's query row (within the block) for Q fragments
    uint32_t q_frag[kQInRegs ? kKQ : 1][4];

    __device__ __forceinline__ WarpTile(const T* sQ_, int warp, int lane)
        : sQ(sQ_), cols(lane), cbit_k((((lane / 8) % 2) ^ (lane & 1)) * 8), cbit_qv(((lane / 16) ^ (lane & 1)) * 8),
          k_row((lane % 8) + (lane / 16) * 8), v_row((lane % 8) + ((lane / 8) % 2) * 8),
          q_row(warp * Traits::kWarpRows + lane % 16) {}

    // Q must be in shared memory (and visible to the warp) before this.
    __device__ __forceinline__ void load_q() {
        if constexpr (kQInRegs) {
#pragma unroll
            for (int kk = 0; kk < kKQ; ++kk) ldmatrix_x4(q_frag[kk], sQ + q_row * kHeadDim + cols(kk, cbit_qv));
        }
    }

    // S = Q K^T for the warp's rows x the tile's keys.
    __device__ __forceinline__ void qk(Scores& acc_s, const T* cK) const {
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int i = 0; i < kNT; ++i) acc_s[m][i][0] = acc_s[m][i][1] = acc_s[m][i][2] = acc_s[m][i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKQ; ++kk) {
            if constexpr (kQInRegs) {
#pragma unroll
                for (int np = 0; np < kNT / 2; ++np) {
                    uint32_t b[4];
                    ldmatrix_x4(b, cK + (k_row + np * 16) * kHeadDim + cols(kk, cbit_k));
                    mma_16816<T>(acc_s[0][2 * np], q_frag[kk], b[0], b[1]);
                    mma_16816<T>(acc_s[0][2 * np + 1], q_frag[kk], b[2], b[3]);
                }
            } else {
                // All of this k-step's K fragments first, then each m-tile's Q fragment: K is read once and feeds
                // every m-tile; one Q fragment is live at a time.
                uint32_t b[kNT / 2][4];
#pragma unroll
                for (int np = 0; np < kNT / 2; ++np) ldmatrix_x4(b[np], cK + (k_row + np * 16) * kHeadDim + cols(kk, cbit_k));
#pragma unroll
                for (int m = 0; m < kMT; ++m) {
                    uint32_t qa[4];
                    ldmatrix_x4(qa, sQ + (q_row + m * 16) * kHeadDim + cols(kk, cbit_qv));
#pragma unroll
                    for (int np = 0; np < kNT / 2; ++np) {
                        mma_16816<T>(acc_s[m][2 * np], qa, b[np][0], b[np][1]);
                        mma_16816<T>(acc_s[m][2 * np + 1], qa, b[np][2], b[np][3]);
                    }
                }
            }
        }
    }
    // O += P V, P the softmax-updated scores (as A fragments, never written to memory).
    __device__ __forceinline__ void pv(float (&acc_o)[kMT][kDT][4], const Scores& p, const T* cV) const {
#pragma unroll
        for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
            mma_c_as_a<T>(acc_o, p, kk, [&](uint32_t (&b)[4], int dp) {
                ldmatrix_x4_trans(b, cV + (v_row + kk * 16) * kHeadDim + cols(dp, cbit_qv));
            });
        }
    }
};


// What the main loops read of their block (references to flash_fwd_block's values; its loads and masks come as
// callables). Taking the softmax state in and returning it, rather than updating it through a reference, keeps the
// kernels' SASS as it was with the loops inline (NOTES.md "Named parts").
template <typename T>
struct FwdLoopArgs {
    const FlashFwdParams& params;
    T* sQ;
    T* sK;  // [2][kBlockN][kHeadDim]
    T* sV;  // [2][kBlockN][kHeadDim]
    const T* q_ptr;
    const int &seqlen_q, &seqlen_k, &causal_offset, &row0, &warp_row0, &tid, &warp, &lane;
};

template <typename Traits>
using FwdState = SoftmaxState<Traits::kMTiles, Traits::kHeadDim / 8>;

// Pipelined main loop over key tiles [n_block_min, n_block_max): S of the next tile (tensor cores) is issued in the
// same straight-line stretch as the softmax of the current one (FMA/MUFU/shuffles), so each warp always has
// independent work in flight instead of alternating an mma phase and a softmax phase. K runs one tile ahead of V:
// the group in flight during tile j holds K[j + 2] and V[j + 1], each in the stage its tile j - 1 counterpart freed.
template <typename T, typename Traits, bool kCausal, typename LoadK, typename LoadV, typename NeedMask,
          typename MaskedOut>
__device__ __forceinline__ FwdState<Traits> fwd_mainloop_pipelined(FwdState<Traits> st, int n_block_min,
                                                                   int n_block_max, const FwdLoopArgs<T>& a,
                                                                   const LoadK& load_k, const LoadV& load_v,
                                                                   const NeedMask& need_mask,
                                                                   const MaskedOut& warp_masked_out) {
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kMT = Traits::kMTiles;
    constexpr int kNT = kBlockN / 8;
    if (n_block_min < n_block_max) {
        using Tile = WarpTile<T, Traits>;
        Tile wt(a.sQ, a.warp, a.lane);
        const float scale_log2 = a.params.scale_log2;
        load_tile_async<Traits, Traits::kBlockM>(a.sQ, a.q_ptr, a.params.q_row_stride, a.seqlen_q - a.row0, a.tid);
        load_k(n_block_min, 0);
        cp_async_commit();
        load_v(n_block_min, 0);
        if (n_block_min + 1 < n_block_max) load_k(n_block_min + 1, 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        wt.load_q();
        typename Tile::Scores acc_s;
        wt.qk(acc_s, a.sK);
        for (int n_block = n_block_min;; ++n_block) {
            const int stage = (n_block - n_block_min) & 1;
            cp_async_wait<0>();
            __syncthreads();  // V[j] and K[j + 1] landed; every warp is done with K[j]'s and V[j - 1]'s stages
            const bool last = n_block + 1 == n_block_max;
            if (n_block + 2 < n_block_max) load_k(n_block + 2, stage);
            if (!last) load_v(n_block + 1, stage ^ 1);
            cp_async_commit();
            if (need_mask(n_block))
                mask_scores<kCausal>(acc_s, n_block * kBlockN, a.warp_row0, a.seqlen_k, a.causal_offset, a.lane);
            if (last) {
                if (!warp_masked_out(n_block)) {
                    st.update(acc_s, scale_log2);
                    wt.pv(st.acc_o, acc_s, a.sV + stage * Traits::kSmemKV);
                }
                break;
            }
            typename Tile::Scores acc_next;
            wt.qk(acc_next, a.sK + (stage ^ 1) * Traits::kSmemKV);
            st.update(acc_s, scale_log2);
            wt.pv(st.acc_o, acc_s, a.sV + stage * Traits::kSmemKV);
#pragma unroll
            for (int m = 0; m < kMT; ++m)
#pragma unroll
                for (int i = 0; i < kNT; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[m][i][e] = acc_next[m][i][e];
        }
    }
    return st;
}

// Simple main loop over key tiles [n_block_min, n_block_max): tile j + 1 loads while tile j runs S, the softmax and
// P V in turn.
template <typename T, typename Traits, bool kCausal, typename LoadK, typename LoadV, typename NeedMask,
          typename MaskedOut>
__device__ __forceinline__ FwdState<Traits> fwd_mainloop_simple(FwdState<Traits> st, int n_block_min,
                                                                int n_block_max, const FwdLoopArgs<T>& a,
                                                                const LoadK& load_k, const LoadV& load_v,
                                                                const NeedMask& need_mask,
                                                                const MaskedOut& warp_masked_out) {
    if (n_block_min < n_block_max) {
        using Tile = WarpTile<T, Traits>;
        Tile wt(a.sQ, a.warp, a.lane);
        const float scale_log2 = a.params.scale_log2;
        load_tile_async<Traits, Traits::kBlockM>(a.sQ, a.q_ptr, a.params.q_row_stride, a.seqlen_q - a.row0, a.tid);
        load_k(n_block_min, 0);
        load_v(n_block_min, 0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        wt.load_q();
        for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
            const int stage = (n_block - n_block_min) & 1;
            if (n_block + 1 < n_block_max) {  // prefetch the next K/V tile into the other stage
                load_k(n_block + 1, stage ^ 1);
                load_v(n_block + 1, stage ^ 1);
            }
            cp_async_commit();
            if (!warp_masked_out(n_block)) {
                typename Tile::Scores acc_s;
                wt.qk(acc_s, a.sK + stage * Traits::kSmemKV);
                if (need_mask(n_block))
                    mask_scores<kCausal>(acc_s, n_block * Traits::kBlockN, a.warp_row0, a.seqlen_k, a.causal_offset,
                                         a.lane);
                st.update(acc_s, scale_log2);
                wt.pv(st.acc_o, acc_s, a.sV + stage * Traits::kSmemKV);
            }
            cp_async_wait<0>();
            __syncthreads();  // next stage landed for everyone; everyone is done reading this stage
        }
    }
    return st;
}

// The body of the forward kernel: one block of kBlockM query rows of one (batch, head[, split]).
template <typename T, typename Traits, bool kCausal, bool kSplit>
__device__ __forceinline__ void flash_fwd_block(const FlashFwdParams& params) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kMT = Traits::kMTiles;
    constexpr int kWarpRows = Traits::kWarpRows;
    constexpr int kNT = kBlockN / 8;    // n-tiles of S per m-tile
    constexpr int kDT = kHeadDim / 8;   // n-tiles of O per m-tile

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Traits::kSmemQ;            // [2][kBlockN][kHeadDim]
    T* sV = sK + 2 * Traits::kSmemKV;       // [2][kBlockN][kHeadDim]

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    // Causal (not split): the grid is (heads, m_blocks) and m_block counts down from the last (longest) row block,
    // so blocks launch longest first across all heads and the short ones fill the tail of the last wave.
    constexpr bool kHeadsFirst = kCausal && !kSplit;
    const int m_block = kHeadsFirst ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    const int head = kHeadsFirst ? blockIdx.x : blockIdx.y;
    const int batch = kSplit ? blockIdx.z / params.num_splits : blockIdx.z;
    const int split = kSplit ? blockIdx.z % params.num_splits : 0;
    const int kv_head = head / (params.num_heads / params.num_kv_heads);

    const int seqlen_q = params.seqlen_q;
    const int seqlen_k = params.seqused_k ? min(params.seqused_k[batch], params.seqlen_k) : params.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;  // row i sees keys j <= i + causal_offset
    const int row0 = m_block * kBlockM;
    const int warp_row0 = row0 + warp * kWarpRows;

    // Key tiles this block visits: all of them, or up to the diagonal of its last row.
    int n_block_max = (seqlen_k + kBlockN - 1) / kBlockN;
    if (kCausal) {
        const int last_key = min(row0 + kBlockM - 1 + causal_offset, seqlen_k - 1);
        n_block_max = min(n_block_max, last_key < 0 ? 0 : last_key / kBlockN + 1);
    }
    int n_block_min = 0;
    if (kSplit) {
        const int per_split = (n_block_max + params.num_splits - 1) / params.num_splits;
        n_block_min = split * per_split;
        n_block_max = min(n_block_max, n_block_min + per_split);
    }

    const T* q_ptr = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride +
                     head * params.q_head_stride + static_cast<int64_t>(row0) * params.q_row_stride;
    const T* k_ptr = reinterpret_cast<const T*>(params.k) + batch * params.k_batch_stride + kv_head * params.k_head_stride;
    const T* v_ptr = reinterpret_cast<const T*>(params.v) + batch * params.v_batch_stride + kv_head * params.v_head_stride;

    auto load_k = [&](int n_block, int stage) {
        const int kv = n_block * kBlockN;
        load_tile_async<Traits, kBlockN>(sK + stage * Traits::kSmemKV, k_ptr + kv * params.k_row_stride,
                                         params.k_row_stride, seqlen_k - kv, tid);
    };
    auto load_v = [&](int n_block, int stage) {
        const int kv = n_block * kBlockN;
        load_tile_async<Traits, kBlockN>(sV + stage * Traits::kSmemKV, v_ptr + kv * params.v_row_stride,
                                         params.v_row_stride, seqlen_k - kv, tid);
    };
    // Mask only tiles that reach past the last key or cross the causal diagonal of the warp's rows.
    auto need_mask = [&](int n_block) {
        const int key0 = n_block * kBlockN;
        return key0 + kBlockN > seqlen_k || (kCausal && key0 + kBlockN - 1 > warp_row0 + causal_offset);
    };
    // A tile whose keys all lie above the diagonal for every row of the warp (the tail of a causal block, e.g.
    // the first warps of the block on its last key tile): the warp skips its softmax and P V.
    auto warp_masked_out = [&](int n_block) {
        return kCausal && n_block * kBlockN > warp_row0 + kWarpRows - 1 + causal_offset;
    };
    const FwdLoopArgs<T> args{params, sQ, sK, sV, q_ptr, seqlen_q, seqlen_k, causal_offset, row0, warp_row0, tid,
                              warp, lane};
    SoftmaxState<kMT, kDT> st0;
    st0.init();
    const SoftmaxState<kMT, kDT> st = [&] {
        if constexpr (Traits::kPipeline)
            return fwd_mainloop_pipelined<T, Traits, kCausal>(st0, n_block_min, n_block_max, args, load_k, load_v,
                                                              need_mask, warp_masked_out);
        else
            return fwd_mainloop_simple<T, Traits, kCausal>(st0, n_block_min, n_block_max, args, load_k, load_v,
                                                           need_mask, warp_masked_out);
    }();

    // Epilogue: normalise, write O (and lse). Rows that saw no key write 0 and lse = -inf.
    float inv_sum[kMT][2], lse[kMT][2];
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float s = quad_sum(st.row_sum[m][r]);
            inv_sum[m][r] = s > 0.f ? 1.f / s : 0.f;
            lse[m][r] = s > 0.f ? (st.row_max[m][r] + __log2f(s)) * kLn2 : -INFINITY;
        }

    if constexpr (kSplit) {
        // float32 partials straight from registers: (split, batch, head, row, d).
        const int64_t bh = (static_cast<int64_t>(split) * params.batch + batch) * params.num_heads + head;
        float* o_acc = params.o_accum + bh * seqlen_q * kHeadDim;
        float* l_acc = params.lse_accum + bh * seqlen_q;
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp_row0 + m * 16 + g + r * 8;
                if (row < seqlen_q) {
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
                        *reinterpret_cast<float2*>(o_acc + static_cast<int64_t>(row) * kHeadDim + dt * 8 + 2 * t) =
                            make_float2(st.acc_o[m][dt][2 * r] * inv_sum[m][r], st.acc_o[m][dt][2 * r + 1] * inv_sum[m][r]);
                    }
                    if (t == 0) l_acc[row] = lse[m][r];
                }
            }
    } else {
        // Stage the tile in (swizzled) shared memory so the global stores are 16-byte and coalesced.
        __syncthreads();
        T* sO = sQ;
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = warp * kWarpRows + m * 16 + g + r * 8;
#pragma unroll
                for (int dt = 0; dt < kDT; ++dt) {
                    *reinterpret_cast<uint32_t*>(sO + swz<kHeadDim>(row, dt) + 2 * t) =
                        pack2<T>(st.acc_o[m][dt][2 * r] * inv_sum[m][r], st.acc_o[m][dt][2 * r + 1] * inv_sum[m][r]);
                }
                if (params.lse != nullptr && t == 0 && row0 + row < seqlen_q) {
                    params.lse[(static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + row0 + row] =
                        lse[m][r];
                }
            }
        __syncthreads();
        T* o_ptr = reinterpret_cast<T*>(params.o) + batch * params.o_batch_stride + head * params.o_head_stride +
                   static_cast<int64_t>(row0) * params.o_row_stride;
        constexpr int kIters = kBlockM * Traits::kChunks / Traits::kThreads;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int idx = it * Traits::kThreads + tid;
            const int row = idx / Traits::kChunks;
            const int chunk = idx % Traits::kChunks;
            if (row0 + row < seqlen_q) {
                *reinterpret_cast<uint4*>(o_ptr + static_cast<int64_t>(row) * params.o_row_stride + chunk * 8) =
                    *reinterpret_cast<const uint4*>(sO + swz<kHeadDim>(row, chunk));
            }
        }
    }
}

// Configurations with kMinArch (e.g. 900) have device code only from that architecture up: elsewhere the host
// never selects them (flash_fwd_launch.cuh) and the body is a trap.
template <typename T, typename Traits, bool kCausal, bool kSplit>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_fwd_kernel(const FlashFwdParams params) {
#if defined(__CUDA_ARCH__)
    if constexpr (__CUDA_ARCH__ < Traits::kMinArch) {
        __trap();
    } else {
        flash_fwd_block<T, Traits, kCausal, kSplit>(params);
    }
#endif
}

}  // namespace llm_attn

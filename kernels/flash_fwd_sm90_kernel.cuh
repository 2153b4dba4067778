// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma tensor cores, warp specialisation.
//
// One thread block (1 + kConsumers warpgroups) owns 64 x kConsumers query rows of one (batch, query head):
//   warpgroup 0, the producer: gives most of its registers away (setmaxnreg) and one thread drives the copy engine:
//     Q once, then K and V tile after tile into a kStages-deep ring of shared-memory slots. Each slot has a "full"
//     mbarrier (completed by the TMA byte count) and an "empty" one (completed when every consumer warp is done).
//   warpgroups 1..kConsumers (2, or 3 for head_dim 64), the consumers: 64 query rows each. Per key tile:
//     S = Q K^T      wgmma m64n{kBlockN}k16, both operands from shared memory, f32 accumulators in registers
//     softmax        online, base 2, masking only on tiles that cross the causal diagonal or the end of the keys
//                    (SoftmaxState: the same lazy-rescale update as the portable kernel)
//     O += P V       wgmma m64n{head_dim}k16 with P straight from the S registers (A operand in registers) and V
//                    read transposed (MN-major) from shared memory
//   Inside a consumer the loop is software-pipelined: S of tile j and P V of tile j - 1 are issued back to back, and
//   the softmax of tile j runs on the CUDA cores while P V still runs on the tensor cores. The consumers run the
//   same loop on different rows and take turns at the tensor cores, so one's softmax overlaps another's GEMMs.
// Key tiles are visited last to first, so the masked ones (diagonal, tail) come first. The O tile is staged in the
// Q slot and written by TMA stores, which clip rows past the end of the sequence.
//
// Keys in [seqused_k, seqlen_k) are real memory that may hold anything (an unused static-cache slot, NaN): their
// scores are masked to -inf, and their V rows are zeroed in shared memory before P V (0 * NaN would be NaN).
#pragma once

#include "flash.h"
#include "mask.cuh"
#include "mma_frag.cuh"
#include "softmax.cuh"
#include "hopper.cuh"

namespace llm_attn {
namespace sm90 {

template <int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_ = 2>
struct Sm90Traits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kConsumers = kConsumers_;  // consumer warpgroups
    static constexpr int kBlockM = 64 * kConsumers;  // 64 rows (wgmma's M) per consumer warpgroup
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kStages = kStages_;
    static constexpr int kThreads = 128 * (1 + kConsumers);
    static constexpr int kConsumerThreads = 128 * kConsumers;
    static constexpr int kConsumerWarps = 4 * kConsumers;
    static constexpr int kMTiles = 1, kWarpRows = 16;  // per warp: one m16 row tile (mask_scores' view)
    static constexpr int kSlabs = kHeadDim / 64;        // 64-column, 128-byte-swizzled slabs per row
    static constexpr int kSlabBytesQ = kBlockM * 128;
    static constexpr int kSlabBytesKV = kBlockN * 128;
    static constexpr int kTileBytesQ = kSlabs * kSlabBytesQ;
    static constexpr int kTileBytesKV = kSlabs * kSlabBytesKV;
    static constexpr int kNumBarriers = 1 + 4 * kStages;
    // Q + kStages x (K + V) + barriers, plus 1 KB to align the dynamic shared memory to the swizzle atom.
    static constexpr int kSmemBytes = kTileBytesQ + 2 * kStages * kTileBytesKV + kNumBarriers * 8 + 1024;
    // Registers after setmaxnreg: 128 x 24 + 256 x 240 = 64K, the whole register file of the SM; with three
    // consumers 128 x 24 + 384 x 160 = 63K (setmaxnreg takes multiples of 8).
    static constexpr int kProducerRegs = 24, kConsumerRegs = kConsumers == 2 ? 240 : 160;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static_assert(kConsumers == 2 || (kConsumers == 3 && kHeadDim == 64),
                  "two consumers, or three for head_dim 64 (128 would need more than 160 registers a thread)");
    static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 64 * 1024, "the SM's register file");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N is a multiple of 16 up to 256 (and a TMA box <= 256)");
    static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory a Hopper block can have");
};

// The kernel's parameters: the portable parameter struct plus the four tensor maps the host builds for it.
struct Sm90Params {
    FlashFwdParams p;
    int pingpong;  // 1: the consumers take turns issuing their GEMMs (see consumer())
    TmaDesc tma_q, tma_k, tma_v, tma_o;
};

template <typename T, typename Traits>
struct Sm90Smem {
    uint8_t* q;
    uint8_t* k;  // [kStages][kTileBytesKV]
    uint8_t* v;
    uint64_t* bar_q;
    uint64_t* full_k;  // [kStages] each
    uint64_t* full_v;
    uint64_t* empty_k;
    uint64_t* empty_v;

    __device__ __forceinline__ explicit Sm90Smem(uint8_t* raw) {
        uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
        q = base;
        k = q + Traits::kTileBytesQ;
        v = k + Traits::kStages * Traits::kTileBytesKV;
        bar_q = reinterpret_cast<uint64_t*>(v + Traits::kStages * Traits::kTileBytesKV);
        full_k = bar_q + 1;
        full_v = full_k + Traits::kStages;
        empty_k = full_v + Traits::kStages;
        empty_v = empty_k + Traits::kStages;
    }
};

// The block's work: which rows, which keys.
struct BlockInfo {
    int m_block, head, batch, kv_head;
    int kv_len;         // keys this batch uses (seqused_k, else seqlen_k)
    int causal_offset;  // row i sees keys j <= i + causal_offset
    int n_blocks;       // key tiles to visit: [0, n_blocks)

    // Causal: heads in x and row blocks counting down in y, so each wave takes the longest remaining blocks.
    // kHeadMajor (the FP8 kernel; kernels/NOTES.md H10): the blocks a wave runs together are one head's (one KV
    // head's, under GQA), longest first, so they stream the same keys through L2 instead of every KV head's at once.
    template <typename Traits, bool kCausal, bool kHeadMajor = false>
    __device__ __forceinline__ static BlockInfo make(const FlashFwdParams& p) {
        BlockInfo b;
        b.m_block = kCausal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
        b.head = kCausal ? blockIdx.x : blockIdx.y;
        if (kCausal && kHeadMajor) {  // the same grid read in launch order head by head, each longest first
            const int lin = blockIdx.y * gridDim.x + blockIdx.x;
            b.head = lin / gridDim.y;
            b.m_block = gridDim.y - 1 - lin % gridDim.y;
        }
        b.batch = blockIdx.z;
        b.kv_head = b.head / (p.num_heads / p.num_kv_heads);
        b.kv_len = p.seqused_k ? max(0, min(p.seqused_k[b.batch], p.seqlen_k)) : p.seqlen_k;
        b.causal_offset = b.kv_len - p.seqlen_q;
        int n_end = b.kv_len;
        if (kCausal) n_end = min(n_end, (b.m_block + 1) * Traits::kBlockM + b.causal_offset);
        b.n_blocks = n_end > 0 ? (n_end + Traits::kBlockN - 1) / Traits::kBlockN : 0;
        return b;
    }
};

template <typename T, typename Traits>
__device__ __forceinline__ void producer(const Sm90Params& params, const Sm90Smem<T, Traits>& sm, const BlockInfo& b) {
    prefetch_tma_desc(&params.tma_q);
    prefetch_tma_desc(&params.tma_k);
    prefetch_tma_desc(&params.tma_v);
    mbar_arrive_expect_tx(sm.bar_q, Traits::kTileBytesQ);
#pragma unroll
    for (int s = 0; s < Traits::kSlabs; ++s) {
        tma_load_4d(sm.q + s * Traits::kSlabBytesQ, &params.tma_q, sm.bar_q, s * 64, b.m_block * Traits::kBlockM,
                    b.head, b.batch);
    }
    // One K or V tile into its ring slot, once every consumer warp has released the slot's previous tile.
    auto load_tile = [&](uint8_t* dst, const TmaDesc* desc, uint64_t* empty, uint64_t* full, uint32_t parity,
                         int n_block) {
        mbar_wait(empty, parity ^ 1);
        mbar_arrive_expect_tx(full, Traits::kTileBytesKV);
#pragma unroll
        for (int s = 0; s < Traits::kSlabs; ++s) {
            tma_load_4d(dst + s * Traits::kSlabBytesKV, desc, full, s * 64, n_block * Traits::kBlockN, b.kv_head,
                        b.batch);
        }
    };
    for (int it = 0; it < b.n_blocks; ++it) {
        const int n_block = b.n_blocks - 1 - it;
        const int stage = it % Traits::kStages;
        const uint32_t parity = (it / Traits::kStages) & 1;
        load_tile(sm.k + stage * Traits::kTileBytesKV, &params.tma_k, &sm.empty_k[stage], &sm.full_k[stage], parity,
                  n_block);
        load_tile(sm.v + stage * Traits::kTileBytesKV, &params.tma_v, &sm.empty_v[stage], &sm.full_v[stage], parity,
                  n_block);
    }
}

// Keys in [kv_len, seqlen_k) that TMA loaded into a V tile (kSlabs slabs of kBlockN keys x 128 bytes; the tile's
// first key is key0) are real memory holding anything (an unused static-cache slot, NaN): their rows are zeroed before
// P V reads them (0 * NaN would be NaN; their scores are masked). The consumer warpgroups (`thread` counts over all
// of them) share the work and meet at named barrier 1; the fence orders the writes before wgmma reads them. Keys
// past seqlen_k arrive as zeros (TMA's out-of-bounds fill).
template <int kBlockN, int kSlabs, int kSlabBytes, int kConsumerThreads>
__device__ __forceinline__ void zero_v_tail(uint8_t* v_tile, int key0, int kv_len, int seqlen_k, int thread) {
    if (key0 + kBlockN <= kv_len || kv_len >= seqlen_k) return;
    const int first = kv_len - key0;
    const int chunks = (kBlockN - first) * kSlabs * 8;
    for (int c = thread; c < chunks; c += kConsumerThreads) {
        const int row = first + c / (kSlabs * 8);
        const int slab = (c / 8) % kSlabs;
        *reinterpret_cast<uint4*>(v_tile + slab * kSlabBytes + row * 128 + (c % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();
    named_barrier_sync(1, kConsumerThreads);
}

template <typename T, typename Traits, bool kCausal>
__device__ __forceinline__ void consumer(const Sm90Params& params, const Sm90Smem<T, Traits>& sm, const BlockInfo& b,
                                         int wg) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kNT = kBlockN / 8;   // n8 blocks of S per warp
    constexpr int kDT = kHeadDim / 8;  // n8 blocks of O per warp
    using Scores = float[1][kNT][4];
    const FlashFwdParams& p = params.p;
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32;
    const int wg_row0 = b.m_block * Traits::kBlockM + wg * 64;  // first query row of this warpgroup
    const int warp_row0 = wg_row0 + warp * 16;

    SoftmaxState<1, kDT> st;
    st.init();
    Scores acc_s;
    float(&s_flat)[kBlockN / 2] = *reinterpret_cast<float(*)[kBlockN / 2]>(&acc_s[0][0][0]);
    float(&o_flat)[kHeadDim / 2] = *reinterpret_cast<float(*)[kHeadDim / 2]>(&st.acc_o[0][0][0]);

    // wgmma descriptors of this warpgroup's Q rows and of stage 0's K and V; a stage or k-step is a constant byte
    // offset from these (a k-step of Q / K: 32 bytes inside a slab, a slab further every 4; of V: 16 rows).
    const SmemDesc desc_q = SmemDesc::make(sm.q + wg * 64 * 128, 16, 1024);
    const SmemDesc desc_k0 = SmemDesc::make(sm.k, 16, 1024);
    const SmemDesc desc_v0 = SmemDesc::make(sm.v, Traits::kSlabBytesKV, 1024);
    auto qk_step = [](int kk, int slab_bytes) { return static_cast<uint32_t>((kk / 4) * slab_bytes + (kk % 4) * 32); };

    // The tail tile's V rows past kv_len (zero_v_tail).
    auto clean_v_tail = [&](uint8_t* v_tile, int key0) {
        zero_v_tail<kBlockN, Traits::kSlabs, Traits::kSlabBytesKV, Traits::kConsumerThreads>(
            v_tile, key0, b.kv_len, p.seqlen_k, tid + wg * 128);
    };
    auto issue_qk = [&](int stage) {
        const SmemDesc k = desc_k0 + stage * Traits::kTileBytesKV;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            Wgmma<T, kBlockN>::template ss<0>(s_flat, (desc_q + qk_step(kk, Traits::kSlabBytesQ)).u64(),
                                              (k + qk_step(kk, Traits::kSlabBytesKV)).u64(), kk > 0);
        }
        wgmma_commit();
    };
    uint32_t pa[kBlockN / 16][1][4];  // P of the previous tile, packed as wgmma A fragments
    auto issue_pv = [&](int stage) {
        const SmemDesc v = desc_v0 + stage * Traits::kTileBytesKV;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            Wgmma<T, kHeadDim>::template rs<1>(o_flat, pa[kk][0], (v + kk * 16 * 128).u64(), 1);
        }
        wgmma_commit();
    };
    // Softmax of the tile at key0, masking only where it reaches past the keys or crosses this warp's diagonal.
    auto softmax = [&](int key0, float (&alpha)[1][2]) {
        if (key0 + kBlockN > b.kv_len || (kCausal && key0 + kBlockN - 1 > warp_row0 + b.causal_offset)) {
            mask_scores<kCausal>(acc_s, key0, warp_row0, b.kv_len, b.causal_offset, lane);
        }
        return st.update_scores(acc_s, p.scale_log2, alpha);
    };
    auto release = [&](uint64_t* bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };

    // Ping-pong: the consumers take turns, in order, at issuing their batch of GEMMs (named barrier 8 + wg: a
    // warpgroup waits at its own, its predecessor arrives there once it has issued), so one's softmax runs while
    // another's GEMMs hold the tensor cores. Each issues n_blocks + 1 batches; the last consumer opens with an
    // arrival for consumer 0 and leaves out its own last one, so every barrier phase is matched.
    constexpr int kLast = Traits::kConsumers - 1;
    const bool pingpong = params.pingpong;
    auto my_turn = [&] {
        if (pingpong) named_barrier_sync(8 + wg, 256);
    };
    auto your_turn = [&] {
        if (pingpong) named_barrier_arrive(8 + (wg == kLast ? 0 : wg + 1), 256);
    };
    if (pingpong && wg == kLast && b.n_blocks > 0) named_barrier_arrive(8, 256);

    // Software pipeline inside the warpgroup: while the softmax of tile j runs on the CUDA cores, the tensor cores
    // work on P V of tile j - 1 (issued just before). S of tile j is issued before that P V, so it is ready first.
    mbar_wait(sm.bar_q, 0);
    if (b.n_blocks > 0) {
        mbar_wait(&sm.full_k[0], 0);
        my_turn();
        issue_qk(0);
        your_turn();
        wgmma_wait<0>();
        fence_regs(s_flat);
        release(&sm.empty_k[0]);
        float alpha[1][2];
        softmax((b.n_blocks - 1) * kBlockN, alpha);  // O is still zero: no rescale needed
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) p_fragment<T>(pa[kk], acc_s, kk);
    }
    for (int it = 1; it < b.n_blocks; ++it) {
        const int stage = it % Traits::kStages, prev = (it - 1) % Traits::kStages;
        const uint32_t parity = (it / Traits::kStages) & 1, prev_parity = ((it - 1) / Traits::kStages) & 1;
        const int key0 = (b.n_blocks - 1 - it) * kBlockN;
        uint8_t* v_prev = sm.v + prev * Traits::kTileBytesKV;

        mbar_wait(&sm.full_k[stage], parity);
        mbar_wait(&sm.full_v[prev], prev_parity);
        if (it == 1) clean_v_tail(v_prev, key0 + kBlockN);  // outside the turn: both consumers meet there
        my_turn();
        issue_qk(stage);
        issue_pv(prev);
        your_turn();
        wgmma_wait<1>();  // S of this tile is in; P V of the previous one may still run
        fence_regs(s_flat);
        release(&sm.empty_k[stage]);
        float alpha[1][2];
        const bool rescale = softmax(key0, alpha);
        wgmma_wait_after<0>(st.row_sum[0][0], st.row_sum[0][1]);  // P V of the previous tile ran under the softmax
        fence_regs(o_flat);
        release(&sm.empty_v[prev]);
        if (rescale) st.rescale_o(alpha);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) p_fragment<T>(pa[kk], acc_s, kk);
    }
    if (b.n_blocks > 0) {
        const int last = (b.n_blocks - 1) % Traits::kStages;
        uint8_t* v_last = sm.v + last * Traits::kTileBytesKV;
        mbar_wait(&sm.full_v[last], ((b.n_blocks - 1) / Traits::kStages) & 1);
        if (b.n_blocks == 1) clean_v_tail(v_last, (b.n_blocks - 1) * kBlockN);
        my_turn();
        issue_pv(last);
        if (wg != kLast) your_turn();
        wgmma_wait<0>();
        fence_regs(o_flat);
        release(&sm.empty_v[last]);
    }

    // Epilogue: normalise; rows that saw no key write 0 and lse = -inf. O is staged (swizzled, as TMA expects) in
    // this warpgroup's rows of the Q slot, which only this warpgroup read, and every wgmma reading them is done
    // (named barrier 2 + wg: this warpgroup's own).
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float s = quad_sum(st.row_sum[0][r]);
        const float inv_sum = s > 0.f ? 1.f / s : 0.f;
        const int row = warp * 16 + g + r * 8;  // within the warpgroup's 64
        uint8_t* o_row = sm.q + (wg * 64 + row) * 128;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            const int chunk = (dt % 8) ^ (row % 8);
            *reinterpret_cast<uint32_t*>(o_row + (dt / 8) * Traits::kSlabBytesQ + chunk * 16 + t * 4) =
                pack2<T>(st.acc_o[0][dt][2 * r] * inv_sum, st.acc_o[0][dt][2 * r + 1] * inv_sum);
        }
        if (p.lse != nullptr && t == 0 && wg_row0 + row < p.seqlen_q) {
            p.lse[(static_cast<int64_t>(b.batch) * p.num_heads + b.head) * p.seqlen_q + wg_row0 + row] =
                s > 0.f ? (st.row_max[0][r] + __log2f(s)) * kLn2 : -INFINITY;
        }
    }
    fence_proxy_async();
    named_barrier_sync(2 + wg, 128);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < Traits::kSlabs; ++s) {
            tma_store_4d(&params.tma_o, sm.q + s * Traits::kSlabBytesQ + wg * 64 * 128, s * 64, wg_row0, b.head,
                         b.batch);
        }
        tma_store_commit_and_wait();
    }
}

// Device code exists for sm_90a only (wgmma, setmaxnreg); elsewhere the body is a trap and the host never selects
// the kernel (flash_fwd.cu: compute capability 9.0 exactly).
template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_fwd_sm90_kernel(const __grid_constant__ Sm90Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const Sm90Smem<T, Traits> sm(smem_raw);
    const BlockInfo b = BlockInfo::make<Traits, kCausal>(params.p);
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbar_init(sm.bar_q, 1);
#pragma unroll
        for (int s = 0; s < Traits::kStages; ++s) {
            mbar_init(&sm.full_k[s], 1);
            mbar_init(&sm.full_v[s], 1);
            mbar_init(&sm.empty_k[s], Traits::kConsumerWarps);
            mbar_init(&sm.empty_v[s], Traits::kConsumerWarps);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<Traits::kProducerRegs>();
        if (threadIdx.x == 0) producer<T, Traits>(params, sm, b);
    } else {
        setmaxnreg_inc<Traits::kConsumerRegs>();
        consumer<T, Traits, kCausal>(params, sm, b, wg - 1);
    }
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

}  // namespace sm90
}  // namespace llm_attn

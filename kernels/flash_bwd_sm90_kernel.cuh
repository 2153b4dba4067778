// FlashAttention backward for Hopper (sm_90a): the dK/dV kernel (with dQ by atomics) on wgmma tensor cores, Q and dO
// streamed by TMA, warp-specialised. Preprocessing and the conversions are the portable ones (flash_bwd_kernel.cuh),
// and so is the work of a block (BwdBlock: one 128-key block of one (batch, KV head), every query head of its group,
// optionally split over several blocks).
//
// One thread block = 3 warpgroups:
//   warpgroup 0, the producer: one thread loads K and V once, then Q and dO of each step (64 query rows of one query
//     head at head_dim 128, 128 at head_dim 64: Sm90BwdTraits::kBlockM) into a kStages-deep ring of shared-memory
//     slots by TMA; warp 1 copies the step's kBlockM lse and dsum values next to them. A slot's "full" mbarrier
//     completes on the TMA bytes plus warp 1's 32 arrivals, its "empty" one when all 256 consumer threads are done
//     with it.
//   warpgroups 1-2, the consumers: 64 keys each (wgmma's M). Per step, for its keys x the step's queries:
//     S^T  = K Q^T       wgmma m64n{64,128}k16, both from shared memory
//     dP^T = V dO^T      the same
//     P^T  = exp2(S^T scale log2e - lse), masked on the causal diagonal and past the keys
//     dV  += P^T dO      wgmma m64n{head_dim}k16, P^T from registers (A), dO MN-major from shared memory
//     dS^T = P^T (dP^T - dsum)
//     dK  += dS^T Q      the same with Q
//     dQ  += dS K        dS^T stored to shared memory, read back as a transposed A operand, K MN-major; 64-column
//                        wgmmas: over the block's 128 keys by one warpgroup per step, the two taking turns (one
//                        block barrier a step), or each warpgroup over its own 64 keys (FlashBwdParams::dq_shared);
//                        with 128 queries a step, each warpgroup over the 128 keys for its half of the queries.
//                        The float32 result goes to the warpgroup's dQ tile in shared memory, and one thread has the
//                        copy engine add it into the float32 dQ buffer (TMA reduce-add: whole 128-byte rows at L2,
//                        instead of 16-byte atomics from every thread, which kept L2 87 % busy).
//
// Keys in [seqused_k, seqlen_k) are real memory that may hold anything: their K and V rows are zeroed in shared
// memory after the load (dS K and V dO^T would turn NaN into NaN even with P = 0), and their scores are masked.
#pragma once

#include "flash.h"
#include "flash_bwd_kernel.cuh"  // BwdBlock, add_dkdv_split
#include "hopper.cuh"
#include "mask.cuh"
#include "mma_frag.cuh"
#include "softmax.cuh"

namespace llm_attn {
namespace sm90 {

template <int kHeadDim_, int kStages_>
struct Sm90BwdTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kStages = kStages_;
    // Query rows per step (wgmma's N for S^T and dP^T): 64 at head_dim 128; 128 at head_dim 64, where a 64-row step's
    // GEMMs are too short for the step's waits and barriers (the same registers: S^T and dP^T of 64 floats each beside
    // dK and dV of 32, where head_dim 128 has 32 and 64). With 128 rows each consumer computes the dQ of its own half
    // of the step's rows over all 128 keys (kDqSplitRows); with 64, FlashBwdParams::dq_shared chooses.
    static constexpr int kBlockM = kHeadDim_ == 64 ? 128 : 64;
    static constexpr int kBlockN = 128;  // keys per block, 64 (wgmma's M) per consumer warpgroup
    static constexpr bool kDqSplitRows = kBlockM == 128;
    static constexpr int kDqRows = 64;  // rows of one consumer's dQ tile (wgmma's M for dQ = dS K)
    static constexpr int kConsumers = 2;
    static constexpr int kThreads = 128 * (1 + kConsumers);
    static constexpr int kConsumerWarps = 4 * kConsumers;
    static constexpr int kSlabs = kHeadDim / 64;  // 64-column, 128-byte-swizzled slabs per row (hopper.cuh)
    static constexpr int kSlabBytesQ = kBlockM * 128;
    static constexpr int kSlabBytesKV = kBlockN * 128;
    static constexpr int kTileBytesQ = kSlabs * kSlabBytesQ;    // Q or dO of one step
    static constexpr int kTileBytesKV = kSlabs * kSlabBytesKV;  // K or V of the block
    static constexpr int kSlabBytesDS = kBlockN * 128;          // 128 keys x 64 queries of dS^T
    static constexpr int kTileBytesDS = kBlockN * kBlockM * 2;  // a step's dS^T: kBlockM / 64 slabs
    static constexpr int kBoxBytesDQ = kDqRows * 128;           // a float32 dQ box: 64 rows x 32 columns
    static constexpr int kTileBytesDQ = kDqRows * kHeadDim * 4;  // one consumer's float32 dQ: kHeadDim / 32 boxes
    static constexpr int kNumBarriers = 1 + 2 * kStages;
    // K, V; kStages x (Q, dO); two dS^T buffers; per consumer a dQ tile; kStages x (lse, dsum); barriers; 1 KB
    // to align to the swizzle atom.
    static constexpr int kSmemBytes = 2 * kTileBytesKV + 2 * kStages * kTileBytesQ + 2 * kTileBytesDS +
                                      kConsumers * kTileBytesDQ + kStages * 2 * kBlockM * 4 + kNumBarriers * 8 + 1024;
    // Registers after setmaxnreg: 128 x 40 + 256 x 232 = the 384 x 168 the block launches with (setmaxnreg.inc
    // draws on what .dec released). A consumer holds dK and dV (head_dim / 2 floats each), S^T and dP^T (32 each);
    // at 240 the producer's two loops would have 24 and spill, at 232 head_dim 128 fits without spills (ptxas).
    static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kThreads * (64 * 1024 / kThreads / 8 * 8),
                  "within the registers the block launches with");
    static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory a Hopper block can have");
};

// The kernel's parameters: the portable parameter struct plus the tensor maps of Q, K, V, dO and the float32 dQ
// accumulator.
struct Sm90BwdParams {
    FlashBwdParams p;
    TmaDesc tma_q, tma_k, tma_v, tma_do, tma_dq;
};

template <typename Traits>
struct Sm90BwdSmem {
    uint8_t* k;
    uint8_t* v;
    uint8_t* q;   // [kStages][kTileBytesQ]
    uint8_t* dO;  // [kStages][kTileBytesQ]
    uint8_t* ds;  // [2][kTileBytesDS]
    uint8_t* dq;  // [kConsumers][kTileBytesDQ]
    float* lse;   // [kStages][kBlockM]
    float* dsum;  // [kStages][kBlockM]
    uint64_t* bar_kv;
    uint64_t* full;  // [kStages]
    uint64_t* empty;

    __device__ __forceinline__ explicit Sm90BwdSmem(uint8_t* raw) {
        uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
        k = base;
        v = k + Traits::kTileBytesKV;
        q = v + Traits::kTileBytesKV;
        dO = q + Traits::kStages * Traits::kTileBytesQ;
        ds = dO + Traits::kStages * Traits::kTileBytesQ;
        dq = ds + 2 * Traits::kTileBytesDS;
        lse = reinterpret_cast<float*>(dq + Traits::kConsumers * Traits::kTileBytesDQ);
        dsum = lse + Traits::kStages * Traits::kBlockM;
        bar_kv = reinterpret_cast<uint64_t*>(dsum + Traits::kStages * Traits::kBlockM);
        full = bar_kv + 1;
        empty = full + Traits::kStages;
    }
};

// Step `it` of block b: its query head and first query row. Query blocks up, heads outer: the portable kernels'
// order (BwdBlock::step, query blocks down, heads inner) measured 0.95x at 8k causal head_dim 128 here, and
// 0.96-0.99x at head_dim 64 causal (H100, kernels/NOTES.md BP3, BP5), so this kernel keeps its own.
__device__ __forceinline__ int2 bwd_step(const BwdBlock& b, int it, int block_m) {
    return make_int2(b.kv_head * b.group + it / b.per_head, (b.m_block_min + it % b.per_head) * block_m);
}

template <typename Traits>
__device__ __forceinline__ void bwd_producer(const Sm90BwdParams& params, const Sm90BwdSmem<Traits>& sm,
                                             const BwdBlock& b) {
    const FlashBwdParams& p = params.p;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (warp == 0 && lane == 0) {
        prefetch_tma_desc(&params.tma_q);
        prefetch_tma_desc(&params.tma_do);
        mbar_arrive_expect_tx(sm.bar_kv, 2 * Traits::kTileBytesKV);
#pragma unroll
        for (int s = 0; s < Traits::kSlabs; ++s) {
            tma_load_4d(sm.k + s * Traits::kSlabBytesKV, &params.tma_k, sm.bar_kv, s * 64, b.n0, b.kv_head, b.batch);
            tma_load_4d(sm.v + s * Traits::kSlabBytesKV, &params.tma_v, sm.bar_kv, s * 64, b.n0, b.kv_head, b.batch);
        }
        for (int it = b.it_begin; it < b.it_end; ++it) {
            const int i = it - b.it_begin, stage = i % Traits::kStages;
            const int2 step = bwd_step(b, it, Traits::kBlockM);
            mbar_wait(&sm.empty[stage], ((i / Traits::kStages) & 1) ^ 1);
            mbar_arrive_expect_tx(&sm.full[stage], 2 * Traits::kTileBytesQ);
#pragma unroll
            for (int s = 0; s < Traits::kSlabs; ++s) {
                const int off = stage * Traits::kTileBytesQ + s * Traits::kSlabBytesQ;
                tma_load_4d(sm.q + off, &params.tma_q, &sm.full[stage], s * 64, step.y, step.x, b.batch);
                tma_load_4d(sm.dO + off, &params.tma_do, &sm.full[stage], s * 64, step.y, step.x, b.batch);
            }
        }
    } else if (warp == 1) {
        // lse (base 2) and dsum of the step's rows; rows past the end read 0 (their dO is 0 too: they add nothing).
        // With 128 rows a step (head_dim 64) the global loads are issued before the wait for the slot, so that their
        // latency runs while the consumers still read it (ncu: the long-scoreboard stall on them was the largest,
        // 31 %; +3-24 %). At head_dim 128 the same order measured 0.91x at S=8192 causal: loads after the wait.
        constexpr int kPerLane = Traits::kBlockM / 32;
        for (int it = b.it_begin; it < b.it_end; ++it) {
            const int i = it - b.it_begin, stage = i % Traits::kStages;
            const int2 step = bwd_step(b, it, Traits::kBlockM);
            if constexpr (Traits::kBlockM == 128) {
                const int64_t base = (static_cast<int64_t>(b.batch) * p.num_heads + step.x) * p.seqlen_q;
                float lse[kPerLane], dsum[kPerLane];
#pragma unroll
                for (int j = 0; j < kPerLane; ++j) {
                    const int r = lane + 32 * j;
                    const bool ok = step.y + r < p.seqlen_q;
                    lse[j] = ok ? p.lse_log2[base + step.y + r] : 0.f;
                    dsum[j] = ok ? p.dsum[base + step.y + r] : 0.f;
                }
                mbar_wait(&sm.empty[stage], ((i / Traits::kStages) & 1) ^ 1);
#pragma unroll
                for (int j = 0; j < kPerLane; ++j) {
                    sm.lse[stage * Traits::kBlockM + lane + 32 * j] = lse[j];
                    sm.dsum[stage * Traits::kBlockM + lane + 32 * j] = dsum[j];
                }
            } else {
                mbar_wait(&sm.empty[stage], ((i / Traits::kStages) & 1) ^ 1);
                const int64_t base = (static_cast<int64_t>(b.batch) * p.num_heads + step.x) * p.seqlen_q;
#pragma unroll
                for (int r = lane; r < Traits::kBlockM; r += 32) {
                    const bool ok = step.y + r < p.seqlen_q;
                    sm.lse[stage * Traits::kBlockM + r] = ok ? p.lse_log2[base + step.y + r] : 0.f;
                    sm.dsum[stage * Traits::kBlockM + r] = ok ? p.dsum[base + step.y + r] : 0.f;
                }
            }
            mbar_arrive(&sm.full[stage]);
        }
    }
}

template <typename T, typename Traits, bool kCausal>
__device__ __forceinline__ void bwd_consumer(const Sm90BwdParams& params, const Sm90BwdSmem<Traits>& sm,
                                             const BwdBlock& b, int wg) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kDT = kHeadDim / 8;  // n8 blocks of dK / dV
    constexpr int kNT = kBlockM / 8;   // n8 blocks of S^T / dP^T
    const FlashBwdParams& p = params.p;
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int key0 = b.n0 + wg * 64;  // this warpgroup's first key

    float acc_dk[kDT][4], acc_dv[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;
    float(&dk_flat)[kHeadDim / 2] = *reinterpret_cast<float(*)[kHeadDim / 2]>(&acc_dk[0][0]);
    float(&dv_flat)[kHeadDim / 2] = *reinterpret_cast<float(*)[kHeadDim / 2]>(&acc_dv[0][0]);

    if (b.it_begin < b.it_end) {
        mbar_wait(sm.bar_kv, 0);
        // Zero this warpgroup's K and V rows in [seqused_k, seqlen_k) (only it reads them), then order the writes
        // before the wgmma reads.
        if (key0 + 64 > b.seqlen_k && b.seqlen_k < p.seqlen_k) {
            const int first = max(b.seqlen_k - key0, 0);
            const int chunks = (64 - first) * Traits::kSlabs * 8;
            for (int c = tid; c < chunks; c += 128) {
                const int row = wg * 64 + first + c / (Traits::kSlabs * 8);
                const int off = ((c / 8) % Traits::kSlabs) * Traits::kSlabBytesKV + row * 128 + (c % 8) * 16;
                *reinterpret_cast<uint4*>(sm.k + off) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(sm.v + off) = make_uint4(0, 0, 0, 0);
            }
            fence_proxy_async();
            named_barrier_sync(2 + wg, 128);
        }

        // Descriptors (hopper.cuh). K-major A: this warpgroup's K / V rows; K-major B: Q / dO rows of stage 0 (S^T,
        // dP^T; a k-step is 32 bytes inside a slab, a slab further every 4). MN-major B: Q / dO for dK / dV (a
        // k-step of 16 queries is 16 rows) and K for dQ; MN-major A: the dS^T tile for dQ.
        const SmemDesc a_k = SmemDesc::make(sm.k + wg * 64 * 128, 16, 1024);
        const SmemDesc a_v = SmemDesc::make(sm.v + wg * 64 * 128, 16, 1024);
        const SmemDesc b_q = SmemDesc::make(sm.q, 16, 1024);
        const SmemDesc b_do = SmemDesc::make(sm.dO, 16, 1024);
        const SmemDesc bt_q = SmemDesc::make(sm.q, Traits::kSlabBytesQ, 1024);
        const SmemDesc bt_do = SmemDesc::make(sm.dO, Traits::kSlabBytesQ, 1024);
        const SmemDesc bt_k = SmemDesc::make(sm.k, Traits::kSlabBytesKV, 1024);
        const SmemDesc at_ds = SmemDesc::make(sm.ds, Traits::kTileBytesDS, 1024);
        const uint32_t ds_base = smem_u32(sm.ds);
        const bool dq_shared = p.dq_shared;
        const uint32_t dq_tile = smem_u32(sm.dq + wg * Traits::kTileBytesDQ);
        auto k_step = [](int kk, int slab_bytes) { return static_cast<uint32_t>((kk / 4) * slab_bytes + (kk % 4) * 32); };
        const int key_row = key0 + warp * 16 + g;  // this thread's keys: key_row and key_row + 8

        for (int it = b.it_begin; it < b.it_end; ++it) {
            const int i = it - b.it_begin, stage = i % Traits::kStages;
            const int2 step = bwd_step(b, it, kBlockM);
            const int m0 = step.y;
            const uint32_t so = stage * Traits::kTileBytesQ;
            mbar_wait(&sm.full[stage], (i / Traits::kStages) & 1);

            float acc_s[kNT][4], acc_dp[kNT][4];
            float(&s_flat)[kBlockM / 2] = *reinterpret_cast<float(*)[kBlockM / 2]>(&acc_s[0][0]);
            float(&dp_flat)[kBlockM / 2] = *reinterpret_cast<float(*)[kBlockM / 2]>(&acc_dp[0][0]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                Wgmma<T, kBlockM>::template ss<0>(s_flat, (a_k + k_step(kk, Traits::kSlabBytesKV)).u64(),
                                                  (b_q + so + k_step(kk, Traits::kSlabBytesQ)).u64(), kk > 0);
            }
            wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < kHeadDim / 16; ++kk) {
                Wgmma<T, kBlockM>::template ss<0>(dp_flat, (a_v + k_step(kk, Traits::kSlabBytesKV)).u64(),
                                                  (b_do + so + k_step(kk, Traits::kSlabBytesQ)).u64(), kk > 0);
            }
            wgmma_commit();
            wgmma_wait<1>();  // S^T is in; dP^T may still run (overlaps the exp2 below)
            fence_regs(s_flat);

            // P^T, masked where the keys reach past the end or cross the causal diagonal of these queries.
            if (key0 + 64 > b.seqlen_k || (kCausal && key0 + 63 > m0 + b.causal_offset)) {
                mask_scores_t<kCausal>(acc_s, key_row, m0, b.seqlen_k, b.causal_offset, t);
            }
            const uint32_t lse = smem_u32(sm.lse + stage * kBlockM + 2 * t);  // this thread's columns, as float2
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const float2 l = lds_f2(lse + nt * 32);
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[nt][e] = exp2f(fmaf(acc_s[nt][e], p.scale_log2, -(e & 1 ? l.y : l.x)));
            }
            wgmma_wait<0>();  // dP^T is in
            fence_regs(dp_flat);
            const uint32_t dsum = smem_u32(sm.dsum + stage * kBlockM + 2 * t);
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
                const float2 d = lds_f2(dsum + nt * 32);
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_dp[nt][e] = acc_s[nt][e] * (acc_dp[nt][e] - (e & 1 ? d.y : d.x));
            }
            // P^T and dS^T as A fragments (bf16/fp16): dV += P^T dO and dK += dS^T Q, both issued together. (dV issued
            // before dS is computed would keep P^T's registers alive beside S^T and dP^T: head_dim 128 spills.)
            uint32_t pa[kBlockM / 16][1][4], dsa[kBlockM / 16][1][4];
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk) {
                p_fragment<T>(pa[kk], one_mtile(acc_s), kk);
                p_fragment<T>(dsa[kk], one_mtile(acc_dp), kk);
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk) {
                Wgmma<T, kHeadDim>::template rs<1>(dv_flat, pa[kk][0], (bt_do + so + kk * 16 * 128).u64(), 1);
            }
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk) {
                Wgmma<T, kHeadDim>::template rs<1>(dk_flat, dsa[kk][0], (bt_q + so + kk * 16 * 128).u64(), 1);
            }
            wgmma_commit();

            // dS^T into this warpgroup's half of this step's dS^T buffer (two buffers, by step parity; each
            // [128 keys][64 queries], 128-byte swizzle, this warpgroup's 64 keys from row 64 wg): n-tile nt of rows
            // g, g + 8 is k-step nt / 2's A fragment registers (nt % 2) * 2 + r. The buffer's last reader, the dQ
            // wgmma two steps back, has finished: shared dQ, its warpgroup waited for it before the previous step's
            // block barrier; own dQ, it was this warpgroup's own, waited for in that step.
            // With 128 queries a step (head_dim 64) the buffer is two such slabs, queries 0-63 then 64-127.
            const uint32_t ds_tile = ds_base + (i & 1) * Traits::kTileBytesDS + wg * 64 * 128;
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = warp * 16 + g + 8 * r;
                    sts_u32(ds_tile + (nt / 8) * Traits::kSlabBytesDS + row * 128 + (((nt % 8) ^ (row % 8)) * 16) +
                                t * 4,
                            dsa[nt / 2][0][(nt % 2) * 2 + r]);
                }
            fence_proxy_async();
            // This warpgroup's previous dQ tile has been read by its reduce-add (it may be rewritten below), and
            // the dS^T that the dQ wgmma reads is written: both warpgroups' (shared dQ: one block barrier), or this
            // warpgroup's own (each its own dQ: its own barrier).
            if (tid == 0) bulk_wait_read<0>();
            if (dq_shared || Traits::kDqSplitRows) {
                named_barrier_sync(1, 256);
            } else {
                named_barrier_sync(2 + wg, 128);
            }

            // dQ of the step: dQ[m0 .. m0 + 64, 64 h .. 64 h + 64] = dS K, one 64-column slab at a time (head_dim 128
            // has no registers for both), into this warpgroup's dQ tile (float32 boxes of 64 rows x 32 columns in
            // the 128-byte swizzle: TMA's layout; a warp's float2 stores take the minimum two wavefronts); one
            // thread then has the copy engine add the tile into the float32 dQ buffer. Two ways (dq_shared: shared
            // unless force_bwd_tile("hopper_own_dq"), flash_bwd_set_splits):
            //   shared: over the block's 128 keys (8 k-steps of 16) by one warpgroup, the two taking turns by step
            //     parity (the other runs ahead into the next step's S^T and dP^T). Half the bytes through L2 of
            //     each warpgroup adding the share of its own keys, which left L2 87 % busy at long S.
            //   own: each warpgroup over its own 64 keys every step (4 k-steps), no block barrier; measured no faster
            //     on the H100 at any shape tried (kernels/NOTES.md, "The Hopper backward's split rule").
            //   split rows (kDqSplitRows, 128 queries a step): each warpgroup over all 128 keys for its own 64 of the
            //     step's rows, every step; both read both halves of dS^T (the block barrier above).
            if (!Traits::kDqSplitRows && dq_shared && (i & 1) != wg) {
                wgmma_wait<0>();  // dV, dK and the reads of Q, dO, lse, dsum are done: this thread releases the slot
                fence_regs(dk_flat);
                fence_regs(dv_flat);
                mbar_arrive(&sm.empty[stage]);
                continue;
            }
            const SmemDesc a_ds =
                at_ds + (i & 1) * Traits::kTileBytesDS + (Traits::kDqSplitRows ? wg * Traits::kSlabBytesDS : 0);
#pragma unroll
            for (int h = 0; h < Traits::kSlabs; ++h) {
                float acc_dq[8][4];  // 64 rows x 64 columns of dQ
                float(&dq_flat)[32] = *reinterpret_cast<float(*)[32]>(&acc_dq[0][0]);
                const SmemDesc b_k = bt_k + h * Traits::kSlabBytesKV;
                wgmma_fence();
                if (dq_shared || Traits::kDqSplitRows) {
#pragma unroll
                    for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
                        Wgmma<T, 64>::template ss<1, 1>(dq_flat, (a_ds + kk * 16 * 128).u64(),
                                                        (b_k + kk * 16 * 128).u64(), kk > 0);
                    }
                } else {
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk) {
                        Wgmma<T, 64>::template ss<1, 1>(dq_flat, (a_ds + (wg * 4 + kk) * 16 * 128).u64(),
                                                        (b_k + (wg * 4 + kk) * 16 * 128).u64(), kk > 0);
                    }
                }
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(dq_flat);
                if (h == 0) {
                    // dV, dK and the reads of Q, dO, lse, dsum are done: this thread releases the slot.
                    fence_regs(dk_flat);
                    fence_regs(dv_flat);
                    mbar_arrive(&sm.empty[stage]);
                }
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = warp * 16 + g + 8 * r;
                        const int chunk = (nt % 4) * 2 + t / 2;  // 16-byte chunk of columns 8 (nt % 4) + 2t, +1
                        sts_f2(dq_tile + (2 * h + nt / 4) * Traits::kBoxBytesDQ + row * 128 + ((chunk ^ (row % 8)) * 16) +
                                   (t % 2) * 8,
                               acc_dq[nt][2 * r], acc_dq[nt][2 * r + 1]);
                    }
            }
            fence_proxy_async();
            named_barrier_sync(2 + wg, 128);  // the dQ tile complete
            if (tid == 0) {
#pragma unroll
                for (int bx = 0; bx < kHeadDim / 32; ++bx) {
                    tma_reduce_add_4d(&params.tma_dq, sm.dq + wg * Traits::kTileBytesDQ + bx * Traits::kBoxBytesDQ,
                                      bx * 32, m0 + (Traits::kDqSplitRows ? wg * Traits::kDqRows : 0), step.x, b.batch);
                }
                bulk_commit();
            }
        }
        if (tid == 0) bulk_wait_read<0>();  // the last dQ tile read before the block's shared memory goes away
    }

    // Epilogue. Split: float32 partials by atomics. Otherwise dK (times the softmax scale) and dV straight from the
    // accumulators; keys past seqused_k get 0 (their P was masked, or the block had no step).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = key0 + warp * 16 + g + 8 * r;
        if (p.num_splits > 1) {
            add_dkdv_split(p, b.batch, b.kv_head, row, b.seqlen_k, acc_dk, acc_dv, r, t);
            continue;
        }
        if (row >= p.seqlen_k) continue;
        T* dk = reinterpret_cast<T*>(p.dk) + b.batch * p.dk_batch_stride + b.kv_head * p.dk_head_stride +
                static_cast<int64_t>(row) * p.dk_row_stride + 2 * t;
        T* dv = reinterpret_cast<T*>(p.dv) + b.batch * p.dv_batch_stride + b.kv_head * p.dv_head_stride +
                static_cast<int64_t>(row) * p.dv_row_stride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            *reinterpret_cast<uint32_t*>(dk + dt * 8) =
                pack2<T>(acc_dk[dt][2 * r] * p.scale, acc_dk[dt][2 * r + 1] * p.scale);
            *reinterpret_cast<uint32_t*>(dv + dt * 8) = pack2<T>(acc_dv[dt][2 * r], acc_dv[dt][2 * r + 1]);
        }
    }
}

// Device code exists for sm_90a only; elsewhere the body is a trap and the host never selects the kernel
// (flash_bwd.cu: the Hopper forward's availability test, compute capability 9.0 exactly).
template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ Sm90BwdParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const Sm90BwdSmem<Traits> sm(smem_raw);
    const BwdBlock b = BwdBlock::make<Traits::kBlockM, Traits::kBlockN, kCausal>(params.p);
    // A split with nothing to add exits at once (the float32 accumulators start at zero).
    if (params.p.num_splits > 1 && b.it_begin >= b.it_end) return;
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        mbar_init(sm.bar_kv, 1);
#pragma unroll
        for (int s = 0; s < Traits::kStages; ++s) {
            mbar_init(&sm.full[s], 1 + 32);  // the TMA thread's expect_tx, then warp 1's 32 lanes
            // Every consumer thread arrives (its own lse/dsum reads are ordinary shared loads that warp 1's next
            // writes must follow; one arrival per warp after __syncwarp left racecheck reporting those as races).
            mbar_init(&sm.empty[s], Traits::kConsumerWarps * 32);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<Traits::kProducerRegs>();
        if (b.it_begin < b.it_end) bwd_producer<Traits>(params, sm, b);
    } else {
        setmaxnreg_inc<Traits::kConsumerRegs>();
        bwd_consumer<T, Traits, kCausal>(params, sm, b, wg - 1);
    }
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

}  // namespace sm90
}  // namespace llm_attn

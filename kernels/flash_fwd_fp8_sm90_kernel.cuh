// FP8 FlashAttention forward for Hopper (sm_90a): the bf16 kernel's structure (flash_fwd_sm90_kernel.cuh: a TMA
// producer warpgroup, two consumer warpgroups of 64 query rows, software-pipelined and ping-ponged wgmma) on the
// e4m3 operands the pre-pass writes (quant_fp8.cuh; flash_fp8.h says what is computed):
//   S = Q8 K8^T      wgmma m64n{kBlockN}k32 e4m3 (kBlockN = 128, 192 or 256 keys), both operands K-major from shared
//                    memory; dequantised by the row's q_scale times the k_scale of each column group (64 keys, 32
//                    with P V in the input dtype), folded into the softmax scale of that row's group
//                    (fp8_update_scores)
//   softmax          online, base 2, fp32, with the exact running max (SoftmaxState<.., 0, 8>): P' = 2^8 P lies in
//                    [0, 256], inside e4m3's range (448) and keeping small probabilities out of its subnormals
//   O += P8 V8       wgmma m64n{head_dim}k32 e4m3, P from registers, V^T (head_dim rows of keys: one 128-key box,
//                    128-byte swizzle, or three 64-key boxes, 64-byte swizzle) from shared memory. The fp8 A
//                    fragment wants keys 4t..4t+3 of each 16 in thread t's registers, where the
//                    S accumulators hold keys 2t, 2t+1, 8+2t, 9+2t: rather than shuffle P between lanes, the pre-pass
//                    wrote V^T with its keys in that order (vt_key_of_position), so P packs in place.
// The epilogue multiplies O by v_scale / rowsum per channel and writes it straight from registers.
#pragma once

#include "flash_fp8.h"
#include "flash_fwd_sm90_kernel.cuh"  // BlockInfo, mask_scores, SoftmaxState
#include "hopper_fp8.cuh"

namespace llm_attn {
namespace sm90 {

// P = exp2(s - max + 8): the exact running max keeps P in [0, 256], inside e4m3's range (448) and with small
// probabilities above its subnormals; the row sum is of the same 256 P, so O / rowsum needs no correction.
constexpr int kPOffsetLog2 = 8;

// kBlockN_: keys per S tile. 128: one 128-byte V^T box per stage. 192 (v3, kernels/NOTES.md): each tile's waits,
// barriers and row reductions serve 1.5x the GEMM work; S is then 96 fp32 registers a thread (O 64 at head_dim
// 128, P 24), inside the consumers' 240. A V^T row of 192 keys is no swizzle width, so its stage is three 64-key
// boxes with the 64-byte swizzle, each a K-major wgmma operand of its own (k32 steps 2 per box).
// kBlockN_ 256 (H14, kernels/NOTES.md; head_dim 128, e4m3 P V only): cuDNN's FP8 tile. S is then 128 registers a
// thread beside O's 64, so P of tile j-1 (32) cannot stay in registers while S of tile j accumulates (ptxas spilled and
// serialised the wgmmas): each turn issues P V of tile j-1 and waits for it before it issues S of tile j. A V^T stage
// is two 128-key boxes with the 128-byte swizzle.
// kQkInt8_ (v4, kernels/NOTES.md): S = Q K^T in int8 (wgmma .s8, s32 accumulators; Q and K scaled by amax / 127
// in the pre-pass) instead of e4m3: the same tensor rate and shared-memory layout (one byte per element), and 7
// bits for every element where e4m3 keeps 3 of mantissa (SageAttention2's split: INT8 Q K^T, FP8 P V).
// kPvInput_ (llm_attn_int8qk, kernels/NOTES.md "The accurate variant"): P V in the input dtype, as the bf16 kernel
// does it: V is the caller's bf16/fp16 tensor, loaded by TMA in 64-column slabs (128-byte swizzle, MN-major B) with no
// pre-pass, and P is packed to the input dtype. e4m3 P and V each carry ~2.6 % rms rounding, which leaves the e4m3
// P V a floor near 0.036 relative L1 whatever Q K^T does; here only Q K^T is 8-bit. int8 Q K^T only; both key tiles
// (at 192 keys P holds 48 registers a thread in bf16, 24 in e4m3: still 0 spills).
template <int kHeadDim_, int kStages_ = 2, int kBlockN_ = 128, bool kQkInt8_ = false, bool kPvInput_ = false>
struct Fp8Traits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kConsumers = 2;
    static constexpr int kBlockM = 64 * kConsumers;
    static constexpr int kBlockN = kBlockN_;
    static constexpr bool kQkInt8 = kQkInt8_;
    static constexpr bool kPvInput = kPvInput_;
    static constexpr int kKBlock = fp8_k_block(kPvInput);  // keys per K scale
    static constexpr int kKGroups = kBlockN / kKBlock;     // K scales (column groups) per S tile
    static constexpr int kStages = kStages_;
    static constexpr int kThreads = 128 * (1 + kConsumers);
    static constexpr int kConsumerThreads = 128 * kConsumers;
    static constexpr int kConsumerWarps = 4 * kConsumers;
    static constexpr int kRowBytes = kHeadDim;  // e4m3 Q/K rows: 64 or 128 bytes, swizzled as wide
    static constexpr int kTileBytesQ = kBlockM * kRowBytes;
    static constexpr int kTileBytesK = kBlockN * kRowBytes;
    // V^T: head_dim rows of kBlockN key bytes, in boxes of kVtBoxKeys keys (bytes) = the swizzle width. kPvInput: V in
    // kSlabs slabs of kBlockN keys x 64 columns (128 bytes), as the bf16 kernel's.
    static constexpr int kSlabs = kHeadDim / 64;
    static constexpr int kSlabBytesV = kBlockN * 128;
    static constexpr int kTileBytesV = kPvInput ? kSlabs * kSlabBytesV : kHeadDim * kBlockN;
    static constexpr int kVtBoxKeys = kBlockN % 128 == 0 ? 128 : 64;
    static constexpr int kVtBoxes = kBlockN / kVtBoxKeys;
    static constexpr int kVtBoxBytes = kHeadDim * kVtBoxKeys;
    static constexpr int kNumBarriers = 1 + 4 * kStages;
    static constexpr int kSmemBytes = kTileBytesQ + kStages * (kTileBytesK + kTileBytesV) + kNumBarriers * 8 + 1024;
    static constexpr int kProducerRegs = 24, kConsumerRegs = 240;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static_assert(kBlockN == 128 || kBlockN == 192 || kBlockN == 256,
                  "WgmmaFp8<kBlockN> exists for 128, 192 and 256 (TMA boxes <= 256 rows)");
    static_assert(kBlockN != 256 || (kHeadDim == 128 && !kPvInput_),
                  "256 keys: head_dim 128 with e4m3 P V (bf16 P of 256 keys does not fit beside S and O)");
    static_assert(kBlockN % kKBlock == 0 && kKBlock % 32 == 0, "whole K-scale groups, whole k32 steps each");
    static_assert(kVtBoxKeys % 32 == 0 && kVtBoxBytes % 1024 == 0, "k32 steps inside a box; boxes swizzle-aligned");
    static_assert(!kPvInput || kQkInt8, "P V in the input dtype: int8 Q K^T");
    static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 64 * 1024, "the SM's register file");
    static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory a Hopper block can have");
};

// tma_vt: the pre-pass's e4m3 V^T (e4m3 P V); tma_v: the caller's V (kPvInput). The one a kernel does not read is
// left zeroed.
struct Fp8Sm90Params {
    FlashFwdFp8Params f;
    int pingpong;
    TmaDesc tma_q, tma_k, tma_vt, tma_v;
};

template <typename Traits>
struct Fp8Smem {
    uint8_t* q;
    uint8_t* k;   // [kStages][kTileBytesK]
    uint8_t* vt;  // [kStages][kTileBytesV]: V^T in e4m3, or V in the input dtype (kPvInput)
    uint64_t* bar_q;
    uint64_t* full_k;
    uint64_t* full_v;
    uint64_t* empty_k;
    uint64_t* empty_v;

    __device__ __forceinline__ explicit Fp8Smem(uint8_t* raw) {
        uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
        q = base;
        k = q + Traits::kTileBytesQ;
        vt = k + Traits::kStages * Traits::kTileBytesK;
        bar_q = reinterpret_cast<uint64_t*>(vt + Traits::kStages * Traits::kTileBytesV);
        full_k = bar_q + 1;
        full_v = full_k + Traits::kStages;
        empty_k = full_v + Traits::kStages;
        empty_v = empty_k + Traits::kStages;
    }
};

template <typename Traits>
__device__ __forceinline__ void fp8_producer(const Fp8Sm90Params& params, const Fp8Smem<Traits>& sm, const BlockInfo& b) {
    prefetch_tma_desc(&params.tma_q);
    prefetch_tma_desc(&params.tma_k);
    prefetch_tma_desc(Traits::kPvInput ? &params.tma_v : &params.tma_vt);
    mbar_arrive_expect_tx(sm.bar_q, Traits::kTileBytesQ);
    tma_load_4d(sm.q, &params.tma_q, sm.bar_q, 0, b.m_block * Traits::kBlockM, b.head, b.batch);
    for (int it = 0; it < b.n_blocks; ++it) {
        const int n_block = b.n_blocks - 1 - it;
        const int stage = it % Traits::kStages;
        const uint32_t parity = (it / Traits::kStages) & 1;
        mbar_wait(&sm.empty_k[stage], parity ^ 1);
        mbar_arrive_expect_tx(&sm.full_k[stage], Traits::kTileBytesK);
        tma_load_4d(sm.k + stage * Traits::kTileBytesK, &params.tma_k, &sm.full_k[stage], 0, n_block * Traits::kBlockN,
                    b.kv_head, b.batch);
        mbar_wait(&sm.empty_v[stage], parity ^ 1);
        mbar_arrive_expect_tx(&sm.full_v[stage], Traits::kTileBytesV);
        if constexpr (Traits::kPvInput) {  // rows past seqlen_k arrive as zeros (TMA's out-of-bounds fill)
#pragma unroll
            for (int s = 0; s < Traits::kSlabs; ++s) {
                tma_load_4d(sm.vt + stage * Traits::kTileBytesV + s * Traits::kSlabBytesV, &params.tma_v,
                            &sm.full_v[stage], s * 64, n_block * Traits::kBlockN, b.kv_head, b.batch);
            }
        } else {
#pragma unroll
            for (int box = 0; box < Traits::kVtBoxes; ++box) {  // inside V^T's padded rows (fp8_seqlen_k_pad)
                tma_load_4d(sm.vt + stage * Traits::kTileBytesV + box * Traits::kVtBoxBytes, &params.tma_vt,
                            &sm.full_v[stage], n_block * Traits::kBlockN + box * Traits::kVtBoxKeys, 0, b.kv_head,
                            b.batch);
            }
        }
    }
}

// SoftmaxState::update_scores with one scale per row and column group of S (Traits::kKBlock keys): the group's K
// scale times the softmax scale (scale_log2[g]) times the row's Q scale (row_scale[r]); the group's max times its
// scale (positive, so the max of the scaled scores), the row's max times the row's scale, and the scale inside the
// exp2's FMA, so finer scales cost no instruction per score (one FMUL per row and group). Exact running max (the
// state's kRescaleLog2 is 0): rescale whenever a row max grows.
// kBiased (the INT8 S): each score is the float 1.5 x 2^23 + s (kS8Bias, s the integer dot product; exact, as
// |s| < 2^22), so the group max is (max - kS8Bias) x scale (an exact subtraction) and the exp2's FMA takes the bias
// in its addend, shift - kS8Bias x scale per group: the integer -> float conversion costs one integer add per score
// (v4) or none (v5: the accumulators start at the bias), and none of MUFU's quarter-rate conversions. The addend's
// rounding (<= 1.5 scale, one constant per group and row) is below a unit of the integer score.
constexpr float kS8Bias = 12582912.f;  // 1.5 x 2^23: bits 0x4B400000
template <int kGroups, int kNT, bool kBiased = false, typename State>
__device__ __forceinline__ bool fp8_update_scores(State& st, float (&acc_s)[1][kNT][4],
                                                  const float (&scale_log2)[kGroups], const float (&row_scale)[2],
                                                  float (&alpha)[1][2]) {
    constexpr int kNTG = kNT / kGroups;  // n8 blocks per group
    static_assert(kNT % kGroups == 0, "whole n8 blocks per group");
    float tile_max[2];
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            float gm = -INFINITY;
#pragma unroll
            for (int nt = g * kNTG; nt < (g + 1) * kNTG; ++nt) {
                gm = fmaxf(gm, fmaxf(acc_s[0][nt][2 * r], acc_s[0][nt][2 * r + 1]));
            }
            if constexpr (kBiased) gm -= kS8Bias;  // -inf stays -inf
            mx = fmaxf(mx, gm * scale_log2[g]);
        }
        tile_max[r] = quad_max(mx) * row_scale[r];  // the row's scale is positive and the same for every group
        grow |= tile_max[r] > st.row_max[0][r];  // -inf > -inf is false: fully masked rows never ask
    }
    const bool rescale = __any_sync(0xffffffff, grow);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float new_max = rescale ? fmaxf(st.row_max[0][r], tile_max[r]) : st.row_max[0][r];
        const float mm = new_max == -INFINITY ? 0.f : new_max;  // a row with no key yet: exp2 gives 0, not NaN
        alpha[0][r] = exp2f(st.row_max[0][r] - mm);
        const float shift = static_cast<float>(kPOffsetLog2) - mm;
        float sc[kGroups], shift_g[kGroups];
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            sc[g] = scale_log2[g] * row_scale[r];
            shift_g[g] = kBiased ? fmaf(-kS8Bias, sc[g], shift) : shift;
        }
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            const float s = sc[nt / kNTG], sh = shift_g[nt / kNTG];
            acc_s[0][nt][2 * r] = exp2f(fmaf(acc_s[0][nt][2 * r], s, sh));
            acc_s[0][nt][2 * r + 1] = exp2f(fmaf(acc_s[0][nt][2 * r + 1], s, sh));
            sum += acc_s[0][nt][2 * r] + acc_s[0][nt][2 * r + 1];
        }
        st.row_sum[0][r] = st.row_sum[0][r] * alpha[0][r] + sum;  // per-thread partial; quad-reduced at the end
        st.row_max[0][r] = new_max;
    }
    return rescale;
}

template <typename T, typename Traits, bool kCausal>
__device__ __forceinline__ void fp8_consumer(const Fp8Sm90Params& params, const Fp8Smem<Traits>& sm,
                                             const BlockInfo& b, int wg) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kNT = kBlockN / 8;   // n8 blocks of S per warp
    constexpr int kDT = kHeadDim / 8;  // n8 blocks of O per warp
    constexpr int kKP = kBlockN / 32;  // k32 steps of P V
    constexpr int kKGroups = Traits::kKGroups;
    constexpr bool kSerialPv = kBlockN == 256;  // P V of tile j-1 done before S of tile j is issued (H14)
    using Scores = float[1][kNT][4];
    const FlashFwdParams& p = params.f.p;
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32;
    const int wg_row0 = b.m_block * Traits::kBlockM + wg * 64;
    const int warp_row0 = wg_row0 + warp * 16;
    const int k_blocks = (p.seqlen_k + Traits::kKBlock - 1) / Traits::kKBlock;
    const float* k_scale = params.f.k_scale + (static_cast<int64_t>(b.batch) * p.num_kv_heads + b.kv_head) * k_blocks;
    // This thread's two rows' Q scales (rows g and g + 8 of the warp's 16). Rows past seqlen_q (a partial last
    // block) have no scale of their own: their Q rows arrive as zeros, and the last row's scale keeps them finite.
    const float* q_scale = params.f.q_scale + (static_cast<int64_t>(b.batch) * p.num_heads + b.head) * p.seqlen_q;
    float q_row_scale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) q_row_scale[r] = __ldg(q_scale + min(warp_row0 + lane / 4 + 8 * r, p.seqlen_q - 1));

    SoftmaxState<1, kDT, 0, kPOffsetLog2> st;
    st.init();
    Scores acc_s;
    float(&s_flat)[kBlockN / 2] = *reinterpret_cast<float(*)[kBlockN / 2]>(&acc_s[0][0][0]);
    uint32_t s_int[Traits::kQkInt8 ? kBlockN / 2 : 1];  // the INT8 S's accumulators, until s_ready
    float(&o_flat)[kHeadDim / 2] = *reinterpret_cast<float(*)[kHeadDim / 2]>(&st.acc_o[0][0][0]);

    const SmemDesc desc_q = kmajor_desc<Traits::kRowBytes>(sm.q + wg * 64 * Traits::kRowBytes);
    const SmemDesc desc_k0 = kmajor_desc<Traits::kRowBytes>(sm.k);
    // e4m3 V^T: K-major boxes. kPvInput: V MN-major, as the bf16 kernel's (SBO 1024 B between 8-key groups, LBO a
    // slab; a k16 step is 16 rows of 128 bytes).
    const SmemDesc desc_v0 =
        Traits::kPvInput ? SmemDesc::make(sm.vt, Traits::kSlabBytesV, 1024) : kmajor_desc<Traits::kVtBoxKeys>(sm.vt);

    auto issue_qk = [&](int stage) {
        const SmemDesc k = desc_k0 + stage * Traits::kTileBytesK;
        if constexpr (Traits::kQkInt8) {  // the accumulators start at the bias's bits: S arrives as kS8Bias + s
#pragma unroll
            for (int i = 0; i < kBlockN / 2; ++i) s_int[i] = 0x4B400000u;
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 32; ++kk) {
            if constexpr (Traits::kQkInt8) {
                WgmmaS8<kBlockN>::ss(s_int, (desc_q + kk * 32).u64(), (k + kk * 32).u64(), 1);
            } else {
                WgmmaFp8<kBlockN>::ss(s_flat, (desc_q + kk * 32).u64(), (k + kk * 32).u64(), kk > 0);
            }
        }
        wgmma_commit();
    };
    // After S's wgmma wait: keep the compiler from reading S before it (as fence_regs). The INT8 S accumulated onto
    // the bias's bits (issue_qk), so each register already holds the float kS8Bias + s (exact below 2^22; no
    // conversion instruction: v4's integer add after the wait cost ~10 % causal, kernels/NOTES.md), and
    // fp8_update_scores removes the bias.
    auto s_ready = [&] {
        if constexpr (Traits::kQkInt8) {
#pragma unroll
            for (int i = 0; i < kBlockN / 2; ++i) asm volatile("" : "+r"(s_int[i])::"memory");
#pragma unroll
            for (int i = 0; i < kBlockN / 2; ++i) s_flat[i] = __uint_as_float(s_int[i]);
        } else {
            fence_regs(s_flat);
        }
    };
    uint32_t pa[Traits::kPvInput ? 1 : kKP][4];  // P of the previous tile, e4m3, as wgmma A fragments
    uint32_t pa16[Traits::kPvInput ? kBlockN / 16 : 1][1][4];  // kPvInput: P in the input dtype (k16 steps)
    auto pack_p = [&] {
        if constexpr (Traits::kPvInput) {
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) p_fragment<T>(pa16[kk], acc_s, kk);
        } else {
#pragma unroll
            for (int c = 0; c < kKP; ++c) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // keys 32c + [0, 16) and + [16, 32): n8 blocks 4c + 2h, 4c + 2h + 1
                    const float(&lo)[4] = acc_s[0][4 * c + 2 * h];
                    const float(&hi)[4] = acc_s[0][4 * c + 2 * h + 1];
                    pa[c][2 * h] = pack4_e4m3(lo[0], lo[1], hi[0], hi[1]);      // row g
                    pa[c][2 * h + 1] = pack4_e4m3(lo[2], lo[3], hi[2], hi[3]);  // row g + 8
                }
            }
        }
    };
    auto issue_pv = [&](int stage) {
        const SmemDesc v = desc_v0 + stage * Traits::kTileBytesV;
        wgmma_fence();
        if constexpr (Traits::kPvInput) {
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                Wgmma<T, kHeadDim>::template rs<1>(o_flat, pa16[kk][0], (v + kk * 16 * 128).u64(), 1);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < kKP; ++kk) {  // k32 step kk: box (32 kk) / kVtBoxKeys, 32-byte step inside it
                constexpr int kStepsPerBox = Traits::kVtBoxKeys / 32;
                const SmemDesc vk = v + (kk / kStepsPerBox) * Traits::kVtBoxBytes + (kk % kStepsPerBox) * 32;
                WgmmaFp8<kHeadDim>::rs(o_flat, pa[kk], vk.u64(), 1);
            }
        }
        wgmma_commit();
    };
    // The tile's K scales are loaded before its S = Q K^T is issued (tile_scale), so that the loads' latency hides
    // behind the GEMM: read after the wgmma wait (a memory clobber), they would stall every softmax. A 192-key tail
    // tile may reach past the last 64-key group (ceil(seqlen_k / 64) scales): its columns there are masked, and the
    // clamp keeps the read inside this head's scales (a finite scale, so -inf stays -inf).
    auto tile_scale = [&](int n_block, float (&sc)[kKGroups]) {
#pragma unroll
        for (int g = 0; g < kKGroups; ++g) {
            sc[g] = p.scale_log2 * __ldg(k_scale + min(n_block * kKGroups + g, k_blocks - 1));
        }
    };
    auto softmax = [&](int n_block, const float (&sc)[kKGroups], float (&alpha)[1][2]) {
        const int key0 = n_block * kBlockN;
        if (key0 + kBlockN > b.kv_len || (kCausal && key0 + kBlockN - 1 > warp_row0 + b.causal_offset)) {
            mask_scores<kCausal>(acc_s, key0, warp_row0, b.kv_len, b.causal_offset, lane);
        }
        return fp8_update_scores<kKGroups, kNT, Traits::kQkInt8>(st, acc_s, sc, q_row_scale, alpha);
    };
    auto release = [&](uint64_t* bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    // kPvInput: the caller's V rows past kv_len in the tail tile, zeroed as the bf16 kernel does (zero_v_tail). The
    // pre-pass's V^T has zeros there already.
    auto clean_v_tail = [&](int stage, int key0) {
        if constexpr (Traits::kPvInput) {
            zero_v_tail<kBlockN, Traits::kSlabs, Traits::kSlabBytesV, Traits::kConsumerThreads>(
                sm.vt + stage * Traits::kTileBytesV, key0, b.kv_len, p.seqlen_k, tid + wg * 128);
        }
    };

    // Ping-pong as in the bf16 kernel (named barriers 8 + wg).
    constexpr int kLast = Traits::kConsumers - 1;
    const bool pingpong = params.pingpong;
    auto my_turn = [&] {
        if (pingpong) named_barrier_sync(8 + wg, 256);
    };
    auto your_turn = [&] {
        if (pingpong) named_barrier_arrive(8 + (wg == kLast ? 0 : wg + 1), 256);
    };
    if (pingpong && wg == kLast && b.n_blocks > 0) named_barrier_arrive(8, 256);

    mbar_wait(sm.bar_q, 0);
    if (b.n_blocks > 0) {
        float scale0[kKGroups];
        tile_scale(b.n_blocks - 1, scale0);
        mbar_wait(&sm.full_k[0], 0);
        my_turn();
        issue_qk(0);
        your_turn();
        wgmma_wait<0>();
        s_ready();
        release(&sm.empty_k[0]);
        float alpha[1][2];
        softmax(b.n_blocks - 1, scale0, alpha);  // O is still zero: no rescale needed
        pack_p();
    }
    for (int it = 1; it < b.n_blocks; ++it) {
        const int stage = it % Traits::kStages, prev = (it - 1) % Traits::kStages;
        const uint32_t parity = (it / Traits::kStages) & 1, prev_parity = ((it - 1) / Traits::kStages) & 1;
        float scale_it[kKGroups];
        tile_scale(b.n_blocks - 1 - it, scale_it);
        mbar_wait(&sm.full_k[stage], parity);
        mbar_wait(&sm.full_v[prev], prev_parity);
        if (it == 1) clean_v_tail(prev, (b.n_blocks - 1) * kBlockN);  // outside the turn: both consumers meet there
        my_turn();
        if constexpr (kSerialPv) {  // 256 keys: P of tile it-1 leaves the registers before S of tile it arrives
            issue_pv(prev);
            wgmma_wait<0>();
            fence_regs(o_flat);
            release(&sm.empty_v[prev]);
            issue_qk(stage);
            your_turn();
            wgmma_wait<0>();
        } else {
            issue_qk(stage);
            issue_pv(prev);
            your_turn();
            wgmma_wait<1>();
        }
        s_ready();
        release(&sm.empty_k[stage]);
        float alpha[1][2];
        const bool rescale = softmax(b.n_blocks - 1 - it, scale_it, alpha);
        // Non-causal: wait for P V of tile it-1 after the softmax, which then runs under it (H8: +5-6 %). Causal keeps
        // the wait where ptxas hoists a plain one, above the softmax: measured 4-7 % faster there (kernels/NOTES.md).
        if constexpr (!kSerialPv) {
            if constexpr (kCausal) {
                wgmma_wait<0>();
            } else {
                wgmma_wait_after<0>(st.row_sum[0][0], st.row_sum[0][1]);
            }
            fence_regs(o_flat);
            release(&sm.empty_v[prev]);
        }
        if (rescale) st.rescale_o(alpha);
        pack_p();
    }
    if (b.n_blocks > 0) {
        const int last = (b.n_blocks - 1) % Traits::kStages;
        mbar_wait(&sm.full_v[last], ((b.n_blocks - 1) / Traits::kStages) & 1);
        if (b.n_blocks == 1) clean_v_tail(last, 0);
        my_turn();
        issue_pv(last);
        if (wg != kLast) your_turn();
        wgmma_wait<0>();
        fence_regs(o_flat);
        release(&sm.empty_v[last]);
    }

    // Epilogue: O * v_scale[channel] / rowsum (both of 256 P; kPvInput: no V scale), straight from registers (4-byte
    // stores, a quad's 16 bytes contiguous); rows that saw no key write 0 and lse = -inf.
    const int g = lane / 4, t = lane % 4;
    float vs[kDT][2];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
        if constexpr (Traits::kPvInput) {
            vs[dt][0] = vs[dt][1] = 1.f;
        } else {
            const float* v_scale =
                params.f.v_scale + (static_cast<int64_t>(b.batch) * p.num_kv_heads + b.kv_head) * kHeadDim;
            // Two 4-byte loads: the workspace puts v_scale after b hq sq Q scales and b hkv ceil(sk / 64) K scales,
            // an odd count of floats when b, hkv and the K blocks are all odd (MQA, batch 1: a float2 load there
            // faulted with a misaligned address, tests/sanitize_shapes.py --fp8).
            vs[dt][0] = __ldg(v_scale + dt * 8 + 2 * t);
            vs[dt][1] = __ldg(v_scale + dt * 8 + 2 * t + 1);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float s = quad_sum(st.row_sum[0][r]);
        const float inv_sum = s > 0.f ? 1.f / s : 0.f;
        const int row = wg_row0 + warp * 16 + g + r * 8;
        if (row >= p.seqlen_q) continue;
        T* o_row = static_cast<T*>(p.o) + b.batch * p.o_batch_stride + b.head * p.o_head_stride + row * p.o_row_stride;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            *reinterpret_cast<uint32_t*>(o_row + dt * 8 + 2 * t) =
                pack2<T>(st.acc_o[0][dt][2 * r] * inv_sum * vs[dt][0], st.acc_o[0][dt][2 * r + 1] * inv_sum * vs[dt][1]);
        }
        if (p.lse != nullptr && t == 0) {
            const int64_t i = (static_cast<int64_t>(b.batch) * p.num_heads + b.head) * p.seqlen_q + row;
            p.lse[i] = s > 0.f ? (st.row_max[0][r] - kPOffsetLog2 + __log2f(s)) * kLn2 + p.scale * params.f.q_dot_kmean[i]
                               : -INFINITY;
        }
    }
}

template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_fp8_sm90_kernel(const __grid_constant__ Fp8Sm90Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const Fp8Smem<Traits> sm(smem_raw);
    const BlockInfo b = BlockInfo::make<Traits, kCausal, /*kHeadMajor=*/true>(params.f.p);
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
        if (threadIdx.x == 0) fp8_producer<Traits>(params, sm, b);
    } else {
        setmaxnreg_inc<Traits::kConsumerRegs>();
        fp8_consumer<T, Traits, kCausal>(params, sm, b, wg - 1);
    }
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

}  // namespace sm90
}  // namespace llm_attn

// Portable INT8 FlashAttention forward (mma.sync, sm_80 .. sm_90): S = Q K^T in int8, P V in e4m3 (sm_89: the only
// arch with native e4m3 mma.sync; sm_90 emulates it) or in the input dtype (any arch). flash_int8.h says what the call computes; flash_fwd_int8_quant.cuh is the pre-pass
// that writes K (int8, mean-subtracted) and V (e4m3, transposed) into the workspace.
//
// One thread block owns 128 query rows of one (batch, head): 8 warps x 16 rows, as the bf16 kernel's Large tile.
// Prologue: the block's Q tile (fp16/bf16) lands in shared memory; each warp quantises its 16 rows to int8, one
// scale (amax / 127) per row, straight into its m16n8k32 A fragments, which stay in registers for the whole loop,
// and computes q . mean(K) per row for the lse. Main loop over 128-key tiles, double-buffered with cp.async (tile j + 1
// loads while tile j is multiplied):
//   S (int32) = Q8 K8^T by mma.sync m16n8k32 s8. The accumulators start at 0x4B400000 (the float 1.5 * 2^23), so
//     each one, read as a float, is 12582912 + S exactly (|S| <= 128 * 127 * 127 < 2^22): no int -> float
//     conversion instruction; the bias is folded into the exp2's FMA with the dequantisation factor of the row and
//     32-key group, c = q_scale[row] * k_scale[group] * scale * log2(e).
//   Masking only on tiles that cross the causal diagonal or the end of the keys (as the bf16 kernel).
//   fp8_pv: exact running max, P * 256 = exp2(S c - max + 8) <= 256 packed to e4m3 as the A fragments of
//     m16n8k32 (the S accumulator columns of two adjacent n8 tiles are the 4 bytes of one thread, keys 2t, 2t+1,
//     8+2t, 9+2t: the pre-pass stored V^T's keys in that order). Each 128-key tile runs as two 64-key halves (for
//     the registers); per 16 output channels a half's P V goes into a fresh fp32 accumulator (the FP8 mma's internal
//     accumulation is below fp32) that is added to O with the online-softmax rescale in the same FMA:
//     O = O * alpha + P V.
//   otherwise: the bf16 kernel's lazy rescale and P V (m16n8k16 in the input dtype, V as given, ldmatrix.trans).
// Epilogue as the bf16 kernel: O / rowsum (* v_scale per channel with fp8_pv) staged through shared memory into
// 16-byte coalesced stores; lse = (max + log2(sum)) ln 2 + scale * q . mean(K).
#pragma once

#include <type_traits>

#include "flash_int8.h"
#include "mma_frag.cuh"
#include "ptx.cuh"
#include "smem_tile.cuh"
#include "softmax.cuh"

namespace llm_attn {
namespace int8fwd {

// ---- PTX ---------------------------------------------------------------------------------------------------------
// m16n8k32 fragments (PTX ISA "Matrix fragments for mma.m16n8k32", 8-bit types), g = lane / 4, t = lane % 4:
//   A (16x32, row): a0 = (g, 4t..4t+3)  a1 = (g+8, 4t..)  a2 = (g, 16+4t..)  a3 = (g+8, 16+4t..)   4 bytes each
//   B (32x8,  col): b0 = (k 4t..4t+3, n g)  b1 = (k 16+4t.., n g)
//   C (16x8, s32/f32): as m16n8k16: c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// In bytes these are the m16n8k16 fp16 layouts, so the ldmatrix patterns of the bf16 kernel load them unchanged.

// D = A B + D, int8 x int8 -> int32.
__device__ __forceinline__ void mma_s8(uint32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// D = A B + (c, c, c, c): the first k-step, accumulating onto a constant.
__device__ __forceinline__ void mma_s8_from(uint32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                            uint32_t c) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c));
}
// D = A B + D, e4m3 x e4m3 -> fp32 (sm_89+; the fp8 variant's body is a trap below sm_89).
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}
// Four floats -> four e4m3 bytes (round to nearest even, saturating), a in the lowest (sm_89+).
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
    uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n"
        : "=r"(r)
        : "f"(a), "f"(b), "f"(c), "f"(d));
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
    return r;
}
// Four ints in [-127, 127] -> four int8 bytes, a in the lowest.
__device__ __forceinline__ uint32_t pack4_s8_regs(int a, int b, int c, int d) {
    return (static_cast<uint32_t>(a) & 0xffu) | ((static_cast<uint32_t>(b) & 0xffu) << 8) |
           ((static_cast<uint32_t>(c) & 0xffu) << 16) | (static_cast<uint32_t>(d) << 24);
}

// ---- shared-memory tiles of bytes ----------------------------------------------------------------------------------
// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of kRowBytes-long rows: the 8 rows an
// ldmatrix phase reads (same logical chunk) land in 8 different 16-byte bank groups. Rows of >= 128 bytes XOR the
// chunk with row % 8 (as swz); 64-byte rows (two per 128-byte bank line) with (row / 2) % 4.
template <int kRowBytes>
__device__ __forceinline__ int swz_bytes(int row, int chunk) {
    static_assert(kRowBytes == 64 || kRowBytes % 128 == 0, "64-byte rows or multiples of 128 bytes");
    if constexpr (kRowBytes == 64) {
        return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
    } else {
        return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
    }
}

// Async copy of a [kRows][kRowBytes] byte tile whose rows all exist in global memory (the workspace is padded to
// whole tiles). As load_tile_async: thread tid copies chunk tid % kChunks of rows tid / kChunks + i * kRowStep, so the
// swizzle term is fixed per thread and the source advances by a constant.
template <int kRows, int kRowBytes, int kThreads>
__device__ __forceinline__ void load_bytes_tile(unsigned char* smem, const void* gmem, int64_t row_stride, int tid) {
    constexpr int kChunks = kRowBytes / 16;
    constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRows % kRowStep == 0, "the tile's chunks divide among the threads");
    static_assert(kRowStep % 8 == 0, "row step must keep the swizzle phase fixed");
    const int row = tid / kChunks;
    const int chunk = tid % kChunks;
    const unsigned char* src = static_cast<const unsigned char*>(gmem) + row * row_stride + chunk * 16;
    unsigned char* dst = smem + swz_bytes<kRowBytes>(row, chunk);
#pragma unroll
    for (int it = 0; it < kRows / kRowStep; ++it) {
        cp_async_16(dst + it * kRowStep * kRowBytes, src, true);
        src += kRowStep * row_stride;
    }
}

// ---- traits ------------------------------------------------------------------------------------------------------
// 128 query rows (8 warps x 16, Q in registers: 16 x head_dim int8 = 4 registers per k32 step) x 128 keys per tile.
// Shared memory per stage: K int8 [128][head_dim] + V: e4m3 V^T [head_dim][128] (fp8_pv) or V [128][head_dim] in the
// input dtype. The block's Q tile (fp16/bf16, 128 x head_dim) is staged in stage 1, which is free until the loop's
// first prefetch, and O in stage 0 after the loop:
//   head_dim 128: fp8_pv 2 x (16 + 16) KB = 64 KB; input-dtype V 2 x (16 + 32) KB = 96 KB
//   head_dim  64: fp8_pv 2 x ( 8 +  8) KB = 32 KB; input-dtype V 2 x ( 8 + 16) KB = 48 KB
// all within sm_86/89's 99 KB per block.
template <int kHeadDim_, bool kFp8PV_>
struct Int8FwdTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr bool kFp8PV = kFp8PV_;
    static constexpr int kBlockM = kInt8BlockM;
    static constexpr int kBlockN = kInt8BlockN;
    static constexpr int kWarpRows = kInt8WarpRows;
    static constexpr int kNWarps = kBlockM / kWarpRows;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per fp16/bf16 row (load_tile_async, swz)
    static constexpr int kKTileBytes = kBlockN * kHeadDim;
    static constexpr int kVRowBytes = kFp8PV ? kBlockN : 2 * kHeadDim;
    static constexpr int kVTileBytes = kFp8PV ? kHeadDim * kBlockN : kBlockN * kHeadDim * 2;
    static constexpr int kStageBytes = kKTileBytes + kVTileBytes;
    // fp8: the warps' int8 Q fragments live in shared memory (lane-private, 16 bytes per lane and k32 step, re-read
    // per tile) instead of registers: with them in registers the fp8 configuration exceeds 255 (spills).
    static constexpr bool kQInSmem = kFp8PV;
    static constexpr int kQ8Bytes = kQInSmem ? kBlockM * kHeadDim : 0;
    static constexpr int kSmemBytes = 2 * kStageBytes + kQ8Bytes;
    // e4m3 mma.sync is native on sm_89 only: sm_90 has it in PTX but ptxas lowers it to e4m3 -> f16 unpacks plus
    // HMMA.16816 (slower than P V in fp16/bf16, and it spills), so the fp8 configuration is built for sm_89 alone.
    static constexpr int kMinArch = kFp8PV ? 890 : 0;
    static constexpr int kMaxArch = kFp8PV ? 899 : 100000;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim must be 64 or 128");
    static_assert(kBlockN % 32 == 0, "P V takes the tile's keys 32 at a time");
    static_assert(kBlockM * kHeadDim * 2 <= kStageBytes, "the Q tile is staged in stage 1");
    static_assert(kSmemBytes <= 99 * 1024, "fits sm_86/89's 99 KB per block");
    static_assert((kBlockM * kChunks) % kThreads == 0 && (kBlockN * kChunks) % kThreads == 0,
                  "fp16/bf16 tile copies divide among the threads");
};

// ---- the block -----------------------------------------------------------------------------------------------------
constexpr uint32_t kSBias = 0x4B400000u;  // int32 accumulator start: as a float, 1.5 * 2^23 + S
constexpr float kSBiasF = 12582912.f;     // 1.5 * 2^23
constexpr uint32_t kSMasked = 0xff800000u;  // -inf as float bits

// Masks this warp's S tile (biased accumulators as float bits): keys past the end, and above the diagonal.
template <bool kCausal, int kNT>
__device__ __forceinline__ void mask_biased(uint32_t (&s)[kNT][4], int key0, int row0, int seqlen_k, int causal_offset,
                                            int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + nt * 8 + 2 * t + (e & 1);
            const int row = row0 + g + (e >= 2 ? 8 : 0);
            if (key >= seqlen_k || (kCausal && key > row + causal_offset)) s[nt][e] = kSMasked;
        }
}

template <typename T, typename Traits, bool kCausal>
__device__ __forceinline__ void flash_fwd_int8_block(const FlashFwdInt8Params& p) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kWarpRows = Traits::kWarpRows;
    constexpr bool kFp8 = Traits::kFp8PV;
    constexpr int kDT = kHeadDim / 8;    // n8 tiles of O
    constexpr int kKQ = kHeadDim / 32;   // k32 steps of Q K^T
    constexpr int kSubN = 64;            // fp8: keys per softmax / P V step (two per 128-key tile)
    // fp8: P * 2^kPOff with the exact running max, so P <= 256 < 448 (e4m3's largest) and values down to 2^-17 of the
    // max stay representable. Input dtype: the bf16 kernel's lazy rescale (P <= 2^8 with a stale max).
    constexpr float kPOff = kFp8 ? 8.f : 0.f;
    constexpr float kRescaleLog2 = 8.f;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t smem = smem_u32(smem_raw);

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    // Causal: heads in x, m_block counting down from the last (longest) row block, as the bf16 kernel.
    const int m_block = kCausal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    const int head = kCausal ? blockIdx.x : blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (p.num_heads / p.num_kv_heads);
    const int64_t bhk = static_cast<int64_t>(batch) * p.num_kv_heads + kv_head;

    const int seqlen_q = p.seqlen_q;
    const int seqlen_k = p.seqused_k ? max(0, min(p.seqused_k[batch], p.seqlen_k)) : p.seqlen_k;
    const int seqlen_k_pad = int8_seqlen_k_pad(p.seqlen_k);
    const int causal_offset = seqlen_k - seqlen_q;  // row i sees keys j <= i + causal_offset
    const int row0 = m_block * kBlockM;
    const int warp_row0 = row0 + warp * kWarpRows;

    int n_block_max = (seqlen_k + kBlockN - 1) / kBlockN;
    if (kCausal) {
        const int last_key = min(row0 + kBlockM - 1 + causal_offset, seqlen_k - 1);
        n_block_max = min(n_block_max, last_key < 0 ? 0 : last_key / kBlockN + 1);
    }

    const T* q_ptr = reinterpret_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride +
                     static_cast<int64_t>(row0) * p.q_row_stride;
    const int8_t* k_q = p.k_int8 + bhk * seqlen_k_pad * kHeadDim;
    const float* k_scale = p.k_scale + bhk * (seqlen_k_pad / kInt8KBlock);

    auto load_k = [&](int n_block, int stage) {
        load_bytes_tile<kBlockN, kHeadDim, Traits::kThreads>(smem_raw + stage * Traits::kStageBytes,
                                                             k_q + static_cast<int64_t>(n_block) * kBlockN * kHeadDim,
                                                             kHeadDim, tid);
    };
    auto load_v = [&](int n_block, int stage) {
        unsigned char* dst = smem_raw + stage * Traits::kStageBytes + Traits::kKTileBytes;
        if constexpr (kFp8) {
            // V^T tile-major: tile n of (batch, KV head) is one contiguous [head_dim][128] block.
            load_bytes_tile<kHeadDim, kBlockN, Traits::kThreads>(
                dst, p.v_fp8 + (bhk * (seqlen_k_pad / kBlockN) + n_block) * (kHeadDim * kBlockN), kBlockN, tid);
        } else {
            // V as given: rows past the valid keys are zero-filled, never read (they may be NaN).
            const int kv = n_block * kBlockN;
            const T* v_ptr = reinterpret_cast<const T*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
            load_tile_async<Traits, kBlockN>(reinterpret_cast<T*>(dst), v_ptr + kv * p.v_row_stride, p.v_row_stride,
                                             seqlen_k - kv, tid);
        }
    };
    auto need_mask = [&](int n_block) {
        const int key0 = n_block * kBlockN;
        return key0 + kBlockN > seqlen_k || (kCausal && key0 + kBlockN - 1 > warp_row0 + causal_offset);
    };
    // A tile above the diagonal for every row of the warp: the warp skips it.
    auto warp_masked_out = [&](int n_block) {
        return kCausal && n_block * kBlockN > warp_row0 + kWarpRows - 1 + causal_offset;
    };

    float acc_o[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};
    float q_mean[2] = {0.f, 0.f};  // q . mean(K) of rows g, g + 8 (the lse's correction for K's smoothing)

    if (n_block_max > 0) {
        // Prologue: Q into stage 1, tile 0 into stage 0.
        T* sQ = reinterpret_cast<T*>(smem_raw + Traits::kStageBytes);
        load_tile_async<Traits, kBlockM>(sQ, q_ptr, p.q_row_stride, seqlen_q - row0, tid);
        load_k(0, 0);
        load_v(0, 0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        // This warp's 16 rows -> int8 A fragments: k32 step kk, register 2 h + r holds row g + 8 r, columns
        // 32 kk + 16 h + 4t .. +3 (8 bytes of one swizzled 16-byte chunk). Two passes: the amax, then the values.
        uint32_t q_frag[kKQ][4];
        float c_row[2];  // q_scale * scale * log2(e) of rows g and g + 8
        uint4* sQ8 = reinterpret_cast<uint4*>(smem_raw + 2 * Traits::kStageBytes) + warp * kKQ * 32 + lane;
        {
            auto q_at = [&](int kk, int h, int r) {
                const int row = warp * kWarpRows + g + 8 * r;
                const uint2 u = *reinterpret_cast<const uint2*>(sQ + swz<kHeadDim>(row, 4 * kk + 2 * h + t / 2) +
                                                                4 * (t & 1));
                const float2 lo = unpack2<T>(u.x), hi = unpack2<T>(u.y);
                return make_float4(lo.x, lo.y, hi.x, hi.y);
            };
            // A row's values are held by the 4 lanes of its quad: the row's amax is their max.
            float amax[2] = {0.f, 0.f}, inv[2];
#pragma unroll
            for (int kk = 0; kk < kKQ; ++kk)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const float4 x = q_at(kk, h, r);
                        amax[r] = fmaxf(amax[r], fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))));
                    }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                amax[r] = quad_max(amax[r]);
                inv[r] = amax[r] > 0.f ? __fdiv_rn(127.f, amax[r]) : 0.f;
                c_row[r] = __fdiv_rn(amax[r], 127.f) * p.scale_log2;
            }
            const bool want_lse = p.lse != nullptr;
            const float* mean = p.k_mean + bhk * kHeadDim;
#pragma unroll
            for (int kk = 0; kk < kKQ; ++kk)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float4 mu = want_lse ? *reinterpret_cast<const float4*>(mean + 32 * kk + 16 * h + 4 * t)
                                               : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const float4 x = q_at(kk, h, r);
                        const float s = inv[r];
                        q_frag[kk][2 * h + r] = pack4_s8_regs(__float2int_rn(x.x * s), __float2int_rn(x.y * s),
                                                              __float2int_rn(x.z * s), __float2int_rn(x.w * s));
                        q_mean[r] += x.x * mu.x + x.y * mu.y + x.z * mu.z + x.w * mu.w;
                    }
                }
            q_mean[0] = quad_sum(q_mean[0]);
            q_mean[1] = quad_sum(q_mean[1]);
            if constexpr (Traits::kQInSmem) {
#pragma unroll
                for (int kk = 0; kk < kKQ; ++kk)
                    sQ8[kk * 32] = make_uint4(q_frag[kk][0], q_frag[kk][1], q_frag[kk][2], q_frag[kk][3]);
            }
        }
        __syncthreads();  // every warp has read Q: stage 1 is free for tile 1

        // ldmatrix lane constants. K (rows = keys, head_dim bytes) and fp8 V^T (rows = channels, 128 bytes): row
        // ld_row of each 16-row block, chunk (2 kk + cbit) ^ phase = ((2 kk) ^ (phase & ~1)) + (cbit ^ (phase & 1))
        // with phase the row's swizzle term (swz_bytes); only the XOR with the even chunk index varies per k-step.
        const int ld_row = lane % 8 + (lane / 16) * 8;
        const int ld_cbit = (lane / 8) % 2;
        const int k_phase = kHeadDim == 64 ? (ld_row >> 1) & 3 : ld_row & 7;
        const int v_phase = ld_row & 7;
        const uint32_t k_lane = ld_row * kHeadDim + ((ld_cbit ^ (k_phase & 1)) << 4);
        const uint32_t v_lane = ld_row * kBlockN + ((ld_cbit ^ (v_phase & 1)) << 4);
        const int k_phase_hi = k_phase & ~1, v_phase_hi = v_phase & ~1;
        // Input-dtype V: the bf16 kernel's ldmatrix.trans pattern.
        const SwzCols cols(lane);
        const int v_row = (lane % 8) + ((lane / 8) % 2) * 8;
        const int cbit_v = ((lane / 16) ^ (lane & 1)) * 8;

        // Mask only key ranges that reach past the last key or cross the diagonal of the warp's rows; a range
        // above the diagonal for every row of the warp is skipped by the warp.
        auto need_mask = [&](int key0, int width) {
            return key0 + width > seqlen_k || (kCausal && key0 + width - 1 > warp_row0 + causal_offset);
        };
        auto warp_masked_out = [&](int key0) { return kCausal && key0 > warp_row0 + kWarpRows - 1 + causal_offset; };

        // The math of kN keys [key0, key0 + kN) of the tile in stage sK / sV (koff: their offset in the tile), ks the
        // K scales of those keys (one per kInt8KBlock): S, the online softmax, O += P V.
        auto tile_math = [&](auto kn, int key0, uint32_t sK, uint32_t sV, int koff, const float* ks) {
            constexpr int kN = decltype(kn)::value;
            constexpr int kNTs = kN / 8;
            constexpr int kGroups = kN / kInt8KBlock, kNTG = kInt8KBlock / 8;  // K-scale groups; n-tiles in one
            // Dequantisation factor per row and group (> 0, so that an all-zero Q row or K group gives scores 0,
            // not NaN); loaded before S's mma so that the loads' latency hides behind them.
            float c[2][kGroups];
#pragma unroll
            for (int gi = 0; gi < kGroups; ++gi) {
                const float k = __ldg(ks + gi);
                c[0][gi] = fmaxf(c_row[0] * k, 1e-30f);
                c[1][gi] = fmaxf(c_row[1] * k, 1e-30f);
            }
            uint32_t s[kNTs][4];
            // S = Q8 K8^T + bias.
            const uint32_t k_base = sK + koff * kHeadDim + k_lane;
            if constexpr (Traits::kQInSmem) {
                // k32 step 0 onto the bias, then steps 1 .. kKQ - 1 in a rolled loop: unrolled, ptxas issues every
                // step's K fragments at once and the kernel spills.
                auto qk_step = [&](int kk, auto first) {
                    const uint4 u = sQ8[kk * 32];
                    const uint32_t a[4] = {u.x, u.y, u.z, u.w};
                    const uint32_t k_addr = k_base + (((2 * kk) ^ k_phase_hi) << 4);
#pragma unroll
                    for (int np = 0; np < kNTs / 2; ++np) {
                        uint32_t b[4];
                        ldsm_x4(b, k_addr + np * 16 * kHeadDim);
                        if constexpr (decltype(first)::value) {
                            mma_s8_from(s[2 * np], a, b[0], b[1], kSBias);
                            mma_s8_from(s[2 * np + 1], a, b[2], b[3], kSBias);
                        } else {
                            mma_s8(s[2 * np], a, b[0], b[1]);
                            mma_s8(s[2 * np + 1], a, b[2], b[3]);
                        }
                    }
                };
                qk_step(0, std::true_type{});
#pragma unroll 1
                for (int kk = 1; kk < kKQ; ++kk) qk_step(kk, std::false_type{});
            } else {
#pragma unroll
                for (int kk = 0; kk < kKQ; ++kk) {
                    const uint32_t k_addr = k_base + (((2 * kk) ^ k_phase_hi) << 4);
#pragma unroll
                    for (int np = 0; np < kNTs / 2; ++np) {
                        uint32_t b[4];
                        ldsm_x4(b, k_addr + np * 16 * kHeadDim);
                        if (kk == 0) {
                            mma_s8_from(s[2 * np], q_frag[0], b[0], b[1], kSBias);
                            mma_s8_from(s[2 * np + 1], q_frag[0], b[2], b[3], kSBias);
                        } else {
                            mma_s8(s[2 * np], q_frag[kk], b[0], b[1]);
                            mma_s8(s[2 * np + 1], q_frag[kk], b[2], b[3]);
                        }
                    }
                }
            }
            if (need_mask(key0, kN)) mask_biased<kCausal>(s, key0, warp_row0, seqlen_k, causal_offset, lane);

            // Each row's max in the base-2 scaled domain: each group's max times its factor (c > 0, so a masked -inf
            // stays -inf), then the quad's.
            float tile_max[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int gi = 0; gi < kGroups; ++gi) {
                    float gm = -INFINITY;
#pragma unroll
                    for (int nt = gi * kNTG; nt < (gi + 1) * kNTG; ++nt)
                        gm = fmaxf(gm, fmaxf(__uint_as_float(s[nt][2 * r]), __uint_as_float(s[nt][2 * r + 1])));
                    mx = fmaxf(mx, (gm - kSBiasF) * c[r][gi]);
                }
                tile_max[r] = quad_max(mx);
            }
            float alpha[2], nb[2][kGroups];
            bool rescale = true;
            if constexpr (!kFp8) {
                const bool grow = tile_max[0] > row_max[0] + kRescaleLog2 || tile_max[1] > row_max[1] + kRescaleLog2;
                rescale = __any_sync(0xffffffffu, grow);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float new_max = rescale ? fmaxf(row_max[r], tile_max[r]) : row_max[r];
                // A row that has seen only masked keys keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
                const float mm = new_max == -INFINITY ? 0.f : new_max;
                alpha[r] = exp2f(row_max[r] - mm);
                row_max[r] = new_max;
#pragma unroll
                for (int gi = 0; gi < kGroups; ++gi) {  // exp2(S c - mm + kPOff) = exp2(fma(12582912 + S, c, nb))
                    nb[r][gi] = -fmaf(kSBiasF, c[r][gi], mm - kPOff);
                }
            }
            float sum[2] = {0.f, 0.f};
            auto p_of = [&](int nt, int e) {
                const float v = exp2f(fmaf(__uint_as_float(s[nt][e]), c[e / 2][nt / kNTG], nb[e / 2][nt / kNTG]));
                sum[e / 2] += v;
                return v;
            };

            if constexpr (kFp8) {
                // P * 256 -> e4m3 A fragments: k32 step kk = n8 tiles 4 kk .. 4 kk + 3.
                uint32_t pf[kN / 32][4];
#pragma unroll
                for (int kk = 0; kk < kN / 32; ++kk) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int nt = 4 * kk + 2 * h;
                        const float a0 = p_of(nt, 0), a1 = p_of(nt, 1), a2 = p_of(nt, 2), a3 = p_of(nt, 3);
                        const float b0 = p_of(nt + 1, 0), b1 = p_of(nt + 1, 1), b2 = p_of(nt + 1, 2),
                                    b3 = p_of(nt + 1, 3);
                        pf[kk][2 * h] = pack4_e4m3(a0, a1, b0, b1);
                        pf[kk][2 * h + 1] = pack4_e4m3(a2, a3, b2, b3);
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * alpha[r] + sum[r];
                // O = O * alpha + P V, 16 channels (two n8 tiles) at a time through a fresh fp32 accumulator.
                uint32_t v_addr[kN / 32];
#pragma unroll
                for (int kk = 0; kk < kN / 32; ++kk) v_addr[kk] = sV + v_lane + (((koff / 16 + 2 * kk) ^ v_phase_hi) << 4);
#pragma unroll
                for (int dp = 0; dp < kDT / 2; ++dp) {
                    float o0[4] = {0.f, 0.f, 0.f, 0.f}, o1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int kk = 0; kk < kN / 32; ++kk) {
                        uint32_t b[4];
                        ldsm_x4(b, v_addr[kk] + dp * 16 * kBlockN);
                        mma_e4m3(o0, pf[kk], b[0], b[1]);
                        mma_e4m3(o1, pf[kk], b[2], b[3]);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc_o[2 * dp][e] = fmaf(acc_o[2 * dp][e], alpha[e / 2], o0[e]);
                        acc_o[2 * dp + 1][e] = fmaf(acc_o[2 * dp + 1][e], alpha[e / 2], o1[e]);
                    }
                }
            } else {
                float pt[kNTs][4];
#pragma unroll
                for (int nt = 0; nt < kNTs; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) pt[nt][e] = p_of(nt, e);
#pragma unroll
                for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * alpha[r] + sum[r];
                if (rescale) {
#pragma unroll
                    for (int dt = 0; dt < kDT; ++dt) {
                        acc_o[dt][0] *= alpha[0];
                        acc_o[dt][1] *= alpha[0];
                        acc_o[dt][2] *= alpha[1];
                        acc_o[dt][3] *= alpha[1];
                    }
                }
                const T* cV = reinterpret_cast<const T*>(smem_raw + (sV - smem));
#pragma unroll
                for (int kk = 0; kk < kN / 16; ++kk) {
                    mma_c_as_a<T>(one_mtile(acc_o), one_mtile(pt), kk, [&](uint32_t (&b)[4], int dp) {
                        ldmatrix_x4_trans(b, cV + (v_row + koff + kk * 16) * kHeadDim + cols(dp, cbit_v));
                    });
                }
            }
        };

        for (int n_block = 0; n_block < n_block_max; ++n_block) {
            const int stage = n_block & 1;
            if (n_block + 1 < n_block_max) {
                load_k(n_block + 1, stage ^ 1);
                load_v(n_block + 1, stage ^ 1);
            }
            cp_async_commit();
            const uint32_t sK = smem + stage * Traits::kStageBytes;
            const uint32_t sV = sK + Traits::kKTileBytes;
            const int key0 = n_block * kBlockN;
            if constexpr (kFp8) {
                // Two 64-key halves in a rolled loop: S, P and the prefetched K/V fragments of a whole 128-key tile
                // do not fit 255 registers beside O (ptxas spilled 16-24 bytes on sm_89).
#pragma unroll 1
                for (int koff = 0; koff < kBlockN; koff += kSubN) {
                    if (!warp_masked_out(key0 + koff))
                        tile_math(std::integral_constant<int, kSubN>{}, key0 + koff, sK, sV, koff,
                                  k_scale + (key0 + koff) / kInt8KBlock);
                }
            } else if (!warp_masked_out(key0)) {
                tile_math(std::integral_constant<int, kBlockN>{}, key0, sK, sV, 0, k_scale + key0 / kInt8KBlock);
            }
            cp_async_wait<0>();
            __syncthreads();  // tile n + 1 landed for everyone; everyone is done reading tile n's stage
        }
    }

    // Epilogue: normalise, write O (and lse). Rows that saw no key write 0 and lse = -inf.
    float inv_sum[2], lse[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float s = quad_sum(row_sum[r]);
        inv_sum[r] = s > 0.f ? 1.f / s : 0.f;
        lse[r] = s > 0.f ? (row_max[r] - kPOff + __log2f(s)) * kLn2 + p.scale * q_mean[r] : -INFINITY;
    }
    __syncthreads();
    T* sO = reinterpret_cast<T*>(smem_raw);
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
        // fp8: V's per-channel scale (only read when the pre-pass ran, i.e. the block saw a key)
        float2 vs = make_float2(1.f, 1.f);
        if constexpr (kFp8) {
            if (n_block_max > 0) vs = *reinterpret_cast<const float2*>(p.v_scale + bhk * kHeadDim + dt * 8 + 2 * t);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp * kWarpRows + g + r * 8;
            *reinterpret_cast<uint32_t*>(sO + swz<kHeadDim>(row, dt) + 2 * t) =
                pack2<T>(acc_o[dt][2 * r] * inv_sum[r] * vs.x, acc_o[dt][2 * r + 1] * inv_sum[r] * vs.y);
        }
    }
    if (p.lse != nullptr && t == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + warp * kWarpRows + g + r * 8;
            if (row < seqlen_q) p.lse[(static_cast<int64_t>(batch) * p.num_heads + head) * seqlen_q + row] = lse[r];
        }
    }
    __syncthreads();
    T* o_ptr = reinterpret_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
               static_cast<int64_t>(row0) * p.o_row_stride;
    constexpr int kIters = kBlockM * Traits::kChunks / Traits::kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const int idx = it * Traits::kThreads + tid;
        const int row = idx / Traits::kChunks;
        const int chunk = idx % Traits::kChunks;
        if (row0 + row < seqlen_q) {
            *reinterpret_cast<uint4*>(o_ptr + static_cast<int64_t>(row) * p.o_row_stride + chunk * 8) =
                *reinterpret_cast<const uint4*>(sO + swz<kHeadDim>(row, chunk));
        }
    }
}

// The fp8 configurations have device code for sm_89 only: elsewhere the host never selects them
// (run_flash_fwd_int8 refuses) and the body is a trap.
template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_fwd_int8_kernel(const FlashFwdInt8Params p) {
#if defined(__CUDA_ARCH__)
    if constexpr (__CUDA_ARCH__ < Traits::kMinArch || __CUDA_ARCH__ > Traits::kMaxArch) {
        __trap();
    } else {
        flash_fwd_int8_block<T, Traits, kCausal>(p);
    }
#endif
}

}  // namespace int8fwd
}  // namespace llm_attn

// v1 of the prefill over the FP8 KV cache (LLM_ATTN_FP8KV_PREFILL_V=1); v2, the default, converts each tile to fp16
// once per block in shared memory (flash_prefill_fp8kv_v2.cuh; kernels/NOTES.md "Prefill over the FP8 KV cache v2").
// This file holds the one kernel template of both (flash_prefill_fp8kv_kernel<T, Traits>, Traits::kVersion).
//
// Prefill over the FP8 (e4m3) KV cache: the chunked-prefill call (q_len < kv_len, or q_len == kv_len) that has more
// packed rows than the decode kernel holds (kDecodeMaxRows). FlashAttention-2's structure (one block per (row
// block, KV head, batch), each warp owns 16 packed rows and sees every key, one online-softmax update per 64-key
// tile, no cross-warp merge, no KV splits) with the decode kernel's arithmetic and fragment tricks
// (flash_decode_fp8kv_kernel.cuh, whose header comment explains them), so that both give the same numbers:
//   - K and V stay e4m3 bytes from global memory to registers (cp.async byte copies into XOR-swizzled tiles), and
//     become fp16 MMA operands x 2^-8 in registers (e4m3x2_to_half2_scaled: exact, no FP8 hardware, sm_80 onwards);
//   - Q rounded to fp16 when staged (bf16 queries too), every MMA fp16 x fp16 -> fp32;
//   - scores scaled by softmax_scale * k_scale[tile] * 256, the online softmax's exact running max (P <= 1),
//     P * v_scale[tile] * 256 rounded to fp16 as P V's A operand, row sums of the unscaled P.
// What differs from the decode kernel: rows are packed as there (row = qi * group + head_in_group) but a block holds
// kRows = 16 kNWarps of them and every warp iterates the four 16-key slices of a tile that the decode kernel gives
// to its four warps (same k_row0 / v_row0 mapping, `warp` replaced by the slice), so S is [8 n-tiles][4] per warp
// and the output goes straight from registers to global memory. Causal: a block's key tiles end at its last row's
// limit (row i sees keys <= i + seqlen_k - seqlen_q); tiles crossing a row's limit or seqlen_k are masked per
// element. Blocks are issued last row block first, so the longest causal blocks start first.
//
// On sm_89 and later the bytes become fp16 with the hardware's cvt.rn.f16x2.e4m3x2 (one instruction per pair instead
// of the bit trick's four: the conversions are most of this kernel's issue slots): exact too, but the true values,
// not x 2^-8. The x256 then leaves the score scale, P keeps it (the same fp16 P * v_scale * 256 as the reference), and
// the output takes the 2^-8 back, all powers of two: the same numbers either way.
//
// Q is staged in the last pipeline stage's buffer (the prologue fills stages 0 .. kStages - 2 only): Q's fp16 tile
// (kRows x head_dim x 2 bytes) is exactly one stage's K + V bytes (2 x 64 x head_dim) for kRows = 64. It is staged
// in fragment order: per (warp, k-step pair p, lane) the 8 words of the lane's two A fragments (the decode kernel's
// channel mapping: row g and g + 8, channels 32 p + 8 t ..), so that each fragment is one 16-byte load into four
// adjacent registers, the quad mma.sync reads (from the decode kernel's row-major tile, ptxas re-assembled the quad
// with four moves before every Q K^T mma). Each warp loads its Q fragments on the first tile, and a barrier then
// hands the buffer to the pipeline.
#pragma once

#include "flash_decode_fp8kv_kernel.cuh"  // k_pair, v_pair, kFp8KvOperandScale, to_half2, swz8, FlashDecodeFp8KvParams
#include "flash_prefill_fp8kv_v2.cuh"     // v2: PrefillFp8KvV2Traits, flash_prefill_fp8kv_v2_body

namespace llm_attn {


template <int kHeadDim_, int kNWarps_, int kStages_>
struct PrefillFp8KvTraits {
    static constexpr int kVersion = 1;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kStages = kStages_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kRows = 16 * kNWarps;     // packed query rows per block: one m16 tile per warp
    static constexpr int kBlockN = 64;             // keys per tile = the cache's 64-token scale block
    static constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks per e4m3 key row
    static constexpr int kQChunks = kHeadDim / 8;  // 16-byte chunks per fp16 Q row
    static constexpr int kSmemScales = 128;        // k and v scale per stage, padded
    static constexpr int kSmemKV = kBlockN * kHeadDim;   // bytes of one operand's tile
    static constexpr int kSmemStage = 2 * kSmemKV;       // K then V
    static constexpr int kSmemQ = kRows * kHeadDim * 2;  // fp16 Q, staged in the last stage
    static constexpr int kSmemBytes = kSmemScales + kStages * kSmemStage;
    static_assert(kSmemQ <= kSmemStage, "Q is staged in one pipeline stage");
    static_assert(kStages >= 2, "need at least double buffering");
    static_assert(kStages * 2 * 4 <= kSmemScales, "scales must fit");
    static_assert((kBlockN * kChunks) % kThreads == 0, "tile copy must divide evenly among threads");
    static_assert((kThreads / kChunks) % 16 == 0, "row step must keep the swizzle phase fixed");
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
};

template <typename T, typename Traits>
__device__ __forceinline__ void flash_prefill_fp8kv_body(const FlashDecodeFp8KvParams& fp) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kRows = Traits::kRows;
    constexpr int kStages = Traits::kStages;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kDT = kHeadDim / 8;   // n-tiles of O; also the bytes of a V row one thread reads
    constexpr int kKP = kHeadDim / 32;  // k-step pairs of Q K^T
    constexpr int kSlices = kBlockN / 16;
    const FlashFwdParams& params = fp.base;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* sScale = reinterpret_cast<float*>(smem_raw);                    // [kStages][2]
    unsigned char* sKV = smem_raw + Traits::kSmemScales;                   // [kStages][K, V][kBlockN][kHeadDim]
    // [warps][kKP][32 lanes][8 words]: fragment order (the header comment)
    uint32_t* sQ = reinterpret_cast<uint32_t*>(sKV + (kStages - 1) * Traits::kSmemStage);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int row_block = gridDim.x - 1 - blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const Fp8KvPrefillBlock blk(fp, row_block, kv_head, batch, kRows, kBlockN);
    const int group = blk.group, seqlen_q = params.seqlen_q, num_rows = blk.num_rows, row0 = blk.row0;
    const int seqlen_k = blk.seqlen_k, causal_offset = blk.causal_offset, n_tiles = blk.n_tiles;
    const unsigned char *k_ptr = blk.k_ptr, *v_ptr = blk.v_ptr;
    const float *ks_ptr = blk.ks_ptr, *vs_ptr = blk.vs_ptr;

    // As the decode kernel: thread tid copies chunk tid % kChunks of rows tid / kChunks + i * kRowStep of K and V;
    // rows past the valid keys are zero-filled; thread 0 also copies the tile's two scales.
    constexpr int kRowStep = Traits::kThreads / Traits::kChunks;
    const int cp_row = tid / Traits::kChunks, cp_chunk = tid % Traits::kChunks;
    auto load_kv = [&](int tile, int stage) {
        const int kv = tile * kBlockN;
        unsigned char* sK = sKV + stage * Traits::kSmemStage;
#pragma unroll
        for (int it = 0; it < kBlockN / kRowStep; ++it) {
            const int row = cp_row + it * kRowStep;
            const bool ok = kv + row < seqlen_k;
            const int64_t koff = static_cast<int64_t>(kv + row) * params.k_row_stride + cp_chunk * 16;
            const int64_t voff = static_cast<int64_t>(kv + row) * params.v_row_stride + cp_chunk * 16;
            const int dst = swz8<kHeadDim>(row, cp_chunk);
            cp_async_16(sK + dst, ok ? k_ptr + koff : k_ptr, ok);
            cp_async_16(sK + Traits::kSmemKV + dst, ok ? v_ptr + voff : v_ptr, ok);
        }
        if (tid == 0) {
            cp_async_4(sScale + 2 * stage, ks_ptr + tile, true);
            cp_async_4(sScale + 2 * stage + 1, vs_ptr + tile, true);
        }
    };

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_tiles) load_kv(s, s);
        cp_async_commit();  // always commit: keeps the group count uniform for cp_async_wait
    }
    // Q rows gathered from the group's heads as fp16 (bf16 converted here, once), in fragment order, into the last
    // stage (not loaded yet); rows past num_rows are zeros (their outputs are never written). Row r's 8 channels
    // 8 c .. (c = 4 p + t) are words 0-3 of lane (r % 8) * 4 + t's fragments of pair p, rows g (r % 16 < 8) or g + 8:
    // word j goes to position 2 j + (r % 16) / 8.
    if (n_tiles > 0) {
        for (int idx = tid; idx < kRows * Traits::kQChunks; idx += Traits::kThreads) {
            const int r = idx / Traits::kQChunks, c = idx % Traits::kQChunks;
            uint4 h = make_uint4(0, 0, 0, 0);
            if (row0 + r < num_rows) {
                const int row = row0 + r;
                const T* src = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride +
                               (kv_head * group + row % group) * params.q_head_stride +
                               static_cast<int64_t>(row / group) * params.q_row_stride + c * 8;
                const uint4 x = *reinterpret_cast<const uint4*>(src);
                h = make_uint4(to_half2<T>(x.x), to_half2<T>(x.y), to_half2<T>(x.z), to_half2<T>(x.w));
            }
            uint32_t* dst = sQ + (((r / 16) * kKP + c / 4) * 32 + (r % 8) * 4 + c % 4) * 8 + (r % 16) / 8;
            dst[0] = h.x, dst[2] = h.y, dst[4] = h.z, dst[6] = h.w;
        }
    }

    SoftmaxState<1, kDT, 0> st;  // exact running max: P <= 1, so P * v_scale * 256 stays far inside fp16
    st.init();
    // This warp's Q fragments of every k-step pair: 8 adjacent channels 32 p + 8 t of rows g and g + 8.
    uint32_t q_frag[kKP][2][4];
    // The first and last keys this warp's rows may see (causal), for the per-element mask.
    const int wrow0 = row0 + warp * 16;
    const int warp_first_limit = params.causal ? wrow0 / group + causal_offset : seqlen_k - 1;
    // This thread's rows of a 16-key slice (add 16 x slice): S's n-tile 0 key (its B column g), P V's four rows.
    const int k_row0 = 4 * (g >> 1) + (g & 1);  // n-tile 1: + 2 (same row group: same swizzle)
    const int v_row0 = 4 * t;
    const int kcol_sw = (2 * (k_row0 >> 2)) & (Traits::kChunks - 1);  // the same for every slice (16 rows = 4 groups)
    const int vcol = kHeadDim == 128 ? (g ^ ((2 * (v_row0 >> 2)) & (Traits::kChunks - 1))) << 4
                                     : (((g >> 1) ^ ((2 * (v_row0 >> 2)) & (Traits::kChunks - 1))) << 4) + 8 * (g & 1);

    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile i (and Q) visible to all; everyone is done with the stage about to be refilled
        if (i == 0) {
#pragma unroll
            for (int p = 0; p < kKP; ++p)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 a = *reinterpret_cast<const uint4*>(sQ + ((warp * kKP + p) * 32 + lane) * 8 + 4 * h);
                    q_frag[p][h][0] = a.x, q_frag[p][h][1] = a.y, q_frag[p][h][2] = a.z, q_frag[p][h][3] = a.w;
                }
            __syncthreads();  // every warp holds its Q: the last stage may be refilled
        }
        if (i + kStages - 1 < n_tiles) load_kv(i + kStages - 1, (i + kStages - 1) % kStages);
        cp_async_commit();

        const int stage = i % kStages;
        const unsigned char* cK = sKV + stage * Traits::kSmemStage;
        const unsigned char* cV = cK + Traits::kSmemKV;
        const float k_scale = sScale[2 * stage], v_scale = sScale[2 * stage + 1];
        const int key0 = i * kBlockN;

        // S = Q K^T over the four 16-key slices: n-tiles (2 sl, 2 sl + 1) hold slice sl, column 2t + e of n-tile
        // 2 sl + n is key key0 + 16 sl + 4t + 2n + e.
        float acc_s[1][2 * kSlices][4];
#pragma unroll
        for (int n = 0; n < 2 * kSlices; ++n) acc_s[0][n][0] = acc_s[0][n][1] = acc_s[0][n][2] = acc_s[0][n][3] = 0.f;
#pragma unroll
        for (int p = 0; p < kKP; ++p) {
            const int col = (((2 * p + (t >> 1)) ^ kcol_sw) << 4) + 8 * (t & 1);
#pragma unroll
            for (int sl = 0; sl < kSlices; ++sl) {
                // 8 bytes = channels 32 p + 8 t .. + 7 of this thread's two keys: k-steps 2p (bytes 0-3), 2p + 1.
                const uint2 k0 = *reinterpret_cast<const uint2*>(cK + (16 * sl + k_row0) * kHeadDim + col);
                const uint2 k1 = *reinterpret_cast<const uint2*>(cK + (16 * sl + k_row0 + 2) * kHeadDim + col);
                mma_16816<half>(acc_s[0][2 * sl], q_frag[p][0], k_pair<0>(k0.x), k_pair<2>(k0.x));
                mma_16816<half>(acc_s[0][2 * sl + 1], q_frag[p][0], k_pair<0>(k1.x), k_pair<2>(k1.x));
                mma_16816<half>(acc_s[0][2 * sl], q_frag[p][1], k_pair<0>(k0.y), k_pair<2>(k0.y));
                mma_16816<half>(acc_s[0][2 * sl + 1], q_frag[p][1], k_pair<0>(k1.y), k_pair<2>(k1.y));
            }
        }
        // Mask keys past seqlen_k and (causal) after each row's limit; only tiles that cross either.
        if (key0 + kBlockN > seqlen_k || key0 + kBlockN - 1 > warp_first_limit) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int limit = params.causal ? min((wrow0 + g + 8 * r) / group + causal_offset, seqlen_k - 1)
                                                : seqlen_k - 1;
#pragma unroll
                for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (key0 + 16 * sl + 4 * t + 2 * n + e > limit) acc_s[0][2 * sl + n][2 * r + e] = -INFINITY;
            }
        }
        st.update(acc_s, params.scale_log2 * k_scale * (1.f / kFp8KvOperandScale));  // x 256 with the bit trick
        const float p_mul = v_scale * 256.f;

#pragma unroll
        for (int sl = 0; sl < kSlices; ++sl) {
            uint32_t a[4];
            a[0] = pack2<half>(acc_s[0][2 * sl][0] * p_mul, acc_s[0][2 * sl][1] * p_mul);
            a[1] = pack2<half>(acc_s[0][2 * sl][2] * p_mul, acc_s[0][2 * sl][3] * p_mul);
            a[2] = pack2<half>(acc_s[0][2 * sl + 1][0] * p_mul, acc_s[0][2 * sl + 1][1] * p_mul);
            a[3] = pack2<half>(acc_s[0][2 * sl + 1][2] * p_mul, acc_s[0][2 * sl + 1][3] * p_mul);
            // V: this thread's 4 rows of the slice (keys 4t .. 4t + 3), kDT adjacent bytes each (channels g kDT ..).
            uint32_t vw[4][kDT / 4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const unsigned char* src = cV + (16 * sl + v_row0 + r) * kHeadDim + vcol;
                if constexpr (kDT == 16) {
                    const uint4 x = *reinterpret_cast<const uint4*>(src);
                    vw[r][0] = x.x, vw[r][1] = x.y, vw[r][2] = x.z, vw[r][3] = x.w;
                } else {
                    const uint2 x = *reinterpret_cast<const uint2*>(src);
                    vw[r][0] = x.x, vw[r][1] = x.y;
                }
            }
#pragma unroll
            for (int j = 0; j < kDT; ++j) {
                // n-tile j: B column g is channel g kDT + j; k rows (2t, 2t + 1) are keys 4t, 4t + 1, (2t + 8,
                // 2t + 9) keys 4t + 2, 4t + 3: byte j % 4 of word j / 4 of rows 0/1 and 2/3.
                mma_16816<half>(st.acc_o[0][j], a, v_pair(vw[0][j / 4], vw[1][j / 4], j % 4),
                                v_pair(vw[2][j / 4], vw[3][j / 4], j % 4));
            }
        }
    }
    cp_async_wait<0>();  // nothing in flight when the block exits

    // Epilogue, from registers: row g (+ 8) of the warp's tile, channels (2t + e) kDT + j of n-tile j: two runs of kDT
    // adjacent channels per thread and row, written as 16-byte stores. Rows that saw no key: 0, lse -inf.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = wrow0 + g + 8 * r;
        const float total = quad_sum(st.row_sum[0][r]);
        if (row >= num_rows) continue;
        // O holds 256 x kFp8KvOperandScale x the output (P carries v_scale x 256): 1 with the bit trick, 256 without.
        constexpr float kOut = 1.f / (256.f * kFp8KvOperandScale);
        const float inv = total > 0.f ? kOut / total : 0.f;
        const int head = kv_head * group + row % group, qi = row / group;
        T* o = reinterpret_cast<T*>(params.o) + batch * params.o_batch_stride + head * params.o_head_stride +
               static_cast<int64_t>(qi) * params.o_row_stride;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            uint32_t w[kDT / 2];
#pragma unroll
            for (int j = 0; j < kDT / 2; ++j)
                w[j] = pack2<T>(st.acc_o[0][2 * j][2 * r + e] * inv, st.acc_o[0][2 * j + 1][2 * r + e] * inv);
            uint4* dst = reinterpret_cast<uint4*>(o + (2 * t + e) * kDT);
#pragma unroll
            for (int c = 0; c < kDT / 8; ++c) dst[c] = make_uint4(w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3]);
        }
        if (t == 0 && params.lse != nullptr) {
            const float mx = st.row_max[0][r];
            const float lse = total > 0.f ? ((mx == -INFINITY ? 0.f : mx) + __log2f(total)) * kLn2 : -INFINITY;
            params.lse[(static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + qi] = lse;
        }
    }
}

// One kernel template for both versions (Traits::kVersion: PrefillFp8KvTraits v1, PrefillFp8KvV2Traits v2).
template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) flash_prefill_fp8kv_kernel(const FlashDecodeFp8KvParams params) {
    if constexpr (Traits::kVersion == 2) {
        flash_prefill_fp8kv_v2_body<T, Traits>(params);
    } else {
        flash_prefill_fp8kv_body<T, Traits>(params);
    }
}

}  // namespace llm_attn

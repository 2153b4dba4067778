// Prefill over the FP8 (e4m3) KV cache, v2 (issue 38): each 64-key tile converted to fp16 once per block, in shared
// memory, then FlashAttention-2's inner loop on fp16 tiles with ldmatrix (the portable kernel's WarpTile,
// flash_fwd_kernel.cuh). v1 (flash_prefill_fp8kv_kernel.cuh) has every warp convert the whole tile in registers for
// its own 16 rows: 4x the conversions; here a block of kNWarps x 16 packed rows converts each tile once.
//
// Per 64-key tile, three places in shared memory:
//   bytes  [kStages][K, V][64][D] e4m3, unswizzled: cp.async'd as v1 does (rows past seqlen_k zero-filled); each
//          thread copies and later converts the same 16-byte chunks, so no barrier orders its copy and its convert
//   fp16   [2][K, V][64][D] half, XOR-swizzled as the portable kernel's tiles (swz): tile i + 1 is converted into one
//          buffer while the warps multiply tile i from the other (k_pair: cvt.rn.f16x2.e4m3x2 on sm_89+, the exact
//          bit trick x 2^-8 on sm_80-87, kFp8KvOperandScale says which), so one barrier per tile orders everything
//   scales [2 kStages][k, v] float: the tile's two scales, live from their copy to the tile's multiply
// Loop, iteration i: wait for tile i + 1's bytes; barrier (tile i's fp16 visible, every warp done with tile i - 1's
// fp16 buffer and byte stage); cp.async tile i + kStages into the byte stage tile i left; convert tile i + 1; Q K^T,
// mask, online softmax, P V on tile i. Q is staged (fp16, bf16 converted once, rows gathered from the GQA group) in
// fp16 buffer 1 before tile 1 is converted there, and read into registers (ldmatrix) in the prologue.
//
// Arithmetic: v1's, so kv_cache_reference.decode_attention(rounding="kernel") is the reference of both: fp16 x fp16
// -> fp32 MMAs, exact e4m3 -> fp16 operands, scores scaled by softmax_scale * k_scale[tile] (x 256 with the bit
// trick), exact running max (P <= 1), P * v_scale[tile] * 256 rounded to fp16 as P V's A operand, row sums of the
// unscaled P, O times 1 / (256 kFp8KvOperandScale sum) at the end. Rows packed as v1 (row = qi * group +
// head_in_group), causal bottom-right (row's query qi sees keys <= qi + seqlen_k - seqlen_q), seqused_k honoured,
// blocks issued last row block first. The output is staged in shared memory for 16-byte coalesced stores.
#pragma once

#include "flash_decode_fp8kv_kernel.cuh"  // k_pair, kFp8KvOperandScale, to_half2, FlashDecodeFp8KvParams
#include "flash_fwd_kernel.cuh"           // WarpTile (ldmatrix Q K^T and P V), swz

namespace llm_attn {

// 99 KB: the most an sm_86 / sm_89 block may opt into (their SM has 100 KB).
constexpr int kPrefillFp8KvMaxSmem = 99 * 1024;

// kNWarps x 16 packed query rows per block, kStages e4m3 byte stages, two fp16 tiles. Doubles as the portable
// WarpTile's traits (kHeadDim, kBlockN, kMTiles, kWarpRows).
template <int kHeadDim_, int kNWarps_, int kStages_>
struct PrefillFp8KvV2Traits {
    static constexpr int kVersion = 2;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kStages = kStages_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kMTiles = 1;  // WarpTile: one m16 tile per warp, Q in registers
    static constexpr int kWarpRows = 16;
    static constexpr int kRows = 16 * kNWarps;
    static constexpr int kBlockN = 64;               // keys per tile = the cache's 64-token scale block
    static constexpr int kChunks8 = kHeadDim / 16;   // 16-byte chunks per e4m3 row
    static constexpr int kChunks16 = kHeadDim / 8;   // 16-byte chunks per fp16 row
    static constexpr int kScaleSlots = 2 * kStages;  // a tile's scales live from its copy (i - kStages) to its use (i)
    static constexpr int kSmemScales = 128;
    static constexpr int kSmemBytesTile = kBlockN * kHeadDim;     // one operand, e4m3
    static constexpr int kSmemHalfTile = kBlockN * kHeadDim * 2;  // one operand, fp16
    static constexpr int kSmemStage = 2 * kSmemBytesTile;         // K then V bytes
    static constexpr int kSmemHalf = 2 * kSmemHalfTile;           // K then V fp16
    static constexpr int kSmemQ = kRows * kHeadDim * 2;           // fp16 Q, staged in fp16 buffer 1
    static constexpr int kSmemO = kRows * kHeadDim * 2;           // the output tile, staged in the fp16 buffers
    static constexpr int kSmemBytes = kSmemScales + kStages * kSmemStage + 2 * kSmemHalf;
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
    static_assert(kStages >= 2, "tile i + 1 must be in flight while tile i is converted");
    static_assert(kScaleSlots * 2 * 4 <= kSmemScales, "scales must fit");
    static_assert(kSmemQ <= kSmemHalf, "Q is staged in one fp16 buffer");
    static_assert(kSmemO <= 2 * kSmemHalf, "the output tile is staged in the fp16 buffers");
    static_assert(kSmemBytes <= kPrefillFp8KvMaxSmem, "must fit the 99 KB of an sm_86 / sm_89 block");
    static_assert((kBlockN * kChunks8) % kThreads == 0, "byte tile copy must divide evenly among threads");
    static_assert((kRows * kChunks16) % kThreads == 0, "Q and O tiles must divide evenly among threads");
    static_assert(kChunks16 >= 8, "the fp16 swizzle permutes 8 chunks per row");
};

template <typename T, typename Traits>
__device__ __forceinline__ void flash_prefill_fp8kv_v2_body(const FlashDecodeFp8KvParams& fp) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kRows = Traits::kRows;
    constexpr int kStages = Traits::kStages;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kThreads = Traits::kThreads;
    constexpr int kNT = kBlockN / 8;    // n-tiles of S
    constexpr int kDT = kHeadDim / 8;   // n-tiles of O
    const FlashFwdParams& params = fp.base;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* sScale = reinterpret_cast<float*>(smem_raw);                               // [kScaleSlots][k, v]
    unsigned char* sBytes = smem_raw + Traits::kSmemScales;                           // [kStages][K, V][64][D]
    half* sHalf = reinterpret_cast<half*>(sBytes + kStages * Traits::kSmemStage);    // [2][K, V][64][D] swizzled
    constexpr int kHalfElems = Traits::kSmemHalf / 2;                                 // one fp16 buffer, elements
    constexpr int kHalfTileElems = Traits::kSmemHalfTile / 2;                         // K or V within it
    half* sQ = sHalf + kHalfElems;                                                    // [kRows][D] swizzled

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int row_block = gridDim.x - 1 - blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const Fp8KvPrefillBlock blk(fp, row_block, kv_head, batch, kRows, kBlockN);
    const int group = blk.group, seqlen_q = params.seqlen_q, num_rows = blk.num_rows, row0 = blk.row0;
    const int seqlen_k = blk.seqlen_k, causal_offset = blk.causal_offset, n_tiles = blk.n_tiles;
    const unsigned char *k_ptr = blk.k_ptr, *v_ptr = blk.v_ptr;
    const float *ks_ptr = blk.ks_ptr, *vs_ptr = blk.vs_ptr;

    // Thread tid copies, and later converts, 16-byte chunk tid % kChunks8 of rows tid / kChunks8 + it * kRowStep of
    // K and V. Thread 0 also copies the tile's two scales.
    constexpr int kRowStep = kThreads / Traits::kChunks8;
    constexpr int kIters = kBlockN / kRowStep;
    const int cp_row = tid / Traits::kChunks8, cp_chunk = tid % Traits::kChunks8;
    auto load_bytes = [&](int tile) {
        const int kv = tile * kBlockN;
        unsigned char* sK = sBytes + (tile % kStages) * Traits::kSmemStage;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int row = cp_row + it * kRowStep;
            const bool ok = kv + row < seqlen_k;
            const int64_t koff = static_cast<int64_t>(kv + row) * params.k_row_stride + cp_chunk * 16;
            const int64_t voff = static_cast<int64_t>(kv + row) * params.v_row_stride + cp_chunk * 16;
            const int dst = row * kHeadDim + cp_chunk * 16;
            cp_async_16(sK + dst, ok ? k_ptr + koff : k_ptr, ok);
            cp_async_16(sK + Traits::kSmemBytesTile + dst, ok ? v_ptr + voff : v_ptr, ok);
        }
        if (tid == 0) {
            float* s = sScale + 2 * (tile % Traits::kScaleSlots);
            cp_async_4(s, ks_ptr + tile, true);
            cp_async_4(s + 1, vs_ptr + tile, true);
        }
    };
    // The same chunks, e4m3 -> fp16 (16 channels: two fp16 chunks). Of the two 16-byte stores, threads with
    // cp_chunk >= 4 write their odd chunk first (head_dim 128): a quarter-warp then covers all 8 bank groups.
    const int first_odd = kHeadDim == 128 ? (cp_chunk >> 2) & 1 : 0;
    auto convert = [&](int tile) {
        const unsigned char* src = sBytes + (tile % kStages) * Traits::kSmemStage;
        half* dst = sHalf + (tile & 1) * kHalfElems;
#pragma unroll
        for (int op = 0; op < 2; ++op) {
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int row = cp_row + it * kRowStep;
                const uint4 b = *reinterpret_cast<const uint4*>(src + op * Traits::kSmemBytesTile + row * kHeadDim +
                                                                cp_chunk * 16);
                const uint4 lo = make_uint4(k_pair<0>(b.x), k_pair<2>(b.x), k_pair<0>(b.y), k_pair<2>(b.y));
                const uint4 hi = make_uint4(k_pair<0>(b.z), k_pair<2>(b.z), k_pair<0>(b.w), k_pair<2>(b.w));
                half* d = dst + op * kHalfTileElems;
                const int c0 = 2 * cp_chunk + first_odd, c1 = 2 * cp_chunk + 1 - first_odd;
                *reinterpret_cast<uint4*>(d + swz<kHeadDim>(row, c0)) = first_odd ? hi : lo;
                *reinterpret_cast<uint4*>(d + swz<kHeadDim>(row, c1)) = first_odd ? lo : hi;
            }
        }
    };

#pragma unroll
    for (int s = 0; s < kStages; ++s) {
        if (s < n_tiles) load_bytes(s);
        cp_async_commit();  // always commit: keeps the group count uniform for cp_async_wait
    }

    using Tile = WarpTile<half, Traits>;
    Tile wt(sQ, warp, lane);
    SoftmaxState<1, kDT, 0> st;  // exact running max: P <= 1, so P * v_scale * 256 stays far inside fp16
    st.init();
    const int wrow0 = row0 + warp * 16;
    // The first and last keys this warp's rows may see: the per-element mask below the first, nothing above the last.
    const int warp_first_limit = params.causal ? wrow0 / group + causal_offset : seqlen_k - 1;
    const int warp_last_limit =
        params.causal ? min(wrow0 + 15, max(num_rows - 1, 0)) / group + causal_offset : seqlen_k - 1;
    // This thread's two rows' limits (rows g, g + 8 of the warp's tile), for the per-element mask.
    int limit[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        limit[r] = params.causal ? min((wrow0 + g + 8 * r) / group + causal_offset, seqlen_k - 1) : seqlen_k - 1;

    if (n_tiles > 0) {
        // Q rows gathered from the group's heads as fp16 (bf16 converted here, once), swizzled; rows past num_rows
        // are zeros (their outputs are never written).
#pragma unroll
        for (int it = 0; it < kRows * Traits::kChunks16 / kThreads; ++it) {
            const int idx = it * kThreads + tid;
            const int r = idx / Traits::kChunks16, c = idx % Traits::kChunks16;
            uint4 h = make_uint4(0, 0, 0, 0);
            if (row0 + r < num_rows) {
                const int row = row0 + r;
                const T* src = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride +
                               (kv_head * group + row % group) * params.q_head_stride +
                               static_cast<int64_t>(row / group) * params.q_row_stride + c * 8;
                const uint4 x = *reinterpret_cast<const uint4*>(src);
                h = make_uint4(to_half2<T>(x.x), to_half2<T>(x.y), to_half2<T>(x.z), to_half2<T>(x.w));
            }
            *reinterpret_cast<uint4*>(sQ + swz<kHeadDim>(r, c)) = h;
        }
        cp_async_wait<kStages - 1>();  // this thread's tile 0 bytes (converted by this thread only)
        convert(0);
        __syncthreads();  // Q staged
        wt.load_q();
        // The loop's first barrier orders these Q reads before tile 1's conversion into the same buffer.
    }

    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<kStages - 2>();  // tile i + 1's bytes (and scales) landed
        __syncthreads();  // tile i's fp16 and scales visible; every warp done with tile i - 1's buffers
        if (i + kStages < n_tiles) load_bytes(i + kStages);
        cp_async_commit();
        if (i + 1 < n_tiles) convert(i + 1);

        const int key0 = i * kBlockN;
        // Nothing to do where every row of the warp is padding or past its causal limit (warp-uniform).
        if (wrow0 >= num_rows || key0 > warp_last_limit) continue;
        const half* cK = sHalf + (i & 1) * kHalfElems;
        const half* cV = cK + kHalfTileElems;
        const float k_scale = sScale[2 * (i % Traits::kScaleSlots)];
        const float v_scale = sScale[2 * (i % Traits::kScaleSlots) + 1];

        typename Tile::Scores acc_s;
        wt.qk(acc_s, cK);
        // Mask keys past seqlen_k and (causal) after each row's limit; only tiles that cross either.
        if (key0 + kBlockN > seqlen_k || key0 + kBlockN - 1 > warp_first_limit) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (key0 + nt * 8 + 2 * t + (e & 1) > limit[e >> 1]) acc_s[0][nt][e] = -INFINITY;
        }
        st.update(acc_s, params.scale_log2 * k_scale * (1.f / kFp8KvOperandScale));  // x 256 with the bit trick
        const float p_mul = v_scale * 256.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][nt][e] *= p_mul;
        wt.pv(st.acc_o, acc_s, cV);
    }
    cp_async_wait<0>();  // nothing in flight when the block exits

    // Epilogue: O x 1 / (256 kFp8KvOperandScale sum) staged in shared memory (the fp16 buffers: every warp is past its
    // last read of them after the barrier), then 16-byte coalesced stores. Rows that saw no key: 0, lse -inf.
    __syncthreads();
    T* sO = reinterpret_cast<T*>(sHalf);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int lrow = warp * 16 + g + 8 * r, row = row0 + lrow;
        const float total = quad_sum(st.row_sum[0][r]);
        constexpr float kOut = 1.f / (256.f * kFp8KvOperandScale);
        const float inv = total > 0.f ? kOut / total : 0.f;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt)
            *reinterpret_cast<uint32_t*>(sO + swz<kHeadDim>(lrow, dt) + 2 * t) =
                pack2<T>(st.acc_o[0][dt][2 * r] * inv, st.acc_o[0][dt][2 * r + 1] * inv);
        if (t == 0 && row < num_rows && params.lse != nullptr) {
            const float mx = st.row_max[0][r];
            const float lse = total > 0.f ? ((mx == -INFINITY ? 0.f : mx) + __log2f(total)) * kLn2 : -INFINITY;
            params.lse[(static_cast<int64_t>(batch) * params.num_heads + kv_head * group + row % group) * seqlen_q +
                       row / group] = lse;
        }
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kRows * Traits::kChunks16 / kThreads; ++it) {
        const int idx = it * kThreads + tid;
        const int r = idx / Traits::kChunks16, c = idx % Traits::kChunks16;
        const int row = row0 + r;
        if (row < num_rows) {
            T* o = reinterpret_cast<T*>(params.o) + batch * params.o_batch_stride +
                   (kv_head * group + row % group) * params.o_head_stride +
                   static_cast<int64_t>(row / group) * params.o_row_stride + c * 8;
            *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(sO + swz<kHeadDim>(r, c));
        }
    }
}

}  // namespace llm_attn

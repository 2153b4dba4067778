// Split-KV decode over the FP8 (e4m3) KV cache: flash_decode_kernel.cuh's algorithm (one block per (batch, KV head,
// split), the group's query heads x q_len packed as m16 rows, 4 warps x 16 keys of each 64-key tile, per-warp
// online softmax merged through shared memory, fused split combine), with K and V read as e4m3 bytes and
// dequantised in registers. A block has one or two such warp groups (DecodeFp8KvTraits::kWGroups); two take the
// split's tiles in turn, each through its own stages and barrier, and meet in the warp merge. No fp16 copy of the cache exists anywhere: global -> shared is a byte copy
// (cp.async), shared -> registers loads bytes, and the bytes become fp16 MMA operands in registers.
//
// The conversion is exact and needs no FP8 hardware (sm_80 onwards): an e4m3 byte s.eeee.mmm placed in an fp16 as
// s.0eeee.mmm0000000 is the same number times 2^-8, subnormals included (e4m3's subnormal 0.mmm 2^-6 lands on
// fp16's 0.mmm 2^-14). Two bytes become a half2 with one byte permute, one shift and two masks. The 2^8 is folded
// into the per-tile scales: the scores use softmax_scale * k_scale[tile] * 256 (the online softmax takes a new
// scale per tile: its max is kept in the scaled domain), and P is multiplied by v_scale[tile] * 256 before it
// becomes the fp16 A operand of P V (the row sums keep the unscaled P). The softmax keeps its exact running max
// (no lazy rescale), so P <= 1 and the fp16 P * v_scale * 256 = P * amax(V block) * 0.57 cannot overflow for any
// |V| below 1e5. All MMAs are fp16 x fp16 -> fp32 for either query dtype: bf16 Q is converted to fp16 once, when
// it is staged in shared memory (exact for |q| in [2^-14, 65504], the range of any real query).
// On sm_89 and later the pairs go through the hardware's cvt.rn.f16x2.e4m3x2 instead (k_pair / v_pair: one
// instruction per pair against the trick's four, and the conversions are most of the issue slots per tile). Those
// operands are the true values, so the x256 leaves the score scale, P keeps its v_scale * 256, and the merge takes
// the 2^-8 back from O: powers of two only, so both paths give the same numbers.
//
// Fragment layouts without ldmatrix (which moves 16-bit elements): a dot product may sum its terms in any order,
// so each mma's 16 k-positions are mapped to head_dim channels such that a thread's four (2t, 2t+1, 2t+8, 2t+9)
// are four adjacent bytes: one 8-byte shared load gives a thread its K operand for two k-steps, and Q is staged
// to match. For P V the same freedom is used twice: the 16 keys of a warp's slice are ordered so that a thread's
// A-fragment keys are the four adjacent rows 4t .. 4t + 3 (S's n-tile 0 holds keys 4(g/2) + g%2, n-tile 1 those
// + 2), and V's output channels are ordered so that thread g's n-column of every n-tile j is channel
// g * (head_dim / 8) + j: a thread loads 16 (hd 128) or 8 (hd 64) adjacent bytes of each of its 4 rows, and the
// output is written back in channel order at the end. The byte tiles are XOR-swizzled per 16-byte chunk with
// 2 ((row / 4) mod (chunks / 2)): the 8 K rows of one load (4 row groups, 2 rows each) then cover all banks twice,
// the minimum for 256 bytes; V rows are read whole (hd 128: conflict-free; hd 64: two-way).
#pragma once

#include "combine.cuh"
#include "flash_decode_fp8kv.h"
#include "ptx.cuh"
#include "smem_tile.cuh"
#include "softmax.cuh"

namespace llm_attn {

template <int kHeadDim_, int kMTiles_, int kStages_, int kWGroups_>
struct DecodeFp8KvTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kMTiles = kMTiles_;
    static constexpr int kRows = 16 * kMTiles;
    static constexpr int kStages = kStages_;
    // Warp groups: each group of 4 warps streams its own tiles of the split (group w: tiles w, w + kWGroups, ...)
    // through its own kStages buffers, synchronised by its own named barrier, as a separate block would; the groups
    // meet once, in the warp merge. Two groups are two blocks' streaming in one block: half the splits for the same
    // warps an SM, so half the partials and the combine's loads (kernels/NOTES.md, "Two warp groups a block").
    static constexpr int kWGroups = kWGroups_;
    static constexpr int kGroupThreads = 128;
    static constexpr int kNWarps = 4 * kWGroups;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kBlockN = 64;             // keys per tile = the cache's 64-token scale block, 16 a warp
    static constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks per e4m3 key row
    static constexpr int kQChunks = kHeadDim / 8;  // 16-byte chunks per fp16 Q row
    static constexpr int kSmemQ = kRows * kHeadDim * 2;          // bytes, fp16
    static constexpr int kSmemScales = 128 * kWGroups;           // k and v scale per stage and group, padded
    static constexpr int kSmemKV = kBlockN * kHeadDim;           // bytes of one operand's tile
    static constexpr int kSmemStages = 2 * kWGroups * kStages * kSmemKV;
    // The warp merge's float32 [warps][rows][kMergeStride]: channel c at c + 2 (c / (2 (head_dim / 8))), rows
    // kHeadDim + 8 apart (flash_decode_fp8kv_body's merge says why).
    static constexpr int kMergeStride = kHeadDim + 8;
    static constexpr int kSmemMerge = kNWarps * kRows * kMergeStride * 4;
    static constexpr int kSmemBytes = kSmemQ + kSmemScales + (kSmemStages > kSmemMerge ? kSmemStages : kSmemMerge);
    static_assert(kSmemBytes == decode_fp8kv_smem_bytes(kHeadDim, kMTiles, kStages, kWGroups), "the host's count");
    static_assert(kStages >= 2, "need at least double buffering");
    static_assert(kWGroups == 1 || kWGroups == 2, "one or two warp groups (named barriers 1 and 2)");
    static_assert(kStages * 2 * 4 <= 128, "scales must fit");
    static_assert((kBlockN * kChunks) % kGroupThreads == 0, "tile copy must divide evenly among a group's threads");
    static_assert((kGroupThreads / kChunks) % 16 == 0, "row step must keep the swizzle phase fixed");
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
};

// Byte offset of (row, 16-byte chunk) in a swizzled [rows][kHeadDim] e4m3 tile.
template <int kHeadDim>
__device__ __forceinline__ int swz8(int row, int chunk) {
    constexpr int kChunks = kHeadDim / 16;
    return row * kHeadDim + ((chunk ^ ((2 * (row >> 2)) & (kChunks - 1))) << 4);
}

// Bytes 1 and 3 of `w` (e4m3) as a half2 of their values times 2^-8 (low half = byte 1); bytes 0 and 2 are ignored.
__device__ __forceinline__ uint32_t e4m3x2_to_half2_scaled(uint32_t w) {
    return ((w >> 1) & 0x3F803F80u) | (w & 0x80008000u);
}
// Two e4m3 bytes (x's byte kLo, then x:y's byte kHi, 0..7 as in __byte_perm) -> half2 (low half = byte kLo) x 2^-8.
template <int kLo, int kHi>
__device__ __forceinline__ uint32_t e4m3_pair(uint32_t x, uint32_t y) {
    return e4m3x2_to_half2_scaled(__byte_perm(x, y, (kHi << 12) | (kLo << 4)));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kFp8KvHwCvt = true;  // cvt.rn.f16x2.e4m3x2 exists (sm_89, sm_90)
// Bytes kLo and kLo + 1 of `w` (kLo 0 or 2) as a half2 of their e4m3 values (low half = byte kLo).
template <int kLo>
__device__ __forceinline__ uint32_t e4m3x2_to_half2_hw(uint32_t w) {
    uint32_t r;
    const unsigned short pair = static_cast<unsigned short>(w >> (8 * kLo));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(pair));
    return r;
}
#else
constexpr bool kFp8KvHwCvt = false;  // sm_80-87: the bit trick (e4m3x2_to_half2_scaled)
template <int kLo>
__device__ __forceinline__ uint32_t e4m3x2_to_half2_hw(uint32_t) {
    return 0u;  // never runs: every caller takes the bit trick's branch where kFp8KvHwCvt is false
}
#endif

// K's B operand: bytes kLo, kLo + 1 of `w` as fp16 (x 2^-8 with the bit trick, exact values with the hardware's).
template <int kLo>
__device__ __forceinline__ uint32_t k_pair(uint32_t w) {
    if constexpr (kFp8KvHwCvt) {
        return e4m3x2_to_half2_hw<kLo>(w);
    } else {
        return e4m3_pair<kLo, kLo + 1>(w, 0);
    }
}
// V's B operand: byte b of `x` (low half) and of `y` (high half), as k_pair scales them (b a constant once unrolled).
__device__ __forceinline__ uint32_t v_pair(uint32_t x, uint32_t y, int b) {
    if constexpr (kFp8KvHwCvt) {
        return e4m3x2_to_half2_hw<0>(__byte_perm(x, y, ((4 + b) << 4) | b));
    } else {
        return e4m3x2_to_half2_scaled(__byte_perm(x, y, ((4 + b) << 12) | (b << 4)));
    }
}
// What an e4m3 MMA operand carries beyond its value: 2^-8 with the bit trick, nothing with the hardware's conversion.
constexpr float kFp8KvOperandScale = kFp8KvHwCvt ? 1.f : 1.f / 256.f;

// Two T (half or bf16) as a half2 (identity for half).
template <typename T>
__device__ __forceinline__ uint32_t to_half2(uint32_t w) {
    const float2 f = unpack2<T>(w);
    return pack2<half>(f.x, f.y);
}

// Where one block of the prefill kernels over the FP8 cache (v1, v2) works: its packed query rows (row = qi x group +
// head_in_group; the block's first is row0), the keys it reads (seqused_k clamped to [0, seqlen_k]), the causal offset
// (row i sees keys <= i / group + causal_offset), the key tiles it visits (all of them, or up to its last row's causal
// limit; none when that row sees no key) and the base pointers of its KV head's bytes and scales.
struct Fp8KvPrefillBlock {
    int group, num_rows, row0, seqlen_k, causal_offset, n_tiles;
    const unsigned char* k_ptr;
    const unsigned char* v_ptr;
    const float* ks_ptr;
    const float* vs_ptr;

    __device__ __forceinline__ Fp8KvPrefillBlock(const FlashDecodeFp8KvParams& fp, int row_block, int kv_head,
                                                 int batch, int rows_per_block, int block_n) {
        const FlashFwdParams& p = fp.base;
        group = p.num_heads / p.num_kv_heads;
        num_rows = group * p.seqlen_q;
        row0 = row_block * rows_per_block;
        seqlen_k = p.seqused_k ? max(min(p.seqused_k[batch], p.seqlen_k), 0) : p.seqlen_k;
        causal_offset = seqlen_k - p.seqlen_q;
        n_tiles = (seqlen_k + block_n - 1) / block_n;
        if (p.causal) {
            const int last_row = min(row0 + rows_per_block, num_rows) - 1;
            const int visible = max(last_row / group + causal_offset + 1, 0);  // keys 0 .. visible - 1
            n_tiles = min(n_tiles, (visible + block_n - 1) / block_n);
        }
        n_tiles = max(n_tiles, 0);
        k_ptr = reinterpret_cast<const unsigned char*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
        v_ptr = reinterpret_cast<const unsigned char*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
        ks_ptr = fp.k_scale + batch * fp.ks_batch_stride + kv_head * fp.ks_head_stride;
        vs_ptr = fp.v_scale + batch * fp.vs_batch_stride + kv_head * fp.vs_head_stride;
    }
};

template <typename T, typename Traits>
__device__ __forceinline__ void flash_decode_fp8kv_body(const FlashDecodeFp8KvParams& fp) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kMT = Traits::kMTiles;
    constexpr int kRows = Traits::kRows;
    constexpr int kStages = Traits::kStages;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kDT = kHeadDim / 8;    // n-tiles of O; also the bytes of a V row one thread reads
    constexpr int kKP = kHeadDim / 32;   // k-step pairs of Q K^T
    const FlashFwdParams& params = fp.base;

    constexpr int kWGroups = Traits::kWGroups;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Warp group wg (4 warps, threads gtid 0..127 of it); wq: the warp's place in its group (its 16 keys of a tile).
    const int wg = warp / 4, wq = warp % 4, gtid = tid % Traits::kGroupThreads;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    half* sQ = reinterpret_cast<half*>(smem_raw);                                   // [kRows][kHeadDim] swizzled
    float* sScale = reinterpret_cast<float*>(smem_raw + Traits::kSmemQ + 128 * wg);  // [groups][kStages][2], padded
    unsigned char* sKV = smem_raw + Traits::kSmemQ + Traits::kSmemScales;  // K [groups][kStages][kBlockN][kHeadDim], V
    unsigned char* sK = sKV + wg * kStages * Traits::kSmemKV;             // this group's stages
    unsigned char* sV = sK + kWGroups * kStages * Traits::kSmemKV;
    // A group's barrier: the whole block with one group (barrier 0), else named barrier 1 + wg for its 128 threads
    // (immediate ids: ptxas then reserves 3 barriers, not all 16).
    auto group_sync = [&] {
        if constexpr (kWGroups == 1) {
            __syncthreads();
        } else if (wg == 0) {
            named_barrier_sync(1, Traits::kGroupThreads);
        } else {
            named_barrier_sync(2, Traits::kGroupThreads);
        }
    };
    const int split = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const int group = params.num_heads / params.num_kv_heads;
    const int seqlen_q = params.seqlen_q;
    const int num_rows = group * seqlen_q;  // <= kRows (checked by the dispatcher)
    const int seqlen_k = params.seqused_k ? max(min(params.seqused_k[batch], params.seqlen_k), 0) : params.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;

    const int n_tiles = (seqlen_k + kBlockN - 1) / kBlockN;
    const int per_split = (n_tiles + params.num_splits - 1) / params.num_splits;
    const int tile_begin = split * per_split;
    const int tile_end = min(n_tiles, tile_begin + per_split);
    // The split's tiles tile_begin .. tile_end - 1, dealt to the groups in turn: this group's i-th is tile_of(i).
    // Both groups run loop_tiles turns (group 0's count): with an odd count, group 1's last turn only waits and
    // meets its barrier. compute-sanitizer's racecheck reports a race after the loop, where there is none, when the
    // two groups pass their named barriers a different number of times (kernels/NOTES.md, "Two warp groups a block").
    const int split_tiles = max(tile_end - tile_begin, 0);
    const int num_tiles = split_tiles > wg ? (split_tiles - wg + kWGroups - 1) / kWGroups : 0;
    const int loop_tiles = (split_tiles + kWGroups - 1) / kWGroups;
    auto tile_of = [&](int i) { return tile_begin + wg + kWGroups * i; };

    const unsigned char* k_ptr = reinterpret_cast<const unsigned char*>(params.k) + batch * params.k_batch_stride +
                                 kv_head * params.k_head_stride;
    const unsigned char* v_ptr = reinterpret_cast<const unsigned char*>(params.v) + batch * params.v_batch_stride +
                                 kv_head * params.v_head_stride;
    const float* ks_ptr = fp.k_scale + batch * fp.ks_batch_stride + kv_head * fp.ks_head_stride;
    const float* vs_ptr = fp.v_scale + batch * fp.vs_batch_stride + kv_head * fp.vs_head_stride;

    // Thread gtid of the group copies chunk gtid % kChunks of rows gtid / kChunks + i * kRowStep of each operand; rows
    // past the valid keys are zero-filled. The group's thread 0 also copies the tile's two scales.
    constexpr int kRowStep = Traits::kGroupThreads / Traits::kChunks;
    const int cp_row = gtid / Traits::kChunks, cp_chunk = gtid % Traits::kChunks;
    auto load_kv = [&](int tile, int stage) {
        const int kv = tile * kBlockN;
#pragma unroll
        for (int it = 0; it < kBlockN / kRowStep; ++it) {
            const int row = cp_row + it * kRowStep;
            const bool ok = kv + row < seqlen_k;
            const int64_t koff = static_cast<int64_t>(kv + row) * params.k_row_stride + cp_chunk * 16;
            const int64_t voff = static_cast<int64_t>(kv + row) * params.v_row_stride + cp_chunk * 16;
            const int dst = stage * Traits::kSmemKV + swz8<kHeadDim>(row, cp_chunk);
            cp_async_16(sK + dst, ok ? k_ptr + koff : k_ptr, ok);
            cp_async_16(sV + dst, ok ? v_ptr + voff : v_ptr, ok);
        }
        if (gtid == 0) {
            cp_async_4(sScale + 2 * stage, ks_ptr + tile, true);
            cp_async_4(sScale + 2 * stage + 1, vs_ptr + tile, true);
        }
    };

    // Q's loads go out first, into registers, and the first tiles' copies after them: a load issued behind the
    // copies of every block waits for most of those bytes (~3-4 us at 32k), while the first tile, which the block
    // needs no sooner than Q, arrives earlier on average (the fp16 kernel stages Q first too). Q rows gathered from
    // the group's heads, as fp16 (bf16 converted once, below); padding rows are zeros.
    constexpr int kQLoads = (kRows * Traits::kQChunks + Traits::kThreads - 1) / Traits::kThreads;
    uint4 q_raw[kQLoads];
#pragma unroll
    for (int it = 0; it < kQLoads; ++it) {
        const int idx = tid + it * Traits::kThreads, r = idx / Traits::kQChunks, c = idx % Traits::kQChunks;
        q_raw[it] = make_uint4(0, 0, 0, 0);
        if (r < num_rows) {
            const T* src = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride +
                           (kv_head * group + r % group) * params.q_head_stride +
                           static_cast<int64_t>(r / group) * params.q_row_stride + c * 8;
            q_raw[it] = *reinterpret_cast<const uint4*>(src);
        }
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_tiles) load_kv(tile_of(s), s);
        cp_async_commit();  // always commit: keeps the group count uniform for cp_async_wait
    }
    // Every thread holds whole loads, or (two groups, head_dim 64: 128 chunks for 256 threads) one load or none.
    constexpr bool kQAll = (kRows * Traits::kQChunks) % Traits::kThreads == 0;
    static_assert(kQAll || kQLoads == 1, "Q staging must divide evenly among threads");
#pragma unroll
    for (int it = 0; it < kQLoads; ++it) {
        const int idx = tid + it * Traits::kThreads, r = idx / Traits::kQChunks, c = idx % Traits::kQChunks;
        if (!kQAll && r >= kRows) break;
        const uint4 x = q_raw[it];
        *reinterpret_cast<uint4*>(sQ + swz<kHeadDim>(r, c)) =
            make_uint4(to_half2<T>(x.x), to_half2<T>(x.y), to_half2<T>(x.z), to_half2<T>(x.w));
    }
    if constexpr (kWGroups > 1) __syncthreads();  // Q's rows, staged by both groups, before either group's barrier

    // Exact running max (kRescaleLog2 = 0): P <= 1, so P * v_scale * 256 stays far inside fp16.
    SoftmaxState<kMT, kDT, 0> st;
    st.init();
    // A thread's Q fragments of k-step pair p, m-tile m: 8 adjacent channels 32 p + 8 t of rows g and g + 8.
    auto load_q = [&](uint32_t (&a)[2][4], int m, int p) {
        const uint4 lo = *reinterpret_cast<const uint4*>(sQ + swz<kHeadDim>(m * 16 + g, 4 * p + t));
        const uint4 hi = *reinterpret_cast<const uint4*>(sQ + swz<kHeadDim>(m * 16 + g + 8, 4 * p + t));
        a[0][0] = lo.x, a[0][1] = hi.x, a[0][2] = lo.y, a[0][3] = hi.y;
        a[1][0] = lo.z, a[1][1] = hi.z, a[1][2] = lo.w, a[1][3] = hi.w;
    };
    // One m16 tile of Q stays in registers; with two, Q is re-read from shared memory per k-step pair (another 64
    // registers would not fit next to the 128 of the O accumulators).
    constexpr bool kQInRegs = kMT == 1;
    uint32_t q_frag[kQInRegs ? kKP : 1][2][4];

    // This thread's rows of the warp's 16-key slice: S's n-tile 0 key (its B column g), and P V's four rows.
    const int k_row0 = wq * 16 + 4 * (g >> 1) + (g & 1);  // n-tile 1: + 2 (same row group: same swizzle)
    const int v_row0 = wq * 16 + 4 * t;

    for (int i = 0; i < loop_tiles; ++i) {
        cp_async_wait<kStages - 2>();
        group_sync();  // tile i (and Q) visible to the group; it is done with the stage about to be refilled
        if constexpr (kQInRegs) {
            if (i == 0) {
#pragma unroll
                for (int p = 0; p < kKP; ++p) load_q(q_frag[p], 0, p);
            }
        }
        if (i + kStages - 1 < num_tiles) load_kv(tile_of(i + kStages - 1), (i + kStages - 1) % kStages);
        cp_async_commit();

        if (i >= num_tiles) continue;  // group 1's turn past its tiles
        const int stage = i % kStages;
        const unsigned char* cK = sK + stage * Traits::kSmemKV;
        const unsigned char* cV = sV + stage * Traits::kSmemKV;
        const float k_scale = sScale[2 * stage], v_scale = sScale[2 * stage + 1];
        const int key0 = tile_of(i) * kBlockN + wq * 16;

        float acc_s[kMT][2][4];
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int n = 0; n < 2; ++n) acc_s[m][n][0] = acc_s[m][n][1] = acc_s[m][n][2] = acc_s[m][n][3] = 0.f;
#pragma unroll
        for (int p = 0; p < kKP; ++p) {
            // 8 bytes = channels 32 p + 8 t .. + 7 of this thread's two keys: k-steps 2p (bytes 0-3), 2p + 1 (4-7).
            const int col = (((2 * p + (t >> 1)) ^ ((2 * (k_row0 >> 2)) & (Traits::kChunks - 1))) << 4) + 8 * (t & 1);
            const uint2 k0 = *reinterpret_cast<const uint2*>(cK + k_row0 * kHeadDim + col);
            const uint2 k1 = *reinterpret_cast<const uint2*>(cK + (k_row0 + 2) * kHeadDim + col);
            const uint32_t b[2][2][2] = {{{k_pair<0>(k0.x), k_pair<2>(k0.x)}, {k_pair<0>(k1.x), k_pair<2>(k1.x)}},
                                         {{k_pair<0>(k0.y), k_pair<2>(k0.y)}, {k_pair<0>(k1.y), k_pair<2>(k1.y)}}};
#pragma unroll
            for (int m = 0; m < kMT; ++m) {
                uint32_t qa[2][4];
                if constexpr (kQInRegs) {
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int e = 0; e < 4; ++e) qa[h][e] = q_frag[p][h][e];
                } else {
                    load_q(qa, m, p);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mma_16816<half>(acc_s[m][0], qa[h], b[h][0][0], b[h][0][1]);
                    mma_16816<half>(acc_s[m][1], qa[h], b[h][1][0], b[h][1][1]);
                }
            }
        }
        // Mask keys past the end, and (causal, q_len > 1) keys after each row's position. Column 2t + e of n-tile
        // n is key key0 + 4t + 2n + e.
        if (key0 + 16 > seqlen_k || (params.causal && key0 + 15 > causal_offset)) {
#pragma unroll
            for (int m = 0; m < kMT; ++m)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int limit = params.causal ? min((m * 16 + g + 8 * r) / group + causal_offset, seqlen_k - 1)
                                                    : seqlen_k - 1;
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (key0 + 4 * t + 2 * n + e > limit) acc_s[m][n][2 * r + e] = -INFINITY;
                }
        }
        st.update(acc_s, params.scale_log2 * k_scale * (1.f / kFp8KvOperandScale));  // x 256 with the bit trick
        const float p_mul = v_scale * 256.f;
        uint32_t a[kMT][4];
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
            a[m][0] = pack2<half>(acc_s[m][0][0] * p_mul, acc_s[m][0][1] * p_mul);
            a[m][1] = pack2<half>(acc_s[m][0][2] * p_mul, acc_s[m][0][3] * p_mul);
            a[m][2] = pack2<half>(acc_s[m][1][0] * p_mul, acc_s[m][1][1] * p_mul);
            a[m][3] = pack2<half>(acc_s[m][1][2] * p_mul, acc_s[m][1][3] * p_mul);
        }
        // V: this thread's 4 rows (keys 4t .. 4t + 3 of the slice), kDT adjacent bytes each (channels g kDT ..).
        const int vcol = kHeadDim == 128 ? (g ^ ((2 * (v_row0 >> 2)) & (Traits::kChunks - 1))) << 4
                                         : (((g >> 1) ^ ((2 * (v_row0 >> 2)) & (Traits::kChunks - 1))) << 4) + 8 * (g & 1);
        uint32_t vw[4][kDT / 4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const unsigned char* src = cV + (v_row0 + r) * kHeadDim + vcol;
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
            // n-tile j: B column g is channel g kDT + j; k rows (2t, 2t + 1) are keys 4t, 4t + 1, (2t + 8, 2t + 9)
            // keys 4t + 2, 4t + 3: byte j % 4 of word j / 4 of rows 0/1 and 2/3.
            const uint32_t b0 = v_pair(vw[0][j / 4], vw[1][j / 4], j % 4);
            const uint32_t b1 = v_pair(vw[2][j / 4], vw[3][j / 4], j % 4);
#pragma unroll
            for (int m = 0; m < kMT; ++m) mma_16816<half>(st.acc_o[m][j], a[m], b0, b1);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // all warps done with K/V: the stages become the merge buffer

    // Merge the warps' softmax states: M = max_w m_w, O = sum_w exp2(m_w - M) O_w / sum_w exp2(m_w - M) l_w.
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
    // s_o: [warps][kRows][kMergeStride]. A thread holds channels (2t + e) kDT + j of its rows; it stores n-tiles j and
    // j + 1 (adjacent channels) as one float2. With rows kHeadDim + 8 floats apart and 2 padding floats after each
    // t's 2 kDT channels, a half-warp's 16 float2 stores (g 0..3, t 0..3) fall on 32 distinct banks; in natural
    // order at stride kHeadDim all 32 lanes hit one bank (~4 us of a 32k call on the H100, decode_phases.py).
    constexpr int kMS = Traits::kMergeStride;
    auto merge_pos = [](int c) { return c + 2 * (c / (2 * kDT)); };
    float* s_o = reinterpret_cast<float*>(sKV);
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
            // O holds 256 x kFp8KvOperandScale x the output (P carries v_scale x 256): 1 with the bit trick, 256 without.
            constexpr float kOut = 1.f / (256.f * kFp8KvOperandScale);
            const float f = total > 0.f ? exp2f(st.row_max[m][r] - mm) / total * kOut : 0.f;
            float* dst = s_o + (warp * kRows + row) * kMS;
#pragma unroll
            for (int j = 0; j < kDT; j += 2)  // C column 2t + e of n-tile j is channel (2t + e) kDT + j
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    *reinterpret_cast<float2*>(dst + merge_pos((2 * t + e) * kDT + j)) =
                        make_float2(st.acc_o[m][j][2 * r + e] * f, st.acc_o[m][j + 1][2 * r + e] * f);
        }
    __syncthreads();

    // From here on the fp16 decode kernel's epilogue, s_o read through merge_pos: sum the warps, write O (or the
    // split's partials) and the lse (natural log, without the k_shift term), then the fused combine.
    const bool split_out = params.num_splits > 1;
    for (int idx = tid * 2; idx < num_rows * kHeadDim; idx += Traits::kThreads * 2) {
        const int row = idx / kHeadDim, d = idx % kHeadDim;
        float x = 0.f, y = 0.f;
#pragma unroll
        for (int w = 0; w < Traits::kNWarps; ++w) {
            const float2 v = *reinterpret_cast<const float2*>(s_o + (w * kRows + row) * kMS + merge_pos(d));
            x += v.x;
            y += v.y;
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

    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* counter = params.split_counters + batch * params.num_kv_heads + kv_head;
        const bool last = atomicAdd(counter, 1) == params.num_splits - 1;
        if (last) *counter = 0;  // left zero for the next launch on these counters (as the fp16 decode kernel)
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
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_decode_fp8kv_kernel(const FlashDecodeFp8KvParams params) {
    flash_decode_fp8kv_body<T, Traits>(params);
}

}  // namespace llm_attn

// Tile configurations and the host-side choices that depend on shapes (tile size, number of KV splits).
// Shared by the launch templates and the dispatcher so both agree on the split count the workspace is sized for.
#pragma once

#include "flash.h"

namespace llm_attn {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMTiles_, bool kPipeline_, int kMinArch_>
struct FwdTraits;

template <int kHeadDim>
struct FwdConfig;

// head_dim 128. Large: 128 query rows (8 warps x 16) x 64 keys. Q 32 KB + 2 stages x (K 16 KB + V 16 KB) = 96 KB
// of shared memory: fits the 99 KB per-block limit of sm_86/sm_89 (RTX 4060 Ti) as well as sm_80/87/90. With one
// m-tile per warp the Q fragments live in registers and two S tiles fit beside the O accumulators, so the loop is
// software-pipelined (S of tile j + 1 overlaps the softmax of tile j).
// Small: 64 rows (4 warps), for grids that would not fill the GPU (short prompts, decode).
// Wide: 4 warps x 32 rows (two m16 tiles each), so every K/V fragment read from shared memory feeds two mma; used
// where an SM holds two blocks of it. Its 128 O accumulators leave room for a 32-key S tile (64 KB of smem).
// Wide64: the same with 64-key tiles (96 KB, half the per-tile softmax and barrier overhead): 255 registers and
// no spill on sm_90 non-causal only (4 bytes spill on sm_80-89, where two 96 KB blocks do not fit an SM anyway,
// and 4-76 bytes in the causal variant), so its device code is built for sm_90 only.
template <>
struct FwdConfig<128> {
    using Large = FwdTraits<128, 128, 64, 8, 1, true, 0>;
    using Small = FwdTraits<128, 64, 64, 4, 1, true, 0>;
    using Wide = FwdTraits<128, 128, 32, 4, 2, false, 0>;
    using Wide64 = FwdTraits<128, 128, 64, 4, 2, false, 900>;
    static constexpr bool kHasWide64 = true;
    // Causal: Wide once the grid has >= 3 blocks per SM (S >= 2048 for B=1, 32 heads on the H100); below, Large's
    // one 8-warp block per SM balances the few, uneven causal blocks better (kernels/NOTES.md v6).
    static constexpr int kWideCausalMinBlocksPerSm = 3;
    static constexpr int kBlockMLarge = 128, kBlockMSmall = 64, kBlockN = 64;
};

// head_dim 64: rows are half as wide, so the large tile takes twice the keys (Q 16 KB + 2 x (16 + 16) KB = 80 KB).
// The small tile stays at 64 keys: with 128 keys its 4-warp variant runs out of registers (spills).
// Wide for head_dim 64: 4 warps x 32 rows x 64 keys, 48 KB (2 blocks per sm_90 SM by registers), 222-239 registers.
// Large is not pipelined for head_dim 64: two 128-key S tiles spill in its split-KV variant.
template <>
struct FwdConfig<64> {
    using Large = FwdTraits<64, 128, 128, 8, 1, false, 0>;
    using Small = FwdTraits<64, 64, 64, 4, 1, true, 0>;
    using Wide = FwdTraits<64, 128, 64, 4, 2, false, 0>;
    using Wide64 = Wide;  // already 64 keys
    static constexpr bool kHasWide64 = false;
    static constexpr int kWideCausalMinBlocksPerSm = 0;
    static constexpr int kBlockMLarge = 128, kBlockMSmall = 64, kBlockN = 128;
};

int max_smem_per_sm_current_device();
int cc_major_current_device();

// Small tiles when the large-tile grid would leave SMs idle.
inline bool use_small_tiles(const FlashFwdParams& p, int num_sms) {
    if (p.tile != kTileAuto) return p.tile == kTileSmall;
    const int block_m = 128;  // both head dims use 128-row large tiles
    const long blocks = static_cast<long>((p.seqlen_q + block_m - 1) / block_m) * p.num_heads * p.batch;
    return blocks < num_sms;
}

// The split-KV decode kernel packs (query heads per KV head) x q_len rows into at most two m16 tiles.
constexpr int kDecodeMaxRows = 32;
inline bool use_decode_kernel(const FlashFwdParams& p) {
    return p.num_heads / p.num_kv_heads * p.seqlen_q <= kDecodeMaxRows;
}

}  // namespace llm_attn

// Tile configurations and the host-side choices that depend on shapes (tile size, number of KV splits).
// Shared by the launch templates and the dispatcher so both agree on the split count the workspace is sized for.
#pragma once

#include "flash.h"

namespace llm_attn {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMTiles_>
struct FwdTraits;

template <int kHeadDim>
struct FwdConfig;

// head_dim 128. Large: 128 query rows (8 warps x 16) x 64 keys. Q 32 KB + 2 stages x (K 16 KB + V 16 KB) = 96 KB
// of shared memory: fits the 99 KB per-block limit of sm_86/sm_89 (RTX 4060 Ti) as well as sm_80/87/90.
// Small: 64 rows (4 warps), for grids that would not fill the GPU (short prompts, decode).
// Wide (used where an SM holds two blocks of it, sm_90): 4 warps x 32 rows (two m16 tiles each), so every K/V
// fragment read from shared memory feeds two mma. For head_dim 128 the 128 O accumulators leave room for a
// 32-key S tile only (64 keys spill): 64 KB of smem, 2 blocks per SM by registers. On the H100 it gained 4-8 %
// non-causal but lost 2-7 % causal at 2k-4k (twice the diagonal tiles to mask), so causal keeps the Large tile
// (kernels/NOTES.md v4-v5).
template <>
struct FwdConfig<128> {
    using Large = FwdTraits<128, 128, 64, 8, 1>;
    using Wide = FwdTraits<128, 128, 32, 4, 2>;
    static constexpr bool kWideCausal = false;
    using Small = FwdTraits<128, 64, 64, 4, 1>;
    static constexpr int kBlockMLarge = 128, kBlockMSmall = 64, kBlockN = 64;
};

// head_dim 64: rows are half as wide, so the large tile takes twice the keys (Q 16 KB + 2 x (16 + 16) KB = 80 KB).
// The small tile stays at 64 keys: with 128 keys its 4-warp variant runs out of registers (spills).
// Wide for head_dim 64: 4 warps x 32 rows x 64 keys, 48 KB (4 blocks per sm_90 SM), 238-242 registers, no spills.
template <>
struct FwdConfig<64> {
    using Large = FwdTraits<64, 128, 128, 8, 1>;
    using Wide = FwdTraits<64, 128, 64, 4, 2>;
    static constexpr bool kWideCausal = true;
    using Small = FwdTraits<64, 64, 64, 4, 1>;
    static constexpr int kBlockMLarge = 128, kBlockMSmall = 64, kBlockN = 128;
};

int max_smem_per_sm_current_device();

// Small tiles when the large-tile grid would leave SMs idle.
inline bool use_small_tiles(const FlashFwdParams& p, int num_sms) {
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

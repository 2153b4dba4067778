// Runtime -> compile-time dispatch for the backward kernels.
#include "flash.h"
#include "kernel_tiles.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace llm_attn {

// The dK/dV kernel's tile (flash_bwd_launch.cuh) as numbers: BwdTile<D>, or BwdTileNarrow<D> where the device's
// shared memory per block is below BwdTile's.
struct BwdTileDims {
    int block_m, block_n, n_warps;
};
template <int D, template <int> class Tile>
constexpr BwdTileDims bwd_dims() { return {Tile<D>::kBlockM, Tile<D>::kBlockN, Tile<D>::kNWarps}; }

static BwdTileDims bwd_tile(int head_dim, bool narrow) {
    if (head_dim == 128) return narrow ? bwd_dims<128, BwdTileNarrow>() : bwd_dims<128, BwdTile>();
    return narrow ? bwd_dims<64, BwdTileNarrow>() : bwd_dims<64, BwdTile>();
}

void flash_bwd_set_splits(FlashBwdParams& p, int num_sms, int force_splits, int force_tile) {
    const BwdTileDims wide = bwd_tile(p.head_dim, false);
    // Deterministic: never the Hopper kernel (the binding refuses it forced), dQ by the separate kernel (below).
    p.hopper = !p.deterministic && ((force_tile >= kBwdHopper && force_tile <= kBwdHopperSharedDq) ||
                                    (force_tile == kBwdAuto && flash_fwd_sm90_available()));
    p.narrow = !p.hopper && (force_tile == kBwdNarrow ||
                             max_smem_per_block_current_device() < bwd_smem_bytes(p.head_dim, wide.block_m, wide.block_n));
    // The two-dimensional portable kernel (flash_bwd_2d_kernel.cuh) where its shared memory fits (161 KB at head_dim
    // 128: sm_80/87/90, not sm_86/89; 97 KB at 64): forced, or by default at head_dim 128, where it runs 1.11-1.18x
    // the portable kernel (H100, forced; at head_dim 64 0.95-0.98x: kernels/NOTES.md BP1, BP3).
    p.layout2d = !p.hopper && max_smem_per_block_current_device() >= bwd_2d_smem_bytes(p.head_dim) &&
                 (force_tile == kBwdPortable2d || (force_tile == kBwdAuto && p.head_dim == 128));
    if (p.layout2d) p.narrow = false;
    // The Hopper kernel (flash_bwd_sm90_kernel.cuh, Sm90BwdTraits): 128 keys, 64 query rows a step (128 at head_dim
    // 64), one block of 8 consumer warps per SM. The two-dimensional kernel: 128 keys, 64 rows, 8 warps.
    const BwdTileDims tile = p.hopper      ? BwdTileDims{p.head_dim == 64 ? 128 : 64, 128, 8}
                             : p.layout2d ? BwdTileDims{64, 128, 8}
                                          : bwd_tile(p.head_dim, p.narrow);
    const int block_m = tile.block_m;
    const int block_n = tile.block_n;
    const int group = p.num_heads / p.num_kv_heads;
    const int num_m = (p.seqlen_q + block_m - 1) / block_m;
    const int n_blocks = (p.seqlen_k + block_n - 1) / block_n;
    const long max_iters = static_cast<long>(group) * num_m;  // steps of a key block that sees every query block
    // Steps of all key blocks of one (batch, KV head); causal key blocks start at their diagonal (seqused_k is on
    // the device: the full length stands in for it here).
    long total = 0;
    for (int n = 0; n < n_blocks; ++n) {
        const int m_min = p.causal ? std::max(n * block_n - (p.seqlen_k - p.seqlen_q), 0) / block_m : 0;
        total += static_cast<long>(group) * std::max(num_m - m_min, 0);
    }
    total *= static_cast<long>(p.num_kv_heads) * p.batch;
    const long blocks = static_cast<long>(n_blocks) * p.num_kv_heads * p.batch;
    // `slots` blocks run at once: the kernel's ~250 registers per thread fill the 64K register file with 256
    // threads (two 4-warp blocks or one 8-warp block).
    const long slots = static_cast<long>(8 / tile.n_warps) * num_sms;
    long splits = 1;
    if (force_splits > 0) {
        splits = force_splits;
    } else if (p.causal && blocks < 2 * slots) {
        // Causal key blocks are unequal (the first see every query): below 2 waves, split them into shares of at
        // least 8 steps (amortises the K/V load and the atomic epilogue). The portable kernels: ~4 waves of shares
        // of about equal work (H100, B=1 32/8 hd128 bf16: S=2048 0.83 ms split vs 1.10 unsplit; S=8192, 3.9 waves,
        // 6.87 split in 3 vs 6.65 unsplit; kernels/NOTES.md, Backward). The Hopper kernel (one 8-warp block an SM,
        // a 64 KB K/V load and 128 KB of float32 dK/dV atomics a share): one wave, the longest share at most 1.25x
        // the mean SM's work (H100, 32/8 hd128: S=1024 3 shares 103 us vs 4-wave 134, S=2048 2 shares 263 vs 379,
        // S=4096 unsplit 791 vs 876; kernels/NOTES.md, "The Hopper backward's split rule").
        const long per = p.hopper ? std::max((5 * total + 4 * slots - 1) / (4 * slots), 8L)
                                  : std::max((total + 4 * slots - 1) / (4 * slots), 8L);
        splits = (max_iters + per - 1) / per;
    } else if (!p.causal && blocks * 5 < slots * 4) {
        // Equal blocks that leave SMs idle: as many whole copies of the grid as fit one wave. A full wave is not
        // split (S=2048 B=1 32/8 bf16 backward: 1.23 ms split in 5 (v2) vs 1.07 unsplit (v1)).
        splits = slots / blocks;
    }
    splits = std::max(1L, std::min({splits, max_iters, 65535L / p.batch}));
    p.iters_per_split = static_cast<int>((max_iters + splits - 1) / splits);
    p.num_splits = static_cast<int>((max_iters + p.iters_per_split - 1) / p.iters_per_split);
    // The Hopper kernel's dQ over the block's 128 keys by one warpgroup a step (half the dQ bytes through L2), unless
    // forced to each warpgroup's own 64 keys. H100, 32/8 hd128 and 4 x 32 hd64, S 1024-8192, at every split count
    // 1-4: shared 0.78-1.01x own's time (one wave at S=2048 non-causal: 364 vs 459 us); kernels/NOTES.md, "The
    // Hopper backward's split rule". (HB4 chose own at short S from H200 runs of an earlier kernel.)
    p.dq_shared = force_tile != kBwdHopperOwnDq;
    // The portable kernels' dQ without atomics (flash_bwd_dq_kernel) only when forced: measured against the atomics
    // on the H200 (portable kernels forced, bf16, 32/8 heads hd128 and 4 x 32 heads hd64), it is 0.92-0.96x at
    // S 2048-4096 (it recomputes S and dP) and within the benchmark's run-to-run spread at S 512-1024 (medians
    // 0.88-1.26x, rounds 0.66-2.05x): no shape where it reliably wins (kernels/NOTES.md "Backward: dQ without
    // atomics").
    p.dq_separate = !p.hopper && (force_tile == kBwdPortableSeparateDq || p.deterministic);
}

template <typename T, int D>
static cudaError_t run_flash_bwd_typed(FlashBwdParams& p, cudaStream_t stream) {
    if (p.hopper) return p.causal ? run_flash_bwd_sm90_<T, D, true>(p, stream) : run_flash_bwd_sm90_<T, D, false>(p, stream);
    return p.causal ? run_flash_bwd_<T, D, true>(p, stream) : run_flash_bwd_<T, D, false>(p, stream);
}

cudaError_t run_flash_bwd(FlashBwdParams& p, cudaStream_t stream) {
    if (p.hopper && !flash_fwd_sm90_available()) return cudaErrorInvalidDeviceFunction;  // forced off an sm_90a device
    if (p.head_dim == 128)
        return p.is_bf16 ? run_flash_bwd_typed<__nv_bfloat16, 128>(p, stream) : run_flash_bwd_typed<half, 128>(p, stream);
    if (p.head_dim == 64)
        return p.is_bf16 ? run_flash_bwd_typed<__nv_bfloat16, 64>(p, stream) : run_flash_bwd_typed<half, 64>(p, stream);
    return cudaErrorInvalidValue;  // the binding validates head_dim first
}

}  // namespace llm_attn

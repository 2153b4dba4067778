// Plain C++ interface of attention over the FP8 (e4m3) KV cache: the split-KV decode kernel
// (flash_decode_fp8kv_kernel.cuh) and the prefill kernel (flash_prefill_fp8kv_kernel.cuh), one params struct.
// No torch headers: kernels/binding.cpp fills the params. The cache format is llm_attn/kv_cache_reference.py's:
//   k_data, v_data   uint8 (e4m3 bits) (batch, kv_heads, capacity, head_dim), head_dim contiguous
//   k_scale, v_scale float32 (batch, kv_heads, ceil(capacity / 64)), one scale per 64-token block, block stride 1
//   K[t] = e4m3(k_data[t]) * k_scale[t / 64] (+ k_shift, which attention never needs: the same score shift for
//   every key of a row; the lse returned here leaves it out)      V[t] = e4m3(v_data[t]) * v_scale[t / 64]
// Q and O are fp16 or bf16 as in FlashFwdParams. The 64-token scale block is both kernels' 64-key tile.
#pragma once

#include "flash.h"
#include "kernel_tiles.h"  // kDecodeMaxRows

namespace llm_attn {

struct FlashDecodeFp8KvParams {
    // q, o, lse, seqused_k, the q/o strides (elements), k/v strides (bytes: one e4m3 byte per element), shapes
    // (seqlen_k = tokens in the cache; seqused_k may cut it per batch), scale, causal (bottom-right, q_len > 1),
    // is_bf16 (of q and o), and the split-KV workspace, exactly as the fp16 decode kernel reads them.
    FlashFwdParams base;
    const float* __restrict__ k_scale;
    const float* __restrict__ v_scale;
    int64_t ks_batch_stride, ks_head_stride;  // in floats; consecutive blocks are adjacent
    int64_t vs_batch_stride, vs_head_stride;
};

// Shared memory of DecodeFp8KvTraits<D, kMTiles, kStages, kWGroups> (flash_decode_fp8kv_kernel.cuh): fp16 Q, the
// tile scales (128 bytes a warp group), and the larger of the groups' e4m3 K/V stages and the warp merge's float32
// buffer ([warps][rows][head_dim + 8]).
constexpr int decode_fp8kv_smem_bytes(int head_dim, int m_tiles, int stages, int wgroups) {
    const int stage_bytes = 2 * wgroups * stages * 64 * head_dim;
    const int merge_bytes = 4 * wgroups * 16 * m_tiles * (head_dim + 8) * 4;
    return 16 * m_tiles * head_dim * 2 + 128 * wgroups + (stage_bytes > merge_bytes ? stage_bytes : merge_bytes);
}
// The same for a config of kernel_tiles.h's DecodeFp8KvConfig<D> by its type, which host code sees only declared.
template <typename Traits>
struct DecodeFp8KvSmem;
template <int D, int M, int S, int W>
struct DecodeFp8KvSmem<DecodeFp8KvTraits<D, M, S, W>> {
    static constexpr int kBytes = decode_fp8kv_smem_bytes(D, M, S, W);
};

// Launches attention over the FP8 cache on `stream` (never synchronises): the split-KV decode kernel where
// (query heads per KV head) x q_len <= kDecodeMaxRows (kernel_tiles.h), else the prefill kernel
// (flash_prefill_fp8kv_kernel.cuh: chunked prefill, q_len <= kv_len; num_splits must be 1). head_dim 64 or 128;
// anything else returns cudaErrorInvalidValue.
cudaError_t run_flash_decode_fp8kv(FlashDecodeFp8KvParams& params, cudaStream_t stream);
// KV splits of such a launch on a device with `num_sms` SMs and `smem_per_block_optin` bytes of shared memory a
// block (flash_decode_fp8kv.cu says the rule) for a decode call, 1 for a prefill call.
int flash_decode_fp8kv_num_splits(const FlashDecodeFp8KvParams& params, int num_sms, int smem_per_block_optin);
// Whether a decode launch of `splits` splits runs blocks of two warp groups (DecodeFp8KvConfig<D>::OneTileWG2):
// one m16 row tile, the grid at most one block an SM, and the config's shared memory within the device's.
bool flash_decode_fp8kv_two_groups(const FlashDecodeFp8KvParams& params, int splits, int num_sms,
                                   int smem_per_block_optin);

// The prefill kernel's version for a call: LLM_ATTN_FP8KV_PREFILL_V "1" or "2" forces one (read per call, so that one
// process can time both); otherwise v2 (each K/V tile converted to fp16 once per 128-row block) where its blocks,
// ceil(rows / v2_rows) x KV heads x batch, are more than half the `num_sms` SMs, and v1 on smaller grids: there v1's
// twice as many 64-row blocks still get an SM each, while v2 leaves SMs idle. Measured on the H100 (132 SMs): v1 1.47x
// v2 at 64 blocks, v2 1.12x v1 at 128 and 1.08-1.12x from 256 (kernels/NOTES.md "Prefill over the FP8 KV cache
// v2"). llm_attn/_plan.py's prefill_fp8kv_version mirrors it.
int flash_prefill_fp8kv_version(const FlashDecodeFp8KvParams& params, int v2_rows, int num_sms);

// One instantiation file per (head_dim, dtype of q and o) and kernel (generated): flash_decode_fp8kv_hdim{D}_{dtype}.cu,
// flash_prefill_fp8kv_hdim{D}_{dtype}.cu.
template <typename T, int kHeadDim>
cudaError_t run_flash_decode_fp8kv_(FlashDecodeFp8KvParams& params, cudaStream_t stream);
template <typename T, int kHeadDim>
cudaError_t run_flash_prefill_fp8kv_(FlashDecodeFp8KvParams& params, cudaStream_t stream);

}  // namespace llm_attn

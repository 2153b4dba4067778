// Runtime -> compile-time dispatch for the forward kernel, and the KV-split heuristic.
#include "flash.h"
#include "flash_fwd_config.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace llm_attn {

static int device_attribute(cudaDeviceAttr attr, int fallback) {
    constexpr int kMaxDevices = 64;
    static int cache[5][kMaxDevices] = {};
    const int slot = attr == cudaDevAttrMultiProcessorCount            ? 0
                     : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? 1
                     : attr == cudaDevAttrMaxSharedMemoryPerMultiprocessor ? 2
                     : attr == cudaDevAttrComputeCapabilityMajor       ? 3
                                                                        : 4;  // compute capability minor
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return fallback;
    if (cache[slot][dev] == 0 && cudaDeviceGetAttribute(&cache[slot][dev], attr, dev) != cudaSuccess) return fallback;
    return cache[slot][dev];
}
int num_sms_current_device() { return device_attribute(cudaDevAttrMultiProcessorCount, 1); }
int max_smem_per_block_current_device() { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024); }
int max_smem_per_sm_current_device() { return device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, 48 * 1024); }
int cc_major_current_device() { return device_attribute(cudaDevAttrComputeCapabilityMajor, 0); }

// sm_90a machine code runs on compute capability 9.0 only (H100, H200); 0 = unknown, 1 = no, 2 = yes, per device.
bool flash_fwd_sm90_available() {
    constexpr int kMaxDevices = 64;
    static int cache[kMaxDevices] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
    if (cache[dev] == 0) {
        const bool cc90 = device_attribute(cudaDevAttrComputeCapabilityMajor, 0) == 9 &&
                          device_attribute(cudaDevAttrComputeCapabilityMinor, -1) == 0;
        cache[dev] = cc90 && flash_fwd_sm90_built_<__nv_bfloat16, 128, true>() ? 2 : 1;
    }
    return cache[dev] == 2;
}

// The Hopper kernel takes every prefill that the portable kernel would run unsplit; grids too small for one wave
// keep the portable kernel's split-KV path.
static bool use_sm90(const FlashFwdParams& p) {
    return p.tile == kTileHopper || (p.tile == kTileAuto && p.num_splits == 1 && flash_fwd_sm90_available());
}

// Decode tuning overrides (flash.h): plain ints like the binding's tile override; set between calls, not during.
static int g_decode_splits = 0;
static int g_decode_config = kDecodeAuto;
int flash_decode_force_splits(int splits) {
    const int prev = g_decode_splits;
    g_decode_splits = splits > 0 ? splits : 0;
    return prev;
}
int flash_decode_force_config(int config) {
    if (config < kDecodeAuto || config >= kDecodeConfigCount) return -1;
    const int prev = g_decode_config;
    g_decode_config = config;
    return prev;
}
int flash_decode_forced_config() { return g_decode_config; }
int flash_decode_forced_splits() { return g_decode_splits; }

// Decode: at most one (batch, KV head, split) block per SM, each split keeping at least one 64-key tile. A 2-way
// split repays its combine pass only from 1024 keys (each block then streams >= 512 keys); fewer than 2 splits
// means none. Rule v4, refitted after the counter pool made a split launch ~2 µs cheaper on the H200 grid of
// experiments/decode_splits.py (kernels/NOTES.md, "decode split rule v4"); llm_attn/_plan.py mirrors it.
static int decode_num_splits(const FlashFwdParams& p, int num_sms) {
    const long blocks = static_cast<long>(p.batch) * p.num_kv_heads;
    const int n_tiles = (p.seqlen_k + 63) / 64;
    if (g_decode_splits > 0) return g_decode_splits < n_tiles ? g_decode_splits : n_tiles;
    long splits = num_sms / blocks;
    splits = splits < n_tiles ? splits : n_tiles;
    splits = splits < 128 ? splits : 128;
    if (splits == 2 && p.seqlen_k < 1024) return 1;
    return splits >= 2 ? static_cast<int>(splits) : 1;
}

bool flash_fwd_uses_decode_kernel(const FlashFwdParams& p) { return use_decode_kernel(p); }

int flash_fwd_num_splits(const FlashFwdParams& p, int num_sms) {
    if (use_decode_kernel(p)) return decode_num_splits(p, num_sms);
    if (p.tile == kTileWide || p.tile == kTileHopper) return 1;
    const bool small = use_small_tiles(p, num_sms);
    const int block_m = small ? 64 : 128;
    const int block_n = p.head_dim == 64 ? FwdConfig<64>::kBlockN : FwdConfig<128>::kBlockN;
    const long blocks = static_cast<long>((p.seqlen_q + block_m - 1) / block_m) * p.num_heads * p.batch;
    const int n_blocks = (p.seqlen_k + block_n - 1) / block_n;
    // Split only when the grid covers less than most of one wave and there are enough key tiles to share out.
    if (blocks * 10 >= static_cast<long>(num_sms) * 8 || n_blocks < 4) return 1;
    // Fewest splits that reach ~2 blocks per SM, each split keeping at least 2 key tiles; at most 64.
    int splits = static_cast<int>((2L * num_sms + blocks - 1) / blocks);
    splits = splits < n_blocks / 2 ? splits : n_blocks / 2;
    splits = splits < 64 ? splits : 64;
    return splits > 1 ? splits : 1;
}

cudaError_t run_flash_fwd(FlashFwdParams& p, cudaStream_t stream) {
    if (use_decode_kernel(p)) {
        if (p.head_dim == 128) return p.is_bf16 ? run_flash_decode_<__nv_bfloat16, 128>(p, stream)
                                                : run_flash_decode_<half, 128>(p, stream);
        if (p.head_dim == 64) return p.is_bf16 ? run_flash_decode_<__nv_bfloat16, 64>(p, stream)
                                               : run_flash_decode_<half, 64>(p, stream);
        return cudaErrorInvalidValue;
    }
// (head_dim, dtype, causal) -> the instantiation of RUN; falls through for an unknown head_dim.
#define LLM_ATTN_FWD_SWITCH(RUN)                                                                        \
    if (p.head_dim == 128 || p.head_dim == 64) {                                                        \
        if (p.head_dim == 128 && p.is_bf16)                                                             \
            return p.causal ? RUN<__nv_bfloat16, 128, true>(p, stream) : RUN<__nv_bfloat16, 128, false>(p, stream); \
        if (p.head_dim == 128)                                                                          \
            return p.causal ? RUN<half, 128, true>(p, stream) : RUN<half, 128, false>(p, stream);       \
        if (p.is_bf16)                                                                                  \
            return p.causal ? RUN<__nv_bfloat16, 64, true>(p, stream) : RUN<__nv_bfloat16, 64, false>(p, stream); \
        return p.causal ? RUN<half, 64, true>(p, stream) : RUN<half, 64, false>(p, stream);             \
    }
    if (use_sm90(p)) {
        if (!flash_fwd_sm90_available()) return cudaErrorInvalidDeviceFunction;  // forced off an sm_90a device
        LLM_ATTN_FWD_SWITCH(run_flash_fwd_sm90_)
        return cudaErrorInvalidValue;
    }
    LLM_ATTN_FWD_SWITCH(run_flash_fwd_)
#undef LLM_ATTN_FWD_SWITCH
    return cudaErrorInvalidValue;  // the binding validates head_dim first
}

}  // namespace llm_attn

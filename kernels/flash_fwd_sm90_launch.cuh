// Host side of the Hopper forward kernel: tensor maps for Q, K, V and O, and the launch. Included by one
// instantiation file per (head_dim, dtype, causal).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "flash_fwd_sm90_kernel.cuh"
#include "launch_smem.h"

namespace llm_attn {
namespace sm90 {

// Tiles per head_dim: 128 query rows (two consumer warpgroups) x 128 keys, two K/V stages.
// head_dim 128: Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB; head_dim 64: 80 KB, or with three consumer warpgroups
// (192 query rows, launch() picks it for most head_dim-64 calls) 88 KB.
template <int kHeadDim, int kBlockN = 128, int kStages = 2, int kConsumers = 2>
using Config = Sm90Traits<kHeadDim, kBlockN, kStages, kConsumers>;

// Tuning switches read once from the environment (kernel benchmarks compare variants in one build; NOTES.md H3):
// LLM_ATTN_SM90_BLOCKN=176 (head_dim 128 non-causal key tile; +0-3 %, within noise, so not the default),
// LLM_ATTN_SM90_PINGPONG=0|1 (default 1), LLM_ATTN_SM90_CONSUMERS=2|3 (head_dim 64: consumer warpgroups, 64 rows
// each; unset: launch() chooses).
inline int tuning_env(const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

static_assert(sizeof(TmaDesc) == sizeof(CUtensorMap) && alignof(TmaDesc) == alignof(CUtensorMap),
              "TmaDesc mirrors CUtensorMap");

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult status{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
                cudaSuccess ||
            status != cudaDriverEntryPointSuccess) {
            return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }();
    return fn;
}

// A 4-D (head_dim, seq, heads, batch) map of a (batch, heads, seq, head_dim) tensor with element strides in
// `strides` (batch, head, row), read in boxes of 64 columns x box_rows rows with the 128-byte swizzle.
template <typename T>
bool encode_tensor_map(TmaDesc* desc, const void* ptr, int head_dim, int seqlen, int heads, int batch,
                       int64_t batch_stride, int64_t head_stride, int64_t row_stride, int box_rows) {
    auto encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                                static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
    // Strides in bytes of dims 1..3. A dim of size 1 is never stepped over, so any valid stride does for it (the
    // binding accepts any stride there).
    auto bytes = [](int64_t stride, int size) { return static_cast<cuuint64_t>(size == 1 ? 16 : stride * 2); };
    const cuuint64_t strides[3] = {bytes(row_stride, seqlen), bytes(head_stride, heads), bytes(batch_stride, batch)};
    const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUtensorMapDataType dtype =
        std::is_same<T, half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const CUresult r = encode(reinterpret_cast<CUtensorMap*>(desc), dtype, 4, const_cast<void*>(ptr), dims, strides,
                              box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

// Everything encode_tensor_map's result depends on. A map holds the address, not the tensor, so it is a pure
// function of this key: a call whose key was seen before copies the cached 128 bytes instead of calling the driver
// (four encodes were ~1/4 of a prefill call's host time). The NVRTC launcher caches the same way (_nvrtc_sm90.py).
struct TmaKey {
    const void* ptr;
    int64_t batch_stride, head_stride, row_stride;
    int head_dim, seqlen, heads, batch, box_rows, is_half;
    bool operator==(const TmaKey& o) const {
        return ptr == o.ptr && batch_stride == o.batch_stride && head_stride == o.head_stride &&
               row_stride == o.row_stride && head_dim == o.head_dim && seqlen == o.seqlen && heads == o.heads &&
               batch == o.batch && box_rows == o.box_rows && is_half == o.is_half;
    }
};

template <typename T>
bool make_tensor_map(TmaDesc* desc, const void* ptr, int head_dim, int seqlen, int heads, int batch,
                     int64_t batch_stride, int64_t head_stride, int64_t row_stride, int box_rows) {
    // Direct-mapped under one lock (uncontended: tens of ns): 512 slots hold the q/k/v/o maps of every layer of a
    // model whose per-layer tensors live at different addresses (a KV cache); a collision only costs an encode.
    struct Slot {
        TmaKey key;
        unsigned char desc[sizeof(TmaDesc)];
        bool valid;
    };
    constexpr int kSlots = 512;
    static Slot cache[kSlots] = {};
    static std::mutex lock;
    const TmaKey key{ptr, batch_stride, head_stride, row_stride, head_dim, seqlen, heads, batch, box_rows,
                     std::is_same<T, half>::value ? 1 : 0};
    uint64_t h = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)) >> 8;
    for (const int64_t x : {batch_stride, head_stride, row_stride, static_cast<int64_t>(seqlen),
                            static_cast<int64_t>(heads) << 32 | static_cast<int64_t>(batch) << 12 | box_rows})
        h = (h ^ static_cast<uint64_t>(x)) * 0x100000001b3ULL;
    Slot& slot = cache[(h ^ (h >> 29)) % kSlots];
    std::lock_guard<std::mutex> guard(lock);
    if (slot.valid && slot.key == key) {
        std::memcpy(desc, slot.desc, sizeof(TmaDesc));
        return true;
    }
    if (!encode_tensor_map<T>(desc, ptr, head_dim, seqlen, heads, batch, batch_stride, head_stride, row_stride,
                              box_rows))
        return false;
    slot.key = key;
    std::memcpy(slot.desc, desc, sizeof(TmaDesc));
    slot.valid = true;
    return true;
}

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_tile(const FlashFwdParams& p, cudaStream_t stream) {
    constexpr int kHeadDim = Traits::kHeadDim;
    static const int pingpong = tuning_env("LLM_ATTN_SM90_PINGPONG", 1);
    Sm90Params sp;
    sp.p = p;
    sp.pingpong = pingpong;
    const bool ok =
        make_tensor_map<T>(&sp.tma_q, p.q, kHeadDim, p.seqlen_q, p.num_heads, p.batch, p.q_batch_stride,
                           p.q_head_stride, p.q_row_stride, Traits::kBlockM) &&
        make_tensor_map<T>(&sp.tma_k, p.k, kHeadDim, p.seqlen_k, p.num_kv_heads, p.batch, p.k_batch_stride,
                           p.k_head_stride, p.k_row_stride, Traits::kBlockN) &&
        make_tensor_map<T>(&sp.tma_v, p.v, kHeadDim, p.seqlen_k, p.num_kv_heads, p.batch, p.v_batch_stride,
                           p.v_head_stride, p.v_row_stride, Traits::kBlockN) &&
        make_tensor_map<T>(&sp.tma_o, p.o, kHeadDim, p.seqlen_q, p.num_heads, p.batch, p.o_batch_stride,
                           p.o_head_stride, p.o_row_stride, 64);
    if (!ok) return cudaErrorInvalidValue;
    auto kernel = flash_fwd_sm90_kernel<T, Traits, kCausal>;
    cudaError_t err = opt_in_dynamic_smem<flash_fwd_sm90_kernel<T, Traits, kCausal>, Traits::kSmemBytes>();
    if (err != cudaSuccess) return err;
    const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const dim3 grid = kCausal ? dim3(p.num_heads, m_blocks, p.batch) : dim3(m_blocks, p.num_heads, p.batch);
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(sp);
    return cudaGetLastError();
}

template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch(const FlashFwdParams& p, cudaStream_t stream) {
    if constexpr (kHeadDim == 128 && !kCausal) {
        static const int block_n = tuning_env("LLM_ATTN_SM90_BLOCKN", 128);
        if (block_n == 176) return launch_tile<T, Config<128, 176>, kCausal>(p, stream);
    }
    if constexpr (kHeadDim == 64) {
        // Three consumer warpgroups (192 query rows) for head_dim 64, whose GEMMs per tile are half of head_dim
        // 128's against the same softmax: 1.11-1.21x two consumers on the H200 (NOTES.md H5), except causal
        // prompts up to 1024 tokens (0.93-0.94x: a 192-row block wastes more of its keys above the diagonal).
        static const int consumers = tuning_env("LLM_ATTN_SM90_CONSUMERS", 0);
        if (consumers == 3 || (consumers != 2 && !(kCausal && p.seqlen_q <= 1024)))
            return launch_tile<T, Config<64, 128, 2, 3>, kCausal>(p, stream);
    }
    return launch_tile<T, Config<kHeadDim>, kCausal>(p, stream);
}

// Whether this build holds sm_90a machine code for the kernel (built with LLM_ATTN_CUDA_ARCHS containing 9.0 and
// running on a compute capability 9.0 device); otherwise the portable kernel runs.
template <typename T, int kHeadDim, bool kCausal>
bool has_device_code() {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, flash_fwd_sm90_kernel<T, Config<kHeadDim>, kCausal>) != cudaSuccess) {
        cudaGetLastError();  // clear: "no kernel image" is an answer here, not an error for the next launch
        return false;
    }
    return attr.binaryVersion == 90 && attr.ptxVersion == 90;
}

}  // namespace sm90

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_sm90_(FlashFwdParams& params, cudaStream_t stream) {
    return sm90::launch<T, kHeadDim, kCausal>(params, stream);
}
template <typename T, int kHeadDim, bool kCausal>
bool flash_fwd_sm90_built_() {
    return sm90::has_device_code<T, kHeadDim, kCausal>();
}

}  // namespace llm_attn

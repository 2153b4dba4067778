// Host side shared by the Hopper kernels' launchers (flash_fwd_sm90_launch.cuh, flash_bwd_sm90_launch.cuh): tensor
// maps for TMA, built through the driver's cuTensorMapEncodeTiled and cached per tensor, and the tuning switches read
// from the environment. Plain CUDA C++ host code (no torch); not part of what NVRTC compiles.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "hopper.cuh"

namespace llm_attn {
namespace sm90 {

// A tuning switch read once from the environment (kernel benchmarks compare variants in one build).
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

// The tensor-map element type of T: 0 bf16, 1 fp16, 2 fp32 (the backward's float32 dQ accumulator).
template <typename T>
constexpr int kTmaElem = std::is_same<T, half>::value ? 1 : std::is_same<T, float>::value ? 2 : 0;

// A 4-D (head_dim, seq, heads, batch) map of a (batch, heads, seq, head_dim) tensor with element strides in
// `strides` (batch, head, row), in boxes of one 128-byte swizzle row of columns (64 bf16/fp16, 32 fp32) x box_rows
// rows with the 128-byte swizzle.
template <typename T>
bool encode_tensor_map(TmaDesc* desc, const void* ptr, int head_dim, int seqlen, int heads, int batch,
                       int64_t batch_stride, int64_t head_stride, int64_t row_stride, int box_rows) {
    auto encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                                static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
    // Strides in bytes of dims 1..3. A dim of size 1 is never stepped over, so any valid stride does for it (the
    // binding accepts any stride there).
    auto bytes = [](int64_t stride, int size) { return static_cast<cuuint64_t>(size == 1 ? 16 : stride * sizeof(T)); };
    const cuuint64_t strides[3] = {bytes(row_stride, seqlen), bytes(head_stride, heads), bytes(batch_stride, batch)};
    const cuuint32_t box[4] = {128 / sizeof(T), static_cast<cuuint32_t>(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    constexpr CUtensorMapDataType kTypes[3] = {CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                               CU_TENSOR_MAP_DATA_TYPE_FLOAT32};
    const CUresult r = encode(reinterpret_cast<CUtensorMap*>(desc), kTypes[kTmaElem<T>], 4, const_cast<void*>(ptr),
                              dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

// Everything encode_tensor_map's result depends on. A map holds the address, not the tensor, so it is a pure
// function of this key: a call whose key was seen before copies the cached 128 bytes instead of calling the driver
// (four encodes were ~1/4 of a prefill call's host time). The NVRTC launcher caches the same way (_nvrtc_sm90.py).
struct TmaKey {
    const void* ptr;
    int64_t batch_stride, head_stride, row_stride;
    int head_dim, seqlen, heads, batch, box_rows, elem;
    bool operator==(const TmaKey& o) const {
        return ptr == o.ptr && batch_stride == o.batch_stride && head_stride == o.head_stride &&
               row_stride == o.row_stride && head_dim == o.head_dim && seqlen == o.seqlen && heads == o.heads &&
               batch == o.batch && box_rows == o.box_rows && elem == o.elem;
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
    const TmaKey key{ptr, batch_stride, head_stride, row_stride, head_dim, seqlen, heads, batch, box_rows, kTmaElem<T>};
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

// The Q, K and V maps of a launch (FlashFwdParams and FlashBwdParams name those fields alike): boxes of q_box_rows
// query rows and kv_box_rows key rows.
template <typename T, typename Params>
bool make_qkv_maps(const Params& p, int head_dim, int q_box_rows, int kv_box_rows, TmaDesc* q, TmaDesc* k, TmaDesc* v) {
    return make_tensor_map<T>(q, p.q, head_dim, p.seqlen_q, p.num_heads, p.batch, p.q_batch_stride, p.q_head_stride,
                              p.q_row_stride, q_box_rows) &&
           make_tensor_map<T>(k, p.k, head_dim, p.seqlen_k, p.num_kv_heads, p.batch, p.k_batch_stride, p.k_head_stride,
                              p.k_row_stride, kv_box_rows) &&
           make_tensor_map<T>(v, p.v, head_dim, p.seqlen_k, p.num_kv_heads, p.batch, p.v_batch_stride, p.v_head_stride,
                              p.v_row_stride, kv_box_rows);
}

}  // namespace sm90
}  // namespace llm_attn

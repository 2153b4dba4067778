// Plain C++ interface of the FP8 KV cache's one-token append (fp8_cache_append.cu): the device step of
// llm_attn.models.kv_cache.Fp8StaticLayer(device_position=True) in one launch per layer, in place of the ~35 small
// PyTorch ops that did it (each a kernel in the decode step's CUDA graph). No torch headers: kernels/binding.cpp
// fills the params.
//
// What one launch does, per (batch, KV head), at the write position p = *position (the cache's cumulative_length,
// read on the device; nothing on the host), with slot = p % 64 and block = min(p / 64, last_block):
//   1. k_open[slot], v_open[slot] = the new token's K, V in float32 (the open block's original values);
//   2. block 0 still open: k_shift = the per-channel lower median of k_open[0 .. slot] (kv_cache_reference
//      .smoothing_shift: a median is one of the values, exact);
//   3. the open block re-quantised from its originals exactly as kv_cache_reference.quantize does it (slots past
//      the token count as zeros): scale = amax * float32(1 / 448) (1 when amax is 0), data = e4m3(clamp(x * (1 /
//      scale), +-448)), with an IEEE division and rounding to nearest even, so the bytes and scales equal the PyTorch path's bit for bit;
//      K is x = k_open - k_shift, V is x = v_open; all 64 rows of the block are written;
//   4. used[b] = min(p + 1, max_cache_len) (int32: the decode kernel's seqused_k).
// The caller advances the position afterwards (one add): the launch only reads it. The e4m3 rounding is done in
// software (exact on every architecture from sm_80). The append writes 16 KB per layer: 4.6-5.9 us a launch on an
// H100 with 1024 threads a block (kernels/NOTES.md "The FP8 cache's append, spread over the block").
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace llm_attn {

constexpr int kFp8CacheBlock = 64;  // tokens per scale (kv_cache_reference.BLOCK)

struct Fp8CacheAppendParams {
    const void* k_new;  // (batch, kv_heads, 1, head_dim) fp16 or bf16; head_dim contiguous
    const void* v_new;
    int64_t kn_batch_stride, kn_head_stride, vn_batch_stride, vn_head_stride;  // elements
    float* k_open;      // (batch, kv_heads, 64, head_dim) float32, contiguous
    float* v_open;
    float* k_shift;     // (batch, kv_heads, head_dim) float32, contiguous
    uint8_t* k_data;    // (batch, kv_heads, capacity, head_dim) e4m3 bytes, contiguous
    uint8_t* v_data;
    float* k_scale;     // (batch, kv_heads, capacity / 64) float32, contiguous
    float* v_scale;
    const int64_t* position;  // one int64: the token's position (tokens cached before it)
    int32_t* used;            // (batch,) int32: min(position + 1, max_cache_len), written
    int batch, kv_heads, head_dim, capacity, max_cache_len;
    bool is_bf16;       // of k_new and v_new
};

// Launches the append on `stream` (never synchronises). head_dim 64 or 128 and capacity a positive multiple of 64;
// anything else returns cudaErrorInvalidValue.
cudaError_t run_fp8_cache_append(const Fp8CacheAppendParams& params, cudaStream_t stream);

}  // namespace llm_attn

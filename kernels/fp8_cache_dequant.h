// Plain C++ interface of the FP8 KV cache's dequantised copy (fp8_cache_dequant.cu; the kernel is
// fp8_cache_dequant_kernel.cuh, which the NVRTC build compiles too): K and V of one layer's cache, tokens [0, n), in
// fp16 or bf16, in one launch, in place of the ~5 PyTorch ops per operand that made it (a float32 temporary each:
// ~27 bytes of traffic per element against the 3 a fused pass needs). It is the copy every call that cannot read the
// FP8 bytes itself gets (stock attention, a chunked prefill sent to the copy, another registry entry). No torch
// headers: kernels/binding.cpp fills the params (the NVRTC build: llm_attn/_cuda_abi.py's mirror, from _nvrtc.py).
//
// Per element, exactly kv_cache_reference.dequantize: out = dtype(float32(e4m3) * scale[token / 64] (+ k_shift for
// K)), the product and the sum each rounded in float32 (never contracted into an FMA), then one rounding to the
// output dtype (nearest even). Bit-identical to the PyTorch reference on every architecture.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace llm_attn {

struct Fp8CacheDequantParams {
    const uint8_t* k_data;   // (batch, kv_heads, capacity, head_dim) e4m3 bytes, contiguous; tokens [0, n) read
    const uint8_t* v_data;
    const float* k_scale;    // (batch, kv_heads, scale_blocks) float32, contiguous; block t / 64 scales token t
    const float* v_scale;
    const float* k_shift;    // (batch, kv_heads, head_dim) float32, contiguous: added to K (nullptr: none)
    void* k_out;             // (batch, kv_heads, n, head_dim) fp16 or bf16, contiguous, written whole
    void* v_out;
    int batch, kv_heads, head_dim, capacity, scale_blocks, n;
    bool is_bf16;            // of k_out and v_out
};

// Launches the copy on `stream` (never synchronises). head_dim 64 or 128, 0 <= n <= capacity, scale_blocks >=
// ceil(n / 64), batch * kv_heads <= 65535, the data pointers 16-byte aligned; anything else returns
// cudaErrorInvalidValue. n == 0 launches nothing.
cudaError_t run_fp8_cache_dequant(const Fp8CacheDequantParams& params, cudaStream_t stream);

}  // namespace llm_attn

// Plain C++ interface of the portable INT8 forward (issue 34 item 2; mma.sync, sm_80 .. sm_90). No torch headers:
// kernels/binding.cpp wires it. The kernels: flash_fwd_int8_quant.cuh (the pre-pass), flash_fwd_int8_kernel.cuh
// (attention), flash_fwd_int8_launch.cuh + flash_fwd_int8_hdim*.cu (instantiations), flash_fwd_int8.cu (dispatch,
// workspace). llm_attn/quant_reference_int8.py holds the same algorithm in PyTorch.
//
// What one call computes (two pre-pass launches, then the attention kernel, all on the caller's stream):
//   K: smoothed by its per-channel mean over the valid keys of its (batch, KV head) (q . mean is the same for every
//      key of a row, so no softmax row changes; the lse adds it back), then int8 with one scale per (batch, KV
//      head, kInt8KBlock keys) = amax / 127.
//   Q: int8 inside the attention kernel (no workspace), one scale per (batch, head, row) = amax / 127.
//      softmax_scale * log2(e) is folded into the dequantisation factor of each row and 32-key group of S.
//   S = (Q8 K8^T) in int32 by mma.sync m16n8k32 s8, times q_scale[row] * k_scale[group] * scale * log2(e) in fp32;
//      online softmax in base 2.
//   fp8_pv (sm_89 only: sm_90 lowers e4m3 mma.sync to f16 unpacks + HMMA): V in e4m3 with one scale per (batch, KV head, channel) = amax / 448 over the valid keys,
//      stored transposed (head_dim rows of keys) with the keys of each 16 permuted to match P's registers; P * 256 in
//      e4m3 (exact running max); O += P8 V8 by mma.sync m16n8k32 e4m3 into a per-64-key fp32 accumulator that is
//      added to O in plain fp32 (the FP8 mma accumulates with reduced precision).
//   !fp8_pv (any arch, the only choice on sm_80/86/87/90): V read as given (fp16/bf16, no workspace), P in the input
//      dtype, O += P V by mma.sync m16n8k16 (as the bf16 kernel).
//   Out in the input dtype; lse natural-log float32 (may be null). Rows that see no key: 0 and lse -inf. Keys at or
//   past seqused_k are never read into a statistic and are zero in the workspace (they may hold NaN).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace llm_attn {

// The kernel's tiles (8 warps x 16 query rows, 128-key tiles) and the granularity of the K scales. Q has one scale
// per row, and K one per 32 keys: on queries with 4x the score spread (peaky) int8 Q K^T's rounding is most of the
// error, and its size follows each scale's block (kernels/NOTES.md "Per-row Q scales").
constexpr int kInt8WarpRows = 16;   // query rows per warp (one m16 tile)
constexpr int kInt8BlockM = 128;    // query rows per thread block
constexpr int kInt8BlockN = 128;    // keys per key tile
constexpr int kInt8KBlock = 32;     // keys per K scale (4 per key tile)
constexpr int kInt8MaxStatChunks = 32;  // the K/V statistics pass splits each (batch, KV head) into at most this many

// Keys rounded up to whole kInt8BlockN tiles: the workspace's key dimension (pad keys are zero).
__host__ __device__ inline int int8_seqlen_k_pad(int seqlen_k) { return (seqlen_k + kInt8BlockN - 1) / kInt8BlockN * kInt8BlockN; }
// Keys per chunk of the statistics pass: at least 256 (a block's worth of loads), at most kInt8MaxStatChunks chunks.
__host__ __device__ inline int int8_stat_chunk_keys(int seqlen_k) {
    const int per = (seqlen_k + kInt8MaxStatChunks - 1) / kInt8MaxStatChunks;
    const int rounded = (per + 255) / 256 * 256;
    return rounded < 256 ? 256 : rounded;
}
__host__ __device__ inline int int8_stat_chunks(int seqlen_k) {
    const int c = int8_stat_chunk_keys(seqlen_k);
    return (seqlen_k + c - 1) / c;
}

struct FlashFwdInt8Params {
    // ---- the caller's tensors (as FlashFwdParams) ----
    // (batch, heads, seq, head_dim), last dim contiguous, other strides in elements (multiples of 8, 16-byte aligned
    // base pointers). q/o: num_heads heads; k/v: num_kv_heads heads (query head h reads KV head
    // h / (num_heads / num_kv_heads)).
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    void* __restrict__ o;
    float* __restrict__ lse;            // (batch, num_heads, seqlen_q) float32, contiguous; may be null
    const int* __restrict__ seqused_k;  // (batch,) int32 valid keys per batch, clamped to [0, seqlen_k]; null = all

    int64_t q_batch_stride, q_head_stride, q_row_stride;
    int64_t k_batch_stride, k_head_stride, k_row_stride;
    int64_t v_batch_stride, v_head_stride, v_row_stride;
    int64_t o_batch_stride, o_head_stride, o_row_stride;

    int batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim;  // head_dim 64 or 128
    float scale;       // softmax scale (1/sqrt(head_dim) by default)
    float scale_log2;  // scale * log2(e)
    bool causal;       // bottom-right aligned: row i sees key j iff j <= i + seqused_k - seqlen_q
    bool is_bf16;      // q, k, v, o are bf16 (else fp16)
    // P V in e4m3 (true; compute capability 8.9 only: flash_fwd_int8_fp8_pv_available) or in the input dtype.
    // Set it before sizing the workspace: it decides whether v_fp8/v_scale exist.
    bool fp8_pv;

    // ---- the workspace (the binding allocates; flash_fwd_int8_set_workspace carves one allocation) ----
    // seqlen_k_pad = int8_seqlen_k_pad(seqlen_k), n_chunks = int8_stat_chunks(seqlen_k). Nothing needs zeroing:
    // the pre-pass writes every element the kernel reads.
    int8_t* __restrict__ k_int8;    // (batch, num_kv_heads, seqlen_k_pad, head_dim) int8, (K - mean) / k_scale
    float* __restrict__ k_scale;    // (batch, num_kv_heads, seqlen_k_pad / kInt8KBlock) float32, amax / 127 (0: all 0)
    float* __restrict__ k_mean;     // (batch, num_kv_heads, head_dim) float32, K's channel mean over the valid keys
    uint8_t* __restrict__ v_fp8;    // fp8_pv: (batch, num_kv_heads, seqlen_k_pad / 128, head_dim, 128) e4m3:
                                    // V^T / v_scale tile-major (each 128-key tile one contiguous block), keys
                                    // permuted within each 16 (int8_v_key_of_position); null otherwise
    float* __restrict__ v_scale;    // fp8_pv: (batch, num_kv_heads, head_dim) float32, amax / 448; null otherwise
    float* __restrict__ stats;      // (batch * num_kv_heads, n_chunks, 2, head_dim) float32: per chunk of
                                    // int8_stat_chunk_keys(seqlen_k) keys, K's channel sums, then V's channel amax
                                    // (written with fp8_pv only)
};

// Byte offsets of the workspace's buffers in one allocation (each 256-byte aligned) and its total size. Needs the
// shapes, head_dim and fp8_pv of `p`.
struct FlashFwdInt8Workspace {
    size_t k_int8, k_scale, k_mean, v_fp8, v_scale, stats;  // offsets; v_fp8/v_scale meaningful only with fp8_pv
    size_t bytes;                                            // total
};
// Defined here, in the contract, for every host that sizes it: the extension's binding, and the NVRTC build's
// mirror (llm_attn/_plan.py int8_workspace, which tests/test_nvrtc.py checks against this function).
inline FlashFwdInt8Workspace flash_fwd_int8_workspace(const FlashFwdInt8Params& p) {
    const auto align256 = [](size_t n) { return (n + 255) / 256 * 256; };
    const size_t heads = static_cast<size_t>(p.batch) * p.num_kv_heads;
    const size_t pad = static_cast<size_t>(int8_seqlen_k_pad(p.seqlen_k));
    const size_t d = static_cast<size_t>(p.head_dim);
    FlashFwdInt8Workspace w{};
    size_t at = 0;
    w.k_int8 = at;
    at += align256(heads * pad * d);
    w.k_scale = at;
    at += align256(heads * (pad / kInt8KBlock) * sizeof(float));
    w.k_mean = at;
    at += align256(heads * d * sizeof(float));
    w.v_fp8 = at;
    if (p.fp8_pv) at += align256(heads * d * pad);
    w.v_scale = at;
    if (p.fp8_pv) at += align256(heads * d * sizeof(float));
    w.stats = at;
    at += align256(heads * static_cast<size_t>(int8_stat_chunks(p.seqlen_k)) * 2 * d * sizeof(float));
    w.bytes = at;
    return w;
}
inline size_t flash_fwd_int8_workspace_bytes(const FlashFwdInt8Params& p) { return flash_fwd_int8_workspace(p).bytes; }
// Points the workspace fields of `p` into `base` (device memory of flash_fwd_int8_workspace_bytes(p) bytes,
// 256-byte aligned, e.g. a torch uint8 tensor's data_ptr()). A caller may instead point each field at its own
// buffer of the size documented above.
inline void flash_fwd_int8_set_workspace(FlashFwdInt8Params& p, void* base) {
    const FlashFwdInt8Workspace w = flash_fwd_int8_workspace(p);
    unsigned char* b = static_cast<unsigned char*>(base);
    p.k_int8 = reinterpret_cast<int8_t*>(b + w.k_int8);
    p.k_scale = reinterpret_cast<float*>(b + w.k_scale);
    p.k_mean = reinterpret_cast<float*>(b + w.k_mean);
    p.v_fp8 = p.fp8_pv ? b + w.v_fp8 : nullptr;
    p.v_scale = p.fp8_pv ? reinterpret_cast<float*>(b + w.v_scale) : nullptr;
    p.stats = reinterpret_cast<float*>(b + w.stats);
}

// True when the current device runs P V in e4m3 natively: compute capability 8.9 (sm_90 has no native e4m3
// mma.sync: ptxas emulates it with f16 unpacks, so the fp8 configuration is not built for it). Cached per device.
bool flash_fwd_int8_fp8_pv_available();

// Launches the pre-pass (2 kernels) and the attention kernel on `stream`; never synchronises. Returns the first
// launch error; cudaErrorInvalidValue for a head_dim other than 64/128 or a missing workspace pointer;
// cudaErrorInvalidDeviceFunction when fp8_pv is set on a device other than compute capability 8.9.
cudaError_t run_flash_fwd_int8(FlashFwdInt8Params& params, cudaStream_t stream);

// Template entry points: the pre-pass per (dtype, head_dim) in flash_fwd_int8.cu, the attention kernel per
// (dtype, head_dim, causal) in kernels/flash_fwd_int8_hdim{D}_{dtype}_{causal}.cu.
template <typename T, int kHeadDim>
cudaError_t run_flash_fwd_int8_quant_(FlashFwdInt8Params& params, cudaStream_t stream);
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_int8_(FlashFwdInt8Params& params, cudaStream_t stream);

}  // namespace llm_attn

// Plain C++ interface of the FP8 attention forward (Hopper, sm_90a): a quantising pre-pass (quant_fp8.cuh) and the
// warp-specialised wgmma kernel on e4m3 operands (flash_fwd_fp8_sm90_kernel.cuh). No torch headers.
//
// What the call computes (llm_attn/quant_reference.py holds the same algorithm in PyTorch):
//   Q: e4m3 with one scale per (batch, head, query row) = amax / 448, or int8 with amax / 127 (Fp8Qk below).
//   K: smoothed by its per-channel mean over the valid keys (q . mean is the same for every key of a row, so no
//      softmax row changes), then e4m3 (or int8, as Q) with one scale per (batch, KV head, 64 keys): a 64-key column
//      group of the kernel's S tile (2 in a 128-key tile, 3 in a 192-key one), applied in its softmax; 32 keys
//      with P V in the input dtype (fp8_k_block).
//   V: e4m3 with one scale per (batch, KV head, channel) over the valid keys, stored transposed (head_dim rows of
//      keys: wgmma's fp8 B operand is K-major), keys permuted inside each group of 16 to match the registers that
//      hold P (flash_fwd_fp8_sm90_kernel.cuh); keys past the valid ones are zero.
//   S = (Q8 K8^T) * q_scale * k_scale in fp32 (int8: the exact integer product, then fp32); online softmax in fp32 (exact running max); P * 256 in e4m3;
//   O = (P8 V8^T) * v_scale / (256 * rowsum(P)), rowsum over the unquantised P. LSE as the bf16 kernel's, plus
//   scale * (q . mean(K)): smoothing shifted every score of the row by that.
#pragma once

#include <cstdint>

#include "flash.h"

namespace llm_attn {

// Workspace geometry: blocks of rows the scales cover.
constexpr int kFp8QBlock = 64;    // query rows per block of the Q pre-pass (each row has a scale of its own)
constexpr int kFp8KBlock = 64;    // keys per K scale (a column group of the kernel's 128- or 192-key S tile)
// With P V in the input dtype (llm_attn_int8qk, the accurate variant) K scales are finer: what is left of its error
// is int8 Q K^T's rounding (kernels/NOTES.md "per-row Q scales").
constexpr int kFp8KBlockPvInput = 32;
constexpr int fp8_k_block(bool pv_input) { return pv_input ? kFp8KBlockPvInput : kFp8KBlock; }
constexpr int kFp8KvChunk = 128;  // keys per block of the K/V pre-pass, and the padding of V^T's rows

struct FlashFwdFp8Params {
    FlashFwdParams p;  // the caller's q, k, v (fp16/bf16), o, lse, strides, shapes, seqused_k, scale, causal
    // Workspaces, allocated by the caller (the binding), contiguous:
    uint8_t* q8;         // (batch, num_heads, seqlen_q, head_dim) e4m3
    float* q_scale;      // (batch, num_heads, seqlen_q)
    uint8_t* k8;         // (batch, num_kv_heads, seqlen_k, head_dim) e4m3, mean-subtracted
    float* k_scale;      // (batch, num_kv_heads, ceil(seqlen_k / fp8_k_block(pv_input)))
    uint8_t* vt8;        // (batch, num_kv_heads, head_dim, seqlen_k_pad) e4m3, seqlen_k_pad = fp8_seqlen_k_pad; keys at
                         // or past the valid ones are zero
    float* v_scale;      // (batch, num_kv_heads, head_dim)
    float* stats;        // (2, batch, num_kv_heads, head_dim): K's channel sums, then V's channel amax (as float
                         // bits); ZERO before the launch
    float* q_dot_kmean;  // (batch, num_heads, seqlen_q): q . mean(K) per row, the smoothing's shift of every score of
                         // the row, added back to the row's lse
};

// V^T's keys per row: the 128-key chunks of the keys plus one more of zeros, so that every V^T box the kernel loads
// (128 keys at a multiple of 128; 64 keys at n 192 + {0, 64, 128} for the 192-key tile, whose last tile may start
// up to 191 keys before the end) lies inside the rows the pre-pass wrote, never past them (no TMA out-of-bounds fill).
__host__ __device__ inline int fp8_seqlen_k_pad(int seqlen_k) {
    return ((seqlen_k + kFp8KvChunk - 1) / kFp8KvChunk + 1) * kFp8KvChunk;
}

// The operands of P V: e4m3 P and V (the pre-pass's V^T, a scale per channel), or P in the input dtype times the
// caller's V, unquantised (kFp8PvInput: int8 Q K^T only; llm_attn_int8qk).
enum Fp8Pv : int { kFp8PvE4m3 = 0, kFp8PvInput = 1 };
// The widest key tile P V in the input dtype has (its bf16/fp16 P of 256 keys would not fit beside S and O).
constexpr int kFp8PvInputMaxBlockN = 192;
// The operands of S = Q K^T: e4m3, or int8 (Q and K scaled by amax / 127 instead of amax / 448; exact s32
// accumulation; the same tensor rate on sm_90). kFp8QkDefault resolves to LLM_ATTN_FP8_QK (int8 or e4m3) if set,
// else int8 (kernels/NOTES.md "FP8 forward v4" says why); V and P are e4m3 either way.
enum Fp8Qk : int { kFp8QkDefault = 0, kFp8QkE4m3 = 1, kFp8QkInt8 = 2 };
int flash_fwd_fp8_qk(int requested);  // kFp8QkE4m3 or kFp8QkInt8; 0 for a value that is neither
// The key tile (kBlockN: keys per S tile) a call with head_dim and `requested` runs: `requested` if this build has it
// (kernel_tiles.h Fp8Tiles<D>), else 0; requested 0 = LLM_ATTN_FP8_BLOCK_N if set, else the build's default for the
// S operands qk (Fp8Qk, resolved as flash_fwd_fp8_qk does: int8 with e4m3 P V has its own). P V in the input dtype:
// the tiles up to kFp8PvInputMaxBlockN (0 for a pv that is neither).
int flash_fwd_fp8_block_n(int head_dim, int requested, int pv = kFp8PvE4m3, int qk = kFp8QkDefault);
// Launches the pre-pass and the kernel on `stream` with the key tile flash_fwd_fp8_block_n(head_dim, block_n, pv, qk),
// the S operands flash_fwd_fp8_qk(qk) and the P V operands pv; never synchronises. With pv = kFp8PvInput, qk default
// means int8 (LLM_ATTN_FP8_QK does not apply) and e4m3 is refused. cudaErrorNotSupported when this build has no
// sm_90a code or the device is not compute capability 9.0, cudaErrorInvalidValue for a tile or an operand choice this
// build lacks (the binding checks them first and says so). kFp8PvInput needs no vt8 (nullptr) and leaves v_scale
// unwritten.
cudaError_t run_flash_fwd_fp8(FlashFwdFp8Params& params, cudaStream_t stream, int block_n = 0, int qk = kFp8QkDefault,
                              int pv = kFp8PvE4m3);
// True when the current device is compute capability 9.0 and this build holds the FP8 kernel's sm_90a code.
bool flash_fwd_fp8_available();

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_fp8_(FlashFwdFp8Params& params, cudaStream_t stream, int block_n, int qk, int pv);
template <typename T, int kHeadDim>
bool flash_fwd_fp8_built_();

}  // namespace llm_attn

// Host side of the FP8 forward (flash_fp8.h): the quantising pre-pass launches, the tensor maps of the e4m3
// workspaces and the kernel launch. Included by one instantiation file per (head_dim, dtype, causal).
#pragma once

#include "flash_fwd_fp8_sm90_kernel.cuh"
#include "kernel_tiles.h"  // Fp8Tiles<D>: the key tiles built
#include "launch_smem.h"
#include "quant_fp8.cuh"
#include "tma_host.h"  // tensor_map_encoder, tuning_env

namespace llm_attn {
namespace sm90 {

// A 4-D e4m3 map (inner, rows, heads, batch) of a contiguous byte tensor, boxes of box_inner x box_rows with the
// swizzle as wide as box_inner (64 or 128 bytes). Encoded per call: the workspaces are fresh allocations.
inline bool encode_fp8_map(TmaDesc* desc, const void* ptr, int inner, int rows, int heads, int batch, int box_inner,
                           int box_rows) {
    auto encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows),
                                static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
    const cuuint64_t strides[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(inner) * rows,
                                   static_cast<cuuint64_t>(inner) * rows * heads};
    const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUresult r = encode(reinterpret_cast<CUtensorMap*>(desc), CU_TENSOR_MAP_DATA_TYPE_UINT8, 4,
                              const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              box_inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

template <typename T, typename Traits, bool kCausal>
cudaError_t launch_fp8_tile(FlashFwdFp8Params& f, cudaStream_t stream) {
    constexpr int kHeadDim = Traits::kHeadDim;
    const FlashFwdParams& p = f.p;
    const int q_blocks = (p.seqlen_q + kFp8QBlock - 1) / kFp8QBlock;
    const int kv_chunks = fp8_seqlen_k_pad(p.seqlen_k) / kFp8KvChunk;  // every V^T key written, the padding too
    // Pre-pass: channel statistics of K and V, then Q, then K and V^T (each waits for the one before on the stream).
    // P V in the input dtype: K's statistics and K only; the kernel reads the caller's V.
    constexpr bool kV8 = !Traits::kPvInput;
    fp8::fp8_kv_stats_kernel<T, kHeadDim, kV8><<<dim3((p.seqlen_k + 511) / 512, p.num_kv_heads, p.batch),
                                                 fp8::kThreads, 0, stream>>>(f);
    fp8::fp8_quant_q_kernel<T, kHeadDim, Traits::kQkInt8><<<dim3(q_blocks, p.num_heads, p.batch), fp8::kThreads, 0, stream>>>(f);
    fp8::fp8_quant_kv_kernel<T, kHeadDim, Traits::kQkInt8, kV8><<<dim3(kv_chunks, p.num_kv_heads, p.batch), fp8::kThreads,
                                                                  0, stream>>>(f);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;

    static const int pingpong = tuning_env("LLM_ATTN_SM90_PINGPONG", 1);
    Fp8Sm90Params sp{};
    sp.f = f;
    sp.pingpong = pingpong;
    // V^T in boxes of kVtBoxKeys keys, each inside the padded rows (fp8_seqlen_k_pad); or the caller's V in the bf16
    // kernel's slabs (kPvInput).
    const int pad = fp8_seqlen_k_pad(p.seqlen_k);
    const bool ok =
        encode_fp8_map(&sp.tma_q, f.q8, kHeadDim, p.seqlen_q, p.num_heads, p.batch, kHeadDim, Traits::kBlockM) &&
        encode_fp8_map(&sp.tma_k, f.k8, kHeadDim, p.seqlen_k, p.num_kv_heads, p.batch, kHeadDim, Traits::kBlockN) &&
        (Traits::kPvInput
             ? make_tensor_map<T>(&sp.tma_v, p.v, kHeadDim, p.seqlen_k, p.num_kv_heads, p.batch, p.v_batch_stride,
                                  p.v_head_stride, p.v_row_stride, Traits::kBlockN)
             : encode_fp8_map(&sp.tma_vt, f.vt8, pad, kHeadDim, p.num_kv_heads, p.batch, Traits::kVtBoxKeys, kHeadDim));
    if (!ok) return cudaErrorInvalidValue;
    err = opt_in_dynamic_smem<flash_fwd_fp8_sm90_kernel<T, Traits, kCausal>, Traits::kSmemBytes>();
    if (err != cudaSuccess) return err;
    const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const dim3 grid = kCausal ? dim3(p.num_heads, m_blocks, p.batch) : dim3(m_blocks, p.num_heads, p.batch);
    flash_fwd_fp8_sm90_kernel<T, Traits, kCausal><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(sp);
    return cudaGetLastError();
}

// block_n: the key tile, resolved by flash_fwd_fp8_block_n (flash_fp8.cu): 128, 192 or 256 where Fp8Tiles<D> has it
// (256: e4m3 P V only).
// qk: the S operands, resolved by flash_fwd_fp8_qk: kFp8QkInt8 or kFp8QkE4m3.
// LLM_ATTN_FP8_STAGES=3: a third K/V stage for the 128-key tile (tuning A/B; two is the default, kernels/NOTES.md
// "FP8 forward"); the 192-key tile is built with two only.
template <typename T, int kHeadDim, bool kCausal, bool kQkInt8>
cudaError_t launch_fp8_qk(FlashFwdFp8Params& f, cudaStream_t stream, int block_n) {
    static const int stages = tuning_env("LLM_ATTN_FP8_STAGES", 2);
    if (block_n == 256) {
        if constexpr (Fp8Tiles<kHeadDim>::has(256)) {
            return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 256, kQkInt8>, kCausal>(f, stream);
        }
        return cudaErrorInvalidValue;
    }
    if (block_n == 192) {
        if constexpr (Fp8Tiles<kHeadDim>::has(192)) {
            return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 192, kQkInt8>, kCausal>(f, stream);
        }
        return cudaErrorInvalidValue;
    }
    if (block_n != 128) return cudaErrorInvalidValue;
    if constexpr (Fp8Tiles<kHeadDim>::has(128)) {
        if (stages == 3) return launch_fp8_tile<T, Fp8Traits<kHeadDim, 3, 128, kQkInt8>, kCausal>(f, stream);
        return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 128, kQkInt8>, kCausal>(f, stream);
    }
    return cudaErrorInvalidValue;
}
// pv: kFp8PvInput runs the int8 Q K^T kernel with P V in the input dtype, at the same key tile as the e4m3 P V
// (flash_fwd_fp8_block_n), two stages either way (kernels/NOTES.md "The accurate variant": 192 keys measured 4-7 %
// faster than 128 at 16k-32k on the H100).
template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch_fp8(FlashFwdFp8Params& f, cudaStream_t stream, int block_n, int qk, int pv) {
    if (pv == kFp8PvInput) {
        if (qk != kFp8QkInt8) return cudaErrorInvalidValue;
        if (block_n == 192) return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 192, true, true>, kCausal>(f, stream);
        if (block_n == 128) return launch_fp8_tile<T, Fp8Traits<kHeadDim, 2, 128, true, true>, kCausal>(f, stream);
        return cudaErrorInvalidValue;
    }
    if (pv != kFp8PvE4m3) return cudaErrorInvalidValue;
    if (qk == kFp8QkInt8) return launch_fp8_qk<T, kHeadDim, kCausal, true>(f, stream, block_n);
    if (qk == kFp8QkE4m3) return launch_fp8_qk<T, kHeadDim, kCausal, false>(f, stream, block_n);
    return cudaErrorInvalidValue;
}

template <typename T, int kHeadDim>
bool fp8_has_device_code() {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, flash_fwd_fp8_sm90_kernel<T, Fp8Traits<kHeadDim>, true>) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return attr.binaryVersion == 90 && attr.ptxVersion == 90;
}

}  // namespace sm90

template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_fp8_(FlashFwdFp8Params& params, cudaStream_t stream, int block_n, int qk, int pv) {
    return sm90::launch_fp8<T, kHeadDim, kCausal>(params, stream, block_n, qk, pv);
}
template <typename T, int kHeadDim>
bool flash_fwd_fp8_built_() {
    return sm90::fp8_has_device_code<T, kHeadDim>();
}

}  // namespace llm_attn

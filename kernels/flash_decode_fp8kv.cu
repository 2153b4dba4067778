// Runtime -> compile-time dispatch of the attention over the FP8 KV cache (flash_decode_fp8kv.h): the split-KV decode
// kernel for up to kDecodeMaxRows packed rows, the prefill kernel (flash_prefill_fp8kv_kernel.cuh; v2 where its
// blocks fill more than half the SMs, else v1; LLM_ATTN_FP8KV_PREFILL_V=1 or 2 forces one) above.
#include "flash_decode_fp8kv.h"
#include "flash_fwd_config.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>

namespace llm_attn {

int flash_prefill_fp8kv_version(const FlashDecodeFp8KvParams& p, int v2_rows, int num_sms) {
    const char* v = std::getenv("LLM_ATTN_FP8KV_PREFILL_V");
    if (v != nullptr && std::strcmp(v, "1") == 0) return 1;
    if (v != nullptr && std::strcmp(v, "2") == 0) return 2;
    const int rows = p.base.num_heads / p.base.num_kv_heads * p.base.seqlen_q;
    const int64_t blocks = static_cast<int64_t>((rows + v2_rows - 1) / v2_rows) * p.base.num_kv_heads * p.base.batch;
    return 2 * blocks > num_sms ? 2 : 1;
}

// The fp16 decode kernel's rule (flash_fwd_num_splits: about one block per SM; a forced count as it is), raised to
// about two blocks per SM where every split keeps at least 8 64-key tiles, and where a first split has 4096 keys to
// share. An e4m3 tile costs a block about half an fp16 tile's time, so the call's fixed part (pipeline fill, warp
// merge, count, combine) weighs twice as much and a second block per SM hides more of it: +2 to +7 % at B >= 4 and
// at B = 1 from 16k keys on the H100 (kernels/NOTES.md, "The FP8-cache decode: conflict-free merge, two blocks an
// SM"); 8 tiles a split keeps B = 1 at 2k-8k keys (32 splits: -7 %) and 4096 keys B = 16 at 2k (2 splits: -4 %) on
// the fp16 rule. The count is then cut to the splits that get a tile: the kernel gives each split ceil(tiles /
// splits) tiles, so 33 splits of 512 tiles (B = 1, 8 KV heads, 32k keys) left the 33rd empty, a block and a partial
// the combine still read; 32 run the same 16 tiles a block.
// Then, where that count is more than one batch of the combine's loads (kDecodeCombineBatch, 16 splits) and its
// splits are short (at most 16 tiles), and blocks of two warp groups fit the device, it is halved: one two-group
// block an SM streams as many tiles as two blocks, and the combine reads half the partials in one batch fewer. On
// the H200, B = 1, 8 KV heads: +3.5 % at 16k keys, +0.5-2 % at 32k; at 64k (32 tiles a split) -2 %; B = 2 at 16k
// (16 splits, one batch already) -2 % (kernels/NOTES.md, "Two warp groups a block").
static int decode_fp8kv_cut(int n_tiles, int count) {
    const int per_split = (n_tiles + count - 1) / count;
    return (n_tiles + per_split - 1) / per_split;
}

bool flash_decode_fp8kv_two_groups(const FlashDecodeFp8KvParams& p, int splits, int num_sms, int smem_per_block_optin) {
    const int rows = p.base.num_heads / p.base.num_kv_heads * p.base.seqlen_q;
    const int smem = p.base.head_dim == 64 ? DecodeFp8KvSmem<DecodeFp8KvConfig<64>::OneTileWG2>::kBytes
                                           : DecodeFp8KvSmem<DecodeFp8KvConfig<128>::OneTileWG2>::kBytes;
    return rows <= 16 && smem <= smem_per_block_optin &&
           static_cast<int64_t>(splits) * p.base.batch * p.base.num_kv_heads <= num_sms;
}

int flash_decode_fp8kv_num_splits(const FlashDecodeFp8KvParams& p, int num_sms, int smem_per_block_optin) {
    if (!use_decode_kernel(p.base)) return 1;
    const int splits = flash_fwd_num_splits(p.base, num_sms);
    if (flash_decode_forced_splits() > 0) return splits;
    const int n_tiles = (p.base.seqlen_k + 63) / 64;
    long two = 2L * num_sms / (static_cast<long>(p.base.batch) * p.base.num_kv_heads);
    two = two < n_tiles / 8 ? two : n_tiles / 8;
    two = two < 128 ? two : 128;
    if (two == 2 && p.base.seqlen_k < 4096) two = 1;
    const int count = two > splits ? static_cast<int>(two) : splits;
    if (count <= 1 || n_tiles < 1) return count;
    const int cut = decode_fp8kv_cut(n_tiles, count);
    if (cut > kDecodeCombineBatch && (n_tiles + cut - 1) / cut <= 16) {
        const int half = decode_fp8kv_cut(n_tiles, (cut + 1) / 2);
        if (flash_decode_fp8kv_two_groups(p, half, num_sms, smem_per_block_optin)) return half;
    }
    return cut;
}

cudaError_t run_flash_decode_fp8kv(FlashDecodeFp8KvParams& p, cudaStream_t stream) {
    if (!use_decode_kernel(p.base)) {  // a prefill over the cache: never split
        if (p.base.num_splits != 1) return cudaErrorInvalidValue;
        if (p.base.head_dim == 128) return p.base.is_bf16 ? run_flash_prefill_fp8kv_<__nv_bfloat16, 128>(p, stream)
                                                          : run_flash_prefill_fp8kv_<half, 128>(p, stream);
        if (p.base.head_dim == 64) return p.base.is_bf16 ? run_flash_prefill_fp8kv_<__nv_bfloat16, 64>(p, stream)
                                                         : run_flash_prefill_fp8kv_<half, 64>(p, stream);
        return cudaErrorInvalidValue;
    }
    if (p.base.head_dim == 128) return p.base.is_bf16 ? run_flash_decode_fp8kv_<__nv_bfloat16, 128>(p, stream)
                                                      : run_flash_decode_fp8kv_<half, 128>(p, stream);
    if (p.base.head_dim == 64) return p.base.is_bf16 ? run_flash_decode_fp8kv_<__nv_bfloat16, 64>(p, stream)
                                                     : run_flash_decode_fp8kv_<half, 64>(p, stream);
    return cudaErrorInvalidValue;
}

}  // namespace llm_attn

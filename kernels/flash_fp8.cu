// Runtime -> compile-time dispatch of the FP8 forward (flash_fp8.h).
#include "flash_fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>

#include "kernel_tiles.h"  // Fp8Tiles<D>
#include "tma_host.h"      // sm90::tuning_env

namespace llm_attn {

int cc_major_current_device();

bool flash_fwd_fp8_available() {
    constexpr int kMaxDevices = 64;
    static int cache[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
    if (cache[dev] == 0) {
        int major = 0, minor = -1;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        cache[dev] = major == 9 && minor == 0 && flash_fwd_fp8_built_<__nv_bfloat16, 128>() ? 2 : 1;
    }
    return cache[dev] == 2;
}

template <int kHeadDim>
int fp8_tile(int requested, int env, bool int8_e4m3) {
    const int def = int8_e4m3 ? Fp8Tiles<kHeadDim>::kDefaultBlockNInt8 : Fp8Tiles<kHeadDim>::kDefaultBlockN;
    const int n = requested ? requested : env ? env : def;
    return Fp8Tiles<kHeadDim>::has(n) ? n : 0;
}

// LLM_ATTN_FP8_BLOCK_N (read once): the tile of calls that ask for none (block_n 0), e.g. a whole TTFT run; a value
// this build lacks makes those calls fail in the binding, saying so. P V in the input dtype has the tiles up to
// kFp8PvInputMaxBlockN (a 256-key bf16 P does not fit the registers beside S and O): a request for a wider one gets
// 0, and so does the variable's process default fall back to the build's default for it. The default itself depends
// on the S operands: int8 Q K^T with e4m3 P V takes Fp8Tiles<D>::kDefaultBlockNInt8 (kernels/NOTES.md "H14").
int flash_fwd_fp8_block_n(int head_dim, int requested, int pv, int qk) {
    if (pv != kFp8PvE4m3 && pv != kFp8PvInput) return 0;
    static const int env = sm90::tuning_env("LLM_ATTN_FP8_BLOCK_N", 0);
    const bool input = pv == kFp8PvInput;
    if (input && requested > kFp8PvInputMaxBlockN) return 0;
    const int e = input && env > kFp8PvInputMaxBlockN ? 0 : env;
    const bool i8 = !input && flash_fwd_fp8_qk(qk) == kFp8QkInt8;
    return head_dim == 128 ? fp8_tile<128>(requested, e, i8) : head_dim == 64 ? fp8_tile<64>(requested, e, i8) : 0;
}

// LLM_ATTN_FP8_QK (read once): int8 or e4m3, the S operands of calls that ask for neither (qk 0); anything else
// leaves the default, int8.
int flash_fwd_fp8_qk(int requested) {
    static const int env = [] {
        const char* v = std::getenv("LLM_ATTN_FP8_QK");
        if (v != nullptr && std::strcmp(v, "e4m3") == 0) return static_cast<int>(kFp8QkE4m3);
        return static_cast<int>(kFp8QkInt8);
    }();
    if (requested == kFp8QkDefault) return env;
    return requested == kFp8QkE4m3 || requested == kFp8QkInt8 ? requested : 0;
}

cudaError_t run_flash_fwd_fp8(FlashFwdFp8Params& params, cudaStream_t stream, int block_n, int qk, int pv) {
    if (!flash_fwd_fp8_available()) return cudaErrorNotSupported;
    const FlashFwdParams& p = params.p;
    block_n = flash_fwd_fp8_block_n(p.head_dim, block_n, pv, qk);
    qk = pv == kFp8PvInput ? (qk == kFp8QkDefault || qk == kFp8QkInt8 ? kFp8QkInt8 : 0) : flash_fwd_fp8_qk(qk);
    if (block_n == 0 || qk == 0) return cudaErrorInvalidValue;
#define LLM_ATTN_FP8_CAUSAL(T, D)                                                   \
    return p.causal ? run_flash_fwd_fp8_<T, D, true>(params, stream, block_n, qk, pv) \
                    : run_flash_fwd_fp8_<T, D, false>(params, stream, block_n, qk, pv)
    if (p.is_bf16) {
        if (p.head_dim == 128) LLM_ATTN_FP8_CAUSAL(__nv_bfloat16, 128);
        if (p.head_dim == 64) LLM_ATTN_FP8_CAUSAL(__nv_bfloat16, 64);
    } else {
        if (p.head_dim == 128) LLM_ATTN_FP8_CAUSAL(half, 128);
        if (p.head_dim == 64) LLM_ATTN_FP8_CAUSAL(half, 64);
    }
#undef LLM_ATTN_FP8_CAUSAL
    return cudaErrorInvalidValue;
}

}  // namespace llm_attn

// The INT8 forward's host side: the pre-pass launches (flash_fwd_int8_quant.cuh, instantiated here
// per dtype and head_dim) and the runtime -> compile-time dispatch of run_flash_fwd_int8 (flash_int8.h).
#include "flash_int8.h"
#include "flash_fwd_int8_quant.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace llm_attn {

// Compute capability 8.9 (the fp8 configuration's only build, Int8FwdTraits::kMaxArch), per device: 0 = unknown,
// 1 = no, 2 = yes.
bool flash_fwd_int8_fp8_pv_available() {
    constexpr int kMaxDevices = 64;
    static int cache[kMaxDevices] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
    if (cache[dev] == 0) {
        int major = 0, minor = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
            return false;
        }
        cache[dev] = major == 8 && minor == 9 ? 2 : 1;
    }
    return cache[dev] == 2;
}

template <typename T, int kHeadDim>
cudaError_t run_flash_fwd_int8_quant_(FlashFwdInt8Params& p, cudaStream_t stream) {
    using namespace int8fwd;
    const int heads = p.batch * p.num_kv_heads;
    const dim3 stats_grid(int8_stat_chunks(p.seqlen_k), heads);
    const dim3 quant_grid(int8_seqlen_k_pad(p.seqlen_k) / kInt8BlockN, heads);
    if (p.fp8_pv) {
        int8_kv_stats_kernel<T, kHeadDim, true><<<stats_grid, kQuantThreads, 0, stream>>>(p);
        if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
        int8_quant_kv_kernel<T, kHeadDim, true><<<quant_grid, kQuantThreads, 0, stream>>>(p);
    } else {
        int8_kv_stats_kernel<T, kHeadDim, false><<<stats_grid, kQuantThreads, 0, stream>>>(p);
        if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
        int8_quant_kv_kernel<T, kHeadDim, false><<<quant_grid, kQuantThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
}

template cudaError_t run_flash_fwd_int8_quant_<half, 64>(FlashFwdInt8Params&, cudaStream_t);
template cudaError_t run_flash_fwd_int8_quant_<half, 128>(FlashFwdInt8Params&, cudaStream_t);
template cudaError_t run_flash_fwd_int8_quant_<__nv_bfloat16, 64>(FlashFwdInt8Params&, cudaStream_t);
template cudaError_t run_flash_fwd_int8_quant_<__nv_bfloat16, 128>(FlashFwdInt8Params&, cudaStream_t);

namespace {
// The pre-pass, then the attention kernel. No keys: no pre-pass (the kernel then writes 0 and lse -inf without
// reading the workspace).
template <typename T, int kHeadDim>
cudaError_t run_int8(FlashFwdInt8Params& p, cudaStream_t stream) {
    if (p.seqlen_k > 0) {
        if (const cudaError_t err = run_flash_fwd_int8_quant_<T, kHeadDim>(p, stream); err != cudaSuccess) return err;
    }
    return p.causal ? run_flash_fwd_int8_<T, kHeadDim, true>(p, stream)
                    : run_flash_fwd_int8_<T, kHeadDim, false>(p, stream);
}
}  // namespace

cudaError_t run_flash_fwd_int8(FlashFwdInt8Params& p, cudaStream_t stream) {
    if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorInvalidValue;
    if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return cudaErrorInvalidValue;
    if (!p.k_int8 || !p.k_scale || !p.k_mean || !p.stats || (p.fp8_pv && (!p.v_fp8 || !p.v_scale))) {
        return cudaErrorInvalidValue;
    }
    if (p.fp8_pv && !flash_fwd_int8_fp8_pv_available()) return cudaErrorInvalidDeviceFunction;
    if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) return cudaSuccess;  // nothing to write
    if (p.head_dim == 128) return p.is_bf16 ? run_int8<__nv_bfloat16, 128>(p, stream) : run_int8<half, 128>(p, stream);
    return p.is_bf16 ? run_int8<__nv_bfloat16, 64>(p, stream) : run_int8<half, 64>(p, stream);
}

}  // namespace llm_attn

// The dynamic shared memory opt-in of the launch templates (flash_*_launch.cuh), done once per kernel and device
// instead of on every launch. Host code, plain CUDA C++ (no torch); not part of what NVRTC compiles.
#pragma once

#include <atomic>
#include <cstdlib>

#include <cuda_runtime.h>

namespace llm_attn {

// LLM_ATTN_SMEM_CARVEOUT=<percent> (a measurement knob, read once; unset or out of 0..100: the driver's choice): the
// preferred shared-memory carveout of every kernel opted in below, so that a GPU with more shared memory per SM
// holds the blocks a smaller one would. 44 on an H100 (228 KB) leaves ~100 KB, an RTX 4060 Ti's (sm_89): one
// 68.5 KB backward block an SM instead of two (kernels/NOTES.md BP9). The NVRTC build reads it too (_nvrtc.py).
inline int smem_carveout_from_env() {
    static const int pct = [] {
        const char* v = std::getenv("LLM_ATTN_SMEM_CARVEOUT");
        const int p = v != nullptr && *v != '\0' ? std::atoi(v) : -1;
        return p >= 0 && p <= 100 ? p : -1;
    }();
    return pct;
}

// Lets kKernel be launched with kSmemBytes of dynamic shared memory on the current device. Above the default 48 KB
// that takes cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), host work that
// need not be repeated: the attribute lives in the device's context, so it is set once per (kernel, device) and
// remembered, as flash_fwd.cu caches device attributes (a device >= kMaxDevices: set on every launch, as before).
// No lock: two threads on a first launch may both set it (the same value, harmless). A failure is returned and not
// remembered, so the next launch tries again. Each launch template passes its kernel's one constant size.
// (A cudaDeviceReset would drop the attribute behind this cache's back; torch never resets a device.)
template <auto kKernel, int kSmemBytes>
cudaError_t opt_in_dynamic_smem() {
    if constexpr (kSmemBytes <= 48 * 1024) {
        return cudaSuccess;
    } else {
        constexpr int kMaxDevices = 64;
        static std::atomic<bool> done[kMaxDevices] = {};  // constant-initialized: no init guard, no lock
        int dev = -1;
        const bool cacheable = cudaGetDevice(&dev) == cudaSuccess && dev >= 0 && dev < kMaxDevices;
        if (cacheable && done[dev].load(std::memory_order_acquire)) return cudaSuccess;
        cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
        if (err == cudaSuccess && smem_carveout_from_env() >= 0)
            err = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, smem_carveout_from_env());
        if (err == cudaSuccess && cacheable) done[dev].store(true, std::memory_order_release);
        return err;
    }
}

}  // namespace llm_attn

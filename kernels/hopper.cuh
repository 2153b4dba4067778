// Hopper-only PTX (sm_90a): mbarriers, the bulk tensor copy engine (TMA), warpgroup MMA (wgmma) and register
// reallocation (setmaxnreg). Used by flash_fwd_sm90_kernel.cuh. Plain CUDA C++: no CUTLASS/CuTe, so the kernel
// reads as the algorithm and compiles with bare nvcc or NVRTC.
//
// Shared-memory tiles are [rows][64 elements] slabs (128 bytes a row) in the 128-byte swizzle that TMA writes and
// wgmma reads: the 16-byte chunk c of row r sits at chunk c ^ (r % 8). A head_dim-128 tile is two such slabs side
// by side in memory (columns 0-63, then 64-127). Every slab starts 1024-byte aligned (one 8-row swizzle atom), so
// the descriptors' base-offset field stays 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "ptx.cuh"

namespace llm_attn {
namespace sm90 {

// A CUtensorMap as the kernel sees it: 128 opaque bytes, built on the host by cuTensorMapEncodeTiled and passed in
// the kernel's __grid_constant__ parameters (the TMA unit reads it from parameter space). Declared here rather than
// taken from <cuda.h> so that the device code also compiles under NVRTC.
struct alignas(128) TmaDesc {
    uint64_t opaque[16];
};

// ---- mbarrier -------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes the initialised barriers visible to the async proxy (TMA) before anyone uses them.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::); }
// One arrival that also announces `bytes` of TMA traffic the current phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)));
}
// Blocks until the phase with this parity has completed. A fresh barrier is in phase 0, so waiting on parity 1
// returns at once: producers start their "slot is empty" waits with parity 1.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
        "r"(parity));
}

// ---- TMA ------------------------------------------------------------------------------------------------------
// Loads the box at coordinates (c0 = column, c1 = row, c2 = head, c3 = batch) of a 4-D tensor map into shared
// memory; completion is counted in bytes on `bar`. Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void tma_load_4d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(smem_u32(smem)),
        "l"(reinterpret_cast<uint64_t>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
        : "memory");
}
// Stores a shared-memory box to global memory; elements outside the tensor are not written (row tails).
__device__ __forceinline__ void tma_store_4d(const TmaDesc* desc, const void* smem, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
            reinterpret_cast<uint64_t>(desc)),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(smem))
        : "memory");
}
__device__ __forceinline__ void tma_store_commit_and_wait() {
    asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Adds a shared-memory box into global memory (float32 add, done by the copy engine at L2; elements outside the
// tensor are skipped). Completion as for tma_store_4d: bulk_commit, then bulk_wait_read before the box is rewritten.
__device__ __forceinline__ void tma_reduce_add_4d(const TmaDesc* desc, const void* smem, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
            reinterpret_cast<uint64_t>(desc)),
        "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(smem))
        : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N committed bulk groups of this thread still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Shared-memory accesses by address (smem_u32): explicit .shared, where a generic pointer would compile to a
// generic (LSU global-path) access.
__device__ __forceinline__ float2 lds_f2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ void sts_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void sts_f2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ void prefetch_tma_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
}
// Orders this thread's ordinary shared-memory writes before later async-proxy (TMA, wgmma) reads of them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- register reallocation (named barriers: ptx.cuh) ------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// ---- wgmma --------------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor for a 128-byte-swizzled operand (PTX ISA, "Matrix Descriptor Format"): start
// address, leading-dimension byte offset (LBO) and stride-dimension byte offset (SBO), all in 16-byte units.
//   K-major (Q and K for S = Q K^T: each row's 64 elements along the reduction dim are contiguous): SBO = 1024 B
//     between 8-row groups; LBO unused (one 16-element k-step never leaves a 128-byte row); a k-step advances
//     the start address by 32 bytes inside the swizzle atom.
//   MN-major (V for O += P V: rows are keys = the reduction dim, columns the head dim): SBO = 1024 B between
//     8-key groups, LBO = the distance from one 64-column slab to the next; a k-step of 16 keys advances 2048 B.
struct SmemDesc {
    uint32_t lo, hi;  // lo: start address and LBO; hi: SBO and the swizzle mode

    __device__ __forceinline__ static SmemDesc make(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
        return {((smem_u32(smem) & 0x3FFFF) >> 4) | (((lbo_bytes >> 4) & 0x3FFF) << 16),
                ((sbo_bytes >> 4) & 0x3FFF) | (1u << 30)};  // bits 62-63 = 1: 128-byte swizzle
    }
    // The descriptor of the operand `bytes` further on: a shared-memory address is < 2^18, so the 14-bit start
    // field never carries into LBO. With `bytes` a compile-time constant this is one add per wgmma.
    __device__ __forceinline__ SmemDesc operator+(uint32_t bytes) const { return {lo + (bytes >> 4), hi}; }
    __device__ __forceinline__ uint64_t u64() const { return (static_cast<uint64_t>(hi) << 32) | lo; }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// wgmma_wait<N> that ptxas cannot schedule before `a` and `b` exist. A plain wait has no operands, and ptxas (CUDA 13)
// hoists it to the top of its basic block, above independent ALU work: the wait for P V of tile j-1 moved above tile
// j's whole softmax, so a consumer sat out its own P V before starting the exp2s (kernels/NOTES.md, H8). The first
// wait is predicated on a test of a and b that holds for every value, NaN included (equ: equal or unordered), so it
// depends on them; the second, plain, keeps ptxas's view that every accumulator read follows a wait (alone, the
// predicated one makes it serialise the wgmmas, C7514) and stays behind the first.
template <int N>
__device__ __forceinline__ void wgmma_wait_after(float a, float b) {
    asm volatile(
        "{\n .reg .pred p;\n setp.equ.f32 p, %0, %0;\n setp.equ.and.f32 p, %1, %1, p;\n"
        " @p wgmma.wait_group.sync.aligned %2;\n}\n" ::"f"(a), "f"(b), "n"(N) : "memory");
    wgmma_wait<N>();
}
// Keeps the compiler from moving accumulator reads/writes across an asynchronous wgmma (the registers are in use by
// the tensor cores until wgmma_wait).
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma.mma_async m64nNk16 with f32 accumulators, one asm operand per accumulator register (the instruction names
// each one). Operand lists written out by a generator; one macro per shape N, expanded for bf16 and fp16.
template <typename T, int N>
struct Wgmma;

#define LLM_ATTN_WGMMA_N64(T, TY) \
template <> \
struct Wgmma<T, 64> { \
    /* D (64x64, f32) = A (64x16, smem) * B (16x64, smem) [+ D]; B MN-major (transposed) when kTransB, A when \
       kTransA (the backward's dQ = dS K reads dS from its key-major dS^T tile). */ \
    template <int kTransB, int kTransA = 0> \
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %36, %35;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB), "n"(kTransA)); \
    } \
    /* D (64x64, f32) = A (64x16, registers: the mma.m16n8k16 A fragment of each warp's 16 rows) * B (smem) [+ D]. */ \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB)); \
    } \
};
LLM_ATTN_WGMMA_N64(__nv_bfloat16, "bf16")
LLM_ATTN_WGMMA_N64(half, "f16")
#undef LLM_ATTN_WGMMA_N64

#define LLM_ATTN_WGMMA_N128(T, TY) \
template <> \
struct Wgmma<T, 128> { \
    /* D (64x128, f32) = A (64x16, smem) * B (16x128, smem) [+ D]; B MN-major (transposed) when kTransB. */ \
    template <int kTransB> \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %67;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB)); \
    } \
    /* D (64x128, f32) = A (64x16, registers: the mma.m16n8k16 A fragment of each warp's 16 rows) * B (smem) [+ D]. */ \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB)); \
    } \
};
LLM_ATTN_WGMMA_N128(__nv_bfloat16, "bf16")
LLM_ATTN_WGMMA_N128(half, "f16")
#undef LLM_ATTN_WGMMA_N128

#define LLM_ATTN_WGMMA_N176(T, TY) \
template <> \
struct Wgmma<T, 176> { \
    /* D (64x176, f32) = A (64x16, smem) * B (16x176, smem) [+ D]; B MN-major (transposed) when kTransB. */ \
    template <int kTransB> \
    static __device__ __forceinline__ void ss(float (&d)[88], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n176k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, %91;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]) \
            : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB)); \
    } \
    /* D (64x176, f32) = A (64x16, registers: the mma.m16n8k16 A fragment of each warp's 16 rows) * B (smem) [+ D]. */ \
    template <int kTransB> \
    static __device__ __forceinline__ void rs(float (&d)[88], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) { \
        asm volatile( \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %93, 0;\n" \
            "wgmma.mma_async.sync.aligned.m64n176k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, {%88, %89, %90, %91}, %92, p, 1, 1, %94;\n}\n" \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]) \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB)); \
    } \
};
LLM_ATTN_WGMMA_N176(__nv_bfloat16, "bf16")
LLM_ATTN_WGMMA_N176(half, "f16")
#undef LLM_ATTN_WGMMA_N176

}  // namespace sm90
}  // namespace llm_attn

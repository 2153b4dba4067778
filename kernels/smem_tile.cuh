// Shared-memory tiles: the XOR swizzle of [rows][head_dim] tiles of 2-byte elements, this lane's swizzled ldmatrix
// columns (SwzCols, LdsmAddr) and the cp.async tile copy. Used by every mma.sync kernel (forward, decode, backward).
#pragma once

#include "ptx.cuh"

namespace llm_attn {

// Element offset of (row, 16-byte chunk) in a swizzled [rows][kHeadDim] tile. XOR with row % 8 spreads the 8 rows
// an ldmatrix phase reads (same logical chunk) over 8 different bank groups: conflict-free without padding.
template <int kHeadDim>
__device__ __forceinline__ int swz(int row, int chunk) {
    return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Per-thread ldmatrix column offsets for a fragment loop over k-steps kk (two 16-byte chunks each), for rows whose
// (row & 7) is this lane's (lane & 7) — every ldmatrix address pattern here. The swizzled chunk
// (2 kk + cbit) ^ (lane & 7) equals 2 (kk & ~3) + [2 ((kk & 3) ^ ((lane & 7) >> 1)) + (cbit ^ (lane & 1))]: only 4
// values depend on the lane (shared by every pattern: `off`), plus the pattern's (cbit ^ (lane & 1)) * 8; the rest
// is a compile-time immediate. Precomputing them keeps ptxas from hoisting a separate address per unrolled
// (kk, tile) into registers across the main loop (kernels/NOTES.md v4).
struct SwzCols {
    int off[4];
    __device__ __forceinline__ explicit SwzCols(int lane) {
        const int s = (lane & 7) >> 1;
#pragma unroll
        for (int j = 0; j < 4; ++j) off[j] = (j ^ s) * 16;
    }
    // Element offset within a row of k-step kk (a compile-time constant in unrolled loops); `cbit8` is
    // (cbit ^ (lane & 1)) * 8 for the caller's fragment pattern.
    __device__ __forceinline__ int operator()(int kk, int cbit8) const { return (kk & ~3) * 16 + off[kk & 3] + cbit8; }
};

// Async copy of a [kRows][kHeadDim] tile; rows >= valid_rows are zero-filled (so masked keys multiply zeros).
// Thread tid copies chunk (tid % kChunks) of rows tid / kChunks + i * kRowStep: the swizzle term is the same for
// all of its rows and the source pointer advances by a constant, so no per-row 64-bit offsets stay live in
// registers across the main loop.
template <typename Traits, int kRows, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride, int valid_rows, int tid) {
    constexpr int kChunks = Traits::kChunks;
    constexpr int kRowStep = Traits::kThreads / kChunks;
    constexpr int kIters = kRows / kRowStep;
    static_assert(kRowStep % 8 == 0, "row step must keep row % 8 (the swizzle phase) fixed");
    const int row = tid / kChunks;
    const int chunk = tid % kChunks;
    const T* src = gmem + row * row_stride + chunk * 8;
    T* dst = smem + swz<Traits::kHeadDim>(row, chunk);
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
        const bool ok = row + it * kRowStep < valid_rows;
        cp_async_16(dst + it * kRowStep * Traits::kHeadDim, ok ? src : gmem, ok);
        src += kRowStep * row_stride;
    }
}

// Element offset of (key row, 16-byte query chunk) in the backward's dS^T tile, rows of kW = 32 or 64 queries. As
// swz: the 8 rows an ldmatrix phase reads (or a C-fragment store writes) land in 8 different 16-byte bank groups.
template <int kW>
__device__ __forceinline__ int swz_ds(int row, int chunk) {
    return row * kW + ((chunk ^ (kW == 64 ? (row & 7) : ((row >> 1) & 3))) << 3);
}

// This lane's ldmatrix byte addresses for one fragment pattern over [rows][kRowLen] swizzled tiles: one register per
// (k-step & 3), the only lane-dependent part of the swizzled column (SwzCols). Everything else (which buffer, the
// k-step's multiple of 4, 16-row steps) is a compile-time immediate in unrolled loops that ptxas folds into the
// ldmatrix address, so the four patterns of the backward cost 16 registers rather than one per (buffer, k-step,
// row step): 64-bit generic pointers per site ran the kernel into 255 registers and spills.
template <int kRowLen>
struct LdsmAddr {
    uint32_t base[4];
    __device__ __forceinline__ LdsmAddr(uint32_t smem, int row, const SwzCols& cols, int cbit8) {
#pragma unroll
        for (int j = 0; j < 4; ++j) base[j] = smem + 2 * (row * kRowLen + cols(j, cbit8));
    }
    // Byte address of k-step kk (16 columns) at element offset `elem` (buffer offset + row offset).
    __device__ __forceinline__ uint32_t operator()(int kk, int elem) const {
        return base[kk & 3] + 2 * ((kk & ~3) * 16 + elem);
    }
};

}  // namespace llm_attn

// mma.sync m16n8k16 fragment helpers (layouts in ptx.cuh): the C accumulators of one product re-packed as the A
// operand of the next (P V in the forward, P^T dO and dS^T Q in the backward), and "acc += A * B" over the n-tiles
// of a B operand that the caller loads (ldmatrix, usually .trans) per pair of n-tiles.
#pragma once

#include "ptx.cuh"

namespace llm_attn {

// The P tile's n-tiles (2kk, 2kk + 1) of C fragments are exactly the A fragment of k-step kk of P V.
template <typename T, int kMT, int kNT>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[kMT][4], const float (&acc_s)[kMT][kNT][4], int kk) {
#pragma unroll
    for (int m = 0; m < kMT; ++m) {
        a[m][0] = pack2<T>(acc_s[m][2 * kk][0], acc_s[m][2 * kk][1]);
        a[m][1] = pack2<T>(acc_s[m][2 * kk][2], acc_s[m][2 * kk][3]);
        a[m][2] = pack2<T>(acc_s[m][2 * kk + 1][0], acc_s[m][2 * kk + 1][1]);
        a[m][3] = pack2<T>(acc_s[m][2 * kk + 1][2], acc_s[m][2 * kk + 1][3]);
    }
}

// acc[m][0 .. kDT) += A[m] * B for every m-tile m: A the C fragments `c` re-packed at k-step kk (p_fragment), B the
// 16 x (8 kDT) operand whose n-tiles (2 dp, 2 dp + 1) load_b(b, dp) puts into b[0..1] and b[2..3]. Each B fragment
// is loaded once and feeds every m-tile.
template <typename T, int kMT, int kNT, int kDT, typename LoadB>
__device__ __forceinline__ void mma_c_as_a(float (&acc)[kMT][kDT][4], const float (&c)[kMT][kNT][4], int kk,
                                           LoadB&& load_b) {
    uint32_t a[kMT][4];
    p_fragment<T>(a, c, kk);
#pragma unroll
    for (int dp = 0; dp < kDT / 2; ++dp) {
        uint32_t b[4];
        load_b(b, dp);
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
            mma_16816<T>(acc[m][2 * dp], a[m], b[0], b[1]);
            mma_16816<T>(acc[m][2 * dp + 1], a[m], b[2], b[3]);
        }
    }
}

// One m-tile's [kN][4] accumulators viewed as [1][kN][4], for the helpers above (same registers, no copy).
template <int kN>
__device__ __forceinline__ float (&one_mtile(float (&acc)[kN][4]))[1][kN][4] {
    return *reinterpret_cast<float(*)[1][kN][4]>(&acc);
}
template <int kN>
__device__ __forceinline__ const float (&one_mtile(const float (&acc)[kN][4]))[1][kN][4] {
    return *reinterpret_cast<const float(*)[1][kN][4]>(&acc);
}

}  // namespace llm_attn

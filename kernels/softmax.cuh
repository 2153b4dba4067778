// The online softmax of the mma.sync and wgmma forward kernels: quad reductions over the 4 lanes that share a C
// fragment row, and SoftmaxState (running max and sum in base 2, O accumulators, lazy rescaling).
#pragma once

// INFINITY: from cuda_runtime.h under nvcc, -DINFINITY under NVRTC (llm_attn/_nvrtc.py).

namespace llm_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Online-softmax state of one thread: its two rows (g, g + 8) of each of kMT m16 tiles, the running max in the
// base-2 scaled domain, the running (per-thread partial) sum, and the O accumulators of kDT n-tiles per tile.
// kRescaleLog2_: how far a row's max may grow before O is rescaled (below); 0 keeps the exact running max, so P <= 1
// (the FP8 kernel, whose e4m3 P needs a known range). kPOffsetLog2: P is computed as 2^offset exp2(s - max) (the
// FP8 kernel's 256 P; the row sum then holds the same factor, and the lse must subtract it).
template <int kMT, int kDT, int kRescaleLog2_ = 8, int kPOffsetLog2 = 0>
struct SoftmaxState {
    float row_max[kMT][2];
    float row_sum[kMT][2];
    float acc_o[kMT][kDT][4];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
            row_max[m][0] = row_max[m][1] = -INFINITY;
            row_sum[m][0] = row_sum[m][1] = 0.f;
#pragma unroll
            for (int i = 0; i < kDT; ++i) acc_o[m][i][0] = acc_o[m][i][1] = acc_o[m][i][2] = acc_o[m][i][3] = 0.f;
        }
    }

    // Folds a tile of scores S (kNT n-tiles of C fragments, masked entries -inf) into the state and replaces S in
    // place by P = exp2(S * scale - max). Lazy rescaling: the running max of the warp's rows moves only when some
    // row's tile max exceeds it by more than kRescaleLog2 (a warp-uniform vote). Otherwise the stale max stays,
    // P stays below 2^kRescaleLog2 (exact in fp32 sums, no overflow in fp16/bf16) and the O accumulators skip the
    // multiply by alpha — which otherwise sits on the critical path between S = QK^T and O += PV. The lse and the
    // final 1/sum use the same max the P values were computed with, so the result is the same softmax.
    static constexpr float kRescaleLog2 = static_cast<float>(kRescaleLog2_);

    template <int kNT>
    __device__ __forceinline__ void update(float (&acc_s)[kMT][kNT][4], float scale_log2) {
        float alpha[kMT][2];
        if (update_scores(acc_s, scale_log2, alpha)) rescale_o(alpha);
    }

    // The first half of update(): the scores become P and the row statistics move; returns whether O must be
    // multiplied by alpha (rescale_o). Split so that a caller can do it while O is still being accumulated by an
    // asynchronous P V of the previous tile (the Hopper kernel), and rescale once that has finished.
    template <int kNT>
    __device__ __forceinline__ bool update_scores(float (&acc_s)[kMT][kNT][4], float scale_log2,
                                                  float (&alpha)[kMT][2]) {
        float tile_max[kMT][2];
        bool grow = false;
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(acc_s[m][nt][2 * r], acc_s[m][nt][2 * r + 1]));
                tile_max[m][r] = quad_max(mx) * scale_log2;
                // -inf > -inf is false: rows that saw only masked keys never ask for a rescale.
                grow |= tile_max[m][r] > row_max[m][r] + kRescaleLog2;
            }
        }
        const bool rescale = __any_sync(0xffffffff, grow);
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float new_max = rescale ? fmaxf(row_max[m][r], tile_max[m][r]) : row_max[m][r];
                // A row that has seen only masked keys keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
                const float mm = new_max == -INFINITY ? 0.f : new_max;
                alpha[m][r] = exp2f(row_max[m][r] - mm);
                const float shift = static_cast<float>(kPOffsetLog2) - mm;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    acc_s[m][nt][2 * r] = exp2f(fmaf(acc_s[m][nt][2 * r], scale_log2, shift));
                    acc_s[m][nt][2 * r + 1] = exp2f(fmaf(acc_s[m][nt][2 * r + 1], scale_log2, shift));
                    sum += acc_s[m][nt][2 * r] + acc_s[m][nt][2 * r + 1];
                }
                row_sum[m][r] = row_sum[m][r] * alpha[m][r] + sum;  // per-thread partial; quad-reduced at the end
                row_max[m][r] = new_max;
            }
        }
        return rescale;
    }

    __device__ __forceinline__ void rescale_o(const float (&alpha)[kMT][2]) {
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                acc_o[m][dt][0] *= alpha[m][0];
                acc_o[m][dt][1] *= alpha[m][0];
                acc_o[m][dt][2] *= alpha[m][1];
                acc_o[m][dt][3] *= alpha[m][1];
            }
    }
};

}  // namespace llm_attn

// Score masking: -inf on keys past the end of the sequence and, causal, above the diagonal (row i sees keys
// j <= i + causal_offset), for both layouts of the S accumulators: rows = queries (the portable and the Hopper
// forward) and rows = keys (the backward's S^T). The decode kernel masks by its own packed-row limit.
#pragma once

// INFINITY: from cuda_runtime.h under nvcc, -DINFINITY under NVRTC (llm_attn/_nvrtc.py).

namespace llm_attn {

// S[m][nt] C fragments, rows = queries: m16 tile m of this warp starts at query row0 + 16 m, n-tile nt covers keys
// key0 + 8 nt ... (PTX C layout: g = lane / 4 picks rows g and g + 8, t = lane % 4 columns 2t, 2t + 1).
template <bool kCausal, int kMT, int kNT>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kMT][kNT][4], int key0, int row0, int seqlen_k,
                                            int causal_offset, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + nt * 8 + 2 * t + (e & 1);
                const int row = row0 + m * 16 + g + (e >= 2 ? 8 : 0);
                if (key >= seqlen_k || (kCausal && key > row + causal_offset)) acc_s[m][nt][e] = -INFINITY;
            }
}

// S^T[nt] C fragments, rows = keys: this thread's keys are key_row (its C row g) and key_row + 8, n-tile nt covers
// queries query0 + 8 nt ... (the backward's 16 keys per warp x kBlockM queries).
template <bool kCausal, int kNT>
__device__ __forceinline__ void mask_scores_t(float (&acc_s)[kNT][4], int key_row, int query0, int seqlen_k,
                                              int causal_offset, int t) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key_row + (e >= 2 ? 8 : 0);
            const int query = query0 + nt * 8 + 2 * t + (e & 1);
            if (key >= seqlen_k || (kCausal && key > query + causal_offset)) acc_s[nt][e] = -INFINITY;
        }
}

}  // namespace llm_attn

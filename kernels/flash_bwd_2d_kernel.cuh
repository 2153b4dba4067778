// The portable backward's dK/dV kernel with two-dimensional warp tiles (FlashBwdParams::layout2d; issue 39 item 2).
//
// Why: flash_bwd_dkdv_kernel gives each warp 16 keys and all of a step's queries, so P^T and dS^T stay in its
// registers, but every warp loads the step's whole Q and dO tiles twice with ldmatrix for 16 keys: ~0.7 ldmatrix.x4
// per mma, and ncu reads it as bound by those loads (kernels/NOTES.md "Backward v3": shared-memory wavefronts at
// 70 % of peak, short-scoreboard stalls). Here each product has its own warp layout, as FlashAttention-2's
// backward does, and P and dS go through shared memory once:
//   step (64 query rows of one head, the block's 128 keys), 8 warps:
//   1. S = Q K^T and dP = dO V^T, warps 2 (queries) x 4 (keys), 32 x 32 each; P = exp2(S scale log2e - lse),
//      dS = P (dP - dsum), both stored to shared memory ([query][key], swizzled as the [rows][128] tiles).
//   2. dV += P^T dO and dK += dS^T Q, warps 4 (keys) x 2 (head_dim halves), 32 keys x head_dim / 2 each, the
//      accumulators live across the steps; dQ = dS K, warps 4 (queries) x 2 (head_dim halves), 16 rows each, added
//      into the float32 dQ buffer with atomics (as the other kernel).
// ~0.48 ldmatrix.x4 per mma plus 32 four-byte stores a warp a step, and half the barriers per query row (64 rows a
// step instead of 32 at head_dim 128).
// Everything around the main loop is the other kernel's: BwdBlock (the block's steps, GQA, splits, causal start),
// the lse / dsum conventions of the preprocessing, the dQ buffer and its conversion, the split epilogues' float32
// accumulators (deterministic: one slab per split) and the dS-only path when dQ has its own kernel (dq_separate).
#pragma once

#include "flash_bwd_kernel.cuh"

namespace llm_attn {

template <int kHeadDim_>
struct Bwd2dTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kThreads = 256;
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kSmemQ = kBlockM * kHeadDim;  // Q and dO tiles
    static constexpr int kSmemK = kBlockN * kHeadDim;  // K and V tiles
    static constexpr int kSmemP = kBlockM * kBlockN;   // P and dS tiles [query][key]
    // K, V; two stages of (Q, dO); P, dS; two stages of (lse, dsum): 161 KB at head_dim 128 (sm_80/87/90 give a block
    // 163-227 KB), 97 KB at 64 (within sm_86/89's 99 KB).
    static constexpr int kSmemBytes = (2 * kSmemK + 4 * kSmemQ + 2 * kSmemP) * 2 + 4 * kBlockM * 4;
    static constexpr int kDW = kHeadDim / 16;  // n8 tiles of a dK / dV / dQ warp tile (head_dim / 2 columns)
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim must be 64 or 128");
    static_assert((kBlockM * kChunks) % kThreads == 0 && (kBlockN * kChunks) % kThreads == 0, "tile copies divide");
};

// threadIdx.x read anew (volatile: ptxas neither hoists nor shares it), for indices that are cheaper recomputed than
// kept in a register across the main loop.
__device__ __forceinline__ uint32_t fresh_tid() {
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}

template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_dkdv_2d_kernel(const FlashBwdParams params) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kDW = Traits::kDW;
    constexpr int kKD = kHeadDim / 16;  // k-steps over head_dim (S, dP)
    constexpr int kKM = kBlockM / 16;   // k-steps over queries (dV, dK)
    constexpr int kKN = kBlockN / 16;   // k-steps over keys (dQ)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + Traits::kSmemK;
    T* sQ = sV + Traits::kSmemK;         // stage s: Q at sQ + 2 s kSmemQ, dO right after it
    T* sP = sQ + 4 * Traits::kSmemQ;     // [kBlockM][kBlockN], swz<kBlockN>
    T* sdS = sP + Traits::kSmemP;        // same layout
    float* sLse = reinterpret_cast<float*>(sdS + Traits::kSmemP);  // [2 stages][kBlockM]
    float* sDsum = sLse + 2 * kBlockM;                              // [2 stages][kBlockM]

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    int g = lane / 4;
    int t = lane % 4;
    // Warp tiles: S / dP rows 32 wm, keys 32 wn; dK / dV keys 32 wk, columns (head_dim / 2) wd; dQ rows 16 wk.
    const int wm = warp / 4, wn = warp % 4;
    int wk = warp / 2, wd = warp % 2;

    const BwdBlock b = BwdBlock::make<kBlockM, kBlockN, kCausal>(params);
    const int n0 = b.n0, kv_head = b.kv_head, batch = b.batch;
    const int seqlen_q = params.seqlen_q, seqlen_k = b.seqlen_k, causal_offset = b.causal_offset;
    const int it_begin = b.it_begin, it_end = b.it_end;
    if (params.num_splits > 1 && it_begin >= it_end) return;

    float acc_dk[2][kDW][4], acc_dv[2][kDW][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < kDW; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[m][i][e] = acc_dv[m][i][e] = 0.f;

    if (it_begin < it_end) {
        load_kv_block<T, Traits>(params, b, sK, sV, tid);
        // The steps in BwdBlock::Step order (query blocks down, heads inner): `cur` this step.
        BwdBlock::Step cur = b.step(it_begin);
        load_q_step<T, Traits>(params, batch, b.head(cur), cur.mb * kBlockM, sQ, sLse, sDsum, tid);
        cp_async_commit();

        // Element offsets from sK; Q / dO are stage 0's (stage 1 adds kStageBytes at run time).
        constexpr int kOffK = 0, kOffV = Traits::kSmemK, kOffQ = 2 * Traits::kSmemK;
        constexpr int kOffdO = kOffQ + Traits::kSmemQ, kOffP = kOffQ + 4 * Traits::kSmemQ;
        constexpr int kOffdS = kOffP + Traits::kSmemP;
        constexpr uint32_t kStageBytes = 4 * Traits::kSmemQ;
        const uint32_t smem = smem_u32(sK);
        const SwzCols cols(lane);
        const int b_row = (lane % 8) + (lane / 16) * 8;
        const int cbit_a = ((lane / 16) ^ (lane & 1)) * 8;
        const int cbit_b = (((lane / 8) % 2) ^ (lane & 1)) * 8;
        // 1. A = Q / dO rows of this warp's queries; B = K / V rows of its keys (both along head_dim).
        const LdsmAddr<kHeadDim> addr_a(smem, wm * 32 + lane % 16, cols, cbit_a);
        const LdsmAddr<kHeadDim> addr_b(smem, wn * 32 + b_row, cols, cbit_b);
        // 2. dV / dK: A = P^T / dS^T, read transposed from the [query][key] tiles: lane rows b_row + 16 kk (queries),
        //    chunk 2 (2 wk + m) + (lane / 8) % 2 (keys), m the warp's two 16-key m-tiles.
        uint32_t addr_pt[2];
#pragma unroll
        for (int m = 0; m < 2; ++m)
            addr_pt[m] = smem + 2 * (kOffP + swz<kBlockN>(b_row, 2 * (2 * wk + m) + (lane / 8) % 2));
        //    B = dO / Q (dV / dK) and K (dQ) transposed: rows (lane % 8) + 8 ((lane / 8) % 2) + 16 kk along the
        //    reduction, chunk 2 dp + lane / 16 of this warp's head_dim half, dp < kDW / 2.
        uint32_t addr_t[kDW / 2];
#pragma unroll
        for (int dp = 0; dp < kDW / 2; ++dp)
            addr_t[dp] = smem + 2 * swz<kHeadDim>((lane % 8) + ((lane / 8) % 2) * 8, wd * (kDW / 2) * 2 + 2 * dp + lane / 16);
        //    dQ: A = dS rows of this warp's 16 queries (16 wk), along the keys: at head_dim 128 addr_a's pattern (rows
        //    of 128, row & 7 == lane & 7) moved by a warp-uniform offset, which costs no registers of its own.
        const LdsmAddr<kBlockN> addr_ds = [&] {
            if constexpr (kHeadDim == kBlockN) {
                LdsmAddr<kBlockN> a = addr_a;
                const uint32_t shift = 2 * (kOffdS + (wk * 16 - wm * 32) * kBlockN);
#pragma unroll
                for (int j = 0; j < 4; ++j) a.base[j] += shift;
                return a;
            } else {
                return LdsmAddr<kBlockN>(smem + 2 * kOffdS, wk * 16 + lane % 16, cols, cbit_a);
            }
        }();

        const float scale_log2 = params.scale_log2;
        for (int it = it_begin; it < it_end; ++it) {
            const int head = b.head(cur);
            const int m0 = cur.mb * kBlockM;
            const int stage = (it - it_begin) & 1;
            const uint32_t so = stage * kStageBytes;
            const float* cLse = sLse + stage * kBlockM;
            const float* cDsum = sDsum + stage * kBlockM;
            cp_async_wait<0>();
            // This step's Q, dO, lse, dsum (and K, V on the first) visible to all warps; every warp is done with the
            // previous step (its P, dS and the other stage's Q, dO).
            __syncthreads();

            // 1. S = Q K^T and dP = dO V^T (32 queries x 32 keys each), two independent chains of mma in one loop
            //    over head_dim (in groups of four k-steps, the LdsmAddr bases). The three product loops are
            //    unrolled: 994 instructions a step against 1130 rolled, 1-5 % faster, no spills on any arch since
            //    BP3/BP4 (kernels/NOTES.md BP6; BP1 rolled them when they spilled).
            float acc_s[2][4][4], acc_dp[2][4][4];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_s[m][i][e] = acc_dp[m][i][e] = 0.f;
#pragma unroll
            for (int kh = 0; kh < kKD / 4; ++kh)
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                uint32_t a[2][4], bm[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) ldsm_x4(a[m], addr_a.base[u] + 2 * (kh * 64 + kOffQ + m * 16 * kHeadDim) + so);
#pragma unroll
                for (int np = 0; np < 2; ++np) ldsm_x4(bm[np], addr_b.base[u] + 2 * (kh * 64 + kOffK + np * 16 * kHeadDim));
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int np = 0; np < 2; ++np) {
                        mma_16816<T>(acc_s[m][2 * np], a[m], bm[np][0], bm[np][1]);
                        mma_16816<T>(acc_s[m][2 * np + 1], a[m], bm[np][2], bm[np][3]);
                    }
#pragma unroll
                for (int m = 0; m < 2; ++m) ldsm_x4(a[m], addr_a.base[u] + 2 * (kh * 64 + kOffdO + m * 16 * kHeadDim) + so);
#pragma unroll
                for (int np = 0; np < 2; ++np) ldsm_x4(bm[np], addr_b.base[u] + 2 * (kh * 64 + kOffV + np * 16 * kHeadDim));
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int np = 0; np < 2; ++np) {
                        mma_16816<T>(acc_dp[m][2 * np], a[m], bm[np][0], bm[np][1]);
                        mma_16816<T>(acc_dp[m][2 * np + 1], a[m], bm[np][2], bm[np][3]);
                    }
            }
            // Keys past the end and (causal) after a query's diagonal: P = 0, in a pass of its own that only the
            // steps which need it run (folded into the exp2 loop, its selects ran at every step: BP3). Query rows
            // past the end need no mask (their dO and dsum are zero).
            const int key0 = n0 + wn * 32;
            if (key0 + 32 > seqlen_k || (kCausal && key0 + 31 > m0 + wm * 32 + causal_offset)) {
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        // This thread's column 8 nt + c (key key0 + 2 t + 8 nt + c) is visible iff 8 nt + c < lim.
                        const int row = wm * 32 + m * 16 + g + 8 * r;
                        const int lim = (kCausal ? min(seqlen_k, m0 + row + causal_offset + 1) : seqlen_k) - key0 - 2 * t;
#pragma unroll
                        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                            for (int c = 0; c < 2; ++c)
                                if (nt * 8 + c >= lim) acc_s[m][nt][2 * r + c] = -INFINITY;
                    }
            }
            // P = exp2(S scale log2e - lse), dS = P (dP - dsum): both to shared memory in the input dtype.
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = wm * 32 + m * 16 + g + 8 * r;  // in the step
                    const float lse = cLse[row], dsum = cDsum[row];
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) {
                        float p[2], ds[2];
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            p[c] = exp2f(fmaf(acc_s[m][nt][2 * r + c], scale_log2, -lse));
                            ds[c] = p[c] * (acc_dp[m][nt][2 * r + c] - dsum);
                        }
                        const int off = swz<kBlockN>(row, wn * 4 + nt) + 2 * t;
                        *reinterpret_cast<uint32_t*>(sP + off) = pack2<T>(p[0], p[1]);
                        *reinterpret_cast<uint32_t*>(sdS + off) = pack2<T>(ds[0], ds[1]);
                    }
                }
            __syncthreads();  // P and dS complete
            // The next step's Q, dO, lse, dsum into the other stage (free since this step's first barrier), issued
            // here rather than under the S / dP products, where the registers are short.
            b.next(cur);
            if (it + 1 < it_end)
                load_q_step<T, Traits>(params, batch, b.head(cur), cur.mb * kBlockM, sQ + (stage ^ 1) * 2 * Traits::kSmemQ,
                                       sLse + (stage ^ 1) * kBlockM, sDsum + (stage ^ 1) * kBlockM, tid);
            cp_async_commit();

            // 2. dV += P^T dO, dK += dS^T Q: this warp's 32 keys x head_dim / 2.
#pragma unroll
            for (int kk = 0; kk < kKM; ++kk) {
                uint32_t ap[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) ldsm_x4_t(ap[m], addr_pt[m] + 2 * (kk * 16 * kBlockN));
#pragma unroll
                for (int dp = 0; dp < kDW / 2; ++dp) {
                    uint32_t bd[4];
                    ldsm_x4_t(bd, addr_t[dp] + 2 * (kOffdO + kk * 16 * kHeadDim) + so);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        mma_16816<T>(acc_dv[m][2 * dp], ap[m], bd[0], bd[1]);
                        mma_16816<T>(acc_dv[m][2 * dp + 1], ap[m], bd[2], bd[3]);
                    }
                }
#pragma unroll
                for (int m = 0; m < 2; ++m) ldsm_x4_t(ap[m], addr_pt[m] + 2 * (Traits::kSmemP + kk * 16 * kBlockN));
#pragma unroll
                for (int dp = 0; dp < kDW / 2; ++dp) {
                    uint32_t bq[4];
                    ldsm_x4_t(bq, addr_t[dp] + 2 * (kOffQ + kk * 16 * kHeadDim) + so);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        mma_16816<T>(acc_dk[m][2 * dp], ap[m], bq[0], bq[1]);
                        mma_16816<T>(acc_dk[m][2 * dp + 1], ap[m], bq[2], bq[3]);
                    }
                }
            }
            if (params.dq_separate) continue;

            // dQ[m0 + 16 wk .. + 16, this warp's head_dim half] += dS K. The thread's row and column come from %tid.x
            // again (as in the epilogue below): kept live across the step, they cost head_dim 128's causal kernel a
            // 4-byte spill on sm_80.
            const auto dq_adder = [&] {
                const uint32_t tq = fresh_tid();
                const int q_row = m0 + (tq / 64) * 16 + (tq % 32) / 4;
                float* row = params.dq_accum +
                             ((static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + q_row) * kHeadDim;
                return DqFragAdder<kHeadDim>(row + ((tq / 32) % 2) * (kHeadDim / 2) + 2 * (tq % 4), q_row < seqlen_q,
                                             q_row + 8 < seqlen_q);
            };
            if constexpr (kHeadDim == 128) {
                // In two column parts (BP7): the first part's 8 reds go out under the second part's mma instead of
                // 16 in one burst at the end of the step, which filled the global-memory queue (ncu: 5.5 % of the
                // samples on lg_throttle, all on the last reds of the burst). The dS fragments of all key k-steps
                // are held across the parts (loaded once, as before). +3-6 % (kernels/NOTES.md "BP7").
                constexpr int kDP = kDW / 2;  // n8 tiles a part
                uint32_t a_ds[kKN][4];
#pragma unroll
                for (int kk = 0; kk < kKN; ++kk) ldsm_x4(a_ds[kk], addr_ds.base[kk % 4] + 2 * ((kk / 4) * 64));
                const DqFragAdder<kHeadDim> dq = dq_adder();
#pragma unroll
                for (int part = 0; part < 2; ++part) {
                    float acc_dq[kDP][4];
#pragma unroll
                    for (int kk = 0; kk < kKN; ++kk)
#pragma unroll
                        for (int dp = 0; dp < kDP / 2; ++dp) {
                            uint32_t bk[4];
                            ldsm_x4_t(bk, addr_t[part * (kDP / 2) + dp] + 2 * (kOffK + kk * 16 * kHeadDim));
                            if (kk == 0) {
#pragma unroll
                                for (int e = 0; e < 4; ++e) acc_dq[2 * dp][e] = acc_dq[2 * dp + 1][e] = 0.f;
                            }
                            mma_16816<T>(acc_dq[2 * dp], a_ds[kk], bk[0], bk[1]);
                            mma_16816<T>(acc_dq[2 * dp + 1], a_ds[kk], bk[2], bk[3]);
                        }
#pragma unroll
                    for (int i = 0; i < kDP; ++i) dq.add((part * kDP + i) * 8, acc_dq[i]);
                }
            } else {
                // head_dim 64: one part (two accumulator chains a part would be too few), as BP6; holding every
                // dS fragment measured 1 % slower there.
                float acc_dq[kDW][4];
#pragma unroll
                for (int i = 0; i < kDW; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;
                // Key k-steps in groups of four (addr_ds's four swizzle bases).
#pragma unroll
                for (int kh = 0; kh < kKN / 4; ++kh) {
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int kk = 4 * kh + u;
                        uint32_t a[4];
                        ldsm_x4(a, addr_ds.base[u] + 2 * (kh * 64));
#pragma unroll
                        for (int dp = 0; dp < kDW / 2; ++dp) {
                            uint32_t bk[4];
                            ldsm_x4_t(bk, addr_t[dp] + 2 * (kOffK + kk * 16 * kHeadDim));
                            mma_16816<T>(acc_dq[2 * dp], a, bk[0], bk[1]);
                            mma_16816<T>(acc_dq[2 * dp + 1], a, bk[2], bk[3]);
                        }
                    }
                }
                const DqFragAdder<kHeadDim> dq = dq_adder();
#pragma unroll
                for (int i = 0; i < kDW; ++i) dq.add(i * 8, acc_dq[i]);
            }
        }
    }

    // This thread's dK / dV elements: key n0 + 32 wk + 16 m + g + 8 r, columns (head_dim / 2) wd + 8 i + 2 t, + 1.
    // The thread's indices are read again (volatile, so not kept from the prologue): kept live across the main loop
    // they cost head_dim 128's causal kernel a 4-byte spill on sm_80.
    {
        const uint32_t tid_now = fresh_tid();
        const int lane_now = tid_now % 32;
        g = lane_now / 4, t = lane_now % 4, wk = tid_now / 64, wd = (tid_now / 32) % 2;
    }
    const float scale = params.scale;
    if (params.num_splits > 1) {
        const int split = blockIdx.z % params.num_splits;
        const int64_t slab = params.deterministic
                                 ? split * static_cast<int64_t>(params.batch) * params.num_kv_heads * params.seqlen_k * kHeadDim
                                 : 0;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = n0 + wk * 32 + m * 16 + g + 8 * r;
                if (row >= seqlen_k) continue;
                const int64_t off = slab +
                    ((static_cast<int64_t>(batch) * params.num_kv_heads + kv_head) * params.seqlen_k + row) * kHeadDim +
                    wd * (kHeadDim / 2) + 2 * t;
#pragma unroll
                for (int i = 0; i < kDW; ++i) {
                    const float k0 = acc_dk[m][i][2 * r] * scale, k1 = acc_dk[m][i][2 * r + 1] * scale;
                    const float v0 = acc_dv[m][i][2 * r], v1 = acc_dv[m][i][2 * r + 1];
                    if (params.deterministic) {
                        *reinterpret_cast<float2*>(params.dk_accum + off + i * 8) = make_float2(k0, k1);
                        *reinterpret_cast<float2*>(params.dv_accum + off + i * 8) = make_float2(v0, v1);
                    } else {
                        atomic_add2(params.dk_accum + off + i * 8, k0, k1);
                        atomic_add2(params.dv_accum + off + i * 8, v0, v1);
                    }
                }
            }
        return;
    }

    // Epilogue: dK (times the softmax scale) and dV through shared memory (the K and V tiles) for 16-byte stores.
    __syncthreads();
    T* sdV = sV;
    T* sdK = sK;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = wk * 32 + m * 16 + g + 8 * r;
#pragma unroll
            for (int i = 0; i < kDW; ++i) {
                const int off = swz<kHeadDim>(row, wd * kDW + i) + 2 * t;
                *reinterpret_cast<uint32_t*>(sdV + off) = pack2<T>(acc_dv[m][i][2 * r], acc_dv[m][i][2 * r + 1]);
                *reinterpret_cast<uint32_t*>(sdK + off) =
                    pack2<T>(acc_dk[m][i][2 * r] * scale, acc_dk[m][i][2 * r + 1] * scale);
            }
        }
    __syncthreads();
    store_dkdv_block<T, Traits>(params, b, sdK, sdV, tid);
}

}  // namespace llm_attn

// FlashAttention-2 backward kernels (mma.sync tensor cores, sm_80 .. sm_90).
//
// Three launches per call:
//   1. flash_bwd_preprocess_kernel: per query row, dsum = rowsum(dO * O) - dlse (fp32) and lse in base 2, with
//      +inf for rows that saw no key so that their P = exp2(S - lse) is exactly 0.
//   2. flash_bwd_dkdv_kernel: one block per (KV head, kBlockN-key block, batch). The block keeps K and V in shared memory
//      and dK, dV accumulators in registers, and walks every query block of every query head of its KV head's group
//      (query blocks from the last down, the group's heads inner: BwdBlock::Step; GQA/MQA: dK/dV are summed over the
//      group inside the block, deterministic, K/V never expanded). Per query
//      block it recomputes S^T = K Q^T and dP^T = V dO^T (each warp owns 16 keys, so the softmax columns it needs
//      come from the saved lse, no cross-warp reduction), P^T = exp2(S^T - lse), dS^T = P^T (dP^T - dsum), then
//      dV += P^T dO and dK += dS^T Q from registers (the S accumulators re-packed as A fragments, as in the forward),
//      writes dS^T to shared memory and adds its share of dQ = dS K into a float32 buffer with atomics (each warp 16
//      query rows).
//   3. flash_bwd_convert_dq_kernel: dq = scale * dq_accum in the input dtype, with dq's strides.
// Small or unbalanced grids (few key blocks; causal, where the first key blocks see every query) split each key
// block's steps over several thread blocks, which add float32 partial dK/dV with atomics; then
// flash_bwd_convert_dkdv_kernel writes dk/dv (FlashBwdParams::num_splits).
//
// Register budget (the seed's failure was spills): per thread dK and dV accumulators (head_dim / 2 floats each) plus
// the S^T and dP^T tiles of 16 keys x kBlockM queries (kBlockM / 2 floats each); at head_dim 64 also the warp's K
// and V fragments, 32 registers (BwdTraits::kKvInRegs). kernels/NOTES.md "Backward" and "BP11" have the numbers
// ptxas reports.
#pragma once

#include "flash.h"
#include "mask.cuh"
#include "mma_frag.cuh"
#include "ptx.cuh"
#include "smem_tile.cuh"  // swz, swz_ds, SwzCols, LdsmAddr, load_tile_async
#include "softmax.cuh"    // kLog2e

namespace llm_attn {

// kBlockM query rows per step of the inner loop; kBlockN keys per block (16 per warp).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kSplitDp_>
struct BwdTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kSmemQ = kBlockM * kHeadDim;   // Q and dO tiles
    static constexpr int kSmemK = kBlockN * kHeadDim;   // K and V tiles
    static constexpr int kSmemDS = kBlockN * kBlockM;   // dS^T tile [key][query]
    // K, V; two stages of (Q, dO) so that step j + 1 loads during step j; dS^T; two stages of (lse, dsum).
    static constexpr int kSmemBytes = bwd_smem_bytes(kHeadDim, kBlockM, kBlockN);
    static_assert(kSmemBytes == (4 * kSmemQ + 2 * kSmemK + kSmemDS) * 2 + 4 * kBlockM * 4, "the layout below");
    // dP^T is computed in this many slices of the queries (register pressure: 2 for head_dim 128).
    static constexpr int kSplitDp = kSplitDp_;
    // Head_dim 64: the warp's K and V rows (its A operands of S^T = K Q^T and dP^T = V dO^T, 4 k-steps each) are loaded
    // from shared memory once per block and held in 32 registers across the query steps, as FlashAttention-2's
    // sm_86/89 tile holds V (kernels/NOTES.md "BP11"). Head_dim 128 has no registers for them (8 k-steps each).
    static constexpr bool kKvInRegs = kHeadDim_ == 64;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim must be 64 or 128");
    // dQ step: kBlockM / 16 m-tiles of dS K, each shared by kWarpsPerMT warps that split head_dim.
    static constexpr int kMTilesDQ = kBlockM / 16;
    static constexpr int kWarpsPerMT = kNWarps / kMTilesDQ;
    static constexpr int kColsDQ = kHeadDim / kWarpsPerMT;  // dQ columns per warp

    static_assert(kBlockN == 16 * kNWarps, "each warp owns 16 keys");
    static_assert(kBlockM == 32 || kBlockM == 64, "the dS^T tile's swizzle handles rows of 4 or 8 chunks");
    static_assert(kNWarps % kMTilesDQ == 0 && (kColsDQ == 32 || kColsDQ % 64 == 0),
                  "dQ: warps split m-tiles, then 32-column or 64-column groups");
    static_assert((kBlockM * kChunks) % kThreads == 0 && (kBlockN * kChunks) % kThreads == 0, "tile copies divide");
    static_assert(kHeadDim % 32 == 0, "dQ is produced 32 columns at a time");
    static_assert((kBlockM / 8) % (2 * kSplitDp) == 0, "each dP slice is whole k-steps of 16 queries");
};

// ---- 1. preprocessing ------------------------------------------------------------------------------------------
// kChunks threads per row, 16 bytes of O and dO each.
template <typename T, int kHeadDim>
__global__ void flash_bwd_preprocess_kernel(const FlashBwdParams params) {
    constexpr int kChunks = kHeadDim / 8;
    const int64_t row_id = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kChunks) + threadIdx.x / kChunks;
    const int chunk = threadIdx.x % kChunks;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;
    // Every lane of a row group takes part in the shuffles: out-of-range rows compute 0 and store nothing.
    const bool valid = row_id < rows;
    const int64_t r = valid ? row_id : 0;
    const int row = r % params.seqlen_q;
    const int head = (r / params.seqlen_q) % params.num_heads;
    const int batch = r / (static_cast<int64_t>(params.seqlen_q) * params.num_heads);
    const T* o = reinterpret_cast<const T*>(params.o) + batch * params.o_batch_stride + head * params.o_head_stride +
                 static_cast<int64_t>(row) * params.o_row_stride + chunk * 8;
    const T* d = reinterpret_cast<const T*>(params.dout) + batch * params.do_batch_stride +
                 head * params.do_head_stride + static_cast<int64_t>(row) * params.do_row_stride + chunk * 8;
    float acc = 0.f;
    if (valid) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o);
        const uint4 dv = *reinterpret_cast<const uint4*>(d);
        const uint32_t* op = reinterpret_cast<const uint32_t*>(&ov);
        const uint32_t* dp = reinterpret_cast<const uint32_t*>(&dv);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 a = unpack2<T>(op[i]);
            const float2 b = unpack2<T>(dp[i]);
            acc = fmaf(a.x, b.x, fmaf(a.y, b.y, acc));
        }
    }
#pragma unroll
    for (int off = kChunks / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (valid && chunk == 0) {
        const float lse = params.lse[row_id];
        params.dsum[row_id] = acc - (params.dlse != nullptr ? params.dlse[row_id] : 0.f);
        params.lse_log2[row_id] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    }
}

// ---- 3. dQ conversion ------------------------------------------------------------------------------------------
template <typename T, int kHeadDim>
__global__ void flash_bwd_convert_dq_kernel(const FlashBwdParams params) {
    constexpr int kChunks = kHeadDim / 8;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_heads * params.seqlen_q;
    if (idx >= rows * kChunks) return;
    const int64_t row_id = idx / kChunks;
    const int chunk = idx % kChunks;
    const int row = row_id % params.seqlen_q;
    const int head = (row_id / params.seqlen_q) % params.num_heads;
    const int batch = row_id / (static_cast<int64_t>(params.seqlen_q) * params.num_heads);
    const float4* src = reinterpret_cast<const float4*>(params.dq_accum + row_id * kHeadDim + chunk * 8);
    const float4 a = src[0], b = src[1];
    const float s = params.scale;
    uint4 out;
    out.x = pack2<T>(a.x * s, a.y * s);
    out.y = pack2<T>(a.z * s, a.w * s);
    out.z = pack2<T>(b.x * s, b.y * s);
    out.w = pack2<T>(b.z * s, b.w * s);
    T* dq = reinterpret_cast<T*>(params.dq) + batch * params.dq_batch_stride + head * params.dq_head_stride +
            static_cast<int64_t>(row) * params.dq_row_stride + chunk * 8;
    *reinterpret_cast<uint4*>(dq) = out;
}

// dk, dv from the float32 accumulators of a split launch (dK already carries the softmax scale): one buffer each,
// or, deterministic, num_splits slabs each, summed in split order.
template <typename T, int kHeadDim>
__global__ void flash_bwd_convert_dkdv_kernel(const FlashBwdParams params) {
    constexpr int kChunks = kHeadDim / 8;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t rows = static_cast<int64_t>(params.batch) * params.num_kv_heads * params.seqlen_k;
    if (idx >= rows * kChunks) return;
    const int64_t row_id = idx / kChunks;
    const int chunk = idx % kChunks;
    const int row = row_id % params.seqlen_k;
    const int head = (row_id / params.seqlen_k) % params.num_kv_heads;
    const int batch = row_id / (static_cast<int64_t>(params.seqlen_k) * params.num_kv_heads);
    const int slabs = params.deterministic ? params.num_splits : 1;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const float* acc = (which == 0 ? params.dk_accum : params.dv_accum) + row_id * kHeadDim + chunk * 8;
        float4 a = reinterpret_cast<const float4*>(acc)[0], b = reinterpret_cast<const float4*>(acc)[1];
        for (int s = 1; s < slabs; ++s) {
            const float4* x = reinterpret_cast<const float4*>(acc + s * rows * kHeadDim);
            const float4 xa = x[0], xb = x[1];
            a.x += xa.x, a.y += xa.y, a.z += xa.z, a.w += xa.w;
            b.x += xb.x, b.y += xb.y, b.z += xb.z, b.w += xb.w;
        }
        uint4 out;
        out.x = pack2<T>(a.x, a.y);
        out.y = pack2<T>(a.z, a.w);
        out.z = pack2<T>(b.x, b.y);
        out.w = pack2<T>(b.z, b.w);
        T* dst = which == 0
                     ? reinterpret_cast<T*>(params.dk) + batch * params.dk_batch_stride + head * params.dk_head_stride +
                           static_cast<int64_t>(row) * params.dk_row_stride
                     : reinterpret_cast<T*>(params.dv) + batch * params.dv_batch_stride + head * params.dv_head_stride +
                           static_cast<int64_t>(row) * params.dv_row_stride;
        *reinterpret_cast<uint4*>(dst + chunk * 8) = out;
    }
}

// Adds two adjacent floats of a C fragment into the float32 dQ buffer (one vector atomic on sm_90).
__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(x, y));
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

// dQ accumulator += n8 C fragments of one m16 tile: rows q_row (c[0], c[1]) and q_row + 8 (c[2], c[3]), columns
// 2t, 2t + 1 of each fragment. `p` points at (q_row, column 2t) of a float32 buffer with kHeadDim columns; ok0 / ok8:
// whether the rows exist. Each fragment is two predicated reductions straight from its accumulator registers (one
// 8-byte vector red each on sm_90, two 4-byte ones before), at constant offsets from one address (issue 39, BP4).
// - On sm_90 predicated PTX, not `if`: there ptxas rebuilt the 64-bit address inside each fragment's branch (BP3;
//   with the address fixed here, the portable kernel's `if` still costs 8 more instructions a step than the PTX).
// - No lane exchange for one 16-byte red a lane: its shuffles and selects waited on the last dQ products, and ncu
//   put ~15 % of the two-dimensional kernel's stall samples there (BP4).
template <int kHeadDim>
struct DqFragAdder {
    float* p;
    bool ok0, ok8;
    __device__ __forceinline__ DqFragAdder(float* row, bool ok0_, bool ok8_) : p(row), ok0(ok0_), ok8(ok8_) {}
    // Fragment `c` of column offset `col` (a multiple of 8, known at compile time after unrolling).
    __device__ __forceinline__ void add(int col, const float (&c)[4]) const {
        red2(p + col, c[0], c[1], ok0);
        red2(p + col + 8 * kHeadDim, c[2], c[3], ok8);
    }
    __device__ __forceinline__ static void red2(float* q, float x, float y, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %3, 0;\n@q red.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(q),
                     "f"(x), "f"(y), "r"(static_cast<int>(ok))
                     : "memory");
#else  // the same two reds in PTX cost 18-48 more instructions a step on sm_80 (a branch each); here one per pair
        if (ok) {
            atomicAdd(q, x);
            atomicAdd(q + 1, y);
        }
#endif
    }
};

// A split launch's epilogue for one key row: this thread's dK (times the softmax scale) and dV of C rows 2r, 2r + 1
// (key `row`), added into the float32 accumulators that flash_bwd_convert_dkdv_kernel converts. Keys from
// `kv_len` (seqused_k) on add nothing: their accumulators stay 0.
template <int kDT>
__device__ __forceinline__ void add_dkdv_split(const FlashBwdParams& params, int batch, int kv_head, int row,
                                               int kv_len, const float (&dk)[kDT][4], const float (&dv)[kDT][4], int r,
                                               int t) {
    if (row >= kv_len) return;
    const int64_t off =
        ((static_cast<int64_t>(batch) * params.num_kv_heads + kv_head) * params.seqlen_k + row) * (kDT * 8) + 2 * t;
    const float scale = params.scale;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
        atomic_add2(params.dk_accum + off + dt * 8, dk[dt][2 * r] * scale, dk[dt][2 * r + 1] * scale);
        atomic_add2(params.dv_accum + off + dt * 8, dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
}

// add_dkdv_split without atomics (FlashBwdParams::deterministic): into split `split`'s own slab of the accumulators,
// which no other block writes; the conversion sums the slabs in split order.
template <int kDT>
__device__ __forceinline__ void store_dkdv_split(const FlashBwdParams& params, int split, int batch, int kv_head,
                                                 int row, int kv_len, const float (&dk)[kDT][4],
                                                 const float (&dv)[kDT][4], int r, int t) {
    if (row >= kv_len) return;
    const int64_t slab = static_cast<int64_t>(params.batch) * params.num_kv_heads * params.seqlen_k * (kDT * 8);
    const int64_t off = split * slab +
        ((static_cast<int64_t>(batch) * params.num_kv_heads + kv_head) * params.seqlen_k + row) * (kDT * 8) + 2 * t;
    const float scale = params.scale;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
        *reinterpret_cast<float2*>(params.dk_accum + off + dt * 8) =
            make_float2(dk[dt][2 * r] * scale, dk[dt][2 * r + 1] * scale);
        *reinterpret_cast<float2*>(params.dv_accum + off + dt * 8) = make_float2(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
}

// One dK/dV thread block's work (both backward kernels): key block n_block of (batch, kv_head), and its steps
// [it_begin, it_end) out of group x per_head (query head, query block) pairs, from m_block_min on.
struct BwdBlock {
    int n0, kv_head, batch, group, seqlen_k, causal_offset, m_block_min, per_head, it_begin, it_end;

    template <int kBlockM, int kBlockN, bool kCausal>
    __device__ __forceinline__ static BwdBlock make(const FlashBwdParams& params) {
        BwdBlock b;
        // Causal: heads in x and key blocks in y, so that the longest blocks (the first keys, seen by every later
        // query) launch first across heads.
        const int n_block = kCausal ? blockIdx.y : blockIdx.x;
        b.kv_head = kCausal ? blockIdx.x : blockIdx.y;
        b.batch = blockIdx.z / params.num_splits;
        const int split = blockIdx.z % params.num_splits;
        b.group = params.num_heads / params.num_kv_heads;
        b.seqlen_k = params.seqused_k ? min(params.seqused_k[b.batch], params.seqlen_k) : params.seqlen_k;
        b.causal_offset = b.seqlen_k - params.seqlen_q;  // query i sees key j iff j <= i + causal_offset
        b.n0 = n_block * kBlockN;
        // Query blocks that see some key of this block: all, or (causal) from the first row i >= n0 - causal_offset.
        const int num_m = (params.seqlen_q + kBlockM - 1) / kBlockM;
        b.m_block_min = kCausal ? max(b.n0 - b.causal_offset, 0) / kBlockM : 0;
        b.per_head = num_m - b.m_block_min;
        const int n_iters = (b.n0 < b.seqlen_k && b.per_head > 0) ? b.group * b.per_head : 0;
        // This block's steps (query head, query block) of its key block: all, or one split's share.
        b.it_begin = split * params.iters_per_split;
        b.it_end = min(n_iters, b.it_begin + params.iters_per_split);
        return b;
    }

    // The portable kernels' order of the steps (issue 39, BP3): query blocks from the last down to m_block_min, the
    // group's query heads inner. Every block of one KV head then works on the same dQ rows (query head, query block)
    // at the same time, causal or not, as FlashAttention-2's backward walks them, so their dQ atomics meet in L2.
    // (Query blocks up, heads outer, made causal blocks drift apart: each key block's first step is its own diagonal
    // and its head takes per_head steps, so their dQ rows spread over the heads; ncu read a 64 % L2 hit rate at
    // 8k causal against 97 % non-causal.) step(it) divides once; next() walks on without dividing.
    struct Step {
        int h, mb;  // query head within the group, query block
    };
    __device__ __forceinline__ Step step(int it) const { return {it % group, m_block_min + per_head - 1 - it / group}; }
    __device__ __forceinline__ void next(Step& s) const {
        if (++s.h == group) s.h = 0, --s.mb;
    }
    __device__ __forceinline__ int head(const Step& s) const { return kv_head * group + s.h; }
};

// K and V rows [n0, n0 + kBlockN) of the block's (batch, KV head) into sK and sV with cp.async; rows past the end
// zero-filled.
template <typename T, typename Traits>
__device__ __forceinline__ void load_kv_block(const FlashBwdParams& params, const BwdBlock& b, T* sK, T* sV, int tid) {
    const T* k_ptr = reinterpret_cast<const T*>(params.k) + b.batch * params.k_batch_stride +
                     b.kv_head * params.k_head_stride + static_cast<int64_t>(b.n0) * params.k_row_stride;
    const T* v_ptr = reinterpret_cast<const T*>(params.v) + b.batch * params.v_batch_stride +
                     b.kv_head * params.v_head_stride + static_cast<int64_t>(b.n0) * params.v_row_stride;
    load_tile_async<Traits, Traits::kBlockN>(sK, k_ptr, params.k_row_stride, b.seqlen_k - b.n0, tid);
    load_tile_async<Traits, Traits::kBlockN>(sV, v_ptr, params.v_row_stride, b.seqlen_k - b.n0, tid);
}

// Q, dO and the rows' lse / dsum of one step (query head `head`, rows from m0) with cp.async: Q at sq, dO at
// sq + kSmemQ, lse and dsum at s_lse / s_dsum. Rows past the end are zero-filled: there Q = 0 gives S = 0 and
// P = exp2(0 - 0) = 1, but dO = 0 and dsum = 0 make their dV and dS contributions 0, and their dQ rows are not
// stored.
template <typename T, typename Traits>
__device__ __forceinline__ void load_q_step(const FlashBwdParams& params, int batch, int head, int m0, T* sq,
                                            float* s_lse, float* s_dsum, int tid) {
    constexpr int kBlockM = Traits::kBlockM;
    const T* q_ptr = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride +
                     head * params.q_head_stride + static_cast<int64_t>(m0) * params.q_row_stride;
    const T* do_ptr = reinterpret_cast<const T*>(params.dout) + batch * params.do_batch_stride +
                      head * params.do_head_stride + static_cast<int64_t>(m0) * params.do_row_stride;
    load_tile_async<Traits, kBlockM>(sq, q_ptr, params.q_row_stride, params.seqlen_q - m0, tid);
    load_tile_async<Traits, kBlockM>(sq + Traits::kSmemQ, do_ptr, params.do_row_stride, params.seqlen_q - m0, tid);
    if (tid < kBlockM) {
        const int64_t idx = (static_cast<int64_t>(batch) * params.num_heads + head) * params.seqlen_q + m0 + tid;
        const bool ok = m0 + tid < params.seqlen_q;
        cp_async_4(s_lse + tid, ok ? params.lse_log2 + idx : params.lse_log2, ok);
        cp_async_4(s_dsum + tid, ok ? params.dsum + idx : params.dsum, ok);
    }
}

// The block's dK / dV, staged in shared memory (sdK, sdV: [kBlockN][kHeadDim], swizzled as the K / V tiles), to
// global memory with 16-byte stores; keys past the end are not stored.
template <typename T, typename Traits>
__device__ __forceinline__ void store_dkdv_block(const FlashBwdParams& params, const BwdBlock& b, const T* sdK,
                                                 const T* sdV, int tid) {
    constexpr int kHeadDim = Traits::kHeadDim;
    T* dk_ptr = reinterpret_cast<T*>(params.dk) + b.batch * params.dk_batch_stride + b.kv_head * params.dk_head_stride +
                static_cast<int64_t>(b.n0) * params.dk_row_stride;
    T* dv_ptr = reinterpret_cast<T*>(params.dv) + b.batch * params.dv_batch_stride + b.kv_head * params.dv_head_stride +
                static_cast<int64_t>(b.n0) * params.dv_row_stride;
    constexpr int kIters = Traits::kBlockN * Traits::kChunks / Traits::kThreads;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
        const int idx = i * Traits::kThreads + tid;
        const int row = idx / Traits::kChunks;
        const int chunk = idx % Traits::kChunks;
        if (b.n0 + row < params.seqlen_k) {
            *reinterpret_cast<uint4*>(dk_ptr + static_cast<int64_t>(row) * params.dk_row_stride + chunk * 8) =
                *reinterpret_cast<const uint4*>(sdK + swz<kHeadDim>(row, chunk));
            *reinterpret_cast<uint4*>(dv_ptr + static_cast<int64_t>(row) * params.dv_row_stride + chunk * 8) =
                *reinterpret_cast<const uint4*>(sdV + swz<kHeadDim>(row, chunk));
        }
    }
}

// ---- 2. dK, dV (and dQ by atomics) -----------------------------------------------------------------------------
template <typename T, typename Traits, bool kCausal>
__device__ __forceinline__ void flash_bwd_dkdv_block(const FlashBwdParams& params) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kNT = kBlockM / 8;     // n-tiles of S^T (query columns) per warp
    constexpr int kDT = kHeadDim / 8;    // n-tiles of dK / dV (head_dim columns)
    constexpr int kKD = kHeadDim / 16;   // k-steps over head_dim (S^T, dP^T)
    constexpr int kKM = kBlockM / 16;    // k-steps over queries (dV, dK)
    constexpr int kKN = kBlockN / 16;    // k-steps over keys (dQ)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + Traits::kSmemK;
    T* sQ = sV + Traits::kSmemK;     // stage s: Q at sQ + 2 s kSmemQ, dO right after it
    T* sdS = sQ + 4 * Traits::kSmemQ;  // [kBlockN keys][kBlockM queries], swizzled (swz_ds)
    float* sLse = reinterpret_cast<float*>(sdS + Traits::kSmemDS);  // [2 stages][kBlockM]
    float* sDsum = sLse + 2 * kBlockM;                               // [2 stages][kBlockM]

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;

    const BwdBlock b = BwdBlock::make<kBlockM, kBlockN, kCausal>(params);
    const int n0 = b.n0, kv_head = b.kv_head, batch = b.batch;
    const int seqlen_q = params.seqlen_q, seqlen_k = b.seqlen_k, causal_offset = b.causal_offset;
    const int it_begin = b.it_begin, it_end = b.it_end;
    // A split with nothing to add exits at once (the float32 accumulators start at zero).
    if (params.num_splits > 1 && it_begin >= it_end) return;

    float acc_dk[kDT][4], acc_dv[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

    if (it_begin < it_end) {
        load_kv_block<T, Traits>(params, b, sK, sV, tid);
        if constexpr (Traits::kKvInRegs) cp_async_commit();  // K, V a group of their own: waited for before the loop
        // The steps in BwdBlock::Step order: `cur` this step, `nxt` the one after it.
        BwdBlock::Step cur = b.step(it_begin);
        load_q_step<T, Traits>(params, batch, b.head(cur), cur.mb * kBlockM, sQ, sLse, sDsum, tid);
        cp_async_commit();

        // Fragment addressing (same patterns as the forward, kernels/flash_fwd_kernel.cuh), as byte addresses in
        // shared memory; buffers at element offsets kOff* from sK.
        // Q and dO offsets are those of stage 0; stage 1 adds kStageBytes at run time.
        constexpr int kOffK = 0, kOffV = Traits::kSmemK, kOffQ = 2 * Traits::kSmemK;
        constexpr int kOffdO = kOffQ + Traits::kSmemQ, kOffdS = kOffQ + 4 * Traits::kSmemQ;
        constexpr uint32_t kStageBytes = 4 * Traits::kSmemQ;
        const uint32_t smem = smem_u32(sK);
        const SwzCols cols(lane);
        const int b_row = (lane % 8) + (lane / 16) * 8;
        const int cbit_a = ((lane / 16) ^ (lane & 1)) * 8;
        // A operand (K, V rows of this warp's keys); B non-transposed (Q, dO rows); B transposed (dO, Q, K rows).
        const LdsmAddr<kHeadDim> addr_a(smem, warp * 16 + lane % 16, cols, cbit_a);
        const LdsmAddr<kHeadDim> addr_b(smem, b_row, cols, (((lane / 8) % 2) ^ (lane & 1)) * 8);
        const LdsmAddr<kHeadDim> addr_bt(smem, (lane % 8) + ((lane / 8) % 2) * 8, cols, cbit_a);
        // dQ: this warp's m-tile and first head_dim column. Its A operand is dS (query-major), read transposed from
        // the key-major dS^T tile: this lane's key row is b_row + 16 kk (row & 7 == lane & 7), its chunk
        // 2 mt + (lane / 8) % 2, swizzled as swz_ds.
        const int dq_mt = warp / Traits::kWarpsPerMT;
        const int dq_col0 = (warp % Traits::kWarpsPerMT) * Traits::kColsDQ;
        const uint32_t addr_ds = smem + 2 * (kOffdS + swz_ds<kBlockM>(b_row, 2 * dq_mt + (lane / 8) % 2));
        // dQ's B operand (K rows, transposed) for this warp's columns: its k-step dq_col0 / 16 + kl, kl < 2 when
        // a warp has 32 columns (8 warps). Then dq_col0 is not a whole 64-column swizzle row, so the swizzled
        // column is computed here once per kl (as SwzCols would for that k-step) instead of addr_bt's bases plus
        // an offset.
        uint32_t addr_dq[2];
#pragma unroll
        for (int kl = 0; kl < 2; ++kl) {
            const int kk = dq_col0 / 16 + kl;
            const int row_t = (lane % 8) + ((lane / 8) % 2) * 8;
            addr_dq[kl] = smem + 2 * (row_t * kHeadDim + (kk & ~3) * 16 + ((kk & 3) ^ ((lane & 7) >> 1)) * 16 + cbit_a);
        }
        const float scale_log2 = params.scale_log2;
        const int key_row0 = n0 + warp * 16 + g;  // this thread's keys: key_row0 and key_row0 + 8
        // kKvInRegs: K's and V's A fragments, loaded once, while the first step's Q and dO are still arriving.
        uint32_t k_frag[Traits::kKvInRegs ? kKD : 1][4], v_frag[Traits::kKvInRegs ? kKD : 1][4];
        if constexpr (Traits::kKvInRegs) {
            cp_async_wait<1>();
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < kKD; ++kk) {
                ldsm_x4(k_frag[kk], addr_a(kk, kOffK));
                ldsm_x4(v_frag[kk], addr_a(kk, kOffV));
            }
        }

        for (int it = it_begin; it < it_end; ++it) {
            const int head = b.head(cur);
            const int m0 = cur.mb * kBlockM;
            const int stage = (it - it_begin) & 1;
            const uint32_t so = stage * kStageBytes;
            const float* cLse = sLse + stage * kBlockM;
            const float* cDsum = sDsum + stage * kBlockM;
            // Step it + 1 into the other stage: every warp finished reading it in step it - 1 (before that step's
            // second barrier, which every warp has passed).
            BwdBlock::Step nxt = cur;
            b.next(nxt);
            if (it + 1 < it_end)
                load_q_step<T, Traits>(params, batch, b.head(nxt), nxt.mb * kBlockM, sQ + (stage ^ 1) * 2 * Traits::kSmemQ,
                                       sLse + (stage ^ 1) * kBlockM, sDsum + (stage ^ 1) * kBlockM, tid);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();  // Q, dO, lse, dsum of this step (and K, V on the first) visible to all warps

            // S^T = K Q^T: this warp's 16 keys x kBlockM queries.
            float acc_s[kNT][4];
#pragma unroll
            for (int i = 0; i < kNT; ++i) acc_s[i][0] = acc_s[i][1] = acc_s[i][2] = acc_s[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kKD; ++kk) {
                uint32_t a[4];
                if constexpr (Traits::kKvInRegs) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[r] = k_frag[kk][r];
                } else {
                    ldsm_x4(a, addr_a(kk, kOffK));
                }
#pragma unroll
                for (int np = 0; np < kNT / 2; ++np) {
                    uint32_t b[4];
                    ldsm_x4(b, addr_b(kk, kOffQ + np * 16 * kHeadDim) + so);
                    mma_16816<T>(acc_s[2 * np], a, b[0], b[1]);
                    mma_16816<T>(acc_s[2 * np + 1], a, b[2], b[3]);
                }
            }

            // Mask keys past the end and (causal) keys after the query's diagonal. Query rows past the end need no
            // mask: their dO and dsum are zero-filled (load_step), so they add nothing to dV, dK or dQ.
            const bool need_mask = n0 + kBlockN > seqlen_k || (kCausal && n0 + kBlockN - 1 > m0 + causal_offset);
            if (need_mask) mask_scores_t<kCausal>(acc_s, key_row0, m0, seqlen_k, causal_offset, t);
            // P^T = exp2(S^T scale log2e - lse log2e).
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[nt][e] = exp2f(fmaf(acc_s[nt][e], scale_log2, -cLse[nt * 8 + 2 * t + (e & 1)]));

            // dV += P^T dO (dO as the B operand through ldmatrix.trans), P^T from the S^T accumulators.
#pragma unroll
            for (int kk = 0; kk < kKM; ++kk) {
                mma_c_as_a<T>(one_mtile(acc_dv), one_mtile(acc_s), kk, [&](uint32_t (&b)[4], int dp) {
                    ldsm_x4_t(b, addr_bt(dp, kOffdO + kk * 16 * kHeadDim) + so);
                });
            }

            // dP^T = V dO^T, dS^T = P^T (dP^T - dsum), dK += dS^T Q, in kSplitDp slices of the queries: only one
            // slice of dP^T is live beside P^T and the dK/dV accumulators (head_dim 128 spilled otherwise).
#pragma unroll
            for (int sl = 0; sl < Traits::kSplitDp; ++sl) {
                constexpr int kSNT = kNT / Traits::kSplitDp;  // n-tiles per slice
                float acc_dp[kSNT][4];
#pragma unroll
                for (int i = 0; i < kSNT; ++i) acc_dp[i][0] = acc_dp[i][1] = acc_dp[i][2] = acc_dp[i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < kKD; ++kk) {
                    uint32_t a[4];
                    if constexpr (Traits::kKvInRegs) {
#pragma unroll
                        for (int r = 0; r < 4; ++r) a[r] = v_frag[kk][r];
                    } else {
                        ldsm_x4(a, addr_a(kk, kOffV));
                    }
#pragma unroll
                    for (int np = 0; np < kSNT / 2; ++np) {
                        uint32_t b[4];
                        ldsm_x4(b, addr_b(kk, kOffdO + (sl * kSNT / 2 + np) * 16 * kHeadDim) + so);
                        mma_16816<T>(acc_dp[2 * np], a, b[0], b[1]);
                        mma_16816<T>(acc_dp[2 * np + 1], a, b[2], b[3]);
                    }
                }
#pragma unroll
                for (int i = 0; i < kSNT; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int nt = sl * kSNT + i;
                        acc_dp[i][e] = acc_s[nt][e] * (acc_dp[i][e] - cDsum[nt * 8 + 2 * t + (e & 1)]);
                    }
                // dK += dS^T Q, dS^T from this slice's accumulators (k-step j of the slice: kk over all queries).
#pragma unroll
                for (int j = 0; j < kSNT / 2; ++j) {
                    const int kk = sl * kSNT / 2 + j;
                    mma_c_as_a<T>(one_mtile(acc_dk), one_mtile(acc_dp), j, [&](uint32_t (&b)[4], int dp) {
                        ldsm_x4_t(b, addr_bt(dp, kOffQ + kk * 16 * kHeadDim) + so);
                    });
                }
                // dS^T to shared memory for dQ (the previous step's dQ reads finished before this step's first
                // barrier). (Also when a separate kernel computes dQ: skipping it costs NVRTC's build a spill.)
#pragma unroll
                for (int i = 0; i < kSNT; ++i) {
                    const int nt = sl * kSNT + i;
                    const int r = warp * 16 + g;
                    *reinterpret_cast<uint32_t*>(sdS + swz_ds<kBlockM>(r, nt) + 2 * t) = pack2<T>(acc_dp[i][0], acc_dp[i][1]);
                    *reinterpret_cast<uint32_t*>(sdS + swz_ds<kBlockM>(r + 8, nt) + 2 * t) =
                        pack2<T>(acc_dp[i][2], acc_dp[i][3]);
                }
            }
            __syncthreads();  // dS^T complete; every warp is done with Q, dO, lse, dsum of this step
            cur = nxt;
            if (params.dq_separate) continue;

            // dQ[m0 + 16 dq_mt .. +16, dq_col0 .. + kColsDQ] += dS K, 32 columns at a time; A fragments (dS) loaded
            // once.
            uint32_t ads[kKN][4];
#pragma unroll
            for (int kk = 0; kk < kKN; ++kk) ldsm_x4_t(ads[kk], addr_ds + 2 * kk * 16 * kBlockM);
            const int q_row = m0 + dq_mt * 16 + g;
            const DqFragAdder<kHeadDim> dq(
                params.dq_accum + ((static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + q_row) * kHeadDim +
                    dq_col0 + 2 * t,
                q_row < seqlen_q, q_row + 8 < seqlen_q);
#pragma unroll
            for (int dg = 0; dg < Traits::kColsDQ / 32; ++dg) {
                float acc[4][4];
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < kKN; ++kk)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        uint32_t b[4];
                        if constexpr (Traits::kColsDQ == 32) {
                            ldsm_x4_t(b, addr_dq[j] + 2 * (kOffK + kk * 16 * kHeadDim));
                        } else {
                            // dq_col0 is a multiple of 64 elements: whole rows of the 8-chunk swizzle pattern.
                            ldsm_x4_t(b, addr_bt(2 * dg + j, kOffK + kk * 16 * kHeadDim) + 2 * dq_col0);
                        }
                        mma_16816<T>(acc[2 * j], ads[kk], b[0], b[1]);
                        mma_16816<T>(acc[2 * j + 1], ads[kk], b[2], b[3]);
                    }
#pragma unroll
                for (int i = 0; i < 4; ++i) dq.add(dg * 32 + i * 8, acc[i]);
            }
        }
    }

    const float scale = params.scale;
    if (params.num_splits > 1) {
        // Split: float32 partials added into the accumulators, or stored into this split's slab (deterministic);
        // converted by flash_bwd_convert_dkdv_kernel.
        const int split = blockIdx.z % params.num_splits;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = n0 + warp * 16 + g + r * 8;
            if (params.deterministic) {
                store_dkdv_split(params, split, batch, kv_head, row, seqlen_k, acc_dk, acc_dv, r, t);
            } else {
                add_dkdv_split(params, batch, kv_head, row, seqlen_k, acc_dk, acc_dv, r, t);
            }
        }
        return;
    }

    // Epilogue: dK (times the softmax scale) and dV through shared memory (the K and V buffers) for 16-byte stores.
    // Keys past seqused_k get 0: their P was masked to 0, or the block did no step at all.
    __syncthreads();
    T* sdV = sV;
    T* sdK = sK;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + r * 8;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            *reinterpret_cast<uint32_t*>(sdV + swz<kHeadDim>(row, dt) + 2 * t) =
                pack2<T>(acc_dv[dt][2 * r], acc_dv[dt][2 * r + 1]);
            *reinterpret_cast<uint32_t*>(sdK + swz<kHeadDim>(row, dt) + 2 * t) =
                pack2<T>(acc_dk[dt][2 * r] * scale, acc_dk[dt][2 * r + 1] * scale);
        }
    }
    __syncthreads();
    store_dkdv_block<T, Traits>(params, b, sdK, sdV, tid);
}

template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_dkdv_kernel(const FlashBwdParams params) {
    flash_bwd_dkdv_block<T, Traits, kCausal>(params);
}

// ---- 4. dQ without atomics (FlashBwdParams::dq_separate) -------------------------------------------------------
// One block per (64-query block, query head, batch), 4 warps of 16 query rows, walking the key blocks its rows see
// (64 keys a step, K and V double-buffered by cp.async). Per step it recomputes S = Q K^T and dP = dO V^T (rows =
// queries, as the forward), P = exp2(S - lse), dS = P (dP - dsum), and adds dS K into register accumulators: dQ is
// owned by one block, written once in the input dtype, no float32 buffer, no atomics, no conversion. The price is
// recomputing S and dP a second time (the dK/dV kernel skips its dQ step then): 4 GEMMs here against 1 there.
template <int kHeadDim_>
struct BwdDqTraits {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4, kThreads = 128;
    static constexpr int kChunks = kHeadDim / 8;
    static constexpr int kTile = 64 * kHeadDim;  // elements of one [64][kHeadDim] tile
    // Q, dO, two stages of (K, V): 96 KB for head_dim 128 (within sm_86/89's 99 KB), 48 KB for 64.
    static constexpr int kSmemBytes = 6 * kTile * 2;
};

template <typename T, typename Traits, bool kCausal>
__global__ void __launch_bounds__(Traits::kThreads) flash_bwd_dq_kernel(const FlashBwdParams params) {
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kTile = Traits::kTile;
    constexpr int kNT = Traits::kBlockN / 8;  // n-tiles of S per warp
    constexpr int kDT = kHeadDim / 8;         // n-tiles of dQ
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);  // then dO, then stage s: K at 2 + 2 s, V at 3 + 2 s (tiles)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    // Causal: heads in x and query blocks counting down in y (the longest blocks, the last rows, first).
    const int m_block = kCausal ? gridDim.y - 1 - blockIdx.y : blockIdx.x;
    const int head = kCausal ? blockIdx.x : blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (params.num_heads / params.num_kv_heads);
    const int seqlen_q = params.seqlen_q;
    const int kv_len = params.seqused_k ? max(0, min(params.seqused_k[batch], params.seqlen_k)) : params.seqlen_k;
    const int causal_offset = kv_len - seqlen_q;
    const int m0 = m_block * Traits::kBlockM;
    int n_end = kv_len;
    if (kCausal) n_end = min(n_end, m0 + Traits::kBlockM + causal_offset);
    const int n_blocks = n_end > 0 ? (n_end + Traits::kBlockN - 1) / Traits::kBlockN : 0;

    const T* q_ptr = reinterpret_cast<const T*>(params.q) + batch * params.q_batch_stride + head * params.q_head_stride +
                     static_cast<int64_t>(m0) * params.q_row_stride;
    const T* do_ptr = reinterpret_cast<const T*>(params.dout) + batch * params.do_batch_stride +
                      head * params.do_head_stride + static_cast<int64_t>(m0) * params.do_row_stride;
    const T* k_ptr = reinterpret_cast<const T*>(params.k) + batch * params.k_batch_stride + kv_head * params.k_head_stride;
    const T* v_ptr = reinterpret_cast<const T*>(params.v) + batch * params.v_batch_stride + kv_head * params.v_head_stride;
    auto load_kv = [&](int n_block, int stage) {
        const int n0 = n_block * Traits::kBlockN;
        load_tile_async<Traits, Traits::kBlockN>(sQ + (2 + 2 * stage) * kTile, k_ptr + static_cast<int64_t>(n0) * params.k_row_stride,
                                                 params.k_row_stride, kv_len - n0, tid);
        load_tile_async<Traits, Traits::kBlockN>(sQ + (3 + 2 * stage) * kTile, v_ptr + static_cast<int64_t>(n0) * params.v_row_stride,
                                                 params.v_row_stride, kv_len - n0, tid);
    };
    load_tile_async<Traits, Traits::kBlockM>(sQ, q_ptr, params.q_row_stride, seqlen_q - m0, tid);
    load_tile_async<Traits, Traits::kBlockM>(sQ + kTile, do_ptr, params.do_row_stride, seqlen_q - m0, tid);
    if (n_blocks > 0) load_kv(0, 0);
    cp_async_commit();

    // This thread's rows m0 + 16 warp + g (+ 8): lse (base 2) and dsum; rows past the end are not stored.
    const int row0 = m0 + warp * 16 + g;
    float lse[2], dsum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = min(row0 + 8 * r, seqlen_q - 1);
        const int64_t idx = (static_cast<int64_t>(batch) * params.num_heads + head) * seqlen_q + row;
        lse[r] = params.lse_log2[idx];
        dsum[r] = params.dsum[idx];
    }

    // Fragment addressing (as the dK/dV kernel's, with queries as the A rows and keys as B): A = Q / dO rows of
    // this warp; B = K / V rows (S, dP); B transposed = K rows along the reduction (dQ).
    const uint32_t smem = smem_u32(sQ);
    const SwzCols cols(lane);
    const int cbit_a = ((lane / 16) ^ (lane & 1)) * 8;
    const LdsmAddr<kHeadDim> addr_a(smem, warp * 16 + lane % 16, cols, cbit_a);
    const LdsmAddr<kHeadDim> addr_b(smem, (lane % 8) + (lane / 16) * 8, cols, (((lane / 8) % 2) ^ (lane & 1)) * 8);
    const LdsmAddr<kHeadDim> addr_bt(smem, (lane % 8) + ((lane / 8) % 2) * 8, cols, cbit_a);

    float acc_dq[kDT][4];
#pragma unroll
    for (int i = 0; i < kDT; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;

    for (int n_block = 0; n_block < n_blocks; ++n_block) {
        const int stage = n_block & 1;
        const int kOffK = (2 + 2 * stage) * kTile, kOffV = kOffK + kTile;
        // The next key block into the other stage: every warp finished reading it in the previous step (before
        // that step's closing barrier).
        if (n_block + 1 < n_blocks) load_kv(n_block + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        // S = Q K^T and dP = dO V^T: this warp's 16 queries x 64 keys each.
        float acc_s[1][kNT][4], acc_dp[1][kNT][4];
#pragma unroll
        for (int i = 0; i < kNT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][i][e] = acc_dp[0][i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            uint32_t aq[4], ado[4];
            ldsm_x4(aq, addr_a(kk, 0));
            ldsm_x4(ado, addr_a(kk, kTile));
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                uint32_t b[4];
                ldsm_x4(b, addr_b(kk, kOffK + np * 16 * kHeadDim));
                mma_16816<T>(acc_s[0][2 * np], aq, b[0], b[1]);
                mma_16816<T>(acc_s[0][2 * np + 1], aq, b[2], b[3]);
                ldsm_x4(b, addr_b(kk, kOffV + np * 16 * kHeadDim));
                mma_16816<T>(acc_dp[0][2 * np], ado, b[0], b[1]);
                mma_16816<T>(acc_dp[0][2 * np + 1], ado, b[2], b[3]);
            }
        }
        const int n0 = n_block * Traits::kBlockN;
        if (n0 + Traits::kBlockN > kv_len || (kCausal && n0 + Traits::kBlockN - 1 > m0 + warp * 16 + causal_offset)) {
            mask_scores<kCausal>(acc_s, n0, m0 + warp * 16, kv_len, causal_offset, lane);
        }
        // dS = P (dP - dsum), P = exp2(S scale log2e - lse), in acc_dp.
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                acc_dp[0][nt][e] = exp2f(fmaf(acc_s[0][nt][e], params.scale_log2, -lse[r])) * (acc_dp[0][nt][e] - dsum[r]);
            }
        // dQ += dS K (K rows along the reduction: ldmatrix.trans).
#pragma unroll
        for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
            mma_c_as_a<T>(*reinterpret_cast<float(*)[1][kDT][4]>(&acc_dq[0][0]), acc_dp, kk, [&](uint32_t (&b)[4], int dp) {
                ldsm_x4_t(b, addr_bt(dp, kOffK + kk * 16 * kHeadDim));
            });
        }
        __syncthreads();  // every warp is done with this stage's K and V
    }

    // dq = scale * dQ in the input dtype; rows past the end are not stored (rows that saw no key store 0).
    T* dq = reinterpret_cast<T*>(params.dq) + batch * params.dq_batch_stride + head * params.dq_head_stride + 2 * t;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        if (row >= seqlen_q) continue;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            *reinterpret_cast<uint32_t*>(dq + static_cast<int64_t>(row) * params.dq_row_stride + dt * 8) =
                pack2<T>(acc_dq[dt][2 * r] * params.scale, acc_dq[dt][2 * r + 1] * params.scale);
        }
    }
}

}  // namespace llm_attn

// Plain C++ interface of the llm_attn CUDA kernels. No torch headers here or in any kernel file: only
// kernels/binding.cpp talks to torch. Every .cu file in kernels/ compiles alone with bare nvcc.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace llm_attn {

// All strides are in elements. Layout is (batch, heads, seq, head_dim) with the last dim contiguous; the other
// strides are arbitrary (multiples of 8 elements, 16-byte aligned base pointers: the binding checks this).
struct FlashFwdParams {
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    void* __restrict__ o;
    float* __restrict__ lse;            // (batch, num_heads, seqlen_q), contiguous; may be null
    const int* __restrict__ seqused_k;  // (batch,) number of valid keys per batch; null = seqlen_k

    int64_t q_batch_stride, q_head_stride, q_row_stride;
    int64_t k_batch_stride, k_head_stride, k_row_stride;
    int64_t v_batch_stride, v_head_stride, v_row_stride;
    int64_t o_batch_stride, o_head_stride, o_row_stride;

    int batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim;
    float scale;       // softmax scale (1/sqrt(head_dim) by default)
    float scale_log2;  // scale * log2(e): the kernel works in base 2 (exp2f)
    bool causal;       // bottom-right aligned: row i sees key j iff j <= i + seqused_k - seqlen_q
    bool is_bf16;
    int tile;          // FwdTile: kTileAuto picks the prefill tile by shape and device; tests and benchmarks force one

    // Split-KV (flash-decoding). num_splits == 1: the kernel writes o/lse directly. Otherwise each split writes
    // float32 partials to o_accum (num_splits, batch, num_heads, seqlen_q, head_dim) and lse_accum
    // (num_splits, batch, num_heads, seqlen_q), and a combine kernel reduces them.
    int num_splits;
    float* __restrict__ o_accum;
    float* __restrict__ lse_accum;
    // Decode path only, when it splits: (batch, num_kv_heads) int32 counters, zero before the launch; the kernel
    // leaves them zero (so a pool of counters can be zeroed once instead of per call).
    int* __restrict__ split_counters;
};

// Prefill tile configurations (kernels/flash_fwd_config.h), and kTileHopper: the sm_90a kernel
// (flash_fwd_sm90_kernel.cuh), which kTileAuto picks on compute capability 9.0. The decode kernel ignores this.
enum FwdTile : int { kTileAuto = 0, kTileLarge = 1, kTileWide = 2, kTileSmall = 3, kTileHopper = 4 };

// Launches the forward pass on `stream`. Returns cudaSuccess or the launch error; never synchronises.
cudaError_t run_flash_fwd(FlashFwdParams& params, cudaStream_t stream);

// How many KV splits run_flash_fwd would use for these shapes on a device with `num_sms` SMs (1 = no split).
// The binding calls it to size the float32 workspace.
int flash_fwd_num_splits(const FlashFwdParams& params, int num_sms);
// Whether run_flash_fwd takes the split-KV decode kernel (which needs params.split_counters when it splits).
bool flash_fwd_uses_decode_kernel(const FlashFwdParams& params);

// Template instantiation entry points, each in its own .cu file: the prefill kernel per (head_dim, dtype, causal),
// the split-KV decode kernel per (head_dim, dtype).
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_(FlashFwdParams& params, cudaStream_t stream);
template <typename T, int kHeadDim>
cudaError_t run_flash_decode_(FlashFwdParams& params, cudaStream_t stream);
// The Hopper kernel per (head_dim, dtype, causal), and whether this build has its sm_90a code for this device.
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_fwd_sm90_(FlashFwdParams& params, cudaStream_t stream);
template <typename T, int kHeadDim, bool kCausal>
bool flash_fwd_sm90_built_();
// True when the current device is compute capability 9.0 and the Hopper kernel's sm_90a code is in this build.
bool flash_fwd_sm90_available();

// Decode tuning overrides (llm_attn.ops.force_decode, experiments/decode_splits.py), process-wide, 0 = automatic.
// Forced splits are clamped to the number of 64-key tiles; a forced DecodeConfigId (kernel_tiles.h) whose row tiles
// cannot hold (query heads per KV head) x q_len is ignored. Each setter returns the previous value (an unknown
// config id: -1, nothing changed).
int flash_decode_force_splits(int splits);
int flash_decode_forced_splits();  // 0 = automatic
int flash_decode_force_config(int config);
int flash_decode_forced_config();
// The decode kernels' split combine (combine.cuh) loads 16 splits' partials in flight: the fp16 rule's count at B=1
// and 8 KV heads on an H100. Their last block runs it after its tile loop; at 32 splits a batch, head_dim 64's kernels
// (121-128 registers) would rise to 174 and lose half their blocks an SM. The FP8-cache split rule reads it too.
inline constexpr int kDecodeCombineBatch = 16;

// Device facts, cached per device (no synchronisation).
int num_sms_current_device();
int max_smem_per_block_current_device();

// ---- Backward (kernels/flash_bwd_*.cuh/.cu) --------------------------------------------------------------------
// Same layout conventions as FlashFwdParams. Gradients dq (like q), dk/dv (like k/v, per KV head: summed over the
// query heads of each group in the kernel, K/V never expanded). Workspaces are allocated by the binding:
//   dq_accum (batch, num_heads, seqlen_q, head_dim) float32, zero before the launch (dQ is accumulated with atomics)
//   dsum, lse_log2 (batch, num_heads, seqlen_q) float32, written by the preprocessing kernel.
struct FlashBwdParams {
    const void* __restrict__ q;
    const void* __restrict__ k;
    const void* __restrict__ v;
    const void* __restrict__ o;
    const void* __restrict__ dout;
    void* __restrict__ dq;
    void* __restrict__ dk;
    void* __restrict__ dv;
    const float* __restrict__ lse;      // (batch, num_heads, seqlen_q) contiguous, from the forward
    const float* __restrict__ dlse;     // same shape, gradient of the lse output; may be null (no lse gradient)
    const int* __restrict__ seqused_k;  // (batch,) or null
    float* __restrict__ dq_accum;
    float* __restrict__ dsum;           // rowsum(dO * O) - dlse
    float* __restrict__ lse_log2;       // lse * log2(e); +inf for rows that see no key (their P is then 0)

    int64_t q_batch_stride, q_head_stride, q_row_stride;
    int64_t k_batch_stride, k_head_stride, k_row_stride;
    int64_t v_batch_stride, v_head_stride, v_row_stride;
    int64_t o_batch_stride, o_head_stride, o_row_stride;
    int64_t do_batch_stride, do_head_stride, do_row_stride;
    int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
    int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
    int64_t dv_batch_stride, dv_head_stride, dv_row_stride;

    int batch, num_heads, num_kv_heads, seqlen_q, seqlen_k, head_dim;
    float scale, scale_log2;
    bool causal;  // bottom-right aligned, as the forward
    bool is_bf16;
    // The portable dK/dV kernel with two-dimensional warp tiles (flash_bwd_2d_kernel.cuh: 64 query rows a step, P and
    // dS through shared memory), set by flash_bwd_set_splits where its shared memory fits: forced (kBwdPortable2d),
    // or by default at head_dim 128. Here, in the padding before num_splits, the struct keeps its size.
    bool layout2d;

    // Split key blocks: with num_splits > 1, each key block's query steps (query heads x query blocks) are shared
    // by num_splits thread blocks of at most iters_per_split steps, which add float32 partial dK/dV into
    // dk_accum / dv_accum ((batch, num_kv_heads, seqlen_k, head_dim), zero before the launch); a conversion pass
    // writes dk/dv. Fills the GPU when there are few key blocks and balances causal blocks (the first keys are
    // seen by every query). num_splits == 1: dK/dV are written directly.
    int num_splits, iters_per_split;
    // The dK/dV kernel (set by flash_bwd_set_splits): the Hopper one (flash_bwd_sm90_kernel.cuh) on compute
    // capability 9.0, else the portable one with BwdTile<head_dim>, or BwdTileNarrow<head_dim> on a device whose
    // shared memory per block is below BwdTile's.
    bool hopper;
    bool narrow;
    // The Hopper kernel's dQ (flash_bwd_sm90_kernel.cuh): over the block's 128 keys by one warpgroup a step (true),
    // or by each warpgroup over its own 64 keys (set by flash_bwd_set_splits).
    bool dq_shared;
    // The portable kernels' dQ: by a separate kernel without atomics (flash_bwd_dq_kernel, writes dq; dq_accum
    // unused), or by the dK/dV kernel's float32 atomics (set by flash_bwd_set_splits).
    bool dq_separate;
    float* __restrict__ dk_accum;
    float* __restrict__ dv_accum;
    // The same bits on every run (llm_attn flash_attn_func(deterministic=True), torch.use_deterministic_algorithms):
    // the portable kernel with the separate dQ kernel (dq_separate), and a split launch's dK/dV partials stored into
    // one float32 slab per split (dk_accum / dv_accum hold num_splits slabs), summed in split order by the
    // conversion, instead of added by atomics. Set before flash_bwd_set_splits, which then never picks the Hopper
    // kernel (its dQ is a TMA reduce-add in no fixed order).
    bool deterministic;
};

// Dynamic shared memory of the backward's dK/dV kernel (BwdTraits::kSmemBytes): K and V (block_n rows each), two
// stages of Q and dO (block_m rows each), dS^T (block_n x block_m), two stages of lse and dsum (float32).
constexpr int bwd_smem_bytes(int head_dim, int block_m, int block_n) {
    return (4 * block_m * head_dim + 2 * block_n * head_dim + block_n * block_m) * 2 + 4 * block_m * 4;
}
// The same for the two-dimensional kernel (Bwd2dTraits::kSmemBytes, 64 x 128 tiles): P and dS instead of dS^T.
constexpr int bwd_2d_smem_bytes(int head_dim) {
    return (4 * 64 * head_dim + 2 * 128 * head_dim + 2 * 128 * 64) * 2 + 4 * 64 * 4;
}

// Which dK/dV kernel a backward runs (llm_attn.backward.force_bwd_tile; tests, benchmarks): kBwdAuto chooses by the
// device (the Hopper kernel on sm_90a; else at head_dim 128 the two-dimensional kernel where its shared memory fits,
// otherwise the portable kernel with the device's tile); kBwdPortable the portable kernel with the device's tile;
// kBwdNarrow its narrow tile on any device;
// kBwdHopper the sm_90a kernel (compute capability 9.0 only: the binding refuses it elsewhere), with its dQ way
// shared by the block's warpgroups (the default), or forced: kBwdHopperOwnDq, kBwdHopperSharedDq
// (FlashBwdParams::dq_shared); the portable
// kernel's dQ by atomics is kBwdPortable's, without them kBwdPortableSeparateDq.
enum BwdTileId : int {
    kBwdAuto = 0,
    kBwdPortable = 1,
    kBwdNarrow = 2,
    kBwdHopper = 3,
    kBwdHopperOwnDq = 4,
    kBwdHopperSharedDq = 5,
    kBwdPortableSeparateDq = 6,  // the portable kernel with the separate dQ kernel (FlashBwdParams::dq_separate)
    kBwdPortable2d = 7           // the portable kernel with two-dimensional warp tiles (FlashBwdParams::layout2d)
};

// The kernel (BwdTileId) and split of FlashBwdParams for these shapes on a device with `num_sms` SMs (sets hopper,
// narrow, num_splits and iters_per_split); `force_splits` > 0 asks for that many (tests). The binding sizes the
// workspaces from it.
void flash_bwd_set_splits(FlashBwdParams& params, int num_sms, int force_splits, int force_tile = kBwdAuto);

// Launches preprocessing, the dK/dV kernel (which also accumulates dQ) and the dQ conversion on `stream`.
cudaError_t run_flash_bwd(FlashBwdParams& params, cudaStream_t stream);
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_bwd_(FlashBwdParams& params, cudaStream_t stream);
template <typename T, int kHeadDim, bool kCausal>
cudaError_t run_flash_bwd_sm90_(FlashBwdParams& params, cudaStream_t stream);

}  // namespace llm_attn

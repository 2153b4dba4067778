// The one file that talks to torch: checks every input, fills FlashFwdParams, allocates the split-KV workspace
// from torch's caching allocator (safe under CUDA-graph capture) and launches on the current stream. No host
// synchronisation anywhere.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <string>
#include <type_traits>
#include <tuple>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "flash.h"
#include "flash_decode_fp8kv.h"
#include "fp8_cache_append.h"
#include "fp8_cache_dequant.h"
#include "flash_fp8.h"
#include "flash_int8.h"

namespace {

// Tile override for the prefill kernel (llm_attn.ops.force_tile): kTileAuto unless a test or benchmark forces one.
int g_tile = llm_attn::kTileAuto;

#define CHECK_INPUT(cond, ...) TORCH_CHECK(cond, "llm_attn.mha_fwd: ", __VA_ARGS__)

// Numbers in error messages are formatted with std::to_string, never streamed: on the H100 image, streaming an
// integer from this extension (its own instantiation of ostream::_M_insert<long>) segfaulted inside TORCH_CHECK,
// turning a bad-input error into a crash (cuda-gdb backtrace in kernels/NOTES.md). Strings stream safely.
// Floating-point numbers go through snprintf's %g instead (std::to_string's %f prints -1e-9 as -0.000000), which
// the NVRTC backend's messages match with Python's f"{x:g}" (llm_attn/_nvrtc.py).
template <typename N>
std::string num(N v) {
    if constexpr (std::is_floating_point_v<N>) {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
        return buf;
    } else {
        return std::to_string(v);
    }
}
std::string shape(at::IntArrayRef a) {
    std::string r = "[";
    for (size_t i = 0; i < a.size(); ++i) r += (i ? ", " : "") + std::to_string(a[i]);
    return r + "]";
}

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
    CHECK_INPUT(t.is_cuda(), name, " must be a CUDA tensor");
    CHECK_INPUT(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device());
    CHECK_INPUT(t.scalar_type() == q.scalar_type(), name, " dtype ", t.scalar_type(), " != q dtype ", q.scalar_type());
    CHECK_INPUT(t.dim() == 4, name, " must be 4-D (batch, heads, seq, head_dim), got ", num(t.dim()), "-D");
    CHECK_INPUT(t.stride(3) == 1, name, " must be contiguous in head_dim");
    for (int d = 0; d < 3; ++d) {
        CHECK_INPUT(t.stride(d) % 8 == 0 || t.size(d) == 1, name, " strides must be multiples of 8 elements (16 bytes), got ",
                    shape(t.strides()));
    }
    CHECK_INPUT(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

// The fields that FlashFwdParams and FlashBwdParams share, filled alike for the forward and the backward: q, k, v,
// out and lse (the forward's output, the backward's input), their strides, the shapes, the scale (also times
// log2(e): the kernels work in base 2), causal and the dtype.
template <typename Params>
void set_shared_params(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                       const at::Tensor& lse, const std::optional<at::Tensor>& seqused_k, double scale, bool causal) {
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
    p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
    p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
    p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
    p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
    p.batch = q.size(0), p.num_heads = q.size(1), p.num_kv_heads = k.size(1);
    p.seqlen_q = q.size(2), p.seqlen_k = k.size(2), p.head_dim = q.size(3);
    p.scale = static_cast<float>(scale);
    p.scale_log2 = static_cast<float>(scale * M_LOG2E);
    p.causal = causal;
    p.is_bf16 = q.scalar_type() == at::kBFloat16;
}

// Every check of the forward's inputs, in the order (and words) of llm_attn/kernel_contract.py's launcher_problem.
// out/lse are checked where given (mha_fwd); mha_fwd_alloc makes them itself.
void check_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* out,
               const at::Tensor* lse, const std::optional<at::Tensor>& seqused_k, double scale, bool causal) {
    CHECK_INPUT(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "only float16 and bfloat16 are supported, got ", q.scalar_type());
    check_operand(q, "q", q);
    check_operand(k, "k", q);
    check_operand(v, "v", q);
    if (out) check_operand(*out, "out", q);
    const int64_t batch = q.size(0), num_heads = q.size(1), seqlen_q = q.size(2), head_dim = q.size(3);
    const int64_t num_kv_heads = k.size(1), seqlen_k = k.size(2);
    CHECK_INPUT(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", num(head_dim));
    CHECK_INPUT(k.sizes() == v.sizes(), "k ", shape(k.sizes()), " and v ", shape(v.sizes()), " must have the same shape");
    CHECK_INPUT(k.size(0) == batch && k.size(3) == head_dim, "k/v ", shape(k.sizes()), " do not match q ", shape(q.sizes()));
    CHECK_INPUT(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query heads (", num(num_heads),
                ") must be a multiple of kv heads (", num(num_kv_heads), ")");
    CHECK_INPUT(batch > 0 && num_heads > 0 && seqlen_q > 0 && seqlen_k > 0, "empty input: q ", shape(q.sizes()), ", k ",
                shape(k.sizes()));
    CHECK_INPUT(seqlen_q < (1 << 30) && seqlen_k < (1 << 30), "sequence too long");
    // Grid limits: heads in gridDim.y (or x), batch x KV splits in z; causal grids put the 64-row blocks in y.
    CHECK_INPUT(num_heads <= 65535 && batch <= 65535, "at most 65535 heads and batch 65535, got ", num(num_heads), " and ",
                num(batch));
    CHECK_INPUT(!causal || seqlen_q <= 65535 * 64, "causal q_len must be <= ", num(65535 * 64), ", got ", num(seqlen_q));
    if (out) CHECK_INPUT(out->sizes() == q.sizes(), "out ", shape(out->sizes()), " must match q ", shape(q.sizes()));
    if (lse) {
        CHECK_INPUT(lse->is_cuda() && lse->device() == q.device() && lse->scalar_type() == at::kFloat &&
                        lse->is_contiguous() && lse->dim() == 3 && lse->size(0) == batch && lse->size(1) == num_heads &&
                        lse->size(2) == seqlen_q,
                    "lse must be a contiguous float32 (batch, heads, seqlen_q) tensor on q's device");
    }
    CHECK_INPUT(std::isfinite(scale), "scale must be finite");
    // As flash_attn_func (llm_attn/ops.py): with scale < 0 the row max taken before scaling is the wrong one.
    CHECK_INPUT(scale >= 0, "scale must be >= 0 (the kernels' online softmax takes each row's max before scaling), ",
                "got ", num(scale));
    if (seqused_k.has_value()) {
        const at::Tensor& s = *seqused_k;
        CHECK_INPUT(s.is_cuda() && s.device() == q.device(), "seqused_k must be on q's device");
        CHECK_INPUT(s.scalar_type() == at::kInt && s.dim() == 1 && s.size(0) == batch && s.is_contiguous(),
                    "seqused_k must be a contiguous int32 tensor of shape (batch,)");
    }
}

// ---- Decode counter pool -------------------------------------------------------------------------------------------
// The split decode kernel's last block per (batch, KV head) is found with an arrival counter, which must be zero
// when the launch starts. A per-call memset costs a graph node (~2 µs per call at short contexts on the H200:
// kernels/NOTES.md, "Decode gap reading"), so the counters live in a pool that is zeroed when it is made and that
// the kernel leaves zero (its last block resets its counter). Slices must never be shared by launches that can run
// at the same time: an eager stream keeps one slice for all its launches (stream order serialises them), and every
// launch captured into a CUDA graph gets a slice of its own, never handed out again (graphs may be replayed side by
// side). The pool is cudaMalloc'd memory, not a tensor (one from torch's allocator, made inside torch.compile's
// CUDA-graph trees, broke them: decode v3 in NOTES.md). It grows by 1 MiB chunks, each allocated in relaxed
// capture mode (as torch's allocator does: allowed inside a capture, and no other thread's capture is disturbed)
// and zeroed on the pool's own stream, waited for on the host, so a chunk is also made inside a capture. Up to
// 64 MiB per device; past that, or if an allocation fails, or when disabled for a test, the caller zeroes
// counters of its own with a memset, as before.
constexpr int64_t kCounterChunkInts = 1 << 18;      // 1 MiB
constexpr int64_t kCounterPoolMaxInts = 1 << 24;    // 64 MiB
constexpr int64_t kCounterSliceQuantum = 256;

struct CounterChunk {
    int* base;
    int64_t size;  // ints
    int64_t used;  // ints handed out
};
struct CounterPool {
    std::vector<CounterChunk> chunks;  // the last one is being handed out
    int64_t total = 0;                              // ints allocated
    bool failed = false;
    cudaStream_t zero_stream = nullptr;
    std::unordered_map<cudaStream_t, std::pair<int*, int64_t>> eager;  // stream -> (slice, ints)
};
std::mutex g_pool_mutex;
std::unordered_map<int, CounterPool> g_pools;
bool g_pool_enabled = true;

// A fresh zeroed chunk of at least `ints` counters, or false (the pool then serves no more).
bool grow_pool(CounterPool& pool, int64_t ints) {
    const int64_t size = std::max(kCounterChunkInts, ints);
    if (pool.total + size > kCounterPoolMaxInts) return false;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    void* ptr = nullptr;
    bool ok = pool.zero_stream != nullptr ||
              cudaStreamCreateWithFlags(&pool.zero_stream, cudaStreamNonBlocking) == cudaSuccess;
    ok = ok && cudaMalloc(&ptr, size * sizeof(int)) == cudaSuccess;
    ok = ok && cudaMemsetAsync(ptr, 0, size * sizeof(int), pool.zero_stream) == cudaSuccess;
    ok = ok && cudaStreamSynchronize(pool.zero_stream) == cudaSuccess;  // zero before any launch is queued on it
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (!ok) {
        (void)cudaGetLastError();
        if (ptr != nullptr) cudaFree(ptr);
        return false;
    }
    pool.chunks.push_back({static_cast<int*>(ptr), size, 0});
    pool.total += size;
    return true;
}

int* pooled_counters(int device, cudaStream_t stream, int64_t n) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
        (void)cudaGetLastError();
        return nullptr;
    }
    const bool captured = status != cudaStreamCaptureStatusNone;
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (!g_pool_enabled) return nullptr;
    CounterPool& pool = g_pools[device];
    if (!captured) {
        auto it = pool.eager.find(stream);
        if (it != pool.eager.end() && it->second.second >= n) return it->second.first;
    }
    if (pool.failed) return nullptr;
    const int64_t size = captured ? n : (n + kCounterSliceQuantum - 1) / kCounterSliceQuantum * kCounterSliceQuantum;
    if (pool.chunks.empty() || pool.chunks.back().used + size > pool.chunks.back().size) {
        if (!grow_pool(pool, size)) {
            pool.failed = true;
            return nullptr;
        }
    }
    CounterChunk& chunk = pool.chunks.back();
    int* slice = chunk.base + chunk.used;
    chunk.used += size;
    if (!captured) pool.eager[stream] = {slice, size};  // a smaller slice it had is not handed out again
    return slice;
}

// Tests: switch the pool off (true -> false: every call zeroes its own counters) or on; returns the previous state.
bool set_decode_counter_pool(bool enabled) {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    const bool prev = g_pool_enabled;
    g_pool_enabled = enabled;
    return prev;
}

// Tests: the current device's pool as (ints handed out, their values copied to the host after a device sync).
std::tuple<int64_t, std::vector<int64_t>> decode_counter_pool_state() {
    const int device = c10::cuda::current_device();
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    std::vector<int64_t> values;
    auto it = g_pools.find(device);
    if (it == g_pools.end()) return {0, values};
    TORCH_CHECK(cudaDeviceSynchronize() == cudaSuccess, "llm_attn: reading the decode counter pool failed");
    for (const CounterChunk& chunk : it->second.chunks) {
        std::vector<int> host(chunk.used);
        TORCH_CHECK(cudaMemcpy(host.data(), chunk.base, chunk.used * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess,
                    "llm_attn: reading the decode counter pool failed");
        values.insert(values.end(), host.begin(), host.end());
    }
    return {static_cast<int64_t>(values.size()), values};
}

// The layout the kernels read and write in place (llm_attn.kernel_contract.aligned16 and a contiguous head_dim):
// cp.async and TMA move 16-byte chunks, so strides of batch/heads/seq must be multiples of 8 elements (a dim of size
// 1 has any stride) and the base 16-byte aligned.
bool kernel_ready(const at::Tensor& t) {
    if (t.dim() != 4 || t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
    for (int d = 0; d < 3; ++d) {
        if (t.stride(d) % 8 != 0 && t.size(d) != 1) return false;
    }
    return true;
}

// An input the kernels can read in place as it is, anything else (4-D) as a contiguous copy: any layout transformers
// or a KV cache produces is read in place; others are copied once rather than rejected. Done here, not in Python,
// because the check costs the host ~1-3 us per tensor there on every call (kernels/NOTES.md "Host cost").
at::Tensor readable(const at::Tensor& t) {
    // clone, not contiguous(): a contiguous tensor at a misaligned address would come back as itself.
    return t.dim() != 4 || kernel_ready(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Fills FlashFwdParams for checked inputs, allocates the split-KV workspace and launches on the current stream.
void launch_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                const at::Tensor& lse, const std::optional<at::Tensor>& seqused_k, double scale, bool causal) {
    const c10::cuda::CUDAGuard guard(q.device());
    llm_attn::FlashFwdParams p{};
    set_shared_params(p, q, k, v, out, lse, seqused_k, scale, causal);
    p.tile = g_tile;

    const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    p.num_splits = llm_attn::flash_fwd_num_splits(p, num_sms);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    at::Tensor workspace;
    if (p.num_splits > 1) {
        // One allocation from torch's caching allocator (safe under CUDA-graph capture) for the partial outputs and
        // their log-sum-exps: o_accum (splits, B, H, Sq, D) floats, lse_accum (splits, B, H, Sq) floats. The decode
        // kernel's per-(batch, KV head) arrival counters come from the counter pool (zero on entry, left zero by
        // the kernel: no memset node per call); where the pool cannot serve, they follow in the same allocation and
        // are zeroed here, as before.
        const int64_t rows = static_cast<int64_t>(p.num_splits) * p.batch * p.num_heads * p.seqlen_q;
        const bool counters = llm_attn::flash_fwd_uses_decode_kernel(p);
        const int64_t n_counters = counters ? static_cast<int64_t>(p.batch) * p.num_kv_heads : 0;
        int* pooled = counters ? pooled_counters(q.get_device(), stream, n_counters) : nullptr;
        workspace = at::empty({rows * (p.head_dim + 1) + (pooled ? 0 : n_counters)}, q.options().dtype(at::kFloat));
        p.o_accum = workspace.data_ptr<float>();
        p.lse_accum = p.o_accum + rows * p.head_dim;
        if (pooled) {
            p.split_counters = pooled;
        } else if (counters) {
            p.split_counters = reinterpret_cast<int*>(p.lse_accum + rows);
            const cudaError_t err = cudaMemsetAsync(p.split_counters, 0, n_counters * sizeof(int), stream);
            TORCH_CHECK(err == cudaSuccess, "llm_attn.mha_fwd: zeroing the split counters failed: ",
                        cudaGetErrorString(err));
        }
    }
    const cudaError_t err = llm_attn::run_flash_fwd(p, stream);
    TORCH_CHECK(err == cudaSuccess, "llm_attn.mha_fwd: kernel launch failed: ", cudaGetErrorString(err));
}

void mha_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
             const std::optional<at::Tensor>& seqused_k, double scale, bool causal) {
    check_fwd(q, k, v, &out, &lse, seqused_k, scale, causal);
    launch_fwd(q, k, v, out, lse, seqused_k, scale, causal);
}

// mha_fwd with its outputs made here (one Python -> C++ crossing per call instead of three): out in (B, Sq, Hq, D)
// memory order viewed as (B, Hq, Sq, D), so that transformers' layout is a free view, and lse (B, Hq, Sq) float32.
// Inputs in any layout (readable() copies what the kernels cannot read in place).
std::tuple<at::Tensor, at::Tensor> mha_fwd_alloc(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, const std::optional<at::Tensor>& seqused_k,
                                                 double scale, bool causal) {
    const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in);
    check_fwd(q, k, v, nullptr, nullptr, seqused_k, scale, causal);
    at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    launch_fwd(q, k, v, out, lse, seqused_k, scale, causal);
    return {out, lse};
}

// The FP8 forward (kernels/flash_fp8.h): the same inputs as mha_fwd_alloc, quantised by the kernel's pre-pass into
// workspaces made here (e4m3 Q, K, V^T in one byte buffer; their scales and the zeroed channel statistics in one
// float32 buffer), so the quantisation is part of every call. block_n: the kernel's key tile (128, 192 or 256 keys per
// S tile, 256 with e4m3 P V only; 0 = LLM_ATTN_FP8_BLOCK_N if set, else the build's default, kernel_tiles.h
// Fp8Tiles<D>): a tuning choice, the result's semantics are the same. qk: the operands of S = Q K^T, "int8" or
// "e4m3" ("" = LLM_ATTN_FP8_QK if set, else int8; flash_fp8.h Fp8Qk): this one changes the result (the rounding of
// Q and K). pv: the operands of P V, "e4m3" ("" too) or "input" (P in the input dtype times the unquantised V; int8
// Q K^T only; no V^T workspace; flash_fp8.h Fp8Pv): it changes the result too.
int fp8_qk_code(const std::string& qk) {
    if (qk.empty()) return llm_attn::flash_fwd_fp8_qk(llm_attn::kFp8QkDefault);
    TORCH_CHECK(qk == "int8" || qk == "e4m3", "llm_attn.mha_fwd_fp8: qk must be 'int8' or 'e4m3' (the operands of "
                "Q K^T), not '", qk, "'");
    return qk == "int8" ? llm_attn::kFp8QkInt8 : llm_attn::kFp8QkE4m3;
}

int fp8_pv_code(const std::string& pv) {
    TORCH_CHECK(pv.empty() || pv == "e4m3" || pv == "input", "llm_attn.mha_fwd_fp8: pv must be 'e4m3' or 'input' (the "
                "operands of P V), not '", pv, "'");
    return pv == "input" ? llm_attn::kFp8PvInput : llm_attn::kFp8PvE4m3;
}

std::tuple<at::Tensor, at::Tensor> mha_fwd_fp8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const std::optional<at::Tensor>& seqused_k, double scale, bool causal,
                                               int64_t block_n, const std::string& qk, const std::string& pv) {
    check_fwd(q, k, v, nullptr, nullptr, seqused_k, scale, causal);
    const int qk_asked = fp8_qk_code(qk);
    const int pv_code = fp8_pv_code(pv);
    const bool pv_input = pv_code == llm_attn::kFp8PvInput;
    TORCH_CHECK(!pv_input || qk != "e4m3", "llm_attn.mha_fwd_fp8: pv='input' runs with int8 Q K^T only (qk 'int8' or "
                "''), not qk='e4m3'");
    const int qk_code = pv_input ? llm_attn::kFp8QkInt8 : qk_asked;  // "" is int8 there, whatever LLM_ATTN_FP8_QK says
    const c10::cuda::CUDAGuard guard(q.device());
    TORCH_CHECK(llm_attn::flash_fwd_fp8_available(),
                "llm_attn.mha_fwd_fp8: FP8 attention needs a compute capability 9.0 GPU (H100, H200) and a build with "
                "sm_90a (LLM_ATTN_CUDA_ARCHS containing 9.0)");
    const int tile =
        llm_attn::flash_fwd_fp8_block_n(static_cast<int>(q.size(3)), static_cast<int>(block_n), pv_code, qk_code);
    TORCH_CHECK(tile != 0, "llm_attn.mha_fwd_fp8: the FP8 kernel has no ",
                block_n ? std::to_string(block_n) + "-key tile" : std::string("tile of the LLM_ATTN_FP8_BLOCK_N set"),
                " for head_dim ", num(q.size(3)), pv_input ? " with pv='input' (128 or 192)" : "",
                " in this build (kernel_tiles.h Fp8Tiles)");
    at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    llm_attn::FlashFwdFp8Params f{};
    set_shared_params(f.p, q, k, v, out, lse, seqused_k, scale, causal);
    f.p.num_splits = 1;
    const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3), hkv = k.size(1), sk = k.size(2);
    const int64_t k_block = llm_attn::fp8_k_block(pv_input), k_blocks = (sk + k_block - 1) / k_block;
    const int64_t pad = llm_attn::fp8_seqlen_k_pad(static_cast<int>(sk));
    const int64_t n_q8 = b * hq * sq * d, n_k8 = b * hkv * sk * d;  // multiples of 64
    const int64_t n_vt8 = pv_input ? 0 : b * hkv * d * pad;           // P V in the input dtype reads the caller's V
    at::Tensor bytes = at::empty({n_q8 + n_k8 + n_vt8}, q.options().dtype(at::kByte));
    const int64_t n_stats = 2 * b * hkv * d, n_qs = b * hq * sq, n_ks = b * hkv * k_blocks, n_vs = b * hkv * d;
    const int64_t n_qm = b * hq * sq;
    at::Tensor floats = at::empty({n_stats + n_qs + n_ks + n_vs + n_qm}, q.options().dtype(at::kFloat));
    floats.narrow(0, 0, n_stats).zero_();  // only the statistics are accumulated into
    uint8_t* base = bytes.data_ptr<uint8_t>();
    f.q8 = base, f.k8 = base + n_q8, f.vt8 = pv_input ? nullptr : base + n_q8 + n_k8;
    float* fb = floats.data_ptr<float>();
    f.stats = fb, f.q_scale = fb + n_stats, f.k_scale = fb + n_stats + n_qs, f.v_scale = fb + n_stats + n_qs + n_ks;
    f.q_dot_kmean = fb + n_stats + n_qs + n_ks + n_vs;
    const cudaError_t err = llm_attn::run_flash_fwd_fp8(f, at::cuda::getCurrentCUDAStream(), tile, qk_code, pv_code);
    TORCH_CHECK(err == cudaSuccess, "llm_attn.mha_fwd_fp8: kernel launch failed: ", cudaGetErrorString(err));
    return {out, lse};
}

// The INT8 forward (kernels/flash_int8.h): int8 Q K^T, P V in e4m3 where the GPU has it (sm_89), else in the
// input dtype; its workspace (int8 K, scales, e4m3 V^T, statistics) in one byte buffer made here.
std::tuple<at::Tensor, at::Tensor> mha_fwd_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const std::optional<at::Tensor>& seqused_k, double scale, bool causal) {
    check_fwd(q, k, v, nullptr, nullptr, seqused_k, scale, causal);
    const c10::cuda::CUDAGuard guard(q.device());
    const int major = at::cuda::getCurrentDeviceProperties()->major;
    TORCH_CHECK(major == 8 || major == 9, "llm_attn.mha_fwd_int8: the INT8 forward has kernels for compute capability "
                "8.x and 9.0, this GPU is ", num(major), ".", num(at::cuda::getCurrentDeviceProperties()->minor));
    at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2);
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    llm_attn::FlashFwdInt8Params p{};
    set_shared_params(p, q, k, v, out, lse, seqused_k, scale, causal);
    p.fp8_pv = llm_attn::flash_fwd_int8_fp8_pv_available();
    at::Tensor ws = at::empty({static_cast<int64_t>(llm_attn::flash_fwd_int8_workspace_bytes(p))},
                              q.options().dtype(at::kByte));
    llm_attn::flash_fwd_int8_set_workspace(p, ws.data_ptr());
    const cudaError_t err = llm_attn::run_flash_fwd_int8(p, at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "llm_attn.mha_fwd_int8: kernel launch failed: ", cudaGetErrorString(err));
    return {out, lse};
}

int64_t num_splits(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t seqlen_q, int64_t seqlen_k,
                   int64_t head_dim, int64_t num_sms) {
    llm_attn::FlashFwdParams p{};
    p.batch = batch, p.num_heads = num_heads, p.num_kv_heads = num_kv_heads;
    p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k, p.head_dim = head_dim;
    return llm_attn::flash_fwd_num_splits(p, num_sms);
}

// Sets the prefill tile override (0 auto, 1 large, 2 wide, 3 small, 4 hopper) and returns the previous one; an
// unknown id changes nothing and returns -1 (llm_attn.ops.force_tile validates names and the device first).
int64_t set_tile(int64_t tile) {
    if (tile < llm_attn::kTileAuto || tile > llm_attn::kTileHopper) return -1;
    const int prev = g_tile;
    g_tile = static_cast<int>(tile);
    return prev;
}


// ---- Backward ------------------------------------------------------------------------------------------------------
// Key-block split override for the backward (llm_attn.backward.force_bwd_splits): 0 = automatic. Starts from
// LLM_ATTN_BWD_SPLITS (a count; kernel A/B runs of one build: experiments/kernel_ab.py variants), else 0.
int g_bwd_splits = [] {
    const char* v = std::getenv("LLM_ATTN_BWD_SPLITS");
    return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : 0;
}();

int64_t set_bwd_splits(int64_t splits) {
    if (splits < 0) return -1;
    const int prev = g_bwd_splits;
    g_bwd_splits = static_cast<int>(splits);
    return prev;
}

// The backward's dK/dV kernel forced (llm_attn.backward.force_bwd_tile): a BwdTileId (flash.h). Starts from
// LLM_ATTN_BWD_TILE=auto|portable|narrow|hopper|hopper_own_dq|hopper_shared_dq|portable_separate_dq|portable_2d (kernel A/B runs of one build: experiments/kernel_ab.py variants),
// else kBwdAuto; hopper off a compute capability 9.0 GPU then fails the backward with the binding's clear error.
int bwd_tile_from_env() {
    const char* v = std::getenv("LLM_ATTN_BWD_TILE");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return llm_attn::kBwdAuto;
    if (std::strcmp(v, "portable") == 0) return llm_attn::kBwdPortable;
    if (std::strcmp(v, "narrow") == 0) return llm_attn::kBwdNarrow;
    if (std::strcmp(v, "hopper") == 0) return llm_attn::kBwdHopper;
    if (std::strcmp(v, "hopper_own_dq") == 0) return llm_attn::kBwdHopperOwnDq;
    if (std::strcmp(v, "hopper_shared_dq") == 0) return llm_attn::kBwdHopperSharedDq;
    if (std::strcmp(v, "portable_separate_dq") == 0) return llm_attn::kBwdPortableSeparateDq;
    if (std::strcmp(v, "portable_2d") == 0) return llm_attn::kBwdPortable2d;
    TORCH_WARN("llm_attn: LLM_ATTN_BWD_TILE=", v, " is not auto, portable, narrow, hopper, hopper_own_dq, "
               "hopper_shared_dq, portable_separate_dq or portable_2d; ignored");
    return llm_attn::kBwdAuto;
}
int g_bwd_tile = bwd_tile_from_env();

// Returns the previous id; an unknown id changes nothing and returns -1 (force_bwd_tile validates names first).
int64_t set_bwd_tile(int64_t tile) {
    if (tile < llm_attn::kBwdAuto || tile > llm_attn::kBwdPortable2d) return -1;
    const int prev = g_bwd_tile;
    g_bwd_tile = static_cast<int>(tile);
    return prev;
}

// The (num_splits, iters_per_split) the backward would use for these shapes (tests).
std::vector<int64_t> bwd_splits(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t seqlen_q,
                                int64_t seqlen_k, int64_t head_dim, bool causal, int64_t num_sms) {
    llm_attn::FlashBwdParams p{};
    p.batch = batch, p.num_heads = num_heads, p.num_kv_heads = num_kv_heads;
    p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k, p.head_dim = head_dim, p.causal = causal;
    llm_attn::flash_bwd_set_splits(p, num_sms, g_bwd_splits, g_bwd_tile);
    return {p.num_splits, p.iters_per_split};
}

#define CHECK_BWD(cond, ...) TORCH_CHECK(cond, "llm_attn.mha_bwd: ", __VA_ARGS__)

void check_bwd_operand(const at::Tensor& t, const char* name, const at::Tensor& q, at::IntArrayRef sizes) {
    CHECK_BWD(t.is_cuda(), name, " must be a CUDA tensor");
    CHECK_BWD(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device());
    CHECK_BWD(t.scalar_type() == q.scalar_type(), name, " dtype ", t.scalar_type(), " != q dtype ", q.scalar_type());
    CHECK_BWD(t.sizes() == sizes, name, " ", shape(t.sizes()), " must have shape ", shape(sizes));
    CHECK_BWD(t.stride(3) == 1, name, " must be contiguous in head_dim");
    for (int d = 0; d < 3; ++d) {
        CHECK_BWD(t.stride(d) % 8 == 0 || t.size(d) == 1, name,
                  " strides must be multiples of 8 elements (16 bytes), got ", shape(t.strides()));
    }
    CHECK_BWD(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

void check_rows_f32(const at::Tensor& t, const char* name, const at::Tensor& q) {
    CHECK_BWD(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(2) == q.size(2),
              name, " must be a contiguous float32 (batch, heads, seqlen_q) tensor on q's device");
}

// Gradients of flash attention into preallocated dq (q's shape), dk, dv (k's shape). lse: the forward's output;
// dlse: optional gradient of it. deterministic: the same bits on every run (FlashBwdParams::deterministic).
// Allocates the float32 dQ accumulator and the per-row workspaces from torch's caching allocator; launches on the
// current stream; no synchronisation.
void mha_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse, at::Tensor& dq,
             at::Tensor& dk, at::Tensor& dv, const std::optional<at::Tensor>& seqused_k, double scale, bool causal,
             bool deterministic) {
    CHECK_BWD(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "only float16 and bfloat16 are supported, got ", q.scalar_type());
    CHECK_BWD(q.is_cuda() && q.dim() == 4, "q must be a 4-D CUDA tensor (batch, heads, seq, head_dim)");
    CHECK_BWD(k.dim() == 4 && v.dim() == 4, "k and v must be 4-D (batch, kv_heads, seq, head_dim)");
    const int64_t batch = q.size(0), num_heads = q.size(1), seqlen_q = q.size(2), head_dim = q.size(3);
    const int64_t num_kv_heads = k.size(1), seqlen_k = k.size(2);
    CHECK_BWD(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", num(head_dim));
    CHECK_BWD(k.size(0) == batch && k.size(3) == head_dim, "k/v ", shape(k.sizes()), " do not match q ",
              shape(q.sizes()));
    CHECK_BWD(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query heads (", num(num_heads),
              ") must be a multiple of kv heads (", num(num_kv_heads), ")");
    CHECK_BWD(batch > 0 && num_heads > 0 && seqlen_q > 0 && seqlen_k > 0, "empty input: q ", shape(q.sizes()),
              ", k ", shape(k.sizes()));
    CHECK_BWD(seqlen_q < (1 << 30) && seqlen_k < (1 << 30), "sequence too long");
    // Grid: key blocks in x (or y when causal), KV heads in the other, batch in z.
    CHECK_BWD(num_heads <= 65535 && batch <= 65535, "at most 65535 heads and batch 65535, got ", num(num_heads),
              " and ", num(batch));
    CHECK_BWD(!causal || seqlen_k <= 65535 * 64, "causal kv_len must be <= ", num(65535 * 64), ", got ",
              num(seqlen_k));
    check_bwd_operand(q, "q", q, q.sizes());
    check_bwd_operand(k, "k", q, k.sizes());
    check_bwd_operand(v, "v", q, k.sizes());
    check_bwd_operand(out, "out", q, q.sizes());
    check_bwd_operand(dout, "dout", q, q.sizes());
    check_bwd_operand(dq, "dq", q, q.sizes());
    check_bwd_operand(dk, "dk", q, k.sizes());
    check_bwd_operand(dv, "dv", q, k.sizes());
    check_rows_f32(lse, "lse", q);
    if (dlse.has_value()) check_rows_f32(*dlse, "dlse", q);
    CHECK_BWD(std::isfinite(scale), "scale must be finite");
    if (seqused_k.has_value()) {
        const at::Tensor& s = *seqused_k;
        CHECK_BWD(s.is_cuda() && s.device() == q.device(), "seqused_k must be on q's device");
        CHECK_BWD(s.scalar_type() == at::kInt && s.dim() == 1 && s.size(0) == batch && s.is_contiguous(),
                  "seqused_k must be a contiguous int32 tensor of shape (batch,)");
    }

    const c10::cuda::CUDAGuard guard(q.device());

    llm_attn::FlashBwdParams p{};
    set_shared_params(p, q, k, v, out, lse, seqused_k, scale, causal);
    p.dout = dout.data_ptr(), p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    p.dlse = dlse.has_value() ? dlse->data_ptr<float>() : nullptr;
    p.do_batch_stride = dout.stride(0), p.do_head_stride = dout.stride(1), p.do_row_stride = dout.stride(2);
    p.dq_batch_stride = dq.stride(0), p.dq_head_stride = dq.stride(1), p.dq_row_stride = dq.stride(2);
    p.dk_batch_stride = dk.stride(0), p.dk_head_stride = dk.stride(1), p.dk_row_stride = dk.stride(2);
    p.dv_batch_stride = dv.stride(0), p.dv_head_stride = dv.stride(1), p.dv_row_stride = dv.stride(2);
    CHECK_BWD(g_bwd_tile < llm_attn::kBwdHopper || g_bwd_tile > llm_attn::kBwdHopperSharedDq ||
                  llm_attn::flash_fwd_sm90_available(),
              "the Hopper backward was forced (force_bwd_tile('hopper')) but needs a compute capability 9.0 GPU and a "
              "build with sm_90a (LLM_ATTN_CUDA_ARCHS containing 9.0)");
    CHECK_BWD(!deterministic || g_bwd_tile < llm_attn::kBwdHopper || g_bwd_tile > llm_attn::kBwdHopperSharedDq,
              "deterministic=True, but the Hopper backward was forced (force_bwd_tile('hopper...')): its dQ is summed "
              "in no fixed order; force 'auto', 'portable', 'narrow' or 'portable_separate_dq'");
    p.deterministic = deterministic;
    llm_attn::flash_bwd_set_splits(p, at::cuda::getCurrentDeviceProperties()->multiProcessorCount, g_bwd_splits,
                                   g_bwd_tile);
    // Every float32 workspace in one allocation (each part on a 256-byte boundary), the accumulators zeroed by one
    // memset: dsum | lse_log2 | dq_accum (unless the separate dQ kernel runs) | dk_accum | dv_accum (split launches;
    // deterministic: one slab per split). One allocation and one memset node instead of five and three fill kernels:
    // an eager backward is host-bound below ~2k tokens (kernels/NOTES.md "The eager backward's host cost").
    const auto part = [](int64_t floats) { return (floats * 4 + 255) / 256 * 256; };
    const int64_t rows = batch * num_heads * seqlen_q;
    const int64_t slabs = p.num_splits > 1 ? (deterministic ? p.num_splits : 1) : 0;
    const int64_t dq_bytes = p.dq_separate ? 0 : part(rows * head_dim);
    const int64_t dkv_bytes = part(slabs * batch * num_kv_heads * seqlen_k * head_dim);
    const int64_t zeroed = dq_bytes + 2 * dkv_bytes;
    at::Tensor work = at::empty({2 * part(rows) + zeroed}, q.options().dtype(at::kByte));
    char* base = static_cast<char*>(work.data_ptr());
    p.dsum = reinterpret_cast<float*>(base);
    p.lse_log2 = reinterpret_cast<float*>(base + part(rows));
    char* acc = base + 2 * part(rows);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (zeroed > 0) {
        const cudaError_t zerr = cudaMemsetAsync(acc, 0, zeroed, stream);
        TORCH_CHECK(zerr == cudaSuccess, "llm_attn.mha_bwd: workspace memset failed: ", cudaGetErrorString(zerr));
    }
    if (!p.dq_separate) p.dq_accum = reinterpret_cast<float*>(acc);
    if (slabs > 0) {
        p.dk_accum = reinterpret_cast<float*>(acc + dq_bytes);
        p.dv_accum = reinterpret_cast<float*>(acc + dq_bytes + dkv_bytes);
    }
    const cudaError_t err = llm_attn::run_flash_bwd(p, stream);
    TORCH_CHECK(err == cudaSuccess, "llm_attn.mha_bwd: kernel launch failed: ", cudaGetErrorString(err));
}

// ---- Eager autograd in C++ (llm_attn.ops.flash_attn_func when gradients are wanted, eager, plain tensors) --------
// The torch.library op's autograd (llm_attn/backward.py) runs Python on both sides of a training step: the forward
// through the dispatcher's Autograd key, the generated autograd.Function and a redispatch; the backward in a Python
// node on the autograd engine's device thread, which has to take the GIL, then the checks, three gradient allocations
// and the crossing into mha_bwd. A short eager backward is host-bound (kernels/NOTES.md "The eager backward's host
// cost"), so this function does the same in C++: the same kernels, checks, saved tensors and gradients, a CppNode in
// the graph. The op path stays for torch.compile, modes, subclasses, the profiler and the NVRTC build.
// LLM_ATTN_BWD_DETERMINISTIC=1: every backward deterministic (read once, as llm_attn/backward.py reads it).
const bool g_bwd_deterministic_env = [] {
    const char* v = std::getenv("LLM_ATTN_BWD_DETERMINISTIC");
    return v != nullptr && std::strcmp(v, "1") == 0;
}();

struct FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
    // q, k, v as the kernels read them (the caller's _readable); returns (out, lse), both differentiable.
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                  const at::Tensor& k, const at::Tensor& v,
                                                  const std::optional<at::Tensor>& seqused_k, double scale,
                                                  bool causal, bool deterministic) {
        auto [out, lse] = mha_fwd_alloc(q, k, v, seqused_k, scale, causal);
        // An unused gradient (out's or lse's) reaches backward undefined: no zeros made for an lse nobody uses.
        ctx->set_materialize_grads(false);
        ctx->save_for_backward({q, k, v, out, lse, seqused_k.has_value() ? *seqused_k : at::Tensor()});
        ctx->saved_data["scale"] = scale;
        ctx->saved_data["causal"] = causal;
        ctx->saved_data["deterministic"] = deterministic;
        return {out, lse};
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        // The kernels' gradients are not differentiable themselves: say so rather than return gradients that a
        // second backward would silently treat as constants.
        TORCH_CHECK(!at::GradMode::is_enabled(),
                    "llm_attn: the attention backward ran with create_graph=True, but it is not differentiable "
                    "(no double backward); call backward without create_graph");
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
        std::optional<at::Tensor> seqused_k;
        if (saved[5].defined()) seqused_k = saved[5];
        at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
        dout = readable(dout);  // e.g. an expanded gradient (stride 0 in head_dim)
        std::optional<at::Tensor> dlse;
        if (grads[1].defined()) dlse = grads[1].to(at::kFloat).contiguous();
        const bool deterministic = ctx->saved_data["deterministic"].toBool() || g_bwd_deterministic_env ||
                                   at::globalContext().deterministicAlgorithms();
        at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
        // Gradients laid out like their inputs; where the kernel cannot write that layout, into a buffer it can.
        at::Tensor wq = kernel_ready(dq) ? dq : at::empty(q.sizes(), q.options());
        at::Tensor wk = kernel_ready(dk) ? dk : at::empty(k.sizes(), k.options());
        at::Tensor wv = kernel_ready(dv) ? dv : at::empty(v.sizes(), v.options());
        mha_bwd(dout, q, k, v, out, lse, dlse, wq, wk, wv, seqused_k, ctx->saved_data["scale"].toDouble(),
                ctx->saved_data["causal"].toBool(), deterministic);
        if (!wq.is_same(dq)) dq.copy_(wq);
        if (!wk.is_same(dk)) dk.copy_(wk);
        if (!wv.is_same(dv)) dv.copy_(wv);
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

std::tuple<at::Tensor, at::Tensor> mha_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& seqused_k, double scale,
                                                    bool causal, bool deterministic) {
    // A copy readable() makes is recorded by autograd (grad mode is on here), so gradients reach the caller's tensors.
    auto r = FlashAttnFunction::apply(readable(q), readable(k), readable(v), seqused_k, scale, causal, deterministic);
    return {r[0], r[1]};
}

// ---- Decode tuning overrides (llm_attn.ops.force_decode, experiments/decode_splits.py) ----------------------------
// Force the decode kernel's KV split count (0 = automatic; clamped to the 64-key tiles) or its DecodeConfigId
// (0 = automatic, kernels/kernel_tiles.h); each returns the previous value, or -1 (nothing changed) when out of range.
// mha_fwd sizes the split workspace from flash_fwd_num_splits, which reads the forced count.
int64_t set_decode_splits(int64_t splits) {
    if (splits < 0 || splits > 4096) return -1;
    return llm_attn::flash_decode_force_splits(static_cast<int>(splits));
}

int64_t set_decode_config(int64_t config) {
    if (config < 0 || config > 1000) return -1;
    return llm_attn::flash_decode_force_config(static_cast<int>(config));  // -1 for an unknown id
}


// ---- Decode over the FP8 KV cache (kernels/flash_decode_fp8kv.h; llm_attn.ops.decode_fp8_kv) -----------------------
// Up to kDecodeMaxRows packed rows ((query heads per KV head) x q_len) the split-KV decode kernel, above them the
// prefill kernel (chunked prefill over the cache; never split). q (B, Hq, Sq, D) fp16/bf16; k_data, v_data (B, Hkv, S, D) e4m3 bytes (float8_e4m3fn or uint8), S the cached tokens
// (a view of the cache's first S slots); k_scale, v_scale float32 (B, Hkv, >= ceil(S / 64)), one scale per 64-token
// block. Returns (out (B, Hq, Sq, D) in (B, Sq, Hq, D) memory order, lse (B, Hq, Sq) float32, natural log, without
// the k_shift term). Every check is one TORCH_CHECK line; nothing here synchronises.
#define CHECK_FP8KV(cond, ...) TORCH_CHECK(cond, "llm_attn.mha_decode_fp8kv: ", __VA_ARGS__)

void check_fp8kv_data(const at::Tensor& t, const char* name, const at::Tensor& q) {
    CHECK_FP8KV(t.is_cuda() && t.device() == q.device(), name, " must be a CUDA tensor on q's device");
    CHECK_FP8KV(t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kByte, name,
                " must be float8_e4m3fn (or its uint8 bits), got ", t.scalar_type());
    CHECK_FP8KV(t.dim() == 4, name, " must be 4-D (batch, kv_heads, tokens, head_dim), got ", num(t.dim()), "-D");
    CHECK_FP8KV(t.stride(3) == 1, name, " must be contiguous in head_dim");
    for (int d = 0; d < 3; ++d) {
        CHECK_FP8KV(t.stride(d) % 16 == 0 || t.size(d) == 1, name, " strides must be multiples of 16 bytes, got ",
                    shape(t.strides()));
    }
    CHECK_FP8KV(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

void check_fp8kv_scale(const at::Tensor& t, const char* name, const at::Tensor& data, const at::Tensor& q) {
    const int64_t blocks = (data.size(2) + 63) / 64;
    CHECK_FP8KV(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.dim() == 3 &&
                    t.size(0) == data.size(0) && t.size(1) == data.size(1) && t.size(2) >= blocks && t.stride(2) == 1,
                name, " must be float32 (batch, kv_heads, >= ", num(blocks), " blocks) on q's device with adjacent "
                "blocks, got ", t.scalar_type(), " ", shape(t.sizes()));
}

std::tuple<at::Tensor, at::Tensor> mha_decode_fp8kv(const at::Tensor& q, const at::Tensor& k_data,
                                                    const at::Tensor& v_data, const at::Tensor& k_scale,
                                                    const at::Tensor& v_scale,
                                                    const std::optional<at::Tensor>& seqused_k, double scale,
                                                    bool causal) {
    CHECK_FP8KV(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "q must be float16 or bfloat16, got ", q.scalar_type());
    CHECK_FP8KV(q.is_cuda() && q.dim() == 4, "q must be a 4-D CUDA tensor (batch, heads, q_len, head_dim)");
    CHECK_FP8KV(q.stride(3) == 1, "q must be contiguous in head_dim");
    for (int d = 0; d < 3; ++d) {
        CHECK_FP8KV(q.stride(d) % 8 == 0 || q.size(d) == 1, "q strides must be multiples of 8 elements, got ",
                    shape(q.strides()));
    }
    CHECK_FP8KV(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0, "q must be 16-byte aligned");
    check_fp8kv_data(k_data, "k_data", q);
    check_fp8kv_data(v_data, "v_data", q);
    const int64_t batch = q.size(0), num_heads = q.size(1), seqlen_q = q.size(2), head_dim = q.size(3);
    const int64_t num_kv_heads = k_data.size(1), seqlen_k = k_data.size(2);
    CHECK_FP8KV(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", num(head_dim));
    CHECK_FP8KV(k_data.sizes() == v_data.sizes(), "k_data ", shape(k_data.sizes()), " and v_data ",
                shape(v_data.sizes()), " must have the same shape");
    CHECK_FP8KV(k_data.size(0) == batch && k_data.size(3) == head_dim, "k_data/v_data ", shape(k_data.sizes()),
                " do not match q ", shape(q.sizes()));
    CHECK_FP8KV(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query heads (", num(num_heads),
                ") must be a multiple of kv heads (", num(num_kv_heads), ")");
    CHECK_FP8KV(batch > 0 && num_heads > 0 && seqlen_q > 0 && seqlen_k > 0, "empty input: q ", shape(q.sizes()),
                ", k_data ", shape(k_data.sizes()));
    CHECK_FP8KV(num_heads / num_kv_heads * seqlen_q < (1 << 30), "(query heads per kv head) x q_len must be below ",
                "2^30, got ", num(num_heads / num_kv_heads * seqlen_q));
    CHECK_FP8KV(seqlen_k < (1 << 30), "sequence too long");
    CHECK_FP8KV(num_kv_heads <= 65535 && batch <= 65535, "at most 65535 kv heads and batch 65535");
    check_fp8kv_scale(k_scale, "k_scale", k_data, q);
    check_fp8kv_scale(v_scale, "v_scale", v_data, q);
    CHECK_FP8KV(std::isfinite(scale) && scale >= 0, "scale must be finite and >= 0, got ", num(scale));
    if (seqused_k.has_value()) {
        const at::Tensor& s = *seqused_k;
        CHECK_FP8KV(s.is_cuda() && s.device() == q.device() && s.scalar_type() == at::kInt && s.dim() == 1 &&
                        s.size(0) == batch && s.is_contiguous(),
                    "seqused_k must be a contiguous int32 tensor of shape (batch,) on q's device");
    }

    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor out = at::empty({batch, seqlen_q, num_heads, head_dim}, q.options()).transpose(1, 2);
    at::Tensor lse = at::empty({batch, num_heads, seqlen_q}, q.options().dtype(at::kFloat));
    llm_attn::FlashDecodeFp8KvParams fp{};
    llm_attn::FlashFwdParams& p = fp.base;
    set_shared_params(p, q, k_data, v_data, out, lse, seqused_k, scale, causal);  // k/v strides: bytes = elements
    p.tile = llm_attn::kTileAuto;
    fp.k_scale = k_scale.data_ptr<float>(), fp.v_scale = v_scale.data_ptr<float>();
    fp.ks_batch_stride = k_scale.stride(0), fp.ks_head_stride = k_scale.stride(1);
    fp.vs_batch_stride = v_scale.stride(0), fp.vs_head_stride = v_scale.stride(1);
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    p.num_splits = llm_attn::flash_decode_fp8kv_num_splits(fp, props->multiProcessorCount,
                                                           static_cast<int>(props->sharedMemPerBlockOptin));
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    at::Tensor workspace;
    if (p.num_splits > 1) {  // as launch_fwd: float32 partials from torch's allocator, counters from the pool
        const int64_t rows = static_cast<int64_t>(p.num_splits) * p.batch * p.num_heads * p.seqlen_q;
        const int64_t n_counters = static_cast<int64_t>(p.batch) * p.num_kv_heads;
        int* pooled = pooled_counters(q.get_device(), stream, n_counters);
        workspace = at::empty({rows * (p.head_dim + 1) + (pooled ? 0 : n_counters)}, q.options().dtype(at::kFloat));
        p.o_accum = workspace.data_ptr<float>();
        p.lse_accum = p.o_accum + rows * p.head_dim;
        if (pooled) {
            p.split_counters = pooled;
        } else {
            p.split_counters = reinterpret_cast<int*>(p.lse_accum + rows);
            const cudaError_t err = cudaMemsetAsync(p.split_counters, 0, n_counters * sizeof(int), stream);
            CHECK_FP8KV(err == cudaSuccess, "zeroing the split counters failed: ", cudaGetErrorString(err));
        }
    }
    const cudaError_t err = llm_attn::run_flash_decode_fp8kv(fp, stream);
    CHECK_FP8KV(err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
    return {out, lse};
}
#undef CHECK_FP8KV

// ---- The FP8 cache's one-token append (kernels/fp8_cache_append.h; Fp8StaticLayer(device_position=True)) ------------
// k_new, v_new (B, Hkv, 1, D) fp16/bf16; k_open, v_open float32 (B, Hkv, 64, D); k_shift float32 (B, Hkv, D);
// k_data, v_data e4m3 (B, Hkv, C, D), C a multiple of 64; k_scale, v_scale float32 (B, Hkv, C / 64); position int64
// (one element); used int32 (B,). All contiguous but k_new / v_new (head_dim contiguous). Writes in place, reads the
// position on the device: CUDA-graph capturable.
#define CHECK_APPEND(cond, ...) TORCH_CHECK(cond, "llm_attn.fp8_cache_append: ", __VA_ARGS__)

void fp8_cache_append(const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& k_open,
                      const at::Tensor& v_open, const at::Tensor& k_shift, const at::Tensor& k_data,
                      const at::Tensor& v_data, const at::Tensor& k_scale, const at::Tensor& v_scale,
                      const at::Tensor& position, const at::Tensor& used, int64_t max_cache_len) {
    CHECK_APPEND(k_data.is_cuda() && k_data.dim() == 4, "k_data must be a 4-D CUDA tensor (batch, kv_heads, capacity, "
                 "head_dim)");
    const int64_t b = k_data.size(0), h = k_data.size(1), c = k_data.size(2), d = k_data.size(3);
    CHECK_APPEND(d == 64 || d == 128, "head_dim must be 64 or 128, got ", num(d));
    CHECK_APPEND(c > 0 && c % 64 == 0, "the capacity must be a positive multiple of 64 tokens, got ", num(c));
    CHECK_APPEND(max_cache_len > 0 && max_cache_len <= c, "max_cache_len must be in [1, ", num(c), "], got ",
                 num(max_cache_len));
    auto same = [&](const at::Tensor& t, const char* name, at::ScalarType dt, std::vector<int64_t> sizes) {
        CHECK_APPEND(t.device() == k_data.device(), name, " must be on k_data's device");
        CHECK_APPEND(t.scalar_type() == dt, name, " must be ", dt, ", got ", t.scalar_type());
        CHECK_APPEND(t.sizes() == at::IntArrayRef(sizes), name, " must be ", shape(at::IntArrayRef(sizes)), ", got ",
                     shape(t.sizes()));
        CHECK_APPEND(t.is_contiguous(), name, " must be contiguous");
    };
    const auto e4m3 = k_data.scalar_type() == at::kByte ? at::kByte : at::kFloat8_e4m3fn;
    same(k_data, "k_data", e4m3, {b, h, c, d});
    same(v_data, "v_data", e4m3, {b, h, c, d});
    same(k_open, "k_open", at::kFloat, {b, h, 64, d});
    same(v_open, "v_open", at::kFloat, {b, h, 64, d});
    same(k_shift, "k_shift", at::kFloat, {b, h, d});
    same(k_scale, "k_scale", at::kFloat, {b, h, c / 64});
    same(v_scale, "v_scale", at::kFloat, {b, h, c / 64});
    CHECK_APPEND(position.device() == k_data.device() && position.scalar_type() == at::kLong &&
                 position.numel() == 1, "position must be one int64 on k_data's device");
    same(used, "used", at::kInt, {b});
    for (const auto* t : {&k_new, &v_new}) {
        const char* name = t == &k_new ? "k_new" : "v_new";
        CHECK_APPEND(t->device() == k_data.device(), name, " must be on k_data's device");
        CHECK_APPEND(t->scalar_type() == at::kHalf || t->scalar_type() == at::kBFloat16, name,
                     " must be float16 or bfloat16, got ", t->scalar_type());
        CHECK_APPEND(t->sizes() == at::IntArrayRef({b, h, 1, d}) && t->stride(3) == 1, name, " must be ",
                     shape(at::IntArrayRef({b, h, 1, d})), " contiguous in head_dim, got ", shape(t->sizes()));
    }
    CHECK_APPEND(v_new.scalar_type() == k_new.scalar_type(), "k_new and v_new must have one dtype");

    const c10::cuda::CUDAGuard guard(k_data.device());
    llm_attn::Fp8CacheAppendParams p{};
    p.k_new = k_new.data_ptr();
    p.v_new = v_new.data_ptr();
    p.kn_batch_stride = k_new.stride(0), p.kn_head_stride = k_new.stride(1);
    p.vn_batch_stride = v_new.stride(0), p.vn_head_stride = v_new.stride(1);
    p.k_open = k_open.data_ptr<float>(), p.v_open = v_open.data_ptr<float>(), p.k_shift = k_shift.data_ptr<float>();
    p.k_data = static_cast<uint8_t*>(k_data.data_ptr()), p.v_data = static_cast<uint8_t*>(v_data.data_ptr());
    p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
    p.position = position.data_ptr<int64_t>();
    p.used = used.data_ptr<int32_t>();
    p.batch = static_cast<int>(b), p.kv_heads = static_cast<int>(h), p.head_dim = static_cast<int>(d);
    p.capacity = static_cast<int>(c), p.max_cache_len = static_cast<int>(max_cache_len);
    p.is_bf16 = k_new.scalar_type() == at::kBFloat16;
    const cudaError_t err = llm_attn::run_fp8_cache_append(p, at::cuda::getCurrentCUDAStream());
    CHECK_APPEND(err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
}
#undef CHECK_APPEND

// ---- The FP8 cache's dequantised copy (kernels/fp8_cache_dequant.h) -------------------------------------------------
// k_data, v_data e4m3 (B, Hkv, C, D); k_scale, v_scale float32 (B, Hkv, NB), NB * 64 >= n; k_shift float32 (B, Hkv, D)
// or None; k_out, v_out (B, Hkv, n, D) fp16/bf16. All contiguous. Writes k_out and v_out whole.
#define CHECK_DEQUANT(cond, ...) TORCH_CHECK(cond, "llm_attn.fp8_cache_dequant: ", __VA_ARGS__)

void fp8_cache_dequant(const at::Tensor& k_data, const at::Tensor& v_data, const at::Tensor& k_scale,
                       const at::Tensor& v_scale, const std::optional<at::Tensor>& k_shift, const at::Tensor& k_out,
                       const at::Tensor& v_out) {
    CHECK_DEQUANT(k_data.is_cuda() && k_data.dim() == 4, "k_data must be a 4-D CUDA tensor (batch, kv_heads, "
                  "capacity, head_dim)");
    const int64_t b = k_data.size(0), h = k_data.size(1), c = k_data.size(2), d = k_data.size(3);
    CHECK_DEQUANT(d == 64 || d == 128, "head_dim must be 64 or 128, got ", num(d));
    CHECK_DEQUANT(b > 0 && h > 0 && b * h <= 65535, "batch x kv_heads must be in [1, 65535], got ", num(b * h));
    CHECK_DEQUANT(k_out.dim() == 4, "k_out must be 4-D (batch, kv_heads, n, head_dim)");
    const int64_t n = k_out.size(2), nb = k_scale.dim() == 3 ? k_scale.size(2) : -1;
    CHECK_DEQUANT(n <= c, "k_out has ", num(n), " tokens, more than the cache's capacity ", num(c));
    CHECK_DEQUANT(nb * 64 >= n, "k_scale must be (batch, kv_heads, >= ceil(n / 64)) float32, got ",
                  shape(k_scale.sizes()));
    auto same = [&](const at::Tensor& t, const char* name, std::vector<at::ScalarType> dts, std::vector<int64_t> sizes) {
        CHECK_DEQUANT(t.device() == k_data.device(), name, " must be on k_data's device");
        CHECK_DEQUANT(std::find(dts.begin(), dts.end(), t.scalar_type()) != dts.end(), name, " has dtype ",
                      t.scalar_type(), ", not one this kernel takes");
        CHECK_DEQUANT(t.sizes() == at::IntArrayRef(sizes), name, " must be ", shape(at::IntArrayRef(sizes)), ", got ",
                      shape(t.sizes()));
        CHECK_DEQUANT(t.is_contiguous(), name, " must be contiguous");
        CHECK_DEQUANT(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
    };
    same(k_data, "k_data", {at::kFloat8_e4m3fn, at::kByte}, {b, h, c, d});
    same(v_data, "v_data", {k_data.scalar_type()}, {b, h, c, d});
    same(k_scale, "k_scale", {at::kFloat}, {b, h, nb});
    same(v_scale, "v_scale", {at::kFloat}, {b, h, nb});
    if (k_shift) same(*k_shift, "k_shift", {at::kFloat}, {b, h, d});
    same(k_out, "k_out", {at::kHalf, at::kBFloat16}, {b, h, n, d});
    same(v_out, "v_out", {k_out.scalar_type()}, {b, h, n, d});

    const c10::cuda::CUDAGuard guard(k_data.device());
    llm_attn::Fp8CacheDequantParams p{};
    p.k_data = static_cast<const uint8_t*>(k_data.data_ptr()), p.v_data = static_cast<const uint8_t*>(v_data.data_ptr());
    p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
    p.k_shift = k_shift ? k_shift->data_ptr<float>() : nullptr;
    p.k_out = k_out.data_ptr(), p.v_out = v_out.data_ptr();
    p.batch = static_cast<int>(b), p.kv_heads = static_cast<int>(h), p.head_dim = static_cast<int>(d);
    p.capacity = static_cast<int>(c), p.scale_blocks = static_cast<int>(nb), p.n = static_cast<int>(n);
    p.is_bf16 = k_out.scalar_type() == at::kBFloat16;
    const cudaError_t err = llm_attn::run_fp8_cache_dequant(p, at::cuda::getCurrentCUDAStream());
    CHECK_DEQUANT(err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
}
#undef CHECK_DEQUANT

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "llm_attn CUDA kernels (FlashAttention-2 forward, Hopper wgmma/TMA forward, split-KV decode)";
    m.def("mha_fwd", &mha_fwd, "FlashAttention forward into preallocated out/lse", py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("seqused_k"), py::arg("scale"), py::arg("causal"));
    m.def("mha_fwd_alloc", &mha_fwd_alloc, "FlashAttention forward; returns (out, lse) allocated here",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("seqused_k"), py::arg("scale"), py::arg("causal"));
    m.def("num_splits", &num_splits, "KV splits the forward would use for these shapes (1 = none)");
    m.def("set_tile", &set_tile, "Force the prefill tile (0 auto, 1 large, 2 wide, 3 small, 4 hopper); returns the previous");
    m.def("mha_fwd_fp8", &mha_fwd_fp8, "FP8 (e4m3) attention forward, quantisation included; returns (out, lse)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("seqused_k"), py::arg("scale"), py::arg("causal"),
          py::arg("block_n") = 0, py::arg("qk") = "", py::arg("pv") = "");
    m.def("fp8_qk", [](const std::string& qk) { return fp8_qk_code(qk) == llm_attn::kFp8QkInt8 ? "int8" : "e4m3"; },
          "The operands of Q K^T an FP8 call with this qk runs ('' = the default: LLM_ATTN_FP8_QK, else int8)",
          py::arg("qk") = "");
    m.def("fp8_block_n", [](int64_t head_dim, int64_t block_n, const std::string& pv, const std::string& qk) {
        return llm_attn::flash_fwd_fp8_block_n(static_cast<int>(head_dim), static_cast<int>(block_n), fp8_pv_code(pv),
                                               fp8_qk_code(qk));
    }, "The FP8 key tile a call with this head_dim, block_n, pv and qk runs (0 = the default), 0 if not built",
          py::arg("head_dim"), py::arg("block_n") = 0, py::arg("pv") = "", py::arg("qk") = "");
    m.def("mha_fwd_int8", &mha_fwd_int8, "INT8 attention forward, quantisation included; returns (out, lse)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("seqused_k"), py::arg("scale"), py::arg("causal"));
    m.def("int8_available", [] {
        int dev = 0, major = 0;
        return cudaGetDevice(&dev) == cudaSuccess &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
               (major == 8 || major == 9);
    }, "Whether the current device runs the INT8 forward of this build");
    m.def("int8_pv_fp8", [] { return llm_attn::flash_fwd_int8_fp8_pv_available(); },
          "Whether the INT8 forward multiplies P V in e4m3 on this device (sm_89)");
    m.def("fp8_available", [] { return llm_attn::flash_fwd_fp8_available(); },
          "Whether the current device runs the FP8 (sm_90a) forward of this build");
    m.def("sm90_available", [] { return llm_attn::flash_fwd_sm90_available(); },
          "Whether the current device runs the Hopper (sm_90a) prefill kernel of this build");
    m.def("mha_bwd", &mha_bwd, "FlashAttention backward into preallocated dq/dk/dv", py::arg("dout"), py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dlse"), py::arg("dq"), py::arg("dk"),
          py::arg("dv"), py::arg("seqused_k"), py::arg("scale"), py::arg("causal"), py::arg("deterministic") = false);
    m.def("mha_fwd_autograd", &mha_fwd_autograd,
          "FlashAttention forward whose backward (mha_bwd's kernels) is a C++ autograd node; returns (out, lse)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("seqused_k"), py::arg("scale"), py::arg("causal"),
          py::arg("deterministic") = false);
    m.def("set_bwd_splits", &set_bwd_splits, "Force the backward's key-block split (0 auto); returns the previous");
    m.def("set_bwd_tile", &set_bwd_tile, "Force the backward's dK/dV kernel (a BwdTileId, 0 auto); returns the previous");
    m.def("bwd_splits", &bwd_splits, "(num_splits, iters_per_split) of the backward for these shapes");
    m.def("set_decode_splits", &set_decode_splits, "Force the decode kernel's KV splits (0 auto); returns the previous");
    m.def("set_decode_config", &set_decode_config,
          "Force the decode kernel's DecodeConfigId (0 auto, kernel_tiles.h); returns the previous");
    m.def("set_decode_counter_pool", &set_decode_counter_pool,
          "Tests: use the decode counter pool (True) or zero counters per call (False); returns the previous");
    m.def("decode_counter_pool_state", &decode_counter_pool_state,
          "Tests: (ints handed out, their values) of the current device's decode counter pool");
    m.def("fp8_cache_append", &fp8_cache_append,
          "The FP8 cache's one-token append at the device-side position (Fp8StaticLayer device_position), in place",
          py::arg("k_new"), py::arg("v_new"), py::arg("k_open"), py::arg("v_open"), py::arg("k_shift"),
          py::arg("k_data"), py::arg("v_data"), py::arg("k_scale"), py::arg("v_scale"), py::arg("position"),
          py::arg("used"), py::arg("max_cache_len"));
    m.def("fp8_cache_dequant", &fp8_cache_dequant,
          "The FP8 cache's dequantised copy of tokens [0, n) into k_out / v_out (n = their length), one launch",
          py::arg("k_data"), py::arg("v_data"), py::arg("k_scale"), py::arg("v_scale"), py::arg("k_shift"),
          py::arg("k_out"), py::arg("v_out"));
    m.def("mha_decode_fp8kv", &mha_decode_fp8kv,
          "Decode attention over the FP8 (e4m3) KV cache, dequantised in registers; returns (out, lse without k_shift)",
          py::arg("q"), py::arg("k_data"), py::arg("v_data"), py::arg("k_scale"), py::arg("v_scale"),
          py::arg("seqused_k"), py::arg("scale"), py::arg("causal"));
    m.def("decode_fp8kv_max_rows", [] { return static_cast<int64_t>(llm_attn::kDecodeMaxRows); },
          "Largest (query heads per KV head) x q_len the FP8-cache decode kernel takes");
    m.def("fp8kv_prefill", [] { return true; },
          "Whether mha_decode_fp8kv takes more rows than decode_fp8kv_max_rows (the prefill kernel over the FP8 cache)");
}

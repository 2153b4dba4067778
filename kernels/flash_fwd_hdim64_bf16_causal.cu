// Instantiation: head_dim 64, bf16, causal. One file per combination keeps nvcc builds parallel.
#include "flash_fwd_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_fwd_<__nv_bfloat16, 64, true>(FlashFwdParams& params, cudaStream_t stream);
}  // namespace llm_attn

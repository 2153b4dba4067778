// Instantiation: head_dim 64, fp16, noncausal. One file per combination keeps nvcc builds parallel.
#include "flash_fwd_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_fwd_<half, 64, false>(FlashFwdParams& params, cudaStream_t stream);
}  // namespace llm_attn

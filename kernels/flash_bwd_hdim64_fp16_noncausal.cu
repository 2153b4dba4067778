// Instantiation: backward, head_dim 64, fp16, noncausal. One file per combination keeps nvcc builds parallel.
#include "flash_bwd_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_bwd_<half, 64, false>(FlashBwdParams& params, cudaStream_t stream);
}  // namespace llm_attn

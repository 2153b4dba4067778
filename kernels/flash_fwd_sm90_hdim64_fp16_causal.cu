// Instantiation: Hopper (sm_90a) forward, head_dim 64, fp16, causal.
#include "flash_fwd_sm90_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_fwd_sm90_<half, 64, true>(FlashFwdParams& params, cudaStream_t stream);
template bool flash_fwd_sm90_built_<half, 64, true>();
}  // namespace llm_attn

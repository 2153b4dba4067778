// FP8 Hopper forward: head_dim 64, fp16 inputs, causal. Written by hand beside generate_kernels.py's files (one per
// instantiation keeps builds parallel).
#include "flash_fwd_fp8_sm90_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_fwd_fp8_<half, 64, true>(FlashFwdFp8Params&, cudaStream_t);
template bool flash_fwd_fp8_built_<half, 64>();
}  // namespace llm_attn

// FP8 Hopper forward: head_dim 64, bf16 inputs, noncausal. Written by hand beside generate_kernels.py's files (one per
// instantiation keeps builds parallel).
#include "flash_fwd_fp8_sm90_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_fwd_fp8_<__nv_bfloat16, 64, false>(FlashFwdFp8Params&, cudaStream_t);
}  // namespace llm_attn

// FP8 Hopper forward: head_dim 64, fp16 inputs, noncausal. Written by hand beside generate_kernels.py's files (one per
// instantiation keeps builds parallel).
#include "flash_fwd_fp8_sm90_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_fwd_fp8_<half, 64, false>(FlashFwdFp8Params&, cudaStream_t);
}  // namespace llm_attn

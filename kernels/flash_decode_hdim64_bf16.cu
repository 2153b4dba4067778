// Instantiation: split-KV decode kernel, head_dim 64, bf16.
#include "flash_decode_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_decode_<__nv_bfloat16, 64>(FlashFwdParams& params, cudaStream_t stream);
}  // namespace llm_attn

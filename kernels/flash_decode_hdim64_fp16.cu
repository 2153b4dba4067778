// Instantiation: split-KV decode kernel, head_dim 64, fp16.
#include "flash_decode_launch.cuh"

namespace llm_attn {
template cudaError_t run_flash_decode_<half, 64>(FlashFwdParams& params, cudaStream_t stream);
}  // namespace llm_attn

"""Built-in attention implementations, one small module each; each registers its entries with
``llm_attn.registry.register_attention`` on import (the registry imports them on first use).

- ``stock``        — transformers' own ``eager``, ``sdpa`` and ``flash_attention_2``;
- ``flash_kernel`` — ``llm_attn``: this project's CUDA kernel (the PyTorch reference on CPU);
- ``low_precision`` — ``llm_attn_fp8`` (FP8 prefill, Hopper; ``llm_attn_fp8_e4m3``, ``llm_attn_int8qk`` its variants)
  and ``llm_attn_int8`` (INT8 Q K^T, sm_80-90): low precision;
- ``naive``        — materialised softmax(QKᵀ)V in the input dtype, the seeds' O(N²)-memory baseline;
- ``flex``         — PyTorch ``flex_attention`` under ``torch.compile`` with a causal block mask;
- ``numba_fa2``    — ``numba``: a FlashAttention-2 forward written in numba-cuda (scalar, no tensor cores).

A new kernel needs one new module here (or a plugin file outside the repository: see ``examples/``).
"""

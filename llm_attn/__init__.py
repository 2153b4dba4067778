"""llm-attn: a from-scratch FlashAttention CUDA kernel, a patch registry that swaps it into Hugging Face LLMs, and
a harness that measures what it does to time-to-first-token and decode speed.

Importing this package never needs the compiled extension; the CUDA kernel is loaded on first use.
"""

from llm_attn._ext import KernelNotBuiltError, kernel_available
from llm_attn.ops import flash_attn_func
from llm_attn.reference import attention_naive, attention_tiled

__version__ = "0.1.0"

__all__ = [
    "KernelNotBuiltError",
    "attention_naive",
    "attention_tiled",
    "flash_attn_func",
    "kernel_available",
]

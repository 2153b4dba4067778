"""llm-attn: a from-scratch FlashAttention CUDA kernel, a patch registry that swaps it — or any attention kernel
registered with ``register_attention`` — into Hugging Face LLMs, and a harness that measures what it does to
time-to-first-token and decode speed.

Importing this package never needs the compiled extension; the CUDA kernel is loaded on first use.
"""

from llm_attn._ext import KernelNotBuiltError, kernel_available, kernel_backend, kernel_build
from llm_attn._version import __version__  # noqa: F401
from llm_attn.ops import flash_attn_func
from llm_attn.reference import attention_naive, attention_tiled
from llm_attn.registry import AttentionImpl, load_plugin, register_attention

_PATCH_API = ("patch_model", "unpatch_model", "patched")


def __getattr__(name):
    # llm_attn.patch_model & co. without importing transformers on `import llm_attn`.
    if name in _PATCH_API:
        from llm_attn import patches

        return getattr(patches, name)
    raise AttributeError(f"module 'llm_attn' has no attribute {name!r}")

__all__ = [
    "AttentionImpl",
    "KernelNotBuiltError",
    "attention_naive",
    "attention_tiled",
    "flash_attn_func",
    "kernel_available",
    "load_plugin",
    "kernel_backend",
    "kernel_build",
    "patch_model",
    "patched",
    "register_attention",
    "unpatch_model",
]

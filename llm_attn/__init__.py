"""llm-attn: a from-scratch FlashAttention CUDA kernel, a patch registry that swaps it — or any attention kernel
registered with ``register_attention`` — into Hugging Face LLMs, and a harness that measures what it does to
time-to-first-token and decode speed.

Importing this package never needs the compiled extension; the CUDA kernel is loaded on first use.
"""

from llm_attn._version import __version__  # noqa: F401

# Public name -> the module that defines it. Imported on first access (PEP 562), so that `import llm_attn` and
# `python -m llm_attn.<cli>` do not import torch before the command line is parsed (fast --help, and a Ctrl-C in
# the first second is handled by the CLI, not a traceback from the middle of an import).
_LAZY = {
    "KernelNotBuiltError": "llm_attn._ext",
    "kernel_available": "llm_attn._ext",
    "kernel_backend": "llm_attn._ext",
    "kernel_build": "llm_attn._ext",
    "flash_attn_func": "llm_attn.ops",
    "attention_naive": "llm_attn.reference",
    "attention_tiled": "llm_attn.reference",
    "AttentionImpl": "llm_attn.registry",
    "load_plugin": "llm_attn.registry",
    "register_attention": "llm_attn.registry",
    # llm_attn.patch_model & co. without importing transformers on `import llm_attn`.
    "patch_model": "llm_attn.patches",
    "unpatch_model": "llm_attn.patches",
    "patched": "llm_attn.patches",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llm_attn' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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

"""Loads the compiled CUDA extension ``llm_attn._C`` and explains how to build it when it is missing."""

from __future__ import annotations

import functools

BUILD_HELP = (
    "The llm_attn CUDA extension (llm_attn._C) is not built. It needs a CUDA build of PyTorch and nvcc at install "
    "time. Build it with:\n"
    "    pip install --no-build-isolation -e .          # or: python setup.py build_ext --inplace\n"
    "Choose the GPU architectures with LLM_ATTN_CUDA_ARCHS, e.g. LLM_ATTN_CUDA_ARCHS=8.9 for an RTX 4060 Ti, 8.7 "
    "for Jetson Orin, 9.0 for H100 (default: 8.0;8.6;8.7;8.9;9.0). See README.md, 'Building the kernel'. "
    "Without the extension, flash_attn_func(..., backend='reference') runs the pure-PyTorch path."
)


class KernelNotBuiltError(RuntimeError):
    """Raised when the CUDA kernel is requested but the extension was not compiled."""


@functools.lru_cache(maxsize=1)
def _load():
    try:
        from llm_attn import _C  # noqa: PLC0415  (import on first use keeps `import llm_attn` build-free)
    except ImportError as e:  # not built, or built against another torch
        return None, str(e)
    return _C, None


def kernel_available() -> bool:
    """True when the compiled extension imports."""
    return _load()[0] is not None


def get_ext():
    """The extension module, or a KernelNotBuiltError that says how to build it."""
    ext, err = _load()
    if ext is None:
        raise KernelNotBuiltError(f"{BUILD_HELP}\n(import error: {err})")
    return ext

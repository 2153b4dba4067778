"""Chooses the kernel build: the compiled extension ``llm_attn._C`` ("aot") when it imports, otherwise the
runtime-compiled NVRTC launcher ("nvrtc", ``llm_attn._nvrtc``); ``LLM_ATTN_BUILD=aot|nvrtc`` (or its older name
``LLM_ATTN_BACKEND``) forces one. Both expose the same functions (``mha_fwd``, ``num_splits``, ``set_tile``), so the
op does not care which runs. Words: the *build* is how the kernel was compiled (this module); the *path* is whether
the kernel or the reference runs (``flash_attn_func(path=...)``); a *variant* is what the registry counts.
"""

from __future__ import annotations

import functools
import os

BUILDS = ("aot", "nvrtc")
BACKENDS = BUILDS  # the old name

BUILD_HELP = (
    "The llm_attn CUDA kernel is not available. Either backend works:\n"
    "  - runtime-compiled (no build step): python -m pip install 'llm-attn[nvrtc]' (CUDA 13 torch) or "
    "'llm-attn[nvrtc-cu12]' "
    "(CUDA 12 torch); the kernel is compiled with NVRTC for your GPU at first use;\n"
    "  - compiled at install (needs nvcc): python -m pip install --no-build-isolation -e .   "
    "(or: python setup.py build_ext "
    "--inplace), with LLM_ATTN_CUDA_ARCHS e.g. 8.9 for an RTX 4060 Ti, 8.7 for Jetson Orin, 9.0 for H100 "
    "(default: the visible GPU's, else 8.0;8.6;8.7;8.9;9.0).\n"
    "See README.md, 'Building the kernel'. Without either, flash_attn_func(..., path='reference') runs the "
    "pure-PyTorch path."
)


class KernelNotBuiltError(RuntimeError):
    """Raised when the CUDA kernel is requested but no backend can run it."""


@functools.lru_cache(maxsize=1)
def _load_aot():
    try:
        # torch first: the extension links against libtorch/libc10, which only `import torch` loads (since
        # `import llm_attn` is lazy, nothing else guarantees torch is in the process when this runs).
        import torch  # noqa: F401, PLC0415

        from llm_attn import _C  # noqa: PLC0415  (import on first use keeps `import llm_attn` build-free)
    except ImportError as e:  # not built, or built against another torch
        return None, str(e)
    return _C, None


def _load(name: str):
    """(module, None) or (None, why not) for backend `name`."""
    if name == "aot":
        return _load_aot()
    from llm_attn import _nvrtc  # noqa: PLC0415

    reason = _nvrtc.unavailable_reason()
    return (None, reason) if reason else (_nvrtc, None)


_forced: str | None = None  # set_backend(); the environment variable otherwise


def _requested() -> str:
    var = "LLM_ATTN_BUILD" if os.environ.get("LLM_ATTN_BUILD", "").strip() else "LLM_ATTN_BACKEND"
    name = _forced or os.environ.get(var, "").strip().lower() or "auto"
    if name not in ("auto", *BUILDS):
        raise ValueError(f"{var} must be 'aot', 'nvrtc' or unset, got {name!r}")
    return name


def forced_build_problem() -> str | None:
    """Why the build forced by LLM_ATTN_BUILD / LLM_ATTN_BACKEND cannot be honoured here, as one sentence; None when
    nothing is forced or the forced build is available. A misspelt value and a forced build that is missing are
    both errors: the command lines check this before loading anything and exit 2 (an explicit request that
    cannot be met must not silently run something else, e.g. the PyTorch reference)."""
    try:
        req = _requested()
    except ValueError as e:
        return str(e)
    if req == "auto" or _forced is not None:
        return None
    var = "LLM_ATTN_BUILD" if os.environ.get("LLM_ATTN_BUILD", "").strip() else "LLM_ATTN_BACKEND"
    mod, why = _load(req)
    if mod is not None:
        return None
    what = {"aot": "the compiled extension llm_attn._C is not importable",
            "nvrtc": "the NVRTC build cannot run here"}[req]
    return (f"{var}={req}: {what} ({why}); unset {var} to run whatever is available (the PyTorch reference on "
            "CPU), or see README.md 'Building the kernel'")


def set_backend(name: str | None) -> str | None:
    """Force a backend for this process ('aot', 'nvrtc'; None: back to LLM_ATTN_BACKEND / automatic). Returns the
    previous forced one. For tests and benchmarks."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    prev, _forced = _forced, name
    return prev


def kernel_build() -> str | None:
    """How the kernel that runs was built: 'aot', 'nvrtc', or None where neither is available."""
    req = _requested()
    for name in BACKENDS if req == "auto" else (req,):
        if _load(name)[0] is not None:
            return name
    return None


def backend_status() -> dict[str, str]:
    """{backend: 'available' or why not}: for messages and the tests' skip reasons."""
    return {name: ("available" if mod is not None else err) for name in BACKENDS for mod, err in [_load(name)]}


def kernel_available() -> bool:
    """True when a kernel backend can run here."""
    return kernel_build() is not None


kernel_backend = kernel_build  # the old name, kept: users call it


def get_ext():
    """The backend's module (the extension, or llm_attn._nvrtc), or a KernelNotBuiltError that says what to do."""
    name = kernel_build()
    if name is not None:
        return _load(name)[0]
    why = "; ".join(f"{n}: {msg}" for n, msg in backend_status().items() if _requested() in ("auto", n))
    raise KernelNotBuiltError(f"{BUILD_HELP}\n(requested: {_requested()}; {why})")

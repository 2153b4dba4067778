"""``llm_attn``: this project's FlashAttention-2 CUDA kernel (``llm_attn.flash_attn_func``), an entry like any other.

Variants, counted separately in a PatchReport: ``cuda`` (the kernel: fp16/bf16, head_dim 64/128, CUDA tensors) and
``reference`` (the tiled PyTorch reference, same algorithm: CPU tensors, or ``backend='reference'``). This entry
owns the kernel/reference choice (``variant_problem``), asking ``llm_attn.kernel_contract`` what the kernel takes;
it also provides the reference path the registry runs for ``backend='reference'`` asked of any entry.
"""

from __future__ import annotations

import os

import torch

from llm_attn._ext import get_ext, kernel_available
from llm_attn.kernel_contract import KERNEL_DTYPES, kernel_problem, reference_problem
from llm_attn.kv_cache_reference import FP8_READ_KERNEL, FP8_READ_PREFILL_KERNEL, FP8_READ_REFERENCE
from llm_attn.ops import (FP8_KV_MAX_ROWS, decode_fp8_kv, flash_attn_func, fp8_cache_dequant_available,
                          fp8_kv_kernel_available, fp8_kv_prefill_available, fp8_kv_rows)
from llm_attn.registry import register_attention

NOT_BUILT = ("the llm_attn CUDA extension is not built (python -m pip install --no-build-isolation -e . on a machine "
             "with nvcc)")
# The registry's variant names -> flash_attn_func's path.
PATH_OF_VARIANT = {"cuda": "kernel", "reference": "reference", "auto": "auto"}


def variant_problem(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    kernel_ok: bool | None = None) -> tuple[str | None, str | None]:
    """Which variant serves tensors like these: ('cuda' | 'reference', None) or (None, why not). ``requested`` is
    the registry's 'auto' | 'cuda' | 'reference'."""
    if requested == "reference":
        why = reference_problem(dtype)
        return (None, why) if why else ("reference", None)
    if device.type == "cuda":
        why = kernel_problem(dtype, head_dim)
        if why:
            return None, why
        if not (kernel_available() if kernel_ok is None else kernel_ok):
            return None, NOT_BUILT
        return "cuda", None
    if requested == "cuda":
        return None, f"backend='cuda' needs the model on a CUDA device, it is on {device}"
    why = reference_problem(dtype)
    return (None, why) if why else ("reference", None)


backend_problem = variant_problem  # the old name (llm_attn.thunder and older callers)


def _select(device, dtype, head_dim, requested):
    return variant_problem(requested, device, dtype, head_dim)


def _run(q, k, v, *, causal, scale, seqused_k=None, variant="auto"):
    return flash_attn_func(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, path=PATH_OF_VARIANT[variant])


register_attention("llm_attn", _run, dtypes=KERNEL_DTYPES + (torch.float32, torch.float64),
                   head_dims=None, devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="this project's FlashAttention-2 kernel (mma.sync; the PyTorch reference on CPU)",
                   default=True, select=_select, provides_reference=True)


def fp8_kv_copy_preferred() -> bool:
    """Whether a prefill over the FP8 cache is faster through its copy on the current device, by default: the copy
    is one launch (``ops.fp8_cache_dequant_available``) and our Hopper kernel reads it (sm_90)."""
    if not fp8_cache_dequant_available():  # a build that has it (AOT or NVRTC) has sm90_available too
        return False
    return bool(get_ext().sm90_available())


def fp8_kv_reader(impl: str, variant: str):
    """How llm_attn reads the FP8 KV cache directly on this variant: ``read`` or None (read the dequantised copy).
    ``read(q, kv, causal, scale, seqused_k)`` returns ((B, Hq, Sq, D), how it read: ``kv_cache_reference.FP8_READ_*``),
    or None for a call it does not take (then the caller reads the copy). 'cuda': the FP8-cache decode kernel for up
    to FP8_KV_MAX_ROWS packed rows, the prefill kernel above (a chunked prefill over the cache), where the build has
    them (the AOT and the NVRTC build; an extension built before the decode kernel: the copy for every call, before
    the prefill kernel: the copy for the prefill calls); 'reference': its blockwise PyTorch reference
    (``kv_cache_reference.decode_attention``), every call on CPU. Other registry entries have none.
    Which prefill calls take the kernel: ``LLM_ATTN_FP8KV_PREFILL`` (read when the reader is made, at the first call
    of a patched model): ``kernel`` all of them, ``copy`` none (each reads the copy), a number N those with q_len <= N;
    ``auto`` (the default) is ``copy`` where the copy is one launch (``ops.fp8_cache_dequant_available``) and feeds
    the Hopper kernel (sm_90: there the copy + that kernel measured 1.6-2.5x the prefill kernel over the cache at
    256-8192-query chunks with the same peak memory, kernels/NOTES.md "The FP8 cache's copy in one launch"), else
    ``kernel`` (no copy: what a 16 GB card needs). The patch report says which path each call took either way."""
    if impl != "llm_attn" or variant not in ("cuda", "reference"):
        return None
    if variant == "reference":
        def read_reference(q, kv, causal, scale, seqused_k):
            out = decode_fp8_kv(q, kv, causal=causal, scale=scale, seqused_k=seqused_k, path="reference")
            return out, FP8_READ_REFERENCE

        return read_reference
    if not fp8_kv_kernel_available():
        return None
    choice = os.environ.get("LLM_ATTN_FP8KV_PREFILL", "auto").strip().lower() or "auto"
    if choice not in ("auto", "kernel", "copy") and not (choice.isdigit() and int(choice) > 0):
        raise ValueError(f"LLM_ATTN_FP8KV_PREFILL must be 'auto', 'kernel', 'copy' or a positive number of queries "
                         f"(the prefill kernel up to it, the copy above), got {choice!r}")
    if choice == "auto":
        choice = "copy" if fp8_kv_copy_preferred() else "kernel"
    max_q = None if choice == "kernel" else 0 if choice == "copy" else int(choice)  # queries the kernel takes
    prefill = max_q != 0 and fp8_kv_prefill_available()

    def read(q, kv, causal, scale, seqused_k):
        if fp8_kv_rows(q, kv) <= FP8_KV_MAX_ROWS:
            how = FP8_READ_KERNEL
        elif prefill and (max_q is None or q.shape[2] <= max_q):
            how = FP8_READ_PREFILL_KERNEL
        else:
            return None
        return decode_fp8_kv(q, kv, causal=causal, scale=scale, seqused_k=seqused_k, path="kernel"), how

    return read

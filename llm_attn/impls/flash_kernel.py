"""``llm_attn``: this project's FlashAttention-2 CUDA kernel (``llm_attn.flash_attn_func``), an entry like any other.

Variants, counted separately in a PatchReport: ``cuda`` (the compiled kernel: fp16/bf16, head_dim 64/128, CUDA
tensors) and ``reference`` (the tiled PyTorch reference, same algorithm: CPU tensors, or ``backend='reference'``).
"""

from __future__ import annotations

import torch

from llm_attn import kernel_available
from llm_attn.ops import KERNEL_DTYPES, KERNEL_HEAD_DIMS, REFERENCE_DTYPES, flash_attn_func
from llm_attn.registry import register_attention

NOT_BUILT = "the llm_attn CUDA extension is not built (pip install --no-build-isolation -e . on a machine with nvcc)"


def backend_problem(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    kernel_ok: bool | None = None) -> tuple[str | None, str | None]:
    """Which variant serves tensors like these: ('cuda' | 'reference', None) or (None, why not)."""
    if backend == "reference":
        if dtype not in REFERENCE_DTYPES:
            return None, f"the reference takes {REFERENCE_DTYPES}, got {dtype}"
        return "reference", None
    if device.type == "cuda":
        if dtype not in KERNEL_DTYPES:
            return None, f"the CUDA kernel takes float16/bfloat16, got {dtype}"
        if head_dim not in KERNEL_HEAD_DIMS:
            return None, f"the CUDA kernel supports head_dim {KERNEL_HEAD_DIMS}, got {head_dim}"
        if not (kernel_available() if kernel_ok is None else kernel_ok):
            return None, NOT_BUILT
        return "cuda", None
    if backend == "cuda":
        return None, f"backend='cuda' needs the model on a CUDA device, it is on {device}"
    if dtype not in REFERENCE_DTYPES:
        return None, f"the reference takes {REFERENCE_DTYPES}, got {dtype}"
    return "reference", None


def _select(device, dtype, head_dim, backend):
    return backend_problem(backend, device, dtype, head_dim)


def _run(q, k, v, *, causal, scale, seqused_k=None, backend="auto"):
    return flash_attn_func(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, backend=backend)


register_attention("llm_attn", _run, dtypes=KERNEL_DTYPES + (torch.float32, torch.float64),
                   head_dims=None, devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="this project's FlashAttention-2 kernel (mma.sync; the PyTorch reference on CPU)",
                   default=True, select=_select)

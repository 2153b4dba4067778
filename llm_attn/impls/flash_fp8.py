"""``llm_attn_fp8``: this project's kernel with FP8 (e4m3) attention for the prefill (``flash_attn_func(...,
precision='fp8')``): Q, K, V quantised inside each call (per-block scales, K smoothed), fp32 accumulation and
softmax. A low-precision path the user picks by name, never a default; its accuracy is measured by the harness
(``bench --mode accuracy`` against float64, the ``correctness`` measurement against stock).

What it serves: prefill-shaped calls (more than ``DECODE_MAX_Q_LEN`` query rows) in FP8; decode-shaped calls (one
token, or a few) keep the native fp16/bf16 kernel, whose cost is reading the cache, not arithmetic (an FP8 KV
cache is the lever there). No backward: training through this entry raises. Variants counted in the patch report:
``fp8`` (the Hopper FP8 kernel, compute capability 9.0 with the AOT build) and ``reference-fp8`` (the same algorithm
in PyTorch: CPU tensors, or ``backend='reference'``).
"""

from __future__ import annotations

import torch

from llm_attn._ext import kernel_available
from llm_attn.kernel_contract import KERNEL_DTYPES, kernel_problem, reference_problem
from llm_attn.ops import flash_attn_func
from llm_attn.registry import register_attention

DECODE_MAX_Q_LEN = 16  # at most this many query rows: the native kernel (decode and speculative steps)


def _cuda_problem(device: torch.device) -> str | None:
    cc = torch.cuda.get_device_capability(device)
    if cc != (9, 0):
        return (f"llm_attn_fp8 has an FP8 kernel for compute capability 9.0 (H100, H200) only; this GPU is "
                f"sm_{cc[0]}{cc[1]}")
    from llm_attn import _ext  # noqa: PLC0415

    if not kernel_available() or _ext.kernel_build() != "aot":
        return "llm_attn_fp8 needs the AOT build of the extension (python -m pip install --no-build-isolation -e .)"
    return None


def _select(device, dtype, head_dim, requested):
    if requested == "reference" or device.type != "cuda":
        if requested == "cuda":
            return None, f"backend='cuda' needs the model on a CUDA device, it is on {device}"
        why = reference_problem(dtype)
        return (None, why) if why else ("reference-fp8", None)
    why = kernel_problem(dtype, head_dim) or _cuda_problem(device)
    return (None, why) if why else ("fp8", None)


def _run(q, k, v, *, causal, scale, seqused_k=None, variant="fp8"):
    path = "reference" if variant == "reference-fp8" else "kernel"
    precision = "native" if q.shape[2] <= DECODE_MAX_Q_LEN and path == "kernel" else "fp8"
    return flash_attn_func(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, path=path, precision=precision)


register_attention("llm_attn_fp8", _run, dtypes=KERNEL_DTYPES + (torch.float32,), head_dims=None,
                   devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="FP8 (e4m3) prefill attention of this project's Hopper kernel; decode stays native "
                               "(low precision: accuracy in bench --mode accuracy)",
                   select=_select)

"""The low-precision entries, each a path the user picks by name, never a default; their accuracy is measured by the
harness (``bench --mode accuracy`` against float64, the ``correctness`` measurement against stock):

- ``llm_attn_fp8``: FP8 prefill attention (``flash_attn_func(..., precision='fp8')``): Q and K in int8 (or e4m3:
  ``LLM_ATTN_FP8_QK=e4m3``), P and V in e4m3, quantised inside each call (a scale per query row, per 64 keys and
  per V channel; K smoothed), fp32
  accumulation and softmax; the Hopper kernel on its FP8/INT8 tensor cores.
- ``llm_attn_fp8_e4m3``: the same kernel with Q and K in e4m3 too (``flash_attn_func(..., fp8_qk="e4m3")``):
  4-10 % faster than int8 Q K^T on the H100, less accurate on peaky rows (kernels/NOTES.md "FP8 forward v4/v5"). A
  separate name, so that its rows and its accuracy never pass for the default's.
- ``llm_attn_int8qk``: the same kernel with int8 Q K^T and P V in the input dtype (``flash_attn_func(...,
  fp8_qk="int8", fp8_pv="input")``): P rounded to bf16/fp16, V not quantised, a bf16/fp16 wgmma for P V (what
  ``llm_attn_int8`` computes on the H100, on Hopper's tensor cores). The accurate one of the FP8 kernel's entries:
  e4m3's rounding of P and V, the larger part of their error, is gone, the int8 Q K^T's remains (K scales per 32
  keys here, for it); what the bf16 P V costs in speed is measured (``bench``), not assumed. Its own name for the same reason as the e4m3 entry's.
- ``llm_attn_int8``: INT8 Q K^T (K smoothed; a scale per query row and per 32 keys), P V in e4m3 on sm_89 and in
  the input dtype elsewhere (``precision='int8'``); the portable mma.sync kernel, sm_80-90 (RTX 30/40, Jetson Orin,
  A100, H100).

What each serves: prefill-shaped calls (more than ``DECODE_MAX_Q_LEN`` query rows) in low precision; decode-shaped calls (one
token, or a few) keep the native fp16/bf16 kernel, whose cost is reading the cache, not arithmetic (an FP8 KV
cache is the lever there). No backward: training through these entries raises. Variants counted in the patch
report: ``fp8`` / ``fp8-e4m3qk`` / ``int8qk`` / ``int8`` (the kernel, either build) and ``reference-`` the same (the
same algorithm in PyTorch: CPU tensors, or ``backend='reference'``: each entry answers it with its own quantised
reference, ``own_reference``, not with llm_attn's plain one).
"""

from __future__ import annotations

import torch

from llm_attn._ext import kernel_available
from llm_attn.kernel_contract import KERNEL_DTYPES, kernel_problem, reference_problem
from llm_attn.ops import ext_quant_available, flash_attn_func
from llm_attn.registry import register_attention

DECODE_MAX_Q_LEN = 16  # at most this many query rows: the native kernel (decode and speculative steps)


def _cuda_problem(device: torch.device, precision: str, pv: str = "") -> str | None:
    from llm_attn import _ext  # noqa: PLC0415
    from llm_attn.kernel_contract import FP8_KERNEL_CC, INT8_KERNEL_CCS  # noqa: PLC0415
    from llm_attn.ops import fp8_pv_available  # noqa: PLC0415

    cc = tuple(torch.cuda.get_device_capability(device))
    if precision == "fp8" and cc != FP8_KERNEL_CC:
        return (f"{'llm_attn_int8qk' if pv else 'llm_attn_fp8'} has an FP8 kernel for compute capability 9.0 (H100, "
                f"H200) only; this GPU is sm_{cc[0]}{cc[1]} (llm_attn_int8 runs on sm_80-90)")
    if precision == "int8" and cc not in INT8_KERNEL_CCS:
        return f"llm_attn_int8 has kernels for sm_80/86/87/89/90; this GPU is sm_{cc[0]}{cc[1]}"
    if not kernel_available():
        return (f"llm_attn_{precision} needs a kernel build: the AOT extension (python -m pip install "
                f"--no-build-isolation -e .) or NVRTC (python -m pip install 'llm-attn[nvrtc]')")
    if not ext_quant_available(_ext.get_ext(), precision):
        return (f"llm_attn_{precision}: the {_ext.kernel_build()} build has no {precision.upper()} kernel for this GPU "
                f"(AOT: LLM_ATTN_CUDA_ARCHS must contain its arch; NVRTC: 12.0 or newer for FP8's sm_90a)")
    if pv and not fp8_pv_available(_ext.get_ext()):
        return (f"llm_attn_int8qk: the {_ext.kernel_build()} build's FP8 kernel has no P V in the input dtype (an "
                f"extension built before it: rebuild it, or LLM_ATTN_BUILD=nvrtc)")
    return None


def _entry(precision: str, qk: str = "", pv: str = ""):
    """select and run of one entry; ``qk``, ``pv`` (fp8 only): its Q K^T and P V operands, "" = the default
    (``ops.fp8_qk``, ``ops.fp8_pv``). P V in the input dtype is named by its Q K^T alone (``int8qk``): the one thing
    still quantised."""
    kind = f"{qk}qk" if pv else f"{precision}-{qk}qk" if qk else precision

    def select(device, dtype, head_dim, requested):
        if requested == "reference" or device.type != "cuda":
            if requested == "cuda":
                return None, f"backend='cuda' needs the model on a CUDA device, it is on {device}"
            why = reference_problem(dtype)
            return (None, why) if why else (f"reference-{kind}", None)
        why = kernel_problem(dtype, head_dim) or _cuda_problem(device, precision, pv)
        return (None, why) if why else (kind, None)

    def run(q, k, v, *, causal, scale, seqused_k=None, variant=kind):
        path = "reference" if variant.startswith("reference") else "kernel"
        lowp = "native" if q.shape[2] <= DECODE_MAX_Q_LEN and path == "kernel" else precision
        return flash_attn_func(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, path=path, precision=lowp,
                               fp8_qk=qk, fp8_pv=pv)

    return select, run


_fp8_select, _fp8_run = _entry("fp8")
_fp8_e4m3_select, _fp8_e4m3_run = _entry("fp8", qk="e4m3")
_int8qk_select, _int8qk_run = _entry("fp8", qk="int8", pv="input")
_int8_select, _int8_run = _entry("int8")
register_attention("llm_attn_fp8", _fp8_run, dtypes=KERNEL_DTYPES + (torch.float32,), head_dims=None,
                   devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="FP8 prefill attention of this project's Hopper kernel (int8 Q K^T, e4m3 P V); decode "
                               "stays native "
                               "(low precision: accuracy in bench --mode accuracy)",
                   select=_fp8_select, own_reference=True)
register_attention("llm_attn_fp8_e4m3", _fp8_e4m3_run, dtypes=KERNEL_DTYPES + (torch.float32,), head_dims=None,
                   devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="FP8 prefill attention of this project's Hopper kernel with e4m3 Q K^T (faster, less "
                               "accurate than llm_attn_fp8's int8 Q K^T); decode stays native "
                               "(low precision: accuracy in bench --mode accuracy)",
                   select=_fp8_e4m3_select, own_reference=True)
register_attention("llm_attn_int8qk", _int8qk_run, dtypes=KERNEL_DTYPES + (torch.float32,), head_dims=None,
                   devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="int8 Q K^T prefill attention of this project's Hopper FP8 kernel with P V in the input "
                               "dtype (bf16/fp16 P and V: more accurate than llm_attn_fp8's e4m3 P V); decode stays "
                               "native (low precision: accuracy in bench --mode accuracy)",
                   select=_int8qk_select, own_reference=True)
register_attention("llm_attn_int8", _int8_run, dtypes=KERNEL_DTYPES + (torch.float32,), head_dims=None,
                   devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="INT8 Q K^T prefill attention of this project's portable kernel (P V in e4m3 on sm_89); "
                               "decode stays native (low precision: accuracy in bench --mode accuracy)",
                   select=_int8_select, own_reference=True)

"""The public attention op: the ``torch.library`` registration and dispatch kernel/reference. What the kernel
accepts is checked by ``llm_attn.kernel_contract``; the backward is ``llm_attn.backward``."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import warnings
from typing import Literal

import torch

from llm_attn import _environ
from llm_attn import _ext as _ext_mod
from llm_attn import backward, quant_reference, quant_reference_int8, reference
from llm_attn import kv_cache_reference as _kvref
from llm_attn.backward import direct_call_allowed, eager_call_allowed
from llm_attn._ext import KernelNotBuiltError, get_ext, kernel_build

# The contract's names, re-exported for callers of llm_attn.ops.
from llm_attn.kernel_contract import (  # noqa: E402,F401
    KERNEL_DTYPES,
    KERNEL_HEAD_DIMS,
    KERNEL_MAX_CAUSAL_Q_LEN,
    REFERENCE_DTYPES,
    PRECISIONS,
    aligned16,
    check_inputs,
    check_inputs_keyed,
    fp8_tile_problem,
    quant_problem,
    readable,
)

Path = Literal["auto", "kernel", "reference"]
Backend = Literal["auto", "cuda", "reference"]  # the old keyword's values (deprecated)
_OLD_BACKEND = {"auto": "auto", "cuda": "kernel", "reference": "reference"}


def _empty_outputs(q: torch.Tensor):
    """Output in (B, Sq, Hq, D) memory order viewed as (B, Hq, Sq, D): transformers' layout is then a free view."""
    b, hq, sq, d = q.shape
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    return out, lse


def _reference_impl(q, k, v, seqused_k, scale, causal):
    out, lse = _empty_outputs(q)
    ref_out, ref_lse = reference.attention_tiled(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


@torch.library.custom_op("llm_attn::flash_fwd", mutates_args=())
def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor | None,
               scale: float, causal: bool, use_kernel: bool,
               deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic: for the backward only (llm_attn.backward); the forward is deterministic anyway.
    # Default implementation (any device): the tiled PyTorch reference.
    return _reference_impl(q, k, v, seqused_k, scale, causal)


@_flash_fwd.register_kernel("cuda")
def _flash_fwd_cuda(q, k, v, seqused_k, scale, causal, use_kernel, deterministic=False):
    if not use_kernel:
        return _reference_impl(q, k, v, seqused_k, scale, causal)
    return _kernel_impl(q, k, v, seqused_k, scale, causal)


def _kernel_impl(q, k, v, seqused_k, scale, causal, ext=None, checked=None, need_lse=True):
    # The build makes out (in _empty_outputs' layout) and lse, and copies an input the kernels cannot read in place
    # (kernel_contract.readable): one crossing into C++ per call on the host-bound path, no Python layout checks (lse
    # is kept: the kernels write it unconditionally, one small float32 (B, Hq, Sq) allocation). `checked`: the key
    # check_inputs passed these very inputs under; the NVRTC build builds its call kind on it (and, with need_lse
    # False, may write lse where no allocation is made and return None for it).
    ext = ext or _current_ext()
    if checked is not None and _is_nvrtc(ext):
        return ext.mha_fwd_alloc_keyed(checked, q, k, v, seqused_k, float(scale), bool(causal), need_lse)
    return ext.mha_fwd_alloc(q, k, v, seqused_k, float(scale), bool(causal))


_NVRTC_BUILD: dict = {}  # build module -> whether it is llm_attn._nvrtc (asked once per module, not per call)


def _is_nvrtc(ext) -> bool:
    """Whether `ext` is the NVRTC build, whose per-call functions also take what the host-bound path passes
    (a checked key, need_lse): the AOT extension's take the binding's arguments only."""
    known = _NVRTC_BUILD.get(ext)
    if known is None:
        known = _NVRTC_BUILD[ext] = getattr(ext, "__name__", "") == "llm_attn._nvrtc"
    return known


@_flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, seqused_k, scale, causal, use_kernel, deterministic=False):
    return _empty_outputs(q)


backward.register_autograd(_flash_fwd)  # its backward: the llm_attn::flash_bwd op of llm_attn.backward


# ---- Low-precision forwards (precision='fp8' | 'int8'): the kernel where the GPU has one, their PyTorch references
# (llm_attn.quant_reference, llm_attn.quant_reference_int8) elsewhere. FP8: kernels/flash_fp8.h, compute capability
# 9.0. INT8: kernels/flash_int8.h, sm_80-90 (P V in e4m3 on sm_89, in the input dtype elsewhere).
_QUANT_BINDING = {"fp8": "mha_fwd_fp8", "int8": "mha_fwd_int8"}


def _quant_reference_impl(q, k, v, seqused_k, scale, causal, precision, qk="", pv=""):
    out, lse = _empty_outputs(q)
    if precision == "fp8":
        pv = fp8_pv(pv)
        qk = "int8" if pv == "input" and not qk else fp8_qk(qk)  # as the binding: P V input runs int8 Q K^T
        ref_out, ref_lse = quant_reference.attention_fp8(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k,
                                                         return_lse=True, qk=qk, pv=pv)
    else:
        ref_out, ref_lse = quant_reference_int8.attention_int8(q, k, v, causal=causal, scale=scale,
                                                               seqused_k=seqused_k, pv=int8_pv(q))
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def int8_pv(q) -> str:
    """What the INT8 path multiplies P V in: e4m3 where the kernel does (compute capability 8.9), else the input
    dtype. The reference follows the GPU it stands in for (on CPU: the input dtype)."""
    return "e4m3" if q.is_cuda and torch.cuda.get_device_capability(q.device) == (8, 9) else "input"


def _quant_kernel_impl(q, k, v, seqused_k, scale, causal, precision, ext=None, block_n=0, qk="", pv=""):
    ext = ext or _current_ext()
    name = _QUANT_BINDING[precision]
    if not hasattr(ext, name):
        raise KernelNotBuiltError(f"precision={precision!r}: this {kernel_build()} build has no {name} (an extension "
                                  f"built before it: rebuild it, or LLM_ATTN_BUILD=nvrtc)")
    q, k, v = readable(q), readable(k), readable(v)
    if precision == "fp8" and pv:  # only then: a build without the argument still runs the default
        if not fp8_pv_available(ext):
            raise KernelNotBuiltError(f"fp8_pv={pv!r}: this {kernel_build()} build's mha_fwd_fp8 has no pv argument "
                                      f"(an extension built before it: rebuild it, or LLM_ATTN_BUILD=nvrtc)")
        return getattr(ext, name)(q, k, v, seqused_k, float(scale), bool(causal), block_n=int(block_n), qk=qk, pv=pv)
    if precision == "fp8" and (block_n or qk):  # force_fp8_tile / force_fp8_qk; 0 / "": the defaults
        return getattr(ext, name)(q, k, v, seqused_k, float(scale), bool(causal), block_n=int(block_n), qk=qk)
    return getattr(ext, name)(q, k, v, seqused_k, float(scale), bool(causal))


def fp8_pv_available(ext) -> bool:
    """Whether this build's ``mha_fwd_fp8`` takes ``pv`` (P V in the input dtype): both builds from the commit that
    added it on. The NVRTC build's is a Python function; the extension's signature is in its docstring (pybind11)."""
    fn = getattr(ext, "mha_fwd_fp8", None)
    if fn is None:
        return False
    try:
        return "pv" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "pv:" in (getattr(fn, "__doc__", None) or "")


# block_n: the FP8 kernel's key tile (0 = the build's default; force_fp8_tile). The reference computes the same
# result for every tile and ignores it. qk: the FP8 path's Q K^T operands, "int8" or "e4m3" ("" = the default,
# fp8_qk; force_fp8_qk): kernel and reference both follow it. pv: those of P V, "input" or "" (e4m3; fp8_pv), the
# kernel called with it only when set.
@torch.library.custom_op("llm_attn::flash_fwd_quant", mutates_args=())
def _flash_fwd_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor | None,
                     scale: float, causal: bool, use_kernel: bool, precision: str,
                     block_n: int = 0, qk: str = "", pv: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    return _quant_reference_impl(q, k, v, seqused_k, scale, causal, precision, qk, pv)


@_flash_fwd_quant.register_kernel("cuda")
def _flash_fwd_quant_cuda(q, k, v, seqused_k, scale, causal, use_kernel, precision, block_n=0, qk="", pv=""):
    if not use_kernel:
        return _quant_reference_impl(q, k, v, seqused_k, scale, causal, precision, qk, pv)
    return _quant_kernel_impl(q, k, v, seqused_k, scale, causal, precision, block_n=block_n, qk=qk, pv=pv)


@_flash_fwd_quant.register_fake
def _flash_fwd_quant_fake(q, k, v, seqused_k, scale, causal, use_kernel, precision, block_n=0, qk="", pv=""):
    return _empty_outputs(q)


def _no_quant_backward(ctx, grad_out, grad_lse):
    raise RuntimeError("flash_attn_func(precision='fp8' | 'int8') is forward-only (inference): train with "
                       "precision='native' (the bf16/fp16 kernel and its backward)")


torch.library.register_autograd("llm_attn::flash_fwd_quant", _no_quant_backward)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False,
                    seqused_k: torch.Tensor | None = None, path: Path = "auto", *, backend: Backend | None = None,
                    precision: str = "native", deterministic: bool = False, fp8_qk: str = "", fp8_pv: str = ""):
    """FlashAttention forward.

    Args:
        q: (batch, num_heads, q_len, head_dim), float16 or bfloat16 for the kernel (the reference also takes
           float32/float64). Any strides with a contiguous last dim.
        k, v: (batch, num_kv_heads, kv_len, head_dim). ``num_heads`` must be a multiple of ``num_kv_heads``;
           query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)`` (GQA; MQA when num_kv_heads == 1).
           K/V are read in place, never expanded.
        causal: mask aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + kv_len - q_len``, so a prompt
           chunk appended to a KV cache sees the whole cache. With q_len == 1 this equals non-causal.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        return_lse: also return the natural-log log-sum-exp of each row, float32 (batch, num_heads, q_len);
           ``-inf`` for a row that sees no key (its output is 0).
        seqused_k: optional int32 (batch,) tensor: batch ``b`` uses only its first ``seqused_k[b]`` keys (a static
           KV cache with unused slots). Read on the device: no host synchronisation, so it is not validated;
           values above ``kv_len`` are clamped to ``kv_len`` and values below 0 to 0 (a row then sees no key:
           output 0, lse ``-inf``), on every path (kernel, reference, backward), never read out of bounds.
        path: what runs: 'auto' (the CUDA kernel for CUDA tensors, the PyTorch reference otherwise), 'kernel'
           (the CUDA kernel, or an error that says why not) or 'reference'. How the kernel was built (aot or nvrtc)
           is ``llm_attn.kernel_build()``'s business, not this argument's.
        backend: the old name of ``path`` ('auto', 'cuda' = 'kernel', 'reference'); deprecated, still honoured.
        precision: 'native' (default: the inputs' fp16/bf16 throughout), 'fp8' or 'int8', both quantising inside
           the call (per-block scales, K smoothed by its channel mean), with fp32 accumulation and softmax and the
           output in q's dtype. 'fp8': int8 Q K^T (or e4m3: ``fp8_qk``) and e4m3 P V (or in the input dtype:
           ``fp8_pv``) (``llm_attn.quant_reference``), kernel on compute capability 9.0 (H100, H200). 'int8': int8 Q K^T, P V in e4m3 on sm_89 and in the input dtype elsewhere
           (``llm_attn.quant_reference_int8``), kernel on sm_80-90. Both kernels are in both builds (AOT, NVRTC);
           the reference path runs the same algorithms in PyTorch anywhere. Forward only: no gradient flows through them. Its accuracy is a measured number, not a promise:
           ``python -m llm_attn.bench --mode accuracy`` prints it against float64 beside SDPA's own.

        fp8_qk: with precision='fp8', the operands of Q K^T: 'int8' (exact products of int8-rounded Q and K) or
           'e4m3' (faster on the H100 by 4-10 %, less accurate on peaky rows); "" = ``force_fp8_qk``'s, else
           ``LLM_ATTN_FP8_QK``'s, else 'int8'. Ignored by the other precisions.
        fp8_pv: with precision='fp8', the operands of P V: 'e4m3' (the default, "" too: P and V in e4m3) or 'input'
           (P rounded to the input dtype, V as given, a bf16/fp16 wgmma: the accurate one, whose remaining error is
           the int8 Q K^T's; registry entry ``llm_attn_int8qk``). 'input' runs with int8 Q K^T only (an explicit
           fp8_qk='e4m3' is an error; "" is int8 whatever ``force_fp8_qk`` or ``LLM_ATTN_FP8_QK`` say), at the same
           key tile as the e4m3 P V (``force_fp8_tile``). Ignored by the other precisions.
        deterministic: a backward that gives the same bits on every run (no float32 atomics: dQ by its own kernel,
           split dK/dV partials summed in a fixed order; on compute capability 9.0 the portable backward kernel
           instead of the Hopper one, slower: kernels/NOTES.md). Also on whenever
           ``torch.use_deterministic_algorithms(True)`` is in force when the backward runs (so a patched model
           follows it). The forward is deterministic either way.

    Returns:
        out (batch, num_heads, q_len, head_dim) in q's dtype (stored as (batch, q_len, num_heads, head_dim), so
        ``out.transpose(1, 2)`` is contiguous), and ``lse`` if ``return_lse``.
    """
    if backend is not None:
        warnings.warn("flash_attn_func(backend=...) is deprecated: use path='auto' | 'kernel' | 'reference' "
                      "(backend='cuda' is path='kernel')", DeprecationWarning, stacklevel=2)
        if backend not in _OLD_BACKEND:
            raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {backend!r}")
        path = _OLD_BACKEND[backend]
    elif path == "cuda":  # the old keyword's value, passed by position
        warnings.warn("flash_attn_func(..., 'cuda') is deprecated: use path='kernel'", DeprecationWarning, stacklevel=2)
        path = "kernel"
    use_kernel, checked = check_inputs_keyed(q, k, v, causal, scale, seqused_k, path)
    if precision != "native":
        return _flash_attn_quant(q, k, v, causal, scale, return_lse, seqused_k, use_kernel, precision, fp8_qk,
                                 fp8_pv)
    compiling = torch.compiler.is_compiling()
    ext = None
    if use_kernel and not compiling:  # traced code must not look up the build (the op does)
        ext = _current_ext()  # raises KernelNotBuiltError with build instructions
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not compiling and direct_call_allowed(q, k, v):
        # Eager, nothing to differentiate, no mode that must see the op: the op's own implementation, without the
        # dispatcher's round trip (the same code the op runs; torch.compile, autograd and modes keep the op).
        if use_kernel:
            out, lse = _kernel_impl(q, k, v, seqused_k, scale, causal, ext, checked, return_lse)
        else:
            out, lse = _reference_impl(q, k, v, seqused_k, scale, causal)
    elif use_kernel and not compiling and _cpp_autograd and eager_call_allowed(q, k, v):
        # Eager with gradients wanted: one node of the build's own, without the op's dispatch: the extension's C++
        # autograd function (kernels/binding.cpp FlashAttnFunction: the same kernels and saved tensors as the op's
        # autograd, no Python in the backward), or on the NVRTC build llm_attn.backward.FlashAttnEager (the op's
        # forward and backward in one Python node). Modes and torch.compile keep the op.
        if hasattr(ext, "mha_fwd_autograd"):
            out, lse = ext.mha_fwd_autograd(q, k, v, seqused_k, scale, bool(causal), bool(deterministic))
        else:
            out, lse = backward.FlashAttnEager.apply(q, k, v, seqused_k, scale, bool(causal), bool(deterministic),
                                                     ext)
    else:
        out, lse = _flash_fwd(q, k, v, seqused_k, scale, causal, use_kernel, bool(deterministic))
    return (out, lse) if return_lse else out


def _flash_attn_quant(q, k, v, causal, scale, return_lse, seqused_k, use_kernel, precision, qk="", pv=""):
    block_n = _fp8_block_n if precision == "fp8" else 0  # the FP8 kernel's key tile, as forced now
    if precision == "fp8":
        qk = fp8_qk(qk) if qk else ""  # checks it
        problem = fp8_pv_problem(pv, qk)  # on every path: the reference refuses what the kernel would
        if problem:
            raise ValueError(problem)
        pv = "" if fp8_pv(pv) == "e4m3" else pv  # the op's and the binding's default
        # its Q K^T operands: the argument, else as forced now; P V in the input dtype runs int8 whatever is forced
        qk = qk or ("int8" if pv else _fp8_qk_forced)
    else:
        qk, pv = "", ""
    problem = quant_problem(precision, q, use_kernel) or (use_kernel and fp8_tile_problem(block_n, q.shape[-1], pv))
    if problem:
        raise ValueError(problem)
    ext = _current_ext() if use_kernel and not torch.compiler.is_compiling() else None
    if use_kernel and ext is not None and not ext_quant_available(ext, precision):
        raise ValueError(quant_problem(precision, q, use_kernel, available=False))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not torch.compiler.is_compiling() and direct_call_allowed(q, k, v):
        if use_kernel:
            out, lse = _quant_kernel_impl(q, k, v, seqused_k, scale, causal, precision, ext, block_n, qk, pv)
        else:
            out, lse = _quant_reference_impl(q, k, v, seqused_k, scale, causal, precision, qk, pv)
    else:
        out, lse = _flash_fwd_quant(q, k, v, seqused_k, scale, causal, use_kernel, precision, block_n, qk, pv)
    return (out, lse) if return_lse else out


def ext_quant_available(ext, precision: str) -> bool:
    """Whether this build runs the ``precision`` kernel on the current device (FP8: a 9.0 GPU and sm_90a code, built
    in or compiled by NVRTC >= 12.0; INT8: sm_80-90)."""
    probe = {"fp8": "fp8_available", "int8": "int8_available"}[precision]
    return hasattr(ext, probe) and bool(getattr(ext, probe)())


# Eager calls that want gradients record the build's own node (flash_attn_func above: the extension's C++ autograd
# function, or backward.FlashAttnEager on the NVRTC build) unless LLM_ATTN_CPP_AUTOGRAD=0 or ``cpp_autograd(False)``
# keeps them on the torch.library op's autograd (A/B runs: ``python -m llm_attn.bench --mode backward --impls ours
# ours-op``). All run the same kernels.
_cpp_autograd = os.environ.get("LLM_ATTN_CPP_AUTOGRAD", "1") != "0"


@contextlib.contextmanager
def cpp_autograd(enabled: bool):
    """Process-wide: whether eager calls with gradients record the build's own node (True, the default: the
    extension's C++ autograd function; on the NVRTC build ``llm_attn.backward.FlashAttnEager``) or the op's autograd
    (False). Decided at the forward: a graph keeps the node it recorded."""
    global _cpp_autograd
    prev, _cpp_autograd = _cpp_autograd, bool(enabled)
    try:
        yield
    finally:
        _cpp_autograd = prev


# get_ext() resolved once per requested build (set_backend, LLM_ATTN_BUILD / LLM_ATTN_BACKEND): a failed import of
# the extension, tried on every call where only NVRTC is available, is the costliest part of a lookup.
_EXT_CACHE: dict = {}


def _current_ext():
    key = (_ext_mod._forced, _environ.get("LLM_ATTN_BUILD"), _environ.get("LLM_ATTN_BACKEND"))  # per call: no raise
    ext = _EXT_CACHE.get(key)
    if ext is None:
        ext = get_ext()  # raises KernelNotBuiltError; failures are not cached
        _EXT_CACHE.clear()
        _EXT_CACHE[key] = ext
    return ext


TILES = {"auto": 0, "large": 1, "wide": 2, "small": 3, "hopper": 4}

# The FP8 kernel's key tile for the calls issued now (0: the build's default): force_fp8_tile sets it, and
# _flash_attn_quant passes it to the op as an argument, so a CUDA graph or a compiled graph keeps the one it saw.
_fp8_block_n = 0


@contextlib.contextmanager
def force_fp8_tile(block_n: int):
    """Force the FP8 kernel's key tile inside the block (tests and benchmarks: both tiles in one process).

    ``block_n``: keys per S tile, 128, 192 or 256 (those built: kernels/generate_kernels.py ``FP8_BLOCK_N``; 256 at
    head_dim 128 with e4m3 P V, not with ``fp8_pv='input'``), or 0 for the
    build's default (``LLM_ATTN_FP8_BLOCK_N`` where set). The result's semantics do not depend on it (the PyTorch
    reference ignores it); only speed does. Applies to ``flash_attn_func(..., precision='fp8')`` calls issued in the
    block (either ``fp8_pv``); process-wide, not for concurrent use from threads.
    """
    global _fp8_block_n
    problem = fp8_tile_problem(block_n)
    if problem:
        raise ValueError(problem)
    prev, _fp8_block_n = _fp8_block_n, block_n
    try:
        yield
    finally:
        _fp8_block_n = prev


# The FP8 path's Q K^T operands for the calls issued now ("" = the default): force_fp8_qk sets it; passed to the op
# as an argument like the tile.
_fp8_qk_forced = ""
FP8_QK = ("int8", "e4m3")


def fp8_qk(qk: str = "") -> str:
    """The operands of Q K^T that an FP8 call with ``qk`` runs: ``qk`` itself, or for "" ``LLM_ATTN_FP8_QK`` if it
    is 'e4m3', else 'int8' (kernels/flash_fp8.h ``Fp8Qk``; the kernel reads the same variable).

    'int8' (the default): Q and K rounded to int8 with amax / 127 scales, multiplied exactly (wgmma s8, the same
    tensor rate as e4m3 on sm_90); 'e4m3': both in e4m3 (3 mantissa bits). P and V are e4m3 either way (unless
    ``fp8_pv='input'``, which takes int8 only). The int8 product is the more accurate (kernels/NOTES.md "FP8 forward
    v4": about half the output error on peaky inputs).
    """
    from llm_attn import _plan  # noqa: PLC0415 (the one reading of LLM_ATTN_FP8_QK, the NVRTC build's too)

    if qk and qk not in FP8_QK:
        raise ValueError(f"qk must be one of {', '.join(FP8_QK)} (the FP8 path's Q K^T operands), not {qk!r}")
    return _plan.fp8_qk(qk)


FP8_PV = ("e4m3", "input")  # kernels/flash_fp8.h Fp8Pv


def fp8_pv(pv: str = "") -> str:
    """The operands of P V that an FP8 call with ``pv`` runs: 'e4m3' for "" (no variable changes it: 'input' is
    chosen by name, ``fp8_pv`` or the ``llm_attn_int8qk`` entry), else ``pv`` itself once checked.

    'e4m3': P and V in e4m3 (V with per-channel scales), the fast one, ~2.6 % rms rounding each; 'input': P rounded
    to the input dtype and V not quantised (bf16/fp16 wgmma at half the e4m3 rate), leaving the int8 Q K^T's error.
    """
    if not pv:
        return "e4m3"
    if pv not in FP8_PV:
        raise ValueError(f"pv must be one of {', '.join(FP8_PV)} (the FP8 path's P V operands; '' = e4m3), not {pv!r}")
    return pv


def fp8_pv_problem(pv: str, qk: str = "") -> str | None:
    """Why an FP8 call with P V operands ``pv`` and Q K^T operands ``qk`` (as passed: "" = the default) cannot run, as
    one line, or None; in the binding's order (pv, then qk). ``pv`` that is not a choice raises fp8_pv's
    ValueError."""
    if fp8_pv(pv) != "input":
        return None
    if qk == "e4m3":
        return ("fp8_pv='input' runs with int8 Q K^T only (fp8_qk 'int8' or '': int8 whatever force_fp8_qk or "
                "LLM_ATTN_FP8_QK say), not fp8_qk='e4m3'")
    return None


@contextlib.contextmanager
def force_fp8_qk(qk: str):
    """Force the FP8 path's Q K^T operands inside the block: 'int8' or 'e4m3' ("" = the default, ``fp8_qk``).
    Unlike the tile, this changes the result (kernel and reference both follow it). Tests and benchmarks: both in one
    process; process-wide, not for concurrent use from threads."""
    global _fp8_qk_forced
    if qk:
        fp8_qk(qk)  # checks it
    prev, _fp8_qk_forced = _fp8_qk_forced, qk
    try:
        yield
    finally:
        _fp8_qk_forced = prev


@contextlib.contextmanager
def force_tile(tile: str):
    """Force the prefill kernel's tile configuration inside the block (tests and benchmarks).

    ``auto`` (the default outside this block) picks by shape and device: the Hopper kernel (wgmma, TMA) on
    compute capability 9.0, the portable mma.sync kernel elsewhere. ``large`` (128 rows, 8 warps x 16), ``wide``
    (128 rows, 4 warps x 32; no split-KV) and ``small`` (64 rows, 4 warps) force a portable tile; ``hopper`` forces
    the Hopper kernel (no split-KV; compute capability 9.0 only). The decode kernel (q_len x query heads per KV head
    <= 32) is not affected. Process-wide: not for concurrent use from threads.
    """
    if tile not in TILES:
        raise ValueError(f"tile must be one of {sorted(TILES)}, got {tile!r}")
    ext = get_ext()
    if tile == "hopper" and not ext.sm90_available():
        raise ValueError("tile 'hopper' needs a compute capability 9.0 GPU (H100, H200) and an extension built for "
                         "it (LLM_ATTN_CUDA_ARCHS containing 9.0)")
    prev = ext.set_tile(TILES[tile])
    try:
        yield
    finally:
        ext.set_tile(prev)


@contextlib.contextmanager
def force_decode(splits: int = 0, config: str = "auto"):
    """Force the split-KV decode kernel's choices inside the block (tuning: experiments/decode_splits.py; tests).

    ``splits``: KV splits per (batch, KV head), clamped to the number of 64-key tiles; 0 = automatic
    (kernels/flash_fwd.cu's decode_num_splits). ``config``: a ``DecodeConfig`` entry of kernels/generate_kernels.py
    (``Deep``: 3 cp.async stages, ``Shallow``: 2, ``Deep4``: 4, ``TwoTiles``: two m16 row tiles) or ``auto``; one
    whose row tiles cannot hold (query heads per KV head) x q_len is ignored, and one that needs more shared memory
    than the device's per-block limit fails at launch. Shapes that do not take the decode kernel are not affected.
    The choice is made when a call is issued: a CUDA graph captured inside the block keeps it. Process-wide: not for
    concurrent use from threads.
    """
    from llm_attn import _plan  # noqa: PLC0415

    if not isinstance(splits, int) or splits < 0:
        raise ValueError(f"splits must be an int >= 0, got {splits!r}")
    ids = {"auto": 0, **_plan.DECODE_CONFIG_IDS}
    if config not in ids:
        raise ValueError(f"config must be one of {sorted(ids)}, got {config!r}")
    ext = get_ext()
    prev_splits = ext.set_decode_splits(splits)
    if prev_splits < 0:
        raise ValueError(f"splits {splits} out of range")
    prev_config = ext.set_decode_config(ids[config])
    if prev_config < 0:  # an extension built from other kernel tables (stale build)
        ext.set_decode_splits(prev_splits)
        raise ValueError(f"the kernel build does not know decode config {config!r}: rebuild the extension")
    try:
        yield
    finally:
        ext.set_decode_splits(prev_splits)
        ext.set_decode_config(prev_config)


# ---- Attention over the FP8 KV cache (kernels/flash_decode_fp8kv.h; the format: llm_attn.kv_cache_reference) -------
# The decode kernel packs (query heads per KV head) x q_len rows into at most this many (kernels/kernel_tiles.h
# kDecodeMaxRows); longer queries (a chunked prefill over the cache) take the prefill kernel
# (kernels/flash_prefill_fp8kv_kernel.cuh) where the build has it (fp8_kv_prefill_available), else the caller reads
# the dequantised copy.
FP8_KV_MAX_ROWS = 32
FP8_KV_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def fp8_kv_rows(q: torch.Tensor, kv) -> int:
    """The rows one (batch, KV head) block of the decode kernel holds: query heads per KV head x q_len."""
    shape = q.shape  # read once: every read builds a torch.Size (this runs on every decode call)
    return shape[1] // max(kv.k_data.shape[1], 1) * shape[2]


def fp8_kv_decode_problem(q: torch.Tensor, kv, use_kernel: bool, prefill: bool | None = None) -> str | None:
    """Why ``decode_fp8_kv`` cannot take these inputs, as one line (None when it can). A view the cache made
    (``Fp8KV.trusted``) has only the query checked against it: this runs on every layer of every decode step.
    ``prefill``: whether the kernel build takes more than FP8_KV_MAX_ROWS rows (the prefill kernel); None asks the
    current build (``fp8_kv_prefill_available``), only for such a call."""
    if not isinstance(kv, _kvref.Fp8KV):
        return f"kv must be an llm_attn.kv_cache_reference.Fp8KV (the cache's .fp8(layer)), got {type(kv).__name__}"
    if q.dim() != 4:
        return f"q must be 4-D (batch, heads, q_len, head_dim), got {q.dim()}-D"
    kd = kv.k_data
    if not kv.trusted:
        problem = _fp8_kv_storage_problem(kv)
        if problem:
            return problem
    b, hq, sq, d = q.shape
    kb, hkv, _, kdim = kd.shape
    if kb != b or kdim != d:
        return f"the cache {tuple(kd.shape)} does not match q {tuple(q.shape)} (batch, head_dim)"
    if hkv == 0 or hq % hkv:
        return f"query heads ({hq}) must be a multiple of the cache's KV heads ({hkv})"
    if sq == 0 or sq > kv.length:
        return f"{sq} query rows over {kv.length} cached tokens: the queries are the newest cached tokens"
    if kd.device != q.device:
        return f"the cache is on {kd.device} but q is on {q.device}"
    if not use_kernel:
        return None if q.is_floating_point() else f"q must be floating point, got {q.dtype}"
    if not q.is_cuda:
        return f"the FP8-cache decode kernel needs CUDA tensors, q is on {q.device}"
    if q.dtype not in FP8_KV_KERNEL_DTYPES:
        return f"the FP8-cache decode kernel takes float16 or bfloat16 queries, got {q.dtype}"
    if d not in KERNEL_HEAD_DIMS:
        return f"the FP8-cache decode kernel supports head_dim {KERNEL_HEAD_DIMS}, got {d}"
    if hq // hkv * sq > FP8_KV_MAX_ROWS and not (fp8_kv_prefill_available() if prefill is None else prefill):
        return (f"(query heads per KV head) x q_len = {hq // hkv * sq} > {FP8_KV_MAX_ROWS}: not a decode call, and "
                f"this kernel build has no FP8-cache prefill kernel (an extension built before it: rebuild it, or "
                f"read the dequantised copy: Fp8KV.dequantized)")
    return None


def _fp8_kv_storage_problem(kv) -> str | None:
    """What is wrong with an Fp8KV's own tensors (dtypes, shapes, devices, length), or None."""
    kd, vd = kv.k_data, kv.v_data
    if kd.dtype != _kvref.STORAGE_DTYPE or vd.dtype != _kvref.STORAGE_DTYPE:
        return f"the cache's data must be {_kvref.STORAGE_DTYPE}, got {kd.dtype} and {vd.dtype}"
    if kd.dim() != 4 or kd.shape != vd.shape:
        return f"k_data {tuple(kd.shape)} and v_data {tuple(vd.shape)} must be one (batch, kv_heads, tokens, " \
               f"head_dim) shape"
    if not 0 < kv.length <= kd.shape[2]:
        return f"the cache holds {kv.length} tokens of {kd.shape[2]} slots: nothing to attend to"
    blocks = _kvref.n_blocks(kv.length)
    for name, t in (("k_scale", kv.k_scale), ("v_scale", kv.v_scale)):
        if t.dtype != torch.float32 or t.dim() != 3 or tuple(t.shape[:2]) != tuple(kd.shape[:2]) \
                or t.shape[2] < blocks:
            return f"{name} must be float32 (batch, kv_heads, >= {blocks} blocks), got {t.dtype} {tuple(t.shape)}"
    if any(t.device != kd.device for t in (vd, kv.k_scale, kv.v_scale, kv.k_shift)):
        return "the cache's tensors are on different devices"
    return None


def fp8_kv_kernel_available(ext=None) -> bool:
    """Whether the kernel build here has the FP8-cache decode kernel: the NVRTC build, and an AOT build from the
    commit that added it on. Any CUDA GPU of the build's archs (sm_80 and up) runs it: it needs no FP8 hardware (the
    e4m3 bytes are converted with integer operations, kernels/flash_decode_fp8kv_kernel.cuh)."""
    try:
        ext = ext or _current_ext()
    except KernelNotBuiltError:
        return False
    return hasattr(ext, "mha_decode_fp8kv")


def fp8_kv_prefill_available(ext=None) -> bool:
    """Whether the kernel build here also runs calls with more than FP8_KV_MAX_ROWS rows over the FP8 cache (the
    prefill kernel, kernels/flash_prefill_fp8kv_kernel.cuh): the NVRTC build, and an AOT build from the commit that
    added it on (``fp8kv_prefill`` in the extension). An older extension: those calls read the dequantised copy."""
    try:
        ext = ext or _current_ext()
    except KernelNotBuiltError:
        return False
    return hasattr(ext, "mha_decode_fp8kv") and hasattr(ext, "fp8kv_prefill")


def decode_fp8_kv(q: torch.Tensor, kv, causal: bool = True, scale: float | None = None, return_lse: bool = False,
                  seqused_k: torch.Tensor | None = None, path: Path = "auto"):
    """Attention of the newest ``q_len`` tokens' queries over the FP8 (e4m3) KV cache, reading its bytes: a decode
    step, or a chunk of a prefill (q_len <= the cached tokens; the chunk's own tokens already in the cache).

    Args:
        q: (batch, num_heads, q_len, head_dim); float16/bfloat16 for the kernel (the reference also float32/64).
        kv: one layer of the cache, ``llm_attn.kv_cache_reference.Fp8KV`` (``Fp8DynamicCache.fp8(layer)``, or the
           ``fp8_kv_of`` view of what the cache returned): tokens ``[0, kv.length)`` are attended to.
        causal: bottom-right, as ``flash_attn_func`` (q_len 1: every cached token).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        return_lse: also the natural-log lse (batch, num_heads, q_len) float32 of the dequantised scores, K's
           smoothing shift included (as ``kv_cache_reference.decode_attention``).
        seqused_k: optional int32 (batch,): batch ``b`` uses its first ``seqused_k[b]`` tokens (read on the device).
        path: 'kernel' (K/V read as e4m3 bytes and dequantised in registers, no fp16 copy of the cache:
           kernels/flash_decode_fp8kv_kernel.cuh for (query heads per KV head) x q_len <= 32, above that
           kernels/flash_prefill_fp8kv_kernel.cuh where the build has it, ``fp8_kv_prefill_available``), 'reference'
           (``kv_cache_reference.decode_attention`` with the kernel's roundings for fp16/bf16 queries) or 'auto'
           (the kernel for CUDA tensors).

    Returns the output (batch, num_heads, q_len, head_dim) in q's dtype (stored as (batch, q_len, num_heads,
    head_dim) by the kernel), and the lse if ``return_lse``. Bad input raises ValueError with one line; a build
    without the kernel raises KernelNotBuiltError.
    """
    if path not in ("auto", "kernel", "reference"):
        raise ValueError(f"path must be 'auto', 'kernel' or 'reference', got {path!r}")
    use_kernel = path == "kernel" or (path == "auto" and q.is_cuda)
    checked = _fp8_kv_verdict_key(q, kv, causal, scale, seqused_k) if use_kernel else None
    known = _FP8_KV_VERDICTS.get(checked) if checked is not None else None
    if known is not None:  # a trusted view's call like one that passed every check below: only the launch is left
        ext = _current_ext()
        if known[0] is ext:
            return _fp8_kv_kernel(ext, checked, q, kv, kv.used if seqused_k is None else seqused_k, known[1],
                                  causal, return_lse, known[2])
    problem = fp8_kv_decode_problem(q, kv, use_kernel)
    if problem:
        raise ValueError(problem)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be finite and >= 0, got {scale}")
    if seqused_k is None:
        seqused_k = kv.used  # a device-position cache's used length (None: all kv.length tokens)
    if seqused_k is not None and (seqused_k.dtype != torch.int32 or tuple(seqused_k.shape) != (q.shape[0],)
                                  or seqused_k.device != q.device):
        raise ValueError("seqused_k must be an int32 tensor of shape (batch,) on q's device")
    if not use_kernel:
        rounding = "kernel" if q.dtype in FP8_KV_KERNEL_DTYPES else "float32"
        return _kvref.decode_attention(q, kv, causal=causal, scale=scale, return_lse=return_lse,
                                      seqused_k=seqused_k, rounding=rounding)
    ext = _current_ext()  # raises KernelNotBuiltError with build instructions
    if not hasattr(ext, "mha_decode_fp8kv"):
        raise KernelNotBuiltError(f"this {kernel_build()} build has no FP8-cache decode kernel (mha_decode_fp8kv): an "
                                  f"extension built before it: rebuild it (python -m pip install --no-build-isolation "
                                  f"-e .), or LLM_ATTN_BUILD=nvrtc, or read the cache's dequantised copy")
    sliced = kv.k_data.shape[2] != kv.length
    qr = readable(q)
    if checked is not None and qr is q:
        if len(_FP8_KV_VERDICTS) >= _FP8_KV_VERDICTS_MAX:
            _FP8_KV_VERDICTS.clear()
        _FP8_KV_VERDICTS[checked] = (ext, scale, sliced)
    return _fp8_kv_kernel(ext, checked if qr is q else None, qr, kv, seqused_k, scale, bool(causal), return_lse,
                          sliced)


# decode_fp8_kv's verdicts on the kernel calls of views the cache made (``Fp8KV.trusted``): a call whose key
# (_fp8_kv_verdict_key) passed every check before, with the same kernel build, skips them (kernels/NOTES.md "The
# FP8-cache decode call's checks, kept per kind"). The key also extends to the NVRTC build's call kind.
_FP8_KV_VERDICTS: dict = {}
_FP8_KV_VERDICTS_MAX = 512
_Tensor = torch.Tensor
_SCALE_TYPES = (float, int, type(None))


def _fp8_kv_verdict_key(q, kv, causal, scale, seqused_k) -> tuple | None:
    """The key of decode_fp8_kv's verdict for a kernel call on a trusted view: every property of q, the view's four
    tensors and seqused_k (the view's ``used`` where None) that the checks and the launch read, the view's length and
    the arguments as given. None (the checks run every call) for anything else: an untrusted view, subclasses,
    another type of scale or causal."""
    if type(q) is not _Tensor or type(kv) is not _kvref.Fp8KV or not kv.trusted or type(causal) is not bool \
            or type(scale) not in _SCALE_TYPES:
        return None
    sk = kv.used if seqused_k is None else seqused_k
    if sk is not None:
        if type(sk) is not _Tensor:
            return None
        sk = (sk.shape, sk.stride(), sk.dtype, sk.device)
    kd, vd, ks, vs = kv.k_data, kv.v_data, kv.k_scale, kv.v_scale
    return (q.shape, q.stride(), q.dtype, q.device, kd.shape, kd.stride(), kd.dtype, kd.device, vd.shape, vd.stride(),
            vd.dtype, vd.device, ks.shape, ks.stride(), ks.dtype, ks.device, vs.shape, vs.stride(), vs.dtype,
            vs.device, (q.data_ptr() | kd.data_ptr() | vd.data_ptr()) & 15, kv.length, sk, type(scale), scale, causal)


def _fp8_kv_kernel(ext, checked, q, kv, seqused_k, scale: float, causal: bool, return_lse: bool, sliced: bool):
    """decode_fp8_kv's launch on checked inputs (`checked`: their verdict key, or None): the NVRTC build's call kind
    is built on the key; the lse (where asked) gets K's smoothing shift back."""
    kd, vd = kv.k_data, kv.v_data
    if sliced:  # capacity past the valid tokens (two views cost the host ~3 us each: only when needed)
        n = kv.length
        kd, vd = kd[:, :, :n], vd[:, :, :n]
    # NVRTC: a dropped lse (not return_lse) allocates nothing (the stream's eager buffer takes it).
    if not _is_nvrtc(ext):
        out, lse = ext.mha_decode_fp8kv(q, kd, vd, kv.k_scale, kv.v_scale, seqused_k, scale, causal)
    elif checked is not None:
        out, lse = ext.mha_decode_fp8kv_keyed(checked, q, kd, vd, kv.k_scale, kv.v_scale, seqused_k, scale, causal,
                                              return_lse)
    else:
        out, lse = ext.mha_decode_fp8kv(q, kd, vd, kv.k_scale, kv.v_scale, seqused_k, scale, causal, return_lse)
    if not return_lse:
        return out
    # The kernel's lse leaves out K's smoothing shift (the same for every key of a row): add q . k_shift back.
    b, hq, sq, d = q.shape
    hkv = kv.k_shift.shape[1]
    qs = q.to(torch.float32).reshape(b, hkv, hq // hkv * sq, d)
    shift = torch.matmul(qs, kv.k_shift.unsqueeze(-1)).reshape(b, hq, sq) * scale
    return out, lse + shift


def fp8_cache_append_available(ext=None) -> bool:
    """Whether this kernel build has the FP8 cache's one-token append (kernels/fp8_cache_append.h): the NVRTC build,
    and an AOT build from the commit that added it on. Without it (an older extension, CPU) the cache's device step
    runs the same arithmetic as PyTorch ops (``Fp8StaticLayer._update_on_device``): the same bytes, ~35 small kernels
    per layer instead of one."""
    try:
        ext = ext or _current_ext()
    except KernelNotBuiltError:
        return False
    return hasattr(ext, "fp8_cache_append")


def fp8_cache_append(k_new: torch.Tensor, v_new: torch.Tensor, k_open: torch.Tensor, v_open: torch.Tensor,
                     k_shift: torch.Tensor, k_data: torch.Tensor, v_data: torch.Tensor, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, position: torch.Tensor, used: torch.Tensor, max_cache_len: int) -> None:
    """One token appended to an FP8 static cache layer at the device-side ``position``, in place, in one launch:
    the open block's float32 originals, K's shift while block 0 is open, the block re-quantised (bytes and scales
    bit-identical to ``kv_cache_reference.quantize``) and ``used`` = min(position + 1, max_cache_len). The position
    is read, not advanced. Raises ValueError (one line) for tensors the kernel does not take."""
    ext = _current_ext()
    if not hasattr(ext, "fp8_cache_append"):
        raise KernelNotBuiltError(f"this {kernel_build()} build has no fp8_cache_append: check "
                                  f"fp8_cache_append_available() first")
    try:
        ext.fp8_cache_append(k_new, v_new, k_open, v_open, k_shift, k_data, v_data, k_scale, v_scale, position, used,
                             int(max_cache_len))
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else repr(e)
        if first.startswith("llm_attn.fp8_cache_append:"):
            raise ValueError(first) from None
        raise


def fp8_cache_dequant_available(ext=None) -> bool:
    """Whether this kernel build has the FP8 cache's one-launch dequantised copy (kernels/fp8_cache_dequant.h): the
    NVRTC build, and an AOT build from the commit that added it on. Without it (an older extension, CPU) the copy is
    ``kv_cache_reference.Fp8KV.dequantized``'s PyTorch ops: the same values, ~9x the memory traffic."""
    try:
        ext = ext or _current_ext()
    except KernelNotBuiltError:
        return False
    return hasattr(ext, "fp8_cache_dequant")


def fp8_kv_dequantized(kv, dtype: torch.dtype, out: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of an FP8 cache layer's valid tokens, (B, H, length, D) in ``dtype``: ``kv.dequantized(dtype)``'s
    values, bit for bit, in one launch where the current build has the kernel (``fp8_cache_dequant_available``: the
    AOT or the NVRTC build, whichever ``flash_attn_func`` runs on) and the cache is on a CUDA device (fp16/bf16,
    head_dim 64 or 128, contiguous 16-byte-aligned storage: what ``llm_attn.models.kv_cache`` makes); the PyTorch
    reference otherwise, and always while torch.compile traces (the launch and its pointer checks are not traceable;
    inductor fuses the reference's ops). ``out``: (k, v) to write into (tests poison them first); the kernel path
    only."""
    d, n = kv.k_data.shape[-1], kv.length
    use_kernel = (not torch.compiler.is_compiling() and kv.k_data.is_cuda
                  and dtype in (torch.float16, torch.bfloat16) and d in (64, 128) and kv.used is None
                  and kv.k_data.shape[0] * kv.k_data.shape[1] <= 65535
                  and all(t.is_contiguous() and t.data_ptr() % 16 == 0  # the kernel's 16-byte loads
                          for t in (kv.k_data, kv.v_data, kv.k_scale, kv.v_scale, kv.k_shift))
                  and fp8_cache_dequant_available())
    if not use_kernel:
        if out is not None:
            raise ValueError("fp8_kv_dequantized(out=) needs the kernel path (a CUDA cache of fp16/bf16, head_dim 64 "
                             "or 128, on a build with fp8_cache_dequant)")
        return kv.dequantized(dtype)
    b, h = kv.k_data.shape[:2]
    if out is None:
        out = (torch.empty((b, h, n, d), dtype=dtype, device=kv.k_data.device),
               torch.empty((b, h, n, d), dtype=dtype, device=kv.k_data.device))
    elif any(t.shape != (b, h, n, d) or t.dtype != dtype for t in out):
        raise ValueError(f"fp8_kv_dequantized: out must be two {dtype} tensors of shape {(b, h, n, d)} (batch, heads, "
                         f"the cache's length, head_dim), got {[(tuple(t.shape), t.dtype) for t in out]}")
    try:
        _current_ext().fp8_cache_dequant(kv.k_data, kv.v_data, kv.k_scale, kv.v_scale, kv.k_shift, *out)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else repr(e)
        if first.startswith("llm_attn.fp8_cache_dequant:"):
            raise ValueError(first) from None
        raise
    return out

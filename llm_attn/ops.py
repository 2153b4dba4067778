"""The public attention op: validation, the ``torch.library`` registration, and dispatch kernel/reference."""

from __future__ import annotations

import contextlib
import math
from typing import Literal

import torch

from llm_attn import reference
from llm_attn._ext import get_ext

KERNEL_HEAD_DIMS = (64, 128)
KERNEL_MAX_CAUSAL_Q_LEN = 65535 * 64
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
Backend = Literal["auto", "cuda", "reference"]


def _check_inputs(q, k, v, causal, scale, seqused_k, backend) -> bool:
    """Validate; return True when the CUDA kernel will run. Every message names the argument and the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): every dim must be > 0")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (head_dim), got strides {t.stride()}; "
                             f"call .contiguous() first")
    if backend not in ("auto", "cuda", "reference"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {backend!r}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"batch mismatch: q has {b}, k/v have {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k/v have {k.shape[3]}")
    hkv = k.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if seqused_k is not None:
        if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32 or seqused_k.shape != (b,):
            raise ValueError(f"seqused_k must be an int32 tensor of shape ({b},), got "
                             f"{getattr(seqused_k, 'dtype', type(seqused_k))} {tuple(getattr(seqused_k, 'shape', ()))}")
        if seqused_k.device != q.device:
            raise ValueError(f"seqused_k must be on {q.device}, got {seqused_k.device}")

    use_kernel = backend == "cuda" or (backend == "auto" and q.is_cuda)
    if use_kernel:
        if not q.is_cuda:
            raise ValueError(f"backend='cuda' needs CUDA tensors, got {q.device}; use backend='reference' on CPU")
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the CUDA kernel takes float16 or bfloat16, got {q.dtype}")
        if d not in KERNEL_HEAD_DIMS:
            raise ValueError(f"the CUDA kernel supports head_dim {KERNEL_HEAD_DIMS}, got {d}")
        if scale is not None and scale < 0:
            raise ValueError(f"the CUDA kernel takes a scale >= 0 (its online softmax takes each row's max before "
                             f"scaling), got {scale}; use backend='reference' for a negative scale")
        if hq > 65535 or b > 65535:
            raise ValueError(f"the CUDA kernel takes at most 65535 heads and batch 65535, got {hq} and {b}")
        if causal and sq > KERNEL_MAX_CAUSAL_Q_LEN:
            raise ValueError(f"causal q_len must be <= {KERNEL_MAX_CAUSAL_Q_LEN} for the CUDA kernel (its grid holds "
                             f"one 64-row block per y index), got {sq}; split the queries into chunks")
        if not torch.compiler.is_compiling():  # traced code must not look up the backend (the op's body does)
            get_ext()  # raises KernelNotBuiltError with build instructions
    elif q.dtype not in REFERENCE_DTYPES:
        raise TypeError(f"unsupported dtype {q.dtype}; use one of {REFERENCE_DTYPES}")
    return use_kernel


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(st % 8 == 0 or n == 1 for st, n in zip(t.stride()[:3], t.shape[:3]))


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
               scale: float, causal: bool, use_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # Default implementation (any device): the tiled PyTorch reference.
    return _reference_impl(q, k, v, seqused_k, scale, causal)


@_flash_fwd.register_kernel("cuda")
def _flash_fwd_cuda(q, k, v, seqused_k, scale, causal, use_kernel):
    if not use_kernel:
        return _reference_impl(q, k, v, seqused_k, scale, causal)
    # cp.async moves 16-byte chunks: strides must be multiples of 8 elements and bases 16-byte aligned. Any
    # layout transformers or a KV cache produces is; anything else is copied once rather than rejected.
    q, k, v = (t if _aligned16(t) else t.contiguous() for t in (q, k, v))
    out, lse = _empty_outputs(q)
    get_ext().mha_fwd(q, k, v, out, lse, seqused_k, float(scale), bool(causal))
    return out, lse


@_flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, seqused_k, scale, causal, use_kernel):
    return _empty_outputs(q)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False,
                    seqused_k: torch.Tensor | None = None, backend: Backend = "auto"):
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
        backend: 'auto' (the CUDA kernel for CUDA tensors, the PyTorch reference otherwise), 'cuda', 'reference'.

    Returns:
        out (batch, num_heads, q_len, head_dim) in q's dtype (stored as (batch, q_len, num_heads, head_dim), so
        ``out.transpose(1, 2)`` is contiguous), and ``lse`` if ``return_lse``.
    """
    use_kernel = _check_inputs(q, k, v, causal, scale, seqused_k, backend)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = _flash_fwd(q, k, v, seqused_k, scale, causal, use_kernel)
    return (out, lse) if return_lse else out


TILES = {"auto": 0, "large": 1, "wide": 2, "small": 3, "hopper": 4}


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

from llm_attn import backward as _backward  # noqa: E402,F401  (registers autograd for llm_attn::flash_fwd)

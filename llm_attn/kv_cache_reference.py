"""The FP8 (e4m3) KV cache format in PyTorch: the spec that a CUDA kernel reading (or writing) the cache must match.

The transformers ``Cache`` that stores it is ``llm_attn.models.kv_cache`` (``Fp8DynamicCache``, ``Fp8StaticCache``);
this module is the format, its quantisation, and attention over it, with no transformers in sight.

Layout of one layer (B batch, H KV heads, S tokens cached, C >= S the capacity, D head_dim, ``BLOCK`` = 64):

    k_data, v_data     float8_e4m3fn  (B, H, C, D)           contiguous, token t in row t
    k_scale, v_scale   float32        (B, H, ceil(C / 64))   contiguous, block j = tokens [64 j, 64 j + 64)
    k_shift            float32        (B, H, D)              K's smoothing shift (zeros until the first token)

    K[t] = float32(k_data[t]) * k_scale[t // 64] + k_shift        V[t] = float32(v_data[t]) * v_scale[t // 64]

One block of n <= 64 tokens (x: their K minus ``k_shift``, or their V, in float32):

    amax  = max |x| over the n tokens and D channels;  scale = amax * float32(1 / 448), or 1 when amax == 0
    data  = e4m3(x * (1 / scale))     1 / scale an IEEE float32 division; e4m3 rounds to nearest even and
                                      saturates at +-448 (cvt.rn.satfinite), as kernels/quant_fp8.cuh does

So a block's data and scale are a function of that block's tokens alone. The newest block may be partial: the
cache keeps its tokens' original values (float32, at most 63 tokens: the *tail*) and re-quantises the whole block
from them, with its scale recomputed, every time tokens are added to it; a full block is never touched again.
The stored values are therefore the same whatever the sizes of the updates that brought the tokens (a prefill of
1000 tokens, or 10 chunks of 100, or 1000 decode steps), which a kernel that appends to the cache can reproduce.

K's smoothing shift is the per-channel median (the lower one of the two middle values, ``torch.median``) of block 0's
keys; it is recomputed while block 0 is still open and frozen once block 0 is full. A median is one of the values,
so it is exact and independent of summation order. Why smooth: LLM keys have a few channels with a large bias
(10-50x); unshifted, that bias sets the block's amax and its e4m3 rounding error (3 mantissa bits, relative) varies
key to key in exactly those channels. Measured on CPU (``tests/test_kv_cache_fp8.py``, README): decode output
cosine against float64 0.9911 unsmoothed, 0.9993 smoothed, with 4 K channels per head biased by 10-50x (2048 keys,
32/8 heads, head_dim 128).

Attention never needs ``k_shift``: ``q . K[t] = k_scale[t // 64] (q . k_data[t]) + q . k_shift``, and the last
term is the same for every key of a query row, so softmax and output do not change without it; only the
log-sum-exp moves, by ``softmax_scale * q . k_shift`` (``decode_attention`` adds it back). A kernel dequantises a
64-key tile with one scale per KV head: the block is the decode kernel's key tile (kernels/flash_decode_kernel.cuh).

Why 64-token blocks rather than one scale per head: e4m3 is a floating-point format, so the scale only places the
exponent range and the error is relative wherever the scale is; per head, per 64/128/256-token block and per token
measure the same (cosine within 1e-4 of one another, README). A block scale, unlike a per-head one, never has to
change when a later token is larger than every earlier one: old blocks are never re-read or re-written.

``FP8_KV_ATTR``: the cache sets it on the K and V it returns to attention, holding an ``Fp8KV`` view of the raw data
and scales; the patched attention looks for it (``fp8_kv_of``). For stock attention those are a dequantised copy
(the honest baseline: it has no other way to read FP8). When the model runs llm_attn's attention function
(``config._attn_implementation == "llm_attn"``) they are *placeholders* (``is_placeholder``: a zero-stride view of
one zero, of the copy's shape and dtype, no memory): the patched attention reads the FP8 data directly
(``llm_attn.ops.decode_fp8_kv``: the decode kernel, kernels/flash_decode_fp8kv_kernel.cuh, for a decode step; the
prefill kernel, kernels/flash_prefill_fp8kv_kernel.cuh, for a longer call, a chunk of a chunked prefill; or this
module's ``decode_attention`` on CPU) or, for a call the direct path does not take (a padding mask, another registry
implementation, a prefill on an extension built before the prefill kernel), makes the dequantised copy itself; the
patch report counts which (``FP8_READ_*``).

What the decode and the prefill kernel compute (``decode_attention(..., rounding="kernel")``, their exact arithmetic up
to the order of float32 sums): Q rounded to fp16 (bf16 queries are converted: exact within fp16's range), S = Q K^T over each 64-key
block's e4m3 values in float32, the online softmax's exact running max (P <= 1), P times the block's V scale rounded
to fp16 before P V; the output rounded once to q's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 64                       # tokens per scale: the decode kernel's key tile
E4M3_MAX = 448.0                 # the largest finite e4m3 value
STORAGE_DTYPE = torch.float8_e4m3fn
FP8_KV_ATTR = "_llm_attn_fp8_kv"  # on the dequantised K the cache returns: the Fp8KV it came from
# What the patch report says for attention calls whose K/V come from the FP8 cache: how each read it (the dequantised
# copy, the decode kernel, the prefill kernel, or on CPU the blockwise reference of both).
FP8_READ_VIA_COPY = "fp8 cache read via dequantised copy"
FP8_READ_KERNEL = "fp8 cache read directly by the decode kernel"
FP8_READ_PREFILL_KERNEL = "fp8 cache read directly by the prefill kernel"
FP8_READ_REFERENCE = "fp8 cache read directly by the blockwise reference"
FP8_PLACEHOLDER_ATTR = "_llm_attn_fp8_placeholder"  # on a K/V that holds no values: read the Fp8KV instead


def n_blocks(tokens: int) -> int:
    """Blocks that hold ``tokens`` tokens (the last may be partial)."""
    return -(-tokens // BLOCK)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """Scales of (B, H, S, D) float32 values per 64-token block: (B, H, ceil(S / 64)), amax x (1/448) (1 for an all-zero
    block). A partial last block's amax is over its own tokens."""
    b, h, s, d = x.shape
    nb = n_blocks(s)
    padded = torch.nn.functional.pad(x, (0, 0, 0, nb * BLOCK - s))  # zeros never raise an amax
    amax = padded.view(b, h, nb, BLOCK * d).abs().amax(dim=-1)
    # amax times the float32 reciprocal, not amax / 448: PyTorch divides a CUDA tensor by a scalar as a product with
    # its reciprocal and a CPU tensor exactly, so the quotient would differ in the last bit between devices; the
    # product is the same everywhere (and kernels/fp8_cache_append.cu computes exactly it).
    return torch.where(amax > 0, amax * (1.0 / E4M3_MAX), torch.ones_like(amax))


def quantize(x: torch.Tensor, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) values in any float dtype, starting at a block boundary -> (data float8_e4m3fn (B, H, S, D),
    scale float32 (B, H, ceil(S / 64))); ``shift`` (B, H, D) float32 is subtracted first (K's smoothing)."""
    xf = x.to(torch.float32)
    if shift is not None:
        xf = xf - shift.unsqueeze(2)
    scale = block_scales(xf)
    inv = (1.0 / scale).repeat_interleave(BLOCK, dim=2)[:, :, :xf.shape[2]].unsqueeze(-1)
    return (xf * inv).clamp_(-E4M3_MAX, E4M3_MAX).to(STORAGE_DTYPE), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, H, S, D) in ``dtype``: float32(data) * its block's scale (+ shift), computed in float32, then rounded."""
    s = data.shape[2]
    out = data.to(torch.float32).mul_(scale.repeat_interleave(BLOCK, dim=2)[:, :, :s].unsqueeze(-1))
    if shift is not None:
        out.add_(shift.unsqueeze(2))
    return out.to(dtype)


def smoothing_shift(k_block0: torch.Tensor) -> torch.Tensor:
    """K's shift from block 0's keys (B, H, n <= 64, D): the per-channel lower median, float32 (B, H, D)."""
    return k_block0.to(torch.float32).median(dim=2).values


@dataclass
class Fp8KV:
    """One layer's FP8 cache as a kernel reads it: tokens ``[0, length)`` of the data are valid (the rest of a static
    cache's capacity is unused). The tensors are the cache's own storage, not copies. ``trusted``: made by the cache
    (``llm_attn.models.kv_cache``), whose dtypes, shapes and devices agree by construction, so a decode call checks
    only its query against them (host time on every layer of every token); any other view is checked whole."""

    k_data: torch.Tensor
    k_scale: torch.Tensor
    k_shift: torch.Tensor
    v_data: torch.Tensor
    v_scale: torch.Tensor
    length: int
    block: int = BLOCK
    trusted: bool = False
    used: torch.Tensor | None = None  # int32 (B,) on the device: tokens [0, used[b]) valid, the rest of ``length`` not

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the valid tokens, (B, H, length, D) in ``dtype``. A view with ``used`` (a device-position
        cache's decode step) has no exact copy of ``length`` tokens: ValueError."""
        if self.used is not None:
            raise ValueError("this FP8 cache view holds its valid length on the device (Fp8StaticCache with "
                             "device_position=True): only llm_attn's decode kernel reads it; a call that needs the "
                             "dequantised copy (stock attention, a forced or compiled path) needs "
                             "device_position=False")
        n, nb = self.length, n_blocks(self.length)
        k = dequantize(self.k_data[:, :, :n], self.k_scale[:, :, :nb], self.k_shift, dtype)
        return k, dequantize(self.v_data[:, :, :n], self.v_scale[:, :, :nb], None, dtype)


def fp8_kv_of(key: torch.Tensor) -> Fp8KV | None:
    """The FP8 cache a K tensor handed to attention was dequantised from, or None for any other tensor."""
    return getattr(key, FP8_KV_ATTR, None)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether a K/V the cache returned holds no values (the FP8 data must be read through ``fp8_kv_of``)."""
    return getattr(t, FP8_PLACEHOLDER_ATTR, False)


ROUNDINGS = ("float32", "kernel")


def decode_attention(q: torch.Tensor, kv: Fp8KV, causal: bool = True, scale: float | None = None,
                     return_lse: bool = False, seqused_k: torch.Tensor | None = None, rounding: str = "float32"):
    """Attention of ``q`` (B, Hq, Sq, D) over the FP8 cache's ``kv.length`` tokens, as a kernel computes it: one
    64-key block at a time, K and V dequantised in float32 with their block's scale, online softmax in float32
    with the exact running max. The query rows are the newest ``Sq`` tokens (already in the cache): with ``causal``
    row ``i`` sees keys ``0 .. length - Sq + i`` (bottom-right, the kernels' convention; decode, ``Sq == 1``, sees
    every key). ``seqused_k`` (B,) int32: batch ``b`` uses its first ``seqused_k[b]`` tokens only (clamped to
    ``[0, length]``; causality aligned to that length; a row that sees no key outputs 0, lse -inf). GQA: query head
    ``h`` reads KV head ``h // (Hq // H)``. ``rounding="kernel"``: the decode kernel's two roundings too (Q to fp16,
    P times the V scale to fp16; the module docstring); "float32" keeps both in float32. Returns the output in q's
    dtype, (B, Hq, Sq, D); with ``return_lse`` also the natural-log lse (B, Hq, Sq) float32 of the dequantised
    scores (k_shift included)."""
    b, hq, sq, d = q.shape
    hkv, n = kv.k_data.shape[1], kv.length
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if sq > n:
        raise ValueError(f"{sq} query rows but only {n} tokens in the cache: the queries are the newest tokens")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    g = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kernel = rounding == "kernel"
    qf = (q.to(torch.float16) if kernel else q).to(torch.float32).reshape(b, hkv, g * sq, d)  # a KV head's rows
    used = (torch.full((b,), n, device=q.device) if seqused_k is None
            else seqused_k.to(device=q.device, dtype=torch.int64).clamp(0, n))
    row_pos = torch.arange(sq, device=q.device).repeat(g).view(1, -1) + (used - sq).view(-1, 1)  # (B, G*Sq)
    m = torch.full((b, hkv, g * sq), float("-inf"), device=q.device)
    l = torch.zeros((b, hkv, g * sq), device=q.device)
    acc = torch.zeros((b, hkv, g * sq, d), device=q.device)
    for j in range(n_blocks(n)):
        lo, hi = j * BLOCK, min((j + 1) * BLOCK, n)
        k = kv.k_data[:, :, lo:hi].to(torch.float32) * kv.k_scale[:, :, j, None, None]
        v = kv.v_data[:, :, lo:hi].to(torch.float32) * kv.v_scale[:, :, j, None, None]
        s = torch.matmul(qf, k.transpose(-1, -2)) * sm_scale             # (B, H, G*Sq, keys)
        key_pos = torch.arange(lo, hi, device=q.device).view(1, 1, -1)
        hidden = key_pos >= used.view(-1, 1, 1)                            # (B, 1, keys): past the used tokens
        if causal:
            hidden = hidden | (key_pos > row_pos.unsqueeze(-1))            # (B, G*Sq, keys)
        s = s.masked_fill(hidden.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - safe.unsqueeze(-1))
        alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m - safe))
        l = l * alpha + p.sum(dim=-1)
        if kernel:  # fp16 (P * v_scale * 256) times V's e4m3 values * 2^-8: the kernel's operands, exact products
            pv = (p * (kv.v_scale[:, :, j, None, None] * 256.0)).to(torch.float16).to(torch.float32)
            v = kv.v_data[:, :, lo:hi].to(torch.float32) * 2.0 ** -8
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(pv, v)
        else:
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, v)
        m = m_new
    out = (acc / l.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).reshape(b, hq, sq, d).to(q.dtype)
    if not return_lse:
        return out
    shift = torch.matmul(qf, kv.k_shift.unsqueeze(-1)).squeeze(-1) * sm_scale  # the score shift smoothing removed
    lse = torch.where(l > 0, m + torch.log(l) + shift, torch.full_like(l, float("-inf")))
    return out, lse.reshape(b, hq, sq)

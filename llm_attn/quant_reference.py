"""The FP8 attention forward in PyTorch: the quantised algorithm of ``kernels/flash_fp8.h``, block for block and scale
for scale, so that the CUDA kernel can be checked against it and the CPU can run what the GPU runs.

- Q: one scale per (batch, head, query row), 1 for an all-zero row; with ``qk="int8"`` (the default) Q / scale
  rounded to the nearest integer (ties to even), scale = amax / 127; with ``qk="e4m3"`` e4m3, scale = amax / 448.
- K: minus its per-channel mean over the valid keys (``q . mean`` is the same for every key of a row, so no softmax
  row changes; it removes the per-channel bias that makes K's amax large), then as Q (int8 or e4m3) with one scale
  per (batch, KV head, 64 keys): a 64-key column group of the kernel's S tile, whichever tile (128 or 192) it runs;
  32 keys with ``pv="input"``.
- V: with ``pv="e4m3"`` (the default) e4m3 with one scale per (batch, KV head, channel) over the valid keys; with
  ``pv="input"`` not quantised (the caller's fp16/bf16 V, as the kernel's TMA reads it), keys past seqused_k zero
  either way.
- S = (Q8 K8^T) q_scale k_scale, masked (the int8 product is exact in the kernel); P = exp(S scale - rowmax) in
  fp32; P' = 256 P, e4m3(P') with ``pv="e4m3"``, P' rounded to q's dtype with ``pv="input"`` (the operand of the
  kernel's bf16/fp16 wgmma; float32/float64 inputs have no kernel and keep P' unrounded);
  O = (P' V') / (256 rowsum(P)) (V' = V8 v_scale or V), the row sum over the unquantised P; lse that of the
  quantised scores plus ``scale q . mean(K)`` (smoothing shifted every score of the row by that), whatever ``pv``.
  The kernel runs ``pv="input"`` with int8 Q K^T only (``llm_attn_int8qk``); this reference takes either.

The kernel quantises P against its running row max (online softmax, key tiles last to first); this reference
against the row's final max. Where the two maxima differ, P is rounded at a different point of the e4m3 (or
bf16/fp16) grid: the two agree to that rounding, not bit for bit (and the kernel's key tile, 128 or 192, moves where
they differ; nothing else in these semantics depends on it).
"""

from __future__ import annotations

import math

import torch

from llm_attn.reference import _group, _valid_key_mask

E4M3_MAX = 448.0
INT8_MAX = 127.0
QK = ("int8", "e4m3")  # the operands of Q K^T (kernels/flash_fp8.h Fp8Qk)
PV = ("e4m3", "input")  # the operands of P V (kernels/flash_fp8.h Fp8Pv)
Q_BLOCK = 1      # query rows per Q scale (kernels/quant_fp8.cuh fp8_quant_q_kernel: one per row)
K_BLOCK = 64     # keys per K scale (kFp8KBlock: a 64-key column group of the kernel's S tile)
K_BLOCK_PV_INPUT = 32  # the same with pv="input" (kFp8KBlockPvInput: finer, for that variant's accuracy)
P_SCALE = 256.0  # P in [0, 1] -> [0, 256] before e4m3 (or the input dtype: the kernel's P' either way)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to e4m3 (round to nearest even, saturating at +-448, as ``cvt.rn.satfinite``), returned as
    float32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def _scale(amax: torch.Tensor, top: float = E4M3_MAX) -> torch.Tensor:
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def _blockwise(x: torch.Tensor, block: int, qk: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 (or int8, ``qk="int8"``) of (B, H, S, D) float32 with one scale per ``block`` rows of each head:
    (dequantised x, scales). The kernel multiplies by the scale's float32 reciprocal, as here."""
    b, h, s, d = x.shape
    n = -(-s // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, n * block - s)).view(b, h, n, block, d)
    int8 = qk == "int8"
    scale = _scale(padded.abs().amax(dim=(-1, -2)), INT8_MAX if int8 else E4M3_MAX)   # (B, H, n)
    inv = (1.0 / scale).view(b, h, n, 1, 1)
    rounded = torch.round(padded * inv).clamp(-128, 127) if int8 else e4m3(padded * inv)
    q = rounded * scale.view(b, h, n, 1, 1)
    return q.view(b, h, n * block, d)[:, :, :s], scale


def _check(qk: str, pv: str) -> None:
    if qk not in QK:
        raise ValueError(f"qk must be one of {', '.join(QK)}, not {qk!r}")
    if pv not in PV:
        raise ValueError(f"pv must be one of {', '.join(PV)} (the operands of P V), not {pv!r}")


def quantize_fp8(q, k, v, seqused_k=None, return_mean=False, qk: str = "int8", pv: str = "e4m3"):
    """The dequantised operands the kernel multiplies (float32): (Q8 q_scale, K8 k_scale, V8 v_scale), K smoothed,
    keys past each batch's valid length zero; with ``return_mean`` also K's channel mean (B, Hkv, 1, D). ``qk``: Q
    and K in int8 or e4m3; ``pv="input"``: V as given (float32 of it), not e4m3."""
    _check(qk, pv)
    b, _, _, d = q.shape
    sk = k.shape[2]
    used = (torch.full((b,), sk, dtype=torch.long, device=k.device) if seqused_k is None
            else seqused_k.to(device=k.device, dtype=torch.long).clamp(0, sk))
    valid = (torch.arange(sk, device=k.device).view(1, 1, sk, 1) < used.view(b, 1, 1, 1))   # (B, 1, Sk, 1)
    kf = torch.where(valid, k.float(), 0.0)
    vf = torch.where(valid, v.float(), 0.0)
    mean = kf.sum(dim=2, keepdim=True) / used.clamp(min=1).view(b, 1, 1, 1).float()
    ks = torch.where(valid, kf - mean, 0.0)
    qd, _ = _blockwise(q.float(), Q_BLOCK, qk)
    kd, _ = _blockwise(ks, K_BLOCK_PV_INPUT if pv == "input" else K_BLOCK, qk)
    if pv == "input":
        vd = vf
    else:
        v_scale = _scale(vf.abs().amax(dim=2, keepdim=True))                  # (B, Hkv, 1, D)
        vd = e4m3(vf * (1.0 / v_scale)) * v_scale
    return (qd, kd, vd, mean) if return_mean else (qd, kd, vd)


def attention_fp8(q, k, v, causal=False, scale=None, seqused_k=None, return_lse=False, qk: str = "int8",
                  pv: str = "e4m3"):
    """FP8 attention (see the module docstring): ``out`` in q's dtype, (B, Hq, Sq, D); with ``return_lse`` also the
    natural-log lse, float32 (B, Hq, Sq). Same conventions as ``llm_attn.reference.attention_naive`` (GQA,
    bottom-right causal, seqused_k). ``qk``: the operands of Q K^T, int8 (the default) or e4m3; ``pv``: those of
    P V, e4m3 (the default) or ``"input"`` (P in q's dtype, V unquantised: ``llm_attn_int8qk``)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qd, kd, vd, mean = quantize_fp8(q, k, v, seqused_k, return_mean=True, qk=qk, pv=pv)
    s = torch.matmul(_group(qd, hkv), kd.unsqueeze(2).transpose(-1, -2)) * scale     # (B, Hkv, G, Sq, Sk)
    mask = _valid_key_mask(sq, sk, causal, seqused_k, b, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(s - safe_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    if pv == "e4m3":
        p8 = e4m3(p * P_SCALE)
    elif q.dtype in (torch.float16, torch.bfloat16):
        p8 = (p * P_SCALE).to(q.dtype).float()  # round to nearest even, as the kernel's cvt.rn
    else:
        p8 = p * P_SCALE
    out = torch.matmul(p8, vd.unsqueeze(2)) / (P_SCALE * torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum)))
    shift = torch.matmul(_group(q.float(), hkv), mean.unsqueeze(2).transpose(-1, -2)) * scale     # (B, Hkv, G, Sq, 1)
    lse = torch.where(row_sum > 0, safe_max + torch.log(row_sum) + shift, torch.full_like(row_sum, float("-inf")))
    out = out.reshape(b, hq, sq, d).to(q.dtype)
    return (out, lse.reshape(b, hq, sq)) if return_lse else out

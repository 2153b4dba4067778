"""Stock transformers attention as registry entries: ``eager``, ``sdpa``, ``flash_attention_2``.

The harness measures them as users run them, through ``model.set_attn_implementation(hf_name)``. Their ``fn``
(the flash_attn_func contract, the same maths) serves ``patch_model(model, impl=...)`` and the kernel benchmark.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from llm_attn.registry import register_attention

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def visible_keys(sq: int, sk: int, causal: bool, seqused_k, batch: int, device) -> torch.Tensor | None:
    """Boolean (B or 1, 1, Sq, Sk) mask of the keys each query sees under the contract, or None for all keys."""
    if not causal and seqused_k is None:
        return None
    kpos = torch.arange(sk, device=device).view(1, 1, 1, sk)
    qpos = torch.arange(sq, device=device).view(1, 1, sq, 1)
    used = (torch.full((1,), sk, device=device) if seqused_k is None else seqused_k.to(torch.long)).view(-1, 1, 1, 1)
    mask = kpos < used
    if causal:
        mask = mask & (kpos <= qpos + used - sq)
    return mask


def eager(q, k, v, *, causal, scale, seqused_k=None):
    """What transformers' eager attention computes: scores and probabilities materialised, softmax in float32."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = visible_keys(q.shape[2], k.shape[2], causal, seqused_k, q.shape[0], q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(q.dtype)  # rows with no key: 0
    return torch.matmul(p, v)


def sdpa(q, k, v, *, causal, scale, seqused_k=None):
    """torch SDPA with GQA; bottom-right causality through an explicit mask unless Sq == Sk (SDPA's is_causal is
    top-left). Rows that see no key are 0, as the contract says (SDPA would give NaN)."""
    sq, sk = q.shape[2], k.shape[2]
    if seqused_k is None and (not causal or sq == sk):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and sq > 1, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    mask = visible_keys(sq, sk, causal, seqused_k, q.shape[0], q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))


def _flash_attn_missing() -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return ("flash_attention_2 needs the flash_attn package, which is not installed "
                "(python -m pip install flash-attn)")
    return None


def flash_attention_2(q, k, v, *, causal, scale, seqused_k=None):
    """The flash-attn package (its causal mask is bottom-right since 2.1, like ours)."""
    from flash_attn import flash_attn_func  # noqa: PLC0415

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=causal)
    return out.transpose(1, 2)


register_attention("eager", eager, dtypes=FLOATS, devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="transformers eager: matmul + float32 softmax, K/V expanded", hf_name="eager",
                   default=True)
register_attention("sdpa", sdpa, dtypes=FLOATS, devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="torch scaled_dot_product_attention (cuDNN/flash/efficient/math by dispatch)",
                   hf_name="sdpa", default=True)


register_attention("flash_attention_2", flash_attention_2, dtypes=(torch.float16, torch.bfloat16),
                   devices=("cuda",), supports_seqused_k=False,
                   description="the flash-attn package (Dao-AILab), as transformers runs it",
                   hf_name="flash_attention_2", default=True, requires=_flash_attn_missing)

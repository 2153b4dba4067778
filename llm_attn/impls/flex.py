"""``flex``: PyTorch's ``flex_attention`` compiled with ``torch.compile`` — the peer a PyTorch user tries first.

Causality (bottom-right) is a block mask, built once per (q_len, kv_len, device) and cached; GQA through
``enable_gqa``; one compiled function shared by all calls (torch.compile specialises per shape and then goes
dynamic). On CPU the uncompiled flex_attention runs (correctness only; it says nothing about speed).
``seqused_k`` would need a data-dependent block mask per call: such calls take the stock path.
"""

from __future__ import annotations

import functools
import warnings

import torch

from llm_attn.registry import register_attention


def _missing() -> str | None:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401, PLC0415
    except ImportError as e:
        return f"flex needs torch.nn.attention.flex_attention (torch >= 2.5): {e}"
    return None


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=64)
def _causal_block_mask(sq: int, sk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    offset = sk - sq

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)


def flex(q, k, v, *, causal, scale, seqused_k=None):
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    if seqused_k is not None:
        raise ValueError("flex does not take seqused_k (registered with supports_seqused_k=False)")
    sq, sk = q.shape[2], k.shape[2]
    causal = causal and sq > 1
    mask = _causal_block_mask(sq, sk, str(q.device)) if causal else None
    if q.is_cuda:
        out = _compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    else:
        with warnings.catch_warnings():  # "called without torch.compile": on CPU that is the point
            warnings.simplefilter("ignore", UserWarning)
            out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if causal and sq > sk:
        out[:, :, : sq - sk] = 0  # rows that see no key: 0 under the contract
    return out


register_attention("flex", flex, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                   head_dims=(16, 32, 64, 128, 256), devices=("cuda", "cpu"), supports_seqused_k=False,
                   description="torch.compile(flex_attention) with a causal block mask (uncompiled on CPU)",
                   requires=_missing)

"""``naive``: softmax(Q Kᵀ) V with the whole score matrix materialised in the input dtype — the seeds' baseline.

Memory is O(Sq·Sk) per head (it shows in peak memory); precision is that of the input dtype throughout (fp16/bf16
scores and probabilities), unlike transformers' eager, which takes the softmax in float32.
"""

from __future__ import annotations

import torch

from llm_attn.impls.stock import visible_keys
from llm_attn.registry import register_attention


def naive_attention(q, k, v, *, causal, scale, seqused_k=None):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, sq, d)                          # GQA by broadcasting, K/V not expanded
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale    # (B, Hkv, G, Sq, Sk), input dtype
    mask = visible_keys(sq, k.shape[2], causal, seqused_k, b, q.device)
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)                      # a row that sees no key: 0
    return torch.matmul(p, v.unsqueeze(2)).reshape(b, hq, sq, d)


register_attention("naive", naive_attention, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
                   devices=("cuda", "cpu"), supports_seqused_k=True,
                   description="materialised softmax(QK^T)V in the input dtype (O(N^2) memory)")

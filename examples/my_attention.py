"""A complete llm_attn attention plugin: a plain-PyTorch kernel, registered as "mine".

    python -m llm_attn.ttft --plugin examples/my_attention.py --impl mine sdpa --seq 2048
    python -m llm_attn.bench --plugin examples/my_attention.py --impls mine flash      # kernel benchmark (GPU)

It processes the queries in chunks of 256 rows, so the score matrix held at a time is 256 x kv_len (float32),
not q_len x kv_len. Swap the body of ``chunked_attention`` for your Triton, CUDA or Numba launch: the contract
(shapes, bottom-right causality, seqused_k) stays the same.
"""

import torch

import llm_attn

CHUNK = 256


def chunked_attention(q, k, v, *, causal, scale, seqused_k=None):
    """q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D); returns (B, Hq, Sq, D) in q's dtype."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1).float()        # GQA: query head h reads KV head h // (Hq // Hkv)
    v = v.repeat_interleave(hq // hkv, dim=1).float()
    used = torch.full((b,), sk, device=q.device) if seqused_k is None else seqused_k.long()
    used = used.view(b, 1, 1, 1)
    keys = torch.arange(sk, device=q.device).view(1, 1, 1, sk)
    out = torch.empty_like(q)
    for start in range(0, sq, CHUNK):
        rows = torch.arange(start, min(start + CHUNK, sq), device=q.device).view(1, 1, -1, 1)
        s = torch.matmul(q[:, :, start:start + CHUNK].float(), k.transpose(-1, -2)) * scale
        visible = keys < used
        if causal:
            visible = visible & (keys <= rows + used - sq)        # bottom-right: the last query sees every key
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)              # a row that sees no key outputs 0
        out[:, :, start:start + CHUNK] = torch.matmul(p, v).to(q.dtype)
    return out


llm_attn.register_attention(
    "mine", chunked_attention,
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    head_dims=None,                      # any head_dim
    devices=("cuda", "cpu"),
    supports_seqused_k=True,             # StaticCache decode runs here too, not on the stock path
    description="example plugin: query-chunked attention in plain PyTorch",
)

"""Pure-PyTorch attention references.

Two functions, both in the (batch, heads, seq, head_dim) layout that transformers and SDPA use:

- ``attention_tiled`` runs the same algorithm as the CUDA kernel (FlashAttention-2: K/V processed a block at a
  time, online softmax with a running max and running sum, the full score matrix never materialised). It runs on
  any device and is the path the package takes when no CUDA kernel is available (CPU, CI).
- ``attention_naive`` materialises the score matrix. It is the ground truth in tests (computed in float64).

Conventions shared with the kernel (see ``llm_attn.ops.flash_attn_func``):

- GQA/MQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. K/V are never expanded in memory; here the query
  heads are viewed as ``(Hkv, group)`` and broadcast against K/V.
- Causal masking is aligned bottom-right: query row ``i`` sees key ``j`` iff ``j <= i + (Sk - Sq)``, so a
  ``q_len < kv_len`` chunk appended to a cache sees the whole prefix. Rows that see no key (only possible when
  ``Sq > Sk``) produce zeros and ``lse = -inf``.
- ``seqused_k`` (int32, shape (B,)) limits batch ``b`` to its first ``seqused_k[b]`` keys, as in a static KV cache;
  causal alignment is then relative to that length. Values are clamped to ``[0, Sk]``.
- The log-sum-exp is natural-log, float32, shape (B, Hq, Sq).
"""

from __future__ import annotations

import math

import torch


def _valid_key_mask(q_len: int, kv_len: int, causal: bool, seqused_k: torch.Tensor | None, batch: int,
                    device) -> torch.Tensor | None:
    """Boolean (B or 1, 1, 1, Sq, Sk) mask of keys each query may see, or None when every key is visible."""
    if not causal and seqused_k is None:
        return None
    kpos = torch.arange(kv_len, device=device)
    qpos = torch.arange(q_len, device=device)
    if seqused_k is None:
        used = torch.full((1,), kv_len, device=device, dtype=torch.long)
    else:
        # Values past kv_len mean kv_len and values below 0 mean 0 (the kernels clamp the same way, on the device).
        used = seqused_k.to(device=device, dtype=torch.long).reshape(batch).clamp(0, kv_len)
    used = used.view(-1, 1, 1)  # (B', 1, 1)
    mask = kpos.view(1, 1, -1) < used  # (B', 1, Sk)
    if causal:
        mask = mask & (kpos.view(1, 1, -1) <= qpos.view(1, -1, 1) + (used - q_len))
    return mask.view(mask.shape[0], 1, 1, mask.shape[1], mask.shape[2])


def _group(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    b, hq, sq, d = q.shape
    return q.reshape(b, num_kv_heads, hq // num_kv_heads, sq, d)


def attention_naive(q, k, v, causal=False, scale=None, seqused_k=None, compute_dtype=torch.float64):
    """Reference with the whole score matrix. Returns (out in ``compute_dtype``, lse float32)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = _group(q.to(compute_dtype), hkv)                      # (B, Hkv, G, Sq, D)
    kk = k.to(compute_dtype).unsqueeze(2)                      # (B, Hkv, 1, Sk, D)
    vv = v.to(compute_dtype).unsqueeze(2)
    s = torch.matmul(qg, kk.transpose(-1, -2)) * scale          # (B, Hkv, G, Sq, Sk)
    mask = _valid_key_mask(sq, sk, causal, seqused_k, b, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = torch.nan_to_num(p, nan=0.0)                           # fully masked rows: exp(-inf - -inf)
    out = torch.matmul(p, vv)
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq).float()


def attention_tiled(q, k, v, causal=False, scale=None, seqused_k=None, block_n: int = 64,
                    compute_dtype=torch.float32):
    """FlashAttention-2 forward in PyTorch: online softmax over blocks of ``block_n`` keys.

    Returns ``(out, lse)``: ``out`` in ``q.dtype`` with shape (B, Hq, Sq, D), ``lse`` float32 (B, Hq, Sq).
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cd = torch.float64 if q.dtype == torch.float64 else compute_dtype
    qg = _group(q.to(cd), hkv) * scale                          # (B, Hkv, G, Sq, D)
    g = hq // hkv
    row_max = torch.full((b, hkv, g, sq), float("-inf"), dtype=cd, device=q.device)
    row_sum = torch.zeros((b, hkv, g, sq), dtype=cd, device=q.device)
    acc = torch.zeros((b, hkv, g, sq, d), dtype=cd, device=q.device)
    mask = _valid_key_mask(sq, sk, causal, seqused_k, b, q.device)
    for start in range(0, sk, block_n):
        end = min(start + block_n, sk)
        kb = k[:, :, start:end].to(cd).unsqueeze(2)              # (B, Hkv, 1, n, D)
        vb = v[:, :, start:end].to(cd).unsqueeze(2)
        s = torch.matmul(qg, kb.transpose(-1, -2))              # (B, Hkv, G, Sq, n)
        if mask is not None:
            s = s.masked_fill(~mask[..., start:end], float("-inf"))
        new_max = torch.maximum(row_max, s.amax(dim=-1))
        # A row that has seen only masked keys keeps max = -inf; use 0 there so exp() gives 0, not NaN.
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        correction = torch.exp(row_max - safe_max)
        p = torch.exp(s - safe_max.unsqueeze(-1))
        row_sum = row_sum * correction + p.sum(dim=-1)
        acc = acc * correction.unsqueeze(-1) + torch.matmul(p, vb)
        row_max = new_max
    empty = row_sum == 0
    out = acc / torch.where(empty, torch.ones_like(row_sum), row_sum).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(row_sum, float("-inf")), row_max + torch.log(row_sum))
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq).float()


def attention_backward(dout, q, k, v, out, lse, causal=False, scale=None, seqused_k=None, dlse=None,
                       compute_dtype=torch.float32, block_m: int = 256):
    """FlashAttention backward in PyTorch, by recomputation from the saved ``lse`` (as the kernel does).

    With P = exp(S - lse) recomputed per block of ``block_m`` query rows (the full score matrix is never
    materialised for all rows at once), D = rowsum(dO * O) - dlse:
    dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q; dK and dV are summed over the
    query heads of each KV head (GQA/MQA). ``dlse`` is the gradient of the lse output (None: not used).
    Keys past ``seqused_k`` get zero gradients and are never read (they may hold anything, NaN included).
    Returns (dq, dk, dv) in the dtypes of q, k, v.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cd = torch.float64 if q.dtype == torch.float64 else compute_dtype
    qg = _group(q.to(cd), hkv)                                   # (B, Hkv, G, Sq, D)
    dog = _group(dout.to(cd), hkv)
    og = _group(out.to(cd), hkv)
    kk = k.to(cd).unsqueeze(2)                                   # (B, Hkv, 1, Sk, D)
    vv = v.to(cd).unsqueeze(2)
    if seqused_k is not None:
        used = (torch.arange(sk, device=q.device).view(1, -1) < seqused_k.to(q.device, torch.long).view(-1, 1))
        used = used.view(b, 1, 1, sk, 1)
        kk = torch.where(used, kk, torch.zeros((), dtype=cd, device=q.device))
        vv = torch.where(used, vv, torch.zeros((), dtype=cd, device=q.device))
    lse_g = lse.to(cd).reshape(b, hkv, g, sq)
    # Rows that see no key have lse = -inf and P = 0: subtracting +inf gives exactly that.
    lse_g = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, float("inf")), lse_g)
    dsum = (dog * og).sum(-1)                                    # (B, Hkv, G, Sq)
    if dlse is not None:
        dsum = dsum - dlse.to(cd).reshape(b, hkv, g, sq)
    mask = _valid_key_mask(sq, sk, causal, seqused_k, b, q.device)
    dq = torch.empty_like(qg)
    dk = torch.zeros((b, hkv, 1, sk, d), dtype=cd, device=q.device)
    dv = torch.zeros((b, hkv, 1, sk, d), dtype=cd, device=q.device)
    for start in range(0, sq, block_m):
        rows = slice(start, min(start + block_m, sq))
        s = torch.matmul(qg[..., rows, :], kk.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[..., rows, :], float("-inf"))
        # The saved lse is float32: in float64 recompute it so that gradients are exact to float64 (gradcheck).
        lse_rows = lse_g[..., rows] if cd != torch.float64 else torch.logsumexp(s, dim=-1)
        lse_rows = torch.where(torch.isneginf(lse_rows), torch.full_like(lse_rows, float("inf")), lse_rows)
        p = torch.exp(s - lse_rows.unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), dog[..., rows, :]).sum(2, keepdim=True)
        dp = torch.matmul(dog[..., rows, :], vv.transpose(-1, -2))
        ds = p * (dp - dsum[..., rows].unsqueeze(-1))
        dq[..., rows, :] = torch.matmul(ds, kk) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2, keepdim=True) * scale
    return (dq.reshape(b, hq, sq, d).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype))

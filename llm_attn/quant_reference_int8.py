"""PyTorch reference of the portable INT8 forward (kernels/flash_int8.h, issue 34 item 2): the same quantisation
blocks, the same scales and the same tile-by-tile online softmax as the CUDA kernels, on any device (CPU in tests).

What the kernel computes, and so this file:

- K is smoothed: ``K' = K - mean``, the per-channel mean over the valid keys of each (batch, KV head). ``q . mean``
  is the same for every key of a row, so no softmax row changes; the lse adds ``scale * q . mean`` back.
- K' in int8 with one scale per (batch, KV head, 32 keys) = amax / 127; Q in int8 with one scale per (batch, head,
  row) = amax / 127. Rounding to nearest even.
- S = (Q8 K8^T) * q_scale[row] * k_scale[32-key group] * scale * log2(e), per 128-key tile, masked (keys past
  ``seqused_k``, above the bottom-right causal diagonal).
- ``pv="e4m3"`` (the kernel's path on sm_89; sm_90 has no native e4m3 mma.sync): V in e4m3 with one scale per (batch, KV head, channel) = amax /
  448; exact running max; P * 256 = exp2(S - max + 8) rounded to e4m3 for P V; the row sum over the unrounded P.
- ``pv="input"`` (sm_80/86/87/90, or forced): V as given; the bf16 kernel's lazy rescale (a 16-row group moves its max
  only when some row's tile max exceeds it by more than 8, in log2 units); P rounded to the input dtype.
- Keys at or past ``seqused_k`` may hold anything (NaN): they are zeroed before any arithmetic. Rows that see no
  key: output 0, lse -inf.

Not modelled: the FP8 mma's internal accumulation (the kernel adds each tile's P V to O in fp32; inside a tile the
hardware's e4m3 accumulation is somewhat below fp32) and the kernel's folding of the dequantisation into one FMA
(a rounding of the exponent's constant, ~1e-4 relative at most). ``quantize_kv`` returns the workspace in the
kernel's layout, to compare the CUDA pre-pass against.
"""

from __future__ import annotations

import math

import torch

BLOCK_N = 128      # keys per key tile (kInt8BlockN)
K_BLOCK = 32       # keys per K scale (kInt8KBlock): 4 per tile
WARP_ROWS = 16     # query rows per warp (kInt8WarpRows): the lazy rescale's vote; Q has one scale per row
E4M3_MAX = 448.0
P_OFFSET_E4M3 = 8.0   # P * 2^8 in e4m3
RESCALE_LOG2 = 8.0    # the input-dtype path's lazy-rescale threshold
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def v_key_of_position(j: int) -> int:
    """The key stored at position ``j`` (0..15) of each 16-key group of the transposed e4m3 V (int8_v_key_of_position
    in kernels/flash_fwd_int8_quant.cuh): thread t's 4 bytes of P hold keys 2t, 2t+1, 8+2t, 9+2t."""
    return 2 * (j >> 2) + (j & 1) + ((j & 2) << 2)


def _used_keys(seqused_k, batch: int, sk: int, device) -> torch.Tensor:
    if seqused_k is None:
        return torch.full((batch,), sk, dtype=torch.long, device=device)
    return seqused_k.to(device=device, dtype=torch.long).reshape(batch).clamp(0, sk)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (nearest even, saturating at +-448) and back to float32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def _div_or_zero(num: float, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))


def quantize_kv(k: torch.Tensor, v: torch.Tensor, seqused_k=None, pv: str = "e4m3") -> dict:
    """The pre-pass (int8_kv_stats_kernel + int8_quant_kv_kernel) in the workspace's layout:

    ``k_int8`` (B, Hkv, Sk_pad, D) int8; ``k_scale`` (B, Hkv, Sk_pad / 32); ``k_mean`` (B, Hkv, D);
    ``v_fp8`` (B, Hkv, Sk_pad / 128, D, 128) as uint8 e4m3 bits (V^T per 128-key tile, tile-major), keys permuted
    within each 16 (``v_key_of_position``), and ``v_scale`` (B, Hkv, D) with ``pv="e4m3"``. Also, for the attention below: ``kq`` (K8 as float32, keys in order),
    ``vq`` (V as the kernel multiplies it, float32, keys in order, not yet times v_scale), ``used`` (B,).
    Keys at or past the valid length are zero (the kernel does not write tiles wholly past them; here they are zero).
    """
    b, hkv, sk, d = k.shape
    used = _used_keys(seqused_k, b, sk, k.device)
    sk_pad = (sk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    valid = (torch.arange(sk, device=k.device).view(1, -1) < used.view(-1, 1)).view(b, 1, sk, 1)
    kf = torch.where(valid, k.float(), torch.zeros((), device=k.device))
    vf = torch.where(valid, v.float(), torch.zeros((), device=k.device))

    mean = kf.sum(dim=2) / used.clamp(min=1).to(torch.float32).view(b, 1, 1)      # (B, Hkv, D)
    ks = torch.where(valid, kf - mean.unsqueeze(2), torch.zeros((), device=k.device))
    ks = torch.nn.functional.pad(ks, (0, 0, 0, sk_pad - sk))
    blocks = ks.view(b, hkv, sk_pad // K_BLOCK, K_BLOCK, d)
    amax = blocks.abs().amax(dim=(-1, -2))                                          # (B, Hkv, Sk_pad / 32)
    k_scale = amax / 127.0
    kq = torch.round(blocks * _div_or_zero(127.0, amax)[..., None, None]).view(b, hkv, sk_pad, d)
    out = {"k_int8": kq.to(torch.int8), "k_scale": k_scale, "k_mean": mean, "kq": kq, "used": used}

    if pv == "e4m3":
        vamax = vf.abs().amax(dim=2)                                                # (B, Hkv, D)
        v8 = _e4m3(vf * _div_or_zero(E4M3_MAX, vamax).unsqueeze(2))
        v8 = torch.nn.functional.pad(v8, (0, 0, 0, sk_pad - sk))
        perm = torch.tensor([g * 16 + v_key_of_position(j) for g in range(sk_pad // 16) for j in range(16)],
                            device=k.device)
        vt = v8.transpose(2, 3)[..., perm]                                          # (B, Hkv, D, Sk_pad) permuted
        vt = vt.view(b, hkv, d, sk_pad // BLOCK_N, BLOCK_N).transpose(2, 3).contiguous()  # tile-major
        out.update(v_fp8=vt.to(torch.float8_e4m3fn).view(torch.uint8), v_scale=vamax / E4M3_MAX, vq=v8)
    elif pv == "input":
        out.update(vq=torch.nn.functional.pad(vf, (0, 0, 0, sk_pad - sk)))
    else:
        raise ValueError(f"pv must be 'e4m3' or 'input', not {pv!r}")
    return out


def quantize_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8 (B, H, Sq_pad, D) as float32 integers and q_scale (B, H, Sq_pad), one per row: what each warp of the kernel
    holds (rows padded to whole warps of 16, the padding zero)."""
    b, h, sq, d = q.shape
    sq_pad = (sq + WARP_ROWS - 1) // WARP_ROWS * WARP_ROWS
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, sq_pad - sq))
    amax = qf.abs().amax(dim=-1)                                                     # (B, H, Sq_pad)
    qq = torch.round(qf * _div_or_zero(127.0, amax)[..., None])
    return qq, amax / 127.0


def attention_int8(q, k, v, causal=False, scale=None, seqused_k=None, *, pv: str = "e4m3"):
    """The INT8 forward, (batch, heads, seq, head_dim) layout as ``attention_naive``. Returns ``(out, lse)``: out in
    ``q.dtype`` (B, Hq, Sq, D), lse float32 (B, Hq, Sq) in natural log."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scale_log2 = torch.tensor(scale * LOG2E, dtype=torch.float32, device=q.device)
    kv = quantize_kv(k, v, seqused_k, pv)
    used = kv["used"]
    qq, q_scale = quantize_q(q)
    sq_pad = qq.shape[2]
    n_groups = sq_pad // WARP_ROWS
    c_row = (q_scale * scale_log2).unsqueeze(-1)                                     # (B, Hq, Sq_pad, 1)

    heads = torch.arange(hq, device=q.device) // group                               # query head -> KV head
    kq = kv["kq"][:, heads]                                                           # (B, Hq, Sk_pad, D)
    vq = kv["vq"][:, heads]
    k_scale = kv["k_scale"][:, heads]                                                 # (B, Hq, Sk_pad / 32)
    p_off = P_OFFSET_E4M3 if pv == "e4m3" else 0.0
    n_tiles = kq.shape[2] // BLOCK_N

    rows = torch.arange(sq_pad, device=q.device).view(1, 1, sq_pad, 1)
    offset = (used - sq).view(b, 1, 1, 1)
    row_max = torch.full((b, hq, sq_pad), -math.inf, device=q.device)
    row_sum = torch.zeros((b, hq, sq_pad), device=q.device)
    o = torch.zeros((b, hq, sq_pad, d), device=q.device)
    for n in range(n_tiles):
        key0 = n * BLOCK_N
        keys = torch.arange(key0, key0 + BLOCK_N, device=q.device).view(1, 1, 1, -1)
        s_int = torch.matmul(qq.double(), kq[:, :, key0:key0 + BLOCK_N].double().transpose(-1, -2))
        ks = k_scale[:, :, key0 // K_BLOCK:(key0 + BLOCK_N) // K_BLOCK].repeat_interleave(K_BLOCK, dim=-1)
        c = torch.clamp(c_row * ks.unsqueeze(2), min=1e-30)                          # (B, Hq, Sq_pad, BLOCK_N)
        x = s_int.float() * c
        ok = keys < used.view(b, 1, 1, 1)
        if causal:
            ok = ok & (keys <= rows + offset)
        x = x.masked_fill(~ok, -math.inf)
        tile_max = x.amax(dim=-1)
        if pv == "e4m3":
            new_max = torch.maximum(row_max, tile_max)
        else:
            grow = (tile_max > row_max + RESCALE_LOG2).view(b, hq, n_groups, WARP_ROWS).any(dim=-1)
            grow = grow.repeat_interleave(WARP_ROWS, dim=-1)
            new_max = torch.where(grow, torch.maximum(row_max, tile_max), row_max)
        mm = torch.where(new_max == -math.inf, torch.zeros((), device=q.device), new_max)
        alpha = torch.exp2(row_max - mm)
        p = torch.exp2(x - (mm - p_off).unsqueeze(-1))
        row_sum = row_sum * alpha + p.sum(dim=-1)
        pq = _e4m3(p) if pv == "e4m3" else p.to(q.dtype).float()
        o = o * alpha.unsqueeze(-1) + torch.matmul(pq, vq[:, :, key0:key0 + BLOCK_N])
        row_max = new_max

    inv = _div_or_zero(1.0, row_sum).unsqueeze(-1)
    out = o * inv
    if pv == "e4m3":
        out = out * kv["v_scale"][:, heads].unsqueeze(2)
    q_mean = (q.float() * kv["k_mean"][:, heads].unsqueeze(2)).sum(dim=-1)          # (B, Hq, Sq)
    lse = (row_max - p_off + torch.log2(row_sum)) * LN2
    lse = torch.where(row_sum > 0, lse, torch.full_like(lse, -math.inf))[:, :, :sq]
    lse = torch.where(row_sum[:, :, :sq] > 0, lse + scale * q_mean, lse)
    return out[:, :, :sq].to(q.dtype), lse.float()

"""AWQ "GEMM" int4 checkpoint format: packing, unpacking and dequantisation, written from the format's definition.

The format (AutoAWQ's `version: "gemm"`, what transformers + gptqmodel load for `quant_method: "awq"`), for a linear
layer y = x @ W with W of shape [in_features, out_features] (the transpose of nn.Linear.weight):

    qweight  int32 [in, out/8]           eight 4-bit codes per word, along the output dimension
    qzeros   int32 [in/group, out/8]     one 4-bit zero point per (group of `group` input rows, output column),
                                         packed the same way as qweight
    scales   fp16  [in/group, out]       one scale per (group, output column)
    W[i, j] = (q[i, j] - z[i // group, j]) * s[i // group, j]      (asymmetric, zero point stored as-is, no +1)

Inside each int32 word, nibble k (bits 4k..4k+3) holds output column 8*word + AWQ_PACK_ORDER[k]: the columns are
interleaved 0,2,4,6,1,3,5,7 so that the CUDA kernels can unpack pairs with one shift. Getting this order wrong
still "loads" but silently permutes weights, which is why tests compare our dequantisation against the loader's.

Nothing here imports gptqmodel: the synthetic writer and the dequantising fallback loader use these functions, and
the tests check them against gptqmodel's own unpacking.
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # codes per int32 word
# Nibble k of a word holds column AWQ_PACK_ORDER[k] of its block of 8 output columns.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS_CACHE:
        _SHIFTS_CACHE[device] = torch.arange(0, 32, BITS, dtype=torch.int64, device=device)
    return _SHIFTS_CACHE[device]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Packs 4-bit codes (any integer dtype, values 0..15) along the last dim into AWQ-ordered int32 words.

    codes: [..., N] with N % 8 == 0  ->  int32 [..., N/8].
    """
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"pack_int4: codes must be an integer tensor, got {codes.dtype}")
    n = codes.shape[-1]
    if n % PACK:
        raise ValueError(f"pack_int4: last dimension must be a multiple of {PACK}, got {n}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
        raise ValueError("pack_int4: codes must lie in 0..15")
    c = c.reshape(*codes.shape[:-1], n // PACK, PACK)[..., list(AWQ_PACK_ORDER)]
    words = (c << _shifts(c.device)).sum(dim=-1)  # 0 .. 2^32-1, exact in int64
    # Reinterpret as signed 32-bit two's complement (the checkpoint stores int32).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int32 [..., M] -> int64 codes [..., 8*M] in column order."""
    if words.dtype != torch.int32:
        raise TypeError(f"unpack_int4: expected int32 words, got {words.dtype}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    nibbles = (w.unsqueeze(-1) >> _shifts(w.device)) & 0xF  # [..., M, 8], nibble k
    cols = torch.empty_like(nibbles)
    cols[..., list(AWQ_PACK_ORDER)] = nibbles  # column AWQ_PACK_ORDER[k] <- nibble k
    return cols.reshape(*words.shape[:-1], words.shape[-1] * PACK)


def check_awq_shapes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    """Validates one layer's AWQ tensors; returns (in_features, out_features)."""
    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise ValueError("AWQ tensors must be 2-D (qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out])")
    in_f, out_f = qweight.shape[0], qweight.shape[1] * PACK
    if group_size <= 0 or in_f % group_size:
        raise ValueError(f"AWQ: in_features {in_f} is not a multiple of group_size {group_size}")
    groups = in_f // group_size
    if tuple(scales.shape) != (groups, out_f) or tuple(qzeros.shape) != (groups, out_f // PACK):
        raise ValueError(
            f"AWQ: inconsistent shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)} for group_size {group_size} (expected qzeros {(groups, out_f // PACK)}, "
            f"scales {(groups, out_f)})")
    return in_f, out_f


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Dequantises one AWQ GEMM layer to an nn.Linear weight, shape [out_features, in_features], in `dtype`.

    (q - z) is a small exact integer and its product with an fp16 scale is exact in fp32, so rounding once to fp16
    gives the same values as a kernel that multiplies in fp16.
    """
    check_awq_shapes(qweight, qzeros, scales, group_size)
    q = unpack_int4(qweight)                                     # [in, out]
    z = unpack_int4(qzeros).repeat_interleave(group_size, dim=0)  # [in, out]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    w = (q - z).to(torch.float32) * s
    return w.t().contiguous().to(dtype)


def quantize_codes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
                   ) -> dict[str, torch.Tensor]:
    """Packs already-chosen integer codes into the checkpoint tensors of one layer.

    codes [in, out] (0..15), zeros [in/group, out] (0..15), scales [in/group, out] (float) ->
    {"qweight", "qzeros", "scales"} with the checkpoint dtypes.
    """
    in_f, out_f = codes.shape
    if in_f % group_size or tuple(zeros.shape) != (in_f // group_size, out_f) or zeros.shape != scales.shape:
        raise ValueError(f"quantize_codes: codes {tuple(codes.shape)}, zeros {tuple(zeros.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit group_size {group_size}")
    return {"qweight": pack_int4(codes), "qzeros": pack_int4(zeros), "scales": scales.to(torch.float16)}

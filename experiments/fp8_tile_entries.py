"""Registry entries for TTFT A/Bs of the FP8 kernel's key tile: ``fp8_tile128``, ``fp8_tile192``, ``fp8_tile256``,
the FP8 default (int8 Q K^T, e4m3 P V) with that tile forced (llm_attn.ops.force_fp8_tile), and ``e4m3_tile<n>``,
the same for ``llm_attn_fp8_e4m3`` (e4m3 Q K^T), so that two tiles are timed in one process and one paired run
(LLM_ATTN_FP8_BLOCK_N is read once per process).

    python -m llm_attn.ttft --plugin experiments/fp8_tile_entries.py --impl sdpa llm_attn_fp8 fp8_tile192 \
        --seq 65536 --measure ttft --repeats 5 --warmup 1
"""

import functools

import torch

import llm_attn
from llm_attn._kernel_table import FP8_BLOCK_N
from llm_attn.ops import flash_attn_func, force_fp8_tile


def fp8_tile(q, k, v, *, causal, scale, seqused_k=None, block_n, qk="int8"):
    with force_fp8_tile(block_n):
        return flash_attn_func(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, precision="fp8", fp8_qk=qk)


for n in sorted({n for tiles in FP8_BLOCK_N.values() for n in tiles}):
    llm_attn.register_attention(
        f"fp8_tile{n}", functools.partial(fp8_tile, block_n=n), dtypes=(torch.float16, torch.bfloat16),
        head_dims=tuple(d for d, tiles in FP8_BLOCK_N.items() if n in tiles), devices=("cuda",),
        supports_seqused_k=True,
        description=f"llm_attn_fp8, its {n}-key tile forced for tile A/Bs (low precision: FP8 prefill)")
    llm_attn.register_attention(
        f"e4m3_tile{n}", functools.partial(fp8_tile, block_n=n, qk="e4m3"), dtypes=(torch.float16, torch.bfloat16),
        head_dims=tuple(d for d, tiles in FP8_BLOCK_N.items() if n in tiles), devices=("cuda",),
        supports_seqused_k=True,
        description=f"llm_attn_fp8_e4m3, its {n}-key tile forced for tile A/Bs (low precision: FP8 prefill)")

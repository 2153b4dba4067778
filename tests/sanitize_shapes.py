"""A few kernel launches for compute-sanitizer (memcheck): tails, GQA/MQA, q_len != kv_len, split-KV, seqused_k,
each prefill tile forced; then the backward kernels: the portable one, its narrow tile (sm_86/89's) and the Hopper
one. `--hopper` runs only the Hopper kernels' launches, forward and backward (racecheck and synccheck of their
TMA/mbarrier/warp-specialised pipelines); `--backward` only the backward's.
    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sanitize_shapes.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python tests/sanitize_shapes.py --hopper
    compute-sanitizer --tool racecheck --error-exitcode 9 python tests/sanitize_shapes.py --backward
`--fp8` (`--int8`) runs only the FP8 (INT8) forward's launches (its pre-pass and its TMA/mbarrier/wgmma pipeline: memcheck, racecheck,
synccheck): tails, GQA/MQA, q_len != kv_len, seqused_k, both head_dims and masks; FP8 with each key tile it has
(128, 192, and 256 at head_dim 128: llm_attn/_kernel_table.py FP8_BLOCK_N). `--fp8kv` runs only the decode kernel over the FP8 KV cache
(llm_attn.ops.decode_fp8_kv: e4m3 bytes to shared memory, the split combine): tails, GQA/MQA, q_len > 1, seqused_k,
a static cache's unused capacity, each split count forced; then the prefill kernel over the cache (more than 32
packed rows), v1 (Q staged in the last pipeline stage) and v2 (byte stages, fp16 tiles converted by the whole block,
LLM_ATTN_FP8KV_PREFILL_V), causal tile counts per row block, causal and not, q_len == kv_len,
seqused_k below q_len (rows that see no key), a static cache's unused capacity; then the static cache's one-token
append (kernels/fp8_cache_append.cu) over 125 device steps, and the dequantised copy (kernels/fp8_cache_dequant.cu);
`--fp8kv --append-only` only those two; `--fp8kv --decode-only` only the decode kernel.
"""
import itertools
import math
import os
import sys

import torch

from llm_attn._ext import get_ext
from llm_attn._kernel_table import FP8_BLOCK_N

ext = get_ext()
SHAPES = [  # (b, hq, hkv, sq, sk, d, causal, seqused)
    (1, 8, 2, 17, 129, 64, True, None),
    (2, 4, 1, 129, 63, 128, True, None),
    (1, 8, 8, 1000, 1000, 128, False, None),
    (1, 32, 8, 1, 4097, 128, True, None),        # split-KV
    (2, 8, 2, 3, 700, 64, True, [700, 5]),       # static cache lengths
]
runs = [(dtype, shape, 0) for dtype in (torch.float16, torch.bfloat16) for shape in SHAPES]
# Each prefill tile forced (llm_attn.ops.TILES: 1 large, 2 wide, 3 small, 4 hopper where the GPU runs it) per
# head_dim and mask, bf16; the Hopper kernel also with static-cache lengths (its V-row zeroing) and fp16.
tiles = (1, 2, 3, 4) if ext.sm90_available() else (1, 2, 3)
runs += [(torch.bfloat16, (1, 8, 2, 300, 1000, d, c, None), t) for t in tiles for d in (64, 128) for c in (0, 1)]
if ext.sm90_available():
    runs += [(torch.float16, (2, 8, 2, 129, 700, d, c, [700, 333]), 4) for d in (64, 128) for c in (0, 1)]
if "--backward" in sys.argv or "--fp8" in sys.argv or "--int8" in sys.argv or "--fp8kv" in sys.argv:
    runs = []
if "--hopper" in sys.argv:
    if not ext.sm90_available():
        sys.exit("--hopper: this GPU/build does not run the Hopper kernel")
    runs = [r for r in runs if r[2] == 4]


def forward(dtype, b, hq, hkv, sq, sk, d, causal, used):
    """Random q, k, v and the forward kernel's out (rows-major in memory, strided view), lse, seqused_k."""
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    out = torch.empty(b, sq, hq, d, device="cuda", dtype=dtype).transpose(1, 2)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    su = torch.tensor(used, dtype=torch.int32, device="cuda") if used else None
    ext.mha_fwd(q, k, v, out, lse, su, 1 / math.sqrt(d), causal)
    return q, k, v, out, lse, su


FP8_SHAPES = [  # (b, hq, hkv, sq, sk, d, causal, seqused)
    (1, 8, 2, 17, 129, 64, True, None),
    (2, 4, 1, 129, 63, 128, True, None),
    (1, 8, 8, 300, 1000, 128, False, None),
    (2, 8, 2, 129, 700, 64, False, [700, 333]),
    (2, 8, 2, 300, 700, 128, True, [700, 5]),
    (1, 4, 1, 200, 577, 128, True, [577]),      # the 192-key tile's tail: 1 key past 3 tiles
    (1, 4, 1, 300, 513, 128, True, [513]),      # the 256-key tile's tail: 1 key past 2 tiles
]
FP8KV_SHAPES = [  # (b, hq, hkv, sq, tokens, capacity, d, seqused)
    (1, 8, 2, 1, 17, 17, 64, None),
    (2, 4, 1, 3, 129, 129, 128, None),
    (1, 32, 8, 1, 4097, 4097, 128, None),       # split-KV
    (2, 8, 8, 1, 700, 1024, 128, [700, 5]),     # static capacity past the length, per-batch lengths
    (2, 32, 8, 4, 333, 333, 64, [333, 64]),     # 4 query heads per KV head x 4 rows: 16 of the 32 rows a block holds
    (1, 32, 1, 1, 300, 300, 128, None),         # MQA: 32 rows, two m16 row tiles (the larger merge buffer)
    (4, 32, 8, 1, 4100, 4100, 128, [4100, 4097, 1000, 0]),  # automatic: more splits than the fp16 kernel's rule
]
FP8KV_PREFILL_SHAPES = [  # (b, hq, hkv, sq, tokens, capacity, d, seqused): the prefill kernel (> 32 packed rows)
    (1, 8, 2, 33, 33, 33, 64, None),            # q_len == kv_len, 132 rows: 3 row blocks, the last one partial
    (2, 32, 8, 77, 1000, 1024, 128, [1000, 40]),  # a chunk over a longer cache; batch 1 sees fewer keys than q_len
    (1, 8, 8, 300, 4097, 4097, 128, None),      # MHA
    (2, 32, 1, 45, 129, 256, 64, [129, 0]),     # MQA, an empty sequence
    (1, 32, 8, 130, 4099, 4160, 128, None),     # 520 rows: v2's last 128-row block has 8 real rows; a partial tile
]
if "--fp8kv" in sys.argv:
    from llm_attn import ops
    from llm_attn.models.kv_cache import Fp8StaticLayer

    if not ops.fp8_kv_kernel_available(ext):
        sys.exit("--fp8kv: this build has no FP8-cache decode kernel")
    # --append-only: only the cache's own kernels (the append and the copy): racecheck of the append's shared
    # memory within a call's time.
    kernels_too = "--append-only" not in sys.argv
    # --decode-only: only the decode kernel (its shapes at automatic and forced split counts).
    prefill_too = kernels_too and "--decode-only" not in sys.argv
    cache_too = "--decode-only" not in sys.argv
    for dtype, (b, hq, hkv, sq, n, cap, d, used), splits in itertools.product(
            (torch.float16, torch.bfloat16), FP8KV_SHAPES if kernels_too else (), (0, 1, 3, 16)):
        layer = Fp8StaticLayer(max_cache_len=cap)
        with torch.inference_mode():
            layer.update(torch.randn(b, hkv, n, d, device="cuda", dtype=dtype),
                         torch.randn(b, hkv, n, d, device="cuda", dtype=dtype))
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        su = torch.tensor(used, dtype=torch.int32, device="cuda") if used else None
        with ops.force_decode(splits=splits):
            out = ops.decode_fp8_kv(q, layer.fp8(), causal=True, seqused_k=su, path="kernel")
        torch.cuda.synchronize()
        assert not out.isnan().any()
    # Both versions of the prefill kernel (LLM_ATTN_FP8KV_PREFILL_V, read per call): v1, and v2's byte stages, fp16
    # tiles and block-wide conversion.
    for version, dtype, (b, hq, hkv, sq, n, cap, d, used), causal in itertools.product(
            ("1", "2"), (torch.float16, torch.bfloat16), FP8KV_PREFILL_SHAPES if prefill_too else (), (True, False)):
        os.environ["LLM_ATTN_FP8KV_PREFILL_V"] = version
        if not ops.fp8_kv_prefill_available(ext):
            sys.exit("--fp8kv: this build has no FP8-cache prefill kernel")
        layer = Fp8StaticLayer(max_cache_len=cap)
        with torch.inference_mode():
            layer.update(torch.randn(b, hkv, n, d, device="cuda", dtype=dtype),
                         torch.randn(b, hkv, n, d, device="cuda", dtype=dtype))
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        su = torch.tensor(used, dtype=torch.int32, device="cuda") if used else None
        out = ops.decode_fp8_kv(q, layer.fp8(), causal=causal, seqused_k=su, path="kernel")
        torch.cuda.synchronize()
        assert not out.isnan().any()
    os.environ.pop("LLM_ATTN_FP8KV_PREFILL_V", None)
    # The static cache's one-token append (kernels/fp8_cache_append.cu) across block 0's end and a later block,
    # both dtypes and head_dims, batch 2 x 3 KV heads, 2 tokens past the 128-token capacity (clamped writes).
    if cache_too and ops.fp8_cache_append_available(ext):
        class _Reads:
            _attn_implementation = "llm_attn"

        for dtype, d in itertools.product((torch.float16, torch.bfloat16), (64, 128)):
            layer = Fp8StaticLayer(max_cache_len=128, device_position=True)
            layer.attn_config = _Reads()
            with torch.inference_mode():
                layer.update(torch.randn(2, 3, 5, d, device="cuda", dtype=dtype),
                             torch.randn(2, 3, 5, d, device="cuda", dtype=dtype))
                for _ in range(125):
                    layer.update(torch.randn(2, 3, 1, d, device="cuda", dtype=dtype),
                                 torch.randn(2, 3, 1, d, device="cuda", dtype=dtype))
            torch.cuda.synchronize()
            assert layer._append_kernel
    # The dequantised copy in one launch (kernels/fp8_cache_dequant.cu): odd lengths, a static cache's capacity past
    # them, both dtypes and head_dims.
    if cache_too and ops.fp8_cache_dequant_available(ext):
        for dtype, d, (b, h, n, cap) in itertools.product((torch.float16, torch.bfloat16), (64, 128),
                                                         ((1, 8, 1, 64), (2, 3, 65, 192), (1, 2, 1000, 1000))):
            layer = Fp8StaticLayer(max_cache_len=cap)
            with torch.inference_mode():
                layer.update(torch.randn(b, h, n, d, device="cuda", dtype=dtype),
                             torch.randn(b, h, n, d, device="cuda", dtype=dtype))
                k, v = ops.fp8_kv_dequantized(layer.fp8(), dtype)
            torch.cuda.synchronize()
            assert not k.isnan().any() and not v.isnan().any()
    print("sanitize shapes done (fp8kv)")
    sys.exit(0)

for lowp in ("fp8", "int8"):
    if f"--{lowp}" not in sys.argv:
        continue
    if not getattr(ext, f"{lowp}_available")():
        sys.exit(f"--{lowp}: this GPU/build does not run the {lowp.upper()} kernel")
    # FP8: each key tile of its head_dim, and the P V in the input dtype variant (pv='input': V read by TMA from the
    # caller's tensor, its seqused_k tail zeroed in shared memory by the consumers)
    cases = [(dtype, shape, block_n) for dtype in (torch.float16, torch.bfloat16) for shape in FP8_SHAPES
             for block_n in (FP8_BLOCK_N[shape[5]] + ("input",) if lowp == "fp8" else (0,))]
    for dtype, (b, hq, hkv, sq, sk, d, causal, used), block_n in cases:
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        su = torch.tensor(used, dtype=torch.int32, device="cuda") if used else None
        tile = {"pv": "input"} if block_n == "input" else {"block_n": block_n} if block_n else {}
        out, _ = getattr(ext, f"mha_fwd_{lowp}")(q, k, v, su, 1 / math.sqrt(d), causal, **tile)
        torch.cuda.synchronize()
        assert not out.isnan().any()
    print(f"sanitize shapes done ({lowp})")
    sys.exit(0)

for dtype, shape, tile in runs:
    ext.set_tile(tile)
    out = forward(dtype, *shape)[3]
    torch.cuda.synchronize()
    assert not out.isnan().any()
ext.set_tile(0)

# Backward kernels (forward first for out/lse): tails, GQA/MQA, q_len != kv_len, seqused_k, on each dK/dV kernel
# (BwdTileId, kernels/flash.h: 1 the portable one, 6 with the separate dQ kernel, 2 its narrow tile as sm_86/89 run
# it, 7 the portable one with two-dimensional warp tiles, 4 and 5 the Hopper one with each of its dQ ways, where the
# GPU runs it). With --hopper only the Hopper backward's (its TMA/mbarrier/
# warp-specialised pipeline).
BWD_SHAPES = [  # (b, hq, hkv, sq, sk, d, causal, seqused)
    (1, 8, 2, 17, 129, 64, True, None),
    (2, 4, 1, 129, 63, 128, True, None),
    (1, 4, 4, 100, 300, 128, False, [200]),
    (2, 8, 2, 70, 700, 64, True, [700, 5]),
]
bwd_kernels = (1, 6, 2, 7, 4, 5) if ext.sm90_available() else (1, 6, 2, 7)
if "--hopper" in sys.argv:
    bwd_kernels = (4, 5)
for dtype, kernel, (b, hq, hkv, sq, sk, d, causal, used) in itertools.product(
        (torch.float16, torch.bfloat16), bwd_kernels, BWD_SHAPES):
    ext.set_bwd_tile(kernel)
    q, k, v, out, lse, su = forward(dtype, b, hq, hkv, sq, sk, d, causal, used)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ext.mha_bwd(torch.randn_like(out), q, k, v, out, lse, None, dq, dk, dv, su, 1 / math.sqrt(d), causal)
    torch.cuda.synchronize()
    assert not (dq.isnan().any() or dk.isnan().any() or dv.isnan().any())
ext.set_bwd_tile(0)
# The deterministic backward (not with --hopper: it never runs the Hopper kernel): the separate dQ kernel and the
# split dK/dV slabs with their ordered conversion, automatic and 3-way split, on the device's portable tile and the
# two-dimensional one.
for dtype, splits, kernel, (b, hq, hkv, sq, sk, d, causal, used) in itertools.product(
        (torch.float16, torch.bfloat16), (0, 3) if "--hopper" not in sys.argv else (), (0, 7), BWD_SHAPES):
    ext.set_bwd_splits(splits)
    ext.set_bwd_tile(kernel)
    q, k, v, out, lse, su = forward(dtype, b, hq, hkv, sq, sk, d, causal, used)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ext.mha_bwd(torch.randn_like(out), q, k, v, out, lse, None, dq, dk, dv, su, 1 / math.sqrt(d), causal, True)
    torch.cuda.synchronize()
    assert not (dq.isnan().any() or dk.isnan().any() or dv.isnan().any())
ext.set_bwd_splits(0)
ext.set_bwd_tile(0)
print("sanitize shapes done")

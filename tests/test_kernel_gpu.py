"""GPU tests of the CUDA kernel (skip without CUDA). Each case: fresh random inputs, output and lse buffers
poisoned with NaN before the launch, result compared with a float64 reference. The bound is relative to PyTorch's
own low-precision error on the same inputs (the same attention computed with fp16/bf16 matmuls), as in
flash-attention's tests: our error must be within 2x of it (plus a tiny floor).

Every test that takes ``cuda_ext`` runs once per kernel backend (the compiled extension, NVRTC; conftest.py):
``LLM_ATTN_BACKEND=nvrtc python -m pytest tests/test_kernel_gpu.py`` runs the NVRTC one only.

The grids (``test_kernel_grid``, ``test_forced_tiles``, ``test_decode_kernel_grid``) run a representative subset by
default: every tile x dtype x mask x head_dim x MHA/GQA/MQA combination, each with rotating awkward lengths (every
length pair at least once). ``python -m pytest -m full tests/test_kernel_gpu.py`` runs the whole cross product
(conftest.py ``grid``)."""

import itertools
import math
import re
import zlib

import pytest
import torch

from conftest import HEADS, LENGTHS, UNEQUAL, grid
from llm_attn import attention_naive, flash_attn_func
from llm_attn.harness.graphs import graph_capture

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PAIRS = [(n, n) for n in LENGTHS] + UNEQUAL


def run_raw(ext, q, k, v, causal, scale=None, seqused_k=None):
    """Call the binding directly on poisoned outputs, so an element the kernel never writes stays NaN."""
    b, hq, sq, d = q.shape
    out = torch.full((b, sq, hq, d), float("nan"), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    scale = 1 / math.sqrt(d) if scale is None else scale
    ext.mha_fwd(q, k, v, out, lse, seqused_k, scale, causal)
    return out, lse


def check(ext, q, k, v, causal, scale=None, seqused_k=None):
    out, lse = run_raw(ext, q, k, v, causal, scale, seqused_k)
    torch.cuda.synchronize()
    ref, ref_lse = attention_naive(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k)  # float64
    pt, _ = attention_naive(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, compute_dtype=q.dtype)
    assert not out.isnan().any(), "NaN in output (unwritten element or bad masking)"
    assert not lse.isnan().any(), "NaN in lse"
    err = (out.double() - ref).abs().max().item()
    pt_err = (pt.double() - ref).abs().max().item()
    assert err <= 2 * pt_err + 1e-4, f"max err {err:.3e} > 2 x PyTorch's {pt_err:.3e}"
    visible = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), visible), "lse is -inf exactly on rows that see no key"
    if visible.any():
        assert (lse[visible] - ref_lse[visible]).abs().max().item() < 2e-3
    assert torch.all(out.double()[~visible] == 0)
    return err, pt_err


@pytest.mark.parametrize("dtype,causal,d,heads,sq,sk",
                         grid([list(DTYPES), [False, True], [64, 128], list(HEADS)], PAIRS, per_combo=2))
def test_kernel_grid(cuda_ext, dtype, causal, d, sq, sk, heads):
    torch.manual_seed(zlib.crc32(repr((dtype, causal, d, sq, sk, heads)).encode()))
    hq, hkv = HEADS[heads]
    dt = DTYPES[dtype]
    q = torch.randn(2, hq, sq, d, device="cuda", dtype=dt)
    k = torch.randn(2, hkv, sk, d, device="cuda", dtype=dt)
    v = torch.randn(2, hkv, sk, d, device="cuda", dtype=dt)
    check(cuda_ext, q, k, v, causal)


TILE_PAIRS = [(63, 63), (1000, 1000), (129, 2049), (2049, 129), (300, 1000)]


def skip_unless_tile_runs(ext, tile):
    if tile == "hopper" and not ext.sm90_available():
        pytest.skip("the Hopper kernel needs a compute capability 9.0 GPU and an sm_90a build")


@pytest.mark.parametrize("tile,dtype,causal,d,heads,sq,sk",
                         grid([["large", "wide", "small", "hopper"], list(DTYPES), [False, True], [64, 128],
                               list(HEADS)], TILE_PAIRS, per_combo=1))
def test_forced_tiles(cuda_ext, dtype, causal, d, sq, sk, heads, tile):
    """Every prefill kernel and tile configuration on every head_dim/mask, whichever the automatic choice would be
    on this GPU (the H100 picks the Hopper kernel: Large non-causal is what an RTX 4060 Ti runs). Small grids also
    take each portable tile's split-KV variant."""
    from llm_attn.ops import force_tile

    skip_unless_tile_runs(cuda_ext, tile)
    torch.manual_seed(zlib.crc32(repr((dtype, causal, d, sq, sk, heads, tile)).encode()))
    hq, hkv = HEADS[heads]
    dt = DTYPES[dtype]
    q = torch.randn(2, hq, sq, d, device="cuda", dtype=dt)
    k = torch.randn(2, hkv, sk, d, device="cuda", dtype=dt)
    v = torch.randn(2, hkv, sk, d, device="cuda", dtype=dt)
    with force_tile(tile):
        check(cuda_ext, q, k, v, causal)


@pytest.mark.parametrize("tile", ["auto", "large", "wide", "small", "hopper"])
@pytest.mark.parametrize("growth", ["rising", "falling"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_softmax_rescale_paths(cuda_ext, dtype, growth, tile):
    """Scores whose row max keeps rising tile after tile (the running max moves past the lazy-rescale threshold
    again and again, O is rescaled) or falls (the first tile's max holds: no rescale, P far below 1)."""
    from llm_attn.ops import force_tile

    skip_unless_tile_runs(cuda_ext, tile)
    torch.manual_seed(7)
    dt = DTYPES[dtype]
    sq, sk, d = 300, 1500, 128
    ramp = torch.linspace(0.2, 3.0, sk, device="cuda")
    ramp = ramp if growth == "rising" else ramp.flip(0)
    q = torch.randn(1, 8, sq, d, device="cuda", dtype=dt) * 2
    k = (torch.randn(1, 2, sk, d, device="cuda") * ramp[:, None]).to(dt)
    v = torch.randn(1, 2, sk, d, device="cuda", dtype=dt)
    with force_tile(tile):
        for causal in (False, True):
            check(cuda_ext, q, k, v, causal)


def test_grid_limits_are_clear_errors(cuda_ext):
    from llm_attn.ops import KERNEL_MAX_CAUSAL_Q_LEN

    q = torch.randn(1, 1, KERNEL_MAX_CAUSAL_Q_LEN + 1, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="causal q_len must be"):
        flash_attn_func(q, k, k, causal=True)
    with pytest.raises(RuntimeError, match="causal q_len must be"):  # the raw binding checks too
        run_raw(cuda_ext, q, k, k, True)


def test_raw_binding_errors_raise(cuda_ext):
    """Every check of the binding raises RuntimeError with its message (numbers included), never crashes."""
    f16 = dict(device="cuda", dtype=torch.float16)
    q, kv = torch.randn(1, 4, 8, 64, **f16), torch.randn(1, 2, 8, 64, **f16)
    cases = [
        ((torch.randn(1, 4, 8, 96, **f16), torch.randn(1, 2, 8, 96, **f16)), "head_dim must be 64 or 128, got 96"),
        ((q, torch.randn(1, 3, 8, 64, **f16)), r"multiple of kv heads \(3\)"),
        ((q, torch.randn(2, 2, 8, 64, **f16)), r"k/v \[2, 2, 8, 64\] do not match q \[1, 4, 8, 64\]"),
        ((torch.randn(1, 4, 8, 68, **f16)[..., :64], kv), "strides must be multiples of 8"),
    ]
    for (qq, kk), msg in cases:
        out = torch.empty_like(qq)
        lse = torch.empty(qq.shape[:3], device="cuda")
        with pytest.raises(RuntimeError, match=msg):
            cuda_ext.mha_fwd(qq, kk, kk, out, lse, None, 0.125, False)
    with pytest.raises(RuntimeError, match=r"out \[1, 4, 7, 64\] must match q"):
        cuda_ext.mha_fwd(q, kv, kv, q[:, :, :7], torch.empty(1, 4, 8, device="cuda"), None, 0.125, False)
    # A negative scale (flash_attn_func raises ValueError before reaching the binding): the whole message, the same
    # text on both backends, the number formatted as %g.
    for scale, shown in ((-0.125, "-0.125"), (-1e-5, "-1e-05")):
        msg = ("llm_attn.mha_fwd: scale must be >= 0 (the kernels' online softmax takes each row's max before "
               f"scaling), got {shown}")
        with pytest.raises(RuntimeError, match=re.escape(msg)):
            cuda_ext.mha_fwd(q, kv, kv, torch.empty_like(q), torch.empty(1, 4, 8, device="cuda"), None, scale, False)


def launched_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_kernel_is_the_default_on_sm90(cuda_ext, d, causal):
    """On compute capability 9.0 a prefill that fills the GPU runs the wgmma/TMA kernel, and its result passes."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel is selected on compute capability 9.0 only")
    assert cuda_ext.sm90_available(), "sm_90 GPU but no sm_90a code (extension: LLM_ATTN_CUDA_ARCHS; NVRTC: < 12.0)"
    q = torch.randn(1, 32, 1000, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 1000, d, device="cuda", dtype=torch.bfloat16)
    names = launched_kernels(lambda: check(cuda_ext, q, k, torch.randn_like(k), causal))
    assert any("flash_fwd_sm90_kernel" in n for n in names), names


def test_hopper_tensor_maps_follow_every_call(cuda_ext):
    """The Hopper launch caches TMA descriptors by (address, shape, strides, box, dtype). Views of one buffer at
    the same address with other lengths, head counts and strides, the same shape at another address, and the other
    dtype on the same bytes each get their own descriptor: every call checked against float64 on poisoned outputs,
    and a call repeated after others gives the same bits."""
    if torch.cuda.get_device_capability() != (9, 0) or not cuda_ext.sm90_available():
        pytest.skip("the Hopper kernel runs on compute capability 9.0 with sm_90a code only")
    buf = torch.randn(3 * 2 * 32 * 1024 * 128, device="cuda", dtype=torch.bfloat16)
    first = None
    for sq, hq, hkv, dtype, offset in ((1024, 32, 8, torch.bfloat16, 0), (640, 32, 8, torch.bfloat16, 0),
                                       (1024, 16, 4, torch.bfloat16, 0), (1024, 32, 8, torch.float16, 0),
                                       (1024, 32, 8, torch.bfloat16, 4096), (1024, 32, 8, torch.bfloat16, 0)):
        flat = buf.view(dtype)[offset:]
        n_q, n_kv = 2 * hq * sq * 128, 2 * hkv * sq * 128
        q = flat[:n_q].view(2, sq, hq, 128).transpose(1, 2)  # strided (transformers' layout)
        k = flat[n_q:n_q + n_kv].view(2, hkv, sq, 128)
        v = flat[n_q + n_kv:n_q + 2 * n_kv].view(2, hkv, sq, 128)
        names = launched_kernels(lambda: check(cuda_ext, q, k, v, True))  # noqa: B023
        assert any("flash_fwd_sm90_kernel" in n for n in names), names
        out, _ = run_raw(cuda_ext, q, k, v, True)
        if first is None:
            first = out.clone()
        elif (sq, hq, dtype, offset) == (1024, 32, torch.bfloat16, 0):
            assert torch.equal(out, first)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 300])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_seqused_k_garbage_slots(cuda_ext, causal, sq, d):
    """Static-cache slots past seqused_k inside the last loaded key tile hold NaN in K and V: the Hopper kernel
    masks the scores and zeroes those V rows in shared memory (0 * NaN would poison P V)."""
    from llm_attn.ops import force_tile

    skip_unless_tile_runs(cuda_ext, "hopper")
    b, hq, hkv, cap = 3, 8, 2, 700
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    used = torch.tensor([cap, 333, 130], dtype=torch.int32, device="cuda")
    for i, n in enumerate(used.tolist()):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("nan")
    with force_tile("hopper"):
        out, _ = run_raw(cuda_ext, q, k, v, causal, seqused_k=used)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    k_ok, v_ok = k.nan_to_num(0), v.nan_to_num(0)  # the reference multiplies masked NaNs too
    ref, _ = attention_naive(q, k_ok, v_ok, causal=causal, seqused_k=used)
    pt, _ = attention_naive(q, k_ok, v_ok, causal=causal, seqused_k=used, compute_dtype=q.dtype)
    err, pt_err = (out.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
    assert err <= 2 * pt_err + 1e-4, f"max err {err:.3e} > 2 x PyTorch's {pt_err:.3e}"


# The Hopper kernel's tuning switches are read once per process (sm90::tuning_env), so their non-default tiles run in
# a child process: the whole forced-tile grid and the static-cache garbage slots, checked as above.
_SM90_VARIANT_CHILD = r"""
import itertools, sys, zlib
import torch
sys.path.insert(0, sys.argv[1])
from conftest import HEADS
from test_kernel_gpu import DTYPES, TILE_PAIRS, check, launched_kernels
from llm_attn import _ext, attention_naive
from llm_attn.ops import force_tile

ext = _ext.get_ext()
seen, cases = set(), 0
with force_tile("hopper"):
    for dtype, causal, heads, (sq, sk) in itertools.product(DTYPES, (False, True), HEADS, TILE_PAIRS):
        torch.manual_seed(zlib.crc32(repr((dtype, causal, heads, sq, sk)).encode()))
        hq, hkv = HEADS[heads]
        dt = DTYPES[dtype]
        q = torch.randn(2, hq, sq, 64, device="cuda", dtype=dt)
        k = torch.randn(2, hkv, sk, 64, device="cuda", dtype=dt)
        v = torch.randn(2, hkv, sk, 64, device="cuda", dtype=dt)
        seen |= set(launched_kernels(lambda: check(ext, q, k, v, causal)))
        cases += 1
    for causal, sq in itertools.product((False, True), (1, 300)):  # NaN in the slots past seqused_k
        q = torch.randn(3, 8, sq, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(3, 2, 700, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(3, 2, 700, 64, device="cuda", dtype=torch.bfloat16)
        used = torch.tensor([700, 333, 130], dtype=torch.int32, device="cuda")
        for i, n in enumerate(used.tolist()):
            k[i, :, n:] = float("nan")
            v[i, :, n:] = float("nan")
        out = torch.full((3, sq, 8, 64), float("nan"), dtype=q.dtype, device="cuda").transpose(1, 2)
        lse = torch.full((3, 8, sq), float("nan"), device="cuda")
        ext.mha_fwd(q, k, v, out, lse, used, 0.125, causal)
        ref, _ = attention_naive(q, k.nan_to_num(0), v.nan_to_num(0), causal=causal, seqused_k=used)
        pt, _ = attention_naive(q, k.nan_to_num(0), v.nan_to_num(0), causal=causal, seqused_k=used,
                                compute_dtype=q.dtype)
        err, pt_err = (out.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
        assert not out.isnan().any() and err <= 2 * pt_err + 1e-4, (causal, sq, err, pt_err)
        cases += 1
print("CASES", cases)
print("KERNELS", sorted(n for n in seen if "sm90" in n))
"""


@pytest.mark.full  # tuning switches; the default grid already runs both counts where the automatic choice takes them
@pytest.mark.parametrize("consumers", [2, 3])
def test_hopper_tuning_tiles_in_a_child_process(cuda_ext, request, consumers):
    """LLM_ATTN_SM90_CONSUMERS=2|3 forces head_dim 64 onto two or three consumer warpgroups (128 or 192 query rows;
    automatic: three, but two for causal prompts up to 1024 tokens), on this backend, over the forced-tile grid's
    shapes (both dtypes and masks, MHA/GQA/MQA, odd and unequal lengths) and NaN-filled slots past seqused_k; only
    the forced kernel runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    skip_unless_tile_runs(cuda_ext, "hopper")
    backend = request.node.callspec.params["cuda_ext"]
    tests = Path(__file__).resolve().parent
    child_env = {**os.environ, "LLM_ATTN_SM90_CONSUMERS": str(consumers), "LLM_ATTN_BACKEND": backend,
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(tests.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _SM90_VARIANT_CHILD, str(tests)], env=child_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CASES 64" in proc.stdout, proc.stdout  # 2 dtypes x 2 masks x 3 head layouts x 5 length pairs + 4
    names = proc.stdout.split("KERNELS", 1)[1]
    assert f"Sm90Traits<64, 128, 2, {consumers}>" in names, names
    assert f"Sm90Traits<64, 128, 2, {5 - consumers}>" not in names, names


@pytest.mark.parametrize("config", ["auto", "Deep", "Shallow", "Deep4"])
@pytest.mark.parametrize("splits", [0, 1, 3, 7, 1000])
@pytest.mark.parametrize("d", [64, 128])
def test_forced_decode_splits_and_configs(cuda_ext, d, splits, config):
    """Every decode tile and split count that experiments/decode_splits.py forces (llm_attn.ops.force_decode through
    this backend's setters) gives the right output: one split (no combine), uneven splits, empty splits (7 of 16 tiles
    each: the last gets 2), a count above the tiles (clamped), with q_len 1 and 3 and a short seqused_k."""
    from llm_attn import _plan

    smem = (16 * d + 2 * _plan.DECODE_CONFIGS.get(config, (1, 3))[1] * 64 * d) * 2
    if smem > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"{config} needs {smem} bytes of shared memory per block")
    ids = {"auto": 0, **_plan.DECODE_CONFIG_IDS}
    prev = cuda_ext.set_decode_splits(splits), cuda_ext.set_decode_config(ids[config])
    try:
        for sq, used in ((1, None), (3, None), (1, [1000, 130])):
            torch.manual_seed(zlib.crc32(repr((d, splits, config, sq)).encode()))
            q = torch.randn(2, 32, sq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(2, 8, 1000, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(2, 8, 1000, d, device="cuda", dtype=torch.bfloat16)
            seqused = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
            check(cuda_ext, q, k, v, True, seqused_k=seqused)
            if splits:
                assert cuda_ext.num_splits(2, 32, 8, sq, 1000, d, 132) == min(splits, 16)
    finally:
        cuda_ext.set_decode_splits(prev[0])
        cuda_ext.set_decode_config(prev[1])


@pytest.mark.parametrize("splits", [16, 17, 33, 65, 128])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_combine_past_its_batches(cuda_ext, d, splits):
    """Split counts at and past the fused combine's boundaries (kernels/combine.cuh: partials loaded 16 splits at a
    time, the lse max taken 32 lanes at a time) up to the cap of 128, over 8293 keys (130 tiles); a short seqused_k
    leaves most splits of its row empty (lse -inf), in the middle of a batch."""
    prev = cuda_ext.set_decode_splits(splits)
    try:
        sk = 8293
        assert cuda_ext.num_splits(2, 32, 8, 1, sk, d, 132) == splits
        for used in (None, [sk, 700]):
            torch.manual_seed(zlib.crc32(repr((d, splits, used)).encode()))
            q = torch.randn(2, 32, 1, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(2, 8, sk, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(2, 8, sk, d, device="cuda", dtype=torch.bfloat16)
            seqused = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
            check(cuda_ext, q, k, v, True, seqused_k=seqused)
    finally:
        cuda_ext.set_decode_splits(prev)


def test_force_tile_rejects_unknown(cuda_ext):
    from llm_attn.ops import force_tile

    with pytest.raises(ValueError, match="tile must be one of"):
        with force_tile("huge"):
            pass
    assert cuda_ext.set_tile(9) == -1 and cuda_ext.set_tile(0) == 0  # unknown id: nothing changed


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_strided_transformers_layout(cuda_ext, dtype, causal):
    """(B, S, H, D) projections viewed as (B, H, S, D), and K/V sliced out of a longer cache buffer."""
    dt = DTYPES[dtype]
    b, s, hq, hkv, d = 3, 77, 32, 8, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dt).transpose(1, 2)
    cache = torch.randn(b, hkv, 300, d, device="cuda", dtype=dt)
    k = cache[:, :, :200]
    v = torch.randn(b, 200, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    check(cuda_ext, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 4, 300])
def test_seqused_k_static_cache(cuda_ext, causal, sq):
    torch.manual_seed(sq)
    b, hq, hkv, d, cap = 4, 32, 8, 128, 4096
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.float16)
    used = torch.tensor([cap, 1000, sq, 2049], dtype=torch.int32, device="cuda")
    k[1, :, 1000:] = float("nan")  # unused slots may hold anything (v: large but finite, so the float64
    v[2, :, sq:] = 6e4              # reference's 0 * v stays 0)
    check(cuda_ext, q, k, v, causal, seqused_k=used)


@pytest.mark.parametrize("tile", ["auto", "large", "small", "hopper"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 4, 300])
def test_seqused_k_out_of_range_is_clamped(cuda_ext, sq, causal, tile):
    """The seqused_k contract (flash_attn_func's docstring): read on the device and not validated, values above
    kv_len count as kv_len and values below 0 as 0. Out-of-range values give exactly the clamped values' result
    (decode kernel for sq 1/4, prefill kernels and their split-KV variants for sq 300)."""
    from llm_attn.ops import force_tile

    skip_unless_tile_runs(cuda_ext, tile)
    torch.manual_seed(sq + 10 * causal)
    b, hq, hkv, d, cap = 5, 8, 2, 128, 700
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    wild = torch.tensor([cap + 1, 2**31 - 1, -1, -70000, -2**31], dtype=torch.int32, device="cuda")
    clamped = torch.tensor([cap, cap, 0, 0, 0], dtype=torch.int32, device="cuda")
    with force_tile(tile):
        out, lse = run_raw(cuda_ext, q, k, v, causal, seqused_k=wild)
        ref, ref_lse = run_raw(cuda_ext, q, k, v, causal, seqused_k=clamped)
    torch.cuda.synchronize()
    assert not ref.isnan().any() and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.all(out[2:] == 0) and torch.all(lse[2:] == -math.inf)  # no key: output 0, lse -inf
    check(cuda_ext, q, k, v, causal, seqused_k=wild)  # and against the float64 reference given the same values


@pytest.mark.parametrize("sk", [4097, 32768])
def test_decode_split_kv(cuda_ext, sk):
    """Llama-3-8B decode shape: one query row, 32 query heads over 8 KV heads, a long cache (KV splits)."""
    assert cuda_ext.num_splits(1, 32, 8, 1, sk, 128, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
    check(cuda_ext, q, k, v, causal=True)


def test_custom_scale_and_large_logits(cuda_ext):
    q = torch.randn(1, 8, 129, 64, device="cuda", dtype=torch.float16) * 4
    k = torch.randn(1, 8, 1000, 64, device="cuda", dtype=torch.float16) * 4
    v = torch.randn(1, 8, 1000, 64, device="cuda", dtype=torch.float16)
    check(cuda_ext, q, k, v, causal=False, scale=0.3)


@pytest.mark.parametrize("sq,sk", [(1000, 1000), (1, 8192), (3, 2049)], ids=["prefill", "decode-split", "q3-split"])
def test_public_api_matches_raw_and_is_deterministic(cuda_ext, sq, sk):
    """flash_attn_func (the build's mha_fwd_alloc: outputs made by the build, one split workspace with its counters)
    gives bit for bit what mha_fwd gives into NaN-poisoned outputs, prefill and split decode alike."""
    q = torch.randn(2, 32, sq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 8, sk, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    raw, raw_lse = run_raw(cuda_ext, q, k, v, True)
    assert not raw.isnan().any() and not raw_lse.isnan().any()
    assert torch.equal(out, raw) and torch.equal(lse, raw_lse)
    assert torch.equal(flash_attn_func(q, k, v, causal=True), out)
    alloc, alloc_lse = cuda_ext.mha_fwd_alloc(q, k, v, None, 1 / math.sqrt(128), True)
    assert torch.equal(alloc, raw) and torch.equal(alloc_lse, raw_lse)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous() and lse.is_contiguous()


def test_cuda_graph_capture_and_compile(cuda_ext):
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 8, 3000, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 8, 3000, 128, device="cuda", dtype=torch.float16)
    used = torch.tensor([2500], dtype=torch.int32, device="cuda")
    fn = lambda: flash_attn_func(q, k, v, causal=True, seqused_k=used)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        static_out = fn()
    for n in (2500, 17, 3000):  # new inputs copied into the captured buffers, replayed
        q.normal_()
        k.normal_()
        used.fill_(n)
        graph.replay()
        torch.testing.assert_close(static_out, fn(), rtol=0, atol=0)
    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(), fn(), rtol=0, atol=0)


def _pool_is_zero(ext):
    used, values = ext.decode_counter_pool_state()
    assert used == len(values) and not any(values), "the decode kernel left a counter of its pool non-zero"
    return used


def test_decode_counter_pool_stays_zero_across_streams_graphs_and_shapes(cuda_ext):
    """The split decode kernel's arrival counters come from a pool zeroed once (no memset per call): every launch must
    leave its counters zero, eager on two streams, with growing (batch x KV heads), and replayed from CUDA graphs, each
    result checked against the float64 reference on NaN-poisoned outputs; the pool's counters are all zero after."""
    torch.manual_seed(7)
    # (batch, heads, KV heads, KV length, forced splits): the last one has 320 (batch, KV head) counters, more than
    # a stream's first slice holds, so its stream gets a larger one.
    shapes = [(1, 32, 8, 2048, 0), (4, 32, 8, 8192, 0), (3, 8, 1, 4097, 0), (2, 32, 8, 1000, 0), (40, 32, 8, 600, 3)]
    side = torch.cuda.Stream()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b, hq, hkv, sk, forced in shapes:
        q = torch.randn(b, hq, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, sk, 128, device="cuda", dtype=torch.bfloat16)
        prev = cuda_ext.set_decode_splits(forced)
        try:
            assert cuda_ext.num_splits(b, hq, hkv, 1, sk, 128, num_sms) > 1
            for _ in range(3):
                check(cuda_ext, q, k, v, causal=False)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                check(cuda_ext, q, k, v, causal=False)
            torch.cuda.current_stream().wait_stream(side)
        finally:
            cuda_ext.set_decode_splits(prev)
    used = _pool_is_zero(cuda_ext)
    assert used > 0, "eager split decode calls did not use the counter pool"

    # Two graphs, each with its own counters, replayed back to back and side by side on two streams.
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 8, 3000, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 8, 3000, 128, device="cuda", dtype=torch.float16)
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    flash_attn_func(q, k, v, path="kernel")  # loads this dtype's kernel outside the capture
    torch.cuda.synchronize()
    graphs, outs = [], []
    for kk, vv in ((k, v), (k2, v2)):
        g = torch.cuda.CUDAGraph()
        with graph_capture(g):
            outs.append(flash_attn_func(q, kk, vv, path="kernel"))
        graphs.append(g)
    assert _pool_is_zero(cuda_ext) > used, "captured launches did not get counters of their own"
    refs = [attention_naive(q, kk, vv)[0] for kk, vv in ((k, v), (k2, v2))]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(20):
        for o in outs:
            o.fill_(float("nan"))
        for g, st in zip(graphs, streams):
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                g.replay()
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
        for o, ref in zip(outs, refs):
            assert not o.isnan().any()
            assert (o.double() - ref).abs().max().item() < 2e-2
    _pool_is_zero(cuda_ext)


def test_decode_counter_pool_grows_past_a_chunk_inside_a_capture(cuda_ext):
    """Every captured split launch keeps counters of its own; a capture of more than one 1 MiB chunk's worth (600
    launches x 512 counters > 262144) makes the pool grow inside the capture, and every replayed launch is right."""
    q = torch.randn(64, 8, 1, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(64, 8, 600, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(64, 8, 600, 64, device="cuda", dtype=torch.float16)
    prev = cuda_ext.set_decode_splits(2)
    try:
        flash_attn_func(q, k, v, path="kernel")  # the kernel loaded outside the capture
        before = _pool_is_zero(cuda_ext)
        g = torch.cuda.CUDAGraph()
        with graph_capture(g):
            outs = [flash_attn_func(q, k, v, path="kernel") for _ in range(600)]
    finally:
        cuda_ext.set_decode_splits(prev)
    assert _pool_is_zero(cuda_ext) >= before + 600 * 512
    ref = attention_naive(q, k, v)[0]
    for _ in range(2):
        for o in (outs[0], outs[-1]):
            o.fill_(float("nan"))
        g.replay()
        for o in (outs[0], outs[-1]):
            assert not o.isnan().any() and (o.double() - ref).abs().max().item() < 2e-2
    _pool_is_zero(cuda_ext)


def test_decode_without_the_counter_pool_is_bit_identical(cuda_ext):
    """Counters zeroed per call (the path taken where the pool cannot serve) give the pool's results bit for bit."""
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    pooled = run_raw(cuda_ext, q, k, v, False)
    prev = cuda_ext.set_decode_counter_pool(False)
    try:
        own = run_raw(cuda_ext, q, k, v, False)
    finally:
        cuda_ext.set_decode_counter_pool(prev)
    assert prev is True
    assert not pooled[0].isnan().any() and torch.equal(pooled[0], own[0]) and torch.equal(pooled[1], own[1])


def test_decode_under_torch_compile_cuda_graph_trees(cuda_ext):
    """torch.compile(mode="reduce-overhead") records the split decode call into CUDA-graph trees: a counter buffer
    that is a tensor of torch's allocator broke them once (kernels/NOTES.md, decode v3); the pool is not one."""
    torch._dynamo.reset()
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda a, b, c: flash_attn_func(a, b, c) * 1, mode="reduce-overhead")
    for _ in range(4):  # warm-up, record, replays
        q.normal_()
        out = compiled(q, k, v).clone()
        torch.testing.assert_close(out, flash_attn_func(q, k, v), rtol=0, atol=0)
    _pool_is_zero(cuda_ext)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d=96), "head_dim"),
        (dict(dtype=torch.float32), "float16 or bfloat16"),
    ],
)
def test_kernel_rejects_unsupported(cuda_ext, kwargs, match):
    d = kwargs.get("d", 64)
    dt = kwargs.get("dtype", torch.float16)
    q = torch.randn(1, 4, 8, d, device="cuda", dtype=dt)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_func(q, q, q, backend="cuda")


def test_negative_scale_is_a_clear_error(cuda_ext):
    q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="scale >= 0"):
        flash_attn_func(q, q, q, scale=-0.125)


def test_mixed_devices_rejected(cuda_ext):
    q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="one device"):
        flash_attn_func(q, q.cpu(), q)


@pytest.mark.parametrize("dtype,sq,heads,sk",
                         grid([list(DTYPES), [1, 2, 3, 5, 8], list(HEADS)], [1, 7, 128, 1000, 4097, 32768],
                              per_combo=2))
def test_decode_kernel_grid(cuda_ext, dtype, sq, sk, heads):
    """Small q_len against a KV cache: the split-KV decode kernel (GQA packed) whenever heads/kv_heads * q_len <= 32.
    Causal (bottom-right) matters for q_len > 1: speculative/chunked decoding."""
    torch.manual_seed(zlib.crc32(repr(("decode", dtype, sq, sk, heads)).encode()))
    hq, hkv = HEADS[heads]
    dt = DTYPES[dtype]
    d = 128 if sk % 2 else 64
    q = torch.randn(2, hq, sq, d, device="cuda", dtype=dt)
    k = torch.randn(2, hkv, sk, d, device="cuda", dtype=dt)
    v = torch.randn(2, hkv, sk, d, device="cuda", dtype=dt)
    check(cuda_ext, q, k, v, causal=True)
    if sq > 1:
        check(cuda_ext, q, k, v, causal=False)


@pytest.mark.parametrize("sq", [1, 4, 8])
def test_decode_static_cache_mask(cuda_ext, sq):
    """StaticCache decode: a 8192-slot buffer, per-sequence valid lengths on the device, garbage beyond them."""
    b, hq, hkv, d, cap = 3, 32, 8, 128, 8192
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
    used = torch.tensor([cap, 777, 8], dtype=torch.int32, device="cuda")
    k[1, :, 777:] = float("nan")
    v[2, :, 8:] = 3e4
    check(cuda_ext, q, k, v, causal=True, seqused_k=used)


def test_plan_mirror_matches_the_extension():
    """llm_attn/_plan.py (the NVRTC backend's host-side choices) against the C++ flash_fwd_num_splits, over shapes
    and SM counts of other GPUs too (Orin 16, 4060 Ti 34, A100 108, H100 132)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn import _ext, _plan

    aot, err = _ext._load_aot()
    if aot is None:
        pytest.skip(f"the compiled extension is needed to compare with: {err}")
    n = 0
    for sms in (16, 34, 108, 132, torch.cuda.get_device_properties(0).multi_processor_count):
        for (b, hq, hkv), sq, sk, d in itertools.product(((1, 32, 8), (2, 8, 8), (3, 32, 32), (1, 28, 4), (8, 8, 1)),
                                                       (1, 2, 5, 17, 64, 127, 128, 129, 1000, 4096),
                                                       (1, 63, 64, 255, 256, 1000, 4097, 32768), (64, 128)):
            ours = _plan.num_splits(_plan.Shape(b, hq, hkv, sq, sk, d), sms)
            assert ours == aot.num_splits(b, hq, hkv, sq, sk, d, sms), (sms, b, hq, hkv, sq, sk, d)
            n += 1
    assert n == 5 * 5 * 10 * 8 * 2  # every shape was compared


def test_nvrtc_compiles_only_what_runs_and_caches_it(tmp_path, monkeypatch):
    """A fresh cache: one call compiles exactly the planned instantiation (cold), a new process-level load reads
    the cubin back from disk (warm), and the result is the same."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn import _ext, _nvrtc, _plan

    if _ext.backend_status()["nvrtc"] != "available":
        pytest.skip(f"nvrtc backend not available: {_ext.backend_status()['nvrtc']}")
    monkeypatch.setenv("LLM_ATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(_nvrtc, "_functions", {})
    monkeypatch.setattr(_nvrtc, "_handles", {})
    monkeypatch.setattr(_nvrtc, "compile_stats", {})
    q = torch.randn(1, 4, 77, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.float16)
    arch, dev = _nvrtc.device_info(torch.cuda.current_device())
    want = {(_nvrtc.kernel_arch(arch, launch.kernel), launch.kernel) for launch in _plan.plan(_plan.Shape(1, 4, 2, 77, 300, 64, True), dev).launches}
    out1, _ = run_raw(_nvrtc, q, k, k, True)
    assert set(_nvrtc.compile_stats) == want and all(s["source"] == "nvrtc" for s in _nvrtc.compile_stats.values())
    assert len(list((tmp_path / "nvrtc").glob("*.cubin"))) == len(want)
    monkeypatch.setattr(_nvrtc, "_functions", {})
    monkeypatch.setattr(_nvrtc, "_handles", {})
    out2, _ = run_raw(_nvrtc, q, k, k, True)
    assert all(_nvrtc.compile_stats[w]["source"] == "cache" for w in want)
    assert torch.equal(out1, out2)


# -- the low-precision forwards on the NVRTC build ------------------------------------------------------------------
# The NVRTC build runs precision='fp8' | 'int8' with the AOT build's kernels and launch sequence, so on the same inputs
# the two give the same bits. K holds multiples of 1/4 (with outlier channels), so that the FP8 pre-pass's float
# atomics (K's channel sums) are exact in any order and the AOT build itself repeats bit for bit; the INT8 pre-pass
# has no atomics. Both builds are also checked against float64. (tests/test_low_precision_gpu.py runs its own grid on
# each build through the cuda_ext fixture.)
QUANT_PAIRS = [(n, n) for n in LENGTHS if n > 16] + [(s, k) for s, k in UNEQUAL if s > 16]


def _quant_builds(precision):
    """(the extension, the NVRTC module), both running the `precision` kernel on this GPU; skip otherwise."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn import _ext

    aot, why = _ext._load_aot()
    if aot is None:
        pytest.skip(f"the compiled extension is needed to compare with: {why}")
    if _ext.backend_status()["nvrtc"] != "available":
        pytest.skip(f"nvrtc backend not available: {_ext.backend_status()['nvrtc']}")
    from llm_attn import _nvrtc

    for ext in (aot, _nvrtc):
        if not getattr(ext, f"{precision}_available")():
            pytest.skip(f"no {precision.upper()} kernel for this GPU in {ext.__name__}")
    return aot, _nvrtc


def _quant_inputs(b, hq, hkv, sq, sk, d, dt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, sq, d, device="cuda", generator=g)
    k = torch.round(4 * torch.randn(b, hkv, sk, d, device="cuda", generator=g)) / 4  # exact in fp16/bf16, exact sums
    k[..., 5] += 20  # an outlier channel, as K has in real models (the pre-pass's smoothing removes its mean)
    v = torch.randn(b, hkv, sk, d, device="cuda", generator=g)
    return q.to(dt), k.to(dt), v.to(dt)


def _run_quant(ext, precision, q, k, v, causal, seqused_k=None, block_n=0):
    """The build's raw low-precision forward, its outputs allocated from memory poisoned with NaN first (the caching
    allocator hands the freed block back), so an element the kernel never writes stays NaN."""
    b, h, s, d = q.shape
    junk = torch.full((b * h * s * d + 4096,), float("nan"), dtype=q.dtype, device=q.device)
    del junk
    fn = getattr(ext, f"mha_fwd_{precision}")
    args = (q, k, v, seqused_k, 1 / math.sqrt(d), causal)
    out, lse = fn(*args, block_n=block_n) if block_n else fn(*args)
    torch.cuda.synchronize()
    return out, lse


def _check_against_float64(out, lse, q, k, v, causal, seqused_k=None):
    ref, ref_lse = attention_naive(q, k, v, causal=causal, seqused_k=seqused_k)
    visible = torch.isfinite(ref_lse)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN: an element never written, or garbage keys read"
    assert torch.equal(torch.isfinite(lse), visible), "lse is -inf exactly on rows that see no key"
    assert torch.all(out.double()[~visible] == 0)
    if visible.any():
        o, r = out.double()[visible].flatten(), ref[visible].flatten()
        cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
        rel = ((o - r).abs().sum() / r.abs().sum()).item()
        assert cos >= 0.995 and rel <= 0.09, f"vs float64: cosine {cos:.5f}, rel L1 {rel:.4f}"
        assert (lse[visible] - ref_lse[visible]).abs().max().item() < 0.5


def _fp8_tiles(aot, d):
    """The FP8 key tiles both builds have for head_dim d (0: the default, where the extension takes no block_n)."""
    from llm_attn import _kernel_table

    return _kernel_table.FP8_BLOCK_N[d] if hasattr(aot, "fp8_block_n") else (0,)


@pytest.mark.parametrize("precision,dtype,causal,d,heads,sq,sk",
                         grid([["fp8", "int8"], list(DTYPES), [False, True], [64, 128], list(HEADS)], QUANT_PAIRS))
def test_nvrtc_quant_matches_aot_bit_for_bit(precision, dtype, causal, d, heads, sq, sk):
    """NVRTC and AOT give the same bits for precision='fp8' (every key tile) and 'int8' (P V as this GPU takes it),
    odd lengths, q_len != kv_len, MHA/GQA/MQA, both dtypes; both within FP8/INT8's error of float64."""
    aot, nvrtc = _quant_builds(precision)
    hq, hkv = HEADS[heads]
    q, k, v = _quant_inputs(2, hq, hkv, sq, sk, d, DTYPES[dtype],
                            zlib.crc32(repr((precision, dtype, causal, d, heads, sq, sk)).encode()))
    for block_n in _fp8_tiles(aot, d) if precision == "fp8" else (0,):
        want, want_lse = _run_quant(aot, precision, q, k, v, causal, block_n=block_n)
        again, again_lse = _run_quant(aot, precision, q, k, v, causal, block_n=block_n)
        assert torch.equal(want, again) and torch.equal(want_lse, again_lse), "the AOT build does not repeat itself"
        got, got_lse = _run_quant(nvrtc, precision, q, k, v, causal, block_n=block_n)
        _check_against_float64(got, got_lse, q, k, v, causal)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse), (
            f"block_n {block_n}: NVRTC differs from AOT by {(got.float() - want.float()).abs().max().item():.3e}")


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_nvrtc_quant_seqused_k_garbage(precision):
    """Keys past seqused_k hold NaN and huge values: neither build reads them into a statistic or an output, and
    the two agree bit for bit."""
    aot, nvrtc = _quant_builds(precision)
    q, k, v = _quant_inputs(3, 8, 2, 300, 1000, 128, torch.bfloat16, 11)
    used = torch.tensor([1000, 517, 129], dtype=torch.int32, device="cuda")
    for i, n in enumerate(used.tolist()):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = 1e4
    for causal in (False, True):
        want = _run_quant(aot, precision, q, k, v, causal, used)
        got = _run_quant(nvrtc, precision, q, k, v, causal, used)
        _check_against_float64(*got, q, k, v, causal, used)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_nvrtc_quant_through_the_op_and_a_cuda_graph(precision):
    """flash_attn_func(precision=...) on the NVRTC build: the same bits as the raw call, and captured in a CUDA graph
    (workspaces from torch's allocator, launches on the capture stream) it replays with new queries."""
    from llm_attn import _ext

    _, nvrtc = _quant_builds(precision)
    q, k, v = _quant_inputs(1, 8, 2, 500, 700, 64, torch.float16, 12)
    prev = _ext.set_backend("nvrtc")
    try:
        fn = lambda: flash_attn_func(q, k, v, causal=True, precision=precision, path="kernel")  # noqa: E731
        assert torch.equal(fn(), _run_quant(nvrtc, precision, q, k, v, True)[0])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up outside capture (compiles and loads the kernels)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            static_out = fn()
        for _ in range(2):
            q.normal_()
            graph.replay()
            torch.testing.assert_close(static_out, fn(), rtol=0, atol=0)
    finally:
        _ext.set_backend(prev)


def test_nvrtc_quant_bad_input_says_what_aot_says(monkeypatch):
    """The NVRTC build refuses what the AOT build refuses, in the same one line: head_dim 96, float32, and FP8 on a
    GPU without its kernel (simulated off compute capability 9.0); the raw calls too (binding.cpp's check_fwd)."""
    from llm_attn import _ext, kernel_contract

    aot, nvrtc = _quant_builds("int8")
    said = {}
    for build, ext in (("aot", aot), ("nvrtc", nvrtc)):
        prev = _ext.set_backend(build)
        try:
            for precision in ("fp8", "int8"):
                for d, dt in ((96, torch.bfloat16), (64, torch.float32)):
                    q = torch.randn(1, 4, 64, d, device="cuda", dtype=dt)
                    with pytest.raises((ValueError, TypeError)) as e:
                        flash_attn_func(q, q[:, :2], q[:, :2], precision=precision, path="kernel")
                    said[(build, precision, d)] = (type(e.value), str(e.value))
                q = torch.randn(1, 4, 64, 96, device="cuda", dtype=torch.float16)
                with pytest.raises(RuntimeError) as e:
                    getattr(ext, f"mha_fwd_{precision}")(q, q, q, None, 0.1, False)
                said[(build, precision, "raw")] = str(e.value).splitlines()[0]  # TORCH_CHECK may add a trace
            with monkeypatch.context() as m:
                m.setattr(kernel_contract.torch.cuda, "get_device_capability", lambda device=None: (8, 9))
                q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
                with pytest.raises(ValueError) as e:
                    flash_attn_func(q, q, q, precision="fp8", path="kernel")
                said[(build, "fp8", "cc")] = str(e.value)
        finally:
            _ext.set_backend(prev)
    for key, value in said.items():
        if key[0] == "aot":
            assert said[("nvrtc",) + key[1:]] == value, key
    assert "head_dim" in said[("aot", "fp8", 96)][1] and "float16 or bfloat16" in said[("aot", "int8", 64)][1]
    assert said[("aot", "int8", "raw")] == "llm_attn.mha_fwd: head_dim must be 64 or 128, got 96"
    assert "compute capability 9.0" in said[("aot", "fp8", "cc")] and "\n" not in said[("aot", "fp8", "cc")]

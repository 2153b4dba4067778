"""GPU tests of the low-precision forwards (``flash_attn_func(..., precision='fp8' | 'int8')``: kernels/flash_fp8.h,
kernels/flash_int8.h; the INT8 kernel runs on any sm_80-90 GPU, so an H100 tests its input-dtype P V): fresh random inputs
shaped like LLM activations (K with outlier channels), awkward shapes, both input dtypes, MHA/GQA/MQA, q_len != kv_len,
seqused_k with NaN in the unused keys. The kernel allocates its output, so the memory it will get is poisoned with NaN
first (the caching allocator hands the freed block back), and an element it never writes stays NaN. FP8 runs with each
of its key tiles forced (``fp8-128``, ``fp8-192``: llm_attn.ops.force_fp8_tile), the same bounds for both, with
its default int8 Q K^T, and with e4m3 Q K^T (``fp8-192-e4m3qk``: llm_attn.ops.force_fp8_qk); and with P V in the
input dtype (``fp8-128-int8qk``, ``fp8-192-int8qk``: ``fp8_pv='input'``, int8 Q K^T, each tile forced,
llm_attn_int8qk's kernel), whose V the kernel reads as given, so its slots past seqused_k hold NaN here.

Two bounds per case (output and lse): against float64 (the error of FP8 attention itself, bounded loosely: ~5 % relative L1 on Gaussian
data, kernels/NOTES.md "FP8 forward"), and against the quantised PyTorch reference of the same algorithm
(llm_attn/quant_reference.py, quant_reference_int8.py): the kernel's error against float64 may exceed the reference's by at most 25 % + a
floor, so a wrong scale, a misplaced key or a lost tile fails even where the loose bound would pass. With P V in the
input dtype e4m3's rounding of P and V is gone (the reference: ~1.3 % relative L1 against ~3.8 % for e4m3 P V on
these inputs), so its bounds are tighter, and the kernel is also held to the reference directly: both round P to
bf16/fp16 (8 or 11 significant bits), the kernel against its running row max and the reference against the final
one, so each P differs by at most one rounding and the outputs by about one output rounding (a CPU emulation of the
kernel's online softmax: 0.13 % relative L1 in bf16, 0.02 % in fp16)."""

import contextlib
import math
import os
import re
import zlib

import pytest
import torch

from conftest import HEADS, LENGTHS, UNEQUAL, grid
from llm_attn import _kernel_table, attention_naive, flash_attn_func
from llm_attn.ops import force_fp8_qk, force_fp8_tile, int8_pv
from llm_attn.quant_reference import attention_fp8
from llm_attn.quant_reference_int8 import attention_int8

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# + lengths around the 192-key tile: one key past a tile, and a tail tile whose last 64-key group is past the keys
PAIRS = [(n, n) for n in LENGTHS if n > 1] + [(s, k) for s, k in UNEQUAL if s > 16] + [(193, 193), (200, 577)]


PRECISIONS = ["fp8", "int8"]
# What runs: the precision and, for FP8, the key tile forced (every tile the build has for head_dim 128), the
# operands of Q K^T ("": the default, int8) and those of P V ("": e4m3; "input": the input dtype, every tile too).
# Appended last, so that the grid's default subset of the others stays as it was.
VARIANTS = {**{f"fp8-{n}": ("fp8", n, "", "") for n in _kernel_table.FP8_BLOCK_N[128]},
            f"fp8-{_kernel_table.FP8_BLOCK_N[128][0]}-e4m3qk": ("fp8", _kernel_table.FP8_BLOCK_N[128][0], "e4m3", ""),
            "int8": ("int8", 0, "", ""),
            **{f"fp8-{n}-int8qk": ("fp8", n, "int8", "input") for n in _kernel_table.FP8_BLOCK_N[128] if n <= 192},
            # the 256-key tile (H14) with e4m3 Q K^T too: its serial P V is the same code for both S types
            **{f"fp8-{n}-e4m3qk": ("fp8", n, "e4m3", "") for n in _kernel_table.FP8_BLOCK_N[128] if n > 192}}
# P V in the input dtype, the kernel against its reference: relative L1 (see the module docstring).
PV_INPUT_VS_REFERENCE = {torch.bfloat16: 5e-3, torch.float16: 2e-3}


@contextlib.contextmanager
def tile(block_n, qk=""):
    """The FP8 key tile (0: the build's default) and Q K^T operands ("": the default) forced in the block."""
    with force_fp8_tile(block_n) if block_n else contextlib.nullcontext(), force_fp8_qk(qk):
        yield


def require(ext, precision):
    if not hasattr(ext, f"mha_fwd_{precision}"):  # both builds have it: a build without it is out of date
        pytest.fail(f"this kernel build ({getattr(ext, '__name__', ext)}) has no mha_fwd_{precision}: rebuild it")
    if not getattr(ext, f"{precision}_available")():
        pytest.skip(f"no {precision.upper()} kernel for this GPU in this build (FP8: compute capability 9.0, sm_90a; "
                    f"INT8: sm_80-90)")


@pytest.fixture
def fp8_ext(cuda_ext):
    require(cuda_ext, "fp8")
    return cuda_ext


def quant_reference(q, k, v, causal, seqused_k, precision, qk="", pv=""):
    if precision == "fp8":
        return attention_fp8(q, k, v, causal=causal, seqused_k=seqused_k, return_lse=True, qk=qk or "int8",
                             pv=pv or "e4m3")
    return attention_int8(q, k, v, causal=causal, seqused_k=seqused_k, pv=int8_pv(q))


def llm_like(b, h, s, d, dt, seed, outliers=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, h, s, d, device="cuda", generator=g)
    if outliers:  # a few channels with a large bias, as K has in real models
        cols = torch.randperm(d, device="cuda", generator=g)[:4]
        x[..., cols] += 20 * torch.sign(torch.randn(4, device="cuda", generator=g))
    return x.to(dt)


def poison_next_alloc(q):
    """Fill the memory the next output-sized allocation will reuse with NaN (freed to the caching allocator)."""
    b, h, s, d = q.shape
    junk = torch.full((b * h * s * d + 4096,), float("nan"), dtype=q.dtype, device=q.device)
    del junk


def metrics(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    rel_l1 = ((o - r).abs().sum() / r.abs().sum().clamp(min=1e-30)).item()
    return cos, rel_l1


def check(q, k, v, causal, seqused_k=None, precision="fp8", block_n=0, qk="", pv=""):
    poison_next_alloc(q)
    with tile(block_n, qk):
        out, lse = flash_attn_func(q, k, v, causal=causal, seqused_k=seqused_k, return_lse=True, path="kernel",
                                   precision=precision, fp8_pv=pv)
    torch.cuda.synchronize()
    assert out.dtype == q.dtype and out.shape == q.shape
    # Slots past seqused_k may hold NaN: float64 attention multiplies its zero P by them (the kernel must not).
    k, v = k.nan_to_num(0), v.nan_to_num(0)
    ref, ref_lse = attention_naive(q, k, v, causal=causal, seqused_k=seqused_k)  # float64
    qref, qref_lse = quant_reference(q, k, v, causal, seqused_k, precision, qk, pv)
    visible = torch.isfinite(ref_lse)
    assert not out.isnan().any(), "NaN in output (unwritten element, bad masking or garbage keys read)"
    assert torch.equal(torch.isfinite(lse), visible), "lse is -inf exactly on rows that see no key"
    assert torch.all(out.double()[~visible] == 0)
    if not visible.any():
        return
    # The lse carries FP8's score error (e4m3 Q and K: a few % of a score): bounded by the quantised reference's own.
    lse_err = (lse[visible] - ref_lse[visible]).abs().max().item()
    qref_lse_err = (qref_lse[visible] - ref_lse[visible]).abs().max().item()
    assert lse_err <= 1.5 * qref_lse_err + 0.02, f"lse error {lse_err:.4f} vs the quantised reference's {qref_lse_err:.4f}"
    cos, rel = metrics(out[visible.unsqueeze(-1).expand_as(out)], ref[visible.unsqueeze(-1).expand_as(ref)])
    rcos, rrel = metrics(qref[visible.unsqueeze(-1).expand_as(qref)], ref[visible.unsqueeze(-1).expand_as(ref)])
    if pv == "input":  # ~1.3 % relative L1 left (the int8 Q K^T's), bounded at ~2.3x as e4m3's ~4 % is by 0.09; the
        # kernel's own rounding adds second-order L1 to the reference's error (under 1e-4 in the CPU emulation)
        assert cos >= 0.9995 and rel <= 0.03, f"vs float64: cosine {cos:.6f}, rel L1 {rel:.4f}"
        assert rel <= 1.1 * rrel + 1e-3, f"kernel rel L1 {rel:.4f} vs the quantised reference's {rrel:.4f}"
        _, drel = metrics(out[visible.unsqueeze(-1).expand_as(out)], qref[visible.unsqueeze(-1).expand_as(qref)])
        assert drel <= PV_INPUT_VS_REFERENCE[q.dtype], f"kernel vs the quantised reference: rel L1 {drel:.5f}"
        return
    assert cos >= 0.995 and rel <= 0.09, f"vs float64: cosine {cos:.5f}, rel L1 {rel:.4f}"
    assert rel <= 1.25 * rrel + 2e-3, f"kernel rel L1 {rel:.4f} vs the quantised reference's {rrel:.4f}"


def built(variant: str, d: int) -> bool:
    """Whether the variant's forced FP8 tile exists at head_dim d (the 256-key one at 128 only)."""
    block_n = VARIANTS[variant][1]
    return not block_n or block_n in _kernel_table.FP8_BLOCK_N[d]


GRID = [c for c in grid([list(VARIANTS), list(DTYPES), [False, True], [64, 128], list(HEADS)], PAIRS, per_combo=2)
        if built(c.values[0], c.values[3])]


@pytest.mark.parametrize("variant,dtype,causal,d,heads,sq,sk", GRID)
def test_low_precision_grid(cuda_ext, variant, dtype, causal, d, heads, sq, sk):
    precision, block_n, qk, pv = VARIANTS[variant]
    require(cuda_ext, precision)
    seed = zlib.crc32(repr((variant, dtype, causal, d, heads, sq, sk)).encode())
    hq, hkv = HEADS[heads]
    dt = DTYPES[dtype]
    q = llm_like(2, hq, sq, d, dt, seed)
    k = llm_like(2, hkv, sk, d, dt, seed + 1, outliers=True)
    v = llm_like(2, hkv, sk, d, dt, seed + 2)
    check(q, k, v, causal, precision=precision, block_n=block_n, qk=qk, pv=pv)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_seqused_k_ignores_garbage(cuda_ext, variant, causal, d):
    """Keys past seqused_k hold NaN and huge values: they must reach no scale, no statistic and no output. With P V in
    the input dtype V is read as given, so its slots hold NaN too (0 * NaN in the P V product is NaN: the kernel
    zeroes those rows of its V tile)."""
    precision, block_n, qk, pv = VARIANTS[variant]
    if not built(variant, d):
        pytest.skip(f"no {block_n}-key FP8 tile at head_dim {d} (kernels/generate_kernels.py FP8_BLOCK_N)")
    require(cuda_ext, precision)
    b, hq, hkv, sk = 3, 8, 2, 1000
    q = llm_like(b, hq, 300, d, torch.bfloat16, 7)
    k = llm_like(b, hkv, sk, d, torch.bfloat16, 8, outliers=True)
    v = llm_like(b, hkv, sk, d, torch.bfloat16, 9)
    used = torch.tensor([1000, 517, 129], dtype=torch.int32, device="cuda")
    for i, n in enumerate(used.tolist()):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("nan") if pv else 1e4
    check(q, k, v, causal, seqused_k=used, precision=precision, block_n=block_n, qk=qk, pv=pv)


@pytest.mark.parametrize("block_n,pv", [pytest.param(n, "", id=str(n)) for n in _kernel_table.FP8_BLOCK_N[128]]
                         + [pytest.param(0, "input", id="int8qk")])
def test_fp8_long_row_accuracy(fp8_ext, block_n, pv):
    """One long causal row set (16k keys, the 8B's heads) against float64 on sampled query rows."""
    d, s = 128, 16384
    q = llm_like(1, 32, s, d, torch.bfloat16, 11)
    k = llm_like(1, 8, s, d, torch.bfloat16, 12, outliers=True)
    v = llm_like(1, 8, s, d, torch.bfloat16, 13)
    with tile(block_n):
        out = flash_attn_func(q, k, v, causal=True, precision="fp8", fp8_pv=pv)
    rows = torch.tensor([0, 1, 777, 4095, 8191, 12000, s - 1], device="cuda")
    # The float64 reference of the sampled rows: each row sees keys <= its index.
    qs = q[:, :, rows]
    ref, _ = attention_naive(qs, k, v, causal=False)
    mask = torch.arange(s, device="cuda").view(1, -1) <= rows.view(-1, 1)
    kk = k.double().repeat_interleave(4, dim=1)
    vv = v.double().repeat_interleave(4, dim=1)
    sc = (qs.double() @ kk.transpose(-1, -2)) / math.sqrt(d)
    sc = sc.masked_fill(~mask, float("-inf"))
    ref = torch.softmax(sc, dim=-1) @ vv
    cos, rel = metrics(out[:, :, rows], ref)
    assert not out.isnan().any()
    if pv:  # P V in bf16: the int8 Q K^T's ~0.013 is what is left (the reference on 2k keys), as in the grid
        assert cos >= 0.9995 and rel <= 0.03, f"cosine {cos:.6f}, rel L1 {rel:.4f}"
        return
    # int8 Q K^T (the default): e4m3's P and V leave ~0.04 relative error on Gaussian V (kernels/NOTES.md "v4")
    assert cos >= 0.999 and rel <= 0.05, f"cosine {cos:.5f}, rel L1 {rel:.4f}"


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("fp8")])
def test_fp8_odd_scale_counts(cuda_ext, variant):
    """Batch 1, one KV head, 513 keys: 9 K scales (or 17), an odd number of floats before v_scale in the workspace.
    The epilogue's float2 load of v_scale faulted there (cudaErrorMisalignedAddress; found by
    tests/sanitize_shapes.py --fp8 with this shape)."""
    precision, block_n, qk, pv = VARIANTS[variant]
    require(cuda_ext, precision)
    q = llm_like(1, 4, 300, 128, torch.bfloat16, 31)
    k = llm_like(1, 1, 513, 128, torch.bfloat16, 32, outliers=True)
    v = llm_like(1, 1, 513, 128, torch.bfloat16, 33)
    check(q, k, v, True, precision=precision, block_n=block_n, qk=qk, pv=pv)


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_tile_asked_is_the_tile_run(fp8_ext, d):
    """The binding resolves the tile (0: the build's default), refuses one it lacks, and the kernel launched is the
    one forced, through the op's dispatcher path too (the profiler makes flash_attn_func take it)."""
    assert fp8_ext.fp8_block_n(d, 0) in _kernel_table.FP8_BLOCK_N[d]  # the default, or LLM_ATTN_FP8_BLOCK_N's
    assert all(fp8_ext.fp8_block_n(d, n) == n for n in _kernel_table.FP8_BLOCK_N[d])
    assert fp8_ext.fp8_block_n(d, 320) == 0 and fp8_ext.fp8_block_n(96, 128) == 0
    assert fp8_ext.fp8_block_n(d, 256, pv="input") == 0  # P V in the input dtype: tiles up to 192 keys
    q = llm_like(1, 4, 300, d, torch.bfloat16, 21)
    k = llm_like(1, 2, 300, d, torch.bfloat16, 22, outliers=True)
    with pytest.raises(RuntimeError, match="no 320-key tile"):
        fp8_ext.mha_fwd_fp8(q, k, k, None, 0.1, True, block_n=320)
    with pytest.raises(ValueError, match="no 320-key tile"):
        with force_fp8_tile(320):
            pass
    if 256 in _kernel_table.FP8_BLOCK_N[d]:
        with pytest.raises(RuntimeError, match="no 256-key tile for head_dim 128 with pv='input'"):
            fp8_ext.mha_fwd_fp8(q, k, k, None, 0.1, True, block_n=256, pv="input")
        with pytest.raises(ValueError, match="fp8_pv='input'"), force_fp8_tile(256):
            flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_pv="input")
    # Unforced, the default tile depends on the S operands: int8 Q K^T (with e4m3 P V) has its own (H14)
    if "LLM_ATTN_FP8_BLOCK_N" not in os.environ:
        assert fp8_ext.fp8_block_n(d, 0, qk="int8") == _kernel_table.FP8_INT8_DEFAULT[d]
        assert fp8_ext.fp8_block_n(d, 0, qk="e4m3") == _kernel_table.FP8_BLOCK_N[d][0]
    for block_n in (*_kernel_table.FP8_BLOCK_N[d], 0):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with force_fp8_tile(block_n):
                flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_qk="int8")
            torch.cuda.synchronize()
        block_n = block_n or fp8_ext.fp8_block_n(d, 0, qk="int8")  # 0: the default the binding resolves
        names = {e.name for e in prof.events() if "flash_fwd_fp8_sm90_kernel" in e.name}
        # demangled or not; the default Q K^T is int8 (kQkInt8 = true), P V e4m3 (kPvInput = false: a fifth argument
        # that a demangled name shows and an older build lacks)
        ran = re.compile(rf"Fp8Traits<{d}, \d, {block_n}, true(, false)?>"
                         rf"|Fp8TraitsILi{d}ELi\dELi{block_n}ELb1E(Lb0E)?E")
        assert names and all(ran.search(n) for n in names), names


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("block_n", [128, 192])
def test_fp8_pv_input_runs_its_kernel(fp8_ext, d, block_n):
    """P V in the input dtype: the binding gives it the e4m3 P V's tiles (the same default), refuses e4m3 Q K^T and
    an unknown pv in its own words (flash_attn_func says so before any launch), and the kernel launched is
    Fp8Traits<d, 2, block_n, kQkInt8 = true, kPvInput = true> even with e4m3 Q K^T forced."""
    assert fp8_ext.fp8_block_n(d, 0, pv="input") == fp8_ext.fp8_block_n(d, 0, qk="e4m3")
    assert fp8_ext.fp8_block_n(d, block_n, pv="input") == block_n
    q = llm_like(1, 4, 300, d, torch.bfloat16, 23)
    k = llm_like(1, 2, 300, d, torch.bfloat16, 24, outliers=True)
    with pytest.raises(RuntimeError, match="pv must be 'e4m3' or 'input'"):
        fp8_ext.mha_fwd_fp8(q, k, k, None, 0.1, True, pv="fp16")
    with pytest.raises(RuntimeError, match="int8 Q K\\^T only"):
        fp8_ext.mha_fwd_fp8(q, k, k, None, 0.1, True, qk="e4m3", pv="input")
    with pytest.raises(ValueError, match="int8 Q K\\^T only"):
        flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_qk="e4m3", fp8_pv="input")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with force_fp8_qk("e4m3"), force_fp8_tile(block_n):
            out = flash_attn_func(q, k, k, causal=True, precision="fp8", fp8_pv="input")
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if "flash_fwd_fp8_sm90_kernel" in e.name}
    ran = re.compile(rf"Fp8Traits<{d}, 2, {block_n}, true, true>|Fp8TraitsILi{d}ELi2ELi{block_n}ELb1ELb1EE")
    assert names and all(ran.search(n) for n in names), names
    ref = attention_fp8(q, k, k, causal=True, qk="int8", pv="input")
    _, rel = metrics(out, ref)
    assert rel <= PV_INPUT_VS_REFERENCE[q.dtype], rel


def test_fp8_bad_input_is_one_line(fp8_ext):
    q = torch.randn(1, 4, 64, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_func(q, q[:, :2], q[:, :2], precision="fp8", path="kernel")
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.float32)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flash_attn_func(q, q, q, precision="fp8", path="kernel")


@pytest.mark.parametrize("impl,variant", [("llm_attn_fp8", "fp8"), ("llm_attn_int8qk", "int8qk")])
def test_fp8_entry_in_a_model(fp8_ext, impl, variant):
    """The registry entry through the patch: prefill in FP8, counted as such; logits close to the native kernel's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import llm_attn

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (1, 300), device="cuda")
    with torch.no_grad():
        llm_attn.patch_model(model, impl="llm_attn")
        native = model(ids).logits.float()
        report = llm_attn.patch_model(model, impl=impl)
        fp8 = model(ids).logits.float()
    assert f"{variant}=2" in str(report), str(report)
    assert torch.nn.functional.cosine_similarity(fp8.flatten(), native.flatten(), dim=0).item() > 0.99

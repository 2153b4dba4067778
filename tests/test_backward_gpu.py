"""GPU tests of the backward kernels (skip without CUDA). Each case: fresh random inputs, the forward kernel's out/lse,
gradient buffers poisoned with NaN before ``mha_bwd``, dq/dk/dv compared with float64 autograd of the naive
reference. The bound is relative to PyTorch's own low-precision error (the same attention computed and
differentiated in fp16/bf16 against float64): ours must be within 2x of it (plus a tiny floor).

    pytest tests/test_backward_gpu.py -q            # the default subset of the grids
    pytest tests/test_backward_gpu.py -q -m full    # every case

Every test that takes ``cuda_ext`` runs once per kernel build (the compiled extension, NVRTC; conftest.py): both
have the backward (``LLM_ATTN_BACKEND=nvrtc`` runs the NVRTC one only). ``test_nvrtc_backward_is_the_aot_backward``
compares the two builds on the same inputs: the same bits where nothing is summed by atomics.

The grids (``test_backward_grid``, ``test_backward_forced_splits``) run every dtype x mask x head_dim x heads (x
split count) combination by default, each with rotating awkward lengths; ``-m full`` runs the whole cross product
(conftest.py ``grid``).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from conftest import HEADS, UNEQUAL, grid
from llm_attn import attention_naive, flash_attn_func
from llm_attn.harness.graphs import graph_capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LENGTHS = [1, 17, 63, 127, 129, 1000]
PAIRS = [(n, n) for n in LENGTHS] + UNEQUAL


def run_raw(ext, q, k, v, dout, causal, scale=None, seqused_k=None):
    """Forward kernel, then the backward kernels into NaN-poisoned dq/dk/dv (an unwritten element stays NaN)."""
    b, hq, sq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    ext.mha_fwd(q, k, v, out, lse, seqused_k, scale, causal)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    ext.mha_bwd(dout, q, k, v, out, lse, None, dq, dk, dv, seqused_k, scale, causal)
    return dq, dk, dv


def reference_grads(q, k, v, dout, causal, scale=None, seqused_k=None, compute_dtype=torch.float64):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = attention_naive(qq, kk, vv, causal=causal, scale=scale, seqused_k=seqused_k, compute_dtype=compute_dtype)
    return torch.autograd.grad(out, (qq, kk, vv), dout.to(out.dtype), allow_unused=True)


def check_grads(got, q, k, v, dout, causal, scale=None, seqused_k=None, ref_kv=None):
    """`ref_kv`: K/V to give the references (e.g. with the garbage past seqused_k zeroed)."""
    torch.cuda.synchronize()
    rk, rv = ref_kv if ref_kv is not None else (k, v)
    ref = reference_grads(q, rk, rv, dout, causal, scale, seqused_k)
    pt = reference_grads(q, rk, rv, dout, causal, scale, seqused_k, compute_dtype=q.dtype)
    errs = {}
    for name, a, r, p in zip(("dq", "dk", "dv"), got, ref, pt, strict=True):
        r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
        p = torch.zeros_like(a) if p is None else p
        assert not a.isnan().any(), f"NaN in {name} (unwritten element or bad masking)"
        err = (a.double() - r).abs().max().item()
        pt_err = (p.double() - r).abs().max().item()
        floor = 1e-4 * max(1.0, r.abs().max().item())
        assert err <= 2 * pt_err + floor, f"{name}: max err {err:.3e} > 2 x PyTorch's {pt_err:.3e} (+{floor:.1e})"
        errs[name] = (err, pt_err)
    return errs


def _qkv(b, hq, hkv, sq, sk, d, dt, seed):
    torch.manual_seed(seed)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dt)
    v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dt)
    dout = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
    return q, k, v, dout


# The kernels every grid runs on, each forced (llm_attn.backward.force_bwd_tile): the portable one (what every GPU
# but compute capability 9.0 runs) with dQ by atomics and by the separate dQ kernel, the portable one with
# two-dimensional warp tiles, and the Hopper one (what 9.0 runs; skipped elsewhere) with each of its two dQ ways.
KERNELS = ["portable", "portable_separate_dq", "portable_2d", "hopper_own_dq", "hopper_shared_dq"]


def forced_kernel(cuda_ext, kernel):
    from llm_attn.backward import force_bwd_tile

    if kernel.startswith("hopper") and not cuda_ext.sm90_available():
        pytest.skip("the Hopper backward needs a compute capability 9.0 GPU and an sm_90a build")
    return force_bwd_tile(kernel)


@pytest.mark.parametrize("dtype,causal,d,heads,kernel,sq,sk",
                         grid([list(DTYPES), [False, True], [64, 128], list(HEADS), KERNELS], PAIRS, per_combo=2))
def test_backward_grid(cuda_ext, dtype, causal, d, sq, sk, heads, kernel):
    hq, hkv = HEADS[heads]
    q, k, v, dout = _qkv(2, hq, hkv, sq, sk, d, DTYPES[dtype], zlib.crc32(repr((dtype, causal, d, sq, sk, heads)).encode()))
    with forced_kernel(cuda_ext, kernel):
        got = run_raw(cuda_ext, q, k, v, dout, causal)
    check_grads(got, q, k, v, dout, causal)


@pytest.mark.parametrize("causal,d,heads,splits,kernel,sq,sk",
                         grid([[False, True], [64, 128], ["mha", "gqa"], [1, 2, 5], KERNELS],
                              [(63, 63), (129, 1000), (1000, 129), (300, 300)], per_combo=1))
def test_backward_forced_splits(cuda_ext, causal, d, sq, sk, heads, splits, kernel):
    """Each key block's steps shared by 1 (direct dK/dV stores), 2 or 5 thread blocks (float32 atomics), whatever
    the automatic choice for the shape would be."""
    from llm_attn.backward import force_bwd_splits

    hq, hkv = HEADS[heads]
    q, k, v, dout = _qkv(2, hq, hkv, sq, sk, d, torch.bfloat16, zlib.crc32(repr((causal, d, sq, sk, heads, splits)).encode()))
    with forced_kernel(cuda_ext, kernel), force_bwd_splits(splits):
        assert cuda_ext.bwd_splits(2, hq, hkv, sq, sk, d, causal, 132)[0] <= splits
        got = run_raw(cuda_ext, q, k, v, dout, causal)
    check_grads(got, q, k, v, dout, causal)


@pytest.mark.parametrize("dtype,causal,heads,splits,sq,sk",
                         grid([list(DTYPES), [False, True], list(HEADS), [0, 3]], PAIRS, per_combo=1))
def test_backward_narrow_tile(cuda_ext, dtype, causal, heads, splits, sq, sk):
    """head_dim 128's narrow tile (4 warps x 64 keys: what a device with 99 KB of shared memory per block, sm_86/89,
    takes instead of the 8-warp 128-key tile) forced here, automatic and 3-way split."""
    from llm_attn.backward import force_bwd_splits, force_bwd_tile

    hq, hkv = HEADS[heads]
    q, k, v, dout = _qkv(2, hq, hkv, sq, sk, 128, DTYPES[dtype],
                         zlib.crc32(repr((dtype, causal, heads, splits, sq, sk, "narrow")).encode()))
    with force_bwd_tile("narrow"), force_bwd_splits(splits):
        got = run_raw(cuda_ext, q, k, v, dout, causal)
    check_grads(got, q, k, v, dout, causal)


def test_force_bwd_tile_rejects_unknown_names():
    from llm_attn.backward import force_bwd_tile

    with pytest.raises(ValueError, match="'auto', 'portable', 'narrow', 'hopper', 'hopper_own_dq', 'hopper_shared_dq', "
                                         "'portable_separate_dq'"):
        with force_bwd_tile("wide"):
            pass


def test_force_bwd_tile_hopper_off_sm90_is_a_clear_error(cuda_ext):
    from llm_attn.backward import force_bwd_tile

    if cuda_ext.sm90_available():
        pytest.skip("this GPU runs the Hopper backward")
    with pytest.raises(ValueError, match="compute capability 9.0"):
        with force_bwd_tile("hopper"):
            pass


def test_backward_split_heuristic(cuda_ext):
    """Causal grids under 2 waves of key blocks are split (~4 waves); non-causal grids only when they leave SMs
    idle (whole copies of the grid in one wave); large grids never (132 SMs, one 8-warp block per SM; the narrow
    tile: two 4-warp blocks of 64 keys)."""
    from llm_attn.backward import force_bwd_tile

    assert cuda_ext.bwd_splits(1, 32, 8, 2048, 2048, 128, True, 132)[0] > 1
    assert cuda_ext.bwd_splits(1, 32, 8, 16384, 16384, 128, True, 132)[0] == 1
    assert cuda_ext.bwd_splits(1, 32, 8, 512, 512, 128, False, 132)[0] == 4    # 32 key blocks -> 128 blocks
    assert cuda_ext.bwd_splits(1, 32, 8, 2048, 2048, 128, False, 132)[0] == 1  # 128 key blocks: ~a full wave
    assert cuda_ext.bwd_splits(4, 32, 32, 8192, 8192, 64, False, 132)[0] == 1
    with force_bwd_tile("narrow"):  # 64-key blocks, 264 slots
        assert cuda_ext.bwd_splits(1, 32, 8, 512, 512, 128, False, 132)[0] == 4    # 64 key blocks -> 256 blocks
        assert cuda_ext.bwd_splits(1, 32, 8, 2048, 2048, 128, True, 132)[0] > 1    # 256 causal blocks: < 2 waves
        assert cuda_ext.bwd_splits(1, 32, 8, 8192, 8192, 128, True, 132)[0] == 1   # 1024: 3.9 waves


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 4, 300])
def test_backward_seqused_k(cuda_ext, causal, sq, kernel):
    """A static cache: per-batch used lengths on the device, NaN/huge garbage past them; gradients there are 0."""
    b, hq, hkv, d, cap = 4, 8, 2, 128, 2048
    q, k, v, dout = _qkv(b, hq, hkv, sq, cap, d, torch.float16, sq)
    used = torch.tensor([cap, 1000, sq, 777], dtype=torch.int32, device="cuda")
    kc, vc = k.clone(), v.clone()
    for i, n in enumerate(used.tolist()):
        kc[i, :, n:] = 0
        vc[i, :, n:] = 0
    k[1, :, 1000:] = float("nan")
    v[2, :, sq:] = 6e4
    with forced_kernel(cuda_ext, kernel):
        got = run_raw(cuda_ext, q, k, v, dout, causal, seqused_k=used)
    check_grads(got, q, k, v, dout, causal, seqused_k=used, ref_kv=(kc, vc))
    _, dk, dv = got
    for i, n in enumerate(used.tolist()):
        assert torch.all(dk[i, :, n:] == 0) and torch.all(dv[i, :, n:] == 0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq", [1, 300])
def test_backward_seqused_k_out_of_range_is_clamped(cuda_ext, causal, sq, kernel):
    """seqused_k above kv_len counts as kv_len, below 0 as 0 (flash_attn_func's docstring): the gradients of
    out-of-range values are those of the clamped values (exactly zero for a batch that uses no key)."""
    q, k, v, dout = _qkv(4, 8, 2, sq, 500, 64, torch.float16, seed=sq + causal)
    wild = torch.tensor([501, 2**31 - 1, -1, -2**31], dtype=torch.int32, device="cuda")
    clamped = torch.tensor([500, 500, 0, 0], dtype=torch.int32, device="cuda")
    with forced_kernel(cuda_ext, kernel):
        got = run_raw(cuda_ext, q, k, v, dout, causal, seqused_k=wild)
        ref = run_raw(cuda_ext, q, k, v, dout, causal, seqused_k=clamped)
    torch.cuda.synchronize()
    # dQ is accumulated with float32 atomics, and on a grid this small so are dK/dV (split key blocks): the order of
    # the additions varies from launch to launch, so the gradients are compared at that run-to-run spread (the
    # rounding of the fp16 result), not bitwise. The batches that use no key must be exactly 0 (below).
    for a, r in zip(got, ref, strict=True):
        assert not r.isnan().any() and not a.isnan().any()
        torch.testing.assert_close(a, r, rtol=2e-3, atol=2e-3)
    assert all(torch.all(g[2:] == 0) for g in got)
    check_grads(got, q, k, v, dout, causal, seqused_k=wild)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_backward_strided_transformers_layout(cuda_ext, dtype, causal, kernel):
    """(B, S, H, D) projections viewed as (B, H, S, D), K sliced out of a longer buffer, dO transposed, gradient
    buffers in (B, S, H, D) order."""
    dt = DTYPES[dtype]
    b, s, hq, hkv, d = 2, 77, 32, 8, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(b, hkv, 300, d, device="cuda", dtype=dt)[:, :, :200]
    v = torch.randn(b, 200, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
    sk = 200
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=dt).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or dout.is_contiguous())
    scale = 1 / math.sqrt(d)
    out = torch.empty(b, s, hq, d, dtype=dt, device="cuda").transpose(1, 2)
    lse = torch.empty(b, hq, s, dtype=torch.float32, device="cuda")
    cuda_ext.mha_fwd(q, k, v, out, lse, None, scale, causal)
    dq = torch.full((b, s, hq, d), float("nan"), dtype=dt, device="cuda").transpose(1, 2)
    dk = torch.full((b, sk, hkv, d), float("nan"), dtype=dt, device="cuda").transpose(1, 2)
    dv = torch.full((b, hkv, 400, d), float("nan"), dtype=dt, device="cuda")[:, :, 100:300]
    with forced_kernel(cuda_ext, kernel):
        cuda_ext.mha_bwd(dout, q, k, v, out, lse, None, dq, dk, dv, None, scale, causal)
    check_grads((dq, dk, dv), q, k, v, dout, causal)


# -- the two eager autograd ways: the build's own node ("node": the extension's C++ autograd function, binding.cpp
# FlashAttnFunction, on the AOT build; llm_attn.backward.FlashAttnEager, one Python node, on the NVRTC build) and the
# torch.library op's autograd (llm_attn/backward.py, cpp_autograd(False)). All run the same kernels; each test checks
# which node it recorded.
AUTOGRAD_WAYS = ["node", "op"]


def autograd_way(ext, way):
    from llm_attn.ops import cpp_autograd

    return cpp_autograd(way == "node")


def assert_node(out, way):
    from llm_attn._ext import get_ext

    name = out.grad_fn.name()
    own = "FlashAttnFunction" if hasattr(get_ext(), "mha_fwd_autograd") else "FlashAttnEager"
    assert (own in name) == (way == "node") and ("flash_fwd" in name) == (way == "op"), name


@pytest.mark.parametrize("way", AUTOGRAD_WAYS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_autograd_public_api(cuda_ext, dtype, way):
    """flash_attn_func + .backward(): same gradients as the raw kernels; lse gradient through the kernel too."""
    dt = DTYPES[dtype]
    q, k, v, dout = _qkv(2, 16, 4, 333, 333, 64, dt, 3)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with autograd_way(cuda_ext, way):
        out, lse = flash_attn_func(qq, kk, vv, causal=True, return_lse=True)
    assert_node(out, way)
    dlse = torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    assert not any(t.grad.isnan().any() for t in (qq, kk, vv))
    # Reference: float64 autograd of out . dout + lse . dlse.
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, _ = attention_naive(q64, k64, v64, causal=True)
    s = torch.matmul(q64, k64.repeat_interleave(4, 1).transpose(-1, -2)) / 8
    s = s.masked_fill(torch.ones(333, 333, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    l64 = torch.logsumexp(s, -1)
    ref = torch.autograd.grad((o64 * dout.double()).sum() + (l64 * dlse.double()).sum(), (q64, k64, v64))
    for t, r in zip((qq, kk, vv), ref, strict=True):
        err = (t.grad.double() - r).abs().max().item()
        assert err <= 2e-2 * max(1.0, r.abs().max().item()), err
    # Without the lse gradient, autograd's dq/dk/dv are the raw kernels' (up to the dQ atomics' summation order).
    for t in (qq, kk, vv):
        t.grad = None
    with autograd_way(cuda_ext, way):
        flash_attn_func(qq, kk, vv, causal=True).backward(dout)
    raw = run_raw(cuda_ext, q, k, v, dout, True)
    for t, r in zip((qq, kk, vv), raw, strict=True):
        torch.testing.assert_close(t.grad, r, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("way", AUTOGRAD_WAYS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,hq,hkv,sq,sk", [(128, 32, 8, 77, 200), (64, 6, 1, 129, 63), (128, 4, 4, 1, 300)])
def test_autograd_strided_inputs_and_expanded_gradient(cuda_ext, way, dtype, causal, d, hq, hkv, sq, sk):
    """Through flash_attn_func: q a (B, S, H, D) projection viewed as (B, H, S, D), K sliced out of a longer buffer,
    V transposed; out.sum() gives an expanded (stride 0) output gradient. Gradients reach the leaves in their
    layouts, against float64 (check_grads' bound), with no NaN; both autograd ways give the same values."""
    dt = DTYPES[dtype]
    torch.manual_seed(31 + sq)
    qb = torch.randn(2, sq, hq, d, device="cuda", dtype=dt, requires_grad=True)
    kb = torch.randn(2, hkv, sk + 37, d, device="cuda", dtype=dt, requires_grad=True)
    vb = torch.randn(2, sk, hkv, d, device="cuda", dtype=dt, requires_grad=True)
    q, k, v = qb.transpose(1, 2), kb[:, :, :sk], vb.transpose(1, 2)
    with autograd_way(cuda_ext, way):
        out = flash_attn_func(q, k, v, causal=causal)
    assert_node(out, way)
    out.sum().backward()  # the output gradient: ones expanded, stride 0 everywhere
    assert qb.grad.shape == qb.shape and kb.grad.shape == kb.shape and vb.grad.shape == vb.shape
    assert torch.count_nonzero(kb.grad[:, :, sk:]) == 0  # the keys past the slice got no gradient
    got = (qb.grad.transpose(1, 2), kb.grad[:, :, :sk], vb.grad.transpose(1, 2))
    check_grads(got, q.detach(), k.detach(), v.detach(), torch.ones_like(q), causal)


@pytest.mark.parametrize("way", AUTOGRAD_WAYS)
@pytest.mark.parametrize("causal", [False, True])
def test_inputs_the_kernels_cannot_read_in_place(cuda_ext, way, causal):
    """q at a misaligned base (one element into its buffer), K rows 68 elements apart, V heads 68 apart: each is
    copied once (mha_fwd_alloc / mha_fwd_autograd in C++, the NVRTC launcher in Python), never rejected. The output
    without gradients and the gradients (reaching the original buffers) match float64."""
    dt, b, hq, hkv, sq, sk, d = torch.float16, 2, 4, 2, 37, 50, 64
    torch.manual_seed(34)
    qbuf = torch.randn(b * hq * sq * d + 1, device="cuda", dtype=dt, requires_grad=True)
    kbuf = torch.randn(b, hkv, sk, d + 4, device="cuda", dtype=dt, requires_grad=True)
    vbuf = torch.randn(b, sk, hkv, d + 4, device="cuda", dtype=dt, requires_grad=True)
    q, k, v = qbuf[1:].view(b, hq, sq, d), kbuf[..., :d], vbuf[..., :d].transpose(1, 2)
    from llm_attn.kernel_contract import aligned16

    assert not (aligned16(q) or aligned16(k) or aligned16(v))
    with torch.no_grad():
        out = flash_attn_func(q, k, v, causal=causal)
    ref, _ = attention_naive(q.detach(), k.detach(), v.detach(), causal=causal)
    pt, _ = attention_naive(q.detach(), k.detach(), v.detach(), causal=causal, compute_dtype=dt)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max() <= 2 * (pt.double() - ref).abs().max() + 1e-4
    dout = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
    with autograd_way(cuda_ext, way):
        out = flash_attn_func(q, k, v, causal=causal)
    assert_node(out, way)
    out.backward(dout)
    got = (qbuf.grad[1:].view(b, hq, sq, d), kbuf.grad[..., :d], vbuf.grad[..., :d].transpose(1, 2))
    assert qbuf.grad[0] == 0 and torch.count_nonzero(kbuf.grad[..., d:]) == 0
    check_grads(got, q.detach(), k.detach(), v.detach(), dout, causal)


def test_own_node_refuses_double_backward(cuda_ext):
    """create_graph=True through the build's own node (the C++ autograd function, or FlashAttnEager on NVRTC): one
    clear error, never gradients that a second backward would silently treat as constants."""
    q, k, v, dout = _qkv(1, 4, 2, 64, 64, 64, torch.float16, 32)
    q.requires_grad_()
    with autograd_way(cuda_ext, "node"):
        out = flash_attn_func(q, k, v, causal=True)
    assert_node(out, "node")
    with pytest.raises(RuntimeError, match="create_graph=True, but it is not differentiable"):
        torch.autograd.grad(out, q, dout, create_graph=True)


@pytest.mark.parametrize("way", AUTOGRAD_WAYS)
def test_autograd_under_activation_checkpointing(cuda_ext, way):
    """torch.utils.checkpoint (non-reentrant: saved-tensor hooks; reentrant: a recomputed forward) gives the plain
    backward's gradients on both autograd ways."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, dout = _qkv(2, 8, 2, 300, 300, 128, torch.bfloat16, 33)

    def grads(wrap):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with autograd_way(cuda_ext, way):
            out = wrap(lambda a, b, c: flash_attn_func(a, b, c, causal=True), *leaves)
        out.backward(dout)
        return [t.grad for t in leaves]

    plain = grads(lambda f, *a: f(*a))
    for reentrant in (False, True):
        for g, r in zip(grads(lambda f, *a: checkpoint(f, *a, use_reentrant=reentrant)), plain, strict=True):
            assert not g.isnan().any()
            torch.testing.assert_close(g, r, atol=1e-2, rtol=1e-2)


def test_backward_compile(cuda_ext):
    """torch.compile of forward + backward (fullgraph): same gradients as eager."""
    q, k, v, dout = _qkv(2, 8, 2, 200, 200, 128, torch.bfloat16, 4)

    def step(q, k, v):
        return (flash_attn_func(q, k, v, causal=True) * dout).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    step(*leaves).backward()
    compiled = torch.compile(step, fullgraph=True)
    leaves_c = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves_c).backward()
    for a, b in zip(leaves, leaves_c, strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=2e-2, rtol=2e-2)
        assert not b.grad.isnan().any()


def test_backward_binding_errors(cuda_ext):
    f16 = dict(device="cuda", dtype=torch.float16)
    q, k = torch.randn(1, 4, 8, 64, **f16), torch.randn(1, 2, 8, 64, **f16)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"llm_attn.mha_bwd: dq \[1, 4, 7, 64\] must have shape \[1, 4, 8, 64\]"):
        cuda_ext.mha_bwd(q, q, k, k, out, lse, None, q[:, :, :7], torch.empty_like(k), torch.empty_like(k), None,
                         0.125, False)
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32"):
        cuda_ext.mha_bwd(q, q, k, k, out, lse.half(), None, torch.empty_like(q), torch.empty_like(k),
                         torch.empty_like(k), None, 0.125, False)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128, got 96"):
        q96 = torch.randn(1, 4, 8, 96, **f16)
        cuda_ext.mha_bwd(q96, q96, q96, q96, q96, lse, None, q96, q96, q96, None, 0.125, False)


# -- a patched tiny Llama trains on the kernel -----------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patched_tiny_llama_training_gradients_match_sdpa(cuda_ext, head_dim, dtype):
    """loss.backward() of a patched tiny Llama (kernel forward + backward) against stock sdpa, both in the low
    dtype, measured against the same model in float32 on sdpa: our gradient error within 2x sdpa's + a floor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llm_attn.patches import patched

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base = LlamaForCausalLM(cfg)
    base.set_attn_implementation("sdpa")
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(base.to("cuda", torch.float32).train())
    model = base.to(dtype)
    stock = grads(model)
    with patched(model, backend="cuda") as report:
        ours = grads(model)
        assert report.native_calls == {"cuda": 2} and report.num_fallback_calls == 0, str(report)
    assert ours.keys() == ref.keys()
    for name in ref:
        err = (ours[name] - ref[name]).abs().max().item()
        sdpa_err = (stock[name] - ref[name]).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-3 * ref[name].abs().max().item(), f"{name}: {err:.3e} vs sdpa {sdpa_err:.3e}"


# -- the two builds side by side -------------------------------------------------------------------------------------
def _build(name: str):
    """The module of build `name`, or skip saying why it is missing (a failure where LLM_ATTN_REQUIRE_BACKENDS names
    it)."""
    import os

    from llm_attn import _ext

    status = _ext.backend_status()[name]
    if status != "available":
        required = {b.strip() for b in os.environ.get("LLM_ATTN_REQUIRE_BACKENDS", "").split(",") if b.strip()}
        if name in required:
            pytest.fail(f"the {name} build is required but not available: {status}")
        pytest.skip(f"needs the {name} build: {status}")
    prev = _ext.set_backend(name)
    try:
        return _ext.get_ext()
    finally:
        _ext.set_backend(prev)


def _both_builds():
    return _build("aot"), _build("nvrtc")


def _forced_in(ext, tile: str, splits: int):
    """force_bwd_tile / force_bwd_splits on one build's module (the context managers act on the selected build)."""
    from llm_attn._plan import BWD_TILE_IDS

    class _Forced:
        def __enter__(self):
            self.prev = (ext.set_bwd_tile(BWD_TILE_IDS[tile]), ext.set_bwd_splits(splits))

        def __exit__(self, *exc):
            ext.set_bwd_tile(self.prev[0])
            ext.set_bwd_splits(self.prev[1])

    return _Forced()


# (tile, splits) whose dK, dV and dQ are each written by one thread block, without atomics: the portable kernel with
# the separate dQ kernel and no key-block split. Elsewhere dQ (atomics or TMA reduce-add) and, when split, dK/dV are
# float32 sums in launch-dependent order: there the builds agree to that order's rounding (the check below), and
# dK/dV bit for bit where the key blocks are not split.
BITWISE = [("portable_separate_dq", 1)]
COMPARED = BITWISE + [("portable", 1), ("portable", 3), ("narrow", 1), ("hopper_own_dq", 1), ("hopper_shared_dq", 1),
                      ("hopper", 0), ("auto", 0)]


@pytest.mark.parametrize("tile,splits", COMPARED)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,heads,sq,sk", [(64, "gqa", 1000, 1000), (128, "mha", 129, 2049), (128, "mqa", 300, 77),
                                          (64, "mha", 2049, 129)])
def test_nvrtc_backward_is_the_aot_backward(tile, splits, dtype, causal, d, heads, sq, sk):
    """The NVRTC build runs the AOT build's backward: the same kernels, tiles, splits and launches (llm_attn._plan
    mirrors flash_bwd_set_splits), so on the same inputs it gives the same bits where nothing is summed by atomics
    (BITWISE; dK/dV of every unsplit launch), and elsewhere agrees within the atomics' run-to-run rounding. The
    split and tile each build chose are compared too."""
    aot, nvrtc = _both_builds()
    if tile.startswith("hopper") and not (aot.sm90_available() and nvrtc.sm90_available()):
        pytest.skip("the Hopper backward needs a compute capability 9.0 GPU and sm_90a code in both builds")
    hq, hkv = HEADS[heads]
    q, k, v, dout = _qkv(2, hq, hkv, sq, sk, d, DTYPES[dtype], zlib.crc32(repr((tile, splits, dtype, causal, d,
                                                                               heads, sq, sk)).encode()))
    scale = 1 / math.sqrt(d)
    out = torch.empty(2, sq, hq, d, dtype=q.dtype, device="cuda").transpose(1, 2)
    lse = torch.empty(2, hq, sq, dtype=torch.float32, device="cuda")
    aot.mha_fwd(q, k, v, out, lse, None, scale, causal)  # one forward: the backwards start from the same bits
    got = {}
    for name, ext in (("aot", aot), ("nvrtc", nvrtc)):
        with _forced_in(ext, tile, splits):
            grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
            ext.mha_bwd(dout, q, k, v, out, lse, None, *grads, None, scale, causal)
            got[name] = grads
            got[name + "_splits"] = ext.bwd_splits(2, hq, hkv, sq, sk, d, causal,
                                                    torch.cuda.get_device_properties(0).multi_processor_count)
    torch.cuda.synchronize()
    assert got["aot_splits"] == got["nvrtc_splits"]
    unsplit = got["aot_splits"][0] == 1
    for name, a, n in zip(("dq", "dk", "dv"), got["aot"], got["nvrtc"], strict=True):
        assert not n.isnan().any(), f"NaN in the NVRTC build's {name}"
        if (tile, splits) in BITWISE or (name != "dq" and unsplit):
            assert torch.equal(a, n), f"{name}: the builds differ by {(a.float() - n.float()).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(n, a, rtol=2e-2, atol=2e-2 * max(1.0, a.abs().max().item()))
    check_grads(got["nvrtc"], q, k, v, dout, causal)


def test_nvrtc_backward_under_autograd_and_graphs():
    """flash_attn_func's autograd on the NVRTC build: the raw mha_bwd's gradients; and the backward captured in a
    CUDA graph and replayed gives them again (its workspaces come from torch's allocator on the captured stream)."""
    from llm_attn import _ext

    nvrtc = _build("nvrtc")
    prev = _ext.set_backend("nvrtc")
    try:
        q, k, v, dout = _qkv(2, 8, 2, 300, 300, 128, torch.bfloat16, 11)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with _forced_in(nvrtc, "portable_separate_dq", 1):
            flash_attn_func(*leaves, causal=True).backward(dout)
            raw = run_raw(nvrtc, q, k, v, dout, True)
            torch.cuda.synchronize()
            for t, r in zip(leaves, raw, strict=True):
                assert torch.equal(t.grad, r)
            static = [t.clone().requires_grad_() for t in (q, k, v)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compile, load, plan outside the capture
                    for t in static:
                        t.grad = None
                    flash_attn_func(*static, causal=True).backward(dout)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            for t in static:
                t.grad = None
            with graph_capture(graph):
                flash_attn_func(*static, causal=True).backward(dout)
            grads = [t.grad for t in static]
            for g in grads:
                g.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for g, r in zip(grads, raw, strict=True):
                assert torch.equal(g, r)
    finally:
        _ext.set_backend(prev)


# -- deterministic=True -------------------------------------------------------------------------------------------
def run_raw_det(ext, q, k, v, dout, causal, out_lse=None):
    """mha_bwd(deterministic=True) into NaN-poisoned gradients (the forward's out/lse given, or computed once)."""
    b, hq, sq, d = q.shape
    scale = 1 / math.sqrt(d)
    if out_lse is None:
        out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
        ext.mha_fwd(q, k, v, out, lse, None, scale, causal)
        out_lse = (out, lse)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    ext.mha_bwd(dout, q, k, v, *out_lse, None, *grads, None, scale, causal, True)
    return grads, out_lse


@pytest.mark.parametrize("tile,splits", [("auto", 0), ("auto", 3), ("narrow", 0), ("portable", 5), ("portable_2d", 0),
                                         ("portable_2d", 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,heads,sq,sk", [(128, "gqa", 2048, 2048), (64, "mha", 300, 1000), (128, "mqa", 1000, 129)])
def test_deterministic_backward_repeats_bit_for_bit(cuda_ext, tile, splits, causal, d, heads, sq, sk):
    """deterministic=True: the same dq, dk, dv bits over 50 reruns on the same inputs (issue 39's count), whatever
    the split (the automatic one splits the 2048-token causal grid; 3 and 5 forced), and within the float64 bound.
    On a compute capability 9.0 GPU 'auto' runs a portable kernel then (the Hopper one's dQ has no fixed order)."""
    from llm_attn.backward import force_bwd_splits, force_bwd_tile

    if tile == "narrow" and d != 128:
        pytest.skip("head_dim 64's narrow tile is its tile")
    hq, hkv = HEADS[heads]
    seed = zlib.crc32(repr((tile, splits, causal, d, sq)).encode())
    q, k, v, dout = _qkv(1, hq, hkv, sq, sk, d, torch.bfloat16, seed)
    with force_bwd_tile(tile), force_bwd_splits(splits):
        first, out_lse = run_raw_det(cuda_ext, q, k, v, dout, causal)
        for _ in range(49):
            again, _ = run_raw_det(cuda_ext, q, k, v, dout, causal, out_lse)
            for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
                assert torch.equal(a, b), f"{name} changed between runs by {(a.float() - b.float()).abs().max():.3e}"
    check_grads(first, q, k, v, dout, causal)


@pytest.mark.parametrize("way", AUTOGRAD_WAYS)
def test_deterministic_through_flash_attn_func_and_torch_flag(cuda_ext, way):
    """flash_attn_func(deterministic=True) and torch.use_deterministic_algorithms(True) (what a patched model
    follows) both give the raw deterministic backward's bits, run after run, on both autograd ways."""
    q, k, v, dout = _qkv(1, 32, 8, 1024, 1024, 128, torch.bfloat16, 21)
    raw, _ = run_raw_det(cuda_ext, q, k, v, dout, True)
    torch.cuda.synchronize()

    def grads(**kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with autograd_way(cuda_ext, way):
            out = flash_attn_func(*leaves, causal=True, **kw)
        assert_node(out, way)
        out.backward(dout)
        return [t.grad for t in leaves]

    for _ in range(3):
        for g, r in zip(grads(deterministic=True), raw, strict=True):
            assert torch.equal(g, r)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for g, r in zip(grads(), raw, strict=True):
            assert torch.equal(g, r)
    finally:
        torch.use_deterministic_algorithms(prev)


def test_deterministic_refuses_the_forced_hopper_backward(cuda_ext):
    """The Hopper kernel cannot honour deterministic=True: forced, it is refused in one line (never silently
    nondeterministic); 'auto' falls back to the portable kernel (test above)."""
    from llm_attn.backward import force_bwd_tile

    if not cuda_ext.sm90_available():
        pytest.skip("the Hopper backward needs a compute capability 9.0 GPU and sm_90a code")
    q, k, v, dout = _qkv(1, 4, 4, 64, 64, 64, torch.float16, 22)
    for tile in ("hopper", "hopper_own_dq", "hopper_shared_dq"):
        with force_bwd_tile(tile), pytest.raises(RuntimeError, match="deterministic=True, but the Hopper backward "
                                                                     "was forced"):
            run_raw_det(cuda_ext, q, k, v, dout, False)


@pytest.mark.parametrize("splits", [0, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_is_the_same_on_both_builds(splits, causal):
    """deterministic=True sums nothing by atomics, so the NVRTC build gives the AOT build's bits exactly."""
    aot, nvrtc = _both_builds()
    q, k, v, dout = _qkv(2, 16, 4, 777, 1500, 128, torch.float16, 23 + splits + causal)
    got, out_lse = {}, None
    for name, ext in (("aot", aot), ("nvrtc", nvrtc)):
        with _forced_in(ext, "auto", splits):
            got[name], out_lse = run_raw_det(ext, q, k, v, dout, causal, out_lse)  # the AOT forward's out/lse
    torch.cuda.synchronize()
    for name, a, n in zip(("dq", "dk", "dv"), got["aot"], got["nvrtc"], strict=True):
        assert torch.equal(a, n), f"{name}: the builds differ by {(a.float() - n.float()).abs().max().item():.3e}"

"""CPU tests of the tiled PyTorch reference (the path CI and GPU-less machines run) and of flash_attn_func's
validation. The ground truth is torch's own scaled_dot_product_attention in float64 with an explicit
bottom-right causal mask and K/V expanded for GQA."""

import math
import subprocess
import sys

import pytest
import torch

from conftest import HEADS, LENGTHS, UNEQUAL
from llm_attn import attention_naive, attention_tiled, flash_attn_func


def sdpa_f64(q, k, v, causal, scale=None, seqused_k=None):
    """torch SDPA in float64 with bottom-right causal alignment; rows with no visible key -> 0."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    used = torch.full((b,), sk) if seqused_k is None else seqused_k.long()
    kpos = torch.arange(sk)
    mask = kpos.view(1, 1, sk) < used.view(b, 1, 1)
    if causal:
        mask = mask & (kpos.view(1, 1, sk) <= torch.arange(sq).view(1, sq, 1) + (used.view(b, 1, 1) - sq))
    mask = mask.unsqueeze(1)  # (b, 1, sq, sk)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))  # SDPA gives NaN on empty rows


SHAPES = [(n, n) for n in LENGTHS if n <= 1000] + [(sq, sk) for sq, sk in UNEQUAL if max(sq, sk) <= 1000]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_tiled_reference_matches_sdpa_f64(sq, sk, causal, heads):
    torch.manual_seed(sq * 7919 + sk)
    hq, hkv = HEADS[heads]
    q = torch.randn(2, hq, sq, 64, dtype=torch.float64)
    k = torch.randn(2, hkv, sk, 64, dtype=torch.float64)
    v = torch.randn(2, hkv, sk, 64, dtype=torch.float64)
    out, lse = attention_tiled(q, k, v, causal=causal, block_n=64)
    ref = sdpa_f64(q, k, v, causal)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    _, lse_naive = attention_naive(q, k, v, causal=causal)
    torch.testing.assert_close(lse, lse_naive, rtol=1e-6, atol=1e-6)


def test_head_dim_128_scale_and_empty_rows():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 40, 128, dtype=torch.float64)
    k = torch.randn(1, 1, 25, 128, dtype=torch.float64)
    v = torch.randn(1, 1, 25, 128, dtype=torch.float64)
    out, lse = attention_tiled(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out, sdpa_f64(q, k, v, True, scale=0.3), rtol=1e-10, atol=1e-10)
    # q_len 40 > kv_len 25: the first 15 rows see no key -> zeros and lse -inf, never NaN.
    assert torch.all(out[:, :, :15] == 0) and torch.all(lse[:, :, :15] == -math.inf)
    assert torch.isfinite(lse[:, :, 15:]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k(causal):
    torch.manual_seed(1)
    q = torch.randn(3, 8, 5, 64, dtype=torch.float64)
    k = torch.randn(3, 2, 70, 64, dtype=torch.float64)
    v = torch.randn(3, 2, 70, 64, dtype=torch.float64)
    used = torch.tensor([70, 33, 5], dtype=torch.int32)
    out = flash_attn_func(q, k, v, causal=causal, seqused_k=used)
    torch.testing.assert_close(out, sdpa_f64(q, k, v, causal, seqused_k=used), rtol=1e-10, atol=1e-10)
    # Garbage in the unused slots must not matter.
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 33:] = float("nan")
    v2[2, :, 5:] = 1e30
    torch.testing.assert_close(flash_attn_func(q, k2, v2, causal=causal, seqused_k=used), out, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_out_of_range_is_clamped(causal):
    """flash_attn_func's contract: seqused_k is read on the device and not validated; values above kv_len count as
    kv_len, values below 0 as 0 (the kernels clamp the same way: tests/test_kernel_gpu.py, test_backward_gpu.py)."""
    torch.manual_seed(2)
    q = torch.randn(5, 4, 6, 64, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 2, 40, 64, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 2, 40, 64, dtype=torch.float64, requires_grad=True)
    wild = torch.tensor([41, 2**31 - 1, -1, -2**31, 17], dtype=torch.int32)
    clamped = torch.tensor([40, 40, 0, 0, 17], dtype=torch.int32)
    dout = torch.randn(5, 4, 6, 64, dtype=torch.float64)
    results = {}
    for name, used in (("wild", wild), ("clamped", clamped)):
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, seqused_k=used)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results[name] = (out, lse, *grads)
    for a, b in zip(results["wild"], results["clamped"], strict=True):
        assert torch.equal(a, b)
    out, lse = results["wild"][:2]
    assert torch.all(out[2:4] == 0) and torch.all(lse[2:4] == -math.inf)  # no key: output 0, lse -inf
    torch.testing.assert_close(out, sdpa_f64(q.detach(), k.detach(), v.detach(), causal, seqused_k=clamped),
                               rtol=1e-10, atol=1e-10)
    for fn in (attention_naive, attention_tiled):
        assert torch.equal(fn(q, k, v, causal=causal, seqused_k=wild)[0], fn(q, k, v, causal=causal,
                                                                             seqused_k=clamped)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_public_api_low_precision_cpu(dtype):
    torch.manual_seed(2)
    q = torch.randn(1, 8, 33, 64, dtype=dtype)
    k = torch.randn(1, 2, 47, 64, dtype=dtype)
    v = torch.randn(1, 2, 47, 64, dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (1, 8, 33)
    assert out.transpose(1, 2).is_contiguous()  # stored as (B, S, H, D): transformers' layout is a free view
    ref = sdpa_f64(q, k, v, True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_strided_inputs_like_transformers():
    """q/k/v as transformers makes them: (B, S, H, D) projections viewed as (B, H, S, D)."""
    torch.manual_seed(3)
    b, s, hq, hkv, d = 2, 19, 8, 2, 64
    q = torch.randn(b, s, hq, d, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(b, s, hkv, d, dtype=torch.float64).transpose(1, 2)
    assert not q.is_contiguous()
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True), sdpa_f64(q, k, v, True), rtol=1e-10,
                               atol=1e-10)


def test_custom_op_registration_cpu():
    q = torch.randn(1, 4, 9, 64)
    k = torch.randn(1, 2, 9, 64)
    v = torch.randn(1, 2, 9, 64)
    torch.library.opcheck(torch.ops.llm_attn.flash_fwd.default, (q, k, v, None, 0.125, True, False))
    compiled = torch.compile(lambda a, b, c: flash_attn_func(a, b, c, causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q, k, v, causal=True))


def _qkv(**over):
    shapes = dict(q=(1, 8, 16, 64), k=(1, 2, 16, 64), v=(1, 2, 16, 64))
    shapes.update(over)
    return [torch.randn(*shapes[n]) for n in "qkv"]


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: _qkv(q=(8, 16, 64)), ValueError, "4 dims"),
        (lambda: _qkv(q=(1, 8, 0, 64)), ValueError, "empty"),
        (lambda: _qkv(k=(1, 3, 16, 64), v=(1, 3, 16, 64)), ValueError, "multiple of key/value heads"),
        (lambda: _qkv(k=(2, 2, 16, 64), v=(2, 2, 16, 64)), ValueError, "batch mismatch"),
        (lambda: _qkv(v=(1, 2, 17, 64)), ValueError, "same shape"),
        (lambda: _qkv(k=(1, 2, 16, 32), v=(1, 2, 16, 32)), ValueError, "head_dim mismatch"),
        (lambda: [t.transpose(-1, -2) if i == 1 else t for i, t in enumerate(_qkv(k=(1, 2, 64, 64)))], ValueError,
         "contiguous in its last dim"),
        (lambda: [t.half() if i == 0 else t for i, t in enumerate(_qkv())], TypeError, "share a dtype"),
        (lambda: [t.int() for t in _qkv()], TypeError, "unsupported dtype"),
    ],
)
def test_validation_errors(make, err, match):
    q, k, v = make()
    with pytest.raises(err, match=match):
        flash_attn_func(q, k, v)


def test_validation_of_options():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="path must be 'auto', 'kernel' or 'reference'"):
        flash_attn_func(q, k, v, path="triton")
    with pytest.raises(ValueError, match="backend"), pytest.warns(DeprecationWarning):
        flash_attn_func(q, k, v, backend="triton")
    # The old keyword still works, with a DeprecationWarning, and means the same path.
    with pytest.warns(DeprecationWarning, match="path="):
        old = flash_attn_func(q, k, v, causal=True, backend="reference")
    assert torch.equal(old, flash_attn_func(q, k, v, causal=True, path="reference"))
    with pytest.raises(ValueError, match="scale"):
        flash_attn_func(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="causal"):
        flash_attn_func(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="seqused_k"):
        flash_attn_func(q, k, v, seqused_k=torch.tensor([16]))  # int64, not int32
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        flash_attn_func(q.half(), k.half(), v.half(), path="kernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without the kernel")
def test_kernel_missing_error_says_how_to_build():
    import llm_attn

    if llm_attn.kernel_available():
        pytest.skip("extension is built here")
    with pytest.raises(llm_attn.KernelNotBuiltError, match="no-build-isolation"):
        llm_attn._ext.get_ext()


def test_import_is_build_free():
    """`import llm_attn` must work without the compiled extension and without touching CUDA."""
    code = ("import sys, llm_attn; assert 'llm_attn._C' not in sys.modules and 'transformers' not in sys.modules; "
            "from llm_attn import patch_model; from llm_attn.patches import patch_model as p; assert patch_model is p")
    subprocess.run([sys.executable, "-c", code], check=True)

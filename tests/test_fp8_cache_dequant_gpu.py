"""GPU tests of the FP8 cache's dequantised copy in one launch (kernels/fp8_cache_dequant.cu,
``llm_attn.ops.fp8_kv_dequantized``): what stock attention, another registry entry or a prefill sent to the copy
reads. Its contract is bit-identity with ``kv_cache_reference.dequantize`` (the PyTorch ops it replaces): every
element of K (shift included) and V, for fp16 and bf16, head_dim 64 and 128, odd lengths, a static cache's capacity
past its length, batch x heads > 1, K with outlier channels, scales large enough to overflow fp16 (inf, as the
reference). Outputs are NaN-poisoned before the launch, so an element the kernel skips fails. The caches' own
``update`` (the copy stock attention reads) goes through it too. Bad input is one ValueError line. Each test runs on
every kernel build that loads here (AOT and NVRTC), and is skipped, with the reason, without CUDA or where a build has
no such kernel (an extension built before it: there the PyTorch ops run, which tests/test_kv_cache_fp8.py covers).

    python -m pytest -q tests/test_fp8_cache_dequant_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_with
from llm_attn import kv_cache_reference as ref
from llm_attn import ops

pytestmark = pytest.mark.gpu


@pytest.fixture
def dequant_kernel(cuda_ext, request):
    """The kernel build this test runs on (conftest.py's ``cuda_ext``: once per build, selected for ``llm_attn.ops``
    too), skipped where it has no copy kernel (an extension built before it)."""
    return build_with(cuda_ext, request, ops.fp8_cache_dequant_available, "fp8_cache_dequant")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _reference(kv: ref.Fp8KV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n, nb = kv.length, ref.n_blocks(kv.length)
    return (ref.dequantize(kv.k_data[:, :, :n], kv.k_scale[:, :, :nb], kv.k_shift, dtype),
            ref.dequantize(kv.v_data[:, :, :n], kv.v_scale[:, :, :nb], None, dtype))


def _view(b, h, n, cap, d, gen, big_scale=False) -> ref.Fp8KV:
    """A cache layer's storage as the cache lays it out, with values from quantising outlier-shaped K and V."""
    k = torch.randn(b, h, cap, d, generator=gen)
    k[..., :4] = k[..., :4] * 3 + torch.tensor([15.0, -30.0, 50.0, 20.0])  # biased outlier channels
    v = torch.randn(b, h, cap, d, generator=gen)
    shift = ref.smoothing_shift(k[:, :, :ref.BLOCK])
    kq, ks = ref.quantize(k, shift)
    vq, vs = ref.quantize(v, None)
    if big_scale:  # scales ~1e3: 448 x 1e3 overflows fp16 (65504); the reference gives inf there, so must the kernel
        vs = vs * 1e5
    dev = "cuda"
    return ref.Fp8KV(kq.to(dev), ks.to(dev), shift.to(dev), vq.to(dev), vs.to(dev), n)


SHAPES = [(1, 8, 1, 64), (1, 8, 64, 64), (2, 3, 65, 192), (1, 2, 1000, 1000), (3, 1, 4099, 4160), (1, 8, 4096, 4096)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}n{}cap{}".format(*s))
def test_bit_identical_to_the_reference(dequant_kernel, dtype, d, shape):
    b, h, n, cap = shape
    kv = _view(b, h, n, cap, d, torch.Generator().manual_seed(n + d))
    out = (torch.full((b, h, n, d), float("nan"), dtype=dtype, device="cuda"),
           torch.full((b, h, n, d), float("nan"), dtype=dtype, device="cuda"))
    k, v = ops.fp8_kv_dequantized(kv, dtype, out=out)
    assert k is out[0] and v is out[1]
    rk, rv = _reference(kv, dtype)
    assert not k.isnan().any() and not v.isnan().any()
    assert torch.equal(_bits(k), _bits(rk)), "K differs from kv_cache_reference.dequantize"
    assert torch.equal(_bits(v), _bits(rv)), "V differs from kv_cache_reference.dequantize"
    # and against float64 of the same bytes: one rounding of the output dtype, after the float32 product and sum
    # (each within 2^-24 of its own magnitude: near-cancelling x s + shift loses that much absolutely), plus the
    # output's smallest subnormal step
    xs = kv.k_data[:, :, :n].to(torch.float64) * kv.k_scale.to(torch.float64).repeat_interleave(
        ref.BLOCK, dim=2)[:, :, :n, None]
    shift = kv.k_shift.to(torch.float64)[:, :, None]
    k64 = xs + shift
    fi = torch.finfo(dtype)
    bound = fi.eps / 2 * k64.abs() + 2.0 ** -23 * (xs.abs() + shift.abs()) + fi.smallest_normal * fi.eps
    assert ((k.to(torch.float64) - k64).abs() <= bound).all()


def test_overflow_is_inf_as_in_the_reference(dequant_kernel):
    kv = _view(1, 2, 130, 192, 128, torch.Generator().manual_seed(1), big_scale=True)
    k, v = ops.fp8_kv_dequantized(kv, torch.float16)
    rk, rv = _reference(kv, torch.float16)
    assert v.isinf().any()
    assert torch.equal(_bits(v), _bits(rv)) and torch.equal(_bits(k), _bits(rk))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_caches_copy_goes_through_it(dequant_kernel, static, dtype):
    """What ``update`` returns to stock attention (chunks of 100 tokens: blocks re-quantised as they fill) equals the
    reference over the same storage."""
    from llm_attn.models.kv_cache import Fp8DynamicLayer, Fp8StaticLayer

    layer = Fp8StaticLayer(max_cache_len=512) if static else Fp8DynamicLayer()
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for _ in range(3):
            k, v = (torch.randn(2, 4, 100, 128, generator=gen).to("cuda", dtype) for _ in range(2))
            dk, dv = layer.update(k, v)
        rk, rv = _reference(layer.fp8(), dtype)
    assert dk.shape == (2, 4, 300, 128) and dk.dtype == dtype
    assert torch.equal(_bits(dk), _bits(rk)) and torch.equal(_bits(dv), _bits(rv))
    assert ref.fp8_kv_of(dk) is not None  # still tagged with its FP8 view


def test_bad_input_is_one_line(dequant_kernel):
    kv = _view(1, 2, 100, 128, 128, torch.Generator().manual_seed(2))
    wrong = (torch.empty(1, 2, 99, 128, dtype=torch.float16, device="cuda"),
             torch.empty(1, 2, 100, 128, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match=r"^fp8_kv_dequantized: out must be two torch.float16 tensors of shape "
                                         r"\(1, 2, 100, 128\)"):
        ops.fp8_kv_dequantized(kv, torch.float16, out=wrong)
    with pytest.raises(ValueError, match=r"^llm_attn.fp8_cache_dequant: v_out must be .*1, 2, 99, 128"):
        try:
            dequant_kernel.fp8_cache_dequant(kv.k_data, kv.v_data, kv.k_scale, kv.v_scale, kv.k_shift, *wrong)
        except RuntimeError as e:
            raise ValueError(str(e).splitlines()[0]) from None
    with pytest.raises(ValueError, match=r"^fp8_kv_dequantized\(out=\) needs the kernel path"):
        ops.fp8_kv_dequantized(kv, torch.float32, out=wrong)
    assert ops.fp8_kv_dequantized(kv, torch.float32)[0].dtype == torch.float32  # the reference path, no out

"""GPU tests of the FP8 cache's one-token append (kernels/fp8_cache_append.cu, ``llm_attn.ops.fp8_cache_append``):
the device step of ``Fp8StaticLayer(device_position=True)`` in one launch. Its contract is bit-identity with the
PyTorch ops it replaces (the same layer with the kernel switched off) and with those ops on CPU (a CPU layer fed
the same tokens; tests/test_kv_cache_fp8.py ties them to the host path), for the data bytes, the block scales, K's
shift and the used length: after prefills that leave block 0 open, full, or a later block part-filled; for fp16
and bf16, head_dim 64 and 128; with outlier K channels, a NaN token and a zero token; replayed from a CUDA graph.
Bad input is one ValueError line. Each test runs on every kernel build that loads here (AOT and NVRTC), and is
skipped, with the reason, without CUDA or where a build has no append kernel (an extension built before it: there
the PyTorch ops run, which tests/test_kv_cache_fp8.py covers).

    python -m pytest -q tests/test_fp8_cache_append_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_with
from llm_attn import kv_cache_reference as ref
from llm_attn import ops
from llm_attn.harness.graphs import graph_capture

pytestmark = pytest.mark.gpu


@pytest.fixture
def append_kernel(cuda_ext, request):
    """The kernel build this test runs on (conftest.py's ``cuda_ext``: once per build, selected for ``llm_attn.ops``
    too), skipped where it has no append kernel (an extension built before it)."""
    return build_with(cuda_ext, request, ops.fp8_cache_append_available, "fp8_cache_append")


class _ReadsFp8:
    _attn_implementation = "llm_attn"  # the attention reads the FP8 bytes: update takes the device step


def _layer(capacity: int, device: str, kernel: bool | None):
    from llm_attn.models.kv_cache import Fp8StaticLayer

    layer = Fp8StaticLayer(max_cache_len=capacity, device_position=True)
    layer.attn_config = _ReadsFp8()
    layer._force_kernel = kernel
    return layer


def _update(layer, k, v):
    if layer.is_initialized and layer._force_kernel is not None:
        layer._append_kernel = layer._force_kernel
    return layer.update(k, v)


def _stored(layer) -> tuple:
    layer.fp8()  # reads the device position back (one sync): the host's length and tail follow
    n = layer.length
    return (layer.k_data[:, :, :n].view(torch.uint8).cpu(), layer.v_data[:, :, :n].view(torch.uint8).cpu(),
            layer.k_scale[:, :, :ref.n_blocks(n)].cpu(), layer.v_scale[:, :, :ref.n_blocks(n)].cpu(),
            layer.k_shift.cpu(), layer.k_tail.cpu(), layer.v_tail.cpu())


def _tokens(n: int, d: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, n, d, generator=gen)
    k[..., :4] += torch.tensor([15.0, -30.0, 50.0, -22.0])  # outlier channels, as real keys have
    v = torch.randn(2, 3, n, d, generator=gen)
    k[:, :, n // 2] = 0.0  # an all-zero token
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("prefill", [1, 37, 64, 127])
def test_append_kernel_stores_the_pytorch_ops_bytes(append_kernel, d, dtype, prefill):
    n, capacity = 200, 230
    k, v = _tokens(n, d, dtype, seed=prefill + d)
    layers = {"kernel": _layer(capacity, "cuda", True), "ops": _layer(capacity, "cuda", False),
              "cpu": _layer(capacity, "cpu", None)}
    with torch.inference_mode():
        for name, layer in layers.items():
            dev = "cpu" if name == "cpu" else "cuda"
            _update(layer, k[:, :, :prefill].to(dev), v[:, :, :prefill].to(dev))
            for t in range(prefill, n):
                kk, _ = _update(layer, k[:, :, t:t + 1].to(dev), v[:, :, t:t + 1].to(dev))
                if dev == "cuda":
                    assert ref.fp8_kv_of(kk).used.tolist() == [t + 1, t + 1]
        assert layers["kernel"]._append_kernel and not layers["ops"]._append_kernel
        stored = {name: _stored(layer) for name, layer in layers.items()}
    for name in ("ops", "cpu"):
        for i, (x, y) in enumerate(zip(stored["kernel"], stored[name], strict=True)):
            assert torch.equal(x, y), f"kernel vs {name}: field {i} differs"


@pytest.mark.parametrize("d", [64, 128])
def test_append_kernel_median_with_many_ties(append_kernel, d):
    """Block 0 open with K drawn from five values: every channel's lower median is tied over many slots, which
    the kernel's slot groups find separately. Bytes, scales and shift as the PyTorch ops store them at every step."""
    gen = torch.Generator().manual_seed(d)
    k = (torch.randint(-2, 3, (2, 3, 70, d), generator=gen) * 1.5).to(torch.float16)
    v = torch.randn(2, 3, 70, d, generator=gen).to(torch.float16)
    layers = [_layer(128, "cuda", True), _layer(128, "cuda", False)]
    with torch.inference_mode():
        for layer in layers:
            _update(layer, k[:, :, :1].cuda(), v[:, :, :1].cuda())
        for t in range(1, 70):
            for layer in layers:
                _update(layer, k[:, :, t:t + 1].cuda(), v[:, :, t:t + 1].cuda())
            if t in (1, 2, 3, 8, 31, 62, 63, 64, 69):
                for i, (x, y) in enumerate(zip(*(_stored(layer) for layer in layers), strict=True)):
                    assert torch.equal(x, y), f"after token {t}: field {i} differs"
    assert layers[0]._append_kernel and not layers[1]._append_kernel


def test_append_kernel_keeps_a_nan_token_as_pytorch_does(append_kernel):
    """A NaN in the open block: PyTorch's amax is NaN, so the block's scale is 1 and the NaN stays a NaN byte; the
    kernel stores the same bytes (no silently different block)."""
    k, v = _tokens(80, 64, torch.float16, seed=9)
    v[0, 1, 70, 5] = float("nan")
    out = []
    with torch.inference_mode():
        for kernel in (True, False):
            layer = _layer(128, "cuda", kernel)
            _update(layer, k[:, :, :66].cuda(), v[:, :, :66].cuda())
            for t in range(66, 80):
                _update(layer, k[:, :, t:t + 1].cuda(), v[:, :, t:t + 1].cuda())
            out.append(_stored(layer))
    for x, y in zip(*out, strict=True):
        assert torch.equal(x, y) if x.dtype == torch.uint8 else torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
    assert out[0][3][0, 1, 1].item() == 1.0  # block 1 of (0, 1) holds the NaN: scale 1


def test_append_kernel_replays_from_a_cuda_graph(append_kernel):
    """Captured once at position p, replayed with the position advanced on the device: each replay appends the
    token in the input buffer at the next slot, the PyTorch ops' bytes."""
    d, steps = 128, 90
    k, v = _tokens(40 + steps, d, torch.float16, seed=4)
    ref_layer, layer = _layer(256, "cuda", False), _layer(256, "cuda", True)
    with torch.inference_mode():
        for lay in (ref_layer, layer):
            _update(lay, k[:, :, :40].cuda(), v[:, :, :40].cuda())
        for t in range(40, 40 + steps):
            _update(ref_layer, k[:, :, t:t + 1].cuda(), v[:, :, t:t + 1].cuda())
        kin, vin = k[:, :, 40:41].cuda().clone(), v[:, :, 40:41].cuda().clone()
        _update(layer, kin, vin)  # the first device step (loads the open block), eager
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        state, pos = layer.position_state(), layer.cumulative_length.clone()
        layer.restore_position(state)
        with torch.cuda.stream(stream), graph_capture(graph, stream=stream):
            _update(layer, kin, vin)
        torch.cuda.current_stream().wait_stream(stream)
        layer.restore_position(state)
        layer.cumulative_length.copy_(pos)
        for t in range(41, 40 + steps):
            kin.copy_(k[:, :, t:t + 1])
            vin.copy_(v[:, :, t:t + 1])
            graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(_stored(ref_layer), _stored(layer), strict=True):
            assert torch.equal(x, y)


def test_append_kernel_bad_input_is_one_line(append_kernel):
    layer = _layer(128, "cuda", True)
    k, v = _tokens(10, 64, torch.float16, seed=1)
    with torch.inference_mode():
        _update(layer, k.cuda(), v.cuda())
        args = [k[:, :, :1].cuda(), v[:, :, :1].cuda(), layer._k_open, layer._v_open, layer.k_shift, layer.k_data,
                layer.v_data, layer.k_scale, layer.v_scale, layer.cumulative_length, layer._used, 128]
        bad = list(args)
        bad[0] = bad[0].float()
        with pytest.raises(ValueError, match=r"^llm_attn.fp8_cache_append: k_new must be float16 or bfloat16"):
            ops.fp8_cache_append(*bad)
        bad = list(args)
        bad[10] = torch.zeros(3, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=r"used must be \[2\], got \[3\]"):
            ops.fp8_cache_append(*bad)
        bad = list(args)
        bad[11] = 129
        with pytest.raises(ValueError, match="max_cache_len must be in"):
            ops.fp8_cache_append(*bad)

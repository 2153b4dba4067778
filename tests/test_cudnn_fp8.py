"""cuDNN's FP8 attention as a reference (``llm_attn.harness.cudnn_fp8``, ``--impls cudnn-fp8``) where it cannot run:
the per-tensor e4m3 quantisation it is fed, and one clear line (an error row, not a crash) without a GPU or without
JAX. On a GPU with JAX: tests/test_cudnn_fp8_gpu.py.

    pytest tests/test_cudnn_fp8.py
"""

from __future__ import annotations

import sys

import pytest
import torch

from llm_attn.harness import cudnn_fp8
from llm_attn.harness.accuracy import accuracy_point
from llm_attn.harness.cudnn_fp8 import E4M3_MAX, CudnnFp8Attention, CudnnFp8Unavailable, quantize_per_tensor
from llm_attn.harness.kernel_bench import make_fn


def test_per_tensor_scale_maps_the_amax_to_e4m3s_largest_value():
    x = torch.randn(3, 5, 77, 64, dtype=torch.bfloat16) * 7
    x8, descale = quantize_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.is_contiguous()
    assert x8.float().abs().max().item() == E4M3_MAX
    back = x8.float() * descale
    big = x.float().abs() > 1e-2 * x.float().abs().max()  # normal e4m3 values: 3 mantissa bits, <= 2^-4 relative
    rel = ((back - x.float()).abs() / x.float().abs())[big]
    assert rel.max().item() <= 2.0 ** -4 + 1e-6
    assert rel.mean().item() > 1e-3  # it did round to e4m3 (not a float copy)


def test_per_tensor_scale_of_zeros_and_of_nan():
    x8, descale = quantize_per_tensor(torch.zeros(4, 4, dtype=torch.float16))
    assert descale == 1.0 and not x8.float().any()
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_per_tensor(torch.tensor([1.0, float("nan")], dtype=torch.float16))


def test_cpu_tensors_get_one_line_not_a_jax_import():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(CudnnFp8Unavailable, match="needs a CUDA GPU"):
        CudnnFp8Attention(q, q, q, causal=True)


def test_missing_jax_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # import jax -> ImportError, as where it is not installed
    with pytest.raises(CudnnFp8Unavailable, match=r"pip install \"jax\[cuda13\]\""):
        cudnn_fp8._jax()


def test_bench_refuses_what_cudnn_fp8_cannot_mask_or_differentiate():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bottom-right"):
        make_fn("cudnn-fp8", q, k, k, causal=True)
    with pytest.raises(ValueError, match="no backward"):
        make_fn("cudnn-fp8", q.requires_grad_(), q, q, causal=False)


def test_accuracy_row_without_a_gpu_is_an_error_row_with_the_reason():
    rows = accuracy_point(["sdpa", "cudnn-fp8"], "k_outliers", heads=4, kv_heads=2, seq=48, head_dim=64,
                          dtype=torch.bfloat16, causal=True, device="cpu", rows=16)
    by = {r["impl"]: r for r in rows}
    assert by["sdpa"]["status"] == "ok"
    assert by["cudnn-fp8"]["status"] == "error" and "needs a CUDA GPU" in by["cudnn-fp8"]["error"]
    assert not all(t["met"] for t in by["cudnn-fp8"]["targets"])  # a path that did not run misses its targets


def test_bench_cli_takes_the_name(capsys):
    from llm_attn import bench

    code = bench.main(["--mode", "accuracy", "--impls", "sdpa", "cudnn-fp8", "--seqs", "32", "--kinds",
                       "k_outliers", "--causal", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "64"])
    out = capsys.readouterr()
    assert code == 1  # the error row misses the targets: said, not hidden
    assert "cudnn-fp8" in out.out + out.err

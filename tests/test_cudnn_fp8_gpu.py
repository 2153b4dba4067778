"""cuDNN's FP8 attention through JAX (``llm_attn.harness.cudnn_fp8``) on a GPU: that the reference computes
attention (against float64 on fresh random inputs: odd lengths, q_len != kv_len, MHA/GQA, both head dims and input
dtypes), that it really ran in FP8 (its error is far above a bf16 kernel's), and that its timer returns what the
benchmark needs. Skips with the reason where JAX, its GPU backend or cuDNN's FP8 graph is missing.

    pytest tests/test_cudnn_fp8_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from llm_attn.harness.accuracy import error_metrics, reference_rows

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cudnn_fp8():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from llm_attn.harness import cudnn_fp8 as mod

    try:
        mod._jax()
    except mod.CudnnFp8Unavailable as e:
        pytest.skip(str(e))
    return mod


CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal)
    (1, 4, 4, 256, 256, 128, True),
    (2, 8, 2, 1000, 1000, 128, True),
    (1, 8, 8, 333, 333, 64, False),
    (1, 4, 1, 100, 517, 128, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_h{}-{}_{}x{}_d{}_{}".format(*c[:6], "causal" if c[6]
                                                                                       else "full"))
def test_against_float64(cudnn_fp8, case, dtype):
    b, hq, hkv, sq, sk, d, causal = case
    gen = torch.Generator(device="cuda").manual_seed(sq * 7 + d)
    q = torch.randn(b, hq, sq, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, hkv, sk, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(b, hkv, sk, d, device="cuda", generator=gen).to(dtype)
    try:
        attn = cudnn_fp8.CudnnFp8Attention(q, k, v, causal)
    except cudnn_fp8.CudnnFp8Unavailable as e:
        pytest.skip(str(e))
    out = attn()
    assert out.shape == q.shape and out.dtype == torch.float32
    ref = reference_rows(q, k, v, torch.arange(sq), causal)
    m = error_metrics(out, ref)
    assert m["finite"], "NaN or inf in cuDNN FP8's output"
    assert m["cosine"] >= 0.99 and m["rel_l1"] <= 0.15, m
    # FP8 (3 mantissa bits on Q, K, V, P and O) errs far above a bf16 kernel (~0.3 % relative L1 here): the
    # reference is what it says, not a bf16 path.
    assert m["rel_l1"] >= 0.01, m


def test_timer_gives_one_finite_sample_per_repeat(cudnn_fp8):
    q = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    attn = cudnn_fp8.CudnnFp8Attention(q, k, k, causal=True)
    samples = attn.time_samples(warmup=1, repeats=4)
    assert len(samples) == 4 and all(math.isfinite(s) and s > 0 for s in samples)
    assert 1 <= attn.chain <= cudnn_fp8.MAX_CHAIN


def test_a_chain_of_n_runs_n_calls(cudnn_fp8):
    """A chain that XLA collapsed to one call (as an optimization barrier around the same query did) would time
    ~1/n of a call: 8 chained calls must take several times one."""
    import time

    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
    attn = cudnn_fp8.CudnnFp8Attention(q, k, k, causal=False)

    def best(n):
        attn._dispatch(n).block_until_ready()  # compile
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            attn._dispatch(n).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    one, eight = best(1), best(8)
    assert eight > 4 * one, (one, eight)


def test_causal_needs_equal_lengths(cudnn_fp8):
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_len == kv_len"):
        cudnn_fp8.CudnnFp8Attention(q, k, k, causal=True)

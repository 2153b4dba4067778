"""GPU correctness of the registry's entries other than our kernel (which tests/test_kernel_gpu.py covers): the
``naive``, ``numba`` and ``flex`` built-ins and the stock ``sdpa``/``eager`` functions, each against a float64
reference on fresh random inputs with the output memory poisoned (NaN) first, over awkward lengths, q_len != kv_len,
MHA/GQA/MQA, seqused_k, fp16 and bf16; then each through ``patch_model`` on a tiny fp16 Llama on the GPU, and in
the kernel benchmark. Skips without CUDA (and ``numba`` without numba-cuda).

    pytest tests/test_impls_gpu.py
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from llm_attn import registry
from llm_attn.reference import attention_naive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENTRIES = ["naive", "numba", "flex", "sdpa", "eager"]
# (b, hq, hkv, sq, sk, d, causal, seqused)
SHAPES = [
    (1, 8, 8, 1, 1, 128, True, None),
    (1, 8, 2, 17, 17, 64, True, None),
    (2, 8, 1, 127, 127, 128, True, None),
    (1, 8, 2, 129, 129, 64, False, None),
    (1, 8, 8, 1000, 1000, 128, True, None),
    (1, 32, 8, 2049, 2049, 128, True, None),
    (2, 8, 2, 1, 2049, 128, True, None),        # decode row
    (1, 8, 2, 63, 1000, 64, True, None),        # chunk over a prefix: bottom-right
    (1, 8, 2, 1000, 17, 64, True, None),        # rows that see no key: 0
    (2, 8, 1, 129, 2049, 128, False, None),
    (2, 8, 2, 17, 300, 128, True, [300, 77]),   # static cache with unused slots
]
DTYPES = [torch.float16, torch.bfloat16]


# numba-cuda compiles through libNVVM and its bf16 intrinsics through libNVRTC: CUDA libraries that the numba extra
# alone does not install (the nvrtc extra or a CUDA toolkit does). Without them the entry is importable but cannot
# compile: such a machine skips it, with the reason.
_WHY = r"not found|cannot|could not|no such file|unable to load|failure finding|DynamicLibNotFound"
MISSING_LIBRARY = re.compile(rf"(?i)(nvvm|nvrtc)[^\n]*({_WHY})|({_WHY})[^\n]*(nvvm|nvrtc)")


@functools.cache
def _compile_problem(name: str) -> str | None:
    """Why the entry cannot compile its kernels here (a missing CUDA library), from one tiny call per dtype."""
    entry = registry.get(name)
    for dtype in DTYPES:
        q = torch.randn(1, 2, 3, 64, device="cuda", dtype=dtype)
        variant, _ = entry.choose(q.device, dtype, 64)
        try:
            entry.run(variant, q, q, q, causal=True, scale=0.125)
        except Exception as e:  # noqa: BLE001 - only a missing library skips; anything else fails the test
            if MISSING_LIBRARY.search(f"{type(e).__name__}: {e}"):
                return f"{name} cannot compile its kernels here, a CUDA library is missing: {e}"
            raise
    return None


def _entry(name):
    entry = registry.get(name)
    why = entry.unavailable_reason("cuda") or (_compile_problem(name) if name == "numba" else None)
    if why:
        pytest.skip(why)
    return entry


def _poison(like: torch.Tensor) -> None:
    """Fill the caching allocator's next block of this size with NaN: an output the kernel leaves unwritten stays
    NaN and fails the test."""
    t = torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)
    del t


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ENTRIES)
def test_entry_against_float64(name, dtype):
    entry = _entry(name)
    torch.manual_seed(0)
    worst = []
    # flex compiles per shape (then goes dynamic): a subset keeps the test within minutes.
    shapes = SHAPES[1::2] if name == "flex" else SHAPES
    for b, hq, hkv, sq, sk, d, causal, used in shapes:
        seq = torch.tensor(used, dtype=torch.int32, device="cuda") if used else None
        if seq is not None and not entry.supports_seqused_k:
            continue
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        variant, why = entry.choose(q.device, dtype, d)
        assert why is None, why
        _poison(q)
        out = entry.run(variant, q, k, v, causal=causal, scale=d ** -0.5, seqused_k=seq)
        torch.cuda.synchronize()
        ref, _ = attention_naive(q, k, v, causal=causal, seqused_k=seq)
        assert not out.isnan().any(), (name, b, hq, hkv, sq, sk, d, causal, used)
        err = (out.double() - ref).abs().max().item()
        # PyTorch's own error at this precision: the same maths in the input dtype (matmuls, softmax and P in
        # fp16/bf16, as flash-style kernels round P before P V), as tests/test_kernel_gpu.py bounds our kernel.
        # (It was the float32 maths rounded to the dtype, i.e. the output's rounding alone: a bound that flex's
        # compiled kernels, with P in the input dtype, can exceed on torch 2.11 without any bug.)
        low, _ = attention_naive(q, k, v, causal=causal, seqused_k=seq, compute_dtype=dtype)
        base = (low.double() - ref).abs().max().item()
        floor = 4e-3 if dtype == torch.float16 else 3e-2
        factor = 8 if name == "naive" else 2  # naive keeps scores and probabilities in fp16/bf16 throughout
        worst.append((err, base, (sq, sk, d, causal, used)))
        assert err <= max(factor * base, floor * (4 if name == "naive" else 1)), \
            f"{name} {dtype}: max err {err:.3e} > {factor} x PyTorch's {base:.3e} at (b, hq, hkv, sq, sk, d, causal, " \
            f"seqused) = {(b, hq, hkv, sq, sk, d, causal, used)}"
    print(name, dtype, "max err", max(worst)[:2])


@pytest.mark.parametrize("name", ["naive", "numba", "flex"])
def test_patch_model_on_the_gpu(name):
    _entry(name)
    from llm_attn.models import load_model
    from llm_attn.patches import patched

    model, _ = load_model("tiny:fp16", device="cuda", dtype=torch.float16, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 200), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
        with patched(model, impl=name) as report:
            out = model(ids).logits.float()
            assert report.num_native_calls == model.config.num_hidden_layers, str(report)
    assert (out - ref).abs().max().item() < 0.05


def test_entries_in_the_kernel_benchmark():
    from llm_attn.harness.kernel_bench import bench_point

    names = [n for n in ("naive", "numba", "flex")
             if registry.get(n).unavailable_reason("cuda") is None and (n != "numba" or _compile_problem(n) is None)]
    rows = bench_point("prefill", ["flash", *names], 1, 8, 2, 512, 512, 128, torch.bfloat16, True, 2, 3,
                       graph=False)
    for n in names:
        assert rows[n]["status"] == "ok", rows[n]
        assert rows[n]["tflops"] > 0 and rows[n]["max_abs_diff_vs_first"] < 0.1, rows[n]

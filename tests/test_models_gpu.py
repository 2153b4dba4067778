"""GPU tests for llm_attn.models: synthetic AWQ checkpoints loaded on CUDA through transformers + gptqmodel, with
the int4 linears run by gptqmodel's Triton kernel. Skipped without CUDA.

    python -m pytest tests/test_models_gpu.py -q                       # tiny model, seconds
    LLM_ATTN_TEST_8B=1 python -m pytest tests/test_models_gpu.py -q -s # + the 8B AWQ checkpoint (generated once
                                                                       #   into $LLM_ATTN_CACHE or ~/.cache/llm_attn)

Needs gptqmodel and its imports installed on the GPU machine (README "Models": `pip install --no-deps
--no-build-isolation .whl/...`).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from llm_attn import models

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
if torch.cuda.is_available():  # every test here loads AWQ through gptqmodel, which the README installs separately
    pytest.importorskip("gptqmodel", reason="gptqmodel is not installed (README 'Models')")

TINY = models.PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory):
    return models.write_synthetic_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-awq", "tiny", "awq", seed=5)


@pytest.fixture(scope="module")
def reference(tiny_awq):
    """fp32 model of the same checkpoint, dequantised by llm_attn.awq (independent of gptqmodel), on CUDA."""
    return models._load_awq_dequantized(tiny_awq, models._read_config(tiny_awq), torch.device("cuda"),
                                        torch.float32, "sdpa")


def _tokens(seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq)
    return torch.randint(0, TINY.vocab_size, (2, seq), generator=g).cuda()


@pytest.mark.parametrize("backend, cls", [(None, "AwqGEMMTritonLinear"), ("torch_awq", "AwqTorchLinear")])
# 16 tokens x batch 2 = 32 rows: the Triton int4 GEMM itself; 160 x 2 = 320 rows: gptqmodel switches to
# Triton dequantisation + dense matmul above 128 rows. Both must agree with the reference.
@pytest.mark.parametrize("seq", [16, 160])
def test_tiny_awq_on_cuda_matches_dequantized_reference(tiny_awq, reference, backend, cls, seq):
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    model, info = models.load_model(str(tiny_awq), device="cuda", awq_backend=backend)
    assert info.quant == "awq-int4" and not info.dequant_fallback and info.device.startswith("cuda")
    assert info.awq_backend == f"gptqmodel:{cls}"
    quant = [m for m in model.modules() if isinstance(m, BaseQuantLinear)]
    assert len(quant) == 7 * TINY.num_hidden_layers and all(type(m).__name__ == cls for m in quant)
    assert all(m.qweight.is_cuda and m.qweight.dtype == torch.int32 for m in quant)
    ids = _tokens(seq)
    with torch.no_grad():
        logits = model(ids).logits.float()
        ref = reference(ids).logits
    diff = (logits - ref).abs()
    assert torch.isfinite(logits).all()
    assert diff.max().item() < 0.05 and diff.mean().item() < 5e-3, (diff.max().item(), diff.mean().item())


def test_default_cuda_backend_runs_int4_kernel(tiny_awq):
    # The default on CUDA is gptqmodel's Triton int4 GEMM (no compiled extension needed).
    assert models._default_awq_backend(torch.device("cuda")) == "gemm_triton"
    _, info = models.load_model(str(tiny_awq), device="cuda")
    assert info.awq_backend == "gptqmodel:AwqGEMMTritonLinear"


@pytest.mark.skipif(os.environ.get("LLM_ATTN_TEST_8B") != "1", reason="set LLM_ATTN_TEST_8B=1 (~6 GB checkpoint)")
def test_llama_3_8b_awq_generates_loads_and_runs():
    t0 = time.perf_counter()
    path = models.cached_checkpoint("llama-3-8b", "awq")
    t1 = time.perf_counter()
    model, info = models.load_model(str(path), device="cuda")
    t2 = time.perf_counter()
    print(f"\n8B AWQ checkpoint ready in {t1 - t0:.1f}s (cached if ~0), loaded in {t2 - t1:.1f}s: {info}")
    assert info.quant == "awq-int4" and info.awq_backend == "gptqmodel:AwqGEMMTritonLinear"
    assert abs(info.num_params - 8.03e9) < 0.01e9 and info.config["num_hidden_layers"] == 32
    assert models.max_seq_len(model) == 131072
    ids = torch.randint(0, 128256, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    assert 0.5 < out.logits.float().std().item() < 2.0

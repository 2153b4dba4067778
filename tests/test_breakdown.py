"""``--measure breakdown``: one prefill under torch.profiler, split into attention / GEMM / quantised weights / other /
idle. On CPU the split is over ATen ops' self time (no GPU kernels); attention is attributed by the implementation's
own ``llm_attn.attention:<impl>`` range, for patched and stock implementations alike. The GPU split is checked on a
CUDA machine (skipped here).

    pytest tests/test_breakdown.py
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging import version

from llm_attn.harness.breakdown import CATEGORIES, measure_breakdown
from llm_attn.harness.impls import use_impl
from llm_attn.registry import get

pytestmark = pytest.mark.skipif(version.parse(transformers.__version__) < version.parse("4.53"),
                                reason="stock attention ranges need transformers' AttentionInterface (>= 4.53)")


@pytest.fixture(scope="module")
def tiny():
    from llm_attn.models import load_model

    model, _ = load_model("auto", device="cpu", dtype=torch.float32, attn_implementation="sdpa")
    return model


@pytest.mark.parametrize("impl", ["sdpa", "eager", "llm_attn", "naive"])
def test_cpu_breakdown_attributes_attention_by_range(tiny, impl):
    layers = tiny.config.num_hidden_layers
    ids = torch.randint(0, tiny.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    entry = get(impl)
    with use_impl(tiny, impl):
        r = measure_breakdown(tiny, ids, impl, entry.hf_name, warmup=1)
    assert r["attention_attribution"] == "ranges"
    assert r["attention_ranges"] == layers  # one range per layer's attention call, nothing else
    ms = r["category_ms"]
    assert set(ms) == set(CATEGORIES)
    assert ms["attention"] > 0 and ms["gemm"] > 0 and ms["quant"] == 0  # fp32 model: no quantised weights
    assert sum(ms.values()) == pytest.approx(r["span_ms"], rel=1e-6)  # the categories cover the prefill exactly
    assert r["ttft_if_attention_zero_ms"] == pytest.approx(r["span_ms"] - ms["attention"])
    assert any(t["category"] == "attention" for t in r["top"])
    assert all(t["category"] != "attention" or "mm" not in t["name"] or impl in ("eager", "naive", "llm_attn")
               for t in r["top"])
    json.dumps(r)


def test_stock_wrapper_is_removed_after_profiling(tiny):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = dict(ALL_ATTENTION_FUNCTIONS._global_mapping)
    ids = torch.randint(0, tiny.config.vocab_size, (1, 16))
    with use_impl(tiny, "eager"):
        measure_breakdown(tiny, ids, "eager", "eager", warmup=1)
    assert dict(ALL_ATTENTION_FUNCTIONS._global_mapping) == before


def test_breakdown_through_the_cli_and_the_report(tmp_path, capsys):
    from llm_attn import ttft
    from llm_attn.report import write_report

    out = tmp_path / "rows.jsonl"
    # --device cpu: on a GPU machine the default would be the 8B AWQ model on the GPU (this checks the CPU path).
    assert ttft.main(["--impl", "sdpa", "llm_attn", "--seq", "16", "32", "--measure", "ttft", "breakdown",
                      "--repeats", "1", "--warmup", "1", "--no-progress", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT if attention took 0 ms" in text and "idle (host, no op)" in text
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    bd = [r for r in rows if r["measurement"] == "breakdown"]
    assert len(bd) == 4 and all(r["status"] == "ok" for r in bd)
    report = write_report([out], tmp_path / "rep")
    md = report.read_text()
    assert "Where prefill time goes" in md and "breakdown.png" in md
    assert (tmp_path / "rep" / "breakdown.png").stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["sdpa", "naive"])
def test_gpu_breakdown_counts_kernels(impl):
    from llm_attn.models import load_model

    model, _ = load_model("tiny:fp16", device="cuda", dtype=torch.float16, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 256), device="cuda")
    with use_impl(model, impl):
        r = measure_breakdown(model, ids, impl, get(impl).hf_name, warmup=2)
    ms = r["category_ms"]
    assert r["device_type"] == "cuda" and r["attention_attribution"] == "ranges (GPU timeline)"
    assert ms["attention"] > 0 and ms["gemm"] > 0 and r["busy_ms"] > 0
    assert r["span_ms"] >= r["busy_ms"] and ms["idle"] >= 0


def _event_factory(layout: str):
    """FunctionEvents as this torch's profiler makes them. 'activity_type': torch 2.13's events name their kineto
    activity; 'annotation_flag': older ones (torch 2.11, the H100's) have no ``activity_type`` (the constructor
    takes no such argument) and mark record_function ranges with ``is_user_annotation`` only."""
    import inspect

    from torch.autograd.profiler_util import FunctionEvent

    takes_activity = "activity_type" in inspect.signature(FunctionEvent.__init__).parameters
    if layout == "activity_type" and not takes_activity:
        pytest.skip("this torch's FunctionEvent has no activity_type")

    def ev(i, name, start, end, device=torch.autograd.DeviceType.CUDA, activity="kernel"):
        kwargs = {"is_user_annotation": "annotation" in activity}
        if layout == "activity_type":
            kwargs["activity_type"] = activity
        return FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end, device_type=device, **kwargs)

    return ev


@pytest.mark.parametrize("layout", ["activity_type", "annotation_flag"])
def test_gpu_event_layout_is_classified_by_the_attention_windows(layout):
    """The CUDA branch of ``classify`` on events laid out as torch 2.11's profiler reports them on an H100 (seen in
    a run there): record_function ranges appear on the GPU timeline as annotations around the kernels launched
    inside them; kernels carry no usable link to their CPU op. The annotations are not kernels; a cuDNN attention
    kernel (a GEMM by name) inside an attention window is attention; idle is the uncovered part of the span."""
    from torch.autograd import DeviceType

    from llm_attn.harness.breakdown import PREFILL_RANGE, classify

    ev = _event_factory(layout)

    events = [
        ev(1, PREFILL_RANGE, 0, 1000, DeviceType.CPU, "user_annotation"),
        ev(2, PREFILL_RANGE, 50, 900, activity="gpu_user_annotation"),
        ev(3, "nvjet_sm90_hsh_64x64_TNT", 100, 200),                          # GEMM
        ev(4, "llm_attn.attention:sdpa", 250, 400, activity="gpu_user_annotation"),
        ev(5, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 250, 400),   # attention
        ev(6, "awq_dequantize_kernel", 450, 500),                              # quantised weights
        ev(7, "void at::native::elementwise_kernel<128, 4>", 600, 700),        # other
        ev(8, "Memcpy DtoD (Device -> Device)", 800, 850, activity="gpu_memcpy"),
    ]
    r = classify(events, "cuda")
    ms = r["category_ms"]
    assert r["attention_attribution"] == "ranges (GPU timeline)"
    assert ms["attention"] == pytest.approx(0.15) and ms["gemm"] == pytest.approx(0.1)
    assert ms["quant"] == pytest.approx(0.05) and ms["other"] == pytest.approx(0.15)
    assert r["span_ms"] == pytest.approx(1.0) and r["busy_ms"] == pytest.approx(0.45)
    assert ms["idle"] == pytest.approx(0.55)
    assert r["ttft_if_attention_zero_ms"] == pytest.approx(0.85)
    assert not any(t["name"].startswith("llm_attn.") for t in r["top"])


@pytest.mark.parametrize("layout", ["activity_type", "annotation_flag"])
def test_cpu_event_layout_is_split_over_op_self_time(layout):
    """The CPU branch of ``classify`` on both event layouts: ATen ops' self time by category (the attention range's
    ops are attention, a matmul outside it is GEMM), ranges themselves are not ops, idle is the rest of the span."""
    from torch.autograd import DeviceType

    from llm_attn.harness.breakdown import PREFILL_RANGE, classify

    ev = _event_factory(layout)
    cpu = DeviceType.CPU
    prefill = ev(1, PREFILL_RANGE, 0, 1000, cpu, "user_annotation")
    mm = ev(2, "aten::mm", 100, 300, cpu, "cpu_op")
    attn = ev(3, "llm_attn.attention:sdpa", 400, 700, cpu, "user_annotation")
    sdpa = ev(4, "aten::scaled_dot_product_attention", 420, 680, cpu, "cpu_op")
    inner = ev(5, "aten::bmm", 450, 550, cpu, "cpu_op")
    add = ev(6, "aten::add", 800, 850, cpu, "cpu_op")
    for child, parent in ((mm, prefill), (attn, prefill), (sdpa, attn), (inner, sdpa), (add, prefill)):
        child.set_cpu_parent(parent)
        parent.append_cpu_child(child)
    r = classify([prefill, mm, attn, sdpa, inner, add], "cpu")
    ms = r["category_ms"]
    assert r["attention_attribution"] == "ranges" and r["attention_ranges"] == 1
    assert ms["attention"] == pytest.approx(0.26) and ms["gemm"] == pytest.approx(0.2)
    assert ms["other"] == pytest.approx(0.05) and ms["quant"] == 0
    assert r["busy_ms"] == pytest.approx(0.51) and ms["idle"] == pytest.approx(0.49)

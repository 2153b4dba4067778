"""GPU tests of issue 18's machinery (skipped without CUDA): graph TTFT vs eager on a GPU-bound shape, a capture
failure recorded as 'unsupported', the host-cost benchmark, and paired rows timed with CUDA events.

    pytest tests/test_paired_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from llm_attn import models, ttft  # noqa: E402
from llm_attn.harness.impls import use_impl  # noqa: E402
from llm_attn.harness.measure import GraphCaptureUnsupported, measure_ttft_graph  # noqa: E402
from llm_attn.harness.paired import measure_ttft_paired  # noqa: E402
from llm_attn.harness.results import iter_rows, validate_row  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model, _ = models.load_model("tiny:fp16", "cuda", torch.float16)
    return model


def _prompt(model, batch, seq):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).cuda()


def test_graph_ttft_equals_eager_on_a_gpu_bound_shape(tiny):
    """Graph TTFT equals eager TTFT within 10 % where the GPU, not the host, sets the pace. On a shared machine one
    side of one measurement can be slowed (this test failed once inside the README's full test run on an H200 and
    passed alone, twice, right after): a ratio outside the band is measured again, eager and graph, and only a
    second miss fails."""
    ids = _prompt(tiny, 16, 4096)  # attention-heavy: ~ms of GPU time per forward against ~1 ms of host time

    def eager_p50():
        eager = measure_ttft_paired(tiny, ids, ["llm_attn"], warmup=2, repeats=10, switch=use_impl)["llm_attn"]
        if eager["host_bound"]["host_bound"]:
            pytest.skip(f"this GPU runs the shape host-bound (enqueue {eager['host_bound']['enqueue_share']:.0%})")
        return eager["stats"]["p50"]

    eager = eager_p50()
    for cache in ("dynamic", "static"):
        for attempt in range(2):
            with use_impl(tiny, "llm_attn") as report:
                graph = measure_ttft_graph(tiny, ids, warmup=2, repeats=10, cache=cache)
                assert report.num_fallback_calls == 0, str(report)
            assert graph["mode"] == f"cuda_graph_{cache}_cache"
            names = [k["name"] for k in graph["attention_kernels"]]
            assert any("flash_fwd" in n for n in names), names  # our kernel ran inside the replay
            if 0.9 < graph["stats"]["p50"] / eager < 1.1:
                break
            assert attempt == 0, (cache, graph["stats"]["p50"], eager)
            eager = eager_p50()


def test_capture_failure_is_unsupported_not_a_crash(tiny):
    ids = _prompt(tiny, 1, 64)
    # A real capture breaker: a host synchronisation inside the forward (what a data-dependent branch does).
    hook = tiny.model.layers[0].register_forward_hook(lambda *a: torch.cuda.synchronize())
    try:
        with pytest.raises(GraphCaptureUnsupported, match="cannot be captured"):
            measure_ttft_graph(tiny, ids, warmup=1, repeats=2)
    finally:
        hook.remove()
    # The same model still captures afterwards: the failed capture left the device usable.
    assert measure_ttft_graph(tiny, ids, warmup=1, repeats=2, profile=False)["stats"]["n"] == 2


def test_cli_graph_rows_are_ok_or_unsupported(tmp_path):
    out = tmp_path / "g.jsonl"
    code = ttft.main(["--model", "tiny:fp16", "--device", "cuda", "--dtype", "float16", "--seq", "128",
                      "--repeats", "3", "--warmup", "1", "--impl", "eager", "sdpa", "llm_attn", "--measure", "ttft",
                      "ttft_graph", "ttft_graph_static", "--no-progress", "--out", str(out)])
    rows = list(iter_rows(out, strict=True))
    assert code == 0
    for r in rows:
        validate_row(r)
        assert r["status"] in ("ok", "unsupported"), r.get("error")
        assert r["host_env"]["start"]["gpu"].get("sm_mhz") or r["host_env"]["start"]["gpu"].get("why")
    ttft_rows = {r["impl"]: r for r in rows if r["measurement"] == "ttft"}
    assert all(r["timer"] == "cuda_event" for r in ttft_rows.values())
    assert all(0 < e < w for r in ttft_rows.values() for e, w in zip(r["enqueue_samples_ms"], r["wall_samples_ms"]))
    assert set(ttft_rows["llm_attn"]["vs"]) == {"sdpa", "eager"}


def test_host_cost_benchmark_runs():
    from llm_attn.harness.hostcost import host_cost_table, measure_host_cost
    from llm_attn.kv_cache_reference import FP8_READ_KERNEL

    rows = measure_host_cost("cuda", torch.float16)
    assert len(rows) == 11
    assert all(r["us_per_call"] and r["us_per_call"] > 0 for r in rows), [r.get("why") for r in rows]
    patch = [r for r in rows if r["path"] == "llm_attn via the patch"]
    assert all(r["attention_calls"]["stock_fallback"] == 0 for r in patch), patch
    for path in ("llm_attn via the patch, FP8 cache", "llm_attn via the patch, FP8 cache, update's return + call"):
        (fp8,) = [r for r in rows if r["path"] == path]
        assert set(fp8["fp8_cache_reads"]) == {FP8_READ_KERNEL}, fp8  # the decode kernel read the bytes, no copy
    print(host_cost_table(rows))

"""Issue 35 item 2: one ratio convention, from one module (``llm_attn.harness.stats``), wherever a ratio is printed.
ratio = reference time / this time (throughputs: this / reference), so > 1 always means "this is faster", and each
column header says so: the report and the TTFT table, the host-cost table of ``python -m llm_attn.bench --mode
host``, the kernel benchmark's table, and the LoRA example's step-time column.

    pytest tests/test_ratio_convention.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_script

from llm_attn.harness.stats import (
    BETTER,
    format_ratio,
    format_ratio_interval,
    paired_ratio_interval,
    ratio_header,
    speed_ratio,
)


def test_one_convention_for_times_and_throughputs():
    assert BETTER == ">1 = faster"
    assert speed_ratio(100.0, 80.0) == 1.25  # reference 100 ms, this 80 ms: this is faster
    assert speed_ratio(80.0, 100.0, throughput=True) == 1.25  # reference 80 tok/s, this 100 tok/s: faster
    for bad in ((None, 1.0), (1.0, None), (0.0, 1.0), (1.0, float("nan")), (-1.0, 2.0)):
        assert speed_ratio(*bad) is None  # no number rather than a wrong one
    assert format_ratio(None) == "" and format_ratio(1.0612) == "1.06x"
    assert format_ratio(184.1 / 188.2, 3, words=True) == "0.978x slower"
    assert format_ratio(1.25, words=True) == "1.25x faster" and format_ratio(1.001, words=True) == "1.00x same"
    assert ratio_header("sdpa") == "vs sdpa (>1 = faster)"
    assert ratio_header("flash", "ours") == "ours vs flash (>1 = faster)"
    # The paired interval reads the same way: reference first, and a faster "mine" gives > 1.
    iv = paired_ratio_interval([10.0, 11.0, 10.5, 10.2], [8.0, 8.8, 8.4, 8.1])
    assert iv["ratio"] > 1 and format_ratio_interval(iv).endswith("faster")


def test_host_cost_ratio_is_torch_sdpa_over_the_path():
    """It was median(path) / median(torch SDPA): > 1 meant the path costs more, the opposite of every other table."""
    from llm_attn.harness.hostcost import HostShape, host_cost_table, measure_host_cost

    rows = measure_host_cost("cpu", torch.float32, shapes=(HostShape("prefill 16", 1, 2, 1, 16, 16, 64),), calls=3,
                             warmup=1, rounds=3)
    ref = next(r for r in rows if r["path"] == "torch SDPA")
    for r in rows:
        if r["path"] != "torch SDPA":
            expect = np.median(ref["samples_us"]) / np.median(r["samples_us"])
            assert r["vs_torch_sdpa"]["ratio"] == pytest.approx(expect)
    assert f"host µs/call (torch SDPA / this path, {BETTER})" in host_cost_table(rows)


def test_kernel_bench_columns_say_which_way_is_better():
    from llm_attn.harness.kernel_bench import _table_row

    rows = {"ours": {"ms": 1.0, "tflops": 400.0}, "flash": {"ms": 1.5, "tflops": 266.7}, "cudnn": {"status": "oom"}}
    r = _table_row("prefill", rows, "bf16", 1, 1, 4096, True)
    assert r["ours vs flash (>1 = faster)"] == pytest.approx(1.5)  # flash's ms / ours
    assert not any("cudnn" in k and "vs" in k for k in r)  # no time, no ratio
    assert not any(k.startswith("ours/") for k in r)  # the old 'ours/flash' read as a time ratio the other way


def test_lora_summary_reads_reference_over_this():
    """examples/finetune_lora.py printed 'x sdpa 1.022' for ours at 188.2 ms against sdpa's 184.1: lower was better
    there, with no word saying so."""
    example = load_script("examples/finetune_lora.py", "finetune_lora_ratio")
    agree = {"cosine": 1.0, "max_rel_diff": 0.0}
    runs = [{"impl": "sdpa", "median_step_ms": 184.1, "max_rel_loss_diff": 0.0, "grad_step1": agree,
             "grad_last": agree, "skipped_steps": []},
            {"impl": "llm_attn", "median_step_ms": 188.2, "max_rel_loss_diff": 2.3e-3, "grad_step1": agree,
             "grad_last": agree, "skipped_steps": [], "native_calls": {"kernel": 80}, "fallback_calls": {}}]
    table = example.summary_table(runs, 20)
    assert "step time vs sdpa (>1 = faster)" in table
    line = next(ln for ln in table.splitlines() if ln.startswith("llm_attn"))
    assert "0.978x slower" in line
    assert runs[1]["speed_vs_reference"] == pytest.approx(184.1 / 188.2) and runs[0]["speed_vs_reference"] == 1.0

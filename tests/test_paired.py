"""CPU tests of issue 18's machinery: paired TTFT order, the verdict interval, the host-bound flag, the JSONL rows
with raw pairs, ``ttft_graph`` off CUDA, and static-cache decode running natively (counted calls).

    pytest tests/test_paired.py -q
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

from llm_attn import models, ttft
from llm_attn.harness import hostenv
from llm_attn.harness.measure import GraphCaptureUnsupported, measure_decode_static, measure_ttft_graph
from llm_attn.harness.paired import (
    host_bound_summary,
    measure_decode_paired,
    pairing_order,
    paired_verdicts,
    switch_cost_ms,
)
from llm_attn.harness.results import iter_rows, validate_row
from llm_attn.harness.stats import format_ratio_interval, paired_ratio_interval
from llm_attn.harness.sweep import row_notes, summary_table, verdict_cell


# -- pairing order ----------------------------------------------------------------------------------------------------
def test_pairing_order_is_a_seeded_shuffle_per_repeat():
    impls = ["sdpa", "eager", "llm_attn"]
    order = pairing_order(impls, 300, seed=7)
    assert len(order) == 300
    assert all(sorted(rep) == sorted(impls) for rep in order)  # every implementation once per repeat
    assert order == pairing_order(impls, 300, seed=7)  # reproducible
    assert order != pairing_order(impls, 300, seed=8)
    # No implementation is always first: each leads about a third of the repeats (binomial, 300 draws).
    firsts = {i: sum(rep[0] == i for rep in order) for i in impls}
    assert all(60 <= n <= 140 for n in firsts.values()), firsts
    assert len({tuple(rep) for rep in order}) == 6  # all 3! orders occur
    with pytest.raises(ValueError):
        pairing_order(["a", "a"], 3, 0)
    with pytest.raises(ValueError):
        pairing_order(["a"], 0, 0)


# -- paired decode ----------------------------------------------------------------------------------------------------
def test_decode_is_paired_and_an_implementation_that_cannot_run_is_left_out():
    """Every repeat runs each implementation once in the seeded order; host drift shared by a repeat cancels in the
    tok/s verdict; an implementation whose warm-up raises is returned with its error and the others are paired."""
    ran, current, drift = [], [None], iter(np.linspace(1.0, 2.0, 100))
    step_ms = {"sdpa": 10.0, "fast": 8.0}

    @contextlib.contextmanager
    def switch(model, impl):
        current[0] = impl
        yield None
        current[0] = None

    def run_once():
        impl = current[0]
        if impl == "broken":
            raise RuntimeError("cannot be captured")
        ran.append(impl)
        t = step_ms[impl] * next(drift)
        return {"samples_ms": [t, t], "run_tpot_ms": [t], "tokens": [[1, 2, 3]], "peak_mem_bytes": None,
                "mode": "test"}

    out, failed = measure_decode_paired(None, ["sdpa", "broken", "fast"], 6, switch=switch, run_once=run_once,
                                        seed=3)
    assert set(failed) == {"broken"} and "cannot be captured" in str(failed["broken"])
    order = pairing_order(["sdpa", "fast"], 6, 3)
    assert ran == ["sdpa", "fast"] + [i for rep in order for i in rep]  # warm-ups, then the paired repeats
    row = {**out["fast"], "impl": "fast"}
    assert row["paired"]["order"] == order and len(row["run_tpot_ms"]) == 6 and row["runs"] == 6
    assert row["tok_s"] == pytest.approx(1e3 / np.median(row["run_tpot_ms"]))
    iv = paired_verdicts(row, ["sdpa"])["sdpa"]  # fast's tok/s over sdpa's: 10/8, drift or not
    assert iv["low"] > 1.1 and not iv["contains_one"], iv


# -- the interval -----------------------------------------------------------------------------------------------------
def test_interval_covers_a_known_ratio_despite_shared_drift():
    rng = np.random.default_rng(0)
    n = 20
    drift = rng.uniform(1.0, 1.8, n)  # host noise hitting both implementations of a repeat alike
    mine = 100.0 * drift * rng.normal(1.0, 0.005, n)
    ref = 120.0 * drift * rng.normal(1.0, 0.005, n)  # stock is 1.2x slower: speedup 1.2
    iv = paired_ratio_interval(ref, mine, seed=1)
    assert iv["low"] <= 1.2 <= iv["high"], iv
    assert iv["low"] > 1.1 and iv["high"] < 1.3, iv  # pairing removes the drift: a tight interval
    assert not iv["contains_one"]
    assert format_ratio_interval(iv).endswith("faster")
    assert paired_ratio_interval(ref, mine, seed=1) == iv  # seeded
    slower = paired_ratio_interval(mine, ref, seed=1)
    assert slower["high"] < 1.0 and format_ratio_interval(slower).endswith("slower")


def test_identical_samples_say_no_difference():
    x = [71.7, 72.1, 90.3, 71.9, 72.0, 85.0]
    iv = paired_ratio_interval(x, list(x))
    assert iv["ratio"] == 1.0 and iv["low"] == 1.0 and iv["high"] == 1.0 and iv["contains_one"]
    assert format_ratio_interval(iv) == "1.000x [1.000, 1.000] no difference"


def test_interval_format_and_bad_input():
    iv = {"ratio": 0.995, "low": 0.989, "high": 1.002, "contains_one": True}
    assert format_ratio_interval(iv) == "0.995x [0.989, 1.002] no difference"
    assert format_ratio_interval(iv, words=False) == "0.995x [0.989, 1.002]"
    with pytest.raises(ValueError):
        paired_ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ratio_interval([1.0, float("nan")], [1.0, 1.0])


# -- host-bound -------------------------------------------------------------------------------------------------------
def test_host_bound_flag_on_synthetic_rows():
    hb = host_bound_summary([100.0, 101.0, 99.0], [95.0, 96.0, 94.0], [101.0, 102.0, 100.0], device_timed=True)
    assert hb["host_bound"] and hb["enqueue_share"] == pytest.approx(0.95)
    assert hb["gpu_span_share"] == pytest.approx(300 / 303)
    gpu_bound = host_bound_summary([100.0] * 3, [52.0, 55.0, 51.0], [101.0] * 3, device_timed=True)
    assert not gpu_bound["host_bound"] and gpu_bound["enqueue_share"] == pytest.approx(0.52)
    row = {"status": "ok", "host_bound": hb, "attention_calls": {"impl": 4, "stock_fallback": 28},
           "host_env": hostenv.span({"gpu": {"sm_mhz": 1980.0}, "cpu": {}}, {"gpu": {"sm_mhz": 1755.0}, "cpu": {}})}
    notes = row_notes(row)
    assert notes[0] == "host-bound (enqueue 95% of TTFT; GPU timeline spans 99% of wall)"
    assert notes[1] == "FALLBACK 88% of attention calls to stock (28/32)"
    assert notes[2] == "SM clock moved 11%"
    assert row_notes({**row, "host_bound": gpu_bound, "attention_calls": {"impl": 32, "stock_fallback": 0},
                      "host_env": hostenv.span({"gpu": {"sm_mhz": 1980.0}, "cpu": {}},
                                               {"gpu": {"sm_mhz": 1965.0}, "cpu": {}})}) == []


def test_verdict_cell_falls_back_to_plain_ratio_for_old_rows():
    assert verdict_cell({"status": "ok"}, "sdpa", 90.0, 100.0) == "0.90x"
    iv = {"ratio": 1.2, "low": 1.15, "high": 1.26, "contains_one": False}
    assert verdict_cell({"status": "ok", "vs": {"sdpa": iv}}, "sdpa", 1, 1) == "1.20x [1.15, 1.26] faster"


def test_host_env_snapshot_on_cpu():
    snap = hostenv.snapshot(torch.device("cpu"))
    assert snap["gpu"]["source"] is None and "not a CUDA device" in snap["gpu"]["why"]
    assert set(snap["cpu"]) >= {"cpu0_mhz", "governor"}
    assert hostenv.span(snap, snap)["sm_clock_change_pct"] is None


# -- the CLI: paired rows ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paired_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("paired") / "rows.jsonl"
    code = ttft.main(["--device", "cpu", "--seq", "16", "--repeats", "4", "--warmup", "1", "--impl", "sdpa",
                      "llm_attn", "--measure", "ttft", "--no-progress", "--out", str(out)])
    return code, list(iter_rows(out, strict=True))


def test_jsonl_rows_keep_the_raw_pairs(paired_rows):
    code, rows = paired_rows
    assert code == 0
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"sdpa", "llm_attn"}
    for impl, r in by.items():
        validate_row(r)
        p = r["paired"]
        assert p["impls"] == ["sdpa", "llm_attn"] and len(p["order"]) == 4
        assert [rep.index(impl) for rep in p["order"]] == p["positions"]
        assert p["samples_ms"][impl] == r["samples_ms"] and len(r["samples_ms"]) == 4
        assert len(r["enqueue_samples_ms"]) == 4 and len(p["switch_ms"]) == 4
        assert all(0 < e <= w for e, w in zip(r["enqueue_samples_ms"], r["wall_samples_ms"]))
        assert r["stats"]["n"] == 4 and r["host_bound"]["host_bound"]  # on CPU the host does everything
        assert r["host_env"]["start"]["gpu"]["source"] is None
        assert r["paired"]["samples_ms"] == by["sdpa"]["paired"]["samples_ms"]  # one pairing, both rows
    ours = by["llm_attn"]
    iv = ours["vs"]["sdpa"]
    assert iv == paired_verdicts(ours, ["sdpa"])["sdpa"]  # recomputable from the row alone
    assert iv["ratio"] == pytest.approx(np.median(by["sdpa"]["samples_ms"]) / np.median(ours["samples_ms"]))
    # Ours really ran: every attention call of warm-up and repeats (2 layers x 5 prefills) natively.
    assert ours["attention_calls"] == {"impl": 10, "stock_fallback": 0, "fallback_reasons": {},
                                       "counted_over": "warm-up and repeats"}
    # Stock rows say what ran too: transformers' sdpa function, counted over the warm-up (1 prefill x 2 layers).
    assert by["sdpa"]["attention_calls"] == {"impl": 2, "stock_fallback": 0, "fallback_reasons": {},
                                             "counted_over": "warm-up"}
    table = summary_table(rows)
    assert format_ratio_interval(iv) in table and "paired-bootstrap interval" in table


def test_switch_cost_is_small():
    model, _ = models.load_model("tiny:fp16", "cpu", torch.float32)
    from llm_attn.harness.impls import use_impl

    cost = switch_cost_ms(model, ["sdpa", "llm_attn"], use_impl, rounds=10)
    assert all(0 < c < 50 for c in cost.values()), cost  # milliseconds, outside the timed region


# -- ttft_graph off CUDA ------------------------------------------------------------------------------------------------
def test_ttft_graph_is_unsupported_on_cpu(tmp_path):
    model, _ = models.load_model("tiny:fp16", "cpu", torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with pytest.raises(GraphCaptureUnsupported, match="CUDA graphs need a CUDA device"):
        measure_ttft_graph(model, ids, warmup=1, repeats=2)
    out = tmp_path / "g.jsonl"
    code = ttft.main(["--device", "cpu", "--seq", "8", "--repeats", "2", "--warmup", "1", "--impl", "llm_attn",
                      "--measure", "ttft_graph", "ttft_graph_static", "--no-progress", "--out", str(out)])
    rows = list(iter_rows(out, strict=True))
    assert code == 0 and {r["measurement"] for r in rows} == {"ttft_graph", "ttft_graph_static"}
    for r in rows:
        validate_row(r)
        assert r["status"] == "unsupported" and "CUDA graphs need a CUDA device" in r["error"]["message"]
    assert "UNSUPPORTED" in summary_table(rows)


# -- static-cache decode runs natively ----------------------------------------------------------------------------------
def _tiny_patched_counts(fn):
    from llm_attn.patches import patched

    model, _ = models.load_model("tiny:fp16", "cpu", torch.float32)
    with patched(model) as report:
        got = fn(model)
        return got, report.num_native_calls, report.num_fallback_calls, dict(report.fallback_calls)


def test_generate_static_cache_runs_natively_batch_2():
    """transformers >= 5.2x's generate() makes the static-cache mask contiguous: batch > 1 exposes a lost tag."""
    new = 6
    ids = torch.randint(0, 1024, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(model):
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  cache_implementation="static", pad_token_id=0)

    _, native, fallback, reasons = _tiny_patched_counts(run)
    layers = models.get_preset("tiny").num_hidden_layers
    assert fallback == 0, reasons
    assert native == layers * new


def test_measure_decode_static_loop_runs_natively():
    ids = torch.randint(0, 1024, (2, 9), generator=torch.Generator().manual_seed(0))
    new, runs = 5, 2

    def run(model):
        return measure_decode_static(model, ids, new, runs, use_graph=False)

    fields, native, fallback, reasons = _tiny_patched_counts(run)
    layers = models.get_preset("tiny").num_hidden_layers
    assert fallback == 0, reasons
    # prefill + warm-up steps + (new - 1) steps per run, every one on llm_attn.
    from llm_attn.harness.measure import GRAPH_WARMUP_STEPS

    assert native == layers * (1 + GRAPH_WARMUP_STEPS + runs * (new - 1))
    assert fields["mode"] == "static_cache_loop_no_graph"


# -- host cost ----------------------------------------------------------------------------------------------------------
def test_host_cost_runs_every_path_and_the_patch_path_is_native():
    from llm_attn.harness.hostcost import HostShape, host_cost_table, measure_host_cost
    from llm_attn.kv_cache_reference import FP8_READ_REFERENCE

    shapes = (HostShape("prefill 32", 1, 4, 2, 32, 32, 64), HostShape("decode kv 64", 1, 4, 2, 1, 64, 64))
    rows = measure_host_cost("cpu", torch.float32, shapes=shapes, calls=5, warmup=1, rounds=3)
    # 4 paths per shape, and three on the FP8 cache for the decode shape
    assert len(rows) == 11 and all(r["us_per_call"] and r["us_per_call"] > 0 for r in rows), rows
    # Interleaved rounds: every path has one sample per round; its number is their median, and every path but the
    # reference carries its paired cost ratio to torch SDPA.
    assert all(len(r["samples_us"]) == 3 and r["us_per_call"] == sorted(r["samples_us"])[1] for r in rows)
    for r in rows:
        iv = r.get("vs_torch_sdpa")
        if r["path"] == "torch SDPA":
            assert iv is None
        else:
            assert iv["n"] == 3 and iv["low"] <= iv["ratio"] <= iv["high"]
    patch = [r for r in rows if r["path"] == "llm_attn via the patch"]
    assert all(r["attention_calls"] == {"impl": 3 * (5 + 1), "stock_fallback": 0} for r in patch)
    # Each FP8 path's row counts its own calls' reads (the counters are read around each path's turn); stock's copy
    # is read by stock attention, which the patch never sees.
    for path in ("llm_attn via the patch, FP8 cache", "llm_attn via the patch, FP8 cache, update's return + call"):
        (fp8,) = [r for r in rows if r["path"] == path]
        assert fp8["shape"] == "decode kv 64" and fp8["fp8_cache_reads"] == {FP8_READ_REFERENCE: 3 * (5 + 1)}, fp8
    (stock,) = [r for r in rows if r["path"] == "sdpa (transformers), FP8 cache, update's return + call"]
    assert "fp8_cache_reads" not in stock and stock["vs_torch_sdpa"]["n"] == 3, stock
    table = host_cost_table(rows)
    assert "prefill 32: host µs/call (torch SDPA / this path, >1 = faster)" in table and "(1.00x)" in table
    assert re.search(r"\(\d+\.\d+x \[\d+\.\d+, \d+\.\d+\] (no difference|faster|slower)\)", table)


def test_user_timing_runs_each_path_in_a_fresh_process_and_reports_failures():
    """Issue 38 item 5: the host benchmark and a user's timing disagreed; user_timed times a path as such a script
    does (fresh process, no warm-up, wall time to a sync), cold and warm, and a child that fails is a reason in the
    row, not an exception. Two paths (one asked for, torch SDPA always: the reference), each in two fresh processes:
    every process is a new Python with torch and transformers (~9 s on a CPU machine, ~15 s on the H100 one); the
    test above runs all five in-process."""
    from llm_attn.harness.hostcost import HostShape, measure_host_cost, user_timed, user_timing_table

    shape = HostShape("decode kv 64", 1, 4, 2, 1, 64, 64)
    rows = measure_host_cost("cpu", torch.float32, shapes=(shape,), calls=2, warmup=0, rounds=1, user_timing=True,
                             user_processes=2, paths=("llm_attn.flash_attn_func",))
    assert sorted(r["path"] for r in rows) == ["llm_attn.flash_attn_func", "torch SDPA"]
    for r in rows:
        assert len(r["user_cold_samples_us"]) == len(r["user_warm_samples_us"]) == 2, r
        assert r["user_cold_us"] > 0 and r["user_warm_us"] > 0, r
        assert min(r["user_warm_samples_us"]) <= r["user_warm_us"] <= max(r["user_warm_samples_us"])
        iv = r.get("user_warm_vs_torch_sdpa")
        assert (iv is None) == (r["path"] == "torch SDPA") and (iv is None or iv["n"] == 2), r
    table = user_timing_table(rows)
    assert "user script: cold wall µs/call" in table and "llm_attn.flash_attn_func" in table
    assert "warm: torch SDPA / this path" in table and re.search(r"\d+\.\dx? \[\d+\.\d+, \d+\.\d+\]", table)
    with pytest.raises(ValueError, match="user_processes"):
        measure_host_cost("cpu", torch.float32, shapes=(shape,), calls=1, warmup=0, rounds=1, user_timing=True,
                          user_processes=0)
    with pytest.raises(ValueError, match=r"unknown host-cost path\(s\) \['flash'\]; known: llm_attn.flash_attn_func"):
        measure_host_cost("cpu", torch.float32, shapes=(shape,), calls=1, warmup=0, rounds=1, paths=("flash",))
    bad = user_timed("no such path", shape, "cpu", torch.float32, calls=1)
    assert set(bad) == {"user_timing_why"} and "KeyError" in bad["user_timing_why"]


def test_python_gc_is_off_while_timing_and_restored_after():
    """A garbage collection inside one implementation's timed prefill would read as a kernel difference."""
    import contextlib
    import gc

    from llm_attn.harness.paired import measure_ttft_paired

    model = models.load_model("tiny", device="cpu", dtype=torch.float32)[0]
    seen = []

    @contextlib.contextmanager
    def switch(m, impl):
        seen.append(gc.isenabled())
        yield None

    assert gc.isenabled()
    got = measure_ttft_paired(model, torch.randint(0, 100, (1, 16)), ["sdpa", "eager"], warmup=1, repeats=3,
                              switch=switch)
    assert seen and not any(seen), seen
    assert gc.isenabled()
    assert got["sdpa"]["paired"]["python_gc"] == "off while timing" and len(got["eager"]["samples_ms"]) == 3


def test_graph_vs_eager_account_splits_the_difference():
    """The H100 case the account exists for: sdpa at 8192 is 88 ms slower replayed from a graph, and its attention
    kernels account for it (under capture transformers hands SDPA a materialised mask)."""
    from llm_attn.harness.measure import graph_vs_eager_account

    eager = {"status": "ok", "stats": {"p50": 287.0}}
    graph = {"status": "ok", "stats": {"p50": 375.0},
             "profile": {"attention_ms": 121.8, "busy_ms": 374.0},
             "eager_profile": {"attention_ms": 35.0, "busy_ms": 286.0}}
    a = graph_vs_eager_account(graph, eager)
    assert a["delta_ms"] == pytest.approx(88.0)
    assert a["attention_ms"] == pytest.approx(86.8) and a["other_ms"] == pytest.approx(1.2)
    assert a["host_removed_ms"] == pytest.approx(0.0)
    # The identity: the parts add up to the difference.
    assert a["attention_ms"] + a["other_ms"] - a["host_removed_ms"] == pytest.approx(a["delta_ms"])
    assert a["unexplained_pct"] == pytest.approx(100 * 1.2 / 287.0)
    # Host-bound eager: the graph removes the idle time, attention unchanged.
    eager = {"status": "ok", "stats": {"p50": 80.0}}
    graph = {"status": "ok", "stats": {"p50": 69.0}, "profile": {"attention_ms": 4.0, "busy_ms": 68.5},
             "eager_profile": {"attention_ms": 4.0, "busy_ms": 68.0}}
    a = graph_vs_eager_account(graph, eager)
    assert a["host_removed_ms"] == pytest.approx(11.5) and a["unexplained_pct"] == pytest.approx(100 * 0.5 / 80)
    assert a["other_changes"] == []  # the profiles name no other kernel
    # The rest, itemised by kernel name: a mask the capture builds, a GEMM that did not change.
    graph["profile"]["other_kernels"] = [{"name": "gemm", "launches": 224, "ms": 60.0},
                                         {"name": "fill_mask", "launches": 32, "ms": 0.4}]
    graph["eager_profile"]["other_kernels"] = [{"name": "gemm", "launches": 224, "ms": 60.01}]
    a = graph_vs_eager_account(graph, eager)
    assert [c["name"] for c in a["other_changes"]] == ["fill_mask"]
    assert a["other_changes"][0]["delta_ms"] == pytest.approx(0.4) and a["other_changes"][0]["launches"] == (0, 32)
    assert graph_vs_eager_account({**graph, "eager_profile": None}, eager) is None
    assert graph_vs_eager_account(graph, {"status": "oom"}) is None


def test_profile_sums_skip_annotation_ranges():
    """torch 2.11 puts record_function ranges (the registry's 'llm_attn.attention:...') on the GPU timeline as events
    that span their kernels and flags them only with is_user_annotation: counted, they doubled our eager attention."""
    import types

    from llm_attn.harness import measure

    def event(name, ms, annotation=False):
        return types.SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                                     is_user_annotation=annotation,
                                     time_range=types.SimpleNamespace(start=0, end=ms * 1e3))

    events = [event("llm_attn.attention:llm_attn", 2.0, annotation=True), event("flash_fwd_sm90_kernel", 2.0),
              event("gemm", 5.0)]
    assert measure.attention_kernels_of(events) == [{"name": "flash_fwd_sm90_kernel", "launches": 1, "ms": 2.0}]
    assert measure.device_busy_ms(events) == pytest.approx(7.0)

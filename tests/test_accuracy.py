"""The kernel accuracy benchmark (``llm_attn.harness.accuracy``, ``python -m llm_attn.bench --mode accuracy``) on
CPU: the metrics on known inputs, the sampled-row float64 reference against ``attention_naive``, the input
generator's outlier channels, and a fake implementation with a known error flagged as missing its target (in the
library and through the command line, exit status 1).

    pytest tests/test_accuracy.py
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from llm_attn import registry
from llm_attn.harness.accuracy import (
    KINDS,
    TARGETS,
    Target,
    accuracy_point,
    accuracy_table,
    check_targets,
    error_metrics,
    make_impl,
    make_inputs,
    query_rows,
    reference_rows,
    target_summary,
)
from llm_attn.reference import attention_naive

SMALL = dict(batch=1, heads=4, kv_heads=2, head_dim=64, device="cpu")


# -- metrics -----------------------------------------------------------------------------------------------------------
def test_metrics_of_an_exact_output():
    ref = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    m = error_metrics(ref.clone(), ref)
    assert m["cosine"] == pytest.approx(1.0, abs=1e-15) and m["rel_l1"] == 0 and m["max_abs"] == 0
    assert m["min_row_cosine"] == pytest.approx(1.0, abs=1e-15) and m["finite"] and m["values"] == 80


def test_metrics_of_known_errors():
    ref = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    # A uniform 5 % scale error: the direction is exact (cosine 1), the relative L1 error is exactly 0.05.
    m = error_metrics(ref * 1.05, ref)
    assert m["cosine"] == pytest.approx(1.0, abs=1e-15)
    assert m["rel_l1"] == pytest.approx(0.05, rel=1e-12)
    assert m["max_abs"] == pytest.approx(0.1, rel=1e-12) and m["ref_absmax"] == 2.0
    # One row rotated by 90 degrees: that row's cosine is 0, the whole tensor's is 4/5 (|ref|^2 = 5, the dot 4).
    out = torch.tensor([[0.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    m = error_metrics(out, ref)
    assert m["min_row_cosine"] == pytest.approx(0.0, abs=1e-15)
    assert m["cosine"] == pytest.approx(4 / 5, rel=1e-12)
    assert m["rel_l1"] == pytest.approx(2 / 3, rel=1e-12)  # |1| + |1| over |1| + |2|
    assert m["max_abs"] == 1.0
    bad = error_metrics(torch.tensor([[float("nan"), 0.0], [0.0, 2.0]]), ref)
    assert not bad["finite"]
    with pytest.raises(ValueError, match="shape"):
        error_metrics(ref[:1], ref)


def test_targets_verdicts():
    row = {"kind": "k_outliers", "status": "ok", "finite": True, "cosine": 0.9995, "rel_l1": 0.031}
    got = {v["target"]: v["met"] for v in check_targets(row)}
    assert got == {"cosine >= 0.999": True, "rel_l1 <= 0.03": False}
    assert check_targets({**row, "kind": "gaussian"}) == []  # the targets are on the outlier inputs
    assert all(not v["met"] and v["value"] is None for v in check_targets({"kind": "k_outliers", "status": "oom"}))
    assert not check_targets({**row, "finite": False})[0]["met"]  # NaN anywhere: no verdict can pass
    everywhere = Target("cosine", ">=", 0.99, outliers_only=False)
    assert check_targets({**row, "kind": "gaussian"}, [everywhere])[0]["met"]
    assert not everywhere.met(math.nan)


# -- the reference on sampled rows ---------------------------------------------------------------------------------------
def test_query_rows_sample_includes_the_last_row():
    rows = query_rows(1000, 37, seed=3)
    assert rows.numel() == 37 and int(rows[-1]) == 999
    assert torch.equal(rows, torch.sort(torch.unique(rows)).values)
    assert torch.equal(rows, query_rows(1000, 37, seed=3))  # seeded
    assert torch.equal(query_rows(20, 37), torch.arange(20))  # short rows: every row


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_reference_rows_match_attention_naive(causal, hq, hkv):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, 37, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, hkv, 37, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, hkv, 37, 16, generator=gen).to(torch.bfloat16)
    full, _ = attention_naive(q, k, v, causal=causal)
    rows = query_rows(37, 11, seed=1)
    # A chunk budget of a few rows: the chunking must not change the result.
    got = reference_rows(q, k, v, rows, causal, chunk_bytes=3 * 2 * hq * 37 * 16)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, full[:, :, rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference_rows(q, k, v, torch.arange(37), causal), full, rtol=1e-12, atol=1e-12)


# -- inputs --------------------------------------------------------------------------------------------------------------
def test_outlier_generator_plants_outlier_channels():
    q, k, v, planted = make_inputs("k_outliers", seq=512, dtype=torch.float32, seed=5, **SMALL)
    channels = planted["outlier_channels"]
    assert channels.shape == (2, KINDS["k_outliers"].k_outlier_channels)
    mean_abs = k[0].mean(dim=1).abs()  # (Hkv, D): each channel's bias over the tokens
    typical = k[0].std(dim=1)  # (Hkv, D): each channel's spread, 1 for N(0, 1)
    for h in range(2):
        others = torch.ones(64, dtype=torch.bool)
        others[channels[h]] = False
        median_other = typical[h][others].median()
        # Every planted channel carries a bias of 10-50x the typical magnitude of the others ...
        assert (mean_abs[h][channels[h]] >= 9.5 * median_other).all()
        assert (mean_abs[h][channels[h]] <= 52 * median_other).all()
        # ... and no other channel does.
        assert (mean_abs[h][others] < 0.5).all()
    assert ((planted["outlier_bias"].abs() >= 10) & (planted["outlier_bias"].abs() <= 50)).all()
    _, k2, _, none = make_inputs("gaussian", seq=512, dtype=torch.float32, seed=5, **SMALL)
    assert none == {} and k2.abs().mean(dim=2).max() < 1.0  # no column stands out
    q3, k3, _, _ = make_inputs("k_outliers", seq=512, dtype=torch.float32, seed=5, **SMALL)
    assert torch.equal(k3, k) and torch.equal(q3, q)  # seeded


def test_peaky_queries_make_peaky_attention():
    def top_share(kind):
        q, k, v, _ = make_inputs(kind, seq=256, dtype=torch.float32, seed=0, **SMALL)
        s = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) / 8.0
        return torch.softmax(s, -1).amax(-1).mean()

    assert q_std("peaky") == pytest.approx(4.0, rel=0.05) and q_std("gaussian") == pytest.approx(1.0, rel=0.05)
    assert top_share("peaky") > 4 * top_share("gaussian")


def q_std(kind):
    q, _, _, _ = make_inputs(kind, seq=256, dtype=torch.float32, seed=0, **SMALL)
    return float(q.std())


# -- a point, targets flagged --------------------------------------------------------------------------------------------
def test_fake_implementation_with_known_error_fails_its_target():
    sdpa = make_impl("sdpa")

    def scaled(q, k, v, causal):  # a 5 % gain error: the cosine stays 1, the relative L1 error becomes 0.05
        return (sdpa(q.float(), k.float(), v.float(), causal) * 1.05).to(q.dtype)

    def broken(q, k, v, causal):
        raise RuntimeError("no kernel for this shape")

    rows = accuracy_point({"sdpa": sdpa, "scaled": scaled, "broken": broken}, "k_outliers", seq=96,
                          dtype=torch.bfloat16, causal=True, rows=40, **SMALL)
    by = {r["impl"]: r for r in rows}
    assert by["sdpa"]["status"] == "ok" and by["sdpa"]["targets_met"] is True
    assert by["sdpa"]["rel_l1"] < 5e-3 and by["sdpa"]["rows_compared"] == 40
    s = by["scaled"]
    assert s["rel_l1"] == pytest.approx(0.05, rel=0.05) and s["cosine"] > 0.9999
    assert s["targets_met"] is False
    assert {v["metric"]: v["met"] for v in s["targets"]} == {"cosine": True, "rel_l1": False}
    assert s["rel_l1_vs_sdpa"] > 10
    assert by["broken"]["status"] == "error" and "no kernel" in by["broken"]["error"]
    assert by["broken"]["targets_met"] is False
    table = accuracy_table(rows)
    assert "FAIL: rel_l1 0.05" in table and "pass" in table
    text, misses = target_summary(rows)
    assert misses == 3  # scaled: rel_l1; broken: both
    assert "MISS scaled k_outliers S=96 causal=1 bfloat16: rel_l1 = 0.05" in text
    assert "MISS broken k_outliers S=96 causal=1 bfloat16: cosine = error" in text
    assert "target cosine >= 0.999 (outlier inputs, every length): MISSED on 1 of 3" in text
    json.dumps(rows)


def test_no_target_on_gaussian_inputs():
    rows = accuracy_point(["sdpa"], "gaussian", seq=32, dtype=torch.bfloat16, causal=False, rows=8, **SMALL)
    assert rows[0]["targets"] == [] and rows[0]["targets_met"] is None
    text, misses = target_summary(rows)
    assert misses == 0 and "not checked" in text


def test_our_native_path_meets_the_targets_on_cpu():
    for kind in ("k_outliers", "outliers+peaky"):
        (row,) = accuracy_point(["ours"], kind, seq=256, dtype=torch.bfloat16, causal=True, rows=64, **SMALL)
        assert row["status"] == "ok", row.get("error")
        assert row["out_dtype"] == "bfloat16" and row["targets_met"], row["targets"]


def test_low_precision_paths_are_measured_and_judged():
    """On CPU the FP8 path (flash_attn_func(precision='fp8')), the llm_attn_fp8 registry entry and the quantised
    reference are one algorithm: the same error (and the INT8 path and its entry likewise). The benchmark tells them
    from bf16 (several times SDPA's error) and records a verdict for each; whether the targets are met is the
    measurement's business, not this test's."""
    rows = accuracy_point(["sdpa", "ours-fp8", "llm_attn_fp8", "fp8-reference", "ours-int8", "llm_attn_int8"],
                          "k_outliers", seq=256, dtype=torch.bfloat16, causal=True, rows=64, **SMALL)
    by = {r["impl"]: r for r in rows}
    assert all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    fp8 = by["ours-fp8"]
    for other in ("llm_attn_fp8", "fp8-reference"):
        assert by[other]["rel_l1"] == pytest.approx(fp8["rel_l1"], rel=1e-6)
    assert by["llm_attn_int8"]["rel_l1"] == pytest.approx(by["ours-int8"]["rel_l1"], rel=1e-6)
    for r in (fp8, by["ours-int8"]):
        assert r["rel_l1_vs_sdpa"] > 2 and 0.9 < r["cosine"] < 1.0
        assert r["targets_met"] in (True, False) and len(r["targets"]) == 2
    # K smoothing at work: the outlier channels cost the FP8 path (almost) nothing over Gaussian inputs.
    (gauss,) = accuracy_point(["ours-fp8"], "gaussian", seq=256, dtype=torch.bfloat16, causal=True, rows=64,
                              **SMALL)
    assert fp8["rel_l1"] < 1.2 * gauss["rel_l1"]


def test_pv_input_path_is_measured_as_its_entry():
    """ours-int8qk (flash_attn_func with P V in the input dtype) and the llm_attn_int8qk entry are one algorithm on
    CPU; e4m3's P and V rounding gone, its error is well under ours-fp8's on the same input."""
    rows = accuracy_point(["ours-fp8", "ours-int8qk", "llm_attn_int8qk"], "k_outliers", seq=256, dtype=torch.bfloat16,
                          causal=True, rows=64, **SMALL)
    by = {r["impl"]: r for r in rows}
    assert all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    assert by["llm_attn_int8qk"]["rel_l1"] == pytest.approx(by["ours-int8qk"]["rel_l1"], rel=1e-6)
    assert by["ours-int8qk"]["rel_l1"] < 0.5 * by["ours-fp8"]["rel_l1"], (by["ours-int8qk"], by["ours-fp8"])


# -- the command line ----------------------------------------------------------------------------------------------------
BAD_PLUGIN = '''
import torch
import llm_attn

def off_by_ten_percent(q, k, v, *, causal, scale, seqused_k=None):
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(
        q.shape[1] // k.shape[1], 1), v.float().repeat_interleave(q.shape[1] // k.shape[1], 1), is_causal=causal)
    return (out * 1.1).to(q.dtype)

llm_attn.register_attention("acc_test_bad", off_by_ten_percent, dtypes=(torch.bfloat16,), devices=("cpu",))
'''


def test_cli_accuracy_mode_writes_rows_and_exits_1_on_a_miss(tmp_path, capsys):
    from llm_attn import bench

    plugin = tmp_path / "bad.py"
    plugin.write_text(BAD_PLUGIN)
    out = tmp_path / "acc.jsonl"
    common = ["--mode", "accuracy", "--seqs", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
              "--causal", "1", "--rows", "16", "--out", str(out)]
    try:
        assert bench.main([*common, "--kinds", "k_outliers", "--impls", "sdpa", "ours"]) == 0
        text = capsys.readouterr().out
        assert "target cosine >= 0.999 (outlier inputs, every length): met on all 2 checked" in text
        assert bench.main([*common, "--plugin", str(plugin), "--kinds", "gaussian", "k_outliers",
                           "--impls", "sdpa", "acc_test_bad"]) == 1
        text = capsys.readouterr().out
        # A 10 % gain error, seen through bf16 rounding: rel L1 0.1 to three digits.
        assert re.search(r"MISS acc_test_bad k_outliers S=48 causal=1 bfloat16: rel_l1 = 0\.(1|0999)", text)
        assert re.search(r"FAIL: rel_l1 0\.(1|0999)\d* not <= 0\.03", text)
    finally:
        registry.unregister_attention("acc_test_bad")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 + 4
    assert all(r["schema"] == "llm_attn.accuracy/1" and r["command"].startswith("python -m llm_attn.bench")
               and r["env"] for r in rows)
    assert {r["kind"] for r in rows} == {"gaussian", "k_outliers"}
    assert {t.name for t in TARGETS} == {"cosine >= 0.999", "rel_l1 <= 0.03"}

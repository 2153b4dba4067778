"""``python -m llm_attn.models fit`` and its memory model (``llm_attn.harness.fit``): the formula's pieces for the
8B, the prediction against the peaks the H100 measured, the 16 GB card with the FP8 cache and chunking, and an
unknown device.

    pytest tests/test_fit.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llm_attn.harness import fit
from llm_attn.harness.devices import load_devices
from llm_attn.harness.results import iter_rows
from llm_attn.models import __main__ as models_cli
from llm_attn.models.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
H100 = REPO / "experiments" / "results" / "h100-80gb-hbm3"
P8B = get_preset("llama-3-8b")


def test_the_pieces_for_llama_3_8b():
    m = fit.MemoryModel(P8B, weights="awq", cache="fp16", arch="sm_90")
    assert m.weight_bytes() == 5_727_855_104  # the loaded model's bytes in every H100 row (model.model_bytes)
    assert m.workspace_bytes() == 32 * 2**20 and fit.cublas_workspace_bytes("sm_89") == 8 * 2**20 + 128 * 2**10
    assert m.kv_bytes(1) == 128 * 1024  # 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes: the 128 KiB
    fp8 = fit.MemoryModel(P8B, weights="awq", cache="fp8")
    per_token = fp8.kv_bytes(64 * 1000 + 64) - fp8.kv_bytes(64 * 1000)
    assert per_token == 64 * 64 * 1024 + 2 * 32 * 8 * 4  # half of fp16, plus one scale per head per 64 tokens
    # per token of a chunk: 4 H + 3 I fp16 at the MLP peak, rotary cos/sin and ids
    assert m.per_token("mlp") == (4 * 4096 + 3 * 14336) * 2 + 2 * 128 * 2 + 16
    # unchunked, the MLP phase is the peak; chunked at 8192 over 128k, the attention phase (its mask: 1 GiB)
    assert m.prefill_peak(131072)["phase"] == "mlp"
    chunked = m.prefill_peak(131072, 8192)
    assert chunked["phase"] == "attention" and chunked["past"] == 131072 - 8192
    assert m.prefill_peak(1000, 4096) == m.prefill_peak(1000)  # a chunk longer than the prompt: one forward
    assert fit.MemoryModel(P8B, cache="fp8-copy").prefill_peak(65536, 2048)["total"] > \
        fit.MemoryModel(P8B, cache="fp8").prefill_peak(65536, 2048)["total"]  # the dequantised copy costs


def test_prediction_against_the_h100_peaks():
    """The measured prefill peaks of the 8B AWQ on the H100 (paired TTFT rows, sdpa and llm_attn alike): within
    4 KiB at 8k-128k tokens; at 2k the measured peak is ~1 % higher (a transient the model leaves out)."""
    rows = []
    for name in ("ttft_long_fp8.jsonl", "ttft_graph_vs_eager.jsonl"):
        rows += [{**r, "_source": name} for r in iter_rows(H100 / name)]
    checks = {c["seq"]: c for c in fit.check_rows(rows, "llama-3-8b")}
    assert {8192, 16384, 65536, 131072} <= set(checks)
    for seq in (8192, 16384, 65536, 131072):
        assert abs(checks[seq]["predicted"] - checks[seq]["measured"]) < 4096, checks[seq]
        assert {"sdpa", "llm_attn"} <= set(checks[seq]["impls"])
    assert -1.5 < checks[2048]["error_pct"] < 0
    assert "ttft_long_fp8.jsonl" in fit.check_table(list(checks.values()))


def test_chunked_and_fp8_peaks_at_128k_against_the_h100():
    """The 128k prefill in chunks of 8192 (H100, 2026-11-26): each row modelled with its cache as it ran (fp16; FP8
    read in place by the prefill kernel; FP8 through the copy, from the row's kv_cache_reads), within 1 % for the
    first two and above the measured peak (the safe side) for the copy."""
    name = "ttft_128k_prefill_chunk.jsonl"
    rows = [{**r, "_source": name} for r in iter_rows(H100 / name)]
    checks = {(c["chunk"], c["cache"]): c for c in fit.check_rows(rows, "llama-3-8b")}
    assert set(checks) == {(None, "fp16"), (8192, "fp16"), (8192, "fp8"), (8192, "fp8-copy")}, set(checks)
    assert abs(checks[(None, "fp16")]["error_pct"]) < 0.01
    assert abs(checks[(8192, "fp16")]["error_pct"]) < 1.5 and abs(checks[(8192, "fp8")]["error_pct"]) < 1.5
    assert 0 < checks[(8192, "fp8-copy")]["error_pct"] < 5
    assert [fit.row_cache(r) for r in rows] == ["fp16", "fp16", "fp8", "fp8-copy"]


def test_longest_is_the_largest_prompt_that_fits():
    m = fit.MemoryModel(P8B, cache="fp16", arch="sm_89")
    budget = 15 * fit.GIB
    n = fit.longest(m, budget, 2048, 1024)
    assert m.peak(n, 2048, 1024) <= budget < m.peak(n + 1, 2048, 1024)
    assert fit.longest(m, m.weight_bytes()) == 0


def test_a_16_gb_card_takes_128k_tokens_with_the_fp8_cache_and_chunking(capsys):
    assert models_cli.main(["fit", "--model", "llama-3-8b", "--device", "rtx-4060-ti", "--chunks", "none", "8192",
                            "2048", "--decode", "1024"]) == 0
    out = capsys.readouterr().out
    lines = {tuple(c.strip() for c in ln.split("|")[3:5]): ln for ln in out.splitlines() if "| rtx-4060-ti" in ln}
    assert "131072 (model max" in lines[("fp8", "2048")]            # the target: >= 128k tokens
    assert "131072 (model max" in lines[("fp8-copy", "2048")]       # and today's FP8 cache, on its copy
    fp16 = int(lines[("fp16", "none")].split("|")[5].split()[0])
    assert 30_000 < fp16 < 60_000  # the "about 70k fit, fewer once the prefill's activations count"
    assert "read in place by llm_attn's decode and prefill kernels" in out

    rows = fit.fit_rows("llama-3-8b", "awq", [d for d in load_devices() if d.slug == "rtx-4060-ti"],
                        caches=("fp8",), chunks=(2048,), new_tokens=1024)
    assert rows[0].longest_prompt >= 131072 and rows[0].with_decode == 131072 - 1024
    assert rows[0].usable_gib == pytest.approx(15.0)


@pytest.mark.parametrize("device, word", [("rtx-5090", "unknown device"), ("h", "ambiguous")])
def test_an_unknown_device_is_one_line_listing_the_known_ones(device, word, capsys):
    with pytest.raises(SystemExit) as exc:
        models_cli.main(["fit", "--device", device])
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"--device {device}: {word}" in err[0]
    assert all(d.slug in err[0] for d in load_devices())


def test_prefixes_name_devices_and_bad_values_are_one_line(capsys):
    assert models_cli.main(["fit", "--device", "jetson", "h100", "--cache", "fp16", "--chunks", "none"]) == 0
    out = capsys.readouterr().out
    assert "jetson-agx-orin-64gb" in out and "h100-sxm-80gb" in out and "rtx-4060-ti" not in out
    for argv, needle in ((["--chunks", "0"], "--chunks 0"), (["--model", "llama-9"], "unknown model preset"),
                         (["--model", "llama-3-8b:int3"], "weights must be one of")):
        with pytest.raises(SystemExit):
            models_cli.main(["fit", *argv])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and needle in err[0], err
    assert math.isfinite(fit.usable_bytes(load_devices()[0]))

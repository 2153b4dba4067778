"""Long prompts in the harness (issue 34, item 5) and the low-precision note, on CPU: experiments/long.toml, the plot
of TTFT vs prompt length stacked by kernel class (from the fixture rows of tests/fixtures/make_long_fixtures.py, and
from a real CPU sweep of the tiny model), and the note a low-precision row carries in the results table.

    pytest tests/test_long_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_script
from llm_attn import registry
from llm_attn.harness.agreement import low_precision_note
from llm_attn.harness.experiments import load_experiment
from llm_attn.harness.session import length_problem
from llm_attn.harness.sweep import summary_table
from llm_attn.models.presets import PRESETS
from llm_attn.reporting.document import write_report
from llm_attn.reporting.ttft_stack import plot_ttft_stacked_rows, stacked_points

REPO = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fixture_rows():
    return load_script("tests/fixtures/make_long_fixtures.py", "make_long_fixtures").rows()


def test_long_experiment_definition():
    e = load_experiment(REPO / "experiments" / "long.toml")
    assert e.name == "long" and e.seqs == [8192, 32768, 65536, 131072] and e.batches == [1]
    assert set(e.measurements) == {"ttft", "breakdown"}
    assert {"sdpa", "llm_attn", "llm_attn_fp8"} <= set(e.impls) and "eager" not in e.impls

    class Config:
        max_position_embeddings = PRESETS["llama-3-8b"].max_position_embeddings

    class Model:
        config = Config()

    # The GPU model takes every length (no decode is measured, so 128k needs no positions beyond the prompt).
    assert length_problem(Model(), e.seqs, e.new_tokens, e.measurements) is None


def test_stacked_plot_from_the_fixture(tmp_path, fixture_rows):
    folder = tmp_path / "results" / "h100-80gb-hbm3"
    folder.mkdir(parents=True)
    (folder / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fixture_rows))
    report = write_report([tmp_path / "results"], tmp_path / "report")
    png = tmp_path / "report" / "ttft_stacked.png"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000
    md = report.read_text()
    assert "](ttft_stacked.png)" in md
    # The low-precision row says so in the report's table notes.
    assert "low precision: FP8 (e4m3) prefill attention" in md and "accuracy: see correctness" in md


def test_stacked_points_and_same_run_ttft(tmp_path, fixture_rows):
    seqs, impls, bd = stacked_points(fixture_rows)
    assert seqs == [8192, 32768, 65536, 131072] and impls == ["sdpa", "llm_attn", "llm_attn_fp8"]
    assert len(bd) == 12
    # One length only: nothing to draw against prompt length.
    one = [r for r in fixture_rows if r["seq"] == 8192]
    assert not plot_ttft_stacked_rows({"d": one}, {}, "t", tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
    # A TTFT row of another run is not drawn on a bar (the diamond comes from the breakdown's own run).
    from llm_attn.reporting.ttft_stack import _ttft_of_run

    assert _ttft_of_run(fixture_rows, "sdpa", 8192, "fixture-long") is not None
    assert _ttft_of_run(fixture_rows, "sdpa", 8192, "another-run") is None


def test_low_precision_note():
    fp8 = low_precision_note(registry.get("llm_attn_fp8").info())
    assert fp8 and fp8.startswith("low precision: FP8 prefill attention") and fp8.endswith("accuracy: see correctness")
    assert low_precision_note(registry.get("llm_attn").info()) is None
    assert low_precision_note(registry.get("sdpa").info()) is None
    assert low_precision_note(None) is None
    # An entry that states its precision (a field the registry may record) is named by it.
    assert low_precision_note({"precision": "fp8 (e4m3, per-block scales)"}) == \
        "fp8 (e4m3, per-block scales) attention; accuracy: see correctness"
    assert low_precision_note({"precision": "native", "description": "x"}) is None


def test_low_precision_row_in_the_summary_table(fixture_rows):
    table = summary_table([r for r in fixture_rows if r["measurement"] == "ttft"])
    lines = {ln.split("|")[3].strip(): ln for ln in table.splitlines() if ln.startswith("| llama")}
    assert "accuracy: see correctness" in lines["llm_attn_fp8"]
    assert "low precision" not in lines["llm_attn"] and "low precision" not in lines["sdpa"]


def test_stacked_plot_from_a_cpu_sweep(tmp_path, capsys):
    from llm_attn import ttft

    out = tmp_path / "results" / "cpu" / "rows.jsonl"
    out.parent.mkdir(parents=True)
    assert ttft.main(["--device", "cpu", "--impl", "sdpa", "llm_attn_fp8", "--seq", "16", "48", "--measure", "ttft",
                      "breakdown", "--repeats", "1", "--warmup", "1", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    # the fp8 rows' table note, from what each row recorded (the compact summary table may cut the notes cell)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fp8_notes = [low_precision_note(r.get("impl_info")) for r in rows if r["impl"] == "llm_attn_fp8"]
    assert fp8_notes and all(n and n.startswith("low precision: FP8 prefill attention") for n in fp8_notes), fp8_notes
    write_report([tmp_path / "results"], tmp_path / "report")
    png = tmp_path / "report" / "ttft_stacked.png"
    assert png.read_bytes()[:8] == PNG

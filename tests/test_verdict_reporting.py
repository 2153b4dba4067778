"""CPU tests of issue 18's verdicts where users read them: the report's `vs` cells (paired interval and words, or the
plain ratio of old rows), its notes column and speedup error bars; ``python -m llm_attn.bench --mode host``; and
experiments/ttft_stability.py (fresh processes, the stable-verdicts table).

    pytest tests/test_verdict_reporting.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_check_here, load_script

from llm_attn import bench, ttft
from llm_attn import report as report_mod
from llm_attn.harness.results import iter_rows

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "results"
INTERVAL = re.compile(r"^\d+\.\d+x \[\d+\.\d+, \d+\.\d+\] (no difference|faster|slower)$")


def _cells(text: str, seq: int, impl: str, header_has: str) -> dict[str, str]:
    """The cells of the table line (seq, impl) under a header that contains ``header_has``, by column name."""
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header_has in line and line.startswith("|"):
            header = cells
        elif header and len(cells) == len(header) and cells[0] == str(seq) and cells[1] == impl:
            return dict(zip(header, cells))
    raise AssertionError(f"no line seq={seq} impl={impl}")


@pytest.fixture(scope="module")
def paired_rows(tmp_path_factory):
    """Rows of a real paired CPU run of the tiny model (sdpa and llm_attn interleaved)."""
    out = tmp_path_factory.mktemp("paired") / "rows.jsonl"
    assert ttft.main(["--device", "cpu", "--model", "tiny", "--seq", "16", "--impl", "sdpa", "llm_attn",
                      "--measure", "ttft", "--repeats", "4", "--warmup", "1", "--no-progress",
                      "--out", str(out)]) == 0
    return out


def test_report_shows_paired_interval_words_and_notes(paired_rows, tmp_path):
    path = report_mod.write_report([paired_rows], tmp_path / "rep")
    text = path.read_text()
    rows = {r["impl"]: r for r in iter_rows(paired_rows)}
    vs = "vs sdpa (>1 = faster)"  # every ratio column says which way is better
    ours = _cells(text, 16, "llm_attn", vs)
    assert INTERVAL.match(ours[vs]), ours[vs]
    iv = rows["llm_attn"]["vs"]["sdpa"]
    assert ours[vs].startswith(f"{iv['ratio']:.{3 if max(abs(iv['high'] - 1), abs(iv['low'] - 1)) < 0.1 else 2}f}x")
    assert ("no difference" in ours[vs]) == iv["contains_one"]
    # CPU timing with perf_counter: the enqueue is the whole TTFT, so every row is host-bound, in words.
    assert rows["llm_attn"]["host_bound"]["host_bound"]
    assert "host-bound" in ours["notes"]
    assert "paired-bootstrap interval" in text


def test_report_notes_fallbacks_and_moved_clock(paired_rows, tmp_path):
    rows = list(iter_rows(paired_rows))
    for r in rows:
        if r["impl"] == "llm_attn":
            r["attention_calls"] = {"impl": 6, "stock_fallback": 2}
            r.setdefault("host_env", {}).update(sm_clock_moved=True, sm_clock_change_pct=-12.0)
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = report_mod.write_report([edited], tmp_path / "rep").read_text()
    notes = _cells(text, 16, "llm_attn", "vs sdpa")["notes"]
    assert "FALLBACK 25% of attention calls to stock (2/8)" in notes and "SM clock moved -12%" in notes


def test_old_rows_without_pairs_keep_the_plain_ratio(tmp_path):
    text = report_mod.write_report([FIXTURES], tmp_path / "rep").read_text()
    assert "1.06x" in text and not re.search(r"\dx \[", text)  # 65.4 / 61.8 in the H100 fixture


def test_speedup_plot_draws_the_interval(paired_rows, tmp_path, monkeypatch):
    import matplotlib.axes

    seen = []
    real = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, *a, **k):  # the real errorbar, its arguments kept
        seen.append((list(x), list(y), k.get("yerr")))
        return real(self, x, y, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    report_mod.write_report([paired_rows], tmp_path / "rep")
    iv = next(r for r in iter_rows(paired_rows) if r["impl"] == "llm_attn")["vs"]["sdpa"]
    assert seen and seen[0][:2] == ([16], [pytest.approx(iv["ratio"])])
    lo, hi = seen[0][2]
    assert lo[0] == pytest.approx(iv["ratio"] - iv["low"]) and hi[0] == pytest.approx(iv["high"] - iv["ratio"])


def test_bench_host_mode_on_cpu(tmp_path, capsys):
    out = tmp_path / "host.jsonl"
    assert bench.main(["--mode", "host", "--dtypes", "bf16", "--calls", "3", "--warmup", "1", "--seqs", "64",
                       "--kv", "128", "--out", str(out)]) == 0
    rows = list(map(json.loads, out.read_text().splitlines()))
    paths = {"llm_attn.flash_attn_func", "llm_attn via the patch", "sdpa (transformers)", "torch SDPA"}
    fp8 = {"llm_attn via the patch, FP8 cache", "llm_attn via the patch, FP8 cache, update's return + call",
           "sdpa (transformers), FP8 cache, update's return + call"}  # the decode on the FP8 cache: decode shapes only
    assert {(r["shape"], r["path"]) for r in rows} == {(s, p) for s in ("prefill 64", "decode kv 128") for p in paths} | {
        ("decode kv 128", p) for p in fp8}
    assert all(r["us_per_call"] > 0 and r["mode"] == "host" and r["command"] for r in rows)
    patched = [r for r in rows if r["path"] == "llm_attn via the patch"]
    assert all(r["attention_calls"]["impl"] > 0 and r["attention_calls"]["stock_fallback"] == 0 for r in patched)
    text = capsys.readouterr().out
    assert "prefill 64: host µs/call (torch SDPA / this path, >1 = faster)" in text and "(1.00x)" in text
    assert re.search(r"decode kv 128, FP8 cache, update's return \+ call: stock's µs / ours \d+\.\d+x \[", text)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the bench's default: the GPU where there is one
    assert f"bf16 on {device}, {rows[0]['env']['kernel_build'] or 'no'} kernel build: host µs per call" in text


def test_bench_host_mode_says_where_its_rows_went(tmp_path, capsys):
    """Issue 35 item 6: --mode host used to end on its table and never say whether or where its rows were kept."""
    args = ["--mode", "host", "--dtypes", "bf16", "--calls", "2", "--rounds", "2", "--warmup", "0", "--seqs", "16",
            "--kv", "16"]
    out = tmp_path / "host.jsonl"
    assert bench.main([*args, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"11 rows appended to {out}"  # 4 + 7 paths
    assert len(out.read_text().splitlines()) == 11
    assert bench.main(args) == 0
    assert "rows not saved: add --out FILE.jsonl" in capsys.readouterr().out.strip().splitlines()[-1]


def test_bench_host_bad_calls_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--mode", "host", "--calls", "0"])
    assert e.value.code == 2 and "argument --calls: must be a positive integer" in capsys.readouterr().err


def _stability():
    return load_script("experiments/ttft_stability.py")


def test_stability_table_targets():
    st = _stability()
    iv = lambda r, lo, hi: {"ratio": r, "low": lo, "high": hi}  # noqa: E731
    table, ok = st.stability_table([iv(1.00, 0.99, 1.01), iv(1.01, 1.00, 1.02), iv(0.995, 0.98, 1.005)])
    assert ok and "NO" not in table and "median of 3 ratios: 1.000x" in table
    table, ok = st.stability_table([iv(1.00, 0.99, 1.01), iv(1.05, 1.04, 1.06), iv(1.00, 0.995, 1.002)])
    assert not ok
    lines = [line for line in table.splitlines() if line.startswith("| 1 ")]
    assert "+5.0%" in lines[0] and lines[0].count("NO") == 2  # outside ±2 % and its interval misses the median


def test_stability_runs_fresh_processes_on_cpu(tmp_path, request):
    cpu_check_here(request, "ttft_stability.py on the tiny CPU model")
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "ttft_stability.py"), "--runs", "2",
                           "--model", "tiny", "--device", "cpu", "--seq", "32", "--out-dir", str(tmp_path / "st"),
                           "--repeats", "3", "--warmup", "1"], check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # 1: CPU timings need not be stable
    assert (tmp_path / "st" / "run0.jsonl").is_file() and (tmp_path / "st" / "run1.jsonl").is_file()
    assert "within ±2% of median" in proc.stdout and "median of 2 ratios" in proc.stdout
    again = subprocess.run([sys.executable, str(REPO / "experiments" / "ttft_stability.py"), "--runs", "2",
                            "--out-dir", str(tmp_path / "st")], check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists already" in again.stderr

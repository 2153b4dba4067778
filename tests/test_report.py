"""CPU tests of ``python -m llm_attn.report``: merging results of two devices (fixtures in tests/fixtures/results,
written by tests/fixtures/make_report_fixtures.py — test inputs, not measurements) into report.md and PNG plots,
%-of-peak from the device table, projections kept apart from measurements, newest row wins.

    pytest tests/test_report.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llm_attn import report as report_mod
from llm_attn.harness.devices import find_device, load_devices
from llm_attn.envinfo import device_slug
from llm_attn.harness.results import OLD_SCHEMAS, SCHEMA, iter_rows, upgrade_row, validate_row
from llm_attn.harness.stats import format_ratio_interval
from llm_attn.reporting import load_rows

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def section(text: str, title: str) -> str:
    """The markdown from the heading ``title`` to the next heading of the same level."""
    start = text.index(title)
    level = title.split(" ")[0]
    nxt = text.find("\n" + level + " ", start + len(title))
    return text[start:] if nxt < 0 else text[start:nxt]


def row_line(text: str, seq: int, impl: str) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 2 and cells[0] == str(seq) and cells[1] == impl:
            return cells
    raise AssertionError(f"no table line for seq={seq} impl={impl}")


def test_fixtures_follow_the_row_schema():
    files = sorted(FIXTURES.rglob("*.jsonl"))
    assert {f.parent.name for f in files} == {"h100-80gb-hbm3", "rtx-4060-ti"}
    for f in files:
        for r in iter_rows(f, strict=True):
            assert r["schema"] in OLD_SCHEMAS + (SCHEMA,)
            validate_row(upgrade_row(r))  # schema 1 rows (the fixtures) are read in today's words
            assert r["env"]["hostname"] == "fixture"  # never mistaken for a measurement


def test_report_reads_schema_1_rows_with_their_old_field_names(tmp_path):
    """Schema 2 renamed env.kernel_backend to env.kernel_build: a schema 1 file still makes a report, and the
    build it recorded is shown; a schema 2 row of the same point (newer) wins over it."""
    src = FIXTURES / "rtx-4060-ti" / "default.jsonl"
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    assert rows[0]["schema"] == "llm_attn.ttft/1"
    for r in rows:
        r["env"]["kernel_backend"] = "nvrtc"
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    up = upgrade_row(rows[0])
    assert up["schema"] == SCHEMA and up["env"]["kernel_build"] == "nvrtc" and "kernel_backend" not in up["env"]
    assert rows[0]["env"]["kernel_backend"] == "nvrtc"  # the input row is not changed
    validate_row(up)
    with pytest.raises(ValueError, match="schema"):
        validate_row(rows[0])  # un-upgraded, an old row is not a current one
    md = report_mod.write_report([tmp_path / "res"], tmp_path / "out", no_projection=True).read_text()
    assert "kernel build" in md and "| nvrtc " in md
    assert f"from {len(rows)} rows" in md


def test_device_table_and_slugs():
    devices = load_devices()
    assert find_device("NVIDIA H100 80GB HBM3", devices).fp16_tensor_tflops == 989
    assert find_device("NVIDIA GeForce RTX 4060 Ti", devices).mem_bandwidth_gb_s == 288
    assert find_device("Orin", devices).sms == 16
    assert find_device("NVIDIA H100 PCIe", devices) is None  # other figures than the SXM part
    assert find_device("cpu", devices) is None
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert device_slug("NVIDIA GeForce RTX 4060 Ti") == "rtx-4060-ti"
    assert device_slug("cpu") == "cpu"


def test_bad_device_table(tmp_path):
    bad = tmp_path / "devices.toml"
    bad.write_text('[[device]]\nslug = "x"\nname = "X"\nmatch = ["x"]\nmem_bandwidth_gb_s = 0\n'
                   'fp16_tensor_tflops = 10\n')
    with pytest.raises(ValueError, match="mem_bandwidth_gb_s must be a positive number"):
        load_devices(bad)


@pytest.fixture(scope="module")
def fixture_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    path = report_mod.write_report([FIXTURES], out)
    return path, path.read_text()


def test_report_files_written(fixture_report):
    path, text = fixture_report
    assert path.name == "report.md" and len(text) > 1000
    for name in ("ttft_vs_seq.png", "speedup.png", "decode_tok_s.png"):
        png = path.parent / name
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
        assert f"]({name})" in text  # linked from the markdown


def test_report_tables_per_device(fixture_report):
    _, text = fixture_report
    h100 = section(text, "## NVIDIA H100 80GB HBM3 — measured")
    rtx = section(text, "## NVIDIA GeForce RTX 4060 Ti — measured")
    # H100, sdpa at 2048: 65.4 ms. Model FLOPs by hand for Llama 3 8B:
    # P_layers = 32 * (4096*128*(2*32 + 2*8) + 3*4096*14336) = 6_979_321_856
    # F = 2*P*2048 + 2*128256*4096 + 2*32*32*2048^2*128 = 29_687_864_623_104 -> 453.9 TFLOP/s = 45.9% of 989
    cells = row_line(h100, 2048, "sdpa")
    assert cells[2] == "65.40" and cells[5] == "454" and cells[6] == "45.9%"
    assert cells[7] == "1.00x" and cells[8] == "1.87x"  # vs sdpa, vs eager (122.4 / 65.4)
    ours = row_line(h100, 2048, "llm_attn")
    assert ours[7] == "1.06x" and ours[8] == "1.98x"  # 65.4 / 61.8, 122.4 / 61.8
    assert row_line(h100, 8192, "eager")[2] == "OOM"
    assert "Out of memory / failed points" in h100 and "OutOfMemoryError" in h100
    assert "| 8192 " not in rtx  # each device shows only what it measured
    assert row_line(rtx, 1024, "sdpa")[2] == "468.60"
    # Decode bandwidth fraction: tok/s * bytes per step / 288 GB/s
    graph = row_line(rtx, 512, "sdpa")
    assert graph[10] == "40.9" and graph[11] == "60%"
    assert "max abs logit diff" in h100


def test_projections_are_separate_and_labelled(fixture_report):
    _, text = fixture_report
    head, _, projected = text.partition("## PROJECTED")
    assert projected, "no projection section"
    measured_part = head
    for name in ("Jetson AGX Orin 64GB", "H200 SXM"):  # table devices without results
        assert name in projected
        assert name not in measured_part
    for name in ("RTX 4060 Ti", "H100 SXM 80GB"):  # measured devices are not projected
        assert f"| {name} " not in projected
    orin = next([c.strip() for c in ln.strip("|").split("|")] for ln in projected.splitlines()
                if ln.startswith("| Jetson AGX Orin 64GB | 512 "))
    # F(512) = 2*P*512 + 2*128256*4096 + 2*32*32*512^2*128 = 7.21e12 FLOPs at 42 TFLOP/s = 172 ms, more than the
    # 4.15 GB of weights at 204.8 GB/s (20 ms): compute-bound.
    assert orin[2:4] == ["172", "compute"]


def test_side_by_side(fixture_report):
    _, text = fixture_report
    side = section(text, "## Side by side (measured)")
    cells = row_line(side, 1024, "llm_attn")
    assert cells[2:4] == ["441.00", "32.60"]  # RTX 4060 Ti, then H100 (ordered by peak)
    assert row_line(side, 4096, "sdpa")[2] == ""  # the 4060 Ti did not run 4096


def test_newest_row_wins_and_no_projection(tmp_path):
    shutil.copytree(FIXTURES, tmp_path / "res")
    h100 = tmp_path / "res" / "h100-80gb-hbm3" / "default.jsonl"
    rows = list(iter_rows(h100))
    redo = next(r for r in rows if r["kind"] == "ttft" and r["impl"] == "sdpa" and r["seq"] == 2048)
    redo = {**redo, "time": "2027-01-01T00:00:00+00:00", "samples_ms": [60.0] * 10,
            "stats": {**redo["stats"], "p50": 60.0, "p90": 60.0}}
    with open(h100, "a") as fh:
        fh.write(json.dumps(redo) + "\n")
        fh.write('{"not": "a result row"}\n')  # another tool's row: ignored, noted
        fh.write(json.dumps({**redo, "stats": None, "samples_ms": []}) + "\n")  # our format, broken: warned
    path = report_mod.write_report([tmp_path / "res"], tmp_path / "out", no_projection=True)
    text = path.read_text()
    assert row_line(section(text, "## NVIDIA H100 80GB HBM3 — measured"), 2048, "sdpa")[2] == "60.00"
    assert "PROJECTED" not in text
    assert "1 rows of another format ignored" in text
    assert f"1 {SCHEMA} rows skipped (they fail validation)" in text  # an old row, read as today's


def test_report_cli(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llm_attn.report", str(FIXTURES), "--out", str(tmp_path / "r"),
                           "--project", "jetson-agx-orin-64gb"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "r" / "report.md").read_text()
    assert "Jetson AGX Orin 64GB" in text and "H200 SXM" not in text

@pytest.mark.parametrize("bad_args, message", [
    (["nope"], "no such results file or folder"),
    (["empty"], "no result rows found"),
    ([str(FIXTURES), "--project", "tpu-v5"], "unknown devices ['tpu-v5']"),
])
def test_report_cli_errors(tmp_path, capsys, bad_args, message):
    (tmp_path / "empty").mkdir()
    args = [str(tmp_path / a) if a in ("nope", "empty") else a for a in bad_args]
    with pytest.raises(SystemExit) as e:
        report_mod.main([*args, "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and message in capsys.readouterr().err


# -- issue 35: a row's cells come from one run -------------------------------------------------------------------------
def _table(text: str, header_has: str) -> list[dict[str, str]]:
    """The lines of the first markdown table whose header contains ``header_has``, by column name."""
    header, out = None, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None and line.startswith("|") and header_has in line:
            header = cells
        elif header is not None and line.startswith("|") and not line.startswith("|--"):
            out.append(dict(zip(header, cells)))
        elif header is not None and not line.startswith("|"):
            break
    assert header is not None, f"no table with {header_has!r}"
    return out


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Issue 35's repro with the real CLIs on the CPU tiny model: run A pairs sdpa and llm_attn, the newer run B
    measures sdpa alone at the same point."""
    from llm_attn import ttft

    d = tmp_path_factory.mktemp("runs")
    fast = ["--device", "cpu", "--model", "tiny", "--seq", "32", "--measure", "ttft", "--warmup", "1", "--no-progress"]
    assert ttft.main([*fast, "--impl", "sdpa", "llm_attn", "--repeats", "4", "--out", str(d / "a.jsonl")]) == 0
    assert ttft.main([*fast, "--impl", "sdpa", "--repeats", "2", "--out", str(d / "b.jsonl")]) == 0
    return list(iter_rows(d / "a.jsonl")), list(iter_rows(d / "b.jsonl")), d


def test_report_never_mixes_runs_in_one_row(two_runs, tmp_path, capsys):
    a, b, d = two_runs
    run_a, run_b = a[0]["run_id"], b[0]["run_id"]
    assert run_a != run_b
    assert report_mod.main([str(d / "a.jsonl"), str(d / "b.jsonl"), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    text = (tmp_path / "r" / "report.md").read_text()
    lines = _table(section(text, "## cpu — measured"), "vs sdpa (>1 = faster)")
    # Each run's rows are shown, with the run they come from.
    got = {(x["run"], x["impl"]): x for x in lines}
    assert set(got) == {(run_a, "sdpa"), (run_a, "llm_attn"), (run_b, "sdpa")}
    p50 = {(r["run_id"], r["impl"]): r["stats"]["p50"] for r in a + b}
    for key, line in got.items():
        assert line["TTFT p50 ms"] == f"{p50[key]:.2f}"
    # llm_attn's vs cell is its own run's paired verdict, and its ratio is run A's sdpa p50 / run A's llm_attn p50
    # (the paired ratio of medians), never run B's sdpa.
    iv = next(r for r in a if r["impl"] == "llm_attn")["vs"]["sdpa"]
    cell = got[(run_a, "llm_attn")]["vs sdpa (>1 = faster)"]
    assert cell == format_ratio_interval(iv)
    assert iv["ratio"] == pytest.approx(p50[(run_a, "sdpa")] / p50[(run_a, "llm_attn")])
    # One line says which runs were kept and why, in the report and on stderr.
    note = f"runs {', '.join(sorted([run_a, run_b]))} both measured cpu, tiny (fp32, float32), batch 1, seq 32"
    assert note in text and note in err and "each run's rows are shown apart" in text


def test_a_newer_run_that_remeasured_everything_replaces_the_older_one(two_runs, tmp_path):
    a, b, _ = two_runs
    # Run C: the same command as run A again, later (its rows, with a new run id and time).
    c = [{**r, "run_id": "c0ffee000000", "time": "2099-01-01T00:00:00+00:00"} for r in a]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a + b + c))
    rows, notes = load_rows([tmp_path / "c.jsonl"])
    assert {r["run_id"] for r in rows} == {"c0ffee000000"}  # C covers both A's and B's points: only C is shown
    note = next(n for n in notes if "kept run c0ffee000000" in n)
    assert a[0]["run_id"] in note and b[0]["run_id"] in note and "re-measured every point" in note
    text = report_mod.write_report([tmp_path / "c.jsonl"], tmp_path / "r").read_text()
    assert "| run " not in text.split("### Runs")[1].split("## cpu")[1]  # one run left: no run column
    assert "kept run c0ffee000000" in text


def test_runs_with_and_without_prompts_are_other_configurations(two_runs, tmp_path):
    """Text prompts (``--prompts``) are another configuration than seeded random ids: a newer --prompts run neither
    replaces nor mixes with the random-id rows; it gets its own table."""
    a, _, _ = two_runs
    prompted = [{**r, "run_id": "beef00000000", "time": "2099-01-01T00:00:00+00:00",
                 "prompts": {"source": "/data/prompts.jsonl", "field": None, "texts": 4},
                 "stats": {**r["stats"], "p50": 1.0}} for r in a]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a + prompted))
    text = report_mod.write_report([tmp_path / "p.jsonl"], tmp_path / "r").read_text()
    plain = _table(section(text, "### tiny (fp32, float32), batch 1"), "TTFT p50 ms")
    with_prompts = _table(section(text, "### tiny (fp32, float32), prompts prompts.jsonl, batch 1"), "TTFT p50 ms")
    assert {x["TTFT p50 ms"] for x in with_prompts} == {"1.00"}
    assert "1.00" not in {x["TTFT p50 ms"] for x in plain} and len(plain) == len(with_prompts) == 2


# -- issue 35 item 6: plots whose titles and tick labels can be read ---------------------------------------------------
def _check_layout(fig, problems: list[str], name: str) -> None:
    """Every title, axis label and tick label inside the figure, and no two tick labels of an axis overlapping."""
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
            lo, hi = (ax.get_xlim() if axis is ax.xaxis else ax.get_ylim())
            labels = [t for t in labels if min(lo, hi) <= (t.get_position()[0] if axis is ax.xaxis
                                                           else t.get_position()[1]) <= max(lo, hi)]
            texts += labels
            ext = [t.get_window_extent(renderer) for t in labels]
            for i in range(len(ext)):
                for j in range(i + 1, len(ext)):
                    if ext[i].overlaps(ext[j]):
                        problems.append(f"{name}: tick labels {labels[i].get_text()!r} and {labels[j].get_text()!r} "
                                        f"overlap")
    for t in texts:
        if not t.get_text():
            continue
        e = t.get_window_extent(renderer)
        if e.x0 < box.x0 - 1 or e.x1 > box.x1 + 1 or e.y0 < box.y0 - 1 or e.y1 > box.y1 + 1:
            problems.append(f"{name}: {t.get_text()!r} is cut off at the figure's edge")


@pytest.mark.parametrize("results, extra", [
    (REPO / "experiments" / "results", {"experiment": "default"}),  # the committed example report's inputs
    (FIXTURES, {}),  # two devices and projections
])
def test_plots_titles_and_tick_labels_fit(results, extra, tmp_path, monkeypatch):
    import matplotlib.figure

    problems, saved = [], []
    real = matplotlib.figure.Figure.savefig

    def checked(fig, path, *args, **kwargs):
        real(fig, path, *args, **kwargs)  # lays the figure out as saved
        saved.append(Path(path).name)
        _check_layout(fig, problems, Path(path).name)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", checked)
    report_mod.write_report([results], tmp_path / "r", **extra)
    assert {"ttft_vs_seq.png", "speedup.png", "decode_tok_s.png"} <= set(saved)
    assert problems == []


def test_runs_of_the_same_second_are_both_shown(two_runs):
    """Rows carry whole-second times: two runs that finished in the same second cannot be ordered, so neither
    replaces the other (the repro's two CLI runs on a fast machine often end in one second; the report then kept
    run A and dropped B, or the other way round)."""
    from llm_attn.reporting.merge import _drop_superseded_runs

    a, b, _ = two_runs
    same = a[0]["time"]
    rows = [dict(r, time=same) for r in a + b]
    kept, _ = _drop_superseded_runs(rows, {a[0]["run_id"]: {"a.jsonl"}, b[0]["run_id"]: {"b.jsonl"}})
    assert {r["run_id"] for r in kept} == {a[0]["run_id"], b[0]["run_id"]}
    assert len(kept) == len(rows)

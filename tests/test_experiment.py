"""CPU tests of ``python -m llm_attn.experiment``: definitions, results under results/<device>/<name>.jsonl,
resumption after an interrupted sweep, and the report over a real (tiny-model) run.

    pytest tests/test_experiment.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_attn import experiment
from llm_attn.harness import sweep as sweep_mod
from llm_attn.harness.results import iter_rows, point_key, validate_row
from llm_attn.report import write_report

REPO = Path(__file__).resolve().parents[1]

SMALL = """
name = "{name}"
models = ["auto"]
impls = ["sdpa", "llm_attn"]
seqs = [16, 24]
batches = [1]
new_tokens = 3
warmup = 1
repeats = 2
decode_repeats = 1
"""


def write_def(tmp_path: Path, name: str = "tiny-sweep", text: str = SMALL) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text.format(name=name))
    return path


def test_shipped_definitions_parse():
    defs = {p.stem: experiment.load_experiment(p) for p in sorted((REPO / "experiments").glob("*.toml"))
            if p.name not in ("devices.toml", "published_references.toml")}  # data files, not definitions
    assert "default" in defs
    d = defs["default"]
    assert d.name == "default" and d.seqs == [512, 1024, 2048, 4096, 8192] and d.batches == [1]
    assert set(d.impls) == {"sdpa", "eager", "llm_attn"}
    assert d.repeats >= 10  # the issue asks for at least 10 repeats by default
    for name, e in defs.items():
        assert e.name == name  # the file name and the results file name agree


@pytest.mark.parametrize("extra, message", [
    ('seq = [16]\n', "unknown keys ['seq']"),
    ('impls = ["sdpa", "flash"]\n', "impls: unknown ['flash']"),
    ('dtypes = ["int4"]\n', "dtypes: unknown ['int4']"),
    ('repeats = 0\n', "repeats must be an integer >= 1"),
    ('new_tokens = 1\n', "new_tokens must be an integer >= 2"),
])
def test_bad_definitions_are_rejected(tmp_path, extra, message):
    text = "\n".join(ln for ln in SMALL.splitlines() if not ln.startswith(extra.split("=")[0].strip() + " "))
    path = write_def(tmp_path, text=text + "\n" + extra)
    with pytest.raises(ValueError) as e:
        experiment.load_experiment(path)
    assert message in str(e.value)


def test_bad_definition_values(tmp_path):
    for bad, message in ((SMALL.replace("seqs = [16, 24]", "seqs = [16, -1]"), "seqs must hold positive integers"),
                         (SMALL.replace('name = "{name}"', 'name = "Bad Name!"'), "name must be lower-case"),
                         (SMALL.replace("seqs = [16, 24]\n", ""), "missing required keys ['seqs']")):
        path = tmp_path / "bad.toml"
        path.write_text(bad.replace("{name}", "x"))
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            experiment.load_experiment(path)


def test_cli_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        experiment.main([str(tmp_path / "missing.toml")])
    assert e.value.code == 2 and "no such experiment file" in capsys.readouterr().err
    path = write_def(tmp_path, text=SMALL.replace("batches = [1]", "batches = [0]"))
    with pytest.raises(SystemExit) as e:
        experiment.main([str(path)])
    assert e.value.code == 2 and "batches must hold positive integers, got [0]" in capsys.readouterr().err
    path.write_text('name = "x"\nseqs = [16,\n')
    with pytest.raises(SystemExit) as e:
        experiment.main([str(path)])
    assert e.value.code == 2 and str(path) in capsys.readouterr().err


def test_dry_run_measures_nothing(tmp_path, capsys):
    path = write_def(tmp_path)
    # --device cpu: the CPU path on every machine ('auto' on a GPU would be the 8B AWQ model)
    assert experiment.main([str(path), "--results-dir", str(tmp_path / "res"), "--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "4 points" in out and str(tmp_path / "res" / "cpu" / "tiny-sweep.jsonl") in out
    assert not (tmp_path / "res").exists()


def test_cpu_results_go_outside_the_checkout_by_default(tmp_path, monkeypatch, capsys):
    """Issue 35 item 6: CPU runs (harness checks) left experiments/results/cpu/ untracked in the checkout."""
    monkeypatch.setenv("LLM_ATTN_CACHE", str(tmp_path / "cache"))
    assert experiment.main([str(write_def(tmp_path)), "--dry-run", "--device", "cpu"]) == 0
    assert f"results -> {tmp_path / 'cache' / 'results' / 'cpu' / 'tiny-sweep.jsonl'}" in capsys.readouterr().out
    from llm_attn.harness.experiments import DEFAULT_RESULTS, default_results_dir

    assert default_results_dir("h100-80gb-hbm3") == DEFAULT_RESULTS == REPO / "experiments" / "results"


def test_runner_resumes_an_interrupted_sweep_and_feeds_the_report(tmp_path, monkeypatch, capsys):
    path = write_def(tmp_path)
    res = tmp_path / "res"
    args = [str(path), "--results-dir", str(res), "--no-progress", "--device", "cpu"]
    out = res / "cpu" / "tiny-sweep.jsonl"

    real, calls = sweep_mod.measure_decode_static, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C in the middle of the second static-cache decode
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(sweep_mod, "measure_decode_static", interrupted)
    assert experiment.main(args) == 130
    first = list(iter_rows(out, strict=True))
    # paired TTFT of both impls @16 and @24, paired decode_generate @16 and @24, then Ctrl-C in the second warm-up
    # run of the paired decode_graph @16
    assert len(first) == 8
    assert "run the same command again" in capsys.readouterr().err

    monkeypatch.setattr(sweep_mod, "measure_decode_static", real)
    assert experiment.main(args) == 0
    rows = list(iter_rows(out, strict=True))
    assert rows[:8] == first
    # 2 impls x 2 lengths x 3 measurements + correctness at 2 lengths
    assert len(rows) == 14 and len({point_key(r) for r in rows}) == 14
    for r in rows:
        validate_row(r)
        assert r["experiment"] == "tiny-sweep" and r["status"] == "ok" and r["device"] == "cpu"
    assert "resumed: 8 measurements" in capsys.readouterr().out

    # A third run finds everything done and adds nothing.
    assert experiment.main(args) == 0
    assert len(list(iter_rows(out))) == 14

    report = write_report([res], tmp_path / "report")
    text = report.read_text()
    assert "## cpu — measured" in text and "llm_attn" in text
    assert (tmp_path / "report" / "ttft_vs_seq.png").stat().st_size > 0

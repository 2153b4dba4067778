"""CPU tests of ``python -m llm_attn.ttft``: the CLI end to end on the tiny model, the result schema, the
statistics, error rows (out of memory, failures), the crash-safe writer, and clear errors for bad arguments.

    pytest tests/test_ttft.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_attn import ttft
from llm_attn.harness import sweep as sweep_mod
from llm_attn.harness.results import ResultWriter, iter_rows, point_key, validate_row
from llm_attn.harness.stats import summarize

REPO = Path(__file__).resolve().parents[1]
# Small enough for two shared CPU cores: the tiny model, two short prompts, two repeats, four new tokens.
FAST = ["--seq", "16", "32", "--repeats", "2", "--warmup", "1", "--new-tokens", "4", "--decode-repeats", "2",
        "--no-progress"]
IMPLS = ["eager", "sdpa", "llm_attn"]
# The harness checks below run the tiny model on the CPU on every machine ('auto' on a GPU is the 8B AWQ model).
CPU = ["--device", "cpu"]


def rows_of(path) -> list[dict]:
    return list(iter_rows(path, strict=True))


# -- statistics -----------------------------------------------------------------------------------------------------
def test_summarize_known_values():
    s = summarize([float(x) for x in range(1, 11)])  # 1..10
    assert s["n"] == 10
    assert s["p50"] == pytest.approx(5.5)
    assert s["p90"] == pytest.approx(9.1)  # linear interpolation: 9 + 0.1 * (10 - 9)
    assert s["min"] == 1.0 and s["max"] == 10.0
    assert s["mean"] == pytest.approx(5.5)
    assert s["stdev"] == pytest.approx(3.0276503540974917)  # sample stdev, sqrt(82.5 / 9)
    assert s["stdev_pct"] == pytest.approx(100 * 3.0276503540974917 / 5.5)


def test_summarize_single_sample_and_bad_input():
    s = summarize([4.0])
    assert (s["p50"], s["p90"], s["stdev"], s["stdev_pct"]) == (4.0, 4.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        summarize([])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("nan")])
    with pytest.raises(ValueError, match="negative"):
        summarize([1.0, -2.0])


# -- the CLI end to end ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One real run of the CLI as users start it (a subprocess), shared by the checks below."""
    out = tmp_path_factory.mktemp("ttft") / "rows.jsonl"
    # On a GPU machine 'auto' would be the 8B AWQ model: these checks are of the CPU path, so ask for it there
    # (test_gpu_events_graph_and_kernel covers the GPU path). Without a GPU the command is exactly the users' one.
    cpu = CPU if torch.cuda.is_available() else []
    proc = subprocess.run([sys.executable, "-m", "llm_attn.ttft", *FAST, *cpu, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, out


def test_cli_exit_code_and_table(cli_run):
    proc, _ = cli_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "no GPU here" in out and "PyTorch reference, not the CUDA kernel" in out  # says it runs the CPU path
    for header in ("TTFT p50 ms", "vs sdpa", "notes", "greedy agreement"):
        assert header in out, header
    table_lines = [ln for ln in out.splitlines() if ln.startswith("|") and ("| 16 " in ln or "| 32 " in ln)]
    for impl in IMPLS:
        assert sum(f"| {impl} " in ln for ln in table_lines) >= 2, impl  # both lengths, and correctness for ours
    # Issue 35 item 5: the default table fits 120 columns (it was 329 here, 806 on a GPU); --wide has the rest.
    lines = out.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("| model"))
    summary = lines[first:next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))]
    assert len(summary) == 2 + 2 * len(IMPLS) and max(map(len, summary)) <= 120, "\n".join(summary)
    assert "p90 ms" not in out and "decode tok/s" not in out.split("(--wide")[0] and "--wide" in out


def test_wide_table_has_every_column_that_has_a_value(cli_run):
    from llm_attn.harness.compact import compact_table
    from llm_attn.harness.session import rows_tables

    _, out = cli_run
    rows = rows_of(out)
    wide = rows_tables(rows, wide=True)
    for header in ("TTFT p50 ms", "p90 ms", "stdev %", "vs sdpa", "vs eager", "decode tok/s (generate)",
                   "decode tok/s (graph)", "greedy agreement"):
        assert header in wide, header
    assert "peak GiB" not in wide and "graph % of BW bound" not in wide  # always empty on CPU: dropped
    assert rows_tables(rows).startswith(compact_table(rows))
    assert ttft.build_parser().parse_args(["--wide"]).wide
    long = [dict(r, model={**r["model"], "name": "/models/" + "x" * 80}) for r in rows]  # a local checkpoint path
    for r in long:
        if r.get("status") == "ok" and r["measurement"] == "ttft":
            r["host_bound"] = {"host_bound": True, "enqueue_share": 1.0, "gpu_span_share": 0.5}
            r["attention_calls"] = {"impl": 5, "stock_fallback": 95, "fallback_reasons": {}}
    table = compact_table(long)
    assert max(map(len, table.splitlines())) <= 120 and "…" in table, table


def test_quiet_by_default_and_verbose_with_v(cli_run, tmp_path, monkeypatch, capsys):
    """Issue 35 item 6: transformers' weight-loading bar (and gptqmodel's banner, datasets' bars) is held back unless
    -v; no third-party warning reaches a default run."""
    proc, _ = cli_run
    assert "Loading weights" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    monkeypatch.setenv("LLM_ATTN_VERBOSE", "0")  # restored after the test: -v sets it for this process
    assert ttft.main([*CPU, "-v", "--seq", "8", "--impl", "sdpa", "--measure", "ttft", "--repeats", "1", "--warmup",
                      "0", "--no-progress", "--out", str(tmp_path / "rows.jsonl")]) == 0
    assert "Loading weights" in capsys.readouterr().err


def test_the_cache_goes_by_the_name_the_forward_takes():
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache``; the old name warned on every run."""
    import warnings

    from transformers.utils.deprecation import deprecate_kwarg

    from llm_attn import models
    from llm_attn.harness.measure import cache_kwarg, prefill_first_token

    model, _ = models.load_model("tiny:fp16", "cpu", torch.float32)
    assert list(cache_kwarg(model, None)) == ["past_key_values"] or list(cache_kwarg(model, None)) == ["cache"]

    class Renamed(type(model)):  # the forward of transformers >= 5.24, on whichever transformers runs the test
        @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
        def forward(self, input_ids=None, cache=None, **kwargs):
            return super().forward(input_ids=input_ids, **cache_kwarg(super(), cache), **kwargs)

    model.__class__ = Renamed
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token, _ = prefill_first_token(model, ids)
    assert token.shape == (1,)


def test_cli_rows_schema_and_content(cli_run):
    proc, out = cli_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(out)
    # 3 impls x 2 lengths x (ttft, decode_generate, decode_graph) + correctness of eager and llm_attn against sdpa
    # per length (eager, a second stock implementation, is the rounding noise floor)
    assert len(rows) == 3 * 2 * 3 + 2 * 2
    assert len({point_key(r) for r in rows}) == len(rows)
    for r in rows:
        validate_row(r)
        assert r["status"] == "ok", r.get("error")
        assert r["env"]["device_type"] == "cpu" and r["env"]["torch"] == torch.__version__
        assert r["env"]["transformers"] and "git_sha" in r["env"] and r["env"]["hostname"]
        assert r["model"]["name"] and r["model"]["quant"] and r["model"]["model_bytes"] > 0
        assert r["command"].startswith("python -m llm_attn.ttft ")
    by = {(r["measurement"], r["impl"], r["seq"]): r for r in rows}
    for impl in IMPLS:
        for seq in (16, 32):
            t = by[("ttft", impl, seq)]
            assert len(t["samples_ms"]) == 2 and len(t["wall_samples_ms"]) == 2
            assert t["stats"]["p50"] == pytest.approx(statistics.median(t["samples_ms"]))
            assert t["stats"]["min"] == min(t["samples_ms"]) > 0
            assert t["model_flops"] > t["attention_flops"] > 0
            gen, graph = by[("decode_generate", impl, seq)], by[("decode_graph", impl, seq)]
            for d in (gen, graph):
                # 2 runs x (4 - 1) tokens: the first token belongs to TTFT and is not a decode sample
                assert len(d["samples_ms"]) == 2 * 3 and len(d["run_tpot_ms"]) == 2
                assert d["tok_s"] == pytest.approx(1e3 / d["tpot_ms"])
                assert d["bytes_per_token"]["total"] > d["bytes_per_token"]["weights"] > 0
                assert len(d["tokens"]) == 1 and len(d["tokens"][0]) == 4
            assert graph["mode"] == "static_cache_loop_no_graph"
            # The static-cache loop (rewound after its warm-up steps) decodes exactly what generate() decodes.
            assert graph["tokens"] == gen["tokens"]
            if impl == "llm_attn":
                for d in (t, gen, graph):
                    assert d["patch"]["native_calls"].get("reference", 0) > 0, d["patch"]
    for seq in (16, 32):
        c = by[("correctness", "llm_attn", seq)]
        assert c["reference_impl"] == "sdpa"
        assert c["max_abs_logit_diff"] < 1e-4  # float32 on CPU: reference attention vs SDPA
        assert c["greedy_agreement"] == 1.0 and c["first_divergence"] is None
        assert c["patch"]["native_calls"].get("reference", 0) > 0


def test_row_command_reproduces_the_point(cli_run, tmp_path, capsys):
    _, out = cli_run
    row = next(r for r in rows_of(out) if r["kind"] == "decode_graph" and r["impl"] == "llm_attn")
    args = shlex.split(row["command"])
    assert args[:3] == ["python", "-m", "llm_attn.ttft"]
    again = tmp_path / "again.jsonl"
    assert ttft.main(args[3:] + ["--out", str(again), "--no-progress"]) == 0
    # A paired point's command re-runs its pairing: one row per implementation paired with this one.
    new_rows = rows_of(again)
    assert sorted(r["impl"] for r in new_rows) == sorted(row["paired"]["impls"])
    new = next(r for r in new_rows if r["impl"] == row["impl"])
    assert point_key(new) == point_key(row)
    assert new["tokens"] == row["tokens"]  # same seeded prompt, same greedy tokens


def test_awq_int4_model_counts_packed_weights(tmp_path):
    """The int4 path users run: a real AWQ checkpoint through gptqmodel's loader. The decode bandwidth bound must
    count the packed int4 storage, not an fp16 model's bytes."""
    pytest.importorskip("gptqmodel")
    out = tmp_path / "rows.jsonl"
    assert ttft.main(["--model", "tiny:awq", "--impl", "sdpa", "--measure", "decode_graph", "--seq", "16",
                      "--new-tokens", "2", "--decode-repeats", "1", "--no-progress", "--out", str(out)]) == 0
    (row,) = rows_of(out)
    assert row["model"]["quant"] == "awq-int4" and row["model"]["awq_backend"].startswith("gptqmodel:")
    assert row["dtype"] == "float16"  # the int4 kernels compute in fp16: the CPU default follows the checkpoint
    # tiny: 2 layers x (512*64*(2*8 + 2*2) + 3*512*1536) = 6_029_312 int4 weights = 3_014_656 bytes, plus fp16
    # scales and int4 zeros per group of 128 (94_208 + 23_552), the fp16 LM head (1_048_576) and the norms.
    int4_bytes = 3_014_656 + 94_208 + 23_552 + 1_048_576 + 5 * 512 * 2
    assert row["bytes_per_token"]["weights"] == pytest.approx(int4_bytes, rel=0.01)


# -- error rows -----------------------------------------------------------------------------------------------------
def _failing_measure(exc_for_seq: dict):
    real = sweep_mod.measure_ttft_paired  # TTFT is measured paired (all implementations of a point together)

    def measure(model, prompt, *a, **kw):
        exc = exc_for_seq.get(prompt.shape[1])
        if exc is not None:
            raise exc
        return real(model, prompt, *a, **kw)

    return measure


def test_oom_point_is_recorded_and_sweep_continues(tmp_path, monkeypatch, capsys):
    # A CPU cannot run out of GPU memory: inject the exception torch raises, at one point only.
    monkeypatch.setattr(sweep_mod, "measure_ttft_paired",
                        _failing_measure({32: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")}))
    out = tmp_path / "rows.jsonl"
    code = ttft.main(["--impl", "sdpa", "--measure", "ttft", *FAST, *CPU, "--out", str(out)])
    assert code == 0  # out of memory is a result, not a failure
    rows = rows_of(out)
    assert [(r["seq"], r["kind"], r["status"]) for r in rows] == [(16, "ttft", "ok"), (32, "error", "oom")]
    err = rows[1]
    validate_row(err)
    assert err["measurement"] == "ttft" and err["error"]["type"] == "OutOfMemoryError"
    assert "Tried to allocate" in err["error"]["message"]
    assert "OOM" in capsys.readouterr().out


def test_failing_point_gives_error_row_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_mod, "measure_ttft_paired", _failing_measure({16: RuntimeError("kernel exploded")}))
    out = tmp_path / "rows.jsonl"
    code = ttft.main(["--impl", "sdpa", "--measure", "ttft", *FAST, *CPU, "--out", str(out)])
    assert code == 1
    rows = rows_of(out)
    assert [(r["seq"], r["status"]) for r in rows] == [(16, "error"), (32, "ok")]
    assert rows[0]["error"]["message"] == "kernel exploded" and "Traceback" in rows[0]["error"]["traceback"]
    assert "FAILED" in capsys.readouterr().out


def test_ctrl_c_keeps_finished_rows_and_resume_completes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["--impl", "sdpa", "llm_attn", "--measure", "ttft", "decode_generate", *FAST, *CPU, "--out", str(out)]
    real, calls = sweep_mod.measure_decode_generate, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(sweep_mod, "measure_decode_generate", interrupted)
    assert ttft.main(args) == 130
    first = rows_of(out)
    # paired TTFT first (both implementations per length), then paired decode @16 (a warm-up run each, then 2
    # repeats of both: 6 runs); Ctrl-C in the second warm-up run @32
    assert [(r["impl"], r["seq"], r["kind"]) for r in first] == [
        ("sdpa", 16, "ttft"), ("llm_attn", 16, "ttft"), ("sdpa", 32, "ttft"), ("llm_attn", 32, "ttft"),
        ("sdpa", 16, "decode_generate"), ("llm_attn", 16, "decode_generate")]
    assert first[-1]["paired"]["impls"] == ["sdpa", "llm_attn"] and len(first[-1]["run_tpot_ms"]) == 2
    monkeypatch.setattr(sweep_mod, "measure_decode_generate", real)
    assert ttft.main(args + ["--resume"]) == 0
    rows = rows_of(out)
    assert rows[:6] == first  # nothing finished was measured again
    assert len(rows) == 8 and len({point_key(r) for r in rows}) == 8
    assert "6 measurements already in" in capsys.readouterr().out


# -- the writer -----------------------------------------------------------------------------------------------------
def test_writer_survives_a_row_cut_by_a_crash(tmp_path):
    path = tmp_path / "rows.jsonl"
    with ResultWriter(path) as w:
        w.write({"a": 1, "x": float("nan")})
    with open(path, "a") as fh:
        fh.write('{"a": 2, "cut')  # a kill in the middle of a write
    with ResultWriter(path) as w:  # moves the cut row to rows.jsonl.corrupt before appending
        w.write({"a": 3, "dtype": torch.float16})
    assert [r["a"] for r in iter_rows(path, strict=True)] == [1, 3]
    assert list(iter_rows(path))[0]["x"] is None  # NaN is not JSON; a missing number must not look measured
    assert list(iter_rows(path))[1]["dtype"] == "torch.float16"
    assert (tmp_path / "rows.jsonl.corrupt").read_text() == '{"a": 2, "cut\n'
    assert json.loads(path.read_text().splitlines()[-1]) == {"a": 3, "dtype": "torch.float16"}


# -- bad arguments --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--seq", "0"], "--seq: must be a positive integer, got 0"),
    (["--seq", "-5"], "--seq: must be a positive integer, got -5"),
    (["--seq", "abc"], "--seq: must be a positive integer, got 'abc'"),
    (["--batch", "0"], "--batch: must be a positive integer"),
    (["--impl", "bogus"], "--impl: invalid choice: 'bogus'"),
    (["--impl", "flash_attention_2", "--device", "cpu"], "flash_attention_2 needs a CUDA GPU"),
    (["--impl", "sdpa", "sdpa"], "lists an implementation twice"),
    (["--model", "/nonexistent/llama-3-8b-awq"], "--model /nonexistent/llama-3-8b-awq: no such file or directory"),
    (["--model", "no-such-preset"], "not a preset"),
    (["--repeats", "0"], "--repeats: must be a positive integer"),
    (["--warmup", "-1"], "--warmup: must be an integer >= 0"),
    (["--new-tokens", "1"], "--new-tokens: must be >= 2"),
    (["--dtype", "int8"], "--dtype: invalid choice"),
    (["--measure", "everything"], "--measure: invalid choice"),
    (["--context", "0"], "--context: must be a positive integer"),
    (["--context", "4096", "--measure", "ttft"], "--context sets decode_graph's KV length"),
    (["--context", "16", "--seq", "32", "--measure", "decode_graph"],
     "--context 16 is shorter than the longest prompt"),
    (["--model", "tiny", "--device", "cpu", "--seq", "16", "--context", "100000", "--measure", "decode_graph"],
     "--context 100000: longer than the model allows"),
])
def test_bad_arguments_exit_2_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        ttft.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is not None,
                    reason="checks the message on a GPU machine without the flash_attn package")
def test_flash_attention_2_without_flash_attn(capsys):
    with pytest.raises(SystemExit) as e:
        ttft.main(["--impl", "flash_attention_2"])
    assert e.value.code == 2
    assert "flash_attention_2 needs the flash_attn package" in capsys.readouterr().err


def test_seq_longer_than_the_model_allows(capsys, tmp_path):
    from llm_attn.models import load_model, max_seq_len

    # The tiny CPU model on every machine ('auto' on a GPU is the 8B AWQ checkpoint).
    model, _ = load_model("auto", device="cpu", dtype=torch.float32)
    limit = max_seq_len(model)
    with pytest.raises(SystemExit) as e:
        ttft.main(["--device", "cpu", "--seq", str(limit + 1), "--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2
    assert f"--seq {limit + 1}: longer than the model allows ({limit} positions)" in capsys.readouterr().err
    # Fits as a prompt, but not with the decoded tokens after it.
    with pytest.raises(SystemExit) as e:
        ttft.main(["--device", "cpu", "--seq", str(limit), "--new-tokens", "4", "--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2
    assert f"seq + --new-tokens = {limit + 4} positions" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()  # nothing measured, nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        ttft.main(["--device", "cuda"])
    assert e.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err


def test_real_cli_bad_argument_exit_code():
    proc = subprocess.run([sys.executable, "-m", "llm_attn.ttft", "--seq", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "--seq: must be a positive integer, got 0" in proc.stderr


# -- on a GPU -------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_events_graph_and_kernel(tmp_path, capsys):
    """CUDA events, peak memory, CUDA-graph decode and our kernel, on the tiny fp16 preset (fast to load, and
    needs no AWQ backend)."""
    from llm_attn import kernel_available

    out = tmp_path / "rows.jsonl"
    code = ttft.main(["--model", "tiny:fp16", "--device", "cuda", "--dtype", "float16", "--impl", "sdpa", "eager",
                      "llm_attn", "--seq", "64", "200", "--repeats", "3", "--warmup", "2", "--new-tokens", "8",
                      "--decode-repeats", "2", "--no-progress", "--out", str(out)])
    rows = rows_of(out)
    assert code == 0, [r["error"] for r in rows if r["status"] != "ok"]
    assert len(rows) == 3 * 2 * 3 + 2 * 2  # correctness: eager (the stock floor) and llm_attn against sdpa
    by = {(r["measurement"], r["impl"], r["seq"]): r for r in rows}
    for r in rows:
        validate_row(r)
        assert r["env"]["compute_capability"] and r["env"]["sms"] > 0 and r["env"]["device_type"] == "cuda"
    for impl in ("sdpa", "eager", "llm_attn"):
        for seq in (64, 200):
            t, gen, graph = (by[(k, impl, seq)] for k in ("ttft", "decode_generate", "decode_graph"))
            assert t["timer"] == "cuda_event" and t["peak_mem_bytes"] > 0 and len(t["samples_ms"]) == 3
            if impl == "eager":
                # Stock eager attention builds its mask with a host tensor: CUDA-graph capture refuses it. That is
                # recorded as "unsupported" (not a failed run), with the reason.
                assert graph["status"] == "unsupported" and "CUDA graph" in graph["error"]["message"], graph
                continue
            assert graph["mode"] == "cuda_graph" and graph["timer"] == "cuda_event"
            assert len(graph["samples_ms"]) == 2 * 7
            # Replaying the graph decodes (nearly) what generate decodes; fp16 reductions over a static cache
            # may flip a near-tie of the random model, never most tokens.
            same = sum(a == b for a, b in zip(graph["tokens"][0], gen["tokens"][0]))
            assert same >= 6, (graph["tokens"], gen["tokens"])
            if impl == "llm_attn" and kernel_available():
                assert t["patch"]["native_calls"].get("cuda", 0) > 0, t["patch"]
    for seq in (64, 200):
        for impl in ("eager", "llm_attn"):
            c = by[("correctness", impl, seq)]
            assert c["max_abs_logit_diff"] < 0.1 and c["greedy_agreement"] >= 0.5, c


# -- bad --out: a clear message and exit status 2, never a traceback -----------------------------------------------
BAD_OUTS = {
    "directory": (lambda tmp: tmp, "is a directory"),
    "under a file": (lambda tmp: (tmp / "afile").joinpath("rows.jsonl"), "is not a directory"),
}


def _bad_out(kind, tmp_path):
    (tmp_path / "afile").write_text("x")
    make, message = BAD_OUTS[kind]
    return str(make(tmp_path)), message


@pytest.mark.parametrize("kind", list(BAD_OUTS))
def test_ttft_bad_out_is_refused_before_the_run(kind, tmp_path, capsys):
    out, message = _bad_out(kind, tmp_path)
    with pytest.raises(SystemExit) as e:
        ttft.main([*CPU, *FAST, "--out", out])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out}: " in err and message in err and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to simulate a full disk")
def test_cli_full_disk_exits_2_with_a_message():
    """The real CLI writing to /dev/full (every write fails with ENOSPC) after measuring one point."""
    proc = subprocess.run([sys.executable, "-m", "llm_attn.ttft", "--device", "cpu", "--seq", "16", "--repeats", "1",
                           "--warmup", "0", "--impl", "sdpa", "--measure", "ttft", "--no-progress", "--out",
                           "/dev/full"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot write results to /dev/full: No space left on device" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_result_writer_reports_output_errors(tmp_path):
    from llm_attn.harness.results import OutputWriteError

    with pytest.raises(OutputWriteError, match="cannot write results to"):
        ResultWriter(tmp_path)
    if os.path.exists("/dev/full"):
        w = ResultWriter("/dev/full")
        with pytest.raises(OutputWriteError, match="No space left on device"):
            w.write({"a": 1})


@pytest.mark.parametrize("kind", list(BAD_OUTS))
def test_experiment_report_bench_bad_out(kind, tmp_path, capsys):
    from llm_attn import bench, experiment, report

    out, message = _bad_out(kind, tmp_path)
    definition = tmp_path / "x.toml"
    definition.write_text('name = "x"\nmodels = ["auto"]\nimpls = ["sdpa"]\nseqs = [16]\n')
    results_dir = out
    if kind == "directory":  # --results-dir is a folder: make the results file in it a directory instead
        results_dir = str(tmp_path / "res")
        (tmp_path / "res" / "cpu" / "x.jsonl").mkdir(parents=True)
    calls = [(experiment.main, [str(definition), "--device", "cpu", "--results-dir", results_dir]),
             (bench.main, ["--out", out])]
    if kind == "under a file":
        calls.append((report.main, [str(REPO / "tests" / "fixtures"), "--out", str(tmp_path / "afile")]))
    for main, args in calls:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2, (main, args)
        err = capsys.readouterr().err
        assert ("directory" in err or "exists" in err) and "Traceback" not in err, err


def test_report_full_disk(tmp_path, monkeypatch, capsys):
    import errno

    from llm_attn import report

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "r" / "report.md"))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(SystemExit) as e:
        report.main([str(REPO / "tests" / "fixtures"), "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "No space left on device" in capsys.readouterr().err


def test_decode_graph_at_a_longer_context(tmp_path, capsys):
    """--context: decode_graph with the cache filled to N tokens after a short prompt. Ours and stock sdpa decode the
    same tokens over the same cache, ours natively; the KV length is in the row, the table and the resume key."""
    out = tmp_path / "ctx.jsonl"
    args = ["--model", "tiny", "--impl", "sdpa", "llm_attn", "--seq", "16", "--context", "150", "--measure",
            "decode_graph", "--new-tokens", "6", "--decode-repeats", "2", *CPU, "--out", str(out), "--no-progress"]
    assert ttft.main(args) == 0
    assert "decode_graph at KV 150" in capsys.readouterr().out
    rows = {r["impl"]: r for r in map(json.loads, out.read_text().splitlines())}
    for r in rows.values():
        assert r["status"] == "ok" and r["context"] == 150 and r["kv_len"] == 150 and r["context_filled"]
        assert "--context 150" in r["command"]
    assert rows["llm_attn"]["tokens"] == rows["sdpa"]["tokens"]
    assert rows["llm_attn"]["attention_calls"]["stock_fallback"] == 0
    # Bytes per step count the 150-token cache, not the 16-token prompt.
    short = tmp_path / "short.jsonl"
    assert ttft.main([a for a in args if a not in ("--context", "150")][:-3] + ["--out", str(short),
                                                                                 "--no-progress"]) == 0
    base = json.loads(short.read_text().splitlines()[0])
    assert rows["sdpa"]["bytes_per_token"]["kv_cache"] > 5 * base["bytes_per_token"]["kv_cache"]
    # Resuming finds the point; another context is another point.
    assert ttft.main(args + ["--resume"]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert ttft.main([*args[:8], "300", *args[9:], "--resume"]) == 0
    assert len(out.read_text().splitlines()) == 4


def test_several_contexts_in_one_run(tmp_path, capsys):
    """--context N1 N2: one decode_graph point per context, TTFT once (it does not depend on the context), a table
    per context; a context shorter than the prompt is still refused."""
    out = tmp_path / "ctx.jsonl"
    args = ["--model", "tiny", "--impl", "llm_attn", "--seq", "16", "--context", "100", "200", "--measure", "ttft",
            "decode_graph", "--new-tokens", "4", "--decode-repeats", "1", "--repeats", "1", "--warmup", "0", *CPU,
            "--out", str(out), "--no-progress"]
    assert ttft.main(args) == 0
    printed = capsys.readouterr().out
    assert "--context 100:" in printed and "--context 200:" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["measurement"], r.get("context")) for r in rows) == [
        ("decode_graph", 100), ("decode_graph", 200), ("ttft", None)]
    assert {r["kv_len"] for r in rows if r["measurement"] == "decode_graph"} == {100, 200}
    with pytest.raises(SystemExit):
        ttft.main([*args[:7], "8", "100", *args[9:]])
    assert "--context 8 is shorter than the longest prompt" in capsys.readouterr().err

"""CPU tests of prompts from a dataset (issue 18 item 8) as the command lines use them: the synthetic checkpoints'
offline tokenizer, ``python -m llm_attn.ttft --prompts`` (cut or repeated to --seq) and ``--seq dataset`` end to end
on the tiny model, bad --prompts input (exit 2, one line), and the experiment TOML's ``prompts`` keys.

    pytest tests/test_prompts_cli.py
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("datasets", reason="--prompts needs the optional 'datasets' package (the 'prompts' extra)")
pytest.importorskip("tokenizers", reason="the offline tokenizer needs the 'tokenizers' package")

from transformers import AutoTokenizer  # noqa: E402

from llm_attn import ttft  # noqa: E402
from llm_attn.harness.experiments import load_experiment  # noqa: E402
from llm_attn.harness.results import iter_rows, validate_row  # noqa: E402
from llm_attn.models.presets import PRESETS  # noqa: E402
from llm_attn.models.synthetic import cached_checkpoint  # noqa: E402
from llm_attn.models.tokenizer import (  # noqa: E402
    TOKENIZER_FILE,
    ensure_offline_tokenizer,
    write_offline_tokenizer,
)
from llm_attn.reporting.document import write_report  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Time to first token is dominated by the prefill of the prompt, layer after layer.",
         "Ünïcödé and emoji 🙂 tokenize too: the tokenizer is byte-level.",
         "short"]
FAST = ["--device", "cpu", "--model", "tiny", "--impl", "sdpa", "llm_attn", "--measure", "ttft", "--repeats", "2",
        "--warmup", "1", "--no-progress"]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    return path


def test_tiny_checkpoint_tokenizer_loads_and_round_trips():
    path = cached_checkpoint("tiny", "fp16")  # the cache the CLIs use; adds the tokenizer if it was missing
    assert (path / TOKENIZER_FILE).is_file()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    p = PRESETS["tiny"]
    assert (tok.bos_token_id, tok.eos_token_id) == (p.bos_token_id, p.eos_token_id)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids and max(ids) < p.vocab_size
        assert tok.decode(ids) == text


def test_llama_ids_of_bos_and_eos(tmp_path):
    p = PRESETS["llama-3-8b"]
    write_offline_tokenizer(tmp_path, p.vocab_size, bos_token_id=p.bos_token_id, eos_token_id=p.eos_token_id)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)
    assert tok.convert_ids_to_tokens([128000, 128001]) == ["<s>", "</s>"]
    ids = tok(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert max(ids) < 128000 and tok.decode(ids) == TEXTS[1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_offline_tokenizer(tmp_path / "bad", 1024, bos_token_id=5000, eos_token_id=5001)


def test_cached_checkpoint_without_tokenizer_gets_one_and_keeps_its_weights(tmp_path):
    path = cached_checkpoint("tiny", "fp16", cache_dir=tmp_path)
    weights = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in path.glob("*.safetensors")}
    for name in (TOKENIZER_FILE, "tokenizer_config.json"):
        (path / name).unlink()  # as cached before checkpoints carried a tokenizer
    assert cached_checkpoint("tiny", "fp16", cache_dir=tmp_path) == path
    assert (path / TOKENIZER_FILE).is_file()
    assert {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in path.glob("*.safetensors")} == weights
    assert not ensure_offline_tokenizer(path, 1024)  # present: nothing written


def test_ttft_prompts_cut_or_repeated_to_seq(jsonl, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert ttft.main([*FAST, "--seq", "24", "--batch", "2", "--prompts", str(jsonl), "--prompt-field", "body",
                      "--out", str(out)]) == 0
    rows = list(iter_rows(out, strict=True))
    assert {r["impl"] for r in rows} == {"sdpa", "llm_attn"} and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["prompts"]["source"] == str(jsonl) and r["prompts"]["field"] == "body"
        assert r["prompts"]["seq_mode"] == "cut_or_repeat" and r["prompts"]["texts"] == 2
        assert f"--prompts {jsonl}" in r["command"] and r["seq"] == 24 and r["batch"] == 2
    assert "vs sdpa" in capsys.readouterr().out


def test_ttft_prompt_batch_is_the_tokenized_text():
    from llm_attn.harness.prompts import prompt_batch

    tok = AutoTokenizer.from_pretrained(str(cached_checkpoint("tiny", "fp16")), local_files_only=True)
    ids = tok(TEXTS[3], add_special_tokens=False)["input_ids"]
    batch = prompt_batch(tok, TEXTS[3:], 1, 3 * len(ids) + 1, 1024)
    assert batch[0].tolist() == (ids * 4)[:3 * len(ids) + 1]  # repeated end to end, then cut


def test_ttft_seq_dataset_reports_p50_and_p90(jsonl, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert ttft.main([*FAST, "--seq", "dataset", "--prompts", str(jsonl), "--out", str(out)]) == 0
    rows = list(iter_rows(out, strict=True))
    assert [r["measurement"] for r in rows] == ["ttft_dataset", "ttft_dataset"]
    tok = AutoTokenizer.from_pretrained(str(cached_checkpoint("tiny", "fp16")), local_files_only=True)
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    for r in rows:
        assert r["lengths"] == lengths and r["length_distribution"]["count"] == len(TEXTS)
        assert len(r["samples_ms"]) == len(TEXTS) and r["stats"]["p90"] >= r["stats"]["p50"] > 0
        assert r["prompts"]["seq_mode"] == "dataset" and r["seq"] == max(lengths)
    assert rows[1]["vs"]["sdpa"]["n"] == len(TEXTS)  # paired prompt by prompt
    text = capsys.readouterr().out
    assert "TTFT over the dataset's own prompt lengths" in text and "TTFT p90 ms" in text
    for r in rows:
        validate_row(r)
    report = write_report([out], tmp_path / "report").read_text()  # the report has the same table
    section = report[report.index("### TTFT over the dataset's own prompt lengths"):]
    ours = next(line for line in section.splitlines() if "| llm_attn" in line)
    assert f"{rows[1]['stats']['p50']:.2f}" in ours and f"{rows[1]['stats']['p90']:.2f}" in ours


@pytest.mark.parametrize("extra, message", [
    (["--seq", "8", "--prompts", "/no/such/prompts.jsonl"], "--prompts /no/such/prompts.jsonl: no such file"),
    (["--seq", "8", "--prompts", "{bad}"], "unsupported file type '.txt'"),
    (["--seq", "8", "--prompts", "{jsonl}", "--prompt-field", "nope"], "no column 'nope'"),
    (["--seq", "8", "--prompts", "{broken}"], "cannot load it as a dataset offline"),
    (["--seq", "dataset"], "--seq dataset needs --prompts"),
    (["--seq", "8", "dataset", "--prompts", "{jsonl}"], "cannot be combined"),
    (["--seq", "8", "--prompt-field", "text"], "--prompt-field needs --prompts"),
    (["--seq", "dataset", "--prompts", "{jsonl}", "--measure", "decode_generate"], "measures TTFT only"),
    (["--seq", "dataset", "--prompts", "{jsonl}", "--resume"], "--resume is not supported"),
])
def test_bad_prompts_exit_2_with_one_line(extra, message, jsonl, tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_text("hello\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    extra = [a.format(jsonl=jsonl, bad=bad, broken=broken) for a in extra]
    with pytest.raises(SystemExit) as e:
        ttft.main([*FAST, "--out", str(tmp_path / "rows.jsonl"), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert not any("loading model" in line for line in err)  # refused before the model loads


def test_prompts_without_datasets_names_the_extra(jsonl, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError, as when not installed
    with pytest.raises(SystemExit) as e:
        ttft.main([*FAST, "--seq", "8", "--prompts", str(jsonl), "--out", str(tmp_path / "rows.jsonl")])
    assert e.value.code == 2
    assert 'python -m pip install -e ".[prompts]"' in capsys.readouterr().err


def test_hub_id_without_datasets_names_the_package_and_the_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SystemExit) as e:
        ttft.main([*FAST, "--seq", "8", "--prompts", "allenai/c4", "--out", str(tmp_path / "rows.jsonl")])
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--prompts allenai/c4: not a local file or folder, so a hub dataset id" in err[0], err
    assert "'datasets' package" in err[0] and "local Hugging Face cache" in err[0]


def test_experiment_prompts_relative_to_the_toml(tmp_path, jsonl):
    (tmp_path / "defs").mkdir()
    (tmp_path / "defs" / "p.jsonl").write_text(jsonl.read_text())
    toml = tmp_path / "defs" / "e.toml"
    toml.write_text('name = "p"\nseqs = [16]\nprompts = "p.jsonl"\nprompt_field = "body"\n'
                    'measurements = ["ttft", "ttft_graph", "ttft_graph_static"]\n')
    exp = load_experiment(toml)
    assert exp.prompts == str(tmp_path / "defs" / "p.jsonl") and exp.prompt_field == "body"
    assert exp.measurements == ["ttft", "ttft_graph", "ttft_graph_static"]
    toml.write_text('name = "p"\nseqs = [16]\nprompt_field = "body"\n')
    with pytest.raises(ValueError, match="prompt_field needs prompts"):
        load_experiment(toml)


def test_experiment_cli_runs_with_prompts(tmp_path, jsonl):
    from llm_attn import experiment

    toml = tmp_path / "e.toml"
    toml.write_text(f'name = "p"\nmodel = "tiny"\nimpls = ["sdpa", "llm_attn"]\nseqs = [16]\nrepeats = 2\n'
                    f'warmup = 1\nmeasurements = ["ttft"]\nprompts = "{jsonl.name}"\nprompt_field = "body"\n')
    assert experiment.main([str(toml), "--device", "cpu", "--results-dir", str(tmp_path / "res"),
                            "--no-progress"]) == 0
    rows = [r for f in (tmp_path / "res").rglob("*.jsonl") for r in iter_rows(f, strict=True)]
    assert len(rows) == 2 and all(r["prompts"]["source"] == str(jsonl) for r in rows)

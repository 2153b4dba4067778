"""experiments/train_tiny_lm.py: a trained checkpoint the harness loads, with its tokenizer and held-out prompts."""

import importlib.util
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", ROOT / "experiments" / "train_tiny_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_is_by_path_and_skips_installed_packages(tmp_path):
    mod = _script()
    for rel in ("a.py", "pkg/b.py", "site-packages/x.py", "test/t.py", "empty.py"):
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("" if rel == "empty.py" else "x = 1\n")
    assert [f.relative_to(tmp_path).as_posix() for f in mod.corpus_files(tmp_path, 10 ** 6)] == ["a.py", "pkg/b.py"]
    assert mod.corpus_files(tmp_path, 7) == [tmp_path / "a.py"]  # the byte cap stops at a whole file
    picks = [mod.held_out(f"f{i}.py", 0.25) for i in range(400)]
    assert picks == [mod.held_out(f"f{i}.py", 0.25) for i in range(400)] and 0.15 < sum(picks) / 400 < 0.35


@pytest.mark.parametrize("bad, why", [(["--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
                                      (["--seq", "64", "--max-positions", "64"], "below --max-positions"),
                                      (["--steps", "0"], "--steps must be positive")])
def test_bad_arguments_are_one_line(bad, why, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--out", str(tmp_path / "m"), *bad])
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_trains_a_checkpoint_the_harness_loads(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py", "glob.py",
                 "colorsys.py", "keyword.py", "this.py", "numbers.py", "abc.py", "copy.py", "random.py"):
        if (stdlib / name).is_file():
            shutil.copy(stdlib / name, corpus / name)
    out = tmp_path / "tinylm"
    summary = _script().main(["--out", str(out), "--corpus", str(corpus), "--heldout-fraction", "0.3",
                              "--vocab", "320", "--prompt-min-chars", "2000", "--hidden", "64", "--intermediate", "128", "--layers", "1",
                              "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--max-positions", "256",
                              "--steps", "3", "--seq", "32", "--batch", "2", "--device", "cpu"])
    assert summary["files"]["training"] > 0 and summary["files"]["prompts"] > 0
    losses = summary["loss_nats_per_token"]
    assert all(0 < losses[k] < 10 for k in ("training", "held_out")), losses
    assert json.loads((out / "training.json").read_text())["steps"] == 3

    from llm_attn.harness.prompts import load_tokenizer, prompt_batch
    from llm_attn.models import load_model

    model, info = load_model(str(out), device="cpu", dtype=torch.float32)
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 1
    tok = load_tokenizer(out)
    texts = [json.loads(line)["text"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert len(texts) == summary["files"]["prompts"] and all(len(t) >= 2000 for t in texts)
    ids = prompt_batch(tok, texts, batch=2, seq=40, vocab_size=model.config.vocab_size)
    assert ids.shape == (2, 40)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()

"""CPU tests of prompts from a dataset (llm_attn.harness.prompts): a local jsonl through ``datasets``, the tiny
model's generated offline tokenizer, cut/repeat to a length, the dataset's own lengths, and bad sources.

    pytest tests/test_prompts.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

datasets = pytest.importorskip("datasets", reason="--prompts needs the optional 'datasets' package")

from llm_attn import models  # noqa: E402
from llm_attn.harness import prompts as P  # noqa: E402
from llm_attn.harness.impls import use_impl  # noqa: E402
from llm_attn.harness.paired import measure_ttft_paired  # noqa: E402

TEXTS = ["Time to first token is the prefill.", "Ünïcödé 漢字 and emoji 🙂 tokenize byte by byte.",
         "A much longer text about attention kernels, " * 20]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    vocab = models.get_preset("tiny").vocab_size
    path = P.write_offline_tokenizer(tmp_path_factory.mktemp("tok"), vocab)
    return P.load_tokenizer(path), vocab


@pytest.fixture
def jsonl(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS)) + "\n")
    return f


def test_generated_tokenizer_loads_and_round_trips(tiny_tokenizer):
    tok, vocab = tiny_tokenizer
    from transformers import AutoTokenizer

    assert len(tok) <= vocab and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for t in TEXTS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert max(ids) < vocab and tok.decode(ids) == t  # byte-level: lossless for any text
    assert isinstance(tok, type(AutoTokenizer.from_pretrained(tok.name_or_path)))


def test_jsonl_prompts_cut_and_repeat_then_measure(tiny_tokenizer, jsonl):
    tok, vocab = tiny_tokenizer
    texts = P.load_texts(str(jsonl))
    assert texts == TEXTS
    ids = P.prompt_batch(tok, texts, batch=3, seq=48, vocab_size=vocab)
    assert ids.shape == (3, 48) and ids.dtype == torch.long
    short = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert len(short) < 48 and ids[0, :len(short)].tolist() == short  # repeated until it fills the length
    assert ids[0, len(short):2 * len(short)].tolist() == short[:48 - len(short)][:len(short)]
    long = tok(TEXTS[2], add_special_tokens=False)["input_ids"]
    assert ids[2].tolist() == long[:48]  # cut
    model, _ = models.load_model("tiny:fp16", "cpu", torch.float32)
    got = measure_ttft_paired(model, ids[:1], ["sdpa", "llm_attn"], warmup=1, repeats=2, switch=use_impl)
    assert got["llm_attn"]["attention_calls"]["stock_fallback"] == 0 and got["sdpa"]["stats"]["n"] == 2


def test_dataset_mode_keeps_each_texts_length(tiny_tokenizer, jsonl):
    tok, _ = tiny_tokenizer
    prompts = P.dataset_prompts(tok, P.load_texts(str(jsonl)), max_seq=64)
    lens = [p.shape[1] for p in prompts]
    want = [min(64, len(tok(t, add_special_tokens=False)["input_ids"])) for t in TEXTS]
    assert lens == want and lens[2] == 64
    dist = P.length_distribution(prompts)
    assert dist["count"] == 3 and dist["max"] == 64 and dist["min"] == min(want)


def test_csv_and_parquet_and_text_field(tmp_path, tiny_tokenizer):
    ds = datasets.Dataset.from_dict({"body": TEXTS, "n": [1, 2, 3]})
    ds.to_csv(str(tmp_path / "p.csv"))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    for f in ("p.csv", "p.parquet"):
        assert P.load_texts(str(tmp_path / f)) == TEXTS  # the only string column
    assert P.load_texts(str(tmp_path / "p.parquet"), text_field="body", limit=2) == TEXTS[:2]


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "missing.jsonl", "no such file or folder"),
    (lambda d: (d / "x.txt").write_text("hi") and d / "x.txt", "unsupported file type '.txt'"),
    (lambda d: (d / "bad.jsonl").write_text("{not json\n") and d / "bad.jsonl", "cannot load it as a dataset"),
    (lambda d: (d / "nums.jsonl").write_text('{"n": 1}\n') and d / "nums.jsonl", "no text column"),
    (lambda d: "surely_not_a_cached_dataset_llm_attn", "is not in the local Hugging Face cache"),
    (lambda d: "org/surely_not_cached:test", "the hub dataset 'org/surely_not_cached' is not in the local"),
    (lambda d: (d / "empty.jsonl").write_text("") or d / "empty.jsonl", "the file is empty"),
])
def test_bad_prompts_source_is_one_line(tmp_path, make, message):
    src = str(make(tmp_path))
    with pytest.raises(P.PromptsError, match=message) as e:
        P.load_texts(src)
    assert "\n" not in str(e.value)


def test_checkpoint_without_tokenizer(tmp_path):
    with pytest.raises(P.PromptsError, match="has none that loads"):
        P.load_tokenizer(tmp_path)


def test_ttft_over_the_datasets_own_lengths(tiny_tokenizer, jsonl):
    from llm_attn.harness.paired import measure_ttft_over_prompts, paired_verdicts

    tok, _ = tiny_tokenizer
    prompts = P.dataset_prompts(tok, P.load_texts(str(jsonl)), max_seq=64)
    model, _ = models.load_model("tiny:fp16", "cpu", torch.float32)
    got = measure_ttft_over_prompts(model, prompts, ["sdpa", "llm_attn"], warmup=1, repeats=1, switch=use_impl)
    ours = got["llm_attn"]
    assert ours["lengths"] == [p.shape[1] for p in prompts] and len(ours["samples_ms"]) == 3
    assert ours["stats"]["p90"] >= ours["stats"]["p50"] > 0
    assert ours["attention_calls"]["stock_fallback"] == 0 and ours["attention_calls"]["impl"] == 3 * 2 * 2
    iv = paired_verdicts({"impl": "llm_attn", **ours}, ["sdpa"])["sdpa"]
    assert iv["n"] == 3 and iv["low"] <= iv["ratio"] <= iv["high"]

"""End-to-end agreement with stock (``llm_attn.harness.agreement``, the correctness measurement's third column) on
CPU: KL and token agreement on known inputs, the 99 % target verdict, the cap at the model's positions, and the
whole measurement on the tiny model (ours against stock: full agreement, KL at rounding level; a perturbed model:
flagged), also through ``python -m llm_attn.ttft --prompts``.

    pytest tests/test_agreement.py
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager

import pytest
import torch

from llm_attn.harness.agreement import (
    AGREEMENT_TOKENS,
    agreement_cells,
    agreement_fields,
    agreement_misses,
    continuation_tokens,
    forced_top1,
    kl_divergence,
    token_agreement,
)
from llm_attn.harness.impls import use_impl
from llm_attn.harness.measure import measure_correctness
from llm_attn.harness.sweep import correctness_table


def test_kl_of_known_distributions():
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    q = torch.tensor([[0.9, 0.1]], dtype=torch.float64).log()
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert float(kl_divergence(p, q)[0]) == pytest.approx(want, rel=1e-12)
    assert float(kl_divergence(p, p)[0]) == 0.0
    assert float(kl_divergence(q, p)[0]) != pytest.approx(want)  # the direction matters: KL(stock || impl)


def test_token_agreement_and_first_divergence():
    ref = torch.arange(64).view(1, 64).repeat(2, 1)
    assert token_agreement(ref, ref.clone()) == (1.0, None)
    other = ref.clone()
    other[1, 40] = -1
    agree, first = token_agreement(ref, other)
    assert agree == pytest.approx(127 / 128) and first == 40
    with pytest.raises(ValueError):
        token_agreement(ref, ref[:, :10])


def test_greedy_target_is_99_percent_over_64_tokens():
    ref = torch.arange(64).view(1, 64)
    one_off = ref.clone()
    one_off[0, 63] = -1  # 63 of 64: 98.4 %, below the target
    assert agreement_fields(ref, ref, None, None, 0)["greedy_target"]["met"]
    f = agreement_fields(ref, one_off, None, None, 0)
    assert f["greedy_agreement_64"] == pytest.approx(63 / 64) and not f["greedy_target"]["met"]
    row = {"measurement": "correctness", "status": "ok", "impl": "x", "reference_impl": "sdpa", "batch": 1,
           "seq": 8, **f}
    assert agreement_cells(row) == ["98.4% MISSED", ""]
    assert agreement_misses([row]) == ["MISS greedy agreement over the first 64 tokens: x vs sdpa at batch 1, seq 8: "
                                       "98.4% < 99% (first difference at token 63)"]
    assert agreement_cells({"greedy_agreement": 1.0}) == ["", ""]  # rows measured before the columns existed


def test_forced_top1_counts_flips_and_reads_them_against_stock_margins():
    # Stock's gaps between its first and second log-probability: 2.0, 0.1, 0.01, 3.0 nats (one row, 4 positions).
    ref = torch.tensor([[[0.0, -2.0, -9.0], [0.0, -0.1, -9.0], [-0.01, 0.0, -9.0], [-3.0, -9.0, 0.0]]],
                       dtype=torch.float64)
    same = forced_top1(ref, ref.clone())
    assert same == {"agreement": 1.0, "flips": 0, "positions": 4, "flip_margin_max": None, "flip_margin_share": None}
    other = ref.clone()
    other[0, 1] = torch.tensor([-0.1, 0.0, -9.0])  # flips the 0.1-nat position
    other[0, 2] = torch.tensor([0.0, -0.01, -9.0])  # and the 0.01-nat one
    f = forced_top1(ref, other)
    assert f["flips"] == 2 and f["agreement"] == pytest.approx(0.5)
    assert f["flip_margin_max"] == pytest.approx(0.1)
    assert f["flip_margin_share"] == pytest.approx(0.5)  # gaps 0.1 and 0.01 of the four are <= 0.1
    with pytest.raises(ValueError):
        forced_top1(ref, ref[:, :2])


def test_the_miss_line_carries_the_flips():
    ref_tok = torch.arange(64).view(1, 64)
    tok = ref_tok.clone()
    tok[0, 10:] = -1
    lp = torch.log_softmax(torch.randn(1, 70, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    lp2 = lp.clone()
    lp2[0, 6] = lp[0, 6].flip(-1)  # a different first token at one position
    f = agreement_fields(ref_tok, tok, lp, lp2, 6)
    assert f["top1_forced"]["flips"] == 1 and f["top1_forced"]["positions"] == 70
    row = {"measurement": "correctness", "status": "ok", "impl": "x", "reference_impl": "sdpa", "batch": 1,
           "seq": 8, **f}
    (line,) = agreement_misses([row])
    assert "teacher-forced, 1 top-1 flip in 70 positions, where stock's top-2 gap was <=" in line


class _Cfg:
    max_position_embeddings = 100


class _Model:
    config = _Cfg()


def test_continuation_is_capped_by_the_model_positions():
    assert continuation_tokens(_Model(), 10) == AGREEMENT_TOKENS
    assert continuation_tokens(_Model(), 60) == 40
    assert continuation_tokens(_Model(), 100) == 0


# -- the tiny model ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from llm_attn.models import load_model

    model, _ = load_model("tiny", device="cpu", dtype=torch.float32, attn_implementation="sdpa")
    return model


def _prompt(model, batch=2, seq=24):
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_ours_agrees_with_stock_on_the_tiny_model(tiny):
    ids = _prompt(tiny)
    r = measure_correctness(tiny, ids, 8, "sdpa", "llm_attn", use_impl)
    assert r["agreement_tokens"] == 64 and r["greedy_agreement_64"] == 1.0 and r["first_divergence_64"] is None
    assert r["greedy_target"]["met"]
    kl = r["logit_kl"]
    assert kl["positions"] == 24 + 64 and kl["prompt_positions"] == 24
    assert 0 <= kl["mean"] < 1e-9 and kl["max"] < 1e-8  # float32 model: rounding only
    assert r["top1_forced"]["flips"] == 0 and r["top1_forced"]["positions"] == 2 * (24 + 64)
    assert len(r["tokens_reference"][0]) == 8  # the existing column keeps --new-tokens
    json.dumps(r)


def test_a_perturbed_model_is_flagged(tiny):
    """A fake 'implementation' with a known, large error: the model's output head is perturbed while it is on."""
    @contextmanager
    def switch(model, name):
        with use_impl(model, "sdpa"):
            if name != "bad":
                yield None
                return
            w = model.lm_head.weight
            saved = w.detach().clone()
            with torch.no_grad():
                w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std() * 2)
            try:
                yield None
            finally:
                with torch.no_grad():
                    w.copy_(saved)

    ids = _prompt(tiny, batch=1)
    r = measure_correctness(tiny, ids, 8, "sdpa", "bad", switch)
    assert r["greedy_agreement_64"] < 0.99 and not r["greedy_target"]["met"]
    assert r["first_divergence_64"] is not None
    assert r["logit_kl"]["mean"] > 1e-3
    assert r["top1_forced"]["flips"] > 0 and r["top1_forced"]["agreement"] < 1
    row = {**r, "measurement": "correctness", "status": "ok", "impl": "bad", "batch": 1, "seq": 24,
           "model": {"name": "tiny"}, "dtype": "float32", "experiment": None, "model_spec": "tiny",
           "new_tokens": 8}
    text = correctness_table([row])
    assert "MISSED" in text and "MISS greedy agreement over the first 64 tokens: bad vs sdpa" in text
    assert "top-1 flip" in text


def test_correctness_through_the_cli_on_prompts(tmp_path, capsys):
    pytest.importorskip("datasets", reason="--prompts needs the optional 'datasets' package")
    pytest.importorskip("tokenizers", reason="the offline tokenizer needs the 'tokenizers' package")
    from llm_attn import ttft

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "Attention is all you need, said the paper, and then the kernels "
                                           "came."}) + "\n")
    out = tmp_path / "rows.jsonl"
    assert ttft.main(["--device", "cpu", "--model", "tiny", "--impl", "sdpa", "llm_attn", "--seq", "40",
                      "--measure", "correctness", "--new-tokens", "4", "--prompts", str(prompts),
                      "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "greedy, first 64" in text and "100.0% met" in text and "KL mean (max)" in text
    assert max(len(ln) for ln in text.splitlines() if ln.startswith("| llm_attn ")) <= 120
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["prompts"]["source"] == str(prompts)
    assert row["greedy_agreement_64"] == 1.0 and row["logit_kl"]["positions"] == 40 + 64


def test_the_fp8_kv_cache_against_the_unquantised_cache(tiny):
    """Issue 38: ``kv_cache="fp8"`` runs the implementation on the FP8 KV cache (prefill, decode and the teacher-forced
    forward) and stock on transformers' own: stock against itself then measures the cache alone. The quantised K/V
    must show (KL > 0, a logit difference: the same call on the unquantised cache gives exactly 0), within the
    cache's accuracy, and llm_attn's calls read the bytes (its CPU reference), counted in the row."""
    ids = _prompt(tiny)
    same = measure_correctness(tiny, ids, 8, "sdpa", "sdpa", use_impl)
    assert same["logit_kl"]["max"] == 0.0 and same["max_abs_logit_diff"] == 0.0 and "reference_kv_cache" not in same
    r = measure_correctness(tiny, ids, 8, "sdpa", "sdpa", use_impl, kv_cache="fp8")
    assert r["reference_kv_cache"] == "fp16"
    assert 0 < r["logit_kl"]["mean"] < 0.05 and 0 < r["max_abs_logit_diff"] < 0.5
    assert r["greedy_target"]["met"] == (r["greedy_agreement_64"] >= 0.99)  # near-ties of random weights may flip
    ours = measure_correctness(tiny, ids, 8, "sdpa", "llm_attn", use_impl, kv_cache="fp8")
    assert 0 < ours["logit_kl"]["mean"] < 0.05
    assert sum(ours["attention_calls"]["kv_cache_reads"].values()) == ours["attention_calls"]["impl"] > 0
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        measure_correctness(tiny, ids, 8, "sdpa", "sdpa", use_impl, kv_cache="int4")
    row = {**ours, "measurement": "correctness", "status": "ok", "impl": "llm_attn", "batch": 2, "seq": 24,
           "kv_cache": "fp8", "model": {"name": "tiny"}, "dtype": "float32", "experiment": None, "model_spec": "tiny",
           "new_tokens": 8}
    assert "llm_attn (FP8 KV cache) | sdpa (unquantised cache)" in correctness_table([row])


def test_the_report_counts_the_flips_beside_the_stock_floor(tmp_path):
    """report.md's correctness table has the flips column, read from real rows (the H100 run that put HF's eager
    attention, a second stock implementation, beside ours: experiments/results/h100-80gb-hbm3)."""
    from pathlib import Path

    from llm_attn import report

    src = Path(__file__).resolve().parents[1] / "experiments" / "results" / "h100-80gb-hbm3" / \
        "correctness_8b_floor_2048.jsonl"
    rows = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    assert {r["impl"] for r in rows} == {"eager", "llm_attn", "llm_attn_int8qk", "llm_attn_fp8"}
    assert report.main([str(src), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "top-1 flips (largest stock gap)" in text and "stock's largest gap" in text
    for r in rows:
        t = r["top1_forced"]
        want = f"{t['flips']} of {t['positions']} (<= {t['flip_margin_max']:.2g})"
        assert any(f"| {r['impl']} " in ln and want in ln for ln in text.splitlines()), (r["impl"], want)


def test_the_report_says_which_rows_ran_on_the_fp8_kv_cache(tmp_path):
    """Rows of ``--kv-cache fp8`` are labelled in report.md as on the CLI's table: "sdpa vs sdpa" at 75 % alone
    would read as noise, not as the cache's effect (real rows: experiments/results/h100-80gb-hbm3)."""
    from pathlib import Path

    from llm_attn import report

    src = Path(__file__).resolve().parents[1] / "experiments" / "results" / "h100-80gb-hbm3" / \
        "tinylm_correctness_fp8kv_flips.jsonl"
    assert report.main([str(src), "--out", str(tmp_path / "r")]) == 0
    lines = [ln for ln in (tmp_path / "r" / "report.md").read_text().splitlines() if "| sdpa (FP8 KV cache)" in ln]
    assert len(lines) == 2 and all("| sdpa (unquantised cache)" in ln for ln in lines)

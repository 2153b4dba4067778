"""Chunked prefill (``python -m llm_attn.ttft --prefill-chunk N``) on CPU: the prompt in chunks of N tokens against
the growing cache gives the unchunked prefill's last-token logits, the rows carry the chunk, a chunk at least as
long as the prompt is one forward and says so, and a chunk <= 0 is one line and exit status 2.

    pytest tests/test_prefill_chunk.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cpu_check_here
from transformers import DynamicCache

from llm_attn.harness.impls import use_impl
from llm_attn.harness.measure import prefill_first_token
from llm_attn.harness.results import iter_rows, point_key, validate_row
from llm_attn.harness.sweep import row_notes
from llm_attn.models.kv_cache import Fp8DynamicCache

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    from llm_attn.models import load_model

    model, _ = load_model("tiny", device="cpu", dtype=torch.float32, attn_implementation="sdpa")
    return model


@pytest.mark.parametrize("impl", ["sdpa", "llm_attn"])
def test_chunked_prefill_gives_the_unchunked_logits(tiny, impl):
    """Chunks of 7 (the last one 5 tokens), 16 and 64 (longer than the prompt: one forward) over a 40-token prompt,
    batch 2: the last position's logits match one forward's; on the patched path every chunk runs on the
    implementation (the chunk-over-cache mask is a causal prefix), none falls back."""
    ids = torch.randint(0, tiny.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), use_impl(tiny, impl) as report:
        tok, want = prefill_first_token(tiny, ids)
        for chunk in (7, 16, 64):
            cache = DynamicCache(config=tiny.config)
            got_tok, got = prefill_first_token(tiny, ids, cache=cache, chunk=chunk)
            assert cache.get_seq_length() == 40
            assert (got - want).abs().max() < 1e-4 * want.abs().max(), chunk
            assert torch.equal(got_tok, tok)
    if report is not None:
        assert report.num_fallback_calls == 0 and report.num_native_calls > 0


def test_chunked_prefill_into_the_fp8_cache(tiny):
    """The FP8 cache takes a chunked prefill: the same logits as its unchunked prefill, to e4m3 rounding."""
    ids = torch.randint(0, tiny.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, want = prefill_first_token(tiny, ids, cache=Fp8DynamicCache(config=tiny.config))
        cache = Fp8DynamicCache(config=tiny.config)
        _, got = prefill_first_token(tiny, ids, cache=cache, chunk=48)
    assert cache.get_seq_length() == 150 and (got - want).abs().max() < 0.02 * want.abs().max()


def test_the_rows_carry_the_chunk(tmp_path, capsys):
    from llm_attn import ttft

    out = tmp_path / "rows.jsonl"
    common = ["--device", "cpu", "--model", "tiny", "--impl", "sdpa", "llm_attn", "--seq", "40", "--repeats", "1",
              "--warmup", "0", "--new-tokens", "3", "--decode-repeats", "1", "--no-progress", "--out", str(out)]
    assert ttft.main([*common, "--prefill-chunk", "16", "--measure", "ttft", "decode_graph", "correctness"]) == 0
    assert ttft.main([*common, "--prefill-chunk", "64", "--measure", "ttft"]) == 0
    capsys.readouterr()
    rows = list(iter_rows(out, strict=True))
    for r in rows:
        validate_row(r)
    # The notes the tables print (the compact table may cut a long notes cell: a GPU machine's rows carry more
    # notes than a CPU's, so read them from the rows).
    notes = {n for r in rows for n in row_notes(r)}
    assert "prefill in 3 chunks of 16" in notes and "prefill chunk 64 >= prompt: one chunk" in notes, notes
    chunked = [r for r in rows if r["measurement"] in ("ttft", "decode_graph")]
    assert len(chunked) == 6 and all(r["status"] == "ok" for r in rows)
    for r in chunked:
        want = (16, 3) if "--prefill-chunk 16" in r["command"] else (64, 1)
        assert (r["prefill_chunk"], r["prefill_chunks"]) == want
    assert all("prefill_chunk" not in r for r in rows if r["measurement"] == "correctness")  # one forward there
    ttft16 = next(r for r in rows if r["measurement"] == "ttft" and r.get("prefill_chunk") == 16)
    assert point_key(ttft16) != point_key({k: v for k, v in ttft16.items() if k != "prefill_chunk"})


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_chunk_of_zero_or_less_is_one_line_and_exit_2(value, request, tmp_path):
    cpu_check_here(request, "command-line error handling")
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, "-m", "llm_attn.ttft", "--device", "cpu", "--prefill-chunk", value,
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines == [f"python -m llm_attn.ttft: error: --prefill-chunk {value}: must be a positive number of tokens"]
    assert not out.exists()

"""A model's own attention inputs for the accuracy benchmark (``llm_attn.harness.captured``, ``bench --mode accuracy
--capture``) on CPU with the tiny model: what is captured is what stock attention received, the forward stays
stock's, nothing is left in the registry, and the rows and the CLI's bad inputs.

    pytest tests/test_captured.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from llm_attn import registry
from llm_attn.harness.accuracy import CAPTURED, accuracy_captured
from llm_attn.harness.captured import capture_qkv, default_layers


@pytest.fixture(scope="module")
def tiny():
    from llm_attn.models import load_model

    model, _ = load_model("tiny", device="cpu", dtype=torch.float32, attn_implementation="sdpa")
    return model


def _ids(model, batch=2, seq=40):
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))


def test_capture_is_what_stock_attention_received_and_changes_nothing(tiny):
    ids = _ids(tiny)
    names = set(registry.names())
    with torch.inference_mode():
        stock = tiny(input_ids=ids, use_cache=False).logits
    seen = []
    layer0 = tiny.model.layers[0].self_attn
    hook = layer0.register_forward_hook(lambda m, a, kw_out: seen.append(kw_out[0].detach().clone()))
    try:
        got = capture_qkv(tiny, ids)
    finally:
        hook.remove()
    cfg = tiny.config
    assert [c.layer for c in got] == list(range(cfg.num_hidden_layers))
    d = cfg.hidden_size // cfg.num_attention_heads
    for c in got:
        assert c.q.shape == (2, cfg.num_attention_heads, 40, d)
        assert c.k.shape == c.v.shape == (2, cfg.num_key_value_heads, 40, d)
        assert c.causal and c.scale == pytest.approx(d ** -0.5)
    # Layer 0's attention output from the captured inputs is the one the model computed (its o_proj input).
    c = got[0]
    attn = torch.nn.functional.scaled_dot_product_attention(c.q, c.k, c.v, is_causal=True, enable_gqa=True)
    want = layer0.o_proj(attn.transpose(1, 2).reshape(2, 40, -1))
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        after = tiny(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(after, stock, rtol=0, atol=0)  # unpatched: the model is stock again
    assert set(registry.names()) == names  # the temporary entry is gone


def test_layers_asked_and_out_of_range(tiny):
    n = tiny.config.num_hidden_layers
    assert [c.layer for c in capture_qkv(tiny, _ids(tiny, 1, 16), [n - 1])] == [n - 1]
    names = set(registry.names())
    with pytest.raises(ValueError, match=f"has {n} attention layers"):
        capture_qkv(tiny, _ids(tiny, 1, 16), [n + 3])
    assert set(registry.names()) == names
    assert default_layers(32) == [0, 16, 31] and default_layers(1) == [0]


def test_rows_on_captured_inputs_carry_the_layer_and_its_statistics(tiny):
    (c,) = capture_qkv(tiny, _ids(tiny, 1, 48), [1])
    rows = accuracy_captured(["sdpa", "ours", "fp8-reference"], c, source="tiny on random ids", rows=16)
    assert [r["impl"] for r in rows] == ["sdpa", "ours", "fp8-reference"]
    for r in rows:
        assert r["kind"] == CAPTURED and r["layer"] == 1 and r["source"] == "tiny on random ids"
        assert r["status"] == "ok" and r["rows_compared"] == 16 and r["kv_len"] == 48
        assert {t["metric"] for t in r["targets"]} == {"cosine", "rel_l1"}  # the targets apply to real inputs
        assert all(math.isfinite(v) for v in r["input_stats"].values())
    ref = next(r for r in rows if r["impl"] == "fp8-reference")
    assert ref["rel_l1"] > 10 * next(r for r in rows if r["impl"] == "ours")["rel_l1"]  # quantisation shows
    json.dumps(rows)


def test_a_layer_with_another_softmax_scale_is_refused(tiny):
    (c,) = capture_qkv(tiny, _ids(tiny, 1, 16), [0])
    c.scale *= 2
    with pytest.raises(ValueError, match="not 1/sqrt"):
        accuracy_captured(["sdpa"], c, source="x")


def test_bench_cli_on_the_tiny_model(tmp_path, capsys):
    """tiny:fp16, because a bare preset is its AWQ checkpoint on a GPU, which needs gptqmodel (not installed by
    the README)."""
    from llm_attn import bench

    out = tmp_path / "rows.jsonl"
    code = bench.main(["--mode", "accuracy", "--capture", "tiny:fp16", "--seqs", "32", "--impls", "sdpa", "ours",
                       "--layers", "0", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["impl"], r["layer"], r["kv_len"]) for r in rows] == [("sdpa", 0, 32), ("ours", 0, 32)]
    assert all(r["command"].startswith("python -m llm_attn.bench --mode accuracy --capture tiny:fp16") for r in rows)
    assert "captured L0" in text and "strongest K channel bias" in text
    assert "met on all 2 checked" in text


@pytest.mark.parametrize("args, message", [
    (["--mode", "accuracy", "--prompts", "x.jsonl"], "--prompts needs --capture MODEL"),
    (["--mode", "accuracy", "--layers", "1"], "--layers needs --capture MODEL"),
    (["--capture", "tiny"], "--capture is for --mode accuracy"),
    (["--mode", "accuracy", "--capture", "tiny:fp16", "--seqs", "16", "--layers", "9"], "tiny:fp16 has 2 layers (0..1)"),
    (["--mode", "accuracy", "--capture", "/nonexistent/model", "--seqs", "16"], "--capture /nonexistent/model:"),
])
def test_bench_cli_bad_capture_arguments_are_one_line(args, message, capsys):
    from llm_attn import bench

    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err

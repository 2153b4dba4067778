"""``llm_attn.thunder``: our op as a Lightning Thunder executor claiming ``scaled_dot_product_attention``.
``thunder.jit`` of a function and of a tiny Llama decoder layer must trace to ``llm_attn_sdpa`` and give the outputs
of the stock module; calls the checker refuses (a mask, top-left causal with q_len != kv_len) must stay with
Thunder's own executors. Runs where lightning-thunder is installed (CI: a separate venv, see .ci/run); skips
elsewhere.

    pytest tests/test_thunder.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("thunder") is None,
                                reason="lightning-thunder is not installed (the 'thunder' extra; CI tests it in "
                                       "its own venv)")


@pytest.fixture(scope="module")
def th():
    from llm_attn.thunder import executor, import_thunder

    thunder = import_thunder()
    return thunder, executor()


def _jit(thunder, ex, fn):
    return thunder.jit(fn, executors=[ex, *thunder.get_default_executors()])


def _trace(thunder, jfn) -> str:
    return str(thunder.last_traces(jfn)[-1])


def test_function_traces_to_our_op(th):
    thunder, ex = th
    F = torch.nn.functional

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 64, generator=g) for _ in range(3))
    jfn = _jit(thunder, ex, attn)
    out = jfn(q, k, v)
    assert "llm_attn_sdpa" in _trace(thunder, jfn)
    torch.testing.assert_close(out, attn(q, k, v), atol=1e-5, rtol=1e-5)


def test_checker_leaves_unsupported_calls_to_thunder(th):
    thunder, ex = th
    F = torch.nn.functional

    def masked(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def top_left(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(1, 2, 8, 32)
    kv = torch.randn(1, 2, 12, 32)
    m = torch.rand(8, 12) > 0.3
    for fn, args in ((masked, (q, kv, kv, m)), (top_left, (q, kv, kv))):
        jfn = _jit(thunder, ex, fn)
        torch.testing.assert_close(jfn(*args), fn(*args), atol=1e-5, rtol=1e-5)
        assert "llm_attn_sdpa" not in _trace(thunder, jfn)


def test_llama_decoder_layer_traces_to_our_op(th):
    thunder, ex = th
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=64, num_hidden_layers=1, vocab_size=128, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(2, 29, 256)
    pos = torch.arange(29).unsqueeze(0).expand(2, -1)
    cos_sin = rope(x, pos)
    with torch.no_grad():
        ref = layer(x, position_embeddings=cos_sin, position_ids=pos)
        ref = ref[0] if isinstance(ref, tuple) else ref
        jlayer = _jit(thunder, ex, layer)
        out = jlayer(x, position_embeddings=cos_sin, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
    assert "llm_attn_sdpa" in _trace(thunder, jlayer)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

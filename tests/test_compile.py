"""torch.compile of a patched model (transformers >= 4.53, the AttentionInterface target), on CPU.

The patched attention call must trace without a graph break: dynamo's ``explain`` finds none, ``fullgraph=True``
compiles prefill and static-cache decode (and transformers' own compiled ``generate``), the compiled graphs call
llm_attn rather than the stock path, and the logits equal the uncompiled patched model's. The ``aot_eager`` backend
(dynamo + AOTAutograd + fake tensors through ``llm_attn::flash_fwd``, no code generation) keeps this fast; inductor
adds only code generation around the same custom op.

    pytest tests/test_compile.py -q
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging import version

if version.parse(transformers.__version__) < version.parse("4.53"):
    pytest.skip("needs transformers >= 4.53 (AttentionInterface)", allow_module_level=True)

from llm_attn.patches import patched  # noqa: E402
from test_patches import LAYERS, greedy, make_model, prompt  # noqa: E402
from transformers import StaticCache  # noqa: E402

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_patched_forward_has_no_graph_break():
    model = make_model()
    ids = prompt(length=20)
    with patched(model) as report, torch.no_grad():
        explained = torch._dynamo.explain(lambda x: model(x).logits)(ids)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        assert explained.graph_count == 1
        # The mask our mask function builds while dynamo traces (transformers materialises it then) is tagged too:
        # the graph calls llm_attn, not the stock path.
        assert report.compiled_native_seen and not report.compiled_fallback_seen, str(report)


def test_fullgraph_prefill_and_static_cache_decode_match_eager():
    model = make_model()
    ids = prompt(length=20)
    with patched(model) as report, torch.no_grad():
        eager_prefill = model(ids).logits
        cache = StaticCache(config=model.config, max_cache_len=48)
        model(ids, past_key_values=cache)
        tokens = [eager_prefill[:, -1:].argmax(-1)]
        eager_decode = []
        for _ in range(3):
            eager_decode.append(model(tokens[-1], past_key_values=cache).logits)
            tokens.append(eager_decode[-1][:, -1:].argmax(-1))
        eager_calls = report.num_native_calls
        assert eager_calls == LAYERS * (2 + 3) and report.num_fallback_calls == 0, str(report)

        prefill = torch.compile(lambda x: model(x).logits, fullgraph=True, backend=BACKEND)
        torch.testing.assert_close(prefill(ids), eager_prefill, atol=1e-5, rtol=1e-5)

        cache = StaticCache(config=model.config, max_cache_len=48)
        model(ids, past_key_values=cache)  # eager prefill (counted), compiled decode
        decode = torch.compile(lambda x: model(x, past_key_values=cache).logits, fullgraph=True, backend=BACKEND)
        for step in range(3):  # one graph serves every step: the position lives in the cache's tensor
            torch.testing.assert_close(decode(tokens[step]), eager_decode[step], atol=1e-5, rtol=1e-5,
                                       msg=f"decode step {step}")

        # Compiled calls are not counted (a counter bumped while dynamo traces would replay as a constant); the
        # eager counters keep exactly the eager calls, and the flags say what the graphs call.
        assert report.num_native_calls == eager_calls + LAYERS, str(report)
        assert report.num_fallback_calls == 0
        assert report.compiled_native_seen and not report.compiled_fallback_seen, str(report)


def test_fullgraph_with_padding_mask_takes_stock_path_inside_the_graph():
    """A 2D padding mask cannot be proved causal while tracing (that needs the mask's values): the graph calls the
    stock path, still without a break, and matches eager."""
    model = make_model()
    ids = prompt(batch=2, length=12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with patched(model) as report, torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        compiled = torch.compile(lambda x, m: model(x, attention_mask=m).logits, fullgraph=True, backend=BACKEND)
        torch.testing.assert_close(compiled(ids, mask), eager, atol=1e-5, rtol=1e-5)
        assert report.compiled_fallback_seen and not report.compiled_native_seen, str(report)


def test_generate_compiled_fullgraph_matches_stock():
    """transformers' test_generate_compile_model_forward_fullgraph, in short: generate() with a static cache compiles
    the decode forward with fullgraph=True."""
    from transformers import CompileConfig

    model = make_model()
    ids = prompt(length=20)
    cc = CompileConfig(fullgraph=True, backend="eager")
    cc._compile_all_devices = True  # transformers compiles only on accelerators unless told otherwise
    stock = greedy(model, ids, n=8, cache_implementation="static", compile_config=cc)
    torch._dynamo.reset()
    with patched(model) as report:
        ours = greedy(model, ids, n=8, cache_implementation="static", compile_config=cc)
        assert report.compiled_native_seen and not report.compiled_fallback_seen, str(report)
        assert report.num_native_calls == LAYERS and report.num_fallback_calls == 0, str(report)  # the eager prefill
    assert torch.equal(ours, stock)

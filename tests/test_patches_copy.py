"""A patched model behaves like a model: ``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load`` copy it with
its patch (transformers >= 4.53, the AttentionInterface target; tests/test_patches_legacy.py does the same for
transformers 4.4x and AutoAWQ).

The copy must be patched on its own: its attention calls are counted as native in *its* report (not the original's),
it gives the original's logits, ``unpatch_model`` on it restores stock attention there and leaves the original
patched. A real tiny Llama (GQA 8:2, head_dim 64, random seeded weights) on CPU, served by llm_attn's reference.

    pytest tests/test_patches_copy.py -q
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from packaging import version

if version.parse(transformers.__version__) < version.parse("4.53"):
    pytest.skip("needs transformers >= 4.53 (AttentionInterface); tests/test_patches_legacy.py covers 4.4x",
                allow_module_level=True)

from transformers import LlamaConfig, LlamaForCausalLM

from llm_attn.patches import STATE_ATTR, is_patched, patch_model, unpatch_model
from llm_attn.patches import hf_attention_interface as hfai

LAYERS = 2
VOCAB = 128
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model.eval()


def ids(seed: int = 1, length: int = 37) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def report_of(model):
    return model.__dict__[STATE_ATTR].report


def torch_roundtrip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": torch_roundtrip,
}


@pytest.mark.parametrize("how", sorted(COPIES))
def test_copy_of_a_patched_model_is_patched_on_its_own(how):
    model = make_model()
    x = ids()
    stock = logits(model, x)
    report = patch_model(model, impl="llm_attn", on_unsupported="fallback")
    assert report.num_patched == LAYERS and report.expected_path.startswith("llm_attn PyTorch reference")
    patched = logits(model, x)
    torch.testing.assert_close(patched, stock, atol=2e-4, rtol=1e-4)
    assert report.native_calls == {"reference": LAYERS} and report.num_fallback_calls == 0

    clone = COPIES[how](model)
    assert is_patched(clone) and clone.config._attn_implementation == hfai.NAME
    clone_report = report_of(clone)
    assert clone_report is not report and clone_report.patched_modules == report.patched_modules
    # Each copied attention module carries the copy's runtime, which counts into the copy's report.
    runtimes = {id(getattr(layer.self_attn, hfai.RUNTIME_ATTR)) for layer in clone.model.layers}
    assert len(runtimes) == 1 and getattr(clone.model.layers[0].self_attn, hfai.RUNTIME_ATTR).report is clone_report
    assert getattr(model.model.layers[0].self_attn, hfai.RUNTIME_ATTR).report is report

    report.reset_counters()
    clone_report.reset_counters()
    assert torch.equal(logits(clone, x), patched)
    assert clone_report.native_calls == {"reference": LAYERS} and clone_report.num_fallback_calls == 0
    assert report.num_native_calls == 0, "the copy's calls were counted on the original"

    unpatch_model(clone)
    assert not is_patched(clone) and clone.config._attn_implementation == "sdpa"
    assert all(hfai.RUNTIME_ATTR not in layer.self_attn.__dict__ for layer in clone.model.layers)
    assert torch.equal(logits(clone, x), stock)
    assert clone_report.num_native_calls == LAYERS  # the unpatched copy counted nothing more

    # The original is untouched: still patched, still counting its own calls.
    assert is_patched(model) and model.config._attn_implementation == hfai.NAME
    assert torch.equal(logits(model, x), patched) and report.native_calls == {"reference": LAYERS}
    unpatch_model(model)
    assert torch.equal(logits(model, x), stock)


def test_unpatching_the_original_leaves_the_copy_patched():
    model = make_model()
    x = ids(seed=3, length=19)
    patch_model(model, on_unsupported="fallback")
    patched = logits(model, x)
    clone = copy.deepcopy(model)
    unpatch_model(model)
    report_of(clone).reset_counters()
    assert torch.equal(logits(clone, x), patched) and report_of(clone).native_calls == {"reference": LAYERS}


def test_torch_load_in_a_new_process_is_patched(tmp_path):
    """``torch.load`` where llm_attn has registered nothing yet: loading the model registers "llm_attn" again."""
    model = make_model()
    x = ids(seed=5, length=23)
    patch_model(model, on_unsupported="fallback")
    expected = logits(model, x)
    torch.save({"model": model, "ids": x, "expected": expected}, tmp_path / "m.pt")
    code = textwrap.dedent("""
        import sys, torch
        import llm_attn.patches as p
        saved = torch.load(sys.argv[1], weights_only=False)
        m = saved["model"]
        state = m.__dict__[p.STATE_ATTR]
        with torch.no_grad():
            out = m(saved["ids"]).logits
        assert torch.equal(out, saved["expected"]), (out - saved["expected"]).abs().max()
        print("native", dict(state.report.native_calls), "fallback", state.report.num_fallback_calls)
        p.unpatch_model(m)
        print("after unpatch", m.config._attn_implementation, p.is_patched(m))
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt")], capture_output=True, text=True, check=False,
                         env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # The counters travel with the model (LAYERS calls made before saving), and the new process added its own.
    assert f"native {{'reference': {2 * LAYERS}}} fallback 0" in run.stdout, run.stdout
    assert "after unpatch sdpa False" in run.stdout, run.stdout

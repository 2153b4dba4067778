"""CPU tests of the patch registry (llm_attn.patches) on transformers >= 4.53 (the AttentionInterface target).

Real transformers model classes and caches with random, seeded weights: a tiny Llama (8 query heads over 2 KV heads,
head_dim 64), plus Mistral and Qwen2 variants. Every test compares the patched model (llm_attn's tiled reference on
CPU, float32) against the same model on stock sdpa, and checks the report's live counters so that a call silently
taking the wrong path fails the test.

    pytest tests/test_patches.py -q
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging import version

if version.parse(transformers.__version__) < version.parse("4.53"):
    pytest.skip("needs transformers >= 4.53 (AttentionInterface + AttentionMaskInterface); "
                "tests/test_patches_legacy.py covers 4.4x", allow_module_level=True)

from llm_attn.patches import (  # noqa: E402
    PatchReport,
    UnsupportedModelError,
    is_patched,
    patch_model,
    patched,
    unpatch_model,
)
from llm_attn.patches import hf_attention_interface as hfai  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

LAYERS = 2
VOCAB = 512
TOL = dict(atol=2e-4, rtol=1e-4)  # float32 reference vs float32 sdpa: observed differences are ~1e-6


def _common(**over):
    # initializer_range 0.1 makes greedy decoding of a random model pick varied tokens (0.02 repeats one token).
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(over)
    return kw


def make_model(kind: str = "llama", seed: int = 0, attn: str = "sdpa", **over):
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_common(**over)))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**_common(**{"sliding_window": None, **over})))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_common(**over)))
    else:
        raise ValueError(kind)
    model.set_attn_implementation(attn)
    return model.eval()


def prompt(batch=1, length=33, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def greedy(model, ids, n=24, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def step_logits(model, ids, cache, steps=8, tokens=None):
    """Prefill, then `steps` decode steps feeding `tokens` (or this model's own greedy choices); all logits."""
    out = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        out.append(logits)
        for t in range(steps):
            nxt = tokens[:, t:t + 1] if tokens is not None else logits[:, -1:].argmax(-1)
            logits = model(nxt, past_key_values=cache, use_cache=True).logits
            out.append(logits)
    chosen = torch.cat([o[:, -1:].argmax(-1) for o in out[:-1]], dim=1)
    return out, chosen


# ---------------------------------------------------------------------------------------------------------------
# Correctness against stock sdpa


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_prefill_and_each_decode_step_match_stock(kind):
    model = make_model(kind)
    ids = prompt()
    ref, tokens = step_logits(model, ids, DynamicCache(config=model.config))
    with patched(model) as report:
        got, _ = step_logits(model, ids, DynamicCache(config=model.config), tokens=tokens)
        assert report.fallback_calls == {}, str(report)
        assert report.native_calls == {"reference": LAYERS * len(ref)}
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        torch.testing.assert_close(b, a, **TOL, msg=f"step {step}")


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_greedy_generation_identical(kind):
    model = make_model(kind)
    ids = prompt()
    stock = greedy(model, ids)
    assert len(set(stock[0, ids.shape[1]:].tolist())) > 5, "degenerate test model: greedy repeats one token"
    with patched(model) as report:
        ours = greedy(model, ids)
        assert report.num_native_calls == LAYERS * 24 and report.num_fallback_calls == 0, str(report)
    assert torch.equal(ours, stock)


def test_static_cache_prefill_and_decode():
    """Prefill into a longer StaticCache (stock crops keys: top-left causal) and decode with a boolean mask over the
    unused slots (our mask function proves it is a prefix: the kernel gets seqused_k). No call may fall back."""
    model = make_model()
    ids = prompt(length=21)
    ref, tokens = step_logits(model, ids, StaticCache(config=model.config, max_cache_len=64), steps=10)
    with patched(model) as report:
        got, _ = step_logits(model, ids, StaticCache(config=model.config, max_cache_len=64), steps=10, tokens=tokens)
        assert report.num_fallback_calls == 0, str(report)
        assert report.num_native_calls == LAYERS * 11
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        torch.testing.assert_close(b, a, **TOL, msg=f"step {step}")

    stock = greedy(model, ids, cache_implementation="static")
    with patched(model) as report:
        ours = greedy(model, ids, cache_implementation="static")
        assert report.num_fallback_calls == 0 and report.num_native_calls == LAYERS * 24, str(report)
    assert torch.equal(ours, stock)


def test_chunk_over_cache_uses_kernel_with_bottom_right_causality():
    """A multi-token chunk appended to a non-empty cache: stock builds a dense causal mask; we must see the whole
    prefix (bottom-right alignment) and run natively."""
    model = make_model()
    ids = prompt(length=40)
    def run():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            a = model(ids[:, :20], past_key_values=cache, use_cache=True).logits
            b = model(ids[:, 20:32], past_key_values=cache, use_cache=True).logits
            c = model(ids[:, 32:33], past_key_values=cache, use_cache=True).logits
        return a, b, c
    ref = run()
    with patched(model) as report:
        got = run()
        assert report.num_fallback_calls == 0 and report.num_native_calls == 3 * LAYERS, str(report)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, **TOL)


def test_left_padded_batch_falls_back_per_call_and_matches():
    model = make_model()
    ids = prompt(batch=2, length=16)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0 is left-padded
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    with patched(model) as report:
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
        # The padding mask cannot be expressed natively: every layer took the stock path, and said why.
        assert report.num_fallback_calls == LAYERS and report.num_native_calls == 0, str(report)
        assert all("padding" in reason for reason in report.fallback_calls)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=0, rtol=0)

    for cache_impl in (None, "static"):
        kw = {"attention_mask": mask, "pad_token_id": 0}
        if cache_impl:
            kw["cache_implementation"] = cache_impl
        stock = greedy(model, ids, n=20, **kw)
        with patched(model) as report:
            ours = greedy(model, ids, n=20, **kw)
            assert report.num_fallback_calls == LAYERS * 20 and report.num_native_calls == 0, str(report)
        assert torch.equal(ours, stock)


def test_unpadded_batch_with_all_ones_mask_runs_natively():
    model = make_model()
    ids = prompt(batch=3, length=12)
    stock = greedy(model, ids, n=20, attention_mask=torch.ones_like(ids))
    with patched(model) as report:
        ours = greedy(model, ids, n=20, attention_mask=torch.ones_like(ids))
        assert report.num_fallback_calls == 0 and report.num_native_calls == LAYERS * 20, str(report)
    assert torch.equal(ours, stock)


def test_custom_4d_mask_takes_stock_path():
    model = make_model()
    ids = prompt(length=10)
    custom = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    custom[..., 3] = False  # not a plain causal prefix
    custom[..., 0, 0] = True
    with torch.no_grad():
        ref = model(ids, attention_mask=custom).logits
        with patched(model) as report:
            got = model(ids, attention_mask=custom).logits
            assert report.num_fallback_calls == LAYERS and report.num_native_calls == 0, str(report)
    assert torch.equal(got, ref)


def test_mask_function_tags_exactly_the_causal_prefix_masks():
    """Property check of the mask analysis: a tagged mask must be exactly 'key j visible to query i iff
    j < seqused and j <= i + seqused - q_len' (what the kernel computes); padding must never be tagged."""
    from transformers.masking_utils import causal_mask_function

    g = torch.Generator().manual_seed(0)
    tagged = untagged = 0
    for _ in range(60):
        batch = int(torch.randint(1, 4, (1,), generator=g))
        q_len = int(torch.randint(1, 6, (1,), generator=g))
        q_off = int(torch.randint(0, 8, (1,), generator=g))
        kv_len = q_off + q_len + int(torch.randint(0, 2, (1,), generator=g)) * 5  # dynamic or static-like
        pad = torch.ones(batch, q_off + q_len, dtype=torch.bool)
        if torch.rand(1, generator=g) < 0.5:
            pad[0, : int(torch.randint(1, q_off + q_len, (1,), generator=g)) if q_off + q_len > 1 else 0] = False
        mask = hfai.llm_attn_mask(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_off,
                                  mask_function=causal_mask_function, attention_mask=pad,
                                  allow_is_causal_skip=False)
        seqused = getattr(mask, hfai.SEQUSED_ATTR, None)
        if seqused is None:
            untagged += 1
            continue
        tagged += 1
        assert pad.all(), "a padded mask was tagged as a causal prefix"
        i = torch.arange(q_len)[:, None]
        j = torch.arange(kv_len)[None, :]
        used = seqused.view(-1, 1, 1, 1).long()
        expect = (j < used) & (j <= i + used - q_len)
        assert torch.equal(mask, expect.expand_as(mask))
    assert tagged > 10 and untagged > 10


# ---------------------------------------------------------------------------------------------------------------
# Patch / unpatch mechanics


def test_unpatch_restores_bit_identical_outputs():
    ids = prompt()
    never = make_model(seed=3)
    with torch.no_grad():
        ref_logits = never(ids).logits
    ref_tokens = greedy(never, ids)

    model = make_model(seed=3)
    before = {n: set(vars(m)) for n, m in model.named_modules()}
    report = patch_model(model)
    assert model.config._attn_implementation == "llm_attn" and is_patched(model)
    greedy(model, ids, n=4)
    assert report.num_native_calls > 0
    unpatch_model(model)

    assert model.config._attn_implementation == "sdpa" and not is_patched(model)
    assert {n: set(vars(m)) for n, m in model.named_modules()} == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_logits)
    assert torch.equal(greedy(model, ids), ref_tokens)
    calls = report.num_native_calls
    greedy(model, ids, n=2)
    assert report.num_native_calls == calls, "an unpatched model still reports calls"


def test_unpatch_restores_eager_exactly():
    model = make_model(attn="eager")
    ids = prompt(length=9)
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model):
            assert model.config._attn_implementation == "llm_attn"
        assert model.config._attn_implementation == "eager"
        assert torch.equal(model(ids).logits, ref)


def test_patch_twice_is_harmless():
    model = make_model()
    ids = prompt(length=9)
    r1 = patch_model(model)
    r2 = patch_model(model)
    assert r1 is r2 and r1.num_patched == LAYERS
    with torch.no_grad():
        model(ids)
    assert r1.num_native_calls == LAYERS  # one call per layer, not two
    unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"
    unpatch_model(model)  # unpatching an unpatched model is a no-op
    assert model.config._attn_implementation == "sdpa"


def test_repatch_with_other_options_replaces_the_patch():
    model = make_model()
    r1 = patch_model(model)
    r2 = patch_model(model, backend="reference")
    assert r2 is not r1 and r2.backend == "reference"
    with torch.no_grad():
        model(prompt(length=5))
    assert r2.native_calls == {"reference": LAYERS} and r1.num_native_calls == 0
    unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("impl,variant", [("llm_attn_fp8", "reference-fp8"), ("llm_attn_int8qk", "reference-int8qk"),
                                          ("llm_attn_int8", "reference-int8")])
def test_backend_reference_keeps_a_low_precision_entry_in_low_precision(impl, variant):
    """patch_model(impl=<low-precision entry>, backend='reference') runs that entry's quantised algorithm in PyTorch:
    the report names its reference variant, and the logits are not the plain reference's."""
    model = make_model()
    ids = prompt(length=40)  # prefill rows above the entries' decode cut-off: the low-precision path
    with patched(model, backend="reference") as plain, torch.no_grad():
        want = model(ids).logits
    with patched(model, impl=impl, backend="reference") as report, torch.no_grad():
        got = model(ids).logits
    assert plain.native_calls == {"reference": LAYERS}
    assert report.native_calls == {variant: LAYERS}
    assert torch.isfinite(got).all() and not torch.equal(got, want)


def test_context_manager_restores_on_error():
    model = make_model()
    with pytest.raises(RuntimeError, match="boom"):
        with patched(model) as report:
            assert isinstance(report, PatchReport) and report.active
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa" and not is_patched(model)


def test_report_is_readable():
    model = make_model()
    with patched(model) as report:
        greedy(model, prompt(length=5), n=3)
        text = str(report)
    assert "transformers.AttentionInterface" in text
    assert f"patched modules: {LAYERS}" in text
    assert f"calls on llm_attn: {3 * LAYERS}" in text
    assert "model.layers.0.self_attn" in report.patched_modules


# ---------------------------------------------------------------------------------------------------------------
# Unsupported models and settings


UNSUPPORTED = {
    "sliding_window": (lambda: make_model("mistral", sliding_window=8), "sliding-window"),
    "softcapping": (lambda: make_model(attn_logit_softcapping=30.0), "softcapping"),
    "dropout_training": (lambda: make_model(attention_dropout=0.2).train(), "dropout"),
    "cuda_backend_on_cpu": (lambda: make_model(), "CUDA"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_setting_errors_at_patch_time(case):
    build, words = UNSUPPORTED[case]
    model = build()
    kw = {"backend": "cuda"} if case == "cuda_backend_on_cpu" else {}
    with pytest.raises(UnsupportedModelError, match=words):
        patch_model(model, **kw)
    assert model.config._attn_implementation == "sdpa" and not is_patched(model)


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_setting_falls_back_and_counts(case):
    build, words = UNSUPPORTED[case]
    model = build()
    kw = {"backend": "cuda"} if case == "cuda_backend_on_cpu" else {}
    ids = prompt(length=12)
    with torch.no_grad():
        torch.manual_seed(5)  # dropout, when on, draws the same numbers in both runs
        ref = model(ids).logits
        report = patch_model(model, on_unsupported="fallback", **kw)
        assert any(words.lower() in f.lower() for f in report.fallbacks), str(report)
        torch.manual_seed(5)
        got = model(ids).logits
    unpatch_model(model)
    assert report.num_native_calls == 0 and report.num_fallback_calls == LAYERS, str(report)
    assert torch.equal(got, ref)


def test_training_mode_with_dropout_at_call_time():
    model = make_model(attention_dropout=0.2)
    ids = prompt(length=6)
    patch_model(model)  # eval mode: fine
    model.train()
    with pytest.raises(UnsupportedModelError, match="dropout"):
        model(ids)
    unpatch_model(model)

    report = patch_model(model.eval(), on_unsupported="fallback")
    model.train()
    model(ids)
    assert report.num_fallback_calls == LAYERS and report.num_native_calls == 0
    model.eval()
    with torch.no_grad():
        model(ids)
    assert report.num_native_calls == LAYERS
    unpatch_model(model)


def test_head_dim_the_kernel_lacks_is_reported_on_cpu():
    model = make_model(head_dim=32)
    ids = prompt(length=9)
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model) as report:
            got = model(ids).logits
    assert any("head_dim 32" in n for n in report.notes)
    torch.testing.assert_close(got, ref, **TOL)
    with pytest.raises(UnsupportedModelError, match="CUDA"):
        patch_model(model, backend="cuda")


def test_unknown_model_type():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        patch_model(gpt2)
    report = patch_model(gpt2, on_unsupported="fallback")
    assert not report.active and report.target is None and "gpt2" in report.fallbacks[0]
    unpatch_model(gpt2)
    assert not is_patched(gpt2)


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="impl"):
        patch_model(model, impl="flash")
    with pytest.raises(ValueError, match="on_unsupported"):
        patch_model(model, on_unsupported="ignore")
    with pytest.raises(ValueError, match="backend"):
        patch_model(model, backend="triton")
    with pytest.raises(TypeError):
        patch_model("not a model")
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------------
# AWQ checkpoint (written by llm_attn.models, loaded by transformers' AWQ backend)


def test_awq_checkpoint_patched_matches_stock(tmp_path):
    models = pytest.importorskip("llm_attn.models", reason="llm_attn.models (synthetic checkpoints) not present")
    try:
        import gptqmodel  # noqa: F401  transformers >= 5 loads AWQ through gptqmodel
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"transformers' AWQ backend (gptqmodel) is not usable here: {e}")
    path = tmp_path / "awq"
    models.write_synthetic_checkpoint(path, "tiny", quant="awq")
    model, _info = models.load_model(str(path), "cpu", torch.float16)
    assert "awq" in (_info.quant or "") and _info.awq_backend, _info  # really int4 linears, not a dequantised copy
    ids = prompt(length=17) % model.config.vocab_size
    # The CPU int4 linears are slow, so greedy decoding is checked the cheap way: stock decodes 20 tokens greedily
    # (each step feeds its own argmax); the patched model is teacher-forced on those tokens and must pick the same
    # argmax at every step, which is exactly "patched greedy decoding produces the same 20 tokens".
    ref, stock_tokens = step_logits(model, ids, DynamicCache(config=model.config), steps=20)
    with patched(model) as report:
        got, our_choices = step_logits(model, ids, DynamicCache(config=model.config), steps=20, tokens=stock_tokens)
        assert report.num_fallback_calls == 0, str(report)
        assert report.num_native_calls == model.config.num_hidden_layers * 21, str(report)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(our_choices, stock_tokens)


def test_compiled_static_cache_decode_stays_on_llm_attn():
    """On GPU, generate() auto-compiles the decode step for a static cache. Trace it here with dynamo (the "eager"
    backend keeps CI fast): tokens must match and the compiled graphs must contain llm_attn, not the stock path."""
    from transformers import CompileConfig

    model = make_model()
    ids = prompt(length=20)
    cc = CompileConfig(fullgraph=False, backend="eager")
    cc._compile_all_devices = True  # transformers compiles only on accelerators unless told otherwise
    stock = greedy(model, ids, n=8, cache_implementation="static", compile_config=cc)
    with patched(model) as report:
        ours = greedy(model, ids, n=8, cache_implementation="static", compile_config=cc)
        assert report.compiled_native_seen and not report.compiled_fallback_seen, str(report)
        assert report.num_fallback_calls == 0
    assert torch.equal(ours, stock)

"""4D attention masks built by the caller (not by llm_attn's mask function), CPU, transformers >= 4.53.

A caller-built mask that is exactly causal over a prefix of the keys (plain causal prefill, a chunk over a cache, a
static-cache decode step with unused slots) runs on llm_attn, counted as native; anything else (padding, one entry
off the pattern, per-head masks, additive values other than 0 / -inf / the dtype's lowest) takes the stock path.
The verdict is computed once per mask tensor and kept while its version counter is unchanged.

    pytest tests/test_caller_masks.py -q
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging import version

if version.parse(transformers.__version__) < version.parse("4.53"):
    pytest.skip("needs transformers >= 4.53 (AttentionInterface)", allow_module_level=True)

from llm_attn.patches import hf_attention_interface as hfai  # noqa: E402
from llm_attn.patches import patched  # noqa: E402
from test_patches import LAYERS, TOL, make_model, prompt  # noqa: E402
from transformers import StaticCache  # noqa: E402

S = 12


def causal(q_len: int, kv_len: int, used: int | None = None, batch: int = 1) -> torch.Tensor:
    """(batch, 1, q_len, kv_len) bools: query i sees keys 0 .. i + used - q_len (used defaults to kv_len)."""
    used = kv_len if used is None else used
    i = torch.arange(q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    return (j <= i + used - q_len).expand(batch, 1, q_len, kv_len).clone()


def additive(visible: torch.Tensor, hidden_value: float, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, hidden_value)


@pytest.fixture
def checks(monkeypatch):
    """How many times a mask's values were inspected (each is one host sync on a GPU)."""
    calls = []
    real = hfai._check_causal_prefix

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(hfai, "_check_causal_prefix", counting)
    return calls


def run_both(model, ids, mask, **kw):
    """Stock logits and patched logits for one forward with ``attention_mask=mask``, and the patch report."""
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, **kw).logits
        with patched(model) as report:
            got = model(ids, attention_mask=mask, **kw).logits
    return ref, got, report


LOWEST = torch.finfo(torch.float32).min
GOOD = {
    "bool": lambda: causal(S, S),
    "bool, batch rows": lambda: causal(S, S, batch=2),
    "additive -inf": lambda: additive(causal(S, S), float("-inf")),
    "additive lowest": lambda: additive(causal(S, S), LOWEST),
    "expanded view": lambda: torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(2, 1, S, S),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_caller_built_causal_mask_runs_natively(name, checks):
    model = make_model()
    ids = prompt(batch=2, length=S)
    mask = GOOD[name]()
    ref, got, report = run_both(model, ids, mask)
    assert report.num_native_calls == LAYERS and report.num_fallback_calls == 0, str(report)
    assert len(checks) == 1, "the mask was inspected more than once in one forward pass"
    torch.testing.assert_close(got, ref, **TOL)
    with torch.no_grad(), patched(model):
        unmasked = model(ids).logits  # the same maths as no mask at all
    torch.testing.assert_close(got, unmasked, **TOL)


def test_caller_built_static_cache_masks_run_natively_with_seqused():
    """What a static-cache decode loop does: prefill and every decode step pass a mask over all max_cache_len slots,
    the unused ones hidden. Each is a causal prefix of `used` keys: the kernel gets seqused_k."""
    model = make_model()
    ids = prompt(batch=2, length=S)
    max_len = 32

    def steps(model):
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        out = []
        with torch.no_grad():
            logits = model(ids, attention_mask=causal(S, max_len, used=S, batch=2), past_key_values=cache).logits
            out.append(logits)
            for t in range(4):
                used = S + t + 1
                mask = causal(1, max_len, used=used, batch=2)
                logits = model(logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache).logits
                out.append(logits)
        return out

    ref = steps(model)
    with patched(model) as report:
        got = steps(model)
        assert report.num_native_calls == LAYERS * 5 and report.num_fallback_calls == 0, str(report)
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        torch.testing.assert_close(b, a, **TOL, msg=f"step {step}")


def _bad_masks():
    left_pad = causal(S, S, batch=2)
    left_pad[0, ..., :3] = False  # row 0's first three keys are padding
    left_pad[0, :, :3, 0] = True   # (its padded queries see something: stock sdpa gives no NaN)
    extra_visible = causal(S, S)
    extra_visible[..., 4, 7] = True  # one future key
    extra_hidden = causal(S, S)
    extra_hidden[..., 9, 2] = False  # one past key
    shifted = causal(S, S, used=S - 1)  # query 0 sees no key
    shifted[..., 0, 0] = True
    per_head = causal(S, S).expand(1, 8, S, S)
    bias = additive(causal(S, S), LOWEST)
    bias[..., 5, 2] = 0.5  # a visible entry with a bias
    return {
        "left padding": left_pad,
        "one future key visible": extra_visible,
        "one past key hidden": extra_hidden,
        "not a prefix": shifted,
        "per-head mask": per_head,
        "additive -1e4": additive(causal(S, S), -1e4),
        "additive bias": bias,
        "additive nan": additive(causal(S, S), float("nan")),
    }


@pytest.mark.parametrize("name", list(_bad_masks()))
def test_caller_built_mask_that_is_not_a_causal_prefix_falls_back(name):
    model = make_model()
    ids = prompt(batch=2, length=S)
    mask = _bad_masks()[name]
    ref, got, report = run_both(model, ids, mask)
    assert report.num_native_calls == 0 and report.num_fallback_calls == LAYERS, str(report)
    assert all("not a causal prefix" in reason for reason in report.fallback_calls)
    assert torch.equal(got.nan_to_num(), ref.nan_to_num())


def test_verdict_is_kept_per_tensor_until_it_is_written(checks):
    model = make_model()
    ids = prompt(length=S)
    mask = causal(S, S)
    with torch.no_grad(), patched(model) as report:
        model(ids, attention_mask=mask)
        model(ids, attention_mask=mask)
        assert len(checks) == 1 and report.num_native_calls == 2 * LAYERS, str(report)
        mask[..., 0, 1] = True  # in place: now query 0 sees a future key
        got = model(ids, attention_mask=mask).logits
        assert len(checks) == 2 and report.num_fallback_calls == LAYERS, str(report)
        mask[..., 0, 1] = False
        model(ids, attention_mask=mask)
        assert len(checks) == 3 and report.num_native_calls == 3 * LAYERS, str(report)
    with torch.no_grad():
        mask[..., 0, 1] = True
        torch.testing.assert_close(got, model(ids, attention_mask=mask).logits, atol=0, rtol=0)


def test_masks_that_cannot_be_checked_cheaply_fall_back(checks):
    """Inference tensors carry no version counter (an in-place write would go unseen): stock path, never inspected.
    Masks our own mask function rejected (left padding) are not inspected again either."""
    model = make_model()
    ids = prompt(batch=2, length=S)
    with patched(model) as report:
        with torch.inference_mode():
            model(ids, attention_mask=causal(S, S))
        assert report.num_fallback_calls == LAYERS and report.num_native_calls == 0, str(report)
        pad = torch.ones_like(ids)
        pad[0, :4] = 0
        with torch.no_grad():
            model(ids, attention_mask=pad)
        assert report.num_fallback_calls == 2 * LAYERS, str(report)
    assert checks == []


def test_caller_mask_prefix_accepts_exactly_the_causal_prefixes():
    """Property check against the definition, and the accepted masks' results against sdpa with the mask (float64):
    random masks near the causal-prefix pattern, one entry flipped half of the time."""
    from llm_attn import flash_attn_func

    g = torch.Generator().manual_seed(0)
    accepted = rejected = 0
    for _ in range(120):
        batch = int(torch.randint(1, 3, (1,), generator=g))
        q_len = int(torch.randint(1, 6, (1,), generator=g))
        kv_len = q_len + int(torch.randint(0, 6, (1,), generator=g))
        used = torch.randint(max(q_len - 1, 1), kv_len + 1, (batch,), generator=g)
        i = torch.arange(q_len)[:, None]
        j = torch.arange(kv_len)[None, :]
        mask = torch.stack([(j <= i + int(u) - q_len) for u in used])[:, None]
        if torch.rand(1, generator=g) < 0.5:
            b, qi, kj = (int(torch.randint(0, n, (1,), generator=g)) for n in (batch, q_len, kv_len))
            mask[b, 0, qi, kj] = ~mask[b, 0, qi, kj]
        ok, seqused = hfai.caller_mask_prefix(mask, batch, q_len, kv_len)
        is_prefix = all(any(torch.equal(mask[b, 0], j <= i + u - q_len) for u in range(q_len, kv_len + 1))
                        for b in range(batch))
        assert ok == is_prefix, (mask, used)
        if not ok:
            rejected += 1
            continue
        accepted += 1
        q = torch.randn(batch, 4, q_len, 16, generator=g, dtype=torch.float64)
        k, v = (torch.randn(batch, 2, kv_len, 16, generator=g, dtype=torch.float64) for _ in range(2))
        got = flash_attn_func(q, k, v, causal=True, seqused_k=seqused, path="reference")
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                               v.repeat_interleave(2, 1), attn_mask=mask)
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    assert accepted > 20 and rejected > 20

"""CPU tests of the backward pass: autograd through ``llm_attn::flash_fwd`` on the reference path.

- ``torch.autograd.gradcheck`` (float64) of ``flash_attn_func(..., path="reference")``, the lse output included;
- ``torch.library.opcheck`` of both custom ops (schema, fake tensors, autograd registration, AOT dispatch);
- the reference backward against float64 autograd of ``attention_naive`` over MHA/GQA/MQA, causal, q_len != kv_len,
  seqused_k (garbage, even NaN, past the used keys);
- a patched tiny Llama (transformers, llm_attn's reference on CPU) trains: ``loss.backward()`` gives the gradients of
  the same model on stock sdpa, and dropout in training mode is still refused.

    pytest tests/test_backward.py -q
"""

from __future__ import annotations

import zlib

import pytest
import torch

from conftest import HEADS
from llm_attn import attention_naive, flash_attn_func
from llm_attn.backward import _flash_bwd
from llm_attn.ops import _flash_fwd
from llm_attn.reference import attention_backward

PAIRS = [(1, 1), (5, 5), (17, 17), (5, 9), (9, 5), (1, 13), (64, 70)]


def _inputs(b, hq, hkv, sq, sk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    return mk(b, hq, sq, d), mk(b, hkv, sk, d), mk(b, hkv, sk, d)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("sq,sk", [(5, 5), (4, 7), (7, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_reference_float64(causal, sq, sk, heads):
    hq, hkv = HEADS[heads]
    q, k, v = _inputs(1, hq // 2, max(hkv // 2, 1), sq, sk, 8, seed=zlib.crc32(repr((causal, sq, sk, heads)).encode()))

    # The lse output is float32 by contract (too coarse for finite differences): test_lse_gradient covers it.
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, path="reference")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_seqused_k_and_scale():
    q, k, v = _inputs(2, 4, 2, 3, 9, 8, seed=3)
    used = torch.tensor([9, 4], dtype=torch.int32)
    for causal in (False, True):
        fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, scale=0.7, seqused_k=used)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("sq,sk", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_backward_matches_naive_autograd(dtype, causal, sq, sk, heads):
    hq, hkv = HEADS[heads]
    q, k, v = _inputs(2, hq, hkv, sq, sk, 16, dtype, seed=zlib.crc32(repr((dtype, causal, sq, sk, heads)).encode()))
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, path="reference")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = attention_naive(q, k, v, causal=causal)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for name, a, r in zip("qkv", got, ref, strict=True):
        assert a.dtype == dtype and a.shape == r.shape
        assert not a.isnan().any(), f"NaN in d{name}"
        err = (a.double() - r).abs().max().item()
        assert err <= tol * max(1.0, r.abs().max().item()), f"d{name}: max err {err:.3e}"


def test_seqused_k_garbage_gets_zero_gradient():
    """Keys past seqused_k may hold NaN (a static cache's unused slots): their gradients are 0 and nothing is NaN."""
    q, k, v = _inputs(2, 4, 2, 6, 12, 8, torch.float32, seed=5)
    used = torch.tensor([12, 5], dtype=torch.int32)
    with torch.no_grad():
        k[1, :, 5:] = float("nan")
        v[1, :, 5:] = 1e30
    for causal in (False, True):
        out = flash_attn_func(q, k, v, causal=causal, seqused_k=used, path="reference")
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert not (dq.isnan().any() or dk.isnan().any() or dv.isnan().any())
        assert torch.all(dk[1, :, 5:] == 0) and torch.all(dv[1, :, 5:] == 0)
        # The used part equals the gradient of the cropped problem.
        kc, vc = k[1:, :, :5].detach().requires_grad_(), v[1:, :, :5].detach().requires_grad_()
        qc = q[1:].detach().requires_grad_()
        outc = flash_attn_func(qc, kc, vc, causal=causal, path="reference")
        rq, rk, rv = torch.autograd.grad(outc, (qc, kc, vc), torch.ones_like(outc))
        torch.testing.assert_close(dq[1:], rq)
        torch.testing.assert_close(dk[1:, :, :5], rk)
        torch.testing.assert_close(dv[1:, :, :5], rv)


def test_lse_gradient():
    """The lse output is differentiable too (d lse / d S = P), through the same backward op."""
    q, k, v = _inputs(1, 4, 2, 7, 7, 8, seed=11)
    _, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, path="reference")
    got = torch.autograd.grad(lse.sum(), (q, k, v))
    s = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) / 8 ** 0.5
    s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.autograd.grad(torch.logsumexp(s, -1).sum(), (q, k))
    for a, r in zip(got[:2], ref, strict=True):
        torch.testing.assert_close(a, r)
    assert torch.all(got[2] == 0)  # lse does not depend on v


def test_an_unused_lse_gradient_stays_none(monkeypatch):
    """The backward gets dlse=None, not a materialised tensor of zeros, when only out is differentiated (one
    allocation, one fill kernel and a pass of the kernel over it saved per call); with lse used, its gradient."""
    from llm_attn import backward

    seen = []
    real = backward._reference_bwd
    monkeypatch.setattr(backward, "_reference_bwd", lambda *a: seen.append(a[6]) or real(*a))
    q, k, v = _inputs(1, 4, 2, 7, 7, 8, seed=12)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, path="reference")
    torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    assert seen[0] is None and seen[1] is not None and torch.all(seen[1] == 1)


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_forward_and_backward_ops(causal):
    q, k, v = _inputs(1, 4, 2, 5, 7, 8, torch.float32, seed=2)
    used = torch.tensor([6], dtype=torch.int32)
    for seqused in (None, used):
        torch.library.opcheck(_flash_fwd, (q, k, v, seqused, 0.35, causal, False))
        with torch.no_grad():
            out, lse = _flash_fwd(q, k, v, seqused, 0.35, causal, False)
        dout = torch.randn_like(out)
        for dlse in (None, torch.randn_like(lse)):
            torch.library.opcheck(_flash_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, dlse, seqused,
                                               0.35, causal, False))


def test_reference_backward_strided_inputs_keep_layout():
    """(B, S, H, D) tensors viewed as (B, H, S, D): gradients come back in the inputs' layout."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 9, 2, 8, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 2, 9, 8, generator=g).requires_grad_()
    out = flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    ref = attention_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                             flash_attn_func(q, k, v, causal=True, return_lse=True)[1].detach(), causal=True)
    for a, r in zip((dq, dk, dv), ref, strict=True):
        torch.testing.assert_close(a, r)


# -- a patched tiny Llama trains -------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed=0, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(over)
    model = LlamaForCausalLM(LlamaConfig(**kw))
    model.set_attn_implementation("sdpa")
    return model


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_patched_tiny_llama_training_gradients_match_sdpa():
    from llm_attn.patches import patched

    model = _tiny_llama().train()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _grads(model, ids)
    with patched(model, backend="reference") as report:
        loss, got = _grads(model, ids)
        assert report.native_calls == {"reference": 2} and report.num_fallback_calls == 0, str(report)
    assert got.keys() == ref.keys() and len(got) > 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_patched_training_with_dropout_is_refused_or_falls_back():
    from llm_attn.patches import UnsupportedModelError, patch_model, patched

    model = _tiny_llama(attention_dropout=0.1).train()
    with pytest.raises(UnsupportedModelError, match="dropout"):
        patch_model(model, backend="reference")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    with patched(model, backend="reference", on_unsupported="fallback") as report:
        model(ids, labels=ids).loss.backward()
        assert report.num_native_calls == 0 and report.num_fallback_calls == 2, str(report)


def test_deterministic_reaches_the_backward_op():
    """flash_attn_func(deterministic=True), or torch.use_deterministic_algorithms(True) when the backward runs (what
    a patched model follows), ask llm_attn::flash_bwd for the deterministic kernels; neither: the default ones. The
    reference path ignores it (deterministic anyway): the same gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    asked = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.llm_attn.flash_bwd.default:
                asked.append(bool(args[11]) if len(args) > 11 else bool((kwargs or {}).get("deterministic", False)))
            return func(*args, **(kwargs or {}))

    q, k, v = _inputs(1, 4, 2, 6, 9, 8, seed=5)
    grads = []
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        for det, flag in ((False, False), (True, False), (False, True)):
            torch.use_deterministic_algorithms(flag)
            for t in (q, k, v):
                t.grad = None
            with Record():
                flash_attn_func(q, k, v, causal=True, deterministic=det).sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
    finally:
        torch.use_deterministic_algorithms(prev)
    assert asked == [False, True, True]
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g, strict=True))

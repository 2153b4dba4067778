"""Patch target: models loaded with AutoAWQ's ``AutoAWQForCausalLM.from_quantized`` (written against AutoAWQ 0.2.6).

Two shapes of such a model:

* ``fuse_layers=False``: the AWQ wrapper holds an ordinary transformers model whose linears are ``WQLinear_*``; its
  attention modules are the stock ones, so we delegate to the transformers targets (``hf_attention_interface`` on
  transformers >= 4.53, ``hf_legacy`` on 4.4x) for the inner model.
* ``fuse_layers=True`` (AutoAWQ's default): every decoder layer became a ``LlamaLikeBlock`` whose attention is a
  ``QuantAttentionFused`` module with its own rolling KV cache (``WindowedCache``: V as (B, Hkv, S, D), K packed as
  (B, Hkv, D/8, S, 8)) and an inline matmul-softmax (or, for decode, the FasterTransformer extension). There is no
  hook inside, so we swap ``forward`` on each fused module instance for one that does the same projections, RoPE,
  batch-size and position bookkeeping and cache update, and computes attention with llm_attn:

  - prefill (seqlen > 1): the fused module attends over the current chunk only, with the causal mask
    ``LlamaLikeModel`` builds (verified once per forward, on the device); no mask means no masking, as in stock;
  - decode (seqlen == 1): non-causal over cache slots 0 .. start_pos, read in place for V and unpacked for K.

  ALiBi modules and modules driven by transformers' own AWQ fusing (``is_hf_transformers``) keep their forward
  (counted in the report, or an error under ``on_unsupported='error'``).
"""

from __future__ import annotations

import math
import sys
import weakref

import torch

from ._common import (
    SUPPORTED_MODEL_TYPES,
    AttentionRuntime,
    PatchOptions,
    PatchReport,
    SwappedForward,
    UnsupportedModelError,
    check_settings,
    module_device_dtype,
    restore_forwards,
    swap_forward,
)

TARGET_NAME = "AutoAWQ"


def _awq():
    # A model built by AutoAWQ means awq is imported already; importing it here for every other model would cost
    # seconds (it pulls in datasets) for nothing.
    if "awq" not in sys.modules:
        return None
    try:
        from awq.models.base import BaseAWQForCausalLM
        from awq.modules.fused.attn import QuantAttentionFused
    except Exception:  # not installed, or it failed to import against this transformers
        return None
    return BaseAWQForCausalLM, QuantAttentionFused


def _fused_modules(model, fused_cls):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, fused_cls)]


def _inner_model(model):
    return getattr(model, "model", None)


def _hf_targets():
    from . import hf_attention_interface, hf_legacy

    return (hf_attention_interface, hf_legacy)


def _hf_target(name: str):
    return next(t for t in _hf_targets() if t.__name__.rpartition(".")[2] == name)


def _config(model):
    cfg = getattr(model, "config", None)
    if cfg is None and _inner_model(model) is not None:
        cfg = getattr(_inner_model(model), "config", None)
    return cfg


def can_patch(model) -> tuple[bool, str]:
    awq = _awq()
    if awq is None:
        return False, "autoawq is not loaded (or does not import with this transformers)"
    base_cls, fused_cls = awq
    if not isinstance(model, base_cls) and not _fused_modules(model, fused_cls):
        return False, f"{type(model).__name__} is neither an AutoAWQ model nor holds AutoAWQ fused attention"
    cfg = _config(model)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {model_type!r} is not one of the verified types {SUPPORTED_MODEL_TYPES}"
    if not _fused_modules(model, fused_cls):
        inner = _inner_model(model)
        reasons = []
        for t in _hf_targets():
            ok, why = t.can_patch(inner)
            if ok:
                return True, "ok"
            reasons.append(f"{t.TARGET_NAME}: {why}")
        return False, "unfused AutoAWQ model, and no transformers target applies to it: " + "; ".join(reasons)
    return True, "ok"


class _CausalMaskCheck:
    """Is the prefill mask exactly causal over the chunk? Checked once per forward pass (one mask, every layer)."""

    def __init__(self):
        self._ref = None
        self._result = False

    def __getstate__(self) -> dict:  # a weak reference does not pickle; a copy checks its next mask afresh
        return {"_ref": None, "_result": False}

    def __call__(self, mask: torch.Tensor, seqlen: int) -> bool:
        if self._ref is not None and self._ref() is mask:
            return self._result
        m = mask[:, :, :seqlen, :seqlen] if mask.shape[-1] != seqlen else mask
        ok = False
        if m.dim() == 4 and tuple(m.shape[-2:]) == (seqlen, seqlen) and m.is_floating_point():
            idx = torch.arange(seqlen, device=m.device)
            visible = idx[None, :] <= idx[:, None]
            ok = bool(torch.where(visible, m == 0, m <= torch.finfo(m.dtype).min).all())  # one host sync
        self._ref, self._result = weakref.ref(mask), ok
        return ok


class _FusedForward(SwappedForward):
    """The forward put on one ``QuantAttentionFused`` module (a picklable object: see ``SwappedForward``)."""

    def __init__(self, module, attr, previous, runtime: AttentionRuntime, mask_check: _CausalMaskCheck):
        super().__init__(module, attr, previous)
        self.runtime, self.mask_check = runtime, mask_check

    def plan(self, hidden_states, attention_mask):
        m, runtime = self.module, self.runtime
        if runtime.forced:
            return None, runtime.forced[0], True
        if m.use_alibi:
            return None, "ALiBi attention bias is not implemented by llm_attn", True
        if m.is_hf_transformers:
            return None, "fused AWQ modules driven by transformers' own AWQ fusing are not verified", True
        variant, why = runtime.choose_variant_for(hidden_states.device, hidden_states.dtype, m.head_dim)
        if variant is None:
            return None, why, True
        seqlen = hidden_states.shape[1]
        if seqlen == 1:
            return variant, False, None  # stock ignores the mask for a single query: all cached keys
        if attention_mask is None:
            return variant, False, None  # stock adds no mask: every key of the chunk
        if self.mask_check(attention_mask, seqlen):
            return variant, True, None
        return None, "fused prefill mask is not the plain causal mask: stock attention", False

    def __call__(self, hidden_states, attention_mask=None, *args, **kwargs):
        runtime = self.runtime
        variant, causal, flag = self.plan(hidden_states, attention_mask)
        if variant is None:
            if flag:
                runtime.setting_unsupported(causal)
            else:
                runtime.count_fallback(causal)
            return self.original(hidden_states, attention_mask, *args, **kwargs)

        m = self.module
        shapes = m.attention_shapes
        bsz, seqlen, _ = hidden_states.shape
        # Same bookkeeping as the stock forward: the cache follows the batch size, and a new size restarts at 0.
        if bsz != m.cache_batch_size:
            if bsz > m.cache_batch_size:
                m.cache.increase_batch_size(bsz)
            else:
                m.cache.decrease_batch_size(bsz)
            m.cache_batch_size = bsz
            m.start_pos = 0

        xqkv = m.qkv_proj(hidden_states).view((bsz, seqlen) + shapes["xqkv_view"])
        xq = shapes["xq_slice"](xqkv).view((bsz, seqlen) + shapes["xq_view"])
        xk = shapes["xk_slice"](xqkv).view((bsz, seqlen) + shapes["xk_view"])
        xv = shapes["xv_slice"](xqkv).view((bsz, seqlen) + shapes["xv_view"])
        if m.partial_rotary_factor < 1:
            rd = m.rotary_dim
            q_rot, k_rot = m.rope.forward(xq[..., :rd], xk[..., :rd], m.start_pos, seqlen)
            xq = torch.cat((q_rot, xq[..., rd:]), dim=-1)
            xk = torch.cat((k_rot, xk[..., rd:]), dim=-1)
        else:
            xq, xk = m.rope.forward(xq, xk, m.start_pos, seqlen)

        # The cache stores K packed for FasterTransformer; the stock torch path and its CUDA decode kernel share it.
        keys_store = xk.reshape((bsz, seqlen) + shapes["xk_reshape"]).permute(0, 2, 3, 1, 4).contiguous()
        m.cache.to(xq)
        m.cache.update_kv(xv.transpose(2, 1), keys_store, bsz, m.start_pos, seqlen)

        query = xq.transpose(1, 2)                                    # (B, H, S, D)
        if seqlen == 1:
            n = m.start_pos + 1
            value = m.cache.v[:bsz, :, :n, :]                         # (B, Hkv, n, D), read in place
            kp = m.cache.k[:bsz, :, :, :n, :]                         # (B, Hkv, D/8, n, 8)
            key = kp.permute(0, 1, 3, 2, 4).reshape(bsz, kp.shape[1], n, m.head_dim)
        else:
            key, value = xk.transpose(1, 2), xv.transpose(1, 2)       # the chunk only, as stock
        out = runtime.run(variant, query, key, value, causal=causal, scale=1.0 / math.sqrt(m.head_dim))
        runtime.count_native(variant)
        attention_weight = out.reshape(bsz, seqlen, -1)
        attn_output = m.o_proj(attention_weight)
        m.start_pos += seqlen
        # Stock returns a dummy cache whose length tells callers how many positions were seen.
        past_key_value = [torch.zeros(1, 1, m.start_pos, 1)]
        return attn_output, attention_weight, past_key_value


def patch(model, options: PatchOptions) -> tuple[PatchReport, dict]:
    _, fused_cls = _awq()
    fused = _fused_modules(model, fused_cls)
    if not fused:
        inner = _inner_model(model)
        for t in _hf_targets():
            if t.can_patch(inner)[0]:
                report, undo = t.patch(inner, options)
                report.target = f"{TARGET_NAME} (unfused) -> {report.target}"
                report.patched_modules[:] = [f"model.{n}" for n in report.patched_modules]
                # The target's name, not the module: the model's patch state must pickle (patches/__init__.py).
                return report, {"delegate": (t.__name__.rpartition(".")[2], inner, undo)}
        raise AssertionError("can_patch said yes but no transformers target applies")  # pragma: no cover

    cfg = _config(model)
    report = PatchReport(target=f"{TARGET_NAME} (fused QuantAttentionFused)", impl=options.impl,
                         backend=options.backend, on_unsupported=options.on_unsupported,
                         model_type=getattr(cfg, "model_type", None))
    device, dtype = module_device_dtype(fused[0][1])
    forced = check_settings(report, options, cfg, training=model.training, device=device, dtype=dtype)
    problems = [f"{name}: " + ("ALiBi attention bias is not implemented" if m.use_alibi else
                               "driven by transformers' own AWQ fusing (not verified)")
                for name, m in fused if m.use_alibi or m.is_hf_transformers]
    if problems and options.on_unsupported == "error":
        raise UnsupportedModelError("llm_attn cannot patch this AutoAWQ model: " + "; ".join(problems)
                                    + ". Patch with on_unsupported='fallback' to keep the stock attention there.")
    report.fallbacks.extend(problems)
    runtime = AttentionRuntime(options, report, forced)
    mask_check = _CausalMaskCheck()
    undo = []
    for name, m in fused:
        undo.append(swap_forward(m, lambda module, attr, previous: _FusedForward(module, attr, previous, runtime,
                                                                                 mask_check)))
        report.patched_modules.append(name)
    return report, {"modules": undo}


def unpatch(model, undo: dict) -> None:
    if "delegate" in undo:
        name, inner, inner_undo = undo["delegate"]
        _hf_target(name).unpatch(inner, inner_undo)
        return
    restore_forwards(undo["modules"])


def on_load(undo: dict) -> None:
    """A patched model was unpickled or deep-copied: give the delegate target its process-wide set-up."""
    if "delegate" in undo:
        name, _, inner_undo = undo["delegate"]
        loaded = getattr(_hf_target(name), "on_load", None)
        if loaded is not None:
            loaded(inner_undo)

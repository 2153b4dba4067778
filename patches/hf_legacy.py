"""Patch target: transformers 4.4x (no ``AttentionInterface``), e.g. the original stack transformers 4.45 + AutoAWQ.

There, attention lives inside per-implementation module classes (``LlamaSdpaAttention``, ``LlamaAttention`` for eager,
and their Mistral/Qwen2 copies) whose ``forward`` projects q/k/v, applies RoPE, updates the cache and then calls
``F.scaled_dot_product_attention`` (or the eager matmul-softmax) inline. There is no narrower hook than that forward,
so we swap ``forward`` on each attention module *instance* (the class is untouched; other models are unaffected) and
restore it exactly on unpatch. When accelerate hooks wrap the module (``device_map``), we swap the ``_old_forward`` the
hook calls, so the hook keeps moving tensors between devices.

Every call first decides, from its arguments alone and before touching the cache, whether llm_attn computes exactly
what the stock class would:

* mask ``None`` (4.4x's sdpa path skips the mask only with no padding and q_len == 1 or q_len == kv_len): non-causal
  decode / causal prefill on the kernel;
* a 4D float mask (eager always builds one; sdpa builds one for a ``StaticCache``, for chunks over a cache and for
  padding): if it is exactly "query i sees keys 0 .. cache_position[i]" (checked once per forward pass on the device,
  one host sync, cached by mask identity), the kernel with ``seqused_k = cache_position[-1] + 1`` and bottom-right
  causality; otherwise the original forward runs unchanged (counted as a fallback);
* anything we do not implement (output_attentions, pretraining_tp > 1, dropout in training, a dtype/head_dim/device
  the chosen variant lacks): the original forward, or an error under ``on_unsupported='error'``.
"""

from __future__ import annotations

import sys
import weakref

import torch

from ._common import (
    SUPPORTED_MODEL_TYPES,
    AttentionRuntime,
    PatchOptions,
    PatchReport,
    SwappedForward,
    restore_forwards,
    start_patch,
    swap_forward,
)

TARGET_NAME = "transformers 4.4x attention modules (instance forward)"
# The attention classes whose forward we re-implement (verified against transformers 4.45.2 in
# tests/test_patches_legacy.py). Flash-attention-2 classes use 2D masks with other conventions: not patched.
_CLASSES = {f"{p}{kind}" for p in ("Llama", "Mistral", "Qwen2") for kind in ("Attention", "SdpaAttention")}


def _has_attention_interface() -> bool:
    try:
        from transformers import AttentionInterface  # noqa: F401
    except ImportError:
        return False
    return True


def _attention_modules(model):
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__ in _CLASSES and hasattr(m, "q_proj") and hasattr(m, "o_proj")]


def can_patch(model) -> tuple[bool, str]:
    if _has_attention_interface():
        return False, "this transformers has AttentionInterface (the legacy target is for 4.4x)"
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False, f"{type(model).__name__} is not a transformers PreTrainedModel"
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {model_type!r} is not one of the verified types {SUPPORTED_MODEL_TYPES}"
    if not _attention_modules(model):
        names = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        return False, f"no attention module of a supported class ({sorted(_CLASSES)}); found {names}"
    return True, "ok"


class _MaskAnalysis:
    """Caches, per forward pass, whether the 4D mask is a causal prefix (the same mask object reaches every layer)."""

    def __init__(self):
        self._key = None
        self._result = None

    def __getstate__(self) -> dict:  # weak references do not pickle; a copy analyses its next mask afresh
        return {"_key": None, "_result": None}

    def seqused(self, mask: torch.Tensor, cache_position: torch.Tensor, kv_len: int, batch: int):
        key = (id(mask), id(cache_position), kv_len)
        # ids can be reused once an object dies: the weak references tell whether it is still the same object.
        if (self._key is not None and self._key[0] == key and self._key[1]() is mask
                and self._key[2]() is cache_position):
            return self._result
        result = self._analyse(mask, cache_position, kv_len, batch)
        self._key = (key, weakref.ref(mask), weakref.ref(cache_position))
        self._result = result
        return result

    @staticmethod
    def _analyse(mask, cache_position, kv_len, batch):
        q_len = cache_position.shape[0]
        if mask.dim() != 4 or mask.shape[-1] < kv_len or mask.shape[-2] != q_len or mask.shape[0] not in (1, batch):
            return None
        m = mask[:, :, :, :kv_len]
        if m.dtype == torch.bool:
            visible, hidden = m, ~m
        elif m.is_floating_point():
            visible = m == 0
            hidden = m <= torch.finfo(m.dtype).min  # stock masks use finfo.min (or -inf)
        else:
            return None
        pos = cache_position.to(m.device)
        expected = torch.arange(kv_len, device=m.device)[None, :] <= pos[:, None]  # (q, kv)
        consecutive = (pos == pos[0] + torch.arange(q_len, device=m.device)).all()
        ok = consecutive & (pos[-1] < kv_len) & torch.where(expected, visible, hidden).all()
        if not bool(ok):  # the one host sync per forward pass
            return None
        return (pos[-1:] + 1).to(torch.int32).expand(batch).contiguous()


class _LegacyForward(SwappedForward):
    """The forward put on one 4.4x attention module (a picklable object: see ``SwappedForward``)."""

    def __init__(self, module, attr, previous, runtime: AttentionRuntime, analysis: _MaskAnalysis):
        super().__init__(module, attr, previous)
        self.runtime, self.analysis = runtime, analysis

    def plan(self, hidden_states, attention_mask, past_key_value, cache_position, output_attentions):
        """(variant, causal, seqused_k) for the kernel, or (None, reason, is_setting) for the original forward."""
        # Every 4.4x has both.
        from transformers.cache_utils import DynamicCache, StaticCache

        module, runtime = self.module, self.runtime
        if runtime.forced:
            return None, runtime.forced[0], True
        if output_attentions:
            return None, "output_attentions=True needs the attention weights", False
        if getattr(module.config, "pretraining_tp", 1) > 1:
            return None, f"pretraining_tp={module.config.pretraining_tp} is not implemented", True
        if module.training and module.attention_dropout > 0:
            return None, f"attention dropout in training mode (p={module.attention_dropout}) is not implemented", True
        variant, why = runtime.choose_variant_for(hidden_states.device, hidden_states.dtype, module.head_dim)
        if variant is None:
            return None, why, True
        bsz, q_len = hidden_states.shape[:2]
        if attention_mask is None:
            if q_len == 1:
                return variant, False, None
            past = 0
            if past_key_value is not None:
                if not isinstance(past_key_value, DynamicCache):
                    return None, "no mask with a non-dynamic cache", False
                past = past_key_value.get_seq_length(module.layer_idx)
            if past != 0:  # stock sdpa's is_causal is top-left: differs from ours over a non-empty cache
                return None, "no mask, causal chunk over a non-empty cache", False
            return variant, True, None
        if cache_position is None:
            return None, "a mask without cache_position", False
        if past_key_value is None:
            kv_len = q_len
        elif isinstance(past_key_value, StaticCache):
            kv_len = past_key_value.get_max_length()
        elif isinstance(past_key_value, DynamicCache):
            kv_len = past_key_value.get_seq_length(module.layer_idx) + q_len
        else:
            return None, f"cache type {type(past_key_value).__name__} is not verified", False
        seqused = self.analysis.seqused(attention_mask, cache_position, kv_len, bsz)
        if seqused is None:
            return None, "attention mask is not a causal prefix (padding or custom mask): stock attention", False
        why = runtime.seqused_problem(variant)
        if why is not None:
            return None, why, False
        return variant, True, seqused

    def __call__(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                 output_attentions=False, use_cache=False, cache_position=None, position_embeddings=None, **kwargs):
        runtime = self.runtime
        variant, causal, seqused = self.plan(hidden_states, attention_mask, past_key_value, cache_position,
                                             output_attentions)
        if variant is None:
            reason, is_setting = causal, seqused
            if is_setting:
                runtime.setting_unsupported(reason)
            else:
                runtime.count_fallback(reason)
            return self.original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_value=past_key_value, output_attentions=output_attentions,
                                 use_cache=use_cache, cache_position=cache_position,
                                 position_embeddings=position_embeddings, **kwargs)

        # The stock forward up to the attention maths (same projections, RoPE and cache update).
        bsz, q_len, _ = hidden_states.size()
        m = self.module
        apply_rotary_pos_emb = sys.modules[type(m).__module__].apply_rotary_pos_emb
        query = m.q_proj(hidden_states).view(bsz, q_len, m.num_heads, m.head_dim).transpose(1, 2)
        key = m.k_proj(hidden_states).view(bsz, q_len, m.num_key_value_heads, m.head_dim).transpose(1, 2)
        value = m.v_proj(hidden_states).view(bsz, q_len, m.num_key_value_heads, m.head_dim).transpose(1, 2)
        if position_embeddings is None:
            cos, sin = m.rotary_emb(value, position_ids)
        else:
            cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_value is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key, value = past_key_value.update(key, value, m.layer_idx, cache_kwargs)
        # GQA: K/V stay un-repeated; the kernel maps query head h to KV head h // num_key_value_groups, as repeat_kv.
        out = runtime.run(variant, query, key, value, causal=causal, scale=None, seqused_k=seqused)
        runtime.count_native(variant)
        out = m.o_proj(out.reshape(bsz, q_len, -1))
        return out, None, past_key_value


def patch(model, options: PatchOptions) -> tuple[PatchReport, dict]:
    modules = _attention_modules(model)
    report, forced = start_patch(model, options, TARGET_NAME, modules)
    runtime = AttentionRuntime(options, report, forced)
    analysis = _MaskAnalysis()
    undo = []
    for name, m in modules:
        undo.append(swap_forward(m, lambda module, attr, previous: _LegacyForward(module, attr, previous, runtime,
                                                                                  analysis)))
        report.patched_modules.append(name)
    return report, {"modules": undo}


def unpatch(model, undo: dict) -> None:
    restore_forwards(undo["modules"])

"""A model's own attention inputs for the kernel accuracy benchmark (``python -m llm_attn.bench --mode accuracy
--capture MODEL``): the Q, K and V that its attention layers receive in one stock prefill (after RoPE, as every
kernel gets them), so that each implementation's error against float64 is measured on what a real model feeds it,
beside the synthetic input kinds of ``harness.accuracy``.

How: a temporary attention-registry entry is patched into the model (``patch_model``, the path every
implementation takes). It keeps the tensors of the layers asked for and answers every call with PyTorch SDPA, so
the forward is stock's and the layers after a captured one see stock's activations. The i-th attention call of
one forward is layer i (each decoder layer attends once).

    python -m llm_attn.bench --mode accuracy --capture /tmp/tinylm --prompts /tmp/tinylm/heldout.jsonl --seqs 2048
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_NAMES = itertools.count()


@dataclass
class CapturedLayer:
    """One attention call's inputs: q (B, Hq, S, D), k and v (B, Hkv, S, D), as the call received them."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float

    def stats(self) -> dict:
        """What makes these inputs hard for a quantised kernel, in numbers: the largest |value| of each, the
        strongest K channel bias against K's typical spread (the outlier columns that the synthetic ``k_outliers``
        kind plants at 10-50x), and the spread of the scores q.k * scale (the synthetic ``peaky`` kind's 4)."""
        k = self.k.float()
        mean = k.mean(dim=2)  # (B, Hkv, D): each channel's bias over the sequence
        spread = k.std(dim=2).median().clamp_min(1e-30)
        q = self.q.float()[:, :, -64:]  # the last rows: scores against every key
        b, hq, s, d = q.shape
        # Query head h reads KV head h // groups: grouped, so K is not copied per query head.
        q = q.view(b, k.shape[1], hq // k.shape[1], s, d)
        scores = torch.einsum("bkgsd,bktd->bkgst", q, k) * self.scale
        return {"q_absmax": float(q.abs().max()), "k_absmax": float(k.abs().max()),
                "v_absmax": float(self.v.float().abs().max()),
                "k_bias_over_spread": float(mean.abs().max() / spread),
                "score_std": float(scores.std(dim=-1).mean())}


def capture_qkv(model, input_ids: torch.Tensor, layers: Sequence[int] | None = None) -> list[CapturedLayer]:
    """The inputs of the attention layers ``layers`` (None: all) in one prefill of ``input_ids`` (no cache), in
    layer order. ValueError for a layer the model does not have."""
    from llm_attn import registry  # noqa: PLC0415
    from llm_attn.patches import patch_model, unpatch_model  # noqa: PLC0415

    want = None if layers is None else sorted(set(int(i) for i in layers))
    calls: list[CapturedLayer | None] = []

    def record(q, k, v, *, causal, scale, seqused_k=None, **_):
        if seqused_k is not None or q.shape[2] != k.shape[2]:
            raise RuntimeError("capture_qkv takes one prefill without a cache: every call has q_len == kv_len")
        i = len(calls)
        keep = want is None or i in want
        calls.append(CapturedLayer(i, q.detach().clone(), k.detach().clone(), v.detach().clone(), bool(causal),
                                   float(scale)) if keep else None)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])

    name = f"capture{next(_NAMES)}"
    registry.register_attention(name, record, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                                devices=("cuda", "cpu"), description="captures attention inputs, answers with SDPA")
    try:
        patch_model(model, impl=name, on_unsupported="error")
        try:
            with torch.inference_mode():
                model(input_ids=input_ids, use_cache=False)
        finally:
            unpatch_model(model)
    finally:
        registry.unregister_attention(name)
    if want is not None and want and want[-1] >= len(calls):
        raise ValueError(f"layers {[i for i in want if i >= len(calls)]}: the model has {len(calls)} attention "
                         f"layers (0..{len(calls) - 1})")
    return [c for c in calls if c is not None]


def default_layers(n_layers: int) -> list[int]:
    """First, middle and last: where activations differ most in a trained model (the first layer's inputs are
    embeddings, the last's the most processed)."""
    return sorted({0, n_layers // 2, n_layers - 1})

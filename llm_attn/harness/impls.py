"""How a loaded model is switched between the attention implementations of ``llm_attn.registry``.

Stock entries (``eager``, ``sdpa``, ``flash_attention_2``: those with an ``hf_name``) go through transformers' own
switch, ``model.set_attn_implementation(hf_name)``: the model keeps its weights, only the attention function its
layers dispatch to changes, exactly as users run it. Every other entry — ours, the built-in peers, plugins — runs on
stock ``sdpa`` as the base implementation with ``llm_attn.patches.patch_model(model, impl=name)`` swapping it in;
leaving the context unpatches the model again. Nothing here knows any implementation by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llm_attn import registry

# The stock implementation every non-stock one is compared against (correctness) and patched on top of.
BASE_IMPL = "sdpa"


def unavailable_reason(impl: str, device: torch.device | str) -> str | None:
    """Why ``impl`` cannot run here, or None when it can."""
    return registry.unavailable_reason(impl, device)


def available_impls(device: torch.device | str) -> list[str]:
    """The default comparison: the registry's default entries (stock ones, then ours) that run here."""
    return registry.default_impls(device)


def is_stock(impl: str) -> bool:
    return registry.get(impl).stock


def impl_info(impl: str) -> dict:
    """What a result row records about an implementation: name, source (built-in / plugin path / package and
    version), description and what it declared it supports."""
    return registry.get(impl).info()


@contextmanager
def use_impl(model: torch.nn.Module, impl: str) -> Iterator[object | None]:
    """Switch ``model`` to ``impl`` for the duration of the block. Yields the PatchReport of a patched
    implementation (its counters say how many attention calls it served and how many fell back to stock), None for
    stock implementations."""
    entry = registry.get(impl)
    if entry.stock:
        model.set_attn_implementation(entry.hf_name)
        yield None
        return
    from llm_attn.patches import patch_model, unpatch_model  # noqa: PLC0415 (transformers only when patching)

    model.set_attn_implementation(BASE_IMPL)
    report = patch_model(model, impl=impl)
    try:
        yield report
    finally:
        unpatch_model(model)

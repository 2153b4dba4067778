"""Attention implementations the harness compares, and how a loaded model is switched between them.

Stock implementations go through transformers' own switch, ``model.set_attn_implementation(name)``: the model
keeps its weights, only the attention function its layers dispatch to changes. Ours, ``llm_attn``, is stock
``sdpa`` as the base implementation with ``llm_attn.patches.patch_model`` swapping our kernel in; leaving the
context unpatches the model again.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import torch

STOCK_IMPLS = ("eager", "sdpa", "flash_attention_2")
OURS = "llm_attn"
ALL_IMPLS = STOCK_IMPLS + (OURS,)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def unavailable_reason(impl: str, device: torch.device | str) -> str | None:
    """Why ``impl`` cannot run here, or None when it can."""
    device = torch.device(device)
    if impl not in ALL_IMPLS:
        return f"unknown implementation {impl!r}; choose from {', '.join(ALL_IMPLS)}"
    if impl == "flash_attention_2":
        if device.type != "cuda":
            return "flash_attention_2 needs a CUDA GPU"
        if not flash_attn_installed():
            return "flash_attention_2 needs the flash_attn package, which is not installed (pip install flash-attn)"
    return None


def available_impls(device: torch.device | str) -> list[str]:
    """The default comparison: every stock implementation that runs here, then ours."""
    return [i for i in ALL_IMPLS if unavailable_reason(i, device) is None]


@contextmanager
def use_impl(model: torch.nn.Module, impl: str) -> Iterator[object | None]:
    """Switch ``model`` to ``impl`` for the duration of the block. Yields the PatchReport for ours (its counters
    say how many attention calls ran our kernel and how many fell back), None for stock implementations."""
    if impl == OURS:
        from llm_attn.patches import patch_model, unpatch_model  # noqa: PLC0415 (only ours needs the registry)

        model.set_attn_implementation("sdpa")
        report = patch_model(model, impl=OURS)
        try:
            yield report
        finally:
            unpatch_model(model)
    elif impl in STOCK_IMPLS:
        model.set_attn_implementation(impl)
        yield None
    else:
        raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(ALL_IMPLS)}")

"""llm_attn.patches: one call swaps a registered attention implementation (ours by default, or any entry of
``llm_attn.registry``) into a Hugging Face model, one call gives the stock one back.

    from llm_attn.patches import patch_model, unpatch_model, patched

    report = patch_model(model)            # in place; returns a PatchReport
    out = model.generate(**inputs)         # attention now runs on llm_attn (CUDA kernel, or the reference on CPU)
    print(report)                          # what was patched, what falls back and why, live call counters
    unpatch_model(model)                   # the stock attention again, bit for bit

    with patched(model, on_unsupported="fallback") as report:
        ...

The registry holds one target per way of plugging attention into a model, each in its own module with
``can_patch(model) -> (bool, reason)``, ``patch(model, options) -> (report, undo)`` and ``unpatch(model, undo)``;
``patch_model`` uses the first target that applies:

* ``autoawq``: models from AutoAWQ's ``from_quantized`` (its own fused attention modules when it fused layers,
  otherwise the transformers model inside it, through one of the two targets below);
* ``hf_attention_interface``: transformers' ``AttentionInterface`` + ``AttentionMaskInterface`` (transformers >= 4.53);
* ``hf_legacy``: transformers 4.4x without that registry: the attention modules' ``forward`` is swapped per instance.

Run the tests: ``pytest tests/test_patches.py`` (CPU), ``tests/test_patches_gpu.py`` (CUDA),
``tests/test_patches_legacy.py`` (in a venv with transformers 4.45.2, see that file).
"""

from __future__ import annotations

import contextlib

from . import autoawq, hf_attention_interface, hf_legacy
from ._common import SUPPORTED_MODEL_TYPES, PatchOptions, PatchReport, UnsupportedModelError

# Order matters: the most specific target first.
TARGETS = (autoawq, hf_attention_interface, hf_legacy)
STATE_ATTR = "_llm_attn_patch_state"

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TARGETS",
    "PatchReport",
    "UnsupportedModelError",
    "is_patched",
    "patch_model",
    "patched",
    "unpatch_model",
]


def _target_by_name(name: str | None):
    for target in TARGETS:
        if target.__name__.rpartition(".")[2] == name:
            return target
    if name is None:
        return None
    raise ValueError(f"unknown llm_attn patch target {name!r}")  # pragma: no cover - a state from another version


class _PatchState:
    """What ``model.__dict__[STATE_ATTR]`` holds. Only names and plain data (and parts of the model itself, in
    ``undo``), never a module object: a patched model deep-copies, pickles and ``torch.save``s with its patch, and
    the copy is patched, counts its own calls in its own report, and unpatches on its own."""

    def __init__(self, target, options: PatchOptions, report: PatchReport, undo):
        self.target_name = None if target is None else target.__name__.rpartition(".")[2]
        self.options, self.report, self.undo = options, report, undo

    @property
    def target(self):
        return _target_by_name(self.target_name)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # A target may need process-wide set-up that a pickle does not carry (transformers' registry entry).
        loaded = getattr(self.target, "on_load", None)
        if loaded is not None:
            loaded(self.undo)


def _state(model):
    return getattr(model, "__dict__", {}).get(STATE_ATTR)


def is_patched(model) -> bool:
    """True while ``model`` carries a patch from patch_model (even one that patched nothing)."""
    return _state(model) is not None


def patch_model(model, impl: str = "llm_attn", on_unsupported: str = "error", backend: str = "auto") -> PatchReport:
    """Patch ``model`` in place so that its attention runs on llm_attn; return a PatchReport.

    Args:
        model: a transformers Llama-family model (llama, mistral without sliding window, qwen2 without sliding
            window), or a model from AutoAWQ's ``from_quantized``.
        impl: the registered attention implementation to swap in (``llm_attn.registry``): "llm_attn" (ours), a
            built-in peer ("naive", "flex", "numba", or a stock one's maths: "sdpa", "eager"), or a plugin's
            name. Calls it cannot take run the stock attention, counted in the report.
        on_unsupported: "error" raises UnsupportedModelError (a ValueError) at patch time for a model or setting
            llm_attn cannot run (and at call time if a setting changes later, e.g. training mode with dropout);
            "fallback" keeps the stock attention for those calls and counts them in the report.
        backend: "auto" (the CUDA kernel for CUDA tensors, the PyTorch reference on CPU), "cuda" (the kernel only:
            a model on CPU is unsupported) or "reference" (the reference on any device, for debugging).

    Patching an already patched model with the same arguments returns its report and changes nothing; with other
    arguments it is unpatched and patched anew.
    """
    if not hasattr(model, "named_modules"):
        raise TypeError(f"patch_model expects a torch.nn.Module, got {type(model).__name__}")
    options = PatchOptions(impl=impl, on_unsupported=on_unsupported, backend=backend)
    options.validate()
    state = _state(model)
    if state is not None:
        if state.options == options:
            return state.report
        unpatch_model(model)

    reasons = []
    for target in TARGETS:
        ok, reason = target.can_patch(model)
        if ok:
            report, undo = target.patch(model, options)
            model.__dict__[STATE_ATTR] = _PatchState(target, options, report, undo)
            return report
        reasons.append(f"{target.TARGET_NAME}: {reason}")
    message = f"no llm_attn patch target applies to {type(model).__name__}: " + "; ".join(reasons)
    if on_unsupported == "error":
        raise UnsupportedModelError(message)
    report = PatchReport(target=None, impl=impl, backend=backend, on_unsupported=on_unsupported,
                         model_type=getattr(getattr(model, "config", None), "model_type", None),
                         expected_path="stock attention (nothing patched)")
    report.fallbacks.append(f"the whole model: {message}")
    model.__dict__[STATE_ATTR] = _PatchState(None, options, report, None)
    return report


def unpatch_model(model) -> None:
    """Restore the attention ``model`` had before patch_model. A model that is not patched is left as it is."""
    state = _state(model)
    if state is None:
        return
    if state.target is not None:
        state.target.unpatch(model, state.undo)
    del model.__dict__[STATE_ATTR]


@contextlib.contextmanager
def patched(model, impl: str = "llm_attn", on_unsupported: str = "error", backend: str = "auto"):
    """``with patched(model) as report:`` patches for the block and restores afterwards. A model that was already
    patched before the block is patched as before after it."""
    before = _state(model)
    report = patch_model(model, impl=impl, on_unsupported=on_unsupported, backend=backend)
    keep = before is not None and _state(model) is before
    try:
        yield report
    finally:
        if not keep:
            unpatch_model(model)
            if before is not None:  # it was patched with other arguments before the block: put that back
                o = before.options
                patch_model(model, impl=o.impl, on_unsupported=o.on_unsupported, backend=o.backend)

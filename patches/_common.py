"""Pieces every patch target shares: options, the report, the runtime that decides kernel vs. stock per call, and
the patch-time checks of a model's attention settings.

A target (``hf_attention_interface``, ``hf_legacy``, ``autoawq``) finds the attention modules of a model and swaps a
registered attention implementation in (``llm_attn.registry``: ours, a built-in peer, or a plugin); for every
attention call it asks an ``AttentionRuntime`` whether this call can run on that implementation (and on which of its
variants) or must take the stock path, and the runtime counts the answer in the model's ``PatchReport``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from llm_attn import registry
from llm_attn.kernel_contract import KERNEL_HEAD_DIMS
from llm_attn.kv_cache_reference import FP8_READ_VIA_COPY, Fp8KV, fp8_kv_of, is_placeholder

ON_UNSUPPORTED = ("error", "fallback")
BACKENDS = registry.BACKENDS

# Model types whose attention we have checked against the stock path in tests (tests/test_patches*.py). Anything else
# is refused: a model family we have not compared may add a bias, a sink or a window that we would silently drop.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The model, or one of its settings, cannot run on the implementation (raised when ``on_unsupported='error'``)."""


@dataclasses.dataclass(frozen=True)
class PatchOptions:
    impl: str = "llm_attn"
    on_unsupported: str = "error"
    backend: str = "auto"

    def validate(self) -> None:
        if self.impl not in registry.names():
            raise ValueError(f"impl must be a registered attention implementation ({', '.join(registry.names())}), "
                             f"got {self.impl!r}")
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {self.on_unsupported!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclasses.dataclass
class PatchReport:
    """What ``patch_model`` did, and live counters of what every attention call since then did.

    ``native_calls`` counts calls served by the implementation ``impl``, keyed by its variant (for llm_attn: 'cuda'
    = the CUDA kernel, 'reference' = the tiled PyTorch reference; for other entries the device type).
    ``fallback_calls`` counts calls that took the stock path, keyed by the reason. Calls
    inside a ``torch.compile``d graph (e.g. transformers' auto-compiled decode with a static cache on GPU; pass
    ``disable_compile=True`` to ``generate`` to count them) are not counted: a Python counter bumped while dynamo
    traces would be replayed as a constant. ``compiled_native_seen`` / ``compiled_fallback_seen`` say which paths
    some compiled graph contains.
    """

    target: str | None
    impl: str
    backend: str
    on_unsupported: str
    model_type: str | None = None
    expected_path: str | None = None
    patched_modules: list[str] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    native_calls: Counter = dataclasses.field(default_factory=Counter)
    fallback_calls: Counter = dataclasses.field(default_factory=Counter)
    # Calls whose K/V came from a quantised KV cache, by how they were read (kv_cache_reference.FP8_READ_*: directly
    # by the decode or the prefill kernel or their blockwise reference, or via the dequantised copy). Counted beside
    # the two above.
    kv_cache_reads: Counter = dataclasses.field(default_factory=Counter)
    compiled_native_seen: bool = False
    compiled_fallback_seen: bool = False

    impl_source: dict | None = None

    @property
    def active(self) -> bool:
        """True when some attention module now runs through the implementation."""
        return bool(self.patched_modules)

    @property
    def num_patched(self) -> int:
        return len(self.patched_modules)

    @property
    def num_native_calls(self) -> int:
        return sum(self.native_calls.values())

    @property
    def num_fallback_calls(self) -> int:
        return sum(self.fallback_calls.values())

    def reset_counters(self) -> None:
        self.native_calls.clear()
        self.fallback_calls.clear()
        self.kv_cache_reads.clear()
        self.compiled_native_seen = self.compiled_fallback_seen = False

    def __str__(self) -> str:
        lines = [f"llm_attn patch report: target={self.target or 'none'} impl={self.impl} backend={self.backend} "
                 f"on_unsupported={self.on_unsupported} model_type={self.model_type}"]
        if self.expected_path:
            lines.append(f"  attention runs on: {self.expected_path}")
        mods = self.patched_modules
        shown = ", ".join(mods[:3]) + (f", ... ({len(mods)} in all)" if len(mods) > 3 else "")
        lines.append(f"  patched modules: {len(mods)}" + (f" [{shown}]" if mods else ""))
        for f in self.fallbacks:
            lines.append(f"  falls back: {f}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        native = ", ".join(f"{k}={v}" for k, v in sorted(self.native_calls.items())) or "0"
        lines.append(f"  calls on {self.impl}: {self.num_native_calls} ({native})")
        lines.append(f"  calls on the stock path: {self.num_fallback_calls}")
        for reason, n in self.fallback_calls.most_common():
            lines.append(f"    {n} x {reason}")
        for how, n in self.kv_cache_reads.most_common():
            lines.append(f"  KV cache: {n} x {how}")
        if self.compiled_native_seen or self.compiled_fallback_seen:
            paths = [p for p, seen in ((self.impl, self.compiled_native_seen),
                                       ("the stock path", self.compiled_fallback_seen)) if seen]
            lines.append(f"  torch.compile graphs also call {' and '.join(paths)} (not counted above)")
        return "\n".join(lines)


def _is_compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def backend_problem(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                    impl: str = "llm_attn") -> tuple[str | None, str | None]:
    """Which variant of ``impl`` serves tensors like these: (variant, None) or (None, why not)."""
    return registry.get(impl).choose(device, dtype, head_dim, backend)


class AttentionRuntime:
    """Per-patch state consulted by every patched attention call: options, counters, and the implementation call."""

    def __init__(self, options: PatchOptions, report: PatchReport, forced: list[str] | None = None):
        self.options = options
        self.report = report
        self.impl = registry.get(options.impl)
        # Config problems found at patch time (under on_unsupported='fallback'): every call takes the stock path.
        self.forced = list(forced or [])
        # (device, dtype, head_dim) -> (variant, why): asked once per kind of call, so that no import or probe
        # (e.g. whether the CUDA extension loads) runs inside a torch.compile trace.
        self._choices: dict = {}
        # variant -> the entry's runner (registry.AttentionImpl.runner): the serving entry decided once, not per call.
        self._runners: dict = {}
        # variant -> the reader that reads the FP8 KV cache directly, or None (impls.flash_kernel.fp8_kv_reader).
        self._fp8_readers: dict = {}

    # A patched model is copied (copy.deepcopy), pickled and torch.saved with its patch: the runtime keeps the
    # implementation's name, not its entry (a plugin's function may not pickle), and looks the entry up again when
    # loaded; the cached choices are asked again (the loading process may have other backends).
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["impl"]
        state["_choices"] = {}
        state["_runners"] = {}
        state["_fp8_readers"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_runners", {})
        self.__dict__.setdefault("_fp8_readers", {})
        self.impl = registry.get(self.options.impl)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def count_native(self, variant: str) -> None:
        if _is_compiling():
            # A counter bumped while dynamo traces would be replayed as a constant; a flag set to True is not.
            self.report.compiled_native_seen = True
        else:
            self.report.native_calls[variant] += 1

    def count_kv_cache_read(self, key: torch.Tensor, how: str = FP8_READ_VIA_COPY) -> None:
        """Count a call whose K came from the FP8 KV cache (``kv_cache_reference.fp8_kv_of``), by how it was read."""
        if not _is_compiling() and fp8_kv_of(key) is not None:
            self.report.kv_cache_reads[how] += 1

    def fp8_kv_copy(self, key: torch.Tensor, value: torch.Tensor, kv: Fp8KV) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V to hand to a path that reads fp16/bf16 tensors: the cache's dequantised copy, made here where the
        cache returned placeholders (``kv_cache_reference.is_placeholder``); counted as read via that copy."""
        self.count_kv_cache_read(key, FP8_READ_VIA_COPY)
        if not is_placeholder(key):
            return key, value
        from llm_attn.ops import fp8_kv_dequantized  # noqa: PLC0415

        return fp8_kv_dequantized(kv, key.dtype)  # one launch where the build has it; else the PyTorch ops

    def fp8_kv_reader(self, variant: str):
        """The reader that reads the FP8 cache directly for this variant (its output and how it read, or None for a
        call it does not take), or None: only llm_attn's own entry has one (its decode and prefill kernels, or the
        blockwise reference on CPU); every other implementation reads the copy."""
        if variant not in self._fp8_readers:
            from llm_attn.impls.flash_kernel import fp8_kv_reader  # noqa: PLC0415

            self._fp8_readers[variant] = fp8_kv_reader(self.impl.name, variant)
        return self._fp8_readers[variant]

    def setting_unsupported(self, reason: str) -> None:
        """A model/setting problem found at call time: raise under on_unsupported='error', else count a fallback."""
        if self.options.on_unsupported == "error":
            raise UnsupportedModelError(f"{self.impl.name} cannot run this attention call: {reason} "
                                        f"(patch with on_unsupported='fallback' to use the stock path instead)")
        self.count_fallback(reason)

    def count_fallback(self, reason: str) -> None:
        if _is_compiling():
            self.report.compiled_fallback_seen = True
        else:
            self.report.fallback_calls[reason] += 1

    # -- the call ------------------------------------------------------------------------------------------------
    def choose_variant(self, query: torch.Tensor) -> tuple[str | None, str | None]:
        key = (query.device, query.dtype, query.shape[-1])
        got = self._choices.get(key)  # choose_variant_for, inlined: this runs on every call
        if got is None:
            got = self._choices[key] = self.impl.choose(key[0], key[1], key[2], self.options.backend)
        return got

    def choose_variant_for(self, device: torch.device, dtype: torch.dtype, head_dim: int):
        key = (device, dtype, head_dim)
        got = self._choices.get(key)
        if got is None:
            got = self._choices[key] = self.impl.choose(device, dtype, head_dim, self.options.backend)
        return got

    def prepare(self, device: torch.device, dtype: torch.dtype | None, head_dim: int) -> None:
        """Decide, at patch time, the variant and its runner for the model's own tensors: deciding may import or
        probe the kernel build, which dynamo cannot trace, and a compiled model's first call would otherwise decide
        inside the trace (a graph break; an error under ``fullgraph=True``)."""
        if dtype is None:
            return
        variant, _ = self.choose_variant_for(device, dtype, head_dim)
        if variant is not None and variant not in self._runners:
            self._runners[variant] = self.impl.runner(variant)

    def seqused_problem(self, variant: str) -> str | None:
        """Why a call that needs ``seqused_k`` cannot run on this implementation (None when it can)."""
        if variant == "reference" or self.impl.supports_seqused_k:
            return None
        return f"{self.impl.name} does not support seqused_k (a KV cache with unused slots): stock attention"

    def run(self, variant: str, query, key, value, *, causal: bool, scale: float | None,
            seqused_k: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) -> (B, Sq, Hq, D) contiguous, the layout transformers expects."""
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        call = self._runners.get(variant)
        if call is None:
            call = self._runners[variant] = self.impl.runner(variant)
        out = call(query, key, value, causal, scale, seqused_k)
        return out.transpose(1, 2).contiguous()  # llm_attn's op stores (B, Sq, Hq, D): then this is free


def config_problems(config: Any, *, training: bool) -> list[str]:
    """Settings of a Llama-family config that llm_attn does not implement (the stock path must handle them)."""
    return static_config_problems(config) + dropout_problems(config, training=training)


def static_config_problems(config: Any) -> list[str]:
    """Config settings that make every attention call unsupported, whatever the call (window, softcapping)."""
    problems = []
    sliding = getattr(config, "sliding_window", None)
    use_sliding = getattr(config, "use_sliding_window", True)  # qwen2 keeps a window value but may not use it
    layer_types = getattr(config, "layer_types", None) or []
    if (sliding is not None and use_sliding) or "sliding_attention" in layer_types:
        problems.append(f"sliding-window attention (sliding_window={sliding}) is not implemented by llm_attn")
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, name, None) is not None:
            problems.append(f"attention logit softcapping ({name}={getattr(config, name)}) is not implemented")
    return problems


def dropout_problems(config: Any, *, training: bool) -> list[str]:
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if training and dropout > 0:
        return [f"attention dropout in training mode (attention_dropout={dropout}) is not implemented"]
    return []


def model_head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def module_device_dtype(module: torch.nn.Module) -> tuple[torch.device, torch.dtype | None]:
    """Device and compute dtype of a (possibly quantised) module: the first floating-point parameter or buffer."""
    device = None
    for t in list(module.parameters()) + list(module.buffers()):
        device = device or t.device
        if t.is_floating_point():
            return t.device, t.dtype
    return device or torch.device("cpu"), None


def check_settings(report: PatchReport, options: PatchOptions, config: Any, *, training: bool,
                   device: torch.device, dtype: torch.dtype | None) -> list[str]:
    """Patch-time checks shared by all targets: raise under 'error', else record what will fall back and why.

    Returns the config problems that hold for every call (give them to the AttentionRuntime as ``forced``); the
    dropout and backend problems depend on the call's mode and tensors and are checked again per call."""
    impl = registry.get(options.impl)
    report.impl_source = dict(impl.source)
    problems = config_problems(config, training=training)
    head_dim = model_head_dim(config)
    variant, why = impl.choose(device, dtype or torch.float16, head_dim, options.backend)
    if variant is None:
        problems.append(why)
    if problems and options.on_unsupported == "error":
        raise UnsupportedModelError(
            f"{impl.name} cannot patch this model: " + "; ".join(problems)
            + ". Patch with on_unsupported='fallback' to keep the stock attention for these calls.")
    for p in problems:
        report.fallbacks.append(f"every attention call: {p}")
    if variant == "reference":
        report.expected_path = "llm_attn PyTorch reference (tiled, same algorithm as the kernel)"
        if device.type == "cpu" and head_dim not in KERNEL_HEAD_DIMS:
            report.notes.append(f"head_dim {head_dim} runs on the reference only; the CUDA kernel supports "
                                f"{KERNEL_HEAD_DIMS}")
    elif variant is not None:
        report.expected_path = f"{impl.name} on {variant} ({impl.description}; {impl.source_label})"
    if not impl.supports_seqused_k:
        report.notes.append(f"{impl.name} does not support seqused_k: calls over a KV cache with unused slots "
                            f"(StaticCache) take the stock path and are counted below")
    if problems:
        report.expected_path = "stock attention (see 'falls back')"
    report.notes.append("arbitrary attention masks (e.g. left padding) take the stock path for that call and are "
                        "counted below")
    return static_config_problems(config)


def start_patch(model, options: PatchOptions, target: str, modules: list) -> tuple[PatchReport, list[str]]:
    """The report of a patch of `modules` (name, module) of `model`, and the settings problems that force the stock
    path (raises under on_unsupported='error'), checked against the first module's device and dtype."""
    report = PatchReport(target=target, impl=options.impl, backend=options.backend,
                         on_unsupported=options.on_unsupported, model_type=model.config.model_type,
                         impl_source=dict(registry.get(options.impl).source))
    device, dtype = module_device_dtype(modules[0][1])
    forced = check_settings(report, options, model.config, training=model.training, device=device, dtype=dtype)
    return report, forced


# -- per-instance forward swaps (transformers 4.4x modules, AutoAWQ fused modules) ------------------------------------

class SwappedForward:
    """What a target puts in place of one module's ``forward`` (on that instance only). A subclass implements
    ``__call__`` with the module's forward signature and calls ``self.original(...)`` for the stock path.

    It is an object holding the module and plain state, never a closure or a bound method: a patched model then
    deep-copies, pickles and ``torch.save``s, and the copy's forward serves the copy's module (a closure would be
    shared by ``copy.deepcopy`` and keep running the original module)."""

    def __init__(self, module: torch.nn.Module, attr: str, previous: Callable | None):
        self.module, self.attr, self.previous = module, attr, previous

    def original(self, *args, **kwargs):
        """The forward that was there before the patch (the class's, unless the instance had its own)."""
        if self.previous is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.previous(*args, **kwargs)


def swap_forward(module: torch.nn.Module, make: Callable[..., SwappedForward]) -> tuple:
    """Replace what runs as ``module.forward`` by ``make(module, attr, previous)`` (a ``SwappedForward``) on this
    instance only (the class is untouched). accelerate's hooks replace ``forward`` and call ``_old_forward``: patch
    what actually runs. Returns the record ``restore_forwards`` needs to put back exactly what was there."""
    attr = "_old_forward" if (hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__) else "forward"
    had = attr in module.__dict__
    previous = module.__dict__.get(attr)
    module.__dict__[attr] = make(module, attr, previous if had else None)
    return module, attr, had, previous


def restore_forwards(records: list[tuple]) -> None:
    for module, attr, had, previous in records:
        if had:
            module.__dict__[attr] = previous
        else:
            module.__dict__.pop(attr, None)

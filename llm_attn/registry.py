"""The attention-implementation registry: *what* attention runs. (``llm_attn.patches`` decides *where* it plugs
into a model; the two are orthogonal: every registered name works through every patch target.)

    import llm_attn

    def my_attention(q, k, v, *, causal, scale, seqused_k=None):
        ...                                    # q (B, Hq, Sq, D); k, v (B, Hkv, Sk, D) -> (B, Hq, Sq, D)

    llm_attn.register_attention("mine", my_attention, dtypes=(torch.float16, torch.bfloat16), head_dims=None,
                                devices=("cuda",), supports_seqused_k=False, description="my Triton kernel")
    llm_attn.patch_model(model, impl="mine")   # or: python -m llm_attn.ttft --plugin mine.py --impl mine

The contract of ``fn`` is ``llm_attn.flash_attn_func``'s: K/V un-expanded (query head ``h`` reads KV head
``h // (Hq // Hkv)``), ``causal`` aligned bottom-right (query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``; a row
that sees no key outputs 0), ``scale`` a float (never None when called by the patches), ``seqused_k`` None or int32
(B,) on the device: batch ``b`` uses only its first ``seqused_k[b]`` keys, causality aligned to that length. Calls
a kernel cannot take (a dtype, head_dim or device it did not declare, a ``seqused_k`` it does not support, a mask
it cannot express) take the stock attention for that call and are counted in the model's ``PatchReport``.

Where entries come from, each recorded as the entry's ``source`` in every result row:

- built-in: one small module per implementation in ``llm_attn/impls/`` (stock eager/sdpa/flash_attention_2, our
  kernel ``llm_attn``, ``naive``, ``flex``, ``numba``), registered on first use of the registry;
- installed packages: the entry-point group ``llm_attn.attention`` (a module that registers on import, a
  zero-argument callable that registers, or an ``AttentionImpl``);
- plugins named on the command line (``--plugin path/to/file.py`` or ``--plugin package.module[:attr]``) or loaded
  with ``load_plugin``;
- direct calls of ``register_attention`` from user code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ENTRY_POINT_GROUP = "llm_attn.attention"
# What a caller may ask of any entry (patch_model(backend=...)): 'auto', 'cuda' (refuse non-CUDA tensors), or
# 'reference' (the entry registered with provides_reference=True runs its reference in place of any entry).
BACKENDS = ("auto", "cuda", "reference")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
# Built-in entries, in the order tables list them; each module registers its entries on import.
_BUILTIN_MODULES = ("llm_attn.impls.stock", "llm_attn.impls.flash_kernel", "llm_attn.impls.low_precision",
                    "llm_attn.impls.naive",
                    "llm_attn.impls.flex", "llm_attn.impls.numba_fa2")


class UnknownImplementationError(ValueError):
    """A name the registry does not hold."""


class PluginError(ValueError):
    """A plugin that cannot be loaded (missing file, import error, nothing registered)."""


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One registered implementation. Build with ``register_attention``, not directly."""

    name: str
    fn: Callable
    dtypes: tuple
    head_dims: tuple | None
    devices: tuple
    supports_seqused_k: bool
    description: str
    source: dict
    # Stock implementations: the name transformers switches to with ``model.set_attn_implementation``. The harness
    # measures them that way (exactly what users run); ``fn`` serves patch_model and the kernel benchmark.
    hf_name: str | None = None
    # In the default comparison of the CLIs (when no --impl is given).
    default: bool = False
    # () -> None, or why this implementation cannot run at all here (a package that is not installed).
    requires: Callable[[], str | None] | None = None
    # Advanced: (device, dtype, head_dim, requested) -> (variant, None) or (None, why), ``requested`` one of
    # BACKENDS. The variant names what serves the call (counted in the report) and is passed to ``fn`` as
    # ``variant=``. Without it the variant is the device type and ``fn`` gets no variant argument.
    select: Callable | None = dataclasses.field(default=None, compare=False)
    # Advanced: this entry (it needs a ``select``) answers ``backend='reference'`` asked of any entry: a debugging
    # path that runs a plain reference in place of the implementation. One entry at most (llm_attn's).
    provides_reference: bool = False
    # Advanced: this entry's ``select`` answers ``backend='reference'`` asked of it with its own reference, the same
    # algorithm in PyTorch (the low-precision entries: the quantised one, so that their reference keeps their
    # accuracy), instead of the plain reference of the ``provides_reference`` entry.
    own_reference: bool = False

    @property
    def stock(self) -> bool:
        return self.hf_name is not None

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        """Why this implementation cannot run on ``device`` (any dtype/head_dim), or None when it can."""
        device = torch.device(device)
        if device.type not in self.devices:
            return f"{self.name} needs a {' or '.join(_DEVICE_WORDS.get(d, d) for d in self.devices)}"
        if self.requires is not None:
            return self.requires() or None
        return None

    def choose(self, device: torch.device, dtype: torch.dtype, head_dim: int,
               backend: str = "auto") -> tuple[str | None, str | None]:
        """Which variant serves tensors like these: (variant, None), or (None, why not).

        ``backend='reference'`` runs the reference of the entry registered with ``provides_reference`` (llm_attn's
        PyTorch reference) in place of any implementation (debugging), or the entry's own (``own_reference``: the
        low-precision entries' quantised algorithm in PyTorch); ``backend='cuda'`` refuses tensors that are not on a
        CUDA device."""
        if backend == "reference" and not (self.provides_reference or self.own_reference):
            ref = _reference_entry()
            if ref is None:
                return None, "no registered implementation provides a reference path"
            return ref.choose(device, dtype, head_dim, backend)
        if self.select is not None:
            return self.select(device, dtype, head_dim, backend)
        if backend == "cuda" and device.type != "cuda":
            return None, f"backend='cuda' needs the model on a CUDA device, it is on {device}"
        why = self.unavailable_reason(device)
        if why:
            return None, why
        if dtype not in self.dtypes:
            return None, f"{self.name} takes {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)}, " \
                         f"got {str(dtype).removeprefix('torch.')}"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return None, f"{self.name} supports head_dim {self.head_dims}, got {head_dim}"
        return device.type, None

    def run(self, variant: str, q, k, v, *, causal: bool, scale: float, seqused_k=None) -> torch.Tensor:
        """One call, (B, Hq, Sq, D) out. Inside a profiler, the call is a ``llm_attn.attention:<name>`` range, so
        that ``--measure breakdown`` attributes exactly this implementation's kernels to attention."""
        return self.runner(variant)(q, k, v, causal, scale, seqused_k)

    def runner(self, variant: str) -> Callable:
        """``run`` for one variant, decided once: ``call(q, k, v, causal, scale, seqused_k) -> out``. The entry that
        serves the variant (the reference entry for 'reference' asked of another one) is looked up here, not per
        call; a caller that makes many calls (the patches' runtime) keeps it."""
        entry = self
        if variant == "reference" and not self.provides_reference:
            entry = _reference_entry()
            if entry is None:
                raise RuntimeError("no registered implementation provides a reference path")
        fn, with_variant, rng, impl = entry.fn, entry.select is not None, range_name(self.name), self

        def call(q, k, v, causal, scale, seqused_k=None):
            if _profiling():
                with torch.profiler.record_function(rng):
                    out = (fn(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, variant=variant)
                           if with_variant else fn(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k))
            elif with_variant:
                out = fn(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k, variant=variant)
            else:
                out = fn(q, k, v, causal=causal, scale=scale, seqused_k=seqused_k)
            if not isinstance(out, torch.Tensor) or out.shape != q.shape:
                raise RuntimeError(f"attention implementation {impl.name!r} ({impl.source_label}) returned "
                                   f"{getattr(out, 'shape', type(out).__name__)}, expected a tensor of q's shape "
                                   f"{tuple(q.shape)} (B, Hq, Sq, D)")
            return out

        return call

    @property
    def source_label(self) -> str:
        s = self.source
        kind = s.get("kind")
        if kind == "plugin":
            return f"plugin {s.get('path') or s.get('module')}"
        if kind == "entry-point":
            return f"package {s.get('package')} {s.get('version')}"
        return f"{kind} {s.get('module', '')}".strip()

    def info(self) -> dict:
        """What a result row records about the implementation."""
        return {"name": self.name, "source": dict(self.source), "description": self.description,
                "stock": self.stock, "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
                "head_dims": list(self.head_dims) if self.head_dims is not None else None,
                "devices": list(self.devices), "supports_seqused_k": self.supports_seqused_k}


RANGE_PREFIX = "llm_attn.attention:"
_DEVICE_WORDS = {"cuda": "CUDA GPU", "cpu": "CPU"}


def range_name(impl: str) -> str:
    return RANGE_PREFIX + impl


def _profiling() -> bool:
    try:
        if torch.compiler.is_compiling():
            return False
    except AttributeError:  # torch < 2.3
        pass
    return torch.autograd._profiler_enabled()


# -- the table --------------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, AttentionImpl] = {}
_state = {"builtins": False, "entry_points": False}
_current_source: list[dict] = []   # set while a plugin / entry point / built-in module is being loaded
plugin_errors: list[str] = []      # entry points that failed to load (a broken package must not break the CLIs)


@contextlib.contextmanager
def _loading(source: dict) -> Iterator[None]:
    _current_source.append(source)
    try:
        yield
    finally:
        _current_source.pop()


def _caller_source(fn) -> dict:
    if _current_source:
        return dict(_current_source[-1])
    module = getattr(fn, "__module__", None)
    if module in _BUILTIN_MODULES:  # a built-in module imported directly (e.g. llm_attn.impls.flash_kernel) first
        return {"kind": "built-in", "module": module}
    return {"kind": "api", "module": module}


def _reference_entry() -> AttentionImpl | None:
    _load_builtins()
    return next((e for e in _REGISTRY.values() if e.provides_reference), None)


def register_attention(name: str, fn: Callable, *, dtypes=(torch.float16, torch.bfloat16), head_dims=None,
                       devices=("cuda",), supports_seqused_k: bool = False, description: str = "",
                       replace: bool = False, **advanced) -> AttentionImpl:
    """Register an attention implementation under ``name``; returns its ``AttentionImpl``.

    Args:
        name: what ``patch_model(impl=...)``, ``--impl`` and result rows call it (letters, digits, ``_.-``).
        fn: ``fn(q, k, v, *, causal, scale, seqused_k=None) -> out``, the ``flash_attn_func`` contract (see the
            module docstring).
        dtypes: the input dtypes it takes; other dtypes take the stock path.
        head_dims: the head dims it takes, or None for any.
        devices: device types it runs on ("cuda", "cpu").
        supports_seqused_k: whether it honours ``seqused_k``; when False, calls that need it (a static KV cache
            with unused slots) take the stock path, counted.
        description: one line for tables and ``--help``.
        replace: allow replacing an entry of the same name from another source (same source: always allowed, so
            a plugin can be loaded twice).
        advanced: ``hf_name``, ``default``, ``requires``, ``select``, ``provides_reference``, ``own_reference``
            (see ``AttentionImpl``); built-ins use them.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"attention implementation name must start with a letter and hold letters, digits, "
                         f"'_', '.', '-', got {name!r}")
    if not callable(fn):
        raise TypeError(f"register_attention({name!r}): fn must be callable, got {type(fn).__name__}")
    dtypes = tuple(dtypes)
    if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise TypeError(f"register_attention({name!r}): dtypes must be a non-empty sequence of torch dtypes, "
                        f"got {dtypes!r}")
    if head_dims is not None:
        head_dims = tuple(head_dims)
        if not head_dims or not all(isinstance(h, int) and h > 0 for h in head_dims):
            raise ValueError(f"register_attention({name!r}): head_dims must be positive integers or None, "
                             f"got {head_dims!r}")
    devices = (devices,) if isinstance(devices, str) else tuple(devices)
    if not devices or not all(isinstance(d, str) for d in devices):
        raise ValueError(f"register_attention({name!r}): devices must be device types like 'cuda', 'cpu'")
    unknown = set(advanced) - {"hf_name", "default", "requires", "select", "provides_reference", "own_reference"}
    if unknown:
        raise TypeError(f"register_attention() got unexpected arguments {sorted(unknown)}")
    entry = AttentionImpl(name=name, fn=fn, dtypes=dtypes, head_dims=head_dims, devices=devices,
                          supports_seqused_k=bool(supports_seqused_k), description=str(description),
                          source=_caller_source(fn), **advanced)
    old = _REGISTRY.get(name)
    if old is not None and not replace and old.source != entry.source:
        raise ValueError(f"an attention implementation named {name!r} is already registered ({old.source_label}); "
                         f"pick another name or pass replace=True")
    for flag in ("provides_reference", "own_reference"):
        if getattr(entry, flag) and entry.select is None:
            raise ValueError(f"register_attention({name!r}): {flag} needs a select")
    if entry.provides_reference:
        other = next((e.name for e in _REGISTRY.values() if e.provides_reference and e.name != name), None)
        if other is not None:
            raise ValueError(f"register_attention({name!r}): {other!r} already provides the reference path")
    _REGISTRY[name] = entry
    return entry


def unregister_attention(name: str) -> None:
    """Remove a plugin's entry (tests, notebooks). Built-ins stay."""
    entry = _REGISTRY.get(name)
    if entry is not None and entry.source.get("kind") == "built-in":
        raise ValueError(f"{name!r} is built in and cannot be unregistered")
    _REGISTRY.pop(name, None)


def _load_builtins() -> None:
    if _state["builtins"]:
        return
    _state["builtins"] = True
    for mod in _BUILTIN_MODULES:
        with _loading({"kind": "built-in", "module": mod}):
            importlib.import_module(mod)
    # Built-ins first, in their modules' order, whichever was imported first (a caller may import
    # llm_attn.impls.flash_kernel directly before the registry is used); then the others as registered.
    order = {m: i for i, m in enumerate(_BUILTIN_MODULES)}
    builtin = sorted((e for e in _REGISTRY.values() if e.source.get("kind") == "built-in"),
                     key=lambda e: order.get(e.source.get("module"), len(order)))
    rest = [e for e in _REGISTRY.values() if e.source.get("kind") != "built-in"]
    _REGISTRY.clear()
    _REGISTRY.update((e.name, e) for e in builtin + rest)


def load_entry_points() -> None:
    """Import every ``llm_attn.attention`` entry point of the installed packages (once)."""
    if _state["entry_points"]:
        return
    _state["entry_points"] = True
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10 API
        eps = importlib.metadata.entry_points().get(ENTRY_POINT_GROUP, [])
    for ep in eps:
        dist = getattr(ep, "dist", None)
        source = {"kind": "entry-point", "entry_point": f"{ep.name} = {ep.value}",
                  "package": getattr(dist, "name", None), "version": getattr(dist, "version", None)}
        try:
            with _loading(source):
                _adopt(ep.load(), source)
        except Exception as e:  # noqa: BLE001 (a broken plugin package is reported, not fatal)
            msg = f"entry point {ep.name} = {ep.value} ({source['package']}): {type(e).__name__}: {e}"
            plugin_errors.append(msg)
            warnings.warn(f"llm_attn: could not load attention plugin {msg}", stacklevel=2)


def _adopt(obj, source: dict) -> None:
    """What a plugin points at: a module (registered on import), an AttentionImpl, or a callable that registers."""
    if isinstance(obj, AttentionImpl):
        if obj.name not in _REGISTRY or _REGISTRY[obj.name] is not obj:
            _REGISTRY[obj.name] = dataclasses.replace(obj, source=source)
    elif callable(obj) and not isinstance(obj, type):
        obj()


def _ensure() -> None:
    _load_builtins()
    load_entry_points()


def load_plugin(spec: str) -> list[str]:
    """Load ``path/to/file.py`` or ``package.module[:attr]``; return the names it registered.

    The file or module registers with ``register_attention`` when imported; ``attr`` may name an AttentionImpl or
    a zero-argument callable that registers."""
    _ensure()
    before = dict(_REGISTRY)
    path = Path(spec)
    if spec.endswith(".py") or path.suffix == ".py":
        if not path.is_file():
            raise PluginError(f"--plugin {spec}: no such file")
        resolved = path.resolve()
        digest = hashlib.sha256(resolved.read_bytes()).hexdigest()[:16]
        source = {"kind": "plugin", "path": str(resolved), "sha256": digest}
        mod_name = f"llm_attn_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
        try:
            with _loading(source):
                mspec = importlib.util.spec_from_file_location(mod_name, resolved)
                module = importlib.util.module_from_spec(mspec)
                sys.modules[mod_name] = module
                mspec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise PluginError(f"--plugin {spec}: importing it failed: {type(e).__name__}: {e}") from e
    else:
        mod_name, _, attr = spec.partition(":")
        source = {"kind": "plugin", "module": spec}
        top = mod_name.split(".")[0]
        try:
            dist = importlib.metadata.packages_distributions().get(top, [None])[0]
            if dist:
                source.update(package=dist, version=importlib.metadata.version(dist))
        except Exception:  # noqa: BLE001 (the version is a nicety)
            pass
        try:
            with _loading(source):
                module = importlib.import_module(mod_name)
                if attr:
                    _adopt(getattr(module, attr), source)
        except ModuleNotFoundError as e:
            raise PluginError(f"--plugin {spec}: no module {e.name!r} (a .py path or an importable module)") from e
        except AttributeError as e:
            raise PluginError(f"--plugin {spec}: {e}") from e
        except Exception as e:
            raise PluginError(f"--plugin {spec}: importing it failed: {type(e).__name__}: {e}") from e
    added = [n for n, e in _REGISTRY.items() if before.get(n) is not e]
    same = [n for n, e in _REGISTRY.items() if e.source == source]
    names = added or same
    if not names:
        raise PluginError(f"--plugin {spec}: it registered no attention implementation (call "
                          f"llm_attn.register_attention(name, fn, ...) at import time)")
    return names


def load_plugins(specs) -> list[str]:
    names = []
    for s in specs or ():
        names += load_plugin(s)
    return names


def get(name: str) -> AttentionImpl:
    _ensure()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownImplementationError(f"unknown attention implementation {name!r}; registered: "
                                         f"{', '.join(_REGISTRY)} (load a plugin with --plugin FILE.py or "
                                         f"register_attention)") from None


def names() -> list[str]:
    _ensure()
    return list(_REGISTRY)


def entries() -> list[AttentionImpl]:
    _ensure()
    return list(_REGISTRY.values())


def unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """Why ``name`` cannot run on ``device``, or None when it can."""
    try:
        entry = get(name)
    except UnknownImplementationError as e:
        return str(e)
    return entry.unavailable_reason(device)


def default_impls(device: torch.device | str) -> list[str]:
    """The default comparison: every default entry (stock implementations, then ours) that runs here."""
    return [e.name for e in entries() if e.default and e.unavailable_reason(device) is None]


def plugin_specs_for(impls) -> list[str]:
    """The --plugin arguments that make ``impls`` known again in another process (for reproduce commands)."""
    specs = []
    for name in impls:
        s = get(name).source
        if s.get("kind") == "plugin":
            spec = s.get("path") or s.get("module")
            if spec not in specs:
                specs.append(spec)
    return specs

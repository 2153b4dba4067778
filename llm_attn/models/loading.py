"""One loader for presets, local checkpoint directories and hub ids already in the local cache (see llm_attn.models)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import io
import json
import logging
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llm_attn import awq as awq_format
from llm_attn._cli import verbose

logger = logging.getLogger("llm_attn.models")

from llm_attn.models.presets import PRESETS
from llm_attn.models.synthetic import (
    MARKER_FILE,
    PROVENANCE_FILE,
    SYNTHETIC_FORMAT_VERSION,
    DISK_HEADROOM,
    NotEnoughDiskError,
    _cache_root,
    cached_checkpoint,
    check_free_disk,
    estimated_checkpoint_bytes,
)


class AwqBackendMissingError(ImportError):
    """An AWQ checkpoint was asked for but no AWQ backend that transformers can use is installed."""


AWQ_PIP_LINE = ("python -m pip install --no-deps --no-build-isolation gptqmodel==7.5.0 pypcre==0.6.4 logbar==0.4.15 "
                "tokenicer==0.0.14 device-smi==0.5.7 defuser==0.0.28 threadpoolctl requests")
AWQ_INSTALL_HINT = (
    "transformers loads AWQ checkpoints through gptqmodel. Install it and the packages it imports without letting "
    "pip replace torch:\n"
    f"  {AWQ_PIP_LINE}\n"
    "or pass allow_dequant_fallback=True (CLI: --allow-dequant-fallback) to run the same checkpoint dequantised "
    "to fp16.")


@dataclass
class ModelInfo:
    name: str                 # preset name, local path or hub id
    source: str               # "synthetic" | "local" | "hub"
    quant: str                # "awq-int4" | "fp16" | "bf16" | "fp32" | "awq-dequantized-fp16"
    awq_backend: str | None   # the QuantLinear class(es) found in the loaded model, e.g. "gptqmodel:AwqTorchLinear"
    dequant_fallback: bool
    dtype: str
    device: str
    num_params: int           # logical parameters (an int4 weight counts in*out, not its packed words)
    config: dict
    versions: dict
    path: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def detect_awq_backends() -> dict[str, str | None]:
    """Installed AWQ-capable packages -> version, or None when absent. Reads package metadata, imports nothing.

    gptqmodel is what transformers' AWQ quantizer calls; autoawq is listed for information only (transformers
    5.x no longer uses it); triton is listed because gptqmodel's GPU int4 kernel (gemm_triton) needs it.
    """
    out: dict[str, str | None] = {}
    for dist in ("gptqmodel", "autoawq", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _gptqmodel_available() -> bool:
    # The same check transformers' AWQ quantizer makes before loading (a test monkeypatches it to simulate absence).
    from transformers.utils import import_utils
    return bool(import_utils.is_gptqmodel_available())


def _import_gptqmodel() -> None:
    """Imports gptqmodel without letting it change this process's CUDA allocator, device numbering or logging.

    At import, gptqmodel sets PYTORCH_ALLOC_CONF (expandable segments, a GC threshold) and CUDA_DEVICE_ORDER when
    they are unset. That would make AWQ runs allocate differently from fp16 runs and skew the harness' timings, so
    torch's defaults are pinned for the import and the environment is restored before anything touches CUDA.
    """
    if "gptqmodel" in sys.modules:
        return
    pinned = [k for k, _ in _GPTQMODEL_ENV_DEFAULTS if not os.environ.get(k)]
    for k, v in _GPTQMODEL_ENV_DEFAULTS:
        if k in pinned:
            os.environ[k] = v
    # It also configures the root logger (INFO, to stderr), which would print every library's INFO lines, ours too.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with _third_party_output():
            import gptqmodel  # noqa: F401
    finally:
        for k in pinned:
            os.environ.pop(k, None)
        if not verbose():
            root.handlers[:] = handlers
            root.setLevel(level)


def _third_party_output():
    """Where the prints of third-party code go: gptqmodel prints a banner and its log lines on stdout, which is for
    our callers' results (JSON, tables). Nowhere by default; stderr with -v (``llm_attn._cli.verbose``)."""
    return contextlib.redirect_stdout(sys.stderr if verbose() else io.StringIO())


@contextlib.contextmanager
def _quiet_loading():
    """transformers' 'Loading weights' progress bar (on stderr, also into log files) and the prints of the AWQ
    backend say nothing to a user of the harness: held back for the load unless -v."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    bar = hf_logging.is_progress_bar_enabled()
    if not verbose():
        hf_logging.disable_progress_bar()
    try:
        with _third_party_output():
            yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()


# torch's own defaults: no expandable segments; CUDA's default device order.
_GPTQMODEL_ENV_DEFAULTS = (("PYTORCH_ALLOC_CONF", "expandable_segments:False"), ("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))


def _versions() -> dict:
    import transformers
    v = {"torch": torch.__version__, "transformers": transformers.__version__}
    v.update({k: val for k, val in detect_awq_backends().items() if val is not None})
    return v


def _resolve_device(device) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__})")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu' (optionally 'cuda:N'), got {device!r}")
    return dev


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def auto_spec(device: str | torch.device) -> tuple[str, str | None]:
    """What ``--model auto`` means on ``device``: (preset spec, a one-line note or None).

    CUDA: the synthetic Llama 3 8B AWQ int4 checkpoint when an AWQ int4 backend (gptqmodel) is installed, otherwise
    the same geometry in fp16 (real fp16 weights: ModelInfo.quant and every row say 'fp16'), with a note saying how
    to get the int4 default. CPU: the tiny fp16 model."""
    if torch.device(device).type != "cuda":
        return "tiny:fp16", None
    if _gptqmodel_available():
        return "llama-3-8b:awq", None
    return "llama-3-8b:fp16", (
        "no AWQ int4 backend (gptqmodel) is installed: model 'auto' is the synthetic Llama 3 8B in fp16 (real fp16 "
        "weights, ~16 GB); for the int4 default install gptqmodel as README.md 'Models' shows: "
        "python -m pip install --no-deps --no-build-isolation gptqmodel==7.5.0 pypcre==0.6.4 logbar==0.4.15 "
        "tokenicer==0.0.14 device-smi==0.5.7 defuser==0.0.28 threadpoolctl requests")


# Memory over the weights' bytes: activations and KV cache of a short prompt, allocator slack, CUDA context.
MEMORY_MARGIN = 1.15
_DTYPE_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}


def _available_memory(dev: torch.device) -> tuple[int, str]:
    """(bytes the model's weights can use on ``dev``, where that number comes from)."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), f"free on {torch.cuda.get_device_name(dev)}"
    try:
        import psutil  # noqa: PLC0415

        return int(psutil.virtual_memory().available), "RAM available"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "RAM available"
    except OSError:
        pass
    return 0, ""


def _preset_memory_bytes(preset: str, quant: str, dtype: torch.dtype) -> int:
    """Bytes the loaded weights of a synthetic preset take: the checkpoint's (fp16, or int4 + fp16 scales) at the
    activation dtype's width for fp16 checkpoints."""
    stored = estimated_checkpoint_bytes(preset, quant)
    if quant == "fp16":
        return stored * _DTYPE_BYTES.get(dtype, 2) // 2
    return stored


def _preset_quant(spec: str, dev: torch.device) -> tuple[str, str] | None:
    """(preset, 'awq' | 'fp16' | another suffix) for a preset spec (a bare preset: AWQ on a GPU, fp16 elsewhere);
    None for anything else."""
    name, _, quant = spec.partition(":")
    if name not in PRESETS:
        return None
    return name, quant or ("awq" if dev.type == "cuda" else "fp16")


def _awq_runs_as(allow_dequant_fallback: bool) -> str | None:
    """How an AWQ checkpoint would load here: 'int4' (gptqmodel installed), 'dequantized' (no backend, the fallback
    allowed) or None (it cannot)."""
    if _gptqmodel_available():
        return "int4"
    return "dequantized" if allow_dequant_fallback else None


def _weights_bytes(name: str, quant: str, dtype: torch.dtype, allow_dequant_fallback: bool) -> int:
    if quant == "awq" and _awq_runs_as(allow_dequant_fallback) == "dequantized":
        return _preset_memory_bytes(name, "fp16", torch.float16)  # every int4 linear as an fp16 Linear
    return _preset_memory_bytes(name, quant, dtype)


def _cached(root: Path, name: str, quant: str) -> bool:
    suffix = "-g128" if quant == "awq" else ""
    return (root / f"{name}-{quant}{suffix}-seed0-v{SYNTHETIC_FORMAT_VERSION}" / MARKER_FILE).is_file()


def runnable_presets(dev: torch.device, allow_dequant_fallback: bool = False, cache_dir=None,
                     avail: int | None = None, free_disk: int | None = None) -> list[str]:
    """The synthetic presets (``name:quant``) that ``--model name:quant`` runs here, smallest first: an AWQ one only
    where it loads (an AWQ backend, or the dequantising fallback allowed), its weights in the dtype the command lines
    pick for it within the free memory (``avail``; default what ``_available_memory`` reads), and a checkpoint not
    cached yet within the cache's free disk (``free_disk``; default what the filesystem says)."""
    if avail is None:
        avail, source = _available_memory(dev)
        avail = avail if source else None  # unknown: not a reason to leave a model out
    root = _cache_root(cache_dir)
    if free_disk is None:
        disk = root
        while not disk.exists() and disk != disk.parent:
            disk = disk.parent
        free_disk = shutil.disk_usage(disk).free
    sizes = {}
    for name in PRESETS:
        for quant in ("fp16", "awq"):
            if quant == "awq" and _awq_runs_as(allow_dequant_fallback) is None:
                continue
            # The command lines' default dtype (harness.session.default_dtype): fp16 on a GPU and for AWQ.
            dtype = torch.float16 if dev.type == "cuda" or quant == "awq" else torch.float32
            need = _weights_bytes(name, quant, dtype, allow_dequant_fallback) * MEMORY_MARGIN
            disk = estimated_checkpoint_bytes(name, quant) * DISK_HEADROOM
            if (avail is None or need <= avail) and (_cached(root, name, quant) or disk <= free_disk):
                sizes[f"{name}:{quant}"] = need
    return sorted(sizes, key=sizes.get)


def _runnable_tail(fits: list[str], dev: torch.device) -> str:
    if not fits:
        return "models that run here: none"
    # The example: the smallest that a bare preset name means on this device (fp16 on CPU, AWQ on a GPU), if any.
    bare = [f for f in fits if _preset_quant(f.partition(":")[0], dev) == tuple(f.split(":"))]
    example = bare[0].partition(":")[0] if bare else fits[0]
    return f"models that run here: {', '.join(fits)} (e.g. --model {example})"


def resource_problem(spec: str, device: str | torch.device, dtype: torch.dtype, cache_dir=None,
                     allow_dequant_fallback: bool = False) -> str | None:
    """Why ``spec`` would not run here, said before anything is written or loaded; None when it runs (or cannot
    be estimated: only the synthetic presets are). Three checks, in this order: an AWQ preset needs an AWQ backend
    (gptqmodel) unless ``allow_dequant_fallback``; the weights' bytes (MEMORY_MARGIN over them; dequantised fp16
    bytes for the fallback) against the free memory of ``device`` (MemAvailable on CPU, ``torch.cuda.mem_get_info``
    on a GPU); and, for a synthetic checkpoint not cached yet, its size against the free disk of the cache
    (``check_free_disk``). The message is one line: what is needed, what is there, and the presets that can run
    here (``runnable_presets``)."""
    dev = _resolve_device(device)
    if spec == "auto":
        spec = auto_spec(dev)[0]
    preset = _preset_quant(spec, dev)
    if preset is None:
        return None
    name, quant = preset
    if quant not in ("awq", "fp16"):
        return None  # load_model's own error names the accepted suffixes
    if quant == "awq" and _awq_runs_as(allow_dequant_fallback) is None:
        fits = runnable_presets(dev, allow_dequant_fallback, cache_dir)
        return (f"the {name} AWQ int4 checkpoint needs an AWQ backend and none is installed (gptqmodel); install it "
                f"as README.md 'Models' shows ({AWQ_PIP_LINE}), or add --allow-dequant-fallback to run it "
                f"dequantised to fp16; {_runnable_tail(fits, dev)}")
    need = int(_weights_bytes(name, quant, dtype, allow_dequant_fallback) * MEMORY_MARGIN)
    avail, where = _available_memory(dev)
    if where and need > avail:
        fits = runnable_presets(dev, allow_dequant_fallback, cache_dir, avail=avail)
        dt = "float16, dequantised" if quant == "awq" and _awq_runs_as(allow_dequant_fallback) == "dequantized" \
            else str(dtype).replace("torch.", "")
        return (f"needs ~{need / 1e9:.1f} GB of {'GPU ' if dev.type == 'cuda' else ''}memory for the {name} {quant} "
                f"weights in {dt} (with {MEMORY_MARGIN - 1:.0%} margin), {avail / 1e9:.1f} GB {where}; "
                f"{_runnable_tail(fits, dev)}")
    root = _cache_root(cache_dir)
    if not _cached(root, name, quant):
        try:
            check_free_disk(root, name, quant, runnable=lambda free: runnable_presets(
                dev, allow_dequant_fallback, cache_dir, free_disk=free))
        except NotEnoughDiskError as e:
            return str(e)
    return None


def _resolve_spec(spec: str, dev: torch.device, cache_dir) -> tuple[Path, str, str, list[str]]:
    """spec -> (checkpoint dir, ModelInfo.name, source, notes)."""
    notes: list[str] = []
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec == "auto":
        (preset, _, quant), fallback = auto_spec(dev)[0].partition(":"), auto_spec(dev)[1]
        msg = f"model 'auto' on {dev.type}: synthetic {preset} {quant} checkpoint"
        logger.info(msg)
        notes.append(msg)
        if fallback:
            notes.append(fallback)
        return cached_checkpoint(preset, quant, cache_dir=cache_dir), preset, "synthetic", notes
    name, _, quant = spec.partition(":")
    if name in PRESETS:
        if not quant:
            # A bare preset means the project's target format on GPU, and the backend-free format on CPU.
            quant = "awq" if dev.type == "cuda" else "fp16"
            msg = f"model {spec!r} on {dev.type}: no ':awq'/':fp16' suffix, using {quant}"
            logger.info(msg)
            notes.append(msg)
        if quant not in ("awq", "fp16"):
            raise ValueError(f"unknown quantisation suffix {quant!r} in {spec!r}; use '{name}:awq' or '{name}:fp16'")
        return cached_checkpoint(name, quant, cache_dir=cache_dir), name, "synthetic", notes
    expanded = Path(spec).expanduser()
    if expanded.exists():
        if not expanded.is_dir():
            raise FileNotFoundError(f"model path {spec!r} is a file; expected a checkpoint directory with config.json")
        return expanded, str(expanded), "local", notes
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec):
        raise FileNotFoundError(f"model path {spec!r} does not exist")
    if "/" not in spec:
        raise ValueError(f"unknown model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}, optionally with "
                         f"':awq' or ':fp16'), not an existing checkpoint directory, and not a hub id (org/name)")
    if not _HUB_ID.match(spec):
        raise FileNotFoundError(f"model path {spec!r} does not exist (and it is not a valid hub id either)")
    # org/name: a hub id, usable only if it is already in the local Hugging Face cache.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        local = snapshot_download(spec, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise FileNotFoundError(
            f"{spec!r} is neither an existing directory nor a model in the local Hugging Face cache; this project "
            f"runs offline and never downloads. Pass a local checkpoint directory or a preset "
            f"({', '.join(sorted(PRESETS))}).") from e
    return Path(local), spec, "hub", notes


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face checkpoint directory")
    return json.loads(cfg_file.read_text())


def _default_awq_backend(dev: torch.device) -> str:
    # Backends that run without compiling anything against the installed torch: gptqmodel's Triton int4 GEMM on
    # CUDA (its CUDA-extension kernels - gemm, marlin, exllama, machete - need a build), and the pure-PyTorch
    # dequantise-then-matmul kernel elsewhere (exact fp16, unlike the CPU ATen int4 kernel's bf16 scales).
    if dev.type == "cuda" and detect_awq_backends().get("triton"):
        return "gemm_triton"
    return "torch_awq"


def _quant_linear_classes(model) -> list[str]:
    names = set()
    for m in model.modules():
        if hasattr(m, "qweight") and hasattr(m, "in_features") and hasattr(m, "out_features"):
            mod = type(m).__module__.split(".")[0]
            names.add(f"{mod}:{type(m).__name__}")
    return sorted(names)


def _logical_num_params(model) -> int:
    total = 0
    for m in model.modules():
        if hasattr(m, "qweight") and hasattr(m, "in_features"):
            total += m.in_features * m.out_features + (m.bias.numel() if getattr(m, "bias", None) is not None else 0)
        else:
            total += sum(p.numel() for p in m.parameters(recurse=False))
    return total


def _iter_checkpoint_tensors(path: Path):
    from safetensors import safe_open
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


def _load_awq_dequantized(path: Path, raw_cfg: dict, dev: torch.device, dtype: torch.dtype, attn_implementation):
    """The AWQ checkpoint at `path`, every int4 linear dequantised (llm_attn.awq.dequantize) into an fp16 Linear."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    qc = raw_cfg["quantization_config"]
    group_size = int(qc.get("group_size", 128))
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in _iter_checkpoint_tensors(path):
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("qweight", "qzeros", "scales"):
            parts = pending.setdefault(prefix, {})
            parts[leaf] = t
            if len(parts) == 3:
                state[prefix + ".weight"] = awq_format.dequantize(parts["qweight"], parts["qzeros"],
                                                                  parts["scales"], group_size, dtype=dtype)
                del pending[prefix]
        else:
            state[name] = t.to(dtype) if t.is_floating_point() else t
    if pending:
        raise ValueError(f"{path}: incomplete AWQ tensors for {sorted(pending)[:3]} (need qweight, qzeros, scales)")
    # from_pretrained with a state_dict (and no path) goes through transformers' normal loading: dtype handling,
    # device placement, tied/missing-weight checks and non-persistent buffers (rotary inv_freq) set up as usual.
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = model_cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype, device_map=str(dev),
                                      attn_implementation=attn_implementation)
    return model


def load_model(spec: str = "auto", device: str | None = None, dtype: torch.dtype = torch.float16,
               allow_dequant_fallback: bool = False, attn_implementation: str = "sdpa", cache_dir=None,
               awq_backend: str | None = None):
    """Loads a causal LM for the harness; returns (model in eval mode on `device`, ModelInfo).

    spec: "auto" | preset[":awq"|":fp16"] | local checkpoint dir | hub id already in the local HF cache.
    device: "cuda" / "cpu" (default: cuda when available).
    AWQ checkpoints go through transformers' AWQ quantizer and gptqmodel; awq_backend picks gptqmodel's kernel
    ("gemm_triton", "torch_awq", "gemm", "marlin", ... or "auto" for gptqmodel's own choice); by default
    gemm_triton on CUDA and torch_awq on CPU. Without gptqmodel an AWQ checkpoint raises AwqBackendMissingError,
    unless allow_dequant_fallback, which loads it dequantised to fp16 (ModelInfo.quant "awq-dequantized-fp16").
    """
    from transformers import AutoModelForCausalLM

    dev = _resolve_device(device)
    preset = _preset_quant(spec, dev) if isinstance(spec, str) else None
    if preset is not None and preset[1] == "awq" and _awq_runs_as(allow_dequant_fallback) is None:
        # Said before the checkpoint is generated (5.4 GB for the 8B model), not after.
        raise AwqBackendMissingError(f"{spec} is an AWQ int4 checkpoint but no AWQ backend is installed "
                                     f"(detected: {detect_awq_backends()}). {AWQ_INSTALL_HINT}")
    path, name, source, notes = _resolve_spec(spec, dev, cache_dir)
    raw_cfg = _read_config(path)
    qc = raw_cfg.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method and method != "awq":
        raise ValueError(f"{path}: quant_method {method!r} is not supported here (only AWQ and unquantised)")
    is_awq = method == "awq"
    common = dict(dtype=dtype, device_map=str(dev), attn_implementation=attn_implementation)
    if source == "local" and (path / PROVENANCE_FILE).is_file():
        source = "synthetic"  # a directory written by write_synthetic_checkpoint

    awq_classes: list[str] = []
    dequant = False
    if is_awq:
        fmt = str(qc.get("version", qc.get("format", "gemm"))).lower()
        if int(qc.get("bits", 4)) != 4:
            raise ValueError(f"{path}: AWQ with bits={qc.get('bits')} is not supported (4 only)")
        if dtype != torch.float16:
            notes.append(f"AWQ kernels compute in float16; dtype {dtype} requested")
        if _gptqmodel_available():
            from transformers import AwqConfig
            _import_gptqmodel()
            backend = awq_backend or _default_awq_backend(dev)
            override = AwqConfig(bits=4, group_size=int(qc.get("group_size", 128)),
                                 zero_point=bool(qc.get("zero_point", True)), version=fmt, backend=backend)
            with warnings.catch_warnings(), _quiet_loading():
                # transformers warns that the checkpoint's config wins except for loading attributes; the backend
                # is the loading attribute we mean to set.
                if not verbose():
                    warnings.filterwarnings("ignore", message=".*already has a `quantization_config`.*")
                model = AutoModelForCausalLM.from_pretrained(path, quantization_config=override, **common)
            awq_classes = _quant_linear_classes(model)
            if not awq_classes:
                raise RuntimeError(f"{path}: AWQ checkpoint loaded but no quantised linear was found in the model")
            quant = "awq-int4"
        elif allow_dequant_fallback:
            if fmt != "gemm":
                raise ValueError(f"{path}: dequantising fallback supports AWQ 'gemm' only, got {fmt!r}")
            if dtype != torch.float16:
                raise ValueError("the AWQ dequantising fallback produces float16 weights; pass dtype=torch.float16")
            msg = "no AWQ backend installed: running the AWQ checkpoint dequantised to fp16 (allow_dequant_fallback)"
            logger.warning(msg)
            notes.append(msg)
            with _quiet_loading():
                model = _load_awq_dequantized(path, raw_cfg, dev, dtype, attn_implementation)
            quant, dequant = "awq-dequantized-fp16", True
        else:
            raise AwqBackendMissingError(f"{path} is an AWQ int4 checkpoint but no AWQ backend is installed "
                                         f"(detected: {detect_awq_backends()}). {AWQ_INSTALL_HINT}")
    else:
        with _quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(path, **common)
        quant = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    model.eval()
    gen = getattr(model, "generation_config", None)
    if source == "synthetic" and gen is not None and gen.max_length == model.config.max_position_embeddings:
        # Checkpoints written before synthetic.py stopped saving it: a max_length beside the user's max_new_tokens
        # makes every generate() warn that both are set.
        gen.max_length = None

    cfg = model.config
    info = ModelInfo(
        name=name, source=source, quant=quant,
        awq_backend=",".join(awq_classes) if awq_classes else None, dequant_fallback=dequant,
        dtype=str(model.dtype).replace("torch.", ""), device=str(next(model.parameters()).device),
        num_params=_logical_num_params(model),
        config={k: getattr(cfg, k, None) for k in (
            "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")},
        versions=_versions(), path=str(path), notes=notes)
    logger.info("loaded %s (%s, %s, %s) on %s", name, source, quant, info.awq_backend or "no int4 backend",
                info.device)
    return model, info


def max_seq_len(model) -> int:
    """The longest sequence the model's position encoding is configured for (config.max_position_embeddings)."""
    cfg = getattr(model, "config", model)
    n = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"model config has no usable max_position_embeddings ({n!r})")
    return n

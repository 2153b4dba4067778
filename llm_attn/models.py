"""Model presets, synthetic Llama checkpoints (fp16 or AWQ int4) and one loader for presets, local dirs and hub ids.

No weights are downloaded: `write_synthetic_checkpoint` writes a real Hugging Face checkpoint directory
(config.json, sharded safetensors, generation_config.json) with seeded random weights in the exact Llama geometry
of a preset, either in fp16 or in the standard AWQ GEMM int4 format (see llm_attn/awq.py). `load_model` then loads
it through the real loaders: transformers' AutoModelForCausalLM, and for AWQ transformers' AWQ quantizer, which
replaces the linears with gptqmodel's int4 QuantLinear classes. Which class actually runs is read back from the
loaded modules and reported in ModelInfo.awq_backend.

    python -m llm_attn.models generate llama-3-8b awq        # generate (or reuse) the cached checkpoint, print time
    python -m llm_attn.models load tiny:awq --device cpu      # load a spec, print its ModelInfo as JSON
    python -m llm_attn.models backends                        # installed AWQ packages

Specs accepted by load_model: "auto" (CUDA: synthetic llama-3-8b AWQ; CPU: synthetic tiny fp16), a preset name
with an optional ":awq" / ":fp16" suffix, a local checkpoint directory (AWQ or not), or a hub id that is already in
the local Hugging Face cache (nothing is fetched: this project runs offline).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from llm_attn import awq as awq_format

logger = logging.getLogger("llm_attn.models")

# Bump when the synthetic weight recipe or file layout changes, so cached checkpoints are regenerated.
SYNTHETIC_FORMAT_VERSION = 1
MARKER_FILE = ".llm_attn_complete"
PROVENANCE_FILE = "llm_attn_synthetic.json"
SHARD_BYTES = 2 * 1024**3
AWQ_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# ----------------------------------------------------------------------------------------------------- presets

@dataclass(frozen=True)
class ModelPreset:
    """A named Llama-architecture geometry."""
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    bos_token_id: int = 1
    eos_token_id: int = 2


PRESETS: dict[str, ModelPreset] = {
    # Llama 3 8B geometry with Llama 3.1's rope scaling. max_position_embeddings is 131072 as Llama 3.1 ships it:
    # transformers warns when original_max_position_embeddings (8192) is not below max_position_embeddings.
    # Callers that size caches must cap lengths themselves (max_seq_len() is a model limit, not a memory budget).
    "llama-3-8b": ModelPreset(
        name="llama-3-8b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    # Small enough for CPU tests, but with the features that matter to the attention patch: GQA (8 q heads over
    # 2 kv heads), head_dim 64 (a size the CUDA kernel supports), and linears that are multiples of 128 so AWQ
    # group_size 128 applies to every one of them.
    "tiny": ModelPreset(
        name="tiny", hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
        max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=None, rms_norm_eps=1e-5),
    # Llama 3 70B geometry (80 layers, 64 q / 8 kv heads, hidden 8192), with the 8B preset's Llama 3.1 rope scaling.
    # fp16 is ~141 GB on disk, AWQ int4 ~40 GB: check_free_disk refuses a write that does not fit.
    "llama-3-70b": ModelPreset(
        name="llama-3-70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    # The tensor-parallel test model (llm_attn.harness.tp): 8 q / 4 kv heads split 4/2 per rank at TP=2 (and 2/1 at
    # TP=4), every linear a multiple of 128 (AWQ groups) and of 2 and 4 (row/column shards); runs on CPU with gloo.
    "tiny-tp": ModelPreset(
        name="tiny-tp", hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024,
        max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=None, rms_norm_eps=1e-5),
}


def get_preset(preset: str | ModelPreset) -> ModelPreset:
    if isinstance(preset, ModelPreset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[preset]


def llama_config(preset: str | ModelPreset, **overrides):
    """transformers.LlamaConfig for a preset; keyword overrides replace preset fields or add config fields."""
    from transformers import LlamaConfig

    p = get_preset(preset)
    fields = {f.name for f in dataclasses.fields(ModelPreset)} - {"name"}
    preset_overrides = {k: overrides.pop(k) for k in list(overrides) if k in fields}
    if preset_overrides:
        p = dataclasses.replace(p, **preset_overrides)
    # transformers 5 keeps rope_theta and the scaling recipe together in rope_parameters.
    rope = {"rope_type": "default"} if p.rope_scaling is None else dict(p.rope_scaling)
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(p.rope_theta)
    kwargs = dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=p.rms_norm_eps, rope_parameters=rope,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        bos_token_id=p.bos_token_id, eos_token_id=p.eos_token_id, architectures=["LlamaForCausalLM"],
    )
    kwargs.update(overrides)
    if kwargs["num_attention_heads"] % kwargs["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return LlamaConfig(**kwargs)


def _param_count(cfg) -> int:
    h, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = h * hd * (nq + 2 * nkv) + nq * hd * h + 3 * h * f + 2 * h
    return v * h * (1 if cfg.tie_word_embeddings else 2) + layers * per_layer + h


# --------------------------------------------------------------------------------------- synthetic checkpoints

def _default_gen_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class _Unit:
    """One thing to generate: a plain tensor or one AWQ linear (3 tensors), with its output size in bytes."""
    name: str            # tensor name (plain) or module prefix (awq linear)
    kind: str            # "embed" | "norm" | "linear" | "awq"
    shape: tuple         # plain: tensor shape; linear/awq: (out_features, in_features)
    std: float           # target std of the (dequantised) weight
    nbytes: int


def _plan(cfg, quant: str, group_size: int) -> list[_Unit]:
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out = cfg.num_attention_heads * cfg.head_dim
    kv_out = cfg.num_key_value_heads * cfg.head_dim
    units = [_Unit("model.embed_tokens.weight", "embed", (v, h), 1.0, v * h * 2)]

    def linear(prefix, out_f, in_f):
        # Unit-variance activations stay unit variance through a linear whose weights have std 1/sqrt(in).
        # Layer outputs are not damped, so every layer (attention included) visibly moves the logits: a broken
        # attention kernel must not hide behind a residual stream dominated by the embeddings.
        std = 1.0 / math.sqrt(in_f)
        if quant == "awq":
            if in_f % group_size or out_f % awq_format.PACK:
                raise ValueError(f"{prefix}: in_features {in_f} must be a multiple of group_size {group_size} and "
                                 f"out_features {out_f} a multiple of {awq_format.PACK} for AWQ")
            nb = in_f * out_f // 2 + (in_f // group_size) * out_f * (2 + 0.5)
            units.append(_Unit(prefix, "awq", (out_f, in_f), std, int(nb)))
        else:
            units.append(_Unit(prefix + ".weight", "linear", (out_f, in_f), std, in_f * out_f * 2))

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        units.append(_Unit(f"{p}.input_layernorm.weight", "norm", (h,), 0.0, h * 2))
        linear(f"{p}.self_attn.q_proj", q_out, h)
        linear(f"{p}.self_attn.k_proj", kv_out, h)
        linear(f"{p}.self_attn.v_proj", kv_out, h)
        linear(f"{p}.self_attn.o_proj", h, q_out)
        units.append(_Unit(f"{p}.post_attention_layernorm.weight", "norm", (h,), 0.0, h * 2))
        linear(f"{p}.mlp.gate_proj", f, h)
        linear(f"{p}.mlp.up_proj", f, h)
        linear(f"{p}.mlp.down_proj", h, f)
    units.append(_Unit("model.norm.weight", "norm", (h,), 0.0, h * 2))
    # lm_head stays fp16 in AWQ checkpoints (as AutoAWQ leaves it); logits then have std ~1.
    units.append(_Unit("lm_head.weight", "embed", (v, h), 1.0 / math.sqrt(h), v * h * 2))
    return units


# The centred code (q - z), q uniform on 0..15 and z uniform on {7, 8}, has mean 0 and this std.
_CODE_STD = math.sqrt((16**2 - 1) / 12 + 0.25)


def synthetic_awq_linear(gen: torch.Generator, out_features: int, in_features: int, group_size: int, std: float,
                         device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded random AWQ layer (qweight, qzeros, scales) whose dequantised weight has roughly the given std.

    Uniformly random int32 words are exactly eight independent uniform 4-bit codes each, in whatever nibble order,
    so qweight is drawn packed: that skips a pack over in*out codes and makes the 8B model cheap to generate.
    """
    groups = in_features // group_size
    qweight = torch.empty((in_features, out_features // awq_format.PACK), dtype=torch.int32, device=device)
    qweight.random_(-2**31, 2**31, generator=gen)
    # Zero points 7 or 8 centre the codes (mean 7.5), so weights have no common offset that would add up over
    # thousands of inputs.
    zeros = torch.randint(7, 9, (groups, out_features), generator=gen, device=device, dtype=torch.int32)
    # Per-(group, column) scales spread by +-25% so that a scale/zero layout mix-up changes the result.
    jitter = torch.empty((groups, out_features), device=device).uniform_(-0.25, 0.25, generator=gen).exp_()
    scales = (std / _CODE_STD) * jitter
    return {"qweight": qweight, "qzeros": awq_format.pack_int4(zeros), "scales": scales.to(torch.float16)}


def _generate_unit(u: _Unit, gen: torch.Generator, device: torch.device, group_size: int) -> dict[str, torch.Tensor]:
    if u.kind == "norm":
        # Near 1 (as trained RMSNorm gains are), not exactly 1, so a norm weight that fails to load shows.
        w = torch.empty(u.shape, device=device).uniform_(0.9, 1.1, generator=gen)
        return {u.name: w.to(torch.float16)}
    if u.kind in ("embed", "linear"):
        w = torch.empty(u.shape, device=device, dtype=torch.float32).normal_(0.0, u.std, generator=gen)
        return {u.name: w.to(torch.float16)}
    out_f, in_f = u.shape
    t = synthetic_awq_linear(gen, out_f, in_f, group_size, u.std, device)
    return {f"{u.name}.{k}": v for k, v in t.items()}


class NotEnoughDiskError(OSError):
    """The synthetic checkpoint would not fit on the disk it is to be written to."""


# Headroom over the planned tensor bytes: safetensors headers, config files, and the filesystem's own blocks.
DISK_HEADROOM = 1.02


def estimated_checkpoint_bytes(preset: str | ModelPreset, quant: Literal["awq", "fp16"], group_size: int = 128) -> int:
    """Bytes the tensors of a synthetic checkpoint take on disk (the writer's own plan, summed)."""
    return sum(u.nbytes for u in _plan(llama_config(get_preset(preset)), quant, group_size))


def check_free_disk(path, preset: str | ModelPreset, quant: Literal["awq", "fp16"], group_size: int = 128) -> int:
    """Raise NotEnoughDiskError (one line: needed vs free, and which presets do fit) unless the checkpoint fits
    on the filesystem holding ``path`` (or its nearest existing parent). Returns the estimated size in bytes."""
    p = get_preset(preset)
    need = int(estimated_checkpoint_bytes(p, quant, group_size) * DISK_HEADROOM)
    where = Path(path).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        fits = [f"{name}:{q}" for name in PRESETS for q in ("awq", "fp16")
                if estimated_checkpoint_bytes(name, q, group_size) * DISK_HEADROOM <= free]
        raise NotEnoughDiskError(
            f"not enough free disk for the synthetic {p.name} {quant} checkpoint in {where}: needs "
            f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free; presets that fit there: {', '.join(fits) or 'none'} "
            f"(or set LLM_ATTN_CACHE to a larger disk)")
    return need


def write_synthetic_checkpoint(path, preset: str | ModelPreset, quant: Literal["awq", "fp16"], seed: int = 0,
                               group_size: int = 128, device: str | torch.device | None = None,
                               shard_bytes: int = SHARD_BYTES) -> Path:
    """Writes a loadable Hugging Face checkpoint with seeded random weights; returns its directory.

    quant="fp16": every weight in fp16. quant="awq": q/k/v/o/gate/up/down_proj of every layer in AWQ GEMM int4
    (llm_attn/awq.py); embeddings, norms and lm_head in fp16; config.json carries the AWQ quantization_config.
    Tensors are generated on `device` (default: CUDA when available, which makes the 8B model take seconds rather
    than minutes) one shard at a time, so memory stays bounded by the shard size. The same seed on the same kind
    of device gives the same weights. The directory must be absent or empty.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if quant not in ("awq", "fp16"):
        raise ValueError(f"quant must be 'awq' or 'fp16', got {quant!r}")
    p = get_preset(preset)
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; refusing to write a checkpoint over it")
    check_free_disk(path, p, quant, group_size)
    path.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device) if device is not None else _default_gen_device()
    cfg = llama_config(p)
    units = _plan(cfg, quant, group_size)

    shards: list[list[tuple[int, _Unit]]] = [[]]
    size = 0
    for idx, u in enumerate(units):
        if shards[-1] and size + u.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((idx, u))
        size += u.nbytes

    weight_map: dict[str, str] = {}
    total_bytes = 0
    t0 = time.perf_counter()
    for s_idx, shard in enumerate(shards):
        fname = f"model-{s_idx + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for idx, u in shard:
            # One generator per tensor, seeded from (seed, position): a tensor does not depend on the sharding.
            gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + idx)
            for name, t in _generate_unit(u, gen, dev, group_size).items():
                tensors[name] = t.to("cpu", non_blocking=False).contiguous()
        for name, t in tensors.items():
            weight_map[name] = fname
            total_bytes += t.numel() * t.element_size()
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        del tensors
        logger.info("wrote %s (%d/%d) after %.1fs", fname, s_idx + 1, len(shards), time.perf_counter() - t0)

    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
    cfg.dtype = torch.float16
    if quant == "awq":
        # The standard AutoAWQ GEMM config. lm_head is listed explicitly (transformers also skips it by default).
        cfg.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                   "version": "gemm", "modules_to_not_convert": ["lm_head"]}
    cfg.save_pretrained(path)
    GenerationConfig(bos_token_id=p.bos_token_id, eos_token_id=p.eos_token_id, do_sample=False,
                     max_length=p.max_position_embeddings).save_pretrained(path)
    (path / PROVENANCE_FILE).write_text(json.dumps({
        "generator": "llm_attn.models.write_synthetic_checkpoint", "format_version": SYNTHETIC_FORMAT_VERSION,
        "preset": dataclasses.asdict(p), "quant": quant, "seed": seed, "group_size": group_size,
        "device": dev.type, "seconds": round(time.perf_counter() - t0, 2)}, indent=2))
    return path


def _cache_root(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("LLM_ATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llm_attn"


def cached_checkpoint(preset: str | ModelPreset, quant: Literal["awq", "fp16"], cache_dir=None, seed: int = 0,
                      group_size: int = 128) -> Path:
    """The synthetic checkpoint for (preset, quant, seed), generated on first use and reused after.

    The marker file is written after everything else, so a directory without it (an interrupted generation) is
    deleted and generated again. A file lock keeps two processes from generating the same checkpoint at once.
    """
    from filelock import FileLock

    p = get_preset(preset)
    if quant not in ("awq", "fp16"):
        raise ValueError(f"quant must be 'awq' or 'fp16', got {quant!r}")
    # A custom ModelPreset with a known name but other geometry must not reuse the named preset's files.
    if PRESETS.get(p.name) == p:
        tag = p.name
    else:
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(p), sort_keys=True).encode()).hexdigest()[:10]
        tag = f"{p.name}-{digest}"
    suffix = f"-g{group_size}" if quant == "awq" else ""
    root = _cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{tag}-{quant}{suffix}-seed{seed}-v{SYNTHETIC_FORMAT_VERSION}"
    with FileLock(str(path) + ".lock"):
        if (path / MARKER_FILE).is_file():
            return path
        if path.exists():
            logger.warning("removing incomplete synthetic checkpoint %s (no %s marker)", path, MARKER_FILE)
            shutil.rmtree(path)
        logger.info("generating synthetic %s %s checkpoint in %s", p.name, quant, path)
        write_synthetic_checkpoint(path, p, quant, seed=seed, group_size=group_size)
        (path / MARKER_FILE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return path


# ------------------------------------------------------------------------------------------------------ loading

class AwqBackendMissingError(ImportError):
    """An AWQ checkpoint was asked for but no AWQ backend that transformers can use is installed."""


AWQ_INSTALL_HINT = (
    "transformers loads AWQ checkpoints through gptqmodel. Install it and the packages it imports without letting "
    "pip replace torch:\n"
    "  pip install --no-deps --no-build-isolation gptqmodel==7.5.0 pypcre==0.6.4 logbar==0.4.15 "
    "tokenicer==0.0.14 device-smi==0.5.7 defuser==0.0.28 threadpoolctl requests\n"
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
    """Imports gptqmodel without letting it change this process's CUDA allocator or device numbering.

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
    try:
        # gptqmodel prints a banner and its log lines on stdout; keep stdout for our callers' results (JSON).
        with contextlib.redirect_stdout(sys.stderr):
            import gptqmodel  # noqa: F401
    finally:
        for k in pinned:
            os.environ.pop(k, None)


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


def _resolve_spec(spec: str, dev: torch.device, cache_dir) -> tuple[Path, str, str, list[str]]:
    """spec -> (checkpoint dir, ModelInfo.name, source, notes)."""
    notes: list[str] = []
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec == "auto":
        preset, quant = ("llama-3-8b", "awq") if dev.type == "cuda" else ("tiny", "fp16")
        msg = f"model 'auto' on {dev.type}: synthetic {preset} {quant} checkpoint"
        logger.info(msg)
        notes.append(msg)
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
            with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
                # transformers warns that the checkpoint's config wins except for loading attributes; the backend
                # is the loading attribute we mean to set.
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
            model = _load_awq_dequantized(path, raw_cfg, dev, dtype, attn_implementation)
            quant, dequant = "awq-dequantized-fp16", True
        else:
            raise AwqBackendMissingError(f"{path} is an AWQ int4 checkpoint but no AWQ backend is installed "
                                         f"(detected: {detect_awq_backends()}). {AWQ_INSTALL_HINT}")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **common)
        quant = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    model.eval()

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


# ---------------------------------------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llm_attn.models", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate (or reuse) a cached synthetic checkpoint and print its path")
    g.add_argument("preset", choices=sorted(PRESETS))
    g.add_argument("quant", choices=["awq", "fp16"])
    g.add_argument("--cache-dir")
    g.add_argument("--seed", type=int, default=0)
    ld = sub.add_parser("load", help="load a model spec and print its ModelInfo as JSON")
    ld.add_argument("spec", nargs="?", default="auto")
    ld.add_argument("--device")
    ld.add_argument("--cache-dir")
    ld.add_argument("--awq-backend")
    ld.add_argument("--allow-dequant-fallback", action="store_true")
    sub.add_parser("backends", help="print installed AWQ packages")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.cmd == "generate":
        t0 = time.perf_counter()
        path = cached_checkpoint(args.preset, args.quant, cache_dir=args.cache_dir, seed=args.seed)
        print(f"{path}  ({time.perf_counter() - t0:.1f}s)")
    elif args.cmd == "load":
        t0 = time.perf_counter()
        _, info = load_model(args.spec, device=args.device, cache_dir=args.cache_dir, awq_backend=args.awq_backend,
                             allow_dequant_fallback=args.allow_dequant_fallback)
        print(json.dumps({**info.to_dict(), "load_seconds": round(time.perf_counter() - t0, 2)}, indent=2))
    else:
        print(json.dumps(detect_awq_backends(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

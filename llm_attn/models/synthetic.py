"""Synthetic Llama checkpoints (fp16 or AWQ int4) with seeded random weights in the exact geometry of a preset,
and their on-disk cache. No weights are downloaded (see llm_attn.models)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from llm_attn import awq as awq_format

logger = logging.getLogger("llm_attn.models")

from llm_attn.models.presets import PRESETS, ModelPreset, get_preset, llama_config
from llm_attn.models.tokenizer import ensure_offline_tokenizer, write_offline_tokenizer

# Bump when the synthetic weight recipe or file layout changes, so cached checkpoints are regenerated.
SYNTHETIC_FORMAT_VERSION = 1
MARKER_FILE = ".llm_attn_complete"
# Written by the writer after each finished shard: a killed write resumes from it (write_synthetic_checkpoint(resume=)).
PROGRESS_FILE = ".llm_attn_progress.json"
PROVENANCE_FILE = "llm_attn_synthetic.json"
SHARD_BYTES = 2 * 1024**3
AWQ_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")



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


def check_free_disk(path, preset: str | ModelPreset, quant: Literal["awq", "fp16"], group_size: int = 128,
                    runnable=None, written: int = 0) -> int:
    """Raise NotEnoughDiskError (one line: needed vs free, and which presets do fit) unless the checkpoint fits
    on the filesystem holding ``path`` (or its nearest existing parent). Returns the estimated size in bytes (still
    to write: ``written`` bytes of it are there already in a resumed write).
    ``runnable(free_disk_bytes)``, when given, names the models that can run here instead (the loader's preflight:
    memory, disk and the AWQ backend)."""
    p = get_preset(preset)
    need = int(max(0, estimated_checkpoint_bytes(p, quant, group_size) - written) * DISK_HEADROOM)
    where = Path(path).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        fits = runnable(free) if runnable is not None else [
            f"{name}:{q}" for name in PRESETS for q in ("awq", "fp16")
            if estimated_checkpoint_bytes(name, q, group_size) * DISK_HEADROOM <= free]
        raise NotEnoughDiskError(
            f"not enough free disk for the synthetic {p.name} {quant} checkpoint in {where}: needs "
            f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free; "
            f"{'models that run here' if runnable is not None else 'presets that fit there'}: "
            f"{', '.join(fits) or 'none'} (or set LLM_ATTN_CACHE to a larger disk)")
    return need


def write_synthetic_checkpoint(path, preset: str | ModelPreset, quant: Literal["awq", "fp16"], seed: int = 0,
                               group_size: int = 128, device: str | torch.device | None = None,
                               shard_bytes: int = SHARD_BYTES, resume: bool = False) -> Path:
    """Writes a loadable Hugging Face checkpoint with seeded random weights; returns its directory.

    quant="fp16": every weight in fp16. quant="awq": q/k/v/o/gate/up/down_proj of every layer in AWQ GEMM int4
    (llm_attn/awq.py); embeddings, norms and lm_head in fp16; config.json carries the AWQ quantization_config.
    Tensors are generated on `device` (default: CUDA when available, which makes the 8B model take seconds rather
    than minutes) one shard at a time, so memory stays bounded by the shard size. The same seed on the same kind
    of device gives the same weights. The directory must be absent or empty, unless ``resume``: then the
    shards a killed write of the same checkpoint finished (PROGRESS_FILE, written after each shard; a shard is
    written to ``<name>.partial`` and renamed when complete) are kept and the write goes on from the first missing
    one. Every tensor has its own generator seeded from (seed, position), so a resumed checkpoint is byte-identical
    to an uninterrupted one. A progress file of another checkpoint (preset, format, seed, sharding, device kind)
    is refused (ValueError).
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if quant not in ("awq", "fp16"):
        raise ValueError(f"quant must be 'awq' or 'fp16', got {quant!r}")
    p = get_preset(preset)
    path = Path(path)
    dev = torch.device(device) if device is not None else _default_gen_device()
    # What a resumed write must match: the same checkpoint, cut into the same shards, by the same kind of generator.
    recipe = {"preset": dataclasses.asdict(p), "quant": quant, "seed": seed, "group_size": group_size,
              "shard_bytes": shard_bytes, "device": dev.type, "format_version": SYNTHETIC_FORMAT_VERSION}
    progress = {"recipe": recipe, "shards": {}}
    if path.exists() and any(path.iterdir()):
        saved = _read_progress(path) if resume else None
        if saved is None:
            raise FileExistsError(f"{path} exists and is not empty; refusing to write a checkpoint over it")
        if saved.get("recipe") != recipe:
            raise ValueError(f"{path}: its progress file is of another checkpoint ({saved.get('recipe')}), not "
                             f"{recipe}; cannot resume it")
        progress = saved
        # A shard counts only when its file is there whole (the rename comes after the write, the record after both).
        progress["shards"] = {f: v for f, v in saved["shards"].items()
                              if (path / f).is_file() and (path / f).stat().st_size == v["file_bytes"]}
    written = sum(v["tensor_bytes"] for v in progress["shards"].values())
    check_free_disk(path, p, quant, group_size, written=written)
    path.mkdir(parents=True, exist_ok=True)
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
    if progress["shards"]:
        logger.info("resuming %s: %d of %d shards already written", path, len(progress["shards"]), len(shards))
    for s_idx, shard in enumerate(shards):
        fname = f"model-{s_idx + 1:05d}-of-{len(shards):05d}.safetensors"
        done = progress["shards"].get(fname)
        if done is not None:
            weight_map.update(dict.fromkeys(done["tensors"], fname))
            total_bytes += done["tensor_bytes"]
            continue
        tensors: dict[str, torch.Tensor] = {}
        for idx, u in shard:
            # One generator per tensor, seeded from (seed, position): a tensor does not depend on the sharding.
            gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + idx)
            for name, t in _generate_unit(u, gen, dev, group_size).items():
                tensors[name] = t.to("cpu", non_blocking=False).contiguous()
        shard_tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        for name in tensors:
            weight_map[name] = fname
        total_bytes += shard_tensor_bytes
        partial = path / (fname + ".partial")
        save_file(tensors, str(partial), metadata={"format": "pt"})
        os.replace(partial, path / fname)
        progress["shards"][fname] = {"tensors": list(tensors), "tensor_bytes": shard_tensor_bytes,
                                     "file_bytes": (path / fname).stat().st_size}
        _write_progress(path, progress)
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
    # No max_length: with the max_new_tokens of a caller's generate() it makes transformers warn that both are set
    # (the model's limit is config.json's max_position_embeddings).
    GenerationConfig(bos_token_id=p.bos_token_id, eos_token_id=p.eos_token_id,
                     do_sample=False).save_pretrained(path)
    # A tokenizer, so that --prompts can tokenize text for it (trained offline; bos/eos at the preset's ids).
    write_offline_tokenizer(path, p.vocab_size, bos_token_id=p.bos_token_id, eos_token_id=p.eos_token_id)
    (path / PROVENANCE_FILE).write_text(json.dumps({
        "generator": "llm_attn.models.write_synthetic_checkpoint", "format_version": SYNTHETIC_FORMAT_VERSION,
        "preset": dataclasses.asdict(p), "quant": quant, "seed": seed, "group_size": group_size,
        "device": dev.type, "seconds": round(time.perf_counter() - t0, 2)}, indent=2))
    (path / PROGRESS_FILE).unlink(missing_ok=True)
    return path


def _read_progress(path: Path) -> dict | None:
    try:
        saved = json.loads((path / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("shards"), dict) else None


def _write_progress(path: Path, progress: dict) -> None:
    tmp = path / (PROGRESS_FILE + ".tmp")
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, path / PROGRESS_FILE)


def _cache_root(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("LLM_ATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llm_attn"


def cached_checkpoint(preset: str | ModelPreset, quant: Literal["awq", "fp16"], cache_dir=None, seed: int = 0,
                      group_size: int = 128) -> Path:
    """The synthetic checkpoint for (preset, quant, seed), generated on first use and reused after.

    The marker file is written after everything else. A directory without it is an interrupted generation: it
    resumes from the shards it finished (``write_synthetic_checkpoint(resume=True)``; the 70B AWQ checkpoint is 20
    shards of 2 GiB), or, without a progress file of this checkpoint, is deleted and generated again. A file lock
    keeps two processes from generating the same checkpoint at once.
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
            # Cached before checkpoints carried a tokenizer: add one next to the weights (not a reason to rewrite
            # them, so the format version stays).
            if ensure_offline_tokenizer(path, p.vocab_size, bos_token_id=p.bos_token_id,
                                        eos_token_id=p.eos_token_id):
                logger.info("added the offline tokenizer to %s", path)
            return path
        resume = path.exists() and _read_progress(path) is not None
        if path.exists() and not resume:
            logger.warning("removing incomplete synthetic checkpoint %s (no %s marker)", path, MARKER_FILE)
            shutil.rmtree(path)
        logger.info("%s synthetic %s %s checkpoint in %s", "resuming the" if resume else "generating", p.name, quant,
                    path)
        try:
            write_synthetic_checkpoint(path, p, quant, seed=seed, group_size=group_size, shard_bytes=SHARD_BYTES,
                                       resume=resume)
        except ValueError:
            if not resume:
                raise
            # Progress of another recipe (e.g. written on a GPU, resumed on a CPU: other random streams): start over.
            logger.warning("cannot resume %s (another recipe): generating it again", path)
            shutil.rmtree(path)
            write_synthetic_checkpoint(path, p, quant, seed=seed, group_size=group_size, shard_bytes=SHARD_BYTES)
        (path / MARKER_FILE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return path

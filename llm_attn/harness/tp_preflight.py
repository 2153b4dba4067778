"""What a tensor-parallel run checks before anything loads (``preflight``) and the synthetic checkpoint it writes
before the ranks start (``prepare_checkpoint``). Every problem is a ``TPError``: one line, exit status 2.

Checked: the TP degree, duplicated or unavailable implementations, WORLD_SIZE against ``--tp`` under torchrun,
enough GPUs, a model spec the ranks can load (a preset with ``:fp16``, ``:awq`` at TP=1 only, ``:init``, or a local
folder), KV and query heads divisible by the degree, AWQ int4 at TP > 1 (transformers' TP plan does not shard
gptqmodel's int4 buffers), prompts longer than the model's positions, and every implementation against the head
shard it would get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# '<preset>:init': a config-only skeleton whose weights transformers initialises at load (tp_world.skeleton_checkpoint).
INIT_SUFFIX = "init"


class TPError(ValueError):
    """Bad input for a tensor-parallel run: the CLI prints it in one line and exits 2."""


def model_geometry(spec: str) -> dict | None:
    """Head counts, head_dim and quantisation of ``spec`` without loading weights; None for a hub id (checked after
    loading instead)."""
    from llm_attn import models  # noqa: PLC0415

    name, _, quant = spec.partition(":")
    if name in models.PRESETS:
        p = models.PRESETS[name]
        return {"name": name, "q_heads": p.num_attention_heads, "kv_heads": p.num_key_value_heads,
                "head_dim": p.head_dim, "awq": quant == "awq", "preset": True, "quant": quant,
                "max_positions": p.max_position_embeddings}
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        q, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
        hd = cfg.get("head_dim") or (cfg["hidden_size"] // q if q else None)
        qc = cfg.get("quantization_config") or json.loads((path / "config.json").read_text()).get(
            "quantization_config") or {}
        return {"name": str(path), "q_heads": q, "kv_heads": kv, "head_dim": hd,
                "awq": str(qc.get("quant_method", "")).lower() == "awq", "preset": False, "quant": None,
                "max_positions": cfg.get("max_position_embeddings")}
    return None


def preflight(tp: int, spec: str, impls: list[str], device: str, dtype: torch.dtype, backend: str = "auto",
              world_size: int | None = None, seqs: list[int] | None = None) -> dict | None:
    """Every reason this TP run cannot work, found before anything is loaded: raises TPError (one line).
    Returns the model geometry (None for a hub id)."""
    from llm_attn import registry  # noqa: PLC0415

    if tp < 1:
        raise TPError(f"--tp {tp}: must be >= 1")
    if len(set(impls)) != len(impls):
        raise TPError(f"--impl lists an implementation twice: {impls}")
    for impl in impls:
        why = registry.unavailable_reason(impl, device)
        if why:
            raise TPError(f"--impl {impl}: {why}")
    if world_size is not None and world_size != tp:
        raise TPError(f"--tp {tp}: torchrun started {world_size} processes (WORLD_SIZE={world_size}); start "
                      f"exactly {tp} (--nproc-per-node {tp})")
    if device == "cuda":
        n = torch.cuda.device_count()
        if n < tp:
            raise TPError(f"--tp {tp}: needs {tp} GPUs, {n} visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if spec == "auto":
        raise TPError("--tp: give --model explicitly (a preset such as llama-3-8b:fp16, or a checkpoint folder); "
                      "'auto' is the AWQ model on GPUs, which transformers' TP plan cannot shard")
    geo = model_geometry(spec)
    if geo is None:
        from llm_attn import models  # noqa: PLC0415

        raise TPError(f"--model {spec}: under --tp give a preset ({', '.join(sorted(models.PRESETS))}, with ':fp16') "
                      f"or a local checkpoint folder")
    if geo["preset"] and geo["quant"] not in ("", "awq", "fp16", INIT_SUFFIX):
        raise TPError(f"--model {spec}: unknown suffix {geo['quant']!r}; use {geo['name']}:fp16, :awq (TP=1 only) "
                      f"or :{INIT_SUFFIX} (weights initialised at load, no checkpoint on disk)")
    if geo is not None:
        q, kv, hd = geo["q_heads"], geo["kv_heads"], geo["head_dim"]
        if kv % tp:
            raise TPError(f"--tp {tp}: {geo['name']} has {kv} KV heads, not divisible by {tp}; each rank must hold "
                          f"whole KV heads (use a TP degree that divides {kv})")
        if q % tp:
            raise TPError(f"--tp {tp}: {geo['name']} has {q} query heads, not divisible by {tp}")
        if geo["awq"] and tp > 1:
            raise TPError(f"--tp {tp}: {spec} is an AWQ int4 checkpoint, which transformers' TP plan cannot shard "
                          f"(gptqmodel keeps the int4 weights in buffers the plan does not split); use "
                          f"{geo['name'] if not geo['preset'] else geo['name'] + ':fp16'} with --dtype bfloat16 "
                          f"or float16")
        too_long = [n for n in seqs or () if geo.get("max_positions") and n > geo["max_positions"]]
        if too_long:
            raise TPError(f"--seq {too_long[0]}: longer than {geo['name']} allows ({geo['max_positions']} positions)")
        dev = torch.device(device)
        for impl in impls:
            entry = registry.get(impl)
            if entry.stock:
                continue
            variant, why = entry.choose(dev, dtype, hd, backend)
            if variant is None:
                raise TPError(f"--impl {impl}: cannot run on a TP shard of {geo['name']} ({q // tp} query / "
                              f"{kv // tp} KV heads per rank, head_dim {hd}, {str(dtype).removeprefix('torch.')} on "
                              f"{device}): {why}")
    return geo


_PREPARE = """
import sys
from llm_attn import models
try:
    models.cached_checkpoint(sys.argv[1], sys.argv[2])
except Exception as e:
    print(f"{type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
    sys.exit(2)
"""


def prepare_checkpoint(spec: str) -> None:
    """Generate a preset's synthetic checkpoint before the ranks start (free disk checked first), in a child process
    so that this launcher holds no GPU memory while the ranks run. TPError with the writer's one line on failure."""
    from llm_attn import models  # noqa: PLC0415

    name, _, quant = spec.partition(":")
    if name not in models.PRESETS or quant == INIT_SUFFIX:
        return
    proc = subprocess.run([sys.executable, "-c", _PREPARE, name, quant or "fp16"], capture_output=True, text=True)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        raise TPError(f"--model {spec}: {lines[-1] if lines else f'checkpoint generation failed ({proc.returncode})'}")

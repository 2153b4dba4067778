"""The process group of a tensor-parallel run (``World``: one rank's view of it) and the model sharded over it
(``load_sharded``: transformers' own TP plan; ``local_heads``: what this rank's attention holds).

TP=1 (the baseline) loads through the project's loader, AWQ int4 included; TP > 1 through
``from_pretrained(path, distributed_config=DistributedConfig(tp_size=N, tp_plan="auto"))``: q/k/v/gate/up
column-wise, o/down row-wise with an all-reduce, lm_head column-wise with its output gathered.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from llm_attn.harness.tp_preflight import INIT_SUFFIX, TPError

class World:
    """This rank's view of the process group."""

    def __init__(self, device_type: str):
        import torch.distributed as dist  # noqa: PLC0415

        self.dist = dist
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        if device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            self.backend = "nccl"
            dist.init_process_group("nccl", device_id=self.device)
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
            dist.init_process_group("gloo")

    def barrier(self) -> None:
        if self.backend == "nccl":
            self.dist.barrier(device_ids=[self.local_rank])
        else:
            self.dist.barrier()

    def gather(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def from_rank0(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.dist.is_initialized():
            if self.backend == "gloo":
                # Every rank reaches this point before any tears its gloo pairs down: a rank that destroyed the
                # group while its peer was still finishing (rank 0 writing the results) sometimes aborted in
                # gloo's threads ("terminate called without an active exception", seen on a loaded 2-core
                # machine). Bounded: a peer that died already does not hold this rank for long.
                try:
                    self.dist.monitored_barrier(timeout=timedelta(seconds=60))
                except RuntimeError:
                    pass
            self.dist.destroy_process_group()


SKELETON_TENSOR = "model.norm.weight"


def skeleton_checkpoint(preset: str) -> Path:
    """A preset's ``:init`` checkpoint: config.json and one small tensor (a few KB), no weights. transformers
    initialises every missing weight at load (normal, std = initializer_range) on each rank's own shard, so a model
    whose weights do not fit the disk (Llama 3 70B in fp16: 141 GB) can still be timed under TP. TTFT does not depend
    on the weights' values; the rows say ``source: initialised-at-load``. Idempotent."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from llm_attn import models  # noqa: PLC0415

    root = Path(os.environ.get("LLM_ATTN_CACHE") or Path.home() / ".cache" / "llm_attn").expanduser()
    path = root / f"{preset}-init-skeleton-v{models.SYNTHETIC_FORMAT_VERSION}"
    if (path / models.MARKER_FILE).is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = models.llama_config(preset)
    cfg.dtype = torch.float16
    cfg.save_pretrained(path)
    save_file({SKELETON_TENSOR: torch.ones(cfg.hidden_size, dtype=torch.float16)}, str(path / "model.safetensors"))
    (path / models.MARKER_FILE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return path


def checkpoint_path(spec: str, world: World) -> tuple[Path, str, str]:
    """(checkpoint folder, name, source): rank 0 generates a missing synthetic checkpoint (free disk checked first),
    the others wait for it. Raises TPError on every rank when it cannot be had."""
    from llm_attn import models  # noqa: PLC0415

    name, _, quant = spec.partition(":")
    if name in models.PRESETS:
        quant = quant or "fp16"
        result = None
        if world.rank == 0:
            try:
                result = str(skeleton_checkpoint(name) if quant == INIT_SUFFIX
                             else models.cached_checkpoint(name, quant))
            except Exception as e:  # noqa: BLE001 (one line for the user, on every rank)
                result = f"ERROR {type(e).__name__}: {e}"
        result = world.from_rank0(result)
        if result.startswith("ERROR "):
            raise TPError(f"--model {spec}: {result[6:]}")
        return Path(result), name, "initialised-at-load" if quant == INIT_SUFFIX else "synthetic"
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        source = "synthetic" if (path / models.PROVENANCE_FILE).is_file() else "local"
        return path, str(path), source
    raise TPError(f"--model {spec}: under --tp give a preset ({', '.join(sorted(models.PRESETS))}) or a local "
                  f"checkpoint folder")


def load_sharded(spec: str, world: World, dtype: torch.dtype):
    """The model sharded over the world by transformers' own TP plan, and a ModelInfo-like dict."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.distributed import DistributedConfig  # noqa: PLC0415

    init = spec.partition(":")[2] == INIT_SUFFIX
    if init:
        torch.manual_seed(0)  # the initialised weights: the same on every run
    if world.world == 1 and not init:
        # TP=1, the baseline: the project's own loader (AWQ int4 included), on this rank's device.
        from llm_attn import models  # noqa: PLC0415

        if spec in models.PRESETS:
            spec = f"{spec}:fp16"  # under --tp a bare preset is its fp16 checkpoint, at any TP degree
        try:
            model, minfo = models.load_model(spec, device=str(world.device), dtype=dtype, attn_implementation="sdpa")
        except Exception as e:  # noqa: BLE001 (the loader's message says what it accepts)
            raise TPError(f"--model {spec}: cannot load it: {type(e).__name__}: {e}") from None
        return model, {**minfo.to_dict(), "tp_plan": None}
    path, name, source = checkpoint_path(spec, world)
    placement = ({"device_map": str(world.device)} if world.world == 1 else
                 {"distributed_config": DistributedConfig(tp_size=world.world, tp_plan="auto")})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **placement)
    model.eval()
    cfg = model.config
    info = {"name": name, "source": source, "path": str(path),
            "quant": {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype)),
            "awq_backend": None, "dequant_fallback": False, "dtype": str(dtype).removeprefix("torch."),
            "device": str(world.device),
            "config": {k: getattr(cfg, k, None) for k in (
                "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")},
            "tp_plan": dict(model.tp_plan)}
    return model, info


def local_heads(model) -> dict:
    """The head counts this rank's attention modules hold (from the local shard of q_proj / k_proj)."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    attn = model.model.layers[0].self_attn
    hd = attn.head_dim

    def out_features(lin):
        w = getattr(lin, "weight", None)
        if not isinstance(w, torch.Tensor):  # an int4 QuantLinear (TP=1 only): no weight, its own out_features
            return lin.out_features
        return (w.to_local() if isinstance(w, DTensor) else w).shape[0]

    return {"q_heads": out_features(attn.q_proj) // hd, "kv_heads": out_features(attn.k_proj) // hd, "head_dim": hd}

"""Tensor-parallel TTFT: ``python -m llm_attn.ttft --tp N`` on torch.distributed and transformers' TP plans.

Launch, either way (the same code runs):

    torchrun --nproc-per-node 2 -m llm_attn.ttft --tp 2 --model llama-3-8b:fp16 --dtype bfloat16 --seq 2048 8192
    python -m llm_attn.ttft --tp 2 --model llama-3-8b:fp16 --dtype bfloat16 --seq 2048 8192   # starts torchrun

Without torchrun's environment (``WORLD_SIZE``/``RANK``), ``--tp N`` first checks its arguments in this process
(one line and exit 2 for: KV heads not divisible by N, an implementation that cannot run on a head shard, an AWQ
int4 checkpoint, fewer GPUs than N, a model that is neither a preset nor a local folder), writes a preset's
synthetic checkpoint if it is not cached (in a child process; free disk checked first, one line when it does not fit)
and then starts ``python -m torch.distributed.run --standalone --nproc-per-node N -m llm_attn.ttft <the same
arguments>`` and returns its exit status. Under torchrun every rank checks the same things again (plus
WORLD_SIZE == N) before anything is loaded.

Every rank then:

- joins the process group (NCCL on GPUs, one GPU per rank = LOCAL_RANK; gloo on CPU);
- loads the model sharded by transformers' own plan: ``from_pretrained(path, distributed_config=
  DistributedConfig(tp_size=N, tp_plan="auto"))`` (the non-deprecated spelling of ``tp_plan="auto"`` in
  transformers 5.17): q/k/v/gate/up column-wise, o/down row-wise with an all-reduce, so each rank holds
  Hq/N query heads and Hkv/N KV heads and its attention function sees exactly those (4/2 per rank for 8/4 heads);
- switches to each implementation with ``llm_attn.harness.impls.use_impl`` (stock: set_attn_implementation; ours
  and the other registry entries: ``patch_model``, which works on the local shard because transformers' attention
  modules infer the head count from the sharded projections);
- measures TTFT paired: in every repeat each implementation runs once, in an order shuffled with the same seed on
  every rank; all ranks meet at a barrier before each prefill; the TTFT sample is rank 0's time from the start of
  the prefill until the greedy first token is on rank 0 (CUDA events on GPUs, perf_counter on CPU); every rank also
  keeps its own time;
- profiles one prefill per implementation with torch.profiler: per-rank GPU time (the sum of its kernel and copy
  durations; on CPU the sum of op self times) and the share of it spent in communication (NCCL kernels; gloo/c10d
  collectives on CPU). A collective's time includes waiting for the slower rank, so the shares differ per rank.

Rank 0 writes one ``ttft`` row per (implementation, batch, seq) with the TP degree, world size, backend,
interconnect (from ``nvidia-smi topo -m``: NVLink or PCIe), every rank's environment, samples, GPU time and
communication share, the first token and the paired ratio against the base implementation (sdpa) with its 95 %
bootstrap interval. It prints a table grouped by TP degree.

Models under ``--tp``: a preset (a bare name or ``:fp16`` is the fp16 checkpoint; ``:awq`` at TP=1 only; ``:init``
is a config-only skeleton whose weights transformers initialises at load on each rank's shard, for models whose
checkpoint does not fit the disk, e.g. ``llama-3-70b:init``: its weights differ between TP degrees, so compare first
tokens only within one degree) or a local checkpoint folder.

AWQ int4 checkpoints are refused under TP > 1: gptqmodel's QuantLinear keeps qweight/qzeros/scales as buffers,
transformers' ``apply_tensor_parallelism`` shards parameters only, so every rank keeps the whole int4 weight and the
row-wise layers fail ("mixed torch.Tensor and DTensor"). Use a ':fp16' preset (``--dtype bfloat16``/``float16``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch

# Environment variables recorded per rank (prefixes end with '_').
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_", "TORCHELASTIC_RUN_ID")
BOOTSTRAP = 2000


class TPError(ValueError):
    """Bad input for a tensor-parallel run: the CLI prints it in one line and exits 2."""


# ------------------------------------------------------------------------------------------------ environment

def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def rank_env(device: torch.device, backend: str) -> dict:
    """What identifies one rank: its ids, host, process, device and the distributed settings in its environment."""
    env = {k: v for k, v in sorted(os.environ.items())
           if any(k == p or (p.endswith("_") and k.startswith(p)) for p in RANK_ENV)}
    out = {"rank": int(os.environ.get("RANK", 0)), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
           "hostname": socket.gethostname(), "pid": os.getpid(), "device": str(device), "backend": backend,
           "torch_threads": torch.get_num_threads(), "env": env}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(device_name=props.name, gpu_memory_bytes=props.total_memory,
                   pci_bus_id=getattr(props, "pci_bus_id", None), uuid=str(getattr(props, "uuid", "")) or None)
    else:
        out["device_name"] = "cpu"
    return out


_TOPO_LINK = re.compile(r"^(X|NV\d+|SYS|NODE|PHB|PXB|PIX|SOC)$")


def parse_topo(text: str, gpus: list[int] | None = None) -> dict:
    """``nvidia-smi topo -m`` -> {"kind": "NVLink"|"PCIe"|"mixed"|"unknown", "links": {"0-1": "NV18", ...}}.

    NV# is NVLink (# bonded links); PIX/PXB/PHB/NODE/SYS are PCIe paths (through switches, the host bridge, or
    across CPU sockets). ``gpus`` restricts to those physical indices (the ranks' GPUs)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    # The header is indented (its first cell is empty); the matrix rows start with their own GPU name.
    header = next((ln for ln in lines if re.search(r"\bGPU\d+\b", ln) and ln[0].isspace()), None)
    if header is None:
        return {"kind": "unknown", "links": {}}
    gpu_cols = re.findall(r"\bGPU\d+\b", header)
    links = {}
    for ln in lines:
        m = re.match(r"^GPU(\d+)\s+(.*)$", ln)
        if not m:
            continue
        i = int(m.group(1))
        cells = m.group(2).split()
        for col, cell in zip(gpu_cols, cells):
            j = int(col[3:])
            if i < j and _TOPO_LINK.match(cell) and (gpus is None or (i in gpus and j in gpus)):
                links[f"{i}-{j}"] = cell
    kinds = {"NVLink" if v.startswith("NV") else "PCIe" for v in links.values()}
    kind = "unknown" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
    return {"kind": kind, "links": links}


def interconnect(device_type: str, world: int) -> dict:
    """How the ranks talk: gloo on one host for CPU runs; NVLink/PCIe between the ranks' GPUs for CUDA runs."""
    if device_type != "cuda":
        return {"kind": "gloo (CPU, one host)" if world > 1 else "none", "links": {}}
    if world <= 1:
        return {"kind": "none (one GPU)", "links": {}}
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"kind": "unknown", "links": {}, "error": f"nvidia-smi topo -m: {e}"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(v.strip().isdigit() for v in visible.split(",")):
        gpus = [int(v) for v in visible.split(",")][:world]
    elif visible:
        gpus = None  # UUIDs: cannot map to nvidia-smi's indices without NVML; report every link
    else:
        gpus = list(range(world))
    return {**parse_topo(text, gpus), "gpus": gpus, "topo": text}


# -------------------------------------------------------------------------------------------------- preflight

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


def launch(tp: int, argv: list[str]) -> int:
    """Start ``tp`` ranks of ``python -m llm_attn.ttft <argv>`` with torchrun on this host; return its status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           "-m", "llm_attn.ttft", *argv]
    print(f"--tp {tp}: starting {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    try:
        return subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:
        return 130


# ------------------------------------------------------------------------------------------------- the ranks

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


INIT_SUFFIX = "init"
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
                result = str(skeleton_checkpoint(name) if quant == INIT_SUFFIX else models.cached_checkpoint(name, quant))
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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_prefill(model, prompt, device):
    """One prefill + greedy token: (device ms from the start of the prefill to the argmax, wall ms until the token
    is on this rank's host, token ids, last logits). On CPU both times are the same perf_counter interval."""
    from llm_attn.harness.measure import prefill_first_token  # noqa: PLC0415

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        tok, logits = prefill_first_token(model, prompt)
        end.record()
        host_tok = tok.cpu()  # the first token is on the host
        wall = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        return start.elapsed_time(end), wall, host_tok, logits
    t0 = time.perf_counter()
    tok, logits = prefill_first_token(model, prompt)
    host_tok = tok.cpu()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, ms, host_tok, logits


_COMM = re.compile(r"nccl|gloo|c10d::|allreduce|all_reduce|allgather|all_gather|reduce_scatter|broadcast",
                   re.IGNORECASE)


def profile_prefill(model, prompt, device) -> dict:
    """One prefill under torch.profiler: this rank's busy time (GPU kernels; CPU ops on CPU) and its
    communication part (NCCL kernels; gloo/c10d collectives on CPU)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from llm_attn.harness.measure import prefill_first_token  # noqa: PLC0415

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=acts) as prof:
        prefill_first_token(model, prompt)[0].cpu()
        _sync(device)
    total = comm = 0.0
    if cuda:
        # Device-side events (kernels, memcpy/memset) once each, by duration. (Summing key_averages' self device
        # times would count every kernel twice: as itself and under the CPU op that launched it.)
        from torch.autograd import DeviceType  # noqa: PLC0415

        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                t = e.time_range.elapsed_us()
                total += t
                if _COMM.search(e.name):
                    comm += t
    else:
        # CPU op self times (each microsecond once); waiting inside a collective counts as communication.
        for e in prof.key_averages():
            t = e.self_cpu_time_total
            total += max(t, 0)
            if t > 0 and _COMM.search(e.key):
                comm += t
    return {"busy_ms": total / 1e3, "comm_ms": comm / 1e3, "comm_share": comm / total if total else None,
            "timer": "cuda_kernels" if cuda else "cpu_ops"}


def paired_verdict(base: list[float], other: list[float], seed: int = 0) -> dict:
    """Per-repeat ratios other/base, their median and a 95 % bootstrap interval of the median."""
    import numpy as np  # noqa: PLC0415

    r = np.asarray(other, dtype=float) / np.asarray(base, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(r, size=(BOOTSTRAP, r.size), replace=True), axis=1)
    lo, hi = (float(x) for x in np.percentile(meds, [2.5, 97.5]))
    med = float(np.median(r))
    verdict = "no difference" if lo <= 1.0 <= hi else ("faster" if hi < 1.0 else "slower")
    return {"ratios": r.tolist(), "ratio_p50": med, "ci95": [lo, hi], "verdict": verdict}


def measure_point(model, world: World, impls: list[str], prompt, warmup: int, repeats: int, seed: int,
                  log) -> dict:
    """Paired TTFT of every implementation at one (batch, seq) on every rank; returns this rank's results."""
    from llm_attn.harness.impls import use_impl  # noqa: PLC0415

    device = world.device
    res = {impl: {"samples_ms": [], "wall_samples_ms": [], "calls": None, "profile": None, "token": None, "logits": None}
           for impl in impls}
    with torch.inference_mode():
        for impl in impls:
            with use_impl(model, impl) as rep:
                for _ in range(warmup):
                    _timed_prefill(model, prompt, device)
                if rep is not None:  # count the calls of exactly one prefill: the one whose token is recorded
                    rep.reset_counters()
                _, _, tok, logits = _timed_prefill(model, prompt, device)
                res[impl]["token"] = tok.tolist()
                res[impl]["logits"] = logits.float().cpu()
                if rep is not None:
                    res[impl]["calls"] = {"impl": rep.num_native_calls, "native": dict(rep.native_calls),
                                          "stock_fallback": rep.num_fallback_calls,
                                          "fallback_reasons": dict(rep.fallback_calls)}
                world.barrier()
                res[impl]["profile"] = profile_prefill(model, prompt, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        order_rng = random.Random(seed)
        for i in range(repeats):
            order = list(impls)
            order_rng.shuffle(order)  # the same order on every rank: same seed
            for impl in order:
                with use_impl(model, impl):
                    _sync(device)
                    world.barrier()  # every rank starts the prefill together
                    ms, wall, _, _ = _timed_prefill(model, prompt, device)
                res[impl]["samples_ms"].append(ms)
                res[impl]["wall_samples_ms"].append(wall)
            log(f"  repeat {i + 1}/{repeats}")
    # One peak over the interleaved repeats of every implementation (they alternate within each repeat).
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    for impl in impls:
        res[impl]["peak_mem_bytes"] = peak
    return res


def summary_table(rows: list[dict]) -> str:
    """TTFT p50 per (TP degree, batch, seq), each implementation with its paired ratio vs the base."""
    from tabulate import tabulate  # noqa: PLC0415

    out = []
    def order(r):  # by TP degree, then model and point, the base implementation first
        return (r["tp"]["degree"], r["model_spec"], r["batch"], r["seq"], "paired" in r, r["impl"])

    for r in sorted(rows, key=order):
        p = r.get("paired")
        vs = (f"{p['ratio_p50']:.3f}x [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}] {p['verdict']}" if p else "(base)")
        ranks = r["tp"]["ranks"]
        comm = "/".join(f"{100 * k['profile']['comm_share']:.0f}%" if k["profile"]["comm_share"] is not None
                        else "-" for k in ranks)
        out.append([r["tp"]["degree"], r["model_spec"], r["batch"], r["seq"], r["impl"],
                    f"{r['stats']['p50']:.2f}", vs, comm, r["tp"]["interconnect"]["kind"],
                    r.get("first_token")])
    return tabulate(out, headers=["TP", "model", "batch", "seq", "impl", "TTFT p50 ms", "vs base (paired)",
                                  "comm share per rank", "interconnect", "first token"], tablefmt="github")


def _device(choice: str, parser, resolve) -> str:
    try:
        return resolve(choice)
    except ValueError as e:
        parser.error(f"--device {choice}: {e}")


def run_ranks(args, parser, plugins: list[str], argv: list[str] | None) -> int:
    """The body every torchrun rank runs for ``--tp N``."""
    from llm_attn.envinfo import capture_env  # noqa: PLC0415
    from llm_attn.harness.impls import BASE_IMPL, available_impls, impl_info  # noqa: PLC0415
    from llm_attn.harness.results import SCHEMA, ResultWriter, jsonable, output_file_problem  # noqa: PLC0415
    from llm_attn.harness.stats import summarize  # noqa: PLC0415
    from llm_attn.harness.sweep import DTYPES, make_prompt  # noqa: PLC0415
    from llm_attn.harness.session import default_dtype, resolve_device  # noqa: PLC0415

    rank = int(os.environ["RANK"])

    def fail(msg: str) -> int:
        if rank == 0:
            print(f"{parser.prog}: error: {msg}", file=sys.stderr, flush=True)
        return 2

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    device_type = _device(args.device, parser, resolve_device)
    impls = args.impl or available_impls(device_type)
    if BASE_IMPL in impls:  # the base first: the paired ratios are against it
        impls = [BASE_IMPL] + [i for i in impls if i != BASE_IMPL]
    dtype_name = args.dtype if args.dtype != "auto" else default_dtype(args.model, device_type)
    dtype = DTYPES[dtype_name]
    try:
        preflight(args.tp, args.model, impls, device_type, dtype, world_size=int(os.environ["WORLD_SIZE"]),
                  seqs=args.seq)
    except TPError as e:
        return fail(str(e))
    if rank == 0 and output_file_problem(args.out):
        return fail(f"--out {args.out}: {output_file_problem(args.out)}")
    skipped = [m for m in args.measure if m != "ttft"]
    if skipped:
        log(f"--tp: measures ttft (paired, with the profiled communication share); not measured: {' '.join(skipped)}")

    world = World(device_type)
    try:
        try:
            model, info = load_sharded(args.model, world, dtype)
        except TPError as e:
            return fail(str(e))
        heads = local_heads(model)
        geo = info["config"]
        if geo["num_key_value_heads"] % world.world:
            return fail(f"--tp {args.tp}: {geo['num_key_value_heads']} KV heads not divisible by {args.tp}")
        seqs = args.seq or [s for s in (512, 1024, 2048) if s <= geo["max_position_embeddings"]]
        ranks_env = world.gather(rank_env(world.device, world.backend))
        link = interconnect(device_type, world.world) if rank == 0 else None
        env = capture_env(str(world.device) if device_type == "cuda" else "cpu") if rank == 0 else None
        log(f"model: {info['name']} ({info['quant']}, {info['source']}) sharded over {world.world} ranks "
            f"({world.backend}); per rank {heads['q_heads']} query / {heads['kv_heads']} KV heads")
        run_id = uuid.uuid4().hex[:12]
        experiment = args.experiment or f"tp{args.tp}"
        command = shlex.join(["torchrun", f"--nproc-per-node={args.tp}", "-m", "llm_attn.ttft",
                              *(sys.argv[1:] if argv is None else argv)])
        rows = []
        writer = ResultWriter(args.out) if rank == 0 else None
        try:
            for batch in args.batch:
                for seq in seqs:
                    log(f"TP={args.tp} batch={batch} seq={seq}: {' '.join(impls)}")
                    prompt = make_prompt(geo["vocab_size"], batch, seq, args.seed, world.device)
                    res = measure_point(model, world, impls, prompt, args.warmup, args.repeats, args.seed, log)
                    per_rank = world.gather({i: {k: v for k, v in r.items() if k != "logits"}
                                             for i, r in res.items()})
                    if rank != 0:
                        continue
                    base = res.get(BASE_IMPL)
                    for impl in impls:
                        mine = res[impl]
                        row = {
                            "schema": SCHEMA, "kind": "ttft", "measurement": "ttft", "status": "ok",
                            "experiment": experiment, "run_id": run_id, "time": _now(),
                            "device": env["device_slug"], "model_spec": args.model, "model": info, "impl": impl,
                            "impl_info": impl_info(impl), "dtype": dtype_name, "batch": batch, "seq": seq,
                            "new_tokens": args.new_tokens, "env": env, "command": command,
                            "samples_ms": mine["samples_ms"], "stats": summarize(mine["samples_ms"]),
                            "wall_samples_ms": mine["wall_samples_ms"],
                            "timer": "cuda_event" if device_type == "cuda" else "perf_counter",
                            "warmup": args.warmup, "repeats": args.repeats, "peak_mem_bytes": mine["peak_mem_bytes"],
                            "model_flops": None, "first_token": mine["token"], "attention_calls": mine["calls"],
                            "tp": {"degree": args.tp, "world_size": world.world, "backend": world.backend,
                                   "interconnect": link, "local_heads": heads,
                                   "ranks": [{**ranks_env[k], "samples_ms": per_rank[k][impl]["samples_ms"],
                                              "wall_samples_ms": per_rank[k][impl]["wall_samples_ms"],
                                              "stats": summarize(per_rank[k][impl]["samples_ms"]),
                                              "profile": per_rank[k][impl]["profile"],
                                              "attention_calls": per_rank[k][impl]["calls"],
                                              "first_token": per_rank[k][impl]["token"],
                                              "peak_mem_bytes": per_rank[k][impl]["peak_mem_bytes"]}
                                             for k in range(world.world)]},
                        }
                        if base is not None and impl != BASE_IMPL:
                            row["paired"] = {"base": BASE_IMPL, **paired_verdict(base["samples_ms"],
                                                                                 mine["samples_ms"], args.seed)}
                            row["max_abs_logit_diff_vs_base"] = float((mine["logits"] - base["logits"]).abs().max())
                        row = jsonable(row)
                        writer.write(row)
                        rows.append(row)
        finally:
            if writer is not None:
                writer.close()
        world.barrier()
        if rank == 0:
            print(summary_table(rows))
            print(f"\n{len(rows)} rows appended to {args.out}")
        return 0
    finally:
        world.close()


def main(args, parser, plugins: list[str], argv: list[str] | None) -> int:
    """``--tp N`` of ``python -m llm_attn.ttft``: start torchrun (outside it) or run this rank (inside it)."""
    from llm_attn.harness.impls import available_impls  # noqa: PLC0415
    from llm_attn.harness.sweep import DTYPES  # noqa: PLC0415
    from llm_attn.harness.session import default_dtype, resolve_device  # noqa: PLC0415

    if under_torchrun():
        return run_ranks(args, parser, plugins, argv)
    device_type = _device(args.device, parser, resolve_device)
    impls = args.impl or available_impls(device_type)
    dtype = DTYPES[args.dtype if args.dtype != "auto" else default_dtype(args.model, device_type)]
    if args.resume:
        parser.error("--resume: not supported with --tp (each --tp run measures every point it is given)")
    from llm_attn.harness.results import output_file_problem  # noqa: PLC0415

    if output_file_problem(args.out):
        parser.error(f"--out {args.out}: {output_file_problem(args.out)}")
    try:
        preflight(args.tp, args.model, impls, device_type, dtype, seqs=args.seq)
        prepare_checkpoint(args.model)
    except TPError as e:
        parser.error(str(e))
    return launch(args.tp, list(sys.argv[1:] if argv is None else argv))

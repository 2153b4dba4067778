"""Host cost of one attention call (issue 18 item 5): microseconds of CPU time to issue a call, no sync.

The 2048-token prefill of an 8B model is on the CPU/GPU edge: what each attention call costs the host is paid 32
times per forward on the path that is host-bound. ``measure_host_cost`` times the paths interleaved: ``rounds``
rounds (default 15), each running every path's N back-to-back calls (after a warm-up; one sync before each batch and
none inside) in a shuffled order, so that host drift (another process, a clock change) hits every path alike, as
the paired TTFT does. Each path's number is the median of its per-round µs per call, and its ratio to torch SDPA
(torch SDPA's µs / the path's, > 1 = the path costs the host less, the convention of every ratio here) comes with a
paired bootstrap interval over the rounds (harness/stats.py). The paths:

- ``llm_attn.flash_attn_func``: our op called directly;
- ``llm_attn via the patch``: the transformers attention-interface function (``llm_attn_attention_forward``) with
  a real ``LlamaAttention`` module of a patched model, exactly as a patched model calls it;
- ``sdpa (transformers)``: stock ``sdpa_attention_forward`` with the same module, what an unpatched model runs;
- ``torch SDPA``: ``F.scaled_dot_product_attention`` alone (GQA expanded by the op: ``enable_gqa``);
- ``llm_attn via the patch, FP8 cache`` (decode shapes): the patched call on K/V from the FP8 KV cache
  (``llm_attn.models.kv_cache``; placeholders tagged with the cache's bytes and scales), which reads the bytes
  (the FP8-cache decode kernel): its scales must add no host work (issue 38 item 5).

Two more decode paths time a decode step's whole host work per layer on the FP8 cache past the append (which both
pay alike): what the cache's ``update`` returns, then the attention call on it (issue 38 item 5 asks ours <= SDPA's
with the FP8 cache too, and stock attention can read that cache only through a dequantised copy):

- ``llm_attn via the patch, FP8 cache, update's return + call``: the placeholders, then the patched call;
- ``sdpa (transformers), FP8 cache, update's return + call``: an unpatched model's step, the dequantised copy
  (``ops.fp8_kv_dequantized``, one launch and two allocations), then stock ``sdpa_attention_forward`` on it.

On a GPU the N calls only enqueue kernels (N = 300 stays far below the launch queue's depth, so the host never
waits for the device); on the CPU every call also computes, so CPU numbers are not host costs.

``user_timing=True`` (``bench --mode host --user-timing``) also times each path the way a user's script does (issue
38 item 5: such a timing and this benchmark disagreed): in a fresh process, N back-to-back calls under
``torch.inference_mode()`` with no warm-up, wall time up to a final synchronize ("cold": every first-call cost of
the process is in it: lazy module loading, plan caches, pools), then N more the same way ("warm": wall time, so the
device's time counts wherever it exceeds the host's). One process is one sample, and one sample misleads (a fresh
process meets whatever the machine is doing then), so each (path, shape) runs in ``user_processes`` processes
(default 5), interleaved: every round starts one process per (path, shape) in a shuffled order. The row keeps every
process's numbers, their medians, and the warm wall time's paired ratio to torch SDPA's over the rounds. Against the
enqueue-only number above, cold - warm is what the first calls cost, and warm - enqueue what waiting for the device
costs.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

CALLS = 300
WARMUP = 20
ROUNDS = 15
USER_PROCESSES = 5


@dataclass(frozen=True)
class HostShape:
    name: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int


# The paths (module docstring), in the order of the tables; torch SDPA is every ratio's reference.
PATHS = ("llm_attn.flash_attn_func", "llm_attn via the patch", "sdpa (transformers)", "torch SDPA")
FP8_PATH = "llm_attn via the patch, FP8 cache"  # decode shapes only: the same call reading the FP8 KV cache's bytes
# Decode shapes only: what the FP8 cache's update returns plus the attention call, ours and stock's (module docstring).
FP8_STEP_PATH = "llm_attn via the patch, FP8 cache, update's return + call"
FP8_STOCK_STEP_PATH = "sdpa (transformers), FP8 cache, update's return + call"
FP8_PATHS = (FP8_PATH, FP8_STEP_PATH, FP8_STOCK_STEP_PATH)

# The shapes of issue 18: Llama 3 8B geometry (32 query heads over 8 KV heads, head_dim 128).
PREFILL = HostShape("prefill 2048", 1, 32, 8, 2048, 2048, 128)
DECODE = HostShape("decode kv 4096", 1, 32, 8, 1, 4096, 128)
SHAPES = (PREFILL, DECODE)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = CALLS,
                     warmup: int = WARMUP) -> float:
    """Mean host µs per call of ``fn`` over ``calls`` back-to-back calls, no sync inside the timed loop."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (t1 - t0) * 1e6 / calls


def _attention_module(shape: HostShape, device, dtype):
    """One real LlamaAttention (a one-layer Llama with this head geometry and a small hidden size: the
    projections are never called) of a model patched with llm_attn, and the patch report."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from llm_attn.patches import patch_model  # noqa: PLC0415

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_position_embeddings=max(8192, shape.kv_len), bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    report = patch_model(model, on_unsupported="fallback")
    return model, model.model.layers[0].self_attn, report


def measure_host_cost(device: str | torch.device = "cuda", dtype: torch.dtype = torch.float16,
                      shapes: tuple[HostShape, ...] = SHAPES, calls: int = CALLS, warmup: int = WARMUP,
                      rounds: int = ROUNDS, seed: int = 0, user_timing: bool = False,
                      user_processes: int = USER_PROCESSES, paths: tuple[str, ...] | None = None) -> list[dict]:
    """One dict per (shape, path): ``{"shape", "path", "us_per_call" (median over rounds), "samples_us" (one per
    round, interleaved), "vs_torch_sdpa" (median(torch SDPA) / median(path) with its paired interval: > 1 = the
    path costs the host less, ``stats.paired_ratio_interval``), ...}``; a path that cannot run here gets
    ``us_per_call: None`` and why. ``user_timing``: also ``user_cold_us`` / ``user_warm_us`` (medians over
    ``user_processes`` fresh processes, ``_user_timing_rounds``). ``paths``: only these (names as in the module
    docstring; torch SDPA, the reference of every ratio, is always timed), default all."""
    from llm_attn.harness.stats import paired_ratio_interval  # noqa: PLC0415

    if user_timing and user_processes < 1:
        raise ValueError(f"user_processes must be >= 1, got {user_processes}")
    known = (*PATHS, *FP8_PATHS)
    if paths is not None and (bad := [p for p in paths if p not in known]):
        raise ValueError(f"unknown host-cost path(s) {bad}; known: {', '.join(known)}")
    device = torch.device(device)
    order = random.Random(seed)
    out = []
    with torch.inference_mode():
        for shape in shapes:
            model, module, report, fns = _paths(shape, device, dtype)
            if paths is not None:
                fns = {name: fn for name, fn in fns.items() if name in paths or name == "torch SDPA"}
            rows = {name: {"shape": shape.name, "path": name, "calls": calls, "rounds": rounds,
                           "device": str(device), "dtype": str(dtype).replace("torch.", ""), **vars(shape),
                           "samples_us": []} for name in fns}
            report.reset_counters()
            seen = {name: Counter() for name in fns}  # the patch's counters moved by each path's own calls
            live = list(fns)
            for _ in range(rounds):
                order.shuffle(live)
                for name in list(live):
                    before = _patch_counters(report)
                    try:
                        rows[name]["samples_us"].append(host_us_per_call(fns[name], device, calls, warmup))
                    except Exception as e:  # noqa: BLE001 (a path this device cannot run: recorded, the others go on)
                        rows[name]["why"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                        rows[name]["samples_us"] = []
                        live.remove(name)
                    seen[name].update(_patch_counters(report) - before)
            ref = rows["torch SDPA"]["samples_us"]
            for name, row in rows.items():
                samples = row["samples_us"]
                row["us_per_call"] = float(np.median(samples)) if samples else None
                if samples and ref and name != "torch SDPA":
                    row["vs_torch_sdpa"] = paired_ratio_interval(ref, samples)
                if name == "llm_attn via the patch":
                    row["attention_calls"] = {"impl": seen[name]["native"], "stock_fallback": seen[name]["fallback"]}
                if name in (FP8_PATH, FP8_STEP_PATH):  # its calls, by how each read the cache
                    row["fp8_cache_reads"] = {k[len("read "):]: n for k, n in seen[name].items()
                                              if k.startswith("read ")}
                out.append(row)
            del model, module, fns
    if user_timing:
        _user_timing_rounds(out, device, dtype, calls, user_processes, order)
    return out


def _patch_counters(report) -> Counter:
    """The patch report's call counters now: native calls, stock fallbacks, and the FP8 cache's reads by kind."""
    return Counter({"native": report.num_native_calls, "fallback": report.num_fallback_calls,
                    **{f"read {k}": n for k, n in report.kv_cache_reads.items()}})


def _user_timing_rounds(rows: list[dict], device, dtype, calls: int, processes: int, order: random.Random,
                        log: bool = True) -> None:
    """``processes`` rounds, each timing every row's (path, shape) once in a fresh process (``user_timed``), in a
    shuffled order; then per row the samples (``user_cold_samples_us``, ``user_warm_samples_us``), their medians
    (``user_cold_us``, ``user_warm_us``) and ``user_warm_vs_torch_sdpa``: torch SDPA's warm wall time over this
    path's, paired by round. A failed child ends that row's timing with its reason (``user_timing_why``)."""
    from llm_attn.harness.stats import paired_ratio_interval  # noqa: PLC0415

    live = list(range(len(rows)))
    for r in rows:
        r["user_cold_samples_us"], r["user_warm_samples_us"] = [], []
    for _ in range(processes):
        order.shuffle(live)
        for i in list(live):
            r = rows[i]
            got = user_timed(r["path"], HostShape(*(r[f] for f in HostShape.__dataclass_fields__)), device, dtype,
                             calls)
            if "user_timing_why" in got:
                r["user_timing_why"] = got["user_timing_why"]
                live.remove(i)
                continue
            r["user_cold_samples_us"].append(got["user_cold_us"])
            r["user_warm_samples_us"].append(got["user_warm_us"])
            if log:  # each process as it ends: a run cut short still shows what it measured
                print(f"user timing, {r['dtype']} {r['shape']}, {r['path']}: cold {got['user_cold_us']:.1f} µs/call, "
                      f"warm {got['user_warm_us']:.1f}", file=sys.stderr, flush=True)
    ref = {r["shape"]: r for r in rows if r["path"] == "torch SDPA" and "user_timing_why" not in r}
    for r in rows:
        if "user_timing_why" in r:
            r.pop("user_cold_samples_us"), r.pop("user_warm_samples_us")
            continue
        r["user_cold_us"] = float(np.median(r["user_cold_samples_us"]))
        r["user_warm_us"] = float(np.median(r["user_warm_samples_us"]))
        base = ref.get(r["shape"])
        if base is not None and r is not base:
            r["user_warm_vs_torch_sdpa"] = paired_ratio_interval(base["user_warm_samples_us"],
                                                                 r["user_warm_samples_us"])


def _paths(shape: HostShape, device: torch.device, dtype: torch.dtype):
    """The paths' zero-argument callables for one shape (inputs made here; the FP8-cache ones at decode shapes), with
    the patched model they use and its patch report."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

    from llm_attn.ops import flash_attn_func  # noqa: PLC0415
    from llm_attn.patches.hf_attention_interface import llm_attn_attention_forward  # noqa: PLC0415

    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(shape.batch, shape.heads, shape.q_len, shape.head_dim, generator=g).to(device, dtype)
    k = torch.randn(shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim, generator=g).to(device, dtype)
    v = torch.randn_like(k)
    causal = shape.q_len > 1
    model, module, report = _attention_module(shape, device, dtype)
    scale = shape.head_dim ** -0.5
    args = (module, q, k, v)
    paths = dict(zip(PATHS, (
        lambda a=args, c=causal: flash_attn_func(*a[1:], causal=c),
        lambda a=args, s=scale: llm_attn_attention_forward(*a, None, scaling=s),
        lambda a=args, s=scale: sdpa_attention_forward(*a, None, scaling=s),
        lambda a=args, c=causal: F.scaled_dot_product_attention(*a[1:], is_causal=c, enable_gqa=True),
    ), strict=True))
    if shape.q_len == 1:  # a decode step on the FP8 cache, as a patched model makes it (issue 38 item 5)
        from llm_attn.models.kv_cache import Fp8DynamicLayer  # noqa: PLC0415

        layer = Fp8DynamicLayer()
        layer.attn_config = module.config  # patched: the attention reads the bytes, update returns placeholders
        stock = Fp8DynamicLayer()  # no patched config: update returns the dequantised copy, as to an unpatched model
        with torch.inference_mode():
            kp, vp = layer.update(k, v)
            stock.update(k, v)
        paths[FP8_PATH] = lambda m=module, q=q, kp=kp, vp=vp, s=scale: llm_attn_attention_forward(m, q, kp, vp, None,
                                                                                              scaling=s)
        # update's return is what it gives after the append (_dequantized), here without appending again
        paths[FP8_STEP_PATH] = lambda m=module, q=q, c=layer, s=scale: llm_attn_attention_forward(
            m, q, *c._dequantized(), None, scaling=s)
        paths[FP8_STOCK_STEP_PATH] = lambda m=module, q=q, c=stock, s=scale: sdpa_attention_forward(
            m, q, *c._dequantized(), None, scaling=s)
    return model, module, report, paths


# A user's script, run in a fresh process per (path, shape): the paths' objects are built first, then the timed
# calls are the process's first calls of that path.
_USER_CHILD = r"""
import json, sys, time, torch
from llm_attn.harness.hostcost import HostShape, _paths
spec = json.loads(sys.argv[1])
device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
with torch.inference_mode():
    _, _, _, paths = _paths(HostShape(*spec["shape"]), device, dtype)
    fn, walls = paths[spec["path"]], []
    sync()
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(spec["calls"]):
            fn()
        sync()
        walls.append((time.perf_counter() - t0) * 1e6 / spec["calls"])
print(json.dumps({"user_cold_us": walls[0], "user_warm_us": walls[1]}))
"""


def user_timed(path: str, shape: HostShape, device: str | torch.device, dtype: torch.dtype, calls: int = CALLS,
               timeout: float = 600.0) -> dict:
    """``{"user_cold_us", "user_warm_us"}`` of one path and shape timed as a user's script does (module docstring),
    or ``{"user_timing_why": ...}`` when the child process failed."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    spec = {"path": path, "shape": [getattr(shape, f) for f in HostShape.__dataclass_fields__],
            "device": str(device), "dtype": str(dtype).replace("torch.", ""), "calls": calls}
    try:
        r = subprocess.run([sys.executable, "-c", _USER_CHILD, json.dumps(spec)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"user_timing_why": f"timed out after {timeout:.0f} s"}
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"user_timing_why": f"exit {r.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def user_timing_table(rows: list[dict], tablefmt: str = "github") -> str:
    """Per path and shape: enqueue-only µs per call (the benchmark's), and the user-script wall µs per call cold
    and warm (``user_timed``: median [min, max] over the processes), with the warm time's ratio to torch SDPA's
    (> 1 = this path costs the user less); '-' where not measured, the reason where a child failed."""
    from tabulate import tabulate  # noqa: PLC0415

    from llm_attn.harness.stats import format_ratio_interval  # noqa: PLC0415

    def spread(r, key):
        samples = r.get(f"{key}_samples_us") or [r[f"{key}_us"]]
        text = f"{r[f'{key}_us']:.1f}"
        return text + (f" [{min(samples):.1f}, {max(samples):.1f}]" if len(samples) > 1 else "")

    table = []
    for r in rows:
        if "user_cold_us" in r:
            cold, warm = spread(r, "user_cold"), spread(r, "user_warm")
            iv = r.get("user_warm_vs_torch_sdpa")
            vs = format_ratio_interval(iv) if iv else ("1.00x" if r["path"] == "torch SDPA" else "-")
        else:
            cold, warm, vs = r.get("user_timing_why", "-"), "", ""
        enq = "-" if r.get("us_per_call") is None else f"{r['us_per_call']:.1f}"
        table.append([r["shape"], r["path"], enq, cold, warm, vs])
    return tabulate(table, headers=["shape", "path", "enqueue µs/call (warmed, no sync)",
                                    "user script: cold wall µs/call", "warm wall µs/call",
                                    "warm: torch SDPA / this path"],
                    tablefmt=tablefmt, disable_numparse=True)


def host_cost_table(rows: list[dict], tablefmt: str = "github") -> str:
    from tabulate import tabulate  # noqa: PLC0415

    from llm_attn.harness.stats import BETTER, format_ratio_interval  # noqa: PLC0415

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    val = {(r["shape"], r["path"]): r["us_per_call"] for r in rows}
    ivs = {(r["shape"], r["path"]): r.get("vs_torch_sdpa") for r in rows}
    table = []
    for p in paths:
        cells = []
        for s in shapes:
            v, iv = val.get((s, p)), ivs.get((s, p))
            cell = "" if v is None else f"{v:.1f}"
            if iv is not None:  # torch SDPA's cost / this path's, with its paired 95 % interval over the rounds
                cell += f" ({format_ratio_interval(iv)})"
            elif v is not None and p == "torch SDPA":
                cell += " (1.00x)"
            cells.append(cell)
        table.append([p, *cells])
    headers = ["path", *[f"{s}: host µs/call (torch SDPA / this path, {BETTER})" for s in shapes]]
    return tabulate(table, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def fp8_step_lines(rows: list[dict]) -> list[str]:
    """Per decode shape with both FP8-cache step paths measured: stock's µs over ours, paired by round (> 1 = ours
    costs the host less), and ours against the patched call on the fp16 cache (the FP8 cache's own host work)."""
    from llm_attn.harness.stats import format_ratio_interval, paired_ratio_interval  # noqa: PLC0415

    by = {(r["shape"], r["path"]): r.get("samples_us") for r in rows}
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ours, stock = by.get((shape, FP8_STEP_PATH)), by.get((shape, FP8_STOCK_STEP_PATH))
        fp16 = by.get((shape, "llm_attn via the patch"))
        if not (ours and stock):
            continue
        line = (f"{shape}, FP8 cache, update's return + call: stock's µs / ours "
                f"{format_ratio_interval(paired_ratio_interval(stock, ours))}")
        if fp16:
            line += (f"; the patched call on the fp16 cache / ours "
                     f"{format_ratio_interval(paired_ratio_interval(fp16, ours))}")
        lines.append(line)
    return lines


def main(argv=None) -> int:
    """``python -m llm_attn.harness.hostcost [--device cuda] [--dtype float16] [--calls 300]``: the table."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m llm_attn.harness.hostcost", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--calls", type=int, default=CALLS)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    rows = measure_host_cost(args.device, getattr(torch, args.dtype), calls=args.calls)
    print(host_cost_table(rows))
    print("\n".join(fp8_step_lines(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

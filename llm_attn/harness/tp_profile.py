"""Where a tensor-parallel rank's prefill time goes: one profiled prefill per rank (``profile_prefill``), the time
each rank spends *waiting* inside collectives rather than transferring (``attach_comm_wait``), and the kernels of one
decoder layer on each rank.

Rank time, collectives, waiting:

- ``span_ms``: the rank's prefill on its own timeline: on a GPU from the first kernel's start to the last one's end
  (device timeline: kernels, copies, memsets), on CPU the wall time of the profiled prefill. ``busy_ms``: the summed
  duration of the GPU's kernels/copies (CPU: of ATen ops' self time). ``comm_ms``: the summed duration of the
  rank's collectives: NCCL kernels on a GPU; on CPU the gloo work items (``gloo:all_reduce`` ...), which run on
  gloo's own threads from the start of a collective until it completes.
- A collective cannot finish before the last rank has entered it, so its duration on a rank = the wait for the
  other ranks to arrive + the transfer. Collectives are issued in the same order on every rank (NCCL and gloo match
  them by order), so the k-th collective of every rank is the same all-reduce. The rank that arrived last did not
  wait: its duration is the transfer (data movement plus the protocol's own latency). So, per collective k,
  ``transfer_k = min over ranks of duration_k`` and ``wait_k(rank) = duration_k(rank) - transfer_k``; a rank's
  ``comm_wait_ms`` is the sum over k, ``comm_wait_share`` = comm_wait_ms / span_ms, and ``comm_transfer_ms`` the
  sum of transfer_k. This needs no clock shared between ranks and no bandwidth model. It is a lower bound of the
  waiting (the last rank's own duration may hold a few µs of skew between its peers), and a defensible one: with
  two ranks, whichever rank is *ahead* (its host enqueues faster, or its GPU finished its share sooner) shows the
  wait, which is why the plain communication share of the two ranks can look swapped between implementations.
  Where the ranks' collective counts differ the wait is not computed and the profile says why.
- ``layer``: the kernels (CPU: ATen ops and collectives) of one decoder layer, the middle one, in the order they
  ran, each with its time and kind (attention, gemm, comm, other): what one layer costs on each rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llm_attn.harness.breakdown import GEMM_KERNEL, GEMM_OPS, _activity, _ancestors
from llm_attn.harness.measure import ATTENTION_KERNEL, prefill_first_token
from llm_attn.registry import RANGE_PREFIX

PREFILL_RANGE = "llm_attn.tp.prefill"
LAYER_RANGE = "llm_attn.tp.layer"
# GPU: NCCL's kernels (ncclDevKernel_AllReduce_Sum_f16_RING_LL, ncclKernel_AllGather_RING_LL_Sum_int8_t, ...).
NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)
# CPU: gloo's work items, recorded on gloo's threads around the whole collective (c10d's own ops only enqueue it).
GLOO_WORK = re.compile(r"^gloo:")
LAYER_KERNELS_KEPT = 60  # a Llama layer runs ~15-25 kernels on a GPU; more means the range caught something else
# CPU: a layer is ~50 top-level ATen ops, most of them views; those under this share of the layer are left out.
CPU_OP_SHARE_KEPT = 0.005


def _is_annotation(e) -> bool:
    # record_function ranges appear on the GPU timeline as annotations spanning their kernels: never counted as
    # kernels. torch 2.13 says so in activity_type; older versions flag is_user_annotation.
    return "annotation" in str(getattr(e, "activity_type", "") or "") or bool(getattr(e, "is_user_annotation", False))


def _device_events(events) -> list:
    return [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and not _is_annotation(e)]


def _kind(name: str, chain_names: list[str] = ()) -> str:
    if NCCL_KERNEL.search(name) or GLOO_WORK.match(name) or "c10d" in name:
        return "comm"
    if ATTENTION_KERNEL.search(name) or any(n.startswith(RANGE_PREFIX) for n in chain_names):
        return "attention"
    if GEMM_KERNEL.search(name) or name in GEMM_OPS or any(n in GEMM_OPS for n in chain_names):
        return "gemm"
    return "other"


@contextmanager
def layer_range(model, index: int | None = None) -> Iterator[int | None]:
    """A profiler range around one decoder layer's forward (the middle one by default); yields its index, or None
    where the model has no ``model.layers``."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        yield None
        return
    index = len(layers) // 2 if index is None else index
    open_ranges = []

    def enter(module, args):
        rf = torch.profiler.record_function(LAYER_RANGE)
        rf.__enter__()
        open_ranges.append(rf)

    def leave(module, args, output):
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    hooks = [layers[index].register_forward_pre_hook(enter), layers[index].register_forward_hook(leave)]
    try:
        yield index
    finally:
        for h in hooks:
            h.remove()


def _layer_gpu(events, windows) -> list[dict]:
    """The kernels inside the layer range's window on the device timeline; where the profiler drew no window there
    (older kineto), the kernels whose launching runtime call nests in the range on the CPU (``breakdown``'s chain)."""
    kernels = sorted(_device_events(events), key=lambda e: e.time_range.start)
    if windows:
        start, end = windows[0]
        inside = [e for e in kernels if start - 1.0 <= e.time_range.start and e.time_range.end <= end + 1.0]
    else:
        launches = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                    and _activity(e) in ("cuda_runtime", "cuda_driver")}
        inside = [e for e in kernels if e.id in launches
                  and any(a.name == LAYER_RANGE for a in _ancestors(launches[e.id]))]
    return [{"name": e.name[:120], "ms": e.time_range.elapsed_us() / 1e3, "kind": _kind(e.name)} for e in inside]


def _layer_cpu(events, window_range) -> list[dict]:
    if window_range is None:
        return []
    start, end = window_range.time_range.start, window_range.time_range.end
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.name in (LAYER_RANGE, PREFILL_RANGE):
            continue
        if GLOO_WORK.match(e.name):  # on gloo's thread: inside the layer when it starts inside the layer's window
            if start <= e.time_range.start <= end:
                out.append((e.time_range.start, {"name": e.name, "ms": e.time_range.elapsed_us() / 1e3,
                                                 "kind": "comm"}))
            continue
        if e.cpu_parent is not None and e.cpu_parent.name == LAYER_RANGE and e.cpu_parent.id == window_range.id:
            # The layer's top-level ops, each with everything under it (their children are not listed again).
            chain = []
            c = e
            while c is not None:
                chain.append(c.name)
                c = c.cpu_parent
            out.append((e.time_range.start, {"name": e.name[:120], "ms": e.cpu_time_total / 1e3,
                                             "kind": _kind(e.name, chain + [k.name for k in e.cpu_children])}))
    total = sum(d["ms"] for _, d in out)
    return [d for _, d in sorted(out, key=lambda x: x[0])
            if d["kind"] in ("comm", "attention") or d["ms"] >= CPU_OP_SHARE_KEPT * total]


def profile_prefill(model, prompt, device: torch.device, layer: int | None = None) -> dict:
    """One prefill + first token under torch.profiler on this rank (see the module docstring for the fields).
    ``collectives_ms`` keeps every collective's duration in issue order, for ``attach_comm_wait``."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with layer_range(model, layer) as index, profile(activities=acts) as prof:
        with torch.profiler.record_function(PREFILL_RANGE):
            prefill_first_token(model, prompt)[0].cpu()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.events()
    if cuda:
        dev = _device_events(events)
        intervals = sorted((e.time_range.start, e.time_range.end) for e in dev)
        span_us = (max(e for _, e in intervals) - intervals[0][0]) if intervals else 0.0
        busy_us = sum(e - s for s, e in intervals)
        coll = sorted((e for e in dev if NCCL_KERNEL.search(e.name)), key=lambda e: e.time_range.start)
        windows = sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.device_type != torch.autograd.DeviceType.CPU and e.name == LAYER_RANGE)
        layer_kernels = _layer_gpu(events, windows)
    else:
        cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        ranges = [e for e in cpu if e.name == PREFILL_RANGE]
        span_us = ranges[0].time_range.elapsed_us() if ranges else 0.0
        busy_us = sum(max(e.self_cpu_time_total, 0) for e in cpu
                      if e.name not in (PREFILL_RANGE, LAYER_RANGE) and not GLOO_WORK.match(e.name))
        coll = sorted((e for e in cpu if GLOO_WORK.match(e.name)), key=lambda e: e.time_range.start)
        layer_ranges = [e for e in cpu if e.name == LAYER_RANGE]
        layer_kernels = _layer_cpu(events, layer_ranges[0] if layer_ranges else None)
    collectives = [e.time_range.elapsed_us() / 1e3 for e in coll]
    comm = sum(collectives)
    span = span_us / 1e3
    names = {}
    for e in coll:
        key = e.name[:80]
        names[key] = names.get(key, 0) + 1
    return {"timer": "cuda_kernels" if cuda else "cpu_ops", "span_ms": span, "busy_ms": busy_us / 1e3,
            "comm_ms": comm, "comm_share": comm / span if span > 0 else None,
            "collectives_ms": collectives, "collective_kinds": names,
            "layer": {"index": index, "kernels": layer_kernels[:LAYER_KERNELS_KEPT],
                      "ms": sum(k["ms"] for k in layer_kernels),
                      "what": "kernels on the device timeline" if cuda else
                              "top-level ATen ops (each with what runs under it) and gloo collectives; ops under "
                              f"{100 * CPU_OP_SHARE_KEPT:.1f} % of the layer left out"}}


def comm_wait(collectives_per_rank: list[list[float]]) -> list[dict]:
    """Per rank: waiting and transfer time in its collectives (module docstring), from every rank's collective
    durations in issue order. Ranks whose collective counts differ cannot be matched: wait None, with the reason."""
    counts = [len(c) for c in collectives_per_rank]
    if len(set(counts)) > 1:
        why = f"ranks ran different numbers of collectives ({'/'.join(map(str, counts))}): cannot match them"
        return [{"comm_wait_ms": None, "comm_transfer_ms": None, "collectives": n, "why": why} for n in counts]
    transfer = [min(ks) for ks in zip(*collectives_per_rank)]
    out = []
    for durations in collectives_per_rank:
        out.append({"comm_wait_ms": sum(d - t for d, t in zip(durations, transfer)),
                    "comm_transfer_ms": sum(transfer), "collectives": len(durations), "why": None})
    return out


def attach_comm_wait(profiles: list[dict]) -> list[dict]:
    """Every rank's profile (``profile_prefill``, gathered in rank order) with ``comm_wait_ms``,
    ``comm_transfer_ms``, ``comm_wait_share`` (of the rank's span) and ``comm_wait_method`` added."""
    waits = comm_wait([p["collectives_ms"] for p in profiles])
    out = []
    for p, w in zip(profiles, waits):
        span = p.get("span_ms") or 0.0
        share = w["comm_wait_ms"] / span if w["comm_wait_ms"] is not None and span > 0 else None
        out.append({**p, "comm_wait_ms": w["comm_wait_ms"], "comm_transfer_ms": w["comm_transfer_ms"],
                    "comm_wait_share": share, "comm_wait_why": w["why"],
                    "comm_wait_method": "per collective: this rank's duration minus the shortest duration of the "
                                        "same collective on any rank (the last to arrive, which did not wait)"})
    return out

"""The measurements every rank of a tensor-parallel run makes at one (batch, seq) point: paired TTFT
(``measure_point``) and paired graph TTFT (``measure_graph_point``). Both return this rank's results; rank 0 turns
the gathered results into rows (``llm_attn.harness.tp``).

Paired as on one GPU (``harness/paired.py``): in every repeat each implementation runs once, in an order drawn from
the same seed on every rank (``paired.pairing_order``), with Python's garbage collector off while timing; all ranks
meet at a barrier before each timed prefill. Per repeat every rank keeps its device time (CUDA events from the start
of the prefill to the first token's argmax; perf_counter on CPU), its host *enqueue* time (perf_counter until the
forward and argmax have returned, before anything waits for the GPU) and its wall time (until the token is on the
host): ``paired.host_bound_summary`` of those flags a rank whose host, not its GPU, set the pace. A host-bound rank
reaches each all-reduce late, and the other rank's collective kernels wait for it (``tp_profile``).

Graph TTFT at TP >= 2: NCCL collectives can be captured in a CUDA graph (``ProcessGroupNCCL`` supports capture; the
replays rendezvous like eager collectives), so the whole sharded prefill is captured once per implementation on
every rank and replayed, all ranks together, with no Python and no host noise: what TP costs and buys on the GPUs
alone. On CPU (gloo) there is no graph: ``GraphCaptureUnsupported`` says so and the caller records the rows as
unsupported.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llm_attn.harness.graphs import graph_capture, no_gc
from llm_attn.harness.impls import use_impl
from llm_attn.harness.measure import (
    _OOM_ERRORS,
    GraphCaptureUnsupported,
    _peak,
    _reset_peak,
    _sync,
    attention_kernels_of,
    prefill_first_token,
)
from llm_attn.harness.paired import host_bound_summary, pairing_order
from llm_attn.harness.tp_profile import profile_prefill
from llm_attn.harness.tp_world import World

OOM_ERRORS = _OOM_ERRORS


def timed_prefill(model, prompt, device: torch.device):
    """One prefill + greedy token: (device ms from the start of the prefill to the argmax, host enqueue ms, wall ms
    until the token is on this rank's host, token ids, last logits). On CPU the device time is the wall time."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        tok, logits = prefill_first_token(model, prompt)
        end.record()
        t_enq = time.perf_counter()
        host_tok = tok.cpu()  # the first token is on the host
        wall = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        return start.elapsed_time(end), (t_enq - t0) * 1e3, wall, host_tok, logits
    t0 = time.perf_counter()
    tok, logits = prefill_first_token(model, prompt)
    t_enq = time.perf_counter()
    host_tok = tok.cpu()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, (t_enq - t0) * 1e3, ms, host_tok, logits


def measure_point(model, world: World, impls: list[str], prompt, warmup: int, repeats: int, seed: int,
                  log: Callable[[str], None], where: dict | None = None) -> dict:
    """Paired TTFT of every implementation at one (batch, seq) on this rank: ``{impl: fields}`` with the samples,
    enqueue and wall times, this rank's host-bound summary, the profiled prefill, the attention calls of one prefill,
    the first token and last logits, and the pairing record (``order``, ``positions``). ``where["impl"]`` follows
    the implementation running (what an out-of-memory row names)."""
    where = {} if where is None else where
    device = world.device
    cuda = device.type == "cuda"
    res = {impl: {"samples_ms": [], "enqueue_ms": [], "wall_samples_ms": [], "positions": [], "calls": None,
                  "profile": None, "token": None, "logits": None, "peak_mem_bytes": None} for impl in impls}
    order = pairing_order(impls, repeats, seed)  # the same on every rank: the same seed
    with torch.inference_mode():
        for impl in impls:
            where["impl"] = impl
            with use_impl(model, impl) as rep:
                for _ in range(warmup):
                    timed_prefill(model, prompt, device)
                if rep is not None:  # count the calls of exactly one prefill: the one whose token is recorded
                    rep.reset_counters()
                _, _, _, tok, logits = timed_prefill(model, prompt, device)
                res[impl]["token"] = tok.tolist()
                res[impl]["logits"] = logits.float().cpu()
                if rep is not None:
                    res[impl]["calls"] = {"impl": rep.num_native_calls, "native": dict(rep.native_calls),
                                          "stock_fallback": rep.num_fallback_calls,
                                          "fallback_reasons": dict(rep.fallback_calls)}
                _sync(device)
                world.barrier()
                res[impl]["profile"] = profile_prefill(model, prompt, device)
        with no_gc():
            for i in range(repeats):
                for pos, impl in enumerate(order[i]):
                    where["impl"] = impl
                    with use_impl(model, impl):
                        _sync(device)
                        world.barrier()  # every rank starts the prefill together
                        _reset_peak(device)
                        ms, enq, wall, _, _ = timed_prefill(model, prompt, device)
                        peak = _peak(device)
                    r = res[impl]
                    r["samples_ms"].append(ms)
                    r["enqueue_ms"].append(enq)
                    r["wall_samples_ms"].append(wall)
                    r["positions"].append(pos)
                    if peak is not None:
                        r["peak_mem_bytes"] = max(r["peak_mem_bytes"] or 0, peak)
                if (i + 1) % max(1, repeats // 4) == 0 or i + 1 == repeats:
                    log(f"  repeat {i + 1}/{repeats}")
    for impl in impls:
        r = res[impl]
        r["host_bound"] = host_bound_summary(r["samples_ms"], r["enqueue_ms"], r["wall_samples_ms"],
                                             device_timed=cuda)
        r["order"] = order
    return res


def _capture(model, prompt, device: torch.device, warmup: int):
    """Warm-up on a side stream (as capture requires), then the prefill captured in one CUDA graph: (graph, the
    graph's token tensor). Raises GraphCaptureUnsupported for a capture failure (OOM is raised as it is)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            prefill_first_token(model, prompt)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with graph_capture(graph):
            token, _ = prefill_first_token(model, prompt)
    except OOM_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 (a capture failure is a property of this path: recorded, not fatal)
        del graph
        try:
            torch.cuda.synchronize(device)
        except RuntimeError:
            pass  # the capture's own error is the one to report
        raise GraphCaptureUnsupported(f"the sharded prefill cannot be captured in a CUDA graph: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300] if str(e) else ''}") from e
    return graph, token


def measure_graph_point(model, world: World, impls: list[str], prompt, warmup: int, repeats: int, seed: int,
                        log: Callable[[str], None], where: dict | None = None) -> tuple[dict, dict]:
    """Graph TTFT of every implementation at one point on this rank, paired like ``measure_point``: each
    implementation's prefill is captured once (on every rank: the captured collectives rendezvous at replay), then
    every repeat replays each graph once in the seeded order, all ranks starting together. Returns (``{impl:
    fields}`` of the captured ones, ``{impl: reason}`` of those that could not be captured on some rank: every rank
    learns every rank's outcome, so all leave out the same implementations)."""
    device = world.device
    where = {} if where is None else where
    if device.type != "cuda":
        raise GraphCaptureUnsupported(f"CUDA graphs need CUDA devices (NCCL); this run is on {device.type} with "
                                      f"{world.backend}: graph TTFT is not measured here")
    graphs, failed = {}, {}
    with torch.inference_mode():
        for impl in impls:
            where["impl"] = impl
            with use_impl(model, impl):
                try:
                    graph, token = _capture(model, prompt, device, warmup)
                    why = None
                except GraphCaptureUnsupported as e:
                    graph, token, why = None, None, str(e)
            whys = world.gather(why)  # every rank's outcome: capture failures must not leave the ranks apart
            bad = [(k, w) for k, w in enumerate(whys) if w]
            if bad:
                failed[impl] = f"rank {bad[0][0]}: {bad[0][1]}"
                del graph
                continue
            graphs[impl] = (graph, token)
        res = {impl: {"samples_ms": [], "positions": [], "peak_mem_bytes": None} for impl in graphs}
        order = pairing_order(list(graphs), repeats, seed) if graphs else []
        with no_gc():
            for i in range(len(order)):
                for pos, impl in enumerate(order[i]):
                    where["impl"] = impl
                    graph = graphs[impl][0]
                    _sync(device)
                    world.barrier()
                    _reset_peak(device)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    res[impl]["samples_ms"].append(start.elapsed_time(end))
                    res[impl]["positions"].append(pos)
                    peak = _peak(device)
                    if peak is not None:
                        res[impl]["peak_mem_bytes"] = max(res[impl]["peak_mem_bytes"] or 0, peak)
                if (i + 1) % max(1, repeats // 4) == 0 or i + 1 == repeats:
                    log(f"  graph repeat {i + 1}/{repeats}")
        for impl, (graph, token) in graphs.items():
            res[impl]["token"] = token.tolist()
            res[impl]["order"] = order
            # The attention kernels of one replay, by name (a replay runs no Python: names are all there is).
            _sync(device)
            world.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize(device)
            res[impl]["attention_kernels"] = attention_kernels_of(prof.events())
        graphs.clear()
    return res, failed

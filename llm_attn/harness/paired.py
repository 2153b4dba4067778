"""Paired TTFT: every implementation runs once per repeat, in a seeded shuffled order, in one process.

Blocks (every repeat of one implementation, then every repeat of the next) let a slow patch of host time land on
one side only and print it as a kernel verdict (issue 18). Here drift hits all implementations of a repeat alike,
and the verdict comes from the per-repeat pairs (``stats.paired_ratio_interval``).

Switching: ``impls.use_impl`` is entered and left around each implementation's run of a repeat (stock entries:
``set_attn_implementation``; patched ones: ``patch_model``/``unpatch_model``, which only set a config field and a
per-module pointer). It runs outside the timed region, and its cost is recorded per switch (``switch_ms``).

Per repeat and implementation the host enqueue time is kept next to the device time: ``perf_counter`` from before
the forward until the forward (and the argmax) returns, before anything waits for the GPU. Where the enqueue time is
>= ``HOST_BOUND_SHARE`` of TTFT the GPU waited for the host: the row is flagged host-bound.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from llm_attn.harness import energy
from llm_attn.harness.graphs import no_gc
from llm_attn.harness.measure import _peak, _reset_peak, _sync, prefill_first_token
from llm_attn.harness.results import jsonable
from llm_attn.harness.stats import paired_ratio_interval, summarize

HOST_BOUND_SHARE = 0.9


@contextmanager
def stock_call_counter(impl: str) -> Iterator[Counter | None]:
    """For a stock implementation (``eager``, ``sdpa``, ``flash_attention_2``): count the calls of transformers'
    attention function while the block runs (wrapping its ``AttentionInterface`` entry, as the breakdown's ranges
    do). Yields None for patched implementations (their PatchReport counts) or where transformers has no
    registry. Used during warm-up only: the timed repeats run the unwrapped function."""
    from llm_attn import registry  # noqa: PLC0415

    entry = registry.get(impl)
    if not entry.stock:
        yield None
        return
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415
        mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    except (ImportError, AttributeError):
        yield None
        return
    name = entry.hf_name
    had, original = name in mapping, mapping.get(name)
    counter = Counter()

    def counted(module, *args, **kwargs):
        fn = original
        if fn is None:  # eager: transformers falls back to the modeling module's own function
            fn = sys.modules[type(module).__module__].eager_attention_forward
        counter["impl"] += 1
        return fn(module, *args, **kwargs)

    mapping[name] = counted
    try:
        yield counter
    finally:
        if had:
            mapping[name] = original
        else:
            mapping.pop(name, None)


def pairing_order(impls: Sequence[str], repeats: int, seed: int) -> list[list[str]]:
    """The order in which ``impls`` run in each repeat: an independent seeded shuffle per repeat (numpy PCG64), so
    no implementation always runs first (after a switch, a warm cache, or the previous one's allocations)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if len(set(impls)) != len(impls) or not impls:
        raise ValueError(f"impls must be distinct and non-empty, got {list(impls)}")
    rng = np.random.default_rng(seed)
    return [[impls[i] for i in rng.permutation(len(impls))] for _ in range(repeats)]


def host_bound_summary(samples_ms: Sequence[float], enqueue_ms: Sequence[float], wall_ms: Sequence[float],
                       device_timed: bool, share: float = HOST_BOUND_SHARE) -> dict:
    """Whether the host, not the device, set the pace: median enqueue time / median TTFT >= ``share``.

    ``gpu_span_share`` (CUDA only) = sum of the event-timed spans / sum of wall times: how much of the wall time the
    device timeline spans from the first kernel of the forward to the argmax; an upper bound of the GPU-busy share
    (gaps inside the span are counted as busy; the profiled breakdown measures them)."""
    ttft_p50 = float(np.median(samples_ms))
    enq_p50 = float(np.median(enqueue_ms))
    ratio = enq_p50 / ttft_p50 if ttft_p50 > 0 else None
    return {
        "enqueue_p50_ms": enq_p50,
        "ttft_p50_ms": ttft_p50,
        "enqueue_share": ratio,
        "threshold": share,
        "host_bound": bool(ratio is not None and ratio >= share),
        "gpu_span_share": (float(np.sum(samples_ms) / np.sum(wall_ms)) if device_timed and np.sum(wall_ms) > 0
                           else None),
        "note": None if device_timed else "CPU run: the host does all the work, so every CPU row is host-bound",
    }


def kv_cache_reads(counts) -> dict:
    """The ``kv_cache_reads`` entry of a row's ``attention_calls``: how many attention calls read the FP8 KV cache
    which way (``kv_cache_reference.FP8_READ_*``), from a PatchReport or a Counter; {} where none came from it."""
    counts = getattr(counts, "kv_cache_reads", counts)
    return {"kv_cache_reads": dict(counts)} if counts else {}


def _timed_prefill(model, input_ids: torch.Tensor, chunk: int | None = None,
                   kv_cache: str = "fp16") -> tuple[float, float, float]:
    """One TTFT: (device ms, host enqueue ms, wall ms). On CPU the device time is the wall time."""
    device = input_ids.device
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        tok, _ = prefill_first_token(model, input_ids, chunk=chunk, kv_cache=kv_cache)
        end.record()
        t_enq = time.perf_counter()
        tok.cpu()
        t1 = time.perf_counter()
        end.synchronize()
        dev_ms = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        tok, _ = prefill_first_token(model, input_ids, chunk=chunk, kv_cache=kv_cache)
        t_enq = time.perf_counter()
        tok.cpu()
        t1 = time.perf_counter()
        dev_ms = (t1 - t0) * 1e3
    return dev_ms, (t_enq - t0) * 1e3, (t1 - t0) * 1e3


def measure_ttft_paired(model, input_ids: torch.Tensor, impls: Sequence[str], warmup: int, repeats: int, *,
                        switch: Callable, seed: int = 0,
                        on_repeat: Callable[[], None] | None = None, meter=None,
                        prefill_chunk: int | None = None, kv_cache: str = "fp16") -> dict[str, dict]:
    """Paired TTFT of ``impls`` on one prompt: ``{impl: row fields}``. ``switch(model, impl)`` is the context
    manager that puts the model on an implementation and yields its PatchReport or None (``impls.use_impl``).
    ``meter`` (``harness.energy``): the energy of every timed prefill, read right before and after it, on the same
    repeats as the times (``energy_j``, ``energy``, and ``paired.energy_j`` by implementation).

    Warm-up: ``warmup`` prefills per implementation, round-robin, before the first timed repeat. Each row holds its
    own samples (``samples_ms``, ``stats``: what the tables read) and the whole paired record (``paired``): the
    order of every repeat, this implementation's position in it, and every implementation's samples by repeat
    index, so any pair's verdict can be recomputed from one row."""
    impls = list(impls)
    device = input_ids.device
    cuda = device.type == "cuda"
    order = pairing_order(impls, repeats, seed)
    dev = {i: [] for i in impls}
    enq = {i: [] for i in impls}
    wall = {i: [] for i in impls}
    switch_ms = {i: [] for i in impls}
    pos = {i: [] for i in impls}
    peak = dict.fromkeys(impls)
    calls = {i: Counter() for i in impls}
    reasons = {i: Counter() for i in impls}
    kv_reads = {i: Counter() for i in impls}
    patch_report = dict.fromkeys(impls)

    def tally(impl, rep):
        if rep is None:
            return
        calls[impl]["impl"] += rep.num_native_calls
        calls[impl]["stock_fallback"] += rep.num_fallback_calls
        reasons[impl].update(rep.fallback_calls)
        kv_reads[impl].update(rep.kv_cache_reads)
        patch_report[impl] = rep

    stock_calls = dict.fromkeys(impls)
    windows = {i: [] for i in impls}
    power_settings = meter.start_point() if meter is not None else {}  # power limit / nvpmodel now
    with torch.inference_mode(), no_gc():
        for _ in range(warmup):
            for impl in impls:
                with switch(model, impl) as rep, stock_call_counter(impl) as counter:
                    prefill_first_token(model, input_ids, chunk=prefill_chunk, kv_cache=kv_cache)
                    tally(impl, rep)
                if counter is not None:
                    stock_calls[impl] = (stock_calls[impl] or 0) + counter["impl"]
        _sync(device)
        for r in range(repeats):
            for p, impl in enumerate(order[r]):
                t0 = time.perf_counter()
                with switch(model, impl) as rep:
                    switch_ms[impl].append((time.perf_counter() - t0) * 1e3)
                    _reset_peak(device)
                    if meter is not None:
                        _sync(device)
                        win = meter.begin()
                    d, e, w = _timed_prefill(model, input_ids, prefill_chunk, kv_cache)
                    if meter is not None:
                        # A prefill shorter than the energy counter resolves is read from a burst of it run here
                        # (harness.energy.NvmlMeter.end); the TTFT sample stays the timed prefill above.
                        windows[impl].append(meter.end(
                            win, again=lambda: _timed_prefill(model, input_ids, prefill_chunk, kv_cache)))
                    pk = _peak(device)
                    tally(impl, rep)
                dev[impl].append(d)
                enq[impl].append(e)
                wall[impl].append(w)
                pos[impl].append(p)
                if pk is not None:
                    peak[impl] = max(peak[impl] or 0, pk)
            if on_repeat:
                on_repeat()
    record = {"impls": impls, "seed": seed, "order": order, "samples_ms": dev, "enqueue_ms": enq,
              "wall_ms": wall, "python_gc": "off while timing"}
    if meter is not None and meter.available:
        record["energy_j"] = {i: [w["energy_j"] if w else None for w in windows[i]] for i in impls}
    out = {}
    for impl in impls:
        fields = {
            "timer": "cuda_event" if cuda else "perf_counter",
            "samples_ms": dev[impl],
            "wall_samples_ms": wall[impl],
            "enqueue_samples_ms": enq[impl],
            "stats": summarize(dev[impl]),
            "warmup": warmup,
            "repeats": repeats,
            "peak_mem_bytes": peak[impl],
            "host_bound": host_bound_summary(dev[impl], enq[impl], wall[impl], device_timed=cuda),
            "paired": {**record, "positions": pos[impl], "switch_ms": switch_ms[impl]},
        }
        if meter is not None:
            fields.update(energy.ttft_energy_fields(windows[impl], meter, power_settings))
        if patch_report[impl] is not None:
            # Summed over every patch of this implementation (warm-up included): proof of what really ran.
            fields["attention_calls"] = {"impl": calls[impl]["impl"], "stock_fallback": calls[impl]["stock_fallback"],
                                         "fallback_reasons": dict(reasons[impl]), **kv_cache_reads(kv_reads[impl]),
                                         "counted_over": "warm-up and repeats" + (
                                             " and their energy bursts" if any(w and w.get("burst")
                                                                                for w in windows[impl]) else "")}
            fields["patch"] = jsonable(patch_report[impl])
        elif stock_calls[impl] is not None:
            # A stock implementation: all of its calls are stock by definition; counted over the warm-up.
            fields["attention_calls"] = {"impl": stock_calls[impl], "stock_fallback": 0, "fallback_reasons": {},
                                         "counted_over": "warm-up"}
        out[impl] = fields
    return out


def paired_verdicts(row: dict, references: Sequence[str], seed: int = 0) -> dict[str, dict]:
    """``{reference: interval}`` of ``row``'s implementation against each reference that ran in the same pairing
    (``stats.paired_ratio_interval``: median(reference) / median(row's impl), > 1 = the row's impl is faster)."""
    paired = row.get("paired")
    if not paired:
        return {}
    samples = paired["samples_ms"]
    mine = samples.get(row["impl"])
    out = {}
    for ref in references:
        if ref == row["impl"] or ref not in samples or mine is None:
            continue
        out[ref] = paired_ratio_interval(samples[ref], mine, seed=seed)
    return out


def switch_cost_ms(model, impls: Sequence[str], switch: Callable, rounds: int = 20) -> dict[str, float]:
    """Median ms to enter and leave ``switch(model, impl)`` for each implementation (nothing run inside)."""
    out = {}
    for impl in impls:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            with switch(model, impl):
                pass
            times.append((time.perf_counter() - t0) * 1e3)
        out[impl] = float(np.median(times))
    return out


def measure_ttft_over_prompts(model, prompts: Sequence[torch.Tensor], impls: Sequence[str], warmup: int,
                              repeats: int, *, switch: Callable, seed: int = 0,
                              on_prompt: Callable[[], None] | None = None) -> dict[str, dict]:
    """``--seq dataset``: TTFT over a dataset's own length distribution (``prompts.dataset_prompts``). Every prompt
    is measured paired at its own length (``measure_ttft_paired``, warm-up included: each length is a new shape);
    its TTFT is the median of its repeats. Per implementation: ``samples_ms`` = the per-prompt TTFTs in prompt order
    (``stats`` gives p50/p90 over the dataset), ``lengths``, and a ``paired`` record whose repeat index is the
    prompt index, so ``paired_verdicts`` pairs implementations prompt by prompt."""
    if not prompts:
        raise ValueError("no prompts to measure")
    impls = list(impls)
    per = {i: [] for i in impls}
    enq = {i: [] for i in impls}
    wall = {i: [] for i in impls}
    calls = {i: Counter() for i in impls}
    has_calls = dict.fromkeys(impls, False)
    lengths = []
    device = prompts[0].device
    for n, p in enumerate(prompts):
        got = measure_ttft_paired(model, p, impls, warmup, repeats, switch=switch, seed=seed + n)
        lengths.append(int(p.shape[1]))
        for i in impls:
            f = got[i]
            per[i].append(float(np.median(f["samples_ms"])))
            enq[i].append(float(np.median(f["enqueue_samples_ms"])))
            wall[i].append(float(np.median(f["wall_samples_ms"])))
            ac = f.get("attention_calls")
            if ac:
                has_calls[i] = True
                calls[i]["impl"] += ac["impl"]
                calls[i]["stock_fallback"] += ac["stock_fallback"]
        if on_prompt:
            on_prompt()
    record = {"impls": impls, "seed": seed, "order": None, "samples_ms": per, "enqueue_ms": enq, "wall_ms": wall,
              "unit": "prompt (each sample: the median of that prompt's paired repeats)"}
    out = {}
    for i in impls:
        out[i] = {
            "timer": "cuda_event" if device.type == "cuda" else "perf_counter",
            "samples_ms": per[i],
            "wall_samples_ms": wall[i],
            "enqueue_samples_ms": enq[i],
            "stats": summarize(per[i]),
            "lengths": lengths,
            "warmup": warmup,
            "repeats": repeats,
            "peak_mem_bytes": None,
            "host_bound": host_bound_summary(per[i], enq[i], wall[i], device_timed=device.type == "cuda"),
            "paired": {**record, "positions": None, "switch_ms": None},
        }
        if has_calls[i]:
            out[i]["attention_calls"] = {"impl": calls[i]["impl"], "stock_fallback": calls[i]["stock_fallback"]}
    return out


def measure_decode_paired(model, impls: Sequence[str], repeats: int, *, switch: Callable,
                          run_once: Callable[[], dict], seed: int = 0,
                          on_repeat: Callable[[], None] | None = None,
                          meter=None) -> tuple[dict[str, dict], dict[str, Exception]]:
    """Paired decode tok/s (issue 19): as TTFT, every implementation runs once per repeat, in a seeded shuffled
    order, so host drift hits all of them alike. ``run_once()`` is one run of a decode measurement on the model as
    switched (``measure_decode_generate`` / ``measure_decode_static`` with ``runs=1``) and returns its fields.

    Each implementation first runs once untimed (the warm-up: decode shapes compile and allocate on first use); one
    whose warm-up raises (e.g. eager attention inside a CUDA graph) is left out of the pairing and returned in the
    second dict with its exception, and the others are paired without it.

    Each row holds every run's per-token samples (``samples_ms``), each repeat's time per output token
    (``run_tpot_ms``), tok/s from their median (``tok_s``), and the ``paired`` record whose ``samples_ms`` are those
    per-repeat times per output token: ``paired_verdicts`` then gives median(reference tpot) / median(mine), i.e.
    my tok/s over the reference's, with its paired-bootstrap interval.

    ``meter`` (``harness.energy``, the one ``run_once`` measures with): its settings are read at the start, and the
    runs' energy windows become ``joules_per_token`` and ``energy`` (``paired.joules_per_token`` by
    implementation)."""
    failed: dict[str, Exception] = {}
    power_settings = meter.start_point() if meter is not None else {}  # power limit / nvpmodel now
    with no_gc():
        for impl in list(impls):
            try:
                with switch(model, impl):
                    run_once()
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 (the caller records it as this implementation's row)
                failed[impl] = e
        impls = [i for i in impls if i not in failed]
        if not impls:
            return {}, failed
        order = pairing_order(impls, repeats, seed)
        runs = {i: [] for i in impls}
        pos = {i: [] for i in impls}
        calls = {i: Counter() for i in impls}
        reasons = {i: Counter() for i in impls}
        kv_reads = {i: Counter() for i in impls}
        patch_report = dict.fromkeys(impls)
        for r in range(repeats):
            for p, impl in enumerate(order[r]):
                with switch(model, impl) as rep:
                    if rep is not None:
                        rep.reset_counters()
                    runs[impl].append(run_once())
                    if rep is not None:
                        calls[impl]["impl"] += rep.num_native_calls
                        calls[impl]["stock_fallback"] += rep.num_fallback_calls
                        reasons[impl].update(rep.fallback_calls)
                        kv_reads[impl].update(rep.kv_cache_reads)
                        patch_report[impl] = rep
                pos[impl].append(p)
            if on_repeat:
                on_repeat()
    tpot = {i: [t for f in runs[i] for t in f["run_tpot_ms"]] for i in impls}
    windows = {i: [w for f in runs[i] for w in f.pop("energy_windows", [])] for i in impls}
    record = {"impls": impls, "seed": seed, "order": order, "samples_ms": tpot, "python_gc": "off while timing",
              "unit": "time per output token of each repeat's run (ms); ratios of their medians are tok/s ratios"}
    if meter is not None and meter.available:
        record["joules_per_token"] = {i: [w["energy_j"] / w["tokens"] if w and w.get("tokens") else None
                                          for w in windows[i]] for i in impls}
    out = {}
    for impl in impls:
        first = runs[impl][0]
        samples = [s for f in runs[impl] for s in f["samples_ms"]]
        med = summarize(tpot[impl])["p50"]
        peaks = [f["peak_mem_bytes"] for f in runs[impl] if f.get("peak_mem_bytes") is not None]
        fields = {
            **first,
            "samples_ms": samples,
            "stats": summarize(samples),
            "run_tpot_ms": tpot[impl],
            "tpot_ms": med,
            "tok_s": 1e3 / med,
            "runs": repeats,
            "warmup_runs": 1,
            "peak_mem_bytes": max(peaks) if peaks else None,
            "paired": {**record, "positions": pos[impl]},
        }
        if meter is not None:
            fields.update(energy.decode_energy_fields(windows[impl], meter, power_settings))
        if "generate_first_token_ms" in first:
            fields["generate_first_token_ms"] = [t for f in runs[impl] for t in f["generate_first_token_ms"]]
        if patch_report[impl] is not None:
            # Calls replayed from a CUDA graph run no Python: counted at capture (each repeat captures anew).
            fields["attention_calls"] = {"impl": calls[impl]["impl"], "stock_fallback": calls[impl]["stock_fallback"],
                                         "fallback_reasons": dict(reasons[impl]), **kv_cache_reads(kv_reads[impl]),
                                         "counted_over": "repeats"}
            fields["patch"] = jsonable(patch_report[impl])
        out[impl] = fields
    return out, failed

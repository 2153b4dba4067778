"""Where TTFT goes: one prefill profiled with ``torch.profiler``, its time split into attention, GEMM, quantised-weight
handling, other kernels and idle (``python -m llm_attn.ttft --measure breakdown``).

Attention is attributed by *launch*, not by kernel name: every call of a registered implementation runs inside a
``llm_attn.attention:<impl>`` profiler range (``AttentionImpl.run``), and for stock implementations, which
transformers calls directly, ``attention_ranges`` wraps transformers' attention function in the same range for
the duration of the profile. On the GPU the profiler draws each range on the device timeline too, around exactly
the kernels launched inside it: a kernel is attention when it runs inside such a window (or, where the device
timeline has none, when the runtime call that launched it nests in the range on the CPU).
Where no range could be installed (transformers without ``AttentionInterface``) the SDPA ATen ops are used instead,
and the row says so (``attention_attribution``).

GEMMs are kernels launched under ATen matmul ops or with GEMM kernel names (cuBLAS, CUTLASS, Triton
``*gemm*``); quantised-weight handling is what remains with a dequantise/AWQ/GPTQ name; everything else launched is
"other" (norms, RoPE, activations, copies); "idle" is the part of the prefill span in which no kernel ran on the
GPU (the CPU was the bottleneck: Python, launches, host syncs). On CPU the same split is made over the self time of
ATen ops, and "idle" is host time outside any op.

``ttft_if_attention_zero_ms`` = profiled span − attention time: the most any attention kernel could gain (less if
the GPU then waits for the CPU instead).
"""

from __future__ import annotations

import bisect
import re
import sys
from collections import Counter
from contextlib import contextmanager

import torch

from llm_attn.registry import RANGE_PREFIX, range_name

CATEGORIES = ("attention", "gemm", "quant", "other", "idle")
PREFILL_RANGE = "llm_attn.prefill"
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "aten::_addmm_activation", "aten::addbmm", "aten::_scaled_mm"}
SDPA_OPS = re.compile(r"^aten::(_?scaled_dot_product|_flash_attention|_efficient_attention|_cudnn_attention)")
GEMM_KERNEL = re.compile(r"gemm|gemv|cutlass|xmma|cublas|nvjet|wgmma|hmma|s16816|s1688|matmul|_mm_|splitk",
                         re.IGNORECASE)
QUANT = re.compile(r"dequant|awq|gptq|marlin|exllama|int4|w4a16|qweight|unpack", re.IGNORECASE)
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


@contextmanager
def attention_ranges(model, impl_name: str, hf_name: str | None):
    """For a stock implementation: wrap transformers' attention function so each call is a profiler range named
    like a registered implementation's. Yields how attention will be attributed: 'ranges' or 'op-names'."""
    if hf_name is None:  # patched implementations open their range themselves (AttentionImpl.run)
        yield "ranges"
        return
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415
        mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    except (ImportError, AttributeError):
        yield "op-names"
        return
    name = range_name(impl_name)
    had = hf_name in mapping
    original = mapping.get(hf_name)

    def wrapped(module, *args, **kwargs):
        fn = original
        if fn is None:  # eager: transformers falls back to the modeling module's own function
            fn = sys.modules[type(module).__module__].eager_attention_forward
        with torch.profiler.record_function(name):
            return fn(module, *args, **kwargs)

    mapping[hf_name] = wrapped
    try:
        yield "ranges"
    finally:
        if had:
            mapping[hf_name] = original
        else:
            mapping.pop(hf_name, None)


_RUNTIME_CALL = re.compile(r"^(cuda|cu)[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...


def _activity(e) -> str:
    """The kineto activity of a profiler event: 'cpu_op', 'user_annotation', 'gpu_user_annotation', 'kernel',
    'gpu_memcpy', 'gpu_memset', 'cuda_runtime', ... ``FunctionEvent.activity_type`` says it on recent torch (2.13);
    older ones (the H100's torch 2.11) have no such attribute: derive it from what their events carry."""
    activity = getattr(e, "activity_type", None)
    if activity:
        return str(activity)
    on_cpu = e.device_type == torch.autograd.DeviceType.CPU
    if getattr(e, "is_user_annotation", False):
        return "user_annotation" if on_cpu else "gpu_user_annotation"
    if not on_cpu:
        name = e.name.lower()
        return "gpu_memcpy" if name.startswith("memcpy") else "gpu_memset" if name.startswith("memset") else "kernel"
    return "cuda_runtime" if _RUNTIME_CALL.match(e.name) else "cpu_op"


def _ancestors(evt):
    while evt is not None:
        yield evt
        evt = evt.cpu_parent


def classify(events, device_type: str, attribution: str = "ranges") -> dict:
    """Split a profile that holds one PREFILL_RANGE into CATEGORIES (ms). ``events``: ``prof.events()``."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    prefill = [e for e in cpu if e.name == PREFILL_RANGE]
    if len(prefill) != 1:
        raise RuntimeError(f"expected one '{PREFILL_RANGE}' range in the profile, found {len(prefill)}")
    prefill = prefill[0]
    ranges = [e for e in cpu if e.name.startswith(RANGE_PREFIX)]
    gpu_ranges = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU
                  and e.name.startswith(RANGE_PREFIX)]
    if attribution == "ranges" and not ranges and not gpu_ranges:
        attribution = "op-names"  # no call went through a range (e.g. an implementation that was never called)

    def is_attention(chain) -> bool:
        if attribution == "ranges":
            return any(e.name.startswith(RANGE_PREFIX) for e in chain)
        return any(SDPA_OPS.match(e.name) for e in chain)

    def category(name: str, chain) -> str:
        if is_attention(chain):
            return "attention"
        if GEMM_KERNEL.search(name) or any(e.name in GEMM_OPS for e in chain):
            return "gemm"
        if QUANT.search(name) or any(QUANT.search(e.name) for e in chain):
            return "quant"
        return "other"

    times = dict.fromkeys(CATEGORIES, 0.0)
    top = Counter()
    start_us, end_us = prefill.time_range.start, prefill.time_range.end
    if device_type == "cuda":
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        # record_function ranges also appear on the GPU timeline ("gpu_user_annotation"), spanning exactly the
        # kernels launched inside them: the most direct attribution, and never counted as kernels themselves.
        notes = [e for e in device if _is_annotation(e)]
        windows = sorted((e.time_range.start, e.time_range.end) for e in notes if e.name.startswith(RANGE_PREFIX))
        kernels = [e for e in device if not _is_annotation(e) and _activity(e) in DEVICE_ACTIVITIES]
        # The launch chain: a kernel shares its CUPTI correlation id with the runtime call that launched it, which
        # nests (by time, on the launching thread) inside the ATen op and the ranges around it.
        launches = {e.id: e for e in cpu if _activity(e) in ("cuda_runtime", "cuda_driver")}
        ops = {e.id: e for e in cpu if getattr(e, "linked_correlation_id", 0) == 0}
        if windows and attribution == "ranges":
            attribution = "ranges (GPU timeline)"
        intervals = []
        for k in kernels:
            launch = launches.get(k.id) or ops.get(getattr(k, "linked_correlation_id", 0))
            chain = list(_ancestors(launch))
            if windows and attribution.startswith("ranges"):
                cat = "attention" if _inside(windows, k.time_range.start, k.time_range.end) else \
                    category(k.name, [e for e in chain if not e.name.startswith(RANGE_PREFIX)])
            else:
                cat = category(k.name, chain)
            dur = (k.time_range.end - k.time_range.start) / 1e3
            times[cat] += dur
            top[(cat, k.name[:80])] += dur
            intervals.append((k.time_range.start, k.time_range.end))
        if intervals:
            start_us = min(start_us, min(s for s, _ in intervals))
            end_us = max(end_us, max(e for _, e in intervals))
        busy = _union(intervals) / 1e3
    else:
        busy = 0.0
        for e in cpu:
            if _activity(e) != "cpu_op" or not (start_us <= e.time_range.start <= end_us):
                continue
            chain = list(_ancestors(e))
            dur = e.self_cpu_time_total / 1e3
            cat = category(e.name, chain)
            times[cat] += dur
            top[(cat, e.name)] += dur
            busy += dur
    span = (end_us - start_us) / 1e3
    times["idle"] = max(0.0, span - busy)
    return {
        "device_type": device_type,
        "attention_attribution": attribution,
        "span_ms": span,
        "busy_ms": busy,
        "category_ms": times,
        "category_pct": {k: 100 * v / span if span > 0 else None for k, v in times.items()},
        "ttft_if_attention_zero_ms": max(0.0, span - times["attention"]),
        "attention_ranges": len(ranges),
        "top": [{"category": c, "name": n, "ms": ms} for (c, n), ms in top.most_common(12)],
    }


def _is_annotation(e) -> bool:
    return e.name == PREFILL_RANGE or e.name.startswith(RANGE_PREFIX) or "annotation" in _activity(e)


def _inside(windows, start: float, end: float) -> bool:
    """Whether [start, end] lies in one of the sorted, non-overlapping ``windows`` (1 µs of slack: rounding)."""
    i = bisect.bisect_right(windows, (start + 1.0, float("inf"))) - 1
    return i >= 0 and windows[i][0] - 1.0 <= start and end <= windows[i][1] + 1.0


def _union(intervals) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def measure_breakdown(model, input_ids: torch.Tensor, impl_name: str, hf_name: str | None,
                      warmup: int = 1) -> dict:
    """Profile one prefill (prompt in, first token on the host) after ``warmup`` unprofiled ones at the same shape;
    return the split (see the module docstring) and the profiler's own total."""
    from llm_attn.harness.measure import prefill_first_token  # noqa: PLC0415

    device = input_ids.device
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        for _ in range(max(1, warmup)):
            prefill_first_token(model, input_ids)
        if cuda:
            torch.cuda.synchronize(device)
        with attention_ranges(model, impl_name, hf_name) as attribution:
            with torch.profiler.profile(activities=activities) as prof:
                with torch.profiler.record_function(PREFILL_RANGE):
                    tok, _ = prefill_first_token(model, input_ids)
                    tok.cpu()  # the first token on the host ends TTFT (and waits for the GPU)
    result = classify(prof.events(), device.type, attribution)
    result["profiler"] = "torch.profiler (" + ", ".join(a.name for a in activities) + ")"
    return result

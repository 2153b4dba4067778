"""The kernel benchmark's measurements (the library behind ``python -m llm_attn.bench``): the callables of each
implementation, CUDA-event and CUDA-graph timing, one benchmark point, and its summary-table row."""

from __future__ import annotations

import math
import statistics

import torch

from llm_attn import registry
from llm_attn.harness.graphs import graph_capture
from llm_attn.harness.stats import ratio_header, speed_ratio

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Our FP8 forward (precision='fp8', its quantising pre-pass included) with its key tile forced (128, 192 or 256 keys
# per S tile; llm_attn.ops.force_fp8_tile), its Q K^T in e4m3 rather than the default int8 (llm_attn.ops.force_fp8_qk),
# both, or its P V in the input dtype (fp8_pv='input', int8 Q K^T: llm_attn_int8qk's kernel, the default tile): A/B in
# one run, beside llm_attn_fp8 (the build's defaults). name -> (block_n, qk, pv); 0 / "": the default.
FP8_TILE_IMPLS = {"ours-fp8-128": (128, "", ""), "ours-fp8-192": (192, "", ""), "ours-fp8-256": (256, "", ""),
                  "ours-fp8-e4m3qk": (0, "e4m3", ""), "ours-fp8-e4m3qk-256": (256, "e4m3", ""),
                  "ours-int8qk": (0, "int8", "input")}
# Attention over the FP8 (e4m3) KV cache (llm_attn.models.kv_cache's format, quantised once before timing): ours reads
# the e4m3 bytes (llm_attn.ops.decode_fp8_kv: kernels/flash_decode_fp8kv_kernel.cuh for a decode call, the prefill
# kernel kernels/flash_prefill_fp8kv_kernel.cuh for a chunk, --q-len); sdpa-fp8kv-copy is what stock attention does
# with that cache, every step: dequantise it to the query dtype, then SDPA (the honest baseline); ours-fp8kv-copy the
# same with our kernel (flash_attn_func: what the patched attention ran for a prefill before the prefill kernel).
# Their GB/s count the FP8 bytes (K and V, one byte per element; the scales are 1/32 of that at head_dim 128).
FP8_KV_IMPLS = ("ours-fp8kv", "ours-fp8kv-copy", "sdpa-fp8kv-copy")
# The vendor's FP8 attention (cuDNN's FP8 forward through JAX, harness/cudnn_fp8.py): a reference for our FP8 paths,
# timed by the wall clock around chains of calls in one XLA program (it cannot join a PyTorch CUDA graph), inputs
# quantised once and not counted.
VENDOR_FP8_IMPLS = ("cudnn-fp8",)
BENCH_IMPLS = ["ours", "ours-op", "ours-large", "ours-wide", "ours-small", "ours-hopper", *FP8_TILE_IMPLS,
               *FP8_KV_IMPLS, "flash", "cudnn", "efficient", "math", *VENDOR_FP8_IMPLS]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def make_fn(impl: str, q, k, v, causal: bool):
    """A zero-argument callable running one attention forward with `impl`, and a note (e.g. K/V expanded)."""
    if impl not in BENCH_IMPLS:  # an entry of the attention registry (built-in or plugin): its own fn, as patched
        entry = registry.get(impl)
        scale = q.shape[-1] ** -0.5
        return (lambda: entry.fn(q, k, v, causal=causal, scale=scale)), entry.source_label
    if impl == "ours":
        from llm_attn.ops import flash_attn_func

        return (lambda: flash_attn_func(q, k, v, causal=causal, path="kernel")), ""
    if impl == "ours-op":  # ours with gradients through the torch.library op's Python autograd (the NVRTC build's
        from llm_attn.ops import cpp_autograd, flash_attn_func  # way), not the extension's C++ autograd function

        def through_op():
            with cpp_autograd(False):
                return flash_attn_func(q, k, v, causal=causal, path="kernel")

        return through_op, "op autograd"
    if impl in FP8_KV_IMPLS:
        return _fp8_kv_fn(impl, q, k, v, causal)
    if impl in VENDOR_FP8_IMPLS:
        from llm_attn.harness.cudnn_fp8 import CudnnFp8Attention  # noqa: PLC0415

        sq, sk = q.shape[2], k.shape[2]
        if causal and 1 < sq < sk:
            raise ValueError("cudnn-fp8 has no bottom-right causal mask (a chunk over a longer cache)")
        if q.requires_grad:
            raise ValueError("cudnn-fp8 is a forward (inference) reference: no backward")
        attn = CudnnFp8Attention(q, k, v, causal and sq == sk and sq > 1)  # q_len 1: every key, as SDPA
        return attn, attn.note
    if impl in FP8_TILE_IMPLS:  # set for each call/capture, as the forced prefill tiles below
        from llm_attn.ops import flash_attn_func, force_fp8_qk, force_fp8_tile

        block_n, qk, pv = FP8_TILE_IMPLS[impl]

        def fp8_forced():
            with force_fp8_tile(block_n), force_fp8_qk(qk):
                return flash_attn_func(q, k, v, causal=causal, path="kernel", precision="fp8", fp8_pv=pv)

        note = ", ".join([f"fp8 tile {block_n}"] * bool(block_n) + [f"fp8 Q K^T {qk}"] * bool(qk))
        return fp8_forced, f"{note}, P V in the input dtype" if pv else note
    if impl.startswith("ours-"):  # ours with one prefill tile forced (kernel tuning); set for each call/capture
        from llm_attn.ops import flash_attn_func, force_tile

        tile = impl.removeprefix("ours-")

        def forced():
            with force_tile(tile):
                return flash_attn_func(q, k, v, causal=causal, path="kernel")

        return forced, f"tile {tile}"
    from torch.nn.attention import sdpa_kernel

    backend = _sdpa_backends()[impl]
    # SDPA's is_causal is top-left aligned; for q_len == kv_len it is the same mask as ours. For decode (q_len 1)
    # causal == full attention, which is what stock transformers runs.
    is_causal = causal and q.shape[2] == k.shape[2] and q.shape[2] > 1
    gqa = q.shape[1] != k.shape[1]
    note = ""

    def call(kk, vv, enable_gqa):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=is_causal,
                                                                    enable_gqa=enable_gqa)

    try:
        call(k, v, gqa)
        fn = lambda: call(k, v, gqa)  # noqa: E731
    except RuntimeError:
        if not gqa:
            raise
        # This backend refuses enable_gqa: measure it the way transformers then runs it, with K/V expanded.
        rep = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        call(ke, ve, False)
        fn = lambda: call(ke, ve, False)  # noqa: E731
        if k.requires_grad:  # training: the expansion is part of every step (and of its backward)
            fn = lambda: call(k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False)  # noqa: E731
        note = "K/V expanded"
    return fn, note


def _fp8_kv_fn(impl: str, q, k, v, causal: bool):
    """The FP8-cache decode callables: K/V quantised into the FP8 cache format once, here (not timed)."""
    from llm_attn.models.kv_cache import Fp8DynamicLayer
    from llm_attn.ops import decode_fp8_kv, fp8_kv_dequantized

    layer = Fp8DynamicLayer()
    with torch.inference_mode():
        layer.update(k, v)
    kv = layer.fp8()
    if impl == "ours-fp8kv":
        return (lambda: decode_fp8_kv(q, kv, causal=causal, path="kernel")), "FP8 KV cache, read as e4m3"
    if impl == "ours-fp8kv-copy":
        from llm_attn.ops import flash_attn_func

        def copy_then_ours():
            dk, dv = fp8_kv_dequantized(kv, q.dtype)
            return flash_attn_func(q, dk, dv, causal=causal, path="kernel")

        return copy_then_ours, "FP8 KV cache, dequantised copy per call"
    gqa = q.shape[1] != k.shape[1]
    is_causal = causal and q.shape[2] == k.shape[2] and q.shape[2] > 1

    def copy_then_sdpa():
        dk, dv = fp8_kv_dequantized(kv, q.dtype)
        return torch.nn.functional.scaled_dot_product_attention(q, dk, dv, is_causal=is_causal, enable_gqa=gqa)

    return copy_then_sdpa, "FP8 KV cache, dequantised copy per call"


def time_cuda(fns, warmup: int, repeats: int, graph: bool = False, max_calls_per_graph: int = 20) -> list[float]:
    """Milliseconds per call, one sample per repeat. `fns` rotate (different input sets) between calls.

    graph=True captures back-to-back calls (rotating inputs; as many as fit in ~2 ms, at most
    `max_calls_per_graph`) in one CUDA graph and reports replay time / calls: kernel time without Python, launch
    or graph-submission latency, for every implementation alike."""
    if graph:
        fns[0]()
        est = time_cuda(fns, 1, 3)
        calls_per_graph = max(1, min(max_calls_per_graph, int(2.0 / max(min(est), 1e-3))))
        replay = _graphed([fns[i % len(fns)] for i in range(calls_per_graph)])
        fns, per = [replay], calls_per_graph
    else:
        per = 1
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    samples = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i % len(fns)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / per)
    return samples


def _graphed(calls):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with graph_capture(g):
        for fn in calls:
            fn()
    return g.replay


def _inputs(b, hq, hkv, sq, sk, d, dtype, sets):
    out = []
    for _ in range(sets):
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        out.append((q, k, v))
    return out


def make_train_fn(impl: str, q, k, v, causal: bool, dout, phase: str, side_stream: bool = False):
    """Backward mode: 'fwd+bwd' runs the forward and autograd.grad of (q, k, v); 'bwd' only the latter, on a forward
    graph built once and retained. `side_stream`: that forward runs on a side stream (for CUDA-graph timing: autograd
    runs each backward op on its forward's stream, and one on the legacy default stream cannot be captured, for SDPA
    as for ours: cudaErrorStreamCaptureImplicit; H200, kernels/NOTES.md "Backward v4")."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fwd, note = make_fn(impl, q, k, v, causal)
    if phase == "fwd+bwd":
        return (lambda: torch.autograd.grad(fwd(), (q, k, v), dout)), note
    if side_stream and q.is_cuda:
        side = torch.cuda.Stream(device=q.device)
        side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):
            out = fwd()
        torch.cuda.current_stream(q.device).wait_stream(side)
    else:
        out = fwd()
    return (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)), note


def bench_point(mode, impls, b, hq, hkv, sq, sk, d, dtype, causal, warmup, repeats, graph=False, phase=None):
    """Time every impl on the same inputs; returns {impl: row}. A failing impl gets an error row, others go on."""
    elem = torch.finfo(dtype).bits // 8
    # Rotate input sets so that small shapes are not served from L2 between repeats (50 MB on H100).
    per_set = (b * hq * sq * d + 2 * b * hkv * sk * d) * elem
    sets = max(1, min(8, math.ceil(200e6 / per_set)))
    data = _inputs(b, hq, hkv, sq, sk, d, dtype, sets)
    flops = 4 * b * hq * sq * sk * d / (2 if causal and sq == sk else 1)
    if causal and 1 < sq < sk:  # a chunk over a longer cache, bottom-right: row i sees sk - sq + i + 1 keys
        flops = 4 * b * hq * (sq * (sk - sq) + sq * (sq + 1) // 2) * d
    flops *= {None: 1, "fwd+bwd": 3.5, "bwd": 2.5}[phase]
    douts = [torch.randn_like(q) for q, _, _ in data] if phase else None
    kv_bytes = 2 * b * hkv * sk * d * elem
    rows = {}
    ref = None
    for impl in impls:
        row = dict(mode=mode, impl=impl, batch=b, heads=hq, kv_heads=hkv, q_len=sq, kv_len=sk, head_dim=d,
                   dtype=str(dtype).removeprefix("torch."), causal=causal, graph=graph)
        if phase:
            row["phase"] = phase
        try:
            if phase:
                fns, note = zip(*(make_train_fn(impl, q, k, v, causal, g, phase, side_stream=graph)
                                  for (q, k, v), g in zip(data, douts)))
            elif impl in VENDOR_FP8_IMPLS:  # one input set: its quantised copies live on both sides of DLPack
                fns, note = zip(make_fn(impl, *data[0], causal))
            else:
                fns, note = zip(*(make_fn(impl, q, k, v, causal) for q, k, v in data))
            out0 = fns[0]()
            out0 = out0[0] if isinstance(out0, tuple) else out0  # backward: compare dq
            if ref is None:
                ref = out0
            row["max_abs_diff_vs_first"] = (out0.float() - ref.float()).abs().max().item()
            if impl in VENDOR_FP8_IMPLS:
                samples = fns[0].time_samples(warmup, repeats)
                row.update(graph=False, timing=f"wall clock, chains of {fns[0].chain} calls in one XLA program",
                           single_ms=fns[0].single_ms)
            else:
                samples = time_cuda(list(fns), warmup, repeats, graph=graph)
            ms = statistics.median(samples)
            read = kv_bytes // elem if impl in FP8_KV_IMPLS else kv_bytes  # the FP8 cache: one byte per element
            row.update(status="ok", note=note[0], ms=ms, ms_min=min(samples), samples_ms=samples,
                       tflops=flops / ms / 1e9, gbps=read / ms / 1e6, kv_bytes=read)
        except torch.cuda.OutOfMemoryError as e:
            row.update(status="oom", error=str(e).splitlines()[0])
        except Exception as e:  # noqa: BLE001 (a backend or registry entry that cannot take this shape/mode)
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            row.update(status="error", error=f"{type(e).__name__}: {msg}")
        rows[impl] = row
        torch.cuda.empty_cache()
    return rows


def _table_row(mode, rows, dt, causal, b, s, graph, phase=None):
    metric = "gbps" if mode == "decode" else "tflops"
    r = {"dtype": dt, "causal": causal, "B": b, "KV" if mode == "decode" else "S": s}
    if mode == "decode":
        r["graph"] = graph
    if phase:
        r["phase"] = phase
    # The time of our first variant in the run (``ours``, or ``ours-large`` when only forced tiles ran), else of the
    # first implementation: a column of NaN said nothing when ``ours`` itself was not asked for.
    first = next((i for i in rows if i.startswith("ours")), next(iter(rows), None))
    if first is not None:
        ms = rows[first].get("ms", float("nan"))
        r[f"{first} µs" if mode == "decode" else f"{first} ms"] = ms * 1e3 if mode == "decode" else ms
    for impl, row in rows.items():
        r[f"{impl} {'GB/s' if mode == 'decode' else 'TF/s'}"] = row.get(metric, row.get("status"))
    # Speed ratios of each of our variants against each reference backend: its ms / ours (>1: ours faster).
    for mine in (i for i in rows if i.startswith("ours")):
        for impl in (i for i in rows if not i.startswith("ours")):
            ratio = speed_ratio(rows[impl].get("ms"), rows[mine].get("ms"))
            if ratio is not None:
                r[ratio_header(impl, mine)] = ratio
    return r

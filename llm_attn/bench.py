"""Kernel benchmark: our FlashAttention kernel against PyTorch SDPA's backends, measured in the same run.

    python -m llm_attn.bench                                   # Llama 3 8B prefill shape, S = 512 .. 16384
    python -m llm_attn.bench --seqs 2048 4096 --dtypes bf16 --causal 1 --out bench.jsonl
    python -m llm_attn.bench --mode decode --kv 512 2048 8192 32768 --batch 1 4 16
    python -m llm_attn.bench --mode backward --seqs 1024 4096 16384     # training: forward+backward, backward alone
    python -m llm_attn.bench --impls ours flash cudnn naive flex numba --seqs 2048 8192   # registry entries too
    python -m llm_attn.bench --plugin examples/my_attention.py --impls ours mine

Prefill: B x 32 query heads over 8 KV heads, head_dim 128 (Llama 3 8B), q_len = kv_len = S. FLOPs = 4*B*Hq*S*S*D,
halved when causal; TFLOP/s from the median of CUDA-event timings after warm-up, inputs rotated among several
sets so that short shapes are not timed out of L2.
Prefill timings are replays of a captured CUDA graph of back-to-back calls over rotating inputs (up to 20,
~2 ms per replay), divided by their number
(kernel time: Python, launch and submission overhead removed for every implementation alike); `--graph 0` times
plain calls.
Decode: q_len = 1 against a KV cache of length S; GB/s counts K and V read once (2*B*Hkv*S*D*bytes), both as plain
launches and replayed inside a CUDA graph.
Backward: q_len = kv_len = S; two phases per point, "fwd+bwd" (forward, then autograd.grad of dq, dk, dv) and "bwd"
(autograd.grad alone on a retained forward graph); FLOPs 3.5x and 2.5x the forward's (the backward's five matmuls
against the forward's two). Plain calls by default (--graph 1 captures them in a CUDA graph).

Each row of the JSONL output carries the environment and the command that reproduces it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from contextlib import nullcontext

import torch
from tabulate import tabulate

from llm_attn import registry
from llm_attn.envinfo import environment
from llm_attn.harness.cli_args import add_plugin_argument, load_plugins

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BENCH_IMPLS = ["ours", "ours-large", "ours-wide", "ours-small", "ours-hopper", "flash", "cudnn", "efficient", "math"]


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
        from llm_attn import flash_attn_func

        return (lambda: flash_attn_func(q, k, v, causal=causal, path="kernel")), ""
    if impl.startswith("ours-"):  # ours with one prefill tile forced (kernel tuning); set for each call/capture
        from llm_attn import flash_attn_func
        from llm_attn.ops import force_tile

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
    with torch.cuda.graph(g):
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


def make_train_fn(impl: str, q, k, v, causal: bool, dout, phase: str):
    """Backward mode: 'fwd+bwd' runs the forward and autograd.grad of (q, k, v); 'bwd' only the latter, on a forward
    graph built once and retained."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fwd, note = make_fn(impl, q, k, v, causal)
    if phase == "fwd+bwd":
        return (lambda: torch.autograd.grad(fwd(), (q, k, v), dout)), note
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
                fns, note = zip(*(make_train_fn(impl, q, k, v, causal, g, phase) for (q, k, v), g in zip(data, douts)))
            else:
                fns, note = zip(*(make_fn(impl, q, k, v, causal) for q, k, v in data))
            out0 = fns[0]()
            out0 = out0[0] if isinstance(out0, tuple) else out0  # backward: compare dq
            if ref is None:
                ref = out0
            row["max_abs_diff_vs_first"] = (out0.float() - ref.float()).abs().max().item()
            samples = time_cuda(list(fns), warmup, repeats, graph=graph)
            ms = statistics.median(samples)
            row.update(status="ok", note=note[0], ms=ms, ms_min=min(samples), samples_ms=samples,
                       tflops=flops / ms / 1e9, gbps=kv_bytes / ms / 1e6)
        except torch.cuda.OutOfMemoryError as e:
            row.update(status="oom", error=str(e).splitlines()[0])
        except Exception as e:  # noqa: BLE001 (a backend or registry entry that cannot take this shape/mode)
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            row.update(status="error", error=f"{type(e).__name__}: {msg}")
        rows[impl] = row
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    load_plugins(argv, "python -m llm_attn.bench")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plugin_argument(p)
    p.add_argument("--mode", choices=["prefill", "decode", "backward"], default="prefill")
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384],
                   help="prefill: q_len = kv_len = S")
    p.add_argument("--kv", type=int, nargs="+", default=[512, 2048, 8192, 32768], help="decode: KV cache lengths")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["bf16", "fp16"])
    p.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    entries = [n for n in registry.names() if n != "llm_attn"]  # llm_attn is 'ours' here
    p.add_argument("--impls", nargs="+", default=["ours", "flash", "cudnn", "efficient"],
                   choices=BENCH_IMPLS + entries,
                   help="ours-<tile>: our kernel with that prefill tile forced (tuning; 'ours' picks automatically); "
                        "flash/cudnn/efficient/math: SDPA backends; any other name: that attention-registry entry's "
                        f"function ({', '.join(entries)}; --plugin adds more)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--graph", type=int, nargs="+", choices=[0, 1], default=None,
                   help="1: time replays of a captured CUDA graph (kernel time without Python/launch overhead); "
                        "0: plain calls (default: prefill 1, decode 0 and 1)")
    p.add_argument("--out", help="append JSONL rows here")
    args = p.parse_args(argv)
    for name in ("seqs", "kv", "batch"):
        if any(x <= 0 for x in getattr(args, name)):
            p.error(f"--{name} values must be positive")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    try:  # --out is opened before anything is measured: a bad path is an argument error
        out = open(args.out, "a") if args.out else nullcontext()  # noqa: SIM115 (closed by the with below)
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror or e}")
    if not torch.cuda.is_available():
        p.error("the kernel benchmark needs a CUDA GPU")
    graphs = args.graph if args.graph is not None else {"decode": [0, 1], "prefill": [1], "backward": [0]}[args.mode]
    phases = ["fwd+bwd", "bwd"] if args.mode == "backward" else [None]

    env = environment()
    command = "python -m llm_attn.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    table = []
    with out as f:
        for dt in args.dtypes:
            for causal in args.causal:
                for b in args.batch:
                    lengths = args.kv if args.mode == "decode" else args.seqs
                    for s, graph, phase in ((s, g, ph) for s in lengths for g in graphs for ph in phases):
                        sq = 1 if args.mode == "decode" else s
                        rows = bench_point(args.mode, args.impls, b, args.heads, args.kv_heads, sq, s,
                                           args.head_dim, DTYPES[dt], bool(causal), args.warmup, args.repeats,
                                           graph=bool(graph), phase=phase)
                        for row in rows.values():
                            row.update(env=env, command=command)
                            if f:
                                try:
                                    f.write(json.dumps(row) + "\n")
                                    f.flush()
                                except OSError as e:  # e.g. the disk is full
                                    with contextlib.suppress(OSError):
                                        f.close()  # closes even when the buffered line cannot be flushed
                                    p.exit(2, f"{p.prog}: error: --out {args.out}: cannot write: "
                                              f"{e.strerror or e}\n")
                        table.append(_table_row(args.mode, rows, dt, causal, b, s, graph, phase))
                        print(_fmt_last(table), flush=True)
    headers = list(table[0].keys())
    print()
    print(tabulate([list(r.values()) for r in table], headers=headers, floatfmt=".2f"))


def _table_row(mode, rows, dt, causal, b, s, graph, phase=None):
    metric = "gbps" if mode == "decode" else "tflops"
    r = {"dtype": dt, "causal": causal, "B": b, "KV" if mode == "decode" else "S": s}
    if mode == "decode":
        r["graph"] = graph
    if phase:
        r["phase"] = phase
    ours = rows.get("ours", {})
    r["ours ms"] = ours.get("ms", float("nan")) if mode != "decode" else ours.get("ms", float("nan")) * 1e3
    if mode == "decode":
        r["ours µs"] = r.pop("ours ms")
    for impl, row in rows.items():
        r[f"{impl} {'GB/s' if mode == 'decode' else 'TF/s'}"] = row.get(metric, row.get("status"))
    # Speed ratios (>1: ours faster) of each of our variants against each reference backend.
    for mine in (i for i in rows if i.startswith("ours")):
        for impl in (i for i in rows if not i.startswith("ours")):
            if rows[impl].get("ms") and rows[mine].get("ms"):
                r[f"{mine}/{impl}"] = rows[impl]["ms"] / rows[mine]["ms"]
    return r


def _fmt_last(table):
    r = table[-1]
    return "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())


if __name__ == "__main__":
    main()

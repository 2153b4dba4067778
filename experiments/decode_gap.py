"""Where does a short decode call's time go? Ours against SDPA cuDNN at the shapes still short of it (issue 19).

    python experiments/decode_gap.py                                   # graph-timed µs per call, interleaved
    ncu --nvtx --nvtx-include "decode_gap/" --csv --page raw --metrics <list> \\
        python experiments/decode_gap.py --ncu-pass > ncu.csv           # one eager call per (shape, impl)
    python experiments/decode_gap.py --parse-ncu ncu.csv               # kernel time per call next to graph time

Timing: for each (B, KV) (q_len 1, 32 query / 8 KV heads, head_dim 128, bf16), CUDA graphs of back-to-back calls over
inputs rotated past L2 (the harness's kernel_bench helpers), every implementation once per round in a shuffled order:
ours as shipped (split-KV with the fused combine, the counter memset node before it), ours forced to one split (no
memset, no combine: one block per (batch, KV head) streams the whole cache), SDPA cuDNN and SDPA flash.

ncu pass: each implementation once per shape, eagerly, inside an NVTX range ``decode_gap``, each call preceded by a
marker kernel (``torch.cuda._sleep``); ncu flushes caches before each kernel, so every read comes from DRAM.
``--parse-ncu`` splits the profiled kernels at the markers, maps them back to (shape, impl) and prints, per call, the sum of its kernels' durations; graph µs per call minus that sum is the time
between kernels (launch, graph-node dependency and, for ours, the memset node), which ncu does not see.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
IMPLS = ("ours", "ours-1split", "cudnn", "flash")


def _fns(torch, impl, data):
    from llm_attn.harness.kernel_bench import make_fn
    from llm_attn.ops import force_decode

    if impl == "ours-1split":
        def one(q, k, v):
            f = make_fn("ours", q, k, v, False)[0]

            def call():
                with force_decode(1, "Deep"):
                    return f()
            return call
        return [one(*d) for d in data]
    return [make_fn(impl, q, k, v, False)[0] for q, k, v in data]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--kv", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ncu-pass", action="store_true", help="one eager call per (shape, impl) in an NVTX range, for ncu")
    p.add_argument("--parse-ncu", metavar="CSV", help="ncu --csv --page raw output of the --ncu-pass run")
    p.add_argument("--timing", metavar="JSON", help="(with --parse-ncu) this script's timing output, for the gap")
    p.add_argument("--out", help="write the timing rows as JSON here")
    p.add_argument("--order", default="/tmp/decode_gap_order.json",
                   help="the ncu pass writes its calls' (shape, impl) order here; --parse-ncu reads it")
    args = p.parse_args(argv)
    if args.parse_ncu:
        return _parse(Path(args.parse_ncu), Path(args.order), Path(args.timing) if args.timing else None)

    import torch

    from llm_attn.harness.kernel_bench import _graphed, _inputs, time_cuda

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dtype = torch.bfloat16
    rng = random.Random(0)
    rows, order = [], []
    for b in args.batch:
        for kv in args.kv:
            per_set = 2 * (b * HEADS * HEAD_DIM + 2 * b * KV_HEADS * kv * HEAD_DIM)
            sets = 1 if args.ncu_pass else max(2, min(12, math.ceil(400e6 / per_set)))
            data = _inputs(b, HEADS, KV_HEADS, 1, kv, HEAD_DIM, dtype, sets)
            fns = {impl: _fns(torch, impl, data) for impl in IMPLS}
            ref = fns["flash"][0]().float()
            for impl in IMPLS:  # every path computes the same thing before anything is timed
                err = (fns[impl][0]().float() - ref).abs().max().item()
                if not err < 2e-2:
                    raise SystemExit(f"{impl} B={b} KV={kv}: max |diff| vs SDPA flash {err}")
            if args.ncu_pass:
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("decode_gap")
                for impl in IMPLS:
                    torch.cuda._sleep(1)  # the marker: every kernel up to the next one belongs to this call
                    fns[impl][0]()
                    order.append(dict(batch=b, kv_len=kv, impl=impl))
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                continue
            calls = 20
            replays = {impl: _graphed([f[i % len(f)] for i in range(calls)]) for impl, f in fns.items()}
            samples = {impl: [] for impl in IMPLS}
            for r in range(args.rounds):
                names = list(IMPLS)
                rng.shuffle(names)
                for impl in names:
                    samples[impl] += [x / calls * 1e3 for x in time_cuda([replays[impl]], 1 if r == 0 else 0, 3)]
            kv_bytes = 2 * b * KV_HEADS * kv * HEAD_DIM * 2
            row = dict(batch=b, kv_len=kv, calls_per_graph=calls,
                       us={i: statistics.median(s) for i, s in samples.items()}, samples_us=samples)
            row["gbps"] = {i: kv_bytes / (u * 1e3) for i, u in row["us"].items()}
            rows.append(row)
            print(f"B={b:<2} KV={kv:<6} " + "  ".join(f"{i} {row['us'][i]:6.2f} µs ({row['gbps'][i]:5.0f} GB/s)"
                                                      for i in IMPLS), flush=True)
            del replays
            torch.cuda.empty_cache()
    if args.ncu_pass:
        Path(args.order).write_text(json.dumps(order))
        return 0
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


def _parse(path: Path, order_path: Path, timing: Path | None) -> int:
    order = json.loads(order_path.read_text())
    text = path.read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (\"ID\",...) found")
    reader = csv.DictReader(text[start:])
    kernels = [r for r in reader if r.get("ID", "").isdigit()]
    by_call: list[list[dict]] = []
    for k in kernels:
        if "sleep" in k.get("Kernel Name", "").lower() or "spin" in k.get("Kernel Name", "").lower():
            by_call.append([])
        elif by_call:
            by_call[-1].append(k)
    if len(by_call) != len(order):
        raise SystemExit(f"{path}: {len(by_call)} marked calls, {len(order)} expected (ncu --nvtx-include decode_gap/?)")
    timing_rows = {}
    if timing:
        for row in json.loads(timing.read_text())["rows"]:
            timing_rows[(row["batch"], row["kv_len"])] = row["us"]
    print("| B | KV | impl | kernels (ncu) | kernel µs | DRAM % peak | graph µs/call | graph − kernel µs |")
    print("|---|---|---|---|---|---|---|---|")
    for o, ks in zip(order, by_call):
        dur = sum(_num(k.get("gpu__time_duration.sum")) for k in ks) / 1e3  # ns -> µs
        dram = max((_num(k.get("dram__throughput.avg.pct_of_peak_sustained_elapsed")) for k in ks), default=0.0)
        names = ", ".join(dict.fromkeys(_short(k.get("Kernel Name", "?")) for k in ks))
        g = timing_rows.get((o["batch"], o["kv_len"]), {}).get(o["impl"])
        gap = f"{g - dur:.2f}" if g is not None else ""
        print(f"| {o['batch']} | {o['kv_len']} | {o['impl']} | {names} | {dur:.2f} | {dram:.0f} | "
              f"{'' if g is None else f'{g:.2f}'} | {gap} |")
    return 0


def _short(name: str) -> str:
    """A kernel's name without its return type, template arguments, parameters or namespaces."""
    depth, out = 0, []
    for ch in name.split("(")[0]:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).split()[-1].split("::")[-1]


def _num(x) -> float:
    try:
        return float(str(x).replace(",", ""))
    except (TypeError, ValueError):
        return 0.0


if __name__ == "__main__":
    sys.exit(main())

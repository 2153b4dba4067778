"""A/B kernel timing: two or more variants of our kernel (other builds, or tuning switches read from the
environment) at the same shapes, in alternating processes, with a reference backend timed inside every process.

    # before/after a kernel change: two installed copies of the package (e.g. the carried extension and a new build)
    python experiments/kernel_ab.py --variant before:PYTHONPATH=/tmp/before --variant after:PYTHONPATH=/tmp/after \
        --shape 1,32,8,128,8192,128,1 --shape 1,32,8,128,8192,128,0
    # a tuning switch of one build
    python experiments/kernel_ab.py --variant c2:LLM_ATTN_SM90_CONSUMERS=2 --variant c3:LLM_ATTN_SM90_CONSUMERS=3 \
        --shape 4,32,32,4096,4096,64,1 --ref cudnn
    # the backward (dq, dk, dv compared; a different tiling sums in another order: give --atol)
    python experiments/kernel_ab.py --phase bwd --ref flash --atol 0.05 --variant before:... --variant after:... \
        --shape 1,32,8,8192,8192,128,1

A shape is batch,heads,kv_heads,q_len,kv_len,head_dim,causal. Each round runs every variant once (a fresh
process, the order rotated each round); a process times every shape and dtype (CUDA graphs of back-to-back calls,
median of --repeats replays; llm_attn.harness.kernel_bench.bench_point, as `python -m llm_attn.bench` does) for our
kernel and for --ref. The table gives, per shape, each variant's median ms over the rounds, its ratio to the first
variant (median and min-max over the rounds, paired by round: the variants of one round ran back to back), and
ours/--ref where the reference computes the same thing (SDPA's causal mask is top-left aligned: compared only for
q_len == kv_len or non-causal). Variants must compute the same result: the largest |difference| between a variant's
output and the first variant's is checked per shape (--atol).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # last: a variant's PYTHONPATH (another copy of the package) comes first

DTYPES = ("bf16", "fp16")


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: integers batch,heads,kv_heads,q_len,kv_len,head_dim,causal")
    if len(vals) != 7 or min(vals[:6]) < 1 or vals[6] not in (0, 1) or vals[1] % vals[2]:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: batch,heads,kv_heads,q_len,kv_len,head_dim,causal (positive; heads a multiple of "
            "kv_heads; causal 0 or 1)")
    return vals


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"variant {text!r}: NAME[:KEY=VALUE,...]")
        env[key] = val
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: NAME[:KEY=VALUE,...]")
    return name, env


def worker(args) -> None:
    """One process: every shape x dtype, ours and the reference; one JSON line per point on stdout."""
    import torch

    from llm_attn.harness.kernel_bench import bench_point

    for b, hq, hkv, sq, sk, d, causal in args.shape:
        for dt in args.dtypes:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
            torch.manual_seed(0)
            bwd = args.phase == "bwd"
            rows = bench_point("backward" if bwd else "prefill", ["ours"] + ([args.ref] if args.ref else []), b, hq,
                               hkv, sq, sk, d, dtype, bool(causal), args.warmup, args.repeats, graph=args.graph,
                               phase="bwd" if bwd else None)
            torch.manual_seed(0)
            q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, requires_grad=bwd)
            k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, requires_grad=bwd)
            v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, requires_grad=bwd)
            from llm_attn.ops import flash_attn_func

            def call():
                o = flash_attn_func(q, k, v, causal=bool(causal), path="kernel")  # noqa: B023
                if not bwd:
                    return o
                # The backward's outputs, compared between variants: dq, dk, dv (their heads concatenated).
                grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o) / o.shape[-1])  # noqa: B023
                return torch.cat([g.flatten()[:1366] for g in grads])

            out = call()
            kernels = _kernel_names(call)
            point = {"shape": [b, hq, hkv, sq, sk, d, causal], "dtype": dt, "kernels": kernels,
                     "out_sum": out.double().sum().item(), "out_abs": out.double().abs().sum().item(),
                     "out_head": out.flatten()[:4096].float().tolist()}
            for impl, row in rows.items():
                point[impl if impl == "ours" else "ref"] = {k: row.get(k) for k in ("status", "ms", "error")}
            print(json.dumps(point), flush=True)


def _kernel_names(fn) -> list[str]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def run_variant(args, env_mod: dict[str, str]) -> list[dict]:
    env = dict(os.environ)
    for key, val in env_mod.items():
        env[key] = f"{val}:{env[key]}" if key == "PYTHONPATH" and env.get(key) else val
    cmd = [sys.executable, __file__, "--worker", "--phase", args.phase, "--graph", str(args.graph),
           "--dtypes", *args.dtypes, "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    cmd += ["--ref", args.ref] if args.ref else []
    for s in args.shape:
        cmd += ["--shape", ",".join(map(str, s))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"kernel_ab: variant {env_mod} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def summarise(results: list[dict[str, dict]], names: list[str], ref: str, atol: float):
    """(markdown table, mismatches, kernels per variant) from results[round][variant][(shape, dtype)] = point."""
    from tabulate import tabulate

    from llm_attn.harness.stats import ratio_header, speed_ratio

    first = names[0]
    rows, bad = [], []
    for key in results[0][first]:
        shape, dt = key
        row = [",".join(map(str, shape)), dt]
        base = [rnd[first][key]["ours"]["ms"] for rnd in results]
        for name in names:
            pts = [rnd[name][key] for rnd in results]
            ms = [p["ours"]["ms"] for p in pts]
            if any(m is None for m in ms) or any(b is None for b in base):
                row += [f"error: {pts[0]['ours'].get('error')}", "", ""]
                continue
            head, head0 = pts[0]["out_head"], results[0][first][key]["out_head"]
            diff = max(abs(a - b) for a, b in zip(head, head0))
            if not diff <= atol or any(x != x for x in head):  # NaN anywhere: a mismatch
                bad.append(f"{name} {row[0]} {dt}: output differs from {first} by {diff:.3g}")
            ratios = [speed_ratio(b, m) for b, m in zip(base, ms)]  # > 1: this variant is faster than the first
            refs = [p.get("ref", {}).get("ms") for p in pts]
            same_work = shape[6] == 0 or shape[3] == shape[4]
            vs_ref = (f"{statistics.median([speed_ratio(x, m) for x, m in zip(refs, ms)]):.3f}"
                      if same_work and all(refs) else "-")
            speed = "" if name == first else (f"{statistics.median(ratios):.3f} "
                                              f"({min(ratios):.3f}-{max(ratios):.3f})")
            row += [f"{statistics.median(ms) * 1e3:.1f}", speed, vs_ref]
        rows.append(row)
    headers = ["shape b,hq,hkv,sq,sk,d,causal", "dtype"]
    for name in names:
        headers += [f"{name} µs", f"{name} {ratio_header(first)}", f"{name} {ratio_header(ref or 'ref')}"]
    kernels = {name: sorted({k for rnd in results for p in rnd[name].values() for k in p["kernels"]}) for name in names}
    return tabulate(rows, headers=headers, tablefmt="github"), bad, kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python experiments/kernel_ab.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", type=parse_variant, default=[],
                    help="NAME[:KEY=VALUE,...]: environment changes of this variant's processes (PYTHONPATH is "
                         "prepended); give two or more")
    ap.add_argument("--shape", action="append", type=parse_shape, required=True,
                    help="batch,heads,kv_heads,q_len,kv_len,head_dim,causal (repeatable)")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bf16"])
    ap.add_argument("--ref", default="cudnn", help="a `python -m llm_attn.bench` impl timed in every process "
                                                   "('' for none)")
    ap.add_argument("--phase", choices=["fwd", "bwd"], default="fwd",
                    help="fwd: the forward (CUDA graphs); bwd: the backward alone on a retained forward graph (plain "
                         "calls, as `python -m llm_attn.bench --mode backward`), dq/dk/dv compared between variants")
    ap.add_argument("--graph", type=int, choices=[0, 1], default=None,
                    help="1: time replays of a captured CUDA graph of back-to-back calls, 0: plain calls (default: 1 "
                         "for fwd, 0 for bwd, as `python -m llm_attn.bench`)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--atol", type=float, default=0.0, help="largest |output difference| allowed between variants "
                                                            "(default 0: the same bits)")
    ap.add_argument("--out", type=Path, help="write every process's points as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.graph is None:
        args.graph = int(args.phase == "fwd")
    if args.rounds < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--rounds and --repeats must be at least 1, --warmup at least 0")
    if args.worker:
        worker(args)
        return 0
    if len(args.variant) < 2:
        ap.error("give two or more --variant")
    names = [n for n, _ in args.variant]
    if len(set(names)) != len(names):
        ap.error("variant names must differ")

    # results[round][variant] = {(shape, dtype): point}
    results: list[dict[str, dict]] = []
    for r in range(args.rounds):
        order = args.variant[r % len(args.variant):] + args.variant[:r % len(args.variant)]
        this = {}
        for name, env_mod in order:
            this[name] = {(tuple(p["shape"]), p["dtype"]): p for p in run_variant(args, env_mod)}
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)
        results.append(this)
    if args.out:
        slim = [{name: [{k: v for k, v in p.items() if k != "out_head"} for p in points.values()]
                 for name, points in rnd.items()} for rnd in results]
        args.out.write_text(json.dumps({"variants": [[n, e] for n, e in args.variant], "rounds": slim}, indent=1))

    table, bad, kernels = summarise(results, names, args.ref, args.atol)
    print(table)
    for name in names:
        print(f"{name}: {len(kernels[name])} kernels: " + "; ".join(k[:110] for k in kernels[name]))
    for line in bad:
        print("MISMATCH", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where an eager backward call's host time goes (issue 39 item 1): ours against SDPA's backends, one GPU run.

    python experiments/backward_host.py --out $OUT/backward_host.json
    python experiments/backward_host.py --seqs 512 2048 --impls ours flash cudnn --profile ours

For each shape (B=1, 32/8 heads, hd128 by default; causal and not) and implementation it builds the forward graph
once (``llm_attn.harness.kernel_bench.make_train_fn``, phase 'bwd': ``autograd.grad`` on a retained graph, as `python
-m llm_attn.bench --mode backward --graph 0` times it; ``--phase fwd+bwd``: the forward with gradients wanted and its
backward, what a training step pays per attention call) and measures, in interleaved rounds:

- enqueue: host microseconds per backward call while the GPU is kept busy (N calls back to back, the clock read
  before the final synchronize): what Python, autograd, the dispatcher and the launches cost;
- wall: microseconds per call to the synchronize (what an eager training step pays when the host is the bound);
- kernel: microseconds per call replayed from a CUDA graph (the GPU's own time).

When enqueue > kernel the call is host-bound. ``--profile IMPL`` also prints torch.profiler's CPU table (self time
per op, top 20) for that implementation at the first shape: the list of launches, allocations and Python-side ops
one call makes. ``--cprofile IMPL`` prints cProfile's table (the Python functions, cumulative time, top 30) of 200
calls of that implementation at the first shape: where the Python of the NVRTC build's calls goes
(``LLM_ATTN_BUILD=nvrtc``). Rows go to --out as JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

import torch

import llm_attn
from llm_attn.harness.kernel_bench import make_train_fn, time_cuda


def enqueue_and_wall(fn, calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--impls", nargs="+", default=["ours", "flash", "cudnn"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    ap.add_argument("--causal", type=int, nargs="+", default=[1, 0], choices=[0, 1])
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per sample")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--phase", default="bwd", choices=["bwd", "fwd+bwd"],
                    help="bwd: the backward on a retained forward graph; fwd+bwd: forward with gradients and backward")
    ap.add_argument("--profile", default="", help="print torch.profiler's CPU table for this impl (first shape)")
    ap.add_argument("--cprofile", default="", help="print cProfile's table of 200 calls of this impl (first shape)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("backward_host.py: needs a CUDA GPU")
    dtype = torch.bfloat16
    rows = []
    for s in args.seqs:
        for causal in args.causal:
            torch.manual_seed(0)
            q = torch.randn(args.batch, args.heads, s, args.head_dim, device="cuda", dtype=dtype)
            k = torch.randn(args.batch, args.kv_heads, s, args.head_dim, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            dout = torch.randn_like(q)
            fns = {impl: make_train_fn(impl, q, k, v, bool(causal), dout, args.phase, side_stream=True)[0]
                   for impl in args.impls}
            samples = {impl: {"enqueue": [], "wall": []} for impl in args.impls}
            for fn in fns.values():
                enqueue_and_wall(fn, 5)  # warm up
            for _ in range(args.rounds):
                order = list(args.impls)
                random.shuffle(order)
                for impl in order:
                    e, w = enqueue_and_wall(fns[impl], args.calls)
                    samples[impl]["enqueue"].append(e)
                    samples[impl]["wall"].append(w)
            for impl in args.impls:
                kernel = statistics.median(time_cuda([fns[impl]], 3, 10, graph=True)) * 1e3
                row = {"seq": s, "causal": causal, "impl": impl, "phase": args.phase, "batch": args.batch,
                       "heads": args.heads, "build": llm_attn.kernel_build() if impl.startswith("ours") else "",
                       "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16",
                       "enqueue_us": statistics.median(samples[impl]["enqueue"]),
                       "wall_us": statistics.median(samples[impl]["wall"]), "kernel_us": kernel,
                       "samples": samples[impl]}
                rows.append(row)
                print(f"S={s:6d} causal={causal} {impl:6s} enqueue {row['enqueue_us']:7.1f} us  wall "
                      f"{row['wall_us']:7.1f} us  kernel (graph) {kernel:7.1f} us", flush=True)
            if args.profile and s == args.seqs[0] and causal == args.causal[0]:
                from torch.profiler import ProfilerActivity, profile

                fn = fns[args.profile]
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
            if args.cprofile and s == args.seqs[0] and causal == args.causal[0]:
                fn = fns[args.cprofile]
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                print(f"cProfile, {args.cprofile} ({args.phase}), 200 calls; per call = cumtime / 200:")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f)


if __name__ == "__main__":
    main()

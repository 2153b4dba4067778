"""Where does a decode token's time go with stock sdpa vs llm_attn? torch.profiler over model.generate.

    python experiments/profile_decode.py --model tiny:fp16 --seq 512 --new-tokens 16
    python experiments/profile_decode.py                        # the default model (GPU: Llama 3 8B AWQ)

Prints, per implementation: wall ms/token, and the CPU-side calls that matter for run-ahead (synchronisations,
host<->device copies, kernel launches) per token, plus the top CPU ops; with ``--cprofile N`` also the N Python
functions with the most own time per token (cProfile over one generate), which is where host time goes when decode
is host-bound. A host synchronisation per step means
the CPU can no longer queue work while the GPU runs, so Python overhead and GPU time add up instead of overlapping.
"""

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from llm_attn.harness.impls import use_impl
from llm_attn.models import load_model

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
            "cudaLaunchKernel", "cudaMemsetAsync", "cudaFuncSetAttribute", "aten::item", "aten::_local_scalar_dense")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="auto")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--impls", nargs="+", default=["sdpa", "llm_attn"])
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N Python functions with the most "
                   "own time per token (cProfile over one generate)")
    args = p.parse_args()
    model, info = load_model(args.model)
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device=dev)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    for impl in args.impls:
        with use_impl(model, impl), torch.no_grad():
            model.generate(ids, **kw)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            per_token = ((t2 - t1) - (t1 - t0)) / (args.new_tokens - 1) * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.generate(ids, **kw)
                torch.cuda.synchronize()
            if args.cprofile:
                cprof = cProfile.Profile()
                cprof.runcall(model.generate, ids, **kw)
                torch.cuda.synchronize()
        ev = {e.key: e for e in prof.key_averages()}
        n = args.new_tokens
        print(f"\n== {impl}: {per_token:.2f} ms/token after the first (wall, {info.name} {info.quant})")
        print("   per token: " + ", ".join(f"{k} {ev[k].count / n:.1f}" for k in SYNC_OPS if k in ev))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        if args.cprofile:
            print(f"   Python functions by own time per token (cProfile; µs, calls):")
            stats = pstats.Stats(cprof).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
            top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.cprofile]
            for (file, line, name), (_, calls, tottime, cumtime, _) in top:
                print(f"   {tottime / n * 1e6:9.1f} {calls / n:7.1f}  {name} ({file.rsplit('/', 2)[-1]}:{line})")


if __name__ == "__main__":
    main()

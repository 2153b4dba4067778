"""Where a chunked prefill's extra time goes (issue 38: chunked TTFT within 5 % of unchunked).

    python experiments/chunk_account.py --seq 131072 --chunk 8192 --cases fp16 fp16:8192 fp8:8192 fp8-copy:8192

Loads the default model once (on a GPU the synthetic Llama 3 8B AWQ), patches it with ``--impl``, and for each case
(``cache[:chunk]``; ``fp8`` is the FP8 cache read in place, ``LLM_ATTN_FP8KV_PREFILL=kernel``, and ``fp8-copy``
through its copy, ``=copy``) times ``--repeats``
prefills with CUDA events, the cases taking turns, then profiles one prefill per case (``profile_device``). It
prints TTFT, busy time and peak memory per case, then the kernels whose summed time differs most from the first
case: the itemised account of chunking's cost. ``--out`` keeps everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


def _parse_case(text: str) -> tuple[str, int | None]:
    cache, _, chunk = text.partition(":")
    if cache not in ("fp16", "fp8", "fp8-copy"):
        raise argparse.ArgumentTypeError(f"cache must be fp16, fp8 or fp8-copy, got {cache!r}")
    if chunk and (not chunk.isdigit() or int(chunk) <= 0):
        raise argparse.ArgumentTypeError(f"chunk must be a positive integer, got {chunk!r}")
    return cache, int(chunk) if chunk else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/chunk_account.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="auto")
    p.add_argument("--impl", default="llm_attn")
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--cases", type=_parse_case, nargs="+",
                   default=[("fp16", None), ("fp16", 8192), ("fp8-copy", 8192)])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (CUDA events and the device profile)")

    from llm_attn.harness.measure import device_busy_ms, device_kernels_of, prefill_first_token
    from llm_attn.models import load_model
    from llm_attn.patches import patch_model, unpatch_model

    model, info = load_model(args.model, device="cuda", dtype=torch.float16)
    if args.impl != "sdpa":
        patch_model(model, impl=args.impl)
    print(f"model: {info.name} ({info.quant}), impl {args.impl}, {args.seq} tokens", flush=True)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)).cuda()

    def run(case):
        cache, chunk = case
        os.environ["LLM_ATTN_FP8KV_PREFILL"] = "copy" if cache == "fp8-copy" else "kernel"  # fp8: read in place
        if args.impl != "sdpa":  # the FP8 reader reads the variable once per patch: patch anew
            unpatch_model(model)
            patch_model(model, impl=args.impl)
        return prefill_first_token(model, ids, chunk=chunk, kv_cache="fp16" if cache == "fp16" else "fp8")

    names = [f"{c}:{k}" if k else c for c, k in args.cases]
    times = {n: [] for n in names}
    peaks = {n: 0 for n in names}
    with torch.inference_mode():
        for case in args.cases:  # warm-up: every kernel compiled / autotuned once
            run(case)
        for rep in range(args.repeats):
            order = list(zip(names, args.cases))
            for name, case in (order if rep % 2 == 0 else order[::-1]):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(case)
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b))
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
        profiles = {}
        for name, case in zip(names, args.cases):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run(case)
                torch.cuda.synchronize()
            ev = prof.events()
            profiles[name] = {"busy_ms": device_busy_ms(ev), "kernels": device_kernels_of(ev)}

    base = names[0]
    print("\n| case | TTFT ms (median) | TTFT / first case's (> 1 = slower) | busy ms | peak GiB |")
    print("|---|---|---|---|---|")
    med = {n: statistics.median(times[n]) for n in names}
    for n in names:
        print(f"| {n} | {med[n]:.0f} | {med[n] / med[base]:.3f} | {profiles[n]['busy_ms']:.0f} | "
              f"{peaks[n] / 2**30:.2f} |")
    for n in names[1:]:
        by = {}
        for which in (base, n):
            for k in profiles[which]["kernels"]:
                by.setdefault(k["name"], {base: (0, 0.0), n: (0, 0.0)})[which] = (k["launches"], k["ms"])
        rows = sorted(by.items(), key=lambda kv: -abs(kv[1][n][1] - kv[1][base][1]))[:args.top]
        print(f"\n{n} against {base}: kernels by change of summed time")
        print(f"| kernel | {base} ms (launches) | {n} ms (launches) | change ms |")
        print("|---|---|---|---|")
        for name, v in rows:
            print(f"| {name[:90]} | {v[base][1]:.1f} ({v[base][0]}) | {v[n][1]:.1f} ({v[n][0]}) | "
                  f"{v[n][1] - v[base][1]:+.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": info.name, "impl": args.impl, "seq": args.seq, "times_ms": times,
                       "peak_bytes": peaks, "device": torch.cuda.get_device_name(),
                       "profiles": {n: {"busy_ms": v["busy_ms"], "kernels": v["kernels"][:80]}
                                    for n, v in profiles.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

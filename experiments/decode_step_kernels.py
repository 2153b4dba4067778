"""Where one kernel-limited decode step's device time goes, per KV cache format: the fp16 StaticCache against the FP8
cache (``Fp8StaticCache(device_position=True)``), llm_attn's attention, the same context.

    python experiments/decode_step_kernels.py --context 32768 131040 --caches fp16 fp8

For each (context, cache): the step replayed from a CUDA graph (median ms over ``--steps`` back-to-back replays,
as ``--measure decode_graph`` times it), then ``--profiled`` eager steps under torch.profiler, their device time per
step split into attention (llm_attn's decode kernels), the FP8 cache's append, GEMMs and the rest, and the kernels
by time. The graph time minus the device-busy time is what the graph still waits for. The context is filled as
``measure_decode_static(context=...)`` fills it (the prompt's keys repeated); the step times do not depend on the
values.
"""

import argparse
import re
import statistics

import torch

from llm_attn.harness.breakdown import GEMM_KERNEL
from llm_attn.harness.graphs import graph_capture
from llm_attn.harness.impls import use_impl
from llm_attn.harness.measure import (ATTENTION_KERNEL, _extend_static_cache, cache_kwarg, device_kernels_of,
                                      prefill_first_token)
from llm_attn.models import load_model
from llm_attn.models.kv_cache import Fp8StaticCache
from transformers import StaticCache

APPEND = re.compile(r"fp8_cache_append", re.I)


def classify(name: str) -> str:
    if APPEND.search(name):
        return "append"
    if ATTENTION_KERNEL.search(name):
        return "attention"
    if GEMM_KERNEL.search(name):
        return "gemm"
    return "other"


def one(model, prompt: torch.Tensor, context: int, cache_kind: str, steps: int, profiled: int) -> dict:
    dev = prompt.device
    max_len = context + steps + profiled + 8
    cache = (Fp8StaticCache(config=model.config, max_cache_len=max_len, device_position=True) if cache_kind == "fp8"
             else StaticCache(config=model.config, max_cache_len=max_len))
    with torch.inference_mode():
        first, _ = prefill_first_token(model, prompt, cache=cache)
        cur = first.view(1, 1).clone()
        _extend_static_cache(cache, prompt.shape[1], context)

        def step():
            out = model(input_ids=cur, **cache_kwarg(model, cache), use_cache=True)
            cur.copy_(out.logits[:, -1, :].argmax(dim=-1, keepdim=True))

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            step()
        # Back to back, one event pair a replay and one synchronisation at the end, as measure_decode_static times
        # a decode_graph run (a synchronisation after each replay would add the graph launch's latency).
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for s, e in events:
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize(dev)
        times = [s.elapsed_time(e) for s, e in events]
        del graph
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                step()
            torch.cuda.synchronize(dev)
    kernels = device_kernels_of(prof.events())
    split: dict[str, float] = {}
    for k in kernels:
        split[classify(k["name"])] = split.get(classify(k["name"]), 0.0) + k["ms"] / profiled
    return {"graph_ms": statistics.median(times), "split": split, "busy_ms": sum(split.values()),
            "kernels": [{**k, "ms": k["ms"] / profiled, "launches": k["launches"] / profiled} for k in kernels]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="auto")
    p.add_argument("--seq", type=int, default=512, help="prompt tokens before the context is filled")
    p.add_argument("--context", type=int, nargs="+", default=[32768, 131040])
    p.add_argument("--caches", nargs="+", choices=["fp16", "fp8"], default=["fp16", "fp8"])
    p.add_argument("--steps", type=int, default=20, help="graph replays timed")
    p.add_argument("--profiled", type=int, default=3, help="eager steps under the profiler")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    model, info = load_model(args.model)
    dev = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, args.seq), device=dev, generator=None)
    print(f"{info.name} {info.quant}, {torch.cuda.get_device_name(dev)}")
    rows = []
    with use_impl(model, "llm_attn") as report:
        for ctx in args.context:
            for kind in args.caches:
                r = one(model, prompt, ctx, kind, args.steps, args.profiled)
                rows.append((ctx, kind, r))
                torch.cuda.empty_cache()
                print(f"\n== context {ctx}, {kind} cache: graph step {r['graph_ms']:.3f} ms, eager device busy "
                      f"{r['busy_ms']:.3f} ms/step")
                print("   " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(r["split"].items(), key=lambda x: -x[1])))
                for k in r["kernels"][:args.top]:
                    print(f"   {k['ms'] * 1e3:9.1f} us {k['launches']:6.1f}x  {k['name'][:110]}")
        if report is not None:
            print(f"\npatch report: {report}")
    print("\n| context | cache | graph step ms | device busy ms | attention | append | gemm | other |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx, kind, r in rows:
        s = r["split"]
        print(f"| {ctx} | {kind} | {r['graph_ms']:.3f} | {r['busy_ms']:.3f} | {s.get('attention', 0):.3f} | "
              f"{s.get('append', 0):.3f} | {s.get('gemm', 0):.3f} | {s.get('other', 0):.3f} |")


if __name__ == "__main__":
    main()

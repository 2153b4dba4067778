"""An independent TTFT probe: the plainest possible loop, to check the harness against (issue: trustworthy verdicts).

    python experiments/ttft_probe.py --seq 2048 8192 --repeats 20

Loads the default model once (``llm_attn.models.load_model``; on a GPU the synthetic Llama 3 8B AWQ), then for each
prompt length alternates stock sdpa and ours (``patch_model``/``unpatch_model``) repeat by repeat, each prefill
timed with two CUDA events around ``model(...)`` + argmax, and prints the medians and their ratio. It shares no
code with ``llm_attn.harness``: the harness's TTFT should agree with it within a few percent.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/ttft_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="auto")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gc", choices=["on", "off"], default="on",
                   help="Python's garbage collector while timing (default on: the plainest loop; the harness turns it "
                        "off, which matters where the prefill is host-bound)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it times with CUDA events)")

    from transformers import DynamicCache

    from llm_attn.models import load_model
    from llm_attn.patches import patch_model, unpatch_model

    model, info = load_model(args.model, device="cuda", dtype=torch.float16)
    print(f"model: {info.name} ({info.quant}, {info.awq_backend}), gc {args.gc}", flush=True)
    gen = torch.Generator().manual_seed(0)

    def prefill(ids):
        out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                    logits_to_keep=1)
        return out.logits[:, -1].argmax(-1)

    print("| seq | sdpa p50 ms | ours p50 ms | sdpa/ours (>1 = ours faster) |")
    print("|---|---|---|---|")
    for seq in args.seq:
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen).cuda()
        times = {"sdpa": [], "ours": []}
        if args.gc == "off":
            gc.collect()
            gc.disable()
        with torch.inference_mode():
            for rep in range(args.warmup + args.repeats):
                for name in (("sdpa", "ours") if rep % 2 == 0 else ("ours", "sdpa")):
                    if name == "ours":
                        patch_model(model, impl="llm_attn")
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    prefill(ids)
                    end.record()
                    end.synchronize()
                    if name == "ours":
                        unpatch_model(model)
                    if rep >= args.warmup:
                        times[name].append(start.elapsed_time(end))
        gc.enable()
        s, o = statistics.median(times["sdpa"]), statistics.median(times["ours"])
        print(f"| {seq} | {s:.2f} | {o:.2f} | {s / o:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one attention call's host time goes, by Python function: cProfile over the host-cost paths.

    LLM_ATTN_BUILD=nvrtc python experiments/host_profile.py
    python experiments/host_profile.py --paths "llm_attn.flash_attn_func" --shapes decode --calls 2000 --top 40

`python -m llm_attn.bench --mode host` says how many microseconds a call costs the host (our op, the patched call,
the patched call on the FP8 cache, transformers' sdpa, torch SDPA); this says where they go. For each chosen path
and shape (``llm_attn.harness.hostcost``: the same inputs and the same real patched LlamaAttention) it warms the
path up, then runs ``--calls`` calls under cProfile (under ``torch.inference_mode``, as the benchmark does) and
prints the functions sorted by their own time and by cumulative time, per call (cProfile's own overhead inflates
every entry; read the shares, not the absolute microseconds).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from llm_attn.harness import hostcost

SHAPES = {"prefill": hostcost.PREFILL, "decode": hostcost.DECODE}


def profile(fn, calls: int, top: int, title: str) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        text = buf.getvalue()
        print(f"== {title}: sorted by {key}, {calls} calls (per call: the time column / {calls}) ==")
        print(text[text.find("   ncalls"):].rstrip() + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="+", default=["llm_attn.flash_attn_func", "llm_attn via the patch",
                                                   hostcost.FP8_PATH],
                    choices=[*hostcost.PATHS, *hostcost.FP8_PATHS])
    ap.add_argument("--shapes", nargs="+", default=["decode", "prefill"], choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: on the CPU every call computes, so the profile would not be a host cost")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    device = torch.device("cuda")
    import llm_attn  # noqa: PLC0415

    print(f"build: {llm_attn.kernel_build()}, {torch.cuda.get_device_name()}, {args.dtype}")
    with torch.inference_mode():
        for name in args.shapes:
            _model, _module, _report, fns = hostcost._paths(SHAPES[name], device, dtype)
            for path in args.paths:
                if path in fns:
                    profile(fns[path], args.calls, args.top, f"{SHAPES[name].name}, {path}")


if __name__ == "__main__":
    main()

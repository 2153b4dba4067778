"""The command line of llm_attn.models (see its docstring): generate, load, backends."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def main(argv=None) -> int:
    from llm_attn.models import __doc__ as _DOC  # noqa: PLC0415 (torch: imported inside main, see llm_attn._cli)
    from llm_attn.models.loading import detect_awq_backends, load_model  # noqa: PLC0415
    from llm_attn.models.presets import PRESETS  # noqa: PLC0415
    from llm_attn.models.synthetic import cached_checkpoint  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m llm_attn.models", description=_DOC.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate (or reuse) a cached synthetic checkpoint and print its path")
    g.add_argument("preset", choices=sorted(PRESETS))
    g.add_argument("quant", choices=["awq", "fp16"])
    g.add_argument("--cache-dir")
    g.add_argument("--seed", type=int, default=0)
    ld = sub.add_parser("load", help="load a model spec and print its ModelInfo as JSON")
    ld.add_argument("spec", nargs="?", default="auto")
    ld.add_argument("--device")
    ld.add_argument("--cache-dir")
    ld.add_argument("--awq-backend")
    ld.add_argument("--allow-dequant-fallback", action="store_true")
    sub.add_parser("backends", help="print installed AWQ packages")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show third-party banners and progress bars (transformers, gptqmodel), held back by default")
    args = ap.parse_args(argv)
    if args.verbose:
        from llm_attn._cli import set_verbose  # noqa: PLC0415

        set_verbose(True)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.cmd == "generate":
        t0 = time.perf_counter()
        path = cached_checkpoint(args.preset, args.quant, cache_dir=args.cache_dir, seed=args.seed)
        print(f"{path}  ({time.perf_counter() - t0:.1f}s)")
    elif args.cmd == "load":
        import torch  # noqa: PLC0415

        from llm_attn.models.loading import resource_problem  # noqa: PLC0415

        try:
            problem = resource_problem(args.spec, args.device or "auto", torch.float16, cache_dir=args.cache_dir,
                                       allow_dequant_fallback=args.allow_dequant_fallback)
        except (RuntimeError, ValueError) as e:  # e.g. --device cuda without a GPU
            problem = str(e)
        if problem:
            ap.exit(2, f"{ap.prog}: error: {args.spec}: {problem}\n")
        t0 = time.perf_counter()
        _, info = load_model(args.spec, device=args.device, cache_dir=args.cache_dir, awq_backend=args.awq_backend,
                             allow_dequant_fallback=args.allow_dequant_fallback)
        print(json.dumps({**info.to_dict(), "load_seconds": round(time.perf_counter() - t0, 2)}, indent=2))
    else:
        print(json.dumps(detect_awq_backends(), indent=2))
    return 0


if __name__ == "__main__":
    from llm_attn._cli import run_cli

    run_cli(main)  # Ctrl-C: exit 130 and one line, no traceback

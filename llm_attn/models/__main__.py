"""The command line of llm_attn.models (see its docstring): generate, load, backends, fit."""

from __future__ import annotations

from llm_attn._cli import hold_sigint

hold_sigint(__name__)  # before any other import: a Ctrl-C from here on exits 130 without a traceback

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
    _add_fit_parser(sub)
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="show third-party banners and progress bars (transformers, gptqmodel), held back by default")
    args = ap.parse_args(argv)
    if args.cmd == "fit":
        return _fit(ap, args)
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


def _chunk(text: str) -> int | None:
    """A --chunks value: 'none' (the prompt in one forward) or a number of tokens (checked by _fit)."""
    return None if text == "none" else int(text)


def _add_fit_parser(sub) -> None:
    from llm_attn.harness.devices import DEFAULT_TABLE  # noqa: PLC0415
    from llm_attn.harness.fit import CACHES  # noqa: PLC0415

    f = sub.add_parser("fit", help="the longest prompt, and prompt + decode, that each device's memory takes, per KV "
                                   "cache format and prefill chunk (a memory model: llm_attn/harness/fit.py)")
    f.add_argument("--model", default="llama-3-8b",
                   help="a preset; ':awq' (the default) or ':fp16' weights (default llama-3-8b)")
    f.add_argument("--device", nargs="+", default=["all"], metavar="SLUG",
                   help="devices of the device table by slug, or a prefix naming one (rtx-4060-ti, jetson, h100), "
                        "or 'all' (the default)")
    f.add_argument("--cache", nargs="+", choices=CACHES, default=list(CACHES),
                   help="KV cache formats: fp16; fp8-copy (the FP8 cache as it runs today, each layer's attention "
                        "on a dequantised copy); fp8 (read in place by a kernel: planned, issue 38)")
    f.add_argument("--chunks", nargs="+", type=_chunk, default=[None, 8192, 2048], metavar="N|none",
                   help="prefill chunk sizes (--prefill-chunk of llm_attn.ttft); 'none': one forward "
                        "(default: none 8192 2048)")
    f.add_argument("--decode", type=int, default=1024, metavar="N", help="tokens decoded after the prompt (1024)")
    f.add_argument("--batch", type=int, default=1, help="batch size (1)")
    f.add_argument("--devices", default=str(DEFAULT_TABLE), help="device table (TOML)")
    f.add_argument("--check", nargs="+", metavar="RESULTS.jsonl",
                   help="instead: the model's predicted prefill peak against the measured peaks of these result "
                        "files' ttft rows")


def _fit(ap, args) -> int:
    from llm_attn.harness import fit  # noqa: PLC0415
    from llm_attn.harness.devices import load_devices  # noqa: PLC0415
    from llm_attn.harness.results import iter_rows  # noqa: PLC0415
    from llm_attn.models.presets import get_preset  # noqa: PLC0415

    def error(message: str):
        ap.exit(2, f"{ap.prog} fit: error: {message}\n")

    name, _, weights = args.model.partition(":")
    weights = weights or "awq"
    try:
        preset = get_preset(name)
    except ValueError as e:
        error(f"--model {args.model}: {e}")
    if weights not in fit.WEIGHTS:
        error(f"--model {args.model}: weights must be one of {', '.join(fit.WEIGHTS)}")
    bad = [c for c in args.chunks if c is not None and c <= 0]
    if bad or args.decode < 0 or args.batch < 1:
        error(f"--chunks {bad[0]}: must be a positive number of tokens or 'none'" if bad else
              f"--decode {args.decode}: must be >= 0" if args.decode < 0 else f"--batch {args.batch}: must be >= 1")
    if args.check:
        rows = []
        for path in args.check:
            try:
                rows += [{**r, "_source": path} for r in iter_rows(path) if isinstance(r, dict)]
            except OSError as e:
                error(f"--check {path}: {e.strerror or e}")
        checks = fit.check_rows(rows, preset)
        if not checks:
            error(f"--check: no successful fp16 ttft row of {preset.name} with a peak in {' '.join(args.check)}")
        print(fit.check_table(checks))
        return 0
    try:
        table = load_devices(args.devices)
    except (OSError, ValueError) as e:
        error(f"--devices {args.devices}: {e}")
    known = [d.slug for d in table]
    devices = []
    for want in args.device:
        hits = table if want == "all" else [d for d in table if d.slug == want] or \
            [d for d in table if d.slug.startswith(want)]
        if len(hits) != 1 and want != "all":
            error(f"--device {want}: {'ambiguous' if hits else 'unknown device'}; known: {', '.join(known)}")
        devices += [d for d in hits if d not in devices]
    missing = [d.slug for d in devices if d.memory_gib is None]
    if missing:
        error(f"--devices {args.devices}: no memory_gib for {', '.join(missing)}")
    rows = fit.fit_rows(preset, weights, devices, caches=tuple(args.cache), chunks=tuple(args.chunks),
                        new_tokens=args.decode, batch=args.batch)
    print(f"{preset.name} ({weights} weights), batch {args.batch}: the longest prompt whose prefill peak (and, last "
          f"column, with {args.decode} tokens decoded after it) fits the device's memory_gib - reserved_gib")
    print(fit.fit_table(rows))
    if "fp8" in args.cache:
        print("fp8: the FP8 cache read in place by llm_attn's decode and prefill kernels; fp8-copy: each layer's "
              "attention reads a dequantised fp16 copy (stock attention, a build without those kernels, "
              "LLM_ATTN_FP8KV_PREFILL=copy).")
    print("The memory model and how it was checked: llm_attn/harness/fit.py (python -m llm_attn.models fit --check "
          "RESULTS.jsonl compares it with measured peaks).")
    return 0


if __name__ == "__main__":
    from llm_attn._cli import run_cli

    run_cli(main)  # Ctrl-C: exit 130 and one line, no traceback

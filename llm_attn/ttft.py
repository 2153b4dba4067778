"""Time-to-first-token and decode speed of an LLM, stock attention implementations against ours.

    python -m llm_attn.ttft                       # defaults: every implementation available here
    python -m llm_attn.ttft --seq 2048            # on a GPU: synthetic Llama 3 8B AWQ int4, fp16
    python -m llm_attn.ttft --seq 512 2048 8192 --impl sdpa llm_attn --repeats 20 --out runs/h100.jsonl
    python -m llm_attn.ttft --model /models/Meta-Llama-3-8B-Instruct-AWQ --seq 1024 --batch 1 4
    python -m llm_attn.ttft --plugin examples/my_attention.py --impl mine sdpa llm_attn --seq 2048
    python -m llm_attn.ttft --impl sdpa llm_attn --seq 2048 8192 --measure ttft breakdown

Without ``--model`` (``auto``) a GPU gets the synthetic Llama 3 8B AWQ checkpoint (exact geometry, seeded int4
weights, loaded through a real AWQ loader; generated once and cached) and a machine without a GPU gets a tiny
Llama-architecture model on CPU, where our attention runs through the PyTorch reference.

Per implementation and prompt length it measures (``--measure`` picks):
  ttft             prefill of exactly --seq tokens + greedy first token; CUDA events; p50/p90/min/stdev%
  decode_generate  tokens 2..N of model.generate (default cache), each timed as it reaches the host
  decode_graph     the same decode kernel-limited: StaticCache + one step replayed from a CUDA graph
  correctness      every non-stock implementation vs stock sdpa: max |logit diff| at the last prompt
                   position, greedy-token agreement
  breakdown        (only when asked for) one prefill under torch.profiler: attention / GEMM / quantised
                   weights / other kernels / GPU idle, and TTFT if attention took 0 ms
and prints a llama-bench-like table with speedups. Every measurement is appended to --out as one JSON line
(raw samples, statistics, environment, model, and the command that reproduces it) the moment it finishes; an
out-of-memory or failing point is recorded as such and the sweep goes on. ``--resume`` skips points already in
--out. Exit status: 0 when every point was measured or ran out of memory, 1 when a point failed otherwise,
2 for bad arguments or a model that cannot be loaded, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from llm_attn import registry
from llm_attn.envinfo import capture_env, device_name
from llm_attn.harness.devices import DEFAULT_TABLE, find_device, load_devices
from llm_attn.harness.impls import available_impls, unavailable_reason
from llm_attn.harness.results import OutputWriteError, ResultWriter, finished_keys, output_file_problem
from llm_attn.harness.sweep import (
    ALL_MEASUREMENTS,
    DEFAULT_MEASUREMENTS,
    DTYPES,
    Sweep,
    SweepConfig,
    breakdown_table,
    correctness_table,
    summary_table,
)

DEFAULT_SEQS = {"cuda": [512, 1024, 2048], "cpu": [32, 64]}
DEFAULT_OUT = "ttft-results.jsonl"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _at_least_two(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError("must be >= 2: decode is timed over the tokens after the first")
    return value


def add_plugin_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py|MODULE[:ATTR]",
                   help="load an attention plugin that registers implementations with "
                        "llm_attn.register_attention (repeatable); installed packages' 'llm_attn.attention' entry "
                        "points load by themselves")


def load_plugins(argv: list[str] | None, prog: str) -> list[str]:
    """Load every --plugin of ``argv`` before the real parser is built, so that --impl knows their names."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False)
    add_plugin_argument(pre)
    known, _ = pre.parse_known_args(argv)
    try:
        registry.load_plugins(known.plugin)
    except registry.PluginError as e:
        pre.error(str(e))
    return known.plugin


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llm_attn.ttft", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    names = registry.names()
    p.add_argument("--model", default="auto",
                   help="'auto' (synthetic Llama 3 8B AWQ on a GPU, tiny fp16 model on CPU), a preset "
                        "(llama-3-8b, tiny; ':awq' or ':fp16' picks the format), a local checkpoint folder, or a "
                        "Hugging Face hub id already in the local cache (nothing is downloaded)")
    p.add_argument("--seq", type=_positive_int, nargs="+", default=None, metavar="N",
                   help="prompt length(s) in tokens (default: 512 1024 2048 on a GPU, 32 64 on CPU)")
    p.add_argument("--batch", type=_positive_int, nargs="+", default=[1], metavar="B", help="batch size(s)")
    p.add_argument("--impl", nargs="+", choices=names, default=None, metavar="IMPL",
                   help=f"attention implementations, from {{{', '.join(names)}}} (the registry, with --plugin's; "
                        "default: the stock ones available here, then llm_attn)")
    add_plugin_argument(p)
    p.add_argument("--new-tokens", type=_at_least_two, default=32, metavar="N",
                   help="tokens generated in the decode and correctness measurements (default 32)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="activation dtype (default: float16 on a GPU, float32 on CPU except for ':awq' presets)")
    p.add_argument("--warmup", type=_non_negative_int, default=3,
                   help="untimed TTFT runs at the exact shape before timing (default 3); decode gets one "
                        "untimed generate when > 0")
    p.add_argument("--repeats", type=_positive_int, default=10, help="timed TTFT runs (default 10)")
    p.add_argument("--decode-repeats", type=_positive_int, default=3, help="timed decode runs (default 3)")
    p.add_argument("--measure", nargs="+", choices=ALL_MEASUREMENTS, default=list(DEFAULT_MEASUREMENTS), metavar="M",
                   help=f"which measurements to run, from {{{', '.join(ALL_MEASUREMENTS)}}} (default: "
                        f"{' '.join(DEFAULT_MEASUREMENTS)})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSONL file rows are appended to (default {DEFAULT_OUT})")
    p.add_argument("--resume", action="store_true", help="skip points that already have a row in --out")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--allow-dequant-fallback", action="store_true",
                   help="when no AWQ int4 backend is installed, run the AWQ checkpoint with dequantised fp16 "
                        "weights (marked as such in every output) instead of stopping")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the random prompts")
    p.add_argument("--devices", default=str(DEFAULT_TABLE), help="device datasheet table (TOML)")
    p.add_argument("--experiment", default=None, help=argparse.SUPPRESS)  # set by llm_attn.experiment
    # --- tensor parallel (llm_attn.harness.tp) ---
    p.add_argument("--tp", type=_positive_int, default=None, metavar="N",
                   help="tensor parallelism over N ranks (transformers' TP plan on torch.distributed; starts "
                        "torchrun itself unless already under it); paired TTFT only. See llm_attn/harness/tp.py")
    # --- end tensor parallel ---
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are also off when stderr is not a terminal)")
    return p


def default_dtype(spec: str, device: str) -> str:
    """float16 on a GPU; float32 on CPU (fast and exact there), except for an AWQ preset, whose int4 kernels
    compute in float16."""
    return "float16" if device == "cuda" or spec.endswith(":awq") else "float32"


def resolve_device(choice: str, parser: argparse.ArgumentParser) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch "
                     f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    return choice


def check_model_spec(spec: str, parser: argparse.ArgumentParser) -> None:
    """Refuse a model path that does not exist before anything heavy happens. Presets, hub ids and the rest are
    checked by ``llm_attn.models.load_model``, whose errors say what it accepts."""
    from llm_attn.models import PRESETS  # noqa: PLC0415 (heavy: keep --help fast)

    if spec == "auto" or spec.partition(":")[0] in PRESETS or Path(spec).expanduser().exists():
        return
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1 or spec.endswith((".safetensors", ".json")):
        parser.error(f"--model {spec}: no such file or directory")


def describe_model(info, device: str, spec: str = "auto") -> str:
    get = (lambda k: info.get(k)) if isinstance(info, dict) else (lambda k: getattr(info, k, None))
    parts = [str(get("quant"))]
    if get("awq_backend"):
        parts.append(f"AWQ backend {get('awq_backend')}")
    if get("dequant_fallback"):
        parts.append("DEQUANTISED FP16 FALLBACK: the int4 linear layers are NOT what runs")
    line = f"model: {get('name')} ({', '.join(parts)}; source {get('source')}) on {device_name(device)}"
    if device == "cpu":
        auto = " (no GPU here, so 'auto' is the tiny Llama-architecture model)" if spec == "auto" else ""
        line += (f"\non CPU{auto}: llm_attn runs through the PyTorch reference, not the CUDA kernel; "
                 "these timings check the harness and say nothing about the kernel")
    return line


def load(spec: str, device: str, dtype: str, allow_dequant_fallback: bool):
    from llm_attn.models import load_model  # noqa: PLC0415

    return load_model(spec, device=device, dtype=DTYPES[dtype], allow_dequant_fallback=allow_dequant_fallback,
                      attn_implementation="sdpa")


def default_seqs(model, device: str, new_tokens: int) -> list[int]:
    """The default lengths that fit the model with the decoded tokens (a small model may allow fewer positions)."""
    from llm_attn.models import max_seq_len  # noqa: PLC0415

    limit = max_seq_len(model) - new_tokens
    return [s for s in DEFAULT_SEQS[device] if s <= limit] or [max(1, limit)]


def check_lengths(model, seqs: list[int], new_tokens: int, measurements: list[str],
                  parser: argparse.ArgumentParser, names: tuple[str, str] = ("--seq", "--new-tokens")) -> None:
    from llm_attn.models import max_seq_len  # noqa: PLC0415

    limit = max_seq_len(model)
    decodes = any(m not in ("ttft", "breakdown") for m in measurements)
    for s in seqs:
        need = s + new_tokens if decodes else s
        if need > limit:
            parser.error(f"{names[0]} {s}: longer than the model allows ({limit} positions)"
                         + (f"; decode needs seq + {names[1]} = {need} positions" if decodes and s <= limit else ""))


def run(cfg: SweepConfig, model, info, out: str | Path, resume: bool, devices_path: str | Path | None,
        progress: bool = True, argv: list[str] | None = None) -> tuple[list[dict], int]:
    """Measure ``cfg`` on a loaded model, appending rows to ``out``. Returns (rows written, number of measurements
    skipped because ``resume`` found them in ``out``)."""
    env = capture_env(cfg.device)
    try:
        entry = find_device(env["device_name"], load_devices(devices_path))
    except (OSError, ValueError) as e:
        print(f"warning: device table unusable ({e}); no %-of-peak or bandwidth bound", file=sys.stderr)
        entry = None
    done = finished_keys(out) if resume else set()
    with ResultWriter(out) as writer:
        sweep = Sweep(cfg, model, info, env, writer, entry, done=done, progress=progress, argv=argv)
        rows = sweep.run()
    return rows, sweep.skipped


def report_rows(rows: list[dict], out: str | Path) -> int:
    """Print the tables; return the exit status (1 when some point failed for another reason than OOM or a stock
    path that cannot be measured that way, e.g. eager attention inside a CUDA graph)."""
    if rows:
        print(summary_table(rows))
        for extra in (correctness_table(rows), breakdown_table(rows)):
            if extra:
                print()
                print(extra)
    failed = [r for r in rows if r["status"] == "error"]
    ooms = [r for r in rows if r["status"] == "oom"]
    unsupported = [r for r in rows if r["status"] == "unsupported"]
    print(f"\n{len(rows)} rows appended to {out}"
          + (f"; {len(ooms)} out of memory" if ooms else "")
          + (f"; {len(unsupported)} unsupported (see their rows)" if unsupported else "")
          + (f"; {len(failed)} FAILED (see the 'error' rows and the messages above)" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    plugins = load_plugins(argv, "python -m llm_attn.ttft")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tp is not None:  # --- tensor parallel: its own launcher and measurement (llm_attn.harness.tp) ---
        from llm_attn.harness import tp  # noqa: PLC0415

        return tp.main(args, parser, plugins, argv)
    device = resolve_device(args.device, parser)
    impls = args.impl or available_impls(device)
    for impl in impls:
        reason = unavailable_reason(impl, device)
        if reason:
            parser.error(f"--impl {impl}: {reason}")
    if len(set(impls)) != len(impls):
        parser.error(f"--impl lists an implementation twice: {impls}")
    dtype = args.dtype if args.dtype != "auto" else default_dtype(args.model, device)
    check_model_spec(args.model, parser)
    if output_file_problem(args.out):
        parser.error(f"--out {args.out}: {output_file_problem(args.out)}")

    print(f"loading model {args.model!r} on {device} ({dtype}) ...", file=sys.stderr, flush=True)
    try:
        model, info = load(args.model, device, dtype, args.allow_dequant_fallback)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 (the loader's message says what it accepts: show it, exit 2)
        parser.error(f"--model {args.model}: cannot load it: {type(e).__name__}: {e}")
    seqs = args.seq or default_seqs(model, device, args.new_tokens)
    check_lengths(model, seqs, args.new_tokens, args.measure, parser)
    print(describe_model(info, device, args.model), flush=True)

    cfg = SweepConfig(model_spec=args.model, dtype=dtype, impls=impls, seqs=seqs, batches=args.batch,
                      new_tokens=args.new_tokens, warmup=args.warmup, repeats=args.repeats,
                      decode_repeats=args.decode_repeats, measurements=args.measure, seed=args.seed,
                      allow_dequant_fallback=args.allow_dequant_fallback, experiment=args.experiment, device=device,
                      plugins=plugins)
    try:
        written, skipped = run(cfg, model, info, args.out, args.resume, args.devices, progress=not args.no_progress,
                               argv=[sys.executable, "-m", "llm_attn.ttft", *(sys.argv[1:] if argv is None else argv)])
    except KeyboardInterrupt:
        print(f"\ninterrupted: every finished measurement is in {args.out}; run again with --resume to continue",
              file=sys.stderr)
        return 130
    except OutputWriteError as e:
        print(f"{parser.prog}: error: --out: {e}", file=sys.stderr)
        return 2
    if skipped:
        print(f"--resume: {skipped} measurements already in {args.out} were skipped")
    return report_rows(written, args.out)


if __name__ == "__main__":
    sys.exit(main())

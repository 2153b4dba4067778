"""Run an experiment definition (a TOML sweep) and write its results under experiments/results/<device>/.

    python -m llm_attn.experiment experiments/default.toml            # the default sweep, 512 .. 8192
    python -m llm_attn.experiment experiments/smoke.toml --dry-run    # list the points, measure nothing
    python -m llm_attn.experiment experiments/default.toml --results-dir /tmp/results

A definition names a sweep over models, dtypes, implementations, batch sizes and prompt lengths (the keys are
those of ``ExperimentDef`` below and of the ``SweepParams`` it shares with ``llm_attn.ttft``; see
experiments/default.toml). ``plugins = ["my_kernel.py"]`` (or ``--plugin``) brings implementations from outside
the repository; ``measurements = [..., "breakdown"]`` adds the profiled prefill split. Results go to
``<results-dir>/<device-slug>/<name>.jsonl``, where the device slug comes from the GPU name ("h100-80gb-hbm3",
"rtx-4060-ti", "cpu"), one row per measurement in the format of ``python -m llm_attn.ttft``. Running the same
command again resumes: points that already have a row (measured, or out of memory) are skipped, so an
interrupted sweep continues where it stopped. ``python -m llm_attn.report`` turns the results into tables and
plots.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from llm_attn import registry, ttft
from llm_attn.envinfo import REPO_ROOT, capture_env
from llm_attn.harness.impls import available_impls, unavailable_reason
from llm_attn.harness.results import iter_rows
from llm_attn.harness.sweep import DTYPES, SweepConfig, SweepParams, breakdown_table, correctness_table, summary_table

DEFAULT_RESULTS = REPO_ROOT / "experiments" / "results"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(kw_only=True)
class ExperimentDef(SweepParams):
    """One experiment file: the sweep parameters of ``SweepParams`` (seqs, batches, new_tokens, warmup, repeats,
    decode_repeats, measurements, seed, allow_dequant_fallback, plugins) plus the models, dtypes and
    implementations to sweep them over. Every list is swept as a product; ``impls`` left out means the default
    implementations available on the machine that runs it. ``plugins`` (.py paths relative to the TOML file, or
    module[:attr]) register implementations that ``impls`` may then name."""

    name: str
    models: list[str] = field(default_factory=lambda: ["auto"])
    dtypes: list[str] = field(default_factory=lambda: ["auto"])
    impls: list[str] | None = None
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"name must be lower-case letters, digits, '-' or '_' (it names the results file), "
                             f"got {self.name!r}")
        for key in ("models", "dtypes"):
            val = getattr(self, key)
            if not isinstance(val, list) or not val:
                raise ValueError(f"{key} must be a non-empty list, got {val!r}")
        super().__post_init__()
        bad = [d for d in self.dtypes if d != "auto" and d not in DTYPES]
        if bad:
            raise ValueError(f"dtypes: unknown {bad}; choose from auto, {', '.join(DTYPES)}")
        registry.load_plugins(self.plugins)  # raises PluginError (a ValueError) with the spec and the cause
        if self.impls is not None:
            known = registry.names()
            bad = [i for i in self.impls if i not in known]
            if bad or not self.impls:
                raise ValueError(f"impls: unknown {bad}; choose from {', '.join(known)}")

    def configs(self, device: str) -> list[SweepConfig]:
        """One SweepConfig per (model, dtype), resolved for ``device``."""

        impls = self.impls or available_impls(device)
        for impl in impls:
            reason = unavailable_reason(impl, device)
            if reason:
                raise ValueError(f"impls: {impl}: {reason}")
        out = []
        for model in self.models:
            for dtype in self.dtypes:
                dt = dtype if dtype != "auto" else ttft.default_dtype(model, device)
                out.append(SweepConfig(**self.shared(), model_spec=model, dtype=dt, impls=list(impls),
                                       experiment=self.name, device=device))
        return out


def load_experiment(path: str | Path) -> ExperimentDef:
    """Parse a definition; unknown keys are errors (a typo must not silently fall back to a default)."""
    path = Path(path)
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    if "model" in data:  # single-value spellings, for short definitions
        data.setdefault("models", [data.pop("model")])
    if "dtype" in data:
        data.setdefault("dtypes", [data.pop("dtype")])
    known = {f.name for f in fields(ExperimentDef)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
    missing = [k for k in ("name", "seqs") if k not in data]
    if missing:
        raise ValueError(f"missing required keys {missing}")
    if isinstance(data.get("plugins"), list):  # plugin files are named relative to the definition
        data["plugins"] = [str(path.parent / p) if isinstance(p, str) and p.endswith(".py")
                           and not Path(p).is_absolute() and (path.parent / p).is_file() else p
                           for p in data["plugins"]]
    return ExperimentDef(**data)


def results_path(results_dir: str | Path, device_slug: str, name: str) -> Path:
    return Path(results_dir) / device_slug / f"{name}.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llm_attn.experiment", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("definition", help="experiment TOML file, e.g. experiments/default.toml")
    p.add_argument("--results-dir", default=str(DEFAULT_RESULTS),
                   help="results root; rows go to <results-dir>/<device-slug>/<name>.jsonl")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--no-resume", action="store_true",
                   help="measure every point again even when its row exists (the newest row wins in reports)")
    p.add_argument("--dry-run", action="store_true", help="print the points and the output file, measure nothing")
    p.add_argument("--devices", default=None, help="device datasheet table (default experiments/devices.toml)")
    p.add_argument("--no-progress", action="store_true")
    ttft.add_plugin_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    ttft.load_plugins(argv, "python -m llm_attn.experiment")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        exp = load_experiment(args.definition)
    except FileNotFoundError:
        parser.error(f"no such experiment file: {args.definition}")
    except (ValueError, TypeError, tomllib.TOMLDecodeError) as e:
        parser.error(f"{args.definition}: {e}")
    device = ttft.resolve_device(args.device, parser)
    try:
        configs = exp.configs(device)
    except ValueError as e:
        parser.error(f"{args.definition}: {e}")
    for cfg in configs:
        ttft.check_model_spec(cfg.model_spec, parser)
    out = results_path(args.results_dir, capture_env(device)["device_slug"], exp.name)
    cmd = [sys.executable, "-m", "llm_attn.experiment", *(sys.argv[1:] if argv is None else argv)]

    if args.dry_run:
        n = sum(len(c.impls) * len(c.batches) * len(c.seqs) for c in configs)
        print(f"experiment {exp.name}: {len(configs)} model/dtype combination(s), {n} points, results -> {out}")
        for c in configs:
            print(f"  model={c.model_spec} dtype={c.dtype} impls={c.impls} batches={c.batches} seqs={c.seqs} "
                  f"measure={c.measurements}")
            print(f"    e.g. {c.command(c.impls, c.batches[0], c.seqs[0], c.measurements)}")
        return 0

    status = 0
    for cfg in configs:
        print(f"loading model {cfg.model_spec!r} on {device} ({cfg.dtype}) ...", file=sys.stderr, flush=True)
        try:
            model, info = ttft.load(cfg.model_spec, device, cfg.dtype, cfg.allow_dequant_fallback)
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # noqa: BLE001 (the loader's message says what it accepts: show it, exit 2)
            parser.error(f"model {cfg.model_spec}: cannot load it: {type(e).__name__}: {e}")
        ttft.check_lengths(model, cfg.seqs, cfg.new_tokens, cfg.measurements, parser,
                           names=(f"{args.definition}: seqs", "new_tokens"))
        print(ttft.describe_model(info, device, cfg.model_spec), flush=True)
        try:
            written, skipped = ttft.run(cfg, model, info, out, resume=not args.no_resume,
                                        devices_path=args.devices, progress=not args.no_progress, argv=cmd)
        except KeyboardInterrupt:
            print(f"\ninterrupted: every finished measurement is in {out}; run the same command again to continue",
                  file=sys.stderr)
            return 130
        if skipped:
            print(f"resumed: {skipped} measurements already in {out} were skipped")
        if any(r["status"] == "error" for r in written):
            status = 1
        del model
    rows = [r for r in iter_rows(out) if r.get("experiment") == exp.name]
    print(summary_table(rows))
    for extra in (correctness_table(rows), breakdown_table(rows)):
        if extra:
            print()
            print(extra)
    print(f"\nresults: {out} ({len(rows)} rows for experiment {exp.name})")
    return status


if __name__ == "__main__":
    sys.exit(main())

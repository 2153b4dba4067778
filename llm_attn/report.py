"""Merge result files from several machines into one comparison: a markdown report and PNG plots.

    python -m llm_attn.report experiments/results --out experiments/reports/default
    python -m llm_attn.report h100.jsonl rtx4060ti.jsonl --out /tmp/report --experiment default

Reads every ``*.jsonl`` result file named or found under the folders named (rows of ``python -m llm_attn.ttft``
and ``python -m llm_attn.experiment``), keyed by run as well as by device and point: a table line and its ``vs``
cells come from one run; a newer run that re-measured everything an older one had at a point with the same
configuration replaces it there, other overlapping runs are shown apart, and one note line says which and why
(``reporting/merge.py``). It writes to --out:

- ``report.md``: per measured device, TTFT (p50/p90/stdev%), model TFLOP/s and % of the datasheet fp16 peak,
  each implementation's TTFT ratio to each stock one (stock / this, > 1 = faster), decode tok/s (generate and
  CUDA graph) with the fraction of the weight-bandwidth bound, peak memory, correctness, and the points that ran
  out of memory or failed; then the devices side by side; then, in a separate section, roofline projections for
  table devices with no results.
- ``ttft_vs_seq*.png``, ``speedup*.png``, ``decode_tok_s*.png`` (one set per model/dtype/batch), and
  ``breakdown*.png`` (where each profiled prefill's time went, a stacked bar per implementation and prompt length,
  from ``--measure breakdown`` rows).
- Energy (rows that carry it, ``harness/energy.py``): a table of TTFT, J per prefill, decode tok/s and J per token
  per device with the paired energy ratios (PROJECTED rows marked), ``energy_per_token.png`` (J/token vs tok/s per
  device), and the published references of ``--references`` (default experiments/published_references.toml) in
  their own section, every number with its source; published numbers are never merged into measured rows.

Every implementation is listed with its source (built-in, or plugin file / package and version) and how many of
its attention calls fell back to the stock path.

Peaks and bandwidths come from ``experiments/devices.toml``. Projections are always labelled as such, in their
own tables and their own plot panels, never mixed with measurements.
"""

from __future__ import annotations

from llm_attn._cli import hold_sigint

hold_sigint(__name__)  # before any other import: a Ctrl-C from here on exits 130 without a traceback

import argparse
import sys

__all__ = ["main", "write_report"]


def __getattr__(name):  # write_report, re-exported without importing the report library (and torch) at import
    if name == "write_report":
        from llm_attn.reporting import write_report  # noqa: PLC0415

        return write_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llm_attn.report", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result .jsonl files or folders searched recursively")
    p.add_argument("--out", required=True, help="folder for report.md and the PNG plots")
    p.add_argument("--experiment", default=None, help="only rows of this experiment name")
    p.add_argument("--devices", default=None, help="device datasheet table (default experiments/devices.toml)")
    p.add_argument("--project", nargs="+", default=None, metavar="SLUG",
                   help="project only these table devices (default: every table device without results)")
    p.add_argument("--no-projection", action="store_true", help="no roofline projections")
    p.add_argument("--references", default=None, metavar="TOML",
                   help="published numbers shown in their own section, each with its source (default "
                        "experiments/published_references.toml)")
    p.add_argument("--no-references", action="store_true", help="no published-references section")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 2) when a line of a results file is skipped (not JSON, not an object, or a row "
                        "that fails validation) instead of warning about it")
    args = p.parse_args(argv)
    from llm_attn.reporting import load_rows, write_report  # noqa: PLC0415 (heavy: keep --help fast)
    from llm_attn.reporting.energy import DEFAULT_REFERENCES, ReferencesError, load_references  # noqa: PLC0415

    references = args.references or (DEFAULT_REFERENCES if DEFAULT_REFERENCES.exists() else None)
    if args.no_references:
        references = None
    if references is not None:
        try:  # before any work; a malformed file is one line that names its line
            load_references(references)
        except ReferencesError as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
    try:
        _, notes = load_rows(args.results, args.experiment)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    except OSError as e:  # a results file that cannot be read
        p.error(f"{e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}")
    for note in notes:
        print(f"{p.prog}: {note}", file=sys.stderr)
    if args.strict and any(n.startswith("warning:") for n in notes):
        p.error("--strict: results files have lines that were skipped (see the warnings above)")
    try:
        report = write_report(args.results, args.out, args.devices, args.experiment, args.project,
                              args.no_projection, references=references)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    except OSError as e:  # --out is a file, not writable, or the disk is full
        p.error(f"cannot write the report to --out {args.out}: {e.filename or ''}{': ' if e.filename else ''}"
                f"{e.strerror or e}")
    print(f"wrote {report} and {len(list(report.parent.glob('*.png')))} plots in {report.parent}")
    return 0


if __name__ == "__main__":
    from llm_attn._cli import run_cli

    run_cli(main)  # Ctrl-C, also during main()'s imports: exit 130 and one line, no traceback

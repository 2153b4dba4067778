"""Stable verdicts (issue 18's first target): the same paired TTFT run N times, each a fresh process.

    python experiments/ttft_stability.py                      # 5 runs of --seq 2048 --impl sdpa llm_attn
    python experiments/ttft_stability.py --runs 3 --seq 8192 --out-dir runs/stability -- --repeats 30
    python experiments/ttft_stability.py --runs 2 --model tiny --seq 32 -- --device cpu     # checks it, on CPU

Each run is ``python -m llm_attn.ttft --seq S --impl sdpa llm_attn --measure ttft --out DIR/run{i}.jsonl`` (plus
--model and any extra arguments), in a new process. Then, from the rows' paired fields (``vs.sdpa``: the ratio of
medians sdpa / llm_attn with its 95 % paired-bootstrap interval), a table: per run the ratio, its interval, whether
the ratio lies within ±2 % of the median of the N ratios, and whether the interval contains that median. Exit
status 0 when every run meets both, 1 when one does not, 2 when a run failed or wrote no paired row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

from llm_attn.harness.cli_args import positive_int

TOLERANCE = 0.02


def run_command(i: int, args, extra: list[str]) -> list[str]:
    out = Path(args.out_dir) / f"run{i}.jsonl"
    return [sys.executable, "-m", "llm_attn.ttft", "--seq", str(args.seq), "--impl", args.stock, args.impl,
            "--measure", "ttft", "--model", args.model, "--out", str(out), "--no-progress", *extra]


def paired_verdict(path: Path, impl: str, stock: str, seq: int) -> dict | None:
    """The interval of the last ok ``ttft`` row of ``impl`` at ``seq`` in ``path`` against ``stock``."""
    found = None
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if (r.get("measurement") == "ttft" and r.get("status") == "ok" and r.get("impl") == impl
                and r.get("seq") == seq and (r.get("vs") or {}).get(stock)):
            found = r["vs"][stock]
    return found


def stability_table(verdicts: list[dict], tolerance: float = TOLERANCE) -> tuple[str, bool]:
    """The per-run table and whether every run meets both targets."""
    median = statistics.median(v["ratio"] for v in verdicts)
    lines, ok = [], True
    for i, v in enumerate(verdicts):
        within = abs(v["ratio"] / median - 1) <= tolerance
        holds = v["low"] <= median <= v["high"]
        ok &= within and holds
        lines.append([i, f"{v['ratio']:.3f}x", f"[{v['low']:.3f}, {v['high']:.3f}]",
                      f"{100 * (v['ratio'] / median - 1):+.1f}%", "yes" if within else "NO",
                      "yes" if holds else "NO"])
    table = tabulate(lines, headers=["run", "ratio", "95% interval", "vs median",
                                     f"within ±{100 * tolerance:.0f}% of median", "interval holds median"],
                     tablefmt="github", disable_numparse=True)
    return table + f"\nmedian of {len(verdicts)} ratios: {median:.3f}x", ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/ttft_stability.py", description=__doc__.split("\n\n")[0],
                                epilog="arguments after the known ones (or after --) go to every llm_attn.ttft run")
    p.add_argument("--runs", type=positive_int, default=5, help="fresh processes (default 5)")
    p.add_argument("--seq", type=positive_int, default=2048)
    p.add_argument("--model", default="auto")
    p.add_argument("--impl", default="llm_attn", help="implementation judged (default llm_attn)")
    p.add_argument("--stock", default="sdpa", help="the stock reference (default sdpa)")
    p.add_argument("--out-dir", default="ttft-stability", help="run{i}.jsonl go here (default ttft-stability)")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out-dir {out_dir}: {e.strerror or e}")
    stale = [out_dir / f"run{i}.jsonl" for i in range(args.runs) if (out_dir / f"run{i}.jsonl").exists()]
    if stale:
        p.error(f"--out-dir {out_dir}: {stale[0].name} exists already (rows are appended): use a new folder")
    verdicts = []
    for i in range(args.runs):
        cmd = run_command(i, args, extra)
        print(f"run {i + 1}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, check=False)  # noqa: S603 (our own CLI, arguments as a list)
        if proc.returncode == 130:
            return 130
        if proc.returncode != 0:
            print(f"error: run {i} exited with status {proc.returncode}", file=sys.stderr)
            return 2
        v = paired_verdict(out_dir / f"run{i}.jsonl", args.impl, args.stock, args.seq)
        if v is None:
            print(f"error: run {i} wrote no paired {args.impl} row with a 'vs {args.stock}' interval",
                  file=sys.stderr)
            return 2
        verdicts.append(v)
    table, ok = stability_table(verdicts)
    print(f"\n{args.impl} vs {args.stock}, seq {args.seq}, {args.runs} fresh processes "
          f"(ratio = {args.stock} p50 / {args.impl} p50, paired)\n" + table)
    print("stable: every run within ±2 % of the median and every interval holds it" if ok
          else "NOT stable: see the NO cells")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

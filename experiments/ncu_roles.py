"""Warp stall reasons per warp role of a warp-specialised kernel (issue 20's "ncu stall reasons per warp role"), from
ncu's PC sampling of one launch exported per SASS instruction.

    ncu --section SourceCounters --kernel-name regex:flash_fwd_sm90 --launch-skip 2 --launch-count 1 -o rep \\
        python .carry/ncu_probe.py 1 32 8 8192 128 0          # any script that launches the kernel
    ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > src.csv.gz
    python experiments/ncu_roles.py src.csv.gz [more.csv.gz ...]

The roles are found in the SASS by control flow, not by address: the consumer warpgroups enter their code after
`USETMAXREG.TRY_ALLOC` (setmaxnreg.inc), the producer after `USETMAXREG.DEALLOC` (setmaxnreg.dec); every
instruction reachable from one entry (fall-through and branch targets, so out-of-line wait loops count with the role
that branches to them) belongs to that role, the code before both (parameter loads, barrier init) to "prologue".
Samples are ncu's warp-state samples: "selected" means the warp was issuing, every other reason a stall. Per role
the table gives its share of all samples and the samples per reason as a share of the role's.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
import sys
from collections import defaultdict
from pathlib import Path

_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(0x[0-9a-f]+)")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


def read_source_csv(path: Path) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, rows) of `ncu --page source --csv --print-source sass`: the first line names the kernel, the
    second is the header, then one row per SASS instruction (Address, Source, counters, stall_* columns)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        lines = list(csv.reader(f))
    if len(lines) < 3 or lines[0][:1] != ["Kernel Name"] or "Address" not in lines[1]:
        raise SystemExit(f"{path}: not an `ncu --page source --csv --print-source sass` export (first lines: "
                         f"{lines[:2]!r:.200})")
    header = lines[1]
    return lines[0][1], [dict(zip(header, row)) for row in lines[2:] if len(row) == len(header)]


def roles(rows: list[dict[str, str]]) -> list[str]:
    """The role of every instruction: 'consumer', 'producer', 'both' or 'prologue' (see the module docstring)."""
    addr = [int(r["Address"], 16) for r in rows]
    index = {a: i for i, a in enumerate(addr)}
    src = [r["Source"].strip() for r in rows]

    def successors(i: int) -> list[int]:
        s = src[i]
        body = _PRED.sub("", s)
        out = []
        m = _BRANCH.search(s)
        if m and int(m.group(1), 16) in index:
            out.append(index[int(m.group(1), 16)])
        unconditional = not _PRED.match(s) and (body.startswith(("EXIT", "RET", "BRA ")) or body == "EXIT")
        if not unconditional and i + 1 < len(rows):
            out.append(i + 1)
        return out

    def reach(start: int) -> set[int]:
        seen, todo = set(), [start]
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            todo.extend(successors(i))
        return seen

    entries = {}
    for i, s in enumerate(src):
        if "USETMAXREG.TRY_ALLOC" in s:
            entries.setdefault("consumer", i)
        elif "USETMAXREG.DEALLOC" in s:
            entries.setdefault("producer", i)
    if set(entries) != {"consumer", "producer"}:
        raise SystemExit("no USETMAXREG.TRY_ALLOC / USETMAXREG.DEALLOC pair in this kernel's SASS: not the "
                         "warp-specialised kernel")
    cons, prod = reach(entries["consumer"]), reach(entries["producer"])
    return ["both" if i in cons and i in prod else "consumer" if i in cons else "producer" if i in prod
            else "prologue" for i in range(len(rows))]


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(rows: list[dict[str, str]], role_of: list[str]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(all samples per role, {role: {reason: samples}}) from the stall_* columns (not the "(Not Issued)" ones)."""
    reasons = [c for c in rows[0] if c.startswith("stall_") and not c.endswith("(Not Issued)")] if rows else []
    total: dict[str, float] = defaultdict(float)
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row, role in zip(rows, role_of, strict=True):
        total[role] += _num(row.get("Warp Stall Sampling (All Samples)", "0"))
        for c in reasons:
            per[role][c.removeprefix("stall_")] += _num(row[c])
    return dict(total), {k: dict(v) for k, v in per.items()}


def table(name: str, total: dict[str, float], per: dict[str, dict[str, float]], top: int = 7) -> str:
    from tabulate import tabulate

    all_samples = sum(total.values()) or 1.0
    out = []
    for role in ("consumer", "producer", "both", "prologue"):
        if role not in total:
            continue
        reasons = per.get(role, {})
        n = sum(reasons.values()) or 1.0
        best = sorted(reasons.items(), key=lambda kv: -kv[1])[:top]
        out.append([role, f"{100 * total[role] / all_samples:.1f} %",
                    ", ".join(f"{k} {100 * v / n:.0f} %" for k, v in best if v > 0)])
    return f"{name}\n" + tabulate(out, headers=["role", "share of samples", "reasons (share of the role's samples)"],
                                  tablefmt="github")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python experiments/ncu_roles.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", type=Path, help="ncu --page source --csv --print-source sass exports (.gz ok)")
    args = ap.parse_args(argv)
    for path in args.csv:
        name, rows = read_source_csv(path)
        total, per = summarise(rows, roles(rows))
        print(table(f"{path.name}: {name[:140]}", total, per), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reading result rows of several machines and merging them (``Merged``), keyed by run as well as by device and point.

A row of a report table is a fact about one run: its cells, and the stock rows its ``vs`` cells compare it with,
all come from the run (``run_id``) that measured it. Rows of several runs at one point are merged by two rules
(``load_rows``): within a run the newest row of a point wins (a re-measured point); an older run is left out at a
point where a newer run with the same configuration (device, model, dtype, batch, prompt source, kernel build)
re-measured everything it had there, and a note says which run was kept and why. Other overlapping runs are all
kept, and the tables show each run's rows apart (a ``run`` column)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from llm_attn.harness import flops
from llm_attn.harness.devices import Device, find_device
from llm_attn.harness.results import (
    NOT_JSON,
    READABLE_SCHEMAS,
    SCHEMA,
    numbered_lines,
    point_key,
    result_files,
    upgrade_row,
    validate_row,
)

STOCK_ORDER = ("sdpa", "eager", "flash_attention_2")


OURS = "llm_attn"
# Stock first, then ours, then the other built-ins; plugins (unknown here) after them, by name.


IMPL_ORDER = {i: n for n, i in enumerate(STOCK_ORDER + (OURS, "naive", "flex", "numba"))}


BREAKDOWN = (("attention", "attention"), ("gemm", "GEMM"), ("quant", "quantised weights"),
             ("other", "other kernels"), ("idle", "idle"))


def _impl_key(impl: str):
    return (IMPL_ORDER.get(impl, len(IMPL_ORDER)), impl)


def _is_stock(row: dict) -> bool:
    info = row.get("impl_info") or {}
    return bool(info["stock"]) if "stock" in info else row["impl"] in STOCK_ORDER


def _line_list(f, linenos: list[int]) -> str:
    shown = ", ".join(f"{f}:{n}" for n in linenos[:10])
    return shown + (f" and {len(linenos) - 10} more" if len(linenos) > 10 else "")


def load_rows(paths: list[str | Path], experiment: str | None = None) -> tuple[list[dict], list[str]]:
    """Valid rows of every result file (newest per run, device and point; runs superseded at a point left out, see
    the module docstring), and notes about what was left out. Rows of other formats (e.g. the kernel benchmark's,
    which share experiments/results/) are ignored with a ``note:``; lines that are not JSON objects, and rows of
    this format that fail validation, are skipped with a ``warning:`` naming them (file:line); runs left out at a
    point, and runs shown side by side at one, get one ``note:`` line each."""
    latest, notes, run_files = {}, [], defaultdict(set)
    for f in result_files(paths):
        corrupt, bad, foreign = [], [], 0
        for lineno, row in numbered_lines(f):
            if row is NOT_JSON or not isinstance(row, dict):
                corrupt.append(lineno)
                continue
            if row.get("schema") not in READABLE_SCHEMAS:
                foreign += 1
                continue
            row = upgrade_row(row)  # older schemas read in today's words
            try:
                validate_row(row)
            except ValueError:
                bad.append(lineno)
                continue
            if experiment is not None and row["experiment"] != experiment:
                continue
            key = (row["device"], row["run_id"]) + point_key(row)
            if key not in latest or row["time"] >= latest[key]["time"]:
                latest[key] = row
            run_files[row["run_id"]].add(str(f))
        if corrupt:
            notes.append(f"warning: {len(corrupt)} lines skipped (not a JSON object): {_line_list(f, corrupt)}")
        if bad:
            notes.append(f"warning: {len(bad)} {SCHEMA} rows skipped (they fail validation): {_line_list(f, bad)}")
        if foreign:
            notes.append(f"note: {f}: {foreign} rows of another format ignored")
    rows, run_notes = _drop_superseded_runs(list(latest.values()), run_files)
    return rows, notes + run_notes


def _prompt_source(row: dict) -> str | None:
    return (row.get("prompts") or {}).get("source")


def _build(row: dict) -> str | None:
    return (row.get("env") or {}).get("kernel_build")


def _run_text(run: str, rows: list[dict], run_files: dict[str, set]) -> str:
    return f"{run} ({', '.join(sorted(run_files.get(run, ()))) or '?'}, {min(r['time'] for r in rows)[:19]})"


def _drop_superseded_runs(rows: list[dict], run_files: dict[str, set]) -> tuple[list[dict], list[str]]:
    """At each point (device, model, dtype, batch, prompt source, seq): leave out a run whose (impl, measurement)
    pairs there a newer run of the same kernel build all re-measured; the kept run is the newest such. One note per
    kept run that replaced others, and one per set of runs kept side by side at some point."""
    groups: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        where = (r["device"], _model_label(r), r["batch"], _prompt_source(r), r["seq"])
        groups[where][r["run_id"]].append(r)
    dropped: set[tuple] = set()  # (where, run)
    replaced: dict[str, dict] = {}  # kept run -> {"runs": {dropped run: its rows}, "where": [where, ...]}
    together: dict[frozenset, list[tuple]] = defaultdict(list)
    for where, by_run in groups.items():
        if len(by_run) < 2:
            continue
        last = {run: max(r["time"] for r in by_run[run]) for run in by_run}
        newest_first = sorted(by_run, key=lambda run: last[run], reverse=True)
        what = {run: {(r["impl"], r["measurement"], point_key(r)[6], point_key(r)[8]) for r in by_run[run]}
                for run in newest_first}
        build = {run: {_build(r) for r in by_run[run]} for run in newest_first}
        for i, old in enumerate(newest_first):
            # Strictly newer: rows carry whole seconds, and two runs of one second cannot be ordered (both shown).
            newer = [run for run in newest_first[:i]
                     if last[run] > last[old] and build[run] == build[old] and what[old] <= what[run]]
            if newer:
                dropped.add((where, old))
                entry = replaced.setdefault(newer[0], {"runs": defaultdict(list), "where": []})
                entry["runs"][old] += by_run[old]
                if where not in entry["where"]:
                    entry["where"].append(where)
        kept = frozenset(run for run in newest_first if (where, run) not in dropped)
        if len(kept) > 1:
            together[kept].append(where)
    notes = []
    for run, entry in replaced.items():
        runs = entry["runs"]
        olds = "; ".join(_run_text(old, rs, run_files) for old, rs in runs.items())
        notes.append(f"note: kept run {_run_text(run, [r for g in groups.values() for r in g.get(run, [])], run_files)}"
                     f" over {'runs' if len(runs) > 1 else 'run'} {olds} at {_where_text(entry['where'])}: the newer "
                     f"run re-measured every point the older had there, with the same configuration; "
                     f"{sum(len(rs) for rs in runs.values())} older rows left out")
    for runs, wheres in together.items():
        builds = sorted({_build(r) or "none" for w in wheres for run in runs for r in groups[w][run]})
        why = f"different kernel builds ({', '.join(builds)})" if len(builds) > 1 else \
            "neither re-measured everything the other had there"
        notes.append(f"note: runs {', '.join(sorted(runs))} {'both' if len(runs) == 2 else 'all'} measured "
                     f"{_where_text(wheres)} and {why}: each run's "
                     f"rows are shown apart (run column), compared only with stock rows of the same run")
    return [r for r in rows if ((r["device"], _model_label(r), r["batch"], _prompt_source(r), r["seq"]), r["run_id"])
            not in dropped], notes


def _seq_order(seq) -> tuple:
    return (not isinstance(seq, int), seq if isinstance(seq, int) else 0, str(seq))


def _where_text(wheres: list[tuple]) -> str:
    """``cpu, tiny (fp32, float32), batch 1, seq 32, 64``: the points of one device, model and batch together."""
    parts: dict[tuple, list] = defaultdict(list)
    for device, label, batch, prompts, seq in wheres:
        parts[(device, label, batch, prompts)].append(seq)
    return "; ".join(f"{device}, {label}, batch {batch}{f', prompts {prompts}' if prompts else ''}, seq "
                     f"{', '.join(str(s) for s in sorted(seqs, key=_seq_order))}"
                     for (device, label, batch, prompts), seqs in parts.items())


def _model_label(row: dict) -> str:
    m = row["model"]
    label = f"{m.get('name')} ({m.get('quant')}, {row['dtype']})"
    if m.get("dequant_fallback"):
        label += " [DEQUANTISED FALLBACK]"
    tp = row.get("tp")
    if tp:  # tensor-parallel rows: one series per TP degree (and interconnect), never merged with another degree's
        label += f" TP={tp['degree']}" + (f" over {tp['interconnect']['kind']}" if tp["degree"] > 1 else "")
    return label


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class Merged:
    """Rows indexed by device, series (model, dtype, batch, prompt source), point and run, with the device-table
    entry of each device. ``get``/``ok`` without ``run`` give the newest run's row of a point (plots, side by side);
    with ``run``, that run's row (tables: a row's cells and its stock reference come from one run)."""

    def __init__(self, rows: list[dict], devices: list[Device]):
        self.rows = rows
        self.devices_table = devices
        self.device_rows: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            self.device_rows[r["device"]].append(r)
        self.device_name = {d: rs[0]["env"].get("device_name", d) for d, rs in self.device_rows.items()}
        self.entry = {d: find_device(self.device_name[d], devices) for d in self.device_rows}
        self.measured = sorted(self.device_rows, key=self._device_order)
        # (device, series, seq, impl, measurement) -> {run_id: row}
        self.index: dict[tuple, dict[str, dict]] = defaultdict(dict)
        self.run_start: dict[str, str] = {}
        for r in rows:
            run = r["run_id"]
            self.run_start[run] = min(self.run_start.get(run, r["time"]), r["time"])
            if r["measurement"] == "ttft_dataset":  # not a point of a length sweep: its own table (device_rows)
                continue
            self.index[(r["device"], self.series(r), r["seq"], r["impl"], r["measurement"])][run] = r

    def _device_order(self, slug):
        entry = self.entry.get(slug)
        peak = entry.peak_flops if entry else 0.0
        return (peak, slug)

    @staticmethod
    def series(r: dict) -> tuple:
        label = _model_label(r)
        source = _prompt_source(r)
        if source:  # text prompts are another configuration than seeded random ids: their own tables and plots
            label += f", prompts {Path(source).name}"
        return (label, r["batch"])

    def all_series(self) -> list[tuple]:
        return sorted({k[1] for k in self.index}, key=lambda s: (s[0], s[1]))

    def projectable_series(self) -> list[tuple]:
        """Series measured on at least one device of the table: projecting the CPU test model onto a GPU would
        say nothing."""
        return [s for s in self.all_series()
                if any(self.entry[d] is not None and self.seqs(d, s) for d in self.measured)]

    def get(self, device, series, seq, impl, measurement, run: str | None = None) -> dict | None:
        by_run = self.index.get((device, series, seq, impl, measurement))
        if not by_run:
            return None
        if run is not None:
            return by_run.get(run)
        return max(by_run.values(), key=lambda r: r["time"])

    def runs(self, device, series, seq=None) -> list[str]:
        """The runs with rows of this device and series (at ``seq``, where given), oldest first."""
        found = {run for k, by_run in self.index.items() if k[0] == device and k[1] == series
                 and (seq is None or k[2] == seq) for run in by_run}
        return sorted(found, key=lambda run: (self.run_start[run], run))

    def ok(self, *key, run: str | None = None) -> dict | None:
        r = self.get(*key, run=run)
        return r if r is not None and r["status"] == "ok" else None

    def seqs(self, device, series) -> list[int]:
        return sorted({k[2] for k in self.index if k[0] == device and k[1] == series})

    def impls(self, device, series) -> list[str]:
        found = {k[3] for k in self.index if k[0] == device and k[1] == series}
        return sorted(found, key=_impl_key)

    def geometry(self, series) -> dict | None:
        for r in self.rows:
            if self.series(r) == series and r["model"].get("config"):
                try:
                    return flops.geometry(r["model"]["config"])
                except ValueError:
                    return None
        return None

    def weight_bytes(self, series) -> float | None:
        for r in self.rows:
            if self.series(r) == series and r.get("status") == "ok" and r.get("bytes_per_token"):
                return r["bytes_per_token"]["weights"]
        for r in self.rows:
            if self.series(r) == series and r["model"].get("model_bytes"):
                return r["model"]["model_bytes"]
        return None

    def dtype_bytes(self, series) -> int:
        for r in self.rows:
            if self.series(r) == series:
                return {"float32": 4}.get(r["dtype"], 2)
        return 2


def _breakdown_rows(m: Merged, device: str, series: tuple) -> list[dict]:
    rows = [r for r in m.device_rows[device]
            if m.series(r) == series and r["measurement"] == "breakdown" and r["status"] == "ok"]
    return sorted(rows, key=lambda r: (r["seq"], _impl_key(r["impl"])))

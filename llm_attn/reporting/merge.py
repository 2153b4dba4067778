"""Reading result rows of several machines and merging them: the newest row per device and point (``Merged``)."""

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
    """Valid rows of every result file (newest per device and point), and notes about what was left out. Rows of
    other formats (e.g. the kernel benchmark's, which share experiments/results/) are ignored with a ``note:``;
    lines that are not JSON objects, and rows of this format that fail validation, are skipped with a
    ``warning:`` naming them (file:line)."""
    latest, notes = {}, []
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
            key = (row["device"],) + point_key(row)
            if key not in latest or row["time"] >= latest[key]["time"]:
                latest[key] = row
        if corrupt:
            notes.append(f"warning: {len(corrupt)} lines skipped (not a JSON object): {_line_list(f, corrupt)}")
        if bad:
            notes.append(f"warning: {len(bad)} {SCHEMA} rows skipped (they fail validation): {_line_list(f, bad)}")
        if foreign:
            notes.append(f"note: {f}: {foreign} rows of another format ignored")
    return list(latest.values()), notes


def _model_label(row: dict) -> str:
    m = row["model"]
    label = f"{m.get('name')} ({m.get('quant')}, {row['dtype']})"
    if m.get("dequant_fallback"):
        label += " [DEQUANTISED FALLBACK]"
    return label


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class Merged:
    """Rows indexed by device and by series (model, dtype, batch), with the device-table entry of each device."""

    def __init__(self, rows: list[dict], devices: list[Device]):
        self.rows = rows
        self.devices_table = devices
        self.device_rows: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            self.device_rows[r["device"]].append(r)
        self.device_name = {d: rs[0]["env"].get("device_name", d) for d, rs in self.device_rows.items()}
        self.entry = {d: find_device(self.device_name[d], devices) for d in self.device_rows}
        self.measured = sorted(self.device_rows, key=self._device_order)
        # (device, series, seq, impl, measurement) -> row
        self.index = {}
        for r in rows:
            if r["measurement"] == "ttft_dataset":  # not a point of a length sweep: its own table (device_rows)
                continue
            self.index[(r["device"], self.series(r), r["seq"], r["impl"], r["measurement"])] = r

    def _device_order(self, slug):
        entry = self.entry.get(slug)
        peak = entry.peak_flops if entry else 0.0
        return (peak, slug)

    @staticmethod
    def series(r: dict) -> tuple:
        return (_model_label(r), r["batch"])

    def all_series(self) -> list[tuple]:
        return sorted({k[1] for k in self.index}, key=lambda s: (s[0], s[1]))

    def projectable_series(self) -> list[tuple]:
        """Series measured on at least one device of the table: projecting the CPU test model onto a GPU would
        say nothing."""
        return [s for s in self.all_series()
                if any(self.entry[d] is not None and self.seqs(d, s) for d in self.measured)]

    def get(self, device, series, seq, impl, measurement) -> dict | None:
        return self.index.get((device, series, seq, impl, measurement))

    def ok(self, *key) -> dict | None:
        r = self.get(*key)
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

"""The table a sweep prints to the terminal by default: one line per (model, batch, impl, seq) with TTFT p50 and its
verdict against the first stock implementation (ratio, 95 % paired interval, words), and the notes, at most 120
characters wide. ``--wide`` prints every column instead (``sweep.summary_table``); both drop columns that are empty in
every row (e.g. peak memory and the bandwidth bound on CPU).

    from llm_attn.harness.compact import compact_table
    print(compact_table(rows))
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from llm_attn import registry
from llm_attn.harness.stats import ratio_header
from llm_attn.harness.sweep import drop_empty_columns, latest_rows, row_notes, verdict_cell

STOCK_IMPLS = ("sdpa", "eager", "flash_attention_2")  # the verdict is against the first one measured
WIDTH = 120  # the terminal most people read it in; a row wider than this wraps and is unreadable
_MODEL_CHARS = 24


def _model_cell(model: dict) -> str:
    name = str(model.get("name"))
    if len(name) > _MODEL_CHARS:  # a local checkpoint path: its folder's name says which
        name = Path(name).name[:_MODEL_CHARS]
    return f"{name} {model.get('quant')}" if model.get("quant") else name


def _cut(text: str, room: int) -> str:
    return text if len(text) <= room else text[:room - 1] + "…"


def _render(table: list[list], headers: list[str]) -> tuple[str, int]:
    out = tabulate(table, headers=headers, tablefmt="github", disable_numparse=True)
    return out, max(map(len, out.splitlines()))


def _fit(table: list[list], headers: list[str], width: int) -> str:
    """The table rendered within ``width`` characters: the notes (the last column) are cut, with '…', to fit, down to
    12 characters; past that the model names (the first column) are cut too."""
    out, wide = _render(table, headers)
    if wide <= width or not table or headers[-1] != "notes":
        return out
    _, bare = _render([row[:-1] + [""] for row in table], headers)
    room = max(width - bare + len(headers[-1]), 12)
    table = [row[:-1] + [_cut(row[-1], room)] for row in table]
    out, wide = _render(table, headers)
    if wide > width and headers[0] == "model":
        room = max(max(len(str(row[0])) for row in table) - (wide - width), len(headers[0]))
        out, _ = _render([[_cut(str(row[0]), room)] + row[1:] for row in table], headers)
    return out


def compact_table(rows: list[dict], width: int = WIDTH) -> str:
    """The default terminal table (module docstring); '' when no row has a TTFT measurement (then the caller prints
    the wide table)."""
    latest = [r for r in latest_rows(rows).values() if r["measurement"] == "ttft"]
    if not latest:
        return ""
    by_point = {(r["model"].get("name"), r["model"].get("quant"), r["dtype"], r["batch"], r["seq"], r["impl"]): r
                for r in latest}
    stock = next((s for s in STOCK_IMPLS if any(k[5] == s for k in by_point)), None)

    def p50(k, impl):
        r = by_point.get(k[:5] + (impl,))
        return r["stats"]["p50"] if r is not None and r["status"] == "ok" else None

    order = {i: n for n, i in enumerate(registry.names())}
    table = []
    for k in sorted(by_point, key=lambda k: (str(k[0]), str(k[1]), k[2], k[3], k[4], order.get(k[5], 99))):
        r = by_point[k]
        ok = r["status"] == "ok"
        table.append([_model_cell(r["model"]), k[3], k[5], k[4],
                      f"{r['stats']['p50']:.2f}" if ok else r["status"].upper(),
                      verdict_cell(r, stock, p50(k, stock), p50(k, k[5])) if stock and ok else "",
                      "; ".join(row_notes(r))])
    headers = ["model", "batch", "impl", "seq", "TTFT p50 ms", ratio_header(stock or "stock"), "notes"]
    if all(row[1] == 1 for row in table):
        table, headers = [row[:1] + row[2:] for row in table], headers[:1] + headers[2:]
    table, headers = drop_empty_columns(table, headers, keep=("model", "impl", "seq", "TTFT p50 ms"))
    out = _fit(table, headers, width)
    if any(r.get("vs") for r in latest if r["status"] == "ok") and stock:
        out += (f"\n(vs {stock}: {stock}'s TTFT median / this row's, with its 95 % paired-bootstrap interval over the "
                "repeats)")
    return out + "\n(--wide: every column: p90, stdev, decode tok/s, peak memory, ...)"

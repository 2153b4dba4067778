"""The PNG plots of the report: TTFT vs prompt length, speedup over stock, decode tok/s, prefill breakdown."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only: no display on CI machines or GPU hosts
import matplotlib.pyplot as plt  # noqa: E402

from llm_attn.harness.devices import Device  # noqa: E402
from llm_attn.harness.stats import BETTER, speed_ratio  # noqa: E402
from llm_attn.reporting.merge import (  # noqa: E402
    BREAKDOWN,
    IMPL_ORDER,
    STOCK_ORDER,
    Merged,
    _breakdown_rows,
    _is_stock,
)
from llm_attn.reporting.tables import projection  # noqa: E402


PANEL_W, PANEL_H = 5.2, 4.0  # inches per panel
MARKERS = ("o", "s", "^", "D", "v", "P")  # one per run, where a device has several runs of a series


def _grid(n: int):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    # Constrained layout sizes the margins to what is drawn (wrapped titles, rotated ticks, legends), so nothing is
    # cut off at the figure's edge.
    fig, axes = plt.subplots(rows, cols, figsize=(PANEL_W * cols, PANEL_H * rows), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _color(impl: str) -> str:
    """One colour per implementation across every panel and plot (plugins: a stable colour from the name)."""
    n = IMPL_ORDER.get(impl)
    if n is None:
        n = len(IMPL_ORDER) + sum(map(ord, impl)) % 3
    return f"C{n % 10}"


def _wrap(text: str, inches: float, fontsize: float = 12) -> str:
    """``text`` broken into lines that fit ``inches`` at ``fontsize`` points (an average glyph is ~0.55 em wide)."""
    return "\n".join(textwrap.wrap(text, width=max(20, int(inches * 72 / (0.55 * fontsize)))))


def _title(ax, text: str) -> None:
    ax.set_title(_wrap(text, PANEL_W * 0.85, 12))


def _minor_label(v: float, ax) -> str:
    """The minor ticks of a log axis that get a label: all of them on an axis shorter than 0.6 decades (it may have
    no major tick at all), at 2 and 5 times a power of ten up to three decades, none beyond: labelling every minor
    tick (6, 7, 8, 9, 60, ...) of a longer axis makes the labels overlap."""
    lo, hi = ax.get_ylim()
    if lo <= 0 or v <= 0:
        return ""
    decades = math.log10(hi / lo)
    mantissa = round(v / 10 ** math.floor(math.log10(v) + 1e-9), 6)
    if decades < 0.6 or (decades < 3 and mantissa in (2.0, 5.0)):
        return f"{v:g}"
    return ""


def _plain_log_y(ax):
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _minor_label(v, ax)))


def _log2_x(ax, seqs):
    ax.set_xscale("log", base=2)
    if seqs:
        # At most 8 labelled lengths (every other one beyond that), rotated: long sweeps never overlap their labels.
        step = max(1, math.ceil(len(seqs) / 8))
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(s) if n % step == 0 else "" for n, s in enumerate(seqs)], rotation=45)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, title: str, path: Path) -> None:
    fig.suptitle(_wrap(title, fig.get_figwidth() * 0.95, 13), fontsize=13)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_label(label: str, run: str, runs: list[str]) -> str:
    """A line's legend label: the run's id where the panel has lines of several runs (they are never merged)."""
    return f"{label}, run {run[:6]}" if len(runs) > 1 else label


def _projection_panel(ax, m: Merged, series: tuple, proj: list[Device], seqs: list[int], key: str, bound: str,
                      ylabel: str, log_y: bool, **legend) -> None:
    """The last panel of a plot: each table device's roofline projection of ``key``, dashed, labelled PROJECTED."""
    for dev in proj:
        p = projection(m, series, dev, seqs)
        if p:
            ax.plot([x["seq"] for x in p], [x[key] for x in p], linestyle="--", marker="o",
                    markerfacecolor="none", label=f"{dev.name} (projected)")
    _title(ax, f"PROJECTED: {bound}, not measured")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(ylabel)
    if log_y:
        _plain_log_y(ax)
    _log2_x(ax, seqs)
    ax.legend(**legend)


def plot_ttft(m: Merged, series: tuple, proj: list[Device], path: Path) -> None:
    devices = [d for d in m.measured if m.seqs(d, series)]
    all_seqs = sorted({s for d in devices for s in m.seqs(d, series)})
    panels = len(devices) + (1 if proj else 0)
    fig, axes = _grid(panels)
    for ax, d in zip(axes, devices):
        runs = m.runs(d, series)
        for impl in m.impls(d, series):
            for n, run in enumerate(runs):
                pts = [(s, r["stats"]["p50"]) for s in m.seqs(d, series)
                       if (r := m.ok(d, series, s, impl, "ttft", run=run))]
                if pts:
                    ax.plot(*zip(*pts), marker=MARKERS[n % len(MARKERS)], color=_color(impl),
                            label=_run_label(impl, run, runs))
        _title(ax, f"{m.device_name[d]} (measured)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT p50 (ms)")
        _plain_log_y(ax)
        _log2_x(ax, m.seqs(d, series))
        ax.legend()
    if proj:
        _projection_panel(axes[-1], m, series, proj, all_seqs, "ttft_ms", "roofline lower bound", "TTFT bound (ms)",
                          log_y=True)
    _save(fig, f"TTFT vs prompt length — {series[0]}, batch {series[1]}", path)


def plot_speedup(m: Merged, series: tuple, path: Path) -> bool:
    """TTFT speedup of every non-stock implementation over each stock one measured beside it; error bars: the
    95 % paired interval of rows measured paired."""
    devices = [d for d in m.measured if any(not _is_stock(r) for r in m.device_rows[d] if m.series(r) == series)]
    if not devices:
        return False
    fig, axes = _grid(len(devices))
    for ax, d in zip(axes, devices):
        impls = m.impls(d, series)
        stocks = [s for s in STOCK_ORDER if s in impls]
        mine = [i for i in impls if i not in STOCK_ORDER
                and not any(_is_stock(r) for r in m.device_rows[d] if r["impl"] == i)]
        styles = ("-", "--", ":", "-.")
        runs = m.runs(d, series)
        for impl, (n, stock), (k, run) in ((i, st, r) for i in mine for st in enumerate(stocks)
                                           for r in enumerate(runs)):
            pts, err = [], []
            for s in m.seqs(d, series):
                # Both rows of a point from one run: a ratio never divides one run's time by another's.
                got, ref = m.ok(d, series, s, impl, "ttft", run=run), m.ok(d, series, s, stock, "ttft", run=run)
                if got and ref:
                    # The paired ratio and its 95 % interval where measured paired; else the plain ratio.
                    iv = (got.get("vs") or {}).get(stock)
                    if iv:
                        pts.append((s, iv["ratio"]))
                        err.append((iv["ratio"] - iv["low"], iv["high"] - iv["ratio"]))
                    else:
                        pts.append((s, speed_ratio(ref["stats"]["p50"], got["stats"]["p50"])))
                        err.append((0.0, 0.0))
            if pts:
                xs, ys = zip(*pts)
                lo, hi = zip(*err)
                ax.errorbar(xs, ys, yerr=[lo, hi] if any(lo) or any(hi) else None,
                            marker=MARKERS[k % len(MARKERS)], capsize=3, color=_color(impl),
                            linestyle=styles[n % len(styles)], label=_run_label(f"{impl} vs {stock}", run, runs))
        ax.axhline(1.0, color="gray", linewidth=1)
        _title(ax, f"{m.device_name[d]} (measured)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"TTFT ratio, stock / impl ({BETTER})")
        _log2_x(ax, m.seqs(d, series))
        ax.legend(fontsize="small")
    _save(fig, f"TTFT vs stock attention ({BETTER}) — {series[0]}, batch {series[1]}", path)
    return True


def plot_breakdown(m: Merged, series: tuple, path: Path) -> bool:
    """Stacked bars: one per (impl, seq), segments attention / GEMM / quantised weights / other / idle in ms."""
    devices = [d for d in m.measured if _breakdown_rows(m, d, series)]
    if not devices:
        return False
    fig, axes = _grid(len(devices))
    for ax, d in zip(axes, devices):
        rows = _breakdown_rows(m, d, series)
        labels = [f"{r['impl']}\n{r['seq']}" for r in rows]
        bottom = [0.0] * len(rows)
        for n, (cat, label) in enumerate(BREAKDOWN):
            vals = [r["category_ms"][cat] for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=label, color=("C3", "C0", "C1", "C7", "0.85")[n],
                   edgecolor="white", linewidth=0.5)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize="small", rotation=45 if len(rows) > 6 else 0)
        ax.set_ylabel("profiled prefill time (ms)")
        gpu = any(r.get("device_type") == "cuda" for r in rows)
        _title(ax, f"{m.device_name[d]} (measured{'' if gpu else '; CPU: ATen op self time'})")
        ax.legend(fontsize="small")
    _save(fig, f"Where prefill time goes — {series[0]}, batch {series[1]} (impl / prompt tokens)", path)
    return True


def plot_decode(m: Merged, series: tuple, proj: list[Device], path: Path) -> bool:
    devices = [d for d in m.measured
               if any(m.ok(d, series, s, i, k) for s in m.seqs(d, series) for i in m.impls(d, series)
                      for k in ("decode_generate", "decode_graph"))]
    if not devices:
        return False
    all_seqs = sorted({s for d in devices for s in m.seqs(d, series)})
    fig, axes = _grid(len(devices) + (1 if proj else 0))
    for ax, d in zip(axes, devices):
        runs = m.runs(d, series)
        for impl in m.impls(d, series):
            color = _color(impl)
            for (kind, style), (n, run) in ((k, r) for k in (("decode_generate", "-"), ("decode_graph", ":"))
                                            for r in enumerate(runs)):
                pts = [(s, r["tok_s"]) for s in m.seqs(d, series) if (r := m.ok(d, series, s, impl, kind, run=run))]
                if pts:
                    ax.plot(*zip(*pts), marker=MARKERS[n % len(MARKERS)], linestyle=style, color=color,
                            label=_run_label(f"{impl} ({kind.split('_')[1]})", run, runs))
        _title(ax, f"{m.device_name[d]} (measured)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode tok/s per sequence")
        _log2_x(ax, m.seqs(d, series))
        ax.legend(fontsize="small")
    if proj:
        _projection_panel(axes[-1], m, series, proj, all_seqs, "decode_tok_s", "bandwidth upper bound",
                          "decode tok/s bound", log_y=False, fontsize="small")
    _save(fig, f"Decode speed — {series[0]}, batch {series[1]} (solid: generate, dotted: CUDA graph)", path)
    return True

"""TTFT vs prompt length, stacked by kernel class (issue 34, item 5): the picture of where an attention kernel can
matter. From the ``breakdown`` rows of a series (``experiments/long.toml``: 8k..128k), for each device: one group of
bars per prompt length, one bar per implementation, each bar the profiled prefill split into attention / GEMM /
quantised weights / other kernels / idle (``harness.breakdown``); a black diamond marks the same run's measured
TTFT p50 where it has one (the profiled span carries the profiler's overhead). A second panel shows the same bars as
shares of the prefill: attention's share growing with the prompt is what an attention kernel can still win.
"""

from __future__ import annotations

from pathlib import Path

from llm_attn.reporting.merge import BREAKDOWN, IMPL_ORDER
from llm_attn.reporting.plots import plt

SEGMENT_COLORS = ("C3", "C0", "C1", "C7", "0.85")  # attention, GEMM, quantised weights, other, idle (as plot_breakdown)


def _impl_key(impl: str):
    return (IMPL_ORDER.get(impl, len(IMPL_ORDER)), impl)


def _newest(rows: list[dict], measurement: str) -> dict[tuple, dict]:
    """(impl, seq) -> the newest ok row of ``measurement``."""
    out = {}
    for r in rows:
        if r.get("measurement") == measurement and r.get("status") == "ok":
            k = (r["impl"], r["seq"])
            if k not in out or r["time"] >= out[k]["time"]:
                out[k] = r
    return out


def _ttft_of_run(rows: list[dict], impl: str, seq: int, run_id: str) -> float | None:
    """The measured TTFT p50 of the same run at this point: a bar never carries another run's number."""
    for r in rows:
        if (r.get("measurement") == "ttft" and r.get("status") == "ok" and r["impl"] == impl and r["seq"] == seq
                and r.get("run_id") == run_id):
            return r["stats"]["p50"]
    return None


def _tokens(seq: int) -> str:
    return f"{seq // 1024}k" if seq >= 1024 and seq % 1024 == 0 else str(seq)


def stacked_points(rows: list[dict]) -> tuple[list[int], list[str], dict[tuple, dict]]:
    """(lengths, implementations, (impl, seq) -> breakdown row) of one device's rows of one series."""
    bd = _newest(rows, "breakdown")
    seqs = sorted({s for _, s in bd})
    impls = sorted({i for i, _ in bd}, key=_impl_key)
    return seqs, impls, bd


def plot_ttft_stacked_rows(by_device: dict[str, list[dict]], device_names: dict[str, str], title: str,
                           path: Path) -> bool:
    """The plot (see the module docstring) from each device's rows of one series; False (nothing written) where no
    device has breakdown rows at two lengths or more."""
    devices = [d for d, rows in by_device.items() if len(stacked_points(rows)[0]) >= 2]
    if not devices:
        return False
    fig, axes = plt.subplots(len(devices), 2, figsize=(14, 5.2 * len(devices)), squeeze=False,
                             layout="constrained")
    for (ax_ms, ax_pct), d in zip(axes, devices):
        rows = by_device[d]
        seqs, impls, bd = stacked_points(rows)
        width = 0.8 / len(impls)
        centers, names = [], []
        for g, seq in enumerate(seqs):
            for n, impl in enumerate(impls):
                r = bd.get((impl, seq))
                if r is None:
                    continue
                x = g + (n - (len(impls) - 1) / 2) * width
                centers.append(x)
                names.append(impl)
                ms = [r["category_ms"].get(cat, 0.0) for cat, _ in BREAKDOWN]
                total = sum(ms) or 1.0
                for ax, vals in ((ax_ms, ms), (ax_pct, [100 * v / total for v in ms])):
                    bottom = 0.0
                    for v, color in zip(vals, SEGMENT_COLORS):
                        ax.bar(x, v, width * 0.92, bottom=bottom, color=color, edgecolor="white", linewidth=0.5)
                        bottom += v
                share = 100 * ms[0] / total  # attention is the first segment: its share, written inside it
                if share >= 8:
                    ax_pct.text(x, share / 2, f"{share:.0f}%", ha="center", va="center", color="white",
                                fontsize=7, rotation=90)
                ttft = _ttft_of_run(rows, impl, seq, r.get("run_id"))
                if ttft is not None:
                    ax_ms.plot([x], [ttft], marker="D", color="black", markersize=5, zorder=5)
        gpu = any(r.get("device_type") == "cuda" for r in bd.values())
        idle = "GPU idle" if gpu else "idle (host, no op)"
        for ax in (ax_ms, ax_pct):
            ax.set_xticks(range(len(seqs)))
            ax.set_xticklabels([f"{_tokens(s)} tokens" for s in seqs])
            ax.tick_params(axis="x", which="major", pad=58, length=0)
            ax.xaxis.remove_overlapping_locs = False  # a middle bar's label sits where its group's is
            ax.set_xticks(centers, minor=True)
            ax.set_xticklabels(names, minor=True, rotation=90, fontsize=7)
            ax.tick_params(axis="x", which="minor", length=2)
            ax.grid(True, axis="y", alpha=0.3)
        ax_ms.set_ylabel("profiled prefill (ms)")
        ax_pct.set_ylabel("share of the profiled prefill (%)")
        ax_pct.set_ylim(0, 100)
        where = "" if gpu else "; CPU: ATen op self time"
        ax_ms.set_title(f"{device_names.get(d, d)} (measured{where}): time by kernel class")
        ax_pct.set_title("the same, as shares: attention's is what an attention kernel can win")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SEGMENT_COLORS]
        labels = [idle if cat == "idle" else label for (cat, label) in BREAKDOWN]
        handles.append(plt.Line2D([], [], marker="D", color="black", linestyle="none", markersize=5))
        labels.append("measured TTFT p50 (same run)")
        ax_ms.legend(handles, labels, fontsize="small", loc="upper left")
    fig.suptitle(title, fontsize=13)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_ttft_stacked(m, series: tuple, path: Path) -> bool:
    """``plot_ttft_stacked_rows`` over a report's merged rows (``reporting.merge.Merged``) for one series."""
    by_device = {d: [r for r in m.device_rows[d] if m.series(r) == series] for d in m.measured}
    return plot_ttft_stacked_rows(by_device, dict(m.device_name),
                                  f"TTFT vs prompt length by kernel class — {series[0]}, batch {series[1]}", path)

"""Merge result files from several machines into one comparison: a markdown report and PNG plots.

    python -m llm_attn.report experiments/results --out experiments/reports/default
    python -m llm_attn.report h100.jsonl rtx4060ti.jsonl --out /tmp/report --experiment default

Reads every ``*.jsonl`` result file named or found under the folders named (rows of ``python -m llm_attn.ttft``
and ``python -m llm_attn.experiment``), keeps the newest row per device and point, and writes to --out:

- ``report.md``: per measured device, TTFT (p50/p90/stdev%), model TFLOP/s and % of the datasheet fp16 peak,
  speedup of each implementation over each stock one, decode tok/s (generate and CUDA graph) with the fraction of
  the weight-bandwidth bound, peak memory, correctness, and the points that ran out of memory or failed; then the
  devices side by side; then, in a separate section, roofline projections for table devices with no results.
- ``ttft_vs_seq*.png``, ``speedup*.png``, ``decode_tok_s*.png`` (one set per model/dtype/batch), and
  ``breakdown*.png`` (where each profiled prefill's time went, a stacked bar per implementation and prompt length,
  from ``--measure breakdown`` rows).

Every implementation is listed with its source (built-in, or plugin file / package and version) and how many of
its attention calls fell back to the stock path.

Peaks and bandwidths come from ``experiments/devices.toml``. Projections are always labelled as such, in their
own tables and their own plot panels, never mixed with measurements.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only: no display on CI machines or GPU hosts
import matplotlib.pyplot as plt  # noqa: E402
from tabulate import tabulate  # noqa: E402

from llm_attn.harness import flops  # noqa: E402
from llm_attn.harness.devices import Device, find_device, load_devices  # noqa: E402
from llm_attn.harness.results import SCHEMA, iter_rows, point_key, result_files, validate_row  # noqa: E402

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

METHOD = """\
**How the numbers are made.** TTFT = prefill forward over exactly `seq` prompt tokens (fresh cache, logits of
the last position only) plus greedy sampling of the first token, timed with CUDA events after warm-up at the
same shape; p50/p90 over the repeats, raw samples in the JSONL rows. Decode *generate* = `model.generate` with
the default cache, tokens 2..N each timed as it reaches the host (the first token is TTFT and is excluded);
decode *graph* = static KV cache with one decode step replayed from a CUDA graph (the kernel-limited speed).

**%-of-peak** uses model FLOPs, since attention alone is not timed end to end:
`F = 2·P_layers·B·S + 2·vocab·hidden·B + 2·L·B·Hq·S²·D`
(decoder-layer matmuls; the LM head on the last position; causal attention QKᵀ and PV, 4·S²·D halved),
with `P_layers = L·(hidden·D·(2·Hq + 2·Hkv) + 3·hidden·intermediate)`; TFLOP/s = F / TTFT p50, compared with the
dense fp16 tensor-core peak of the device table. An int4 AWQ model still does its matmuls in fp16 after
dequantisation, so the same peak applies.

**Decode bandwidth bound**: tok/s ≤ bandwidth / bytes per step, where bytes per step = every weight as stored
(int4 packed weights, scales and zeros for AWQ; the embedding table only for its B rows) + the K/V cache read
once at the mean context length. The fraction shown is measured tok/s over that bound."""


# -- loading --------------------------------------------------------------------------------------------------------
def load_rows(paths: list[str | Path], experiment: str | None = None) -> tuple[list[dict], list[str]]:
    """Valid rows of every result file (newest per device and point), and notes about what was left out. Rows of
    other formats (e.g. the kernel benchmark's, which share experiments/results/) are ignored; rows of this
    format that fail validation are reported."""
    latest, notes = {}, []
    for f in result_files(paths):
        bad = foreign = 0
        for row in iter_rows(f):
            if row.get("schema") != SCHEMA:
                foreign += 1
                continue
            try:
                validate_row(row)
            except ValueError:
                bad += 1
                continue
            if experiment is not None and row["experiment"] != experiment:
                continue
            key = (row["device"],) + point_key(row)
            if key not in latest or row["time"] >= latest[key]["time"]:
                latest[key] = row
        if bad:
            notes.append(f"warning: {f}: {bad} {SCHEMA} rows skipped (they fail validation)")
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
            self.index[(r["device"], self.series(r), r["seq"], r["impl"], r["measurement"])] = r

    def _device_order(self, slug):
        entry = self.entry.get(slug)
        peak = entry.peak_flops if entry else 0.0
        return (peak, slug)

    @staticmethod
    def series(r: dict) -> tuple:
        return (_model_label(r), r["batch"])

    def all_series(self) -> list[tuple]:
        return sorted({self.series(r) for r in self.rows}, key=lambda s: (s[0], s[1]))

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


# -- markdown -------------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}"):
    return "" if x is None else fmt.format(x)


def _sig(x):
    """About three significant digits, never in scientific notation (tables are read by people)."""
    if x is None:
        return ""
    for limit, fmt in ((100, "{:.0f}"), (10, "{:.1f}"), (1, "{:.2f}")):
        if abs(x) >= limit:
            return fmt.format(x)
    return f"{x:.3g}"


def _status_cell(r):
    return r["status"].upper() if r is not None and r["status"] != "ok" else ""


def device_table(m: Merged, device: str, series: tuple) -> str:
    entry = m.entry[device]
    geom = m.geometry(series)
    batch = series[1]
    impls = m.impls(device, series)
    stocks = [s for s in STOCK_ORDER if s in impls]
    lines = []
    for seq in m.seqs(device, series):
        for impl in impls:
            t = m.get(device, series, seq, impl, "ttft")
            dg = m.get(device, series, seq, impl, "decode_generate")
            dgr = m.get(device, series, seq, impl, "decode_graph")
            if t is None and dg is None and dgr is None:
                continue
            p50 = t["stats"]["p50"] if t is not None and t["status"] == "ok" else None
            tflops = flops.prefill_flops(geom, batch, seq) / (p50 * 1e-3) / 1e12 if p50 and geom else None
            pct = 100 * tflops / entry.fp16_tensor_tflops if tflops and entry else None
            speed = []
            for s in stocks:
                ref = m.ok(device, series, seq, s, "ttft")
                speed.append(_f(ref["stats"]["p50"] / p50, "{:.2f}x") if ref and p50 else "")
            bw = None
            if dgr is not None and dgr["status"] == "ok" and entry:
                bw = 100 * dgr["tok_s"] * dgr["bytes_per_token"]["total"] / entry.bandwidth_bytes_s
            peak = max((x.get("peak_mem_bytes") or 0) for x in (t, dg, dgr) if x is not None) or None
            lines.append([
                seq, impl,
                _f(p50) or _status_cell(t), _f(t["stats"]["p90"]) if p50 else "",
                _f(t["stats"]["stdev_pct"], "{:.1f}") if p50 else "",
                _sig(tflops), _f(pct, "{:.1f}%"), *speed,
                _f(dg["tok_s"], "{:.1f}") if dg is not None and dg["status"] == "ok" else _status_cell(dg),
                _f(dgr["tok_s"], "{:.1f}") if dgr is not None and dgr["status"] == "ok" else _status_cell(dgr),
                _f(bw, "{:.0f}%"),
                _f(peak / 2**30 if peak else None),
            ])
    headers = ["seq", "impl", "TTFT p50 ms", "p90 ms", "stdev %", "model TFLOP/s", "% fp16 peak",
               *[f"vs {s}" for s in stocks], "decode tok/s (generate)", "decode tok/s (graph)",
               "graph % of BW bound", "peak GiB"]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def correctness_md(m: Merged, device: str) -> str:
    lines = []
    for r in sorted(m.device_rows[device], key=lambda r: (_model_label(r), r["batch"], r["seq"])):
        if r["measurement"] != "correctness":
            continue
        if r["status"] != "ok":
            lines.append([_model_label(r), r["batch"], r["seq"], r["impl"], "", r["status"].upper(), ""])
        else:
            lines.append([_model_label(r), r["batch"], r["seq"], r["impl"], r["reference_impl"],
                          f"{r['max_abs_logit_diff']:.3g}", f"{100 * r['greedy_agreement']:.1f}%"])
    if not lines:
        return ""
    return tabulate(lines, headers=["model", "batch", "seq", "impl", "vs", "max abs logit diff", "greedy agreement"],
                    tablefmt="github", disable_numparse=True)


def failures_md(m: Merged, device: str) -> str:
    lines = [[_model_label(r), r["batch"], r["seq"], r["impl"], r["measurement"], r["status"].upper(),
              f"{r['error']['type']}: {r['error']['message'][:120]}".replace("|", "/").replace("\n", " ")]
             for r in m.device_rows[device] if r["status"] != "ok"]
    if not lines:
        return ""
    return tabulate(sorted(lines, key=lambda x: (x[0], x[1], x[2])),
                    headers=["model", "batch", "seq", "impl", "measurement", "status", "error"], tablefmt="github",
                    disable_numparse=True)


def env_md(m: Merged) -> str:
    lines = []
    for d in m.measured:
        env = m.device_rows[d][0]["env"]
        model = m.device_rows[d][0]["model"]
        entry = m.entry[d]
        lines.append([d, m.device_name[d], env.get("compute_capability", ""), env.get("sms", ""),
                      env.get("driver", "") or "", env.get("cuda_runtime", "") or "", env.get("torch", ""),
                      env.get("transformers", ""), model.get("awq_backend") or "",
                      (env.get("git_sha") or env.get("llm_attn_git") or "")[:12], len(m.device_rows[d]),
                      entry.name if entry else "not in table"])
    return tabulate(lines, headers=["device", "GPU", "CC", "SMs", "driver", "CUDA", "torch", "transformers",
                                    "AWQ backend", "git", "rows", "datasheet entry"], tablefmt="github",
                    disable_numparse=True)


def side_by_side_md(m: Merged, series: tuple, measurement: str, value) -> str:
    devices = [d for d in m.measured if m.seqs(d, series)]
    if len(devices) < 2:
        return ""
    keys = sorted({(seq, impl) for d in devices for seq in m.seqs(d, series) for impl in m.impls(d, series)},
                  key=lambda k: (k[0], _impl_key(k[1])))
    lines = []
    for seq, impl in keys:
        cells = []
        for d in devices:
            r = m.get(d, series, seq, impl, measurement)
            cells.append(_f(value(r)) if r is not None and r["status"] == "ok" else _status_cell(r))
        lines.append([seq, impl, *cells])
    return tabulate(lines, headers=["seq", "impl", *[m.device_name[d] for d in devices]], tablefmt="github",
                    disable_numparse=True)


# -- projections ----------------------------------------------------------------------------------------------------
def projected_devices(m: Merged, only: list[str] | None) -> list[Device]:
    measured = {e.slug for e in m.entry.values() if e is not None}
    out = [d for d in m.devices_table if d.slug not in measured]
    if only is not None:
        unknown = set(only) - {d.slug for d in m.devices_table}
        if unknown:
            raise ValueError(f"--project: unknown devices {sorted(unknown)}; the table has "
                             f"{[d.slug for d in m.devices_table]}")
        out = [d for d in out if d.slug in only]
    return out


def projection(m: Merged, series: tuple, dev: Device, seqs: list[int], new_tokens: int = 32) -> list[dict]:
    """Roofline bounds (not measurements): TTFT >= max(F / peak FLOP/s, weight bytes / bandwidth); decode tok/s <=
    bandwidth / (weight bytes + K/V bytes)."""
    geom, weights = m.geometry(series), m.weight_bytes(series)
    if geom is None or weights is None:
        return []
    batch = series[1]
    out = []
    for seq in seqs:
        f = flops.prefill_flops(geom, batch, seq)
        t_compute, t_memory = f / dev.peak_flops, weights / dev.bandwidth_bytes_s
        kv = flops.kv_bytes_per_token(geom, batch, seq + new_tokens / 2, m.dtype_bytes(series))
        out.append({"seq": seq, "ttft_ms": 1e3 * max(t_compute, t_memory),
                    "bound": "compute" if t_compute >= t_memory else "memory",
                    "decode_tok_s": dev.bandwidth_bytes_s / (weights + kv)})
    return out


def projection_md(m: Merged, series: tuple, devs: list[Device], seqs: list[int]) -> str:
    lines = []
    for dev in devs:
        for p in projection(m, series, dev, seqs):
            lines.append([dev.name, p["seq"], _sig(p["ttft_ms"]), p["bound"], _sig(p["decode_tok_s"])])
    if not lines:
        return ""
    return tabulate(lines, headers=["device (PROJECTED)", "seq", "TTFT lower bound ms", "bound by",
                                    "decode tok/s upper bound"], tablefmt="github", disable_numparse=True)


# -- plots ----------------------------------------------------------------------------------------------------------
def _grid(n: int):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
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


def _plain_log_y(ax):
    ax.set_yscale("log")
    fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)


def _log2_x(ax, seqs):
    ax.set_xscale("log", base=2)
    if seqs:
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(s) for s in seqs], rotation=45)
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(m: Merged, series: tuple, proj: list[Device], path: Path) -> None:
    devices = [d for d in m.measured if m.seqs(d, series)]
    all_seqs = sorted({s for d in devices for s in m.seqs(d, series)})
    panels = len(devices) + (1 if proj else 0)
    fig, axes = _grid(panels)
    for ax, d in zip(axes, devices):
        for impl in m.impls(d, series):
            pts = [(s, r["stats"]["p50"]) for s in m.seqs(d, series) if (r := m.ok(d, series, s, impl, "ttft"))]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=_color(impl), label=impl)
        ax.set_title(f"{m.device_name[d]} (measured)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT p50 (ms)")
        _plain_log_y(ax)
        _log2_x(ax, m.seqs(d, series))
        ax.legend()
    if proj:
        ax = axes[-1]
        for dev in proj:
            p = projection(m, series, dev, all_seqs)
            if p:
                ax.plot([x["seq"] for x in p], [x["ttft_ms"] for x in p], linestyle="--", marker="o",
                        markerfacecolor="none", label=f"{dev.name} (projected)")
        ax.set_title("PROJECTED: roofline lower bound, not measured")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT bound (ms)")
        _plain_log_y(ax)
        _log2_x(ax, all_seqs)
        ax.legend()
    _save(fig, f"TTFT vs prompt length — {series[0]}, batch {series[1]}", path)


def plot_speedup(m: Merged, series: tuple, path: Path) -> bool:
    """TTFT speedup of every non-stock implementation over each stock one measured beside it."""
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
        for impl in mine:
            for n, stock in enumerate(stocks):
                pts = []
                for s in m.seqs(d, series):
                    got, ref = m.ok(d, series, s, impl, "ttft"), m.ok(d, series, s, stock, "ttft")
                    if got and ref:
                        pts.append((s, ref["stats"]["p50"] / got["stats"]["p50"]))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=_color(impl), linestyle=styles[n % len(styles)],
                            label=f"{impl} vs {stock}")
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_title(f"{m.device_name[d]} (measured)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT speedup (stock p50 / impl p50)")
        _log2_x(ax, m.seqs(d, series))
        ax.legend(fontsize="small")
    _save(fig, f"TTFT speedup over stock attention — {series[0]}, batch {series[1]}", path)
    return True


def _breakdown_rows(m: Merged, device: str, series: tuple) -> list[dict]:
    rows = [r for r in m.device_rows[device]
            if m.series(r) == series and r["measurement"] == "breakdown" and r["status"] == "ok"]
    return sorted(rows, key=lambda r: (r["seq"], _impl_key(r["impl"])))


def breakdown_md(m: Merged, device: str, series: tuple) -> str:
    lines = []
    for r in _breakdown_rows(m, device, series):
        ms, pct = r["category_ms"], r["category_pct"]
        t = m.ok(device, series, r["seq"], r["impl"], "ttft")
        p50 = t["stats"]["p50"] if t else None
        lines.append([r["seq"], r["impl"], _f(r["span_ms"]),
                      *(f"{ms[c]:.2f} ({pct[c]:.0f}%)" if pct.get(c) is not None else "" for c, _ in BREAKDOWN),
                      _f(r["ttft_if_attention_zero_ms"]),
                      _f(p50 - ms["attention"] if p50 is not None else None), r["attention_attribution"]])
    if not lines:
        return ""
    return tabulate(lines, headers=["seq", "impl", "profiled prefill ms", *(label for _, label in BREAKDOWN),
                                    "TTFT if attention took 0 ms (profiled)", "same, from TTFT p50",
                                    "attention found by"], tablefmt="github", disable_numparse=True)


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
        ax.set_xticklabels(labels, fontsize="small")
        ax.set_ylabel("profiled prefill time (ms)")
        gpu = any(r.get("device_type") == "cuda" for r in rows)
        ax.set_title(f"{m.device_name[d]} (measured{'' if gpu else '; CPU: ATen op self time'})")
        ax.legend(fontsize="small")
    _save(fig, f"Where prefill time goes — {series[0]}, batch {series[1]} (impl / prompt tokens)", path)
    return True


def implementations_md(m: Merged) -> str:
    """Each implementation once: where it came from, what it is, and how many attention calls fell back."""
    seen: dict[str, dict] = {}
    for r in m.rows:
        info = r.get("impl_info")
        entry = seen.setdefault(r["impl"], {"info": info, "impl": 0, "fallback": 0, "reasons": {}})
        entry["info"] = entry["info"] or info
        calls = r.get("attention_calls")
        if calls:
            entry["impl"] += calls.get("impl", 0)
            entry["fallback"] += calls.get("stock_fallback", 0)
            for k, v in (calls.get("fallback_reasons") or {}).items():
                entry["reasons"][k] = entry["reasons"].get(k, 0) + v
    lines = []
    for impl in sorted(seen, key=_impl_key):
        e = seen[impl]
        info = e["info"] or {}
        src = info.get("source") or {}
        kind = src.get("kind", "unknown")
        where = src.get("path") or src.get("module") or ""
        if src.get("package"):
            where = f"{src['package']} {src.get('version') or ''}".strip()
        stock = info.get("stock", impl in STOCK_ORDER)
        reasons = "; ".join(f"{v} x {k}" for k, v in sorted(e["reasons"].items(), key=lambda kv: -kv[1]))[:200]
        lines.append([impl, kind, where, info.get("description", ""),
                      "stock (transformers)" if stock else e["impl"], "" if stock else e["fallback"],
                      reasons.replace("|", "/")])
    return tabulate(lines, headers=["impl", "source", "path / package", "description", "calls on impl",
                                    "calls on stock (fallback)", "fallback reasons"], tablefmt="github",
                    disable_numparse=True)


def plot_decode(m: Merged, series: tuple, proj: list[Device], path: Path) -> bool:
    devices = [d for d in m.measured
               if any(m.ok(d, series, s, i, k) for s in m.seqs(d, series) for i in m.impls(d, series)
                      for k in ("decode_generate", "decode_graph"))]
    if not devices:
        return False
    all_seqs = sorted({s for d in devices for s in m.seqs(d, series)})
    fig, axes = _grid(len(devices) + (1 if proj else 0))
    for ax, d in zip(axes, devices):
        for impl in m.impls(d, series):
            color = _color(impl)
            for kind, style in (("decode_generate", "-"), ("decode_graph", ":")):
                pts = [(s, r["tok_s"]) for s in m.seqs(d, series) if (r := m.ok(d, series, s, impl, kind))]
                if pts:
                    ax.plot(*zip(*pts), marker="o", linestyle=style, color=color,
                            label=f"{impl} ({kind.split('_')[1]})")
        ax.set_title(f"{m.device_name[d]} (measured)")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode tok/s per sequence")
        _log2_x(ax, m.seqs(d, series))
        ax.legend(fontsize="small")
    if proj:
        ax = axes[-1]
        for dev in proj:
            p = projection(m, series, dev, all_seqs)
            if p:
                ax.plot([x["seq"] for x in p], [x["decode_tok_s"] for x in p], linestyle="--", marker="o",
                        markerfacecolor="none", label=f"{dev.name} (projected)")
        ax.set_title("PROJECTED: bandwidth upper bound, not measured")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("decode tok/s bound")
        _log2_x(ax, all_seqs)
        ax.legend(fontsize="small")
    _save(fig, f"Decode speed — {series[0]}, batch {series[1]} (solid: generate, dotted: CUDA graph)", path)
    return True


# -- the report -----------------------------------------------------------------------------------------------------
def write_report(paths: list[str | Path], out_dir: str | Path, devices_path: str | Path | None = None,
                 experiment: str | None = None, project: list[str] | None = None,
                 no_projection: bool = False) -> Path:
    rows, warnings = load_rows(paths, experiment)
    if not rows:
        raise ValueError(f"no result rows found in {[str(p) for p in paths]}"
                         + (f" for experiment {experiment!r}" if experiment else ""))
    m = Merged(rows, load_devices(devices_path))
    proj = [] if no_projection or not m.projectable_series() else projected_devices(m, project)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series_list = m.all_series()
    md = ["# llm_attn: TTFT and decode across devices\n",
          f"Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} by `python -m llm_attn.report` "
          f"from {len(rows)} rows in {len(result_files(paths))} file(s)"
          + (f", experiment `{experiment}`" if experiment else "") + ".\n",
          "## Measured devices\n", env_md(m), "", METHOD, "",
          "## Attention implementations\n",
          "Source: `built-in` (llm_attn/impls/), `plugin` (a --plugin file or module), `entry-point` (an installed "
          "package's `llm_attn.attention` entry point). Calls are summed over the rows (warm-up included).\n",
          implementations_md(m), ""]
    md += [f"> {w}\n" for w in warnings]
    for d in m.measured:
        entry = m.entry[d]
        md.append(f"## {m.device_name[d]} — measured\n")
        md.append(f"Datasheet: {entry.name}, {entry.fp16_tensor_tflops:g} TFLOP/s fp16 dense, "
                  f"{entry.mem_bandwidth_gb_s:g} GB/s.\n" if entry else
                  "Not in the device table: no %-of-peak or bandwidth bound.\n")
        for series in series_list:
            if m.seqs(d, series):
                md += [f"### {series[0]}, batch {series[1]}\n", device_table(m, d, series), ""]
        for series in series_list:
            bd = breakdown_md(m, d, series)
            if bd:
                md += [f"### Where prefill time goes: {series[0]}, batch {series[1]}\n",
                       "One prefill per implementation under torch.profiler (its overhead included). Attention = "
                       "kernels launched inside the implementation's own call; idle = no kernel running (CPU-bound "
                       "gaps). 'TTFT if attention took 0 ms' is the most any attention kernel could gain.\n",
                       bd, ""]
        corr = correctness_md(m, d)
        if corr:
            md += ["### Correctness (each implementation vs stock)\n", corr, ""]
        fail = failures_md(m, d)
        if fail:
            md += ["### Out of memory / failed points\n", fail, ""]
    side = []
    for series in series_list:
        t = side_by_side_md(m, series, "ttft", lambda r: r["stats"]["p50"])
        dec = side_by_side_md(m, series, "decode_generate", lambda r: r["tok_s"])
        gr = side_by_side_md(m, series, "decode_graph", lambda r: r["tok_s"])
        if t:
            side += [f"### {series[0]}, batch {series[1]}: TTFT p50 ms\n", t, ""]
        if dec:
            side += [f"### {series[0]}, batch {series[1]}: decode tok/s (generate)\n", dec, ""]
        if gr:
            side += [f"### {series[0]}, batch {series[1]}: decode tok/s (CUDA graph)\n", gr, ""]
    if side:
        md += ["## Side by side (measured)\n"] + side
    if proj:
        md += ["## PROJECTED — roofline bounds for devices without results (not measurements)\n",
               "Lower bound on TTFT = max(F / peak fp16 FLOP/s, weight bytes / bandwidth); upper bound on decode "
               "tok/s = bandwidth / (weight bytes + K/V bytes). Real kernels reach a fraction of these; compare the "
               "measured devices' % of peak above. Whether the model fits the device's memory is not checked.\n"]
        for series in m.projectable_series():
            seqs = sorted({s for d in m.measured for s in m.seqs(d, series)})
            t = projection_md(m, series, proj, seqs)
            if t:
                md += [f"### {series[0]}, batch {series[1]} (PROJECTED)\n", t, ""]
    md.append("## Plots\n")
    multi = len(series_list) > 1
    for series in series_list:
        suffix = f"_{_slugify(series[0])}_b{series[1]}" if multi else ""
        series_proj = proj if series in m.projectable_series() else []
        plot_ttft(m, series, series_proj, out / f"ttft_vs_seq{suffix}.png")
        md.append(f"![TTFT vs prompt length, {series[0]}, batch {series[1]}](ttft_vs_seq{suffix}.png)\n")
        if plot_speedup(m, series, out / f"speedup{suffix}.png"):
            md.append(f"![TTFT speedup over stock, {series[0]}, batch {series[1]}](speedup{suffix}.png)\n")
        if plot_breakdown(m, series, out / f"breakdown{suffix}.png"):
            md.append(f"![Where prefill time goes, {series[0]}, batch {series[1]}](breakdown{suffix}.png)\n")
        if plot_decode(m, series, series_proj, out / f"decode_tok_s{suffix}.png"):
            md.append(f"![Decode tok/s, {series[0]}, batch {series[1]}](decode_tok_s{suffix}.png)\n")
    report = out / "report.md"
    report.write_text("\n".join(md) + "\n", encoding="utf-8")
    return report


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
    args = p.parse_args(argv)
    try:
        report = write_report(args.results, args.out, args.devices, args.experiment, args.project,
                              args.no_projection)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    except OSError as e:  # --out is a file, not writable, or the disk is full
        p.error(f"cannot write the report to --out {args.out}: {e.filename or ''}{': ' if e.filename else ''}"
                f"{e.strerror or e}")
    print(f"wrote {report} and {len(list(report.parent.glob('*.png')))} plots in {report.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The report's energy parts: a table of TTFT, decode tok/s and J/token per device (measured rows, then PROJECTED
rows), the published references (``experiments/published_references.toml``, every number with its source) in their
own table, and the "J/token vs tok/s" scatter per device with the published decode speeds drawn as labelled lines.

Published numbers come from other systems and settings: they sit beside ours, are always labelled "published" with
their source, and are never merged into a measured or projected row.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from datetime import date as _date
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tabulate import tabulate

from llm_attn.envinfo import REPO_ROOT
from llm_attn.harness.devices import Device
from llm_attn.harness.energy import format_energy_interval
from llm_attn.reporting.merge import STOCK_ORDER, Merged, _impl_key
from llm_attn.reporting.tables import _f, _sig, projection

DEFAULT_REFERENCES = REPO_ROOT / "experiments" / "published_references.toml"
METRICS = {"ttft_ms": "TTFT ms", "decode_ms_per_token": "decode ms/token", "decode_tok_s": "decode tok/s",
           "joules_per_token": "J/token"}
_REQUIRED = ("id", "device", "system", "model", "metric", "value", "source", "date")
_OPTIONAL = ("device_name", "quant", "seq", "history", "setting", "url")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class ReferencesError(ValueError):
    """A published-references file that cannot be used; the message is one line: ``file:line: what is wrong``."""


@dataclass(frozen=True)
class Reference:
    id: str
    device: str
    system: str
    model: str
    metric: str
    value: float
    source: str
    date: str
    line: int
    device_name: str | None = None
    quant: str | None = None
    seq: int | None = None
    history: int | None = None
    setting: str | None = None
    url: str | None = None

    @property
    def tok_s(self) -> float | None:
        """Decode tok/s: as published, or derived from ms per token."""
        if self.metric == "decode_tok_s":
            return self.value
        if self.metric == "decode_ms_per_token":
            return 1e3 / self.value
        return None

    def label(self) -> str:
        return f"{self.system}, {self.model} ({self.source.split(',')[0]}, {self.date})"


def load_references(path: str | Path | None = None) -> list[Reference]:
    """Parse and check a published-references file (``[[reference]]`` tables). Every problem is a ReferencesError
    naming the file and the line: a TOML syntax error, an unknown or missing key, a metric not in ``METRICS``, a value
    that is not a positive number, a date that is not YYYY-MM-DD."""
    path = Path(path) if path is not None else DEFAULT_REFERENCES
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ReferencesError(f"{path}: cannot read the published references: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"at line (\d+)", str(e))
        where = f"{path}:{m.group(1)}" if m else str(path)
        raise ReferencesError(f"{where}: not valid TOML: {str(e).split(' (at line')[0]}") from None
    lines = text.splitlines()
    headers = [n + 1 for n, line in enumerate(lines) if re.match(r"^\s*\[\[\s*reference\s*\]\]", line)]

    def line_of(key: str, start: int = 1, stop: int | None = None) -> int:
        """The line of ``key = ...`` between two lines (the table's own), else ``start``."""
        for n in range(start, (stop or len(lines)) + 1):
            if re.match(rf"^\s*{re.escape(key)}\s*=", lines[n - 1]):
                return n
        return start

    extra = sorted(set(data) - {"reference"})
    if extra:
        raise ReferencesError(f"{path}:{line_of(extra[0])}: unknown top-level key {extra[0]!r}; the file holds "
                              "[[reference]] tables only")
    entries = data.get("reference", [])
    if not isinstance(entries, list) or not entries:
        raise ReferencesError(f"{path}:1: no [[reference]] tables")
    refs, seen = [], {}
    for k, entry in enumerate(entries):
        start = headers[k] if k < len(headers) else 1
        stop = headers[k + 1] - 1 if k + 1 < len(headers) else None
        name = entry.get("id", f"#{k + 1}")

        def bad(key: str | None, what: str):
            at = line_of(key, start, stop) if key else start
            raise ReferencesError(f"{path}:{at}: reference {name!r}: {what}")

        unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            bad(unknown[0], f"unknown key {unknown[0]!r}; known: {', '.join(_REQUIRED + _OPTIONAL)}")
        missing = [key for key in _REQUIRED if key not in entry]
        if missing:
            bad(None, f"misses {', '.join(missing)}" + (" (every number needs its source)" if "source" in missing
                                                       else ""))
        for key in _REQUIRED + _OPTIONAL:
            if key in ("value", "seq", "history") or key not in entry:
                continue
            if not isinstance(entry[key], str) or not entry[key].strip():
                bad(key, f"{key} must be a non-empty string")
        if not _SLUG.match(entry["device"]):
            bad("device", f"device {entry['device']!r} must be a lower-case slug (a devices.toml slug, or e.g. "
                          "rtx-4090)")
        if entry["metric"] not in METRICS:
            bad("metric", f"metric {entry['metric']!r} is not one of {', '.join(METRICS)}")
        v = entry["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            bad("value", f"value must be a positive number, got {v!r}")
        for key in ("seq", "history"):
            if key in entry and (isinstance(entry[key], bool) or not isinstance(entry[key], int) or entry[key] < 0):
                bad(key, f"{key} must be a whole number of tokens, got {entry[key]!r}")
        try:
            _date.fromisoformat(entry["date"])
        except ValueError:
            bad("date", f"date {entry['date']!r} is not YYYY-MM-DD")
        if entry["id"] in seen:
            bad("id", f"id repeats the one of line {seen[entry['id']]}")
        seen[entry["id"]] = start
        refs.append(Reference(line=start, value=float(v), **{key: entry[key] for key in entry if key != "value"}))
    return refs


def references_md(refs: list[Reference]) -> str:
    lines = []
    for r in refs:
        what = METRICS[r.metric] + (f", {r.seq} tokens" if r.seq is not None else "") + (
            f" after {r.history} in the cache" if r.history else "")
        tok_s = "" if r.tok_s is None else (f"{r.tok_s:.1f}" + (" (derived)" if r.metric != "decode_tok_s" else ""))
        src = f"[{r.source}]({r.url})" if r.url else r.source
        lines.append([r.device_name or r.device, r.system, f"{r.model} ({r.quant})" if r.quant else r.model, what,
                      f"{r.value:g}", tok_s, (r.setting or "").replace("|", "/"), src.replace("|", "/"), r.date])
    return tabulate(lines, headers=["device", "system", "model", "published measure", "value", "as decode tok/s",
                                    "setting", "source", "date"], tablefmt="github", disable_numparse=True)


# -- the measured + projected table ---------------------------------------------------------------------------------
def _ok(r):
    return r if r is not None and r.get("status") == "ok" else None


def _vs(row: dict | None) -> str:
    """The paired energy verdict against the first stock implementation it was paired with."""
    vs = (row or {}).get("vs_energy") or {}
    stock = next((s for s in STOCK_ORDER if s in vs and s != row["impl"]), None)
    return f"{format_energy_interval(vs[stock])} vs {stock}" if stock else ""


def power_setting(row: dict | None) -> str:
    s = ((row or {}).get("energy") or {}).get("settings") or {}
    if s.get("nvpmodel") and (s["nvpmodel"].get("name") or s["nvpmodel"].get("id") is not None):
        mode = s["nvpmodel"]
        return f"nvpmodel {mode.get('name') or ''}" + (f" ({mode['id']})" if mode.get("id") is not None else "")
    if s.get("power_limit_w"):
        return f"power limit {s['power_limit_w']:g} W"
    return ""


def _source(row: dict | None) -> str:
    e = (row or {}).get("energy") or {}
    if e.get("method") == "nvml_total_energy_counter":
        return "NVML energy counter"
    if e.get("method") == "ina3221_rails_sampled":
        scope = e.get("scope") or ""
        return "INA3221 rails: " + (scope.split("rail ")[-1] if scope.startswith("module input") else "sum of rails")
    return ""


def energy_note(row: dict | None) -> str:
    if row is None:
        return ""
    if "energy" not in row:
        return "no energy (the row predates energy readings)"
    e = row["energy"] or {}
    notes = [e["note"]] if e.get("note") else []
    st = e.get("stats") or {}
    if st.get("stdev_pct") is not None and row.get("measurement") == "ttft":
        notes.append(f"energy spread {st['stdev_pct']:.1f}% over {st['n']} repeats")
    return "; ".join(notes)


def has_energy(m: Merged, device: str, series: tuple | None = None) -> bool:
    return any("energy" in r for r in m.device_rows[device] if series is None or m.series(r) == series)


def energy_md(m: Merged, series: tuple, proj: list[Device]) -> str:
    """One table per series: the (seq, impl) of every measured device whose rows carry energy, with TTFT, joules per
    prefill, decode tok/s and joules per token (CUDA-graph decode, else generate) with their paired energy verdicts;
    then the PROJECTED rows (roofline bounds, no energy) of the table devices without results."""
    lines = []
    # One line per (device, seq, run, impl): its time, energy and verdict cells all from that one run (as in the
    # device tables); a run label where a device has several runs of this series.
    for d in (d for d in m.measured if has_energy(m, d, series)):
        several_runs = len(m.runs(d, series)) > 1
        for seq in m.seqs(d, series):
            for run, impl in ((run, impl) for run in m.runs(d, series, seq) for impl in m.impls(d, series)):
                t = _ok(m.get(d, series, seq, impl, "ttft", run=run))
                dgr = _ok(m.get(d, series, seq, impl, "decode_graph", run=run))
                dec = dgr or _ok(m.get(d, series, seq, impl, "decode_generate", run=run))
                if t is None and dec is None:
                    continue
                notes = [n for n in (energy_note(t), energy_note(dec)) if n]
                if several_runs:
                    notes.insert(0, f"run {run}")
                lines.append([m.device_name[d], "measured", seq, impl,
                              _f(t["stats"]["p50"]) if t else "", _sig((t or {}).get("energy_j")), _vs(t),
                              (_f(dec["tok_s"], "{:.1f}") + ("" if dec is dgr else " (generate)")) if dec else "",
                              _sig((dec or {}).get("joules_per_token")), _vs(dec), _watts(t), _watts(dec),
                              _source(t or dec), power_setting(t or dec),
                              "; ".join(dict.fromkeys(notes)).replace("|", "/")])
    seqs = sorted({s for d in m.measured if has_energy(m, d, series) for s in m.seqs(d, series)})
    for dev in proj:
        for p in projection(m, series, dev, seqs):
            lines.append([dev.name, "PROJECTED (roofline bound)", p["seq"], "—", f"≥ {_sig(p['ttft_ms'])}", "", "",
                          f"≤ {_sig(p['decode_tok_s'])}", "", "", "", "", "", "",
                          "bounds, not measurements; no energy"])
    if not any(line[1] == "measured" for line in lines):
        return ""
    return tabulate(lines, headers=["device", "source", "seq", "impl", "TTFT p50 ms", "J / prefill",
                                    "J / prefill vs stock (>1 = less energy)", "decode tok/s (graph)", "J / token",
                                    "J / token vs stock (>1 = less energy)", "prefill W avg / peak",
                                    "decode W avg / peak", "energy from", "power setting", "notes"],
                    tablefmt="github", disable_numparse=True)


def _watts(row: dict | None) -> str:
    e = (row or {}).get("energy") or {}
    avg, peak = e.get("avg_power_w"), e.get("peak_power_w")
    return f"{_f(avg, '{:.1f}') or '?'} / {_f(peak, '{:.1f}') or '?'}" if avg or peak else ""


# -- the scatter ----------------------------------------------------------------------------------------------------
def _device_slug(m: Merged, d: str) -> str:
    entry = m.entry.get(d)
    return entry.slug if entry is not None else d


def plot_energy(m: Merged, refs: list[Reference], proj: list[Device], path: Path) -> bool:
    """J/token vs decode tok/s, one panel per measured device with J/token readings: a point per decode row
    (colour: implementation; marker: graph or generate; label: prompt tokens), and the published decode speeds of
    that device as dash-dotted lines labelled "published" with their source. A last panel holds what was not
    measured here: published decode speeds of other devices and the PROJECTED bandwidth bounds. False (no plot)
    where no row has J/token."""
    from llm_attn.reporting.plots import _color, _grid, _save  # noqa: PLC0415 (matplotlib: only when drawing)

    def title(ax, text: str) -> None:
        ax.set_title("\n".join(textwrap.wrap(text, 48)), fontsize="medium")

    def wrap(text: str) -> str:
        return "\n".join(textwrap.wrap(text, 60))

    devices = [d for d in m.measured
               if any(r.get("joules_per_token") for r in m.device_rows[d] if r.get("status") == "ok")]
    if not devices:
        return False
    decode_refs = [r for r in refs if r.tok_s is not None]
    shown = {_device_slug(m, d) for d in devices}
    elsewhere = [r for r in decode_refs if r.device not in shown]
    series_proj = [s for s in m.projectable_series()]
    fig, axes = _grid(len(devices) + (1 if elsewhere or (proj and series_proj) else 0))
    for ax, d in zip(axes, devices):
        groups: dict[tuple, list[dict]] = {}
        for r in m.device_rows[d]:
            if r.get("status") == "ok" and r.get("joules_per_token"):
                groups.setdefault((_impl_key(r["impl"]), r["impl"], r["measurement"], m.series(r)), []).append(r)
        for (_, impl, measurement, _s), rs in sorted(groups.items()):
            rs.sort(key=lambda r: r["seq"])
            graph = measurement == "decode_graph"
            # One line per implementation and mode, through its prompt lengths (labelled at each point).
            ax.plot([r["tok_s"] for r in rs], [r["joules_per_token"] for r in rs], color=_color(impl),
                    marker="o" if graph else "^", linestyle="-" if graph else "--", linewidth=0.8,
                    label=f"{impl} ({'CUDA graph' if graph else 'generate'}), labels: prompt tokens")
            for k, r in enumerate(rs):
                ax.annotate(str(r["seq"]), (r["tok_s"], r["joules_per_token"]), textcoords="offset points",
                            xytext=(-5 if k % 2 else 5, -2), ha="right" if k % 2 else "left", fontsize="x-small",
                            color=_color(impl))
        dash = ("-.", (0, (5, 2)), (0, (1, 1)))
        for n, ref in enumerate(x for x in decode_refs if x.device == _device_slug(m, d)):
            ax.axvline(ref.tok_s, color="0.35", linestyle=dash[n % len(dash)], linewidth=1,
                       label=wrap(f"published: {ref.tok_s:.1f} tok/s, {ref.label()}; no energy published"))
        ax.set_xlim(left=0)
        ax.margins(y=0.25)
        title(ax, f"{m.device_name[d]} (measured)")
        ax.set_xlabel("decode tok/s per sequence")
        ax.set_ylabel("J per decoded token")
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        keep = dict(zip(labels, handles))  # one legend entry per implementation and mode
        ax.legend(keep.values(), keep.keys(), fontsize="x-small", loc="lower left")
    if len(axes) > len(devices):
        ax = axes[-1]
        styles = ("-.", (0, (3, 1, 1, 1, 1, 1)), (0, (5, 2)))
        for n, ref in enumerate(elsewhere):
            ax.axvline(ref.tok_s, color=f"C{n % 10}", linestyle=styles[n % len(styles)], linewidth=1.2,
                       label=wrap(f"published, {ref.device_name or ref.device}: {ref.tok_s:.1f} tok/s "
                                  f"({ref.label()})"))
        if proj and series_proj:
            series = series_proj[0]
            seqs = sorted({s for d in m.measured for s in m.seqs(d, series)})
            for dev in proj:
                for p in projection(m, series, dev, seqs[:1]):
                    ax.axvline(p["decode_tok_s"], color="0.2", linestyle=":", linewidth=1.5,
                               label=wrap(f"PROJECTED bound, {dev.name}: {p['decode_tok_s']:.0f} tok/s "
                                          f"({series[0]}, {p['seq']} tokens)"))
        ax.set_xlim(left=0)
        ax.set_yticks([])
        ax.set_xlabel("decode tok/s per sequence")
        title(ax, "Not measured here: published decode speeds and PROJECTED bounds (no J/token)")
        ax.legend(fontsize="xx-small", loc="upper left")
    _save(fig, "Energy per decoded token vs decode speed (lower right is better)", path)
    return True


# -- the report's sections ------------------------------------------------------------------------------------------
ENERGY_METHOD = """\
**Energy.** Read on the same repeats as the times: on an NVIDIA GPU with NVML, the GPU's total-energy counter right
before and after each timed prefill or decode run (the whole board); on a Jetson, the INA3221 power rails sampled
every 10 ms and integrated over each repeat (the module-input rail where the board has one, else the sum of its
rails: each rail's meaning is in the rows). J / prefill is the median over the repeats; J / token is a decode run's
joules over the tokens it decoded (the first token, the prefill's, excluded as in tok/s). The energy `vs` cells are
paired like the time ones: the ratio of medians, stock / this row (> 1: this row used less energy), with its 95 %
paired-bootstrap interval. Average power = joules / seconds over the repeats; peak = the highest power sample
inside them. Where no reading exists (a CPU, a GPU without NVML or without permission) the cells are empty and the
notes say why."""


def energy_sections(m: Merged, proj: list[Device], out: Path, references: str | Path | None) -> list[str]:
    """The report's energy and published-references sections, and the J/token plot written into ``out``.
    ``references``: the published-references file (None: no such section); ReferencesError when it is
    malformed."""
    if references is not None and Path(references) == DEFAULT_REFERENCES and not DEFAULT_REFERENCES.exists():
        references = None  # an installed package without the repository's experiments/
    refs = load_references(references) if references is not None else []
    without = [m.device_name[d] for d in m.measured if not has_energy(m, d)]
    if len(without) == len(m.measured):
        md = ["## Energy\n", "No row of these results carries energy: they were recorded before rows carried it "
              "(see README, \"Energy per measurement\").\n"]
    else:
        md = [f"## Energy and speed per device{' (measured; PROJECTED rows marked)' if proj else ''}\n",
              ENERGY_METHOD, ""]
        if without:
            md += [f"No energy in the rows of {', '.join(without)}: they were recorded before rows carried energy "
                   "(their TTFT and decode are in their own sections above).\n"]
        for series in m.all_series():
            series_proj = proj if series in m.projectable_series() else []
            t = energy_md(m, series, series_proj)
            if t:
                md += [f"### {series[0]}, batch {series[1]}\n", t, ""]
        if plot_energy(m, refs, proj, out / "energy_per_token.png"):
            md.append("![J per decoded token vs decode tok/s, per device](energy_per_token.png)\n")
        else:
            md.append("No row has a J/token reading (see the notes above): no J/token plot.\n")
    if refs:
        md += ["## Published references (not measured here)\n",
               "Numbers others published for similar models on these and other devices, each with its source "
               f"(`{Path(references).name}`). They come from other software and settings (see each one's setting): "
               "read them beside our rows, never as our measurements; the plot above draws the decode speeds as "
               "dash-dotted lines labelled \"published\".\n", references_md(refs), ""]
    return md

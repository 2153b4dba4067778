"""``write_report``: report.md and its plots from result files (the library behind ``python -m llm_attn.report``)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from llm_attn.harness.devices import load_devices
from llm_attn.harness.results import result_files
from llm_attn.harness.session import dataset_table
from llm_attn.reporting.energy import DEFAULT_REFERENCES, energy_sections
from llm_attn.reporting.merge import Merged, _slugify, load_rows
from llm_attn.reporting.plots import (
    plot_breakdown,
    plot_decode,
    plot_speedup,
    plot_ttft,
)
from llm_attn.reporting.tables import (
    METHOD,
    breakdown_md,
    correctness_md,
    device_table,
    env_md,
    failures_md,
    implementations_md,
    projected_devices,
    projection_md,
    runs_md,
    side_by_side_md,
)
from llm_attn.reporting.ttft_stack import plot_ttft_stacked


def write_report(paths: list[str | Path], out_dir: str | Path, devices_path: str | Path | None = None,
                 experiment: str | None = None, project: list[str] | None = None,
                 no_projection: bool = False, references: str | Path | None = DEFAULT_REFERENCES) -> Path:
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
          "## Measured devices\n", env_md(m), "", "### Runs\n", runs_md(m), "", METHOD, "",
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
        ds = dataset_table(m.device_rows[d])  # --seq dataset rows (harness.session)
        if ds:
            title, _, table = ds.partition("\n")
            md += [f"### {title}\n", "Each prompt at its own token length, all implementations paired prompt by "
                   "prompt; p50 / p90 over the prompts' TTFTs.\n", table, ""]
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
    md += energy_sections(m, proj, out, references)  # J per prefill / token per device, published references
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
        if plot_ttft_stacked(m, series, out / f"ttft_stacked{suffix}.png"):  # breakdowns at 2+ lengths
            md.append(f"![TTFT vs prompt length by kernel class, {series[0]}, batch {series[1]}]"
                      f"(ttft_stacked{suffix}.png)\n")
        if plot_decode(m, series, series_proj, out / f"decode_tok_s{suffix}.png"):
            md.append(f"![Decode tok/s, {series[0]}, batch {series[1]}](decode_tok_s{suffix}.png)\n")
    report = out / "report.md"
    report.write_text("\n".join(md) + "\n", encoding="utf-8")
    return report

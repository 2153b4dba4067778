"""The markdown tables of the report: per device, side by side, correctness, failures, projections, breakdowns."""

from __future__ import annotations

from tabulate import tabulate

from llm_attn.harness import flops
from llm_attn.harness.agreement import (
    AGREEMENT_HEADERS,
    AGREEMENT_NOTE,
    FLIPS_HEADER,
    FLIPS_NOTE,
    agreement_cells,
    correctness_names,
    flips_cell,
)
from llm_attn.harness.devices import Device
from llm_attn.harness.stats import ratio_header
from llm_attn.harness.sweep import row_notes, verdict_cell
from llm_attn.reporting.merge import (
    BREAKDOWN,
    STOCK_ORDER,
    Merged,
    _breakdown_rows,
    _impl_key,
    _model_label,
)

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
once at the mean context length. The fraction shown is measured tok/s over that bound.

**vs columns.** Where TTFT was measured paired (every implementation once per repeat, in a shuffled order), a `vs`
cell is the ratio of medians, stock / this row (> 1: this row is faster), with its 95 % paired-bootstrap interval,
and says "no difference" where the interval holds 1.0 ("faster" / "slower" otherwise); older rows show the plain
ratio of p50s. **notes**: host-bound rows (enqueue ≥ 90 % of TTFT), attention calls that fell back to stock, an SM
clock that moved > 5 %.

**Runs.** Every line of a table comes from one run (one command; its `run_id`), and its `vs` cells compare it with
the stock rows of that same run. Where a newer run with the same configuration (device, model, dtype, batch, prompt
source, kernel build) re-measured everything an older one had at a point, the older is left out there; other runs
that overlap are shown apart, with a `run` column. The notes above the tables say which runs were kept and why."""


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
    several_runs = len(m.runs(device, series)) > 1
    lines = []
    # One line per (seq, run, impl): every cell of a line, and the stock row of its vs cells, from that one run.
    for seq, run, impl in ((seq, run, impl) for seq in m.seqs(device, series)
                           for run in m.runs(device, series, seq) for impl in impls):
        t = m.get(device, series, seq, impl, "ttft", run=run)
        dg = m.get(device, series, seq, impl, "decode_generate", run=run)
        dgr = m.get(device, series, seq, impl, "decode_graph", run=run)
        if t is None and dg is None and dgr is None:
            continue
        p50 = t["stats"]["p50"] if t is not None and t["status"] == "ok" else None
        tflops = flops.prefill_flops(geom, batch, seq) / (p50 * 1e-3) / 1e12 if p50 and geom else None
        gpus = ((t or {}).get("tp") or {}).get("degree", 1)  # a TP row's TTFT is the work of that many GPUs
        pct = 100 * tflops / (entry.fp16_tensor_tflops * gpus) if tflops and entry else None
        speed = []
        for s in stocks:
            # The paired ratio, its 95 % interval and verdict words where the row was measured paired;
            # the plain ratio of p50s for older rows (sweep.verdict_cell).
            ref = m.ok(device, series, seq, s, "ttft", run=run)
            speed.append(verdict_cell(t, s, ref["stats"]["p50"] if ref else None, p50) if p50 else "")
        notes = []
        for x in (t, dg, dgr):
            notes += [n for n in row_notes(x) if n not in notes]
        bw = None
        if dgr is not None and dgr["status"] == "ok" and entry:
            bw = 100 * dgr["tok_s"] * dgr["bytes_per_token"]["total"] / entry.bandwidth_bytes_s
        peak = max((x.get("peak_mem_bytes") or 0) for x in (t, dg, dgr) if x is not None) or None
        lines.append([
            seq, impl, *([run] if several_runs else []),
            _f(p50) or _status_cell(t), _f(t["stats"]["p90"]) if p50 else "",
            _f(t["stats"]["stdev_pct"], "{:.1f}") if p50 else "",
            _sig(tflops), _f(pct, "{:.1f}%"), *speed,
            _f(dg["tok_s"], "{:.1f}") if dg is not None and dg["status"] == "ok" else _status_cell(dg),
            _f(dgr["tok_s"], "{:.1f}") if dgr is not None and dgr["status"] == "ok" else _status_cell(dgr),
            _f(bw, "{:.0f}%"),
            _f(peak / 2**30 if peak else None),
            "; ".join(notes),
        ])
    headers = ["seq", "impl", *(["run"] if several_runs else []), "TTFT p50 ms", "p90 ms", "stdev %", "model TFLOP/s",
               "% fp16 peak",
               *[ratio_header(s) for s in stocks], "decode tok/s (generate)", "decode tok/s (graph)",
               "graph % of BW bound", "peak GiB", "notes"]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def runs_md(m: Merged) -> str:
    """The runs the tables' rows come from: one line per device and run, with its configuration and command."""
    lines = []
    for d in m.measured:
        by_run: dict[str, list[dict]] = {}
        for r in m.device_rows[d]:
            by_run.setdefault(r["run_id"], []).append(r)
        for run in sorted(by_run, key=lambda run: (m.run_start[run], run)):
            rows = by_run[run]
            first = min(rows, key=lambda r: r["time"])
            sources = sorted({(r.get("prompts") or {}).get("source") or "random ids" for r in rows})
            lines.append([d, run, first["time"][:19], first["env"].get("kernel_build") or "",
                          ", ".join(sources), (first["env"].get("git_sha") or first["env"].get("llm_attn_git")
                                               or "")[:12], len(rows),
                          f"`{first['command']}`".replace("|", "/") if first.get("command") else ""])
    return tabulate(lines, headers=["device", "run", "started", "kernel build", "prompts", "git", "rows", "command"],
                    tablefmt="github", disable_numparse=True)


def correctness_md(m: Merged, device: str) -> str:
    lines = []
    for r in sorted(m.device_rows[device], key=lambda r: (_model_label(r), r["batch"], r["seq"])):
        if r["measurement"] != "correctness":
            continue
        if r["status"] != "ok":
            lines.append([_model_label(r), r["batch"], r["seq"], r["impl"], "", r["status"].upper(), "",
                          *[""] * (len(AGREEMENT_HEADERS) + 1)])
        else:
            impl, vs = correctness_names(r)
            lines.append([_model_label(r), r["batch"], r["seq"], impl, vs, f"{r['max_abs_logit_diff']:.3g}",
                          f"{100 * r['greedy_agreement']:.1f}%", *agreement_cells(r), flips_cell(r)])
    if not lines:
        return ""
    return tabulate(lines, headers=["model", "batch", "seq", "impl", "vs", "max abs logit diff", "greedy agreement",
                                    *AGREEMENT_HEADERS, FLIPS_HEADER], tablefmt="github", disable_numparse=True) \
        + "\n\n" + AGREEMENT_NOTE + " " + FLIPS_NOTE


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
                      env.get("transformers", ""), env.get("kernel_build") or "", model.get("awq_backend") or "",
                      (env.get("git_sha") or env.get("llm_attn_git") or "")[:12], len(m.device_rows[d]),
                      entry.name if entry else "not in table"])
    return tabulate(lines, headers=["device", "GPU", "CC", "SMs", "driver", "CUDA", "torch", "transformers",
                                    "kernel build", "AWQ backend", "git", "rows", "datasheet entry"], tablefmt="github",
                    disable_numparse=True)


def side_by_side_md(m: Merged, series: tuple, measurement: str, value) -> str:
    devices = [d for d in m.measured if m.seqs(d, series)]
    if len(devices) < 2:
        return ""
    keys = sorted({(seq, impl) for d in devices for seq in m.seqs(d, series) for impl in m.impls(d, series)},
                  key=lambda k: (k[0], _impl_key(k[1])))
    lines, several = [], False
    for seq, impl in keys:
        cells = []
        for d in devices:
            r = m.get(d, series, seq, impl, measurement)  # the newest run's row of the point
            several = several or len(m.runs(d, series, seq)) > 1
            cells.append(_f(value(r)) if r is not None and r["status"] == "ok" else _status_cell(r))
        lines.append([seq, impl, *cells])
    table = tabulate(lines, headers=["seq", "impl", *[m.device_name[d] for d in devices]], tablefmt="github",
                     disable_numparse=True)
    return table + ("\n\n(a device with several runs at a point: each cell is its newest run's row)" if several else "")


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


def breakdown_md(m: Merged, device: str, series: tuple) -> str:
    lines = []
    for r in _breakdown_rows(m, device, series):
        ms, pct = r["category_ms"], r["category_pct"]
        t = m.ok(device, series, r["seq"], r["impl"], "ttft", run=r["run_id"])  # this profile's own run
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

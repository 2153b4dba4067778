"""The tables of tensor-parallel rows: TTFT per (TP degree, model, point, implementation) with what explains it
(``summary_table``), and the kernels of one decoder layer on each rank (``layer_table``).

Every ratio reads as the main table's: reference / this row, > 1 = this row is faster, with its 95 % paired-bootstrap
interval and verdict from ``stats`` through ``sweep.verdict_cell`` (the function the single-GPU table uses). ``vs
TP=1`` compares runs of different processes, so it is the plain ratio of medians, never an interval.
"""

from __future__ import annotations

from itertools import zip_longest

from tabulate import tabulate

from llm_attn.harness.impls import BASE_IMPL
from llm_attn.harness.sweep import verdict_cell


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _per_rank(values) -> str:
    return "/".join(values) if values else "-"


def _key(r: dict, degree: int) -> tuple:
    m = r["model"]
    return (m.get("name"), m.get("quant"), r["dtype"], r["batch"], r["seq"], r["measurement"], r["impl"], degree)


def summary_table(rows: list[dict], short: bool = False) -> str:
    """TTFT p50 per (TP degree, model, batch, seq, measurement, implementation): the paired ratio vs the base
    implementation, the ratio vs the same point at TP=1, which ranks were host-bound (enqueue / TTFT per rank), the
    share of each rank's time spent waiting in collectives, the transfer time, the interconnect, the first token.
    ``short``: without batch, transfer time, link codes and first token (the device command's last table)."""
    ok = [r for r in rows if r.get("status") == "ok" and "tp" in r]
    p50 = {_key(r, r["tp"]["degree"]): r["stats"]["p50"] for r in ok}
    base_p50 = {_key(r, r["tp"]["degree"])[:-2] + (r["tp"]["degree"],): r["stats"]["p50"]
                for r in ok if r["impl"] == BASE_IMPL}

    def order(r):  # by TP degree, then model and point, eager before graph, the base implementation first
        return (r["tp"]["degree"], r["model"].get("name"), r["model"].get("quant"), r["batch"], r["seq"],
                r["measurement"], r["impl"] != BASE_IMPL, r["impl"])

    out = []
    for r in sorted(ok, key=order):
        t = r["tp"]
        ranks = t.get("ranks") or []
        mine = r["stats"]["p50"]
        ref = base_p50.get(_key(r, t["degree"])[:-2] + (t["degree"],))
        vs_base = "(base)" if r["impl"] == BASE_IMPL else verdict_cell(r, BASE_IMPL, ref, mine)
        tp1 = p50.get(_key(r, 1)) if t["degree"] != 1 else None
        vs_tp1 = verdict_cell(None, "", tp1, mine) if tp1 else "-"
        hb = [k.get("host_bound") or {} for k in ranks]
        host_bound = ",".join(str(k["rank"]) for k, h in zip(ranks, hb) if h.get("host_bound")) or "none"
        enqueue = _per_rank([_pct(h.get("enqueue_share")) for h in hb if h])
        prof = [k.get("profile") or {} for k in ranks]
        wait = _per_rank([_pct(p.get("comm_wait_share")) for p in prof if p])
        transfer = next((p.get("comm_transfer_ms") for p in prof if p.get("comm_transfer_ms") is not None), None)
        link = t["interconnect"]["kind"]
        links = t["interconnect"].get("links") or {}
        if links:
            link += " " + ",".join(f"{k}:{v}" for k, v in sorted(links.items()))
        eager = r["measurement"] == "ttft"
        out.append([t["degree"], r["model_spec"], r["batch"], r["seq"], "eager" if eager else "graph", r["impl"],
                    f"{mine:.2f}", vs_base, vs_tp1, f"{host_bound} ({enqueue})" if eager else "-",
                    wait if eager else "-", "-" if transfer is None else f"{transfer:.2f}",
                    t["interconnect"]["kind"] if short else link, r.get("first_token")])
    headers = ["TP", "model", "batch", "seq", "mode", "impl", "TTFT p50 ms", f"vs {BASE_IMPL} (paired; >1 = faster)",
               "vs TP=1 (>1 = faster)", "host-bound ranks (enqueue/TTFT per rank)",
               "comm wait per rank (% of rank time)", "comm transfer ms", "interconnect", "first token"]
    if short:
        keep = [i for i, h in enumerate(headers) if h not in ("batch", "comm transfer ms", "first token")]
        headers = [headers[i] for i in keep]
        out = [[line[i] for i in keep] for line in out]
    return tabulate(out, headers=headers, tablefmt="github", disable_numparse=True)


def layer_table(row: dict) -> str:
    """The kernels of one decoder layer (the profiled prefill's middle layer) on each rank of a ``ttft`` row, in the
    order they ran, side by side: where a rank's layer time goes and where it waits."""
    ranks = row["tp"].get("ranks") or []
    layers = [(k.get("profile") or {}).get("layer") or {} for k in ranks]
    kernels = [lay.get("kernels") or [] for lay in layers]
    lines = []
    for ks in zip_longest(*kernels):
        first = next(k for k in ks if k)
        lines.append([first["name"][:70], first["kind"], *(f"{k['ms']:.3f}" if k else "" for k in ks)])
    lines.append(["(layer total)", "", *(f"{lay.get('ms', 0.0):.3f}" for lay in layers)])
    index = next((lay.get("index") for lay in layers if lay.get("index") is not None), "?")
    title = (f"layer {index} of {row['model_spec']} at TP={row['tp']['degree']}, batch {row['batch']}, seq "
             f"{row['seq']}, {row['impl']}")
    headers = ["kernel (CPU: op)", "kind", *(f"rank {k['rank']} ms" for k in ranks)]
    return title + "\n" + tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)

"""Is the TTFT energy in the rows trustworthy on this GPU? (issue 37's targets, for an NVIDIA GPU with NVML)

    python experiments/energy_check.py                                   # 8B AWQ (auto), sdpa, 2048 and 8192 tokens
    python experiments/energy_check.py --impl sdpa llm_attn --repeats 20 --seconds 20 --json energy_check.json
    python experiments/energy_check.py --model tiny --seq 64 --seconds 3  # a quick look at the method

Per prompt length and implementation:

1. **Spread.** ``--repeats`` timed prefills measured exactly as the rows are (``harness.paired.measure_ttft_paired``
   with the NVML meter of ``harness.energy``): median J per prefill and the repeat-to-repeat spread (sample stdev %
   of the mean, and (max - min) / median). Target: stdev <= 5 %. The "reading" column says how the rows read it:
   ``window`` (the counter interpolated at the prefill's start and end) or ``burst n x s`` (a prefill shorter than
   ``energy.BURST_BELOW_PERIODS`` counter updates: n back-to-back prefills right after it, lasting s seconds, whose
   average power x s / n is the repeat's J). Where a burst was used, the prompt is measured once more with every
   repeat read as a window (``window (no burst)`` lines: what the rows read before bursts; not part of the exit
   status).
2. **Agreement.** A block of back-to-back prefills lasting at least ``--seconds``: the counter's delta over the block
   against the trapezoid integral of ``nvmlDeviceGetPowerUsage`` sampled every ``--period-ms`` on a thread over the
   same window. Target: within 10 %. On Ampere and newer (except GA100) NVML's power reading is a one-second
   average, so the integral lags the counter by about half a second of (load - idle) power at each end of the
   block: keep the block long (the default 20 s puts that edge effect near 2 %).
3. **Bias.** The block's counter joules / its prefills is the energy of one prefill among back-to-back ones, read
   over 20 s: "vs block %" is the median J per prefill of item 1 against it (a burst should read within a few %;
   the window reading of a prefill shorter than the counter's period reads low: the idle time around it is mixed in).

Also printed: how often the counter changes (polled for one second while idle): a prefill much shorter than that
period cannot be resolved by the counter, whatever the spread says.

Exit status 0 when both targets hold everywhere, 1 when one does not, 2 without an NVIDIA GPU or a readable counter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from tabulate import tabulate

from llm_attn.harness.cli_args import positive_int

SPREAD_TARGET_PCT = 5.0
AGREEMENT_TARGET_PCT = 10.0


def counter_period_s(read_mj, seconds: float = 1.0) -> float | None:
    """Median seconds between changes of the energy counter ``read_mj()`` polled for ``seconds``."""
    changes, last, end = [], read_mj(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        v = read_mj()
        if v != last:
            changes.append(time.perf_counter())
            last = v
        time.sleep(0.0005)
    return float(np.median(np.diff(changes))) if len(changes) > 2 else None


def spread(joules: list[float]) -> dict:
    x = np.asarray([j for j in joules if j is not None], dtype=np.float64)
    if x.size < 2:
        return {"n": int(x.size), "median_j": float(x[0]) if x.size else None, "stdev_pct": None, "range_pct": None}
    med = float(np.median(x))
    return {"n": int(x.size), "median_j": med, "stdev_pct": float(100 * x.std(ddof=1) / x.mean()),
            "range_pct": float(100 * (x.max() - x.min()) / med)}


def agreement(counter_j: float, integral_j: float) -> float:
    """Percent by which the power integral differs from the counter (positive: the integral reads more)."""
    return 100.0 * (integral_j / counter_j - 1.0)


def reading(energy_fields: dict) -> str:
    """How a row's J per prefill was read: ``window``, ``burst 8 x 0.56 s`` (median n and length), or both."""
    b = energy_fields.get("burst")
    if not b:
        return "window"
    ns = [n for n in b["n"] if n is not None]
    secs = [x for x in b["duration_s"] if x is not None]
    text = f"burst {int(np.median(ns))} x {np.median(secs):.2f} s"
    return text if len(ns) == len(b["n"]) else f"{text} ({len(ns)} of {len(b['n'])} repeats)"


def vs_block(median_j: float | None, block_j_per_prefill: float | None) -> float | None:
    """Percent by which the rows' median J per prefill differs from the block's counter J / prefills."""
    if median_j is None or not block_j_per_prefill:
        return None
    return 100.0 * (median_j / block_j_per_prefill - 1.0)


def check_table(results: list[dict]) -> tuple[str, bool]:
    """The table, and whether every line that counts (not ``window (no burst)``) meets both targets."""
    lines, ok = [], True
    for r in results:
        s, a = r["spread"], r["agreement_pct"]
        good_s = s["stdev_pct"] is not None and s["stdev_pct"] <= SPREAD_TARGET_PCT
        good_a = a is not None and abs(a) <= AGREEMENT_TARGET_PCT
        counts = not r.get("comparison", False)
        ok &= (good_s and good_a) or not counts
        vb = r.get("vs_block_pct")
        lines.append([r["seq"], r["impl"], r.get("reading", "window"), f"{r['ttft_p50_ms']:.2f}",
                      f"{s['median_j']:.3f}" if s["median_j"] is not None else "",
                      f"{s['stdev_pct']:.2f}" if s["stdev_pct"] is not None else "",
                      f"{s['range_pct']:.2f}" if s["range_pct"] is not None else "",
                      ("yes" if good_s else "NO") if counts else "(not a target)",
                      f"{vb:+.2f}" if vb is not None else "", f"{r['block_s']:.1f}", f"{r['counter_j']:.1f}",
                      f"{r['integral_j']:.1f}", f"{a:+.2f}" if a is not None else "", "yes" if good_a else "NO"])
    table = tabulate(lines, headers=["seq", "impl", "reading", "TTFT p50 ms", "J / prefill (median)", "stdev %",
                                     "(max-min)/median %", f"stdev <= {SPREAD_TARGET_PCT:g}%", "vs block %",
                                     "block s", "counter J", "power integral J", "integral vs counter %",
                                     f"within {AGREEMENT_TARGET_PCT:g}%"], tablefmt="github", disable_numparse=True)
    return table, ok


class WindowOnly:
    """The meter, reading every repeat as a window (no bursts): the rows' reading before bursts, for comparison."""

    def __init__(self, meter):
        self._meter = meter

    def __getattr__(self, name):
        return getattr(self._meter, name)

    def end(self, window, tokens=None, again=None):
        return self._meter.end(window, tokens=tokens)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python experiments/energy_check.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="auto")
    p.add_argument("--seq", type=positive_int, nargs="+", default=[2048, 8192])
    p.add_argument("--impl", nargs="+", default=["sdpa"])
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--seconds", type=float, default=20.0, help="length of the agreement block (default 20)")
    p.add_argument("--period-ms", type=float, default=10.0, help="power sampling period of the block (default 10)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    # tests/test_energy.py runs the whole check on the CPU (the tiny model) against a fake NVML; not for real use.
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch  # noqa: PLC0415

    from llm_attn.harness import energy, session  # noqa: PLC0415
    from llm_attn.harness.impls import use_impl  # noqa: PLC0415
    from llm_attn.harness.measure import _sync, prefill_first_token  # noqa: PLC0415
    from llm_attn.harness.paired import measure_ttft_paired  # noqa: PLC0415
    from llm_attn.harness.sweep import make_prompt  # noqa: PLC0415

    device = args.device
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("energy_check: needs an NVIDIA GPU (torch sees none); energy on a CPU is not read", file=sys.stderr)
        return 2
    index = torch.cuda.current_device() if cuda else 0
    meter = energy.open_nvml_meter(index, energy._cuda_identity(index) if cuda else None)
    if not isinstance(meter, energy.NvmlMeter):
        print(f"energy_check: {meter.note}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if cuda else "CPU (a fake NVML)"
    spec, note = session.resolve_model_spec(args.model, device)
    if note:
        print(note, file=sys.stderr)
    dtype = session.default_dtype(spec, device)
    model, info = session.load(spec, device, dtype, allow_dequant_fallback=False)
    vocab = (model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config).vocab_size
    settings = meter.start_point()
    period = counter_period_s(meter.energy_mj)
    print(f"{name}: power limit {settings.get('power_limit_w')} W; the energy counter "
          f"changes every {period * 1e3:.1f} ms (idle)" if period else "the energy counter did not change while idle")
    results = []
    try:
        for seq in args.seq:
            ids = make_prompt(vocab, 1, seq, 0, device)
            got = measure_ttft_paired(model, ids, args.impl, args.warmup, args.repeats, switch=use_impl, meter=meter)
            bursts = any(got[i]["energy"].get("burst") for i in args.impl)
            # The same repeats read as windows, where the rows read bursts: what the rows read before.
            plain = (measure_ttft_paired(model, ids, args.impl, args.warmup, args.repeats, switch=use_impl,
                                         meter=WindowOnly(meter)) if bursts else {})
            for impl in args.impl:
                row = got[impl]
                # The agreement block: back-to-back prefills, the counter over the window against the power samples.
                sampler = energy.Sampler(meter._power, args.period_ms / 1e3)
                try:
                    with use_impl(model, impl), torch.inference_mode():
                        time.sleep(0.5)  # samples before the window, to interpolate its start
                        _sync(torch.device(device))
                        t0, e0, prefills = time.perf_counter(), meter.energy_mj(), 0
                        while time.perf_counter() - t0 < args.seconds:
                            prefill_first_token(model, ids)
                            _sync(torch.device(device))
                            prefills += 1
                        t1, e1 = time.perf_counter(), meter.energy_mj()
                    sampler.wait_past(t1, timeout=1.0)
                    integral, _ = sampler.integrate(t0, t1)
                finally:
                    sampler.close()
                counter = (e1 - e0) / 1e3
                block = {"block_s": t1 - t0, "counter_j": counter, "integral_j": integral,
                         "agreement_pct": agreement(counter, integral) if counter > 0 else None,
                         "avg_power_w": counter / (t1 - t0), "block_prefills": prefills,
                         "block_j_per_prefill": counter / prefills if prefills else None}
                for fields, comparison in ((row, False), *(((plain[impl], True),) if plain else ())):
                    e = fields["energy"]
                    sp = spread(e["samples_j"])
                    results.append({"seq": seq, "impl": impl, "reading": reading(e) + (" (no burst)" * comparison),
                                    "comparison": comparison, "ttft_p50_ms": fields["stats"]["p50"],
                                    "samples_j": e["samples_j"], "spread": sp, "burst": e.get("burst"),
                                    "vs_block_pct": vs_block(sp["median_j"], block["block_j_per_prefill"]),
                                    **block, "note": e.get("note")})
    finally:
        meter.close()
    table, ok = check_table(results)
    print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"device": name, "settings": settings, "counter_period_s": period,
                       "model": spec, "results": results}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Which KV split count (and decode tile) is fastest per decode shape? One GPU run answers it (issue 19).

    python experiments/decode_splits.py --out $OUT/decode_splits.json
    python experiments/decode_splits.py --batch 1 16 --kv 8192 --configs Deep --out /tmp/d.json   # a subset
    python experiments/decode_splits.py --impl ours-fp8kv --batch 1 --kv 8192 32768 131072 --out /tmp/f.json

`--impl ours-fp8kv` sweeps the FP8-cache decode kernel (issue 38; kernels/flash_decode_fp8kv_kernel.cuh) the same
way: split counts only (it picks its own tile configs), GB/s of the e4m3 bytes and scales it reads.

For B in {1,4,8,16} x KV in {512,2048,8192,32768} (q_len 1, 32 query / 8 KV heads, head_dim 128, bf16 by default) it
times, in CUDA graphs of back-to-back calls over rotating inputs (the harness's kernel_bench helpers), our decode
kernel for every candidate split count of every forced decode config (``llm_attn.ops.force_decode``), our automatic
choice (the current heuristic), and SDPA's cuDNN and flash backends, interleaved: every round times each candidate
once, in a shuffled order, so clock or thermal drift hits all alike. GB/s counts K and V read once.

Candidates: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, the heuristic's and the cost model's counts and those
that fill 1..4 waves of one or two blocks per SM, each replaced
by the count of its non-empty splits (n 64-key tiles in splits of ceil(n / s) tiles: ceil(n / ceil(n / s)) of them),
at most the 64-key tiles and at most 16 blocks per SM. Each candidate's output is checked against SDPA flash's.

Prints one table (best split and its GB/s, the heuristic's, the cost model's prediction, cuDNN, flash) and one per
config (its best split and GB/s); writes everything, samples included, as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BASE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def effective_splits(n_tiles: int, s: int) -> int:
    """The kernel's non-empty splits for s requested: each takes ceil(n / s) tiles (flash_decode_kernel.cuh)."""
    s = max(1, min(s, n_tiles))
    return math.ceil(n_tiles / math.ceil(n_tiles / s))


def predicted_splits(batch: int, kv_heads: int, kv_len: int, num_sms: int, blocks_per_sm: int = 2,
                     stages: int = 3) -> tuple[int, float]:
    """The cost model of kernels/NOTES.md ("Decode split count: cost model", a PREDICTION, unmeasured): the split
    count with the least modelled time, and that time in µs. Constants are guesses for an H100 (see NOTES)."""
    bw = 3000.0          # KB/µs (= 3.0 TB/s): achievable DRAM bandwidth
    lat = 1.5            # µs: loaded DRAM latency seen by one tile
    t_block = 2.0        # µs: block start, Q + first tile, softmax merge and partial write
    t_comb0, t_comb_per = 1.5, 0.03  # µs: fence + counter + first L2 round; per split merged (8 per L2 round)
    tile_kb = 2 * 64 * HEAD_DIM * 2 / 1024  # K + V of one 64-key tile: 32 KB
    n_tiles = math.ceil(kv_len / 64)
    pairs = batch * kv_heads
    slots = blocks_per_sm * num_sms
    best = (1, float("inf"))
    for s in sorted({effective_splits(n_tiles, s) for s in range(1, min(n_tiles, 128) + 1)}):
        per = math.ceil(n_tiles / s)
        blocks = pairs * s
        waves = math.ceil(blocks / slots)
        active = max(1.0, min(blocks, slots) / num_sms)  # blocks sharing an SM in a full wave
        # A block streams at its SM's share of the bandwidth, or at what its (stages - 1) tiles in flight allow.
        rate = min(bw / num_sms / active, (stages - 1) * tile_kb / lat)  # KB/µs
        t_stream = per * tile_kb / rate
        t = max(pairs * n_tiles * tile_kb / bw, waves * (t_block + t_stream))
        if s > 1:
            t += t_comb0 + t_comb_per * s
        if t < best[1] - 1e-9:
            best = (s, t)
    return best


def candidates(n_tiles: int, pairs: int, num_sms: int, heuristic: int, predicted: int = 1) -> list[int]:
    extra = {heuristic, predicted} | {max(1, k * num_sms // pairs) for k in (1, 2, 3, 4)}
    out = set()
    for s in set(BASE_SPLITS) | extra:
        if s > n_tiles or pairs * s > 16 * num_sms:
            continue
        out.add(effective_splits(n_tiles, s))
    return sorted(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--kv", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16"], default=["bf16"])
    p.add_argument("--q-len", type=int, default=1, help="query rows per sequence (1..4 keep one m16 row tile)")
    p.add_argument("--impl", choices=["ours", "ours-fp8kv"], default="ours",
                   help="ours: the decode kernel on the fp16/bf16 K/V; ours-fp8kv: the FP8-cache decode kernel")
    p.add_argument("--configs", nargs="+", default=None,
                   help="forced DecodeConfig entries to sweep (kernels/generate_kernels.py's DECODE_TRAITS; default "
                        "Deep Deep4 Shallow; ours-fp8kv: auto only, its kernel has configs of its own)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each times every candidate)")
    p.add_argument("--per-round", type=int, default=3, help="graph replays timed per candidate and round")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from llm_attn import _plan
    from llm_attn._ext import get_ext
    from llm_attn.envinfo import environment
    from llm_attn.harness.kernel_bench import DTYPES, _graphed, _inputs, make_fn, time_cuda
    from llm_attn.ops import force_decode

    if args.configs is None:
        args.configs = ["auto"] if args.impl == "ours-fp8kv" else ["Deep", "Deep4", "Shallow"]
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    bad = [c for c in args.configs if c != "auto" and c not in _plan.DECODE_CONFIG_IDS]
    if bad:
        p.error(f"unknown configs {bad}; known: {sorted(_plan.DECODE_CONFIG_IDS)}")
    ext = get_ext()
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    results = []
    for dt in args.dtypes:
        dtype = DTYPES[dt]
        for b in args.batch:
            for kv in args.kv:
                results.append(_shape(torch, ext, args, rng, dtype, dt, b, kv, num_sms, _inputs, make_fn, time_cuda,
                                      _graphed, force_decode))
                _print_row(results[-1])
                torch.cuda.empty_cache()
    wall = time.perf_counter() - t_start
    _print_tables(results, args.configs)
    print(f"\n{len(results)} shapes in {wall:.0f} s on {props.name} ({num_sms} SMs)")
    doc = dict(env=environment(), command="python experiments/decode_splits.py " + " ".join(sys.argv[1:] if argv is None else argv),
               device=props.name, num_sms=num_sms, wall_s=wall, rows=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def _shape(torch, ext, args, rng, dtype, dt, b, kv, num_sms, _inputs, make_fn, time_cuda, _graphed, force_decode):
    sq = args.q_len
    elem = torch.finfo(dtype).bits // 8
    per_set = (b * HEADS * sq * HEAD_DIM + 2 * b * KV_HEADS * kv * HEAD_DIM) * elem
    sets = max(2, min(12, math.ceil(400e6 / per_set)))  # rotate through > 8x the 50 MB L2
    data = _inputs(b, HEADS, KV_HEADS, sq, kv, HEAD_DIM, dtype, sets)
    kv_bytes = 2 * b * KV_HEADS * kv * HEAD_DIM * elem
    n_tiles = math.ceil(kv / 64)
    # What our kernel reads: the FP8 cache's bytes and its float32 scales (one K and one V per 64-token block).
    ours_bytes = (2 * b * KV_HEADS * kv * HEAD_DIM + 2 * 4 * b * KV_HEADS * n_tiles if args.impl == "ours-fp8kv"
                  else kv_bytes)
    pairs = b * KV_HEADS
    heuristic = int(ext.num_splits(b, HEADS, KV_HEADS, sq, kv, HEAD_DIM, num_sms))
    pred_s, pred_us = predicted_splits(b, KV_HEADS, kv, num_sms)

    # Reference output (SDPA flash) and the graph size from the automatic choice's time.
    ref_fn, _ = make_fn("flash", *data[0], False)
    ref = ref_fn().float()
    auto_fns = [make_fn(args.impl, q, k, v, False)[0] for q, k, v in data]
    est = min(time_cuda(auto_fns, 2, 3))
    calls = max(1, min(20, int(2.0 / max(est, 1e-3))))

    cands = [dict(kind="ours", config="auto", splits=0, splits_eff=effective_splits(n_tiles, heuristic))]
    for cfg in args.configs:
        for s in candidates(n_tiles, pairs, num_sms, heuristic, pred_s):
            cands.append(dict(kind="ours", config=cfg, splits=s, splits_eff=s))
    cands += [dict(kind="cudnn"), dict(kind="flash")]
    for c in cands:
        try:
            if c["kind"] == "ours":
                fns = [make_fn(args.impl, q, k, v, False)[0] for q, k, v in data]
                with force_decode(c["splits"], c["config"]):
                    out = fns[0]()
                    c["max_abs_diff"] = (out.float() - ref).abs().max().item()
                    c["replay"] = _graphed([fns[i % len(fns)] for i in range(calls)])
                c["keep"] = fns  # a graph holds no reference: ours-fp8kv's callables own the caches its replays read
            else:
                fns, note = zip(*(make_fn(c["kind"], q, k, v, False) for q, k, v in data))
                c["note"] = note[0]
                c["max_abs_diff"] = (fns[0]().float() - ref).abs().max().item()
                c["replay"] = _graphed([fns[i % len(fns)] for i in range(calls)])
            c["samples_ms"] = []
        except Exception as e:  # noqa: BLE001 (e.g. a config that needs more shared memory than this GPU has)
            c["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            torch.cuda.synchronize()
    live = [c for c in cands if "replay" in c]
    for r in range(args.rounds):
        rng.shuffle(live)
        for c in live:
            samples = time_cuda([c["replay"]], 1 if r == 0 else 0, args.per_round)
            c["samples_ms"] += [x / calls for x in samples]
    for c in cands:
        c.pop("replay", None)
        c.pop("keep", None)
        if c.get("samples_ms"):
            c["ms"] = statistics.median(c["samples_ms"])
            c["gbps"] = (ours_bytes if c["kind"] == "ours" else kv_bytes) / c["ms"] / 1e6
    ours = [c for c in cands if c["kind"] == "ours" and "gbps" in c and c["max_abs_diff"] < 2e-2]
    wrong = [(c["config"], c["splits"], c["max_abs_diff"]) for c in cands
             if c["kind"] == "ours" and c.get("max_abs_diff", 0) >= 2e-2]
    forced = [c for c in ours if c["config"] != "auto"]
    best = max(forced or ours, key=lambda c: c["gbps"]) if ours else {}
    auto = next((c for c in cands if c["kind"] == "ours" and c["config"] == "auto"), {})
    deep_pred = next((c for c in cands if c.get("config") == "Deep" and c.get("splits") == pred_s), {})
    by_kind = {c["kind"]: c for c in cands if c["kind"] != "ours"}
    return dict(impl=args.impl, dtype=dt, batch=b, kv_len=kv, q_len=sq, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                n_tiles=n_tiles, sets=sets, calls_per_graph=calls, heuristic_splits=heuristic,
                predicted_splits=pred_s, predicted_us=pred_us,
                best=dict(config=best.get("config"), splits=best.get("splits"), gbps=best.get("gbps"), ms=best.get("ms")),
                heuristic=dict(gbps=auto.get("gbps"), ms=auto.get("ms")),
                predicted=dict(gbps=deep_pred.get("gbps"), ms=deep_pred.get("ms")),
                cudnn=dict(gbps=by_kind["cudnn"].get("gbps"), note=by_kind["cudnn"].get("note"),
                           error=by_kind["cudnn"].get("error")),
                flash=dict(gbps=by_kind["flash"].get("gbps"), error=by_kind["flash"].get("error")),
                wrong_outputs=wrong, candidates=cands)


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def _ratio(x, ref):
    """GB/s over the reference's GB/s (> 1 = faster), llm_attn.harness.stats.speed_ratio."""
    from llm_attn.harness.stats import speed_ratio

    return _f(speed_ratio(ref, x, throughput=True), "{:.2f}")


def _print_row(r):
    b, h = r["best"], r["heuristic"]
    print(f"{r['dtype']} B={r['batch']} KV={r['kv_len']}: best {b['config']}/{b['splits']} {_f(b['gbps'])} GB/s, "
          f"heuristic {r['heuristic_splits']} {_f(h['gbps'])}, cuDNN {_f(r['cudnn']['gbps'])}, "
          f"flash {_f(r['flash']['gbps'])}" + (f"  WRONG OUTPUT {r['wrong_outputs']}" if r["wrong_outputs"] else ""),
          flush=True)


def _print_tables(results, configs):
    print("\nGB/s of the K/V bytes read once (ours-fp8kv: its e4m3 bytes and scales; cuDNN, flash: fp16/bf16) "
          "(median of the interleaved samples); best = fastest forced (config/splits); "
          "x/cuDNN = GB/s ratio (>1 = faster than cuDNN)")
    print(f"{'dtype':5} {'B':>3} {'KV':>6} | {'best':>11} {'GB/s':>6} | {'heur':>4} {'GB/s':>6} | {'pred':>4} "
          f"{'GB/s':>6} | {'cuDNN':>6} {'flash':>6} | {'best/cuDNN':>10} {'heur/cuDNN':>10}")
    for r in results:
        b, h, pr, cu = r["best"], r["heuristic"], r["predicted"], r["cudnn"]["gbps"]
        print(f"{r['dtype']:5} {r['batch']:>3} {r['kv_len']:>6} | {str(b['config']) + '/' + str(b['splits']):>11} "
              f"{_f(b['gbps']):>6} | {r['heuristic_splits']:>4} {_f(h['gbps']):>6} | {r['predicted_splits']:>4} "
              f"{_f(pr['gbps']):>6} | {_f(cu):>6} {_f(r['flash']['gbps']):>6} | {_ratio(b['gbps'], cu):>10} "
              f"{_ratio(h['gbps'], cu):>10}")
    print("\nper config: best splits:GB/s (and the GB/s at the heuristic's effective split count)")
    print(f"{'dtype':5} {'B':>3} {'KV':>6} | " + " | ".join(f"{c:>18}" for c in configs))
    for r in results:
        cells = []
        for cfg in configs:
            mine = [c for c in r["candidates"] if c.get("config") == cfg and "gbps" in c]
            if not mine:
                err = next((c.get("error") for c in r["candidates"] if c.get("config") == cfg), None)
                cells.append(f"{'error' if err else '-':>18}")
                continue
            top = max(mine, key=lambda c: c["gbps"])
            at_h = next((c["gbps"] for c in mine if c["splits"] == effective_splits(r["n_tiles"], r["heuristic_splits"])),
                        None)
            cells.append(f"{str(top['splits']) + ':' + _f(top['gbps']) + ' (' + _f(at_h) + ')':>18}")
        print(f"{r['dtype']:5} {r['batch']:>3} {r['kv_len']:>6} | " + " | ".join(cells))


if __name__ == "__main__":
    sys.exit(main())

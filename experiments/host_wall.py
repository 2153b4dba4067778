"""A decode call timed as a user's script times it (issue 38 item 5), in one warm process, interleaved: for each
path, N back-to-back calls under ``torch.inference_mode()``, wall time to a final synchronize, µs per call; R rounds
in a shuffled order each; medians and the paired ratio to torch SDPA (its µs / the path's, > 1 = cheaper).

    python experiments/host_wall.py --dtypes fp16 bf16 --out $OUT/host_wall.json

The paths are ``llm_attn.harness.hostcost``'s (``python -m llm_attn.bench --mode host`` times the same calls
enqueue-only; ``--user-timing`` in fresh processes, ~10 s each). Shape: B=1, 32/8 heads, hd128, KV 4096, one query.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from llm_attn.harness.hostcost import DECODE, _paths
from llm_attn.harness.kernel_bench import DTYPES
from llm_attn.harness.stats import paired_ratio_interval


def wall_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_wall.py: needs a CUDA GPU")
    device, order, rows = torch.device("cuda"), random.Random(0), []
    for name in args.dtypes:
        with torch.inference_mode():
            model, _, _, paths = _paths(DECODE, device, DTYPES[name])  # model: kept alive while its paths run
            for fn in paths.values():  # warm-up: kernel load, plan caches
                wall_us(fn, 20)
            samples = {p: [] for p in paths}
            for _ in range(args.rounds):
                for p in order.sample(list(paths), len(paths)):
                    samples[p].append(wall_us(paths[p], args.calls))
        ref = samples["torch SDPA"]
        print(f"{name}: wall µs per call (median of {args.rounds} rounds of {args.calls}), torch SDPA's / this path's")
        for p, s in samples.items():
            ratio = paired_ratio_interval(ref, s)
            rows.append(dict(dtype=name, path=p, wall_us=statistics.median(s), samples_us=s, vs_sdpa=ratio))
            print(f"  {p:36s} {statistics.median(s):7.1f}  {ratio['ratio']:.3f}x [{ratio['low']:.3f}, "
                  f"{ratio['high']:.3f}]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

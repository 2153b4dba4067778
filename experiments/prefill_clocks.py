"""The GPU's clock and power while prefills run: is a long prefill power-limited, and at what SM clock?

    python experiments/prefill_clocks.py --seq 65536 --impl sdpa llm_attn_fp8_e4m3
    python experiments/prefill_clocks.py --seq 65536 --impl sdpa llm_attn_fp8 --alone fp8 --csv smi.csv

nvidia-smi samples the SM clock, the board power and the active clock-event (throttle) reasons every
``--period-ms`` while, per implementation in turn (``--rounds`` times), the default model (on a GPU the synthetic
Llama 3 8B AWQ) patched with it prefills ``--seq`` tokens once, after one untimed prefill and a one-second pause.
``--alone fp8|int8|native`` then times our kernel's call alone on N(0, 1) inputs of the model's attention shape
(B=1, 32/8 heads, head_dim 128, causal): ``--calls`` back to back, and 8 calls 0.3 s apart. The table gives, per
phase, its time, the mean / min / max SM clock, the mean / max power and the reasons seen (0x4: the software power
cap; nvidia-smi --help-query-gpu lists the bits). Kernel benchmarks time a few back-to-back calls; a prefill of
seconds runs at whatever clock the power limit leaves (kernels/NOTES.md "The FP8 kernel inside the 64k prefill").
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from tabulate import tabulate

QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def read_samples(path: str) -> list[tuple[float, float, float, str]]:
    rows = []
    with open(path) as f:
        for line in f:
            p = [x.strip() for x in line.split(",")]
            try:
                t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((t, float(p[1]), float(p[2]), p[3]))
            except (ValueError, IndexError):  # a partial last line, or [N/A]
                continue
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/prefill_clocks.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="auto")
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--impl", nargs="+", default=["sdpa", "llm_attn_fp8_e4m3"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--alone", choices=["fp8", "int8", "native"], default=None)
    p.add_argument("--calls", type=int, default=80)
    p.add_argument("--period-ms", type=int, default=50)
    p.add_argument("--csv", default=None, help="keep nvidia-smi's samples here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        p.error("needs an NVIDIA GPU and nvidia-smi")
    if args.seq <= 0 or args.rounds <= 0 or args.calls <= 0:
        p.error("--seq, --rounds and --calls must be positive")

    from llm_attn.harness.measure import prefill_first_token
    from llm_attn.models import load_model
    from llm_attn.ops import flash_attn_func
    from llm_attn.patches import patch_model, unpatch_model

    csv = args.csv or tempfile.mkstemp(suffix=".csv")[1]
    with open(csv, "w") as out:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms",
                                str(args.period_ms)], stdout=out)
    phases = []  # (name, t0, t1, ms)

    def timed(name, fn):
        torch.cuda.synchronize()
        t0 = time.time()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        phases.append((name, t0, time.time(), a.elapsed_time(b)))

    try:
        model, info = load_model(args.model, device="cuda", dtype=torch.float16)
        ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
        ids = ids.cuda()
        with torch.inference_mode():
            for r in range(args.rounds):
                for impl in args.impl:
                    unpatch_model(model)
                    if impl != "sdpa":
                        patch_model(model, impl=impl)
                    prefill_first_token(model, ids)
                    time.sleep(1.0)
                    timed(f"prefill {args.seq}, {impl} (round {r + 1})", lambda: prefill_first_token(model, ids))
        del model
        torch.cuda.empty_cache()
        if args.alone:
            shape = (1, args.seq, 32, 128)
            q = torch.randn(*shape, device="cuda", dtype=torch.float16).transpose(1, 2)
            k, v = (torch.randn(1, args.seq, 8, 128, device="cuda", dtype=torch.float16).transpose(1, 2)
                    for _ in range(2))
            call = lambda: flash_attn_func(q, k, v, causal=True, precision=args.alone)  # noqa: E731
            with torch.inference_mode():
                call()
                time.sleep(1.0)
                timed(f"{args.alone} call alone, {args.calls} back to back", lambda: [call() for _ in range(args.calls)])
                phases[-1] = (*phases[-1][:3], phases[-1][3] / args.calls)
                spaced = []
                t0 = time.time()
                for _ in range(8):
                    time.sleep(0.3)
                    timed("", call)
                    spaced.append(phases.pop())
                phases.append((f"{args.alone} call alone, 8 calls 0.3 s apart", t0, time.time(),
                               sum(s[3] for s in spaced) / len(spaced)))
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()

    samples = read_samples(csv)
    table = []
    for name, t0, t1, ms in phases:
        sel = [s for s in samples if t0 <= s[0] <= t1]
        if not sel:
            table.append([name, f"{ms:.1f}", "", "", "", "no sample"])
            continue
        clk, pw = [s[1] for s in sel], [s[2] for s in sel]
        table.append([name, f"{ms:.1f}", f"{sum(clk) / len(clk):.0f} ({min(clk):.0f}-{max(clk):.0f})",
                      f"{sum(pw) / len(pw):.0f} ({max(pw):.0f})", len(sel), " ".join(sorted({s[3] for s in sel}))])
    print(tabulate(table, headers=["phase", "ms (a call, for 'alone')", "SM MHz mean (min-max)", "W mean (max)",
                                   "samples", "clock-event reasons"], tablefmt="github"))
    if args.csv:
        print(f"samples: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the NVRTC backend costs against the compiled (AOT) extension, on the GPU that is present.

    python experiments/nvrtc_bench.py                       # everything; the AOT columns say "absent" without it
    python experiments/nvrtc_bench.py --compile all         # cold compile of every instantiation, not just the needed
    python experiments/nvrtc_bench.py --out runs/nvrtc.json # also write the numbers as JSON

Five tables:
 1. cold compile: NVRTC compile time of each instantiation a default `python -m llm_attn.ttft --seq 2048` run needs
    (Llama 3 8B geometry: 32 query / 8 KV heads, head_dim 128, fp16; causal prefill of --seq tokens, then decode
    over --seq+1 .. --seq+32 keys), and their sum = what a first run pays once, on this CPU, for this GPU's arch;
    with --compile all, every instantiation (registers and local memory from ptxas as well);
 2. warm cache: loading the same from the disk cache (read + cuModuleLoadData + cuModuleGetFunction), and the
    first calls of a new process with an empty cache, a warm cache, and the AOT extension;
 3. CPU time per call: host time of N back-to-back calls without synchronisation (flash_attn_func, the public op,
    and the raw mha_fwd), AOT vs NVRTC;
 4. kernel time: the same shapes, CUDA-graph timed (a graph of 20 calls replayed, median over repeats), the prefill
    tile forced to "large" (--tile: another, e.g. hopper) on both sides so the same source runs (the decode kernel has no tile choice). NVRTC's
    cubin is not nvcc's (NVRTC computes shared-memory addresses in 64 bits: a few more registers), so this is
    where a difference would show.
Cold compiles go to a temporary cache (the user's cache is neither read nor changed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from llm_attn import _ext, _nvrtc, _plan, flash_attn_func  # noqa: E402
from llm_attn.ops import force_tile  # noqa: E402
from llm_attn.harness.graphs import graph_capture

HQ, HKV, D = 32, 8, 128  # Llama 3 8B


def short(kernel: str) -> str:
    return (kernel.replace("llm_attn::", "").replace("__nv_bfloat16", "bf16").replace("half", "fp16")
            .replace("flash_", "").replace("FwdTraits", "T").replace("DecodeTraits", "DT"))


def needed_kernels(seq: int, new_tokens: int, dev: _plan.Device) -> dict[str, int]:
    """{instantiation: dynamic smem bytes} that the default ttft run launches on this device."""
    shapes = [_plan.Shape(1, HQ, HKV, seq, seq, D, True, False)]
    shapes += [_plan.Shape(1, HQ, HKV, 1, seq + i, D, True, False) for i in range(1, new_tokens + 1)]
    return {launch.kernel: launch.smem for s in shapes for launch in _plan.plan(s, dev).launches}


def cold_compile(arch: str, kernels: list[str]) -> list[dict]:
    rows = []
    for k in kernels:
        t0 = time.perf_counter()
        cubin, lowered, log = _nvrtc.compile_cubin(_nvrtc.kernel_arch(arch, k), [k])  # Hopper kernel: sm_90a
        dt = time.perf_counter() - t0
        lm = _nvrtc.local_memory_report(log).get(lowered[k], (0, 0, 0))
        regs = [int(line.split("Used ")[1].split()[0]) for line in log.splitlines() if "Used " in line and " registers" in line]
        rows.append({"kernel": k, "seconds": dt, "cubin_kb": len(cubin) / 1024, "regs": regs[0] if regs else None,
                     "stack_spill_st_ld": lm})
    return rows


def warm_load(index: int, kernels: dict[str, int]) -> list[dict]:
    """Disk cache -> CUfunction, as a new process would (the in-process function table emptied first)."""
    rows = []
    for k, smem in kernels.items():
        _nvrtc._functions.pop((index, k), None)
        t0 = time.perf_counter()
        _nvrtc._function(index, k, smem)
        rows.append({"kernel": k, "seconds": time.perf_counter() - t0,
                     "source": _nvrtc.compile_stats.get((_nvrtc.kernel_arch(device_arch(index), k), k), {}).get("source")})
    return rows


FIRST_CALL = """
import json, sys, time
t_start = time.perf_counter()
import torch
from llm_attn import flash_attn_func, kernel_backend
q = torch.randn(1, 32, {seq}, 128, device="cuda", dtype=torch.float16)
k = torch.randn(1, 8, {seq}, 128, device="cuda", dtype=torch.float16)
qd = q[:, :, :1].contiguous()
torch.cuda.synchronize()
ts = time.perf_counter()
x = torch.randn(1, 1, 4, 64)
flash_attn_func(x, x, x)  # the custom op's one-time setup (torch.library imports torch._dynamo), on the CPU
t0 = time.perf_counter()
flash_attn_func(q, k, k, causal=True)
torch.cuda.synchronize()
t1 = time.perf_counter()
flash_attn_func(qd, k, k, causal=True)
torch.cuda.synchronize()
t2 = time.perf_counter()
flash_attn_func(q, k, k, causal=True)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps(dict(backend=kernel_backend(), op_setup=t0 - ts, prefill=t1 - t0, decode=t2 - t1, again=t3 - t2)))
"""


def first_calls(backend: str, cache: str, seq: int) -> dict:
    """A new process: wall time of the op's one-time setup (a CPU call first), then of its first prefill call on the
    GPU, its first decode call, and a second prefill call."""
    env = {**os.environ, "LLM_ATTN_BACKEND": backend, "LLM_ATTN_CACHE": cache,
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", FIRST_CALL.format(seq=seq)], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def device_arch(index: int) -> str:
    return _nvrtc.device_info(index)[0]


def inputs(shape: str):
    g = torch.Generator(device="cuda").manual_seed(0)
    sq, sk = {"prefill-2048": (2048, 2048), "prefill-4096": (4096, 4096), "decode-8192": (1, 8192),
              "decode-2080": (1, 2080)}[shape]
    q = torch.randn(1, HQ, sq, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(1, HKV, sk, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(1, HKV, sk, D, device="cuda", dtype=torch.float16, generator=g)
    return q, k, v


def cpu_per_call(backend: str, q, k, v, n: int) -> dict:
    """Host microseconds per call for n calls in a row, no synchronisation inside the loop."""
    _ext.set_backend(backend)
    ext = _ext.get_ext()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    res = {}
    for name, fn in (("flash_attn_func", lambda: flash_attn_func(q, k, v, causal=True)),
                     ("raw mha_fwd", lambda: ext.mha_fwd(q, k, v, out, lse, None, 0.088, True))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples.append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        res[name] = min(samples)
    return res


def graph_time_ms(q, k, v, calls: int = 20, repeats: int = 15) -> float:
    fn = lambda: flash_attn_func(q, k, v, causal=True)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048, help="prompt length of the default ttft run (default 2048)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--compile", choices=["needed", "all"], default="needed",
                   help="cold-compile the instantiations the default run needs, or all of them")
    p.add_argument("--tile", choices=["large", "wide", "small", "hopper"], default="large",
                   help="prefill tile of the kernel-time table on both backends (default large; hopper: the sm_90a "
                        "kernel on a compute capability 9.0 GPU)")
    p.add_argument("--calls", type=int, default=200, help="calls per CPU-time sample (default 200)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()

    if not torch.cuda.is_available():
        print("nvrtc_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    status = _ext.backend_status()
    if status["nvrtc"] != "available":
        print(f"nvrtc_bench: the NVRTC backend is not available: {status['nvrtc']}", file=sys.stderr)
        return 2
    have_aot = status["aot"] == "available"
    index = torch.cuda.current_device()
    arch, dev = _nvrtc.device_info(index)
    results = {"gpu": torch.cuda.get_device_name(index), "arch": arch, "nvrtc": ".".join(map(str, _nvrtc.nvrtc_version())),
               "torch": torch.__version__, "aot": "present" if have_aot else f"absent ({status['aot']})"}
    print(f"GPU {results['gpu']} ({arch}), NVRTC {results['nvrtc']}, torch {torch.__version__}, "
          f"AOT extension: {results['aot']}\n")

    with tempfile.TemporaryDirectory() as cache:
        os.environ["LLM_ATTN_CACHE"] = cache
        # 1. cold compile
        needed = needed_kernels(args.seq, args.new_tokens, dev)
        kernels = list(needed) if args.compile == "needed" else _plan.all_kernels()
        cold = cold_compile(arch, kernels)
        results["cold"] = cold
        print(f"1. cold NVRTC compile, one instantiation per program ({arch}):")
        print(tabulate([[short(r["kernel"]), f"{r['seconds']:.2f}", r["regs"], "/".join(map(str, r["stack_spill_st_ld"])),
                         f"{r['cubin_kb']:.0f}", "yes" if r["kernel"] in needed else ""] for r in cold],
                       headers=["instantiation", "s", "regs", "stack/spill st/ld B", "cubin KB", "default run"]))
        need_s = sum(r["seconds"] for r in cold if r["kernel"] in needed)
        print(f"   default `llm_attn.ttft --seq {args.seq}` run needs {len(needed)} instantiation(s): {need_s:.2f} s "
              f"cold, once per (arch, NVRTC, source)" + (f"; all {len(cold)}: {sum(r['seconds'] for r in cold):.1f} s"
                                                       if args.compile == "all" else ""))
        results["cold_needed_seconds"] = need_s

        # 2. warm cache: fill the disk cache for the needed set, then load from it
        for k in needed:
            _nvrtc.get_cubin(_nvrtc.kernel_arch(arch, k), k)
        warm = warm_load(index, needed)
        results["warm"] = warm
        print("\n2. warm cache, in this process (disk cubin -> module -> function; the first load in a process also "
              "pays the driver's one-time module setup):")
        print(tabulate([[short(r["kernel"]), f"{r['seconds'] * 1e3:.1f}", r["source"]] for r in warm],
                       headers=["instantiation", "ms", "from"]))

        # 2b. what a new process pays on its first calls (prefill --seq, then decode), cold and warm cache
        first = {}
        with tempfile.TemporaryDirectory() as fresh:
            first["nvrtc, cold cache"] = first_calls("nvrtc", fresh, args.seq)
            first["nvrtc, warm cache"] = first_calls("nvrtc", fresh, args.seq)
        if have_aot:
            first["aot"] = first_calls("aot", cache, args.seq)
        results["first_calls"] = first
        print(f"\n2b. first calls in a new process, ms (the custom op's one-time setup, paid by a CPU call first; then "
              f"prefill {args.seq} causal, decode over {args.seq} keys, the prefill again):")
        print(tabulate([[name, *(f"{r[x] * 1e3:.1f}" if x in r else r.get("error", "") for x in
                                 ("op_setup", "prefill", "decode", "again"))] for name, r in first.items()],
                       headers=["process", "op setup", "first prefill", "first decode", "second prefill"]))

        # 3/4. CPU per call and kernel time, both backends
        backends = ["aot", "nvrtc"] if have_aot else ["nvrtc"]
        cpu_rows, gpu_rows = [], []
        prev = _ext.set_backend(None)
        try:
            for shape in ("decode-2080", "decode-8192", "prefill-2048", "prefill-4096"):
                q, k, v = inputs(shape)
                cpu = {b: cpu_per_call(b, q, k, v, args.calls if shape.startswith("decode") else 50) for b in backends}
                ms = {}
                for b in backends:
                    _ext.set_backend(b)
                    with force_tile(args.tile):
                        ms[b] = graph_time_ms(q, k, v)
                if have_aot:  # the same source on both sides: the outputs should agree to the bit or nearly
                    outs = {}
                    for b in backends:
                        _ext.set_backend(b)
                        with force_tile(args.tile):
                            outs[b] = flash_attn_func(q, k, v, causal=True)
                    diff = (outs["aot"].float() - outs["nvrtc"].float()).abs().max().item()
                else:
                    diff = None
                def col(d, b, fmt):
                    return fmt.format(d[b]) if b in d else "absent"
                cpu_rows.append([shape] + [col({b: cpu[b]["flash_attn_func"] for b in cpu}, b, "{:.1f}") for b in ("aot", "nvrtc")]
                                + [col({b: cpu[b]["raw mha_fwd"] for b in cpu}, b, "{:.1f}") for b in ("aot", "nvrtc")])
                gpu_rows.append([shape] + [col(ms, b, "{:.4f}") for b in ("aot", "nvrtc")]
                                + [f"{ms['nvrtc'] / ms['aot']:.3f}" if have_aot else "-",
                                   f"{diff:.2e}" if diff is not None else "-"])
                results.setdefault("per_shape", {})[shape] = {"cpu_us": cpu, "kernel_ms": ms, "max_abs_diff": diff}
        finally:
            _ext.set_backend(prev)
        print(f"\n3. CPU time per call, microseconds (min over 5 runs of N calls without sync; fp16, {HQ}/{HKV} heads, "
              f"head_dim {D}, causal):")
        print(tabulate(cpu_rows, headers=["shape", "op: aot", "op: nvrtc", "raw: aot", "raw: nvrtc"]))
        print("\n4. kernel time, ms per call (CUDA graph of 20 calls, median of 15; prefill tile forced "
              f"'{args.tile}'):")
        print(tabulate(gpu_rows, headers=["shape", "aot", "nvrtc", "nvrtc/aot", "max |aot - nvrtc|"]))
        if not have_aot:
            print("\n(AOT columns absent: build the extension, `python -m pip install --no-build-isolation -e .`, to compare)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

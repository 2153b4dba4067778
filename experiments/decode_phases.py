"""Where one split-KV decode call's time goes, phase by phase, on the fp16 and the FP8 cache (issue 38's 2.6 TB/s).

The kernel benchmark puts the FP8-cache decode's per-call intercept at ~12 us against the fp16 kernel's ~8 us
(kernels/NOTES.md "The FP8-cache decode at 32k under ncu's source counters"). This script times the phases of every
block of one call with %globaltimer stamps, in an instrumented copy of the package that it writes (the tree's kernels
are not changed), compiled through NVRTC:

    0 entry   1 the prologue issued and Q staged   2 the first tile in shared memory   3 the last tile done
    4 the warps merged and the split's partials written   5 counted (fence + atomic)   6 the last block's combine done

Per (cache, KV length) it prints the call's time in a CUDA graph (as `python -m llm_attn.bench --mode decode`) and,
over --reps eager calls, the medians over blocks of each phase, the launch ramp (last block's entry - first's) and
the stamped span (first entry to the last stamp): what the graph time holds beyond the span is launch and drain.

    python experiments/decode_phases.py --kv 8192 32768 131072        # GPU, cuda-python (the nvrtc extra)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SYMBOL = "g_llm_attn_phase"
SLOTS = 8                  # stamps per block: phases 0-6, then the SM id
MAX_BLOCKS = 8192

STAMP_HEADER = f"""
extern "C" {{ __device__ unsigned long long {SYMBOL}[{SLOTS * MAX_BLOCKS}]; }}
__device__ __forceinline__ void llm_attn_phase(int k) {{
    if (threadIdx.x == 0) {{
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        if (b < {MAX_BLOCKS}) {{
            {SYMBOL}[b * {SLOTS} + k] = t;
            if (k == 0) {{
                unsigned sm;
                asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
                {SYMBOL}[b * {SLOTS} + {SLOTS - 1}] = sm + 1;
            }}
        }}
    }}
}}
"""


def _insert(text: str, anchor: str, before: str = "", after: str = "") -> str:
    if text.count(anchor) != 1:
        raise SystemExit(f"decode_phases: anchor found {text.count(anchor)} times, not once: {anchor!r}")
    return text.replace(anchor, before + anchor + after)


def instrument(src: str, body_anchor: str, loop_anchor: str, sync_anchor: str) -> str:
    """The decode kernel's source with the phase stamps (both kernels share their loop and epilogue's shape)."""
    src = _insert(src, "namespace llm_attn {\n", after="#ifndef LLM_ATTN_PHASE_STAMPS\n#define LLM_ATTN_PHASE_STAMPS\n"
                  + STAMP_HEADER + "#endif\n")
    src = _insert(src, body_anchor, after="    llm_attn_phase(0);\n")
    src = _insert(src, loop_anchor, before="    llm_attn_phase(1);\n")
    src = _insert(src, sync_anchor, after="\n        if (i == 0) llm_attn_phase(2);")
    src = _insert(src, "    cp_async_wait<0>();\n    __syncthreads();  // all warps done with K/V",
                  before="    llm_attn_phase(3);\n")
    src = _insert(src, "    if (!split_out) return;\n", before="    __syncthreads();\n    llm_attn_phase(4);\n")
    src = _insert(src, "    if (!s_last) return;\n", before="    llm_attn_phase(5);\n")
    combine = "        combine_row<T, kHeadDim, kDecodeCombineBatch>(params, row_id, lane);\n    }\n"
    return _insert(src, combine, after="    __syncthreads();\n    llm_attn_phase(6);\n")


def make_copy(dst: Path) -> None:
    """The package, its kernels and patches under dst, the two decode kernels instrumented."""
    for name in ("llm_attn", "kernels", "patches"):
        shutil.copytree(ROOT / name, dst / name, symlinks=True,
                        ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "patches"))
    (dst / "llm_attn" / "patches").symlink_to("../patches")
    k = dst / "kernels"
    fp16 = (k / "flash_decode_kernel.cuh").read_text()
    (k / "flash_decode_kernel.cuh").write_text(instrument(
        fp16, "__device__ __forceinline__ void flash_decode_body(const FlashFwdParams& params) {\n",
        "    for (int i = 0; i < num_tiles; ++i) {\n",
        "        __syncthreads();  // tile i visible to all; everyone is done with the stage about to be refilled"))
    fp8 = (k / "flash_decode_fp8kv_kernel.cuh").read_text()
    (k / "flash_decode_fp8kv_kernel.cuh").write_text(instrument(
        fp8, "__device__ __forceinline__ void flash_decode_fp8kv_body(const FlashDecodeFp8KvParams& fp) {\n",
        "    for (int i = 0; i < loop_tiles; ++i) {\n",
        "        group_sync();  // tile i (and Q) visible to the group; it is done with the stage about to be refilled"))


class Stamps:
    """The stamp arrays of every module NVRTC loads in this process (each module has its own copy)."""

    def __init__(self):
        from llm_attn import _nvrtc

        self.driver = _nvrtc._driver()
        self.modules = []
        load = self.driver.cuModuleLoadData

        def recording_load(image):
            result = load(image)
            if int(result[0]) == 0:
                self.modules.append(result[1])
            return result

        self.driver.cuModuleLoadData = recording_load

    def _globals(self):
        for m in self.modules:
            err, ptr, size = self.driver.cuModuleGetGlobal(m, SYMBOL.encode())
            if int(err) == 0:
                yield ptr, size

    def clear(self):
        for ptr, size in self._globals():
            self.driver.cuMemsetD8(ptr, 0, size)

    def read(self):
        """The stamps of the one module whose kernel ran since clear(): (blocks, SLOTS) integers."""
        for ptr, size in self._globals():
            host = np.zeros(size // 8, dtype=np.uint64)
            self.driver.cuMemcpyDtoH(host.ctypes.data, ptr, size)  # an address, as _nvrtc passes one
            host = host.reshape(-1, SLOTS)
            used = host[:, 0] > 0
            if used.any():
                return host[: int(np.nonzero(used)[0][-1]) + 1].astype(np.int64)
        raise RuntimeError("no stamps: the instrumented kernel did not run (is LLM_ATTN_BUILD=nvrtc set?)")


def phase_rows(stamps, heads_x_batch: int) -> dict[str, float]:
    """Microseconds per phase (medians over blocks), the launch ramp and the stamped span, of one call; then where
    the tile loops end (from the first block's entry): deciles, blocks alone on their SM against blocks sharing one,
    and the later half of the splits against the earlier half (the grid is splits x KV heads x batch: block b is
    split b % splits)."""
    splits = max(len(stamps) // heads_x_batch, 1)
    split_of = np.arange(len(stamps)) % splits
    keep = stamps[:, 0] > 0
    s, split_of = stamps[keep], split_of[keep]
    t0 = s[:, 0].min()
    out = {"blocks": len(s), "SMs": len(set(s[:, SLOTS - 1].tolist()))}
    names = ["Q staged", "first tile", "tile loop", "merge + partials", "fence + count"]
    for k, name in enumerate(names):
        d = (s[:, k + 1] - s[:, k])[(s[:, k + 1] > 0) & (s[:, k] > 0)]
        out[name] = statistics.median(d.tolist()) / 1e3 if len(d) else float("nan")
    last = s[s[:, 6] > 0]
    out["combine (last blocks)"] = statistics.median((last[:, 6] - last[:, 5]).tolist()) / 1e3 if len(last) else 0.0
    out["entry ramp"] = (s[:, 0].max() - t0) / 1e3
    out["stamped span"] = (s[:, :7].max() - t0) / 1e3
    ends = s[:, :7].max(axis=1)
    out["last block's tile loop end - first's"] = (s[:, 3].max() - s[:, 3][s[:, 3] > 0].min()) / 1e3
    out["block time (median)"] = statistics.median((ends - s[:, 0]).tolist()) / 1e3
    done = s[:, 3] > 0
    loop_end = (s[:, 3] - t0) / 1e3
    for p in (10, 50, 90):
        out[f"tile loop end, p{p}"] = float(np.percentile(loop_end[done], p)) if done.any() else float("nan")
    sm = s[:, SLOTS - 1]
    alone = np.isin(sm, [x for x, n in zip(*np.unique(sm, return_counts=True)) if n == 1])
    for name, pick in (("alone on an SM", alone), ("sharing an SM", ~alone)):
        sel = done & pick
        out[f"tile loop end, blocks {name} ({int(sel.sum())})"] = (
            statistics.median(loop_end[sel].tolist()) if sel.any() else float("nan"))
    late, early = done & (split_of >= splits / 2), done & (split_of < splits / 2)
    out["tile loop end, later half of the splits - earlier"] = (
        statistics.median(loop_end[late].tolist()) - statistics.median(loop_end[early].tolist())
        if late.any() and early.any() else float("nan"))
    return out


def worker(args) -> None:
    import torch

    from llm_attn import kernel_backend
    from llm_attn.harness.kernel_bench import make_fn, time_cuda

    if kernel_backend() != "nvrtc":
        raise SystemExit(f"decode_phases: the worker runs on the NVRTC build, not {kernel_backend()!r}")
    stamps = Stamps()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    for kv in args.kv:
        q = torch.randn(args.batch, 32, 1, 128, device="cuda", dtype=dtype)
        k = torch.randn(args.batch, 8, kv, 128, device="cuda", dtype=dtype)
        v = torch.randn(args.batch, 8, kv, 128, device="cuda", dtype=dtype)
        for impl, label, elem in (("ours", "fp16 cache", 2), ("ours-fp8kv", "FP8 cache", 1)):
            fn, _ = make_fn(impl, q, k, v, True)
            fn()
            torch.cuda.synchronize()
            graph_us = statistics.median(time_cuda([fn], 5, 20, graph=True)) * 1e3
            rows = []
            for _ in range(args.reps):
                stamps.clear()
                fn()
                torch.cuda.synchronize()
                rows.append(phase_rows(stamps.read(), 8 * args.batch))
            gbs = 2 * args.batch * 8 * kv * 128 * elem / graph_us / 1e3
            print(f"\n## {label}, B={args.batch} 32/8 hd128 bf16, KV {kv}: graph {graph_us:.1f} us a call ({gbs:.0f} GB/s)"
                  f", {rows[0]['blocks']} blocks on {rows[0]['SMs']} SMs; medians of {args.reps} eager calls, us")
            for key in rows[0]:
                if key in ("blocks", "SMs"):
                    continue
                vals = [r[key] for r in rows]
                print(f"  {key:40s} {statistics.median(vals):8.2f}   (min {min(vals):.2f}, max {max(vals):.2f})")
            del fn
        del q, k, v
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--keep", type=Path, help="write the instrumented copy here (kept) instead of a temporary folder")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if any(k < 1 for k in args.kv) or args.batch < 1 or args.reps < 1:
        ap.error("--kv, --batch and --reps must be positive")
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="decode_phases_") as tmp:
        dst = args.keep or Path(tmp) / "copy"
        if dst.exists():
            ap.error(f"{dst} exists")
        make_copy(dst)
        env = dict(os.environ, PYTHONPATH=str(dst), LLM_ATTN_BUILD="nvrtc")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--batch", str(args.batch), "--reps",
               str(args.reps), "--kv", *map(str, args.kv)]
        sys.exit(subprocess.call(cmd, env=env, cwd=tmp))


if __name__ == "__main__":
    main()

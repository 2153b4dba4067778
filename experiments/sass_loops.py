"""A kernel's loops in SASS and what each one issues: the instruction count and opcode mix between a backward branch
and its target, per function of a cubin (or of any binary cuobjdump reads). A static reading, no GPU needed: how two
kernels' step loops compare (ours against FlashAttention-2's, kernels/NOTES.md "BP11"), or what a change did to one.

    nvcc -cubin -arch=sm_90 -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -o /tmp/b.cubin \
        kernels/flash_bwd_hdim64_bf16_noncausal.cu
    python experiments/sass_loops.py /tmp/b.cubin flash_bwd_dkdv_kernel --loops 2

cuobjdump comes with the CUDA toolkit; where the toolkit has none (nvcc alone), PyPI's `nvidia-cuda-cuobjdump`
wheel holds one (`nvidia/cu13/bin/cuobjdump` inside it). Counts are static: a loop's instructions under a branch it
skips (a mask, a tail) count as if they ran, and a loop nested in another is counted in both.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b(?:\.\S+)?\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


@dataclass(frozen=True)
class Loop:
    first: int  # index of the target instruction
    last: int   # index of the backward branch
    opcodes: Counter

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def opcode(text: str) -> str:
    """The opcode's base name: no predicate guard, no modifiers (`@!P0 LDSM.16.M88.4 R4, [R2]` -> `LDSM`)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {mangled name: [(address, instruction text), ...]} in address order."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function : " in line:
            current = line.split("Function : ", 1)[1].strip()
            out[current] = []
        elif current is not None and (m := _INSTR.match(line)):
            out[current].append((int(m.group(1), 16), m.group(2)))
    return out


def loops(instrs: list[tuple[int, str]]) -> list[Loop]:
    """Every backward branch's loop (target .. branch), largest first."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    spans = set()
    for i, (addr, text) in enumerate(instrs):
        m = _BRANCH_TARGET.search(text)
        if m and opcode(text) == "BRA" and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            spans.add((index[int(m.group(1), 16)], i))
    found = [Loop(a, b, Counter(opcode(t) for _, t in instrs[a:b + 1])) for a, b in spans]
    return sorted(found, key=lambda lp: (-lp.size, lp.first))


def describe(name: str, instrs: list[tuple[int, str]], n_loops: int, top: int = 18) -> str:
    lines = [f"{name}: {len(instrs)} instructions"]
    for lp in loops(instrs)[:n_loops]:
        mix = ", ".join(f"{k} {v}" for k, v in lp.opcodes.most_common(top))
        lines.append(f"  loop [{lp.first}, {lp.last}] {lp.size} instructions: {mix}")
    whole = Counter(opcode(t) for _, t in instrs)
    lines.append("  whole: " + ", ".join(f"{k} {v}" for k, v in whole.most_common(top)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="a cubin (or any file cuobjdump -sass reads)")
    ap.add_argument("function", help="a substring of the mangled function names to show")
    ap.add_argument("--loops", type=int, default=3, help="the largest loops shown per function")
    args = ap.parse_args(argv)
    if args.loops < 1:
        ap.error("--loops must be at least 1")
    tool = shutil.which("cuobjdump")
    if tool is None:
        ap.error("cuobjdump is not on PATH (CUDA toolkit, or PyPI's nvidia-cuda-cuobjdump wheel: nvidia/cu13/bin)")
    run = subprocess.run([tool, "-sass", args.binary], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"cuobjdump failed on {args.binary}: {run.stderr.strip()}", file=sys.stderr)
        return 2
    chosen = {k: v for k, v in functions(run.stdout).items() if args.function in k}
    if not chosen:
        print(f"no function of {args.binary} contains {args.function!r}", file=sys.stderr)
        return 2
    for name, instrs in chosen.items():
        print(describe(name, instrs, args.loops))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# SASS instruction counts per kernel: compiles every kernel translation unit with the flags of check_ptxas.sh and
# prints, per kernel symbol and arch, the number of SASS instructions (all, and without NOPs) and a hash of the
# instruction text (addresses stripped), so that a refactor can show "unchanged" or "fewer" kernel by kernel.
#   bash kernels/sass_counts.sh > before.tsv                 # archs from SASS_ARCHS, default "80 90 90a"
#   bash kernels/sass_counts.sh [KERNEL_DIR] > after.tsv     # a copy of kernels/ elsewhere (default: this folder)
#   bash kernels/sass_counts.sh --compare before.tsv after.tsv   # markdown table of the two
# Needs cuobjdump and nvdisasm: $CUOBJDUMP, or next to nvcc, or pip's nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm
# (nvidia/cu13/bin).
set -euo pipefail
if [ "${1:-}" = "--compare" ]; then
  python3 - "$2" "$3" <<'EOF'
import sys
def load(p):
    rows = {}
    for line in open(p):
        if line.startswith("#") or not line.strip():
            continue
        tu, arch, n, n_nonop, h, sym = line.rstrip("\n").split("\t")
        rows[(tu, arch, sym)] = (int(n), int(n_nonop), h)
    return rows
a, b = load(sys.argv[1]), load(sys.argv[2])
print("| TU | arch | kernel | before (non-NOP) | after (non-NOP) | SASS |")
print("|---|---|---|---|---|---|")
worse = 0
for k in sorted(set(a) | set(b)):
    x, y = a.get(k), b.get(k)
    if x and y:
        verdict = "identical" if x[2] == y[2] else ("fewer" if y[1] < x[1] else "same count" if y[1] == x[1] else "MORE")
        worse += verdict == "MORE"
    else:
        verdict = "only before" if x else "only after"
        worse += 1
    sym = k[2] if len(k[2]) < 70 else k[2][:67] + "..."
    print(f"| {k[0]} | {k[1]} | `{sym}` | {x[1] if x else '-'} | {y[1] if y else '-'} | {verdict} |")
sys.exit(1 if worse else 0)
EOF
  exit $?
fi
kdir=$(cd "${1:-$(dirname "$0")}" && pwd)
archs=${SASS_ARCHS:-"80 90 90a"}
jobs=${JOBS:-$(nproc)}
nvcc_bin=$(command -v nvcc)
co=${CUOBJDUMP:-}
for c in "$co" "$(dirname "$(readlink -f "$nvcc_bin")")/cuobjdump" /usr/local/cuda/bin/cuobjdump \
         "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13/bin/cuobjdump"))' 2>/dev/null)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then co=$c; break; fi
done
[ -x "$co" ] || { echo "cuobjdump not found (set CUOBJDUMP or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)" >&2; exit 2; }
export PATH="$(dirname "$co"):$PATH"  # cuobjdump -sass runs nvdisasm (pip's nvidia-cuda-nvdisasm puts it beside)
if [ -n "${SASS_OBJ_DIR:-}" ]; then out=$SASS_OBJ_DIR; mkdir -p "$out"; else out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; fi
gencode=()
for a in $archs; do gencode+=(-gencode "arch=compute_${a},code=sm_${a}"); done
for src in "$kdir"/*.cu; do
  [ -n "${SASS_REUSE:-}" ] && [ -f "$out/$(basename "$src" .cu).o" ] && continue
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
  name=$(basename "$src" .cu)
  nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr "${gencode[@]}" -c "$src" -o "$out/$name.o" \
    >"$out/$name.log" 2>&1 || touch "$out/failed" &
done
wait  # one wait for all (see check_ptxas.sh: per-PID waits break when PIDs wrap)
[ ! -e "$out/failed" ] || { rm -f "$out/failed"; cat "$out"/*.log >&2; exit 1; }
echo -e "#tu\tarch\tinstructions\tnon_nop\tsass_hash\tsymbol"
for o in "$out"/*.o; do
  tu=$(basename "$o" .o)
  for a in $archs; do
    "$co" -sass -arch "sm_$a" "$o" | python3 -c '
import hashlib, re, sys
tu, arch = sys.argv[1], sys.argv[2]
fn, lines, want = None, [], True
def flush():
    if fn is None:
        return
    ins = lines
    text = "\n".join(ins).encode()
    nonop = sum(1 for l in ins if not l.startswith("NOP"))
    print(f"{tu}\t{arch}\t{len(ins)}\t{nonop}\t{hashlib.sha1(text).hexdigest()[:12]}\t{fn}")
for line in sys.stdin:
    m = re.match(r"\s*code for (sm_\w+)", line)
    if m:  # -arch sm_90 also prints the sm_90a code: keep the requested one only
        flush(); fn, want = None, m.group(1) == "sm_" + arch
        continue
    m = re.match(r"\s*Function : (\S+)", line)
    if m:
        flush(); fn, lines = (m.group(1) if want else None), []
        continue
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*(/\*.*\*/)?\s*$", line)
    if m and fn is not None and m.group(1):
        lines.append(m.group(1).rstrip(" ;"))
flush()
' "$tu" "$a"
  done
done | sort

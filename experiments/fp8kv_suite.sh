#!/usr/bin/env bash
# The decode kernel over the FP8 KV cache (issue 38) on a GPU in one command: build (gpu_suite.sh's build step: a
# carried extension when its stamp matches), its GPU tests against float64 (printing the outlier-K cosines),
# compute-sanitizer memcheck/racecheck on a subset, the kernel benchmark (GB/s: ours on the FP8 cache in FP8 bytes,
# ours fp16, SDPA on the fp16 cache and on the FP8 cache's dequantised copy; CUDA graphs and plain calls), and
# --kv-cache fp8 through the harness (decode on the tiny and the default model). Logs to $OUT.
#   OUT=/tmp/out bash experiments/fp8kv_suite.sh [build] [test] [sanitize] [bench] [splits] [ttft]
# FP8KV_KV (cache lengths, default 8192 32768 131072), FP8KV_BATCH (default 1 4), FP8KV_REPEATS (default 20).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/llm_attn_out}; mkdir -p "$OUT"
steps=${*:-build test sanitize bench}
has() { [[ " $steps " == *" $1 "* ]]; }
has build && { bash experiments/gpu_suite.sh build || exit 1; }
[ -e llm_attn/patches ] || ln -s ../patches llm_attn/patches
if has test; then
  python3 -m pytest -q -s -p no:cacheprovider -rfEs tests/test_kv_cache_fp8_gpu.py 2>&1 | tee "$OUT/fp8kv_pytest.log" \
    | grep -E "cosine|passed|failed|error|SKIP" | tail -20
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-480} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x \
      -p no:cacheprovider tests/test_kv_cache_fp8_gpu.py -k "grid and (mqa or 2049) or splits or junk" \
      >"$OUT/fp8kv_sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/fp8kv_sanitize_$tool.log" | tail -1))"
  done
fi
if has bench; then
  # ours-fp8kv's and sdpa-fp8kv-copy's GB/s count FP8 bytes (K+V, one byte each); ours' and flash's fp16 bytes.
  python3 -m llm_attn.bench --mode decode --kv ${FP8KV_KV:-8192 32768 131072} --batch ${FP8KV_BATCH:-1 4} \
    --impls ours ours-fp8kv flash cudnn sdpa-fp8kv-copy --dtypes bf16 --graph 1 0 --repeats ${FP8KV_REPEATS:-20} \
    --out "$OUT/fp8kv_bench.jsonl" 2>&1 | tee "$OUT/fp8kv_bench.txt" | tail -30
fi
if has splits; then  # the first knob if ours-fp8kv is below 2.6 TB/s at B=1, 32k: more blocks per SM
  for s in 0 32 64; do
    python3 - "$s" <<'PY' 2>&1 | tee -a "$OUT/fp8kv_splits.txt"
import statistics, sys, torch
from llm_attn import ops
from llm_attn.harness.kernel_bench import _fp8_kv_fn, time_cuda
splits = int(sys.argv[1])
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
fn, _ = _fp8_kv_fn("ours-fp8kv", q, k, v, True)
with ops.force_decode(splits=splits):
    ms = statistics.median(time_cuda([fn], 5, 30, graph=True))
print(f"B=1 KV 32768 32/8 hd128 bf16, splits {splits or 'auto'}: {ms * 1e3:.1f} us, "
      f"{2 * 8 * 32768 * 128 / ms / 1e6:.0f} GB/s of FP8 bytes")
PY
  done
fi
if has ttft; then  # through the harness: decode on the FP8 cache, stock (dequantised copy) vs ours (the kernel)
  python3 -m llm_attn.ttft --model tiny --seq 2048 --kv-cache fp8 --measure decode_generate --new-tokens 32 \
    --out "$OUT/fp8kv_ttft.jsonl" 2>&1 | tail -12
  python3 -m llm_attn.ttft --seq 8192 32768 --kv-cache fp8 --measure ttft decode_generate --new-tokens 64 \
    --out "$OUT/fp8kv_ttft.jsonl" 2>&1 | tail -12
fi

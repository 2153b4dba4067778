#!/usr/bin/env bash
# The FP8 forward on a Hopper GPU in one command (issue 34): build (gpu_suite.sh's build step: carried extension
# when its stamp matches), the FP8 GPU tests, compute-sanitizer memcheck/racecheck/synccheck of its pipeline, the
# kernel benchmark (ours bf16, ours FP8 with its quantisation, SDPA cuDNN; CUDA graphs, interleaved) and the accuracy
# benchmark against float64. Logs to $OUT; a short table last.
#   OUT=/tmp/out bash experiments/fp8_suite.sh [build] [test] [sanitize] [bench] [accuracy]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/llm_attn_out}; mkdir -p "$OUT"
steps=${*:-build test sanitize bench accuracy}
has() { [[ " $steps " == *" $1 "* ]]; }
has build && { bash experiments/gpu_suite.sh build || exit 1; }
[ -e llm_attn/patches ] || ln -s ../patches llm_attn/patches
if has test; then
  python3 -m pytest -q -p no:cacheprovider -m full -rfE tests/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_pytest.log" | tail -15
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_shapes.py --fp8 \
      >"$OUT/fp8_sanitize_$tool.log" 2>&1; echo "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/fp8_sanitize_$tool.log" | tail -1))"
  done
fi
if has bench; then
  python3 -m llm_attn.bench --impls ours llm_attn_fp8 cudnn --seqs ${FP8_SEQS:-4096 8192 16384 32768} --causal 1 0 \
    --dtypes bf16 --graph 1 --repeats ${FP8_REPEATS:-10} --out "$OUT/fp8_bench.jsonl" 2>&1 | tee "$OUT/fp8_bench.txt" | tail -30
fi
if has accuracy; then
  python3 -m llm_attn.bench --mode accuracy ${ACC_ARGS:-} --out "$OUT/fp8_accuracy.jsonl" 2>&1 | tee "$OUT/fp8_accuracy.txt" | tail -30
fi

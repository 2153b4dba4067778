#!/usr/bin/env bash
# The low-precision forwards on a Hopper GPU in one command (issue 34; INT8 forced on the H100 as the proxy for sm_80-89): build (gpu_suite.sh's build step: carried extension
# when its stamp matches), the FP8 GPU tests, compute-sanitizer memcheck/racecheck/synccheck of its pipeline, the
# kernel benchmark (ours bf16, ours FP8 with its quantisation, SDPA cuDNN, cuDNN FP8 through JAX where installed; CUDA
# graphs, interleaved) and the accuracy
# benchmark against float64. Logs to $OUT; a short table last.
#   OUT=/tmp/out bash experiments/fp8_suite.sh [build] [test] [sanitize] [bench] [int8bench] [accuracy] [ncu]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/llm_attn_out}; mkdir -p "$OUT"
steps=${*:-build test sanitize bench accuracy}
has() { [[ " $steps " == *" $1 "* ]]; }
has build && { bash experiments/gpu_suite.sh build || exit 1; }
[ -e llm_attn/patches ] || ln -s ../patches llm_attn/patches
if has test; then
  python3 -m pytest -q -p no:cacheprovider -m full -rfE tests/test_low_precision_gpu.py 2>&1 | tee "$OUT/fp8_pytest.log" | tail -15
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
   for lowp in ${SANITIZE_PRECISIONS:-fp8 int8}; do
    timeout ${SANITIZE_TIMEOUT:-480} compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_shapes.py --$lowp \
      >"$OUT/sanitize_${lowp}_$tool.log" 2>&1; echo "compute-sanitizer $tool $lowp: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_${lowp}_$tool.log" | tail -1))"
   done
  done
fi
if has bench; then
  # llm_attn_fp8: the build's default key tile; ours-fp8-192 (ours-fp8-128): that tile forced, same run;
  # llm_attn_int8qk: P V in the input dtype (the same default tile)
  python3 -m llm_attn.bench --impls ${FP8_IMPLS:-ours llm_attn_fp8 ours-fp8-192 llm_attn_int8qk cudnn cudnn-fp8} --seqs ${FP8_SEQS:-4096 8192 16384 32768} --causal 1 0 \
    --dtypes bf16 --graph 1 --repeats ${FP8_REPEATS:-10} --out "$OUT/fp8_bench.jsonl" 2>&1 | tee "$OUT/fp8_bench.txt" | tail -30
fi
if has int8bench; then  # the portable INT8 kernel against the portable bf16 tiles (what sm_80-89 run) and cuDNN
  python3 -m llm_attn.bench --impls ours-large ours-wide llm_attn_int8 cudnn --seqs ${FP8_SEQS:-4096 8192 16384} \
    --causal 1 0 --dtypes bf16 --graph 1 --repeats ${FP8_REPEATS:-10} --out "$OUT/int8_bench.jsonl" 2>&1 | tee "$OUT/int8_bench.txt" | tail -12
fi
if has accuracy; then
  python3 -m llm_attn.bench --mode accuracy ${ACC_ARGS:-} --out "$OUT/fp8_accuracy.jsonl" 2>&1 | tee "$OUT/fp8_accuracy.txt" | tail -30
fi
if has ncu; then  # one FP8 launch at B=1, 32/8 heads, hd128, S=16384 causal (LLM_ATTN_FP8_BLOCK_N=192: that tile): speed of light, pipes, warp stalls
  ncu --clock-control none -k regex:flash_fwd_fp8_sm90 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats python3 -c "
import torch; from llm_attn import flash_attn_func
q = torch.randn(1, 32, 16384, 128, device='cuda', dtype=torch.bfloat16)
k = torch.randn(1, 8, 16384, 128, device='cuda', dtype=torch.bfloat16); v = torch.randn_like(k)
flash_attn_func(q, k, v, causal=True, precision='fp8'); torch.cuda.synchronize()" > "$OUT/fp8_ncu.txt" 2>&1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc|Stall|Warp Cycles Per Issued" "$OUT/fp8_ncu.txt" | head -20
fi

#!/usr/bin/env bash
# One GPU session in one command: build the extension (only when kernels/ changed), run the GPU tests, a
# compute-sanitizer memcheck on a few shapes, and the kernel benchmark. Logs and results go to $OUT.
#   OUT=/tmp/out bash experiments/gpu_suite.sh [readme] [build] [awq] [test] [full] [sanitize] [racecheck] [bench]
#                                              [bench_mha64] [decode] [ttft] [sweep] [profile] [ncu]
#                                              [host] [verdicts] [lora] [decode_splits] [decode_context] [decode_gap]
#                                              [probe] [durations]
# host: host µs per call (bench --mode host); verdicts: issue 18's targets on the default model (five fresh paired
# TTFT runs at 2048, graph vs eager TTFT with the kernels named, and the harness against experiments/ttft_probe.py);
# lora: examples/finetune_lora.py on the 8B-shaped model (needs datasets: carried in .whl/, installed by awq).
# test runs the whole kernel grid (pytest -m full) of ${PYTEST_ARGS:-tests/test_kernel_gpu.py}; full runs the whole
# suite with the whole grid (python -m pytest -q -m full tests), timed; readme runs the README's default (a subset).
# readme runs the README's two commands, read from README.md, in a clean copy of the tree, as a new user would
# (after awq when both are given, so that the default ttft model can load; README_PART=cmd1 or tests splits them
# over two calls; README_PYTEST_ADDOPTS adds pytest options to command 2, e.g. "--ignore-glob=tests/test_[a-o]*.py" to
# finish a run that a call's time limit cut; README_PART=tests_prebuilt: command 2 after command 1's install lines with the carried
# extension in place of command 1's build, or, on a machine still warm from a cmd1 call, the one that call built: an
# extension built for sm_90 and sm_90a is larger than what comes back through $OUT). awq installs gptqmodel and its
# source-only dependencies from .whl/ (carried; see llm_attn/models.py) into /tmp/site. Make .whl/ on a machine with
# PyPI: `pip download --no-deps -d .whl gptqmodel==7.5.0 pypcre==0.6.4 logbar==0.4.15 tokenicer==0.0.14
# device-smi==0.5.7 defuser==0.0.28` (for the lora and --prompts steps also `datasets==5.2.0 dill==0.4.1
# multiprocess==0.70.19 optimum==2.3.0`: peft refuses LoRA layers with gptqmodel but no optimum), then `pip wheel --no-deps --no-build-isolation -w .whl` each sdist but pypcre's
# (it compiles on the GPU machine) and delete those sdists; ttft runs `python -m llm_attn.ttft` with the defaults;
# sweep runs experiments/default.toml into experiments/results/ (copied to $OUT; make the report from it anywhere: it
# needs no GPU).
# The built extension and its source stamp are copied to $OUT so the next session can carry them instead of
# rebuilding (a stamp mismatch rebuilds).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/llm_attn_out}; mkdir -p "$OUT"
steps=${*:-build test sanitize bench}
has() { [[ " $steps " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
stamp=$(LC_ALL=C; cat kernels/*.cu kernels/*.cuh kernels/*.h kernels/*.cpp setup.py | sha256sum | cut -c1-16)
# Run from the source tree without installing: llm_attn.patches is the top-level patches/ folder (setup.py maps
# it when installed); a git-ignored link gives the same module path here.
[ -e llm_attn/patches ] || ln -s ../patches llm_attn/patches
if has build; then
  # An extension carried from an earlier call (`carry: [".carry"]`, .carry/_C.so.gz + .carry/_C.stamp) is used when
  # its stamp matches the sources.
  if [ -f .carry/_C.so.gz ] && [ "$(cat .carry/_C.stamp 2>/dev/null)" = "$stamp" ] && ! ls llm_attn/_C*.so >/dev/null 2>&1; then
    gunzip -c .carry/_C.so.gz > "llm_attn/_C$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
    cp .carry/_C.stamp llm_attn/_C.stamp
  fi
  if [ "$(cat llm_attn/_C.stamp 2>/dev/null)" != "$stamp" ] || ! ls llm_attn/_C*.so >/dev/null 2>&1; then
    rm -f llm_attn/_C*.so
    start=$(date +%s)
    LLM_ATTN_CUDA_ARCHS=${LLM_ATTN_CUDA_ARCHS:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
      python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
    echo "$stamp" > llm_attn/_C.stamp
    echo "built extension in $(( $(date +%s) - start )) s"
  else
    echo "extension up to date (stamp $stamp)"
  fi
  gzip -1 -c llm_attn/_C*.so > "$OUT/_C.so.gz"; cp llm_attn/_C.stamp "$OUT/"  # carried into the next session
fi
if has awq; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/*.whl \
    .whl/pypcre-*.tar.gz >"$OUT/awq_install.log" 2>&1 || { tail -30 "$OUT/awq_install.log"; exit 1; }
  awq_site=/tmp/site; export PYTHONPATH=$awq_site:$PYTHONPATH
  python3 -m llm_attn.models backends
fi
if has readme; then
  # A new user: a clean copy (no build outputs, no links), no PYTHONPATH but the awq step's /tmp/site (so the
  # default ttft model loads when `awq` ran before: give both), and the README's two commands as written there: the
  # first two lines of its first ```bash block that are not comments. Command 1 ends with `python -m llm_attn.ttft`,
  # whose default GPU model needs gptqmodel (the awq step); without it that run stops with its install hint.
  rm -rf /tmp/readme && mkdir -p /tmp/readme && tar --exclude=./build --exclude='./llm_attn/_C*' \
    --exclude=./llm_attn/patches --exclude=./.whl --exclude='*.egg-info' -cf - . | tar -xf - -C /tmp/readme
  # No LLM_ATTN_CUDA_ARCHS or MAX_JOBS: a new user sets neither (setup.py builds for the visible GPU).
  (cd /tmp/readme && unset LLM_ATTN_CUDA_ARCHS MAX_JOBS
   if [ -n "${awq_site:-}" ]; then export PYTHONPATH=$awq_site; else unset PYTHONPATH; fi
   cmds=$(awk '/^```bash/ {n++; next} n == 1 && /^```/ {exit} n == 1 && !/^[[:space:]]*#/ && NF' README.md | head -2)
   cmd1=$(sed -n 1p <<<"$cmds") cmd2=$(sed -n 2p <<<"$cmds")
   [ -n "$cmd2" ] || { echo "README: the first bash block has fewer than two commands"; exit 1; }
   # README_PART=tests: command 1's install lines only (its last `&& python -m llm_attn.ttft ...` cut off), then
   # command 2; README_PART=cmd1: command 1 alone. The two fit one device call each where both together (build,
   # the 8B run, the whole test command: ~10 min on an H200) do not; the default runs both as written.
   part=${README_PART:-all}
   if [ "$part" = tests ] || [ "$part" = tests_prebuilt ]; then
     cmd1=$(sed -E 's/ && python -m llm_attn\.ttft[^&]*$//' <<<"$cmd1")
     echo "README_PART=$part: command 1 without its ttft run"
   fi
   # README_PART=tests_prebuilt: the state command 1 leaves, without paying its build again in this call: the
   # extension carried in .carry (built from the same sources: the stamps must match) is put in place and command 1's
   # install lines run with LLM_ATTN_NO_CUDA=1 (setup.py then compiles nothing; everything else installs as written).
   # An extension too large to come back through $OUT: on a machine still warm from the cmd1 call, the copy that call
   # kept in /tmp/readme_C (its stamp beside it) serves instead.
   if [ "$part" = tests_prebuilt ]; then
     so="llm_attn/_C$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
     if [ "$(cat "$OLDPWD/.carry/_C.stamp" 2>/dev/null)" = "$stamp" ] && [ -f "$OLDPWD/.carry/_C.so.gz" ]; then
       gunzip -c "$OLDPWD/.carry/_C.so.gz" > "$so"
     elif [ "$(cat /tmp/readme_C/_C.stamp 2>/dev/null)" = "$stamp" ]; then
       cp /tmp/readme_C/_C*.so "$so"; echo "tests_prebuilt: the extension the cmd1 call built on this machine"
     else
       echo "tests_prebuilt: no extension of these sources (.carry/_C.so.gz + _C.stamp, or a cmd1 call's on this machine)"; exit 1
     fi
     export LLM_ATTN_NO_CUDA=1
   fi
   echo "README command 1 (python: $(command -v python), pip: $(command -v pip)): $cmd1"
   bash -c "$cmd1" >"$OUT/readme_cmd1.log" 2>&1 && rc=0 || rc=$?
   unset LLM_ATTN_NO_CUDA
   echo "README command 1: exit code $rc, kernel backend $(cd /tmp && python -c 'import llm_attn; print(llm_attn.kernel_backend())' 2>&1 | tail -1)"
   tail -$(( rc ? 30 : 8 )) "$OUT/readme_cmd1.log"
   # The extension command 1 built, for the next calls to carry (the same stamp as the build step's).
   if ls llm_attn/_C*.so >/dev/null 2>&1; then
     gzip -1 -c llm_attn/_C*.so > "$OUT/_C.so.gz"; echo "$stamp" > "$OUT/_C.stamp"
     if [ "$part" != tests_prebuilt ]; then rm -rf /tmp/readme_C && mkdir -p /tmp/readme_C && cp llm_attn/_C*.so /tmp/readme_C/ && echo "$stamp" > /tmp/readme_C/_C.stamp; fi
   fi
   [ "$part" = cmd1 ] && exit "$rc"
   echo "README command 2: $cmd2"
   start=$(date +%s)
   PYTEST_ADDOPTS="--durations=25 -rfE -v ${README_PYTEST_ADDOPTS:-}" LLM_ATTN_REQUIRE_BACKENDS=aot,nvrtc bash -c "$cmd2" 2>&1 | tee "$OUT/readme_pytest.log" | grep -v -E "PASSED|SKIPPED|^$" | tail -45
   echo "README command 2: $(( $(date +%s) - start )) s (must stay under 600)")
fi
if has test; then
  python3 -m pytest -q -p no:cacheprovider -m full ${PYTEST_ARGS:-tests/test_kernel_gpu.py} 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if has durations; then  # the README's test command in this tree, timed per test (what makes it slow on a GPU)
  start=$(date +%s)
  timeout -s INT ${DURATIONS_LIMIT:-420} python3 -m pytest -q -p no:cacheprovider --durations=60 -rfE tests 2>&1 \
    | tee "$OUT/pytest_durations.log" | grep -v -E "^\s*$" | tail -80
  echo "README test command in this tree: $(( $(date +%s) - start )) s"
fi
if has full; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider -m full --durations=15 tests 2>&1 | tee "$OUT/pytest_full.log" | tail -40
  echo "full suite with the whole kernel grid: $(( $(date +%s) - start )) s"
fi
if has sanitize; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/sanitize_shapes.py >"$OUT/sanitize.log" 2>&1
  echo "compute-sanitizer memcheck exit code $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitize.log") clean summaries)"
  tail -3 "$OUT/sanitize.log"
fi
if has racecheck; then  # the Hopper kernel's asynchronous pipeline: shared-memory races and barrier misuse
  for tool in racecheck synccheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_shapes.py --hopper \
      >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool exit code $? ($(grep -c -E 'ERROR SUMMARY: 0 errors|SUMMARY: 0 hazards' "$OUT/$tool.log") clean summaries)"
    tail -2 "$OUT/$tool.log"
  done
fi
if has bench; then
  python3 -m llm_attn.bench ${BENCH_ARGS:-} --out "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log" | grep -v "^dtype=" | tail -40
fi
if has bench_mha64; then  # the issue's batch-4 MHA head_dim-64 point
  python3 -m llm_attn.bench --head-dim 64 --heads 32 --kv-heads 32 --batch 4 --seqs 4096 --out "$OUT/bench.jsonl" 2>&1 \
    | tee -a "$OUT/bench.log" | grep -v "^dtype=" | tail -8
fi
if has ttft; then
  python3 -m llm_attn.ttft --seq ${TTFT_SEQ:-2048} ${TTFT_ARGS:-} --out "$OUT/ttft.jsonl" --no-progress 2>&1 \
    | tee "$OUT/ttft.log" | grep -v -E "Warning|warn" | tail -30
fi
if has sweep; then
  # Rows land under $OUT as they are measured, so a run cut short still brings back what it finished.
  python3 -m llm_attn.experiment experiments/${EXPERIMENT:-default}.toml --results-dir "$OUT/results" --no-progress \
    2>&1 | tee "$OUT/sweep.log" | grep -v -E "Warning|warn" | tail -30
fi
if has ncu; then  # what limits the kernels (clocks left as they are); one report file
  sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
  : >"$OUT/ncu.txt"
  for c in 0 1; do
    echo "##### prefill S=4096 bf16 causal=$c" >>"$OUT/ncu.txt"
    ncu --clock-control none -k regex:flash_fwd_kernel --launch-skip 3 --launch-count 1 $sections \
      python3 -m llm_attn.bench --seqs 4096 --dtypes bf16 --causal $c --impls ours --warmup 3 --repeats 1 --graph 0 \
      >>"$OUT/ncu.txt" 2>&1
  done
  echo "##### decode KV=8192 B=1 bf16" >>"$OUT/ncu.txt"
  ncu --clock-control none -k regex:flash_decode_kernel --launch-skip 3 --launch-count 1 $sections \
    python3 -m llm_attn.bench --mode decode --kv 8192 --dtypes bf16 --causal 1 --impls ours --warmup 3 --repeats 1 \
    --graph 0 >>"$OUT/ncu.txt" 2>&1
  grep -E "#####|Duration|Compute \(SM\) Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Shared Memory Throughput|Waves Per SM" "$OUT/ncu.txt"
fi
if has profile; then
  python3 experiments/profile_decode.py ${PROFILE_ARGS:-} 2>&1 | grep -v -E "Warning|warn" | tee "$OUT/profile.log" | grep -A45 "=="
fi
if has decode; then
  python3 -m llm_attn.bench --mode decode ${DECODE_ARGS:-} --out "$OUT/bench_decode.jsonl" 2>&1 | tee "$OUT/bench_decode.log" | grep -v "^dtype=" | tail -40
fi
if has decode_splits; then  # issue 19: every forced (tile, split count) per (B, KV) against cuDNN/flash; its heur column is the shipped rule
  timeout 300 python3 experiments/decode_splits.py --dtypes bf16 fp16 --out "$OUT/decode_splits.json" >"$OUT/decode_splits.txt" 2>&1
  echo "decode_splits exit $?"; sed -n '/^GB\/s of K+V/,/^per config/p' "$OUT/decode_splits.txt"; tail -2 "$OUT/decode_splits.txt"
fi
if has decode_gap; then  # issue 19: graph µs per decode call against ncu's kernel time, ours vs SDPA cuDNN/flash
  python3 experiments/decode_gap.py --out "$OUT/decode_gap.json" 2>&1 | grep -v -E "Warning|warn"
  ncu --clock-control none --nvtx --nvtx-include "decode_gap/" --print-units base --csv --page raw \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
    python3 experiments/decode_gap.py --ncu-pass >"$OUT/decode_gap_ncu.csv" 2>"$OUT/decode_gap_ncu.err"
  python3 experiments/decode_gap.py --parse-ncu "$OUT/decode_gap_ncu.csv" --timing "$OUT/decode_gap.json" \
    | tee "$OUT/decode_gap.md"
  for kv in 2048 8192; do  # what limits ours where it trails: stall reasons of the shipped split launch, B=1
    echo "##### decode B=1 KV=$kv bf16 (shipped split rule)" >>"$OUT/decode_gap_ncu_ours.txt"
    ncu --clock-control none -k regex:flash_decode_kernel --launch-count 1 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 experiments/decode_gap.py --ncu-pass --batch 1 --kv $kv >>"$OUT/decode_gap_ncu_ours.txt" 2>&1
  done
  grep -i -E "#####|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|stall|Warp Cycles Per Issued|Grid Size|Waves Per SM" \
    "$OUT/decode_gap_ncu_ours.txt" | head -60
fi
if has decode_context; then  # issue 19: decode tok/s (graph) of the default model with 2k, 8k and 32k tokens in the cache
  for ctx in 2048 8192 32768; do
    python3 -m llm_attn.ttft --seq 512 --impl sdpa llm_attn --measure decode_graph --context $ctx \
      --out "$OUT/decode_context_$ctx.jsonl" --no-progress 2>&1 | grep -E "^\| llama"
  done
fi
if has host; then
  python3 -m llm_attn.bench --mode host --dtypes fp16 bf16 --out "$OUT/host.jsonl" 2>&1 | tee "$OUT/host.log" | tail -14
fi
if has verdicts; then  # issue 18: stable verdicts, graph TTFT explained, agreement with an independent probe
  python3 experiments/ttft_stability.py --runs 5 --seq 2048 --out-dir "$OUT/stability" 2>&1 | tail -10
  python3 -m llm_attn.ttft --seq 2048 8192 16384 --impl sdpa llm_attn --measure ttft ttft_graph ttft_graph_static \
    --out "$OUT/graph.jsonl" --no-progress 2>&1 | grep -v -E "Warning|warn" | tail -20
  python3 experiments/ttft_probe.py --seq 2048 8192 --repeats 20 2>&1 | tail -5
fi
if has probe; then  # the independent TTFT probe with Python's GC off and on (the harness times with it off)
  python3 -m llm_attn.ttft --seq ${PROBE_SEQ:-2048} --impl sdpa llm_attn --measure ttft --out "$OUT/probe_harness.jsonl" \
    --no-progress 2>&1 | grep -E "^\| (model|llama)"
  for g in off on; do
    python3 experiments/ttft_probe.py --seq ${PROBE_SEQ:-2048} --repeats 20 --gc $g 2>&1 | grep -E "^\||gc"
  done
fi
if has lora; then  # issue 21: LoRA through the patch, 8B-shaped model at 2048 tokens, 20 steps, bf16
  python3 examples/finetune_lora.py --model llama-3-8b --seq 2048 --steps 20 --dtype bf16 \
    --json "$OUT/finetune_lora.json" --fail-above 1e-2 2>&1 | tail -8
fi
